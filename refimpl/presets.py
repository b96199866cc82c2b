"""Built-in tiny models with seeded random weights: the embedded default and the test fixtures.

They are shaped like the released models (the real vocabulary size, explicit head_dim != hidden/heads,
GQA, tied embeddings where the small Qwen3 checkpoints tie them) but small. Every 1-D parameter is
randomised: transformers initialises norms to exactly 0 or 1, which hides a wrong (1 + w) vs w.
"""

import hashlib
import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np

from .errors import InputError, brief
from .files import atomic_directory, write_atomic
from .formats.device_encodings import read_device_encodings
from .formats.safetensors import write_safetensors
from .kernels import elementary
from .models.config import config_from_dict
from .models.experts import per_expert_tensors
from .models.model import Model, expected_tensors
from .precision import policy

_QWEN3_COMMON = {
    "vocab_size": 151936, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu", "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "bos_token_id": 151643, "eos_token_id": 151645, "attention_bias": False, "use_sliding_window": False,
}
PRESETS: dict[str, dict] = {
    "tiny-qwen3": {**_QWEN3_COMMON, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                   "intermediate_size": 192, "tie_word_embeddings": True},
    "tiny-qwen3-moe": {**_QWEN3_COMMON, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                       "intermediate_size": 192, "moe_intermediate_size": 32, "num_experts": 8,
                       "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
                       "mlp_only_layers": [], "tie_word_embeddings": False},
}
_HYBRID_COMMON = {
    "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "hidden_act": "silu", "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "attention_bias": False,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "full_attention_interval": 4,
}
_QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1], "mrope_interleaved": True}
PRESETS.update({
    "tiny-qwen3-next": {**_HYBRID_COMMON, "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
                        "vocab_size": 151936, "intermediate_size": 192, "moe_intermediate_size": 32,
                        "shared_expert_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                        "partial_rotary_factor": 0.25, "rope_parameters": {"rope_type": "default",
                                                                           "rope_theta": 10000000.0},
                        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645},
    "tiny-qwen3.5": {**_HYBRID_COMMON, "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
                     "vocab_size": 248320, "intermediate_size": 192, "rope_parameters": _QWEN35_ROPE,
                     "tie_word_embeddings": True, "eos_token_id": 248044},
    "tiny-qwen3.5-moe": {**_HYBRID_COMMON, "model_type": "qwen3_5_moe_text",
                         "architectures": ["Qwen3_5MoeForCausalLM"], "vocab_size": 248320,
                         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 8,
                         "num_experts_per_tok": 2, "rope_parameters": _QWEN35_ROPE,
                         "tie_word_embeddings": False, "eos_token_id": 248044},
})
DEFAULT_PRESET = "tiny-qwen3.5"
PRESET_SEED = 20261122


def _rng(seed: int, name: str) -> np.random.Generator:
    """One generator per tensor, so a tensor's values depend only on (seed, its name)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def random_weights(config, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """Seeded random weights for every tensor the config's forward reads.

    matrices: N(0, 1/fan_in); embeddings N(0, 1); plain norm weights 1 + N(0, 0.1^2); zero-centred norm
    weights N(0, 0.1^2); biases N(0, 0.1^2); per-model extras (A_log, dt_bias, ...) as their module says.
    """
    out = {}
    for name, shape in sorted(expected_tensors(config).items()):
        r = _rng(seed, name)
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            a = r.standard_normal(shape, dtype=np.float32)
        elif name.endswith(".A_log"):
            a = elementary.log(r.uniform(1.0, 16.0, shape), float32_result=True)
        elif name.endswith(".dt_bias") or name.endswith(".bias"):
            a = 0.1 * r.standard_normal(shape, dtype=np.float32)
        elif len(shape) == 1:
            plain = not config.zero_centered_norms or ".linear_attn.norm" in name
            a = (1.0 if plain else 0.0) + 0.1 * r.standard_normal(shape, dtype=np.float32)
        else:
            a = r.standard_normal(shape, dtype=np.float32)
            a /= np.float32(np.sqrt(shape[-1]))
        out[name] = a.astype(dtype, copy=False)
    return out


def build(name: str, dtype: str = "float32", seed: int = PRESET_SEED, precision=None,
          max_resident_bytes: int | None = None):
    """The preset as a Model; precision: a refimpl.precision policy (default: `dtype` activations);
    max_resident_bytes: as refimpl.load."""
    config, p = config_from_dict(PRESETS[name], source=f"preset:{name}"), policy(precision or dtype)
    return Model.from_arrays(config, random_weights(config, seed), f"preset:{name}", p, max_resident_bytes,
                             device=read_device_encodings(p))


def checkpoint_layout(config, arrays: dict) -> dict:
    """The tensors as released checkpoints store them: Qwen3-MoE and Qwen3-Next keep one tensor per expert
    (`experts.{e}.gate_proj.weight`, ...); Qwen3.5-MoE keeps the fused `gate_up_proj` / `down_proj`."""
    if config.fused_expert_checkpoint:
        return dict(arrays)
    out = {}
    for name, a in arrays.items():
        prefix, _, kind = name.rpartition(".")
        if prefix.endswith(".experts") and kind in ("gate_up_proj", "down_proj"):
            out.update(per_expert_tensors(prefix, **{kind: a}))
        else:
            out[name] = a
    return out


_PRESET_FILES = ("config.json", "model.safetensors")


def save_preset(name: str, directory: str | Path, seed: int = PRESET_SEED, dtype: str = "float32") -> Path:
    """Write a preset as an HF checkpoint directory (config.json + model.safetensors) in the layout the
    released checkpoints of its architecture use; dtype: float32, bfloat16 (rounded to nearest even) or float16.
    The directory is written whole (refimpl.files.atomic_directory): absent or empty before, or a checkpoint of
    these two files, which it replaces; a crash leaves the old directory or the whole new one."""
    directory = Path(directory)
    other = sorted(p.name for p in directory.iterdir() if p.name not in _PRESET_FILES) if directory.is_dir() else []
    if other or (os.path.lexists(directory) and not directory.is_dir()):
        raise InputError(f"{directory}: holds {brief(other) if other else 'a file'}; a preset is saved into a new or "
                         f"empty directory (or over a saved preset)")
    config = config_from_dict(PRESETS[name], source=f"preset:{name}")
    target = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    arrays = {k: a.astype(target) for k, a in checkpoint_layout(config, random_weights(config, seed)).items()}
    with atomic_directory(directory, True, "preset checkpoint") as tmp:
        write_atomic(tmp / "config.json", json.dumps({**PRESETS[name], "dtype": dtype}, indent=2), "config.json")
        write_safetensors(tmp / "model.safetensors", arrays)
    return directory
