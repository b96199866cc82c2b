"""Cases and strategies: refimpl's own float32 kernels pass their float64 references at the fp32 tolerances; the
strategies reach every feature they promise; Case.check's contract; the optional hypothesis import; the pytest
plugin."""

import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, find, given, settings

from refimpl.kernels.attention import sdpa
from refimpl.kernels.conv import causal_conv1d
from refimpl.kernels.gated_delta import gated_delta_chunked
from refimpl.kernels.moe import route
from refimpl.kernels.norm import rms_norm, rms_norm_gated
from refimpl.kernels.rope import apply_rope
from refimpl.testing import make_conv1d_case, make_gated_delta_case, make_moe_routing_case, make_sdpa_case
from refimpl.testing import strategies as S

FAST = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


def refimpl_float32(case):
    """refimpl's kernels in their float32 mode on the case's float32 inputs: honest fp32 implementations."""
    i, p = case.inputs, case.params
    if case.op == "rope":
        return apply_rope(i["x"], i["cos"], i["sin"])
    if case.op == "sdpa":
        with np.errstate(invalid="ignore"):  # rows with no visible key under a -inf mask: NaN, not compared
            return sdpa(i["q"], i["k"], i["v"], i["mask"], scale=p["scale"])
    if case.op == "rms_norm":
        if p["variant"] == "gated":
            return rms_norm_gated(i["x"], i["gate"], i["weight"], p["eps"])
        return rms_norm(i["x"], i["weight"], p["eps"], zero_centered=p["variant"] == "zero_centered")
    if case.op == "gated_delta":
        return gated_delta_chunked(i["q"], i["k"], i["v"], i["g"], i["beta"], i["initial_state"],
                                   chunk_size=p["chunk_size"], use_qk_l2norm=p["use_qk_l2norm"], scale=p["scale"])
    if case.op == "conv1d":
        return causal_conv1d(i["x"], i["weight"], i["state"], state_len=p["state_len"])
    _, w, e = route(i["logits"], p["top_k"], p["norm_topk_prob"])
    return w, e


STRATEGIES = [S.rope_cases, S.sdpa_cases, S.rms_norm_cases, S.gated_delta_cases, S.conv1d_cases,
              S.moe_routing_cases]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.__name__)
@pytest.mark.parametrize("extreme", [False, True])
def test_refimpl_float32_kernels_pass_at_fp32_tolerances(strategy, extreme):
    """The chunked GDN (C = 16 / 64) against the recurrent float64 reference included."""

    @settings(max_examples=25, **FAST)
    @given(case=strategy("float32", extreme=extreme))
    def run(case):
        case.check(refimpl_float32(case))

    run()


def reaches(strategy, condition, max_examples=300):
    """Whether derandomized generation produces a case satisfying condition."""
    find(strategy, condition, settings=settings(max_examples=max_examples, phases=[Phase.generate], **FAST))
    return True


def test_strategies_reach_the_features_they_promise():
    sd = S.sdpa_cases("float16")
    assert reaches(sd, lambda c: c.params["offset"] > 0 and c.inputs["q"].shape[1] == 4 * c.inputs["k"].shape[1])
    for floor in ("-inf", "finfo", -50.0, -1000.0):
        assert reaches(sd, lambda c, f=floor: c.params["floor"] == f and c.inputs["key_valid"] is not None
                       and c.params["window"] is not None)
    c = find(sd, lambda c: c.params["floor"] == "finfo")
    assert c.inputs["mask"].dtype == np.float16 and c.inputs["mask"].min() in (0, np.finfo(np.float16).min)
    assert reaches(S.sdpa_cases("float16", extreme=True), lambda c: c.outputs[0].growth[0] > 8 + 2 * 11.09)
    assert reaches(S.rope_cases("bfloat16"), lambda c: c.inputs["positions"].max() > 100_000
                   and c.params["rot"] * 4 == c.inputs["x"].shape[-1])
    gd = S.gated_delta_cases("float16")
    assert reaches(gd, lambda c: np.any(c.inputs["g"] == 0) and np.any(c.inputs["g"] == -20)
                   and np.any(c.inputs["beta"] == 0) and np.any(c.inputs["beta"] == 1)
                   and c.inputs["initial_state"] is not None and c.inputs["v"].shape[2] == 4 * c.inputs["q"].shape[2])
    assert reaches(gd, lambda c: not c.params["use_qk_l2norm"] and c.inputs["q"].shape[1] == 65)
    assert reaches(S.gated_delta_cases("float16", extreme=True), lambda c: np.any(c.inputs["g"] == -1e3))
    assert reaches(S.conv1d_cases("float16"), lambda c: c.inputs["state"] is not None and c.inputs["x"].shape[2] == 1
                   and c.params["state_len"] == c.inputs["weight"].shape[1] - 1)
    assert reaches(S.moe_routing_cases("float16"), lambda c: len(np.unique(c.inputs["logits"][0])) <
                   c.inputs["logits"].shape[1] and not c.params["norm_topk_prob"])
    assert reaches(S.rms_norm_cases(["float16", "bfloat16"]), lambda c: c.dtype == ml_dtypes.bfloat16
                   and c.params["variant"] == "gated")


def test_inputs_are_in_the_device_dtype_and_the_reference_is_float64():
    c = make_gated_delta_case(0, dtype="bfloat16", T=5, r=2)
    assert c.inputs["q"].dtype == c.inputs["v"].dtype == ml_dtypes.bfloat16
    assert c.inputs["g"].dtype == c.inputs["beta"].dtype == c.inputs["initial_state"].dtype == np.float32
    o, state = c.reference()
    assert o.dtype == state.dtype == np.float64 and o.shape == (1, 5, 2, 16) and c.reference()[0] is o  # cached


def test_check_reports_the_output_and_the_case():
    c = make_conv1d_case(5, dtype="float16", T=3)
    y, state = c.reference()
    c.check((y.astype(np.float16), state.astype(np.float16)))
    bad = state.astype(np.float16)
    bad[0, 2, 1] += np.float16(1)
    with pytest.raises(AssertionError, match=r"(?s)conv1d output 'state' \(float16; x \(1, 8, 3\).*seed 5\):\n"
                                             r"assert_close \(exact.*index \(0, 2, 1\)"):
        c.check((y.astype(np.float16), bad))
    with pytest.raises(AssertionError, match=r"expected 2 outputs \['y', 'state'\], got 1"):
        c.check((y,))


def test_sdpa_rows_without_a_visible_key_are_not_compared():
    c = make_sdpa_case(2, Lq=4, Lk=4, B=2, padding=True, floor="-inf")
    o = c.reference()
    valid = c.outputs[0].valid
    assert np.all(np.isnan(o[~valid])) and not np.any(np.isnan(o[valid])) and (~valid).any()
    c.check(np.where(valid, o, 123.0).astype(np.float16))  # garbage in the pad rows is fine


def test_routing_accepts_any_tie_break_and_order_but_not_a_wrong_set():
    c = make_moe_routing_case(0, N=1, E=4, top_k=2, norm_topk_prob=True, ties=True)
    c.inputs["logits"][:] = np.array([[1, 2, 2, 0]], np.float16)  # experts 1 and 2 tie for first
    w, e = c.reference()
    c.check((w.astype(np.float16), e))
    c.check((w[:, ::-1].astype(np.float16), e[:, ::-1]))  # any order
    c2 = make_moe_routing_case(0, N=1, E=4, top_k=1, norm_topk_prob=False, ties=True)
    c2.inputs["logits"][:] = np.array([[1, 2, 2, 0]], np.float16)
    p = np.exp([1, 2, 2, 0]) / np.exp([1, 2, 2, 0]).sum()
    c2.check((np.array([[p[2]]], np.float16), np.array([[2]])))  # the other tied expert
    with pytest.raises(AssertionError, match=r"not a top-1 set: expert 0 \(p 0.1.*\) chosen over expert 1"):
        c2.check((np.array([[p[0]]], np.float16), np.array([[0]])))
    with pytest.raises(AssertionError, match="not 2 distinct ids"):
        c.check((w, np.array([[1, 1]])))


def test_strategies_need_hypothesis_with_a_clear_error(tmp_path):
    code = textwrap.dedent("""
        import sys
        sys.modules["hypothesis"] = None  # as if not installed
        import refimpl.testing as t
        t.assert_close(t.make_rope_case(0).reference(), t.make_rope_case(0).reference())  # works without it
        try:
            t.sdpa_cases
        except ImportError as e:
            print(e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "refimpl.testing.strategies needs hypothesis: pip install 'refimpl[testing]'" in out


def test_pytest_plugin(tmp_path):
    """Fixtures, the dtype parametrisation and the profiles, in a fresh pytest run of a user's test file."""
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["refimpl.testing.pytest_plugin"]\n')
    (tmp_path / "test_user.py").write_text(textwrap.dedent("""
        from hypothesis import given, settings
        from refimpl.testing import make_rms_norm_case
        from refimpl.testing.strategies import rms_norm_cases

        def test_fixtures(refimpl_dtype, refimpl_reference, refimpl_assert_close):
            case = make_rms_norm_case(0, dtype=refimpl_dtype)
            refimpl_assert_close(refimpl_reference(case).astype(case.dtype), refimpl_reference(case))

        @given(case=rms_norm_cases("float16"))
        def test_profile(case):
            assert settings().deadline is None and settings().derandomize
            case.check(case.reference().astype(case.dtype))
    """))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "--hypothesis-profile=refimpl-ci", "--refimpl-dtypes=fp16,bf16", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 passed" in run.stdout
