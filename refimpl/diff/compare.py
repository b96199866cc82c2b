"""Compare a device dump with a golden bundle: every dumped tensor scored, judged, and each step's first divergence.

    report = compare(read_bundle(b), read_dump(d, bundle), load_policy(None))
    report.first_divergence[k]            # step k's first tensor that fails while everything it reads passes
    report.results                        # every compared tensor in execution order, with metrics and status

The judging is policy.py's, the readings of a dumped array layouts.py's, the first divergence divergence.py's;
three-way judging (an emulated-precision bundle of the same case) is here. Each golden tensor is read once: a
float tensor's bar depends on its golden power over the whole run, so the verdicts are given after the last step
(only a tensor whose reading is decided by that power and fails it is read again, to try its other readings).
"""

import math

import numpy as np

from ..bundle import valid_mask
from ..conventions.common import tap_token_axis
from ..errors import InputError
from ..metrics import sqnr_db
from .channels import channel_scores, gain_tested, sample_axes
from .classify import classify_divergences
from .curves import report_notes
from .dataflow import producer
from .divergence import localise, model_config
from .forks import fork
from .layouts import ADAPTERS, candidates, conv_kernel
from .metrics import code_shift, logits_metrics, tensor_metrics
from .policy import ROUNDING_NMSE, Policy, bar, judge
from .results import Report, Result


def compare(bundle, dump, policy: Policy | None = None, emulated=None, progress=None, encodings=None) -> Report:
    """Score every dumped tensor of `bundle` (refimpl.bundle.Bundle) against `dump` (refimpl.diff.dump.Dump).
    emulated: an optional Bundle of the same case run at the device's precision (three-way judging).
    progress(i, total): called after each of the bundle's tensors. encodings: {tap: refimpl.encodings.Encoding}
    of the bundle's quantised taps: a tap the dump holds as integer codes (refimpl.diff.quantised.decode_codes)
    gets metrics["code_shift"] (metrics.code_shift), which the code_shift criterion judges."""
    policy = policy or Policy()
    cfg = model_config((bundle.manifest.get("model") or {}).get("config"))
    conv = bundle.manifest.get("convention")
    results, absent, scored, powers = [], 0, [], {}
    skipped = check_same_case(bundle, emulated) if emulated is not None else []
    starts = _step_starts(bundle.manifest)
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
        golden = bundle.tensor(rec["step"], rec["role"], rec["name"])
        _add_power(powers, rec, golden)
        results.append(r)
        if item.problem:
            r.status, r.problem = "error", item.problem
            continue
        scored.append((r, _score(r, rec, item, golden, bundle, policy, None if rec["step"] in skipped else emulated,
                                 starts[rec["step"]], conv_kernel(cfg), dump, (encodings or {}).get(rec["name"]))))
    run_power = _run_power(powers)   # a float tensor's bar depends on its golden power over every step: judge now
    for r, scoring in scored:
        if scoring is not None:
            _verdict(r, scoring, policy.layout(r.name), run_power.get((r.role, r.name)))
    report = Report(str(bundle.path), str(dump.path), policy.to_dict(), results, {k: None for k in range(bundle.steps)},
                    dump.unknown, absent, [], (bundle.manifest.get("model") or {}).get("config"), conv)
    localise(report)
    classify_divergences(report, bundle, dump, policy)
    report.notes = report_notes(report)
    if skipped:
        report.notes.append(f"three-way: the emulated run decoded other tokens from step {skipped[0]} on; those "
                            f"steps are judged by the {policy.dtype} defaults")
    return report


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


def _add_power(powers: dict, rec: dict, golden) -> None:
    """Add a dumped float tensor's golden^2 over its valid, finite elements to powers[(role, name)] = (sum, count)."""
    if is_integer(golden.dtype):
        return
    v = np.asarray(golden, np.float64)[valid_mask(golden.shape, rec["valid"])]
    v = v[np.isfinite(v)]
    total, n = powers.get((rec["role"], rec["name"]), (0.0, 0))
    with np.errstate(over="ignore"):
        powers[(rec["role"], rec["name"])] = (total + float(np.sum(v * v)), n + v.size)


def _run_power(powers: dict) -> dict:
    """{(role, name): mean golden^2 over every step} (policy.judged_nmse's run power) from _add_power's sums."""
    return {k: total / n for k, (total, n) in powers.items() if n and math.isfinite(total)}


def _score(r: Result, rec: dict, item, golden, bundle, policy: Policy, emulated, start: int,
           kernel: int | None, dump=None, encoding=None) -> tuple | None:
    """Score the readings of a dumped tensor (layouts.candidates) in order until one may pass: whether it does
    depends on the run's golden power, known once every step is read, and _verdict judges it then. Returns
    (criteria, the readings scored as (adapter, metrics, logits metrics), {adapter: positions} of the first and the
    last, rest), rest(run_power) scoring the readings after them (it reads the golden again); None when no reading
    fits (r is then an error). encoding: the tap's (refimpl.encodings.Encoding), for a dump of its integer codes."""
    integer = is_integer(golden.dtype)
    emulation = None   # the emulated run's tensor (three-way): its channels' errors are the channels' references
    if emulated is not None and not integer:
        emulation = _emulated_tensor(emulated, rec, golden)
        r.reference = None if emulation is None else tensor_metrics(golden, emulation, rec["valid"], policy.dtype)
    declared = policy.layout(rec["name"])
    found = candidates(item, rec, declared, kernel)
    if not found:
        r.status = "error"
        r.problem = (f"shape {list(item.array.shape)} where the bundle has {rec['shape']}"
                     + (f" (declared layout {declared})" if declared else ""))
        return None
    if emulated is not None and integer:  # e.g. chosen experts: a near tie the device's precision decides too
        r.reference = _integer_reference(emulated, rec, golden, found[0][1], (bundle, dump, policy, kernel))
    criteria = policy.criteria(rec["name"], integer, r.reference)

    codes = getattr(item, "codes", None) if encoding is not None and encoding.float_dtype is None else None

    def score(adapter, device, golden):
        m, lm = _metrics(golden, device, rec, policy.dtype, emulation)
        if integer:
            m["integer"] = True
        elif codes is not None:   # the device's integer codes against the quantised golden's
            m["code_shift"] = _code_shift(golden, device, codes if adapter is None else None, rec, encoding)
        return adapter, m, lm

    readings = []
    for adapter, device in found:
        readings.append(score(adapter, device, golden))
        # the nmse judged is lowest when the run's golden power is largest (policy.judged_nmse)
        if not judge({**readings[-1][1], "run_power": math.inf}, readings[-1][2], criteria, r.reference):
            break
    kept = dict((found[0], found[len(readings) - 1]))   # the readings _verdict may keep
    positions = {a: _positions(rec, golden, d, bundle, start) for a, d in kept.items()}

    def rest(run_power):
        """The first reading after those scored that passes at the run's golden power, with its positions."""
        if len(readings) == len(found):
            return None
        golden = bundle.tensor(rec["step"], rec["role"], rec["name"])
        for adapter, device in candidates(item, rec, declared, kernel)[len(readings):]:
            _, m, lm = score(adapter, device, golden)
            if run_power is not None:
                m["run_power"] = run_power
            if not judge(m, lm, criteria, r.reference):
                return adapter, m, lm, _positions(rec, golden, device, bundle, start)
        return None
    return criteria, readings, positions, rest


def _verdict(r: Result, scored: tuple, declared: str | None, run_power: float | None) -> None:
    """Judge a tensor's scored readings at the run's golden power: it is read as the first reading that passes
    (status layout when that is a layout mix-up the policy does not declare), else as the first (status fail).
    Of the readings _score kept only the last can pass: the others fail at any run power."""
    criteria, readings, positions, rest = scored
    for _, m, _ in readings:
        if run_power is not None:
            m["run_power"] = run_power
    adapter, m, lm = readings[-1]
    passing = rest(run_power) if judge(m, lm, criteria, r.reference) else (adapter, m, lm, positions[adapter])
    if passing is None:
        adapter, m, lm = readings[0]
        r.layout, r.metrics, r.logits, r.positions = adapter, m, lm, positions[adapter]
        r.failures, r.status, r.bar = judge(m, lm, criteria, r.reference), "fail", bar(criteria, m)
        return
    r.layout, r.metrics, r.logits, r.positions = passing
    r.failures, r.bar = [], bar(criteria, r.metrics)
    if r.layout in ADAPTERS and r.layout != declared:
        r.status = "layout"
        r.problem = f"matches the golden only when read as '{r.layout}': {ADAPTERS[r.layout][2]}"
    else:
        r.status = "pass"


def _code_shift(golden, device, codes, rec, encoding) -> dict:
    """metrics.code_shift of a quantised tap over its valid region: the golden's codes against the device's as
    dumped (`codes`, in the golden's reading; reshaped, as that reading reshapes them) or, in another reading, the
    codes of the device's dequantised values read so (encoding.codes of them: the same codes)."""
    mask = valid_mask(golden.shape, rec["valid"])
    if codes is None or codes.size != golden.size:
        codes = encoding.codes(np.nan_to_num(np.asarray(device, np.float32)))
    return code_shift(encoding.codes(golden)[mask], codes.reshape(golden.shape)[mask], encoding)


def _metrics(golden, device, rec, dtype, emulation=None):
    m = tensor_metrics(golden, device, rec["valid"], dtype)
    axes = sample_axes(rec) if not is_integer(golden.dtype) else None
    if axes is not None:   # the worst channel (refimpl.diff.channels), judged beside the whole tensor
        m["channels"] = channel_scores(golden, device, valid_mask(golden.shape, rec["valid"]), axes, emulation,
                                       gain_tested(rec["name"]))
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


def _emulated_tensor(emulated, rec, golden):
    """The emulated run's tensor of `rec`, or None (not in it, another shape)."""
    try:
        e = emulated.tensor(rec["step"], rec["role"], rec["name"])
    except InputError:
        return None
    return e if e.shape == golden.shape else None


def _integer_reference(emulated, rec, golden, device, router: tuple | None = None) -> dict | None:
    """Three-way for an integer tensor: does the device equal, element by element, the golden or the emulation?
    For chosen experts, a choice between experts the emulation's router gives the same probability (an exact tie
    at the device's precision, broken another way: torch.topk's order is not refimpl's lowest id) counts too, as a
    tie: the device followed the other branch of a fork, and the tensors after it are not judged (localise). A
    token routed otherwise is a fork when its choice is the top-k of the device's own router logits at a near tie
    within the error they carry there (forks.py, checked on router = (bundle, dump, policy, conv kernel)): the
    reference then records it ("fork"), and localise accepts it only if the device's router logits pass."""
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
            valid = p is not None and 0 <= min(dev, emu) and max(dev, emu) < p.size   # a garbage id is no tie
            if valid and abs(p[dev] - p[emu]) <= 2 * np.spacing(np.float32(p[emu])):
                explained[idx] = True
                ties.append(f"token {row[-1]}: expert {dev} where the emulation took {emu} (p = {p[emu]:.6g} both)")
    out = {"equals_golden_or_emulation": bool(explained[mask].all()),
           "emulation_differs": int((e != golden)[mask].sum())}
    if ties and out["equals_golden_or_emulation"]:
        out["tie"] = "; ".join(ties)
    elif not out["equals_golden_or_emulation"] and router is not None and rec["name"].endswith("selected_experts"):
        rows = sorted({tuple(idx[:-1]) for idx in zip(*np.nonzero(mask & ~explained))})
        out.update(_fork(emulated, rec, golden, e, device, rows, ties, *router))
    return out


def _fork(emulated, rec, golden, e, device, rows, ties, bundle, dump, policy: Policy, kernel) -> dict:
    """{"fork": {logits: the router logits' key, reading: the reading of the device's, rows: what}} when every
    token of `rows` (the chosen experts' unexplained [B, T] indices) is a fork of the device's own router logits
    (forks.py), else {"no_fork": why}."""
    name = rec["name"].removesuffix("selected_experts") + "router_logits"
    key = f"{rec['step']}/tap/{name}"
    item, lrec = (dump.items.get(key) if dump is not None else None), bundle.manifest["tensors"].get(key)
    if item is None or item.problem or lrec is None:
        return {"no_fork": f"the device's router logits ({name}) are not in the dump"}
    found = candidates(item, lrec, policy.layout(name), kernel)
    try:
        g_logits, e_logits = bundle.tensor(rec["step"], "tap", name), emulated.tensor(rec["step"], "tap", name)
    except InputError:
        return {"no_fork": f"no golden or emulated {name}"}
    if not found or e_logits.shape != g_logits.shape or g_logits.shape[:-1] != golden.shape[:-1]:
        return {"no_fork": f"the device's router logits ({name}) are not readable in the golden's shape"}
    reading, d_logits = found[0]
    said = list(ties)
    for row in rows:
        why, what = fork(g_logits[row], e_logits[row], d_logits[row], device[row], (golden[row], e[row]),
                         policy.three_way_k, ROUNDING_NMSE[policy.dtype])
        if why is not None:
            return {"no_fork": f"token {row[-1]}: {why}"}
        said.append(f"token {row[-1]}: {what}")
    return {"fork": {"logits": key, "reading": reading, "rows": "; ".join(said)}}


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
