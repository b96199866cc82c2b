"""What produces each tensor of a graph call: its op, layer, formula and direct inputs (the layer DAG), resolved over
the declarations of the code that computes it (refimpl/graph.py): the model's blocks declare their taps
(refimpl.models.model.graph), each convention its graph inputs and outputs.

    node = producer(cfg, "model.layers.3.self_attn.q_norm")
    node.op, node.layer, node.formula, node.inputs   # "rms_norm", 3, "...", ("model.layers.3.self_attn.q_proj",)

Names are tap names (docs/taps.md, generated from the same declarations: `python -m refimpl.diff.dataflow`) and
graph I/O names of the conventions (genie, qeff, hf). A block's input "cache:<kind>.<i>" (the state a host carries
between calls) resolves to the convention's graph input of that state, or, when the convention is not known, to every
convention's. Inputs that a convention does not have (e.g. `position_ids_cos` in the hf convention) are simply absent
from a bundle; the first-divergence walk (refimpl.diff.compare) skips to the nearest ancestors it can see. A graph
input of a later step is produced by the host from the previous step's outputs: its inputs are named "prev:<name>".
"""

import dataclasses
import re

from ..graph import Node
from ..models.model import graph

_CONVENTIONS = ("genie", "hf", "qeff")
_graphs: dict[int, tuple] = {}   # id(cfg) -> (cfg, its graph): a diff asks for thousands of nodes of one config


def producer(cfg, name: str, convention: dict | None = None) -> Node | None:
    """The node that produces tensor `name` (a tap or a graph input / output), or None if unknown.
    convention: the bundle manifest's convention record (genie's kv_output="window" outputs read the inputs)."""
    node = model_graph(cfg).get(name)
    if node is not None:
        names = [convention["name"]] if (convention or {}).get("name") in _CONVENTIONS else _CONVENTIONS
        return dataclasses.replace(node, inputs=tuple(n for i in node.inputs for n in _resolve(i, names)))
    return _io_node(cfg, name, convention)


def model_graph(cfg) -> dict[str, Node]:
    """models.model.graph(cfg), built once per config object."""
    held = _graphs.get(id(cfg))
    if held is None or held[0] is not cfg:
        held = _graphs[id(cfg)] = (cfg, graph(cfg))
    return held[1]


def _resolve(name: str, conventions) -> list[str]:
    """A declared input -> the tensor names it is: "cache:<kind>.<i>" -> each convention's graph input of that state."""
    if not name.startswith("cache:"):
        return [name]
    kind, i = name[len("cache:"):].rsplit(".", 1)
    return [_STATE_INPUT[c](kind, int(i)) for c in conventions]


_STATE_INPUT = {
    "genie": lambda kind, i: f"{kind}_{i}_in",
    "hf": lambda kind, i: {"past_key": f"past_key_values.{i}.key", "past_value": f"past_key_values.{i}.value"}.get(
        kind, f"past_{kind}.{i}"),
    "qeff": lambda kind, i: f"{kind}.{i}",
}


# --- graph I/O (to move beside each convention) ---
_IO = re.compile(r"(past_key|past_value|conv_state|recurrent_state)_(\d+)_(in|out)$")
_QEFF_IO = re.compile(r"(past_key|past_value|conv_state|recurrent_state)\.(\d+)(_RetainedState)?$")
_HF_IO = re.compile(r"(past_key_values|present)\.(\d+)\.(key|value)$|(past|present)_(conv|recurrent)_state\.(\d+)$")


def _io_node(cfg, name: str, convention: dict | None) -> Node | None:
    if name == "input_ids":  # a decode step's token is the previous call's greedy choice
        return Node("graph input", "prompt chunk, or argmax of the previous call's logits", ("prev:logits",))
    if name in ("attention_mask", "position_ids", "position_ids_cos", "position_ids_sin"):
        return Node("graph input", "prepared by the host", ())
    if name == "logits":
        return Node("graph output", "logits = lm_head", ("lm_head",))
    m = _IO.fullmatch(name)
    if m:
        node = _state_io(cfg, m[1], int(m[2]), m[3])
        window = ((convention or {}).get("params") or {}).get("kv_output") == "window"
        if window and m[1].startswith("past_") and m[3] == "out":  # the updated window: old entries too
            node = Node(node.op, "the updated window: cached entries then the new ones",
                        (*node.inputs, f"{m[1]}_{m[2]}_in"), layer=node.layer)
        return node
    m = _HF_IO.fullmatch(name)
    if m:
        return _hf_io(m)
    m = _QEFF_IO.fullmatch(name)
    if m:
        return _qeff_io(m[1], int(m[2]), bool(m[3]))
    return None


def _state_io(cfg, kind: str, i: int, direction: str) -> Node:
    if direction == "in":  # the host's cache: the previous call's outputs (shifted into the window)
        return Node("host cache", "window of earlier calls' outputs", (f"prev:{kind}_{i}_out", f"prev:{kind}_{i}_in"),
                    layer=i)
    a, g = f"model.layers.{i}.self_attn", f"model.layers.{i}.linear_attn"
    source = {"past_key": f"{a}.k_rope", "past_value": f"{a}.v_proj", "conv_state": f"{g}.conv_state",
              "recurrent_state": f"{g}.recurrent_state"}[kind]
    formula = {"past_key": "new keys after RoPE (transposed [Hkv, 1, D, T] unless configured)",
               "past_value": "new values [Hkv, 1, T, D]", "conv_state": "last S raw conv inputs",
               "recurrent_state": "S after the call, keys on rows"}[kind]
    return Node("graph output", formula, (source,), layer=i)


def _qeff_io(kind: str, i: int, retained: bool) -> Node:
    if not retained:
        return Node("host cache", "previous call's retained state", (f"prev:{kind}.{i}_RetainedState",), layer=i)
    node = _state_io(None, kind, i, "out")
    extra = (f"{kind}.{i}",) if kind.startswith("past_") else ()
    return Node(node.op, "scattered at the tokens' positions" if extra else node.formula, (*node.inputs, *extra), layer=i)


def _hf_io(m) -> Node:
    if m[1] == "past_key_values":
        return Node("host cache", "previous call's present", (f"prev:present.{m[2]}.{m[3]}",), layer=int(m[2]))
    if m[4] == "past":
        return Node("host cache", "previous call's present", (f"prev:present_{m[5]}_state.{m[6]}",), layer=int(m[6]))
    if m[1] == "present":
        i = int(m[2])
        source = f"model.layers.{i}.self_attn." + ("k_rope" if m[3] == "key" else "v_proj")
        return Node("graph output", "cache after the call (past + new)", (f"past_key_values.{i}.{m[3]}", source), layer=i)
    i = int(m[6])
    return Node("graph output", "state after the call", (f"model.layers.{i}.linear_attn.{m[5]}_state",), layer=i)

