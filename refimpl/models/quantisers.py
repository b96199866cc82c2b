"""AIMET activation quantisers, placed where AIMET puts them (docs/numerics.md).

AIMET's QuantSim wraps nn.Modules of a transformers model; each wrapped module has input quantisers (one per
argument) and output quantisers. refimpl's blocks declare the same modules beside their code
(the graph's `module=k` nodes, refimpl.graph.modules): module -> the taps that are its inputs. So an activation
encoding of module M is placed:

    legacy  {M: {"output": {0: enc}}}   at M's output tap (named M; the router mlp.gate's: mlp.router_logits),
                                        before it is recorded
            {M: {"input":  {i: enc}}}   on M's i-th input as M consumes it (q_proj's input quantiser acts on
                                        input_layernorm's output as q_proj reads it, not as k_proj does)
    1.0.0   {"name": M}                 M's output; AIMET's ONNX tensor name of a module output,
                                        "/model/layers.0/self_attn/q_proj/MatMul_output_0", too

Anything else (a module refimpl does not have, an input index it does not take, a tensor inside a module) cannot
be placed: it is listed (`unplaced`), warned about, recorded in the manifest, and an error with strict=True.

A quantised device graph (aimet-onnx, a QDQ model: refimpl/models/onnx_placement.py) has quantisers on nearly every
tensor; those sit at any declared node's output (`output(node, y)`, node outputs that are no module's too) or at a
sub-op point of its kernel's equation (`at(node)`: the hook a kernel takes, kernels/activation.Unhooked), several in
a row where the device re-quantises a tensor it only moves (a chain of encodings, applied in order).
"""

import re
import warnings

import numpy as np

from ..encodings import ActivationEntry, Encoding, model_name
from ..errors import InputError
from ..kernels.activation import identity, unhooked

_ONNX_OUTPUT = re.compile(r"^/(?P<path>.+)/[A-Za-z0-9_]+_output_(?P<index>\d+)$")


class EncodingsWarning(UserWarning):
    """An encodings file names tensors refimpl cannot place; they are listed and left float."""


def _chain(enc) -> tuple:
    return enc if isinstance(enc, tuple) else (enc,)


class Quantisers:
    """The activation quantisers of one model: `input(module, x, i)` and `output(node, y)` return the value as
    the quantised device holds it (x itself where no encoding is placed); `at(node)` is the hook of node's kernel
    (its sub-op points). After each quantiser the value is cast to the activation dtype (`rnd`): QuantSim on a
    reduced-precision model quantises in float32 and returns the tensor's own dtype. An encoding may be a tuple of
    encodings, applied in order. record: None, or a dict that receives {node (its tap name) or node/point, or
    "module:input.i": the value its first quantiser received} (the device's float tensor before quantisation)."""

    def __init__(self, inputs: dict | None = None, outputs: dict | None = None, unplaced=(), rnd=identity,
                 taps: dict | None = None, points: dict | None = None, placement=None, forms: dict | None = None):
        self.inputs: dict[tuple[str, int], Encoding] = inputs or {}
        self.outputs: dict[str, Encoding | tuple] = outputs or {}
        self.points: dict[str, dict[str, Encoding | tuple]] = points or {}   # node -> {point: encoding(s)}
        self.taps: dict[str, str] = taps or {}   # module -> its output's tap, where that is not the module's name
        self.unplaced: list[str] = list(unplaced)
        self.placement = placement               # an ONNX graph's placement (onnx_placement.Placement), if any
        self.record: dict | None = None
        self._rnd = rnd
        forms = forms or {}                      # "node/point" -> the op of the form the device computes it in
        self.hooks = {node: Hook(self, node, encs, {p: forms[f"{node}/{p}" if p else node] for p in (*encs, "")
                                                    if (f"{node}/{p}" if p else node) in forms})
                      for node, encs in self.points.items()}   # (point "": the node's output, its form too)

    def __bool__(self) -> bool:
        return bool(self.inputs or self.outputs or self.points)

    def quantise(self, name: str, enc, x):
        """x through the quantiser(s) enc (recorded as `name` when recording)."""
        if self.record is not None:
            self.record[name] = np.array(x, copy=True)
        for e in _chain(enc):
            x = self._rnd(e.apply(x))
        return x

    def input(self, module: str, x: np.ndarray, i: int = 0) -> np.ndarray:
        enc = self.inputs.get((module, i)) if self.inputs else None
        return x if enc is None else self.quantise(f"{module}:input.{i}", enc, x)

    def output(self, node: str, y: np.ndarray) -> np.ndarray:
        enc = self.outputs.get(node) if self.outputs else None
        return y if enc is None else self.quantise(self.taps.get(node, node), enc, y)

    def at(self, node: str):
        """The hook of node's kernel: its sub-op points' quantisers (kernels/activation.Unhooked where none)."""
        return self.hooks.get(node, unhooked) if self.hooks else unhooked

    def within(self, prefix: str):
        """A hook over a block's nodes (a kernel computing several: the MoE router): point "node" is node
        prefix.node's output, "node/p" its point p."""
        if not (self.outputs or self.hooks):
            return unhooked
        return BlockHook(self, prefix)

    def output_taps(self) -> dict[str, Encoding]:
        """{tap: Encoding} of every output-quantised tap (the last of a chain: the values the tap holds)."""
        return {self.taps.get(m, m): _chain(enc)[-1] for m, enc in self.outputs.items()}

    def describe(self, modules: dict) -> dict:
        """The manifest record: every placed quantiser (module, input i / output, the tap it acts on, encoding)
        in execution order, and what could not be placed; with an ONNX graph's placement, its quantisers per node
        and point (refimpl/models/onnx_placement.py)."""
        if self.placement is not None:
            return self.placement.describe()
        placed = []
        for module, taps in modules.items():
            for i, tap in enumerate(taps):
                if (module, i) in self.inputs:
                    placed.append({"module": module, "io": "input", "index": i, "tap": tap,
                                   **self.inputs[module, i].describe()})
            if module in self.outputs:
                placed.append({"module": module, "io": "output", "index": 0, "tap": self.taps.get(module, module),
                               **self.outputs[module].describe()})
        return {"quantisers": placed, "unplaced": list(self.unplaced)}


class BlockHook:
    """Quantisers.within(prefix): hook("node" | "node/point", value) for the nodes under prefix."""

    def __init__(self, quantisers: Quantisers, prefix: str):
        self.quantisers, self.prefix = quantisers, prefix
        cut = len(prefix) + 1
        self.points = frozenset([n[cut:] for n in quantisers.outputs if n.startswith(prefix + ".")]
                                + [f"{n[cut:]}/{p}" for n, h in quantisers.hooks.items() if n.startswith(prefix + ".")
                                   for p in h.points])

    def __call__(self, point: str, value):
        if point not in self.points:
            return value
        node, _, sub = point.partition("/")
        node = f"{self.prefix}.{node}"
        return self.quantisers.at(node)(sub, value) if sub else self.quantisers.output(node, value)


class Hook:
    """A node's sub-op quantisers as its kernel calls them: hook(point, value) -> the value quantised there (a
    constant, e.g. eps, as float32: the device's constant); `points`: where it acts; `forms`: points the device
    computes in another declared form (graph.Point.also: {point: its op}), which the kernel then computes."""

    def __init__(self, quantisers: Quantisers, node: str, encodings: dict, forms: dict | None = None):
        self.quantisers, self.node, self.encodings = quantisers, node, encodings
        self.points = frozenset(encodings)
        self.forms = forms or {}     # point -> the ONNX op of the equivalent form the device computes it in

    def __call__(self, point: str, value):
        enc = self.encodings.get(point)
        if enc is None:
            return value
        x = value if isinstance(value, np.ndarray) and value.dtype.kind == "f" else np.asarray(value, np.float32)
        return self.quantisers.quantise(f"{self.node}/{point}", enc, x)


NONE = Quantisers()


def place(entries: list[ActivationEntry], modules: dict, rnd=identity, strict: bool = False,
          source: str = "encodings", taps: dict | None = None) -> Quantisers:
    """Place a file's activation encodings at the model's declared modules (module -> input taps; taps: module -> its
    output's tap where that is not the module's name)."""
    inputs, outputs, unplaced = {}, {}, []
    for e in entries:
        module, io, index = model_name(e.name), e.io, e.index
        if io is None:  # 1.0.0: a tensor name, a module's output
            m = _ONNX_OUTPUT.match(e.name)
            if module not in modules and m:
                module, index = model_name(m["path"].replace("/", ".")), int(m["index"])
            io = "output"
        if (module not in modules or (io == "output" and index != 0)
                or (io == "input" and index >= len(modules[module]))):
            unplaced.append(e.label)
            continue
        if io == "input":
            inputs[module, index] = e.encoding
        else:
            outputs[module] = e.encoding
    if unplaced:
        message = (f"{source}: {len(unplaced)} activation encoding(s) name no module input / output refimpl has, "
                   f"e.g. {unplaced[:3]}")
        if strict:
            raise InputError(message + " (--strict-encodings)")
        warnings.warn(message + "; they stay float", EncodingsWarning, stacklevel=2)
    return Quantisers(inputs, outputs, unplaced, rnd, taps)
