"""Scaled dot-product attention and its masks: models.md §3.4. Properties in float64 against a per-head loop and
against full recomputation; parity with transformers' eager_attention_forward and masking_utils (float32, oracle)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.kernels.attention import causal_mask, sdpa


def naive_sdpa(q, k, v, mask=None, scale=None):
    """One (batch, query head) at a time: kv head h // n_rep, s = q k^T * scale + M, softmax, p v (float64)."""
    B, Hq, Lq, D = q.shape
    n_rep = Hq // k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    o = np.zeros((B, Hq, Lq, v.shape[-1]))
    p_all = np.zeros((B, Hq, Lq, k.shape[2]))
    for b in range(B):
        for h in range(Hq):
            s = (q[b, h] @ k[b, h // n_rep].T) * scale
            if mask is not None:
                s = s + mask[b if mask.shape[0] > 1 else 0, h if mask.shape[1] > 1 else 0]
            e = np.exp(s - s.max(axis=-1, keepdims=True))
            p_all[b, h] = e / e.sum(axis=-1, keepdims=True)
            o[b, h] = p_all[b, h] @ v[b, h // n_rep]
    return o, p_all


@st.composite
def qkv(draw, dtype=np.float64):
    """q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] with Lq <= Lk (a cache continuation)."""
    B, Hkv, n_rep = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4]))
    Lk = draw(st.integers(1, 12))
    Lq = draw(st.integers(1, Lk))
    D, Dv = draw(st.sampled_from([4, 8, 16])), draw(st.sampled_from([4, 8]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((B, Hkv * n_rep, Lq, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, Lk, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Lk, Dv)).astype(dtype)
    return q, k, v


def key_padding(rng, B, Lk):
    """Left padding [B, Lk] of 0/1 with at least one real key per row (the last one)."""
    valid = np.ones((B, Lk), np.int64)
    for b in range(B):
        valid[b, :rng.integers(0, Lk)] = 0
    return valid


def rows_with_a_key(mask):
    return np.any(mask == 0, axis=-1)  # [B|1, 1, Lq]


# ---------------------------------------------------------------- masks

@settings(max_examples=50, deadline=None)
@given(Lk=st.integers(1, 16), data=st.data(), window=st.none() | st.integers(1, 8), B=st.integers(1, 3),
       seed=st.integers(0, 2**16), dtype=st.sampled_from([np.float32, np.float64]))
def test_causal_mask_allows_exactly_the_keys_of_the_spec(Lk, data, window, B, seed, dtype):
    """Query i sits at key index q = offset + i; it sees j <= q, j > q - window, key_valid[b, j]. A query that is not
    padded sees exactly min(window, q + 1) keys, itself included. Blocked entries are finfo(dtype).min."""
    Lq = data.draw(st.integers(1, Lk), label="Lq")
    valid = key_padding(np.random.default_rng(seed), B, Lk)
    m = causal_mask(Lq, Lk, sliding_window=window, key_valid=valid, dtype=dtype)
    assert m.shape == (B, 1, Lq, Lk) and m.dtype == dtype
    assert set(np.unique(m)) <= {dtype(0), np.finfo(dtype).min}
    offset = Lk - Lq
    for b in range(B):
        for i in range(Lq):
            q = offset + i
            seen = [j for j in range(Lk) if m[b, 0, i, j] == 0]
            expect = [j for j in range(Lk) if j <= q and (window is None or j > q - window) and valid[b, j]]
            assert seen == expect
            if window is not None and valid[b].all():
                assert len(seen) == min(window, q + 1)
    unpadded = causal_mask(Lq, Lk, dtype=dtype)
    assert unpadded.shape == (1, 1, Lq, Lk)
    assert np.array_equal(causal_mask(Lq, Lk, offset=offset, dtype=dtype), unpadded)


# ---------------------------------------------------------------- sdpa properties (float64)

@settings(max_examples=50, deadline=None)
@given(t=qkv(), seed=st.integers(0, 2**16), window=st.none() | st.integers(1, 6), per_head=st.booleans())
def test_sdpa_equals_a_per_head_loop(t, seed, window, per_head):
    """GQA (query head h reads kv head h // n_rep), masks [B, 1 | Hq, Lq, Lk] with padding and sliding window;
    probabilities sum to 1 over keys; returned scores are q k^T * scale + M."""
    q, k, v = t
    B, Hq, Lq, _ = q.shape
    Lk = k.shape[2]
    rng = np.random.default_rng(seed)
    mask = causal_mask(Lq, Lk, sliding_window=window, key_valid=key_padding(rng, B, Lk), dtype=np.float64)
    if per_head:  # a different additive bias per query head checks the [Hkv, n_rep] grouping of the mask
        mask = mask + rng.uniform(-2, 0, (B, Hq, Lq, Lk))
    o, scores, probs = sdpa(q, k, v, mask, return_weights=True)
    o_ref, p_ref = naive_sdpa(q, k, v, mask)
    assert o.shape == (B, Hq, Lq, v.shape[-1]) and o.dtype == np.float64
    assert scores.shape == probs.shape == (B, Hq, Lq, Lk)
    assert np.max(np.abs(o - o_ref)) <= 1e-12 and np.max(np.abs(probs - p_ref)) <= 1e-12
    assert np.max(np.abs(probs.sum(-1) - 1)) <= 1e-12
    expect_scores = np.einsum("bhqd,bhkd->bhqk", q, np.repeat(k, Hq // k.shape[1], axis=1)) * q.shape[-1] ** -0.5
    assert np.max(np.abs(scores - (expect_scores + mask))) <= 1e-12 * (1 + np.abs(mask).max())


@pytest.mark.parametrize("Hkv,n_rep", [(2, 2), (3, 4), (4, 2)])
def test_gqa_grouping_of_queries_and_per_head_masks(Hkv, n_rep):
    """The grouped cases every GQA model hits (both Hkv > 1 and n_rep > 1), with a different mask per query head:
    equal to the per-head loop, and not to the modulo (np.tile) assignment of kv heads."""
    rng = np.random.default_rng(Hkv * 10 + n_rep)
    B, Lq, Lk, D = 2, 3, 6, 8
    q = rng.standard_normal((B, Hkv * n_rep, Lq, D))
    k, v = rng.standard_normal((2, B, Hkv, Lk, D))
    mask = causal_mask(Lq, Lk, dtype=np.float64) + rng.uniform(-3, 0, (B, Hkv * n_rep, Lq, Lk))
    o, _, probs = sdpa(q, k, v, mask, return_weights=True)
    o_ref, p_ref = naive_sdpa(q, k, v, mask)
    assert np.max(np.abs(o - o_ref)) <= 1e-12 and np.max(np.abs(probs - p_ref)) <= 1e-12
    o_tile, _ = naive_sdpa(q, np.tile(k, (1, n_rep, 1, 1)), np.tile(v, (1, n_rep, 1, 1)), mask)
    assert np.max(np.abs(o - o_tile)) > 1e-3


@settings(max_examples=40, deadline=None)
@given(t=qkv(), scale=st.floats(0.01, 2.0))
def test_query_offset_gives_the_last_rows_of_full_causal_attention(t, scale):
    """Lq != Lk, offset = Lk - Lq: the output equals the last Lq rows of causal attention with all Lk queries."""
    q_new, k, v = t
    B, Hq, Lq, D = q_new.shape
    Lk = k.shape[2]
    rng = np.random.default_rng(Lq * 131 + Lk)
    q_full = np.concatenate([rng.standard_normal((B, Hq, Lk - Lq, D)), q_new], axis=2)
    full = sdpa(q_full, k, v, causal_mask(Lk, Lk, dtype=np.float64), scale=scale)
    part, _, probs = sdpa(q_new, k, v, causal_mask(Lq, Lk, dtype=np.float64), scale=scale, return_weights=True)
    assert np.max(np.abs(part - full[:, :, Lk - Lq:])) <= 1e-12
    hidden = causal_mask(Lq, Lk, offset=0, dtype=np.float64) < 0               # keys a mask from 0 would hide
    if (probs * hidden).sum(axis=-1).max() > 1e-3:  # the offset matters (where those keys carry weight: a score
        # gap of ~40 leaves them e^-40 of it, and the outputs alike): queries put at 0 .. Lq-1 give something else
        wrong = sdpa(q_new, k, v, causal_mask(Lq, Lk, offset=0, dtype=np.float64), scale=scale)
        assert not np.allclose(wrong, part)


@settings(max_examples=40, deadline=None)
@given(t=qkv(), causal=st.booleans())
def test_gqa_is_repeat_interleave_not_tile(t, causal):
    """Equals multi-head attention with K/V repeated by np.repeat(axis=1) (torch repeat_interleave, HF repeat_kv);
    the modulo mapping h % Hkv (np.tile) gives a different result whenever 1 < n_rep and 1 < Hkv."""
    q, k, v = t
    Hq, Hkv = q.shape[1], k.shape[1]
    n_rep = Hq // Hkv
    mask = causal_mask(q.shape[2], k.shape[2], dtype=np.float64) if causal else None
    o = sdpa(q, k, v, mask)
    o_repeat = sdpa(q, np.repeat(k, n_rep, axis=1), np.repeat(v, n_rep, axis=1), mask)
    assert np.max(np.abs(o - o_repeat)) <= 1e-12
    if n_rep > 1 and Hkv > 1:
        o_tile = sdpa(q, np.tile(k, (1, n_rep, 1, 1)), np.tile(v, (1, n_rep, 1, 1)), mask)
        assert np.max(np.abs(o - o_tile)) > 1e-6


@settings(max_examples=40, deadline=None)
@given(t=qkv(), window=st.integers(1, 6))
def test_sliding_window_equals_attention_over_the_window_slice(t, window):
    """Each query sees keys max(0, q - window + 1) .. q only: the same as attending over that slice alone."""
    q, k, v = t
    Lq, Lk = q.shape[2], k.shape[2]
    o, _, probs = sdpa(q, k, v, causal_mask(Lq, Lk, sliding_window=window, dtype=np.float64), return_weights=True)
    for i in range(Lq):
        pos = Lk - Lq + i
        lo = max(0, pos - window + 1)
        assert np.all(probs[:, :, i, :lo] == 0) and np.all(probs[:, :, i, pos + 1:] == 0)
        assert np.all(probs[:, :, i, lo:pos + 1] > 0)
        alone = sdpa(q[:, :, i:i + 1], k[:, :, lo:pos + 1], v[:, :, lo:pos + 1])
        assert np.max(np.abs(o[:, :, i:i + 1] - alone)) <= 1e-12


@settings(max_examples=40, deadline=None)
@given(t=qkv(dtype=np.float32), seed=st.integers(0, 2**16))
def test_padded_keys_get_zero_weight_and_cannot_leak(t, seed):
    """Keys with key_valid = 0 get probability exactly 0 from every query that has a real key; overwriting their k
    and v with garbage leaves those queries bit-identical."""
    q, k, v = t
    B, _, Lq, _ = q.shape
    Lk = k.shape[2]
    rng = np.random.default_rng(seed)
    valid = key_padding(rng, B, Lk)
    mask = causal_mask(Lq, Lk, key_valid=valid)
    o, _, probs = sdpa(q, k, v, mask, return_weights=True)
    live_pad = (valid == 0)[:, None, None, :] & rows_with_a_key(mask)[..., None]  # [B, 1, Lq, Lk]
    assert np.all(probs[np.broadcast_to(live_pad, probs.shape)] == 0)
    k2, v2 = k.copy(), v.copy()
    pad = np.broadcast_to((valid == 0)[:, None, :], k.shape[:3])
    k2[pad], v2[pad] = 1e4, -1e4
    live = np.broadcast_to(rows_with_a_key(mask)[..., None], o.shape)
    assert np.array_equal(sdpa(q, k2, v2, mask)[live], o[live])


@settings(max_examples=40, deadline=None)
@given(t=qkv(dtype=np.float32), window=st.none() | st.integers(1, 4), seed=st.integers(0, 2**16))
def test_mask_floor(t, window, seed):
    """Device graphs clamp the mask from below (max(M, floor)). A floor of -1e9 still underflows every blocked
    exp() to 0, so every query with a real key is bit-identical to no floor; a floor of -5 lets blocked keys back in."""
    q, k, v = t
    B, _, Lq, _ = q.shape
    Lk = k.shape[2]
    mask = causal_mask(Lq, Lk, sliding_window=window, key_valid=key_padding(np.random.default_rng(seed), B, Lk))
    o = sdpa(q, k, v, mask)
    live = np.broadcast_to(rows_with_a_key(mask)[..., None], o.shape)
    assert np.array_equal(sdpa(q, k, v, mask, mask_floor=-1e9)[live], o[live])
    if np.any(mask[rows_with_a_key(mask)] != 0):  # some live query has a blocked key
        soft, _, probs = sdpa(q, k, v, mask, mask_floor=-5.0, return_weights=True)
        blocked = np.broadcast_to(mask != 0, probs.shape) & np.broadcast_to(rows_with_a_key(mask)[..., None],
                                                                             probs.shape)
        assert np.all(probs[blocked] > 0) and np.max(np.abs(soft - o)) > 1e-4
        np.testing.assert_allclose(soft, sdpa(q, k, v, np.where(mask != 0, np.float32(-5), np.float32(0))),
                                   rtol=0, atol=0)
    # a clamp, not a replacement: additive biases above the floor are kept
    bias = mask + np.random.default_rng(seed).uniform(-3, 0, mask.shape).astype(np.float32)
    kept = np.where(bias < -5, np.float32(-5), bias)
    assert np.array_equal(sdpa(q, k, v, bias, mask_floor=-5.0), sdpa(q, k, v, kept))
    if Lk > 1:
        assert not np.array_equal(sdpa(q, k, v, bias, mask_floor=-5.0), sdpa(q, k, v, np.where(bias < 0, -5, 0)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fully_masked_query_gives_the_uniform_distribution(dtype):
    """finfo.min, not -inf: a query with no visible key (a left-pad query row) averages all values instead of NaN."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in [(2, 4, 5, 8), (2, 2, 5, 8), (2, 2, 5, 8)])
    valid = np.array([[0, 0, 0, 1, 1], [1, 1, 1, 1, 1]])
    mask = causal_mask(5, 5, key_valid=valid, dtype=dtype)
    o, _, probs = sdpa(q, k, v, mask, return_weights=True)
    assert np.all(np.isfinite(o))
    for i in range(3):  # batch 0, queries 0..2 see no real key
        assert np.all(probs[0, :, i] == probs.dtype.type(1 / 5))
        np.testing.assert_allclose(o[0, :, i], np.repeat(v[0].mean(axis=1), 2, axis=0), rtol=1e-6)
    assert np.all(probs[0, :, 3:, :3] == 0)


def test_default_scale_is_head_dim_to_minus_half_and_applied_after_the_product():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 3, 16)) for _ in range(3))
    _, scores, _ = sdpa(q, k, v, return_weights=True)
    np.testing.assert_allclose(scores, np.einsum("bhqd,bhkd->bhqk", q, k) / 4, rtol=1e-15)
    _, scores, _ = sdpa(q, k, v, scale=0.3, return_weights=True)
    np.testing.assert_allclose(scores, np.einsum("bhqd,bhkd->bhqk", q, k) * 0.3, rtol=1e-15)


# ---------------------------------------------------------------- parity with transformers (float32)

@pytest.mark.oracle
@settings(max_examples=40, deadline=None)
@given(Lk=st.integers(1, 12), data=st.data(), B=st.integers(1, 3), window=st.none() | st.integers(1, 6),
       seed=st.integers(0, 2**16))
def test_oracle_causal_mask_equals_masking_utils_eager_mask(Lk, data, B, window, seed):
    """transformers builds the eager mask from the boolean sdpa_mask with q_offset = past length, the 2-D padding
    mask and (optionally) the sliding-window overlay, then 0 / finfo(float32).min."""
    torch = pytest.importorskip("torch")
    from transformers.masking_utils import causal_mask_function, eager_mask, sliding_window_causal_mask_function
    Lq = data.draw(st.integers(1, Lk), label="Lq")
    valid = key_padding(np.random.default_rng(seed), B, Lk)
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    hf = eager_mask(batch_size=B, q_length=Lq, kv_length=Lk, q_offset=Lk - Lq, mask_function=fn,
                    attention_mask=torch.from_numpy(valid).bool(), dtype=torch.float32).numpy()
    mine = causal_mask(Lq, Lk, sliding_window=window, key_valid=valid)
    assert mine.dtype == hf.dtype and np.array_equal(mine, hf)


@pytest.mark.oracle
@settings(max_examples=30, deadline=None)
@given(t=qkv(dtype=np.float32), seed=st.integers(0, 2**16), padded=st.booleans(), window=st.none() | st.integers(1, 5))
def test_oracle_sdpa_equals_eager_attention_forward(t, seed, padded, window):
    """Qwen3's eager_attention_forward (repeat_kv, matmul * scaling, + mask, float32 softmax, matmul) with the
    additive mask transformers builds (finfo.min, left padding, fully masked pad rows included)."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from transformers.masking_utils import causal_mask_function, eager_mask, sliding_window_causal_mask_function
    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward
    q, k, v = t
    B, Hq, Lq, D = q.shape
    Lk = k.shape[2]
    valid = key_padding(np.random.default_rng(seed), B, Lk) if padded else np.ones((B, Lk), np.int64)
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    hf_mask = eager_mask(batch_size=B, q_length=Lq, kv_length=Lk, q_offset=Lk - Lq, mask_function=fn,
                         attention_mask=torch.from_numpy(valid).bool(), dtype=torch.float32)
    module = SimpleNamespace(num_key_value_groups=Hq // k.shape[1], training=False)
    hf_o, hf_p = eager_attention_forward(module, *(torch.from_numpy(a) for a in (q, k, v)), hf_mask,
                                         scaling=D ** -0.5)
    o, _, probs = sdpa(q, k, v, hf_mask.numpy(), return_weights=True)
    assert o.dtype == probs.dtype == np.float32
    np.testing.assert_allclose(probs, hf_p.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(o.transpose(0, 2, 1, 3), hf_o.numpy(), rtol=1e-6, atol=1e-6)
