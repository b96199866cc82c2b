"""A minimal QDQ reader for developing the placement before refimpl.formats.qdq (branch i27read) lands: the float
graph (QuantizeLinear / DequantizeLinear pairs removed, consumers reading the float tensor) and {float tensor:
Encoding} (per-tensor and per-axis, uint8 / uint16 / int8 / int16 / int4)."""

import numpy as np
import onnx
from onnx import numpy_helper

from refimpl.encodings import Encoding
from refimpl.formats.onnx_graph import OnnxGraph, OnnxNode


def read_qdq_minimal(path):
    m = onnx.load(str(path), load_external_data=False)
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    alias, encodings, drop = {}, {}, set()

    def enc(scale, zp):
        s = numpy_helper.to_array(inits[scale]).astype(np.float32)
        z = numpy_helper.to_array(inits[zp])
        bits = {"uint8": 8, "int8": 8, "uint16": 16, "int16": 16}.get(z.dtype.name, 8)
        signed = z.dtype.kind == "i"
        offset = -z.astype(np.int64)
        if signed:   # signed codes q - zp: QNN's offset over signed codes
            offset = -z.astype(np.int64)
        e = Encoding(bits, s if s.ndim else s.reshape(()), offset.astype(np.int32) if offset.ndim else np.int32(offset),
                     signed=signed)
        return e
    for n in g.node:
        if n.op_type == "QuantizeLinear":
            alias[n.output[0]] = n.input[0]
            encodings[n.input[0]] = enc(n.input[1], n.input[2])
            drop.add(n.name)
        elif n.op_type == "DequantizeLinear":
            src = n.input[0]
            if src in inits:                                    # a stored quantised constant
                name = src[:-len("_quantized")] if src.endswith("_quantized") else src
                encodings[name] = enc(n.input[1], n.input[2])
                alias[n.output[0]] = name
            else:
                alias[n.output[0]] = alias.get(src, src)
            drop.add(n.name)

    def real(t):
        while t in alias:
            t = alias[t]
        return t
    nodes = tuple(OnnxNode(n.op_type, n.name, tuple(real(i) for i in n.input), tuple(n.output), n.domain)
                  for n in g.node if n.name not in drop)
    stored = {real(n.output[0]) for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] in inits}
    initializers = tuple(t for t in inits if not t.endswith(("_scale", "_zero_point", "_quantized"))) + tuple(stored)
    outputs = tuple(real(o.name) if o.name in alias else o.name for o in g.output)
    return OnnxGraph(nodes, tuple(i.name for i in g.input), outputs, initializers), encodings
