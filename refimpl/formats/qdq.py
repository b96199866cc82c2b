"""QDQ ONNX models (issue 27): the quantisers a QDQ model carries in itself, as refimpl's encodings.

A QDQ model (onnxruntime.quantization, AI Hub's and QAIRT's QDQ exports, aimet-onnx's to_onnx_qdq) is the float
graph with a QuantizeLinear -> DequantizeLinear pair on each quantised activation and a DequantizeLinear on each
quantised initializer (a weight stored as integers):

    T --QuantizeLinear(s, zp)--> Tq --DequantizeLinear(s, zp)--> Td --> consumers     (an activation)
    W_q (integer initializer) --DequantizeLinear(s, zp, axis, block_size)--> Wd --> consumers   (a weight)

read_qdq returns the float graph (the pairs removed, their consumers reading T; a weight's DequantizeLinear
removed, its output Wd standing as an initializer holding the dequantised weight) and {float tensor name: Encoding}:
T for an activation (Td when Td is a graph output: the graph keeps its output names), Wd for a weight, whose Encoding
keeps W_q itself (Encoding.stored) where the ops reading Wd say its layout: refimpl's quantised weight is then the
graph's own codes dequantised, not the checkpoint's weight quantised again (aimet-onnx's to_onnx_qdq rounds its
stored codes another way: half to even after adding the zero point). Each Encoding
is QuantizeLinear's (arithmetic "onnx": q = saturate(round_half_even(fl32(x / s)) + zp), kernels/quant.py) in QNN's
terms: offset = -zero_point, signed for the int types, bitwidth of the type (int4 / uint4 / int8 / uint8 / int16 /
uint16), per tensor, per axis (Encoding.axis) or blocked (ONNX's block_size along axis).

Validated before use: every scale a positive finite float, every zero point inside its type, axis inside the
tensor's rank, scale / zero point shapes agreeing with each other and with the tensor, a QuantizeLinear's
DequantizeLinear with the same parameters, a DequantizeLinear of an activation fed by a QuantizeLinear; one-line
FormatError naming the file and the node.
"""

import dataclasses
import functools
from pathlib import Path

import numpy as np

from ..encodings import Encoding, load_onnx_model
from ..errors import FormatError, InputError, brief
from ..kernels import quant
from .onnx_graph import OnnxGraph, OnnxNode, integer_scalars

# ONNX TensorProto data types of the quantised integer types: name, bits, signed
QTYPES = {2: ("uint8", 8, False), 3: ("int8", 8, True), 4: ("uint16", 16, False), 5: ("int16", 16, True),
          21: ("uint4", 4, False), 22: ("int4", 4, True)}
BIAS_TYPES = {6: ("int32", 32, True)}   # a weight's only (a Gemm's / Conv's bias: scale = input scale x weight scale)
SCALE_TYPES = {1: np.float32, 10: np.float16, 16: None}   # float, float16, bfloat16 (read through onnx)
QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
QDQ_DOMAINS = ("", "ai.onnx", "com.microsoft")
# ops that read a weight in the layout refimpl holds it (Gather's table [V, H], a Conv's [out, in, k], elementwise
# operands: norm weights, biases); MatMul / Gemm are read by their operand (weight_layout in read_qdq)
LAID_AS_IS = ("Gather", "Conv", "Mul", "Add", "Sub", "Div")


def read_qdq(path) -> tuple[OnnxGraph, dict[str, Encoding]]:
    """A QDQ ONNX model -> (its float graph, {float tensor name: Encoding}); see the module doc."""
    import onnx  # imported only when an ONNX file is read
    from onnx import numpy_helper

    path = Path(path)
    model = load_onnx_model(path)
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in (*g.input, *g.output, *g.value_info)
             if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")}
    ranks.update({t.name: len(t.dims) for t in g.initializer})
    producer = {}
    consumers = {}
    for n in g.node:
        for t in n.output:
            if t:
                producer[t] = n
        for t in n.input:
            if t:
                consumers.setdefault(t, []).append(n)
    outputs = [o.name for o in g.output]
    # a scale computed by a DequantizeLinear of integer constants (LPBQ in QDQ form, aimet-onnx's to_onnx_qdq:
    # per-block integer scales times a per-channel float scale) is part of its quantiser
    scale_dqs = {n.output[0]: n for n in g.node if n.op_type == "DequantizeLinear" and n.input and n.output and
                 n.input[0] in inits and n.output[0] not in outputs and consumers.get(n.output[0]) and
                 all(c.op_type in QDQ_OPS and list(c.input[1:2]) == [n.output[0]] and c.input[0] != n.output[0]
                     for c in consumers[n.output[0]])}

    def where(n) -> str:
        return f"{path}: node {brief(n.name or '<unnamed>')} ({n.op_type} of {brief(n.input[0] if n.input else '')})"

    def array(name: str, at: str) -> np.ndarray:
        t = inits.get(name)
        if t is None:
            const = producer.get(name)
            if const is not None and const.op_type == "Constant" and const.attribute:
                t = const.attribute[0].t if const.attribute[0].HasField("t") else None
        if t is None:
            raise FormatError(f"{at}: {brief(name)} is not an initializer or Constant (scales and zero points must "
                              f"be constants)")
        if t.data_location == onnx.TensorProto.EXTERNAL:
            raise FormatError(f"{at}: {brief(name)} is stored as external data (not read)")
        try:
            return numpy_helper.to_array(t)
        except Exception as e:  # a tensor whose byte size disagrees with its dims, an unknown data type
            raise FormatError(f"{at}: {brief(name)} cannot be read ({brief(str(e))})") from None

    def computed_scale(name: str, at: str) -> np.ndarray:
        """The float32 scale a DequantizeLinear of constants computes: (q - zp) * s, as ORT's DequantizeLinear."""
        d = scale_dqs[name]
        if not 2 <= len(d.input) <= 3 or any(t and t not in inits for t in d.input[1:]):
            raise FormatError(f"{where(d)}: a scale's DequantizeLinear with inputs that are not initializers")
        attrs = {a.name: a for a in d.attribute}
        q = np.asarray(array(d.input[0], at))
        s = np.asarray(array(d.input[1], at))
        z = np.asarray(array(d.input[2], at)) if len(d.input) == 3 and d.input[2] else np.zeros(s.shape, np.int64)
        axis = attrs["axis"].i if "axis" in attrs else 1
        block = attrs["block_size"].i if "block_size" in attrs else 0
        if q.dtype.kind not in "iu" or s.dtype.kind != "f" or z.shape != s.shape or z.dtype.kind not in "iu":
            raise FormatError(f"{where(d)}: a scale's DequantizeLinear of {q.dtype} codes, {s.dtype} scales and "
                              f"{z.dtype} zero points of shape {list(z.shape)} for scales {list(s.shape)}")
        if s.ndim and not -q.ndim <= axis < q.ndim or block < 0:
            raise FormatError(f"{where(d)}: axis {axis} / block_size {block} for codes of shape {list(q.shape)}")
        try:
            return quant.onnx_dequantize(q, s, z, axis % max(q.ndim, 1) if s.ndim else None, block or None)
        except InputError as e:
            raise FormatError(f"{where(d)}: {e}") from None

    def params(n, rank: int | None) -> tuple[tuple, Encoding]:
        """(the parameters that identify the quantiser, its Encoding) of a Q or DQ node on a tensor of `rank`."""
        at = where(n)
        if n.domain not in QDQ_DOMAINS:
            raise FormatError(f"{at}: domain {brief(n.domain)} is not ONNX's")
        if not 2 <= len(n.input) <= 3 or not n.input[1] or len(n.output) != 1 or not n.output[0]:
            raise FormatError(f"{at}: {len(n.input)} inputs / {len(n.output)} outputs (x, scale[, zero_point] -> y)")
        attrs = {a.name: a for a in n.attribute}
        axis = attrs["axis"].i if "axis" in attrs else 1
        block = attrs["block_size"].i if "block_size" in attrs else 0
        scale_t = inits.get(n.input[1])
        if scale_t is not None and scale_t.data_type not in SCALE_TYPES:
            raise FormatError(f"{at}: scale of data type {scale_t.data_type} (float, float16 or bfloat16)")
        try:
            scale = np.asarray(computed_scale(n.input[1], at) if n.input[1] in scale_dqs else
                               array(n.input[1], at)).astype(np.float64)
        except (TypeError, ValueError):   # a string or otherwise non-numeric Constant
            raise FormatError(f"{at}: scale {brief(n.input[1])} is not numeric") from None
        zp_name = n.input[2] if len(n.input) == 3 else ""
        if zp_name:
            zt = inits.get(zp_name)
            if zt is None and zp_name in producer:
                c = producer[zp_name]
                zt = c.attribute[0].t if c.op_type == "Constant" and c.attribute and c.attribute[0].HasField("t") \
                    else None
            if zt is None:
                raise FormatError(f"{at}: zero point {brief(zp_name)} is not an initializer or Constant")
            dtype = zt.data_type
            try:
                zp = np.asarray(array(zp_name, at)).astype(np.int64)
            except (TypeError, ValueError, OverflowError):
                raise FormatError(f"{at}: zero point {brief(zp_name)} is not an integer tensor") from None
        else:
            dtype = attrs["output_dtype"].i if n.op_type == "QuantizeLinear" and "output_dtype" in attrs else 2
            zp = np.zeros(scale.shape, np.int64)
            if n.op_type == "DequantizeLinear" and n.input[0] in inits:
                dtype = inits[n.input[0]].data_type
        types = {**QTYPES, **BIAS_TYPES} if n.op_type == "DequantizeLinear" and n.input[0] in inits else QTYPES
        if dtype not in types:
            raise FormatError(f"{at}: quantised data type {dtype} is not one of "
                              f"{', '.join(q[0] for q in types.values())}")
        name, bits, signed = types[dtype]
        lo, hi = (-2 ** (bits - 1), 2 ** (bits - 1) - 1) if signed else (0, 2 ** bits - 1)
        if not (scale.size and np.all(np.isfinite(scale)) and np.all(scale > 0)) or \
                not np.all(np.isfinite(scale.astype(np.float32))) or np.any(scale.astype(np.float32) == 0):
            bad = scale[~(np.isfinite(scale) & (scale > 0))] if scale.size else []
            raise FormatError(f"{at}: scale {brief(bad[0] if len(bad) else scale.tolist())} is not a positive "
                              f"finite float32 number")
        if zp.size == scale.size == 1 and not block:   # one-element scale / zero point: per tensor (ONNX Runtime)
            scale, zp = scale.reshape(()), zp.reshape(())
        if zp.shape != scale.shape:
            raise FormatError(f"{at}: zero point of shape {list(zp.shape)} for a scale of shape {list(scale.shape)}")
        if zp.size and (zp.min() < lo or zp.max() > hi):
            raise FormatError(f"{at}: zero point {int(zp.min() if zp.min() < lo else zp.max())} outside {name}'s "
                              f"[{lo}, {hi}]")
        if block < 0:
            raise FormatError(f"{at}: block_size {block} < 0")
        if scale.ndim == 0 or (scale.ndim == 1 and scale.size == 1 and not block and rank is None):
            if block:
                raise FormatError(f"{at}: block_size {block} with a scalar scale")
            axis_used, block_used, s, z = None, None, scale.reshape(()), zp.reshape(())
        else:
            if rank is None:
                raise FormatError(f"{at}: a per-axis / blocked quantiser of a tensor of unknown rank (no shape in the "
                                  f"graph)")
            if not -rank <= axis < rank:
                raise FormatError(f"{at}: axis {axis} out of range for a tensor of rank {rank}")
            axis_used, block_used, s, z = axis % rank, (block or None), scale, zp
            if not block and scale.ndim != 1:
                raise FormatError(f"{at}: a per-axis scale of shape {list(scale.shape)} (1-D expected)")
            if block and scale.ndim != rank:
                raise FormatError(f"{at}: a blocked scale of rank {scale.ndim} for a tensor of rank {rank}")
        enc = Encoding(bits, s.astype(np.float32), (-z).astype(np.int32), block_used, signed, axis=axis_used,
                       arithmetic="onnx")
        key = (name, axis_used, block_used, s.astype(np.float32).tobytes(), s.shape, z.tobytes())
        return key, enc

    def check_shape(n, enc: Encoding, shape: tuple) -> None:
        """The encoding's scale against the tensor's known shape (per axis: its length; blocked: ONNX's shape)."""
        if enc.axis is None:
            return
        n_axis = shape[enc.axis]
        if enc.block_size is None:
            if enc.scale.shape != (n_axis,):
                raise FormatError(f"{where(n)}: {enc.scale.size} scales for axis {enc.axis} of a tensor of shape "
                                  f"{list(shape)}")
            return
        want = tuple(-(-d // enc.block_size) if a == enc.axis else d for a, d in enumerate(shape))
        if enc.scale.shape != want:
            raise FormatError(f"{where(n)}: blocked scale of shape {list(enc.scale.shape)} for a tensor of shape "
                              f"{list(shape)} (block {enc.block_size} on axis {enc.axis}: {list(want)})")

    def weight_layout(t: str, depth: int = 0) -> bool | None:
        """How the weight DequantizeLinear output t holds its weight, from the ops that read it: True where it is the
        weight's transpose (MatMul's B, a Gemm's B without transB: [in, out]), False where it is the weight as
        refimpl holds it (a Gemm's B with transB, a Gather's table, a MatMul's A, an elementwise operand or a
        bias); through a Transpose of the last two axes (the other way round) and a QuantizeLinear / its
        DequantizeLinear (a tied lm_head: the table transposed, quantised again, MatMul's B). None where its
        readers disagree or are other ops (its codes then not read: the checkpoint's weight is quantised by its
        encoding)."""
        roles = set()
        for c in consumers.get(t, ()):
            attrs = {a.name: a for a in c.attribute}
            for k, x in enumerate(c.input):
                if x != t:
                    continue
                if c.op_type == "MatMul" or (c.op_type == "Gemm" and k == 1):
                    roles.add(k == 1 and not (c.op_type == "Gemm" and "transB" in attrs and attrs["transB"].i))
                elif c.op_type in LAID_AS_IS or c.op_type == "Gemm":
                    roles.add(False)
                elif c.op_type == "Transpose" and "perm" in attrs and depth < 4 and len(attrs["perm"].ints) >= 2 and \
                        list(attrs["perm"].ints) == [*range(len(attrs["perm"].ints) - 2), len(attrs["perm"].ints) - 1,
                                                     len(attrs["perm"].ints) - 2]:
                    inner = weight_layout(c.output[0], depth + 1)
                    roles.add(None if inner is None else not inner)
                elif c.op_type in QDQ_OPS and k == 0 and depth < 4:
                    roles.add(weight_layout(c.output[0], depth + 1))
                else:
                    roles.add(None)
        return roles.pop() if len(roles) == 1 else None

    encodings: dict[str, Encoding] = {}
    rename: dict[str, str] = {}      # a removed tensor -> the float tensor that replaces it
    removed: set[int] = set()
    weights: list[str] = []
    dropped_inits: set[str] = set()
    index = {id(n): i for i, n in enumerate(g.node)}
    for i, n in enumerate(g.node):
        if n.op_type not in QDQ_OPS:
            continue
        if n.op_type == "DequantizeLinear" and n.output and n.output[0] in scale_dqs:
            removed.add(i)                                    # a quantiser's computed scale: read with it
            dropped_inits.update(x for x in n.input if x)
            continue
        if n.op_type == "DequantizeLinear":
            if not n.input:
                raise FormatError(f"{where(n)}: no input")
            src = n.input[0]
            if src in inits:                                  # a weight stored as integers
                shape = tuple(int(d) for d in inits[src].dims)
                _, enc = params(n, len(shape))
                check_shape(n, enc, shape)
                if inits[src].data_type not in {**QTYPES, **BIAS_TYPES}:
                    raise FormatError(f"{where(n)}: weight {brief(src)} of data type {inits[src].data_type} is not a "
                                      f"quantised integer type")
                zp_t = inits.get(n.input[2]) if len(n.input) == 3 and n.input[2] else None
                if zp_t is not None and zp_t.data_type != inits[src].data_type:
                    raise FormatError(f"{where(n)}: weight of data type {inits[src].data_type}, zero point of "
                                      f"{zp_t.data_type}")
                out = n.output[0]
                if out in encodings:
                    raise FormatError(f"{where(n)}: {brief(out)} is produced twice")
                transposed = weight_layout(out)
                if transposed is not None and inits[src].data_location != onnx.TensorProto.EXTERNAL:
                    # the device graph's own codes, in a layout refimpl knows (external data is not read: the
                    # checkpoint's weight quantised instead); held with the model file's initializers (inline data:
                    # at most protobuf's 2 GB) while the model lives, read when the weight is
                    enc = dataclasses.replace(enc, stored=functools.partial(array, src, where(n)),
                                              stored_transposed=transposed)
                encodings[out] = enc
                weights.append(out)
                dropped_inits.update(x for x in n.input if x)
                removed.add(i)
                continue
            q = producer.get(src)
            if q is None or q.op_type != "QuantizeLinear":
                raise FormatError(f"{where(n)}: a DequantizeLinear of an activation not produced by a QuantizeLinear")
            continue                                          # handled with its QuantizeLinear
        # QuantizeLinear: its DequantizeLinear consumers
        if not n.input or not n.input[0] or not n.output or not n.output[0]:
            raise FormatError(f"{where(n)}: no input / output tensor")
        x, qt = n.input[0], n.output[0]
        if qt in outputs:
            raise FormatError(f"{where(n)}: its integer output {brief(qt)} is a graph output (a Q without its DQ)")
        deqs = consumers.get(qt, [])
        if not deqs or any(d.op_type != "DequantizeLinear" for d in deqs):
            other = next((d.op_type for d in deqs if d.op_type != "DequantizeLinear"), None)
            raise FormatError(f"{where(n)}: a QuantizeLinear without its DequantizeLinear"
                              f"{f' (its output feeds {other})' if other else ''}")
        key, enc = params(n, ranks.get(x))
        float_name = x
        for d in deqs:
            dkey, _ = params(d, ranks.get(x))
            if d.input[0] != qt or dkey != key:
                raise FormatError(f"{where(d)}: its parameters differ from those of its QuantizeLinear "
                                  f"{brief(n.name)}")
            if d.output[0] in outputs:
                float_name = d.output[0]
        x = rename.get(x, x)
        float_name = rename.get(float_name, float_name)
        if float_name != x:                        # the graph's output name is kept: the float tensor takes it
            rename[x] = float_name
        for d in deqs:
            rename[d.output[0]] = float_name
            removed.add(index[id(d)])
        if float_name in encodings and encodings[float_name].describe() != enc.describe():
            raise FormatError(f"{where(n)}: a second quantiser of {brief(float_name)} with other parameters "
                              f"(a type conversion: not supported)")
        encodings[float_name] = enc
        removed.add(i)
        dropped_inits.update(t for t in n.input[1:] if t)

    def final(t: str) -> str:
        seen = 0
        while t in rename and rename[t] != t and seen < len(rename) + 1:
            t, seen = rename[t], seen + 1
        return t

    nodes = tuple(OnnxNode(n.op_type, n.name, tuple(final(t) for t in n.input),
                           tuple(final(t) for t in n.output), n.domain)
                  for i, n in enumerate(g.node) if i not in removed)
    used = {t for n in nodes for t in n.inputs} | set(outputs)
    kept = tuple(t.name for t in g.initializer if t.name not in dropped_inits or t.name in used)
    encodings = {final(k): v for k, v in encodings.items()}
    graph = OnnxGraph(nodes, tuple(i.name for i in g.input if i.name not in inits),
                      tuple(final(o) for o in outputs), kept + tuple(w for w in weights if w not in kept),
                      integer_scalars(g))
    return graph, encodings


def qdq_names(path) -> dict[str, str]:
    """{name a quantised activation goes by in a QDQ model: the tensor read_qdq keys its Encoding by}: each
    QuantizeLinear's output (the codes an ONNX Runtime session of the model returns) and its DequantizeLinears'
    outputs (the dequantised values) -> the tensor quantised, or the graph output a DequantizeLinear writes (the
    graph keeps its output names, as read_qdq does). The names a dump of the model's run may carry."""
    g = load_onnx_model(path).graph
    inits = {t.name for t in g.initializer}
    outputs = {o.name for o in g.output}
    names, float_name = {}, {}
    for n in g.node:   # a DequantizeLinear that writes a graph output: its tensor takes the output's name
        if n.op_type == "DequantizeLinear" and n.domain in QDQ_DOMAINS and n.output and n.output[0] in outputs:
            float_name[n.input[0]] = n.output[0]
    for n in g.node:
        if n.op_type != "QuantizeLinear" or n.domain not in QDQ_DOMAINS or not n.input or not n.output:
            continue
        x = n.input[0]
        if x in inits:
            continue
        names[n.output[0]] = float_name.get(n.output[0], x)
        if x != names[n.output[0]]:
            names[x] = names[n.output[0]]
    for n in g.node:
        if n.op_type == "DequantizeLinear" and n.input and n.input[0] in names and n.output:
            names.setdefault(n.output[0], names[n.input[0]])
    return {k: v for k, v in names.items() if k != v}
