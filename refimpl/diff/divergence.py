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


def localise(report: Report) -> dict:
    """Mark each failure added / inherited and pick each step's first divergence. A tensor downstream of a tie
    (three-way: the device broke an exact tie of its precision the other way) or of a fork (chosen experts that
    are the top-k of the device's own router logits at a near tie: compare.py, forks.py; accepted here only when
    those router logits pass) follows another, equally valid path: where it differs it is "diverged", not judged.
    Returns {key: the tie's or fork's key} of every compared tensor that follows one, passing ones included (their
    verdicts compare another branch with the golden's). Idempotent: a second call decides the same."""
    cfg = model_config(report.config)
    by_key = {r.key: r for r in report.results if r.status != "missing"}
    report.first_divergence = {k: None for k in report.first_divergence}
    memo, forked = {}, {}
    for r in report.results:
        r.origin = None
        if r.status == "diverged":  # judged again (rejudge): decided afresh below
            r.status, r.problem = "fail", None
        tie = (r.reference or {}).get("tie") or _fork(r, by_key)
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
    return forked


FORK = "a fork: "   # the problem of chosen experts localise accepted as a fork (its mark: the verdict it replaced)


def _fork(r, by_key: dict) -> str | None:
    """A fork's account when r's reference records one (compare.py) and the device's router logits it was read
    from pass: r then passes, as at an exact tie. Else None: r keeps (or gets back) its failing verdict, with why
    it is no fork."""
    ref = r.reference or {}
    fork = ref.get("fork")
    accepted = r.status == "pass" and (r.problem or "").startswith(FORK)   # by an earlier call
    if not (r.status == "fail" or accepted) or not (fork or ref.get("no_fork")):
        return None
    logits = by_key.get(fork["logits"]) if fork else None
    if logits is not None and logits.status == "pass" and logits.layout == fork["reading"]:
        r.status, r.failures, r.problem = "pass", [], FORK + fork["rows"]
        return fork["rows"]
    r.status, r.failures = "fail", r.failures or ["exact: values differ"]
    r.problem = (f"no fork: the device's router logits ({fork['logits']}) do not pass" if fork else
                 f"no fork: {ref['no_fork']}")
    return None


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
