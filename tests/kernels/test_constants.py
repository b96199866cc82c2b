"""A weight's products from its products.Constant (column norms made once, maybe a float64 copy) and spread over
threads give the same bits as the product of the bare array, block by block in one thread, and as the exact
product rounded once (tests/exact.py, an oracle the kernel does not use)."""

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import exact
from refimpl.kernels import products

F32 = np.float32


def bits(a) -> np.ndarray:
    a = np.asarray(a, F32)
    return np.where(np.isnan(a), np.int32(0x7FC00000), a.view(np.int32))


def scaled(rng, shape, spread: int) -> np.ndarray:
    return (rng.standard_normal(shape) * 2.0 ** rng.integers(-spread, spread + 1, shape)).astype(F32)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 64 columns (the kernel's smallest), so a few hundred columns are several blocks and one-row
    products take the threaded path, and every product spreads its blocks (the same for every generated input:
    nothing is reset between them)."""
    monkeypatch.setattr(products, "_SPREAD_WORK", 0)
    monkeypatch.setattr(products, "_workers", lambda: 2)    # two threads even where BLAS runs on one (make test)
    monkeypatch.setattr(products, "_IN_BLOCK", 64)
    monkeypatch.setattr(products, "_OUT_BLOCK", 64)
    monkeypatch.setattr(products, "_VECTOR_BLOCK", 64)


def serial(a, b):
    """The product of the bare array, every block in this thread (the path before constants and threads)."""
    saved = products._THREADED_ROWS, products._SPREAD_WORK
    products._THREADED_ROWS, products._SPREAD_WORK = -1, float("inf")
    try:
        return products.matmul(a, b)
    finally:
        products._THREADED_ROWS, products._SPREAD_WORK = saved


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(M=st.sampled_from([1, 2, 8, 9]), K=st.integers(1, 120), N=st.integers(1, 260),
       spread=st.sampled_from([0, 8, 40]), special=st.sampled_from([None, np.inf, -np.inf, np.nan, 0.0]),
       seed=st.integers(0, 2**32 - 1))
def test_constant_and_threaded_products_are_the_same_bits(small_blocks, M, K, N, spread, special, seed):
    rng = np.random.default_rng(seed)
    a, w = scaled(rng, (M, K), spread), scaled(rng, (N, K), spread)       # w: a weight [out, in]
    if special is not None:                                               # one non-finite (or zero) weight
        w[rng.integers(N), rng.integers(K)] = special
    want = serial(a, w.T)
    for keep in (False, True):
        c = products.constant(w.T, keep_float64=keep)
        assert (c.b64 is not None) == keep and c.norms.shape == (1, N)
        assert np.array_equal(bits(products.matmul(a, c)), bits(want)), f"keep_float64={keep}"
    assert np.array_equal(bits(products.matmul(a, w.T)), bits(want))     # threaded, converting per block
    if special is None and K * M * N <= 4000:
        assert np.array_equal(bits(want), bits(exact.matmul(a, w.T)))


def test_constant_of_near_ties(small_blocks):
    """Rows whose exact sums are float32 midpoints or within 2^-100 of one: the exact fallback decides them the
    same way from a Constant's norms and float64 copy, in threads."""
    rng = np.random.default_rng(7)
    rows = []
    for f in scaled(rng, 40, 30):
        half = float(np.spacing(abs(f))) / 2
        for tail in (0.0, 2.0 ** -100 * abs(float(f)), -(2.0 ** -100) * abs(float(f))):
            rows.append([float(f), half, tail, 2.0 ** 60, -(2.0 ** 60)])
    w = np.array(rows, F32)                                 # [120, 5]: each row's sum against ones is a near tie
    ones = np.ones((1, 5), F32)
    want = exact.matmul(ones, w.T)
    for keep in (False, True):
        assert np.array_equal(bits(products.matmul(ones, products.constant(w.T, keep))), bits(want))


def test_float64_and_plain_modes_take_the_array():
    rng = np.random.default_rng(1)
    a, w = scaled(rng, (3, 20), 2), scaled(rng, (7, 20), 2)
    c = products.constant(w.T, keep_float64=True)
    with products.plain_blas():
        assert np.array_equal(products.matmul(a, c), np.matmul(a, w.T))
    a64 = a.astype(np.float64)
    assert np.array_equal(products.matmul(a64, products.constant(w.T.astype(np.float64))),
                          np.matmul(a64, w.T.astype(np.float64)))


def test_spread_runs_every_task_once_and_reraises(monkeypatch):
    """products.spread: the threads take tasks in turn; each runs once, and a task's exception reaches the caller."""
    monkeypatch.setattr(products, "_workers", lambda: 2)
    seen = []
    products.spread(seen.append, 50)
    assert sorted(seen) == list(range(50))

    def task(i):
        if i == 7:
            raise ZeroDivisionError(i)
    with pytest.raises(ZeroDivisionError):
        products.spread(task, 20)


def test_plain_one_token_products_are_blas_by_column_blocks(monkeypatch):
    """Plain BLAS one-token products spread over threads: each column block is NumPy's own product of that block
    (the blocks depend on the shapes alone, so every run gives the same bits)."""
    monkeypatch.setattr(products, "_PLAIN_BLOCK", 64)
    monkeypatch.setattr(products, "_PLAIN_SPREAD", True)
    rng = np.random.default_rng(3)
    a, w = scaled(rng, (1, 16), 4), scaled(rng, (100, 16), 4)
    with products.plain_blas():
        got = products.matmul(a, w.T)
    want = np.concatenate([np.matmul(a, w.T[:, j:j + 4]) for j in range(0, 100, 4)], axis=1)
    assert np.array_equal(bits(got), bits(want))


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("row", [None, "zero", np.inf, -np.inf, np.nan])
def test_few_rows_over_kept_copies_take_the_short_path_or_the_general_one(M, row):
    """One token's product over a kept float64 copy (_few_rows_kept, a decode step's path) gives the exact product
    rounded once; a zero or non-finite row of a goes the general way (IEEE's answer, +0 for a zero row)."""
    rng = np.random.default_rng(11)
    a, w = scaled(rng, (M, 70), 8), scaled(rng, (90, 70), 8)
    if row == "zero":
        a[M - 1] = 0
    elif row is not None:
        a[M - 1, 5] = row
    c = products.constant(w.T, keep_float64=True)
    assert c.positive
    short = products._few_rows_kept(a, c)
    assert (short is None) == (row is not None)
    want = serial(a, w.T)
    assert np.array_equal(bits(products.matmul(a, c)), bits(want))
    if row is None:
        assert np.array_equal(bits(short), bits(exact.matmul(a, w.T)))
    w[3, 4] = 0                                                           # a zero column of b = w^T: not positive
    w[3] = 0
    assert not products.constant(w.T, keep_float64=True).positive


@pytest.mark.parametrize("terms", [
    [1 + 2.0 ** -23, 2.0 ** -24, -(2.0 ** -52), 2.0 ** -60],   # RN64 one float64 step below a float32 midpoint
    [1 + 2.0 ** -23, 2.0 ** -24, 2.0 ** -52],                  # ... above it
    [1.0, 2.0 ** -24, 2.0 ** -70], [1.0, 2.0 ** -24, -(2.0 ** -70)], [1.0, 2.0 ** -24],   # on it: the residual, a tie
    [float(np.finfo(F32).max), 2.0 ** 103, -(2.0 ** 60)], [float(np.finfo(F32).max), 2.0 ** 103],   # the overflow edge
    [2.0 ** -149, 2.0 ** -150, -(2.0 ** -200)],               # the subnormal spacing
])
def test_exact_fallback_rounds_sums_near_a_midpoint(terms):
    """The last step of the fallback: RNE32 of an exact sum whose float64 rounding is on, or one step off, a float32
    rounding midpoint (found by an adversarial review: one step off was taken for on, and the residual's sign then
    picked the neighbour across it)."""
    from fractions import Fraction
    with np.errstate(over="ignore"):
        want = exact.to_float32(sum((Fraction(t) for t in terms), Fraction(0)))
        assert bits(products._exact_sum_rounded(list(terms))) == bits(want)



def test_few_rows_over_kept_copies_overflow_quietly_and_check_out():
    """The short path overflows to inf as IEEE does, without a warning (as the general path), and checks `out`."""
    w, a = np.full((4, 3), 3e38, F32), np.full((1, 3), 2, F32)
    c = products.constant(w.T, keep_float64=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.all(products.matmul(a, c) == np.inf)
    for out in (np.empty((1, 4)), np.empty(4, F32), np.empty((2, 1, 4), F32)):
        with pytest.raises(ValueError, match="out is"):
            products.matmul(a, c, out=out)
