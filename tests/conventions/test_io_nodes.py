"""Every convention is the same protocol, and declares the producer of every graph input and output it has: the
names a run produces, no more, no fewer, each with the node refimpl.diff.dataflow gives it."""

import dataclasses
import inspect

import pytest

import refimpl
from refimpl.conventions import CONVENTIONS
from refimpl.diff.dataflow import producer
from refimpl.models.model import graph
from refimpl.presets import PRESETS

PARAMS = [("hf", {}), ("genie", {"ar": 4, "cl": 16}), ("genie", {"ar": 4, "cl": 16, "kv_output": "window"}),
          ("qeff", {"seq_len": 4, "ctx_len": 16})]
PROMPT = [5, 6, 7, 8, 9]   # two prompt calls of the static graphs, one padded
_models = {}


def model(name):
    if name not in _models:
        _models[name] = refimpl.load(name)
    return _models[name]


def _shape(fn):
    """A function's parameters: names, kinds and defaults (annotations name each module's own Options)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_conventions_share_one_protocol():
    hf = CONVENTIONS["hf"]
    for name, module in CONVENTIONS.items():
        assert dataclasses.is_dataclass(module.Options) and module.Options.__dataclass_params__.frozen, name
        for method in ("check", "resolved"):
            assert _shape(getattr(module.Options, method)) == _shape(getattr(hf.Options, method)), (name, method)
        for fn in ("input_shapes", "graph", "run", "io_nodes", "state_input", "state_output"):
            assert _shape(getattr(module, fn)) == _shape(getattr(hf, fn)), (name, fn)


@pytest.mark.parametrize("convention,params", PARAMS, ids=lambda p: p if isinstance(p, str) else
                         ",".join(f"{k}={v}" for k, v in p.items()) or "defaults")
@pytest.mark.parametrize("preset", list(PRESETS))
def test_io_nodes_declare_every_graph_input_and_output(preset, convention, params):
    m, module = model(preset), CONVENTIONS[convention]
    opts = module.Options(**params)
    calls = module.run(m, PROMPT, opts, decode_steps=1)
    record = {"name": convention, "params": dataclasses.asdict(opts.resolved(m))}   # as the manifest records it
    declared = module.io_nodes(m.config, record["params"])
    for k, call in enumerate(calls):
        names = [*call.inputs, *call.outputs]
        if convention == "hf" and k == 0:    # the first call has no cache inputs
            assert set(names) <= set(declared), (k, sorted(set(names) - set(declared)))
        else:                                # and the declarations are in the graph's order
            assert names == list(declared), (k, sorted(set(names) ^ set(declared)))
    assert set(declared) == {n for c in calls for n in (*c.inputs, *c.outputs)}
    # the options given or resolved declare the same; a field this refimpl does not know (a bundle of another
    # version) is ignored: the diff reads any bundle's params
    assert module.io_nodes(m.config, params) == declared == module.io_nodes(m.config, {**params, "unknown": 1})
    taps = graph(m.config)
    for name, node in declared.items():   # each producer reads taps the model declares, or this graph's own I/O
        assert producer(m.config, name, record) == node, name
        for n in node.inputs:
            assert n in taps or n in declared or n.removeprefix("prev:") in declared, (name, n)
    for kind in ("past_key", "past_value", "conv_state", "recurrent_state"):   # what a block's cache:<kind>.<i> is
        layers = [i for i, t in enumerate(m.config.layer_types) if (t == "linear_attention") == kind.endswith("state")]
        assert all(module.state_input(kind, i) in declared and module.state_output(kind, i) in declared
                   for i in layers), kind


def test_io_nodes_defaults_without_params():
    cfg = model("tiny-qwen3.5").config
    for module in CONVENTIONS.values():
        assert module.io_nodes(cfg, None) == module.io_nodes(cfg, {})
