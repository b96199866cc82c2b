"""A dataset reference is checked before use: a damaged manifest, tokens file or window is a one-line error naming
that file (exit 2), never blamed on the device and never an internal error; a resumed run computes a damaged window
again. Workers get their share of the cores for BLAS."""

import json
import multiprocessing
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from threadpoolctl import threadpool_info

import gguf_cases
import refimpl
from refimpl.cli import main
from refimpl.dataset import cut, open_reference, write_reference
from refimpl.dataset.reference import Job, blas_share, start_worker, window_logits, with_digest
from refimpl.formats.safetensors import read_safetensors, write_safetensors
from refimpl.precision import Policy

CTX = 16


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A finished reference of the 320-token Qwen3 (3 windows of 16 tokens), a device's logits for it, and the
    settings that made it."""
    root = tmp_path_factory.mktemp("validation")
    gguf_cases.write_checkpoint("qwen3", root / "qwen3")
    model = refimpl.load(root / "qwen3")
    windows = cut([np.random.default_rng(5).integers(0, 300, 3 * CTX).tolist()], CTX)
    job = Job(str(root / "qwen3"), Policy(), first=windows.first, scored=windows.scored, top_k=4)
    write_reference(root / "ref", job, windows, {"stride": None}, model=model)
    noise = np.random.default_rng(6)
    np.savez(root / "device.npz", **{f"{k}/logits": (window_logits(model, t) + 0.2 * noise.standard_normal(
        (CTX, 320))).astype(np.float32) for k, t in enumerate(windows.tokens)})
    return root, job, windows, model


def _files(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _rewrite(path: Path, edit) -> None:
    """The safetensors file with its arrays edited and its digest made to match again (damage only a value check
    can find)."""
    arrays = {k: np.array(v) for k, v in read_safetensors(path).items() if k != "sha256"}
    edit(arrays)
    write_safetensors(path, with_digest(arrays), {"window": path.stem.lstrip("0") or "0"}
                      if path.parent.name == "windows" else None)


def _header(path: Path, edit) -> None:
    """The safetensors file with its JSON header edited (the data kept)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n:])


def _manifest(edit):
    def do(ref: Path):
        m = json.loads((ref / "manifest.json").read_text())
        edit(m)
        (ref / "manifest.json").write_text(json.dumps(m))
    return do


W0 = "windows/000000.safetensors"
DAMAGE = {  # name -> (edit of the reference directory, the file the error must name)
    "window truncated": (lambda r: (r / W0).write_bytes((r / W0).read_bytes()[:-100]), W0),
    "window emptied": (lambda r: (r / W0).write_bytes(b""), W0),
    "window garbage header": (lambda r: (r / W0).write_bytes(b"\xff" * 64 + (r / W0).read_bytes()[64:]), W0),
    "window data byte flipped": (lambda r: (r / W0).write_bytes((r / W0).read_bytes()[:-3] + b"\x55\x55\x55"), W0),
    "window NaN scale": (lambda r: _rewrite(r / W0, lambda a: a["scale"].__setitem__(2, np.nan)), W0),
    "window negative scale": (lambda r: _rewrite(r / W0, lambda a: a["scale"].__setitem__(0, -1e-4)), W0),
    "window top id outside the vocabulary": (lambda r: _rewrite(r / W0, lambda a: a["top_ids"].__setitem__(
        (0, 0), 320)), W0),
    "window tensor missing": (lambda r: _rewrite(r / W0, lambda a: a.pop("nll")), W0),
    "targets renamed": (lambda r: _header(r / "tokens.safetensors", lambda h: h.__setitem__(
        "target", h.pop("targets"))), "tokens.safetensors"),
    "target outside the vocabulary": (lambda r: _rewrite(r / "tokens.safetensors", lambda a: a["targets"].__setitem__(
        (1, 1), 999)), "tokens.safetensors"),
    "manifest without windows": (_manifest(lambda m: m.pop("windows")), "manifest.json"),
    "manifest vocab_size a string": (_manifest(lambda m: m.__setitem__("vocab_size", "320")), "manifest.json"),
    "manifest scored past the window": (_manifest(lambda m: m["windows"].__setitem__("scored", 99)),
                                        "manifest.json"),
    "manifest of version 1": (_manifest(lambda m: m.__setitem__("version", 1)), "manifest.json"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_reference_is_the_reference_error(base, damage, tmp_path, capsys):
    root = base[0]
    shutil.copytree(root / "ref", tmp_path / "ref")
    edit, culprit = DAMAGE[damage]
    edit(tmp_path / "ref")
    capsys.readouterr()
    code = main(["compare-logits", str(tmp_path / "ref"), str(root / "device.npz"), "-q", "--json",
                 str(tmp_path / "r.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not (tmp_path / "r.json").exists()
    assert err.count("\n") == 0 and err.startswith("refimpl: error: "), err
    assert str(tmp_path / "ref" / culprit) in err and "device" not in err, err
    assert main(["export-kld-base", str(tmp_path / "ref"), str(tmp_path / "x.kld")]) == 2
    assert str(tmp_path / "ref" / culprit) in capsys.readouterr().err
    assert not (tmp_path / "x.kld").exists()


def test_undamaged_reference_compares(base, tmp_path, capsys):
    root = base[0]
    assert main(["compare-logits", str(root / "ref"), str(root / "device.npz"), "-q", "--json",
                 str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["windows"]["compared"] == 3 and not report["notes"]
    assert report["llama_cpp"]["kld"]["mean"] > 0 and report["llama_cpp"]["definition"].startswith("llama.cpp's")
    assert "llama.cpp" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["window NaN scale", "window data byte flipped", "window truncated",
                                    "targets renamed"])
def test_resume_recomputes_damaged_files(base, damage, tmp_path):
    root, job, windows, model = base
    shutil.copytree(root / "ref", tmp_path / "ref")
    DAMAGE[damage][0](tmp_path / "ref")
    write_reference(tmp_path / "ref", job, windows, {"stride": None}, model=model)
    assert _files(tmp_path / "ref") == _files(root / "ref")
    open_reference(tmp_path / "ref").window(0)


def test_workers_get_their_share_of_the_cores(monkeypatch):
    from refimpl.dataset import reference
    monkeypatch.setattr(reference, "cores", lambda: 8)
    assert [blas_share(n) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    # a spawned worker started as the pool starts it has its BLAS at that share
    with multiprocessing.get_context("spawn").Pool(1, initializer=start_worker, initargs=(1,)) as pool:
        info = pool.apply(threadpool_info)
    blas = [lib for lib in info if lib.get("user_api") == "blas"]
    assert blas and all(lib["num_threads"] == 1 for lib in blas)
