"""The compact reference form: its entry error, and KLD (and every statistic built on it) within the stated bound
of the full-precision KLD, on distributions chosen to stress it."""

import numpy as np
import pytest

from refimpl.dataset import compact, stats


def _exact_kld(ref_logits, dev_logits):
    p, q = compact.log_softmax64(ref_logits), compact.log_softmax64(dev_logits)
    return (np.exp(p) * (p - q)).sum(-1)


CASES = {  # name -> (reference logit scale, device noise relative to it, vocabulary)
    "flat, near-identical device": (0.5, 1e-4, 4000),
    "peaked, small error (bf16-like)": (8.0, 4e-3, 4000),
    "peaked, large error": (8.0, 0.3, 4000),
    "wide range, clamped tail": (25.0, 0.02, 20000),
    "very wide range, broken device": (60.0, 1.0, 5000),
}


@pytest.mark.parametrize("case", CASES)
def test_kld_within_bound(case, rng):
    scale, noise, V = CASES[case]
    ref = (rng.standard_normal((48, V)) * scale).astype(np.float32)
    dev = (ref + rng.standard_normal(ref.shape) * noise * scale).astype(np.float32)
    logp = compact.log_softmax64(ref)
    codes, s, floor = compact.encode(logp)
    exact = _exact_kld(ref, dev)
    got, bound = compact.kld(codes, s, floor, compact.log_softmax64(dev))
    err = np.abs(got - exact)
    assert (err <= bound).all(), f"{case}: error {err.max():.3g} above bound at {np.argmax(err - bound)}"
    assert (bound <= 1e-3 * exact + 1e-3 * np.sqrt(2 * exact) + 1e-6).all()   # the stated size of the bound
    # entries within the range are stored to scale / 2
    kept = logp >= floor[:, None].astype(np.float64)
    stored = compact.decode(codes, s, floor)
    assert (np.abs(stored - logp)[kept] <= (s[:, None] * 0.5 * (1 + 1e-6) + 1e-12).repeat(V, 1)[kept]).all()
    if case.startswith(("wide", "very")):
        assert compact.clamped(s, floor, codes).any()          # the tail path of the bound is exercised


def test_statistics_within_bound(rng):
    """Acceptance: statistics from the compact reference agree with full-precision ones: the mean within the
    mean bound, every order statistic (median, percentiles, max) within the largest bound."""
    ref = (rng.standard_normal((400, 3000)) * rng.uniform(0.5, 12, (400, 1))).astype(np.float32)
    dev = (ref + rng.standard_normal(ref.shape) * 0.05).astype(np.float32)
    exact = _exact_kld(ref, dev)
    codes, s, floor = compact.encode(compact.log_softmax64(ref))
    got, bound = compact.kld(codes, s, floor, compact.log_softmax64(dev))
    a, b = stats.distribution(got), stats.distribution(exact)
    assert abs(a["mean"] - b["mean"]) <= bound.mean()
    for key in ("median", "max", "min", *(f"p{100 * f:g}" for f in stats.PERCENTILES)):
        assert abs(a[key] - b[key]) <= bound.max(), key
    assert bound.mean() < 0.05 * b["mean"]                   # and the bound is small beside what it bounds


def test_device_probability_zero_is_infinite():
    ref = np.array([[0.0, 1.0, 2.0]], np.float32)
    codes, s, floor = compact.encode(compact.log_softmax64(ref))
    kl, _ = compact.kld(codes, s, floor, np.array([[-np.inf, 0.0, -1.0]]))
    assert kl[0] == np.inf


def test_llama_percentile_and_median():
    v = np.array([1.0, 2.0, 4.0, 8.0])
    assert stats.median(v) == 3.0 and stats.median(v[:3]) == 2.0
    assert stats.percentile(v, 0.5) == 3.0 and stats.percentile(v, 0.9) == pytest.approx(4 * 0.3 + 8 * 0.7)
    assert stats.mean_and_uncertainty(np.arange(5.0))[1] == 0.0          # n <= 10: no uncertainty, as llama.cpp
