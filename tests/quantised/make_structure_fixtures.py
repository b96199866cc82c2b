"""Regenerate tests/fixtures/quantised/: tiny presets (vocab 256, tests/e2e/devices.small_preset) as GenieGraph
(prompt AR 8, CL 32) exported by torch.onnx.export (dynamo, optimize=True), quantised W8A16 by
onnxruntime.quantization's QNN QDQ config on one calibration input (genie_inputs; tiny-qwen3-qdq-inputs.npz). The
tiny Qwen3 is kept whole (tiny-qwen3-qdq.onnx, run by onnxruntime in the tests); the others as *-qdq-structure.onnx
(Qwen3.5: its float graph, *-structure.onnx), every initializer of more than 16 elements but scales / zero points
emptied (what placement reads). tiny-qwen3.5-htp: tests/e2e/quantised.py's Qwen3.5 (its float case: rewritten for the
quantised HTP, the gated delta rule in its recurrent form) quantised W8A16 there (QNN QDQ, its four calibration
prompts), as tiny-qwen3.5-htp-qdq-structure.onnx.

    PYTHONPATH=. python tests/quantised/make_structure_fixtures.py tiny-qwen3 tiny-qwen3-moe tiny-qwen3.5 \
        tiny-qwen3.5-htp
"""

import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE.parent / "e2e"), str(HERE.parent)]
import devices as D  # noqa: E402

OUT = HERE.parent / "fixtures" / "quantised"


def genie_inputs(cfg, AR=8, CL=32) -> dict:
    W, rng = CL - AR, np.random.default_rng(0)
    inputs = {"input_ids": rng.integers(0, 200, (1, AR)).astype(np.int32)}
    mask = np.full((1, 1, AR, CL), -100.0, np.float32)
    for i in range(AR):
        mask[0, 0, i, W:W + i + 1] = 0
    inputs["attention_mask"] = mask
    inputs["position_ids_cos"], inputs["position_ids_sin"] = D.rope_tables(cfg, np.arange(AR))
    for i, kind in enumerate(D.layer_types(cfg)):
        if kind == "linear_attention":
            conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim \
                + cfg.linear_num_value_heads * cfg.linear_value_head_dim
            inputs[f"conv_state_{i}_in"] = np.zeros((1, conv_dim, cfg.linear_conv_kernel_dim - 1), np.float32)
            inputs[f"recurrent_state_{i}_in"] = np.zeros((1, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                                          cfg.linear_value_head_dim), np.float32)
        else:
            inputs[f"past_key_{i}_in"] = np.zeros((cfg.num_key_value_heads, 1, cfg.head_dim, W), np.float32)
            inputs[f"past_value_{i}_in"] = np.zeros((cfg.num_key_value_heads, 1, W, cfg.head_dim), np.float32)
    return inputs


def export(preset: str, directory: Path) -> tuple[Path, dict]:
    """The float GenieGraph export of the preset and its example inputs."""
    config, arrays = D.small_preset(preset, vocab=256)
    model = D.load_hf(D.hf_checkpoint(config, arrays, directory / f"{preset}-ckpt"),
                      experts="batched_mm" if "moe" in preset else None)
    ins, outs = D.genie_names(model.config)
    inputs = genie_inputs(model.config)
    f = directory / f"{preset}.onnx"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = D.GenieGraph(model).eval()
        args = tuple(D.torch_arg(inputs[n], torch.float32) for n in ins)
        torch.onnx.export(g, args, f, input_names=ins, output_names=outs, dynamo=True, external_data=False,
                          optimize=True, verbose=False)
    return f, inputs


def qdq(f: Path, inputs: dict, out: Path) -> Path:
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([inputs])

        def get_next(self):
            return next(self.it, None)
    quantize(str(f), str(out), get_qnn_qdq_config(str(f), Reader(), activation_type=QuantType.QUInt16,
                                                    weight_type=QuantType.QUInt8))
    return out


def structure_only(src: Path, out: Path) -> Path:
    """The graph with every initializer of more than 16 elements but scales / zero points emptied (name, dtype and
    dims kept, no data: what placement reads) and the nodes' metadata dropped."""
    m = onnx.load(str(src))
    for t in m.graph.initializer:
        a = numpy_helper.to_array(t)
        if a.size > 16 and not t.name.endswith(("_scale", "_zero_point")):
            t.ClearField("raw_data")
            for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                t.ClearField(field)
    for n in m.graph.node:
        del n.metadata_props[:]
    onnx.save(m, str(out))
    return out


if __name__ == "__main__":
    import tempfile
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for preset in sys.argv[1:]:
            if preset == "tiny-qwen3.5-htp":
                import quantised as Q
                case = Q.float_case("hybrid", Path(tmp) / "hybrid")
                qdq_path = Path(tmp) / "htp-qdq.onnx"
                Q.quantise_qdq(case, "w8a16", qdq_path)
                structure_only(qdq_path, OUT / "tiny-qwen3.5-htp-qdq-structure.onnx")
                continue
            f, inputs = export(preset, Path(tmp))
            if preset == "tiny-qwen3":
                qdq(f, inputs, OUT / f"{preset}-qdq.onnx")
                np.savez_compressed(OUT / f"{preset}-qdq-inputs.npz", **inputs)
            elif "3.5" in preset:     # its QDQ calibration takes tens of minutes: the float graph's structure
                structure_only(f, OUT / f"{preset}-structure.onnx")
            else:
                structure_only(qdq(f, inputs, Path(tmp) / "qdq.onnx"), OUT / f"{preset}-qdq-structure.onnx")
