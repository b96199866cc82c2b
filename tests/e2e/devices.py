"""Independent devices for end-to-end tests of `refimpl diff`: implementations refimpl did not write, dumping what a
bring-up engineer can hook, in the layouts their modules produce.

- transformers (float32 eager / sdpa, bfloat16) on a preset's weights (save_preset / hf_checkpoint), driven by
  `run_hf` (the dynamic convention: transformers' own cache, prefill then one token per call) or by `run_genie`
  (a Genie host loop written here from device_conventions.md §1.3 feeding `GenieGraph`, transformers behind the
  static-shape I/O of §1.2);
- ONNX Runtime (CPU EP) running `GenieGraph` exported with torch.onnx.export, in float32 or float16 (`ort_graph`).

Every device records its taps with module forward hooks (and a few function hooks: RoPE, the causal conv, the gated
delta rule) under the names `refimpl diff --layout hf-hooks` reads (docs/diff.md): `<module path>` for a module's
output, `<module path>.<i>` for the i-th tensor of a tuple output, `<module path>.input[.<i>]` for a leaf module's
inputs, `<module path>.<function>[.<i>]` for a function called inside a module. Dumps are
`steps/<k>/{inputs,outputs,taps}/<name>.npy`.

The devices decode the golden's tokens (prompt and generated ids from the bundle's manifest), so the steps stay
aligned; each carries its own cache and state from call to call. Faults are planted with the `Fault` fields.
"""

import contextlib
import dataclasses
import json
import sys
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from refimpl.formats.safetensors import write_safetensors
from refimpl.models.config import config_from_dict
from refimpl.models.model import Model
from refimpl.precision import policy
from refimpl.presets import PRESETS, checkpoint_layout, random_weights

# functions of transformers' modeling modules a bring-up engineer hooks besides the modules (outputs recorded)
HOOKED_FUNCTIONS = ("apply_rotary_pos_emb", "eager_attention_forward", "causal_conv1d_fn", "causal_conv1d_update",
                    "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclasses.dataclass
class Fault:
    """One planted fault (all off by default). Layers / steps are indices; None = not planted."""
    scale_weight: tuple | None = None        # (parameter name, factor): a mis-converted weight
    scale_channel: tuple | None = None       # (parameter name, output channel, factor): one row of a weight off
    swap_rows: tuple | None = None           # (parameter name, row i, row j): two rows exchanged (router rows)
    shift_weight: tuple | None = None        # (parameter name, delta): a weight off by a constant (A_log + 0.1)
    interleaved_rope_layer: int | None = None    # RoPE over (2i, 2i+1) pairs in this layer's attention
    fp16_overflow_layer: int | None = None   # this layer's MLP down projection in fp16 on a 2^16-scaled input
    mask_floor: float | None = None          # genie host: clamp the mask here instead of the golden's floor
    window_shift_step: int | None = None     # genie host: at this step the KV window sits one slot too far left
    conv_state_stale_step: int | None = None  # genie graph: at this step the conv state is written back unshifted
    recurrent_not_carried_step: int | None = None  # host: at this step the recurrent state input is reset to zeros
    key_untransposed: bool = False           # genie graph: past_key_out written [Hkv, 1, T, D] into [Hkv, 1, D, T]
    module_output: tuple | None = None       # (module path, fn(output tensor) -> tensor): a kernel's wrong output


# ------------------------------------------------------------------------------------------------ models

def small_preset(preset: str, vocab: int = 2048, seed: int = 11) -> tuple[dict, dict]:
    """A preset with a small vocabulary (fast goldens and devices), its seeded weights with the output head scaled
    to logits of size ~2: (config dict, arrays)."""
    config = {**PRESETS[preset], "vocab_size": vocab, "eos_token_id": vocab - 48, "bos_token_id": vocab - 49}
    arrays = random_weights(config_from_dict(config), seed=seed)
    head = "model.embed_tokens.weight" if config["tie_word_embeddings"] else "lm_head.weight"
    arrays[head] = arrays[head] * np.float32(0.05)
    return config, arrays


def reference(config: dict, arrays: dict, precision: str | dict | None = None):
    """refimpl's model of the same weights (the golden), optionally at an emulated precision (bf16, fp16, a policy
    dict)."""
    return Model.from_arrays(config_from_dict(config), arrays, "e2e", policy(precision or "float32"))


def hf_checkpoint(config: dict, arrays: dict, directory: Path) -> Path:
    """config.json + model.safetensors in the layout the released checkpoints of the architecture use."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    write_safetensors(directory / "model.safetensors", checkpoint_layout(config_from_dict(config), arrays))
    return directory


def load_hf(directory: Path, dtype: str = "float32", attn: str = "eager", experts: str | None = None):
    """transformers' model of a checkpoint directory (preset weights written by save_preset or hf_checkpoint).
    experts: the MoE experts implementation (default transformers' choice; "batched_mm" exports to ONNX)."""
    kwargs = {"experts_implementation": experts} if experts else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=TORCH_DTYPES[dtype],
                                                              attn_implementation=attn, **kwargs)
    return model.eval()


@contextlib.contextmanager
def planted(model, fault: Fault | None):
    """The model with `fault`'s weight and function faults applied (restored afterwards)."""
    fault = fault or Fault()
    stack = contextlib.ExitStack()
    with stack:
        def edit(name, change):   # a parameter changed in place by change(value, before), restored afterwards
            p = dict(model.named_parameters())[name]
            before = p.detach().clone()
            with torch.no_grad():
                change(p, before)
            stack.callback(lambda: p.data.copy_(before))

        if fault.scale_weight:
            name, factor = fault.scale_weight
            edit(name, lambda p, _: p.mul_(factor))
        if fault.scale_channel:   # a wrong per-channel scale: one output channel (weight row) of a projection
            name, row, factor = fault.scale_channel
            edit(name, lambda p, _: p[row].mul_(factor))
        if fault.swap_rows:
            name, i, j = fault.swap_rows
            edit(name, lambda p, before: p.__setitem__([i, j], before[[j, i]]))
        if fault.shift_weight:
            name, delta = fault.shift_weight
            edit(name, lambda p, _: p.add_(delta))
        if fault.module_output is not None:
            path, fn = fault.module_output

            def wrong(module, args, out):
                return (fn(out[0]), *out[1:]) if isinstance(out, tuple) else fn(out)
            stack.enter_context(_hook(model.get_submodule(path), wrong))
        if fault.fp16_overflow_layer is not None:
            down = model.get_submodule(f"model.layers.{fault.fp16_overflow_layer}.mlp.down_proj")

            def overflow(module, args, out):
                # the device keeps a 2^16 input scale meant for int16 and multiplies in fp16: sums pass 65504
                x = (args[0] * 2.0 ** 16).to(torch.float16)
                y = torch.nn.functional.linear(x, module.weight.to(torch.float16)).to(out.dtype)
                return y / 2.0 ** 16
            stack.enter_context(_hook(down, overflow))
        yield model


@contextlib.contextmanager
def _hook(module, fn):
    handle = module.register_forward_hook(fn)
    try:
        yield
    finally:
        handle.remove()


# ------------------------------------------------------------------------------------------------ hooks

class Recorder:
    """Module and function hooks over one model: `calls()` yields a dict {hook name: tensor} per forward."""

    def __init__(self, model, fault: Fault | None = None):
        self.model, self.fault = model, fault or Fault()
        self.stack, self.taps = [], {}

    def __enter__(self):
        self.handles = []
        for name, module in self.model.named_modules():
            if not name or name == "model":
                continue
            self.handles.append(module.register_forward_pre_hook(lambda m, a, name=name: self.stack.append(name)))
            leaf = not any(True for _ in module.children())
            self.handles.append(module.register_forward_hook(
                lambda m, a, out, name=name, leaf=leaf: self._module(name, a if leaf else (), out)))
        self.patches = contextlib.ExitStack()
        modeling = sys.modules[type(self.model).__module__]
        for fn in HOOKED_FUNCTIONS:
            if hasattr(modeling, fn):
                self.patches.enter_context(mock.patch.object(modeling, fn, self._function(fn, getattr(modeling, fn))))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.patches.close()

    def take(self) -> dict:
        """The taps (torch tensors) of the forward calls since the last take()."""
        taps, self.taps = self.taps, {}
        return taps

    def _module(self, name, args, out):
        self.stack.pop()
        self._save(name, out)
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        for i, a in enumerate(tensors):
            self._save(f"{name}.input" + (f".{i}" if len(tensors) > 1 else ""), a)

    def _function(self, fn_name, fn):
        def wrapped(*args, **kwargs):
            layer = self.stack[-1] if self.stack else ""
            if fn_name == "apply_rotary_pos_emb" and self.fault.interleaved_rope_layer is not None \
                    and layer == f"model.layers.{self.fault.interleaved_rope_layer}.self_attn":
                out = _interleaved_rope(*args, **kwargs)
            else:
                out = fn(*args, **kwargs)
            tensors = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
            for i, a in enumerate(tensors):
                self._save(f"{layer}.{fn_name}.input.{i}", a)
            for key, a in kwargs.items():
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    self._save(f"{layer}.{fn_name}.{key}", a)
            self._save(f"{layer}.{fn_name}", out)
            return out
        return wrapped

    def _save(self, name, out):
        if isinstance(out, torch.Tensor):
            self.taps[name] = out.detach()
        elif isinstance(out, (tuple, list)):
            for i, o in enumerate(out):
                if isinstance(o, torch.Tensor):
                    self._save(name if i == 0 else f"{name}.{i}", o)


def _interleaved_rope(q, k, cos, sin, unsqueeze_dim=1):
    """The fault: RoPE over interleaved pairs (2i, 2i+1) (Meta / GPT-J) instead of half-split (i, i + rot/2)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rot = cos.shape[-1]
    c, s = cos[..., : rot // 2], sin[..., : rot // 2]

    def apply(x):
        even, odd = x[..., 0:rot:2], x[..., 1:rot:2]
        out = x.clone()
        out[..., 0:rot:2] = even * c - odd * s
        out[..., 1:rot:2] = odd * c + even * s
        return out
    return apply(q), apply(k)


# ------------------------------------------------------------------------------------------------ hf convention

def layer_types(cfg) -> list:
    return getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers


@dataclasses.dataclass
class Call:
    inputs: dict
    outputs: dict
    taps: dict


def _np(t) -> np.ndarray:
    return t.detach().float().numpy().copy() if t.is_floating_point() else t.detach().numpy().copy()


def _hf_state(cache, cfg, prefix: str) -> dict:
    """The cache as the dynamic convention's graph I/O (refimpl.conventions.hf names)."""
    out = {}
    for i, kind in enumerate(layer_types(cfg)):
        layer = cache.layers[i]
        if kind == "linear_attention":
            out[f"{prefix}_conv_state.{i}"] = _np(layer.conv_states[0])
            out[f"{prefix}_recurrent_state.{i}"] = _np(layer.recurrent_states[0])
        else:
            name = "past_key_values" if prefix == "past" else "present"
            out[f"{name}.{i}.key"], out[f"{name}.{i}.value"] = _np(layer.keys), _np(layer.values)
    return out


def run_hf(model, prompt: list, generated: list, fault: Fault | None = None) -> list[Call]:
    """transformers' own loop: the prompt in one call, then one token per call, its DynamicCache carried."""
    fault = fault or Fault()
    cfg = model.config
    cache = transformers.DynamicCache(config=cfg)
    calls = []
    with torch.no_grad(), planted(model, fault), Recorder(model, fault) as rec:
        for k, tokens in enumerate([prompt] + [[t] for t in generated]):
            P = cache.get_seq_length()
            if k == fault.recurrent_not_carried_step:
                for i, kind in enumerate(layer_types(cfg)):
                    if kind == "linear_attention":
                        cache.layers[i].recurrent_states[0].zero_()
            inputs = {"input_ids": np.array([tokens], np.int64),
                      "position_ids": np.arange(P, P + len(tokens), dtype=np.int64)[None]}
            if k:
                inputs.update(_hf_state(cache, cfg, "past"))
            out = model(input_ids=torch.as_tensor(inputs["input_ids"]),
                        position_ids=torch.as_tensor(inputs["position_ids"]), past_key_values=cache, use_cache=True)
            taps = {n: _np(t) for n, t in rec.take().items()}
            calls.append(Call(inputs, {"logits": _np(out.logits), **_hf_state(cache, cfg, "present")}, taps))
    return calls


# ------------------------------------------------------------------------------------------------ genie

class _TableRope(torch.nn.Module):
    """Stands in for the model's rotary embedding: the host's cos / sin inputs, widened to transformers' layout
    (the half-width table twice, as rotate_half pairs channel d with d + rot/2)."""

    def forward(self, x, position_ids):
        return self.tables()


class GenieGraph(torch.nn.Module):
    """transformers' model behind the Genie static-shape I/O (device_conventions.md §1.2): inputs
    (input_ids, attention_mask, position_ids_cos, position_ids_sin, then per layer past_key/past_value or
    conv_state/recurrent_state) -> (logits, then per layer the new KV entries or the updated states), plus the
    hooked taps when `record` is set (they become extra graph outputs in an ONNX export).

    The cache is transformers' DynamicCache filled with the host's window; a conv state of S < Kc columns is given
    leading zero columns (transformers keeps Kc and never reads the first). GDN pad slots: the chunk's
    own mask entries mark them (its diagonal), and transformers zeroes their hidden states — an identity only while
    the state is zero: pads leading the first chunk (AI Hub's left padding), or chunks without pads. Pads trailing
    the last chunk after a state (the Genie runtime's right padding) is where this device departs from the contract
    (test_independent_devices shows the diff naming it)."""

    def __init__(self, model, key_transposed: bool = True, fault: Fault | None = None):
        super().__init__()
        self.model, self.key_transposed, self.fault = model, key_transposed, fault or Fault()
        self.rope = _TableRope()
        self.step = 0
        self.recorder = None

    def forward(self, input_ids, attention_mask, cos, sin, *state):
        cfg = self.model.config
        AR, CL = input_ids.shape[1], attention_mask.shape[-1]
        W = CL - AR
        cache = transformers.DynamicCache(config=cfg)
        it = iter(state)
        for i, kind in enumerate(layer_types(cfg)):
            a, b = next(it), next(it)
            if kind == "linear_attention":
                layer = cache.layers[i]
                Kc, S = self.model.config.linear_conv_kernel_dim, a.shape[-1]
                full = torch.cat([torch.zeros_like(a[..., :1]).expand(*a.shape[:-1], Kc - S), a], dim=-1) \
                    if S < Kc else a
                layer.lazy_initialization(conv_states=full, recurrent_states=b)
                layer.conv_states[0] = full.clone()
                layer.recurrent_states[0] = b.clone()
                layer.has_previous_state[0] = True
            else:
                keys = a[:, 0].transpose(1, 2) if self.key_transposed else a[:, 0]          # [Hkv, W, D]
                cache.update(keys[None], b[:, 0][None], i)
        tables = (torch.cat([cos, cos], -1)[:, 0], torch.cat([sin, sin], -1)[:, 0])
        self.rope.tables = lambda: tables  # a callable, not a tensor attribute (torch.export warns about those)
        own, self.model.model.rotary_emb = self.model.model.rotary_emb, self.rope
        chunk = torch.diagonal(attention_mask[0, 0, :, W:]) == 0                            # real slots
        if layer_types(cfg).count("linear_attention"):
            mask = {"full_attention": attention_mask,
                    "linear_attention": None if AR == 1 else chunk[None].to(attention_mask.dtype)}
        else:
            mask = attention_mask
        positions = torch.zeros_like(input_ids, dtype=torch.int64)  # unused: RoPE comes from the tables
        try:
            logits = self.model(input_ids=input_ids.to(torch.int64), attention_mask=mask, position_ids=positions,
                                past_key_values=cache, use_cache=True).logits
        finally:
            self.model.model.rotary_emb = own
        outputs = [logits]
        it = iter(state)
        for i, kind in enumerate(layer_types(cfg)):
            a, b = next(it), next(it)
            layer = cache.layers[i]
            if kind == "linear_attention":
                conv = layer.conv_states[0][..., -a.shape[-1]:]
                if self.step == self.fault.conv_state_stale_step:
                    conv = a                                         # the fault: the state written back unshifted
                outputs += [conv, layer.recurrent_states[0]]
            else:
                keys, values = layer.keys[0, :, W:], layer.values[0, :, W:]                   # [Hkv, AR, D]
                if self.key_transposed:
                    keys = keys.transpose(1, 2)
                if self.fault.key_untransposed:                     # the fault: [Hkv, AR, D] bytes, [Hkv, D, AR] shape
                    keys = keys.transpose(1, 2).reshape(keys.shape)
                outputs += [keys[:, None], values[:, None]]
        return tuple(outputs)


def genie_names(cfg) -> tuple[list, list]:
    """Input and output names of the static graph, in GenieGraph's argument / result order."""
    ins, outs = ["input_ids", "attention_mask", "position_ids_cos", "position_ids_sin"], ["logits"]
    for i, kind in enumerate(layer_types(cfg)):
        kinds = ("conv_state", "recurrent_state") if kind == "linear_attention" else ("past_key", "past_value")
        ins += [f"{n}_{i}_in" for n in kinds]
        outs += [f"{n}_{i}_out" for n in kinds]
    return ins, outs


def rope_tables(cfg, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Half-width cos / sin at `positions` [T], as the host computes them (float64, then float32): inv_freq_j =
    theta^(-2j / rot) over the rotated width rot."""
    rope = cfg.rope_parameters if hasattr(cfg, "rope_parameters") else {}
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
    factor = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    rot = int(cfg.head_dim * factor)
    inv = 1.0 / theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot)
    angles = positions[:, None].astype(np.float64) * inv[None]
    return np.cos(angles).astype(np.float32)[None, None], np.sin(angles).astype(np.float32)[None, None]


def run_genie(graph, cfg, steps: list, params: dict, fault: Fault | None = None) -> list[Call]:
    """The Genie host loop (device_conventions.md §1.3) around `graph(inputs: dict) -> (outputs: dict, taps: dict)`.
    steps: each call's (graph name, real tokens), the bundle's; params: the bundle's genie options (ar, cl, mask_floor,
    key_transposed, pad_id, pad_side, conv_state_len)."""
    fault = fault or Fault()
    AR, CL, floor = params["ar"], params["cl"], params["mask_floor"] if fault.mask_floor is None else fault.mask_floor
    left = params.get("pad_side", "left") == "left"
    pad = params.get("pad_id")
    pad = pad if pad is not None else (cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id)
    transposed = params.get("key_transposed", True)
    Hkv, D = cfg.num_key_value_heads, cfg.head_dim
    kv = {i: (np.zeros((Hkv, 0, D), np.float32),) * 2
          for i, t in enumerate(layer_types(cfg)) if t != "linear_attention"}
    states = {}
    for i, t in enumerate(layer_types(cfg)):
        if t == "linear_attention":
            conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
                cfg.linear_num_value_heads * cfg.linear_value_head_dim
            S = params.get("conv_state_len") or cfg.linear_conv_kernel_dim - 1   # (older bundles: Kc - 1)
            states[i] = (np.zeros((1, conv_dim, S), np.float32),
                         np.zeros((1, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                   cfg.linear_value_head_dim), np.float32))
    calls, cur = [], 0
    for k, (graph_name, tokens) in enumerate(steps):
        ar = AR if graph_name == "prompt" else params.get("decode_ar", 1)
        W, n = CL - ar, len(tokens)
        lo, hi = (ar - n, ar) if left else (0, n)                                    # the real slots of the chunk
        chunk = np.zeros(ar)
        chunk[lo:hi] = 1
        full = np.concatenate([np.zeros(W - cur), np.ones(cur), chunk])                          # [CL]
        allowed = (full[None] == 1) & (np.arange(CL)[None] <= W + np.arange(ar)[:, None])      # causal over slots
        mask = np.maximum(np.where(allowed, 0.0, np.finfo(np.float32).min), floor).astype(np.float32)
        positions = np.clip(np.cumsum(full) - 1, 0, CL - 1)[-ar:]
        cos, sin = rope_tables(cfg, positions)
        ids = np.full((1, ar), pad, np.int32)
        ids[0, lo:hi] = tokens
        inputs = {"input_ids": ids, "attention_mask": mask[None, None],
                  "position_ids_cos": cos, "position_ids_sin": sin}
        for i, (keys, values) in kv.items():
            shift = 1 if k == fault.window_shift_step else 0                 # the fault: one slot too far left
            kw, vw = _window(keys, W, shift), _window(values, W, shift)
            inputs[f"past_key_{i}_in"] = (kw.transpose(0, 2, 1) if transposed else kw)[:, None]
            inputs[f"past_value_{i}_in"] = vw[:, None]
        for i, (conv, rec) in states.items():
            if k == fault.recurrent_not_carried_step:
                rec = np.zeros_like(rec)                                     # the fault: the state not fed back
            inputs[f"conv_state_{i}_in"], inputs[f"recurrent_state_{i}_in"] = conv, rec
        outputs, taps = graph(inputs, k)
        for i in kv:
            keys = outputs[f"past_key_{i}_out"][:, 0]
            keys = keys.transpose(0, 2, 1) if transposed else keys
            kv[i] = (np.concatenate([kv[i][0], keys[:, lo:hi]], 1),
                     np.concatenate([kv[i][1], outputs[f"past_value_{i}_out"][:, 0][:, lo:hi]], 1))
        for i in states:
            states[i] = (outputs[f"conv_state_{i}_out"], outputs[f"recurrent_state_{i}_out"])
        calls.append(Call(inputs, outputs, taps))
        cur += n
    return calls


def _window(entries: np.ndarray, W: int, shift: int = 0) -> np.ndarray:
    """[Hkv, cur, D] -> the left-padded window [Hkv, W, D]; shift > 0 moves the entries that many slots left
    (the newest slots then hold zeros)."""
    Hkv, cur, D = entries.shape
    out = np.zeros((Hkv, W, D), np.float32)
    if cur:
        out[:, W - cur - shift:W - shift] = entries
    return out


def eager_graph(model, cfg, params: dict, fault: Fault | None = None):
    """graph(inputs, step) -> (outputs, taps) with transformers running GenieGraph eagerly."""
    fault = fault or Fault()
    g = GenieGraph(model, params.get("key_transposed", True), fault)
    ins, outs = genie_names(cfg)
    stack = contextlib.ExitStack()
    stack.enter_context(torch.no_grad())
    stack.enter_context(planted(model, fault))
    rec = stack.enter_context(Recorder(model, fault))
    dtype = next(model.parameters()).dtype

    def graph(inputs, step):
        g.step = step
        args = [torch.as_tensor(inputs[n]) for n in ins]
        args = [a.to(dtype) if a.is_floating_point() else a for a in args]
        result = g(*args)
        return {n: _np(t) for n, t in zip(outs, result)}, {n: _np(t) for n, t in rec.take().items()}
    graph.close = stack.close
    return graph


# ------------------------------------------------------------------------------------------------ qeff

class _ScatterLayer(transformers.cache_utils.DynamicLayer):
    """QEfficient's KV cache (device_conventions.md §3.1): full-context slots [1, Hkv, ctx_len, D], not transposed;
    the new entries written at their position ids (CtxScatter: data[b, h, pos[t]] = updates[b, h, t]), a pad's
    write (position -1) dropped; attention reads every ctx_len slot, the mask built from the position ids."""

    def __init__(self, keys, values, positions):
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self.keys, self.values, self.positions = keys.clone(), values.clone(), positions
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        real = self.positions >= 0
        self.keys[:, :, self.positions[real]] = key_states[:, :, real]
        self.values[:, :, self.positions[real]] = value_states[:, :, real]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2], 0

    def get_seq_length(self) -> int:
        return int(self.positions[self.positions >= 0].min())     # the positions before the call's first


def run_qeff(model, steps: list, params: dict, fault: Fault | None = None) -> list[Call]:
    """A QEfficient host loop (device_conventions.md §3) around transformers: per call input_ids and position_ids
    [1, S] (the chunk right-padded with pad_id, position -1 on pads; decode one slot at max + 1), past_key.{i} /
    past_value.{i} [1, Hkv, ctx_len, D] and conv_state.{i} / recurrent_state.{i} in, the *_RetainedState outputs
    read back and fed to the next call. steps: each call's (graph name, real tokens), the bundle's; params: its qeff
    options (seq_len, ctx_len, pad_id). Pads in a chunk after a GDN state are outside this device (transformers
    lets them into the state, QEfficient's port neutralises them): run the hybrids without pads."""
    fault = fault or Fault()
    cfg = model.config
    dtype = next(model.parameters()).dtype
    S, C = params["seq_len"], params["ctx_len"]
    pad = params.get("pad_id")
    pad = pad if pad is not None else cfg.pad_token_id if cfg.pad_token_id is not None else \
        (cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id)
    Hkv, D = cfg.num_key_value_heads, cfg.head_dim
    state = {}
    for i, t in enumerate(layer_types(cfg)):
        if t == "linear_attention":
            conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
                cfg.linear_num_value_heads * cfg.linear_value_head_dim
            state[f"conv_state.{i}"] = np.zeros((1, conv_dim, cfg.linear_conv_kernel_dim - 1), np.float32)
            state[f"recurrent_state.{i}"] = np.zeros((1, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                                      cfg.linear_value_head_dim), np.float32)
        else:
            state[f"past_key.{i}"] = state[f"past_value.{i}"] = np.zeros((1, Hkv, C, D), np.float32)
    calls, next_pos = [], 0
    with torch.no_grad(), planted(model, fault), Recorder(model, fault) as rec:
        for k, (graph_name, tokens) in enumerate(steps):
            s, n = (S if graph_name == "prefill" else 1), len(tokens)
            positions = np.concatenate([np.arange(next_pos, next_pos + n), -np.ones(s - n, np.int64)])
            if k == fault.recurrent_not_carried_step:
                state = {name: np.zeros_like(a) if name.startswith("recurrent") else a for name, a in state.items()}
            inputs = {"input_ids": np.array([list(tokens) + [pad] * (s - n)], np.int64),
                      "position_ids": positions[None].astype(np.int64), **state}
            pos = torch.as_tensor(positions)
            cache = transformers.DynamicCache(config=cfg)
            for i, t in enumerate(layer_types(cfg)):
                if t == "linear_attention":
                    conv = torch_arg(inputs[f"conv_state.{i}"], dtype)          # Kc - 1 columns; transformers keeps Kc
                    conv = torch.cat([torch.zeros_like(conv[..., :1]), conv], -1)
                    layer = cache.layers[i]
                    layer.lazy_initialization(conv_states=conv, recurrent_states=torch_arg(
                        inputs[f"recurrent_state.{i}"], dtype))
                    layer.conv_states[0] = conv.clone()
                    layer.recurrent_states[0] = torch_arg(inputs[f"recurrent_state.{i}"], dtype).clone()
                    layer.has_previous_state[0] = True
                else:
                    cache.layers[i] = _ScatterLayer(torch_arg(inputs[f"past_key.{i}"], dtype),
                                                    torch_arg(inputs[f"past_value.{i}"], dtype), pos)
            allowed = (torch.arange(C)[None] <= pos[:, None]) & (pos[:, None] >= 0)        # [s, C]: slot j <= p
            mask = torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)[None, None]
            if "linear_attention" in layer_types(cfg):
                mask = {"full_attention": mask, "linear_attention": None if s == 1 else
                        torch.as_tensor(positions >= 0)[None].to(dtype)}
            out = model(input_ids=torch.as_tensor(inputs["input_ids"]), attention_mask=mask,
                        position_ids=pos.clamp(min=0)[None], past_key_values=cache, use_cache=True)
            outputs = {"logits": _np(out.logits)}
            for i, t in enumerate(layer_types(cfg)):
                layer = cache.layers[i]
                if t == "linear_attention":
                    outputs[f"conv_state.{i}_RetainedState"] = _np(layer.conv_states[0][..., 1:])
                    outputs[f"recurrent_state.{i}_RetainedState"] = _np(layer.recurrent_states[0])
                else:
                    outputs[f"past_key.{i}_RetainedState"] = _np(layer.keys)
                    outputs[f"past_value.{i}_RetainedState"] = _np(layer.values)
            state = {name.removesuffix("_RetainedState"): a for name, a in outputs.items() if name != "logits"}
            calls.append(Call(inputs, outputs, {n: _np(t) for n, t in rec.take().items()}))
            next_pos += n
    return calls


# ------------------------------------------------------------------------------------------------ ONNX Runtime

class WithTaps(torch.nn.Module):
    """GenieGraph returning the hooked taps as extra outputs (their names in `tap_names` after a trace)."""

    def __init__(self, genie, recorder):
        super().__init__()
        self.genie, self.recorder, self.tap_names = genie, recorder, []

    def forward(self, *args):
        self.recorder.take()
        outputs = self.genie(*args)
        taps = self.recorder.take()
        self.tap_names = list(taps)
        return (*outputs, *taps.values())


def ort_graph(model, cfg, params: dict, example: dict, path: Path, fault: Fault | None = None):
    """graph(inputs, step) -> (outputs, taps) with ONNX Runtime (CPU EP) running GenieGraph exported by
    torch.onnx.export at the model's dtype. One export per call shape (prompt AR, token AR)."""
    import onnxruntime
    fault = fault or Fault()
    ins, outs = genie_names(cfg)
    dtype = next(model.parameters()).dtype
    sessions = {}

    def session(inputs):
        ar = inputs["input_ids"].shape[1]
        if ar not in sessions:
            with torch.no_grad(), planted(model, fault), Recorder(model, fault) as rec:
                wrapped = WithTaps(GenieGraph(model, params.get("key_transposed", True), fault), rec).eval()
                args = tuple(torch_arg(inputs[n], dtype) for n in ins)
                wrapped(*args)                                           # learn the tap names
                f = path / f"genie_ar{ar}.onnx"
                if not f.exists():   # else a graph exported before (and edited: scale_output)
                    with warnings.catch_warnings():  # torch's own pytree deprecation, nothing of ours
                        warnings.simplefilter("ignore", FutureWarning)
                        torch.onnx.export(wrapped, args, f, input_names=ins, output_names=outs + wrapped.tap_names,
                                          dynamo=True, external_data=False, optimize=True, verbose=False)
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = 1
            sessions[ar] = (onnxruntime.InferenceSession(str(f), options, providers=["CPUExecutionProvider"]),
                            wrapped.tap_names)
        return sessions[ar]

    def graph(inputs, step):
        sess, tap_names = session(inputs)
        feed = {n: torch_arg(inputs[n], dtype).numpy() for n in ins}
        result = sess.run(None, feed)
        named = dict(zip(outs + tap_names, result))
        as32 = {n: (a.astype(np.float32) if a.dtype == np.float16 else a) for n, a in named.items()}
        return {n: as32[n] for n in outs}, {n: as32[n] for n in tap_names}
    return graph


def scale_output(source: Path, target: Path, tensor: str, channel: int, factor: float) -> Path:
    """A copy of an exported graph with one channel (last axis) of the named tensor scaled: a Mul by a per-channel
    constant inserted after the node producing it, as a device applying a wrong per-channel output scale does."""
    import onnx
    from onnx import helper, numpy_helper
    model = onnx.load(source)
    index, node = next((i, n) for i, n in enumerate(model.graph.node) if tensor in n.output)
    raw = f"{tensor}.unscaled"
    node.output[list(node.output).index(tensor)] = raw
    elem = next(v for v in model.graph.output if v.name == tensor).type.tensor_type.elem_type
    dims = [d.dim_value for d in next(v for v in model.graph.output if v.name == tensor).type.tensor_type.shape.dim]
    scale = np.ones(dims[-1], helper.tensor_dtype_to_np_dtype(elem))
    scale[channel] = factor
    model.graph.initializer.append(numpy_helper.from_array(scale, f"{tensor}.scale"))
    model.graph.node.insert(index + 1, helper.make_node("Mul", [raw, f"{tensor}.scale"], [tensor]))   # in order
    target.mkdir(parents=True, exist_ok=True)
    onnx.save(model, target / source.name)
    return target


def torch_arg(a: np.ndarray, dtype):
    t = torch.as_tensor(a)
    return t.to(dtype) if t.is_floating_point() else t


# ------------------------------------------------------------------------------------------------ dumps

def write_dump(calls: list[Call], out: Path, roles=("inputs", "outputs", "taps")) -> Path:
    """steps/<k>/{inputs,outputs,taps}/<name>.npy"""
    for k, c in enumerate(calls):
        for role in roles:
            d = out / "steps" / str(k) / role
            d.mkdir(parents=True, exist_ok=True)
            for name, a in getattr(c, role).items():
                np.save(d / f"{name}.npy", a)
    return out
