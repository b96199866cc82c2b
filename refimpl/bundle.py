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

from .errors import FormatError, InputError, brief
from .files import expect, inside, integer, load_json, read_exact, regular_file, sha256_file
from .formats.safetensors import DTYPES as _SAFETENSORS_DTYPES, write_safetensors

SCHEMA_VERSION = 1
ROLES = {"input": "inputs", "output": "outputs", "tap": "taps"}  # role -> directory (and step-list key)
EXECUTION_ORDER = ("input", "tap", "output")                        # within a step
DTYPES = {n: np.dtype(n).newbyteorder("<") for n in
          ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint16", "uint8", "bool")}
DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16).newbyteorder("<")
EXPORTS = ("safetensors", "npz")
_NAME = re.compile(r"[A-Za-z0-9_.]{1,200}")   # a tensor name: with ".raw", a file name on every system
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
        raise InputError(f"{where}: a name may hold only [A-Za-z0-9_.], 1 to 200 characters (device tools rewrite "
                         f"':', '/', '-')")
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
        if not isinstance(valid, (list, tuple)) or not all(isinstance(box, (list, tuple)) for box in valid):
            raise TypeError
        boxes = [[[operator.index(lo), operator.index(hi)] for lo, hi in box] for box in valid]
        if any(isinstance(v, bool) for box in valid for pair in box for v in pair):
            raise TypeError
    except (TypeError, ValueError):
        raise InputError(f"{where}: valid must be a list of boxes, each one [start, stop) per axis; "
                         f"got {brief(valid)}") from None
    for box in boxes:
        if len(box) != len(shape) or not all(0 <= lo <= hi <= n for (lo, hi), n in zip(box, shape)):
            raise InputError(f"{where}: valid box {brief(box)} does not fit shape {list(shape)}")
    return boxes


def _check_manifest_in(manifest, plan) -> dict:
    """A copy of the caller's manifest with schema_version, refimpl_version and the step lists filled in."""
    from .version import __version__
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
#
# A bundle comes from another team or a CI system: reading one never touches anything outside its directory.
# Every path it names is checked to resolve inside it (refimpl.files.inside: no absolute path, no '..', no symlink
# leaving it), every file is checked to be a regular file of the declared size before it is read or mapped, and
# hashes are computed by streaming. The manifest is checked whole on opening, so the tools that read it (diff,
# replay, explain) can trust its structure.

_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_DIMS = 32


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
    if not path.is_dir():
        raise FormatError(f"{path}: {'not a directory' if path.exists() else 'no such directory'} "
                          f"(a golden bundle is a directory with a manifest.json)")
    mf = inside(path, "manifest.json", "manifest")
    if not mf.exists() and not mf.is_symlink():
        raise FormatError(f"{mf}: missing (not a golden bundle)")
    manifest = load_json(mf, "bundle manifest")
    _check_manifest_out(manifest, mf)
    if verify:
        for rec in manifest["tensors"].values():
            _tensor_file(path, rec)
    return Bundle(path, manifest, verify)


def _key(rec: dict) -> str:
    return f"{rec['step']}/{rec['role']}/{rec['name']}"


def _check_manifest_out(m, mf: Path) -> None:
    """The manifest's structure, whole: the tensor index, the step lists and the derived files (what the readers
    index and open), and the types of the records refimpl golden writes (model, convention, precision,
    quantisation) when present."""
    if not isinstance(m, dict) or "schema_version" not in m:
        raise FormatError(f"{mf}: no schema_version (not a golden bundle manifest)")
    if m["schema_version"] != SCHEMA_VERSION or isinstance(m["schema_version"], bool):
        raise FormatError(f"{mf}: schema_version {brief(m['schema_version'])}, this refimpl reads {SCHEMA_VERSION}")
    tensors, steps = m.get("tensors"), m.get("steps")
    if not isinstance(tensors, dict) or not isinstance(steps, list) or not isinstance(m.get("derived"), dict):
        raise FormatError(f"{mf}: 'tensors' (object), 'steps' (list) and 'derived' (object) are required")
    for k, s in enumerate(steps):
        where = f"{mf}: steps[{k}]"
        expect(s, dict, where)
        if s.get("index", k) != k or isinstance(s.get("index"), bool):
            raise FormatError(f"{where}: index {brief(s.get('index'))}, expected {k}")
        for r in ROLES:
            names = expect(s.get(ROLES[r]), list, f"{where}.{ROLES[r]}", what="a list of tensor names")
            if not all(isinstance(n, str) and _NAME.fullmatch(n) for n in names):
                raise FormatError(f"{where}.{ROLES[r]}: tensor names hold 1 to 200 of [A-Za-z0-9_.], got {brief(names)}")
            if len(set(names)) != len(names):
                raise FormatError(f"{where}.{ROLES[r]}: a name is listed twice")
            missing = [n for n in names if f"{k}/{r}/{n}" not in tensors]
            if missing:
                raise FormatError(f"{where} names tensors missing from the index: {brief(missing)}")
        if s.get("tokens") is not None:
            expect(s["tokens"], list, f"{where}.tokens")
            for t in s["tokens"]:
                integer(t, f"{where}.tokens", lo=0)
    for key, rec in tensors.items():
        _check_record(key, rec, len(steps), f"{mf}: tensor index entry {brief(key)}")
    for rel, info in m["derived"].items():
        where = f"{mf}: derived {brief(rel)}"
        inside(mf.parent, rel, "derived file")
        expect(info, dict, where)
        integer(info.get("size"), f"{where}.size", lo=0)
        if not isinstance(info.get("sha256"), str) or not _SHA256.fullmatch(info["sha256"]):
            raise FormatError(f"{where}.sha256: expected 64 hex digits, got {brief(info.get('sha256'))}")
    _check_golden_records(m, mf)


_RECORD_FIELDS = ("name", "step", "role", "file", "dtype", "shape", "axes", "valid", "sha256")  # axes, valid: null ok


def _check_record(key, rec, n_steps: int, where: str) -> None:
    expect(rec, dict, where)
    missing = [f for f in _RECORD_FIELDS if f not in rec]
    if missing:
        raise FormatError(f"{where}: no {', '.join(missing)} (every record has {', '.join(_RECORD_FIELDS)})")
    name, step, role = rec.get("name"), rec.get("step"), rec.get("role")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise FormatError(f"{where}: name {brief(name)} is not a tensor name (1 to 200 of [A-Za-z0-9_.])")
    integer(step, f"{where}: step", hi=n_steps - 1, lo=0)
    if not isinstance(role, str) or role not in ROLES:
        raise FormatError(f"{where}: role {brief(role)} is not one of {', '.join(ROLES)}")
    if key != f"{step}/{role}/{name}":
        raise FormatError(f"{where}: the key does not match step / role / name ({brief(f'{step}/{role}/{name}')})")
    if rec.get("file") != f"steps/{step}/{ROLES[role]}/{name}.raw":
        raise FormatError(f"{where}: file {brief(rec.get('file'))}, expected steps/{step}/{ROLES[role]}/{name}.raw")
    if not isinstance(rec.get("dtype"), str) or rec["dtype"] not in DTYPES:
        raise FormatError(f"{where}: dtype {brief(rec.get('dtype'))} is not one of {', '.join(DTYPES)}")
    shape = expect(rec.get("shape"), list, f"{where}: shape")
    if len(shape) > MAX_DIMS or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise FormatError(f"{where}: shape {brief(shape)} is not a list of at most {MAX_DIMS} sizes >= 0")
    axes = rec.get("axes")
    if axes is not None and (not isinstance(axes, str) or len(axes.split(",") if axes else []) != len(shape)):
        raise FormatError(f"{where}: axes {brief(axes)} must name each of the {len(shape)} axes, comma-separated")
    if rec.get("valid") is not None:
        try:
            _check_valid(rec["valid"], shape, where)
        except InputError as e:
            raise FormatError(str(e)) from None
    if not isinstance(rec.get("sha256"), str) or not _SHA256.fullmatch(rec["sha256"]):
        raise FormatError(f"{where}: sha256 {brief(rec.get('sha256'))} is not 64 hex digits")


def _check_golden_records(m: dict, mf: Path) -> None:
    """Types of the records refimpl golden writes, where present (the diff tools read them)."""
    fields = {"model": dict, "convention": dict, "precision": dict, "quantisation": dict, "prompt_ids": list,
              "generated_ids": list}
    for key, kind in fields.items():
        if m.get(key) is not None:
            expect(m[key], kind, f"{mf}: {key}")
    model, conv = m.get("model") or {}, m.get("convention") or {}
    for key, kind in (("source", str), ("config", dict), ("weights_sha256", str)):
        if model.get(key) is not None:
            expect(model[key], kind, f"{mf}: model.{key}")
    if conv.get("name") is not None:
        expect(conv["name"], str, f"{mf}: convention.name")
    if conv.get("params") is not None:
        expect(conv["params"], dict, f"{mf}: convention.params")
    for key in ("prompt_ids", "generated_ids"):
        for t in m.get(key) or []:
            integer(t, f"{mf}: {key}", lo=0)
    quantisers = (m.get("quantisation") or {}).get("quantisers")
    if quantisers is not None:
        for i, q in enumerate(expect(quantisers, list, f"{mf}: quantisation.quantisers")):
            expect(q, dict, f"{mf}: quantisation.quantisers[{i}]")


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
    for box in _check_valid(valid, shape, "valid_mask"):
        mask[tuple(slice(lo, hi) for lo, hi in box)] = True
    return mask
