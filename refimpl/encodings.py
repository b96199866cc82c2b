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
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np

from .errors import FormatError, InputError, brief
from .files import expect, integer, load_json, number, read_exact, regular_file
from .kernels import quant


@dataclasses.dataclass
class Encoding:
    """One tensor's encoding. Integer: x = (q + offset) * scale, q in [qmin, qmax].
    scale / offset: scalars (per tensor), [channels] (per channel: weights' output rows, activations' last
    axis), or with block_size: [out * blocks] or [out, blocks] scales (blocks of block_size along a weight's
    input axis; offsets per block or per channel). LPBQ entries are expanded to per-block float scales on reading.
    float_dtype: a float encoding (a cast to that dtype; scale and offset unused).
    axis: None for refimpl's conventions above; an encoding read from an ONNX graph (read_onnx_encodings, read_qdq)
    applies to that graph's tensor as it is there: per channel along `axis` (scale [x.shape[axis]]), per block along
    `axis` with scale / offset of x's rank (ONNX's blocked QuantizeLinear: x.shape with axis ceil(n / block_size)).
    on_rows() turns a MatMul weight's encoding into refimpl's (rows of the [out, in] weight).
    arithmetic: whose rounding the codes follow (kernels/quant.py): "aimet-torch" (QuantSim of aimet-torch),
    "aimet-onnx" (aimet-onnx's QuantSim: ties away from zero) or "onnx" (QuantizeLinear: ties to even).
    stored: () -> a weight's integer codes as the device graph stores them (a QDQ model's DequantizeLinear of an
    integer initializer, read when the weight is), or None. fake_quant then returns those codes dequantised, not
    the checkpoint's weight quantised again: the device graph's own weight, whoever rounded it (aimet-onnx's
    to_onnx_qdq rounds half to even after adding the zero point, not before as QuantizeLinear: 16-bit asymmetric
    tables one code apart at ties). Laid out as the tensor `axis` refers to; stored_transposed: that tensor is the
    weight's transpose (ONNX MatMul's B, [in, out]), which on_rows undoes."""
    bitwidth: int
    scale: np.ndarray
    offset: np.ndarray
    block_size: int | None = None
    signed: bool = False
    float_dtype: object = None
    axis: int | None = None
    arithmetic: str = "aimet-torch"
    stored: Callable[[], np.ndarray] | None = None
    stored_transposed: bool = False

    @property
    def scale_zero(self) -> tuple:
        """(scale, zero point): the pair a device kernel takes (kernels/htp_quantised.py); the zero point is -offset."""
        return self.scale, -np.asarray(self.offset)

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
        extra = {} if self.arithmetic == "aimet-torch" else {"arithmetic": self.arithmetic}
        if self.stored is not None:
            extra["codes"] = "stored"      # the device graph's own integer weight, not the checkpoint's re-quantised
        if self.axis is not None:
            extra.update(axis=self.axis, block_size=self.block_size)
        return {"dtype": "int", "bitwidth": self.bitwidth, "signed": self.signed,
                "scale": np.asarray(self.scale, np.float32).tolist(), "offset": np.asarray(self.offset).tolist(),
                **extra}

    @classmethod
    def from_record(cls, r: dict) -> "Encoding":
        if r["dtype"] != "int":
            return cls(int(r["bitwidth"]), np.float32(1), np.int32(0), float_dtype=_FLOATS[r["dtype"]])
        return cls(int(r["bitwidth"]), np.array(r["scale"], np.float32), np.array(r["offset"], np.int32),
                   signed=bool(r["signed"]), axis=r.get("axis"), block_size=r.get("block_size"),
                   arithmetic=r.get("arithmetic", "aimet-torch"))

    def on_rows(self, rank: int = 2) -> "Encoding":
        """An ONNX graph's weight encoding (axis set) in refimpl's convention for the same weight as refimpl holds
        it, [out, in] (ONNX MatMul's [in, out] transposed; Gemm transB / Conv weights already [out, in]): per-channel
        scales [out], block scales [out * blocks] (out-major), axis None. Per-tensor and axis-less encodings as
        they are. Stored codes (ONNX MatMul's [in, out]) transposed to [out, in] likewise."""
        if self.stored is not None and self.stored_transposed:
            return dataclasses.replace(self, stored=lambda f=self.stored: np.swapaxes(f(), -1, -2),
                                       stored_transposed=False).on_rows(rank)
        if self.axis is None or not np.ndim(self.scale):
            return dataclasses.replace(self, axis=None)
        axis = self.axis % rank
        if self.block_size is None:     # per channel: the channel axis is the output axis
            return dataclasses.replace(self, axis=None)
        if rank != 2:
            raise InputError(f"a per-block encoding of a rank-{rank} tensor has no [out, in] form")
        # blocks run along the input axis `axis`; the other axis holds the output channels
        def rows(a):
            a = np.asarray(a)
            if not a.ndim:
                return a
            return (a.T if axis == 0 else a).reshape(-1)          # [out, blocks], flattened out-major
        return dataclasses.replace(self, scale=rows(self.scale), offset=rows(self.offset), axis=None)

    @property
    def code_dtype(self) -> np.dtype:
        """The integer dtype a device stores the codes in (4-bit codes one per byte)."""
        bits = 8 if self.bitwidth <= 8 else 16 if self.bitwidth <= 16 else 32
        return np.dtype(f"{'int' if self.signed else 'uint'}{bits}")

    def rows(self, index, shape: tuple) -> "Encoding":
        """The encoding of part `index` of the leading axis of a weight of `shape` (an expert of a fused tensor,
        rows of lm_head): per-channel and per-block scales / offsets, and stored codes, restricted to that part's
        rows."""
        def part(a):
            return np.asarray(a).reshape(shape[0], -1)[index].reshape(-1)
        if (self.axis is not None and np.ndim(self.scale)) or self.stored_transposed:
            raise InputError(f"rows() of an encoding laid out on an ONNX tensor (axis {self.axis}): take on_rows() "
                             f"first")
        stored = None if self.stored is None else lambda f=self.stored: part(f())
        if not np.ndim(self.scale):
            return dataclasses.replace(self, stored=stored)
        return dataclasses.replace(self, scale=part(self.scale), stored=stored,
                                   offset=part(self.offset) if np.ndim(self.offset) else self.offset)

    def fake_quant(self, w: np.ndarray) -> np.ndarray:
        """A weight w [out, ...] -> (q + offset) * scale as QuantSim computes it: the device's values (an ONNX
        graph's encoding, axis set: w as that graph holds it). With stored codes: those codes dequantised, after
        checking they are w's (each within one code of w quantised by this encoding: the device graph's weight of
        this checkpoint, in w's layout)."""
        if self.float_dtype is not None:
            return quant.float_fake_cast(w, self.float_dtype)
        if self.axis is not None:
            if self.stored is not None:
                return self.dequantize(self._stored_as(self.codes(np.asarray(w, np.float32)))).astype(w.dtype)
            return self.apply(np.asarray(w, np.float32)).astype(w.dtype)
        x = w.reshape(-1, w.shape[-1]) if w.ndim > 1 else w   # channels = every output row (fused experts too)
        scale, offset, kw = self.scale, self.offset, {}
        if scale.ndim and self.block_size is None:
            if scale.size != x.shape[0]:
                raise InputError(f"per-channel encodings: {scale.size} scales for {x.shape[0]} channels")
            kw = {"axis": 0}
        elif scale.ndim:
            kw = {"axis": 1, "block_size": self.block_size}
            blocks = -(-x.shape[1] // self.block_size)
            if scale.size != x.shape[0] * blocks:
                raise InputError(f"block encodings: {scale.size} scales for {x.shape[0]} channels x {blocks} "
                                 f"blocks of {self.block_size}")
            scale = scale.reshape(x.shape[0], blocks)
            if offset.size not in (1, x.shape[0], scale.size):
                raise InputError(f"block encodings: {offset.size} offsets for {x.shape[0]} channels x {blocks} blocks")
            offset = np.broadcast_to(offset.reshape(-1, 1) if offset.size in (1, x.shape[0]) else offset.reshape(
                x.shape[0], blocks), scale.shape)
        q = quant.ARITHMETICS[self.arithmetic](x, scale, offset, *self.qrange, **kw)   # = quantsim_fake_quant
        if self.stored is not None:
            q = self._stored_as(q)
        return quant.qnn_dequantize(q, scale, offset, **kw).reshape(w.shape).astype(w.dtype)

    def _stored_as(self, q: np.ndarray) -> np.ndarray:
        """The stored codes in the layout of q (the checkpoint's weight quantised by this encoding), checked to be
        its codes: each within one code of q (another rounding of the same weight), else InputError."""
        stored = np.asarray(self.stored())
        if stored.size != q.size:
            raise InputError(f"the device graph stores {stored.size} integer codes for a weight of "
                             f"{q.size} elements {list(q.shape)}")
        stored = stored.reshape(q.shape).astype(np.int64)
        step = np.abs(stored - q)
        if step.size and step.max() > 1:
            at = np.unravel_index(int(np.argmax(step)), q.shape)
            raise InputError(f"the device graph stores another integer weight than this checkpoint's: "
                             f"{int(step.max())} codes from it at {list(map(int, at))} ({int((step > 1).sum())} of "
                             f"{step.size} codes more than one apart)")
        return stored

    def _where(self, x: np.ndarray) -> tuple:
        """(axis, block_size) of this encoding on x, checked: an ONNX graph's axis, else the last axis."""
        if not np.ndim(self.scale):
            return None, None
        if self.axis is None:
            return -1, None
        if not -x.ndim <= self.axis < x.ndim:
            raise InputError(f"an encoding along axis {self.axis} applied to a tensor of shape {list(x.shape)}")
        return self.axis, self.block_size

    def codes(self, x: np.ndarray) -> np.ndarray:
        """An activation's integer codes (int32, x's shape); per-channel encodings run along the last axis (an ONNX
        graph's: along its axis), in this encoding's arithmetic."""
        if self.axis is not None or self.arithmetic != "aimet-torch":
            axis, block = self._where(x)
            return quant.ARITHMETICS[self.arithmetic](x, self.scale, self.offset, *self.qrange, axis=axis,
                                                      block_size=block)
        axis = -1 if np.ndim(self.scale) else None
        if axis is not None and np.size(self.scale) != x.shape[-1]:
            raise InputError(f"per-channel activation encoding of {np.size(self.scale)} channels applied to a "
                             f"tensor of shape {list(x.shape)} (channels on the last axis)")
        return quant.quantsim_quantize(x, self.scale, self.offset, *self.qrange, axis=axis)

    def apply(self, x: np.ndarray) -> np.ndarray:
        """An activation x -> its quantise-dequantised value, in x's dtype."""
        if self.float_dtype is not None:
            return quant.float_fake_cast(x, self.float_dtype)
        return self.dequantize(self.codes(x)).astype(x.dtype, copy=False)

    def dequantize(self, q: np.ndarray) -> np.ndarray:
        """Integer codes (a device's integer dump) -> float32 values: (q + offset) * scale, one float32 product."""
        axis, block = self._where(np.asarray(q))
        return quant.qnn_dequantize(q, self.scale, self.offset, axis=axis, block_size=block)


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


MAX_BITWIDTH = 32


def _doc(path) -> dict:
    path = Path(path)
    doc = load_json(path, "encodings")
    if not isinstance(doc, dict) or ("param_encodings" not in doc and "activation_encodings" not in doc):
        raise FormatError(f"{path}: not an encodings JSON with param_encodings / activation_encodings")
    return doc


def _float_dtype(e: dict, bw: int, where: str):
    """The dtype of a float encoding: bw 16 -> float16 (bfloat16 with exponent_bits 8), 32 -> float32."""
    if bw == 32:
        return np.float32
    if bw == 16:
        exponent = e.get("exponent_bits", e.get("exp_bits", 5))
        return ml_dtypes.bfloat16 if integer(exponent, f"{where}: exponent_bits", lo=1, hi=15) == 8 else np.float16
    raise FormatError(f"{where}: float encoding of bitwidth {bw}: only 16 and 32 exist in these formats")


def _scales(values, where: str) -> np.ndarray:
    """Scales: finite positive numbers, as float32 (QNN's and AIMET's scale dtype)."""
    for v in values:
        if not (number(v, f"{where}: scale") > 0) or not np.isfinite(np.float32(v)) or np.float32(v) == 0:
            raise FormatError(f"{where}: scale {brief(v)} is not a positive float32 number")
    return np.array(values, np.float32)


def _offsets(values, bw: int, where: str) -> np.ndarray:
    """Offsets: whole numbers in [-2^bw, 0] (QNN's negative zero point; > 0 is explained by _check_offsets)."""
    for v in values:
        number(v, f"{where}: offset")
        if v != int(v) or not -2 ** bw <= v <= 2 ** bw:
            raise FormatError(f"{where}: offset {brief(v)} is not a whole number within +-2^{bw}")
    return np.array([int(v) for v in values], np.int64).astype(np.int32)


def _symmetric(value, where: str) -> bool:
    """AIMET writes is_symmetric as the strings "True" / "False" (legacy) or a bool (1.0.0)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise FormatError(f"{where}: is_symmetric {brief(value)} is not true / false")


def _legacy(encs, where: str) -> Encoding:
    """One legacy encoding (a dict, or a non-empty list of per-channel dicts) -> Encoding."""
    encs = encs if isinstance(encs, list) else [encs]
    if not encs:
        raise FormatError(f"{where}: an empty list of encodings")
    for e in encs:
        expect(e, dict, where, what="an encoding object")
    first = encs[0]
    if "zero_point_shift" in first:
        raise FormatError(f"{where}: zero_point_shift encodings are not supported")
    bw = integer(first.get("bitwidth"), f"{where}: bitwidth", lo=1, hi=MAX_BITWIDTH)
    if any(e.get("bitwidth") != bw for e in encs):
        raise FormatError(f"{where}: per-channel entries of different bitwidths")
    kind = expect(first.get("dtype", "int"), str, f"{where}: dtype").lower()
    if kind == "float":
        return Encoding(bw, np.float32(1), np.int32(0), float_dtype=_float_dtype(first, bw, where))
    if kind != "int":
        raise FormatError(f"{where}: dtype {brief(first.get('dtype'))} is not int or float")
    scale = _scales([e.get("scale") for e in encs], where)
    offset = _offsets([e.get("offset") for e in encs], bw, where)
    if len(encs) == 1:
        scale, offset = scale[0], offset[0]
    sym = _symmetric(first.get("is_symmetric", "False"), where)
    return Encoding(bw, scale, offset, signed=sym and not offset.any())


def _v1_common(e, where: str, arithmetic: str):
    """The fields every 1.0.0 entry shares -> (bw, a float Encoding or None, enc_type, scale, offset)."""
    if "zero_point_shift" in e:
        raise FormatError(f"{where}: zero_point_shift encodings are not supported")
    bw = integer(e.get("bw"), f"{where}: bw", lo=1, hi=MAX_BITWIDTH)
    kind = expect(e.get("dtype", "INT"), str, f"{where}: dtype").lower()
    if kind == "float":
        return bw, Encoding(bw, np.float32(1), np.int32(0), float_dtype=_float_dtype(e, bw, where),
                            arithmetic=arithmetic), None, None, None
    if kind != "int":
        raise FormatError(f"{where}: dtype {brief(e.get('dtype'))} is not INT or FLOAT")
    enc_type = e.get("enc_type", "PER_TENSOR")
    scale = _scales(expect(e.get("scale"), list, f"{where}: scale"), where)
    offset = _offsets(expect(e.get("offset"), list, f"{where}: offset"), bw, where)
    if not scale.size or offset.size not in (1, scale.size):
        raise FormatError(f"{where}: {scale.size} scales and {offset.size} offsets (expected one offset, or one "
                          f"per scale)")
    return bw, None, enc_type, scale, offset


def _v1(e, where: str) -> Encoding:
    """One 1.0.0 encoding -> Encoding (LPBQ expanded to per-block float scales)."""
    expect(e, dict, where, what="an encoding object")
    bw, floating, enc_type, scale, offset = _v1_common(e, where, "aimet-torch")
    if floating is not None:
        return floating
    block = None
    if enc_type == "PER_TENSOR":
        if scale.size != 1:
            raise FormatError(f"{where}: PER_TENSOR with {scale.size} scales")
        scale, offset = scale.reshape(()), offset.reshape(())
    elif enc_type == "PER_CHANNEL":
        offset = np.broadcast_to(offset, scale.shape)
    elif enc_type in ("PER_BLOCK", "LPBQ"):
        block = integer(e.get("block_size"), f"{where}: block_size", lo=1)
        if enc_type == "PER_BLOCK":
            offset = np.broadcast_to(offset, scale.shape)   # flat [out * blocks]; shaped [out, blocks] when applied
        else:
            ints = expect(e.get("per_block_int_scale"), list, f"{where}: per_block_int_scale")
            for v in ints:
                integer(v, f"{where}: per_block_int_scale", lo=1, hi=2 ** MAX_BITWIDTH)
            if not ints or len(ints) % scale.size:
                raise FormatError(f"{where}: {len(ints)} per_block_int_scale entries for {scale.size} channels")
            scale = scale[:, None] * np.array(ints, np.float32).reshape(scale.size, -1)
            offset = np.broadcast_to(np.broadcast_to(offset, (scale.shape[0],))[:, None], scale.shape)
    else:
        raise FormatError(f"{where}: unknown enc_type {brief(enc_type)} (PER_TENSOR, PER_CHANNEL, PER_BLOCK, LPBQ)")
    signed = _symmetric(e.get("is_sym", False), where) and not offset.any()
    if enc_type == "LPBQ" and "compressed_bw" in e:
        # AIMET writes bw as the expanded width (8) with offset -2^(bw-1); the codes are the compressed width's
        # signed range: q in [-2^(cbw-1), 2^(cbw-1) - 1], no offset
        bw, signed = integer(e["compressed_bw"], f"{where}: compressed_bw", lo=1, hi=bw), True
        offset = np.zeros_like(offset)
    return Encoding(bw, scale, offset, block, signed)


def _check_offsets(path, name: str, enc: Encoding) -> None:
    if enc.float_dtype is None and np.any(enc.offset > 0):
        raise FormatError(f"{path}: {name}: offset {int(np.max(enc.offset))} > 0; QNN offsets are <= 0 (the "
                          f"negative zero point) — was a zero point given?")


def _name(value, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise FormatError(f"{where}: name {brief(value)} is not a tensor / module name")
    return value


def read_encodings(path) -> dict[str, Encoding]:
    """param_encodings -> {tensor name (refimpl's weight name): Encoding}.

    Legacy: one entry per tensor, or one per output channel. 1.0.0: enc_type PER_TENSOR | PER_CHANNEL |
    PER_BLOCK | LPBQ; for LPBQ the float scale is per channel and the integer block scales [out * blocks]
    multiply it (QNN blockwise expansion). A float entry of bw 16 rounds the weight to float16 (as QuantSim's float
    quantiser does); bw 32 leaves it alone.
    """
    params = _doc(path).get("param_encodings", {})
    where = f"{path}: param_encodings"
    out = {}
    if isinstance(params, dict):
        items = [(_name(name, where), e, f"{where}: {brief(name)}") for name, e in params.items()]
        parse = _legacy
    else:
        expect(params, list, where, what="an object (legacy schema) or a list (1.0.0)")
        items = [(_name(expect(e, dict, f"{where}[{i}]").get("name"), f"{where}[{i}]"), e,
                  f"{where}[{i}] {brief(e.get('name'))}") for i, e in enumerate(params)]
        parse = _v1
    for name, e, at in items:
        enc = parse(e, at)
        if enc.float_dtype is np.float32:
            continue                                  # kept in float32: nothing to do
        out[model_name(name)] = enc
    for name, enc in out.items():
        _check_offsets(path, name, enc)
    return out


def read_activation_encodings(path) -> list[ActivationEntry]:
    """activation_encodings -> entries in file order (an empty list when the file has none)."""
    acts = _doc(path).get("activation_encodings", {})
    where = f"{path}: activation_encodings"
    out = []
    if isinstance(acts, dict):
        for module, ios in acts.items():
            at = f"{where}: {brief(_name(module, where))}"
            for io, entries in expect(ios, dict, at).items():
                if io not in ("input", "output"):
                    raise FormatError(f"{at}: {brief(io)} is neither 'input' nor 'output'")
                for i, e in expect(entries, dict, f"{at}.{io}").items():
                    if not (isinstance(i, str) and i.isdigit() and len(i) <= 3):
                        raise FormatError(f"{at}.{io}: index {brief(i)} is not a small whole number")
                    out.append(ActivationEntry(module, io, int(i), _legacy(e, f"{at} {io} {i}")))
    else:
        expect(acts, list, where, what="an object (legacy schema) or a list (1.0.0)")
        for i, e in enumerate(acts):
            name = _name(expect(e, dict, f"{where}[{i}]").get("name"), f"{where}[{i}]")
            out.append(ActivationEntry(name, None, 0, _v1(e, f"{where}[{i}] {brief(name)}")))
    for entry in out:
        _check_offsets(path, entry.label, entry.encoding)
        if entry.encoding.block_size is not None:
            raise FormatError(f"{path}: {entry.label}: a per-block activation encoding (refimpl quantises activations "
                              f"per tensor or per channel)")
    return out


def model_name(name: str) -> str:
    """Checkpoint name -> the name refimpl's Weights use (the multimodal prefix dropped, as Weights does)."""
    return "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name


# ---------------------------------------------------------------------------------------------- aimet-onnx encodings

def read_onnx_encodings(path, model=None) -> dict[str, Encoding]:
    """aimet-onnx's encodings (1.0.0 schema, `QuantizationSimModel.export`) -> {ONNX tensor name as written:
    Encoding}: its activation AND param entries (a name in both, or twice, is refused), in aimet-onnx's own
    arithmetic (kernels/quant.aimet_onnx_quantize). Float entries of 16 bits are casts (float16, or bfloat16 with
    exponent_bits 8); 32-bit float entries are left out (the tensor stays float).

    Per-channel and per-block entries apply along the axes aimet-onnx chose for the weight (its
    `_get_quantization_axes`: MatMul [in, out] channels on the last axis and blocks on the one before; Gemm by transB;
    Conv [out, in, ...] channels 0, blocks 1; ConvTranspose channels 1, blocks 0), which the file does not record:
    they are read from `model`, the ONNX file exported beside it (default: the file's sibling <stem>.onnx, as
    sim.export writes both). The file lists block scales channel-major; they are returned in the weight's ONNX layout
    (Encoding.axis: ONNX's blocked scale shape; on_rows() gives refimpl's [out, in] form). LPBQ: per_block_int_scale
    times the per-channel float scale (formed in float64, rounded to float32 once, as aimet-onnx does), with codes of
    the compressed width (signed, offset 0)."""
    path = Path(path)
    doc = _doc(path)
    version = doc.get("version")
    if version != "1.0.0":
        raise FormatError(f"{path}: version {brief(version)}: aimet-onnx encodings are read in the 1.0.0 schema "
                          f"(sim.export(..., encoding_version='1.0.0'), its default)")
    entries = []
    for section in ("activation_encodings", "param_encodings"):
        items = doc.get(section, [])
        expect(items, list, f"{path}: {section}", what="a list (the 1.0.0 schema)")
        for i, e in enumerate(items):
            at = f"{path}: {section}[{i}]"
            name = _name(expect(e, dict, at, what="an encoding object").get("name"), at)
            entries.append((name, e, f"{at} {brief(name)}"))
    layouts = None
    if any(isinstance(e.get("scale"), list) and len(e["scale"]) > 1 or e.get("enc_type") in _BLOCKED
           for _, e, _ in entries):
        layouts = _weight_layouts(path, model)
    out = {}
    for name, e, at in entries:
        if name in out:
            raise FormatError(f"{at}: a second encoding of {name!r}")
        enc = _onnx_entry(e, at, (layouts or {}).get(name))
        if enc.float_dtype is np.float32:
            out[name] = None          # kept in float32 (recorded to refuse a duplicate)
            continue
        _check_offsets(path, name, enc)
        out[name] = enc
    return {k: v for k, v in out.items() if v is not None}


def load_onnx_model(path):
    """An ONNX model file (its external data not read) -> onnx.ModelProto: a regular file (not a FIFO or device),
    parsed by the onnx package; FormatError naming the file otherwise."""
    import onnx  # imported only when an ONNX file is read (it costs ~0.3 s)

    path = Path(path)
    data = read_exact(path, regular_file(path, "ONNX model"))
    try:
        return onnx.load_model_from_string(data)
    except Exception as e:  # protobuf's DecodeError and friends: a file that is not an ONNX model
        raise FormatError(f"{path}: not an ONNX model ({brief(str(e))})") from None


_BLOCKED = ("PER_BLOCK", "LPBQ")
_WEIGHT_AXES = {"Conv": (0, 1), "ConvTranspose": (1, 0)}


def _weight_layouts(path: Path, model) -> dict[str, tuple]:
    """{initializer name: (shape, channel axis, block axis)} of the weights of MatMul / Gemm / Conv / ConvTranspose
    in the ONNX model beside an encodings file (aimet-onnx's quantization axes)."""
    model = Path(model) if model is not None else path.with_suffix(".onnx")
    if not model.exists() and not model.is_symlink():
        raise FormatError(f"{path}: per-channel / per-block entries need the ONNX model they were exported with, for "
                          f"their axes; {model} does not exist (pass model=)")
    m = load_onnx_model(model)
    shapes = {t.name: tuple(int(d) for d in t.dims) for t in m.graph.initializer}
    # a weight transposed in the graph (Transpose of an initializer feeding a MatMul: a tied lm_head): aimet-onnx's
    # "transposed_params", channels on the axis before the last
    transposed = {n.output[0]: n.input[0] for n in m.graph.node if n.op_type == "Transpose" and n.input and
                  n.output and n.input[0] in shapes}
    out = {}
    for n in m.graph.node:
        if n.op_type == "MatMul" and len(n.input) >= 2 and n.input[1] in transposed:
            shape = shapes[transposed[n.input[1]]]
            if len(shape) >= 2:
                out[transposed[n.input[1]]] = (shape, len(shape) - 2, len(shape) - 1)
            continue
        if len(n.input) < 2 or n.input[1] not in shapes:
            continue
        shape = shapes[n.input[1]]
        if n.op_type == "MatMul" and len(shape) >= 2:
            axes = (len(shape) - 1, len(shape) - 2)
        elif n.op_type == "Gemm" and len(shape) == 2:
            trans = next((a.i for a in n.attribute if a.name == "transB"), 0)
            axes = (0, 1) if trans else (1, 0)
        elif n.op_type in _WEIGHT_AXES and len(shape) >= 2:
            axes = _WEIGHT_AXES[n.op_type]
        else:
            continue
        out[n.input[1]] = (shape, *axes)
    return out


def _onnx_entry(e: dict, where: str, layout) -> Encoding:
    """One aimet-onnx 1.0.0 entry -> Encoding (arithmetic aimet-onnx), laid out on the weight's ONNX shape."""
    bw, floating, enc_type, scale, offset = _v1_common(e, where, "aimet-onnx")
    if floating is not None:
        return floating
    signed = _symmetric(e.get("is_sym", False), where) and not offset.any()
    if enc_type == "PER_TENSOR":
        if scale.size != 1:
            raise FormatError(f"{where}: PER_TENSOR with {scale.size} scales")
        return Encoding(bw, scale.reshape(()), offset.reshape(()), signed=signed, arithmetic="aimet-onnx")
    if enc_type not in ("PER_CHANNEL", *_BLOCKED):
        raise FormatError(f"{where}: unknown enc_type {brief(enc_type)} (PER_TENSOR, PER_CHANNEL, PER_BLOCK, LPBQ)")
    if layout is None:
        raise FormatError(f"{where}: a {enc_type} encoding of a tensor that is not the weight of a MatMul / Gemm / "
                          f"Conv of the model (per-channel and per-block entries apply to such weights)")
    shape, channel, block_axis = layout
    if enc_type == "PER_CHANNEL":
        if scale.size != shape[channel]:
            raise FormatError(f"{where}: {scale.size} scales for the {shape[channel]} channels of a weight of shape "
                              f"{list(shape)} (axis {channel})")
        return Encoding(bw, scale, np.broadcast_to(offset, scale.shape).copy(), signed=signed, axis=channel,
                        arithmetic="aimet-onnx")
    if len(shape) != 2:
        raise FormatError(f"{where}: a {enc_type} encoding of a weight of rank {len(shape)} (2-D weights only)")
    block = integer(e.get("block_size"), f"{where}: block_size", lo=1, hi=shape[block_axis])
    if shape[block_axis] % block:
        raise FormatError(f"{where}: block_size {block} does not divide the {shape[block_axis]} inputs of a weight "
                          f"of shape {list(shape)}")
    grid = tuple(s // block if a == block_axis else s for a, s in enumerate(shape))   # ONNX's blocked scale shape

    def on_grid(a):
        # the file lists block scales channel-major ([channels, blocks] flattened, whichever axis the blocks are on)
        a = np.asarray(a).reshape(grid[channel], grid[block_axis])
        return a if channel < block_axis else a.T
    if enc_type == "PER_BLOCK":
        if scale.size != grid[0] * grid[1]:
            raise FormatError(f"{where}: {scale.size} scales for {grid[channel]} channels x {grid[block_axis]} "
                              f"blocks of {block}")
        return Encoding(bw, on_grid(scale), on_grid(np.broadcast_to(offset, scale.shape)).copy(), block,
                        signed, axis=block_axis, arithmetic="aimet-onnx")
    ints = expect(e.get("per_block_int_scale"), list, f"{where}: per_block_int_scale")
    for v in ints:
        integer(v, f"{where}: per_block_int_scale", lo=1, hi=2 ** MAX_BITWIDTH)
    if scale.size != shape[channel] or len(ints) != grid[0] * grid[1]:
        raise FormatError(f"{where}: LPBQ of {scale.size} channel scales and {len(ints)} per_block_int_scale "
                          f"entries for a weight of shape {list(shape)} ({shape[channel]} channels x "
                          f"{grid[block_axis]} blocks of {block})")
    # [C] along the channel axis, as the file writes it (aimet-onnx's float64 channel scale: the product of the
    # integer and the channel scale is formed in float64 and rounded to float32 once, as its quantiser holds it)
    per_channel = np.array(e["scale"], np.float64).reshape([-1 if a == channel else 1 for a in range(2)])
    expanded = (on_grid(np.array(ints, np.float64)) * per_channel).astype(np.float32)
    if not np.all(np.isfinite(expanded)):
        raise FormatError(f"{where}: LPBQ scales overflow float32")
    if "compressed_bw" in e:
        # bw is the expanded width with offset -2^(bw-1); the codes are the compressed width's, and aimet-onnx's
        # quantiser holds them as unsigned codes with offset -2^(cbw-1) (the same grid as signed codes, but the
        # offset enters its float32 arithmetic: fl32(x / s) + 8 rounds where x / s alone would not)
        bw = integer(e["compressed_bw"], f"{where}: compressed_bw", lo=1, hi=bw)
        return Encoding(bw, expanded, np.full(grid, -2 ** (bw - 1), np.int32), block, False, axis=block_axis,
                        arithmetic="aimet-onnx")
    return Encoding(bw, expanded, np.broadcast_to(offset.reshape(per_channel.shape), grid).astype(np.int32), block,
                    signed, axis=block_axis, arithmetic="aimet-onnx")
