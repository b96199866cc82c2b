"""The dynamic convention: transformers' own calls — the whole prompt in one forward, then one token per call,
with the cache passed in and out (ONNX-export names). Shapes vary per step; nothing is padded.

  input_ids [1, T] int64, position_ids [1, T] int64
  past_key_values.{i}.key / .value [1, Hkv, P, D]      (attention layers, from step 1 on)
  past_conv_state.{i} [1, conv_dim, Kc], past_recurrent_state.{i} [1, Hv, Dk, Dv]   (linear attention, step 1 on)
outputs: logits [1, T, V]; present.{i}.key / .value [1, Hkv, P + T, D]; present_conv_state.{i},
present_recurrent_state.{i}.
"""

import dataclasses

import numpy as np

from ..graph import Node
from ..models.cache import KVCache, LinearAttentionState
from ..trace import trace
from .common import (
    Call,
    cache_input_shapes,
    cache_kinds,
    cache_tap,
    check_inputs,
    greedy,
    host_input,
    logits_output,
    next_token,
    prompt_list,
    tap_valid,
    token_input,
)


@dataclasses.dataclass(frozen=True)
class Options:
    """The dynamic convention has no options."""

    def check(self, model) -> None:
        """Nothing to check: every model runs dynamically."""

    def resolved(self, model) -> "Options":
        return self


def _state(cache, cfg, name) -> dict:
    """The cache's layers as graph tensors named by name(kind, i): state_input (past) or state_output (present)."""
    out = {}
    for i, layer in enumerate(cache.layers):
        if layer is None:
            continue
        if cfg.layer_types[i] == "linear_attention":
            out[name("conv_state", i)], out[name("recurrent_state", i)] = layer.conv, layer.recurrent
        else:
            out[name("past_key", i)], out[name("past_value", i)] = layer.keys.copy(), layer.values.copy()
    return out


def run(model, prompt_ids, opts: Options, decode_steps: int = 0, taps: str | None = None,
        decode_ids: list | None = None) -> list[Call]:
    """transformers' loop: the whole prompt in one call, then `decode_steps` greedy tokens one by one (or the
    given `decode_ids`: teacher forcing), the cache passed in and out. Returns every call's inputs and outputs (and
    the taps matching the regex `taps`)."""
    opts.check(model)
    cfg = model.config
    prompt = prompt_list(prompt_ids, "hf")
    cache, calls = model.new_cache(), []
    for step in range(1 + decode_steps):
        tokens = prompt if step == 0 else [next_token(greedy(calls[-1]), decode_ids, step - 1)]
        P = cache.seq_length
        inputs = {"input_ids": np.array([tokens], np.int64),
                  "position_ids": np.arange(P, P + len(tokens), dtype=np.int64)[None],
                  **_state(cache, cfg, state_input)}
        with trace(taps or "$^") as tr:  # "$^" matches nothing: no taps recorded
            logits = model.forward(inputs["input_ids"], cache=cache, position_ids=inputs["position_ids"])
        outputs = {"logits": logits, **_state(cache, cfg, state_output)}
        axes = {n: ("b,kvh,t,d" if ".key" in n or ".value" in n else "b,conv_dim,t" if "conv" in n
                    else "b,hv,dk,dv" if "recurrent" in n else "b,t,vocab" if n == "logits" else "b,t")
                for n in (*inputs, *outputs)}
        T = len(tokens)
        allowed = np.arange(P + T)[None, :] <= P + np.arange(T)[:, None]                 # causal [T, P+T]
        recorded = {n: tr[n] for n in tr.names()}
        calls.append(Call("prefill" if step == 0 else "decode", tokens, inputs, outputs, axes,
                          tap_valid(recorded, T, 0, T, allowed), recorded))
    return calls


def input_shapes(cfg, opts: Options) -> dict:
    """name -> shape of a call's inputs (T: tokens, P: cached positions, Kc: conv state columns); the cache inputs
    from the second call on."""
    Hkv, D = cfg.num_key_value_heads, cfg.head_dim
    return {"input_ids": (1, "T"), "position_ids": (1, "T"),
            **cache_input_shapes(cfg, state_input, (1, Hkv, "P", D), (1, Hkv, "P", D))}


def state_input(kind: str, i: int) -> str:
    """The graph input holding layer i's carried state `kind` (past_key, past_value, conv_state, recurrent_state)."""
    if kind in ("past_key", "past_value"):
        return f"past_key_values.{i}.{kind[len('past_'):]}"
    return f"past_{kind}.{i}"


def state_output(kind: str, i: int) -> str:
    """The graph output of layer i's state `kind` after the call (the KV cache: past entries then the new ones)."""
    if kind in ("past_key", "past_value"):
        return f"present.{i}.{kind[len('past_'):]}"
    return f"present_{kind}.{i}"


def io_nodes(cfg, params: dict | None) -> dict[str, Node]:
    """The producer of every graph input and output (refimpl.graph), in the graph's order. A cache input is the
    previous call's present; a present KV is the past entries then the new ones. params: none (no options)."""
    nodes = {"input_ids": token_input(), "position_ids": host_input()}
    for i, layer_type in enumerate(cfg.layer_types):
        for kind in cache_kinds(layer_type):
            nodes[state_input(kind, i)] = Node("host cache", "previous call's present",
                                               ("prev:" + state_output(kind, i),), layer=i)
    nodes["logits"] = logits_output()
    for i, layer_type in enumerate(cfg.layer_types):
        for kind in cache_kinds(layer_type):
            if kind.startswith("past_"):   # the KV cache: the past entries, then the new ones
                node = Node("graph output", "cache after the call (past + new)",
                            (state_input(kind, i), cache_tap(kind, i)), layer=i)
            else:
                node = Node("graph output", "state after the call", (cache_tap(kind, i),), layer=i)
            nodes[state_output(kind, i)] = node
    return nodes


def graph(model, inputs: dict, opts: Options) -> dict:
    """One call on its inputs alone (the cache rebuilt from past_* inputs): what `run` computes for that call."""
    cfg = model.config
    # a layer's cache inputs are read once its first one (key, conv state) is given: from the second call on
    first = {state_input(kind, i): state_input(cache_kinds(layer_type)[0], i)
             for i, layer_type in enumerate(cfg.layer_types) for kind in cache_kinds(layer_type)}
    shapes = {name: shape for name, shape in input_shapes(cfg, opts).items()
              if name not in first or first[name] in inputs}
    check_inputs(inputs, shapes, "hf")
    ids, positions = inputs["input_ids"].astype(np.int64), inputs["position_ids"].astype(np.int64)
    cache = model.new_cache()
    for i, kind in enumerate(cfg.layer_types):
        if kind == "linear_attention" and state_input("conv_state", i) in inputs:
            cache.layers[i] = LinearAttentionState(inputs[state_input("conv_state", i)].copy(),
                                                   inputs[state_input("recurrent_state", i)].copy())
        elif state_input("past_key", i) in inputs:
            k, v = inputs[state_input("past_key", i)], inputs[state_input("past_value", i)]
            cache.layers[i] = KVCache(k.copy(), v.copy(), k.shape[2])
            cache.mask = np.ones((1, k.shape[2]), np.int64)
    logits = model.forward(ids, cache=cache, position_ids=positions)
    return {"logits": logits, **_state(cache, cfg, state_output)}
