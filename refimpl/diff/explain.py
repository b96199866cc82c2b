"""`refimpl explain`: one element of one tensor, line by line — its producing op and formula, the input values
that produced it and the reference's intermediate values.

    print(explain(bundle, model, "model.layers.3.self_attn.q_norm[0,5,2,17]", step=0))

The step is re-run under a trace (the golden's own values, recomputed; with a dump, the device's values are
shown beside them). Ops with an element-level view: RMSNorm, linear layers, RoPE, attention scores,
probabilities and output, SwiGLU, residual adds, gates; others list their inputs' values at the same token.
A linear layer's element, an attention score and an RMSNorm element of a float32 bundle are reproduced bit for
bit from the printed inputs: the exact sum of products (docs/numerics.md), its float32 rounding, then each
IEEE float32 operation that follows.
"""

import re

import numpy as np

from ..conventions import genie, hf
from ..errors import InputError
from ..golden import manifest_config, run_graph
from ..kernels.elementary import inverse_sqrt
from ..kernels.products import exact_dot
from ..trace import trace
from .classify import classify
from .dataflow import producer

_SPEC = re.compile(r"\s*([A-Za-z0-9_.]+)\s*\[\s*([-\d\s,]+)\]\s*$")


def parse(spec: str) -> tuple[str, tuple[int, ...]]:
    m = _SPEC.fullmatch(spec)
    if not m:
        raise InputError(f"explain: expected NAME[i,j,...], e.g. 'model.layers.3.self_attn.q_norm[0,5,2,17]', "
                         f"got {spec!r}")
    return m[1], tuple(int(i) for i in m[2].split(",") if i.strip())


def explain(bundle, model, spec: str, step: int | None = None, device: dict | None = None,
            dtype: str = "float32") -> str:
    """The line-by-line view of one element. device: optional {tensor name: array} of the same step (then the
    fault class of its whole tensor is named too, at the precision floor of `dtype`)."""
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
    cfg = manifest_config(bundle.manifest)
    node = producer(cfg, name, bundle.manifest.get("convention"))
    lines = [f"{name}{list(idx)} at step {step} ({steps[step].get('graph', '')} call), shape {list(x.shape)}",
             f"  reference value: {_f(x[idx])}" + (f"   device: {_f(device[name][idx])}   diff: "
                                                   f"{_f(device[name][idx] - x[idx])}"
                                                   if device is not None and name in device else "")]
    if device is not None and name in device and np.shape(device[name]) == x.shape:
        keys = [f"{step}/{role}/{name}" for role in ("tap", "output", "input")]
        rec = next((bundle.manifest["tensors"][k] for k in keys if k in bundle.manifest["tensors"]), {})
        f = classify(x, device[name], rec.get("valid"), dtype)
        lines.append(f"  fault class of the whole tensor: {f.kind}: {f.summary}")
    if node is None:
        return "\n".join(lines + ["  (no producer known for this tensor)"])
    lines += [f"  op: {node.op}" + (f" (layer {node.layer})" if node.layer is not None else ""),
              f"  formula: {node.formula}",
              "  inputs: " + ", ".join(f"{n} {list(np.shape(values[n]))}" for n in node.inputs if n in values)]
    detail = _detail(cfg, model, name, node, idx, values, device)
    return "\n".join(lines + ["  " + d for d in detail])


def _f(v) -> str:
    return f"{float(v):+.8g}"


def _x(v) -> str:
    """A float32 exactly: decimal (9 digits round-trip) and hexadecimal."""
    return f"{float(v):+.9g} ({float(v).hex()})"


def _sum_lines(what: str, a, b, stored=None) -> tuple[list[str], np.float32]:
    """The exact sum of products a.b, its float32 rounding, and whether that is the stored value."""
    s, r = exact_dot(a, b)
    lines = [f"{what} = exact sum of {np.size(a)} products = {float(s):+.17g}"
             + ("" if float(s) == s else " (rounded here for display; exactly " + str(s.limit_denominator(10**30))
                [:60] + "...)"),
             f"  float32 rounding (nearest, ties to even) = {_x(r)}"]
    if stored is not None:
        same = np.float32(stored).view(np.int32) == r.view(np.int32)
        lines.append(f"  stored value {_x(stored)}: " + ("reproduced bit for bit" if same else "DIFFERS"))
    return lines, r


def _float32(values, *names) -> bool:
    return all(np.asarray(values[n]).dtype == np.float32 for n in names)


def _detail(cfg, model, name, node, idx, values, device) -> list[str]:
    w, module = model.weights, node.module_name or name   # the HF module whose weights it reads (router: mlp.gate)
    src = [n for n in node.inputs if n in values]
    if node.op == "rms_norm":
        x = values[src[0]] if src else None
        if x is None:
            return []
        y = values[name]
        if x.size == 2 * y.size and name.endswith("q_norm"):  # gated attention: q_proj holds [q_h | gate_h]
            x = x.reshape(*y.shape[:-1], 2 * y.shape[-1])[..., :y.shape[-1]]
        if _float32(values, src[0], name) and w[f"{module}.weight"].dtype == np.float32:
            return _rms_norm_exact(cfg, x.reshape(y.shape)[idx[:-1]], w[f"{module}.weight"], idx[-1], y[idx])
        row = x.reshape(y.shape)[idx[:-1]].astype(np.float64)
        weight = np.asarray(w[f"{module}.weight"], np.float64)
        ms = np.mean(row ** 2)
        scale = 1 / np.sqrt(ms + cfg.rms_norm_eps)
        gain = (1 + weight[idx[-1]]) if cfg.zero_centered_norms else weight[idx[-1]]
        return [f"x = {src[0]}{list(idx[:-1])}[{idx[-1]}] = {_f(row[idx[-1]])}",
                f"mean(x^2) over {row.size} = {_f(ms)};  eps = {cfg.rms_norm_eps:g};  1/sqrt(. + eps) = {_f(scale)}",
                f"w[{idx[-1]}] = {_f(weight[idx[-1]])}"
                + ("  (zero-centred: gain 1 + w)" if cfg.zero_centered_norms else ""),
                f"y = x * rsqrt * gain = {_f(row[idx[-1]] * scale * gain)}   (float64 recomputation)"]
    if node.op == "linear" and src:
        x = values[src[0]][idx[:-1]].astype(np.float64)
        weight = _linear_weight(cfg, module, w)
        shape = w.shape(weight)
        if x.shape[-1] != shape[1] or idx[-1] >= shape[0]:
            return [f"x = {src[0]}{list(idx[:-1])}, |x| = {_f(np.linalg.norm(x))}"]
        W = np.asarray(w.rows(weight, slice(idx[-1], idx[-1] + 1))[0], np.float64)   # the one row it reads
        terms = x * W
        top = np.argsort(-np.abs(terms))[:5]
        head = [f"x = {src[0]}{list(idx[:-1])}: {x.size} values, |x| = {_f(np.linalg.norm(x))}",
                "largest terms: " + ", ".join(f"i={i}: {_f(x[i])}*{_f(W[i])}" for i in top)]
        if not _float32(values, src[0], name):
            return head + [f"y = sum_i x[i] W[{idx[-1]}, i] = {_f(terms.sum())}   (float64)"]
        bias = _linear_bias(cfg, module, w)
        lines, r = _sum_lines(f"y = sum_i x[i] W[{idx[-1]}, i]", x, W, None if bias is not None
                              else values[name][idx])
        if bias is not None:
            y = np.float32(r + np.float32(bias[idx[-1]]))
            same = y.view(np.int32) == np.float32(values[name][idx]).view(np.int32)
            lines.append(f"  + bias {_x(bias[idx[-1]])} = {_x(y)} (float32): " + ("reproduced bit for bit" if same
                                                                                 else "DIFFERS"))
        return head + lines
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
            cos, sin = model.rope(pos, None)
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
            out.append(f"mask[{i},{j}] = {_f(m)};  q.k / sqrt({cfg.head_dim}) = score - mask = "
                       f"{_f(values[name][idx] - m)}")
        else:
            out.append(f"score = q.k / sqrt({cfg.head_dim}) + mask (0 where allowed, finfo.min where masked)")
        keys = _keys(values, a, b, h // rep, values[name].shape[-1])
        if keys is not None and _float32(values, name, f"{a}.q_rope"):
            lines, r = _sum_lines(f"q.k[{j}]", values[f"{a}.q_rope"][b, i, h], keys[j])
            scale = np.float32(inverse_sqrt(cfg.head_dim))
            scaled = np.float32(r * scale)
            lines.append(f"  * {_x(scale)} (1/sqrt({cfg.head_dim}), float32) = {_x(scaled)}")
            if mask is not None:
                m = np.float32(mask[b if mask.shape[0] > 1 else 0, 0, i, j])
                scaled = np.float32(scaled + m)
                lines.append(f"  + mask {_x(m)} = {_x(scaled)}")
            same = scaled.view(np.int32) == np.float32(values[name][idx]).view(np.int32)
            lines.append(f"  stored score {_x(values[name][idx])}: " + ("reproduced bit for bit" if same
                                                                     else "differs (a mask floor or pre-scaled keys)"))
            out += lines
        return out
    if name.endswith("attn_probs"):
        b, h, i, j = idx
        s = values[name.replace("attn_probs", "attn_scores")][b, h, i].astype(np.float64)
        e = np.exp(s - s.max())
        return [f"scores row: max {_f(s.max())} at slot {int(np.argmax(s))}; s[{j}] = {_f(s[j])}",
                f"p = exp(s[j] - max) / sum = {_f(e[j])} / {_f(e.sum())} = {_f(e[j] / e.sum())}"]
    if name.endswith((".mlp.hidden", ".shared_expert.hidden")):
        m = name.rsplit(".", 1)[0]
        g, a, u = values[f"{m}.gate_proj"][idx], values[f"{m}.act_fn"][idx], values[f"{m}.up_proj"][idx]
        return [f"gate = {_f(g)}, act_fn = act(gate) = {_f(a)} (silu: {_f(g / (1 + np.exp(-float(g))))}), up = {_f(u)}",
                f"hidden = act_fn * up = {_f(a * u)}"]
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


def _keys(values, a: str, b: int, kv_head: int, slots: int):
    """The keys [slots, D] a score row reads, when the call's inputs and trace hold them: the cache window of the
    graph input and this call's new keys (genie: past_key_{i}_in [Hkv, 1, D|W, W|D]; hf: past_key_values.{i}.key
    [B, Hkv, P, D]); None when they do not make up the row (qeff scatters new keys into its cache)."""
    k = values.get(f"{a}.k_rope")
    if k is None:
        return None
    new = np.asarray(k)[b, :, kv_head]                                   # [T, D]
    layer = int(a.split(".")[2])
    static, dynamic = genie.state_input("past_key", layer), hf.state_input("past_key", layer)
    past = None
    if static in values:
        past = np.asarray(values[static])[kv_head, 0]                     # [D, W] or [W, D]
    elif dynamic in values:
        past = np.asarray(values[dynamic])[b, kv_head]
    if past is not None:
        window, D = slots - new.shape[0], new.shape[-1]
        if static in values and past.shape == (D, window):               # genie's transposed keys
            past = past.T
        if past.shape != (window, D):
            return None
        new = np.concatenate([past, new])
    return new if new.shape[0] == slots else None


def _rms_norm_exact(cfg, row: np.ndarray, weight: np.ndarray, d: int, stored) -> list[str]:
    """An RMSNorm element of a float32 run, each float32 operation in the kernel's order."""
    n = row.shape[-1]
    lines, ss = _sum_lines(f"sum x^2 over {n}", row, row)
    var = np.float32(ss / np.float32(n))
    root = np.float32(np.sqrt(var + np.float32(cfg.rms_norm_eps)))
    inv = np.float32(np.float32(1) / root)
    nu = np.float32(row[d] * inv)
    lines += [f"mean = {_x(var)};  + eps {cfg.rms_norm_eps:g}, sqrt = {_x(root)};  1/. = {_x(inv)}",
              f"x[{d}] = {_x(row[d])};  nu = x * 1/. = {_x(nu)}"]
    if cfg.zero_centered_norms:
        y = np.float32(nu * np.float32(np.float32(1) + weight[d]))
        lines.append(f"y = nu * (1 + w[{d}] = {_x(weight[d])}) = {_x(y)}")
    else:
        y = np.float32(weight[d] * nu)
        lines.append(f"y = w[{d}] {_x(weight[d])} * nu = {_x(y)}")
    same = y.view(np.int32) == np.float32(stored).view(np.int32)
    return lines + [f"stored value {_x(stored)}: " + ("reproduced bit for bit" if same else
                                                        "differs (reduced-precision emulation rounds in between)")]


def _linear_bias(cfg, name: str, w):
    if name == "lm_head" or not cfg.attention_bias or not name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")):
        return None
    return w[f"{name}.bias"]


def _linear_weight(cfg, name: str, w) -> str:
    """The weight a linear tap multiplies by: lm_head reads the tied embedding, unless integer weights quantise
    it on its own (an alias of the embedding under its own name)."""
    if name == "lm_head":
        own = "lm_head.weight" in w.stored or "lm_head.weight" in w.aliases
        return "lm_head.weight" if own or not cfg.tie_word_embeddings else "model.embed_tokens.weight"
    return f"{name}.weight"
