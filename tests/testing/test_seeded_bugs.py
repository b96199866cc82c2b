"""The toolkit finds seeded bugs in sample device kernels and passes their honest fp16 / bf16 / fp32 versions with
the default tolerances: the tolerances are neither too loose to catch the bugs nor too tight for honest reduced
precision.

Examples-to-find are counted with derandomized hypothesis (the same numbers on every run; docs/testing.md quotes
them) and bounded here, so a strategy that loses its power to find a bug fails the test.
"""

import functools

import numpy as np
import pytest
import sample_kernels as K
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis.errors import NoSuchExample

from refimpl.kernels.moe import route
from refimpl.testing import make_gated_delta_case
from refimpl.testing import strategies as S
from refimpl.testing.cases import check_routing, make_moe_routing_case

DERANDOMIZED = dict(derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))


def examples_to_find(strategy, kernel, max_examples=200) -> int:
    """How many derandomized examples hypothesis generates before case.check(kernel(case)) first fails
    (generation only: shrinking would add calls after the find)."""
    calls = []

    def fails(case):
        calls.append(case)
        try:
            case.check(kernel(case))
        except AssertionError:
            return True
        return False

    try:
        find(strategy, fails, settings=settings(max_examples=max_examples, phases=[Phase.generate], **DERANDOMIZED))
    except NoSuchExample:
        return 0
    return len(calls)


# (name, strategy, buggy kernel, bound on examples-to-find); the measured counts are in docs/testing.md
BUGS = [
    ("softmax without max subtraction (fp16 exp overflow)", S.sdpa_cases("float16", extreme=True),
     functools.partial(K.sdpa, subtract_max=False), 30),
    ("SDPA query offset off by one (Lk - Lq - 1)", S.sdpa_cases("float16"), functools.partial(K.sdpa, offset_bug=-1),
     10),
    ("SDPA query offset off by one, bf16", S.sdpa_cases("bfloat16"), functools.partial(K.sdpa, offset_bug=-1), 10),
    ("SDPA causal mask aligned top-left (offset 0; wrong only when Lq != Lk)", S.sdpa_cases("float16"),
     functools.partial(K.sdpa, top_left=True), 20),
    ("SDPA sliding window one key too wide", S.sdpa_cases("float16"), functools.partial(K.sdpa, window_bug=1), 30),
    ("RoPE interleaved pairs instead of half split", S.rope_cases("float16"),
     functools.partial(K.rope, interleaved=True), 10),
    ("RoPE interleaved, bf16", S.rope_cases("bfloat16"), functools.partial(K.rope, interleaved=True), 10),
    ("GDN gate applied after the delta update", S.gated_delta_cases("float16"),
     functools.partial(K.gated_delta, gate_after_update=True), 20),
    ("GDN gate after the update, bf16", S.gated_delta_cases("bfloat16"),
     functools.partial(K.gated_delta, gate_after_update=True), 20),
    ("GDN beta missing", S.gated_delta_cases("float16"), functools.partial(K.gated_delta, no_beta=True), 20),
    ("conv state shifted by one", S.conv1d_cases("float16"), functools.partial(K.conv1d, state_shift=1), 10),
    ("RMSNorm sum of squares in fp16 (overflow)", S.rms_norm_cases("float16", extreme=True),
     functools.partial(K.rms_norm, fp16_sum=True), 20),
    ("MoE norm_topk_prob ignored", S.moe_routing_cases("float16"),
     functools.partial(K.moe_routing, ignore_norm_topk_prob=True), 20),
    # precision bugs: bf16 roundings inside a kernel tested as fp16 (the tolerances resolve 8x coarser rounding)
    ("RoPE with bf16 intermediates, tested as fp16", S.rope_cases("float16"), K.in_bfloat16(K.rope), 20),
    ("SDPA with bf16 intermediates, tested as fp16", S.sdpa_cases("float16"), K.in_bfloat16(K.sdpa), 100),
    ("RMSNorm with bf16 intermediates, tested as fp16", S.rms_norm_cases("float16"), K.in_bfloat16(K.rms_norm), 20),
    ("GDN with bf16 intermediates, tested as fp16", S.gated_delta_cases("float16"), K.in_bfloat16(K.gated_delta),
     20),
]


@pytest.mark.parametrize("name,strategy,kernel,bound", BUGS, ids=[b[0] for b in BUGS])
def test_finds_the_seeded_bug(name, strategy, kernel, bound):
    n = examples_to_find(strategy, kernel)
    print(f"{name}: found after {n} examples")
    assert 1 <= n <= bound, f"{name}: not found within {bound} examples (took {n or 'more than 200'})"


def test_overflow_bug_needs_the_extreme_magnitudes():
    """Without extreme=True scores stay below exp's fp16 overflow (11.09): the bug is invisible there, which is
    why the extreme magnitudes exist and are opt-in."""
    assert examples_to_find(S.sdpa_cases("float16"), functools.partial(K.sdpa, subtract_max=False), 100) == 0


# ---------------------------------------------------------------- honest kernels pass the default tolerances

HONEST = [("rope", S.rope_cases, K.rope), ("sdpa", S.sdpa_cases, K.sdpa), ("rms_norm", S.rms_norm_cases, K.rms_norm),
          ("gated_delta", S.gated_delta_cases, K.gated_delta), ("conv1d", S.conv1d_cases, K.conv1d),
          ("moe_routing", S.moe_routing_cases, K.moe_routing)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("op,strategy,kernel", HONEST, ids=[h[0] for h in HONEST])
def test_honest_kernels_pass(op, strategy, kernel, dtype, extreme):
    """Every op, every dtype, ordinary and extreme magnitudes: within the default tolerances on every example, and
    using at most 3/4 of them (elementwise and RMS), so examples beyond these derandomized ones have headroom."""
    worst = []

    @settings(max_examples=40, **DERANDOMIZED)
    @given(case=strategy(dtype, extreme=extreme))
    def run(case):
        with np.errstate(over="ignore"):  # silu of -1e2 in the conv: exp overflows to inf, silu -> -0, correct
            out = kernel(case)
        worst.extend(max(r["excess"], r["rel_rmse"] / r["ratio_limit"]) for r in case.check(out)
                     if r["ratio_limit"] > 0)

    run()
    assert max(worst) < 0.75, max(worst)


def test_a_low_precision_gdn_state_is_flagged_by_its_dtype_not_its_values():
    """A state kept in fp16 between steps stays inside the output tolerances (the delta rule contracts, so its
    rounding does not pile up: ~2x the honest error at T = 4096 in a direct measurement), so the values cannot flag
    it; its dtype does (spec §7.8), unless the user opts in."""
    case = make_gated_delta_case(0, dtype="float16", T=64)
    o, state = K.gated_delta(case, state_dtype=np.float16)
    case.check((o, state), allow_low_precision_state=True)  # within tolerance
    with pytest.raises(AssertionError, match=r"final state is float16; keep the recurrent state in float32"):
        case.check((o, state.astype(np.float16)))


def test_moe_routing_check_rejects_the_next_expert_at_real_expert_counts():
    """Choosing the (k+1)-th expert instead of the k-th must fail, also with 128 experts in bf16."""
    caught = 0
    for seed in range(20):
        case = make_moe_routing_case(seed, dtype="bfloat16", N=4, E=128, top_k=8, norm_topk_prob=True, ties=False,
                                     logit_scale=1.0)
        probs, weights, experts = route(case.inputs["logits"].astype(np.float64), 8, True)
        check_routing(case, weights, experts)                          # the right answer passes
        order = np.argsort(-probs, axis=1, kind="stable")
        wrong = experts.copy()
        wrong[:, -1] = order[:, 8]                                      # k-th -> (k+1)-th
        try:
            check_routing(case, np.take_along_axis(probs, wrong, 1) / np.take_along_axis(probs, wrong, 1).sum(1,
                          keepdims=True), wrong)
        except AssertionError:
            caught += 1
    assert caught >= 18   # a pair within 2 bf16 roundoffs of each other is a legitimate near-tie
