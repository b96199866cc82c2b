"""What the device conventions share: a graph call's record, the host loop's prompt chunks, token choices and pad
checks, the shapes of graph inputs, the valid regions of taps, and the producers of the graph I/O every convention
has (input_ids, logits) or names alike (cache outputs copy the same taps)."""

import dataclasses

import numpy as np

from ..errors import FormatError, InputError
from ..graph import Node


@dataclasses.dataclass
class Call:
    """One graph call: exactly the device's inputs and outputs, with axes and valid regions (boxes)."""
    graph: str                   # "prompt" / "token" (genie), "prefill" / "decode" (hf, qeff)
    tokens: list                 # the real token ids of this call
    inputs: dict
    outputs: dict
    axes: dict
    valid: dict                  # name -> list of boxes ([start, stop) per axis); absent = all valid
    taps: dict = dataclasses.field(default_factory=dict)   # traced intermediates of this call, by tap name


# ---------------------------------------------------------------------------------------------- the host loop

def prompt_list(prompt_ids, convention: str) -> list:
    """A prompt as a list of ids: one sequence, [T] or [1, T]."""
    ids = np.asarray(prompt_ids)
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"{convention}: the prompt must be one non-empty sequence of token ids, got {ids.dtype} "
                         f"{list(ids.shape)}")
    return [int(t) for t in ids]


def prompt_chunks(prompt: list, ar: int, pad_side: str) -> list[list]:
    """The prompt in chunks of at most `ar` tokens, the short one where the pads go: first for left padding
    (AI Hub's host driver slices from the prompt's end), last for right padding."""
    first = len(prompt) % ar if pad_side == "left" and len(prompt) % ar else ar
    return [prompt[:first]] + [prompt[s:s + ar] for s in range(first, len(prompt), ar)]


def greedy(call: Call) -> int:
    """The next call's input: the argmax of the call's logits at its last real slot (its last row when every
    slot is real)."""
    box = call.valid.get("logits")                       # [[[0, 1], [lo, hi], [0, V]]] when padded
    last = box[0][1][1] - 1 if box else call.outputs["logits"].shape[1] - 1
    return int(np.argmax(call.outputs["logits"][0, last]))


def next_token(choice: int, decode_ids: list | None, j: int) -> int:
    """Decode call j's token: the host's greedy `choice`, or decode_ids[j] (teacher forcing)."""
    return int(decode_ids[j]) if decode_ids is not None else choice


def eos_token(cfg, convention: str) -> int:
    """The model's (first) eos token: the default pad id."""
    eos = cfg.eos_token_id
    eos = (eos[0] if eos else None) if isinstance(eos, list) else eos
    if eos is None:
        raise InputError(f"{convention}: the model config has no eos_token_id; give pad_id")
    return int(eos)


def check_pad_id(pad_id: int, cfg, convention: str) -> int:
    if not 0 <= pad_id < cfg.vocab_size:
        raise InputError(f"{convention}: pad id {pad_id} is outside the vocabulary [0, {cfg.vocab_size})")
    return pad_id


# ---------------------------------------------------------------------------------------------- graph inputs

def state_shapes(cfg) -> tuple:
    """(conv, recurrent) state shapes of a linear-attention layer as graph inputs (Kc: the conv state's columns,
    an export option)."""
    return (1, cfg.conv_dim, "Kc"), (1, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)


def cache_input_shapes(cfg, state_input, key_shape: tuple, value_shape: tuple) -> dict:
    """name -> shape of every layer's carried-state graph inputs, named by the convention's state_input(kind, i):
    conv and recurrent states (state_shapes) in linear-attention layers, the KV cache (as given) in the others."""
    shapes = {}
    for i, kind in enumerate(cfg.layer_types):
        if kind == "linear_attention":
            shapes[state_input("conv_state", i)], shapes[state_input("recurrent_state", i)] = state_shapes(cfg)
        else:
            shapes[state_input("past_key", i)], shapes[state_input("past_value", i)] = key_shape, value_shape
    return shapes


def check_inputs(inputs: dict, expected: dict, where: str) -> dict:
    """Graph inputs given from outside (a bundle's, a device's: replay, explain) against the names and shapes a
    convention's graph reads. expected: name -> shape, a size as an int, or as a letter that must agree wherever it
    recurs (AR, CL, ...). Returns the letters' sizes; FormatError naming the input otherwise."""
    sizes = {}
    for name, shape in expected.items():
        if name not in inputs:
            raise FormatError(f"{where}: graph input {name!r} is missing")
        got = np.shape(inputs[name])
        ok = len(got) == len(shape)
        for want, n in zip(shape, got) if ok else ():
            if isinstance(want, str):
                ok = ok and sizes.setdefault(want, n) == n
            else:
                ok = ok and want == n
        if not ok:
            shown = [sizes.get(s, s) if isinstance(s, str) else s for s in shape]
            raise FormatError(f"{where}: graph input {name!r} has shape {list(got)}, the graph reads {shown}")
    return sizes


# ---------------------------------------------------------------------------------------------- valid regions

def tap_valid(taps: dict, T: int, lo: int, hi: int, allowed: np.ndarray | None = None) -> dict:
    """Valid regions of a call's taps: only the query rows lo..hi of the T slots are real tokens. Token axes:
    axis 2 of attention scores/probabilities [B, H, T, S], axis 1 of every other [B, T, ...] tap; states and
    other taps are all valid. Pad rows of a linear-attention tap hold zeros (don't-care as well).
    allowed [T, S] (True where a query may attend): attention scores are scored there only — a masked score is
    the mask constant plus noise, and would drown the real ones."""
    valid = {}
    for name, a in taps.items():
        if allowed is not None and name.endswith("attn_scores") and a.ndim == 4 and a.shape[2:] == allowed.shape:
            valid[name] = score_boxes(allowed, range(lo, hi), a.shape)
            continue
        axis = tap_token_axis(name)
        if axis is None or a.ndim <= axis or a.shape[axis] != T or (lo, hi) == (0, T):
            continue
        box = [[0, s] for s in a.shape]
        box[axis] = [lo, hi]
        valid[name] = [box]
    return valid


def tap_token_axis(name: str) -> int | None:
    """The token axis of a tap: 2 for attention scores / probabilities [B, H, T, S], none for the states (whole
    after the call), else 1 ([B, T, ...])."""
    if name.endswith(("conv_state", "recurrent_state")):
        return None
    return 2 if name.endswith(("attn_scores", "attn_probs")) else 1


def score_boxes(allowed: np.ndarray, rows, shape) -> list:
    """Boxes over [B, H, T, S] covering, for each query row in `rows`, the key slots allowed[row] marks."""
    boxes = []
    for r in rows:
        cols = np.flatnonzero(allowed[r])
        if cols.size:
            for run in np.split(cols, np.flatnonzero(np.diff(cols) > 1) + 1):  # contiguous runs of slots
                boxes.append([[0, shape[0]], [0, shape[1]], [r, r + 1], [int(run[0]), int(run[-1]) + 1]])
    return boxes


# ---------------------------------------------------------------------------------------------- graph I/O producers

def host_input() -> Node:
    """A graph input the host prepares from the prompt and the step alone (masks, positions, rotary tables)."""
    return Node("graph input", "prepared by the host")


def token_input() -> Node:
    """input_ids: a decode step's token is the previous call's greedy choice."""
    return Node("graph input", "prompt chunk, or argmax of the previous call's logits", ("prev:logits",))


def logits_output() -> Node:
    return Node("graph output", "logits = lm_head", ("lm_head",))


def cache_kinds(layer_type: str) -> tuple[str, str]:
    """The cache a layer's graph I/O carries, named by the static graphs' prefixes: KV or the GDN states."""
    return ("conv_state", "recurrent_state") if layer_type == "linear_attention" else ("past_key", "past_value")


def cache_tap(kind: str, i: int) -> str:
    """The tap a cache output of layer i holds: kind past_key (after RoPE), past_value, conv_state or
    recurrent_state."""
    a, g = f"model.layers.{i}.self_attn", f"model.layers.{i}.linear_attn"
    return {"past_key": f"{a}.k_rope", "past_value": f"{a}.v_proj", "conv_state": f"{g}.conv_state",
            "recurrent_state": f"{g}.recurrent_state"}[kind]


def state_output_node(kind: str, i: int) -> Node:
    """A static graph's GDN state output of layer i (kind conv_state or recurrent_state)."""
    formula = {"conv_state": "last S raw conv inputs", "recurrent_state": "S after the call, keys on rows"}[kind]
    return Node("graph output", formula, (cache_tap(kind, i),), layer=i)
