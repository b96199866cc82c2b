"""RoPE: models.md §3.2. Properties of the rotation (float64, exact or ~1e-12), and parity with transformers 5.23:
the init functions of every rope type, Qwen3RotaryEmbedding's cos/sin, apply_rotary_pos_emb, and Qwen3.5's
interleaved MRoPE (float32, oracle)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.kernels.rope import (
    apply_rope,
    default_inv_freq,
    interleaved_mrope_axes,
    inv_freq_and_scaling,
    mrope_interleaved_tables,
    mrope_tables,
    rope_tables,
)

THETAS = st.sampled_from([1e4, 5e5, 1e6, 1e7]) | st.floats(100.0, 1e7)


@st.composite
def heads(draw, dtype=np.float64, max_pos=4096):
    """x [B, T, H, D] with D = rot + pass-through channels, integer positions [B, T], rot, theta."""
    B, T, H = draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(1, 3))
    rot = 2 * draw(st.integers(1, 16))
    D = rot + draw(st.integers(0, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = rng.standard_normal((B, T, H, D)).astype(dtype)
    positions = rng.integers(0, max_pos, (B, T))
    return x, positions, rot, draw(THETAS)


def rotate(x, positions, inv_freq, scaling=1.0):
    return apply_rope(x, *rope_tables(positions, inv_freq, scaling))


def interleaved_rope(x, cos, sin):
    """The GPT-J / Meta pairing (2i, 2i+1) that HF Qwen checkpoints do NOT use (pitfall §8.17)."""
    h = cos.shape[-1]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    even, odd = x[..., 0:2 * h:2], x[..., 1:2 * h:2]
    y = x.copy()
    y[..., 0:2 * h:2] = even * c - odd * s
    y[..., 1:2 * h:2] = odd * c + even * s
    return y


# ---------------------------------------------------------------- properties of the rotation (float64)

@settings(max_examples=40, deadline=None)
@given(case=heads(max_pos=50_000), scaling=st.sampled_from([1.0, 1.1386294361119891, 0.7]))
def test_rotation_preserves_every_pair_norm_and_scales_by_attention_scaling(case, scaling):
    """A rotation per pair (i, i+rot/2): each pair's 2-D norm is kept, so the head norm is too; attention_scaling
    multiplies cos and sin, hence every norm, exactly once."""
    x, positions, rot, theta = case
    h = rot // 2
    y = rotate(x, positions, default_inv_freq(theta, rot, np.float64), scaling)
    pair = lambda a: np.hypot(a[..., :h], a[..., h:rot])  # noqa: E731
    head = np.linalg.norm(x, axis=-1, keepdims=True)
    assert np.max(np.abs(pair(y) - scaling * pair(x)) / head) <= 1e-13
    if scaling == 1.0:
        np.testing.assert_allclose(np.linalg.norm(y, axis=-1), head[..., 0], rtol=1e-13)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(0, 2048), n=st.integers(0, 2048), shift=st.integers(1, 2048),
       rot_half=st.integers(1, 16), extra=st.integers(0, 4), theta=THETAS)
def test_scores_depend_only_on_position_difference(seed, m, n, shift, rot_half, extra, theta):
    """q_m . k_n == q_{m+s} . k_{n+s} (that RoPE moves vectors at all is checked by the position tests)."""
    rng = np.random.default_rng(seed)
    rot = 2 * rot_half
    q, k = rng.standard_normal((2, 1, 1, 1, rot + extra))
    inv_freq = default_inv_freq(theta, rot, np.float64)

    def score(pq, pk):
        return float(np.sum(rotate(q, np.array([[pq]]), inv_freq) * rotate(k, np.array([[pk]]), inv_freq)))

    bound = 1e-11 * np.linalg.norm(q) * np.linalg.norm(k)  # angles up to ~4096 rad carry ~1e-12 rounding
    assert abs(score(m, n) - score(m + shift, n + shift)) <= bound


@settings(max_examples=40, deadline=None)
@given(case=heads(), dtype=st.sampled_from([np.float32, np.float64]))
def test_partial_rotary_passes_channels_rot_to_D_through_bit_identically(case, dtype):
    """y[..., rot:] is x[..., rot:] bit for bit, and y[..., :rot] is the rotation of x[..., :rot] alone."""
    x, positions, rot, theta = case
    x = x.astype(dtype)
    cos, sin = rope_tables(positions, default_inv_freq(theta, rot, dtype))
    y = apply_rope(x, cos, sin)
    assert y.dtype == dtype and y.shape == x.shape
    assert np.array_equal(y[..., rot:], x[..., rot:])
    assert np.array_equal(y[..., :rot], apply_rope(np.ascontiguousarray(x[..., :rot]), cos, sin))


@settings(max_examples=30, deadline=None)
@given(case=heads(), dtype=st.sampled_from([np.float32, np.float64]))
def test_position_zero_is_the_identity_and_other_positions_are_not(case, dtype):
    x, positions, rot, theta = case
    x = x.astype(dtype)
    inv_freq = default_inv_freq(theta, rot, dtype)
    cos, sin = rope_tables(np.zeros_like(positions), inv_freq)
    assert np.all(cos == 1) and np.all(sin == 0)
    assert np.array_equal(apply_rope(x, cos, sin), x)
    moved = rotate(x, np.ones_like(positions), inv_freq)  # frequency 0 turns 1 rad per position
    expect = x[..., 0].astype(np.float64) * math.cos(1) - x[..., rot // 2].astype(np.float64) * math.sin(1)
    np.testing.assert_allclose(moved[..., 0], expect, rtol=0, atol=4 * np.finfo(dtype).eps * np.abs(x).max())


@pytest.mark.parametrize("rot,D", [(8, 8), (8, 13), (64, 256)])
def test_half_split_pairs_channel_i_with_i_plus_half(rot, D):
    """A unit vector on channel i (< rot/2) lands on exactly {i, i+rot/2} as (cos, sin); on i+rot/2 as (-sin, cos)."""
    h = rot // 2
    inv_freq = default_inv_freq(1e4, rot, np.float64)
    cos, sin = rope_tables(np.array([[3]]), inv_freq)
    for i in range(h):
        for src, expect_i, expect_ih in [(i, cos[0, 0, i], sin[0, 0, i]), (i + h, -sin[0, 0, i], cos[0, 0, i])]:
            e = np.zeros((1, 1, 1, D))
            e[..., src] = 1.0
            y = apply_rope(e, cos, sin)[0, 0, 0]
            expect = np.zeros(D)
            expect[i], expect[i + h] = expect_i, expect_ih
            assert np.array_equal(y, expect), (i, src)


@settings(max_examples=30, deadline=None)
@given(case=heads())
def test_half_split_is_the_interleaved_rotation_under_a_channel_permutation_and_differs_from_it(case):
    """apply_rope == P^-1 . interleaved . P with P: channel i -> 2i, i+rot/2 -> 2i+1 (bit for bit); the interleaved
    (adjacent-pair) rotation applied directly gives a different result whenever rot >= 4."""
    x, positions, rot, theta = case
    h = rot // 2
    cos, sin = rope_tables(positions + 1, default_inv_freq(theta, rot, np.float64))
    perm = np.concatenate([np.ravel(np.column_stack([np.arange(h), np.arange(h, rot)])), np.arange(rot, x.shape[-1])])
    inv = np.argsort(perm)
    y = apply_rope(x, cos, sin)
    assert np.array_equal(interleaved_rope(x[..., perm], cos, sin)[..., inv], y)
    if rot >= 4:
        assert not np.allclose(interleaved_rope(x, cos, sin), y, rtol=1e-6, atol=1e-6)


def test_rotary_width_is_the_exponent_denominator():
    """inv_freq[i] = base^(-2i/rot) with rot the rotary width (64 for D = 256, factor 0.25), not D."""
    inv_freq = default_inv_freq(1e7, 64, np.float64)
    assert inv_freq.shape == (32,) and inv_freq[0] == 1.0
    np.testing.assert_allclose(inv_freq, 1e7 ** (-np.arange(0, 64, 2) / 64), rtol=1e-15)
    f32 = default_inv_freq(1e7, 64)
    assert f32.dtype == np.float32
    np.testing.assert_allclose(f32, inv_freq, rtol=2**-23)  # one rounding of the float64 value


@pytest.mark.parametrize("factor", [2.0, 4.0, 8.0, 40.0])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_yarn_attention_factor_and_linear_scaling(factor, dtype):
    """yarn attention_factor = 0.1 ln f + 1 (factor 4: 1.1386294...), or m(f, mscale)/m(f, mscale_all_dim);
    linear divides the default frequencies by the factor; both in the requested dtype."""
    rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": factor, "original_max_position_embeddings": 32768}
    inv_freq, scaling = inv_freq_and_scaling(rope, 128, 40960, dtype=dtype)
    assert inv_freq.dtype == dtype and inv_freq.shape == (64,)
    assert abs(scaling - (0.1 * math.log(factor) + 1)) <= 1e-15
    if factor == 4.0:
        assert abs(scaling - 1.1386294361119891) <= 1e-15
    m = lambda mu: 0.1 * mu * math.log(factor) + 1  # noqa: E731
    _, scaling = inv_freq_and_scaling({**rope, "mscale": 0.8, "mscale_all_dim": 0.5}, 128, 40960)
    assert abs(scaling - m(0.8) / m(0.5)) <= 1e-15
    _, scaling = inv_freq_and_scaling({**rope, "mscale": 0.8, "mscale_all_dim": 0}, 128, 40960)
    assert abs(scaling - m(1)) <= 1e-15  # a zero mscale_all_dim falls back to m(f, 1)
    linear, scaling = inv_freq_and_scaling({"rope_type": "linear", "rope_theta": 1e6, "factor": factor}, 128, 4096,
                                           dtype=dtype)
    assert scaling == 1.0 and np.array_equal(linear, default_inv_freq(1e6, 128, dtype) / dtype(factor))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("factor", [2.0, 4.3, 16.3, 64.328])
def test_dynamic_and_longrope_switch_on_seq_len(dtype, factor):
    """dynamic: seq_len <= max_position_embeddings (or None) gives the default frequencies bit for bit (in float32,
    factor*s/max - (factor-1) is not exactly 1 at s = max for these factors, so it must not be evaluated); above it
    every frequency but the first shrinks. longrope: short factors up to original_max, long factors above it."""
    default = default_inv_freq(1e4, 64, dtype)
    dyn = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": factor}
    for seq_len in (None, 1, 4095, 4096):
        assert np.array_equal(inv_freq_and_scaling(dyn, 64, 4096, seq_len, dtype)[0], default)
    grown = inv_freq_and_scaling(dyn, 64, 4096, 8192, dtype)[0]
    assert grown[0] == 1 and np.all(grown[1:] < default[1:])
    short, long = np.linspace(1, 2, 32), np.linspace(2, 5, 32)
    lr = {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 1024,
          "short_factor": list(short), "long_factor": list(long)}
    for seq_len, ext in ((None, short), (1024, short), (1025, long)):
        np.testing.assert_allclose(inv_freq_and_scaling(lr, 64, 4096, seq_len, dtype)[0], default / ext,
                                   rtol=4 * np.finfo(dtype).eps)
    assert abs(inv_freq_and_scaling(lr, 64, 4096)[1] - math.sqrt(1 + math.log(4) / math.log(1024))) <= 1e-15


# ---------------------------------------------------------------- Qwen3.5 interleaved MRoPE

@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), half=st.integers(3, 40), data=st.data(),
       dtype=st.sampled_from([np.float32, np.float64]))
def test_mrope_slots(seed, half, data, dtype):
    """Identical T/H/W rows give exactly the 1-D tables; different rows put H at slots j%3==1, j < 3*s[1], W at
    j%3==2, j < 3*s[2], T elsewhere (each slot bit-identical to the 1-D table of its axis)."""
    section = data.draw(st.lists(st.integers(0, half), min_size=3, max_size=3), label="mrope_section")
    rng = np.random.default_rng(seed)
    inv_freq = default_inv_freq(1e7, 2 * half, dtype)
    positions = rng.integers(0, 10_000, (2, 5))
    same = mrope_interleaved_tables(np.stack([positions] * 3), inv_freq, section, 1.25)
    flat = rope_tables(positions, inv_freq, 1.25)
    assert all(np.array_equal(a, b) and a.dtype == dtype for a, b in zip(same, flat))
    thw = np.stack([positions, rng.integers(0, 10_000, (2, 5)), rng.integers(0, 10_000, (2, 5))])
    cos, sin = mrope_interleaved_tables(thw, inv_freq, section)
    per_axis = [rope_tables(p, inv_freq) for p in thw]
    for j in range(half):
        a = 1 if (j % 3 == 1 and j < 3 * section[1]) else 2 if (j % 3 == 2 and j < 3 * section[2]) else 0
        assert np.array_equal(cos[..., j], per_axis[a][0][..., j])
        assert np.array_equal(sin[..., j], per_axis[a][1][..., j])


def test_mrope_default_section_slots():
    """Default section [11, 11, 10], rot/2 = 32: H slots 1, 4, ..., 31; W slots 2, 5, ..., 29 (models.md §3.2.6)."""
    inv_freq = default_inv_freq(1e7, 64, np.float64)
    thw = np.array([0, 5, 9]).reshape(3, 1, 1)
    cos, _ = mrope_interleaved_tables(thw, inv_freq, [11, 11, 10])
    per_axis = np.stack([rope_tables(p, inv_freq)[0][0, 0] for p in thw])  # [3, 32]
    axis = [[a for a in range(3) if cos[0, 0, j] == per_axis[a, j]] for j in range(32)]
    assert axis == [[1] if j in range(1, 32, 3) else [2] if j in range(2, 30, 3) else [0] for j in range(32)]


def test_llamacpp_imrope_axes_follow_ggml():
    """llama.cpp's interleaved M-RoPE (ggml_mrope_cache_init, IMROPE): sector = j mod (s0+s1+s2+s3); H where
    sector % 3 == 1 and sector < 3*s1, W where % 3 == 2 and < 3*s2, T where % 3 == 0 and < 3*s0, else the fourth
    axis E. Where the sections cover every pair it is transformers' rule."""
    axes = lambda n, s, cpp: interleaved_mrope_axes(n, s, llama_cpp=cpp).tolist()
    assert axes(8, [3, 2, 1], False) == [0, 1, 2, 0, 1, 0, 0, 0]
    assert axes(8, [3, 2, 1], True) == [0, 1, 2, 0, 1, 3, 0, 1]          # 6, 7 repeat sectors 0, 1
    assert axes(8, [3, 3, 0], True) == [0, 1, 3, 0, 1, 3, 0, 1]
    assert axes(8, [2, 1, 1, 4], True) == [0, 1, 2, 0, 3, 3, 3, 3]       # a fourth section of the file's
    for section in ([11, 11, 10], [2, 1, 1], [6, 5, 5]):
        n = sum(section)
        assert axes(n, section, True) == axes(n, section, False), section
    # T's section counts pairs, not slots: [16, 8, 8] over 32 pairs leaves the H / W slots past 24 to nobody
    differ = [j for j, (a, b) in enumerate(zip(axes(32, [16, 8, 8], True), axes(32, [16, 8, 8], False))) if a != b]
    assert differ == [25, 26, 28, 29, 31] and {axes(32, [16, 8, 8], True)[j] for j in differ} == {3}


def test_mrope_tables_put_each_pair_on_its_axis():
    inv_freq = default_inv_freq(1e4, 16, np.float32)
    positions = np.stack([np.full((1, 3), p) for p in (7, 8, 9, 0)])      # T, H, W, E
    cos, sin = mrope_tables(positions, inv_freq, [0, 1, 2, 0, 1, 3, 0, 1])
    per_axis = [rope_tables(p, inv_freq) for p in positions]
    for j, a in enumerate([0, 1, 2, 0, 1, 3, 0, 1]):
        assert (np.array_equal(cos[..., j], per_axis[a][0][..., j])
                and np.array_equal(sin[..., j], per_axis[a][1][..., j]))
    assert (cos[..., 5] == 1).all() and (sin[..., 5] == 0).all()          # position 0: unrotated


# ---------------------------------------------------------------- parity with transformers (float32)

def _hf_rope(rope_parameters, head_dim, max_pos, config_cls="Qwen3Config"):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, config_cls)(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=head_dim, max_position_embeddings=max_pos,
                                               rope_parameters=dict(rope_parameters))
    return config


def _hf_init(config, seq_len=None):
    """transformers' inv_freq and attention scaling: the model's own default function or ROPE_INIT_FUNCTIONS."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    kind = config.rope_parameters["rope_type"]
    fn = Qwen3RotaryEmbedding.compute_default_rope_parameters if kind == "default" else ROPE_INIT_FUNCTIONS[kind]
    inv_freq, scaling = fn(config, seq_len=seq_len)
    return inv_freq.numpy(), float(scaling)


_SAME = object()


def _check_inv_freq(config, dim, seq_len=None, hf_seq_len=_SAME):
    """refimpl against transformers (given hf_seq_len, else the same seq_len): inv_freq to rtol 1e-6, scaling 1e-12."""
    hf_inv, hf_scaling = _hf_init(config, seq_len if hf_seq_len is _SAME else hf_seq_len)
    inv, scaling = inv_freq_and_scaling(config.rope_parameters, dim, config.max_position_embeddings, seq_len)
    assert inv.dtype == np.float32 and inv.shape == hf_inv.shape == (dim // 2,)
    np.testing.assert_allclose(inv, hf_inv, rtol=1e-6, atol=0)
    assert abs(scaling - hf_scaling) <= 1e-12


HEAD_DIMS = st.sampled_from([16, 32, 64, 128, 256])
PARTIAL = st.sampled_from([1.0, 0.5, 0.25])
MAX_POS = st.sampled_from([128, 4096, 32768, 40960])


@pytest.mark.oracle
@settings(max_examples=25, deadline=None)
@given(head_dim=HEAD_DIMS, theta=THETAS, max_pos=MAX_POS)
def test_oracle_default_inv_freq(head_dim, theta, max_pos):
    pytest.importorskip("torch")
    config = _hf_rope({"rope_type": "default", "rope_theta": theta}, head_dim, max_pos)
    _check_inv_freq(config, head_dim)


@pytest.mark.oracle
@settings(max_examples=25, deadline=None)
@given(head_dim=HEAD_DIMS, partial=PARTIAL, theta=THETAS, factor=st.floats(1.0, 64.0))
def test_oracle_linear_inv_freq(head_dim, partial, theta, factor):
    pytest.importorskip("torch")
    config = _hf_rope({"rope_type": "linear", "rope_theta": theta, "factor": factor, "partial_rotary_factor": partial},
                      head_dim, 4096)
    _check_inv_freq(config, int(head_dim * partial))


@pytest.mark.oracle
@settings(max_examples=25, deadline=None)
@given(head_dim=HEAD_DIMS, partial=PARTIAL, theta=THETAS, factor=st.floats(1.0, 64.0), max_pos=MAX_POS,
       excess=st.sampled_from([0, 1]) | st.integers(-100, 200_000))
def test_oracle_dynamic_inv_freq(head_dim, partial, theta, factor, max_pos, excess):
    """Compared with the calls the model makes. Up to max_position_embeddings it holds the init-time frequencies
    (seq_len None). Beyond, dynamic_rope_update passes seq_len = max(position_ids) + 1 as a tensor, so the new
    base is formed in float32 tensor arithmetic (a plain int would form it in float64, which the model never does)."""
    torch = pytest.importorskip("torch")
    config = _hf_rope({"rope_type": "dynamic", "rope_theta": theta, "factor": factor, "partial_rotary_factor": partial},
                      head_dim, max_pos)
    seq_len = max(1, max_pos + excess)
    _check_inv_freq(config, int(head_dim * partial), seq_len, torch.tensor(seq_len) if seq_len > max_pos else None)


@pytest.mark.oracle
@pytest.mark.parametrize("factor", [2.3, 4.3, 16.3, 32.7, 64.328])
@pytest.mark.parametrize("max_pos,excess", [(40960, 1), (40960, 7), (4096, 1), (1000, 3), (4096, 50_000)])
def test_oracle_dynamic_inv_freq_just_past_max_position(factor, max_pos, excess):
    """Just past max_position_embeddings factor*s/max - (factor - 1) is ~1 and cancels: transformers subtracts
    float32(factor - 1) (rounded from float64), not float32(factor) - 1, and the difference shows at ~4e-6 here."""
    torch = pytest.importorskip("torch")
    config = _hf_rope({"rope_type": "dynamic", "rope_theta": 1e6, "factor": factor}, 128, max_pos)
    _check_inv_freq(config, 128, max_pos + excess, torch.tensor(max_pos + excess))


@pytest.mark.oracle
def test_oracle_dynamic_inv_freq_in_the_module_after_a_long_forward():
    """Qwen3RotaryEmbedding's own buffer over a sequence of forwards. The module is stateful (§3.2.5): it grows when
    seq_len exceeds the largest seen so far, keeps that size for shorter calls, and restores the original
    frequencies only when seq_len < max_position_embeddings. The kernel is given the size the module holds."""
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    config = _hf_rope({"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.3}, 128, 4096)
    emb = Qwen3RotaryEmbedding(config)
    held = 4096
    for seq_len in (4096, 5000, 4097, 20_000, 100, 4097, 4096):
        held = seq_len if seq_len > held else 4096 if seq_len < 4096 < held else held
        emb(torch.zeros(1), torch.arange(seq_len)[None])
        inv, _ = inv_freq_and_scaling(config.rope_parameters, 128, 4096, held)
        np.testing.assert_allclose(inv, emb.inv_freq.numpy(), rtol=1e-6, atol=0)
    assert held == 4097  # the last call did not restore: 4096 is not below max_position_embeddings


def _longrope_factors(dim, seed=0):
    rng = np.random.default_rng(seed)
    return {"short_factor": list(rng.uniform(1, 3, dim // 2)), "long_factor": list(rng.uniform(1, 40, dim // 2))}


NAMED = {  # (rope_parameters, head_dim, max_position_embeddings, seq_len): every knob at least once, deterministically
    "default": ({"rope_type": "default", "rope_theta": 1e6}, 128, 40960, None),
    "linear-partial": ({"rope_type": "linear", "rope_theta": 1e4, "factor": 8.0, "partial_rotary_factor": 0.25},
                       256, 4096, None),
    "dynamic-at-init": ({"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0}, 128, 40960, None),
    "dynamic-grown": ({"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0}, 128, 40960, 100_000),
    "yarn-qwen3-card": ({"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                         "original_max_position_embeddings": 32768}, 128, 40960, None),
    "yarn-factor-none": ({"rope_type": "yarn", "rope_theta": 1e6, "factor": None,
                          "original_max_position_embeddings": 8192}, 128, 40960, None),
    "yarn-mscale": ({"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                     "original_max_position_embeddings": 4096}, 64, 40960, None),
    "yarn-attention-factor": ({"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "attention_factor": 1.5,
                               "original_max_position_embeddings": 32768}, 128, 40960, None),
    "yarn-no-truncate-betas": ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 16.0, "beta_fast": 16,
                                "beta_slow": 2, "truncate": False, "original_max_position_embeddings": 2048,
                                "partial_rotary_factor": 0.5}, 128, 40960, None),
    "longrope-short": ({"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 1024,
                        **_longrope_factors(64)}, 64, 8192, 1024),
    "longrope-long": ({"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 1024,
                       **_longrope_factors(64)}, 64, 8192, 1025),
    "llama3.1": ({"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 128, 131072, None),
}


@pytest.mark.oracle
@pytest.mark.parametrize("name", NAMED)
def test_oracle_named_rope_configurations(name):
    torch = pytest.importorskip("torch")
    rope, head_dim, max_pos, seq_len = NAMED[name]
    config = _hf_rope(rope, head_dim, max_pos)
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    grows = rope["rope_type"] == "dynamic" and seq_len is not None and seq_len > max_pos
    _check_inv_freq(config, dim, seq_len, torch.tensor(seq_len) if grows else _SAME)
    if name == "yarn-qwen3-card":
        assert abs(inv_freq_and_scaling(config.rope_parameters, dim, max_pos)[1] - (0.1 * math.log(4) + 1)) <= 1e-15


YARN = st.fixed_dictionaries(
    {"rope_type": st.just("yarn"), "original_max_position_embeddings": st.sampled_from([64, 2048, 4096, 32768])},
    optional={"factor": st.none() | st.floats(1.0, 40.0), "attention_factor": st.floats(0.5, 2.0),
              "mscale": st.sampled_from([0, 0.707, 1.0]), "mscale_all_dim": st.sampled_from([0, 0.5, 1.0]),
              "beta_fast": st.sampled_from([0, 8, 32, 64]), "beta_slow": st.sampled_from([0, 0.5, 1, 2]),
              "truncate": st.booleans()})


@pytest.mark.oracle
@settings(max_examples=60, deadline=None)
@given(head_dim=HEAD_DIMS, partial=PARTIAL, theta=THETAS, rope=YARN)
def test_oracle_yarn_inv_freq_and_attention_factor(head_dim, partial, theta, rope):
    """Every yarn knob: factor (None -> max_pos / original), attention_factor, mscale / mscale_all_dim (0 = unset),
    beta_fast / beta_slow (0 = default), truncate False (fractional ramp ends)."""
    pytest.importorskip("torch")
    rope = {**rope, "rope_theta": theta, "partial_rotary_factor": partial}
    rope.setdefault("factor", None)
    config = _hf_rope(rope, head_dim, 131072)
    _check_inv_freq(config, int(head_dim * partial))


@pytest.mark.oracle
@settings(max_examples=25, deadline=None)
@given(head_dim=HEAD_DIMS, partial=PARTIAL, theta=THETAS, factor=st.none() | st.floats(1.0, 16.0),
       attention_factor=st.none() | st.floats(0.5, 2.0), seq_len=st.none() | st.integers(1, 10_000),
       seed=st.integers(0, 2**16))
def test_oracle_longrope_short_and_long(head_dim, partial, theta, factor, attention_factor, seq_len, seed):
    pytest.importorskip("torch")
    dim = int(head_dim * partial)
    rng = np.random.default_rng(seed)
    rope = {"rope_type": "longrope", "rope_theta": theta, "partial_rotary_factor": partial,
            "original_max_position_embeddings": 1024, "short_factor": list(rng.uniform(1, 3, dim // 2)),
            "long_factor": list(rng.uniform(1, 40, dim // 2))}
    if factor is not None:
        rope["factor"] = factor
    if attention_factor is not None:
        rope["attention_factor"] = attention_factor
    _check_inv_freq(_hf_rope(rope, head_dim, 8192), dim, seq_len)


@pytest.mark.oracle
@settings(max_examples=40, deadline=None)
@given(head_dim=HEAD_DIMS, partial=PARTIAL, theta=st.sampled_from([1e4, 5e5, 1e6, 1e7]),
       factor=st.sampled_from([8.0, 16.0, 32.0]) | st.floats(1.0, 32.0), low=st.sampled_from([0.5, 1.0, 2.0]),
       high=st.sampled_from([4.0, 8.0]), original=st.sampled_from([64, 256, 1024, 8192, 32768]))
def test_oracle_llama3_inv_freq(head_dim, partial, theta, factor, low, high, original):
    """The smoothing (old_len / wavelen - low) / (high - low) cancels near 0 and amplifies one-ulp differences by
    up to (factor - 1) * low / (high - low); parameters span the released Llama 3.x settings."""
    pytest.importorskip("torch")
    rope = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": original, "partial_rotary_factor": partial}
    _check_inv_freq(_hf_rope(rope, head_dim, 131072), int(head_dim * partial))


@pytest.mark.oracle
@pytest.mark.parametrize("factor", [8.0, 16.0, 32.0])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_oracle_llama3_released_settings_within_one_ulp(factor, head_dim):
    """Llama 3.1 / 3.2 settings (low 1, high 4, original 8192, theta 5e5): within 1 ulp of transformers, which
    evaluates 2*pi / inv_freq and old_len / wavelen as reciprocal-then-multiply (a plain division is up to 10 ulps off
    at head_dim 256, factor 32)."""
    pytest.importorskip("torch")
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = _hf_rope(rope, head_dim, 131072)
    hf_inv, _ = _hf_init(config)
    inv, _ = inv_freq_and_scaling(config.rope_parameters, head_dim, 131072)
    assert np.max(np.abs(inv.view(np.int32) - hf_inv.view(np.int32))) <= 1


@pytest.mark.oracle
@pytest.mark.parametrize("config_cls,head_dim", [("Qwen3NextConfig", 256), ("Qwen3_5TextConfig", 256),
                                                 ("Qwen3_5TextConfig", 128)])
def test_oracle_partial_rotary_default_inv_freq(config_cls, head_dim):
    """Qwen3-Next / Qwen3.5 default partial_rotary_factor 0.25: 1/base^(2i/rot) with rot = int(D * 0.25)."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding
    config = getattr(transformers, config_cls)(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=head_dim)
    rotary = {"Qwen3NextConfig": Qwen3NextRotaryEmbedding, "Qwen3_5TextConfig": Qwen3_5TextRotaryEmbedding}
    emb = rotary[config_cls](config)
    rot = int(head_dim * config.rope_parameters["partial_rotary_factor"])
    assert rot == head_dim // 4
    inv, scaling = inv_freq_and_scaling(config.rope_parameters, rot, config.max_position_embeddings)
    np.testing.assert_allclose(inv, emb.inv_freq.numpy(), rtol=1e-6, atol=0)
    assert scaling == emb.attention_scaling


@pytest.mark.oracle
@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 1e6},
    {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
], ids=lambda r: r["rope_type"])
def test_oracle_rope_tables_at_large_positions(rope):
    """Given transformers' inv_freq, cos/sin [B, T, rot/2] equal the first half of Qwen3RotaryEmbedding's tables (whose
    halves are identical) to float32 rounding of the result, at positions up to 45000 (dynamic grows past 40960)."""
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    config = _hf_rope(rope, 128, 40960)
    emb = Qwen3RotaryEmbedding(config)
    positions = np.stack([np.arange(0, 45_000, 7), np.arange(45_000, 0, -7) - 1])
    hf_cos, hf_sin = (t.numpy() for t in emb(torch.zeros(1), torch.from_numpy(positions)))
    assert np.array_equal(hf_cos[..., :64], hf_cos[..., 64:]) and np.array_equal(hf_sin[..., :64], hf_sin[..., 64:])
    inv, scaling = inv_freq_and_scaling(config.rope_parameters, 128, 40960, int(positions.max()) + 1)
    assert scaling == emb.attention_scaling
    np.testing.assert_allclose(inv, emb.inv_freq.numpy(), rtol=1e-6, atol=0)
    cos, sin = rope_tables(positions, emb.inv_freq.numpy(), scaling)
    assert cos.dtype == np.float32 and cos.shape == (2, positions.shape[1], 64)
    ulp = np.float32(scaling) * 2.0**-23  # one ulp of the largest value, |cos| <= scaling
    assert np.max(np.abs(cos - hf_cos[..., :64])) <= 2 * ulp
    assert np.max(np.abs(sin - hf_sin[..., :64])) <= 2 * ulp


@pytest.mark.oracle
@pytest.mark.parametrize("partial", [1.0, 0.5, 0.25])
def test_oracle_apply_rope_equals_apply_rotary_pos_emb(partial):
    """x [B, T, H, D] against transformers' apply_rotary_pos_emb with duplicated tables (unsqueeze_dim=2): Qwen3's
    (full rotary) and Qwen3-Next's (partial: rotates cos.shape[-1] channels, passes the rest)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb as qwen3_apply
    from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb as next_apply
    rng = np.random.default_rng(0)
    B, T, Hq, Hkv, D = 2, 7, 4, 2, 64
    rot = int(D * partial)
    q = rng.standard_normal((B, T, Hq, D)).astype(np.float32)
    k = rng.standard_normal((B, T, Hkv, D)).astype(np.float32)
    cos, sin = rope_tables(rng.integers(0, 40_000, (B, T)), default_inv_freq(1e6, rot), 1.1)
    full = lambda t: torch.from_numpy(np.concatenate([t, t], axis=-1))  # noqa: E731
    hf = qwen3_apply if partial == 1.0 else next_apply
    hq, hk = hf(torch.from_numpy(q), torch.from_numpy(k), full(cos), full(sin), unsqueeze_dim=2)
    for mine, theirs in ((apply_rope(q, cos, sin), hq.numpy()), (apply_rope(k, cos, sin), hk.numpy())):
        assert mine.dtype == np.float32
        np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.oracle
@pytest.mark.parametrize("section", [[11, 11, 10], [6, 5, 5], [2, 8, 6]])
def test_oracle_mrope_equals_qwen3_5_text_rotary_embedding(section):
    """3-D positions [3, B, T] (T, H, W) against Qwen3_5TextRotaryEmbedding's recomposed tables (first half)."""
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
    rot_half = sum(section)
    config = _hf_rope({"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                       "mrope_section": section, "mrope_interleaved": True}, 8 * rot_half, 4096,
                      config_cls="Qwen3_5TextConfig")
    emb = Qwen3_5TextRotaryEmbedding(config)
    thw = np.random.default_rng(1).integers(0, 4000, (3, 2, 9))
    hf_cos, hf_sin = (t.numpy() for t in emb(torch.zeros(1), torch.from_numpy(thw)))
    inv, scaling = inv_freq_and_scaling(config.rope_parameters, 2 * rot_half, 4096)
    np.testing.assert_allclose(inv, emb.inv_freq.numpy(), rtol=1e-6, atol=0)
    cos, sin = mrope_interleaved_tables(thw, emb.inv_freq.numpy(), section, scaling)
    assert np.max(np.abs(cos - hf_cos[..., :rot_half])) <= 2 * 2.0**-23
    assert np.max(np.abs(sin - hf_sin[..., :rot_half])) <= 2 * 2.0**-23
