"""Module-hook dumps (refimpl.diff.hooks): a golden's own taps rewritten into the names and layouts PyTorch module
hooks give them must read back into the bundle's taps, declared `--layout hf-hooks` or not.
(tests/e2e runs the real thing: transformers and ONNX Runtime hooked.)"""

import faults as F
import numpy as np
import pytest

from refimpl.bundle import read_bundle
from refimpl.diff.compare import compare
from refimpl.diff.dump import read_dump
from refimpl.diff.hooks import readings, rename
from refimpl.diff.policy import make_policy
from refimpl.golden import write_golden

PROMPT = [97, 11, 1879, 13, 42]


def _hooked(name: str, a: np.ndarray) -> dict:
    """{hook name: array} of one golden tap as module hooks on transformers' modules produce it."""
    p, _, what = name.rpartition(".")
    if what in ("q_rope", "k_rope"):   # apply_rotary_pos_emb's outputs, heads first
        return {f"{p}.apply_rotary_pos_emb" + (".1" if what == "k_rope" else ""): a.swapaxes(1, 2)}
    if name.endswith("linear_attn.core"):   # the gated norm's first input, flattened rows [B*T*H, D]
        return {f"{p}.norm.input.0": a.reshape(-1, a.shape[-1])}
    if name.endswith("linear_attn.z"):
        return {f"{p}.norm.input.1": a.reshape(-1, a.shape[-1])}
    if name.endswith("linear_attn.norm"):
        return {name: a.reshape(-1, a.shape[-1])}
    if name.endswith("linear_attn.conv1d_silu"):   # causal_conv1d_fn's output (after its silu), channels first
        return {f"{p}.causal_conv1d_fn": a.swapaxes(1, 2)}
    if name.endswith("linear_attn.conv1d"):   # the module transformers calls no more (see the fixture)
        return {}
    if name.endswith("attn_residual"):
        return {f"{p}.post_attention_layernorm.input": a}
    if what in ("router_logits", "routing_weights", "selected_experts"):   # the router module `mlp.gate`'s tuple, rows
        return {f"{p}.gate" + {"router_logits": "", "routing_weights": ".1", "selected_experts": ".2"}[what]:
                a.reshape(-1, a.shape[-1])}
    if name.endswith("mlp.shared_expert_gate"):   # the module's output, rows: the logit (the tap is the logit too)
        return {name: a.reshape(-1, 1)}
    if what in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        return {}   # written fused below
    return {name: a}


def _fused(taps: dict) -> dict:
    """vLLM-style fused projections: qkv_proj = [q | k | v], gate_up_proj = [gate | up] on the last axis."""
    out = {}
    for name in taps:
        if name.endswith("self_attn.q_proj"):
            p = name[:-len(".q_proj")]
            out[f"{p}.qkv_proj"] = np.concatenate([taps[f"{p}.{n}"] for n in ("q_proj", "k_proj", "v_proj")], -1)
        if name.endswith("gate_proj"):
            p = name[:-len(".gate_proj")]
            out[f"{p}.gate_up_proj"] = np.concatenate([taps[f"{p}.gate_proj"], taps[f"{p}.up_proj"]], -1)
    return out


@pytest.fixture(scope="module")
def hooked(tmp_path_factory):
    """A Qwen3.5-MoE golden (hf convention, one decode step) and its taps dumped as module hooks see them."""
    root = tmp_path_factory.mktemp("hooks")
    model, arrays = F.model_and_arrays("tiny-qwen3.5-moe", vocab_size=2048, eos_token_id=2000)
    bundle = read_bundle(write_golden(root / "golden", model, PROMPT, source="x", convention="hf", decode_steps=1,
                                      taps="."))
    for k in range(bundle.steps):
        s = bundle.manifest["steps"][k]
        taps = {n: bundle.tensor(k, "tap", n) for n in s["taps"]}
        hooks = {**{h: a for n, t in taps.items() for h, a in _hooked(n, t).items()}, **_fused(taps)}
        if k == 0:  # layer 0's conv as the nn.Conv1d(padding=K-1) module gives it: raw, padded, channels first
            x = taps["model.layers.0.linear_attn.mixed_qkv"][0].T.astype(np.float64)          # [C, T]
            w = arrays["model.layers.0.linear_attn.conv1d.weight"].reshape(x.shape[0], -1)     # [C, K]
            raw = np.stack([np.convolve(xc, wc[::-1]) for xc, wc in zip(x, w)])             # [C, T + K - 1]
            hooks["model.layers.0.linear_attn.conv1d"] = raw[None].astype(np.float32)
        files = {"taps": hooks,
                 **{role: {n: bundle.tensor(k, role[:-1], n) for n in s[role]} for role in ("inputs", "outputs")}}
        for role, arrays in files.items():
            d = root / "dump" / "steps" / str(k) / role
            d.mkdir(parents=True)
            for n, a in arrays.items():
                np.save(d / f"{n}.npy", a)
    return bundle, root / "dump"


def test_hooked_dump_reads_into_every_tap(hooked):
    bundle, path = hooked
    dump = read_dump(path, bundle)
    report = compare(bundle, dump, make_policy({"layouts": {".": "hf-hooks"}}))
    assert report.exit_code == 0, [(r.key, r.failures, r.problem) for r in report.failed][:3]
    assert report.unknown == []
    # every tap the hooks give is scored, through its reading: q / k (normalised inside transformers' kernel) and
    # the mixed conv input are the only taps of a hybrid the hooks above leave out
    scored = {r.name.rsplit(".", 1)[-1] for r in report.results if r.role == "tap"}
    assert {"q_rope", "k_rope", "core", "z", "norm", "conv1d_silu", "attn_residual", "routing_weights",
            "selected_experts", "shared_expert_gate", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
            "act_fn"} <= scored
    layouts = {r.name.rsplit(".", 1)[-1]: r.layout for r in report.results if r.step == 0 and r.role == "tap"}
    assert layouts["q_rope"] == "hf-hooks:heads_first" and layouts["core"] == "hf-hooks:reshape"
    assert layouts["conv1d_silu"] == "hf-hooks:channels_first"
    padded = next(r for r in report.results if r.key == "0/tap/model.layers.0.linear_attn.conv1d")
    assert padded.layout == "hf-hooks:padded_conv" and padded.metrics["sqnr_db"] > 120


def test_hook_layouts_need_no_declaration(hooked):
    """The readings are by shape (and by hook name): the undeclared dump reads the same."""
    bundle, path = hooked
    report = compare(bundle, read_dump(path, bundle))
    assert report.exit_code == 0, [(r.key, r.failures, r.problem) for r in report.failed][:3]


def test_rename_table():
    assert rename("model.layers.3.self_attn.1") == ([["model.layers.3.self_attn.attn_probs"]], None)
    assert rename("model.layers.0.self_attn.o_proj.input") == (
        [["model.layers.0.self_attn.gated_output"], ["model.layers.0.self_attn.attn_output"]], None)
    assert rename("model.layers.2.linear_attn.torch_chunk_gated_delta_rule.g") == (
        [["model.layers.2.linear_attn.g"]], None)
    assert rename("model.layers.1.mlp.shared_expert.gate_up_proj") == (
        [["model.layers.1.mlp.shared_expert.gate_proj", "model.layers.1.mlp.shared_expert.up_proj"]], "split")
    assert rename("model.layers.1.self_attn.q_proj") == ([], None)   # a tap name already: matched as is
    assert rename("lm_head.input") == ([], None)


def test_rename_table_reads_ai_hubs_function_hooks():
    """AI Hub's Qwen3.5 graph code (qai-hub-models templates/qwen3_5) hooked at its functions gated_delta_rule and
    _conv_with_state (tests/e2e/htp_aihub.py dumps them): the same taps as transformers' function hooks."""
    layer = "model.layers.2.linear_attn."
    assert rename(layer + "gated_delta_rule.g") == ([[layer + "g"]], None)
    assert rename(layer + "gated_delta_rule.beta") == ([[layer + "beta"]], None)
    assert rename(layer + "gated_delta_rule.value") == ([[layer + "v"]], None)
    assert rename(layer + "gated_delta_rule") == ([[layer + "core"]], None)
    assert rename(layer + "gated_delta_rule.1") == ([[layer + "recurrent_state"]], None)
    assert rename(layer + "gated_delta_rule.query") == ([], None)    # repeated to the value heads: not a tap
    assert rename(layer + "_conv_with_state") == ([[layer + "conv1d_silu"]], "channels_first")
    assert rename(layer + "_conv_with_state.mixed_qkv") == ([[layer + "mixed_qkv"]], "channels_first")
    assert rename(layer + "_conv_with_state.1") == ([[layer + "conv_state"]], None)


def test_heads_first_reads_a_flattened_tap_from_its_heads():
    """A tap [B, T, H*D] (attn_output) dumped as the attention's [B, H, T, D] (a device graph's tensor before its
    Transpose / Reshape) is read back in the tap's layout; with T == H the shape is ambiguous and only a hook
    name that says heads_first reads it so."""
    x = np.arange(2 * 5 * 4 * 3, dtype=np.float32).reshape(2, 5, 4, 3)          # [B, T, H, D]
    got = dict(readings(x.swapaxes(1, 2), "model.layers.0.self_attn.attn_output", (2, 5, 12), None))
    np.testing.assert_array_equal(got["hf-hooks:heads_first"], x.reshape(2, 5, 12))
    square = np.zeros((1, 4, 4, 3), np.float32)
    assert "hf-hooks:heads_first" not in dict(readings(square, "attn_output", (1, 4, 12), None))
    assert "hf-hooks:heads_first" in dict(readings(square, "attn_output", (1, 4, 12), None, "heads_first"))


def test_a_static_graphs_padded_conv_over_its_state_and_qk_repeated_to_the_value_heads_are_read():
    """A device graph's conv1d over [state (S = K columns) | x] with K - 1 zeros each side ([B, C, S + T + K - 1]:
    the prompt call of a static Qwen3.5 graph) is read at its T real columns, the K - 1 before the last; the delta
    rule's q / k repeated to the value heads ([B, T, Hv, Dk], repeat_interleave) as each key head once, only where
    every repeat holds the same values."""
    B, C, T, K = 1, 6, 5, 4
    a = np.arange(B * C * (K + T + K - 1), dtype=np.float32).reshape(B, C, K + T + K - 1)
    got = dict(readings(a, "model.layers.0.linear_attn.conv1d", (B, T, C), K))
    assert np.array_equal(got["hf-hooks:padded_conv"], a[..., K:K + T].swapaxes(1, 2))
    assert np.array_equal(got["hf-hooks:channels_first"], a[..., -T:].swapaxes(1, 2))     # state in front: next
    short = a[..., :T + K - 1]                                                             # no state: padded only
    only = [r for r, _ in readings(short, "model.layers.0.linear_attn.conv1d", (B, T, C), K)]
    assert only == ["hf-hooks:padded_conv"]
    k = np.random.default_rng(0).normal(size=(1, T, 2, 16)).astype(np.float32)
    rep = np.repeat(k, 2, axis=2)                                                          # [1, T, 4, 16]
    assert np.array_equal(dict(readings(rep, "model.layers.0.linear_attn.k", k.shape, K))["hf-hooks:repeated_heads"], k)
    rep[0, 0, 1, 0] += 1                                                                   # one repeat differs
    assert "hf-hooks:repeated_heads" not in dict(readings(rep, "model.layers.0.linear_attn.k", k.shape, K))
