"""Dumps taken with module hooks on an HF-style PyTorch implementation (transformers' modeling code, a fork of it,
an export of it): their names and layouts, read into the bundle's taps (docs/diff.md, "PyTorch-style dumps").

A hook dump names each tensor after what produced it:

    <module path>                   a module's output (the first tensor of a tuple output)
    <module path>.<i>               the i-th tensor of a tuple output (eager attention's weights: self_attn.1)
    <module path>.input[.<i>]       a leaf module's (i-th) positional input (o_proj's input: the attention output)
    <module path>.<function>[.<i>]  a function called inside that module (apply_rotary_pos_emb, causal_conv1d_fn, ...)
    <module path>.<function>.input.<i> / .<keyword>   its positional / keyword tensor arguments (the gated delta
                                    rule's v, g and beta)

and keeps the module's own layout. `rename` maps the names that are not tap names already (RENAMES); a fused
projection (vLLM-style `qkv_proj`, `gate_up_proj`) holds several taps side by side on its last axis, in the
order the name says, each read as its slice. `readings` lists the layout readings a tap's dumped array may need,
by shape:

    reshape         the same elements in C order: flattened rows [B*T, X] or [B*T*H, D] (MoE blocks and routers,
                    the gated norm) for [B, T, ..., D]; heads split [B, T, H, D] for [B, T, H*D]
    heads_first     [B, H, T, D] (q / k after RoPE, as attention consumes them) for [B, T, H, D]
    channels_first  [B, C, T] (the conv path) for [B, T, C]; the conv's input and output also with the state's
                    columns in front, [B, C, S + T] (a continued chunk: the conv runs over [state | x])
    repeated_heads  q / k of the delta rule repeated to the value heads, [B, T, Hv, Dk] for [B, T, Hk, Dk]
                    (repeat_interleave: transformers' recurrent rule l2-normalises them there), read only where
                    every repeat holds the same values (each key head once)
    padded_conv     nn.Conv1d(padding=K-1)'s raw output [B, C, T + K - 1] for the conv1d tap: its first T columns;
                    over [state | x] (a static graph's prompt call, S state columns in front), [B, C, S + T + K - 1]:
                    the T columns before the last K - 1 (tried before the state-in-front reading's last T)

Readings apply to taps only: a tap has no device contract, so reading it in its module's layout is not a mix-up.
Graph inputs and outputs keep their contract, and the layout adapters of refimpl.diff.layouts flag mix-ups there.
The taps themselves are the modules' outputs (docs/taps.md: conv1d before its silu, shared_expert_gate's logit),
so no reading changes a value; declaring `--layout hf-hooks` only makes the hook readings win over an as-is
reading where both fit.
"""

import math
import re

import numpy as np

# hook name (after "model.layers.<i>.") -> the tap it holds (the first of "a|b" the bundle has; "a+b+c": a fused
# projection, the taps' last axes side by side) and the layout its source always has (None: known by shape), e.g.
# apply_rotary_pos_emb's [B, H, T, D] even when T == H
RENAMES = (
    (r"self_attn\.1", "self_attn.attn_probs", None),
    (r"self_attn\.apply_rotary_pos_emb(\.0)?", "self_attn.q_rope", "heads_first"),
    (r"self_attn\.apply_rotary_pos_emb\.1", "self_attn.k_rope", "heads_first"),
    (r"self_attn\.eager_attention_forward(\.0)?", "self_attn.attn_output", "reshape"),
    (r"self_attn\.eager_attention_forward\.1", "self_attn.attn_probs", None),
    (r"self_attn\.o_proj\.input(\.0)?", "self_attn.gated_output|self_attn.attn_output", None),
    (r"post_attention_layernorm\.input(\.0)?", "attn_residual", None),
    (r"mlp\.down_proj\.input(\.0)?", "mlp.hidden", None),
    (r"mlp\.shared_expert\.down_proj\.input(\.0)?", "mlp.shared_expert.hidden", None),
    (r"mlp\.gate(\.0)?", "mlp.router_logits", None),
    (r"mlp\.gate\.1", "mlp.routing_weights", None),
    (r"mlp\.gate\.2", "mlp.selected_experts", None),
    (r"linear_attn\.causal_conv1d_(fn|update)\.input(\.0)?", "linear_attn.mixed_qkv", "channels_first"),
    (r"linear_attn\.causal_conv1d_(fn|update)(\.0)?", "linear_attn.conv1d_silu", "channels_first"),
    (r"linear_attn\.torch_(chunk|recurrent)_gated_delta_rule\.input\.2", "linear_attn.v", None),
    (r"linear_attn\.torch_(chunk|recurrent)_gated_delta_rule\.(g|beta)", r"linear_attn.\2", None),
    (r"linear_attn\.torch_(chunk|recurrent)_gated_delta_rule(\.0)?", "linear_attn.core", None),
    (r"linear_attn\.torch_(chunk|recurrent)_gated_delta_rule\.1", "linear_attn.recurrent_state", None),
    # AI Hub's Qwen3.5 graph code (qai-hub-models: templates/qwen3_5/model_adaptations.py) hooked at its functions:
    # gated_delta_rule(query, key, value, g, beta, state, valid) -> (core, state), _conv_with_state -> (silu(conv),
    # the new conv state), both channels as transformers' (query / key there are repeated to the value heads)
    (r"linear_attn\.gated_delta_rule\.value", "linear_attn.v", None),
    (r"linear_attn\.gated_delta_rule\.(g|beta)", r"linear_attn.\1", None),
    (r"linear_attn\.gated_delta_rule(\.0)?", "linear_attn.core", None),
    (r"linear_attn\.gated_delta_rule\.1", "linear_attn.recurrent_state", None),
    (r"linear_attn\._conv_with_state\.mixed_qkv", "linear_attn.mixed_qkv", "channels_first"),
    (r"linear_attn\._conv_with_state(\.0)?", "linear_attn.conv1d_silu", "channels_first"),
    (r"linear_attn\._conv_with_state\.1", "linear_attn.conv_state", None),
    (r"linear_attn\.norm\.input\.0", "linear_attn.core", "reshape"),
    (r"linear_attn\.norm\.input\.1", "linear_attn.z", "reshape"),
    # block outputs that are a tap: a dense MLP's (and a shared expert's) is its down projection, attention's its
    # o_proj (the first tensor of its tuple), a linear-attention block's its out_proj (a MoE block's `mlp` is a tap)
    (r"mlp", "mlp|mlp.down_proj", None),
    (r"mlp\.shared_expert", "mlp.shared_expert.down_proj", None),
    (r"self_attn(\.0)?", "self_attn.o_proj", None),
    (r"linear_attn(\.0)?", "linear_attn.out_proj", None),
    (r"self_attn\.qkv_proj", "self_attn.q_proj+self_attn.k_proj+self_attn.v_proj", "split"),
    (r"mlp\.(shared_expert\.)?gate_up_proj", r"mlp.\1gate_proj+mlp.\1up_proj", "split"),
)
_LAYER = re.compile(r"(model\.layers\.\d+\.)(.+)")
DECLARED = "hf-hooks"


def rename(name: str) -> tuple[list[list[str]], str | None]:
    """The taps a hook name may hold, as alternatives in preference order, each a list of taps (several: a fused
    projection split along its last axis), and the reading its source implies ([], None if it is no hook name)."""
    m = _LAYER.fullmatch(name)
    if not m:
        return [], None
    for pattern, taps, reading in RENAMES:
        hit = re.fullmatch(pattern, m[2])
        if hit:
            return [[m[1] + t for t in alt.split("+")] for alt in hit.expand(taps).split("|")], reading
    return [], None


def readings(a: np.ndarray, name: str, shape: tuple, conv_kernel: int | None, source: str | None = None) -> list:
    """[(reading, array in the tap's layout)] for a hooked array `a` of tap `name` (bundle shape `shape`).
    source: the reading the hook's source implies (rename), the only one tried when given."""
    out = []
    same_rows = a.ndim >= 2 and a.shape[-1] == shape[-1] or a.ndim >= 3 and a.shape[:2] == tuple(shape[:2])
    if a.size == math.prod(shape) and a.ndim != len(shape) and same_rows:
        out.append(("reshape", a.reshape(shape)))
    if a.ndim == 4 and len(shape) == 4 and a.shape == (shape[0], shape[2], shape[1], shape[3]) \
            and (shape[1] != shape[2] or source == "heads_first"):
        out.append(("heads_first", a.swapaxes(1, 2)))
    if a.ndim == 4 and len(shape) == 3 and a.shape[0] == shape[0] and a.shape[2] == shape[1] \
            and a.shape[1] * a.shape[3] == shape[2] and (a.shape[1] != a.shape[2] or source == "heads_first"):
        out.append(("heads_first", a.swapaxes(1, 2).reshape(shape)))   # [B, H, T, D] for [B, T, H*D]
    if a.ndim == 4 and len(shape) == 4 and name.endswith(("linear_attn.q", "linear_attn.k")) and a.shape[2] > shape[2] \
            and a.shape[2] % shape[2] == 0 and (*a.shape[:2], a.shape[3]) == (*shape[:2], shape[3]):
        r = a.shape[2] // shape[2]                                     # each key head repeated to r value heads
        if all(np.array_equal(a[:, :, i::r], a[:, :, ::r]) for i in range(1, r)):
            out.append(("repeated_heads", a[:, :, ::r]))
    if a.ndim == 3 and len(shape) == 3 and a.shape[:2] == (shape[0], shape[2]) and a.shape[2] >= shape[1]:
        T, columns = shape[1], a.shape[2]
        padded = name.endswith("linear_attn.conv1d") and conv_kernel and columns >= T + conv_kernel - 1 \
            and source != "channels_first"
        if padded:   # over [state (S >= 0 columns) | x], K - 1 zeros each side: its T real outputs end K - 1 early
            end = columns - (conv_kernel - 1)
            out.append(("padded_conv", a[..., end - T:end].swapaxes(1, 2)))
        stateless_padded = padded and columns == T + conv_kernel - 1          # the padded reading only
        if not stateless_padded and (
                name.endswith(("linear_attn.conv1d", "linear_attn.conv1d_silu", "linear_attn.mixed_qkv")) or
                columns == T and (shape[1] != shape[2] or source == "channels_first")):   # [B, T, T]: as is
            out.append(("channels_first", a[..., columns - T:].swapaxes(1, 2)))
    if source is not None:
        out = [r for r in out if r[0] == source]
    return [(f"{DECLARED}:{r}", v) for r, v in out]
