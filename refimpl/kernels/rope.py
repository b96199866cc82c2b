"""Rotary position embedding: inverse frequencies for every rope type transformers supports for Qwen3,
cos/sin tables, and the half-split (NeoX, `rotate_half`) rotation with partial rotary.

Shapes: positions [B, T] (integers); inv_freq [rot/2]; tables [B, T, rot/2] (half width, as device graphs
take them); x [B, T, H, D] with rot <= D. Frequencies are formed in the table dtype (float32 in the default
mode, float64 in the oracle mode). In float32, base ** exponent and cos / sin are correctly rounded
(kernels/elementary.py), and constants derived from the configuration (YaRN's and LongRoPE's logarithms, ...)
are computed once at high precision and rounded to float64: the tables are the same bits on every platform.
"""

import math

import numpy as np

from . import elementary
from .activation import identity, unhooked


def _base_powers(base: float, dim: int, dtype) -> np.ndarray:
    """base ** (2i / dim) for i < dim/2: the exponent is formed in `dtype` as transformers forms it."""
    exponent = np.arange(0, dim, 2).astype(dtype) / dtype(dim)
    return elementary.power(base, exponent)


def default_inv_freq(base: float, dim: int, dtype=np.float32) -> np.ndarray:
    """inv_freq[i] = 1 / base^(2i/dim); dim is the rotary width (not head_dim under partial rotary)."""
    return dtype(1) / _base_powers(base, dim, dtype)


def _yarn(p: dict, dim: int, max_pos: int, dtype):
    base, factor = p["rope_theta"], p.get("factor")
    original = p["original_max_position_embeddings"]
    if factor is None:
        factor = max_pos / original

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * elementary.scalar(lambda mp: mp.log(scale)) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations):  # the dimension whose wavelength makes `rotations` turns over `original`
        return elementary.scalar(lambda mp: dim * mp.log(original / (rotations * 2 * mp.pi)) / (2 * mp.log(base)))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=dtype) - dtype(low)) / dtype(high - low), 0, 1)
    pos_freqs = _base_powers(base, dim, dtype)
    extrapolation, interpolation = dtype(1) / pos_freqs, dtype(1) / (dtype(factor) * pos_freqs)
    keep = dtype(1) - ramp  # 1: keep the original frequency (high frequencies), 0: interpolate
    return interpolation * (dtype(1) - keep) + extrapolation * keep, float(attention_factor)


def _llama3(p: dict, dim: int, dtype):
    inv_freq = default_inv_freq(p["rope_theta"], dim, dtype)
    factor, low_ff, high_ff = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    # transformers writes `2*pi / inv_freq` and `old_len / wavelen`; torch evaluates `scalar / t` as
    # `t.reciprocal() * scalar` (two roundings), and the smoothing amplifies the difference, so do the same.
    wavelen = (dtype(1) / inv_freq) * dtype(2 * math.pi)
    scaled = np.where(wavelen > old_len / low_ff, inv_freq / dtype(factor), inv_freq)
    smooth = ((dtype(1) / wavelen) * dtype(old_len) - dtype(low_ff)) / dtype(high_ff - low_ff)
    smoothed = (dtype(1) - smooth) * scaled / dtype(factor) + smooth * scaled
    medium = ~(wavelen < old_len / high_ff) & ~(wavelen > old_len / low_ff)
    return np.where(medium, smoothed, scaled).astype(dtype), 1.0


def _longrope(p: dict, dim: int, max_pos: int, seq_len, dtype):
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_pos / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else elementary.scalar(
            lambda mp: mp.sqrt(1 + mp.log(factor) / mp.log(original)))
    long = seq_len is not None and seq_len > original
    ext = np.asarray(p["long_factor"] if long else p["short_factor"], dtype=dtype)
    return dtype(1) / (ext * _base_powers(p["rope_theta"], dim, dtype)), float(attention_factor)


def _dynamic(p: dict, dim: int, max_pos: int, seq_len, dtype):
    if seq_len is None or seq_len <= max_pos:  # transformers keeps (or restores) its init-time default frequencies
        return default_inv_freq(p["rope_theta"], dim, dtype), 1.0
    # As the model's update forms it from the tensor seq_len: factor*s/max_pos in the table dtype, minus
    # (factor - 1) rounded once from float64, raised to dim/(dim-2) in float64 and rounded once.
    factor = dtype(p["factor"])
    x = factor * dtype(seq_len) / dtype(max_pos) - dtype(p["factor"] - 1)
    growth = dtype(elementary.scalar(lambda mp: mp.mpf(float(x)) ** (dim / (dim - 2))))
    return default_inv_freq(dtype(p["rope_theta"]) * growth, dim, dtype), 1.0


def inv_freq_and_scaling(rope: dict, dim: int, max_position_embeddings: int, seq_len: int | None = None,
                         dtype=np.float32) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dim/2] and the attention scaling that multiplies both cos and sin.

    rope: transformers' standardised `rope_parameters` (rope_type, rope_theta, factor, ...).
    seq_len: max(position) + 1 of the current call; only `dynamic` and `longrope` depend on it. (transformers'
    dynamic module is stateful: pass the largest length it holds, as models/model.py does.)
    """
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return default_inv_freq(rope["rope_theta"], dim, dtype), 1.0
    if kind == "linear":
        return default_inv_freq(rope["rope_theta"], dim, dtype) / dtype(rope["factor"]), 1.0
    if kind == "dynamic":
        return _dynamic(rope, dim, max_position_embeddings, seq_len, dtype)
    if kind == "yarn":
        return _yarn(rope, dim, max_position_embeddings, dtype)
    if kind == "llama3":
        return _llama3(rope, dim, dtype)
    if kind == "longrope":
        return _longrope(rope, dim, max_position_embeddings, seq_len, dtype)
    raise ValueError(f"unknown rope_type {kind!r}")


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray, attention_scaling: float = 1.0):
    """Half-width cos/sin tables.  positions [B, T] -> cos, sin [B, T, rot/2] in inv_freq's dtype.

    freqs = p * inv_freq (in the table dtype); cos = cos(freqs) * scaling. transformers duplicates the table to
    width rot (`cat(freqs, freqs)`); the half is all the information, and is what device graphs take.
    cos/sin are correctly rounded (float32) or NumPy's (float64).
    """
    dtype = inv_freq.dtype.type
    freqs = positions.astype(dtype)[..., None] * inv_freq  # [B, T, rot/2]
    cos = elementary.cos(freqs) * dtype(attention_scaling)
    sin = elementary.sin(freqs) * dtype(attention_scaling)
    return cos, sin



def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, rnd=identity, at=unhooked) -> np.ndarray:
    """Half-split rotation of the first rot channels of every head; channels rot..D pass through.

    x [B, T, H, D], cos/sin [B, T, rot/2] (broadcast over heads), h = rot/2:
      y[:h]    = x[:h] * cos - x[h:rot] * sin
      y[h:rot] = x[h:rot] * cos + x[:h] * sin      (= x*cos + rotate_half(x)*sin with duplicated tables)
      y[rot:]  = x[rot:]
    computed as the right-hand form over the rot channels (the same values: x1 c + (-x2) s is x1 c - x2 s), so that
    its sub-op points are tensors a device graph has: cos, sin (the tables as read), x*cos, x1, x2, -x2,
    rotate_half, rotate_half*sin, and with partial rotary rot / pass (the channels rotated / passed through) and the
    sum before the pass-through channels join it.
    rnd rounds each product and each sum, as transformers' elementwise ops do in bf16 / fp16 (identity default).
    """
    h = cos.shape[-1]
    c, s = at("cos", cos)[:, :, None, :], at("sin", sin)[:, :, None, :]          # [B, T, 1, h]
    c, s = np.concatenate([c, c], axis=-1), np.concatenate([s, s], axis=-1)      # [B, T, 1, rot]: cat(t, t)
    at.operand("cos", c), at.operand("sin", s)                                   # the Muls read them so
    xr, rest = x[..., :2 * h], x[..., 2 * h:]
    if rest.shape[-1]:
        xr, rest = at("rot", xr), at("pass", rest)                               # x[:rot], x[rot:]
    x1, x2 = at("x1", xr[..., :h]), at("x2", xr[..., h:])                         # halves of the rotated channels
    xc = at("x*cos", rnd(xr * c))                                                # x cos
    half = at("rotate_half", np.concatenate([at("-x2", -x2), x1], axis=-1))      # rotate_half(x) = [-x2 | x1]
    y = rnd(xc + at("rotate_half*sin", rnd(half * s)))                           # x cos + rotate_half(x) sin
    if rest.shape[-1]:
        y = np.concatenate([at("sum", y), rest], axis=-1)                        # [y | x[rot:]]
    return y.astype(x.dtype, copy=False)


def interleaved_mrope_axes(n_pairs: int, mrope_section, llama_cpp: bool = False) -> np.ndarray:
    """The position axis each rotary pair j rotates with under Qwen3.5's interleaved M-RoPE: 0 T, 1 H, 2 W, 3 E.

    transformers (apply_interleaved_mrope):  H if j % 3 == 1 and j < 3*s[1];  W if j % 3 == 2 and j < 3*s[2];  else T.
    llama.cpp (ggml's IMROPE; s may have a fourth entry, else 0):  sector = j mod (s[0] + s[1] + s[2] + s[3]);
        H if sector % 3 == 1 and sector < 3*s[1];  W if % 3 == 2 and < 3*s[2];  T if % 3 == 0 and < 3*s[0];
        else E, its fourth axis (position 0 for text).
    They differ only where the sections leave pairs uncovered (transformers: T; llama.cpp: E, or a repeat).
    """
    s = [int(v) for v in mrope_section] + [0] * (4 - len(mrope_section))
    j = np.arange(n_pairs)
    if llama_cpp:
        j = j % max(sum(s), 1)
    axes = np.full(n_pairs, 3 if llama_cpp else 0)
    if llama_cpp:
        axes[(j % 3 == 0) & (j < 3 * s[0])] = 0
    axes[(j % 3 == 1) & (j < 3 * s[1])] = 1
    axes[(j % 3 == 2) & (j < 3 * s[2])] = 2
    return axes


def mrope_tables(positions: np.ndarray, inv_freq: np.ndarray, pair_axes, attention_scaling=1.0):
    """M-RoPE tables: pair j rotates with the positions of axis pair_axes[j].
    positions [A, B, T] (one row per axis) -> cos, sin [B, T, rot/2]; each pair bit-identical to rope_tables of
    its axis' positions."""
    j = np.arange(inv_freq.shape[0])
    axes = np.asarray(pair_axes)
    cos_sin = [rope_tables(positions[a], inv_freq, attention_scaling) for a in range(positions.shape[0])]
    cos = np.stack([cs[0] for cs in cos_sin])[axes, :, :, j].transpose(1, 2, 0)
    sin = np.stack([cs[1] for cs in cos_sin])[axes, :, :, j].transpose(1, 2, 0)
    return cos, sin


def mrope_interleaved_tables(positions_thw: np.ndarray, inv_freq: np.ndarray, mrope_section, attention_scaling=1.0):
    """Qwen3.5's interleaved multimodal RoPE as transformers computes it: frequency slot j takes its angle from axis
    H if j % 3 == 1 and j < 3*section[1], from axis W if j % 3 == 2 and j < 3*section[2], else from axis T
    (interleaved_mrope_axes).

    positions_thw [3, B, T] -> cos, sin [B, T, rot/2]. For text, all three rows hold the same positions, so
    every slot reads the same angle and this is exactly `rope_tables(positions, ...)`.
    """
    axes = interleaved_mrope_axes(inv_freq.shape[0], mrope_section)
    return mrope_tables(positions_thw, inv_freq, axes, attention_scaling)
