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
    """Keys/values [B, Hkv, P, D] in buffers with room to grow along P: an append writes only the new
    positions instead of copying the whole past (which costs O(P) per decode step)."""
    key_buffer: np.ndarray     # [B, Hkv, capacity, D]
    value_buffer: np.ndarray   # [B, Hkv, capacity, D]
    length: int                # P

    @property
    def keys(self) -> np.ndarray:      # [B, Hkv, P, D], a view
        return self.key_buffer[:, :, :self.length]

    @property
    def values(self) -> np.ndarray:    # [B, Hkv, P, D], a view
        return self.value_buffer[:, :, :self.length]


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
        """Append new keys/values [B, Hkv, T, D]; return the full [B, Hkv, P+T, D] pair (views of the cache).
        Capacity doubles when full, so each position is copied O(1) times overall."""
        kv = self.layers[layer]
        P, T = (kv.length if kv is not None else 0), keys.shape[2]
        if kv is None or P + T > kv.key_buffer.shape[2]:
            capacity = max(2 * (P + T), 256)
            grown = KVCache(np.empty((*keys.shape[:2], capacity, keys.shape[3]), keys.dtype),
                            np.empty((*values.shape[:2], capacity, values.shape[3]), values.dtype), P)
            if kv is not None:
                grown.key_buffer[:, :, :P], grown.value_buffer[:, :, :P] = kv.keys, kv.values
            kv = self.layers[layer] = grown
        kv.key_buffer[:, :, P:P + T] = keys
        kv.value_buffer[:, :, P:P + T] = values
        kv.length = P + T
        return kv.keys, kv.values

    def select(self, rows) -> "Cache":
        """Keep only the batch rows `rows` (in that order), in place: how a batch drops the sequences that have
        finished generating. Returns self."""
        rows = np.asarray(rows, dtype=np.int64)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, KVCache):
                self.layers[i] = KVCache(layer.key_buffer[rows], layer.value_buffer[rows], layer.length)
            elif isinstance(layer, LinearAttentionState):
                self.layers[i] = LinearAttentionState(layer.conv[rows], layer.recurrent[rows])
        self.mask = self.mask[rows]
        self.batch_size = len(rows)
        return self
