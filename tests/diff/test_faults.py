"""Fault injection: `refimpl diff` must name the injected tensor as the first divergence; a clean dump passes;
teacher-forced replay puts the added error on the faulty layer and only inherited error after it."""

import faults as F
import numpy as np
import pytest

from refimpl.bundle import read_bundle
from refimpl.diff.compare import compare
from refimpl.diff.dump import read_dump
from refimpl.diff.policy import load_policy
from refimpl.diff.replay import replay
from refimpl.golden import write_golden
from refimpl.models.model import Model
from refimpl.models.weights import Weights
from refimpl.precision import policy, weight_transform

PROMPT = [97, 11, 1879, 13, 42, 7, 99]          # 2 chunks of AR=4: the first has one (left) pad slot
PARAMS = {"ar": 4, "cl": 16, "mask_floor": -1000.0}
STEPS = 2                                        # greedy decode calls after the prompt


def _case(tmp_path_factory, preset, params=PARAMS, prompt=PROMPT):
    model, arrays = F.model_and_arrays(preset, vocab_size=2048, eos_token_id=2000)
    root = tmp_path_factory.mktemp(preset)
    path = write_golden(root / "golden", model, prompt, source=preset, convention="genie", params=params,
                        decode_steps=STEPS, taps=".")
    return model, arrays, read_bundle(path), root


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return _case(tmp_path_factory, "tiny-qwen3.5")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return _case(tmp_path_factory, "tiny-qwen3.5-moe")


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return _case(tmp_path_factory, "tiny-qwen3")


def _diff(case, name, fault=None, model=None, layout="qnn", params=PARAMS, prompt=PROMPT):
    m, _, bundle, root = case
    dump = F.device_dump(model or m, prompt, params, STEPS, root / name, fault, layout=layout)
    return compare(bundle, read_dump(dump, bundle), load_policy()), dump


def _first(report):
    """(step, name) of the earliest first divergence."""
    for k, key in sorted(report.first_divergence.items()):
        if key:
            return k, key.split("/", 2)[2]
    return None


FAULTS = {
    # fault name: (case fixture, fault factory(model, arrays) -> (model or None, context or None), expected)
    "q_norm weight +-1e-2": ("hybrid", lambda m, a: (F.perturbed_weights(m, a,
                                                                         "model.layers.3.self_attn.q_norm.weight"),
                                                     None), (0, "model.layers.3.self_attn.q_norm")),
    "interleaved RoPE": ("hybrid", lambda m, a: (None, F.interleaved_rope()), (0, "model.layers.3.self_attn.q_rope")),
    "K cache untransposed": ("hybrid", lambda m, a: (None, F.key_cache_untransposed(3)), (0, "past_key_3_out")),
    "conv state shifted by one": ("hybrid", lambda m, a: (None, F.conv_state_shifted()),
                                  (0, "model.layers.0.linear_attn.conv_state")),
    "recurrent state transposed": ("hybrid", lambda m, a: (None, F.recurrent_state_transposed(1)),
                                   (0, "recurrent_state_1_out")),
    "fp16 MLP output": ("hybrid", lambda m, a: (None, F.fp16_round("model.layers.2.mlp.down_proj")),
                        (0, "model.layers.2.mlp.down_proj")),
    "pad leaks into GDN": ("hybrid", lambda m, a: (None, F.pad_leaks_into_gdn()),
                           (0, "model.layers.0.linear_attn.conv1d")),
    "wrong expert": ("moe", lambda m, a: (None, F.wrong_expert(1, 2, 8)), (0, "model.layers.1.mlp.selected_experts")),
    "dense q_norm weight +-1e-2": ("dense", lambda m, a: (F.perturbed_weights(m, a,
                                                                              "model.layers.1.self_attn.q_norm.weight"),
                                                          None), (0, "model.layers.1.self_attn.q_norm")),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_is_the_first_divergence(fault, request):
    case_name, make, expected = FAULTS[fault]
    case = request.getfixturevalue(case_name)
    model, context = make(case[0], case[1])
    report, _ = _diff(case, fault.replace(" ", "_"), context, model)
    assert _first(report) == expected, [r.key for r in report.failed][:5]
    first = next(r for r in report.results if r.key == f"{expected[0]}/{'output' if '_out' in expected[1] else 'tap'}/"
                 f"{expected[1]}")
    assert first.origin == "added" and report.exit_code == 1
    if fault in ("K cache untransposed", "recurrent state transposed"):
        assert first.status == "layout" and first.layout == "transposed"  # a layout mix-up, reported as one
    # nothing before the injected tensor fails in its step
    step_results = [r for r in report.results if r.step == expected[0]]
    index = step_results.index(first)
    assert all(r.status == "pass" for r in step_results[:index] if r.role != "output")


def test_mask_floor_at_long_context(tmp_path_factory):
    """Golden with mask floor -1000 over CL=64; the device's host clamps at -50: the mask input is named."""
    params = {"ar": 4, "cl": 64, "mask_floor": -1000.0}
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 2000, 40)]
    case = _case(tmp_path_factory, "tiny-qwen3.5", params, prompt)
    report, _ = _diff(case, "floor", None, None, "bundle", {**params, "mask_floor": -50.0}, prompt)
    assert _first(report) == (0, "attention_mask")
    # scores are scored on the allowed slots only (where the floor does not reach), so they pass; the
    # attention's output inherits the mask's error where the leak past -50 is visible
    scores = next(r for r in report.results if r.key == "0/tap/model.layers.3.self_attn.attn_scores")
    assert scores.status == "pass"
    assert all(r.origin == "inherited" for r in report.failed if r.name != "attention_mask")


@pytest.mark.parametrize("layout", ["qnn", "bundle"])
def test_clean_dump_passes(hybrid, layout):
    report, _ = _diff(hybrid, f"clean-{layout}", layout=layout)
    assert report.failed == [] and report.exit_code == 0 and report.unknown == []
    assert len(report.results) > 300 and all(r.status == "pass" for r in report.results)


def test_float64_rerun_passes_float32_thresholds(hybrid, tmp_path):
    """An honest float32 device (here: the float64 reference, rounded to float32) passes the fp32 defaults."""
    model, arrays, bundle, root = hybrid
    m64 = Model(model.config, Weights(arrays, dtype="float64"))
    dump = F.device_dump(m64, PROMPT, PARAMS, STEPS, tmp_path / "f64")
    report = compare(bundle, read_dump(dump, bundle), load_policy())
    assert report.failed == []
    worst = min(r.metrics["sqnr_db"] for r in report.results if r.metrics)
    assert worst > 100  # float32 rounding noise sits far above the 80 dB bar


def test_replay_separates_added_from_inherited(hybrid):
    model, _, bundle, root = hybrid
    dump_path = F.device_dump(model, PROMPT, PARAMS, STEPS, root / "replay-fp16",
                              F.fp16_round("model.layers.1.mlp.down_proj"), layout="bundle")  # with the inputs
    dump = read_dump(dump_path, bundle)
    verdict = {}
    for layer in range(4):
        rows = replay(bundle, dump, model, layer=layer)
        block = [r for r in rows if r.name == f"model.layers.{layer}"]
        assert len(block) == bundle.steps
        verdict[layer] = any(r.adds_error for r in rows)
        if layer > 1:  # downstream: real inherited error, nothing added
            assert all(r.inherited["sqnr_db"] < 90 and r.total["sqnr_db"] < 90 for r in block)
    assert verdict == {0: False, 1: True, 2: False, 3: False}
    # op by op: inside layer 1 only the rounded op adds; the block output after it inherits
    adding = {r.name for r in replay(bundle, dump, model, layer=1) if r.adds_error}
    assert adding == {"model.layers.1.mlp.down_proj"}
    rows = replay(bundle, dump, model, tensor="model.layers.1.mlp.down_proj", step=0)
    assert len(rows) == 1 and rows[0].adds_error and rows[0].inherited["sqnr_db"] == float("inf")


def test_replay_on_weight_fault_blames_the_faulty_op(dense):
    model, arrays, bundle, root = dense
    device_model = F.perturbed_weights(model, arrays, "model.layers.1.self_attn.q_norm.weight")
    dump = read_dump(F.device_dump(device_model, PROMPT, PARAMS, STEPS, root / "replay-qnorm", layout="bundle"),
                     bundle)
    rows = replay(bundle, dump, model, layer=1, step=0)
    adding = [r.name for r in rows if r.adds_error]
    assert adding == ["model.layers.1.self_attn.q_norm"]  # RoPE, scores, ... after it only inherit
    rows = replay(bundle, dump, model, layer=2, step=0)
    assert not any(r.adds_error for r in rows)
    assert min(r.inherited["sqnr_db"] for r in rows) < 60


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("fault", ["K cache untransposed", "recurrent state transposed"])
def test_state_fault_is_inherited_in_later_steps(fault, dtype, hybrid):
    """The device's cache carries the fault into later calls; with outputs-only (qnn) dumps the walk goes back
    through the uncompared cache inputs to the failing output, so no later step claims a divergence of its own."""
    _, make, expected = FAULTS[fault]
    model, context = make(hybrid[0], hybrid[1])
    m, _, bundle, root = hybrid
    dump = F.device_dump(m, PROMPT, PARAMS, STEPS, root / f"later-{fault.replace(' ', '_')}-{dtype}", context)
    report = compare(bundle, read_dump(dump, bundle), load_policy(dtype=dtype))
    assert _first(report) == expected
    # every call writes its state the same wrong way: a later step may name that output again, nothing else
    assert all(key in (None, f"{k}/output/{expected[1]}") for k, key in report.first_divergence.items()), \
        report.first_divergence
    assert any(r.step > 0 and r.origin == "inherited" for r in report.failed)


@pytest.mark.parametrize("convention", ["hf", "qeff"])
def test_faults_in_other_conventions(convention, tmp_path):
    """The same localisation on the dynamic and QEfficient conventions (their own I/O names)."""
    model, arrays = F.model_and_arrays("tiny-qwen3.5", vocab_size=2048, eos_token_id=2000)
    params = {} if convention == "hf" else {"seq_len": 4, "ctx_len": 16}
    golden = read_bundle(write_golden(tmp_path / "golden", model, PROMPT, source="x", convention=convention,
                                      params=params, decode_steps=STEPS, taps="."))
    clean = F.device_dump(model, PROMPT, params, STEPS, tmp_path / "clean", convention=convention)
    assert compare(golden, read_dump(clean, golden)).exit_code == 0
    dump = F.device_dump(model, PROMPT, params, STEPS, tmp_path / "fp16",
                         F.fp16_round("model.layers.2.linear_attn.core"), convention=convention)
    report = compare(golden, read_dump(dump, golden))
    assert _first(report) == (0, "model.layers.2.linear_attn.core")
    assert all(key in (None, f"{k}/tap/model.layers.2.linear_attn.core")
               for k, key in report.first_divergence.items())
    faulty = F.perturbed_weights(model, arrays, "model.layers.3.self_attn.k_norm.weight")
    dump = F.device_dump(faulty, PROMPT, params, STEPS, tmp_path / "knorm", convention=convention)
    report = compare(golden, read_dump(dump, golden))
    assert _first(report) == (0, "model.layers.3.self_attn.k_norm")
    later = {key.split("/", 2)[2] for k, key in report.first_divergence.items() if key and k > 0}
    assert later <= {"model.layers.3.self_attn.k_norm"}  # each call's own k_norm, nothing downstream claimed


def test_replay_cannot_separate_without_the_layer_inputs(tmp_path):
    model, arrays = F.model_and_arrays("tiny-qwen3.5", vocab_size=2048, eos_token_id=2000)
    golden = read_bundle(write_golden(tmp_path / "golden", model, PROMPT, source="x", convention="genie",
                                      params=PARAMS, decode_steps=0, taps=r"layers\.2\.mlp"))
    faulty = F.perturbed_weights(model, arrays, "model.layers.0.input_layernorm.weight")
    dump = read_dump(F.device_dump(faulty, PROMPT, PARAMS, 0, tmp_path / "dump"), golden)
    rows = replay(golden, dump, model, layer=2)
    assert rows and not any(r.adds_error for r in rows)
    gate = next(r for r in rows if r.name == "model.layers.2.mlp.gate_proj")
    # the reference had to compute layer 2's norm and attention from layer 1's (undumped) output: no claim
    assert gate.not_forced == ["model.layers.1"]
    assert "model.layers.2.post_attention_layernorm" in gate.through


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_three_way_judging_with_precision_emulation(dtype, hybrid, tmp_path):
    """Golden float32, emulated = the same model at `dtype` (refimpl.precision), device = an honest `dtype` run
    whose roundings fall differently (weights nudged by one float32 ulp, as another accumulation order would):
    judged within k x the emulation's own error it passes, while the fp32 bar flags it; faults on top of it are
    still localised."""
    model, arrays, bundle, root = hybrid
    p = policy(dtype)

    def at_precision(arrs):
        return Model(model.config, Weights(arrs, dtype=p.dtype, transform=weight_transform(p)), precision=p)
    emulated = read_bundle(write_golden(tmp_path / "emulated", at_precision(arrays), PROMPT, source="x",
                                        convention="genie", params=PARAMS, decode_steps=STEPS, taps="."))
    rng = np.random.default_rng(1)
    nudged = {n: (a * (1 + rng.choice([-1, 1], a.shape) * 2.0 ** -23).astype(np.float32) if a.ndim == 2 else a)
              for n, a in arrays.items()}
    honest = read_dump(F.device_dump(at_precision(nudged), PROMPT, PARAMS, STEPS, tmp_path / "honest"), bundle)
    assert compare(bundle, honest).exit_code == 1                                   # the fp32 bar flags it
    report = compare(bundle, honest, load_policy(dtype=dtype), emulated=emulated)
    assert report.failed == [], [(r.key, r.failures) for r in report.failed][:3]
    for make, expected in ((lambda: (None, F.interleaved_rope()), (0, "model.layers.3.self_attn.q_rope")),
                           (lambda: (None, F.conv_state_shifted()), (0, "model.layers.0.linear_attn.conv_state")),
                           # bf16 noise at layer 3 is already NMSE ~6e-4 (32 dB): the weight error must exceed
                           # k x that to show in totals (replay isolates smaller ones)
                           (lambda: (F.perturbed_weights(model, nudged, "model.layers.3.self_attn.q_norm.weight",
                                                         scale=5e-2 if dtype == "fp16" else 0.25), None),
                            (0, "model.layers.3.self_attn.q_norm"))):
        device_model, context = make()
        device = at_precision(nudged if device_model is None else
                              {**nudged, "model.layers.3.self_attn.q_norm.weight":
                               device_model.weights.stored["model.layers.3.self_attn.q_norm.weight"]})
        dump = F.device_dump(device, PROMPT, PARAMS, STEPS, tmp_path / f"fault-{expected[1]}", context)
        report = compare(bundle, read_dump(dump, bundle), load_policy(dtype=dtype), emulated=emulated)
        assert _first(report) == expected


def test_three_way_tie_is_followed_not_failed(tmp_path):
    """Two experts with the same router row tie exactly at every token; refimpl breaks ties to the lower id,
    torch.topk may not. A bf16 device taking the other expert of the tie passes three-way, the tensors after it are
    'diverged' (another valid path, not judged) with a note; taking an expert that was not tied still fails."""
    model, arrays = F.model_and_arrays("tiny-qwen3-moe", vocab_size=2048, eos_token_id=2000)
    router = "model.layers.1.mlp.gate.weight"
    arrays = {**arrays, router: arrays[router].copy()}
    arrays[router][5] = arrays[router][2]                                  # experts 2 and 5 always tie
    p = policy("bf16")

    def at(precision_arrays, p=p):
        return Model(model.config, Weights(precision_arrays, dtype=p.dtype, transform=weight_transform(p)), precision=p)
    golden = read_bundle(write_golden(tmp_path / "g", Model(model.config, Weights(arrays)), PROMPT, source="x",
                                      convention="genie", params=PARAMS, decode_steps=STEPS, taps="."))
    emulated = read_bundle(write_golden(tmp_path / "e", at(arrays), PROMPT, source="x", convention="genie",
                                        params=PARAMS, decode_steps=STEPS, taps=".",
                                        decode_ids=golden.manifest["generated_ids"]))

    def other_side(to):
        def fn(selected):
            s = selected.copy()
            rows = (s == 2).any(-1) & ~(s == to).any(-1)
            s[rows] = np.where(s[rows] == 2, to, s[rows])
            return s
        return F.corrupt_tap("model.layers.1.mlp.selected_experts", fn)
    tied = F.device_dump(at(arrays), PROMPT, PARAMS, STEPS, tmp_path / "tied", other_side(5))
    report = compare(golden, read_dump(tied, golden), load_policy(dtype="bf16"), emulated=emulated)
    assert report.exit_code == 0, [(r.key, r.failures) for r in report.failed][:3]
    assert any(r.status == "diverged" for r in report.results)
    assert any(n.startswith("tie at step") and "expert 5 where the emulation took 2" in n for n in report.notes)
    untied = F.device_dump(at(arrays), PROMPT, PARAMS, STEPS, tmp_path / "untied", other_side(3))
    report = compare(golden, read_dump(untied, golden), load_policy(dtype="bf16"), emulated=emulated)
    assert _first(report)[1] == "model.layers.1.mlp.selected_experts"
