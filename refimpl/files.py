"""Reading files other tools wrote, defensively: one place for the checks every reader makes before it trusts a file.

    doc = load_json(path, "policy", InputError)           # bounded size and nesting, UTF-8, one-line errors
    f = inside(bundle_dir, rec["file"], "tensor 0/input/x")  # a path a file names, kept inside its directory
    size = regular_file(f, "tensor 0/input/x")              # a regular file (not a directory, FIFO or /dev/zero)
    data = read_exact(f, size)                              # never more than the bytes declared
    digest = sha256_file(f)                                 # streamed: a 10 GB file is never held at once

Every failure is the given refimpl error (FormatError by default) whose one-line message names the file and the
field. The limits are far above what real files hold: they stop a damaged or hostile file from making a reader
recurse, allocate or read without bound, not real models.

Writing is crash-safe: atomic_path / write_atomic (a file) and atomic_directory (a directory tree) put the whole
new content in place, or leave what was there, at every instant (an existing tree is swapped with the new one in
one step: exchange, Linux renameat2(RENAME_EXCHANGE); where that is unavailable, recover() completes a replacement
a dead writer left half done). Files and directories are fsynced before they are put in place, and the parent
directory after. discard removes a tree in one rename. tests/test_crash_points.py kills every writer at each of its
file-system calls in turn.

Every scan of input is linear in its size (json_depth: one regular-expression pass that never backtracks), so a
damaged file is refused in time proportional to its size (tests/fuzz: 5 s of CPU per case).
"""

import contextlib
import ctypes
import errno
import functools
import glob
import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import stat
from pathlib import Path

import numpy as np

from .errors import FormatError, InputError, brief

_log = logging.getLogger(__name__)

MAX_JSON_DEPTH = 64            # deepest nesting any JSON refimpl reads has is ~6 (encodings, manifests)
MAX_JSON_BYTES = 2 << 30       # a manifest of a 100-layer model with every tap is a few MB; AIMET encodings ~100 MB
# a JSON string literal, escapes included, or an unterminated one up to the end: it matches at every quote it is
# tried at (possessive loops, then a quote or the end), so re.sub never backtracks nor retries from a later quote
# inside the same string: one pass over the text (the form that fails on an unterminated string and is retried from
# each quote in it was quadratic: a 100 KB damaged safetensors header of escaped quotes took minutes)
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.S)
_BRACKETS = np.zeros(256, np.int8)
_BRACKETS[[ord("["), ord("{")]], _BRACKETS[[ord("]"), ord("}")]] = 1, -1
# what atomic_directory leaves beside its target while it writes: .<target>.tmp-<pid>-<hex>, .<target>.old-<pid>-<hex>
_STALE = re.compile(r"\.(?P<target>.+)\.(?P<kind>tmp|old)-(?P<token>(?P<pid>\d+)-[0-9a-f]{8})")


def json_depth(data: bytes) -> int:
    """The deepest nesting of [ and { in JSON text (brackets inside strings not counted)."""
    skeleton = np.frombuffer(_STRING.sub(b"", data), np.uint8)
    steps = _BRACKETS[skeleton]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0)) if steps.size else 0


def parse_json(data: bytes | str, where: str, error=FormatError, max_depth: int = MAX_JSON_DEPTH):
    """JSON text -> Python objects, or `error` naming `where`: not UTF-8, not JSON, nested deeper than max_depth
    (a recursive reader of it, or json itself, would run out of stack), or numbers beyond Python's int limit."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    depth = json_depth(data)
    if depth > max_depth:
        raise error(f"{where}: JSON nested {depth} levels deep; at most {max_depth} are read")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg}: line {e.lineno} column {e.colno})") from None
    except (ValueError, RecursionError) as e:   # e.g. an integer of more than 4300 digits
        raise error(f"{where}: not readable JSON ({brief(str(e), 120)})") from None


def load_json(path, what: str = "JSON", error=FormatError, max_bytes: int = MAX_JSON_BYTES,
              max_depth: int = MAX_JSON_DEPTH):
    """A JSON file, bounded: a regular file of at most max_bytes, valid UTF-8 JSON nested at most max_depth levels.
    `what` names the file's role in messages ("policy", "encodings", ...)."""
    path = Path(path)
    size = regular_file(path, f"{what} file", error)
    if size > max_bytes:
        raise error(f"{path}: {what} file of {size} bytes; at most {max_bytes} are read")
    return parse_json(read_exact(path, size, error), str(path), error, max_depth)


def regular_file(path, what: str = "file", error=FormatError) -> int:
    """The size of `path`, which must be a regular file (symlinks followed): not missing, not a directory, FIFO,
    socket or device (reading /dev/zero never ends)."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path}: no such file ({what})") from None
    except (OSError, ValueError) as e:   # ValueError: a NUL in the path, ELOOP: a symlink loop
        raise error(f"{path}: {what} cannot be opened ({getattr(e, 'strerror', None) or e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{path}: {what} is a directory, expected a file")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: {what} is not a regular file (a device, FIFO or socket)")
    return st.st_size


def read_exact(path, size: int, error=FormatError) -> bytes:
    """The first `size` bytes of a file, and a check that there are no more (a file that changes while read)."""
    try:
        with open(path, "rb") as f:
            data = f.read(size + 1)
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    if len(data) != size:
        raise error(f"{path}: {len(data) if len(data) <= size else 'more than ' + str(size)} bytes, expected "
                    f"{size} (changed while read?)")
    return data


def sha256_file(path, what: str = "file", error=FormatError, chunk: int = 1 << 22) -> tuple[str, int]:
    """(sha256 hex digest, size) of a regular file, read in chunks."""
    regular_file(path, what, error)
    h, n = hashlib.sha256(), 0
    try:
        with open(path, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
                n += len(block)
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    return h.hexdigest(), n


def output_file(path, what: str = "output", error=InputError) -> Path:
    """A path to write a file to (atomically: a temporary file beside it, renamed into place): it must name a file,
    not '', '.', '..' or an existing directory."""
    path = Path(path)
    if path.name in ("", ".", "..") or os.path.isdir(path):
        raise error(f"{brief(str(path))}: the {what} must be a file path, not a directory")
    return path


@contextlib.contextmanager
def atomic_path(path, what: str = "output", error=InputError):
    """A temporary path `.<name>.tmp-<pid>-<random>` beside `path` to write the whole file to; fsynced and renamed
    over `path` (the directory then fsynced) when the block ends without an exception, removed otherwise. So `path`
    is either absent, the old file or the whole new one, never a part, after a crash (SIGKILL) or a power loss.
    OSError while writing or renaming: `error` naming `path`. Temporaries of `path` that dead writers left are
    removed first.

        with atomic_path(out, "GGUF file") as tmp:
            writer = GGUFWriter(tmp, ...); ...
    """
    path = output_file(path, what, error)
    tmp = path.with_name(f".{path.name}.tmp-{_token()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(path.parent, path.name)
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())                   # the content on disk before the name points at it
        os.replace(tmp, path)
        _fsync_dir(path.parent)                    # and the name itself
    except OSError as e:
        raise error(f"{path}: cannot write the {what} ({e.strerror or e})") from None
    finally:
        if os.path.lexists(tmp):
            tmp.unlink()


def write_atomic(path, content, what: str = "output", error=InputError) -> None:
    """Write text, bytes or an iterable of byte chunks (a file larger than memory) atomically (atomic_path)."""
    with atomic_path(path, what, error) as tmp:
        if isinstance(content, str):
            tmp.write_text(content, encoding="utf-8")
        else:
            with open(tmp, "wb") as f:
                for chunk in [content] if isinstance(content, (bytes, bytearray, memoryview)) else content:
                    f.write(chunk)


@contextlib.contextmanager
def atomic_directory(path, overwrite: bool = False, what: str = "output", error=InputError):
    """A temporary directory `.<name>.tmp-<pid>-<random>` beside `path` to write a whole directory tree into (each
    file fsynced by its writer). When the block ends without an exception, every directory of the tree is fsynced
    and the tree put in place; otherwise it is removed. So `path` is the old tree or the whole new one (absent if
    there was none) at every instant, even after a crash (SIGKILL) or, once this returns, a power loss.

    An existing `path` is replaced only with overwrite: on Linux the two trees are swapped in one step
    (renameat2(RENAME_EXCHANGE)) and the old one, now under the temporary name, removed. Where that call is
    unavailable (another system; a file system without it: EINVAL) the old tree is moved aside to
    `.<name>.old-<pid>-<random>` (the temporary's suffix) and the new one renamed in; a crash between the two renames
    leaves no `path`, which `recover` (run by the next writer, and by readers such as read_bundle) mends by renaming
    the complete new tree in, saying so in one logged warning. Temporaries that dead writers left beside `path` are
    removed first.

        with atomic_directory(out, overwrite, "bundle") as tmp:
            (tmp / "manifest.json").write_bytes(...)
    """
    target = Path(path)
    recover(target, what)
    if os.path.lexists(target) and not overwrite:
        raise error(f"{target}: already exists (pass overwrite=True to replace it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(target.parent)
    token = _token()
    tmp = target.parent / f".{target.name}.tmp-{token}"
    tmp.mkdir()
    try:
        yield tmp
        for d, _, _ in os.walk(tmp):
            _fsync_dir(d)                          # every entry of the new tree on disk before it is put in place
        _move_into_place(tmp, target, token, overwrite, what, error)
    finally:
        if os.path.lexists(tmp):                   # the unfinished new tree, or the old one after a swap
            _remove_tree(tmp)


def discard(path) -> None:
    """Remove a directory tree (or a file) in one step as far as readers see: renamed to a temporary name beside it
    (`.<name>.tmp-<pid>-<random>`, which the next atomic_path / atomic_directory / discard beside it sweeps if this
    process dies), then removed."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    gone = path.parent / f".{path.name}.tmp-{_token()}"
    os.rename(path, gone)
    _fsync_dir(path.parent)
    _remove_tree(gone)
    _remove_stale(path.parent, path.name)


def sweep(path) -> None:
    """Remove what dead writers left beside `path` (its `.<name>.tmp-*` / `.<name>.old-*`), after finishing a
    replacement of it that one left half done (recover). For writers that build `path` in place (a resumable
    dataset reference) rather than through atomic_path / atomic_directory, which sweep by themselves."""
    path = Path(path)
    if path.parent.is_dir():
        _remove_stale(path.parent, path.name)


def recover(path, what: str = "output") -> bool:
    """Finish a replacement of the directory `path` that a dead writer left half done (atomic_directory without
    RENAME_EXCHANGE, killed between its two renames): `path` absent, `.<name>.old-<pid>-<r>` and normally
    `.<name>.tmp-<pid>-<r>` beside it, pid dead. The new tree (complete: the old one is moved aside only once the
    new one is whole and fsynced) is renamed to `path`, or the old one when the new one is gone; one warning is
    logged. True if `path` was restored. A reader calls this before it reports `path` missing.

    An `.old-*` without its `.tmp-*` partner is never put back: the replacement it belonged to was finished (the
    target was then removed by someone else, or the old tree was being deleted), so it may be partial."""
    target = Path(path)
    if os.path.lexists(target):
        return False
    try:
        olds = list(target.parent.glob(f".{glob.escape(target.name)}.old-*"))
    except OSError:
        return False
    swaps = []                                     # (the new tree, its writer's pid) of interrupted replacements
    for old in olds:
        m = _STALE.fullmatch(old.name)
        if not m or m["target"] != target.name or _alive(m["token"]):
            continue
        new = target.parent / f".{target.name}.tmp-{m['token']}"
        if new.is_dir() and not new.is_symlink():
            swaps.append((new, m["pid"]))
    if not swaps:
        return False
    new, pid = max(swaps, key=lambda s: s[0].stat().st_mtime_ns)   # several dead writers: the newest tree wins
    try:
        os.rename(new, target)
        _fsync_dir(target.parent)
    except OSError:                                # another process restored it first, or a read-only directory
        return False
    _log.warning(f"{target}: a writer (pid {pid}) died while replacing this {what}; restored the new one from "
                 f"{new.name}")
    return True


_MINE: set[str] = set()   # the tokens this process made: another entry with its pid is a dead writer's (pid reuse)


def _token() -> str:
    token = f"{os.getpid()}-{secrets.token_hex(4)}"
    _MINE.add(token)
    return token


def _fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() and not path.is_symlink() else \
        path.unlink(missing_ok=True)


_RENAME_EXCHANGE = 2       # linux/fs.h
_AT_FDCWD = -100
_NO_EXCHANGE = (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)   # no syscall; not on this file system


@functools.lru_cache(maxsize=1)
def _renameat2():
    """libc's renameat2 (glibc >= 2.28), or None (another C library or system)."""
    try:
        f = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    f.restype = ctypes.c_int
    return f


def exchange(a, b) -> bool:
    """Swap two existing paths in one atomic step (Linux renameat2 with RENAME_EXCHANGE): True when done, False
    where the call is unavailable (no such function or syscall, or a file system without it); other failures:
    OSError."""
    f = _renameat2()
    if f is None:
        return False
    if f(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _move_into_place(tmp: Path, target: Path, token: str, overwrite: bool, what: str, error) -> None:
    try:
        if not os.path.lexists(target):
            os.rename(tmp, target)
        elif not overwrite:
            raise error(f"{target}: already exists (pass overwrite=True to replace it)")
        elif exchange(tmp, target):                # target: the new tree; tmp: the old one, removed by the caller
            pass
        else:
            old = target.parent / f".{target.name}.old-{token}"
            os.rename(target, old)
            # a crash here leaves no target: recover() renames tmp (whole and fsynced) into place
            try:
                os.rename(tmp, target)
            except BaseException:
                os.rename(old, target)
                raise
            _fsync_dir(target.parent)
            trash = target.parent / f".{target.name}.tmp-{_token()}"
            os.rename(old, trash)                  # a crash while it is removed: a temporary, swept, never restored
            _remove_tree(trash)
        _fsync_dir(target.parent)
    except OSError as e:
        raise error(f"{target}: cannot move the {what} into place ({e.strerror or e})") from None


def _remove_stale(parent: Path, target: str | None = None) -> None:
    """Remove temporaries left by writers that died: `.<name>.tmp-<pid>-<rand>` of a dead pid, and
    `.<name>.old-<pid>-<rand>` (a replaced tree) of a dead pid once `<name>` exists again; those of `target` only,
    when given."""
    found = [(p, m) for p in (parent.glob(f".{glob.escape(target)}.*") if target else parent.iterdir())
             if (m := _STALE.fullmatch(p.name)) and not _alive(m["token"])]
    for name in {m["target"] for p, m in found if m["kind"] == "old"}:
        recover(parent / name)                     # an interrupted replacement: its new tree is kept, not swept
    for p, m in found:
        if os.path.lexists(p) and (m["kind"] == "tmp" or os.path.lexists(parent / m["target"])):
            _remove_tree(p)


def _alive(token: str) -> bool:
    """Whether the writer of a temporary named with `token` (`<pid>-<random>`) may still be running: a process of
    that pid exists here (this process only for tokens it made). Writers in another pid namespace or on another host
    sharing the directory cannot be seen: see docs/bundle.md."""
    pid = int(token.split("-")[0])
    if pid == os.getpid():
        return token in _MINE
    try:
        os.kill(pid, 0) if 0 < pid <= 2 ** 31 - 1 else None
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return 0 < pid <= 2 ** 31 - 1


def inside(root, rel, what: str, error=FormatError, links_out: bool = False) -> Path:
    """root / rel for a relative path `rel` that a file names (a bundle's tensor file, a checkpoint's shard), checked
    to stay inside root: a non-empty relative str with no '..' part and no NUL, which (symlinks followed) resolves
    inside root. links_out: a symlink may lead elsewhere (a Hugging Face cache snapshot links every file to a blob
    outside it); the name itself must still be inside. The file need not exist."""
    root = Path(root)
    if not isinstance(rel, str) or not rel or "\0" in rel or "\\" in rel:
        raise error(f"{root}: {what}: path {brief(rel)} is not a relative file path")
    parts = Path(rel).parts
    if Path(rel).is_absolute() or ".." in parts:
        raise error(f"{root}: {what}: path {brief(rel)} leaves the directory (absolute, or with '..')")
    path = root / rel
    if links_out:
        return path
    try:
        real, base = path.resolve(), root.resolve()
    except (OSError, RuntimeError) as e:   # a symlink loop
        raise error(f"{root}: {what}: path {brief(rel)} cannot be resolved ({e})") from None
    if not real.is_relative_to(base):
        raise error(f"{root}: {what}: {brief(rel)} is a symlink to {brief(str(real))}, outside the directory")
    return path


# ------------------------------------------------------------------------------------ fields of parsed documents

def expect(value, types, where: str, error=FormatError, what: str | None = None):
    """value, checked to be an instance of `types` (bool never counts as int or float)."""
    types = types if isinstance(types, tuple) else (types,)
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok:
        names = what or " or ".join({dict: "an object", list: "a list", str: "a string", int: "an integer",
                                     float: "a number", bool: "true / false", type(None): "null"}.get(t, t.__name__)
                                    for t in types)
        raise error(f"{where}: expected {names}, got {brief(value)}")
    return value


def integer(value, where: str, error=FormatError, lo: int | None = None, hi: int | None = None) -> int:
    """An int (not a bool) in [lo, hi]."""
    expect(value, int, where, error)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"[{lo}, {hi}]" if lo is not None and hi is not None else f">= {lo}" if lo is not None else f"<= {hi}"
        raise error(f"{where}: {brief(value)} is out of range (expected {bounds})")
    return value


def number(value, where: str, error=FormatError, finite: bool = True) -> float:
    """An int or float (not a bool), finite unless told otherwise."""
    expect(value, (int, float), where, error, "a number")
    if finite and not math.isfinite(value):
        raise error(f"{where}: expected a finite number, got {value!r}")
    return value
