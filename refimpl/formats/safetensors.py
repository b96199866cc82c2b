"""safetensors files as memory-mapped NumPy arrays (single file or sharded with an index).

The format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}},
then the raw little-endian C-order data. We parse the header ourselves because the `safetensors` NumPy
backend has no BF16 and copies every tensor; here a tensor is a zero-copy view into a read-only memory map,
read from disk only when the forward pass first touches it. BF16 arrives as ml_dtypes.bfloat16.
"""

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import FormatError

DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


def read_safetensors(path: str | Path, problems: dict | None = None) -> dict[str, np.ndarray]:
    """name -> read-only memory-mapped array, after checking the header against the file size.
    With a `problems` dict, a bad or truncated tensor entry is recorded there (name -> message) and the
    others are still returned (device dumps); without one it raises FormatError."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise FormatError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(size - 8, _MAX_HEADER):
                raise FormatError(f"{path}: truncated or corrupt safetensors header "
                                  f"(header claims {header_len} bytes, file has {size})")
            header = json.loads(f.read(header_len))
    except FileNotFoundError:
        raise FormatError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
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
    try:
        kind, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise FormatError(f"{path}: tensor {name!r}: bad header entry {info!r}") from None
    if kind not in DTYPES:
        raise FormatError(f"{path}: tensor {name!r} has dtype {kind!r}, which refimpl cannot read "
                          f"(readable: {', '.join(DTYPES)})")
    dtype = DTYPES[kind]
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if end - begin != nbytes or begin < 0:
        raise FormatError(f"{path}: tensor {name!r}: header offsets [{begin}, {end}) do not fit "
                          f"shape {list(shape)} of {info['dtype']} ({nbytes} bytes)")
    if end > data_len:
        raise FormatError(f"{path}: truncated: tensor {name!r} needs bytes [{begin}, {end}) of the data "
                          f"section but the file holds {data_len}")
    return mm[data_start + begin:data_start + end].view(dtype).reshape(shape)


def read_checkpoint(directory: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Path]]:
    """All tensors of an HF checkpoint directory (model.safetensors, or the shards its index names) as memory
    maps, and the file each is in."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = {str(f) for f in weight_map.values()}
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise FormatError(f"{index}: corrupt index ({e!r})") from None
        for f in sorted(shards):
            path = directory / f
            if Path(f).is_absolute() or ".." in Path(f).parts:
                raise FormatError(f"{index}: shard {f!r} is outside the checkpoint directory")
            if not path.is_file():
                listed = [n for n, g in weight_map.items() if g == f]
                raise FormatError(f"{path}: missing shard: {index.name} lists {len(listed)} tensor(s) in it, e.g. "
                                  f"{listed[0]!r}")
        files = sorted(directory / f for f in shards)
    else:
        weight_map = None
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FormatError(f"{directory}: no model.safetensors or model.safetensors.index.json")
    arrays, origins = {}, {}
    for f in files:
        for name, a in read_safetensors(f).items():
            arrays[name], origins[name] = a, f
    for name, f in (weight_map or {}).items():
        if name not in arrays:
            raise FormatError(f"{directory / f}: tensor {name!r} listed in {index.name} is not in the shard")
    return arrays, origins


def write_safetensors(path: str | Path, arrays: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """Write arrays (F32/F16/BF16/ints) as one safetensors file, atomically (temp file, then rename)."""
    path = Path(path)
    header, offset = {}, 0
    items = sorted(arrays.items())
    for name, a in items:
        if a.dtype not in _NAMES:
            raise FormatError(f"{path}: tensor {name!r}: dtype {a.dtype} has no safetensors name")
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for _, a in items:
            f.write(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
    os.replace(tmp, path)
