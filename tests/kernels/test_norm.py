"""RMSNorm variants: models.md §3.1. Properties in float64; parity with transformers' Qwen3RMSNorm (plain),
Qwen3NextRMSNorm (zero-centred) and Qwen3NextRMSNormGated (gated) in float32 (oracle)."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import exact
from refimpl.kernels.activation import silu
from refimpl.kernels.norm import rms_norm, rms_norm_gated

FLOATS = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]


@st.composite
def rows(draw, dtype=np.float64, scale=None):
    """x [..., n], weight [n] (around 1, randomised as the oracle tests randomise every 1-D parameter)."""
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=2))) + (draw(st.integers(1, 64)),)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    s = draw(st.sampled_from([1e-3, 1.0, 1e3])) if scale is None else scale
    x = (s * rng.standard_normal(shape)).astype(dtype)
    w = (1 + 0.3 * rng.standard_normal(shape[-1])).astype(dtype)
    return x, w


def reference(x, w, eps):
    """w * x / sqrt(mean(x^2) + eps), float64."""
    x = x.astype(np.float64)
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


@settings(max_examples=50, deadline=None)
@given(t=rows(), eps=st.sampled_from([1e-6, 1e-5, 0.0]))
def test_formula(t, eps):
    """eps inside the root, added to the mean of squares (not the sum, not outside the root)."""
    x, w = t
    np.testing.assert_allclose(rms_norm(x, w, eps), reference(x, w, eps), rtol=1e-14, atol=1e-300)


@settings(max_examples=50, deadline=None)
@given(t=rows(), c=st.floats(1e-3, 1e3), k=st.integers(-60, 60))
def test_scale_invariance(t, c, k):
    """rms_norm(c x) == rms_norm(x) for c > 0 when eps is negligible: eps = 0 gives 1e-15 agreement, and a power
    of two c = 2^k gives bit-identical output (every step scales exactly). With eps = 1e-6 and a tiny x the
    invariance breaks, as it must (eps dominates the mean)."""
    x, w = t
    if not np.any(x):
        return
    y = rms_norm(x, w, 0.0)
    np.testing.assert_allclose(rms_norm(c * x, w, 0.0), y, rtol=1e-14, atol=1e-300)
    assert np.array_equal(rms_norm(np.ldexp(x, k), w, 0.0), y)
    big = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True)) * 1e3  # rms >= 1e3: eps 1e-6 is <= 1e-12 relative
    np.testing.assert_allclose(rms_norm((1 + c) * big, w, 1e-6), rms_norm(big, w, 1e-6), rtol=1e-12)
    tiny = big * 1e-6  # rms 1e-3: mean 1e-6 == eps
    np.testing.assert_allclose(rms_norm(tiny, w, 1e-6), y / np.sqrt(2), rtol=1e-12)


@settings(max_examples=50, deadline=None)
@given(t=rows(), eps=st.sampled_from([1e-6, 1e-5]), dtype=st.sampled_from([np.float32, np.float64]))
def test_zero_centred_with_w_equals_plain_with_one_plus_w(t, eps, dtype):
    """In float32/float64 the casts are no-ops: nu(x) * (1 + w) == (1 + w) * nu(x) bit for bit."""
    x, w = (a.astype(dtype) for a in t)
    zc = rms_norm(x, w, eps, zero_centered=True)
    assert np.array_equal(zc, rms_norm(x, 1 + w, eps))
    assert not np.allclose(zc, rms_norm(x, w, eps))  # it is not the plain norm with w


@settings(max_examples=40, deadline=None)
@given(t=rows(), eps=st.sampled_from([1e-6, 1e-5]))
def test_gated_norm_is_plain_norm_times_silu_gate(t, eps):
    """y = (w * nu(x)) * silu(z): z = 0 gives 0; z -> +inf gives z * plain (sigmoid(z) == 1 in float64 for z >= 40);
    z -> -inf gives 0; in general plain * z * sigmoid(z)."""
    x, w = t
    plain = rms_norm(x, w, eps)
    z = np.random.default_rng(x.size).normal(0, 3, x.shape)
    np.testing.assert_allclose(rms_norm_gated(x, z, w, eps), plain * z / (1 + np.exp(-z)), rtol=1e-14, atol=1e-300)
    assert np.all(rms_norm_gated(x, np.zeros_like(x), w, eps) == 0)
    for big in (40.0, 1e3, 1e300):
        np.testing.assert_allclose(rms_norm_gated(x, np.full_like(x, big), w, eps) / big, plain, rtol=1e-15, atol=0)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        assert np.all(rms_norm_gated(x, np.full_like(x, -1e300), w, eps) == 0)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_output_dtype_is_the_input_dtype_and_casts_sit_where_transformers_casts(dtype):
    """Every variant returns x's dtype. nu is computed in float32 (float64 for float64 input) as x * (1/sqrt(.))
    and cast where transformers casts: plain w * cast(nu), zero-centred cast(nu * (1 + w)), gated
    cast(cast(w * cast(nu)) * silu(float32 z)) (w * cast(nu) is a product in x's dtype); bit for bit, with the
    kernels' own silu (tested against torch in test_activation.py). For float16 / bfloat16 other placements differ."""
    rng = np.random.default_rng(0)
    x = (100 * rng.standard_normal((3, 32))).astype(dtype)
    w, z = (1 + 0.3 * rng.standard_normal(32)).astype(dtype), rng.standard_normal((3, 32)).astype(dtype)
    outs = [rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6, zero_centered=True), rms_norm_gated(x, z, w, 1e-6)]
    assert all(o.dtype == np.dtype(dtype) and o.shape == x.shape for o in outs)
    c = np.float64 if dtype == np.float64 else np.float32
    xc, wc, zc = (a.astype(c) for a in (x, w, z))
    # the mean of squares: the exact sum correctly rounded (float32), or NumPy's float64 sum, over n
    squares = np.sum(xc * xc, axis=-1, keepdims=True) if c == np.float64 else exact.sum_squares(xc)
    nu = xc * (1 / np.sqrt(squares / c(xc.shape[-1]) + 1e-6))
    cast = lambda a: a.astype(dtype).astype(c)  # noqa: E731
    expect = [cast(wc * cast(nu)), cast(nu * (1 + wc)), cast(cast(wc * cast(nu)) * silu(zc))]
    for o, e in zip(outs, expect):
        assert np.array_equal(o.astype(c), e)
    if dtype in (np.float16, ml_dtypes.bfloat16):  # the test can tell the cast placements apart
        assert not np.array_equal(expect[0], cast(wc * nu))
        assert not np.array_equal(expect[1], cast(cast(nu) * cast(1 + wc)))
        assert not np.array_equal(expect[2], cast(wc * nu * silu(zc)))


@settings(max_examples=20, deadline=None)
@given(t=rows(dtype=np.float32, scale=1.0))
def test_huge_and_tiny_float32_rows_do_not_overflow(t):
    """Statistics in float32: rows of magnitude 1e18 (squares 1e36 < 3.4e38) stay finite and scale-free; rows of
    magnitude 1e-18 are eps-dominated: w * x / sqrt(1e-6) = w * x * 1e3."""
    x, w = t
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        big = rms_norm(x * np.float32(1e18), w, 1e-6)
        small = rms_norm(x * np.float32(1e-18), w, 1e-6)
    np.testing.assert_allclose(big, rms_norm(x, w, 0.0), rtol=1e-6, atol=0)
    np.testing.assert_allclose(small, w * x * np.float32(1e-15), rtol=1e-6, atol=0)


# ---------------------------------------------------------------- parity with transformers (float32)

def _randomised(module, torch, seed, offset):
    """Every 1-D parameter randomised (HF initialises the weights to 1 or 0, which hides swapped variants)."""
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        module.weight.copy_(offset + 0.3 * torch.randn(module.weight.shape, generator=gen))
    return module.weight.detach().numpy().copy()


@pytest.mark.oracle
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_oracle_plain_zero_centred_and_gated_norms(eps, scale):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm, Qwen3NextRMSNormGated
    rng = np.random.default_rng(int(scale * 1000) + int(eps * 1e7))
    x = (scale * rng.standard_normal((2, 5, 4, 64))).astype(np.float32)
    z = (3 * rng.standard_normal(x.shape)).astype(np.float32)
    tx, tz = torch.from_numpy(x), torch.from_numpy(z)
    plain, zc, gated = Qwen3RMSNorm(64, eps), Qwen3NextRMSNorm(64, eps), Qwen3NextRMSNormGated(64, eps)
    w_plain, w_zc, w_gated = _randomised(plain, torch, 1, 1.0), _randomised(zc, torch, 2, 0.0), \
        _randomised(gated, torch, 3, 1.0)
    with torch.no_grad():
        cases = [(rms_norm(x, w_plain, eps), plain(tx)), (rms_norm(x, w_zc, eps, zero_centered=True), zc(tx)),
                 (rms_norm_gated(x, z, w_gated, eps), gated(tx, tz))]
    for mine, theirs in cases:
        assert mine.dtype == np.float32 and theirs.dtype == torch.float32
        np.testing.assert_allclose(mine, theirs.numpy(), rtol=1e-6, atol=1e-6 * np.abs(theirs.numpy()).max())
    # the variants really differ on this input (the comparison above can tell them apart)
    assert not np.allclose(cases[0][0], rms_norm(x, w_plain, eps, zero_centered=True), rtol=1e-3)
