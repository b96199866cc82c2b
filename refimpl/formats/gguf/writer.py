"""A model written as a llama.cpp GGUF: its tensors under llama.cpp's names in llama.cpp's layout (names.py), the
metadata keys llama.cpp's converter writes, block types quantised by gguf-py; atomically."""

import logging
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
from gguf.constants import GGMLQuantizationType as qtypes

from ...errors import ConfigError, FormatError, WeightsError
from ...files import atomic_path, output_file
from ...models.config import config_from_dict
from ...models.weights import Weights
from .config import MODEL_TYPE_TO_ARCH, config_dict, conversion_note
from .names import norm_names, plain_names, retile, split_qkvz, tile_v_heads
from .reader import GGUFFile

_log = logging.getLogger(__name__)

WRITE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
_FILE_TYPE = {"F32": 0, "F16": 1, "BF16": 32, "Q8_0": 7, "Q4_0": 2}     # llama_ftype (general.file_type)


def hf_to_gguf_tensors(cfg, w) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array (torch order) in llama.cpp's layout, every conversion transform applied, as
    convert_hf_to_gguf.py writes them. `w` maps HF names to arrays (a Weights, or a dict)."""
    w = w if isinstance(w, Weights) else Weights(w)
    f32 = lambda name: np.asarray(w[name], dtype=np.float32)
    out = {gg: f32(hf) for hf, gg in plain_names(cfg).items()}
    for hf, gg in norm_names(cfg).items():
        out[gg] = f32(hf) + np.float32(1) if cfg.zero_centered_norms else f32(hf)
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}", f"blk.{i}"
        if cfg.is_moe_layer(i):
            experts = [w.expert(f"{p}.mlp.experts", e) for e in range(cfg.num_experts)]
            for k, proj in enumerate(("gate", "up", "down")):
                out[f"{b}.ffn_{proj}_exps.weight"] = np.stack([np.asarray(x[k], np.float32) for x in experts])
            if cfg.shared_expert_intermediate_size:
                out[f"{b}.ffn_gate_inp_shexp.weight"] = f32(f"{p}.mlp.shared_expert_gate.weight")  # [1, H]
        if cfg.layer_types[i] != "linear_attention":
            continue
        q = f"{p}.linear_attn"
        r, key_dim = Hv // Hk, Hk * Dk
        tile = (lambda a, axis, d, start=0: retile(tile_v_heads, a, axis, d, start, Hk, r)) \
            if not cfg.fused_linear_projections and Hk != Hv else (lambda a, axis, d, start=0: a)
        # -exp(A_log), evaluated in float64 and rounded once (within an ulp of torch's float32 exp)
        out[f"{b}.ssm_a"] = tile((-np.exp(f32(f"{q}.A_log").astype(np.float64))).astype(np.float32), 0, 1)
        out[f"{b}.ssm_dt.bias"] = tile(f32(f"{q}.dt_bias"), 0, 1)
        out[f"{b}.ssm_conv1d.weight"] = tile(f32(f"{q}.conv1d.weight")[:, 0, :], 0, Dv, 2 * key_dim)
        out[f"{b}.ssm_norm.weight"] = f32(f"{q}.norm.weight")
        out[f"{b}.ssm_out.weight"] = tile(f32(f"{q}.out_proj.weight"), 1, Dv)
        if cfg.fused_linear_projections:
            out[f"{b}.attn_qkv.weight"], out[f"{b}.attn_gate.weight"] = split_qkvz(
                f32(f"{q}.in_proj_qkvz.weight"), Hk, Dk, r * Dv)
            out[f"{b}.ssm_ba.weight"] = f32(f"{q}.in_proj_ba.weight")
        else:
            out[f"{b}.attn_qkv.weight"] = tile(f32(f"{q}.in_proj_qkv.weight"), 0, Dv, 2 * key_dim)
            out[f"{b}.attn_gate.weight"] = tile(f32(f"{q}.in_proj_z.weight"), 0, Dv)
            out[f"{b}.ssm_beta.weight"] = tile(f32(f"{q}.in_proj_b.weight"), 0, 1)
            out[f"{b}.ssm_alpha.weight"] = tile(f32(f"{q}.in_proj_a.weight"), 0, 1)
    return out


def _stays_f32(name: str, a: np.ndarray) -> bool:
    """llama.cpp keeps these in F32 whatever the file type: 1-D tensors, norms, the MoE routers, the conv."""
    return (a.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight")
            or ".ffn_gate_inp" in name or ".ssm_conv1d" in name)


def encode_tensor(name: str, a: np.ndarray, qtype: str):
    """(data, ggml type) of one tensor for file type `qtype`: F32 / F16 / BF16 as is; Q8_0 / Q4_0 by gguf-py's
    quantiser (llama.cpp's reference rounding); a tensor whose rows are not whole blocks falls back to F16, as
    llama.cpp's converter does."""
    if qtype == "F32" or _stays_f32(name, a):
        return a.astype(np.float32), qtypes.F32
    if qtype == "F16":
        return a.astype(np.float16), qtypes.F16
    try:
        return gguf.quants.quantize(a.astype(np.float32), qtypes[qtype]), qtypes[qtype]
    except (gguf.quants.QuantError, ValueError):
        return a.astype(np.float16), qtypes.F16


def write_metadata(wr, cfg, name: str, qtype: str, tokenizer: dict | None) -> None:
    """The metadata keys llama.cpp's converter writes for this architecture (models.md §7.2, §7.4)."""
    arch = MODEL_TYPE_TO_ARCH[cfg.model_type]
    wr.add_type("model")
    wr.add_name(name)
    wr.add_block_count(cfg.num_hidden_layers)
    wr.add_context_length(cfg.max_position_embeddings)
    wr.add_embedding_length(cfg.hidden_size)
    if cfg.intermediate_size is not None:
        wr.add_feed_forward_length(cfg.intermediate_size)
    wr.add_head_count(cfg.num_attention_heads)
    wr.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope
    if rope["rope_type"] in ("linear", "yarn"):
        wr.add_string(f"{arch}.rope.scaling.type", rope["rope_type"])
        wr.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
        if rope["rope_type"] == "yarn":
            wr.add_uint32(f"{arch}.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
            for hf, key in (("attention_factor", "attn_factor"), ("beta_fast", "beta_fast"),
                            ("beta_slow", "beta_slow")):
                if rope.get(hf) is not None:
                    wr.add_float32(f"{arch}.rope.scaling.yarn_{key}", rope[hf])
    elif rope["rope_type"] != "default":
        raise ConfigError(f"{cfg.source}: rope_type {rope['rope_type']!r} has no GGUF encoding here "
                          f"(supported: default, linear, yarn)")
    if cfg.mrope_section is not None:   # [T, H, W, E]: llama.cpp's fourth (E) section is 0 unless a GGUF had one
        wr.add_array(f"{arch}.rope.dimension_sections", [int(v) for v in (*cfg.mrope_section, 0, 0)[:4]])
    wr.add_rope_freq_base(rope["rope_theta"])
    wr.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.num_experts:
        wr.add_expert_count(cfg.num_experts)
        wr.add_expert_used_count(cfg.num_experts_per_tok)
    wr.add_key_length(cfg.head_dim)
    wr.add_value_length(cfg.head_dim)
    wr.add_file_type(_FILE_TYPE[qtype])
    if cfg.num_experts:
        wr.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size:
            wr.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if cfg.is_hybrid:
        wr.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
        wr.add_ssm_state_size(cfg.linear_key_head_dim)
        wr.add_ssm_group_count(cfg.linear_num_key_heads)
        wr.add_ssm_time_step_rank(cfg.linear_num_value_heads)
        wr.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
        wr.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in cfg.layer_types])
        wr.add_uint32(f"{arch}.full_attention_interval", _interval(cfg.layer_types))
        wr.add_rope_dimension_count(cfg.rotary_dim)
    wr.add_quantization_version(2)
    if tokenizer is None:   # no vocabulary: llama.cpp then sizes it from {arch}.vocab_size
        wr.add_tokenizer_model("none")
        wr.add_vocab_size(cfg.vocab_size)
        eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, (list, tuple)) else cfg.eos_token_id
        ids = {"bos": cfg.bos_token_id, "eos": eos, "pad": cfg.pad_token_id}
    else:
        wr.add_tokenizer_model(tokenizer.get("model", "gpt2"))
        if tokenizer.get("pre"):
            wr.add_tokenizer_pre(tokenizer["pre"])
        wr.add_token_list(tokenizer["tokens"])
        wr.add_token_types([int(t) for t in tokenizer["token_types"]])
        if tokenizer.get("merges"):
            wr.add_token_merges(tokenizer["merges"])
        ids = {key: tokenizer.get(f"{key}_token_id") for key in ("bos", "eos", "pad", "unk")}
    keys = {"bos": "bos", "eos": "eos", "pad": "padding", "unk": "unknown"}   # llama.cpp's key names
    for key, value in ids.items():
        if value is not None:
            wr.add_uint32(f"tokenizer.ggml.{keys[key]}_token_id", int(value))
    if tokenizer is None:
        return
    for key in ("add_bos_token", "add_eos_token"):
        if tokenizer.get(key) is not None:
            wr.add_bool(f"tokenizer.ggml.{key}", bool(tokenizer[key]))
    if tokenizer.get("chat_template"):
        wr.add_chat_template(tokenizer["chat_template"])


def _check_tokenizer(cfg, tokenizer: dict | None) -> None:
    if tokenizer is not None and len(tokenizer["tokens"]) != cfg.vocab_size:
        raise WeightsError(f"{cfg.source}: tokenizer has {len(tokenizer['tokens'])} tokens but the embedding "
                           f"'model.embed_tokens.weight' has {cfg.vocab_size} rows")


def _interval(layer_types) -> int:
    """full_attention_interval when the layers follow one (else 4, llama.cpp's default; recurrent_layers rules)."""
    for n in range(1, len(layer_types) + 1):
        if all((t != "linear_attention") == ((i + 1) % n == 0) for i, t in enumerate(layer_types)):
            return n
    return 4


def write_gguf(path: str | Path, model, qtype: str = "F32", tokenizer: dict | None = None,
               name: str | None = None) -> Path:
    """Write a model (config + weights) as a llama.cpp GGUF of file type `qtype` (F32, F16, BF16, Q8_0, Q4_0),
    atomically: a temporary file beside `path`, renamed into place only when complete.
    tokenizer: `tokenizer_metadata()` of a GGUF (plain data) to embed; without it the file has no vocabulary."""
    path = output_file(path, "GGUF file")
    qtype = qtype.upper()
    if qtype not in WRITE_TYPES:
        raise ConfigError(f"{path}: unsupported GGUF type {qtype!r}; supported: {', '.join(WRITE_TYPES)}")
    cfg = model.config
    if cfg.model_type not in MODEL_TYPE_TO_ARCH:
        raise ConfigError(f"{path}: model_type {cfg.model_type!r} has no GGUF architecture")
    _check_tokenizer(cfg, tokenizer)
    tensors = hf_to_gguf_tensors(cfg, model.weights)
    with atomic_path(path, "GGUF file", FormatError) as tmp:
        wr = gguf.GGUFWriter(tmp, MODEL_TYPE_TO_ARCH[cfg.model_type])
        try:
            write_metadata(wr, cfg, name or path.stem, qtype, tokenizer)
            for tname, a in tensors.items():
                data, ggml_type = encode_tensor(tname, a, qtype)
                wr.add_tensor(tname, data, raw_dtype=ggml_type)
            wr.write_header_to_file()
            wr.write_kv_data_to_file()
            wr.write_tensors_to_file()
        finally:
            wr.close()
    try:   # the file as llama.cpp's semantics read it
        back = config_from_dict(config_dict(GGUFFile(path)), str(path), "llama.cpp")
    except (ConfigError, WeightsError) as e:   # written as asked, but not a model file refimpl reads back
        _log.warning(f"{path}: written, but it does not read back as a model: {e}")
    else:
        if (note := conversion_note(cfg, back)) is not None:
            _log.warning(note)
    return path
