"""Golden bundles: one directory per case, raw-first so the device side needs no parser (docs/bundle.md).

    manifest.json                 the caller's manifest + "steps" + "tensors" (the index) + "derived"
    steps/<k>/inputs/<name>.raw   headerless little-endian C-order; dtype and shape live in the index
    steps/<k>/outputs/<name>.raw
    steps/<k>/taps/<name>.raw
    input_list.txt                qnn-net-run: line k = step k, `name:=steps/<k>/inputs/name.raw ...`
    bundle.safetensors, .npz      optional exports, keys "<k>/<role>/<name>"
    aimet/                        optional AIMET layer-output layout (inputs/, outputs/, name order)

    path = write_bundle("golden/case", manifest, [[Tensor("input_ids", "input", ids), ...], ...])
    read_bundle(path).tensor(0, "output", "logits")

A bundle is written into a hidden temporary directory beside the target and renamed into place (swapped with the
old one on --overwrite: refimpl.files.atomic_directory), so a crash (even SIGKILL) at any point leaves the old bundle
or the whole new one at the target path (tests/test_crash_points.py enumerates every point). Same
content, same bytes. The schema and its checks are refimpl/bundle_schema.py; the npz and AIMET exports
refimpl/bundle_exports.py.
"""

import hashlib
import math
import os
from pathlib import Path

import numpy as np

from .bundle_exports import npz, write_aimet
from .bundle_schema import (
    DTYPES,
    EXECUTION_ORDER,
    ROLES,
    SCHEMA_VERSION,
    Tensor,
    check_manifest_in,
    check_manifest_out,
    check_options,
    check_tensor,
    check_valid,
    dumps,
    raw,
)
from .errors import FormatError, InputError, brief
from .files import atomic_directory, inside, load_json, read_exact, recover, regular_file, sha256_file
from .formats.safetensors import write_safetensors

# ---------------------------------------------------------------------------------------------- writing

def write_bundle(out_dir, manifest: dict, steps: list[list[Tensor]], *, exports=(), aimet: bool = False,
                 overwrite: bool = False, progress=None, platform: dict | None = None) -> Path:
    """Write a golden bundle to `out_dir` atomically and return its path.

    steps[k] lists step k's tensors; inputs keep the order given (it is the input_list.txt order).
    exports: any of "safetensors", "npz". aimet: also write the AIMET layer-output layout.
    progress(k, total) is called after step k's raw files are written.
    platform: where the bundle was made, written as platform.json (information only: not hashed, not read back).
    """
    target = Path(out_dir)
    steps = [list(s) for s in steps]
    plan = [[check_tensor(t, k) for t in s] for k, s in enumerate(steps)]  # [(record, array)] per step
    manifest = check_manifest_in(manifest, plan)
    check_options(plan, exports, aimet)
    with atomic_directory(target, overwrite, "bundle") as tmp:
        index, arrays = {}, {}
        for k, step in enumerate(plan):
            for rec, a in step:
                key = f"{k}/{rec['role']}/{rec['name']}"
                rec["file"] = f"steps/{k}/{ROLES[rec['role']]}/{rec['name']}.raw"
                rec["sha256"] = _write(tmp / rec["file"], raw(a))
                index[key], arrays[key] = rec, a
            if progress is not None:
                progress(k, len(plan))
        arrays = {key: arrays[key] for key in _execution_order(manifest["steps"])}
        derived = {}

        def put(rel, data):
            derived[rel] = {"sha256": _write(tmp / rel, data), "size": memoryview(data).nbytes}

        lines = [" ".join(f"{n}:={index[f'{k}/input/{n}']['file']}" for n in s["inputs"])
                 for k, s in enumerate(manifest["steps"])]
        put("input_list.txt", "".join(line + "\n" for line in lines).encode())
        if "safetensors" in exports:
            write_safetensors(tmp / "bundle.safetensors", arrays, {"schema_version": str(SCHEMA_VERSION),
                                                                   "tensors": dumps(index)})
            put("bundle.safetensors", (tmp / "bundle.safetensors").read_bytes())  # rewritten: hashed and fsynced
        if "npz" in exports:
            put("bundle.npz", npz(arrays))
        if aimet:
            write_aimet(put, manifest["steps"], index, arrays)
        manifest["tensors"], manifest["derived"] = index, derived
        _write(tmp / "manifest.json", dumps(manifest).encode())
        if platform is not None:
            _write(tmp / "platform.json", dumps(platform, "platform").encode())
    return target


def _execution_order(steps: list) -> list[str]:
    """Index keys "<k>/<role>/<name>": per step, inputs, taps, then outputs, each list in the order given."""
    return [f"{k}/{r}/{n}" for k, s in enumerate(steps) for r in EXECUTION_ORDER for n in s[ROLES[r]]]


def _write(path: Path, data) -> str:
    """Write bytes (any buffer), fsync, return their sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------- reading
#
# A bundle comes from another team or a CI system: reading one never touches anything outside its directory.
# Every path it names is checked to resolve inside it (refimpl.files.inside: no absolute path, no '..', no symlink
# leaving it), every file is checked to be a regular file of the declared size before it is read or mapped, and
# hashes are computed by streaming. The manifest is checked whole on opening, so the tools that read it (diff,
# replay, explain) can trust its structure.


class Bundle:
    """A golden bundle opened by read_bundle. Tensors are read lazily, one file per call.

    With verify=True, opening checks the schema, the index and every file's size (a stat, no reads);
    tensor() checks the file's sha256 before returning it; verify() hashes every file of the bundle.
    """

    def __init__(self, path: Path, manifest: dict, verify: bool):
        self.path, self.manifest, self._verify = path, manifest, verify

    @property
    def steps(self) -> int:
        return len(self.manifest["steps"])

    def tensor(self, step: int, role: str, name: str) -> np.ndarray:
        """Step `step`'s tensor (read-only): role is input / output / tap (or inputs / outputs / taps)."""
        role = {v: k for k, v in ROLES.items()}.get(role, role)
        rec = self.manifest["tensors"].get(f"{step}/{role}/{name}")
        if rec is None:
            raise InputError(f"{self.path}: no tensor {step}/{role}/{name} in the bundle")
        return _load(self.path, rec, self._verify)

    def records(self):
        """Index records in execution order: per step, its inputs, taps, then outputs (each in given order)."""
        return (self.manifest["tensors"][key] for key in _execution_order(self.manifest["steps"]))

    def input_list(self) -> list[dict[str, str]]:
        """input_list.txt parsed back: one {input name: path relative to the bundle} per step (every path checked
        to stay inside the bundle)."""
        path = inside(self.path, "input_list.txt", "input list")
        data = read_exact(path, regular_file(path, "input list (input_list.txt)"))
        try:
            lines = data.decode("utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise FormatError(f"{path}: not UTF-8 text (byte {e.start})") from None
        if len(lines) != self.steps:
            raise FormatError(f"{path}: {len(lines)} lines, but the bundle has {self.steps} steps (one line each)")
        out = []
        for i, line in enumerate(lines):
            items = [item.partition(":=") for item in line.split()]
            if any(not sep or not n or not p for n, sep, p in items):
                raise FormatError(f"{path}:{i + 1}: expected `name:=path` items, got {brief(line)}")
            for _, _, p in items:
                inside(self.path, p, f"input_list.txt line {i + 1}")
            out.append({n: p for n, _, p in items})
        return out

    def verify(self) -> None:
        """Check every raw file's size and sha256, and every derived file (input list, exports, AIMET), streaming."""
        for rec in self.records():
            f = _tensor_file(self.path, rec)
            if sha256_file(f)[0] != rec["sha256"]:
                raise FormatError(f"{f}: sha256 mismatch (tensor {_key(rec)})")
        for rel, info in self.manifest["derived"].items():
            f = inside(self.path, rel, f"derived file {brief(rel)}")
            size = regular_file(f, "derived file listed in manifest.json")
            if size != info["size"] or sha256_file(f)[0] != info["sha256"]:
                raise FormatError(f"{f}: sha256 mismatch ({size} bytes, manifest says {info['size']})")

    def __repr__(self):
        return f"Bundle({str(self.path)!r}, steps={self.steps}, tensors={len(self.manifest['tensors'])})"


def read_bundle(path, *, verify: bool = True) -> Bundle:
    """Open a bundle: parse and check manifest.json; with verify, also check every raw file's size."""
    path = Path(path)
    if not os.path.lexists(path):
        recover(path, "bundle")     # a writer killed between the two renames of a replacement (refimpl.files)
    if not path.is_dir():
        raise FormatError(f"{path}: {'not a directory' if path.exists() else 'no such directory'} "
                          f"(a golden bundle is a directory with a manifest.json)")
    mf = inside(path, "manifest.json", "manifest")
    if not mf.exists() and not mf.is_symlink():
        raise FormatError(f"{mf}: missing (not a golden bundle)")
    manifest = load_json(mf, "bundle manifest")
    check_manifest_out(manifest, mf)
    if verify:
        for rec in manifest["tensors"].values():
            _tensor_file(path, rec)
    return Bundle(path, manifest, verify)


def _key(rec: dict) -> str:
    return f"{rec['step']}/{rec['role']}/{rec['name']}"


def _tensor_file(root: Path, rec: dict) -> Path:
    """The record's raw file, checked: inside the bundle, a regular file, of exactly the declared size."""
    key = _key(rec)
    path = inside(root, rec["file"], f"tensor {key}")
    nbytes = math.prod(rec["shape"]) * DTYPES[rec["dtype"]].itemsize
    if not os.path.lexists(path):
        raise FormatError(f"{path}: missing (tensor {key})")
    size = regular_file(path, f"raw file of tensor {key}")
    if size != nbytes:
        raise FormatError(f"{path}: {size} bytes, expected {nbytes} for {rec['dtype']} {rec['shape']} "
                          f"(tensor {key}; truncated or corrupt)")
    return path


def _load(root: Path, rec: dict, verify: bool) -> np.ndarray:
    path, dtype, shape = _tensor_file(root, rec), DTYPES[rec["dtype"]], tuple(rec["shape"])
    nbytes = math.prod(shape) * dtype.itemsize
    if verify:
        data = read_exact(path, nbytes)
        if hashlib.sha256(data).hexdigest() != rec["sha256"]:
            raise FormatError(f"{path}: sha256 mismatch (tensor {_key(rec)})")
        return np.frombuffer(data, dtype).reshape(shape)
    return np.memmap(path, dtype, "r", shape=shape) if nbytes else np.zeros(shape, dtype)


def valid_mask(shape, valid) -> np.ndarray:
    """The boolean mask of a record's valid region: True inside any box (all True when valid is None)."""
    if valid is None:
        return np.ones(shape, bool)
    mask = np.zeros(shape, bool)
    for box in check_valid(valid, shape, "valid_mask"):
        mask[tuple(slice(lo, hi) for lo, hi in box)] = True
    return mask
