"""Hybrid models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): cached decoding, states, padding, checkpoints, errors."""

import json
import shutil

import numpy as np
import pytest

import refimpl
from helpers import scaled
from refimpl.cli import main
from refimpl.errors import ConfigError, WeightsError
from refimpl.formats.safetensors import read_safetensors, write_safetensors
from refimpl.presets import save_preset

HYBRIDS = ["tiny-qwen3-next", "tiny-qwen3.5", "tiny-qwen3.5-moe"]


def _states(cache):
    return [(layer.conv, layer.recurrent) for layer in cache.layers if hasattr(layer, "recurrent")]


@pytest.mark.parametrize("name", HYBRIDS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_prefill_then_decode_equals_one_forward(name, dtype):
    """float64: <= 1e-12 absolute. float32: <= 1e-5 of the largest logit (measured 4e-6..8.4e-6: the decode
    steps run the recurrent form, the single forward the chunked one, as in transformers)."""
    model = scaled(name, dtype)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, size=(2, 75))
    whole = model.new_cache(batch_size=2)
    full = model.forward(ids, cache=whole)
    tol = 1e-12 if dtype == "float64" else 1e-5 * float(np.abs(full).max())
    cache = model.new_cache(batch_size=2)
    parts = [model.forward(ids[:, :67], cache=cache)] + [model.forward(ids[:, t:t + 1], cache=cache)
                                                          for t in range(67, 75)]
    np.testing.assert_allclose(np.concatenate(parts, axis=1), full, atol=tol, rtol=0)
    for (conv_a, rec_a), (conv_b, rec_b) in zip(_states(cache), _states(whole)):
        np.testing.assert_allclose(conv_a, conv_b, atol=tol, rtol=0)
        np.testing.assert_allclose(rec_a, rec_b, atol=tol, rtol=0)
    if dtype == "float32":
        return
    # a multi-token continuation sees the cached conv window and state too (a semantic check: float64)
    cont = model.new_cache(batch_size=2)
    split = [model.forward(ids[:, :30], cache=cont), model.forward(ids[:, 30:], cache=cont)]
    np.testing.assert_allclose(np.concatenate(split, axis=1), full, atol=tol, rtol=0)


@pytest.mark.parametrize("name", HYBRIDS)
def test_conv_state_holds_the_last_kc_raw_inputs(name):
    model = refimpl.load(name, dtype="float64")
    cache = model.new_cache()
    ids = np.array([[5, 6, 7, 8, 9, 10]])
    with refimpl.trace(r"layers\.0\.linear_attn\.mixed_qkv$") as tr:
        model.forward(ids, cache=cache)
    Kc = model.config.linear_conv_kernel_dim
    mixed = tr["model.layers.0.linear_attn.mixed_qkv"]                     # [1, T, conv_dim]
    np.testing.assert_array_equal(cache.layers[0].conv, mixed[:, -Kc:].transpose(0, 2, 1))
    assert cache.layers[0].recurrent.shape == (1, model.config.linear_num_value_heads,
                                               model.config.linear_key_head_dim, model.config.linear_value_head_dim)


@pytest.mark.parametrize("name", HYBRIDS)
def test_pad_steps_are_identities_on_the_state(name):
    model = refimpl.load(name, dtype="float64")
    rng = np.random.default_rng(3)
    ids = rng.integers(0, model.config.vocab_size, size=(2, 12))
    mask = np.ones_like(ids)
    mask[0, :5] = 0
    padded = model.new_cache(batch_size=2)
    out = model.forward(ids, attention_mask=mask, cache=padded)
    alone = model.new_cache()
    ref = model.forward(ids[:1, 5:], cache=alone)
    np.testing.assert_allclose(out[0, 5:], ref[0], atol=1e-12)
    for (conv_p, rec_p), (conv_a, rec_a) in zip(_states(padded), _states(alone)):
        np.testing.assert_allclose(conv_p[:1], conv_a, atol=1e-13, rtol=0)
        np.testing.assert_allclose(rec_p[:1], rec_a, atol=1e-13, rtol=0)
    # and decoding on from the padded batch continues row 0 exactly as the unpadded run
    nxt = rng.integers(0, model.config.vocab_size, size=(2, 1))
    np.testing.assert_allclose(model.forward(nxt, cache=padded)[0], model.forward(nxt[:1], cache=alone)[0],
                               atol=1e-12)


def test_pads_between_chunks_do_not_touch_the_state():
    """A left-padded chunk after earlier tokens (the static-graph case) equals the unpadded continuation."""
    model = refimpl.load("tiny-qwen3.5", dtype="float64")
    rng = np.random.default_rng(4)
    first, second = rng.integers(0, 248320, size=(1, 7)), rng.integers(0, 248320, size=(1, 3))
    a = model.new_cache()
    model.forward(first, cache=a)
    chunk = np.concatenate([np.zeros((1, 4), np.int64), second], axis=1)
    padded = model.forward(chunk, cache=a, attention_mask=np.array([[0, 0, 0, 0, 1, 1, 1]]))
    b = model.new_cache()
    model.forward(first, cache=b)
    plain = model.forward(second, cache=b)
    np.testing.assert_allclose(padded[:, 4:], plain, atol=1e-12)
    for (conv_p, rec_p), (conv_b, rec_b) in zip(_states(a), _states(b)):
        np.testing.assert_allclose(conv_p, conv_b, atol=1e-13, rtol=0)
        np.testing.assert_allclose(rec_p, rec_b, atol=1e-13, rtol=0)


@pytest.mark.parametrize("name", HYBRIDS)
def test_traced_linear_attention_taps(name):
    model = refimpl.load(name)
    with refimpl.trace(r"^model\.layers\.0\.linear_attn\.") as tr:
        model.forward(np.array([[1, 2, 3]]))
    p = "model.layers.0.linear_attn."
    for what in ("mixed_qkv", "conv1d", "q", "k", "v", "z", "beta", "g", "core", "norm", "out_proj",
                 "conv_state", "recurrent_state"):
        assert p + what in tr, what
    np.testing.assert_allclose(np.linalg.norm(tr[p + "q"], axis=-1), 1, atol=1e-5)  # after l2norm
    assert (tr[p + "g"] < 0).all() and ((tr[p + "beta"] > 0) & (tr[p + "beta"] < 1)).all()


def test_multimodal_wrapper_checkpoint_with_mtp(tmp_path):
    """Qwen3.5 checkpoints: text_config nesting, `model.language_model.` prefix, `mtp.*` set aside."""
    src = save_preset("tiny-qwen3.5", tmp_path / "text")
    wrapped = tmp_path / "wrapped"
    wrapped.mkdir()
    text = json.loads((src / "config.json").read_text())
    (wrapped / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "tie_word_embeddings": True,
                                                     "text_config": {**text, "mtp_num_hidden_layers": 1},
                                                     "vision_config": {"depth": 1}}))
    arrays = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): np.array(v)
              for k, v in read_safetensors(src / "model.safetensors").items()}
    arrays["mtp.layers.0.input_layernorm.weight"] = np.zeros(64, np.float32)
    arrays["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)
    write_safetensors(wrapped / "model.safetensors", arrays)
    model = refimpl.load(wrapped)
    assert model.config.model_type == "qwen3_5_text" and model.config.mtp_layers == 1
    assert sorted(model.weights.set_aside) == ["model.visual.patch_embed.proj.weight",
                                               "mtp.layers.0.input_layernorm.weight"]
    ids = np.array([[1, 2, 3]])
    np.testing.assert_array_equal(model.forward(ids), refimpl.load(src).forward(ids))


def test_info_notes_mtp(tmp_path, capsys):
    src = save_preset("tiny-qwen3-next", tmp_path / "next")
    arrays = {k: np.array(v) for k, v in read_safetensors(src / "model.safetensors").items()}
    arrays["mtp.fc.weight"] = np.zeros((2, 2), np.float32)
    write_safetensors(src / "model.safetensors", arrays)
    assert main(["info", str(src)]) == 0
    out = capsys.readouterr().out
    assert "1 tensors set aside (multi-token prediction" in out and "3 linear_attention, 1 full_attention" in out


# ---- bad input ----

def _broken(tmp_path, name, edit=None, config_edit=None):
    src = save_preset(name, tmp_path / "src")
    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    if edit:
        arrays = {k: np.array(v) for k, v in read_safetensors(dst / "model.safetensors").items()}
        edit(arrays)
        write_safetensors(dst / "model.safetensors", arrays)
    if config_edit:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_missing_a_log(tmp_path):
    bad = _broken(tmp_path, "tiny-qwen3.5", edit=lambda a: a.pop("model.layers.1.linear_attn.A_log"))
    with pytest.raises(WeightsError, match=r"bad: missing tensor 'model.layers.1.linear_attn.A_log' "
                                           r"\(expected shape \[4\]\)"):
        refimpl.load(bad)


def test_conv_weight_of_wrong_shape(tmp_path):
    bad = _broken(tmp_path, "tiny-qwen3-next", edit=lambda a: a.update(
        {"model.layers.0.linear_attn.conv1d.weight": np.zeros((128, 1, 3), np.float32)}))
    with pytest.raises(WeightsError, match=r"'model.layers.0.linear_attn.conv1d.weight' has shape \[128, 1, 3\], "
                                           r"expected \[128, 1, 4\]"):
        refimpl.load(bad)


def test_layer_types_length(tmp_path):
    bad = _broken(tmp_path, "tiny-qwen3.5-moe", config_edit=lambda c: c.update(
        layer_types=["linear_attention", "full_attention"]))
    with pytest.raises(ConfigError, match="layer_types has 2 entries, num_hidden_layers is 4"):
        refimpl.load(bad)


def test_value_heads_not_a_multiple_of_key_heads(tmp_path):
    bad = _broken(tmp_path, "tiny-qwen3.5", config_edit=lambda c: c.update(linear_num_value_heads=3))
    with pytest.raises(ConfigError, match="linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"):
        refimpl.load(bad)


def test_all_rows_padding_on_the_first_call_and_padded_taps():
    model = refimpl.load("tiny-qwen3.5", dtype="float64")
    cache = model.new_cache(batch_size=2)
    ids = np.array([[0, 0, 0], [0, 0, 0]])
    model.forward(ids, attention_mask=np.zeros((2, 3), np.int64), cache=cache)
    assert not cache.layers[0].recurrent.any() and not cache.layers[0].conv.any()
    ids = np.array([[0, 0, 5, 6], [7, 8, 9, 10]])
    with refimpl.trace(r"layers\.0\.linear_attn\.in_proj_qkv$") as tr:
        model.forward(ids, attention_mask=np.array([[0, 0, 1, 1], [1, 1, 1, 1]]))
    qkv = tr["model.layers.0.linear_attn.in_proj_qkv"]
    assert qkv.shape[:2] == (2, 4) and not qkv[0, :2].any() and qkv[1].all()


def test_bad_position_ids():
    model = refimpl.load("tiny-qwen3")
    for bad in (np.arange(4)[None], np.array([[0.5, 1.5, 2.5]]), np.array([[-1, 0, 1]])):
        with pytest.raises(refimpl.errors.InputError, match="position_ids must be"):
            model.forward(np.array([[1, 2, 3]]), position_ids=bad)
    with pytest.raises(refimpl.errors.InputError, match="batch_size"):
        model.new_cache(batch_size=0)
