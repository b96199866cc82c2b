"""Fault injection: a "device dump" made by the reference itself with one known fault.

Each fault is a context manager that patches the reference (or swaps its weights) while the convention's host
loop runs; `device_dump` then writes what a device would: every graph output and every tap of every call,
as qnn-net-run float32 raw files (Result_<k>/<name>.raw) or in the bundle's own layout with the host's inputs.
The expected first divergence of each fault is the tensor the fault corrupts first.
"""

import contextlib
from pathlib import Path

import numpy as np

from refimpl.conventions import genie
from refimpl.golden import run_convention
from refimpl.models import hybrid, qwen3
from refimpl.models.config import config_from_dict
from refimpl.models.model import Model
from refimpl.models.weights import Weights
from refimpl.presets import PRESETS, random_weights


def model_and_arrays(preset: str, seed: int = 11, **overrides):
    """A preset model (optionally with config overrides) with a scaled output head, and its arrays."""
    cfg = config_from_dict({**PRESETS[preset], **overrides})
    arrays = random_weights(cfg, seed=seed)
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    arrays[head] = arrays[head] * np.float32(0.05)
    return Model(cfg, Weights(arrays)), arrays


def device_dump(model, prompt, params: dict, decode_steps: int, out: Path, fault=None, layout: str = "qnn",
                convention: str = "genie") -> Path:
    """Run the host loop with `fault` (a context manager or None) and write the device's dump to `out`."""
    with fault if fault is not None else contextlib.nullcontext():
        calls, _ = run_convention(model, prompt, convention, params, decode_steps, taps=".")
    for k, c in enumerate(calls):
        groups = {"outputs": {**c.outputs, **c.taps}} if layout == "qnn" else \
            {"inputs": c.inputs, "outputs": c.outputs, "taps": c.taps}
        for role, tensors in groups.items():
            d = out / f"Result_{k}" if layout == "qnn" else out / "steps" / str(k) / role
            d.mkdir(parents=True, exist_ok=True)
            for name, a in tensors.items():
                with np.errstate(over="ignore"):  # float64 finfo.min masks become -inf, as on a device
                    np.asarray(a, np.float32).tofile(d / f"{name}.raw")  # qnn-net-run writes float32
    return out


@contextlib.contextmanager
def patched(module, name: str, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def corrupt_tap(full_name: str, fn):
    """The tap `full_name` (and everything computed from it) gets fn(value) instead of value."""
    def wrap(original):
        def tap(prefix, what, value):
            name = prefix if what is None else f"{prefix}.{what}"
            return original(prefix, what, fn(value) if name == full_name else value)
        return tap
    @contextlib.contextmanager
    def active():
        with patched(qwen3, "tap", wrap(qwen3.tap)), patched(hybrid, "tap", wrap(hybrid.tap)):
            yield
    return active()


# ------------------------------------------------------------------------------------------------ faults

def perturbed_weights(model, arrays, name: str, scale: float = 1e-2, seed: int = 0) -> Model:
    """A model whose weight `name` is off by +-scale (seeded signs): a device with a mis-converted weight."""
    rng = np.random.default_rng(seed)
    w = arrays[name] + np.float32(scale) * rng.choice([-1, 1], arrays[name].shape).astype(np.float32)
    return Model(model.config, Weights({**arrays, name: w}))


def interleaved_rope():
    """RoPE over interleaved pairs (2i, 2i+1) (Meta / llama.c) instead of half-split pairs (i, i + rot/2)."""
    def apply(x, cos, sin, rnd=lambda v: v, at=None):   # at: refimpl's sub-op points (none quantised here)
        rot = 2 * cos.shape[-1]
        c, s = cos[..., None, :], sin[..., None, :]
        even, odd = x[..., 0:rot:2], x[..., 1:rot:2]
        out = x.copy()
        out[..., 0:rot:2] = rnd(rnd(even * c) - rnd(odd * s))
        out[..., 1:rot:2] = rnd(rnd(odd * c) + rnd(even * s))
        return out
    return patched(qwen3, "apply_rope", apply)


def graph_outputs(fn):
    """Post-process every genie graph call's outputs with fn(outputs) (a device writing them wrongly)."""
    original = genie.graph

    def graph(model, inputs, opts):
        return fn(original(model, inputs, opts))
    return patched(genie, "graph", graph)


def written_transposed(name: str):
    """Output `name` written with its last two axes swapped into the buffer of the contract's shape (same bytes,
    reshaped): e.g. past_key_out as [Hkv, 1, T, D] for [Hkv, 1, D, T], a recurrent state as [Dv, Dk]."""
    def fn(out):
        a = out[name]
        out[name] = np.ascontiguousarray(a.swapaxes(-1, -2)).reshape(a.shape)
        return out
    return graph_outputs(fn)


def key_cache_untransposed(layer: int):
    return written_transposed(f"past_key_{layer}_out")


def recurrent_state_transposed(layer: int):
    return written_transposed(f"recurrent_state_{layer}_out")


def conv_state_shifted():
    """The conv state keeps the S columns one step too early: [state | x][-S-1:-1] instead of [-S:]."""
    original = hybrid.causal_conv1d

    def conv(x, w, state=None, **kwargs):
        y, new_state = original(x, w, state, **kwargs)
        S = new_state.shape[-1]
        full = x if state is None else np.concatenate([state, x], axis=-1)
        if full.shape[-1] > S:
            new_state = np.ascontiguousarray(full[..., -S - 1:-1])
        return y, new_state
    return patched(hybrid, "causal_conv1d", conv)


def fp16_round(name: str):
    """Tap `name` rounded to float16 (a device keeping one layer's output in half precision)."""
    return corrupt_tap(name, lambda v: v.astype(np.float16).astype(v.dtype))


def wrong_expert(layer: int, token: int, num_experts: int):
    """One token of one MoE layer routed to an expert the router did not choose (its first choice swapped)."""
    def fn(selected):
        if selected.shape[1] <= token:  # a call without that slot (decode)
            return selected
        selected = selected.copy()
        row = selected[0, token]
        row[0] = next(e for e in range(num_experts) if e not in row)
        return selected
    return corrupt_tap(f"model.layers.{layer}.mlp.selected_experts", fn)


def pad_leaks_into_gdn():
    """Linear-attention layers run the pad slots of a chunk as if they were tokens."""
    original = genie.Context

    def context(cos, sin, masks, cache, linear_mask, **kw):
        return original(cos, sin, masks, cache, None, **kw)
    return patched(genie, "Context", context)
