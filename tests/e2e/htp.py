"""Qualcomm's HTP as a device of the end-to-end tests: libQnnHtp.so, the Hexagon NPU backend of QNN, runs on this
CPU as Qualcomm's simulator (the PyPI wheel onnxruntime-qnn, QNN SDK 2.51) through ONNX Runtime's plugin-EP API,
with the NPU's own fp16 arithmetic and graph compiler. docs/htp.md is the walkthrough.

The graphs are transformers' models in float16 behind the genie convention's static I/O (`GenieGraph` of
tests/e2e/devices.py: the prompt call is the prefill, KV windows / conv and recurrent state in and out), exported
with torch.onnx.export with the hooked taps as extra graph outputs (so a tap is named as its hook,
`model.layers.0.self_attn.q_norm`), compiled for the HTP with the CPU fallback disabled: every node runs on the HTP
or the session fails.

Where the HTP compiler rejects an op or mis-compiles it, the exported graph is rewritten to the same real function
(`HTP_REWRITES`; the facts are docs/htp.md's):
  - ScatterElements (an in-place write `out[:, :, i] = ...` exports as one) is rejected: transformers' gated delta
    rules write their outputs so. They are replaced by transformers' own recurrent rule, op for op, with the
    per-token outputs stacked instead of written into a zeros buffer (`recurrent_gated_delta_rule`); the chunked
    prompt form is the same maths (spec gated_deltanet.md §3.2) and is replaced by it too.
  - GatherND (transformers' expert-weight gather in the batched_mm experts) returns wrong expert rows: replaced by
    Gather on axis 0 with the index column (`gathernd_as_gather`), the same selection.
  - transformers' own forward (the hf form: causal mask and RoPE tables built in the graph) needs no rewrite of its
    own once optimized (tests/e2e/htp_hf.py; a segmentation fault reported for it earlier did not reproduce); its
    RoPE tables are then the HTP's Cos / Sin kernels', not correctly rounded (docs/htp.md sections 4 and 8).
  - The RMSNorm chain Pow -> ReduceMean -> Add -> Sqrt -> Reciprocal -> Mul -> Mul is fused by the compiler into
    its RmsNorm kernel: `unfused_rms_norm` writes x^2 as Mul(x, x) (the same value: both are one correctly rounded
    product), which the fusion does not match.
"""

import contextlib
import sys
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
import devices as D  # noqa: E402  (after the skips: it imports torch)

QNN_OPTIONS = {"backend_type": "htp", "soc_model": "60", "htp_arch": "75", "enable_htp_fp16_precision": "1"}
GDN_RULES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


def unavailable() -> str | None:
    """Why the HTP simulator cannot run here (None: it can)."""
    try:
        import onnxruntime_qnn
    except ImportError as e:
        return f"onnxruntime-qnn is not installed ({e}); `make test` installs it"
    try:
        if not any(d.ep_name == "QNNExecutionProvider" for d in ort.get_ep_devices()):
            ort.register_execution_provider_library("QNNExecutionProvider", onnxruntime_qnn.get_library_path())
        if not any(d.ep_name == "QNNExecutionProvider" for d in ort.get_ep_devices()):
            return "onnxruntime-qnn loaded but offers no QNNExecutionProvider device"
    except Exception as e:  # the wheel's library failing to load on this platform
        return f"the QNN HTP library cannot load here: {e}"
    return None


def session(model_bytes: bytes):
    """An ONNX Runtime session on the HTP: fp16 arithmetic, no CPU fallback (an unsupported node is an error)."""
    why = unavailable()   # registers the plugin EP once
    assert why is None, why
    devices = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_provider_for_devices(devices, QNN_OPTIONS)
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    return ort.InferenceSession(model_bytes, options)


# ------------------------------------------------------------------------------------------------ torch-level rewrites

def recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers 5.23's torch_recurrent_gated_delta_rule op for op (its casts, its order), the per-token outputs
    stacked rather than written into a zeros buffer (an index write exports as ScatterElements, which the HTP
    rejects). Serves the chunked prompt form too: the same function of the inputs (spec gated_deltanet.md §3.2)."""
    initial_dtype = query.dtype
    B, T, Hk, Dk = key.shape
    Hv, Dv = value.shape[-2:]
    if Hk != Hv:
        query = query.repeat_interleave(Hv // Hk, dim=2)
        key = key.repeat_interleave(Hv // Hk, dim=2)
    query, key, value, beta, decay = [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                                      for x in (query, key, value, beta, g)]
    if use_qk_l2norm_in_kernel:
        query = query * torch.rsqrt((query * query).sum(dim=-1, keepdim=True) + 1e-6)
        key = key * torch.rsqrt((key * key).sum(dim=-1, keepdim=True) + 1e-6)
    query = query / (query.shape[-1] ** 0.5)
    S = torch.zeros((B, Hv, Dk, Dv), dtype=value.dtype) if initial_state is None else initial_state.to(value)
    out = []
    for i in range(T):
        q_t, k_t, v_t = query[:, :, i], key[:, :, i], value[:, :, i]
        S = S * decay[:, :, i].exp()[..., None, None]                     # S <- exp(g_t) S
        kv_mem = (S * k_t.unsqueeze(-1)).sum(dim=-2)                      # S^T k_t
        delta = (v_t - kv_mem) * beta[:, :, i].unsqueeze(-1)              # beta_t (v_t - S^T k_t)
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)                   # S <- S + k_t delta^T
        out.append((S * q_t.unsqueeze(-1)).sum(dim=-2))                   # o_t = S^T q_t
    core = torch.stack(out, dim=2).transpose(1, 2).contiguous().to(initial_dtype)
    return core, (S if output_final_state else None)


@contextlib.contextmanager
def htp_functions(model):
    """transformers' gated delta rules replaced by `recurrent_gated_delta_rule` (entered before the Recorder, so its
    hooks keep the names a bring-up engineer hooks)."""
    modeling = sys.modules[type(model).__module__]
    with contextlib.ExitStack() as stack:
        for name in GDN_RULES:
            if hasattr(modeling, name):
                stack.enter_context(mock.patch.object(modeling, name, recurrent_gated_delta_rule))
        yield


# ------------------------------------------------------------------------------------------------ graph rewrites

def gathernd_as_gather(m) -> int:
    """GatherND(data, idx[..., 1]) with batch_dims 0 -> Gather(data, Squeeze(idx, -1), axis 0): the same rows."""
    helper, n = onnx.helper, 0
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in m.graph.value_info}
    nodes = []
    for node in m.graph.node:
        batch_dims = next((a.i for a in node.attribute if a.name == "batch_dims"), 0)
        if node.op_type == "GatherND" and batch_dims == 0 and shapes.get(node.input[1], [0])[-1:] == [1]:
            data, idx = node.input
            axes = f"{node.name}_last_axis"
            m.graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1], np.int64), axes))
            rows = f"{node.name}_rows"
            nodes += [helper.make_node("Squeeze", [idx, axes], [rows], name=f"{node.name}_squeeze"),
                      helper.make_node("Gather", [data, rows], list(node.output), name=node.name, axis=0)]
            n += 1
        else:
            nodes.append(node)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return n


def unfused_rms_norm(m) -> int:
    """Pow(x, 2) -> Mul(x, x) where it starts an RMSNorm chain (Pow feeding ReduceMean): one correctly rounded
    product either way; the HTP compiler's RmsNorm fusion matches Pow only."""
    consumers = {}
    for node in m.graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    n = 0
    for node in m.graph.node:
        if node.op_type == "Pow" and all(c.op_type == "ReduceMean" for c in consumers.get(node.output[0], [])):
            node.op_type = "Mul"
            node.input[1] = node.input[0]
            n += 1
    return n


def composed_gates(m) -> int:
    """Softplus -> Log(1 + Exp(x)), and a Sigmoid outside a SiLU (x * sigmoid(x)) -> Reciprocal(1 + Exp(-x)): the
    same functions, from ops the HTP computes within an ulp or two; its own Softplus and Sigmoid kernels are up to
    132 and 727 ulp off (docs/htp.md)."""
    helper, n = onnx.helper, 0
    consumers = {}
    for node in m.graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    nodes = []
    for node in m.graph.node:
        x, y, t = node.input[0] if node.input else None, node.output[0], node.name or node.output[0]
        silu = node.op_type == "Sigmoid" and any(c.op_type == "Mul" and x in c.input for c in consumers.get(y, []))
        if node.op_type not in ("Softplus", "Sigmoid") or silu:
            nodes.append(node)
            continue
        one = f"{t}_one"
        m.graph.initializer.append(onnx.numpy_helper.from_array(np.array(1, _elem_dtype(m, x)), one))
        if node.op_type == "Softplus":
            nodes += [helper.make_node("Exp", [x], [f"{t}_exp"]),
                      helper.make_node("Add", [f"{t}_exp", one], [f"{t}_1p"]),
                      helper.make_node("Log", [f"{t}_1p"], [y])]
        else:
            nodes += [helper.make_node("Neg", [x], [f"{t}_neg"]), helper.make_node("Exp", [f"{t}_neg"], [f"{t}_exp"]),
                      helper.make_node("Add", [f"{t}_exp", one], [f"{t}_1p"]),
                      helper.make_node("Reciprocal", [f"{t}_1p"], [y])]
        n += 1
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return n


def _elem_dtype(m, name):
    """The numpy dtype of tensor `name` (float16 unless shape inference says float32)."""
    typed = {v.name: v.type.tensor_type.elem_type for v in (*m.graph.value_info, *m.graph.input, *m.graph.output)}
    return np.float32 if typed.get(name) == onnx.TensorProto.FLOAT else np.float16


HTP_REWRITES = {"rms_norm": unfused_rms_norm, "gathernd": gathernd_as_gather, "gates": composed_gates}


def plant(m, raw, fault: D.Fault) -> None:
    """A fault's weight parts planted in the optimized graph `m`. The parameter is found by its checkpoint name in
    the raw export `raw` (under the wrapper's prefix); the optimizer folds a projection's Transpose into a new
    initializer (`val_N`), so the planted one is the optimized initializer holding the parameter's values, as they
    are or transposed (exactly one may: an ambiguous match is an error, never a guess)."""
    raw_by_name = {i.name: i for i in raw.graph.initializer}
    by_name = {i.name: i for i in m.graph.initializer}

    def change(param, fn):
        name = next((n for n in raw_by_name if n == param or n.endswith("." + param)), None)
        assert name is not None, f"no initializer holds {param}"
        w = onnx.numpy_helper.to_array(raw_by_name[name])
        assert sum(np.array_equal(onnx.numpy_helper.to_array(i), w) for i in raw.graph.initializer) == 1, \
            f"{param}'s values are not unique in the export"
        hits = []
        for n, init in by_name.items():
            a = onnx.numpy_helper.to_array(init)
            if a.shape == w.shape and np.array_equal(a, w):
                hits.append((n, False))
            elif w.ndim == 2 and a.shape == w.T.shape and np.array_equal(a, w.T):
                hits.append((n, True))
        if not hits:   # folded into a constant by the optimizer (A_log -> -exp(A_log)): plant before it
            raise LookupError(param)
        assert len(hits) == 1, f"{param}: {len(hits)} optimized initializers hold its values"
        n, transposed = hits[0]
        changed = fn(w.copy()).astype(w.dtype)
        by_name[n].CopyFrom(onnx.numpy_helper.from_array(changed.T.copy() if transposed else changed, n))
    if fault.scale_weight:
        param, factor = fault.scale_weight
        change(param, lambda a: a * np.float32(factor))
    if fault.scale_channel:
        param, row, factor = fault.scale_channel
        change(param, lambda a: np.concatenate([a[:row], a[row:row + 1] * np.float32(factor), a[row + 1:]]))
    if fault.shift_weight:
        param, delta = fault.shift_weight
        change(param, lambda a: a + np.float32(delta))
    if fault.swap_rows:
        param, i, j = fault.swap_rows
        change(param, lambda a: a[[j if r == i else i if r == j else r for r in range(len(a))]])


def weight_key(fault: D.Fault | None) -> tuple:
    """The parts of a fault that change the graph (host faults run the honest graph)."""
    fault = fault or D.Fault()
    return fault.scale_weight, fault.scale_channel, fault.swap_rows, fault.shift_weight


_OPTIMIZED = {}  # raw export -> (raw model, optimized + shape-inferred model): optimized once per export
_COMPILED = {}   # (raw export, skipped rewrites, weight fault) -> the graph given to the HTP
_SESSIONS = {}   # the same key -> its HTP session (host faults and re-runs reuse the honest graph's compile)


def optimized(path: Path):
    """The raw export (torch.onnx.export without its optimizer, so the initializers keep the checkpoint's names) and
    its optimization as torch.onnx.export(optimize=True) does it (onnxscript's optimizer), shape-inferred."""
    import onnxscript.optimizer
    if str(path) not in _OPTIMIZED:
        raw = onnx.load(str(path))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = onnxscript.optimizer.optimize(onnx.load(str(path)))
        _OPTIMIZED[str(path)] = raw, onnx.shape_inference.infer_shapes(m)
    return _OPTIMIZED[str(path)]


def rewrite(path: Path, skip=(), fault: D.Fault | None = None) -> bytes:
    """The optimized export with the fault's weights planted (after the optimizer: one optimization per export; a
    parameter the optimizer folds into a constant is planted before it), then HTP_REWRITES applied (but those named
    in `skip`: to reproduce a compiler bug)."""
    key = (str(path), tuple(skip), weight_key(fault))
    if key not in _COMPILED:
        raw, honest = optimized(path)
        m = onnx.ModelProto()
        m.CopyFrom(honest)
        try:
            plant(m, raw, fault or D.Fault())
        except LookupError:   # a parameter the optimizer folds away: planted in the raw export, then optimized
            import onnxscript.optimizer
            m = onnx.ModelProto()
            m.CopyFrom(raw)
            plant(m, raw, fault)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m = onnx.shape_inference.infer_shapes(onnxscript.optimizer.optimize(m))
        for name, fn in HTP_REWRITES.items():
            if name not in skip:
                fn(m)
        _COMPILED[key] = m.SerializeToString()
    return _COMPILED[key]


def compiled_session(path: Path, skip=(), fault: D.Fault | None = None):
    """The HTP session of `rewrite(path, skip, fault)`, compiled once per graph for the test session."""
    key = (str(path), tuple(skip), weight_key(fault))
    if key not in _SESSIONS:
        _SESSIONS[key] = session(rewrite(path, skip, fault))
    return _SESSIONS[key]


# ------------------------------------------------------------------------------------------------ devices

def _export(wrapped, args, names_in, names_out, f: Path):
    with warnings.catch_warnings():  # torch's own pytree deprecation, nothing of ours
        warnings.simplefilter("ignore", FutureWarning)
        torch.onnx.export(wrapped, args, f, input_names=names_in, output_names=names_out, dynamo=True,
                          external_data=False, optimize=False, verbose=False)


def run_graph(compiled, ins: list, outs: list):
    """The host's graph(inputs, step) -> (outputs, taps) of an fp16 HTP graph: compiled(inputs) -> (session, tap
    names) for that call's shape; float32 inputs fed as float16, float16 results returned as float32."""
    def graph(inputs, step):
        sess, tap_names = compiled(inputs)
        feed = {n: (inputs[n].astype(np.float16) if inputs[n].dtype == np.float32 else inputs[n]) for n in ins}
        named = dict(zip(outs + tap_names, sess.run(None, feed)))
        as32 = {n: (a.astype(np.float32) if a.dtype == np.float16 else a) for n, a in named.items()}
        return {n: as32[n] for n in outs}, {n: as32[n] for n in tap_names}
    return graph


def htp_genie_graph(model, cfg, params: dict, path: Path, fault: D.Fault | None = None, skip=(), exports=None):
    """graph(inputs, step) -> (outputs, taps): GenieGraph exported in float16 and run on the HTP. One honest export
    per call shape (prompt AR, token AR); `exports` (a dict) caches the ONNX files across graphs of the same model
    (keyed by AR). The fault's weights are planted in the graph (`plant`), its host parts are run_genie's."""
    fault = fault or D.Fault()
    ins, outs = D.genie_names(cfg)
    exports = {} if exports is None else exports
    sessions = {}

    def compiled(inputs):
        ar = inputs["input_ids"].shape[1]
        if ar not in exports:
            with torch.no_grad(), htp_functions(model), D.Recorder(model) as rec:
                wrapped = D.WithTaps(D.GenieGraph(model, params.get("key_transposed", True)), rec).eval()
                args = tuple(D.torch_arg(inputs[n], torch.float16) for n in ins)
                wrapped(*args)                                           # learn the tap names
                f = path / f"htp_genie_ar{ar}.onnx"
                _export(wrapped, args, ins, outs + wrapped.tap_names, f)
            exports[ar] = (f, wrapped.tap_names)
        if ar not in sessions:
            f, tap_names = exports[ar]
            sessions[ar] = (compiled_session(f, skip, fault), tap_names)
        return sessions[ar]

    return run_graph(compiled, ins, outs)
