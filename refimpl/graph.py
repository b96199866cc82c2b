"""The graph, declared by the code that computes it: every tapped tensor is a `Node` (its op, its formula, its direct
inputs) declared beside its block's computation (refimpl/models/qwen3.py, hybrid.py), and every convention declares
the producers of its graph inputs and outputs (refimpl/conventions/). refimpl.diff.dataflow resolves names over
these declarations; docs/taps.md is generated from them (tests/test_graph.py keeps both honest: every traced tap
has exactly one declared node, every declared node is tapped).

    nodes = declare({"q_proj": Node("linear", "q = x Wq^T (+ b)", (x,), module=1)}, prefix="model.layers.0.self_attn")

A quantised device graph (an exported ONNX model: aimet-onnx, QDQ) quantises tensors inside a node too: each node
declares the sub-op points of its kernel's equation (`points`, named `<node>/<point>`; the kernel passes each
through its hook `at`, kernels/activation.Unhooked) and the ONNX op each exports as, with its inputs, so that
refimpl/models/onnx_placement.py finds them in an exported graph by its structure. The point named "" is the node's
own output.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Point:
    """A sub-op point of a node's kernel equation (name "" the node's own output): the ONNX op types it exports as
    (one of) and its inputs, each one of
        "/p"              point p of the same node              a tap name, "n/p"   that node / point's value
        "const:p"         a constant of the graph (eps, the attention scale, 2 of x^2), quantised at point p
        "weight:w"        checkpoint weight w (a MatMul's or Gather's constant; quantised as that weight)
        "input:p"         a graph input read here (the mask, the cos / sin tables), quantised at point p
    also: the same point's other forms, (onnx, inputs) each, declared beside it (a device graph an engineer
    rewrote: Pow(x, 2) as Mul(x, x), Reciprocal as Div(1, x)); the kernel reads a form's constants through the
    hook too ("const:1": at("1", 1)).
    A point of a per-token loop the device graph unrolls (the recurrent delta rule) reads inputs "x@t" (value x at
    token t: a per-token slice of a whole value, or that point's instance t) or "x@t-1" (the previous token's);
    its instances are named "<name>@<t>" (the kernel's hook: at("S@3", ...)); first: its inputs at token 0 where they
    differ (the state the graph reads in, "input:state", for the previous token's). "x@*": every instance of x in
    token order (their stack).
    """
    name: str
    onnx: tuple[str, ...]
    inputs: tuple[str, ...]
    formula: str = ""
    more: tuple[str, ...] = ()     # the points of the op's further outputs (Split's second half); "#name": integers
    also: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = ()   # other (onnx, inputs) forms of the same function
    first: tuple[str, ...] = ()    # a per-token point's inputs at token 0, where they differ

    @property
    def per_token(self) -> bool:
        """A point computed once per token (its inputs name "@t" / "@t-1" values)."""
        return any(i.endswith(("@t", "@t-1")) for i in self.inputs)

    def forms(self) -> tuple["Point", ...]:
        """The point as declared, then each equivalent form a rewritten device graph computes it in (`also`: x^2 as
        Mul(x, x), 1 / s as Div(1, s)): the same real function of the same values, another op."""
        return (self, *(dataclasses.replace(self, onnx=ops, inputs=ins, also=(), first=()) for ops, ins in self.also))


@dataclasses.dataclass(frozen=True)
class Node:
    """How one tensor is computed: op, formula (its kernel's equation) and direct inputs (tap or graph I/O names; a
    later step's graph input names the previous call's output "prev:<name>"); shape in the symbols of docs/taps.md.
    module: for a tensor that is the output of an HF module AIMET wraps with quantisers, how many of `inputs` are
    that module's arguments (its input quantisers act on them in that order); module_name: that module when it is
    not the tap's own name (the MoE router: module `mlp.gate`, tap `mlp.router_logits`)."""
    op: str
    formula: str
    inputs: tuple[str, ...] = ()
    shape: str = ""
    layer: int | None = None
    module: int | None = None
    module_name: str | None = None
    points: tuple[Point, ...] = ()


def declare(table: dict, prefix: str | None = None, layer: int | None = None) -> dict[str, Node]:
    """{what: Node} of one block -> {full tap name: Node} (`prefix.what`, or `prefix` for the key ""), each node
    given the block's layer and its module's full name."""
    out = {}
    for what, node in table.items():
        name = what if prefix is None else (f"{prefix}.{what}" if what else prefix)
        module_name = node.module_name and (node.module_name if prefix is None else f"{prefix}.{node.module_name}")
        out[name] = dataclasses.replace(node, layer=layer, module_name=module_name)
    return out


def merge(*tables: dict) -> dict[str, Node]:
    """One graph from blocks' declarations, in order; a name declared twice is a bug in the declarations."""
    out = {}
    for t in tables:
        twice = out.keys() & t.keys()
        if twice:
            raise AssertionError(f"graph nodes declared twice: {sorted(twice)}")
        out.update(t)
    return out


def module_taps(nodes: dict) -> dict[str, str]:
    """The AIMET-quantisable modules of a graph -> the tap that is the module's output."""
    return {node.module_name or name: name for name, node in nodes.items() if node.module is not None}


def modules(nodes: dict) -> dict[str, tuple[str, ...]]:
    """The AIMET-quantisable modules of a graph -> their input taps, in declaration (execution) order."""
    return {node.module_name or name: node.inputs[:node.module] for name, node in nodes.items()
            if node.module is not None}


def points(nodes: dict) -> dict[str, tuple[str, Point]]:
    """Every declared point of a graph, "<node>/<point>" (the node's own output: "<node>") -> (node, Point)."""
    return {(f"{name}/{pt.name}" if pt.name else name): (name, pt)
            for name, node in nodes.items() for pt in node.points}


def point_name(node: str, point: str) -> str:
    """The full name of a node's point ("" its output)."""
    return f"{node}/{point}" if point else node
