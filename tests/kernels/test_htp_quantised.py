"""The HTP's quantised arithmetic as refimpl models it (refimpl/kernels/htp_quantised.py) and the device arithmetic
that computes a QDQ graph's ops with it (Policy.device_arithmetic, models/quantisers.DEVICE_OPS): the invariants of
the models here; their agreement with the HTP simulator is tests/e2e/test_quantised_htp.py's (one-op graphs, and
the dense W8A16 model's Adds, Sqrts and ReduceMeans on the HTP's own inputs)."""

from pathlib import Path

import numpy as np
import pytest

from refimpl.encodings import Encoding
from refimpl.errors import InputError
from refimpl.kernels import htp_quantised as H
from refimpl.models.quantisers import DEVICE_OPS, Quantisers, device_ops
from refimpl.precision import DEVICE_ARITHMETICS, Policy

QUANTISED_FIXTURES = Path(__file__).parent.parent / "fixtures" / "quantised"


def anchor(name: str) -> dict:
    """The arrays of a committed anchor of HTP-measured codes, tests/fixtures/quantised/<name> (its provenance in the
    comment above the tests that read it)."""
    with np.load(QUANTISED_FIXTURES / name) as f:
        return {k: f[k] for k in f.files}


def test_add_rounds_ties_up_and_shares_one_int16_shift():
    # two inputs of the output's scale, each half a step: the exact sum 1/2 code rounds up (ONNX: to even, 0)
    assert H.add([1, -1], (0.5, 0), [0, 0], (0.5, 0), (1.0, 10)).tolist() == [11, 10]
    assert H.multiplier_shift((0.99, 0.5), 15) == 15 and H.multiplier_shift((0.99999, 0.5), 15) == 14
    assert H.multiplier_shift((2.0, 0.3), 15) == 13


def test_sqrt_table_is_a_staircase_and_exact_at_powers_of_four():
    t = H.RSQRT_THRESHOLDS
    assert len(t) == 512 and (np.diff(t) > 0).all() and t[0] > 2 ** 14 and t[-1] < 2 ** 16
    m = np.arange(2 ** 14, 2 ** 16)
    k = H.rsqrt_mantissa(m)
    assert k[0] == 1024 and k[-1] == 512 and np.abs(k - np.rint(m ** -0.5 * 2 ** 17)).max() <= 1
    # x = n s_x = 1 and 4 (n = 2^14, 2^16 / ... ): sqrt exactly 1, 2 on an output grid of 2^-15
    sx, so = 2.0 ** -14, 2.0 ** -15
    assert H.sqrt([2 ** 14, 2 ** 12, 0], (sx, 0), (so, 0)).tolist() == [2 ** 15, 2 ** 14, 0]


def test_reduce_mean_adds_a_whole_step_below_a_ratio_of_one_half():
    # r = s_x / (N s_o) = 1 / 4 (a shift over 15): mean of codes 1, 2 -> floor(0.75 + 1) = 1; 2, 2 -> floor(1 + 1) = 2
    assert H.reduce_mean([[1, 2], [2, 2]], (1.0, 0), (2.0, 0)).ravel().tolist() == [1, 2]
    # r = 1 / 2 (measured on the simulator: 100 % of 4096 rows): the codes summed, rounded half up: 1.5 -> 2, 2 -> 2
    assert H.reduce_mean([[1, 2], [2, 2]], (1.0, 0), (1.0, 0)).ravel().tolist() == [2, 2]
    # ReduceSum from r = 1 / 2: the codes' sum rounded half up, the zero points' term truncated apart:
    # (4 - 3 + 5 - 3) / 2 = 1.5 -> floor(9 / 2 + 1/2) - floor(2 * 3 / 2) = 5 - 3
    assert H.reduce_sum([[4, 5]], (0.5, 3), (1.0, 0)).ravel().tolist() == [2]
    assert H.reduce_sum([[5, 6]], (0.5, 3), (1.0, 0)).ravel().tolist() == [3]      # 2.5 -> 3 (ONNX: 2)


def test_div_reciprocal_is_within_5e_4_and_the_quotient_is_sign_symmetric():
    j = np.arange(2 ** 14, 2 ** 15)
    r = H.recip_mantissa(j)                                            # r 2^-29 ~ 1 / (2 j): 14 bits
    assert r[0] == 2 ** 14 and r.min() >= 2 ** 13 and r.max() <= 2 ** 14
    assert 2e-4 < np.abs(r * 2.0 * j / 2 ** 29 - 1).max() < 5.6e-4   # four quadratic pieces: not correctly rounded
    # a power-of-two divisor and K = 1 (s_a = s_b s_o): the quotient exact; symmetric about the zero point
    q = H.div([100 + 6, 100 - 6, 100 + 7, 100], (1.0, 100), [2 ** 12 + 5] * 4, (2.0 ** -12, 5), (1.0, 50))
    assert q.tolist() == [56, 44, 57, 50]
    # the numerator's 15 significant bits: n K_m rounded, K_m = 2^14 here (n = 2^15 + 3 halves, then rounds)
    assert H.div([2 ** 15 + 3], (1.0, 0), [2 ** 15], (1.0, 0), (2.0 ** -15, 0)).tolist() == [2 ** 15 + 4]


def enc(scale, zp):
    return Encoding(16, np.float32(scale), np.int32(-zp), arithmetic="onnx")


def test_the_htp_device_arithmetic_computes_an_add_on_its_inputs_codes():
    """A node's "+eps" point (Add("/mean", "const:eps")) under arithmetic "htp": its quantiser's values are the
    HTP's Add of the codes the mean's and eps's quantisers held (ties rounded up), not the float sum quantised (ties
    to even); without it, the float sum."""
    e_mean, e_eps, e_out = enc(1e-4, 0), enc(1e-7, 0), enc(2e-4, 0)
    points = {"n": {"mean": e_mean, "eps": e_eps, "+eps": e_out}}
    ops = {"n/+eps": ("Add", ("n/mean", "n/eps"))}
    for arithmetic, want in ((None, [0, 2, 2]), ("htp", [1, 2, 3])):
        q = Quantisers(points=points, arithmetic=arithmetic, ops=ops if arithmetic else None)
        hook = q.at("n")
        mean = hook("mean", e_mean.dequantize(np.array([1, 3, 5])))      # half steps of the output
        y = hook("+eps", mean + hook("eps", 0.0))
        assert e_out.codes(y).tolist() == want, (arithmetic, e_out.codes(y))


def test_device_ops_are_declared_by_the_graph_and_the_policy_checks_its_arithmetic():
    from refimpl.models.config import config_from_dict
    from refimpl.models.model import graph
    from refimpl.presets import PRESETS
    assert set(DEVICE_OPS) == set(DEVICE_ARITHMETICS)
    ops = device_ops(graph(config_from_dict(PRESETS["tiny-qwen3"])), "htp")
    assert ops["model.layers.0.input_layernorm/sqrt"] == ("Sqrt", ("model.layers.0.input_layernorm/+eps",))
    assert ops["model.layers.0.attn_residual"][0] == "Add"
    assert ops["model.layers.0.self_attn.q_proj"] == ("MatMul", ("model.layers.0.input_layernorm",
                                                                 "weight:model.layers.0.self_attn.q_proj.weight"))
    assert ops["model.layers.0.self_attn.attn_scores/q*k^T"] == ("MatMul", ("model.layers.0.self_attn.q_rope",
                                                                            "model.layers.0.self_attn.attn_scores/keys"))
    assert ops["model.layers.0.self_attn.attn_output"][0] == "MatMul"          # probs @ values: two activations
    with pytest.raises(InputError, match="device_arithmetic"):
        Policy(device_arithmetic="htp")                        # no device graph
    with pytest.raises(InputError, match="device_arithmetic"):
        Policy(weights="encodings", encodings="m.onnx", device_arithmetic="npu")


def test_mul_is_its_q34_multiplier_and_the_zero_points_constant_error():
    # M = 2^-15 exactly, zero points 0: the product rounded half up (a tie, 2^14 / 2^15, rounds up)
    assert H.mul([2 ** 14, 3, 65535], (2.0 ** -16, 0), [1, 2 ** 14, 65535], (2.0 ** -16, 0),
                 (2.0 ** -17, 0)).tolist() == [1, 2, 65535]
    # M 2^15 = 2/3: m = 349525, whose low 15 bits (-10923) put every threshold 1/24 code above the exact product's
    # (as on the simulator: an exact 1.5 -> 1, 1.538 -> 1, 1.550 -> 2)
    sa, so = 2.0 ** -16, float(np.float32(2.0 ** -17 * 1.5))
    assert H.mul([24576, 25200, 25400], (sa, 0), [3, 3, 3], (sa, 0), (so, 0)).tolist() == [1, 1, 2]


def test_neg_rounds_in_eighths_half_up_so_seven_sixteenths_round_up():
    z = 2 ** 15
    q = np.arange(0, 65536, 97)
    assert (H.neg(q, (1.0, z), (1.0, z)) == np.clip(2 * z - q, 0, 65535)).all()       # r = 1: exact negation
    # r = 1/2: -1/2 and +1/2 code both round up (towards +inf), as the HTP's other requantisations
    assert H.neg([z + 1, z - 1], (0.5, z), (1.0, 100)).tolist() == [100, 101]
    # r = 7/16: 7/16 of a code is 3.5 eighths, rounded up to 4, then half: 1 (exact rounding: 0); 5/16 -> 0
    assert H.neg([z - 1], (7 / 16, z), (1.0, 100)).tolist() == [101]
    assert H.neg([z - 1], (5 / 16, z), (1.0, 100)).tolist() == [100]
    # the zero point's term is rounded to eighths on its own: z' r = 1/16 becomes one eighth, still under half a code
    assert H.neg([z], (1 / 16, z + 1), (1.0, 100)).tolist() == [100]
    assert H.neg([0, 65535], (1.0, z), (2.0 ** -4, z)).tolist() == [65535, 0]     # saturated


def test_rotate_half_rescales_x_straight_into_the_concats_encoding_and_the_device_fuses_it():
    """The HTP's Concat(Neg(x2), x1) (htp_quantised.rotate_half) reads x2's codes, not the Neg's: each half x's
    codes times a Q18 multiplier of the float32 ratio into eighths, as Neg's; declared for RoPE's rotate_half point."""
    from refimpl.models.config import config_from_dict
    from refimpl.models.model import graph
    from refimpl.presets import PRESETS
    z = 2 ** 15
    q = np.arange(0, 65536, 97)
    y = H.rotate_half(q, (1.0, z), q, (1.0, z), (1.0, z))                       # r = 1: [-x2 | x1] exactly
    assert (y[: q.size] == np.clip(2 * z - q, 0, 65535)).all() and (y[q.size:] == q).all()
    # the -x2 half is the Neg's arithmetic (its encoding skipped), whatever the other half
    sx, so = float(np.float32(1.0118e-04)), float(np.float32(1.0319723e-04))
    assert (H.rotate_half(q, (sx, 29676), q[::-1], (sx, 29676), (so, 35157))[: q.size] ==
            H.neg(q, (sx, 29676), (so, 35157))).all()
    # r = 7/16: +7/16 of a code is 3.5 eighths, rounded up to 4, then half: 1 (exact rounding: 0); 5/16 -> 0
    def x1_half(q1, x1, out):                                                    # rotate_half's x1 half alone
        return H.rotate_half(np.full(len(q1), z), x1, q1, x1, out)[len(q1):].tolist()
    assert x1_half([z + 1, z + 1], (7 / 16, z), (1.0, 100)) == [101, 101]
    assert x1_half([z + 1], (5 / 16, z), (1.0, 100)) == [100]
    # the multiplier rounds the float32 ratio's r 2^18 to even: 4.5 -> 4 (half up: 5); q' = 22938 steps are 2.8
    # eighths (5: 3.5, rounded up to 4, then half a code: 1)
    assert x1_half([z + 22938], (4.5 * 2.0 ** -18, z), (1.0, 100)) == [100]
    assert x1_half([0, 65535], (4.0, z), (1.0, z)) == [0, 65535]                # saturated
    ops = device_ops(graph(config_from_dict(PRESETS["tiny-qwen3"])), "htp")
    assert ops["model.layers.0.self_attn.k_rope/rotate_half"] == (
        "RotateHalf", ("model.layers.0.self_attn.k_rope/x2", "model.layers.0.self_attn.k_rope/x1"))
    assert ops["model.layers.0.self_attn.k_rope/-x2"][0] == "Neg"                # its own quantiser still the Neg's


def test_silu_product_is_the_mul_with_a_sixteenth_more_and_the_device_fuses_x_times_its_own_sigmoid():
    from refimpl.models.config import config_from_dict
    from refimpl.models.model import graph
    from refimpl.presets import PRESETS
    # the sigmoid's code 1 at (2^-16, 0) (as the fused product reads it, whatever its encoding), x's zero point 2^15
    # (T = -2^15: T m = -2^39, c = 0), M = 2^6 2^-16 = 2^-10: products 448 and 320 are exactly 7/16 and 5/16 of a
    # code; the Mul rounds 7/16 down (+ 1/2), the fused product up (+ 1/2 + 1/16); 5/16 both down
    a, b, out = (2.0 ** 6, 2 ** 15), (2.0 ** -16, 0), (1.0, 2 ** 15)
    q = np.array([2 ** 15 + 448, 2 ** 15 + 320])
    assert H.mul(q, a, [1, 1], b, out).tolist() == [2 ** 15, 2 ** 15]
    assert H.silu_product(q, a, [1, 1], b, out).tolist() == [2 ** 15 + 1, 2 ** 15]
    # the zero points' term in float32: T = 2^25 + 1 is rounded to 2^25 (24 bits), so c = 2^25 m mod 2^31
    assert int(np.float32(2 ** 25 + 1)) == 2 ** 25
    ops = device_ops(graph(config_from_dict(PRESETS["tiny-qwen3"])), "htp")
    assert ops["model.layers.0.mlp.act_fn"] == ("SiLU", ("model.layers.0.mlp.gate_proj",
                                                         "model.layers.0.mlp.act_fn/sigmoid"))
    assert ops["model.layers.0.self_attn.q_rope/-x2"][0] == "Neg"
    assert ops["model.layers.0.mlp.act_fn/sigmoid"] == ("Sigmoid", ("model.layers.0.mlp.gate_proj",))
    ops = device_ops(graph(config_from_dict(PRESETS["tiny-qwen3.5"])), "htp")      # o * sigmoid(gate): a Mul
    assert ops["model.layers.3.self_attn.gated_output"][0] == "Mul"
    assert ops["model.layers.0.linear_attn.conv1d_silu"][0] == "SiLU"


def test_ropes_muls_read_the_half_tables_duplicated_as_the_device_graph_does():
    """RoPE's x * cos and rotate_half * sin under the HTP arithmetic: the cos / sin points hold the half tables
    [B, T, rot/2] (the graph's inputs), which the kernel duplicates and broadcasts before its Muls (at.operand); the
    device Mul runs on those codes (it fell back to the CPU EP's arithmetic: 96.8 % of q_rope's codes on the dense
    W8A16 HTP dump, now 100 %)."""
    from refimpl.kernels.rope import apply_rope
    rng = np.random.default_rng(0)
    e_x, e_t, e_m = enc(1e-4, 32000), enc(2 ** -15, 32768), enc(9e-5, 31000)
    points = {"r": {"cos": e_t, "sin": e_t, "x*cos": e_m}}
    q = Quantisers(outputs={"x": e_x}, points=points, arithmetic="htp",
                   ops={"r/x*cos": ("Mul", ("x", "r/cos"))})
    x = q.output("x", e_x.dequantize(rng.integers(20000, 44000, (1, 3, 2, 8))))   # [B, T, H, rot]
    cos, sin = np.cos(rng.random((1, 3, 4))).astype(np.float32), np.sin(rng.random((1, 3, 4))).astype(np.float32)
    q.record = {}
    apply_rope(x, cos, sin, at=q.at("r"))
    c = np.concatenate([e_t.codes(cos)] * 2, axis=-1)[:, :, None, :]              # the duplicated table's codes
    want = H.mul(e_x.codes(x), (1e-4, 32000), c, (2 ** -15, 32768), (9e-5, 31000))
    assert (e_m.codes(q.record["r/x*cos"]) == want).all()


def test_the_device_matmul_reads_an_input_held_with_its_heads_split():
    """Qwen3.5's out_proj reads the gated norm, held as [B, T, H, D], as the device graph's [B, T, H D] (it raised
    "mismatch in its core dimension" before): the device MatMul on the merged codes; an input whose last axes do not
    make the weight's K stays the CPU EP's arithmetic (None)."""
    rng = np.random.default_rng(0)
    e_in, e_out = enc(1e-3, 30000), enc(4e-3, 31000)
    e_w = Encoding(8, np.float32(0.01), np.int32(-128), arithmetic="onnx")
    w = e_w.dequantize(rng.integers(0, 256, (3, 4)))                            # [out, in]
    q = Quantisers(outputs={"norm": e_in, "proj": e_out}, arithmetic="htp", weight=lambda name: (w, e_w),
                   ops={"proj": ("MatMul", ("norm", "weight:w"))})
    x = q.output("norm", e_in.dequantize(rng.integers(25000, 35000, (1, 2, 2, 2))))   # [B, T, H, D]
    y = q.output("proj", (x.reshape(1, 2, 4) @ w.T).astype(np.float32))
    want = H.matmul(e_in.codes(x).reshape(1, 2, 4), (1e-3, 30000), e_w.codes(w).T, (0.01, 128), (4e-3, 31000))
    assert (e_out.codes(y) == want).all()
    q.held["norm"] = (x.reshape(1, 2, 1, 4)[..., :3], e_in)                    # 1 x 3: not K = 4
    assert (q.output("proj", y) == e_out.dequantize(e_out.codes(y))).all()      # y quantised, as the CPU EP


def test_the_scores_mask_add_reads_the_scores_held_with_their_heads_grouped():
    """The attention's mask Add under the HTP arithmetic: the scaled scores are held [B, Hkv, Hq/Hkv, T, L] (GQA),
    the node's output is [B, Hq, T, L]; the device Add runs on the held codes and its codes are put back merged (it
    fell back to the CPU EP's arithmetic: 96.2 % of layer 0's attn_scores codes on the dense W8A16 HTP dump, now
    100 %). A layout that only transposes the axes is not the op's (regrouped)."""
    from refimpl.kernels.attention import attention_scores
    from refimpl.models.quantisers import regrouped
    rng = np.random.default_rng(0)
    e_s, e_m, e_o = enc(2e-4, 30000), enc(1e-3, 65535), enc(4e-4, 60000)   # ties: half a code
    q = Quantisers(outputs={"s": e_o}, points={"s": {"scaled": e_s, "mask": e_m}}, arithmetic="htp",
                   ops={"s": ("Add", ("s/scaled", "s/mask"))})
    qr, k = rng.standard_normal((1, 4, 3, 8)).astype(np.float32), rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    mask = np.where(np.arange(5)[None, None, None] <= np.arange(3)[None, None, :, None] + 2, 0, -60).astype(np.float32)
    q.record = {}
    y = q.output("s", attention_scores(qr, k, mask, scale=0.1, at=q.at("s")))
    held = e_s.codes(q.record["s/scaled"]).reshape(1, 4, 3, 5)                 # [B, Hkv, rep, T, L] -> [B, Hq, T, L]
    want = H.add(held, (2e-4, 30000), e_m.codes(mask), (1e-3, 65535), (4e-4, 60000))
    assert y.shape == (1, 4, 3, 5) and (e_o.codes(y) == want).all()
    assert regrouped((1, 2, 2, 3, 5), (1, 4, 3, 5)) and regrouped((2, 3, 20), (2, 3, 4, 5))
    assert not regrouped((1, 3, 4, 5), (1, 4, 3, 5)) and not regrouped((6, 4), (4, 6))


def test_sigmoid_table_is_monotone_symmetric_and_within_two_steps_of_the_sigmoid():
    t = H.SIGMOID_TABLE
    assert t[0] == 2 ** 14 and t[-1] == 2 ** 15 - 1 and len(t) == 62486 and set(np.diff(t)) <= {0, 1, 2}
    k = np.arange(len(t))
    assert np.abs(t - 2 ** 14 * (1 + np.tanh(k / (2 * H.SIGMOID_GRID)))).max() < 1.3
    # s_x = 1/6144: the codes are the table's points; x < 0 mirrored (y(x) + y(-x) = 2^15 - 1, x = 0: 2^14)
    q = np.arange(0, 65536, 7)
    y = H.sigmoid(q, (1 / 6144, 2 ** 15)) // 2
    n = q - 2 ** 15
    assert (y[n >= 0] == t[n[n >= 0]]).all() and (y[n < 0] == 2 ** 15 - 1 - t[-n[n < 0]]).all()
    assert H.sigmoid([2 ** 15], (1e-3, 2 ** 15)).tolist() == [2 ** 15]
    assert (H.sigmoid(q, (1e-3, 2 ** 15)) % 2 == 0).all()
    # s_x 6144 = 61.44 grid steps per code: the int16 multiplier round(61.44 2^9) = 31457 at shift 9, k = 245
    assert H.sigmoid([2 ** 15 + 4], (0.01, 2 ** 15)).tolist() == [2 * t[int(4 * 0.01 * 6144)]]


def test_mean_multiplier_is_the_ratio_1e_5_short_rounded_half_up():
    """ReduceMean's int16 multiplier as read off the HTP simulator (QNN 2.51 HTP v75 through onnxruntime-qnn 2.7;
    one-op ReduceMeans of 1024-4096 rows of random codes, zero points 0): at the dense aimet-onnx models' layer 0
    post-attention means (W4A16: s_x, s_o, N = 64, r 2^17 = 17622.68; W8A16: N = 32, 32275.81) the device's m is
    17623 and 32275 (floor(r 2^k + 1/4): 17622, 32276); and the ratios at which m steps up, bisected to one float32
    step of s_x (s_o fixed, N = 32): 28004 below, 28005 above; 21576 / 21577."""
    for sx, so, n, m in (("0x1.34eef2p-13", "0x1.1f38p-16", 64, 17623),
                         ("0x1.8f2ff8p-13", "0x1.95465ap-16", 32, 32275)):
        assert H.mean_multiplier(float.fromhex(sx) / (n * float.fromhex(so))) == (m, 17)
    for so, lo, hi, m in (("0x1.a6baaep-15", "0x1.6947ccp-12", "0x1.6947cep-12", 28004),
                          ("0x1.0d979cp-15", "0x1.63094ap-13", "0x1.63094cp-13", 21576)):
        assert H.mean_multiplier(float.fromhex(lo) / (32 * float.fromhex(so)))[0] == m
        assert H.mean_multiplier(float.fromhex(hi) / (32 * float.fromhex(so)))[0] == m + 1
    assert H.mean_multiplier(0.25) == (16384, 16)     # r 2^17 (1 - 1e-5) = 32767.67 rounds to 2^15: one shift less


def test_matmul_rescales_only_the_columns_whose_weight_steps_leave_int8():
    k = np.array([[-160, 5, 155, 0], [95, -128, 0, 0], [3, 127, 0, -7]])        # steps [K = 3, N = 4]
    kp, r = H.matmul_column_steps(k)
    assert r[1] == r[3] == 1 and (kp[:, 1] == k[:, 1]).all() and (kp[:, 3] == k[:, 3]).all()   # in int8: as stored
    assert r[0] == 1.25 and kp[:, 0].tolist() == [-128, 76, 2]       # max(95 / 127, 160 / 128) = 1.25: exact here
    assert r[2] == 2500 / 2048 and kp[0, 2] == 127                    # 155 / 127 on Q11; the step re-rounded
    # a column holding one out-of-int8 step (and zeros) is within a code of the exact product (as on the device)
    qa = np.arange(0, 65536, 997)[:, None] * np.array([[0, 1, 0]])
    sa, sw, so = 1e-4, 1e-3, 2e-3
    exact = ((qa - 100) @ np.array([0, -160, 0])) * sa * sw / so + 30000
    y = H.matmul(qa, (sa, 100), np.array([[200], [40], [200]]), (sw, 200), (so, 30000))[:, 0]
    assert np.abs(y - exact).max() <= 1


def test_matmul_multiplier_is_a_22_bit_mantissa_of_the_float32_ratio_rounded_half_up():
    # 2^8 s_a s_w / s_o = 1.5 2^-2 exactly: M = 1.5 2^21, s = 23; the bias M 2^-30 is 1.5 / 512 code
    m, s = H.matmul_multiplier((2.0 ** -10, 0), (1.5 * 2.0 ** -10, 0), (2.0 ** -10, 0), np.ones(1))
    assert (m[0], s[0]) == (3 << 20, 23)
    # a ratio whose float32 mantissa ends in binary 10 (a tie at 22 bits) rounds up; 01 down; 11 up
    for low, up in ((2, 1), (1, 0), (3, 1)):
        sa = np.float32((2 ** 23 + 4 * 12345 + low) * 2.0 ** -23 * 2.0 ** -10)     # mantissa 1 + (4 j + low) 2^-23
        m, s = H.matmul_multiplier((sa, 0), (2.0 ** -8, 0), (2.0 ** -10, 0), np.ones(1))
        assert m[0] == (2 ** 23 + 4 * 12345 + low) // 4 + up and s[0] == 21, (low, m, s)
    # the float32 ratio, not the float64 one: s_a s_w rounded to float32 before the division
    sa, sw, so = np.float32(1.01379926e-4), np.float32(1.1e-3), np.float32(4.71e-4)
    want = np.float32(np.float32(sa * sw) / so)
    m, s = H.matmul_multiplier((sa, 0), (sw, 0), (so, 0), np.ones(1))
    assert abs(m[0] * 2.0 ** -s[0] - float(want) * 256) <= 2.0 ** -s[0] * 0.5 + 1e-18
    # the bias: a product of 0 steps lands M 2^-30 + 1/2 above the zero point, under one code: q_o = z_o
    assert H.matmul(np.zeros((1, 4), np.int64), (1e-4, 0), np.full((4, 2), 128), (1e-3, 128), (1e-4, 7)).tolist() \
        == [[7, 7]]


def test_matmul_per_channel_weights_take_the_largest_scale_and_each_columns_float32_share():
    """W4A16's int4 weights per output channel: anchored codes of the HTP simulator (QNN 2.51 HTP v75 through
    onnxruntime-qnn 2.7; one-op QDQ MatMuls of K = 1 over every activation code, steps 7, at the encodings of the
    dense W4A16 case's layer 0 v_proj: its input (s_a, 33155), output (s_o, 29232), four of its 64 column scales).
    Columns 33, 50 and 60 beside the tensor's largest scale (column 58) gave 22579, 21602, 20275; the same three
    beside column 0's scale as the largest (a 6-column graph) 22579, 21603, 20276: each column's multiplier is
    2^8 float32(float32(s_a max s_w / s_o) float32(s_w,j / max s_w)), not its own scale's ratio (22578, 21603,
    20276 in both graphs)."""
    sa, so = float.fromhex("0x1.c42fe6p-14"), float.fromhex("0x1.d034e6p-14")
    s33, s50, s60, s58, s0 = (float.fromhex(h) for h in ("0x1.5ed64ap-5", "0x1.167b56p-5", "0x1.561fa8p-5",
                                                          "0x1.0ad95cp-4", "0x1.aa7f9cp-5"))
    qa = np.array([[10387], [256], [1719]])                         # the first codes the own-scale ratio misses
    for scales, want in (([s33, s50, s60, s58], [22579, 21602, 20275]), ([s33, s50, s60, s0], [22579, 21603, 20276])):
        y = H.matmul(qa, (sa, 33155), np.full((1, 4), 7), (np.array(scales, np.float32), 0), (so, 29232))
        assert np.diagonal(y).tolist() == want, (scales, y)
        own = [H.matmul(qa[i:i + 1], (sa, 33155), [[7]], (scales[i], 0), (so, 29232))[0, 0] for i in range(3)]
        assert own == [22578, 21603, 20276]                          # each column's own ratio: not the device's
    top, share = H.matmul_channel_shares(np.array([s33, s58], np.float32))
    assert top == np.float32(s58) and share.dtype == np.float32 and share[1] == 1


def test_matmul16_requantises_its_second_operand_to_uint8_as_measured():
    # steps measured on the simulator (one-op MatMuls of K = 1, every code of the second operand): where they
    # differ from n 255 / 65535 rounded, and the zero point's extremes
    for zb, pairs in ((32768, [(-30713, -119), (-129, 0), (30454, 119), (-32768, -127)]),
                      (29232, [(-29171, -113), (-1672, -6), (30454, 119), (-29232, -114)])):
        n = np.array([p[0] for p in pairs])
        q8, (s8, z8) = H.matmul16_operand(n + zb, (1e-4, zb))
        assert (q8 - z8).tolist() == [p[1] for p in pairs] and 0 <= q8.min() and q8.max() <= 255
        assert s8 == np.float32(np.float32(np.float32(1e-4) * np.float32(65535)) / np.float32(255))   # float32
    n = np.arange(-30000, 30000)
    q8, (_, z8) = H.matmul16_operand(n + 32768, (1e-4, 32768))
    assert np.abs(q8 - z8 - n * 255 / 65535).max() < 0.51           # within half a step and its 2^-7 offset
    # batch axes: one W8A16 product per head
    qa, qb = np.full((2, 3, 4), 40000), np.full((1, 4, 5), 50000)
    y = H.matmul16(qa, (1e-4, 32768), qb, (1e-4, 32768), (1e-3, 0))
    assert y.shape == (2, 3, 5) and (y == y[0, 0, 0]).all()
    assert abs(y[0, 0, 0] - 4 * 7232 * 17232 * 1e-5) <= 0.02 * y[0, 0, 0]


def test_matmul16_second_operand_at_zero_point_2_15_saturates_its_uint8_steps_at_127():
    """aimet-onnx's symmetric uint16 encodings (zero point 2^15): the HTP simulator's codes (QNN 2.51 HTP v75 through
    onnxruntime-qnn 2.7, one-op MatMuls of K = 1; s_a 1.5e-5, z_a 0, s_b 1.2e-4, s_o 1e-3, z_o 0): the second
    operand's top code 65535, step 128 on the uint8 grid, gives 3850, 2350, 1175 at z_b = 32768 (the step
    saturated to 127: the dense aimet W8A16 model's probs @ v, 16 codes up to 253 off when rescaled) and 3880, 2368,
    1184 at z_b = 32767 (the column rescaled, as modelled)."""
    qa, args = np.array([65535, 40000, 20000]).reshape(1, 1, 3, 1), (np.float32(1.5e-5), 0)
    for zb, want in ((32768, [3850, 2350, 1175]), (32767, [3880, 2368, 1184])):
        y = H.matmul16(qa, args, np.full((1, 1, 1, 1), 65535), (np.float32(1.2e-4), zb), (np.float32(1e-3), 0))
        assert y[0, 0, :, 0].tolist() == want, zb
    q8, (_, z8) = H.matmul16_operand(np.array([0, 65535]), (1e-4, 32768))
    assert (q8 - z8).tolist() == [-127, 127]


def test_silu_product_reads_the_sigmoids_codes_as_sigmoid_times_2_16_whatever_its_encoding():
    """The dense aimet-onnx W8A16 model's first SiLU product on the HTP simulator (its honest run's dump: codes of x,
    of its Sigmoid (aimet's calibrated encoding, s 1.50e-5, not 2^-16) and of the product): the fused product reads
    the sigmoid's codes as sigmoid(x) 2^16 (every code of its 512; with the graph's encoding 0.4 %, up to 993 off)."""
    x, sig = np.array([29999, 25740, 59942, 8172]), np.array([27478, 19882, 63040, 3362])
    a, b = (float.fromhex("0x1.f1ece8p-14"), 32743), (float.fromhex("0x1.f5c732p-17"), 0)
    out = (float.fromhex("0x1.05fdc4p-14"), 4458)
    assert H.silu_product(x, a, sig, b, out).tolist() == [2272, 420, 54182, 2063]
    assert (H.silu_product(x, a, sig, b, out) == H.silu_product(x, a, sig, (2.0 ** -16, 0), out)).all()


def test_attention_operands_are_the_device_graphs_per_head_products():
    """The attention's products on codes held in refimpl's layouts (q_rope [B, T, Hq, D], keys [B, Hkv, L, D],
    probs [B, Hq, T, L], values [B, Hkv, L, D]) as the device computes them, head by head, put back in the points'
    layouts (q*k^T [B, Hkv, rep, T, L], attn_output [B, T, Hq D]); another layout: None."""
    from refimpl.models.quantisers import attention_operands
    rng = np.random.default_rng(0)
    B, T, Hq, Hkv, D, L = 1, 3, 4, 2, 5, 6
    q, k = rng.integers(0, 9, (B, T, Hq, D)), rng.integers(0, 9, (B, Hkv, L, D))
    (a, b), put = attention_operands([q, k], (B, Hkv, Hq // Hkv, T, L))
    want = np.einsum("bthd,bhld->bhtl", q, np.repeat(k, Hq // Hkv, axis=1)).reshape(B, Hkv, Hq // Hkv, T, L)
    assert (put(a @ b) == want).all()
    p, v = rng.integers(0, 9, (B, Hq, T, L)), rng.integers(0, 9, (B, Hkv, L, D))
    (a, b), put = attention_operands([p, v], (B, T, Hq * D))
    want = np.einsum("bhtl,bhld->bthd", p, np.repeat(v, Hq // Hkv, axis=1)).reshape(B, T, Hq * D)
    assert (put(a @ b) == want).all()
    assert attention_operands([p, v], (B, T, Hq * D + 1)) is None and attention_operands([q[0], k], (1,) * 5) is None


def test_matmul_takes_each_columns_own_weight_scale():
    # W4A16: symmetric int4 weights per output channel: each column its own scale, the same arithmetic
    rng = np.random.default_rng(1)
    qa, qw = rng.integers(0, 65536, (5, 16)), rng.integers(-8, 8, (16, 3))
    sw = np.array([1e-3, 3e-3, 7e-4], np.float32)
    y = H.matmul(qa, (1e-4, 30000), qw, (sw, np.zeros(3, np.int64)), (2e-3, 32768))
    for j in range(3):
        assert (y[:, j] == H.matmul(qa, (1e-4, 30000), qw[:, j:j + 1], (sw[j], 0), (2e-3, 32768))[:, 0]).all()


def test_softmax_of_equal_maxima_is_the_htps():
    """Rows of k equal maxima (the rest far below: exps 0): p = 1/k. The HTP's codes, measured on the QNN 2.51 HTP
    v75 simulator (s_x = 16/65535, output (1/65535, 0), rows of 16): 65534, 32767, 21845, ..., 4368, 4095; the model
    gives them all (k <= 8 from its reciprocal tables, k > 8 from its floored quotient: the same codes here, and for
    every k up to 512 measured)."""
    htp = [65534, 32767, 21845, 16383, 13107, 10922, 9362, 8191, 7281, 6553, 5957, 5461, 5041, 4681, 4368, 4095]
    q = np.where(np.arange(16)[None, :] < np.arange(1, 17)[:, None], 65535, 0)
    p = H.softmax(q, (16 / 65535, 32768), (1 / 65535, 0))
    assert (p[:, 0] == htp).all() and (p[q == 0] == 0).all()
    assert (p.T == H.softmax(q.T, (16 / 65535, 32768), (1 / 65535, 0), axis=0)).all()


# --- Qwen3.5 on the HTP: codes the simulator produced (tests/fixtures/quantised/tiny-qwen3.5-htp-w8a16-codes.npz:
# the tiny Qwen3.5's QNN W8A16 QDQ model on the QNN 2.51 HTP v75 simulator, onnxruntime-qnn 2.7, its prompt call of
# tests/e2e/quantised.py, layer 0; docs/htp.md §9)

HTP_CODES = "tiny-qwen3.5-htp-w8a16-codes.npz"


def htp_codes():
    return anchor(HTP_CODES)


def test_the_htps_depthwise_conv_is_its_matmul_per_channel_on_the_htps_codes():
    """Layer 0's causal conv1d (Conv(group = 128) over [state | x], K - 1 zeros each side: the device graph's 15
    columns) from the HTP's input codes: every code (uint8 weights at zero point 113, 2 channels' steps outside int8);
    the exact requantisation (the CPU EP's arithmetic) is not."""
    c = htp_codes()
    zx, K = int(c["conv_x_enc"][1]), c["conv_w"].shape[-1]
    x = np.pad(c["conv_x"].astype(np.int64), ((0, 0), (0, 0), (K - 1, K - 1)), constant_values=zx)   # [1, C, 18]
    w = c["conv_w"][:, 0, :].T                                                                      # [K, C]
    y = H.conv1d_depthwise(x, tuple(c["conv_x_enc"]), w, tuple(c["conv_w_enc"]), tuple(c["conv_y_enc"]))
    assert np.array_equal(y, c["conv_y"])
    (sx, _), (sw, zw), (so, zo) = c["conv_x_enc"], c["conv_w_enc"], c["conv_y_enc"]
    win = np.stack([x[..., t:t + K] for t in range(y.shape[-1])], -2) - zx                      # [1, C, 15, K]
    exact = np.rint((win * (w.T.astype(np.int64) - int(zw))[None, :, None, :]).sum(-1) * sx * sw / so) + zo
    assert (exact == c["conv_y"]).mean() < 0.4


def test_the_htp_requantises_an_expand_into_another_encoding_through_float16():
    """The repeat of q to the value heads (an Expand whose output encoding is not its input's: a chain link,
    Placement.moved_by): under the HTP's arithmetic each value is rounded to float16, then quantised: every code of
    the HTP's; the exact requantisation (a plain chain) is not."""
    c = htp_codes()
    ea, eb = enc(*c["expand_x_enc"]), enc(*c["expand_y_enc"])
    x = np.broadcast_to(ea.dequantize(c["expand_x"]), c["expand_y"].shape).astype(np.float32)
    for moved_by, arithmetic in (({"n/p": (None, "Expand")}, "htp"), ({}, "htp"), ({"n/p": (None, "Expand")}, None)):
        q = Quantisers(points={"n": {"p": (ea, eb)}}, arithmetic=arithmetic, moved_by=moved_by)
        share = (eb.codes(q.quantise("n/p", (ea, eb), x)) == c["expand_y"]).mean()
        assert (share == 1.0) == (arithmetic == "htp" and bool(moved_by)), (moved_by, arithmetic, share)


def test_the_htps_k_delta_outer_product_is_the_elementwise_product_of_its_inputs():
    """Layer 0's k_t delta_t^T (Mul of [1, 4, 16, 1] and [1, 4, 1, 16], token 0) on the HTP, its own input codes:
    not the outer product (the HTP's Mul of it: 1 code in 1024) but the elementwise product k_t * delta_t, [4, 16],
    every code, in the output's first 64 elements, the other 960 code 0: the device departs from its graph (the Mul's
    broadcast), not from its arithmetic (tests/e2e/test_quantised_htp.py reproduces it on a five-node graph)."""
    c = htp_codes()
    k, d, (ek, ed, eo) = c["outer_k"], c["outer_d"], (tuple(c[f"outer_{n}_enc"]) for n in "kdy")
    got = c["outer_y"].reshape(-1)
    assert (H.mul(k, ek, d, ed, eo).reshape(-1) == got).mean() < 0.01
    assert np.array_equal(got[:k.size], H.mul(k.reshape(-1), ek, d.reshape(-1), ed, eo))
    assert not got[k.size:].any()


def test_a_per_token_device_op_reads_its_instances_inputs():
    """A per-token point's op (graph.Point "x@t", "x@t-1") is declared once (device_ops: "p@t", token 0's inputs
    apart) and read per instance (Quantisers.op)."""
    from refimpl.models.config import config_from_dict
    from refimpl.models.model import graph
    from refimpl.presets import PRESETS
    ops = device_ops(graph(config_from_dict(PRESETS["tiny-qwen3.5"])), "htp")
    core = "model.layers.0.linear_attn.core"
    assert ops[f"{core}/decayed@t"] == ("Mul", (f"{core}/S@t-1", f"{core}/exp(g)@t"))
    assert ops[f"{core}/decayed@0"] == ("Mul", (f"{core}/state", f"{core}/exp(g)@t"))
    q = Quantisers(ops=ops, arithmetic="htp")
    assert q.op(f"{core}/decayed@3") == ("Mul", (f"{core}/S@2", f"{core}/exp(g)@3"))
    assert q.op(f"{core}/decayed@0") == ("Mul", (f"{core}/state", f"{core}/exp(g)@0"))
    assert q.op(f"{core}/k delta^T@5") == ("Mul", ("model.layers.0.linear_attn.k@5", f"{core}/delta@5"))
    assert q.op(f"{core}/S*q") is None and q.op(f"{core}/decayed@x") is None


def test_a_per_token_point_in_its_matmul_form_is_the_htps_matmul16_and_the_cores_stack_its_token_sums():
    """The graph's form of k delta^T (placement.forms: its instances "p@t" found as MatMul, the QDQ model rewritten by
    tests/e2e/quantised.outer_products_as_matmul) makes the device op MatMul16 on the same operands; without it the
    declared Mul. The core's Concat of the o_t sums is the HTP's TokenSums of S * q (every token's instance)."""
    from refimpl.models.config import config_from_dict
    from refimpl.models.model import graph
    from refimpl.presets import PRESETS
    nodes, core = graph(config_from_dict(PRESETS["tiny-qwen3.5"])), "model.layers.0.linear_attn.core"
    plain, as_matmul = device_ops(nodes, "htp"), device_ops(nodes, "htp", {f"{core}/k delta^T@3": "MatMul"})
    operands = ("model.layers.0.linear_attn.k@t", f"{core}/delta@t")
    assert plain[f"{core}/k delta^T@t"] == ("Mul", operands)
    assert as_matmul[f"{core}/k delta^T@t"] == ("MatMul16", operands)
    assert plain[core] == ("TokenSums", (f"{core}/S*q@*",))


# --- the HTP's Softplus: codes the simulator produced (tests/fixtures/quantised/tiny-qwen3.5-htp-softplus-codes.npz:
# the QNN 2.51 HTP v75 simulator, onnxruntime-qnn 2.7: layers_*: the 3 Softpluses of the tiny Qwen3.5's QNN W8A16
# prompt call, their input and output codes as dumped ([3, 1, 8, 4]; encodings (s_x, z_x, s_o, z_o) per layer);
# sweep1 / sweep7: one-op QDQ Softplus graphs over every input code 0..65535 at two encodings not used to fit the
# model (Qwen3.5's layer-2 encoding, and a random wide one), stored as the first code and the steps; docs/htp.md §9)

HTP_SOFTPLUS = "tiny-qwen3.5-htp-softplus-codes.npz"


def test_the_htps_softplus_on_qwen35s_gates_and_on_held_out_sweeps():
    """The model's three Softpluses on the HTP's own input codes: every code (the correctly rounded softplus: none,
    up to 348 codes off). Over every input code at two held-out encodings: 99.59 % / 99.905 % identical as measured,
    max 1 (the fitted coefficients: the device's rounding inside its polynomial is not modelled)."""
    c = anchor(HTP_SOFTPLUS)
    for x, y, (sx, zx, so, zo) in zip(c["layers_x"], c["layers_y"], c["layers_enc"]):
        q = H.softplus(x.astype(np.int64), (sx, int(zx)), (so, int(zo)))
        assert np.array_equal(q, y)
        exact = np.rint(np.logaddexp(0, (x.astype(np.int64) - zx) * np.float64(np.float32(sx))) / np.float32(so))
        assert (exact == y).mean() < 0.1
    codes = np.arange(65536)
    for k, share in ((1, 0.99589), (7, 0.99904)):   # as measured
        first, steps = c[f"sweep{k}_first"], c[f"sweep{k}_steps"]
        y = np.concatenate([[first], first + np.cumsum(steps, dtype=np.int64)])
        sx, zx, so, zo = c[f"sweep{k}_enc"]
        q = H.softplus(codes, (sx, int(zx)), (so, int(zo)))
        assert (q == y).mean() >= share and np.abs(q - y).max() == 1, k


# --- ReduceSum's multiplier (tests/fixtures/quantised/tiny-qwen3.5-htp-reducesum-codes.npz, the same simulator:
# read_*: 60 one-op ReduceSum graphs at random float32 scales (r = s_x / s_o 0.5-2, zero points 0, rows of 2 codes
# summing 0 to 2^17), each its multiplier m, the one integer whose floor((m S + 2^(k-1)) / 2^k) gives all 4096 of its
# codes; l2norm_* / stk_*: two of the tiny Qwen3.5's QNN W8A16 ReduceSums on the HTP's own input codes (layer 0's
# l2norm sum of k^2, [1, 8, 4, 16] over the last axis; S^T k over D_k, [1, 4, 16, 16] over axis -2); docs/htp.md §9)

HTP_REDUCE_SUM = "tiny-qwen3.5-htp-reducesum-codes.npz"


def test_the_htps_reduce_sum_multiplier_is_the_ratio_less_1e_5_rounded():
    """Every one of the 60 multipliers read off the simulator is round(r (1 - 1e-5) 2^k) (floor(r 2^k + 1/4): 56,
    round(r 2^k): 40), and the two Qwen3.5 ReduceSums whose codes that rule alone gives are every code (with
    floor(r 2^k + 1/4): 62.5 % and 95.3 %)."""
    c = anchor(HTP_REDUCE_SUM)
    r = c["read_sx"].astype(np.float64) / c["read_so"].astype(np.float64)
    assert [H.mean_multiplier(v)[0] for v in r] == c["read_m"].tolist()
    k = [H.mean_multiplier(v)[1] for v in r]
    assert sum(int(np.floor(v * 2.0 ** s + 0.25)) != m for v, s, m in zip(r, k, c["read_m"])) == 4
    for key, keep in (("l2norm", True), ("stk", False)):
        sx, zx, so, zo = c[f"{key}_enc"]
        y = H.reduce_sum(c[f"{key}_x"].astype(np.int64), (sx, int(zx)), (so, int(zo)), int(c[f"{key}_axis"]), keep)
        assert np.array_equal(y, c[f"{key}_y"]), key


# ------------------------------------------------------------------------------------------------ MoE router, int4
# An anchor measured on the HTP (QNN 2.51 HTP v75 simulator, onnxruntime-qnn 2.7.0): the tiny-qwen3-moe preset's QNN
# QDQ W4A16 model (tests/e2e/quantised.py, session 37's honest run), layer 0's router Gemm x W^T with its signed int4
# weight per tensor (s_w 0.0494932, zero point 0): the first 2 tokens' input codes (view_5, [2, 64]), the weight's
# codes [8, 64] (nibbles, row by row) and the HTP's output codes (linear_4, [2, 8]).
ROUTER_X = ((9.822368e-05, 33358), [
    [19289, 40871, 24432, 18580, 37844, 53956, 48063, 32811, 29023, 38845, 44795, 31767, 29523, 24727, 42271, 18772,
     17914, 42030, 14363, 51005, 21485, 16644, 32379, 40499, 26965, 30259, 35715, 59534, 35638, 52983, 44926, 30235,
     51199, 36988, 27685, 50816, 29137, 25497, 38742, 25053, 31096, 26051, 49007, 46557, 42747, 30401, 19366, 26726,
     22526, 40274, 31455, 26958, 25046, 42446, 26559, 34320, 29651, 37388, 25736, 35758, 33064, 30282, 47037, 36181],
    [29214, 18238, 39950, 37277, 33449, 43864, 49833, 38838, 49216, 28440, 35034, 27623, 40023, 41627, 33027, 30618,
     18183, 37394, 34002, 34526, 45526, 32314, 31974, 41958, 45849, 27799, 20394, 40988, 25361, 33020, 46010, 39800,
     22045, 25960, 47323, 28687, 20661, 33847, 55293, 23239, 19995, 30642, 55456, 34856, 45794, 28791, 29575, 52441,
     26442, 32469, 27339, 21765, 45602, 40981, 42703, 40539, 9188, 48555, 21175, 43111, 41128, 47591, 32505, 33138]])
ROUTER_W = (0.04949319735169411, (
    "2111004d5f2f1022021e2df12e010ef204dfe0328e036e103340efe12f0f2de0d501fd000132024031c092e2c0f36300e0c310fe0f4ff6"
    "121d1ee00ef200ffe1d33401e004ffdf224cb228fde21bcdcec5004de02233e2e52df0333ee4f42c10cbe53d9d5fcc001010ff24edd101"
    "0023ef33e3fefd501fe0f1141fcf04f030e4111bee250c13f00e011f04d3aec31e0d0102edf1e0214e4df2e16f5bfce007fcf4eded1f30"
    "01ff01dc32212e1e40d40fef1303e2ec0fe2f3d2ff2f1f0359d2232f30300f13e0002ff4ef2122e5001001031e12e1dffeff1dd321e2ef"
    "2e30ed1c125f2e0be03ded5ffbf2402110122e3124a0fcef2ffdf092003432ef2ed03fbf"))
ROUTER_Y = ((8.730124e-05, 33394), [[37357, 53737, 26166, 23814, 36844, 33750, 32225, 42546],
                                    [46195, 20536, 30543, 48733, 46124, 30728, 16872, 20621]])


def test_a_moe_routers_int4_weight_per_tensor_is_the_htps_matmul():
    """QNN's W4A16 gives the MoE router (a Gemm, transB) a signed int4 weight per tensor; the HTP computes it as its
    8-bit MatMul (htp_quantised.matmul: int4 steps are int8 steps): every code of the anchor above (and of the 4
    routers on the HTP's own inputs; ONNX's exact requantisation 1.6-3.1 % there), and `--device-arithmetic htp`
    takes such a weight (DEVICE_WEIGHTS)."""
    from refimpl.models.quantisers import DEVICE_WEIGHTS
    (sx, zx), qx = ROUTER_X
    sw, nibbles = ROUTER_W
    w = np.array([int(c, 16) for c in nibbles]).reshape(8, 64)
    w = np.where(w > 7, w - 16, w)                                                 # int4 codes [out, in]
    (so, zo), want = ROUTER_Y
    got = H.matmul(np.array(qx), (np.float32(sx), zx), w.T, (np.float32(sw), 0), (np.float32(so), zo))
    assert got.tolist() == want
    exact = np.rint((np.array(qx) - zx) @ w.T * (np.float64(np.float32(sx)) * np.float32(sw) / np.float32(so)) + zo)
    assert (exact != want).any()                                                   # the CPU EP's rounding is not it
    assert (4, True) in DEVICE_WEIGHTS["MatMul"] and (4, True) in DEVICE_WEIGHTS["Gemm"]


# ------------------------------------------------------------------------------------------------ MoE experts
# An anchor measured on the HTP (the same run as ROUTER_X: the QNN QDQ W8A16 model's dump): layer 0's first expert
# product (bmm: the gathered gate_up weights [16, 64, 64] x the tokens repeated [16, 64, 1], uint16 x uint16), token
# 0's first slot: the gathered weight's codes of output rows 0-3 (val_146), its x (unsqueeze_12) and the HTP's output
# codes of those rows (bmm; ONNX's exact requantisation [40720, 20061, 40862, 29114], x as the first operand
# [40832, 19781, 40750, 29234]).
EXPERT_W = ((1.6250595e-05, 33565), [
    [23569, 43066, 28776, 18130, 40148, 29525, 35637, 23795, 23566, 35984, 34763, 29126, 27949, 32243, 34853, 37628,
     37270, 26824, 24680, 17080, 26181, 37686, 29956, 24625, 29888, 44257, 31587, 32260, 36726, 35806, 35303, 35793,
     19104, 46719, 49063, 35157, 21111, 21504, 34415, 41401, 27862, 38560, 37389, 43434, 39339, 25087, 38255, 30980,
     26946, 30151, 41358, 30819, 36139, 50089, 35585, 34611, 24923, 22236, 31466, 31853, 37981, 28159, 37153, 31408],
    [45362, 37531, 26287, 13849, 23883, 28423, 42139, 23801, 46385, 23527, 45494, 28692, 33862, 28055, 34619, 38968,
     29607, 24023, 40290, 42386, 24104, 44777, 26638, 28415, 28136, 32314, 37229, 33893, 32033, 27521, 17638, 31378,
     30858, 32877, 40690, 32879, 40891, 38773, 28490, 42982, 30718, 47746, 19576, 38248, 31884, 41267, 40264, 30730,
     37482, 33394, 37864, 33163, 30089, 44944, 40294, 33624, 39081, 30024, 35335, 33672, 27420, 13274, 26681, 33143],
    [18135, 45580, 31135, 37234, 26877, 31458, 38637, 21563, 30365, 30518, 34153, 30249, 39190, 29438, 43068, 33146,
     29720, 35622, 17541, 35170, 49275, 37061, 13127, 18621, 39617, 19418, 39125, 34621, 36918, 32395, 26664, 27889,
     25694, 22770, 34527, 33812, 25593, 45618, 36456, 39372, 19342, 30077, 36880, 36668, 36711, 28076, 34102, 22508,
     17950, 32970, 31467, 31453, 29965, 41720, 38091, 6099, 47487, 38607, 43097, 45188, 28161, 25074, 22296, 28621],
    [26314, 33713, 19955, 23392, 32720, 27078, 35541, 25504, 36569, 32511, 25844, 33715, 21688, 19391, 38953, 28452,
     31862, 49395, 34456, 38109, 35170, 40993, 28823, 34844, 43110, 25887, 35258, 30064, 35570, 30787, 13411, 31202,
     26491, 34748, 34358, 32350, 42169, 36700, 38770, 26686, 25347, 31391, 24818, 31299, 25779, 43522, 24711, 41808,
     38692, 21167, 27041, 44285, 18495, 34482, 18973, 36167, 24752, 30775, 33562, 22413, 26826, 44807, 25280, 51506]])
EXPERT_X = ((9.822368e-05, 33358), [
    19241, 40410, 25320, 18658, 36295, 54922, 49712, 32121, 29072, 36636, 44349, 32352, 27934, 25294, 42086, 18495,
    17000, 42349, 15060, 51459, 21322, 17471, 32685, 41829, 27471, 30165, 36475, 59038, 35504, 53177, 46164, 29738,
    50830, 36421, 28716, 51868, 28045, 26570, 39828, 26778, 31948, 26306, 50008, 46625, 42366, 30848, 20596, 26174,
    23379, 39290, 31727, 26380, 24619, 43597, 27100, 33671, 30944, 37750, 24549, 35009, 32564, 30523, 45648, 36333])
EXPERT_Y = ((9.534865e-05, 32553), [40763, 20037, 40867, 28999])


def test_a_moe_experts_product_is_the_htps_uint16_matmul_with_the_weights_first():
    """The device graph's expert product W_e x (weights gathered by expert id: uint16 activations in QNN's QDQ
    models) is the uint16 x uint16 MatMul with the weights as the first operand, x requantised to uint8
    (htp_quantised.matmul16): every code of the anchor above (measured: all 16 token-slot rows of layer 0, 1024
    codes; x first 0.6 %, ONNX's exact requantisation 0 %). `--device-arithmetic htp` computes it per expert on the
    held x's rows of its tokens (Hook.select, ExpertMatMul): the same codes; the weighted term's Mul reads each
    token's routing weight in its slot, and the terms [N, k, H] summed over the k slots are the ReduceSum over axis
    1."""
    from types import SimpleNamespace

    (sw, zw), w = EXPERT_W
    (sx, zx), x = EXPERT_X
    (so, zo), want = EXPERT_Y
    w, x = np.array(w), np.array(x)
    got = H.matmul16(w, (np.float32(sw), zw), x[:, None], (np.float32(sx), zx), (np.float32(so), zo))[:, 0]
    assert got.tolist() == want
    swapped = H.matmul16(x[None], (np.float32(sx), zx), w.T, (np.float32(sw), zw), (np.float32(so), zo))[0]
    assert swapped.tolist() != want                                                 # x first: not the device's
    # the wiring: expert 1 (gate: rows 0-1, up: rows 2-3), token 1 of 2 in its slot 0 of k = 2
    e_w, e_x, e_y = enc(sw, zw), enc(sx, zx), enc(so, zo)
    values = {f"m.experts.1.{p}_proj.weight": e_w.dequantize(w[rows]) for p, rows in (("gate", [0, 1]), ("up", [2, 3]))}
    ops = {"m.experts/gate_up": ("ExpertMatMul", ("weight:m.experts.gate_up_proj", "m.x")),
           "m.experts/weighted": ("Mul", ("m.experts/gate_up", "m.routing_weights")),
           "m.experts": ("ReduceSum", ("m.experts/weighted",))}
    e_r, e_t, e_s = enc(1 / 65535, 0), enc(1e-4, 30000), enc(2e-4, 30000)
    q = Quantisers(outputs={"m.x": e_x, "m.routing_weights": e_r, "m.experts": e_s},
                   points={"m.experts": {"gate_up": e_y, "weighted": e_t}}, arithmetic="htp", ops=ops,
                   placement=SimpleNamespace(weights={"m.experts.gate_up_proj": (e_w,)}),
                   weight=lambda n: (values[n], None))
    q.output("m.x", e_x.dequantize(np.stack([x[::-1], x])))                        # tokens [2, 64]: the second is x
    q.output("m.routing_weights", e_r.dequantize(np.array([[40000, 25535], [50000, 15535]])))
    at = q.at("m.experts")
    at.select(expert=1, tokens=np.array([1]), slots=np.array([0]))
    y = at("gate_up", np.zeros((1, 4), np.float32))                                # the float value is not read
    assert e_y.codes(y).tolist() == [want]
    t = at("weighted", y * 0.76)
    assert (e_t.codes(t) == H.mul(np.array([want]), (np.float32(so), zo), np.array([[50000]]),
                                  (np.float32(1 / 65535), 0), (np.float32(1e-4), 30000))).all()
    at.select()
    terms = np.stack([np.zeros((2, 4)), np.concatenate([e_t.dequantize(np.full((1, 4), 30001)), t])], axis=1)
    at.operand("weighted", terms.astype(np.float32))                               # [N = 2, k = 2, H = 4]
    out = q.output("m.experts", terms.sum(axis=1).astype(np.float32))
    qt = e_t.codes(terms.astype(np.float32))
    assert (e_s.codes(out) == H.reduce_sum(qt, (np.float32(1e-4), 30000), (np.float32(2e-4), 30000), axis=1,
                                            keepdims=False)).all()


# An anchor measured on the HTP (aimet-onnx's QDQ W8A16 export of the same MoE, its HTP run's dump): layer 0's first
# expert row's gate codes (split_split_0), its Sigmoid's codes (val_149, encoding (1.4549152e-05, 0): aimet's
# calibrated range, not QNN's (2^-16, 0)) and the fused SiLU product's codes (silu).
AIMET_SILU = (((9.55184586928226e-05, 32485), [
    40354, 19925, 40966, 29147, 37153, 26780, 24930, 36180, 32876, 43718, 25841, 42243, 34797, 31208, 36060, 24090,
    26112, 45898, 34727, 30296, 28891, 27895, 35194, 23498, 28507, 20423, 31050, 12680, 19029, 22847, 22031, 36244]),
    ((1.4549152183462866e-05, 0), [
        44530, 15174, 45358, 27588, 39952, 24056, 21432, 38490, 33380, 48834, 22706, 47020, 36368, 30770, 38306, 20292,
        23090, 51290, 36262, 29354, 27196, 25698, 36982, 19506, 26616, 15736, 30524, 8588, 14198, 18666, 17646, 38584]),
    ((4.8190548113780096e-05, 5778), [
        16376, 14, 17412, 2993, 11418, 1627, 881, 10079, 6173, 22369, 1215, 19655, 8321, 4590, 9920, 626, 1327, 26585,
        8237, 3835, 2822, 2211, 8808, 476, 2576, 37, 4453, 634, 0, 337, 199, 10165]))


def test_the_fused_silu_product_reads_the_sigmoids_codes_as_2_16_sigmoid_whatever_its_encoding():
    """At aimet-onnx's Sigmoid encoding the HTP's sigmoid codes are still sigmoid(x) 2^16 (htp_quantised.sigmoid:
    every code of the anchor) and the fused x * sigmoid(x) reads them so (SILU_SIGMOID): every code of the anchor
    (measured: every code of the MoE's 4 SiLUs on the HTP's own inputs, W8A16 and W4A16; read at the graph's
    encoding, 0 %, 2432-2695 codes off). The device arithmetic's "SiLU" op does the same."""
    ((sg, zg), g), ((ss, zs), s), ((so, zo), want) = AIMET_SILU
    g, s = np.array(g), np.array(s)
    assert H.sigmoid(g, (np.float32(sg), zg)).tolist() == s.tolist()
    e_g, e_o = (np.float32(sg), zg), (np.float32(so), zo)
    assert H.silu_product(g, e_g, s, (np.float32(ss), zs), e_o).tolist() == want     # the graph's encoding unread
    assert (H.mul(g, e_g, s, (np.float32(ss), zs), e_o) != want).mean() > 0.9   # the codes read at the graph's
    assert DEVICE_OPS["htp"]["SiLU"]([g, s], [e_g, (np.float32(ss), zs)], e_o).tolist() == want


# --- aimet-onnx's Qwen3.5 on the HTP: codes the simulator produced (tests/fixtures/quantised/
# tiny-qwen3.5-aimet-htp-w8a16-codes.npz: the tiny Qwen3.5's aimet-onnx W8A16 QDQ export (its calibrated Sigmoid
# encodings, its pad mask left float) on the QNN 2.51 HTP v75 simulator, onnxruntime-qnn 2.7, the prompt call of
# tests/e2e/quantised.py: layer 0's x * mask, beta and its 8 per-token Gathers, delta_0, layer 3's gated attention
# output x * sigmoid(gate); docs/htp.md §9)

AIMET_HTP_CODES = "tiny-qwen3.5-aimet-htp-w8a16-codes.npz"


def aimet_htp_codes():
    return {k: (np.float32(v[0]), int(v[1])) if k.endswith("_enc") else v for k, v in anchor(AIMET_HTP_CODES).items()}


def test_an_op_reading_an_input_the_graph_leaves_float_is_computed_in_float16():
    """aimet-onnx leaves Qwen3.5's pad mask float (x * mask before the projections): the HTP computes that Mul in
    float16, x's value rounded to float16, then quantised: every code of the HTP's (the exact requantisation of x * 1,
    the CPU EP's, 36 %, up to 9 codes). Through the device arithmetic: the point's mask input has no quantiser."""
    c = aimet_htp_codes()
    ex, ey = enc(*c["mask_x_enc"]), enc(*c["mask_y_enc"])
    x = ex.dequantize(c["mask_x"]).astype(np.float32)
    for arithmetic, points in (("htp", {"masked": ey}), ("htp", {"masked": ey, "pad_mask": enc(1 / 65535, 0)}),
                               (None, {"masked": ey})):
        q = Quantisers(points={"n.qkv": points}, arithmetic=arithmetic,
                       ops={"n.qkv/masked": ("Mul", ("x", "n.qkv/pad_mask"))} if arithmetic else None)
        got = ey.codes(q.quantise("n.qkv/masked", ey, x * np.float32(1)))
        share = (got == c["mask_y"]).mean()
        assert (share == 1.0) == (arithmetic == "htp" and "pad_mask" not in points), (arithmetic, points, share)
        assert share > 0.3


def test_every_consumer_reads_the_htps_sigmoid_codes_as_sigmoid_times_2_16():
    """At aimet-onnx's calibrated Sigmoid encodings (1.44e-5, 1.48e-5) the HTP's Sigmoid codes mean sigmoid(x) 2^16:
    a plain Mul (the gated attention's x * sigmoid(gate)) reads them at (2^-16, 0): every code (at the graph's
    encoding 0.6 %); a Gather of one token (beta_t) requantises them into its encoding (sigmoid_moved: every code of
    the 8 tokens; exact rounding not all), and delta_0 = beta_0 (v_0 - S^T k_0) is the Mul of those: every code."""
    c = aimet_htp_codes()
    args = c["gate_x"], c["gate_x_enc"], c["gate_s"]
    assert np.array_equal(H.mul(*args, H.SILU_SIGMOID, c["gate_y_enc"]), c["gate_y"])
    assert (H.mul(*args, c["gate_s_enc"], c["gate_y_enc"]) == c["gate_y"]).mean() < 0.01
    beta = c["beta"][0].astype(np.int64)                                                     # [T, Hv]
    assert np.array_equal(H.sigmoid_moved(beta, c["beta_t_enc"]), c["beta_t"])
    exact = np.rint(beta * 2.0 ** -16 / np.float64(c["beta_t_enc"][0]))
    assert 0.5 < (exact == c["beta_t"]).mean() < 1
    delta = H.mul(c["delta_v"], c["delta_v_enc"], c["beta_t"][0][None, :, None], c["beta_t_enc"], c["delta_y_enc"])
    assert np.array_equal(delta, c["delta_y"])
    held = H.mul(c["delta_v"], c["delta_v_enc"], beta[0][None, :, None], c["beta_enc"], c["delta_y_enc"])
    assert (held == c["delta_y"]).mean() < 0.1                 # beta_0's codes read at the graph's encoding


# --- Qwen3.5 with k delta^T written as a MatMul (tests/e2e/quantised.outer_products_as_matmul) on the HTP: codes the
# simulator produced (tests/fixtures/quantised/tiny-qwen3.5-htp-w8a16-matmul-codes.npz: the /tmp/s37 QNN W8A16 QDQ
# model of the tiny Qwen3.5 rewritten so, on the QNN 2.51 HTP v75 simulator, onnxruntime-qnn 2.7, the prompt call of
# tests/e2e/quantised.py, its device_dumps; layer 0: token 3's k delta^T, every token's S * q and the core's stack)

HTP_MATMUL_CODES = "tiny-qwen3.5-htp-w8a16-matmul-codes.npz"


def test_the_htp_computes_k_delta_t_written_as_a_matmul_as_its_matmul16():
    """k_t [.., Dk, 1] x delta_t [.., 1, Dv] as a MatMul (K = 1) of two uint16 activations: every code the HTP's
    MatMul16 (delta requantised to uint8), the device op --device-arithmetic htp computes at the point when the
    graph's form there is a MatMul (quantisers.device_ops); the same product through the HTP's Mul is not."""
    c = anchor(HTP_MATMUL_CODES)
    k, ek, d, ed, y, ey = (c[n] for n in ("kd_k", "kd_k_enc", "kd_d", "kd_d_enc", "kd_y", "kd_y_enc"))
    enc = [(float(e[0]), int(e[1])) for e in (ek, ed, ey)]
    assert np.array_equal(DEVICE_OPS["htp"]["MatMul16"]([k, d], enc[:2], enc[2]), y)
    assert (H.mul(k.astype(np.int64), enc[0], d.astype(np.int64), enc[1], enc[2]) == y).mean() < 0.9


def test_the_htp_sums_each_tokens_o_into_the_cores_concat_encoding():
    """The core's stack of o_t = S^T q_t (ReduceSum -> Unsqueeze -> Concat): every code is each token's ReduceSum of
    the HTP's own S * q codes straight into the Concat's encoding (device op TokenSums,
    quantisers.DEVICE_CONCAT_ENCODES_INPUTS); o_t's own codes requantised into it are not (o_t's quantiser clips:
    up to 423 codes off)."""
    c = anchor(HTP_MATMUL_CODES)
    sq, esq, o, eo, stack, es = (c[n] for n in ("sq", "sq_enc", "o", "o_enc", "stack", "stack_enc"))
    out = (float(es[0]), int(es[1]))
    got = DEVICE_OPS["htp"]["TokenSums"](list(sq), [(float(s), int(z)) for s, z in esq], out)   # [B, T, Hv, Dv]
    assert np.array_equal(got.transpose(0, 2, 1, 3), stack)                                        # [B, Hv, T, Dv]
    x = np.concatenate([(oi.astype(np.float64) - z) * s for oi, (s, z) in zip(o, eo)], 2)         # [B, Hv, T, Dv]
    requantised = np.clip(np.rint(x / out[0]) + out[1], 0, 65535)
    assert np.abs(requantised - stack).max() > 100


def test_gated_attentions_sigmoid_reads_the_gate_half_of_q_projs_codes():
    """Gated attention's q_proj holds [q_h | gate_h] per head; the gate's Sigmoid reads its gate half (the device's
    Split moves the codes: every code on the Qwen3.5 HTP dump). Told the half (Hook.operand, as qwen3.attention
    does), the Sigmoid is the HTP's on those codes; held as the whole projection it has no operand in its layout
    (then the CPU EP's arithmetic)."""
    p = "model.layers.3.self_attn"
    e_x, e_s = enc(1.08e-4, 34596), enc(1 / 65536, 0)
    rng = np.random.default_rng(3)
    proj = ((rng.integers(20000, 50000, (1, 2, 2, 8)) - 34596) * np.float32(1.08e-4)).astype(np.float32)
    gate = proj[..., 4:].reshape(1, 2, 8)                                              # [B, T, Hq D]
    want = H.sigmoid(e_x.codes(gate), (e_x.scale, 34596), (e_s.scale, 0))
    got = {}
    for told in (False, True):
        q = Quantisers(outputs={f"{p}.q_proj": e_x}, points={f"{p}.gated_output": {"sigmoid": e_s}},
                       ops={f"{p}.gated_output/sigmoid": ("Sigmoid", (f"{p}.q_proj",))}, arithmetic="htp")
        q.output(f"{p}.q_proj", proj.reshape(1, 2, 16))
        if told:
            q.at(f"{p}.gated_output").operand("q_proj", gate)
        got[told] = e_s.codes(q.at(f"{p}.gated_output")("sigmoid", 1 / (1 + np.exp(-gate))))
    assert np.array_equal(got[True], want)
    assert not np.array_equal(got[False], want)


# --- the genie KV cache the host feeds float (tests/fixtures/quantised/tiny-qwen3-htp-w8a16-cache-codes.npz: the same
# simulator, the dense W8A16 QNN QDQ model calibrated with filled caches (3 prompts, each as a 4-token chunk, a
# 4-token chunk reading it and 2 decode calls of the AR = 8 graph): per layer and key / value, "x" the host's float
# copy of the 7-token prompt call's past_*_out (real slots, [Hkv, 7, D]), "input" the first decode call's codes at
# that cache input's quantiser, "concat" its Concat's codes of those cached slots; "enc" (s_in, z_in, s_cat, z_cat))

HTP_CACHE = "tiny-qwen3-htp-w8a16-cache-codes.npz"


def test_the_htp_holds_the_float_cache_as_float16_and_its_concat_quantises_that_copy():
    """The cache input's quantiser: the float16 copy times float32(1 / s) rounded, 3577 of 3584 codes (the 7 others
    ties float32 rounds the other way, 1 code), every one in layer 0; the exact quantisation of the host's float32
    under 40 %. The Concat with the new entries quantises the float16 copy into its own encoding (99.5 % at least per
    tensor), not the input quantiser's codes requantised (under 99.4 % in layers 1-3, where the encodings differ).
    Quantisers under the HTP's arithmetic: a past_keys point records those codes and passes the float16 copy on,
    clipped to the quantiser's range only where 1 / s leaves float16 (the empty-cache encoding)."""
    c = anchor(HTP_CACHE)
    same, total = 0, 0
    for k in (f"{kind}{i}" for i in range(4) for kind in ("key", "value")):
        x, (s, z, sc, zc) = c[f"{k}_x"], c[f"{k}_enc"]
        q = H.quantize_float16(x, (s, int(z)))
        same, total = same + int((q == c[f"{k}_input"]).sum()), total + q.size
        assert np.abs(q - c[f"{k}_input"]).max() <= 1 and (k[-1] != "0" or np.array_equal(q, c[f"{k}_input"])), k
        assert (np.clip(np.rint(x.astype(np.float64) / s) + z, 0, 65535) == c[f"{k}_input"]).mean() < 0.4, k
        via = H.quantize_float16(((q - int(z)) * np.float32(s)).astype(np.float32), (sc, int(zc)))   # requantised
        assert (H.quantize_float16(x, (sc, int(zc))) == c[f"{k}_concat"]).mean() >= 0.995, k
        assert k[-1] == "0" or (via == c[f"{k}_concat"]).mean() < 0.994, k
    assert same == 3577 and total == 3584
    e = enc(float(c["key1_enc"][0]), int(c["key1_enc"][1]))
    for arithmetic in ("htp", None):
        qs = Quantisers(points={"n": {"past_keys": e}}, arithmetic=arithmetic)
        qs.record = {}
        y = qs.quantise("n/past_keys", e, c["key1_x"])
        codes = e.codes(qs.record["n/past_keys"] if arithmetic else y)
        assert np.array_equal(y, c["key1_x"].astype(np.float16).astype(np.float32)) == (arithmetic == "htp")
        assert ((codes == c["key1_input"]).mean() > 0.99) == (arithmetic == "htp"), arithmetic
    empty = enc(1.5259022e-09, 0)   # a cache encoding calibrated on empty caches: [0, 1e-4], 1 / s beyond float16
    y = Quantisers(points={"n": {"past_keys": empty}}, arithmetic="htp").quantise("n/past_keys", empty, c["key1_x"])
    assert y.min() == 0 and np.isclose(y.max(), 65535 * np.float32(1.5259022e-09)) and (c["key1_x"] < 0).any()


# --- the MoE's routing under aimet-onnx's encodings (tests/fixtures/quantised/tiny-qwen3-moe-aimet-htp-softmax-div-
# codes.npz: the QNN 2.51 HTP v75 simulator, onnxruntime-qnn 2.7.0. router_{w8a16,w4a16}_*: the tiny-qwen3-moe
# preset's aimet-onnx W8A16 / W4A16 QDQ exports (tests/e2e/quantised.py, session 37's honest runs), the 4 router
# Softmaxes' input and output codes as dumped ([4, 8, 8]; (s_x, z_x, s_o, z_o) per layer: aimet's calibrated output
# scales 8.3e-6 to 1.17e-5); div_*: W4A16 layer 0's routing-weights Div, top-k values / their sum, as dumped
# (s_a / (s_b s_o) = 65534.998: float32 65535.0); sweep_*: 512 rows of a one-op Softmax sweep at a held-out random
# encoding (rows of 5, half of them masked); recip_*: one row of 64 exps per reciprocal SOFTMAX_RECIP_HIGHER corrects,
# read at s_o = 0.75 2^-18; divsweep{0,1}_*: one-op Div graphs (numerators 0..65535 step 61 x 3 divisors) at scales
# whose K's 15-bit mantissa sits on a half point, where float32 (s_a / s_b) (1 / s_o) and s_a (1 / s_b) (1 / s_o)
# round apart; docs/htp.md §9)

HTP_AIMET_ROUTING = "tiny-qwen3-moe-aimet-htp-softmax-div-codes.npz"


@pytest.fixture(scope="module")
def aimet_routing_codes():
    return anchor(HTP_AIMET_ROUTING)


def test_the_htps_softmax_at_another_output_encoding_scales_the_sum_by_its_mantissa(aimet_routing_codes):
    """aimet-onnx's 8 router Softmaxes on the HTP's own input codes, a held-out one-op sweep and the 23 corrected
    reciprocals: every code (the model before, E R K floored once: 67-89 % of the routers' codes; the codes at
    (2^-16, 0) times K floored: under 60 %)."""
    c = aimet_routing_codes
    for mix in ("w8a16", "w4a16"):
        for x, y, (sx, zx, so, zo) in zip(c[f"router_{mix}_x"], c[f"router_{mix}_y"], c[f"router_{mix}_enc"]):
            q = H.softmax(x.astype(np.int64), (sx, int(zx)), (so, int(zo)))
            assert np.array_equal(q, y), (mix, so)
            k = 2.0 ** -16 / np.float64(np.float32(so))
            assert (np.floor(H.softmax(x.astype(np.int64), (sx, int(zx)), (2.0 ** -16, 0)) * k) == y).mean() < 0.6
    for key in ("sweep", "recip"):
        sx, zx, so, zo = c[f"{key}_enc"]
        assert np.array_equal(H.softmax(c[f"{key}_x"].astype(np.int64), (sx, int(zx)), (so, int(zo))), c[f"{key}_y"])
    assert len(H.SOFTMAX_RECIP_HIGHER) == len(c["recip_x"]) == 23


def test_the_htps_div_takes_k_as_float32_s_a_times_the_reciprocals_of_s_b_and_s_o(aimet_routing_codes):
    """W4A16 layer 0's routing Div on its own input codes, every code (the float64 ratio's K_m 32767: 2 of 16, up to 5
    codes: the device's float32 65535.0 rounds to 2^15, the next octave's 14 bits); the two one-op sweeps at
    half-point mantissas every code (where (s_a / s_b) (1 / s_o) rounds the other way)."""
    c = aimet_routing_codes
    sa, za, sb, zb, so, zo = c["div_enc"]
    y = H.div(c["div_a"].astype(np.int64), (sa, int(za)), c["div_b"].astype(np.int64), (sb, int(zb)), (so, int(zo)))
    assert np.array_equal(y, c["div_y"])
    for i in (0, 1):
        sa, za, sb, zb, so, zo = c[f"divsweep{i}_enc"]
        qa, qb = c[f"divsweep{i}_a"].astype(np.int64)[None, :], c[f"divsweep{i}_b"].astype(np.int64)[:, None]
        assert np.array_equal(H.div(qa, (sa, int(za)), qb, (sb, int(zb)), (so, int(zo))), c[f"divsweep{i}_y"]), i
        f32 = np.float32
        ks = [f32(sa) * (f32(1) / f32(sb)) * (f32(1) / f32(so)), (f32(sa) / f32(sb)) * (f32(1) / f32(so))]
        m = [np.floor(np.float64(k) / 2.0 ** (np.floor(np.log2(k)) - 14) + 0.5) for k in ks]
        assert m[0] != m[1], i                                       # the sweep tells the two orders apart


# --- the MoE's routing as TopK of the logits -> Softmax over the k (tests/e2e/quantised.routing_as_topk_softmax):
# codes the simulator produced (tests/fixtures/quantised/tiny-qwen3-moe-htp-routing-codes.npz, its `provenance`: the
# 8 routers of the QNN W8A16 / W4A16 tiny Qwen3-MoE prompt calls so rewritten, and one-op TopK / Softmax sweeps)

HTP_ROUTING = "tiny-qwen3-moe-htp-routing-codes.npz"


def routing_codes() -> dict:
    return anchor(HTP_ROUTING)


def test_the_htps_topk_of_uint16_codes_compares_their_float16_values_ties_the_higher_index():
    """The TopK's values are each code's float16 value requantised (half up), its order that of the float16 values,
    ties to the higher index: every value of the 8 routers, every index and value of 2 x 1024 one-op rows (a third
    of the near-tie rows tie in float16); the logits' own codes gathered 12.5-31 % of the routers' values."""
    c = routing_codes()
    encs = iter(c["router_encodings"])
    for mix in ("w8a16", "w4a16"):
        for logits, topk in zip(c[f"{mix}_logits"].astype(np.int64), c[f"{mix}_topk"].astype(np.int64)):
            sl, zl, sv, zv, _, _ = next(encs)
            values = H.topk_values(logits, (sl, int(zl)), (sv, int(zv)))
            assert np.array_equal(np.take_along_axis(values, H.topk_order(values, 2), -1), topk), mix
            assert (-np.sort(-logits, -1)[:, :2] == topk).mean() <= 0.32
    for tag in ("l0tie", "big"):
        x, (s, z) = c[f"topk_{tag}_x"].astype(np.int64), c[f"topk_{tag}_encoding"]
        values = H.topk_values(x, (s, int(z)), (s, int(z)))
        order = H.topk_order(values, 2)
        assert np.array_equal(order, c[f"topk_{tag}_indices"]), tag
        assert np.array_equal(np.take_along_axis(values, order, -1), c[f"topk_{tag}_values"]), tag
    ties = H.topk_order(np.array([[1.0, 3.0, 3.0, 2.0]]), 2)
    assert ties.tolist() == [[2, 1]]


def test_the_htps_softmax_of_two_is_its_cubic_exp_rounded_half_down():
    """Rows of 2: on the routers' own top-k codes 7 of 8 whole, the other 93.75 % (1 code); over the sweeps of code
    differences at three input scales 96.9-98.0 %, max 1 code, where the exact softmax rounded is 6-65 % (the most at
    the widest scale, whose rows mostly saturate), up to 9 off
    (its exp's relative error, periodic in y = |d| s log2(e), is the device's cubic's)."""
    c = routing_codes()
    encs, whole = iter(c["router_encodings"]), 0
    for mix in ("w8a16", "w4a16"):
        for topk, weights in zip(c[f"{mix}_topk"].astype(np.int64), c[f"{mix}_weights"].astype(np.int64)):
            _, _, sv, zv, sw, zw = next(encs)
            got = H.softmax_pair(topk, (sv, int(zv)), (sw, int(zw)))
            whole += int(np.array_equal(got, weights))
            assert (got == weights).mean() >= 0.93 and np.abs(got - weights).max() <= 1, mix
    assert whole == 7
    for tag, s in zip(("l0", "big", "small"), c["pair_scales"]):
        x, codes = c[f"pair_{tag}_x"].astype(np.int64), c[f"pair_{tag}_codes"].astype(np.int64)
        got = H.softmax_pair(x, (s, 0), (1 / 65535, 0))
        assert (got == codes).mean() >= 0.96 and np.abs(got - codes).max() <= 1, tag
        d = (x[:, 0] - x[:, 1]) * np.float64(np.float32(s))
        exact = np.rint(np.stack([1 / (1 + np.exp(-d)), 1 / (1 + np.exp(d))], -1) * 65535)
        assert (exact == codes).mean() < 0.7 and np.abs(exact - codes).max() >= 8, tag
    assert H.softmax_pair(np.array([[7, 7]]), (1e-4, 0), (1 / 65535, 0)).tolist() == [[32767, 32767]]


def test_the_moes_routing_in_its_topk_softmax_form_is_the_device_ops_and_the_same_routing():
    """The rewritten routing's forms (placement.forms: TopK of the logits, Softmax of the top k) make the device ops
    TopK on the router's logits and Softmax on the top-k codes; as declared, the Softmax over all experts -> TopK ->
    ReduceSum -> Div, its TopK the HTP's of a Softmax (SoftmaxTopK: from the router's logits). moe.route in that
    form chooses the same experts and weights (float: softmax of the top-k logits, 1 ulp from the renormalised
    probabilities)."""
    from refimpl.kernels.activation import Unhooked
    from refimpl.kernels.moe import route
    from refimpl.models.config import config_from_dict
    from refimpl.models.model import graph
    from refimpl.presets import PRESETS
    nodes, p = graph(config_from_dict(PRESETS["tiny-qwen3-moe"])), "model.layers.0.mlp"
    plain = device_ops(nodes, "htp")
    forms = device_ops(nodes, "htp", {f"{p}.routing_weights/top-k": "TopK", f"{p}.routing_weights": "Softmax"})
    assert plain[f"{p}.routing_weights"] == ("Div", (f"{p}.routing_weights/top-k", f"{p}.routing_weights/sum"))
    assert plain[f"{p}.routing_weights/top-k"] == ("SoftmaxTopK", (f"{p}.router_logits",))   # not the probs' codes
    assert forms[f"{p}.routing_weights/top-k"] == ("TopK", (f"{p}.router_logits",))
    assert forms[f"{p}.routing_weights"] == ("Softmax", (f"{p}.routing_weights/top-k",))

    class Form(Unhooked):
        forms = {"routing_weights": "Softmax"}
    logits = np.random.default_rng(3).normal(0, 2, (64, 8)).astype(np.float32)
    logits[0, 5] = logits[0, 1] = logits[0].max() + 1                      # an exact tie: the higher id first
    _, w, e = route(logits, 2, True)
    _, w2, e2 = route(logits, 2, True, at=Form())
    assert np.array_equal(e2[1:], e[1:]) and e[0].tolist() == [1, 5] and e2[0].tolist() == [5, 1]
    assert np.abs(w2 - w).max() <= 2 * np.finfo(np.float32).eps


def test_the_htps_topk_of_a_quantised_softmax_is_a_float16_softmax_with_the_cubic_exps():
    """The as-exported routing's TopK of the router Softmax reads not the Softmax's codes but a softmax of its input
    codes with softmax_pair's cubic exps, rounded to float16: every top-2 value of the 16 routers of the four
    as-exported MoE dumps (QNN and aimet-onnx, W8A16 and W4A16; the Softmax's codes gathered were 0-6 %); 99.8 % of a
    one-op sweep's 1024 rows of 8, max one float16 step, where the exact softmax so rounded is 70.8 % and the
    Softmax's own codes sorted 13 %."""
    c = routing_codes()
    for logits, topk, (sl, zl, sv, zv) in zip(c["exported_logits"].astype(np.int64),
                                              c["exported_topk"].astype(np.int64), c["exported_encodings"]):
        assert np.array_equal(H.softmax_topk(logits, (sl, int(zl)), (sv, int(zv)), 2), topk)
    x, values = c["softmax_topk_x"].astype(np.int64), c["softmax_topk_values"].astype(np.int64)
    sx, zx = np.float32(8.730124e-05), 33394
    got = H.softmax_topk(x, (sx, zx), (1 / 65535, 0), 8)
    assert (got == values).mean() > 0.997 and np.abs(got - values).max() <= 32
    p = np.exp((x - x.max(-1, keepdims=True)) * np.float64(sx))
    p = -np.sort(-p / p.sum(-1, keepdims=True), -1)
    assert (np.rint(p.astype(np.float16).astype(np.float64) * 65535) == values).mean() < 0.72
    assert (-np.sort(-c["softmax_topk_codes"].astype(np.int64), -1) == values).mean() < 0.15


# --- a Gemm whose bias the graph leaves float (aimet-onnx's Qwen3.5 in_proj_a + dt_bias): codes the simulator
# produced (tests/fixtures/quantised/tiny-qwen3.5-aimet-htp-w8a16-gemm-codes.npz: the 3 Gemms of the /tmp/s37
# aimet-onnx W8A16 QDQ export of the tiny Qwen3.5 on the QNN 2.51 HTP v75 simulator, onnxruntime-qnn 2.7, the prompt
# call of tests/e2e/quantised.py with ONNX Runtime's graph optimizations off (its x, int8 weight, float bias and
# output codes); and two one-op QDQ Gemm sweeps of random codes (K = 2 and 8, 16 columns, the encodings
# `sweep_enc`), run so on the simulator; and the same export with k delta^T as MatMul (/tmp/i27kd), its dump's layer 1
# post-attention RMSNorm mean (the ReduceMean's input x^2 and output codes); docs/htp.md §9)

AIMET_HTP_GEMM = "tiny-qwen3.5-aimet-htp-w8a16-gemm-codes.npz"


def test_a_gemm_with_a_float_bias_is_the_htps_float16_gemm():
    """The HTP computes a Gemm whose bias is left float on the float16 grid (htp_quantised.gemm_float_bias): every
    code of the 3 dumped in_proj_a + dt_bias Gemms and of the two sweeps; the int32-bias Gemm (its bias at s_a s_w),
    the weights' float16 rounded to even (a 3 2^m-step weight is a tie) and float16(k s_w) are not."""
    c = anchor(AIMET_HTP_GEMM)
    op = DEVICE_OPS["htp"]["GemmFloat16Bias"]
    for i in range(3):
        ea, ew, ey = ((np.float32(c[f"gemm{i}_{n}_enc"][0]), int(c[f"gemm{i}_{n}_enc"][1])) for n in "xwy")
        x, w, b, y = c[f"gemm{i}_x"], c[f"gemm{i}_w"], c[f"gemm{i}_b"], c[f"gemm{i}_y"]
        assert np.array_equal(op([x, w, b], [ea, ew], ey), y)
        qb = np.rint(b / (np.float64(ea[0]) * np.float64(ew[0]))).astype(np.int64)   # the int32 bias at s_a s_w
        assert (H.matmul(x, ea, w, ew, ey, bias=(qb, ea[0] * ew[0])) == y).mean() < 0.5
    sa, za, sw, zw, so, zo = c["sweep_enc"]
    ea, ew, eo = (np.float32(sa), int(za)), (np.float32(sw), int(zw)), (np.float32(so), int(zo))
    for key in ("K2_b0", "K8_b1"):
        x, w, b, y = (c[f"sweep_{key}_{n}"] for n in "xwby")
        assert np.array_equal(H.gemm_float_bias(x, ea, w, ew, b, eo), y)
    x, w, b, y = (c[f"sweep_K2_b0_{n}"] for n in "xwby")
    xf = H.float16_copy((x.astype(np.int64) - za) * np.float64(ea[0])).astype(np.float64)
    for wf, share in (((w * np.float64(np.float16(ew[0]))).astype(np.float16), 0.96),    # ties to even: 96.2 %
                      ((w * np.float64(ew[0])).astype(np.float16), 0.63)):               # float32 scale: 63.4 %
        v = H.float16_copy(xf @ wf.astype(np.float64) + H.float16_copy(b)).astype(np.float64)
        assert (np.rint(v / np.float64(eo[0])) + zo == y).mean() == pytest.approx(share, abs=0.01)


def test_the_device_arithmetic_computes_a_gemm_whose_bias_is_float_on_the_float16_grid():
    """--device-arithmetic htp: a Gemm point (x W + b) whose bias no integer encoding holds is the device op
    GemmFloat16Bias on x's held codes and the weight's stored codes (layer 0's in_proj_a + dt_bias of the dump: every
    code); with an int32 bias encoding it is the int32-bias Gemm; without the device arithmetic, x W + b quantised."""
    f = anchor(AIMET_HTP_GEMM)
    x, w, b, y = (f[f"gemm0_{n}"] for n in "xwby")
    (sa, za), (sw, _), (so, zo) = (f[f"gemm0_{n}_enc"] for n in "xwy")
    e_x, e_y = enc(sa, int(za)), enc(so, int(zo))
    e_w = Encoding(8, np.float32(sw), np.int32(0), signed=True, arithmetic="onnx")
    wt = e_w.dequantize(w.T.astype(np.int64))                                       # [out, in]
    float16 = Encoding(16, np.float32(1), np.int32(0), float_dtype="float16")        # a float entry
    for arithmetic, bias_enc in (("htp", None), ("htp", float16), (None, None)):
        weights = {"w": (wt, e_w), "b": (b, bias_enc)}
        q = Quantisers(outputs={"x": e_x, "g": e_y}, arithmetic=arithmetic, weight=lambda n: weights[n],
                       ops={"g": ("Gemm", ("x", "weight:w", "weight:b"))} if arithmetic else None)
        xv = q.output("x", e_x.dequantize(x.astype(np.int64)))
        got = e_y.codes(q.output("g", (xv @ wt.T + b).astype(np.float32)))
        assert (got == y).all() == (arithmetic == "htp"), (arithmetic, bias_enc)


def test_a_reduction_below_half_a_step_carries_one_unit_per_term():
    """Below r = 1/2 the HTP's ReduceMean / ReduceSum sums m n_i plus N units of Q(k) before adding its whole step
    (htp_quantised.reduce_steps): the aimet-onnx Qwen3.5 dump's layer 1 post-attention mean (r = 0.127, k = 17, N = 64)
    every code; without the N units its last row is one code low (m S / 2^k = 17223.99989)."""
    f = anchor(AIMET_HTP_GEMM)
    x, ex, y, ey = f["mean_x"], f["mean_x_enc"], f["mean_y"], f["mean_y_enc"]
    ex, ey = (np.float32(ex[0]), int(ex[1])), (np.float32(ey[0]), int(ey[1]))
    assert np.array_equal(H.reduce_mean(x, ex, ey), y)
    m, k = H.mean_multiplier(np.float64(ex[0]) / (x.shape[-1] * np.float64(ey[0])))
    without = (m * x.astype(np.int64).sum(-1, keepdims=True) >> k) + 1
    assert (without == y).mean() == 7 / 8
