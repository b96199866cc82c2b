"""Qwen3-Next and Qwen3.5 (dense and MoE) layers: Gated DeltaNet linear attention and gated full attention.

Layer i mixes tokens with `linear_attn` (Gated DeltaNet) or `self_attn` (gated attention) by layer_types[i];
norms are zero-centred (1 + w); the MLP is dense or sparse with a shared expert (models.md §6).

Gated DeltaNet block, x [B, T, H] (the input_layernorm output):
  mixed_qkv, z, b, a = projections of x                   (Next: fused, grouped per key head; 3.5: split)
  q, k, v = split( silu(conv1d(mixed_qkv)) )              conv1d: causal depthwise; its state the last Kc raw inputs
  q, k    = l2norm(q), l2norm(k)                           eps: cfg.linear_l2norm_eps
  beta    = sigmoid(b);   g = -exp(A_log) * softplus(a + dt_bias)
  o, S    = gated delta rule(q, k, v, g, beta, S)          chunked; one recurrent step for a cached single token
  out     = out_proj( rms_norm_gated(o, z) )

Emulated bf16 / fp16 (refimpl/precision.py) rounds, as transformers does in that dtype: the projections, the conv
output and its silu, beta, the core output and the gated norm; g, the l2norms and the whole delta-rule core
(its recurrent state included) stay float32, as transformers computes them. htp-fp16 (an fp16 NPU, docs/htp.md)
rounds those too, op by op, the rule token by token (kernels.gated_delta.gated_delta_rounded) or, with the policy's
delta_rule_chunk, in chunks as AI Hub's graph code runs it (kernels.gated_delta.gated_delta_chunked_rounded).
"""

import numpy as np

from ..graph import Node, Point, declare
from ..kernels.activation import activate, sigmoid, sigmoid_rounded, softplus, softplus_rounded
from ..kernels.conv import causal_conv1d
from ..kernels.elementary import exp
from ..kernels.gated_delta import (
    gated_delta_chunked,
    gated_delta_chunked_rounded,
    gated_delta_recurrent,
    gated_delta_rounded,
    gated_delta_step,
    l2_normalize,
    l2_normalize_rounded,
)
from ..kernels.norm import rms_norm_gated
from ..trace import conform, override, tap
from . import qwen3
from .cache import LinearAttentionState


def gated_attention_mixer(w, i, x, cfg, ctx):
    return qwen3.attention(w, f"model.layers.{i}.self_attn", x, cfg, ctx, i, gated=True)


def linear_attention_mixer(w, i, x, cfg, ctx):
    return gated_deltanet(w, f"model.layers.{i}.linear_attn", i, x, cfg, ctx)


def mixer(cfg, i: int):
    """Layer i's token mixer: Gated DeltaNet or gated attention, by layer_types[i]."""
    return linear_attention_mixer if cfg.layer_types[i] == "linear_attention" else gated_attention_mixer


def projections(w, p: str, x: np.ndarray, cfg, put, ctx):
    """x [B, T, H] -> mixed_qkv [B, T, conv_dim] (channels [q | k | v], head-major), z [B, T, Hv, Dv],
    b and a [B, T, Hv]; from Qwen3.5's split projections or Qwen3-Next's fused ones. put(name, value) taps
    each projection output (qwen3.project: cast, quantised where the encodings say) and returns what the block
    continues with."""
    B, T, _ = x.shape
    Hk, Hv, Dk, Dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    n = Hv // Hk

    def proj(name):
        return put(name, qwen3.project(w, f"{p}.{name}", x, ctx))
    if cfg.fused_linear_projections:
        # Qwen3-Next: rows grouped per key head kh as [q (Dk) | k (Dk) | v (n*Dv) | z (n*Dv)] and [b (n) | a (n)]
        qkvz = proj("in_proj_qkvz").reshape(B, T, Hk, 2 * Dk + 2 * n * Dv)
        ba = proj("in_proj_ba").reshape(B, T, Hk, 2 * n)
        q, k, v, z = np.split(qkvz, [Dk, 2 * Dk, 2 * Dk + n * Dv], axis=-1)
        mixed_qkv = np.concatenate([q.reshape(B, T, Hk * Dk), k.reshape(B, T, Hk * Dk), v.reshape(B, T, Hv * Dv)], -1)
        b, a = ba[..., :n].reshape(B, T, Hv), ba[..., n:].reshape(B, T, Hv)   # value head h = kh * n + j
        return mixed_qkv, z.reshape(B, T, Hv, Dv), b, a
    mixed_qkv, z, b, a = (proj(name) for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
    return mixed_qkv, z.reshape(B, T, Hv, Dv), b, a


def _gdn(w, p: str, x: np.ndarray, cfg, state: LinearAttentionState | None, put, ctx):
    """The block on rows that are all real tokens.  x [B, T, H] -> (out [B, T, H], new state).
    put(name, value) taps an intermediate and returns what the block continues with (refimpl.trace.tap);
    ctx.round is the activation cast, ctx.quant the AIMET quantisers."""
    B, T, _ = x.shape
    Hk, Dk, Dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    key_dim, r, quant = Hk * Dk, ctx.round, ctx.quant
    at = quant.at(f"{p}.in_proj_qkv")
    if "masked" in at.points:   # a device graph zeroing pad rows (x * mask; its mask 1 on the real rows run here)
        x = at("masked", x * at("pad_mask", np.ones((), x.dtype)))
    mixed_qkv, z, b, a = projections(w, p, x, cfg, put, ctx)
    mixed_qkv = put("mixed_qkv", mixed_qkv)
    conv_in = quant.input(f"{p}.conv1d", mixed_qkv).transpose(0, 2, 1)                 # [B, conv_dim, T]
    conv_out, conv_state = causal_conv1d(conv_in, w[f"{p}.conv1d.weight"][:, 0, :],
                                         None if state is None else state.conv, activation=None, rnd=r,
                                         at=quant.at(f"{p}.conv1d"))
    conv_out = put("conv1d", quant.output(f"{p}.conv1d", conv_out.transpose(0, 2, 1)))  # [B, T, conv_dim]
    at = quant.at(f"{p}.conv1d_silu")
    conv_out = put("conv1d_silu", quant.output(f"{p}.conv1d_silu", r(activate("silu", conv_out, at=at))))
    q, k, v = np.split(conv_out, [key_dim, 2 * key_dim], axis=-1)
    if at.points:   # the split as a device graph quantises its parts
        q, k, v = at("split_q", q), at("split_k", k), at("split_v", v)
    npu = ctx.precision.rounds_each_op   # htp-fp16: g, the l2norms and the delta rule rounded at each op too

    def l2(x, eps, node):
        return l2_normalize_rounded(x, r, eps) if npu else l2_normalize(x, eps, at=quant.at(node))
    q = put("q", quant.output(f"{p}.q", l2(q.reshape(B, T, Hk, Dk), cfg.linear_l2norm_eps, f"{p}.q")))
    k = put("k", quant.output(f"{p}.k", l2(k.reshape(B, T, Hk, Dk), cfg.linear_l2norm_eps, f"{p}.k")))
    v = put("v", v.reshape(B, T, -1, Dv))                                              # [B, T, Hv, Dv]
    z = put("z", z)
    beta = put("beta", quant.output(f"{p}.beta", sigmoid_rounded(b, r) if npu else r(sigmoid(b))))   # [B, T, Hv]
    if npu:   # -exp(A_log) a constant of the graph; a + dt_bias, softplus and the product on the NPU
        g = put("g", r(r(-exp(w[f"{p}.A_log"])) * softplus_rounded(r(a + w[f"{p}.dt_bias"]), r)))
    else:
        at = quant.at(f"{p}.g")
        t = at("+dt_bias", a + w[f"{p}.dt_bias"])                                     # a + dt_bias
        sp = softplus(t)
        if "softplus_raw" in at.points:   # a device's Softplus, then Where(t > 20, t, .) as torch's threshold
            sp = np.where(t > at("threshold", t.dtype.type(20)), t, at("softplus_raw", softplus(np.minimum(t, 20))))
        g = at("-exp(A_log)", -exp(w[f"{p}.A_log"])) * at("softplus", sp)
        g = put("g", quant.output(f"{p}.g", g))                                       # [B, T, Hv], < 0
    chunk = ctx.precision.delta_rule_chunk
    if npu and chunk:   # in chunks, as AI Hub's graph code runs the rule (prompt and decode alike)
        core, S = gated_delta_chunked_rounded(q, k, v, g, beta, None if state is None else state.recurrent, r, chunk)
    elif npu:   # token by token, as a static NPU graph of transformers' recurrent rule runs it
        core, S = gated_delta_rounded(q, k, v, g, beta, None if state is None else state.recurrent, r)
    elif quant.at(f"{p}.core").points:   # a device graph's quantisers inside the rule: its recurrent form, op by op
        core, S = gated_delta_recurrent(q, k, v, g, beta, None if state is None else state.recurrent,
                                        use_qk_l2norm=False, at=quant.at(f"{p}.core"))
    elif state is not None and T == 1:
        core, S = gated_delta_step(q, k, v, g, beta, state.recurrent, use_qk_l2norm=False)
    else:
        core, S = gated_delta_chunked(q, k, v, g, beta, None if state is None else state.recurrent,
                                      use_qk_l2norm=False, allow_neg_inf=True)         # [B, T, Hv, Dv]
    core = put("core", quant.output(f"{p}.core", r(core)))                            # float32 core, cast out
    normed = quant.output(f"{p}.norm", rms_norm_gated(quant.input(f"{p}.norm", core, 0), quant.input(f"{p}.norm", z, 1),
                                                      w[f"{p}.norm.weight"], cfg.rms_norm_eps, rnd=r,
                                                      at=quant.at(f"{p}.norm")))
    normed = put("norm", normed)                                                       # [B, T, Hv, Dv]
    out = put("out_proj", qwen3.project(w, f"{p}.out_proj", normed.reshape(B, T, -1), ctx))
    return out, LinearAttentionState(conv_state, S.astype(np.result_type(np.float32, x.dtype)))


def gated_deltanet(w, p: str, layer: int, x: np.ndarray, cfg, ctx) -> np.ndarray:
    """Gated DeltaNet over x [B, T, H]. With padding, each row runs on its real tokens only, so a pad step is
    the identity on the conv and the recurrent state wherever it sits (transformers zeroes pad inputs, which
    is the same for left padding of a fresh sequence); pad rows of the outputs are zeros (don't-care)."""
    cache = ctx.cache
    state = cache.layers[layer] if cache is not None else None
    if ctx.linear_mask is None:
        out, new_state = _gdn(w, p, x, cfg, state, lambda name, value: tap(p, name, value), ctx)
    else:
        B, T, _ = x.shape
        out, taps, rows = np.zeros_like(x), {}, []
        for row in range(B):
            real = np.flatnonzero(ctx.linear_mask[row])
            row_state = None if state is None else LinearAttentionState(state.conv[row:row + 1],
                                                                       state.recurrent[row:row + 1])
            if len(real) == 0:
                rows.append(row_state)
                continue

            def put(name, value, row=row, real=real):  # the row's real tokens of each tap, taps written below
                taps.setdefault(name, np.zeros((B, T, *value.shape[2:]), value.dtype))[row, real] = value[0]
                given = override(f"{p}.{name}")
                return value if given is None else conform(f"{p}.{name}", given, taps[name])[row:row + 1, real]

            o, s = _gdn(w, p, x[row:row + 1, real], cfg, row_state, put, ctx)
            out[row, real] = o[0]
            rows.append(s)
        rows = [s or zero_state(cfg, x.dtype) for s in rows]  # a fresh row that was all padding: zero state
        new_state = LinearAttentionState(np.concatenate([s.conv for s in rows]),
                                         np.concatenate([s.recurrent for s in rows]))
        for name, value in taps.items():
            tap(p, name, value)
    tap(p, "conv_state", new_state.conv), tap(p, "recurrent_state", new_state.recurrent)
    if cache is not None:
        cache.layers[layer] = new_state
    return out


def zero_state(cfg, dtype, conv_len: int | None = None) -> LinearAttentionState:
    """The state before any token: conv [1, conv_dim, conv_len] (default Kc, as transformers keeps it) and
    recurrent [1, Hv, Dk, Dv] zeros."""
    conv_len = cfg.linear_conv_kernel_dim if conv_len is None else conv_len
    return LinearAttentionState(np.zeros((1, cfg.conv_dim, conv_len), dtype),
                                np.zeros((1, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                          cfg.linear_value_head_dim), np.result_type(np.float32, dtype)))


def linear_attention_tensors(cfg, p: str) -> dict:
    H, Hk, Hv, Dk, Dv, Kc = (cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                             cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim)
    key_dim, value_dim = Hk * Dk, Hv * Dv
    t = {f"{p}.conv1d.weight": (2 * key_dim + value_dim, 1, Kc), f"{p}.dt_bias": (Hv,), f"{p}.A_log": (Hv,),
         f"{p}.norm.weight": (Dv,), f"{p}.out_proj.weight": (H, value_dim)}
    if cfg.fused_linear_projections:
        t.update({f"{p}.in_proj_qkvz.weight": (2 * key_dim + 2 * value_dim, H), f"{p}.in_proj_ba.weight": (2 * Hv, H)})
    else:
        t.update({f"{p}.in_proj_qkv.weight": (2 * key_dim + value_dim, H), f"{p}.in_proj_z.weight": (value_dim, H),
                  f"{p}.in_proj_b.weight": (Hv, H), f"{p}.in_proj_a.weight": (Hv, H)})
    return t


def linear_attention_nodes(cfg, i: int) -> dict:
    """`gated_deltanet`'s taps (qwen3.py's comment on the graph says what module=k and "cache:" mean)."""
    p, x = f"model.layers.{i}.linear_attn", f"model.layers.{i}.input_layernorm"
    fused = cfg.fused_linear_projections
    qkv = f"{p}.in_proj_qkvz" if fused else f"{p}.in_proj_qkv"
    pads = ("attention_mask", "position_ids")  # how the graph tells pad slots (which leave the state alone)
    xm = f"{p}.in_proj_qkv/masked"              # x as the projections read it (a graph zeroing pad rows: x * mask)
    silu_out, b_in = f"{p}.conv1d_silu", f"{p}.in_proj_ba" if fused else f"{p}.in_proj_b"
    a_in = f"{p}.in_proj_ba" if fused else f"{p}.in_proj_a"
    z_in = qkv if fused else f"{p}.in_proj_z"   # z's value in a graph: the projection's (a split moves data)
    conv_in = (f"cache:conv_state.{i}", *pads)
    core_in = (f"{p}.q", f"{p}.k", f"{p}.v", f"{p}.g", f"{p}.beta", f"cache:recurrent_state.{i}", *pads)
    projections = {
        "in_proj_qkvz": Node("linear", "[q | k | v | z] per key head = x W^T", (x,), shape="[B, T, 2*Hk*Dk + 2*Hv*Dv]",
                             module=1),
        "in_proj_ba": Node("linear", "[b | a] per key head = x W^T", (x,), shape="[B, T, 2*Hv]", module=1),
    } if fused else {
        "in_proj_qkv": Node("linear", "[q | k | v] = x W^T", (x,), shape="[B, T, conv_dim]", module=1,
                            points=(Point("masked", ("Mul",), (x, "const:pad_mask")),
                                    *qwen3.linear_points(xm, f"{p}.in_proj_qkv.weight"))),
        "in_proj_z": Node("linear", "z = x Wz^T", (x,), shape="[B, T, Hv*Dv]", module=1,
                          points=qwen3.linear_points(xm, f"{p}.in_proj_z.weight")),
        "in_proj_b": Node("linear", "b = x Wb^T", (x,), shape="[B, T, Hv]", module=1,
                          points=qwen3.linear_points(xm, f"{p}.in_proj_b.weight")),
        "in_proj_a": Node("linear", "a = x Wa^T", (x,), shape="[B, T, Hv]", module=1,
                          points=qwen3.linear_points(xm, f"{p}.in_proj_a.weight")),
    }
    return declare({
        **projections,
        "mixed_qkv": Node("split / concat", "channels [q | k | v], head-major", (qkv,), shape="[B, T, conv_dim]"),
        "conv1d": Node("causal_conv1d", "y[c, t] = sum_j w[c, j] x[c, t - Kc + 1 + j] over [state | x]",
                       (f"{p}.mixed_qkv", *conv_in), shape="[B, T, conv_dim]", module=1,
                       points=(Point("x", ("Concat",), ("input:conv_state", qkv)),
                               Point("", ("Conv",), ("/x", f"weight:{p}.conv1d.weight")))),
        "conv1d_silu": Node("silu", "y = x * sigmoid(x)", (f"{p}.conv1d",), shape="[B, T, conv_dim]",
                            points=(Point("sigmoid", ("Sigmoid",), (f"{p}.conv1d",)),
                                    Point("", ("Mul",), (f"{p}.conv1d", "/sigmoid")),
                                    Point("split_q", ("Split",), (silu_out,), more=("split_k", "split_v")))),
        "q": Node("l2_normalize", "q / sqrt(sum q^2 + eps)", (f"{p}.conv1d_silu",), shape="[B, T, Hk, Dk]",
                  points=l2_points(f"{silu_out}/split_q")),
        "k": Node("l2_normalize", "k / sqrt(sum k^2 + eps)", (f"{p}.conv1d_silu",), shape="[B, T, Hk, Dk]",
                  points=l2_points(f"{silu_out}/split_k")),
        "v": Node("split", "v channels of conv1d_silu", (f"{p}.conv1d_silu",), shape="[B, T, Hv, Dv]"),
        "z": Node("split", "z = output gate", (qkv if fused else f"{p}.in_proj_z",), shape="[B, T, Hv, Dv]"),
        "beta": Node("sigmoid", "beta = sigmoid(b)", (b_in,), shape="[B, T, Hv]",
                     points=(Point("", ("Sigmoid",), (b_in,)),)),
        "g": Node("gate", "g = -exp(A_log) * softplus(a + dt_bias)", (a_in,), shape="[B, T, Hv]", points=(
            Point("+dt_bias", ("Add",), (a_in, f"weight:{p}.dt_bias"),   # or fused with in_proj_a into a Gemm
                  also=() if fused else ((("Gemm",), (xm, f"weight:{a_in}.weight", f"weight:{p}.dt_bias")),)),
            Point("softplus_raw", ("Softplus",), ("/+dt_bias",)),
            Point("softplus", ("Where",), ("const:threshold", "/+dt_bias", "/softplus_raw")),
            Point("", ("Mul",), ("const:-exp(A_log)", "/softplus")))),
        "core": Node("gated delta rule", "S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q / sqrt(Dk)", core_in,
                     shape="[B, T, Hv, Dv]", points=core_points(p, f"{silu_out}/split_v")),
        "norm": Node("rms_norm_gated", "y = w * x / sqrt(mean(x^2) + eps) * silu(z)", (f"{p}.core", f"{p}.z"),
                     shape="[B, T, Hv, Dv]", module=2, points=(
                         *qwen3.norm_points(cfg, f"{p}.core", None)[:-1],
                         Point("w*x", ("Mul",), ("/x*1/sqrt", f"weight:{p}.norm.weight")),
                         Point("sigmoid", ("Sigmoid",), (z_in,)),
                         Point("silu(z)", ("Mul",), (z_in, "/sigmoid")),
                         Point("", ("Mul",), ("/w*x", "/silu(z)")))),
        "out_proj": Node("linear", "y = x Wo^T", (f"{p}.norm",), shape="[B, T, H]", module=1,
                         points=qwen3.linear_points(f"{p}.norm", f"{p}.out_proj.weight")),
        "conv_state": Node("state update", "last Kc raw conv inputs of [state | mixed_qkv]",
                           (f"{p}.mixed_qkv", *conv_in), shape="[B, conv_dim, Kc]"),
        "recurrent_state": Node("state update", "S after the last real token", core_in, shape="[B, Hv, Dk, Dv]"),
    }, p, i)


def core_points(p: str, v: str) -> tuple:
    """kernels.gated_delta's recurrent rule op by op, as transformers' torch_recurrent_gated_delta_rule exports
    (one unrolled step per token; graph.Point: "x@t" token t's value, "/S@t-1" the previous token's state, the
    graph's state input at token 0). Its chunked form (the prompt's in transformers) is another factorisation:
    found whole ("*", its inputs), no points inside."""
    q, k, g, beta = f"{p}.q", f"{p}.k", f"{p}.g", f"{p}.beta"
    return (Point("q/sqrt(Dk)", ("Div",), (q, "const:sqrt(Dk)")),
            Point("exp(g)", ("Exp",), (f"{g}@t",)),
            Point("decayed", ("Mul",), ("/S@t-1", "/exp(g)@t"), first=("input:state", "/exp(g)@t")),
            Point("S*k", ("Mul",), ("/decayed@t", f"{k}@t")),
            Point("S^T k", ("ReduceSum",), ("/S*k@t",)),
            Point("v-S^T k", ("Sub",), (f"{v}@t", "/S^T k@t")),
            Point("delta", ("Mul",), ("/v-S^T k@t", f"{beta}@t")),
            Point("k delta^T", ("Mul",), (f"{k}@t", "/delta@t"),                       # k_t delta_t^T broadcast,
                  also=((("MatMul",), (f"{k}@t", "/delta@t")),)),        # or [Dk, 1] x [1, Dv] (K = 1)
            Point("S", ("Add",), ("/decayed@t", "/k delta^T@t")),
            Point("S*q", ("Mul",), ("/S@t", "/q/sqrt(Dk)@t")),
            Point("o", ("ReduceSum",), ("/S*q@t",)),
            Point("", ("Concat",), ("/o@*",), also=((("*",), (q, k, v, beta, g)),)))


def l2_points(x: str) -> tuple:
    """kernels.gated_delta.l2_normalize over value x (its node the normalised value)."""
    return (Point("x^2", ("Mul", "Pow"), (x, x)), Point("sum", ("ReduceSum",), ("/x^2",)),
            Point("+eps", ("Add",), ("/sum", "const:eps")), Point("sqrt", ("Sqrt",), ("/+eps",)),
            Point("1/sqrt", ("Reciprocal",), ("/sqrt",)),
            Point("", ("Mul",), (x, "/1/sqrt"), also=((("Div",), (x, "/sqrt")),)))   # x / sqrt folded


def layer_nodes(cfg, i: int) -> dict:
    """Layer i's taps: Gated DeltaNet or gated attention, in the pre-norm layer with its MLP."""
    if cfg.layer_types[i] == "linear_attention":
        return qwen3.decoder_layer_nodes(cfg, i, linear_attention_nodes(cfg, i),
                                         f"model.layers.{i}.linear_attn.out_proj")
    return qwen3.decoder_layer_nodes(cfg, i, qwen3.attention_nodes(cfg, i, gated=True),
                                     f"model.layers.{i}.self_attn.o_proj")


def mixer_tensors(cfg, i: int) -> dict:
    if cfg.layer_types[i] == "linear_attention":
        return linear_attention_tensors(cfg, f"model.layers.{i}.linear_attn")
    return qwen3.attention_tensors(cfg, f"model.layers.{i}.self_attn", gated=True)


def expected_tensors(cfg) -> dict:
    """Checkpoint name -> shape of every tensor a Qwen3-Next / Qwen3.5 forward reads."""
    return qwen3.expected_tensors(cfg, mixer_tensors)
