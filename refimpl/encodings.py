"""AIMET / QNN encodings files: the scales and offsets of a quantised device, for its weights and activations.

Both schemas aimet-torch writes are read:

    legacy (0.6.1; QuantizationSimModel.save_encodings_to_json)
        {"activation_encodings": {module: {"input": {i: enc}, "output": {i: enc}}},
         "param_encodings": {tensor: [enc, ...]}}
        enc = {"bitwidth", "dtype": "int" | "float", "is_symmetric", "scale", "offset", "min", "max"}, or a list of
        them, one per channel
    1.0.0 (QuantizationSimModel.export)
        {"version": "1.0.0", "activation_encodings": [{"name", "dtype", "enc_type", "bw", "is_sym", "scale": [...],
         "offset": [...]}], "param_encodings": [{... "block_size", "per_block_int_scale", "compressed_bw"}]}

An integer encoding is QNN's: x = (q + offset) * scale with offset <= 0 (the negative zero point) over unsigned
codes q in [0, 2^bw - 1]; a symmetric entry whose offsets are all 0 means signed codes, q in [-2^(bw-1),
2^(bw-1) - 1] (AIMET writes its signed symmetric grids as offset -2^(bw-1) over unsigned codes, which is the same
grid). A float entry (dtype float, bw 16) is a cast to float16 there (bfloat16 when it says exponent_bits 8);
bw 32 leaves the tensor alone. Quantise-dequantise is AIMET QuantSim's own arithmetic (kernels/quant.py,
docs/numerics.md).

Where activation encodings apply in the model (which tap a module name is, and its inputs) is declared beside
the model code (refimpl/models/quantisers.py reads those declarations).
"""

import dataclasses
import json
from pathlib import Path

import ml_dtypes
import numpy as np

from .errors import FormatError, InputError
from .kernels import quant


@dataclasses.dataclass
class Encoding:
    """One tensor's encoding. Integer: x = (q + offset) * scale, q in [qmin, qmax].
    scale / offset: scalars (per tensor), [channels] (per channel: weights' output rows, activations' last
    axis), or with block_size: [out * blocks] or [out, blocks] scales (blocks of block_size along a weight's
    input axis; offsets per block or per channel). LPBQ entries are expanded to per-block float scales on reading.
    float_dtype: a float encoding (a cast to that dtype; scale and offset unused)."""
    bitwidth: int
    scale: np.ndarray
    offset: np.ndarray
    block_size: int | None = None
    signed: bool = False
    float_dtype: object = None

    @property
    def qrange(self) -> tuple[int, int]:
        """(qmin, qmax) of the integer codes."""
        if self.signed:
            return -2 ** (self.bitwidth - 1), 2 ** (self.bitwidth - 1) - 1
        return 0, 2 ** self.bitwidth - 1

    def describe(self) -> dict:
        """The encoding as a manifest records it (float scales as float32 values, exactly); from_record reads it."""
        if self.float_dtype is not None:
            return {"dtype": np.dtype(self.float_dtype).name, "bitwidth": self.bitwidth}
        return {"dtype": "int", "bitwidth": self.bitwidth, "signed": self.signed,
                "scale": np.asarray(self.scale, np.float32).tolist(), "offset": np.asarray(self.offset).tolist()}

    @classmethod
    def from_record(cls, r: dict) -> "Encoding":
        if r["dtype"] != "int":
            return cls(int(r["bitwidth"]), np.float32(1), np.int32(0), float_dtype=_FLOATS[r["dtype"]])
        return cls(int(r["bitwidth"]), np.array(r["scale"], np.float32), np.array(r["offset"], np.int32),
                   signed=bool(r["signed"]))

    @property
    def code_dtype(self) -> np.dtype:
        """The integer dtype a device stores the codes in (4-bit codes one per byte)."""
        bits = 8 if self.bitwidth <= 8 else 16 if self.bitwidth <= 16 else 32
        return np.dtype(f"{'int' if self.signed else 'uint'}{bits}")

    def rows(self, index, shape: tuple) -> "Encoding":
        """The encoding of part `index` of the leading axis of a weight of `shape` (an expert of a fused tensor,
        rows of lm_head): per-channel and per-block scales / offsets restricted to that part's rows."""
        def part(a):
            return np.asarray(a).reshape(shape[0], -1)[index].reshape(-1)
        if not np.ndim(self.scale):
            return self
        return dataclasses.replace(self, scale=part(self.scale),
                                   offset=part(self.offset) if np.ndim(self.offset) else self.offset)

    def fake_quant(self, w: np.ndarray) -> np.ndarray:
        """A weight w [out, ...] -> (q + offset) * scale as QuantSim computes it: the device's values."""
        if self.float_dtype is not None:
            return quant.float_fake_cast(w, self.float_dtype)
        x = w.reshape(-1, w.shape[-1]) if w.ndim > 1 else w   # channels = every output row (fused experts too)
        scale, offset, kw = self.scale, self.offset, {}
        if scale.ndim and self.block_size is None:
            kw = {"axis": 0}
        elif scale.ndim:
            kw = {"axis": 1, "block_size": self.block_size}
            blocks = -(-x.shape[1] // self.block_size)
            if scale.size != x.shape[0] * blocks:
                raise InputError(f"block encodings: {scale.size} scales for {x.shape[0]} channels x {blocks} "
                                 f"blocks of {self.block_size}")
            scale = scale.reshape(x.shape[0], blocks)
            offset = np.broadcast_to(offset.reshape(-1, 1) if offset.size == x.shape[0] else offset.reshape(
                x.shape[0], blocks), scale.shape)
        return quant.quantsim_fake_quant(x, scale, offset, *self.qrange, **kw).reshape(w.shape).astype(w.dtype)

    def codes(self, x: np.ndarray) -> np.ndarray:
        """An activation's integer codes (int32, x's shape); per-channel encodings run along the last axis."""
        axis = -1 if np.ndim(self.scale) else None
        if axis is not None and np.size(self.scale) != x.shape[-1]:
            raise InputError(f"per-channel activation encoding of {np.size(self.scale)} channels applied to a "
                             f"tensor of shape {list(x.shape)} (channels on the last axis)")
        return quant.quantsim_quantize(x, self.scale, self.offset, *self.qrange, axis=axis)

    def apply(self, x: np.ndarray) -> np.ndarray:
        """An activation x -> its quantise-dequantised value, in x's dtype."""
        if self.float_dtype is not None:
            return quant.float_fake_cast(x, self.float_dtype)
        axis = -1 if np.ndim(self.scale) else None
        return quant.qnn_dequantize(self.codes(x), self.scale, self.offset, axis=axis).astype(x.dtype, copy=False)

    def dequantize(self, q: np.ndarray) -> np.ndarray:
        """Integer codes (a device's integer dump) -> float32 values."""
        return quant.qnn_dequantize(q, self.scale, self.offset, axis=-1 if np.ndim(self.scale) else None)


_FLOATS = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


@dataclasses.dataclass(frozen=True)
class ActivationEntry:
    """One activation encoding of a file: `name` as written, and where: legacy files say which input / output of
    the module (io "input" | "output", index); a 1.0.0 entry names a tensor (io None, index 0)."""
    name: str
    io: str | None
    index: int
    encoding: Encoding

    @property
    def label(self) -> str:
        return self.name if self.io is None else f"{self.name} {self.io} {self.index}"


def _doc(path) -> dict:
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise FormatError(f"{path}: not an encodings JSON ({e})") from None
    if not isinstance(doc, dict) or ("param_encodings" not in doc and "activation_encodings" not in doc):
        raise FormatError(f"{path}: not an encodings JSON with param_encodings / activation_encodings")
    return doc


def _float_dtype(e: dict, bw: int):
    """The dtype of a float encoding: bw 16 -> float16 (bfloat16 with exponent_bits 8), 32 -> float32."""
    if bw == 32:
        return np.float32
    if bw == 16:
        return ml_dtypes.bfloat16 if int(e.get("exponent_bits", e.get("exp_bits", 5))) == 8 else np.float16
    raise ValueError(f"float encoding of bitwidth {bw}: only 16 and 32 exist in these formats")


def _legacy(encs) -> Encoding:
    """One legacy encoding (a dict, or a list of per-channel dicts) -> Encoding."""
    encs = encs if isinstance(encs, list) else [encs]
    first = encs[0]
    if "zero_point_shift" in first:
        raise ValueError("zero_point_shift encodings are not supported")
    bw = int(first["bitwidth"])
    if str(first.get("dtype", "int")).lower() == "float":
        return Encoding(bw, np.float32(1), np.int32(0), float_dtype=_float_dtype(first, bw))
    scale = np.array([e["scale"] for e in encs], np.float32)
    offset = np.array([e["offset"] for e in encs], np.int32)
    if len(encs) == 1:
        scale, offset = scale[0], offset[0]
    sym = str(first.get("is_symmetric", "False")).lower() == "true"
    return Encoding(bw, scale, offset, signed=sym and not offset.any())


def _v1(e: dict) -> Encoding:
    """One 1.0.0 encoding -> Encoding (LPBQ expanded to per-block float scales)."""
    if "zero_point_shift" in e:
        raise ValueError("zero_point_shift encodings are not supported")
    bw = int(e["bw"])
    if str(e.get("dtype", "INT")).lower() == "float":
        return Encoding(bw, np.float32(1), np.int32(0), float_dtype=_float_dtype(e, bw))
    kind = e.get("enc_type", "PER_TENSOR")
    scale = np.array(e["scale"], np.float32)
    offset = np.array(e["offset"], np.int32)
    block = e.get("block_size")
    if kind == "PER_TENSOR":
        scale, offset, block = scale.reshape(()), offset.reshape(()), None
    elif kind == "PER_CHANNEL":
        block = None
    elif kind == "PER_BLOCK":
        block = int(block)  # flat [out * blocks]; shaped [out, blocks] when applied
    elif kind == "LPBQ":
        ints = np.array(e["per_block_int_scale"], np.float32).reshape(len(scale), -1)
        scale, block = scale[:, None] * ints, int(block)
        offset = np.broadcast_to(offset.reshape(-1, 1), scale.shape)
    else:
        raise ValueError(f"unknown enc_type {kind!r}")
    signed = bool(e.get("is_sym")) and not offset.any()
    if kind == "LPBQ" and "compressed_bw" in e:
        # AIMET writes bw as the expanded width (8) with offset -2^(bw-1); the codes are the compressed width's
        # signed range: q in [-2^(cbw-1), 2^(cbw-1) - 1], no offset
        bw, signed, offset = int(e["compressed_bw"]), True, np.zeros_like(offset)
    return Encoding(bw, scale, offset, block, signed)


def _check_offsets(path, name: str, enc: Encoding) -> None:
    if enc.float_dtype is None and np.any(enc.offset > 0):
        raise FormatError(f"{path}: {name}: offset {int(np.max(enc.offset))} > 0; QNN offsets are <= 0 (the "
                          f"negative zero point) — was a zero point given?")


def read_encodings(path) -> dict[str, Encoding]:
    """param_encodings -> {tensor name (refimpl's weight name): Encoding}.

    Legacy: one entry per tensor, or one per output channel. 1.0.0: enc_type PER_TENSOR | PER_CHANNEL |
    PER_BLOCK | LPBQ; for LPBQ the float scale is per channel and the integer block scales [out * blocks]
    multiply it (QNN blockwise expansion). A float entry of bw 16 rounds the weight to float16 (as QuantSim's float
    quantiser does); bw 32 leaves it alone.
    """
    params = _doc(path).get("param_encodings", {})
    out = {}
    try:
        items = params.items() if isinstance(params, dict) else ((e["name"], e) for e in params)
        for name, e in items:
            enc = _legacy(e) if isinstance(params, dict) else _v1(e)
            if enc.float_dtype is np.float32:
                continue                                  # kept in float32: nothing to do
            out[model_name(name)] = enc
    except (KeyError, TypeError, ValueError) as err:
        raise FormatError(f"{path}: malformed param encoding ({type(err).__name__}: {err})") from None
    for name, enc in out.items():
        _check_offsets(path, name, enc)
    return out


def read_activation_encodings(path) -> list[ActivationEntry]:
    """activation_encodings -> entries in file order (an empty list when the file has none)."""
    acts = _doc(path).get("activation_encodings", {})
    out = []
    try:
        if isinstance(acts, dict):
            for module, ios in acts.items():
                for io, entries in ios.items():
                    if io not in ("input", "output"):
                        raise ValueError(f"{module}: {io!r} is neither 'input' nor 'output'")
                    for i, e in entries.items():
                        out.append(ActivationEntry(module, io, int(i), _legacy(e)))
        else:
            out = [ActivationEntry(e["name"], None, 0, _v1(e)) for e in acts]
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise FormatError(f"{path}: malformed activation encoding ({type(err).__name__}: {err})") from None
    for entry in out:
        _check_offsets(path, entry.label, entry.encoding)
        if entry.encoding.block_size is not None:
            raise FormatError(f"{path}: {entry.label}: a per-block activation encoding (refimpl quantises activations "
                              f"per tensor or per channel)")
    return out


def model_name(name: str) -> str:
    """Checkpoint name -> the name refimpl's Weights use (the multimodal prefix dropped, as Weights does)."""
    return "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name
