"""What produces each tensor of a graph call: its op, layer, formula and direct inputs (the layer DAG), resolved over
the declarations of the code that computes it (refimpl/graph.py): the model's blocks declare their taps
(refimpl.models.model.graph), each convention its graph inputs and outputs.

    node = producer(cfg, "model.layers.3.self_attn.q_norm")
    node.op, node.layer, node.formula, node.inputs   # "rms_norm", 3, "...", ("model.layers.3.self_attn.q_proj",)

Names are tap names (docs/taps.md, generated from the same declarations by docs/make_taps.py) and
graph I/O names of the conventions (genie, qeff, hf). A block's input "cache:<kind>.<i>" (the state a host carries
between calls) resolves to the convention's graph input of that state, or, when the convention is not known, to every
convention's. Inputs that a convention does not have (e.g. `position_ids_cos` in the hf convention) are simply absent
from a bundle; the first-divergence walk (refimpl.diff.compare) skips to the nearest ancestors it can see. A graph
input of a later step is produced by the host from the previous step's outputs: its inputs are named "prev:<name>".
"""

import dataclasses

from ..conventions import CONVENTIONS
from ..graph import Node
from ..models.model import graph

_graphs: dict[tuple, tuple] = {}   # (id(cfg), what) -> (cfg, nodes): a diff asks for thousands of nodes of one config


def producer(cfg, name: str, convention: dict | None = None) -> Node | None:
    """The node that produces tensor `name` (a tap or a graph input / output), or None if unknown.
    convention: the bundle manifest's convention record {"name", "params"} (genie's kv_output="window" outputs read
    the inputs); without it, every convention's graph I/O names are tried."""
    convention = convention or {}
    known = convention.get("name") in CONVENTIONS
    names = [convention["name"]] if known else list(CONVENTIONS)
    node = _held(cfg, "model", lambda: graph(cfg)).get(name)
    if node is not None:
        return dataclasses.replace(node, inputs=tuple(n for i in node.inputs for n in _resolve(i, names)))
    params = (convention.get("params") or {}) if known else {}
    for c in names:
        node = _held(cfg, (c, repr(sorted(params.items()))), lambda: CONVENTIONS[c].io_nodes(cfg, params)).get(name)
        if node is not None:
            return node
    return None


def _held(cfg, what, build) -> dict:
    """The nodes `build()` declares for cfg, built once per config object."""
    held = _graphs.get((id(cfg), what))
    if held is None or held[0] is not cfg:   # a new config, or another one where a freed one lived
        if len(_graphs) >= 64:
            del _graphs[next(iter(_graphs))]   # the oldest: a run asks for a handful of configs
        held = _graphs[id(cfg), what] = (cfg, build())
    return held[1]


def _resolve(name: str, conventions) -> list[str]:
    """A declared input -> the tensor names it is: "cache:<kind>.<i>" -> each convention's graph input of that state."""
    if not name.startswith("cache:"):
        return [name]
    kind, i = name[len("cache:"):].rsplit(".", 1)
    return [CONVENTIONS[c].state_input(kind, int(i)) for c in conventions]
