"""Diffing a device dump against a golden bundle (docs/diff.md).

    bundle = refimpl.bundle.read_bundle("golden/case")
    report = compare(bundle, read_dump("output/", bundle), load_policy(dtype="fp16"))
    report.first_divergence, report.failed, report.exit_code
    rows = replay(bundle, read_dump("output/", bundle), refimpl.load(source), layer=3)
    print(explain(bundle, model, "model.layers.3.self_attn.q_norm[0,5,2,17]"))

metrics.py (formulas), dump.py (reading dumps), hooks.py (PyTorch module-hook dumps: names and layouts),
dataflow.py (the layer DAG), compare.py (judging, first divergence, curves), replay.py (teacher forcing, op by op),
explain.py, report.py (table, HTML), commands.py (the CLI).
"""

from .compare import Policy, compare, load_metrics, load_policy, make_policy, rejudge, save_metrics
from .dump import read_dump, read_mapping
from .explain import explain
from .replay import replay

__all__ = ["Policy", "compare", "explain", "load_metrics", "load_policy", "make_policy", "read_dump", "read_mapping",
           "rejudge", "replay", "save_metrics"]
