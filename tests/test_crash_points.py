"""Crash consistency at every step (the method of ALICE, OSDI 2014, and CrashMonkey, OSDI 2018): each writer runs in
a forked child that counts its file-system calls and kills itself (SIGKILL) when it is about to make call n + 1, for
every n from 0 to the number of calls a whole write makes. After each kill the target must be the old artefact or
the whole new one, readable by its reader (a resumable dataset reference: every file there complete, and resuming
ends with the bytes of an uninterrupted run), and the next write must sweep whatever the dead one left beside it.

Counted: opens for writing (builtins.open / io.open / os.open), writes through those files and os.write, fsync,
rename / replace / renameat2 (refimpl.files.exchange), unlink / remove, mkdir, rmdir. Python's file buffers die
with the process, as in a real kill; the kernel's page cache survives it, so fsync is counted but not made (what a
power loss can lose is in docs/bundle.md). Each test records its writers' crash-point counts (`pytest -s` prints them).
"""

import builtins
import io
import json
import os
import shutil
import signal
import traceback
from pathlib import Path

import numpy as np
import pytest

import refimpl
from refimpl import files, presets
from refimpl.bundle import Tensor, read_bundle, write_bundle

_REAL = {name: getattr(os, name) for name in ("open", "write", "fsync", "rename", "replace", "unlink", "remove",
                                              "mkdir", "rmdir", "kill", "_exit", "getpid")}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
POINTS = {}     # writer -> crash points enumerated (printed at the end of each test)


# ------------------------------------------------------------------------------------------------ the harness

def _no_fsync(fd) -> None:
    """fsync's place in the order of calls is what a kill tests; its effect (the data on the disk, not only in the
    kernel's cache) only a power loss would, so here it returns at once: a crash point costs no disk flush."""


@pytest.fixture(autouse=True)
def _fast_fsync(monkeypatch):
    monkeypatch.setattr(os, "fsync", _no_fsync)


def _install(limit: int, exchange: bool) -> dict:
    """In the child: count every file-system call of the kinds above; SIGKILL this process instead of call
    limit + 1. exchange=False: refimpl.files.exchange answers 'unavailable' (the fallback of two renames)."""
    state = {"calls": 0}

    def tick():
        if state["calls"] >= limit:
            _REAL["kill"](_REAL["getpid"](), signal.SIGKILL)
        state["calls"] += 1

    def counted(real):
        def call(*args, **kwargs):
            tick()
            return real(*args, **kwargs)
        return call

    real_open = io.open

    class File:
        """A file opened for writing: its writes counted, everything else passed through."""

        def __init__(self, f):
            self._f = f

        def write(self, data):
            tick()
            return self._f.write(data)

        def writelines(self, lines):
            tick()
            return self._f.writelines(lines)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def __iter__(self):
            return iter(self._f)

        def __getattr__(self, name):
            return getattr(self._f, name)

    def open_(file, mode="r", *args, **kwargs):
        if isinstance(mode, str) and set(mode) & set("wax+"):
            tick()
            return File(real_open(file, mode, *args, **kwargs))
        return real_open(file, mode, *args, **kwargs)

    def os_open(path, flags, *args, **kwargs):
        if flags & _WRITE_FLAGS:
            tick()
        return _REAL["open"](path, flags, *args, **kwargs)

    builtins.open = io.open = open_
    os.open = os_open
    for name in ("write", "rename", "replace", "unlink", "remove", "mkdir", "rmdir"):
        setattr(os, name, counted(_REAL[name]))
    os.fsync = counted(_no_fsync)
    files.exchange = counted(files.exchange if exchange else lambda a, b: False)
    return state


def _child(write, limit: int, exchange: bool = True) -> tuple[bool, int]:
    """Run write() in a forked child killed before file-system call limit + 1: (killed, calls made)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                     # the child: never returns to pytest
        os.close(r)
        code = 0
        state = {"calls": 0}
        try:
            state = _install(limit, exchange)
            write()
        except BaseException:                        # noqa: BLE001 - reported to the parent as exit 3
            traceback.print_exc()
            code = 3
        finally:
            _REAL["write"](w, str(state["calls"]).encode())
            _REAL["_exit"](code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        reported = f.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True, limit
    assert os.WEXITSTATUS(status) == 0, f"the writer failed (exit {os.WEXITSTATUS(status)}) at limit {limit}"
    return False, int(reported)


def _enumerate(name: str, setup, write, check, exchange: bool = True) -> int:
    """setup() makes the state before the write; write() is the writer; check(n) judges the state after a kill
    before call n + 1 (and runs the next write). Every n from 0 to the whole write's count."""
    setup()
    killed, total = _child(write, 1 << 30, exchange)
    assert not killed and total > 0
    for n in range(total + 1):
        setup()
        killed, _ = _child(write, n, exchange)
        assert killed == (n < total), f"{name}: {'killed' if killed else 'finished'} at crash point {n} of {total}"
        check(n)
    POINTS[name] = total + 1
    print(f"{name}: {total + 1} crash points")
    return total + 1


def _calls(write, exchange: bool = True) -> int:
    """The file-system calls of one whole write (counted in a child that is never killed)."""
    killed, total = _child(write, 1 << 30, exchange)
    assert not killed
    return total


@pytest.fixture
def small_vocab(monkeypatch):
    """tiny-qwen3 with a 320-token vocabulary instead of 151936 (every tensor's name and rank kept): its writers make
    the same file-system calls (one write per tensor, whatever its size; each test asserts the count against the
    real preset once), so every crash point is still enumerated, at a fraction of the bytes and arithmetic. Returns
    the real preset's config (to count its calls)."""
    real = presets.PRESETS["tiny-qwen3"]
    monkeypatch.setitem(presets.PRESETS, "tiny-qwen3", {**real, "vocab_size": 320, "bos_token_id": 300,
                                                       "eos_token_id": 302})
    return real


def _state(path: Path):
    """A file's bytes, a directory's {relative path: bytes}, or None if absent."""
    if not os.path.lexists(path):
        return None
    if path.is_file():
        return path.read_bytes()
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _leftovers(parent: Path, names) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name not in names)


def _reset(path: Path, state) -> None:
    """Put `state` (from _state) at `path`, removing whatever is there and beside it."""
    parent = path.parent
    if parent.exists():
        shutil.rmtree(parent)
    parent.mkdir(parents=True)
    if isinstance(state, bytes):
        path.write_bytes(state)
    elif isinstance(state, dict):
        for rel, data in state.items():
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            (path / rel).write_bytes(data)


# ------------------------------------------------------------------------------------------------ golden bundles

def _steps(seed: int):
    rng = np.random.default_rng(seed)
    return [[Tensor("input_ids", "input", rng.integers(0, 100, (1, 4), dtype=np.int32), "b,t"),
             Tensor("logits", "output", rng.standard_normal((1, 4, 16)).astype(np.float32), "b,t,v"),
             Tensor("model.layers.0.mlp", "tap", rng.standard_normal((1, 4, 8)).astype(np.float16), "b,t,d")]
            for _ in range(1)]


@pytest.mark.parametrize("mode", ["new", "overwrite", "overwrite-two-renames"])
def test_golden_bundle_every_crash_point(tmp_path, mode):
    """write_bundle (the golden command's writer) with both exports: a new bundle, --overwrite by the atomic swap,
    and --overwrite where the swap is unavailable (two renames: readers restore an interrupted one)."""
    target = tmp_path / "out" / "case"
    exchange = mode != "overwrite-two-renames"
    old = None
    if mode != "new":
        write_bundle(target, {"case": "old"}, _steps(1), exports=("safetensors",))
        old = _state(target)
    new_steps = _steps(2)

    def write():
        write_bundle(target, {"case": "new"}, new_steps, exports=("safetensors", "npz"), overwrite=mode != "new")

    write()
    new = _state(target)
    restored = []

    def check(n):
        before = _state(target)
        if exchange:
            assert before in (old, new), f"crash point {n}: neither the old nor the new bundle at the target"
        if before is not None or old is not None:
            read_bundle(target).verify()            # restores an interrupted two-rename replacement
        after = _state(target)
        assert after in (old, new), f"crash point {n}: neither the old nor the new bundle"
        if before is None and after is not None:
            restored.append(n)
        write_bundle(target, {"case": "new"}, new_steps, exports=("safetensors", "npz"), overwrite=True)
        assert _state(target) == new and _leftovers(target.parent, {"case"}) == [], f"crash point {n}"

    _enumerate(f"bundle {mode}", lambda: _reset(target, old), write, check, exchange)
    # the two-rename fallback has its window, and readers close it; the swap has none
    assert bool(restored) == (mode == "overwrite-two-renames"), restored


# ------------------------------------------------------------------------------------------------ single files

def test_safetensors_gguf_and_preset_every_crash_point(tmp_path, monkeypatch, small_vocab):
    """write_safetensors and write_gguf over an old file; save_preset over an old preset checkpoint (tiny-qwen3 with
    a small vocabulary: the real preset's calls, counted once)."""
    from refimpl.formats.gguf.reader import GGUFFile
    from refimpl.formats.gguf.writer import write_gguf
    from refimpl.formats.safetensors import read_safetensors, write_safetensors
    from refimpl.presets import build, save_preset

    st = tmp_path / "st" / "m.safetensors"
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float16)}
    write_safetensors(st, {"a": np.zeros(3, np.float32)})
    old_st = _state(st)

    def check_st(n):
        assert _state(st) in (old_st, new_st), f"crash point {n}"
        read_safetensors(st)
        write_safetensors(st, arrays)
        assert _state(st) == new_st and _leftovers(st.parent, {st.name}) == [], f"crash point {n}"

    write_safetensors(st, arrays)
    new_st = _state(st)
    _enumerate("safetensors", lambda: _reset(st, old_st), lambda: write_safetensors(st, arrays), check_st)

    pre = tmp_path / "pre" / "ckpt"
    gg = tmp_path / "gg" / "m.gguf"
    gg.parent.mkdir()
    with monkeypatch.context() as real:              # the released vocabulary: the calls every crash point stands for
        real.setitem(presets.PRESETS, "tiny-qwen3", small_vocab)
        big = build("tiny-qwen3")
        gg.write_bytes(b"GGUF old, not a model")
        save_preset("tiny-qwen3", pre, seed=1)           # the states the crash points start from: an old file / preset
        real_calls = {"gguf": _calls(lambda: write_gguf(gg, big)),
                      "save_preset": _calls(lambda: save_preset("tiny-qwen3", pre))}
    big = None                                        # (40 MB)
    shutil.rmtree(pre)

    model = build("tiny-qwen3")
    gg.write_bytes(b"GGUF old, not a model")
    old_gg = _state(gg)
    write_gguf(gg, model)
    new_gg = _state(gg)

    def check_gg(n):
        state = _state(gg)
        assert state in (old_gg, new_gg), f"crash point {n}"
        if state == new_gg:
            GGUFFile(gg)
        write_gguf(gg, model)
        assert _state(gg) == new_gg and _leftovers(gg.parent, {gg.name}) == [], f"crash point {n}"

    assert _enumerate("gguf", lambda: _reset(gg, old_gg), lambda: write_gguf(gg, model), check_gg) == \
        real_calls["gguf"] + 1

    weights, rw = {}, presets.random_weights         # the seeded weights made once: a crash point costs the write

    def random_weights(config, seed=0, *args):
        key = (config.model_type, seed, *args)
        if key not in weights:
            weights[key] = rw(config, seed, *args)
        return weights[key]
    monkeypatch.setattr(presets, "random_weights", random_weights)
    save_preset("tiny-qwen3", pre, seed=1)
    old_pre = _state(pre)
    save_preset("tiny-qwen3", pre)
    new_pre = _state(pre)

    def check_pre(n):
        assert _state(pre) in (old_pre, new_pre), f"crash point {n}"
        refimpl.load(pre)
        save_preset("tiny-qwen3", pre)
        assert _state(pre) == new_pre and _leftovers(pre.parent, {pre.name}) == [], f"crash point {n}"

    assert _enumerate("save_preset", lambda: _reset(pre, old_pre), lambda: save_preset("tiny-qwen3", pre),
                      check_pre) == real_calls["save_preset"] + 1


def test_tokenizer_cache_every_crash_point(tmp_path, monkeypatch):
    """The converted-vocabulary cache over a damaged cache file. The conversion is replaced by a two-token BPE
    (the writer's file-system calls are the same; each crash point then costs no 7 MB conversion)."""
    from tokenizers import Tokenizer, models

    from refimpl.formats import tokenizer as T
    hf = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    cache = tmp_path / "cache"
    monkeypatch.setenv("REFIMPL_CACHE", str(cache))
    monkeypatch.setattr(T, "parse_tiktoken", lambda *a, **k: {})
    monkeypatch.setattr(T, "convert_tiktoken", lambda *a, **k: hf)

    def write():
        T.qwen_tokenizer.cache_clear()
        T.qwen_tokenizer("qwen3")

    write()
    (path,) = (cache / "tokenizers").iterdir()
    new = _state(path)
    old = b'{"damaged": '

    def check(n):
        assert _state(path) in (old, new), f"crash point {n}"
        write()                                      # reads the cache (the new file) or converts and replaces it
        assert _state(path) == new and _leftovers(path.parent, {path.name}) == [], f"crash point {n}"

    _enumerate("tokenizer cache", lambda: _reset(path, old), write, check)
    T.qwen_tokenizer.cache_clear()                   # no other test sees the two-token vocabulary


def test_diff_metrics_and_html_every_crash_point(tmp_path):
    """The outputs of `refimpl diff --json --html` (save_metrics, then the HTML page written atomically, as the
    command does) over old outputs: each file the old one or the whole new one."""
    from refimpl.diff import compare
    from refimpl.diff.dump import read_dump
    from refimpl.diff.report import render_html
    from refimpl.diff.saved import load_metrics, save_metrics
    bundle = tmp_path / "bundle"
    write_bundle(bundle, {}, _steps(3))
    b = read_bundle(bundle)
    report = compare(b, read_dump(bundle, b, dtype="native"))
    page = render_html(report, None)
    out = tmp_path / "out"
    metrics, html = out / "diff.json", out / "diff.html"
    old = {"diff.json": b"{}", "diff.html": b"<html>old</html>"}

    def write():
        save_metrics(report, metrics)
        files.write_atomic(html, page)

    _reset(metrics, None)
    write()
    new = {"diff.json": metrics.read_bytes(), "diff.html": html.read_bytes()}

    def setup():
        _reset(metrics, None)
        for name, data in old.items():
            (out / name).write_bytes(data)

    def check(n):
        for f in (metrics, html):
            assert _state(f) in (old[f.name], new[f.name]), f"crash point {n}: {f.name}"
        if _state(metrics) == new["diff.json"]:
            load_metrics(metrics)
        write()
        assert _state(out) == new and _leftovers(out, set(new)) == [], f"crash point {n}"

    _enumerate("diff metrics + html", setup, write, check)


# ------------------------------------------------------------------------------------------------ dataset references

def test_dataset_reference_every_crash_point(tmp_path, monkeypatch, small_vocab):
    """write_reference (2 windows of 16 tokens) with --overwrite over a reference made with other settings (its
    calls: removing the old reference, then every call of a new one): killed at every point, then run again
    (resumed), it ends with the bytes of an uninterrupted run; every file present after a kill is complete (its
    reader reads it), and the manifest present means the reference opens. The model: tiny-qwen3 with a small
    vocabulary (the window files' tensors have the same names: the real preset's calls, counted once)."""
    from refimpl.dataset import cut, open_reference
    from refimpl.dataset.reference import Job, window_path, write_reference
    from refimpl.formats.safetensors import read_safetensors
    from refimpl.presets import save_preset
    windows = cut([list(range(5, 5 + 32))], 16)
    ref = tmp_path / "ref" / "r"

    def writer(name):
        src = save_preset("tiny-qwen3", tmp_path / name)
        model = refimpl.load(src)
        job = Job(str(src), model.precision, "hf", (), windows.first, windows.scored, top_k=4)
        other = Job(str(src), model.precision, "hf", (), windows.first, windows.scored, top_k=3)

        def write(j=job):
            write_reference(ref, j, windows, {"stride": None}, model=model, overwrite=True)
        return write, lambda: write(other)

    with monkeypatch.context() as real:              # the released vocabulary: the calls every crash point stands for
        real.setitem(presets.PRESETS, "tiny-qwen3", small_vocab)
        write, write_other = writer("big")
        _reset(ref, None)
        write_other()
        real_calls = _calls(write)

    write, write_other = writer("src")
    _reset(ref, None)
    write_other()
    old = _state(ref)
    write()
    new = _state(ref)
    assert len(new) == 3 + windows.tokens.shape[0]

    def check(n):
        state = _state(ref)
        if state != old:                             # every file there is whole: the new run's bytes
            assert all(data == new.get(rel) for rel, data in (state or {}).items()
                       if not Path(rel).name.startswith(".")), f"crash point {n}"   # (not a dead one's temporary)
            if state and "manifest.json" in state:
                r = open_reference(ref)
                for k in r.finished():               # resume trusts a window file that is there
                    read_safetensors(window_path(ref, k))
        write()                                      # resumes
        assert _state(ref) == new and _leftovers(ref.parent, {"r"}) == [], f"crash point {n}"

    assert _enumerate("dataset reference --overwrite", lambda: _reset(ref, old), write, check) == real_calls + 1
    assert json.loads((ref / "summary.json").read_text())["windows"] == 2
