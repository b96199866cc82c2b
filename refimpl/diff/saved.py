"""Saved metrics: a Report written as JSON, read back with every field checked, and judged again under another
policy (no dump or bundle needed).

    save_metrics(report, "diff.json")
    report = rejudge(load_metrics("diff.json"), load_policy(dtype="fp16"))
"""

import dataclasses
import json

from ..bundle import ROLES
from ..errors import InputError, brief
from ..files import expect, integer, load_json, number, write_atomic
from .classify import CLASSES, SHIFT_CRITERION, offset_fault
from .curves import report_notes
from .divergence import localise
from .policy import METRIC_NAMES, Policy, bar, judge
from .results import FAILING, Report, Result


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
_CHANNEL_NUMBERS = ("count", "n", "mse", "power", "tensor_power", "rest_nmse", "gain", "nmse")


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
    channels = (r.get("metrics") or {}).get("channels")
    if channels is not None:   # the worst channel judge() reads (refimpl.diff.channels)
        expect(channels, dict, f"{where}.metrics.channels", InputError)
        for k in _CHANNEL_NUMBERS:
            number(channels.get(k), f"{where}.metrics.channels.{k}", InputError, finite=False)
        for k in ("n", "count"):
            integer(channels[k], f"{where}.metrics.channels.{k}", InputError, lo=1, hi=2 ** 48)
        for k in ("gain_mse", "gain_power", "gain_offset", "gain_z2", "gain_scale", "gain_q"):   # the gain test's
            if k in channels:
                number(channels[k], f"{where}.metrics.channels.{k}", InputError, finite=False)
        if "gain_n" in channels:
            integer(channels["gain_n"], f"{where}.metrics.channels.gain_n", InputError, lo=1, hi=2 ** 48)
        if channels.get("emulated_nmse") is not None:
            number(channels["emulated_nmse"], f"{where}.metrics.channels.emulated_nmse", InputError, finite=False)
    shift = (r.get("metrics") or {}).get("code_shift")
    if shift is not None:   # a quantised tap's integer codes (refimpl.diff.metrics.code_shift), judged by code_shift
        expect(shift, dict, f"{where}.metrics.code_shift", InputError)
        integer(shift.get("codes"), f"{where}.metrics.code_shift.codes", InputError, lo=-2 ** 32, hi=2 ** 32)
        integer(shift.get("n"), f"{where}.metrics.code_shift.n", InputError, lo=0, hi=2 ** 48)
        if not 0 <= number(shift.get("share"), f"{where}.metrics.code_shift.share", InputError) <= 1:
            raise InputError(f"{where}.metrics.code_shift.share: {brief(shift['share'])} is not a share in [0, 1]")
        if "zero_point" in shift or "scale" in shift:
            integer(shift.get("zero_point"), f"{where}.metrics.code_shift.zero_point", InputError, lo=-2 ** 32,
                    hi=2 ** 32)
            number(shift.get("scale"), f"{where}.metrics.code_shift.scale", InputError)
    for key, needed in (("metrics", ("n", "max_abs", "n_nan", "n_inf", "sqnr_db")), ("reference", ("nmse",))):
        if key == "reference" and "equals_golden_or_emulation" in (r.get(key) or {}):
            continue   # an integer tensor's three-way reference (compare._integer_reference): no nmse
        if r.get(key) is not None and not all(k in r[key] for k in needed):
            raise InputError(f"{where}.{key}: needs {', '.join(needed)}")
    if not all(isinstance(x, str) for x in r.get("failures", [])):
        raise InputError(f"{where}.failures must be a list of strings")
    fault = r.get("fault")
    if fault is not None and not (fault.get("class") in CLASSES and all(isinstance(fault.get(k), str) for k in
                                  ("summary", "criterion")) and isinstance(fault.get("params"), dict)):
        raise InputError(f"{where}.fault: needs a class of {', '.join(CLASSES)}, a summary, a criterion and params")
    for k in ("residual_before", "residual_after", "floor"):
        if fault is not None:
            number(fault.get(k), f"{where}.fault.{k}", InputError, finite=False)
    positions = r.get("positions") or {}
    for k, v in positions.items():
        if not (k.isascii() and k.isdigit()):
            raise InputError(f"{where}.positions: {brief(k)} is not a token position")
        number(v, f"{where}.positions.{k}", InputError, finite=False)
    return Result(**{**r, "positions": {int(k): v for k, v in positions.items()} if r.get("positions") else
                     r.get("positions")})


def rejudge(report: Report, policy: Policy) -> Report:
    """Judge saved metrics again under `policy` (no dump or bundle needed: the saved report carries the model
    config for the layer DAG). Layout, error and missing statuses stay. Faults: a first divergence the code_shift
    criterion fails is an offset (classify.offset_fault, from its metrics); one that was a first divergence before
    keeps the fault classified then (the fit needs the arrays), unless that was a code shift's; the others have none."""
    criteria = {}
    for r in report.results:
        if r.metrics is None or r.status in ("error", "missing"):
            continue
        if policy.ignored(r.name):
            r.status = "ignored"
            continue
        criteria[r.key] = policy.criteria(r.name, bool(r.metrics.get("integer")), r.reference)
        r.failures, r.bar = judge(r.metrics, r.logits, criteria[r.key], r.reference), bar(criteria[r.key], r.metrics)
        r.status = "fail" if r.failures else ("layout" if r.status == "layout" else "pass")
    report.policy = policy.to_dict()
    localise(report)
    first = set(report.first_divergence.values())
    for r in report.results:
        shifted = offset_fault(r.metrics, criteria[r.key]) if r.key in first and r.key in criteria else None
        if shifted is not None:
            r.fault = shifted.to_dict()
        elif r.key not in first or (r.fault or {}).get("criterion") == SHIFT_CRITERION:
            r.fault = None
    report.notes = report_notes(report)
    return report
