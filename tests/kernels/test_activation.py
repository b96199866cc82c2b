"""Activations in their stable forms: sigmoid, silu, softplus (torch's, threshold 20), softmax, and the ACTIVATIONS
map. Properties in float64; parity with torch / transformers' ACT2FN in float32 (oracle). No overflow, invalid or
divide warnings anywhere (np.errstate raises on them; underflow to 0 is the correct result and is allowed)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from refimpl.kernels.activation import ACTIVATIONS, sigmoid, silu, softmax, softplus

RAISE = dict(over="raise", invalid="raise", divide="raise")
TINY32 = float(np.finfo(np.float32).tiny)


def finite(dtype, max_value=None):
    info = np.finfo(dtype)
    bound = float(info.max) if max_value is None else max_value
    return arrays(dtype, st.integers(1, 64), elements=st.floats(-bound, bound, width=info.bits))


@settings(max_examples=100, deadline=None)
@given(x=finite(np.float64) | finite(np.float32))
def test_sigmoid_silu_softplus_are_finite_and_warning_free_over_the_whole_range(x):
    with np.errstate(**RAISE):
        s, u, p = sigmoid(x), silu(x), softplus(x)
    assert s.dtype == u.dtype == p.dtype == x.dtype
    assert np.all((s >= 0) & (s <= 1)) and np.all(np.isfinite(u)) and np.all(np.isfinite(p) & (p >= 0))
    assert np.all(s[x >= 0] >= 0.5) and np.all(s[x < 0] <= 0.5)
    assert np.all(p >= np.maximum(x, 0))  # softplus(x) >= max(x, 0)


@settings(max_examples=100, deadline=None)
@given(x=finite(np.float64, 700.0))
def test_float64_formulas(x):
    """sigmoid = 1/(1+e^-x) (each form is a few roundings: agree to 1e-15 relative), sigmoid(-x) = 1 - sigmoid(x)
    (to 2 ulps of 1), silu = x * sigmoid(x), softplus = log1p(e^x) for x <= 20."""
    with np.errstate(**RAISE):
        s = sigmoid(x)
        np.testing.assert_allclose(s, 1 / (1 + np.exp(np.minimum(-x, 700))), rtol=1e-15, atol=0)
        np.testing.assert_allclose(sigmoid(-x), 1 - s, rtol=0, atol=2 * 2.0**-52)
        assert np.array_equal(silu(x), x * s)
        low = x <= 20
        np.testing.assert_allclose(softplus(x)[low], np.log1p(np.exp(x[low])), rtol=1e-15, atol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softplus_threshold(dtype):
    """torch's rule: x where x > threshold (bit for bit), else log1p(exp(x)); at 20.5 the two differ in float64
    (log1p(e^20.5) = 20.5 + 1.25e-9), so the branch is observable. A custom threshold moves the switch."""
    x = np.array([19.0, 20.0, 20.5, 25.0, 1e4, 3e38], dtype)
    with np.errstate(**RAISE):
        y = softplus(x)
        assert np.array_equal(y[x > 20], x[x > 20])
        np.testing.assert_allclose(y[x <= 20], np.log1p(np.exp(x[x <= 20].astype(np.float64))), rtol=1e-7)
        if dtype == np.float64:  # x == threshold takes the log1p branch
            assert softplus(np.array([20.0]))[0] == np.log1p(np.exp(20.0)) != 20.0
            assert np.log1p(np.exp(20.5)) != 20.5 and softplus(np.array([20.5]))[0] == 20.5
            assert softplus(np.array([20.5]), threshold=30.0)[0] == np.log1p(np.exp(20.5))
            assert softplus(np.array([5.0]), threshold=4.0)[0] == 5.0


@settings(max_examples=60, deadline=None)
@given(x=arrays(np.float64, st.tuples(st.integers(1, 4), st.integers(1, 16)), elements=st.floats(-1e3, 1e3)),
       shift=st.sampled_from([0.0, 1e300, -1e300, 1e6, 3e38]), axis=st.sampled_from([0, -1]))
def test_softmax_is_shift_invariant_and_stable_for_huge_inputs(x, shift, axis):
    """softmax(x + c) == softmax(x) for huge c (the max is subtracted first); rows sum to 1; no overflow."""
    with np.errstate(**RAISE):
        p = softmax(x, axis=axis)
        np.testing.assert_allclose(p.sum(axis=axis), 1, rtol=0, atol=1e-14)
        if shift in (0.0, 1e6):
            np.testing.assert_allclose(softmax(x + shift, axis=axis), p, rtol=0, atol=1e-9)
        big = np.full_like(x, shift)
        assert np.allclose(softmax(big, axis=axis), 1 / x.shape[axis])
        e = np.exp(x - x.max(axis=axis, keepdims=True))
        np.testing.assert_allclose(p, e / e.sum(axis=axis, keepdims=True), rtol=1e-15, atol=1e-300)
    lowest = np.finfo(np.float32).min  # an additive attention mask entry
    x32 = np.array([[3e38, 3e38, 1e38, 0.0], [1e4, 0.0, -1e4, 1e4], [lowest, 50.0, lowest, 50.0]], np.float32)
    with np.errstate(**RAISE):
        p32 = softmax(x32)
    assert p32.dtype == np.float32
    np.testing.assert_array_equal(p32, np.array([[0.5, 0.5, 0, 0], [0.5, 0, 0, 0.5], [0, 0.5, 0, 0.5]], np.float32))


# ---------------------------------------------------------------- parity with torch (float32)

def _grid():
    """Normal draws at several scales, a dense sweep over [-120, 120] (exp overflow / underflow boundaries of
    float32 sit at +-88.7 and -103.3) and the extremes of float32."""
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal(2000) * s for s in (0.01, 1, 10, 30, 100)]
    parts += [np.linspace(-120, 120, 4801), [-3.4e38, -1e30, -1e10, 1e10, 1e30, 3.4e38, 0.0, -0.0, 19.999, 20.0,
                                            20.001, -20.0, 88.7, -88.7, -103.3, -104.0]]
    return np.concatenate(parts).astype(np.float32)


@pytest.mark.oracle
@pytest.mark.parametrize("name", ["sigmoid", "silu", "softplus"])
def test_oracle_against_torch_float32(name):
    """rtol 1e-6, relative to max(|value|, tiny) since subnormals carry less precision, everywhere but one region:
    for x < -88.7 exp(-x) overflows in torch's 1 / (1 + exp(-x)), so torch returns 0 where the stable form keeps
    exp(x) / (1 + exp(x)) < tiny = 1.2e-38 (float32's smallest normal). There sigmoid may differ by tiny, and
    silu = x * sigmoid(x) by |x| * tiny."""
    torch = pytest.importorskip("torch")
    x = _grid()
    theirs = {"sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu,
              "softplus": torch.nn.functional.softplus}[name](torch.from_numpy(x)).numpy()
    with np.errstate(**RAISE):
        mine = {"sigmoid": sigmoid, "silu": silu, "softplus": softplus}[name](x)
    assert mine.dtype == np.float32
    err = np.abs(mine.astype(np.float64) - theirs)
    flushed = (x < -88.7) & (theirs == 0)
    assert np.all(err[~flushed] <= 1e-6 * np.maximum(np.abs(theirs[~flushed]), TINY32))
    assert np.all(err[flushed] <= TINY32 * np.maximum(1, np.abs(x[flushed])))
    if name == "softplus":  # the threshold branch returns x itself, bit for bit, like torch
        assert np.array_equal(mine[x > 20], theirs[x > 20])


@pytest.mark.oracle
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_oracle_activations_map_equals_act2fn(name):
    """Every hidden_act the kernels accept is transformers' ACT2FN[name] (float32, |x| <= 12). gelu's 1 + erf(x/sqrt 2)
    cancels for x << 0 in float32 on both sides, so those compare to an absolute 1e-6 (values are <= 12)."""
    torch = pytest.importorskip("torch")
    from transformers.activations import ACT2FN
    x = _grid()
    x = x[np.abs(x) <= 12]
    with np.errstate(**RAISE):
        mine = ACTIVATIONS[name](x)
    theirs = ACT2FN[name](torch.from_numpy(x)).numpy()
    assert mine.dtype == np.float32
    np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.oracle
@pytest.mark.parametrize("scale", [1.0, 30.0, 1e4])
def test_oracle_softmax_against_torch_float32(scale):
    torch = pytest.importorskip("torch")
    x = (scale * np.random.default_rng(1).standard_normal((6, 33))).astype(np.float32)
    with np.errstate(**RAISE):
        mine = softmax(x)
    np.testing.assert_allclose(mine, torch.softmax(torch.from_numpy(x), -1).numpy(), rtol=1e-6, atol=1e-7)
