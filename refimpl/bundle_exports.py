"""The optional derived files of a golden bundle: the npz export (reproducible bytes) and AIMET's layer-output
layout (docs/bundle.md). The safetensors export is refimpl.formats.safetensors' own writer."""

import io
import zipfile

import numpy as np

from .bundle_schema import ROLES, dumps, raw


def write_aimet(put, steps, index, arrays) -> None:
    """AIMET LayerOutputUtil layout: inputs/input_<k>/<i>.raw, outputs/layer_outputs_<k>/<name>.raw (taps, then
    outputs), layer_output_name_order.json. Each file gets a leading batch axis (unless its first axis is "b"),
    then 4-D is transposed NCHW -> NHWC; floats are written as float32, which is what the QAIRT debugger reads."""
    names = {}
    for k, s in enumerate(steps):
        for i, n in enumerate(s["inputs"]):
            key = f"{k}/input/{n}"
            put(f"aimet/inputs/input_{k}/{i}.raw", raw(_aimet_array(index[key], arrays[key])))
        for r in ("tap", "output"):
            for n in s[ROLES[r]]:
                key = f"{k}/{r}/{n}"
                put(f"aimet/outputs/layer_outputs_{k}/{n}.raw", raw(_aimet_array(index[key], arrays[key])))
                names[n] = None
    put("aimet/layer_output_name_order.json", dumps({"layer_output_names": list(names)}).encode())


def _aimet_array(rec: dict, a: np.ndarray) -> np.ndarray:
    if not (rec["axes"] or "").split(",")[0] == "b":
        a = a[None]
    if a.ndim == 4:
        a = a.transpose(0, 2, 3, 1)
    if a.dtype.name in ("float64", "float16", "bfloat16"):
        a = a.astype(np.float32)
    return np.ascontiguousarray(a)


def npz(arrays: dict) -> bytes:
    """np.savez with fixed zip timestamps (so the bytes are reproducible); bfloat16 stored as its uint16 bits."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for key, a in arrays.items():
            npy = io.BytesIO()
            np.lib.format.write_array(npy, a.view(np.uint16) if a.dtype.name == "bfloat16" else a, allow_pickle=False)
            z.writestr(zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0)), npy.getvalue())
    return buf.getvalue()
