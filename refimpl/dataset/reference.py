"""A dataset reference directory: the reference's compact log-softmax and NLL of every scored position of
every window, written window by window so that a run can stop anywhere and resume (docs/dataset.md).

    REF/manifest.json                 model (source, config, weights sha256), precision, convention, windows, form
    REF/tokens.safetensors            tokens [n, ctx] int32, targets [n, S] int32, documents [n, 2] int64
    REF/windows/<k:06d>.safetensors   codes uint16 [S, V], scale / floor float32 [S], nll float64 [S],
                                      top_ids int32 [S, K], top_logprobs float64 [S, K]
    (each .safetensors also holds sha256 uint8 [32]: the digest of its other tensors, `digest`)
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
import hashlib
import json
import math
import multiprocessing
import os
import signal
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from ..diff.dump import read_json
from ..errors import FormatError, InputError, RefimplError, brief
from ..files import discard, expect, integer, load_json, sweep, write_atomic
from ..formats.safetensors import header_bytes, read_safetensors, write_safetensors
from ..golden import run_convention
from ..kernels import products
from ..sources import load
from ..version import __version__
from . import compact
from .windows import Windows

FORMAT = "refimpl-dataset-reference"
VERSION = 2                 # 2: every window and tokens.safetensors carry the sha256 of their tensors
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
    out = rows[0] if len(rows) == 1 else np.concatenate(rows)                # (one call: its rows, not a copy)
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
    starts = range(0, job.scored, ROW_CHUNK)
    parts = [None] * len(starts)

    def chunk(i: int) -> None:                                                  # scored rows s .. s + ROW_CHUNK
        s = starts[i]
        logp = compact.log_softmax(logits[s:s + ROW_CHUNK])
        codes, scale, floor = compact.encode(logp)
        top = top_ids(logp, job.top_k)
        rows = np.arange(logp.shape[0])
        parts[i] = {"codes": codes, "scale": scale, "floor": floor, "nll": -logp[rows, targets[s:s + ROW_CHUNK]],
                    "top_ids": top, "top_logprobs": np.take_along_axis(logp, top, -1)}

    products.spread(chunk, len(starts))                                         # the chunks over the cores
    return with_digest({name: np.concatenate([p[name] for p in parts]) for name in parts[0]})


def digest(arrays: dict) -> np.ndarray:
    """sha256 (uint8 [32]) of a file's tensors other than `sha256`: name, dtype, shape and bytes, by name."""
    h = hashlib.sha256()
    for name in sorted(n for n in arrays if n != "sha256"):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{a.dtype.str}:{list(a.shape)};".encode())
        h.update(memoryview(a).cast("B"))
    return np.frombuffer(h.digest(), np.uint8).copy()


def with_digest(arrays: dict) -> dict:
    return {**arrays, "sha256": digest(arrays)}


# ------------------------------------------------------------------------------------------------ executors

def cores() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:          # not Linux
        return os.cpu_count() or 1


def blas_share(workers: int) -> int:
    """BLAS / OpenMP threads for each of `workers` workers on this machine: its share of the cores (at least 1).
    Each worker's BLAS would otherwise start a thread per core, and N workers' threads fight over the cores."""
    return max(1, cores() // workers)


def start_worker(threads: int):
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the driver handles Ctrl-C and stops the workers
    threadpool_limits(threads)                     # this process's share of the cores, for BLAS and OpenMP


def _pool_task(args):
    job, k, tokens, targets = args
    return k, compute_window(job, tokens, targets)


def _serial(job, items):
    for k, tokens, targets in items:
        yield k, compute_window(job, tokens, targets)


def _processes(job, items, workers: int):
    pool = multiprocessing.get_context("spawn").Pool(workers, initializer=start_worker,
                                                     initargs=(blas_share(workers),))
    try:
        yield from pool.imap_unordered(_pool_task, [(job, k, t, g) for k, t, g in items], chunksize=1)
        pool.close()
    finally:
        pool.terminate()
        pool.join()


class _Actor:
    """A Ray actor: loads the model once, then computes windows, its BLAS limited to `threads`."""

    def __init__(self, job, threads: int):
        threadpool_limits(threads)
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
        # one CPU each; on a local instance of ours, the machine's cores shared among the actors (a cluster's
        # nodes differ: there an actor takes the one CPU Ray gives it)
        threads = blas_share(n) if started and not (address or os.environ.get("RAY_ADDRESS")) else 1
        actors = [ray.remote(num_cpus=1)(_Actor).remote(job, threads) for _ in range(n)]
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


def window_metadata(k: int) -> dict:
    return {"window": str(k)}


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


def _tokens_arrays(windows: Windows) -> dict:
    return with_digest({"tokens": windows.tokens, "targets": windows.targets,
                        "documents": np.asarray(windows.documents, np.int64).reshape(-1, 2)})


def _resume_tokens(out: Path, windows: Windows) -> None:
    """A resumed run's tokens.safetensors must hold these windows; a damaged one is written again (it is a
    function of the data and the windows, which the manifest already matched)."""
    path = out / "tokens.safetensors"
    want = _tokens_arrays(windows)
    try:
        have = read_safetensors(path)
        _check_layout(path, have)
        same = set(have) == set(want) and all(have[n].dtype == want[n].dtype and np.array_equal(have[n], want[n])
                                              for n in want)
    except FormatError:
        same = False
    if not same:
        write_safetensors(path, want)


def _window_is_whole(path: Path, k: int, S: int, V: int, K: int) -> bool:
    """True if the window file is complete, of the expected tensors, and its digest holds (else it is computed
    again)."""
    try:
        check_window(path, k, read_safetensors(path), S, V, K)
    except FormatError:
        return False
    return True


def check_window(path: Path, k: int, a: dict, S: int, V: int, K: int) -> dict:
    """Window k's tensors, checked: names, dtypes, shapes (from the manifest), the file laid out as
    write_safetensors lays it out (nothing added or moved: _check_layout), the digest, and values (scale
    finite and in (0, RANGE / LEVELS], or 0 for a constant row; floor, nll and top_logprobs finite; top_ids in
    [0, V)). A FormatError naming the file and what is wrong."""
    want = {"codes": ("uint16", (S, V)), "scale": ("float32", (S,)), "floor": ("float32", (S,)),
            "nll": ("float64", (S,)), "top_ids": ("int32", (S, K)), "top_logprobs": ("float64", (S, K)),
            "sha256": ("uint8", (32,))}
    _check_tensors(path, a, want)
    _check_layout(path, a, window_metadata(k))
    if not np.array_equal(a["sha256"], digest(a)):
        raise FormatError(f"{path}: the tensors do not match their sha256 (the file was changed or damaged)")
    scale = a["scale"]
    bad = ~(np.isfinite(scale) & (scale >= 0) & (scale <= np.float32(compact.RANGE / compact.LEVELS * (1 + 1e-6))))
    if bad.any():
        r = int(np.argmax(bad))
        raise FormatError(f"{path}: scale[{r}] = {scale[r]!r}, expected a finite step in (0, "
                          f"{compact.RANGE / compact.LEVELS:.3g}] nats")
    for name in ("floor", "nll", "top_logprobs"):
        if not np.isfinite(a[name]).all():
            raise FormatError(f"{path}: {name} holds non-finite values")
    if a["top_ids"].size and (a["top_ids"].min() < 0 or a["top_ids"].max() >= V):
        raise FormatError(f"{path}: top_ids outside the vocabulary [0, {V})")
    return a


def _check_layout(path: Path, a: dict, metadata: dict | None = None) -> None:
    """The file is byte for byte laid out as write_safetensors writes these arrays: its header, then exactly their
    data (so a file that passes is the file refimpl wrote, given its digest holds)."""
    head = header_bytes(a, metadata, path)
    with open(path, "rb") as f:
        ok = f.read(len(head)) == head and os.fstat(f.fileno()).st_size == len(head) + sum(x.nbytes for x in a.values())
    if not ok:
        raise FormatError(f"{path}: not laid out as `refimpl reference` writes it (header or length changed)")


def _check_tensors(path: Path, a: dict, want: dict) -> None:
    if set(a) != set(want):
        missing, extra = sorted(set(want) - set(a)), sorted(set(a) - set(want))
        raise FormatError(f"{path}: expected the tensors {', '.join(want)}"
                          + (f"; missing {', '.join(missing)}" if missing else "")
                          + (f"; unexpected {', '.join(map(brief, extra))}" if extra else ""))
    for name, (dtype, shape) in want.items():
        if a[name].dtype != np.dtype(dtype) or a[name].shape != shape:
            raise FormatError(f"{path}: {name} is {a[name].dtype} {list(a[name].shape)}, expected {dtype} "
                              f"{list(shape)} (from manifest.json)")


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
            old = load_json(mf, "dataset reference manifest", FormatError)
        except FormatError:
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
        write_safetensors(out / "tokens.safetensors", _tokens_arrays(windows))
        write_atomic(mf, _json(manifest))
    else:
        _resume_tokens(out, windows)
    n, S, V, K = len(windows.tokens), windows.scored, int(model.config.vocab_size), job.top_k
    todo = [k for k in range(n) if not _window_is_whole(window_path(out, k), k, S, V, min(K, V))]
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
        write_safetensors(window_path(out, k), arrays, window_metadata(k))
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
    """An opened reference directory; windows are read lazily (memory-mapped) and checked when read."""

    def __init__(self, path: Path, manifest: dict, tokens: dict):
        self.path, self.manifest, self.tokens, self.targets = path, manifest, tokens["tokens"], tokens["targets"]
        w = manifest["windows"]
        self.count, self.ctx, self.first, self.scored = w["count"], w["ctx"], w["first"], w["scored"]
        self.vocab, self.top_k = manifest["vocab_size"], min(manifest["top_k"], manifest["vocab_size"])
        self._last = None

    def finished(self) -> list[int]:
        return [k for k in range(self.count) if window_path(self.path, k).is_file()]

    def window(self, k: int) -> dict:
        """Window k's tensors, checked (check_window): a damaged window is a FormatError naming its file."""
        if self._last is not None and self._last[0] == k:
            return self._last[1]
        path = window_path(self.path, k)
        if not path.is_file():
            raise InputError(f"{self.path}: window {k} is not computed yet ({len(self.finished())} of {self.count} "
                             f"done); run `refimpl reference` again to finish it")
        a = check_window(path, k, read_safetensors(path), self.scored, self.vocab, self.top_k)
        self._last = (k, a)
        return a


def check_manifest(mf: Path, m) -> dict:
    """manifest.json's fields that readers use, with their types and ranges (a FormatError naming the field)."""
    expect(m, dict, f"{mf}", what="a dataset reference manifest (a JSON object)")
    if m.get("format") != FORMAT:
        raise FormatError(f"{mf}: not a dataset reference manifest (format {brief(m.get('format'))})")
    if m.get("version") != VERSION:
        raise FormatError(f"{mf}: version {brief(m.get('version'))}, this refimpl reads {VERSION}"
                          + (" (references of version 1 carry no digests: make it again)" if m.get("version") == 1
                             else ""))

    def field(obj, key, where, types):
        if key not in obj:
            raise FormatError(f"{mf}: {where}{key} is missing")
        return expect(obj[key], types, f"{mf}: {where}{key}")
    w = field(m, "windows", "", dict)
    integer(field(w, "count", "windows.", int), f"{mf}: windows.count", lo=1)
    ctx = integer(field(w, "ctx", "windows.", int), f"{mf}: windows.ctx", lo=4, hi=2 ** 31 - 1)
    first = integer(field(w, "first", "windows.", int), f"{mf}: windows.first", lo=0, hi=ctx - 2)
    integer(field(w, "scored", "windows.", int), f"{mf}: windows.scored", lo=1, hi=ctx - 1 - first)
    if field(w, "stride", "windows.", (int, type(None))) is not None:        # null: llama-perplexity's windows
        integer(w["stride"], f"{mf}: windows.stride", lo=1, hi=ctx - 1)
    if w.get("bos") is not None:
        integer(w["bos"], f"{mf}: windows.bos", lo=0)
    integer(field(m, "vocab_size", "", int), f"{mf}: vocab_size", lo=1, hi=2 ** 31 - 1)
    integer(field(m, "top_k", "", int), f"{mf}: top_k", lo=1)
    field(field(m, "model", "", dict), "source", "model.", str)
    p = field(m, "precision", "", dict)
    for key in ("activations", "weights", "kv"):
        if p.get(key) is not None:
            expect(p[key], str, f"{mf}: precision.{key}")
    if p.get("encodings") is not None:
        enc = expect(p["encodings"], dict, f"{mf}: precision.encodings")
        if enc.get("file") is not None:
            expect(enc["file"], str, f"{mf}: precision.encodings.file")
    c = field(m, "convention", "", dict)
    field(c, "name", "convention.", str)
    for key, value in field(c, "params", "convention.", dict).items():
        expect(value, (int, float, str, type(None)), f"{mf}: convention.params.{key}")
    return m


def open_reference(path) -> Reference:
    """An opened reference, its manifest and tokens.safetensors checked (windows are checked as they are read)."""
    path = Path(path)
    mf = path / "manifest.json"
    manifest = check_manifest(mf, read_json(mf, "dataset reference manifest (written by `refimpl reference`)"))
    tf = path / "tokens.safetensors"
    tokens = read_safetensors(tf)
    w, V = manifest["windows"], manifest["vocab_size"]
    _check_tensors(tf, tokens, {"tokens": ("int32", (w["count"], w["ctx"])),
                                "targets": ("int32", (w["count"], w["scored"])),
                                "documents": ("int64", (w["count"], 2)), "sha256": ("uint8", (32,))})
    _check_layout(tf, tokens)
    if not np.array_equal(tokens["sha256"], digest(tokens)):
        raise FormatError(f"{tf}: the tensors do not match their sha256 (the file was changed or damaged)")
    for name in ("tokens", "targets"):
        if tokens[name].min() < 0 or tokens[name].max() >= V:
            raise FormatError(f"{tf}: {name} outside the vocabulary [0, {V})")
    return Reference(path, manifest, tokens)
