"""Cached decoding equals full recomputation; left padding equals the unpadded row."""

import numpy as np
import pytest

import refimpl
from refimpl.errors import InputError
from refimpl.models.config import config_from_dict
from refimpl.models.model import Model
from refimpl.models.weights import Weights
from refimpl.presets import PRESETS, random_weights

# HF-like scale (logits of order 1), where 1e-5 absolute is a meaningful float32 bound
SMALL = dict(model_type="qwen3", vocab_size=101, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=48, rope_parameters={"rope_theta": 1e4})


def small_model(dtype="float32", **overrides):
    cfg = config_from_dict({**SMALL, **overrides})
    arrays = random_weights(cfg, seed=3)
    arrays = {k: (v * 0.3 if v.ndim == 2 else v) for k, v in arrays.items()}
    return Model(cfg, Weights(arrays, dtype=dtype))


@pytest.mark.parametrize("overrides", [{}, {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
                                       {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                            "original_max_position_embeddings": 8}}])
def test_prefill_then_decode_equals_full_forward(overrides):
    model = small_model(**overrides)
    ids = np.random.default_rng(0).integers(0, 101, size=(1, 20))
    full = model.forward(ids)
    cache = model.new_cache()
    steps = [model.forward(ids[:, :12], cache=cache)] + [model.forward(ids[:, t:t + 1], cache=cache)
                                                          for t in range(12, 20)]
    assert cache.seq_length == 20
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_any_chunking_equals_one_call_float64(preset):
    model = refimpl.load(preset, dtype="float64")
    ids = np.random.default_rng(1).integers(0, 151936, size=(2, 11))
    full = model.forward(ids)
    for cuts in ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [5], [3, 9], [10]):
        cache = model.new_cache(batch_size=2)
        bounds = [0, *cuts, 11]
        parts = [model.forward(ids[:, a:b], cache=cache) for a, b in zip(bounds, bounds[1:])]
        np.testing.assert_allclose(np.concatenate(parts, axis=1), full, atol=1e-11, rtol=0)


def test_presets_decode_close_in_float32():
    model = refimpl.load("tiny-qwen3-moe")
    ids = np.random.default_rng(2).integers(0, 151936, size=(1, 9))
    full = model.forward(ids)
    cache = model.new_cache()
    parts = [model.forward(ids[:, :5], cache=cache)] + [model.forward(ids[:, t:t + 1], cache=cache)
                                                        for t in range(5, 9)]
    got = np.concatenate(parts, axis=1)
    # preset logits reach ~40: a few float32 ulps of the largest logit
    assert np.abs(got - full).max() <= 8 * np.finfo(np.float32).eps * np.abs(full).max()


def test_left_padded_rows_equal_unpadded_rows():
    model = small_model(dtype="float64")
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 101, size=(2, 10))
    mask = np.ones_like(ids)
    mask[0, :4] = 0
    out = model.forward(ids, attention_mask=mask)
    np.testing.assert_allclose(out[0, 4:], model.forward(ids[:1, 4:])[0], atol=1e-12)
    np.testing.assert_allclose(out[1], model.forward(ids[1:])[0], atol=1e-12)
    # continue the padded batch with a cache: positions carry on from each row's own count
    cache = model.new_cache(batch_size=2)
    model.forward(ids, attention_mask=mask, cache=cache)
    nxt = rng.integers(0, 101, size=(2, 1))
    step = model.forward(nxt, cache=cache)
    np.testing.assert_allclose(step[0, 0], model.forward(np.concatenate([ids[:1, 4:], nxt[:1]], 1))[0, -1], atol=1e-12)


def test_explicit_position_ids_override_the_mask_default():
    model = small_model(dtype="float64")
    ids = np.arange(1, 7)[None]
    uniform = model.forward(ids, position_ids=np.arange(100, 106)[None])
    np.testing.assert_allclose(uniform, model.forward(ids), atol=1e-10)  # RoPE sees only differences
    gapped = model.forward(ids, position_ids=np.array([[0, 1, 2, 10, 11, 12]]))
    np.testing.assert_allclose(gapped[:, :3], model.forward(ids)[:, :3], atol=1e-12)
    assert np.abs(gapped[:, 3:] - model.forward(ids)[:, 3:]).max() > 1e-3


def test_dynamic_rope_state_lives_in_the_cache():
    """transformers grows dynamic-NTK frequencies once a sequence passes max_position_embeddings and keeps them."""
    model = small_model(dtype="float64", max_position_embeddings=8,
                        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    cache = model.new_cache()
    ids = np.arange(1, 13)[None]
    model.forward(ids[:, :10], cache=cache)
    assert cache.rope_max_seq_len == 10
    model.forward(ids[:, 10:11], cache=cache)
    assert cache.rope_max_seq_len == 11


def test_bad_forward_inputs_raise_input_error():
    model = small_model()
    with pytest.raises(InputError, match="outside the vocabulary"):
        model.forward(np.array([[1, 500]]))
    with pytest.raises(InputError, match="attention_mask has shape"):
        model.forward(np.array([[1, 2]]), attention_mask=np.ones((1, 3)))
    with pytest.raises(InputError, match="integer"):
        model.forward(np.array([[0.5, 1.0]]))
    with pytest.raises(InputError, match="batch size"):
        model.forward(np.array([[1, 2]]), cache=model.new_cache(batch_size=2))


def test_float64_mirror_gives_the_same_bits_and_tracks_the_cache(monkeypatch):
    """A cache with float64 copies and norms (Model.new_cache over kept float64 weights) decodes the same bits as
    one without; its norms are the keys' and the value columns' over every appended position, also after the
    buffers grow (256 positions) and after select(); attention reads them only where it reads the cache as is."""
    from refimpl.kernels import products
    from refimpl.models.cache import Cache
    model = small_model()
    assert model.weights.float64_copies_planned()
    ids = np.random.default_rng(4).integers(0, 101, size=(2, 300))
    plain, mirrored = Cache(3, 2), model.new_cache(batch_size=2)
    assert mirrored.float64_mirror and not plain.float64_mirror
    taken, operands = [], Cache.operands                                  # which operands attention was given

    def spy(self, *args):
        out = operands(self, *args)
        taken.append((self is mirrored, all(isinstance(x, products.Constant) for x in out)))
        return out

    monkeypatch.setattr(Cache, "operands", spy)
    for a, b in [(0, 250), (250, 251), (251, 260), (260, 261)]:
        want, got = (model.forward(ids[:, a:b], cache=c) for c in (plain, mirrored))
        assert np.array_equal(want.view(np.int32), got.view(np.int32))
    mirrored.select([1]), plain.select([1])
    for t in range(261, 264):
        want, got = (model.forward(ids[1:, t:t + 1], cache=c) for c in (plain, mirrored))
        assert np.array_equal(want.view(np.int32), got.view(np.int32))
    assert set(taken) == {(True, True), (False, False)}                   # every mirrored read, none of the plain
    kv = mirrored.layers[0]
    m = kv.float64
    assert kv.key_buffer.shape[2] > 256 and m is not None and plain.layers[0].float64 is None
    k64, v64 = kv.keys.astype(np.float64), kv.values.astype(np.float64)
    np.testing.assert_allclose(m.key_norms[:, :, :kv.length], np.sqrt((k64 ** 2).sum(-1)), rtol=1e-14)
    np.testing.assert_allclose(m.value_squares, (v64 ** 2).sum(2), rtol=1e-13)
    keys_t, values = mirrored.operands(0, *m.views)                        # the views the last append returned
    assert isinstance(keys_t, products.Constant) and isinstance(values, products.Constant)
    assert np.array_equal(keys_t.b64, k64[:, :, None].swapaxes(-1, -2)) and np.array_equal(values.b64, v64[:, :, None])
    changed = kv.keys * np.float32(0.5)                                    # a prescaled copy: the arrays as they are
    for k, v in ((changed, m.views[1]), (kv.keys, kv.values)):             # a changed copy; other views alike
        got_k, got_v = mirrored.operands(0, k, v)
        assert got_k is k and got_v is v


def test_float64_mirror_dropped_beyond_its_room():
    """Mirrors that would outgrow the room they are given are dropped (every layer's), and decoding goes on with
    the same bits; Model.new_cache gives the budget's room beside the weights and their float64 copies."""
    from refimpl.models.cache import Cache
    model = small_model()
    assert model.new_cache().float64_mirror == model.weights.float64_room() > 0
    ids = np.random.default_rng(5).integers(0, 101, size=(2, 12))
    plain, tight = Cache(3, 2), Cache(3, 2, float64_mirror=2**19)           # a layer's mirror: 256 KiB
    for a, b in [(0, 10), (10, 11), (11, 12)]:
        want, got = (model.forward(ids[:, a:b], cache=c) for c in (plain, tight))
        assert np.array_equal(want.view(np.int32), got.view(np.int32))
    assert tight.float64_mirror == 0 and all(kv.float64 is None for kv in tight.layers)
