"""End to end: independent devices (tests/e2e/devices.py: transformers float32 / bf16, ONNX Runtime float32 / float16)
dump what their module hooks see, `refimpl diff` judges the dumps against refimpl's goldens. Honest runs pass (fp32
bars, or three-way for bf16 / fp16); each planted fault is named at its step, layer and op, and replay blames that
op only. The margins over many more steps are docs/diff.md's calibration table (tests/e2e/calibrate.py)."""

import dataclasses
import math

import devices as D
import numpy as np
import pytest

from refimpl.bundle import read_bundle
from refimpl.diff.compare import compare
from refimpl.diff.dump import read_dump
from refimpl.diff.policy import make_policy
from refimpl.diff.replay import replay
from refimpl.golden import write_golden

# one xdist worker runs the module: its architectures' checkpoints, goldens and loaded transformers models (the
# `cases` fixture, module-scoped) are then built once, not once per worker (`make test` runs --dist loadgroup)
pytestmark = [pytest.mark.oracle, pytest.mark.xdist_group("e2e-independent-devices")]

PROMPT = [97, 11, 1879, 13, 42, 7, 99]             # one genie chunk of AR = 8 with one pad slot
GENIE = {"ar": 8, "cl": 32, "mask_floor": -1000.0}  # W = 24 window slots, most of them empty
# the prompt in one QEfficient chunk without pads (the QEff GDN port neutralises pads after a state, transformers
# lets them in: the device runs the hybrids unpadded); QEFF_PADDED: chunks of 4 and 3 + 1 right pad (position -1)
QEFF, QEFF_PADDED = {"seq_len": 7, "ctx_len": 32}, {"seq_len": 4, "ctx_len": 32}
STEPS = 3                                         # decode calls after the prompt
ARCHITECTURES = {"dense": "tiny-qwen3", "moe": "tiny-qwen3-moe", "hybrid": "tiny-qwen3.5", "next": "tiny-qwen3-next"}


@dataclasses.dataclass
class Case:
    config: dict
    arrays: dict
    checkpoint: object
    root: object
    goldens: dict = dataclasses.field(default_factory=dict)
    models: dict = dataclasses.field(default_factory=dict)
    exports: dict = dataclasses.field(default_factory=dict)   # the HTP's float16 exports (AR -> file), made once

    def golden(self, convention: str, precision: str | None = None, params: dict | None = None, steps: int = STEPS):
        """The float32 golden, or (precision) the emulated bundle following its tokens (three-way judging)."""
        params = params if params is not None else {"genie": GENIE, "qeff": QEFF}.get(convention, {})
        key = (convention, precision, tuple(sorted(params.items())), steps)
        if key not in self.goldens:
            follow = self.golden(convention, None, params, steps).manifest["generated_ids"] if precision else None
            path = self.root / f"golden-{len(self.goldens)}"
            self.goldens[key] = read_bundle(write_golden(path, D.reference(self.config, self.arrays, precision),
                                                         PROMPT, source="e2e", convention=convention, params=params,
                                                         decode_steps=steps, taps=".", decode_ids=follow))
        return self.goldens[key]

    def hf(self, dtype="float32", attn="eager", experts=None):
        if (dtype, attn, experts) not in self.models:
            self.models[dtype, attn, experts] = D.load_hf(self.checkpoint, dtype, attn, experts)
        return self.models[dtype, attn, experts]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    built = {}

    def get(arch: str) -> Case:
        if arch not in built:
            root = tmp_path_factory.mktemp(arch)
            config, arrays = D.small_preset(ARCHITECTURES[arch])
            built[arch] = Case(config, arrays, D.hf_checkpoint(config, arrays, root / "checkpoint"), root)
        return built[arch]
    return get


def device_dump(case: Case, bundle, out, fault=None, dtype="float32", attn="eager", runtime="transformers"):
    """Run the device on the bundle's case (its tokens, its convention options) and write its dump."""
    m = bundle.manifest
    model = case.hf(dtype, attn)
    if m["convention"]["name"] == "hf":
        calls = D.run_hf(model, m["prompt_ids"], m["generated_ids"], fault)
    elif m["convention"]["name"] == "qeff":
        calls = D.run_qeff(model, [(s["graph"], s["tokens"]) for s in m["steps"]], m["convention"]["params"], fault)
    else:
        params = m["convention"]["params"]
        if runtime == "htp":   # Qualcomm's HTP simulator (htp.py): float16, weight faults planted in the export
            htp = pytest.importorskip("htp")
            model = case.hf("float16", "eager", "batched_mm")
            (case.root / "htp").mkdir(exist_ok=True)
            graph = htp.htp_genie_graph(model, model.config, params, case.root / "htp", fault, (), case.exports)
        elif runtime == "ort":
            graph = D.ort_graph(model, model.config, params, None, out.parent, fault)
        else:
            graph = D.eager_graph(model, model.config, params, fault)
        calls = D.run_genie(graph, model.config, [(s["graph"], s["tokens"]) for s in m["steps"]], params, fault)
        getattr(graph, "close", lambda: None)()
    return D.write_dump(calls, out)


# taps no module hook or hooked function returns in transformers' eager / sdpa code, and why
HOOK_HIDDEN = {
    "self_attn.attn_scores": "eager_attention_forward returns the probabilities, never the scaled scores",
    "self_attn.attn_probs": "sdpa returns only the attention output",
    "self_attn.attn_output": "sdpa_attention_forward is not hooked (its torch kernel is the op)",
    "self_attn.gate": "a hybrid's q_proj returns the query and its gate fused; the split is not a call",
    "mlp.router_probs": "the MoE block's softmax of the router logits is not a module",
    "linear_attn.q": "read after the in-kernel l2norm only",
    "linear_attn.k": "read after the in-kernel l2norm only",
    "linear_attn.conv1d": "at decode torch_causal_conv1d_update returns silu(conv) only (conv1d_silu)",
    "linear_attn.conv_state": "a cache entry, not returned by a call",
}


def judge(bundle, dump_path, dtype="fp32", emulated=None):
    return compare(bundle, read_dump(dump_path, bundle), make_policy({"layouts": {".": "hf-hooks"}}, dtype),
                   emulated=emulated)


def first(report):
    """(step, name) of the earliest first divergence."""
    return next(((k, key.split("/", 2)[2]) for k, key in sorted(report.first_divergence.items()) if key), None)


def worst_sqnr(report) -> float:
    return min(r.metrics["sqnr_db"] for r in report.results if r.metrics and r.metrics["n"])


# ------------------------------------------------------------------------------------------------ honest runs

@pytest.mark.parametrize("arch,convention,attn,params", [
    ("dense", "hf", "eager", None), ("dense", "genie", "sdpa", None), ("moe", "genie", "eager", None),
    ("hybrid", "hf", "sdpa", None), ("hybrid", "genie", "eager", None), ("next", "hf", "eager", None),
    ("dense", "qeff", "eager", QEFF_PADDED), ("moe", "qeff", "sdpa", QEFF_PADDED), ("hybrid", "qeff", "eager", None),
    ("next", "qeff", "sdpa", None)])
def test_honest_float32_runs_pass(arch, convention, attn, params, cases, tmp_path):
    case = cases(arch)
    bundle = case.golden(convention, params=params)
    dump_path = device_dump(case, bundle, tmp_path / "dump", attn=attn)
    report = judge(bundle, dump_path)
    assert report.exit_code == 0, [(r.key, r.failures) for r in report.failed][:3]
    assert report.notes == [] and report.missing == []
    # the hooks reach every tap but those no module or hooked function returns (HOOK_HIDDEN)
    taps = {(k, t) for k, s in enumerate(bundle.manifest["steps"]) for t in s["taps"]}
    scored = {(r.step, r.key.split("/", 2)[2]) for r in report.results if r.role == "tap"}
    unreached = {t.split(".", 3)[3] for _, t in taps - scored}
    assert unreached <= set(HOOK_HIDDEN), unreached - set(HOOK_HIDDEN)
    assert worst_sqnr(report) > 95  # the calibrated margin over more steps: docs/diff.md
    # op by op, an honest device adds nothing anywhere (layer 1 at the last step; op-level noise is ~120 dB)
    rows = replay(bundle, read_dump(dump_path, bundle), D.reference(case.config, case.arrays), layer=1, step=STEPS,
                  policy=make_policy({"layouts": {".": "hf-hooks"}}))
    assert rows and not any(r.adds_error for r in rows), [(r.name, r.failures) for r in rows if r.adds_error]


# ------------------------------------------------------------------------------------------------ faults

A, G = "self_attn", "linear_attn"
FAULTS = {
    # name: (architecture, convention, Fault, expected (step, tensor), replayed (step, layer), ops replay blames)
    "norm weight (dense)": ("dense", "genie", D.Fault(scale_weight=("model.layers.1.input_layernorm.weight", 1.1)),
                            (0, "model.layers.1.input_layernorm"), (0, 1), ["model.layers.1.input_layernorm"]),
    "k_norm weight (moe)": ("moe", "hf", D.Fault(scale_weight=("model.layers.2.self_attn.k_norm.weight", 1.1)),
                            (0, "model.layers.2.self_attn.k_norm"), (0, 2), ["model.layers.2.self_attn.k_norm"]),
    "gated norm weight (hybrid)": ("hybrid", "genie", D.Fault(scale_weight=("model.layers.1.linear_attn.norm.weight",
                                                                            1.1)),
                                   (0, "model.layers.1.linear_attn.norm"), (0, 1), ["model.layers.1.linear_attn.norm"]),
    "A_log (hybrid)": ("hybrid", "hf", D.Fault(scale_weight=("model.layers.1.linear_attn.A_log", 1.2)),
                       (0, "model.layers.1.linear_attn.g"), (0, 1), ["model.layers.1.linear_attn.g"]),
    "conv weight (hybrid)": ("hybrid", "genie", D.Fault(scale_weight=("model.layers.0.linear_attn.conv1d.weight", 1.1)),
                             (0, "model.layers.0.linear_attn.conv1d_silu"), (0, 0),
                             ["model.layers.0.linear_attn.conv1d_silu"]),
    "interleaved RoPE (dense)": ("dense", "hf", D.Fault(interleaved_rope_layer=2),
                                 (0, "model.layers.2.self_attn.q_rope"), (0, 2),
                                 ["model.layers.2.self_attn.q_rope", "model.layers.2.self_attn.k_rope"]),
    "interleaved RoPE (hybrid)": ("hybrid", "genie", D.Fault(interleaved_rope_layer=3),
                                  (0, "model.layers.3.self_attn.q_rope"), (0, 3),
                                  ["model.layers.3.self_attn.q_rope", "model.layers.3.self_attn.k_rope"]),
    "mask floor -50 (dense)": ("dense", "genie", D.Fault(mask_floor=-50.0), (0, "attention_mask"), (0, 0), []),
    "KV window shifted at a decode step (moe)": ("moe", "genie", D.Fault(window_shift_step=2), (2, "past_key_0_in"),
                                                 (2, 0), []),
    "conv state not shifted (hybrid)": ("hybrid", "genie", D.Fault(conv_state_stale_step=1), (1, "conv_state_0_out"),
                                        (1, 0), ["conv_state_0_out"]),
    "recurrent state not carried (hybrid)": ("hybrid", "genie", D.Fault(recurrent_not_carried_step=2),
                                             (2, "recurrent_state_0_in"), (2, 0), []),
    "recurrent state not carried (next, hf)": ("next", "hf", D.Fault(recurrent_not_carried_step=1),
                                               (1, "past_recurrent_state.0"), (1, 0), []),
    "fp16 overflow in a down projection (hybrid)": ("hybrid", "hf", D.Fault(fp16_overflow_layer=1),
                                                    (0, "model.layers.1.mlp.down_proj"), (0, 1),
                                                    ["model.layers.1.mlp.down_proj"]),
    "K written untransposed (dense)": ("dense", "genie", D.Fault(key_untransposed=True), (0, "past_key_0_out"), (0, 0),
                                       ["past_key_0_out"]),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_planted_fault_is_localised_and_blamed(fault, cases, tmp_path):
    arch, convention, planted, expected, (step, layer), blamed = FAULTS[fault]
    case = cases(arch)
    bundle = case.golden(convention)
    dump_path = device_dump(case, bundle, tmp_path / "dump", planted)
    report = judge(bundle, dump_path)
    assert first(report) == expected, [(r.key, r.failures) for r in report.failed][:3]
    hit = next(r for r in report.results if r.step == expected[0] and r.name == expected[1])
    assert hit.origin == "added" and report.exit_code == 1
    if planted.key_untransposed:
        assert hit.status == "layout" and hit.layout == "transposed"
    from test_fault_classes import FAULT_CLASSES, verdict  # the fault's class (issue 26)
    named, check = FAULT_CLASSES[fault]
    assert verdict(report, named, check, [])[0] == ("right" if named else "unexplained"), hit.fault
    # nothing before the planted tensor fails in its step, no other step claims a divergence of its own elsewhere
    step_results = [r for r in report.results if r.step == expected[0]]
    assert all(r.status == "pass" for r in step_results[:step_results.index(hit)])
    # replay, op by op on the device's own inputs: exactly the planted op adds error (a host fault: none does)
    rows = replay(bundle, read_dump(dump_path, bundle), D.reference(case.config, case.arrays), layer=layer, step=step,
                  policy=make_policy({"layouts": {".": "hf-hooks"}}))
    assert sorted(r.name for r in rows if r.adds_error) == sorted(blamed), \
        [(r.name, r.failures) for r in rows if r.adds_error]
    assert not any(r.not_forced for r in rows)


def test_transformers_pad_handling_after_a_state_is_localised(cases, tmp_path):
    """Not a planted fault: transformers zeroes a pad slot's hidden state in a linear-attention layer, an identity
    only while the state is zero. With the Genie runtime's right padding the pads trail the last prompt chunk,
    after a state, and the contract (refimpl, AI Hub's graph) leaves the state alone at pads. An honest
    transformers device fed that chunk as is runs the pad as a step: the diff names step 1, layer 0's state, and
    replay blames the two ops that let the pad in (the delta rule's decay, the conv state's shift)."""
    case = cases("hybrid")
    bundle = case.golden("genie", params={**GENIE, "ar": 4, "pad_side": "right"})  # chunks of 4 and 3 + 1 pad
    dump_path = device_dump(case, bundle, tmp_path / "dump")
    report = judge(bundle, dump_path)
    assert first(report) == (1, "model.layers.0.linear_attn.recurrent_state")
    rows = replay(bundle, read_dump(dump_path, bundle), D.reference(case.config, case.arrays), layer=0, step=1,
                  policy=make_policy({"layouts": {".": "hf-hooks"}}))
    # the delta rule's state (its tap and the graph output holding it) and the conv state's shift
    assert sorted(r.name for r in rows if r.adds_error) == ["conv_state_0_out",
                                                            "model.layers.0.linear_attn.recurrent_state",
                                                            "recurrent_state_0_out"]


# ------------------------------------------------------------------------------------------------ reduced precision

def test_transformers_bf16_passes_three_way(cases, tmp_path):
    """transformers in bfloat16 against refimpl's bf16 emulation: every tensor's error within k x the emulation's;
    the float32 bar flags the same dump (it is a bf16 run), and a fault on top of it is still named."""
    case = cases("hybrid")
    golden, emulated = case.golden("hf"), case.golden("hf", "bf16")
    dump = device_dump(case, golden, tmp_path / "honest", dtype="bfloat16")
    assert judge(golden, dump).exit_code == 1
    report = judge(golden, dump, "bf16", emulated)
    assert report.exit_code == 0 and report.notes == [], [(r.key, r.failures) for r in report.failed][:3]
    faulty = device_dump(case, golden, tmp_path / "fault", D.Fault(fp16_overflow_layer=2), dtype="bfloat16")
    assert first(judge(golden, faulty, "bf16", emulated)) == (0, "model.layers.2.mlp.down_proj")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_onnx_runtime_device(dtype, cases, tmp_path):
    """GenieGraph exported by torch.onnx.export and run by ONNX Runtime's CPU EP: float32 passes the fp32 bars,
    float16 passes three-way against refimpl's fp16 emulation. AR = 1 graphs (one export serves every call)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    case = cases("hybrid")
    params = {**GENIE, "ar": 1}
    golden = case.golden("genie", params=params)
    emulated = case.golden("genie", "fp16", params=params) if dtype == "float16" else None
    report = judge(golden, device_dump(case, golden, tmp_path / "dump", dtype=dtype, runtime="ort"),
                   "fp16" if emulated else "fp32", emulated)
    assert report.exit_code == 0 and report.notes == [], [(r.key, r.failures) for r in report.failed][:3]
    assert sum(r.role == "tap" for r in report.results) > 100
    if emulated is None:
        assert worst_sqnr(report) > 95
    else:
        assert not math.isinf(worst_sqnr(report)) and np.isfinite(worst_sqnr(report))


# ------------------------------------------------------------------------------------------------ the CLI

def test_cli_names_step_layer_and_op_in_full_on_an_80_column_terminal(cases, tmp_path, capsys, monkeypatch):
    """`refimpl diff` / `replay` on a hooked dump of transformers with a conv weight off: the first divergence and
    the replay verdict name the op; no tensor name is cut at 80 columns; --json carries the full names."""
    from refimpl.cli import main
    case = cases("hybrid")
    bundle = case.golden("genie")
    dump = device_dump(case, bundle, tmp_path / "dump",
                       D.Fault(scale_weight=("model.layers.0.linear_attn.conv1d.weight", 1.1)))
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["diff", str(bundle.path), str(dump), "--layout", "hf-hooks", "--top", "8", "-q",
                 "--json", str(tmp_path / "m.json")]) == 1
    out = capsys.readouterr().out
    assert "first divergence, step 0: model.layers.0.linear_attn.conv1d_silu (tap; layer 0, op conv1d_silu " in out
    assert "…" not in out
    assert "model.layers.0.linear_attn.conv1d_silu " in out.split("first divergence")[0]  # the table row, whole
    assert all(len(line) <= 80 for line in out.split("first divergence")[0].splitlines())
    assert "model.layers.0.linear_attn.conv1d_silu" in (tmp_path / "m.json").read_text()
    assert main(["replay", str(bundle.path), str(dump), "--tensor", "model.layers.0.linear_attn.conv1d_silu",
                 "--step", "0", "--layout", "hf-hooks", "--model", str(case.checkpoint)]) == 1
    out = capsys.readouterr().out   # the conv itself (the module transformers no longer calls) was not dumped
    assert "model.layers.0.linear_attn.conv1d_silu" in out and "ADDS ERROR (this op or the undumped conv1d" in out


# ------------------------------------------------------------------------------------------------ per channel

# a projection of every architecture whose output channel a device scales wrongly (its tap: the module's output)
PROJECTION = {"dense": "model.layers.1.mlp.down_proj", "moe": "model.layers.1.self_attn.o_proj",
              "hybrid": "model.layers.1.mlp.down_proj", "next": "model.layers.1.mlp.shared_expert.down_proj"}


# the fp16 device and the channel's scale: ONNX Runtime, x1.02; for the hybrids transformers itself in float16
# (torch.onnx.export of their chunked Gated DeltaNet prompt graph takes longer than a test may: ~25 s for the
# attention-only models, over 15 min here), x1.05: transformers' fp16 hybrids are noisier (the down projections'
# other channels at NMSE 1e-5 to 2e-5, ONNX Runtime's dense one 1.3e-6), and a x1.02 channel (NMSE 3-5e-4) stands
# out of them by a contrast of 6.5-9.8 (7 or 28 tokens) where the bar allows 16 (docs/diff.md, "Per channel")
FP16_DEVICE = {"dense": ("ort", 1.02), "moe": ("ort", 1.02), "hybrid": ("eager", 1.05), "next": ("eager", 1.05)}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_one_channel_scaled_is_caught_under_fp16_noise(arch, cases, tmp_path):
    """A float16 device (a prompt call of AR = 8, judged three-way against refimpl's fp16 emulation): the honest
    run passes; the same run with one output channel of a projection scaled (FP16_DEVICE; ONNX Runtime: a Mul after
    it in the exported graph, a wrong per-channel output scale; transformers: that weight row) is named at that
    projection, by its worst channel, while its whole-tensor NMSE stays under the tensor's bar; replay blames that
    op alone. The channel is the golden's median-power one."""
    case = cases(arch)
    params = {**GENIE, "ar": 8}
    golden = case.golden("genie", params=params, steps=0)
    emulated = case.golden("genie", "fp16", params=params, steps=0)
    tap = PROJECTION[arch]
    power = np.mean(golden.tensor(0, "tap", tap).astype(np.float64) ** 2, axis=(0, 1))     # [C]
    channel = int(np.argsort(power)[len(power) // 2])
    steps = [(s["graph"], s["tokens"]) for s in golden.manifest["steps"]]
    params = golden.manifest["convention"]["params"]   # the bundle's genie options in full (conv state length, ...)
    runtime, factor = FP16_DEVICE[arch]
    if runtime == "ort":
        pytest.importorskip("onnxruntime")
        pytest.importorskip("onnxscript")
        model = case.hf("float16", experts="batched_mm")
        (tmp_path / "honest").mkdir()
        graph = D.ort_graph(model, model.config, params, None, tmp_path / "honest")
        honest = D.run_genie(graph, model.config, steps, params)
        D.scale_output(tmp_path / "honest" / "genie_ar8.onnx", tmp_path / "fault", tap, channel, factor)
        faulty = D.run_genie(D.ort_graph(model, model.config, params, None, tmp_path / "fault"), model.config, steps,
                             params)
    else:
        model = case.hf("float16")
        runs = []
        for fault in (None, D.Fault(scale_channel=(f"{tap}.weight", channel, factor))):
            graph = D.eager_graph(model, model.config, params, fault)
            runs.append(D.run_genie(graph, model.config, steps, params, fault))
            graph.close()
        honest, faulty = runs
    report = judge(golden, D.write_dump(honest, tmp_path / "honest-dump"), "fp16", emulated)
    assert report.exit_code == 0, [(r.key, r.failures) for r in report.failed][:3]

    dump = D.write_dump(faulty, tmp_path / "fault-dump")
    report = judge(golden, dump, "fp16", emulated)
    assert first(report) == (0, tap), [(r.key, r.failures) for r in report.failed][:3]
    hit = next(r for r in report.results if r.key == f"0/tap/{tap}")
    assert hit.metrics["nmse"] <= hit.bar["max_nmse"]          # the whole tensor passes its bar ...
    assert hit.metrics["channels"]["worst"] == [channel]       # ... its channel does not
    assert hit.failures == [f for f in hit.failures if f.startswith(f"channel [{channel}]")]
    assert hit.metrics["channels"]["gain"] == pytest.approx(factor - 1, abs=0.004)
    rows = replay(golden, read_dump(dump, golden), D.reference(case.config, case.arrays), layer=1, step=0,
                  policy=make_policy({"layouts": {".": "hf-hooks"}}, "fp16"))
    assert [r.name for r in rows if r.adds_error] == [tap], [(r.name, r.failures) for r in rows if r.adds_error]


@pytest.mark.parametrize("arch", ["dense", "moe", "next"])
def test_honest_bf16_passes_per_channel(arch, cases, tmp_path):
    """transformers in bfloat16 (hf convention, prompt and decode calls), three-way: no channel of an honest run
    fails (the Qwen3.5 run is test_transformers_bf16_passes_three_way's)."""
    case = cases(arch)
    golden, emulated = case.golden("hf"), case.golden("hf", "bf16")
    report = judge(golden, device_dump(case, golden, tmp_path / "dump", dtype="bfloat16"), "bf16", emulated)
    assert report.exit_code == 0, [(r.key, r.failures) for r in report.failed][:3]
    assert sum(bool((r.metrics or {}).get("channels")) for r in report.results) > 100
