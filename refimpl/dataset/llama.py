"""llama.cpp's `--kl-divergence-base` file, written from a dataset reference (tools/perplexity/perplexity.cpp):

    "_logits_"                         8 bytes
    n_ctx uint32, n_vocab int32, n_chunk int32
    tokens int32 [n_chunk * n_ctx]
    per chunk, per scored position (ctx - 1 - ctx/2 of them): nv = 2 * ((n_vocab + 1) / 2) + 4 uint16, i.e.
        scale float32, min_log_prob float32, n_vocab uint16 codes, one uint16 of padding if n_vocab is odd
    (log p = scale * code + min_log_prob; llama-perplexity's --kl-divergence reads it back that way)

Our rows are that row with our range (compact.RANGE nats instead of 16), so the export is a copy. It needs the
default windows (llama-perplexity's KL mode has no stride).

And llama.cpp's definition of the statistics it prints from such a row (llama_rows per token, llama_summary over
them): compare-logits' second column, beside the exact KL divergence (compact.kld, stats.summarise).
"""

import math
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..files import write_atomic
from . import stats
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


def llama_rows(codes, scale, min_log_prob, device_logits, targets) -> dict:
    """Per scored position, what llama-perplexity --kl-divergence computes from a base-file row and the device's
    logits (perplexity.cpp, `log_softmax(n_vocab, logits, base_log_prob, tok, kld)`), in its float32 / double
    arithmetic:

        m = max_i x_i (f32), imax its first index;  lse = f32(log(sum_i f64(expf(x_i - m))))
        nll = (m + lse) - x_tok                                               f32
        log p_base_i = scale * code_i + min_log_prob                         f32; not renormalised
        nll_base = -log p_base_tok                                           f32
        kld = sum_{i: log p_base_i > -16} f64(expf(log p_base_i) * ((log p_base_i - x_i) + (m + lse)))
        same top: imax == the first index of the largest log p_base;  dp = expf(-nll) - expf(-nll_base)   f32

    So its KLD keeps only the base entries above -16 nats and does not renormalise them, and its base NLL is the
    16-bit row's: this is llama.cpp's definition (the numbers llama-perplexity prints), not the KL divergence
    (compact.kld). codes [S, V] uint16, scale / min_log_prob [S] float32, device_logits [S, V] (read as float32,
    as llama.cpp holds them), targets [S]. Returns {kld float64, nll, nll_base, p_diff float32, same_top bool}."""
    x = np.asarray(device_logits).astype(np.float32)                                     # [S, V]
    r = np.arange(x.shape[0])
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = x.max(-1)                                                                    # [S] f32
        lse = np.log(np.exp(x - m[:, None]).astype(np.float64).sum(-1)).astype(np.float32)
        top = (m + lse).astype(np.float32)                                               # f32 m + lse
        nll = top - x[r, targets]                                                        # f32
        lp = scale.astype(np.float32)[:, None] * codes.astype(np.float32) \
            + min_log_prob.astype(np.float32)[:, None]                                   # f32 log p_base [S, V]
        terms = np.exp(lp) * ((lp - x) + top[:, None])                                   # f32
        kld = np.where(lp > np.float32(-16), terms, np.float32(0)).astype(np.float64).sum(-1)
        nll_base = -lp[r, targets]
        p_diff = np.exp(-nll) - np.exp(-nll_base)
    return {"kld": kld, "nll": nll, "nll_base": nll_base, "p_diff": p_diff,
            "same_top": np.argmax(x, -1) == np.argmax(lp, -1)}


def percentile_f32(sorted_values: np.ndarray, fraction: float) -> float:
    """llama-perplexity's percentile of float32 values, in its float arithmetic."""
    v = np.asarray(sorted_values, np.float32)
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    p = np.float32(fraction) * np.float32(len(v) - 1)
    i = int(p)
    t = np.float32(p - np.float32(i))
    return float((np.float32(1) - t) * v[i] + t * v[min(i + 1, len(v) - 1)])


def distribution_f32(values: np.ndarray, sums: np.ndarray | None = None) -> dict:
    """stats.distribution as llama-perplexity prints it: mean +- u from the double values (`sums`, default
    `values`), order statistics of the values stored as float32."""
    v = np.sort(np.asarray(values, np.float32))
    m, u = stats.mean_and_uncertainty(np.asarray(values if sums is None else sums, np.float64))
    n = len(v)
    med = np.float32(0.5) * (v[n // 2] + v[n // 2 - 1]) if n % 2 == 0 else v[n // 2]
    return {"mean": m, "uncertainty": u, "min": float(v[0]), "median": float(med), "max": float(v[-1]),
            **{f"p{100 * f:g}": percentile_f32(v, f) for f in stats.PERCENTILES}}


def llama_summary(rows: dict) -> dict:
    """llama-perplexity's statistics over llama_rows' per-token arrays (concatenated): the keys of
    stats.summarise it prints (PPL(Q), PPL(base), their ratio, difference and correlation, KLD, dp, RMS dp, same
    top p), each computed as perplexity.cpp computes it."""
    nll, base = rows["nll"].astype(np.float64), rows["nll_base"].astype(np.float64)
    n = len(nll)
    dp = rows["p_diff"].astype(np.float32)
    dp2 = (dp * dp).astype(np.float64)                                       # f32 square, summed in double
    mse = stats.mean_and_uncertainty(dp2)
    rms = math.sqrt(mse[0])
    top = float(np.mean(rows["same_top"]))
    return {
        "tokens": n,
        **stats.perplexities(nll, base),
        "kld": distribution_f32(rows["kld"]),
        "p_diff": distribution_f32(dp),
        "rms_p_diff": {"value": rms, "uncertainty": 0.5 / rms * mse[1] if rms > 0 else 0.0},
        "same_top": {"value": top, "uncertainty": math.sqrt(top * (1 - top) / (n - 1)) if n > 1 else 0.0},
        "definition": DEFINITION,
    }


DEFINITION = ("llama.cpp's (llama-perplexity --kl-divergence on this reference's export-kld-base file): the base "
              "log-probs are the 16-bit rows, not renormalised, entries at or below -16 nats left out of the KLD; "
              "float32 per-token values")
