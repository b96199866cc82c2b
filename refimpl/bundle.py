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

A bundle is written into a hidden temporary directory beside the target and renamed into place, so a
crash (even SIGKILL) never leaves half a bundle at the target path. Same content, same bytes.
"""

import collections
import dataclasses
import hashlib
import io
import json
import math
import operator
import os
import re
import secrets
import shutil
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np

from .errors import FormatError, InputError
from .formats.safetensors import DTYPES as _SAFETENSORS_DTYPES, write_safetensors

SCHEMA_VERSION = 1
ROLES = {"input": "inputs", "output": "outputs", "tap": "taps"}  # role -> directory (and step-list key)
EXECUTION_ORDER = ("input", "tap", "output")                        # within a step
DTYPES = {n: np.dtype(n).newbyteorder("<") for n in
          ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint16", "uint8", "bool")}
DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16).newbyteorder("<")
EXPORTS = ("safetensors", "npz")
_NAME = re.compile(r"[A-Za-z0-9_.]+")
_STALE = re.compile(r"\.(?P<target>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[0-9a-f]{8}")


@dataclasses.dataclass
class Tensor:
    name: str                  # as the device toolchain names it: only [A-Za-z0-9_.]
    role: str                  # "input" | "output" | "tap"
    array: np.ndarray
    axes: str | None = None    # logical axis names, one per dim, e.g. "kvh,b,d,t"
    valid: list | None = None  # None = all valid; else a union of boxes, each one [start, stop) per axis
    meta: dict | None = None   # free-form, JSON-serialisable (producing op, layer index, ...)


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
    plan = [[_check_tensor(t, k) for t in s] for k, s in enumerate(steps)]  # [(record, array)] per step
    manifest = _check_manifest_in(manifest, plan)
    _check_options(plan, exports, aimet)
    if os.path.lexists(target) and not overwrite:
        raise InputError(f"{target}: already exists (pass overwrite=True to replace it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(target.parent)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        index, arrays = {}, {}
        for k, step in enumerate(plan):
            for rec, a in step:
                key = f"{k}/{rec['role']}/{rec['name']}"
                rec["file"] = f"steps/{k}/{ROLES[rec['role']]}/{rec['name']}.raw"
                rec["sha256"] = _write(tmp / rec["file"], _raw(a))
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
                                                                   "tensors": _dumps(index)})
            put("bundle.safetensors", (tmp / "bundle.safetensors").read_bytes())  # rewritten: hashed and fsynced
        if "npz" in exports:
            put("bundle.npz", _npz(arrays))
        if aimet:
            _write_aimet(put, manifest["steps"], index, arrays)
        manifest["tensors"], manifest["derived"] = index, derived
        _write(tmp / "manifest.json", _dumps(manifest).encode())
        if platform is not None:
            _write(tmp / "platform.json", _dumps(platform, "platform").encode())
        for d, _, _ in os.walk(tmp):
            _fsync_dir(d)
        _move_into_place(tmp, target, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _execution_order(steps: list) -> list[str]:
    """Index keys "<k>/<role>/<name>": per step, inputs, taps, then outputs, each list in the order given."""
    return [f"{k}/{r}/{n}" for k, s in enumerate(steps) for r in EXECUTION_ORDER for n in s[ROLES[r]]]


def _check_tensor(t, k: int) -> tuple[dict, np.ndarray]:
    """The index record (without file and sha256) and the little-endian C-order array, or InputError."""
    if not isinstance(t, Tensor):
        raise InputError(f"step {k}: expected a refimpl.bundle.Tensor, got {type(t).__name__}")
    where = f"step {k}: tensor {t.name!r}"
    if not isinstance(t.name, str) or not _NAME.fullmatch(t.name):
        raise InputError(f"{where}: a name may hold only [A-Za-z0-9_.] (device tools rewrite ':', '/', '-')")
    if t.role not in ROLES:
        raise InputError(f"{where}: role {t.role!r} is not one of {', '.join(ROLES)}")
    a = np.asarray(t.array)
    if a.dtype.name not in DTYPES:
        raise InputError(f"{where}: dtype {a.dtype} is not one of {', '.join(DTYPES)}")
    a = a.astype(DTYPES[a.dtype.name], order="C", copy=False)  # (ascontiguousarray makes 0-d 1-d)
    if t.axes is not None and (not isinstance(t.axes, str) or len(t.axes.split(",") if t.axes else []) != a.ndim):
        raise InputError(f"{where}: axes {t.axes!r} must name each of the {a.ndim} axes of shape {list(a.shape)}, "
                         f"comma-separated")
    rec = {"name": t.name, "step": k, "role": t.role, "dtype": a.dtype.name, "shape": list(a.shape),
           "axes": t.axes, "valid": None if t.valid is None else _check_valid(t.valid, a.shape, where),
           "meta": t.meta}
    _dumps(t.meta, f"{where}: meta")
    return rec, a


def _check_valid(valid, shape, where) -> list:
    try:
        boxes = [[[operator.index(lo), operator.index(hi)] for lo, hi in box] for box in valid]
    except (TypeError, ValueError):
        raise InputError(f"{where}: valid must be a list of boxes, each one [start, stop) per axis; "
                         f"got {valid!r}") from None
    for box in boxes:
        if len(box) != len(shape) or not all(0 <= lo <= hi <= n for (lo, hi), n in zip(box, shape)):
            raise InputError(f"{where}: valid box {box} does not fit shape {list(shape)}")
    return boxes


def _check_manifest_in(manifest, plan) -> dict:
    """A copy of the caller's manifest with schema_version, refimpl_version and the step lists filled in."""
    from . import __version__
    if not isinstance(manifest, dict):
        raise InputError(f"manifest must be a dict, got {type(manifest).__name__}")
    m = json.loads(_dumps(manifest, "manifest"))  # a deep copy in JSON types
    if m.setdefault("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise InputError(f"manifest: schema_version {m['schema_version']!r}, this writer writes {SCHEMA_VERSION}")
    m.setdefault("refimpl_version", __version__)
    for key in ("tensors", "derived"):
        if key in m:
            raise InputError(f"manifest: {key!r} is written by write_bundle; remove it")
    given = m.get("steps", [{} for _ in plan])
    if not isinstance(given, list) or len(given) != len(plan) or not all(isinstance(s, dict) for s in given):
        raise InputError(f"manifest: 'steps' must be a list of {len(plan)} dicts (one per step), got {given!r}")
    for k, (info, step) in enumerate(zip(given, plan)):
        ours = {"index": k} | {ROLES[r]: [rec["name"] for rec, _ in step if rec["role"] == r] for r in ROLES}
        for key, names in ours.items():
            if key in info and info[key] != names:
                raise InputError(f"manifest: steps[{k}].{key} is {info[key]!r} but the tensors give {names!r}")
        info.update(ours)
        for r in ROLES:
            dup = sorted(n for n, c in collections.Counter(ours[ROLES[r]]).items() if c > 1)
            if dup:
                raise InputError(f"step {k}: {r} name(s) {dup} given more than once")
    m["steps"] = given
    return m


def _check_options(plan, exports, aimet) -> None:
    for e in exports:
        if e not in EXPORTS:
            raise InputError(f"export {e!r} is not one of {', '.join(EXPORTS)}")
    for k, step in enumerate(plan):
        for rec, a in step:
            if "safetensors" in exports and a.dtype not in _SAFETENSORS_DTYPES.values():
                raise InputError(f"step {k}: tensor {rec['name']!r}: safetensors export has no {a.dtype}")
        names = [rec["name"] for rec, _ in step if rec["role"] != "input"]
        if aimet and len(set(names)) != len(names):
            raise InputError(f"step {k}: an output and a tap share a name; AIMET layout keeps them in one directory")


def _write_aimet(put, steps, index, arrays) -> None:
    """AIMET LayerOutputUtil layout: inputs/input_<k>/<i>.raw, outputs/layer_outputs_<k>/<name>.raw (taps, then
    outputs), layer_output_name_order.json. Each file gets a leading batch axis (unless its first axis is "b"),
    then 4-D is transposed NCHW -> NHWC; floats are written as float32, which is what the QAIRT debugger reads."""
    names = {}
    for k, s in enumerate(steps):
        for i, n in enumerate(s["inputs"]):
            key = f"{k}/input/{n}"
            put(f"aimet/inputs/input_{k}/{i}.raw", _raw(_aimet_array(index[key], arrays[key])))
        for r in ("tap", "output"):
            for n in s[ROLES[r]]:
                key = f"{k}/{r}/{n}"
                put(f"aimet/outputs/layer_outputs_{k}/{n}.raw", _raw(_aimet_array(index[key], arrays[key])))
                names[n] = None
    put("aimet/layer_output_name_order.json", _dumps({"layer_output_names": list(names)}).encode())


def _aimet_array(rec: dict, a: np.ndarray) -> np.ndarray:
    if not (rec["axes"] or "").split(",")[0] == "b":
        a = a[None]
    if a.ndim == 4:
        a = a.transpose(0, 2, 3, 1)
    if a.dtype.name in ("float64", "float16", "bfloat16"):
        a = a.astype(np.float32)
    return np.ascontiguousarray(a)


def _npz(arrays: dict) -> bytes:
    """np.savez with fixed zip timestamps (so the bytes are reproducible); bfloat16 stored as its uint16 bits."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for key, a in arrays.items():
            npy = io.BytesIO()
            np.lib.format.write_array(npy, a.view(np.uint16) if a.dtype.name == "bfloat16" else a, allow_pickle=False)
            z.writestr(zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0)), npy.getvalue())
    return buf.getvalue()


def _raw(a: np.ndarray):
    return a.reshape(-1).view(np.uint8)  # zero-copy bytes of a C-contiguous little-endian array


def _write(path: Path, data) -> str:
    """Write bytes (any buffer), fsync, return their sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def _dumps(obj, what: str = "manifest") -> str:
    """Deterministic JSON: sorted keys, repr floats, NumPy scalars as Python numbers, no NaN / Infinity.
    Objects get one member per line; a value holding no object (a shape, a box list) stays on one line."""
    def plain(o):
        if isinstance(o, (np.generic, np.ndarray)):
            return o.tolist()
        raise TypeError(f"{type(o).__name__} is not JSON-serialisable")
    try:
        obj = json.loads(json.dumps(obj, allow_nan=False, default=plain))  # JSON types only, str keys
    except (TypeError, ValueError) as e:
        raise InputError(f"{what}: cannot be written as JSON ({e})") from None
    return _format(obj, "") + "\n"


def _format(o, indent: str) -> str:
    def has_object(v):
        return isinstance(v, dict) or isinstance(v, list) and any(map(has_object, v))
    if not o or not has_object(o):
        return json.dumps(o, sort_keys=True, separators=(", ", ": "))
    inner = indent + " "
    if isinstance(o, dict):
        items = [f"{json.dumps(k)}: {_format(v, inner)}" for k, v in sorted(o.items())]
    else:
        items = [_format(v, inner) for v in o]
    open_, close = "{}" if isinstance(o, dict) else "[]"
    return open_ + "\n" + ",\n".join(inner + item for item in items) + "\n" + indent + close


def _fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _move_into_place(tmp: Path, target: Path, overwrite: bool) -> None:
    if not os.path.lexists(target):
        try:
            os.rename(tmp, target)
        except OSError as e:
            raise InputError(f"{target}: cannot move the bundle into place ({e.strerror})") from None
    elif not overwrite:
        raise InputError(f"{target}: already exists (pass overwrite=True to replace it)")
    else:
        old = target.parent / f".{target.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(target, old)
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(old, target)
            raise
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    _fsync_dir(target.parent)


def _remove_stale(parent: Path) -> None:
    """Remove temporaries left by writers that died: `.<name>.tmp-<pid>-<rand>` of a dead pid, and
    `.<name>.old-<pid>-<rand>` (a replaced bundle) of a dead pid once `<name>` exists again."""
    for p in parent.iterdir():
        m = _STALE.fullmatch(p.name)
        if m and not _alive(int(m["pid"])) and (m["kind"] == "tmp" or (parent / m["target"]).exists()):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------------------------------- reading

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
        """input_list.txt parsed back: one {input name: path relative to the bundle} per step."""
        path = self.path / "input_list.txt"
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:
            raise FormatError(f"{path}: missing") from None
        out = []
        for i, line in enumerate(lines):
            items = [item.partition(":=") for item in line.split()]
            if any(not sep or not n for n, sep, _ in items):
                raise FormatError(f"{path}:{i + 1}: expected `name:=path` items, got {line!r}")
            out.append({n: p for n, _, p in items})
        return out

    def verify(self) -> None:
        """Check every raw file's size and sha256, and every derived file (input list, exports, AIMET)."""
        for rec in self.records():
            _load(self.path, rec, True)
        for rel, info in self.manifest["derived"].items():
            path = self.path / rel
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                raise FormatError(f"{path}: missing (derived file listed in manifest.json)") from None
            if len(data) != info["size"] or hashlib.sha256(data).hexdigest() != info["sha256"]:
                raise FormatError(f"{path}: sha256 mismatch ({len(data)} bytes, manifest says {info['size']})")

    def __repr__(self):
        return f"Bundle({str(self.path)!r}, steps={self.steps}, tensors={len(self.manifest['tensors'])})"


def read_bundle(path, *, verify: bool = True) -> Bundle:
    """Open a bundle: parse and check manifest.json; with verify, also check every raw file's size."""
    path = Path(path)
    mf = path / "manifest.json"
    try:
        manifest = json.loads(mf.read_text())
    except FileNotFoundError:
        raise FormatError(f"{mf}: missing (not a golden bundle)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"{mf}: corrupt JSON ({e})") from None
    _check_manifest_out(manifest, mf)
    if verify:
        for rec in manifest["tensors"].values():
            _check_size(path / rec["file"], rec)
    return Bundle(path, manifest, verify)


def _check_manifest_out(m, mf: Path) -> None:
    if not isinstance(m, dict) or "schema_version" not in m:
        raise FormatError(f"{mf}: no schema_version (not a golden bundle manifest)")
    if m["schema_version"] != SCHEMA_VERSION:
        raise FormatError(f"{mf}: schema_version {m['schema_version']!r}, this refimpl reads {SCHEMA_VERSION}")
    tensors, steps = m.get("tensors"), m.get("steps")
    if not isinstance(tensors, dict) or not isinstance(steps, list) or not isinstance(m.get("derived"), dict):
        raise FormatError(f"{mf}: 'tensors' (object), 'steps' (list) and 'derived' (object) are required")
    for key, rec in tensors.items():
        try:
            ok = (_NAME.fullmatch(rec["name"]) and key == f"{rec['step']}/{rec['role']}/{rec['name']}"
                  and rec["file"] == f"steps/{rec['step']}/{ROLES[rec['role']]}/{rec['name']}.raw"
                  and rec["dtype"] in DTYPES and isinstance(rec["sha256"], str)
                  and all(isinstance(n, int) and n >= 0 for n in rec["shape"]))
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise FormatError(f"{mf}: tensor index entry {key!r} is malformed: {rec!r}")
    for k, s in enumerate(steps):
        try:
            missing = [f"{k}/{r}/{n}" for r in ROLES for n in s[ROLES[r]] if f"{k}/{r}/{n}" not in tensors]
        except (KeyError, TypeError):
            raise FormatError(f"{mf}: steps[{k}] needs 'inputs', 'outputs' and 'taps' lists") from None
        if missing:
            raise FormatError(f"{mf}: steps[{k}] names tensors missing from the index: {missing}")


def _check_size(path: Path, rec: dict) -> int:
    key = f"{rec['step']}/{rec['role']}/{rec['name']}"
    nbytes = math.prod(rec["shape"]) * DTYPES[rec["dtype"]].itemsize
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise FormatError(f"{path}: missing (tensor {key})") from None
    if size != nbytes:
        raise FormatError(f"{path}: {size} bytes, expected {nbytes} for {rec['dtype']} {rec['shape']} "
                          f"(tensor {key}; truncated or corrupt)")
    return nbytes


def _load(root: Path, rec: dict, verify: bool) -> np.ndarray:
    path, dtype, shape = root / rec["file"], DTYPES[rec["dtype"]], tuple(rec["shape"])
    nbytes = _check_size(path, rec)
    if verify:
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != rec["sha256"]:
            raise FormatError(f"{path}: sha256 mismatch (tensor {rec['step']}/{rec['role']}/{rec['name']})")
        return np.frombuffer(data, dtype).reshape(shape)
    return np.memmap(path, dtype, "r", shape=shape) if nbytes else np.zeros(shape, dtype)


def valid_mask(shape, valid) -> np.ndarray:
    """The boolean mask of a record's valid region: True inside any box (all True when valid is None)."""
    if valid is None:
        return np.ones(shape, bool)
    mask = np.zeros(shape, bool)
    for box in valid:
        mask[tuple(slice(lo, hi) for lo, hi in box)] = True
    return mask
