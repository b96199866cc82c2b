"""Quantisation arithmetic against hand-computed examples: QNN (q + offset) * scale with offset <= 0, ONNX
(q - zero_point) * scale with round-half-to-even and saturation; per tensor, per channel, per block (including
a short last block), LPBQ, and int4 packing (first value in the low nibble)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.errors import InputError
from refimpl.kernels import quant


def test_qnn_per_tensor_4bit_hand_computed():
    # scale 0.5, offset -3: the grid is (q - 3) * 0.5 for q in 0..15, i.e. -1.5 .. 6.0, with 0.0 at q = 3
    x = np.array([1.2, 1.25, 1.75, 0.0, -5.0, 100.0, -1.5])
    q = quant.qnn_quantize(x, 0.5, -3, 4)
    # 1.2/0.5 = 2.4 -> 2; 2.5 -> 2 and 3.5 -> 4 (half to even); 0 -> 0; -10 and 200 saturate
    np.testing.assert_array_equal(q, [5, 5, 7, 3, 0, 15, 0])
    np.testing.assert_array_equal(quant.qnn_dequantize(q, 0.5, -3), [1.0, 1.0, 2.0, 0.0, -1.5, 6.0, -1.5])


def test_qnn_signed_codes_clip_to_the_signed_range():
    x = np.array([-3.0, -0.26, 0.9, 10.0])
    q = quant.qnn_quantize(x, 0.25, 0, 4, signed=True)       # -12 -> -8, -1.04 -> -1, 3.6 -> 4, 40 -> 7
    np.testing.assert_array_equal(q, [-8, -1, 4, 7])
    np.testing.assert_array_equal(quant.qnn_dequantize(q, 0.25, 0), [-2.0, -0.25, 1.0, 1.75])


def test_fake_quant_is_dequantize_of_quantize():
    x = np.array([[0.3, -0.3, 3.0, -3.0, 0.7]])
    # 0.6 -> 1, -0.6 -> -1, 6, -6 + 3 = -3 clips to code 0 (-1.5), 1.4 -> 1
    np.testing.assert_array_equal(quant.qnn_fake_quant(x, 0.5, -3, 4), [[0.5, -0.5, 3.0, -1.5, 0.5]])
    np.testing.assert_array_equal(quant.onnx_fake_quant(x, [[0.25, 1.0, 0.5]], [[0, 1, -1]], "int8", axis=1,
                                                        block_size=2), [[0.25, -0.25, 3.0, -3.0, 0.5]])


def test_onnx_int4_hand_computed_saturates_to_signed_range():
    x = np.array([1.25, -5.0, -6.0, 3.0, 0.0])
    q = quant.onnx_quantize(x, 0.5, 2, "int4")
    # 2.5 -> 2 (+2 = 4); -10 + 2 = -8; -12 + 2 = -10 -> -8; 6 + 2 = 8 -> 7; 0 + 2 = 2
    np.testing.assert_array_equal(q, [4, -8, -8, 7, 2])
    np.testing.assert_array_equal(quant.onnx_dequantize(q, 0.5, 2), [1.0, -5.0, -5.0, 2.5, 0.0])
    np.testing.assert_array_equal(quant.onnx_quantize(np.array([-1.0, 20.0]), 0.5, 2, "uint4"), [0, 15])


def test_qnn_offset_is_the_negative_onnx_zero_point():
    """The sign trap (spec §8.1): QNN offset -128 is ONNX uint8 zero point 128."""
    x = np.linspace(-2, 2, 41)
    q_qnn, q_onnx = quant.qnn_quantize(x, 1 / 64, -128, 8), quant.onnx_quantize(x, 1 / 64, 128, "uint8")
    np.testing.assert_array_equal(q_qnn, q_onnx)
    np.testing.assert_array_equal(quant.qnn_dequantize(q_qnn, 1 / 64, -128), quant.onnx_dequantize(q_onnx, 1 / 64, 128))


def test_per_channel_hand_computed():
    x = np.array([[1.0, -1.0, 0.3], [1.0, -1.0, 0.3]])
    scale, offset = np.array([0.5, 0.25]), np.array([-2, -4])   # axis 0: one encoding per row
    q = quant.qnn_quantize(x, scale, offset, 4, axis=0)
    # row 0: 2, -2, 0.6 -> 1 (+2): 4, 0, 3;  row 1: 4, -4, 1.2 -> 1 (+4): 8, 0, 5
    np.testing.assert_array_equal(q, [[4, 0, 3], [8, 0, 5]])
    np.testing.assert_array_equal(quant.qnn_dequantize(q, scale, offset, axis=0), [[1.0, -1.0, 0.5], [1.0, -1.0, 0.25]])
    # the same along axis 1 (per column)
    qc = quant.onnx_quantize(x.T, scale, -offset - 8, "int4", axis=1)   # zp = 4 - 8, ... : same grid, signed
    np.testing.assert_array_equal(quant.onnx_dequantize(qc, scale, -offset - 8, axis=1), [[1.0, 1.0], [-1.0, -1.0],
                                                                                         [0.5, 0.25]])


def test_blocks_not_dividing_the_row():
    """5 columns in blocks of 2: blocks {0,1}, {2,3}, {4} (short); scale [rows, 3]."""
    x = np.array([[0.3, -0.3, 3.0, -3.0, 0.7]])
    scale = np.array([[0.25, 1.0, 0.5]])
    zp = np.array([[0, 1, -1]])
    q = quant.onnx_quantize(x, scale, zp, "int8", axis=1, block_size=2)
    # 1.2 -> 1, -1.2 -> -1;  3 + 1 = 4, -3 + 1 = -2;  1.4 -> 1, -1 = 0
    np.testing.assert_array_equal(q, [[1, -1, 4, -2, 0]])
    np.testing.assert_array_equal(quant.onnx_dequantize(q, scale, zp, axis=1, block_size=2),
                                  [[0.25, -0.25, 3.0, -3.0, 0.5]])
    with pytest.raises(InputError, match=r"block parameters must have shape \[1, 3\]"):
        quant.onnx_quantize(x, np.ones((1, 2)), 0, "int8", axis=1, block_size=2)


def test_lpbq_is_a_channel_scale_times_integer_block_scales():
    q = np.array([[9, 10, 9, 10, 12]])          # offset -8: q + offset = 1, 2, 1, 2, 4
    x = quant.lpbq_dequantize(q, [0.5], [[1, 2, 4]], -8, block_size=2)
    np.testing.assert_array_equal(x, [[0.5, 1.0, 1.0, 2.0, 8.0]])


def test_qnn_encoding_from_range_includes_zero_exactly():
    scale, offset = quant.qnn_encoding_from_range(-1.0, 2.0, 8)
    assert scale == np.float32(3 / 255) and offset == -85
    assert quant.qnn_dequantize(quant.qnn_quantize(np.array([0.0]), scale, offset, 8), scale, offset)[0] == 0.0
    # an all-positive range is widened down to 0 (offset 0); a zero range to 1e-4
    assert quant.qnn_encoding_from_range(0.5, 2.0, 8)[1] == 0
    assert quant.qnn_encoding_from_range(0.0, 0.0, 8)[0] == np.float32(1e-4 / 255)


def test_onnx_params_from_range_asymmetric():
    scale, zp = quant.onnx_params_from_range(np.array([-1.0]), np.array([3.0]), "int8")
    assert scale[0] == np.float32(4 / 255) and zp[0] == -128 + 64   # round(-1 / (4/255)) = round(-63.75) = -64
    q = quant.onnx_quantize(np.array([-1.0, 0.0, 3.0]), scale[0], zp[0], "int8")
    np.testing.assert_array_equal(q, [-128, -64, 127])


def test_int4_packing_first_value_in_the_low_nibble():
    np.testing.assert_array_equal(quant.pack_int4(np.array([1, 2, 3])), np.array([0x21, 0x03], np.uint8))
    packed = quant.pack_int4(np.array([[-1, 7, -8], [0, -2, 5]]))   # nibbles F 7 8 / 0 E 5, odd rows padded
    np.testing.assert_array_equal(packed, np.array([[0x7F, 0x08], [0xE0, 0x05]], np.uint8))
    np.testing.assert_array_equal(quant.unpack_int4(packed, 3, signed=True), [[-1, 7, -8], [0, -2, 5]])
    np.testing.assert_array_equal(quant.unpack_int4(packed, 3, signed=False), [[15, 7, 8], [0, 14, 5]])


def test_int4_pack_unpack_round_trip_all_codes():
    q = np.arange(-8, 8).reshape(2, 8)
    np.testing.assert_array_equal(quant.unpack_int4(quant.pack_int4(q), 8, signed=True), q)
    u = np.arange(16)[::-1].reshape(1, 16)
    np.testing.assert_array_equal(quant.unpack_int4(quant.pack_int4(u), 16, signed=False), u)
    with pytest.raises(InputError, match="int4 codes"):
        quant.pack_int4(np.array([16]))
    with pytest.raises(InputError, match="need 2 bytes"):
        quant.unpack_int4(np.zeros((1, 3), np.uint8), 4, signed=True)


# --- properties -----------------------------------------------------------------------------------------------


@st.composite
def blocked(draw):
    """(x [rows, n], block size or None, bits, seed-derived ranges)"""
    rows, n = draw(st.integers(1, 4)), draw(st.integers(1, 40))
    block = draw(st.one_of(st.none(), st.integers(1, 16)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = (rng.normal(size=(rows, n)) * draw(st.sampled_from([1e-3, 1.0, 1e2])) + draw(st.sampled_from([0.0, 0.5]))
         ).astype(np.float32)
    return x, block, draw(st.sampled_from([4, 8]))


@settings(max_examples=60, deadline=None)
@given(case=blocked())
def test_fake_quant_from_the_own_range_is_within_half_a_step_and_idempotent(case):
    x, block, bits = case
    lo, hi = quant.block_range(x, block)
    kw = {"axis": 0} if block is None else {"axis": 1, "block_size": block}
    scale, offset = quant.qnn_encoding_from_range(lo, hi, bits)
    y = quant.qnn_fake_quant(x, scale, offset, bits, **kw)
    step = quant.expand(scale, x.shape, **kw)
    assert np.all(np.abs(y - x) <= step * (0.5 + 1e-3) + 1e-7)          # the range covers x: no clipping
    np.testing.assert_array_equal(quant.qnn_fake_quant(y, scale, offset, bits, **kw), y)
    s, zp = quant.onnx_params_from_range(lo, hi, f"int{bits}")
    z = quant.onnx_fake_quant(x, s, zp, f"int{bits}", **kw)
    assert np.all(np.abs(z - x) <= quant.expand(s, x.shape, **kw) * (0.5 + 1e-3) + 1e-7)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 33), signed=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_int4_pack_unpack_round_trips(n, signed, seed):
    lo, hi = (-8, 7) if signed else (0, 15)
    q = np.random.default_rng(seed).integers(lo, hi + 1, size=(3, n))
    packed = quant.pack_int4(q)
    assert packed.shape == (3, (n + 1) // 2) and packed.dtype == np.uint8
    np.testing.assert_array_equal(quant.unpack_int4(packed, n, signed), q)


# ---------------------------------------------------------------- ggml blocks gguf-py lacks (layout checks; the
# bit-for-bit check against ggml's own dequantisation is tests/formats/test_gguf.py)

def _block(d: float, payload: list[int]) -> bytes:
    return np.float16(d).tobytes() + bytes(payload)


def test_q1_0_layout_hand_computed():
    """block_q1_0: f16 d, then bit j of the block = bit j % 8 of byte j // 8; set -> +d, clear -> -d."""
    payload = [0b00000101] + [0xFF] * 7 + [0] * 8          # values 0 and 2 set in byte 0; 8..63 set; 64..127 clear
    x = quant.dequantize_q1_0(np.frombuffer(_block(0.75, payload) + _block(-2.0, [0x80] * 16), np.uint8)[None])
    assert x.shape == (1, 256) and x.dtype == np.float32
    np.testing.assert_array_equal(x[0, :8], [0.75, -0.75, 0.75, -0.75, -0.75, -0.75, -0.75, -0.75])
    assert (x[0, 8:64] == 0.75).all() and (x[0, 64:128] == -0.75).all()
    np.testing.assert_array_equal(x[0, 128:136], [2.0] * 7 + [-2.0])   # second block: d = -2, only bit 7 set


def test_q2_0_layout_hand_computed():
    """block_q2_0: f16 d, then code j = bits 2(j % 4)..2(j % 4)+1 of byte j // 4; x = (code - 1) * d."""
    payload = [0b11100100] + [0b01010101] * 15             # codes 0, 1, 2, 3, then all 1 (zero)
    x = quant.dequantize_q2_0(np.frombuffer(_block(1.5, payload) * 2, np.uint8).reshape(2, 18))
    assert x.shape == (2, 64) and x.dtype == np.float32
    np.testing.assert_array_equal(x[:, :4], [[-1.5, 0.0, 1.5, 3.0]] * 2)
    assert (x[:, 4:] == 0).all()
