"""GGUF (llama.cpp) files: a fast header reader, lazy dequantisation, the llama.cpp <-> HF name map with every
conversion transform and its inverse, and an atomic writer.

File layout (little-endian): magic "GGUF", u32 version (2 or 3), u64 tensor count, u64 metadata count; metadata
entries (string key, u32 value type, value); tensor infos (string name, u32 n_dims, u64 ne[n_dims], u32 ggml type,
u64 offset); padding to `general.alignment` (32); the tensor data. Strings are a u64 length + UTF-8 bytes; arrays
are a u32 element type + u64 count + elements. `ne` lists dimensions innermost first, so a torch [out, in] matrix
is ne = {in, out}; here every shape is in torch order.

We parse the header ourselves: gguf-py's GGUFReader builds numpy objects for every string of a vocabulary and
takes seconds on a 250k-token file. Tensor data stays in a read-only memory map; F32 tensors without a
transform are used in place, every other tensor is dequantised (gguf.quants) and transformed only when the
forward pass first reads it.

The transforms llama.cpp's convert_hf_to_gguf.py applies (models.md §7), HF -> GGUF:
  zero-centred norms (Next / 3.5: input/post-attention, model.norm, q_norm, k_norm):  stored = 1 + w
  linear_attn.A_log -> ssm_a = -exp(A_log);  dt_bias -> ssm_dt.bias;  conv1d [C, 1, Kc] -> [C, Kc]
  Qwen3-Next in_proj_qkvz (grouped per key head [q | k | v | z]) -> attn_qkv [all q | all k | all v] + attn_gate
  Qwen3.5 (Hk != Hv): value heads grouped h = kh*r + j -> tiled h' = j*Hk + kh, on the v rows of in_proj_qkv,
    in_proj_z, in_proj_b/a, A_log, dt_bias, the v channels of conv1d and the columns of out_proj
  MoE experts stacked: ffn_{gate,up,down}_exps [E, ...]; Qwen3.5-MoE's fused gate_up_proj split into gate | up
The reader undoes each (w = stored - 1, A_log = ln(-ssm_a), ...), so the model sees the HF arrays.
"""

import dataclasses
import logging
import math
import mmap
import os
import re
import struct
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import ConfigError, FormatError, WeightsError, brief
from ..files import integer, number, output_file, regular_file
from ..kernels.elementary import log
from ..kernels.quant import dequantize_q1_0, dequantize_q2_0
from ..models.config import HYBRID_TYPES, config_from_dict

_log = logging.getLogger(__name__)
MAGIC = b"GGUF"
MAX_ARRAY_NESTING = 8    # metadata arrays of arrays: llama.cpp reads none; deeper nesting is corruption
MAX_DIMS = 4             # GGML_MAX_DIMS
# metadata value types
_U8, _I8, _U16, _I16, _U32, _I32, _F32, _BOOL, _STRING, _ARRAY, _U64, _I64, _F64 = range(13)
_NUMERIC = {_U8: "<u1", _I8: "<i1", _U16: "<u2", _I16: "<i2", _U32: "<u4", _I32: "<i4", _F32: "<f4", _BOOL: "?",
            _U64: "<u8", _I64: "<i8", _F64: "<f8"}

ARCHITECTURES = {"qwen3": "qwen3", "qwen3moe": "qwen3_moe", "qwen3next": "qwen3_next", "qwen35": "qwen3_5_text",
                 "qwen35moe": "qwen3_5_moe_text"}
MODEL_TYPE_TO_ARCH = {v: k for k, v in ARCHITECTURES.items()}


# ---------------------------------------------------------------------------------------------------- reading

@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple          # torch order (outermost first): reversed ne
    ggml_type: int
    offset: int           # absolute byte offset in the file
    nbytes: int | None    # bytes in the file; None for a type this reader does not know the size of


# Every ggml type id (ggml.h `enum ggml_type`, llama.cpp as vendored by llama-cpp-python 0.3.36): name, values per
# block, bytes per block (ggml.c's type_traits; ggml-common.h's block structs). tests check it against ggml's own
# traits, recorded in quant-types.gguf. Q8_1 / Q8_K are ggml's activation formats (no to_float: llama.cpp does not
# run them as weights); the I types are integer tensors; ids 4, 5, 31-33, 36-38 were removed from ggml.
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18), 42: ("Q2_0", 64, 18),
}
REMOVED_TYPES = {4: "Q4_2", 5: "Q4_3", 31: "Q4_0_4_4", 32: "Q4_0_4_8", 33: "Q4_0_8_8", 36: "IQ4_NL_4_4",
                 37: "IQ4_NL_4_8", 38: "IQ4_NL_8_8"}
FLOAT_VIEWS = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "BF16": ml_dtypes.bfloat16}   # read in place
_NOT_WEIGHTS = {"Q8_1": "ggml's activation format (ggml has no dequantisation for it; llama.cpp does not run it as "
                        "a weight)",
                "I8": "an integer type, not a weight", "I16": "an integer type, not a weight",
                "I32": "an integer type, not a weight", "I64": "an integer type, not a weight"}
_NOT_WEIGHTS["Q8_K"] = _NOT_WEIGHTS["Q8_1"]
OWN_DEQUANTISERS = {"Q1_0": dequantize_q1_0, "Q2_0": dequantize_q2_0}   # the block types gguf-py 0.19 lacks


def type_name(ggml_type: int) -> str:
    if ggml_type in GGML_TYPES:
        return GGML_TYPES[ggml_type][0]
    if ggml_type in REMOVED_TYPES:
        return REMOVED_TYPES[ggml_type]
    return f"type id {ggml_type}"




def unreadable(ggml_type: int) -> str | None:
    """Why tensors of this type cannot be read as weights, or None when they can (float types in place, every
    block type ggml dequantises: gguf-py's dequantisation, or refimpl's for the types gguf-py lacks)."""
    if ggml_type in REMOVED_TYPES:
        return f"{REMOVED_TYPES[ggml_type]} (type id {ggml_type}), which ggml has removed (llama.cpp refuses it)"
    if ggml_type not in GGML_TYPES:
        return (f"type id {ggml_type}, which this reader does not know (ggml's types as of llama.cpp 0.3.36: ids "
                f"0-{max(GGML_TYPES)})")
    name = GGML_TYPES[ggml_type][0]
    if name in _NOT_WEIGHTS:
        return f"{name}, {_NOT_WEIGHTS[name]}"
    if name in FLOAT_VIEWS or name in OWN_DEQUANTISERS or _gguf_py_dequantises(ggml_type):
        return None
    return f"{name}, which neither gguf-py nor refimpl can dequantise"


@cache
def _gguf_py_dequantises(ggml_type: int) -> bool:
    """Whether the installed gguf-py dequantises this block type (tried on one zero block)."""
    import gguf.quants
    from gguf.constants import GGMLQuantizationType
    try:
        qtype = GGMLQuantizationType(ggml_type)
        gguf.quants.dequantize(np.zeros((1, GGML_TYPES[ggml_type][2]), np.uint8), qtype)
        return True
    except (NotImplementedError, KeyError, ValueError):
        return False


def dequantize(rows: np.ndarray, ggml_type: int) -> np.ndarray:
    """Rows of blocks of a readable block type, uint8 [..., row bytes] -> float32 [..., row values], as ggml's
    to_float computes them (bit for bit: tests/formats/test_gguf.py)."""
    if rows.size == 0:   # an empty tensor (a zero dimension): no blocks to decode
        _, block, nbytes = GGML_TYPES[ggml_type]
        return np.zeros((*rows.shape[:-1], rows.shape[-1] // nbytes * block), np.float32)
    own = OWN_DEQUANTISERS.get(type_name(ggml_type))
    if own is not None:
        return own(rows)
    import gguf.quants
    from gguf.constants import GGMLQuantizationType
    return gguf.quants.dequantize(rows, GGMLQuantizationType(ggml_type))


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
            raise FormatError(f"{self.path}: truncated or corrupt GGUF header: {n_kv} metadata entries and {n_tensors} tensors "
                              f"cannot fit in the {size - c.pos} bytes after the header")
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
                    raise FormatError(f"{self.path}: truncated: tensor {name!r} needs bytes [{begin}, {begin + nbytes}) "
                                      f"but the file has {size}")
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


# ---------------------------------------------------------------------------------------------------- metadata

def _key(g: GGUFFile, arch: str, key: str, required: bool = True, default=None, kind: str = "int"):
    """Metadata `{arch}.{key}` of type `kind`: "int" (a size, >= 0), "count" (an int >= 1), "float" (finite), "str",
    or "ints" (a numeric array, returned as a list of ints)."""
    full = f"{arch}.{key}"
    if full not in g.metadata:
        if required:
            raise ConfigError(f"{g.path}: missing metadata {full!r} (needed for architecture {arch!r})")
        return default
    return typed(g, full, kind)


def typed(g: GGUFFile, key: str, kind: str):
    """g.metadata[key] checked to be of type `kind` (see _key), or ConfigError naming it."""
    v, where = g.metadata[key], f"{g.path}: metadata {key!r}"
    if kind == "ints":
        if not isinstance(v, np.ndarray) or v.dtype.kind not in "iub" or v.ndim != 1:
            raise ConfigError(f"{where}: expected an array of integers, got {brief(v)}")
        return [int(x) for x in v]
    if isinstance(v, np.ndarray) and kind != "str" and v.dtype.kind in "iubf" and v.ndim == 1:
        if v.size == 0 or (v != v.flat[0]).any():   # per-layer arrays: accepted when uniform
            raise ConfigError(f"{where} varies per layer ({brief(v.tolist())}); not supported")
        v = v.flat[0].item()
    if kind in ("int", "count"):
        return integer(v, where, ConfigError, lo=0 if kind == "int" else 1)
    if kind == "bool":
        if not isinstance(v, bool):
            raise ConfigError(f"{where}: expected true / false, got {brief(v)}")
        return v
    if kind == "float":
        return number(v, where, ConfigError)
    if not isinstance(v, str):
        raise ConfigError(f"{where}: expected a string, got {brief(v)}")
    return v


_BLOCK = re.compile(r"blk\.(\d+)\.")


def _token_id(g: GGUFFile, which: str) -> int | None:
    key = f"tokenizer.ggml.{which}_token_id"
    return typed(g, key, "int") if key in g.metadata else None


def _f32(x: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (9.99999997e-07 -> 1e-06)."""
    return float(str(np.float32(x)))


def config_dict(g: GGUFFile) -> dict:
    """The HF config.json dict (as `config_from_dict` takes it) that the GGUF's metadata and tensors describe."""
    arch = g.architecture
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{g.path}: unknown architecture {arch!r} (general.architecture); supported: "
                          f"{', '.join(ARCHITECTURES)}")
    model_type = ARCHITECTURES[arch]
    k = lambda key, *a, **kw: _key(g, arch, key, *a, **kw)
    if "token_embd.weight" not in g.tensors:
        raise WeightsError(f"{g.path}: missing tensor 'token_embd.weight'")
    if len(g.tensors["token_embd.weight"].shape) != 2:
        raise WeightsError(f"{g.path}: tensor 'token_embd.weight' has shape "
                           f"{list(g.tensors['token_embd.weight'].shape)}, expected [vocab, hidden]")
    vocab, hidden = g.tensors["token_embd.weight"].shape
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None and not isinstance(tokens, StringArray):
        raise ConfigError(f"{g.path}: metadata 'tokenizer.ggml.tokens': expected an array of strings, got "
                          f"{brief(tokens)}")
    if tokens is not None and len(tokens) != vocab:
        raise WeightsError(f"{g.path}: tensor 'token_embd.weight' has {vocab} rows but tokenizer.ggml.tokens has "
                           f"{len(tokens)} entries")
    if k("embedding_length") != hidden:
        raise WeightsError(f"{g.path}: tensor 'token_embd.weight' is {vocab} x {hidden}, but "
                           f"{arch}.embedding_length is {k('embedding_length')}")
    nextn = k("nextn_predict_layers", required=False, default=0)
    blocks, block_count = len({m[1] for n in g.tensors if (m := _BLOCK.match(n))}), k("block_count", kind="count")
    if block_count > blocks or nextn >= block_count:   # counts checked against the file before any loop runs
        raise WeightsError(f"{g.path}: {arch}.block_count is {block_count} (nextn_predict_layers {nextn}), but the "
                           f"file holds tensors of {blocks} blocks")
    n_layers = block_count - nextn
    heads = k("attention.head_count", kind="count")
    head_dim = k("attention.key_length", required=False, default=None) or hidden // heads
    if head_dim < 1:
        raise ConfigError(f"{g.path}: no head dim: {arch}.attention.key_length is missing and embedding_length "
                          f"{hidden} < head_count {heads}")
    d = {
        "model_type": model_type, "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": n_layers,
        "num_attention_heads": heads, "num_key_value_heads": k("attention.head_count_kv", required=False,
                                                               default=heads),
        "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": k("context_length", required=False, default=32768),
        "rms_norm_eps": _f32(k("attention.layer_norm_rms_epsilon", kind="float")),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": any(f"blk.{i}.attn_q.bias" in g.tensors for i in range(n_layers)),
        "bos_token_id": _token_id(g, "bos"), "eos_token_id": _token_id(g, "eos"),
        "pad_token_id": _token_id(g, "padding"),
    }
    if (ff := k("feed_forward_length", required=False)) is not None:
        d["intermediate_size"] = ff
    rope = {"rope_type": "default", "rope_theta": _f32(k("rope.freq_base", required=False, default=10000.0,
                                                         kind="float"))}
    # llama.cpp's reading (llama_model_base::load_hparams, llama_context): the scaling type defaults to linear, the
    # factor to rope.scaling.factor, else the older rope.scale_linear, else none; YaRN's original context to
    # context_length. For these architectures it reads no rope.scaling.yarn_* key (ignored_metadata): beta_fast 32,
    # beta_slow 1 and the attention factor mscale(factor) = 0.1 ln(factor) + 1 always, times
    # rope.scaling.attn_factor, which it applies to every rope type.
    scaling = k("rope.scaling.type", required=False, default="linear", kind="str")
    factor = (k("rope.scaling.factor", required=False, kind="float") or k("rope.scale_linear", required=False,
                                                                          kind="float") or 0.0)
    attn_factor = k("rope.scaling.attn_factor", required=False, default=1.0, kind="float")
    if factor < 0 or attn_factor <= 0:
        raise ConfigError(f"{g.path}: {arch}.rope.scaling factor {factor:g} / attn_factor {attn_factor:g}: expected "
                          f"positive numbers")
    if scaling == "yarn":
        factor = factor or 1.0
        rope.update(rope_type="yarn", factor=_f32(factor), original_max_position_embeddings=k(
            "rope.scaling.original_context_length", required=False, default=d["max_position_embeddings"]))
        if attn_factor != 1:
            rope["attention_factor"] = float(np.float32(attn_factor)) * (0.1 * math.log(factor) + 1 if factor > 1
                                                                         else 1.0)
    elif scaling == "linear" and factor not in (0, 1):
        rope.update(rope_type="linear", factor=_f32(factor))
    elif scaling not in ("none", "linear"):
        raise ConfigError(f"{g.path}: unsupported {arch}.rope.scaling.type {scaling!r}; supported: none, linear, yarn")
    if scaling != "yarn" and attn_factor != 1:
        raise ConfigError(f"{g.path}: {arch}.rope.scaling.attn_factor {attn_factor:g} with rope scaling {scaling!r}: "
                          f"llama.cpp scales cos and sin by it, which has no transformers counterpart here "
                          f"(supported with yarn only)")
    rot = k("rope.dimension_count", required=False, default=head_dim)
    if model_type not in HYBRID_TYPES and rot != head_dim:
        raise ConfigError(f"{g.path}: {arch}.rope.dimension_count {rot} differs from the head dim {head_dim}, which "
                          f"llama.cpp's {arch} refuses (GGML_ASSERT(n_embd_head == n_rot))")
    if model_type in HYBRID_TYPES:
        prf = rot / head_dim
        if int(head_dim * prf) != rot:   # the config takes rot = int(head_dim * factor): keep that exact
            prf = math.nextafter(prf, math.inf)
        rope["partial_rotary_factor"] = prf
    if model_type in ("qwen3_moe", "qwen3_next", "qwen3_5_moe_text"):
        # norm_topk_prob is not stored: llama.cpp always renormalises the top-k weights (models.md §7.2)
        d.update(num_experts=k("expert_count", kind="count"), num_experts_per_tok=k("expert_used_count", kind="count"),
                 moe_intermediate_size=k("expert_feed_forward_length"), norm_topk_prob=True)
        dense = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in g.tensors]
        if model_type != "qwen3_5_moe_text":
            d["mlp_only_layers"] = dense
        elif dense:
            raise WeightsError(f"{g.path}: missing tensor 'blk.{dense[0]}.ffn_gate_inp.weight' (qwen35moe layers "
                               f"are all sparse)")
        if model_type != "qwen3_moe":
            d["shared_expert_intermediate_size"] = k("expert_shared_feed_forward_length")
    if model_type in HYBRID_TYPES:
        dt_rank = k("ssm.time_step_rank", kind="count")
        d.update(linear_conv_kernel_dim=k("ssm.conv_kernel"), linear_key_head_dim=k("ssm.state_size"),
                 linear_num_key_heads=k("ssm.group_count"), linear_num_value_heads=dt_rank,
                 linear_value_head_dim=k("ssm.inner_size") // dt_rank)
        recurrent = k("attention.recurrent_layers", required=False, kind="ints")
        if recurrent is not None:
            d["layer_types"] = ["linear_attention" if r else "full_attention" for r in recurrent[:n_layers]]
        else:
            d["full_attention_interval"] = k("full_attention_interval", required=False, default=4, kind="count")
        if model_type != "qwen3_next":   # llama.cpp requires the sections: [T, H, W, E], E (llama.cpp's) usually 0
            sections = k("rope.dimension_sections", kind="ints")
            if len(sections) != 4:
                raise ConfigError(f"{g.path}: metadata '{arch}.rope.dimension_sections' must have 4 entries, got "
                                  f"{sections}")
            rope.update(mrope_section=sections if sections[3] else sections[:3], mrope_interleaved=True)
        d["mtp_num_hidden_layers"] = nextn
    d["rope_parameters"] = rope
    return d


# ---------------------------------------------------------------------------------------------------- tensors

class LazyTensor:
    """A model tensor read from the file only when used: dequantised, and its conversion transform undone, then.

    shape, dtype (float32: what `read` returns) and nbytes (the bytes it takes in the file) are known up front, so
    checks, sizes and `refimpl info` read no data. `read(index)` gives the tensor, or part `index` (int, slice or
    int array) of its leading axis; `partial` says whether that reads only the part (a plain dequantisation, an
    expert of a stack: rows of blocks are independent) or computes the whole tensor first (a transform that moves
    rows, such as Qwen3.5's value-head untiling). A tensor of a type that cannot be read raises WeightsError,
    naming it, when it is read.
    """

    def __init__(self, shape, compute, nbytes: int, partial: bool = False):
        """compute(index) when partial, else compute(): the float array."""
        self.shape, self.dtype, self.nbytes, self.partial = tuple(shape), np.dtype(np.float32), int(nbytes), partial
        self.ndim = len(self.shape)
        self._compute = compute

    def read(self, index=None) -> np.ndarray:
        if self.partial:
            a = np.asarray(self._compute(index), np.float32)
            return a.reshape(self.shape) if index is None else a
        a = np.asarray(self._compute(), np.float32).reshape(self.shape)
        return a if index is None else a[index]

    def __array__(self, dtype=None, copy=None):
        a = self.read()
        return a if dtype is None else a.astype(dtype, copy=False)

    def __getitem__(self, index):
        return np.asarray(self)[index] if isinstance(index, tuple) else self.read(index)


def untile_v_heads(a: np.ndarray, axis: int, Hk: int, r: int, d: int) -> np.ndarray:
    """GGUF tiled value-head order (h' = j*Hk + kh) -> HF grouped order (h = kh*r + j) along `axis`
    (length r*Hk*d): view it as [r, Hk, d], swap to [Hk, r, d], flatten."""
    a = np.moveaxis(a, axis, 0)
    rest = a.shape[1:]
    a = a.reshape(r, Hk, d, *rest).swapaxes(0, 1).reshape(r * Hk * d, *rest)
    return np.moveaxis(a, 0, axis)


def tile_v_heads(a: np.ndarray, axis: int, Hk: int, r: int, d: int) -> np.ndarray:
    """HF grouped value-head order -> GGUF tiled order: view the axis as [Hk, r, d], swap to [r, Hk, d]."""
    return untile_v_heads(a, axis, r, Hk, d)


def _plain_names(cfg) -> dict:
    """HF name -> GGUF name of every tensor stored without a value transform (beyond a possible reshape)."""
    m = {"model.embed_tokens.weight": "token_embd.weight"}
    if not cfg.tie_word_embeddings:
        m["lm_head.weight"] = "output.weight"
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}", f"blk.{i}"
        if cfg.layer_types[i] != "linear_attention":
            for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
                m[f"{p}.self_attn.{hf}.weight"] = f"{b}.{gg}.weight"
                if cfg.attention_bias:
                    m[f"{p}.self_attn.{hf}.bias"] = f"{b}.{gg}.bias"
        if not cfg.is_moe_layer(i):
            for proj in ("gate", "up", "down"):
                m[f"{p}.mlp.{proj}_proj.weight"] = f"{b}.ffn_{proj}.weight"
        else:
            m[f"{p}.mlp.gate.weight"] = f"{b}.ffn_gate_inp.weight"
            if cfg.shared_expert_intermediate_size:
                for proj in ("gate", "up", "down"):
                    m[f"{p}.mlp.shared_expert.{proj}_proj.weight"] = f"{b}.ffn_{proj}_shexp.weight"
    return m


def _norm_names(cfg) -> dict:
    """HF name -> GGUF name of the RMSNorm weights (stored as 1 + w for the zero-centred-norm models)."""
    m = {"model.norm.weight": "output_norm.weight"}
    post = "post_attention_norm" if cfg.is_hybrid else "ffn_norm"
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}", f"blk.{i}"
        m[f"{p}.input_layernorm.weight"] = f"{b}.attn_norm.weight"
        m[f"{p}.post_attention_layernorm.weight"] = f"{b}.{post}.weight"
        if cfg.layer_types[i] != "linear_attention":
            m[f"{p}.self_attn.q_norm.weight"] = f"{b}.attn_q_norm.weight"
            m[f"{p}.self_attn.k_norm.weight"] = f"{b}.attn_k_norm.weight"
    return m


def read_gguf_tensors(g: GGUFFile, cfg, strict: bool = True) -> dict:
    """HF name -> array (or LazyTensor) for every tensor of the model, the conversion transforms undone.
    strict: a tensor of a type that cannot be read (`unreadable`) is an error now, naming it; else only when read."""
    from ..models.model import expected_tensors
    path = g.path
    hf_shapes = expected_tensors(cfg)

    read = set()

    def need(name, shape=None):
        """The tensor's info, after checking it exists, (strict) can be read and (given `shape`) has that shape."""
        read.add(name)
        if name not in g.tensors:
            expected = f" (expected shape {list(shape)})" if shape else ""
            raise WeightsError(f"{path}: missing tensor {name!r}{expected}")
        t = g.tensors[name]
        if strict and (why := unreadable(t.ggml_type)) is not None:   # named now, not at the first forward pass
            raise WeightsError(f"{path}: tensor {name!r} has {why}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise WeightsError(f"{path}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        return t

    def lazy(shape, compute, *sources, partial=False, share=1):
        """A LazyTensor over GGUF tensors `sources` (a `share` of their bytes: one expert of a stack)."""
        return LazyTensor(shape, compute, sum(g.tensors[s].nbytes or 0 for s in sources) // share, partial)

    def src(name, index=None):
        return g.array(name, index)

    def direct(name, shape):
        """A tensor used as stored (shape checked): F32 / F16 / BF16 / F64 as a zero-copy view; a block type
        dequantised when read."""
        t = need(name, shape)
        if type_name(t.ggml_type) in FLOAT_VIEWS:
            return g.array(name)
        return lazy(shape, lambda index: src(name, index), name, partial=True)

    out = {hf: direct(gg, hf_shapes[hf]) for hf, gg in _plain_names(cfg).items()}
    for hf, gg in _norm_names(cfg).items():
        if cfg.zero_centered_norms:   # stored = 1 + w  ->  w = stored - 1 (exact in float32 for stored in [0.5, 2])
            out[hf] = lazy(need(gg, hf_shapes[hf]).shape,
                           lambda index, gg=gg: src(gg, index).astype(np.float32) - np.float32(1), gg, partial=True)
        else:
            out[hf] = direct(gg, hf_shapes[hf])
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}", f"blk.{i}"
        if cfg.is_moe_layer(i):
            out.update(_experts(g, cfg, p, b, need, lazy, src))
            if cfg.shared_expert_intermediate_size:
                # the converter writes [1, H] (ne {H, 1}); llama.cpp reads it as an H vector, so accept [H] too
                name, H = f"{b}.ffn_gate_inp_shexp.weight", cfg.hidden_size
                need(name, (H,) if g.tensors.get(name) and g.tensors[name].shape == (H,) else (1, H))
                out[f"{p}.mlp.shared_expert_gate.weight"] = lazy((1, H), lambda name=name: src(name), name)
        if cfg.layer_types[i] == "linear_attention":
            out.update(_linear_attention(g, cfg, f"{p}.linear_attn", b, need, lazy, src, direct))
    # nextn (MTP) blocks blk.{L}.. are recognised (config mtp_layers) and not read; anything else unread means the
    # file holds tensors this config does not use (a bias, a router, a wrong architecture): refuse it
    mtp = re.compile(r"blk\.(\d+)\.")
    unread = sorted(n for n in g.tensors if n not in read and not ((m := mtp.match(n)) and
                                                                   int(m[1]) >= cfg.num_hidden_layers))
    if unread:
        raise WeightsError(f"{path}: {len(unread)} tensor(s) the {cfg.model_type} config does not use, e.g. "
                           f"{unread[:3]} (a config / file mismatch)")
    return out


def _experts(g, cfg, p, b, need, lazy, src) -> dict:
    """Stacked experts -> per-expert tensors (Qwen3-MoE, Qwen3-Next checkpoints) or the fused gate_up_proj /
    down_proj (Qwen3.5-MoE checkpoints), each expert read on its own. A fused ffn_gate_up_exps is accepted too."""
    E, Ie, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    fused, gate, up = (f"{b}.ffn_gate_up_exps.weight", f"{b}.ffn_gate_exps.weight", f"{b}.ffn_up_exps.weight")
    down = f"{b}.ffn_down_exps.weight"
    need(down, (E, H, Ie))
    if fused in g.tensors:
        need(fused, (E, 2 * Ie, H))
        sources = (fused,)
        gate_up = lambda e=None: src(fused, e)
    else:
        need(gate, (E, Ie, H)), need(up, (E, Ie, H))
        sources = (gate, up)
        gate_up = lambda e=None: np.concatenate([src(gate, e), src(up, e)], axis=-2)
    out = {}
    if cfg.model_type == "qwen3_5_moe_text":
        out[f"{p}.mlp.experts.gate_up_proj"] = lazy((E, 2 * Ie, H), gate_up, *sources, partial=True)
        out[f"{p}.mlp.experts.down_proj"] = lazy((E, H, Ie), lambda e=None: src(down, e), down, partial=True)
        return out
    for e in range(E):
        q = f"{p}.mlp.experts.{e}"
        if fused in g.tensors:
            out[f"{q}.gate_proj.weight"] = lazy((Ie, H), lambda e=e: gate_up(e)[:Ie], fused, share=2 * E)
            out[f"{q}.up_proj.weight"] = lazy((Ie, H), lambda e=e: gate_up(e)[Ie:], fused, share=2 * E)
        else:
            out[f"{q}.gate_proj.weight"] = lazy((Ie, H), lambda e=e: src(gate, e), gate, share=E)
            out[f"{q}.up_proj.weight"] = lazy((Ie, H), lambda e=e: src(up, e), up, share=E)
        out[f"{q}.down_proj.weight"] = lazy((H, Ie), lambda e=e: src(down, e), down, share=E)
    return out


def _linear_attention(g, cfg, p, b, need, lazy, src, direct) -> dict:
    H, Hk, Hv, Dk, Dv, Kc = (cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                             cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim)
    r, key_dim, value_dim, conv_dim = Hv // Hk, Hk * Dk, Hv * Dv, cfg.conv_dim
    tiled = cfg.model_type != "qwen3_next" and Hk != Hv     # Qwen3.5's value-head reorder (models.md §7.3)

    def untile(a, axis, d, start=0):
        return _retile(untile_v_heads, a, axis, d, start, Hk, r) if tiled else a

    for name, shape in (("ssm_a", (Hv,)), ("ssm_dt.bias", (Hv,)), ("ssm_conv1d.weight", (conv_dim, Kc)),
                        ("ssm_out.weight", (H, value_dim))):
        need(f"{b}.{name}", shape)
    a, dt, conv, out_proj = (f"{b}.{n}" for n in ("ssm_a", "ssm_dt.bias", "ssm_conv1d.weight", "ssm_out.weight"))
    out = {
        # ssm_a = -exp(A_log)  ->  A_log = ln(-ssm_a), in float64 then rounded
        f"{p}.A_log": lazy((Hv,), lambda: untile(log(-src(a).astype(np.float32)), 0, 1), a),
        f"{p}.dt_bias": lazy((Hv,), lambda: untile(src(dt), 0, 1), dt),
        f"{p}.conv1d.weight": lazy((conv_dim, 1, Kc), lambda: untile(src(conv), 0, Dv, 2 * key_dim)[:, None, :], conv),
        f"{p}.norm.weight": direct(f"{b}.ssm_norm.weight", (Dv,)),
        # the value heads are columns here: rows stay independent
        f"{p}.out_proj.weight": lazy((H, value_dim), lambda index: untile(src(out_proj, index), -1, Dv), out_proj,
                                     partial=True),
    }
    if cfg.model_type == "qwen3_next":
        if f"{b}.ssm_in.weight" in g.tensors:          # older files: the unsplit, still grouped in_proj_qkvz
            out[f"{p}.in_proj_qkvz.weight"] = direct(f"{b}.ssm_in.weight", (2 * key_dim + 2 * value_dim, H))
        else:
            qkv, z = f"{b}.attn_qkv.weight", f"{b}.attn_gate.weight"
            need(qkv, (conv_dim, H)), need(z, (value_dim, H))
            out[f"{p}.in_proj_qkvz.weight"] = lazy((2 * key_dim + 2 * value_dim, H), lambda: regroup_qkvz(
                src(qkv), src(z), Hk, Dk, r * Dv), qkv, z)
        out[f"{p}.in_proj_ba.weight"] = direct(f"{b}.ssm_ba.weight", (2 * Hv, H))
        return out
    for name, shape in (("attn_qkv.weight", (conv_dim, H)), ("attn_gate.weight", (value_dim, H)),
                        ("ssm_beta.weight", (Hv, H)), ("ssm_alpha.weight", (Hv, H))):
        need(f"{b}.{name}", shape)
    for hf, gg, d, start in (("in_proj_qkv", "attn_qkv", Dv, 2 * key_dim), ("in_proj_z", "attn_gate", Dv, 0),
                             ("in_proj_b", "ssm_beta", 1, 0), ("in_proj_a", "ssm_alpha", 1, 0)):
        name = f"{b}.{gg}.weight"
        out[f"{p}.{hf}.weight"] = lazy(g.tensors[name].shape, lambda name=name, d=d, start=start: untile(
            src(name), 0, d, start), name)
    return out


def regroup_qkvz(qkv: np.ndarray, z: np.ndarray, Hk: int, Dk: int, rDv: int) -> np.ndarray:
    """Qwen3-Next: attn_qkv [all q (Hk*Dk) | all k | all v (Hk*rDv)] rows + attn_gate [Hk*rDv] rows -> HF's
    in_proj_qkvz, grouped per key head kh as [q_kh (Dk) | k_kh (Dk) | v_kh (rDv) | z_kh (rDv)]."""
    H = qkv.shape[-1]
    kd = Hk * Dk
    q, k, v = qkv[:kd].reshape(Hk, Dk, H), qkv[kd:2 * kd].reshape(Hk, Dk, H), qkv[2 * kd:].reshape(Hk, rDv, H)
    return np.concatenate([q, k, v, z.reshape(Hk, rDv, H)], axis=1).reshape(-1, H)


def split_qkvz(qkvz: np.ndarray, Hk: int, Dk: int, rDv: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of regroup_qkvz: HF in_proj_qkvz -> (attn_qkv, attn_gate), as llama.cpp's converter splits it."""
    H = qkvz.shape[-1]
    g = qkvz.reshape(Hk, 2 * Dk + 2 * rDv, H)
    q, k, v, z = np.split(g, [Dk, 2 * Dk, 2 * Dk + rDv], axis=1)
    return np.concatenate([q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)]), z.reshape(-1, H)


def reading_notes(g: GGUFFile) -> list[str]:
    """How llama.cpp 0.3.36 reads metadata that would mean something else to transformers' eyes: the HF YaRN
    parameters llama.cpp's converter writes as rope.scaling.yarn_* are read only by other architectures (grok,
    mistral3), and a scaling factor without a scaling type is linear scaling."""
    arch, m = g.architecture, g.metadata
    ignored = [f"{arch}.rope.scaling.yarn_{key} {_f32(typed(g, f'{arch}.rope.scaling.yarn_{key}', 'float')):g}"
               for key in ("beta_fast", "beta_slow", "attn_factor", "ext_factor") if f"{arch}.rope.scaling.yarn_{key}" in m]
    notes = [f"not read (llama.cpp does not): {', '.join(ignored)}"] if ignored else []
    factor = _key(g, arch, "rope.scaling.factor", False, kind="float") or _key(g, arch, "rope.scale_linear", False,
                                                                               kind="float")
    if factor not in (None, 0, 1) and f"{arch}.rope.scaling.type" not in m:
        notes.append(f"rope scaling factor {_f32(factor):g} without a scaling type: linear, llama.cpp's default")
    return notes


def llamacpp_note(cfg, notes=()) -> str | None:
    """The one-line note a GGUF gets on load where llama.cpp's semantics, which it runs with, differ from
    transformers' for the same values (cfg.semantic_differences) or llama.cpp reads the metadata its own way
    (reading_notes); None when there is nothing to say."""
    parts = [*cfg.semantic_differences(), *notes]
    return f"{cfg.source}: runs as llama.cpp runs it: " + "; ".join(parts) if parts else None


def conversion_note(before, after) -> str | None:
    """What a GGUF written from a model with config `before` means to llama.cpp (config `after`, read back)
    that the model did not: values llama.cpp does not read (YaRN's betas, ...) and, for an HF model,
    the places where llama.cpp's semantics differ from transformers'. None when the meaning is the same."""
    parts = []
    old, new = before.to_dict(), after.to_dict()
    for key in sorted((set(old) | set(new)) - {"source", "semantics"}):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            parts += [f"{key}.{k} {a.get(k, 'unset')} -> {b.get(k, 'unset')}" for k in sorted(set(a) | set(b))
                      if a.get(k) != b.get(k)]
        elif a != b:
            parts.append(f"{key} {a!r} -> {b!r}")
    if before.semantics != after.semantics:
        parts += after.semantic_differences()
    return f"{after.source}: llama.cpp runs it otherwise than {before.source}: " + "; ".join(parts) if parts else None


def load_gguf(path: str | Path, strict: bool = True):
    """(ModelConfig, HF name -> array or LazyTensor) of a .gguf file, with llama.cpp's semantics (a one-line note,
    logged as a warning, says where they differ from transformers'). strict: a tensor of a type that cannot be
    read is an error now (default), else only when it is read (`refimpl info` lists such files)."""
    g = GGUFFile(path)
    cfg = config_from_dict(config_dict(g), source=str(g.path), semantics="llama.cpp")
    arrays = read_gguf_tensors(g, cfg, strict)
    if (note := llamacpp_note(cfg, reading_notes(g))) is not None:
        _log.warning(note)
    return cfg, arrays


# ---------------------------------------------------------------------------------------------------- writing

WRITE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
_FILE_TYPE = {"F32": 0, "F16": 1, "BF16": 32, "Q8_0": 7, "Q4_0": 2}     # llama_ftype (general.file_type)


def hf_to_gguf_tensors(cfg, w) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array (torch order) in llama.cpp's layout, every conversion transform applied, as
    convert_hf_to_gguf.py writes them. `w` maps HF names to arrays (a Weights, or a dict)."""
    f32 = lambda name: np.asarray(w[name], dtype=np.float32)
    out = {gg: f32(hf) for hf, gg in _plain_names(cfg).items()}
    for hf, gg in _norm_names(cfg).items():
        out[gg] = f32(hf) + np.float32(1) if cfg.zero_centered_norms else f32(hf)
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}", f"blk.{i}"
        if cfg.is_moe_layer(i):
            experts = [_expert(w, f"{p}.mlp.experts", e) for e in range(cfg.num_experts)]
            for k, proj in enumerate(("gate", "up", "down")):
                out[f"{b}.ffn_{proj}_exps.weight"] = np.stack([np.asarray(x[k], np.float32) for x in experts])
            if cfg.shared_expert_intermediate_size:
                out[f"{b}.ffn_gate_inp_shexp.weight"] = f32(f"{p}.mlp.shared_expert_gate.weight")  # [1, H]
        if cfg.layer_types[i] != "linear_attention":
            continue
        q = f"{p}.linear_attn"
        r, key_dim = Hv // Hk, Hk * Dk
        tile = (lambda a, axis, d, start=0: _retile(tile_v_heads, a, axis, d, start, Hk, r)) \
            if cfg.model_type != "qwen3_next" and Hk != Hv else (lambda a, axis, d, start=0: a)
        # -exp(A_log), evaluated in float64 and rounded once (within an ulp of torch's float32 exp)
        out[f"{b}.ssm_a"] = tile((-np.exp(f32(f"{q}.A_log").astype(np.float64))).astype(np.float32), 0, 1)
        out[f"{b}.ssm_dt.bias"] = tile(f32(f"{q}.dt_bias"), 0, 1)
        out[f"{b}.ssm_conv1d.weight"] = tile(f32(f"{q}.conv1d.weight")[:, 0, :], 0, Dv, 2 * key_dim)
        out[f"{b}.ssm_norm.weight"] = f32(f"{q}.norm.weight")
        out[f"{b}.ssm_out.weight"] = tile(f32(f"{q}.out_proj.weight"), 1, Dv)
        if cfg.model_type == "qwen3_next":
            out[f"{b}.attn_qkv.weight"], out[f"{b}.attn_gate.weight"] = split_qkvz(
                f32(f"{q}.in_proj_qkvz.weight"), Hk, Dk, r * Dv)
            out[f"{b}.ssm_ba.weight"] = f32(f"{q}.in_proj_ba.weight")
        else:
            out[f"{b}.attn_qkv.weight"] = tile(f32(f"{q}.in_proj_qkv.weight"), 0, Dv, 2 * key_dim)
            out[f"{b}.attn_gate.weight"] = tile(f32(f"{q}.in_proj_z.weight"), 0, Dv)
            out[f"{b}.ssm_beta.weight"] = tile(f32(f"{q}.in_proj_b.weight"), 0, 1)
            out[f"{b}.ssm_alpha.weight"] = tile(f32(f"{q}.in_proj_a.weight"), 0, 1)
    return out


def _expert(w, prefix, e):
    if hasattr(w, "expert"):
        return w.expert(prefix, e)
    if f"{prefix}.{e}.gate_proj.weight" in w:
        return tuple(w[f"{prefix}.{e}.{p}_proj.weight"] for p in ("gate", "up", "down"))
    gate_up = np.asarray(w[f"{prefix}.gate_up_proj"][e])
    half = gate_up.shape[0] // 2
    return gate_up[:half], gate_up[half:], w[f"{prefix}.down_proj"][e]


def _retile(fn, a, axis, d, start, Hk, r):
    """fn (tile_v_heads when writing, untile_v_heads when reading) on the part of `axis` from `start` on (the v
    rows / channels of a q|k|v tensor), in a float32 copy."""
    a = np.array(a, dtype=np.float32)
    idx = [slice(None)] * a.ndim
    idx[axis] = slice(start, None)
    a[tuple(idx)] = fn(a[tuple(idx)], axis, Hk, r, d)
    return a


def _stays_f32(name: str, a: np.ndarray) -> bool:
    """llama.cpp keeps these in F32 whatever the file type: 1-D tensors, norms, the MoE routers, the conv."""
    return (a.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight")
            or ".ffn_gate_inp" in name or ".ssm_conv1d" in name)


def encode_tensor(name: str, a: np.ndarray, qtype: str):
    """(data, ggml type) of one tensor for file type `qtype`: F32 / F16 / BF16 as is; Q8_0 / Q4_0 by gguf-py's
    quantiser (llama.cpp's reference rounding); a tensor whose rows are not whole blocks falls back to F16, as
    llama.cpp's converter does."""
    import gguf.quants
    from gguf.constants import GGMLQuantizationType as qtypes
    if qtype == "F32" or _stays_f32(name, a):
        return a.astype(np.float32), qtypes.F32
    if qtype == "F16":
        return a.astype(np.float16), qtypes.F16
    try:
        return gguf.quants.quantize(a.astype(np.float32), qtypes[qtype]), qtypes[qtype]
    except (gguf.quants.QuantError, ValueError):
        return a.astype(np.float16), qtypes.F16


def _write_metadata(wr, cfg, name: str, qtype: str, tokenizer: dict | None) -> None:
    """The metadata keys llama.cpp's converter writes for this architecture (models.md §7.2, §7.4)."""
    arch = MODEL_TYPE_TO_ARCH[cfg.model_type]
    wr.add_type("model")
    wr.add_name(name)
    wr.add_block_count(cfg.num_hidden_layers)
    wr.add_context_length(cfg.max_position_embeddings)
    wr.add_embedding_length(cfg.hidden_size)
    if cfg.intermediate_size is not None:
        wr.add_feed_forward_length(cfg.intermediate_size)
    wr.add_head_count(cfg.num_attention_heads)
    wr.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope
    if rope["rope_type"] in ("linear", "yarn"):
        wr.add_string(f"{arch}.rope.scaling.type", rope["rope_type"])
        wr.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
        if rope["rope_type"] == "yarn":
            wr.add_uint32(f"{arch}.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
            for hf, key in (("attention_factor", "attn_factor"), ("beta_fast", "beta_fast"),
                            ("beta_slow", "beta_slow")):
                if rope.get(hf) is not None:
                    wr.add_float32(f"{arch}.rope.scaling.yarn_{key}", rope[hf])
    elif rope["rope_type"] != "default":
        raise ConfigError(f"{cfg.source}: rope_type {rope['rope_type']!r} has no GGUF encoding here "
                          f"(supported: default, linear, yarn)")
    if cfg.mrope_section is not None:   # [T, H, W, E]: llama.cpp's fourth (E) section is 0 unless a GGUF had one
        wr.add_array(f"{arch}.rope.dimension_sections", [int(v) for v in (*cfg.mrope_section, 0, 0)[:4]])
    wr.add_rope_freq_base(rope["rope_theta"])
    wr.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.num_experts:
        wr.add_expert_count(cfg.num_experts)
        wr.add_expert_used_count(cfg.num_experts_per_tok)
    wr.add_key_length(cfg.head_dim)
    wr.add_value_length(cfg.head_dim)
    wr.add_file_type(_FILE_TYPE[qtype])
    if cfg.num_experts:
        wr.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size:
            wr.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if cfg.is_hybrid:
        wr.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
        wr.add_ssm_state_size(cfg.linear_key_head_dim)
        wr.add_ssm_group_count(cfg.linear_num_key_heads)
        wr.add_ssm_time_step_rank(cfg.linear_num_value_heads)
        wr.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
        wr.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in cfg.layer_types])
        wr.add_uint32(f"{arch}.full_attention_interval", _interval(cfg.layer_types))
        wr.add_rope_dimension_count(cfg.rotary_dim)
    wr.add_quantization_version(2)
    if tokenizer is None:   # no vocabulary: llama.cpp then sizes it from {arch}.vocab_size
        wr.add_tokenizer_model("none")
        wr.add_vocab_size(cfg.vocab_size)
        eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, (list, tuple)) else cfg.eos_token_id
        ids = {"bos": cfg.bos_token_id, "eos": eos, "pad": cfg.pad_token_id}
    else:
        wr.add_tokenizer_model(tokenizer.get("model", "gpt2"))
        if tokenizer.get("pre"):
            wr.add_tokenizer_pre(tokenizer["pre"])
        wr.add_token_list(tokenizer["tokens"])
        wr.add_token_types([int(t) for t in tokenizer["token_types"]])
        if tokenizer.get("merges"):
            wr.add_token_merges(tokenizer["merges"])
        ids = {key: tokenizer.get(f"{key}_token_id") for key in ("bos", "eos", "pad", "unk")}
    keys = {"bos": "bos", "eos": "eos", "pad": "padding", "unk": "unknown"}   # llama.cpp's key names
    for key, value in ids.items():
        if value is not None:
            wr.add_uint32(f"tokenizer.ggml.{keys[key]}_token_id", int(value))
    if tokenizer is None:
        return
    for key in ("add_bos_token", "add_eos_token"):
        if tokenizer.get(key) is not None:
            wr.add_bool(f"tokenizer.ggml.{key}", bool(tokenizer[key]))
    if tokenizer.get("chat_template"):
        wr.add_chat_template(tokenizer["chat_template"])


def _check_tokenizer(cfg, tokenizer: dict | None) -> None:
    if tokenizer is not None and len(tokenizer["tokens"]) != cfg.vocab_size:
        raise WeightsError(f"{cfg.source}: tokenizer has {len(tokenizer['tokens'])} tokens but the embedding "
                           f"'model.embed_tokens.weight' has {cfg.vocab_size} rows")


def _interval(layer_types) -> int:
    """full_attention_interval when the layers follow one (else 4, llama.cpp's default; recurrent_layers rules)."""
    for n in range(1, len(layer_types) + 1):
        if all((t != "linear_attention") == ((i + 1) % n == 0) for i, t in enumerate(layer_types)):
            return n
    return 4


def write_gguf(path: str | Path, model, qtype: str = "F32", tokenizer: dict | None = None,
               name: str | None = None) -> Path:
    """Write a model (config + weights) as a llama.cpp GGUF of file type `qtype` (F32, F16, BF16, Q8_0, Q4_0),
    atomically: a temporary file beside `path`, renamed into place only when complete.
    tokenizer: `tokenizer_metadata()` of a GGUF (plain data) to embed; without it the file has no vocabulary."""
    import gguf
    path = output_file(path, "GGUF file")
    qtype = qtype.upper()
    if qtype not in WRITE_TYPES:
        raise ConfigError(f"{path}: unsupported GGUF type {qtype!r}; supported: {', '.join(WRITE_TYPES)}")
    cfg = model.config
    if cfg.model_type not in MODEL_TYPE_TO_ARCH:
        raise ConfigError(f"{path}: model_type {cfg.model_type!r} has no GGUF architecture")
    _check_tokenizer(cfg, tokenizer)
    tensors = hf_to_gguf_tensors(cfg, model.weights)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    wr = gguf.GGUFWriter(tmp, MODEL_TYPE_TO_ARCH[cfg.model_type])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_metadata(wr, cfg, name or path.stem, qtype, tokenizer)
        for tname, a in tensors.items():
            data, ggml_type = encode_tensor(tname, a, qtype)
            wr.add_tensor(tname, data, raw_dtype=ggml_type)
        wr.write_header_to_file()
        wr.write_kv_data_to_file()
        wr.write_tensors_to_file()
        wr.close()
        os.replace(tmp, path)
    except BaseException as e:
        wr.close()
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise FormatError(f"{path}: cannot write ({e.strerror or e})") from None
        raise
    try:   # the file as llama.cpp's semantics read it
        back = config_from_dict(config_dict(GGUFFile(path)), str(path), "llama.cpp")
    except (ConfigError, WeightsError) as e:   # written as asked, but not a model file refimpl reads back
        _log.warning(f"{path}: written, but it does not read back as a model: {e}")
    else:
        if (note := conversion_note(cfg, back)) is not None:
            _log.warning(note)
    return path


# ---------------------------------------------------------------------------------------------------- tokenizer

def tokenizer_metadata(source) -> dict:
    """The GGUF's embedded tokenizer as plain Python data: model ("gpt2" = byte-level BPE), pre (pre-tokenizer
    name, e.g. "qwen2", "qwen35"), tokens (list[str]), token_types (list[int]: 1 normal, 2 unknown, 3 control,
    4 user-defined, 5 unused, 6 byte), merges (list[str], "a b"), bos/eos/pad/unk token ids (or None),
    add_bos_token / add_eos_token (or None) and chat_template (or None)."""
    g = source if isinstance(source, GGUFFile) else GGUFFile(source)
    m = g.metadata
    if "tokenizer.ggml.model" not in m:
        raise ConfigError(f"{g.path}: no tokenizer (metadata 'tokenizer.ggml.model' is missing)")

    def get(key, kind):
        return typed(g, f"tokenizer.{key}", kind) if f"tokenizer.{key}" in m else None

    def strings(key):
        v = m.get(f"tokenizer.ggml.{key}")
        if v is None:
            return []
        if not isinstance(v, StringArray):
            raise ConfigError(f"{g.path}: metadata 'tokenizer.ggml.{key}': expected an array of strings, got "
                              f"{brief(v)}")
        return list(v)
    return {
        "model": get("ggml.model", "str"), "pre": get("ggml.pre", "str"), "tokens": strings("tokens"),
        "token_types": get("ggml.token_type", "ints") or [], "merges": strings("merges"),
        **{f"{key}_token_id": _token_id(g, which) for key, which in (("bos", "bos"), ("eos", "eos"),
                                                                      ("pad", "padding"), ("unk", "unknown"))},
        "add_bos_token": get("ggml.add_bos_token", "bool"), "add_eos_token": get("ggml.add_eos_token", "bool"),
        "chat_template": get("chat_template", "str"),
    }
