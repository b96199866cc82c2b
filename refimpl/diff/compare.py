"""Compare a device dump with a golden bundle: metrics per tensor, judging, first divergence, error curves.

    report = compare(read_bundle(b), read_dump(d, bundle), load_policy(None))
    report.first_divergence[k]            # step k's first tensor that fails while everything it reads passes
    report.results                        # every compared tensor in execution order, with metrics and status
    save_metrics(report, "diff.json"); rejudge(load_metrics("diff.json"), new_policy)

Judging (a policy, default by the device's compute dtype; spec device_conventions.md §9):
  float tensors pass when  nmse <= max_nmse  or  max_abs <= atol  (a floor for tensors that are ~0), with no
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

Status of a tensor: pass | fail | layout (matches the golden only when read in another layout, e.g. an
untransposed key cache) | error (unreadable, truncated, wrong shape) | missing (a graph output not dumped) |
diverged (three-way: downstream of an exact tie the device broke the other way; not judged).
A failing tensor whose inputs all pass *adds* error; one with a failing input *inherits* it. The first
divergence of a step is its first adding failure in execution order (coremltools' rule, over the layer DAG
of refimpl.diff.dataflow); graph inputs of a later step read the previous step's outputs.
"""

import dataclasses
import json
import math
import os
import re

import numpy as np

from ..bundle import ROLES, valid_mask
from ..conventions.common import tap_token_axis
from ..errors import InputError, brief
from ..files import expect, integer, load_json, number, output_file, write_atomic
from ..models.config import config_from_dict
from . import hooks
from .dataflow import producer
from .metrics import logits_metrics, sqnr_db, tensor_metrics

DEFAULTS = {
    "float32": {"max_nmse": 1e-8, "atol": 1e-6},   # calibrated on independent runtimes: docs/diff.md
    "float16": {"max_nmse": 1e-5, "atol": 1e-3},
    "bfloat16": {"max_nmse": 1e-4, "atol": 1e-2},
}
_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# the least NMSE three-way judging expects of a device: one round-to-nearest of a tensor to its dtype, relative error
# uniform within the unit roundoff u (NMSE u^2 / 3; fp16 u = 2^-11, bf16 2^-8). A small tensor (a 4-element gate
# projection at decode) can show an emulated error far below it by luck; k^2 x that would demand luck of the device.
ROUNDING_NMSE = {"float32": DEFAULTS["float32"]["max_nmse"], "float16": 2.0 ** -22 / 3, "bfloat16": 2.0 ** -16 / 3}
FAILING = ("fail", "layout", "error")
METRIC_NAMES = {"n_nan", "n_inf", "max_abs", "max_rel", "max_rel_polygraphy", "rel_p99", "mse", "cosine", "sqnr_db",
                "sqnr_qairt_db", "nmse", "psnr_db", "std_ratio", "not_close", "not_close_frac", "matched_ratio",
                "ulp_max", "ulp_mean", "top1_agreement", "top1_flips", "topk_overlap_mean", "kl_over_lnv_mean",
                "kl_over_lnv_max", "kl_over_lnv_p99", "kl_over_lnv_last", "dp_top_mean", "dp_top_max"}


# ------------------------------------------------------------------------------------------------ policy

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
        a policy rule sets max_nmse itself; an integer tensor passes where it equals the golden or the emulation."""
        c = {"exact": True} if integer else {**DEFAULTS[self.dtype], "run_power": True}
        c.update({"max_n_nan": 0, "max_n_inf": 0})
        if reference is not None and not integer:
            c["max_nmse"] = (self.three_way_k ** 2 * max(reference["nmse"], ROUNDING_NMSE[self.dtype])
                             * small_sample(reference.get("n_compared", reference.get("n", 0))))
            c.pop("run_power")   # the emulation's nmse is per step: so is the device's
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
         "tensors": [{"match": "mlp\\\\.down_proj$", "max_nmse": 1e-4, "min_cosine": 0.999}, ...],
         "layouts": {"past_key_.*_out": "transposed"}, "ignore": ["attn_scores$"]}"""
    spec = dict(spec or {})
    if not isinstance(spec.get("tensors", []), list) or not isinstance(spec.get("layouts", {}), dict) \
            or not isinstance(spec.get("ignore", []), list) or not all(isinstance(p, str) for p in spec.get("ignore", [])):
        raise InputError(f"{where}: 'tensors' must be a list, 'layouts' an object {{regex: adapter}}, 'ignore' a "
                         f"list of regexes")
    three_way_k = spec.get("three_way_k", 4.0)
    if isinstance(three_way_k, bool) or not isinstance(three_way_k, (int, float)) or not three_way_k > 0:
        raise InputError(f"{where}: three_way_k must be a positive number, got {brief(three_way_k)}")
    unknown = set(spec) - {"dtype", "tensors", "layouts", "ignore", "three_way_k"}
    if unknown:
        raise InputError(f"{where}: unknown key(s) {brief(sorted(unknown))}; expected dtype, tensors, layouts, ignore, "
                         f"three_way_k")
    d = dtype or spec.get("dtype", "float32")
    d = _ALIASES.get(d, d) if isinstance(d, str) else d
    if not isinstance(d, str) or d not in DEFAULTS:
        raise InputError(f"{where}: dtype {brief(d)} is not one of {', '.join(DEFAULTS)} (or fp32 / fp16 / bf16)")
    rules = []
    for i, r in enumerate(spec.get("tensors", [])):
        if not isinstance(r, dict) or not isinstance(r.get("match"), str):
            raise InputError(f"{where}: tensors[{i}] must be an object with a 'match' regex")
        crit = {k: v for k, v in r.items() if k != "match"}
        for k, v in crit.items():
            if not (k in ("exact", "atol") or (re.fullmatch(r"(max|min)_\w+", k) and k[4:] in METRIC_NAMES)):
                raise InputError(f"{where}: tensors[{i}]: criterion {brief(k)} is not max_<metric> / min_<metric> of a "
                                 f"known metric ({', '.join(sorted(METRIC_NAMES))}), atol or exact")
            if k == "exact":
                expect(v, bool, f"{where}: tensors[{i}].exact", InputError)
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                raise InputError(f"{where}: tensors[{i}]: {k} must be a number, got {brief(v)}")
        rules.append((_regex(r["match"], where), crit))
    layouts = [(_regex(p, where), a) for p, a in spec.get("layouts", {}).items()]
    for _, a in layouts:
        if not isinstance(a, str) or (a not in ADAPTERS and a != hooks.DECLARED):
            raise InputError(f"{where}: layout {brief(a)} is not one of {', '.join([*ADAPTERS, hooks.DECLARED])}")
    return Policy(d, rules, layouts, [_regex(p, where) for p in spec.get("ignore", [])], float(three_way_k))


def _regex(p, where):
    try:
        re.compile(p)
    except (re.error, TypeError, RecursionError, OverflowError) as e:
        raise InputError(f"{where}: bad regex {brief(p)} ({brief(str(e), 120)})") from None
    return p


def load_policy(path=None, dtype: str | None = None) -> Policy:
    if path is None:
        return make_policy(None, dtype)
    from .dump import read_json
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


def judge(metrics: dict | None, logits: dict | None, criteria: dict) -> list[str]:
    """The criteria a tensor fails (empty: it passes). metrics / logits: refimpl.diff.metrics dicts."""
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
    within_floor = (floor is not None and metrics["max_abs"] <= floor and metrics.get("golden_max_abs", math.inf) <= floor
                    and not metrics["n_nan"] and not metrics["n_inf"])
    for key, limit in criteria.items():
        if key in ("exact", "atol", "run_power"):
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
    return failed


# ------------------------------------------------------------------------------------------------ layouts

def _swap_last(shape):
    return (*shape[:-2], shape[-1], shape[-2]) if len(shape) >= 2 else None


def _aimet_shape(shape, axes):
    s = shape if (axes or "").split(",")[0] == "b" else (1, *shape)
    return (s[0], s[2], s[3], s[1]) if len(s) == 4 else s


def _aimet_inverse(a, shape, axes):
    if a.ndim == 4:
        a = a.transpose(0, 3, 1, 2)
    return a if (axes or "").split(",")[0] == "b" else a[0]


# adapter -> (device shape from the golden shape/axes, device array -> golden layout, description)
ADAPTERS = {
    "transposed": (lambda s, ax: _swap_last(s), lambda a, s, ax: a.swapaxes(-1, -2),
                   "last two axes swapped (e.g. key cache [.., t, d] for [.., d, t], state [dv, dk] for [dk, dv])"),
    "nhwc": (lambda s, ax: (s[0], s[2], s[3], s[1]) if len(s) == 4 else None,
             lambda a, s, ax: a.transpose(0, 3, 1, 2), "NHWC for NCHW (4-D)"),
    "aimet": (_aimet_shape, _aimet_inverse, "AIMET layer-output layout (batch axis added, 4-D as NHWC)"),
}


def candidates(item, rec, declared: str | None, conv_kernel: int | None = None):
    """[(reading or None, array in the golden layout)] to try, the likeliest first (replay takes the first). A tap
    is also tried in the layouts of module hooks (refimpl.diff.hooks: flattened rows, [B, H, T, D], channels-first
    conv), first when its hook name implies one; `declared` is an adapter of ADAPTERS, "hf-hooks" (the dump comes
    from module hooks: their layouts first) or a reading recorded earlier (e.g. "hf-hooks:reshape").
    conv_kernel: the model's causal conv width (padded conv outputs)."""
    shape, axes, a = tuple(rec["shape"]), rec.get("axes"), item.array
    flat = a.ndim == 1 and len(shape) != 1 and a.size == math.prod(shape)  # a raw file: the bundle's shape
    tap = rec["role"] == "tap"
    out = []
    hooked, source = [], getattr(item, "reading", None)
    if tap and (declared is None or declared.startswith(hooks.DECLARED)):
        hooked = hooks.readings(a, rec["name"], shape, conv_kernel, source)
    hooked_names = [h for h, _ in hooked]
    if declared is None and not source:  # as is, as hooked, then the mix-ups
        names = [None, *hooked_names, *ADAPTERS]
    elif declared in (None, hooks.DECLARED):  # the hook layouts first (the one its source implies, if named)
        names = [*hooked_names, None, *ADAPTERS]
    else:
        names = [declared]
    hooked = dict(hooked)
    for name in names:
        if name is None:
            if flat or a.shape == shape or (a.size == math.prod(shape)
                                            and [n for n in a.shape if n != 1] == [n for n in shape if n != 1]):
                out.append((None, a.reshape(shape)))
            continue
        if name.startswith(hooks.DECLARED):
            if name in hooked:
                out.append((name, hooked[name]))
            continue
        dev_shape, inverse, _ = ADAPTERS[name]
        ds = dev_shape(shape, axes)
        if ds is None or math.prod(ds) != math.prod(shape):
            continue
        if flat or a.shape in (tuple(ds), shape):  # its own shape, or its bytes in the contract's buffer
            g = inverse(a.reshape(ds), shape, axes)
            if g.shape == shape:
                out.append((name, g))
    return out


# ------------------------------------------------------------------------------------------------ comparing

@dataclasses.dataclass
class Result:
    key: str
    step: int
    role: str
    name: str
    status: str                      # pass | fail | layout | error | missing | diverged
    op: str | None = None
    layer: int | None = None
    metrics: dict | None = None
    logits: dict | None = None
    failures: list = dataclasses.field(default_factory=list)
    layout: str | None = None        # adapter the dump was read with (declared or detected)
    problem: str | None = None
    positions: dict | None = None    # absolute token position -> SQNR dB of that row
    origin: str | None = None        # for failures: "added" (all inputs pass) or "inherited"
    reference: dict | None = None    # three-way: the emulated run's metrics on this tensor
    source: str | None = None


@dataclasses.dataclass
class Report:
    bundle: str
    dump: str
    policy: dict
    results: list
    first_divergence: dict           # step -> key (or None)
    unknown: list
    absent: int                      # taps / inputs the dump does not hold (not scored)
    notes: list
    config: dict | None = None       # the bundle's model config and convention: the layer DAG, for re-judging
    convention: dict | None = None

    @property
    def failed(self) -> list:
        return [r for r in self.results if r.status in FAILING]

    @property
    def missing(self) -> list:
        return [r for r in self.results if r.status == "missing"]

    @property
    def exit_code(self) -> int:
        """1 when a tensor fails, is unreadable, or a graph output is missing from the dump; else 0."""
        return 1 if self.failed or self.missing else 0


def compare(bundle, dump, policy: Policy | None = None, emulated=None, progress=None) -> Report:
    """Score every dumped tensor of `bundle` (refimpl.bundle.Bundle) against `dump` (refimpl.diff.dump.Dump).
    emulated: an optional Bundle of the same case run at the device's precision (three-way judging).
    progress(i, total): called after each of the bundle's tensors."""
    policy = policy or Policy()
    cfg = model_config((bundle.manifest.get("model") or {}).get("config"))
    conv = bundle.manifest.get("convention")
    results, absent = [], 0
    skipped = check_same_case(bundle, emulated) if emulated is not None else []
    starts = _step_starts(bundle.manifest)
    powers = _run_powers(bundle, dump, policy)
    total = len(bundle.manifest["tensors"])
    for i, rec in enumerate(bundle.records()):
        if progress is not None:
            progress(i, total)
        key = f"{rec['step']}/{rec['role']}/{rec['name']}"
        if policy.ignored(rec["name"]):
            continue
        node = producer(cfg, rec["name"], conv) if cfg is not None else None
        r = Result(key, rec["step"], rec["role"], rec["name"], "missing", node and node.op, node and node.layer)
        item = dump.items.get(key)
        if item is None:
            if rec["role"] == "output":
                r.problem = "not in the dump"
                results.append(r)
            else:
                absent += 1
            continue
        r.source = item.source
        if item.problem:
            r.status, r.problem = "error", item.problem
            results.append(r)
            continue
        _score(r, rec, item, bundle, policy, None if rec["step"] in skipped else emulated, starts[rec["step"]],
               conv_kernel(cfg), powers.get((rec["role"], rec["name"])))
        results.append(r)
    report = Report(str(bundle.path), str(dump.path), policy.to_dict(), results, {k: None for k in range(bundle.steps)},
                    dump.unknown, absent, [], (bundle.manifest.get("model") or {}).get("config"), conv)
    _localise(report)
    report.notes = _notes(report)
    if skipped:
        report.notes.append(f"three-way: the emulated run decoded other tokens from step {skipped[0]} on; those "
                            f"steps are judged by the {policy.dtype} defaults")
    return report


def model_config(config: dict | None):
    """The model config of a bundle's manifest, or None (a bundle from elsewhere: no layer DAG, so every
    failure counts as added)."""
    try:
        return config_from_dict(config) if config is not None else None
    except Exception:
        return None


def is_integer(dtype) -> bool:
    """Token ids, chosen experts, ...: compared exactly (bfloat16 is a float, whatever NumPy says)."""
    return not np.issubdtype(dtype, np.floating) and np.dtype(dtype).name != "bfloat16"


def _step_starts(manifest) -> list[int]:
    """Absolute position of each step's first real token (tokens of earlier steps)."""
    starts, n = [], 0
    for s in manifest["steps"]:
        starts.append(n)
        n += len(s.get("tokens") or [])
    return starts


def conv_kernel(cfg) -> int | None:
    """The causal conv width of a hybrid model (hook dumps of its padded conv), else None."""
    return cfg.linear_conv_kernel_dim if cfg is not None and cfg.is_hybrid else None


def _run_powers(bundle, dump, policy: Policy) -> dict:
    """{(role, name): mean golden^2 over the valid, finite elements of every step} of the dumped float tensors."""
    sums = {}
    for rec in bundle.records():
        if f"{rec['step']}/{rec['role']}/{rec['name']}" not in dump.items or policy.ignored(rec["name"]):
            continue
        g = bundle.tensor(rec["step"], rec["role"], rec["name"])
        if is_integer(g.dtype):
            continue
        v = np.asarray(g, np.float64)[valid_mask(g.shape, rec["valid"])]
        v = v[np.isfinite(v)]
        total, n = sums.get((rec["role"], rec["name"]), (0.0, 0))
        with np.errstate(over="ignore"):
            sums[(rec["role"], rec["name"])] = (total + float(np.sum(v * v)), n + v.size)
    return {k: total / n for k, (total, n) in sums.items() if n and math.isfinite(total)}


def _score(r: Result, rec: dict, item, bundle, policy: Policy, emulated, start: int, kernel: int | None,
           run_power: float | None = None) -> None:
    golden = bundle.tensor(rec["step"], rec["role"], rec["name"])
    integer = is_integer(golden.dtype)
    if emulated is not None and not integer:
        r.reference = _emulated_metrics(emulated, rec, golden, policy)
    declared = policy.layout(rec["name"])
    found = candidates(item, rec, declared, kernel)
    if not found:
        r.status = "error"
        r.problem = (f"shape {list(item.array.shape)} where the bundle has {rec['shape']}"
                     + (f" (declared layout {declared})" if declared else ""))
        return
    if emulated is not None and integer:  # e.g. chosen experts: a near tie the device's precision decides too
        r.reference = _integer_reference(emulated, rec, golden, found[0][1])
    criteria = policy.criteria(rec["name"], integer, r.reference)
    best = None
    for adapter, device in found:
        m, lm = _metrics(golden, device, rec, policy.dtype)
        if run_power is not None:
            m["run_power"] = run_power
        failures = judge(m, lm, criteria)
        if best is None:
            best = (adapter, device, m, lm, failures)
        if not failures:
            best = (adapter, device, m, lm, failures)
            break
    adapter, device, r.metrics, r.logits, r.failures = best
    r.layout = adapter
    if r.failures:
        r.status = "fail"
    elif adapter in ADAPTERS and adapter != declared:
        r.status = "layout"
        r.problem = f"matches the golden only when read as '{adapter}': {ADAPTERS[adapter][2]}"
    else:
        r.status = "pass"
    if integer:
        r.metrics["integer"] = True
    r.positions = _positions(rec, golden, device, bundle, start)


def _metrics(golden, device, rec, dtype):
    m = tensor_metrics(golden, device, rec["valid"], dtype)
    lm = None
    if rec["name"] == "logits" and golden.ndim >= 2 and golden.shape[-1] >= 2:
        rows = valid_mask(golden.shape, rec["valid"]).any(axis=-1)
        lm = logits_metrics(golden, device, rows)
    return m, lm


def check_same_case(bundle, emulated) -> list[int]:
    """An emulated bundle must be the golden's case at another precision: same weights, convention, options and
    prompt (else InputError). Returns the steps whose tokens differ (a reduced-precision greedy decode can pick
    another token; from there on its tensors are not the same computation and three-way judging skips them)."""
    g, e = bundle.manifest, emulated.manifest
    for what, a, b in (("weights", g["model"].get("weights_sha256"), e["model"].get("weights_sha256")),
                       ("convention", g.get("convention"), e.get("convention")),
                       ("prompt", g.get("prompt_ids"), e.get("prompt_ids")),
                       ("number of steps", len(g["steps"]), len(e["steps"]))):
        if a != b:
            raise InputError(f"{emulated.path}: not the golden's case at another precision: its {what} differ "
                             f"({str(b)[:60]} vs {str(a)[:60]})")
    diverged = [k for k, (a, b) in enumerate(zip(g["steps"], e["steps"])) if a.get("tokens") != b.get("tokens")]
    return list(range(diverged[0], len(g["steps"]))) if diverged else []


def _emulated_metrics(emulated, rec, golden, policy):
    try:
        e = emulated.tensor(rec["step"], rec["role"], rec["name"])
    except InputError:
        return None
    if e.shape != golden.shape:
        return None
    return tensor_metrics(golden, e, rec["valid"], policy.dtype)


def _integer_reference(emulated, rec, golden, device) -> dict | None:
    """Three-way for an integer tensor: does the device equal, element by element, the golden or the emulation?
    For chosen experts, a choice between experts the emulation's router gives the same probability (an exact tie
    at the device's precision, broken another way: torch.topk's order is not refimpl's lowest id) counts too, as a
    tie: the device followed the other branch of a fork, and the tensors after it are not judged (_localise)."""
    try:
        e = emulated.tensor(rec["step"], rec["role"], rec["name"])
    except InputError:
        return None
    if e.shape != golden.shape or device.shape != golden.shape:
        return None
    mask = valid_mask(golden.shape, rec["valid"])
    explained = ((device == golden) | (device == e)) & mask
    ties = []
    if rec["name"].endswith("mlp.selected_experts") and not explained[mask].all():
        probs = _emulated_router_probs(emulated, rec)
        for idx in zip(*np.nonzero(mask & ~explained)):
            *row, _ = idx
            p = probs[tuple(row)] if probs is not None else None
            dev, emu = int(device[idx]), int(e[idx])
            if p is not None and max(dev, emu) < p.size and abs(p[dev] - p[emu]) <= 2 * np.spacing(np.float32(p[emu])):
                explained[idx] = True
                ties.append(f"token {row[-1]}: expert {dev} where the emulation took {emu} (p = {p[emu]:.6g} both)")
    out = {"equals_golden_or_emulation": bool(explained[mask].all()), "emulation_differs": int((e != golden)[mask].sum())}
    if ties and out["equals_golden_or_emulation"]:
        out["tie"] = "; ".join(ties)
    return out


def _emulated_router_probs(emulated, rec):
    try:
        return emulated.tensor(rec["step"], "tap", rec["name"].removesuffix("selected_experts") + "router_probs")
    except InputError:
        return None


def _token_axis(rec: dict, T: int) -> int | None:
    name, shape = rec["name"], rec["shape"]
    if rec["role"] == "tap":
        axis = tap_token_axis(name)
        if axis is None:
            return None
    else:
        axes = (rec.get("axes") or "").split(",")
        if "t" not in axes:
            return None
        axis = axes.index("t")
    return axis if len(shape) > axis and shape[axis] == T else None


def _positions(rec, golden, device, bundle, start: int) -> dict | None:
    """SQNR dB of each real token row, keyed by absolute position."""
    step = bundle.manifest["steps"][rec["step"]]
    ids = bundle.manifest["tensors"].get(f"{rec['step']}/input/input_ids")
    T = ids["shape"][-1] if ids else len(step.get("tokens") or [])
    axis = _token_axis(rec, T)
    if axis is None:
        return None
    mask = valid_mask(golden.shape, rec["valid"])
    rows = [t for t in range(T) if np.take(mask, t, axis=axis).any()]
    out = {}
    for j, t in enumerate(rows):
        m = np.take(mask, t, axis=axis)
        g = np.take(golden, t, axis=axis)[m].astype(np.float64)
        d = np.take(device, t, axis=axis)[m].astype(np.float64)
        ok = np.isfinite(g) & np.isfinite(d)
        out[start + j] = sqnr_db(g[ok], d[ok]) if ok.all() else -math.inf
    return out


# ------------------------------------------------------------------------------------------------ localising

def _localise(report: Report) -> None:
    """Mark each failure added / inherited and pick each step's first divergence. A tensor downstream of a tie
    (three-way: the device broke an exact tie of its precision the other way) follows another, equally valid
    path: where it differs it is "diverged", not judged."""
    cfg = model_config(report.config)
    by_key = {r.key: r for r in report.results if r.status != "missing"}
    report.first_divergence = {k: None for k in report.first_divergence}
    memo, forked = {}, {}
    for r in report.results:
        r.origin = None
        if r.status == "diverged":  # judged again (rejudge): decided afresh below
            r.status, r.problem = "fail", None
        tie = (r.reference or {}).get("tie")
        deps = (_compared_ancestors(cfg, report.convention, r.step, r.name, by_key, memo)
                if cfg is not None and (r.status in FAILING or forked or tie) else [])
        fork = next((forked[d] for d in deps if d in forked), r.key if tie else None)
        if fork is not None:
            forked[r.key] = fork
            if r.status == "fail":
                r.status, r.problem = "diverged", f"follows the device's side of the tie at {fork} (not judged)"
            continue
        if r.status not in FAILING:
            continue
        r.origin = "inherited" if any(by_key[d].status in FAILING for d in deps) else "added"
        if r.origin == "added" and report.first_divergence.get(r.step) is None:
            report.first_divergence[r.step] = r.key


def _compared_ancestors(cfg, conv, step: int, name: str, by_key: dict, memo: dict, depth: int = 0) -> list[str]:
    """Keys of the nearest compared tensors that `name` (at `step`) reads, through uncompared ones (also back
    through earlier steps: a cache input reads the previous call's outputs and cache)."""
    if (step, name) in memo:
        return memo[step, name]
    memo[step, name] = []  # cycle guard
    node = producer(cfg, name, conv)
    found = []
    for dep in (node.inputs if node else ()):
        s, n = (step - 1, dep[5:]) if dep.startswith("prev:") else (step, dep)
        if s < 0:
            continue
        hit = next((f"{s}/{role}/{n}" for role in ROLES if f"{s}/{role}/{n}" in by_key), None)
        if hit:
            found.append(hit)
        elif depth < 256 and producer(cfg, n, conv) is not None:
            found += _compared_ancestors(cfg, conv, s, n, by_key, memo, depth + 1)
    memo[step, name] = found
    return found


def _notes(report: Report) -> list[str]:
    """Patterns worth a sentence: state drift over steps, cliffs along positions, where divergence starts. Drift
    and cliffs are named only where they cross the tensor's bar (an honest run's error also grows with steps and
    positions, well above the bar)."""
    notes = []
    fd = [(k, v) for k, v in report.first_divergence.items() if v]
    if fd:
        k, key = fd[0]
        notes.append(f"first divergence: step {k}, {key.split('/', 2)[2]}")
    policy = make_policy(report.policy, where="the report's policy")
    diverged = [r for r in report.results if r.status == "diverged"]
    for r in report.results:
        if (r.reference or {}).get("tie"):
            after = sum(d.problem.endswith(f"{r.key} (not judged)") for d in diverged)
            notes.append(f"tie at step {r.step}, {r.name}: {r.reference['tie']}; {after} tensors after it follow "
                         f"that branch and are not judged (replay them on the device's own inputs: refimpl replay)")
    series = {}
    for r in report.results:
        if r.role == "output" and r.metrics and r.name != "logits":
            series.setdefault(r.name, []).append(r)
    for name, rs in series.items():
        rs = [r for r in sorted(rs, key=lambda r: r.step) if math.isfinite(r.metrics["sqnr_db"])]
        vals = [r.metrics["sqnr_db"] for r in rs]
        if len(vals) >= 3 and all(b < a for a, b in zip(vals, vals[1:])) and vals[-1] < bar_db(policy, rs[-1]):
            below = next(r.step for r in rs if r.metrics["sqnr_db"] < bar_db(policy, r))
            notes.append(f"{name}: SQNR falls every step ({vals[0]:.1f} -> {vals[-1]:.1f} dB), below the bar from "
                         f"step {below}: state drift")
    bars = {p: bar_db(policy, r) for r in report.results if r.name == "logits" and r.positions for p in r.positions}
    curve = position_curve(report, "logits")
    for (p0, v0), (p1, v1) in zip(curve, curve[1:]):
        if math.isfinite(v0) and v0 - v1 > 20 and v1 < bars[p1]:
            notes.append(f"logits: SQNR drops {v0 - v1:.0f} dB from position {p0} to {p1}, below the bar")
            break
    return notes


def bar_db(policy: Policy, r: Result) -> float:
    """The SQNR (dB) a float tensor must reach under `policy`: its max_nmse bar in dB (inf if it has none)."""
    limit = policy.criteria(r.name, bool((r.metrics or {}).get("integer")), r.reference).get("max_nmse")
    return -10 * math.log10(limit) if limit else math.inf


# ------------------------------------------------------------------------------------------------ curves

def layer_curve(report: Report, step: int | None = None) -> dict:
    """layer -> worst SQNR dB among its compared tensors (KV and GDN state outputs included)."""
    out = {}
    for r in report.results:
        if r.layer is None or r.metrics is None or (step is not None and r.step != step):
            continue
        out[r.layer] = min(out.get(r.layer, math.inf), r.metrics["sqnr_db"])
    return dict(sorted(out.items()))


def position_curve(report: Report, name: str) -> list[tuple[int, float]]:
    """(absolute position, SQNR dB) of tensor `name`'s real rows over all steps."""
    pts = {}
    for r in report.results:
        if r.name == name and r.positions:
            pts.update(r.positions)
    return sorted(pts.items())


def step_curve(report: Report, names=None) -> dict:
    """step -> worst SQNR dB over outputs (logits, KV, states) or over the given tensor names."""
    out = {}
    for r in report.results:
        if r.metrics is None or (names is None and r.role != "output") or (names is not None and r.name not in names):
            continue
        out[r.step] = min(out.get(r.step, math.inf), r.metrics["sqnr_db"])
    return dict(sorted(out.items()))


# ------------------------------------------------------------------------------------------------ saving

def save_metrics(report: Report, path) -> None:
    """Raw metrics as JSON (Infinity / NaN as Python writes them), to re-judge later under another policy.
    Written to a temporary file and renamed into place."""
    write_atomic(path, json.dumps(dataclasses.asdict(report), indent=1, default=str))


def load_metrics(path) -> Report:
    """A metrics file save_metrics wrote, every field checked (types, the numbers the judge reads) before use."""
    data = load_json(path, "diff metrics", InputError)
    where = f"{path}: not a refimpl diff metrics file"
    expect(data, dict, where, InputError)
    fields = {f.name: f for f in dataclasses.fields(Report)}
    if set(data) - set(fields) or {n for n, f in fields.items() if f.default is dataclasses.MISSING} - set(data):
        raise InputError(f"{where} (fields {brief(sorted(data, key=str))}, expected {sorted(fields)})")
    _check_fields(data, Report, where)
    for k, v in data["first_divergence"].items():
        if not (k.isascii() and k.isdigit()) or not isinstance(v, (str, type(None))):
            raise InputError(f"{where}: first_divergence {brief(k)}: {brief(v)}")
    for key in ("unknown", "notes"):
        if not all(isinstance(x, str) for x in data[key]):
            raise InputError(f"{where}: {key} must be a list of strings")
    params = (data["convention"] or {}).get("params")
    expect(params, (dict, type(None)), f"{where}: convention.params", InputError)
    results = [_result(r, f"{where}: results[{i}]") for i, r in enumerate(data["results"])]
    return Report(**{**data, "results": results,
                     "first_divergence": {int(k): v for k, v in data["first_divergence"].items()}})


def _check_fields(d: dict, cls, where: str) -> None:
    """Each field of dataclass `cls` present in `d` has its declared type (bool is not an int)."""
    for f in dataclasses.fields(cls):
        if f.name in d:
            v = d[f.name]
            if not isinstance(v, f.type) or (isinstance(v, bool) and f.type is int):
                raise InputError(f"{where}: {f.name} {brief(v)} is not of type {f.type}")


# the numbers judge(), rejudge() and the report read from a result's metrics (others are recorded, not read)
_READ_METRICS = METRIC_NAMES | {"n", "n_compared", "golden_max_abs", "golden_power", "run_power"}


def _result(r, where: str) -> "Result":
    expect(r, dict, where, InputError)
    fields = {f.name: f for f in dataclasses.fields(Result)}
    if set(r) - set(fields) or {n for n, f in fields.items() if f.default is dataclasses.MISSING
                                and f.default_factory is dataclasses.MISSING} - set(r):
        raise InputError(f"{where}: fields {brief(sorted(r, key=str))}, expected {sorted(fields)}")
    _check_fields(r, Result, where)
    integer(r["step"], f"{where}.step", InputError, lo=0)
    if r["role"] not in ROLES or r["status"] not in (*FAILING, "pass", "missing", "diverged", "ignored"):
        raise InputError(f"{where}: role {brief(r['role'])} / status {brief(r['status'])} unknown")
    for key in ("metrics", "logits", "reference"):
        for k, v in (r.get(key) or {}).items():
            if k in _READ_METRICS:
                number(v, f"{where}.{key}.{k}", InputError, finite=False)
    for key, needed in (("metrics", ("n", "max_abs", "n_nan", "n_inf", "sqnr_db")), ("reference", ("nmse",))):
        if r.get(key) is not None and not all(k in r[key] for k in needed):
            raise InputError(f"{where}.{key}: needs {', '.join(needed)}")
    if not all(isinstance(x, str) for x in r.get("failures", [])):
        raise InputError(f"{where}.failures must be a list of strings")
    positions = r.get("positions") or {}
    for k, v in positions.items():
        if not (k.isascii() and k.isdigit()):
            raise InputError(f"{where}.positions: {brief(k)} is not a token position")
        number(v, f"{where}.positions.{k}", InputError, finite=False)
    return Result(**{**r, "positions": {int(k): v for k, v in positions.items()} if r.get("positions") else
                     r.get("positions")})


def rejudge(report: Report, policy: Policy) -> Report:
    """Judge saved metrics again under `policy` (no dump or bundle needed: the saved report carries the model
    config for the layer DAG). Layout, error and missing statuses stay."""
    for r in report.results:
        if r.metrics is None or r.status in ("error", "missing"):
            continue
        if policy.ignored(r.name):
            r.status = "ignored"
            continue
        criteria = policy.criteria(r.name, bool(r.metrics.get("integer")), r.reference)
        r.failures = judge(r.metrics, r.logits, criteria)
        r.status = "fail" if r.failures else ("layout" if r.status == "layout" else "pass")
    report.policy = policy.to_dict()
    _localise(report)
    report.notes = _notes(report)
    return report
