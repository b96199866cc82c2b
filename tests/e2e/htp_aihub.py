"""AI Hub's own graph code on the HTP: the graphs qai-hub-models 0.65.0 compiles for the Hexagon NPU (loaded by
tests/conformance/aihub.py: Qwen3's split-head attention with per-head 1x1 convs, q pre-scaled, RoPE tables and
static KV windows as inputs; Qwen3.5's gated attention, conv-with-state and chunked delta rule with explicit state
I/O), exported in float16 with torch.onnx.export (dynamo, opset 18, optimize=False then onnxscript's optimizer, as
AI Hub's exporter does), run on the HTP simulator with the CPU fallback disabled (tests/e2e/htp.py).

Dumps are what an engineer hooking AI Hub's modules gets, named as the hooks (`HookRecorder`):
  - module forward hooks on the wrapped transformers model (`model.layers.1.input_layernorm`, `...mlp.gate`,
    `...linear_attn.in_proj_qkv`, `...linear_attn.norm.input.0`): AI Hub calls transformers' own modules there;
  - Qwen3.5's full-attention layers run AI Hub's `SHAFullAttention` (its `sha_attention.<i>` module): hooked, its
    output is the attention block's, named `model.layers.<i>.self_attn` as the layer's attention;
  - AI Hub's functions a bring-up engineer hooks in Qwen3.5's linear attention (`gated_delta_rule`, its arguments
    g and beta by keyword; `_conv_with_state`): named `model.layers.<i>.linear_attn.<function>` like transformers'
    function hooks (refimpl/diff/hooks.py maps AI Hub's function names too).
"""

import contextlib
import functools
import re
import sys
import warnings
from pathlib import Path
from unittest import mock

import pytest

torch = pytest.importorskip("torch")
import devices as D  # noqa: E402
import htp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "conformance"))
import aihub  # noqa: E402  (tests/conformance/aihub.py: the same module object test_aihub imports)

ARCHITECTURES = {"dense": "tiny-qwen3", "moe": "tiny-qwen3-moe", "hybrid": "tiny-qwen3.5",
                 "hybrid-moe": "tiny-qwen3.5-moe"}
# Qwen3-Next: AI Hub's code has no Qwen3-Next graph. Qwen3-MoE and Qwen3.5-MoE: AI Hub exports neither; its Qwen3
# and Qwen3.5 code applied to transformers' MoE models (tests/conformance/aihub.py), batched_mm experts (below)


class HookRecorder:
    """Forward hooks on AI Hub's graph module (`base`: the LLMBase stand-in wrapping the transformers model as
    `base.model`), names as a hook on the transformers model gives them, plus AI Hub's Qwen3.5 functions."""

    def __init__(self, base):
        self.base, self.taps, self.handles, self.stack = base, {}, [], []

    def name(self, path: str) -> str | None:
        """A module path of `base` as the engineer's hook names it (None: not hooked). Qwen3's per-head norms
        (`self_attn.q_norm_sha.<h>`, one module per head holding the same weight) are hooked as the norm they split:
        `self_attn.q_norm`, one call per head."""
        if path.startswith("model.model.") or path.startswith("model.lm_head"):
            return re.sub(r"\.(q|k)_norm_sha\.\d+$", r".\1_norm", path.removeprefix("model."))
        if path.startswith("sha_attention.") and path.count(".") == 1:
            return f"model.layers.{path.split('.')[1]}.self_attn"
        return None

    def __enter__(self):
        for path, module in self.base.named_modules():
            name = self.name(path)
            if name is None or name == "model":
                continue
            leaf = not any(True for _ in module.children())
            first = path.startswith("sha_attention.")   # (output, new_key, new_value): the output is the block's
            self.handles.append(module.register_forward_hook(
                lambda m, a, out, name=name, leaf=leaf, first=first: self._module(name, a if leaf else (),
                                                                                  out[0] if first else out)))
        self.patches = contextlib.ExitStack()
        adaptations = sys.modules.get(f"{aihub.T}.qwen3_5.model_adaptations")
        if adaptations is not None and any(path.endswith("linear_attn") for path, _ in self.base.named_modules()):
            layers = {id(m.linear_attn): f"model.layers.{i}.linear_attn"
                      for i, m in enumerate(self.base.model.model.layers) if hasattr(m, "linear_attn")}
            forward = adaptations.linear_attention_forward

            def linear_attention(module, *args):
                self.stack.append(layers[id(module)])
                try:
                    return forward(module, *args)
                finally:
                    self.stack.pop()
            for where in (adaptations, aihub.load().qwen3_5):   # the graph's module imported it by name
                self.patches.enter_context(mock.patch.object(where, "linear_attention_forward", linear_attention))
            self.patches.enter_context(mock.patch.object(adaptations, "gated_delta_rule", self._function(
                "gated_delta_rule", adaptations.gated_delta_rule, ("query", "key", "value", "g", "beta"))))
            self.patches.enter_context(mock.patch.object(adaptations, "_conv_with_state", self._function(
                "_conv_with_state", adaptations._conv_with_state, ("mixed_qkv",))))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.patches.close()

    def take(self) -> dict:
        """The taps since the last take(). A hook called once per head in one forward (a module shared by AI Hub's
        split heads: Qwen3.5's q_norm / k_norm) gives [B, 1, T, D] per call: stacked on axis 1, [B, H, T, D], as
        the engineer's dump script puts the heads back together."""
        taps, self.taps = self.taps, {}
        return {n: (torch.cat(a, dim=1) if len(a) > 1 else a[0]) for n, a in taps.items()}

    def _module(self, name, args, out):
        self._save(name, out)
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        for i, a in enumerate(tensors):
            self._save(f"{name}.input" + (f".{i}" if len(tensors) > 1 else ""), a)

    def _function(self, fn_name, fn, arg_names):
        def wrapped(*args, **kwargs):
            where = f"{self.stack[-1]}.{fn_name}"
            for key, a in zip(arg_names, args):
                self._save(f"{where}.{key}", a)
            out = fn(*args, **kwargs)
            self._save(where, out)
            return out
        return wrapped

    def _save(self, name, out):
        if isinstance(out, torch.Tensor):
            self.taps.setdefault(name, []).append(out.detach())
        elif isinstance(out, (tuple, list)):
            for i, o in enumerate(out):
                if isinstance(o, torch.Tensor):
                    self._save(name if i == 0 else f"{name}.{i}", o)


@functools.cache
def aihub_graph(directory: str, CL: int, pad_id: int):
    """AI Hub's graph of a checkpoint (tests/conformance/aihub.py) in float16, built once per process."""
    g = aihub.graph(Path(directory), CL, pad_id)
    if getattr(g.model.llm_config, "num_experts", None):
        # the conformance graph runs transformers' eager experts, whose loop over the experts hit is data-dependent
        # (torch.export cannot trace it); batched_mm is the same function and exports (AI Hub exports no MoE)
        g.model.model.set_experts_implementation("batched_mm")
    g.model.half().eval()
    return g


def htp_aihub_graph(directory: Path, cfg, params: dict, path: Path, fault: D.Fault | None = None, skip=(),
                    exports=None):
    """graph(inputs, step) -> (outputs, taps): AI Hub's graph exported in float16 and run on the HTP. One export
    per call shape (AR), cached in `exports`; the fault's weights planted in the graph (htp.plant), its host parts
    are run_genie's."""
    fault = fault or D.Fault()
    g = aihub_graph(str(directory), params["cl"], params["pad_id"])
    ins, outs = D.genie_names(cfg)
    assert outs == g.output_names, (outs, g.output_names)
    exports = {} if exports is None else exports
    sessions = {}

    def compiled(inputs):
        ar = inputs["input_ids"].shape[1]
        assert ins == list(g.input_spec(ar)), (ins, list(g.input_spec(ar)))
        if ar not in exports:
            with torch.no_grad(), HookRecorder(g.model) as rec:
                wrapped = D.WithTaps(g.model, rec).eval()
                args = tuple(D.torch_arg(inputs[n], torch.float16) for n in ins)
                wrapped(*args)                                           # learn the tap names
                f = path / f"aihub_genie_ar{ar}.onnx"
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    torch.onnx.export(wrapped, args, f, input_names=ins, output_names=outs + wrapped.tap_names,
                                      dynamo=True, opset_version=18, external_data=False, optimize=False,
                                      verbose=False)
            exports[ar] = (f, wrapped.tap_names)
        if ar not in sessions:
            f, tap_names = exports[ar]
            sessions[ar] = (htp.compiled_session(f, skip, fault), tap_names)
        return sessions[ar]

    return htp.run_graph(compiled, ins, outs)
