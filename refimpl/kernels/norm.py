"""RMSNorm variants of the Qwen3 family, with transformers' cast points.

nu(x) = x * 1/sqrt(mean(x^2) + eps), computed in float32 (or wider); eps inside the root, added to the mean.
In a float32 or float64 run the casts are no-ops; they matter for reduced-precision emulation, where `rnd`
(refimpl/precision.py) rounds to the emulated activation dtype at each cast. rnd defaults to the identity.

Sub-op points (`at`, identity by default: kernels/activation.Unhooked), where a quantised device graph has a
tensor: x^2 (Pow, with its exponent 2; or Mul(x, x)), mean (ReduceMean), +eps (Add, with eps), sqrt, 1/sqrt
(Reciprocal; or Div with its 1), x*1/sqrt (Mul; or Div(x, sqrt)); 1+w (the zero-centred weight, a folded
constant). x^2 is formed only where a hook acts on it (else the mean is one correctly rounded sum of squares).
"""

import numpy as np

from . import products
from .activation import compute_dtype, identity, sigmoid, silu, unhooked


def _normalized(x: np.ndarray, eps: float, at=unhooked) -> np.ndarray:
    """nu(x) over the last axis, in at least float32.  [..., n] -> [..., n]"""
    x = x.astype(compute_dtype(x), copy=False)
    n = x.dtype.type(x.shape[-1])
    if "x^2" in at.points or "2" in at.points:
        e = at("2", x.dtype.type(2))
        square = at("x^2", x * x if e == 2 else x ** e)                          # x^2
        variance = at("mean", products.sum(square, keepdims=True) / n)          # mean(x^2)
    else:
        variance = at("mean", products.sumprod(x, x, keepdims=True) / n)        # mean(x^2): sum correctly rounded
    root = at("sqrt", np.sqrt(at("+eps", variance + at("eps", eps))))          # sqrt(mean + eps)
    if at.forms.get("x*1/sqrt") == "Div":                                    # the device's form: x / sqrt
        return at("x*1/sqrt", x / root)
    return at("x*1/sqrt", x * at("1/sqrt", at("1", x.dtype.type(1)) / root))   # torch's rsqrt on CPU is 1/sqrt



def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, *, zero_centered: bool = False, rnd=identity,
             at=unhooked) -> np.ndarray:
    """RMSNorm over the last axis.  x [..., n], weight [n] -> [..., n] in x's dtype.

    plain (Qwen3, Qwen3-MoE):          cast(w * cast(nu(x)))    cast before the weight multiply, and after it
    zero-centred (Qwen3-Next / 3.5):   cast(nu(x) * (1 + w))    multiply in float32, cast after
    """
    n = _normalized(x, eps, at)
    if zero_centered:
        return rnd((n * at("1+w", 1 + weight.astype(n.dtype))).astype(x.dtype, copy=False))
    return rnd((weight * rnd(n.astype(x.dtype, copy=False))).astype(x.dtype, copy=False))


def rms_norm_rounded(x: np.ndarray, weight: np.ndarray, eps: float, *, zero_centered: bool = False,
                     rnd=identity) -> np.ndarray:
    """RMSNorm as an fp16 NPU runs transformers' float32 norm (precision htp-fp16, docs/htp.md): each op rounded
    by rnd, the mean of squares accumulated wide and rounded once, 1/sqrt rounded once (the HTP's RMSNorm on AI
    Hub's Qwen3.5 graph: 76 % of elements bit-identical, the one-cast form 30 %).  x [..., n] -> [..., n]"""
    x = x.astype(compute_dtype(x), copy=False)
    ms = rnd(np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True).astype(x.dtype))   # mean(x^2)
    inv = rnd((1 / np.sqrt(rnd(ms + x.dtype.type(eps)).astype(np.float64))).astype(x.dtype))    # 1/sqrt(. + eps)
    w = rnd(1 + weight.astype(x.dtype)) if zero_centered else weight.astype(x.dtype)           # (1 + w) or w
    return rnd(rnd(x * inv) * w)                                                               # (x * 1/sqrt) w


def rms_norm_gated(x: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float, *, rnd=identity,
                   at=unhooked) -> np.ndarray:
    """Gated RMSNorm of the GDN output: norm first, then the plain weight, then * silu(gate).

    x, gate [..., n], weight [n] -> cast( cast(w * cast(nu(x))) * silu(float32(gate)) )
    Points besides the norm's: w*x (the weighted norm), silu(z) (and its sigmoid where a hook acts on it).
    """
    n = _normalized(x, eps, at)
    m = at("w*x", rnd(weight * rnd(n.astype(x.dtype, copy=False))))                # w nu(x)
    gate = gate.astype(n.dtype, copy=False)
    g = gate * at("sigmoid", sigmoid(gate)) if "sigmoid" in at.points else silu(gate)
    return rnd((m * at("silu(z)", g)).astype(x.dtype, copy=False))                 # w nu(x) silu(z)
