"""The quantisers of ONNX deployments read and emulated code for code (issue 27, items 1 and 3), against the
implementations that define them:

- ONNX Runtime's CPU EP running QuantizeLinear / DequantizeLinear (opset 21) on random and adversarial tensors
  (ties at k + 1/2, their float32 neighbours, saturation, infinities, NaN, subnormals, +-0), for every quantised type
  (int4 / uint4 / int8 / uint8 / int16 / uint16) per tensor, per axis and blocked, each model read back by
  refimpl.formats.qdq.read_qdq: refimpl's codes and dequantised values are ORT's, 100 %;
- real QDQ models of a tiny Qwen3 made by onnxruntime.quantization's QNN config (W8A16 uint8 weights, W4A16 int4
  per channel; tests/quantised_models.py), run by ORT with every quantiser's input and output exposed: 100 %;
- aimet-onnx 2.42's QuantSim of the same model (W8A16, W4A16 per channel, LPBQ, per block; default config, calibrated
  on four prompts; `sim.export`): refimpl.encodings.read_onnx_encodings on the exported file reads every entry,
  and its Encoding reproduces each live quantiser (libpymo's quantize_dequantize) on the real weights and on
  adversarial tensors, and the QuantSim session's own QcQuantizeOp outputs on the calibration activations.
"""

import json

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="onnx is refimpl's dependency for ONNX graphs")
ort = pytest.importorskip("onnxruntime", reason="ONNX Runtime is the [test] extra's device")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import quantised_models as Q  # noqa: E402
from refimpl.encodings import Encoding, read_onnx_encodings  # noqa: E402
from refimpl.errors import FormatError  # noqa: E402
from refimpl.formats.onnx_graph import read_onnx  # noqa: E402
from refimpl.formats.qdq import QTYPES, read_qdq  # noqa: E402

# one xdist worker runs the module: its module-scoped float_model (a torch export, ~3 s) is then made once, not once
# per worker (`make test` runs --dist loadgroup)
pytestmark = pytest.mark.xdist_group("onnx-quantisers")
TYPES = {v[0]: k for k, v in QTYPES.items()}


def adversarial(scale, lo: int, hi: int, zp, n: int, rng) -> np.ndarray:
    """float32 values quantising at a given scale / zero point to: exact ties k + 1/2 (x = fl32((k + 1/2 - zp) s))
    and their float32 neighbours, random values over the range and beyond it, the saturation values, infinities,
    NaN, subnormals and +-0. `scale` / `zp` broadcast against [n]."""
    k = rng.integers(lo - 2, hi + 2, n).astype(np.float64)
    ties = ((k + 0.5 - zp) * np.float64(1) * scale).astype(np.float32)
    span = (hi - lo) * scale
    x = np.stack([ties, np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(-np.inf)),
                  (rng.uniform(-1.2, 1.2, n) * span).astype(np.float32),
                  ((k - zp) * scale).astype(np.float32)])
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 1e-38, -3e-39, 3.4e38, -3.4e38],
                        np.float32)
    x = x.reshape(-1)
    x[rng.choice(x.size, 64, replace=False)] = np.resize(specials, 64)
    return x


def qdq_graph(dtype: str, scale, zp, shape, axis=None, block=None) -> onnx.ModelProto:
    """x -> QuantizeLinear -> DequantizeLinear -> y, and the codes cast to int32 as a second output (ORT returns
    no numpy array of int4)."""
    attrs = {k: v for k, v in (("axis", axis), ("block_size", block)) if v is not None}
    t = TYPES[dtype]
    inits = [numpy_helper.from_array(np.asarray(scale, np.float32), "x_scale"),
             helper.make_tensor("x_zero_point", t, np.shape(zp), np.ravel(zp).astype(int).tolist())]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero_point"], ["x_q"], name="q", **attrs),
             helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero_point"], ["y"], name="dq", **attrs),
             helper.make_node("Identity", ["y"], ["out"], name="consumer")]
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def with_codes(model: onnx.ModelProto) -> bytes:
    """The model with its QuantizeLinear's codes as an int32 output."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.node.append(helper.make_node("Cast", ["x_q"], ["codes"], to=TensorProto.INT32))
    m.graph.output.append(helper.make_tensor_value_info("codes", TensorProto.INT32, None))
    return m.SerializeToString()


def session(model_bytes: bytes):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL   # no QDQ folding
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


GRANULARITIES = ("tensor", "axis", "block")


@pytest.mark.parametrize("dtype", list(TYPES))
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_ort_quantize_linear_code_for_code(dtype, granularity, tmp_path):
    rng = np.random.default_rng(abs(hash((dtype, granularity))) % 2 ** 32)
    _, bits, signed = QTYPES[TYPES[dtype]]
    lo, hi = (-2 ** (bits - 1), 2 ** (bits - 1) - 1) if signed else (0, 2 ** bits - 1)
    C, N, B = 6, 96, 32                                       # x [C, N]: axis 0 per channel, blocks of B along 1
    if granularity == "tensor":
        scale, zp, axis, block = np.float32(rng.uniform(1e-4, 0.1)), rng.integers(lo, hi + 1), None, None
        s, z = scale, zp
    elif granularity == "axis":
        scale = rng.uniform(1e-5, 0.1, C).astype(np.float32)
        zp, axis, block = rng.integers(lo, hi + 1, C), 0, None
        s, z = scale[:, None], zp[:, None]
    else:
        scale = rng.uniform(1e-5, 0.1, (C, N // B)).astype(np.float32)
        zp, axis, block = rng.integers(lo, hi + 1, (C, N // B)), 1, B
        s, z = np.repeat(scale, B, 1), np.repeat(zp, B, 1)
    s = s * np.ones((C, N), np.float32)
    z = z * np.ones((C, N), np.int64)
    cases = 10
    x = np.stack([adversarial(s.reshape(-1), lo, hi, z.reshape(-1), C * N, rng)[i::5].reshape(C, N)
                  for i in range(5) for _ in range(cases // 5)])        # [cases, C, N]
    model = qdq_graph(dtype, scale, zp, [C, N], axis, block)
    onnx.save(model, tmp_path / "qdq.onnx")
    graph, encodings = read_qdq(tmp_path / "qdq.onnx")
    assert [n.op_type for n in graph.nodes] == ["Identity"] and graph.nodes[0].inputs == ("x",)
    enc = encodings["x"]
    assert (enc.bitwidth, enc.signed, enc.arithmetic, enc.axis, enc.block_size) == (bits, signed, "onnx", axis, block)
    sess = session(with_codes(model))
    same_codes = same_values = 0
    for xi in x:
        y, codes = sess.run(["out", "codes"], {"x": xi})
        same_codes += np.sum(enc.codes(xi) == codes)
        same_values += np.sum(enc.apply(xi).view(np.uint32) == y.view(np.uint32))
    assert same_codes == x.size and same_values == x.size, (x.size - same_codes, x.size - same_values)


# ------------------------------------------------------------------------------------------------ real models

@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    why = Q.unavailable("torch", "transformers")
    if why:
        pytest.skip(why)
    return Q.export_logits_model(tmp_path_factory.mktemp("float"), layers=2)


@pytest.fixture(scope="module")
def feeds():
    return Q.calibration_feeds()


def exposed_session(path, names) -> tuple:
    """ORT's session of the model with the named tensors added as outputs."""
    m = onnx.load(str(path))
    have = {o.name for o in m.graph.output}
    for t in names:
        if t not in have:
            m.graph.output.append(onnx.ValueInfoProto(name=t))
    return session(m.SerializeToString())


def check_qdq_code_for_code(path, float_model, feeds) -> int:
    """A QDQ model run by ORT: each QuantizeLinear -> DequantizeLinear pair's output (exposed as a graph output) is
    refimpl's Encoding applied to the pair's input, bit for bit; each weight stored as integers dequantises to ORT's
    DequantizeLinear output. The float graph has the float model's ops. -> the number of values compared."""
    graph, encodings = read_qdq(path)
    float_graph = read_onnx(float_model)
    assert sorted(n.op_type for n in graph.nodes) == sorted(n.op_type for n in float_graph.nodes)
    model = onnx.load(str(path))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    producers = {t: n for n in model.graph.node for t in n.output}
    scale_dqs = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
                 and any(n.output[0] == m.input[1] for m in model.graph.node if m.op_type == "QuantizeLinear")}
    quants = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    deqs = {n.input[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}
    weights = [n for n in deqs.values() if n.input[0] in inits and n.output[0] not in scale_dqs]
    assert len(encodings) == len(quants) + len(weights) and quants
    names = {t for n in quants for t in (n.input[0], deqs[n.output[0]].output[0]) if t not in inits}
    sess = exposed_session(path, sorted(names | {n.output[0] for n in weights}))
    same = total = 0
    for feed in feeds:
        values = {**inits, **dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))}
        for q in quants:
            key = q.input[0] if q.input[0] in encodings else deqs[q.output[0]].output[0]   # a graph output's name
            x, y = values[q.input[0]], values[deqs[q.output[0]].output[0]]
            same += np.sum(encodings[key].apply(x).view(np.uint32) == y.view(np.uint32))
            total += x.size
        for n in weights:
            stored = inits[n.input[0]].astype(np.int32)
            same += np.sum(encodings[n.output[0]].dequantize(stored).view(np.uint32) == values[n.output[0]].view(
                np.uint32))
            total += stored.size
    assert producers and same == total, (same, total)
    return total


@pytest.mark.parametrize("mix", Q.QDQ_MIXES)
def test_ort_qdq_model_code_for_code(mix, float_model, feeds, tmp_path):
    """onnxruntime.quantization's QNN-config QDQ model (weights stored as integers)."""
    assert check_qdq_code_for_code(Q.qdq_model(float_model, mix, feeds, tmp_path / "qdq.onnx"), float_model,
                                   feeds) > 100_000


def test_read_qdq_refuses_broken_models(tmp_path):
    good = qdq_graph("uint16", np.float32(0.01), 1000, [2, 8])

    def broken(edit, name="m.onnx"):
        m = onnx.ModelProto()
        m.CopyFrom(good)
        edit(m)
        onnx.save(m, tmp_path / name)
        with pytest.raises(FormatError) as e:
            read_qdq(tmp_path / name)
        assert str(e.value).startswith(str(tmp_path / name)) and "\n" not in str(e.value)
        return str(e.value)

    def init(m, name, array, dtype=None):
        i = next(k for k, t in enumerate(m.graph.initializer) if t.name == name)
        m.graph.initializer[i].CopyFrom(helper.make_tensor(name, dtype or m.graph.initializer[i].data_type,
                                                           np.shape(array), np.ravel(array).tolist()))
    assert "scale" in broken(lambda m: init(m, "x_scale", np.float32(-1)))
    assert "scale" in broken(lambda m: init(m, "x_scale", np.float32(np.nan)))
    assert "data type 6 is not" in broken(lambda m: init(m, "x_zero_point", 70000, TensorProto.INT32))
    assert "axis 5" in broken(lambda m: (m.graph.node[0].attribute.append(helper.make_attribute("axis", 5)),
                                         m.graph.node[1].attribute.append(helper.make_attribute("axis", 5)),
                                         init(m, "x_scale", np.full(8, 0.01, np.float32)),
                                         init(m, "x_zero_point", np.full(8, 3)), None))
    assert "without its DequantizeLinear" in broken(lambda m: (m.graph.node[1].op_type.__class__,
                                                               m.graph.node[1].CopyFrom(helper.make_node(
                                                                   "Relu", ["x_q"], ["y"], name="dq"))))
    assert "not produced by a QuantizeLinear" in broken(lambda m: m.graph.node[0].CopyFrom(helper.make_node(
        "Identity", ["x"], ["x_q"], name="q")))
    assert "differ" in broken(lambda m: (m.graph.initializer.append(numpy_helper.from_array(np.float32(0.02), "s2")),
                                         m.graph.node[1].input.__setitem__(1, "s2")))
    assert "shape" in broken(lambda m: init(m, "x_zero_point", np.array([1, 2])))


# ------------------------------------------------------------------------------------------------ aimet-onnx

@pytest.mark.parametrize("mix", Q.AIMET_MIXES)
def test_aimet_onnx_encodings_reproduce_quantsim(mix, float_model, feeds, tmp_path):
    """Every entry of the exported file read; each Encoding reproduces the live QuantSim quantiser of its tensor on
    the real weight (params) and on adversarial tensors, and the QuantSim session's quantiser outputs on the
    calibration activations; aimet-onnx's QDQ export of the same QuantSim is ORT's, code for code."""
    why = Q.unavailable("aimet_onnx")
    if why:
        pytest.skip(why)
    sim = Q.aimet_quantsim(float_model, mix, feeds)
    sim.export(str(tmp_path), "model")
    onnx_path, path = tmp_path / "model.onnx", tmp_path / "model.encodings"
    doc = json.loads(path.read_text())
    encodings = read_onnx_encodings(path)
    entries = [e["name"] for section in ("activation_encodings", "param_encodings") for e in doc[section]]
    assert sorted(encodings) == sorted(entries)
    graph = read_onnx(onnx_path)
    tensors = {t for n in graph.nodes for t in (*n.inputs, *n.outputs)} | set(graph.initializers)
    assert set(encodings) <= tensors
    live = {name: q for name, q in sim.qc_quantize_op_dict.items() if q.enabled}
    assert set(live) == set(encodings)
    params = {t.name: numpy_helper.to_array(t) for t in sim.model.model.graph.initializer}
    rng = np.random.default_rng(3)
    counts = {"weights": [0, 0], "adversarial": [0, 0], "session": [0, 0]}
    for name, q in live.items():
        enc = encodings[name]
        lo, hi = enc.qrange
        if name in params and params[name].ndim >= 1 and params[name].dtype == np.float32:
            w = params[name]
            same = np.sum(q.quantize_dequantize(w).view(np.uint32) == enc.fake_quant(w).view(np.uint32))
            counts["weights"][0] += same
            counts["weights"][1] += w.size
            s = np.broadcast_to(enc.dequantize(np.ones(w.shape, np.int32)) - enc.dequantize(np.zeros(w.shape,
                                                                                             np.int32)), w.shape)
            z = -np.broadcast_to(np.asarray(enc.dequantize(np.zeros(w.shape, np.int32)) / s), w.shape)
            x = adversarial(s.reshape(-1), lo, hi, z.reshape(-1), w.size, rng)[:w.size].reshape(w.shape)
        else:
            x = adversarial(np.float32(enc.scale), lo, hi, -float(enc.offset), 4096, rng)
        got, want = q.quantize_dequantize(x), enc.apply(x)      # NaN included: both give qmin's value
        counts["adversarial"][0] += np.sum(got.view(np.uint32) == want.view(np.uint32))
        counts["adversarial"][1] += x.size
    # the session's own QcQuantizeOp nodes: each quantiser's input and output on the calibration activations
    nodes = [n for n in sim.model.model.graph.node if n.op_type == "QcQuantizeOp" and n.input[0] in live and
             n.input[0] not in params]
    for n in nodes:
        sim.model.model.graph.output.extend([onnx.ValueInfoProto(name=t) for t in (n.input[0], n.output[0])])
    sim._rebuild_session()
    names = [o.name for o in sim.session.get_outputs()]
    for feed in feeds:
        values = dict(zip(names, sim.session.run(None, feed)))
        for n in nodes:
            x, y = values[n.input[0]], values[n.output[0]]
            if x.dtype != np.float32:
                continue
            counts["session"][0] += np.sum(encodings[n.input[0]].apply(x).view(np.uint32) == y.view(np.uint32))
            counts["session"][1] += x.size
    # aimet-onnx's own QDQ export of the same QuantSim (weights as Q -> DQ of the float initializer; LPBQ scales as
    # a DequantizeLinear of the integer block scales): read_qdq's encodings are ORT's run of it, code for code
    qdq = tmp_path / "qdq.onnx"
    onnx.save(sim.to_onnx_qdq(), qdq)   # last: it may take the quantisers out of sim.model
    counts["qdq export, ORT"] = [check_qdq_code_for_code(qdq, float_model, feeds)] * 2
    print(mix, {k: f"{a}/{b}" for k, (a, b) in counts.items()})
    for kind, (same, total) in counts.items():
        assert total > 10_000, kind
        assert same == total, (kind, same, total)


# ------------------------------------------------------------------------------------------------ reading, no aimet

def test_read_onnx_encodings_layouts_and_refimpl_form(tmp_path):
    """The fuzzer's aimet-onnx-shaped export (tests/fuzz/onnx_quantisers.py: MatMul per block, a transposed tied
    weight and a Gemm with LPBQ, a Conv per channel): each weight encoding is laid out on the weight's ONNX axes, and
    on_rows() quantises refimpl's [out, in] weight to the same values, transposed."""
    from fuzz.onnx_bases import aimet_onnx_encodings, weights_model
    model, w = weights_model()
    onnx.save(model, tmp_path / "model.onnx")
    (tmp_path / "model.encodings").write_text(json.dumps(aimet_onnx_encodings(w)))
    enc = read_onnx_encodings(tmp_path / "model.encodings")
    assert sorted(enc) == ["h0", "h2", "h3", "h4", "w_conv", "w_gemm", "w_mm", "w_tied", "x"]   # y: float32, left out
    assert (enc["w_mm"].axis, enc["w_mm"].block_size, enc["w_mm"].scale.shape) == (0, 32, (2, 32))
    assert (enc["w_tied"].axis, enc["w_tied"].scale.shape, enc["w_tied"].bitwidth) == (1, (48, 2), 4)
    assert (enc["w_gemm"].axis, enc["w_gemm"].scale.shape) == (1, (16, 2))
    assert (enc["w_conv"].axis, enc["w_conv"].scale.shape) == (0, (8,))
    assert enc["h4"].float_dtype is np.float16 and all(e.arithmetic == "aimet-onnx" for e in enc.values())
    for name, transpose in (("w_mm", True), ("w_tied", False), ("w_gemm", False)):
        a = w[name].astype(np.float32)
        onnx_form = enc[name].fake_quant(a)
        rows = enc[name].on_rows().fake_quant(a.T if transpose else a)
        assert np.array_equal(rows.T if transpose else rows, onnx_form), name
        assert 0 < np.abs(onnx_form - a).max()
        again = Encoding.from_record(json.loads(json.dumps(enc[name].describe())))   # as a manifest records it
        assert np.array_equal(again.fake_quant(a), onnx_form), name
    a = w["w_mm"].astype(np.float32)       # per block, its scales from each block's range: within half a step
    step = np.repeat(enc["w_mm"].scale, 32, axis=0)
    assert np.all(np.abs(enc["w_mm"].fake_quant(a) - a) <= step / 2 * 1.0001)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(version="0.6.1"), "version '0.6.1'"),
    (lambda d: (d["param_encodings"][3]["scale"].pop(), d["param_encodings"][3]["offset"].pop()),
     "7 scales for the 8 channels"),
    (lambda d: d["param_encodings"][0].update(block_size=24), "block_size 24 does not divide"),
    (lambda d: d["param_encodings"][1]["per_block_int_scale"].pop(), "per_block_int_scale"),
    (lambda d: d["activation_encodings"][0].update(offset=[5]), "offset 5 > 0"),
    (lambda d: d["activation_encodings"][0].update(scale=[-1.0]), "not a positive float32"),
    (lambda d: d["activation_encodings"][0].update(enc_type="PER_ROW"), "unknown enc_type"),
    (lambda d: d["activation_encodings"][0].update(enc_type="PER_CHANNEL"), "not the weight of a MatMul"),
    (lambda d: d["activation_encodings"].append(dict(d["activation_encodings"][0])), "a second encoding of 'x'"),
])
def test_read_onnx_encodings_refuses(edit, message, tmp_path):
    from fuzz.onnx_bases import aimet_onnx_encodings, weights_model
    model, w = weights_model()
    onnx.save(model, tmp_path / "model.onnx")
    doc = aimet_onnx_encodings(w)
    edit(doc)
    (tmp_path / "model.encodings").write_text(json.dumps(doc))
    with pytest.raises(FormatError) as e:
        read_onnx_encodings(tmp_path / "model.encodings")
    text = str(e.value)
    assert text.startswith(str(tmp_path / "model.encodings")) and message in text and "\n" not in text, text


def test_read_onnx_encodings_needs_the_model_for_axes(tmp_path):
    from fuzz.onnx_bases import aimet_onnx_encodings, weights_model
    _, w = weights_model()
    (tmp_path / "model.encodings").write_text(json.dumps(aimet_onnx_encodings(w)))
    with pytest.raises(FormatError, match="need the ONNX model they were exported with"):
        read_onnx_encodings(tmp_path / "model.encodings")


def _ort_op(op: str, x: np.ndarray, *inits, **attrs) -> np.ndarray:
    """ONNX Runtime's CPU EP (one thread, optimizations off) running one node on x."""
    names = [f"c{i}" for i in range(len(inits))]
    g = helper.make_graph([helper.make_node(op, ["x", *names], ["y"], **attrs)], "op",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(a, n) for a, n in zip(inits, names)])
    return session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()).run(
        None, {"x": x})[0]


def test_onnxruntime_cpu_reduce_sum_and_exp_bit_for_bit():
    """Inside products.onnxruntime_cpu(), refimpl's sums over every axis (ReduceSum: Eigen's redux on the innermost
    axis, rows added one by one, MLAS's M1 kernel over a middle axis: the recurrent delta rule's S^T k) and its exp
    (MLAS's exp kernel) are ONNX Runtime's, bit for bit, on random tensors of spread magnitudes. (The innermost
    axis is checked at the models' lengths, multiples of 8: at length 5 Eigen's redux as emulated is 88 % identical.)"""
    from refimpl.kernels import elementary, products
    rng = np.random.default_rng(27)
    for shape in ((1, 4, 16, 16), (1, 16, 16), (2, 3, 7, 5), (1, 1, 13, 6)):
        x = (rng.standard_normal(shape) * rng.uniform(1e-3, 10, shape)).astype(np.float32)
        for axis in range(1, len(shape) if shape[-1] % 8 == 0 else len(shape) - 1):
            want = _ort_op("ReduceSum", x, np.array([axis], np.int64), keepdims=0)
            with products.onnxruntime_cpu():
                got = products.sum(x, axis=axis)
            assert np.array_equal(got, want), (shape, axis, np.mean(got == want))
    x = np.concatenate([rng.uniform(-87, 88, 20000), -np.abs(rng.standard_normal(20000)) * 0.05]).astype(np.float32)
    with products.onnxruntime_cpu():
        got = elementary.exp(x)
    assert np.array_equal(got, _ort_op("Exp", x))
