"""Dtype-aware tolerances and `assert_close` for comparing a user's kernel against refimpl's reference.

The reference is refimpl's kernel run in float64 on exactly the inputs the device kernel received (already
rounded to the device dtype), so the only error left is what the device kernel adds: its roundings to the device
dtype (storing intermediates and the output) and the rounding of its wider accumulations. With u the unit roundoff
eps / 2 of the device dtype (fp32 2^-24 = 6.0e-8, fp16 2^-11 = 4.9e-4, bf16 2^-8 = 3.9e-3) and u_acc that of the
accumulation dtype (float32; float64 for a float64 "device"), an op has two growth factors (table GROWTH):

    G   roundings to the device dtype an honest kernel stacks on one output element, counted along its longest
        path, times 2;
    F   growth of its float32 accumulations (sum lengths, algorithm depth); negligible for fp16 / bf16 kernels,
        it is what an fp32 kernel's many full-precision roundings cost;

and the defaults are

    rtol  = G * u + F * u_acc                     elementwise relative part
    atol  = rtol * scale                          elementwise absolute part: rounding errors of a sum scale
                                                  with its terms, not its result, so an output that cancels to
                                                  ~0 is judged on the terms' scale
    ratio = rtol / 2                              fla's relative RMSE, rmse(a - e) / (scale + 1e-8): honest
                                                  errors are random, so their RMS sits well below the max

scale defaults to rms(expected), which makes the ratio exactly fla's; a Case passes max(rms(expected), the rms
magnitude of the op's terms) where outputs cancel (a conv's taps, a rotation's products, attention's values).
An element passes when |a - e| <= atol + rtol * |e| (isclose, the numpy / CANN rule); the tensor passes when every
valid element passes *and* the relative RMSE is within `ratio` (metric="both", the default; "isclose" or "ratio"
use one rule). A non-finite actual value passes only against the same non-finite expected value.
"""

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..diff.classify import classify
from ..metrics import DTYPE_ALIASES, cosine, sqnr_db, ulp_distance

# (G, F) per op: G roundings to the device dtype on an output element's longest path, times 2; F the growth of
# the float32 accumulations. The tests in tests/testing check honest fp16 / bf16 / fp32 kernels stay below them.
GROWTH = {
    "exact": (0.0, 0.0),          # data movement: conv state, caches, routing ids
    "elementwise": (4.0, 4.0),    # one op + the output rounding
    "rope": (8.0, 8.0),           # 2 table roundings + 2 products + 1 sum + the output ~ 4u on the pair norm
    "rms_norm": (8.0, 16.0),      # x * r, * w, the output ~ 4u; F: the sum of n squares and the rsqrt
    "rms_norm_gated": (12.0, 16.0),  # + silu(gate) (exp, divide) and one more product
    "sdpa": (8.0, 16.0),          # + 2 max|score| on both (Case): a score rounds to u |s|, moving its probability
    "conv1d": (12.0, 8.0),        # Kc <= 4 taps summed + silu ~ 6u
    "gated_delta": (16.0, 64.0),  # fp16 operands of S^T k, S^T q, u, o ~ 8u; F: a chunked (UT / WY, C <= 64)
                                  # fp32 kernel (forward substitution over C rows): refimpl's own fp32 chunked form
                                  # needs ~48; + 4 max|within-chunk cumsum g| for exp(G_r - G_i) (Case, §7.4)
    "moe_routing": (8.0, 8.0),    # softmax (exp, sum, divide) + top-k renormalisation ~ 4u
}


@dataclass(frozen=True)
class Tolerance:
    """rtol and ratio are relative; atol is absolute (None: rtol * scale, computed per comparison)."""
    rtol: float
    atol: float | None
    ratio: float
    dtype: str
    growth: float
    acc_growth: float


def dtype_of(dtype) -> np.dtype:
    """np.dtype of a name or type: float32 / float16 / bfloat16 / float64 (aliases fp32, fp16, half, bf16, f64)."""
    if isinstance(dtype, str):
        dtype = DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
        if dtype == "bfloat16":
            return np.dtype(ml_dtypes.bfloat16)
    d = np.dtype(dtype)
    if d.name not in ("float16", "bfloat16", "float32", "float64"):
        raise ValueError(f"refimpl.testing: dtype must be float16, bfloat16, float32 or float64; got {dtype!r}")
    return d


def unit_roundoff(dtype) -> float:
    """u = eps / 2: the largest relative error of rounding a real to `dtype` (round to nearest)."""
    return float(ml_dtypes.finfo(dtype_of(dtype)).eps) / 2


def tolerance(dtype, op: str = "elementwise", *, growth=None, rtol=None, atol=None, ratio=None) -> Tolerance:
    """The default tolerance for an output of `op` computed in `dtype` (module docstring); explicit values win.

    growth: None (the op's (G, F) from GROWTH), a number (G, keeping the op's F) or a pair (G, F).
    """
    G, F = GROWTH[op]
    if growth is not None:
        G, F = (float(growth[0]), float(growth[1])) if isinstance(growth, (tuple, list)) else (float(growth), F)
    d = dtype_of(dtype)
    u_acc = unit_roundoff("float64" if d.name == "float64" else "float32")
    r = G * unit_roundoff(d) + F * u_acc
    return Tolerance(rtol=r if rtol is None else float(rtol), atol=None if atol is None else float(atol),
                     ratio=r / 2 if ratio is None else float(ratio), dtype=d.name, growth=G, acc_growth=F)


def rel_rmse(actual, expected) -> float:
    """fla's error ratio: sqrt(mean((a - e)^2)) / (sqrt(mean(e^2)) + 1e-8) (device_conventions.md §9.5)."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if not e.size:
        return 0.0
    return math.sqrt(float(np.mean((a - e) ** 2))) / (math.sqrt(float(np.mean(e * e))) + 1e-8)


def _fmt_index(flat: int, shape) -> str:
    return str(tuple(int(i) for i in np.unravel_index(flat, shape))) if shape else "()"


def compare(actual, expected, *, dtype=None, op: str = "elementwise", growth=None, rtol=None, atol=None,
            ratio=None, metric: str = "both", valid=None, scale=None) -> dict:
    """Score `actual` against `expected` with the rules of the module docstring; never raises on a mismatch.

    actual, expected: arrays of one shape (any float dtype). dtype: the device dtype the tolerance is for
    (default: actual's dtype, float64 read as float32). valid: a bool mask of the shape (False: not compared).
    scale: the magnitude errors are proportional to (atol = rtol * scale, ratio = rmse / (scale + 1e-8));
    default rms(expected) over the compared elements; a given scale below rms(expected) is raised to it.
    Returns a dict: passed, n, n_fail (elements failing isclose, non-finite mismatches included), n_nonfinite
    (non-finite mismatches), worst (flat index of the worst element by |a - e| / (atol + rtol |e|), or None),
    excess (that worst ratio; <= 1 passes), rel_rmse, max_abs, scale, the tolerance fields (rtol, atol,
    ratio_limit, growth, acc_growth, dtype, metric), and the message on failure.
    """
    a, e = np.asarray(actual), np.asarray(expected)
    if a.shape != e.shape:
        raise AssertionError(f"assert_close: shape mismatch, actual {a.shape} vs expected {e.shape}")
    if metric not in ("both", "isclose", "ratio"):
        raise ValueError(f"assert_close: metric must be 'both', 'isclose' or 'ratio'; got {metric!r}")
    if dtype is None:
        dtype = a.dtype if a.dtype.name in ("float16", "bfloat16", "float32") else "float32"
    tol = tolerance(dtype, op, growth=growth, rtol=rtol, atol=atol, ratio=ratio)
    shape = a.shape
    a64, e64 = a.astype(np.float64).ravel(), e.astype(np.float64).ravel()
    mask = np.ones(a64.shape, bool) if valid is None else np.broadcast_to(np.asarray(valid, bool), shape).ravel()
    idx = np.flatnonzero(mask)
    a64, e64 = a64[idx], e64[idx]

    finite = np.isfinite(a64) & np.isfinite(e64)
    same_special = ~finite & ((a64 == e64) | (np.isnan(a64) & np.isnan(e64)))  # same inf, or NaN on both sides
    nonfinite_bad = ~finite & ~same_special
    af, ef = a64[finite], e64[finite]
    rms = math.sqrt(float(np.mean(ef * ef))) if ef.size else 0.0
    rms = rms if scale is None else max(rms, float(scale))
    tiny = float(ml_dtypes.finfo(dtype_of(tol.dtype)).smallest_subnormal)
    atol_v = tol.atol if tol.atol is not None else tol.rtol * max(rms, tiny)
    err = np.abs(af - ef)
    bound = atol_v + tol.rtol * np.abs(ef)
    with np.errstate(divide="ignore", invalid="ignore"):
        score = np.where(err == 0, 0.0, err / bound)  # bound = 0 (exact ops): any error is an infinite excess
    close_fail = score > 1
    ratio_v = math.sqrt(float(np.mean(err * err))) / (rms + 1e-8) if err.size else 0.0
    n_fail = int(close_fail.sum() + nonfinite_bad.sum())

    worst = None
    if nonfinite_bad.any():
        worst = int(idx[np.flatnonzero(nonfinite_bad)[0]])
        excess = math.inf
    elif err.size:
        j = int(np.argmax(score))
        worst, excess = int(idx[np.flatnonzero(finite)[j]]), float(score[j])
    else:
        excess = 0.0
    isclose_ok = n_fail == 0
    ratio_ok = not nonfinite_bad.any() and ratio_v <= tol.ratio
    passed = {"both": isclose_ok and ratio_ok, "isclose": isclose_ok, "ratio": ratio_ok}[metric]
    out = {"passed": passed, "n": int(idx.size), "n_fail": n_fail, "n_nonfinite": int(nonfinite_bad.sum()),
           "worst": worst, "excess": excess, "rel_rmse": ratio_v, "max_abs": float(err.max()) if err.size else 0.0,
           "scale": rms, "rtol": tol.rtol, "atol": atol_v, "ratio_limit": tol.ratio, "growth": tol.growth,
           "acc_growth": tol.acc_growth,
           "dtype": tol.dtype, "metric": metric}
    if not passed:
        out["message"] = _message(out, a, e, shape, ef, af, op)
    return out


def _message(r: dict, a, e, shape, ef, af, op) -> str:
    """The failure report: the rule, how many elements fail, the worst element, and the summary metrics."""
    lines = [f"assert_close ({op}, {r['dtype']}, shape {shape}): "
             f"{r['n_fail']} of {r['n']} compared elements not close ({100 * r['n_fail'] / max(r['n'], 1):.3g}%), "
             f"{r['n_nonfinite']} of them non-finite mismatches",
             f"  rule: |a - e| <= atol + rtol*|e| with rtol = {r['rtol']:.3g}, atol = {r['atol']:.3g} "
             f"(growth {r['growth']:.3g} x u({r['dtype']}) + {r['acc_growth']:.3g} x u_acc; atol = rtol * scale, "
             f"scale {r['scale']:.4g}); "
             f"rel RMSE <= {r['ratio_limit']:.3g}; metric {r['metric']!r}"]
    if r["worst"] is not None:
        w = r["worst"]
        av, ev = float(a.ravel()[w]), float(e.ravel()[w])
        abs_err = abs(av - ev)
        rel = abs_err / abs(ev) if ev != 0 else math.inf
        lines.append(f"  worst element at index {_fmt_index(w, shape)}: actual {av:.6g}, expected {ev:.6g}, "
                     f"abs err {abs_err:.3g}, rel err {rel:.3g} ({r['excess']:.3g}x its tolerance "
                     f"{r['atol'] + r['rtol'] * abs(ev):.3g})" if math.isfinite(ev) and math.isfinite(av) else
                     f"  worst element at index {_fmt_index(w, shape)}: actual {av}, expected {ev} (non-finite)")
    extra = ""
    if ef.size:
        extra = f", cosine {cosine(ef, af):.6f}, SQNR {sqnr_db(ef, af):.1f} dB"
        if r["dtype"] != "float64":
            extra += f", max ULP ({r['dtype']}) {float(np.max(ulp_distance(ef, af, r['dtype']))):.0f}"
    lines.append(f"  metrics: rel RMSE {r['rel_rmse']:.3g} (limit {r['ratio_limit']:.3g}; rmse / scale), "
                 f"max abs err {r['max_abs']:.3g}{extra}")
    return "\n".join(lines)


def assert_close(actual, expected, *, dtype=None, op: str = "elementwise", growth=None, rtol=None, atol=None,
                 ratio=None, metric: str = "both", valid=None, scale=None, name: str | None = None) -> dict:
    """Assert that a device kernel's output matches refimpl's reference within dtype-aware tolerances.

    actual: the kernel's output; expected: the reference (float64 from Case.reference(), or any array).
    dtype: the device dtype (default actual's); op: a key of GROWTH choosing the default growths (G, F);
    growth / rtol / atol / ratio override the defaults (module docstring). metric: "both" | "isclose" | "ratio".
    valid: a bool mask of the elements to compare. scale: the error scale (default rms(expected)).
    Raises AssertionError naming the worst element (index, actual, expected, abs / rel error), how many elements
    fail, and the metrics; returns compare()'s dict when it passes.
    """
    r = compare(actual, expected, dtype=dtype, op=op, growth=growth, rtol=rtol, atol=atol, ratio=ratio,
                metric=metric, valid=valid, scale=scale)
    if not r["passed"]:
        raise AssertionError((f"{name}: " if name else "") + r["message"] + _fault(actual, expected, dtype, valid))
    return r


def _fault(actual, expected, dtype, valid) -> str:
    """The failure's kind (refimpl.diff.classify at the precision floor of the device dtype), as a last line."""
    a, e = np.asarray(actual), np.asarray(expected)
    if a.shape != e.shape or not np.issubdtype(a.dtype, np.floating) and a.dtype.name != "bfloat16":
        return ""
    name = dtype_of(dtype if dtype is not None else a.dtype).name
    f = classify(e, a, valid, name if name in ("float16", "bfloat16") else "float32")
    return f"\n  fault class: {f.kind}: {f.summary}"

