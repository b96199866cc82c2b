"""End to end on a real NPU's arithmetic: Qualcomm's HTP simulator (tests/e2e/htp.py, docs/htp.md) runs transformers'
models exported in float16, every node on the HTP; `refimpl diff` judges the dumps three-way against the golden
and refimpl's htp-fp16 emulation. Honest runs of the dense, MoE, Qwen3-Next and Qwen3.5 presets pass, prompt and
decode calls (tiny-qwen3.5-moe does not yet: docs/htp.md); each planted fault is the first divergence at its step,
layer and op and replay blames that op; the two HTP compiler bugs the rewrites avoid are reproduced and named at
their op.

One float16 export per architecture and call shape for the session (`htp_cases`), optimized once (htp.optimized):
weight faults are planted in the optimized graph's initializers (found by the checkpoint's names in the raw
export), host faults in the host loop, and a graph is compiled for the HTP once (htp.compiled_session), so no
fault re-exports or re-optimizes and host faults compile nothing."""

import dataclasses
import math
from unittest import mock

import devices as D
import numpy as np
import pytest

htp = pytest.importorskip("htp")
reason = htp.unavailable()
if reason:
    pytest.skip(reason, allow_module_level=True)

from refimpl.bundle import read_bundle  # noqa: E402
from refimpl.diff.compare import compare  # noqa: E402
from refimpl.diff.dump import read_dump  # noqa: E402
from refimpl.diff.policy import make_policy  # noqa: E402
from refimpl.diff.replay import replay  # noqa: E402
from refimpl.golden import write_golden  # noqa: E402

pytestmark = pytest.mark.oracle

PROMPT = [97, 11, 1879, 13, 42, 7, 99]             # one genie chunk of AR = 8 with one pad slot
GENIE = {"ar": 8, "cl": 32, "mask_floor": -1000.0}
STEPS = 2                                         # decode calls after the prompt
LONG_PROMPT = PROMPT + [5, 300, 1200, 64, 8, 777, 31, 1500]   # one chunk of AR = 16: q_norm is [1, 16, H, D]
LONG_GENIE = {**GENIE, "ar": 16}
ARCHITECTURES = {"dense": "tiny-qwen3", "moe": "tiny-qwen3-moe", "next": "tiny-qwen3-next", "hybrid": "tiny-qwen3.5"}
# tiny-qwen3.5-moe is not among them: its honest HTP run fails (docs/htp.md, section 7)
HTP_POLICY = {"layouts": {".": "hf-hooks"}}


@dataclasses.dataclass
class Case:
    config: dict
    arrays: dict
    model: object
    root: object
    exports: dict = dataclasses.field(default_factory=dict)   # AR -> the raw ONNX export (faults, skips: rewrite)
    prompt: list = dataclasses.field(default_factory=lambda: PROMPT)
    genie: dict = dataclasses.field(default_factory=lambda: GENIE)
    goldens: dict = dataclasses.field(default_factory=dict)
    dumps: dict = dataclasses.field(default_factory=dict)

    def golden(self, convention: str = "genie", precision: str | None = None):
        """The float32 golden, or the htp-fp16 emulation following its tokens."""
        key = (convention, precision)
        if key not in self.goldens:
            follow = self.golden(convention).manifest["generated_ids"] if precision else None
            params, steps = (self.genie, STEPS) if convention == "genie" else ({}, 0)
            path = self.root / f"golden-{convention}-{precision}"
            model = D.reference(self.config, self.arrays, precision)
            self.goldens[key] = read_bundle(write_golden(path, model, self.prompt, source="e2e", convention=convention,
                                                         params=params, decode_steps=steps, taps=".",
                                                         decode_ids=follow))
        return self.goldens[key]

    def dump(self, fault: D.Fault | None = None, skip=(), name="honest"):
        """The HTP's genie dump (the float32 golden's tokens), cached by name."""
        if name not in self.dumps:
            bundle = self.golden()
            m, params = bundle.manifest, bundle.manifest["convention"]["params"]
            graph = htp.htp_genie_graph(self.model, self.model.config, params, self.root, fault, skip, self.exports)
            calls = D.run_genie(graph, self.model.config, [(s["graph"], s["tokens"]) for s in m["steps"]], params,
                                fault)
            self.dumps[name] = D.write_dump(calls, self.root / f"dump-{name}")
        return self.dumps[name]


@pytest.fixture(scope="session")
def htp_cases(tmp_path_factory):
    built = {}

    def get(arch: str) -> Case:
        """One architecture's case: its model loaded once, its exports, compiled graphs and goldens cached."""
        if arch not in built:
            root = tmp_path_factory.mktemp(f"htp-{arch}")
            config, arrays = D.small_preset(ARCHITECTURES[arch])
            model = D.load_hf(D.hf_checkpoint(config, arrays, root / "checkpoint"), "float16", "eager", "batched_mm")
            built[arch] = Case(config, arrays, model, root)
        return built[arch]
    return get


def judge(case: Case, dump_path, convention="genie"):
    bundle = case.golden(convention)
    return compare(bundle, read_dump(dump_path, bundle), make_policy(HTP_POLICY, "fp16"),
                   emulated=case.golden(convention, "htp-fp16"))


def margin(report) -> tuple[float, str]:
    """How far the worst tensor's NMSE stays under its three-way bar (dB), and where."""
    policy = make_policy(HTP_POLICY, "fp16")
    worst, where = math.inf, None
    for r in report.results:
        if r.metrics and not r.metrics.get("integer") and r.metrics["n"] and r.reference and r.status != "diverged":
            slack = 10 * math.log10(policy.criteria(r.name, False, r.reference)["max_nmse"] /
                                    max(r.metrics["nmse"], 1e-300))
            if slack < worst:
                worst, where = slack, f"step {r.step} {r.name}"
    return worst, where


def first(report):
    return next(((k, key.split("/", 2)[2]) for k, key in sorted(report.first_divergence.items()) if key), None)


# ------------------------------------------------------------------------------------------------ honest runs

@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_honest_htp_runs_pass_three_way(arch, htp_cases):
    case = htp_cases(arch)
    report = judge(case, case.dump())
    assert report.exit_code == 0, [(r.key, r.failures) for r in report.failed][:4]
    assert report.notes == [] and report.missing == []
    steps = {r.step for r in report.results if r.role == "tap"}
    assert steps == set(range(STEPS + 1))                 # the prompt call and every decode call judged
    assert sum(r.role == "tap" for r in report.results) > 100
    worst, where = margin(report)
    assert worst > 1.0, (worst, where)                    # every tensor under its bar with margin (docs/htp.md)


# ------------------------------------------------------------------------------------------------ faults

# the diff's per-channel judgement (refimpl/diff/channels.py): a 2 % error on one of 64 channels is an NMSE of
# ~6e-6, under the tensor's fp16 three-way bar; per channel (4e-4) it stands out of the rest of layer 1's v_proj
# (3e-6) by 29 x the chance quantile over 7 tokens, where 16 is the bar. Layer 1's down_proj carries more fp16
# noise (the rest at 6e-6 over 7 tokens, 1.3e-5 over 31): x1.02 there stands out by 7 (12 over 31 tokens) and is
# not caught; docs/htp.md states the limit
FAULTS = {
    # name: (architecture, Fault, expected first divergence (step, tensor), replayed (step, layer), ops blamed)
    "norm gain x1.05 (dense)": ("dense", D.Fault(scale_weight=("model.layers.1.input_layernorm.weight", 1.05)),
                                (0, "model.layers.1.input_layernorm"), (0, 1), ["model.layers.1.input_layernorm"]),
    "one output channel x1.02 (dense v_proj)": (
        "dense", D.Fault(scale_channel=("model.layers.1.self_attn.v_proj.weight", 5, 1.02)),
        (0, "model.layers.1.self_attn.v_proj"), (0, 1), ["model.layers.1.self_attn.v_proj"]),
    "router rows swapped (moe)": ("moe", D.Fault(swap_rows=("model.layers.1.mlp.gate.weight", 0, 3)),
                                  (0, "model.layers.1.mlp.router_logits"), (0, 1),
                                  ["model.layers.1.mlp.router_logits"]),
    "GDN A_log + 0.1 (hybrid)": ("hybrid", D.Fault(shift_weight=("model.layers.1.linear_attn.A_log", 0.1)),
                                 (0, "model.layers.1.linear_attn.g"), (0, 1), ["model.layers.1.linear_attn.g"]),
    "conv weight x1.1 (next)": ("next", D.Fault(scale_weight=("model.layers.0.linear_attn.conv1d.weight", 1.1)),
                                (0, "model.layers.0.linear_attn.conv1d_silu"), (0, 0),
                                ["model.layers.0.linear_attn.conv1d_silu"]),
    "KV window shifted at a decode call (dense)": ("dense", D.Fault(window_shift_step=2), (2, "past_key_0_in"),
                                                   (2, 0), []),
    "recurrent state not carried (hybrid)": ("hybrid", D.Fault(recurrent_not_carried_step=1),
                                             (1, "recurrent_state_0_in"), (1, 0), []),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_planted_fault_on_the_htp_is_localised_and_blamed(fault, htp_cases):
    arch, planted, expected, (step, layer), blamed = FAULTS[fault]
    case = htp_cases(arch)
    dump_path = case.dump(planted, name=fault)
    report = judge(case, dump_path)
    assert first(report) == expected, [(r.key, r.failures) for r in report.failed][:3]
    hit = next(r for r in report.results if r.step == expected[0] and r.name == expected[1])
    assert hit.origin == "added" and report.exit_code == 1
    step_results = [r for r in report.results if r.step == expected[0]]
    assert all(r.status == "pass" for r in step_results[:step_results.index(hit)])
    bundle = case.golden()
    rows = replay(bundle, read_dump(dump_path, bundle), D.reference(case.config, case.arrays, "htp-fp16"),
                  layer=layer, step=step, policy=make_policy(HTP_POLICY, "fp16"))
    assert sorted(r.name for r in rows if r.adds_error) == sorted(blamed), \
        [(r.name, r.failures) for r in rows if r.adds_error]


# ------------------------------------------------------------------------------------------------ compiler bugs

def rms_norm_graph(shape, dtype, weight_first=True):
    """The exported RMSNorm chain Pow -> ReduceMean -> Add -> Sqrt -> Reciprocal -> Mul -> Mul over the last axis
    (transformers' `weight * x` when weight_first), its seeded input x, its weight and the exact RMSNorm of x."""
    onnx, helper = htp.onnx, htp.onnx.helper
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    w = (1 + 0.1 * np.random.default_rng(1).standard_normal(shape[-1])).astype(dtype)
    consts = {"w": w, "two": np.array(2, dtype), "axes": np.array([-1], np.int64), "eps": np.array(1e-6, dtype)}
    nodes = [helper.make_node("Pow", ["x", "two"], ["p"]), helper.make_node("ReduceMean", ["p", "axes"], ["m"]),
             helper.make_node("Add", ["m", "eps"], ["a"]), helper.make_node("Sqrt", ["a"], ["s"]),
             helper.make_node("Reciprocal", ["s"], ["r"]), helper.make_node("Mul", ["x", "r"], ["n"]),
             helper.make_node("Mul", ["w", "n"] if weight_first else ["n", "w"], ["y"])]
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(nodes, "rms_norm", [helper.make_tensor_value_info("x", elem, x.shape)],
                              [helper.make_tensor_value_info("y", elem, x.shape)],
                              [onnx.numpy_helper.from_array(v, k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    x64 = x.astype(np.float64)
    return model, x, w.astype(np.float64) * x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6)


def test_htp_rms_norm_fusion_fails_a_float32_graph_and_the_rewrite_is_exact():
    """The HTP compiler fuses the exported RMSNorm chain into its RmsNorm kernel; with the weight as the first Mul
    operand (transformers' `weight * x`) a float32 graph then fails to finalize. Pow(x, 2) -> Mul(x, x) (the same
    product) stops the fusion: the graph compiles and computes RMSNorm to fp16 precision."""
    model, x, want = rms_norm_graph((1, 8, 4, 32), np.float32)
    with pytest.raises(Exception, match="QNN_COMMON_ERROR_MEM_ALLOC"):
        htp.session(model.SerializeToString())
    assert htp.unfused_rms_norm(model) == 1
    y = htp.session(model.SerializeToString()).run(None, {"x": x})[0]
    assert np.abs(y - want).max() < 4 * 2.0 ** -11 * np.abs(want).max()


def test_htp_rms_norm_fusion_is_wrong_on_the_4d_q_norm_of_a_longer_prompt():
    """In float16 the fused RmsNorm kernel (weight first) computes q_norm / k_norm's 4-D [B, T, H, D] (norm over D)
    wrong at T = 16 (T = 8, the other tests' AR, and 3-D [B, T, C] are right; docs/htp.md has the shapes): here a
    third of the elements off by more than 1 % of the tensor's scale, the worst by more than the scale. Mul(x, x)
    for Pow(x, 2) is exact again."""
    model, x, want = rms_norm_graph((1, 16, 8, 32), np.float16)
    fused = htp.session(model.SerializeToString()).run(None, {"x": x})[0].astype(np.float64)
    scale = np.abs(want).max()
    assert np.abs(fused - want).max() > 0.5 * scale and (np.abs(fused - want) > 0.01 * scale).mean() > 0.1
    assert htp.unfused_rms_norm(model) == 1
    y = htp.session(model.SerializeToString()).run(None, {"x": x})[0].astype(np.float64)
    assert np.abs(y - want).max() < 4 * 2.0 ** -11 * scale


def test_htp_gathernd_bug_is_named_at_the_expert_gather(htp_cases):
    """Without the GatherND rewrite the HTP gathers wrong expert rows (transformers' batched_mm experts): the diff's
    first divergence is layer 0's experts, the first op downstream of the gather, at the prompt call."""
    case = htp_cases("moe")
    report = judge(case, case.dump(skip=("gathernd",), name="gathernd-bug"))
    assert report.exit_code == 1
    step, name = first(report)
    assert step == 0 and name.startswith("model.layers.0.mlp."), (step, name)
    bundle = case.golden()
    rows = replay(bundle, read_dump(case.dumps["gathernd-bug"], bundle), D.reference(case.config, case.arrays,
                                                                                     "htp-fp16"),
                  layer=0, step=0, policy=make_policy(HTP_POLICY, "fp16"))
    assert [r.name for r in rows if r.adds_error][:1] == [name]


def rms_norm_in_input_dtype(self, x):
    """An RMSNorm computed in its input's dtype (transformers' Qwen3RMSNorm computes in float32 between two Casts,
    which keeps its weight Mul out of the compiler's fusion): what a float16 export of a norm that does not upcast
    gives the HTP, the chain Pow -> ReduceMean -> Add -> Sqrt -> Reciprocal -> Mul -> Mul(weight, .) in float16."""
    return self.weight * (x * htp.torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def test_htp_rms_norm_bug_is_named_at_q_norm(htp_cases, tmp_path):
    """Without the RMSNorm rewrite, a float16 export whose norms do not upcast, on a 15-token prompt (one AR = 16
    chunk: q_norm / k_norm are [1, 16, H, D]): the fused RmsNorm kernel's wrong values are the first divergence, at
    layer 0's q_norm or k_norm at the prompt call, and replay blames that op; with the rewrite the run passes."""
    short = htp_cases("dense")
    case = Case(short.config, short.arrays, short.model, tmp_path, prompt=LONG_PROMPT, genie=LONG_GENIE)
    with mock.patch.object(type(short.model.model.norm), "forward", rms_norm_in_input_dtype):
        honest = judge(case, case.dump())
        report = judge(case, case.dump(skip=("rms_norm",), name="rms-norm-bug"))
    assert honest.exit_code == 0, [(r.key, r.failures) for r in honest.failed][:3]
    assert report.exit_code == 1
    step, name = first(report)
    assert step == 0 and name in ("model.layers.0.self_attn.q_norm", "model.layers.0.self_attn.k_norm"), (step, name)
    bundle = case.golden()
    rows = replay(bundle, read_dump(case.dumps["rms-norm-bug"], bundle), D.reference(case.config, case.arrays,
                                                                                      "htp-fp16"),
                  layer=0, step=0, policy=make_policy(HTP_POLICY, "fp16"))
    assert [r.name for r in rows if r.adds_error][:1] == [name]
