"""Correctly rounded float32 products and sums: the same bits on every CPU, BLAS kernel, thread count and SIMD path.

Contract (float32 inputs). Every output element is RNE32(s): the float32 nearest to the exact real number
s = sum_k a_k b_k (ties to even; IEEE overflow to +-inf; subnormals kept), where the a_k b_k are the exact products
of the float32 inputs. An exact s = 0 gives +0. So a stored element is a stated function of its inputs, which any
other program can recompute (`refimpl explain` prints the exact sum and its rounding). Non-finite inputs give what
IEEE arithmetic gives for every summation order: NaN if a product is NaN (a NaN, or inf * 0) or +inf and -inf
products meet, else +-inf; NaN is returned as the one quiet NaN 0x7fc00000.
float64 inputs (the oracle mode) take NumPy's float64 product as it is: portable to ~1e-15 relative, not bitwise;
so does everything inside `plain_blas()` (the opt-in fast mode).

Method (verified rounding; docs/numerics.md has the proof):
  1. c = fl64(A B), float64 BLAS in whatever order it likes, as s partial products over slices of K added in
     order. Each a_k b_k is exact in float64 (24 + 24 <= 53 significand bits), and no product or partial sum can
     overflow or become subnormal (2^-298 <= |a_k b_k| <= 2^256 for non-zero finite products, K < 2^40).
  2. A sum of n exact terms in any order and blocking (FMA or not) errs by at most gamma_{n-1} sum |terms|,
     gamma_n = n u / (1 - n u), u = 2^-53 (Higham, Accuracy and Stability of Numerical Algorithms, §3.1, §4.2).
     s slices of at most L = ceil(K / s) terms, then s - 1 additions: |c - s| <= gamma_{L + s - 1} sum_k |a_k b_k|,
     and sum_k |a_k b_k| <= ||a||_2 ||b||_2 (Cauchy-Schwarz), so with the norms' own rounding covered,
        |c - s| <= e = (gamma_{L + s - 1} + 2^-51) ||a||_2 ||b||_2 (1 + 2^-20)
     where the 2^-51 term also covers the float64 rounding of c - e and c + e (|c| <= (1 + gamma) ||a|| ||b||).
  3. RNE32 is monotone: if fl(c - e) and fl(c + e) round to the same float32 (same bits), that is RNE32(s). No
     double rounding: each end is one float64 number, rounded once.
  4. The rest (about 1 element in 10^4 of a model's products) is summed again with one error-free extraction
     (Rump, Ogita, Oishi, ExtractVector), whose error is ~K^3 u^2 max|a_k b_k|; what is still undecided (true
     near-midpoints) is summed exactly by math.fsum (Shewchuk): r = RN64(s), and where r is itself a float32
     rounding midpoint the exact sign of s - r decides.
Sums are products with ones; cumulative sums are prefix sums, each correctly rounded the same way.
"""

import builtins
import contextlib
import contextvars
import math
from fractions import Fraction

import numpy as np

_U = 2.0 ** -53
_QNAN32 = np.float32(np.nan)                # 0x7fc00000
_OUT_BLOCK = 1 << 16                        # float64 results checked at once (512 KiB: stays in cache)
_IN_BLOCK = 1 << 18                         # float64 elements of the second operand converted at once (2 MiB)
_SLICE = 384                                # terms per partial product: more slices cost BLAS speed, fewer give
                                            # looser bounds and more undecided elements
_plain = contextvars.ContextVar("plain_blas", default=False)
_runtime = contextvars.ContextVar("onnxruntime_cpu", default=False)
MLAS_STRIDE_K = 256                         # ONNX Runtime's MLAS SGEMM: K blocks summed from 0, added in order


def _bound_factor(K: int) -> float:
    """e / (||a|| ||b||) for a K-term product computed by _sliced_matmul (step 2 of the module doc)."""
    s = _slices(K)
    n = -(-K // s) + s - 1
    return (n * _U / (1 - n * _U) + 2.0 ** -51) * (1 + 2.0 ** -20)


def _slices(K: int) -> int:
    return max(1, round(K / _SLICE))


def _sliced_matmul(a64: np.ndarray, b64: np.ndarray) -> np.ndarray:
    """fl64(a b) as s BLAS products over consecutive slices of K, added in order (s = K / 384, at least 1)."""
    K = a64.shape[-1]
    step = -(-K // _slices(K))
    c = np.matmul(a64[..., :step], b64[..., :step, :])
    for k in range(step, K, step):
        c += np.matmul(a64[..., k:k + step], b64[..., k:k + step, :])
    return c


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b with NumPy's matmul broadcasting: a [..., M, K], b [..., K, N] -> [..., M, N], correctly rounded.

    float32 (or narrower) inputs give float32 RNE32(sum_k a_k b_k) per element; float64 inputs NumPy's float64 product.
    Columns of `b` are converted to float64 a block at a time (a block's results stay in cache while they are
    checked), so a weight matrix is never held in float64 whole.
    """
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"matmul: operands need >= 2 axes, got {a.shape} and {b.shape}")
    if np.result_type(a.dtype, b.dtype, np.float32) == np.float64 or _plain.get():
        return np.matmul(a, b)
    if _runtime.get():
        return matmul_sequential_fma(a, b)
    K, N = b.shape[-2], b.shape[-1]
    if a.shape[-1] != K:
        raise ValueError(f"matmul: inner dimensions differ: {a.shape} @ {b.shape}")
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    out = np.empty((*batch, a.shape[-2], N), np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        a64 = a.astype(np.float64)
        na = np.sqrt(np.einsum("...k,...k->...", a64, a64))[..., :, None] * _bound_factor(K)   # [..., M, 1]
        rows, depth = math.prod(batch) * a.shape[-2], math.prod(b.shape[:-2]) * K
        width = max(64, min(_OUT_BLOCK // max(1, rows), _IN_BLOCK // max(1, depth)))
        for j in range(0, N, width):                                            # column blocks of b
            b64 = b[..., :, j:j + width].astype(np.float64)
            nb = np.sqrt(np.einsum("...kn,...kn->...n", b64, b64))[..., None, :]  # [..., 1, n]  ||b_j||
            out[..., j:j + width] = _rounded_product(a64, b64, _sliced_matmul(a64, b64), na * nb)
    return out


def _rounded_product(a64, b64, c, e) -> np.ndarray:
    """RNE32 of each exact element of a64 @ b64, from its float64 value c and error bound e (step 3, then 4)."""
    if np.isfinite(e).all():
        block, undecided = _round_verified(c, e)
    else:                                                                       # an inf / NaN operand
        finite = np.isfinite(e)
        block, undecided = _round_verified(np.where(finite, c, 0), np.where(finite, e, 0))
        block = np.where(finite, block, _nonfinite(*_nonfinite_products(a64, b64)))
        undecided &= finite
    if undecided.any():
        idx = np.nonzero(undecided)
        batch = block.shape[:-2]
        rows = np.broadcast_to(a64, (*batch, *a64.shape[-2:]))[idx[:-1]]                       # [F, K]
        cols = np.broadcast_to(b64, (*batch, *b64.shape[-2:])).swapaxes(-1, -2)[(*idx[:-2], idx[-1])]
        block[idx] = _exact_sums(rows, cols)
    return block


def _round_verified(c: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 results where c - e and c + e round to one float32, and the mask of the undecided elements.
    c, e float64 (broadcasting), e >= 0 finite and large enough to cover the rounding of c -+ e. e = 0 means
    every product is zero: the sum is +0."""
    lo = (c - e).astype(np.float32)
    hi = (c + e).astype(np.float32)
    undecided = lo.view(np.int32) != hi.view(np.int32)
    zero = e == 0
    if zero.any():
        lo[np.broadcast_to(zero, lo.shape)] = 0
        undecided &= ~zero
    return lo, undecided


def _exact_sums(a: np.ndarray, b: np.ndarray, chunk: int = 1 << 15) -> np.ndarray:
    """RNE32 of the exact sum_k a_fk b_fk for each row f of finite float64 a, b [F, K] (step 4), a chunk of rows
    at a time (in cache).

    One error-free extraction: with sigma a power of two >= 2 K max|p|, q = (sigma + p) - sigma is p on the grid
    ulp(sigma)/2 and r = p - q exactly; sum q is exact in any order, |r| <= 2^-53 sigma, and
    c = fl(sum q + fl(sum r)) errs by at most gamma_K sum |r| + 2^-52 |c|."""
    F, K = a.shape
    out = np.empty(F, np.float32)
    rows = max(1, chunk // K)
    for f in range(0, F, rows):
        p = a[f:f + rows] * b[f:f + rows]                                        # exact products
        _, exponent = np.frexp(np.maximum(p.max(axis=-1), -p.min(axis=-1)))    # max|p| < 2^exponent
        sigma = np.ldexp(1.0, exponent + math.ceil(math.log2(K)) + 1)[:, None]
        q = (sigma + p) - sigma
        p -= q                                                                  # r, exactly
        c = q.sum(axis=-1) + p.sum(axis=-1)
        np.abs(p, out=p)
        e = (K * _U / (1 - K * _U)) * p.sum(axis=-1) * (1 + 2.0 ** -20) + np.abs(c) * 2.0 ** -51
        out[f:f + rows], undecided = _round_verified(c, e)
        for g in np.flatnonzero(undecided):
            out[f + g] = _exact_sum_rounded((a[f + g] * b[f + g]).tolist())
    return out


def _exact_sum_rounded(terms: list) -> np.float32:
    """RNE32 of the exact sum of finite float64 terms."""
    r = math.fsum(terms) + 0.0              # RN64(s); + 0.0 makes an exact zero +0
    down = np.float32(np.nextafter(r, -np.inf))
    up = np.float32(np.nextafter(r, np.inf))
    if down.view(np.int32) == up.view(np.int32):
        return down                         # every float64 within an ulp of r rounds alike: s does too
    residual = math.fsum(terms + [-r])      # r is a float32 midpoint: the exact sign of s - r decides
    if residual > 0:
        return up
    if residual < 0:
        return down
    return np.float32(r)                    # s = r exactly: IEEE's tie to even


def _nonfinite(nan: np.ndarray, pos_inf: np.ndarray, neg_inf: np.ndarray) -> np.ndarray:
    """IEEE's sum of products that are not all finite, from whether any product is NaN, +inf, -inf (the same for
    every order: finite products cannot overflow in float64): NaN, +inf or -inf (float32)."""
    out = np.where(pos_inf, np.float32(np.inf), np.float32(-np.inf))
    out[nan | (pos_inf & neg_inf)] = _QNAN32
    return out


def _nonfinite_products(a: np.ndarray, b: np.ndarray):
    """(any NaN, any +inf, any -inf) product per element of a @ b, counted with 0/1 matrix products (exact).
    inf * 0 and any NaN operand give NaN; inf * x the sign of x."""
    f = lambda m: m.astype(np.float64)                                          # noqa: E731
    isnan_a, isnan_b = f(np.isnan(a)), f(np.isnan(b))
    inf_a, inf_b, zero_a, zero_b = f(np.isinf(a)), f(np.isinf(b)), f(a == 0), f(b == 0)
    pos_a, neg_a, pos_b, neg_b = f(a > 0), f(a < 0), f(b > 0), f(b < 0)
    pinf_a, ninf_a, pinf_b, ninf_b = f(a == np.inf), f(a == -np.inf), f(b == np.inf), f(b == -np.inf)
    nan = (isnan_a @ np.ones_like(b) + np.ones_like(a) @ isnan_b + inf_a @ zero_b + zero_a @ inf_b) > 0
    pos_inf = (pinf_a @ pos_b + ninf_a @ neg_b + pos_a @ pinf_b + neg_a @ ninf_b) > 0
    neg_inf = (pinf_a @ neg_b + ninf_a @ pos_b + pos_a @ ninf_b + neg_a @ pinf_b) > 0
    return nan, pos_inf, neg_inf


def sumprod(a: np.ndarray, b: np.ndarray, axis: int = -1, keepdims: bool = False) -> np.ndarray:
    """sum_k a_k b_k along `axis` (broadcasting a and b), correctly rounded like matmul; e.g. sumprod(x, x) is
    a sum of squares. The bound here is gamma_K sum_k |a_k b_k| itself."""
    if np.result_type(a.dtype, b.dtype, np.float32) == np.float64 or _plain.get():
        return np.sum(a * b, axis=axis, keepdims=keepdims)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.moveaxis(np.multiply(a, b, dtype=np.float64), axis, -1)        # [..., K] exact products
        out = _sums(p, p.sum(axis=-1), np.abs(p).sum(axis=-1), p.shape[-1],
                    lambda test: test(p).any(axis=-1), lambda idx: p[idx])
    return np.expand_dims(out, axis) if keepdims else out


def sum(x: np.ndarray, axis: int = -1, keepdims: bool = False) -> np.ndarray:  # noqa: A001 (the kernel's name)
    """sum_k x_k along `axis`, correctly rounded (float32) or NumPy's float64 sum (float64); inside
    onnxruntime_cpu(), in ONNX Runtime's order (eigen_sum)."""
    if x.dtype == np.float64 or _plain.get():
        return np.sum(x, axis=axis, keepdims=keepdims)
    if _runtime.get():
        out = eigen_sum(np.moveaxis(np.asarray(x, np.float32), axis, -1))
        return np.expand_dims(out, axis) if keepdims else out
    return sumprod(x, np.ones((), np.float32), axis=axis, keepdims=keepdims)


def cumsum(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Prefix sums y_r = sum_{i <= r} x_i along `axis`, each correctly rounded (float32) or NumPy's (float64)."""
    if x.dtype == np.float64 or _plain.get():
        return np.cumsum(x, axis=axis)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.moveaxis(x.astype(np.float64), axis, -1)                       # [..., K]
        K = np.arange(1, p.shape[-1] + 1)                                       # terms in each prefix
        out = _sums(p, np.cumsum(p, axis=-1), np.cumsum(np.abs(p), axis=-1), K,
                    lambda test: np.logical_or.accumulate(test(p), axis=-1), lambda idx: p[idx[:-1]][:idx[-1] + 1])
    return np.moveaxis(out, -1, axis)


def _sums(p, c, abs_sum, K, any_product, terms) -> np.ndarray:
    """RNE32 of exact sums of products, from their float64 sums c and sums of |products| (same shape; K terms
    each): verified, IEEE's answer where a product is not finite, exact where undecided. any_product(test)
    says per sum whether test holds for any of its products; terms(idx) gives the products of sum idx."""
    gamma = K * _U / (1 - K * _U) * (1 + 2.0 ** -20)
    finite = np.isfinite(abs_sum)
    if finite.all():
        out, undecided = _round_verified(c, gamma * abs_sum + np.abs(c) * 2.0 ** -51)
    else:                                                                       # an inf / NaN product
        c, abs_sum = np.where(finite, c, 0), np.where(finite, abs_sum, 0)
        out, undecided = _round_verified(c, gamma * abs_sum + np.abs(c) * 2.0 ** -51)
        nonfinite = _nonfinite(any_product(np.isnan), any_product(np.isposinf), any_product(np.isneginf))
        out = np.where(finite, out, nonfinite)
        undecided &= finite
    out, undecided = np.atleast_1d(out), np.atleast_1d(undecided)            # sums over a 1-D array: 0-d
    for idx in zip(*np.nonzero(undecided)):
        out[idx] = _exact_sum_rounded(terms(idx if undecided.ndim == c.ndim else ()).tolist())
    return out.reshape(c.shape)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """RNE32(a b + c) exactly (float32 a, b, c: one rounding, as an FMA instruction): a b is exact in float64, the
    float64 sum s = fl64(a b + c) with its error-free remainder (TwoSum) decides where s is a float32 midpoint."""
    p, c = np.multiply(a, b, dtype=np.float64), np.asarray(c, np.float64)         # a b exact (48 bits)
    s = p + c                                                                      # fl64(a b + c)
    v = s - p
    err = (p - (s - v)) + (c - v)                                                  # s + err = a b + c exactly
    r = s.astype(np.float32)                                                       # RNE32(s)
    mid = (err != 0) & (np.abs(s - r) * 2 == np.abs(np.nextafter(r, np.where(s > r, np.inf, -np.inf)
                                                                  .astype(np.float32)).astype(np.float64) - r))
    if mid.any():   # s a float32 midpoint, the exact sum beyond it in err's direction: the neighbour that way
        away = np.nextafter(r, np.where(err > 0, np.inf, -np.inf).astype(np.float32))
        toward = np.sign(s - r) == np.sign(err)
        r = np.where(mid & toward, away, r)
    return r


def matmul_sequential_fma(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float32 a @ b summed as ONNX Runtime's CPU EP sums (MLAS SGEMM): per block of MLAS_STRIDE_K terms of K,
    acc = fma(a_k, b_k, acc) from acc = 0 in k order; the blocks' sums added to the result in order. a [..., M, K],
    b [..., K, N] -> [..., M, N] float32. Not correctly rounded: the runtime's own order (a QDQ model's 16-bit
    codes flip with its float32 roundings: docs/precision.md)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    K = a.shape[-1]
    shape = (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    out = None
    for k0 in range(0, K, MLAS_STRIDE_K):
        acc = np.zeros(shape, np.float32)
        for k in range(k0, min(K, k0 + MLAS_STRIDE_K)):
            acc = fma32(a[..., :, k:k + 1], b[..., k:k + 1, :], acc)              # acc = a_k b_k + acc, one rounding
        out = acc if out is None else out + acc
    return out


EIGEN_PACKET = 4                            # float32 lanes of Eigen's packets in ONNX Runtime's CPU build (SSE)


def eigen_sum(x: np.ndarray) -> np.ndarray:
    """float32 sum over the last axis as ONNX Runtime's CPU EP reduces (ReduceSum / ReduceMean: Eigen's vectorised
    redux, packets of EIGEN_PACKET lanes): two packet accumulators over alternate packets, added; a last odd
    packet added; the lanes halved pairwise (predux); the tail elements added in order.  [..., n] -> [...]"""
    n, w = x.shape[-1], EIGEN_PACKET
    whole, pairs = n // w * w, n // (2 * w) * 2 * w
    if not whole:
        s = x[..., 0] if n else np.zeros(x.shape[:-1], np.float32)
    else:
        r0 = x[..., :w]
        if whole > w:
            r1 = x[..., w:2 * w]
            for i in range(2 * w, pairs, 2 * w):
                r0, r1 = r0 + x[..., i:i + w], r1 + x[..., i + w:i + 2 * w]     # two accumulators
            r0 = r0 + r1
            if whole > pairs:
                r0 = r0 + x[..., pairs:pairs + w]                               # the odd packet
        while r0.shape[-1] > 1:                                                 # predux: halves added
            r0 = r0[..., :r0.shape[-1] // 2] + r0[..., r0.shape[-1] // 2:]
        s = r0[..., 0]
    for i in range(whole if whole else 1, n):
        s = s + x[..., i]                                                       # the tail, in order
    return s


def onnxruntime_cpu_active() -> bool:
    return _runtime.get()


@contextlib.contextmanager
def onnxruntime_cpu(enabled: bool = True):
    """Within the block, float32 matrix products (matmul_sequential_fma) and sums (eigen_sum) are summed and the
    logistic evaluated (elementary.sigmoid: MLAS's rational approximation) as ONNX Runtime's CPU EP computes them:
    refimpl emulating a device graph that runtime runs (a QDQ model; aimet-onnx's QuantSim session), whose 16-bit
    codes follow its float32 roundings. The rest stays correctly rounded (measured: what the runtime computes)."""
    token = _runtime.set(enabled)
    try:
        yield
    finally:
        _runtime.reset(token)


def plain_blas_active() -> bool:
    return _plain.get()


@contextlib.contextmanager
def plain_blas(enabled: bool = True):
    """Within the block, float32 products and sums are NumPy's / BLAS's own (fast, not portable, not correctly
    rounded): the opt-in `fast` precision mode for very large runs, recorded in a bundle's manifest."""
    token = _plain.set(enabled)
    try:
        yield
    finally:
        _plain.reset(token)


def exact_dot(a: np.ndarray, b: np.ndarray) -> tuple[Fraction, np.float32]:
    """The exact sum_k a_k b_k of two float vectors as a Fraction, and its RNE32 (what matmul stores): for
    `refimpl explain`, which shows a stored element as this function of its inputs."""
    a64, b64 = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    exact = builtins.sum((Fraction(x) * Fraction(y) for x, y in zip(a64.tolist(), b64.tolist())), Fraction(0))
    return exact, _exact_sum_rounded((a64 * b64).tolist())
