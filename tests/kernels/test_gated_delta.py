"""Gated delta rule: the invariants of gated_deltanet.md §9 (float64, <= 1e-10 unless bit-exact) and parity with
transformers' torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule (float32, oracle)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.errors import InputError
from refimpl.kernels.gated_delta import (
    gated_delta_chunked,
    gated_delta_recurrent,
    gated_delta_rule,
    gated_delta_step,
    l2_normalize,
)

TOL64 = 1e-10  # spec §9: fp64 chunked vs fp64 recurrent (observed ~5e-16)


def make_inputs(seed, B=2, T=37, Hk=2, r=2, Dk=16, Dv=12, *, g_norm=1.0, dtype=np.float64, state=True):
    """fla's test distribution (spec §9): q, k, v ~ N(0, 1); beta = sigmoid(N(0, 1)); g = logsigmoid(U[0, 1)) / norm;
    S0 ~ N(0, 1)."""
    rng = np.random.default_rng(seed)
    Hv = Hk * r
    q = rng.standard_normal((B, T, Hk, Dk))
    k = rng.standard_normal((B, T, Hk, Dk))
    v = rng.standard_normal((B, T, Hv, Dv))
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, Hv))))
    g = -np.log1p(np.exp(-rng.uniform(0, 1, (B, T, Hv)))) / g_norm
    S0 = rng.standard_normal((B, Hv, Dk, Dv)) if state else None
    cast = (lambda x: x if x is None else x.astype(dtype))
    return tuple(cast(x) for x in (q, k, v, g, beta, S0))


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0))


def rel_rmse(ref, x):
    """fla's error ratio (spec §10.1)."""
    ref, x = np.asarray(ref, np.float64), np.asarray(x, np.float64)
    return math.sqrt(np.mean((ref - x) ** 2)) / (math.sqrt(np.mean(ref**2)) + 1e-8)


def naive_closed_form(q, k, v, g, beta, S0, *, use_qk_l2norm=True, scale=None):
    """An independent per-(b, h) loop over the closed form S_t = exp(g_t)(I - beta_t k kᵀ) S_{t-1} + beta_t k vᵀ,
    o_t = S_tᵀ q̂_t (spec §1.3), with explicit matrices. Value head h reads key head h // r."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    r = Hv // Hk
    scale = Dk**-0.5 if scale is None else scale
    o = np.zeros((B, T, Hv, Dv))
    S_out = np.zeros((B, Hv, Dk, Dv))
    for b in range(B):
        for h in range(Hv):
            S = np.zeros((Dk, Dv)) if S0 is None else S0[b, h].astype(np.float64)
            for t in range(T):
                qt, kt = q[b, t, h // r].astype(np.float64), k[b, t, h // r].astype(np.float64)
                if use_qk_l2norm:
                    qt, kt = qt / np.sqrt(qt @ qt + 1e-6), kt / np.sqrt(kt @ kt + 1e-6)
                S = np.exp(g[b, t, h]) * (np.eye(Dk) - beta[b, t, h] * np.outer(kt, kt)) @ S \
                    + beta[b, t, h] * np.outer(kt, v[b, t, h])
                o[b, t, h] = S.T @ (scale * qt)
            S_out[b, h] = S
    return o, S_out


# ---------------------------------------------------------------- the recurrence itself


def test_recurrent_matches_independent_closed_form():
    q, k, v, g, beta, S0 = make_inputs(0, B=2, T=21, Hk=2, r=2, Dk=6, Dv=5)
    o, S = gated_delta_recurrent(q, k, v, g, beta, S0)
    o_ref, S_ref = naive_closed_form(q, k, v, g, beta, S0)
    assert max_err(o, o_ref) <= TOL64 and max_err(S, S_ref) <= TOL64


def test_error_before_decay_is_a_different_model():
    """P-order: the implementation must not agree with u = beta (v - S_{t-1}ᵀ k) taken before the decay."""
    q, k, v, g, beta, S0 = make_inputs(1, B=1, T=40, Hk=1, r=1, Dk=8, Dv=8)
    o, _ = gated_delta_recurrent(q, k, v, g, beta, S0)
    qn, kn = l2_normalize(q[0, :, 0]) * 8**-0.5, l2_normalize(k[0, :, 0])
    S, o_wrong = S0[0, 0].copy(), np.zeros((40, 8))
    for t in range(40):
        u = beta[0, t, 0] * (v[0, t, 0] - S.T @ kn[t])
        S = np.exp(g[0, t, 0]) * S + np.outer(kn[t], u)
        o_wrong[t] = S.T @ qn[t]
    assert rel_rmse(o_wrong, o[0, :, 0]) > 1e-3


def test_l2_normalize():
    x = np.array([[3.0, 4.0], [0.0, 0.0]])
    y = l2_normalize(x)
    assert max_err(y[0], np.array([3.0, 4.0]) / np.sqrt(25 + 1e-6)) <= 1e-15  # eps on the SUM of squares
    assert np.array_equal(y[1], [0.0, 0.0])  # a zero vector maps to 0
    assert l2_normalize(x.astype(np.float32)).dtype == np.float32


# ---------------------------------------------------------------- P1 chunked == recurrent


@pytest.mark.parametrize("C", [1, 2, 3, 16, 64])
@pytest.mark.parametrize("T", [1, 5, 16, 63, 64, 65, 130])
def test_p1_chunked_equals_recurrent(C, T):
    q, k, v, g, beta, S0 = make_inputs(T * 100 + C, B=2, T=T, Hk=2, r=2, Dk=16, Dv=12)
    o_c, S_c = gated_delta_chunked(q, k, v, g, beta, S0, chunk_size=C)
    o_r, S_r = gated_delta_recurrent(q, k, v, g, beta, S0)
    assert o_c.shape == o_r.shape == (2, T, 4, 12) and S_c.shape == (2, 4, 16, 12)
    assert max_err(o_c, o_r) <= TOL64 and max_err(S_c, S_r) <= TOL64


shapes = st.fixed_dictionaries({
    "B": st.sampled_from([1, 2]),
    "Hk": st.sampled_from([1, 2]),
    "r": st.sampled_from([1, 2, 4]),
    "Dk": st.sampled_from([4, 8, 16]),
    "Dv": st.sampled_from([3, 5, 12]),  # never equal to Dk: a transposed state would not fit
    "T": st.sampled_from([1, 5, 16, 63, 64, 65, 130]),
})


@settings(max_examples=25, deadline=None)
@given(s=shapes, C=st.sampled_from([1, 2, 3, 16, 64]), g_norm=st.sampled_from([0.1, 1.0, 10.0]),
       with_state=st.booleans(), seed=st.integers(0, 2**16))
def test_p1_chunked_equals_recurrent_drawn(s, C, g_norm, with_state, seed):
    q, k, v, g, beta, S0 = make_inputs(seed, **s, g_norm=g_norm, state=with_state)
    o_c, S_c = gated_delta_chunked(q, k, v, g, beta, S0, chunk_size=C)
    o_r, S_r = gated_delta_recurrent(q, k, v, g, beta, S0)
    assert max_err(o_c, o_r) <= TOL64 and max_err(S_c, S_r) <= TOL64


# ---------------------------------------------------------------- P2, P3: carrying the state


def check_split(T, t, C, seed):
    """Two calls, the first's final state carried into the second, equal one call: outputs and state."""
    q, k, v, g, beta, S0 = make_inputs(seed, T=T)
    a, b = slice(0, t), slice(t, T)
    for form in ("chunked", "recurrent"):
        o_full, S_full = gated_delta_rule(q, k, v, g, beta, S0, mode=form, chunk_size=C)
        o1, S1 = gated_delta_rule(q[:, a], k[:, a], v[:, a], g[:, a], beta[:, a], S0, mode=form, chunk_size=C)
        o2, S2 = gated_delta_rule(q[:, b], k[:, b], v[:, b], g[:, b], beta[:, b], S1, mode=form, chunk_size=C)
        assert max_err(np.concatenate([o1, o2], axis=1), o_full) <= TOL64
        assert max_err(S2, S_full) <= TOL64


@pytest.mark.parametrize("t", [1, 37, 64, 149])
def test_p2_split_and_carry_state_equals_one_call(t):
    check_split(150, t, 64, seed=t)


@settings(max_examples=15, deadline=None)
@given(T=st.integers(2, 150), data=st.data(), C=st.sampled_from([1, 3, 16, 64]), seed=st.integers(0, 2**16))
def test_p2_split_anywhere_drawn(T, data, C, seed):
    check_split(T, data.draw(st.integers(1, T - 1), label="split"), C, seed)


@pytest.mark.parametrize("T", [1, 2, 64, 65, 100])
def test_p3_chunked_prefill_then_step_equals_recurrent(T):
    q, k, v, g, beta, S0 = make_inputs(T, T=T)
    o_r, S_r = gated_delta_recurrent(q, k, v, g, beta, S0)
    p = slice(0, T - 1)
    _, S_p = gated_delta_chunked(q[:, p], k[:, p], v[:, p], g[:, p], beta[:, p], S0)
    s = slice(T - 1, T)
    o_s, S_s = gated_delta_step(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], S_p)
    assert o_s.shape == (2, 1, 4, 12)
    assert max_err(o_s, o_r[:, -1:]) <= TOL64 and max_err(S_s, S_r) <= TOL64


def test_step_does_not_modify_the_state_it_was_given():
    q, k, v, g, beta, S0 = make_inputs(3, T=1)
    S0_copy = S0.copy()
    gated_delta_step(q, k, v, g, beta, S0)
    gated_delta_chunked(q, k, v, g, beta, S0)
    assert np.array_equal(S0, S0_copy)


# ---------------------------------------------------------------- P4 inert tokens, P10 causality


@settings(max_examples=20, deadline=None)
@given(T=st.integers(1, 100), P=st.integers(1, 70), C=st.sampled_from([1, 3, 16, 64]),
       dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**16))
def test_p4_zero_tokens_are_bit_exact_no_ops(T, P, C, dtype, seed):
    q, k, v, g, beta, S0 = make_inputs(seed, T=T, dtype=dtype)
    zero = (lambda x: np.concatenate([x, np.zeros((x.shape[0], P, *x.shape[2:]), x.dtype)], axis=1))
    q_tail = np.random.default_rng(seed).standard_normal((q.shape[0], P, *q.shape[2:])).astype(dtype)
    q2 = np.concatenate([q, q_tail], axis=1)
    k2, v2, g2, beta2 = (zero(x) for x in (k, v, g, beta))  # k = v = beta = g = 0, q arbitrary; l2norm(0) = 0
    for form in ("chunked", "recurrent"):
        o, S = gated_delta_rule(q, k, v, g, beta, S0, mode=form, chunk_size=C)
        o2, S2 = gated_delta_rule(q2, k2, v2, g2, beta2, S0, mode=form, chunk_size=C)
        assert np.array_equal(S2, S) and np.array_equal(o2[:, :T], o)


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_p10_causality(form):
    T, t0 = 80, 30
    q, k, v, g, beta, S0 = make_inputs(4, T=T)
    q2, k2, v2, g2, beta2, _ = make_inputs(5, T=T)
    late = (lambda a, b: np.concatenate([a[:, :t0], b[:, t0:]], axis=1))
    o, _ = gated_delta_rule(q, k, v, g, beta, S0, mode=form)
    o2, _ = gated_delta_rule(late(q, q2), late(k, k2), late(v, v2), late(g, g2), late(beta, beta2), S0, mode=form)
    assert np.array_equal(o2[:, :t0], o[:, :t0])
    assert not np.allclose(o2[:, t0:], o[:, t0:])


# ---------------------------------------------------------------- P5-P9 closed forms and linearity


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_p5_beta_zero_only_decays(form):
    q, k, v, g, beta, S0 = make_inputs(6, T=70, Hk=2, r=2, Dk=16, Dv=12)
    beta = np.zeros_like(beta)
    o, S = gated_delta_rule(q, k, v, g, beta, S0, mode=form, chunk_size=16)
    G = np.cumsum(g, axis=1)  # [B, T, Hv] global cumulative log decay
    q_hat = np.repeat(l2_normalize(q), 2, axis=2) * 16**-0.5  # [B, T, Hv, Dk]
    o_ref = np.exp(G)[..., None] * np.einsum("btho,bhov->bthv", q_hat, S0)
    assert max_err(o, o_ref) <= TOL64
    assert max_err(S, np.exp(G[:, -1])[..., None, None] * S0) <= TOL64


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_p6_g_zero_is_plain_deltanet(form):
    q, k, v, g, beta, S0 = make_inputs(7, B=1, T=45, Hk=1, r=2, Dk=8, Dv=6)
    g = np.zeros_like(g)
    o, S = gated_delta_rule(q, k, v, g, beta, S0, mode=form, chunk_size=16)
    o_ref, S_ref = naive_closed_form(q, k, v, g, beta, S0)  # S_t = (I - beta k kᵀ) S_{t-1} + beta k vᵀ
    assert max_err(o, o_ref) <= TOL64 and max_err(S, S_ref) <= TOL64


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_p7_orthonormal_keys_are_gated_linear_attention(form):
    B, T, H, Dk, Dv = 1, 12, 1, 16, 5
    q, _, v, g, beta, _ = make_inputs(8, B=B, T=T, Hk=H, r=1, Dk=Dk, Dv=Dv)
    k = np.zeros((B, T, H, Dk))
    k[0, np.arange(T), 0, np.arange(T)] = 1.0  # k_t = e_t
    o, _ = gated_delta_rule(q, k, v, g, beta, None, mode=form, chunk_size=5, use_qk_l2norm=False)
    G = np.cumsum(g[0, :, 0])
    Gamma = np.tril(np.exp(G[:, None] - G[None, :]))
    o_ref = Dk**-0.5 * ((q[0, :, 0] @ k[0, :, 0].T) * Gamma) @ (beta[0, :, 0, None] * v[0, :, 0])
    assert max_err(o[0, :, 0], o_ref) <= TOL64


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_p8_beta_one_recalls_the_value_just_written(form):
    q, k, v, g, beta, S0 = make_inputs(9, T=20, Dk=16, Dv=12)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    beta = np.ones_like(beta)
    for t in (1, 7, 20):
        _, S = gated_delta_rule(q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t], S0, mode=form,
                                use_qk_l2norm=False)
        recalled = np.einsum("bhkv,bhk->bhv", S, np.repeat(k[:, t - 1], 2, axis=1))  # S_tᵀ k_t
        assert max_err(recalled, v[:, t - 1]) <= TOL64


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_p9_linearity(form):
    q, k, v, g, beta, S0 = make_inputs(10, T=70)
    q2 = make_inputs(11, T=70)[0]
    run = (lambda q_, v_, S_, l2=True: gated_delta_rule(q_, k, v_, g, beta, S_, mode=form, chunk_size=16,
                                                         use_qk_l2norm=l2))
    o, S = run(q, v, S0)
    o3, S3 = run(q, 3 * v, 3 * S0)  # jointly linear in (V, S0)
    assert max_err(o3, 3 * o) <= TOL64 and max_err(S3, 3 * S) <= TOL64
    oa, _ = run(q, v, S0, l2=False)  # linear in q (without the l2norm of q)
    ob, _ = run(q2, v, S0, l2=False)
    oab, _ = run(q + q2, v, S0, l2=False)
    assert max_err(oab, oa + ob) <= TOL64


# ---------------------------------------------------------------- heads, batch, GVA


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_gva_is_repeat_interleave_not_modulo(form):
    Hk, r = 2, 3  # transformers' upstream test shape: Hk = 2, Hv = 6
    q, k, v, g, beta, S0 = make_inputs(12, T=30, Hk=Hk, r=r)
    o, S = gated_delta_rule(q, k, v, g, beta, S0, mode=form, chunk_size=16)
    grouped = [h // r for h in range(Hk * r)]  # value head h reads key head h // r
    o_rep, S_rep = gated_delta_rule(q[:, :, grouped], k[:, :, grouped], v, g, beta, S0, mode=form, chunk_size=16)
    assert max_err(o, o_rep) <= TOL64 and max_err(S, S_rep) <= TOL64
    modulo = [h % Hk for h in range(Hk * r)]
    o_mod, _ = gated_delta_rule(q[:, :, modulo], k[:, :, modulo], v, g, beta, S0, mode=form, chunk_size=16)
    assert max_err(o, o_mod) > 1e-3


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_permuting_batch_and_heads_permutes_outputs(form):
    q, k, v, g, beta, S0 = make_inputs(13, B=3, T=40, Hk=3, r=1)
    o, S = gated_delta_rule(q, k, v, g, beta, S0, mode=form, chunk_size=16)
    pb, ph = [2, 0, 1], [1, 2, 0]
    perm = (lambda x: x[pb][:, :, ph])
    o_p, S_p = gated_delta_rule(perm(q), perm(k), perm(v), perm(g), perm(beta), S0[pb][:, ph], mode=form,
                                chunk_size=16)
    assert np.array_equal(o_p, perm(o)) and np.array_equal(S_p, S[pb][:, ph])


# ---------------------------------------------------------------- numerics, dtypes, errors


def test_large_decay_stays_finite_and_exact():
    """g = -20 per token in a 64-chunk: the upper-triangle exponents reach +1260 and must be masked before exp."""
    for dtype in (np.float32, np.float64):
        q, k, v, g, beta, S0 = make_inputs(14, T=64, dtype=dtype)
        g = np.full_like(g, -20.0)
        with np.errstate(over="raise", invalid="raise", divide="raise"):  # exp never overflows; no NaN
            o_c, S_c = gated_delta_chunked(q, k, v, g, beta, S0, chunk_size=64)
        o_r, S_r = gated_delta_recurrent(q, k, v, g, beta, S0)
        assert np.isfinite(o_c).all() and np.isfinite(S_c).all()
        if dtype == np.float64:
            assert max_err(o_c, o_r) <= TOL64 and max_err(S_c, S_r) <= TOL64


def test_minus_inf_gate_is_rejected_by_chunked_and_handled_by_recurrent():
    q, k, v, g, beta, S0 = make_inputs(15, T=10)
    g[0, 4, 1] = -np.inf  # a hard reset
    with pytest.raises(InputError, match="-inf"):
        gated_delta_chunked(q, k, v, g, beta, S0)
    o, S = gated_delta_recurrent(q, k, v, g, beta, S0)
    assert np.isfinite(o).all() and np.isfinite(S).all()


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_float32_paths_against_float64_recurrent(form):
    """Spec §9: fp32 reference paths vs the fp64 recurrence, relative RMSE <= 1e-6 (N1 observed <= 4e-7)."""
    for g_norm in (0.01, 1.0, 10.0):
        inputs = make_inputs(16, B=1, T=300, Hk=2, r=2, Dk=32, Dv=32, g_norm=g_norm)
        o64, S64 = gated_delta_recurrent(*inputs)
        o32, S32 = gated_delta_rule(*(x.astype(np.float32) for x in inputs), mode=form)
        assert rel_rmse(o64, o32) <= 1e-6 and rel_rmse(S64, S32) <= 1e-6


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_dtypes_and_determinism(form):
    q, k, v, g, beta, S0 = make_inputs(17, T=20, dtype=np.float32)
    o, S = gated_delta_rule(q, k, v, g, beta, S0, mode=form)
    assert o.dtype == np.float32 and S.dtype == np.float32 and o.flags.c_contiguous
    o_again, S_again = gated_delta_rule(q, k, v, g, beta, S0, mode=form)
    assert np.array_equal(o, o_again) and np.array_equal(S, S_again)  # same inputs, same bits
    o16, S16 = gated_delta_rule(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), g, beta,
                                S0, mode=form)
    assert o16.dtype == np.float16 and S16.dtype == np.float32  # o in q's dtype; the state stays float32
    o64, S64 = gated_delta_rule(*(x.astype(np.float64) for x in (q, k, v, g, beta, S0)), mode=form)
    assert o64.dtype == np.float64 and S64.dtype == np.float64  # the oracle mode


def test_bad_shapes_raise_input_error():
    q, k, v, g, beta, S0 = make_inputs(18, T=5, Hk=2, r=2)
    with pytest.raises(InputError, match="multiple"):
        gated_delta_recurrent(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3], None)
    with pytest.raises(InputError, match="initial_state"):
        gated_delta_chunked(q, k, v, g, beta, S0.swapaxes(-1, -2))
    with pytest.raises(InputError, match="one token"):
        gated_delta_step(q, k, v, g, beta, S0)
    with pytest.raises(InputError, match="mode"):
        gated_delta_rule(q, k, v, g, beta, S0, mode="fused")


# ---------------------------------------------------------------- parity with transformers (float32)


@pytest.mark.oracle
@pytest.mark.parametrize("T, C, with_state", [(1, 64, True), (70, 64, True), (130, 64, False), (50, 16, True)])
def test_parity_with_transformers(hf, T, C, with_state):
    torch, m = hf
    inputs = make_inputs(19 + T, B=2, T=T, Hk=2, r=3, Dk=16, Dv=12, dtype=np.float32, state=with_state)
    q, k, v, g, beta, S0 = (None if x is None else torch.from_numpy(x) for x in inputs)
    kw = dict(initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    with torch.no_grad():
        o_tc, S_tc = m.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=C, **kw)
        o_tr, S_tr = m.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    o_c, S_c = gated_delta_chunked(*inputs, chunk_size=C)
    o_r, S_r = gated_delta_recurrent(*inputs)
    assert o_c.dtype == o_tc.numpy().dtype and S_c.dtype == S_tc.numpy().dtype
    assert max_err(o_c, o_tc.numpy()) <= 1e-5 and max_err(S_c, S_tc.numpy()) <= 1e-5
    assert max_err(o_r, o_tr.numpy()) <= 1e-5 and max_err(S_r, S_tr.numpy()) <= 1e-5


@pytest.mark.oracle
def test_step_parity_with_transformers_decode(hf):
    torch, m = hf
    inputs = make_inputs(20, B=2, T=1, Hk=2, r=2, Dk=16, Dv=12, dtype=np.float32)
    with torch.no_grad():
        o_t, S_t = m.torch_recurrent_gated_delta_rule(*(torch.from_numpy(x) for x in inputs[:5]),
                                                      initial_state=torch.from_numpy(inputs[5]),
                                                      output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, S = gated_delta_step(*inputs)
    assert max_err(o, o_t.numpy()) <= 1e-5 and max_err(S, S_t.numpy()) <= 1e-5
