"""The command line's shared argument types and flag groups, for refimpl.cli and the diff and dataset commands.

    p.add_argument("--max-resident", type=size)         # a bad value is an argparse error: one line, exit 2
    precision_flags(p)                                  # --dtype / --precision / --weights / --kv / --encodings ...
    model = load_model(args)                            # the model those flags describe
"""

import argparse
import math
import re

import numpy as np

from .errors import InputError
from .precision import DEVICE_ARITHMETICS, Policy
from .sources import load


def token_ids(text: str) -> np.ndarray:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--input-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--input-ids is empty")
    if any(not 0 <= t < 2**31 for t in ids):
        raise argparse.ArgumentTypeError(f"--input-ids must be token ids in [0, 2^31), got {text!r}")
    return np.array([ids], dtype=np.int64)


def regex(text: str) -> str:
    """A user-given regular expression, compiled once here so a bad one is an argument error."""
    try:
        re.compile(text)
    except (re.error, RecursionError, OverflowError) as e:
        raise argparse.ArgumentTypeError(f"invalid regular expression {text!r} ({e})") from None
    return text


def finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _integer_at_least(lo: int, what: str):
    """An argparse type: an integer >= lo, else an argument error saying it expected `what`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = lo - 1
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


positive = _integer_at_least(1, "a positive integer")
nonnegative = _integer_at_least(0, "an integer >= 0")


def size(text: str) -> int:
    """A byte count: 1073741824, 512MiB, 1.5GiB, 2G (binary units; B, K/KiB, M/MiB, G/GiB, T/TiB)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size such as 512MiB, 2GiB or a number of bytes, got {text!r}")
    return int(float(m[1]) * 1024 ** ("KMGT".find(m[2].upper()) + 1) if m[2] else float(m[1]))


def precision_flags(p) -> None:
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--precision", choices=["float32", "float64", "bf16", "fp16", "htp-fp16"],
                   help="activation precision; bf16 / fp16 are emulated by rounding at transformers' cast points, "
                        "htp-fp16 also rounds the Gated DeltaNet core and state as an fp16 NPU (docs/htp.md)")
    p.add_argument("--weights", help="weight emulation: bf16, fp16 or int{4,8}-{per-tensor|per-channel|block<N>}-"
                                     "{qnn|onnx} (default: the activation precision)")
    p.add_argument("--kv", choices=["bf16", "fp16", "int8"], help="KV cache dtype emulation")
    p.add_argument("--delta-rule-chunk", type=positive, metavar="N",
                   help="htp-fp16: the device graph runs the Gated DeltaNet delta rule in chunks of min(T, N) tokens "
                        "(AI Hub's Qwen3.5 graph code: 64; docs/htp.md section 8); default token by token")
    p.add_argument("--fast", action="store_true",
                   help="plain BLAS float32 sums instead of correctly rounded ones: faster, but the bits depend on the "
                        "CPU, BLAS kernel and thread count (recorded in the manifest; never the golden default)")
    p.add_argument("--encodings", help="AIMET / QNN encodings JSON: the quantised device's weights, and its "
                                       "activations quantised where AIMET's QuantSim quantises them "
                                       "(docs/numerics.md); or a QDQ .onnx model: its quantisers placed on "
                                       "refimpl's graph (docs/precision.md)")
    p.add_argument("--onnx", metavar="MODEL.onnx",
                   help="with --encodings from aimet-onnx: the ONNX model whose tensors the file names (its quantisers "
                        "are placed by that graph's structure, docs/precision.md)")
    p.add_argument("--device-arithmetic", choices=DEVICE_ARITHMETICS,
                   help="with --encodings MODEL_QDQ.onnx: the ops a quantised device computes on codes, as that device "
                        "computes them (htp: the ops measured on the HTP simulator, docs/htp.md section 9); default "
                        "ONNX Runtime's CPU EP")
    p.add_argument("--strict-encodings", action="store_true",
                   help="an activation encoding naming nothing refimpl can place is an error (default: a warning)")
    p.add_argument("--max-resident", type=size, metavar="SIZE",
                   help="most converted weights held at once, e.g. 2GiB; the rest are converted per layer as they "
                        "run (default: keep all when the converted model fits in half of memory, else 1GiB)")


def load_model(args, source=None, strict=True):
    """The model with the precision policy of --dtype / --precision / --weights / --kv / --encodings and the
    resident budget of --max-resident."""
    fields = {"activations": args.precision or args.dtype, "weights": args.weights, "kv": args.kv,
              "fast": args.fast, "delta_rule_chunk": args.delta_rule_chunk}
    if args.encodings:
        if args.weights not in (None, "encodings"):
            raise InputError(f"--encodings sets the weights; it cannot be combined with --weights {args.weights}")
        fields.update(weights="encodings", encodings=args.encodings, strict_encodings=args.strict_encodings,
                      onnx=args.onnx, device_arithmetic=args.device_arithmetic)
    elif args.strict_encodings or args.onnx or args.device_arithmetic:
        flag = "onnx" if args.onnx else "strict-encodings" if args.strict_encodings else "device-arithmetic"
        raise InputError(f"--{flag} needs --encodings")
    return load(source or args.model, dtype=args.dtype, precision=Policy(**fields), strict=strict,
                max_resident_bytes=args.max_resident)
