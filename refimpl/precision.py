"""Precision policies: what refimpl rounds, where, and to what (device_conventions.md §8.3).

    refimpl.load(src)                                   # float32 (default)
    refimpl.load(src, precision="bf16")                 # bf16 activations and weights, as transformers in bf16
    refimpl.load(src, precision=Policy(activations="fp16", weights="int8-per-channel-qnn", kv="int8"))

activations  float32 | float64 (the oracle) | bf16 | fp16 | htp-fp16. Reduced precision is *emulated*: arrays
             stay float32, and `Policy.round` rounds (IEEE round-to-nearest-even, ml_dtypes) at exactly the op
             boundaries where transformers casts when the model runs in that dtype: every nn.Linear output, each
             elementwise op of RoPE / SwiGLU / gates, residual adds, the attention scores (after the product, after
             the scale, after the mask), the probabilities, the norms' outputs (computed in float32 inside), the MoE
             routing weights and each expert's contribution, the conv output and its silu, the GDN core output.
             Between boundaries the arithmetic is float32 (matmuls accumulate in float32, as CPU/NPU kernels do);
             the GDN core and its recurrent state stay float32, g is float32 (transformers computes both so).
             htp-fp16: an fp16 NPU running the whole graph in fp16 (Qualcomm's HTP; docs/htp.md): fp16's cast points,
             and also g, the GDN l2norms and the delta rule (token by token, its state included) and the gates'
             sigmoid / softplus rounded to fp16 after every op, each sum accumulated wide and rounded once (the HTP's
             reductions and matmuls, measured), and the RMSNorms op by op (AI Hub's Qwen3.5 graph needs it: its
             layer-0 norm 76 % bit-identical op by op, 30 % cast once). delta_rule_chunk: the device graph runs
             the rule in chunks as AI Hub's graph code does (kernels.gated_delta.gated_delta_chunked_rounded).
weights      float32 | float64 | bf16 | fp16, or integer fake-quantisation of every matrix (ndim >= 2) except
             the embedding table and the depthwise conv:  int{4,8}-{per-tensor|per-channel|block<N>}-{qnn|onnx}
             (ranges from the weights' own min/max per row or per block of the input axis: a stand-in when no
             encodings exist), or "encodings": the scales and offsets of an AIMET / QNN encodings JSON
             (`encodings=path`), applied exactly; tensors the file does not name stay float. The file's
             activation encodings quantise activations where AIMET's QuantSim does (refimpl/models/quantisers.py):
             a module's inputs and output; the rest of the arithmetic stays in the activation dtype.
             strict_encodings: an activation encoding refimpl cannot place is an error (else a warning).
             Default: the activation dtype (bf16 weights for bf16 activations, as a bf16 checkpoint).
kv           None (keys/values as the activations leave them) | bf16 | fp16 | int8: what the KV cache holds.
             int8 is symmetric per (token, head) over head_dim: s = max|x| / 127, x -> round_half_even(x/s) * s.
             The current call's attention reads the cache, so it sees the stored values too.

float32 and float64 make every hook the identity: the float32 path is bit-identical to a run without policies.
"""

import dataclasses
import re
from pathlib import Path

import ml_dtypes
import numpy as np

from .encodings import Encoding, read_encodings  # noqa: F401  (re-exported: refimpl.precision's API)
from .errors import FormatError, InputError
from .files import sha256_file
from .kernels import quant
from .kernels.activation import identity

ACTIVATIONS = {"float32": None, "float64": None, "bf16": ml_dtypes.bfloat16, "fp16": np.float16,
               "htp-fp16": np.float16}
FLOAT_WEIGHTS = ("float32", "float64", "bf16", "fp16")
KV = (None, "bf16", "fp16", "int8")
_INT_WEIGHTS = re.compile(r"^int(4|8)-(per-tensor|per-channel|block(\d+))-(qnn|onnx)$")
CAST_POINTS = (  # where emulated bf16 / fp16 rounds (transformers 5.23's casts, eager attention); in manifests
    "linear outputs (every projection, router, lm_head)", "norm outputs (float32 inside)",
    "rope tables and each rope product and sum", "attention scores after q.k, after the scale, after the mask",
    "attention probabilities (float32 softmax) and output", "activation outputs and gating products",
    "residual adds", "moe routing weights, each weighted expert term and the running sum",
    "conv1d output and its silu", "gdn beta and core output (g, l2norm, the core and its state float32)")
# AI Hub's Qwen3.5 graph code (qai-hub-models 0.65.0, DELTA_RULE_CHUNK_CAP) runs the delta rule in chunks of
# min(T, 64) tokens with a band-seeded Newton-Schulz triangular inverse, exact up to 64 (docs/htp.md section 8)
AIHUB_DELTA_RULE_CHUNK = 64
HTP_CAST_POINTS = CAST_POINTS[:-1] + (  # htp-fp16: the GDN in fp16 too (docs/htp.md)
    "gdn beta, g (each op), the l2norms (each op), the delta rule token by token (each op, its state included)",
    "the RMSNorms (each op: the mean of squares, 1/sqrt, the two products)",
    "gate sigmoids and softplus as 1 / (1 + exp(-x)) and log(1 + exp(x)), each op",
    "sums (reductions, matmuls) accumulated wide, rounded once")



def rounder(dtype_name: str | None):
    """x -> x rounded to dtype (round-to-nearest-even) and returned in x's own dtype; the identity for
    float32 / float64 / None."""
    target = ACTIVATIONS.get(dtype_name) if dtype_name else None
    if target is None:
        return identity

    def round_to(x):
        x = np.asarray(x)
        return x.astype(target).astype(x.dtype)
    return round_to


# the devices whose quantised arithmetic refimpl emulates on a device graph's codes (models/quantisers.DEVICE_OPS)
DEVICE_ARITHMETICS = ("htp",)


@dataclasses.dataclass(frozen=True)
class Policy:
    activations: str = "float32"
    weights: str | None = None        # None: the activation dtype
    kv: str | None = None
    encodings: str | None = None      # AIMET / QNN encodings JSON (weights "encodings", and its activations)
    strict_encodings: bool = False    # an activation encoding that names nothing refimpl has is an error
    onnx: str | None = None           # the ONNX model whose tensors an aimet-onnx encodings file names (issue 27)
    fast: bool = False                # plain BLAS / NumPy float32 sums: faster, not portable, not correctly rounded
    delta_rule_chunk: int | None = None  # htp-fp16: the device graph runs the delta rule in chunks of min(T, this)
                                         # tokens (AI Hub's Qwen3.5 graph: AIHUB_DELTA_RULE_CHUNK); None: token by token
    device_arithmetic: str | None = None  # a quantised device graph's ops on codes as this device computes them
                                          # ("htp": models/quantisers.DEVICE_OPS); None: ONNX Runtime's CPU EP

    def __post_init__(self):
        if self.activations not in ACTIVATIONS:
            raise InputError(f"precision activations {self.activations!r} is not one of {', '.join(ACTIVATIONS)}")
        w = self.weights
        if w is not None and w not in FLOAT_WEIGHTS and w != "encodings" and not _INT_WEIGHTS.match(w):
            raise InputError(f"precision weights {w!r} is not one of {', '.join(FLOAT_WEIGHTS)}, encodings or "
                             "int{4,8}-{per-tensor|per-channel|block<N>}-{qnn|onnx}")
        if (w == "encodings") != (self.encodings is not None):
            raise InputError("precision: weights='encodings' and an encodings file go together")
        if self.strict_encodings and self.encodings is None:
            raise InputError("precision: strict_encodings needs an encodings file")
        if self.onnx is not None and (self.encodings is None or str(self.encodings).endswith(".onnx")):
            raise InputError("precision: onnx names the ONNX model an aimet-onnx encodings JSON keys (a QDQ model is "
                             "given as the encodings itself)")
        if self.kv not in KV:
            raise InputError(f"precision kv {self.kv!r} is not one of {', '.join(map(str, KV))}")
        if not isinstance(self.fast, bool):
            raise InputError(f"precision fast must be True or False, got {self.fast!r}")
        c = self.delta_rule_chunk
        if c is not None and (not isinstance(c, int) or isinstance(c, bool) or not 1 <= c <= AIHUB_DELTA_RULE_CHUNK
                              or self.activations != "htp-fp16"):
            raise InputError(f"precision delta_rule_chunk {c!r}: an integer from 1 to {AIHUB_DELTA_RULE_CHUNK} (the "
                             f"chunked rule's triangular inverse is exact up to there), with htp-fp16 activations only")
        if self.device_arithmetic is not None and (self.device_arithmetic not in DEVICE_ARITHMETICS
                                                   or not self.device_graph):
            raise InputError(f"precision device_arithmetic {self.device_arithmetic!r}: one of "
                             f"{', '.join(DEVICE_ARITHMETICS)}, with a quantised device graph's encodings (QDQ)")
        if self.activations == "float64" and (self.weight_format != "float64" or self.kv):
            raise InputError("precision: the float64 oracle takes float64 weights and no KV emulation")

    @property
    def dtype(self) -> str:
        """The container dtype of every array: float64 in the oracle mode, float32 otherwise."""
        return "float64" if self.activations == "float64" else "float32"

    @property
    def weight_format(self) -> str:
        return self.weights or ("fp16" if self.activations == "htp-fp16" else self.activations)

    @property
    def device_graph(self) -> bool:
        """The encodings are a quantised device graph's (a QDQ .onnx model, or aimet-onnx encodings of `onnx`):
        quantisers on that graph's tensors, placed by refimpl/models/onnx_placement.py."""
        return self.encodings is not None and (self.onnx is not None or str(self.encodings).endswith(".onnx"))

    @property
    def emulated(self) -> bool:
        return self.activations in ("bf16", "fp16", "htp-fp16")

    @property
    def rounds_each_op(self) -> bool:
        """htp-fp16: what transformers computes in float32 inside an fp16 model (g, the GDN l2norms, the delta rule
        with its state, the gates' sigmoid / softplus) rounded after every op too, as an NPU running it in fp16."""
        return self.activations == "htp-fp16"

    def round(self, x):
        """An activation boundary: x rounded to the activation dtype (identity in float32 / float64)."""
        return _ROUNDERS[self.activations](x)

    def mask(self, m: np.ndarray) -> np.ndarray:
        """An additive mask as transformers builds it in the activation dtype: its "-inf" is that dtype's
        finfo.min (float32's min would overflow to -inf when rounded to bf16 / fp16)."""
        if not self.emulated:
            return m
        return np.maximum(m, m.dtype.type(ml_dtypes.finfo(ACTIVATIONS[self.activations]).min))

    def store_kv(self, x: np.ndarray) -> np.ndarray:
        """Keys / values [B, Hkv, T, D] as the KV cache holds them."""
        if self.kv == "int8":
            return int8_kv(x)
        return rounder(self.kv)(x)

    def to_dict(self) -> dict:
        """The policy as recorded in a golden bundle's manifest (the encodings file by name and sha256)."""
        encodings = None
        if self.encodings is not None:
            encodings = {"file": Path(self.encodings).name,
                         "sha256": sha256_file(self.encodings, "encodings file", InputError)[0]}
        rounds = self.emulated or self.kv is not None or self.weight_format != self.dtype
        if self.onnx is not None:
            encodings["onnx"] = {"file": Path(self.onnx).name,
                                 "sha256": sha256_file(self.onnx, "ONNX model", InputError)[0]}
        recorded = {"dtype": self.dtype, "activations": self.activations, "weights": self.weight_format,
                    "kv": self.kv, "encodings": encodings, "rounding": "round-to-nearest-even" if rounds else None,
                    "cast_points": self.cast_points, "arithmetic": self.arithmetic}
        if self.delta_rule_chunk is not None:   # recorded only when set: other manifests stay as they were
            recorded["delta_rule_chunk"] = self.delta_rule_chunk
        if self.device_arithmetic is not None:  # likewise
            recorded["device_arithmetic"] = self.device_arithmetic
        return recorded

    @property
    def cast_points(self) -> list:
        """Where the emulation rounds (recorded in manifests)."""
        points = list(HTP_CAST_POINTS if self.rounds_each_op else CAST_POINTS if self.emulated else ())
        if self.delta_rule_chunk:
            points[len(CAST_POINTS) - 1] = (f"gdn beta, g (each op), the l2norms (each op), the delta rule in "
                                            f"chunks of min(T, {self.delta_rule_chunk}) as AI Hub's graph (each op, "
                                            "its state included)")
        return points

    @property
    def arithmetic(self) -> str:
        """How products, sums and elementary functions are computed (docs/numerics.md): "correctly-rounded"
        (float32, the same bits on every platform), "plain-blas" (float32, fast: BLAS / NumPy order, not portable)
        or "float64" (the oracle: NumPy / BLAS float64, portable to ~1e-15 relative, not bitwise)."""
        if self.dtype == "float64":
            return "float64"
        return "plain-blas" if self.fast else "correctly-rounded"


_ROUNDERS = {name: rounder(name) for name in ACTIVATIONS}


def from_manifest(recorded: dict, encodings: str | None = None, onnx: str | None = None) -> Policy:
    """The policy a bundle manifest's `precision` records (older bundles: just {"dtype"}). An encodings policy
    needs the file again (the manifest keeps its name and sha256), which must match."""
    activations = recorded.get("activations", recorded.get("dtype", "float32"))
    weights, kv, fast = recorded.get("weights"), recorded.get("kv"), recorded.get("arithmetic") == "plain-blas"
    chunk = recorded.get("delta_rule_chunk")
    if weights != "encodings":
        return Policy(activations, None if weights == activations else weights, kv, fast=fast, delta_rule_chunk=chunk)
    want = (recorded.get("encodings") or {}).get("sha256")
    if encodings is None:
        raise InputError(f"the bundle's weights come from an encodings file "
                         f"({(recorded.get('encodings') or {}).get('file')}); give it again (--encodings)")
    got = sha256_file(encodings, "encodings file", InputError)[0]
    if want is not None and got != want:
        raise InputError(f"{encodings}: sha256 {got[:12]} differs from the bundle's encodings ({want[:12]})")
    graph = (recorded.get("encodings") or {}).get("onnx")
    if graph and onnx is None:
        raise InputError(f"the bundle's encodings name the tensors of an ONNX model ({graph.get('file')}); "
                         f"give it again (--onnx)")
    if graph and sha256_file(onnx, "ONNX model", InputError)[0] != graph.get("sha256"):
        raise InputError(f"{onnx}: sha256 differs from the bundle's ONNX model ({str(graph.get('sha256'))[:12]})")
    return Policy(activations, "encodings", kv, str(encodings), fast=fast, onnx=onnx if graph else None,
                  delta_rule_chunk=chunk, device_arithmetic=recorded.get("device_arithmetic"))


def policy(precision) -> Policy:
    """A Policy from a Policy, an activation dtype name ("float32", "bf16", ...) or a dict of its fields."""
    if isinstance(precision, Policy):
        return precision
    if isinstance(precision, str):
        return Policy(activations=precision)
    if isinstance(precision, dict):
        return Policy(**precision)
    raise InputError(f"precision must be a Policy, a dtype name or a dict, got {type(precision).__name__}")


def int8_kv(x: np.ndarray) -> np.ndarray:
    """Symmetric int8 per (…, token) over the last axis: s = max|x| / 127 (1 where the row is zero),
    x -> round_half_even(x / s) * s, in x's dtype."""
    s = np.max(np.abs(x), axis=-1, keepdims=True) / 127
    s = np.where(s > 0, s, 1).astype(x.dtype)
    return (np.clip(np.rint(x / s), -127, 127) * s).astype(x.dtype)


# --- weights ----------------------------------------------------------------------------------------------------

def quantizable(name: str, array: np.ndarray) -> bool:
    """Matrices a device stores as integers: every weight of ndim >= 2 but the embedding table (a gather) and
    the depthwise conv [C, 1, Kc]."""
    return array.ndim >= 2 and not name.endswith("embed_tokens.weight") and not name.endswith("conv1d.weight")


def fake_quant_weight(w: np.ndarray, spec: str, tensor_range=None) -> np.ndarray:
    """w [..., out, in] -> dequantised w, by spec int{4,8}-{per-tensor|per-channel|block<N>}-{qnn|onnx}, from
    the weights' own ranges (per tensor, per row = output channel, or per block of N along the input axis).
    tensor_range: (min, max) of the whole tensor when w is a part of it (per-tensor ranges only)."""
    bits, gran, block, conv = _INT_WEIGHTS.match(spec).groups()
    bits, block = int(bits), (int(block) if block else None)
    x = w.reshape(-1, w.shape[-1]).astype(np.float32)                       # [rows, in]
    if gran == "per-tensor":
        (lo, hi), kw = tensor_range or (x.min(), x.max()), {}
    else:
        lo, hi = quant.block_range(x, block)                                # [rows] or [rows, blocks]
        kw = {"axis": 0} if block is None else {"axis": 1, "block_size": block}
    if conv == "qnn":
        out = quant.qnn_fake_quant(x, *quant.qnn_encoding_from_range(lo, hi, bits), bits, **kw)
    else:
        out = quant.onnx_fake_quant(x, *quant.onnx_params_from_range(lo, hi, f"int{bits}"), f"int{bits}", **kw)
    return out.reshape(w.shape).astype(w.dtype)


def check_encodings(p: "Policy", names, encodings: dict | None = None) -> None:
    """Every encoding must name a weight of the model: a typo would otherwise silently leave it in float.
    encodings: the file already read (the weight transform keeps it), else it is read here."""
    if p.weight_format != "encodings" or (p.device_graph and encodings is None):
        return
    unknown = sorted(set(read_encodings(p.encodings) if encodings is None else encodings) - set(names))
    if unknown:
        raise InputError(f"{p.encodings}: {len(unknown)} encoding(s) name no weight of the model, e.g. {unknown[:3]}")


def weight_transform(p: Policy, encodings: dict | None = None):
    """The per-tensor weight emulation of a policy, or None (nothing to do):
    (name, float array, part=None) -> array. `part` (refimpl.models.weights.Part), when given, says the array is
    part `part.index` of the leading axis of the tensor (an expert of a fused tensor, rows of lm_head): the
    result is that part of the emulated whole tensor. encodings: {weight: Encoding or a tuple applied in order}
    instead of the file's (a device graph's, placed: refimpl/models/onnx_placement.py)."""
    fmt = p.weight_format
    if fmt in ("float32", "float64"):
        return None
    if fmt in ("bf16", "fp16"):
        r = rounder(fmt)
        return lambda name, a, part=None: r(a)
    rest = rounder(p.activations)  # tensors that are not quantised keep the activation dtype
    if fmt == "encodings":
        encs = read_encodings(p.encodings) if encodings is None else encodings

        def from_file(name, a, part=None):
            enc = encs.get(name)
            if enc is None:
                return rest(a)
            try:
                for e in (enc if isinstance(enc, tuple) else (enc,)):
                    a = (e if part is None else e.rows(part.index, part.shape)).fake_quant(a)
                return a
            except (InputError, ValueError) as e:
                raise FormatError(f"{p.encodings}: {name} {list(part.shape if part else a.shape)}: {e}") from None
        from_file.encodings = encs   # for check_encodings: the file is read once
        return from_file
    ranges = {}  # per-tensor ranges of tensors read in parts: from the whole tensor, once

    def own_range(name, a, part=None):
        if not quantizable(name, a):
            return rest(a)
        tensor_range = None
        if part is not None and "per-tensor" in fmt:
            if name not in ranges:
                lo, hi = np.inf, -np.inf
                for chunk in part.chunks():
                    lo, hi = min(lo, chunk.min()), max(hi, chunk.max())
                ranges[name] = (np.float32(lo), np.float32(hi))
            tensor_range = ranges[name]
        return fake_quant_weight(a, fmt, tensor_range)
    return own_range
