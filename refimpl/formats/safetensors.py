"""safetensors files as memory-mapped NumPy arrays (single file or sharded with an index).

The format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}},
then the raw little-endian C-order data. We parse the header ourselves because the `safetensors` NumPy
backend has no BF16 and copies every tensor; here a tensor is a zero-copy view into a read-only memory map,
read from disk only when the forward pass first touches it. BF16 arrives as ml_dtypes.bfloat16.
"""

import itertools
import json
import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import FormatError, brief
from ..files import expect, inside, load_json, parse_json, regular_file, write_atomic

DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024
_MAX_HEADER_DEPTH = 8      # {name: {"shape": [...]}}: three levels; __metadata__ is flat
_MAX_DIMS = 32


def read_safetensors(path: str | Path, problems: dict | None = None) -> dict[str, np.ndarray]:
    """name -> read-only memory-mapped array, after checking the header against the file size.
    With a `problems` dict, a bad or truncated tensor entry is recorded there (name -> message) and the
    others are still returned (device dumps); without one it raises FormatError."""
    path = Path(path)
    size = regular_file(path, "safetensors file")
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise FormatError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(size - 8, _MAX_HEADER):
                raise FormatError(f"{path}: truncated or corrupt safetensors header "
                                  f"(header claims {header_len} bytes, file has {size})")
            text = f.read(header_len)
    except OSError as e:
        raise FormatError(f"{path}: cannot read ({e.strerror or e})") from None
    header = parse_json(text, f"{path}: safetensors header", max_depth=_MAX_HEADER_DEPTH)
    expect(header, dict, f"{path}: safetensors header", what="a JSON object {name: {dtype, shape, data_offsets}}")
    expect(header.pop("__metadata__", None), (dict, type(None)), f"{path}: safetensors __metadata__")
    data_start, data_len = 8 + header_len, size - 8 - header_len
    mm = np.memmap(path, dtype=np.uint8, mode="r") if data_len > 0 else np.zeros(0, np.uint8)
    arrays = {}
    for name, info in header.items():
        try:
            arrays[name] = _entry(path, mm, data_start, data_len, name, info)
        except FormatError as e:
            if problems is None:
                raise
            problems[name] = str(e)
    return arrays


def _entry(path, mm, data_start: int, data_len: int, name: str, info) -> np.ndarray:
    """One header entry checked (fields, types, a dtype refimpl reads, sizes >= 0, shape x dtype size == the byte
    span, the span inside the data section) and its view of the memory map."""
    where = f"{path}: tensor {brief(name)}"
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise FormatError(f"{where}: header entry {brief(info)} is not {{dtype, shape, data_offsets}}")
    kind, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(kind, str) or kind not in DTYPES:
        raise FormatError(f"{where} has dtype {brief(kind)}, which refimpl cannot read (readable: {', '.join(DTYPES)})")
    dtype = DTYPES[kind]
    expect(shape, list, f"{where}: shape")
    if len(shape) > _MAX_DIMS or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise FormatError(f"{where}: shape {brief(shape)} is not a list of at most {_MAX_DIMS} sizes >= 0")
    expect(offsets, list, f"{where}: data_offsets")
    if len(offsets) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) for n in offsets):
        raise FormatError(f"{where}: data_offsets {brief(offsets)} is not [begin, end]")
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes or begin < 0:
        raise FormatError(f"{where}: header offsets [{begin}, {end}) do not fit shape {shape} of {kind} "
                          f"({nbytes} bytes)")
    if end > data_len:
        raise FormatError(f"{path}: truncated: tensor {brief(name)} needs bytes [{begin}, {end}) of the data "
                          f"section but the file holds {data_len}")
    return mm[data_start + begin:data_start + end].view(dtype).reshape(shape)


def read_checkpoint(directory: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Path]]:
    """All tensors of an HF checkpoint directory (model.safetensors, or the shards its index names) as memory
    maps, and the file each is in. Shards the index names must be files inside the directory."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists() or index.is_symlink():
        doc = load_json(index, "safetensors index")
        expect(doc, dict, f"{index}")
        weight_map = expect(doc.get("weight_map"), dict, f"{index}: weight_map", what="an object {tensor: shard}")
        for name, f in weight_map.items():
            expect(f, str, f"{index}: weight_map[{brief(name)}]", what="a shard file name")
        shards = sorted(set(weight_map.values()))
        for f in shards:
            path = inside(directory, f, f"shard named in {index.name}", links_out=True)   # HF cache: links to blobs
            if not os.path.lexists(path):   # (False also for a name too long to exist)
                listed = [n for n, g in weight_map.items() if g == f]
                raise FormatError(f"{path}: missing shard: {index.name} lists {len(listed)} tensor(s) in it, e.g. "
                                  f"{brief(listed[0])}")
        files = [directory / f for f in shards]
    else:
        weight_map = None
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FormatError(f"{directory}: no model.safetensors or model.safetensors.index.json")
    arrays, origins = {}, {}
    for f in files:
        for name, a in read_safetensors(f).items():
            if name in arrays:
                raise FormatError(f"{f}: tensor {brief(name)} is also in {origins[name]}")
            arrays[name], origins[name] = a, f
    for name, f in (weight_map or {}).items():
        if name not in arrays or origins[name] != directory / f:
            raise FormatError(f"{directory / f}: tensor {brief(name)} listed in {index.name} is not in the shard")
    return arrays, origins


def write_safetensors(path: str | Path, arrays: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """Write arrays (F32/F16/BF16/ints) as one safetensors file, atomically (refimpl.files.write_atomic: a temporary
    file beside it, renamed into place when whole), one tensor at a time."""
    path = Path(path)
    items = sorted(arrays.items())
    data = (np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes() for _, a in items)
    write_atomic(path, itertools.chain([header_bytes(arrays, metadata, path)], data), "safetensors file")


def header_bytes(arrays: dict[str, np.ndarray], metadata: dict | None = None, path: str | Path = "") -> bytes:
    """The first bytes write_safetensors writes for these arrays: the header's length and the header (tensors by
    name, contiguous, compact JSON, padded to 8 bytes); the data follows, sum of the arrays' nbytes."""
    header, offset = {}, 0
    for name, a in sorted(arrays.items()):
        if a.dtype not in _NAMES:
            raise FormatError(f"{path}: tensor {name!r}: dtype {a.dtype} has no safetensors name")
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob
