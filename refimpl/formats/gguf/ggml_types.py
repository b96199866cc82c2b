"""ggml's tensor types: every type id with its block size, which of them refimpl reads as weights, and the
dequantisation of a block type to float32 (gguf-py's, or refimpl's for the types gguf-py lacks)."""

from functools import cache

import gguf.quants
import ml_dtypes
import numpy as np
from gguf.constants import GGMLQuantizationType

from ...kernels.quant import dequantize_q1_0, dequantize_q2_0

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
    return gguf.quants.dequantize(rows, GGMLQuantizationType(ggml_type))
