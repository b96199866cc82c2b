"""Teacher-forced replay: run the reference on the device's own dumped inputs and split each tensor's error
into the part it inherited and the part its op (or layer) added (device_conventions.md §11, §13.1).

    rows = replay(bundle, dump, model, layer=3)          # every dumped tensor of layer 3, every step
    rows = replay(bundle, dump, model, tensor="model.layers.3.self_attn.q_norm", step=0)

For a step, the graph runs on the device's inputs where the dump holds them (else the bundle's), with every
dumped tap outside the replayed set forced to the device's value (refimpl.trace overrides). So the replayed
layer reads exactly what the device's layer read, and the reference's value R of each of its tensors is
"the right answer given the device's inputs". With golden G and device D:

    total     = metrics(G, D)      what the diff reports
    inherited = metrics(G, R)      how far the device's inputs alone move the tensor
    added     = metrics(R, D)      the error this op / layer itself adds

A layer that adds error fails `added` under the policy; one downstream of a fault shows a large `inherited`
and a passing `added`. Where a replayed tensor reads a tap that is neither in the dump nor replayed (a bundle
recorded with a --taps filter), the two cannot be separated: the row lists those inputs and claims nothing.
Give the dump the inputs the host fed the device (steps/<k>/inputs/<name>.raw): without
them a later step replays on the golden's KV and state inputs, and the error the device's own cache carried in
counts as added (each row lists the inputs it had to take from the golden).
"""

import dataclasses

import numpy as np

from ..bundle import DTYPES
from ..golden import run_graph
from ..errors import InputError
from ..trace import trace
from .compare import Policy, _candidates, is_integer, judge
from .dataflow import producer
from .metrics import tensor_metrics
from ..models.config import config_from_dict


@dataclasses.dataclass
class ReplayRow:
    step: int
    name: str
    total: dict
    inherited: dict
    added: dict
    adds_error: bool
    failures: list
    golden_inputs: list = dataclasses.field(default_factory=list)  # graph inputs the dump lacked (golden used)
    not_forced: list = dataclasses.field(default_factory=list)     # direct inputs neither dumped nor replayed:
                                                                   # added and inherited cannot be separated


def _device(bundle, dump, step: int, role: str, name: str, policy: Policy):
    """The device's tensor in the golden layout (declared layout, else as is), or None if not usable."""
    item = dump.items.get(f"{step}/{role}/{name}")
    if item is None or item.problem:
        return None
    rec = bundle.manifest["tensors"][item.key]
    cands = _candidates(item, rec, policy.layout(name))
    return cands[0][1] if cands else None


def run_step(bundle, dump, model, step: int, keep: set, policy: Policy):
    """The reference's taps and outputs for `step` on the device's inputs, with every dumped tap not in
    `keep` forced to its device value."""
    s = bundle.manifest["steps"][step]
    inputs = {}
    for n in s["inputs"]:
        d = _device(bundle, dump, step, "input", n, policy)
        golden = bundle.tensor(step, "input", n)
        inputs[n] = golden.copy() if d is None else np.asarray(d).astype(golden.dtype)
    overrides = {}
    for n in s["taps"]:
        if n in keep:
            continue
        d = _device(bundle, dump, step, "tap", n, policy)
        if d is not None:
            overrides[n] = np.array(d, dtype=DTYPES[bundle.manifest["tensors"][f"{step}/tap/{n}"]["dtype"]])
    with trace(".", overrides=overrides) as tr:
        outputs = run_graph(model, bundle.manifest, inputs)
    return {**{n: tr[n] for n in tr.names()}, **outputs}, set(overrides)


def layer_tensors(bundle, step: int, layer: int) -> list[tuple[str, str]]:
    """(role, name) of step's taps inside layer `layer` and the graph outputs it writes (KV, states)."""
    cfg = config_from_dict(bundle.manifest["model"]["config"])
    s = bundle.manifest["steps"][step]
    out = [("tap", n) for n in s["taps"] if n == f"model.layers.{layer}" or n.startswith(f"model.layers.{layer}.")]
    for n in s["outputs"]:
        node = producer(cfg, n)
        if node is not None and node.layer == layer:
            out.append(("output", n))
    return out


def replay(bundle, dump, model, *, layer: int | None = None, tensor: str | None = None, step: int | None = None,
           policy: Policy | None = None) -> list[ReplayRow]:
    """Replay one layer or one tensor on the device's inputs (see the module docstring); every step unless
    `step` is given. Rows only for tensors the dump holds."""
    policy = policy or Policy()
    cfg = config_from_dict(bundle.manifest["model"]["config"])
    if (layer is None) == (tensor is None):
        raise InputError("replay: give exactly one of a layer index or a tensor name")
    n_layers = bundle.manifest["model"]["config"]["num_hidden_layers"]
    if layer is not None and not 0 <= layer < n_layers:
        raise InputError(f"replay: layer {layer} is outside 0..{n_layers - 1}")
    steps = range(bundle.steps) if step is None else [step]
    if step is not None and not 0 <= step < bundle.steps:
        raise InputError(f"replay: step {step} is outside 0..{bundle.steps - 1}")
    rows = []
    for k in steps:
        names = layer_tensors(bundle, k, layer) if layer is not None else \
            [(r, tensor) for r in ("tap", "output") if tensor in bundle.manifest["steps"][k][r + "s"]]
        if tensor is not None and not names:
            raise InputError(f"replay: step {k} has no tap or output named {tensor!r}")
        dumped = [(r, n) for r, n in names if _device(bundle, dump, k, r, n, policy) is not None]
        if not dumped:
            continue
        keep = {n for _, n in names}
        ref, forced = run_step(bundle, dump, model, k, keep, policy)
        lacking = [n for n in bundle.manifest["steps"][k]["inputs"]
                   if _device(bundle, dump, k, "input", n, policy) is None]
        step_inputs = set(bundle.manifest["steps"][k]["inputs"])
        for role, n in dumped:
            rec = bundle.manifest["tensors"][f"{k}/{role}/{n}"]
            g, d = bundle.tensor(k, role, n), _device(bundle, dump, k, role, n, policy)
            r = np.asarray(ref[n])
            total, inherited, added = (tensor_metrics(a, b, rec["valid"], policy.dtype)
                                       for a, b in ((g, d), (g, r), (r, d)))
            integer = is_integer(g.dtype)
            failures = judge(added, None, policy.criteria(n, integer))
            unforced = sorted(_unforced(cfg, bundle.manifest.get("convention"), n, keep, forced, step_inputs,
                                        ref, {}))
            rows.append(ReplayRow(k, n, total, inherited, added, bool(failures) and not unforced, failures, lacking,
                                  unforced))
    return rows


def _unforced(cfg, conv, name: str, keep: set, forced: set, step_inputs: set, existing, memo: dict) -> set:
    """Inputs of `name`, directly or through other replayed tensors, that were neither forced to the device's
    value nor replayed: the reference computed them from golden values."""
    if name in memo:
        return memo[name]
    memo[name] = set()
    node = producer(cfg, name, conv)
    out = set()
    for d in (node.inputs if node else ()):
        if d in keep:
            out |= _unforced(cfg, conv, d, keep, forced, step_inputs, existing, memo)
        elif d in existing and d not in forced and d not in step_inputs:
            out.add(d)
    memo[name] = out
    return out
