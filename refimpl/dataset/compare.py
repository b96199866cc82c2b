"""The device's logits over a dataset reference's windows -> KLD, top-1 agreement, top-k overlap, perplexities.

The device gives, per window k, the logits of the window's tokens: `logits` [1, ctx, V] (or [ctx, V], or only the
scored rows [S, V] / [1, S, V] in .npy / .npz). Files are found and named as `refimpl diff` finds them
(refimpl.diff.dump): a qnn-net-run output directory (Result_<k>/logits.raw, float32 unless --dump-dtype), a
directory of <k>/logits.raw|.npy, one .npz / .safetensors with keys "<k>/logits"; device names are matched after
the toolchain's sanitising, or through a --mapping {golden name: device name} file. Windows are read one at a time.
"""

import math
from pathlib import Path

import numpy as np

from ..diff.dump import match_dump, read_json
from ..errors import FormatError, InputError, brief
from ..files import number
from . import compact, llama, stats
from .reference import Reference, top_ids

BARS = {  # --policy key -> (statistic path, direction)
    "max_mean_kld": (("kld", "mean"), "max"), "max_median_kld": (("kld", "median"), "max"),
    "max_p90_kld": (("kld", "p90"), "max"), "max_p99_kld": (("kld", "p99"), "max"),
    "max_p99.9_kld": (("kld", "p99.9"), "max"), "max_max_kld": (("kld", "max"), "max"),
    "min_top1": (("same_top", "value"), "min"), "min_topk_overlap": (("topk_overlap",), "min"),
    "max_ppl_ratio": (("ppl_ratio", "value"), "max"), "max_ln_ppl_ratio": (("ln_ppl_ratio", "value"), "max"),
    "max_delta_ppl": (("ppl_difference", "value"), "max"),
}


class _Windows:
    """A stand-in for a golden bundle with one step per window whose only tensor is the output `logits`, so the
    diff's dump reader matches device files to windows."""

    def __init__(self, ref: Reference):
        self.manifest = {
            "steps": [{"index": k, "inputs": [], "outputs": ["logits"], "taps": []} for k in range(ref.count)],
            "tensors": {f"{k}/output/logits": {"name": "logits", "step": k, "role": "output", "dtype": "float32",
                                               "shape": [1, ref.ctx, ref.vocab]} for k in range(ref.count)}}


def device_windows(ref: Reference, path, *, mapping: dict | None = None, dtype: str | None = None) -> dict:
    """{window: load()} for every window the device dump holds (load() -> array, or FormatError)."""
    matched, _ = match_dump(path, _Windows(ref), mapping=mapping, dtype=dtype)
    return {int(key.split("/")[0]): load for key, (_, load) in matched.items()}


def _rows(a: np.ndarray, ref: Reference, k: int) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim == 1 and a.size % ref.vocab == 0:        # a raw file: headerless, its rows are the window's
        a = a.reshape(-1, ref.vocab)
    while a.ndim > 2 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 2 or a.shape[1] != ref.vocab or a.shape[0] not in (ref.ctx, ref.scored):
        raise FormatError(f"device window {k}: logits of shape {list(np.shape(a))}, expected [1, {ref.ctx}, "
                          f"{ref.vocab}] (the window) or [{ref.scored}, {ref.vocab}] (its scored rows)")
    return a[ref.first:ref.first + ref.scored] if a.shape[0] == ref.ctx else a


LLAMA = ("llama_kld", "llama_nll", "llama_nll_base", "llama_p_diff", "llama_same_top")   # llama.llama_rows'


def window_metrics(ref: Reference, k: int, device: np.ndarray, top_k: int) -> dict:
    """Per scored position of window k: kld, its compact-form bound, device and reference NLL, same top,
    top-k overlap, device top token; and llama.cpp's definition of each (LLAMA: llama.llama_rows)."""
    w = ref.window(k)
    dev = _rows(device, ref, k)
    targets = ref.targets[k]
    out = {n: [] for n in ("kld", "bound", "nll", "nll_ref", "same_top", "overlap", "top1", *LLAMA)}
    for s in range(0, ref.scored, 64):
        rows = slice(s, s + 64)
        logits = dev[rows].astype(np.float64)
        finite = np.isfinite(logits).all(-1)
        with np.errstate(invalid="ignore", over="ignore"):
            lq = compact.log_softmax64(np.where(finite[:, None], logits, 0.0))
        kl, bound = compact.kld(w["codes"][rows], w["scale"][rows], w["floor"][rows], lq)
        r = np.arange(len(lq))
        dev_top = top_ids(lq, top_k)
        ref_top = w["top_ids"][rows][:, :top_k]
        out["kld"].append(np.where(finite, kl, np.inf))
        out["bound"].append(bound)
        out["nll"].append(np.where(finite, -lq[r, targets[rows]], np.inf))
        out["nll_ref"].append(np.asarray(w["nll"][rows]))
        out["same_top"].append(finite & (dev_top[:, 0] == ref_top[:, 0]))
        out["overlap"].append(np.array([len(set(a) & set(b)) / top_k for a, b in zip(dev_top, ref_top, strict=True)]))
        out["top1"].append(dev_top[:, 0])
        ll = llama.llama_rows(w["codes"][rows], w["scale"][rows], w["floor"][rows], dev[rows], targets[rows])
        for n in LLAMA:
            out[n].append(ll[n.removeprefix("llama_")])
    return {n: np.concatenate(v) for n, v in out.items()}


def compare_logits(ref: Reference, device_path, *, mapping=None, dtype=None, top_k: int | None = None,
                   worst: int = 10, progress=None) -> dict:
    """Compare the device's logits with the reference over every window; the report dict (see stats.summarise
    for the statistics; plus per-position curve, worst windows and positions, and notes)."""
    top_k = min(top_k or ref.top_k, ref.top_k)
    if ref.finished() != list(range(ref.count)):
        raise InputError(f"{ref.path}: {len(ref.finished())} of {ref.count} windows are computed; run "
                         f"`refimpl reference` again with the same arguments to finish it")
    loads = device_windows(ref, device_path, mapping=mapping, dtype=dtype)
    missing = [k for k in range(ref.count) if k not in loads]
    per, problems = {}, {}
    for i, k in enumerate(sorted(loads)):
        ref.window(k)       # a damaged reference window is an error of the reference (raised), not of the device
        try:
            per[k] = window_metrics(ref, k, loads[k](), top_k)
        except FormatError as e:
            problems[k] = str(e)
        if progress is not None:
            progress(i + 1, len(loads))
    if not per:
        raise InputError(f"{device_path}: no window could be compared ({len(problems)} unreadable, e.g. "
                         f"{next(iter(problems.values()), '')})")
    keys = sorted(per)
    cat = {n: np.concatenate([per[k][n] for k in keys]) for n in per[keys[0]]}
    report = {"reference": str(ref.path), "device": str(device_path), "model": ref.manifest["model"]["source"],
              "windows": {"compared": len(keys), "total": ref.count, "missing": missing, "unreadable": problems},
              "ctx": ref.ctx, "first": ref.first, "scored_per_window": ref.scored, "top_k": top_k,
              **stats.summarise(cat["kld"], cat["nll"], cat["nll_ref"], cat["same_top"], cat["overlap"],
                                cat["bound"])}
    report["llama_cpp"] = llama.llama_summary({n.removeprefix("llama_"): cat[n] for n in LLAMA})
    curve = np.stack([per[k]["kld"] for k in keys])                          # [windows, S]
    report["per_position"] = {"position": list(range(ref.first, ref.first + ref.scored)),
                              "mean_kld": curve.mean(0).tolist(), "max_kld": curve.max(0).tolist()}
    report["worst_windows"] = [{"window": keys[i], "mean_kld": float(curve[i].mean()),
                                "max_kld": float(curve[i].max())}
                               for i in np.argsort(-curve.mean(1), kind="stable")[:worst]]
    report["worst_positions"] = [_position(ref, keys[i // ref.scored], i % ref.scored, per)
                                 for i in np.argsort(-curve.reshape(-1), kind="stable")[:worst]]
    report["kld_values"] = cat["kld"].tolist()          # for the histogram (and re-analysis)
    report["notes"] = _notes(report)
    return report


def _position(ref: Reference, k: int, j: int, per: dict) -> dict:
    pos = ref.first + j
    ids = ref.tokens[k][:pos + 1].tolist()
    m = ref.manifest
    w = ref.window(k)
    return {"window": k, "position": pos, "kld": float(per[k]["kld"][j]), "target": int(ref.targets[k][j]),
            "reference_top1": int(w["top_ids"][j][0]), "device_top1": int(per[k]["top1"][j]),
            "nll_reference": float(per[k]["nll_ref"][j]), "nll_device": float(per[k]["nll"][j]),
            "drill_down": f"refimpl golden --model {m['model']['source']}{_golden_flags(m)} --input-ids "
                          f"{','.join(map(str, ids))} --out drill-w{k}-p{pos}"}


def _golden_flags(manifest: dict) -> str:
    """`refimpl golden` flags for the reference's precision policy and convention."""
    p, c = manifest["precision"], manifest["convention"]
    flags = [] if p.get("activations", "float32") == "float32" else [f"--precision {p['activations']}"]
    if p.get("weights") not in (None, p.get("activations")):
        flags.append(f"--weights {p['weights']}" if p["weights"] != "encodings" else
                     f"--encodings {(p.get('encodings') or {}).get('file', 'ENCODINGS.json')}")
    if p.get("kv"):
        flags.append(f"--kv {p['kv']}")
    flags.append(f"--convention {c['name']}")
    names = {"ar": "--ar", "cl": "--cl", "seq_len": "--ar", "ctx_len": "--cl"}
    flags += [f"{names[k]} {v}" for k, v in c["params"].items() if k in names]
    return " " + " ".join(flags)


def _notes(report: dict) -> list[str]:
    notes = []
    w = report["windows"]
    if w["missing"]:
        notes.append(f"{len(w['missing'])} windows are not in the device dump (e.g. {w['missing'][:5]}); "
                     f"statistics cover the {w['compared']} compared")
    if w["unreadable"]:
        notes.append(f"{len(w['unreadable'])} device windows are unreadable: {next(iter(w['unreadable'].values()))}")
    if not math.isfinite(report["kld"]["max"]):
        notes.append("the device's logits hold non-finite values (or give the reference's tokens probability 0): "
                     "those positions count as infinite KLD")
    return notes


def parse_policy(text: str) -> dict:
    """--policy: a JSON file {bar: value} or inline 'max_mean_kld=0.01,min_top1=0.9'."""
    if Path(text).is_file():
        bars = read_json(text, "policy")
        if not isinstance(bars, dict):
            raise InputError(f"{text}: policy must be a JSON object {{bar: value}}")
    else:
        bars = {}
        for item in filter(None, text.split(",")):
            key, sep, value = item.partition("=")
            if not sep:
                raise InputError(f"--policy: expected BAR=VALUE or a JSON file, got {item!r}")
            try:
                bars[key.strip()] = float(value)
            except ValueError:
                raise InputError(f"--policy {key}: {brief(value)} is not a number") from None
    for key, value in bars.items():
        if key not in BARS:
            raise InputError(f"--policy: unknown bar {brief(key)}; bars: {', '.join(BARS)}")
        number(value, f"--policy {key}", InputError)
    return bars


def judge(report: dict, bars: dict) -> list[str]:
    """The bars the report misses, one line each."""
    failures = []
    for key, limit in bars.items():
        path, direction = BARS[key]
        value = report
        for p in path:
            value = value[p]
        if not (value <= limit if direction == "max" else value >= limit):
            failures.append(f"{key}: {value:.6g} {'>' if direction == 'max' else '<'} {limit:g}")
    return failures
