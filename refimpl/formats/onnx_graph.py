"""An ONNX model's graph as plain data: what refimpl needs to place a device's quantisers (issue 27).

A quantised deployment quantises the exported graph: its quantisers are keyed by ONNX tensor names (aimet-onnx
encodings) or are QuantizeLinear / DequantizeLinear pairs in the model itself. Placing them on refimpl's graph needs
the exported graph's structure: each node's op type, inputs and outputs, in file (topological) order, and the scope
of the module that exported it (torch.onnx.export names nodes "/model/layers.0/self_attn/q_norm/Pow").

    g = read_onnx("model.onnx")
    [n for n in g.nodes if n.scope == "model.layers.0.input_layernorm"]

The onnx package parses the protobuf (a well-kept library: refimpl never parses protobuf by hand); tensors' values
are not loaded here.
"""

import dataclasses

from ..encodings import load_onnx_model


@dataclasses.dataclass(frozen=True)
class OnnxNode:
    """One node: op type (with its domain when not the default one), name, input / output tensor names ("" for an
    omitted optional input), and the module scope of its name ("model.layers.0.self_attn.q_norm"; "" if none)."""
    op_type: str
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    domain: str = ""

    @property
    def scope(self) -> str:
        """"/model/layers.0/self_attn/q_norm/Pow_1" -> "model.layers.0.self_attn.q_norm"."""
        parts = self.name.strip("/").split("/")
        return ".".join(parts[:-1]) if self.name.startswith("/") and len(parts) > 1 else ""


@dataclasses.dataclass(frozen=True)
class OnnxGraph:
    """A model's main graph: nodes in file order, graph input / output names, initializer names."""
    nodes: tuple[OnnxNode, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    initializers: tuple[str, ...]
    scalars: dict = dataclasses.field(default_factory=dict)   # {tensor: int} integer scalar constants (an index)

    def producers(self) -> dict[str, OnnxNode]:
        """tensor name -> the node that computes it."""
        return {t: n for n in self.nodes for t in n.outputs if t}


def read_onnx(path) -> OnnxGraph:
    """The graph of an ONNX model file (external data is not read)."""
    model = load_onnx_model(path)   # a regular file (never a FIFO), parsed; FormatError naming it otherwise
    g = model.graph
    nodes = tuple(OnnxNode(n.op_type, n.name, tuple(n.input), tuple(n.output), n.domain) for n in g.node)
    return OnnxGraph(nodes, tuple(i.name for i in g.input), tuple(o.name for o in g.output),
                     tuple(t.name for t in g.initializer), integer_scalars(g))


def integer_scalars(g) -> dict[str, int]:
    """{tensor: value} of a graph's integer scalar constants (initializers and Constant nodes): the index of a
    Gather that picks one token (an unrolled per-token loop, the recurrent delta rule), read as plain data."""
    from onnx import numpy_helper
    tensors = [(t.name, t) for t in g.initializer if not t.dims]
    tensors += [(n.output[0], a.t) for n in g.node if n.op_type == "Constant" and n.output
                for a in n.attribute if a.name == "value" and not a.t.dims]
    out = {}
    for name, t in tensors:
        if t.data_type in (6, 7):   # int32, int64
            out[name] = int(numpy_helper.to_array(t))
    return out
