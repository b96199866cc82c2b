"""Error metrics of a device value t against a golden g, and the dtype names refimpl accepts (spec
device_conventions.md §9). Shared by the diff (refimpl.diff.metrics: the per-tensor and per-logit rows) and
refimpl.testing (assert_close's failure message); NumPy and ml_dtypes only.

    dtype_name("bf16")              # "bfloat16" (DTYPE_ALIASES: fp32 / f32, fp16 / f16 / half, bf16, fp64 / f64)
    ulp_distance(g, t, "fp16")      # representable float16 steps between the two, elementwise
    sqnr_db(g, t), nmse(g, t), cosine(g, t), max_rel_sym(g, t), not_close_mask(g, t, atol, rtol)

The scalar metrics take finite float64 vectors already restricted to the compared elements. Degenerate
denominators (all-zero golden, identical tensors, nothing to compare) give inf or nan by the rule stated in each
docstring, never a silent ZeroDivision or a NumPy warning; results are plain Python floats.
"""

import math

import ml_dtypes
import numpy as np

from .errors import InputError

# Polygraphy replaces exact zeros of the reference by this when dividing (§9.1, §9.3)
POLYGRAPHY_EPS = 2.22e-16

# dtype name -> (float type, unsigned integer type of the same width)
_FLOAT_TYPES = {
    "float32": (np.dtype(np.float32), np.dtype(np.uint32)),
    "float16": (np.dtype(np.float16), np.dtype(np.uint16)),
    "bfloat16": (np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint16)),
}
# alias -> dtype name, the one table of dtype names the diff's policies and refimpl.testing accept
DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "fp16": "float16", "f16": "float16", "half": "float16",
                 "htp-fp16": "float16",   # the HTP precision policy (refimpl.precision): an fp16 device
                 "bf16": "bfloat16", "fp64": "float64", "f64": "float64"}


def dtype_name(dtype) -> str:
    """The canonical name ("float32", "float16" or "bfloat16") of a dtype given by name or type."""
    if isinstance(dtype, str):
        name = DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    else:
        name = np.dtype(dtype).name
    if name not in _FLOAT_TYPES:
        raise InputError(f"ULP dtype: expected one of fp32 / fp16 / bf16, got {dtype!r}")
    return name


# --- ULP -------------------------------------------------------------------------------------------


def ordered_int(x, dtype) -> np.ndarray:
    """The ordered-integer image of x after rounding it to `dtype` (int64).

    Let u be the n-bit pattern of x cast to dtype (round to nearest even), s = u >> (n-1) its sign bit
    and m = u & (2^(n-1) - 1) its magnitude bits. Then ord(x) = -m if s else m. The map is monotone in x,
    consecutive representable values differ by 1, +0 and -0 both map to 0, and ±inf sit one step past
    ±max. NaN maps to some integer and must be masked out by the caller.
    """
    ftype, utype = _FLOAT_TYPES[dtype_name(dtype)]
    bits = utype.itemsize * 8
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to ±inf is a value like any other
        u = np.asarray(x).astype(ftype).view(utype).astype(np.int64)
    m = u & ((1 << (bits - 1)) - 1)
    return np.where(u >> (bits - 1) == 1, -m, m)


def ulp_distance(a, b, dtype="float32") -> np.ndarray:
    """Elementwise ULP distance |ord(a) - ord(b)| in `dtype` (fp32 / fp16 / bf16), as float64.

    Both inputs are first rounded to dtype (bf16 through ml_dtypes); ord is `ordered_int`. The distance
    is the number of representable steps between the two values (§9.1 "ULP distance"): 0 for equal
    values and for +0 vs -0, 1 for x vs np.nextafter(x). Where either input is NaN the result is NaN
    (hence float64; every fp32 distance, < 2^33, is exact in float64).
    """
    a = np.asarray(a)
    b = np.asarray(b)
    d = np.abs(ordered_int(a, dtype) - ordered_int(b, dtype)).astype(np.float64)
    nan = np.isnan(a.astype(np.float64)) | np.isnan(b.astype(np.float64))
    return np.where(nan, np.nan, d)


# --- scalar metrics on finite float64 vectors g, t (already restricted to the valid region) --------


def max_abs(g, t) -> float:
    """max |t - g| (§9.1). nan when there is nothing to compare."""
    return float(np.max(np.abs(t - g))) if g.size else math.nan


def rel_diff_polygraphy(g, t) -> np.ndarray:
    """Polygraphy's reldiff |t - g| / |g|, exact zeros of g replaced by 2.22e-16 (§9.1, §9.3 step 2)."""
    ag = np.abs(g)
    with np.errstate(over="ignore"):  # a subnormal g can give inf: an honest answer
        return np.abs(t - g) / np.where(ag == 0, POLYGRAPHY_EPS, ag)


def max_rel_polygraphy(g, t) -> float:
    """max |t - g| / |g|_ε with ε = 2.22e-16 for exact zeros of g (§9.1 "max rel"). Explodes near 0."""
    return float(np.max(rel_diff_polygraphy(g, t))) if g.size else math.nan


def max_rel_sym(g, t) -> float:
    """The robust max rel: max |t - g| / max(|g|, |t|), with 0/0 (both exactly 0) taken as 0.

    This is the symmetric form QAIRT's rtolatol counts against 5% (§6). It lies in [0, 2] (≤ 1 when
    the signs agree, 2 for t = -g, 1 when one side is 0), so a near-zero golden cannot blow it up.
    """
    if not g.size:
        return math.nan
    den = np.maximum(np.abs(g), np.abs(t))
    r = np.abs(t - g) / np.where(den == 0, 1.0, den)  # den == 0 only where g == t == 0, so r = 0 there
    return float(np.max(r))


def rel_p99(g, t) -> float:
    """rel@p99: the 0.99 quantile of Polygraphy's reldiff (§13.3, §9.3 step 4 "quantile" mode).

    Linear interpolation, as np.quantile's default (what Polygraphy calls), but inf-safe. Up to 1% of
    elements, e.g. near-zero goldens, may have exploding reldiff without moving it.
    """
    return quantile_linear(rel_diff_polygraphy(g, t), 0.99) if g.size else math.nan


def quantile_linear(x, q) -> float:
    """The q-quantile of non-NaN x with linear interpolation: s = sort(x), pos = q·(N - 1),
    s[⌊pos⌋] + (s[⌊pos⌋+1] - s[⌊pos⌋])·frac(pos) (np.quantile's "linear"); inf when the upper
    neighbour it interpolates towards is inf (np.quantile would give nan there)."""
    s = np.sort(np.asarray(x, np.float64).ravel())
    pos = q * (s.size - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, s.size - 1)
    f = pos - lo
    if f == 0 or s[hi] == s[lo]:
        return float(s[lo])
    if math.isinf(s[hi]):
        return math.inf
    return float(s[lo] + (s[hi] - s[lo]) * f)


def mse(g, t) -> float:
    """mean((t - g)^2) (§9.1). nan when empty."""
    return float(np.mean((t - g) ** 2)) if g.size else math.nan


def cosine(g, t) -> float:
    """Σ g·t / (√Σg² · √Σt²) (§9.1).

    Zero vectors: 1.0 when both g and t are all zero (identical), 0.0 when exactly one is (no shared
    direction; fails any cosine threshold), nan when empty. Clipped to [-1, 1] against rounding.
    """
    if not g.size:
        return math.nan
    ng, nt = math.sqrt(float(np.dot(g, g))), math.sqrt(float(np.dot(t, t)))
    if ng == 0 or nt == 0:
        return 1.0 if ng == nt else 0.0
    return float(min(1.0, max(-1.0, float(np.dot(g, t)) / (ng * nt))))


def nmse(g, t) -> float:
    """Σ(t - g)² / Σg², g the reference (§9.1; ggml test-backend-ops §9.2, a = CPU = golden).

    All-zero golden: 0.0 if t is all zero too (no error), inf otherwise (any error is infinitely large
    relative to zero signal). nan when empty. Always NMSE = 10^(-sqnr_db/10).
    """
    if not g.size:
        return math.nan
    noise, signal = float(np.sum((t - g) ** 2)), float(np.sum(g**2))
    if signal == 0:
        return 0.0 if noise == 0 else math.inf
    return noise / signal


def _db(signal: float, noise: float) -> float:
    """10·log10(signal / noise) as a difference of logs (no under/overflow of the ratio); zero noise: +inf,
    zero signal with noise: -inf."""
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    if math.isinf(signal) or math.isinf(noise) or math.isnan(signal) or math.isnan(noise):
        return math.nan  # sums of squares past the float64 range (tensor_metrics scales by 2^k first)
    return 10.0 * (math.log10(signal) - math.log10(noise))


def sqnr_db(g, t) -> float:
    """Standard SQNR: 10·log10(Σg² / Σ(t - g)²) dB, signal power from the golden (§9.1).

    Identical tensors (zero noise): +inf, whatever the signal (also for all-zero g = t). All-zero
    golden with nonzero noise: -inf. nan when empty. Equals -10·log10(nmse).
    """
    if not g.size:
        return math.nan
    return _db(float(np.sum(g**2)), float(np.sum((t - g) ** 2)))


def sqnr_qairt_db(g, t) -> float:
    """QAIRT's `sqnr` verifier: 10·log10(mean(t²) / mean((g - t)²)) dB (§6, §9.1).

    Labelled separately because the signal power comes from the device (inference) tensor t, not the
    golden. Zero MSE, where QAIRT returns 'SAME': +inf. All-zero t with nonzero MSE: -inf. nan when empty.
    """
    if not g.size:
        return math.nan
    return _db(float(np.mean(t**2)), float(np.mean((g - t) ** 2)))


def psnr_db(g, t) -> float:
    """AI Hub PSNR: 20·log10((max|g| + 1e-5) / (√mean((t - g)²) + 1e-10)) dB, g = ground truth (§9.1).

    The epsilons are the tool's, so no case divides by zero: identical tensors give
    20·log10((max|g| + 1e-5) / 1e-10), e.g. 100 dB for all-zero g = t. nan when empty.
    """
    if not g.size:
        return math.nan
    return psnr_from_peak(float(np.max(np.abs(g))), math.sqrt(float(np.mean((t - g) ** 2))))


def psnr_from_peak(peak: float, rmse: float) -> float:
    """AI Hub's PSNR in dB from the golden's peak max|g| and the RMS error (psnr_db's epsilons)."""
    return 20.0 * math.log10((peak + 1e-5) / (rmse + 1e-10))


def std_ratio(g, t) -> float:
    """QAIRT `std`: |σ(t) - σ(g)| / |σ(g)| (§6), population σ.

    0.0 on an exact match; 100.0 when σ(g) = 0 and the tensors differ (QAIRT's rule); nan when empty.
    """
    if not g.size:
        return math.nan
    if np.array_equal(g, t):
        return 0.0
    sg, st = float(np.std(g)), float(np.std(t))
    if sg == 0:
        return 100.0
    return abs(st - sg) / sg


def not_close_mask(g, t, atol, rtol) -> np.ndarray:
    """Elements failing isclose: |t - g| > atol + rtol·|g| (§6 rtolatol, §9.1, §9.4 CANN).

    Works on any float64 arrays: NaN on either side fails; an infinity passes only against the same
    infinity (t == g); any other infinity fails.
    """
    with np.errstate(invalid="ignore"):
        close = np.abs(t - g) <= atol + rtol * np.abs(g)
    both_finite = np.isfinite(g) & np.isfinite(t)
    return ~((close & both_finite) | (t == g))
