"""The model's tensors in a GGUF file, read lazily under their HF names with llama.cpp's conversion transforms
undone (names.py), and `load_gguf`: the file as (ModelConfig, tensors)."""

import logging
from pathlib import Path

import numpy as np

from ...errors import WeightsError
from ...kernels.elementary import log
from ...models.config import config_from_dict
from ...models.experts import expert_names, split_gate_up
from ...models.model import expected_tensors
from .config import config_dict, llamacpp_note, reading_notes
from .ggml_types import FLOAT_VIEWS, type_name, unreadable
from .names import BLOCK, norm_names, plain_names, regroup_qkvz, retile, untile_v_heads
from .reader import GGUFFile

_log = logging.getLogger(__name__)


class LazyTensor:
    """A model tensor read from the file only when used: dequantised, and its conversion transform undone, then.

    shape, dtype (float32: what `read` returns) and nbytes (the bytes it takes in the file) are known up front, so
    checks, sizes and `refimpl info` read no data. `read(index)` gives the tensor, or part `index` (int, slice or
    int array) of its leading axis; `partial` says whether that reads only the part (a plain dequantisation, an
    expert of a stack: rows of blocks are independent) or computes the whole tensor first (a transform that moves
    rows, such as Qwen3.5's value-head untiling). A tensor of a type that cannot be read raises WeightsError,
    naming it, when it is read.
    """

    def __init__(self, shape, compute, nbytes: int, partial: bool = False):
        """compute(index) when partial, else compute(): the float array."""
        self.shape, self.dtype, self.nbytes, self.partial = tuple(shape), np.dtype(np.float32), int(nbytes), partial
        self.ndim = len(self.shape)
        self._compute = compute

    def read(self, index=None) -> np.ndarray:
        if self.partial:
            a = np.asarray(self._compute(index), np.float32)
            return a.reshape(self.shape) if index is None else a
        a = np.asarray(self._compute(), np.float32).reshape(self.shape)
        return a if index is None else a[index]

    def __array__(self, dtype=None, copy=None):
        a = self.read()
        return a if dtype is None else a.astype(dtype, copy=False)

    def __getitem__(self, index):
        return np.asarray(self)[index] if isinstance(index, tuple) else self.read(index)


def read_gguf_tensors(g: GGUFFile, cfg, strict: bool = True) -> dict:
    """HF name -> array (or LazyTensor) for every tensor of the model, the conversion transforms undone.
    strict: a tensor of a type that cannot be read (`unreadable`) is an error now, naming it; else only when read."""
    path = g.path
    hf_shapes = expected_tensors(cfg)

    read = set()

    def need(name, shape=None):
        """The tensor's info, after checking it exists, (strict) can be read and (given `shape`) has that shape."""
        read.add(name)
        if name not in g.tensors:
            expected = f" (expected shape {list(shape)})" if shape else ""
            raise WeightsError(f"{path}: missing tensor {name!r}{expected}")
        t = g.tensors[name]
        if strict and (why := unreadable(t.ggml_type)) is not None:   # named now, not at the first forward pass
            raise WeightsError(f"{path}: tensor {name!r} has {why}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise WeightsError(f"{path}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        return t

    def lazy(shape, compute, *sources, partial=False, share=1):
        """A LazyTensor over GGUF tensors `sources` (a `share` of their bytes: one expert of a stack)."""
        return LazyTensor(shape, compute, sum(g.tensors[s].nbytes or 0 for s in sources) // share, partial)

    def src(name, index=None):
        return g.array(name, index)

    def direct(name, shape):
        """A tensor used as stored (shape checked): F32 / F16 / BF16 / F64 as a zero-copy view; a block type
        dequantised when read."""
        t = need(name, shape)
        if type_name(t.ggml_type) in FLOAT_VIEWS:
            return g.array(name)
        return lazy(shape, lambda index: src(name, index), name, partial=True)

    out = {hf: direct(gg, hf_shapes[hf]) for hf, gg in plain_names(cfg).items()}
    for hf, gg in norm_names(cfg).items():
        if cfg.zero_centered_norms:   # stored = 1 + w  ->  w = stored - 1 (exact in float32 for stored in [0.5, 2])
            out[hf] = lazy(need(gg, hf_shapes[hf]).shape,
                           lambda index, gg=gg: src(gg, index).astype(np.float32) - np.float32(1), gg, partial=True)
        else:
            out[hf] = direct(gg, hf_shapes[hf])
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}", f"blk.{i}"
        if cfg.is_moe_layer(i):
            out.update(_experts(g, cfg, p, b, need, lazy, src))
            if cfg.shared_expert_intermediate_size:
                # the converter writes [1, H] (ne {H, 1}); llama.cpp reads it as an H vector, so accept [H] too
                name, H = f"{b}.ffn_gate_inp_shexp.weight", cfg.hidden_size
                need(name, (H,) if g.tensors.get(name) and g.tensors[name].shape == (H,) else (1, H))
                out[f"{p}.mlp.shared_expert_gate.weight"] = lazy((1, H), lambda name=name: src(name), name)
        if cfg.layer_types[i] == "linear_attention":
            out.update(_linear_attention(g, cfg, f"{p}.linear_attn", b, need, lazy, src, direct))
    # nextn (MTP) blocks blk.{L}.. are recognised (config mtp_layers) and not read; anything else unread means the
    # file holds tensors this config does not use (a bias, a router, a wrong architecture): refuse it
    unread = sorted(n for n in g.tensors if n not in read and not ((m := BLOCK.match(n)) and
                                                                   int(m[1]) >= cfg.num_hidden_layers))
    if unread:
        raise WeightsError(f"{path}: {len(unread)} tensor(s) the {cfg.model_type} config does not use, e.g. "
                           f"{unread[:3]} (a config / file mismatch)")
    return out


def _experts(g, cfg, p, b, need, lazy, src) -> dict:
    """Stacked experts -> per-expert tensors (Qwen3-MoE, Qwen3-Next checkpoints) or the fused gate_up_proj /
    down_proj (Qwen3.5-MoE checkpoints), each expert read on its own. A fused ffn_gate_up_exps is accepted too."""
    E, Ie, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    fused, gate, up = (f"{b}.ffn_gate_up_exps.weight", f"{b}.ffn_gate_exps.weight", f"{b}.ffn_up_exps.weight")
    down = f"{b}.ffn_down_exps.weight"
    need(down, (E, H, Ie))
    if fused in g.tensors:
        need(fused, (E, 2 * Ie, H))
        sources = (fused,)
        gate_up = lambda e=None: src(fused, e)
    else:
        need(gate, (E, Ie, H)), need(up, (E, Ie, H))
        sources = (gate, up)
        gate_up = lambda e=None: np.concatenate([src(gate, e), src(up, e)], axis=-2)
    out = {}
    if cfg.fused_expert_checkpoint:
        out[f"{p}.mlp.experts.gate_up_proj"] = lazy((E, 2 * Ie, H), gate_up, *sources, partial=True)
        out[f"{p}.mlp.experts.down_proj"] = lazy((E, H, Ie), lambda e=None: src(down, e), down, partial=True)
        return out
    for e in range(E):
        hf_gate, hf_up, hf_down = expert_names(f"{p}.mlp.experts", e)
        if fused in g.tensors:
            out[hf_gate] = lazy((Ie, H), lambda e=e: split_gate_up(gate_up(e))[0], fused, share=2 * E)
            out[hf_up] = lazy((Ie, H), lambda e=e: split_gate_up(gate_up(e))[1], fused, share=2 * E)
        else:
            out[hf_gate] = lazy((Ie, H), lambda e=e: src(gate, e), gate, share=E)
            out[hf_up] = lazy((Ie, H), lambda e=e: src(up, e), up, share=E)
        out[hf_down] = lazy((H, Ie), lambda e=e: src(down, e), down, share=E)
    return out


def _linear_attention(g, cfg, p, b, need, lazy, src, direct) -> dict:
    H, Hk, Hv, Dk, Dv, Kc = (cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                             cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim)
    r, key_dim, value_dim, conv_dim = Hv // Hk, Hk * Dk, Hv * Dv, cfg.conv_dim
    tiled = not cfg.fused_linear_projections and Hk != Hv     # Qwen3.5's value-head reorder (models.md §7.3)

    def untile(a, axis, d, start=0):
        return retile(untile_v_heads, a, axis, d, start, Hk, r) if tiled else a

    for name, shape in (("ssm_a", (Hv,)), ("ssm_dt.bias", (Hv,)), ("ssm_conv1d.weight", (conv_dim, Kc)),
                        ("ssm_out.weight", (H, value_dim))):
        need(f"{b}.{name}", shape)
    a, dt, conv, out_proj = (f"{b}.{n}" for n in ("ssm_a", "ssm_dt.bias", "ssm_conv1d.weight", "ssm_out.weight"))
    out = {
        # ssm_a = -exp(A_log)  ->  A_log = ln(-ssm_a), in float64 then rounded
        f"{p}.A_log": lazy((Hv,), lambda: untile(log(-src(a).astype(np.float32)), 0, 1), a),
        f"{p}.dt_bias": lazy((Hv,), lambda: untile(src(dt), 0, 1), dt),
        f"{p}.conv1d.weight": lazy((conv_dim, 1, Kc), lambda: untile(src(conv), 0, Dv, 2 * key_dim)[:, None, :], conv),
        f"{p}.norm.weight": direct(f"{b}.ssm_norm.weight", (Dv,)),
        # the value heads are columns here: rows stay independent
        f"{p}.out_proj.weight": lazy((H, value_dim), lambda index: untile(src(out_proj, index), -1, Dv), out_proj,
                                     partial=True),
    }
    if cfg.fused_linear_projections:
        if f"{b}.ssm_in.weight" in g.tensors:          # older files: the unsplit, still grouped in_proj_qkvz
            out[f"{p}.in_proj_qkvz.weight"] = direct(f"{b}.ssm_in.weight", (2 * key_dim + 2 * value_dim, H))
        else:
            qkv, z = f"{b}.attn_qkv.weight", f"{b}.attn_gate.weight"
            need(qkv, (conv_dim, H)), need(z, (value_dim, H))
            out[f"{p}.in_proj_qkvz.weight"] = lazy((2 * key_dim + 2 * value_dim, H), lambda: regroup_qkvz(
                src(qkv), src(z), Hk, Dk, r * Dv), qkv, z)
        out[f"{p}.in_proj_ba.weight"] = direct(f"{b}.ssm_ba.weight", (2 * Hv, H))
        return out
    for name, shape in (("attn_qkv.weight", (conv_dim, H)), ("attn_gate.weight", (value_dim, H)),
                        ("ssm_beta.weight", (Hv, H)), ("ssm_alpha.weight", (Hv, H))):
        need(f"{b}.{name}", shape)
    for hf, gg, d, start in (("in_proj_qkv", "attn_qkv", Dv, 2 * key_dim), ("in_proj_z", "attn_gate", Dv, 0),
                             ("in_proj_b", "ssm_beta", 1, 0), ("in_proj_a", "ssm_alpha", 1, 0)):
        name = f"{b}.{gg}.weight"
        out[f"{p}.{hf}.weight"] = lazy(g.tensors[name].shape, lambda name=name, d=d, start=start: untile(
            src(name), 0, d, start), name)
    return out


def load_gguf(path: str | Path, strict: bool = True):
    """(ModelConfig, HF name -> array or LazyTensor) of a .gguf file, with llama.cpp's semantics (a one-line note,
    logged as a warning, says where they differ from transformers'). strict: a tensor of a type that cannot be
    read is an error now (default), else only when it is read (`refimpl info` lists such files)."""
    g = GGUFFile(path)
    cfg = config_from_dict(config_dict(g), source=str(g.path), semantics="llama.cpp")
    arrays = read_gguf_tensors(g, cfg, strict)
    if (note := llamacpp_note(cfg, reading_notes(g))) is not None:
        _log.warning(note)
    return cfg, arrays
