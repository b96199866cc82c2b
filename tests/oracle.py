"""Helpers that build transformers reference models (test oracle only: refimpl never imports torch)."""

import inspect
import math
import re
import sys
import types
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def case_seed(name: str) -> int:
    """A seed fixed by the case's name, whatever order the cases run in."""
    return zlib.crc32(name.encode())


def build_hf(config_dict: dict, seed: int = 0, logit_scale: float = 1.0, auto=None):
    """A transformers model (float32, eager attention, eager experts) with every parameter randomised:
    matrices N(0, 1/fan_in), 1-D parameters (norm weights, biases, A_log, dt_bias, ...) random too.
    logit_scale multiplies the output projection (lm_head, or the tied embedding), setting the logits' size.
    auto: the transformers Auto class to build with (default AutoModelForCausalLM)."""
    config = transformers.AutoConfig.for_model(**config_dict)
    torch.manual_seed(seed)
    kwargs = {"attn_implementation": "eager"}
    if config_dict.get("num_experts"):
        kwargs["experts_implementation"] = "eager"
    auto = auto or transformers.AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    zero_centred = config_dict["model_type"] in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5",
                                                 "qwen3_5_moe")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                # moderate decays (A in [0.1, 2]): with transformers' init range A in [0.01, 16] random tiny
                # models cancel strongly in S^T q, and float32 itself (transformers' included) lands ~2e-4 from
                # float64 — a parity test would then measure conditioning, not agreement
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.1, 2, generator=gen)))
            elif p.ndim == 1 and "norm" in name and (not zero_centred or name.endswith("linear_attn.norm.weight")):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))   # plain norm weights: around 1
            elif p.ndim == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))       # zero-centred norms, biases, dt_bias
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        model.get_output_embeddings().weight.mul_(logit_scale)
    model.eval()
    return model


def hf_logits(model, ids, attention_mask=None, position_ids=None) -> np.ndarray:
    # a fresh rotary module each call: transformers keeps dynamic-RoPE state in it across calls
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    dtype = next(model.parameters()).dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # float64 twins: no float32 from default-dtype promotion either
    try:
        with torch.no_grad():
            out = model(input_ids=torch.as_tensor(ids),
                        attention_mask=None if attention_mask is None else torch.as_tensor(attention_mask),
                        position_ids=None if position_ids is None else torch.as_tensor(position_ids))
    finally:
        torch.set_default_dtype(previous)
    return out.logits.numpy()


def left_padded(rng, vocab: int, T: int, pads: int):
    """Batch of 2: row 0 left-padded by `pads`, row 1 full. Returns ids, mask, position_ids."""
    ids = rng.integers(0, vocab, size=(2, T))
    mask = np.ones((2, T), np.int64)
    mask[0, :pads] = 0
    ids[0, :pads] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return ids, mask, positions


def _float64_module(module, rewrite=lambda src: src):
    """`module` re-executed with every float32 cast (torch.float32, torch.float, .float()) made float64."""
    name = module.__name__ + "_float64"
    if name in sys.modules:
        return sys.modules[name]
    source = re.sub(r"torch\.float(32)?\b", "torch.float64", inspect.getsource(module)).replace(".float()", ".double()")
    twin = types.ModuleType(name)
    twin.__package__, twin.__file__ = module.__package__, module.__file__
    sys.modules[name] = twin  # its classes must be findable by module name (docstring tooling)
    exec(compile(rewrite(source), module.__file__, "exec"), twin.__dict__)
    return twin


def float64_twin(model):
    """The same transformers model computing in float64 throughout.

    transformers keeps float32 islands even in a float64 model (RMSNorm statistics, softmaxes, RoPE frequencies
    and tables, the whole Gated DeltaNet core), so `.double()` is not a float64 oracle. The twin is the model's
    own modeling module (and transformers' RoPE utilities) re-executed with every float32 cast made float64,
    loaded with the same weights.
    """
    import transformers.modeling_rope_utils as rope_utils
    rope64 = _float64_module(rope_utils)
    module = _float64_module(sys.modules[type(model).__module__], lambda src: src.replace(
        "from ...modeling_rope_utils import", f"from {rope64.__name__} import"))
    model64 = getattr(module, type(model).__name__)(model.config)
    model64.load_state_dict(model.state_dict())
    return model64.double().eval()


def checkpoint_builder(tmp_path_factory, logit_scale: float = 1.0):
    """get(model_type, name, cfg) -> (transformers model, its float64 twin, save_pretrained directory),
    built once per case, seeded by the case's name."""
    built = {}

    def get(model_type, name, cfg):
        key = f"{model_type}-{name}"
        if key not in built:
            hf = build_hf({"model_type": model_type, **cfg}, seed=case_seed(key), logit_scale=logit_scale)
            directory = tmp_path_factory.mktemp(key)
            hf.save_pretrained(directory)
            built[key] = (hf, float64_twin(hf), directory)
        return built[key]
    return get
