"""Trace taps: names follow the module tree, values are the real intermediates, nothing when not tracing."""

import numpy as np

import refimpl
from refimpl.kernels.norm import rms_norm
from refimpl.trace import tracing


def test_taps_are_the_intermediates():
    model = refimpl.load("tiny-qwen3", dtype="float64")
    ids = np.array([[3, 1, 4, 1, 5]])
    with refimpl.trace() as tr:
        logits = model.forward(ids)
    np.testing.assert_array_equal(tr["lm_head"], logits)
    w = model.weights
    np.testing.assert_array_equal(tr["model.embed_tokens"], w["model.embed_tokens.weight"][ids])
    # the layer-0 input norm is the norm of the embeddings; block output = residual + mlp
    np.testing.assert_allclose(tr["model.layers.0.input_layernorm"],
                               rms_norm(tr["model.embed_tokens"], w["model.layers.0.input_layernorm.weight"], 1e-6))
    np.testing.assert_allclose(tr["model.layers.0"],
                               tr["model.layers.0.attn_residual"] + tr["model.layers.0.mlp.down_proj"])
    probs = tr["model.layers.1.self_attn.attn_probs"]
    assert probs.shape == (1, 4, 5, 5)
    np.testing.assert_allclose(probs.sum(-1), 1)
    assert np.all(np.triu(probs[0, 0], 1) == 0)  # causal
    names = tr.names()
    assert names[0] == "model.embed_tokens" and names[-2:] == ["model.norm", "lm_head"]
    assert names.index("model.layers.0.self_attn.q_norm") < names.index("model.layers.0.self_attn.q_rope")


def test_moe_taps_and_pattern_filter():
    model = refimpl.load("tiny-qwen3-moe")
    with refimpl.trace(r"\.mlp\.(selected_experts|routing_weights)$") as tr:
        model.forward(np.array([[7, 8, 9]]))
    assert set(tr.names()) == {f"model.layers.{i}.mlp.{k}" for i in range(4)
                               for k in ("selected_experts", "routing_weights")}
    np.testing.assert_allclose(tr["model.layers.2.mlp.routing_weights"].sum(-1), 1, rtol=1e-6)
    assert tr["model.layers.2.mlp.selected_experts"].shape == (1, 3, 2)


def test_nothing_recorded_outside_a_trace():
    model = refimpl.load("tiny-qwen3")
    with refimpl.trace() as tr:
        pass
    model.forward(np.array([[1, 2]]))
    assert len(tr) == 0 and not tracing()


def test_trace_over_several_calls_keeps_every_call():
    model = refimpl.load("tiny-qwen3")
    cache = model.new_cache()
    with refimpl.trace("^lm_head$") as tr:
        model.forward(np.array([[1, 2]]), cache=cache)
        model.forward(np.array([[3]]), cache=cache)
    assert [v.shape[1] for v in tr.all("lm_head")] == [2, 1]
