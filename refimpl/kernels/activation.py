"""Activations in their numerically stable forms."""

import math

import numpy as np


def identity(x):
    """The activation cast of float32 / float64 runs (kernels' `rnd=`; bf16 / fp16 emulation passes a rounding)."""
    return x


def compute_dtype(*arrays) -> np.dtype:
    """The dtype a kernel computes in: the inputs' result type, promoted to at least float32."""
    return np.result_type(np.float32, *[a.dtype for a in arrays])


def sigmoid(x: np.ndarray) -> np.ndarray:
    """sigmoid(x) = exp(min(x, 0)) / (1 + exp(-|x|))  (= 1/(1+e^-x) for x >= 0, e^x/(1+e^x) for x < 0):
    exp never sees a positive argument, and there is no per-element branch (np.where costs 2.7x here)."""
    return (np.exp(np.minimum(x, 0)) / (1 + np.exp(-np.abs(x)))).astype(x.dtype, copy=False)


def silu(x: np.ndarray) -> np.ndarray:
    """silu(x) = x * sigmoid(x) (torch computes x / (1 + exp(-x)); they agree to rounding)."""
    return x * sigmoid(x)


def softplus(x: np.ndarray, threshold: float = 20.0) -> np.ndarray:
    """torch's softplus (beta 1): x where x > threshold, else log1p(exp(x))."""
    return np.where(x > threshold, x, np.log1p(np.exp(np.minimum(x, threshold)))).astype(x.dtype, copy=False)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """softmax(x)_i = exp(x_i - max x) / sum_j exp(x_j - max x); computed in x's dtype."""
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


_erf = np.frompyfunc(math.erf, 1, 1)


def gelu(x: np.ndarray) -> np.ndarray:
    """Exact gelu(x) = x/2 * (1 + erf(x / sqrt 2)) (transformers' "gelu"); slow, for test configs only."""
    return (0.5 * x * (1 + _erf(x / math.sqrt(2)).astype(x.dtype))).astype(x.dtype)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """gelu with the tanh approximation (transformers' "gelu_new" / "gelu_pytorch_tanh")."""
    return (0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))).astype(x.dtype)


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
