"""Tokenizers for the Qwen3 family (`tokenizers.Tokenizer`)."""

from ..errors import ConfigError

# ---------------------------------------------------------------------------------------------------- from GGUF

# The split regex of each llama.cpp pre-tokenizer name (tokenizer.ggml.pre), as the models' tokenizer.json
# writes it: Qwen2 / Qwen3 words are letters (\p{L}); Qwen3.5 words also take combining marks (\p{M}).
GGUF_PRE_TOKENIZERS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+",
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
GGUF_PRE_TOKENIZERS["deepseek-r1-qwen"] = GGUF_PRE_TOKENIZERS["qwen2"]   # llama.cpp maps it to the Qwen2 regex
# Qwen2 / Qwen3 tokenizers NFC-normalise the text first; Qwen3.5's do not normalise (a decomposed "e + U+0301"
# stays two pieces, which its \p{M} in the regex keeps with the letter)
GGUF_NFC = {"qwen2": True, "deepseek-r1-qwen": True, "qwen35": False}
_CONTROL, _USER_DEFINED = 3, 4   # llama.cpp token types


def tokenizer_from_gguf(path_or_metadata):
    """A byte-level BPE `tokenizers.Tokenizer` from a GGUF file (or its `tokenizer_metadata()` dict), built the
    way Qwen's tokenizer.json is: NFC normaliser (Qwen2 / Qwen3; none for Qwen3.5); the pre-tokenizer regex of
    `tokenizer.ggml.pre` (isolated splits), then byte-to-unicode mapping; BPE over the GGUF's tokens and merges;
    control tokens (type 3) added as special tokens and user-defined ones (type 4) as added tokens, neither
    normalised."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    if isinstance(path_or_metadata, dict):
        meta, source = path_or_metadata, "tokenizer metadata"
    else:
        from .gguf import tokenizer_metadata
        meta, source = tokenizer_metadata(path_or_metadata), str(getattr(path_or_metadata, "path", path_or_metadata))
    if meta.get("model") != "gpt2":
        raise ConfigError(f"{source}: tokenizer.ggml.model is {meta.get('model')!r}; only 'gpt2' (byte-level BPE) "
                          f"is supported")
    pre = meta.get("pre")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ConfigError(f"{source}: unsupported tokenizer.ggml.pre {pre!r}; supported: "
                          f"{', '.join(GGUF_PRE_TOKENIZERS)}")
    tokens, types = meta["tokens"], meta["token_types"]
    if types and len(types) != len(tokens):
        raise ConfigError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries, tokens has {len(tokens)}")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("merges") or []]
    bad = next((m for m in merges if len(m) != 2), None)
    if bad is not None:
        raise ConfigError(f"{source}: tokenizer.ggml.merges entry {' '.join(bad)!r} is not 'left right'")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, byte_fallback=False,
                               ignore_merges=False))
    if GGUF_NFC[pre]:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZERS[pre]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    bos = meta.get("bos_token_id") if meta.get("add_bos_token") else None
    eos = meta.get("eos_token_id") if meta.get("add_eos_token") else None
    if bos is not None or eos is not None:   # llama.cpp adds them when encoding with special tokens
        head = f"{tokens[bos]} " if bos is not None else ""
        tail = f" {tokens[eos]}" if eos is not None else ""
        tok.post_processor = processors.Sequence([tok.post_processor, processors.TemplateProcessing(
            single=f"{head}$A{tail}", pair=f"{head}$A{tail} {head}$B{tail}",
            special_tokens=[(tokens[i], i) for i in (bos, eos) if i is not None])])
    added = [AddedToken(tokens[i], special=t == _CONTROL, normalized=False)
             for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    return tok
