"""Scaled dot-product attention with Lq != Lk, GQA, and the masks device graphs use.

Queries sit at absolute key indices offset .. offset+Lq-1 over keys 0 .. Lk-1 (offset = Lk - Lq for a cache
continuation). Masks are additive: 0 where attention is allowed, finfo(dtype).min where it is not (as
transformers' eager path builds them), optionally clamped from below to a floor as device graphs do.
"""

import numpy as np

from . import elementary, products
from .activation import compute_dtype, identity, softmax, unhooked


def causal_mask(Lq: int, Lk: int, *, offset: int | None = None, sliding_window: int | None = None,
                   key_valid: np.ndarray | None = None, dtype=np.float32) -> np.ndarray:
    """Additive causal mask [B|1, 1, Lq, Lk].

    query i (key index q = offset + i) may see key j iff  j <= q  and  j > q - sliding_window (if set)
    and key_valid[b, j] (if given, [B, Lk] of 0/1: the padding mask).
    """
    offset = Lk - Lq if offset is None else offset
    q_idx = offset + np.arange(Lq)[:, None]
    kv_idx = np.arange(Lk)[None, :]
    allowed = kv_idx <= q_idx
    if sliding_window is not None:
        allowed &= kv_idx > q_idx - sliding_window
    allowed = allowed[None, None]  # [1, 1, Lq, Lk]
    if key_valid is not None:
        allowed = allowed & (np.asarray(key_valid) != 0)[:, None, None, :]
    return np.where(allowed, dtype(0), np.finfo(dtype).min).astype(dtype)



def sdpa(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None, *,
         scale: float | None = None, mask_floor: float | None = None, return_weights: bool = False, rnd=identity):
    """o = softmax(q k^T * scale + M) v, with grouped-query attention.

    q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv], mask [B|1, Hq|1, Lq, Lk] additive.
    Query head h reads kv head h // (Hq/Hkv) (repeat_interleave), computed by grouping the query heads
    instead of repeating K and V. scale defaults to D^-1/2 and multiplies the product after the matmul.
    mask_floor clamps the mask from below (max(M, floor)), as graphs with a finite "-inf" do.
    Softmax runs in at least float32; probabilities are cast back to q's dtype before the value product.
    rnd (identity by default) is the activation cast of reduced-precision emulation, applied where transformers'
    eager attention casts: after q k^T, after the scale, after the mask add, the probabilities, the output.
    Returns o [B, Hq, Lq, Dv], or (o, scores, probs) with scores/probs [B, Hq, Lq, Lk] if return_weights.
    """
    scores = attention_scores(q, k, mask, scale=scale, mask_floor=mask_floor, rnd=rnd)
    probs = attention_probs(scores, q.dtype, rnd=rnd)
    o = attend(probs, v, rnd=rnd)
    return (o, scores, probs) if return_weights else o


def attention_scores(q: np.ndarray, k: np.ndarray, mask: np.ndarray | None = None, *, scale: float | None = None,
                     mask_floor: float | None = None, rnd=identity, at=unhooked) -> np.ndarray:
    """s = q k^T * scale + max(M, floor) with GQA: q [B, Hq, Lq, D], k [B, Hkv, Lk, D] (or k^T [B, Hkv, 1, D, Lk]
    as a products.Constant: a cache's, Cache.operands) -> s [B, Hq, Lq, Lk].
    Sub-op points: q*k^T, scale (the constant), scaled, mask (as added, after the floor)."""
    B, Hq, Lq, D = q.shape
    kt = k if isinstance(k, products.Constant) else k[:, :, None].swapaxes(-1, -2)     # k^T [B, Hkv, 1, D, Lk]
    Hkv, Lk = kt.shape[1], kt.shape[-1]
    n_rep = Hq // Hkv
    scale = elementary.inverse_sqrt(D) if scale is None else scale
    qg = q.reshape(B, Hkv, n_rep, Lq, D)
    # [B, Hkv, n_rep, Lq, Lk]
    qk = at("q*k^T", rnd(products.matmul(qg, kt)))                                      # q k^T
    scores = at("scaled", rnd(qk * at("scale", q.dtype.type(scale))))                   # q k^T * scale
    if mask is not None:
        if mask_floor is not None:
            mask = np.maximum(mask, mask.dtype.type(mask_floor))
        mask = at("mask", mask)
        heads = mask.shape[1]
        scores = rnd(scores + mask.reshape(mask.shape[0], Hkv if heads > 1 else 1, n_rep if heads > 1 else 1, Lq, Lk))
    return scores.reshape(B, Hq, Lq, Lk)


def attention_probs(scores: np.ndarray, dtype, *, rnd=identity) -> np.ndarray:
    """p = softmax(scores) over the key axis, in at least float32, cast to `dtype` (the value product's)."""
    return rnd(softmax(scores.astype(compute_dtype(scores), copy=False)).astype(dtype, copy=False))


def attend(probs: np.ndarray, v: np.ndarray, *, rnd=identity) -> np.ndarray:
    """o = p v with GQA.  probs [B, Hq, Lq, Lk] or grouped [B, Hkv, Hq/Hkv, Lq, Lk], v [B, Hkv, Lk, Dv] (or
    [B, Hkv, 1, Lk, Dv] as a products.Constant: a cache's, Cache.operands) -> o [B, Hq, Lq, Dv]; query head h
    reads kv head h // (Hq/Hkv)."""
    v = v if isinstance(v, products.Constant) else v[:, :, None]                        # [B, Hkv, 1, Lk, Dv]
    B, Hkv, _, Lk, Dv = v.shape
    Lq = probs.shape[-2]
    probs = probs.reshape(B, Hkv, -1, Lq, Lk)
    return rnd(products.matmul(probs, v)).reshape(B, -1, Lq, Dv)
