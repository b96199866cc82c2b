"""The base files and ONNX edits of the fuzzed formats of issue 27 (onnx_quantisers.py): aimet-onnx encodings (the 1.0.0
JSON and the ONNX model beside it) and QDQ ONNX models. The base files are built here with onnx.helper (no torch / aimet
needed), laid out as aimet-onnx 2.42 and onnxruntime.quantization write them (tests/test_onnx_quantisers.py reads the
real ones): every quantised type, per tensor / per axis / blocked, a weight transposed in the graph (a tied lm_head),
Gemm and Conv weights, LPBQ and float entries.

Besides the byte, JSON and file-system ops of mutate.py, a case may edit the ONNX model structurally:
    ["onnx", file, edit]   edit: ["init", name, kind] | ["attr", node, name, value] | ["input", node, slot, name] |
                           ["optype", node, op] | ["drop", node] | ["domain", node, domain] | ["output", name] |
                           ["dup", node] | ["rank", tensor, rank]
"""

import random
from pathlib import Path

import numpy as np

INIT_KINDS = ("neg", "nan", "inf", "zero", "big", "tiny", "longer", "shorter", "scalar", "matrix", "int32", "float64",
              "int4", "uint16", "empty", "dims", "raw")
ATTR_VALUES = (-100, -3, -2, -1, 0, 1, 2, 3, 7, 8, 16, 2 ** 31 - 1, 2 ** 40, -2 ** 40)
OPS = ("QuantizeLinear", "DequantizeLinear", "Relu", "Identity", "MatMul", "Transpose")


def onnx_edit(path: Path, edit: list) -> None:
    """One structural edit of an ONNX model file (nothing when it does not apply: an index out of range)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    if not path.is_file() or path.is_symlink():
        return
    try:
        m = onnx.load_model_from_string(path.read_bytes())
    except Exception:   # a file an earlier op broke
        return
    g = m.graph
    kind = edit[0]
    nodes = g.node
    if kind == "init":
        _, name, how = edit
        i = next((k for k, t in enumerate(g.initializer) if t.name == name), None)
        if i is None:
            return
        t = g.initializer[i]
        try:
            a = numpy_helper.to_array(t).astype(np.float64)
        except Exception:
            a = np.zeros(1)
        dtype = t.data_type
        new = {"neg": lambda: -np.abs(a) - 1, "nan": lambda: np.full(a.shape, np.nan), "inf": lambda: a + np.inf,
               "zero": lambda: np.zeros(a.shape), "big": lambda: a * 1e30 + 7e4, "tiny": lambda: a * 1e-44,
               "longer": lambda: np.concatenate([a.reshape(-1), a.reshape(-1)[:1]]),
               "shorter": lambda: a.reshape(-1)[:-1], "scalar": lambda: np.asarray(a.reshape(-1)[0] if a.size else 1),
               "matrix": lambda: np.stack([a.reshape(-1)] * 2), "empty": lambda: np.zeros(0)}
        if how in new:
            v = new[how]()
            if dtype in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE):
                g.initializer[i].CopyFrom(helper.make_tensor(name, dtype, v.shape, v.reshape(-1).tolist()))
            else:
                # integers written raw into int32_data, out of the type's range too (make_tensor would refuse)
                v = np.clip(np.nan_to_num(v, nan=0, posinf=2 ** 20, neginf=-2 ** 20), -2 ** 31, 2 ** 31 - 1)
                t = TensorProto(name=name, data_type=dtype, dims=v.shape)
                t.int32_data.extend(v.astype(np.int64).reshape(-1).tolist())
                g.initializer[i].CopyFrom(t)
        elif how in ("int32", "float64", "int4", "uint16"):
            to = {"int32": TensorProto.INT32, "float64": TensorProto.DOUBLE, "int4": TensorProto.INT4,
                  "uint16": TensorProto.UINT16}[how]
            v = np.clip(np.rint(np.nan_to_num(a)), -8, 7) if how == "int4" else np.clip(np.nan_to_num(a), 0, 65535) \
                if how == "uint16" else a
            g.initializer[i].CopyFrom(helper.make_tensor(name, to, v.shape, v.reshape(-1).tolist()))
        elif how == "dims":
            del t.dims[:]
            t.dims.extend([2 ** 20, 2 ** 20])
        elif how == "raw":
            t.ClearField("float_data")
            t.ClearField("int32_data")
            t.raw_data = b"\x01\x02\x03"
    elif kind in ("attr", "input", "optype", "drop", "domain", "dup"):
        if not nodes:
            return
        n = nodes[edit[1] % len(nodes)]
        if kind == "attr":
            _, _, name, value = edit
            kept = [a for a in n.attribute if a.name != name]
            del n.attribute[:]
            n.attribute.extend(kept + [helper.make_attribute(name, value)])
        elif kind == "input":
            _, _, slot, name = edit
            if slot < len(n.input):
                n.input[slot] = name
            else:
                n.input.append(name)
        elif kind == "optype":
            n.op_type = edit[2]
        elif kind == "drop":
            nodes.remove(n)
        elif kind == "domain":
            n.domain = edit[2]
        else:
            nodes.append(n)
    elif kind == "output":
        g.output.append(onnx.ValueInfoProto(name=edit[1]))
    elif kind == "rank":
        _, name, rank = edit
        kept = [v for v in g.value_info if v.name != name]
        del g.value_info[:]
        g.value_info.extend(kept + [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2] * rank)])
    path.write_bytes(m.SerializeToString())


def onnx_op(rng: random.Random, rel: str, model) -> list:
    names = [t.name for t in model.graph.initializer]
    tensors = sorted({t for n in model.graph.node for t in (*n.input, *n.output)} | set(names))
    n = len(model.graph.node)
    kind = rng.choice(["init", "init", "init", "attr", "attr", "input", "optype", "drop", "domain", "output", "dup",
                       "rank"])
    if kind == "init":
        edit = ["init", rng.choice(names), rng.choice(INIT_KINDS)]
    elif kind == "attr":
        edit = ["attr", rng.randrange(n), rng.choice(["axis", "block_size", "output_dtype", "transB", "perm"]),
                rng.choice(ATTR_VALUES)]
    elif kind == "input":
        edit = ["input", rng.randrange(n), rng.randrange(4), rng.choice(tensors + ["", "missing"])]
    elif kind == "optype":
        edit = ["optype", rng.randrange(n), rng.choice(OPS)]
    elif kind in ("drop", "dup"):
        edit = [kind, rng.randrange(n)]
    elif kind == "domain":
        edit = ["domain", rng.randrange(n), rng.choice(["com.microsoft", "ai.onnx", "x.y"])]
    elif kind == "output":
        edit = ["output", rng.choice(tensors)]
    else:
        edit = ["rank", rng.choice(tensors), rng.randrange(6)]
    return ["onnx", rel, edit]


def exercise(enc) -> None:
    """Quantise a tensor the encoding fits (its shape from the scale's), and the other public uses of it."""
    scale = np.asarray(enc.scale)
    if enc.float_dtype is None and scale.size > 1 << 20:
        return
    if enc.axis is None:
        shape = (3, scale.size) if scale.ndim else (3, 5)
    elif enc.block_size is None:
        shape = tuple(scale.size if a == enc.axis else 2 for a in range(max(2, enc.axis + 1)))
    else:
        shape = tuple(d * enc.block_size if a == enc.axis else d for a, d in enumerate(scale.shape))
        if int(np.prod(shape, dtype=np.float64)) > 1 << 20:
            return
    x = np.linspace(-3, 3, int(np.prod(shape))).astype(np.float32).reshape(shape)
    enc.apply(x)
    enc.codes(x) if enc.float_dtype is None else None
    enc.describe()
    if enc.axis is not None and len(shape) == 2:
        enc.on_rows()
    if enc.stored is not None:   # a QDQ model's stored integer weight, read when the weight is
        enc.stored()


# ---------------------------------------------------------------------------------------------------- base models

def weights_model():
    """A float model with the weights aimet-onnx quantises per channel / block: MatMul [64, 32], a Transpose-tied
    [48, 64] (MatMul of its transpose), Gemm transB [16, 32], Conv [8, 4, 3, 3]."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    w = {"w_mm": rng.normal(0, 0.05, (64, 32)), "w_tied": rng.normal(0, 0.05, (48, 64)),
         "w_gemm": rng.normal(0, 0.05, (16, 32)), "w_conv": rng.normal(0, 0.05, (8, 4, 3, 3))}
    inits = [numpy_helper.from_array(a.astype(np.float32), k) for k, a in w.items()]
    nodes = [helper.make_node("Transpose", ["w_tied"], ["w_tied_t"], name="node_Transpose_1"),
             helper.make_node("MatMul", ["x", "w_tied_t"], ["h0"], name="node_linear"),           # [2, 48]
             helper.make_node("Slice", ["h0", "starts", "ends", "axes"], ["h1"], name="node_slice"),
             helper.make_node("MatMul", ["h1", "w_mm"], ["h2"], name="node_linear_1"),           # [2, 32]
             helper.make_node("Gemm", ["h2", "w_gemm"], ["h3"], name="node_gemm", transB=1),     # [2, 16]
             helper.make_node("Reshape", ["h3", "shape4"], ["h4"], name="node_view"),             # [2, 4, 2, 2]
             helper.make_node("Conv", ["h4", "w_conv"], ["y"], name="node_conv", pads=[1, 1, 1, 1])]
    inits += [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in (
        ("starts", [0]), ("ends", [64]), ("axes", [1]), ("shape4", [2, 4, 2, 2]))]
    graph = helper.make_graph(nodes, "weights", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), w


def aimet_onnx_encodings(w: dict) -> dict:
    """A 1.0.0 file as aimet-onnx writes it for weights_model (block scales listed channel-major)."""
    def sym(a, bw, axis):
        s = np.abs(a).max(axis=axis) / (2 ** (bw - 1) - 1)
        return [float(np.float32(v)) for v in s.reshape(-1)]
    mm_blocks = np.abs(w["w_mm"]).reshape(2, 32, 32).max(1) / 7                   # [blocks, out] -> out-major
    tied = np.abs(w["w_tied"]).reshape(48, 2, 32).max(2)                          # [out, blocks]
    gemm = np.abs(w["w_gemm"]).reshape(16, 2, 16).max(2)
    params = [
        {"name": "w_mm", "dtype": "INT", "enc_type": "PER_BLOCK", "bw": 4, "is_sym": True, "block_size": 32,
         "scale": [float(np.float32(v)) for v in mm_blocks.T.reshape(-1)], "offset": [-8] * 64},
        {"name": "w_tied", "dtype": "INT", "enc_type": "LPBQ", "bw": 8, "compressed_bw": 4, "is_sym": True,
         "block_size": 32, "scale": (tied.max(1) / 7 / 16).tolist(), "offset": [-128] * 48,
         "per_block_int_scale": np.clip(np.rint(tied / tied.max(1, keepdims=True) * 16), 1, 16).astype(int)
         .reshape(-1).tolist()},
        {"name": "w_gemm", "dtype": "INT", "enc_type": "LPBQ", "bw": 8, "compressed_bw": 4, "is_sym": True,
         "block_size": 16, "scale": (gemm.max(1) / 7 / 16).tolist(), "offset": [-128] * 16,
         "per_block_int_scale": [16, 9] * 16},
        {"name": "w_conv", "dtype": "INT", "enc_type": "PER_CHANNEL", "bw": 8, "is_sym": True,
         "scale": sym(w["w_conv"], 8, (1, 2, 3)), "offset": [-128] * 8}]
    acts = [{"name": n, "dtype": "INT", "enc_type": "PER_TENSOR", "bw": 16, "is_sym": False,
             "scale": [s], "offset": [o]} for n, s, o in (("x", 6.2e-05, -32768), ("h0", 1.1e-05, -31000),
                                                          ("h2", 3.3e-06, -30000), ("h3", 1e-06, -32000))]
    acts += [{"name": "h4", "dtype": "FLOAT", "enc_type": "PER_TENSOR", "bw": 16, "scale": [], "offset": []},
             {"name": "y", "dtype": "FLOAT", "enc_type": "PER_TENSOR", "bw": 32, "scale": [], "offset": []}]
    return {"version": "1.0.0", "activation_encodings": acts, "param_encodings": params,
            "producer": {"package": "aimet-onnx", "version": "2.42.0"}, "quantizer_args": {"activation_bitwidth": 16}}


def qdq_model():
    """A QDQ model as onnxruntime.quantization writes one: activation Q/DQ pairs (uint16 per tensor, int16 per axis
    with the rank in value_info, uint8, the graph output through its DQ), weights stored int4 per axis, uint8 per
    tensor, int8 blocked, uint4 and uint16 per tensor."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(1)
    inits, nodes = [], []

    def const(name, a, dtype=None):
        inits.append(numpy_helper.from_array(np.asarray(a, np.float32), name) if dtype is None else
                     helper.make_tensor(name, dtype, np.shape(a), np.ravel(a).astype(int).tolist()))

    def pair(x, out, scale, zp, dtype, **attrs):
        const(f"{x}_scale", scale)
        const(f"{x}_zero_point", zp, dtype)
        nodes.append(helper.make_node("QuantizeLinear", [x, f"{x}_scale", f"{x}_zero_point"], [f"{x}_q"],
                                      name=f"{x}_QuantizeLinear", **attrs))
        nodes.append(helper.make_node("DequantizeLinear", [f"{x}_q", f"{x}_scale", f"{x}_zero_point"], [out],
                                      name=f"{x}_DequantizeLinear", **attrs))

    def weight(name, shape, dtype, lo, hi, scale, zp, **attrs):
        const(f"{name}_quantized", rng.integers(lo, hi + 1, shape), dtype)
        const(f"{name}_scale", scale)
        const(f"{name}_zero_point", zp, dtype)
        nodes.append(helper.make_node("DequantizeLinear", [f"{name}_quantized", f"{name}_scale", f"{name}_zero_point"],
                                      [f"{name}_DequantizeLinear_Output"], name=f"{name}_DequantizeLinear", **attrs))
        return f"{name}_DequantizeLinear_Output"

    T = TensorProto
    pair("x", "x_dq", 6.1e-05, 32768, T.UINT16)
    w1 = weight("w1", (64, 32), T.INT4, -8, 7, rng.uniform(1e-3, 1e-2, 32), np.zeros(32), axis=1)
    nodes.append(helper.make_node("MatMul", ["x_dq", w1], ["h"], name="node_linear"))
    pair("h", "h_dq", rng.uniform(1e-4, 1e-3, 32), rng.integers(-100, 100, 32), T.INT16, axis=2)
    w2 = weight("w2", (32, 16), T.UINT8, 0, 255, 0.004, 128)
    nodes.append(helper.make_node("MatMul", ["h_dq", w2], ["o"], name="node_linear_1"))
    pair("o", "o_dq", 0.02, 120, T.UINT8)
    w3 = weight("w3", (16, 16), T.INT8, -128, 127, rng.uniform(1e-3, 1e-2, (2, 16)), np.zeros((2, 16)), axis=0,
                block_size=8)
    nodes.append(helper.make_node("MatMul", ["o_dq", w3], ["p"], name="node_linear_2"))
    w4 = weight("w4", (16,), T.UINT4, 0, 15, 0.1, 8)
    w5 = weight("w5", (16,), T.UINT16, 0, 65535, 3e-5, 30000)
    # LPBQ as aimet-onnx's to_onnx_qdq writes it: a float weight quantised by Q -> DQ whose blocked scale is a
    # DequantizeLinear of integer block scales by a per-channel float scale
    const("w6", rng.normal(0, 0.05, (16, 16)))
    const("w6_block_scales", rng.integers(1, 16, (2, 16)), T.UINT8)
    const("w6_channel_scale", rng.uniform(1e-3, 2e-3, 16))
    nodes.append(helper.make_node("DequantizeLinear", ["w6_block_scales", "w6_channel_scale"], ["w6_scale"],
                                  name="w6_scale_DequantizeLinear", axis=1))
    const("w6_zero_point", np.zeros((2, 16)), T.INT4)
    nodes.append(helper.make_node("QuantizeLinear", ["w6", "w6_scale", "w6_zero_point"], ["w6_q"], name="w6_q",
                                  axis=0, block_size=8))
    nodes.append(helper.make_node("DequantizeLinear", ["w6_q", "w6_scale", "w6_zero_point"], ["w6_dq"], name="w6_dq",
                                  axis=0, block_size=8))
    nodes.append(helper.make_node("MatMul", ["p", "w6_dq"], ["p6"], name="node_linear_3"))
    nodes.append(helper.make_node("Mul", ["p6", w4], ["r"], name="node_mul"))
    nodes.append(helper.make_node("Add", ["r", w5], ["y_QuantizeLinear_Input"], name="node_add"))
    pair("y_QuantizeLinear_Input", "y", 1.5e-4, 30000, T.UINT16)
    value_info = [helper.make_tensor_value_info("h", T.FLOAT, [2, 8, 32])]
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", T.FLOAT, [2, 8, 64])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [2, 8, 16])], inits, value_info=value_info)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
