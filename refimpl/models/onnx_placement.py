"""A quantised device graph's quantisers placed on refimpl's graph, by the exported graph's structure (issue 27).

aimet-onnx encodings and QDQ models key their quantisers by ONNX tensor names. Each is placed where refimpl computes
the same tensor: a node's output, a sub-op point of its kernel's equation, a constant or graph input as the kernel
reads it, or a weight. The names themselves are not read (an export may call a tensor `mul_13` or
`/model/layers.0/mlp/Mul_output_0`): the ONNX graph is walked in file (topological) order, and each node is matched to
the declared point (refimpl/graph.py's Point: the ONNX op types it exports as, its inputs) whose op type it has and
whose inputs are the values already found, in declaration order among equals (q_proj before k_proj before v_proj,
as transformers computes them; a weight's initializer name, where the export kept the checkpoint's, decides).

    data movement   Reshape, Transpose, (Un)Squeeze, Expand, Identity, Cast, Flatten, Split, a Slice / Concat no point
                    declares, a Gather of an activation (`select`): the output holds the input's values, so its
                    quantiser acts on the same value: `shared` where its encoding is the one already applied there,
                    else a further quantiser of that value (a chain, applied in order)
    constants       an initializer or Constant (through data movement): a weight ("weight:w"), or a constant the kernel
                    reads (eps, the attention scale, the exponent of x^2, a folded 1 + w: "const:p")
    graph inputs    bound by where they are read: the mask, the cos / sin tables, the past keys / values ("input:p")

Every encoding is placed or listed with the reason it is not (`unplaced`); strict refuses any.
"""

import dataclasses
import re

import numpy as np

from ..errors import InputError
from ..graph import point_name
from ..graph import points as declared_points
from .experts import FUSED, expert_names

ROLES = ("const:", "weight:", "input:")
ORDERED = {"Gather", "MatMul", "Gemm", "Concat", "Sub", "Div", "Pow", "Slice"}   # operands in declared order
CONDITIONS = {"Greater", "Less", "Equal", "GreaterOrEqual", "LessOrEqual", "Not", "And", "Or", "IsNaN", "IsInf",
              "Shape", "Size", "NonZero", "Range", "ConstantOfShape", "EyeLike"}   # shapes, masks, conditions
COMPARISONS = {"Greater", "Less", "Equal", "GreaterOrEqual", "LessOrEqual"}
DATA = {op: 1 for op in ("ReduceMean", "ReduceSum", "ReduceMax", "Reshape", "Slice", "Unsqueeze", "Squeeze",
                         "Expand", "SequenceAt",
                         "Split", "Tile", "TopK", "CumSum", "Pad")}   # operands after these: shapes, axes, sizes
MOVES = {"Reshape", "Transpose", "Unsqueeze", "Squeeze", "Expand", "Identity", "Cast", "Flatten", "Split", "Slice",
         "Concat", "Gather", "GatherND", "GatherElements", "QuantizeLinear", "DequantizeLinear", "Tile",
         "SplitToSequence", "SequenceAt"}


@dataclasses.dataclass
class Placement:
    """Where a device graph's quantisers act. activations: {node or "node/point": (Encoding, ...)} in the order
    applied; weights: {checkpoint weight name: (Encoding, ...)}; tensors: {ONNX tensor name: [where, ...]}
    (a quantiser of a graph input or constant read at several points is placed at each); shared: {ONNX tensor:
    where} for quantisers identical to one already applied there; unplaced: [(ONNX tensor name, reason)]."""
    activations: dict
    weights: dict
    tensors: dict
    shared: dict
    unplaced: list
    source: str = "encodings"
    forms: dict = dataclasses.field(default_factory=dict)   # point -> the op of the other form it was found in
    moved_by: dict = dataclasses.field(default_factory=dict)   # where -> the op making each link of its chain (the
    #                                                            first None: the value's own; Expand, Concat, ...)

    @property
    def total(self) -> int:
        return len(self.tensors) + len(self.shared) + len(self.unplaced)

    @property
    def placed(self) -> int:
        return len(self.tensors) + len(self.shared)

    def points(self) -> dict:
        """{node: {point: encodings}} of the sub-op points, for models/quantisers.Quantisers."""
        out = {}
        for name, encs in self.activations.items():
            if "/" in name:
                node, point = name.split("/", 1)
                out.setdefault(node, {})[point] = encs
        return out

    def outputs(self) -> dict:
        return {name: encs for name, encs in self.activations.items() if "/" not in name}

    def describe(self) -> dict:
        """The manifest record: per node output (io "output", its tap), point (io "point") and weight (io
        "weight"), the ONNX tensors whose quantisers act there in order and the last one's encoding (the values the
        tensor holds); the shared quantisers; the unplaced ones with their reasons."""
        by_place = {}
        for tensor, wheres in self.tensors.items():
            for w in wheres:
                by_place.setdefault(w, []).append(tensor)
        placed = []
        for table, io in ((self.activations, None), (self.weights, "weight")):
            for where, chain in table.items():
                kind = io or ("point" if "/" in where else "output")
                placed.append({"at": where, "io": kind, **({"tap": where} if kind == "output" else {}),
                               "onnx": by_place.get(where, []), **chain[-1].describe()})
        return {"source": self.source, "placed": self.placed, "total": self.total, "quantisers": placed,
                "stored_weights": self.stored_weights, "shared": dict(self.shared),
                "unplaced": [{"onnx": t, "reason": r} for t, r in self.unplaced]}

    @property
    def stored_weights(self) -> int:
        """Weights whose values are the device graph's own stored integer codes (a QDQ model's integer initializer,
        Encoding.stored), not the checkpoint's weight quantised by the encoding."""
        return sum(chain[0].stored is not None for chain in self.weights.values())

    def summary(self) -> str:
        return f"{self.source}: {self.placed} of {self.total} quantisers placed" + (
            f"; unplaced: {', '.join(f'{t} ({r})' for t, r in self.unplaced[:5])}"
            + (" ..." if len(self.unplaced) > 5 else "") if self.unplaced else "")


def _same(a, b) -> bool:
    """Two encodings that quantise identically."""
    return (a.bitwidth == b.bitwidth and a.signed == b.signed and a.float_dtype == b.float_dtype
            and a.block_size == b.block_size and np.array_equal(a.scale, b.scale)
            and np.array_equal(a.offset, b.offset))


def _checkpoint(initializer: str, weights: set) -> str | None:
    """An initializer named after a checkpoint tensor (an export's wrapper prefix, e.g. "model.", dropped) -> it."""
    parts = initializer.split(".")
    for k in range(len(parts)):
        name = ".".join(parts[k:])
        if name in weights:
            return name
    return None


def place_onnx(graph, encodings: dict, nodes: dict, weight_names=(), strict: bool = False,
               source: str = "encodings") -> Placement:
    """Place {ONNX tensor name: Encoding} of `graph` (refimpl.formats.onnx_graph.OnnxGraph, QDQ pairs removed) on the
    declared graph `nodes` (refimpl.models.model.graph(cfg)); weight_names: the checkpoint's tensor names (an
    initializer named after one is that weight)."""
    weight_names = set(weight_names)
    pts = declared_points(nodes)
    forms = {}                            # (point name, k) -> (node, its k-th form: Point.forms)
    index = {}                            # (op type, value inputs) -> [(point name, form)], declaration order
    initial = set()                       # (point name, k) of per-token points' token-0 forms (Point.first)
    for full, (node, declared) in pts.items():
        kept = declared.forms()
        if declared.first:
            kept += (dataclasses.replace(declared, inputs=declared.first, also=(), first=()),)
            initial.add((full, len(kept) - 1))
        for k, pt in enumerate(kept):
            forms[(full, k)] = (node, pt)
            values = tuple(sorted(_unstep(_full(node, i)) for i in pt.inputs if not i.startswith(ROLES)))
            for op in pt.onnx:
                index.setdefault((op, values), []).append((full, k))
    consts = set(graph.initializers)
    value, const, ginput = {}, {}, {}     # tensor -> point name / (root initializer, path) / (graph input, path)
    path = {}                             # tensor -> tensors from its root (a point's output, a constant, an input)
    uses = {}                             # constant / graph-input tensor -> [(where, kind)] it was read as
    assigned, derived = set(), {}        # derived: a tensor computed from graph inputs only -> its op
    for g in graph.inputs:
        ginput[g], path[g] = g, (g,)
    for t in consts:
        const[t], path[t] = t, (t,)
    unmatched = {}                        # tensor -> why its node matched nothing
    ancestry = {}                         # an unmatched tensor -> the found values it is computed from
    opaque = {node: frozenset(_full(node, i) for i in f.inputs) for _, (node, pt) in pts.items()
              for f in pt.forms() if "*" in f.onnx}

    def candidates_of(n, kinds):
        """[(point, form)] the node can be, in declaration order; a per-token point's as its instance "point@t"."""
        stepped = any(k == "v" and _unstep(v) != v for k, v in kinds)
        out = candidates_in(n, kinds, stepped)
        if not out and stepped:   # a scalar Gather that was no token's (a batch of one): the value itself
            out = candidates_in(n, [(k, _unstep(v)) if k == "v" else (k, v) for k, v in kinds], False)
        return out

    def candidates_in(n, kinds, stepped):
        values = tuple(sorted(_unstep(v) for k, v in kinds if k == "v"))
        n_const, n_input = sum(k == "c" for k, _ in kinds), sum(k == "i" for k, _ in kinds)
        same = len(set(n.inputs)) < len(n.inputs)          # Mul(x, x): one tensor twice
        out = []
        for c in index.get((n.op_type, values), ()):
            node, pt = forms[c]
            if (pt.per_token or "@*" in "".join(pt.inputs)) != (stepped or any(v.endswith("@*") for k, v in kinds)):
                continue
            t = _token(node, pt, kinds, c in initial) if pt.per_token else None
            name = c[0] if t is None else f"{c[0]}@{t}"
            if (t is None and pt.per_token) or name in assigned or _counts(pt) != (n_const, n_input) or (
                    not same and _twice(pt)) or (n.op_type in ORDERED and
                                                 _operands(node, pt) != _operands(None, None, kinds)):
                continue
            out.append((name, c[1]))
        return out

    found = {}                            # point -> (its tensor, the (op, values) it was matched by)
    forms_found = {}                      # point -> the op of the form (Point.also) it was found in

    def relabel(pairs: dict) -> None:
        """Swap the names in `pairs` (points, nodes, weights: {name: its mirror}) wherever found so far."""
        def m(name):   # (a point only one of the pair declares, in_proj_qkv/masked of in_proj_qkv / in_proj_z, stays)
            mirror = _mirror(pairs, name)
            return name if _unstep(name) in pts and _unstep(mirror) not in pts else mirror
        for t in value:
            value[t] = m(value[t])
        swapped = {m(a) for a in assigned}, {m(key): f for key, f in found.items()}
        moved = {m(key): op for key, op in forms_found.items()}
        forms_found.clear(), forms_found.update(moved)
        assigned.clear(), assigned.update(swapped[0]), found.clear(), found.update(swapped[1])
        for t, ws in uses.items():
            uses[t] = [(m(w), kind) for w, kind in ws]

    def twin_swapped(n, kinds):
        """Equal points (x1 / x2 of RoPE: Slices of one value; gate_proj / up_proj where no weight's name decides)
        are assigned in file order, which an optimizer may reorder; a node that matches only with an input's twin
        in its place decides: the two swap (with their weights)."""
        for j, (k, p) in enumerate(kinds):
            if k != "v" or p not in found or p not in pts or (n.op_type == "Slice" and found[p][1][0] != "Slice"):
                continue   # (a per-token instance has no twin; a Slice reads a Slice's twin: RoPE's x1 / x2)
            for twin, _ in index.get(found[p][1], ()):
                if twin == p or twin not in pts:
                    continue
                tried = [*kinds[:j], ("v", twin), *kinds[j + 1:]]
                if candidates_of(n, tried):
                    pairs = {p: twin, twin: p}
                    for ia, ib in zip(pts[p][1].inputs, pts[twin][1].inputs):
                        if ia != ib and ia.startswith("weight:") and ib.startswith("weight:"):
                            pairs[ia[7:]], pairs[ib[7:]] = ib[7:], ia[7:]
                    relabel(pairs)
                    return tried, candidates_of(n, tried)
        return kinds, []

    def mirrored(a: str, b: str, out: dict) -> dict | None:
        """Two declared nodes of the same structure (q_rope / k_rope, and upstream q_norm / k_norm, q_proj /
        k_proj): {name: its mirror} of the nodes, their points and weights, or None where they differ."""
        if a == b or out.get(a) == b:
            return out
        na, nb = nodes.get(a), nodes.get(b)
        if na is None or nb is None or na.op != nb.op or [x.name for x in na.points] != [x.name for x in nb.points]:
            return None
        out[a], out[b] = b, a
        for pa, pb in zip(na.points, nb.points):
            for ia, ib in zip(pa.inputs, pb.inputs):
                if ia == ib or ia.startswith("/") or ia.startswith(("const:", "input:")):
                    continue
                if ia.startswith("weight:") and ib.startswith("weight:"):
                    out[ia[7:]], out[ib[7:]] = ib[7:], ia[7:]
                elif ia.startswith(ROLES) or ib.startswith(ROLES) or mirrored(
                        ia.split("/")[0], ib.split("/")[0], out) is None:
                    return None
        return out

    def mirror_swapped(n, kinds):
        """Parallel chains (q and k: projection, norm, RoPE) are told apart by file order where no weight's name
        decides (an optimizer may put k's first): a node that matches only with an input's chain mirrored (the
        keys' Concat reading "q_rope") decides: the two chains swap names."""
        for k, p in kinds:
            node = p.split("/")[0] if k == "v" else None
            if node not in nodes:
                continue
            for other, decl in nodes.items():
                if other == node or decl.op != nodes[node].op or decl.layer != nodes[node].layer:
                    continue
                pairs = mirrored(node, other, {})
                if not pairs:
                    continue

                tried = [(kk, _mirror(pairs, v)) if kk == "v" else (kk, v) for kk, v in kinds]
                if candidates_of(n, tried):
                    relabel(pairs)
                    return tried, candidates_of(n, tried)
        return kinds, []

    for n in graph.nodes:
        outs = [o for o in n.outputs if o]
        ins = [i for i in n.inputs[:DATA.get(n.op_type)] if i]
        if n.op_type == "Constant" or n.op_type in CONDITIONS or (ins and all(i in const for i in ins)):
            moved = n.op_type in MOVES and ins and n.op_type not in CONDITIONS
            # a value compared with a constant (x > 20, Softplus's threshold): the comparison reads that constant
            compared = [i for i in ins if i in const] if n.op_type in COMPARISONS and any(i in value for i in ins) \
                else []
            for o in outs:                # a constant moved (a weight transposed, an expert's rows gathered) keeps its
                src = ins[0] if moved else compared[0] if len(compared) == 1 else None   # root; else its own
                const[o], path[o] = (const[src], path[src] + (o,)) if src else (o, (o,))
            continue
        kinds = [("v", value[i]) if i in value else ("c", i) if i in const else ("i", i) if i in ginput
                 else ("?", i) for i in ins]
        if n.op_type == "Concat":   # every token's instance of one per-token point, in order: their stack "x@*"
            kinds = _stacked(kinds)
        candidates = []
        if any(k == "?" for k, _ in kinds):
            # an opaque node's output (a kernel refimpl computes in another factorisation: the chunked delta rule)
            # is the first unmatched tensor, computed from its inputs, that a declared point reads
            for node, needs in opaque.items():
                if node in assigned:
                    continue
                tried = [("v", node) if k == "?" and needs & ancestry.get(i, frozenset()) else (k, i)
                         for k, i in kinds]   # (a Loop body reads outer values without naming them: some suffice)
                if not any(k == "?" for k, _ in tried) and candidates_of(n, tried):
                    for (k, i), (k2, _) in zip(kinds, tried):
                        if k == "?" and k2 == "v":
                            value[i], path[i] = node, (i,)
                    assigned.add(node)
                    kinds = tried
                    break
            else:
                why = next(unmatched.get(i, "its input is unknown") for k, i in kinds if k == "?")
                if why.startswith("inside "):   # the opaque kernel's own ops: name each
                    why = why.split(" (")[0] + f" ({n.op_type} {n.name})" + why[why.index("):") + 1:]
                anc = frozenset().union(*(ancestry.get(i, frozenset()) if k == "?" else {i} if k == "v" else ()
                                          for k, i in kinds))
                for o in outs:
                    unmatched[o], ancestry[o] = why, anc | {v for k, v in kinds if k == "v"}
                continue
        candidates = candidates_of(n, kinds)
        if not candidates and (n.op_type not in MOVES or n.op_type == "Slice"):   # a Slice: x1 / x2 of RoPE
            kinds, candidates = twin_swapped(n, kinds)
        if not candidates and (n.op_type not in MOVES or n.op_type == "Concat"):
            kinds, candidates = mirror_swapped(n, kinds)
        if candidates and not (n.op_type in MOVES and _moves_only(n.op_type, kinds)):
            named = [c for c in candidates if any(_checkpoint(const[i], weight_names) == w[7:]
                                                  for k, i in kinds if k == "c" for w in forms[_declared(*c)][1].inputs
                                                  if w.startswith("weight:"))]
            point, form = (named or candidates)[0]
            if form and _declared(point, form) not in initial:
                forms_found[point] = n.op_type
            assigned.add(point)
            node, pt = forms[_declared(point, form)]
            value[outs[0]], path[outs[0]] = point, (outs[0],)
            found[point] = (outs[0], (n.op_type, tuple(sorted(_unstep(v) for k, v in kinds if k == "v"))))
            for o, more in zip(n.outputs[1:], pt.more):       # a Split's other parts, TopK's indices
                if o and more.startswith("#"):                 # integers (indices): no values, like a shape
                    const[o], path[o] = o, (o,)
                elif o:
                    value[o], path[o] = point_name(node, more), (o,)
            roles = [i for i in pt.inputs if i.startswith(("const:", "weight:", "input:"))]
            for (k, i), role in zip([ki for ki in kinds if ki[0] in "ci"], _ordered(roles, kinds)):
                where = role[7:] if role.startswith("weight:") else _full(node, "/" + role.split(":", 1)[1])
                uses.setdefault(i, []).append((where, "weight" if role.startswith("weight:") else "point"))
            continue
        if n.op_type in MOVES:   # the moved data: a Concat's value (else its graph input), any other op's first operand
            order = [next((j for j, (k, _) in enumerate(kinds) if k == want), None) for want in "vic"]
            first = next(j for j in order if j is not None) if n.op_type == "Concat" else 0
            data, src = kinds[first], ins[first]
            token = graph.scalars.get(ins[1]) if n.op_type == "Gather" and len(ins) > 1 else None
            for o in outs:
                path[o] = path[src] + (o,)
                if data[0] == "v":   # a Gather of one index: token t's slice, "x@t" (a per-token point reads it)
                    value[o] = data[1] if token is None or _unstep(data[1]) != data[1] else f"{data[1]}@{token}"
                elif data[0] == "i":
                    ginput[o] = ginput[src]
                else:
                    const[o] = const[src]
            continue
        if all(k in "ci" for k, _ in kinds):      # computed from graph inputs only: the host's mask plumbing
            for o in outs:
                ginput[o], path[o] = o, (o,)
                derived[o] = f"{n.op_type} {n.name}"
            continue
        anc = frozenset(v for k, v in kinds if k == "v")
        inside = [node for node, needs in opaque.items() if node not in assigned and needs & anc]
        for o in outs:
            unmatched[o] = (f"inside {inside[0]} ({n.op_type} {n.name}): refimpl computes that kernel in another "
                            f"factorisation and declares no points inside it" if inside else
                            f"{n.op_type} {n.name} matches no declared point (inputs {', '.join(v for _, v in kinds)})")
            ancestry[o] = anc
    placement = _assign(graph, encodings, value, const, ginput, path, uses, unmatched, strict, source, derived,
                        weight_names, frozenset(assigned))
    placement.forms.update(forms_found)
    return placement


def _full(node: str, name: str) -> str:
    """A point's input as a full name: "/p" -> "node/p", "/" -> the node; others as they are."""
    if name.startswith("/"):
        return f"{node}{name}" if name != "/" else node
    return name


def _operands(node, pt, kinds=None) -> tuple:
    """A point's declared operands, or a node's found ones: values by name (per-token ones without their token),
    constants "c", graph inputs "i"."""
    if kinds is not None:
        return tuple(_unstep(v) if k == "v" else k for k, v in kinds)
    return tuple("c" if i.startswith(("const:", "weight:")) else "i" if i.startswith("input:") else
                 _unstep(_full(node, i)) for i in pt.inputs)


def _mirror(pairs: dict, name: str) -> str:
    """A point / node / weight name under a swap {name: its mirror} ("node/point" by its node)."""
    head, sep, rest = name.partition("/")
    return pairs.get(head, head) + sep + rest if head in pairs else pairs.get(name, name)


def _twice(pt) -> bool:
    """A form reading one value twice (x^2 as Mul(x, x)): only a node with one tensor twice is it."""
    values = [i for i in pt.inputs if not i.startswith(ROLES)]
    return len(set(values)) < len(values)


def _counts(pt) -> tuple:
    return (sum(i.startswith(("const:", "weight:")) for i in pt.inputs), sum(i.startswith("input:") for i in pt.inputs))


def _ordered(roles, kinds):
    """The declared constant / input roles in the order of the node's constant / input operands (constants first
    matched to const:/weight: roles, graph inputs to input: roles)."""
    c = iter([r for r in roles if not r.startswith("input:")])
    i = iter([r for r in roles if r.startswith("input:")])
    return [next(c) if k == "c" else next(i) for k, _ in kinds if k in "ci"]


def _moves_only(op: str, kinds) -> bool:
    """A Concat of one value with itself (cat(t, t)) moves data; any other declared op computes (a stack of every
    token's instance too)."""
    return op == "Concat" and len({v for _, v in kinds}) == 1 and not kinds[0][1].endswith("@*")


STEP = re.compile(r"@(t|t-1|\d+)$")


def _unstep(name: str) -> str:
    """A per-token value's name without its token ("x@3", "x@t", "x@t-1" -> "x"); "x@*" and others as they are."""
    return STEP.sub("", name)


def _declared(point: str, form: int) -> tuple:
    """A candidate (point or its instance "point@t", form) -> its key in the declared forms."""
    return _unstep(point), form


def _token(node: str, pt, kinds, initial: bool) -> int | None:
    """The token t a per-token point's form computes for a node reading `kinds` (its value inputs "x@s"): each
    declared input "x@t" found as x@s says t = s, "x@t-1" says t = s + 1; None where they disagree or none says
    (a token-0 form: t must be 0)."""
    found = [v for k, v in kinds if k == "v"]
    t = None
    for declared in (_full(node, i) for i in pt.inputs if not i.startswith(ROLES)):
        base, tag = _unstep(declared), declared[len(_unstep(declared)) + 1:]
        match = next((v for v in found if _unstep(v) == base), None)
        if match is None:
            return None
        found.remove(match)
        if tag not in ("t", "t-1"):
            continue
        s = match[len(base) + 1:]
        if not s.isdigit():
            return None
        want = int(s) + (tag == "t-1")
        if t is not None and want != t:
            return None
        t = want
    return None if t is None or (initial and t != 0) else t


def _stacked(kinds) -> list:
    """A Concat's operands: every instance x@0, x@1, ... of one per-token point, in order -> [("v", "x@*")]."""
    values = [v for k, v in kinds if k == "v"]
    if len(values) != len(kinds) or not values:
        return kinds
    base = _unstep(values[0])
    if all(v == f"{base}@{t}" for t, v in enumerate(values)) and base != values[0]:
        return [("v", f"{base}@*")]
    return kinds


def _assign(graph, encodings, value, const, ginput, path, uses, unmatched, strict, source, derived,
            weight_names, instances=frozenset()) -> Placement:
    activations, weights, tensors, shared, unplaced, moved_by = {}, {}, {}, {}, [], {}
    made_by = {o: n.op_type for n in graph.nodes for o in n.outputs}

    def put(table, where, tensor, enc):
        chain = table.get(where, ())
        if chain and _same(chain[-1], enc):
            shared[tensor] = where
            return
        table[where] = chain + (enc,)
        tensors.setdefault(tensor, []).append(where)
        if table is activations:   # a further link: requantised by the data movement that made the tensor
            moved_by[where] = moved_by.get(where, ()) + ((made_by.get(tensor) if chain else None),)

    known = set(path)
    for tensor in _in_graph_order(graph, encodings):
        enc = encodings[tensor]
        if tensor in value:   # (token t's slice of a value, "x@t", no point's instance: the value x)
            where = value[tensor]
            put(activations, where if where in instances else _unstep(where), tensor, enc)
        elif tensor in const or tensor in ginput:
            root = path[tensor][0]
            readers = [(w, kind) for t, ws in uses.items() if path.get(t, (None,))[0] == root
                       and tensor in path[t] for w, kind in ws]
            weight = tensor in const and _checkpoint(tensor, weight_names)
            if not readers and weight:            # a checkpoint weight read through a constant op (1 + w, exp(A_log))
                readers = [(weight, "weight")]
            if not readers:
                what = (f"computed from graph inputs only ({derived[root]}: the host's plumbing)" if root in derived
                        else "a constant" if tensor in const else "a graph input")
                unplaced.append((tensor, f"{what}, read by no matched point{_read_by(graph, tensor, derived, ginput)}"))
            for where, kind in dict.fromkeys(readers):
                put(weights if kind == "weight" else activations, where, tensor, enc)
        elif tensor in unmatched:
            unplaced.append((tensor, unmatched[tensor]))
        else:
            unplaced.append((tensor, "not a tensor of the graph" if tensor not in known else "not reached"))
    p = Placement(activations, weights, tensors, shared, unplaced, source,
                  moved_by={w: ops for w, ops in moved_by.items() if len(ops) > 1})
    if unplaced and strict:
        raise InputError(f"{p.summary()} (--strict-encodings)")
    return p


def _read_by(graph, tensor: str, derived: dict, ginput: dict) -> str:
    """" (read by <op> <node>: what it is)" of a constant / graph input no point reads: a comparison, a shape or
    mask op, the host's plumbing (a node computed from graph inputs only), a graph input's data movement."""
    readers = [n for n in graph.nodes if tensor in n.inputs][:2]
    if not readers:
        return " (read by no node: a graph output, or unused)"
    said = []
    for n in readers:
        kind = ("a comparison" if n.op_type in COMPARISONS else "a shape / mask op" if n.op_type in CONDITIONS else
                "the host's plumbing" if any(o in derived for o in n.outputs) else
                "a graph input's data movement" if any(o in ginput for o in n.outputs) else "")
        said.append(f"{n.op_type} {n.name}" + (f": {kind}" if kind else ""))
    return f" (read by {', '.join(said)})"


def _in_graph_order(graph, encodings) -> list:
    """The encoded tensors in the graph's order (inputs, initializers, then each node's outputs), then the rest."""
    order = [*graph.inputs, *graph.initializers, *(o for n in graph.nodes for o in n.outputs)]
    seen = dict.fromkeys(t for t in order if t in encodings)
    return [*seen, *(t for t in encodings if t not in seen)]


def stored_weights(weights: dict, stored) -> dict:
    """A placement's {weight: (Encoding, ...)} (each laid out on the ONNX graph's tensor) as the checkpoint stores
    the weights, refimpl's convention (Encoding.on_rows: [out, in] rows): a fused expert tensor the checkpoint holds
    one per expert (Qwen3-MoE: the export's experts.gate_up_proj [E, 2Ie, H] / down_proj [E, H, Ie], gathered by
    the expert index) becomes that expert's gate and up (the first and second half of its 2Ie rows) and down."""
    stored, out = set(stored), {}
    for name, chain in weights.items():
        rows = tuple(e.on_rows(max(2, np.ndim(e.scale))) for e in chain)
        fused = FUSED.match(name)
        if fused is None or name in stored or expert_names(fused[1], 0)[0] not in stored:
            out[name] = rows
            continue
        experts = 0
        while expert_names(fused[1], experts)[0] in stored:
            experts += 1
        for e in range(experts):
            gate, up, down = expert_names(fused[1], e)
            if fused[2] == "down_proj":
                out[down] = tuple(enc.rows(e, (experts, -1)) for enc in rows)
                continue
            for half, part in enumerate((gate, up)):   # expert e's 2Ie channels: gate's, then up's
                out[part] = tuple(enc.rows(e, (experts, -1)).rows(half, (2, -1)) for enc in rows)
    return out
