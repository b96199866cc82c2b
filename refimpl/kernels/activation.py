"""Activations, each correctly rounded in float32 (kernels/elementary.py: the same bits on every platform).

float64 inputs (the oracle mode) use NumPy's float64 functions.
"""

import numpy as np

from . import elementary, products
from .elementary import gelu, gelu_tanh, sigmoid, silu, softplus  # noqa: F401  (this module's public names)


def identity(x):
    """The activation cast of float32 / float64 runs (kernels' `rnd=`; bf16 / fp16 emulation passes a rounding)."""
    return x


class Unhooked:
    """A kernel's sub-op hook by default (kernels' `at=`, as `rnd=`): every named point of its equation passes its
    value on unchanged, and no point asks for a fused intermediate to be formed. A device's quantisers act through
    a hook with the same interface (refimpl/models/quantisers.py): `at(point, value) -> value`, and `points`, the
    points it acts on (a kernel computes a fused step, x^2 inside a sum or silu, op by op only where a hook acts
    on its intermediate: the float path keeps its correctly rounded fused form)."""
    points = frozenset()
    forms: dict = {}           # point -> the op of another declared form (graph.Point.also) the device computes

    def __call__(self, point: str, value):
        return value

    def operand(self, point: str, value) -> None:
        """The value an op reads at `point` after data movement (a table duplicated and broadcast): a device's hook
        computes that op on it; nothing here."""

    def operands(self, point: str, *values) -> None:
        """The values the op at `point` reads, in its inputs' order and as it broadcasts them (a per-token op of an
        unrolled loop: token t's slices): a device's hook computes that op on them; nothing here."""

    def select(self, **rows) -> None:
        """The rows the next ops read of their inputs (the MoE's expert: `expert` id, its `tokens` and their `slots`
        among the k; none: all rows again): a device's hook computes those ops on them; nothing here."""


unhooked = Unhooked()


def compute_dtype(*arrays) -> np.dtype:
    """The dtype a kernel computes in: the inputs' result type, promoted to at least float32."""
    return np.result_type(np.float32, *[a.dtype for a in arrays])


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """softmax(x)_i = e_i / sum_j e_j with e_j = exp(x_j - max x): each exp and the sum correctly rounded, the
    difference and the quotient IEEE float32 operations; computed in x's dtype."""
    if products.onnxruntime_cpu_active() and x.dtype == np.float32:
        return mlas_softmax(x, axis)
    e = elementary.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / products.sum(e, axis=axis, keepdims=True)


def mlas_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """ONNX Runtime's CPU Softmax (inside products.onnxruntime_cpu()), float32: e = its exp of x - max
    (elementary.mlas_softmax_exp), s = the e summed in adjacent pairs, halving (measured bit-identical to the
    runtime's sums over 8 and 32 keys / experts; odd widths not measured), p = e * fl32(1 / s)."""
    x = np.moveaxis(x, axis, -1)
    e = elementary.mlas_softmax_exp(x - np.max(x, axis=-1, keepdims=True))      # e_j
    s = e
    while s.shape[-1] > 1:                                                      # adjacent pairs, then theirs
        odd = s[..., -1:] if s.shape[-1] % 2 else s[..., :0]                    # an odd last one carried
        s = np.concatenate([s[..., 0:s.shape[-1] - 1:2] + s[..., 1::2], odd], axis=-1)
    return np.moveaxis(e * (np.float32(1) / s), -1, axis)


def relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0)


ACTIVATIONS = {
    "silu": silu,
    "swish": silu,
    "gelu": gelu,
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "relu": relu,
    "sigmoid": sigmoid,
}


def activate(kind: str, x: np.ndarray, *, at=unhooked) -> np.ndarray:
    """ACTIVATIONS[kind](x); silu as x * sigmoid(x), op by op (ONNX's Sigmoid, Mul), where a hook acts on the
    sigmoid.  [...] -> [...]"""
    if kind in ("silu", "swish") and "sigmoid" in at.points:
        return x * at("sigmoid", sigmoid(x))                                   # y = x * sigmoid(x)
    return ACTIVATIONS[kind](x)


def sigmoid_rounded(x: np.ndarray, rnd) -> np.ndarray:
    """sigmoid(x) = 1 / (1 + exp(-x)) with every op rounded by rnd (an fp16 NPU running the composition; the HTP's
    own Sigmoid kernel is an approximation refimpl does not state, docs/htp.md).  [...] -> [...]"""
    return rnd(1 / rnd(1 + rnd(elementary.exp(-x))))


def softplus_rounded(x: np.ndarray, rnd) -> np.ndarray:
    """softplus(x) = log(1 + exp(x)) with every op rounded by rnd (as sigmoid_rounded).  [...] -> [...]"""
    return rnd(elementary.log(rnd(1 + rnd(elementary.exp(x)))))
