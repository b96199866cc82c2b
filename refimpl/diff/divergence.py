"""Where error enters: each failing tensor marked as adding or inheriting error, and each step's first divergence.

A failing tensor whose inputs all pass *adds* error; one with a failing input *inherits* it. The first
divergence of a step is its first adding failure in execution order (coremltools' rule, over the layer DAG
of refimpl.diff.dataflow); graph inputs of a later step read the previous step's outputs.
"""

from ..bundle import ROLES
from ..models.config import config_from_dict
from .dataflow import producer
from .results import FAILING, Report


def model_config(config: dict | None):
    """The model config of a bundle's manifest, or None (a bundle from elsewhere: no layer DAG, so every
    failure counts as added)."""
    try:
        return config_from_dict(config) if config is not None else None
    except Exception:
        return None


def localise(report: Report) -> None:
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
