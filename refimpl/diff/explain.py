"""`refimpl explain`: one element of one tensor, line by line — its producing op and formula, the input values
that produced it and the reference's intermediate values.

    print(explain(bundle, model, "model.layers.3.self_attn.q_norm[0,5,2,17]", step=0))

The step is re-run under a trace (the golden's own values, recomputed; with a dump, the device's values are
shown beside them). Ops with an element-level view: RMSNorm, linear layers, RoPE, attention scores,
probabilities and output, SwiGLU, residual adds, gates; others list their inputs' values at the same token.
"""

import re

import numpy as np

from ..errors import InputError
from ..models.config import config_from_dict
from ..trace import trace
from .dataflow import producer
from ..golden import run_graph

_SPEC = re.compile(r"\s*([A-Za-z0-9_.]+)\s*\[\s*([-\d\s,]+)\]\s*$")


def parse(spec: str) -> tuple[str, tuple[int, ...]]:
    m = _SPEC.fullmatch(spec)
    if not m:
        raise InputError(f"explain: expected NAME[i,j,...], e.g. 'model.layers.3.self_attn.q_norm[0,5,2,17]', "
                         f"got {spec!r}")
    return m[1], tuple(int(i) for i in m[2].split(",") if i.strip())


def explain(bundle, model, spec: str, step: int | None = None, device: dict | None = None) -> str:
    """The line-by-line view of one element. device: optional {tensor name: array} of the same step."""
    name, idx = parse(spec)
    steps = bundle.manifest["steps"]
    where = [k for k, s in enumerate(steps) if name in s["taps"] or name in s["outputs"] or name in s["inputs"]]
    if step is None:
        if not where:
            raise InputError(f"explain: no step of the bundle has a tensor named {name!r}")
        step = where[0]
    elif not 0 <= step < len(steps):
        raise InputError(f"explain: step {step} is outside 0..{len(steps) - 1}")
    inputs = {n: bundle.tensor(step, "input", n).copy() for n in steps[step]["inputs"]}
    with trace(".") as tr:
        outputs = run_graph(model, bundle.manifest, inputs)
    values = {**inputs, **{n: tr[n] for n in tr.names()}, **outputs}
    if name not in values:
        raise InputError(f"explain: step {step} has no tensor {name!r}")
    x = values[name]
    if len(idx) != x.ndim or not all(-n <= i < n for i, n in zip(idx, x.shape)):
        raise InputError(f"explain: index {list(idx)} does not fit {name} of shape {list(x.shape)}")
    idx = tuple(i % n for i, n in zip(idx, x.shape))
    cfg = config_from_dict(bundle.manifest["model"]["config"])
    node = producer(cfg, name)
    lines = [f"{name}{list(idx)} at step {step} ({steps[step].get('graph', '')} call), shape {list(x.shape)}",
             f"  reference value: {_f(x[idx])}" + (f"   device: {_f(device[name][idx])}   diff: "
                                                   f"{_f(device[name][idx] - x[idx])}"
                                                   if device is not None and name in device else "")]
    if node is None:
        return "\n".join(lines + ["  (no producer known for this tensor)"])
    lines += [f"  op: {node.op}" + (f" (layer {node.layer})" if node.layer is not None else ""),
              f"  formula: {node.formula}",
              "  inputs: " + ", ".join(f"{n} {list(np.shape(values[n]))}" for n in node.inputs if n in values)]
    detail = _detail(cfg, model, name, node, idx, values, device)
    return "\n".join(lines + ["  " + d for d in detail])


def _f(v) -> str:
    return f"{float(v):+.8g}"


def _detail(cfg, model, name, node, idx, values, device) -> list[str]:
    w = model.weights
    src = [n for n in node.inputs if n in values]
    if node.op == "rms_norm":
        x = values[src[0]] if src else None
        if x is None:
            return []
        y = values[name]
        if x.size == 2 * y.size and name.endswith("q_norm"):  # gated attention: q_proj holds [q_h | gate_h]
            x = x.reshape(*y.shape[:-1], 2 * y.shape[-1])[..., :y.shape[-1]]
        row = x.reshape(y.shape)[idx[:-1]].astype(np.float64)
        weight = np.asarray(w[f"{name}.weight"], np.float64)
        ms = np.mean(row ** 2)
        scale = 1 / np.sqrt(ms + cfg.rms_norm_eps)
        gain = (1 + weight[idx[-1]]) if cfg.zero_centered_norms else weight[idx[-1]]
        return [f"x = {src[0]}{list(idx[:-1])}[{idx[-1]}] = {_f(row[idx[-1]])}",
                f"mean(x^2) over {row.size} = {_f(ms)};  eps = {cfg.rms_norm_eps:g};  1/sqrt(. + eps) = {_f(scale)}",
                f"w[{idx[-1]}] = {_f(weight[idx[-1]])}" + ("  (zero-centred: gain 1 + w)" if cfg.zero_centered_norms else ""),
                f"y = x * rsqrt * gain = {_f(row[idx[-1]] * scale * gain)}   (float64 recomputation)"]
    if node.op == "linear" and src:
        x = values[src[0]][idx[:-1]].astype(np.float64)
        weight = _linear_weight(cfg, name, w)
        shape = w.shape(weight)
        if x.shape[-1] != shape[1] or idx[-1] >= shape[0]:
            return [f"x = {src[0]}{list(idx[:-1])}, |x| = {_f(np.linalg.norm(x))}"]
        W = np.asarray(w.rows(weight, slice(idx[-1], idx[-1] + 1))[0], np.float64)   # the one row it reads
        terms = x * W
        top = np.argsort(-np.abs(terms))[:5]
        return [f"x = {src[0]}{list(idx[:-1])}: {x.size} values, |x| = {_f(np.linalg.norm(x))}",
                f"y = sum_i x[i] W[{idx[-1]}, i] = {_f(terms.sum())}   (float64)",
                "largest terms: " + ", ".join(f"i={i}: {_f(x[i])}*{_f(W[i])}" for i in top)]
    if node.op == "rope":
        x = values[src[0]]
        half = cfg.rotary_dim // 2
        b, t, h, d = idx
        if d >= 2 * half:
            return [f"channel {d} >= rotary dim {2 * half}: passed through, = {_f(x[idx])}"]
        j = d % half
        partner = d + half if d < half else d - half
        if "position_ids_cos" in values:  # genie: the tables are graph inputs [1, 1, T, rot/2]
            c, s = values["position_ids_cos"][b, 0, t, j], values["position_ids_sin"][b, 0, t, j]
        else:                             # hf / qeff: the tables of the positions
            pos = np.maximum(values["position_ids"], 0)
            cos, sin = model._rope(pos, None)
            c, s = cos[min(b, cos.shape[0] - 1), t, j], sin[min(b, sin.shape[0] - 1), t, j]
        sign = "-" if d < half else "+"
        return [f"x[d={d}] = {_f(x[b, t, h, d])}, partner x[d={partner}] = {_f(x[b, t, h, partner])} (half-split)",
                f"cos = {_f(c)}, sin = {_f(s)} (table column {j})",
                f"y = x[d] cos {sign} x[partner] sin = "
                f"{_f(x[b, t, h, d] * c + (-1 if d < half else 1) * x[b, t, h, partner] * s)}"]
    if name.endswith("attn_scores"):
        b, h, i, j = idx
        a = name.rsplit(".", 1)[0]
        q = values[f"{a}.q_rope"][b, i, h].astype(np.float64)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        mask = values.get("attention_mask")
        out = [f"q = {a}.q_rope[{b},{i},{h}] ({q.size} values, |q| {_f(np.linalg.norm(q))}), kv head {h // rep}, "
               f"key slot {j}"]
        if mask is not None:  # genie: the additive mask is a graph input
            m = mask[b if mask.shape[0] > 1 else 0, 0, i, j]
            out.append(f"mask[{i},{j}] = {_f(m)};  q.k / sqrt({cfg.head_dim}) = score - mask = {_f(values[name][idx] - m)}")
        else:
            out.append(f"score = q.k / sqrt({cfg.head_dim}) + mask (0 where allowed, finfo.min where masked)")
        return out
    if name.endswith("attn_probs"):
        b, h, i, j = idx
        s = values[name.replace("attn_probs", "attn_scores")][b, h, i].astype(np.float64)
        e = np.exp(s - s.max())
        return [f"scores row: max {_f(s.max())} at slot {int(np.argmax(s))}; s[{j}] = {_f(s[j])}",
                f"p = exp(s[j] - max) / sum = {_f(e[j])} / {_f(e.sum())} = {_f(e[j] / e.sum())}"]
    if node.op == "swiglu":
        m = name.rsplit(".", 1)[0]
        g, u = values[f"{m}.gate_proj"][idx], values[f"{m}.up_proj"][idx]
        return [f"gate = {_f(g)}, silu(gate) = {_f(g / (1 + np.exp(-float(g))))}, up = {_f(u)}",
                f"hidden = silu(gate) * up = {_f(g / (1 + np.exp(-float(g))) * u)}"]
    out = []
    for n in src:  # generic: the inputs at the same token ([B, T, ...] taps; not caches, states or masks)
        if not n.startswith(("model.", "lm_head")):
            continue
        v = values[n]
        lead = idx[:2] if v.ndim >= 2 and v.shape[:2] == values[name].shape[:2] else None
        if lead is not None:
            row = v[lead].astype(np.float64)
            out.append(f"{n}{list(lead)}: {row.size} values, min {_f(row.min())}, max {_f(row.max())}, "
                       f"|.| {_f(np.linalg.norm(row))}")
            if device is not None and n in device:
                out.append(f"  device: |diff| max {_f(np.abs(device[n][lead] - v[lead]).max())}")
    return out


def _linear_weight(cfg, name: str, w) -> str:
    """The weight a linear tap multiplies by: lm_head reads the tied embedding, unless integer weights quantise
    it on its own (an alias of the embedding under its own name)."""
    if name == "lm_head":
        own = "lm_head.weight" in w.stored or "lm_head.weight" in w.aliases
        return "lm_head.weight" if own or not cfg.tie_word_embeddings else "model.embed_tokens.weight"
    return f"{name}.weight"
