"""Structural edits of GGUF files for the fuzzer: parse a file into its header fields, change one, write it back.

A file is (version, [kv], [tensor info], alignment padding, data); edits are JSON dicts:
    {"kv_set": key, "vtype": t, "value": v}    set (or add) a metadata value; v a number, str,
                                               {"array": etype, "items": [...]} or {"nested": depth}
    {"kv_del": key}  {"kv_dup": key}           remove / repeat an entry
    {"kv_retype": key, "vtype": t}              the entry's type code changed, its bytes kept
    {"kv_count": key, "value": n}               an array's element count (or a string's length) written as n
    {"tensor": name, "field": ne | type | offset | name | n_dims, "value": v}
    {"tensor_del": name}  {"tensor_dup": name}
    {"count": "n_kv" | "n_tensors", "value": n} the header's counts written as n
    {"version": n}
This is the test's own reader / writer (independent of refimpl's), kept to what the fuzzer needs.
"""

import struct

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
        I64: "<q", F64: "<d"}


class _R:
    def __init__(self, data):
        self.data, self.pos = data, 0

    def take(self, fmt):
        v = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return v[0] if len(v) == 1 else v

    def string(self):
        n = self.take("<Q")
        s = self.data[self.pos:self.pos + n]
        self.pos += n
        return s.decode("utf-8", "surrogateescape")

    def value(self, t):
        if t == STRING:
            return self.string()
        if t == ARRAY:
            et, n = self.take("<I"), self.take("<Q")
            return {"array": et, "items": [self.value(et) for _ in range(n)]}
        return self.take(_FMT[t])


def parse(data: bytes) -> dict:
    r = _R(data)
    assert r.take("<4s") == b"GGUF"
    version, nt, nkv = r.take("<I"), r.take("<Q"), r.take("<Q")
    kv = []
    for _ in range(nkv):
        key = r.string()
        t = r.take("<I")
        kv.append({"key": key, "vtype": t, "value": r.value(t)})
    tensors = []
    for _ in range(nt):
        name = r.string()
        nd = r.take("<I")
        ne = [r.take("<Q") for _ in range(nd)]
        ttype, off = r.take("<I"), r.take("<Q")
        tensors.append({"name": name, "ne": ne, "type": ttype, "offset": off})
    align = next((e["value"] for e in kv if e["key"] == "general.alignment"), 32)
    start = -(-r.pos // align) * align
    return {"version": version, "kv": kv, "tensors": tensors, "data": data[start:], "align": align}


def _pack_value(t, v, count=None) -> bytes:
    if t == STRING:
        b = str(v).encode("utf-8", "surrogateescape") if not isinstance(v, bytes) else v
        return struct.pack("<Q", len(b) if count is None else count) + b
    if t == ARRAY:
        items = v["items"] if isinstance(v, dict) else list(v)
        et = v["array"] if isinstance(v, dict) else U32
        return struct.pack("<IQ", et, len(items) if count is None else count) + b"".join(
            _pack_value(et, x) for x in items)
    fmt = _FMT.get(t, "<I")
    try:
        return struct.pack(fmt, v)
    except (struct.error, TypeError):
        return struct.pack(fmt, 0)


def write(g: dict, counts: dict | None = None) -> bytes:
    counts = counts or {}
    out = [b"GGUF", struct.pack("<I", g["version"]),
           struct.pack("<Q", counts.get("n_tensors", len(g["tensors"])) % 2**64),
           struct.pack("<Q", counts.get("n_kv", len(g["kv"])) % 2**64)]
    for e in g["kv"]:
        out.append(_pack_value(STRING, e["key"]))
        out.append(struct.pack("<I", e.get("as_type", e["vtype"]) % 2**32))
        out.append(_pack_value(e["vtype"], e["value"], e.get("count")))
    for t in g["tensors"]:
        out.append(_pack_value(STRING, t["name"]))
        nd = t.get("n_dims", len(t["ne"]))
        out.append(struct.pack("<I", nd % 2**32))
        out.append(b"".join(struct.pack("<Q", int(x) % 2**64) for x in t["ne"]))
        out.append(struct.pack("<IQ", int(t["type"]) % 2**32, int(t["offset"]) % 2**64))
    head = b"".join(out)
    align = g["align"] if isinstance(g["align"], int) and g["align"] > 0 else 32
    return head + b"\0" * (-len(head) % align) + g["data"]


def edit(data: bytes, e: dict) -> bytes:
    try:
        g = parse(data)
    except (AssertionError, struct.error, KeyError, MemoryError, OverflowError, UnicodeDecodeError):
        return data
    counts = {}
    kv = {x["key"]: x for x in g["kv"]}
    tensors = {t["name"]: t for t in g["tensors"]}
    if "kv_set" in e:
        entry = kv.get(e["kv_set"])
        if entry is None:
            entry = {"key": e["kv_set"]}
            g["kv"].append(entry)
        value = e["value"]
        if isinstance(value, dict) and "nested" in value:   # arrays of arrays, n deep
            value = _nested(value["nested"])
        entry.update(vtype=e["vtype"], value=value)
        entry.pop("as_type", None)
    elif "kv_del" in e and e["kv_del"] in kv:
        g["kv"].remove(kv[e["kv_del"]])
    elif "kv_dup" in e and e["kv_dup"] in kv:
        g["kv"].append(dict(kv[e["kv_dup"]]))
    elif "kv_retype" in e and e["kv_retype"] in kv:
        kv[e["kv_retype"]]["as_type"] = e["vtype"]
    elif "kv_count" in e and e["kv_count"] in kv:
        kv[e["kv_count"]]["count"] = e["value"] % 2**64
    elif "tensor" in e and e["tensor"] in tensors:
        t = tensors[e["tensor"]]
        if e["field"] == "n_dims":
            t["n_dims"] = e["value"]
        else:
            t[e["field"]] = e["value"]
    elif "tensor_del" in e and e["tensor_del"] in tensors:
        g["tensors"].remove(tensors[e["tensor_del"]])
    elif "tensor_dup" in e and e["tensor_dup"] in tensors:
        g["tensors"].append(dict(tensors[e["tensor_dup"]]))
    elif "count" in e:
        counts[e["count"]] = e["value"]
    elif "version" in e:
        g["version"] = e["version"] % 2**32
    return write(g, counts)


def choose(rng, data: bytes) -> dict:
    """A random structural edit of a GGUF file."""
    g = parse(data)
    keys = [x["key"] for x in g["kv"]]
    names = [t["name"] for t in g["tensors"]]
    big = [0, 1, 2, 3, 7, 8, 9, 31, 32, 33, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63,
           2**64 - 1]
    r = rng.random()
    if r < 0.35 and keys:
        key = rng.choice(keys)
        entry = next(x for x in g["kv"] if x["key"] == key)
        old = entry["value"]
        choices = [
            lambda: {"kv_set": key, "vtype": rng.choice([U32, I32, U64, I64, F32, F64, U8, BOOL]), "value": rng.choice(
                big + [-1, -2**31, 0.5, float("nan"), float("inf"), -1.0, 1e30])},
            lambda: {"kv_set": key, "vtype": STRING, "value": rng.choice(["", "x", "qwen3", "qwen35", "llama", "gpt2",
                                                                          "yarn", "none", "\udcff", "x" * 1000])},
            lambda: {"kv_set": key, "vtype": ARRAY, "value": {"array": rng.choice([U32, I32, F32, STRING, BOOL]),
                                                              "items": rng.choice([[], [0], [1, 2, 3, 4], [0] * 64])}},
            lambda: {"kv_set": key, "vtype": ARRAY, "value": {"nested": rng.choice([2, 5, 50, 900])}},
            lambda: {"kv_del": key},
            lambda: {"kv_dup": key},
            lambda: {"kv_retype": key, "vtype": rng.choice(list(range(14)) + [99, 2**31])},
            lambda: {"kv_count": key, "value": rng.choice(big)},
        ]
        if isinstance(old, (int, float)) and not isinstance(old, bool):
            choices.append(lambda: {"kv_set": key, "vtype": entry["vtype"], "value": rng.choice(
                [old + 1, old - 1, old * 2, old * 1000, 0, -old, old * 2**20])})
        if isinstance(old, dict) and old["items"]:
            choices.append(lambda: {"kv_set": key, "vtype": ARRAY, "value": {"array": old["array"], "items": rng.choice(
                [old["items"][:-1], old["items"][:1], old["items"] + old["items"][-1:], old["items"][::-1]])}})
        return rng.choice(choices)()
    if r < 0.8 and names:
        name = rng.choice(names)
        t = next(x for x in g["tensors"] if x["name"] == name)
        field = rng.choice(["ne", "ne", "type", "type", "offset", "offset", "name", "n_dims", "del", "dup"])
        if field == "del":
            return {"tensor_del": name}
        if field == "dup":
            return {"tensor_dup": name}
        if field == "ne":
            ne = list(t["ne"])
            choice = rng.random()
            if choice < 0.4 and ne:
                i = rng.randrange(len(ne))
                ne[i] = rng.choice(big + [ne[i] * 2, ne[i] + 1, ne[i] - 1, ne[i] // 2])
            elif choice < 0.6:
                ne = ne[::-1]
            elif choice < 0.8:
                ne = ne + [rng.choice([1, 2, 2**40])]
            else:
                ne = ne[:-1]
            return {"tensor": name, "field": "ne", "value": [int(x) % 2**64 for x in ne]}
        if field == "type":
            return {"tensor": name, "field": "type", "value": rng.choice(list(range(44)) + [99, 2**31, 2**32 - 1])}
        if field == "offset":
            other = rng.choice(g["tensors"])["offset"]
            return {"tensor": name, "field": "offset", "value": rng.choice(
                big + [other, t["offset"] + 1, t["offset"] + 32, t["offset"] - 32, len(g["data"]), len(g["data"]) - 1])}
        if field == "name":
            return {"tensor": name, "field": "name", "value": rng.choice(names + ["", "x" * 300, name + ".x"])}
        return {"tensor": name, "field": "n_dims", "value": rng.choice([0, 1, 2, 3, 4, 5, 9, 2**31, 2**32 - 1])}
    if r < 0.95:
        return {"count": rng.choice(["n_kv", "n_tensors"]), "value": rng.choice(
            big + [len(g["kv"]) + 1, len(g["kv"]) - 1, len(g["tensors"]) + 1, len(g["tensors"]) - 1])}
    return {"version": rng.choice([0, 1, 2, 4, 2 << 24, 3 << 24, 2**32 - 1])}


def _nested(depth: int) -> dict:
    v = {"array": U32, "items": [1]}
    for _ in range(depth):
        v = {"array": ARRAY, "items": [v]}
    return v
