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
     order (one token's products over a weight: s = 1, over its float64 copy or cache-sized blocks of the float32
     weight: _few_rows).
     Each a_k b_k is exact in float64 (24 + 24 <= 53 significand bits), and no product or partial sum can
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
import concurrent.futures
import contextlib
import contextvars
import functools
import itertools
import math
import os
import threading
from fractions import Fraction

import numpy as np
import threadpoolctl

_U = 2.0 ** -53
_QNAN32 = np.float32(np.nan)                # 0x7fc00000
_OUT_BLOCK = 1 << 18                        # float64 results checked at once (2 MiB: stays in cache)
_IN_BLOCK = 1 << 18                         # float64 elements of the second operand converted at once (2 MiB)
_SLICE = 384                                # terms per partial product: more slices cost BLAS speed, fewer give
                                            # looser bounds and more undecided elements
_plain = contextvars.ContextVar("plain_blas", default=False)
_runtime = contextvars.ContextVar("onnxruntime_cpu", default=False)


def _bound_factor(K: int, s: int | None = None) -> float:
    """e / (||a|| ||b||) for a K-term product computed by _sliced_matmul (s = _slices(K) slices), or as s slices
    otherwise (step 2 of the module doc)."""
    s = _slices(K) if s is None else s
    n = -(-K // s) + s - 1
    return (n * _U / (1 - n * _U) + 2.0 ** -51) * (1 + 2.0 ** -20)


def _slices(K: int) -> int:
    return max(1, round(K / _SLICE))


def _sliced_matmul(a64: np.ndarray, b64: np.ndarray) -> np.ndarray:
    """fl64(a b) as s BLAS products over consecutive slices of K, added in order (s = K / 384, at least 1)."""
    K = a64.shape[-1]
    step = max(1, -(-K // _slices(K)))                                          # (K = 0: one empty product)
    c = np.matmul(a64[..., :step], b64[..., :step, :])
    for k in range(step, K, step):
        c += np.matmul(a64[..., k:k + step], b64[..., k:k + step, :])
    return c


class Constant:
    """A constant second operand b [..., K, N] (a weight matrix, transposed) with what its products reuse: the
    column norms ||b_j||_2 of the error bound (step 2; float64 [..., 1, N]) and, optionally, b in float64 (then no
    product converts it again). Made once per weight by `constant`; b's values must not change afterwards."""

    def __init__(self, b: np.ndarray, norms: np.ndarray, b64: np.ndarray | None = None, positive: bool = False):
        self.b, self.norms, self.b64, self.positive = b, norms, b64, positive    # positive: every norm finite, > 0
        self.shape, self.dtype = b.shape, b.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held beyond b itself: the norms and the float64 copy."""
        return self.norms.nbytes + (0 if self.b64 is None else self.b64.nbytes)


def constant(b: np.ndarray, keep_float64: bool = False) -> Constant:
    """b [..., K, N] with its column norms (float64, computed a block of columns at a time, the blocks spread over
    the cores), and its float64 copy when keep_float64. A float64 b (the oracle mode) needs neither: its norms are
    not computed."""
    if b.dtype == np.float64:
        return Constant(b, np.empty((*b.shape[:-2], 1, 0)))
    width = max(1, _IN_BLOCK // max(1, math.prod(b.shape[:-1])))
    b64 = np.empty_like(b, np.float64) if keep_float64 else None                # (b's layout: W^T's rows contiguous)
    norms = np.empty((*b.shape[:-2], 1, b.shape[-1]))

    def block(i: int) -> None:                                                  # columns j .. j + width
        j = slice(i * width, (i + 1) * width)
        if keep_float64:
            _convert(b64[..., j], b[..., j])
        norms[..., j] = column_norms(b64[..., j] if keep_float64 else _to_float64(b[..., j]))

    spread(block, -(-b.shape[-1] // width))
    return Constant(b, norms, b64, bool(((norms > 0) & (norms < np.inf)).all()))


def _to_float64(b: np.ndarray) -> np.ndarray:
    """b converted to float64 (exact)."""
    return b.astype(np.float64)


def column_norms(b64: np.ndarray) -> np.ndarray:
    """||b_j||_2 of each column of float64 b [..., K, N] -> [..., 1, N] (its rounding is covered by step 2's
    factor 1 + 2^-20: any float64 evaluation of the norm will do)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.sqrt(np.einsum("...kn,...kn->...n", b64, b64))[..., None, :]


def matmul(a: np.ndarray, b, out: np.ndarray | None = None) -> np.ndarray:
    """a @ b with NumPy's matmul broadcasting: a [..., M, K], b [..., K, N] -> [..., M, N], correctly rounded;
    written into `out` when given (of that shape and the result's dtype; a column block of a larger array will do:
    a blocked lm_head's blocks land in place, no copy).

    float32 (or narrower) inputs give float32 RNE32(sum_k a_k b_k) per element; float64 inputs NumPy's float64 product.
    b may be a `Constant` (a weight with its norms and maybe its float64 copy, made once). Otherwise columns of
    `b` are converted to float64 a block at a time (a block's results stay in cache while they are checked), so a
    weight matrix is never held in float64 whole; with few rows of a (one token's products), those blocks are
    spread over the cores (NumPy's casts and BLAS release the GIL; each output element is computed by one
    thread, so the bits do not depend on the split).
    """
    const = b if isinstance(b, Constant) else None
    b = const.b if const is not None else b
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"matmul: operands need >= 2 axes, got {a.shape} and {b.shape}")
    if np.result_type(a.dtype, b.dtype, np.float32) == np.float64:
        return np.matmul(a, b, out=out)
    if _plain.get():
        if _PLAIN_SPREAD and a.ndim == 2 and _streamed(a, b, ()) and b.size >= 2 * _PLAIN_BLOCK:
            return _into(out, _plain_few_rows(a, b))
        return np.matmul(a, b, out=out)
    if _runtime.get():
        return _into(out, mlas_sgemm(a, b))
    if const is not None and const.b64 is not None and const.positive and a.ndim == 2 and b.ndim == 2 \
            and a.shape[0] <= _THREADED_ROWS and a.shape[1] == b.shape[0] and \
            (out is None or out.shape == (a.shape[0], b.shape[1]) and out.dtype == np.float32):
        y = _few_rows_kept(a, const)
        if y is not None:
            return _into(out, y)
    K, N = b.shape[-2], b.shape[-1]
    if a.shape[-1] != K:
        raise ValueError(f"matmul: inner dimensions differ: {a.shape} @ {b.shape}")
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    shape = (*batch, a.shape[-2], N)
    if out is None:
        out = np.empty(shape, np.float32)
    elif out.shape != shape or out.dtype != np.float32:
        raise ValueError(f"matmul: out is {out.dtype} {out.shape}, the product float32 {shape}")
    with np.errstate(invalid="ignore", over="ignore"):
        a64, norm_a = _with_norms(a)                                            # [..., M, K], [..., M, 1]
        if _streamed(a64, b, batch):
            out[...] = _few_rows(a64, norm_a, b, const)
            return out
        na = norm_a * _bound_factor(K)
        rows, depth = math.prod(batch) * a.shape[-2], math.prod(b.shape[:-2]) * K
        width = _OUT_BLOCK // max(1, rows)                                      # c's block stays in cache
        converting = const is None or const.b64 is None
        if converting:
            width = min(width, _IN_BLOCK // max(1, depth))                      # ... and b's converted block
        # a large product's blocks over our threads, BLAS on one each (its rounding check, conversion and norms run
        # on every core too), at least two blocks a core; a small one (a decode step's attention) in this thread
        threaded = rows * depth * N >= _SPREAD_WORK and _workers() > 1
        if threaded:
            width = min(width, -(-N // (2 * _workers())))                       # (whoever is free takes the next)
        width = max(64, width)

        def block(j: int) -> None:                                              # columns j .. j + width of b
            with np.errstate(invalid="ignore", over="ignore"):                  # (per thread)
                _block(j)

        def _block(j: int) -> None:
            if const is not None and const.b64 is not None:
                b64 = const.b64[..., :, j:j + width]
            else:
                b64 = _to_float64(b[..., :, j:j + width])
            nb = const.norms[..., j:j + width] if const is not None else column_norms(b64)  # [..., 1, n]
            out[..., j:j + width] = _rounded_product(a64, b64, _sliced_matmul(a64, b64), na, nb)

        starts = range(0, N, width)
        if threaded and len(starts) > 1:
            spread(lambda i: block(starts[i]), len(starts))                    # no BLAS threads inside ours
        else:
            for j in starts:
                block(j)
    return out


def _with_norms(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """a [..., M, K] in float64 and its row norms ||a_i||_2 [..., M, 1]; a large a a block of rows at a time, the
    blocks spread over the cores (a prefill's attention probabilities: 4M elements a layer at 512 tokens)."""
    if a.size < _SPREAD_SUM:
        a64 = _to_float64(a)
        return a64, np.sqrt(np.einsum("...k,...k->...", a64, a64))[..., :, None]
    K = a.shape[-1]
    a64, norms = np.empty(a.shape), np.empty((*a.shape[:-1], 1))
    rows, flat, flat64, flat_norms = max(1, _SUM_BLOCK // max(1, K)), a.reshape(-1, K), a64.reshape(-1, K), \
        norms.reshape(-1)

    def block(i: int) -> None:                                                  # rows r .. r + rows
        r = slice(i * rows, (i + 1) * rows)
        _convert(flat64[r], flat[r])
        flat_norms[r] = np.sqrt(np.einsum("mk,mk->m", flat64[r], flat64[r]))

    spread(block, -(-flat.shape[0] // rows))
    return a64, norms


def _into(out: np.ndarray | None, y: np.ndarray) -> np.ndarray:
    """y, or y copied into out when out is given."""
    if out is None:
        return y
    out[...] = y
    return out


_THREADED_ROWS = 8                          # products over a weight with at most this many rows: _few_rows
_SPREAD_WORK = 1 << 22                      # multiply-adds from which a product's column blocks are spread
_VECTOR_BLOCK = 1 << 19                     # float64 elements of b converted at once by each thread of a few-row
                                            # product (4 MiB: multiplied while it is in the shared cache; 2 MiB
                                            # blocks made a 0.6B decode step's products 9 % slower, 8 MiB 30 %)
_VECTOR_SLICES = 1                          # slices of K in a few-row product's float64 product (step 1)


def _streamed(a64: np.ndarray, b: np.ndarray, batch: tuple) -> bool:
    """Whether a @ b is a few-row product over a weight: b [K, N] 2-D with contiguous columns (W^T of a weight
    W [N, K]), a [M, K] with M <= _THREADED_ROWS (one token's projections)."""
    return not batch and b.ndim == 2 and a64.shape[-2] <= _THREADED_ROWS and b.shape[0] > 0 and b.T.flags.c_contiguous


def _few_rows_kept(a: np.ndarray, const: Constant) -> np.ndarray | None:
    """RNE32 of a @ b for few rows of a [M, K] over a Constant b [K, N] with its float64 copy and finite non-zero
    column norms (a decode step's projections over resident weights), or None where a row of a is zero or not
    finite (the general path's cases). _few_rows's arithmetic (one BLAS product over the copy, its bound from the
    kept norms, steps 1-4) in as few NumPy calls as it takes: a decode step makes some 200 of these products, and
    each call's fixed cost is paid with cold caches (the weights streaming through them)."""
    a64 = a.astype(np.float64)                                                  # [M, K], exact
    na = np.sqrt(a64 @ a64[0] if len(a64) == 1 else np.square(a64).sum(axis=-1))  # ||a_i||  [M]
    if not all(0 < n < math.inf for n in na.tolist()):
        return None
    ct = np.empty((const.shape[1], a.shape[0]))                                 # c^T [N, M]
    _vector_product(const.b64.T, a64.T, ct, a.shape[1])                         # one BLAS product, its own threads
    e = const.norms.T * (na * _bound_factor(a.shape[1], 1))                     # bound [N, M], finite and > 0
    with np.errstate(over="ignore"):                                            # (IEEE overflow to +-inf)
        lo, undecided = _round_verified(ct, e)
        if np.count_nonzero(undecided):
            cols, rows = np.nonzero(undecided)
            lo[cols, rows] = _exact_sums(a64[rows], const.b64.T[cols])
    return np.ascontiguousarray(lo.T)                                           # [M, N]


def _few_rows(a64: np.ndarray, norm_a: np.ndarray, b: np.ndarray, const) -> np.ndarray:
    """RNE32 of a64 @ b for few rows of a (a64 [M, K] float64, its row norms [M, 1]; b [K, N] float32 with
    contiguous columns, maybe a Constant's, whose norms are then used). A Constant with its float64 copy: one BLAS
    product over the copy on BLAS's own threads (twice b's bytes, but no conversion and no thread hand-offs of ours:
    bench/forward.py at 0.6B: 269 against 351 ms a decode token, sides alternating). Otherwise the bytes read are
    b's own: each thread converts W = b^T [N, K] a block of rows at a time into its buffer (_VECTOR_BLOCK float64
    values: in cache), multiplies it there, and takes the next block (spread). One float64 product per block
    (_VECTOR_SLICES slices of K), its bound from the column norms, then the rounding check and the exact fallback
    on the whole [M, N] result (steps 1-4)."""
    K, N = b.shape
    if const is not None and const.b64 is not None:                             # (any order: one slice's bound)
        ct = np.empty((N, a64.shape[0]))                                        # c^T [N, M]
        _vector_product(const.b64.T, np.ascontiguousarray(a64.T), ct, K)
        return _rounded_product(a64, b, ct.T, norm_a * _bound_factor(K, 1), const.norms)
    W = b.T                                                                     # [N, K], rows contiguous
    a64t = np.ascontiguousarray(a64.T)                                          # [K, M]
    ct = np.empty((N, a64.shape[0]))                                            # c^T [N, M]
    nb = const.norms[0] if const is not None else np.empty(N)                  # [N]
    rows = max(1, min(_VECTOR_BLOCK // K, -(-N // _workers())))                # a block for every thread
    step = -(-K // _VECTOR_SLICES)

    def block(i: int) -> None:                                                  # rows r .. r + n of W
        r = i * rows
        n = min(rows, N - r)
        blk = _buffer(rows * K)[:n * K].reshape(n, K)
        _convert(blk, W[r:r + n])                                               # exact
        _vector_product(blk, a64t, ct[r:r + n], step)                           # [n, M]
        if const is None:
            nb[r:r + n] = np.sqrt(np.einsum("nk,nk->n", blk, blk))

    spread(block, -(-N // rows))
    na = norm_a * _bound_factor(K, -(-K // step))
    return _rounded_product(a64, b, ct.T, na, nb[None, :])


_SUM_BLOCK = 1 << 15                        # terms of a correctly rounded sum taken at once (256 KiB of float64);
                                            # also elements of a product's operand converted at once (_with_norms)
_SPREAD_SUM = 1 << 18                       # terms (elements) from which those blocks are spread over the cores


_PLAIN_SPREAD = False                       # plain one-token products: our threads over BLAS on one thread each
                                            # (off: on a quiet machine OpenBLAS's own threads are faster, decode
                                            # 110 ms against 196 ms a token at 0.6B; on a loaded one they collapse)
_PLAIN_BLOCK = 1 << 18                      # elements of b per block of a plain one-token product (1 MiB)


def _plain_few_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b by BLAS (plain), a [M, K] few rows, b [K, N] with contiguous columns: column blocks of _PLAIN_BLOCK
    elements of b taken in turn by the threads (BLAS on one thread each; OpenBLAS's own spinning threads collapse
    on a loaded machine: measured 2-10x slower there). The blocks depend on the shapes alone."""
    K, N = b.shape
    out = np.empty((a.shape[0], N), np.result_type(a.dtype, b.dtype))
    width = max(1, _PLAIN_BLOCK // K)

    def block(i: int) -> None:
        j = i * width
        np.matmul(a, b[:, j:j + width], out=out[:, j:j + width])

    spread(block, -(-N // width))
    return out


def _convert(dst: np.ndarray, src: np.ndarray) -> None:
    """dst (float64) = src (float32: exact)."""
    np.copyto(dst, src)


def _vector_product(blk: np.ndarray, a64t: np.ndarray, out: np.ndarray, step: int) -> None:
    """out [n, M] = fl64(blk [n, K] @ a64t [K, M]) as partial products over slices of `step` terms of K, added in
    order."""
    K = blk.shape[1]
    np.matmul(blk[:, :step], a64t[:step], out=out)
    for k in range(step, K, step):
        out += np.matmul(blk[:, k:k + step], a64t[k:k + step])


def spread(task, n: int) -> None:
    """task(0), ..., task(n - 1), taken in turn by this thread and the pool's (BLAS on one thread meanwhile):
    whoever is free takes the next, so a loaded machine's late thread delays nothing (this thread does not wait
    for a thread that never started; one that starts late finds nothing left)."""
    workers = min(_workers(), n)
    if workers <= 1:
        for i in range(n):
            task(i)
        return
    turn, done, failed = itertools.count(), [], []
    finished = threading.Event()

    def work() -> None:
        with np.errstate(invalid="ignore", over="ignore"):
            for i in turn:                                                      # atomic under the GIL
                if i >= n:
                    break
                try:
                    task(i)
                except BaseException as exc:                                    # noqa: BLE001 (re-raised below)
                    failed.append(exc)
                done.append(i)
                if len(done) == n:
                    finished.set()

    with _blas_single():
        for _ in range(workers - 1):
            _helpers().submit(work)
        work()
        finished.wait()
    if failed:
        raise failed[0]


@functools.cache
def _helpers() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that work beside the caller's in spread (so at most _cores() threads hold a _buffer)."""
    return concurrent.futures.ThreadPoolExecutor(max(1, _cores() - 1), thread_name_prefix="refimpl-spread")


_local = threading.local()


def _buffer(size: int) -> np.ndarray:
    """This thread's float64 buffer of at least `size` elements (kept: made once per thread)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < size:
        buf = _local.buf = np.empty(max(size, _VECTOR_BLOCK))
    return buf


@contextlib.contextmanager
def _blas_single():
    """BLAS on one thread inside the block (our threads are the parallelism)."""
    libs = _blas_libs()
    saved = [lib.num_threads for lib in libs]
    for lib in libs:
        lib.set_num_threads(1)
    try:
        yield
    finally:
        for lib, n in zip(libs, saved):
            lib.set_num_threads(n)


def _workers() -> int:
    """Threads the products and elementary functions use: the cores this process may run on, at most BLAS's own
    thread count (OPENBLAS_NUM_THREADS=1, threadpoolctl's limits or a dataset worker's share of the cores limit ours
    too); 1 inside spread's tasks (BLAS on one thread there), so nothing nests."""
    return max(1, min([_cores(), *(lib.num_threads for lib in _blas_libs())]))


@functools.cache
def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@functools.cache
def _blas_libs() -> tuple:
    """threadpoolctl's controllers of the BLAS libraries loaded (found once: _workers asks on every product)."""
    return tuple(lib for lib in threadpoolctl.ThreadpoolController().lib_controllers if lib.user_api == "blas")


def _rounded_product(a64, b64, c, na, nb) -> np.ndarray:
    """RNE32 of each exact element of a64 @ b64, from its float64 value c and error bound e = na nb (step 3, then 4;
    na [..., M, 1] and nb [..., 1, N]: e is finite iff both are, zero where either is)."""
    e = na * nb                                                                 # (finite iff na and nb are: no
    if np.isfinite(e).all():                                                    # norm product overflows float64)
        block, undecided = _round_verified(c, e)
    else:                                                                       # an inf / NaN operand
        finite = np.isfinite(e)
        block, undecided = _round_verified(np.where(finite, c, 0), np.where(finite, e, 0))
        block = np.where(finite, block, _nonfinite(*_nonfinite_products(a64, b64)))
        undecided &= finite
    if undecided.any():
        idx = np.nonzero(undecided)
        if block.ndim == 2:                                                     # one product (a token's)
            rows, cols = a64[idx[0]], b64.T[idx[1]]                             # [F, K]
        else:
            batch = block.shape[:-2]
            rows = np.broadcast_to(a64, (*batch, *a64.shape[-2:]))[idx[:-1]]
            cols = np.broadcast_to(b64, (*batch, *b64.shape[-2:])).swapaxes(-1, -2)[(*idx[:-2], idx[-1])]
        block[idx] = _exact_sums(rows, cols)
    return block


def _round_verified(c: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 results where c - e and c + e round to one float32, and the mask of the undecided elements.
    c, e float64 (broadcasting), e >= 0 finite and large enough to cover the rounding of c -+ e. e = 0 means
    every product is zero: the sum is +0 (c may be -0 then). Each end is computed in float64 and rounded to float32
    once (the ufunc's output cast)."""
    lo, hi = (c - e).astype(np.float32), (c + e).astype(np.float32)
    undecided = lo.view(np.int32) != hi.view(np.int32)
    if not e.all():                                                             # (the zeros: one call when none)
        zero = e == 0
        lo[np.broadcast_to(zero, lo.shape)] = 0
        undecided &= ~zero
    return lo, undecided


def _exact_sums(a: np.ndarray, b: np.ndarray, chunk: int = 1 << 15) -> np.ndarray:
    """RNE32 of the exact sum_k a_fk b_fk for each row f of finite float64 a, b [F, K] (step 4), a chunk of rows
    at a time (in cache).

    One error-free extraction: with sigma a power of two >= 2 K max|p|, q = (sigma + p) - sigma is p on the grid
    ulp(sigma)/2 and r = p - q exactly, |r| <= 2^-53 sigma; sum q is exact in any order, and
    c = fl(sum q + fl(sum r)) errs by at most gamma_K K 2^-53 sigma + 2^-52 |c|. Where every r is 0, c = sum q is
    the exact sum and its cast to float32 is RNE32 (the exact float32 ties that sums of bfloat16-valued products
    often are: no fsum for them)."""
    F, K = a.shape
    out = np.empty(F, np.float32)
    rows = max(1, chunk // K)
    extra = math.ceil(math.log2(K)) + 1 if K else 1
    for f in range(0, F, rows):
        p = a[f:f + rows] * b[f:f + rows]                                        # exact products
        _, exponent = np.frexp(np.abs(p).max(axis=-1, keepdims=True))           # max|p| < 2^exponent
        sigma = np.ldexp(1.0, exponent + extra)                                 # [n, 1]
        q = (sigma + p) - sigma
        p -= q                                                                  # r, exactly
        c = q.sum(axis=-1) + p.sum(axis=-1)
        e = (K * _U / (1 - K * _U) * K * _U * (1 + 2.0 ** -20)) * sigma[:, 0] + np.abs(c) * 2.0 ** -51
        out[f:f + rows], undecided = _round_verified(c, e)
        if np.count_nonzero(undecided):
            exact = undecided & ~p.any(axis=-1)                                 # every r 0: c is the exact sum
            out[f:f + rows][exact] = (c[exact] + 0.0).astype(np.float32)       # RNE32(c); an exact zero +0
            for g in np.flatnonzero(undecided & ~exact):
                out[f + g] = _exact_sum_rounded((a[f + g] * b[f + g]).tolist())
    return out


def _exact_sum_rounded(terms: list) -> np.float32:
    """RNE32 of the exact sum s of finite float64 terms. r = RN64(s) (math.fsum) is within half a float64 ulp of s,
    so RNE32(s) = RNE32(r) unless r is itself a float32 rounding midpoint (float32 values and midpoints are float64
    numbers: s cannot cross one that r is not on); there the exact sign of s - r decides, and s = r is a tie."""
    r = math.fsum(terms) + 0.0              # RN64(s); + 0.0 makes an exact zero +0
    _, exponent = math.frexp(r)             # 2^(exponent - 1) <= |r| < 2^exponent
    half = math.ldexp(1.0, max(exponent - 25, -150))                           # half the float32 spacing at |r|
    with np.errstate(over="ignore"):
        if (abs(r) / half) % 2 != 1:        # not an odd multiple of the half spacing: not a midpoint
            return np.float32(r)
        residual = math.fsum(terms + [-r])  # r is a float32 midpoint: the exact sign of s - r decides
        if residual == 0:
            return np.float32(r)            # s = r exactly: IEEE's tie to even
        return np.float32(r + math.copysign(half, residual))                     # the neighbour toward s


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


def sumprod(a: np.ndarray, b: np.ndarray | None, axis: int = -1, keepdims: bool = False) -> np.ndarray:
    """sum_k a_k b_k along `axis` (broadcasting a and b; b None: sum_k a_k), correctly rounded like matmul; e.g.
    sumprod(x, x) is a sum of squares. The bound here is gamma_K sum_k |a_k b_k| itself (the sum itself where no
    term is negative: squares, or a block whose terms are all >= 0, as softmax's exps are). The sums are taken a
    block of rows at a time (its float64 terms stay in cache) and the blocks spread over the cores."""
    if np.result_type(a.dtype, np.float32 if b is None else b.dtype, np.float32) == np.float64 or _plain.get():
        return np.sum(a if b is None else a * b, axis=axis, keepdims=keepdims)
    squares = a is b
    if (b is None or squares) and a.ndim and a.size < _SPREAD_SUM and axis in (-1, a.ndim - 1):
        with np.errstate(invalid="ignore", over="ignore"):                    # small, summed where it lies
            out = _sums_of_terms(a, b)
        return out[..., None] if keepdims else out
    if b is not None and not squares:
        a, b = np.broadcast_arrays(a, b)
    a = np.moveaxis(a, axis, -1)
    shape, K = a.shape[:-1], a.shape[-1]
    a = a.reshape(-1, K)                                                        # [R, K] rows (a view if it can be)
    if b is not None and not squares:
        b = np.moveaxis(b, axis, -1).reshape(-1, K)
    out = np.empty(a.shape[0], np.float32)
    rows = max(1, _SUM_BLOCK // max(1, K))

    def block(i: int) -> None:                                                  # rows r .. r + n
        r = slice(i * rows, (i + 1) * rows)
        rows_a = a[r]
        out[r] = _sums_of_terms(rows_a, None if b is None else rows_a if squares else b[r])

    n = -(-a.shape[0] // rows)
    with np.errstate(invalid="ignore", over="ignore"):
        if a.size >= _SPREAD_SUM:
            spread(block, n)
        else:
            for i in range(n):
                block(i)
    out = out.reshape(shape)
    return np.expand_dims(out, axis) if keepdims else out


def _sums_of_terms(a: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    """RNE32 of each sum over the last axis of a's terms (b None) or of the products a b (b a itself: squares),
    [..., K] -> [...]; the bound from the sums themselves where no term is negative."""
    p = a.astype(np.float64) if b is None else np.multiply(a, b, dtype=np.float64)  # exact terms [..., K]
    c = p.sum(axis=-1)
    nonnegative = b is a or (b is None and a.min(initial=0) >= 0)              # (NaN compares False)
    return _sums(p, c, c if nonnegative else np.abs(p).sum(axis=-1), a.shape[-1],
                 lambda test: test(p).any(axis=-1), lambda idx: p[idx])


def sum(x: np.ndarray, axis: int = -1, keepdims: bool = False) -> np.ndarray:  # noqa: A001 (the kernel's name)
    """sum_k x_k along `axis`, correctly rounded (float32) or NumPy's float64 sum (float64); inside
    onnxruntime_cpu(), in ONNX Runtime's ReduceSum order for x's layout (reduce_sum_onnxruntime)."""
    if x.dtype == np.float64 or _plain.get():
        return np.sum(x, axis=axis, keepdims=keepdims)
    if _runtime.get():
        out = reduce_sum_onnxruntime(x, axis)
        return np.expand_dims(out, axis) if keepdims else out
    return sumprod(x, None, axis=axis, keepdims=keepdims)


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


MLAS_STRIDE = 128                           # MLAS_SGEMM_STRIDEN = MLAS_SGEMM_STRIDEK (mlasi.h): the B panel's sides
MLAS_STRIDE_N_MIN = 16                      # ... N's side is not narrowed below this (sgemm.cpp)
MLAS_LANES = 8                              # float32 lanes of the AVX registers of MLAS's M1 kernels (ymm)


def mlas_stride_k(N: int, K: int) -> int:
    """The K block of MLAS's SGEMM (MlasSgemmOperation, B not pre-packed, A not transposed) for an [M, K] @ [K, N]
    product: from 128 x 128 panels, a small K doubles N's side while K fits in half the K side (N >= K), a small N
    doubles K's side while N fits in half the N side (N < K; N's side stays >= 16)."""
    stride_n = stride_k = MLAS_STRIDE
    if N >= K:
        while stride_k // 2 >= K:
            stride_n, stride_k = stride_n * 2, stride_k // 2
    else:
        while stride_n > MLAS_STRIDE_N_MIN and stride_n // 2 >= N:
            stride_n, stride_k = stride_n // 2, stride_k * 2
    return stride_k


def mlas_sgemm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float32 a @ b with NumPy's broadcasting, summed as ONNX Runtime's CPU EP sums its MatMul (one MLAS thread per
    product, B a runtime tensor, not an initializer MLAS pre-packs: a QDQ model's dequantised weights). As
    MatMulComputeHelper does, a's leading axes fold into the rows M when b has no batch (b [K, N] or [1.., K, N]);
    else each batch is one [M, K] @ [K, N] product. MlasSgemmOperation then takes (x86-64 with AVX):
      M == 1:  MlasSgemmKernelM1Avx, b's rows added four at a time (matmul_mlas_m1);
      N == 1:  MlasSgemmKernelM1TransposeBAvx on (b, a), eight lanes and a per-row-group reduction (matmul_mlas_n1);
      else:    the FMA kernel per K block of mlas_stride_k(N, K) (matmul_sequential_fma).
    a [..., M, K], b [..., K, N] -> [..., M, N] float32."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    if b.shape[-2] != K:
        raise ValueError(f"matmul: inner dimensions differ: {a.shape} @ {b.shape}")
    fold = a.ndim >= b.ndim and math.prod(b.shape[:-2]) == 1
    rows = math.prod(a.shape[:-1]) if fold else M                                # ORT's M
    if rows == 1:
        return matmul_mlas_m1(a, b)
    if N == 1:
        if fold:
            out = matmul_mlas_n1(a.reshape(rows, K), b.reshape(K, 1))             # one [rows, K] @ [K, 1]
            return out.reshape(*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), M, 1)
        return matmul_mlas_n1(a, b)
    return matmul_sequential_fma(a, b, mlas_stride_k(N, K))


def matmul_sequential_fma(a: np.ndarray, b: np.ndarray, block: int) -> np.ndarray:
    """float32 a @ b summed as MLAS's SGEMM FMA kernels sum (ONNX Runtime's CPU EP, M > 1 and N > 1): per block of
    `block` terms of K (mlas_stride_k), acc = fma(a_k, b_k, acc) from acc = 0 in k order; the blocks' sums added
    to the result in order. a [..., M, K], b [..., K, N] -> [..., M, N] float32. Not correctly rounded: the
    runtime's own order (a QDQ model's 16-bit codes flip with its float32 roundings: docs/precision.md)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    K = a.shape[-1]
    shape = (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    out = None
    for k0 in range(0, K, block):
        acc = np.zeros(shape, np.float32)
        for k in range(k0, min(K, k0 + block)):
            acc = fma32(a[..., :, k:k + 1], b[..., k:k + 1, :], acc)              # acc = a_k b_k + acc, one rounding
        out = acc if out is None else out + acc
    return out if out is not None else np.zeros(shape, np.float32)


def matmul_mlas_m1(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float32 a @ b for one row of a, summed as MlasSgemmKernelM1Avx (ONNX Runtime's CPU EP, M == 1): products
    p_k = fl32(a_k b_kn) (vmulps, no FMA); per four rows k..k+3 of b, t = ((p_k + p_k+1) + p_k+2) + p_k+3, then
    c = t + c from c = +0; of the last K mod 4 rows, a pair t = p_k + p_k+1 (c = t + c), then a single p (c = p + c).
    a [..., 1, K], b [..., K, N] -> [..., 1, N] float32."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    K = a.shape[-1]
    p = a[..., 0, :, None] * b                                                  # p_kn = fl32(a_k b_kn)  [..., K, N]
    c = np.zeros(p.shape[:-2] + p.shape[-1:], np.float32)                       # +0  [..., N]
    k = 0
    for step in (4,) * (K // 4) + ((2,) if K % 4 >= 2 else ()) + ((1,) if K % 2 else ()):
        t = p[..., k, :]
        for j in range(k + 1, k + step):
            t = t + p[..., j, :]                                                # t = ((p_k + p_k+1) + ...) in order
        c, k = t + c, k + step
    return c[..., None, :]


def matmul_mlas_n1(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float32 a @ b for one column b, summed as MlasSgemmKernelM1TransposeBAvx on (b, a) (ONNX Runtime's CPU EP,
    N == 1: MlasSgemmOperation computes C^T = b^T a^T, a's rows being the kernel's transposed B):
      products p_k = fl32(a_mk b_k) (vmulps, no FMA), eight lanes: s_j = (((+0 + p_j) + p_j+8) + p_j+16) + ...,
      k = j mod 8 (vaddps; the last K mod 8 lanes loaded masked: + a zero product);
      the lanes reduced by the rows' group (a's rows in fours from row 0, then a pair, then a single row):
        four:   (((s0 + s1) + s2) + s3) + (((s4 + s5) + s6) + s7)
        pair:   ((s0 + s2) + (s4 + s6)) + ((s1 + s3) + (s5 + s7))
        single: ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
      then + 0 (beta = 0: C masked to +0, added).
    a [..., M, K], b [..., K, 1] -> [..., M, 1] float32."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    M, K = a.shape[-2:]
    p = a * np.swapaxes(b, -1, -2)                                              # p_mk = fl32(a_mk b_k)  [..., M, K]
    L = MLAS_LANES
    chunks = -(-K // L)
    p = np.concatenate([p, np.zeros((*p.shape[:-1], chunks * L - K), np.float32)], axis=-1)   # masked: + 0 products
    s = np.zeros((*p.shape[:-1], L), np.float32)                                 # the lanes, from +0  [..., M, 8]
    for c in range(chunks):
        s = s + p[..., c * L:(c + 1) * L]                                       # s_j += p_j+8c
    l = [s[..., j] for j in range(L)]                                           # noqa: E741
    four = (((l[0] + l[1]) + l[2]) + l[3]) + (((l[4] + l[5]) + l[6]) + l[7])
    pair = ((l[0] + l[2]) + (l[4] + l[6])) + ((l[1] + l[3]) + (l[5] + l[7]))
    single = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
    m4 = M // 4 * 4
    group = np.where(np.arange(M) < m4, 0, np.where(np.arange(M) < m4 + (M % 4 // 2) * 2, 1, 2))  # four, pair, single
    out = np.choose(np.broadcast_to(group, four.shape), (four, pair, single)) + np.float32(0)
    return out[..., None]


EIGEN_PACKET = 4                            # float32 lanes of Eigen's packets in ONNX Runtime's CPU build (SSE)


def eigen_sum(x: np.ndarray, head: int = 0) -> np.ndarray:
    """float32 sum over the last axis as Eigen's vectorised redux (ONNX Runtime's CPU EP: packets of EIGEN_PACKET
    lanes) sums a row whose first `head` elements precede its first packet-aligned one: over the whole packets
    from there, two packet accumulators over alternate packets, added; a last odd packet added; the lanes halved
    pairwise (predux); then the head elements, then the tail, each added in order. Fewer than one packet after
    the head: x_0 + x_1 + ... in order.  [..., n] -> [...]"""
    n, w = x.shape[-1], EIGEN_PACKET
    h = min(head, n)
    whole = (n - h) // w * w
    if not whole:
        s = x[..., 0] if n else np.zeros(x.shape[:-1], np.float32)
        for i in range(1, n):
            s = s + x[..., i]                                                   # too short: in order
        return s
    pairs = h + (n - h) // (2 * w) * 2 * w
    r0 = x[..., h:h + w]
    if whole > w:
        r1 = x[..., h + w:h + 2 * w]
        for i in range(h + 2 * w, pairs, 2 * w):
            r0, r1 = r0 + x[..., i:i + w], r1 + x[..., i + w:i + 2 * w]         # two accumulators
        r0 = r0 + r1
        if h + whole > pairs:
            r0 = r0 + x[..., pairs:pairs + w]                                   # the odd packet
    while r0.shape[-1] > 1:                                                     # predux: halves added
        r0 = r0[..., :r0.shape[-1] // 2] + r0[..., r0.shape[-1] // 2:]
    s = r0[..., 0]
    for i in (*range(h), *range(h + whole, n)):
        s = s + x[..., i]                                                       # the head, then the tail, in order
    return s


def reduce_sum_onnxruntime(x: np.ndarray, axis: int) -> np.ndarray:
    """float32 sum of x over one axis as ONNX Runtime's CPU EP's ReduceSum sums it (x a C-ordered tensor, its buffer
    16-byte aligned, one thread). With pre / post the sizes of the axes before / after `axis`, its fast paths:
      post == 1 (KR): each row of n by Eigen's redux (eigen_sum), row r's head the elements before its first
        16-byte boundary, (-r n) mod EIGEN_PACKET;
      pre == 1 (RK): the rows of the axis added in order, x_0 + x_1 + ... (Eigen's += on arrays);
      else (KRK): per leading index, MatMul(ones [1, n], x [n, post]): MLAS's M == 1 kernel (matmul_mlas_m1).
    [..., n, ...] -> [..., ...]"""
    x = np.asarray(x, np.float32)
    axis = axis % x.ndim
    pre, n, post = math.prod(x.shape[:axis]), x.shape[axis], math.prod(x.shape[axis + 1:])
    shape = x.shape[:axis] + x.shape[axis + 1:]
    if post == 1:
        rows = x.reshape(pre, n)
        heads = (-(np.arange(pre) * n)) % EIGEN_PACKET
        out = np.empty(pre, np.float32)
        for h in np.unique(heads):
            out[heads == h] = eigen_sum(rows[heads == h], int(h))
        return out.reshape(shape)
    if pre == 1:
        rows = x.reshape(n, post)
        s = rows[0]
        for i in range(1, n):
            s = s + rows[i]                                                     # row by row
        return s.reshape(shape)
    ones = np.ones((pre, 1, n), np.float32)
    return matmul_mlas_m1(ones, x.reshape(pre, n, post)).reshape(shape)


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
