"""Test cases for users' kernels: the inputs a device kernel receives, and refimpl's answer for them.

A Case holds arrays already rounded to the device dtype (float16 / bfloat16 / float32), the scalar parameters,
and knows its reference: refimpl's kernel run in float64 on exactly those inputs, so the reference carries no
rounding of its own and every difference is the device kernel's. `Case.check(actual)` compares with the
dtype-aware tolerances of tolerance.py, per output. The make_*_case builders are plain NumPy (seeded) and need
no hypothesis; strategies.py draws their arguments.

    case = make_sdpa_case(0, dtype="float16", Lq=3, Lk=9)
    out = my_sdpa(case.inputs["q"], case.inputs["k"], case.inputs["v"], case.inputs["mask"])
    case.check(out)        # AssertionError naming the worst element, or a list of per-output scores
"""

import math
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from ..kernels.attention import causal_mask, sdpa
from ..kernels.conv import causal_conv1d
from ..kernels.gated_delta import gated_delta_recurrent, l2_normalize
from ..kernels.moe import route
from ..kernels.norm import rms_norm, rms_norm_gated
from ..kernels.rope import apply_rope, default_inv_freq, rope_tables
from .tolerance import GROWTH, compare, dtype_of, unit_roundoff


@dataclass(frozen=True, eq=False)
class Output:
    """One output of a case: its name, the op (for messages), the growths (G, F) of its tolerance (tolerance.py),
    a valid mask, and the error scale (None: rms(expected); else the rms magnitude of the op's terms, where the
    output can cancel)."""
    name: str
    op: str
    growth: tuple
    valid: np.ndarray | None = None
    scale: float | None = None


@dataclass(frozen=True, eq=False)
class Case:
    """Inputs of one kernel call and how to judge its outputs.

    op: "rope" | "sdpa" | "rms_norm" | "gated_delta" | "conv1d" | "moe_routing"; dtype: the device dtype;
    inputs: name -> array (in dtype unless a builder says otherwise) or None; params: scalars (scale, eps,
    offset, window, chunk_size, ...); outputs: what the kernel returns, in order.
    """
    op: str
    dtype: np.dtype
    inputs: dict
    params: dict
    outputs: tuple
    seed: int = 0
    _ref: list = field(default_factory=list, repr=False)

    def reference(self):
        """refimpl's answer in float64: one array, or a tuple in the order of `outputs` (cached)."""
        if not self._ref:
            with np.errstate(invalid="ignore", over="ignore"):  # -inf masks on fully blocked rows give NaN there
                self._ref.append(_REFERENCES[self.op](self))
        return self._ref[0]

    def check(self, actual, **overrides) -> list:
        """assert_close of each output against the reference with this case's tolerances (overrides: rtol, atol,
        ratio, growth, metric, scale). actual: an array, or a tuple in the order of `outputs`. Returns the scores.
        A gated delta state returned in a 16-bit dtype fails unless allow_low_precision_state=True."""
        if self.op == "moe_routing":
            return [check_routing(self, *actual, **overrides)]
        allow_low_state = overrides.pop("allow_low_precision_state", False)
        expected = self.reference()
        many = len(self.outputs) > 1
        actual, expected = (tuple(actual), expected) if many else ((actual,), (expected,))
        if len(actual) != len(self.outputs):
            raise AssertionError(f"{self.op}: expected {len(self.outputs)} outputs "
                                 f"{[o.name for o in self.outputs]}, got {len(actual)}")
        if self.op == "gated_delta" and not allow_low_state and np.asarray(actual[1]).dtype.itemsize < 4:
            # an fp16 / bf16 state stays within the output tolerances at these lengths (the delta rule contracts),
            # yet costs task accuracy in serving: gated_deltanet.md §7.8 asks a reference to flag it
            raise AssertionError(f"gated_delta: the final state is {np.asarray(actual[1]).dtype}; keep the recurrent "
                                 "state in float32 (gated_deltanet.md §7.8), or pass allow_low_precision_state=True")
        scores = []
        for out, a, e in zip(self.outputs, actual, expected):
            kw = {"growth": out.growth, "scale": out.scale, **overrides}
            r = compare(a, e, dtype=self.dtype, op=out.op, valid=out.valid, **kw)
            if not r["passed"]:
                raise AssertionError(f"{self.op} output {out.name!r} ({self.describe()}):\n{r['message']}")
            scores.append(r)
        return scores

    def describe(self) -> str:
        """Shapes and parameters in one line, for failure messages."""
        shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in self.inputs.items() if isinstance(v, np.ndarray))
        params = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.dtype.name}; {shapes}; {params}; seed {self.seed}"


def _cast(x, dtype):
    """Round to the device dtype (round to nearest even, bf16 through ml_dtypes)."""
    return np.asarray(x).astype(dtype)


def _f64(x):
    return None if x is None else np.asarray(x).astype(np.float64)


def _rms(x) -> float:
    x = _f64(x)
    return math.sqrt(float(np.mean(x * x))) if x.size else 0.0


# ------------------------------------------------------------------------------------------------ RoPE

def make_rope_case(seed, *, dtype="float16", B=1, T=4, H=2, D=16, rotary_fraction=1.0, theta=1e6,
                   max_position=4096, magnitude=1.0) -> Case:
    """Half-split RoPE of x [B, T, H, D] over its first rot = D * rotary_fraction channels (even).

    inputs: x [B, T, H, D] (dtype); positions [B, T] int64 in [0, max_position); inv_freq [rot/2] float32;
    cos, sin [B, T, rot/2] float32: refimpl's float32 tables (what its float32 model computes and what device
    graphs take as position_ids_cos / _sin). The kernel may use the tables (cast as it likes) or recompute them
    as refimpl and transformers do (angle = position * inv_freq rounded to float32); other angle arithmetic moves
    angles at position 1e6 by up to ~0.06 rad and fails, as it should: those tables define the model.
    Reference: apply_rope on x with the tables, in float64. Output: y [B, T, H, D].
    """
    rng = np.random.default_rng(seed)
    dtype = dtype_of(dtype)
    rot = max(2, 2 * int(round(D * rotary_fraction / 2)))
    x = _cast(magnitude * rng.standard_normal((B, T, H, D)), dtype)
    positions = rng.integers(0, max_position, (B, T))
    inv_freq = default_inv_freq(theta, rot, np.float32)
    cos, sin = rope_tables(positions, inv_freq)
    inputs = {"x": x, "positions": positions, "inv_freq": inv_freq, "cos": cos, "sin": sin}
    params = {"rot": rot, "theta": theta}
    y = Output("y", "rope", GROWTH["rope"], scale=_rms(x))  # a rotation's products cancel; |pair| is kept
    return Case("rope", dtype, inputs, params, (y,), seed)


def _rope_ref(c: Case):
    i = c.inputs
    return apply_rope(_f64(i["x"]), _f64(i["cos"]), _f64(i["sin"]))


# ------------------------------------------------------------------------------------------------ SDPA

MASK_FLOORS = ("finfo", "-inf", -50.0, -1000.0)  # finfo: finfo(dtype).min, transformers' eager value


def make_sdpa_case(seed, *, dtype="float16", B=1, Hkv=1, n_rep=1, Lq=4, Lk=4, D=16, Dv=16, window=None,
                   padding=False, floor="finfo", magnitude=1.0) -> Case:
    """o = softmax(q k^T * D^-1/2 + M) v with GQA, queries at key positions offset + i, offset = Lk - Lq.

    inputs: q [B, Hkv*n_rep, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] (dtype); key_valid [B, Lk] int64 (left
    padding: 0 on pads) or None; mask [B|1, 1, Lq, Lk] additive in dtype: 0 where query i may see key j
    (j <= offset + i, j > offset + i - window, key_valid), else the floor: finfo(dtype).min, -inf, -50 or -1000.
    params: offset, window, scale, floor. A kernel may add `mask` or build its own from offset / window /
    key_valid. Reference: refimpl's sdpa in float64 on these inputs and this mask. Output: o [B, Hq, Lq, Dv];
    queries that see no key (left-pad rows) are not compared.
    Both growths get + 2 max|s| over the visible scaled scores s: rounding s moves each probability by a
    relative 2 u |s| (the product and the scale multiply each round once).
    """
    rng = np.random.default_rng(seed)
    dtype = dtype_of(dtype)
    q = _cast(magnitude * rng.standard_normal((B, Hkv * n_rep, Lq, D)), dtype)
    k = _cast(magnitude * rng.standard_normal((B, Hkv, Lk, D)), dtype)
    v = _cast(rng.standard_normal((B, Hkv, Lk, Dv)), dtype)
    key_valid = None
    if padding:
        key_valid = np.ones((B, Lk), np.int64)
        for b in range(B):
            key_valid[b, :rng.integers(0, Lk)] = 0  # left padding; the last key is always real
    allowed = causal_mask(Lq, Lk, sliding_window=window, key_valid=key_valid, dtype=np.float64) == 0
    fill = {"finfo": float(ml_dtypes.finfo(dtype).min), "-inf": -math.inf}.get(floor, floor)
    mask = _cast(np.where(allowed, 0.0, fill), dtype)
    scale = D ** -0.5
    s = np.einsum("bhqd,bhkd->bhqk", _f64(q), np.repeat(_f64(k), n_rep, axis=1)) * scale
    max_s = float(np.max(np.abs(np.where(allowed, s, 0.0))))
    sees = np.broadcast_to(allowed.any(-1, keepdims=True), (B, Hkv * n_rep, Lq, 1))
    valid = np.broadcast_to(sees, (B, Hkv * n_rep, Lq, Dv))
    inputs = {"q": q, "k": k, "v": v, "mask": mask, "key_valid": key_valid}
    params = {"offset": Lk - Lq, "window": window, "scale": scale, "floor": floor}
    G, F = GROWTH["sdpa"]
    o = Output("o", "sdpa", (G + 2 * max_s, F + 2 * max_s), valid, scale=_rms(v))  # o averages rows of v
    return Case("sdpa", dtype, inputs, params, (o,), seed)


def _sdpa_ref(c: Case):
    i = c.inputs
    return sdpa(_f64(i["q"]), _f64(i["k"]), _f64(i["v"]), _f64(i["mask"]), scale=c.params["scale"])


# ------------------------------------------------------------------------------------------------ RMSNorm

def make_rms_norm_case(seed, *, dtype="float16", shape=(2, 16), variant="plain", eps=1e-6, magnitude=1.0) -> Case:
    """RMSNorm over the last axis: variant "plain" (Qwen3: w * nu(x)), "zero_centered" (Qwen3-Next / 3.5:
    nu(x) * (1 + w)) or "gated" (the GDN output norm: w * nu(x) * silu(gate)); nu(x) = x / sqrt(mean(x^2) + eps).

    inputs: x [..., n], weight [n] (plain / gated: around 1; zero-centred: around 0), gate [..., n] (gated only),
    all in dtype. params: eps, variant. Output: y [..., n].
    """
    rng = np.random.default_rng(seed)
    dtype = dtype_of(dtype)
    shape = tuple(shape)
    x = _cast(magnitude * rng.standard_normal(shape), dtype)
    w0 = 0.0 if variant == "zero_centered" else 1.0
    weight = _cast(w0 + 0.3 * rng.standard_normal(shape[-1]), dtype)
    gate = _cast(2 * rng.standard_normal(shape), dtype) if variant == "gated" else None
    if variant not in ("plain", "zero_centered", "gated"):
        raise ValueError(f"make_rms_norm_case: variant must be plain, zero_centered or gated; got {variant!r}")
    op = "rms_norm_gated" if variant == "gated" else "rms_norm"
    inputs = {"x": x, "weight": weight, "gate": gate}
    return Case("rms_norm", dtype, inputs, {"eps": eps, "variant": variant}, (Output("y", op, GROWTH[op]),), seed)


def _rms_norm_ref(c: Case):
    i, p = c.inputs, c.params
    if p["variant"] == "gated":
        return rms_norm_gated(_f64(i["x"]), _f64(i["gate"]), _f64(i["weight"]), p["eps"])
    return rms_norm(_f64(i["x"]), _f64(i["weight"]), p["eps"], zero_centered=p["variant"] == "zero_centered")


# ------------------------------------------------------------------------------------------------ gated delta rule

def make_gated_delta_case(seed, *, dtype="float16", B=1, T=16, Hk=1, r=1, Dk=16, Dv=16, g_norm=1.0, zero_gate=0.0,
                          spikes=0.0, spike_value=-20.0, beta_edges=0.0, initial_state=True, use_qk_l2norm=True,
                          chunk_size=64, magnitude=1.0) -> Case:
    """The gated delta rule (gated_deltanet.md §1.3): S <- exp(g) S; u = beta (v - S^T k); S <- S + k u^T;
    o = S^T q * Dk^-1/2, with l2-normalised q, k and value head h reading key head h // r.

    inputs: q, k [B, T, Hk, Dk], v [B, T, r*Hk, Dv] (dtype, N(0, 1) * magnitude for v); g, beta [B, T, Hv] and
    initial_state [B, Hv, Dk, Dv] (float32: the spec keeps gates and state in fp32; §7.8) or None.
    Gates as fla draws them, g = logsigmoid(U[0, 1)) / g_norm, then a share `zero_gate` set to exactly 0 (gate 1,
    §7.6) and a share `spikes` set to spike_value (very negative); beta = sigmoid(N(0, 1)) with a share
    `beta_edges` set to exactly 0 or 1. use_qk_l2norm: True, the kernel normalises q and k (eps 1e-6 on the sum
    of squares); False, the inputs are already l2-normalised (then rounded to dtype) and the kernel must not.
    params: scale, use_qk_l2norm, chunk_size (a hint for chunked kernels; the reference is the recurrent form).
    Outputs: o [B, T, Hv, Dv] and the final state [B, Hv, Dk, Dv].
    """
    rng = np.random.default_rng(seed)
    dtype = dtype_of(dtype)
    Hv = Hk * r
    q, k = rng.standard_normal((2, B, T, Hk, Dk))
    if not use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    v = magnitude * rng.standard_normal((B, T, Hv, Dv))
    g = -np.log1p(np.exp(-rng.uniform(0, 1, (B, T, Hv)))) / g_norm
    g = np.where(rng.uniform(size=g.shape) < zero_gate, 0.0, g)
    g = np.where(rng.uniform(size=g.shape) < spikes, spike_value, g)
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, Hv))))
    edge = rng.uniform(size=beta.shape) < beta_edges
    beta = np.where(edge, rng.integers(0, 2, beta.shape).astype(np.float64), beta)
    S0 = (magnitude * rng.standard_normal((B, Hv, Dk, Dv))).astype(np.float32) if initial_state else None
    inputs = {"q": _cast(q, dtype), "k": _cast(k, dtype), "v": _cast(v, dtype), "g": g.astype(np.float32),
              "beta": beta.astype(np.float32), "initial_state": S0}
    params = {"scale": Dk ** -0.5, "use_qk_l2norm": use_qk_l2norm, "chunk_size": chunk_size}
    G, F = GROWTH["gated_delta"]
    # a chunked fp32 kernel forms exp(G_r - G_i) from within-chunk cumulative decays G of magnitude up to |G|max,
    # which costs ~u |G| (spikes of -1e3 make it large: gated_deltanet.md §7.4); chunks of 64, the largest in use
    growth = (G, F + 4 * _max_chunk_decay(g, 64))  # 4: exp(G), exp(G_C - G) and Gamma each carry u |G|
    # o_t = S_t^T q_t sums Dk terms of size |S| |q|, with ||q|| = 1 and state columns of norm ~ |v| (what the delta
    # rule writes) plus the initial state's: that is o's error scale, even when q and k are near orthogonal
    s0_col = 0.0 if S0 is None else _rms(S0) * math.sqrt(Dk)
    o_scale = Dk ** -0.5 * (_rms(inputs["v"]) + s0_col)
    return Case("gated_delta", dtype, inputs, params, (Output("o", "gated_delta", growth, scale=o_scale),
                                                       Output("final_state", "gated_delta", growth)), seed)


def _max_chunk_decay(g, C) -> float:
    """max |cumsum(g)| within chunks of C tokens.  g [B, T, H]"""
    B, T, H = g.shape
    pad = np.concatenate([g, np.zeros((B, (-T) % C, H))], axis=1).reshape(B, -1, C, H)
    return float(np.max(np.abs(np.cumsum(pad, axis=2)), initial=0.0))


def _gated_delta_ref(c: Case):
    i, p = c.inputs, c.params
    return gated_delta_recurrent(_f64(i["q"]), _f64(i["k"]), _f64(i["v"]), _f64(i["g"]), _f64(i["beta"]),
                                 _f64(i["initial_state"]), use_qk_l2norm=p["use_qk_l2norm"], scale=p["scale"])


# ------------------------------------------------------------------------------------------------ causal conv1d

def make_conv1d_case(seed, *, dtype="float16", B=1, C=8, T=5, Kc=4, state=True, state_len=None,
                     magnitude=1.0) -> Case:
    """Causal depthwise conv1d + SiLU with a carried state (gated_deltanet.md §5):
    y[c, t] = silu(sum_j w[c, j] X[c, t + j]), X = concat(last Kc-1 state columns, x); new state = the last
    state_len columns of concat(state, x), raw inputs.

    inputs: x [B, C, T], weight [C, Kc], state [B, C, S] or None (zeros), all in dtype; S = state_len, default Kc
    (transformers; Kc - 1 is causal-conv1d's). Outputs: y [B, C, T], and the new state [B, C, S], which holds
    raw inputs and must match bit for bit (growth 0).
    """
    rng = np.random.default_rng(seed)
    dtype = dtype_of(dtype)
    S = Kc if state_len is None else state_len
    x = _cast(magnitude * rng.standard_normal((B, C, T)), dtype)
    w = _cast(rng.standard_normal((C, Kc)) / math.sqrt(Kc), dtype)
    s0 = _cast(magnitude * rng.standard_normal((B, C, S)), dtype) if state else None
    inputs = {"x": x, "weight": w, "state": s0}
    # the taps' magnitudes sum_j |w_j X_j|: the pre-activation sum can cancel to ~0
    terms, _ = causal_conv1d(np.abs(_f64(x)), np.abs(_f64(w)), None if s0 is None else np.abs(_f64(s0)),
                             activation=None, state_len=S)
    outputs = (Output("y", "conv1d", GROWTH["conv1d"], scale=_rms(terms)), Output("state", "exact", GROWTH["exact"]))
    return Case("conv1d", dtype, inputs, {"state_len": S, "activation": "silu"}, outputs, seed)


def _conv1d_ref(c: Case):
    i = c.inputs
    return causal_conv1d(_f64(i["x"]), _f64(i["weight"]), _f64(i["state"]), state_len=c.params["state_len"])


# ------------------------------------------------------------------------------------------------ MoE routing

def make_moe_routing_case(seed, *, dtype="float16", N=4, E=8, top_k=2, norm_topk_prob=True, ties=False,
                          logit_scale=1.0) -> Case:
    """Router: p = softmax(logits) over E experts; the top_k experts by p; weights p[chosen], divided by their sum
    if norm_topk_prob.

    inputs: logits [N, E] (dtype; with ties, small integers so that equal probabilities are common).
    params: top_k, norm_topk_prob. Outputs: weights [N, top_k] and experts [N, top_k] (int). Exact ties may be
    broken either way and the experts may come in any order: see check_routing.
    """
    rng = np.random.default_rng(seed)
    dtype = dtype_of(dtype)
    logits = rng.integers(-2, 3, (N, E)).astype(np.float64) if ties else logit_scale * rng.standard_normal((N, E))
    return Case("moe_routing", dtype, {"logits": _cast(logits, dtype)}, {"top_k": top_k, "norm_topk_prob":
                norm_topk_prob}, (Output("weights", "moe_routing", GROWTH["moe_routing"]),
                                  Output("experts", "exact", GROWTH["exact"])), seed)


def _moe_ref(c: Case):
    _, weights, experts = route(_f64(c.inputs["logits"]), c.params["top_k"], c.params["norm_topk_prob"])
    return weights, experts


def check_routing(case: Case, weights, experts, **overrides) -> dict:
    """Judge a router's (weights [N, k], experts [N, k]) against the reference probabilities p (float64).

    Order-free and tie-aware: each row's experts must be k distinct ids forming a top-k set of p (every chosen
    p >= every unchosen p, up to the probability tolerance, so exact and near ties may go either way), and the
    weights must equal p at the chosen experts (renormalised over them if norm_topk_prob) within the
    "moe_routing" tolerance.
    """
    weights, experts = np.asarray(weights), np.asarray(experts)
    N, E = case.inputs["logits"].shape
    k = case.params["top_k"]
    if weights.shape != (N, k) or experts.shape != (N, k):
        raise AssertionError(f"moe_routing: expected weights and experts of shape {(N, k)}; got {weights.shape}, "
                             f"{experts.shape}")
    probs, _, _ = route(_f64(case.inputs["logits"]), E, False)
    # the choice may differ from the exact one only between probabilities equal to within the device dtype's
    # rounding of a probability (2 units of roundoff, relative): a wider slack would accept the (k+1)-th expert
    tol = 2 * unit_roundoff(case.dtype)
    for n in range(N):
        chosen = experts[n].astype(np.int64)
        if len(set(chosen.tolist())) != k or chosen.min() < 0 or chosen.max() >= E:
            raise AssertionError(f"moe_routing row {n}: experts {chosen.tolist()} are not {k} distinct ids in "
                                 f"[0, {E}) ({case.describe()})")
        rest = np.setdiff1d(np.arange(E), chosen)
        if rest.size and probs[n, chosen].min() < probs[n, rest].max() * (1 - tol):
            lo, hi = chosen[np.argmin(probs[n, chosen])], rest[np.argmax(probs[n, rest])]
            raise AssertionError(f"moe_routing row {n}: experts {chosen.tolist()} are not a top-{k} set: expert {lo} "
                                 f"(p {probs[n, lo]:.6g}) chosen over expert {hi} (p {probs[n, hi]:.6g}) "
                                 f"({case.describe()})")
    expected = np.take_along_axis(probs, experts.astype(np.int64), axis=1)
    if case.params["norm_topk_prob"]:
        expected = expected / expected.sum(axis=1, keepdims=True)
    r = compare(weights, expected, dtype=case.dtype, op="moe_routing", **overrides)
    if not r["passed"]:
        raise AssertionError(f"moe_routing output 'weights' ({case.describe()}):\n{r['message']}")
    return r


_REFERENCES = {"rope": _rope_ref, "sdpa": _sdpa_ref, "rms_norm": _rms_norm_ref, "gated_delta": _gated_delta_ref,
               "conv1d": _conv1d_ref, "moe_routing": _moe_ref}
