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
places them; the identity otherwise. A quantised device graph's quantisers (aimet-onnx, QDQ) also sit at the other
nodes' outputs (`q.output(node, y)`) and at the sub-op points of their kernels' equations (`at=q.at(node)`).
The `*_nodes` declarations below (the graph, refimpl/graph.py) say, per block,
which taps are HF modules' outputs that can carry them and which taps are those modules' inputs.
"""

import numpy as np

from ..graph import Node, Point, declare, merge
from ..kernels.activation import ACTIVATIONS, activate, sigmoid, sigmoid_rounded, unhooked
from ..kernels.attention import attend, attention_probs, attention_scores
from ..kernels.elementary import inverse_sqrt
from ..kernels.linear import linear, matvec
from ..kernels.moe import mix_experts, route
from ..kernels.norm import rms_norm, rms_norm_rounded
from ..kernels.rope import apply_rope
from ..trace import tap


def norm(w, name: str, x: np.ndarray, cfg, ctx) -> np.ndarray:
    """The model's RMSNorm module `name`: plain weight (Qwen3) or zero-centred (1 + w) (Qwen3-Next / 3.5)."""
    q = ctx.quant
    if ctx.precision.rounds_each_op:   # htp-fp16: each op of the norm rounded
        y = rms_norm_rounded(q.input(name, x), w[f"{name}.weight"], cfg.rms_norm_eps,
                             zero_centered=cfg.zero_centered_norms, rnd=ctx.round)
    else:
        y = rms_norm(q.input(name, x), w[f"{name}.weight"], cfg.rms_norm_eps, zero_centered=cfg.zero_centered_norms,
                     rnd=ctx.round, at=q.at(name))
    return q.output(name, y)


def gate_sigmoid(x: np.ndarray, ctx) -> np.ndarray:
    """A gate's sigmoid (gated attention, the shared expert), cast: as 1 / (1 + exp(-x)) op by op under htp-fp16."""
    return sigmoid_rounded(x, ctx.round) if ctx.precision.rounds_each_op else ctx.round(sigmoid(x))


def project(w, name: str, x: np.ndarray, ctx, bias: bool = False, weight: str | None = None) -> np.ndarray:
    """The nn.Linear module `name`: y = x W^T (+ b), cast to the activation dtype.  x [..., in] -> [..., out].
    weight: the matrix's checkpoint name when it is not `name.weight` (a tied lm_head)."""
    q = ctx.quant
    y = w.linear(q.input(name, x), weight or f"{name}.weight", f"{name}.bias" if bias else None)
    return q.output(name, ctx.round(y))


def activation(p: str, gate: np.ndarray, cfg, ctx) -> np.ndarray:
    """The MLP's activation module `p.act_fn` on gate_proj's output."""
    q, name = ctx.quant, f"{p}.act_fn"
    return q.output(name, ctx.round(activate(cfg.hidden_act, q.input(name, gate), at=q.at(name))))


def attention(w, p: str, x: np.ndarray, cfg, ctx, layer: int, *, gated: bool = False) -> np.ndarray:
    """Self-attention.  x [B, T, H] -> [B, T, H].

    q = q_norm(x Wq^T) and k = k_norm(x Wk^T) per head, then RoPE on the first rot channels; v = x Wv^T.
    gated (Qwen3-Next / 3.5): q_proj rows are interleaved per head [q_h | gate_h], and the attention output
    is multiplied by sigmoid(gate) before o_proj.
    """
    B, T, _ = x.shape
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    r, bias, quant = ctx.round, cfg.attention_bias, ctx.quant
    q = tap(p, "q_proj", project(w, f"{p}.q_proj", x, ctx, bias))
    k = tap(p, "k_proj", project(w, f"{p}.k_proj", x, ctx, bias))
    v = tap(p, "v_proj", project(w, f"{p}.v_proj", x, ctx, bias))
    if gated:
        q, gate = np.split(q.reshape(B, T, Hq, 2 * D), 2, axis=-1)      # [B, T, Hq, D] each
        gate = gate.reshape(B, T, Hq * D)
        gate = tap(p, "gate", gate)
        quant.at(f"{p}.q_norm").operand("q_proj", q)       # q_proj's codes as q_norm reads them: its q half (a Split)
    q = norm(w, f"{p}.q_norm", q.reshape(B, T, Hq, D), cfg, ctx)        # [B, T, Hq, D]
    k = norm(w, f"{p}.k_norm", k.reshape(B, T, Hkv, D), cfg, ctx)       # [B, T, Hkv, D]
    q, k = tap(p, "q_norm", q), tap(p, "k_norm", k)
    cos, sin = r(ctx.cos), r(ctx.sin)                                  # transformers casts the tables too
    q = apply_rope(q, cos, sin, rnd=r, at=quant.at(f"{p}.q_rope"))
    k = apply_rope(k, cos, sin, rnd=r, at=quant.at(f"{p}.k_rope"))
    q, k = tap(p, "q_rope", quant.output(f"{p}.q_rope", q)), tap(p, "k_rope", quant.output(f"{p}.k_rope", k))
    q, k, v = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.reshape(B, T, Hkv, D).transpose(0, 2, 1, 3)
    if ctx.precision.kv is not None:  # KV dtype emulation: attention reads what the cache holds
        k, v = ctx.precision.store_kv(k), ctx.precision.store_kv(v)
    if ctx.cache is not None:
        k, v = ctx.cache.append_kv(layer, k, v)                          # [B, Hkv, P+T, D]
    k, v = cached(k, T, quant.at(f"{p}.attn_scores"), "keys"), cached(v, T, quant.at(f"{p}.attn_output"), "values")
    mask = ctx.precision.mask(ctx.masks[cfg.layer_types[layer]])
    scale = None
    if ctx.k_prescale:  # q . (k / sqrt(D)): the cache keeps the unscaled keys
        k, scale = r(k * k.dtype.type(inverse_sqrt(D))), 1.0
    if ctx.cache is not None:
        k, v = ctx.cache.operands(layer, k, v)                   # with float64 copies, where attention reads the cache
    scores = attention_scores(q, k, mask, scale=scale, mask_floor=ctx.mask_floor, rnd=r,
                              at=quant.at(f"{p}.attn_scores"))
    scores = tap(p, "attn_scores", quant.output(f"{p}.attn_scores", scores))
    probs = tap(p, "attn_probs", quant.output(f"{p}.attn_probs", attention_probs(scores, q.dtype, rnd=r)))
    o = attend(probs, v, rnd=r)                                              # [B, Hq, T, D]: sdpa, op by op
    o = o.transpose(0, 2, 1, 3).reshape(B, T, Hq * D)
    o = tap(p, "attn_output", quant.output(f"{p}.attn_output", o))
    if gated:
        quant.at(f"{p}.gated_output").operand("q_proj", gate)   # q_proj's codes as the sigmoid reads them: the gate
        o = r(o * quant.at(f"{p}.gated_output")("sigmoid", gate_sigmoid(gate, ctx)))
        o = tap(p, "gated_output", quant.output(f"{p}.gated_output", o))
    return tap(p, "o_proj", project(w, f"{p}.o_proj", o, ctx, bias))


def cached(x: np.ndarray, T: int, at, what: str) -> np.ndarray:
    """The keys / values attention reads, [B, Hkv, P+T, D], through the points of a device graph that carries its
    cache as graph inputs: past_<what> (the P cached entries as the input holds them) and <what> (all of them)."""
    if f"past_{what}" in at.points and x.shape[2] > T:
        x = np.concatenate([at(f"past_{what}", x[:, :, :-T]), x[:, :, -T:]], axis=2)   # [past | new]
    return at(what, x)


def mlp(w, p: str, x: np.ndarray, cfg, ctx) -> np.ndarray:
    """SwiGLU:  down( act(gate(x)) * up(x) ).  x [..., H] -> [..., H]."""
    gate = tap(p, "gate_proj", project(w, f"{p}.gate_proj", x, ctx))
    up = tap(p, "up_proj", project(w, f"{p}.up_proj", x, ctx))
    hidden = ctx.round(tap(p, "act_fn", activation(p, gate, cfg, ctx)) * up)
    hidden = tap(p, "hidden", ctx.quant.output(f"{p}.hidden", hidden))
    return tap(p, "down_proj", project(w, f"{p}.down_proj", hidden, ctx))


def moe(w, p: str, x: np.ndarray, cfg, ctx) -> np.ndarray:
    """Sparse MoE block: router softmax -> top-k -> (renormalise) -> experts summed in ascending id;
    plus, where the checkpoint has one, the shared expert scaled by sigmoid(shared_expert_gate(x)) (the tap
    shared_expert_gate holds the linear's output, before the sigmoid)."""
    B, T, H = x.shape
    act, r = ACTIVATIONS[cfg.hidden_act], ctx.round
    xs = x.reshape(B * T, H)
    logits = tap(p, "router_logits", project(w, f"{p}.gate", x, ctx)).reshape(B * T, -1)          # router logits [N, E]
    quant = ctx.quant
    probs, weights, experts = route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob, rnd=r, at=quant.within(p))
    weights = quant.output(f"{p}.routing_weights", weights)
    at = quant.at(f"{p}.experts")
    w.prefetch_experts(f"{p}.experts", np.unique(experts))           # streamed: the routed experts' reads start
    tap(p, "router_probs", probs.reshape(B, T, -1))
    experts = tap(p, "selected_experts", experts.reshape(B, T, -1)).reshape(B * T, -1)
    weights = tap(p, "routing_weights", weights.reshape(B, T, -1)).reshape(B * T, -1)

    def expert(e: int, xe: np.ndarray) -> np.ndarray:
        gate, up, down = w.expert(f"{p}.experts", e)
        if at is unhooked:
            return r(linear(r(r(act(r(linear(xe, gate)))) * r(linear(xe, up))), down))
        # a device graph's points: W_gate_up x split in [gate | up], silu as x * sigmoid(x), the product, W_down h;
        # its products are the declared points' W x per token (MatMul's operands in order: the placement checks),
        # which ONNX Runtime sums in another order than x W^T (matvec)
        g, u = np.split(r(matvec(np.concatenate([gate, up]), xe)), 2, axis=-1)        # [n_e, Ie] each
        if "gate_up" in at.points:
            g, u = np.split(at("gate_up", np.concatenate([g, u], axis=-1)), 2, axis=-1)
        g, u = at("gate", g), at("up", u)
        a = at("act", r(activate(cfg.hidden_act, g, at=at)))                          # act(gate)
        return at("down", r(matvec(down, at("hidden", r(a * u)))))                    # W_down (act * up)

    # a device graph's point: the weighted terms ReduceSum'd over the k slots (an order of its own for k > 2)
    out = mix_experts(xs, experts, weights, expert, rnd=r, at=at, by_slot=at is not unhooked)
    out = tap(p, "experts", quant.output(f"{p}.experts", out.reshape(B, T, H))).reshape(B * T, H)
    if cfg.shared_expert_intermediate_size:  # Qwen3-Next, Qwen3.5-MoE
        shared = mlp(w, f"{p}.shared_expert", x, cfg, ctx).reshape(B * T, H)
        gate = tap(p, "shared_expert_gate", project(w, f"{p}.shared_expert_gate", x, ctx)).reshape(B * T, 1)
        out = r(out + r(gate_sigmoid(gate, ctx) * shared))
    return tap(p, None, out.reshape(B, T, H))


def feed_forward(w, i: int, x: np.ndarray, cfg, ctx) -> np.ndarray:
    p = f"model.layers.{i}.mlp"
    return moe(w, p, x, cfg, ctx) if cfg.is_moe_layer(i) else mlp(w, p, x, cfg, ctx)


def decoder_layer(w, i: int, x: np.ndarray, cfg, ctx, mixer) -> np.ndarray:
    """Pre-norm residual layer around `mixer` (attention or, in hybrids, Gated DeltaNet) and the MLP."""
    p, q = f"model.layers.{i}", ctx.quant
    h = norm(w, f"{p}.input_layernorm", x, cfg, ctx)
    h = tap(p, "input_layernorm", h)
    h = ctx.round(x + mixer(w, i, h, cfg, ctx))
    h = tap(p, "attn_residual", q.output(f"{p}.attn_residual", h))
    m = norm(w, f"{p}.post_attention_layernorm", h, cfg, ctx)
    m = tap(p, "post_attention_layernorm", m)
    return tap(p, None, q.output(p, ctx.round(h + feed_forward(w, i, m, cfg, ctx))))


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
        t.update({f"{p}.q_proj.bias": ((2 if gated else 1) * Hq * D,), f"{p}.k_proj.bias": (Hkv * D,),
                  f"{p}.v_proj.bias": (Hkv * D,), f"{p}.o_proj.bias": (H,)})
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


# --- The graph (refimpl/graph.py) -------------------------------------------------------------------------------
# Each block declares its taps beside the code above that computes them, in execution order: op, shape, formula (the
# kernel's equation) and direct inputs. A tap that is an HF module's output declares module=k: AIMET wraps that module
# with quantisers (refimpl/models/quantisers.py), its first k inputs are the module's arguments, in order (its input
# quantiser i acts on the i-th as this module consumes it). Functional ops (RoPE, the attention matmuls, softmax,
# residual adds, the routed experts' fused matrices) have no module, so AIMET leaves them float. "cache:<kind>.<i>" is
# the state a host carries between calls (each convention names its graph input: refimpl/conventions).

ROPE = "y1 = x1 cos - x2 sin; y2 = x2 cos + x1 sin (half-split pairs d, d + rot/2)"


def norm_formula(cfg) -> str:
    return "y = x / sqrt(mean(x^2) + eps) * " + ("(1 + w)" if cfg.zero_centered_norms else "w")


# Sub-op points (refimpl/graph.py's Point): the tensors of each kernel's equation a quantised device graph has, with
# the ONNX op each exports as (torch.onnx.export of transformers' modules) and its inputs.

def norm_points(cfg, x: str, weight: str) -> tuple:
    """kernels.norm.rms_norm over tap x with checkpoint weight `weight`."""
    return (Point("x^2", ("Pow",), (x, "const:2"), also=((("Mul",), (x, x)),)),
            Point("mean", ("ReduceMean",), ("/x^2",)),
            Point("+eps", ("Add",), ("/mean", "const:eps")), Point("sqrt", ("Sqrt",), ("/+eps",)),
            Point("1/sqrt", ("Reciprocal",), ("/sqrt",), also=((("Div",), ("const:1", "/sqrt")),)),
            Point("x*1/sqrt", ("Mul",), (x, "/1/sqrt"), also=((("Div",), (x, "/sqrt")),)),   # x / sqrt folded
            Point("", ("Mul",), ("/x*1/sqrt", "const:1+w" if cfg.zero_centered_norms else f"weight:{weight}")))


def linear_points(x: str, weight: str) -> tuple:
    return (Point("", ("MatMul", "Gemm"), (x, f"weight:{weight}")),)


def rope_points(x: str, partial: bool) -> tuple:
    """kernels.rope.apply_rope over tap x: x cos + rotate_half(x) sin, with partial rotary the rotated channels
    sliced off first and the pass-through ones joined after."""
    rot = "/rot" if partial else x
    return ((Point("rot", ("Slice",), (x,)), Point("pass", ("Slice",), (x,))) if partial else ()) + (
        Point("x*cos", ("Mul",), (rot, "input:cos")), Point("x1", ("Slice",), (rot,)), Point("x2", ("Slice",), (rot,)),
        Point("-x2", ("Neg",), ("/x2",)), Point("rotate_half", ("Concat",), ("/-x2", "/x1")),
        Point("rotate_half*sin", ("Mul",), ("/rotate_half", "input:sin")),
        Point("sum" if partial else "", ("Add",), ("/x*cos", "/rotate_half*sin"))) + (
        (Point("", ("Concat",), ("/sum", "/pass")),) if partial else ())


def attention_nodes(cfg, i: int, gated: bool = False) -> dict:
    """`attention`'s taps. gated: q_proj holds [q_h | gate_h] per head, the output is gated before o_proj."""
    p, x, norm = f"model.layers.{i}.self_attn", f"model.layers.{i}.input_layernorm", norm_formula(cfg)
    positions = ("position_ids_cos", "position_ids_sin", "position_ids")
    wq, wk, wv, wo = (f"weight:{p}.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    partial = cfg.rotary_dim < cfg.head_dim
    qn, kn, qr, kr = f"{p}.q_norm", f"{p}.k_norm", f"{p}.q_rope", f"{p}.k_rope"
    o_in = f"{p}.gated_output" if gated else f"{p}.attn_output"
    nodes = {
        "q_proj": Node("linear", "q = x Wq^T (+ b)" + ("; rows per head [q_h | gate_h]" if gated else ""), (x,),
                       shape="[B, T, 2*Hq*D]" if gated else "[B, T, Hq*D]", module=1,
                       points=linear_points(x, wq[7:])),
        "k_proj": Node("linear", "k = x Wk^T (+ b)", (x,), shape="[B, T, Hkv*D]", module=1,
                       points=linear_points(x, wk[7:])),
        "v_proj": Node("linear", "v = x Wv^T (+ b)", (x,), shape="[B, T, Hkv*D]", module=1,
                       points=linear_points(x, wv[7:])),
        **({"gate": Node("split", "gate = second half of each head's q_proj rows", (f"{p}.q_proj",),
                         shape="[B, T, Hq*D]")} if gated else {}),
        "q_norm": Node("rms_norm", norm + " per head over D", (f"{p}.q_proj",), shape="[B, T, Hq, D]", module=1,
                       points=norm_points(cfg, f"{p}.q_proj", f"{qn}.weight")),
        "k_norm": Node("rms_norm", norm + " per head over D", (f"{p}.k_proj",), shape="[B, T, Hkv, D]", module=1,
                       points=norm_points(cfg, f"{p}.k_proj", f"{kn}.weight")),
        "q_rope": Node("rope", ROPE, (qn, *positions), shape="[B, T, Hq, D]", points=rope_points(qn, partial)),
        "k_rope": Node("rope", ROPE, (kn, *positions), shape="[B, T, Hkv, D]", points=rope_points(kn, partial)),
        "attn_scores": Node("matmul + mask",
                            "s = q k^T / sqrt(D) + max(M, floor); q head h reads kv head h // (Hq/Hkv)",
                            (qr, kr, f"cache:past_key.{i}", "position_ids", "attention_mask"),
                            shape="[B, Hq, T, P+T]", points=(
                                Point("keys", ("Concat",), ("input:past_keys", kr)),
                                Point("q*k^T", ("MatMul",), (qr, "/keys")),
                                Point("scaled", ("Mul",), ("/q*k^T", "const:scale")),
                                Point("", ("Add",), ("/scaled", "input:mask")))),
        "attn_probs": Node("softmax", "p = exp(s - max s) / sum exp(s - max s) over keys (float32)",
                           (f"{p}.attn_scores",), shape="[B, Hq, T, P+T]",
                           points=(Point("", ("Softmax",), (f"{p}.attn_scores",)),)),
        "attn_output": Node("matmul", "o = p v, heads flattened head-major",
                            (f"{p}.attn_probs", f"{p}.v_proj", f"cache:past_value.{i}"), shape="[B, T, Hq*D]",
                            points=(Point("values", ("Concat",), ("input:past_values", f"{p}.v_proj")),
                                    Point("", ("MatMul",), (f"{p}.attn_probs", "/values")))),
        **({"gated_output": Node("gate", "o * sigmoid(gate)", (f"{p}.attn_output", f"{p}.gate"),
                                 shape="[B, T, Hq*D]",
                                 points=(Point("sigmoid", ("Sigmoid",), (f"{p}.q_proj",)),   # gate: q_proj's half
                                         Point("", ("Mul",), (f"{p}.attn_output", "/sigmoid"))))}
           if gated else {}),
        "o_proj": Node("linear", "y = o Wo^T (+ b)", (o_in,), shape="[B, T, H]", module=1,
                       points=linear_points(o_in, wo[7:])),
    }
    return declare(nodes, p, i)


def mlp_nodes(p: str, x: str, layer: int) -> dict:
    """`mlp`'s taps (a dense layer's MLP, or a MoE block's shared expert)."""
    return declare({
        "gate_proj": Node("linear", "x Wg^T", (x,), shape="[B, T, I]", module=1,
                          points=linear_points(x, f"{p}.gate_proj.weight")),
        "up_proj": Node("linear", "x Wu^T", (x,), shape="[B, T, I]", module=1,
                        points=linear_points(x, f"{p}.up_proj.weight")),
        "act_fn": Node("activation", "act(gate_proj)", (f"{p}.gate_proj",), shape="[B, T, I]", module=1,
                       points=(Point("sigmoid", ("Sigmoid",), (f"{p}.gate_proj",)),
                               Point("", ("Mul",), (f"{p}.gate_proj", "/sigmoid")))),
        "hidden": Node("mul", "act_fn * up_proj", (f"{p}.act_fn", f"{p}.up_proj"), shape="[B, T, I]",
                       points=(Point("", ("Mul",), (f"{p}.act_fn", f"{p}.up_proj")),)),
        "down_proj": Node("linear", "y = hidden Wd^T", (f"{p}.hidden",), shape="[B, T, H]", module=1,
                          points=linear_points(f"{p}.hidden", f"{p}.down_proj.weight")),
    }, p, layer)


def moe_nodes(cfg, i: int) -> dict:
    """`moe`'s taps: the router (HF module `mlp.gate`, tapped as router_logits), the routed experts, and where the
    checkpoint has one the shared expert and its gate."""
    p, x = f"model.layers.{i}.mlp", f"model.layers.{i}.post_attention_layernorm"
    shared = cfg.shared_expert_intermediate_size
    # renormalised, a device graph may compute the same weights as the softmax of the top-k logits (the HTP's TopK of
    # a quantised Softmax reads an fp16 softmax: tests/e2e/quantised.py routing_as_topk_softmax): the other forms
    top = (Point("top-k", ("TopK",), (f"{p}.router_probs",), more=("#indices",),
                 also=((("TopK",), (f"{p}.router_logits",)),) if cfg.norm_topk_prob else ()),)
    weights = top + ((Point("sum", ("ReduceSum",), ("/top-k",)), Point("", ("Div",), ("/top-k", "/sum"),
                                                                        also=((("Softmax",), ("/top-k",)),)))
                     if cfg.norm_topk_prob else ())
    nodes = declare({
        "router_logits": Node("linear", "router logits = x Wr^T", (x,), shape="[B, T, E]", module=1,
                              module_name="gate", points=linear_points(x, f"{p}.gate.weight")),
        "router_probs": Node("softmax", "softmax over experts (float32)", (f"{p}.router_logits",), shape="[B, T, E]",
                             points=(Point("", ("Softmax",), (f"{p}.router_logits",)),)),
        "selected_experts": Node("top-k", "k experts of highest probability (ties: lower id)", (f"{p}.router_logits",),
                                 shape="[B, T, k] int"),
        "routing_weights": Node("top-k weights", "their probabilities, renormalised if norm_topk_prob",
                                (f"{p}.router_logits",), shape="[B, T, k]", points=weights),
        "experts": Node("expert mix", "sum_e w_e * down_e(act(gate_e x) * up_e x), ascending e",
                        (x, f"{p}.selected_experts", f"{p}.routing_weights"), shape="[B, T, H]", points=(
                            Point("gate_up", ("MatMul",), (f"weight:{p}.experts.gate_up_proj", x)),
                            Point("gate", ("Split", "SequenceAt"), ("/gate_up",), more=("up",)),
                            Point("up", ("SequenceAt",), ("/gate_up",)),   # an export without optimizer
                            Point("sigmoid", ("Sigmoid",), ("/gate",)), Point("act", ("Mul",), ("/gate", "/sigmoid")),
                            Point("hidden", ("Mul",), ("/act", "/up")),
                            Point("down", ("MatMul",), (f"weight:{p}.experts.down_proj", "/hidden")),
                            Point("weighted", ("Mul",), ("/down", f"{p}.routing_weights")),
                            Point("", ("ReduceSum",), ("/weighted",)))),
    }, p, i)
    if shared:
        nodes = merge(nodes, mlp_nodes(f"{p}.shared_expert", x, i), declare({"shared_expert_gate": Node(
            "linear", "x Wsg^T (one logit per token, before the sigmoid)", (x,), shape="[B, T, 1]", module=1)}, p, i))
    out = Node("add", "experts + sigmoid(shared_expert_gate) * shared_expert",
               (f"{p}.experts", f"{p}.shared_expert.down_proj", f"{p}.shared_expert_gate"), shape="[B, T, H]") \
        if shared else Node("identity", "out = experts", (f"{p}.experts",), shape="[B, T, H]")
    return merge(nodes, declare({"": out}, p, i))


def feed_forward_nodes(cfg, i: int) -> dict:
    if cfg.is_moe_layer(i):
        return moe_nodes(cfg, i)
    return mlp_nodes(f"model.layers.{i}.mlp", f"model.layers.{i}.post_attention_layernorm", i)


def layer_input(i: int) -> str:
    """Layer i's input: layer i-1's output, the embedding for layer 0."""
    return f"model.layers.{i - 1}" if i else "model.embed_tokens"


def decoder_layer_nodes(cfg, i: int, mixer_nodes: dict, mixer_output: str) -> dict:
    """`decoder_layer`'s taps around its token mixer's (mixer_nodes, whose output tap is mixer_output)."""
    p, norm = f"model.layers.{i}", norm_formula(cfg)
    ff = f"{p}.mlp" if cfg.is_moe_layer(i) else f"{p}.mlp.down_proj"
    # the value the residual add reads in an exported graph: a MoE block without shared expert is its expert mix
    ff_value = f"{p}.mlp.experts" if cfg.is_moe_layer(i) and not cfg.shared_expert_intermediate_size else ff
    x, h = layer_input(i), f"{p}.attn_residual"
    return merge(
        declare({"input_layernorm": Node("rms_norm", norm, (x,), shape="[B, T, H]", module=1,
                                         points=norm_points(cfg, x, f"{p}.input_layernorm.weight"))}, p, i),
        mixer_nodes,
        declare({"attn_residual": Node("residual add", "h = x + mixer(input_layernorm(x))", (x, mixer_output),
                                       shape="[B, T, H]", points=(Point("", ("Add",), (x, mixer_output)),)),
                 "post_attention_layernorm": Node("rms_norm", norm, (h,), shape="[B, T, H]", module=1,
                                                  points=norm_points(cfg, h, f"{p}.post_attention_layernorm.weight"))},
                p, i),
        feed_forward_nodes(cfg, i),
        declare({"": Node("residual add", "out = attn_residual + mlp", (h, ff), shape="[B, T, H]",
                          points=(Point("", ("Add",), (h, ff_value)),))}, p, i))


def layer_nodes(cfg, i: int) -> dict:
    return decoder_layer_nodes(cfg, i, attention_nodes(cfg, i), f"model.layers.{i}.self_attn.o_proj")


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
