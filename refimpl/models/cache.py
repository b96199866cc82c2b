"""Per-layer decoding state.

full / sliding attention layers: keys (after q/k norm and RoPE) and values, [B, Hkv, P, D], appended along P.
linear attention layers: the conv state [B, conv_dim, Kc] (the last Kc pre-conv inputs, as transformers keeps
it) and the recurrent state [B, Hv, Dk, Dv] (float32, or float64 in the oracle mode).
The cache also remembers which past positions were real tokens (`mask`, for left padding) and, for dynamic
RoPE, the longest sequence seen so far (transformers keeps that in the rotary module).
"""

import dataclasses

import numpy as np


@dataclasses.dataclass
class KVCache:
    keys: np.ndarray      # [B, Hkv, P, D]
    values: np.ndarray    # [B, Hkv, P, D]


@dataclasses.dataclass
class LinearAttentionState:
    conv: np.ndarray       # [B, conv_dim, Kc]
    recurrent: np.ndarray  # [B, Hv, Dk, Dv]


class Cache:
    def __init__(self, num_layers: int, batch_size: int):
        self.batch_size = batch_size
        self.layers: list[KVCache | LinearAttentionState | None] = [None] * num_layers
        self.mask = np.ones((batch_size, 0), dtype=np.int64)  # [B, P]: 1 where a past position is a real token
        self.rope_max_seq_len: int | None = None

    @property
    def seq_length(self) -> int:
        return self.mask.shape[1]

    def append_kv(self, layer: int, keys: np.ndarray, values: np.ndarray):
        """Append new keys/values [B, Hkv, T, D]; return the full [B, Hkv, P+T, D] pair."""
        old = self.layers[layer]
        if old is not None:
            keys = np.concatenate([old.keys, keys], axis=2)
            values = np.concatenate([old.values, values], axis=2)
        self.layers[layer] = KVCache(keys, values)
        return keys, values
