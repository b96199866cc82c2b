"""transformers' own forward on the HTP in the hf prefill form (refimpl.conventions.hf, the prompt in one call):
inputs input_ids and position_ids, outputs the logits and the cache the forward fills (present.<i>.key / .value, or
present_conv_state.<i> / present_recurrent_state.<i>), plus the hooked taps; exported in float16 and rewritten for
the HTP as the genie form is (tests/e2e/htp.py). The causal mask, the positions and the RoPE tables are built
inside the graph, by transformers (Range, CumSum, Cos / Sin, Qwen3.5's interleaved M-RoPE with ScatterND).
"""

import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import devices as D  # noqa: E402
import htp  # noqa: E402


def output_names(cfg) -> list:
    """The hf convention's prefill outputs, in the order `Prefill` returns them."""
    names = ["logits"]
    for i, kind in enumerate(D.layer_types(cfg)):
        names += [f"present_conv_state.{i}", f"present_recurrent_state.{i}"] if kind == "linear_attention" else \
            [f"present.{i}.key", f"present.{i}.value"]
    return names


class Prefill(torch.nn.Module):
    """transformers' forward on the whole prompt, its DynamicCache's contents returned as graph outputs."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids):
        cfg = self.model.config
        cache = transformers.DynamicCache(config=cfg)
        out = self.model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, use_cache=True)
        result = [out.logits]
        for i, kind in enumerate(D.layer_types(cfg)):
            layer = cache.layers[i]
            result += [layer.conv_states[0], layer.recurrent_states[0]] if kind == "linear_attention" else \
                [layer.keys, layer.values]
        return tuple(result)


def export_prefill(model, prompt: list, path: Path) -> tuple[Path, list]:
    """The float16 model's prefill on `prompt` exported (raw: optimize=False; htp.rewrite optimizes it), with the
    hooked taps as extra outputs. Returns the file and the tap names."""
    ids = torch.tensor([prompt], dtype=torch.int64)
    positions = torch.arange(len(prompt))[None]
    with torch.no_grad(), htp.htp_functions(model), D.Recorder(model) as rec:
        wrapped = D.WithTaps(Prefill(model), rec).eval()
        wrapped(ids, positions)
        f = path / f"hf_prefill_t{len(prompt)}.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(wrapped, (ids, positions), f, input_names=["input_ids", "position_ids"],
                              output_names=output_names(model.config) + wrapped.tap_names, dynamo=True,
                              external_data=False, optimize=False, verbose=False)
    return f, wrapped.tap_names


def run_prefill(session, cfg, tap_names: list, prompt: list, fault: D.Fault | None = None) -> list:
    """The prefill call on the HTP: one D.Call (inputs, outputs, taps), float16 results as float32."""
    inputs = {"input_ids": np.array([prompt], np.int64), "position_ids": np.arange(len(prompt))[None]}
    names = output_names(cfg)
    named = dict(zip(names + tap_names, session.run(None, inputs)))
    as32 = {n: (a.astype(np.float32) if a.dtype == np.float16 else a) for n, a in named.items()}
    return [D.Call(inputs, {n: as32[n] for n in names}, {n: as32[n] for n in tap_names})]
