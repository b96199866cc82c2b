"""Qwen3 dense and Qwen3-MoE decoder layers, and the blocks the hybrid models share with them.

One pre-norm layer:  h = x + attention(input_layernorm(x));  out = h + mlp(post_attention_layernorm(h)).
Every function reads its weights by checkpoint name under `p` (e.g. "model.layers.3.self_attn") and taps
its intermediates under the same path. A projection (`project`) is `w.linear(x, name)`: kernels.linear.linear on
the matrix `name`, in the row blocks refimpl/models/weights.py fixes (for one token, cache-sized blocks converted
as they are multiplied, which is what makes a streamed decode step cost little more than reading its weights).
`r = ctx.round` marks each point where transformers casts to the activation dtype (refimpl/precision.py); it is
the identity in float32 and float64.

AIMET activation quantisers (refimpl/models/quantisers.py): `q = ctx.quant` quantises the input of a module as that
module consumes it (`q.input(module, x)`) and the module's output (`q.output(module, y)`), where an encodings file
places them; the identity otherwise. The `*_modules(cfg, i)` tables below declare, per block, each HF module that
can carry them and the taps that are its inputs.
"""

import numpy as np

from ..kernels.activation import ACTIVATIONS, sigmoid
from ..kernels.elementary import inverse_sqrt
from ..kernels.attention import attend, attention_probs, attention_scores
from ..kernels.linear import linear
from ..kernels.moe import mix_experts, route
from ..kernels.norm import rms_norm
from ..kernels.rope import apply_rope
from ..trace import tap


def norm(w, name: str, x: np.ndarray, cfg, ctx) -> np.ndarray:
    """The model's RMSNorm module `name`: plain weight (Qwen3) or zero-centred (1 + w) (Qwen3-Next / 3.5)."""
    q = ctx.quant
    y = rms_norm(q.input(name, x), w[f"{name}.weight"], cfg.rms_norm_eps, zero_centered=cfg.zero_centered_norms,
                 rnd=ctx.round)
    return q.output(name, y)


def project(w, name: str, x: np.ndarray, ctx, bias: bool = False, weight: str | None = None) -> np.ndarray:
    """The nn.Linear module `name`: y = x W^T (+ b), cast to the activation dtype.  x [..., in] -> [..., out].
    weight: the matrix's checkpoint name when it is not `name.weight` (a tied lm_head)."""
    q = ctx.quant
    y = w.linear(q.input(name, x), weight or f"{name}.weight", f"{name}.bias" if bias else None)
    return q.output(name, ctx.round(y))


def activation(p: str, gate: np.ndarray, cfg, ctx) -> np.ndarray:
    """The MLP's activation module `p.act_fn` on gate_proj's output."""
    q, name = ctx.quant, f"{p}.act_fn"
    return q.output(name, ctx.round(ACTIVATIONS[cfg.hidden_act](q.input(name, gate))))


def attention(w, p: str, x: np.ndarray, cfg, ctx, layer: int, *, gated: bool = False) -> np.ndarray:
    """Self-attention.  x [B, T, H] -> [B, T, H].

    q = q_norm(x Wq^T) and k = k_norm(x Wk^T) per head, then RoPE on the first rot channels; v = x Wv^T.
    gated (Qwen3-Next / 3.5): q_proj rows are interleaved per head [q_h | gate_h], and the attention output
    is multiplied by sigmoid(gate) before o_proj.
    """
    B, T, _ = x.shape
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    r, bias = ctx.round, cfg.attention_bias
    q = tap(p, "q_proj", project(w, f"{p}.q_proj", x, ctx, bias))
    k = tap(p, "k_proj", project(w, f"{p}.k_proj", x, ctx, bias))
    v = tap(p, "v_proj", project(w, f"{p}.v_proj", x, ctx, bias))
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
        k, scale = r(k * k.dtype.type(inverse_sqrt(D))), 1.0
    scores = tap(p, "attn_scores", attention_scores(q, k, mask, scale=scale, mask_floor=ctx.mask_floor, rnd=r))
    probs = tap(p, "attn_probs", attention_probs(scores, q.dtype, rnd=r))   # [B, Hq, T, P+T]
    o = attend(probs, v, rnd=r)                                              # [B, Hq, T, D]: sdpa, op by op
    o = o.transpose(0, 2, 1, 3).reshape(B, T, Hq * D)
    o = tap(p, "attn_output", o)
    if gated:
        o = r(o * r(sigmoid(gate)))
        o = tap(p, "gated_output", o)
    return tap(p, "o_proj", project(w, f"{p}.o_proj", o, ctx, bias))


def mlp(w, p: str, x: np.ndarray, cfg, ctx) -> np.ndarray:
    """SwiGLU:  down( act(gate(x)) * up(x) ).  x [..., H] -> [..., H]."""
    gate = tap(p, "gate_proj", project(w, f"{p}.gate_proj", x, ctx))
    up = tap(p, "up_proj", project(w, f"{p}.up_proj", x, ctx))
    hidden = tap(p, "hidden", ctx.round(tap(p, "act_fn", activation(p, gate, cfg, ctx)) * up))
    return tap(p, "down_proj", project(w, f"{p}.down_proj", hidden, ctx))


def moe(w, p: str, x: np.ndarray, cfg, ctx) -> np.ndarray:
    """Sparse MoE block: router softmax -> top-k -> (renormalise) -> experts summed in ascending id;
    plus, where the checkpoint has one, the shared expert scaled by sigmoid(shared_expert_gate(x)) (the tap
    shared_expert_gate holds the linear's output, before the sigmoid)."""
    B, T, H = x.shape
    act, r = ACTIVATIONS[cfg.hidden_act], ctx.round
    xs = x.reshape(B * T, H)
    logits = tap(p, "gate", project(w, f"{p}.gate", x, ctx)).reshape(B * T, -1)          # router logits [N, E]
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
        gate = tap(p, "shared_expert_gate", project(w, f"{p}.shared_expert_gate", x, ctx)).reshape(B * T, 1)
        out = r(out + r(r(sigmoid(gate)) * shared))
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


def mixer(cfg, i: int):
    """Layer i's token mixer: self-attention in every layer."""
    return self_attention_mixer


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


# --- AIMET's quantisers (refimpl/models/quantisers.py) ----------------------------------------------------------
# Each block declares the HF modules AIMET wraps with quantisers: module -> the taps that are its inputs, in the
# module's argument order (its input i quantiser acts on the i-th, as this module consumes it); the module's output
# is the tap of its own name. Functional ops (RoPE, the attention matmuls, softmax, residual adds, the routed
# experts' fused matrices) have no module, so AIMET leaves them float.

def attention_modules(p: str, x: str, gated: bool = False) -> dict:
    """q_norm / k_norm read q_proj / k_proj per head (gated: the query half of each head's q_proj rows)."""
    return {f"{p}.q_proj": (x,), f"{p}.k_proj": (x,), f"{p}.v_proj": (x,), f"{p}.q_norm": (f"{p}.q_proj",),
            f"{p}.k_norm": (f"{p}.k_proj",), f"{p}.o_proj": (f"{p}.gated_output" if gated else f"{p}.attn_output",)}


def mlp_modules(p: str, x: str) -> dict:
    return {f"{p}.gate_proj": (x,), f"{p}.up_proj": (x,), f"{p}.act_fn": (f"{p}.gate_proj",),
            f"{p}.down_proj": (f"{p}.hidden",)}


def feed_forward_modules(cfg, i: int) -> dict:
    p, x = f"model.layers.{i}.mlp", f"model.layers.{i}.post_attention_layernorm"
    if not cfg.is_moe_layer(i):
        return mlp_modules(p, x)
    m = {f"{p}.gate": (x,)}  # the router: its output is the logits (AIMET quantises them before the softmax)
    if cfg.shared_expert_intermediate_size:
        m.update(mlp_modules(f"{p}.shared_expert", x))
        m[f"{p}.shared_expert_gate"] = (x,)
    return m


def self_attention_modules(cfg, i: int) -> dict:
    return attention_modules(f"model.layers.{i}.self_attn", f"model.layers.{i}.input_layernorm")


def expected_modules(cfg, mixer_modules=self_attention_modules) -> dict:
    """Every module that can carry AIMET quantisers -> its input taps, in execution order; mixer_modules(cfg, i)
    gives layer i's token mixer (hybrid.py passes its own)."""
    out = {"model.embed_tokens": ()}  # its input is the token ids
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm"] = (f"model.layers.{i - 1}" if i else "model.embed_tokens",)
        out.update(mixer_modules(cfg, i))
        out[f"{p}.post_attention_layernorm"] = (f"{p}.attn_residual",)
        out.update(feed_forward_modules(cfg, i))
    out["model.norm"] = (f"model.layers.{cfg.num_hidden_layers - 1}",)
    out["lm_head"] = ("model.norm",)
    return out


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
