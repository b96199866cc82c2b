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
their own inputs, 99.92-100 % on 18 sweeps of N = 32 / 64 random codes, max 1 code; from r = 1/2, on Qwen3.5's 3 of
[32, 16] and 5 one-op sweeps at r 0.5-1.3, every code): ReduceSum's arithmetic (further on) at r = s_x / (N s_o),

    r   = s_x / (N s_o)
    k   = the largest k with round(r (1 - 10^-5) 2^k) <= 2^15 - 1
    m   = round(r (1 - 10^-5) 2^k)                      an int16 multiplier of r less 1e-5 of it (rounded half up)
    q_o = clip(floor((m sum_i n_i + N) / 2^k + 1) + z_o, 0, 2^16 - 1)   k > 15 (r < 1/2): a whole step added
                                                                    before the floor, and a unit of Q(k) per term:
                                                                    the mean lands half a code above the rounded
                                                                    one (from r = 1/2: rounded half up)

    The multiplier's shortfall (measured: the ratio at which m steps to m + 1, bisected to one float32 step of s_x
    on 12 one-op graphs, N 16-64, k 16-18, m 16,596-31,988, s_o 1.2e-5 to 9.6e-5: r 2^k (1 - eps) = m + 1/2 at eps
    9.79e-6 to 9.99e-6; of the 6 whose bounds were kept, 3 fall on eps = 1e-5's side, 3 a float32 step off; its
    origin not found: not a float32 chain of s_x, s_o, N and 0.99999, not 16-24-bit mantissas of the scales): it
    replaces floor(r 2^k + 1/4) (an average of the shortfall over m in [2^14, 2^15)), which missed layer 0's
    post-attention mean of the dense aimet W4A16 model (r 2^k = 17622.68: device 17623, 48 % of codes) and of W8A16
    (32275.81: 32275, 6 %). With it, every ReduceMean and ReduceSum of the 11 honest HTP dumps (dense, MoE, Qwen3.5;
    QNN and aimet-onnx; W8A16 and W4A16: 178 ReduceMeans, 197 ReduceSums) is the HTP's, every code, on its own
    inputs (6 ReduceMeans and 6 of Qwen3.5's ReduceSums were not).

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

    Weights per output channel (W4A16: symmetric int4, scale s_w,j per column; measured: 12 one-op graphs of K = 1
    over every activation code, 6-128 columns each, steps -8 to 7, 51.1M codes, every one; the dense W4A16 model's 28
    projections on their own inputs, every code): the same arithmetic (steps in [-8, 7], never rescaled), its
    multiplier from the tensor's largest scale and each column's share of it, both in float32:

    S     = max_j s_w,j                                 the weight tensor's largest scale
    r_j   = float32(s_w,j / S)                          column j's share (times its rescale: 1 for int4)
    v_j   = 2^8 float32(float32(float32(s_a S) / s_o) r_j)   then M_j, e_j, q_o as above

    so a column's multiplier depends on the other columns' scales (layer 0 v_proj's column 50: M = 2222254 among
    its 64 columns, 2222253 beside 5 of them whose largest scale is another; the order of the columns does not
    matter); with each column's own scale in the ratio (s_a s_w,j / s_o, the per-tensor chain) 6 codes of the
    model's 28 projections were one off, and 1,482 of 16.8M codes on two K = 1 sweeps of 128 random scales (13
    columns). Refuted: the other float32 orders of s_a, s_w,j, s_o and the float64 ratio (59-61 of 64 columns),
    a 22-bit rounding of the largest scale's multiplier times the share (Q14-Q32 or float32; 59-62 of 64 columns).

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
    K    = s_a (1 / s_b) (1 / s_o) in float32 (one rounding per operation) = K_m 2^e_K, K_m a 15-bit integer
           (rounded half up; a mantissa rounding up to 2^15 is the next octave's 2^14: 14 bits)
    A    = floor(n K_m / 2^(k + 1) + 1/2)                  n K_m normalised to ~15 bits (K_m / 2 <= A <= K_m)
    R    = r 2^(e - 29) ~ 1 / n_b: n_b = q_b - z_b > 0 as m 2^-e, m in [2^15, 2^16); r = recip_mantissa(m >> 1):
           4 quadratic pieces per octave of m, evaluated in fixed point (RECIP_PIECES; 14 significant bits, within
           5.5e-4 of 2^29 / m: not the correctly rounded reciprocal; m's lowest bit is dropped)
    q_o  = clip(sign(q_a - z_a) floor(A r / 2^(28 - e - e_K - k - g) + 1/2) + z_o, 0, 2^16 - 1)

    so the quotient carries the reciprocal's error (-5.2e-4 to +5.4e-4 relative: up to ~18 codes at 2^15 steps)
    and the rounding of n K_m to 15 bits (half a step of A: 2^-15 relative), each rounding half up on the magnitude
    (symmetric about the zero point, where ONNX rounds the signed value to even). n_b <= 0 (a divisor at or below its
    zero point; no RMSNorm input) is not modelled: the quotient saturates.

Neg, the fused SiLU product, Sigmoid, the uint16 x uint16 MatMul, Softmax (its exps' and reciprocals' tables),
RoPE's fused rotate_half, ReduceSum, the Div by a constant (folded), Exp and a Gemm with a float bias (on the float16
grid): the sections further on (Sub: Add's).
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


def add(qa, a: tuple, qb, b: tuple, out: tuple, qrange: tuple = UINT16, sign: int = 1) -> np.ndarray:
    """The HTP's quantised Add (sign -1: its Sub, a - b).  qa, qb: codes (broadcastable); a, b, out: (scale, zero
    point) of each, per tensor.  -> int64 codes of the output, broadcast shape."""
    (sa, za), (sb, zb), (so, zo) = a, b, out
    ra = np.float64(np.float32(sa)) / np.float64(np.float32(so))                  # r_a = s_a / s_o
    rb = np.float64(np.float32(sb)) / np.float64(np.float32(so))                  # r_b = s_b / s_o
    k = multiplier_shift((ra, rb), ADD_MULTIPLIER_BITS)                           # the shared shift
    ma, mb = multiplier(ra, k), multiplier(rb, k)                                  # m_i = round(r_i 2^k)
    na = np.asarray(qa, np.int64) - np.int64(za)                                   # n_a = q_a - z_a
    nb = np.asarray(qb, np.int64) - np.int64(zb)                                   # n_b = q_b - z_b
    acc = np.int64(ma) * na + np.int64(sign * mb) * nb                             # m_a n_a +- m_b n_b   (Q(k))
    return np.clip(round_half_up_shift(acc, k) + np.int64(zo), *qrange)            # q_o, saturated


def sub(qa, a: tuple, qb, b: tuple, out: tuple, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's quantised Sub a - b: its Add with the second input's multiplier negated (m_a n_a - m_b n_b, the
    same shift and rounding half up).  -> int64 codes, broadcast shape."""
    return add(qa, a, qb, b, out, qrange, sign=-1)


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
# ... of the ratio less 1e-5 of it, rounded (measured: the multiplier read off 60 one-op ReduceSum sweeps at random
# float32 scales, r 0.5-2, each fixes m: every one m = round(r 2^k (1 - d)) for one d in (9.61e-6, 1.0095e-5), none
# with d = 0 at 20; on the models' dumps, every code of all 375 ReduceSums / ReduceMeans on their own inputs (dense,
# MoE, Qwen3.5 x QNN / aimet-onnx W8A16 / W4A16; the earlier rule floor(r 2^k + 1/4), a fit of this one: 363))
MEAN_MULTIPLIER_DEFICIT = 1e-5


def mean_multiplier(r: float) -> tuple[int, int]:
    """ReduceMean's (and ReduceSum's) int16 multiplier of the ratio r: (m, k), k the largest shift with
    m = round(r (1 - 1e-5) 2^k) <= 2^15 - 1."""
    v = r * (1 - MEAN_MULTIPLIER_DEFICIT)                                          # r less 1e-5 of it
    k = 62
    while np.floor(v * 2.0 ** k + 0.5) > 2 ** MEAN_MULTIPLIER_BITS - 1:            # the int16 multiplier's shift
        k -= 1
    return int(np.floor(v * 2.0 ** k + 0.5)), k                                    # m = round(v 2^k)


def reduce_mean(qx, x: tuple, out: tuple, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's quantised ReduceMean over the last axis (keepdims): ReduceSum's arithmetic (reduce_steps) at
    r = s_x / (N s_o).  qx: codes [..., N]; x, out: (scale, zero point), per tensor.  -> int64 codes [..., 1]."""
    (sx, zx), (so, zo) = x, out
    q = np.asarray(qx, np.int64)
    r = np.float64(np.float32(sx)) / (q.shape[-1] * np.float64(np.float32(so)))   # r = s_x / (N s_o)
    return reduce_steps(q, r, zx, zo, -1, True, qrange)


# ReduceSum over one axis, uint16 (Qwen3.5's l2norm sums of squares over the last axis and the delta rule's S^T k, S^T q
# over Dk, the MoE's top-k weights' sum and its expert terms summed over the k slots; measured: 99.5 % of codes
# identical, max 1, over 80 one-op sweeps of random codes at random encodings (s_x / s_o 0.05-3, zero points 0-65535,
# N = 2 and 16, the last and a middle axis), 76 of them every code; the CPU EP's exact QuantizeLinear 2-75 %):
# ReduceMean's multiplier of r = s_x / s_o; below r = 1/2 (a shift over 15) a whole step added, from r = 1/2 the
# codes themselves summed and the zero points' term truncated apart (ReduceMean the same at r = s_x / (N s_o)):
#
#     r   = s_x / s_o
#     m   = round(r (1 - 10^-5) 2^k), k the largest shift with m <= 2^15 - 1      (mean_multiplier)
#     k > 15:  q_o = clip(floor((m sum_i (q_i - z_x) + N) / 2^k + 1) + z_o, 0, 2^16 - 1)   a whole step added, and
#                                                                                     a unit of Q(k) per term
#     k <= 15: q_o = clip(floor((m sum_i q_i + 2^(k-1)) / 2^k) - floor(m N z_x / 2^k) + z_o, 0, 2^16 - 1)
#
# so from r = 1/2 every code carries the zero point term's truncation (a constant 0-1 code, 1/2 + frac(m N z_x / 2^k)
# over the sum's rounding, as measured on each sweep), below it a half code up. The multiplier is r less 1e-5 of it,
# rounded (mean_multiplier: the "floor(r 2^k + 1/4)" read before, which missed 4 of 80 sweeps and 12 of the models'
# 375 reductions, was its average: r 2^k's fraction 0.58-0.79 rounded either way). Below r = 1/2 the sum carries N
# more units of Q(k) (measured: the one (m, C) with y = floor((m S + C) / 2^k) over 60,000 row sums S of each of 8
# one-op sweeps, ReduceMean N = 16-64 at k 16-18, ReduceSum N = 2-16 at k 16-17, zero points 0-1000: m the model's,
# C - 2^k in [N, N + 2) every time; without it 99.90-99.997 % of codes, one lower at sums whose fraction reaches
# 1 - N 2^-k: the aimet-onnx Qwen3.5 W8A16 dump's layer 1 post-attention mean, one row of 8).
REDUCE_SUM_SPLIT = 15             # the shift above which a reduction adds a whole step (r < 1/2), below it rounds


def reduce_sum(qx, x: tuple, out: tuple, axis: int = -1, keepdims: bool = True, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's quantised ReduceSum over one axis.  qx: codes; x, out: (scale, zero point), per tensor.
    -> int64 codes, qx's shape with the axis reduced (kept as 1 with keepdims)."""
    (sx, zx), (so, zo) = x, out
    r = np.float64(np.float32(sx)) / np.float64(np.float32(so))                    # r = s_x / s_o
    return reduce_steps(np.asarray(qx, np.int64), r, zx, zo, axis, keepdims, qrange)


def reduce_steps(q: np.ndarray, r: float, zx, zo, axis: int, keepdims: bool, qrange: tuple = UINT16) -> np.ndarray:
    """ReduceSum's (and ReduceMean's) arithmetic: the codes q summed over axis times r's int16 multiplier.
    -> int64 codes."""
    m, k = mean_multiplier(r)
    if k > REDUCE_SUM_SPLIT:
        acc = np.int64(m) * (q - np.int64(zx)).sum(axis=axis, keepdims=keepdims)    # m sum_i n_i   (Q(k))
        acc = acc + q.shape[axis]                                                   # + N: a unit per term
        return np.clip((acc >> k) + 1 + np.int64(zo), *qrange)                      # floor(acc / 2^k + 1) + z_o
    acc = np.int64(m) * q.sum(axis=axis, keepdims=keepdims)                         # m sum_i q_i   (Q(k))
    z = (m * q.shape[axis] * int(zx)) >> k                                          # floor(m N z_x / 2^k)
    return np.clip(round_half_up_shift(acc, k) - z + np.int64(zo), *qrange)          # q_o, saturated


MATMUL_DROPPED_BITS = 8           # MatMul's products summed, the low 8 bits dropped (floor; the zero point's rounded)
MATMUL_RATIO_BITS = 11            # a column's weight rescale r (its steps leave int8): Q11, rounded half up
MATMUL_RECIP_BITS = 16            # 1 / r as a Q16 multiplier of the steps (k' = k / r rounded half up)
MATMUL_MULTIPLIER_BITS = 22       # the requantisation's multiplier: a 22-bit mantissa of the float32 ratio, half up
MATMUL_BIAS_BITS = 9              # its bias: the multiplier's mantissa times 2^-9 of a code
# A Gemm's int32 bias (Qwen3.5's in_proj_a with dt_bias fused; its codes q_b at s_b = s_a s_w): added to the products'
# sum after their low 8 bits are dropped, itself in the column's accumulator unit with its low bits truncated towards
# zero (measured: 99.8-99.9 % of codes on 6 one-op sweeps: zero weights, activations at their zero point, random, a
# ramp of biases and random ones, the rest the MatMul's own 1-code residual; Qwen3.5's 3 on the HTP's own inputs,
# every code, with columns rescaled by r 1.008-1.10; refuted: the bias rounded or floored (50-59 %), added before the
# low bits are dropped, folded with the zero point's term, undivided by r (50-75 %, up to 184 codes)):
#
#     B_j = trunc(q_b,j s_b / (s_a s_w r_j 2^8))         the bias in the accumulator's unit, towards zero
#     acc = floor(sum_i q_a,i k'_ij / 2^8) + B_j - round(z_a sum_i k'_ij / 2^8)


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
    as M 2^-s, M a 22-bit integer (rounded half up).  a, w, out: (scale, zero point) (s_w per tensor, or per column:
    then the tensor's largest scale in the ratio and each column's share of it in r, matmul_channel_shares);
    r: the columns' rescales.  -> (M int64 [N], s int64 [N])."""
    sw, share = matmul_channel_shares(w[0])                                         # per column: max s_w, s_w,j / max
    ratio = np.float32(np.float32(np.float32(a[0]) * sw) / np.float32(out[0]))     # s_a s_w / s_o
    r = np.float32(np.asarray(r, np.float32) * share)                               # r s_w,j / max s_w (1: per tensor)
    v = np.float64(np.float32(ratio * r)) * 2.0 ** MATMUL_DROPPED_BITS             # 2^8 (ratio r)
    f, x = np.frexp(v)                                                               # v = f 2^x, f in [1/2, 1)
    m = np.floor(f * 2.0 ** MATMUL_MULTIPLIER_BITS + 0.5).astype(np.int64)           # M = round(f 2^22), half up
    top = m >> MATMUL_MULTIPLIER_BITS                                                # f rounded up to 1: M = 2^21
    return m >> top, MATMUL_MULTIPLIER_BITS - x.astype(np.int64) - top              # (M, s): v ~ M 2^-s


def matmul_channel_shares(sw) -> tuple[np.float32, np.ndarray]:
    """Per-channel weight scales as the HTP's multiplier takes them (module doc: "Weights per output channel"): the
    tensor's largest scale and each column's share of it, both float32.  sw: scale per tensor (share 1) or per
    column [N].
    -> (max s_w, s_w,j / max s_w [N] or 1)."""
    sw = np.asarray(sw, np.float32)
    if not sw.ndim:
        return sw, np.float32(1)
    top = sw.max()                                                                 # max_j s_w,j
    return top, np.float32(sw / top)                                               # float32(s_w,j / max s_w)


def matmul(qa, a: tuple, qw, w: tuple, out: tuple, qrange: tuple = UINT16, bias: tuple | None = None) -> np.ndarray:
    """The HTP's quantised MatMul of uint16 activations [..., K] and per-tensor 8-bit weights [K, N]: uint8, or int8
    symmetric (aimet-onnx's), the same arithmetic (module doc: a column whose steps leave int8 rescaled,
    matmul_column_steps; the multiplier, matmul_multiplier); or symmetric int4 weights per output channel (W4A16:
    the multiplier from the largest scale, matmul_channel_shares).
    a, w, out: (scale, zero point), w's scale per tensor or per column [N]; bias: None, or (int32 codes [N], scale)
    of a Gemm's bias (above).
    -> int64 [..., N]."""
    (sa, za), (sw, zw), (_, zo) = a, w, out
    b = MATMUL_DROPPED_BITS
    k, r = matmul_column_steps(np.asarray(qw, np.int64) - np.int64(zw))          # k' (int8), r per column
    hi = (np.asarray(qa, np.int64) @ k) >> b                                      # floor(sum q_a k' / 2^8)
    zp = (np.int64(za) * k.sum(axis=0) + (1 << (b - 1))) >> b                     # round(z_a sum k' / 2^8)
    if bias is not None:                                                          # a Gemm's int32 bias
        unit = np.float64(np.float32(sa)) * np.float64(np.float32(sw)) * r * 2.0 ** b    # the accumulator's unit
        hi = hi + np.trunc(np.asarray(bias[0], np.int64) * np.float64(np.float32(bias[1])) / unit).astype(np.int64)
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


# Div by a constant (a uint16 initializer: Qwen3.5's q / sqrt(D_k), Div(x, 4)), measured on one-op graphs of every
# input code: where the output encoding is the input's divided by the constant (s_a / (c s_o) = 1 within float32's
# rounding, the zero points equal: the graph's own encoding) the HTP folds the Div away, its codes the input's (100 %
# at 4 encodings: constants 4, 3, 1.48, two input encodings; the Div model 10-72 %, 2-9 codes); at 6 others (constants
# 4, 2, 1.48, 2.69; ratios 0.67-0.999999, z_o moved by up to 3000) it is the Div model, every code (the same Div with
# the divisor fed as a graph input is the Div model at ratio 1 too).
#
#     |s_a / (c s_o) - 1| < 2^-24 and z_o = z_a:  q_o = q_a,  c = (q_c - z_c) s_c the constant
DIV_FOLDED_TOLERANCE = 2.0 ** -24  # a Div by a constant whose output encoding is the input's / c: folded away


def div(qa, a: tuple, qb, b: tuple, out: tuple, qrange: tuple = UINT16, constant: bool = False) -> np.ndarray:
    """The HTP's quantised Div of two uint16 tensors, the divisor above its zero point (n_b <= 0: saturated, not
    modelled).  qa, qb: codes (broadcastable); a, b, out: (scale, zero point), per tensor; constant: the divisor is
    a constant of the graph (one value; folded away where the output encoding is the input's / c).  -> int64 codes."""
    (sa, za), (sb, zb), (so, zo) = a, b, out
    if constant and np.size(qb) == 1 and int(zo) == int(za):
        c = (int(np.ravel(qb)[0]) - int(zb)) * np.float64(np.float32(sb))          # c = (q_c - z_c) s_c
        if c > 0 and abs(np.float64(np.float32(sa)) / (c * np.float64(np.float32(so))) - 1) < DIV_FOLDED_TOLERANCE:
            return np.asarray(qa, np.int64)                                         # q_o = q_a: folded
    one = np.float32(1)
    k_ratio = np.float64(np.float32(sa) * (one / np.float32(sb)) * (one / np.float32(so)))   # K = s_a (1/s_b) (1/s_o),
    e_k = int(np.floor(np.log2(k_ratio))) - DIV_SCALE_BITS + 1                     # float32, one rounding per op
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
#
# where the sigmoid's encoding (s_b, z_b) is (2^-16, 0) whatever the graph's says: the device's Sigmoid codes mean
# sigmoid(x) 2^16 (Sigmoid, below), and the fused product reads them so (measured on the dense aimet-onnx W8A16 model,
# whose Sigmoids carry calibrated encodings, s_b 1.47e-5 to 1.51e-5: its 4 SiLU products on the HTP's own inputs every
# code; with the graph's s_b 0.07-0.7 % of codes, up to 2,041 off). ONNX Runtime's QNN config gives (2^-16, 0) anyway.

SILU_EXTRA_BITS = 30              # the fused product's extra rounding: 2^30 at Q34, a sixteenth of a code
SILU_SIGMOID = (2.0 ** -16, 0)    # the sigmoid's codes as the fused product reads them: sigmoid(x) 2^16


def silu_product(qa, a: tuple, qb, b: tuple, out: tuple, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's fused x * sigmoid(x): qa the codes of x, qb those of its sigmoid (the Sigmoid's own quantiser);
    a, out: (scale, zero point), per tensor; b: the sigmoid's, not read (the device's codes mean sigmoid(x) 2^16:
    SILU_SIGMOID).  -> int64 codes, broadcast shape."""
    (sa, za), (sb, zb), (so, zo) = a, SILU_SIGMOID, out
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


def _stepped_table(steps: tuple, first: int, sign: int = -1) -> np.ndarray:
    """A measured table stored as its successive steps (bytes, zlib, base64): first, first + sign * (the running sum
    of the steps)."""
    import base64
    import zlib
    step = np.frombuffer(zlib.decompress(base64.b64decode("".join(steps))), np.uint8)
    return np.concatenate([[first], first + sign * np.cumsum(step, dtype=np.int64)])


SIGMOID_TABLE = _stepped_table(SIGMOID_STEPS, 2 ** 14, +1)                      # S(k), k = 0..62485


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


# Every consumer reads the Sigmoid's codes as sigmoid(x) 2^16 (SILU_SIGMOID), whatever the graph's encoding (measured
# on aimet-onnx's Qwen3.5 W8A16 dump, its Sigmoids at calibrated encodings, s 1.44e-5 / 1.48e-5): the gated
# attention's x * sigmoid(gate), a plain Mul, every code so (0.6 % read at the graph's encoding, up to 894 codes);
# a Gather of one token (the delta rule's beta_t) requantises them into its own encoding (the graph's) with an int16
# multiplier, rounded half up: every code of the 32 of layer 0 (exact rounding 84 %, the fractions 0.51-0.55 one lower;
# Q11-Q17 fit alike, Q14 is the int16 multiplier's shift here):
#
#     m   = round(float32(2^-16 / s_o) 2^14)              q_o = floor(q m / 2^14 + 1/2) + z_o

SIGMOID_MOVE_BITS = 14


def sigmoid_moved(q, out: tuple, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's Sigmoid codes (sigmoid(x) 2^16) moved by a Gather into the encoding out (scale, zero point)."""
    so, zo = out
    r = np.float64(np.float32(np.float32(SILU_SIGMOID[0]) / np.float32(so)))        # 2^-16 / s_o
    m = np.int64(np.floor(r * 2.0 ** SIGMOID_MOVE_BITS + 0.5))                     # m = round(r 2^14)
    y = (np.asarray(q, np.int64) * m + (1 << (SIGMOID_MOVE_BITS - 1))) >> SIGMOID_MOVE_BITS   # floor(q m / 2^14 + 1/2)
    return np.clip(y + np.int64(zo), *qrange)


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
#                                                       with the previous multiplier);
#                                                       at z_b = 2^15 (aimet-onnx's symmetric activations) the
#                                                       top is 127, not 255 - z_8 = 128: that step saturates, its
#                                                       column not rescaled (K = 1 sweeps at z_b 32767 / 32768 /
#                                                       32769; the dense aimet W8A16 model's probs @ v, 16 codes
#                                                       up to 253 off with the rescale, every code so)
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
MATMUL16_SYMMETRIC_ZERO = 1 << 15  # a second operand of this zero point (symmetric): its steps saturate at int8's 127


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
    top = min(255 - z8, 127) if zb == MATMUL16_SYMMETRIC_ZERO else 255 - z8         # z_b = 2^15: int8's top
    k8 = np.clip(t >> 16, -z8, top)                                                # k_8, on the uint8 grid
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


# Softmax over the last axis, uint16 (rows of 3 or more elements; measured on the QNN 2.51 HTP v75 simulator with
# one-op graphs whose rows hold the maximum, a swept element and elements far enough below it to have no exp, each
# row's reciprocal read off the maximum's output, the swept element's exp off its own): the exps are 15-bit integers,
# the device's table of 2^-f at a Q16 fraction of y = (x_max - x) log2(e) shifted right by y's integer part; their sum
# S, scaled by the output scale's mantissa (halved at (1 / 65535, 0)), indexes the device's reciprocal tables; each
# probability is E_i r floored, shifted by the output scale's exponent (in units of 2^-16 at (1 / 65535, 0)):
#
#     n_i = q_max - q_i                                     the row's steps below its maximum (integers)
#     M   = floor(s_x log2(e) 2^(22 - k)) 2^k               y's multiplier, Q22 truncated to a 16-bit mantissa (k the
#                                                           least shift that fits it: every attention Softmax's s_x
#                                                           ~0.015 has k = 1)
#     y_i = n_i M                                           y in Q22
#     i_i = floor(y_i / 2^22),  f_i = floor(y_i / 2^6) mod 2^16      y's integer part; its fraction in Q16
#     E_i = T(f_i) >> i_i                                   T: the device's table (SOFTMAX_EXP_TABLE, T(0) = 32767,
#                                                           within -2.3..+1.9 of 32768 2^-f: four smooth quadratic
#                                                           pieces per octave, their fixed-point form not found)
#     S   = sum_i E_i                                       the exps' sum
#     m   = floor(mu 2^16),  s_o = mu 2^e, mu in [1/2, 1)   the output scale's mantissa, 16 bits truncated
#     h   = floor(S m / 2^16) in [2^(14 + l), 2^(15 + l))   the sum scaled by it (at s_o = 1 / 65535 or 2^-16, m =
#                                                           2^15: h = floor(S / 2), the half-sum) and its level l
#     c   = 13 + 2 l (l <= 2), 18 (l = 3), 15 + l (l >= 4)  the level's shift
#     q_i = floor(E_i R_l(h) / 2^(c + 15 + e))              l = 0, 1, 2: R_0 ~ 2^28 / h, R_1 ~ 2^30 / h, R_2 ~ 2^32 / h
#                                                           l = 3: R_3 ~ 2^33 / h (h < 2^18): the device's tables
#                                                           (SOFTMAX_RECIP_TABLES), each of all of h's bits; l >= 4
#                                                           (h >= 2^18, sixteen maxima's worth at s_o = 2^-16) R_l =
#                                                           floor(2^(30 + l) / h): NOT the device's (its 16-bit
#                                                           reciprocal of all of h's bits, not tabulated: 99.1 % of
#                                                           level-4 rows' reciprocals, max 1 code)
#     q_o = clip(q_i + z_o, 0, 2^16 - 1)
#
#     so the output encoding enters twice: its mantissa scales the sum before the reciprocal (its 16 bits truncated),
#     its exponent e the final shift (a left shift where c + 15 + e < 0). At ONNX Runtime's QNN encoding (1 / 65535,
#     0) and at (2^-16, 0) that is the half-sum's reciprocal; at aimet-onnx's calibrated router encodings (s_o
#     8.3e-6 to 1.17e-5) the sum is scaled by 0.55-0.77 first (found on rows of 16 and 64 exps at s_o 1.07e-5, each
#     row's reciprocal the one integer that fits all its codes: R_1(floor(S m / 2^16)) every one at level 0; every
#     code of 15 output encodings' sweeps where h < 2^18, s_o 7e-6 to 4e-5; the product E R_l(h / 2) times 2^-16 /
#     s_o floored once, the model before, 75-87 %, the codes at (2^-16, 0) requantised with an int16 multiplier
#     rounded half up 33-67 %). Where two reciprocals gave the same codes for every 15-bit exp at s_o = 2^-16 (12
#     entries of R_2, 43 of R_3) the tables hold the device's as read at s_o = 0.75 2^-18 (a shift 3 bits lower):
#     the higher one at 23 of them (SOFTMAX_RECIP_HIGHER)
#
# The tables (T at every f, R_l at every h of its level) were read off the simulator (646,000 exps at 160
# multipliers: one value per Q16 fraction, conflicts at Q15; R_2 and R_3 from 1 and 3.8 million random rows), not
# fitted; the reciprocals are not the correctly rounded quotients (round(2^30 / h) is 87 % of R_1, round(2^32 / h)
# 85 % of R_2, floor(2^33 / h) 81 % of R_3) nor one level's table at another's h / 2 (R_2(h / 2): 66 % of R_3).
# Against the device: docs/htp.md §9. With s_x log2(e) >= ~1 (y's multiplier at 2^22) the simulator runs another
# kernel (exps of more than 15 bits); rows of 2 elements too.
SOFTMAX_Y_BITS = 22               # Softmax's y = n s_x log2(e): a Q22 multiplier of the integer steps n,
SOFTMAX_MULTIPLIER_BITS = 16      # truncated to a 16-bit mantissa
SOFTMAX_FRACTION_BITS = 16        # T's index: y's fraction in Q16
SOFTMAX_EXP_BITS = 15             # the exps: 15-bit integers, the row's maximum 2^15 - 1
SOFTMAX_RECIP_SHIFT = 13          # level l's probabilities E R_l(h) / 2^(13 + 2 l), l <= 2; 2^(15 + l) above
SOFTMAX_SCALE_BITS = 16           # the output scale's mantissa m scaling the sum: 16 bits, truncated
# The tables as their successive decreases (bytes, zlib, base64), read off the simulator (module comment above):
# T(f) for f = 0..2^16 - 1 from 32767; R_0(h) for h = 2^14 - 1..2^15 - 1 from 16384 (S = 32767, a lone maximum,
# has h = 2^14 - 1); R_1(h) for h = 2^15..2^16 - 1 from 32767; R_2(h) for h = 2^16..2^17 - 1 and R_3(h) for
# h = 2^17..2^18 - 1 from 65534 (R_2 and R_3 near the ratios' exact values hold either of two reciprocals that give
# the same codes for every 15-bit exp at s_o = 2^-16: the lower one, SOFTMAX_RECIP_HIGHER's 23 read since).
SOFTMAX_EXP_STEPS = (
    "eNrtWIlyGzcMlf3/H91x26S2RRLvAkk5nUyStZYE3gXuWo+3x8efx8fft4//f198/H1/fLr4+8O3Txe/tn3Z/2XVr21f9v/T5ff+t38/WOFACno8SE"
    "BPBf+r7O6HAM0lHzj0rdDTfgfZtDKUHY0i5WaVJiIWhIpEISL5KlZilrLsn8MU955Dz4F9N92cN20sTfFZlgYOGduOnC+Oiu3N2Fiw+ZC7AqmU28/D"
    "BByaRXsfB5A8Rg/flydAizAGkdUQ4QNAwoqDjqaJRo/KKFnOMFxhfCfIA+KPX6g8+KZl+gVKkTS6SQ9UISQNeizwi8db/mI8QesLR+HAxeRI2X6xYa"
    "ag5NGDtz2VWyAG2kcs6+tRpaGpopb8WKHVkQA8Ddz9ywOxTp64TYrOSvL8NkFOerWsWXVIQKsFYVCGxGpIBpWPuCiFnqbYBHq0SCCEuzAJExm0FURF"
    "RRF1mQZWM0RPH1CtEKJeGT0dBz8CZGJIGZT2ZE6XAm/vWk6pojAW6kVl184Ujf4ey8p5QlDBwRtNqrRXUISfwjqE3yMDVqeJPTsdEmnJ8rwdNdfaha"
    "ivJqA6aEuFDMseFjPS+zkOWuGYHkwhxmDJDpuH2X6ZSjAEiV29pPFdUHRnOXWxrqeU2r/0pSamjaIDcdxisZ93gdeDaUYyW/k7e7ETZchoBqgHEAKi"
    "Q/nCJE5dTNnBnIOunNU2KoNGhmQ9fxYObhTf0rOdLO3omlf4W8GCzyPYPpGqlgziNDKEONJcLDhhBk5TawarN3TN6OE5hTzDvMTN10zTnZWBJsa4mA"
    "A0f7Pa2IxIZSXj/NQq+MwPq5gwMGn20CQKBXCYwjrbt3Kdbt/TA1Hx0SA1hF6imG4/PbMJ9rr4g6YifDsWLjMiTA/TjoepB0OV3B9RcXQr2pUHlJPB"
    "u8WlIX2L9Ay9xTvFgZ3cWpxIxUjX01XOZARiHZkoDkwPzBdMfCw6+YqMv6odD1xzcEwe0NOoDZm5jZIaYdjfHqvTLP78q6nPkRgaNf5K57Gq+jVodt"
    "XRdxfj16D1S4HHe/Yd49df255hz8/DomkpxibYLNhabVQX0c4hl9YGqhvj3/inDYqyQ1q+8ziZZXY9CaMM9V6Vh7MTtggkfjxoZDUFCGfpmY8JP8RS"
    "8G7GQowBg0X+8OkVQc1LFpac7aGEU10rE7UPS4QO7GH2GtUGBnkekgWDhhA1M8SPcOD3XJ5Xgix7FLnOkydsxlp4U4uEVbQANavo8WrrwrvG1HJ2tw"
    "pC0UMSyRMdPT2FbUuFw9ZZ2g67UcLsLjJaYCCJiYFGEhq5pgKtYKoXWvbyKX3Pl8sUk4FlDxXL+UygLI94tdHjQxnkVIr9SyIcz7qgl4Tx7Zc9DM3h"
    "77KeDGxXyDzYtNri8SHkRZ75xWVMwgV84PwJgoXtFC3SxwDVJWhX1VVrNTsp1MCiI1XsI4THi04vB2Q3M6ScXSJYGzduKxFwJfR7uQoZDRwykt3xBs"
    "8S9VT93iBjZ8JDuWr9/sMALKazVhCZeU4C2XnYbkNCj2yJ0BVrfhaC+6d2TjygYVn796qdxVIEqlEXulZaDIkMF1ggpdM4rBKvqlHRXs+Z48FaglUK"
    "ga4B2B0FkiFBJcaxAsMBGQPkCThUaIbrQdSEBUJA6oI7D9QvduFi0CEhJdy8i9At7tFgqbbLMCYW6OzItYfkpgZbPYhguUKXq5Z++mh0PddteP22vq"
    "0vXeEDl7JiyWchurQ6l+2lS2FvC+wZjzYY0yRhutRMC4GsjjCYUjUkghh2jPsZqsI2K0Ab0wDbUXsyETslSkqYlLgbS+x+k4fuk0e+jwrPGNMihpoi"
    "xfmomkq0ehRob6B6OJVImQg7pfkCXcac0eUy2Fm10XMZ45UQQ4+e5BE9EeU7cAl8ueH7JrpaTeB7Vbvakj28sIEM5CfYXtOPZrmeixgzrM33lhobOv"
    "89+SH7Vy5396/CTGYBBVYfRvmeWhggAwJgSvP9mHjHR8C/wADrwoLIeMg2F/wwDirLR0mAmcSfvVG/GC5v4IfpdspmQzGM0xfIBJwuNqHtYv4xajH9"
    "Qqu2NEnpHzVDsKyDaJvObbwukeLAFoELcbK4w/Bz97v6RfdHw9Rf7KI2+3pOvubrA4A/jIoHEPdk6wnza/7w/MUs9wTMmYn0mw/GMLFbxXzx/Nma7e"
    "R/VrS9Zh4hEyybg5wLU7s1RP4PJUPVz+zIHiZbhGFPtv5hIMLUpczR/ln+6WEOsGRQtxFjTlavS8BMT47Q7rR+PGm/sEGmw/8k/niy6CeT0WaPMj0q"
    "M4xj/mlNk5V5+c5SNm0yYwrrp0fGwIJK5ji7vRhyGCCaLd6MdnCBXxMdZklhsR2BMPNT6pK5QoyftT+rP+U/OQzUMDVRhn6aQdY8I2euu2VTMoWWHW"
    "FQtUSfTHto2srYYtr6k12qN4sbJU9umYzZJKSc5ufI4PDbkFUnQ4dKqzYtlMOFkzK16R/kfAbMYn6T/iczo0B+PgyanSGJXSGZWjlu2aH+GH9/FZus"
    "9KqoTJgxK5mWq3TKCkx2Mss4e154ykQ518CkluUwSSxl/MswxVw6Wqw8JhKes8PUSYxN1ovxT41pYnutsmmGqZ+xTKYMSlrfzFYDb2obUpjPdJ45T3"
    "dOiHdQgqyEtNybet2K61BmGhQ6JEJOP1CTXmA5sXMpaIO9q3ew8AYoHXKPXjIOAA2nhsKYIblXka1qFv9cQutlfxTn8DWMywzNZoZbYCXrHyPW2Mnm"
    "dBfq+2vtBnL3ZotzSO0jrfLA/rTVKb1HD4x+yFygzhQLaH1Rr4OYD0HZxLPr9ksKtr9ub7NASC7hvMvIW5c3iBtbHktUh5qJ7W2Fw9svxJVo1FcOb3"
    "SMhw6kQ5EcpRYMh9vv8/KyTkdickVYbvs5WHSYoYv5/4xWx0sFE7aHdvtWQpEe2CfVvgSW3eu+2k2abMJ5tNZVem3FEdq7leQBFULAWtX2SeSBvAQr"
    "hvbeYmJjce2Jy3tQpzZva/T/5uDm01CyhY/I1FziIJFLW7/sPW/xfdq+jBrdu0/yvuWDn8Fi8sEfg+bG0u0br2lw2bqfuP3iZq/98Ut1+Il7/gIAhE"
    "AA")

SOFTMAX_RECIP0_STEPS = (
    "eNrdUwlS40AMlPn/o4EqkngcHd06Ji4WiKW+JM9kDzk2/JNRk0zuJjwlBIyCEAQgUuuJVg6wA5tz/1t8XXp7FaAulwEIVhgJcXaR0UqUwQpBnyCsL3"
    "ZFAKkqHWGsyAiUxoRqDvgzL4nhEtdDBWDN0/yRJxUF2T0rA+YLRFjT+bJYqibH4wQh1SgqgfzzsosxmCSGfAXshRi3JMnlIV+v8onrCV5M8bGM/l3J"
    "kVuA0T1e8DxLCwsrQnCq/97nECQVHGkqozAG0uOxCQ7NzFfHg3NaftWXt8Zls4HZkQMFTkwUHADoAEVkBlE7+KWyxNt2gB2DAAp9RpIdJOhlmgLiwS"
    "8OU1U+tCg0+fXlW3Pez9VfWK4hz5Z5GdfsvLe+pxxBClKvb2dJqxApUB7Pw2t+KDOut2NusMKmzT4B8zumLWhurtlNwrEjgYGvCZsrWcnpv+6yc+hQ"
    "m+W2dc7ziXM/xg0bOgtQcfWwjPGXRjljFTYOQH1z4zCMSwWO1z15cy/8soJLkuCuzqC7eHTJ7sVxK7//nO+GG/HwXI91zez/uUvghLhDkiXbiDJc0C"
    "UhGmjmJ6TFxo7m7ckybdTKmtLFkKI3zUnqCfRhxBoTyZ5dlYHxR1/S2KNNHqhsCNMho4IZ67xyjZxBIwkCJZmDFiiIzyiBiK7E1Ie52kAurAothqpv"
    "VIDUDI3utiapcEE8EyIp0Yj59NwTkZOU1T6UYZNosfz54KOv3xQwoUoMdSzdr4ewhKWODcMuk7c18JiEFKbkqikbM7DZP/y1zmRkwKStVVdWbOVIoi"
    "7fIpxxVSNK+TvIDzfDmhDuFKSkH64m5E3UsHm7sMU2oMqIPxt7q9wmWZoniJJ0CzJPJnT3Lvv0GXvDnPu2Q4rPQPeC89Q4DUoIGSlNyIu24ahdf4d8"
    "A102IAE=")

SOFTMAX_RECIP1_STEPS = (
    "eNrlVYd22zAMhPT/H530OalFCuOwSLltapME7g6Dw3Rs/kfXxRngFIZvIFEdjADEGWIl/EEn1dgpa00ZqaSXkClksSHkBVDZMo6FVyEXSKI6FJ2D5c"
    "94kjNVOlxz25wHh6CUAeoUtwrmjMIhqbaJbXB4GhwwYBpnHuVkfDBD5HdGhzzMBkH5HNyG4Dec5PxIC89AEeSU1mkh9RIo4jJtPoBrEfCLpqjDDcoI"
    "FelnIUmzZoiCV00drpK1bMTpqJvYR8Mvpq5ORHokjzJmLLxMcpt/TKfsEkUsfXkvLNbYJDQNdO/JlELxQth3VJQKKLs6kIZEFvyGOWGYgRXUo8Qdpt"
    "NOcT5caurhHHZ95qqmj1asIwwIAeBpc9iEo4XK7l4deDEzHigFPVdPDAKcKCUNBx1AKLUbgL4vdn54zYbduuwbOdKC3WpdJ9m0eAh09tMFqlLhemnO"
    "omaTNBcowwRdi8MFCTDlWoB1ACLvOsviLxGjgKViOAyfJwZbirZlqFgBJ8vc9J/d66m9ElGUvPNn0GloOEP6gcRUSPyxd4QdpYTqgf0wikJrLgLF8H"
    "wX7jeXLDB/Ku3OztPpqIvRASl7iiHFJogdEI+wNOWbRYeoz0SPt4H04AE173ipIaoDNNwuCVJkQbKCcpY8gbsX1W7B4i5ZMb8mJ707G+jpsDF/l8Ft"
    "dhTb8gWgpgeDuxD4F6kXy2bzYsGSR6sVF0yJJ1hkFZs0xNEK8NqvsXfxueRiBiOkrHRlGyYj4dkktUWuxKjxro3CHcP4nrE+DQJozleVzVnQgeIJSe"
    "ItEho9v/lzCD3cfS0cXbEjtr7dX62P1taUQzdNKuFthICeqRiIA0x96AoNL8Sr87hFFBiH3pZyrwJSOTlBUD71SVE9WzvS9fW19mT4VVFDDC86gFZF"
    "bsZgDwnthqIvbI13m6CWKDFdh0NpL9wtIAtn513AEDxAKKEWixRKvwY6/r+/9/ld0ic9keRfSUfmM8S9Y0D8N1HNT3pIxQhwreMbfP2OdI3riqHDKH"
    "O31KgUT/X+24jJKhnPP7nY2RNSUMnCzjNCQveMzVVSYILpbTdvrRZGCKIcFCs7QZ5pMbur7DU3hZVs5CjiNnBL5RjrG2hthiMYGBdkDuUHIvqAbDTw"
    "afEvhqsJRcFlY/ZySBgtTi8t4qeaQihsGXK7zXLeuhjVT8M/ZtLD2eEIAxetwTQXmAu8HlAAG6d8/uDExViyCdVr92TBflOOEVTKSI+/fSE2iMA64Y"
    "ta40yiywy1vFZrzHU9ZU5ByI+nVhxuEq4S41KNiBV+pRNZREoGNJkVef9CgENSnKtPBDOXyNwvkmDxKQ+dzvZEtiClgLruQuDu4osyIblg4R6oCGfC"
    "eJ1JTTWQXFs8JcjpAqXAIXKKtGHcK9UOibGVQ6CbYFkp0vdgvSZ6nkUE2GtykkqfmkA78xMc5aSHrSrBnCFA2W/gfIGC7WaEu9hjy0N9CiXatQTV00"
    "HrJgN+DFKMagGG4CFGjlcn0Ky3SvufSfxzu7Qq+8cIrWW2obfg1iBsUBM1qryb1KuTF2nJoZ/baWpjNVAaJB4itt1ZTivXKFwslmrGlFBLQm4C7CXV"
    "zFDo5kx7iXWajfx92NVqG6WWCxj2HlqJuwEVASc4eep29acND5ZfQCqCdcvUEyscq6DF5LRltcBmZwC3nJKflmqur6KbWifaRi/wPAeYWRaq9ubcQG"
    "hCVJGebFqI7NQty6SUsdq1212jUBPICeuD9sOTtCS1QaZJ7iGhnvY56AuMIUAA")
SOFTMAX_RECIP2_STEPS = (
    "eNrtWIliGysMJP7/j359bdPsgq7RBRunRwzSzOhArB2P8fHWf8aDI429Iq3MUQgf6ciRAfmFeJkijjhixPyjyjtcvoE6hnwKDZFAe4Y5bDUbjTa3qS"
    "WwE5Rk8UBwwwAJIH8koonUXiGFwBZwuqHOXQLQShomAZwSDBJZ3x2/5us1CqKAaz9ENycj6pd2v0uJMprjOIAjIG1kpFCHeFuG1flCg3hNJl8BaOsi"
    "B5viGeqIFBgSshhGQlgo6TVIU2RiQVPEhkMayscTd4RTDTn/PEXH3w8pY8Wu79ncz/XdgccYoJ+fl5aHZuaLoWkhvBMIuhLglYDeTRTskMS1cCwu5Q"
    "TB0GTypp8d1CjE4wyaS4hp4ASfc0n78qOFUYArm1pHyjAWeBLcDqADnUn+9yNRilJ2ytvsY/78q/I5GNGOyWTVlVIQyrh9RFVrGfThDXM29zrH7+/R"
    "x7WXv1drQ7j2SP3L3tnLDIOkIcHNkeTMC2EQhEGKRBwALkh3uRWmy/r3vkRT694ITxFQQK4HMOgwp7oD9TGsPSBLt9F8DlLbfmZwHH+WEChEckUoFW"
    "r6T53/oOeQGxcW/hpoOn8+NIzrh4j/TUrUjwGXrB4jV/yQ5PyBcRdzgecZNB4aHjPDxOStC8AR9S2Ri1fD3Ex5kvREPYOZg5c7Li7jEemOW0OAzpRa"
    "QpZmaMQ/5hMxiAkPstgLXM99oBT6FxiKj1fwYjxfHUZDZrrvDTFL+oGGMVKZ/nQQqdwEQF3TKsp3pSqnz6uo+sIEYMEsZjkYoGDHhKW6BBCnSJw9wj"
    "PakEPZ/jqBNh5a9VXbrMg3UDkp1qqUD7XO5As6lJjjgx9Cr2wYwTbUJLviwFkIlSbdalR1nbDL1wTB5gcJZKXO2O/9bz3hDMmRniR0uP4I6xMAE/r8"
    "XWEwEuBsU6RQ5QYnhfIIDsdpTfd6OXwsGgZl6tZGZIANAwjiPWDTYQy6rh3K1K/ffagJyvNJOkCpAWjfLSnmCOIOFpaFsZCzmY1LeVjUam6myx0wCF"
    "FXiGSaYkvXci5P0DKHKXPNGV6SvrkMAWg1TECkeHnWVweJLJgbAFcww0QONhwUDHLe7GTBLjmRfOs4f1fFsVGE141oPGJjhEtmUBd2JxBSLevpMzOF"
    "yq4ijiOaPt6Zj4cubR5tx+EvHSI+Kdp6zkJROpUf00b1oaTFNKTBSk3dhxrDTOlQzhP8kSBRHEC4B2BE7YgFHcNd06vVctKSBPNnYxojXIWFhK9YTV"
    "eslu6xSVLpiFDO1aA1ic8fppudzSqRNedM1uGgFntMFa8zhRE1NYOJG+gJd7mmxBNGfOjIGZFSNtnLwtoIHsXkYWgT2Q+7iikpuZE5L6nM+7SgUe5v"
    "A5iEFH5+qzEq30dnPqL5TcxYODGPVBD+M4t+5S/7+5ASb7RaptH9pS+4EHuKRoZwveYPDZYssNvALec50FNcxdakDW8ChsU6Z9rTEhS0LLw8rdkx+M"
    "nOFGF7jIh0TT6ORjVIOcNulQtACqghfRwkPm4dWrfnMXIxxvp4595ieDVyq3L5VInyUs5Uapx8KlLtekOMIeSTkLdkRqCUXCRYc7Rn0FllGjbKwpg/"
    "8yKhPhEa6gsnRbShbLOuRtWLT1HUsvw02gWIc/mCkiUwx8oUTNwD5nogl5E1s2lid5PupyWv1cWwiGeeILnHGXW3ALIgRlAWTLmk6/wZw4JthUqCW+"
    "5smislxxHNqToS5p8T7iJCldtFgSH0Blof7IUV5jV0W6I/fx1/3zup02UTBFJEzHEcxGB1rMhaujOaYAQ7BJQtZkt9geAtZjC/0OBaQIuvBWAtMAVZ"
    "f1uwdxc8SsLBiCt5Ky1hzdF7a2fFrgoWBTseLGFBP6EdVZ2p0Q0ZW8jlVKepV+kkUtywQWF5rMT0me2/1fRLvEvMWAq5NWlDNZEVhcsjg3h8l3dIuG"
    "QpACdy6fcFMX1vY8yDr+zW9OmLkmnjj0TbL8K3KLf42FxpHb2VTHWaS56+M+RvB3OF5IyrnVqPgAgmNkCq2BRVSYDP4zJLfAvvdmII10zsJazfbw4x"
    "NLWccrMG5s9rvtu82JyiqQbu7O4ySlCpcbbo1IGuDxHTmxEbkD+7uW6ugWwbqKxvTuo4KXWhC2rU2cYNF1vOfDDcLFLlzExxxCxPoRW+NoVKUO2rVr"
    "6lGk7JuOAquS9eYxADc9aiXWUXtJUadxwE/Cb7k2DHmQtIJu/BoDAlzMwSeFxg8OWxQTvJ7bhKQAkV8rSCC/iKaZNuTDAvthOaQGuSa1nvEctXb1DZ"
    "i+7Xow3bhUKwAjJs3SUONyA9TAo1xb8DVIb0wN2cLHa+To/se6R5dteOj7AthUJ8OrQ1YghQ4fOS8yiHBTCbO4Cp1IMs9RLZCVTFPon4XTeN3B7BA2"
    "i4gj8Qb0xmzE4TOAnk7KoXFCo1JT1xH0ojpTE/r/DrWZK1FIPrsjfMPhArkP65LrPXh7a1VXurQ1CVpoz+JRFsJ5Nf2RlAdsnd+JRliWj70uJArDXJ"
    "qOGRczkC82jHAbAEUoW8/YoYpzlchov6MTDw5f24Lrmj3E8QONnQKVMLYo7OZLPqddiA/IC+KM/SeKuLFYrNvQTqJIAzSvccRAs5zyW3SdggzULJEU"
    "sU80P3wV0MLynAi1FrlPISqtGrTLQl794u/eT+zf5xnX98MQf1simzJ+ieobKJfCynmLAXugXXCTolVkMt29xF1HRfn+DWMKcFaBfZbu2itwCTuU8x"
    "bRYqgNgO8gCKxkcnNNpIlJ+67yPngZuU5i+SkibMORsVNKeGvRfOk3iTzZm6JYQs0eJ88qlbzd1yDcKbtFzQHaRSoXbxb7Z6VqguYgU8T/Ngfr1rg0"
    "wIm0s+Nt5Tgx0ILBM41H4U7QB3o8ghkh5wgBOnpilkC21Q/87Jpb+8dXZnKLVzH4dOgjXJlPkPIj7F0axxUpwjAhRYTpTcCC8KtCOhs3DtlDR2hdBB"
    "kc5efoOIjdQS/LNAZfTjPJ0S5cAkXo1Mi+pB20cFO4HwaEQWqVDnXUz79I5EnqFbbX6UUJfYQa4DmYe7WxRaIe1KAGyr4lHKx1MCtCB1Pz1ZpkiuSH"
    "JDiI3hHp7Wt/r/+vV//AdcYX//")
SOFTMAX_RECIP3_STEPS = (
    "eNrtmNGW3DYMQ539/4/uQ89pN8l6REkACFJq2t0ZibiAaFl2+jzP8+v+Efy5sWSWFbA+mDy5VmgpYZZzivFMLE/O8inJL8ibpmlXJwk6i6lkmBuo5v"
    "B2LQdgN2hUl0FbHNKSUmtUFI+BBILZ/F65EFbgq0QJKmVgtBByYRKv4he5vFKR8ThXOlciqkYIwYy+H42oCZVUkIZIxEjH+JB1GkkJmKRUrZZv63AA"
    "CfKUD5ZcjkYM25hAwBA5hBNGhTBh0+9ajKTMAPp5WMfiIVUIuB3KPGeJmF9/fgBT4wsi9kPfVfNfhfjGKlI5rC61gCJNnPEtRg7FioW5FBAqMIW0WA"
    "qQgREFLBuYc0XiQotJ42rEAMVAuBZTnUzMMtImyxfIpzyloXkdBFxkULlSLtWg1CgECSZk+9v3+JHQyc2cf3ya3w+E3r1keo0a3djEdseybZphL8mq"
    "GBtkq6lb3vCdzZhbFU8cUgw6uDm/VcXi7w6v9o7piyoc3n0kNwoMmmMwkmYMiIIW2Ezb1WKEUmT8y/vhPHhnUwVFghAGgwrOEhcv5bo7jTW5Nmbyse"
    "GPtwIoH3PybUcs5sdFXi+a3+T8Ip1IFwcilkItTRv83pB8+/52/4ZeOTSreEv96yG3CRt/tP8nbg1uoOSpH8ZH74uxKVjy0D3DT1hoSO+cwgALeLgV"
    "zPBEnvs73WbsBM1Q/to3Soacj58X+NqX8JZCfczkDS/+ek5CeWQ56zW/Dy3eTcBFKSZea4AKL/1SWfCewDhlAV//njJ+gjp8ywX927ndu2acBbmSzO"
    "l48V5DMgDgXoTuvYxVgAZSMUQVtwgqnBibGxbJxSnn+sLJR7s8OcODV5GVBn9/Kg8eKajQWpQq2PT+GdHgMjlzcpJ5owAuo3Ieg8DY/XfGwKJnVSkL"
    "/97YgdMhDAWcVNJyN8U8OkeXJgUBHDE0HpMawTPNfzylVGv2viIfPHfkyw+LOhfm/tvq3wKxdoNGDsPzrgsSxEq9Gyq7R3mL1yrjz8K9e3P416ro2x"
    "W5MSbVXZDT+wlUh4tfB8OziJ4EgzuZsaqNaZI0Abst+rP09e3t05vdgDZ+HQwvMfQMgUx8Pc+zsndRE0kcYnnGOoWjjlZ4H3LG16dJ4PUifIKQ+xFL"
    "nzyUDIKVvD6/3l9BfigZvb8uH3Ox1yFCtwASQwvp99mTxNeMVzwlFpEKT8ox75WIKIs54Avzox/yhch9eThPX9DgQ39lbwyTvwcB9lcJ9cXXH95ffO"
    "SwH+74/cSR24JqBom70czc0jIiKkgOt7Uu96mTaUkE1yf60Jkpn2RKSCX0qVNeDrJaI7EmwFiyUCEd8GRXsMh3sjccjM/eMyibQeFs+6aogzCLWQeR"
    "FxuxaOoKqYjkxdjXpEphBDQogf7pJMmLY/iLSD+5rU2tHYGAYwCuHXED92DQYpQrmGLp2Jw+ZJuUsefndo9w3khobVUQbhgAnBVsYGFpM1LDRA1Als"
    "tYzpP1IAt1Xmii+tuELsawDrY99iPvbdr9ywW74JiFu3wsZdNeag7dLMr1SAAXmimGoBcm66wxvK+eAY+JIteXFBhXOGFrcu6QLU8kLl7pwT1nOBGU"
    "rFDBakyZQanTWb5FDI4twZbJDdOJvFIbsq3DokQvy5Pmyz0xJBwJScSKLRLtTCM0iHjbcf/79dwG1GzImSFqGxwE9IDkAooIdW7HCTjFydSkwgRayS"
    "IRpX5BU3WTSRtkN1yHiSJ8ebUxQso9dbAHz8SAWuUIR8kSwYlO5wwUdBDrC5ULYc1nM0BlS1N1eAiZqMQ3iST/cnJIR6xUXLBeVhKoT46rZ1fE3dHQ"
    "aCMUQ5TArDDt5SJO7bMOZ0GGlRnCnpVvY52g0oev53luH3Y+HBShN+wAKVHhgNYXykA2RqT5WrZYmYSWaVJsuLQT3beQwXHcbYkbIA2eZlVzad271M"
    "LmDHGt8oKGlII6rokaHkZKruHvM9TFNhPoaKQt9UYUsCw1Xs/ERLRO1HWj26Qxmy43MIBVVLS6ZUfW8uEi1ZoDa8uI7lcfqYXeDAImMXA0poquskgy"
    "swxQMNld1f1xf4R/3CWdFquPXbn8/jH3xV5p8jLkxbaV2KYzM7DInVNIWpH5Ym7N8Yg7bc8lCKsjD5+pZGHla5UdN7giyk2MGISIwoNgC214NG5SSV"
    "6xw2LjReLtoNuN5NXlidYXhrPPNslbTov2Hfy9p7UnOmcBdgGnp9bY9HUu/QVDmUrUMmROTruSYokA8DBWifhd//EFMiuyVEAyk+YAaW0xVKIKvvi0"
    "n5lr0YbFt6DFluUty/fjTMNP6SfrpnFrBEE8T+fuusMU9aLYlc0/nT4Wo9ICFoJFMPo7dSIgKtRLqwXCng1linPU4+OCF5GNk/MrJLgDOwN/PRo3qb"
    "h8wTrDSG9CxM3DzHdk3cqujx6Ln155OSt1oDqY4d51Owx3yLN7QL48MjbT8heo1RQHBiY9/Ns5r7z4UMMtpR0/sJEN8SvxswvrZedCYtfTF2PF3RaB"
    "AFdUQ6rbTPl7koBxh9GQoNvI4PpmHrCWF7VskP3In1+B97cy9oa5V/3+hP68LejVGutA8fNVGiWtf5UNKkBdcbCbxWrNeb29MqxgEf31/P9PXviUDd"
    "2utAXP1xRRVDDNxOOv+oLvtPLaV8Ha6OaB8E4CFXdCPHE8vY2hsHZe/sP05kGyWRWDDP5PFqaNEhP5hqg9hCQe18IWXk5gzAYmRNK4dEfeeeB8E1gR"
    "Z96Zk26zqwxKQAf5OuY9+u4ZPwywu1xGTsbu6Znjrirpy11jqyB1HHI4o/9zwgnMXOv6k5m6ItlFtItaHHcLDrEtKGribgEvFeKOLb7OkC72ZCRSTN"
    "/Vz71m4jaCHrF2RSRhdsobGLfzv1OwqWqWeaGc19wigFnFNfP27FjYH2xa721TSZZpmpm8NcScRSfzwqoMxD4Orn4ZagU7agm3431/3R7cZndby6H2"
    "PZzKsS9NnOZYfWuhtZWZ4gh4t1JvZ1PLirHOCpuf0rwHJa3vZE+zhrxMSQvvc/BFo9zRidFzI7UGGkuP4B9V1NT9ai7CiKg2SPbzsr8La/b1rqyN/0"
    "VWZFzRRd+qHkF6iYsz862OzJs4fPM39PBXKSN0j1LP807vTPfJcCzFuSxIadSQxtSKITqG6hiutKuHvFWKo3FkrAjf08bU3ixG0Xh3Wfd35PfX8+2f"
    "fwBmGX//")


SOFTMAX_EXP_TABLE = _stepped_table(SOFTMAX_EXP_STEPS, 2 ** SOFTMAX_EXP_BITS - 1)       # T(f), f in Q16
SOFTMAX_RECIP_TABLES = (_stepped_table(SOFTMAX_RECIP0_STEPS, 2 ** 14),                  # R_0(h), h >= 2^14 - 1
                        _stepped_table(SOFTMAX_RECIP1_STEPS, 2 ** 15 - 1),              # R_1(h), h >= 2^15
                        _stepped_table(SOFTMAX_RECIP2_STEPS, 2 ** 16 - 2),              # R_2(h), h >= 2^16
                        _stepped_table(SOFTMAX_RECIP3_STEPS, 2 ** 16 - 2))              # R_3(h), h >= 2^17
# The reciprocals one above the tables' reading (the lower of two that give the same codes at s_o = 2^-16; read at
# s_o = 0.75 2^-18, where the shift is 3 bits lower): R_2 at h = 65536-65537, 98300-98301, 131067-131069; R_3 above.
SOFTMAX_RECIP_HIGHER = (65536, 65537, 98300, 98301, 131067, 131068, 131069, 131072, 131073, 131074, 163834, 163835,
                        163836, 196600, 196601, 196602, 196603, 229372, 229373, 229374, 229375, 229376, 229377)
for _h in SOFTMAX_RECIP_HIGHER:
    SOFTMAX_RECIP_TABLES[_h.bit_length() - 15][_h - 2 ** (_h.bit_length() - 1)] += 1   # R_2 (h < 2^17), R_3


def softmax_multiplier(sx: float) -> int:
    """y's multiplier M = floor(s_x log2(e) 2^22) truncated to a 16-bit mantissa (the device's)."""
    m = int(np.floor(np.float64(np.float32(sx)) * np.log2(np.e) * 2.0 ** SOFTMAX_Y_BITS))   # Q22, truncated
    k = max(m.bit_length() - SOFTMAX_MULTIPLIER_BITS, 0)
    return m >> k << k                                                              # its low k bits dropped


def softmax(qx, x: tuple, out: tuple, axis: int = -1, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's quantised Softmax (module comment above).  qx: codes, rows of >= 3 along axis; x, out: (scale,
    zero point), per tensor.  -> int64 codes, qx's shape."""
    (sx, _), (so, zo) = x, out
    q = np.moveaxis(np.asarray(qx, np.int64), axis, -1)
    n = q.max(axis=-1, keepdims=True) - q                                           # n_i = q_max - q_i
    y = n * np.int64(softmax_multiplier(sx))                                        # y_i = n_i M   (Q22)
    i = np.minimum(y >> SOFTMAX_Y_BITS, SOFTMAX_EXP_BITS)                          # i_i (15 and over: E = 0)
    f = (y >> (SOFTMAX_Y_BITS - SOFTMAX_FRACTION_BITS)) & ((1 << SOFTMAX_FRACTION_BITS) - 1)   # f_i in Q16
    e_x = SOFTMAX_EXP_TABLE[f] >> i                                                 # E_i = T(f_i) >> i_i
    s = e_x.sum(axis=-1, keepdims=True)                                             # S
    mu, e_o = np.frexp(np.float64(np.float32(so)))                                  # s_o = mu 2^e, mu in [1/2, 1)
    m = int(np.floor(mu * 2.0 ** SOFTMAX_SCALE_BITS))                               # m = floor(mu 2^16)
    h = (s * m) >> SOFTMAX_SCALE_BITS                                               # h = floor(S m / 2^16)
    level = np.zeros_like(h)
    while ((h >> level) >= 1 << 15).any():
        level = np.where((h >> level) >= 1 << 15, level + 1, level)                # h in [2^(14 + l), 2^(15 + l))
    r = (np.int64(1) << (30 + level)) // h                                          # l >= 4: floor(2^(30 + l) / h)
    shift = 15 + level
    for lv, table in enumerate(SOFTMAX_RECIP_TABLES):
        first = 2 ** 14 - 1 if lv == 0 else 2 ** (14 + lv)
        r = np.where(level == lv, table[np.clip(h - first, 0, len(table) - 1)], r)   # R_l(h)
        shift = np.where(level == lv, SOFTMAX_RECIP_SHIFT + min(2 * lv, lv + 2), shift)   # 13 + 2 l; 18 at l = 3
    shift = shift + SOFTMAX_EXP_BITS + e_o                                          # c + 15 + e
    y_o = np.where(shift >= 0, (e_x * r) >> np.maximum(shift, 0), (e_x * r) << np.maximum(-shift, 0))  # E R / 2^shift
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


# Exp, uint16, x <= 0 (Qwen3.5's exp(g), the delta rule's decay; measured on the simulator over every input code:
# 100 % of codes identical on 10 sweeps of input scales 1e-4 to 6.3e-4 (s_x log2(e) not a power of 2 on 5), zero
# points 12288-65535, output scales 2^-20 to 1e-3 (K 0.015 to 16), none of them read for the table; the CPU EP's exact
# QuantizeLinear 42-85 %, 2-9 codes; every one of Qwen3.5's 24 Exps on the HTP's own inputs, where the CPU EP's is 2):
# y = -x log2(e) from a 15-bit multiplier, the device's 15-bit 2^-f at f's top 16 bits, times the output rescale's
# 15-bit mantissa, its octave and y's integer part applied as shifts of the rescaled value:
#
#     c   = s_x log2(e) = M 2^-h,  M a 15-bit mantissa (rounded)
#     Y   = (z_x - q_x) M                               y = Y 2^-h, exactly (x <= 0: Y >= 0)
#     i   = floor(Y / 2^h),  j = floor((Y mod 2^h) 2^(16 - h))    y's integer part, its fraction's top 16 bits
#     X   = E(j)                                        2^15 2^-f, the HTP's table (EXP_STEPS: measured at every j on
#                                                       28 sweeps at s_x log2(e) = 2^-16, output rescales 0.3-2; within
#                                                       1 of round(2^15 2^-f), 85 % equal; E(0) = 32767, 32768 at y = 0)
#     K   = 2^-16 / s_o = (m_q / 2^14) 2^(s - 2),  m_q / 2^14 in [1, 2) rounded to 15 bits (2^15: the next octave)
#     q_o = clip((floor(X m_q / 2^15) 2^s >> i) + z_o, 0, 2^16 - 1)    shifts floor (s < 0: right)
#
# so the output carries y's 15-bit multiplier (a relative 2^-16 of y: up to ~4 codes against the exact exp at large y
# and K), the table's unit and the rescale's floor, 2^-i of the value before the octave shift. x > 0 (q_x > z_x) is
# another path (23-55 % of those codes by this one), not modelled.
EXP_Y_BITS = 15                   # y = n s_x log2(e): s_x log2(e) as a 15-bit mantissa
EXP_FRACTION_BITS = 16            # the table's index: y's fraction, its top 16 bits
EXP_RESCALE_BITS = 14             # the output rescale K: m_q / 2^14 in [1, 2)
EXP_STEPS = (
    "eNrtW4ly5TYME/3/H93Ozm7WtoiDOvyctNNpJy+RJRIEQMpJW7TWvv6N09f//nt8ff3nH7g2rt+ja4/s0WTpcQkBbht9uNnayM7sQ+gzvW7LM72v"
    "PSx0f30dRiXiFANBJSC6l7WRF/G+NkjBT2sPRY6vrw0ifa0Ra0Oyo8KkrzVibeCSU3zztaHpUaBS8Jr/WRsGP4RST2sPGX9cn+drOym0s1yvm2gy"
    "Hc1ypUh13q0N7Amo8AThUFVnaujWmmqIqLuNa6xd2YkG042nOZK0BFr3u/eSjWPGRXKSeDYiCn/9JmfUESKDtLUi+h1O5Uc6DVssuevaw9235vwh"
    "5QBafP75UO2BHWmH0E0kAPeJaK75ZGYjPeIwdd8KOdSETw0z1Zw3iZqOea9gcIWmwiKLDyFnORiwyQCJP1LgK7PjfTZv2vhv0xDaOqyaXihFu6DR"
    "x7vbA6RLjBeVTXsnewTjnjHvWQNrcP+QnQYqVY42su/WparKqm8rCd/oZVvyrbHx4bz65L907nIEWCCcg0jfUxsbumlhu3sZniKMy8D9msqozuak"
    "/HbELgTaLK89A0SWz0qNtEvP86WwOtP3xt+OGeF28uylQtEgRqX1VzvubM5WdwxGs23fogGFHSaFJXs5eAVwxJZzAc08ICR1IWhU+MibUMGCaOCU"
    "SeiGGmJeidwkBmM7GrR0UDEeW3dNSmvgvVK437BFybLBDzDdEjTz38uQGEqjpyHUGs+cdqlF2txOfguOaloafjdNlzZLh+8gpgBH4EwLf0/UZTA5"
    "clgm0ucBlocAFnB9iCTc4kTrbWo2b2J5MGSzuYAuT6+l/fJgt9jTctpq+tsdXP77p9hzz4YeRuH9SkQyFiXgBW4gqC2QbAxexr0PkOUx1kOYBkUT"
    "6YZf8DYAjxnsRoCZGQa4We3zdEK8KLr8Xk3PQcG4fS/kYPF7pRW1INqD8hm7+um2pL8ZY+aRvaXo8zkcutlyOBqr599wHL5hRNgNmVgn3CDpt5pw"
    "zWuDEWicxgrkd1ALEU6hFomN4bnAcrjeBdCrUywqUlKwPiyS//pZNj1f119xT9dj07+T7lYE4nKHceLvF16C5nfzC8y6wDvgova8hS0H0s4bMxxl"
    "NTn/9p08l9YlN8hc5OZtrbbyd0ogaCwuHqKWM/qVFLnUqBdfVg8J68g/gh5uW/07j14vSYwU2H6G5wIL9/rWHzncLPuLQy5q9854yxf7SDNK0b1M"
    "JrdonGZ6KScPBNnCNa+/qrwMr03MBULYvVDBA86l934nt80BPhDiTAhc+kDnge5QaGo1fUC7oDvp5/fe9IHgcaeJug0Jz2phVDSRfwlddmg0/9CU"
    "A7sPdTJ1bivy3UhTjeZUU9Bpoh+b00MJvtkRbI8pfOdTDdw9NlY1mgUwL1L1VOYP0pRGT6V4JSX3EWZ1PZpgZMo4Mu07HiEAO5WhORCH7qrZOAKe"
    "IKGfn4jmJJu/2wQ9CdYhuvMdHxbH3jsjPlYUCq5OR1EPsnb/gxkhQXYsmPSzsZtvkkpPmhKdatF0lqRLlRp9ADxd0TwSqQKXATeSPNLQTSu3iPSq"
    "6d3Lrn8HjG3YHYGaNQMFqXjmpvJc32qwwyXGyvVqMRiROvmrWHnr1VSy3CbpNjRhQwjQeFqPkdGh0zsXoAFmRnJ7trqldTDbJfFUejBCqnt75ph5"
    "8kLOqSp6pRFWv08n0vyRxK3K6AZ2zwJwt0cCRqwsTt0ILI/jFSFFusfBzYb2rSm3kTbX9MkZvmC8cfHlYGHdw8papurzt8nSym2acaH1AT6lqaSD"
    "jBWr81GEQzscGlipxdGjOVxFKaQaSo+GjoW1cM2zY4TTRBplZE6lpsWQ4uW5ORpY0TPMO+40aaIiGMvWyUVVFGebR5dRWiAJ3iWA9DIVI0fKeCR5"
    "55AlqyYON/2FRcKSvFT9H8HxbEMVp5AtfDWUlCN/PHwq9v0vOT757ZJRnesyFm/GKppucOfjSmo21cIsT1JPHX4QMaxgl4lIy5tqKLL59Goj0vYf"
    "CMProkcOm0Hm1I55NTZNpHpCIcqSqviJfUG+mQ6QuW/TZmxFbDGmwbZFI6bzBDuw6/4igZ6aLIEQrMrGRgsUo2kEnocIS0iRWM1ChIz8Oe3SRh/g"
    "86bL8woT753ascb+1SSsAe4FDo3l6HA3xwrqZkC1dnq/Q1YakkqhYBdGS0JkV35Bi0Qy8iqfz3WSK4q8cM7UFibaRsNDFGUCtGxlYr6i7Wbd4Zg/"
    "Aa5KGGrUO1TxCY6sdFT3wgZUN/D5eOaL24OtptUquoMAKTZQ3Si3MJuAib1uS/0rVSfsmpC4PJFoLBKmSqp5pAVlRRi1scSxTqoM52OZY6ZjkJ4k"
    "tzVIVmV67ZEay4a8dAPg6f8p8mBJuwxXirRN1rQf86njRYWMsypymEZOSLuqwmaOjkZVi0ot8tE2X2C5CA0Vhu2lqp8OZjoSuqQXI4eJjuqQGA4s"
    "0E7zvEfaYdGypMY+bQJOHA7hwi3TvOAypiM7Sjk1XCdOvD6uEm9NQFCfKTiSFBCf7qzgGUBhBJL0OTNZH5EkGEkZo/ypxeQn5/fwSql82G3yWkYt"
    "VFQlDZd3vCaS/g2hNOIsEhqoVR1keepVX7MIXCaX4b6IUvSQKVCEvQznG0tDmYV+WShDFnMhdRYKlYrrdjkNqGrB2djsDbB9x4DvipCrwj43z5Zl"
    "sXgZCyedicVjIZjAFCuhg91P9W4DZUlPqbWmaevw5BJh4l+rUj8J6WBcvkfd7RRfvbqC0d/lTNrXETVJYakualz0hYFeaeHPrkqpMogcHGeCbGTR"
    "GFho0yCfOf0EHcVnPjWC+5j7RDhguEFbFHCcWnlALmngCT2cDgei+eFEZZiqo24fb5tSXXnalUzYtSmaCi30JdBiZnGHKDpeUOFXmQdFL8Lnqeyy"
    "8xPEs/MHGUbU7DG+UNLCTGJkqigPAHG6HTjZdV5AZLNCwPuAqRonubUX5mtUku8Mmh6nvVV8c2fsrNBwwbXdR3WQjkauvsfU+DggvaLruREofLKj"
    "opWqVITfphZO1joqalunR+Gq0+dCCp7hP403qWEY2bK6CCo57CJ0UGOGqx8ZAvMXwwWcClQQZ8e4iLuEK1SXrhPttKRoU0/0NjXgc4y99jpUgwqW"
    "VfELqxszlgmnKcmfjQ3OOkl04RklNoqR1UnQ9dwxmkXFqN2Mh7heh93mCINzLsMstYqrlyeUshepccePyimQuqLNAy/aqTrtnjrN2Su/7aSh3+is"
    "QR45UMkjGVrp9+mp91DBQ56TDtlvBUm44z0nWsSSy6trjplg6HDsWMd4Y5uyJFoG8hgszs42RyczHPcPlInfBhVGOS6uK3pFjFYs4nCKttZoEyRV"
    "dPoPB8Y917Y+eAz1+fpTPNr6U6p9SfjG+ZxL1hoBNxJa183mpo9f9h5W+1CtA1kC9GU7x2lT3HZb1V5kQeG7t3ftpAVfGO8sQUvOQgrMHIRAGMZM"
    "JMSKBDR2ckV3UEE2bXRI0jLNLlbgZLiQUReaTWs5Goy/XKFclZw5kg+eORRnleLmqc69vPxWXvB2TYIKVZjeuFt6Yh7hCg1Zo2ZMbctrQZuCOwew"
    "t3ZToMrrWmEsGmXZaGbF3U1fKFjtICKFLj0gceODSdZBKRTGAMdgPMP1SW1YpzdbVVhd8O2lDubk5lf3KV6b3BqJcbQALkKDBVgjgFFxf4sKLCrB"
    "aJRTHlT9YIyta7NbHWVll88xZTRKJ/G5A74PmKuZWaCc2H+3+dnnb3Cx24+3V319L3l7nIvwnK/7Ihmt1pGTz6QtDfnec4HWDbpqMGMnlP3UfM0z"
    "SDUbGAP6SSwCMqZGkjBFtgh7h85LazjMypLDj+FkO3XFS5aMEnuPKHtLiZgT/WdMswv8slZvond7hig1K2YwTlXrYhhjWOlHKqklZzjmtxYdUoGa"
    "HkiwMVePFTUfIMckjjVfqfWRWX3anWtiWxtI1UtGDaJU9lHsSEnWMs3uYDN+armNb32lI6ehdGzC36lGmFprlEaxBMtdiQ24/Gj9ShJnryBmtCBt"
    "RRZw7Zl+qSmF1sUz4EFraz3F6alDZbGLZSha30wNfYYtxHMXxd51KCM2M05m1pJkRVBmmuTQJ5ncG0j3kfiQ4AE5tlSmkGtRCADcSUt6QAlgiqgG"
    "OJI6ClBu4+38KC766eEHCx72/LFvBWYjY6iJSKd9JApGanPWWlrKQvEKcl8e4lIUx+O/rZAEM/eZo/KK8k2G4VXz8zFOysCstTa9VSFvAHL9DzcA"
    "MHQUfHJFVuMx87BWnDLEFNP0xlLYn65pP1WrKsG4glL7wVjGqRLmE9I0w9yAxmIgxwg5gWu5I6zJf13Btu40aPCmSxjsnrDn1XiMkX/HOTPH8if4"
    "YZWKDga6Gr0ymKtDXp3B6uxn8Nr3LN/qsWdf93GQejOknvoPtJdS/4BONcq2UtDPQbaaBW84yT14Y06f2PpH7iUe5grFe73rYePKtkAM86qp1U8c"
    "+gwGH06juJr3rrmjN4Gw/ehP5rGUCp+BdAEh58zloVCef7pWz/uP5562gV/Lm10//hGHvW+3B/j0+cOLVjP5zRXBbCj/ZEVeeNrPf1xsPLToiWh2"
    "5DF+8Bu2/47HTRpb/s3JcNbt9Aju3yK93ZFXP78t0yX5baTbRvrOprIxq88kpLb+ZO6fCWCiDUxnuAaMPcmu3PDJs7yln89+eQo7917/wE78yie+"
    "BZ9FObzgsBmA3rXj+nruOvKpmHaF98YEP/xlBZJBFci1j2VYSWDv8T9qy1fE8/rjFjzx6Ry3Hfoc0pu3eOn2b9pz2Xk7sP44AotxeEnyr4Lgx233"
    "n43xe8b70YzeuPXzIbzmgB++7tFdXxnU/9/e+u1PnvAP3CFAAA==")


EXP_TABLE = _stepped_table(EXP_STEPS, 2 ** 15 - 1)                              # E(j), j = 0..65535


def exp(qx, x: tuple, out: tuple, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's quantised Exp of x <= 0 (codes above the zero point are another path: not modelled, computed as at
    the zero point).  qx: codes; x, out: (scale, zero point), per tensor.  -> int64 codes, qx's shape."""
    (sx, zx), (so, zo) = x, out
    c = np.float64(np.float32(sx)) * np.log2(np.e)                                  # c = s_x log2(e)
    h = EXP_Y_BITS - 1 - int(np.floor(np.log2(c)))
    m = int(np.rint(c * 2.0 ** h))                                                  # M = c 2^h, 15 bits
    n = np.maximum(np.int64(zx) - np.asarray(qx, np.int64), 0)                     # z_x - q_x (x <= 0)
    y = n * np.int64(m)                                                             # Y = y 2^h
    i = y >> h                                                                      # floor(y)
    j = (y & ((np.int64(1) << h) - 1)) << EXP_FRACTION_BITS >> h                   # f's top 16 bits
    e = np.where(n == 0, 2 ** 15, EXP_TABLE[j])                                     # X = E(j); 2^15 at y = 0
    k = 2.0 ** -16 / np.float64(np.float32(so))                                     # K = 2^-16 / s_o
    s = int(np.floor(np.log2(4 * k)))
    mq = int(np.rint(4 * k / 2.0 ** s * 2 ** EXP_RESCALE_BITS))                     # m_q: 4 K / 2^s in Q14
    if mq >> (EXP_RESCALE_BITS + 1):
        mq, s = mq >> 1, s + 1                                                      # rounded up to 2: next octave
    v = (e * np.int64(mq)) >> (EXP_RESCALE_BITS + 1)                               # floor(X m_q / 2^15)
    v = v << s if s >= 0 else v >> -s                                               # 2^s
    return np.clip((v >> np.minimum(i, 62)) + np.int64(zo), *qrange)               # >> i, + z_o, saturated


# Depthwise Conv (Qwen3.5's causal conv1d, Conv(group = C) of uint16 activations [B, C, L] and 8-bit or int4 per-tensor
# weights [C, 1, K]; measured: every code of the 9 convs of the Qwen3.5 QNN W8A16 (uint8, z_w 113-134: 1-2 channels'
# steps leave int8), QNN W4A16 (int4, z_w -1 and 0) and aimet-onnx W8A16 (int8 symmetric) HTP dumps on their own input
# codes (the CPU EP's exact requantisation: 20-33 %, up to 92 codes)): each channel is the MatMul above, its K taps the
# MatMul's K, the channel its column (so a channel whose steps leave int8 is rescaled and re-rounded by its own r):
#
#     y[b, c, t] = matmul(X[b, c, t : t + K], W[c, 0, :])      t = 0 .. L - K (the conv's valid outputs)
#
# The device graph pads the conv K - 1 zeros each side (nn.Conv1d(padding=K-1)): a padded column holds the input's zero
# point (n = 0), so its outputs are the same arithmetic on fewer taps; the valid ones are those a causal conv keeps.
CONV_CHANNEL_BLOCK = 64            # channels per MatMul call (its columns; the diagonal kept)


def conv1d_depthwise(qx, x: tuple, qw, w: tuple, out: tuple, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's quantised depthwise Conv1d, valid outputs.  qx: codes [..., C, L]; qw: weight codes [K, C] (tap j of
    channel c at [j, c]); x, w, out: (scale, zero point), per tensor.  -> int64 codes [..., C, L - K + 1]."""
    qx, qw = np.asarray(qx, np.int64), np.asarray(qw, np.int64)
    K, C = qw.shape
    L = qx.shape[-1]
    win = np.stack([qx[..., t:t + K] for t in range(L - K + 1)], axis=-2)           # [..., C, L - K + 1, K]
    y = np.empty(win.shape[:-1], np.int64)                                          # [..., C, L - K + 1]
    for c0 in range(0, C, CONV_CHANNEL_BLOCK):
        c = slice(c0, min(c0 + CONV_CHANNEL_BLOCK, C))
        p = matmul(win[..., c, :, :], x, qw[:, c], w, out, qrange)                  # [..., c, T', c]: every pair
        y[..., c, :] = np.diagonal(p, axis1=-3, axis2=-1).swapaxes(-1, -2)          # channel c with its own column
    return y


# ---------------------------------------------------------------------------------------------------------- Softplus
# The HTP's quantised Softplus (Qwen3.5's decay gate g = -exp(A_log) softplus(a + dt_bias); measured on the simulator:
# one-op QDQ Softplus graphs over every input code at 18 encodings, input ranges +-2.3 to +-40, docs/htp.md §9): a
# function of the dequantised input x in three pieces, none of them the correctly rounded softplus:
#
#     x = (q_x - z_x) s_x
#     y = 2^i p(f),  t = x log2(e), i = floor(t), f = t - i     x < -2: the exp of x (softplus's e^x tail), p a cubic
#                                                               approximation of 2^f (within -7.5e-5..+8.0e-5 of it,
#                                                               equioscillating: a minimax cubic)
#     y = P(x)                                                  -2 <= x < 5: one quartic (within -0.0123..+0.0123 of
#                                                               softplus: the "~1.5 %" near x = -1.3, 97 codes' jump
#                                                               at x = -2 at s_o 4e-5)
#     y = x                                                     x >= 5 (softplus(5) = 5.0067: 0.0067 low there)
#     q_o = clip(round(y / s_o) + z_o, 0, 2^16 - 1)
#
# The coefficients are fitted (linear programming: the smallest max |codes - P(x) / s_o| over 4 sweeps' quartic codes,
# 0.5065; the cubic's over 3 sweeps' codes below -2, x log2(e) in [-16, -7), 0.5043): the device's own arithmetic
# rounds below them (its codes sit up to 0.0065 code (quartic) / 2^-18 relative (exp) beyond the nearest rounding
# of any such polynomial; float32 Horner with the coefficients' float32 neighbours (+-64 ulps) and the output
# divided or multiplied by 1 / s_o: 0.24-0.31 % of codes off, no better). So a code whose value sits that close to a
# rounding point can come out one off: 99.59-99.73 % of codes identical at five held-out Qwen3.5 Softplus
# encodings, 99.78-99.91 % at five random ones (s_x 1e-4 to 3e-4), max 1 (the CPU EP's exact softplus: 0.1 %, up to
# 348 codes); the models' 9 Softpluses on their own inputs: every code.
SOFTPLUS_EXP_BELOW = -2.0          # x < -2: the exp piece
SOFTPLUS_LINEAR_FROM = 5.0         # x >= 5: y = x
SOFTPLUS_EXP2 = (0.9999257512833629, 0.6957918940624883, 0.22618187937722123, 0.07795900200871866)  # p(f), f^0..f^3
SOFTPLUS_QUARTIC = (0.7031086624142923, 0.51270432817994, 0.10882609298151458, -0.004610729376403278,
                    -0.000666440120087329)                                                          # P(x), x^0..x^4


def softplus(qx, x: tuple, out: tuple, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's quantised Softplus.  qx: codes; x, out: (scale, zero point), per tensor.  -> int64 codes, qx's
    shape."""
    (sx, zx), (so, zo) = x, out
    v = (np.asarray(qx, np.int64) - np.int64(zx)) * np.float64(np.float32(sx))     # x = (q_x - z_x) s_x
    t = v * np.log2(np.e)                                                           # t = x log2(e)
    i = np.floor(t)
    e = np.polynomial.polynomial.polyval(t - i, SOFTPLUS_EXP2) * np.exp2(i)         # 2^i p(f)
    p = np.polynomial.polynomial.polyval(v, SOFTPLUS_QUARTIC)                       # P(x)
    y = np.where(v < SOFTPLUS_EXP_BELOW, e, np.where(v < SOFTPLUS_LINEAR_FROM, p, v))
    return np.clip(np.rint(y / np.float64(np.float32(so))) + np.int64(zo), *qrange).astype(np.int64)


# ------------------------------------------------------------------------------------- a float input quantised on-chip
# A graph input the host feeds float whose first quantiser sits after data-movement ops (the genie KV cache:
# past_key_i_in / past_value_i_in -> Gather -> Unsqueeze (-> Transpose) -> QuantizeLinear): the QNN EP runs those
# moves on the HTP in float16 (enable_htp_fp16_precision), then quantises the float16 value there, multiplying by the
# float32 reciprocal of the scale (measured on the dense W8A16 QDQ model calibrated on calls with a filled cache: the
# HTP's codes of layer 0's 7 cached keys and values of a decode call, from the host's float copy of the prompt call's
# outputs, every one of 896 each; the float32 x / s: the values 99.8 %, 1 code off; without the float16 copy 37-39 %,
# up to 9 codes). A QuantizeLinear right on a graph input (the cos / sin tables, the mask) is the exact float32 one.
#
#     q = clip(round_half_even(float32(float16(x)) float32(1 / s)) + z, 0, 2^16 - 1)


def float16_copy(x) -> np.ndarray:
    """x as the HTP holds a value it computes or moves in float16: rounded to float16 (RNE), as float32."""
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def quantize_float16(x, out: tuple, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's quantisation of a float value it holds in float16.  x: float32 values; out: (scale, zero point).
    -> int64 codes."""
    s, z = out
    x16 = float16_copy(x)                                                          # the device's float16 copy
    inv = np.float32(np.float32(1) / np.float32(s))                                # float32(1 / s)
    return np.clip(np.rint(x16 * inv).astype(np.int64) + np.int64(z), *qrange)      # round(x16 / s) + z, saturated


# ------------------------------------------------------------------------------------- TopK, Softmax of two
# The MoE's routing written as TopK of the router's logits, then Softmax over the k values (tests/e2e/quantised.py
# `routing_as_topk_softmax`: the HTP's TopK of a quantised Softmax reads an fp16 softmax, not the Softmax's codes).
#
# TopK of uint16 codes (measured on one-op TopK(k = 2) graphs over rows of 8, 3 x 8192 rows at the QNN W8A16 router
# encoding and at (3e-4, 30000), and on the 8 routers of the QNN W8A16 / W4A16 MoE dumps so rewritten): the HTP
# compares and returns the values in float16. Each value (q - z) s in float32 rounded to float16, requantised into
# the values' encoding rounded half up; the order by those float16 values, exact ties the higher index first (100 %
# of the indices of the three sweeps, the 34 % of rows whose float16 values tie included; the values 99.96 % and 100 %
# of two sweeps, 99.2-99.6 % with the product rounded half to even or the quotient v / s_o; the 0.04 % left one
# float16 value whose float32 product sits 0.001 below the half, which the device rounds up):
#
#     v   = float16((q - z) s)                                the value the TopK compares
#     q_o = clip(floor(v float32(1 / s_o) + 1/2) + z_o, 0, 2^16 - 1)    its code, the product in float32, half up


def topk_values(qx, x: tuple, out: tuple, qrange: tuple = UINT16) -> np.ndarray:
    """The codes of the HTP's TopK values, elementwise (the k selected are those of the largest, ties the higher
    index: topk_order).  qx: codes; x, out: (scale, zero point), per tensor.  -> int64 codes, qx's shape."""
    (sx, zx), (so, zo) = x, out
    v = float16_copy((np.asarray(qx, np.int64) - np.int64(zx)).astype(np.float32) * np.float32(sx))   # float16(x)
    y = v * (np.float32(1) / np.float32(so))                                        # v float32(1 / s_o), float32
    return np.clip(np.floor(y + np.float32(0.5)).astype(np.int64) + np.int64(zo), *qrange)   # half up


def topk_order(values: np.ndarray, k: int) -> np.ndarray:
    """The indices of the k largest along the last axis, largest first, exact ties the higher index first (the
    HTP's TopK).  values [..., E] -> int64 [..., k]."""
    n = values.shape[-1]
    return (n - 1 - np.argsort(-values[..., ::-1], axis=-1, kind="stable"))[..., :k]   # stable on the reversed row


# Softmax over rows of 2 (another kernel than `softmax`'s, measured on one-op Softmax graphs over [a, b] rows: every
# code difference a - b at (8.73e-5, 33394) from three b, at (3e-4, 30000) and (2.1e-5, 30000), and the TopK sweeps'
# top 2): p_1 + p_2 = 65535 but at exact or near ties; p depends on the code difference d = q_a - q_b only (every code
# of 2 x 65536 rows shifted); the exp of the smaller's distance is 2^-y, y = |d| s log2(e), as a cubic of y's
# fraction f times 2^-floor(y): its relative error is periodic in y (+1.3e-4 at f ~ 0.15, -5.2e-4 at f ~ 0.65,
# the same in every octave; the exact exp is up to 9 codes off). The cubic is fitted (least squares on the implied
# 2^-f of the 8 sweeps; fitted on one sweep alone it gives the held-out encodings 96.8-98.1 %); its codes rounded
# half down (the tie d = 0: 32767 for both):
#
#     e   = P(f) 2^-floor(y)                                  the smaller's exp, the larger's P(0)
#     p_i = E_i / (E_1 + E_2)
#     q_i = clip(ceil(p_i float32(1 / s_o) - 1/2) + z_o, 0, 2^16 - 1)   (measured at s_o = 1 / 65535 only)
#
# 96.4-98.0 % of codes on the 8 sweeps, max 1 code (the device's evaluation rounds below the fit: float32 Horner of
# the float32 coefficients no closer; exps as 14- to 20-bit integers 21-97 %).
SOFTMAX_PAIR_EXP2 = (0.9999995592364235, -0.6905308101092735, 0.2263195765692293, -0.03578996527320959)   # P(f)


def cubic_exps(q: np.ndarray, sx) -> np.ndarray:
    """The exps of the HTP's Softmax of two and of its TopK of a Softmax: each code's distance below its row's maximum
    y = (q_max - q_i) s_x log2(e), its exp 2^-y the cubic P of y's fraction times 2^-floor(y) (P(0) at the maximum).
    q: int64 codes, rows along the last axis; sx: their scale.  -> float64, q's shape."""
    y = (q.max(axis=-1, keepdims=True) - q) * np.float64(np.float32(sx)) * np.log2(np.e)   # y_i
    i = np.floor(y)
    return np.polynomial.polynomial.polyval(y - i, SOFTMAX_PAIR_EXP2) * np.exp2(-i)         # P(f_i) 2^-floor(y_i)


def softmax_pair(qx, x: tuple, out: tuple, axis: int = -1, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's quantised Softmax of rows of 2.  qx: codes, rows of 2 along axis; x, out: (scale, zero point), per
    tensor.  -> int64 codes, qx's shape."""
    (sx, _), (so, zo) = x, out
    q = np.moveaxis(np.asarray(qx, np.int64), axis, -1)
    e = cubic_exps(q, sx)                                                           # [E_a, E_b]: the larger's P(0)
    p = e / e.sum(axis=-1, keepdims=True)                                           # p_i = E_i / (E_a + E_b)
    y_o = np.ceil(p * np.float64(np.float32(1) / np.float32(so)) - 0.5).astype(np.int64)   # half down
    return np.moveaxis(np.clip(y_o + np.int64(zo), *qrange), -1, axis)


# The TopK of a quantised Softmax (the MoE's routing as exported: Softmax -> Q/DQ -> TopK): the HTP's TopK does not
# read the Softmax's codes but a float softmax of the Softmax's input codes, the exps those of `softmax_pair` (its
# cubic of y's fraction, y = (q_max - q_i) s_x log2(e)), normalised, rounded to float16 and quantised into the top k's
# encoding (measured: 4096 random rows of 8 at QNN W8A16's router encoding, one-op Softmax -> TopK graphs: 99.77 % of
# the top-2 values, max one float16 step; the exact softmax so rounded 71 %, the Softmax's own codes gathered 0-6 %):
#
#     e_i = P(f_i) 2^-floor(y_i),   p_i = e_i / sum_j e_j,   q_o = clip(round(float16(p_i) float32(1 / s_o)) + z_o)


def softmax_topk(qx, x: tuple, out: tuple, k: int, qrange: tuple = UINT16) -> np.ndarray:
    """The codes of the k values the HTP's TopK returns of a quantised Softmax of qx (its input's codes, rows along
    the last axis), largest first.  x: the Softmax input's (scale, zero point); out: the top k's.  -> int64 [..., k]."""
    (sx, _), (so, zo) = x, out
    e = cubic_exps(np.asarray(qx, np.int64), sx)                                            # e_i = P(f_i) 2^-i
    v = float16_copy(e / e.sum(axis=-1, keepdims=True)).astype(np.float64)                  # float16(p_i)
    top = -np.sort(-v, axis=-1)[..., :k]                                                    # the k largest
    return np.clip(np.rint(top * np.float64(np.float32(1) / np.float32(so))).astype(np.int64) + np.int64(zo), *qrange)


# ------------------------------------------------------------------------------------------ a Gemm with a float bias
# A Gemm whose bias the graph leaves float (aimet-onnx's Qwen3.5 in_proj_a + dt_bias; with ONNX Runtime's graph
# optimizations off, as the honest runs, no int32 bias is made): the HTP runs it on the float16 grid, its quantised
# inputs dequantised to float16 and its output quantised from float16, each conversion rounding ties away from zero
# (measured on one-op QDQ graphs on the simulator, int8 symmetric weights per tensor, 2.24M codes: every code of 3 K = 1
# sweeps over every activation code 0-65535 at three encodings and 3 over 26,000 codes, of 12 random sweeps at K = 2-64
# and 3 at K = 64 of the model's encodings; 19 codes off in 6 random sweeps at random encodings, K = 5-128 (1 code each:
# the accumulator's own rounding, not found); every code of the aimet-onnx W8A16 dump's 3 Gemms on their own inputs):
#
#     x_i  = float16_away(float32(n_a,i s_a))             the activation's steps times its scale, to float16
#     w_ij = float16_away(k_ij float16(s_w))              the weight's steps times its scale's float16, to float16
#                                                         (3 float16(s_w) 2^m is a tie: one ulp up)
#     v_j  = float16(float32(sum_i x_i w_ij + float16(b_j)))   the products summed wide, the bias's float16 added,
#                                                              rounded once (ties to even)
#     q_o  = clip(round_away(float32(v_j float32(1 / s_o))) + z_o, 0, 2^16 - 1)
#
# Refuted (here and before): the weight's float16 from the float32 scale (a 127-step weight one ulp low: 16 % of that
# column's codes; 63 % of a K = 2 sweep), the weight's or the activation's ties to even (96 %; 4 rows of 65,536 at the
# model's encoding), the activation as float16(n float16(s_a)) (82 %), the products in float16 (57 % at K = 64 summed
# wide, 18 % summed in float16), the sum's ties away from zero (99.4 %), the output as round(v / s_o) (2,754 codes of
# 65,536 x 8 at v / s_o = 1/2 +- 1e-3) or its float32 product rounded to even (301 of 65,536 x 8). A subnormal bias
# (|b| < 2^-14, -0.0 included) is not that: its sign rounds the sum up or down (directed: 56-78 % of codes by the
# model), not modelled (the models' biases are normal).
FLOAT16_MANTISSA_BITS = 10           # float16's significand: 10 bits after the leading one
FLOAT16_MIN_EXPONENT = -14           # its smallest normal exponent (below it: subnormals, steps of 2^-24)


def float16_away(v) -> np.ndarray:
    """v (float64) rounded to the float16 grid, ties away from zero (no overflow: |v| < 65504).  -> float64."""
    v = np.asarray(v, np.float64)
    e = np.maximum(np.frexp(v)[1] - 1, FLOAT16_MIN_EXPONENT) - FLOAT16_MANTISSA_BITS     # the ulp's exponent
    return np.ldexp(round_away(np.ldexp(v, -e)), e)                                      # in ulps, rounded


def round_away(t) -> np.ndarray:
    """t rounded to an integer, ties away from zero.  -> float64."""
    t = np.asarray(t, np.float64)
    return np.sign(t) * np.floor(np.abs(t) + 0.5)


def gemm_float_bias(qa, a: tuple, qw, w: tuple, bias, out: tuple, qrange: tuple = UINT16) -> np.ndarray:
    """The HTP's Gemm of uint16 activations [..., K] and 8-bit per-tensor weights [K, N] with a float bias [N] (above).
    a, w, out: (scale, zero point).  -> int64 codes [..., N]."""
    (sa, za), (sw, zw), (so, zo) = a, w, out
    n = np.asarray(qa, np.int64) - np.int64(za)                                     # n_a
    x = float16_away(np.float32(n * np.float64(np.float32(sa))))                   # float16_away(float32(n_a s_a))
    s16 = np.float64(np.float16(np.float32(sw)))                                   # float16(s_w)
    wt = float16_away((np.asarray(qw, np.int64) - np.int64(zw)) * s16)             # float16_away(k float16(s_w))
    b16 = float16_copy(bias).astype(np.float64)                                    # float16(b)
    v = float16_copy(x @ wt + b16)                                                 # float16(float32(sum x w + b))
    inv = np.float32(np.float32(1) / np.float32(so))                               # float32(1 / s_o)
    t = round_away(v * inv)                                                        # round_away(float32(v / s_o))
    return np.clip(t.astype(np.int64) + np.int64(zo), *qrange)                     # + z_o, saturated
