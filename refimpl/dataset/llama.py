"""llama.cpp's `--kl-divergence-base` file, written from a dataset reference (tools/perplexity/perplexity.cpp):

    "_logits_"                         8 bytes
    n_ctx uint32, n_vocab int32, n_chunk int32
    tokens int32 [n_chunk * n_ctx]
    per chunk, per scored position (ctx - 1 - ctx/2 of them): nv = 2 * ((n_vocab + 1) / 2) + 4 uint16, i.e.
        scale float32, min_log_prob float32, n_vocab uint16 codes, one uint16 of padding if n_vocab is odd
    (log p = scale * code + min_log_prob; llama-perplexity's --kl-divergence reads it back that way)

Our rows are that row with our range (compact.RANGE nats instead of 16), so the export is a copy. It needs the
default windows (llama-perplexity's KL mode has no stride).
"""

from pathlib import Path

import numpy as np

from ..errors import InputError
from ..files import write_atomic
from .reference import Reference

MAGIC = b"_logits_"


def row_words(n_vocab: int) -> int:
    return 2 * ((n_vocab + 1) // 2) + 4


def write_kld_base(ref: Reference, out) -> Path:
    if ref.manifest["windows"]["stride"] is not None:
        raise InputError(f"{ref.path}: made with --stride; llama-perplexity's KL divergence reads only the default "
                         f"(consecutive) windows")
    if ref.finished() != list(range(ref.count)):
        raise InputError(f"{ref.path}: {len(ref.finished())} of {ref.count} windows are computed; finish it first")
    V, nv = ref.vocab, row_words(ref.vocab)

    def chunks():
        yield MAGIC + np.array([ref.ctx], "<u4").tobytes() + np.array([V, ref.count], "<i4").tobytes()
        yield np.ascontiguousarray(ref.tokens, "<i4").tobytes()
        for k in range(ref.count):
            w = ref.window(k)
            rows = np.zeros((ref.scored, nv), "<u2")
            rows[:, 0:2] = w["scale"].astype("<f4").view("<u2").reshape(-1, 2)
            rows[:, 2:4] = w["floor"].astype("<f4").view("<u2").reshape(-1, 2)
            rows[:, 4:4 + V] = w["codes"]
            yield rows.tobytes()
    out = Path(out)
    write_atomic(out, chunks())
    return out


def read_kld_base(path) -> dict:
    """The file back: n_ctx, n_vocab, tokens [n_chunk, n_ctx], scale / min_log_prob [n_chunk, S], codes
    [n_chunk, S, n_vocab] (memory-mapped)."""
    data = np.memmap(path, np.uint8, "r")
    if bytes(data[:8]) != MAGIC:
        raise InputError(f"{path}: not a llama.cpp KL-divergence base file (no '_logits_' magic)")
    n_ctx = int(data[8:12].view("<u4")[0])
    n_vocab, n_chunk = (int(x) for x in data[12:20].view("<i4"))
    tok_end = 20 + 4 * n_ctx * n_chunk
    S, nv = n_ctx - 1 - n_ctx // 2, row_words(n_vocab)
    if len(data) != tok_end + 2 * n_chunk * S * nv:
        raise InputError(f"{path}: {len(data)} bytes, expected {tok_end + 2 * n_chunk * S * nv} for n_ctx {n_ctx}, "
                         f"n_vocab {n_vocab}, {n_chunk} chunks")
    rows = data[tok_end:].view("<u2").reshape(n_chunk, S, nv)
    head = np.ascontiguousarray(rows[..., :4]).view("<f4")
    return {"n_ctx": n_ctx, "n_vocab": n_vocab, "tokens": data[20:tok_end].view("<i4").reshape(n_chunk, n_ctx),
            "scale": head[..., 0], "min_log_prob": head[..., 1], "codes": rows[..., 4:4 + n_vocab]}


def llama_kld(codes, scale, min_log_prob, device_logits) -> tuple[np.ndarray, np.ndarray]:
    """KLD and "same top" per row exactly as llama-perplexity's --kl-divergence computes them from a base row:
    log p_base_i = scale * code_i + min_log_prob (not renormalised), entries with log p_base <= -16 left out,
    base top = the first largest code. (float64 here; llama.cpp mixes float32 and double.) For comparing our
    statistics with numbers llama-perplexity printed; refimpl's own KLD is compact.kld."""
    lq = device_logits.astype(np.float64)
    lq = lq - lq.max(-1, keepdims=True)
    lq = lq - np.log(np.exp(lq).sum(-1, keepdims=True))
    lp = scale.astype(np.float32)[:, None] * codes.astype(np.float32) + min_log_prob.astype(np.float32)[:, None]
    lp = lp.astype(np.float64)
    kld = np.where(lp > -16, np.exp(lp) * (lp - lq), 0.0).sum(-1)
    return kld, np.argmax(codes, -1) == np.argmax(device_logits, -1)
