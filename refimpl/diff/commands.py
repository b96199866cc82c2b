"""CLI commands of the diff tool: `refimpl diff`, `refimpl replay`, `refimpl explain`.

Exit codes: 0 every compared tensor passes, 1 a mismatch (fail, layout or unreadable tensor), 2 bad input.
"""

import dataclasses
import json
import sys

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from ..arguments import nonnegative, size
from ..bundle import read_bundle, valid_mask
from ..errors import InputError
from ..files import output_file, write_atomic
from ..metrics import DTYPE_ALIASES
from ..precision import from_manifest
from ..sources import load
from .classify import divergence_arrays
from .compare import compare
from .divergence import model_config
from .dump import read_dump, read_json, read_mapping, refuse_renamed_taps
from .explain import explain, parse
from .layouts import candidates, conv_kernel
from .policy import load_policy, make_policy
from .quantised import (
    EXCESS,
    compare_three_way,
    decode_codes,
    device_graph,
    device_names,
    print_three_way,
    tap_encodings,
)
from .replay import device_tensor, replay
from .report import fault_line, fmt, print_report, print_table, render_html, terminal
from .saved import load_metrics, rejudge, save_metrics


def add_commands(sub) -> None:
    d = sub.add_parser("diff", help="compare a device dump with a golden bundle: metrics, first divergence, report")
    d.add_argument("bundle", help="golden bundle directory")
    d.add_argument("device", nargs="?", help="device dump: qnn-net-run output dir, dir of .raw/.npy, .npz or "
                                             ".safetensors (omit with --rejudge)")
    d.add_argument("--dtype", help="device compute dtype for default thresholds and ULPs: fp32 (default), fp16, bf16")
    d.add_argument("--policy", help="JSON policy file: per-tensor criteria, declared layouts, ignored tensors")
    d.add_argument("--dump-dtype", help="dtype of raw dump files: float32 (qnn-net-run's; the default), native (the "
                                        "bundle's; the default for a dump that is itself a bundle), float16, ...")
    d.add_argument("--mapping", help="JSON {golden name: device name} for names sanitising does not explain")
    d.add_argument("--layout", action="append", default=[], metavar="[REGEX=]ADAPTER",
                   help="declare a dump layout: transposed, nhwc, aimet or hf-hooks (PyTorch module hooks), for "
                        "the tensors REGEX matches (e.g. '.=aimet', 'past_key_.*=transposed'); a bare name: all")
    d.add_argument("--emulated", help="bundle of the same case at the device's precision: three-way judging "
                                      "(device error within k x the emulation's), at the dtype its manifest records")
    d.add_argument("--k", type=float, help="k of three-way judging (default 4)")
    d.add_argument("--float", dest="float_bundle", metavar="FLOAT_BUNDLE",
                   help="quantised device: BUNDLE is the quantised golden (--encodings), FLOAT_BUNDLE the float golden "
                        "of the same case; per tensor the device's distance to BUNDLE next to quantisation's own "
                        "(docs/diff.md)")
    d.add_argument("--excess", type=float, help="with --float: the device's RMS error against the quantised golden "
                                                "allowed, as a multiple of quantisation's own (default 0.01)")
    d.add_argument("--encodings", help="the bundle's AIMET encodings file: dump files of quantised taps may hold "
                                       "integer codes (uint8 / uint16), dequantised with the tap's encoding")
    d.add_argument("--json", help="write raw metrics (re-judge later with --rejudge)")
    d.add_argument("--html", help="write the HTML report with plots")
    d.add_argument("--rejudge", metavar="METRICS_JSON", help="judge saved metrics again under --policy / --dtype / --k "
                                                          "(default: the dtype and k they were judged at)")
    d.add_argument("--top", type=nonnegative, default=20, help="rows of the terminal table (0: all)")
    d.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    d.set_defaults(func=cmd_diff)

    r = sub.add_parser("replay", help="run the reference on the device's own inputs of a layer or tensor: "
                                      "inherited vs added error")
    r.add_argument("bundle")
    r.add_argument("device")
    which = r.add_mutually_exclusive_group(required=True)
    which.add_argument("--layer", type=int, help="layer index")
    which.add_argument("--tensor", help="tap or output name")
    r.add_argument("--step", type=int, help="only this step (default: all)")
    r.add_argument("--model", help="model source (default: the bundle's)")
    r.add_argument("--dtype", help="device compute dtype for the verdict: fp32 (default), fp16, bf16")
    r.add_argument("--policy")
    r.add_argument("--json", help="write the rows (total, inherited and added metrics, verdict) as JSON")
    _reading_flags(r)
    r.set_defaults(func=cmd_replay)

    e = sub.add_parser("explain", help="one element line by line: op, formula, inputs, intermediate values")
    e.add_argument("bundle")
    e.add_argument("element", help="NAME[i,j,...], e.g. 'model.layers.3.self_attn.q_norm[0,5,2,17]'")
    e.add_argument("--step", type=int, help="step (default: the first that has the tensor)")
    e.add_argument("--model", help="model source (default: the bundle's)")
    e.add_argument("--device", help="a device dump: show its values beside the reference's")
    _reading_flags(e)
    e.add_argument("--dtype", help="with --device: the device dtype whose precision floor names the fault class "
                                   "(fp32 default, fp16, bf16)")
    e.set_defaults(func=cmd_explain, policy=None)


def _reading_flags(p) -> None:
    """How a dump is read (as `refimpl diff` reads it), and the model's encodings file if the bundle used one."""
    p.add_argument("--encodings", help="the AIMET / QNN encodings file of a bundle made with --weights encodings")
    p.add_argument("--onnx", help="the ONNX model an aimet-onnx encodings file names (a bundle made with --onnx)")
    p.add_argument("--dump-dtype", help="dtype of raw dump files (default float32; native for a bundle)")
    p.add_argument("--mapping", help="JSON {golden name: device name}")
    p.add_argument("--layout", action="append", default=[], metavar="[REGEX=]ADAPTER", help="declared dump layout")
    p.add_argument("--max-resident", type=size, metavar="SIZE", help="most converted weights held at once "
                                                                     "(as for refimpl golden)")


def _policy(args):
    policy = load_policy(args.policy, args.dtype)
    for item in args.layout:
        pattern, sep, adapter = item.rpartition("=")
        pattern = pattern if sep else "."  # a bare adapter name: every tensor
        policy.layouts.insert(0, make_policy({"layouts": {pattern: adapter}}, policy.dtype, "--layout").layouts[0])
    if getattr(args, "k", None) is not None:
        if not args.k > 0:
            raise InputError(f"--k must be positive, got {args.k}")
        policy.three_way_k = args.k
    return policy


def _dump(args, bundle):
    """The dump matched to the bundle: by --mapping, and a quantised device graph's tensor names (the bundle's
    --encodings a QDQ model or aimet-onnx encodings: its quantisers' ONNX names are its taps') by the bundle; with
    --encodings, integer code files of quantised taps dequantised (diff, replay and explain alike)."""
    mapping = read_mapping(args.mapping) if args.mapping else {}
    encodings = tap_encodings(bundle, args.encodings) if getattr(args, "encodings", None) else None
    if encodings is not None and device_graph(bundle, args.encodings):
        mapping = {**device_names(bundle, args.encodings), **mapping}
    dump = read_dump(args.device, bundle, mapping=mapping or None, dtype=args.dump_dtype)
    if encodings is not None:
        decode_codes(dump, bundle, encodings)
    return dump


def _bundle(path):
    bundle = read_bundle(path, verify=False)
    refuse_renamed_taps(bundle.manifest, path)
    return bundle


def _model(bundle, source=None, encodings=None, max_resident=None, onnx=None):
    """The bundle's model at the bundle's precision policy (its encodings file given again, if it used one)."""
    m = bundle.manifest.get("model") or {}
    if source is None and not isinstance(m.get("source"), str):
        raise InputError(f"{bundle.path}: manifest.json records no model source; give --model")
    model = load(source or m["source"], precision=from_manifest(bundle.manifest.get("precision", {}), encodings, onnx),
                 max_resident_bytes=max_resident)
    digest = model.weights.sha256()
    if digest != m.get("weights_sha256"):
        raise InputError(f"model {source or m['source']!r}: weights differ from the bundle's "
                         f"(sha256 {digest[:12]} vs {str(m.get('weights_sha256'))[:12]}); give --model")
    return model


def cmd_diff(args) -> int:
    for out in (args.json, args.html):  # check every destination before writing any (no partial outputs)
        if out and not output_file(out, "--json / --html output").resolve().parent.is_dir():
            raise InputError(f"{out}: its directory does not exist")
    rows = None  # three-way rows of a quantised device (--float)
    if args.rejudge:
        saved = load_metrics(args.rejudge)
        if args.dtype is None and args.policy is None:  # judge at the dtype it was measured for
            args.dtype = saved.policy.get("dtype")
        if getattr(args, "k", None) is None and args.policy is None:   # and at its three-way k (--float: EXCESS)
            args.k = make_policy({"three_way_k": saved.policy.get("three_way_k", 4.0)}, None,
                                 f"{args.rejudge}: policy").three_way_k
        report = rejudge(saved, _policy(args))
        first_error = None
    else:
        if args.device is None:
            raise InputError("diff: give a device dump (or --rejudge METRICS_JSON)")
        emulated = _bundle(args.emulated) if args.emulated else None
        if emulated is not None:
            args.dtype = emulated_dtype(emulated, args.dtype, args.policy)
        policy = _policy(args)
        bundle = _bundle(args.bundle)
        dump = _dump(args, bundle)
        if args.float_bundle and args.emulated:
            raise InputError("--float (a quantised device) and --emulated are two kinds of three-way diff: give one")
        if args.excess is not None and not args.float_bundle:
            raise InputError("--excess applies to --float")
        with Progress(TextColumn("comparing"), BarColumn(), MofNCompleteColumn(), transient=True,
                      disable=args.quiet or not sys.stdout.isatty()) as bar:  # a hidden bar still ends with a newline
            task = bar.add_task("", total=len(bundle.manifest["tensors"]))

            def tick(i, total):
                bar.update(task, completed=i + 1)
            if args.float_bundle:
                report, rows = compare_three_way(_bundle(args.float_bundle), bundle, dump, policy,
                                                 EXCESS if args.excess is None else args.excess, progress=tick)
            else:
                report = compare(bundle, dump, policy, emulated, progress=tick)
        first_error = _first_error(bundle, dump, report, policy)
    if rows is not None:
        print_three_way(report, rows, top=args.top)
    else:
        print_report(report, top=args.top)
    page = render_html(report, first_error, None if args.rejudge or rows is not None else
                       _fault_arrays(bundle, dump, report)) if args.html else None
    duplicates = [] if args.rejudge else dump.duplicates
    if duplicates:
        print(f"{len(duplicates)} dump files hold a tensor another file holds too (e.g. {duplicates[0]}); the file "
              f"named after it was compared")
    if args.json:
        save_metrics(report, args.json)
    if page is not None:
        write_atomic(args.html, page)
    return report.exit_code


def emulated_dtype(emulated, dtype: str | None, policy_file: str | None) -> str:
    """The device dtype three-way judging uses: the activation dtype the emulated bundle's manifest records (the
    device's precision); a --dtype or policy file that says another is refused."""
    recorded = emulated.manifest.get("precision") or {}
    want = recorded.get("activations", recorded.get("dtype", "float32"))
    want = DTYPE_ALIASES.get(want, want)
    spec = read_json(policy_file, "policy") if policy_file and dtype is None else {}
    given = dtype or (spec.get("dtype") if isinstance(spec, dict) else None)   # load_policy checks the file itself
    if given is not None and DTYPE_ALIASES.get(given, given) != want:
        raise InputError(f"--emulated {emulated.path}: computed at {want} (its manifest), but the device dtype is "
                         f"given as {given}; give the emulation at the device's precision")
    return want


def _first_error(bundle, dump, report, policy):
    """device - golden over the valid region of the earliest first divergence (for the histogram)."""
    keys = [k for k in report.first_divergence.values() if k]
    if not keys:
        return None
    rec = bundle.manifest["tensors"][keys[0]]
    item = dump.items.get(keys[0])
    result = next(r for r in report.results if r.key == keys[0])
    if item is None or item.problem or item.array is None or result.metrics is None:
        return None  # unreadable: nothing to histogram
    kernel = conv_kernel(model_config((bundle.manifest.get("model") or {}).get("config")))
    cands = dict(candidates(item, rec, result.layout, kernel))
    device = cands.get(result.layout)
    if device is None:
        return None
    golden = bundle.tensor(rec["step"], rec["role"], rec["name"])
    mask = valid_mask(golden.shape, rec["valid"])
    return (device.astype(np.float64) - golden.astype(np.float64))[mask]


def _fault_arrays(bundle, dump, report):
    """(golden, device, valid mask, fault) of the earliest classified first divergence (the HTML scatter)."""
    by_key = {r.key: r for r in report.results}
    r = next((by_key[k] for _, k in sorted(report.first_divergence.items()) if k and by_key[k].fault), None)
    arrays = divergence_arrays(bundle, dump, r, conv_kernel(model_config(report.config))) if r else None
    if arrays is None:
        return None
    golden, device, _ = arrays
    return golden, device, valid_mask(golden.shape, bundle.manifest["tensors"][r.key]["valid"]), r.fault


def cmd_replay(args) -> int:
    if args.json and not output_file(args.json, "--json output").resolve().parent.is_dir():
        raise InputError(f"{args.json}: its directory does not exist")
    bundle = _bundle(args.bundle)
    policy = _policy(args)
    dump = _dump(args, bundle)
    rows = replay(bundle, dump, _model(bundle, args.model, args.encodings, args.max_resident, args.onnx),
                  layer=args.layer, tensor=args.tensor, step=args.step, policy=policy)
    if not rows:
        raise InputError("replay: the dump holds none of the replayed tensors")
    if args.json:
        write_atomic(args.json, json.dumps({"bundle": str(bundle.path), "dump": str(dump.path),
                                            "layer": args.layer, "tensor": args.tensor, "step": args.step,
                                            "policy": policy.to_dict(), "rows": [dataclasses.asdict(r) for r in rows]},
                                           indent=1, default=str))
    cells, styles = [], []
    for r in rows:
        if r.not_forced:
            verdict = "cannot separate: not dumped: " + ", ".join(r.not_forced)
        elif r.adds_error:
            verdict = "ADDS ERROR" + (f" (this op or the undumped {', '.join(x.rsplit('.', 1)[-1] for x in r.through)} "
                                      f"before it)" if r.through else "") + ": " + "; ".join(r.failures)
            verdict += f"; fault: {fault_line(r.fault)}" if r.fault else ""
        else:
            verdict = "inherited only"
        cells.append([str(r.step), r.name, *(fmt(m["sqnr_db"], "sqnr_db") for m in (r.total, r.inherited, r.added)),
                      verdict])
        styles.append("red" if r.adds_error else None)
    console = terminal()
    what = f"layer {args.layer}" if args.layer is not None else args.tensor
    print_table(console, f"replay {what}, op by op on the device's inputs: SQNR dB (total = inherited + added)",
                [("step", None, False), ("tensor", None, False), ("total", 2, False), ("inherited", None, False),
                 ("added", None, False), ("verdict", None, True)], cells, styles)
    lacking = sorted({(r.step, n) for r in rows for n in r.golden_inputs if r.step > 0})
    if lacking:
        print(f"note: {len(lacking)} graph inputs of later steps are not in the dump (e.g. step {lacking[0][0]} "
              f"{lacking[0][1]}); the replay used the golden's, so error carried in by the device's cache and "
              f"state counts as added there")
    return 1 if any(r.adds_error for r in rows) else 0


def cmd_explain(args) -> int:
    bundle = _bundle(args.bundle)
    model = _model(bundle, args.model, args.encodings, args.max_resident, args.onnx)
    device = None
    if args.device:
        name, _ = parse(args.element)
        dump = _dump(args, bundle)
        policy = _policy(args)   # declared --layout readings
        steps = [args.step] if args.step is not None else range(bundle.steps)
        for k in steps:
            for role in ("tap", "output", "input"):
                d = device_tensor(bundle, dump, k, role, name, policy)
                if d is not None:
                    device = {name: d}
                    break
            if device:
                break
    print(explain(bundle, model, args.element, step=args.step, device=device, dtype=args.dtype or "float32"))
    return 0
