"""Qualcomm Genie / AI Hub static graphs (device_conventions.md §1-2; docs/conventions.md has the I/O table).

A graph takes AR token slots over a context of CL slots. The host splits the prompt into chunks of AR tokens and
pads one of them with `pad_id`: with pad_side="left" (AI Hub's host driver, `lm_driver/generator.py`) the chunks
are aligned to the end of the prompt and the pads lead the FIRST chunk; with pad_side="right" (the Genie runtime,
as AI Hub's Qwen3.5 graph code describes it) the chunks start at the prompt's start and the pads trail the LAST
chunk. It then decodes one token per call of the token graph (AR = decode_ar, padded on the same side).
Per call, with W = CL - AR cached slots and `cur` valid cached tokens, inputs in the exported graph's order
(AI Hub's `get_input_spec`: the fixed inputs, then each decoder layer's pair in layer order):

  input_ids           [1, AR] int32            the padded chunk
  attention_mask      [1, 1, AR, CL] float32   0 where allowed, else finfo.min clamped to mask_floor; key slots
                                               are [W - cur empty | cur cached | AR chunk]; causal over slots,
                                               pad slots masked
  position_ids_cos/sin [1, 1, AR, rot/2]       half-width tables at clip(cumsum(slot mask) - 1, 0, CL - 1)
  per layer i: past_key_{i}_in [Hkv, 1, D, W] (transposed; or [Hkv, 1, W, D]) and past_value_{i}_in
               [Hkv, 1, W, D] (left-padded shift window, oldest first), or conv_state_{i}_in [1, conv_dim, S]
               (the last S raw conv inputs; S = Kc as AI Hub exports it) and recurrent_state_{i}_in [1, Hv, Dk, Dv]
outputs: logits [1, AR, V], then per layer: past_key_{i}_out [Hkv, 1, D, AR] / past_value_{i}_out [Hkv, 1, AR, D]
(the new entries; or the updated window with kv_output="window"), or conv_state_{i}_out, recurrent_state_{i}_out.

Pads in Gated DeltaNet layers: the graph treats a chunk slot as padding when its own mask entry (the diagonal
of the chunk block) is masked, and pad steps leave the conv and recurrent state untouched on either side (as
AI Hub's graph does: a gathered conv window, zeroed k, v and decay on pads; recorded in the manifest).
Pad query rows and empty cache slots are don't-care: `valid` marks what may be scored.
"""

import dataclasses
import math

import numpy as np

from ..errors import FormatError, InputError
from ..graph import Node
from ..models.cache import Cache, KVCache, LinearAttentionState
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
    prompt_chunks,
    prompt_list,
    state_output_node,
    tap_valid,
    token_input,
)


@dataclasses.dataclass(frozen=True)
class Options:
    """Defaults are AI Hub's exported graph and host driver (qai-hub-models 0.65.0; tests/conformance/)."""
    ar: int = 128                   # token slots of the prompt graph (AI Hub's DEFAULT_SEQUENCE_LENGTH)
    cl: int = 4096                  # context length (AI Hub's DEFAULT_CONTEXT_LENGTH)
    decode_ar: int = 1              # token slots of the token graph
    pad_id: int | None = None       # default: the model's eos token
    pad_side: str = "left"          # "left": AI Hub's host driver; "right": the Genie runtime
    mask_floor: float = -100.0      # AI Hub's host driver clips at -100; Genie's fp16 runtime -1000, quantised -50
    key_transposed: bool = True     # past_key as [Hkv, 1, D, W] (True) or [Hkv, 1, W, D]
    kv_output: str = "new"          # "new": only the AR new entries; "window": the updated W-slot window
    k_prescale: bool = False        # scores as q . (k / sqrt(D))
    conv_state_len: int | None = None  # conv state columns S (hybrid models); default Kc, as AI Hub exports it

    def resolved(self, model) -> "Options":
        """The options with the model-dependent defaults filled in (what a manifest records)."""
        cfg = model.config
        return dataclasses.replace(self, pad_id=self.pad_id if self.pad_id is not None else eos_token(cfg, "genie"),
                                   conv_state_len=self.conv_state_len or (cfg.linear_conv_kernel_dim
                                                                          if cfg.is_hybrid else None))

    def check(self, model) -> None:
        """The options against what a Genie / AI Hub graph pair allows (InputError naming the allowed values): both
        graphs share the CL-slot context, so CL is a whole number of either graph's calls, and the token graph
        takes no more slots than the prompt graph."""
        cfg = model.config
        for name in ("ar", "cl", "decode_ar"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"genie: {name} must be a positive integer, got {value!r}")
        if self.ar >= self.cl or self.decode_ar >= self.cl:
            raise InputError(f"genie: AR ({self.ar}, token graph {self.decode_ar}) must be smaller than CL ({self.cl})")
        if self.decode_ar > self.ar:
            raise InputError(f"genie: the token graph's AR (decode_ar {self.decode_ar}) exceeds the prompt graph's "
                             f"({self.ar}); allowed: 1 to {self.ar}")
        for name, slots in (("AR", self.ar), ("decode AR", self.decode_ar)):
            if self.cl % slots:
                lower, upper = self.cl // slots * slots, -(-self.cl // slots) * slots
                allowed = " or ".join(str(c) for c in (lower, upper) if c > max(self.ar, self.decode_ar))
                raise InputError(f"genie: CL {self.cl} is not a multiple of the {name} {slots} (the context holds "
                                 f"whole calls); allowed nearby: {allowed}")
        if self.cl > cfg.max_position_embeddings:
            raise InputError(f"genie: CL {self.cl} exceeds the model's context (max_position_embeddings "
                             f"{cfg.max_position_embeddings})")
        if self.pad_side not in ("left", "right"):
            raise InputError(f"genie: pad_side must be 'left' or 'right', got {self.pad_side!r}")
        if self.kv_output not in ("new", "window"):
            raise InputError(f"genie: kv_output must be 'new' or 'window', got {self.kv_output!r}")
        if self.kv_output == "window" and max(self.ar, self.decode_ar) > self.cl - max(self.ar, self.decode_ar):
            raise InputError(f"genie: kv_output='window' needs AR <= CL - AR (the window must hold a call's new "
                             f"entries); AR {max(self.ar, self.decode_ar)}, CL {self.cl}")
        if self.pad_id is not None and (not isinstance(self.pad_id, int) or not 0 <= self.pad_id < cfg.vocab_size):
            raise InputError(f"genie: pad_id {self.pad_id} is outside the vocabulary [0, {cfg.vocab_size})")
        if not isinstance(self.mask_floor, (int, float)) or not -math.inf < self.mask_floor < 0:
            raise InputError(f"genie: mask_floor must be a finite negative number, got {self.mask_floor}")
        for name in ("key_transposed", "k_prescale"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"genie: {name} must be true or false, got {getattr(self, name)!r}")
        if "sliding_attention" in cfg.layer_types:
            raise InputError("genie: sliding-window layers need a second mask input, which this convention lacks")
        if self.conv_state_len is not None:
            Kc = cfg.linear_conv_kernel_dim
            if not cfg.is_hybrid:
                raise InputError("genie: conv_state_len applies to hybrid (Gated DeltaNet) models only")
            if not isinstance(self.conv_state_len, int) or not Kc - 1 <= self.conv_state_len <= self.cl:
                raise InputError(f"genie: conv_state_len must be an integer from Kc - 1 = {Kc - 1} to CL = {self.cl}, "
                                 f"got {self.conv_state_len!r}")


def _window(entries: np.ndarray, W: int) -> np.ndarray:
    """Cached entries [Hkv, cur, D] -> the left-padded window [Hkv, W, D] (empty slots are zeros)."""
    Hkv, cur, D = entries.shape
    return np.concatenate([np.zeros((Hkv, W - cur, D), entries.dtype), entries], axis=1)


def input_shapes(cfg, opts: Options) -> dict:
    """name -> shape of the graph's inputs (AR: token slots, CL: context, W = CL - AR: cached entries, R: rotary
    pairs, Kc: conv state columns)."""
    Hkv, D = cfg.num_key_value_heads, cfg.head_dim
    shapes = {"input_ids": (1, "AR"), "attention_mask": (1, 1, "AR", "CL"), "position_ids_cos": (1, 1, "AR", "R"),
              "position_ids_sin": (1, 1, "AR", "R")}
    key = (Hkv, 1, D, "W") if opts.key_transposed else (Hkv, 1, "W", D)
    return {**shapes, **cache_input_shapes(cfg, state_input, key, (Hkv, 1, "W", D))}


def state_input(kind: str, i: int) -> str:
    """The graph input holding layer i's carried state `kind` (past_key, past_value, conv_state, recurrent_state)."""
    return f"{kind}_{i}_in"


def state_output(kind: str, i: int) -> str:
    """The graph output of layer i's state `kind` after the call (the new KV entries, or the window)."""
    return f"{kind}_{i}_out"


def io_nodes(cfg, params: dict | None) -> dict[str, Node]:
    """The producer of every graph input and output (refimpl.graph), in the exported graph's order. A cache input
    is the host's window of earlier calls' outputs. params: the manifest's convention.params; with
    kv_output="window" the KV outputs hold the cached entries too, so they read the KV inputs."""
    window = (params or {}).get("kv_output") == "window"
    nodes = {"input_ids": token_input(), "attention_mask": host_input(), "position_ids_cos": host_input(),
             "position_ids_sin": host_input()}
    for i, layer_type in enumerate(cfg.layer_types):
        for kind in cache_kinds(layer_type):
            nodes[state_input(kind, i)] = Node("host cache", "window of earlier calls' outputs",
                                           ("prev:" + state_output(kind, i), "prev:" + state_input(kind, i)), layer=i)
    nodes["logits"] = logits_output()
    for i, layer_type in enumerate(cfg.layer_types):
        for kind in cache_kinds(layer_type):
            is_kv = kind.startswith("past_")
            nodes[state_output(kind, i)] = _kv_output(kind, i, window) if is_kv else state_output_node(kind, i)
    return nodes


def _kv_output(kind: str, i: int, window: bool) -> Node:
    if window:
        return Node("graph output", "the updated window: cached entries then the new ones",
                    (cache_tap(kind, i), state_input(kind, i)), layer=i)
    formula = {"past_key": "new keys after RoPE (transposed [Hkv, 1, D, T] unless configured)",
               "past_value": "new values [Hkv, 1, T, D]"}[kind]
    return Node("graph output", formula, (cache_tap(kind, i),), layer=i)


def graph(model, inputs: dict, opts: Options) -> dict:
    """Run the static graph on its inputs, as the device does: returns its outputs."""
    cfg = model.config
    sizes = check_inputs(inputs, input_shapes(cfg, opts), "genie")
    if sizes.get("W", sizes["CL"] - sizes["AR"]) != sizes["CL"] - sizes["AR"]:
        raise FormatError(f"genie: the cache inputs hold {sizes['W']} entries, CL - AR = {sizes['CL'] - sizes['AR']}")
    ids = inputs["input_ids"].astype(np.int64)
    AR, CL = ids.shape[1], inputs["attention_mask"].shape[-1]
    W = CL - AR
    cache = Cache(cfg.num_hidden_layers, 1)
    for i, kind in enumerate(cfg.layer_types):
        if kind == "linear_attention":
            cache.layers[i] = LinearAttentionState(inputs[state_input("conv_state", i)],
                                                   inputs[state_input("recurrent_state", i)])
        else:
            k = inputs[state_input("past_key", i)][:, 0]                      # [Hkv, D, W] or [Hkv, W, D]
            k = k.swapaxes(1, 2) if opts.key_transposed else k
            cache.layers[i] = KVCache(k[None].copy(), inputs[state_input("past_value", i)][:, 0][None].copy(), W)
    mask = inputs["attention_mask"]                                           # [1, 1, AR, CL]
    real = np.diagonal(mask[0, 0, :, W:]) == 0                                # a slot attends to itself iff real
    ctx = Context(inputs["position_ids_cos"][0], inputs["position_ids_sin"][0],
                  {"full_attention": mask}, cache, None if real.all() else real[None].astype(np.int64),
                  k_prescale=opts.k_prescale)
    outputs = {"logits": model.run(ids, ctx)}
    for i, kind in enumerate(cfg.layer_types):
        state = cache.layers[i]
        if kind == "linear_attention":
            outputs[state_output("conv_state", i)] = state.conv
            outputs[state_output("recurrent_state", i)] = state.recurrent
            continue
        keys, values = state.keys[0], state.values[0]                         # [Hkv, W + AR, D]
        keys, values = (keys[:, W:], values[:, W:]) if opts.kv_output == "new" else (keys[:, -W:], values[:, -W:])
        outputs[state_output("past_key", i)] = (keys.swapaxes(1, 2) if opts.key_transposed else keys)[:, None]
        outputs[state_output("past_value", i)] = values[:, None]
    return outputs


def run(model, prompt_ids, opts: Options, decode_steps: int = 0, taps: str | None = None,
        decode_ids: list | None = None) -> list[Call]:
    """The host loop: prompt chunks through the prompt graph, then `decode_steps` greedy tokens through the
    token graph (or the given `decode_ids`: teacher forcing). Returns every call's inputs and outputs (and the
    taps matching the regex `taps`)."""
    opts.check(model)
    opts = opts.resolved(model)
    cfg, dtype = model.config, model.dtype.type
    prompt = prompt_list(prompt_ids, "genie")
    pad_id = check_pad_id(opts.pad_id, cfg, "genie")
    Hkv, D = cfg.num_key_value_heads, cfg.head_dim
    attn = [i for i, k in enumerate(cfg.layer_types) if k != "linear_attention"]
    kv = {i: (np.zeros((Hkv, 0, D), dtype), np.zeros((Hkv, 0, D), dtype)) for i in attn}   # real tokens only
    states = {i: zero_state(cfg, dtype, opts.conv_state_len) for i, k in enumerate(cfg.layer_types)
              if k == "linear_attention"}
    chunks = [("prompt", opts.ar, c) for c in prompt_chunks(prompt, opts.ar, opts.pad_side)]
    calls, cur = [], 0
    for step in range(len(chunks) + decode_steps):
        if step < len(chunks):
            name, AR, tokens = chunks[step]
        else:
            name, AR, tokens = "token", opts.decode_ar, [next_token(greedy(calls[-1]), decode_ids, step - len(chunks))]
        W, n = opts.cl - AR, len(tokens)
        if cur > W:
            raise InputError(f"genie: context length CL={opts.cl} is too small: call {step} ({name} graph, AR={AR}) "
                             f"needs {cur} cached tokens but its window holds CL - AR = {W}")
        lo, hi = (AR - n, AR) if opts.pad_side == "left" else (0, n)                # the real slots of the chunk
        chunk_mask = np.zeros(AR)
        chunk_mask[lo:hi] = 1
        mask1d = np.concatenate([np.zeros(W - cur), np.ones(cur), chunk_mask])                   # [CL]
        allowed = (mask1d[None, :] == 1) & (np.arange(opts.cl)[None, :] <= W + np.arange(AR)[:, None])
        mask = np.maximum(np.where(allowed, 0, np.finfo(np.float32).min), opts.mask_floor).astype(dtype)
        positions = np.clip(np.cumsum(mask1d) - 1, 0, opts.cl - 1)[-AR:].astype(np.int64)
        cos, sin = model.rope(positions[None], None)                                             # [1, AR, rot/2]
        ids = np.full((1, AR), pad_id, np.int32)
        ids[0, lo:hi] = tokens
        inputs = {"input_ids": ids, "attention_mask": mask[None, None], "position_ids_cos": cos[None],
                  "position_ids_sin": sin[None]}
        for i, kind in enumerate(cfg.layer_types):   # the exported graph's order: each layer's pair, layer by layer
            if kind == "linear_attention":
                inputs[state_input("conv_state", i)] = states[i].conv
                inputs[state_input("recurrent_state", i)] = states[i].recurrent
            else:
                keys, values = _window(kv[i][0], W), _window(kv[i][1], W)
                inputs[state_input("past_key", i)] = (keys.swapaxes(1, 2) if opts.key_transposed else keys)[:, None]
                inputs[state_input("past_value", i)] = values[:, None]
        with trace(taps or "$^") as tr:  # "$^" matches nothing: no taps recorded
            outputs = graph(model, inputs, opts)
        for i in attn:  # the host appends the new real entries to its cache
            keys = outputs[state_output("past_key", i)][:, 0]
            keys = keys.swapaxes(1, 2) if opts.key_transposed else keys
            new = slice(W - AR + lo, W - AR + hi) if opts.kv_output == "window" else slice(lo, hi)
            kv[i] = (np.concatenate([kv[i][0], keys[:, new]], 1),
                     np.concatenate([kv[i][1], outputs[state_output("past_value", i)][:, 0][:, new]], 1))
        for i in states:
            states[i] = LinearAttentionState(outputs[state_output("conv_state", i)],
                                             outputs[state_output("recurrent_state", i)])
        taps_ = {t: tr[t] for t in tr.names()}
        valid = {**_valid(outputs, lo, hi, AR, W, cur, opts), **_window_valid(inputs, W, cur, opts),
                 **tap_valid(taps_, AR, lo, hi, allowed)}
        calls.append(Call(name, tokens, inputs, outputs, _axes(inputs, outputs, opts), valid, taps_))
        cur += n
    return calls


def _axes(inputs: dict, outputs: dict, opts: Options) -> dict:
    axes = {"input_ids": "b,t", "attention_mask": "b,1,t,ctx", "position_ids_cos": "b,1,t,rot_half",
            "position_ids_sin": "b,1,t,rot_half", "logits": "b,t,vocab"}
    for name in (*inputs, *outputs):
        if name.startswith("past_key_"):
            axes[name] = "kvh,b,d,t" if opts.key_transposed else "kvh,b,t,d"
        elif name.startswith("past_value_"):
            axes[name] = "kvh,b,t,d"
        elif name.startswith("conv_state_"):
            axes[name] = "b,conv_dim,t"
        elif name.startswith("recurrent_state_"):
            axes[name] = "b,hv,dk,dv"
    return axes


def _window_valid(inputs: dict, W: int, cur: int, opts: Options) -> dict:
    """Empty slots of the input KV windows (the first W - cur) are don't-care."""
    valid = {}
    for name, a in inputs.items():
        if name.startswith(("past_key_", "past_value_")):
            t_axis = 3 if name.startswith("past_key_") and opts.key_transposed else 2
            box = [[0, s] for s in a.shape]
            box[t_axis] = [W - cur, W]
            valid[name] = [box]
    return valid


def _valid(outputs: dict, lo: int, hi: int, AR: int, W: int, cur: int, opts: Options) -> dict:
    """Don't-care regions: pad query rows of the logits and of the new KV entries, empty window slots. The real
    slots of the chunk are lo..hi."""
    valid = {"logits": [[[0, 1], [lo, hi], [0, outputs["logits"].shape[-1]]]]}
    for name, a in outputs.items():
        if name.startswith(("past_key_", "past_value_")):
            t_axis = 3 if name.startswith("past_key_") and opts.key_transposed else 2
            # new: the chunk's AR slots; window: the last W of [W - cur empty | cur cached | AR chunk]
            spans = [(lo, hi)] if opts.kv_output == "new" else [(max(W - cur - AR, 0), max(W - AR, 0)),
                                                                (W - AR + lo, W - AR + hi)]
            boxes = []
            for a_lo, a_hi in spans:
                if a_hi > a_lo:
                    box = [[0, s] for s in a.shape]
                    box[t_axis] = [a_lo, a_hi]
                    boxes.append(box)
            valid[name] = boxes
    return valid
