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

Sqrt (measured: 99.9 % of codes identical over every input code of six encodings, max 1 code; the CPU EP's exact
QuantizeLinear of the true root is 2 % identical there, 60-88 codes off): x * rsqrt(x) on the input's code,

    n    = q_x - z_x                                     the input's steps (x = n s_x; n <= 0 gives 0: for n < 0
                                                         the HTP gives ~60000, not modelled; no RMSNorm input)
    R(n) = the HTP's rsqrt of the integer n, 10 significant bits: k(m) 2^(j - 17), m = 4^j n in [2^14, 2^16),
           k(m) in [512, 1024] the device's table (RSQRT_THRESHOLDS: not the correctly rounded rsqrt: its rounding
           points sit up to 59 codes of m before those of round(m^-1/2 2^17), a sawtooth of an interpolated rsqrt)
    K    = s_x^(1/2) / s_o as a 15-bit mantissa (rounded)
    q_o  = clip(floor(n R(n) K + 1/2) + z_o, 0, 2^16 - 1)

    so every code is off the true root by up to half a step of R (a relative 2^-11: ~30 codes at the top of the
    range), the "Sqrt every code off by ~42" of the model's replay.

ReduceMean over the last axis (measured: 100 % of codes identical on the dense W8A16 model's 17 ReduceMeans on
their own inputs, 99.92-100 % on 18 sweeps of N = 32 / 64 random codes, max 1 code):

    r   = s_x / (N s_o)
    k   = the largest k with floor(r 2^k + 1/4) <= 2^15 - 1
    m   = floor(r 2^k + 1/4)                            an int16 multiplier, rounded up only from 3/4 of a step
    q_o = clip(floor(m sum_i n_i / 2^k + 1) + z_o, 0, 2^16 - 1)      a whole step added before the floor: the mean
                                                                    lands half a code above the rounded one

MatMul, uint16 activations x uint8 weights per tensor (measured: every code of the dense W8A16 model's 28
projections on their own inputs (were 12 of 28 whole with an exact multiplier and a 0.0025-code bias, median 99.9 %),
of 90 one-op sweeps over every activation code with K = 1 (16.6M codes, multipliers 0.03-3, zero points random;
16 with rescaled columns: 10.5M) and of the held-out one-op test sweeps of random codes, zero points 121 and 200, K 32
and 64): the weights' steps as int8, a column whose steps leave int8 (an asymmetric zero point and a weight at the far
end) rescaled by its own ratio r and its steps re-rounded (so its products carry the rounding of k / r: the "50-387
codes off" of the int8-only model), the activation's codes times the steps with the low 8 bits dropped, requantised
by a 22-bit mantissa of the float32 ratio:

    k_ij  = q_w,ij - z_w                                the weight steps
    r_j   = round(max(max_i k_ij / 127, -min_i k_ij / 128) 2^11) / 2^11    column j's rescale, Q11 (1: in int8)
    k'_ij = floor(k_ij round(2^16 / r_j) / 2^16 + 1/2)  the steps re-rounded by a Q16 reciprocal (k' = k: in int8)
    acc   = floor(sum_i q_a,i k'_ij / 2^8) - round(z_a sum_i k'_ij / 2^8)    the products, low 8 bits dropped;
                                                        the zero point's term rounded
    v_j   = 2^8 float32(float32(float32(s_a s_w) / s_o) r_j)     the multiplier in float32 (one rounding per operation)
    M_j   = round(v_j 2^(21 - e_j)), e_j = floor(log2 v_j)       a 22-bit mantissa, ties up (the float32's low 2 bits)
    q_o   = clip(floor(acc M_j 2^(e_j - 21) + 1/2 + M_j 2^-30) + z_o, 0, 2^16 - 1)   a bias of the mantissa / 2^9 code

    so the multiplier is off the exact ratio by up to 2^-22 relative (2.8 float32 ulps above it measured: the
    float32 chain and the 22-bit rounding), and every code carries a bias of 0.002-0.004 code (the "0.0025" of the
    previous model): found on K = 1 sweeps (y = floor(acc m + c) is exactly linear in acc per sweep; m on the grid
    of float32 numbers rounded to 22 bits, c - 1/2 = mantissa(m) / 512 inside the feasible window of each of 40).
    Refuted on the simulator (one-op graphs, out-of-int8 weights in a column): the step saturated to int8 or
    wrapped modulo 256 (a column holding only one step, -200 to 155, is exact: slope within 1e-5 of k), a
    requantisation of the whole tensor (columns in int8 stay exact beside a rescaled one), r from max |k| / 127
    (a column with -160 and +95 exact on the device, 0.5 % off so), k' rounded with the exact ratio (45-77 %
    identical) or by a float division (one tie differs), r rounded up (84-97 %); for the multiplier: the float64
    ratio, the ratio as s_a (s_w / s_o), (s_a / s_o) s_w or times float32(1 / s_o) (380-1,674 codes off in 7.6M),
    the 22-bit rounding before r's product or r inside the float32 chain (1,143-3,672 of 10.5M), 21 / 23 bits.

Mul, uint16 x uint16 (measured: 100 % of codes identical on 19 one-op sweeps (every code of one input against
13 of the other, random codes; multipliers 2^-22.6 to 2^-11, zero points 0 to 65535 on either input and the output)
and on 58 of the dense W8A16 model's 62 Muls on their own inputs (x^2, x * 1 / sqrt, * w, RoPE's products, the
scores' scaling, the MLP's product; the 4 SiLU products x * sigmoid(x) are the HTP's fused op, silu_product below)):

    M   = s_a s_b / s_o                                  in float32 (one rounding per operation)
    m   = round(M 2^34)                                  the multiplier, Q34 (ties to even)
    T   = 2 z_a' z_b' + z_a' + z_b',  z' = z - 2^15     the zero points as int16 (the codes moved by 2^15)
    c   = (T m mod 2^31) wrapped into [-2^30, 2^30)      a constant error of the zero points' term: within 1/16 code
    q_o = clip(floor(((q_a - z_a)(q_b - z_b) m - c + 2^33) / 2^34) + z_o, 0, 2^16 - 1)     rounded half up

    so the product is exact, its multiplier has 34 fractional bits (a relative 2^-12 at M = 2^-22), and every code
    carries the same bias -c 2^-34 (up to 1/16 code; with both zero points 0: the multiplier's low 15 bits, signed,
    times 2^-18): the HTP's rounding thresholds sit that far from the exact product's.

Div, uint16 / uint16 with a positive divisor (RMSNorm's x / sqrt(mean + eps); measured: 100 % of codes identical on
7 one-op sweeps, 2.2 million codes: every numerator code against 4-11 divisors, every divisor code against one
numerator, random codes of both, zero points 0-40000 on the numerator, 0 and 1000 on the divisor; the CPU EP 11-76 %):
the numerator's magnitude times a 15-bit K, rounded to 15 significant bits, times the HTP's 14-bit reciprocal of the
divisor's integer steps, rounded half up, sign-magnitude:

    n    = |q_a - z_a|, halved (floor) at n >= 2^15 (g = 1, else 0)   the numerator's magnitude, 15 bits
    k    = floor(log2 n)
    K    = s_a / (s_b s_o) = K_m 2^e_K, K_m a 15-bit integer (rounded half up)
    A    = floor(n K_m / 2^(k + 1) + 1/2)                  n K_m normalised to ~15 bits (K_m / 2 <= A <= K_m)
    R    = r 2^(e - 29) ~ 1 / n_b: n_b = q_b - z_b > 0 as m 2^-e, m in [2^15, 2^16); r = recip_mantissa(m >> 1):
           4 quadratic pieces per octave of m, evaluated in fixed point (RECIP_PIECES; 14 significant bits, within
           5.5e-4 of 2^29 / m: not the correctly rounded reciprocal; m's lowest bit is dropped)
    q_o  = clip(sign(q_a - z_a) floor(A r / 2^(28 - e - e_K - k - g) + 1/2) + z_o, 0, 2^16 - 1)

    so the quotient carries the reciprocal's error (-5.2e-4 to +5.4e-4 relative: up to ~18 codes at 2^15 steps)
    and the rounding of n K_m to 15 bits (half a step of A: 2^-15 relative), each rounding half up on the magnitude
    (symmetric about the zero point, where ONNX rounds the signed value to even). n_b <= 0 (a divisor at or below its
    zero point; no RMSNorm input) is not modelled: the quotient saturates.

Neg, the fused SiLU product, Sigmoid, the uint16 x uint16 MatMul, Softmax (a structural model, not code for code) and
RoPE's fused rotate_half: the sections at the end of this file.
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


SQRT_SCALE_BITS = 15              # Sqrt's requantisation s_x^(1/2) / s_o: a 15-bit mantissa
RSQRT_BITS = 17                   # R's table: k 2^-17 for m in [2^14, 2^16) (k in [512, 1024]: 10 significant bits)
# The HTP's rsqrt table, measured (QNN 2.51 HTP v75 simulator, one-op QDQ Sqrt over all 65536 input codes; the same
# points at two input scales): for k = 1023, 1022, ..., 512, the first m in [2^14, 2^16) whose R is k 2^-17, as its
# offset from the first m whose correctly rounded rsqrt is (ceil(((k + 1/2) 2^-17)^-2)); one m off the staircase
# (RSQRT_EXCEPTIONS).
RSQRT_OFFSETS = tuple(int(v) for v in """
    -12 -11 -9 -8 -6 -5 -4 -3 -3 -2 -2 -1 -1 0 -1 0 0 0 0 -1 -1 -2 -2 -3 -4 -4 -6 -6 -8 -9 -11 -15 -13 -11 -10
    -8 -7 -6 -5 -4 -3 -3 -2 -2 -1 -1 0 0 0 0 0 -1 -1 -2 -2 -3 -4 -5 -6 -1 -1 0 0 0 0 0 0 -1 -1 -2 -3 -4 -4 -5 -6
    -9 -10 -11 -13 -15 -17 -19 -22 -24 -26 -8 -6 -5 -4 -3 -2 -2 -1 -1 0 0 0 0 -1 -1 -2 -2 -3 -4 -5 -6 -8 -9 -1 0
    0 0 0 0 0 -1 -1 -2 -3 -5 -5 -7 -9 -10 -12 -14 -16 -18 -21 -24 -26 -13 -12 -9 -8 -6 -5 -3 -3 -2 -1 -1 0 0 0 0
    -1 -1 -2 -2 -4 -6 -5 -4 -2 -2 -1 -1 0 0 0 -1 0 -1 -2 -2 -4 -5 -7 -8 -3 -2 -1 -1 0 0 0 0 -1 -2 -2 -3 -5 -5 -7
    -10 -11 -14 -1 0 -1 0 0 -1 -1 -1 -3 -3 -4 -6 -8 -9 -12 -14 -17 0 0 0 0 0 -1 -1 -3 -3 -5 -7 -9 -11 -13 -16
    -19 -1 -1 0 0 0 -1 -1 -3 -4 -6 -8 -9 -11 -14 -17 -2 0 0 0 0 0 -1 -2 -3 -4 -6 -7 -10 -13 -5 -3 -2 -1 0 0 0 -1
    -1 -2 -3 -4 -6 -9 -9 -7 -5 -3 -2 -1 0 0 0 -1 -1 -2 -23 -19 -15 -12 -10 -8 -5 -3 -2 -1 -1 0 0 0 -1 -2 -4 -6
    -7 -10 -13 -16 -20 -23 -2 -1 0 0 0 0 -1 -2 -4 -6 -8 -15 -11 -9 -6 -4 -2 -1 -1 0 0 0 -2 -2 -5 -6 -9 -12 -16
    -19 -24 -28 -3 -2 0 0 0 0 -1 -2 -5 -19 -22 -18 -14 -11 -8 -5 -3 -2 -1 -1 0 0 -2 -3 -5 -8 -11 -15 -15 -12 -8
    -5 -3 -2 -1 0 0 -1 -2 -3 -6 -8 -12 -16 -21 -12 -9 -6 -4 -2 -1 0 0 -1 -2 -4 -7 -10 -13 -17 -18 -14 -10 -6 -4
    -2 -1 0 0 -1 -2 -4 -7 -10 -15 -27 -21 -16 -11 -7 -4 -2 0 0 0 -1 -2 -5 -7 -11 -16 -22 -28 -35 -43 -8 -5 -2 0
    0 0 -1 -3 -5 -9 -13 -18 -33 -25 -20 -14 -9 -5 -2 -1 0 0 -1 -2 -6 -10 -14 -20 -26 -29 -21 -16 -10 -6 -3 -1 -1
    0 -1 -4 -7 -10 -16 -22 -30 -33 -24 -18 -12 -7 -3 -1 0 0 -2 -3 -7 -12 -18 -59 -47 -37 -27 -20 -14 -8 -4 -1 0
    0 -1 -5 -8 -14 -20 -29 -38 -42 -32 -23 -16 -10 -5 -2 -1
""".split())
RSQRT_EXCEPTIONS = {21504: 894}


def _rsqrt_thresholds() -> np.ndarray:
    k = np.arange(1023, 511, -1, dtype=np.float64)                                  # k = 1023 .. 512
    ideal = np.ceil(((k + 0.5) * 2.0 ** -RSQRT_BITS) ** -2).astype(np.int64)       # round(m^-1/2 2^17) <= k from here
    return ideal + np.asarray(RSQRT_OFFSETS, np.int64)                               # the device's points


RSQRT_THRESHOLDS = _rsqrt_thresholds()


def rsqrt_mantissa(m: np.ndarray) -> np.ndarray:
    """k(m): the HTP's rsqrt of m in [2^14, 2^16) in units of 2^-17 (int64, 512..1024)."""
    k = 1024 - np.searchsorted(RSQRT_THRESHOLDS, m, side="right")                  # one step down at each point
    for at, value in RSQRT_EXCEPTIONS.items():
        k = np.where(m == at, value, k)
    return k


def mantissa(ratio: float, bits: int) -> float:
    """ratio rounded to a `bits`-bit mantissa (float64)."""
    e = np.floor(np.log2(ratio)) - bits + 1
    return float(np.rint(ratio / 2.0 ** e) * 2.0 ** e)


def sqrt(qx, x: tuple, out: tuple, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's quantised Sqrt.  qx: codes; x, out: (scale, zero point), per tensor.  -> int64 codes, qx's shape."""
    (sx, zx), (so, zo) = x, out
    n = np.maximum(np.asarray(qx, np.int64) - np.int64(zx), 0)                     # n = q_x - z_x (>= 0)
    j = np.zeros(n.shape, np.int64)                                                # m = 4^j n in [2^14, 2^16)
    m = np.where(n > 0, n, 1 << 14)
    while (small := m < 1 << 14).any():
        m, j = np.where(small, m * 4, m), j + small
    r = rsqrt_mantissa(m) * 2.0 ** (j - RSQRT_BITS)                                 # R(n) = k(m) 2^(j - 17)
    k = mantissa(np.sqrt(np.float64(np.float32(sx))) / np.float64(np.float32(so)), SQRT_SCALE_BITS)   # K
    y = np.floor(n * r * k + 0.5).astype(np.int64)                                 # floor(n R(n) K + 1/2)
    return np.clip(y + np.int64(zo), *qrange)                                      # q_o, saturated


MEAN_MULTIPLIER_BITS = 15         # ReduceMean's s_x / (N s_o): an int16 multiplier


def reduce_mean(qx, x: tuple, out: tuple, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's quantised ReduceMean over the last axis (keepdims).  qx: codes [..., N]; x, out: (scale, zero
    point), per tensor.  -> int64 codes [..., 1]."""
    (sx, zx), (so, zo) = x, out
    n = np.asarray(qx, np.int64) - np.int64(zx)                                    # n_i = q_i - z_x
    r = np.float64(np.float32(sx)) / (n.shape[-1] * np.float64(np.float32(so)))   # r = s_x / (N s_o)
    k = 62
    while np.floor(r * 2.0 ** k + 0.25) > 2 ** MEAN_MULTIPLIER_BITS - 1:           # the int16 multiplier's shift
        k -= 1
    m = np.int64(np.floor(r * 2.0 ** k + 0.25))                                    # m = floor(r 2^k + 1/4)
    acc = m * n.sum(axis=-1, keepdims=True)                                         # m sum_i n_i   (Q(k))
    return np.clip((acc >> k) + 1 + np.int64(zo), *qrange)                          # floor(acc / 2^k + 1) + z_o


MATMUL_DROPPED_BITS = 8           # MatMul's products summed, the low 8 bits dropped (floor; the zero point's rounded)
MATMUL_RATIO_BITS = 11            # a column's weight rescale r (its steps leave int8): Q11, rounded half up
MATMUL_RECIP_BITS = 16            # 1 / r as a Q16 multiplier of the steps (k' = k / r rounded half up)
MATMUL_MULTIPLIER_BITS = 22       # the requantisation's multiplier: a 22-bit mantissa of the float32 ratio, half up
MATMUL_BIAS_BITS = 9              # its bias: the multiplier's mantissa times 2^-9 of a code


def matmul_column_steps(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The HTP's int8 weight steps of per-tensor uint8 weights: a column whose steps k = q_w - z_w [K, N] leave
    int8 is rescaled by its own r >= 1 (Q11) and its steps re-rounded.  -> (k' int64 [K, N], r float64 [N])."""
    ratio = np.maximum(k.max(axis=0) / 127, -k.min(axis=0) / 128)                 # max(k_max / 127, -k_min / 128)
    over = ratio > 1                                                               # the column leaves int8
    rq = np.where(over, np.floor(ratio * 2 ** MATMUL_RATIO_BITS + 0.5), 2 ** MATMUL_RATIO_BITS).astype(np.int64)
    inv = np.floor(2.0 ** (MATMUL_RECIP_BITS + MATMUL_RATIO_BITS) / rq + 0.5).astype(np.int64)   # round(2^16 / r)
    kp = (k * inv + (1 << (MATMUL_RECIP_BITS - 1))) >> MATMUL_RECIP_BITS          # k' = floor(k inv / 2^16 + 1/2)
    return np.where(over, kp, k).clip(-128, 127), rq / 2.0 ** MATMUL_RATIO_BITS    # r = rq / 2^11 (1: untouched)


def matmul_multiplier(a: tuple, w: tuple, out: tuple, r) -> tuple[np.ndarray, np.ndarray]:
    """The HTP's requantisation multiplier of a MatMul's products, per column: 2^8 float32(float32(s_a s_w / s_o) r)
    as M 2^-s, M a 22-bit integer (rounded half up).  a, w, out: (scale, zero point) (s_w per tensor, or per column);
    r: the columns' rescales.  -> (M int64 [N], s int64 [N])."""
    ratio = np.float32(np.float32(np.float32(a[0]) * np.float32(w[0])) / np.float32(out[0]))   # s_a s_w / s_o
    v = np.float64(np.float32(ratio * np.asarray(r, np.float32))) * 2.0 ** MATMUL_DROPPED_BITS  # 2^8 (ratio r)
    f, x = np.frexp(v)                                                               # v = f 2^x, f in [1/2, 1)
    m = np.floor(f * 2.0 ** MATMUL_MULTIPLIER_BITS + 0.5).astype(np.int64)           # M = round(f 2^22), half up
    top = m >> MATMUL_MULTIPLIER_BITS                                                # f rounded up to 1: M = 2^21
    return m >> top, MATMUL_MULTIPLIER_BITS - x.astype(np.int64) - top              # (M, s): v ~ M 2^-s


def matmul(qa, a: tuple, qw, w: tuple, out: tuple, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's quantised MatMul of uint16 activations [..., K] and per-tensor uint8 weights [K, N] (module doc:
    a column whose steps leave int8 rescaled, matmul_column_steps; the multiplier, matmul_multiplier).
    a, w, out: (scale, zero point).  -> int64 [..., N]."""
    (_, za), (_, zw), (_, zo) = a, w, out
    b = MATMUL_DROPPED_BITS
    k, r = matmul_column_steps(np.asarray(qw, np.int64) - np.int64(zw))          # k' (int8), r per column
    hi = (np.asarray(qa, np.int64) @ k) >> b                                      # floor(sum q_a k' / 2^8)
    zp = (np.int64(za) * k.sum(axis=0) + (1 << (b - 1))) >> b                     # round(z_a sum k' / 2^8)
    m, s = matmul_multiplier(a, w, out, r)                                        # 2^8 s_a s_w r / s_o ~ M 2^-s
    t = MATMUL_MULTIPLIER_BITS - 1 + MATMUL_BIAS_BITS                               # M 2^-30: the mantissa 2^-9
    c = np.where(s >= t, m << np.maximum(s - t, 0), m >> np.maximum(t - s, 0))    # floor(M 2^-30 2^s): the bias
    y = ((hi - zp) * m + (np.int64(1) << (s - 1)) + c) >> s                      # floor((hi - zp) M 2^-s + 1/2 + bias)
    return np.clip(y + np.int64(zo), *qrange)                                      # q_o, saturated


MUL_MULTIPLIER_BITS = 34          # Mul's s_a s_b / s_o: a Q34 multiplier
MUL_CONSTANT_WRAP = 31            # its zero points' term's error: T m modulo 2^31, signed


def mul(qa, a: tuple, qb, b: tuple, out: tuple, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's quantised Mul of two uint16 tensors (or a tensor and a uint16 constant: RMSNorm's weight).  qa, qb:
    codes (broadcastable); a, b, out: (scale, zero point), per tensor.  -> int64 codes, broadcast shape."""
    (sa, za), (sb, zb), (so, zo) = a, b, out
    r = np.float32(np.float32(sa) * np.float32(sb)) / np.float32(so)               # M = s_a s_b / s_o (float32)
    m = int(np.rint(np.float64(r) * 2.0 ** MUL_MULTIPLIER_BITS))                   # m = round(M 2^34)
    zap, zbp = int(za) - 2 ** 15, int(zb) - 2 ** 15                                 # z' = z - 2^15 (int16)
    return q34_product(qa, za, qb, zb, zo, m, 2 * zap * zbp + zap + zbp, 0, qrange)   # T exact


def q34_product(qa, za, qb, zb, zo, m: int, t: int, bias: int, qrange: tuple = UINT16) -> np.ndarray:
    """The Mul's requantisation (and the fused SiLU product's): the exact product of the inputs' steps times the Q34
    multiplier m, less the zero points' constant c = t m mod 2^31 (signed), plus bias, shifted right by 34 rounding
    half up.  qa, qb: codes (broadcastable); za, zb, zo: zero points.  -> int64 codes, broadcast shape."""
    c = t * m % 2 ** MUL_CONSTANT_WRAP                                              # T m mod 2^31
    c -= 2 ** MUL_CONSTANT_WRAP if c >= 2 ** (MUL_CONSTANT_WRAP - 1) else 0         # signed: [-2^30, 2^30)
    p = (np.asarray(qa, np.int64) - np.int64(za)) * (np.asarray(qb, np.int64) - np.int64(zb))   # the exact product
    acc = p * np.int64(m) - np.int64(c) + np.int64(bias)                           # p m - c + bias   (Q34; |p| < 2^32)
    return np.clip(round_half_up_shift(acc, MUL_MULTIPLIER_BITS) + np.int64(zo), *qrange)   # q_o, saturated


DIV_SCALE_BITS = 15               # Div's s_a / (s_b s_o): a 15-bit mantissa K_m
RECIP_BITS = 29                   # r(m) 2^-29 ~ 1 / m for m in [2^15, 2^16) (r in [2^13, 2^14]: 14 significant bits)
RECIP_PIECE_BITS = 12             # four pieces per octave: x = (m >> 1) - 2^14 in [0, 2^14), piece x >> 12
# The HTP's reciprocal, measured (QNN 2.51 HTP v75 simulator, one-op QDQ Div of a fixed numerator over all 65536
# divisor codes; the same r at n_b and 2 n_b): per piece (a2, rounding of a2 x, b1, c0),
#     r = floor((c0 2^14 + x (b1 + floor((a2 x + rounding) / 2^14))) / 2^14),  x global in [0, 2^14)
# reproduces all 16384 measured r exactly (a quadratic of 1 / m, coefficients found by exhaustive search).
RECIP_PIECES = ((11794, 0, -16043, 16384.5), (6555, 0, -13659, 16116), (3945, 1 << 13, -11177, 15527),
                (2530, 0, -9111, 14774))


def recip_mantissa(j: np.ndarray) -> np.ndarray:
    """r(j): the HTP's reciprocal of m = 2 j + (0 or 1) in [2^15, 2^16), j in [2^14, 2^15), in units of 2^-29
    (int64 in [2^13, 2^14])."""
    x = np.asarray(j, np.int64) - (1 << 14)                                        # x in [0, 2^14)
    r = np.zeros(x.shape, np.int64)
    for i, (a2, half, b1, c0) in enumerate(RECIP_PIECES):
        t = x * (b1 + ((a2 * x + half) >> 14))                                     # x (b1 + a2 x / 2^14)
        r = np.where(x >> RECIP_PIECE_BITS == i, (int(c0 * 2 ** 14) + t) >> 14, r)  # c0 + t / 2^14, floored
    return r


def div(qa, a: tuple, qb, b: tuple, out: tuple, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's quantised Div of two uint16 tensors, the divisor above its zero point (n_b <= 0: saturated, not
    modelled).  qa, qb: codes (broadcastable); a, b, out: (scale, zero point), per tensor.  -> int64 codes."""
    (sa, za), (sb, zb), (so, zo) = a, b, out
    k_ratio = np.float64(np.float32(sa)) / (np.float64(np.float32(sb)) * np.float64(np.float32(so)))   # K
    e_k = int(np.floor(np.log2(k_ratio))) - DIV_SCALE_BITS + 1
    k_m = int(np.floor(k_ratio / 2.0 ** e_k + 0.5))                                # K_m, 15 bits (rounded half up)
    if k_m >> DIV_SCALE_BITS:
        k_m, e_k = k_m >> 1, e_k + 1
    na = np.asarray(qa, np.int64) - np.int64(za)                                   # q_a - z_a
    nb = np.asarray(qb, np.int64) - np.int64(zb)                                   # n_b = q_b - z_b
    na, nb = np.broadcast_arrays(na, nb)
    g = (np.abs(na) >> 15).clip(0, 1)                                              # g: |n_a| >= 2^15
    n = np.abs(na) >> g                                                            # n, halved at 2^15
    k = np.floor(np.log2(np.maximum(n, 1))).astype(np.int64)                       # k = floor(log2 n)
    big = n * np.int64(k_m)
    A = (big + (np.int64(1) << k)) >> (k + 1)                                      # floor(n K_m / 2^(k+1) + 1/2)
    m = np.maximum(nb, 1)
    e = 15 - np.floor(np.log2(m)).astype(np.int64)                                 # m 2^e in [2^15, 2^16)
    r = recip_mantissa((m << e) >> 1)                                              # R = r 2^(e - 29)
    sh = RECIP_BITS - 1 - e - e_k - k - g                                           # A r 2^(-sh): the quotient
    p = A * r
    y = np.where(sh > 0, (p + ((np.int64(1) << np.maximum(sh, 1)) >> 1)) >> np.maximum(sh, 0),
                 p << np.maximum(-sh, 0))                                          # rounded half up (magnitude)
    y = np.where(nb > 0, np.sign(na) * y, np.sign(na) * (qrange[1] - qrange[0] + abs(int(zo)) + 1))  # n_b <= 0
    return np.clip(y + np.int64(zo), *qrange)                                      # q_o, saturated


# Neg, uint16 (RoPE's rotate_half; measured: 100 % of codes identical over every input code of 33 encodings: scale
# ratios 0.01 to 60, zero points 0-65535 on the input and the output, 8 of them held out; the CPU EP's exact
# QuantizeLinear 91-100 %, 1 code): the input's int16 codes (q - 2^15) rescaled by a Q18 multiplier into eighths of
# an output code, its zero point's term rounded to eighths apart, then the eighths rounded half up with a sixteenth
# more (the rounding constant 9/16: about a middle zero point every code is floor(-n r + 9/16)):
#
#     m   = round(s_x / s_o 2^18)                         the multiplier, Q18
#     t   = floor((-(q_x - 2^15) m + 2^14) / 2^15)        -q' r in eighths, rounded half up
#     Z   = floor(((z_x - 2^15) m + 2^14) / 2^15)         z' r in eighths, rounded half up
#     q_o = clip(floor((t + Z + 4) / 8) + z_o, 0, 2^16 - 1)

NEG_MULTIPLIER_BITS = 18          # Neg's s_x / s_o: a Q18 multiplier
NEG_EIGHTHS_BITS = 3              # its terms in eighths of an output code, each rounded half up


def neg(qx, x: tuple, out: tuple, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's quantised Neg.  qx: codes; x, out: (scale, zero point), per tensor.  -> int64 codes, qx's shape."""
    (sx, _), (so, _) = x, out
    r = np.float64(np.float32(sx)) / np.float64(np.float32(so))                   # r = s_x / s_o
    return rescale_in_eighths(qx, x, out, multiplier(r, NEG_MULTIPLIER_BITS), negate=True, qrange=qrange)


def rescale_in_eighths(qx, x: tuple, out: tuple, m: int, negate: bool = False, qrange: tuple = UINT16) -> np.ndarray:
    """x's codes rescaled by the Q18 multiplier m into the output encoding in eighths of a code (negated: Neg, and
    the -x2 of the fused rotate_half; not: its x1).  qx: codes; x, out: (scale, zero point), per tensor.  -> int64
    codes, qx's shape."""
    (_, zx), (_, zo) = x, out
    sh = NEG_MULTIPLIER_BITS - NEG_EIGHTHS_BITS
    sign = np.int64(-1 if negate else 1)
    qp = np.asarray(qx, np.int64) - np.int64(2 ** 15)                              # q' = q_x - 2^15 (int16)
    t = round_half_up_shift(sign * qp * np.int64(m), sh)                           # +-q' r in eighths
    z = round_half_up_shift(np.int64(int(zx) - 2 ** 15) * np.int64(m), sh)         # z' r in eighths
    y = (t - sign * z + (1 << (NEG_EIGHTHS_BITS - 1))) >> NEG_EIGHTHS_BITS         # floor((t -+ Z + 4) / 8)
    return np.clip(y + np.int64(zo), *qrange)                                      # q_o, saturated


# SiLU's product x * sigmoid(x), uint16 (measured: the HTP fuses a Mul of a tensor and its own Sigmoid's codes: on the
# same graph x * sigmoid(y) is the Mul above, every code, and x * sigmoid(x) 91-97 % of it; this model is 100 % of
# codes over every input code of 17 encodings, 6 held out, and on the dense W8A16 model's 4 SiLU products on the
# HTP's own inputs): the Mul's exact product and Q34 multiplier, with three differences
#
#     m   = floor(M 2^34 + 1/2),  M = s_a s_b / s_o in float32   the multiplier: ties up (the Mul: to even)
#     T   = float32(2 z_a' z_b' + z_a' + z_b')                   the zero points' term in float32 (24 bits)
#     c   = (T m mod 2^31) wrapped into [-2^30, 2^30)
#     q_o = clip(floor(((q_a - z_a)(q_b - z_b) m - c + 2^33 + 2^30) / 2^34) + z_o, 0, 2^16 - 1)   a sixteenth more

SILU_EXTRA_BITS = 30              # the fused product's extra rounding: 2^30 at Q34, a sixteenth of a code


def silu_product(qa, a: tuple, qb, b: tuple, out: tuple, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's fused x * sigmoid(x): qa the codes of x, qb those of its sigmoid (the Sigmoid's own quantiser);
    a, b, out: (scale, zero point), per tensor.  -> int64 codes, broadcast shape."""
    (sa, za), (sb, zb), (so, zo) = a, b, out
    r = np.float32(np.float32(sa) * np.float32(sb)) / np.float32(so)               # M = s_a s_b / s_o (float32)
    m = int(np.floor(np.float64(r) * 2.0 ** MUL_MULTIPLIER_BITS + 0.5))            # m = round(M 2^34), ties up
    zap, zbp = int(za) - 2 ** 15, int(zb) - 2 ** 15                                 # z' = z - 2^15 (int16)
    t = int(np.float32(2 * zap * zbp + zap + zbp))                                  # T in float32
    return q34_product(qa, za, qb, zb, zo, m, t, 1 << SILU_EXTRA_BITS, qrange)      # + 2^30: a sixteenth more


# Sigmoid, uint16 (measured: 100 % of codes identical over every input code of 10 encodings, input scales 2^-16 to
# 2^-10, 7 of them not used to read the table; the CPU EP 20-40 %, 4-5 codes): the input's magnitude on a grid of
# 1/6144 (an int16 multiplier), the device's 15-bit sigmoid at that grid point read from its table, mirrored for a
# negative input, written as codes of sigmoid(x) 2^16 (every code even) WHATEVER the graph's output encoding says
# (ONNX Runtime's QNN config gives Sigmoid (2^-16, 0), so they agree there; with another, the device's codes still
# mean sigmoid(x) 2^16: docs/htp.md §9):
#
#     r   = s_x 6144                                      the input's scale in grid steps
#     s   = the largest s <= 15 with round(r 2^s) <= 2^15 - 1;  m = round(r 2^s)    an int16 multiplier
#     k   = min(floor(|q_x - z_x| m / 2^s), 62485)        |x| on the grid (62485: the table's end, 32767)
#     y   = S(k) if q_x >= z_x else 2^15 - 1 - S(k)       the 15-bit sigmoid: S(0) = 2^14, S(k) + S'(-k) = 2^15 - 1
#     q_o = 2 y
#
# S: the HTP's sigmoid on the grid, measured (QNN 2.51 HTP v75 simulator, one-op QDQ Sigmoid over all 65536 input
# codes at s_x = 1/6144, zero point 0: k = 0..65535; the same S at s_x = 2/6144, 4/6144 about zero point 2^15), stored
# as its steps S(k + 1) - S(k) in {0, 1, 2}, zlib-compressed, base64. Within -1.25..+0.93 of 2^14 (1 + tanh(k /
# 12288)): not the correctly rounded sigmoid (an approximation; not linear between its own points at any spacing of
# 2^3..2^11).

SIGMOID_GRID = 6144               # Sigmoid's input grid: |x| in steps of 1/6144
SIGMOID_MULTIPLIER_BITS = 15      # s_x 6144: an int16 multiplier, at most Q15
SIGMOID_STEPS = (
    "eNrtV4mW4zgIxP3/H73HTBJZKqBAku3MwOZ1bFEXOJ2ePX6O48Gvf3+0179e7fXk6/Q2EdIPJjozaG0JasnU+UPoLjbz3BxLwtVxGhUCe4hsamYp"
    "mRXQ6Y1IMrNZq00MK/avSkyWeLiSmdLcbWzpyhOVWCbv28P5TtEXQXwSzYdD+7OfZcl6HNzvPPUVzEgxC/J/88wDUvWIMsRZSZhv409f/j+H/ETU"
    "aOvXzfCJf911f1h502vvBM37itw8ZTn9U0HafxSR4irs1EhQjkMJIwRbfg4OBC00vLeOU0ePaRrFjvXNwiCS8WAV+mWA3Q59ZWkheyF8hmxgUZhs"
    "uZgq6BENWTCj94KoJqYoMc5OYox3jB9yaQVgZhyLuGhMjAvo77AiMfr1gVUp8yK5IVwHaMjiaR2Wv+VmaPuSqpIqsJHn6sTovXuM5aI+A7nkMQgA"
    "f2Y1lNvFAFtDEGNcAT31oENCNVWNDtZ0fkMqrIFxth5BsdGYcoxvupyuoHHet56DqdnDQN/jU0Sr0WVAWr5tw+5kz6DxxDcFWTnRnNq7i5AqCcsj"
    "PhLQjlsPfDyKt57iJHSU4ICG439yqZ7lje6BsC72e0g9yQBwLXlW/yBaFKE3ZjX5Y0hdWRfy1fCc0bYokAGjpTgBNcMJhsONCCgTnoU/P94W7/HP"
    "i0DnYEu5ppwGPIcZkjZjpKpJ8TKSduGEdJOXSNMaMsjfgSgQkHs7KSqn4HAwLPuioZYphnXAMVTuDFVcdzwmlRHSJxnFZYSMuiA03/04ojxauDbX"
    "64FjnhzszWeuOB82Tk8PI9qJBaBPs0FD5fBnYJ339zkUFPvQDlFIaCFBVXUv7HsES2sKeCSJ99diZEoKHwsP/f89YJJrdZFOLYmkYgXERskYRpmA"
    "Ioi5dH0k8S5NE4ko7bkUkIZiChppgIvV6H7AFCNZncDmy/kJygHVxL17kVykHGRP8HQ0WMy2qHqDOMb7BydF9bA90K3FMUPSwxoEbE2LIQGuYG8P"
    "LubcOhrpUxa+HOwAH1c0II1xhIY4UwgG40vByXy8A1K0xV2G6WMreCKEeuyYEg8miAlSfmEo/ZLjglf6LOnANEwNV8gCe2kicsyqxM9KaI4tbX9m"
    "kwIpXuM4DpfXtRZl92AYnECNpjp0YDWOaWqedp9LfNqFOKNVI1Hnho/K0LdpDlE3s1JaGnBS5l6TwPceHgYe7zEVRtV01KycjX6pITWaEe2im3cC"
    "D273tmJUauTY1VaW0DMd6X67hppuTJGwK47aZ/L65yud0Tom/+tjhQhtkgzsbG4qKBCVN4lOKjKelvCMg2cU65AuGILO9RlYKfOCxSk8JBDXGe99"
    "VfJ+Bk2AeJWzmHXXriCoH027Chpt4jk1BH/qEfCuCGTGR/FTz6IaakRHYVbJv+lceYkXJ2hKISgmpZzgB6SwepjoEkB0VQkHsRrYiLdzkKht+Vj4"
    "AMvjsgqmJafpQQygGYqhRmR2vWCePJ9Fa3uKcT4Iuufn5fzBKU1E9z04RO5vzCSMWoxg6gQBrjOroq3XB6UdxivDFh4MeI0WpjqusUOmr4U00R4x"
    "fzKHc1fQnY6dsdle6pE6umvpJwa3iq+tocgqyBi6G3dtWxvRmNOTsFwZWdRnomgjaBlDYiY5BFzMNmXtBlxKQivRtdWJMP5kxg0Rh9BmFeZwRiwP"
    "wyh7jJjHjIkXkjfJ5vXPwR2flIhqZo0mCEdgU27+oY6NRltuvAAd7KQDRQ/h/lJpPJNAvuSl0Q/LTAUJ9SxGwi+Gix1YqTPaKUgL1K4nnIIyUz81"
    "rwBZe0gB8nVt72gl0dPKS0533JuYjosOCl0JT+LnhH2RtW9EiFnRaehyJhUpEt+57aKGDDLcVLqgY85D8QqKs2pJt9vf3TnYQfUDGkBL6+FcCT62"
    "frBELL6WXJIUZE2G2YtQrtBYlOs6dHDIHfClRyvwjyHE5TZeTRknyF7b3mFKnbdMaQb6Af+IwTxg/jIyZUgiDU4j8iIEOg+ZgAfzUpJRHcqACh1W"
    "PWHiWcOyiZE4eoaf8M/AWAEyjqFNrio3EuvLx02aLRGxJHnzLPISaEdMbyMiO6O08Da/l2DIOfLUUFH2tXT3PsoPGwwC0QnmIySmipvucV2RlFG9"
    "TCVHWsVi4uQyp2k77R57tJ05YXAXbubsacBJSfI3JyC4Y8YFqWY3GtPdJhySWBA5GnqJiiq+RCYafc1241PtP08wlhGsTkJtYSOV+ZC7O8t3vXpF"
    "6fBpzYsl06PnF7NlpfcE2hdpzneSvVV80nxS/fb+dwAukbgI8W2QPxZztRKJutzwFrFdsrfANqzm2LDCHcAdkn8qdCc4Cn9MkudMuR+/O84FhEs8"
    "EqkumeS5wbKkL2CleRfb3UC8Puld1CnubeQp30n2t/Nn3ZdIPCLEY2KsEVmk8qwwy3SemGil1HNzLVa776/dlmm+RHGT6vEFMfcsc6/yTunN4pvV"
    "98l/a+7LTS5y2W9z0RwXGl3s9Sd9GB5hebnpLTPeanyf+a0j3x3g9uGfFOMhy3hMjifmedpunprpqamenew78j0/4Jfl/Kak3xr4a0P/VUMdNUSN"
    "UhPWODXzX/5Qaws1eS2hVlULqpXVCqtqs7XyqnoM9Xiq6glW1UOuqg9DVX1oquqjVVVVn/aqqvrUV1VV1e9xVVVVfQlUVVVV1VdlVVVVVVX9Zamq"
    "qqqqqqqqqn9oVFVVVVVVVVVVVVVVVT3t/zj/AewnQAA=")


def _sigmoid_table() -> np.ndarray:
    import base64
    import zlib
    steps = np.frombuffer(zlib.decompress(base64.b64decode("".join(SIGMOID_STEPS))), np.uint8)
    return np.concatenate([[2 ** 14], 2 ** 14 + np.cumsum(steps, dtype=np.int64)])   # S(k), k = 0..62485


SIGMOID_TABLE = _sigmoid_table()


def sigmoid(qx, x: tuple, out: tuple | None = None, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's quantised Sigmoid.  qx: codes; x: (scale, zero point), per tensor; out: the graph's output encoding,
    which the device does not read (its codes are sigmoid(x) 2^16).  -> int64 codes, qx's shape."""
    sx, zx = x
    r = np.float64(np.float32(sx)) * SIGMOID_GRID                                  # r = s_x 6144
    s = multiplier_shift((r,), SIGMOID_MULTIPLIER_BITS)                             # the int16 multiplier's shift
    m = np.int64(multiplier(r, s))                                                 # m = round(r 2^s)
    n = np.asarray(qx, np.int64) - np.int64(zx)                                    # n = q_x - z_x
    k = np.minimum((np.abs(n) * m) >> s, len(SIGMOID_TABLE) - 1)                   # |x| on the grid
    y = np.where(n >= 0, SIGMOID_TABLE[k], 2 ** 15 - 1 - SIGMOID_TABLE[k])         # S(k), mirrored
    return np.clip(2 * y, *qrange)                                                 # q_o = 2 y


# ---------------------------------------------------------------------------------------------- uint16 x uint16 MatMul
# The attention's products (q k^T, probs @ v; measured on the simulator: one-op QDQ MatMuls of two uint16 inputs, and
# the dense W8A16 model's 8 on their own inputs): the second operand is requantised to uint8 (its range kept: the
# scale times 65535 / 255), then the product is the W8A16 MatMul above (matmul: its columns outside int8 rescaled).
#
#     n_b = q_b - z_b                                   the second operand's steps
#     z_8 = floor((255 z_b + 2^15 - 1) / 2^16)          its uint8 zero point (255 z_b / 2^16, ties down)
#     Z   = ceil(255 z_b / 2^9)                         its zero point's term, the low 9 bits dropped (rounded up)
#     k_8 = clip(floor((255 q_b - 2^9 Z + 2^15 + 2^9 - 1) / 2^16), -z_8, 255 - z_8)    the steps: 255 n_b / 2^16
#                                                       rounded, off by up to 2^-7 of a step (exact over all 65536
#                                                       codes at each of 8 zero points; 6 held out, 99.9-100 %
#                                                       with the previous multiplier)
#     s_8 = float32(float32(s_b 65535) / 255)           its scale, the range kept, in float32 (matmul's multiplier
#                                                       float32(float32(s_a s_8) / s_o): 57 of 58 sweeps and models'
#                                                       products; float32(257 s_b) or the float64 ratio: 53-55)
#     q_o = matmul(q_a, (s_a, z_a), k_8 + z_8, (s_8, z_8), (s_o, z_o))
#
# so every element of the second operand loses its low ~8 bits (a relative 2^-8 of its range: the "tens to hundreds
# of codes" between the exact product and the HTP's), and the first keeps all 16. Every code of 7 of the dense W8A16
# model's 8 (the 8th: 1 code in a column of the uint8 operand rescaled out of int8), 7 of the MoE's 8 (the 8th: its
# multiplier a tie at 22 bits which the device rounded down, 2 codes), Qwen3.5's 2, 32 K = 1 sweeps over every code
# of the first operand, the one-op test's 2 held-out sweeps. Not found: random sweeps whose uint8 operand has columns
# rescaled are 99.8-100 % (z_8 136: 16 of 32768 codes, all in rescaled columns; 156: 13 of 8192; 47, 175: every
# code; +-1; the rescale in s_8's float32 (s_a float32(s_8 r) / s_o) fits the first, not the others; K = 1 sweeps
# of such columns, 16 encodings, every first-operand code: 88 of 96 columns every code, 8 (2 with r = 1) 18-236 of
# 65536 codes off, two of them fitting no multiplier at all: the rescaled steps' rounding too); at the MoE's
# encodings the multiplier is one unit under the model (131k codes of random sweeps every one with M - 1): no float32
# chain tried (3480 orders of s_a, s_b, s_o, 65535, 255, 257) gives both it and the other 57.
MATMUL16_ZERO_DROPPED_BITS = 9     # the requantiser's zero point term 255 z_b: its low 9 bits dropped (ceil)


def matmul16_operand(qb, b: tuple) -> tuple[np.ndarray, tuple]:
    """The HTP's uint8 requantisation of a uint16 MatMul's second operand.  qb: codes; b: (scale, zero point).
    -> (uint8 codes as int64, (scale, zero point))."""
    sb, zb = b
    zb = int(zb)
    n = np.asarray(qb, np.int64) - np.int64(zb)                                   # n_b = q_b - z_b
    z8 = (255 * zb + (1 << 15) - 1) >> 16                                          # z_8 = 255 z_b / 2^16, ties down
    d = MATMUL16_ZERO_DROPPED_BITS
    zt = -((-255 * zb) >> d) << d                                                 # 2^9 Z = 2^9 ceil(255 z_b / 2^9)
    t = 255 * (n + zb) - zt + (1 << 15) + (1 << d) - 1                              # 255 q_b - 2^9 Z + 2^15 + 2^9 - 1
    k8 = np.clip(t >> 16, -z8, 255 - z8)                                           # k_8, on the uint8 grid
    s8 = np.float32(np.float32(np.float32(sb) * np.float32(65535)) / np.float32(255))   # s_b 65535 / 255, float32
    return k8 + z8, (float(s8), z8)                                                # q_8, (s_8, z_8)


def matmul16(qa, a: tuple, qb, b: tuple, out: tuple, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's quantised MatMul of two uint16 tensors [..., M, K] x [..., K, N] (batch axes broadcast), per-tensor
    encodings: the second requantised to uint8 (matmul16_operand), then matmul.  -> int64 [..., M, N]."""
    q8, e8 = matmul16_operand(qb, b)
    qa = np.asarray(qa, np.int64)
    batch = np.broadcast_shapes(qa.shape[:-2], q8.shape[:-2])
    qa, q8 = np.broadcast_to(qa, batch + qa.shape[-2:]), np.broadcast_to(q8, batch + q8.shape[-2:])
    y = np.empty(batch + (qa.shape[-2], q8.shape[-1]), np.int64)
    for i in np.ndindex(*batch):                                                    # per head: its own columns
        y[i] = matmul(qa[i], a, q8[i], e8, out, qrange)
    return y


# Softmax over the last axis, uint16 (rows of 3 or more elements; measured, QNN 2.51 HTP v75 simulator): a structural
# model, not code for code. Measured: the exps are 15-bit integers E_i = T(f_i) >> i_i with the row's maximum at
# T(0) = 32767 (on dyadic input steps E(y + 1) = E(y) >> 1 for 100 % of 180k codes), T within -2..+2 of 32768 2^-f
# (four quadratic pieces per octave, modelled by a fixed-point quadratic per piece fitted to the measured table,
# 80 % of its 4096 points exact, the rest within 1: SOFTMAX_EXP_PIECES; the device's own not found); y = (q_max - q_x) M
# / 2^22 with M = floor(s_x log2(e) 2^22) (the multiplier's truncation fits six input scales' exp slopes within 7e-5);
# the probabilities floor(E_i r / 2^(13 + ...)) with r ~ 1 / sum E (every row of six one-op sweeps, given E and r:
# ~2^29 / S for S < 2^16, a 14-bit r; ~2^31 / (S >> e), a 15-bit r, above: the reciprocal itself is within 1.3 units
# of these, its formula not found: modelled as the rounded quotient, of S with its lowest bit dropped below 2^16);
# the output codes are p 2^16 for both (1 / 65535, 0) and (2^-16, 0) (identical codes). Rows of 2 elements are
# another kernel (12 % of its codes the same), not modelled. Against the device: 96.6-98.3 % of codes on the dense
# W8A16 model's 4 attention Softmaxes on the HTP's own inputs (CPU EP 91.8-94.2 %), max 1-4 codes; 83-95 % on the
# MoE's 4 routers, max 1 (CPU EP 3-30 %, up to 46); 83-99 % on 7 random-row sweeps at other encodings (CPU EP
# 41-88 %), max 4-8 (the reciprocal's and T's units): docs/htp.md §9.
#
#     n_i = q_max - q_i                                     the row's steps below its maximum (integers)
#     M   = floor(s_x log2(e) 2^22)                         y's multiplier, Q22, truncated
#     i_i = floor(n_i M / 2^22),  f_i = (n_i M mod 2^22) / 2^22      y = -x log2(e): its integer part and fraction
#     v   = f_i 2^2 - p, p = floor(4 f_i)                  the piece p of f_i and its place v in it (Q15: V = v 2^15)
#     T   = c0 + floor((V (c1 + floor((c2 V + h2) / 2^15)) + h1) / 2^15)     the piece's quadratic, h: 0 or 2^14
#     E_i = min(T, 32767) >> i_i                            the 15-bit exp (the device's own table: within 1)
#     S   = sum_i E_i
#     q_i = floor(E_i round(2^29 / S') / 2^13),  S' = 2 floor(S / 2)                    S < 2^16
#           floor(E_i min(round(2^31 / m), 2^15 - 1) / 2^(15 + e)),  m = S >> e in [2^16, 2^17)     above
#     q_o = clip(q_i K + z_o, 0, 2^16 - 1),  K = 2^-16 / s_o as a 15-bit mantissa (1 at s_o = 1 / 65535; other
#           output encodings not measured)

SOFTMAX_Y_BITS = 22               # Softmax's y = n s_x log2(e): a truncated Q22 multiplier of the integer steps n
SOFTMAX_EXP_BITS = 15             # its exps: 15-bit integers, the row's maximum 2^15 - 1
SOFTMAX_PIECE_BITS = 15           # T's pieces: four per octave of f, the place in a piece in Q15
# T(f) per piece (c2, c1, c0, h1, h2): the least-squares quadratic of the HTP's exps measured on a 1/4096 grid of f (QNN
# 2.51 HTP v75 simulator, s_x log2(e) = 2^-12: every f of the grid at i = 0), its coefficients searched in Q15 with
# each rounding: 74-86 % of each piece's points exact, the rest within 1 (not the device's own coefficients)
SOFTMAX_EXP_PIECES = ((450, -5662, 32767, 0, 1 << 14), (380, -4764, 27555, 0, 1 << 14), (319, -4005, 23171, 0, 0),
                      (269, -3369, 19484, 1 << 14, 1 << 14))
SOFTMAX_SMALL_RECIP_BITS = 29     # S < 2^16: r = round(2^29 / S'), the probabilities E r / 2^13
SOFTMAX_RECIP_BITS = 31           # S >= 2^16: r = round(2^31 / m) (int16), m = S >> e in [2^16, 2^17)


def softmax(qx, x: tuple, out: tuple, axis: int = -1, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's quantised Softmax (a structural model: module comment above).  qx: codes, rows of >= 3 along axis;
    x, out: (scale, zero point), per tensor.  -> int64 codes, qx's shape."""
    (sx, _), (so, zo) = x, out
    q = np.moveaxis(np.asarray(qx, np.int64), axis, -1)
    n = q.max(axis=-1, keepdims=True) - q                                           # n_i = q_max - q_i
    m_y = int(np.floor(np.float64(np.float32(sx)) * np.log2(np.e) * 2.0 ** SOFTMAX_Y_BITS))   # M, Q22 truncated
    y = n * np.int64(m_y)                                                           # n_i M   (Q22)
    i = y >> SOFTMAX_Y_BITS                                                         # i_i
    fq = (y & ((1 << SOFTMAX_Y_BITS) - 1)) >> (SOFTMAX_Y_BITS - SOFTMAX_PIECE_BITS - 2)   # f_i in Q17
    piece, v = fq >> SOFTMAX_PIECE_BITS, fq & ((1 << SOFTMAX_PIECE_BITS) - 1)     # p and V
    t = np.zeros_like(fq)
    for k, (c2, c1, c0, h1, h2) in enumerate(SOFTMAX_EXP_PIECES):
        inner = c1 + ((c2 * v + h2) >> SOFTMAX_PIECE_BITS)                          # c1 + c2 V / 2^15
        t = np.where(piece == k, c0 + ((v * inner + h1) >> SOFTMAX_PIECE_BITS), t)   # T = c0 + V (...) / 2^15
    t = np.minimum(t, 2 ** SOFTMAX_EXP_BITS - 1)
    e_x = np.where(i < 62, t >> np.minimum(i, 62), 0)                               # E_i = T(f_i) >> i_i
    s = e_x.sum(axis=-1, keepdims=True)                                             # S
    e = np.zeros_like(s)
    while ((s >> e) >= 1 << 17).any():
        e = np.where((s >> e) >= 1 << 17, e + 1, e)                                 # m = S >> e in [2^16, 2^17)
    m = s >> e
    r = np.minimum((np.int64(1) << SOFTMAX_RECIP_BITS) // m + ((np.int64(1) << SOFTMAX_RECIP_BITS) % m * 2 >= m),
                   2 ** 15 - 1)                                                     # round(2^31 / m), int16
    big = (e_x * r) >> (SOFTMAX_RECIP_BITS - 16 + e)                                # E r / 2^(15 + e)
    s2 = np.maximum(s >> 1 << 1, 1)                                                  # S, its lowest bit dropped
    small = (e_x * (((np.int64(1) << SOFTMAX_SMALL_RECIP_BITS) + (s2 >> 1)) // s2)) >> 13   # E round(2^29 / S') / 2^13
    p = np.where(s >= 1 << 16, big, small)                                          # p 2^16, floored
    k = mantissa(2.0 ** -16 / np.float64(np.float32(so)), SQRT_SCALE_BITS)          # K, a 15-bit mantissa
    y_o = p if k == 1.0 else np.floor(p * k).astype(np.int64)
    return np.moveaxis(np.clip(y_o + np.int64(zo), *qrange), -1, axis)              # q_o, saturated


# RoPE's rotate_half, Concat(Neg(x2), x1) of two halves of one tensor x, uint16 (measured: the HTP fuses the Neg into
# the Concat: the Neg's own quantiser is not read (its codes still come out, the Neg above); each half is rescaled
# from x's codes straight into the Concat's output encoding, -x2 by the Neg's arithmetic and x1 by the same without
# the negation. 100 % of codes identical over every input code of 14 of 15 encodings of a one-op rotate_half graph
# (x -> Slice, Slice -> Neg -> Concat; scale ratios 0.35-2.6, zero points 0-65535; the one left: 98.9 % of -x2 at
# z_x 61159, z_o 62326, dev one code higher) and on the dense W8A16 model's 8 of 8 on the HTP's own inputs (where the
# exact requantisation of the Neg's codes is 74.8-100 %, of x1's 89.8-100 %). A Concat alone requantises its inputs
# another way (within a code of the exact requantisation, 99.9-100 %: not modelled here):
#
#     m   = round(float32(s_x / s_o) 2^18)                the multiplier, Q18, of the float32 ratio (ties to even:
#                                                         r 2^18 = 549404.5 gives 549404 on the device)
#     t   = floor((+-(q_x - 2^15) m + 2^14) / 2^15)       +-q' r in eighths, rounded half up (- for -x2)
#     Z   = floor(((z_x - 2^15) m + 2^14) / 2^15)         z' r in eighths, rounded half up
#     q_o = clip(floor((t -+ Z + 4) / 8) + z_o, 0, 2^16 - 1)


def rotate_half(qx2, x2: tuple, qx1, x1: tuple, out: tuple, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's fused Concat(Neg(x2), x1) over the last axis (RoPE's rotate_half).  qx2, qx1: the halves' codes
    [..., h] (before the Neg: its quantiser is not read); x2, x1, out: (scale, zero point), per tensor.
    -> int64 codes [..., 2h]."""
    def m(x: tuple) -> int:                                                       # round(float32(s_x / s_o) 2^18)
        return multiplier(np.float32(np.float32(x[0]) / np.float32(out[0])), NEG_MULTIPLIER_BITS)
    return np.concatenate([rescale_in_eighths(qx2, x2, out, m(x2), negate=True, qrange=qrange),     # -x2
                           rescale_in_eighths(qx1, x1, out, m(x1), qrange=qrange)], axis=-1)         # x1
