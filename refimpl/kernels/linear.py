"""Projections and the embedding gather."""

import numpy as np

from . import products


def linear(x: np.ndarray, weight, bias: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """y = x W^T (+ b).  x [..., in], weight [out, in] (PyTorch layout) or a products.Constant of W^T [in, out]
    (a weight with its error-bound norms made once: Weights.matrix), bias [out] -> [..., out]; written into `out`
    [prod(x.shape[:-1]), out] when given (a column block of a larger array will do).

    Each element is the correctly rounded sum of its products (kernels/products.py); leading axes are flattened
    so the product is one matrix multiply.
    """
    x2 = x.reshape(-1, x.shape[-1])
    w_t = weight if isinstance(weight, products.Constant) else weight.T            # [in, out]
    y = products.matmul(x2, w_t, out=out)
    if bias is not None:
        y = np.add(y, bias, out=out)                                                # (in place into out)
    return y.reshape(*x.shape[:-1], w_t.shape[-1])


def matvec(weight: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y_t = W x_t for each row x_t of x: n matrix-vector products, the batched form [n, out, in] @ [n, in, 1] an
    export computes (transformers' batched_mm experts: W first).  weight [out, in], x [n, in] -> [n, out].

    Correctly rounded, each element is what `linear` gives (and `linear` computes it); inside
    products.onnxruntime_cpu() it is summed as ONNX Runtime sums that form (one column: MLAS's N == 1 kernel, whose
    order depends on the row of W: the whole W, not a slice of its rows, is the product's A), a few tokens at a
    time (the products of a chunk are held: [n, out, in] float32).
    """
    if not products.onnxruntime_cpu_active():
        return linear(x, weight)
    step = max(1, _MATVEC_ELEMENTS // max(1, weight.size))
    return np.concatenate([products.matmul(np.broadcast_to(weight, (len(xs), *weight.shape)), xs[:, :, None])[..., 0]
                           for xs in (x[i:i + step] for i in range(0, max(1, len(x)), step))])   # [n, out]


_MATVEC_ELEMENTS = 1 << 22                  # products held at once by matvec in ONNX Runtime's order (16 MiB)


def embedding(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Row gather: ids [B, T] int, table [V, H] -> [B, T, H]."""
    return table[ids]
