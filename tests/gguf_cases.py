"""The tiny HF checkpoints behind the committed GGUF fixtures (tests/fixtures/gguf), rebuilt bit for bit from a
seed: tests regenerate the HF directory instead of committing it, and compare it with what the GGUF holds.

Each case is an HF config.json dict; weights are refimpl's seeded `random_weights` in the released-checkpoint
layout (per-expert Qwen3-MoE / Qwen3-Next, fused Qwen3.5-MoE), with moderate GDN decays (A in [0.1, 2]) and the
output projection scaled so logits are of size ~1 (a 1e-4 bound then measures agreement, not conditioning).
The tokenizer is a byte-level BPE of TOKENIZER_SIZE tokens (Qwen2 pre-tokenizer regex) with Qwen's special
tokens, so llama.cpp's converter and runtime accept it; config vocab_size pads it to VOCAB.
"""

import hashlib
import json
from pathlib import Path

import gguf
import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from refimpl.formats.gguf import writer
from refimpl.formats.safetensors import write_safetensors
from refimpl.models.config import config_from_dict
from refimpl.models.model import Model
from refimpl.models.weights import Weights
from refimpl.presets import checkpoint_layout, random_weights

VOCAB = 320
SEED = 6
PROMPT = [3, 17, 42, 100, 250, 7, 77, 199, 5, 301]

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=32, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
               bos_token_id=None, eos_token_id=302, pad_token_id=300)
_LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
               linear_num_value_heads=4, full_attention_interval=2)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

CASES = {
    "qwen3": {**_COMMON, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "intermediate_size": 96,
              "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    "qwen3moe": {**_COMMON, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                 "intermediate_size": 96, **_MOE, "norm_topk_prob": True, "tie_word_embeddings": False,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    "qwen3next": {**_COMMON, **_LINEAR, **_MOE, "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
                  "intermediate_size": 96, "shared_expert_intermediate_size": 32, "norm_topk_prob": True,
                  "tie_word_embeddings": False,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}},
    "qwen35": {**_COMMON, **_LINEAR, "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
               "intermediate_size": 96, "tie_word_embeddings": True,
               "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                   "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
    "qwen35moe": {**_COMMON, **_LINEAR, **_MOE, "model_type": "qwen3_5_moe_text",
                  "architectures": ["Qwen3_5MoeForCausalLM"], "shared_expert_intermediate_size": 32,
                  "tie_word_embeddings": False,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                      "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
    # K-quants need rows that are multiples of 256: every matrix's input width is 256
    "qwen3-h256": {**_COMMON, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256,
                   "head_dim": 64, "intermediate_size": 256, "tie_word_embeddings": True,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    # every block type llama.cpp's quantiser makes, one per matrix (EVERY_TYPE): 29 matrices whose rows are 256
    # (hidden) or 128 (attention output, ffn_down) wide
    "qwen3-every-type": {**_COMMON, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256,
                         "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
                         "intermediate_size": 128, "tie_word_embeddings": True,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
}
QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K", "IQ4_XS")   # of qwen3-h256
# qwen3-every-type: GGUF tensor -> the type llama_model_quantize is told to make it (its tensor-type overrides)
EVERY_TYPE = {
    "token_embd.weight": "Q5_K",
    **{f"blk.{i}.{name}.weight": t for i, row in enumerate([
        # attn_q,   attn_k,    attn_v,    ffn_gate, ffn_up   (rows of 256) | attn_output, ffn_down (rows of 128)
        ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1"),
        ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "Q5_0", "Q5_1"),
        ("IQ1_S", "IQ1_M", "IQ4_XS", "TQ1_0", "TQ2_0", "Q8_0", "IQ4_NL"),
        ("Q1_0", "BF16", "F16", "Q2_0", "MXFP4", "NVFP4", "Q4_0"),
    ]) for name, t in zip(("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up", "attn_output", "ffn_down"), row)},
}

# GGUF files whose meaning differs between llama.cpp and transformers (a GGUF runs as llama.cpp runs it; the HF
# checkpoint as transformers runs it): name -> (HF config, the case whose weights it uses, metadata a GGUF of it has
# beyond what refimpl's writer writes, {key: (gguf-py value type, value)}). make_fixtures.py records llama.cpp's
# logits of each file `write_semantics_gguf` makes.
_MROPE = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5, "mrope_interleaved": True}
SEMANTICS = {
    # 8 rotary pairs: llama.cpp leaves pair 5 (sector 5 of 6) / pairs 2, 5 to its fourth section, position 0
    "qwen35-mrope321": ({**CASES["qwen35"], "rope_parameters": {**_MROPE, "mrope_section": [3, 2, 1]}}, "qwen35", {}),
    "qwen35-mrope330": ({**CASES["qwen35"], "rope_parameters": {**_MROPE, "mrope_section": [3, 3, 0]}}, "qwen35", {}),
    "qwen35moe-mrope321": ({**CASES["qwen35moe"], "rope_parameters": {**_MROPE, "mrope_section": [3, 2, 1]}},
                           "qwen35moe", {}),
    # the Gated DeltaNet l2norm: llama.cpp's eps is rms_norm_eps, transformers' 1e-6
    "qwen35-eps1e-2": ({**CASES["qwen35"], "rms_norm_eps": 1e-2}, "qwen35", {}),
    # YaRN: llama.cpp's qwen3 reads none of the rope.scaling.yarn_* keys the converter writes (beta_fast 32,
    # beta_slow 1, attention factor 0.1 ln(factor) + 1), but rope.scaling.attn_factor
    "qwen3-yarn": ({**CASES["qwen3"], "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                    "original_max_position_embeddings": 64, "beta_fast": 8.0, "beta_slow": 2.0,
                    "attention_factor": 1.25}}, "qwen3", {"qwen3.rope.scaling.attn_factor": ("FLOAT32", 0.75)}),
    # a factor alone: llama.cpp's rope scaling type defaults to linear
    "qwen3-factor2": (CASES["qwen3"], "qwen3", {"qwen3.rope.scaling.factor": ("FLOAT32", 2.0)}),
}


def weights(name: str) -> dict[str, np.ndarray]:
    """The case's HF checkpoint tensors (float32), exactly as written to model.safetensors."""
    cfg = config_from_dict(CASES[name], source=name)
    arrays = random_weights(cfg, seed=SEED)
    for k, a in arrays.items():
        if k.endswith(".A_log"):
            u = np.random.default_rng(int(hashlib.sha256(k.encode()).hexdigest()[:8], 16)).uniform(0.1, 2.0, a.shape)
            arrays[k] = np.log(u).astype(np.float32)
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    arrays[head] = arrays[head] * np.float32(0.25)
    return checkpoint_layout(cfg, arrays)


SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]   # ids 300, 301, 302
TOKENIZER_SIZE = 300 + len(SPECIAL)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_CORPUS = ("The quick brown fox jumps over the lazy dog. Hello world! hello, world? It's 2026 and we're "
           "testing a tiny tokenizer: 123 456 7890. Qwen3 models use byte-level BPE with a regex pre-tokenizer.")


def tokenizer_json() -> str:
    """A Qwen2-style byte-level BPE tokenizer.json: 256 byte tokens + 44 merges, then the special tokens."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    tok.add_special_tokens(SPECIAL)
    return tok.to_str()


def write_checkpoint(name: str, directory: str | Path) -> Path:
    """config.json, model.safetensors and the tokenizer files of a case (or of a SEMANTICS case's HF side)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config, base = (SEMANTICS[name][0], SEMANTICS[name][1]) if name in SEMANTICS else (CASES[name], name)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    write_safetensors(directory / "model.safetensors", weights(base))
    (directory / "tokenizer.json").write_text(tokenizer_json())
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "add_prefix_space": False, "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096}, indent=1))
    return directory


def semantics_model(name: str):
    """The HF side of a SEMANTICS case: its config (transformers' semantics) over its base case's weights."""
    config, base, _ = SEMANTICS[name]
    return Model(config_from_dict(config, source=name), Weights(weights(base)))


def write_gguf_with(path: str | Path, model, extra: dict | None = None, edit=None) -> Path:
    """An F32 GGUF of `model` as refimpl's writer lays it out (no vocabulary), with extra metadata
    {key: (gguf-py value type name, value)} and its llama.cpp tensors passed through `edit` first."""
    tensors = writer.hf_to_gguf_tensors(model.config, model.weights)
    if edit is not None:
        edit(tensors)
    wr = gguf.GGUFWriter(path, writer.MODEL_TYPE_TO_ARCH[model.config.model_type])
    writer.write_metadata(wr, model.config, Path(path).stem, "F32", None)
    for key, (vtype, value) in (extra or {}).items():
        wr.add_key_value(key, value, gguf.GGUFValueType[vtype])
    for name, a in tensors.items():
        wr.add_tensor(name, a)
    wr.write_header_to_file(), wr.write_kv_data_to_file(), wr.write_tensors_to_file(), wr.close()
    return Path(path)


def write_semantics_gguf(name: str, path: str | Path) -> Path:
    """The GGUF side of a SEMANTICS case (what make_fixtures.py ran llama.cpp on)."""
    return write_gguf_with(path, semantics_model(name), SEMANTICS[name][2])
