"""What produces each tensor of a graph call: its op, layer, formula and direct inputs (the layer DAG).

    node = producer(cfg, "model.layers.3.self_attn.q_norm")
    node.op, node.layer, node.formula, node.inputs   # "rms_norm", 3, "...", ["model.layers.3.self_attn.q_proj"]

Names are tap names (docs/taps.md) and graph I/O names of the conventions (genie, qeff, hf). Inputs that a
convention does not have (e.g. `position_ids_cos` in the hf convention) are simply absent from a bundle; the
first-divergence walk (refimpl.diff.compare) skips to the nearest ancestors it can see. A graph input of a
later step is produced by the host from the previous step's outputs: its inputs are named "prev:<name>".
"""

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Node:
    op: str
    layer: int | None
    formula: str
    inputs: tuple[str, ...]


_NORM = {False: "y = x / sqrt(mean(x^2) + eps) * w", True: "y = x / sqrt(mean(x^2) + eps) * (1 + w)"}
_LAYER = re.compile(r"model\.layers\.(\d+)(?:\.(.*))?$")
_IO = re.compile(r"(past_key|past_value|conv_state|recurrent_state)_(\d+)_(in|out)$")
_QEFF_IO = re.compile(r"(past_key|past_value|conv_state|recurrent_state)\.(\d+)(_RetainedState)?$")
_HF_IO = re.compile(r"(past_key_values|present)\.(\d+)\.(key|value)$|(past|present)_(conv|recurrent)_state\.(\d+)$")


def producer(cfg, name: str, convention: dict | None = None) -> Node | None:
    """The node that produces tensor `name` (a tap or a graph input / output), or None if unknown.
    convention: the bundle manifest's convention record (genie's kv_output="window" outputs read the inputs)."""
    if name == "input_ids":  # a decode step's token is the previous call's greedy choice
        return Node("graph input", None, "prompt chunk, or argmax of the previous call's logits", ("prev:logits",))
    if name in ("attention_mask", "position_ids", "position_ids_cos", "position_ids_sin"):
        return Node("graph input", None, "prepared by the host", ())
    if name == "model.embed_tokens":
        return Node("embedding", None, "x[b, t] = E[input_ids[b, t]]", ("input_ids",))
    if name == "model.norm":
        return Node("rms_norm", None, _NORM[cfg.zero_centered_norms], (_block(cfg.num_hidden_layers - 1),))
    if name == "lm_head":
        return Node("linear", None, "logits = x E^T (tied) or x W_lm^T", ("model.norm",))
    if name == "logits":
        return Node("graph output", None, "logits = lm_head", ("lm_head",))
    m = _IO.fullmatch(name)
    if m:
        node = _state_io(cfg, m[1], int(m[2]), m[3])
        window = ((convention or {}).get("params") or {}).get("kv_output") == "window"
        if window and m[1].startswith("past_") and m[3] == "out":  # the updated window: old entries too
            node = Node(node.op, node.layer, "the updated window: cached entries then the new ones",
                        (*node.inputs, f"{m[1]}_{m[2]}_in"))
        return node
    m = _HF_IO.fullmatch(name)
    if m:
        return _hf_io(m)
    m = _QEFF_IO.fullmatch(name)
    if m:
        return _qeff_io(m[1], int(m[2]), bool(m[3]))
    m = _LAYER.fullmatch(name)
    if m:
        return _layer_node(cfg, int(m[1]), m[2] or "")
    return None


def _block(i: int) -> str:
    """Layer i's output; layer -1's is the embedding."""
    return "model.embed_tokens" if i < 0 else f"model.layers.{i}"


def _state_io(cfg, kind: str, i: int, direction: str) -> Node:
    if direction == "in":  # the host's cache: the previous call's outputs (shifted into the window)
        return Node("host cache", i, "window of earlier calls' outputs", (f"prev:{kind}_{i}_out", f"prev:{kind}_{i}_in"))
    a, g = f"model.layers.{i}.self_attn", f"model.layers.{i}.linear_attn"
    source = {"past_key": f"{a}.k_rope", "past_value": f"{a}.v_proj", "conv_state": f"{g}.conv_state",
              "recurrent_state": f"{g}.recurrent_state"}[kind]
    formula = {"past_key": "new keys after RoPE (transposed [Hkv, 1, D, T] unless configured)",
               "past_value": "new values [Hkv, 1, T, D]", "conv_state": "last S raw conv inputs",
               "recurrent_state": "S after the call, keys on rows"}[kind]
    return Node("graph output", i, formula, (source,))


def _qeff_io(kind: str, i: int, retained: bool) -> Node:
    if not retained:
        return Node("host cache", i, "previous call's retained state", (f"prev:{kind}.{i}_RetainedState",))
    node = _state_io(None, kind, i, "out")
    extra = (f"{kind}.{i}",) if kind.startswith("past_") else ()
    return Node(node.op, i, "scattered at the tokens' positions" if extra else node.formula, (*node.inputs, *extra))


def _hf_io(m) -> Node:
    if m[1] == "past_key_values":
        return Node("host cache", int(m[2]), "previous call's present", (f"prev:present.{m[2]}.{m[3]}",))
    if m[4] == "past":
        return Node("host cache", int(m[6]), "previous call's present", (f"prev:present_{m[5]}_state.{m[6]}",))
    if m[1] == "present":
        i = int(m[2])
        source = f"model.layers.{i}.self_attn." + ("k_rope" if m[3] == "key" else "v_proj")
        return Node("graph output", i, "cache after the call (past + new)", (f"past_key_values.{i}.{m[3]}", source))
    i = int(m[6])
    return Node("graph output", i, "state after the call", (f"model.layers.{i}.linear_attn.{m[5]}_state",))


def _layer_node(cfg, i: int, rest: str) -> Node | None:
    p, x = f"model.layers.{i}", _block(i - 1)
    norm = _NORM[cfg.zero_centered_norms]
    if rest == "":
        ff = f"{p}.mlp" if cfg.is_moe_layer(i) else f"{p}.mlp.down_proj"
        return Node("residual add", i, "out = attn_residual + mlp", (f"{p}.attn_residual", ff))
    if rest == "input_layernorm":
        return Node("rms_norm", i, norm, (x,))
    if rest == "attn_residual":
        mixer = f"{p}.linear_attn.out_proj" if cfg.layer_types[i] == "linear_attention" else f"{p}.self_attn.o_proj"
        return Node("residual add", i, "h = x + mixer(input_layernorm(x))", (x, mixer))
    if rest == "post_attention_layernorm":
        return Node("rms_norm", i, norm, (f"{p}.attn_residual",))
    if rest.startswith("self_attn."):
        return _attention(cfg, i, rest[len("self_attn."):], norm)
    if rest.startswith("linear_attn."):
        return _gdn(cfg, i, rest[len("linear_attn."):])
    if rest == "mlp" or rest.startswith("mlp."):
        return _mlp(cfg, i, rest[len("mlp."):] if rest != "mlp" else "")
    return None


def _attention(cfg, i: int, what: str, norm: str) -> Node | None:
    a = f"model.layers.{i}.self_attn"
    gated = cfg.is_hybrid
    kv_in = (f"past_key_{i}_in", f"past_key_values.{i}.key", f"past_key.{i}", "position_ids")
    nodes = {
        "q_proj": ("linear", "q = x Wq^T (+ b)" + ("; rows per head [q_h | gate_h]" if gated else ""),
                   (f"model.layers.{i}.input_layernorm",)),
        "k_proj": ("linear", "k = x Wk^T (+ b)", (f"model.layers.{i}.input_layernorm",)),
        "v_proj": ("linear", "v = x Wv^T (+ b)", (f"model.layers.{i}.input_layernorm",)),
        "gate": ("split", "gate = second half of each head's q_proj rows", (f"{a}.q_proj",)),
        "q_norm": ("rms_norm", norm + " per head over D", (f"{a}.q_proj",)),
        "k_norm": ("rms_norm", norm + " per head over D", (f"{a}.k_proj",)),
        "q_rope": ("rope", "y1 = x1 cos - x2 sin; y2 = x2 cos + x1 sin (half-split pairs d, d + rot/2)",
                   (f"{a}.q_norm", "position_ids_cos", "position_ids_sin", "position_ids")),
        "k_rope": ("rope", "y1 = x1 cos - x2 sin; y2 = x2 cos + x1 sin (half-split pairs d, d + rot/2)",
                   (f"{a}.k_norm", "position_ids_cos", "position_ids_sin", "position_ids")),
        "attn_scores": ("matmul + mask", "s = q k^T / sqrt(D) + max(M, floor); q head h reads kv head h // (Hq/Hkv)",
                        (f"{a}.q_rope", f"{a}.k_rope", *kv_in, "attention_mask")),
        "attn_probs": ("softmax", "p = exp(s - max s) / sum exp(s - max s) over keys (float32)", (f"{a}.attn_scores",)),
        "attn_output": ("matmul", "o = p v, heads flattened head-major",
                        (f"{a}.attn_probs", f"{a}.v_proj", f"past_value_{i}_in", f"past_key_values.{i}.value",
                         f"past_value.{i}")),
        "gated_output": ("gate", "o * sigmoid(gate)", (f"{a}.attn_output", f"{a}.gate")),
        "o_proj": ("linear", "y = o Wo^T (+ b)", (f"{a}.gated_output" if gated else f"{a}.attn_output",)),
    }
    return _pick(nodes, what, i)


def _gdn(cfg, i: int, what: str) -> Node | None:
    g, x = f"model.layers.{i}.linear_attn", f"model.layers.{i}.input_layernorm"
    fused = cfg.fused_linear_projections
    qkv = f"{g}.in_proj_qkvz" if fused else f"{g}.in_proj_qkv"
    pads = ("attention_mask", "position_ids")  # how the graph tells pad slots (which leave the state alone)
    conv_in = f"conv_state_{i}_in", f"past_conv_state.{i}", f"conv_state.{i}", *pads
    rec_in = f"recurrent_state_{i}_in", f"past_recurrent_state.{i}", f"recurrent_state.{i}", *pads
    core_in = (f"{g}.q", f"{g}.k", f"{g}.v", f"{g}.g", f"{g}.beta", *rec_in)
    nodes = {
        "in_proj_qkvz": ("linear", "[q | k | v | z] per key head = x W^T", (x,)),
        "in_proj_ba": ("linear", "[b | a] per key head = x W^T", (x,)),
        "in_proj_qkv": ("linear", "[q | k | v] = x W^T", (x,)),
        "in_proj_z": ("linear", "z = x Wz^T", (x,)),
        "in_proj_b": ("linear", "b = x Wb^T", (x,)),
        "in_proj_a": ("linear", "a = x Wa^T", (x,)),
        "mixed_qkv": ("split / concat", "channels [q | k | v], head-major", (qkv,)),
        "conv1d": ("causal_conv1d", "y[c, t] = sum_j w[c, j] x[c, t - Kc + 1 + j] over [state | x]",
                   (f"{g}.mixed_qkv", *conv_in)),
        "conv1d_silu": ("silu", "y = x * sigmoid(x)", (f"{g}.conv1d",)),
        "q": ("l2_normalize", "q / sqrt(sum q^2 + 1e-6)", (f"{g}.conv1d_silu",)),
        "k": ("l2_normalize", "k / sqrt(sum k^2 + 1e-6)", (f"{g}.conv1d_silu",)),
        "v": ("split", "v channels of conv1d_silu", (f"{g}.conv1d_silu",)),
        "z": ("split", "z = output gate", (qkv if fused else f"{g}.in_proj_z",)),
        "beta": ("sigmoid", "beta = sigmoid(b)", (f"{g}.in_proj_ba" if fused else f"{g}.in_proj_b",)),
        "g": ("gate", "g = -exp(A_log) * softplus(a + dt_bias)", (f"{g}.in_proj_ba" if fused else f"{g}.in_proj_a",)),
        "core": ("gated delta rule", "S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q / sqrt(Dk)", core_in),
        "norm": ("rms_norm_gated", "y = w * x / sqrt(mean(x^2) + eps) * silu(z)", (f"{g}.core", f"{g}.z")),
        "out_proj": ("linear", "y = x Wo^T", (f"{g}.norm",)),
        "conv_state": ("state update", "last S raw conv inputs of [state | mixed_qkv]", (f"{g}.mixed_qkv", *conv_in)),
        "recurrent_state": ("state update", "S after the last real token", core_in),
    }
    return _pick(nodes, what, i)


def _mlp(cfg, i: int, what: str) -> Node | None:
    m, x = f"model.layers.{i}.mlp", f"model.layers.{i}.post_attention_layernorm"
    if what.startswith("shared_expert."):
        x, what, m = x, what[len("shared_expert."):], f"{m}.shared_expert"
    nodes = {
        "gate_proj": ("linear", "x Wg^T", (x,)),
        "up_proj": ("linear", "x Wu^T", (x,)),
        "act_fn": ("activation", "act(gate_proj)", (f"{m}.gate_proj",)),
        "hidden": ("mul", "act_fn * up_proj", (f"{m}.act_fn", f"{m}.up_proj")),
        "down_proj": ("linear", "y = hidden Wd^T", (f"{m}.hidden",)),
        "gate": ("linear", "router logits = x Wr^T", (x,)),
        "router_probs": ("softmax", "softmax over experts (float32)", (f"{m}.gate",)),
        "selected_experts": ("top-k", "k experts of highest probability (ties: lower id)", (f"{m}.gate",)),
        "routing_weights": ("top-k weights", "their probabilities, renormalised if norm_topk_prob", (f"{m}.gate",)),
        "experts": ("expert mix", "sum_e w_e * down_e(act(gate_e x) * up_e x), ascending e",
                    (x, f"{m}.selected_experts", f"{m}.routing_weights")),
        "shared_expert_gate": ("linear", "x Wsg^T (one logit per token)", (x,)),
        "": ("add", "experts + sigmoid(shared_expert_gate) * shared_expert",
             (f"{m}.experts", f"{m}.shared_expert.down_proj", f"{m}.shared_expert_gate")),
    }
    return _pick(nodes, what, i)


def _pick(nodes: dict, what: str, layer: int) -> Node | None:
    """The node named `what` of a block's table {what: (op, formula, inputs)}, or None."""
    if what not in nodes:
        return None
    op, formula, inputs = nodes[what]
    return Node(op, layer, formula, inputs)
