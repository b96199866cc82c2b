"""assert_close: the default tolerances, the two rules (isclose, fla's relative RMSE), non-finite handling, and the
failure message (worst element's index and values, errors, how many fail, the metrics)."""

import math
import re

import ml_dtypes
import numpy as np
import pytest

from refimpl.testing import GROWTH, assert_close, compare, rel_rmse, tolerance, unit_roundoff


def test_unit_roundoff_and_default_tolerances():
    assert unit_roundoff("float32") == 2.0**-24
    assert unit_roundoff("fp16") == 2.0**-11 and unit_roundoff(np.float16) == 2.0**-11
    assert unit_roundoff("bf16") == 2.0**-8 and unit_roundoff(ml_dtypes.bfloat16) == 2.0**-8
    t = tolerance("float16", "gated_delta")  # (G, F) = (16, 64): 16 u(fp16) + 64 u(fp32)
    assert t.rtol == 16 * 2.0**-11 + 64 * 2.0**-24 and t.ratio == t.rtol / 2 and t.atol is None
    # fla's chunk bound 0.005 for fp16 sits between our ratio (3.9e-3) and rtol (7.8e-3)
    assert t.ratio < 0.005 < t.rtol
    G, F = GROWTH["rope"]
    assert tolerance("bf16", "rope").rtol == G * 2.0**-8 + F * 2.0**-24
    assert tolerance("float32", "rope").rtol == (G + F) * 2.0**-24  # an fp32 kernel pays both
    assert tolerance("float64", "rope").rtol == (G + F) * 2.0**-53
    assert tolerance("float16", "rope", growth=(2, 0)).rtol == 2 * 2.0**-11
    assert tolerance("float16", "rope", growth=2).rtol == 2 * 2.0**-11 + F * 2.0**-24
    assert tolerance("float32", rtol=1e-3, atol=2e-3, ratio=4e-3) == tolerance("float32", rtol=1e-3, atol=2e-3,
                                                                                 ratio=4e-3)
    with pytest.raises(ValueError, match="dtype"):
        tolerance("int8")


def test_message_names_the_worst_element():
    rng = np.random.default_rng(0)
    expected = rng.standard_normal((2, 3, 4))
    actual = expected.astype(np.float16)
    actual[1, 2, 3] += np.float16(0.5)  # the worst
    actual[0, 1, 0] += np.float16(0.05)  # also failing, but less
    with pytest.raises(AssertionError) as exc:
        assert_close(actual, expected, op="rope", name="q_rot")
    msg = str(exc.value)
    assert msg.startswith("q_rot: assert_close (rope, float16, shape (2, 3, 4)): 2 of 24 compared elements not close")
    worst = re.search(r"worst element at index \(1, 2, 3\): actual (\S+), expected (\S+), abs err (\S+), "
                      r"rel err (\S+) \((\S+)x its tolerance", msg)
    assert worst, msg
    a, e, abs_err, rel = (float(worst.group(i).rstrip(",")) for i in range(1, 5))
    assert a == pytest.approx(float(actual[1, 2, 3]), rel=1e-5) and e == pytest.approx(expected[1, 2, 3], rel=1e-5)
    assert abs_err == pytest.approx(abs(float(actual[1, 2, 3]) - expected[1, 2, 3]), rel=1e-2)
    assert rel == pytest.approx(abs_err / abs(expected[1, 2, 3]), rel=1e-2)
    t = tolerance("float16", "rope")
    assert f"rtol = {t.rtol:.3g}" in msg and f"rel RMSE <= {t.ratio:.3g}" in msg
    r = compare(actual, expected, op="rope")
    assert f"rel RMSE {r['rel_rmse']:.3g}" in msg and "cosine" in msg and "SQNR" in msg and "max ULP (float16)" in msg
    assert r["n_fail"] == 2 and r["worst"] == np.ravel_multi_index((1, 2, 3), (2, 3, 4))


def test_nonfinite_values():
    e = np.array([1.0, 2.0, np.inf, np.nan, 5.0])
    ok = np.array([1.0, 2.0, np.inf, np.nan, 5.0], np.float16)
    assert assert_close(ok, e)["n_fail"] == 0  # the same inf, NaN on both sides
    bad = ok.copy()
    bad[4] = np.nan
    with pytest.raises(AssertionError, match=r"1 of 5 compared elements not close .*1 of them non-finite"):
        assert_close(bad, e)
    with pytest.raises(AssertionError, match=r"index \(4,\): actual nan, expected 5.0 \(non-finite\)"):
        assert_close(bad, e)
    bad = ok.copy()
    bad[2] = -np.inf
    with pytest.raises(AssertionError, match=r"(?s)1 of them non-finite.*index \(2,\): actual -inf, expected inf"):
        assert_close(bad, e)
    assert compare(bad, e, valid=np.array([1, 1, 0, 1, 1], bool))["passed"]  # masked out


def test_isclose_rule_and_fla_ratio():
    e = np.linspace(-1, 1, 1000)
    u = unit_roundoff("float16")
    r = compare(e * (1 + 3 * u), e, dtype="float16", growth=(8, 0))  # within rtol = 8u everywhere, ratio 3u < 4u
    assert r["passed"] and r["excess"] == pytest.approx(3 / 8 * np.max(np.abs(e)) /
                                                        (np.sqrt(np.mean(e * e)) + np.max(np.abs(e))), rel=1e-2)
    # the ratio is fla's: rmse(a - e) / (rms(e) + 1e-8)
    a = e + 1e-3 * np.sin(np.arange(1000))
    assert compare(a, e)["rel_rmse"] == pytest.approx(rel_rmse(a, e), rel=1e-12)
    assert rel_rmse(a, e) == pytest.approx(np.sqrt(np.mean((a - e) ** 2)) / (np.sqrt(np.mean(e**2)) + 1e-8))
    # one outlier among 1000: the isclose rule fails it, the RMS rule alone lets it through
    a = e.copy()
    a[17] += 0.02
    assert not compare(a, e, dtype="float16", growth=(8, 0))["passed"]
    assert not compare(a, e, dtype="float16", growth=(8, 0), metric="isclose")["passed"]
    assert compare(a, e, dtype="float16", growth=(8, 0), metric="ratio")["passed"]
    # a uniform 0.5% bias: every element within rtol 16u = 0.78%, the RMS over the ratio limit 8u = 0.39%
    a = e * 1.005
    assert compare(a, e, dtype="float16", growth=(16, 0), metric="isclose")["passed"]
    assert not compare(a, e, dtype="float16", growth=(16, 0))["passed"]
    with pytest.raises(ValueError, match="metric"):
        compare(a, e, metric="max")


def test_atol_is_relative_to_the_scale():
    """Near-zero outputs are judged on rms(expected), or on a given scale (the terms' magnitude)."""
    e = np.array([1e-6, 1.0, -1.0])
    a = e + np.array([3e-3, 0, 0])  # off by 3e-3 where e ~ 0: fails on scale rms(e) = 0.8 at 8u (3.2e-3)...
    r = compare(a, e, dtype="float16", growth=(8, 0), metric="isclose")
    assert r["atol"] == pytest.approx(8 * 2.0**-11 * math.sqrt(np.mean(e * e)))  # growth (8, 0): rtol = 8u
    assert r["passed"]
    assert not compare(a * 0.1, e * 0.1 + [3e-3, 0, 0], dtype="float16", growth=(8, 0), metric="isclose")["passed"]
    assert compare(a * 0.1, e * 0.1 + [3e-3, 0, 0], dtype="float16", growth=(8, 0), metric="isclose",
                   scale=1.0)["passed"]


def test_exact_ops_need_equal_bits():
    x = np.arange(6, dtype=np.float16).reshape(2, 3)
    assert assert_close(x, x, op="exact")["excess"] == 0
    y = x.copy()
    y[1, 1] = np.nextafter(y[1, 1], np.float16(10))
    with pytest.raises(AssertionError, match=r"index \(1, 1\): actual 4.00391, expected 4"):
        assert_close(y, x, op="exact")


def test_dtype_defaults_to_the_actual_dtype_and_bf16_works():
    e = np.random.default_rng(1).standard_normal(64)
    assert compare(e.astype(np.float16), e)["dtype"] == "float16"
    assert compare(e.astype(ml_dtypes.bfloat16), e)["dtype"] == "bfloat16"
    assert compare(e, e)["dtype"] == "float32"  # a float64 actual is judged as float32
    assert not compare(e.astype(ml_dtypes.bfloat16), e, dtype="float16")["passed"]  # bf16 rounding is 8x fp16's


def test_shape_mismatch():
    with pytest.raises(AssertionError, match=r"shape mismatch, actual \(2, 3\) vs expected \(3, 2\)"):
        assert_close(np.zeros((2, 3)), np.zeros((3, 2)))
