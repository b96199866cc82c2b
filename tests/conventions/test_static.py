"""The Genie static-graph convention reproduces the dynamic forward: logits at valid positions, the KV the
host accumulates and the GDN states, over drawn AR, CL, prompt lengths, decode steps and options."""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import refimpl
from helpers import scaled
from refimpl.conventions import genie, qeff
from refimpl.errors import InputError
from refimpl.models.hybrid import zero_state

PRESETS = ["tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3-next", "tiny-qwen3.5", "tiny-qwen3.5-moe"]
_models = {}


def model(name, dtype="float64"):
    """float64: the preset (checks hold to 1e-10); float32: the preset with logits of size ~2 (helpers.scaled),
    checked to 1e-5 of the largest logit."""
    if (name, dtype) not in _models:
        _models[name, dtype] = refimpl.load(name, dtype=dtype) if dtype == "float64" else scaled(name)
    return _models[name, dtype]


def close(actual, expected, what="", exact=False):
    """float64: 1e-10 absolute; float32: bit for bit where `exact`, else 1e-5 of the expected tensor's largest
    magnitude.

    float32 static calls equal the dynamic forward bit for bit wherever the padding adds exact zeros to exact
    sums: every product and sum is correctly rounded (docs/numerics.md), so a row's value does not depend on the
    other rows of its matmul, and a masked key slot whose exp(score - max) underflows to 0 adds nothing. It cannot
    hold (a) with a mask floor of -50 or -100: exp(s - 100 - max) is a non-zero float32 subnormal for s near max
    (e^-100 = 3.7e-44 > 2^-149), so pad slots add tiny terms to the softmax sums; (b) with k_prescale, which is
    another formula (q . (k / sqrt D) instead of (q . k) / sqrt D)."""
    expected = np.asarray(expected)
    if exact and expected.dtype == np.float32:
        np.testing.assert_array_equal(actual, expected, err_msg=what)
        return
    tol = 1e-10 if expected.dtype == np.float64 else 1e-5 * float(np.abs(expected).max())
    np.testing.assert_allclose(actual, expected, atol=tol, rtol=0, err_msg=what)


def valid_logits(call):
    """The logits rows the call's valid region marks (the real tokens)."""
    (b0, b1), (t0, t1), _ = call.valid["logits"][0]
    return call.outputs["logits"][0, t0:t1]


def check_against_dynamic(m, prompt, calls, conv="conv_state_{}_out", rec="recurrent_state_{}_out", exact=False):
    """Static calls == the dynamic forward: prompt logits, each decode step's logits, final GDN states.

    float64: against one forward of the whole prompt, then single-token steps (1e-10).
    float32: against the dynamic forward fed the same real-token chunks with a cache, so both run the same GDN
    algorithm per call (a one-token call runs the recurrent form, a longer one the chunked form; in float32 the
    two differ by rounding that these tiny hybrids amplify to ~2e-5 of the logit scale over many steps). The
    static plumbing — windows, masks, positions, layouts, states — is still checked independently. `exact`: float32
    bit for bit (see close).
    """
    cache = m.new_cache()
    n_prompt = len([c for c in calls if c.graph in ("prompt", "prefill")])
    if m.dtype == np.float64:
        full = m.forward(np.array([prompt]), cache=cache)
        close(np.concatenate([valid_logits(c) for c in calls[:n_prompt]]), full[0], "prompt logits")
    else:  # zero states up front: a static graph always receives a state, so a first 1-token call is recurrent too
        for i, kind in enumerate(m.config.layer_types):
            if kind == "linear_attention":
                cache.layers[i] = zero_state(m.config, m.dtype)
        for c in calls[:n_prompt]:
            close(valid_logits(c), m.forward(np.array([c.tokens]), cache=cache)[0], "prompt logits", exact)
    for c in calls[n_prompt:]:
        step = m.forward(np.array([c.tokens]), cache=cache)
        close(valid_logits(c)[-1], step[0, -1], "decode logits", exact)
    last = calls[-1]
    for i, kind in enumerate(m.config.layer_types):
        if kind == "linear_attention":
            S = last.outputs[conv.format(i)].shape[-1]
            close(last.outputs[conv.format(i)], cache.layers[i].conv[:, :, -S:], f"conv state {i}", exact)
            close(last.outputs[rec.format(i)], cache.layers[i].recurrent, f"recurrent state {i}", exact)
    return cache


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", PRESETS)
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_static_equals_dynamic(name, dtype, data):
    ar = data.draw(st.integers(1, 9), label="ar")
    prompt_len = data.draw(st.integers(1, 20), label="prompt_len")
    decode = data.draw(st.integers(0, 3), label="decode_steps")
    decode_ar = data.draw(st.sampled_from([1, 2] if ar >= 2 else [1]), label="decode_ar")
    kv_output = data.draw(st.sampled_from(["new", "window"]), label="kv_output")
    low = ar + prompt_len + decode  # every call's window holds all earlier tokens
    if kv_output == "window":  # and the window returns all of a call's new entries
        low = max(low, 2 * ar)
    step = math.lcm(ar, decode_ar)  # the context holds whole calls of either graph
    cl = data.draw(st.integers(-(-low // step), -(-low // step) + 3), label="cl / lcm(AR, decode AR)") * step
    m = model(name, dtype)
    Kc = m.config.linear_conv_kernel_dim
    opts = genie.Options(ar=ar, cl=cl, decode_ar=decode_ar,
                         pad_side=data.draw(st.sampled_from(["left", "right"]), label="pad_side"),
                         mask_floor=data.draw(st.sampled_from([-50.0, -100.0, -1000.0]), label="floor"),
                         key_transposed=data.draw(st.booleans(), label="key_transposed"),
                         kv_output=kv_output,
                         k_prescale=data.draw(st.booleans(), label="k_prescale"),
                         conv_state_len=data.draw(st.sampled_from([None, Kc - 1]), label="conv_state_len")
                         if m.config.is_hybrid else None)
    prompt = list(np.random.default_rng(prompt_len).integers(0, m.config.vocab_size, size=prompt_len))
    calls = genie.run(m, prompt, opts, decode_steps=decode)
    exact = opts.mask_floor <= -1000 and not opts.k_prescale       # pads add exact zeros (see close)
    cache = check_against_dynamic(m, prompt, calls, exact=exact)
    # the KV the device returned, gathered over calls, is the dynamic cache
    for i, kind in enumerate(m.config.layer_types):
        if kind != "linear_attention":
            keys = []
            for c in calls:
                k = c.outputs[f"past_key_{i}_out"][:, 0]
                k = k.swapaxes(1, 2) if opts.key_transposed else k
                box = c.valid[f"past_key_{i}_out"][-1]        # the call's real new entries (kv_output new or window)
                keys.append(k[:, slice(*box[3 if opts.key_transposed else 2])])
            close(np.concatenate(keys, 1), cache.layers[i].keys[0], f"keys {i}", exact)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", PRESETS)
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_qeff_static_equals_dynamic(name, dtype, data):
    seq_len = data.draw(st.integers(1, 9), label="seq_len")
    prompt_len = data.draw(st.integers(1, 20), label="prompt_len")
    decode = data.draw(st.integers(0, 3), label="decode_steps")
    ctx_len = data.draw(st.integers(max(prompt_len + decode, seq_len), prompt_len + decode + seq_len + 5))
    m = model(name, dtype)
    prompt = list(np.random.default_rng(prompt_len).integers(0, m.config.vocab_size, size=prompt_len))
    calls = qeff.run(m, prompt, qeff.Options(seq_len=seq_len, ctx_len=ctx_len), decode_steps=decode)
    cache = check_against_dynamic(m, prompt, calls, "conv_state.{}_RetainedState", "recurrent_state.{}_RetainedState",
                                  exact=True)                           # masked slots: finfo.min, exp gives 0
    for i, kind in enumerate(m.config.layer_types):  # the scattered full-context KV holds the dynamic cache
        if kind != "linear_attention":
            P = cache.seq_length
            close(calls[-1].outputs[f"past_key.{i}_RetainedState"][:, :, :P], cache.layers[i].keys, f"keys {i}", True)
            assert not calls[-1].outputs[f"past_key.{i}_RetainedState"][:, :, P:].any()  # pad writes dropped


def test_qeff_inputs():
    calls = qeff.run(model("tiny-qwen3"), [5, 6, 7, 8, 9], qeff.Options(seq_len=4, ctx_len=8), decode_steps=1)
    assert calls[1].inputs["input_ids"].tolist() == [[9, 151645, 151645, 151645]]
    assert calls[1].inputs["position_ids"].tolist() == [[4, -1, -1, -1]]
    assert calls[2].inputs["position_ids"].tolist() == [[5]]
    assert calls[0].inputs["past_key.0"].shape == (1, 2, 8, 32) and calls[2].graph == "decode"
    with pytest.raises(InputError, match="ctx_len 8 is too small"):
        qeff.run(model("tiny-qwen3"), list(range(1, 9)), qeff.Options(seq_len=4, ctx_len=8), decode_steps=1)


@pytest.mark.parametrize("name", PRESETS)
def test_static_equals_dynamic_float32(name):
    """float32, bit for bit where the pads add exact zeros (mask floor -1000; qeff's finfo.min), else (AI Hub's
    default floor -100: e^-100 is a float32 subnormal, not 0) <= 1e-5 of the largest logit."""
    m = scaled(name)
    prompt = list(np.random.default_rng(5).integers(0, m.config.vocab_size, size=13))
    for floor in (-1000.0, -100.0):
        check_against_dynamic(m, prompt, genie.run(m, prompt, genie.Options(ar=4, cl=24, mask_floor=floor),
                                                   decode_steps=2), exact=floor == -1000.0)
    check_against_dynamic(m, prompt, qeff.run(m, prompt, qeff.Options(seq_len=4, ctx_len=24), decode_steps=2),
                          "conv_state.{}_RetainedState", "recurrent_state.{}_RetainedState", exact=True)


def test_shapes_names_and_valid_regions():
    """AI Hub's exported I/O (the defaults): Kc conv state columns, mask floor -100, left padding with the pads
    leading the first prompt chunk, each layer's inputs in layer order."""
    m = model("tiny-qwen3.5")
    calls = genie.run(m, [5, 6, 7, 8, 9], genie.Options(ar=4, cl=16), decode_steps=1)
    first, token = calls[0], calls[-1]
    cfg = m.config
    eos = cfg.eos_token_id
    assert first.inputs["input_ids"].tolist() == [[eos] * 3 + [5]] and calls[1].inputs["input_ids"].tolist() == \
        [[6, 7, 8, 9]]
    assert list(first.inputs) == ["input_ids", "attention_mask", "position_ids_cos", "position_ids_sin",
                                  "conv_state_0_in", "recurrent_state_0_in", "conv_state_1_in", "recurrent_state_1_in",
                                  "conv_state_2_in", "recurrent_state_2_in", "past_key_3_in", "past_value_3_in"]
    assert list(first.outputs) == ["logits"] + [n.replace("_in", "_out") for n in list(first.inputs)[4:]]
    assert first.inputs["input_ids"].dtype == np.int32
    assert first.inputs["attention_mask"].shape == (1, 1, 4, 16)
    assert first.inputs["position_ids_cos"].shape == (1, 1, 4, cfg.rotary_dim // 2)
    assert first.inputs["past_key_3_in"].shape == (2, 1, 32, 12)
    assert first.inputs["past_value_3_in"].shape == (2, 1, 12, 32)
    assert first.outputs["past_key_3_out"].shape == (2, 1, 32, 4)
    assert first.inputs["conv_state_0_in"].shape == (1, 128, 4) == first.outputs["conv_state_0_out"].shape
    assert first.inputs["recurrent_state_0_in"].shape == (1, 4, 16, 16)
    assert token.inputs["input_ids"].shape == (1, 1) and token.inputs["attention_mask"].shape == (1, 1, 1, 16)
    # the padded first chunk: three pad rows are don't-care and see nothing (all at the floor), positions start at 0
    assert first.valid["logits"] == [[[0, 1], [3, 4], [0, cfg.vocab_size]]] and "logits" not in calls[1].valid or \
        calls[1].valid["logits"] == [[[0, 1], [0, 4], [0, cfg.vocab_size]]]
    assert first.inputs["attention_mask"].min() == -100.0
    np.testing.assert_array_equal(first.inputs["attention_mask"][0, 0, 3], [-100.0] * 15 + [0.0])
    np.testing.assert_array_equal(calls[1].inputs["attention_mask"][0, 0, 0], [-100.0] * 11 + [0.0] * 2 + [-100.0] * 3)
    assert calls[1].axes["past_key_3_in"] == "kvh,b,d,t" and calls[1].axes["recurrent_state_0_out"] == "b,hv,dk,dv"


def test_right_padding():
    """pad_side='right' (the Genie runtime): chunks from the prompt's start, the pads trail the last one; pad slots
    are masked for every row and take the last real position; the pads leave the GDN states untouched."""
    m = model("tiny-qwen3.5")
    opts = genie.Options(ar=4, cl=16, pad_side="right", decode_ar=2)
    calls = genie.run(m, [5, 6, 7, 8, 9], opts, decode_steps=1)
    eos = m.config.eos_token_id
    assert [c.inputs["input_ids"].tolist() for c in calls[:2]] == [[[5, 6, 7, 8]], [[9, eos, eos, eos]]]
    assert calls[2].inputs["input_ids"][0, 1] == eos and calls[2].graph == "token"
    assert calls[1].valid["logits"][0][1] == [0, 1] and calls[2].valid["logits"][0][1] == [0, 1]
    assert calls[1].valid["past_key_3_out"] == [[[0, 2], [0, 1], [0, 32], [0, 1]]]
    mask = calls[1].inputs["attention_mask"][0, 0]                  # W = 12 slots: 8 empty, 4 cached, then the chunk
    np.testing.assert_array_equal(mask[0], [-100.0] * 8 + [0.0] * 5 + [-100.0] * 3)
    assert (mask[1:, 13:] == -100).all()                            # pad slots are masked for every row
    left = genie.run(m, [5, 6, 7, 8, 9], genie.Options(ar=4, cl=16, pad_side="left", decode_ar=2), decode_steps=1)
    np.testing.assert_array_equal(calls[1].inputs["position_ids_cos"][0, 0, 1:],     # pads: the last real position
                                  np.repeat(calls[1].inputs["position_ids_cos"][0, 0, :1], 3, axis=0))
    for i in (0, 1, 2):   # the same real tokens give the same states, whichever side the pads sit on
        for state in ("recurrent_state", "conv_state"):   # float64: other chunkings round differently
            np.testing.assert_allclose(calls[-1].outputs[f"{state}_{i}_out"], left[-1].outputs[f"{state}_{i}_out"],
                                       atol=1e-12)
    np.testing.assert_allclose(calls[-1].outputs["logits"][0, 0], left[-1].outputs["logits"][0, -1], atol=1e-10)


def test_tap_valid_regions_mark_pad_rows():
    m = model("tiny-qwen3.5")
    calls = genie.run(m, [5, 6, 7, 8, 9], genie.Options(ar=4, cl=16, pad_side="right"), taps=".")
    padded = calls[1]  # [9, pad, pad, pad] after 4 cached tokens
    assert padded.valid["model.layers.0.linear_attn.core"] == [[[0, 1], [0, 1], [0, 4], [0, 16]]]
    assert padded.valid["model.layers.3.self_attn.attn_probs"] == [[[0, 1], [0, 4], [0, 1], [0, 16]]]
    assert "model.layers.0.linear_attn.recurrent_state" not in padded.valid   # states: all valid
    assert padded.valid["past_key_3_in"] == [[[0, 2], [0, 1], [0, 32], [8, 12]]]  # 4 cached of 12 window slots
    # scores: only the slots each real query row may attend (4 cached, itself); masked slots hold the floor
    assert padded.valid["model.layers.3.self_attn.attn_scores"] == [[[0, 1], [0, 4], [0, 1], [8, 13]]]
    assert not any(k.startswith("model.") and not k.endswith("attn_scores") for k in calls[0].valid)  # full chunk
    assert calls[0].valid["model.layers.3.self_attn.attn_scores"][0] == [[0, 1], [0, 4], [0, 1], [12, 13]]
    assert not padded.taps["model.layers.0.linear_attn.core"][0, 1:].any()   # pad rows of GDN taps are zeros


@pytest.mark.parametrize("opts,message", [
    (genie.Options(ar=4, cl=8), "too small"),
    (genie.Options(ar=8, cl=8), "smaller than CL"),
    (genie.Options(ar=4, cl=16, kv_output="full"), "kv_output"),
    (genie.Options(ar=4, cl=16, pad_id=-1), "pad_id -1"),
    (genie.Options(ar=4, cl=16, mask_floor=5.0), "mask_floor"),
    (genie.Options(ar=4, cl=16, pad_side="middle"), "pad_side"),
    (genie.Options(ar=4, cl=16, conv_state_len=2), "conv_state_len applies to hybrid"),
    (genie.Options(ar=4, cl=30), "CL 30 is not a multiple of the AR 4 .*allowed nearby: 28 or 32"),
    (genie.Options(ar=4, cl=32, decode_ar=3), "CL 32 is not a multiple of the decode AR 3 .*allowed nearby: 30 or 33"),
    (genie.Options(ar=4, cl=32, decode_ar=8), r"token graph's AR \(decode_ar 8\) exceeds the prompt graph's \(4\); "
                                               "allowed: 1 to 4"),
    (genie.Options(ar=4, cl=2**20), "CL 1048576 exceeds the model's context"),
    (genie.Options(ar=4, cl=16, mask_floor=-float("inf")), "mask_floor must be a finite negative number"),
])
def test_bad_options(opts, message):
    with pytest.raises(InputError, match=message):
        genie.run(model("tiny-qwen3"), list(range(1, 11)), opts, decode_steps=0)


def test_window_output_valid_boxes_skip_the_pads():
    """kv_output='window': the output window is [empty | cached | new real | pads]; only cached and new are valid."""
    m = model("tiny-qwen3")
    calls = genie.run(m, list(range(1, 7)), genie.Options(ar=4, cl=16, kv_output="window", pad_side="right"))
    second = calls[1]  # cur = 4 cached, n = 2 new, p = 2 pads; W = 12
    assert second.valid["past_value_0_out"] == [[[0, 2], [0, 1], [4, 8], [0, 32]], [[0, 2], [0, 1], [8, 10], [0, 32]]]
    window = second.outputs["past_value_0_out"][:, 0]
    np.testing.assert_array_equal(window[:, 4:8], calls[0].outputs["past_value_0_out"][:, 0][:, 8:12])


@pytest.mark.parametrize("run,opts", [(genie.run, genie.Options(ar=4, cl=16)),
                                      (qeff.run, qeff.Options(seq_len=4, ctx_len=16))])
def test_prompt_and_pad_id_checks(run, opts):
    m = model("tiny-qwen3")
    with pytest.raises(InputError, match="one non-empty sequence"):
        run(m, [[1, 2], [3, 4]], opts)
    with pytest.raises(InputError, match="pad.id 999999 is outside the vocabulary"):
        run(m, [1, 2, 3], dataclasses.replace(opts, pad_id=999999))


def test_window_output_needs_room():
    # CL a multiple of AR (issue 19) implies the window holds a call's new entries (CL - AR >= AR): the options
    # that lack the room are refused by that check first
    with pytest.raises(InputError, match="not a multiple of the AR 8"):
        genie.run(model("tiny-qwen3"), [1, 2], genie.Options(ar=8, cl=12, kv_output="window"))
