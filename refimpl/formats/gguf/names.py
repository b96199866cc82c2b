"""llama.cpp's names of the HF tensors and the layout transforms between the two, both ways.

The transforms llama.cpp's convert_hf_to_gguf.py applies (models.md §7), HF -> GGUF:
  zero-centred norms (Next / 3.5: input/post-attention, model.norm, q_norm, k_norm):  stored = 1 + w
  linear_attn.A_log -> ssm_a = -exp(A_log);  dt_bias -> ssm_dt.bias;  conv1d [C, 1, Kc] -> [C, Kc]
  Qwen3-Next in_proj_qkvz (grouped per key head [q | k | v | z]) -> attn_qkv [all q | all k | all v] + attn_gate
  Qwen3.5 (Hk != Hv): value heads grouped h = kh*r + j -> tiled h' = j*Hk + kh, on the v rows of in_proj_qkv,
    in_proj_z, in_proj_b/a, A_log, dt_bias, the v channels of conv1d and the columns of out_proj
  MoE experts stacked: ffn_{gate,up,down}_exps [E, ...]; Qwen3.5-MoE's fused gate_up_proj split into gate | up
The writer (writer.py) applies each; the reader (tensors.py) undoes each (w = stored - 1, A_log = ln(-ssm_a),
...), so the model sees the HF arrays. Here: the name tables and the array transforms both use.
"""

import re

import numpy as np

BLOCK = re.compile(r"blk\.(\d+)\.")   # a tensor of GGUF block i: blk.{i}.*


def plain_names(cfg) -> dict:
    """HF name -> GGUF name of every tensor stored without a value transform (beyond a possible reshape)."""
    m = {"model.embed_tokens.weight": "token_embd.weight"}
    if not cfg.tie_word_embeddings:
        m["lm_head.weight"] = "output.weight"
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}", f"blk.{i}"
        if cfg.layer_types[i] != "linear_attention":
            for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                           ("o_proj", "attn_output")):
                m[f"{p}.self_attn.{hf}.weight"] = f"{b}.{gg}.weight"
                if cfg.attention_bias:
                    m[f"{p}.self_attn.{hf}.bias"] = f"{b}.{gg}.bias"
        if not cfg.is_moe_layer(i):
            for proj in ("gate", "up", "down"):
                m[f"{p}.mlp.{proj}_proj.weight"] = f"{b}.ffn_{proj}.weight"
        else:
            m[f"{p}.mlp.gate.weight"] = f"{b}.ffn_gate_inp.weight"
            if cfg.shared_expert_intermediate_size:
                for proj in ("gate", "up", "down"):
                    m[f"{p}.mlp.shared_expert.{proj}_proj.weight"] = f"{b}.ffn_{proj}_shexp.weight"
    return m


def norm_names(cfg) -> dict:
    """HF name -> GGUF name of the RMSNorm weights (stored as 1 + w for the zero-centred-norm models)."""
    m = {"model.norm.weight": "output_norm.weight"}
    post = "post_attention_norm" if cfg.is_hybrid else "ffn_norm"
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}", f"blk.{i}"
        m[f"{p}.input_layernorm.weight"] = f"{b}.attn_norm.weight"
        m[f"{p}.post_attention_layernorm.weight"] = f"{b}.{post}.weight"
        if cfg.layer_types[i] != "linear_attention":
            m[f"{p}.self_attn.q_norm.weight"] = f"{b}.attn_q_norm.weight"
            m[f"{p}.self_attn.k_norm.weight"] = f"{b}.attn_k_norm.weight"
    return m


def untile_v_heads(a: np.ndarray, axis: int, Hk: int, r: int, d: int) -> np.ndarray:
    """GGUF tiled value-head order (h' = j*Hk + kh) -> HF grouped order (h = kh*r + j) along `axis`
    (length r*Hk*d): view it as [r, Hk, d], swap to [Hk, r, d], flatten."""
    a = np.moveaxis(a, axis, 0)
    rest = a.shape[1:]
    a = a.reshape(r, Hk, d, *rest).swapaxes(0, 1).reshape(r * Hk * d, *rest)
    return np.moveaxis(a, 0, axis)


def tile_v_heads(a: np.ndarray, axis: int, Hk: int, r: int, d: int) -> np.ndarray:
    """HF grouped value-head order -> GGUF tiled order: view the axis as [Hk, r, d], swap to [r, Hk, d]."""
    return untile_v_heads(a, axis, r, Hk, d)


def retile(fn, a, axis, d, start, Hk, r):
    """fn (tile_v_heads when writing, untile_v_heads when reading) on the part of `axis` from `start` on (the v
    rows / channels of a q|k|v tensor), in a float32 copy."""
    a = np.array(a, dtype=np.float32)
    idx = [slice(None)] * a.ndim
    idx[axis] = slice(start, None)
    a[tuple(idx)] = fn(a[tuple(idx)], axis, Hk, r, d)
    return a


def regroup_qkvz(qkv: np.ndarray, z: np.ndarray, Hk: int, Dk: int, rDv: int) -> np.ndarray:
    """Qwen3-Next: attn_qkv [all q (Hk*Dk) | all k | all v (Hk*rDv)] rows + attn_gate [Hk*rDv] rows -> HF's
    in_proj_qkvz, grouped per key head kh as [q_kh (Dk) | k_kh (Dk) | v_kh (rDv) | z_kh (rDv)]."""
    H = qkv.shape[-1]
    kd = Hk * Dk
    q, k, v = qkv[:kd].reshape(Hk, Dk, H), qkv[kd:2 * kd].reshape(Hk, Dk, H), qkv[2 * kd:].reshape(Hk, rDv, H)
    return np.concatenate([q, k, v, z.reshape(Hk, rDv, H)], axis=1).reshape(-1, H)


def split_qkvz(qkvz: np.ndarray, Hk: int, Dk: int, rDv: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of regroup_qkvz: HF in_proj_qkvz -> (attn_qkv, attn_gate), as llama.cpp's converter splits it."""
    H = qkvz.shape[-1]
    g = qkvz.reshape(Hk, 2 * Dk + 2 * rDv, H)
    q, k, v, z = np.split(g, [Dk, 2 * Dk, 2 * Dk + rDv], axis=1)
    return np.concatenate([q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)]), z.reshape(-1, H)
