"""The HTP's quantised (uint16 activation) arithmetic, as measured on Qualcomm's HTP simulator (QNN 2.51, HTP v75,
onnxruntime-qnn 2.7; docs/htp.md §9 "The HTP's quantised arithmetic"; tests/e2e/test_quantised_htp.py checks each
model against the simulator on one-op QDQ graphs with controlled codes).

Codes in, codes out: an op of a QDQ graph takes its inputs' integer codes q_i with their encodings (scale s_i, zero
point z_i: x_i = (q_i - z_i) s_i) and gives its output's codes in the output encoding (s_o, z_o). ONNX Runtime's CPU
EP computes the op in float32 on the dequantised inputs and quantises (round half to even); the HTP computes on the
codes in fixed point. Symbols: n_i = q_i - z_i (the inputs' signed integer steps).

Add (measured: 100 % of codes identical on sweeps of random codes over ten pairs of input / output encodings, 99.98 %
on one, max 1 code; scale ratios 0.09 to 2):

    r_i = s_i / s_o                                     each input's rescale
    k   = the largest k <= 15 with round(max_i r_i 2^k) <= 2^15 - 1     one shift for both: int16 multipliers
    m_i = round(r_i 2^k)                                fixed-point multipliers, Q(k)
    q_o = clip(floor((m_a n_a + m_b n_b) / 2^k + 1/2) + z_o, 0, 2^16 - 1)     rounded half up (towards +inf)

    so a tie (the sum of two inputs of the output's scale, halved) rounds up where ONNX rounds to even (a quarter of
    the codes of an Add of two equal scales into their doubled one: the CPU EP's 76 % identical), a ratio at or
    over 1 (a residual add whose output range is the stream's own) halves both multipliers' precision, and an
    input whose scale is under 2^-16 of the output's (a tiny eps) contributes nothing.

Not modelled here (measured, docs/htp.md): Mul (its multiplier quantised at 2^-34 and rounded half up with a bias
of 0.01-0.05 code that depends on the zero points: the exact product rounded half up is within one code, as the CPU
EP), Sqrt (x * r(x), r a piecewise-constant reciprocal square root of ~9 bits whose segments are not located yet:
tens of codes), Div, Softmax, MatMul (a few codes per product term, not located).
"""

import numpy as np

ADD_MULTIPLIER_BITS = 15          # Add's input rescales s_i / s_o: int16 fixed-point multipliers, at most Q15
UINT16 = (0, 65535)               # the activations' codes


def multiplier(ratio: float, bits: int) -> int:
    """A scale ratio as the HTP's fixed-point multiplier: round(ratio * 2^bits) (ratio in float64)."""
    return int(np.rint(np.float64(ratio) * 2.0 ** bits))


def multiplier_shift(ratios, bits: int) -> int:
    """The largest shift k <= bits at which every ratio's multiplier round(r 2^k) fits a signed (bits + 1)-bit
    integer: the shift the HTP's multipliers share."""
    k = bits
    while k > 0 and max(multiplier(abs(r), k) for r in ratios) > 2 ** bits - 1:
        k -= 1
    return k


def round_half_up_shift(v: np.ndarray, bits: int) -> np.ndarray:
    """floor(v / 2^bits + 1/2) of int64 v: the HTP's requantising right shift (ties towards +inf)."""
    return (v + (np.int64(1) << (bits - 1))) >> bits if bits > 0 else v


def add(qa, a: tuple, qb, b: tuple, out: tuple, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's quantised Add.  qa, qb: codes (broadcastable); a, b, out: (scale, zero point) of each, per tensor.
    -> int64 codes of the output, broadcast shape."""
    (sa, za), (sb, zb), (so, zo) = a, b, out
    ra = np.float64(np.float32(sa)) / np.float64(np.float32(so))                  # r_a = s_a / s_o
    rb = np.float64(np.float32(sb)) / np.float64(np.float32(so))                  # r_b = s_b / s_o
    k = multiplier_shift((ra, rb), ADD_MULTIPLIER_BITS)                           # the shared shift
    ma, mb = multiplier(ra, k), multiplier(rb, k)                                  # m_i = round(r_i 2^k)
    na = np.asarray(qa, np.int64) - np.int64(za)                                   # n_a = q_a - z_a
    nb = np.asarray(qb, np.int64) - np.int64(zb)                                   # n_b = q_b - z_b
    acc = np.int64(ma) * na + np.int64(mb) * nb                                    # m_a n_a + m_b n_b   (Q(k))
    return np.clip(round_half_up_shift(acc, k) + np.int64(zo), *qrange)            # q_o, saturated
