"""Teacher-forced replay: run the reference on the device's own dumped tensors and split each tensor's error into
the part it inherited and the part its op added (device_conventions.md §11, §13.1).

    rows = replay(bundle, dump, model, layer=3)          # every dumped tensor of layer 3, every step
    rows = replay(bundle, dump, model, tensor="model.layers.3.linear_attn.conv1d", step=0)

Op by op: each step runs once on the device's graph inputs (where the dump holds them, else the bundle's) with
every dumped tap forced to the device's value (refimpl.trace overrides). A trace records each tap's own value
before the override, so the reference's value R of a tensor is its op applied to the device's inputs of that op:
"the right answer given what the device fed this op". With golden G and device D:

    total     = metrics(G, D)      what the diff reports
    inherited = metrics(G, R)      how far the device's inputs alone move the tensor
    added     = metrics(R, D)      the error this op itself adds (scored where R is finite)

The faulty op fails `added`; every op downstream of it, inside its layer or after, shows a large `inherited` and a
passing `added`. Where an op's inputs were not dumped, the reference computes them from the nearest dumped
tensors: the row's `through` lists those ops, and an added error belongs to the op or to one of them. When that
span leaves the tensor's layer (e.g. a bundle recorded with a --taps filter, a dump of a few tensors), the two
cannot be separated: `not_forced` lists the nearest undumped tensors outside the layer and the row claims nothing.
Give the dump the inputs the host fed the device (steps/<k>/inputs/<name>): without them a later step replays on
the golden's KV and state inputs, and the error the device's own cache carried in counts as added (each row lists
the inputs it had to take from the golden).
"""

import dataclasses

import numpy as np

from ..bundle import DTYPES, valid_mask
from ..errors import InputError
from ..golden import manifest_config, run_graph
from ..trace import trace
from .channels import channel_scores, gain_tested, sample_axes
from .classify import classify, judged_floor
from .compare import is_integer
from .dataflow import producer
from .layouts import candidates, conv_kernel
from .metrics import tensor_metrics
from .policy import Policy, judge


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
    not_forced: list = dataclasses.field(default_factory=list)     # undumped inputs outside the layer: added and
                                                                   # inherited cannot be separated
    through: list = dataclasses.field(default_factory=list)        # undumped ops of the layer the reference ran
                                                                   # between the forced inputs and this tensor
    fault: dict | None = None                                      # the kind of fault the added error shows


def device_tensor(bundle, dump, step: int, role: str, name: str, policy: Policy):
    """The device's tensor in the golden layout (declared layout, else as is or as hooked), or None if not usable."""
    item = dump.items.get(f"{step}/{role}/{name}")
    if item is None or item.problem:
        return None
    rec = bundle.manifest["tensors"][item.key]
    cands = candidates(item, rec, policy.layout(name), conv_kernel(manifest_config(bundle.manifest)))
    return cands[0][1] if cands else None


def run_step(bundle, dump, model, step: int, policy: Policy):
    """The reference's taps and outputs for `step`, each op on the device's inputs: the graph inputs and every
    dumped tap forced to the device's values (a tap's recorded value is computed before its override).
    Returns (values by name, names of the forced taps)."""
    s = bundle.manifest["steps"][step]
    inputs = {}
    for n in s["inputs"]:
        d = device_tensor(bundle, dump, step, "input", n, policy)
        golden = bundle.tensor(step, "input", n)
        inputs[n] = golden.copy() if d is None else np.asarray(d).astype(golden.dtype)
    overrides = {}
    experts = getattr(manifest_config(bundle.manifest), "num_experts", None) or 2 ** 31
    for n in s["taps"]:
        d = device_tensor(bundle, dump, step, "tap", n, policy)
        if d is not None:
            d = np.array(d, dtype=DTYPES[bundle.manifest["tensors"][f"{step}/tap/{n}"]["dtype"]])
            bound = experts if n.endswith("experts") else 2 ** 31
            if is_integer(d.dtype) and d.size and (d.min() < 0 or d.max() >= bound):
                continue   # ids no table holds (a device's garbage): not forced, the row shows the op adding error
            overrides[n] = d
    with trace(".", overrides=overrides) as tr:
        outputs = run_graph(model, bundle.manifest, inputs)
    return {**{n: tr[n] for n in tr.names()}, **outputs}, set(overrides)


def layer_tensors(bundle, step: int, layer: int) -> list[tuple[str, str]]:
    """(role, name) of step's taps inside layer `layer` and the graph outputs it writes (KV, states)."""
    cfg = manifest_config(bundle.manifest)
    s = bundle.manifest["steps"][step]
    out = [("tap", n) for n in s["taps"] if n == f"model.layers.{layer}" or n.startswith(f"model.layers.{layer}.")]
    for n in s["outputs"]:
        node = producer(cfg, n)
        if node is not None and node.layer == layer:
            out.append(("output", n))
    return out


def replay(bundle, dump, model, *, layer: int | None = None, tensor: str | None = None, step: int | None = None,
           policy: Policy | None = None) -> list[ReplayRow]:
    """Replay one layer's or one tensor's ops on the device's inputs (see the module docstring); every step
    unless `step` is given. Rows only for tensors the dump holds."""
    policy = policy or Policy()
    cfg = manifest_config(bundle.manifest)
    conv = bundle.manifest.get("convention")
    if (layer is None) == (tensor is None):
        raise InputError("replay: give exactly one of a layer index or a tensor name")
    n_layers = cfg.num_hidden_layers
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
        dumped = [(r, n) for r, n in names if device_tensor(bundle, dump, k, r, n, policy) is not None]
        if not dumped:
            continue
        ref, forced = run_step(bundle, dump, model, k, policy)
        lacking = [n for n in bundle.manifest["steps"][k]["inputs"]
                   if device_tensor(bundle, dump, k, "input", n, policy) is None]
        given = forced | set(bundle.manifest["steps"][k]["inputs"])
        for role, n in dumped:
            rec = bundle.manifest["tensors"][f"{k}/{role}/{n}"]
            g, d = bundle.tensor(k, role, n), device_tensor(bundle, dump, k, role, n, policy)
            r = np.asarray(ref[n])
            total, inherited = (tensor_metrics(a, b, rec["valid"], policy.dtype) for a, b in ((g, d), (g, r)))
            # where the op's reference value is itself NaN / Inf (fed one), the device's value there adds nothing
            scored = valid_mask(r.shape, rec["valid"]) & np.isfinite(r)
            added = tensor_metrics(r, d, scored, policy.dtype)
            axes = sample_axes(rec) if not is_integer(g.dtype) else None
            if axes is not None:   # the op's worst channel too (refimpl.diff.channels): a wrong per-channel scale
                added["channels"] = channel_scores(r, d, scored, axes, gain=gain_tested(n))
            failures = judge(added, None, policy.criteria(n, is_integer(g.dtype)))
            through, outside = span(cfg, conv, n, given, ref)
            rows.append(ReplayRow(k, n, total, inherited, added, bool(failures) and not outside, failures, lacking,
                                  outside, through))
            if rows[-1].adds_error and not is_integer(g.dtype):   # the op's own fault: its output against R
                rows[-1].fault = classify(r, d, valid_mask(r.shape, rec["valid"]) & np.isfinite(r), policy.dtype,
                                          floor=judged_floor(added, policy.criteria(n, False))).to_dict()
    return rows


def span(cfg, conv, name: str, given: set, computed) -> tuple[list, list]:
    """The undumped ops between `name` and the forced tensors it reads: (those inside its layer, in graph order
    of discovery; the nearest ones outside it). `given`: forced taps and graph inputs; `computed`: every value
    the reference produced this step (names absent from it do not exist in this convention)."""
    node = producer(cfg, name, conv)
    layer = node.layer if node else None
    inside, outside, seen = [], [], set()
    todo = list(node.inputs if node else ())
    while todo:
        dep = todo.pop(0)
        if dep in seen or dep.startswith("prev:") or dep in given or dep not in computed:
            continue
        seen.add(dep)
        up = producer(cfg, dep, conv)
        if up is None or layer is None or up.layer != layer:
            outside.append(dep)
            continue
        inside.append(dep)
        todo += up.inputs
    return inside, sorted(outside)
