"""Name the kind of fault a device tensor shows against its reference: a small set of fault models, each fitted by
least squares or tested exactly, and the one that explains the device chosen by a stated criterion (docs/diff.md).

    fault = classify(reference, device, valid=None, dtype="fp16")
    fault.kind, fault.params, fault.summary     # "gain", {"factor": 1.02, ...}, "scaled by 1.02 (whole tensor)"

Let r, d be the reference and the device over the compared region V (valid, reference finite) and
NMSE(x) = sum_V (d - x)^2 / sum_V r^2. The precision floor F of the device dtype is the diff's calibrated NMSE bar
(policy.DEFAULTS: fp32 1e-8, fp16 1e-5, bf16 1e-4: honest independent runtimes stay under it), or for an integer
grid of step s (int8 / int16 at an encoding's scale) k^2 s^2 / 12 over the reference's mean square (k = 4, three-way's
k), or the caller's (the diff passes the bar that judged the tensor).

    non-finite      d is NaN / Inf somewhere r is finite (an exact test, before any fit)
    precision       NMSE(r) <= F: the residual is rounding to the device's grid, no fault
    a model M       fits when NMSE(M(r)) <= F and its residual per degree of freedom is at most a quarter of the
                    residual before: NMSE(M(r)) n / (n - k) <= NMSE(r) / 4 for k parameters over n elements (fitting
                    k parameters to noise removes a fraction k / n of it, not three quarters); of the models that
                    fit, the one with the fewest parameters wins (BIC's order); two of different kinds with as few:
                    "unexplained" (ambiguous)
    unexplained     no model fits (the closest is reported, as evidence, never as the answer); or, for a reduced-
                    precision dtype, NMSE(r) < 100 F: the fp16 / bf16 / int floor is one rounding's error, and an
                    honest device's accumulates past it (a per-head gate rounded in bf16 is a per-head gain of a
                    few %): below 100 F a fault cannot be told from rounding without an emulation (three-way, whose
                    floor the diff passes with separation 1)

Models (parameters): gain c r (1) or c_j r per slice j of an axis (one per slice); offset r + b (1) or r + b_j;
sign / swap -r, halves of an axis swapped (with a sign: rotate_half), c_j = -1 on some slices; permutation of the
slices of an axis (heads, channels, rows; found by nearest slice), or a layout (the reference transposed, in its own
shape or its bytes in the reference's shape: a K cache written untransposed); shift by 1 or 2 along an axis (the
device at i holds the reference at i + s), a roll; stale state (d equals the previous step's reference, or the
initial zeros, where the caller gives `previous`); saturation clip(r, lo, hi) (lo at a mask's floor: masked region);
masked region (d zero where r is not, or nonzero where r is exactly zero); alternatives (the reference computed under
a known wrong convention by the caller, e.g. RoPE over interleaved pairs).
"""

import dataclasses
import itertools
import math
import re

import ml_dtypes
import numpy as np

from ..bundle import valid_mask
from ..errors import InputError
from ..metrics import DTYPE_ALIASES
from .channels import gain_floor, sample_axes, whitened
from .divergence import model_config
from .layouts import candidates, conv_kernel
from .policy import DEFAULTS, shifted_codes

CLASSES = ("gain", "offset", "permutation", "shift", "stale state", "precision", "saturation", "non-finite",
           "masked region", "sign/swap", "unexplained")
K = 4.0                        # an integer grid's floor: k^2 x its rounding NMSE (three-way judging's k)
IMPROVEMENT = 4.0              # a model must cut the residual NMSE by at least this factor
SEPARATION = 100.0             # reduced precision: the floor is a typical rounding error, not a ceiling (honest error
                               # accumulates past it): a fault is named only 100x above it (10x in RMS)
MIN_PER_GROUP = 2              # a per-slice model needs this many compared elements per parameter
MAX_PERMUTED = 1024            # largest axis searched for a permutation of its slices
MAX_LAYOUT_ELEMENTS = 1 << 22  # largest tensor tried in every axis order
FLOAT_MAX = {"float16": 65504.0, "bfloat16": float(ml_dtypes.finfo(ml_dtypes.bfloat16).max),
             "float32": float(np.finfo(np.float32).max)}
INT_BITS = {"int8": 8, "int16": 16, "uint8": 8, "uint16": 16}
STATE_NAME = re.compile(r"past|present|state|cache|key|value")   # graph I/O names of carried caches and states


@dataclasses.dataclass
class Fault:
    """What classify found: kind (one of CLASSES), params (the fitted parameters), summary (one line), the residual
    NMSE before and after the fit, the floor F and the criterion that chose it, and the other models that fit."""
    kind: str
    summary: str
    params: dict
    residual_before: float
    residual_after: float
    floor: float
    criterion: str
    candidates: list = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready: {"class", "summary", "params", "residual_before", "residual_after", "floor", "criterion",
        "candidates"}."""
        return {"class": self.kind, "summary": self.summary, "params": self.params,
                "residual_before": self.residual_before, "residual_after": self.residual_after, "floor": self.floor,
                "criterion": self.criterion, "candidates": self.candidates}

    def __str__(self) -> str:
        return f"{self.kind}: {self.summary}"


@dataclasses.dataclass
class _Fit:
    kind: str
    nparams: int
    after: float
    params: dict
    summary: str
    model: object = None       # the fitted device prediction (for plots), or None


def precision_floor(dtype="float32", reference=None, scale=None) -> float:
    """F of the module docstring: the NMSE rounding to the device's grid may leave."""
    name = DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if name in INT_BITS:
        r = np.asarray(reference, np.float64) if reference is not None else None
        if scale is None:   # symmetric, per tensor, over the reference's range
            scale = (np.max(np.abs(r)) if r is not None and r.size else 1.0) / (2 ** (INT_BITS[name] - 1) - 1)
        power = float(np.mean(r * r)) if r is not None and r.size else 0.0
        grid = K * K * float(scale) ** 2 / 12 / power if power > 0 else math.inf
        return max(DEFAULTS["float32"]["max_nmse"], grid)
    if name not in DEFAULTS:
        raise InputError(f"classify: dtype {dtype!r}: expected fp32 / fp16 / bf16 / int8 / int16")
    return DEFAULTS[name]["max_nmse"]


def classify(reference, device, valid=None, dtype="float32", *, previous=None, floor: float | None = None,
             scale: float | None = None, alternatives: dict | None = None, separation: float | None = None,
             state: bool = False, ties: float = math.inf) -> Fault:
    """The fault model that explains `device` against `reference` (arrays of one shape; module docstring).

    valid: None, the bundle's boxes or a bool mask of the compared elements; dtype: the device dtype (fp32, fp16,
    bf16, int8, int16) whose precision floor decides (or `floor`, an NMSE); scale: an integer grid's step (default
    max |reference| / (2^(b-1) - 1)); previous: the reference's previous-step value of a carried state (stale state);
    state: the tensor is a carried state or cache (then all zeros is the initial state: stale, also without previous);
    alternatives: {"kind: what": the reference computed under a known wrong convention}; separation: how far above
    the floor the error must be for a fault to be named (default SEPARATION for a reduced-precision dtype, 1 for
    float32; the diff gives 1 under three-way judging, whose floor is the emulation's own error); ties: a model of as
    many parameters as the best is its rival (ambiguous) when its residual is within this factor of the best's
    (default: any that fits)."""
    r = np.asarray(reference)
    d = np.asarray(device)
    if r.ndim == 0 and d.ndim == 0:                                     # a scalar: a tensor of one element
        r, d = r.reshape(1), d.reshape(1)
        valid = valid.reshape(1) if isinstance(valid, np.ndarray) else valid
    if r.shape != d.shape:
        raise InputError(f"classify: reference shape {r.shape} != device shape {d.shape}")
    mask = valid if isinstance(valid, np.ndarray) else valid_mask(r.shape, valid)
    if mask.dtype != bool or mask.shape != r.shape:
        raise InputError(f"classify: valid mask of {mask.dtype} {mask.shape} for a tensor of shape {r.shape}")
    r, d = r.astype(np.float64), d.astype(np.float64)
    V = mask & np.isfinite(r)                                            # the compared region
    F = float(floor) if floor is not None else precision_floor(dtype, r[V], scale)
    bad = V & ~np.isfinite(d)
    if bad.any():
        return _nonfinite(r, d, V, bad, F)
    # scale-free sums: r / 2^e, d / 2^e (exact), so squares of masks near float max do not overflow
    peak = float(max(np.max(np.abs(r[V]), initial=0.0), np.max(np.abs(d[V]), initial=0.0)))
    e = 2.0 ** math.floor(math.log2(peak)) if peak > 0 else 1.0
    raw = np.where(np.isfinite(d), d, 0.0) / e          # the device everywhere (a shift reads past V's edge)
    r, d = np.where(V, r, 0.0) / e, np.where(V, d, 0.0) / e
    power = float(np.sum(r * r))
    before = _nmse(d, r, V, power)
    criterion = (f"residual NMSE after the fit <= the floor F = {F:.3g} ({_floor_words(dtype, floor)}) and, per "
                 f"degree of freedom, <= 1/{IMPROVEMENT:g} of the NMSE before; the fewest parameters among the models "
                 f"that fit")
    if before <= F:
        what = "bit-exact" if before == 0 else f"{_dtype_words(dtype)} rounding only"
        return Fault("precision", f"{what} (residual NMSE {before:.3g} <= floor {F:.3g})", {"dtype": str(dtype)},
                     before, before, F, criterion)
    prev = None
    if previous is not None:
        prev = np.asarray(previous, np.float64)
        if prev.shape != r.shape:
            raise InputError(f"classify: previous shape {prev.shape} != reference shape {r.shape}")
        prev = np.where(V, prev, 0.0) / e
    alts = {k: np.where(V, np.asarray(a, np.float64), 0.0) / e for k, a in (alternatives or {}).items()
            if np.shape(a) == r.shape}
    name = DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    S = separation if separation is not None else (1.0 if name == "float32" else SEPARATION)
    if before < S * F:
        return Fault("unexplained", f"residual NMSE {before:.3g} is within {S:g} x the {_dtype_words(dtype)} floor "
                     f"{F:.3g}: accumulated rounding or a small fault, not separable without the device's own "
                     f"precision emulated (three-way)", {"separation": S}, before, before, F, criterion)
    fits = list(_fits(r, d, raw, V, power, e, prev, alts, dtype, scale, F, state))
    n = int(V.sum())
    good = sorted((f for f in fits if f.after <= F and f.nparams < n and f.after * n / (n - f.nparams) * IMPROVEMENT
                   <= before),
                  key=lambda f: (f.nparams, f.after))
    listed = [f"{f.kind}: {f.summary} (NMSE {f.after:.3g}, {f.nparams} parameters)" for f in good[:6]]
    if not good:
        closest = min(fits, key=lambda f: f.after, default=None)
        hint = f"; closest: {closest.kind}, {closest.summary} (residual NMSE {closest.after:.3g})" if closest else ""
        return Fault("unexplained", f"no fault model brings the residual NMSE {before:.3g} to the floor {F:.3g}"
                     + hint, {"closest": closest.kind if closest else None}, before,
                     closest.after if closest else before, F, criterion)
    best = good[0]
    rivals = [f for f in good[1:] if f.nparams == best.nparams and f.kind != best.kind and f.after <= ties * best.after]
    if rivals:
        return Fault("unexplained", f"ambiguous: {best.kind} ({best.summary}) or {rivals[0].kind} "
                     f"({rivals[0].summary}) explain it equally", {"ambiguous": [best.kind, rivals[0].kind]},
                     before, best.after, F, criterion, listed)
    return Fault(best.kind, best.summary, best.params, before, best.after, F, criterion, listed[1:])


def _floor_words(dtype, floor) -> str:
    return "given" if floor is not None else f"precision floor of {dtype}"


def _dtype_words(dtype) -> str:
    name = DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(name, name)


def _nmse(x, r, V, power) -> float:
    """sum_V (x - r)^2 / sum_V r^2 (x, r zero outside V)."""
    err = float(np.sum(np.where(V, x - r, 0.0) ** 2))
    return err / power if power > 0 else (0.0 if err == 0 else math.inf)


def _nonfinite(r, d, V, bad, F) -> Fault:
    n_nan, n_inf = int(np.isnan(d[bad]).sum()), int(np.isinf(d[bad]).sum())
    first = [int(i) for i in np.unravel_index(int(np.flatnonzero(bad)[0]), r.shape)]
    big = np.abs(r[bad])
    parts = ([f"overflow to inf in {n_inf} elements"] if n_inf else []) + ([f"NaN in {n_nan}"] if n_nan else [])
    where = f" (first at {first}; |reference| there {np.min(big):.3g}..{np.max(big):.3g})"
    return Fault("non-finite", ", ".join(parts) + where, {"n_nan": n_nan, "n_inf": n_inf, "first": first,
                                                        "n_compared": int(V.sum())},
                 math.inf, math.inf, F, "an exact test: the device is NaN / Inf where the reference is finite")


def _fits(r, d, raw, V, power, e, prev, alts, dtype, scale, F, state):
    """Every fault model fitted: _Fit(kind, parameters, residual NMSE, fitted parameters, summary)."""
    n = int(V.sum())
    yield from _gains(r, d, V, power, n, F)
    yield from _offsets(r, d, V, power, n, e, F)
    yield from _saturation(r, d, V, power, e, dtype, scale)
    yield from _masked(r, d, V, power)
    if prev is not None or state:
        yield from _stale(r, d, V, power, prev)
    yield from _shifts(r, raw, V, power)
    yield from _halves(r, d, V, power)
    yield from _permutations(r, d, raw, V, power)
    yield from _layouts(r, raw, V, power)
    for key, a in alts.items():
        kind, _, what = key.partition(": ")
        yield _Fit(kind if kind in CLASSES else "unexplained", 0, _nmse(d, a, V, power), {"alternative": key},
                   what or key)


def _ranges(idx) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    idx, out = sorted(int(i) for i in idx), []
    for _, run in itertools.groupby(enumerate(idx), lambda p: p[1] - p[0]):
        run = [v for _, v in run]
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}")
    return ", ".join(out[:8]) + (", ..." if len(out) > 8 else "")


def _axes(r, n):
    """(axis, size) of the axes a per-slice model may use: 2+ slices, MIN_PER_GROUP compared elements each."""
    return [(a, s) for a, s in enumerate(r.shape) if s >= 2 and s * MIN_PER_GROUP <= n]


def _sum_but(x, a):
    return np.sum(x, axis=tuple(i for i in range(x.ndim) if i != a))


def _gains(r, d, V, power, n, F):
    rr = float(np.sum(r * r))
    values = np.unique(r[V][:4096])
    if values.size == 2 and values[0] < 0 and values[-1] == 0:
        return    # a mask (0 and a floor): a scaled floor is a floor (saturation / masked region), not a gain
    if rr > 0:
        c = float(np.sum(d * r)) / rr                                             # c = <d, r> / <r, r>
        after = _nmse(d, c * r, V, power)
        if abs(c) < 1e-3:
            pass                                   # a device of zeros is no gain (masked region / stale state)
        elif abs(c + 1) < 1e-3:
            yield _Fit("sign/swap", 1, after, {"factor": c}, "sign flipped (whole tensor x -1)", c * r)
        else:
            yield _Fit("gain", 1, after, {"factor": c}, f"scaled by {c:.5g} (whole tensor)", c * r)
    for a, s in _axes(r, n):
        rr_j, dr_j = _sum_but(r * r, a), _sum_but(d * r, a)
        c_j = np.where(rr_j > 0, dr_j / np.where(rr_j > 0, rr_j, 1), 1.0)          # c_j = <d_j, r_j> / <r_j, r_j>
        shape = [1] * r.ndim
        shape[a] = s
        model = c_j.reshape(shape) * r
        after = _nmse(d, model, V, power)
        res_j = _sum_but(np.where(V, d - model, 0.0) ** 2, a)
        n_j = np.maximum(_sum_but(V, a), 2)
        se = np.sqrt(res_j / (n_j - 1) / np.where(rr_j > 0, rr_j, np.inf))         # standard error of c_j
        # a slice moved: its factor 6 standard errors from 1, and its error above its share of the floor
        moved = np.flatnonzero((np.abs(c_j - 1) > 6 * se + 1e-7) & (rr_j > 0) & ((c_j - 1) ** 2 * rr_j > F * power / s))
        if not moved.size:
            continue
        f = c_j[moved]
        if np.all(np.abs(f + 1) < 1e-3):
            yield _Fit("sign/swap", s, after, {"axis": a, "slices": moved.tolist(), "factors": f.tolist()},
                       f"sign flipped on slices {_ranges(moved)} of axis {a}", model)
            continue
        same = np.max(np.abs(f - np.median(f))) <= 1e-3 * abs(np.median(f))
        what = (f"scaled by {np.median(f):.5g}" if same else
                "scaled by " + ", ".join(f"{v:.4g}" for v in f[:6]) + (" ..." if f.size > 6 else ""))
        yield _Fit("gain", s, after, {"axis": a, "slices": moved.tolist(), "factors": f.tolist(),
                                      **({"factor": float(np.median(f))} if same else {})},
                   f"slices {_ranges(moved)} of axis {a} {what}", model)


def _offsets(r, d, V, power, n, e, F):
    b = float(np.sum(d - r)) / n if n else 0.0                                  # b = mean_V (d - r)
    yield _Fit("offset", 1, _nmse(d, r + b * V, V, power), {"offset": b * e}, f"offset by {b * e:.4g} (whole tensor)",
               r + b)
    for a, s in _axes(r, n):
        n_j = np.maximum(_sum_but(V, a), 1)
        b_j = _sum_but(d - r, a) / n_j                                            # b_j = mean_{V_j} (d - r)
        shape = [1] * r.ndim
        shape[a] = s
        model = r + b_j.reshape(shape) * V
        after = _nmse(d, model, V, power)
        res = np.where(V, d - model, 0.0)
        sd = np.sqrt(_sum_but(res * res, a) / np.maximum(n_j - 1, 1))
        moved = np.flatnonzero((np.abs(b_j) > 6 * sd / np.sqrt(n_j) + 1e-12) & (b_j ** 2 * n_j > F * power / s))
        if moved.size:
            yield _Fit("offset", s, after, {"axis": a, "slices": moved.tolist(), "offsets": (e * b_j[moved]).tolist()},
                       f"slices {_ranges(moved)} of axis {a} offset by "
                       + ", ".join(f"{e * v:.3g}" for v in b_j[moved][:4]) + (" ..." if moved.size > 4 else ""), model)


def _saturation(r, d, V, power, e, dtype, scale):
    lo, hi = float(np.min(d[V])), float(np.max(d[V]))
    low, high = V & (r < lo), V & (r > hi)
    if not (low.any() or high.any()):
        return
    model = np.clip(r, lo, hi)
    after = _nmse(d, model, V, power)
    limits = {"float16 max": FLOAT_MAX["float16"], "bfloat16 max": FLOAT_MAX["bfloat16"]}
    name = DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if name in INT_BITS and scale is not None:
        limits["the encoding's max"] = float(scale) * (2 ** (INT_BITS[name] - 1) - 1)
    sides = []
    for side, v, hit in (("lo", lo, low), ("hi", hi, high)):
        if hit.any():
            known = next((f" = -{k}" if v < 0 else f" = {k}" for k, m in limits.items()
                          if abs(abs(v * e) - m) <= 1e-3 * m), "")
            sides.append(f"{v * e:.6g}{known} ({int(hit.sum())} elements)")
    params = {"lo": lo * e if low.any() else None, "hi": hi * e if high.any() else None,
              "n_clipped": int(low.sum() + high.sum())}
    # a mask's floor raised: every element clipped from below is at the reference's most negative value
    floor_mask = low.any() and not high.any() and np.ptp(r[low]) <= 1e-6 * abs(np.min(r[low])) and lo * e < -1
    if floor_mask:
        leak = math.exp(lo * e) if lo * e > -745 else 0.0
        yield _Fit("masked region", 2, after, {**params, "reference_floor": float(np.min(r[low]) * e)},
                   f"mask floor {lo * e:.6g} where the reference masks with {np.min(r[low]) * e:.6g} "
                   f"({int(low.sum())} masked entries leak weight exp({lo * e:.4g}) = {leak:.3g})", model)
    else:
        yield _Fit("saturation", 2, after, params, "clipped at " + " and ".join(sides), model)


def _masked(r, d, V, power):
    zeroed = V & (d == 0) & (r != 0)                     # zero where the reference is not
    opened = V & (d != 0) & (r == 0)                     # values where the reference is exactly 0
    for hit, could, what in ((zeroed, V & (r != 0), "zero where the reference is not"),
                             (opened, V & (r == 0), "nonzero where the reference is 0")):
        if not hit.any():
            continue
        slices = None
        for a in range(r.ndim):        # whole slices of an axis (rows, heads, slots)?
            h, c = _sum_but(hit, a), _sum_but(could, a)
            if r.shape[a] > 1 and np.all((h == 0) | (h == c)) and 0 < np.count_nonzero(h) < np.count_nonzero(c):
                slices = (a, np.flatnonzero(h))
                break
        where = f" (slices {_ranges(slices[1])} of axis {slices[0]})" if slices else ""
        model = np.where(hit, d, r)
        yield _Fit("masked region", 1, _nmse(d, model, V, power),
                   {"n": int(hit.sum()), "what": what, **({"axis": slices[0], "slices": slices[1].tolist()}
                                                          if slices else {})},
                   f"{what} in {int(hit.sum())} elements{where}", model)


def _stale(r, d, V, power, prev):
    if not np.any(d[V]):
        yield _Fit("stale state", 0, _nmse(d, np.zeros_like(r), V, power), {"equals": "the initial (zero) state"},
                   "the initial zero state, not the one carried from the previous step (state not carried)",
                   np.zeros_like(r))
    if prev is not None:
        yield _Fit("stale state", 0, _nmse(d, prev, V, power), {"equals": "the previous step's value"},
                   "equals the reference's previous-step value (state not updated)", prev)


def _shifts(r, d, V, power):
    """d at i holds r at i + s along one axis (s = +-1, +-2), compared where the reference element is in V; the
    slots it vacates hold zeros (compared where V)."""
    for a, S in enumerate(r.shape):
        if S < 3:
            continue
        for s in (1, -1, 2, -2):
            lo, hi = (range(0, S - s), range(s, S)) if s > 0 else (range(-s, S), range(0, S + s))
            dd, rr, mm = np.take(d, lo, axis=a), np.take(r, hi, axis=a), np.take(V, hi, axis=a)
            p = float(np.sum(rr * rr))
            if mm.sum() * 2 < V.sum() or p < 0.25 * power:
                continue
            gone = range(S - s, S) if s > 0 else range(0, -s)          # the device's vacated slots: zeros
            vac = np.take(d, gone, axis=a)[np.take(V, gone, axis=a)]
            after = _nmse(dd, rr, mm, p) + float(np.sum(vac * vac)) / p
            toward = "lower" if s > 0 else "higher"
            yield _Fit("shift", 1, after, {"axis": a, "by": s},
                       f"shifted by {abs(s)} toward {toward} indices along axis {a} (device[i] = reference[i{s:+d}])")


def _halves(r, d, V, power):
    for a, S in enumerate(r.shape):
        if S < 2 or S % 2:
            continue
        r1, r2 = np.split(r, 2, axis=a)
        for model, signs, what in ((np.concatenate([r2, r1], a), [1, 1], "halves of axis {a} swapped"),
                                   (np.concatenate([-r2, r1], a), [-1, 1],
                                    "halves of axis {a} swapped, the first negated (rotate_half)"),
                                   (np.concatenate([r2, -r1], a), [1, -1],
                                    "halves of axis {a} swapped, the second negated (-rotate_half)"),
                                   (np.concatenate([r1, -r2], a), None, "second half of axis {a} negated")):
            yield _Fit("sign/swap", 0, _nmse(d, model, V, power), {"axis": a, "swapped": signs is not None,
                                                                   "signs": signs or [1, -1]},
                       what.format(a=a), model)


def _permutations(r, d, raw, V, power):
    """The slices of an axis permuted: each device slice matched to its nearest reference slice through a random
    projection of the slices over V (then verified on the whole tensor, the device read where the permuted
    reference is compared)."""
    rng = np.random.default_rng(0)
    for a, S in enumerate(r.shape):
        if S < 2 or S > MAX_PERMUTED:
            continue
        rs, ds = np.moveaxis(r, a, 0).reshape(S, -1), np.moveaxis(d, a, 0).reshape(S, -1)
        P = rng.standard_normal((rs.shape[1], min(16, rs.shape[1])))
        sr, sd = rs @ P, ds @ P                                                        # [S, 16] signatures
        dist = np.sum(sd * sd, 1)[:, None] + np.sum(sr * sr, 1)[None] - 2 * sd @ sr.T
        perm = np.argmin(dist, axis=1)                                                 # device slice i = ref perm[i]
        if len(set(perm.tolist())) != S or np.array_equal(perm, np.arange(S)):
            continue
        if S % 2 == 0 and np.array_equal(perm, np.roll(np.arange(S), S // 2)):
            continue                                                                   # halves swapped: _halves
        model = np.take(r, perm, axis=a)
        after = _nmse(raw, model, np.take(V, perm, axis=a), power)
        roll = next((s for s in range(1, S) if np.array_equal(perm, (np.arange(S) + s) % S)), None)
        if roll is not None:
            yield _Fit("shift", 1, after, {"axis": a, "by": roll if roll <= S // 2 else roll - S, "roll": True},
                       f"rolled by {roll if roll <= S // 2 else roll - S} along axis {a} (device[i] = "
                       f"reference[(i{roll if roll <= S // 2 else roll - S:+d}) mod {S}])", model)
            continue
        cycles = _cycles(perm)
        what = "; ".join(" and ".join(map(str, c)) + " swapped" if len(c) == 2 else "->".join(map(str, c))
                         + " cycled" for c in cycles[:4]) + ("; ..." if len(cycles) > 4 else "")
        yield _Fit("permutation", 1, after, {"axis": a, "perm": perm.tolist(), "cycles": cycles},
                   f"slices of axis {a} permuted: {what}", model)


def _cycles(perm) -> list:
    seen, out = set(), []
    for i in range(len(perm)):
        if i in seen or perm[i] == i:
            continue
        c, j = [], i
        while j not in seen:
            seen.add(j)
            c.append(int(j))
            j = int(perm[j])
        out.append(c)
    return out


def _layouts(r, d, V, power):
    """The reference in another axis order: transposed in shape (a square pair of axes), or its bytes laid into the
    reference's shape (a cache written [T, D] into a [D, T] buffer)."""
    if r.size > MAX_LAYOUT_ELEMENTS or r.ndim < 2:
        return
    dims = [a for a in range(r.ndim) if r.shape[a] > 1]
    if len(dims) > 4:
        return
    for order in itertools.permutations(dims):
        if list(order) == dims:
            continue
        p = list(range(r.ndim))
        for a, b in zip(dims, order):
            p[a] = b
        t, vt = r.transpose(p), V.transpose(p)
        for how, model, mask in (("transposed", t, vt), ("bytes", t.reshape(r.shape), vt.reshape(r.shape))):
            if model.shape != r.shape:
                continue
            words = ("the reference transposed to axes {p}" if how == "transposed" else
                     "the reference transposed to axes {p}, its bytes read in the reference's shape (a layout "
                     "mix-up: e.g. a K cache written untransposed)").format(p=tuple(p))
            yield _Fit("permutation", 1, _nmse(d, model, mask, power), {"layout": how, "axes": p}, words, model)


# ------------------------------------------------------------------------------------------------ in the diff

def judged_floor(metrics: dict | None, criteria: dict) -> float | None:
    """The NMSE floor of a tensor the diff judged: its max_nmse bar, on the step's own power (the diff divides the
    error by max(the step's golden power, the run's): policy.judged_nmse)."""
    bar = criteria.get("max_nmse")
    if bar is None:
        return None
    m = metrics or {}
    power, run = m.get("golden_power"), m.get("run_power")
    if criteria.get("run_power") and power and run and run > power and math.isfinite(run):
        return bar * run / power
    return bar


def divergence_arrays(bundle, dump, r, kernel=None):
    """(golden, device in the reading the diff judged, previous step's golden or None) of result `r`, or None
    when the dump's tensor is unreadable or integer. A tensor that passes only in another layout is given in the
    dump's own reading (its layout is the fault)."""
    item = dump.items.get(r.key)
    if item is None or item.problem or item.array is None or r.metrics is None or r.metrics.get("integer"):
        return None
    rec = bundle.manifest["tensors"][r.key]
    found = dict(candidates(item, rec, None if r.status == "layout" else r.layout, kernel))
    device = next(iter(found.values()), None) if r.status == "layout" else found.get(r.layout)
    if device is None:
        return None
    golden = bundle.tensor(r.step, r.role, r.name)
    previous = None
    if r.step > 0 and f"{r.step - 1}/{r.role}/{r.name}" in bundle.manifest["tensors"]:
        previous = bundle.tensor(r.step - 1, r.role, r.name)
        previous = previous if previous.shape == golden.shape else None
    return golden, device, previous


def rope_alternatives(x, y, rot: int) -> dict:
    """What a wrong RoPE convention would have made of RoPE's input x [..., T, H, D] given its half-split output y
    (the golden): the cos / sin of each (token, pair) solved from x and y (least squares over the heads:
    [y_i, y_(i+h)] = [[x_i, -x_(i+h)], [x_(i+h), x_i]] [c, s], h = rot / 2), then applied over interleaved pairs
    (2i, 2i+1) (Meta / GPT-J), and half-split with the sine's sign flipped (rotate_half negated)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    h = rot // 2
    a, b, ya, yb = x[..., :h], x[..., h:rot], y[..., :h], y[..., h:rot]                     # [..., T, H, h]
    norm = np.maximum(np.sum(a * a + b * b, axis=-2, keepdims=True), 1e-300)
    c = np.sum(a * ya + b * yb, axis=-2, keepdims=True) / norm                             # cos, [..., T, 1, h]
    s = np.sum(a * yb - b * ya, axis=-2, keepdims=True) / norm                             # sin
    inter = x.copy()
    even, odd = x[..., 0:rot:2], x[..., 1:rot:2]
    inter[..., 0:rot:2], inter[..., 1:rot:2] = even * c - odd * s, odd * c + even * s      # pairs (2i, 2i+1)
    flipped = x.copy()
    flipped[..., :h], flipped[..., h:rot] = a * c + b * s, b * c - a * s                     # x c - rotate_half(x) s
    return {"permutation: RoPE over interleaved pairs (2i, 2i+1) instead of half-split (i, i + rot/2)": inter,
            "sign/swap: RoPE with the sine's sign flipped (rotate_half negated)": flipped}


def _alternatives(bundle, r, golden, cfg) -> dict | None:
    """Known wrong conventions of the op that made `r` (RoPE: from the golden's input tap), or None."""
    if cfg is None or r.role != "tap" or not r.name.endswith(("self_attn.q_rope", "self_attn.k_rope")):
        return None
    key = f"{r.step}/tap/{r.name[:-4]}norm"
    if key not in bundle.manifest["tensors"]:
        return None
    x = bundle.tensor(r.step, "tap", r.name[:-4] + "norm")
    return rope_alternatives(x, golden, cfg.rotary_dim) if x.shape == golden.shape else None


SHIFT_CRITERION = ("code_shift (policy.CODE_SHIFT): most of the device's integer codes are the quantised golden's "
                   "shifted by one constant, an exact test on the codes")


def offset_fault(metrics: dict | None, criteria: dict) -> Fault | None:
    """The fault of a tensor the code_shift criterion fails (policy.shifted_codes: its metrics' code shift), an
    offset of c codes: its zero point run as another and every value moved by c steps; None when it does not."""
    shift = shifted_codes(metrics, criteria)
    if shift is None:
        return None
    codes, zero_point, step = shift["codes"], shift.get("zero_point"), shift.get("scale")
    what = "" if zero_point is None else f" (zero point {zero_point} run as {zero_point + codes})"
    value = "" if step is None else f": every value {codes * step:+.4g}"
    return Fault("offset", f"codes offset by {codes:+d}{what}{value}",
                 {"codes": codes, "share": shift["share"], **({} if step is None else {"offset": codes * step})},
                 0.0, 0.0, 0.0, SHIFT_CRITERION)


def classify_divergences(report, bundle, dump, policy) -> None:
    """Set `fault` (Fault.to_dict()) on each first divergence of `report` (refimpl.diff.compare's last step): an
    offset where the code_shift criterion fails it (offset_fault: the codes say so exactly), else the fault model
    classify fits."""
    cfg = model_config((bundle.manifest.get("model") or {}).get("config"))
    kernel = conv_kernel(cfg)
    by_key = {r.key: r for r in report.results}
    for key in {k for k in report.first_divergence.values() if k}:
        r = by_key[key]
        criteria = policy.criteria(r.name, bool((r.metrics or {}).get("integer")), r.reference)
        shifted = offset_fault(r.metrics, criteria)
        if shifted is not None:
            r.fault = shifted.to_dict()
            continue
        arrays = divergence_arrays(bundle, dump, r, kernel)
        if arrays is None:
            continue
        golden, device, previous = arrays
        rec = bundle.manifest["tensors"][key]
        channel = _failed_channel(r)
        if channel is not None:   # only one channel fails (the tensor passes its bar): that channel's fault
            floor, valid, axes = judged_floor(r.metrics, criteria), valid_mask(golden.shape, rec["valid"]), \
                sample_axes(rec)
            if floor is not None and "off the emulation" in r.failures[0]:   # the gain test's: on its weighting,
                golden, device, nmse = whitened(golden, device, valid, axes)  # against its channel's noise
                floor = gain_floor(r.metrics["channels"], floor, nmse)
            r.fault = classify_channel(golden, device, valid, axes, channel, policy.dtype, floor,
                                       1.0 if r.reference else None).to_dict()
            continue
        r.fault = classify(golden, device, rec["valid"], policy.dtype, previous=previous,
                           floor=judged_floor(r.metrics, criteria), separation=1.0 if r.reference else None,
                           state=r.role != "tap" and r.name != "logits" and bool(STATE_NAME.search(r.name)),
                           alternatives=_alternatives(bundle, r, golden, cfg)).to_dict()


def _failed_channel(r) -> list | None:
    """The channel index of a tensor whose only failure is one channel's (refimpl.diff.channels: the nmse test's
    worst channel, or the gain test's), else None."""
    ch = (r.metrics or {}).get("channels") or {}
    if len(r.failures) != 1 or not r.failures[0].startswith("channel "):
        return None
    return ch.get("gain_worst") if "off the emulation" in r.failures[0] else ch.get("worst")


def classify_channel(golden, device, mask, axes: tuple, channel: list, dtype, floor: float | None,
                     separation: float | None) -> Fault:
    """The fault of one channel of a tensor (an index over its feature axes; axes: the batch and token axes), the
    channel classified alone against the tensor's floor on the channel's scale (floor x max(P, its power) / its
    power, P the tensor's mean g^2, as the channel test judges it); a gain found there is that channel's gain."""
    g, d, m = (np.asarray(x) for x in (golden, device, mask))
    feature = [a for a in range(g.ndim) if a not in axes]
    index = tuple(slice(None) if a not in feature else channel[feature.index(a)] for a in range(g.ndim))
    gc, dc, mc = (x[index].astype(np.float64) if x.dtype != bool else x[index] for x in (g, d, m))
    ok = mc & np.isfinite(gc)
    power_c = float(np.mean(gc[ok] ** 2)) if ok.any() else 0.0
    P = float(np.mean(g[m & np.isfinite(g)].astype(np.float64) ** 2)) if m.any() else 0.0
    F = None if floor is None or not power_c > 0 else floor * max(P, power_c) / power_c
    f = classify(gc, dc, mc, dtype, floor=F, separation=separation, ties=IMPROVEMENT)   # a channel's few samples
    where = f"channel {list(channel)}"
    if f.kind == "gain" and "axis" not in f.params:
        return Fault("gain", f"{where} scaled x{f.params['factor']:.4g}",
                     {"axis": feature[-1] if len(feature) == 1 else feature, "slices": list(channel),
                      "factors": [f.params["factor"]]}, f.residual_before, f.residual_after, f.floor, f.criterion,
                     f.candidates)
    return Fault(f.kind, f"{where}: {f.summary}", {**f.params, "channel": list(channel)}, f.residual_before,
                 f.residual_after, f.floor, f.criterion, f.candidates)
