"""Edits of a case's files, as JSON-serialisable ops (so a case found once is committed as its ops), and the random
choice of them.

    ["flip", file, offset, mask]        xor one byte            ["truncate", file, length]
    ["set", file, offset, hex]          overwrite bytes         ["insert", file, offset, hex(, times)]
    ["delete", file, offset, length]                            ["append", file, hex]
    ["json", file, path, action, value] a structural edit of a JSON file (path: keys / indices from the root;
                                        action: set | delete | dupkey | rename | wrap; value: a value spec)
    ["st", file, path, action, value]   the same on a safetensors file's JSON header (its length rewritten)
    ["npy", file, header]               a .npy file's header dict text replaced (the data kept)
    ["gguf", file, edit]                a structural edit of a GGUF file (refimpl/formats/gguf/reader.py's layout; see
                                        gguf_edit below)
    ["symlink", file, target]           the file replaced by a symlink: "outside" (a file beside the case
                                        directory), "/dev/zero", "self" (a loop), "abs:<file>" (an absolute path to
                                        another file of the case)
    ["mkdir", file] ["remove", file] ["fifo", file] ["copy", src, dst] ["write", file, hex]

Value specs: a plain JSON value, or {"$": kind, ...}: nan, inf, -inf, big (an integer of n digits), deep (n nested
lists or objects), copy (the value at another path), float (1e999).
"""

import json
import os
import random
import struct
from pathlib import Path

# ------------------------------------------------------------------------------------------------ applying

SPECIAL = [{"$": "nan"}, {"$": "inf"}, {"$": "-inf"}, {"$": "big", "n": 5000}, {"$": "big", "n": 30},
           {"$": "deep", "n": 100000, "kind": "list"}, {"$": "deep", "n": 3000, "kind": "object"},
           {"$": "deep", "n": 70, "kind": "list"}, {"$": "float"}]
VALUES = [None, True, False, 0, -1, 1, 2, 3, 7, 255, 65536, 2**31, 2**32 + 1, 2**53 + 1, 2**63 - 1, 2**63, 2**64,
          -2**63, 10**30, 0.5, -0.0, 1e-300, 1e308, "", "x", "..", "../..", "/dev/zero", "/etc/passwd",
          "a/../../b", "steps/0/../../../outside", "\u0000", "\u00e9", "[", "(?", "*", "x" * 5000, [], [0], [[0, 1]],
          [-1], [None], ["x"], {}, {"a": 1}, {"": None}]


def _raw(spec) -> str | None:
    """The JSON text of a special value spec, or None for a plain value."""
    if not (isinstance(spec, dict) and "$" in spec):
        return None
    kind = spec["$"]
    if kind == "nan":
        return "NaN"
    if kind in ("inf", "-inf"):
        return "Infinity" if kind == "inf" else "-Infinity"
    if kind == "float":
        return "1e999"
    if kind == "big":
        return "9" * spec["n"]
    if kind == "deep":
        return "[" * spec["n"] + "]" * spec["n"] if spec["kind"] == "list" else '{"a":' * spec["n"] + "1" + "}" * \
            spec["n"]
    raise ValueError(kind)


def _get(doc, path):
    for p in path:
        doc = doc[p]
    return doc


def json_edit(text: str, path: list, action: str, value) -> str:
    """A JSON document's text with one structural edit applied."""
    doc = json.loads(text)
    raws = {}

    def put(v):
        if isinstance(v, dict) and v.get("$") == "copy":
            try:
                return json.loads(json.dumps(_get(doc, v["path"])))
            except (KeyError, IndexError, TypeError):
                return None
        raw = _raw(v)
        if raw is None:
            return v
        token = f"\u0001fuzz{len(raws)}\u0001"
        raws[json.dumps(token)] = raw
        return token

    if not path:
        if action == "set":
            doc = put(value)
    else:
        try:
            parent, key = _get(doc, path[:-1]), path[-1]
            if action == "set":
                parent[key] = put(value)
            elif action == "delete":
                del parent[key]
            elif action == "wrap":
                parent[key] = [parent[key]]
            elif action == "rename" and isinstance(parent, dict):
                parent[str(value)] = parent.pop(key)
            elif action == "dupkey" and isinstance(parent, dict):
                token = f"\u0001fuzz{len(raws)}\u0001"
                # the key written twice: first the given value, then the original (json keeps the last)
                raws[json.dumps(token) + ": null"] = (f"{json.dumps(key)}: {json.dumps(put(value))}, "
                                                      f"{json.dumps(key)}: {json.dumps(parent[key])}")
                del parent[key]
                parent[token] = None
        except (KeyError, IndexError, TypeError):
            pass
    out = json.dumps(doc)
    for token, raw in raws.items():
        out = out.replace(token, raw)
    return out


def apply(root: Path, op: list) -> None:
    """One op on the case directory `root` (whose parent holds `outside`, a file no reader may open)."""
    kind, rel = op[0], op[1]
    path = root / rel
    if kind in ("flip", "set", "truncate", "insert", "delete", "append"):
        if not path.is_file() or path.is_symlink():
            return
        data = bytearray(path.read_bytes())
        if kind == "flip" and data:
            data[op[2] % len(data)] ^= op[3]
        elif kind == "set":
            at = min(op[2], len(data))
            new = bytes.fromhex(op[3])
            data[at:at + len(new)] = new
        elif kind == "truncate":
            del data[op[2]:]
        elif kind == "insert":
            data[op[2]:op[2]] = bytes.fromhex(op[3]) * (op[4] if len(op) > 4 else 1)
        elif kind == "delete":
            del data[op[2]:op[2] + op[3]]
        elif kind == "append":
            data += bytes.fromhex(op[2])
        path.write_bytes(bytes(data))
    elif kind == "json":
        if path.is_file() and not path.is_symlink():
            try:
                path.write_text(json_edit(path.read_text(), *op[2:]))
            except (ValueError, RecursionError):
                pass
    elif kind == "st":
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            if len(data) < 8:
                return
            (n,) = struct.unpack("<Q", data[:8])
            try:
                header = json_edit(data[8:8 + n].decode(), *op[2:]).encode()
            except (ValueError, RecursionError):
                return
            path.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + n:])
    elif kind == "npy":
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            if len(data) < 12:   # cut short by an earlier op: no header to replace
                return
            major = data[6]
            hlen, start = (struct.unpack("<H", data[8:10])[0], 10) if major == 1 else (
                struct.unpack("<I", data[8:12])[0], 12)
            header = op[2].encode("latin1")
            pad = (-(start + len(header) + 1)) % 64
            header = header + b" " * pad + b"\n"
            size = struct.pack("<H", len(header)) if major == 1 and len(header) < 65536 else None
            if size is None:
                out = data[:6] + bytes([2, 0]) + struct.pack("<I", len(header)) + header + data[start + hlen:]
            else:
                out = data[:8] + size + header + data[start + hlen:]
            path.write_bytes(out)
    elif kind == "gguf":
        from .gguf_edit import edit
        if path.is_file() and not path.is_symlink():
            path.write_bytes(edit(path.read_bytes(), op[2]))
    elif kind in ("symlink", "mkdir", "remove", "fifo", "write"):
        _remove(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "symlink":
            target = op[2]
            target = (root.parent / "outside" if target == "outside" else path if target == "self"
                      else (root / target[4:]).resolve() if target.startswith("abs:") else Path(target))
            os.symlink(target, path)
        elif kind == "mkdir":
            path.mkdir()
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "write":
            path.write_bytes(bytes.fromhex(op[2]))
    elif kind == "copy":
        src, dst = root / op[1], root / op[2]
        if src.is_file() and not src.is_symlink() and src != dst:
            _remove(dst)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
    else:
        raise ValueError(f"unknown op {kind!r}")


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file() or path.exists() and not path.is_dir():
        path.unlink()
    elif path.is_dir():
        import shutil
        shutil.rmtree(path)


# ------------------------------------------------------------------------------------------------ choosing

def offset(rng: random.Random, size: int) -> int:
    """A byte offset, most often near the start (headers), else anywhere."""
    if size <= 1:
        return 0
    return min(size - 1, int(rng.expovariate(1 / 64))) if rng.random() < 0.6 else rng.randrange(size)


def byte_op(rng: random.Random, rel: str, size: int) -> list:
    kind = rng.choice(["flip", "flip", "set", "truncate", "insert", "delete", "append"])
    at = offset(rng, size)
    if kind == "flip":
        return ["flip", rel, at, 1 << rng.randrange(8) if rng.random() < 0.7 else rng.randrange(1, 256)]
    if kind == "set":
        n = rng.choice([1, 2, 4, 8])
        fill = rng.choice([b"\xff", b"\x00", b"\x7f", b"\x80", None])
        data = (fill * n) if fill else bytes(rng.randrange(256) for _ in range(n))
        return ["set", rel, at, data.hex()]
    if kind == "truncate":
        return ["truncate", rel, rng.choice([0, at, size - 1, size // 2, max(0, size - rng.randrange(1, 64))])]
    if kind == "insert":
        return ["insert", rel, at, bytes(rng.randrange(256) for _ in range(rng.choice([1, 3, 8, 100]))).hex()]
    if kind == "delete":
        return ["delete", rel, at, rng.choice([1, 4, 8, 100])]
    return ["append", rel, bytes(rng.randrange(256) for _ in range(rng.choice([1, 8, 1000]))).hex()]


def json_paths(doc, limit: int = 20000) -> list:
    """Every path in a JSON document (breadth first, at most `limit`)."""
    out, queue = [], [([], doc)]
    while queue and len(out) < limit:
        path, node = queue.pop(0)
        out.append(path)
        if isinstance(node, dict):
            queue += [([*path, k], v) for k, v in node.items()]
        elif isinstance(node, list):
            queue += [([*path, i], v) for i, v in enumerate(node)]
    return out


def value(rng: random.Random, old=None, paths=()):
    """A replacement value: special (NaN, huge, deep), a plain one of another type, a tweak of the old one, or a
    copy of another node (type confusion with a plausible value)."""
    r = rng.random()
    if r < 0.12:
        return rng.choice(SPECIAL)
    if r < 0.2 and paths:
        return {"$": "copy", "path": rng.choice(paths)}
    if r < 0.55 and isinstance(old, (int, float)) and not isinstance(old, bool):
        return rng.choice([old + 1, old - 1, -old, old * 2**20, old * 2**40, 0, old // 2 if isinstance(old, int)
                           else old / 2, old + 0.5])
    if r < 0.55 and isinstance(old, str):
        return rng.choice(["../" + old, old + "/..", "/" + old, old + "x", old[:-1], old.upper(), old * 3, "",
                           old.replace("/", "/../", 1), old + "\n"])
    if r < 0.55 and isinstance(old, list) and old:
        return rng.choice([old[:-1], old + old[-1:], old[::-1], [old], old * 3, old[1:]])
    return rng.choice(VALUES)


def json_op(rng: random.Random, rel: str, doc, paths=None, prefer=None, kind: str = "json") -> list:
    """A structural edit of the JSON document `doc` (stored at `rel`). prefer(path) -> weight biases the choice."""
    paths = paths if paths is not None else json_paths(doc)
    if prefer is not None and rng.random() < 0.7:
        weighted = [p for p in paths if prefer(p)]
        paths_to_pick = weighted or paths
    else:
        paths_to_pick = paths
    path = rng.choice(paths_to_pick)
    action = rng.choices(["set", "delete", "wrap", "rename", "dupkey"], [70, 12, 6, 6, 6])[0]
    if not path:
        action = "set"
    old = _get(doc, path)
    v = value(rng, old, paths) if action in ("set", "dupkey") else (
        rng.choice(["", "x", path[-1] + "_" if isinstance(path[-1], str) else "0", "..", "/abs"])
        if action == "rename" else None)
    return [kind, rel, path, action, v]


def fs_op(rng: random.Random, rel: str, others: list[str]) -> list:
    kind = rng.choice(["symlink", "symlink", "mkdir", "remove", "fifo", "copy"])
    if kind == "symlink":
        return ["symlink", rel, rng.choice(["outside", "/dev/zero", "self", f"abs:{rng.choice(others)}"])]
    if kind == "copy":
        return ["copy", rng.choice(others), rel]
    return [kind, rel]
