"""RMSNorm variants of the Qwen3 family, with transformers' cast points.

nu(x) = x * 1/sqrt(mean(x^2) + eps), computed in float32 (or wider); eps inside the root, added to the mean.
In a float32 or float64 run the casts are no-ops; they matter for reduced-precision emulation, where `rnd`
(refimpl/precision.py) rounds to the emulated activation dtype at each cast. rnd defaults to the identity.
"""

import numpy as np

from . import products
from .activation import compute_dtype, identity, silu


def _normalized(x: np.ndarray, eps: float) -> np.ndarray:
    """nu(x) over the last axis, in at least float32.  [..., n] -> [..., n]"""
    x = x.astype(compute_dtype(x), copy=False)
    variance = products.sumprod(x, x, keepdims=True) / x.dtype.type(x.shape[-1])  # mean: sum correctly rounded
    return x * (1 / np.sqrt(variance + eps))  # torch's rsqrt on CPU is 1/sqrt



def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, *, zero_centered: bool = False, rnd=identity) -> np.ndarray:
    """RMSNorm over the last axis.  x [..., n], weight [n] -> [..., n] in x's dtype.

    plain (Qwen3, Qwen3-MoE):          cast(w * cast(nu(x)))    cast before the weight multiply, and after it
    zero-centred (Qwen3-Next / 3.5):   cast(nu(x) * (1 + w))    multiply in float32, cast after
    """
    n = _normalized(x, eps)
    if zero_centered:
        return rnd((n * (1 + weight.astype(n.dtype))).astype(x.dtype, copy=False))
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


def rms_norm_gated(x: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float, *, rnd=identity) -> np.ndarray:
    """Gated RMSNorm of the GDN output: norm first, then the plain weight, then * silu(gate).

    x, gate [..., n], weight [n] -> cast( cast(w * cast(nu(x))) * silu(float32(gate)) )
    """
    n = _normalized(x, eps)
    m = rnd(weight * rnd(n.astype(x.dtype, copy=False)))
    return rnd((m * silu(gate.astype(n.dtype, copy=False))).astype(x.dtype, copy=False))
