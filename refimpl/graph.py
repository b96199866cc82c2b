"""The graph, declared by the code that computes it: every tapped tensor is a `Node` (its op, its formula, its direct
inputs) declared beside its block's computation (refimpl/models/qwen3.py, hybrid.py), and every convention declares
the producers of its graph inputs and outputs (refimpl/conventions/). refimpl.diff.dataflow resolves names over
these declarations; docs/taps.md is generated from them (tests/test_graph.py keeps both honest: every traced tap
has exactly one declared node, every declared node is tapped).

    nodes = declare({"q_proj": Node("linear", "q = x Wq^T (+ b)", (x,), module=1)}, prefix="model.layers.0.self_attn")
"""

import dataclasses


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
