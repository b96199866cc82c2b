"""Generation: the decode loop over the model's cache, and a sampler a device can reproduce draw by draw.

Per row and step, from the model's last-position logits l [V] (taken to float64):

  1. repetition penalty (CTRL / HF): for every distinct id t among the row's real prompt tokens and the tokens
     generated so far, l[t] = l[t] / r if l[t] > 0 else l[t] * r.  (Pads are not part of the history.)
  2. greedy (temperature == 0): the token is argmax l, ties to the lowest id. Steps 3-8 do not apply (top-k,
     top-p and min-p always keep the argmax, so they could not change it).
  3. temperature: l = l / T.
  4. order: the ids sorted by (l descending, id ascending); every later step works on this order.
     top-k (k > 0): keep the first k ids of the order.
  5. e = exp(l - l_0) over the candidates (l_0 the largest, so e_0 = 1), correctly rounded to float32 (then
     float64, exactly): all ids, as an array in id order, or the top-k ids in the order; Z = the exact sum of that
     array rounded once (math.fsum; p_i = e_i / Z); E_i = e_0 + ... + e_i summed one by one in the order.
  6. top-p (< 1): keep the shortest prefix whose cumulative probability reaches top_p: id i (0-based in the
     order) is kept iff i == 0 or E_{i-1} < top_p * Z (that is, c_{i-1} < top_p, in this arithmetic).
  7. min-p (> 0): of those, keep ids with e_i >= min_p (that is, p_i >= min_p * p_0).
  8. S = Z if nothing was cut, else E_{n-1} (n kept ids); draw one u ~ U[0, 1) from the row's generator and take
     the first kept id i (in the order) with u * S < E_i (the last kept id if rounding leaves u * S above E_{n-1}).
  These are the exact float64 operations `sample` performs (it sorts only the part of the order that top-p and
  the draw reach, because a full sort of a 248k vocabulary costs ~40 ms a step); `distribution` keeps the same
  ids with a full sort and returns q_i = e_i / S for display; `draw(order, q, u)` is the same inverse CDF over q.

The generator of row b is numpy's `Generator(PCG64(seed_b))` (PCG64 seeded through numpy's SeedSequence), with
seed_b = seed + b for an int seed (or the b-th entry of a list of seeds), and u = generator.random() =
(next 64-bit output >> 11) * 2^-53; a row draws
exactly one u per sampled step. The draws are returned (`Generation.uniforms`), so a device sampler can be fed
the same u and must then pick the same token. Log-probabilities are log_softmax(l)[token] of the model's raw
logits (before the penalty and the warpers): the exact value correctly rounded to float32, as a Python float.
Every step above is IEEE arithmetic or correctly rounded, so a sampled token is the same on every platform.
Where transformers differs: its top-k keeps every id tied with the k-th value (here exactly k, by the order), and
its repetition penalty also counts pad tokens of a padded batch (here a row's history is its real tokens only).
"""

import dataclasses
import math
from typing import Callable

import mpmath
import numpy as np

from .errors import InputError
from .kernels import elementary


@dataclasses.dataclass
class Generation:
    """What `generate` returns; row b of the batch is index b of each list."""
    prompts: list                # [B] the real prompt ids of each row (pads removed)
    tokens: list                 # [B] the generated ids (the eos / stop-completing token included)
    logprobs: list               # [B] log_softmax(raw logits, float64) at each generated id
    finish_reasons: list         # [B] "eos" | "stop" | "length"
    uniforms: list               # [B] the u drawn at each step (empty when greedy)
    texts: list | None = None    # [B] the generated text, when a tokenizer was given
    logits: list | None = None   # [B] float32/64 [N_b, V] raw logits of each step, with return_logits=True

    @property
    def sequences(self) -> list:
        """[B] prompt + generated ids of each row."""
        return [p + t for p, t in zip(self.prompts, self.tokens)]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def check(self):
        def bad(name, rule):
            raise InputError(f"{name} must be {rule}, got {getattr(self, name)!r}")
        if not _real(self.temperature) or self.temperature < 0:
            bad("temperature", "a finite number >= 0")
        if not isinstance(self.top_k, (int, np.integer)) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad("top_k", "an integer >= 0 (0: off)")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1] (1: off)")
        if not _real(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1] (0: off)")
        if not _real(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", "a finite number > 0 (1: off)")
        return self


def _real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and math.isfinite(x)


# ---------------------------------------------------------------- the sampler: pure functions of one row

def repetition_penalty(logits: np.ndarray, history, penalty: float) -> np.ndarray:
    """l [V] -> l with l[t] / r (l[t] > 0) or l[t] * r (l[t] <= 0) for every distinct t in history (CTRL)."""
    if penalty == 1.0 or len(history) == 0:
        return logits
    out = logits.copy()
    seen = np.unique(np.asarray(history, dtype=np.int64))
    out[seen] = np.where(out[seen] > 0, out[seen] / penalty, out[seen] * penalty)
    return out


def greedy(logits: np.ndarray) -> int:
    """argmax, ties to the lowest id."""
    return int(np.argmax(logits))


def top_k_order(logits: np.ndarray, top_k: int = 0) -> np.ndarray:
    """Ids sorted by (logit desc, id asc), the first top_k of them (all when top_k is 0 or >= V)."""
    V = logits.shape[0]
    if 0 < top_k < V:
        kth = np.partition(logits, V - top_k)[V - top_k]    # the k-th largest value
        candidates = np.flatnonzero(logits >= kth)          # ascending ids, ties at the k-th value included
        return candidates[_descending(logits[candidates])[:top_k]]
    return _descending(logits)


def _descending(values: np.ndarray) -> np.ndarray:
    """Positions sorted by (value desc, position asc): an unstable sort (3x faster than a stable one on 248k
    values), then each run of equal values put back in position order."""
    order = np.argsort(-values)
    v = values[order]
    tie = v[1:] == v[:-1]                                   # position i holds the same value as i + 1
    if tie.any():
        in_run = np.zeros(len(order), bool)
        in_run[:-1] |= tie
        in_run[1:] |= tie
        at = np.flatnonzero(in_run)
        run = np.cumsum(np.concatenate([[True], ~tie]))[at]  # one label per run of equal values
        order[at] = order[at][np.lexsort((order[at], run))]
    return order


def top_p_count(p_sorted: np.ndarray, top_p: float) -> int:
    """How many of the sorted probabilities top-p keeps: i is kept iff i == 0 or c_{i-1} < top_p."""
    if top_p >= 1.0:
        return len(p_sorted)
    c = np.cumsum(p_sorted)
    return 1 + int(np.count_nonzero(c[:-1] < top_p))


def min_p_count(p_sorted: np.ndarray, min_p: float) -> int:
    """How many of the sorted probabilities min-p keeps: p_i >= min_p * p_0."""
    if min_p <= 0.0:
        return len(p_sorted)
    return int(np.count_nonzero(p_sorted >= min_p * p_sorted[0]))


def distribution(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Steps 3-8 of the module doc with a full sort: penalised logits l [V] (float64) -> (kept ids in order [n],
    q [n] = e_i / S). Keeps exactly the ids `sample` keeps (the same float64 operations)."""
    l = logits / params.temperature
    V, m = l.shape[0], l.max()
    order = top_k_order(l, params.top_k)
    e = _exp(l[order] - m)
    candidates = e if 0 < params.top_k < V else _exp(l - m)      # in id order without top-k, as `sample` sums them
    N, Z = len(candidates), math.fsum(candidates)
    E = np.cumsum(e)
    n = N if params.top_p >= 1 else 1 + int(np.count_nonzero(E[:-1] < params.top_p * Z))
    if params.min_p > 0:
        n = min(n, int(np.count_nonzero(candidates >= params.min_p)))
    S = Z if n == N else E[n - 1]
    return order[:n], e[:n] / S


def sample(logits: np.ndarray, params: SamplingParams, u: float) -> int:
    """Steps 3-8 with the draw u: the token draw(*distribution(l, params), u) picks, up to rounding, from a sorted
    prefix of the order that grows (x8 from 1024) until it holds the kept ids, or the draw when nothing is cut."""
    l = logits / params.temperature
    V = l.shape[0]
    m = l.max()
    if 0 < params.top_k < V:
        order = top_k_order(l, params.top_k)
        e_all = _exp(l[order] - m)
        prefix = lambda L: order[:L]                                   # noqa: E731
    else:
        e_all = _exp(l - m)
        prefix = lambda L: top_k_order(l, L)                           # noqa: E731
    N, Z = len(e_all), math.fsum(e_all)
    n_min_p = N if params.min_p <= 0 else int(np.count_nonzero(e_all >= params.min_p))
    L = min(N, 1024)
    while True:
        ids = prefix(L)
        E = np.cumsum(_exp(l[ids] - m))                                   # e_0 + ... + e_i in order
        if params.top_p >= 1:
            n_top_p = N
        elif L == N or E[-1] >= params.top_p * Z:                         # c_{i-1} < top_p  <=>  E_{i-1} < top_p Z
            n_top_p = 1 + int(np.count_nonzero(E[:-1] < params.top_p * Z))
        else:
            n_top_p = None                                                # beyond the prefix: more than L
        n = n_min_p if n_top_p is None else min(n_top_p, n_min_p)
        if n <= L:                                                        # the kept ids are all in the prefix
            S = Z if n == N else E[n - 1]
            return int(ids[min(int(np.searchsorted(E[:n], u * S, side="right")), n - 1)])
        if n == N and n_top_p == N:                                       # nothing cut: S = Z is known already
            i = int(np.searchsorted(E, u * Z, side="right"))
            if i < L:
                return int(ids[i])
        L = min(N, 8 * L)


def draw(order: np.ndarray, q: np.ndarray, u: float) -> int:
    """The first id i (in order) with u < q_0 + ... + q_i; the last one if rounding leaves u above the total."""
    i = int(np.searchsorted(np.cumsum(q), u, side="right"))
    return int(order[min(i, len(order) - 1)])


def _exp(d: np.ndarray) -> np.ndarray:
    """exp of float64 arguments, correctly rounded to float32 and returned as float64 (step 5)."""
    return elementary.exp(d, float32_result=True).astype(np.float64)


def log_softmax_at(logits: np.ndarray, token: int) -> float:
    """log_softmax(l)[token] of float32 logits: the exact value correctly rounded to float32, as a Python float,
    so a manifest's log-probabilities are the same on every platform. Float64 logits (the oracle mode) give
    l[token] - m - log(sum_j exp(l_j - m)), m = max l, in NumPy's float64.

    lp = -log1p(R), R = sum_{i != token} exp(l_i - l_token): evaluated in float64 (exps relative error <= 2^-40 each
    by kernels/elementary.py's assumption, R summed exactly by math.fsum, then log1p), |error| <= 2^-37 |lp|;
    where that interval straddles a float32 rounding midpoint, R and lp are recomputed with mpmath at 96 bits."""
    l = np.asarray(logits, np.float64)
    if np.asarray(logits).dtype == np.float64 or not np.isfinite(l).all():   # the oracle; or IEEE's answer
        with np.errstate(all="ignore"):
            m = l.max()
            return float(l[token] - m - np.log(np.exp(l - m).sum()))
    with np.errstate(all="ignore"):
        d = l - l[token]
        d[token] = -np.inf
        lp = -np.log1p(math.fsum(np.exp(d)))
    lo, hi = np.float32(lp - abs(lp) * 2.0 ** -37), np.float32(lp + abs(lp) * 2.0 ** -37)
    if lo.view(np.int32) == hi.view(np.int32):
        return float(lo)
    with mpmath.workprec(96):
        others = np.delete(l, token).tolist()
        R = mpmath.fsum(mpmath.exp(mpmath.mpf(x) - mpmath.mpf(float(l[token]))) for x in others)
        return float(elementary.to_float32(-mpmath.log1p(R)))


def choose(logits: np.ndarray, history, params: SamplingParams,
           rng: np.random.Generator | None) -> tuple[int, float | None]:
    """One row, one step: raw logits [V] -> (token, the u drawn or None when greedy)."""
    l = repetition_penalty(logits.astype(np.float64, copy=False), history, params.repetition_penalty)
    if params.temperature == 0.0:
        return greedy(l), None
    u = float(rng.random())
    return sample(l, params, u), u


# ---------------------------------------------------------------- the decode loop

def generate(model, prompt_ids, max_new_tokens: int = 16, temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, seed=0, eos_token_id=None, *, min_p: float | None = None,
             repetition_penalty: float | None = None,
             stop=(), tokenizer=None, attention_mask=None, callback: Callable | None = None, use_cache: bool = True,
             return_logits: bool = False) -> Generation:
    """Generate up to max_new_tokens per row, sampling as the module doc describes (greedy at temperature 0).

    prompt_ids: [T], [B, T], or a list of B id lists of different lengths (left-padded here). With a [B, T] array,
      attention_mask [B, T] of 1/0 marks left padding (pads before the real tokens). A str (or a list of str) is
      encoded with `tokenizer`.
    temperature, top_k, top_p, min_p, repetition_penalty: None takes the checkpoint's generation_config.json
      (`checkpoint_sampling`; without one: greedy, every warper off).
    eos_token_id: an id or ids that end a row (kept as its last token); None: generation_config.json's
      eos_token_id, else the config's; () or []: never stop early.
    stop: strings that end a row once the decoded generated text contains one (needs `tokenizer`); the token that
      completes it is kept.
    seed: int (row b uses seed + b) or one int per row.
    callback(row, token): called for each new token, rows in order within a step (for streaming).
    use_cache: False recomputes the whole sequence every step (the naive path, for checking the cached one).
    return_logits: also keep every step's raw logits [N_b, V] per row.
    The context limit is checked first: prompt + max_new_tokens <= config.max_position_embeddings for each row.
    Rows that finish leave the batch (their cache rows are dropped), so a row's tokens equal its tokens alone.
    In float32 the logits, the sampler's arithmetic and the log-probabilities are the same bits on every platform.
    """
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
             "repetition_penalty": repetition_penalty}
    s = {**checkpoint_sampling(getattr(model, "generation_config", {})),
         **{k: v for k, v in given.items() if v is not None}}
    return _generate(model, prompt_ids, max_new_tokens, s["temperature"], s["top_k"], s["top_p"], seed,
                     eos_token_id, s["min_p"], s["repetition_penalty"], stop, tokenizer, attention_mask,
                     callback, use_cache, return_logits)


def _generate(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, min_p,
              repetition_penalty, stop, tokenizer, attention_mask, callback, use_cache, return_logits) -> Generation:
    cfg = model.config
    texts = [prompt_ids] if isinstance(prompt_ids, str) else prompt_ids if isinstance(prompt_ids, (list, tuple)) \
        and prompt_ids and all(isinstance(p, str) for p in prompt_ids) else None
    if texts is not None:
        if tokenizer is None:
            raise InputError("a text prompt needs a tokenizer (tokenizer=refimpl.load_tokenizer(...))")
        prompt_ids = [tokenizer.encode(t) for t in texts]
    prompts = _prompts(prompt_ids, attention_mask, cfg.vocab_size)
    B = len(prompts)
    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    params = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty).check()
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > cfg.max_position_embeddings:
        raise InputError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {longest + max_new_tokens} "
                         f"exceeds the model's context limit (max_position_embeddings {cfg.max_position_embeddings})")
    eos = _eos_ids(default_eos(model) if eos_token_id is None else eos_token_id)
    stop = [stop] if isinstance(stop, str) else list(stop)
    if any(not isinstance(s, str) or not s for s in stop):
        raise InputError(f"stop must be non-empty strings, got {stop!r}")
    if stop and tokenizer is None:
        raise InputError("stop strings need a tokenizer to decode the generated text")
    rngs = _generators(seed, B) if params.temperature > 0 else [None] * B

    out = Generation([list(p) for p in prompts], [[] for _ in range(B)], [[] for _ in range(B)], ["length"] * B,
                     [[] for _ in range(B)], None, [[] for _ in range(B)] if return_logits else None)
    active = list(range(B))                      # original row of each batch row still generating
    cache = model.new_cache(B) if use_cache else None
    logits = _first_logits(model, prompts, cache) if max_new_tokens else None
    for step in range(max_new_tokens):
        keep, fed = [], []
        for i, b in enumerate(active):
            history = out.prompts[b] + out.tokens[b] if params.repetition_penalty != 1 else ()
            token, u = choose(logits[i], history, params, rngs[b])
            out.tokens[b].append(token)
            out.logprobs[b].append(log_softmax_at(logits[i], token))
            if u is not None:
                out.uniforms[b].append(u)
            if return_logits:
                out.logits[b].append(logits[i].copy())
            if callback is not None:
                callback(b, token)
            if token in eos:
                out.finish_reasons[b] = "eos"
            elif stop and any(s in tokenizer.decode(out.tokens[b]) for s in stop):
                out.finish_reasons[b] = "stop"
            else:
                keep.append(i)
                fed.append(token)
        active = [active[i] for i in keep]
        if not active or step == max_new_tokens - 1:
            break
        if cache is not None:
            if len(keep) < cache.batch_size:
                cache.select(keep)
            logits = model.forward(np.array(fed, np.int64)[:, None], cache=cache, logits_to_keep=1)[:, -1]
        else:
            logits = _first_logits(model, [out.sequences[b] for b in active], None)
    if return_logits:
        out.logits = [np.stack(x) if x else np.zeros((0, cfg.vocab_size), model.dtype) for x in out.logits]
    if tokenizer is not None:
        out.texts = [tokenizer.decode(t) for t in out.tokens]
    return out


def _first_logits(model, rows: list, cache) -> np.ndarray:
    """Last-position logits [B, V] of left-padded rows (one forward, filling the cache if given)."""
    T = max(len(r) for r in rows)
    ids = np.zeros((len(rows), T), np.int64)
    mask = np.zeros((len(rows), T), np.int64)
    for b, r in enumerate(rows):
        ids[b, T - len(r):], mask[b, T - len(r):] = r, 1
    padded = not mask.all()
    return model.forward(ids, cache=cache, attention_mask=mask if padded else None, logits_to_keep=1)[:, -1]


def _prompts(prompt_ids, attention_mask, vocab_size: int) -> list:
    """The real prompt ids of each row: [T] / [B, T] (+ left-padding mask) / a list of id lists."""
    if isinstance(prompt_ids, (list, tuple)) and prompt_ids and all(isinstance(r, (list, tuple, np.ndarray))
                                                                      for r in prompt_ids):
        if attention_mask is not None:
            raise InputError("attention_mask applies to a [B, T] array of prompt ids, not a list of rows")
        rows = [np.asarray(r) for r in prompt_ids]
    else:
        ids = np.asarray(prompt_ids)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2:
            raise InputError(f"prompt_ids must be [T], [B, T] or a list of id lists, got shape {list(ids.shape)}")
        if attention_mask is None:
            rows = list(ids)
        else:
            m = np.asarray(attention_mask)
            if m.shape != ids.shape:
                raise InputError(f"attention_mask has shape {list(m.shape)}, prompt_ids {list(ids.shape)}")
            m = m != 0
            if (np.diff(m.astype(np.int8), axis=1) < 0).any():
                raise InputError("attention_mask must be left padding: a row's pads all come before its tokens")
            rows = [ids[b][m[b]] for b in range(ids.shape[0])]
    out = []
    for b, r in enumerate(rows):
        if r.ndim != 1 or r.size == 0 or not np.issubdtype(r.dtype, np.integer):
            raise InputError(f"prompt row {b} must be a non-empty list of integer ids, got {r.dtype} {list(r.shape)}")
        if ((r < 0) | (r >= vocab_size)).any():
            raise InputError(f"prompt row {b} has id {int(r[(r < 0) | (r >= vocab_size)][0])} outside the "
                             f"vocabulary [0, {vocab_size})")
        out.append([int(t) for t in r])
    if not out:
        raise InputError("prompt_ids is empty")
    return out


def checkpoint_sampling(generation_config: dict) -> dict:
    """The sampling settings a checkpoint's generation_config.json asks for, as transformers' generate reads
    them: with do_sample, its temperature, top_k, top_p and min_p (transformers' defaults 1.0, 50, 1.0 and off
    where it leaves them out); without, greedy. repetition_penalty either way (default 1: off)."""
    g, off = generation_config, dataclasses.asdict(SamplingParams())
    out = dict(off, repetition_penalty=g.get("repetition_penalty", 1.0))
    if g.get("do_sample"):
        out.update(temperature=g.get("temperature", 1.0), top_k=g.get("top_k", 50), top_p=g.get("top_p", 1.0),
                   min_p=g.get("min_p", 0.0))
    return out


def default_eos(model) -> list:
    """The ids that end a row by default: generation_config.json's eos_token_id, else the config's."""
    eos = getattr(model, "generation_config", {}).get("eos_token_id", model.config.eos_token_id)
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _eos_ids(eos) -> set:
    if eos is None:
        return set()
    ids = [eos] if isinstance(eos, (int, np.integer)) else list(eos)
    if any(not isinstance(t, (int, np.integer)) or isinstance(t, bool) for t in ids):
        raise InputError(f"eos_token_id must be an id or a list of ids, got {eos!r}")
    return {int(t) for t in ids}


def _generators(seed, B: int) -> list:
    seeds = [seed + b for b in range(B)] if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) \
        else list(seed) if isinstance(seed, (list, tuple)) else None
    if seeds is None or len(seeds) != B or any(not isinstance(s, (int, np.integer)) or s < 0 for s in seeds):
        raise InputError(f"seed must be an int >= 0 or one per row ({B}), got {seed!r}")
    return [np.random.Generator(np.random.PCG64(int(s))) for s in seeds]
