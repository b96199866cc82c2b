"""Parity with transformers 5.23 (float32, eager, torch fallback kernels) on random tiny Qwen3-Next, Qwen3.5
and Qwen3.5-MoE configs: value/key head ratios 1, 2, 4; d_k != d_v; conv kernels 2, 3, 4; partial rotary
0.25, 0.5, 1.0; sequences 1, 63, 64, 65, 130 around the 64-token chunk; a left-padded batch of 2.

As in test_parity_qwen3.py: refimpl float32 vs transformers float32 <= 1e-4; the float64 oracle mode vs
transformers' float64 twin (tests/oracle.py) <= 1e-10.

Conditioning: the GDN block normalises small vectors twice (l2norm of q/k, the gated RMSNorm of the core
output), so random tiny hybrids amplify float32 rounding ~10x more than dense Qwen3: with logits of size ~4,
transformers' own float32 logits sit up to 1.4e-4 from the float64 truth, and two equally accurate float32
implementations can disagree by twice that. The oracle models therefore have logits of size ~0.4 (lm_head at
0.1 scale, as transformers' own test models with initializer_range 0.02 have) and moderate decays
(tests/oracle.py). The float64 check against transformers' float64 twin is scale-free and exact (<= 1e-10).
"""

import importlib.metadata

import numpy as np
import pytest

import refimpl
from oracle import checkpoint_builder, hf_logits, left_padded

pytestmark = pytest.mark.oracle


def test_oracle_environment_has_no_fused_kernels():
    """transformers silently swaps in these packages' kernels when present (spec models.md §0.2)."""
    for dist in ("flash-linear-attention", "causal-conv1d", "kernels"):
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.distribution(dist)


BASE = dict(vocab_size=89, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=40, hidden_act="silu", max_position_embeddings=512, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, full_attention_interval=2)


def lin(hk, hv, dk, dv, kc):
    return dict(linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk,
                linear_value_head_dim=dv, linear_conv_kernel_dim=kc)


def rope(prf, theta=1e6, mrope=None):
    r = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": prf}
    if mrope:
        r.update(mrope_section=mrope, mrope_interleaved=True)
    return r


MOE = dict(moe_intermediate_size=12, shared_expert_intermediate_size=20, num_experts=6, num_experts_per_tok=2)
VARIANTS = [  # (name, overrides): every architecture runs all eight
    ("r1-kc2-prf25", {**lin(2, 2, 8, 12, 2), "prf": 0.25}),
    ("r2-kc3-prf50", {**lin(2, 4, 12, 8, 3), "prf": 0.5}),
    ("r4-kc4-prf100", {**lin(1, 4, 8, 8, 4), "prf": 1.0}),
    ("r2-kc4-prf25-tied", {**lin(2, 4, 16, 8, 4), "prf": 0.25, "tie_word_embeddings": True}),
    ("r4-kc2-prf50-gqa4", {**lin(2, 8, 8, 16, 2), "prf": 0.5, "num_attention_heads": 8, "num_key_value_heads": 2}),
    ("r1-kc3-prf100-interval3", {**lin(4, 4, 8, 12, 3), "prf": 1.0, "full_attention_interval": 3,
                                 "num_hidden_layers": 3}),
    ("r2-kc2-layer_types", {**lin(2, 4, 8, 8, 2), "prf": 0.25, "layer_types": ["full_attention",
                            "linear_attention", "linear_attention", "full_attention"]}),
    ("r4-kc3-prf25-bias", {**lin(1, 4, 12, 12, 3), "prf": 0.25, "attention_bias": True}),
]


def make_config(model_type, overrides):
    cfg = {**BASE, **{k: v for k, v in overrides.items() if k != "prf"}}
    prf = overrides["prf"]
    if model_type == "qwen3_next":
        cfg.update(MOE, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                   partial_rotary_factor=prf, rope_parameters=rope(prf))
    else:
        half = int(cfg["head_dim"] * prf) // 2
        sections = [half - 2 * (half // 3), half // 3, half // 3]
        cfg.update(rope_parameters=rope(prf, 1e7, sections))
        if model_type == "qwen3_5_moe_text":
            cfg.update(MOE)
            cfg.pop("intermediate_size")
    if "layer_types" in cfg:
        cfg.pop("full_attention_interval")
    return cfg


CASES = [(t, name, make_config(t, o)) for t in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
         for name, o in VARIANTS]
LENGTHS = (63, 64, 65, 130)  # each case runs T = 1 and two of these, in rotation: every architecture sees all
# one extra Qwen3-Next config with a dense layer (mlp_only_layers) and no renormalisation
CASES.append(("qwen3_next", "mlp-only-no-norm-topk", {**make_config("qwen3_next", VARIANTS[1][1]),
                                                      "mlp_only_layers": [1], "norm_topk_prob": False}))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return checkpoint_builder(tmp_path_factory, logit_scale=0.1)


def _err(a, b):
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


@pytest.mark.parametrize("model_type,name,cfg", CASES, ids=[f"{t}-{n}" for t, n, _ in CASES])
def test_logits_match_transformers(model_type, name, cfg, checkpoints):
    hf, hf64, directory = checkpoints(model_type, name, cfg)
    m32, m64 = refimpl.load(directory), refimpl.load(directory, dtype="float64")
    rng = np.random.default_rng(7)
    errors = {}
    k = [n for n, _ in VARIANTS].index(name) if name in dict(VARIANTS) else 0
    for T in (1, LENGTHS[k % 4], LENGTHS[(k + 1) % 4]):
        ids = rng.integers(0, cfg["vocab_size"], size=(1, T))
        e32, e64 = _err(m32.forward(ids), hf_logits(hf, ids)), _err(m64.forward(ids), hf_logits(hf64, ids))
        errors[T] = (e32, e64)
        assert e32 <= 1e-4, f"T={T}: float32 max abs error {e32:.3g}"
        assert e64 <= 1e-10, f"T={T}: float64 max abs error {e64:.3g}"
    ids, mask, positions = left_padded(rng, cfg["vocab_size"], 70, pads=6)
    valid = mask.astype(bool)
    e32 = _err(m32.forward(ids, attention_mask=mask)[valid], hf_logits(hf, ids, mask, positions)[valid])
    e64 = _err(m64.forward(ids, attention_mask=mask)[valid], hf_logits(hf64, ids, mask, positions)[valid])
    errors["pad"] = (e32, e64)
    assert e32 <= 1e-4, f"left-padded batch: float32 max abs error {e32:.3g}"
    assert e64 <= 1e-10, f"left-padded batch: float64 max abs error {e64:.3g}"
    print(f"{model_type}-{name}: max abs err (f32, f64) by T: {errors}")
