"""The model: a config, its weights, and the forward pass over a per-layer cache."""

import dataclasses
import warnings

import numpy as np

from ..encodings import read_activation_encodings
from ..errors import InputError
from ..graph import Node, Point, declare, merge, module_taps, modules
from ..kernels import products
from ..kernels.attention import causal_mask
from ..kernels.rope import inv_freq_and_scaling, mrope_tables, rope_tables
from ..precision import FLOAT_WEIGHTS, Policy, check_encodings, policy, rounder, weight_transform
from ..progress import layer_progress
from ..trace import tap
from . import hybrid, qwen3
from .cache import Cache
from .config import ModelConfig
from .onnx_placement import Placement, place_onnx, stored_weights
from .quantisers import NONE as NO_QUANTISERS
from .quantisers import EncodingsWarning, Quantisers, device_ops, place
from .weights import Weights


@dataclasses.dataclass
class Context:
    """What every layer of one forward call shares."""
    cos: np.ndarray               # [B, T, rot/2]
    sin: np.ndarray               # [B, T, rot/2]
    masks: dict                   # layer type -> additive mask [B|1, 1, T, P+T] (attention) or None
    cache: Cache | None
    linear_mask: np.ndarray | None  # [B, T] 0/1 for linear-attention layers, None when nothing is padded
    mask_floor: float | None = None  # device graphs clamp the additive mask from below (-50, -100, -1000)
    k_prescale: bool = False         # scores as q . (k / sqrt(D)) instead of (q . k) / sqrt(D), as some graphs do
    precision: Policy = Policy()     # set by Model.run from the model's policy
    quant: Quantisers = NO_QUANTISERS  # AIMET activation quantisers, set by Model.run from the model's encodings

    def round(self, x: np.ndarray) -> np.ndarray:
        """An activation cast point (refimpl/precision.py): the identity in float32 / float64."""
        return self.precision.round(x)


def architecture(cfg: ModelConfig):
    """The module of cfg's blocks: qwen3 (Qwen3, Qwen3-MoE) or hybrid (Qwen3-Next, Qwen3.5). Each has
    expected_tensors(cfg), mixer(cfg, i) and layer_nodes(cfg, i)."""
    return hybrid if cfg.is_hybrid else qwen3


def expected_tensors(cfg: ModelConfig) -> dict:
    """Checkpoint name -> shape of every tensor cfg's forward reads."""
    return architecture(cfg).expected_tensors(cfg)


def graph(cfg: ModelConfig) -> dict[str, Node]:
    """Every tap of cfg's forward -> its Node (refimpl/graph.py), in execution order: `Model._layers`' own taps
    declared here, each block's beside its code (qwen3.py, hybrid.py)."""
    last = cfg.num_hidden_layers - 1
    head = "logits = x E^T (tied)" if cfg.tie_word_embeddings else "logits = x W_lm^T"
    return merge(
        declare({"model.embed_tokens": Node("embedding", "x[b, t] = E[input_ids[b, t]]", ("input_ids",),
                                            shape="[B, T, H]", module=0, points=(
                                                Point("", ("Gather",), ("weight:model.embed_tokens.weight",
                                                                        "input:input_ids")),))}),
        *(architecture(cfg).layer_nodes(cfg, i) for i in range(cfg.num_hidden_layers)),
        declare({"model.norm": Node("rms_norm", qwen3.norm_formula(cfg), (f"model.layers.{last}",), shape="[B, T, H]",
                                    module=1, points=qwen3.norm_points(cfg, f"model.layers.{last}",
                                                                       "model.norm.weight")),
                 "lm_head": Node("linear", head, ("model.norm",), shape="[B, T, V]", module=1,
                                 points=qwen3.linear_points("model.norm", "lm_head.weight"))}))


class Model:
    def __init__(self, config: ModelConfig, weights: Weights, precision: Policy | None = None,
                 placement: Placement | None = None):
        self.config = config
        self.weights = weights
        self.generation_config: dict = {}          # a checkpoint's generation_config.json (refimpl.generate)
        self.dtype = weights.dtype                  # the container dtype: float64 (oracle) or float32
        self.precision = precision or policy(weights.dtype.name)
        if self.precision.fast:
            weights.float64_copies = False  # plain BLAS products use the float32 weights as they are
        names = expected_tensors(config)
        weights.check(names)
        self._mixers = [architecture(config).mixer(config, i) for i in range(config.num_hidden_layers)]
        # what each layer reads (its experts aside: those the router picks), read ahead one layer early
        self._layer_tensors = [[n for n in names if n.startswith(f"model.layers.{i}.") and ".experts." not in n]
                               for i in range(config.num_hidden_layers)] + [["lm_head.weight", "model.norm.weight"]]
        nodes = graph(config)
        self.modules = modules(nodes)            # AIMET-quantisable modules -> their input taps
        self.quantisers = NO_QUANTISERS
        # a device graph's quantisers act on ONNX Runtime's float32 values: its sums and logistic, in its order
        self._onnxruntime = placement is not None
        if placement is not None:                # a device graph's quantisers (onnx_placement), placed
            if placement.unplaced:
                warnings.warn(placement.summary() + "; they stay float", EncodingsWarning, stacklevel=2)
            taps = module_taps(nodes)                # a module computes its output as the module (the router: mlp.gate)
            module_of = {tap: module for module, tap in taps.items()}
            arithmetic = self.precision.device_arithmetic   # ops the device computes on codes (else the CPU EP's)
            self.quantisers = Quantisers(outputs={module_of.get(n, n): e for n, e in placement.outputs().items()},
                                         points=placement.points(), rnd=rounder(self.precision.activations),
                                         taps=taps, placement=placement, forms=placement.forms,
                                         arithmetic=arithmetic,
                                         ops=arithmetic and device_ops(nodes, arithmetic, placement.forms),
                                         moved_by=placement.moved_by,
                                         weight=lambda n: (self.weights[n], (placement.weights.get(n) or (None,))[-1]))
        elif self.precision.device_graph:
            raise InputError(f"{self.precision.encodings}: a device graph's encodings are placed when the model is "
                             f"loaded (refimpl.load, Model.from_arrays(device=...))")
        elif self.precision.encodings is not None:
            self.quantisers = place(read_activation_encodings(self.precision.encodings), self.modules,
                                    rounder(self.precision.activations), self.precision.strict_encodings,
                                    self.precision.encodings, taps=module_taps(nodes))
        # integer weights: a tied lm_head is a MatMul the device quantises on its own, while the embedding table
        # it shares stays a float gather; so it reads the embedding under its own name, "lm_head.weight"
        self._own_lm_head = config.tie_word_embeddings and self.precision.weight_format not in FLOAT_WEIGHTS
        if self._own_lm_head:
            weights.alias("lm_head.weight", "model.embed_tokens.weight")
        check_encodings(self.precision, [*weights.stored, *weights.aliases],
                        getattr(weights.transform, "encodings", None))
        weights.plan()   # a resident budget too small for the largest piece fails here, not mid-forward

    @classmethod
    def from_arrays(cls, config: ModelConfig, arrays: dict, source: str, p: Policy,
                    max_resident_bytes: int | None = None, origins: dict | None = None,
                    device: tuple | None = None) -> "Model":
        """A model over checkpoint arrays at precision policy p (its weight emulation applied when a tensor is
        converted), holding at most max_resident_bytes of converted weights (default: refimpl.models.weights).
        device: (OnnxGraph, {tensor: Encoding}) of a quantised device graph (refimpl.formats.device_encodings),
        its quantisers placed on this model's graph, weights included (refimpl/models/onnx_placement.py)."""
        placement = None
        if device is not None:
            names = set(expected_tensors(config)) | {"lm_head.weight"}
            placement = place_onnx(*device, graph(config), names, p.strict_encodings, str(p.encodings))
        encodings = placement and stored_weights(placement.weights, arrays)
        return cls(config, Weights(arrays, dtype=p.dtype, source=source, transform=weight_transform(p, encodings),
                                   max_resident_bytes=max_resident_bytes, origins=origins), precision=p,
                   placement=placement)

    def new_cache(self, batch_size: int = 1) -> Cache:
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
        room = 0 if self.precision.fast else max(0, self.weights.float64_room())   # (Cache.operands)
        return Cache(self.config.num_hidden_layers, batch_size, float64_mirror=room)

    def forward(self, input_ids, *, cache: Cache | None = None, attention_mask=None, position_ids=None,
                logits_to_keep: int = 0) -> np.ndarray:
        """input_ids int [B, T] (or [T]) -> logits [B, T, V] in the model dtype.

        cache: continues its positions and is updated in place.
        attention_mask: 0/1, [B, T] for the new tokens or [B, P+T] including the past; left padding allowed.
        position_ids: [B, T]; by default cumsum(mask) - 1 over past and new tokens (pads clipped to 0), so a
        padded row's valid outputs equal the same row run unpadded.
        Linear-attention layers run each padded row on its real tokens only: pads are identities on the conv
        and recurrent state wherever they sit (device semantics). transformers instead zeroes pad inputs, which
        is the same for left padding of a fresh sequence but, for pads after real tokens (right padding, a
        left-padded continuation chunk), still decays the state and shifts zeros into the conv window.
        Dynamic-NTK RoPE: the longest sequence seen is kept in the cache (transformers keeps it in its rotary
        module across calls); a call without a cache starts from the checkpoint's frequencies.
        logits_to_keep: compute logits for the last N positions only (0 = all).
        """
        cfg = self.config
        ids = self._check_ids(input_ids)
        B, T = ids.shape
        if cache is not None and cache.batch_size != B:
            raise InputError(f"cache holds batch size {cache.batch_size}, input_ids has {B} rows")
        past = cache.mask if cache is not None else np.ones((B, 0), np.int64)
        P = past.shape[1]
        full_mask = self._full_mask(attention_mask, past, B, T)             # [B, P+T]
        if position_ids is None:
            positions = np.maximum(np.cumsum(full_mask, axis=1) - 1, 0)[:, P:]
        else:
            positions = np.asarray(position_ids)
            if positions.ndim == 1:
                positions = positions[None]
            if not np.issubdtype(positions.dtype, np.integer) or positions.shape not in ((B, T), (1, T)) \
                    or (positions < 0).any():
                raise InputError(f"position_ids must be non-negative integers of shape [{B}, {T}] (or [1, {T}]), "
                                 f"got {positions.dtype} {list(positions.shape)}")
            positions = np.broadcast_to(positions.astype(np.int64), (B, T))
        with products.plain_blas(self.precision.fast):
            cos, sin = self.rope(positions, cache)
        padded = not full_mask.all()
        masks = {kind: causal_mask(T, P + T, offset=P, key_valid=full_mask if padded else None,
                                      sliding_window=cfg.sliding_window if kind == "sliding_attention" else None,
                                      dtype=self.dtype.type)
                 for kind in set(cfg.layer_types) - {"linear_attention"}}
        linear_mask = full_mask[:, P:] if padded and T > 1 else None
        logits = self.run(ids, Context(cos, sin, masks, cache, linear_mask), logits_to_keep)
        if cache is not None:
            cache.mask = full_mask
        return logits

    __call__ = forward

    def run(self, ids: np.ndarray, ctx: Context, logits_to_keep: int = 0) -> np.ndarray:
        """The layers over checked ids [B, T] with a prepared context (positions' cos/sin, masks, cache):
        what `forward` runs, and what a device convention runs on the inputs its graph receives. NaN / Inf (from
        weights that hold them: a NonFiniteWeightWarning names each such tensor) propagate as IEEE arithmetic says,
        without NumPy's warnings at every op they reach."""
        with products.plain_blas(self.precision.fast), products.onnxruntime_cpu(self._onnxruntime), \
                np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            return self._layers(ids, ctx, logits_to_keep)

    def _layers(self, ids: np.ndarray, ctx: Context, logits_to_keep: int) -> np.ndarray:
        cfg, w = self.config, self.weights
        ctx.precision, ctx.quant = self.precision, self.quantisers
        x = w.rows("model.embed_tokens.weight", ids)                        # [B, T, H]: the looked-up rows
        x = tap("model.embed_tokens", None, ctx.quant.output("model.embed_tokens", x))
        w.prefetch(self._layer_tensors[0])
        with layer_progress("forward", len(self._mixers)) as advance:
            for i, mixer in enumerate(self._mixers):
                w.prefetch(self._layer_tensors[i + 1])      # streamed weights: the disk reads the next layer now
                x = qwen3.decoder_layer(w, i, x, cfg, ctx, mixer)
                advance()
        x = qwen3.norm(w, "model.norm", x, cfg, ctx)
        x = tap("model.norm", None, x)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        lm_head = "model.embed_tokens.weight" if cfg.tie_word_embeddings and not self._own_lm_head \
            else "lm_head.weight"
        return tap("lm_head", None, qwen3.project(w, "lm_head", x, ctx, weight=lm_head))   # [B, T, V]

    def _check_ids(self, input_ids) -> np.ndarray:
        ids = np.asarray(input_ids)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or 0 in ids.shape or not np.issubdtype(ids.dtype, np.integer):
            raise InputError(f"input_ids must be a non-empty integer array [B, T], got {ids.dtype} {list(ids.shape)}")
        bad = (ids < 0) | (ids >= self.config.vocab_size)
        if bad.any():
            b, t = map(int, np.argwhere(bad)[0])
            raise InputError(f"input_ids[{b}, {t}] = {int(ids[b, t])} is outside the vocabulary "
                             f"[0, {self.config.vocab_size})")
        return ids.astype(np.int64, copy=False)

    @staticmethod
    def _full_mask(attention_mask, past: np.ndarray, B: int, T: int) -> np.ndarray:
        P = past.shape[1]
        if attention_mask is None:
            return np.concatenate([past, np.ones((B, T), np.int64)], axis=1)
        m = np.asarray(attention_mask)
        if m.ndim == 1:
            m = m[None]
        if m.shape == (B, P + T) and P:
            if not np.array_equal(m[:, :P] != 0, past != 0):
                raise InputError("attention_mask disagrees with the cache about which past positions are real")
            return (m != 0).astype(np.int64)
        if m.shape != (B, T):
            expected = f"[{B}, {T}]" + (f" or [{B}, {P + T}]" if P else "")
            raise InputError(f"attention_mask has shape {list(m.shape)}, expected {expected}")
        return np.concatenate([past, (m != 0).astype(np.int64)], axis=1)

    def rope(self, positions: np.ndarray, cache: Cache | None):
        """cos/sin [B, T, rot/2] for these positions. Dynamic NTK RoPE recomputes its frequencies when the
        sequence outgrows every length seen so far (kept in the cache), as transformers does."""
        cfg = self.config
        seq_len = int(positions.max()) + 1
        rope_len = seq_len
        if cfg.rope.get("rope_type") == "dynamic":
            seen = (cache.rope_max_seq_len if cache is not None else None) or cfg.max_position_embeddings
            if seq_len > seen:
                seen = seq_len
            elif seq_len < cfg.max_position_embeddings < seen:
                seen = cfg.max_position_embeddings
            if cache is not None:
                cache.rope_max_seq_len = seen
            rope_len = seen
        inv_freq, scaling = inv_freq_and_scaling(cfg.rope, cfg.rotary_dim, cfg.max_position_embeddings,
                                                 seq_len=rope_len, dtype=self.dtype.type)
        if cfg.mrope_section is not None:
            # Qwen3.5's interleaved M-RoPE: text gives the temporal, height and width axes its position (exactly
            # 1-D RoPE under transformers' rule) and llama.cpp's fourth axis position 0 (cfg.mrope_pair_axes)
            thwe = np.stack([positions] * 3 + [np.zeros_like(positions)])
            return mrope_tables(thwe, inv_freq, cfg.mrope_pair_axes, scaling)
        return rope_tables(positions, inv_freq, scaling)
