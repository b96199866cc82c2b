"""Precision policies (refimpl/precision.py): plumbing, the cast-point invariant, weight and KV emulation,
AIMET-style encodings files."""

import json

import ml_dtypes
import numpy as np
import pytest

import refimpl
from refimpl.encodings import Encoding, read_encodings
from refimpl.errors import FormatError, InputError
from refimpl.kernels import quant
from refimpl.kernels.quant import onnx_quantize, qnn_quantize
from refimpl.precision import Policy, fake_quant_weight, from_manifest, policy

IDS = np.array([[5, 6, 7, 8, 9]])


def on_grid(x, dtype) -> bool:
    return np.array_equal(x, x.astype(dtype).astype(x.dtype))


def test_float32_policy_is_the_default_bit_for_bit():
    a = refimpl.load("tiny-qwen3.5").forward(IDS)
    b = refimpl.load("tiny-qwen3.5", precision=Policy()).forward(IDS)
    assert a.tobytes() == b.tobytes()
    assert refimpl.load("tiny-qwen3", precision="float64").forward(IDS).tobytes() == \
        refimpl.load("tiny-qwen3", dtype="float64").forward(IDS).tobytes()


@pytest.mark.parametrize("bad, message", [
    ("bf17", "activations 'bf17'"),
    ({"activations": "bf16", "weights": "int3-per-channel-qnn"}, "weights 'int3"),
    ({"kv": "int4"}, "kv 'int4'"),
    ({"weights": "encodings"}, "go together"),
    ({"activations": "float64", "kv": "fp16"}, "float64 oracle"),
])
def test_bad_policies_are_refused(bad, message):
    with pytest.raises(InputError, match=message):
        policy(bad)


def test_float64_dtype_and_a_low_precision_policy_conflict():
    with pytest.raises(InputError, match="contradicts"):
        refimpl.load("tiny-qwen3", dtype="float64", precision="bf16")


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-qwen3-next", "tiny-qwen3.5-moe"])
def test_every_tap_is_on_the_bf16_grid_except_transformers_float32_islands(preset):
    """With bf16 activations, everything transformers holds in bf16 is bf16-representable; what it keeps in
    float32 (router probabilities, g, the l2-normalised q / k inside the GDN core, the recurrent state) is not."""
    m = refimpl.load(preset, precision="bf16")
    cache = m.new_cache()
    with refimpl.trace() as tr:
        m.forward(IDS, cache=cache)
        m.forward(np.array([[3]]), cache=cache)
    off = {n.split(".", 3)[-1] for n, v in tr.records if v.dtype.kind == "f" and not on_grid(v, ml_dtypes.bfloat16)}
    islands = {"mlp.router_probs"} | ({"linear_attn.g", "linear_attn.q", "linear_attn.k",
                                       "linear_attn.recurrent_state"} if m.config.is_hybrid else set())
    assert off == islands
    assert all(on_grid(w, ml_dtypes.bfloat16) for w in (m.weights[n] for n in m.weights.stored if "experts" not in n))


def test_fp16_emulation_differs_from_float32_by_fp16_rounding():
    a = refimpl.load("tiny-qwen3").forward(IDS)
    b = refimpl.load("tiny-qwen3", precision="fp16").forward(IDS)
    assert on_grid(b, np.float16) and not np.array_equal(a, b)
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3.5"])
def test_fp16_kv_cache_holds_fp16_values(preset):
    m = refimpl.load(preset, precision=Policy(kv="fp16"))
    cache = m.new_cache()
    m.forward(IDS, cache=cache)
    m.forward(np.array([[3]]), cache=cache)
    layers = [kv for kv in cache.layers if hasattr(kv, "keys")]
    assert layers and all(on_grid(kv.keys, np.float16) and on_grid(kv.values, np.float16) for kv in layers)
    plain = m.new_cache()
    refimpl.load(preset).forward(IDS, cache=plain)
    assert not on_grid(next(kv for kv in plain.layers if hasattr(kv, "keys")).keys, np.float16)


def test_int8_kv_cache_values_are_on_each_rows_grid():
    m = refimpl.load("tiny-qwen3", precision=Policy(kv="int8"))
    cache = m.new_cache()
    m.forward(IDS, cache=cache)
    m.forward(np.array([[3]]), cache=cache)
    for kv in cache.layers:
        for x in (kv.keys, kv.values):                      # [B, Hkv, P, D]: one scale per (b, h, t) row
            s = np.abs(x).max(-1, keepdims=True) / 127
            q = x / s
            assert np.abs(q - np.rint(q)).max() < 1e-3 and np.abs(q).max() <= 127 + 1e-3
            assert np.allclose(np.abs(q).max(-1), 127)      # the row's largest value is the scale's anchor
    a, b = refimpl.load("tiny-qwen3").forward(IDS), m.forward(IDS)
    assert 0 < np.abs(a - b).max() < 0.05 * np.abs(a).max()


def test_kv_emulation_is_the_same_with_and_without_a_cache():
    m = refimpl.load("tiny-qwen3", precision=Policy(kv="int8"))
    cache = m.new_cache()
    stepwise = np.concatenate([m.forward(IDS[:, :3], cache=cache), m.forward(IDS[:, 3:], cache=cache)], axis=1)
    # float32 matmul blocking differs between the calls (~2e-5 on logits of ~16); int8 KV applied
    # inconsistently would differ by ~1e-2
    np.testing.assert_allclose(stepwise, m.forward(IDS), rtol=0, atol=1e-4)


def test_int8_per_channel_weights_are_on_each_rows_qnn_grid():
    w = np.random.default_rng(0).normal(size=(6, 10)).astype(np.float32)
    d = fake_quant_weight(w, "int8-per-channel-qnn")
    scale, offset = quant.qnn_encoding_from_range(w.min(1), w.max(1), 8)
    q = d / scale[:, None] - offset[:, None]
    assert np.abs(q - np.rint(q)).max() < 1e-3 and q.min() > -1e-3 and q.max() < 255 + 1e-3
    assert np.abs(d - w).max() <= scale.max() / 2 + 1e-7


def test_int4_block_onnx_weights_with_a_short_last_block():
    w = np.random.default_rng(1).normal(size=(3, 10)).astype(np.float32)
    d = fake_quant_weight(w, "int4-block4-onnx")            # blocks of 4, 4, 2
    for lo, hi in ((0, 4), (4, 8), (8, 10)):
        block, deq = w[:, lo:hi], d[:, lo:hi]
        scale, zp = quant.onnx_params_from_range(block.min(1), block.max(1), "int4")
        q = deq / scale[:, None] + zp[:, None]
        np.testing.assert_allclose(q, np.rint(q), atol=1e-4)
        assert q.min() > -8 - 1e-4 and q.max() < 7 + 1e-4
        assert np.abs(deq - block).max() <= scale.max() / 2 + 1e-6


def test_int_weights_policy_quantises_matrices_only():
    m = refimpl.load("tiny-qwen3-moe", precision=Policy(weights="int4-per-channel-qnn"))
    ref = refimpl.load("tiny-qwen3-moe")
    w, r = m.weights, ref.weights
    assert np.array_equal(w["model.embed_tokens.weight"], r["model.embed_tokens.weight"])
    assert np.array_equal(w["model.norm.weight"], r["model.norm.weight"])
    q = w["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(q, r["model.layers.0.self_attn.q_proj.weight"])
    assert all(len(np.unique(row)) <= 16 for row in q)
    experts = w["model.layers.0.mlp.experts.gate_up_proj"]  # [E, 2Ie, H]: per (expert, row)
    assert all(len(np.unique(row)) <= 16 for row in experts.reshape(-1, experts.shape[-1]))


def _encodings(w: np.ndarray):
    """Symmetric 4-bit per-channel QNN encodings of w [out, in]: offset -8, scale = max|w_row| / 7."""
    scale = (np.abs(w).max(1) / 7).astype(np.float32)
    return scale, [{"bitwidth": 4, "scale": float(s), "offset": -8, "min": float(-8 * s), "max": float(7 * s),
                    "is_symmetric": "True"} for s in scale]


def test_aimet_legacy_encodings_are_applied_exactly(tmp_path):
    name = "model.layers.0.mlp.down_proj.weight"
    w = refimpl.load("tiny-qwen3").weights[name]
    scale, per_channel = _encodings(w)
    path = tmp_path / "model.encodings"
    path.write_text(json.dumps({"activation_encodings": {}, "param_encodings": {name: per_channel}}))
    m = refimpl.load("tiny-qwen3", precision=Policy(weights="encodings", encodings=str(path)))
    q = np.clip(np.rint(w.astype(np.float64) / scale[:, None]) + 8, 0, 15)   # hand-written QNN quantisation
    np.testing.assert_array_equal(m.weights[name], ((q - 8).astype(np.float32) * scale[:, None]))
    other = "model.layers.0.mlp.up_proj.weight"
    assert np.array_equal(m.weights[other], refimpl.load("tiny-qwen3").weights[other])   # not in the file


def test_aimet_v1_per_block_and_lpbq_encodings(tmp_path):
    ref = refimpl.load("tiny-qwen3").weights
    a, b = "model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.gate_proj.weight"
    wa, wb = ref[a], ref[b]                                  # [64, 128], [192, 64]
    block = 48                                               # 128 = 48 + 48 + 32: a short last block
    blocks = -(-wa.shape[1] // block)
    sa = np.stack([np.abs(wa[:, i * block:(i + 1) * block]).max(1) / 127 for i in range(blocks)], 1).astype(np.float32)
    ch = (np.abs(wb).max(1) / (7 * 2)).astype(np.float32)   # LPBQ: channel scale x integer block scale (1 or 2)
    ints = np.tile([1, 2], (wb.shape[0], 1))                 # blocks of 32 over 64 columns
    path = tmp_path / "v1.encodings"
    path.write_text(json.dumps({"version": "1.0.0", "activation_encodings": [], "param_encodings": [
        {"name": a, "dtype": "INT", "enc_type": "PER_BLOCK", "bw": 8, "is_sym": True, "block_size": block,
         "scale": sa.reshape(-1).tolist(), "offset": [-128] * sa.size},
        {"name": b, "dtype": "INT", "enc_type": "LPBQ", "bw": 4, "is_sym": True, "block_size": 32,
         "scale": ch.tolist(), "offset": [-8] * len(ch), "per_block_int_scale": ints.reshape(-1).tolist()}]}))
    m = refimpl.load("tiny-qwen3", precision=Policy(weights="encodings", encodings=str(path)))
    sa_full = np.repeat(sa, block, axis=1)[:, :wa.shape[1]]
    qa = np.clip(np.rint(wa.astype(np.float64) / sa_full) + 128, 0, 255)
    np.testing.assert_array_equal(m.weights[a], (qa - 128).astype(np.float32) * sa_full)
    sb = (ch[:, None] * np.repeat(ints, 32, axis=1)).astype(np.float32)
    qb = np.clip(np.rint(wb.astype(np.float64) / sb) + 8, 0, 15)
    np.testing.assert_array_equal(m.weights[b], (qb - 8).astype(np.float32) * sb)
    assert read_encodings(path)[b].bitwidth == 4


def test_symmetric_encodings_with_zero_offsets_are_signed(tmp_path):
    name = "model.layers.0.mlp.down_proj.weight"
    w = refimpl.load("tiny-qwen3").weights[name]
    scale = (np.abs(w).max(1) / 7).astype(np.float32)
    path = tmp_path / "sym.encodings"
    path.write_text(json.dumps({"version": "1.0.0", "param_encodings": [
        {"name": name, "enc_type": "PER_CHANNEL", "bw": 4, "is_sym": True, "scale": scale.tolist(),
         "offset": [0] * len(scale)}]}))
    m = refimpl.load("tiny-qwen3", precision=Policy(weights="encodings", encodings=str(path)))
    q = np.clip(np.rint(w.astype(np.float64) / scale[:, None]), -8, 7)
    np.testing.assert_array_equal(m.weights[name], q.astype(np.float32) * scale[:, None])
    assert (m.weights[name] < 0).any()


def test_policy_round_trips_through_a_manifest(tmp_path):
    for p in (Policy(), Policy("float64"), Policy("bf16"), Policy("fp16", "int4-block32-onnx", "int8"),
              Policy("float32", "bf16", "fp16")):
        assert from_manifest(json.loads(json.dumps(p.to_dict()))) == Policy(p.activations, p.weights, p.kv)
    assert from_manifest({"dtype": "float64"}) == Policy("float64")          # bundles from before policies
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"param_encodings": {}}))
    recorded = Policy(weights="encodings", encodings=str(path)).to_dict()
    assert from_manifest(recorded, str(path)).encodings == str(path)
    with pytest.raises(InputError, match="give it again"):
        from_manifest(recorded)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"param_encodings": {"x": []}}))
    with pytest.raises(InputError, match="differs from the bundle"):
        from_manifest(recorded, str(other))


def test_bad_encodings_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(FormatError, match="bad.json: not valid JSON"):
        read_encodings(bad)
    wrong = tmp_path / "wrong.json"
    name = "model.layers.0.mlp.down_proj.weight"
    wrong.write_text(json.dumps({"param_encodings": {name: [{"bitwidth": 8, "scale": 0.1, "offset": -128}] * 3}}))
    m = refimpl.load("tiny-qwen3", precision=Policy(weights="encodings", encodings=str(wrong)))
    with pytest.raises(FormatError, match="down_proj"):
        m.weights[name]


def test_aimet_lpbq_as_exported_float_entries_offsets_and_names(tmp_path):
    """AIMET 1.0.0 writes LPBQ with bw = the expanded width (8), compressed_bw = 4 and offset -128: the codes are
    the signed 4-bit range (AIMET's GroupedBlockQuantizeDequantize: round(clip(x / s, -8, 7)) * s)."""
    name = "model.layers.0.mlp.down_proj.weight"
    w = refimpl.load("tiny-qwen3").weights[name]                     # [64, 192]
    ch = np.full(w.shape[0], 0.1, np.float32)
    ints = np.ones((w.shape[0], w.shape[1] // 64), np.int64)
    entry = {"name": "model.language_model.layers.0.mlp.down_proj.weight",  # the multimodal checkpoint's name
             "dtype": "INT", "enc_type": "LPBQ", "bw": 8, "compressed_bw": 4, "is_sym": True, "block_size": 64,
             "scale": ch.tolist(), "offset": [-128] * len(ch), "per_block_int_scale": ints.reshape(-1).tolist()}
    float_entry = {"name": "model.layers.0.mlp.up_proj.weight", "dtype": "FLOAT", "bw": 16}
    path = tmp_path / "lpbq.encodings"
    path.write_text(json.dumps({"version": "1.0.0", "param_encodings": [entry, float_entry]}))
    enc = read_encodings(path)
    assert set(enc) == {name, float_entry["name"]} and enc[name].bitwidth == 4 and enc[name].signed
    x = np.array([[0.95, -0.9, 0.04, 0.06]], np.float32)
    e = Encoding(4, np.float32(0.1), np.int32(0), None, True)
    np.testing.assert_allclose(e.fake_quant(x), [[0.7, -0.8, 0.0, 0.1]], rtol=1e-6)   # clipped to [-8, 7] codes
    m = refimpl.load("tiny-qwen3", precision=Policy(weights="encodings", encodings=str(path)))
    q = np.clip(np.rint(w / np.float32(0.1)), -8, 7)
    np.testing.assert_array_equal(m.weights[name], q.astype(np.float32) * np.float32(0.1))
    up = refimpl.load("tiny-qwen3").weights[float_entry["name"]]       # a float 16 entry: QuantSim's fp16 cast
    np.testing.assert_array_equal(m.weights[float_entry["name"]], up.astype(np.float16).astype(np.float32))
    bad = tmp_path / "bad.encodings"
    bad.write_text(json.dumps({"version": "1.0.0", "param_encodings": [{**entry, "enc_type": "PER_TENSOR",
                                                                        "scale": [0.1], "offset": [126]}]}))
    with pytest.raises(FormatError, match="offset 126 > 0"):
        read_encodings(bad)
    typo = tmp_path / "typo.encodings"
    typo.write_text(json.dumps({"version": "1.0.0", "param_encodings": [{**entry, "name": "model.layers.0.mlp.down"}]}))
    with pytest.raises(InputError, match="name no weight"):
        refimpl.load("tiny-qwen3", precision=Policy(weights="encodings", encodings=str(typo)))


def test_quantisation_divides_in_float32_as_onnx_runtime():
    x = np.array([-0.43664998], np.float32)
    s = np.float32(0.0123)
    assert np.float32(x[0]) / s == np.float32(-35.5)                  # float64 would give -35.4999994
    assert onnx_quantize(x, s, 0, "int8")[0] == -36                     # half to even
    assert qnn_quantize(x, s, -128, 8)[0] == -36 + 128


def test_tied_lm_head_is_quantised_on_its_own():
    """Integer weights: a tied model's lm_head MatMul is fake-quantised under its own name, while the embedding
    gather keeps the float table (both read the same stored array)."""
    m = refimpl.load("tiny-qwen3", precision=Policy(weights="int8-per-channel-qnn"))
    assert m.config.tie_word_embeddings
    emb, head = m.weights["model.embed_tokens.weight"], m.weights["lm_head.weight"]
    np.testing.assert_array_equal(emb, refimpl.load("tiny-qwen3").weights["model.embed_tokens.weight"])
    np.testing.assert_array_equal(head, fake_quant_weight(emb, "int8-per-channel-qnn"))
    assert not np.array_equal(head, emb)
    assert "lm_head.weight" not in m.weights.stored          # no copy in the checkpoint, no new sha256
    assert m.weights.sha256() == refimpl.load("tiny-qwen3").weights.sha256()


def test_htp_fp16_policy_rounds_the_delta_rule_too():
    """htp-fp16: fp16 weights and cast points, plus the delta rule token by token in fp16 (state included)."""
    from refimpl.kernels.activation import identity
    from refimpl.kernels.gated_delta import gated_delta_recurrent, gated_delta_rounded, l2_normalize
    from refimpl.precision import Policy, rounder
    p = Policy("htp-fp16")
    assert p.emulated and p.rounds_each_op and p.weight_format == "fp16" and not Policy("fp16").rounds_each_op
    assert p.to_dict()["cast_points"] != Policy("fp16").to_dict()["cast_points"]
    rng = np.random.default_rng(3)
    q, k = (l2_normalize(rng.standard_normal((1, 5, 2, 8)).astype(np.float32)) for _ in range(2))
    v = rng.standard_normal((1, 5, 4, 8)).astype(np.float32)
    g, beta = -rng.uniform(0.05, 1, (1, 5, 4)).astype(np.float32), rng.uniform(0, 1, (1, 5, 4)).astype(np.float32)
    S0 = rng.standard_normal((1, 4, 8, 8)).astype(np.float32)
    o_ref, S_ref = gated_delta_recurrent(q, k, v, g, beta, S0, use_qk_l2norm=False)
    o, S = gated_delta_rounded(q, k, v, g, beta, S0, identity)        # no rounding: the same function
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(S, S_ref, rtol=1e-5, atol=1e-5)
    o16, S16 = gated_delta_rounded(q, k, v, g, beta, S0, rounder("fp16"))
    assert np.array_equal(o16, o16.astype(np.float16).astype(np.float32))       # every value an fp16 value
    assert np.array_equal(S16, S16.astype(np.float16).astype(np.float32))
    err = np.abs(o16 - o_ref).max() / np.abs(o_ref).max()
    assert 1e-5 < err < 1e-2, err                                               # fp16 noise, not a different rule


@pytest.mark.parametrize("T,C,Hk,Hv", [(7, 64, 2, 4), (8, 64, 2, 2), (40, 16, 1, 2), (64, 64, 2, 4), (9, 1, 1, 1)])
def test_aihub_chunked_delta_rule_is_the_recurrent_rule_in_float64(T, C, Hk, Hv):
    """gated_delta_chunked_rounded without rounding (AI Hub's chunked algorithm, its band-seeded Newton-Schulz
    inverse included) is the token-by-token rule in float64 to ~1e-15: the same real function."""
    from refimpl.kernels.activation import identity
    from refimpl.kernels.gated_delta import gated_delta_chunked_rounded, gated_delta_recurrent, l2_normalize
    rng = np.random.default_rng(T * 100 + C)
    q, k = (l2_normalize(rng.standard_normal((1, T, Hk, 16))) for _ in range(2))
    v, S0 = rng.standard_normal((1, T, Hv, 8)), 0.1 * rng.standard_normal((1, Hv, 16, 8))
    g, beta = -0.5 * np.abs(rng.standard_normal((1, T, Hv))), rng.uniform(0, 1, (1, T, Hv))
    o_ref, S_ref = gated_delta_recurrent(q, k, v, g, beta, S0, use_qk_l2norm=False, scale=16 ** -0.5)
    o, S = gated_delta_chunked_rounded(q, k, v, g, beta, S0, identity, C)
    assert np.abs(o - o_ref).max() < 1e-12 * np.abs(o_ref).max()
    assert np.abs(S - S_ref).max() < 1e-12 * np.abs(S_ref).max()
    o16, _ = gated_delta_chunked_rounded(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                                         g.astype(np.float32), beta.astype(np.float32), S0.astype(np.float32),
                                         rounder_fp16(), C)
    assert np.array_equal(o16, o16.astype(np.float16).astype(np.float32))
    err = np.abs(o16 - o_ref).max() / np.abs(o_ref).max()
    assert 1e-5 < err < 1e-2, err                                               # fp16 noise, not a different rule


def rounder_fp16():
    from refimpl.precision import rounder
    return rounder("fp16")


def test_delta_rule_chunk_is_an_htp_fp16_property_recorded_only_when_set():
    p = Policy("htp-fp16", delta_rule_chunk=64)
    assert p.to_dict()["delta_rule_chunk"] == 64 and "delta_rule_chunk" not in Policy("htp-fp16").to_dict()
    assert from_manifest(p.to_dict()).delta_rule_chunk == 64
    assert from_manifest(Policy("htp-fp16").to_dict()).delta_rule_chunk is None
    assert any("chunks of min(T, 64)" in c for c in p.cast_points)
    for activations, chunk in (("fp16", 64), ("htp-fp16", 0), ("htp-fp16", 65), ("htp-fp16", 8.0)):
        with pytest.raises(InputError, match="delta_rule_chunk"):
            policy({"activations": activations, "delta_rule_chunk": chunk})


def test_rms_norm_rounded_is_rms_norm_without_rounding():
    """htp-fp16's op-by-op RMSNorm is the same function as the one-cast norm (float64, no rounding), plain and
    zero-centred; rounded, every value is an fp16 value within fp16 noise of it."""
    from refimpl.kernels.norm import rms_norm, rms_norm_rounded
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((3, 4, 32)), 0.1 * rng.standard_normal(32)
    for zc in (False, True):
        np.testing.assert_allclose(rms_norm_rounded(x, w, 1e-6, zero_centered=zc),
                                   rms_norm(x, w, 1e-6, zero_centered=zc), rtol=1e-13, atol=1e-15)
        y = rms_norm_rounded(x.astype(np.float32), w.astype(np.float32), 1e-6, zero_centered=zc, rnd=rounder_fp16())
        assert np.array_equal(y, y.astype(np.float16).astype(np.float32))
        ref = rms_norm(x, w, 1e-6, zero_centered=zc)
        assert np.abs(y - ref).max() < 4e-3 * np.abs(ref).max()
