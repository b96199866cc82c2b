"""Parity with transformers 5.23 (eager) on random tiny Qwen3 / Qwen3-MoE configs.

The path is the user's: build the HF model, save_pretrained, refimpl.load(directory). Every parameter is
randomised, 1-D ones included. Logits are compared at every valid position:
- refimpl float32 against transformers float32: max abs error <= 1e-4;
- the float64 oracle mode against transformers run in float64, fed refimpl's float64 RoPE tables (transformers
  builds its tables in float32 even in a float64 model; tests/kernels/test_rope.py checks the tables against
  transformers'): the float64 mode must be at least as close to it as the float32 mode. The float64 reference
  still has transformers' float32 islands (RMSNorm statistics, softmaxes), which bound how close it can get.
- left padding: transformers in float64 gives NaN for padded batches (its eager softmax casts finfo(float64).min
  to float32 -inf), so the float64 check of a padded row uses that row run unpadded.
"""

import copy

import numpy as np
import pytest

import refimpl

from oracle import build_hf, hf_logits, left_padded

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
    """Each case's HF model and its save_pretrained directory, built once per module."""
    built = {}

    def get(model_type, name, cfg):
        key = (model_type, name)
        if key not in built:
            hf = build_hf({"model_type": model_type, **cfg}, seed=len(built))
            d = tmp_path_factory.mktemp(f"{model_type}-{name}")
            hf.save_pretrained(d)
            built[key] = (hf, copy.deepcopy(hf).double(), d)
        return built[key]
    return get


def _tables(model, ids):
    """refimpl's cos/sin tables for an unpadded forward without a cache."""
    return model._rope(np.broadcast_to(np.arange(ids.shape[1]), ids.shape), None)


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
        ref32, ref64 = hf_logits(hf, ids), hf_logits(hf64, ids, rope=_tables(m64, ids))
        r32, r64 = m32.forward(ids), m64.forward(ids)
        e32, e64 = _max_err(r32, ref32), _max_err(r64, ref64)
        errors[T] = (e32, e64)
        assert e32 <= 1e-4, f"T={T}: float32 max abs error {e32:.3g}"
        assert e64 <= _max_err(r32, ref64), f"T={T}: float64 mode is farther from the float64 reference"
    # batch 2 with left padding: explicit positions for transformers, refimpl derives them from the mask
    ids, mask, positions = left_padded(rng, cfg["vocab_size"], 40, pads=9)
    valid = mask.astype(bool)
    r32, r64 = m32.forward(ids, attention_mask=mask), m64.forward(ids, attention_mask=mask)
    e32 = _max_err(r32, hf_logits(hf, ids, mask, positions), valid)
    e64 = e32x = 0.0
    cos, sin = m64._rope(positions, None)  # the batch's frequencies (dynamic / longrope depend on max position)
    for b in range(2):  # float64 reference: each row without its pads
        row = ids[b:b + 1, valid[b]]
        ref64 = hf_logits(hf64, row, rope=(cos[b:b + 1, valid[b]], sin[b:b + 1, valid[b]]))
        e64, e32x = max(e64, _max_err(r64[b, valid[b]], ref64[0])), max(e32x, _max_err(r32[b, valid[b]], ref64[0]))
    errors["pad"] = (e32, e64)
    assert e32 <= 1e-4, f"left-padded batch: float32 max abs error {e32:.3g}"
    assert e64 <= e32x, "left-padded batch: float64 mode farther from the float64 reference than float32 mode"
    record_property("max_abs_err", {k: f"{a:.2e}/{b:.2e}" for k, (a, b) in errors.items()})
    print(f"{model_type}-{name}: max abs err f32/f64 by T: {errors}")
