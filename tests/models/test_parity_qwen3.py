"""Parity with transformers 5.23 (eager) on random tiny Qwen3 / Qwen3-MoE configs.

The path is the user's: build the HF model, save_pretrained, refimpl.load(directory). Every parameter is
randomised, 1-D ones included. Logits are compared at every valid position:
- refimpl float32 against transformers float32: max abs error <= 1e-4;
- refimpl's float64 oracle mode against transformers' float64 twin (tests/oracle.py: its own code with its
  float32 casts made float64): <= 1e-10, i.e. the same maths to float64 rounding.
"""


import numpy as np
import pytest

import refimpl
from oracle import checkpoint_builder, hf_logits, left_padded

pytestmark = pytest.mark.oracle

BASE = dict(vocab_size=97, hidden_size=48, num_hidden_layers=3, intermediate_size=40, hidden_act="silu",
            max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
ROPE_SCALED = {
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6, "original_max_position_embeddings": 32},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 5e5, "mscale": 1.0, "mscale_all_dim": 0.5,
                    "beta_fast": 16, "beta_slow": 2, "original_max_position_embeddings": 32, "truncate": False},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 5e5},
}


def _longrope(head_dim):
    half = head_dim // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [1.5 + 0.2 * i for i in range(half)]}


DENSE = {
    # GQA 1, head_dim != hidden/heads, tied, default rope
    "gqa1-tied": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # GQA 2, attention bias, linear rope
    "gqa2-bias-linear": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True,
                             rope_parameters=ROPE_SCALED["linear"]),
    # GQA 4, sliding window on layers >= 1, dynamic NTK (grows past max_position_embeddings=32)
    "gqa4-sliding-dynamic": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=12, use_sliding_window=True,
                                 sliding_window=5, max_window_layers=1, max_position_embeddings=32,
                                 rope_parameters=ROPE_SCALED["dynamic"]),
    "yarn-untied": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16, rope_parameters=ROPE_SCALED["yarn"]),
    "yarn-mscale": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                        rope_parameters=ROPE_SCALED["yarn-mscale"]),
    "longrope": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                     rope_parameters=_longrope(16)),
    "llama3-tied-bias": dict(num_attention_heads=6, num_key_value_heads=3, head_dim=8, tie_word_embeddings=True,
                             attention_bias=True, rope_parameters=ROPE_SCALED["llama3"]),
    "gelu-sliding-all": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="gelu",
                             use_sliding_window=True, sliding_window=9, max_window_layers=0,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
MOE_BASE = dict(moe_intermediate_size=12, num_experts=8, num_experts_per_tok=2)
MOE = {
    "norm-topk": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, norm_topk_prob=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "no-norm-topk-tied": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=8, norm_topk_prob=False,
                              tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    "sparse-step-2-mlp-only": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8, decoder_sparse_step=2,
                                   mlp_only_layers=[2], norm_topk_prob=True, num_hidden_layers=4,
                                   rope_parameters=ROPE_SCALED["yarn"]),
    "top3-of-6-bias": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16, num_experts=6,
                           num_experts_per_tok=3, attention_bias=True, norm_topk_prob=True,
                           rope_parameters=ROPE_SCALED["linear"]),
    "sliding-all-dynamic": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_sliding_window=True,
                                sliding_window=6, max_position_embeddings=32, norm_topk_prob=False,
                                rope_parameters=ROPE_SCALED["dynamic"]),
    "llama3": dict(num_attention_heads=2, num_key_value_heads=2, head_dim=24, norm_topk_prob=True,
                   rope_parameters=ROPE_SCALED["llama3"]),
    "longrope-untied": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                            norm_topk_prob=True, rope_parameters=_longrope(8)),
    "top1-gelu": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts_per_tok=1,
                      hidden_act="gelu", norm_topk_prob=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}
CASES = [("qwen3", name, {**BASE, **c}) for name, c in DENSE.items()] + \
        [("qwen3_moe", name, {**BASE, **MOE_BASE, **c}) for name, c in MOE.items()]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return checkpoint_builder(tmp_path_factory)


def _max_err(a, b, valid=None):
    if valid is not None:
        a, b = a[valid], b[valid]
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


@pytest.mark.parametrize("model_type,name,cfg", CASES, ids=[f"{t}-{n}" for t, n, _ in CASES])
def test_logits_match_transformers(model_type, name, cfg, checkpoints, record_property):
    hf, hf64, directory = checkpoints(model_type, name, cfg)
    m32 = refimpl.load(directory)
    m64 = refimpl.load(directory, dtype="float64")
    rng = np.random.default_rng(1)
    errors = {}
    for T in (1, 7, 65):
        ids = rng.integers(0, cfg["vocab_size"], size=(1, T))
        e32 = _max_err(m32.forward(ids), hf_logits(hf, ids))
        e64 = _max_err(m64.forward(ids), hf_logits(hf64, ids))
        errors[T] = (e32, e64)
        assert e32 <= 1e-4, f"T={T}: float32 max abs error {e32:.3g}"
        assert e64 <= 1e-10, f"T={T}: float64 max abs error {e64:.3g}"
    # batch 2 with left padding: explicit positions for transformers, refimpl derives them from the mask
    ids, mask, positions = left_padded(rng, cfg["vocab_size"], 40, pads=9)
    valid = mask.astype(bool)
    e32 = _max_err(m32.forward(ids, attention_mask=mask), hf_logits(hf, ids, mask, positions), valid)
    e64 = _max_err(m64.forward(ids, attention_mask=mask), hf_logits(hf64, ids, mask, positions), valid)
    errors["pad"] = (e32, e64)
    assert e32 <= 1e-4, f"left-padded batch: float32 max abs error {e32:.3g}"
    assert e64 <= 1e-10, f"left-padded batch: float64 max abs error {e64:.3g}"
    record_property("max_abs_err", {k: f"{a:.2e}/{b:.2e}" for k, (a, b) in errors.items()})
    print(f"{model_type}-{name}: max abs err f32/f64 by T: {errors}")
