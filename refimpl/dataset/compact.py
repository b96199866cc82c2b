"""The compact reference: each scored position's log-softmax over the whole vocabulary in 16 bits per entry, and
the KL divergence against a device computed from it with a bound on its error.

Form (one row per scored position; it is llama.cpp's `--kl-divergence-base` row, with another range):

    l_i    = log_softmax(logits)_i                     float64, from the reference's float32 logits (portable)
    top    = max_i l_i
    floor  = f32(max(min_i l_i, top - RANGE))          RANGE = 40 nats (llama.cpp: 16)
    scale  = f32((top - floor) / 65535)
    code_i = clip(rint((l_i - floor) / scale), 0, 65535)      uint16
    decoded: l~_i = floor + scale * code_i

Every entry within the range is stored to |l~_i - l_i| <= scale / 2 <= RANGE / 131070 = 3.05e-4 nats. Entries
more than RANGE below the top (p_i < e^-40 = 4.2e-18 each) are stored at the floor ("clamped").

KL divergence from the compact form: p^ = softmax(l~) (renormalised), KL^ = sum_i p^_i (log p^_i - log q_i).
Error bound (derivation in docs/dataset.md), with h = scale (so |log p^_i - log p_i| <= h) and S = sum_i p^_i
|log p^_i - log q_i|:

    |KL^ - KL| <= expm1(h) * e^h * (S + h) + expm1(h)^2 + tail,          tail = 0 when nothing was clamped

and since sum_i p_i |log p_i / q_i| <= KL + sqrt(2 KL) (Pinsker), at most about 6.1e-4 * (KL + sqrt(2 KL)).
"""

import numpy as np

from ..kernels import elementary, products

RANGE = 40.0          # nats below the top log-prob that are stored exactly to scale / 2
LEVELS = 65535        # uint16 codes 0 .. 65535


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """The reference's log-probs along the last axis, as float64: for float32 logits x, (x - m) - lse with
    m = max x, lse = log(sum(exp(x - m))), each exp, the sum and the log correctly rounded in float32
    (docs/numerics.md), so the stored codes are the same on every platform; lse is within ~1e-6 nats of exact,
    far inside the codes' half step (scale / 2 >= 3e-4 of slack in the KLD bound). float64 logits (the oracle
    mode): log_softmax64."""
    x = np.asarray(logits)
    if x.dtype == np.float64:
        return log_softmax64(x)
    d = x.astype(np.float32) - x.astype(np.float32).max(axis=-1, keepdims=True)
    lse = elementary.log(products.sum(elementary.exp(d), axis=-1, keepdims=True))
    return d.astype(np.float64) - lse.astype(np.float64)


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    """log p = x - max - log(sum(exp(x - max))), in float64 along the last axis."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def encode(logp: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """log-probs [S, V] float64 -> (codes uint16 [S, V], scale float32 [S], floor float32 [S])."""
    top, low = logp.max(axis=-1), logp.min(axis=-1)
    floor = np.maximum(low, top - RANGE).astype(np.float32)
    scale = ((top - floor.astype(np.float64)) / LEVELS).astype(np.float32)
    safe = np.where(scale > 0, scale, 1).astype(np.float64)[:, None]
    codes = np.rint((logp - floor.astype(np.float64)[:, None]) / safe)
    return np.clip(codes, 0, LEVELS).astype(np.uint16), scale, floor


def decode(codes: np.ndarray, scale: np.ndarray, floor: np.ndarray) -> np.ndarray:
    """The stored log-probs l~ = floor + scale * code, float64 [S, V] (not renormalised)."""
    return floor.astype(np.float64)[:, None] + scale.astype(np.float64)[:, None] * codes.astype(np.float64)


def clamped(scale: np.ndarray, floor: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """[S] bool: rows whose range was cut at RANGE, so their code-0 entries may lie below the floor."""
    return scale.astype(np.float64) * LEVELS >= RANGE * (1 - 1e-6)


def kld(codes, scale, floor, device_logp) -> tuple[np.ndarray, np.ndarray]:
    """KL(reference || device) per row from the compact form, and its error bound (see the module docstring).

    device_logp: the device's log-softmax [S, V] float64. Returns (kld [S], bound [S])."""
    stored = decode(codes, scale, floor)
    ref = stored - np.log(np.exp(stored - stored.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - stored.max(-1, keepdims=True)                                    # renormalised log p^
    p = np.exp(ref)
    diff = ref - device_logp
    with np.errstate(invalid="ignore"):      # 0 * inf where the device gives an entry probability 0
        terms = np.where(p > 0, p * diff, 0.0)
    kl = terms.sum(-1)
    h = scale.astype(np.float64) * (1 + 2.0 ** -20) + 1e-15                # + the float32 header's rounding
    tail = np.zeros_like(h)
    cut = clamped(scale, floor, codes)
    if cut.any():   # a clamped entry's true p_i is anywhere in [0, e^(floor + h)]: its own term, and its mass
        f = floor.astype(np.float64)[:, None] + h[:, None]   # moves the normaliser of every other entry
        zero = (codes == 0) & cut[:, None]
        mass = np.where(zero, np.exp(f), 0.0)
        h = h + mass.sum(-1)
        tail = (2 * mass * (1 + np.abs(f) + np.abs(np.where(zero, device_logp, 0.0)))).sum(-1) * np.exp(h)
    S = np.abs(terms).sum(-1)
    e = np.expm1(h)
    return kl, e * np.exp(h) * (S + h) + e * e + tail
