"""MoE routing and mixing: models.md §3.6. Properties in float64 (and float32 where bits matter); parity with
transformers' Qwen3MoeTopKRouter and eager Qwen3MoeExperts in float32 (oracle)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.kernels.linear import linear
from refimpl.kernels.moe import mix_experts, route


def softmax64(a):
    e = np.exp(a - a.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@st.composite
def router_logits(draw, dtype=np.float64, ties=False):
    """logits [N, E] and k <= E; with ties, values come from a few integers so equal probabilities are common."""
    N, E = draw(st.integers(1, 8)), draw(st.integers(1, 16))
    k = draw(st.integers(1, E))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    logits = rng.integers(-2, 3, (N, E)) if ties else rng.normal(0, draw(st.sampled_from([0.1, 1.0, 30.0])), (N, E))
    return logits.astype(dtype), k


@settings(max_examples=60, deadline=None)
@given(t=router_logits())
def test_renormalised_weights_are_the_softmax_over_the_top_k_logits(t):
    logits, k = t
    probs, weights, experts = route(logits, k, renormalize=True)
    assert weights.shape == experts.shape == (logits.shape[0], k) and experts.dtype == np.int64
    assert np.max(np.abs(weights.sum(-1) - 1)) <= 1e-15 * k
    np.testing.assert_allclose(weights, softmax64(np.take_along_axis(logits, experts, axis=-1)), rtol=1e-14,
                               atol=1e-300)


@settings(max_examples=60, deadline=None)
@given(t=router_logits())
def test_unrenormalised_weights_are_the_top_k_of_the_full_softmax(t):
    logits, k = t
    probs, weights, experts = route(logits, k, renormalize=False)
    np.testing.assert_allclose(probs, softmax64(logits), rtol=1e-14, atol=1e-300)
    np.testing.assert_allclose(weights, np.take_along_axis(softmax64(logits), experts, axis=-1), rtol=1e-14,
                               atol=1e-300)
    assert np.all(weights.sum(-1) <= 1 + 1e-15)


@settings(max_examples=60, deadline=None)
@given(t=router_logits() | router_logits(ties=True), renormalize=st.booleans())
def test_experts_are_the_top_k_by_probability_in_descending_order(t, renormalize):
    logits, k = t
    probs, weights, experts = route(logits, k, renormalize)
    N, E = logits.shape
    for n in range(N):
        chosen = experts[n]
        assert len(set(chosen)) == k and np.all((0 <= chosen) & (chosen < E))
        rest = np.setdiff1d(np.arange(E), chosen)
        assert rest.size == 0 or probs[n, chosen].min() >= probs[n, rest].max()
        assert np.all(np.diff(probs[n, chosen]) <= 0) and np.all(np.diff(weights[n]) <= 0)


@settings(max_examples=60, deadline=None)
@given(t=router_logits(ties=True), renormalize=st.booleans())
def test_exact_ties_go_to_the_lower_expert_id(t, renormalize):
    """Selection and order are the lexicographic sort by (-probability, expert id)."""
    logits, k = t
    probs, _, experts = route(logits, k, renormalize)
    for n in range(logits.shape[0]):
        assert list(experts[n]) == list(np.lexsort((np.arange(logits.shape[1]), -probs[n]))[:k])
    tied = np.zeros((1, 6))
    assert list(route(tied, 3, renormalize)[2][0]) == [0, 1, 2]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_router_dtypes(dtype):
    """Softmax and renormalisation in at least float32; weights cast back to the logits dtype."""
    logits = np.random.default_rng(0).normal(0, 3, (5, 8)).astype(dtype)
    probs, weights, experts = route(logits, 2, True)
    assert probs.dtype == np.result_type(np.float32, dtype) and weights.dtype == dtype
    p32 = softmax64(logits.astype(np.float64))
    w = np.take_along_axis(p32, experts, -1)
    np.testing.assert_allclose(weights.astype(np.float64), w / w.sum(-1, keepdims=True),
                               rtol=float(np.finfo(dtype).eps), atol=0)


def swiglu_experts(rng, E, H, I, dtype=np.float64):
    gate, up = rng.standard_normal((2, E, I, H)).astype(dtype) / np.sqrt(H)
    down = rng.standard_normal((E, H, I)).astype(dtype) / np.sqrt(I)

    def expert_fn(e, xe):
        g, u = xe @ gate[e].T, xe @ up[e].T
        return (g / (1 + np.exp(-g)) * u) @ down[e].T

    return expert_fn, (gate, up, down)


@settings(max_examples=40, deadline=None)
@given(t=router_logits(), H=st.integers(1, 8), renormalize=st.booleans())
def test_mix_equals_the_dense_sum_over_all_experts(t, H, renormalize):
    """out[n] = sum_e W[n, e] * expert_e(x[n]) with W the dense [N, E] routing matrix (0 for unchosen experts)."""
    logits, k = t
    N, E = logits.shape
    rng = np.random.default_rng(N * 100 + E * 10 + H)
    x = rng.standard_normal((N, H))
    expert_fn, _ = swiglu_experts(rng, E, H, 5)
    _, weights, experts = route(logits, k, renormalize)
    dense = np.zeros((N, E))
    np.put_along_axis(dense, experts, weights, axis=-1)
    reference = sum(dense[:, e:e + 1] * expert_fn(e, x) for e in range(E))
    out = mix_experts(x, experts, weights, expert_fn)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert np.max(np.abs(out - reference)) <= 1e-13 * (1 + np.abs(reference).max())


@settings(max_examples=40, deadline=None)
@given(t=router_logits(dtype=np.float32), H=st.integers(1, 8))
def test_mix_calls_each_chosen_expert_once_in_ascending_id_and_adds_in_that_order(t, H):
    """Each chosen expert runs once on its tokens (ascending token order); the float32 sum is bit-identical to adding
    w * expert_e(x) into zeros in ascending expert id (not top-k rank order)."""
    logits, k = t
    N, E = logits.shape
    rng = np.random.default_rng(N * 100 + E * 10 + H)
    x = rng.standard_normal((N, H)).astype(np.float32)
    expert_fn, _ = swiglu_experts(rng, E, H, 5, np.float32)
    _, weights, experts = route(logits, k, True)
    calls = []

    def recording(e, xe):
        calls.append((e, xe.copy()))
        return expert_fn(e, xe)

    out = mix_experts(x, experts, weights, recording)
    assert [e for e, _ in calls] == sorted(set(experts.ravel().tolist()))
    expect = np.zeros_like(x)
    for e, xe in calls:
        tokens = np.nonzero((experts == e).any(-1))[0]
        assert np.array_equal(xe, x[tokens])
        w = weights[tokens][experts[tokens] == e]
        expect[tokens] += expert_fn(e, x[tokens]) * w[:, None]
    assert np.array_equal(out, expect)


def test_accumulation_order_is_visible_in_float32():
    """Expert outputs 1, 1e8, -1e8 for experts 0, 1, 2, ranked [2, 1, 0] by the router. Ascending id:
    ((0 + 1) + 1e8) - 1e8 = 0 in float32 (the 1 is absorbed); rank order: ((0 - 1e8) + 1e8) + 1 = 1."""
    x = np.ones((1, 1), np.float32)
    outputs = {0: 1.0, 1: 1e8, 2: -1e8}
    expert_fn = lambda e, xe: np.full_like(xe, outputs[e])  # noqa: E731
    out = mix_experts(x, np.array([[2, 1, 0]]), np.ones((1, 3), np.float32), expert_fn)
    f = np.float32
    ascending, rank = ((f(0) + f(1)) + f(1e8)) + f(-1e8), ((f(0) + f(-1e8)) + f(1e8)) + f(1)
    assert (ascending, rank) == (0, 1) and out[0, 0] == ascending


# ---------------------------------------------------------------- parity with transformers (float32)

def _moe_config(E, k, H, I, norm_topk_prob):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                                         num_experts_per_tok=k, norm_topk_prob=norm_topk_prob, hidden_act="silu")
    config._experts_implementation = "eager"  # §0.2: the v5 default may dispatch to grouped_mm
    return config


@pytest.mark.oracle
@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("E,k", [(8, 2), (16, 4), (5, 5), (64, 8)])
def test_oracle_route_equals_qwen3_moe_top_k_router(norm_topk_prob, E, k):
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    H = 32
    router = Qwen3MoeTopKRouter(_moe_config(E, k, H, 8, norm_topk_prob))
    gen = torch.Generator().manual_seed(E * 10 + k)
    x = torch.randn(3, 7, H, generator=gen)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=gen))
        hf_logits, hf_weights, hf_experts = router(x)
    logits = linear(x.numpy().reshape(-1, H), router.weight.detach().numpy())
    np.testing.assert_allclose(logits, hf_logits.numpy(), rtol=1e-6, atol=1e-6 * np.abs(hf_logits.numpy()).max())
    probs, weights, experts = route(hf_logits.numpy(), k, norm_topk_prob)
    assert weights.dtype == np.float32
    np.testing.assert_array_equal(experts, hf_experts.numpy())
    np.testing.assert_allclose(weights, hf_weights.numpy(), rtol=1e-6, atol=0)
    np.testing.assert_allclose(probs, torch.softmax(hf_logits, -1, dtype=torch.float32).numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.oracle
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_oracle_mix_equals_eager_qwen3_moe_experts(norm_topk_prob):
    """Routing weight after down_proj, index_add_ in ascending expert id, from zeros (the 3-D expert tensors:
    gate_up_proj [E, 2I, H] with gate rows first, down_proj [E, H, I])."""
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    E, k, H, I, N = 8, 2, 16, 12, 20
    experts_module = Qwen3MoeExperts(_moe_config(E, k, H, I, norm_topk_prob))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        experts_module.gate_up_proj.copy_(torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5)
        experts_module.down_proj.copy_(torch.randn(E, H, I, generator=gen) / I ** 0.5)
    gate_up, down = experts_module.gate_up_proj.detach().numpy(), experts_module.down_proj.detach().numpy()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((N, H)).astype(np.float32)
    _, weights, experts = route(rng.normal(0, 2, (N, E)).astype(np.float32), k, norm_topk_prob)

    def expert_fn(e, xe):
        g, u = np.split(linear(xe, gate_up[e]), 2, axis=-1)
        return linear(g / (1 + np.exp(-g)) * u, down[e])

    with torch.no_grad():
        hf = experts_module(torch.from_numpy(x), torch.from_numpy(experts), torch.from_numpy(weights)).numpy()
    out = mix_experts(x, experts, weights, expert_fn)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, hf, rtol=1e-6, atol=1e-6 * np.abs(hf).max())
