"""Reading a device's dump and matching it to a golden bundle's tensors.

    dump = read_dump("output/", bundle)                 # qnn-net-run: output/Result_<k>/<name>.raw
    dump = read_dump("dump.npz", bundle)                # keys "<k>/<role>/<name>", "<k>/<name>" or "<name>"
    dump.items["0/output/logits"].array, dump.unknown

Accepted layouts:
- a qnn-net-run output directory: Result_<k>/<name>.raw, k = line k of the input list = bundle step k; with
  --debug, intermediate tensors too (names with "/" become subdirectories);
- a directory in the bundle's own layout (steps/<k>/{inputs,outputs,taps}/<name>.raw|.npy), or of
  <k>/<name>.raw|.npy, or flat <name>.raw|.npy files for a one-step bundle;
- the AIMET layer-output layout (outputs/layer_outputs_<k>/<name>.raw);
- one .npz or .safetensors file with the same key forms.

Raw files are headerless: float32 unless told (qnn-net-run writes dequantised float32; pass dtype="native" for
--use_native_output_files, or a dtype name). Their shape is the bundle's; layout adapters (transposed key
cache, NHWC, AIMET) are tried by refimpl.diff.layouts so a layout mix-up is reported as one.

Names: the device toolchain rewrites ':', '/' and '-' to '_'; some also '.'. A name is matched exactly, then
after that rewriting, then as a module-hook name (`model.layers.3.self_attn.1`, `...o_proj.input`: refimpl.diff.hooks),
then with every non-alphanumeric character as '_' (if that is unambiguous). A mapping
{golden name: device name} (QAIRT's tensor_mapping.json direction) covers the rest. Files that match nothing
are listed in `unknown`, never fatal; an unreadable or truncated file becomes an item with a `problem`.
"""

import dataclasses
import math
import os
import re
import struct
import tokenize
import zipfile
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np

from ..bundle import DTYPES, ROLES
from ..errors import FormatError, InputError, brief
from ..files import inside, load_json, read_exact, regular_file
from ..formats.safetensors import read_safetensors
from . import hooks

SUFFIXES = (".raw", ".npy", ".bin")
_ROLE_DIRS = {**{v: k for k, v in ROLES.items()}, **{k: k for k in ROLES}}  # "inputs" or "input" -> "input"
_STEP_DIR = re.compile(r"(?:Result_|layer_outputs_)?(\d+)$")
# taps renamed within bundle schema 1: old name's ending -> new one (a bundle written before holds the old name)
RENAMED_TAPS = {".mlp.gate": ".mlp.router_logits"}   # the MoE router's logits (`gate` is also attention's gate)


@dataclasses.dataclass
class Item:
    key: str                        # the bundle key "<step>/<role>/<name>" it matched
    source: str                     # file path (or container key) it came from
    array: np.ndarray | None        # as stored: 1-D for raw files (shape comes from the bundle)
    problem: str | None = None      # unreadable, truncated, ... (then array is None)
    reading: str | None = None      # the layout its source implies (a module-hook dump: refimpl.diff.hooks)


@dataclasses.dataclass
class Dump:
    path: Path
    items: dict                     # bundle key -> Item
    unknown: list                   # sources matching no bundle tensor, with the reason
    duplicates: list = dataclasses.field(default_factory=list)   # sources holding a tensor another source gives too


def sanitize(name: str) -> str:
    """The device toolchain's rewriting: ':', '/' and '-' become '_'."""
    return re.sub(r"[:/\-]", "_", name)


def _loose(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", name)


def read_json(path, what: str):
    """A JSON file the user gives (mapping, policy), bounded (refimpl.files.load_json), or a one-line InputError."""
    return load_json(path, what, InputError)


def read_mapping(path) -> dict:
    """A {golden name: device name} JSON file (QAIRT tensor_mapping.json) -> {device name: golden name}."""
    m = read_json(path, "mapping")
    if not isinstance(m, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in m.items()):
        raise InputError(f"{path}: mapping must be a JSON object {{golden name: device name}}")
    for golden in m:
        if renamed(golden):
            raise InputError(f"{path}: golden name {golden!r} is now named {renamed(golden)!r}")
    return {v: k for k, v in m.items()}


def read_dump(path, bundle, *, mapping: dict | None = None, dtype: str | None = None) -> Dump:
    """Read a device dump and match its tensors to `bundle`'s (a refimpl.bundle.Bundle).
    mapping: {device name: golden name}. dtype: of raw files: a dtype name, or "native" (the bundle's); default
    float32 (qnn-net-run), native when the dump is itself a refimpl bundle (has a manifest.json)."""
    duplicates = []
    matched, unknown = match_dump(path, bundle, mapping=mapping, dtype=dtype, duplicates=duplicates)
    dump = Dump(Path(path), {}, unknown, duplicates)
    for key, (source, load) in matched.items():
        try:
            array, problem = load(), None
        except FormatError as e:
            array, problem = None, str(e)
        dump.items[key] = Item(key, source, array, problem, load.reading)
    return dump


def renamed(name) -> str | None:
    """The current name of a tap `name` renamed since (RENAMED_TAPS), or None."""
    old = next((o for o in RENAMED_TAPS if isinstance(name, str) and name.endswith(o)), None)
    return None if old is None else name[:-len(old)] + RENAMED_TAPS[old]


def refuse_renamed_taps(manifest: dict, where) -> None:
    """A schema-1 bundle written before a tap was renamed (RENAMED_TAPS) is refused, naming the new name: its tap
    would otherwise silently match nothing."""
    if manifest.get("schema_version") != 1:   # renamed within schema 1, not a new schema
        return
    for rec in (manifest.get("tensors") or {}).values():
        name = rec.get("name") if isinstance(rec, dict) and rec.get("role") == "tap" else None
        if renamed(name):
            raise FormatError(f"{where}: tap {name!r} is now named {renamed(name)!r}; write the bundle again with "
                              f"this refimpl")


def match_dump(path, bundle, *, mapping: dict | None = None, dtype: str | None = None,
               duplicates: list | None = None) -> tuple[dict, list]:
    """The matching of read_dump without reading: ({bundle key: (source, load)}, unknown sources), where load()
    returns the array or raises FormatError. For dumps too large to hold at once (one window at a time).
    A file holding a tensor another file holds too (a module hook and the hook of the module whose output it
    returns: `mlp` and `mlp.down_proj`, `o_proj.input` and `eager_attention_forward`) is matched to it: the file
    named after the tensor (a mapping's, exactly, sanitised) is read, the other listed in `duplicates` (given a
    list; else in unknown)."""
    path = Path(path)
    refuse_renamed_taps(bundle.manifest, getattr(bundle, "path", "reference"))   # a Bundle, or a dataset reference
    is_bundle = (path / "manifest.json").is_file()   # the dump is itself a refimpl bundle
    if is_bundle:
        try:
            device = read_json(path / "manifest.json", "dump manifest")
        except InputError:
            device = {}   # not a manifest refimpl reads: its files are matched by name as any dump's
        refuse_renamed_taps(device if isinstance(device, dict) else {}, path)
    if dtype is None:
        dtype = "native" if is_bundle else "float32"
    if dtype != "native" and dtype not in DTYPES:
        raise InputError(f"dump dtype {brief(dtype)} is not 'native' or one of {', '.join(DTYPES)}")
    if not path.exists():
        raise InputError(f"{path}: no such dump file or directory")
    matcher = _Matcher(bundle.manifest, mapping or {})
    matched, unknown = {}, []
    if path.is_dir():
        entries = _directory(path)
    elif path.suffix == ".npz":
        regular_file(path, "dump", InputError)
        entries = _npz(path)
    elif path.suffix == ".safetensors":
        regular_file(path, "dump", InputError)
        entries = _safetensors(path)
    else:
        raise InputError(f"{path}: a dump must be a directory, a .npz or a .safetensors file")
    ranks = {}   # bundle key -> how its file matched: 0 by name, 1 as a hook name, 2 loosely
    for parts, source, load in entries:
        keys, why, rank = matcher.match(parts)
        if not keys:
            unknown.append(f"{source} ({why})")
            continue
        taken = [k for k in keys if k in matched]
        if taken and len(keys) == 1 and rank < ranks[keys[0]] and matched[keys[0]][1].part is None:
            old = matched.pop(keys[0])[0]   # a file named after the tensor wins over a hook holding it too
            (unknown if duplicates is None else duplicates).append(f"{old} (the same tensor as {source}: {keys[0]})")
        elif taken:
            (unknown if duplicates is None else duplicates).append(
                f"{source} (the same tensor as {matched[taken[0]][0]}: {taken[0]})")
            continue
        recs = [bundle.manifest["tensors"][k] for k in keys]
        widths = [r["shape"][-1] if r["shape"] else 1 for r in recs]
        reading = hooks.rename(parts[-1])[1] if len(keys) == 1 else None
        start = 0
        for key, rec, width in zip(keys, recs, widths):
            part = None if len(keys) == 1 else (start, start + width, sum(widths), [k.split("/", 2)[2] for k in keys])
            matched[key] = (source, _Loader(load, rec, dtype, part, reading))
            ranks[key] = rank
            start += width
    if not matched:
        raise InputError(f"{path}: no file of the dump matches a tensor of the bundle "
                         f"({len(unknown)} unknown, e.g. {unknown[:3]})")
    return matched, unknown


@dataclasses.dataclass
class _Loader:
    """One matched tensor's reader: loader() -> its array, or FormatError. part: (start, stop, total width, names)
    for a tap that a fused projection holds on its last axis beside others; reading: the layout its hook name
    implies (refimpl.diff.hooks)."""
    load: object
    rec: dict
    dtype: str
    part: tuple | None = None
    reading: str | None = None

    def __call__(self):
        if self.part is None:
            return self.load(self.rec, self.dtype)
        start, stop, total, names = self.part
        whole = {**self.rec, "shape": [*self.rec["shape"][:-1], total]}
        a = self.load(whole, self.dtype)
        a = a.reshape(whole["shape"]) if a.ndim == 1 else a
        if a.shape[-1] != total:
            raise FormatError(f"last axis {a.shape[-1]}, expected {total} for {' + '.join(names)} side by side")
        return a[..., start:stop]


# --------------------------------------------------------------------------------------------- containers

def _directory(root: Path):
    """(path parts, source, loader) for every file under root; parts = step / role hints and the name. Symlinked
    directories are listed, not followed; a file's loader checks it resolves inside root and is a regular file."""
    bundle = (root / "manifest.json").is_file()  # a refimpl bundle as the dump: only its steps/ hold tensors
    found = []
    for d, dirs, files in os.walk(root):
        found += [Path(d, n) for n in files + [n for n in dirs if os.path.islink(os.path.join(d, n))]]
    for f in sorted(found):
        rel = f.relative_to(root).parts
        if bundle and rel[0] != "steps":
            continue
        if f.suffix not in SUFFIXES:
            yield (*rel[:-1], f.name), str(f), _unsupported(f)
            continue
        yield (*rel[:-1], f.name[:-len(f.suffix)]), str(f), _file_loader(root, f)


def _unsupported(f: Path):
    def load(rec, dtype):
        raise FormatError(f"{f}: not a .raw / .npy file")
    return load


def _file_loader(root: Path, f: Path):
    def load(rec, dtype):
        inside(root, f.relative_to(root).as_posix(), "dump file")   # no symlink out of the dump
        size = regular_file(f, "dump file")
        if f.suffix == ".npy":
            try:
                with open(f, "rb") as fh:
                    return _npy(fh, size, rec, str(f))
            except OSError as e:
                raise FormatError(f"{f}: cannot read ({e.strerror or e})") from None
        return _from_raw(size, lambda: read_exact(f, size), rec, dtype, str(f))
    return load


# np.savez writes members stored, np.savez_compressed deflated; deflate expands at most ~1032:1
_ZIP_RATIO = {zipfile.ZIP_STORED: 1, zipfile.ZIP_DEFLATED: 1032}
_ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, NotImplementedError,
               RuntimeError, zlib.error, struct.error)


def _npz(path: Path):
    try:
        z = zipfile.ZipFile(path)
        infos = z.infolist()
        archive = os.fstat(z.fp.fileno()).st_size
    except _ZIP_ERRORS as e:
        raise FormatError(f"{path}: corrupt .npz ({brief(str(e), 120)})") from None
    for info in infos:
        member = info.filename
        key = member[:-4] if member.endswith(".npy") else member

        def load(rec, dtype, info=info, member=member):
            where = f"{path}[{member}]"
            ratio = _ZIP_RATIO.get(info.compress_type)
            if ratio is None:
                raise FormatError(f"{where}: compression method {info.compress_type} (np.savez writes stored or "
                                  f"deflated members)")
            if info.header_offset + info.compress_size > archive or info.file_size > ratio * info.compress_size + 64:
                raise FormatError(f"{where}: declares {info.file_size} bytes from {info.compress_size} compressed "
                                  f"in an archive of {archive} (corrupt)")
            try:
                with z.open(info) as fh:
                    return _npy(fh, info.file_size, rec, where)
            except _ZIP_ERRORS as e:
                raise FormatError(f"{where}: corrupt member ({brief(str(e), 120)})") from None
        yield tuple(key.split("/")), f"{path}[{key}]", load


def _npy(fh, size: int, rec: dict, where: str) -> np.ndarray:
    """The array of an .npy stream of `size` bytes: its header checked (version, a numeric dtype, a shape of sizes
    >= 0) and the data it declares against the bytes that follow, before anything is allocated."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(fh)
        read_header = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}.get(version)
        if read_header is None:
            raise FormatError(f"{where}: .npy format version {version}, expected 1.0 or 2.0")
        shape, fortran, dt = read_header(fh)
    except FormatError:
        raise
    except (ValueError, TypeError, SyntaxError, tokenize.TokenError, RecursionError, MemoryError, EOFError) as e:
        raise FormatError(f"{where}: damaged .npy header ({brief(str(e), 120)})") from None
    if len(shape) > 32 or any(n < 0 for n in shape):
        raise FormatError(f"{where}: .npy shape {brief(shape)} (at most 32 sizes >= 0)")
    bf16 = dt.kind == "V" and dt.itemsize == 2 and not dt.names and rec["dtype"] == "bfloat16"  # np.save of bf16
    if dt.kind not in "biuf" and not bf16:
        raise FormatError(f"{where}: .npy dtype {brief(dt.str)} is not a number type")
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes != size - fh.tell():
        raise FormatError(f"{where}: the header declares {dt.str} {list(shape)} ({nbytes} bytes), but "
                          f"{size - fh.tell()} bytes follow it")
    data = fh.read(nbytes)
    if len(data) != nbytes:
        raise FormatError(f"{where}: truncated ({len(data)} of {nbytes} bytes)")
    a = np.frombuffer(data, ml_dtypes.bfloat16 if bf16 else dt).reshape(shape, order="F" if fortran else "C")
    return _from_npy(a, rec)


def _safetensors(path: Path):
    problems = {}
    arrays = read_safetensors(path, problems)
    for key in [*arrays, *problems]:
        def load(rec, dtype, key=key):
            if key in problems:
                raise FormatError(problems[key])
            return _from_npy(np.asarray(arrays[key]), rec)
        yield tuple(key.split("/")), f"{path}[{key}]", load


def _from_npy(a: np.ndarray, rec: dict) -> np.ndarray:
    if rec["dtype"] == "bfloat16" and a.dtype == np.uint16:  # bf16 stored as its bits (NumPy has no bf16)
        return a.view(ml_dtypes.bfloat16)
    return a


def _from_raw(size: int, read, rec: dict, dtype: str, where: str) -> np.ndarray:
    """A headerless file of `size` bytes, checked against the bundle's shape before read() reads it."""
    dt = DTYPES[rec["dtype"] if dtype == "native" else dtype]
    n = math.prod(rec["shape"])
    if size != n * dt.itemsize:
        hint = [name for name, d in DTYPES.items() if size == n * d.itemsize and d.itemsize != dt.itemsize]
        hint = f"; the size fits {' / '.join(hint)} (--dump-dtype)" if hint else ""
        raise FormatError(f"{where}: {size} bytes, expected {n * dt.itemsize} for {dt.name} {rec['shape']} "
                          f"(truncated or corrupt{hint})")
    return np.frombuffer(read(), dt)


# --------------------------------------------------------------------------------------------- matching

class _Matcher:
    """Resolves (directory parts..., name) to a bundle key "<k>/<role>/<name>"."""

    def __init__(self, manifest: dict, mapping: dict):
        self.steps, self.mapping = manifest["steps"], mapping
        self.by_step = []
        for s in self.steps:
            exact, loose = {}, {}
            for role in ("output", "tap", "input"):  # preference when a name is both (device dumps outputs)
                for n in s[ROLES[role]]:
                    exact.setdefault(n, []).append(role)
                    loose.setdefault(_loose(n), []).append((role, n))
            self.by_step.append((exact, loose))

    def match(self, parts: tuple) -> tuple[list[str], str, int]:
        """The bundle keys a dumped file holds (several: a fused projection) or [] and why not, and how it
        matched: 0 by name (a mapping's, exactly or sanitised), 1 as a module-hook name, 2 loosely."""
        *dirs, name = parts
        step, role = None, None
        for i, d in enumerate(dirs):  # the first Result_<k> / layer_outputs_<k> / <k> directory is the step
            m = _STEP_DIR.fullmatch(d)
            if m:
                step, rest = int(m[1]), dirs[i + 1:]
                role = _ROLE_DIRS.get(rest[0]) if rest else None
                name = "/".join([*rest[1 if role else 0:], name])  # names with "/" become subdirectories
                break
        else:
            name = "/".join([*dirs, name])
        if step is None:
            if len(self.steps) != 1:
                return [], "no step: put it under Result_<k>/ or steps/<k>/ (the bundle has several steps)", 0
            step = 0
        if step >= len(self.steps):
            return [], f"step {step}, the bundle has {len(self.steps)}", 0
        exact, loose = self.by_step[step]
        golden = self.mapping.get(name) or self.mapping.get(sanitize(name))
        for candidate in (golden, name, sanitize(name)):
            roles = exact.get(candidate) if candidate else None
            if roles:
                r = role if role in roles else roles[0]
                return [f"{step}/{r}/{candidate}"], "", 0
        alternatives, _ = hooks.rename(name)  # a module-hook name (refimpl.diff.hooks)
        for taps in alternatives:
            if all("tap" in exact.get(t, ()) for t in taps):
                return [f"{step}/tap/{t}" for t in taps], "", 1
        hits = loose.get(_loose(name), [])
        if role:
            hits = [h for h in hits if h[0] == role] or hits
        names = {n for _, n in hits}
        if len(names) == 1:
            r, n = hits[0]
            return [f"{step}/{r}/{n}"], "", 2
        if len(names) > 1:
            return [], f"ambiguous: matches {sorted(names)}; give a mapping file", 0
        return [], f"no tensor of step {step} is named like it", 0
