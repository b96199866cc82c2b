"""The diff's per-tensor and per-logit metric rows, golden g against device t (spec device_conventions.md §9);
the formulas they use are refimpl.metrics'.

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
  the rule stated in each formula's docstring (refimpl.metrics), never a silent ZeroDivision or a NumPy warning.
- Results are plain Python floats / ints / strings, so json.dumps works (inf and nan are written as
  Infinity / NaN, Python's default).
"""

import math

import numpy as np

from ..bundle import valid_mask
from ..errors import InputError
from ..metrics import (
    cosine,
    dtype_name,
    max_abs,
    max_rel_polygraphy,
    max_rel_sym,
    mse,
    nmse,
    not_close_mask,
    psnr_from_peak,
    rel_p99,
    sqnr_db,
    sqnr_qairt_db,
    std_ratio,
    ulp_distance,
)

# CANN "mixed tolerance" defaults per dtype (§9.4): (atol, rtol)
DEFAULT_TOLERANCES = {
    "float32": (2.0**-16, 2.0**-10),
    "float16": (2.0**-9, 2.0**-9),
    "bfloat16": (2.0**-6, 2.0**-6),
}


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
    psnr = psnr_from_peak(float(np.max(np.abs(g))), s * math.sqrt(scaled_mse)) if g.size else math.nan
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
    """The k largest indices per row of [R, V] x, ties broken by the lower index (stable sort).

    Finite rows: only the values >= the row's k-th largest (np.partition) are sorted, in index order, so ties keep
    the lower index first: the stable sort's first k, without sorting a whole vocabulary per row."""
    x = np.asarray(x, np.float64)
    V = x.shape[-1]
    if k >= V or not np.isfinite(x).all():
        return np.argsort(-x, axis=-1, kind="stable")[:, :k]
    kth = np.partition(x, V - k, axis=-1)[:, V - k]                                # [R] the k-th largest
    out = np.empty((x.shape[0], k), np.intp)
    for r, row in enumerate(x):
        at = np.flatnonzero(row >= kth[r])                                         # >= k indices, ascending
        out[r] = at[np.argsort(-row[at], kind="stable")[:k]]
    return out


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


def code_shift(want, have, encoding=None) -> dict:
    """Integer codes of a quantised tap, the quantised golden's `want` against the device's `have` (int64, one
    shape): {"codes": c, "share": s, "n": n} with c != 0 the commonest difference have - want other than 0 and s the
    share of the n codes it shifts (c = 0, s = 0 when every code agrees); given the tap's encoding (refimpl.encodings
    .Encoding), also its zero point and step (per axis: the largest) for the fault's words. policy.CODE_SHIFT judges
    it: a zero point the device runs that is not its encoding's shifts most codes alike."""
    d = (np.asarray(have, np.int64) - np.asarray(want, np.int64)).ravel()
    values, counts = np.unique(d[d != 0], return_counts=True)
    i = int(np.argmax(counts)) if counts.size else None
    out = {"codes": 0 if i is None else int(values[i]), "share": 0.0 if i is None else float(counts[i]) / d.size,
           "n": int(d.size)}
    if encoding is not None:
        out.update(zero_point=-int(np.max(encoding.offset)), scale=float(np.max(encoding.scale)))
    return out
