"""A GGUF's metadata as the HF config.json dict it describes, and where llama.cpp's reading of it differs from
transformers' (the notes logged when a GGUF is loaded or written)."""

import math

import numpy as np

from ...errors import ConfigError, WeightsError, brief
from ...files import integer, number
from ...models.config import HYBRID_TYPES, MOE_ONLY_TYPES, MOE_TYPES, MROPE_TYPES, SHARED_EXPERT_TYPES
from .names import BLOCK
from .reader import GGUFFile, StringArray

ARCHITECTURES = {"qwen3": "qwen3", "qwen3moe": "qwen3_moe", "qwen3next": "qwen3_next", "qwen35": "qwen3_5_text",
                 "qwen35moe": "qwen3_5_moe_text"}
MODEL_TYPE_TO_ARCH = {v: k for k, v in ARCHITECTURES.items()}


def _key(g: GGUFFile, arch: str, key: str, required: bool = True, default=None, kind: str = "int"):
    """Metadata `{arch}.{key}` of type `kind`: "int" (a size, >= 0), "count" (an int >= 1), "float" (finite), "str",
    or "ints" (a numeric array, returned as a list of ints)."""
    full = f"{arch}.{key}"
    if full not in g.metadata:
        if required:
            raise ConfigError(f"{g.path}: missing metadata {full!r} (needed for architecture {arch!r})")
        return default
    return typed(g, full, kind)


def typed(g: GGUFFile, key: str, kind: str):
    """g.metadata[key] checked to be of type `kind` (see _key), or ConfigError naming it."""
    v, where = g.metadata[key], f"{g.path}: metadata {key!r}"
    if kind == "ints":
        if not isinstance(v, np.ndarray) or v.dtype.kind not in "iub" or v.ndim != 1:
            raise ConfigError(f"{where}: expected an array of integers, got {brief(v)}")
        return [int(x) for x in v]
    if isinstance(v, np.ndarray) and kind != "str" and v.dtype.kind in "iubf" and v.ndim == 1:
        if v.size == 0 or (v != v.flat[0]).any():   # per-layer arrays: accepted when uniform
            raise ConfigError(f"{where} varies per layer ({brief(v.tolist())}); not supported")
        v = v.flat[0].item()
    if kind in ("int", "count"):
        return integer(v, where, ConfigError, lo=0 if kind == "int" else 1)
    if kind == "bool":
        if not isinstance(v, bool):
            raise ConfigError(f"{where}: expected true / false, got {brief(v)}")
        return v
    if kind == "float":
        return number(v, where, ConfigError)
    if not isinstance(v, str):
        raise ConfigError(f"{where}: expected a string, got {brief(v)}")
    return v


def token_id(g: GGUFFile, which: str) -> int | None:
    """Metadata tokenizer.ggml.{which}_token_id (which: bos, eos, padding, unknown), or None when absent."""
    key = f"tokenizer.ggml.{which}_token_id"
    return typed(g, key, "int") if key in g.metadata else None


def _f32(x: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (9.99999997e-07 -> 1e-06)."""
    return float(str(np.float32(x)))


def config_dict(g: GGUFFile) -> dict:
    """The HF config.json dict (as `config_from_dict` takes it) that the GGUF's metadata and tensors describe."""
    arch = g.architecture
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{g.path}: unknown architecture {arch!r} (general.architecture); supported: "
                          f"{', '.join(ARCHITECTURES)}")
    model_type = ARCHITECTURES[arch]
    k = lambda key, *a, **kw: _key(g, arch, key, *a, **kw)
    if "token_embd.weight" not in g.tensors:
        raise WeightsError(f"{g.path}: missing tensor 'token_embd.weight'")
    if len(g.tensors["token_embd.weight"].shape) != 2:
        raise WeightsError(f"{g.path}: tensor 'token_embd.weight' has shape "
                           f"{list(g.tensors['token_embd.weight'].shape)}, expected [vocab, hidden]")
    vocab, hidden = g.tensors["token_embd.weight"].shape
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None and not isinstance(tokens, StringArray):
        raise ConfigError(f"{g.path}: metadata 'tokenizer.ggml.tokens': expected an array of strings, got "
                          f"{brief(tokens)}")
    if tokens is not None and len(tokens) != vocab:
        raise WeightsError(f"{g.path}: tensor 'token_embd.weight' has {vocab} rows but tokenizer.ggml.tokens has "
                           f"{len(tokens)} entries")
    if k("embedding_length") != hidden:
        raise WeightsError(f"{g.path}: tensor 'token_embd.weight' is {vocab} x {hidden}, but "
                           f"{arch}.embedding_length is {k('embedding_length')}")
    nextn = k("nextn_predict_layers", required=False, default=0)
    blocks, block_count = len({m[1] for n in g.tensors if (m := BLOCK.match(n))}), k("block_count", kind="count")
    if block_count > blocks or nextn >= block_count:   # counts checked against the file before any loop runs
        raise WeightsError(f"{g.path}: {arch}.block_count is {block_count} (nextn_predict_layers {nextn}), but the "
                           f"file holds tensors of {blocks} blocks")
    n_layers = block_count - nextn
    heads = k("attention.head_count", kind="count")
    head_dim = k("attention.key_length", required=False, default=None) or hidden // heads
    if head_dim < 1:
        raise ConfigError(f"{g.path}: no head dim: {arch}.attention.key_length is missing and embedding_length "
                          f"{hidden} < head_count {heads}")
    d = {
        "model_type": model_type, "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": n_layers,
        "num_attention_heads": heads, "num_key_value_heads": k("attention.head_count_kv", required=False,
                                                               default=heads),
        "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": k("context_length", required=False, default=32768),
        "rms_norm_eps": _f32(k("attention.layer_norm_rms_epsilon", kind="float")),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": any(f"blk.{i}.attn_q.bias" in g.tensors for i in range(n_layers)),
        "bos_token_id": token_id(g, "bos"), "eos_token_id": token_id(g, "eos"),
        "pad_token_id": token_id(g, "padding"),
    }
    if (ff := k("feed_forward_length", required=False)) is not None:
        d["intermediate_size"] = ff
    rope = {"rope_type": "default", "rope_theta": _f32(k("rope.freq_base", required=False, default=10000.0,
                                                         kind="float"))}
    # llama.cpp's reading (llama_model_base::load_hparams, llama_context): the scaling type defaults to linear, the
    # factor to rope.scaling.factor, else the older rope.scale_linear, else none; YaRN's original context to
    # context_length. For these architectures it reads no rope.scaling.yarn_* key (ignored_metadata): beta_fast 32,
    # beta_slow 1 and the attention factor mscale(factor) = 0.1 ln(factor) + 1 always, times
    # rope.scaling.attn_factor, which it applies to every rope type.
    scaling = k("rope.scaling.type", required=False, default="linear", kind="str")
    factor = (k("rope.scaling.factor", required=False, kind="float") or k("rope.scale_linear", required=False,
                                                                          kind="float") or 0.0)
    attn_factor = k("rope.scaling.attn_factor", required=False, default=1.0, kind="float")
    if factor < 0 or attn_factor <= 0:
        raise ConfigError(f"{g.path}: {arch}.rope.scaling factor {factor:g} / attn_factor {attn_factor:g}: expected "
                          f"positive numbers")
    if scaling == "yarn":
        factor = factor or 1.0
        rope.update(rope_type="yarn", factor=_f32(factor), original_max_position_embeddings=k(
            "rope.scaling.original_context_length", required=False, default=d["max_position_embeddings"]))
        if attn_factor != 1:
            rope["attention_factor"] = float(np.float32(attn_factor)) * (0.1 * math.log(factor) + 1 if factor > 1
                                                                         else 1.0)
    elif scaling == "linear" and factor not in (0, 1):
        rope.update(rope_type="linear", factor=_f32(factor))
    elif scaling not in ("none", "linear"):
        raise ConfigError(f"{g.path}: unsupported {arch}.rope.scaling.type {scaling!r}; supported: none, linear, yarn")
    if scaling != "yarn" and attn_factor != 1:
        raise ConfigError(f"{g.path}: {arch}.rope.scaling.attn_factor {attn_factor:g} with rope scaling {scaling!r}: "
                          f"llama.cpp scales cos and sin by it, which has no transformers counterpart here "
                          f"(supported with yarn only)")
    rot = k("rope.dimension_count", required=False, default=head_dim)
    if model_type not in HYBRID_TYPES and rot != head_dim:
        raise ConfigError(f"{g.path}: {arch}.rope.dimension_count {rot} differs from the head dim {head_dim}, which "
                          f"llama.cpp's {arch} refuses (GGML_ASSERT(n_embd_head == n_rot))")
    if model_type in HYBRID_TYPES:
        prf = rot / head_dim
        if int(head_dim * prf) != rot:   # the config takes rot = int(head_dim * factor): keep that exact
            prf = math.nextafter(prf, math.inf)
        rope["partial_rotary_factor"] = prf
    if model_type in MOE_TYPES:
        # norm_topk_prob is not stored: llama.cpp always renormalises the top-k weights (models.md §7.2)
        d.update(num_experts=k("expert_count", kind="count"), num_experts_per_tok=k("expert_used_count", kind="count"),
                 moe_intermediate_size=k("expert_feed_forward_length"), norm_topk_prob=True)
        dense = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in g.tensors]
        if model_type not in MOE_ONLY_TYPES:
            d["mlp_only_layers"] = dense
        elif dense:
            raise WeightsError(f"{g.path}: missing tensor 'blk.{dense[0]}.ffn_gate_inp.weight' (qwen35moe layers "
                               f"are all sparse)")
        if model_type in SHARED_EXPERT_TYPES:
            d["shared_expert_intermediate_size"] = k("expert_shared_feed_forward_length")
    if model_type in HYBRID_TYPES:
        dt_rank = k("ssm.time_step_rank", kind="count")
        d.update(linear_conv_kernel_dim=k("ssm.conv_kernel"), linear_key_head_dim=k("ssm.state_size"),
                 linear_num_key_heads=k("ssm.group_count"), linear_num_value_heads=dt_rank,
                 linear_value_head_dim=k("ssm.inner_size") // dt_rank)
        recurrent = k("attention.recurrent_layers", required=False, kind="ints")
        if recurrent is not None:
            d["layer_types"] = ["linear_attention" if r else "full_attention" for r in recurrent[:n_layers]]
        else:
            d["full_attention_interval"] = k("full_attention_interval", required=False, default=4, kind="count")
        if model_type in MROPE_TYPES:   # llama.cpp requires the sections: [T, H, W, E], E (llama.cpp's) usually 0
            sections = k("rope.dimension_sections", kind="ints")
            if len(sections) != 4:
                raise ConfigError(f"{g.path}: metadata '{arch}.rope.dimension_sections' must have 4 entries, got "
                                  f"{sections}")
            rope.update(mrope_section=sections if sections[3] else sections[:3], mrope_interleaved=True)
        d["mtp_num_hidden_layers"] = nextn
    d["rope_parameters"] = rope
    return d


def reading_notes(g: GGUFFile) -> list[str]:
    """How llama.cpp 0.3.36 reads metadata that would mean something else to transformers' eyes: the HF YaRN
    parameters llama.cpp's converter writes as rope.scaling.yarn_* are read only by other architectures (grok,
    mistral3), and a scaling factor without a scaling type is linear scaling."""
    arch, m = g.architecture, g.metadata
    ignored = [f"{arch}.rope.scaling.yarn_{key} {_f32(typed(g, f'{arch}.rope.scaling.yarn_{key}', 'float')):g}"
               for key in ("beta_fast", "beta_slow", "attn_factor", "ext_factor")
               if f"{arch}.rope.scaling.yarn_{key}" in m]
    notes = [f"not read (llama.cpp does not): {', '.join(ignored)}"] if ignored else []
    factor = _key(g, arch, "rope.scaling.factor", False, kind="float") or _key(g, arch, "rope.scale_linear", False,
                                                                               kind="float")
    if factor not in (None, 0, 1) and f"{arch}.rope.scaling.type" not in m:
        notes.append(f"rope scaling factor {_f32(factor):g} without a scaling type: linear, llama.cpp's default")
    return notes


def llamacpp_note(cfg, notes=()) -> str | None:
    """The one-line note a GGUF gets on load where llama.cpp's semantics, which it runs with, differ from
    transformers' for the same values (cfg.semantic_differences) or llama.cpp reads the metadata its own way
    (reading_notes); None when there is nothing to say."""
    parts = [*cfg.semantic_differences(), *notes]
    return f"{cfg.source}: runs as llama.cpp runs it: " + "; ".join(parts) if parts else None


def conversion_note(before, after) -> str | None:
    """What a GGUF written from a model with config `before` means to llama.cpp (config `after`, read back)
    that the model did not: values llama.cpp does not read (YaRN's betas, ...) and, for an HF model,
    the places where llama.cpp's semantics differ from transformers'. None when the meaning is the same."""
    parts = []
    old, new = before.to_dict(), after.to_dict()
    for key in sorted((set(old) | set(new)) - {"source", "semantics"}):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            parts += [f"{key}.{k} {a.get(k, 'unset')} -> {b.get(k, 'unset')}" for k in sorted(set(a) | set(b))
                      if a.get(k) != b.get(k)]
        elif a != b:
            parts.append(f"{key} {a!r} -> {b!r}")
    if before.semantics != after.semantics:
        parts += after.semantic_differences()
    return f"{after.source}: llama.cpp runs it otherwise than {before.source}: " + "; ".join(parts) if parts else None
