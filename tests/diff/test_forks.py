"""Forks (refimpl/diff/forks.py, docs/diff.md "Ties and forks"): a device's top-k choice at a near tie of its router
is followed, not failed, only with the evidence: its own router logits pass and pick exactly those experts, and the
golden's and the emulation's margins between the swapped experts are within the error the logits carry there."""

import faults as F
import numpy as np
import pytest

from refimpl.bundle import read_bundle
from refimpl.diff.compare import compare
from refimpl.diff.divergence import localise
from refimpl.diff.dump import read_dump
from refimpl.diff.forks import fork
from refimpl.diff.policy import ROUNDING_NMSE, load_policy
from refimpl.diff.saved import load_metrics, rejudge, save_metrics
from refimpl.golden import write_golden
from refimpl.models.model import Model
from refimpl.models.weights import Weights
from refimpl.precision import policy, weight_transform

FP16 = ROUNDING_NMSE["float16"]
G = np.array([-0.02, -0.19, 0.685, 0.692, 0.659, 2.12, -0.89, -0.61])   # a near tie of experts 3, 2, 4 behind 5
E = G + np.array([0.012, -0.012, -0.008, -0.004, 0.012, -0.016, 0.008, 0.004])   # the emulation: RMS error 0.0103
ERROR = np.array([0.01, -0.01, -0.01, -0.02, 0.02, -0.01, 0.005, 0.0])   # the device's there: RMS 0.0124
REFS = ([5, 3], [5, 3])                                                 # the golden's and the emulation's top-2


def test_a_near_tie_the_devices_own_logits_break_is_a_fork():
    d = G + ERROR                                    # expert 4 over expert 3 (and 2): the golden's margin 0.033,
    why, what = fork(G, E, d, [5, 4], REFS, 4.0, FP16)   # within k sqrt(2) x 0.0103 = 0.058
    assert why is None and what.startswith("experts [4, 5] (golden [3, 5], emulation [3, 5]): the top-2 of the "
                                           "device's own router logits, a margin of 0.033 within 0.0582")
    assert fork(G, E, d, [4, 5], REFS, 4.0, FP16)[0] is None            # the order within the top-k: free


def test_a_choice_inconsistent_with_the_devices_own_logits_is_no_fork():
    why, _ = fork(G, E, E, [5, 4], REFS, 4.0, FP16)      # logits that keep expert 3, expert 4 taken all the same
    assert why.startswith("experts [4, 5] are not the top-2 of the device's own router logits (expert 3")
    d = G + ERROR
    assert fork(G, E, d, [5, 2], REFS, 4.0, FP16)[0].startswith("experts [2, 5] are not the top-2")
    assert fork(G, E, d, [5, 5], REFS, 4.0, FP16)[0].startswith("experts [5, 5] are not 2 distinct ids under 8")
    assert fork(G, E, d, [5, 9], REFS, 4.0, FP16)[0].startswith("experts [5, 9] are not 2 distinct ids under 8")


def test_no_fork_past_the_error_the_logits_carry_there():
    far = G + 4 * ERROR                              # the device's error there 4.8 x the emulation's (RMS): > k
    assert "are 4.81 x the emulation's error (RMS), over k = 4" in fork(G, E, far, [5, 4], REFS, 4.0, FP16)[0]
    wide = G - 0.05 * (np.arange(8) == 4)            # the golden prefers expert 3 to 4 by 0.083
    e = wide + (E - G)
    d = e.copy()
    d[4], d[3] = d[3] + 1e-3, d[4]                   # the two swapped: the row's RMS error within k, the margin not
    assert fork(wide, e, d, [5, 4], REFS, 4.0, FP16)[0] == ("the golden preferred experts [3] to [4] by 0.083, "
                                                            "over k sqrt(2) x the emulation's error there (0.0582)")


PROMPT = [97, 11, 1879, 13, 42, 7, 99]
PARAMS = {"ar": 4, "cl": 16, "mask_floor": -1000.0}
LAYER = "model.layers.1.mlp"


@pytest.fixture(scope="module")
def near_tie(tmp_path_factory):
    """tiny-qwen3-moe whose layer-1 router rows 2 and 5 differ by 2e-4 x noise (logits within ~1e-3: a near tie,
    not an exact one, at fp16), its float32 golden and fp16 emulation (prompt calls only), and the fp16 model."""
    model, arrays = F.model_and_arrays("tiny-qwen3-moe", vocab_size=2048, eos_token_id=2000)
    router = f"{LAYER}.gate.weight"
    arrays = {**arrays, router: arrays[router].copy()}
    noise = np.random.default_rng(0).standard_normal(arrays[router][2].shape).astype(np.float32)
    arrays[router][5] = arrays[router][2] + np.float32(2e-4) * noise
    p = policy("fp16")
    device = Model(model.config, Weights(arrays, dtype=p.dtype, transform=weight_transform(p)), precision=p)
    root = tmp_path_factory.mktemp("fork")
    golden = read_bundle(write_golden(root / "g", Model(model.config, Weights(arrays)), PROMPT, source="x",
                                      convention="genie", params=PARAMS, decode_steps=0, taps="."))
    emulated = read_bundle(write_golden(root / "e", device, PROMPT, source="x", convention="genie", params=PARAMS,
                                        decode_steps=0, taps="."))
    return golden, emulated, device, root


def _swapped(logits, constant_row=False):
    """Router logits with experts 2 and 5 swapped (a near tie broken the other way); constant_row: also +1 on
    every logit of the last row whose top-2 has neither (the softmax, the choice unchanged: a fault of the router
    logits alone, away from the fork's rows; the last: a pad slot is the first)."""
    out = logits.copy()
    out[..., [2, 5]] = out[..., [5, 2]]
    if constant_row:
        top = np.argsort(-logits, axis=-1)[..., :2]
        kept = (~(top == 2).any(-1) & ~(top == 5).any(-1))[0]
        out[0, int(np.nonzero(kept)[0][-1])] += 1.0
    return out


def _device(near_tie, name, fault):
    golden, emulated, device, root = near_tie
    dump = F.device_dump(device, PROMPT, PARAMS, 0, root / name, fault)
    report = compare(golden, read_dump(dump, golden), load_policy(dtype="fp16"), emulated=emulated)
    return report, {r.key: r for r in report.results}


def test_a_device_that_follows_its_own_router_at_a_near_tie_forks(near_tie):
    report, by_key = _device(near_tie, "fork", F.corrupt_tap(f"{LAYER}.router_logits", _swapped))
    assert report.exit_code == 0, [(r.key, r.failures) for r in report.failed][:3]
    forks = [r for r in report.results if r.problem and r.problem.startswith("a fork: ")]
    assert forks and all(r.name == f"{LAYER}.selected_experts" and r.status == "pass" for r in forks)
    assert not any((r.reference or {}).get("tie") for r in forks)                      # not an exact tie
    assert any(r.status == "diverged" for r in report.results)
    assert any(n.startswith("fork at step") for n in report.notes)
    after = localise(report)                                                          # idempotent
    assert report.exit_code == 0 and all(r.key in after and r.status == "pass" for r in forks)
    save_metrics(report, near_tie[3] / "fork.json")                                   # saved and judged again
    again = rejudge(load_metrics(near_tie[3] / "fork.json"), load_policy(dtype="fp16"))
    assert again.exit_code == 0 and again.notes == report.notes


def test_a_top_k_inconsistent_with_the_devices_own_router_fails(near_tie):
    def other_side(selected):
        s = selected.copy()
        rows = (s == 2).any(-1) & ~(s == 5).any(-1)
        s[rows] = np.where(s[rows] == 2, 5, s[rows])
        return s
    report, by_key = _device(near_tie, "topk", F.corrupt_tap(f"{LAYER}.selected_experts", other_side))
    first = next(v for v in report.first_divergence.values() if v)
    assert first.endswith(f"{LAYER}.selected_experts")
    assert "are not the top-2 of the device's own router logits" in by_key[first].problem


def test_no_fork_when_the_devices_router_logits_fail(near_tie):
    report, by_key = _device(near_tie, "logits", F.corrupt_tap(f"{LAYER}.router_logits",
                                                               lambda v: _swapped(v, constant_row=True)))
    first = next(v for v in report.first_divergence.values() if v)
    assert first.endswith(f"{LAYER}.router_logits")
    chosen = [r for r in report.results if r.name == f"{LAYER}.selected_experts" and r.status != "pass"]
    assert chosen and all(r.status == "fail" and r.problem == f"no fork: the device's router logits "
                          f"({r.key.replace('selected_experts', 'router_logits')}) do not pass" for r in chosen)
    assert not any(n.startswith("fork at") for n in report.notes)
