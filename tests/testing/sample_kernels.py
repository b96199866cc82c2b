"""Sample "device" kernels for the toolkit's own tests: honest reduced-precision implementations, and the same
kernels with one seeded bug each.

The device model is an NPU's: operands in the device dtype (fp16 / bf16 / fp32), products accumulated in fp32,
every op's result rounded back to the device dtype (`rd`), state and gates in fp32. Each kernel takes a Case
(refimpl.testing) and returns what the case's reference returns. Bugs are keyword flags, so the bug is the only
difference between a passing and a failing kernel.
"""

import dataclasses
import math

import ml_dtypes
import numpy as np


def rd(x, dtype):
    """Round to the device dtype and continue in fp32 (the value an fp16 / bf16 register holds)."""
    return np.asarray(x, np.float32).astype(dtype).astype(np.float32)


def f32(x):
    return np.asarray(x).astype(np.float32)


# ------------------------------------------------------------------------------------------------ RoPE

def rope(case, *, interleaved=False):
    """y = (x1 c - x2 s, x2 c + x1 s) on the first rot channels, tables cast to the device dtype, every
    product and sum rounded. interleaved=True: the GPT-J pairing (2i, 2i+1) instead of the half split."""
    dt = case.dtype
    x = f32(case.inputs["x"])
    c, s = (rd(case.inputs[n], dt)[:, :, None, :] for n in ("cos", "sin"))
    h = c.shape[-1]
    if interleaved:
        x1, x2 = x[..., 0:2 * h:2], x[..., 1:2 * h:2]
    else:
        x1, x2 = x[..., :h], x[..., h:2 * h]
    y1 = rd(rd(x1 * c, dt) - rd(x2 * s, dt), dt)
    y2 = rd(rd(x2 * c, dt) + rd(x1 * s, dt), dt)
    y = x.copy()
    if interleaved:
        y[..., 0:2 * h:2], y[..., 1:2 * h:2] = y1, y2
    else:
        y[..., :h], y[..., h:2 * h] = y1, y2
    return y.astype(dt)


# ------------------------------------------------------------------------------------------------ SDPA

def sdpa(case, *, subtract_max=True, offset_bug=0, top_left=False, window_bug=0):
    """Attention with the mask built from offset / window / key_valid, scores and probabilities in the device
    dtype, sums in fp32. subtract_max=False: softmax as exp(s) / sum exp(s) (overflows fp16 above s = 11.09).
    offset_bug: added to the query offset (-1: the index of the last cached token instead of the count).
    top_left=True: the causal mask aligned top-left (query i sees keys <= i, offset 0), as torch's
    scaled_dot_product_attention(is_causal=True) builds it: wrong exactly when Lq != Lk. window_bug: added to the
    sliding window (1: each query sees window + 1 keys)."""
    dt, i, p = case.dtype, case.inputs, case.params
    q, k, v = f32(i["q"]), f32(i["k"]), f32(i["v"])
    B, Hq, Lq, D = q.shape
    Lk, r = k.shape[2], Hq // k.shape[1]
    k, v = np.repeat(k, r, axis=1), np.repeat(v, r, axis=1)
    s = rd(rd(q @ k.swapaxes(-1, -2), dt) * rd(p["scale"], dt), dt)  # [B, Hq, Lq, Lk]
    qpos = (0 if top_left else p["offset"] + offset_bug) + np.arange(Lq)[:, None]
    kpos = np.arange(Lk)[None, :]
    allowed = (kpos <= qpos)[None, None]
    if p["window"] is not None:
        allowed = allowed & (kpos > qpos - p["window"] - window_bug)[None, None]
    if i["key_valid"] is not None:
        allowed = allowed & (i["key_valid"] != 0)[:, None, None, :]
    floor = {"finfo": float(ml_dtypes.finfo(dt).min), "-inf": -math.inf}.get(p["floor"], p["floor"])
    with np.errstate(invalid="ignore", over="ignore"):
        s = rd(s + np.where(allowed, 0.0, floor), dt)
        if subtract_max:
            s = rd(s - s.max(axis=-1, keepdims=True), dt)
        e = rd(np.exp(s), dt)
        probs = rd(e / e.sum(axis=-1, keepdims=True), dt)
    return rd(probs @ v, dt).astype(dt)


# ------------------------------------------------------------------------------------------------ RMSNorm

def rms_norm(case, *, fp16_sum=False):
    """nu(x) = x / sqrt(mean(x^2) + eps) with the sum of squares in fp32 (fp16_sum=True: in the device dtype,
    which overflows fp16 for |x| > 256), then the variant's weight and gate, each op rounded."""
    dt, i, p = case.dtype, case.inputs, case.params
    x = f32(i["x"])
    with np.errstate(over="ignore"):  # the fp16_sum bug overflows to inf: that is the bug
        sq = rd(x * x, dt) if fp16_sum else x * x
        ms = rd(sq.sum(-1, keepdims=True), dt) / x.shape[-1] if fp16_sum else sq.mean(-1, keepdims=True)
        n = rd(x * (1 / np.sqrt(ms + np.float32(p["eps"]))), dt)
    w = f32(i["weight"])
    if p["variant"] == "zero_centered":
        return rd(n * (1 + w), dt).astype(dt)
    y = rd(w * n, dt)
    if p["variant"] == "gated":
        g = f32(i["gate"])
        y = rd(y * rd(g / (1 + np.exp(-g)), dt), dt)
    return y.astype(dt)


# ------------------------------------------------------------------------------------------------ gated delta rule

def gated_delta(case, *, gate_after_update=False, no_beta=False, state_dtype=np.float32):
    """The recurrence token by token: q / k / v in the device dtype, gates and the state in fp32, the products
    S^T k and S^T q accumulated in fp32 from device-dtype operands (the state is rounded where it meets them),
    u and o rounded. gate_after_update: S <- exp(g) (S + k u^T) with u from the undecayed state (the decay
    applied after the delta update); no_beta: u = v - S^T k; state_dtype: the dtype the state is stored in
    between steps (spec §7.8: an fp16 / bf16 state costs accuracy and a reference should flag it)."""
    dt, i, p = case.dtype, case.inputs, case.params
    q, k, v = f32(i["q"]), f32(i["k"]), f32(i["v"])
    g, beta = f32(i["g"]), f32(i["beta"])
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    r = Hv // Hk
    if p["use_qk_l2norm"]:
        q = rd(q / np.sqrt((q * q).sum(-1, keepdims=True) + np.float32(1e-6)), dt)
        k = rd(k / np.sqrt((k * k).sum(-1, keepdims=True) + np.float32(1e-6)), dt)
    q = rd(q * np.float32(p["scale"]), dt)
    q, k = np.repeat(q, r, axis=2), np.repeat(k, r, axis=2)  # [B, T, Hv, Dk]
    S = np.zeros((B, Hv, Dk, Dv), np.float32) if i["initial_state"] is None else f32(i["initial_state"]).copy()
    o = np.empty((B, T, Hv, Dv), np.float32)
    for t in range(T):
        decay = np.exp(g[:, t])[:, :, None, None]
        if not gate_after_update:
            S = S * decay
        kS = np.einsum("bhk,bhkv->bhv", k[:, t], rd(S, dt))
        u = rd(v[:, t] - kS, dt) if no_beta else rd(beta[:, t, :, None] * (v[:, t] - kS), dt)
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        if gate_after_update:
            S = S * decay
        S = rd(S, state_dtype)  # fp32: a no-op; fp16 / bf16: a state kept in reduced precision between steps
        o[:, t] = rd(np.einsum("bhk,bhkv->bhv", q[:, t], rd(S, dt)), dt)
    return o.astype(dt), S


# ------------------------------------------------------------------------------------------------ causal conv1d

def conv1d(case, *, state_shift=0):
    """y = silu(sum of Kc taps) accumulated in fp32 from device-dtype operands, rounded; the new state is the last
    state_len raw columns. state_shift=1: the state window ends one column early (shifted by one)."""
    dt, i, p = case.dtype, case.inputs, case.params
    x, w = i["x"], f32(i["weight"])
    B, C, T = x.shape
    Kc, S = w.shape[1], p["state_len"]
    state = np.zeros((B, C, S), dt) if i["state"] is None else i["state"]
    hist = np.concatenate([state, x], axis=2)  # raw, in the device dtype
    X = f32(hist[:, :, hist.shape[2] - (Kc - 1) - T:])
    y = sum(w[:, j, None] * X[:, :, j:j + T] for j in range(Kc))
    y = rd(y / (1 + np.exp(-y)), dt)
    end = hist.shape[2] - state_shift
    return y.astype(dt), hist[:, :, end - S:end].copy()


# ------------------------------------------------------------------------------------------------ MoE routing

def moe_routing(case, *, ignore_norm_topk_prob=False):
    """softmax in fp32, top-k by probability (ties to the higher id, unlike refimpl, which is allowed), weights
    renormalised if norm_topk_prob, rounded to the device dtype."""
    logits = f32(case.inputs["logits"])
    e = np.exp(logits - logits.max(-1, keepdims=True))
    probs = e / e.sum(-1, keepdims=True)
    k = case.params["top_k"]
    experts = np.argsort(-probs[:, ::-1], axis=-1, kind="stable")[:, :k]
    experts = probs.shape[1] - 1 - experts  # ties go to the higher expert id
    w = np.take_along_axis(probs, experts, axis=-1)
    if case.params["norm_topk_prob"] and not ignore_norm_topk_prob:
        w = w / w.sum(-1, keepdims=True)
    return rd(w, case.dtype).astype(case.dtype), experts


def in_bfloat16(kernel):
    """The kernel run with bf16 roundings inside while the case (and its tolerance) says fp16: a precision bug
    (8x coarser rounding) that the fp16 tolerances must resolve."""
    def run(case):
        out = kernel(dataclasses.replace(case, dtype=np.dtype(ml_dtypes.bfloat16)))
        if isinstance(out, tuple):
            return tuple(np.asarray(o).astype(np.float32) for o in out)
        return out.astype(np.float16)
    return run
