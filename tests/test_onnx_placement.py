"""A quantised device graph's quantisers placed on refimpl's graph by structure (refimpl/models/onnx_placement.py),
and refimpl computing through exactly the declared points.

Fixtures (tests/quantised/make_structure_fixtures.py): tiny presets (vocab 256) exported as a Genie graph by
torch.onnx.export and quantised W8A16 by onnxruntime's QNN QDQ config: tests/fixtures/quantised/tiny-qwen3-qdq.onnx
whole, *-qdq-structure.onnx with the weights zero-filled (placement reads the graph and the scales)."""

import sys
from pathlib import Path

import numpy as np
import pytest

import refimpl
from refimpl.encodings import Encoding
from refimpl.errors import InputError
from refimpl.formats.qdq import read_qdq
from refimpl.graph import points
from refimpl.models import qwen3
from refimpl.models.config import config_from_dict
from refimpl.models.model import expected_tensors, graph
from refimpl.models.onnx_placement import place_onnx
from refimpl.models.quantisers import Quantisers
from refimpl.presets import PRESETS

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE / "quantised"), str(HERE / "e2e")]

FIXTURES = HERE / "fixtures" / "quantised"
MODELS = ["tiny-qwen3", "tiny-qwen3-moe"]


def config(preset):
    return config_from_dict({**PRESETS[preset], "vocab_size": 256})


def fixture(preset):
    return FIXTURES / (f"{preset}-qdq.onnx" if preset == "tiny-qwen3" else f"{preset}-qdq-structure.onnx")


def fixture_checkpoint():
    """(config, arrays) of the checkpoint tiny-qwen3-qdq.onnx was made from: devices.small_preset(vocab=256)'s
    weights (its stored integer weights are these, quantised)."""
    from refimpl.presets import random_weights
    cfg = config_from_dict({**PRESETS["tiny-qwen3"], "vocab_size": 256, "eos_token_id": 208, "bos_token_id": 207})
    arrays = random_weights(cfg, seed=11)
    arrays["model.embed_tokens.weight"] = arrays["model.embed_tokens.weight"] * np.float32(0.05)
    return cfg, arrays


def placed(preset, strict=False):
    g, encs = read_qdq(fixture(preset))
    cfg = config(preset)
    return g, encs, place_onnx(g, encs, graph(cfg), set(expected_tensors(cfg)) | {"lm_head.weight"}, strict)


@pytest.mark.parametrize("preset", MODELS)
def test_every_quantiser_of_a_w8a16_qdq_model_is_placed_at_a_point_of_its_op(preset):
    g, encs, p = placed(preset)
    assert (p.placed, p.total, p.unplaced) == (len(encs), len(encs), [])
    declared, producers = points(graph(config(preset))), g.producers()
    acting = [(t, w) for t, ws in p.tensors.items() for w in ws if t in producers and w in declared]
    assert len(acting) > 0.5 * len(encs)
    for tensor, where in acting:   # a point's own quantiser sits on an output of an op it declares, or data movement
        op = producers[tensor].op_type
        assert op in declared[where][1].onnx or op in ("Transpose", "Reshape", "Unsqueeze", "Slice", "Squeeze",
                                                       "Expand", "Gather", "Concat", "Split"), (tensor, op, where)
    weights = set(p.weights)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.input_layernorm.weight"} <= weights
    norm = "model.layers.0.input_layernorm"
    for sub in ("x^2", "mean", "+eps", "sqrt", "1/sqrt", "x*1/sqrt", "eps", "2"):
        assert f"{norm}/{sub}" in p.activations
    for sub in ("cos", "sin", "x*cos", "-x2", "rotate_half", "rotate_half*sin"):
        assert f"model.layers.0.self_attn.q_rope/{sub}" in p.activations
    for sub in ("mask", "scale", "q*k^T", "scaled", "keys", "past_keys"):
        assert f"model.layers.0.self_attn.attn_scores/{sub}" in p.activations


def test_qwen35_everything_outside_the_chunked_delta_rule_is_placed():
    """Qwen3.5's float Genie graph with an encoding on every float tensor (a superset of any quantisation config's):
    the Gated DeltaNet and gated attention outside the delta rule are placed; the chunked delta rule's insides (refimpl
    declares no points there) and the host's mask arithmetic are listed with those reasons, nothing else."""
    from refimpl.formats.onnx_graph import read_onnx
    g = read_onnx(FIXTURES / "tiny-qwen3.5-structure.onnx")
    cfg = config("tiny-qwen3.5")
    enc = Encoding(16, np.float32(1e-3), np.int32(-30000))
    skip = {"Shape", "Greater", "Less", "Equal", "Not", "And", "Cast", "Range", "ConstantOfShape", "NonZero",
            "Constant", "EyeLike"}
    encs = {o: enc for n in g.nodes if n.op_type not in skip for o in n.outputs if o}
    encs.update({i: enc for i in g.inputs if i != "input_ids"})
    p = place_onnx(g, encs, graph(cfg), set(expected_tensors(cfg)) | {"lm_head.weight"})
    inside = [t for t, r in p.unplaced if r.startswith("inside model.layers.") and ".linear_attn.core (" in r]
    other = [(t, r) for t, r in p.unplaced if t not in inside]
    assert len(inside) > 2000 and p.placed > 350
    assert len(other) <= 10 and all("graph input" in r or "host's plumbing" in r or "a constant" in r
                                    for _, r in other), other
    for sub in ("in_proj_qkv/masked", "conv1d/x", "conv1d", "conv1d_silu/sigmoid", "conv1d_silu/split_q", "q/x^2",
                "k/1/sqrt", "beta", "g/+dt_bias", "g/softplus", "g", "core", "norm/x^2", "norm/silu(z)", "norm",
                "out_proj"):
        assert f"model.layers.0.linear_attn.{sub}" in p.activations, sub
    for sub in ("q_rope/rot", "q_rope/sum", "q_rope", "gated_output/sigmoid", "gated_output", "attn_probs"):
        assert f"model.layers.3.self_attn.{sub}" in p.activations, sub


def test_qwen35_htp_qdq_model_places_the_recurrent_delta_rule_token_by_token():
    """Qwen3.5 rewritten for the HTP (the gated delta rule in transformers' recurrent form, one unrolled step per
    token) and quantised W8A16 by the QNN QDQ config (tiny-qwen3.5-htp-qdq-structure.onnx): every quantiser placed
    but the host's mask plumbing and constants no computed value reads (925 of 932); each step's quantisers at that
    token's instance of the rule's points (an Exp's token is its Gather's index, read from the graph)."""
    g, encs = read_qdq(FIXTURES / "tiny-qwen3.5-htp-qdq-structure.onnx")
    cfg = config("tiny-qwen3.5")
    p = place_onnx(g, encs, graph(cfg), set(expected_tensors(cfg)) | {"lm_head.weight"})
    assert p.placed >= 0.99 * p.total and p.total == len(encs), p.summary()
    assert all("read by no matched point" in r for _, r in p.unplaced), p.unplaced
    core = "model.layers.0.linear_attn.core"
    for sub in ("state", "sqrt(Dk)", "q/sqrt(Dk)", "exp(g)@0", "decayed@0", "S*k@3", "S^T k@3", "v-S^T k@3",
                "delta@3", "k delta^T@3", "S@7", "S*q@7", "o@7"):
        assert f"{core}/{sub}" in p.activations, sub
    assert core in p.activations and "model.layers.2.linear_attn.core/o@7" in p.activations
    assert "model.layers.0.linear_attn.g/+dt_bias" in p.activations   # in_proj_a + dt_bias fused into a Gemm
    assert p.forms["model.layers.0.linear_attn.g/+dt_bias"] == "Gemm"
    producers = g.producers()
    exps = [(t, w) for t, ws in p.tensors.items() for w in ws if "/exp(g)@" in w]
    assert len(exps) == 3 * 8
    for tensor, where in exps:
        gather = producers[producers[tensor].inputs[0]]
        assert gather.op_type == "Gather" and where.endswith(f"@{g.scalars[gather.inputs[1]]}"), (tensor, where)


def test_a_point_not_declared_is_unplaced_with_its_reason_and_strict_refuses(monkeypatch):
    original = qwen3.norm_points
    monkeypatch.setattr(qwen3, "norm_points", lambda cfg, x, w: tuple(pt for pt in original(cfg, x, w)
                                                                      if pt.name != "sqrt"))
    g, encs, p = placed("tiny-qwen3")
    assert p.unplaced and p.placed < len(encs)
    assert any("Sqrt" in reason and "matches no declared point" in reason for _, reason in p.unplaced)
    with pytest.raises(InputError, match="quantisers placed.*--strict-encodings"):
        placed("tiny-qwen3", strict=True)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_the_code_computes_through_exactly_the_declared_points(preset):
    """A quantiser (float16) at every declared point and node output: the forward passes a value through each,
    a prompt and a cached step (the past keys / values points act from the second call); a per-token point (the
    recurrent delta rule's) at each of the prompt's 4 tokens, "point@t"."""
    m = refimpl.load(preset)
    nodes = graph(m.config)
    f16 = Encoding(16, np.float32(1), np.int32(0), float_dtype=np.float16)
    outputs, pts, want = {}, {}, set()
    for name, (node, pt) in points(nodes).items():
        names = [f"{pt.name}@{t}" for t in range(4)] if pt.per_token else [pt.name]
        want.update(f"{node}/{n}" if n else name for n in names)
        for n in names:
            if n:
                pts.setdefault(node, {})[n] = f16
            else:
                outputs[nodes[node].module_name or node] = f16
    m.quantisers = Quantisers(outputs=outputs, points=pts, taps={nodes[n].module_name: n for n in nodes
                                                                  if nodes[n].module_name})
    m.quantisers.record = {}
    cache = m.new_cache()
    m.forward(np.array([[1, 2, 3, 4]]), cache=cache)
    m.forward(np.array([[5]]), cache=cache)
    assert set(m.quantisers.record) == want


def test_float_path_hooks_are_the_identity():
    """No quantiser: every kernel's hook is the shared identity (the float path computes as before; golden anchors,
    tests/test_golden.py, are bit-identical)."""
    from refimpl.kernels.activation import unhooked
    m = refimpl.load("tiny-qwen3")
    assert m.quantisers.at("model.layers.0.input_layernorm") is unhooked
    assert m.quantisers.within("model.layers.0.mlp") is unhooked


def test_a_golden_with_a_device_graph_records_every_quantiser_in_its_manifest(tmp_path):
    from refimpl.bundle import read_bundle
    from refimpl.golden import write_golden
    from refimpl.models.model import Model
    from refimpl.precision import Policy
    f = fixture("tiny-qwen3")
    cfg, arrays = fixture_checkpoint()
    m = Model.from_arrays(cfg, arrays, "preset", Policy(weights="encodings", encodings=str(f)), device=read_qdq(f))
    out = write_golden(tmp_path / "q", m, np.array([[1, 2, 3, 4]]), source="preset", codes=True)
    q = read_bundle(out).manifest["quantisation"]
    assert (q["placed"], q["total"], q["unplaced"]) == (408, 408, [])
    weights = [r for r in q["quantisers"] if r["io"] == "weight"]
    assert q["stored_weights"] == len(weights) == 47   # every weight read from the graph's own integer codes
    assert {r.get("codes") for r in weights} == {"stored"}
    assert q["encodings"]["file"] == f.name
    rows = {r["at"]: r for r in q["quantisers"]}
    assert rows["model.layers.0.input_layernorm/x^2"]["io"] == "point"
    assert rows["model.layers.0.self_attn.attn_probs"]["io"] == "output"
    assert rows["model.layers.0.self_attn.q_proj.weight"]["io"] == "weight"
    assert len({t for r in q["quantisers"] for t in r["onnx"]}) + len(q["shared"]) == 408


@pytest.mark.oracle
def test_refimpl_with_a_qdq_models_quantisers_computes_what_onnxruntime_computes():
    """refimpl with the fixture's quantisers placed vs onnxruntime running that QDQ model (CPU EP, graph
    optimizations off: its QDQ fusions compute in integer kernels, another arithmetic), on the fixture's own
    calibration input: max |refimpl - ORT| <= 1 % of max |float - ORT| on logits."""
    import onnxruntime as ort

    from refimpl.models.model import Model
    from refimpl.precision import Policy, policy
    from refimpl.presets import random_weights
    f = fixture("tiny-qwen3")
    config_ = {**PRESETS["tiny-qwen3"], "vocab_size": 256, "eos_token_id": 256 - 48, "bos_token_id": 256 - 49}
    cfg = config_from_dict(config_)
    arrays = random_weights(cfg, seed=11)                     # tests/e2e/devices.small_preset's weights
    arrays["model.embed_tokens.weight"] = arrays["model.embed_tokens.weight"] * np.float32(0.05)
    inputs = dict(np.load(FIXTURES / "tiny-qwen3-qdq-inputs.npz"))   # the export's example and calibration input
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.graph_optimization_level = 1, ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(str(f), options, providers=["CPUExecutionProvider"])
    device = s.run(["logits"], {i.name: inputs[i.name] for i in s.get_inputs()})[0]
    ids = inputs["input_ids"].astype(np.int64)
    m = Model.from_arrays(cfg, arrays, "e2e", Policy(weights="encodings", encodings=str(f)), device=read_qdq(f))
    assert m.quantisers.placement.unplaced == []
    ours, floating = m.forward(ids), Model.from_arrays(cfg, arrays, "e2e", policy("float32")).forward(ids)
    assert np.abs(ours - device).max() <= 0.01 * np.abs(floating - device).max()


def test_cli_golden_with_a_qdq_model_and_its_errors(tmp_path, capsys, monkeypatch):
    """`refimpl golden --encodings model_qdq.onnx`: every quantiser placed and recorded; --onnx without --encodings
    and --strict-encodings with an unplaced quantiser are one-line errors, exit 2, nothing written."""
    import json

    from refimpl.cli import main
    from refimpl.formats.safetensors import write_safetensors
    from refimpl.presets import checkpoint_layout
    f = fixture("tiny-qwen3")
    cfg, arrays = fixture_checkpoint()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({**PRESETS["tiny-qwen3"], "vocab_size": 256, "eos_token_id": 208,
                                                  "bos_token_id": 207}))
    write_safetensors(ckpt / "model.safetensors", checkpoint_layout(cfg, arrays))
    args = ["golden", "--model", str(ckpt), "--input-ids", "1,2,3", "-q"]
    assert main([*args, "--out", str(tmp_path / "q"), "--encodings", str(f)]) == 0
    q = json.loads((tmp_path / "q" / "manifest.json").read_text())["quantisation"]
    assert (q["placed"], q["total"]) == (408, 408)
    assert main([*args, "--out", str(tmp_path / "a"), "--onnx", str(f)]) == 2
    assert "--onnx needs --encodings" in capsys.readouterr().err
    original = qwen3.rope_points
    monkeypatch.setattr(qwen3, "rope_points", lambda x, partial: original(x, partial)[1:])   # x*cos undeclared
    assert main([*args, "--out", str(tmp_path / "b"), "--encodings", str(f), "--strict-encodings"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "of 408 quantisers placed" in err and "--strict-encodings" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # another checkpoint (the preset's own weights) than the one whose quantised weights the QDQ model stores
    args[2] = "tiny-qwen3"
    assert main([*args, "--out", str(tmp_path / "c"), "--encodings", str(f)]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("refimpl: error:")]
    assert len(errors) == 1 and "the device graph stores" in errors[0], err
    assert not (tmp_path / "c").exists()


def test_stored_weights_lays_a_device_graphs_weight_encodings_out_as_the_checkpoint_stores_them():
    """A MatMul B [in, out] per-channel encoding (ONNX axis 1, W4A16) applies to refimpl's [out, in] rows; the
    export's fused experts.gate_up_proj [E, 2Ie, H] / down_proj encodings, for a checkpoint stored one tensor per
    expert (Qwen3-MoE), become each expert's gate (first Ie rows), up (the next) and down."""
    from refimpl.models.onnx_placement import stored_weights
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3)).astype(np.float32)              # refimpl's [out 4, in 3]
    scale = np.array([0.01, 0.02, 0.03, 0.04], np.float32)
    enc = Encoding(4, scale, np.zeros(4, np.int32), signed=True, axis=1, arithmetic="onnx")
    rows = stored_weights({"q.weight": (enc,)}, {"q.weight"})["q.weight"]
    got = rows[0].fake_quant(w)
    want = (np.clip(np.rint(w / scale[:, None]), -8, 7) * scale[:, None]).astype(np.float32)
    assert np.array_equal(got, want)
    E, Ie = 2, 3
    per_row = Encoding(8, np.arange(1, 2 * E * Ie + 1, dtype=np.float32), np.zeros(2 * E * Ie, np.int32), axis=None)
    stored = {n for e in range(E) for n in (f"m.experts.{e}.gate_proj.weight", f"m.experts.{e}.up_proj.weight",
                                            f"m.experts.{e}.down_proj.weight")}
    flat = Encoding(8, np.float32(0.5), np.int32(0))
    out = stored_weights({"m.experts.gate_up_proj": (per_row,), "m.experts.down_proj": (flat,)}, stored)
    assert set(out) == stored
    assert out["m.experts.1.gate_proj.weight"][0].scale.tolist() == [7, 8, 9]
    assert out["m.experts.1.up_proj.weight"][0].scale.tolist() == [10, 11, 12]
    assert out["m.experts.0.down_proj.weight"][0].scale == flat.scale


def test_a_qdq_models_stored_integer_weights_are_the_quantised_weights(tmp_path):
    """A QDQ model's weights stored as integers (DequantizeLinear of an integer initializer) are refimpl's quantised
    weights, dequantised with their scale / zero point, not the checkpoint's weight quantised again: a uint16 table
    rounded as aimet-onnx's to_onnx_qdq rounds (half to even after adding the zero point: one code off
    QuantizeLinear at a tie) read by a Gather as stored; a MatMul's B [in, out] transposed to [out, in]; a fused
    expert tensor's codes split per expert; codes of another checkpoint's weight a one-line error."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper, save

    from refimpl.models.onnx_placement import stored_weights
    s_t, z_t = np.float32(0.5), np.uint16(3)
    table = np.array([[0.25, 1.0, -0.5], [2.0, 0.75, -1.25]], np.float32)   # 0.25 / 0.5 = 0.5: a tie
    aimet = np.rint((table / s_t).astype(np.float64) + z_t).astype(np.uint16)  # rint(0.5 + 3) = 4
    onnx_q = (np.rint(table / s_t) + z_t).astype(np.uint16)                    # rint(0.5) + 3 = 3
    assert aimet[0, 0] == 4 and onnx_q[0, 0] == 3
    s_w = np.float32(0.1)
    w = np.array([[0.31, -0.2, 0.05], [0.4, 0.12, -0.33]], np.float32)        # refimpl's [out 2, in 3]
    w_q = np.rint(w.T / s_w).astype(np.int8)                                   # MatMul B: [in 3, out 2]
    inits = [numpy_helper.from_array(aimet, "t_q"), numpy_helper.from_array(s_t, "t_s"),
             numpy_helper.from_array(z_t, "t_z"), numpy_helper.from_array(w_q, "w_q"),
             numpy_helper.from_array(s_w, "w_s"), numpy_helper.from_array(np.int8(0), "w_z")]
    nodes = [helper.make_node("DequantizeLinear", ["t_q", "t_s", "t_z"], ["t"]),
             helper.make_node("Gather", ["t", "ids"], ["x"]),
             helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["wt"]),
             helper.make_node("MatMul", ["x", "wt"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])], inits)
    path = tmp_path / "qdq.onnx"
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    _, encs = read_qdq(path)
    assert (encs["t"].stored_transposed, encs["wt"].stored_transposed) == (False, True)
    got = encs["t"].on_rows().fake_quant(table)
    assert np.array_equal(got, (aimet.astype(np.float32) - 3) * s_t) and got[0, 0] == 0.5   # stored: not 0.0
    assert encs["t"].describe()["codes"] == "stored"
    assert np.array_equal(encs["wt"].on_rows().fake_quant(w), w_q.T.astype(np.float32) * s_w)
    with pytest.raises(InputError, match="another integer weight than this checkpoint's"):
        encs["wt"].on_rows().fake_quant(w + np.float32(0.5))
    with pytest.raises(InputError, match="stores 6 integer codes for a weight of 4 elements"):
        encs["wt"].on_rows().fake_quant(w[:, :2])
    E, Ie, H = 2, 2, 3                                                         # experts.gate_up_proj [E, 2Ie, H]
    codes = np.arange(E * 2 * Ie * H, dtype=np.int64).reshape(E, 2 * Ie, H) % 7
    fused = Encoding(8, np.float32(1), np.int32(0), signed=True, arithmetic="onnx", stored=lambda: codes)
    names = {f"m.experts.{e}.{p}_proj.weight" for e in range(E) for p in ("gate", "up", "down")}
    out = stored_weights({"m.experts.gate_up_proj": (fused,)}, names)
    assert np.array_equal(out["m.experts.1.up_proj.weight"][0].fake_quant(codes[1, Ie:].astype(np.float32)),
                          codes[1, Ie:])
    model = onnx.load(path)                       # codes in external data (not read): the checkpoint's re-quantised
    t = next(t for t in model.graph.initializer if t.name == "t_q")
    t.data_location = TensorProto.EXTERNAL
    t.external_data.add(key="location", value="t_q.bin")
    save(model, path)
    _, encs = read_qdq(path)
    assert encs["t"].stored is None and encs["wt"].stored is not None
    assert encs["t"].on_rows().fake_quant(table)[0, 0] == 0.0
