"""Diffing a device dump against a golden bundle (docs/diff.md).

    bundle = refimpl.bundle.read_bundle("golden/case")
    report = compare(bundle, read_dump("output/", bundle), load_policy(dtype="fp16"))
    report.first_divergence, report.failed, report.exit_code
    rows = replay(bundle, read_dump("output/", bundle), refimpl.load(source), layer=3)
    print(explain(bundle, model, "model.layers.3.self_attn.q_norm[0,5,2,17]"))

metrics.py (the per-tensor and per-logit rows; their formulas are refimpl.metrics), dump.py (reading dumps), hooks.py
(PyTorch module-hook dumps: names and layouts), layouts.py (the readings of a dumped array), dataflow.py (the layer
DAG), policy.py (judging), results.py (Result, Report), compare.py (scoring a dump, three-way), divergence.py (added
or inherited error, first divergence), curves.py (SQNR per layer / position / step, notes), saved.py (metrics
files, re-judging), replay.py (teacher forcing, op by op), explain.py, report.py (table, HTML), quantised.py
(integer dumps, the three-way diff of a quantised device), classify.py (the kind of fault a tensor shows),
commands.py (the CLI).
"""

from .classify import classify
from .compare import compare
from .dump import read_dump, read_mapping
from .explain import explain
from .policy import Policy, load_policy, make_policy
from .replay import replay
from .saved import load_metrics, rejudge, save_metrics

__all__ = ["Policy", "classify", "compare", "explain", "load_metrics", "load_policy", "make_policy", "read_dump",
           "read_mapping", "rejudge", "replay", "save_metrics"]
