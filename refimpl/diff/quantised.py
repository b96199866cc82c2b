"""Diffing a quantised device: integer dumps, and the three-way diff (docs/diff.md §2.1).

    encs = tap_encodings(quantised_bundle)                      # {tap: Encoding} of its output-quantised taps
    decode_codes(dump, quantised_bundle, encs)                  # integer code files -> dequantised float32
    report, rows = compare_three_way(float_bundle, quantised_bundle, dump)

Three-way: F is the float golden, Q the quantised golden of the same case (`refimpl golden --encodings`: the
device's encodings applied where AIMET's QuantSim applies them), D the device dump. Per tensor:

    quantisation   distance(Q, F)    what the encodings themselves do to the tensor
    device         distance(D, Q)    what the device does beyond its encodings
    excess         RMS(D - Q) / RMS(Q - F)

A tensor is explained by quantisation when excess <= k (NMSE(D, Q) <= k^2 NMSE(Q, F), never below the float32
bar); above it the device departs from its own encodings by more than k times what quantisation moved the tensor.
The first tensor with significant excess whose inputs have none is the first divergence (the layer DAG of
refimpl.diff.dataflow, as `refimpl diff` localises). Quantised taps also get code metrics: the share of the
device's codes equal to Q's, and the largest code distance (a device that computes its ops in another float order
differs by one code at ~0.1 % of the elements of a 16-bit tensor; docs/numerics.md). A tap dumped as integer codes
also carries its code shift in its metrics (refimpl.diff.metrics.code_shift), which the policy's code_shift
criterion judges (on by default here: most codes shifted alike is a zero point that is not the encoding's) and
the fault classifier names an offset, in compare's own judging, so `refimpl diff --rejudge` reproduces both.

The machinery is refimpl.diff.compare's three-way judging with the roles of the bundles as above (Q is the golden
the device is scored against, F the reference whose distance sets the bar); steps where F decoded other tokens than
Q are not the same computation and are judged by the plain bar (a note says so).
"""

import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from ..bundle import valid_mask
from ..encodings import Encoding, read_activation_encodings
from ..errors import InputError
from ..files import sha256_file
from ..golden import manifest_config
from ..graph import module_taps, modules
from ..models.model import graph
from ..models.quantisers import place
from .compare import compare
from .divergence import model_config
from .layouts import candidates, conv_kernel
from .policy import Policy, make_policy

EXCESS = 0.01  # k: measured (docs/diff.md): QuantSim itself stays below 1e-3 of its own quantisation error


def tap_encodings(bundle, encodings=None) -> dict:
    """{tap name: Encoding} of the bundle's output-quantised taps: from its manifest's record, or, given an
    encodings file, placed from that file for the bundle's model (its sha256 must match the bundle's, if it
    recorded one). A device graph's encodings (a QDQ .onnx model, aimet-onnx encodings of an ONNX model: the bundle
    placed them on its graph when it was written) are the record's, once the file is the bundle's."""
    record = bundle.manifest.get("quantisation") or {}
    if encodings is None:
        return {q["tap"]: Encoding.from_record(q) for q in record.get("quantisers", []) if q["io"] == "output"}
    want = (record.get("encodings") or {}).get("sha256")
    got = sha256_file(encodings, "encodings file", InputError)[0]
    if want is not None and got != want:
        raise InputError(f"{encodings}: sha256 {got[:12]} differs from the bundle's encodings ({want[:12]})")
    if device_graph(bundle, encodings):
        if want is None:
            raise InputError(f"{encodings}: a device graph's encodings, but {bundle.path} was not written with them "
                             f"(refimpl golden --encodings {Path(encodings).name})")
        return tap_encodings(bundle)
    cfg = manifest_config(bundle.manifest)
    nodes = graph(cfg)
    placed = place(read_activation_encodings(encodings), modules(nodes), source=str(encodings),
                   taps=module_taps(nodes))
    return placed.output_taps()


def device_graph(bundle, encodings) -> bool:
    """The encodings file is a quantised device graph's: a QDQ .onnx model, or the bundle recorded the ONNX model
    its aimet-onnx encodings name (precision.Policy.device_graph)."""
    recorded = (bundle.manifest.get("precision") or {}).get("encodings") or {}
    return str(encodings).endswith(".onnx") or "onnx" in recorded


def device_names(bundle, encodings) -> dict:
    """{device name: golden tap name} of a dump of the device graph whose encodings the bundle was written with:
    each tap a quantiser of that graph sits on (the record's "onnx" tensors; the last one's values are the
    tap's), by its ONNX tensor name and, for a QDQ model, by its QuantizeLinear's output (the codes) and its
    DequantizeLinears' outputs (refimpl.formats.qdq.qdq_names). Names that are a bundle tensor's own (a graph
    output a quantiser writes) keep their meaning. The mapping `refimpl diff --encodings` reads a dump by, so a
    dump named as the device graph names its tensors needs no mapping file."""
    record = bundle.manifest.get("quantisation") or {}
    own = {n for s in bundle.manifest.get("steps", []) for role in ("inputs", "outputs", "taps") for n in s[role]}
    tensor_tap = {}
    for q in record.get("quantisers", []):
        if q["io"] == "output" and q.get("onnx"):
            tensor_tap[q["onnx"][-1]] = q["tap"]
    aliases = {}
    if str(encodings).endswith(".onnx"):
        from ..formats.qdq import qdq_names
        aliases = qdq_names(encodings)
    out = dict(tensor_tap)
    out.update({alias: tensor_tap[t] for alias, t in aliases.items() if t in tensor_tap})
    return {name: tap for name, tap in out.items() if name not in own}


def decode_codes(dump, bundle, encodings: dict) -> list[str]:
    """Dump items of quantised taps that hold integer codes (a .raw file of the codes' size, or an integer array)
    become dequantised float32 values, x = (q + offset) * scale; the codes stay on the item (`codes`).
    Returns the keys decoded."""
    decoded = []
    for key, item in dump.items.items():
        rec = bundle.manifest["tensors"][key]
        enc = encodings.get(rec["name"])
        if enc is None or enc.float_dtype is not None:
            continue
        n = math.prod(rec["shape"])
        codes = None
        if item.array is not None and np.issubdtype(item.array.dtype, np.integer):
            codes = item.array
        elif item.problem and Path(item.source).is_file() and Path(item.source).suffix == ".raw":
            data = Path(item.source).read_bytes()
            if len(data) == n * enc.code_dtype.itemsize:
                codes = np.frombuffer(data, enc.code_dtype.newbyteorder("<"))
        if codes is None:
            continue
        lo, hi = enc.qrange
        if codes.size and (codes.min() < lo or codes.max() > hi):
            item.array, item.problem = None, (f"{item.source}: integer codes outside [{lo}, {hi}] of the tap's "
                                              f"{enc.bitwidth}-bit encoding")
            continue
        if codes.ndim <= 1 or (enc.axis is not None and codes.shape != tuple(rec["shape"])):
            codes = codes.reshape(rec["shape"])  # a raw file's codes (or a per-axis grid): the bundle's shape
        item.codes = codes.astype(np.int64)     # an array's own shape: the device's layout, read as its floats are
        item.array, item.problem = enc.dequantize(codes), None
        decoded.append(key)
    return decoded


@dataclasses.dataclass
class Row:
    key: str
    step: int
    name: str
    status: str
    quantisation_sqnr_db: float | None   # SQNR of Q against F
    device_sqnr_db: float | None         # SQNR of D against Q
    excess: float | None                 # RMS(D - Q) / RMS(Q - F)
    codes_identical: float | None = None
    codes_max_step: int | None = None

    @property
    def verdict(self) -> str:
        if self.status in ("error", "missing"):
            return self.status
        if self.excess is None:
            return "no float reference" if self.status == "pass" else "fails"
        return "explained by quantisation" if self.status == "pass" else "EXCESS beyond quantisation"


def compare_three_way(float_bundle, quantised_bundle, dump, policy: Policy | None = None, excess: float = EXCESS,
                      encodings: dict | None = None, progress=None):
    """(report, rows): refimpl.diff.compare's report of D against Q with the bar set by F, and one Row per
    compared tensor in execution order. encodings: {tap: Encoding} for the code metrics (default: Q's record)."""
    if not excess > 0:
        raise InputError(f"excess bar must be positive, got {excess}")
    policy = make_policy(policy.to_dict() if policy is not None else None)
    policy.three_way_k = excess
    policy.ignore.append(r"\.codes$")        # Q's own code taps: the codes are scored on their tap
    encodings = tap_encodings(quantised_bundle) if encodings is None else encodings
    report = compare(quantised_bundle, dump, policy, float_bundle, progress, encodings)   # code shifts judged there
    rows = []
    for r in report.results:
        m, ref = r.metrics or {}, r.reference or {}
        ratio = None
        if m and ref and ref.get("nmse") is not None and m.get("nmse") is not None:
            ratio = math.sqrt(m["nmse"] / ref["nmse"]) if ref["nmse"] > 0 else (0.0 if m["nmse"] == 0 else math.inf)
        row = Row(r.key, r.step, r.name, r.status, ref.get("sqnr_db"), m.get("sqnr_db"), ratio)
        enc = encodings.get(r.name)
        codes = _code_arrays(quantised_bundle, dump.items[r.key], r, enc) if (
            enc is not None and enc.float_dtype is None and r.metrics is not None) else None
        if codes is not None:
            want, have = codes
            step = np.abs(want - have)
            row.codes_identical, row.codes_max_step = float((step == 0).mean()), int(step.max())
        rows.append(row)
    report.notes.append(f"three-way: {quantised_bundle.path} (quantised golden) against {float_bundle.path} "
                        f"(float golden); excess bar k = {excess:g}")
    return report, rows


def _code_arrays(bundle, item, result, enc: Encoding):
    """(Q's codes, the device's codes) over the tensor's valid region, int64, in the golden's layout; None when the
    device's tensor is not read in a layout."""
    rec = bundle.manifest["tensors"][result.key]
    golden = bundle.tensor(rec["step"], rec["role"], rec["name"])
    mask = valid_mask(golden.shape, rec["valid"])
    want = enc.codes(golden)[mask].astype(np.int64)
    have = getattr(item, "codes", None)
    if have is not None and result.layout is None and have.size == golden.size:
        have = have.reshape(golden.shape)[mask]
    else:   # the device's floats (or its dequantised codes) in the layout the diff read them in: their codes
        device = dict(candidates(item, rec, result.layout, conv_kernel(model_config(
            (bundle.manifest.get("model") or {}).get("config"))))).get(result.layout)
        if device is None:
            return None
        have = enc.codes(np.nan_to_num(device.astype(np.float32)))[mask]
    if want.size == 0:
        return None
    return want, have.astype(np.int64)


def print_three_way(report, rows, console=None, top: int = 20) -> None:
    """Worst excess first: per tensor the quantisation's SQNR next to the device's, their RMS ratio, codes."""
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    first = set(report.first_divergence.values())
    t = Table(title=f"refimpl diff (three-way): {report.dump} vs {report.bundle}")
    for col in ("step", "tensor", "quantisation SQNR dB (Q vs F)", "device SQNR dB (D vs Q)", "excess RMS ratio",
                "codes identical", "max code step", "verdict"):
        t.add_column(col, overflow="fold")
    order = sorted(rows, key=lambda r: (r.key not in first, r.status == "pass",
                                        -(r.excess if r.excess is not None and math.isfinite(r.excess) else 1e9)))
    for r in order[:top] if top else order:
        style = "bold red" if r.key in first else ("red" if r.status != "pass" else None)
        t.add_row(str(r.step), ("* " if r.key in first else "") + r.name, _db(r.quantisation_sqnr_db),
                  _db(r.device_sqnr_db), "" if r.excess is None else f"{r.excess:.3g}",
                  "" if r.codes_identical is None else f"{100 * r.codes_identical:.2f}%",
                  "" if r.codes_max_step is None else str(r.codes_max_step), r.verdict, style=style)
    console.print(t)
    explained = sum(r.verdict == "explained by quantisation" for r in rows)
    console.print(f"{len(rows)} tensors: {explained} explained by quantisation, "
                  f"{sum(r.verdict.startswith('EXCESS') for r in rows)} with excess beyond it")
    by_key = {r.key: r for r in rows}
    for k, key in report.first_divergence.items():
        if key:
            r = by_key[key]
            console.print(f"[bold red]first excess beyond quantisation, step {k}:[/] {r.name}: device SQNR "
                          f"{_db(r.device_sqnr_db)} dB against the quantised golden, quantisation itself "
                          f"{_db(r.quantisation_sqnr_db)} dB (excess "
                          f"{'none: ' + r.status if r.excess is None else _ratio(r.excess)})")
    for note in report.notes:
        console.print(f"note: {note}")


def _ratio(v) -> str:
    return "n/a" if v is None else f"{v:.3g}"


def _db(v) -> str:
    if v is None:
        return ""
    return "inf" if math.isinf(v) else f"{v:.1f}"
