"""The vocabulary a GGUF embeds (tokenizer.ggml.*), as plain Python data."""

from ...errors import ConfigError, brief
from .config import token_id, typed
from .reader import GGUFFile, StringArray


def tokenizer_metadata(source) -> dict:
    """The GGUF's embedded tokenizer as plain Python data: model ("gpt2" = byte-level BPE), pre (pre-tokenizer
    name, e.g. "qwen2", "qwen35"), tokens (list[str]), token_types (list[int]: 1 normal, 2 unknown, 3 control,
    4 user-defined, 5 unused, 6 byte), merges (list[str], "a b"), bos/eos/pad/unk token ids (or None),
    add_bos_token / add_eos_token (or None) and chat_template (or None)."""
    g = source if isinstance(source, GGUFFile) else GGUFFile(source)
    m = g.metadata
    if "tokenizer.ggml.model" not in m:
        raise ConfigError(f"{g.path}: no tokenizer (metadata 'tokenizer.ggml.model' is missing)")

    def get(key, kind):
        return typed(g, f"tokenizer.{key}", kind) if f"tokenizer.{key}" in m else None

    def strings(key):
        v = m.get(f"tokenizer.ggml.{key}")
        if v is None:
            return []
        if not isinstance(v, StringArray):
            raise ConfigError(f"{g.path}: metadata 'tokenizer.ggml.{key}': expected an array of strings, got "
                              f"{brief(v)}")
        return list(v)
    return {
        "model": get("ggml.model", "str"), "pre": get("ggml.pre", "str"), "tokens": strings("tokens"),
        "token_types": get("ggml.token_type", "ints") or [], "merges": strings("merges"),
        **{f"{key}_token_id": token_id(g, which) for key, which in (("bos", "bos"), ("eos", "eos"),
                                                                      ("pad", "padding"), ("unk", "unknown"))},
        "add_bos_token": get("ggml.add_bos_token", "bool"), "add_eos_token": get("ggml.add_eos_token", "bool"),
        "chat_template": get("chat_template", "str"),
    }
