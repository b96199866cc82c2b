"""What a golden bundle may hold, checked (docs/bundle.md): the schema's constants, the Tensor a writer is given,
the checks of write_bundle's arguments (InputError) and of a manifest read back (FormatError: the tools that read
it trust its structure), and the byte layouts: deterministic manifest JSON, headerless raw arrays."""

import collections
import dataclasses
import json
import operator
import re
from pathlib import Path

import ml_dtypes
import numpy as np

from .errors import FormatError, InputError, brief
from .files import expect, inside, integer
from .formats.safetensors import DTYPES as _SAFETENSORS_DTYPES
from .version import __version__

SCHEMA_VERSION = 1
ROLES = {"input": "inputs", "output": "outputs", "tap": "taps"}  # role -> directory (and step-list key)
EXECUTION_ORDER = ("input", "tap", "output")                        # within a step
DTYPES = {n: np.dtype(n).newbyteorder("<") for n in
          ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint16", "uint8", "bool")}
DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16).newbyteorder("<")
EXPORTS = ("safetensors", "npz")
TENSOR_NAME = re.compile(r"[A-Za-z0-9_.]{1,200}")   # a tensor name: with ".raw", a file name on every system
SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_DIMS = 32


@dataclasses.dataclass
class Tensor:
    name: str                  # as the device toolchain names it: only [A-Za-z0-9_.]
    role: str                  # "input" | "output" | "tap"
    array: np.ndarray
    axes: str | None = None    # logical axis names, one per dim, e.g. "kvh,b,d,t"
    valid: list | None = None  # None = all valid; else a union of boxes, each one [start, stop) per axis
    meta: dict | None = None   # free-form, JSON-serialisable (producing op, layer index, ...)


def check_tensor(t, k: int) -> tuple[dict, np.ndarray]:
    """The index record (without file and sha256) and the little-endian C-order array, or InputError."""
    if not isinstance(t, Tensor):
        raise InputError(f"step {k}: expected a refimpl.bundle.Tensor, got {type(t).__name__}")
    where = f"step {k}: tensor {t.name!r}"
    if not isinstance(t.name, str) or not TENSOR_NAME.fullmatch(t.name):
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
           "axes": t.axes, "valid": None if t.valid is None else check_valid(t.valid, a.shape, where),
           "meta": t.meta}
    dumps(t.meta, f"{where}: meta")
    return rec, a


def check_valid(valid, shape, where) -> list:
    """A valid region (a list of boxes, each [start, stop) per axis, inside `shape`) as lists of ints, or
    InputError naming `where`."""
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


def check_manifest_in(manifest, plan) -> dict:
    """A copy of the caller's manifest with schema_version, refimpl_version and the step lists filled in."""
    if not isinstance(manifest, dict):
        raise InputError(f"manifest must be a dict, got {type(manifest).__name__}")
    m = json.loads(dumps(manifest, "manifest"))  # a deep copy in JSON types
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


def check_options(plan, exports, aimet) -> None:
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


def raw(a: np.ndarray):
    return a.reshape(-1).view(np.uint8)  # zero-copy bytes of a C-contiguous little-endian array


def dumps(obj, what: str = "manifest") -> str:
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


# ---------------------------------------------------------------------------------------------- a manifest read back

def check_manifest_out(m, mf: Path) -> None:
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
            if not all(isinstance(n, str) and TENSOR_NAME.fullmatch(n) for n in names):
                raise FormatError(f"{where}.{ROLES[r]}: tensor names hold 1 to 200 of [A-Za-z0-9_.], "
                                  f"got {brief(names)}")
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
        if not isinstance(info.get("sha256"), str) or not SHA256.fullmatch(info["sha256"]):
            raise FormatError(f"{where}.sha256: expected 64 hex digits, got {brief(info.get('sha256'))}")
    _check_golden_records(m, mf)


_RECORD_FIELDS = ("name", "step", "role", "file", "dtype", "shape", "axes", "valid", "sha256")  # axes, valid: null ok


def _check_record(key, rec, n_steps: int, where: str) -> None:
    expect(rec, dict, where)
    missing = [f for f in _RECORD_FIELDS if f not in rec]
    if missing:
        raise FormatError(f"{where}: no {', '.join(missing)} (every record has {', '.join(_RECORD_FIELDS)})")
    name, step, role = rec.get("name"), rec.get("step"), rec.get("role")
    if not isinstance(name, str) or not TENSOR_NAME.fullmatch(name):
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
            check_valid(rec["valid"], shape, where)
        except InputError as e:
            raise FormatError(str(e)) from None
    if not isinstance(rec.get("sha256"), str) or not SHA256.fullmatch(rec["sha256"]):
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
