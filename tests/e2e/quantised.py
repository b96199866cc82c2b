"""The quantised HTP as a device of the tests (issue 27, item 4): transformers' tiny presets behind the genie I/O,
exported in float32, quantised W8A16 / W4A16 on the exported graph as a real deployment does, and run on Qualcomm's
HTP simulator (onnxruntime-qnn, CPU fallback disabled: QDQ node groups run as the HTP's integer ops) and on ONNX
Runtime's CPU EP (the QDQ model's reference semantics: QuantizeLinear rounds half to even and saturates).

    case = float_case("dense", root)                         # export, optimize, HTP rewrites (tests/e2e/htp.py)
    q = quantise_qdq(case, "w8a16")                         # onnxruntime.quantization's QNN QDQ config
    a = quantise_aimet(case, "w8a16")                       # aimet-onnx QuantSim: its encodings + its model
    taps = quantiser_taps(q.model)                          # every QuantizeLinear of an activation: its codes
    cpu, htp = run_cpu(with_outputs(q.model, taps), feed), run_htp(...)
    codes_agreement(cpu[t], htp[t])                         # identical share, largest step

Calibration: a few short prompts, each the genie prompt call (AR 8, CL 32, empty cache) of the float model.

refimpl's diff of the runs, as a user runs it (`python tests/e2e/quantised.py diff` prints docs/htp.md §9's table):

    f, q = goldens(case, qdq_path, root)                    # refimpl golden (float; --encodings MODEL_QDQ.onnx)
    dumps = device_dumps(case, qm, root / "dump")           # {cpu, htp}: codes by QuantizeLinear output names
    d = diff(f, q, qdq_path, dumps["htp"], root / "m.json")  # refimpl diff --float --encodings: verdicts, first
    replayed(qm, values)                                    # refimpl's kernels on a run's own inputs, per quantiser

Planted faults, as edits of the QDQ device graph (each returns a new model; fault_models picks the three):
`wrong_channel_scale` (one channel of a weight's per-channel DequantizeLinear scale x1.02), `offset_off_by_one` (an
activation's zero point + 1: every value one step off), `saturating_residual` (a residual add's output scale shrunk
so the add clips).
"""

import dataclasses
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
import devices as D  # noqa: E402  (after the skips: it imports torch)
import htp as H  # noqa: E402

ARCHITECTURES = {"dense": "tiny-qwen3", "moe": "tiny-qwen3-moe", "hybrid": "tiny-qwen3.5"}
GENIE = {"ar": 8, "cl": 32, "mask_floor": -1000.0}
PROMPT = [97, 11, 1879, 13, 42, 7, 99, 5]              # the measured prompt: one full AR = 8 chunk (no pad slot)
# calibration: the measured prompt and three others, full chunks (a pad slot's zeroed GDN input would be 0 / 0 in
# the quantised l2norm); the ranges then cover the measured call (no clipping of it)
CALIBRATION = (PROMPT, [5, 300, 1200, 64, 8, 777, 31, 1500], [2000, 17, 450, 900, 33, 1024, 3, 4],
               [640, 641, 12, 99, 1300, 8, 250, 1777])
MIXES = ("w8a16", "w4a16")
# QNN's QDQ, its own weight type per mix; W4A16's int4 weights per output channel (MatMul's B: axis 1 of [K, N])
QDQ_MIXES = {"w8a16": dict(activation="QUInt16", weight="QUInt8", per_channel=False),
             "w4a16": dict(activation="QUInt16", weight="QInt4", per_channel=True)}
QNN_INT_OPTIONS = {"backend_type": "htp", "soc_model": "60", "htp_arch": "75"}


# ------------------------------------------------------------------------------------------------ float export

@dataclasses.dataclass
class FloatCase:
    arch: str
    config: dict
    arrays: dict
    model: object              # transformers, float32
    path: Path                 # the float32 graph: optimized, HTP rewrites applied, shape-inferred
    ins: list
    outs: list
    feeds: list                # calibration feeds (the genie prompt calls of CALIBRATION)
    feed: dict                 # the measured prompt call (PROMPT)
    real: slice                # its real token slots

    def float_session(self):
        return cpu_session(self.path.read_bytes())


def genie_feed(cfg, tokens: list) -> tuple[dict, slice]:
    """The genie prompt call of `tokens` (empty cache), as run_genie's host builds it; and its real slots."""
    captured = {}

    def graph(inputs, step):
        captured.update(inputs)
        raise StopIteration
    try:
        D.run_genie(graph, cfg, [("prompt", tokens)], GENIE)
    except StopIteration:
        pass
    ar = GENIE["ar"]
    return captured, slice(ar - len(tokens), ar)


def float_case(arch: str, root: Path, skip=()) -> FloatCase:
    """The preset (2048-token vocabulary) in transformers float32 behind GenieGraph, exported for the prompt call,
    optimized as torch.onnx.export(optimize=True) does and rewritten for the HTP (HTP_REWRITES: unfused RMSNorm,
    GatherND as Gather; the gated delta rule as its recurrent form; not FLOAT_ONLY_REWRITES), and for the
    quantised HTP QUANTISED_REWRITES (but those named in `skip`)."""
    root.mkdir(parents=True, exist_ok=True)
    config, arrays = D.small_preset(ARCHITECTURES[arch])
    model = D.load_hf(D.hf_checkpoint(config, arrays, root / "checkpoint"), "float32", "eager", "batched_mm")
    cfg = model.config
    ins, outs = D.genie_names(cfg)
    feed, real = genie_feed(cfg, PROMPT)
    raw = root / "float_raw.onnx"
    with torch.no_grad(), H.htp_functions(model):
        wrapped = D.GenieGraph(model, True).eval()
        args = tuple(D.torch_arg(feed[n], torch.float32) for n in ins)
        H._export(wrapped, args, ins, outs, raw)
    feeds = [genie_feed(cfg, t)[0] for t in CALIBRATION]
    return FloatCase(arch, config, arrays, model, rewritten(raw, skip), ins, outs, feeds, feed, real)


def variant(case: FloatCase, skip=()) -> FloatCase:
    """The same case with the rewrites named in `skip` left out (from the same raw export)."""
    return dataclasses.replace(case, path=rewritten(case.path.parent / "float_raw.onnx", skip))


def rewritten(raw: Path, skip=()) -> Path:
    """The raw export optimized, rewritten for the quantised HTP (but `skip`), constants folded: the float graph."""
    _, m = H.optimized(raw)
    m2 = onnx.ModelProto()
    m2.CopyFrom(m)
    for name, fn in H.HTP_REWRITES.items():
        if name not in FLOAT_ONLY_REWRITES:
            fn(m2)
    for name, fn in QUANTISED_REWRITES.items():
        if name not in skip:
            fn(m2)
    path = raw.parent / ("float.onnx" if not skip else f"float-skip-{'-'.join(skip)}.onnx")
    onnx.save(onnx.shape_inference.infer_shapes(m2), path)
    folded(path)
    return path


def reciprocal_as_div(m) -> int:
    """Reciprocal(x) -> Div(1, x): the same function. The HTP's quantised (uint16) Reciprocal is wrong when its
    input's encoding range ends below 1: measured, its result is max(range) / x instead of 1 / x (RMSNorm's
    1 / sqrt(mean(x^2) + eps) of small activations: every code off); Div(1, x) is within ~50 codes of 65535."""
    n = 0
    for node in m.graph.node:
        if node.op_type == "Reciprocal":
            one = f"{node.name or node.output[0]}_one"
            m.graph.initializer.append(onnx.numpy_helper.from_array(np.array(1, np.float32), one))   # float32 graphs
            node.op_type = "Div"
            node.input[:] = [one, node.input[0]]
            n += 1
    return n


def behind(producer: dict, name: str, ops: tuple) -> list | None:
    """The nodes behind tensor `name` (producer: output name -> node), each one's first input followed, whose op types
    are `ops` in order; None where they are not."""
    chain = []
    for op in ops:
        n = producer.get(name)
        if n is None or n.op_type != op:
            return None
        chain.append(n)
        name = n.input[0]
    return chain


def outer_products_as_matmul(m) -> int:
    """Each broadcast Mul of a column and a row, Unsqueeze(a, -1) [.., Dk, 1] * Unsqueeze(b, -2) [.., 1, Dv] (the
    gated delta rule's k_t delta_t^T, 24 in the tiny Qwen3.5's prompt graph), -> MatMul(column, row): the same
    product (K = 1), every quantiser kept (the operands' and the product's own Q / DQ). The HTP computes the Mul
    after a Gather of one token as the elementwise product (docs/htp.md §9, "Qwen3.5 on the HTP"); the MatMul it
    computes as its uint16 x uint16 MatMul (htp_quantised.matmul16). Applied to a QDQ model: returns the count."""
    producer = {o: n for n in m.graph.node for o in n.output}
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in m.graph.initializer}

    def unsqueezed(name):                       # the Unsqueeze's axis behind DQ(Q(Unsqueeze(x))), else None
        chain = behind(producer, name, ("DequantizeLinear", "QuantizeLinear", "Unsqueeze"))
        if chain is None:
            return None
        axes = inits.get(chain[2].input[1]) if len(chain[2].input) > 1 else _attr(chain[2], "axes")
        return None if axes is None else tuple(np.ravel(axes).tolist())
    n = 0
    for node in m.graph.node:
        if node.op_type == "Mul" and len(node.input) == 2:
            axes = tuple(unsqueezed(i) for i in node.input)
            if axes in (((-1,), (-2,)), ((-2,), (-1,))):
                node.op_type = "MatMul"                                     # [.., Dk, 1] @ [.., 1, Dv]
                node.input[:] = list(node.input) if axes[0] == (-1,) else list(node.input)[::-1]
                n += 1
    return n


ROUTING_SOFTMAX_ENCODING = (np.float32(1 / 65535), np.uint16(0))   # a Softmax's output as QNN's config gives it


def routing_as_topk_softmax(m) -> int:
    """Each MoE routing with norm_topk_prob, TopK(DQ(Q(Softmax(logits)))) -> Div(top-k, ReduceSum(top-k)), -> the
    same function in the other order: TopK of the logits (its values quantised at the logits' own encoding), then
    Softmax over the k values (softmax over all experts, the top k renormalised, is the softmax of the k largest
    logits). The Softmax over all experts stays (the router's probabilities: its quantiser is a tap; no consumer);
    the ReduceSum and its quantiser go. The routing weights' quantiser (the Div's, now the k-Softmax's, and those of
    the data movement after it: aimet-onnx gives them their own) takes ROUTING_SOFTMAX_ENCODING, (1 / 65535, 0), the
    encoding QNN's config gives every Softmax output (the HTP's Softmax writes p 2^16 codes there). The HTP computes
    the TopK of the quantised Softmax from an fp16 softmax of the logits, not from the Softmax's codes (docs/htp.md
    §9, "The MoE's routing on the HTP"); this form has no TopK of a Softmax. Applied to a QDQ model: returns the
    count."""
    producer = {o: n for n in m.graph.node for o in n.output}
    consumers = {}
    for n in m.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    scale = onnx.numpy_helper.from_array(ROUTING_SOFTMAX_ENCODING[0], "routing_softmax_scale")
    zero = onnx.numpy_helper.from_array(ROUTING_SOFTMAX_ENCODING[1], "routing_softmax_zero_point")
    dead, renamed, n = set(), {}, 0
    for topk in [t for t in m.graph.node if t.op_type == "TopK"]:
        probs = behind(producer, topk.input[0], ("DequantizeLinear", "QuantizeLinear", "Softmax", "DequantizeLinear"))
        qv = [c for c in consumers.get(topk.output[0], ()) if c.op_type == "QuantizeLinear"]
        dqv = [c for c in consumers.get(qv[0].output[0], ()) if c.op_type == "DequantizeLinear"] if len(qv) == 1 else []
        div = [c for c in consumers.get(dqv[0].output[0], ()) if c.op_type == "Div"] if len(dqv) == 1 else []
        if probs is None or len(div) != 1 or div[0].input[0] != dqv[0].output[0]:
            continue
        logits = probs[3]                                           # DQ(logits): the Softmax's input
        summed = behind(producer, div[0].input[1], ("DequantizeLinear", "QuantizeLinear", "ReduceSum"))
        if summed is None or summed[2].input[0] != dqv[0].output[0]:
            continue
        topk.input[0] = logits.output[0]                            # TopK of the logits
        for q in (qv[0], dqv[0]):                                   # its values at the logits' encoding
            q.input[1:3] = logits.input[1:3]
        d = div[0]
        out = [c for c in consumers.get(d.output[0], ()) if c.op_type == "QuantizeLinear"]
        while len(out) == 1:                                        # its quantiser, and the data movement's after it
            renamed[out[0].input[1]], renamed[out[0].input[2]] = scale.name, zero.name   # (aimet-onnx gives those
            dq = [c for c in consumers.get(out[0].output[0], ()) if c.op_type == "DequantizeLinear"]   # their own)
            moved = [c for c in consumers.get(dq[0].output[0], ()) if c.op_type in MOVES] if len(dq) == 1 else []
            out = [c for c in consumers.get(moved[0].output[0], ()) if c.op_type == "QuantizeLinear"] \
                if len(moved) == 1 else []
        d.op_type, d.input[:] = "Softmax", [dqv[0].output[0]]       # softmax over the k values
        d.attribute.append(onnx.helper.make_attribute("axis", -1))
        dead.update(id(x) for x in summed)
        n += 1
    if n:
        kept = [x for x in m.graph.node if id(x) not in dead]
        del m.graph.node[:]
        m.graph.node.extend(kept)
        for x in m.graph.node:                                      # the routing weights' encoding, downstream too
            if x.op_type in ("QuantizeLinear", "DequantizeLinear") and len(x.input) > 2 and x.input[1] in renamed:
                x.input[1], x.input[2] = renamed[x.input[1]], renamed[x.input[2]]
        m.graph.initializer.extend([scale, zero])
    return n


QUANTISED_REWRITES = {"reciprocal": reciprocal_as_div}
# htp.HTP_REWRITES not applied to a graph that will be quantised: "gates" composes Softplus as Log(1 + Exp(x)), and
# the HTP's quantised (uint16) Log returns code 0 for every input (measured: 0 % of codes right, the GDN's g then
# collapses the hybrid to -2.5 dB against the CPU EP); its quantised Softplus is within 201 codes of 65535
FLOAT_ONLY_REWRITES = ("gates",)


def folded(path: Path) -> None:
    """ONNX Runtime's basic (provider-independent) graph optimizations applied to the file in place: constants
    folded (ConstantOfShape / EyeLike the HTP does not take), so the quantised graph is what every session runs
    (the sessions below then run it with ONNX Runtime's optimizations off: the QNN EP groups the QDQ nodes
    itself, and the quantisers' taps as graph outputs leave its grouping alone)."""
    before = onnx.load(path)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(path)
    options.log_severity_level = 3
    ort.InferenceSession(path.read_bytes(), options, providers=["CPUExecutionProvider"])
    onnx.save(onnx.shape_inference.infer_shapes(keep_scopes(before, onnx.load(path))), path)


# ------------------------------------------------------------------------------------------------ sessions

def cpu_session(model_bytes: bytes):
    """ONNX Runtime's CPU EP with its graph optimizations off: the QDQ model's own semantics (with them on, ORT fuses
    QDQ groups into integer kernels that depart from it; i27core measured that)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


def htp_session(model_bytes: bytes, fp16: bool = True, optimize: bool = True):
    """The HTP simulator, CPU fallback disabled. QDQ node groups run as integer ops; float ops (if any are left)
    in fp16 when `fp16`. optimize=False: ONNX Runtime's own graph optimizations off (the QNN EP groups the QDQ
    nodes itself)."""
    why = H.unavailable()
    assert why is None, why
    devices = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
    options = ort.SessionOptions()
    options.log_severity_level = 3
    opts = dict(QNN_INT_OPTIONS, **({"enable_htp_fp16_precision": "1"} if fp16 else {}))
    options.add_provider_for_devices(devices, opts)
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    return ort.InferenceSession(model_bytes, options)


def run(session, feed: dict, names: list | None = None) -> dict:
    want = {i.name for i in session.get_inputs()}
    names = names or [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, {k: v for k, v in feed.items() if k in want})))


# ------------------------------------------------------------------------------------------------ QDQ

class Reader:
    """onnxruntime.quantization's CalibrationDataReader over a list of feeds."""

    def __init__(self, feeds, names):
        self.feeds, self.names, self.i = feeds, set(names), 0

    def get_next(self):
        if self.i >= len(self.feeds):
            return None
        self.i += 1
        return {k: v for k, v in self.feeds[self.i - 1].items() if k in self.names}

    def rewind(self):
        self.i = 0


def matmul_weights(m) -> dict:
    """{initializer name: axis of its output channel} for the constant B of every MatMul ([K, N]: axis 1) and
    Gather-ed expert stacks feeding MatMul are left per-tensor."""
    inits = {i.name for i in m.graph.initializer}
    return {n.input[1]: 1 for n in m.graph.node if n.op_type == "MatMul" and n.input[1] in inits}


def quantise_qdq(case: FloatCase, mix: str, out: Path | None = None) -> onnx.ModelProto:
    """The float graph quantised by onnxruntime.quantization with get_qnn_qdq_config (MinMax on CALIBRATION):
    W8A16 = uint16 activations, uint8 weights per tensor; W4A16 = uint16 activations, int4 symmetric weights per
    output channel (MatMul B)."""
    from onnxruntime.quantization import QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config
    spec = QDQ_MIXES[mix]
    m = onnx.load(case.path)
    overrides = None
    if spec["per_channel"]:
        overrides = {w: [{"axis": axis, "quant_type": getattr(QuantType, spec["weight"]), "symmetric": True}]
                     for w, axis in matmul_weights(m).items()}
    config = get_qnn_qdq_config(m, Reader(case.feeds, case.ins), activation_type=getattr(QuantType, spec["activation"]),
                                weight_type=getattr(QuantType, spec["weight"]), init_overrides=overrides)
    out = out or case.path.with_name(f"qdq_{mix}_{case.path.stem}.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize(m, out, config)
    return keep_scopes(onnx.load(case.path), onnx.load(out), out)


def keep_scopes(source, m, out: Path | None = None):
    """The exporter's node metadata (module scopes, which refimpl's placement reads) copied by node name from
    `source` onto `m` (ONNX Runtime's quantize and saved optimized models drop it); saved to `out` if given."""
    meta = {n.name: n.metadata_props for n in source.graph.node if n.name}
    for n in m.graph.node:
        if n.name in meta and not n.metadata_props:
            n.metadata_props.extend(meta[n.name])
    if out is not None:
        onnx.save(m, out)
    return m


MOVES = ("Unsqueeze", "Squeeze", "Transpose", "Reshape", "Slice")


# aimet-onnx QuantSim: its default config (W4A16: its default per-channel config, the weights per output channel)
AIMET_MIXES = {"w8a16": dict(param="int8", activation="int16", config="default_config.json"),
               "w4a16": dict(param="int4", activation="int16", config="default_config_per_channel.json")}


def aimet_unavailable() -> str | None:
    try:
        import aimet_onnx  # noqa: F401
    except Exception as e:   # absent, or its native library failing to load here
        return f"aimet-onnx cannot load here ({e}); `make test` installs aimet-onnx==2.42.0"
    return None


@dataclasses.dataclass
class AimetQuantised:
    sim: object                # aimet_onnx QuantizationSimModel, calibrated
    encodings: Path            # its exported encodings (1.0.0 schema, keyed by ONNX tensor names)
    model: Path                # its exported model (the float graph it keys the encodings to)
    qdq: onnx.ModelProto       # the same quantisers as a QDQ model (sim.to_onnx_qdq): the device graph

    def session_run(self, feed: dict, outs: list) -> dict:
        """QuantSim's own session (its QcQuantizeOps) on a feed: its outputs in graph order, named `outs` (QuantSim
        renames the graph outputs it quantises)."""
        sess = self.sim.session
        want = {i.name for i in sess.get_inputs()}
        return dict(zip(outs, sess.run(None, {k: v for k, v in feed.items() if k in want})))


def quantise_aimet(case: FloatCase, mix: str, out: Path | None = None) -> AimetQuantised:
    """The float graph under aimet-onnx's QuantizationSimModel (min-max, its default config file for the mix),
    calibrated on CALIBRATION, exported (encodings + model) and as a QDQ model."""
    import aimet_onnx
    from aimet_onnx.quantsim import QuantizationSimModel
    spec = AIMET_MIXES[mix]
    config = Path(aimet_onnx.__file__).parent / "common" / "quantsim_config" / spec["config"]
    out = out or case.path.parent / f"aimet_{mix}"
    out.mkdir(parents=True, exist_ok=True)
    m = onnx.load(case.path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sim = QuantizationSimModel(m, param_type=spec["param"], activation_type=spec["activation"],
                                   config_file=str(config), providers=["CPUExecutionProvider"])
        names = {i.name for i in sim.session.get_inputs()}
        sim.compute_encodings([{k: v for k, v in f.items() if k in names} for f in case.feeds])
        sim.export(str(out), "model")
        qdq = sim.to_onnx_qdq(prequantize_constants=True)
    onnx.save(qdq, out / "model_qdq.onnx")
    return AimetQuantised(sim, out / "model.encodings", out / "model.onnx", qdq)


def quantsim_values(a: AimetQuantised, feed: dict) -> dict:
    """{ONNX tensor: QuantSim's quantised-dequantised value} of every enabled activation quantiser of its session
    (a QcQuantizeOp of a tensor that is no initializer: its output made a graph output), on a feed."""
    from aimet_onnx.utils import OrtInferenceSession
    m = onnx.ModelProto()
    m.CopyFrom(a.sim.model.model)
    inits = {i.name for i in m.graph.initializer}
    ops = {n.input[0]: n.output[0] for n in m.graph.node if n.op_type == "QcQuantizeOp" and n.input[0] not in inits
           and a.sim.qc_quantize_op_dict[n.input[0]].enabled}
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(onnx.helper.make_empty_tensor_value_info(o) for o in ops.values() if o not in have)
    sess = OrtInferenceSession(m, ["CPUExecutionProvider"])
    want = {i.name for i in sess.get_inputs()}
    outs = dict(zip([o.name for o in sess.get_outputs()],
                    sess.run(None, {k: v for k, v in feed.items() if k in want})))
    del sess   # aimet's session finalizer logs: not at interpreter exit
    return {t: outs[o] for t, o in ops.items()}


def quantiser_taps(m) -> list[str]:
    """The output (codes) of every QuantizeLinear in graph order: each quantiser of an activation (weights are
    stored quantised, initializer -> DequantizeLinear, and compared by their initializers); but those on the
    data-movement chain that ends in a graph output (Q -> DQ -> Unsqueeze / Transpose ... -> Q -> DQ -> output):
    made graph outputs too, the QNN EP's layout pass leaves a Transpose / Unsqueeze there it cannot take (the
    session fails). Their codes are the graph output's own (data movement keeps codes), read from it."""
    producer = {o: n for n in m.graph.node for o in n.output}
    skip = set()
    for out in m.graph.output:
        n = producer.get(out.name)
        while n is not None and n.op_type in ("QuantizeLinear", "DequantizeLinear", *MOVES):
            if n.op_type == "QuantizeLinear":
                skip.add(n.output[0])
            n = producer.get(n.input[0])
    return [n.output[0] for n in m.graph.node if n.op_type == "QuantizeLinear" and n.output[0] not in skip]


def with_outputs(m, names) -> bytes:
    """The model with `names` added as graph outputs (types from shape inference), serialized."""
    m2 = onnx.ModelProto()
    m2.CopyFrom(m)
    m2 = onnx.shape_inference.infer_shapes(m2)
    have = {o.name for o in m2.graph.output}
    typed = {v.name: v for v in m2.graph.value_info}
    for n in names:
        if n not in have:
            m2.graph.output.append(typed[n] if n in typed else onnx.helper.make_empty_tensor_value_info(n))
    return m2.SerializeToString()


def quant_params(m) -> dict:
    """{QuantizeLinear output: (scale, zero point)} of the model's activation quantisers."""
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in m.graph.initializer}
    return {n.output[0]: (inits[n.input[1]], inits[n.input[2]] if len(n.input) > 2 else None)
            for n in m.graph.node if n.op_type == "QuantizeLinear"}


# ------------------------------------------------------------------------------------------------ metrics

def sqnr_db(ref, x) -> float:
    ref, x = np.asarray(ref, np.float64), np.asarray(x, np.float64)
    err = np.sum((x - ref) ** 2)
    return math.inf if err == 0 else 10 * math.log10(np.sum(ref ** 2) / err)


def top1(ref, x) -> float:
    """Share of positions where the argmax over the last axis agrees."""
    return float((np.argmax(ref, -1) == np.argmax(x, -1)).mean())


def quantised_as(q, inits: dict, y, want) -> np.ndarray:
    """y quantised by QuantizeLinear node q's encoding (its scale and zero point initializers; ONNX's arithmetic),
    to codes of want's dtype."""
    from refimpl.encodings import Encoding
    zp = inits[q.input[2]]
    enc = Encoding(8 * want.dtype.itemsize, inits[q.input[1]], -zp.astype(np.int32), signed=want.dtype.kind == "i",
                   axis=None, arithmetic="onnx")
    return enc.codes(np.asarray(y, np.float32))


def codes_agreement(a, b) -> tuple[float, int]:
    """(share of identical codes, largest code distance) of two integer code arrays of the same quantiser."""
    a, b = np.asarray(a).astype(np.int64), np.asarray(b).astype(np.int64)
    if a.shape != b.shape:
        raise ValueError(f"code shapes differ: {a.shape} vs {b.shape}")
    if a.size == 0:
        return 1.0, 0
    d = np.abs(a - b)
    return float((d == 0).mean()), int(d.max())


def codes_of(values, scale, zero_point, dtype) -> np.ndarray:
    """ONNX QuantizeLinear of float values (round half to even, saturate): what a node's quantiser makes of
    refimpl's (or any peer's) float value at that node. scale / zero_point per tensor or along the last axis."""
    info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else None
    lo, hi = (info.min, info.max) if info else (None, None)
    q = np.rint(np.asarray(values, np.float32) / np.float32(scale)) + np.asarray(zero_point, np.int64)
    return np.clip(q, lo, hi).astype(dtype)


def departures(m, a: dict, b: dict, taps: list) -> list[tuple]:
    """Per quantiser in graph order: (tap, op of the node it quantises, node name, identical share, max step, SQNR
    dB of b's dequantised values against a's) of two runs' codes."""
    producer = {o: n for n in m.graph.node for o in n.output}
    params = quant_params(m)
    rows = []
    for t in taps:
        src = producer.get(producer[t].input[0])
        share, step = codes_agreement(a[t], b[t])
        zp = params[t][1]
        zp = 0 if zp is None else zp.astype(np.int64)
        snr = sqnr_db(a[t].astype(np.int64) - zp, b[t].astype(np.int64) - zp)
        rows.append((t, src.op_type if src else "input", src.name if src else producer[t].input[0], share, step, snr))
    return rows


def first_collapse(rows, db: float = 10.0):
    """The first row whose values part by more than noise: SQNR under `db`."""
    return next((r for r in rows if r[5] < db), None)


def first_departure(rows, share: float = 0.999, step: int = 0):
    """The first row whose codes part: identical share under `share` and largest step over `step`."""
    return next((r for r in rows if r[3] < share and r[4] > step), None)


@dataclasses.dataclass
class Measured:
    quantisers: int                 # QuantizeLinear nodes (activations) of the model
    tapped: int                     # those made graph outputs
    cpu_vs_float: tuple             # logits over the real slots: (SQNR dB, top-1 agreement)
    htp_vs_cpu: tuple
    htp_vs_float: tuple
    codes_all_identical: int        # quantisers whose codes are identical on the HTP and the CPU EP
    codes_999: int                  # quantisers with >= 99.9 % of codes identical
    first_any: tuple | None         # first quantiser where the HTP's codes differ at all
    first_big: tuple | None         # first where they differ by more than 1 % of the 16-bit grid (655 codes)
    first_collapse: tuple | None    # first where the HTP's values sit under 10 dB SQNR against the CPU EP's


def measure(case: FloatCase, qm, cpu_fn=None, htp_fn=None) -> tuple[Measured, dict, dict]:
    """The quantised model on the CPU EP and the HTP, every quantiser tapped: logits against each other and
    against the float graph, and the codes of every quantiser compared."""
    taps = quantiser_taps(qm)
    b = with_outputs(qm, taps)
    fl = run(case.float_session(), case.feed)["logits"][0, case.real]
    cpu = run(cpu_session(b), case.feed)
    dev = run(htp_session(b, optimize=False), case.feed)
    lc, lh = cpu["logits"][0, case.real], dev["logits"][0, case.real]
    rows = departures(qm, cpu, dev, taps)
    big = first_departure(rows, 1.0, 655)
    return Measured(sum(n.op_type == "QuantizeLinear" for n in qm.graph.node), len(taps),
                    (sqnr_db(fl, lc), top1(fl, lc)), (sqnr_db(lc, lh), top1(lc, lh)), (sqnr_db(fl, lh), top1(fl, lh)),
                    sum(r[3] == 1.0 for r in rows), sum(r[3] >= 0.999 for r in rows), first_departure(rows, 1.0),
                    big, first_collapse(rows)), cpu, dev


# ------------------------------------------------------------------------------------------------ planted faults

def _copy(m):
    m2 = onnx.ModelProto()
    m2.CopyFrom(m)
    return m2


def _init(m, name):
    return next(i for i in m.graph.initializer if i.name == name)


def _replace_input(node, index: int, m, name: str, value: np.ndarray) -> None:
    """node.input[index] becomes a new initializer `name` holding `value` (the old one may be shared)."""
    m.graph.initializer.append(onnx.numpy_helper.from_array(value, name))
    node.input[index] = name


def weight_dequantizers(m) -> dict:
    """{weight initializer: its DequantizeLinear node} of the model's stored-quantised weights."""
    inits = {i.name for i in m.graph.initializer}
    return {n.input[0]: n for n in m.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits}


def wrong_channel_scale(m, weight: str, channel: int, factor: float = 1.02, axis: int | None = None):
    """The weight's DequantizeLinear with one output channel's scale x factor: a device that converted one channel's
    scale wrong. A per-tensor scale becomes per-axis along `axis` (default: MatMul B's output axis 1, or the
    DequantizeLinear's own axis) with the other channels unchanged. The HTP takes per-channel weights symmetric
    only (W4A16's int4): an asymmetric uint8 weight made per-axis (W8A16) fails to compile ("Unsupported nodes")
    and runs on the CPU EP only."""
    m = _copy(m)
    dq = weight_dequantizers(m)[weight]
    codes = onnx.numpy_helper.to_array(_init(m, weight))
    scale = onnx.numpy_helper.to_array(_init(m, dq.input[1]))
    zp = onnx.numpy_helper.to_array(_init(m, dq.input[2])) if len(dq.input) > 2 else None
    own = next((a.i for a in dq.attribute if a.name == "axis"), 1)
    axis = own if axis is None else axis
    if scale.ndim == 0:
        n = codes.shape[axis]
        scale = np.full(n, scale, scale.dtype)
        if zp is not None:
            _replace_input(dq, 2, m, f"{weight}_fault_zero_point", np.full(n, zp, zp.dtype))
        del dq.attribute[:]
        dq.attribute.append(onnx.helper.make_attribute("axis", axis))
    scale = scale.copy()
    scale[channel] *= scale.dtype.type(factor)
    _replace_input(dq, 1, m, f"{weight}_fault_scale", scale)
    return m


def activation_quantizer(m, tensor: str):
    """The QuantizeLinear of activation `tensor` (its input)."""
    return next(n for n in m.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor)


def offset_off_by_one(m, tensor: str, delta: int = 1):
    """The activation's quantiser runs with zero point + delta on the device (its QuantizeLinear and the
    DequantizeLinears reading its codes, consistently: the device's own arithmetic is unchanged but for the grid's
    ends), while the encodings (the honest model's) say zero point: the device's codes at that tap are one step
    off, read with the encodings every value is one step (scale) off. The HTP compiles it (a QuantizeLinear whose
    consumers read another zero point it does not: that graph fails, "Unsupported nodes")."""
    m = _copy(m)
    q = activation_quantizer(m, tensor)
    zp = onnx.numpy_helper.to_array(_init(m, q.input[2]))
    info = np.iinfo(zp.dtype)
    moved = np.clip(zp.astype(np.int64) + delta, info.min, info.max).astype(zp.dtype)
    name = f"{tensor}_fault_zero_point"
    _replace_input(q, 2, m, name, moved)
    for n in m.graph.node:
        if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0]:
            n.input[2] = name
    return m


def saturating_residual(m, tensor: str, shrink: float = 0.5):
    """The residual add's output quantiser (its QuantizeLinear and the DequantizeLinears of its codes) with the
    scale x shrink: a range too small for the sum, whose large values clip at the grid's ends."""
    m = _copy(m)
    q = activation_quantizer(m, tensor)
    scale = onnx.numpy_helper.to_array(_init(m, q.input[1]))
    name = f"{tensor}_fault_scale"
    m.graph.initializer.append(onnx.numpy_helper.from_array((scale * scale.dtype.type(shrink)).astype(scale.dtype),
                                                            name))
    q.input[1] = name
    for n in m.graph.node:
        if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0]:
            n.input[1] = name
    return m


def residual_adds(m) -> list[str]:
    """Outputs of the residual Adds of a QDQ model, in graph order: the residual stream starts at the embedding's
    Gather (the first Gather of a weight); an Add of two activations one of which (through its QDQ pair) is the
    stream continues it."""
    inits = {i.name for i in m.graph.initializer}
    producer = {o: n for n in m.graph.node for o in n.output}

    def source(t):   # through the QDQ pair to the tensor quantised
        n = producer.get(t)
        while n is not None and n.op_type in ("DequantizeLinear", "QuantizeLinear"):
            t = n.input[0]
            n = producer.get(t)
        return t
    embedding = next(n for n in m.graph.node if n.op_type == "Gather" and source(n.input[0]) in inits)
    stream = {embedding.output[0]}
    adds = []
    for n in m.graph.node:
        srcs = [source(i) for i in n.input]
        if n.op_type == "Add" and len(srcs) == 2 and not any(x in inits for x in srcs) and any(x in stream
                                                                                                for x in srcs):
            stream.add(n.output[0])
            adds.append(n.output[0])
    return adds


# ------------------------------------------------------------------------------------------------ refimpl's diff

def write_dump(qm, values: dict, directory: Path, dequantised: bool = False) -> Path:
    """A run of the QDQ model as its engineer dumps it: each quantiser's integer codes (an ONNX Runtime session's
    QuantizeLinear output, a device's native output) under that QuantizeLinear's output name, and the graph outputs
    (float, dequantised) under theirs; .npy files, flat (one call). refimpl maps the names (diff --encodings).
    dequantised: each quantiser's values as float32 instead, dequantised with the run's own scale and zero point
    (qnn-net-run's default float output), under its DequantizeLinear's output name."""
    directory.mkdir(parents=True, exist_ok=True)
    params = quant_params(qm)
    dq = {n.input[0]: n.output[0] for n in qm.graph.node if n.op_type == "DequantizeLinear"}
    outputs = {o.name for o in qm.graph.output}
    for name, v in values.items():
        if name in params and dequantised and name in dq:
            scale, zp = params[name]
            zp = np.zeros((), np.int64) if zp is None else zp.astype(np.int64)
            name, v = dq[name], ((v.astype(np.int64) - zp).astype(np.float32) * scale).astype(np.float32)
        elif name not in params and name not in outputs:
            continue
        np.save(directory / f"{name.replace('/', '_')}.npy", v)
    return directory


def cli(*args) -> int:
    """refimpl's command line, in process (as `refimpl ARGS` would run)."""
    from refimpl.cli import main as refimpl_main
    return refimpl_main([str(a) for a in args])


GOLDEN_ARGS = ("--input-ids", ",".join(map(str, PROMPT)), "--convention", "genie", "--ar", GENIE["ar"], "--cl",
               GENIE["cl"], "--mask-floor", GENIE["mask_floor"], "-q", "--overwrite")


def golden_args(checkpoint: Path) -> tuple:
    """GOLDEN_ARGS for the case's checkpoint: a hybrid's conv state as the exported graph holds it, Kc - 1 columns
    (run_genie's host gives the graph that; refimpl's genie default is transformers' Kc)."""
    kc = json.loads((Path(checkpoint) / "config.json").read_text()).get("linear_conv_kernel_dim")
    return GOLDEN_ARGS + (("--conv-state-len", kc - 1) if kc else ())


def goldens(case: FloatCase, qdq: Path, root: Path) -> tuple[Path, Path]:
    """`refimpl golden` of the case's checkpoint: the float golden (once per case) and the quantised golden with the
    QDQ model's quantisers (--encodings MODEL_QDQ.onnx --codes)."""
    checkpoint = case.path.parent / "checkpoint"
    f = case.path.parent / "golden-float"
    if not (f / "manifest.json").is_file():
        assert cli("golden", "--model", checkpoint, *golden_args(checkpoint), "--out", f) == 0
    q = root / f"golden-{qdq.stem}"
    assert cli("golden", "--model", checkpoint, *golden_args(checkpoint), "--encodings", qdq, "--codes", "--out",
               q) == 0
    return f, q


@dataclasses.dataclass
class Diffed:
    exit_code: int
    verdicts: dict              # tap / output name -> "explained" | "excess" | status (error, missing, ...)
    first: str | None           # the first excess beyond quantisation (refimpl's first divergence)
    fault: str | None           # its fault class, if the classifier named one
    excess: dict                # name -> RMS(D - Q) / RMS(Q - F)
    codes: dict                 # name -> share of the device's codes identical to the quantised golden's
    unknown: int                # dump files matching no tensor of the bundle (quantisers at sub-op points)


def diff(float_golden: Path, quantised_golden: Path, qdq: Path, dump: Path, out: Path) -> Diffed:
    """`refimpl diff Q DUMP --float F --encodings MODEL_QDQ.onnx --json`, read back: per tensor the three-way
    verdict, the excess ratio and the codes identical."""
    code = cli("diff", quantised_golden, dump, "--float", float_golden, "--encodings", qdq, "--json", out, "-q")
    report = json.loads(Path(out).read_text())
    verdicts, excess, codes = {}, {}, {}
    key_name = {}
    for r in report["results"]:
        key_name[r["key"]] = r["name"]
        m, ref = r.get("metrics") or {}, r.get("reference") or {}
        verdicts[r["name"]] = {"pass": "explained", "fail": "excess"}.get(r["status"], r["status"])
        if m.get("nmse") is not None and ref.get("nmse"):
            excess[r["name"]] = math.sqrt(m["nmse"] / ref["nmse"])
    from refimpl.bundle import read_bundle
    from refimpl.diff.dump import read_dump
    from refimpl.diff.quantised import compare_three_way, decode_codes, device_names, tap_encodings
    q, f = read_bundle(quantised_golden, verify=False), read_bundle(float_golden, verify=False)
    d = read_dump(dump, q, mapping=device_names(q, qdq))
    decode_codes(d, q, tap_encodings(q, qdq))
    for row in compare_three_way(f, q, d)[1]:
        if row.codes_identical is not None:
            codes[row.name] = row.codes_identical
    first = report["first_divergence"].get("0")
    hit = next((r for r in report["results"] if r["key"] == first), None)
    fault = (hit.get("fault") or {}).get("summary") if hit else None
    return Diffed(code, verdicts, key_name.get(first), fault, excess, codes, len(report["unknown"]))


def tap_of(quantised_golden: Path, qdq: Path, onnx_name: str) -> str | None:
    """The refimpl tap a device graph's tensor (or its QuantizeLinear output) is read as."""
    from refimpl.bundle import read_bundle
    from refimpl.diff.quantised import device_names
    return device_names(read_bundle(quantised_golden, verify=False), qdq).get(onnx_name)


def _attr(n, name, default=None):
    return next((onnx.helper.get_attribute_value(a) for a in n.attribute if a.name == name), default)


def refimpl_op(n, ins):
    """A computing node of the QDQ model, evaluated by refimpl's kernels (None: a node that moves data, whose codes
    are its input's)."""
    from refimpl.kernels import activation, elementary, products
    op = n.op_type
    if op == "MatMul":
        return products.matmul(ins[0], ins[1])
    if op == "Gemm" and _attr(n, "alpha", 1.0) == 1 and _attr(n, "beta", 1.0) == 1 and not _attr(n, "transA", 0):
        y = products.matmul(ins[0], ins[1].T if _attr(n, "transB", 0) else ins[1])   # the router: x W^T
        return y + ins[2] if len(ins) > 2 else y           # the bias after the products (one K block: as MLAS)
    if op in ("Mul", "Add", "Sub", "Div"):
        return {"Mul": np.multiply, "Add": np.add, "Sub": np.subtract, "Div": np.divide}[op](ins[0], ins[1])
    if op == "Neg":
        return -ins[0]
    if op == "Sqrt":
        return np.sqrt(ins[0])
    if op == "Exp":
        return elementary.exp(ins[0])
    if op == "Reciprocal":
        return np.float32(1) / ins[0]
    if op == "Pow" and np.all(ins[1] == 2):
        return ins[0] * ins[0]
    if op in ("ReduceMean", "ReduceSum"):
        (axis,) = ins[1] if len(ins) > 1 else _attr(n, "axes")
        y = products.sum(ins[0], axis=int(axis), keepdims=bool(_attr(n, "keepdims", 1)))
        return y / np.float32(ins[0].shape[int(axis)]) if op == "ReduceMean" else y
    if op == "Softmax":
        return activation.softmax(ins[0], _attr(n, "axis", -1))
    if op == "Sigmoid":
        return elementary.sigmoid(ins[0])
    return None


def htp_op(n, codes, fused: bool = False, constant: bool = False):
    """A computing node of the QDQ model in the HTP's quantised arithmetic where refimpl models it
    (refimpl/kernels/htp_quantised.py): codes, per input, (its codes, (scale, zero point)), or (a constant, None)
    for a plain initializer (ReduceMean's axes), and last the output's (None, (scale, zero point)); its output
    codes, or None where not modelled (or an input is not read, or an encoding is per axis). fused: a Mul of x and
    its own Sigmoid's codes, which the HTP computes as its fused SiLU product; a Concat of a Neg and another tensor
    on the last axis (RoPE's rotate_half), which the HTP computes from the Neg's input (codes[0]: x2's). constant:
    the second input is a constant of the graph (a quantised initializer: Qwen3.5's Div by sqrt(D_k))."""
    from refimpl.kernels import htp_quantised
    if any(c is None for c in codes):
        return None
    codes = [(c[0], tuple(np.reshape(v, ()) for v in c[1])) if c[1] is not None and np.size(c[1][0]) == 1 else c
             for c in codes]                      # a one-element scale (a Gemm's bias): per tensor
    if any(c[1] is not None and np.ndim(c[1][0]) != 0 for c in codes):
        return None
    (q0, e0), out = codes[0], codes[-1][1]
    if n.op_type == "Add" and len(codes) == 3 and codes[1][1] is not None:
        return htp_quantised.add(q0, e0, codes[1][0], codes[1][1], out)
    if n.op_type == "Sub" and len(codes) == 3 and codes[1][1] is not None:
        return htp_quantised.sub(q0, e0, codes[1][0], codes[1][1], out)
    if n.op_type == "Sqrt":
        return htp_quantised.sqrt(q0, e0, out)
    if n.op_type == "Mul" and len(codes) == 3 and codes[1][1] is not None and fused:
        return htp_quantised.silu_product(q0, e0, codes[1][0], codes[1][1], out)   # (reads the sigmoid as 2^16 sigmoid)
    if n.op_type == "Mul" and len(codes) == 3 and codes[1][1] is not None:
        return htp_quantised.mul(q0, e0, codes[1][0], codes[1][1], out)
    if n.op_type == "Div" and len(codes) == 3 and codes[1][1] is not None:
        return htp_quantised.div(q0, e0, codes[1][0], codes[1][1], out, constant=constant)
    if n.op_type == "MatMul" and codes[1][1] is not None and codes[1][0].ndim == 2 \
            and np.asarray(codes[1][0]).dtype == np.uint8:
        return htp_quantised.matmul(q0, e0, codes[1][0], codes[1][1], out)
    if n.op_type == "Gemm" and len(codes) == 4 and codes[1][1] is not None and codes[2][1] is None \
            and np.asarray(codes[1][0]).dtype in (np.uint8, np.int8) and codes[1][0].ndim == 2 \
            and not _attr(n, "transA", 0) and not _attr(n, "transB", 0) and _attr(n, "alpha", 1.0) == 1 \
            and _attr(n, "beta", 1.0) == 1:               # x W + b, b left float (aimet-onnx's in_proj_a + dt_bias)
        return htp_quantised.gemm_float_bias(q0, e0, codes[1][0], codes[1][1], codes[2][0], out)
    if n.op_type == "Gemm" and len(codes) in (3, 4) and codes[1][1] is not None and codes[1][0].ndim == 2 \
            and (np.asarray(codes[1][0]).dtype == np.uint8 or _int4(codes[1][0])) and not _attr(n, "transA", 0) \
            and _attr(n, "alpha", 1.0) == 1 and _attr(n, "beta", 1.0) == 1:   # x W (+ b): the MatMul, its int32 bias
        bias = (codes[2][0], codes[2][1][0]) if len(codes) == 4 and codes[2][1] is not None \
            and np.asarray(codes[2][0]).dtype == np.int32 and not np.any(codes[2][1][1]) else None
        if len(codes) == 4 and bias is None:
            return None
        w = np.asarray(codes[1][0]).astype(np.int64)                # uint8, or int4 per tensor (a W4A16 router)
        return htp_quantised.matmul(q0, e0, w.T if _attr(n, "transB", 0) else w, codes[1][1], out,
                                    bias=bias)
    if n.op_type == "Neg":
        return htp_quantised.neg(q0, e0, out)
    if n.op_type == "Concat" and fused and len(codes) == 3 and _attr(n, "axis") in (-1, np.ndim(q0) - 1):
        return htp_quantised.rotate_half(q0, e0, codes[1][0], codes[1][1], out)
    if n.op_type == "Sigmoid":
        return htp_quantised.sigmoid(q0, e0, out)
    if n.op_type == "Exp" and (np.asarray(q0, np.int64) <= int(e0[1])).all():     # x <= 0: modelled
        return htp_quantised.exp(q0, e0, out)
    if n.op_type == "MatMul" and codes[1][1] is not None and np.asarray(codes[1][0]).dtype == np.uint16 \
            and np.asarray(q0).dtype == np.uint16:                  # the attention's products
        return htp_quantised.matmul16(q0, e0, codes[1][0], codes[1][1], out)
    if n.op_type == "Softmax" and q0.shape[_attr(n, "axis", -1)] > 2:
        return htp_quantised.softmax(q0, e0, out, _attr(n, "axis", -1))
    if n.op_type == "ReduceMean" and len(codes) == 3 and bool(_attr(n, "keepdims", 1)) \
            and np.ravel(codes[1][0]).tolist() in ([-1], [q0.ndim - 1]):
        return htp_quantised.reduce_mean(q0, e0, out)
    if n.op_type == "ReduceSum" and len(codes) == 3 and np.size(codes[1][0]) == 1:
        return htp_quantised.reduce_sum(q0, e0, out, int(np.ravel(codes[1][0])[0]), bool(_attr(n, "keepdims", 1)))
    return None


def _int4(w) -> bool:
    """A stored int4 weight (QNN's W4A16 MoE router, per tensor: the same MatMul, its steps in [-8, 7])."""
    return str(np.asarray(w).dtype) == "int4"


def replayed(qm, values: dict, htp: bool = False) -> list[tuple]:
    """refimpl's kernels on a run's own inputs, quantiser by quantiser (the replay of a quantised device): for each
    QuantizeLinear after a computing node whose inputs the run's codes give (each a DequantizeLinear of a dumped
    quantiser, or a constant), the node computed by refimpl (refimpl_op, ONNX Runtime's CPU arithmetic) on the
    run's dequantised inputs, quantised by the encoding refimpl reads, against the run's codes. values: {name:
    array} of the run (its QuantizeLinear outputs). Rows in graph order: (QuantizeLinear output, op, node name,
    identical share, largest step). htp: the ops refimpl models in the HTP's quantised arithmetic (htp_op) computed so,
    on the run's codes, instead."""
    from refimpl.kernels import products
    producer = {o: n for n in qm.graph.node for o in n.output}
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in qm.graph.initializer}

    def value(t):   # a DequantizeLinear of a dumped quantiser or of an initializer, or a constant
        if t in inits:
            return inits[t]
        d = producer.get(t)
        if d is None or d.op_type != "DequantizeLinear" or (d.input[0] not in values and d.input[0] not in inits):
            return None
        codes = values.get(d.input[0], inits.get(d.input[0]))
        scale, zp = inits[d.input[1]], inits[d.input[2]] if len(d.input) > 2 else np.zeros((), np.int64)
        axis = next((a.i for a in d.attribute if a.name == "axis"), 1)
        if np.size(scale) == 1:          # a one-element scale (Qwen3.5's scalar codes): per tensor
            scale, zp = np.reshape(scale, ()), np.reshape(zp, ())
        if np.ndim(scale):
            shape = [1] * codes.ndim
            shape[axis] = -1
            scale, zp = scale.reshape(shape), zp.reshape(shape)
        return ((codes.astype(np.int64) - zp.astype(np.int64)).astype(np.float32) * scale).astype(np.float32)
    def codes(t):   # (codes, (scale, zero point)) of a DequantizeLinear's input, dumped or stored; a constant
        if t in inits:
            return inits[t], None
        d = producer.get(t)
        if d is None or d.op_type != "DequantizeLinear" or (d.input[0] not in values and d.input[0] not in inits):
            return None
        zp = inits[d.input[2]] if len(d.input) > 2 else np.zeros((), np.int64)
        return values.get(d.input[0], inits.get(d.input[0])), (inits[d.input[1]], zp)
    def silu(n):    # a Mul of a tensor and its own Sigmoid's codes, x * sigmoid(x): the HTP fuses it
        def quantiser(t):   # the QuantizeLinear output a DequantizeLinear reads
            d = producer.get(t)
            return d.input[0] if d is not None and d.op_type == "DequantizeLinear" else None
        if n.op_type != "Mul" or len(n.input) != 2:
            return False
        q = producer.get(quantiser(n.input[1]) or "")
        s = producer.get(q.input[0]) if q is not None else None
        return s is not None and s.op_type == "Sigmoid" and quantiser(s.input[0]) == quantiser(n.input[0]) is not None
    def negated(n):  # a Concat of a Neg (rotate_half's [-x2 | x1]): the Neg's input, which the HTP reads instead
        chain = behind(producer, n.input[0], ("DequantizeLinear", "QuantizeLinear", "Neg")) \
            if n.op_type == "Concat" and len(n.input) == 2 else None
        return chain[2].input[0] if chain is not None else None

    def sigmoid_codes(t):   # a DequantizeLinear of a Sigmoid's own quantiser (DEVICE_SIGMOID_CODES)
        return behind(producer, t, ("DequantizeLinear", "QuantizeLinear", "Sigmoid")) is not None
    from refimpl.kernels.htp_quantised import SILU_SIGMOID as htp_sigmoid

    rows = []
    with products.onnxruntime_cpu():
        for q in qm.graph.node:
            if q.op_type != "QuantizeLinear" or q.output[0] not in values or q.input[0] not in producer:
                continue
            n = producer[q.input[0]]
            ins = [value(i) for i in n.input if i]
            if any(x is None for x in ins):
                continue
            want = values[q.output[0]]
            x2 = negated(n) if htp else None
            names = [i for i in ([x2, n.input[1]] if x2 else n.input) if i]
            read = [codes(i) for i in names]
            if htp:          # a Sigmoid's codes are sigmoid(x) 2^16 whatever its encoding: its consumers read them so
                read = [(r[0], htp_sigmoid) if r is not None and r[1] is not None and sigmoid_codes(i) else r
                        for r, i in zip(read, names)]
            d1 = producer.get(n.input[1]) if len(n.input) > 1 else None
            constant = d1 is not None and d1.op_type == "DequantizeLinear" and d1.input[0] in inits
            mine = htp_op(n, read + [(None, (inits[q.input[1]], inits[q.input[2]]))],
                          fused=silu(n) or x2 is not None, constant=constant) if htp else None
            if mine is not None:
                share, step = codes_agreement(np.broadcast_to(mine, want.shape), want)
                rows.append((q.output[0], n.op_type, n.name, share, step))
                continue
            y = refimpl_op(n, ins)
            if y is None:
                continue
            share, step = codes_agreement(quantised_as(q, inits, y, want).reshape(want.shape), want)
            rows.append((q.output[0], n.op_type, n.name, share, step))
    return rows


def fault_models(qm, qm4) -> dict:
    """name -> (the honest QDQ model, its faulty copy, the QuantizeLinear output where the fault first shows): a
    planted wrong per-channel weight scale (one output channel of the first projection x1.02, on W4A16's per-channel
    int4 weights: the HTP takes no asymmetric per-channel uint8 weight), an activation offset off by one step (the
    second residual add's zero point + 1) and a saturating residual add (the first one's range halved)."""
    weights = weight_dequantizers(qm4)
    proj = next(w for w, n in weights.items() if any(c.op_type == "MatMul" and n.output[0] in c.input
                                                     for c in qm4.graph.node))
    matmul = next(c for c in qm4.graph.node if weights[proj].output[0] in c.input)
    residual, later = residual_adds(qm)[:2]   # a tensor whose consumers compute (RMSNorm, the next residual
    # add): the HTP requires a data-movement op's (Gather, Reshape) output encoding to be its input's
    return {"wrong per-channel weight scale": (qm4, wrong_channel_scale(qm4, proj, 3, 1.02),
                                               activation_quantizer(qm4, matmul.output[0]).output[0]),
            "activation offset off by one": (qm, offset_off_by_one(qm, later),
                                             activation_quantizer(qm, later).output[0]),
            "saturating residual add": (qm, saturating_residual(qm, residual, 0.5),
                                        activation_quantizer(qm, residual).output[0])}


def device_dumps(case: FloatCase, qm, directory: Path, devices=("cpu", "htp"), dequantised: bool = False) -> dict:
    """The QDQ model run on ONNX Runtime's CPU EP and the HTP simulator, every quantiser's codes a graph output,
    each run dumped (write_dump): {device: its dump directory}."""
    taps = quantiser_taps(qm)
    b = with_outputs(qm, taps)
    sessions = {"cpu": cpu_session, "htp": lambda x: htp_session(x, optimize=False)}
    return {d: write_dump(qm, run(sessions[d](b), case.feed), directory / d, dequantised) for d in devices}


def cache_feeds(case: FloatCase) -> list[dict]:
    """Calibration feeds of calls that read a filled KV cache: each CALIBRATION prompt as a 4-token chunk, a 4-token
    chunk reading it and 2 decode calls of the same AR graph fed one token (the float graph on the CPU EP, the host
    carrying its KV outputs). The prompt calls alone (case.feeds) calibrate the cache inputs on empty caches: an
    encoding of [0, 1e-4] that zeroes every cached entry (docs/htp.md section 9)."""
    session, feeds = case.float_session(), []

    def graph(inputs, k):
        feeds.append(dict(inputs))
        values = run(session, inputs)
        return {o: values[o] for o in case.outs}, {}
    for tokens in CALIBRATION:
        D.run_genie(graph, case.model.config, [("prompt", tokens[:4]), ("prompt", tokens[4:]), ("token", tokens[:1]),
                                               ("token", tokens[1:2])], dict(GENIE, decode_ar=GENIE["ar"]))
    return feeds


def genie_dumps(case: FloatCase, qm, golden: Path, directory: Path, device: str = "htp") -> Path:
    """The QDQ model run on one device for every call of a genie golden (`refimpl golden ... --decode-ar AR` of the
    graph's AR: a prompt of several chunks, decode calls fed one token in the same graph), in order, the host
    carrying each call's KV outputs into the next call's cache window (devices.run_genie); each call's quantisers
    dumped under directory/<k>/ (write_dump), the layout `refimpl diff` reads as step k."""
    manifest = json.loads((golden / "manifest.json").read_text())
    session = {"cpu": cpu_session, "htp": lambda x: htp_session(x, optimize=False)}[device](
        with_outputs(qm, quantiser_taps(qm)))
    outs = D.genie_names(case.model.config)[1]

    def graph(inputs, k):
        values = run(session, inputs)
        write_dump(qm, values, directory / str(k))
        return {o: values[o] for o in outs}, {}
    D.run_genie(graph, case.model.config, [(s["graph"], s["tokens"]) for s in manifest["steps"]],
                manifest["convention"]["params"])
    return directory


def diff_matrix(archs, mixes, root: Path, faults: bool = True) -> None:
    """`python tests/e2e/quantised.py diff [ARCH,...] [MIX,...] [DIR]`: the table of docs/htp.md §9 (refimpl's
    diff of quantised runs): per model x mix (QNN QDQ config), each device's honest run and the planted faults
    judged by `refimpl diff Q DUMP --float F --encodings MODEL_QDQ.onnx` (integer codes dumped; the saturating
    residual add's run as floats, dequantised with its own encodings: read with the file's, its codes would be a
    wrong scale)."""
    for arch in archs:
        case = float_case(arch, root / arch)
        models = {mix: quantise_qdq(case, mix, root / arch / f"qdq_{mix}.onnx") for mix in MIXES}
        for mix in mixes:
            qdq = root / arch / f"qdq_{mix}.onnx"
            f, q = goldens(case, qdq, root / arch)
            placed = json.loads((q / "manifest.json").read_text())["quantisation"]
            runs = [("QNN QDQ", qdq, f, q, placed, models[mix])]
            if aimet_unavailable() is None:   # aimet-onnx's QuantSim of the same float graph, as a QDQ model
                qdq_a = root / arch / f"aimet_qdq_{mix}.onnx"
                keep_scopes(onnx.load(case.path), quantise_aimet(case, mix, root / arch / f"aimet_{mix}").qdq, qdq_a)
                f_a, q_a = goldens(case, qdq_a, root / arch)
                runs.append(("aimet-onnx", qdq_a, f_a, q_a, json.loads((q_a / "manifest.json").read_text())[
                    "quantisation"], onnx.load(qdq_a)))
            for tool, path, fg, qg, record, model in runs:
                for device, dump in device_dumps(case, model, root / arch / f"dump_{path.stem}").items():
                    d = diff(fg, qg, path, dump, root / arch / f"diff_{path.stem}_{device}.json")
                    explained = sum(v == "explained" for v in d.verdicts.values())
                    identical = sum(c == 1.0 for c in d.codes.values())
                    worst = max(d.excess.items(), key=lambda kv: kv[1], default=None)
                    print(f"{arch} {mix} {tool} {device}: placed {record['placed']}/{record['total']}; explained "
                          f"{explained} of {len(d.verdicts)}; codes identical at {identical} of {len(d.codes)} taps; "
                          f"first excess {d.first} (excess {d.excess.get(d.first, float('nan')):.3g}); worst {worst}; "
                          f"unknown {d.unknown}", flush=True)
            if not faults:
                continue
            for name, (honest, faulty, tap) in fault_models(models["w8a16"], models["w4a16"]).items():
                hmix = "w4a16" if honest is models["w4a16"] else "w8a16"
                if hmix != mix:
                    continue
                want = tap_of(q, qdq, tap)
                floats = name == "saturating residual add"   # its values as the device dequantises them
                for device, dump in device_dumps(case, faulty, root / arch / f"dump_{mix}_{name[:12]}",
                                                 dequantised=floats).items():
                    d = diff(f, q, qdq, dump, root / arch / f"diff_{mix}_{name[:12]}_{device}.json")
                    print(f"{arch} {mix} {device} fault {name!r} at {want}: first excess {d.first} (fault "
                          f"{d.fault}); excess at the tap {d.excess.get(want, float('nan')):.3g}, "
                          f"{d.verdicts.get(want)}", flush=True)


def main(argv=None) -> None:
    """`python tests/e2e/quantised.py [ARCH,...] [MIX,...] [DIR]`: the device-side table of docs/htp.md §9 (QNN QDQ
    and aimet-onnx per model x mix: HTP and CPU EP logits, codes, the first quantiser where they part)."""
    import sys
    import tempfile
    args = (argv if argv is not None else sys.argv[1:]) + [None] * 4
    if args[0] == "diff":
        root = Path(args[3] or tempfile.mkdtemp(prefix="quantised-diff-"))
        return diff_matrix((args[1] or "dense,moe").split(","), (args[2] or ",".join(MIXES)).split(","), root)
    archs = (args[0] or ",".join(ARCHITECTURES)).split(",")
    mixes = (args[1] or ",".join(MIXES)).split(",")
    root = Path(args[2] or tempfile.mkdtemp(prefix="quantised-htp-"))
    for arch in archs:
        case = float_case(arch, root / arch)
        for mix in mixes:
            for tool in ("qdq", "aimet"):
                qm = quantise_qdq(case, mix) if tool == "qdq" else quantise_aimet(case, mix).qdq
                try:
                    m = measure(case, qm)[0]
                except Exception as e:   # a graph the HTP does not compile
                    print(f"{arch} {mix} {tool}: {str(e).splitlines()[0][:200]}", flush=True)
                    continue
                print(f"{arch} {mix} {tool}: quantisers {m.quantisers}; CPU EP vs float {m.cpu_vs_float[0]:.1f} dB "
                      f"top-1 {m.cpu_vs_float[1]:.2f}; HTP vs CPU EP {m.htp_vs_cpu[0]:.1f} dB top-1 "
                      f"{m.htp_vs_cpu[1]:.2f}; codes identical at {m.codes_all_identical}; first departure "
                      f"{m.first_any}; first collapse {m.first_collapse}", flush=True)


if __name__ == "__main__":   # the script's directory is on sys.path (devices, htp); PYTHONPATH the worktree
    main()


def codes_against(record: dict, tensors: dict, qm, peer: dict) -> dict:
    """refimpl's values at the device's quantisers, as codes, against a peer's codes. record: {refimpl node or
    node/point: the float value its first quantiser received} (refimpl's `model.quantisers.record` after a forward);
    tensors: {ONNX tensor name: [refimpl node / point names]} (the placement's `tensors`); peer: {QuantizeLinear
    output: codes} (this module's runs). Returns {ONNX tensor: (identical share, max step)} where refimpl's value
    has the peer's elements in the peer's order (the same shape up to leading 1s, or a transpose of the last two
    axes, or of the two before the last: heads and tokens; adjacent axes merged, e.g. refimpl's [kv heads, group]
    as the device's heads); {ONNX tensor: reason} where not (another layout, refimpl's real slots only, ...)."""
    params = quant_params(qm)
    quantizer = {n.input[0]: n.output[0] for n in qm.graph.node if n.op_type == "QuantizeLinear"}
    out = {}
    for tensor, wheres in tensors.items():
        q = quantizer.get(tensor)
        if q is None or q not in peer or not wheres or wheres[0] not in record:
            out[tensor] = "not tapped" if q is not None and q not in peer else "no recorded value"
            continue
        have, mine = np.asarray(peer[q]), np.asarray(record[wheres[0]], np.float32)
        scale, zp = params[q]
        match = in_layout(mine, have.shape)                                   # [B, T, heads, d] / [B, heads, T, d]
        if match is None:
            out[tensor] = f"layout: refimpl {list(mine.shape)}, device {list(have.shape)}"
            continue
        if np.ndim(scale) != 0:
            out[tensor] = "per-axis activation encoding"
            continue
        out[tensor] = codes_agreement(codes_of(match, scale, zp, have.dtype), have)
    return out


def in_layout(mine: np.ndarray, shape: tuple) -> np.ndarray | None:
    """refimpl's value with a peer's elements in the peer's `shape` (the same up to leading 1s, a transpose of the
    last two axes or of the two before the last, adjacent axes merged), or None."""
    candidates = [mine] + ([np.swapaxes(mine, -1, -2)] if mine.ndim >= 2 else []) + \
        ([np.swapaxes(mine, -2, -3)] if mine.ndim >= 3 else [])
    return next((c.reshape(shape) for c in candidates if c.size == math.prod(shape) and _coarsens(shape, c.shape)),
                None)


def codes_against_quantsim(record: dict, tensors: dict, encodings: dict, peer: dict) -> dict:
    """codes_against for aimet-onnx's QuantSim: refimpl's values at its quantisers as codes of the encoding refimpl
    read for the tensor (its exported encodings: aimet-onnx's arithmetic), against QuantSim's codes (its
    quantised-dequantised values, quantsim_values, mapped back to codes by the same encoding: (q + offset) * s in
    float32 is within 0.01 of a code). {ONNX tensor: (identical share, max step) or the reason not compared}."""
    out = {}
    for tensor, wheres in tensors.items():
        if tensor not in peer or not wheres or wheres[0] not in record:
            out[tensor] = "no QuantSim value" if tensor not in peer else "no recorded value"
            continue
        enc, have = encodings[tensor], np.asarray(peer[tensor], np.float32)
        mine = np.asarray(record[wheres[0]], np.float32)
        match = in_layout(mine, have.shape)
        if match is None:
            out[tensor] = f"layout: refimpl {list(mine.shape)}, QuantSim {list(have.shape)}"
            continue
        if enc.float_dtype is not None or np.ndim(enc.scale) != 0:
            out[tensor] = "float or per-axis activation encoding"
            continue
        theirs = np.rint(have.astype(np.float64) / np.float64(enc.scale)) - np.asarray(enc.offset, np.int64)
        out[tensor] = codes_agreement(enc.codes(match), theirs)
    return out


def _coarsens(shape, finer) -> bool:
    """`shape` is `finer` with adjacent axes merged (1s aside): the same elements in the same order."""
    ends = set(np.cumprod([d for d in finer if d != 1]).tolist())
    mine = np.cumprod([d for d in shape if d != 1]).tolist()
    return math.prod(shape) == math.prod(finer) and all(e in ends for e in mine)
