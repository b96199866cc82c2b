"""Integer quantisation arithmetic in the two conventions device toolchains use (device_conventions.md §8).

QNN (QnnTypes.h):  q unsigned in [0, 2^bw - 1],   x = (q + offset) * scale,   offset <= 0 (= -zero_point)
                   q = clip(round(x / scale) - offset, 0, 2^bw - 1)
                   (signed: SFIXED_POINT, q in [-2^(bw-1), 2^(bw-1) - 1], offset 0 for symmetric encodings)
ONNX:              q signed or unsigned,           x = (q - zero_point) * scale
                   q = saturate(round(x / scale) + zero_point)   (QuantizeLinear)

round is round-half-to-even in both (ONNX specifies it; for QNN it is an assumption, as AIMET's torch.round).

AIMET QuantSim (aimet-torch 2.x, on CPU) computes the QNN codes in float32, in one of two ways (docs/numerics.md):
  per tensor / per channel (torch.fake_quantize_per_{tensor,channel}_affine, its inference path):
                   q = clip(round(x * fl(1 / scale)) - offset, qmin, qmax)     the reciprocal rounded first
  per block, LPBQ (its own QuantDequantFunc):
                   q = clip(round(fl(x / scale)) - offset, qmin, qmax)
                   the two differ by one code for ~1e-4 of the elements (a quotient within an ulp of k + 1/2).
aimet-onnx QuantSim (2.42, its C++ quantiser libpymo / the QcQuantizeOp of its ORT session, on CPU; measured:
docs/numerics.md, tests/test_onnx_quantisers.py), every granularity:
                   q = clip(round_half_away(fl32(fl32(x32 / s) - offset)), qmin, qmax)
                   a float32 quotient, the offset subtracted in float32 (rounding the sum once more above 2^24 / ulp),
                   ties rounded away from zero (std::round), not to even.
Granularity is given by the shape of scale / offset:
  per tensor:   scalars
  per channel:  1-D [x.shape[axis]], one per index along `axis`
  per block:    x's rank, with x.shape[axis] replaced by ceil(n / block_size) (ONNX blocked QuantizeLinear):
                element i along `axis` uses block i // block_size; the last block may be short.
Everything is computed in float64 and returned in float32 (dequantised) or int32 (integer codes); a dequantised
value is (q + offset) * scale evaluated once in float32, as a device's float32 dequantise does.
"""

import ml_dtypes
import numpy as np

from ..errors import InputError

ONNX_RANGES = {"int4": (-8, 7), "uint4": (0, 15), "int8": (-128, 127), "uint8": (0, 255),
               "int16": (-32768, 32767), "uint16": (0, 65535)}


def expand(p, shape: tuple, axis: int | None = None, block_size: int | None = None) -> np.ndarray:
    """Broadcast a scale / offset to x's shape.  scalar | [n_axis] | blocked (see module doc) -> shape."""
    p = np.asarray(p)
    if p.ndim == 0:
        return np.broadcast_to(p, shape)
    axis = axis % len(shape)
    n = shape[axis]
    if block_size is None:
        if p.shape != (n,):
            raise InputError(f"per-channel parameters must have shape [{n}] (axis {axis}), got {list(p.shape)}")
        return np.broadcast_to(p.reshape([n if a == axis else 1 for a in range(len(shape))]), shape)
    blocks = -(-n // block_size)
    want = tuple(blocks if a == axis else s for a, s in enumerate(shape))
    if p.shape != want:
        raise InputError(f"block parameters must have shape {list(want)} (block {block_size} on axis {axis}), "
                         f"got {list(p.shape)}")
    full = np.repeat(p, block_size, axis=axis)                     # [.., blocks * block_size, ..]
    return full if blocks * block_size == n else full.take(np.arange(n), axis=axis)   # the last block cut to n


def qnn_quantize(x, scale, offset, bitwidth: int, axis=None, block_size=None, signed: bool = False) -> np.ndarray:
    """q = clip(round_half_even(x / scale) - offset, 0, 2^bw - 1)  -> int32, x's shape;
    signed: clipped to [-2^(bw-1), 2^(bw-1) - 1] instead."""
    s, o = (expand(np.asarray(a, np.float64), x.shape, axis, block_size) for a in (scale, offset))
    q = np.rint(_divide(x, s)) - o
    lo, hi = (-2 ** (bitwidth - 1), 2 ** (bitwidth - 1) - 1) if signed else (0, 2 ** bitwidth - 1)
    return np.clip(q, lo, hi).astype(np.int32)


def qnn_dequantize(q, scale, offset, axis=None, block_size=None) -> np.ndarray:
    """x = (q + offset) * scale  -> float32, q's shape (offset is QNN's, <= 0)."""
    s, o = (expand(np.asarray(a, np.float32), q.shape, axis, block_size) for a in (scale, offset))
    return (np.asarray(q, np.float32) + o) * s


def onnx_quantize(x, scale, zero_point, dtype: str = "int8", axis=None, block_size=None) -> np.ndarray:
    """QuantizeLinear: q = saturate(round_half_even(x / scale) + zero_point) to dtype's range  -> int32."""
    if dtype not in ONNX_RANGES:
        raise InputError(f"ONNX quantised dtype must be one of {', '.join(ONNX_RANGES)}, got {dtype!r}")
    lo, hi = ONNX_RANGES[dtype]
    s, z = (expand(np.asarray(a, np.float64), x.shape, axis, block_size) for a in (scale, zero_point))
    return np.clip(np.rint(_divide(x, s)) + z, lo, hi).astype(np.int32)


def _divide(x, scale) -> np.ndarray:
    """x / scale in float32, as ONNX Runtime, the onnx reference and QNN divide (float32 scales): a float64
    quotient rounds differently at half-way codes (e.g. -0.43664998 / 0.0123 is -35.5 in float32, not -35.49...)."""
    return np.asarray(x, np.float32) / np.asarray(scale, np.float32)


def quantsim_quantize(x, scale, offset, qmin: int, qmax: int, axis=None, block_size=None) -> np.ndarray:
    """AIMET QuantSim's codes on CPU  -> int32, x's shape (offset is QNN's, <= 0; [qmin, qmax] the code range:
    [0, 2^bw - 1] unsigned, [-2^(bw-1), 2^(bw-1) - 1] signed).

    per tensor / per channel:  q = clip(round_half_even(x32 * fl32(1 / s)) - offset, qmin, qmax)
    per block:                 q = clip(round_half_even(fl32(x32 / s)) - offset, qmin, qmax)
    """
    x = np.asarray(x, np.float32)
    s = expand(np.asarray(scale, np.float32), x.shape, axis, block_size)
    o = expand(np.asarray(offset, np.float32), x.shape, axis, block_size)
    scaled = x / s if block_size is not None else x * (np.float32(1) / s)
    return np.clip(np.rint(scaled) - o, qmin, qmax).astype(np.int32)


def aimet_onnx_quantize(x, scale, offset, qmin: int, qmax: int, axis=None, block_size=None) -> np.ndarray:
    """aimet-onnx QuantSim's codes on CPU  -> int32, x's shape (offset QNN's; [qmin, qmax] the code range):
    q = clip(round_half_away(fl32(fl32(x32 / s) - offset)), qmin, qmax)."""
    x = np.asarray(x, np.float32)
    s = expand(np.asarray(scale, np.float32), x.shape, axis, block_size)
    o = expand(np.asarray(offset, np.float32), x.shape, axis, block_size)
    with np.errstate(invalid="ignore", over="ignore"):
        shifted = (x / s - o).astype(np.float64)                        # fl32(fl32(x / s) - offset), exact in f64
        q = np.sign(shifted) * np.floor(np.abs(shifted) + 0.5)          # ties away from zero
        return np.clip(np.nan_to_num(q, nan=qmin), qmin, qmax).astype(np.int32)


def onnx_codes(x, scale, offset, qmin: int, qmax: int, axis=None, block_size=None) -> np.ndarray:
    """QuantizeLinear with the QNN offset (= -zero_point) and the code range [qmin, qmax] of the quantised type:
    q = saturate(round_half_even(fl32(x32 / s)) - offset)  -> int32, x's shape (onnx_quantize's arithmetic; a NaN
    gives qmin, as ONNX Runtime's CPU EP does for every type: the ONNX spec leaves it open)."""
    s, o = (expand(np.asarray(a, np.float64), np.shape(x), axis, block_size) for a in (scale, offset))
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.rint(_divide(x, s)) - o
        return np.clip(np.where(np.isnan(q), qmin, q), qmin, qmax).astype(np.int32)   # NaN: qmin, as ORT's CPU EP


ARITHMETICS = {"aimet-torch": quantsim_quantize, "aimet-onnx": aimet_onnx_quantize, "onnx": onnx_codes}


def quantsim_fake_quant(x, scale, offset, qmin: int, qmax: int, axis=None, block_size=None) -> np.ndarray:
    """x -> (q + offset) * scale with q = quantsim_quantize(x): one float32 product, as torch's fake_quantize
    and AIMET's QuantDequantFunc dequantise  -> float32."""
    q = quantsim_quantize(x, scale, offset, qmin, qmax, axis, block_size)
    return qnn_dequantize(q, scale, offset, axis, block_size)


def float_fake_cast(x, dtype) -> np.ndarray:
    """AIMET's float quantiser of a 16-bit float encoding (scale 1): x clipped to +-finfo(dtype).max (it
    saturates), rounded to dtype (round-to-nearest-even) and back  -> x's dtype."""
    x = np.asarray(x)
    big = x.dtype.type(ml_dtypes.finfo(dtype).max)
    return np.clip(x, -big, big).astype(dtype).astype(x.dtype)


def onnx_dequantize(q, scale, zero_point, axis=None, block_size=None) -> np.ndarray:
    """DequantizeLinear: x = (q - zero_point) * scale  -> float32."""
    s, z = (expand(np.asarray(a, np.float32), q.shape, axis, block_size) for a in (scale, zero_point))
    return (np.asarray(q, np.float32) - z) * s


def qnn_fake_quant(x, scale, offset, bitwidth: int, axis=None, block_size=None, signed: bool = False) -> np.ndarray:
    """x -> qnn_dequantize(qnn_quantize(x)): the value on the device's grid nearest x (clipped to the range)."""
    q = qnn_quantize(x, scale, offset, bitwidth, axis, block_size, signed)
    return qnn_dequantize(q, scale, offset, axis, block_size)


def onnx_fake_quant(x, scale, zero_point, dtype: str = "int8", axis=None, block_size=None) -> np.ndarray:
    """x -> DequantizeLinear(QuantizeLinear(x))."""
    return onnx_dequantize(onnx_quantize(x, scale, zero_point, dtype, axis, block_size), scale, zero_point, axis,
                           block_size)


def qnn_encoding_from_range(lo, hi, bitwidth: int) -> tuple[np.ndarray, np.ndarray]:
    """QNN encoding of a range (arrays for per-channel / per-block ranges):
    the range is widened to include 0 and to at least 1e-4; scale = (max - min) / (2^bw - 1);
    offset = round(min / scale) (<= 0), so 0.0 is exactly representable ("nudged")."""
    lo = np.minimum(np.asarray(lo, np.float64), 0)
    hi = np.maximum(np.asarray(hi, np.float64), 0)
    hi = np.maximum(hi, lo + 1e-4)
    scale = (hi - lo) / (2 ** bitwidth - 1)
    return scale.astype(np.float32), np.rint(lo / scale).astype(np.int32)


def onnx_params_from_range(lo, hi, dtype: str = "int8") -> tuple[np.ndarray, np.ndarray]:
    """Asymmetric ONNX (scale, zero_point) of a range over dtype's integer range: the range is widened to
    include 0 (and to >= 1e-4); scale = (max - min) / (qmax - qmin); zero_point = qmin - round(min / scale)."""
    qmin, qmax = ONNX_RANGES[dtype]
    lo = np.minimum(np.asarray(lo, np.float64), 0)
    hi = np.maximum(np.maximum(np.asarray(hi, np.float64), 0), lo + 1e-4)
    scale = (hi - lo) / (qmax - qmin)
    return scale.astype(np.float32), np.clip(qmin - np.rint(lo / scale), qmin, qmax).astype(np.int32)


def block_range(x: np.ndarray, block_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(min, max) over the last axis (per channel: [..., 1] dropped) or over its blocks ([..., ceil(n/bs)])."""
    if block_size is None:
        return x.min(axis=-1), x.max(axis=-1)
    n = x.shape[-1]
    blocks = -(-n // block_size)
    pad = blocks * block_size - n
    shape = (*x.shape[:-1], blocks, block_size)
    if not pad:                                                     # whole blocks: no padded copies
        return x.reshape(shape).min(-1), x.reshape(shape).max(-1)
    lo = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=np.inf)
    hi = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=-np.inf)
    return lo.reshape(shape).min(-1), hi.reshape(shape).max(-1)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes along the last axis, two per byte, the FIRST value in the LOW nibble (QNN's order).

    q [..., n] int in [-8, 7] or [0, 15] -> uint8 [..., ceil(n/2)]; byte j = (q[2j] & 0xF) | (q[2j+1] & 0xF) << 4;
    an odd row is padded with a zero nibble. Signed codes are stored as two's-complement nibbles.
    """
    q = np.asarray(q)
    if q.size and (q.min() < -8 or q.max() > 15):
        raise InputError(f"int4 codes must lie in [-8, 15], got [{q.min()}, {q.max()}]")
    nib = (q.astype(np.int64) & 0xF).astype(np.uint8)
    if nib.shape[-1] % 2:
        nib = np.concatenate([nib, np.zeros((*nib.shape[:-1], 1), np.uint8)], axis=-1)
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray, n: int, signed: bool) -> np.ndarray:
    """Inverse of pack_int4.  uint8 [..., ceil(n/2)] -> int32 [..., n]; signed nibbles are sign-extended
    (nibble v >= 8 means v - 16), an assumption the QNN sources leave open (spec §8.1)."""
    packed = np.asarray(packed, np.uint8)
    if packed.shape[-1] != -(-n // 2):
        raise InputError(f"{n} int4 values need {-(-n // 2)} bytes per row, got {packed.shape[-1]}")
    nib = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)[..., :n].astype(np.int32)
    return np.where(nib >= 8, nib - 16, nib) if signed else nib


def lpbq_dequantize(q, channel_scale, block_scale, offset, block_size: int) -> np.ndarray:
    """QNN blockwise expansion (LPBQ): x = (q + offset) * (channel_scale[c] * block_scale[c, b]), a float
    per-channel scale times a small integer per-block scale.  q [C, n], channel_scale [C],
    block_scale [C, ceil(n / block_size)] (blocks along the input axis) -> float32 [C, n]."""
    s = np.asarray(channel_scale, np.float32)[:, None] * np.asarray(block_scale, np.float32)
    return qnn_dequantize(q, s, offset, axis=1, block_size=block_size)


# ---------------------------------------------------------------------------------------------------- ggml blocks
# ggml's block types gguf-py 0.19 cannot dequantise, from ggml's published layouts (ggml-common.h). A row of n values
# is n / block consecutive blocks; `d` is an IEEE half (little-endian), converted to float32 exactly, and every value
# is one float32 product of d and a small integer (exact here), as ggml's to_float computes it.

def _ggml_blocks(rows: np.ndarray, block_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [..., nb * block_bytes] -> (d float32 [..., nb, 1], the remaining bytes uint8 [..., nb, block_bytes - 2])
    of blocks that open with a half-precision scale d."""
    rows = np.asarray(rows, np.uint8)
    blocks = rows.reshape(*rows.shape[:-1], rows.shape[-1] // block_bytes, block_bytes)
    d = np.ascontiguousarray(blocks[..., :2]).view("<f2").astype(np.float32)
    return d, blocks[..., 2:]


def dequantize_q1_0(rows: np.ndarray) -> np.ndarray:
    """ggml Q1_0 (block_q1_0: f16 d, 16 bytes of signs; 128 values): bit j of the block is bit j % 8 of byte
    j // 8, and x_j = +d if it is set, -d if not.   uint8 [..., nb * 18] -> float32 [..., nb * 128]"""
    d, qs = _ggml_blocks(rows, 18)
    bits = np.unpackbits(qs, axis=-1, bitorder="little")                  # [..., nb, 128], bit j of the block
    x = np.where(bits.astype(bool), d, -d)
    return x.reshape(*x.shape[:-2], -1)


def dequantize_q2_0(rows: np.ndarray) -> np.ndarray:
    """ggml Q2_0 (block_q2_0: f16 d, 16 bytes of 2-bit codes; 64 values): code j is bits 2(j % 4) .. 2(j % 4) + 1
    of byte j // 4, and x_j = (code_j - 1) * d, i.e. one of -d, 0, d, 2d.
    uint8 [..., nb * 18] -> float32 [..., nb * 64]"""
    d, qs = _ggml_blocks(rows, 18)
    codes = (qs[..., :, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3      # [..., nb, 16, 4]: code 4*byte + k
    x = (codes.reshape(*codes.shape[:-2], 64).astype(np.float32) - np.float32(1)) * d
    return x.reshape(*x.shape[:-2], -1)
