"""The graph is declared once, beside the code that computes it (refimpl/graph.py): every traced tap has exactly one
declared node, every declared node is tapped, and docs/taps.md is what the declarations say."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import refimpl
from refimpl.conventions import CONVENTIONS
from refimpl.diff.dataflow import producer
from refimpl.graph import Node, declare
from refimpl.models import qwen3
from refimpl.models.model import graph
from refimpl.presets import PRESETS

DOCS = Path(__file__).parent.parent / "docs"


def graph_inputs(cfg) -> set:
    """Every convention's graph inputs that a host prepares (not carried state): what a block may read besides taps."""
    return {n for c in CONVENTIONS.values() for n, node in c.io_nodes(cfg, {}).items() if node.op == "graph input"}


def traced_and_declared(model) -> tuple[set, set]:
    """(tap names a forward records, node names the graph declares) over a padded two-row prefill, a cached decode
    step and an unpadded single-row call: every path a block has (padded rows of linear attention, the one-token
    recurrent step, the chunked core)."""
    cache = model.new_cache(batch_size=2)
    names = []
    for ids, kw in ((np.array([[0, 5, 6, 7], [1, 2, 3, 4]]), {"attention_mask": np.array([[0, 1, 1, 1], [1] * 4])}),
                    (np.array([[8], [9]]), {}), (np.array([[1, 2, 3]]), {"cache": None})):
        with refimpl.trace() as tr:
            model.forward(ids, **{"cache": cache, **kw})
        once = [n for n, _ in tr.records]
        twice = sorted({n for n in once if once.count(n) > 1})
        assert not twice, f"recorded twice in one call: {twice}"
        names += once
    return set(names), set(graph(model.config))


def mismatch(model) -> str:
    traced, declared = traced_and_declared(model)
    return (f"tapped, not declared: {sorted(traced - declared)[:5]}; "
            f"declared, never tapped: {sorted(declared - traced)[:5]}") if traced != declared else ""


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_tap_is_declared_once_and_every_declared_node_is_tapped(preset):
    model = refimpl.load(preset)
    assert mismatch(model) == ""
    for name, node in graph(model.config).items():   # every input is a node, a graph input or a carried state
        for n in node.inputs:
            assert n in graph(model.config) or n.startswith("cache:") or n in graph_inputs(model.config), (name, n)
        assert producer(model.config, name).op == node.op


def test_an_undeclared_tap_fails(monkeypatch):
    """A tap added to a block without declaring it is caught ..."""
    mlp = qwen3.mlp

    def tapping_more(w, p, x, cfg, ctx):
        y = mlp(w, p, x, cfg, ctx)
        return qwen3.tap(p, "extra", y)
    monkeypatch.setattr(qwen3, "mlp", tapping_more)
    assert "tapped, not declared: ['model.layers.0.mlp.extra'" in mismatch(refimpl.load("tiny-qwen3"))


def test_a_declared_node_never_tapped_fails(monkeypatch):
    """... and so is a node declared but never tapped."""
    mlp_nodes = qwen3.mlp_nodes

    def declaring_more(p, x, layer):
        return {**mlp_nodes(p, x, layer), **declare({"extra": Node("mul", "y = 2 x", (x,))}, p, layer)}
    monkeypatch.setattr(qwen3, "mlp_nodes", declaring_more)
    assert "declared, never tapped: ['model.layers.0.mlp.extra'" in mismatch(refimpl.load("tiny-qwen3"))


def test_a_node_declared_twice_fails(monkeypatch):
    monkeypatch.setattr(qwen3, "mlp_nodes", lambda p, x, layer: declare(
        {"input_layernorm": Node("mul", "y = x", (x,))}, p.rsplit(".", 1)[0], layer))
    with pytest.raises(AssertionError, match="declared twice.*input_layernorm"):
        graph(refimpl.load("tiny-qwen3").config)


def test_a_tap_recorded_twice_in_one_call_fails(monkeypatch):
    mlp = qwen3.mlp
    monkeypatch.setattr(qwen3, "mlp", lambda w, p, x, cfg, ctx: qwen3.tap(p, "down_proj", mlp(w, p, x, cfg, ctx)))
    with pytest.raises(AssertionError, match="recorded twice in one call.*mlp.down_proj"):
        mismatch(refimpl.load("tiny-qwen3"))


def test_docs_taps_md_is_generated_from_the_declarations():
    spec = importlib.util.spec_from_file_location("make_taps", DOCS / "make_taps.py")
    make_taps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_taps)
    assert (DOCS / "taps.md").read_text() == make_taps.taps_markdown(), \
        "docs/taps.md is stale: run `python docs/make_taps.py`"
