"""A dataset reference directory: the reference's compact log-softmax and NLL of every scored position of
every window, written window by window so that a run can stop anywhere and resume (docs/dataset.md).

    REF/manifest.json                 model (source, config, weights sha256), precision, convention, windows, form
    REF/tokens.safetensors            tokens [n, ctx] int32, targets [n, S] int32, documents [n, 2] int64
    REF/windows/<k:06d>.safetensors   codes uint16 [S, V], scale / floor float32 [S], nll float64 [S],
                                      top_ids int32 [S, K], top_logprobs float64 [S, K]
    REF/summary.json                  written last: the reference perplexity, counts and sizes

Every file is written to a temporary name and renamed into place, so a file that exists is complete; a window
whose file exists is never computed again. manifest.json and tokens.safetensors are written before any window,
and a resumed run must have the same manifest (same model bytes, precision, convention, data and windows). The
files hold nothing that depends on the run (no times, no worker count): an interrupted and resumed run ends
with the same bytes as an uninterrupted one, and so does any split of the windows over workers or machines (float32
references are correctly rounded: docs/numerics.md).

Windows run as independent tasks: in this process (workers=1), in N local processes, or as Ray actors (one model
load per actor, the model read from a path every node sees).
"""

import dataclasses
import json
import math
import multiprocessing
import os
import signal
from pathlib import Path

import numpy as np

from ..diff.dump import read_json
from ..errors import FormatError, InputError, RefimplError
from ..files import discard, sweep, write_atomic
from ..formats.safetensors import read_safetensors, write_safetensors
from ..golden import run_convention
from ..sources import load
from ..version import __version__
from . import compact
from .windows import Windows

FORMAT = "refimpl-dataset-reference"
VERSION = 1
ROW_CHUNK = 32          # scored rows encoded at a time (bounds the float64 temporaries: ROW_CHUNK x V x 8 bytes)


@dataclasses.dataclass(frozen=True)
class Job:
    """What a worker needs to compute any window: picklable, sent once per worker."""
    source: str
    precision: object             # refimpl.precision.Policy
    convention: str = "hf"
    params: tuple = ()            # convention options as sorted (name, value) pairs
    first: int = 0
    scored: int = 0
    top_k: int = 10


_MODELS = {}                      # per process: Job -> loaded model (one load per worker)


def _model(job: Job):
    if job not in _MODELS:
        _MODELS.clear()
        _MODELS[job] = load(job.source, precision=job.precision)
    return _MODELS[job]


def window_logits(model, tokens: np.ndarray, convention: str = "hf", params: dict | None = None) -> np.ndarray:
    """The reference logits [ctx, V] of one window through a device convention: the valid logits rows of each
    of its prompt calls, in order (hf: one call; genie / qeff: AR-token chunks, padded rows dropped)."""
    calls, _ = run_convention(model, np.asarray(tokens, dtype=np.int64), convention, params or {})
    rows = []
    for c in calls:
        logits = c.outputs["logits"][0]
        box = c.valid.get("logits")
        rows.append(logits[box[0][1][0]:box[0][1][1]] if box else logits)
    out = np.concatenate(rows)
    if out.shape[0] != len(tokens):
        raise InputError(f"convention {convention}: {out.shape[0]} logits rows for a window of {len(tokens)} tokens")
    return out


def top_ids(logp: np.ndarray, k: int) -> np.ndarray:
    """[S, V] -> [S, k] ids of the k largest entries per row, largest first, ties to the lower id."""
    k = min(k, logp.shape[-1])
    kth = -np.partition(-logp, k - 1, axis=-1)[:, k - 1:k]                   # the k-th largest value per row
    out = np.empty((logp.shape[0], k), np.int32)
    for r in range(logp.shape[0]):
        cand = np.flatnonzero(logp[r] >= kth[r])
        out[r] = cand[np.lexsort((cand, -logp[r, cand]))][:k]
    return out


def compute_window(job: Job, tokens: np.ndarray, targets: np.ndarray) -> dict:
    """One window's stored arrays (see the module docstring)."""
    model = _model(job)
    logits = window_logits(model, tokens, job.convention, dict(job.params))[job.first:job.first + job.scored]
    parts = []
    for s in range(0, job.scored, ROW_CHUNK):
        logp = compact.log_softmax(logits[s:s + ROW_CHUNK])
        codes, scale, floor = compact.encode(logp)
        top = top_ids(logp, job.top_k)
        rows = np.arange(logp.shape[0])
        parts.append({"codes": codes, "scale": scale, "floor": floor,
                      "nll": -logp[rows, targets[s:s + ROW_CHUNK]],
                      "top_ids": top, "top_logprobs": np.take_along_axis(logp, top, -1)})
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


# ------------------------------------------------------------------------------------------------ executors

def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the driver handles Ctrl-C and stops the workers


def _pool_task(args):
    job, k, tokens, targets = args
    return k, compute_window(job, tokens, targets)


def _serial(job, items):
    for k, tokens, targets in items:
        yield k, compute_window(job, tokens, targets)


def _processes(job, items, workers: int):
    pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_ignore_sigint)
    try:
        yield from pool.imap_unordered(_pool_task, [(job, k, t, g) for k, t, g in items], chunksize=1)
        pool.close()
    finally:
        pool.terminate()
        pool.join()


class _Actor:
    """A Ray actor: loads the model once, then computes windows."""

    def __init__(self, job):
        self.job = job
        _model(job)

    def compute(self, k, tokens, targets):
        return k, compute_window(self.job, tokens, targets)


def _ray(job, items, workers: int | None, address: str | None):
    try:
        import ray  # lazy: optional, the [scale] extra
    except ImportError:
        raise InputError("--ray needs Ray: pip install 'refimpl[scale]'") from None
    started = not ray.is_initialized()
    if started:
        joining = address or os.environ.get("RAY_ADDRESS")   # an existing cluster brings its own CPUs
        try:
            ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
                     **({} if joining else {"num_cpus": workers}))
        except (ValueError, ConnectionError, RuntimeError) as e:   # a malformed or unreachable address
            raise InputError(f"--ray {address or joining}: cannot start or join Ray ({e})") from None
    actors = []
    try:
        n = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        actors = [ray.remote(num_cpus=1)(_Actor).remote(job) for _ in range(n)]
        pending, items = {}, list(items)
        nxt = 0
        while nxt < len(items) or pending:
            while nxt < len(items) and len(pending) < 2 * n:    # two in flight per actor
                k, tokens, targets = items[nxt]
                pending[actors[nxt % n].compute.remote(k, tokens, targets)] = k
                nxt += 1
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                del pending[ref]
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayTaskError as e:     # a bad-input error of ours: re-raised as itself
                    raise e.cause if isinstance(e.cause, RefimplError) else e from None
                yield result
    finally:
        for a in actors:
            ray.kill(a)
        if started:
            ray.shutdown()


# ------------------------------------------------------------------------------------------------ the directory

def _json(obj) -> str:
    return json.dumps(obj, indent=1, sort_keys=True, allow_nan=False) + "\n"


def window_path(root, k: int) -> Path:
    return Path(root) / "windows" / f"{k:06d}.safetensors"


def build_manifest(job: Job, model, windows: Windows, data: dict, bos) -> dict:
    cfg = model.config
    return {
        "format": FORMAT, "version": VERSION, "refimpl_version": __version__,
        "model": {"source": job.source, "config": cfg.to_dict(), "weights_sha256": model.weights.sha256()},
        "precision": model.precision.to_dict(),
        "convention": {"name": job.convention, "params": dict(job.params)},
        "data": data,
        "windows": {"count": len(windows.tokens), "ctx": int(windows.tokens.shape[1]), "stride": data.get("stride"),
                    "first": windows.first, "scored": windows.scored, "bos": bos,
                    "rule": "llama-perplexity: " + ("consecutive windows of ctx tokens, positions ctx/2 .. ctx-2 "
                                                    "scored" if data.get("stride") is None else
                                                    "window i starts at i*stride, the last stride positions scored")},
        "vocab_size": int(cfg.vocab_size),
        "top_k": job.top_k,
        "compact": {"form": "uint16 log-softmax rows (llama.cpp's base-file row with another range)",
                    "range_nats": compact.RANGE, "levels": compact.LEVELS,
                    "decode": "log p~ = floor + scale * code; renormalise before use",
                    "max_entry_error_nats": compact.RANGE / compact.LEVELS / 2},
    }


def _check_window_file(path: Path, S: int, V: int, K: int) -> bool:
    """True if the window file is complete and of the expected shapes."""
    try:
        a = read_safetensors(path)
    except FormatError:
        return False
    want = {"codes": (S, V), "scale": (S,), "floor": (S,), "nll": (S,), "top_ids": (S, K), "top_logprobs": (S, K)}
    return all(n in a and a[n].shape == s for n, s in want.items())


def write_reference(out, job: Job, windows: Windows, data: dict, *, bos=None, workers: int = 1,
                    ray: str | bool | None = None, overwrite: bool = False, progress=None, model=None) -> dict:
    """Compute every window not yet in `out` and return the summary. progress(done, total, tokens) after each
    window (done counts windows already there). ray: False/None (local), True (a local Ray instance or
    RAY_ADDRESS) or a cluster address; workers: processes or Ray actors (Ray: default one per CPU)."""
    out = Path(out)
    if model is not None and workers == 1 and not ray:
        _MODELS.clear()
        _MODELS[job] = model                  # the caller's model computes the windows here
    model = model if model is not None else _model(job) if workers == 1 and not ray else \
        load(job.source, precision=job.precision)
    manifest = json.loads(_json(build_manifest(job, model, windows, data, bos)))
    mf = out / "manifest.json"
    sweep(out)                        # an old reference a killed --overwrite run had begun to remove
    if mf.is_file():
        try:
            old = json.loads(mf.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            old = None
        if old != manifest:
            if not overwrite:
                key = next((k for k in manifest if not isinstance(old, dict) or old.get(k) != manifest[k]), "?")
                raise InputError(f"{out}: holds a reference made with other settings ({key} differs); "
                                 f"give another --out or --overwrite")
            discard(out)               # gone in one rename: a kill cannot leave a reference without its manifest
    elif out.exists() and any(p.name not in ("tokens.safetensors", "windows") and not p.name.startswith(".")
                              for p in out.iterdir()):
        raise InputError(f"{out}: exists and is not a dataset reference; give another --out")
    (out / "windows").mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob(".*.tmp-*"), *(out / "windows").glob(".*.tmp-*")]:   # left by a run that was killed
        stale.unlink(missing_ok=True)
    if not mf.is_file():
        write_safetensors(out / "tokens.safetensors",
                          {"tokens": windows.tokens, "targets": windows.targets,
                           "documents": np.asarray(windows.documents, np.int64).reshape(-1, 2)})
        write_atomic(mf, _json(manifest))
    n, S, V, K = len(windows.tokens), windows.scored, int(model.config.vocab_size), job.top_k
    todo = [k for k in range(n) if not _check_window_file(window_path(out, k), S, V, min(K, V))]
    if progress is not None:
        progress(n - len(todo), n, 0)
    items = [(k, windows.tokens[k], windows.targets[k]) for k in todo]
    if ray:
        results = _ray(job, items, None if workers == 1 else workers, None if ray is True else ray)
    elif workers > 1 and len(items) > 1:
        results = _processes(job, items, workers)
    else:
        results = _serial(job, items)
    done = n - len(todo)
    for k, arrays in results:
        write_safetensors(window_path(out, k), arrays, {"window": str(k)})
        done += 1
        if progress is not None:
            progress(done, n, S)
    return finish(out)


def finish(out) -> dict:
    """Write summary.json from the window files (all present) and return it."""
    ref = open_reference(out)
    nll = [math.fsum(ref.window(k)["nll"].tolist()) for k in range(ref.count)]
    tokens = ref.count * ref.scored
    files = sum(window_path(out, k).stat().st_size for k in range(ref.count))
    summary = {"windows": ref.count, "scored_tokens": tokens, "mean_nll": math.fsum(nll) / tokens,
               "perplexity": math.exp(math.fsum(nll) / tokens), "window_bytes": files,
               "bytes_per_scored_token": files / tokens}
    write_atomic(Path(out) / "summary.json", _json(summary))
    return summary


# ------------------------------------------------------------------------------------------------ reading

class Reference:
    """An opened reference directory; windows are read lazily (memory-mapped)."""

    def __init__(self, path: Path, manifest: dict, tokens: dict):
        self.path, self.manifest, self.tokens, self.targets = path, manifest, tokens["tokens"], tokens["targets"]
        w = manifest["windows"]
        self.count, self.ctx, self.first, self.scored = w["count"], w["ctx"], w["first"], w["scored"]
        self.vocab, self.top_k = manifest["vocab_size"], min(manifest["top_k"], manifest["vocab_size"])

    def finished(self) -> list[int]:
        return [k for k in range(self.count) if window_path(self.path, k).is_file()]

    def window(self, k: int) -> dict:
        path = window_path(self.path, k)
        if not path.is_file():
            raise InputError(f"{self.path}: window {k} is not computed yet ({len(self.finished())} of {self.count} "
                             f"done); run `refimpl reference` again to finish it")
        a = read_safetensors(path)
        if not _check_window_file(path, self.scored, self.vocab, self.top_k):
            raise FormatError(f"{path}: not a window of this reference (shapes differ from manifest.json)")
        return a


def open_reference(path) -> Reference:
    path = Path(path)
    mf = path / "manifest.json"
    manifest = read_json(mf, "dataset reference manifest (written by `refimpl reference`)")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise FormatError(f"{mf}: not a dataset reference manifest (format {manifest.get('format')!r})"
                          if isinstance(manifest, dict) else f"{mf}: not a JSON object")
    if manifest.get("version") != VERSION:
        raise FormatError(f"{mf}: version {manifest.get('version')!r}, this refimpl reads {VERSION}")
    tokens = read_safetensors(path / "tokens.safetensors")
    w = manifest["windows"]
    if tokens["tokens"].shape != (w["count"], w["ctx"]) or tokens["targets"].shape != (w["count"], w["scored"]):
        raise FormatError(f"{path / 'tokens.safetensors'}: shapes {tokens['tokens'].shape} / "
                          f"{tokens['targets'].shape} disagree with manifest.json")
    return Reference(path, manifest, tokens)

