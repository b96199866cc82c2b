"""GGUF (llama.cpp) files: a fast header reader over a read-only memory map of the file.

File layout (little-endian): magic "GGUF", u32 version (2 or 3), u64 tensor count, u64 metadata count; metadata
entries (string key, u32 value type, value); tensor infos (string name, u32 n_dims, u64 ne[n_dims], u32 ggml type,
u64 offset); padding to `general.alignment` (32); the tensor data. Strings are a u64 length + UTF-8 bytes; arrays
are a u32 element type + u64 count + elements. `ne` lists dimensions innermost first, so a torch [out, in] matrix
is ne = {in, out}; here every shape is in torch order.

We parse the header ourselves: gguf-py's GGUFReader builds numpy objects for every string of a vocabulary and
takes seconds on a 250k-token file. Tensor data stays in the memory map: `GGUFFile.array` gives a float tensor
as a view of it, and dequantises a block type (ggml_types.py) only the part asked for.
"""

import dataclasses
import math
import mmap
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ...errors import FormatError, WeightsError, brief
from ...files import regular_file
from .ggml_types import FLOAT_VIEWS, GGML_TYPES, dequantize, type_name, unreadable

MAGIC = b"GGUF"
MAX_ARRAY_NESTING = 8    # metadata arrays of arrays: llama.cpp reads none; deeper nesting is corruption
MAX_DIMS = 4             # GGML_MAX_DIMS
# metadata value types
_U8, _I8, _U16, _I16, _U32, _I32, _F32, _BOOL, _STRING, _ARRAY, _U64, _I64, _F64 = range(13)
_NUMERIC = {_U8: "<u1", _I8: "<i1", _U16: "<u2", _I16: "<i2", _U32: "<u4", _I32: "<i4", _F32: "<f4", _BOOL: "?",
            _U64: "<u8", _I64: "<i8", _F64: "<f8"}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple          # torch order (outermost first): reversed ne
    ggml_type: int
    offset: int           # absolute byte offset in the file
    nbytes: int | None    # bytes in the file; None for a type this reader does not know the size of


class _Cursor:
    """Sequential little-endian reads from the header, each checked against the file end."""

    def __init__(self, buf, path):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def _need(self, n: int, what: str):
        if self.pos + n > self.size:
            raise FormatError(f"{self.path}: truncated GGUF header: {what} needs bytes [{self.pos}, {self.pos + n}) "
                              f"but the file has {self.size}")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self._need(n, what)
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return out if len(out) > 1 else out[0]

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what)
        self._need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"{self.path}: {what} is not valid UTF-8") from None

    def strings(self, count: int, what: str) -> "StringArray":
        """`count` strings in a row (a vocabulary, its merges: hundreds of thousands). Only their offsets are
        read here, in one tight loop; they are decoded when first used."""
        buf, pos, unpack = self.buf, self.pos, struct.unpack_from
        if count * 8 > self.size - pos:  # every string has an 8-byte length: a corrupt count, not a huge list
            raise FormatError(f"{self.path}: truncated or corrupt GGUF header: {what} claims {count} strings, more "
                              f"than the {self.size - pos} bytes left could hold")
        starts, size = [0] * count, self.size
        for i in range(count):
            if pos + 8 > size:
                pos = size + 1
                break
            starts[i] = pos
            pos += 8 + unpack("<Q", buf, pos)[0]
        if pos > self.size:
            raise FormatError(f"{self.path}: truncated GGUF header: {what} ({count} strings) runs past the end of "
                              f"the file ({self.size} bytes)")
        self.pos = pos
        return StringArray(buf, starts, pos, f"{self.path}: {what}")

    def value(self, vtype: int, key: str, depth: int = 0):
        if vtype == _STRING:
            return self.string(f"metadata {key!r}")
        if vtype in _NUMERIC:
            dtype = np.dtype(_NUMERIC[vtype])
            self._need(dtype.itemsize, f"metadata {key!r}")
            v = np.frombuffer(self.buf, dtype, 1, self.pos)[0].item()
            self.pos += dtype.itemsize
            return v
        if vtype == _ARRAY:
            etype, count = self.unpack("<I", f"metadata {key!r}"), self.unpack("<Q", f"metadata {key!r}")
            if etype == _STRING:
                return self.strings(count, f"metadata {key!r}")
            if etype in _NUMERIC:
                dtype = np.dtype(_NUMERIC[etype])
                self._need(count * dtype.itemsize, f"metadata {key!r}")
                out = np.frombuffer(self.buf, dtype, count, self.pos).copy()
                self.pos += count * dtype.itemsize
                return out
            if etype == _ARRAY:  # nested arrays: none of our keys use them; read them generically
                if depth >= MAX_ARRAY_NESTING:
                    raise FormatError(f"{self.path}: metadata {key!r}: arrays nested more than {MAX_ARRAY_NESTING} "
                                      f"deep")
                if count * 12 > self.size - self.pos:   # each inner array has a 4-byte type and an 8-byte count
                    raise FormatError(f"{self.path}: truncated or corrupt GGUF header: metadata {key!r} claims {count} "
                                      f"arrays, more than the {self.size - self.pos} bytes left could hold")
                return [self.value(_ARRAY, key, depth + 1) for _ in range(count)]
            raise FormatError(f"{self.path}: metadata {key!r}: unknown array element type {etype}")
        raise FormatError(f"{self.path}: metadata {key!r}: unknown value type {vtype}")


class StringArray(Sequence):
    """A GGUF string array, decoded on first access: the bytes between the u64 length prefixes are joined with
    NUL separators and decoded at once (a per-string loop takes ~1 s for a 250k vocabulary and its merges)."""

    def __init__(self, buf, starts: list[int], end: int, what: str):
        self._buf, self._starts, self._end, self._what, self._items = buf, starts, end, what, None

    def __len__(self):
        return len(self._starts)

    def __getitem__(self, i):
        return self._decoded()[i]

    def __iter__(self):
        return iter(self._decoded())

    def __eq__(self, other):
        return list(self) == list(other)

    def _decoded(self) -> list[str]:
        if self._items is None:
            self._items = self._decode()
        return self._items

    def _decode(self) -> list[str]:
        if not self._starts:
            return []
        s0 = self._starts[0]
        data = np.frombuffer(self._buf, np.uint8, self._end - s0, s0).copy()
        rel = np.asarray(self._starts, np.int64) - s0
        keep = np.ones(data.size, bool)
        keep[(rel[:, None] + np.arange(1, 8)).ravel()] = False     # drop 7 of each prefix's 8 bytes ...
        data[rel] = 0                                              # ... and make the 8th the separator
        try:
            text = data[keep].tobytes().decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"{self._what} holds a string that is not valid UTF-8") from None
        items = text.split("\0")[1:]
        if len(items) != len(self._starts):   # a string holds a NUL itself: decode one by one
            buf = self._buf
            items = [bytes(buf[s + 8:s + 8 + struct.unpack_from("<Q", buf, s)[0]]).decode("utf-8", "strict")
                     for s in self._starts]
        return items


class GGUFFile:
    """A parsed GGUF header over a read-only memory map of the file.

    metadata: key -> int | float | bool | str | list[str] | np.ndarray (numeric arrays)
    tensors:  name -> TensorInfo (shapes in torch order)
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        regular_file(self.path, "GGUF file")   # not a FIFO or device (opening one would block or never end)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 24:
                    raise FormatError(f"{self.path}: truncated GGUF file ({size} bytes, no header)")
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise FormatError(f"{self.path}: no such file") from None
        except IsADirectoryError:
            raise FormatError(f"{self.path}: is a directory, expected a .gguf file") from None
        c = _Cursor(self._mm, self.path)
        if self._mm[:4] != MAGIC:
            raise FormatError(f"{self.path}: not a GGUF file (magic {bytes(self._mm[:4])!r}, expected {MAGIC!r})")
        c.pos = 4
        self.version = c.unpack("<I", "version")
        if self.version not in (2, 3):
            hint = " (a big-endian GGUF?)" if self.version in (2 << 24, 3 << 24) else ""
            raise FormatError(f"{self.path}: unsupported GGUF version {self.version}{hint}; supported: 2, 3")
        n_tensors, n_kv = c.unpack("<QQ", "tensor and metadata counts")
        # every entry takes bytes: a count the rest of the file cannot hold is corruption, not a loop to run
        # (a metadata entry: key length 8 + type 4 + a value of >= 1; a tensor info: 8 + 4 + 4 + 8)
        if n_kv * 13 + n_tensors * 24 > size - c.pos:
            raise FormatError(f"{self.path}: truncated or corrupt GGUF header: {n_kv} metadata entries and "
                              f"{n_tensors} tensors cannot fit in the {size - c.pos} bytes after the header")
        self.metadata = {}
        for _ in range(n_kv):
            key = c.string("a metadata key")
            if key in self.metadata:
                raise FormatError(f"{self.path}: metadata key {brief(key)} appears twice")
            self.metadata[key] = c.value(c.unpack("<I", f"metadata {brief(key)} type"), brief(key))
        infos, names = [], set()
        for _ in range(n_tensors):
            name = c.string("a tensor name")
            if name in names:
                raise FormatError(f"{self.path}: tensor {brief(name)} appears twice")
            names.add(name)
            n_dims = c.unpack("<I", f"tensor {brief(name)}")
            if n_dims > MAX_DIMS:
                raise FormatError(f"{self.path}: tensor {brief(name)}: {n_dims} dimensions, GGUF has at most "
                                  f"{MAX_DIMS} (corrupt header)")
            ne = c.unpack(f"<{n_dims}Q", f"tensor {name!r}") if n_dims else ()
            ne = (ne,) if isinstance(ne, int) else ne
            ggml_type, offset = c.unpack("<IQ", f"tensor {brief(name)}")
            infos.append((name, tuple(reversed(ne)), ggml_type, offset))
        alignment = self.metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment % 8 \
                or alignment & (alignment - 1):
            raise FormatError(f"{self.path}: metadata 'general.alignment' must be a power of two >= 8, "
                              f"got {brief(alignment)}")
        data_start = -(-c.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, offset in infos:
            begin, nbytes = data_start + offset, None
            if ggml_type in GGML_TYPES:   # a type of unknown size is listed, and refused when read (unreadable)
                _, block, type_size = GGML_TYPES[ggml_type]
                inner = shape[-1] if shape else 1
                if inner % block:
                    raise FormatError(f"{self.path}: tensor {name!r}: row of {inner} values is not a multiple of the "
                                      f"{type_name(ggml_type)} block size {block}")
                nbytes = math.prod(shape) // block * type_size
                if begin + nbytes > size:
                    raise FormatError(f"{self.path}: truncated: tensor {name!r} needs bytes [{begin}, "
                                      f"{begin + nbytes}) but the file has {size}")
            elif begin > size:
                raise FormatError(f"{self.path}: truncated: tensor {name!r} starts at byte {begin} but the file has "
                                  f"{size}")
            self.tensors[name] = TensorInfo(name, shape, ggml_type, begin, nbytes)
        self._data = np.frombuffer(self._mm, np.uint8)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture", "")
        return arch if isinstance(arch, str) else ""

    def raw(self, name: str, index=None) -> np.ndarray:
        """The stored bytes of a tensor as [..., row bytes] uint8, or part `index` (int, slice or int array) of its
        leading axis."""
        t = self.tensors[name]
        if t.nbytes is None:
            raise WeightsError(f"{self.path}: tensor {name!r} has {unreadable(t.ggml_type)}")
        _, block, type_size = GGML_TYPES[t.ggml_type]
        shape = t.shape or (1,)
        a = self._data[t.offset:t.offset + t.nbytes].reshape(*shape[:-1], shape[-1] // block * type_size)
        return a if index is None else a[index]

    def array(self, name: str, index=None) -> np.ndarray:
        """A tensor, or part `index` (int, slice or int array) of its leading axis, in torch order: F32 / F16 /
        BF16 / F64 as zero-copy views of the file, every block type dequantised to float32 (`dequantize`)."""
        t = self.tensors[name]
        if (why := unreadable(t.ggml_type)) is not None:
            raise WeightsError(f"{self.path}: tensor {name!r} has {why}")
        if index is not None and len(t.shape) < 2:   # a vector is one row: read it whole
            return self.array(name)[index]
        raw = self.raw(name, index)
        kind = type_name(t.ggml_type)
        shape = t.shape if index is None else (*raw.shape[:-1], t.shape[-1])
        if kind in FLOAT_VIEWS:
            return raw.view(FLOAT_VIEWS[kind]).reshape(shape)
        return dequantize(raw, t.ggml_type).reshape(shape)

    def storage(self) -> list[tuple[str, int, int | None]]:
        """The file's tensors by type, largest first: (type name, tensor count, bytes; None when the type's size
        is unknown)."""
        by_type: dict[str, list] = {}
        for t in self.tensors.values():
            entry = by_type.setdefault(type_name(t.ggml_type), [0, 0])
            entry[0] += 1
            entry[1] = None if t.nbytes is None or entry[1] is None else entry[1] + t.nbytes
        return sorted(((k, n, b) for k, (n, b) in by_type.items()), key=lambda e: -(e[2] or 0))
