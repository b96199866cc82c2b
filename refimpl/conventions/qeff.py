"""QEfficient (Cloud AI 100) static graphs (device_conventions.md §3).

Calls of `seq_len` slots over a full-context KV of `ctx_len` positions; the prompt is split into chunks of
seq_len, the last chunk RIGHT-padded with `pad_id` and `position_ids = -1` on pads; decode calls have one slot
at position max + 1. Per call:

  input_ids            [1, S] int64;   position_ids [1, S] int64 (-1 on pads)
  past_key.{i}         [1, Hkv, ctx_len, D]  (not transposed; slot = position)   past_value.{i} likewise
  conv_state.{i}       [1, conv_dim, Kc - 1];  recurrent_state.{i} [1, Hv, Dk, Dv]   (linear-attention layers)
outputs: logits [1, S, V]; past_key.{i}_RetainedState / past_value.{i}_RetainedState [1, Hkv, ctx_len, D] (the
new entries scattered at their positions, pad writes dropped); conv_state.{i}_RetainedState,
recurrent_state.{i}_RetainedState.

Inside the graph a query at position p sees the slots j <= p. QEfficient masks with -inf, which makes a pad
row NaN; refimpl uses finfo.min (pad rows are don't-care either way). Pad steps leave the GDN conv and recurrent
states untouched, as QEfficient's port does (g = beta = 0, q = k = v = 0, position-ordered conv window).
"""

import dataclasses

import numpy as np

from ..errors import InputError
from ..graph import Node
from ..models.cache import Cache, LinearAttentionState
from ..models.hybrid import zero_state
from ..models.model import Context
from ..trace import trace
from .common import (
    Call,
    cache_input_shapes,
    cache_kinds,
    cache_tap,
    check_inputs,
    check_pad_id,
    eos_token,
    greedy,
    host_input,
    logits_output,
    next_token,
    prompt_list,
    state_output_node,
    tap_valid,
    token_input,
)


@dataclasses.dataclass(frozen=True)
class Options:
    seq_len: int = 32
    ctx_len: int = 128
    pad_id: int | None = None       # default: the model's pad token, else eos

    def check(self, model) -> None:
        for name in ("seq_len", "ctx_len"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise InputError(f"qeff: {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.seq_len > self.ctx_len:
            raise InputError(f"qeff: seq_len ({self.seq_len}) must not exceed ctx_len ({self.ctx_len})")
        if self.ctx_len > model.config.max_position_embeddings:
            raise InputError(f"qeff: ctx_len {self.ctx_len} exceeds the model's context (max_position_embeddings "
                             f"{model.config.max_position_embeddings})")
        vocab = model.config.vocab_size
        if self.pad_id is not None and (not isinstance(self.pad_id, int) or not 0 <= self.pad_id < vocab):
            raise InputError(f"qeff: pad_id {self.pad_id} is outside the vocabulary [0, {vocab})")
        if "sliding_attention" in model.config.layer_types:
            raise InputError("qeff: sliding-window layers are not supported by this convention")

    def resolved(self, model) -> "Options":
        """The options with the model-dependent default filled in: pad id = the model's pad token, else eos."""
        cfg = model.config
        return dataclasses.replace(self, pad_id=self.pad_id if self.pad_id is not None else
                                   cfg.pad_token_id if cfg.pad_token_id is not None else eos_token(cfg, "qeff"))


class ScatterCache(Cache):
    """KV slots indexed by position: new entries are written at their position ids (CtxScatter), pads dropped."""

    def __init__(self, num_layers: int, kv: dict, positions: np.ndarray):
        super().__init__(num_layers, 1)
        self.kv, self.positions = kv, positions

    def append_kv(self, layer, keys, values):   # keys [1, Hkv, S, D] -> the full [1, Hkv, ctx_len, D] slots
        k, v = self.kv[layer]
        k, v = k.copy(), v.copy()
        real = self.positions >= 0
        k[:, :, self.positions[real]] = keys[:, :, real]
        v[:, :, self.positions[real]] = values[:, :, real]
        self.kv[layer] = (k, v)
        return k, v


def input_shapes(cfg, opts: Options) -> dict:
    """name -> shape of the graph's inputs (S: token slots, C: ctx_len, Kc: conv state columns)."""
    Hkv, D = cfg.num_key_value_heads, cfg.head_dim
    return {"input_ids": (1, "S"), "position_ids": (1, "S"),
            **cache_input_shapes(cfg, state_input, (1, Hkv, "C", D), (1, Hkv, "C", D))}


def state_input(kind: str, i: int) -> str:
    """The graph input holding layer i's carried state `kind` (past_key, past_value, conv_state, recurrent_state)."""
    return f"{kind}.{i}"


def state_output(kind: str, i: int) -> str:
    """The graph output of layer i's state `kind` after the call (the cache with the new entries scattered in)."""
    return f"{kind}.{i}_RetainedState"


def io_nodes(cfg, params: dict | None) -> dict[str, Node]:
    """The producer of every graph input and output (refimpl.graph), in the graph's order. A cache input is the
    previous call's retained state; the KV outputs are the cache inputs with the new entries scattered in.
    params: the manifest's convention.params (no option changes a producer)."""
    nodes = {"input_ids": token_input(), "position_ids": host_input()}
    for i, layer_type in enumerate(cfg.layer_types):
        for kind in cache_kinds(layer_type):
            nodes[state_input(kind, i)] = Node("host cache", "previous call's retained state",
                                        ("prev:" + state_output(kind, i),), layer=i)
    nodes["logits"] = logits_output()
    for i, layer_type in enumerate(cfg.layer_types):
        for kind in cache_kinds(layer_type):
            if kind.startswith("past_"):   # the cache input, the new entries written at their positions
                node = Node("graph output", "scattered at the tokens' positions",
                            (cache_tap(kind, i), state_input(kind, i)), layer=i)
            else:
                node = state_output_node(kind, i)
            nodes[state_output(kind, i)] = node
    return nodes


def graph(model, inputs: dict, opts: Options) -> dict:
    """One call of the graph on its inputs, as the device runs it: returns its outputs."""
    cfg = model.config
    check_inputs(inputs, input_shapes(cfg, opts), "qeff")
    ids, positions = inputs["input_ids"].astype(np.int64), inputs["position_ids"][0].astype(np.int64)
    attn = [i for i, kind in enumerate(cfg.layer_types) if kind != "linear_attention"]
    kv = {i: (inputs[state_input("past_key", i)], inputs[state_input("past_value", i)]) for i in attn}
    cache = ScatterCache(cfg.num_hidden_layers, kv, positions)
    for i, kind in enumerate(cfg.layer_types):
        if kind == "linear_attention":
            cache.layers[i] = LinearAttentionState(inputs[state_input("conv_state", i)],
                                                   inputs[state_input("recurrent_state", i)])
    allowed = _allowed(inputs, positions)                                                   # [S, ctx_len]
    dtype = model.dtype.type
    mask = np.where(allowed, dtype(0), np.finfo(dtype).min)[None, None]
    real = positions >= 0
    cos, sin = model.rope(np.maximum(positions, 0)[None], None)
    ctx = Context(cos, sin, {"full_attention": mask}, cache, None if real.all() else real[None].astype(np.int64))
    outputs = {"logits": model.run(ids, ctx)}
    for i, kind in enumerate(cfg.layer_types):
        if kind == "linear_attention":
            outputs[state_output("conv_state", i)] = cache.layers[i].conv
            outputs[state_output("recurrent_state", i)] = cache.layers[i].recurrent
        else:
            outputs[state_output("past_key", i)], outputs[state_output("past_value", i)] = cache.kv[i]
    return outputs


def run(model, prompt_ids, opts: Options, decode_steps: int = 0, taps: str | None = None,
        decode_ids: list | None = None) -> list[Call]:
    opts.check(model)
    cfg, dtype = model.config, model.dtype.type
    prompt = prompt_list(prompt_ids, "qeff")
    if len(prompt) + decode_steps > opts.ctx_len:
        raise InputError(f"qeff: ctx_len {opts.ctx_len} is too small for {len(prompt)} prompt tokens + "
                         f"{decode_steps} decode steps")
    pad_id = check_pad_id(opts.resolved(model).pad_id, cfg, "qeff")
    Hkv, D = cfg.num_key_value_heads, cfg.head_dim
    state = {}
    for i, kind in enumerate(cfg.layer_types):
        if kind == "linear_attention":
            zero = zero_state(cfg, dtype, cfg.linear_conv_kernel_dim - 1)
            state[state_input("conv_state", i)], state[state_input("recurrent_state", i)] = zero.conv, zero.recurrent
        else:
            state[state_input("past_key", i)] = np.zeros((1, Hkv, opts.ctx_len, D), dtype)
            state[state_input("past_value", i)] = np.zeros((1, Hkv, opts.ctx_len, D), dtype)
    chunks = [("prefill", prompt[s:s + opts.seq_len]) for s in range(0, len(prompt), opts.seq_len)]
    calls, next_pos = [], 0
    for step in range(len(chunks) + decode_steps):
        if step < len(chunks):
            graph_name, tokens = chunks[step]
            S = opts.seq_len
        else:
            graph_name, tokens, S = "decode", [next_token(greedy(calls[-1]), decode_ids, step - len(chunks))], 1
        n = len(tokens)
        positions = np.concatenate([np.arange(next_pos, next_pos + n), -np.ones(S - n, np.int64)])
        inputs = {"input_ids": np.array([tokens + [pad_id] * (S - n)], np.int64),
                  "position_ids": positions[None].astype(np.int64), **state}
        with trace(taps or "$^") as tr:  # "$^" matches nothing: no taps recorded
            outputs = graph(model, inputs, opts)
        state = {state_input(kind, i): outputs[state_output(kind, i)]   # retained: the next call's cache
                 for i, layer_type in enumerate(cfg.layer_types) for kind in cache_kinds(layer_type)}
        valid = {"logits": [[[0, 1], [0, n], [0, cfg.vocab_size]]]}
        for name, a in outputs.items():   # KV slots not yet written are don't-care
            if name.startswith("past_"):
                valid[name] = [[[0, 1], [0, Hkv], [0, next_pos + n], [0, D]]]
        for name, a in inputs.items():
            if name.startswith("past_"):
                valid[name] = [[[0, 1], [0, Hkv], [0, next_pos], [0, D]]]
        axes = {name: _axes(name) for name in (*inputs, *outputs)}
        recorded = {t: tr[t] for t in tr.names()}
        allowed = _allowed(inputs, positions)
        calls.append(Call(graph_name, tokens, inputs, outputs, axes, {**valid, **tap_valid(recorded, S, 0, n, allowed)},
                          recorded))
        next_pos += n
    return calls


def _allowed(inputs: dict, positions: np.ndarray) -> np.ndarray:
    """[S, ctx_len]: a query at position p sees the slots j <= p; a pad (position -1) sees none."""
    ctx_len = next((a.shape[2] for name, a in inputs.items() if name.startswith("past_key.")), 1)
    return (np.arange(ctx_len)[None, :] <= positions[:, None]) & (positions[:, None] >= 0)


def _axes(name: str) -> str:
    if name in ("input_ids", "position_ids"):
        return "b,t"
    if name == "logits":
        return "b,t,vocab"
    if name.startswith("past_"):
        return "b,kvh,ctx,d"
    if name.startswith("conv_state"):
        return "b,conv_dim,t"
    return "b,hv,dk,dv"
