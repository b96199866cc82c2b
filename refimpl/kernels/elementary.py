"""Correctly rounded float32 elementary functions: exp, log, log1p, sin, cos, power and the activations built on
them (sigmoid, silu, softplus, gelu), the same bits on every CPU, libm and SIMD path.

Contract (float32 inputs). f(x) is RNE32 of the exact real value of the function at the float32 input (ties to
even, IEEE overflow and subnormals, NaN as the one quiet NaN 0x7fc00000). float64 inputs (the oracle mode), and
everything inside products.plain_blas(), take NumPy's float64 / float32 functions as they are.

Method. y = the function evaluated in float64 by NumPy on the float32 input (exact in float64). We rely on one
stated property of the platform's float64 functions (NumPy's SIMD loops, SVML, glibc, Apple's libm, ARM's optimized
routines, ...): a relative error below 2^-40 (published worst cases are a few ulp, 2^-50), and for sin and cos an
absolute error below 2^-60 too, for |x| <= 2^20 (their results are bounded by 1). Where every real in
[y - err, y + err] rounds to one float32 (monotone RNE32: the two ends decide), that is the answer. The rest
(about 1 element in 10^5), and arguments outside the stated ranges, are evaluated with mpmath at 160 bits and
rounded to float32 by integer arithmetic; float32 arguments put no transcendental value within 2^-160 of a float32
rounding midpoint except exact cases (exp(0) = 1, sin(0) = 0, ...), which mpmath returns exactly.
"""

import functools
import math

import mpmath
import numpy as np

from . import products

_REL = 2.0 ** -40           # assumed bound on the relative error of the platform's float64 evaluation
_ABS_TRIG = 2.0 ** -60      # ... and on the absolute error of its sin / cos for |x| <= 2^20
_PREC = 160                 # mpmath's working precision (bits) for undecided elements
_QNAN32 = np.float32(np.nan)


def to_float32(value: mpmath.mpf) -> np.float32:
    """RNE32 of an mpmath number, by integer arithmetic on its exact binary form (man * 2^exp)."""
    if mpmath.isnan(value):
        return _QNAN32
    if mpmath.isinf(value):
        return np.float32(np.inf if value > 0 else -np.inf)
    man, exp = value.man_exp                                     # |value| = man * 2^exp exactly
    sign, man = bool(value < 0), abs(int(man))
    top = exp + man.bit_length() - 1                             # 2^top <= |value| < 2^(top + 1)
    if man == 0 or top < -150:                                   # below half the smallest subnormal: +-0
        return np.float32(-0.0 if sign else 0.0)
    if top >= 128:
        return np.float32(-np.inf if sign else np.inf)
    shift = max(top - 23, -149)                                  # exponent of float32's grid spacing at |value|
    if exp >= shift:
        q = man << (exp - shift)
    else:
        q, rest = divmod(man, 1 << (shift - exp))
        half = 1 << (shift - exp - 1)
        q += rest > half or (rest == half and q & 1)             # round half to even
    magnitude = math.ldexp(q, shift) if q.bit_length() + shift <= 128 else math.inf
    return np.float32(-magnitude if sign else magnitude)


def correctly_rounded(x, float64_fn, mp_fn, *, trig: bool = False, float32_result: bool = False) -> np.ndarray:
    """RNE32 of an elementary function at each float32 element of x (the method above).

    float64_fn: the function on a float64 array (the platform's evaluation); mp_fn: the same function on one
    mpmath number (evaluated at _PREC bits). float64 x, or plain_blas(), returns float64_fn(x) in x's dtype,
    unless float32_result asks for the correctly rounded float32 value at float64 arguments."""
    x = np.asarray(x)
    if x.dtype == np.float64 and not float32_result:
        with np.errstate(all="ignore"):
            return float64_fn(x)
    if products.plain_blas_active():
        with np.errstate(all="ignore"):
            return float64_fn(x.astype(np.float32, copy=False)).astype(np.float32)
    if x.dtype != np.float64:
        x = x.astype(np.float32, copy=False)
    flat = x.reshape(-1)
    if flat.size <= _CHUNK:                     # one chunk (a decode step's activations): in this thread
        out, undecided = _decided(flat, float64_fn, trig)
    else:
        out, undecided = np.empty(flat.shape, np.float32), np.empty(flat.shape, bool)

        def chunk(i: int) -> None:              # a cache-sized chunk: its float64 temporaries stay in cache
            s = slice(i * _CHUNK, (i + 1) * _CHUNK)
            out[s], undecided[s] = _decided(flat[s], float64_fn, trig)

        products.spread(chunk, -(-flat.size // _CHUNK))  # elementwise: the bits do not depend on the chunks
    if np.count_nonzero(undecided):             # mpmath in this thread alone (its precision is a global)
        with mpmath.workprec(_PREC):
            for i in np.flatnonzero(undecided):
                out[i] = to_float32(mp_fn(mpmath.mpf(float(flat[i]))))
    return out.reshape(x.shape)


_CHUNK = 1 << 14            # elements per chunk of correctly_rounded (its float64 temporaries: 128 KiB each)


def _decided(x: np.ndarray, float64_fn, trig: bool) -> tuple[np.ndarray, np.ndarray]:
    """(RNE32 where [y - err, y + err] rounds to one float32, the mask of the undecided elements) for x (float32,
    or float64 arguments of float32_result), y = float64_fn(x)."""
    with np.errstate(all="ignore"):
        y = float64_fn(x.astype(np.float64))
        err = np.abs(y) * _REL
        if trig:
            err += _ABS_TRIG
        lo, hi = (y - err).astype(np.float32), (y + err).astype(np.float32)
    undecided = lo.view(np.int32) != hi.view(np.int32)
    undecided |= np.isnan(y) & ~np.isnan(x)                      # a NaN from a number: mpmath says what it is
    if trig:
        undecided |= np.abs(x) > 2.0 ** 20
    lo[np.isnan(x)] = _QNAN32
    return lo, undecided


def exp(x, float32_result: bool = False):
    """e^x; float32_result: the float32 exponential of float64 arguments too. Inside products.onnxruntime_cpu(),
    float32 x whose e^x is a normal number: ONNX Runtime's Exp (MLAS's exp kernel, the polynomial of its softmax:
    measured identical on 500,000 arguments in [-12, 2]; correctly rounded 94.8 %)."""
    if products.onnxruntime_cpu_active() and np.asarray(x).dtype == np.float32:
        x = np.asarray(x)
        normal = (x >= np.float32(-87.3)) & (x <= np.float32(88.3))
        return np.where(normal, mlas_softmax_exp(np.where(normal, x, 0)), correctly_rounded(x, np.exp, mpmath.exp))
    return correctly_rounded(x, np.exp, mpmath.exp, float32_result=float32_result)


def log(x, float32_result: bool = False):
    """ln x (x = 0: -inf; x < 0: NaN); float32_result: the float32 logarithm of float64 arguments too."""
    return correctly_rounded(x, np.log, lambda v: mpmath.log(v) if v > 0 else (mpmath.ninf if v == 0 else mpmath.nan),
                             float32_result=float32_result)


def cos(x):
    return correctly_rounded(x, np.cos, mpmath.cos, trig=True)


def sin(x):
    return correctly_rounded(x, np.sin, mpmath.sin, trig=True)


def _sigmoid64(v):
    """exp(min(v, 0)) / (1 + exp(-|v|)): exp never sees a positive argument (the float64 oracle's form)."""
    return np.exp(np.minimum(v, 0)) / (1 + np.exp(-np.abs(v)))


def sigmoid(x):
    """sigmoid(x) = 1 / (1 + e^-x); inside products.onnxruntime_cpu(), ONNX Runtime's (mlas_logistic)."""
    if products.onnxruntime_cpu_active() and np.asarray(x).dtype == np.float32:
        return mlas_logistic(x)
    return correctly_rounded(x, _sigmoid64, lambda v: 1 / (1 + mpmath.exp(-v)))


# MLAS's logistic (onnxruntime/core/mlas/lib/logistic.cpp, Eigen's coefficients): an odd rational function of x
_MLAS_P = tuple(np.float32(c) for c in (4.37031012579801e-11, 1.15627324459942e-07, 6.08574864600143e-05,
                                        8.51377133304701e-03, 2.48287947061529e-01))            # alpha_9 .. alpha_1
_MLAS_Q = tuple(np.float32(c) for c in (6.10247389755681e-13, 5.76102136993427e-09, 6.29106785017040e-06,
                                        1.70198817374094e-03, 1.16817656904453e-01, 9.93151921023180e-01))  # beta_10..0


# MLAS's exp of softmax (onnxruntime/core/mlas/lib/compute.cpp, MlasComputeSumExpVector): x = m ln 2 + r, a degree-6
# polynomial of r (its last coefficient applied twice), times 2^m
_MLAS_EXP = tuple(np.float32(float.fromhex(h)) for h in ("0x1.694000p-10", "0x1.125edcp-7", "0x1.555b5ap-5",
                                                         "0x1.555450p-3", "0x1.fffff6p-2", "0x1.000000p+0"))
_MLAS_BIAS = np.float32(12582912.0)          # 1.5 * 2^23: adding it rounds to an integer


def mlas_softmax_exp(x):
    """ONNX Runtime's CPU exp inside Softmax, float32 x <= 0 (x - max): clamped at -88.376; m = round(x / ln 2)
    (by the rounding bias), r = x - m ln2 (two fused steps, ln 2 split high / low), p(r) by Horner with fused
    multiply-adds, times 2^m (exponent bits)."""
    v = np.maximum(np.float32(-88.3762626647949), np.asarray(x, np.float32))
    biased = products.fma32(v, np.float32(1.44269504088896341), _MLAS_BIAS)     # x / ln 2 + bias
    m = biased - _MLAS_BIAS                                                      # round(x / ln 2)
    r = products.fma32(m, np.float32(-6.93145752e-1), v)                         # x - m ln2 (high part)
    r = products.fma32(m, np.float32(-1.42860677e-6), r)                         # ... (low part)
    p = np.full_like(r, _MLAS_EXP[0])
    for c in _MLAS_EXP[1:]:
        p = products.fma32(p, r, c)                                              # p r + c
    p = products.fma32(p, r, _MLAS_EXP[5])                                       # the last coefficient again
    scale = ((biased.view(np.int32) << 23) + np.int32(0x3F800000)).view(np.float32)   # 2^m
    return p * scale


def mlas_logistic(x):
    """ONNX Runtime's CPU Sigmoid (its x86-64 FMA3 kernel), float32: x clamped to [-18, 18],
    p = x (a1 + x^2 (a3 + ...)), q = b0 + x^2 (b2 + ...) by Horner with fused multiply-adds, clamp(p / q + 1/2, 0, 1).
    Not correctly rounded (within a few ulp): the runtime's own values, which a QDQ model's 16-bit codes follow."""
    v = np.clip(np.asarray(x, np.float32), np.float32(-18), np.float32(18))
    v2 = v * v                                                                   # x^2
    p = products.fma32(v2, _MLAS_P[0], _MLAS_P[1])                               # a9 x^2 + a7
    for c in _MLAS_P[2:]:
        p = products.fma32(p, v2, c)                                             # p x^2 + a_k
    p = p * v                                                                    # odd numerator
    q = products.fma32(v2, _MLAS_Q[0], _MLAS_Q[1])                               # b10 x^2 + b8
    for c in _MLAS_Q[2:]:
        q = products.fma32(q, v2, c)                                             # q x^2 + b_k
    return np.clip(p / q + np.float32(0.5), np.float32(0), np.float32(1))       # (NaN stays NaN)


def silu(x):
    """silu(x) = x sigmoid(x) = x / (1 + e^-x) (x = -inf: NaN, as x * sigmoid(x) is in IEEE arithmetic). Inside
    products.plain_blas(), float32 x / (1 + e^-x) as it comes (one exp, three passes: a 128-token prefill's SiLU at
    0.6B 69 -> ~25 ms)."""
    if products.plain_blas_active() and np.asarray(x).dtype == np.float32:
        with np.errstate(over="ignore", invalid="ignore"):
            return x / (1 + np.exp(-x))
    return correctly_rounded(x, lambda v: v * _sigmoid64(v), lambda v: v / (1 + mpmath.exp(-v)))


def softplus(x, threshold: float = 20.0):
    """softplus(x) = ln(1 + e^x) for x <= threshold, x itself above it (torch's softplus, beta 1)."""
    x = np.asarray(x)
    y = correctly_rounded(np.minimum(x, x.dtype.type(threshold)), lambda v: np.log1p(np.exp(v)),
                          lambda v: mpmath.log1p(mpmath.exp(v)))
    return np.where(x > threshold, x, y)


def gelu(x):
    """gelu(x) = x/2 * erfc(-x / sqrt 2) (= x/2 (1 + erf(x / sqrt 2)), transformers' "gelu")."""
    erfc = np.frompyfunc(math.erfc, 1, 1)
    return correctly_rounded(x, lambda v: 0.5 * v * erfc(-v / math.sqrt(2)).astype(np.float64),
                             lambda v: v / 2 * mpmath.erfc(-v / mpmath.sqrt(2)))


def gelu_tanh(x):
    """gelu with the tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    = x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)) (transformers' "gelu_new" / "gelu_pytorch_tanh")."""
    c = math.sqrt(2 / math.pi)
    return correctly_rounded(
        x, lambda v: v / (1 + np.exp(-2 * c * (v + 0.044715 * v ** 3))),
        lambda v: v / (1 + mpmath.exp(-2 * mpmath.sqrt(2 / mpmath.pi) * (v + mpmath.mpf("0.044715") * v ** 3))))


def power(base: float, exponent):
    """base ** exponent for a scalar base > 0 and float32 exponents (RoPE's frequencies), correctly rounded."""
    b = mpmath.mpf(float(base))
    return correctly_rounded(exponent, lambda v: np.float64(base) ** v, lambda v: b ** v)


def scalar(expression) -> float:
    """A float64 constant computed once at 160 bits and rounded to the nearest float64 (no libm involved):
    scalar(lambda mp: mp.log(8) / mp.log(2)). Used for configuration-derived constants (RoPE scaling)."""
    with mpmath.workprec(_PREC):
        return float(expression(mpmath))


@functools.lru_cache(maxsize=None)
def inverse_sqrt(n: int) -> float:
    """n^-1/2 correctly rounded to float64 (attention's default scale, D^-1/2), free of the platform's pow."""
    return scalar(lambda mp: mp.mpf(n) ** -0.5)
