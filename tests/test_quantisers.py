"""AIMET activation encodings in refimpl (refimpl/encodings.py, refimpl/models/quantisers.py): reading both schemas,
placing each quantiser at its module's input or output, QuantSim's arithmetic, and the float32 path untouched.
tests/test_aimet.py checks all of it against AIMET's QuantSim itself."""

import json

import ml_dtypes
import numpy as np
import pytest

import refimpl
from refimpl.encodings import read_activation_encodings
from refimpl.errors import FormatError, InputError
from refimpl.graph import module_taps
from refimpl.kernels import quant
from refimpl.kernels.linear import linear
from refimpl.models.model import Model, graph
from refimpl.models.quantisers import EncodingsWarning
from refimpl.precision import Policy

IDS = np.array([[5, 6, 7, 8, 9]])
ENC16 = {"bitwidth": 16, "dtype": "int", "is_symmetric": "False", "scale": 1e-4, "offset": -32768}


def _file(tmp_path, activations, params=None, name="model.encodings"):
    path = tmp_path / name
    path.write_text(json.dumps({"activation_encodings": activations, "param_encodings": params or {}}))
    return str(path)


def _load(preset, path, **kw):
    return refimpl.load(preset, precision=Policy(weights="encodings", encodings=path, **kw))


def test_quantsim_multiplies_by_the_float32_reciprocal_per_tensor_and_divides_per_block():
    """QuantSim's CPU path: torch.fake_quantize computes x * fl(1/s) (per tensor / channel), its block path x / s.
    -2.0356498 / 0.0123 is -165.49998 (-> -165) but -2.0356498 * fl(1 / 0.0123) is -165.5 (-> -166, half to even)."""
    x, s = np.array([-2.0356498], np.float32), np.float32(0.0123)
    assert quant.quantsim_quantize(x, s, -32768, 0, 65535)[0] == -166 + 32768
    assert quant.quantsim_quantize(x[None], s.reshape(1, 1), [[-32768]], 0, 65535, axis=1, block_size=1)[0, 0] == \
        -165 + 32768
    assert quant.qnn_quantize(x, s, -32768, 16)[0] == -165 + 32768                   # ONNX / QNN convention: x / s
    np.testing.assert_array_equal(quant.quantsim_fake_quant(np.array([1.2, -5.0, 100.0], np.float32), 0.5, -3, 0, 15),
                                  [1.0, -1.5, 6.0])                                 # clipped at both ends


def test_float_encodings_saturate_and_round():
    x = np.array([1e6, -1e6, 1.0001, 3e38], np.float32)
    np.testing.assert_array_equal(quant.float_fake_cast(x, np.float16), [65504, -65504, 1.0, 65504])
    assert quant.float_fake_cast(np.array([3.4e38], np.float32), ml_dtypes.bfloat16)[0] == \
        np.float32(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


def test_both_schemas_read(tmp_path):
    legacy = _file(tmp_path, {"model.layers.0.mlp.act_fn": {"output": {"0": ENC16}, "input": {"0": [ENC16, ENC16]}},
                              "lm_head": {"output": {"0": {"bitwidth": 16, "dtype": "float"}}}})
    entries = {e.label: e.encoding for e in read_activation_encodings(legacy)}
    assert set(entries) == {"model.layers.0.mlp.act_fn output 0", "model.layers.0.mlp.act_fn input 0",
                            "lm_head output 0"}
    assert entries["model.layers.0.mlp.act_fn input 0"].scale.shape == (2,)          # per channel
    assert entries["lm_head output 0"].float_dtype is np.float16
    v1 = tmp_path / "v1.json"
    v1.write_text(json.dumps({"version": "1.0.0", "activation_encodings": [
        {"name": "x", "dtype": "INT", "enc_type": "PER_TENSOR", "bw": 8, "is_sym": True, "scale": [0.5], "offset": [0]},
        {"name": "y", "dtype": "FLOAT", "bw": 16, "enc_type": "PER_TENSOR"}]}))
    x, y = read_activation_encodings(v1)
    assert (x.io, x.encoding.signed, x.encoding.qrange, y.encoding.float_dtype) == (None, True, (-128, 127), np.float16)


@pytest.mark.parametrize("bad, message", [
    ({"m": {"output": {"0": {**ENC16, "offset": 5}}}}, "offset 5 > 0"),
    ({"m": {"output": {"0": {**ENC16, "zero_point_shift": 0.5}}}}, "zero_point_shift"),
    ({"m": {"middle": {"0": ENC16}}}, "neither 'input' nor 'output'"),
    ({"m": {"output": {"0": {"dtype": "int"}}}}, "'m' output 0: bitwidth: expected an integer, got None"),
])
def test_bad_activation_encodings(tmp_path, bad, message):
    with pytest.raises(FormatError, match=message):
        read_activation_encodings(_file(tmp_path, bad))


def test_output_quantiser_at_its_tap_input_quantiser_for_its_module_only(tmp_path):
    """q_proj's output quantiser is the q_proj tap; k_proj's input quantiser acts on input_layernorm's output as
    k_proj reads it — v_proj reads it unquantised."""
    a = "model.layers.0.self_attn"
    coarse = {**ENC16, "bitwidth": 8, "scale": 0.05, "offset": -128}
    path = _file(tmp_path, {f"{a}.q_proj": {"output": {"0": ENC16}}, f"{a}.k_proj": {"input": {"0": coarse}}})
    m = _load("tiny-qwen3", path)
    with refimpl.trace() as tr:
        m.forward(IDS)
    plain = refimpl.load("tiny-qwen3")
    w, x = plain.weights, tr["model.layers.0.input_layernorm"]
    np.testing.assert_array_equal(tr[f"{a}.q_proj"], quant.quantsim_fake_quant(
        linear(x, w[f"{a}.q_proj.weight"]), 1e-4, -32768, 0, 65535))
    np.testing.assert_array_equal(tr[f"{a}.k_proj"], linear(quant.quantsim_fake_quant(x, 0.05, -128, 0, 255),
                                                            w[f"{a}.k_proj.weight"]))
    np.testing.assert_array_equal(tr[f"{a}.v_proj"], linear(x, w[f"{a}.v_proj.weight"]))
    desc = m.quantisers.describe(m.modules)
    assert [(q["module"], q["io"], q["tap"]) for q in desc["quantisers"]] == [
        (f"{a}.q_proj", "output", f"{a}.q_proj"), (f"{a}.k_proj", "input", "model.layers.0.input_layernorm")]


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3-next", "tiny-qwen3.5",
                                    "tiny-qwen3.5-moe"])
def test_the_module_tables_are_what_the_code_quantises(preset, tmp_path):
    """Every declared module's inputs and output carry a quantiser when the file names them all (nothing unplaced),
    the code asks for exactly the declared ones, each input tap exists, and each output tap holds codes on its grid."""
    m = refimpl.load(preset)
    acts = {mod: {"output": {"0": ENC16}, **({"input": {str(i): ENC16 for i in range(len(taps))}} if taps else {})}
            for mod, taps in m.modules.items()}
    q = _load(preset, _file(tmp_path, acts))
    asked = set()
    inner = q.quantisers

    class Asking:
        def input(self, module, x, i=0):
            asked.add((module, "input", i))
            return inner.input(module, x, i)

        def output(self, module, y):
            asked.add((module, "output", 0))
            return inner.output(module, y)

        def at(self, node):
            return inner.at(node)

        def within(self, prefix):
            return inner.within(prefix)
    q.quantisers = Asking()
    cache = q.new_cache()
    with refimpl.trace() as tr:
        q.forward(IDS, cache=cache)
        q.forward(np.array([[3]]), cache=cache)
    declared = {(mod, "output", 0) for mod in q.modules} | {(mod, "input", i) for mod, t in q.modules.items()
                                                             for i in range(len(t))}
    # every node's output can carry a device graph's quantiser: the modules' are among them
    assert {a for a in asked if a[1] == "input"} == {d for d in declared if d[1] == "input"} and not inner.unplaced
    assert declared <= asked and {a[0] for a in asked} <= set(graph(q.config)) | set(q.modules)
    assert {t for taps in q.modules.values() for t in taps} <= set(tr.names())
    taps = module_taps(graph(q.config))
    assert list(taps) == list(q.modules)   # each module's output is a tap (the router's: router_logits)
    for mod, tap in taps.items():
        codes = tr[tap].astype(np.float64) / 1e-4
        assert np.abs(codes - np.rint(codes)).max() < 1e-2, mod


def test_float_activation_encoding_casts_to_float16(tmp_path):
    m = _load("tiny-qwen3", _file(tmp_path, {"model.norm": {"output": {"0": {"bitwidth": 16, "dtype": "float"}}}}))
    with refimpl.trace() as tr:
        m.forward(IDS)
    x = tr["model.norm"]
    assert np.array_equal(x, x.astype(np.float16).astype(np.float32))
    assert not np.array_equal(refimpl.load("tiny-qwen3").forward(IDS), m.forward(IDS))


def test_no_activation_encodings_leave_the_float32_path_bit_identical(tmp_path):
    """A weights-only file: the forward is the plain float32 forward over the quantised weights, bit for bit."""
    params = {"model.layers.0.mlp.down_proj.weight": [{**ENC16, "bitwidth": 8, "scale": 0.01, "offset": -128,
                                                       "is_symmetric": "True"}] * 64}
    weights_only = _load("tiny-qwen3", _file(tmp_path, {}, params))
    assert not weights_only.quantisers
    w = weights_only.weights
    plain = Model.from_arrays(weights_only.config, {n: w[n] for n in w.stored}, "tiny-qwen3", Policy())
    assert not np.array_equal(w["model.layers.0.mlp.down_proj.weight"],
                              refimpl.load("tiny-qwen3").weights["model.layers.0.mlp.down_proj.weight"])
    np.testing.assert_array_equal(weights_only.forward(IDS), plain.forward(IDS))


def test_bf16_activations_round_after_the_quantiser(tmp_path):
    m = refimpl.load("tiny-qwen3", precision=Policy("bf16", "encodings", encodings=_file(
        tmp_path, {"model.layers.0.self_attn.q_proj": {"output": {"0": ENC16}}})))
    with refimpl.trace() as tr:
        m.forward(IDS)
    q = tr["model.layers.0.self_attn.q_proj"]
    assert np.array_equal(q, q.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_aimet_1_0_0_names_place_like_module_names(tmp_path):
    """A 1.0.0 file names tensors: a module path, or AIMET's ONNX name of a module's output; both are that
    module's output quantiser. A tensor made inside a module or by a functional op cannot be placed."""
    enc = {"dtype": "INT", "enc_type": "PER_TENSOR", "bw": 16, "is_sym": False, "scale": [1e-4], "offset": [-32768]}
    v1 = tmp_path / "v1.encodings"
    v1.write_text(json.dumps({"version": "1.0.0", "param_encodings": [], "activation_encodings": [
        {**enc, "name": "model.layers.0.self_attn.q_proj"},
        {**enc, "name": "/model/layers.1/mlp/down_proj/MatMul_output_0"},
        {**enc, "name": "/model/layers.1/mlp/Mul_output_0"}]}))
    legacy = tmp_path / "legacy.json"
    one = {"bitwidth": 16, "dtype": "int", "is_symmetric": "False", "scale": 1e-4, "offset": -32768}
    legacy.write_text(json.dumps({"param_encodings": {}, "activation_encodings": {
        "model.layers.0.self_attn.q_proj": {"output": {"0": one}},
        "model.layers.1.mlp.down_proj": {"output": {"0": one}}}}))
    ids = np.array([[5, 6, 7, 8]])
    with pytest.warns(EncodingsWarning, match="Mul_output_0"):
        a = refimpl.load("tiny-qwen3", precision=Policy(weights="encodings", encodings=str(v1)))
    b = refimpl.load("tiny-qwen3", precision=Policy(weights="encodings", encodings=str(legacy)))
    assert a.quantisers.unplaced == ["/model/layers.1/mlp/Mul_output_0"]
    assert set(a.quantisers.outputs) == set(b.quantisers.outputs) == {"model.layers.0.self_attn.q_proj",
                                                                       "model.layers.1.mlp.down_proj"}
    np.testing.assert_array_equal(a.forward(ids), b.forward(ids))
    with pytest.raises(InputError, match="Mul_output_0"):
        refimpl.load("tiny-qwen3", precision=Policy(weights="encodings", encodings=str(v1), strict_encodings=True))
