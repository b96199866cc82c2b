"""Per-layer decoding state.

full / sliding attention layers: keys (after q/k norm and RoPE) and values, [B, Hkv, P, D], appended along P.
linear attention layers: the conv state [B, conv_dim, Kc] (the last Kc pre-conv inputs, as transformers keeps
it) and the recurrent state [B, Hv, Dk, Dv] (float32, or float64 in the oracle mode).
The cache also remembers which past positions were real tokens (`mask`, for left padding) and, for dynamic
RoPE, the longest sequence seen so far (transformers keeps that in the rotary module).
"""

import dataclasses

import numpy as np

from ..kernels import products


@dataclasses.dataclass
class KVCache:
    """Keys/values [B, Hkv, P, D] in buffers with room to grow along P: an append writes only the new
    positions instead of copying the whole past (which costs O(P) per decode step)."""
    key_buffer: np.ndarray     # [B, Hkv, capacity, D]
    value_buffer: np.ndarray   # [B, Hkv, capacity, D]
    length: int                # P
    float64: "Float64Mirror | None" = None   # float64 copies and norms for correctly rounded attention

    @property
    def keys(self) -> np.ndarray:      # [B, Hkv, P, D], a view
        return self.key_buffer[:, :, :self.length]

    @property
    def values(self) -> np.ndarray:    # [B, Hkv, P, D], a view
        return self.value_buffer[:, :, :self.length]


@dataclasses.dataclass
class Float64Mirror:
    """What attention's correctly rounded products reuse from a float32 cache (kernels/products.py, step 2): the
    keys and values in float64 and their error-bound norms, kept as positions are appended instead of computed
    again over the whole past at every decode step. Twice the cache's float32 bytes."""
    keys: np.ndarray           # [B, Hkv, capacity, D] float64
    values: np.ndarray         # [B, Hkv, capacity, Dv] float64
    key_norms: np.ndarray      # [B, Hkv, capacity]: ||k_p||_2 of each key
    value_squares: np.ndarray  # [B, Hkv, Dv]: sum_p v_pj^2 over the P positions (the value columns' norms squared)
    views: tuple = (None, None)   # the (keys, values) views the last append_kv returned: what it stands for


@dataclasses.dataclass
class LinearAttentionState:
    conv: np.ndarray       # [B, conv_dim, Kc]
    recurrent: np.ndarray  # [B, Hv, Dk, Dv]


class Cache:
    def __init__(self, num_layers: int, batch_size: int, float64_mirror: float = 0):
        """float64_mirror: bytes a Float64Mirror beside float32 keys and values may take (correctly rounded
        attention over resident weights whose float64 copies are kept: Model.new_cache gives the budget's room left
        beside them); when the mirrors would outgrow it they are dropped, and attention converts the cache again."""
        self.batch_size = batch_size
        self.float64_mirror = float64_mirror
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
            if self.float64_mirror and keys.dtype == values.dtype == np.float32 and (kv is None or kv.float64) \
                    and self._mirror_fits(layer, grown):
                grown.float64 = Float64Mirror(np.empty(grown.key_buffer.shape), np.empty(grown.value_buffer.shape),
                                              np.empty(grown.key_buffer.shape[:3]),
                                              np.zeros((*values.shape[:2], values.shape[3])))
            if kv is not None:
                grown.key_buffer[:, :, :P], grown.value_buffer[:, :, :P] = kv.keys, kv.values
                if grown.float64 is not None:
                    old, new = kv.float64, grown.float64
                    new.keys[:, :, :P], new.values[:, :, :P] = old.keys[:, :, :P], old.values[:, :, :P]
                    new.key_norms[:, :, :P], new.value_squares[...] = old.key_norms[:, :, :P], old.value_squares
            kv = self.layers[layer] = grown
        kv.key_buffer[:, :, P:P + T] = keys
        kv.value_buffer[:, :, P:P + T] = values
        if kv.float64 is not None:
            m = kv.float64
            m.keys[:, :, P:P + T], m.values[:, :, P:P + T] = keys, values                # exact
            m.key_norms[:, :, P:P + T] = np.sqrt(np.square(m.keys[:, :, P:P + T]).sum(axis=-1))
            m.value_squares += np.square(m.values[:, :, P:P + T]).sum(axis=2)
        kv.length = P + T
        views = kv.keys, kv.values
        if kv.float64 is not None:
            kv.float64.views = views
        return views

    def _mirror_fits(self, layer: int, grown: KVCache) -> bool:
        """Whether layer `layer`'s mirror may grow to the buffers of `grown` within float64_mirror (a mirror: twice
        its buffers' bytes, its norms aside); if not, every layer's mirror is dropped and none is made again."""
        mirrors = [kv for i, kv in enumerate(self.layers) if i != layer and isinstance(kv, KVCache) and kv.float64]
        if sum(2 * (kv.key_buffer.nbytes + kv.value_buffer.nbytes) for kv in [*mirrors, grown]) <= self.float64_mirror:
            return True
        self.float64_mirror = 0
        for kv in self.layers:
            if isinstance(kv, KVCache):
                kv.float64 = None
        return False

    def operands(self, layer: int, keys: np.ndarray, values: np.ndarray):
        """The operands of attention's two products over layer `layer`'s cache: keys^T [B, Hkv, 1, D, P] and values
        [B, Hkv, 1, P, Dv] as products.Constants with the float64 mirror's copies and norms where `keys` / `values`
        are the very views append_kv returned (attention reads the cache as it is), else the arrays as they are."""
        kv = self.layers[layer]
        m = kv.float64 if isinstance(kv, KVCache) else None
        if m is None or keys is not m.views[0] or values is not m.views[1]:
            return keys, values
        P = kv.length
        keys_t = products.Constant(keys[:, :, None].swapaxes(-1, -2), m.key_norms[:, :, None, None, :P],
                                   m.keys[:, :, None, :P].swapaxes(-1, -2))
        values = products.Constant(values[:, :, None], np.sqrt(m.value_squares)[:, :, None, None, :],
                                   m.values[:, :, None, :P])
        return keys_t, values

    def select(self, rows) -> "Cache":
        """Keep only the batch rows `rows` (in that order), in place: how a batch drops the sequences that have
        finished generating. Returns self."""
        rows = np.asarray(rows, dtype=np.int64)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, KVCache):
                m = layer.float64
                self.layers[i] = KVCache(layer.key_buffer[rows], layer.value_buffer[rows], layer.length, m and
                                         Float64Mirror(m.keys[rows], m.values[rows], m.key_norms[rows],
                                                       m.value_squares[rows]))
            elif isinstance(layer, LinearAttentionState):
                self.layers[i] = LinearAttentionState(layer.conv[rows], layer.recurrent[rows])
        self.mask = self.mask[rows]
        self.batch_size = len(rows)
        return self
