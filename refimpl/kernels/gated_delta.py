"""The gated delta rule (the Gated DeltaNet core): recurrent, chunked (UT / WY transform) and single-step forms.

Normative maths: spec/gated_deltanet.md §1.3 (recurrence), §3.2 (chunked form), §4 (decode). Symbols:

    B batch, T tokens, Hk key heads, Hv value heads (r = Hv / Hk), Dk key dim, Dv value dim, C chunk size
    q, k [B, T, Hk, Dk]   v [B, T, Hv, Dv]   g, beta [B, T, Hv]   S [B, Hv, Dk, Dv] (keys on rows, "b,hv,dk,dv")

One step, in this order (decay first, error against the decayed state, read after the write):

    S   <- exp(g_t) S
    u_t  = beta_t (v_t - S^T k_t)
    S   <- S + k_t u_t^T
    o_t  = S^T q_t                    (q_t l2-normalised, then scaled by Dk^-1/2)

Casts (transformers 5.23.0): value head h reads key head h // r (repeat_interleave); q, k, v, g, beta and S0 are
cast to the compute dtype (float32, or float64 when an input is float64: the oracle mode); l2norm and the scale are
applied in that dtype; o is cast back to q's dtype; the state stays in the compute dtype. Inside, arrays are
head-major, [B, Hv, T, D], as in transformers.
"""

import functools
import math

import numpy as np

from refimpl.errors import InputError

from . import elementary, products
from .activation import unhooked
from .elementary import exp
from .products import matmul


def l2_normalize(x: np.ndarray, eps: float = 1e-6, at=unhooked) -> np.ndarray:
    """l2norm(x) = x * 1/sqrt(sum_i x_i^2 + eps) over the last axis.  [..., D] -> [..., D], in x's dtype.

    eps is added to the SUM of squares inside the root (transformers' l2norm, fla's l2norm to rounding); it is
    not rms_norm_eps, and this is not F.normalize's x / max(||x||, eps). A zero vector maps to 0.
    Points (`at`): x^2 (formed only where a hook acts on it), sum, eps, +eps, sqrt, 1/sqrt (or x / sqrt where the
    device divides: its form of the output point "").
    """
    if "x^2" in at.points:
        total = at("sum", products.sum(at("x^2", x * x), keepdims=True))             # sum_i x_i^2
    else:
        total = at("sum", products.sumprod(x, x, keepdims=True))                     # one correctly rounded sum
    root = at("sqrt", np.sqrt(at("+eps", total + at("eps", x.dtype.type(eps)))))   # sqrt(sum + eps)
    if at.forms.get("") == "Div":                                                # the device's form: x / sqrt
        return x / root
    return x * at("1/sqrt", 1 / root)


def _prepare(q, k, v, g, beta, initial_state, use_qk_l2norm):
    """Check shapes, cast, go head-major, l2-normalise q and k, GVA-repeat them.

    Returns q, k [B, Hv, T, Dk], v [B, Hv, T, Dv], g, beta [B, Hv, T] and S0 [B, Hv, Dk, Dv] (a fresh array),
    all in the compute dtype.
    """
    if q.ndim != 4 or q.shape != k.shape or v.ndim != 4 or v.shape[:2] != k.shape[:2]:
        raise InputError(f"gated delta rule: q, k must be [B, T, Hk, Dk] and v [B, T, Hv, Dv]; got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    if Hv % Hk:
        raise InputError(f"gated delta rule: value heads Hv={Hv} must be a multiple of key heads Hk={Hk}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, Hv):
            raise InputError(f"gated delta rule: {name} must be [B, T, Hv] = {(B, T, Hv)}; got {x.shape}")
    if initial_state is not None and initial_state.shape != (B, Hv, Dk, Dv):
        raise InputError(f"gated delta rule: initial_state must be [B, Hv, Dk, Dv] = {(B, Hv, Dk, Dv)}; "
                         f"got {initial_state.shape}")
    dt = np.result_type(np.float32, q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)

    q, k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3), dtype=dt) for x in (q, k, v))  # [B, H, T, D]
    g, beta = (np.ascontiguousarray(x.transpose(0, 2, 1), dtype=dt) for x in (g, beta))  # [B, Hv, T]
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    r = Hv // Hk  # GVA: value head h reads key head h // r (repeat_interleave; the l2norm commutes with it)
    q, k = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)  # [B, Hv, T, Dk]
    S = np.zeros((B, Hv, Dk, Dv), dt) if initial_state is None else initial_state.astype(dt, copy=True)
    return q, k, v, g, beta, S


def _vecmat(x: np.ndarray, S: np.ndarray) -> np.ndarray:
    """S^T x for a stack of vectors.  x [..., Dk], S [..., Dk, Dv] -> [..., Dv]"""
    return matmul(x[..., None, :], S)[..., 0, :]


def gated_delta_recurrent(q, k, v, g, beta, initial_state=None, *, use_qk_l2norm=True, scale=None, at=unhooked):
    """The gated delta rule one token at a time (spec §1.3): the normative reference.

    q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; initial_state [B, Hv, Dk, Dv] or None (zeros).
    Returns o [B, T, Hv, Dv] in q's dtype and the final state [B, Hv, Dk, Dv] in the compute dtype.

    scale=None divides q by sqrt(Dk), as transformers' torch_recurrent_gated_delta_rule does (its chunked form
    multiplies by Dk^-1/2 instead; the two differ by an ulp). A given scale multiplies q.
    at: a device graph's quantisers inside the rule (`recurrent_points`); where a hook acts, the rule is computed op
    by op as the exported graph writes it.
    """
    if at.points:
        return _recurrent_points(q, k, v, g, beta, initial_state, use_qk_l2norm, at)
    out_dtype = q.dtype
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, initial_state, use_qk_l2norm)
    B, Hv, T, Dk = k.shape
    q = q / q.dtype.type(math.sqrt(Dk)) if scale is None else q * q.dtype.type(scale)
    o = np.empty_like(v)  # [B, Hv, T, Dv]
    for t in range(T):
        S *= exp(g[:, :, t, None, None])  # S <- exp(g_t) S
        u = beta[:, :, t, None] * (v[:, :, t] - _vecmat(k[:, :, t], S))  # u = beta_t (v_t - S^T k_t)
        S += k[:, :, t, :, None] * u[:, :, None, :]  # S <- S + k_t u_t^T
        o[:, :, t] = _vecmat(q[:, :, t], S)  # o_t = S^T q_t
    return o.transpose(0, 2, 1, 3).astype(out_dtype, order="C"), S


def _recurrent_points(q, k, v, g, beta, initial_state, use_qk_l2norm, at):
    """gated_delta_recurrent op by op as transformers' torch_recurrent_gated_delta_rule exports to ONNX (one
    unrolled step per token), each op's value through the hook at its point (point "name@t": token t's instance;
    "state" the initial state as the graph reads it, "sqrt(Dk)" the divisor as a constant of the graph). The
    products S * k_t and S * q_t are formed and summed over Dk (ReduceSum), as the export writes S^T k_t."""
    out_dtype = q.dtype
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, initial_state, use_qk_l2norm)
    B, Hv, T, Dk = k.shape
    S = at("state", S) if initial_state is not None else S                       # S0 (zeros: exact on any grid)
    at.operand("q", q)                                  # q as the Div reads it: head-major, GVA-repeated (same codes)
    q = at("q/sqrt(Dk)", q / at("sqrt(Dk)", q.dtype.type(math.sqrt(Dk))))       # q / sqrt(Dk)
    o = np.empty_like(v)                                                         # [B, Hv, T, Dv]

    def step(point: str, op, *operands):
        """op(*operands) at a per-token point, its operands told to the hook first (token t's slices as the op
        broadcasts them: a device computes that op on their codes, Unhooked.operands), its value through the hook."""
        at.operands(point, *operands)
        return at(point, op(*operands))

    sum_dk = functools.partial(products.sum, axis=-2)                            # sum over D_k (ReduceSum)
    for t in range(T):
        k_t, q_t = k[:, :, t, :, None], q[:, :, t, :, None]                      # k_t, q_t  [B, Hv, Dk, 1]
        decay = step(f"exp(g)@{t}", exp, g[:, :, t])                              # exp(g_t)  [B, Hv]
        S = step(f"decayed@{t}", np.multiply, S, decay[:, :, None, None])         # S <- exp(g_t) S
        Sk = step(f"S*k@{t}", np.multiply, S, k_t)                                # S_ij k_i
        kv = step(f"S^T k@{t}", sum_dk, Sk)                                       # S^T k_t  [B, Hv, Dv]
        err = step(f"v-S^T k@{t}", np.subtract, v[:, :, t], kv)                   # v_t - S^T k_t
        delta = step(f"delta@{t}", np.multiply, err, beta[:, :, t, None])         # delta_t = beta_t (v_t - S^T k_t)
        update = step(f"k delta^T@{t}", np.multiply, k_t, delta[:, :, None, :])  # k_t delta_t^T
        S = step(f"S@{t}", np.add, S, update)                                     # S <- S + k_t delta_t^T
        Sq = step(f"S*q@{t}", np.multiply, S, q_t)                                # S_ij q_i
        o[:, :, t] = step(f"o@{t}", sum_dk, Sq)                                   # o_t = S^T q_t
    return o.transpose(0, 2, 1, 3).astype(out_dtype, order="C"), S


def _wide_sum(x: np.ndarray, rnd, axis: int) -> np.ndarray:
    """A sum as an fp16 NPU reduces: accumulated wide (float64 here, exact for fp16 terms), rounded once by rnd."""
    return rnd(np.sum(x.astype(np.float64), axis=axis)).astype(x.dtype)


def l2_normalize_rounded(x: np.ndarray, rnd, eps: float = 1e-6) -> np.ndarray:
    """transformers' l2norm with every op rounded by rnd (an NPU running it in fp16), the sum accumulated wide.
    [..., D] -> [..., D]"""
    ss = rnd(_wide_sum(rnd(x * x), rnd, -1)[..., None] + x.dtype.type(eps))    # sum_i x_i^2 + eps
    return rnd(x * rnd(1 / rnd(np.sqrt(ss))))                                  # x * 1 / sqrt(.)


def gated_delta_rounded(q, k, v, g, beta, initial_state, rnd):
    """The delta rule as an fp16 NPU runs transformers' recurrent form (precision htp-fp16, docs/htp.md): token by
    token, every elementwise op rounded by rnd, every sum (S^T k, S^T q) accumulated wide and rounded once, the state
    held rounded. q, k come l2-normalised (l2_normalize_rounded). Shapes and results as gated_delta_recurrent."""
    out_dtype = q.dtype
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, initial_state, False)
    B, Hv, T, Dk = k.shape
    q = rnd(q / q.dtype.type(math.sqrt(Dk)))                                    # q / sqrt(Dk)
    S = rnd(S)
    o = np.empty_like(v)  # [B, Hv, T, Dv]
    for t in range(T):
        S = rnd(S * rnd(exp(g[:, :, t, None, None])))                          # S <- exp(g_t) S
        kv = _wide_sum(rnd(S * k[:, :, t, :, None]), rnd, -2)                  # S^T k_t   [B, Hv, Dv]
        u = rnd(rnd(v[:, :, t] - kv) * beta[:, :, t, None])                    # u = beta_t (v_t - S^T k_t)
        S = rnd(S + rnd(k[:, :, t, :, None] * u[:, :, None, :]))              # S <- S + k_t u_t^T
        o[:, :, t] = _wide_sum(rnd(S * q[:, :, t, :, None]), rnd, -2)          # o_t = S^T q_t
    return o.transpose(0, 2, 1, 3).astype(out_dtype, order="C"), S


def _wide_matmul(a: np.ndarray, b: np.ndarray, rnd) -> np.ndarray:
    """a @ b as an fp16 NPU multiplies: each dot product accumulated wide (float64 here), rounded once by rnd."""
    return rnd(np.matmul(a.astype(np.float64), b.astype(np.float64))).astype(a.dtype)


def _band_inverse_rounded(A: np.ndarray, rnd, order: int = 4) -> np.ndarray:
    """(I - A)^-1 for a strictly lower-triangular A [..., C, C] (C <= 64), as AI Hub's graph solves it
    (qai-hub-models 0.65.0, qwen3_5 `_solve_triangular`): a Taylor seed of `order` powers masked to the band of
    `order` sub-diagonals, refined by four product-form Newton-Schulz squarings; every op rounded by rnd."""
    C = A.shape[-1]
    eye = np.eye(C, dtype=A.dtype)
    band = np.triu(np.ones((C, C), A.dtype), -order)                            # j >= i - order
    M = eye - A                                                                 # I - A
    acc, power = eye + A, A                                                     # I + A
    for _ in range(2, order + 1):
        power = _wide_matmul(power, A, rnd)                                     # A^p
        acc = rnd(acc + power)                                                  # I + A + ... + A^p
    M0 = band * acc                                                             # the seed, exact inside the band
    E = [rnd(eye - _wide_matmul(M, M0, rnd))]                                   # E0 = I - (I - A) M0
    for _ in range(3):
        E.append(_wide_matmul(E[-1], E[-1], rnd))                               # E_{n+1} = E_n^2
    X = M0
    for En in E:
        X = _wide_matmul(X, rnd(eye + En), rnd)                                 # M0 (I + E0)(I + E1)(I + E2)(I + E3)
    return X


def gated_delta_chunked_rounded(q, k, v, g, beta, initial_state, rnd, chunk_size: int = 64):
    """The delta rule as an fp16 NPU runs AI Hub's chunked graph code (qai-hub-models 0.65.0, qwen3_5
    `gated_delta_rule`: chunks of min(T, chunk_size) tokens, the triangular inverse by `_band_inverse_rounded`),
    every elementwise op rounded by rnd, every matmul accumulated wide and rounded once, the state held rounded.
    q, k come l2-normalised. Same real function as gated_delta_recurrent; shapes and results as it."""
    out_dtype = q.dtype
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, initial_state, False)
    B, Hv, T, Dk = k.shape
    C = min(T, chunk_size)
    q = rnd(q * rnd(q.dtype.type(Dk ** -0.5)))                                 # q Dk^-1/2
    v_beta, k_beta = rnd(v * beta[..., None]), rnd(k * beta[..., None])        # beta V, beta K
    q, k, v_beta, k_beta, g = (_to_chunks(x, C) for x in (q, k, v_beta, k_beta, g))   # [B, Hv, N, C, .]
    tril = np.tril(np.ones((C, C), q.dtype))                                    # i <= r
    strict = tril - np.eye(C, dtype=q.dtype)                                    # i < r
    G = _wide_matmul(tril, g[..., None], rnd)[..., 0]                           # G_r = sum_{i<=r} g_i  [B, Hv, N, C]
    decay = rnd(exp(rnd(G[..., :, None] - G[..., None, :]) * tril)) * tril     # Gamma[r, i] = exp(G_r - G_i), i <= r
    kT = k.swapaxes(-1, -2)                                                     # [B, Hv, N, Dk, C]
    A = -rnd(_wide_matmul(k_beta, kT, rnd) * decay) * strict                   # -strict_lower((beta K) K^T * Gamma)
    T_ut = _band_inverse_rounded(A, rnd)                                        # (I + A_ut)^-1
    U_tilde = _wide_matmul(T_ut, v_beta, rnd)                                   # U~ = T_ut (beta V)
    eG = rnd(exp(G))                                                            # exp(G)  [B, Hv, N, C]
    W = _wide_matmul(T_ut, rnd(k_beta * eG[..., None]), rnd)                    # W = T_ut (beta exp(G) K)
    S = rnd(S)
    o = np.empty((*v_beta.shape[:4], v.shape[-1]), S.dtype)                     # [B, Hv, N, C, Dv]
    for j in range(g.shape[2]):
        A_qk = rnd(_wide_matmul(q[:, :, j], kT[:, :, j], rnd) * decay[:, :, j]) * tril      # (Q K^T) * Gamma
        U = rnd(U_tilde[:, :, j] - _wide_matmul(W[:, :, j], S, rnd))                       # U = U~ - W S
        o[:, :, j] = rnd(_wide_matmul(rnd(q[:, :, j] * eG[:, :, j, :, None]), S, rnd)     # O = exp(G) Q S
                         + _wide_matmul(A_qk, U, rnd))                                     #     + A_qk U
        Gc = G[:, :, j, -1:]                                                                # G_C  [B, Hv, 1]
        k_dec = rnd(k[:, :, j] * rnd(exp(rnd(Gc - G[:, :, j])))[..., None])               # exp(G_C - G) K
        S = rnd(rnd(S * rnd(exp(Gc))[..., None]) + _wide_matmul(k_dec.swapaxes(-1, -2), U, rnd))  # S <- exp(G_C) S + .
    o = o.reshape(B, Hv, -1, o.shape[-1])[:, :, :T]                             # drop the padding
    return o.transpose(0, 2, 1, 3).astype(out_dtype, order="C"), S


def gated_delta_step(q, k, v, g, beta, state, *, use_qk_l2norm=True, scale=None, at=unhooked):
    """One decode step (spec §4): the recurrent form with T = 1, from a cached state.

    q, k [B, 1, Hk, Dk]; v [B, 1, Hv, Dv]; g, beta [B, 1, Hv]; state [B, Hv, Dk, Dv] (None means zeros).
    Returns o [B, 1, Hv, Dv] in q's dtype and the new state [B, Hv, Dk, Dv]; the input state is not modified.
    This is exactly what transformers runs for a cached single-token call (torch_recurrent_gated_delta_rule).
    """
    if q.ndim != 4 or q.shape[1] != 1:
        raise InputError(f"gated_delta_step: expected one token, q [B, 1, Hk, Dk]; got q {q.shape}")
    return gated_delta_recurrent(q, k, v, g, beta, state, use_qk_l2norm=use_qk_l2norm, scale=scale, at=at)


def _unit_lower_inverse(L: np.ndarray) -> np.ndarray:
    """(I + L)^-1 for a strictly lower-triangular L, by forward substitution (spec §3.3).  [..., C, C] -> same.

    With T = I - L, row by row in increasing order (rows < i are final):  T[i, :i] <- T[i, :i] @ T[:i, :i],
    i.e. T[i, j] = -L[i, j] - sum_{j<m<i} L[i, m] T[m, j], each element one correctly rounded sum.
    transformers solves with solve_triangular instead (same maths, other rounding); numpy has no triangular solver,
    and this loop over rows, vectorised over [B, H, N], was 5x faster than np.linalg.solve's pivoted LU here.
    """
    C = L.shape[-1]
    T = np.eye(C, dtype=L.dtype) - L
    for i in range(2, C):
        T[..., i, :i] = matmul(T[..., i, None, :i], T[..., :i, :i])[..., 0, :]
    return T


def _to_chunks(x: np.ndarray, C: int) -> np.ndarray:
    """Split the time axis into chunks, zero-padding it to a multiple of C.  [B, H, T, ...] -> [B, H, N, C, ...]"""
    B, H, T = x.shape[:3]
    p = (C - T % C) % C
    if p:
        x = np.concatenate([x, np.zeros((B, H, p, *x.shape[3:]), x.dtype)], axis=2)
    return x.reshape(B, H, (T + p) // C, C, *x.shape[3:])


_CHUNKS_PER_BLOCK = 16  # chunks set up together: large enough for batched GEMMs, small enough to stay in cache


def _chunk_setup(q, k, v, g, beta):
    """Everything per chunk that does not depend on the state.  [B, Hv, n, C, .] ->
    U~ [.., C, Dv], W [.., C, Dk], exp(G) Q [.., C, Dk], A_qk [.., C, C], (exp(G_C - G) K)^T [.., Dk, C], exp(G_C)."""
    C = g.shape[-1]
    G = products.cumsum(g, axis=-1)  # [B, Hv, n, C]  within-chunk cumulative log decay
    causal = np.tril(np.ones((C, C), dtype=bool))  # i <= r
    Gamma = exp(np.where(causal, G[..., :, None] - G[..., None, :], -np.inf))  # [B, Hv, n, C, C]; -inf first
    kT = k.swapaxes(-1, -2)  # [B, Hv, n, Dk, C]
    A_ut = np.tril(matmul(beta[..., None] * k, kT) * Gamma, -1)  # [B, Hv, n, C, C]  strict lower
    A_qk = matmul(q, kT) * Gamma  # [B, Hv, n, C, C]
    T_ut = _unit_lower_inverse(A_ut)  # [B, Hv, n, C, C]
    U_tilde = matmul(T_ut, beta[..., None] * v)  # [B, Hv, n, C, Dv]
    W = matmul(T_ut, (beta * exp(G))[..., None] * k)  # [B, Hv, n, C, Dk]
    q_dec = exp(G)[..., None] * q  # [B, Hv, n, C, Dk]
    k_decT = (exp(G[..., -1:] - G)[..., None] * k).swapaxes(-1, -2)  # [B, Hv, n, Dk, C]
    lam = exp(G[..., -1])[..., None, None]  # [B, Hv, n, 1, 1]
    return U_tilde, W, q_dec, A_qk, k_decT, lam


def gated_delta_chunked(q, k, v, g, beta, initial_state=None, *, chunk_size=64, use_qk_l2norm=True, scale=None,
                        allow_neg_inf=False):
    """The gated delta rule in chunks of C tokens (UT / WY transform, spec §3.2 = transformers 5.23.0's
    torch_chunk_gated_delta_rule). Same maths as gated_delta_recurrent, different rounding.

    q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; initial_state [B, Hv, Dk, Dv] or None (zeros).
    Returns o [B, T, Hv, Dv] in q's dtype and the final state [B, Hv, Dk, Dv] in the compute dtype.

    Per chunk, with G = cumsum(g) restarting at each chunk and Gamma[r, i] = exp(G_r - G_i) for i <= r, else 0:
        A_ut = strict_lower((beta K) K^T * Gamma)        A_qk = (Q K^T) * Gamma   (diagonal included)
        T_ut = (I + A_ut)^-1                             U~ = T_ut (beta V),   W = T_ut (beta exp(G) K)
    then sequentially over chunks, from S = S0:
        U = U~ - W S        O = exp(G) Q S + A_qk U        S <- exp(G_C) S + (exp(G_C - G) K)^T U
    T is zero-padded to a multiple of C; padded rows have k = v = beta = g = 0 and are inert. scale=None
    multiplies q by Dk^-1/2 (transformers' chunked form). g = -inf is rejected: the chunked form turns it into
    NaN (spec §7.5); clamp it first, or use the recurrent form. allow_neg_inf: compute anyway (the NaN that
    transformers' chunked form computes: a model whose weights hold Inf runs on, as IEEE arithmetic says).
    """
    if not (isinstance(chunk_size, (int, np.integer)) and chunk_size >= 1):
        raise InputError(f"gated_delta_chunked: chunk_size must be a positive int; got {chunk_size!r}")
    if not allow_neg_inf and np.isneginf(g).any():
        raise InputError("gated_delta_chunked: g contains -inf, which makes every chunked output NaN "
                         "(gated_deltanet.md §7.5); clamp g to a finite floor or use gated_delta_recurrent")
    out_dtype = q.dtype
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, initial_state, use_qk_l2norm)
    B, Hv, T, Dk = k.shape
    Dv, C = v.shape[-1], chunk_size
    q = q * q.dtype.type(elementary.inverse_sqrt(Dk) if scale is None else scale)

    q, k, v, g, beta = (_to_chunks(x, C) for x in (q, k, v, g, beta))  # [B, Hv, N, C, .], zero-padded
    N = g.shape[2]
    o = np.empty((B, Hv, N, C, Dv), S.dtype)
    for start in range(0, N, _CHUNKS_PER_BLOCK):  # set up a block of chunks at once, then run them in order
        block = slice(start, start + _CHUNKS_PER_BLOCK)
        U_tilde, W, q_dec, A_qk, k_decT, lam = _chunk_setup(q[:, :, block], k[:, :, block], v[:, :, block],
                                                            g[:, :, block], beta[:, :, block])
        for j in range(U_tilde.shape[2]):
            U = U_tilde[:, :, j] - matmul(W[:, :, j], S)  # [B, Hv, C, Dv]  values written
            o[:, :, start + j] = matmul(q_dec[:, :, j], S) + matmul(A_qk[:, :, j], U)  # [B, Hv, C, Dv]
            S *= lam[:, :, j]  # S <- exp(G_C) S       (in place: S is our own copy)
            S += matmul(k_decT[:, :, j], U)  # S <- S + (exp(G_C - G) K)^T U
    o = o.reshape(B, Hv, N * C, Dv)[:, :, :T]  # drop the padding
    return o.transpose(0, 2, 1, 3).astype(out_dtype, order="C"), S


def gated_delta_rule(q, k, v, g, beta, initial_state=None, *, mode="chunked", chunk_size=64, use_qk_l2norm=True,
                     scale=None):
    """Dispatch to gated_delta_chunked (mode="chunked") or gated_delta_recurrent (mode="recurrent").

    transformers uses the recurrent form for a cached single-token call and the chunked form (C = 64) otherwise.
    """
    if mode == "chunked":
        return gated_delta_chunked(q, k, v, g, beta, initial_state, chunk_size=chunk_size,
                                   use_qk_l2norm=use_qk_l2norm, scale=scale)
    if mode == "recurrent":
        return gated_delta_recurrent(q, k, v, g, beta, initial_state, use_qk_l2norm=use_qk_l2norm, scale=scale)
    raise InputError(f"gated_delta_rule: mode must be 'chunked' or 'recurrent'; got {mode!r}")
