"""Helpers that build transformers reference models (test oracle only: refimpl never imports torch)."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def build_hf(config_dict: dict, seed: int = 0):
    """A transformers model (float32, eager attention, eager experts) with every parameter randomised:
    matrices N(0, 1/fan_in), 1-D parameters (norm weights, biases, A_log, dt_bias, ...) random too."""
    config = transformers.AutoConfig.for_model(**config_dict)
    torch.manual_seed(seed)
    kwargs = {"attn_implementation": "eager"}
    if config_dict.get("num_experts"):
        kwargs["experts_implementation"] = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                if name.endswith("A_log"):
                    p.copy_(torch.log(torch.empty(p.shape).uniform_(1, 16, generator=gen)))
                elif "norm" in name and not config_dict["model_type"].startswith("qwen3_5") \
                        and config_dict["model_type"] != "qwen3_next" or name.endswith("linear_attn.norm.weight"):
                    p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    model.eval()
    return model


class _FixedRope(torch.nn.Module):
    """Stands in for transformers' rotary module: returns given half-width tables, duplicated to width rot."""

    def __init__(self, cos, sin):
        super().__init__()
        self.cos = torch.as_tensor(np.concatenate([cos, cos], axis=-1))
        self.sin = torch.as_tensor(np.concatenate([sin, sin], axis=-1))

    def forward(self, x, position_ids):
        return self.cos.to(x.dtype), self.sin.to(x.dtype)


def hf_logits(model, ids, attention_mask=None, position_ids=None, rope=None) -> np.ndarray:
    """Logits of a transformers model. rope: (cos, sin) half-width tables to use instead of its rotary module
    (transformers builds its tables in float32 even in a float64 model)."""
    # a fresh rotary module each call: transformers keeps dynamic-RoPE state in it across calls
    model.model.rotary_emb = _FixedRope(*rope) if rope is not None else type(model.model.rotary_emb)(model.config)
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids),
                    attention_mask=None if attention_mask is None else torch.as_tensor(attention_mask),
                    position_ids=None if position_ids is None else torch.as_tensor(position_ids))
    return out.logits.numpy()


def left_padded(rng, vocab: int, T: int, pads: int):
    """Batch of 2: row 0 left-padded by `pads`, row 1 full. Returns ids, mask, position_ids."""
    ids = rng.integers(0, vocab, size=(2, T))
    mask = np.ones((2, T), np.int64)
    mask[0, :pads] = 0
    ids[0, :pads] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return ids, mask, positions
