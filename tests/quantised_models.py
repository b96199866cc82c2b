"""Quantised ONNX models as a deployment makes them (issue 27): a tiny transformers Qwen3 exported to ONNX, quantised
by aimet-onnx's QuantSim (its default config; encodings keyed by ONNX tensor names, `sim.export`) and by ONNX
Runtime's quantiser with its QNN config (a QDQ model). Shared by tests/test_onnx_quantisers.py and the device runs of
tests/e2e (reusable: every function takes paths and plain feeds).

    float_onnx = export_logits_model(tmp / "float")                  # input_ids [1, 8] -> logits, seeded weights
    feeds = calibration_feeds()                                        # four short prompts
    onnx_path, encodings = aimet_export(float_onnx, "W8A16", feeds, tmp / "aimet")
    qdq = qdq_model(float_onnx, "W8A16", feeds, tmp / "qdq.onnx")

Mixes (AIMET_MIXES, QDQ_MIXES): W8A16 = 8-bit weights per output channel, 16-bit activations; W4A16 = 4-bit weights
per channel; W4A16-LPBQ (aimet-onnx: per-block 4-bit integer scales of a per-channel float scale, blocks of
BLOCK inputs); W4A16-block (aimet-onnx PER_BLOCK). QDQ W8A16 is the issue's: uint8 weights per tensor
(onnxruntime's QNN config makes MatMul weights per tensor, as QNN wants), uint16 activations; QDQ W4A16 gives int4
weights per output channel (the QNN config's override, axis 1 of a MatMul's [in, out] weight).

Everything here imports torch / transformers / aimet-onnx / onnxruntime lazily: a test module skips with the reason
`unavailable()` gives.
"""

import json
import warnings
from pathlib import Path

import numpy as np

AIMET_MIXES = ("W8A16", "W4A16", "W4A16-LPBQ", "W4A16-block")
QDQ_MIXES = ("W8A16", "W4A16")
BLOCK = 32          # block size (inputs) of the LPBQ / per-block mixes: hidden 64 and intermediate 192 divide by it
VOCAB = 512
SEQ = 8


def unavailable(*modules) -> str | None:
    """Why these modules cannot be imported here (None: they can)."""
    import importlib
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:   # an ImportError, or a package broken by its own import (a missing .so)
            return f"{name} cannot be imported ({type(e).__name__}: {str(e)[:120]}); `make test` installs it"
    return None


def export_logits_model(directory: Path, preset: str = "tiny-qwen3", vocab: int = VOCAB, seq: int = SEQ,
                        seed: int = 11, layers: int | None = None) -> Path:
    """transformers' model of a preset (seeded random weights, small vocabulary: tests/e2e/devices.small_preset)
    exported with torch.onnx.export (dynamo, optimized, one file): input_ids int64 [1, seq] -> logits float32
    [1, seq, vocab], no cache; `layers` overrides the preset's layer count (fewer: a faster export). The checkpoint is
    kept beside it (directory/ckpt). -> directory/model.onnx"""
    import sys
    e2e = str(Path(__file__).resolve().parent / "e2e")
    if e2e not in sys.path:
        sys.path.insert(0, e2e)
    import devices as D
    import torch
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    f = directory / "model.onnx"
    if f.exists():
        return f
    config, arrays = D.small_preset(preset, vocab=vocab, seed=seed)
    if layers is not None:
        from refimpl.models.config import config_from_dict
        from refimpl.presets import random_weights
        config = {**config, "num_hidden_layers": layers}
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][:layers]
        head = "model.embed_tokens.weight" if config["tie_word_embeddings"] else "lm_head.weight"
        arrays = random_weights(config_from_dict(config), seed=seed)
        arrays[head] = arrays[head] * np.float32(0.05)              # as small_preset scales it
    model = D.load_hf(D.hf_checkpoint(config, arrays, directory / "ckpt"))

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids):
            return self.m(input_ids=input_ids, use_cache=False).logits

    ids = torch.tensor(np.random.default_rng(seed).integers(0, vocab, (1, seq)))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(Logits(model).eval(), (ids,), f, input_names=["input_ids"], output_names=["logits"],
                          dynamo=True, external_data=False, optimize=True, verbose=False)
    return f


def calibration_feeds(n: int = 4, seq: int = SEQ, vocab: int = VOCAB, seed: int = 1) -> list[dict]:
    """n short prompts (seeded random ids) as ONNX feeds {"input_ids": int64 [1, seq]}."""
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, vocab, (1, seq)).astype(np.int64)} for _ in range(n)]


def aimet_quantsim(onnx_path: Path, mix: str, feeds: list[dict]):
    """aimet-onnx QuantizationSimModel of the model (default config, min-max calibration on `feeds`): 16-bit
    activations, weights as `mix` says. Shared initializers (a tied embedding / lm_head) are duplicated first, as
    aimet-onnx asks."""
    import logging

    import onnx
    from aimet_onnx.quantsim import QuantizationSimModel, set_blockwise_quantization_for_weights, set_lpbq_for_params
    from aimet_onnx.utils import duplicate_shared_initializers
    logging.getLogger("Quant").setLevel(logging.WARNING)
    if mix not in AIMET_MIXES:
        raise ValueError(f"mix {mix!r} is not one of {AIMET_MIXES}")
    model = onnx.load(str(onnx_path))
    duplicate_shared_initializers(model.graph)
    bits = 8 if mix == "W8A16" else 4
    sim = QuantizationSimModel(model, param_type=f"int{bits}", activation_type="int16",
                               providers=["CPUExecutionProvider"])
    if mix == "W4A16-LPBQ":
        set_lpbq_for_params(sim, 4, BLOCK, op_types={"MatMul", "Gemm"})
    elif mix == "W4A16-block":
        set_blockwise_quantization_for_weights(sim, ("MatMul", "Gemm"), 4, True, BLOCK)
    sim.compute_encodings(feeds)
    return sim


def aimet_export(onnx_path: Path, mix: str, feeds: list[dict], directory: Path) -> tuple[Path, Path]:
    """QuantSim of the model exported with `sim.export`: (directory/model.onnx, directory/model.encodings), the
    1.0.0 encodings keyed by the ONNX tensor names of that model."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "model.encodings").exists():
        aimet_quantsim(onnx_path, mix, feeds).export(str(directory), "model")
    return directory / "model.onnx", directory / "model.encodings"


def qdq_model(onnx_path: Path, mix: str, feeds: list[dict], target: Path) -> Path:
    """A QDQ model of the float model with onnxruntime.quantization's QNN config (MinMax calibration on `feeds`):
    uint16 activations; W8A16 uint8 weights (per tensor: the QNN config's choice for MatMul), W4A16 int4 weights
    per output channel (axis 1 of each MatMul's [in, out] initializer, given as an override)."""
    import onnx
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config
    if mix not in QDQ_MIXES:
        raise ValueError(f"mix {mix!r} is not one of {QDQ_MIXES}")
    target = Path(target)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(feeds)

        def get_next(self):
            return next(self.it, None)

    overrides = None
    if mix == "W4A16":
        model = onnx.load(str(onnx_path), load_external_data=False)
        inits = {t.name for t in model.graph.initializer}
        weights = {n.input[1] for n in model.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in inits}
        overrides = {w: [{"quant_type": QuantType.QInt4, "symmetric": True, "axis": 1}] for w in sorted(weights)}
    config = get_qnn_qdq_config(str(onnx_path), Reader(), activation_type=QuantType.QUInt16,
                                weight_type=QuantType.QUInt8 if mix == "W8A16" else QuantType.QInt4,
                                init_overrides=overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import logging
        level = logging.getLogger().level
        logging.getLogger().setLevel(logging.ERROR)   # its advice to pre-process and the opset 21 upgrade
        try:
            quantize(str(onnx_path), str(target), config)
        finally:
            logging.getLogger().setLevel(level)
    return target


def encodings_summary(path: Path) -> dict:
    """{(section, dtype, enc_type, bw): count} of an aimet-onnx encodings file (for reports)."""
    doc = json.loads(Path(path).read_text())
    out = {}
    for section in ("activation_encodings", "param_encodings"):
        for e in doc.get(section, []):
            key = f"{section.split('_')[0]} {e.get('dtype')} {e.get('enc_type')} bw{e.get('bw')}"
            out[key] = out.get(key, 0) + 1
    return out
