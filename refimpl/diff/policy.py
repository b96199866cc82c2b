"""How the diff judges a tensor: a Policy (default bars by the device's compute dtype; spec device_conventions.md
§9), and judge(), the criteria a tensor's metrics fail.

    policy = load_policy("policy.json", dtype="fp16")      # or make_policy({...}), Policy()
    criteria = policy.criteria("model.layers.3.mlp.down_proj", integer=False)
    failures = judge(metrics, logits, criteria)            # empty: the tensor passes

Float tensors pass when  nmse <= max_nmse  or  max_abs <= atol  (a floor for tensors that are ~0), with no
NaN / Inf where the golden is finite; integer tensors (ids, chosen experts) must be equal. For the default
bars the nmse judged is the step's error power over the larger of the step's golden power and the tensor's
golden power over the whole run (`judged_nmse`): a decode step's few elements can sit near 0 by chance (a
one-element gate logit at a cancelling sum), and an honest device's inherited error is relative to the op's
usual scale, not to that value. A fault's error is unchanged, so it is judged against the same bar.
    dtype      max_nmse   (SQNR)    atol
    float32    1e-8       80 dB     1e-6    honest independent float32 runtimes: >= 87.3 dB judged (calibrate.py);
                                            one fp16 rounding of one tensor is ~74 dB
    float16    1e-5       50 dB     1e-3
    bfloat16   1e-4       40 dB     1e-2
A policy file overrides any of these per tensor (regex) with max_<metric> / min_<metric> criteria over the
metrics of refimpl.diff.metrics; three-way judging replaces max_nmse by k^2 times the error an emulated-
precision run of the reference shows on the same tensor, at least k^2 times one rounding to the device dtype
(error within k x the emulation's, in RMS), and lets an integer tensor equal the golden or the emulation.
Three-way judging also applies the code_shift criterion (CODE_SHIFT): a quantised tap dumped as integer codes
fails when more than max_share of its codes (of min_codes or more) are the quantised golden's shifted by one
constant c != 0 (metrics["code_shift"], refimpl.diff.metrics.code_shift): a zero point that is not the encoding's.
A policy rule switches it off ("code_shift": false) or sets its parameters ({"max_share": .., "min_codes": ..}).
"""

import dataclasses
import math
import re

from ..errors import InputError, brief
from ..files import expect
from ..metrics import DTYPE_ALIASES
from . import hooks
from .channels import GAIN_CONTRAST, channel_bar, gain_failure, judged_channel_nmse
from .dump import read_json
from .layouts import ADAPTERS

DEFAULTS = {
    "float32": {"max_nmse": 1e-8, "atol": 1e-6},   # calibrated on independent runtimes: docs/diff.md
    "float16": {"max_nmse": 1e-5, "atol": 1e-3},
    "bfloat16": {"max_nmse": 1e-4, "atol": 1e-2},
}
# the least NMSE three-way judging expects of a device: one round-to-nearest of a tensor to its dtype, relative error
# uniform within the unit roundoff u (NMSE u^2 / 3; fp16 u = 2^-11, bf16 2^-8). A small tensor (a 4-element gate
# projection at decode) can show an emulated error far below it by luck; k^2 x that would demand luck of the device.
ROUNDING_NMSE = {"float32": DEFAULTS["float32"]["max_nmse"], "float16": 2.0 ** -22 / 3, "bfloat16": 2.0 ** -16 / 3}
METRIC_NAMES = {"n_nan", "n_inf", "max_abs", "max_rel", "max_rel_polygraphy", "rel_p99", "mse", "cosine", "sqnr_db",
                "sqnr_qairt_db", "nmse", "psnr_db", "std_ratio", "not_close", "not_close_frac", "matched_ratio",
                "ulp_max", "ulp_mean", "top1_agreement", "top1_flips", "topk_overlap_mean", "kl_over_lnv_mean",
                "kl_over_lnv_max", "kl_over_lnv_p99", "kl_over_lnv_last", "dp_top_mean", "dp_top_max"}
# the code_shift criterion's parameters (on by default under three-way judging): a one-step offset moves a 16-bit tensor
# by one step, well under the excess bar wherever quantisation's own error exceeds 100 steps RMS, yet no honest run
# shifts most of its codes alike (the CPU EP's are identical, QuantSim's 75-100 % identical, an HTP's spread over tens
# of codes either way: docs/diff.md); min_codes: a MoE's 16 routing weights of an honest run had 5 flipped alike
CODE_SHIFT = {"max_share": 0.5, "min_codes": 64}


@dataclasses.dataclass
class Policy:
    """How tensors are judged. rules: [(regex over the tensor name, {criterion: value})], later rules win
    key by key; layouts: [(regex, adapter)] declared dump layouts; ignore: regexes of tensors not scored;
    three_way_k: k of three-way judging."""
    dtype: str = "float32"
    rules: list = dataclasses.field(default_factory=list)
    layouts: list = dataclasses.field(default_factory=list)
    ignore: list = dataclasses.field(default_factory=list)
    three_way_k: float = 4.0

    def criteria(self, name: str, integer: bool, reference: dict | None = None) -> dict:
        """The criteria for tensor `name`. reference: the emulated run's metrics on it (three-way judging):
        max_nmse becomes k^2 x its NMSE, at least k^2 x one rounding to the device dtype (ROUNDING_NMSE), unless
        a policy rule sets max_nmse itself, and the code_shift criterion (CODE_SHIFT) is on; an integer tensor passes
        where it equals the golden or the emulation."""
        c = {"exact": True} if integer else {**DEFAULTS[self.dtype], "run_power": True, "channels": True}
        c.update({"max_n_nan": 0, "max_n_inf": 0})
        if reference is not None and not integer:
            c["max_nmse"] = (self.three_way_k ** 2 * max(reference["nmse"], ROUNDING_NMSE[self.dtype])
                             * small_sample(reference.get("n_compared", reference.get("n", 0))))
            c.pop("run_power")   # the emulation's nmse is per step: so is the device's
            c["code_shift"] = dict(CODE_SHIFT)   # judged where the metrics carry a code shift (an integer dump)
        if reference is not None and integer and reference.get("equals_golden_or_emulation"):
            del c["exact"]
        for pattern, rule in self.rules:
            if re.search(pattern, name):
                c.update(rule)
                if "max_nmse" in rule:
                    c.pop("run_power", None)   # a bar a policy sets is on the step's nmse, as written
        return c

    def layout(self, name: str) -> str | None:
        for pattern, adapter in self.layouts:
            if re.search(pattern, name):
                return adapter
        return None

    def ignored(self, name: str) -> bool:
        return any(re.search(p, name) for p in self.ignore)

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "tensors": [{"match": p, **r} for p, r in self.rules],
                "layouts": {p: a for p, a in self.layouts}, "ignore": self.ignore, "three_way_k": self.three_way_k}


def small_sample(n: int, z: float = 3.09) -> float:
    """How far the NMSE of one honest run may exceed another's on n elements by chance: the 99.9th percentile of
    the ratio of two chi-square(n) / n errors (an F(n, n) quantile), from log F ~ normal with variance 2 psi'(n/2).
    1.2 at n = 1000, 2.2 at 64, 7.8 at 10, 270 at 2: a 2-element routing weight carries little evidence."""
    if n <= 0:
        return 1.0
    x, trigamma = n / 2, 0.0
    while x < 6:  # psi'(x) = psi'(x + 1) + 1 / x^2, then the asymptotic series
        trigamma, x = trigamma + 1 / x ** 2, x + 1
    trigamma += 1 / x + 1 / (2 * x ** 2) + 1 / (6 * x ** 3) - 1 / (30 * x ** 5) + 1 / (42 * x ** 7) - 1 / (30 * x ** 9)
    return math.exp(z * math.sqrt(2 * trigamma))


def make_policy(spec: dict | None = None, dtype: str | None = None, where: str = "policy") -> Policy:
    """A Policy from a JSON-style dict:
        {"dtype": "float16", "three_way_k": 4,
         "tensors": [{"match": "mlp\\\\.down_proj$", "max_nmse": 1e-4, "min_cosine": 0.999},
                     {"match": "residual$", "code_shift": false}, ...],
         "layouts": {"past_key_.*_out": "transposed"}, "ignore": ["attn_scores$"]}"""
    spec = dict(spec or {})
    ignore = spec.get("ignore", [])
    if not isinstance(spec.get("tensors", []), list) or not isinstance(spec.get("layouts", {}), dict) \
            or not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise InputError(f"{where}: 'tensors' must be a list, 'layouts' an object {{regex: adapter}}, 'ignore' a "
                         f"list of regexes")
    three_way_k = spec.get("three_way_k", 4.0)
    if isinstance(three_way_k, bool) or not isinstance(three_way_k, (int, float)) or not three_way_k > 0:
        raise InputError(f"{where}: three_way_k must be a positive number, got {brief(three_way_k)}")
    unknown = set(spec) - {"dtype", "tensors", "layouts", "ignore", "three_way_k"}
    if unknown:
        raise InputError(f"{where}: unknown key(s) {brief(sorted(unknown))}; expected dtype, tensors, layouts, ignore, "
                         f"three_way_k")
    given = dtype or spec.get("dtype", "float32")
    d = DTYPE_ALIASES.get(given, given) if isinstance(given, str) else given
    if not isinstance(d, str) or d not in DEFAULTS:
        raise InputError(f"{where}: dtype {brief(given)} is not one of {', '.join(DEFAULTS)} (or fp32 / fp16 / bf16)")
    rules = []
    for i, r in enumerate(spec.get("tensors", [])):
        if not isinstance(r, dict) or not isinstance(r.get("match"), str):
            raise InputError(f"{where}: tensors[{i}] must be an object with a 'match' regex")
        crit = {k: v for k, v in r.items() if k != "match"}
        for k, v in crit.items():
            named = re.fullmatch(r"(max|min)_\w+", k) and k[4:] in METRIC_NAMES
            if not (k in ("exact", "atol", "channels", "code_shift") or named):
                raise InputError(f"{where}: tensors[{i}]: criterion {brief(k)} is not max_<metric> / min_<metric> of a "
                                 f"known metric ({', '.join(sorted(METRIC_NAMES))}), atol, exact, channels or "
                                 f"code_shift")
            if k == "code_shift":
                crit[k] = code_shift_criterion(v, f"{where}: tensors[{i}].code_shift")
            elif k in ("exact", "channels"):
                expect(v, bool, f"{where}: tensors[{i}].{k}", InputError)
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                raise InputError(f"{where}: tensors[{i}]: {k} must be a number, got {brief(v)}")
        rules.append((_regex(r["match"], where), crit))
    layouts = [(_regex(p, where), a) for p, a in spec.get("layouts", {}).items()]
    for _, a in layouts:
        if not isinstance(a, str) or (a not in ADAPTERS and a != hooks.DECLARED):
            raise InputError(f"{where}: layout {brief(a)} is not one of {', '.join([*ADAPTERS, hooks.DECLARED])}")
    return Policy(d, rules, layouts, [_regex(p, where) for p in spec.get("ignore", [])], float(three_way_k))


def code_shift_criterion(v, where: str):
    """A policy's code_shift: false (off), true (CODE_SHIFT) or {"max_share": 0 <= s < 1, "min_codes": n >= 1}
    (either omitted: CODE_SHIFT's)."""
    if isinstance(v, bool):
        return dict(CODE_SHIFT) if v else False
    expect(v, dict, where, InputError)
    if set(v) - set(CODE_SHIFT):
        raise InputError(f"{where}: unknown key(s) {brief(sorted(v, key=str))}; expected {', '.join(CODE_SHIFT)}")
    out = {**CODE_SHIFT, **v}
    share, least = out["max_share"], out["min_codes"]
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
        raise InputError(f"{where}: max_share must be a number in [0, 1), got {brief(share)}")
    if isinstance(least, bool) or not isinstance(least, int) or least < 1:
        raise InputError(f"{where}: min_codes must be a positive integer, got {brief(least)}")
    return out


def shifted_codes(metrics: dict | None, criteria: dict) -> dict | None:
    """The tensor's code shift (metrics["code_shift"]: {"codes": c, "share": s, "n": n, ...}) when the code_shift
    criterion fails it: c != 0 at more than max_share of n >= min_codes codes; else None."""
    crit, shift = criteria.get("code_shift"), (metrics or {}).get("code_shift")
    if not crit or shift is None:
        return None
    crit = crit if isinstance(crit, dict) else CODE_SHIFT
    ok = shift["codes"] == 0 or shift["n"] < crit["min_codes"] or not shift["share"] > crit["max_share"]
    return None if ok else shift


def _regex(p, where):
    try:
        re.compile(p)
    except (re.error, TypeError, RecursionError, OverflowError) as e:
        raise InputError(f"{where}: bad regex {brief(p)} ({brief(str(e), 120)})") from None
    return p


def load_policy(path=None, dtype: str | None = None) -> Policy:
    if path is None:
        return make_policy(None, dtype)
    spec = read_json(path, "policy")
    if not isinstance(spec, dict):
        raise InputError(f"{path}: policy must be a JSON object")
    return make_policy(spec, dtype, str(path))


def judged_nmse(metrics: dict) -> float:
    """The step's error power over max(the step's golden power, the tensor's golden power over the run)."""
    power, run, mse = metrics.get("golden_power"), metrics.get("run_power"), metrics.get("mse")
    if not power or not run or not run > power or mse is None or not math.isfinite(mse):
        return metrics.get("nmse")   # a saved metrics file may lack them
    return mse / run


def bar(criteria: dict, metrics: dict | None) -> dict:
    """The bar a tensor was judged by, for the record (diff --json): its criteria (max_nmse: the default's, a
    policy's or three-way's k^2 x the emulation's), and its worst channel's bar (channel_max_nmse) where judged."""
    out = dict(criteria)
    ch = (metrics or {}).get("channels")
    if criteria.get("channels") and ch and criteria.get("max_nmse") is not None:
        out["channel_max_nmse"] = channel_bar(ch, criteria["max_nmse"])
        if "gain_q" in ch:   # the gain test's bar on z^2 (channels.py)
            out["channel_max_gain_z2"] = GAIN_CONTRAST * ch["gain_q"]
    return out


def judge(metrics: dict | None, logits: dict | None, criteria: dict, reference: dict | None = None) -> list[str]:
    """The criteria a tensor fails (empty: it passes). metrics / logits: refimpl.diff.metrics dicts; reference: the
    emulated run's metrics (three-way), for the excess a code shift's failure quotes."""
    if metrics is None:
        return ["not compared"]
    if metrics["n"] == 0:  # nothing valid to score (e.g. an empty cache window)
        return []
    values = {**metrics, **(logits or {})}
    if criteria.get("run_power"):
        values["nmse"] = judged_nmse(metrics)
    failed = []
    if criteria.get("exact"):
        if not metrics["max_abs"] == 0 or metrics["n_nan"] or metrics["n_inf"]:
            failed.append(f"exact: values differ (max abs {metrics['max_abs']:.3g})")
        return failed
    floor = criteria.get("atol")  # a golden that is itself ~0 (within atol) passes when the device is within atol
    within_floor = (floor is not None and metrics["max_abs"] <= floor
                    and metrics.get("golden_max_abs", math.inf) <= floor
                    and not metrics["n_nan"] and not metrics["n_inf"])
    for key, limit in criteria.items():
        if key in ("exact", "atol", "run_power", "channels", "code_shift"):
            continue
        kind, metric = key.split("_", 1)
        value = values.get(metric)
        if value is None:
            continue  # e.g. a logits criterion on a tensor that is not logits
        ok = (value <= limit) if kind == "max" else (value >= limit)
        if isinstance(value, float) and math.isnan(value):
            ok = False
        if not ok and not (within_floor and metric not in ("n_nan", "n_inf")):
            failed.append(f"{metric} {value:.3g} {'>' if kind == 'max' else '<'} {limit:g}")
    ch = metrics.get("channels")
    if criteria.get("channels") and ch and criteria.get("max_nmse") is not None and not within_floor:
        reference_power = metrics.get("run_power") if criteria.get("run_power") else None
        value, limit = judged_channel_nmse(ch, reference_power), channel_bar(ch, criteria["max_nmse"])
        gain = gain_failure(ch, criteria["max_nmse"], reference_power)
        if not value <= limit:   # the worst channel stands out of the rest and fails the tensor's bar (channels.py)
            failed.append(f"channel {ch['worst']} of {ch['count']}: nmse {value:.3g} > {limit:.3g} "
                          f"(gain {100 * ch['gain']:+.2f} %)")
        elif gain is not None:   # the gain test (channels.py): one channel scaled, beyond the other channels' noise
            failed.append(gain)
    shift = shifted_codes(metrics, criteria)
    if shift is not None:   # a zero point that is not the encoding's, whatever the excess (CODE_SHIFT)
        within = "" if failed else f" (excess {_excess(metrics, reference)} alone is within the bar)"
        failed.append(f"codes shifted by {shift['codes']:+d} at {100 * shift['share']:.1f} % of elements: the device's "
                      f"zero point is not its encoding's{within}")
    return failed


def _excess(metrics: dict, reference: dict | None) -> str:
    """RMS(D - Q) / RMS(Q - F) of three-way judging, as the report prints it ("n/a" without a reference)."""
    mine, ref = metrics.get("nmse"), (reference or {}).get("nmse")
    if mine is None or ref is None:
        return "n/a"
    return f"{math.sqrt(mine / ref) if ref > 0 else (0.0 if mine == 0 else math.inf):.3g}"
