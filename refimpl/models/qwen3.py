"""Qwen3 dense and Qwen3-MoE decoder layers, and the blocks the hybrid models share with them.

One pre-norm layer:  h = x + attention(input_layernorm(x));  out = h + mlp(post_attention_layernorm(h)).
Every function reads its weights by checkpoint name under `p` (e.g. "model.layers.3.self_attn") and taps
its intermediates under the same path. A projection is `w.linear(x, name)`: kernels.linear.linear on the matrix
`name`, in the row blocks refimpl/models/weights.py fixes (for one token, cache-sized blocks converted as they
are multiplied, which is what makes a streamed decode step cost little more than reading its weights). `r = ctx.round` marks each point where transformers casts to the
activation dtype (refimpl/precision.py); it is the identity in float32 and float64.
"""

import numpy as np

from ..kernels.activation import ACTIVATIONS, sigmoid
from ..kernels.attention import attend, attention_probs, attention_scores
from ..kernels.linear import linear
from ..kernels.moe import mix_experts, route, shared_expert_gate
from ..kernels.norm import rms_norm
from ..kernels.rope import apply_rope
from ..trace import tap


def norm(w, name: str, x: np.ndarray, cfg, ctx) -> np.ndarray:
    """The model's RMSNorm: plain weight (Qwen3) or zero-centred (1 + w) (Qwen3-Next / 3.5)."""
    return rms_norm(x, w[f"{name}.weight"], cfg.rms_norm_eps, zero_centered=cfg.zero_centered_norms, rnd=ctx.round)


def attention(w, p: str, x: np.ndarray, cfg, ctx, layer: int, *, gated: bool = False) -> np.ndarray:
    """Self-attention.  x [B, T, H] -> [B, T, H].

    q = q_norm(x Wq^T) and k = k_norm(x Wk^T) per head, then RoPE on the first rot channels; v = x Wv^T.
    gated (Qwen3-Next / 3.5): q_proj rows are interleaved per head [q_h | gate_h], and the attention output
    is multiplied by sigmoid(gate) before o_proj.
    """
    B, T, _ = x.shape
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    r = ctx.round
    bias = (lambda name: f"{p}.{name}.bias") if cfg.attention_bias else (lambda name: None)
    q = r(w.linear(x, f"{p}.q_proj.weight", bias("q_proj")))
    k = r(w.linear(x, f"{p}.k_proj.weight", bias("k_proj")))
    v = r(w.linear(x, f"{p}.v_proj.weight", bias("v_proj")))
    q, k, v = tap(p, "q_proj", q), tap(p, "k_proj", k), tap(p, "v_proj", v)
    if gated:
        q, gate = np.split(q.reshape(B, T, Hq, 2 * D), 2, axis=-1)      # [B, T, Hq, D] each
        gate = gate.reshape(B, T, Hq * D)
        gate = tap(p, "gate", gate)
    q = norm(w, f"{p}.q_norm", q.reshape(B, T, Hq, D), cfg, ctx)        # [B, T, Hq, D]
    k = norm(w, f"{p}.k_norm", k.reshape(B, T, Hkv, D), cfg, ctx)       # [B, T, Hkv, D]
    q, k = tap(p, "q_norm", q), tap(p, "k_norm", k)
    cos, sin = r(ctx.cos), r(ctx.sin)                                  # transformers casts the tables too
    q, k = apply_rope(q, cos, sin, rnd=r), apply_rope(k, cos, sin, rnd=r)
    q, k = tap(p, "q_rope", q), tap(p, "k_rope", k)
    q, k, v = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.reshape(B, T, Hkv, D).transpose(0, 2, 1, 3)
    if ctx.precision.kv is not None:  # KV dtype emulation: attention reads what the cache holds
        k, v = ctx.precision.store_kv(k), ctx.precision.store_kv(v)
    if ctx.cache is not None:
        k, v = ctx.cache.append_kv(layer, k, v)                          # [B, Hkv, P+T, D]
    mask = ctx.precision.mask(ctx.masks[cfg.layer_types[layer]])
    scale = None
    if ctx.k_prescale:  # q . (k / sqrt(D)): the cache keeps the unscaled keys
        k, scale = r(k * k.dtype.type(D ** -0.5)), 1.0
    scores = tap(p, "attn_scores", attention_scores(q, k, mask, scale=scale, mask_floor=ctx.mask_floor, rnd=r))
    probs = tap(p, "attn_probs", attention_probs(scores, q.dtype, rnd=r))   # [B, Hq, T, P+T]
    o = attend(probs, v, rnd=r)                                              # [B, Hq, T, D]: sdpa, op by op
    o = o.transpose(0, 2, 1, 3).reshape(B, T, Hq * D)
    o = tap(p, "attn_output", o)
    if gated:
        o = r(o * r(sigmoid(gate)))
        o = tap(p, "gated_output", o)
    out = r(w.linear(o, f"{p}.o_proj.weight", bias("o_proj")))
    return tap(p, "o_proj", out)


def mlp(w, p: str, x: np.ndarray, cfg, ctx) -> np.ndarray:
    """SwiGLU:  down( act(gate(x)) * up(x) ).  x [..., H] -> [..., H]."""
    act, r = ACTIVATIONS[cfg.hidden_act], ctx.round
    gate = r(w.linear(x, f"{p}.gate_proj.weight"))
    up = r(w.linear(x, f"{p}.up_proj.weight"))
    gate, up = tap(p, "gate_proj", gate), tap(p, "up_proj", up)
    hidden = r(r(act(gate)) * up)
    hidden = tap(p, "hidden", hidden)
    out = r(w.linear(hidden, f"{p}.down_proj.weight"))
    return tap(p, "down_proj", out)


def moe(w, p: str, x: np.ndarray, cfg, ctx) -> np.ndarray:
    """Sparse MoE block: router softmax -> top-k -> (renormalise) -> experts summed in ascending id;
    plus, where the checkpoint has one, the shared expert scaled by sigmoid(shared_expert_gate(x))."""
    B, T, H = x.shape
    act, r = ACTIVATIONS[cfg.hidden_act], ctx.round
    xs = x.reshape(B * T, H)
    logits = tap(p, "gate", r(w.linear(xs, f"{p}.gate.weight")).reshape(B, T, -1)).reshape(B * T, -1)  # [N, E]
    probs, weights, experts = route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob, rnd=r)
    w.prefetch_experts(f"{p}.experts", np.unique(experts))           # streamed: the routed experts' reads start
    tap(p, "router_probs", probs.reshape(B, T, -1))
    experts = tap(p, "selected_experts", experts.reshape(B, T, -1)).reshape(B * T, -1)
    weights = tap(p, "routing_weights", weights.reshape(B, T, -1)).reshape(B * T, -1)

    def expert(e: int, xe: np.ndarray) -> np.ndarray:
        gate, up, down = w.expert(f"{p}.experts", e)
        return r(linear(r(r(act(r(linear(xe, gate)))) * r(linear(xe, up))), down))

    out = mix_experts(xs, experts, weights, expert, rnd=r)
    out = tap(p, "experts", out.reshape(B, T, H)).reshape(B * T, H)
    if cfg.shared_expert_intermediate_size:  # Qwen3-Next, Qwen3.5-MoE
        shared = mlp(w, f"{p}.shared_expert", x, cfg, ctx).reshape(B * T, H)
        gate = shared_expert_gate(xs, w[f"{p}.shared_expert_gate.weight"], rnd=r)
        gate = tap(p, "shared_expert_gate", gate.reshape(B, T, 1)).reshape(B * T, 1)
        out = r(out + r(gate * shared))
    return tap(p, None, out.reshape(B, T, H))


def feed_forward(w, i: int, x: np.ndarray, cfg, ctx) -> np.ndarray:
    p = f"model.layers.{i}.mlp"
    return moe(w, p, x, cfg, ctx) if cfg.is_moe_layer(i) else mlp(w, p, x, cfg, ctx)


def decoder_layer(w, i: int, x: np.ndarray, cfg, ctx, mixer) -> np.ndarray:
    """Pre-norm residual layer around `mixer` (attention or, in hybrids, Gated DeltaNet) and the MLP."""
    p = f"model.layers.{i}"
    h = norm(w, f"{p}.input_layernorm", x, cfg, ctx)
    h = tap(p, "input_layernorm", h)
    h = ctx.round(x + mixer(w, i, h, cfg, ctx))
    h = tap(p, "attn_residual", h)
    m = norm(w, f"{p}.post_attention_layernorm", h, cfg, ctx)
    m = tap(p, "post_attention_layernorm", m)
    return tap(p, None, ctx.round(h + feed_forward(w, i, m, cfg, ctx)))


def self_attention_mixer(w, i, x, cfg, ctx):
    return attention(w, f"model.layers.{i}.self_attn", x, cfg, ctx, i)


def attention_tensors(cfg, p: str, gated: bool = False) -> dict:
    Hq, Hkv, D, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    t = {f"{p}.q_proj.weight": ((2 if gated else 1) * Hq * D, H), f"{p}.k_proj.weight": (Hkv * D, H),
         f"{p}.v_proj.weight": (Hkv * D, H), f"{p}.o_proj.weight": (H, Hq * D),
         f"{p}.q_norm.weight": (D,), f"{p}.k_norm.weight": (D,)}
    if cfg.attention_bias:
        t.update({f"{p}.q_proj.bias": ((2 if gated else 1) * Hq * D,), f"{p}.k_proj.bias": (Hkv * D,), f"{p}.v_proj.bias": (Hkv * D,),
                  f"{p}.o_proj.bias": (H,)})
    return t


def mlp_tensors(p: str, hidden: int, inner: int) -> dict:
    return {f"{p}.gate_proj.weight": (inner, hidden), f"{p}.up_proj.weight": (inner, hidden),
            f"{p}.down_proj.weight": (hidden, inner)}


def feed_forward_tensors(cfg, i: int) -> dict:
    p, H = f"model.layers.{i}.mlp", cfg.hidden_size
    if not cfg.is_moe_layer(i):
        return mlp_tensors(p, H, cfg.intermediate_size)
    E, Ie = cfg.num_experts, cfg.moe_intermediate_size
    t = {f"{p}.gate.weight": (E, H), f"{p}.experts.gate_up_proj": (E, 2 * Ie, H),
         f"{p}.experts.down_proj": (E, H, Ie)}
    if cfg.shared_expert_intermediate_size:
        t.update(mlp_tensors(f"{p}.shared_expert", H, cfg.shared_expert_intermediate_size))
        t[f"{p}.shared_expert_gate.weight"] = (1, H)
    return t


def self_attention_tensors(cfg, i: int) -> dict:
    return attention_tensors(cfg, f"model.layers.{i}.self_attn")


def expected_tensors(cfg, mixer_tensors=self_attention_tensors) -> dict:
    """Checkpoint name -> shape of every tensor the forward reads; mixer_tensors(cfg, i) gives layer i's
    token-mixer tensors (self-attention here; hybrid.py passes its own)."""
    H = cfg.hidden_size
    t = {"model.embed_tokens.weight": (cfg.vocab_size, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = (cfg.vocab_size, H)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = (H,)
        t[f"{p}.post_attention_layernorm.weight"] = (H,)
        t.update(mixer_tensors(cfg, i))
        t.update(feed_forward_tensors(cfg, i))
    return t
