"""Per-tensor and per-logit comparison metrics, golden g against device t (spec device_conventions.md §9).

    m = tensor_metrics(golden, device, valid=[[0, 4], [0, 8]], dtype="bf16")
    m["sqnr_db"], m["nmse"], m["cosine"], m["not_close_frac"], m["ulp_max"], m["n_nan"]
    l = logits_metrics(golden_logits, device_logits, valid_rows=None, k=5)
    l["top1_agreement"], l["kl_over_lnv_mean"], l["dp_top_max"]

Conventions shared by every function here:
- Only the valid region is scored (§13.1, §13.3); `valid` is a list of [start, stop) boxes per axis
  (refimpl.bundle.valid_mask), a boolean mask of the tensor's shape, or None (all valid).
- Both tensors are upcast to float64 before any arithmetic (bf16 / fp16 / fp32 in, exact sums out).
- NaN / Inf never raise. They are counted (n_nan, n_inf of the device; golden_n_nan, golden_n_inf of
  the golden) and every other metric is computed over the elements where both tensors are finite
  (n_compared of them). The not-close share is the exception: it is over all valid elements and a
  non-finite element fails unless both sides hold the same infinity.
- Degenerate denominators (all-zero golden, identical tensors, nothing to compare) give inf or nan by
  the rule stated in each docstring, never a silent ZeroDivision or a NumPy warning.
- Results are plain Python floats / ints / strings, so json.dumps works (inf and nan are written as
  Infinity / NaN, Python's default).
"""

import math

import ml_dtypes
import numpy as np

from ..bundle import valid_mask
from ..errors import InputError

# Polygraphy replaces exact zeros of the reference by this when dividing (§9.1, §9.3)
POLYGRAPHY_EPS = 2.22e-16

# dtype name -> (float type, unsigned integer type of the same width)
_FLOAT_TYPES = {
    "float32": (np.dtype(np.float32), np.dtype(np.uint32)),
    "float16": (np.dtype(np.float16), np.dtype(np.uint16)),
    "bfloat16": (np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint16)),
}
_ALIASES = {"fp32": "float32", "f32": "float32", "fp16": "float16", "f16": "float16", "half": "float16",
            "bf16": "bfloat16"}

# CANN "mixed tolerance" defaults per dtype (§9.4): (atol, rtol)
DEFAULT_TOLERANCES = {
    "float32": (2.0**-16, 2.0**-10),
    "float16": (2.0**-9, 2.0**-9),
    "bfloat16": (2.0**-6, 2.0**-6),
}


def dtype_name(dtype) -> str:
    """The canonical name ("float32", "float16" or "bfloat16") of a dtype given by name or type."""
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype.lower(), dtype.lower())
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
    return _psnr(float(np.max(np.abs(g))), math.sqrt(float(np.mean((t - g) ** 2))))


def _psnr(peak: float, rmse: float) -> float:
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


# --- the per-tensor table row ----------------------------------------------------------------------


def _mask(shape, valid) -> np.ndarray:
    if valid is None or not isinstance(valid, np.ndarray):
        return valid_mask(shape, valid)
    if valid.dtype != bool or valid.shape != tuple(shape):
        raise InputError(f"valid mask: expected a bool array of shape {tuple(shape)}, "
                         f"got {valid.dtype} {valid.shape}")
    return valid


def tensor_metrics(golden, device, valid=None, dtype="float32", atol=None, rtol=None) -> dict:
    """Every per-tensor metric of §13.3 over the valid region, as a JSON-ready dict.

    golden, device: arrays of the same shape (any float dtype, bf16 included). valid: None, boxes
    ([[start, stop) per axis], ...) or a bool mask. dtype: the device dtype for ULP distances and the
    default tolerances; atol / rtol default to CANN's table for dtype (§9.4: fp32 2⁻¹⁶ / 2⁻¹⁰,
    fp16 2⁻⁹ / 2⁻⁹, bf16 2⁻⁶ / 2⁻⁶).

    Keys (formulas in the functions named):
      n (valid elements), n_compared (valid, both finite), n_nan / n_inf (device, valid region),
      golden_n_nan / golden_n_inf, max_abs, worst_index (index of max_abs in the full tensor, or None),
      max_rel (robust symmetric form, max_rel_sym), max_rel_polygraphy, rel_p99, mse, cosine, sqnr_db
      (standard), sqnr_qairt_db (QAIRT variant, signal from device), nmse, psnr_db (AI Hub), std_ratio,
      not_close (count), not_close_frac (over n, non-finite elements fail), matched_ratio
      (1 - not_close_frac, CANN), ulp_max / ulp_mean (in dtype), dtype, atol, rtol.
    """
    golden, device = np.asarray(golden), np.asarray(device)
    if golden.shape != device.shape:
        raise InputError(f"tensor_metrics: golden shape {golden.shape} != device shape {device.shape}")
    name = dtype_name(dtype)
    d_atol, d_rtol = DEFAULT_TOLERANCES[name]
    atol = d_atol if atol is None else float(atol)
    rtol = d_rtol if rtol is None else float(rtol)

    mask = _mask(golden.shape, valid)
    idx = np.flatnonzero(mask)
    g_all = golden.astype(np.float64).ravel()[idx]
    t_all = device.astype(np.float64).ravel()[idx]
    finite = np.isfinite(g_all) & np.isfinite(t_all)
    g, t = g_all[finite], t_all[finite]

    bad = not_close_mask(g_all, t_all, atol, rtol)
    n = int(idx.size)
    worst = None
    if g.size:
        flat = idx[finite][int(np.argmax(np.abs(t - g)))]
        worst = [int(i) for i in np.unravel_index(flat, golden.shape)]
    ulp = ulp_distance(g, t, name)
    # scale-free metrics on g / 2^k, t / 2^k (exact), so sums of squares of huge values (float64 masks of
    # -1.8e308, logits of 1e200) cannot overflow; mse and PSNR are scaled back
    peak = float(max(np.max(np.abs(g)), np.max(np.abs(t)))) if g.size else 0.0
    s = 2.0 ** math.floor(math.log2(peak)) if peak > 0 else 1.0
    gs, ts = g / s, t / s
    scaled_mse = mse(gs, ts)
    with np.errstate(over="ignore"):
        mse_ = scaled_mse * s * s
    psnr = _psnr(float(np.max(np.abs(g))), s * math.sqrt(scaled_mse)) if g.size else math.nan
    return {
        "n": n,
        "n_compared": int(g.size),
        "n_nan": int(np.isnan(t_all).sum()),
        "n_inf": int(np.isinf(t_all).sum()),
        "golden_n_nan": int(np.isnan(g_all).sum()),
        "golden_n_inf": int(np.isinf(g_all).sum()),
        "max_abs": max_abs(g, t),
        "golden_max_abs": float(np.max(np.abs(g))) if g.size else math.nan,
        "worst_index": worst,
        "max_rel": max_rel_sym(g, t),
        "max_rel_polygraphy": max_rel_polygraphy(g, t),
        "rel_p99": rel_p99(g, t),
        "mse": mse_,
        "golden_power": float(np.mean(gs * gs)) * s * s if g.size else math.nan,   # mean golden^2
        "cosine": cosine(gs, ts),
        "sqnr_db": sqnr_db(gs, ts),
        "sqnr_qairt_db": sqnr_qairt_db(gs, ts),
        "nmse": nmse(gs, ts),
        "psnr_db": psnr,
        "std_ratio": std_ratio(gs, ts),
        "not_close": int(bad.sum()),
        "not_close_frac": float(bad.mean()) if n else math.nan,
        "matched_ratio": float(1.0 - bad.mean()) if n else math.nan,
        "ulp_max": float(ulp.max()) if ulp.size else math.nan,
        "ulp_mean": float(ulp.mean()) if ulp.size else math.nan,
        "dtype": name,
        "atol": atol,
        "rtol": rtol,
    }


# --- logits ---------------------------------------------------------------------------------------


def log_softmax(x) -> np.ndarray:
    """Stable log-softmax over the last axis in float64: x - max(x) - ln Σ exp(x - max(x))."""
    x = np.asarray(x, np.float64)
    z = x - np.max(x, axis=-1, keepdims=True)
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def kl_rows(golden_logits, device_logits) -> np.ndarray:
    """Forward KL(p‖q) = Σ_v p_v (ln p_v - ln q_v) per row, p = softmax(golden), q = softmax(device) (§9.6).

    Terms with p_v = 0 (underflow) contribute 0. Clipped at 0 against rounding (KL ≥ 0).
    """
    lp, lq = log_softmax(golden_logits), log_softmax(device_logits)
    p = np.exp(lp)
    terms = np.where(p > 0, p * (lp - lq), 0.0)
    return np.maximum(np.sum(terms, axis=-1), 0.0)


def topk_indices(x, k) -> np.ndarray:
    """The k largest indices per row of [R, V] x, ties broken by the lower index (stable sort)."""
    return np.argsort(-np.asarray(x, np.float64), axis=-1, kind="stable")[:, :k]


def logits_metrics(golden_logits, device_logits, valid_rows=None, k=5) -> dict:
    """Token-level metrics of §9.6 / §13.3 over logits [..., V] (rows = all leading axes, flattened).

    valid_rows: None (all rows), a bool mask of shape logits.shape[:-1], or integer indices of the
    flattened rows. Rows where either side has a NaN or Inf are counted (n_rows_nonfinite) and
    excluded from everything else. With p = softmax(golden), q = softmax(device) in float64:
      top1_agreement   mean [argmax g == argmax t] (llama.cpp "Same top p", AI Hub flips); top1_flips
                       the count of disagreements; argmax ties go to the lower index.
      topk_overlap_mean  mean |topk(g) ∩ topk(t)| / k, k clipped to V.
      kl_over_lnv_mean / _max / _p99 / _last  KL(p‖q) / ln V (AI Hub KLDivEvaluator), _last the last
                       scored row; ≥ 0, can exceed 1.
      dp_top_mean / _max  |q(g*) - p(g*)|, g* = argmax of the golden row.
    Every metric is nan when no row is scored. V must be ≥ 2 (ln V > 0).
    """
    g, t = np.asarray(golden_logits), np.asarray(device_logits)
    if g.shape != t.shape or g.ndim < 1:
        raise InputError(f"logits_metrics: golden shape {g.shape} != device shape {t.shape} (or 0-d)")
    V = g.shape[-1]
    if V < 2:
        raise InputError(f"logits_metrics: vocabulary size must be >= 2, got {V}")
    lead = g.shape[:-1]
    g = g.astype(np.float64).reshape(-1, V)
    t = t.astype(np.float64).reshape(-1, V)
    if valid_rows is None:
        rows = np.arange(g.shape[0])
    else:
        vr = np.asarray(valid_rows)
        if vr.dtype == bool:
            if vr.shape != lead:
                raise InputError(f"valid_rows: expected a bool mask of shape {lead}, got {vr.shape}")
            rows = np.flatnonzero(vr)
        else:
            rows = vr.astype(np.int64).ravel()
    g, t = g[rows], t[rows]
    finite = np.isfinite(g).all(axis=1) & np.isfinite(t).all(axis=1)
    g, t = g[finite], t[finite]
    R, k = g.shape[0], max(1, min(int(k), V))
    out = {"n_rows": int(rows.size), "n_rows_nonfinite": int((~finite).sum()), "n_rows_scored": int(R),
           "vocab": int(V), "k": k}
    if R == 0:
        nan = math.nan
        out.update(top1_agreement=nan, top1_flips=0, topk_overlap_mean=nan, kl_over_lnv_mean=nan,
                   kl_over_lnv_max=nan, kl_over_lnv_p99=nan, kl_over_lnv_last=nan, dp_top_mean=nan,
                   dp_top_max=nan)
        return out
    top_g, top_t = np.argmax(g, axis=1), np.argmax(t, axis=1)
    kg, kt = topk_indices(g, k), topk_indices(t, k)
    overlap = np.array([len(set(a.tolist()) & set(b.tolist())) for a, b in zip(kg, kt)]) / k
    kl = kl_rows(g, t) / math.log(V)
    p, q = np.exp(log_softmax(g)), np.exp(log_softmax(t))
    r = np.arange(R)
    dp = np.abs(q[r, top_g] - p[r, top_g])
    out.update(
        top1_agreement=float(np.mean(top_g == top_t)),
        top1_flips=int(np.sum(top_g != top_t)),
        topk_overlap_mean=float(np.mean(overlap)),
        kl_over_lnv_mean=float(np.mean(kl)),
        kl_over_lnv_max=float(np.max(kl)),
        kl_over_lnv_p99=float(np.quantile(kl, 0.99)),
        kl_over_lnv_last=float(kl[-1]),
        dp_top_mean=float(np.mean(dp)),
        dp_top_max=float(np.max(dp)),
    )
    return out
