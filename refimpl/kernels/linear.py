"""Projections and the embedding gather."""

import numpy as np


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """y = x W^T (+ b).  x [..., in], weight [out, in] (PyTorch layout), bias [out] -> [..., out].

    Leading axes are flattened so the product is one matrix multiply (one GEMM, or a GEMV for one row).
    """
    x2 = x.reshape(-1, x.shape[-1])
    y = weight @ x2[0] if x2.shape[0] == 1 else x2 @ weight.T
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def embedding(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Row gather: ids [B, T] int, table [V, H] -> [B, T, H]."""
    return table[ids]
