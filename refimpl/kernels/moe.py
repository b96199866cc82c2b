"""Mixture-of-experts routing and mixing (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE).

router:  p = softmax(float32(logits)) over all E; (w, idx) = top-k(p); w <- w / sum(w) if renormalised;
         w cast back to the logits dtype.
mix:     out = sum over the chosen experts, in ascending expert id, of w_e * expert_e(x), from zeros (a device
         graph's: summed over the k slots, as its ReduceSum).
shared:  out += sigmoid(x . w_sg) * shared_expert(x)   (the model composes it: a linear, then sigmoid)
"""

import numpy as np

from . import products
from .activation import compute_dtype, identity, softmax, unhooked
from .htp_quantised import topk_order


def route(logits: np.ndarray, top_k: int, renormalize: bool, *, rnd=identity, at=unhooked):
    """logits [N, E] -> probs [N, E] (float32+), weights [N, k] (logits dtype), experts [N, k] int64.

    Experts are ordered by descending probability; exact ties go to the lower expert id (torch.topk on CPU
    breaks exact ties differently; the `selected_experts` tap records the choice). rnd: the activation cast of
    the weights (reduced-precision emulation; identity by default). Points (`at`, over the MoE block's nodes):
    router_probs, routing_weights/top-k (the chosen probabilities), routing_weights/sum (their sum); where the
    device graph computes the renormalised weights as the softmax of the top-k logits (`at.forms`: the routing
    weights' form "Softmax"), routing_weights/top-k holds the chosen logits (_top_logits_softmax).
    """
    probs = at("router_probs", softmax(logits.astype(compute_dtype(logits), copy=False)))   # p = softmax(logits)
    if renormalize and at.forms.get("routing_weights") == "Softmax":   # a device graph's form: top-k of the logits
        weights, experts = _top_logits_softmax(logits, top_k, at)       # (then the softmax over the k)
        return probs, rnd(weights.astype(logits.dtype, copy=False)), experts
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = at("routing_weights/top-k", np.take_along_axis(probs, experts, axis=-1))     # the top-k p
    if renormalize:
        weights = weights / at("routing_weights/sum", products.sum(weights, axis=-1, keepdims=True))  # w / sum w
    return probs, rnd(weights.astype(logits.dtype, copy=False)), experts


def _top_logits_softmax(logits: np.ndarray, top_k: int, at) -> tuple[np.ndarray, np.ndarray]:
    """The renormalised routing in the order a device graph rewrote it (tests/e2e/quantised.py
    routing_as_topk_softmax): the top k of the logits, then the softmax over those k (= the top k of the softmax over
    all experts, renormalised). The top-k point's quantiser acts on the whole row (what the TopK compares: the HTP's
    float16 values of the codes), ties the higher expert id first (the HTP's TopK); the chosen values are the
    Softmax's operand.  -> weights [N, k], experts [N, k]."""
    ranked = at("routing_weights/top-k", logits.astype(compute_dtype(logits), copy=False))   # [N, E] as compared
    experts = topk_order(ranked, top_k)                                                      # ties: the higher id
    top = np.take_along_axis(ranked, experts, axis=-1)                                       # the k largest
    at.operand("routing_weights/top-k", top)                                                 # as the Softmax reads
    return softmax(top), experts                                                             # softmax over the k


def mix_experts(x: np.ndarray, experts: np.ndarray, weights: np.ndarray, expert_fn, *, rnd=identity,
                at=unhooked, by_slot: bool = False) -> np.ndarray:
    """x [N, H], experts/weights [N, k], expert_fn(e, x_e [n_e, H]) -> [n_e, H]  ->  out [N, H].

    Each term is weighted after the expert's down projection and added in ascending expert id; in emulated
    bf16 / fp16 the weighted term and the running sum are rounded (transformers' index_add_ in that dtype).
    by_slot: the terms summed over the k slots instead (an export's ReduceSum of weighted [N, k, H] over k, in the
    router's order: products.sum, which is ONNX Runtime's order inside products.onnxruntime_cpu()).
    Point: weighted (each weighted term).
    """
    if by_slot:
        terms = np.zeros((*experts.shape, x.shape[-1]), x.dtype)                # [N, k, H]
        for e in np.unique(experts):
            token, slot = np.nonzero(experts == e)
            at.select(expert=int(e), tokens=token, slots=slot)                  # the rows expert e's ops read
            terms[token, slot] = rnd(at("weighted", expert_fn(int(e), x[token]) * weights[token, slot, None]))
        at.select()
        at.operand("weighted", terms)                                           # the terms as the ReduceSum reads
        return rnd(products.sum(terms, axis=1))                                 # sum over the k slots
    out = np.zeros_like(x)
    for e in np.unique(experts):
        token, slot = np.nonzero(experts == e)  # a token picks an expert at most once: no repeated rows
        out[token] = rnd(out[token] + rnd(at("weighted", expert_fn(int(e), x[token]) * weights[token, slot, None])))
    return out
