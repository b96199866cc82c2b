"""Text -> token windows, cut as llama.cpp's `llama-perplexity` cuts them (tools/perplexity/perplexity.cpp).

Default (no stride; `perplexity()` there): the token stream is cut into n = N // ctx consecutive, non-overlapping
windows of ctx tokens; in each, the logits at positions ctx/2 .. ctx-2 are scored (each predicts the next token),
so ctx - 1 - ctx/2 tokens per window. This is also the only mode its `--kl-divergence` supports.

With a stride s (`--ppl-stride`; `perplexity_v2()` there): window i starts at token i*s, n = ceil((N - ctx) / s),
and the logits at positions ctx-s-1 .. ctx-2 are scored (s tokens per window).

BOS: where the vocabulary asks for one (a GGUF's `tokenizer.ggml.add_bos_token`), llama-perplexity puts the BOS
id in place of each window's first token in the default mode; Qwen's vocabularies add none. (Its strided mode
writes the BOS after the batch is decoded, so the model never sees it there; we follow the default mode's rule.)
"""

import dataclasses
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..files import parse_json, read_exact, regular_file


@dataclasses.dataclass(frozen=True)
class Windows:
    tokens: np.ndarray      # [n, ctx] int32, what the model is run on (BOS already in place)
    targets: np.ndarray     # [n, S] int32: the token each scored position predicts
    first: int              # scored positions are first .. first + S - 1 in every window
    documents: list         # per window: (document index, start token in that document)

    @property
    def scored(self) -> int:
        return self.targets.shape[1]


def scored_range(ctx: int, stride: int | None) -> tuple[int, int]:
    """(first scored position, number of scored positions) of a window."""
    if stride is None:
        return ctx // 2, ctx - 1 - ctx // 2
    return ctx - stride - 1, stride


def cut(documents: list, ctx: int, stride: int | None = None, bos: int | None = None) -> Windows:
    """Cut every document's token ids (lists of ints) into windows; a document too short for one gives none."""
    if ctx < 4:
        raise InputError(f"--ctx must be at least 4, got {ctx}")
    if stride is not None and not 0 < stride < ctx:
        raise InputError(f"--stride must be in [1, ctx - 1] = [1, {ctx - 1}], got {stride}")
    first, S = scored_range(ctx, stride)
    rows, where = [], []
    for d, ids in enumerate(documents):
        ids = np.asarray(ids, dtype=np.int64)
        if stride is None:
            starts = range(0, (len(ids) // ctx) * ctx, ctx)
        else:
            starts = range(0, max(0, -(-(len(ids) - ctx) // stride)) * stride, stride)
        for s in starts:
            rows.append(ids[s:s + ctx])
            where.append((d, s))
    if not rows:
        longest = max((len(d) for d in documents), default=0)
        raise InputError(f"no window of {ctx} tokens fits the input (longest document: {longest} tokens)")
    tokens = np.stack(rows)
    targets = tokens[:, first + 1:first + 1 + S]
    if bos is not None and stride is None:
        tokens = tokens.copy()
        tokens[:, 0] = bos
    if tokens.min() < 0 or tokens.max() >= 2 ** 31:
        raise InputError("token ids must be in [0, 2^31)")
    return Windows(tokens.astype(np.int32), targets.astype(np.int32), first, where)


def read_documents(text: str | None = None, jsonl: str | None = None, field: str = "text",
                   tokenizer=None) -> list:
    """The documents' token ids: --text FILE is one document (the whole file, as llama-perplexity reads -f);
    --jsonl FILE has one JSON object per line, each a document: its `field` text (tokenised) or `input_ids`.
    tokenizer: a Tokenizer, or a function returning one (called only if some document is text)."""
    if (text is None) == (jsonl is None):
        raise InputError("give the data as --text FILE or --jsonl FILE")
    path = Path(text if text is not None else jsonl)
    raw = read_exact(path, regular_file(path, "dataset", InputError), InputError)
    try:
        data = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    if text is not None:
        return [_encode(tokenizer, data, str(path))]
    docs = []
    for n, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        record = parse_json(line, f"{path}:{n}", InputError)
        if not isinstance(record, dict):
            raise InputError(f"{path}:{n}: expected a JSON object, got {type(record).__name__}")
        if "input_ids" in record:
            ids = record["input_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < 2 ** 31 for t in ids):
                raise InputError(f"{path}:{n}: input_ids must be a list of token ids in [0, 2^31)")
            docs.append(ids)
        elif isinstance(record.get(field), str):
            docs.append(_encode(tokenizer, record[field], f"{path}:{n}"))
        else:
            raise InputError(f"{path}:{n}: no {field!r} text and no input_ids")
    if not docs:
        raise InputError(f"{path}: no records")
    return docs


def _encode(tokenizer, text: str, where: str) -> list:
    if tokenizer is None:
        raise InputError(f"{where}: text needs a tokenizer (the model has none; give --tokenizer)")
    return (tokenizer() if callable(tokenizer) else tokenizer).encode(text)
