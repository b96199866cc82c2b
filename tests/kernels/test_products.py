"""The correctly rounded products, sums and elementary functions against exact references (tests/exact.py: Python
Fractions and an integer round-half-to-even; mpmath at 200 bits for the functions): every element bit-identical,
on random shapes, K from 1 to 10^5, exact float32 rounding midpoints and their neighbours, heavy cancellation,
mixed magnitudes, subnormal results, overflow, inf and NaN."""

from fractions import Fraction

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import exact
from refimpl.kernels import elementary, products

F32 = np.float32


def bits(a) -> np.ndarray:
    return np.asarray(a, F32).view(np.int32)


def assert_bits(got, want):
    got, want = np.asarray(got, F32), np.asarray(want, F32)
    assert got.shape == want.shape
    same = (bits(got) == bits(want)) | (np.isnan(got) & np.isnan(want))
    i = np.argwhere(~same)
    assert same.all(), f"{len(i)} elements differ, first at {tuple(i[0])}: got {got[tuple(i[0])]!r}, " \
                       f"exact {want[tuple(i[0])]!r}"


def scaled(rng, shape, spread: int) -> np.ndarray:
    """Normal values times 2^e, e uniform in [-spread, spread]: mixed magnitudes."""
    return (rng.standard_normal(shape) * 2.0 ** rng.integers(-spread, spread + 1, shape)).astype(F32)


@settings(max_examples=60, deadline=None)
@given(M=st.integers(1, 5), K=st.integers(1, 400), N=st.integers(1, 5), spread=st.sampled_from([0, 8, 40]),
       seed=st.integers(0, 2**32 - 1))
def test_matmul_is_the_exact_product_rounded_once(M, K, N, spread, seed):
    rng = np.random.default_rng(seed)
    a, b = scaled(rng, (M, K), spread), scaled(rng, (K, N), spread)
    assert_bits(products.matmul(a, b), exact.matmul(a, b))


@pytest.mark.parametrize("K", [1, 2, 3, 1000, 4096, 100_000])
def test_long_sums(K):
    """K up to 10^5: a row of a weight matrix times an activation, and the same with heavy cancellation."""
    rng = np.random.default_rng(K)
    a, b = scaled(rng, (2, K), 4), scaled(rng, (K, 2), 4)
    b[:, 1] = -b[:, 0]
    b[0, 1] += F32(1e-3)                    # column 1 cancels all but one product of column 0
    assert_bits(products.matmul(a, b), exact.matmul(a, b))


def midpoint_cases():
    """Rows whose exact product sum is a float32 rounding midpoint (a tie), or lies 2^-100 above or below one,
    or is such a value behind a cancelling pair of 2^60-sized products (the float64 BLAS sum loses it)."""
    rng = np.random.default_rng(7)
    rows = []
    for f in np.concatenate([scaled(rng, 40, 30), [F32(1), F32(3), F32(2.0 ** -126), F32(2.0 ** 100)]]):
        half = float(np.spacing(abs(f))) / 2                       # f + half is the midpoint above f
        for tail in (0.0, 2.0 ** -100 * abs(float(f)), -(2.0 ** -100) * abs(float(f))):
            rows.append([float(f), half, tail, 0.0, 0.0])
            rows.append([float(f), half, tail, 2.0 ** 60, -(2.0 ** 60)])
    return np.array(rows, F32)


def test_ties_and_near_ties_round_as_ieee_says():
    a = midpoint_cases()
    ones = np.ones((a.shape[1], 1), F32)
    got = products.matmul(a, ones)
    assert_bits(got, exact.matmul(a, ones))
    ties = a[:, 2] == 0
    f = a[ties, 0]
    assert np.all(bits(got[ties, 0]) & 1 == 0), "a tie must round to the even neighbour"
    assert np.all((got[ties, 0] == f) | (got[ties, 0] == np.nextafter(f, F32(np.inf))))


def test_bfloat16_valued_operands_whose_sums_are_exact_ties():
    """bfloat16-valued activations and weights (8-bit significands): the float64 sum of their products is often exact
    and a float32 midpoint; such ties round to even, like every other element, bit for bit."""
    import ml_dtypes
    rng = np.random.default_rng(11)
    a = rng.standard_normal((16, 64)).astype(ml_dtypes.bfloat16).astype(F32)
    b = (rng.standard_normal((64, 16)) / 8).astype(ml_dtypes.bfloat16).astype(F32)
    got, want = products.matmul(a, b), exact.matmul(a, b)
    assert_bits(got, want)
    ties = 0
    for i in range(16):                     # the exact sums: how many are ties (the case this test is about)
        for j in range(16):
            s = sum(Fraction(float(x)) * Fraction(float(y)) for x, y in zip(a[i], b[:, j]))
            f = np.float32(float(s))
            g = np.nextafter(f, F32(np.inf) if s > Fraction(float(f)) else F32(-np.inf))
            ties += s == (Fraction(float(f)) + Fraction(float(g))) / 2
    assert ties >= 10, f"{ties} exact ties among 256 sums: the case is not exercised"


def test_subnormal_zero_and_overflowing_results():
    tiny, big = F32(2.0 ** -75), F32(2.0 ** 64)
    a = np.array([[tiny, tiny], [tiny, -tiny], [big, big], [F32(0), F32(0)], [-tiny, F32(0)]], F32)
    b = np.array([[F32(1.5 * 2.0 ** -75)], [F32(2.0 ** -76)]], F32)
    c = np.array([[big], [big]], F32)
    assert_bits(products.matmul(a, b), exact.matmul(a, b))              # 2^-150 * 1.5 + ...: subnormal / 0
    assert_bits(products.matmul(a, c), exact.matmul(a, c))              # 2^129: inf; 0 * big: +0
    assert bits(products.matmul(a[3:4], -c))[0, 0] == 0                 # an exact zero sum is +0
    assert np.signbit(products.matmul(a[4:5], b))[0, 0]                 # -2^-150 * 1.5: rounds to -2^-149


def test_an_empty_inner_dimension_sums_to_plus_zero():
    """An empty inner dimension sums nothing: +0 (it raised before)."""
    assert bits(products.matmul(np.ones((3, 0), F32), np.ones((0, 4), F32))).tolist() == [[0] * 4] * 3
    assert bits(products.matmul(np.ones((2, 5, 0), F32), np.ones((2, 0, 70), F32))).tolist() == [[[0] * 70] * 5] * 2


def test_non_finite_operands_follow_ieee():
    inf, nan = F32(np.inf), F32(np.nan)
    a = np.array([[inf, 1, 0], [1, 2, 3], [nan, 0, 0], [inf, 1, 1], [1, 1, 1]], F32)
    b = np.array([[0, 1, 1], [1, 1, 1], [1, -inf, inf]], F32)
    got = products.matmul(a, b)
    want = np.array([[np.nan, np.nan, np.nan], [5, -np.inf, np.inf], [np.nan] * 3, [np.nan, np.nan, np.inf],
                     [2, -np.inf, np.inf]], F32)                    # 0 * inf is NaN; inf + -inf is NaN
    assert_bits(got, want)
    assert np.all(bits(got[np.isnan(got)]) == np.int32(0x7FC00000)), "one quiet NaN"


def test_batched_broadcasting_and_float64_oracle():
    rng = np.random.default_rng(3)
    a, b = scaled(rng, (2, 1, 3, 7), 3), scaled(rng, (1, 4, 7, 2), 3)
    got = products.matmul(a, b)
    for i in range(2):
        for j in range(4):
            assert_bits(got[i, j], exact.matmul(a[i, 0], b[0, j]))
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    assert np.array_equal(products.matmul(a64, b64), np.matmul(a64, b64))


@settings(max_examples=40, deadline=None)
@given(shape=st.tuples(st.integers(1, 4), st.integers(1, 300)), spread=st.sampled_from([0, 20]),
       seed=st.integers(0, 2**32 - 1))
def test_sums_sum_of_squares_and_prefix_sums(shape, spread, seed):
    rng = np.random.default_rng(seed)
    x = scaled(rng, shape, spread)
    assert_bits(products.sum(x, axis=-1), [exact.to_float32(exact.dot(r, np.ones_like(r))) for r in x])
    assert_bits(products.sumprod(x, x, axis=-1), exact.sum_squares(x)[..., 0])
    prefix = [[exact.to_float32(exact.dot(r[:i + 1], np.ones(i + 1))) for i in range(len(r))] for r in x]
    assert_bits(products.cumsum(x, axis=-1), prefix)
    assert_bits(products.sum(x[0]), exact.to_float32(exact.dot(x[0], np.ones_like(x[0]))))


def test_large_sums_are_blocked_and_spread_with_the_same_bits():
    """A sum over many rows is taken a block of rows at a time, the blocks spread over the cores (products._SUM_BLOCK,
    _SPREAD_SUM): every row is still its exact sum rounded once, across block boundaries, in rows whose terms are
    all >= 0 (softmax's exps: the bound is the sum itself), mixed in sign, cancelling to a float32 tie, or not
    finite; a sum of squares over a middle axis alike."""
    rng = np.random.default_rng(5)
    x = scaled(rng, (2000, 200), 20)                                    # 400,000 terms: spread, 164 rows a block
    x[::3] = np.abs(x[::3])                                             # rows of terms >= 0
    x[7] = 0
    x[7, :5] = [2.0 ** 30, 1, -2.0 ** 30, 2.0 ** -24, 3 * 2.0 ** -149]  # 1 + 2^-24: a tie in float64, a subnormal
                                                                        # over it: rounds up, to 1 + 2^-23
    x[163:166, 5] = [np.inf, np.nan, -np.inf]                           # at a block boundary (164 rows a block)
    got = products.sum(x, axis=-1)
    want = np.array([np.sum(r) if not np.isfinite(r).all() else exact.to_float32(exact.dot(r, np.ones_like(r)))
                     for r in x], F32)
    assert_bits(got, want)
    t = x[:40].reshape(8, 5, 200).transpose(0, 2, 1)                    # [8, 200, 5]: sums over the middle axis
    assert got[7] == np.float32(1 + 2.0 ** -23)
    assert_bits(products.sumprod(t, t, axis=1), exact.sum_squares(x[:40]).reshape(8, 5))


def test_plain_blas_is_opt_in():
    rng = np.random.default_rng(0)
    a, b = scaled(rng, (4, 300), 0), scaled(rng, (300, 3), 0)
    with products.plain_blas():
        assert np.array_equal(products.matmul(a, b), a @ b)
    assert_bits(products.matmul(a, b), exact.matmul(a, b))


def test_products_written_into_a_column_block_are_the_same_bits():
    """matmul(out=) (a blocked lm_head's blocks in place): each mode writes the bits it returns, into a strided
    column block of a larger array; an out of the wrong shape or dtype is refused."""
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((5, 70), dtype=F32), rng.standard_normal((70, 90), dtype=F32)
    for mode in (products.plain_blas, products.onnxruntime_cpu, lambda: products.plain_blas(False)):
        with mode():
            whole = np.full((5, 200), np.nan, F32)
            got = products.matmul(a, b, out=whole[:, 60:150])
            assert np.shares_memory(got, whole)
            assert np.array_equal(bits(whole[:, 60:150]), bits(products.matmul(a, b)))
            assert np.isnan(whole[:, :60]).all() and np.isnan(whole[:, 150:]).all()
    with pytest.raises(ValueError, match="out is float32"):
        products.matmul(a, b, out=np.empty((5, 89), F32))


def test_fma32_rounds_once_and_the_runtime_order_is_a_chain_of_them():
    """fma32(a, b, c) is RNE32 of the exact a b + c (tests/exact.py's Fraction rounding), midpoints included
    (a b exactly halfway between two float32, c a tiny nudge either way); ONNX Runtime's order (onnxruntime_cpu) is
    that chain from 0 over each K block (256 terms here), blocks added; the float path outside it stays correctly
    rounded. (Against ONNX Runtime itself: tests/e2e/test_quantised_refimpl.py.)"""
    from fractions import Fraction
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal(300).astype(np.float32), rng.standard_normal(300).astype(np.float32)
    c = np.concatenate([rng.standard_normal(100), -(a[100:200].astype(np.float64) * b[100:200]),
                        rng.standard_normal(100) * 1e-9]).astype(np.float32)
    half = np.float32(1 + 2 ** -12)                          # half^2 = 1 + 2^-11 + 2^-24: a float32 midpoint
    a, b = np.append(a, [half] * 3), np.append(b, [half] * 3)
    c = np.append(c, np.array([0, 2.0 ** -60, -2.0 ** -60], np.float32))
    want = [exact.to_float32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))) for x, y, z in zip(a, b, c)]
    assert_bits(products.fma32(a, b, c), want)
    x, w = scaled(rng, (3, 600), 0), scaled(rng, (600, 40), 0)
    step = products.mlas_stride_k(40, 600)                  # N = 40 < K: N's side 64, K's 256
    assert step == 256
    with products.onnxruntime_cpu():
        got = products.matmul(x, w)
    blocks = []
    for k0 in range(0, 600, step):
        acc = np.zeros((3, 40), np.float32)
        for k in range(k0, min(600, k0 + step)):
            acc = products.fma32(x[:, k:k + 1], w[k:k + 1], acc)
        blocks.append(acc)
    assert_bits(got, (blocks[0] + blocks[1]) + blocks[2])
    assert_bits(products.matmul(x, w), exact.matmul(x, w))


# --- elementary functions -------------------------------------------------------------------------------------

def mp_rounded(fn, x) -> np.ndarray:
    """RNE32 of fn at each float32 x, evaluated with mpmath at 200 bits, rounded by tests/exact.py."""
    out = []
    with mpmath.workprec(200):
        for v in np.ravel(x):
            y = fn(mpmath.mpf(float(v)))
            if mpmath.isnan(y) or mpmath.isinf(y):
                out.append(F32(float(y)))
            else:
                sign, man, exp, _ = mpmath.mpf(y)._mpf_
                out.append(exact.to_float32((-1) ** sign * Fraction(man) * Fraction(2) ** exp))
    return np.array(out, F32).reshape(np.shape(x))


FUNCTIONS = {
    "exp": (elementary.exp, mpmath.exp, 100.0),
    "cos": (elementary.cos, mpmath.cos, 1e5),
    "sin": (elementary.sin, mpmath.sin, 1e5),
    "sigmoid": (elementary.sigmoid, lambda v: 1 / (1 + mpmath.exp(-v)), 120.0),
    "silu": (elementary.silu, lambda v: v / (1 + mpmath.exp(-v)), 120.0),
    "softplus": (elementary.softplus, lambda v: mpmath.log1p(mpmath.exp(v)) if v <= 20 else v, 40.0),
    "log": (elementary.log, lambda v: mpmath.log(v) if v > 0 else (mpmath.ninf if v == 0 else mpmath.nan), None),
}


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_elementary_functions_are_correctly_rounded(name):
    fn, reference, bound = FUNCTIONS[name]
    rng = np.random.default_rng(1)
    if bound is None:
        x = np.abs(scaled(rng, 3000, 60)) + F32(2.0 ** -100)
    else:
        x = np.concatenate([rng.uniform(-bound, bound, 2500), scaled(rng, 500, 20)]).astype(F32)
    x = np.concatenate([x, np.array([0, -0.0, 1, -1, 2.0 ** -149], F32)])
    if bound is not None:
        x = np.clip(x, -bound, bound)
    assert_bits(fn(x), mp_rounded(reference, x))


def test_plain_silu_is_float32_within_a_few_ulp():
    """Inside plain_blas(), silu is float32's x / (1 + e^-x): within 4 ulp of the correctly rounded value on normal
    results (subnormal ones may flush), the same infinities and NaNs."""
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.uniform(-30, 30, 3000), scaled(rng, 500, 10)]).astype(F32)
    want = elementary.silu(x)
    with products.plain_blas():
        got = elementary.silu(x)
        edges = elementary.silu(np.array([np.inf, -np.inf, np.nan], F32))
    normal = np.abs(want) >= np.finfo(F32).tiny
    assert np.abs(bits(got).astype(np.int64) - bits(want))[normal].max() <= 4
    assert_bits(edges, [np.inf, np.nan, np.nan])


def test_elementary_functions_at_the_edges():
    inf, nan = F32(np.inf), F32(np.nan)
    x = np.array([inf, -inf, nan, F32(3e38), F32(-3e38), F32(-104), F32(89)], F32)
    assert_bits(elementary.exp(x), [inf, 0, nan, inf, 0, mp_rounded(mpmath.exp, F32(-104)), inf])
    assert_bits(elementary.sigmoid(x[:5]), [1, 0, nan, 1, 0])
    assert_bits(elementary.silu(x[:5]), [inf, nan, nan, F32(3e38), -0.0])
    assert_bits(elementary.log(np.array([0, -1, inf], F32)), [-inf, nan, inf])
