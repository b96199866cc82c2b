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

Planted faults, as edits of the QDQ device graph (each returns a new model): `wrong_channel_scale` (one channel of
a weight's per-channel DequantizeLinear scale x1.02), `offset_off_by_one` (an activation's zero point + 1: every
value one step off), `saturating_residual` (a residual add's output scale shrunk so the add clips).
"""

import dataclasses
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
PROMPT = [97, 11, 1879, 13, 42, 7, 99]                 # the measured prompt (test_htp's): 7 real slots of AR = 8
CALIBRATION = ([5, 300, 1200, 64, 8, 777, 31, 1500], [1, 2, 3, 4, 5, 6, 7], [2000, 17, 450, 900, 33, 1024],
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
    GatherND as Gather, composed Softplus / Sigmoid; the gated delta rule as its recurrent form), and for the
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
    _, m = H.optimized(raw)
    m2 = onnx.ModelProto()
    m2.CopyFrom(m)
    for fn in H.HTP_REWRITES.values():
        fn(m2)
    for name, fn in QUANTISED_REWRITES.items():
        if name not in skip:
            fn(m2)
    path = root / ("float.onnx" if not skip else f"float-skip-{'-'.join(skip)}.onnx")
    onnx.save(onnx.shape_inference.infer_shapes(m2), path)
    feeds = [genie_feed(cfg, t)[0] for t in CALIBRATION]
    return FloatCase(arch, config, arrays, model, path, ins, outs, feeds, feed, real)


def reciprocal_as_div(m) -> int:
    """Reciprocal(x) -> Div(1, x): the same function. The HTP's quantised (uint16) Reciprocal is wrong when its
    input's encoding range ends below 1: measured, its result is max(range) / x instead of 1 / x (RMSNorm's
    1 / sqrt(mean(x^2) + eps) of small activations: every code off); Div(1, x) is within ~50 codes of 65535."""
    n = 0
    for node in m.graph.node:
        if node.op_type == "Reciprocal":
            one = f"{node.name or node.output[0]}_one"
            m.graph.initializer.append(onnx.numpy_helper.from_array(np.array(1, H._elem_dtype(m, node.input[0])),
                                                                    one))
            node.op_type = "Div"
            node.input[:] = [one, node.input[0]]
            n += 1
    return n


QUANTISED_REWRITES = {"reciprocal": reciprocal_as_div}


# ------------------------------------------------------------------------------------------------ sessions

def cpu_session(model_bytes: bytes):
    options = ort.SessionOptions()
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
    out = out or case.path.with_name(f"qdq_{mix}.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize(m, out, config)
    return onnx.load(out)


def quantiser_taps(m) -> list[str]:
    """The output (codes) of every QuantizeLinear in graph order: each quantiser of an activation. Weights are
    stored quantised (initializer -> DequantizeLinear) and are compared by their initializers."""
    return [n.output[0] for n in m.graph.node if n.op_type == "QuantizeLinear"]


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
