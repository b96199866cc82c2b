"""Error along the model and the run: SQNR per layer, per token position, per decode step, and the patterns in
them worth a sentence of the report (state drift, cliffs, ties).
"""

import math

from .policy import Policy, make_policy
from .results import Report, Result


def layer_curve(report: Report, step: int | None = None) -> dict:
    """layer -> worst SQNR dB among its compared tensors (KV and GDN state outputs included)."""
    out = {}
    for r in report.results:
        if r.layer is None or r.metrics is None or (step is not None and r.step != step):
            continue
        out[r.layer] = min(out.get(r.layer, math.inf), r.metrics["sqnr_db"])
    return dict(sorted(out.items()))


def position_curve(report: Report, name: str, judged: bool = False) -> list[tuple[int, float]]:
    """(absolute position, SQNR dB) of tensor `name`'s real rows over all steps (judged: not those after a tie or
    fork, which follow another branch than the golden's)."""
    pts = {}
    for r in report.results:
        if r.name == name and r.positions and not (judged and r.status == "diverged"):
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


def report_notes(report: Report) -> list[str]:
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
        ref = r.reference or {}
        fork = ref.get("fork") if r.status == "pass" else None   # accepted by divergence.localise
        if ref.get("tie") or fork:
            after = sum(d.problem.endswith(f"{r.key} (not judged)") for d in diverged)
            what = f"fork at step {r.step}, {r.name}: {fork['rows']}" if fork else \
                f"tie at step {r.step}, {r.name}: {ref['tie']}"
            notes.append(f"{what}; {after} tensors after it follow that branch and are not judged (replay them on "
                         f"the device's own inputs: refimpl replay)")
    series = {}
    for r in report.results:
        if r.role == "output" and r.metrics and r.name != "logits" and r.status != "diverged":
            series.setdefault(r.name, []).append(r)
    for name, rs in series.items():
        rs = [r for r in sorted(rs, key=lambda r: r.step) if math.isfinite(r.metrics["sqnr_db"])]
        vals = [r.metrics["sqnr_db"] for r in rs]
        if len(vals) >= 3 and all(b < a for a, b in zip(vals, vals[1:])) and vals[-1] < bar_db(policy, rs[-1]):
            below = next(r.step for r in rs if r.metrics["sqnr_db"] < bar_db(policy, r))
            notes.append(f"{name}: SQNR falls every step ({vals[0]:.1f} -> {vals[-1]:.1f} dB), below the bar from "
                         f"step {below}: state drift")
    bars = {p: bar_db(policy, r) for r in report.results if r.name == "logits" and r.positions for p in r.positions}
    curve = position_curve(report, "logits", judged=True)
    for (p0, v0), (p1, v1) in zip(curve, curve[1:]):
        if math.isfinite(v0) and v0 - v1 > 20 and v1 < bars[p1]:
            notes.append(f"logits: SQNR drops {v0 - v1:.0f} dB from position {p0} to {p1}, below the bar")
            break
    return notes


def bar_db(policy: Policy, r: Result) -> float:
    """The SQNR (dB) a float tensor must reach under `policy`: its max_nmse bar in dB (inf if it has none)."""
    limit = policy.criteria(r.name, bool((r.metrics or {}).get("integer")), r.reference).get("max_nmse")
    return -10 * math.log10(limit) if limit else math.inf
