"""Weights.matrix: the products' constants (column norms, float64 copies) kept with each weight change no bit of
a forward pass, whether copies are kept, refused, or the model is streamed; `drop` forgets them with the converted
tensors."""

import numpy as np

import refimpl
from refimpl.models import weights as W


def run(model, steps=2):
    """Prefill three tokens, then `steps` cached one-token steps: every logit, concatenated."""
    cache = model.new_cache()
    out = [model.forward(np.array([[3, 17, 42]]), cache=cache)]
    for t in range(steps):
        out.append(model.forward(np.array([[5 + t]]), cache=cache))
    return np.concatenate([o[0] for o in out])


def test_float64_copies_and_norms_change_no_bits(monkeypatch):
    monkeypatch.setattr(W, "VECTOR_BLOCK_BYTES", 2**14)      # lm_head in several row blocks for one token
    plain = refimpl.load("tiny-qwen3")
    plain.weights.float64_copies = False
    want = run(plain)
    assert plain.weights.float64_nbytes == 0 and "float64_copies is off" in plain.weights.residency()
    copies = refimpl.load("tiny-qwen3")
    assert copies.weights.float64_copies_planned() and "float64 copies" in copies.weights.residency()
    got = run(copies)
    assert np.array_equal(got.view(np.int32), want.view(np.int32))
    assert copies.weights.float64_nbytes == copies.weights.float64_copies_nbytes()   # one copy of each matrix
    streamed = refimpl.load("tiny-qwen3", max_resident_bytes=2 * copies.weights.plan()[1])
    assert not streamed.weights.float64_copies_planned()
    assert np.array_equal(run(streamed).view(np.int32), want.view(np.int32))
    assert streamed.weights.float64_nbytes == 0


def test_a_replaced_tensor_gets_new_constants_after_drop():
    model = refimpl.load("tiny-qwen3")
    run(model, steps=0)                                          # constants made
    name = "model.layers.0.mlp.down_proj.weight"
    model.weights.stored[name] = model.weights.stored[name] * np.float32(4)
    model.weights.drop()
    assert model.weights.float64_nbytes == 0
    fresh = refimpl.load("tiny-qwen3")
    fresh.weights.stored[name] = model.weights.stored[name]
    assert np.array_equal(run(model).view(np.int32), run(fresh).view(np.int32))
