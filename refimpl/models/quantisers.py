"""AIMET activation quantisers, placed where AIMET puts them (docs/numerics.md).

AIMET's QuantSim wraps nn.Modules of a transformers model; each wrapped module has input quantisers (one per
argument) and output quantisers. refimpl's blocks declare the same modules beside their code
(the graph's `module=k` nodes, refimpl.graph.modules): module -> the taps that are its inputs. So an activation
encoding of module M is placed:

    legacy  {M: {"output": {0: enc}}}   at M's output tap (named M; the router mlp.gate's: mlp.router_logits),
                                        before it is recorded
            {M: {"input":  {i: enc}}}   on M's i-th input as M consumes it (q_proj's input quantiser acts on
                                        input_layernorm's output as q_proj reads it, not as k_proj does)
    1.0.0   {"name": M}                 M's output; AIMET's ONNX tensor name of a module output,
                                        "/model/layers.0/self_attn/q_proj/MatMul_output_0", too

Anything else (a module refimpl does not have, an input index it does not take, a tensor inside a module) cannot
be placed: it is listed (`unplaced`), warned about, recorded in the manifest, and an error with strict=True.

A quantised device graph (aimet-onnx, a QDQ model: refimpl/models/onnx_placement.py) has quantisers on nearly every
tensor; those sit at any declared node's output (`output(node, y)`, node outputs that are no module's too) or at a
sub-op point of its kernel's equation (`at(node)`: the hook a kernel takes, kernels/activation.Unhooked), several in
a row where the device re-quantises a tensor it only moves (a chain of encodings, applied in order).

A device arithmetic (`arithmetic="htp"`, Policy.device_arithmetic): the device computes some ops of its quantised
graph on the integer codes of their inputs, not on the float values ONNX Runtime's CPU EP computes and quantises.
For those ops (DEVICE_OPS, declared per node / point by the graph: device_ops) the quantiser's codes are the device
op's (kernels/htp_quantised.py) on the codes its inputs' quantisers held (each input's last quantised value, exactly
on its grid, and its encoding); every other quantiser quantises refimpl's float value as before.
"""

import re
import warnings

import numpy as np

from ..encodings import ActivationEntry, Encoding, model_name
from ..errors import InputError
from ..kernels import htp_quantised
from ..kernels.activation import identity, unhooked
from ..precision import DEVICE_ARITHMETICS
from .experts import expert_names

_ONNX_OUTPUT = re.compile(r"^/(?P<path>.+)/[A-Za-z0-9_]+_output_(?P<index>\d+)$")


class EncodingsWarning(UserWarning):
    """An encodings file names tensors refimpl cannot place; they are listed and left float."""


def _chain(enc) -> tuple:
    return enc if isinstance(enc, tuple) else (enc,)


# the ops a device arithmetic computes on its inputs' codes: op -> f(codes, ((scale, zero point) of each input),
# (scale, zero point) of the output) -> codes (kernels/htp_quantised.py: each measured on the HTP simulator)
DEVICE_OPS = {"htp": {"Add": lambda q, e, out: htp_quantised.add(q[0], e[0], q[1], e[1], out),
                      "Sub": lambda q, e, out: htp_quantised.sub(q[0], e[0], q[1], e[1], out),
                      "Sqrt": lambda q, e, out: htp_quantised.sqrt(q[0], e[0], out),
                      "ReduceMean": lambda q, e, out: htp_quantised.reduce_mean(q[0], e[0], out),
                      "ReduceSum": lambda q, e, out: htp_quantised.reduce_sum(q[0], e[0], out),   # last axis, kept
                      "MatMul": lambda q, e, out: htp_quantised.matmul(q[0], e[0], q[1], e[1], out),
                      "MatMul16": lambda q, e, out: htp_quantised.matmul16(q[0], e[0], q[1], e[1], out),
                      "Gemm": lambda q, e, out: htp_quantised.matmul(q[0], e[0], q[1], e[1], out, bias=(q[2], e[2][0])),
                      "GemmFloat16Bias": lambda q, e, out: htp_quantised.gemm_float_bias(q[0], e[0], q[1], e[1], q[2],
                                                                                          out),
                      "Mul": lambda q, e, out: htp_quantised.mul(q[0], e[0], q[1], e[1], out),
                      "Div": lambda q, e, out: htp_quantised.div(q[0], e[0], q[1], e[1], out),
                      "DivConstant": lambda q, e, out: htp_quantised.div(q[0], e[0], q[1], e[1], out, constant=True),
                      "Neg": lambda q, e, out: htp_quantised.neg(q[0], e[0], out),
                      "SiLU": lambda q, e, out: htp_quantised.silu_product(q[0], e[0], q[1], e[1], out),
                      "Sigmoid": lambda q, e, out: htp_quantised.sigmoid(q[0], e[0], out),
                      "Exp": lambda q, e, out: htp_quantised.exp(q[0], e[0], out),        # x <= 0 (_device)
                      "Softplus": lambda q, e, out: htp_quantised.softplus(q[0], e[0], out),
                      "Softmax": lambda q, e, out: htp_quantised.softmax(q[0], e[0], out),
                      "SoftmaxPair": lambda q, e, out: htp_quantised.softmax_pair(q[0], e[0], out),   # rows of 2
                      # the values a TopK compares and returns (the whole row: its kernel selects; moe.route)
                      "TopK": lambda q, e, out: htp_quantised.topk_values(q[0], e[0], out),
                      # the k values of a TopK of a Softmax, from the Softmax's input (k: the point's; _device)
                      "SoftmaxTopK": lambda q, e, out, k: htp_quantised.softmax_topk(q[0], e[0], out, k),
                      "RotateHalf": lambda q, e, out: htp_quantised.rotate_half(q[0], e[0], q[1], e[1], out),
                      "Conv": lambda q, e, out: htp_quantised.conv1d_depthwise(q[0], e[0], q[1], e[1], out),
                      # the MoE's experts (section "MoE experts" below): W_e x as the device graph's batched MatMul of
                      # the gathered uint16 weights [out, in] and x [in, n] (the second operand: requantised to uint8)
                      "ExpertMatMul": lambda q, e, out: htp_quantised.matmul16(q[0], e[0], q[1], e[1], out),
                      "ReduceSumSlots": lambda q, e, out: htp_quantised.reduce_sum(q[0], e[0], out, axis=1,
                                                                                   keepdims=False),
                      # a Concat of a per-token sum's instances (the delta rule's o_t = S^T q_t) computed into the
                      # Concat's encoding (DEVICE_CONCAT_ENCODES_INPUTS): each token's terms [B, Hv, Dk, Dv] summed
                      # over Dk, stacked over the tokens -> [B, T, Hv, Dv]
                      "TokenSums": lambda q, e, out: np.stack([htp_quantised.reduce_sum(c, ec, out, axis=-2,
                                                                                        keepdims=False)
                                                               for c, ec in zip(q, e)], 1)}}
# inputs an op of the device arithmetic takes as they are stored: the (bits, signed) it takes: MatMul's weight, 8-bit
# per tensor, unsigned (QNN's W8A16) or signed symmetric (aimet-onnx's: the same arithmetic, its zero point 0; a MatMul
# of two activations, the attention's products, is "MatMul16": its operands' layouts as attention_operands reads
# them); Mul's (RMSNorm's * w), 16-bit unsigned per tensor; a signed int4 weight per tensor (the MoE routers of QNN's
# W4A16: its steps in [-8, 7] are int8 steps, the same MatMul: every code of the 4 routers on the HTP's own inputs);
# the depthwise conv's weight per tensor, int4 too
DEVICE_WEIGHTS = {"MatMul": ((8, False), (8, True), (4, True)), "Mul": ((16, False),),
                  "Gemm": ((8, False), (8, True), (4, True)), "Conv": ((8, False), (8, True), (4, True))}
# biases an op of the device arithmetic reads as stored: a Gemm's (x W + b: Qwen3.5's in_proj_a with dt_bias fused),
# 32-bit signed per tensor
DEVICE_BIASES = {"Gemm": ((32, True),)}
# the device arithmetics that compute a Gemm whose bias the graph leaves float (no integer encoding: aimet-onnx's
# Qwen3.5 in_proj_a + dt_bias, with ONNX Runtime's graph optimizations off) on the float16 grid, op "GemmFloat16Bias"
# (the HTP: kernels/htp_quantised.gemm_float_bias; every code of the aimet-onnx W8A16 dump's 3 Gemms on their own
# inputs)
DEVICE_FLOAT16_BIASES = {"htp": ("Gemm",)}
assert set(DEVICE_OPS) == set(DEVICE_ARITHMETICS)
# the device arithmetics that compute a Mul of a tensor and its own Sigmoid's codes, x * sigmoid(x), as one fused op
# "SiLU" (the HTP: its rounding differs from its Mul's; kernels/htp_quantised.silu_product)
DEVICE_FUSES_SILU = ("htp",)
# the device arithmetics that requantise a value a data movement op moves into another encoding (a chain's further
# link: onnx_placement.Placement.moved_by) through float16: its value rounded to float16, then quantised (the HTP's
# Expand: Qwen3.5's repeat of q / k to the value heads; measured: every code of the 12 Expands of the QNN W8A16 and
# W4A16 HTP dumps on their own inputs, the exact requantisation 42-62 %, up to 20 codes)
DEVICE_FLOAT16_MOVES = {"htp": ("Expand",)}
# the device arithmetics that compute an op one of whose inputs the graph leaves float (a constant or graph input no
# quantiser holds: aimet-onnx's Qwen3.5 export leaves the pad mask of x * mask float) in float16: the op's value
# rounded to float16, then quantised (the HTP: every code of the 3 masks' Muls of the aimet-onnx W8A16 dump on their
# own inputs, the exact requantisation of x * 1 36 %, up to 9 codes)
DEVICE_FLOAT16_FLOAT_INPUTS = ("htp",)
# the device arithmetics that hold a cache the host feeds float (the genie past keys / values: graph inputs whose first
# quantiser follows a Gather and an Unsqueeze) as its float16 copy, and the points holding it: its quantiser's codes
# from that copy (htp_quantised.quantize_float16), the Concat with the new entries reading the copy (_float16_cache;
# docs/htp.md §9: the dense W8A16 model's decode calls)
DEVICE_FLOAT16_CACHE = {"htp": ("past_keys", "past_values")}
# the device arithmetics whose Sigmoid writes codes of its own encoding whatever the graph's says, which every consumer
# reads so (the HTP: sigmoid(x) 2^16; a plain Mul reads them at (2^-16, 0), a Gather of a token requantises them from
# there into its encoding: htp_quantised.sigmoid_moved; the fused SiLU: htp_quantised.silu_product)
DEVICE_SIGMOID_CODES = {"htp": htp_quantised.SILU_SIGMOID}
# the device arithmetics whose Concat takes its inputs in its own encoding: the ops making them write into it, their
# own quantisers not applied on the way (the HTP: the delta rule's per-token o_t = S^T q_t, ReduceSum -> Unsqueeze ->
# Concat into the core's [B, Hv, T, Dv]: every code of layer 0's core as each token's ReduceSum of the HTP's own S*q
# codes into the Concat's encoding, where o_t's quantiser clips; QNN Qwen3.5 W8A16, k delta^T as MatMul): the op
# "TokenSums" on the sum's own input
DEVICE_CONCAT_ENCODES_INPUTS = ("htp",)
# the device arithmetics that compute a Concat of a Neg and another tensor, RoPE's rotate_half [-x2 | x1], as one
# fused op "RotateHalf" on the Neg's input (the Neg's own quantiser not read; kernels/htp_quantised.rotate_half)
DEVICE_FUSES_ROTATE_HALF = ("htp",)


def device_ops(nodes: dict, arithmetic: str, forms: dict | None = None) -> dict:
    """{node or "node/point": (op, the names its inputs' quantisers hold)} of the declared ops the device arithmetic
    computes on codes (graph declarations: refimpl/graph.py; a residual add node is an Add of its inputs). Inputs:
    "/p", "const:p" and "input:p" are the node's point p; a tap "n" or "n/p" itself; "weight:w" the stored weight
    w (an op of DEVICE_WEIGHTS, x W only, or x W + b of DEVICE_BIASES: their codes). Other ops reading a weight, and
    per-token values, are left out; a MatMul of two activations (the attention's products) is computed in the device
    graph's per-head layout (attention_operands). forms: {"node/point": the op of the other
    declared form (graph.Point.also) the device graph computes it in} (onnx_placement.Placement.forms: x^2 as
    Mul(x, x), x * 1 / sqrt as Div(x, sqrt)): that form's op and inputs. A Mul of x and its own Sigmoid point
    (SiLU: x * sigmoid(x)) is the op "SiLU" where the device fuses it (DEVICE_FUSES_SILU); a Concat of a Neg point
    and another tensor (rotate_half: [-x2 | x1]) the op "RotateHalf" on the Neg's input (DEVICE_FUSES_ROTATE_HALF); a
    Div by a constant of the graph (q / sqrt(D_k)) the op "DivConstant" (the HTP folds it where its output encoding is
    the input's / c). A per-token point's form is its instances' ("p@t" in forms); a per-token MatMul of two
    activations (k_t delta_t^T written [Dk, 1] x [1, Dv]) the op "MatMul16" on its operands as the kernel broadcasts
    them. A TopK of a Softmax node's output (the MoE's top k of the router's probabilities) is the op "SoftmaxTopK"
    on the Softmax's input (the HTP's TopK reads a float16 softmax, not the Softmax's codes); in its other form (the
    top k of the logits) "TopK"."""
    ops = DEVICE_OPS[arithmetic]
    forms = dict(forms or {})
    for instance, op in list(forms.items()):   # a per-token point's instances "p@t": the form of p (its unrolled op)
        forms.setdefault(instance.rpartition("@")[0] if "@" in instance else instance, op)
    out = {}
    softmaxes = {name: pt.inputs for name, node in nodes.items() for pt in node.points   # a node that is a Softmax:
                 if not pt.name and pt.onnx[0] == "Softmax" and len(pt.inputs) == 1}   # its input
    for name, node in nodes.items():
        declared = [(name, "Add", node.inputs)] if node.op == "residual add" else []
        sigmoids = {f"/{pt.name}": tuple(pt.inputs) for pt in node.points if pt.onnx[0] == "Sigmoid"}
        negs = {f"/{pt.name}": pt.inputs[0] for pt in node.points if pt.onnx[0] == "Neg" and len(pt.inputs) == 1}
        sums = {f"/{pt.name}@*": pt.inputs[0].replace("@t", "@*") for pt in node.points   # per-token ReduceSums:
                if pt.onnx[0] == "ReduceSum" and pt.per_token and len(pt.inputs) == 1}     # "/o@*" -> "/S*q@*"
        for pt in node.points:
            where = f"{name}/{pt.name}" if pt.name else name
            pt = next((f for f in pt.forms()[1:] if f.onnx[0] == forms.get(where)), pt)   # the device's form
            if pt.onnx[0] == "TopK" and forms.get(where) != "TopK" and len(pt.inputs) == 1 \
                    and pt.inputs[0] in softmaxes:                  # the top k of a Softmax's codes: the HTP's reads
                declared.append((where, "SoftmaxTopK", softmaxes[pt.inputs[0]]))   # a float16 softmax of its input
                continue
            if pt.onnx[0] == "Mul" and arithmetic in DEVICE_FUSES_SILU and len(pt.inputs) == 2 \
                    and sigmoids.get(pt.inputs[1]) == (pt.inputs[0],):
                declared.append((where, "SiLU", pt.inputs))                     # x * sigmoid(x), fused
                continue
            if pt.onnx[0] == "Concat" and arithmetic in DEVICE_FUSES_ROTATE_HALF and len(pt.inputs) == 2 \
                    and pt.inputs[0] in negs:
                declared.append((where, "RotateHalf", (negs[pt.inputs[0]], pt.inputs[1])))   # [-x2 | x1], fused
                continue
            if pt.onnx[0] == "MatMul" and len(pt.inputs) == 2 and pt.inputs[0].startswith("weight:") \
                    and not pt.inputs[1].startswith("weight:"):
                declared.append((where, "ExpertMatMul", pt.inputs))             # W x: the MoE's experts
                continue
            if pt.onnx[0] == "Concat" and arithmetic in DEVICE_CONCAT_ENCODES_INPUTS and len(pt.inputs) == 1 \
                    and pt.inputs[0] in sums:
                declared.append((where, "TokenSums", (sums[pt.inputs[0]],)))   # each o_t summed into its encoding
                continue
            constant = pt.onnx[0] == "Div" and len(pt.inputs) == 2 and pt.inputs[1].startswith("const:")
            if pt.per_token:               # an unrolled loop's op: every token's instance "where@t" (its first's)
                two = pt.onnx[0] == "MatMul" and not any(i.startswith("weight:") for i in pt.inputs)   # of two
                declared.append((f"{where}@t", "MatMul16" if two else pt.onnx[0], pt.inputs))   # activations
                if pt.first:
                    declared.append((f"{where}@0", pt.onnx[0], pt.first))
                continue
            declared.append((where, "DivConstant" if constant else pt.onnx[0], pt.inputs))   # x / c: may fold
        for where, op, inputs in declared:
            held = tuple(f"{name}/{i[1:]}" if i.startswith("/") else f"{name}/{i.partition(':')[2]}"
                         if i.startswith(("const:", "input:")) else i for i in inputs)
            weights = [i.startswith("weight:") for i in inputs]
            reads = weights in ([False, True], [False] * len(weights)) or (   # x W, or no weight, or x W + b
                op in DEVICE_BIASES and weights == [False, True, True]) or (
                op == "ExpertMatMul" and weights == [True, False])                # W x (the MoE's experts)
            if op in ops and ("@*" not in "".join(inputs) or op == "TokenSums") and reads:
                out[where] = (op, held)     # a per-token op's inputs "x@t", "x@t-1": its instances' (Quantisers.op)
    return out


BROADCASTING = ("Add", "Sub", "Mul", "Div", "DivConstant", "SiLU")   # device ops whose inputs broadcast


def attention_operands(codes: list, shape: tuple):
    """The attention's two products as the device graph computes them (per head, [..., M, K] x [..., K, N]), from
    the codes refimpl's quantisers held in refimpl's layouts (models/qwen3.attention); None for another layout.
    -> ([a, b], put: the product's codes -> the point's layout `shape`).
        q*k^T:  q_rope [B, T, Hq, D], keys [B, Hkv, L, D]      -> [B, Hkv, Hq/Hkv, T, L] (the point's)
        p v:    probs [B, Hq, T, L], values [B, Hkv, L, D]     -> [B, T, Hq D] (attn_output's)"""
    a, b = (np.asarray(c) for c in codes)
    if a.ndim != 4 or b.ndim != 4:
        return None
    if len(shape) == 5:                                                      # q k^T
        B, Hkv, rep, T, L = shape
        if a.shape != (B, T, Hkv * rep, a.shape[-1]) or b.shape != (B, Hkv, L, a.shape[-1]):
            return None
        qa = a.transpose(0, 2, 1, 3).reshape(B, Hkv, rep, T, -1)                # [B, Hkv, rep, T, D]
        return [qa, b[:, :, None].swapaxes(-1, -2)], lambda q: q                # keys^T [B, Hkv, 1, D, L]
    if len(shape) == 3:                                                      # p v, heads flattened
        B, Hq, T, L = a.shape
        Hkv, D = b.shape[1], b.shape[-1]
        if b.shape != (B, Hkv, L, D) or Hq % Hkv or shape != (B, T, Hq * D):
            return None
        pa = a.reshape(B, Hkv, Hq // Hkv, T, L)                                  # [B, Hkv, rep, T, L]
        return [pa, b[:, :, None]], lambda q: q.reshape(B, Hq, T, D).transpose(0, 2, 1, 3).reshape(shape)
    return None


def conv_operands(codes: list, shape: tuple):
    """The depthwise conv as the device graph's Conv reads it, from the codes refimpl's quantisers held: the conv's
    input [state | x] [B, C, S + T] (kernels/conv.causal_conv1d's point "x") and the weight's codes as held ([in,
    out] of the checkpoint's [C, 1, K]: [K, 1, C]); None for another layout.
    -> ([the last K - 1 + T columns, the weight [K, C]], put: the conv's codes [B, C, T] -> the node's [B, T, C])."""
    x, w = (np.asarray(c) for c in codes)
    if x.ndim != 3 or w.ndim != 3 or w.shape[1] != 1 or len(shape) != 3:
        return None
    B, T, C = shape
    K = w.shape[0]
    if x.shape[:2] != (B, C) or w.shape[2] != C or x.shape[2] < K - 1 + T:
        return None
    return [x[..., x.shape[2] - (K - 1 + T):], w[:, 0]], lambda q: q.transpose(0, 2, 1)


def regrouped(a: tuple, b: tuple) -> bool:
    """Shapes a and b the same axes in the same order, runs of adjacent axes merged on one side ([B, Hkv, Hq/Hkv,
    T, L] and [B, Hq, T, L]; [B, T, H D] and [B, T, H, D]); axes of 1 ignored."""
    a, b = [d for d in a if d != 1], [d for d in b if d != 1]
    while a and b:
        if a[0] > b[0]:
            a, b = b, a
        run = a.pop(0)                                                      # the smaller axis, merged with its
        while run < b[0] and a:                                             # neighbours up to the other's
            run *= a.pop(0)
        if run != b.pop(0):
            return False
    return not a and not b


def _broadcast(*shapes) -> bool:
    try:
        np.broadcast_shapes(*shapes)
    except ValueError:
        return False
    return True


def _expert_rows(name: str, codes, selection: dict):
    """An input's codes as the selected expert's ops read them: the routing weights [N, k] at its tokens' slots,
    [n_e, 1]; any other input as held."""
    if not name.endswith(".routing_weights") or "slots" not in selection:
        return codes
    c = np.asarray(codes)
    return c.reshape(-1, c.shape[-1])[selection["tokens"], selection["slots"]][:, None]


def _per_channel_int4(enc: Encoding, rows: int) -> bool:
    """A weight's symmetric int4 encoding per output row (W4A16; the HTP's MatMul takes each column's own scale)."""
    return (enc.float_dtype is None and enc.block_size is None and enc.signed and enc.bitwidth == 4
            and np.shape(enc.scale) == (rows,) and not np.any(enc.offset))


def _per_tensor_integer(enc: Encoding, bits: int = 16, signed: bool = False) -> bool:
    return enc.float_dtype is None and not np.ndim(enc.scale) and enc.signed == signed and enc.bitwidth == bits


class Quantisers:
    """The activation quantisers of one model: `input(module, x, i)` and `output(node, y)` return the value as
    the quantised device holds it (x itself where no encoding is placed); `at(node)` is the hook of node's kernel
    (its sub-op points). After each quantiser the value is cast to the activation dtype (`rnd`): QuantSim on a
    reduced-precision model quantises in float32 and returns the tensor's own dtype. An encoding may be a tuple of
    encodings, applied in order. record: None, or a dict that receives {node (its tap name) or node/point, or
    "module:input.i": the value its first quantiser received} (the device's float tensor before quantisation)."""

    def __init__(self, inputs: dict | None = None, outputs: dict | None = None, unplaced=(), rnd=identity,
                 taps: dict | None = None, points: dict | None = None, placement=None, forms: dict | None = None,
                 arithmetic: str | None = None, ops: dict | None = None, weight=None, moved_by: dict | None = None):
        self.inputs: dict[tuple[str, int], Encoding] = inputs or {}
        self.outputs: dict[str, Encoding | tuple] = outputs or {}
        self.points: dict[str, dict[str, Encoding | tuple]] = points or {}   # node -> {point: encoding(s)}
        self.taps: dict[str, str] = taps or {}   # module -> its output's tap, where that is not the module's name
        self.unplaced: list[str] = list(unplaced)
        self.placement = placement               # an ONNX graph's placement (onnx_placement.Placement), if any
        self.record: dict | None = None
        self._rnd = rnd
        if arithmetic is not None and arithmetic not in DEVICE_OPS:
            raise InputError(f"device arithmetic {arithmetic!r} is not one of {', '.join(DEVICE_ARITHMETICS)}")
        self.arithmetic = arithmetic             # None: ONNX Runtime's CPU EP (the float value quantised)
        self.ops: dict = ops or {}               # where -> (op, input names): computed on codes (device_ops)
        self._holds = {i.partition("@")[0] for _, ins in self.ops.values() for i in ins}   # (a per-token input's base)
        self._whole = {i[:-2] for _, ins in self.ops.values() for i in ins if i.endswith("@*")}   # every token's read
        self.given: dict = {}                    # where -> the values its op reads, as its kernel gave them
        self.held: dict = {}                     # input name -> (its last quantised value, its encoding)
        self.selection: dict | None = None       # the rows the next ops read (the MoE's expert e: Hook.select)
        self._weight = weight                    # checkpoint name -> (its stored values [out, in], its encoding)
        self._weight_codes: dict = {}            # name -> (codes [in, out], encoding), read once
        self.moved_by: dict = moved_by or {}     # where -> the op making each link of its chain (Placement.moved_by)
        self.sigmoids: set = set()               # held Sigmoids whose codes mean sigmoid(x) 2^16, not their encoding
        forms = forms or {}                      # "node/point" -> the op of the form the device computes it in
        self.hooks = {node: Hook(self, node, encs, {p: forms[f"{node}/{p}" if p else node] for p in (*encs, "")
                                                    if (f"{node}/{p}" if p else node) in forms})
                      for node, encs in self.points.items()}   # (point "": the node's output, its form too)

    def __bool__(self) -> bool:
        return bool(self.inputs or self.outputs or self.points)

    def op(self, name: str):
        """(op, the names its inputs' quantisers hold) of the device op at `name`, or None: a per-token point's
        instance "p@3" is its template's "p@t" with "x@t" read as x@3 and "x@t-1" as x@2 (token 0: its own entry)."""
        base, _, t = name.rpartition("@")
        got = self.ops.get(name) or (self.ops.get(f"{base}@t") if base and t.isdigit() else None)
        if got is None or not t.isdigit():
            return got
        return got[0], tuple(i.replace("@t-1", f"@{int(t) - 1}").replace("@t", f"@{t}") for i in got[1])

    def quantise(self, name: str, enc, x):
        """x through the quantiser(s) enc (recorded as `name` when recording); with a device arithmetic, an op it
        computes on codes (self.ops) takes its first quantiser's values from the device op instead (recorded so)."""
        chain = full = _chain(enc)
        if name.rpartition("/")[2] in DEVICE_FLOAT16_CACHE.get(self.arithmetic, ()) and len(chain) == 1 and \
                _per_tensor_integer(chain[0]):   # the host's float cache, on the device in float16
            return self._float16_cache(name, chain[0], x)
        op = self.op(name) if self.ops else None
        y = self._device(name, chain[0], x) if op else None
        if y is None and op and self.arithmetic in DEVICE_FLOAT16_FLOAT_INPUTS and self._float_input(name, op[1]):
            y = htp_quantised.float16_copy(x).astype(np.asarray(x).dtype, copy=False)   # computed in float16
        self.given.pop(name, None)
        if self.record is not None:        # a device op's value is the device's (its codes those of its quantiser)
            self.record[name] = np.array(x if y is None else y, copy=True)
        if y is not None:
            x, chain = self._rnd(y), chain[1:]
            own = DEVICE_SIGMOID_CODES.get(self.arithmetic)
            if op[0] == "Sigmoid" and own and (float(full[0].scale), -int(np.asarray(full[0].offset))) != own:
                self.sigmoids.add(name)        # its consumers read the codes at the device's own encoding
        moves = self.moved_by.get(name, ())[len(full) - len(chain):]   # the op making each link applied
        for e, op in zip(chain, moves or (None,) * len(chain)):
            if op is not None and op in DEVICE_FLOAT16_MOVES.get(self.arithmetic, ()):
                x = htp_quantised.float16_copy(x)                                        # the device's float16 copy
            x = self._rnd(e.apply(x))
        base, _, t = name.rpartition("@")
        if name in self._holds or (t.isdigit() and base in self._holds):
            self.held[name] = (x, full[-1])
            if t.isdigit() and base not in self._whole:   # a per-token instance: two tokens back read no more
                self.held.pop(f"{base}@{int(t) - 2}", None)
        return x

    def _float16_cache(self, name: str, enc: Encoding, x):
        """The cache the host feeds float, as the device holds it (DEVICE_FLOAT16_CACHE): its quantiser's codes taken
        from its float16 copy (recorded and held as the device's), and that float16 copy returned: the Concat after it
        reads it (the QNN EP folds the quantiser's pair into the Concat, which quantises the float16 value into its
        own encoding: every code of layer 0's cached keys and values of a decode call, layers 1-3's 99.55-100 %, the
        rest ties the float32 x / s rounds the other way; through the quantiser's own codes 98.0-99.3 %; a cached key
        202 steps beyond its quantiser's range reaches the Concat unclipped). A quantiser whose 1 / s leaves float16's
        range (a cache encoding calibrated on empty caches: [0, 1e-4], s = 1.5e-9) is not folded so: the Concat reads
        the value clipped to that range (every code of such a model's decode calls: the cache zeroed; where between
        s = 1.5e-9 and 1e-4 the HTP changes over is not measured)."""
        x16 = htp_quantised.float16_copy(x).astype(np.asarray(x).dtype, copy=False)   # the device's float16 copy
        q = htp_quantised.quantize_float16(x, enc.scale_zero)                             # its quantiser's codes
        y = enc.dequantize(q).astype(x16.dtype, copy=False)
        self.given.pop(name, None)
        if self.record is not None:
            self.record[name] = np.array(y, copy=True)
        if name in self._holds:
            self.held[name] = (y, enc)
        if 1 / float(enc.scale) > float(np.finfo(np.float16).max):                      # 1 / s beyond float16
            lo, hi = enc.dequantize(np.array(enc.qrange)).astype(x16.dtype)              # the quantiser's range
            return np.clip(x16, lo, hi)
        return x16                                                                       # the copy, unclipped

    def _float_input(self, name: str, inputs: tuple) -> bool:
        """Whether the device op at `name` reads one of its node's own points (a constant or graph input) with no
        quantiser placed there nor at the same point of a sibling node (twins share one: in_proj_qkv / in_proj_z's
        pad mask): the device graph holds that input float."""
        node = name.partition("/")[0]
        block = node.rpartition(".")[0]
        placed = {p for n, encs in self.points.items() if n.rpartition(".")[0] == block for p in encs}
        return any(i.partition("/")[0] == node and i.partition("/")[2].partition("@")[0] not in placed
                   for i in inputs if "/" in i)

    def _device(self, name: str, enc: Encoding, x):
        """The device op at `name` on its inputs' held codes, dequantised by enc (x's dtype); None where an input
        is not held or an encoding is not per-tensor uint16 (then x is quantised as the CPU EP does)."""
        op, inputs = self.op(name)
        if op == "ExpertMatMul":
            return self._expert_matmul(enc, inputs, x)
        if op == "TokenSums":              # "x@*": x's instances of this call's T tokens (x [B, T, ...])
            inputs = tuple(inputs[0].replace("@*", f"@{t}") for t in range(np.shape(x)[1]))
        held = [self.held.get(i, self.held.get(i.partition("@")[0])) if not i.startswith("weight:")   # (x@t: x's
                else self._weight_held(i[7:], op, bias=n == 2) for n, i in enumerate(inputs)]      # encoding) x, W, b
        bias = self._float16_bias(op, inputs, held)   # a Gemm whose bias the graph leaves float (DEVICE_FLOAT16_BIASES)
        if bias is not None:
            held, op = held[:2], "GemmFloat16Bias"
        given = self.given.get(name)   # the values a per-token op reads, as its kernel broadcasts them
        if given is not None:
            if len(given) != len(held) or any(h is None for h in held):
                return None
            held = [(v, h[1]) for v, h in zip(given, held)]
        if any(h is None for h in held) or not all(_per_tensor_integer(e) for e in (enc, *(h[1] for h in held
                                                                                         if h[0] is not None))):
            return None
        codes = [h[1].codes(np.asarray(h[0], np.float32)) if h[0] is not None else h[2] for h in held]   # on grid
        encs = [h[1].scale_zero for h in held]                                        # (scale, zero point) each
        if bias is not None:
            codes.append(bias)                                                        # its float values [N]
        for j, i in enumerate(inputs):     # a Sigmoid's codes at the device's encoding (DEVICE_SIGMOID_CODES)
            if i.partition("@")[0] in self.sigmoids:
                if "@" in i:               # a token of it: the device graph's Gather moves it into its encoding
                    codes[j] = htp_quantised.sigmoid_moved(codes[j], encs[j])
                else:
                    encs[j] = DEVICE_SIGMOID_CODES[self.arithmetic]
        if self.selection is not None:     # the MoE's expert e: its tokens' routing weights, in their slots
            codes = [_expert_rows(i, c, self.selection) for i, c in zip(inputs, codes)]
        if op == "ReduceSum" and np.ndim(codes[0]) == 3 and np.size(codes[0]) == np.size(x) * np.shape(codes[0])[1]:
            op = "ReduceSumSlots"          # the MoE's weighted terms [N, k, H] summed over the k slots
        if op == "MatMul" and all(h[0] is not None for h in held):                  # two activations: attention
            operands = attention_operands(codes, np.shape(x))
            if operands is None:
                return None
            codes, put = operands
            q = DEVICE_OPS[self.arithmetic]["MatMul16"](codes, encs, enc.scale_zero)
            return enc.dequantize(put(q)).astype(np.asarray(x).dtype, copy=False)
        if op == "Conv":                   # the depthwise conv over [state | x] ([B, C, S + T]) into [B, T, C]
            operands = conv_operands(codes, np.shape(x))
            if operands is None:
                return None
            codes, put = operands
            q = DEVICE_OPS[self.arithmetic][op](codes, encs, enc.scale_zero)
            return enc.dequantize(put(q)).astype(np.asarray(x).dtype, copy=False)
        if op in BROADCASTING:             # an input held before a split of its last axis (q_proj's [B, T, H D]
            codes = [c.reshape(np.shape(x)) if np.size(c) == np.size(x) and np.shape(c) != np.shape(x)   # as
                     and np.shape(c)[:-1] == np.shape(x)[:np.ndim(c) - 1] else c for c in codes]   # q_norm's x)
            if not _broadcast(*(np.shape(c) for c in codes)):      # held in another layout
                return None
        if op == "MatMul" and np.shape(codes[0])[-1] != np.shape(codes[1])[0]:     # held with its heads split
            a = np.asarray(codes[0])                                                # (Qwen3.5's gated norm [.., H, D]
            if a.ndim < 2 or a.shape[-2] * a.shape[-1] != np.shape(codes[1])[0]:  # into out_proj's [.., H D])
                return None
            codes[0] = a.reshape(*a.shape[:-2], -1)
        if op == "Exp" and (np.asarray(codes[0], np.int64) > int(encs[0][1])).any():
            return None                    # x > 0: another path of the HTP's Exp, not modelled
        c0 = np.shape(codes[0])
        axes = [a for a in range(len(c0)) if c0[:a] + c0[a + 1:] == np.shape(x)]     # the axis a sum removes
        if op == "ReduceSum" and given is not None and axes:   # a per-token sum over its kernel's axis (S^T k: Dk)
            q = htp_quantised.reduce_sum(codes[0], encs[0], enc.scale_zero, axes[0], False)
            return enc.dequantize(q).astype(np.asarray(x).dtype, copy=False)
        if op == "ReduceSum" and (np.shape(x)[-1:] != (1,) or np.shape(codes[0])[:-1] != np.shape(x)[:-1]):
            return None                    # a sum over another axis (the device op sums the last, keeping it)
        if op == "SoftmaxTopK":            # the k values of the TopK of a Softmax of the held codes ([.., E] rows)
            c = np.asarray(codes[0])
            q = DEVICE_OPS[self.arithmetic][op]([c.reshape(-1, c.shape[-1])], encs, enc.scale_zero, np.shape(x)[-1])
            return enc.dequantize(q.reshape(np.shape(x))).astype(np.asarray(x).dtype, copy=False) \
                if q.size == np.size(x) else None
        if op == "Softmax" and np.shape(codes[0])[-1] == 2:                       # the HTP's 2-element kernel
            op = "SoftmaxPair"
        if op == "Softmax" and np.shape(codes[0])[-1] < 2:
            return None
        q = DEVICE_OPS[self.arithmetic][op](codes, encs, enc.scale_zero)
        shape = np.shape(x)                # the inputs may be held with axes split or merged (q_proj's [B, T, H D]
        if q.shape != shape and not regrouped(q.shape, shape):   # for q_norm's [B, T, H, D]; the scores' [B, Hkv,
            return None                    # Hq/Hkv, T, L] for [B, Hq, T, L]); transposed, it is not the op's
        return enc.dequantize(q.reshape(shape)).astype(np.asarray(x).dtype, copy=False)

    def _float16_bias(self, op: str, inputs: tuple, held: list):
        """The float values [N] of a Gemm's bias that no integer encoding holds (aimet-onnx leaves in_proj_a + dt_bias's
        float), where the device computes such a Gemm on the float16 grid (DEVICE_FLOAT16_BIASES); None otherwise."""
        if op not in DEVICE_FLOAT16_BIASES.get(self.arithmetic, ()) or len(inputs) != 3 or held[2] is not None \
                or not inputs[2].startswith("weight:") or self._weight is None:
            return None
        got = self._weight(inputs[2][7:])
        if got is None or (got[1] is not None and got[1].float_dtype is None):   # an integer bias: not this op
            return None
        return np.asarray(got[0], np.float32)

    def _weight_held(self, name: str, op: str, bias: bool = False):
        """(None, encoding, codes [in, out]) of stored weight `name` as op reads it (DEVICE_WEIGHTS, or a bias:
        DEVICE_BIASES: its bits and sign, per tensor); None where it is not so (a per-channel int4 weight: the CPU EP's
        arithmetic then)."""
        if name not in self._weight_codes:
            got = self._weight(name) if self._weight is not None else None
            enc = got[1].on_rows() if got is not None and got[1] is not None else None   # [out, in], as held
            ok = enc is not None and (any(_per_tensor_integer(enc, *kind) for kind in (
                DEVICE_BIASES if bias else DEVICE_WEIGHTS)[op]) or (
                op == "MatMul" and _per_channel_int4(enc, np.shape(got[0])[0])))   # W4A16: int4 per output row
            self._weight_codes[name] = (None, enc, enc.codes(np.asarray(got[0], np.float32).T)) if ok else None
        return self._weight_codes[name]

    # ---------------------------------------------------------------------------------------------- MoE experts
    # The device graph computes the MoE's experts per token and slot: each expert's weights gathered by the expert id
    # (uint16 activations of their own encoding in QNN's QDQ models: the fused gate_up_proj / down_proj), W_e x as a
    # batched MatMul of two uint16 tensors (htp_quantised.matmul16: x, the second operand, requantised to uint8), the
    # SiLU product, the weighted term (a Mul by the token's routing weight in that slot) and their ReduceSum over the
    # k slots. refimpl computes them per expert (kernels/moe.mix_experts tells the hook which expert, tokens and slots
    # its next ops read: Hook.select), on the same codes.

    def _expert_matmul(self, enc: Encoding, inputs: tuple, x):
        """W_e x of the selected expert e (a point MatMul(weight:W, x), W the fused experts' tensor) on its stored
        uint16 codes and the held x's rows of e's tokens; None where not so (then the CPU EP's arithmetic)."""
        sel, held = self.selection, self.held.get(inputs[1])
        w = self._expert_weight(inputs[0][7:], sel["expert"]) if sel is not None and "expert" in sel else None
        if w is None or held is None or not (_per_tensor_integer(enc) and _per_tensor_integer(held[1])):
            return None
        qx = held[1].codes(np.asarray(held[0], np.float32))
        qx = qx.reshape(-1, qx.shape[-1])                                               # [N, in] or [n_e, in]
        qx = qx if qx.shape[0] == np.shape(x)[0] else qx[sel["tokens"]]                # expert e's tokens
        if qx.shape != (np.shape(x)[0], w[0].shape[1]) or np.shape(x)[-1] != w[0].shape[0]:
            return None
        q = DEVICE_OPS[self.arithmetic]["ExpertMatMul"]([w[0], qx.T], [w[1], held[1].scale_zero],
                                                        enc.scale_zero).T                       # [n_e, out]
        return enc.dequantize(q).astype(np.asarray(x).dtype, copy=False)

    def _expert_weight(self, name: str, e: int):
        """(codes [out, in], (scale, zero point)) of expert e's part of the fused experts' weight `name`
        (`{prefix}.gate_up_proj`: its gate's rows then its up's; `{prefix}.down_proj`), stored 16-bit unsigned per
        tensor; None otherwise."""
        prefix, _, fused = name.rpartition(".")
        gate, up, down = expert_names(prefix, e)
        parts = {"gate_up_proj": (gate, up), "down_proj": (down,)}.get(fused, ())
        chain = self.placement.weights.get(name) if self.placement is not None else None   # the fused tensor's
        if not parts or not chain or self._weight is None or not _per_tensor_integer(chain[-1]):
            return None
        enc = chain[-1]                                                 # one encoding per tensor: every expert's
        codes = np.concatenate([enc.codes(np.asarray(self._weight(n)[0], np.float32)) for n in parts])   # [out, in]
        return codes, enc.scale_zero

    def input(self, module: str, x: np.ndarray, i: int = 0) -> np.ndarray:
        enc = self.inputs.get((module, i)) if self.inputs else None
        return x if enc is None else self.quantise(f"{module}:input.{i}", enc, x)

    def output(self, node: str, y: np.ndarray) -> np.ndarray:
        enc = self.outputs.get(node) if self.outputs else None
        return y if enc is None else self.quantise(self.taps.get(node, node), enc, y)

    def at(self, node: str):
        """The hook of node's kernel: its sub-op points' quantisers (kernels/activation.Unhooked where none)."""
        return self.hooks.get(node, unhooked) if self.hooks else unhooked

    def within(self, prefix: str):
        """A hook over a block's nodes (a kernel computing several: the MoE router): point "node" is node
        prefix.node's output, "node/p" its point p."""
        if not (self.outputs or self.hooks):
            return unhooked
        return BlockHook(self, prefix)

    def output_taps(self) -> dict[str, Encoding]:
        """{tap: Encoding} of every output-quantised tap (the last of a chain: the values the tap holds)."""
        return {self.taps.get(m, m): _chain(enc)[-1] for m, enc in self.outputs.items()}

    def describe(self, modules: dict) -> dict:
        """The manifest record: every placed quantiser (module, input i / output, the tap it acts on, encoding)
        in execution order, and what could not be placed; with an ONNX graph's placement, its quantisers per node
        and point (refimpl/models/onnx_placement.py)."""
        if self.placement is not None:
            return self.placement.describe()
        placed = []
        for module, taps in modules.items():
            for i, tap in enumerate(taps):
                if (module, i) in self.inputs:
                    placed.append({"module": module, "io": "input", "index": i, "tap": tap,
                                   **self.inputs[module, i].describe()})
            if module in self.outputs:
                placed.append({"module": module, "io": "output", "index": 0, "tap": self.taps.get(module, module),
                               **self.outputs[module].describe()})
        return {"quantisers": placed, "unplaced": list(self.unplaced)}


class BlockHook:
    """Quantisers.within(prefix): hook("node" | "node/point", value) for the nodes under prefix."""

    def __init__(self, quantisers: Quantisers, prefix: str):
        self.quantisers, self.prefix = quantisers, prefix
        cut = len(prefix) + 1
        self.points = frozenset([n[cut:] for n in quantisers.outputs if n.startswith(prefix + ".")]
                                + [f"{n[cut:]}/{p}" for n, h in quantisers.hooks.items() if n.startswith(prefix + ".")
                                   for p in h.points])
        self.forms = {f"{n[cut:]}/{p}" if p else n[cut:]: op for n, h in quantisers.hooks.items()   # "node(/point)":
                      if n.startswith(prefix + ".") for p, op in h.forms.items()}                  # its device form

    def __call__(self, point: str, value):
        if point not in self.points:
            return value
        node, _, sub = point.partition("/")
        node = f"{self.prefix}.{node}"
        return self.quantisers.at(node)(sub, value) if sub else self.quantisers.output(node, value)

    def operand(self, point: str, value) -> None:
        node, _, sub = point.partition("/")
        if sub:
            self.quantisers.at(f"{self.prefix}.{node}").operand(sub, value)


class Hook:
    """A node's sub-op quantisers as its kernel calls them: hook(point, value) -> the value quantised there (a
    constant, e.g. eps, as float32: the device's constant); `points`: where it acts; `forms`: points the device
    computes in another declared form (graph.Point.also: {point: its op}), which the kernel then computes."""

    def __init__(self, quantisers: Quantisers, node: str, encodings: dict, forms: dict | None = None):
        self.quantisers, self.node, self.encodings = quantisers, node, encodings
        self.points = frozenset(encodings)
        self.forms = forms or {}     # point -> the ONNX op of the equivalent form the device computes it in

    def __call__(self, point: str, value):
        enc = self.encodings.get(point)
        if enc is None:
            return value
        x = value if isinstance(value, np.ndarray) and value.dtype.kind == "f" else np.asarray(value, np.float32)
        return self.quantisers.quantise(f"{self.node}/{point}", enc, x)

    def operands(self, point: str, *values) -> None:
        """The values the op at `point` reads (its kernel's operands, as it broadcasts them: a per-token op's token t
        slices), each on its input's grid: the device arithmetic computes the op on their codes."""
        if point in self.points and self.quantisers.ops and self.quantisers.op(f"{self.node}/{point}"):
            self.quantisers.given[f"{self.node}/{point}"] = values

    def select(self, **rows) -> None:
        """The rows the node's next ops read (kernels/moe.mix_experts: expert=e, tokens=..., slots=...; none: all)."""
        self.quantisers.selection = rows or None

    def operand(self, point: str, value) -> None:
        """value: the quantised value held at `point` (or at the block's tap `point`, the node's input of that name:
        the gated delta rule's q) after data movement (duplicated, broadcast, transposed: the same codes), as the ops
        reading it there take it; the device arithmetic computes them on it."""
        key = f"{self.node}/{point}"
        key = key if key in self.quantisers.held else f"{self.node.rpartition('.')[0]}.{point}"
        held = self.quantisers.held.get(key)
        if held is not None:
            self.quantisers.held[key] = (value, held[1])


NONE = Quantisers()


def place(entries: list[ActivationEntry], modules: dict, rnd=identity, strict: bool = False,
          source: str = "encodings", taps: dict | None = None) -> Quantisers:
    """Place a file's activation encodings at the model's declared modules (module -> input taps; taps: module -> its
    output's tap where that is not the module's name)."""
    inputs, outputs, unplaced = {}, {}, []
    for e in entries:
        module, io, index = model_name(e.name), e.io, e.index
        if io is None:  # 1.0.0: a tensor name, a module's output
            m = _ONNX_OUTPUT.match(e.name)
            if module not in modules and m:
                module, index = model_name(m["path"].replace("/", ".")), int(m["index"])
            io = "output"
        if (module not in modules or (io == "output" and index != 0)
                or (io == "input" and index >= len(modules[module]))):
            unplaced.append(e.label)
            continue
        if io == "input":
            inputs[module, index] = e.encoding
        else:
            outputs[module] = e.encoding
    if unplaced:
        message = (f"{source}: {len(unplaced)} activation encoding(s) name no module input / output refimpl has, "
                   f"e.g. {unplaced[:3]}")
        if strict:
            raise InputError(message + " (--strict-encodings)")
        warnings.warn(message + "; they stay float", EncodingsWarning, stacklevel=2)
    return Quantisers(inputs, outputs, unplaced, rnd, taps)
