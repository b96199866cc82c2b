"""Generation: cached == naive recompute, the documented sampler (order, boundaries, draws), per-row finishing in a
batch, stop strings, streaming, and clear errors."""

import math

import numpy as np
import pytest

import exact
import refimpl
from helpers import scaled
from refimpl.errors import InputError
from refimpl.generate import (
    SamplingParams,
    choose,
    distribution,
    draw,
    greedy,
    log_softmax_at,
    min_p_count,
    repetition_penalty,
    sample,
    top_k_order,
    top_p_count,
)
from refimpl.models.config import config_from_dict
from refimpl.models.model import Model
from refimpl.models.weights import Weights
from refimpl.presets import PRESETS, random_weights

# one xdist worker runs the module: its module-scoped `models` (five scaled presets, ~2 s) are then built once, not
# once per worker (`make test` runs --dist loadgroup)
pytestmark = pytest.mark.xdist_group("generate")
PROMPT = [9707, 11, 1879]


@pytest.fixture(scope="module")
def models():
    return {name: scaled(name) for name in PRESETS}


@pytest.mark.parametrize("name", list(PRESETS))
def test_cached_equals_one_forward_over_64_greedy_steps(models, name):
    """64 greedy steps with the cache against one forward of the prompt and the tokens it chose: causal, so the
    forward's logits at each position are what recomputing that prefix would give (generate's naive path, which
    recomputes them step by step, is checked on a ragged batch below; here 64 recomputed prefixes cost ~30x more)."""
    model = models[name]
    cached = refimpl.generate(model, PROMPT, max_new_tokens=64, eos_token_id=())
    assert len(cached.tokens[0]) == 64 and cached.finish_reasons == ["length"]
    logits = model.forward(np.array([PROMPT + cached.tokens[0][:-1]]))[0, len(PROMPT) - 1:]   # [64, V]
    assert cached.tokens[0] == [int(i) for i in np.argmax(logits, axis=-1)]
    # float32 logits of size ~2 computed by two different call sequences: a few e-5 apart
    np.testing.assert_allclose(cached.logprobs[0], [log_softmax_at(l, t) for l, t in zip(logits, cached.tokens[0])],
                               atol=1e-4, rtol=0)


def test_cached_equals_naive_for_a_ragged_batch_with_sampling(models):
    model = models["tiny-qwen3.5-moe"]
    kw = dict(max_new_tokens=12, temperature=0.8, top_k=50, top_p=0.9, seed=[3, 4], eos_token_id=())
    cached = refimpl.generate(model, [[1, 2, 3, 4, 5], [7]], **kw)
    naive = refimpl.generate(model, [[1, 2, 3, 4, 5], [7]], use_cache=False, **kw)
    assert cached.tokens == naive.tokens and cached.uniforms == naive.uniforms


def test_sampling_is_seeded(models):
    model = models["tiny-qwen3.5"]
    kw = dict(max_new_tokens=16, temperature=0.4, eos_token_id=())
    a, b = refimpl.generate(model, PROMPT, seed=0, **kw), refimpl.generate(model, PROMPT, seed=0, **kw)
    c = refimpl.generate(model, PROMPT, seed=1, **kw)
    assert a.tokens == b.tokens and a.uniforms == b.uniforms
    assert a.tokens != c.tokens
    # the draws are the documented stream: PCG64(seed + row), one random() per step
    g = np.random.Generator(np.random.PCG64(0))
    assert a.uniforms[0] == [g.random() for _ in range(16)]


def test_top_k_1_equals_greedy(models):
    model = models["tiny-qwen3-moe"]
    g = refimpl.generate(model, PROMPT, max_new_tokens=16, eos_token_id=())
    k1 = refimpl.generate(model, PROMPT, max_new_tokens=16, temperature=1.7, top_k=1, seed=5, eos_token_id=())
    assert g.tokens == k1.tokens and len(k1.uniforms[0]) == 16


def test_greedy_and_top_k_break_ties_towards_the_lowest_id():
    l = np.array([1.0, 3.0, 2.0, 3.0, 3.0, 0.0])
    assert greedy(l) == 1
    assert top_k_order(l, 2).tolist() == [1, 3]
    assert top_k_order(l, 4).tolist() == [1, 3, 4, 2]
    assert top_k_order(l).tolist() == [1, 3, 4, 2, 0, 5]


def test_the_order_is_logit_descending_then_id_ascending(rng):
    for V in (1, 2, 7, 1000, 50000):
        l = rng.integers(-5, 5, V).astype(np.float64)        # many ties
        l[rng.integers(0, V, V // 10 + 1)] = -np.inf
        assert top_k_order(l).tolist() == sorted(range(V), key=lambda t: (-l[t], t))
        k = max(1, V // 3)
        assert top_k_order(l, k).tolist() == sorted(range(V), key=lambda t: (-l[t], t))[:k]


def test_top_p_boundaries():
    p = np.array([0.5, 0.25, 0.125, 0.0625, 0.0625])     # exact binary fractions: exact cumulative sums
    assert top_p_count(p, 0.75) == 2                      # cumulative reaches top_p exactly at the 2nd: stop there
    assert top_p_count(p, np.nextafter(0.75, 1)) == 3     # just above: one more
    assert top_p_count(p, 0.5) == 1
    assert top_p_count(p, 0.3) == 1                       # the first token is always kept
    assert top_p_count(p, 0.9375) == 4
    assert top_p_count(p, 1.0) == 5


def test_min_p_keeps_p_at_least_min_p_times_p_max():
    p = np.array([0.4, 0.2, np.nextafter(0.2, 0), 0.1, 0.1])
    assert min_p_count(p, 0.5) == 2                       # 0.2 >= 0.5 * 0.4 exactly; the next one is below
    assert min_p_count(p, 0.0) == 5 and min_p_count(p, 1.0) == 1


def test_distribution_applies_the_documented_order():
    # logits log(p) for p = 0.4, 0.3, 0.2, 0.1 (ids permuted), temperature 1
    ids = np.array([2, 0, 3, 1])
    l = np.empty(4)
    l[ids] = np.log([0.4, 0.3, 0.2, 0.1])
    order, q = distribution(l, SamplingParams(temperature=1.0, top_k=3))
    assert order.tolist() == [2, 0, 3]
    np.testing.assert_allclose(q, np.array([0.4, 0.3, 0.2]) / 0.9, rtol=1e-12)
    # top-p 0.75 on the top-3 renormalised (0.444, 0.333, 0.222): the first two reach it
    order, q = distribution(l, SamplingParams(temperature=1.0, top_k=3, top_p=0.75))
    assert order.tolist() == [2, 0]
    np.testing.assert_allclose(q, [4 / 7, 3 / 7], rtol=1e-12)
    # min-p 0.6: p >= 0.24 of the full distribution -> 0.4 and 0.3
    order, _ = distribution(l, SamplingParams(temperature=1.0, min_p=0.6))
    assert order.tolist() == [2, 0]
    # temperature 1e-3 makes the distribution one-hot; temperature 100 nearly uniform
    _, q = distribution(l, SamplingParams(temperature=1e-3))
    assert q[0] == 1.0
    _, q = distribution(l, SamplingParams(temperature=100.0))
    assert q.max() - q.min() < 0.01


def test_sampler_boundaries_as_documented():
    """At an exact top-p / min-p boundary `sample` (what generate calls) keeps what `distribution` keeps."""
    l = np.array([0.3, 0.0, 0.5])                          # order [2, 0, 1]
    Z = math.fsum(exact.exp32(l - 0.5))                    # e_i: float32 exps, correctly rounded; Z: exact sum
    top_p = 1.0 / Z
    if top_p * Z != 1.0:                                   # make E_0 == top_p * Z hold exactly
        top_p = np.nextafter(top_p, 1.0) if top_p * Z < 1.0 else np.nextafter(top_p, 0.0)
    assert top_p * Z == 1.0
    at = SamplingParams(temperature=1.0, top_p=top_p)
    assert distribution(l, at)[0].tolist() == [2]           # E_0 < top_p Z fails: only the top id
    assert {sample(l, at, u) for u in (0.0, 0.5, 0.999)} == {2}
    assert {choose(l, [], at, np.random.Generator(np.random.PCG64(s)))[0] for s in range(20)} == {2}
    above = SamplingParams(temperature=1.0, top_p=float(np.nextafter(top_p, 1.0)))
    assert distribution(l, above)[0].tolist() == [2, 0] and sample(l, above, 0.999) == 0
    # min-p exactly at e_2 = exp(0.4 - 2) keeps it; one ulp above drops it
    l = np.array([2.0, -2.6, 0.4])
    e2 = float(exact.exp32(0.4 - 2.0))
    for min_p, kept in ((e2, [0, 2]), (float(np.nextafter(e2, 1.0)), [0])):
        params = SamplingParams(temperature=1.0, min_p=min_p)
        assert distribution(l, params)[0].tolist() == kept
        assert sample(l, params, 0.99) == kept[-1]


def test_draw_is_the_inverse_cdf_over_the_order():
    order, q = np.array([5, 2, 9]), np.array([0.5, 0.25, 0.25])
    assert [draw(order, q, u) for u in (0.0, 0.4999, 0.5, 0.7499, 0.75, 0.9999999)] == [5, 5, 2, 2, 9, 9]


def test_repetition_penalty_hand_computed():
    l = np.array([2.0, -1.0, 0.5, 3.0, -0.5])
    got = repetition_penalty(l, [0, 1, 1, 4], 2.0)
    assert got.tolist() == [1.0, -2.0, 0.5, 3.0, -1.0]
    assert l.tolist() == [2.0, -1.0, 0.5, 3.0, -0.5]       # input untouched
    # penalising id 3 (the argmax) by 2: 3 / 2 = 1.5 < 2.0, so greedy moves to id 0
    assert choose(l, [3], SamplingParams(repetition_penalty=2.0), None) == (0, None)
    assert choose(l, [3], SamplingParams(repetition_penalty=1.2), None) == (3, None)   # 2.5 still wins


def test_repetition_penalty_in_the_loop_covers_prompt_and_generated_ids(models):
    model = models["tiny-qwen3"]
    plain = refimpl.generate(model, PROMPT, max_new_tokens=12, eos_token_id=()).tokens[0]
    assert len(set(plain)) < 12                                           # this model repeats itself
    r = refimpl.generate(model, PROMPT, max_new_tokens=12, eos_token_id=(), repetition_penalty=1e9).tokens[0]
    assert len(set(r)) == 12 and not set(r) & set(PROMPT)
    ids, expected = list(PROMPT), []                                      # the same, by hand
    for _ in range(4):
        l = model.forward(np.array([ids]), logits_to_keep=1)[0, -1].astype(np.float64)
        seen = sorted(set(ids))
        l[seen] = np.where(l[seen] > 0, l[seen] / 1.5, l[seen] * 1.5)
        expected.append(int(np.argmax(l)))
        ids.append(expected[-1])
    assert refimpl.generate(model, PROMPT, max_new_tokens=4, eos_token_id=(), repetition_penalty=1.5).tokens[0] \
        == expected != plain[:4]


def test_an_independent_reading_of_the_docstring_picks_the_same_tokens(rng):
    """The module doc's procedure, re-implemented in plain Python loops, agrees with the sampler."""
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.8, min_p=0.05, repetition_penalty=1.3)
    for trial in range(30):
        logits = rng.standard_normal(200) * 3
        logits[rng.integers(0, 200, 5)] = logits.max()       # ties at the top
        history = rng.integers(0, 200, 10).tolist()
        u = np.random.Generator(np.random.PCG64(trial)).random()
        l = [(x / 1.3 if x > 0 else x * 1.3) if t in set(history) else x for t, x in enumerate(logits)]
        l = [x / 0.7 for x in l]
        order = sorted(range(200), key=lambda t: (-l[t], t))[:40]
        w = [np.exp(l[t] - l[order[0]]) for t in order]
        p = [x / sum(w) for x in w]
        kept, c = [], 0.0
        for i in range(len(order)):
            if i > 0 and c >= 0.8:
                break
            kept.append(i)
            c += p[i]
        kept = [i for i in kept if p[i] >= 0.05 * p[0]]
        total = sum(p[i] for i in kept)
        c, expected = 0.0, order[kept[-1]]
        for i in kept:
            c += p[i] / total
            if u < c:
                expected = order[i]
                break
        token, u_used = choose(logits, history, params, np.random.Generator(np.random.PCG64(trial)))
        assert (token, u_used) == (expected, u), trial


@pytest.mark.parametrize("V", [50, 1025, 20000])
def test_the_lazy_sampler_equals_the_literal_procedure(rng, V):
    """sample() sorts only a growing prefix of the order; it picks what distribution() + draw() pick."""
    settings = [dict(temperature=1.0), dict(temperature=0.5, top_p=0.9), dict(temperature=2.0, top_p=0.999),
                dict(temperature=1.0, min_p=0.3), dict(temperature=3.0, min_p=0.01, top_p=0.95),
                dict(temperature=1.0, top_k=1024), dict(temperature=1.0, top_k=1025, top_p=0.5),
                dict(temperature=0.8, top_k=7, min_p=0.2)]
    for trial in range(30 if V < 20000 else 9):
        scale = [0.01, 1.0, 8.0][trial % 3]                       # flat, medium and peaked distributions
        logits = np.round(rng.standard_normal(V) * scale, 2)      # rounding makes ties
        for kw in settings:
            params = SamplingParams(**kw)
            # (u within rounding of 1 would pick among tail ids of probability ~1e-27 by rounding alone)
            for u in (0.0, float(rng.random()), 0.999):
                assert sample(logits, params, u) == draw(*distribution(logits, params), u), (trial, kw, u)


def test_batch_rows_finish_on_eos_and_equal_each_row_alone(models):
    model = models["tiny-qwen3-moe"]
    prompts = [[9707, 11, 1879, 0, 315], [42, 7], [100, 200, 300]]
    alone = [refimpl.generate(model, p, max_new_tokens=8, eos_token_id=()).tokens[0] for p in prompts]
    eos = alone[1][4]                     # row 1 stops after 5 tokens
    assert eos not in alone[1][:4]
    expected = []
    for p in prompts:
        r = refimpl.generate(model, p, max_new_tokens=8, eos_token_id=eos)
        expected.append((r.tokens[0], r.finish_reasons[0], r.logprobs[0]))
    batch = refimpl.generate(model, prompts, max_new_tokens=8, eos_token_id=eos)
    assert batch.tokens == [e[0] for e in expected]
    assert batch.finish_reasons == [e[1] for e in expected] and batch.finish_reasons[1] == "eos"
    assert len(batch.tokens[1]) == 5 and batch.tokens[1][-1] == eos
    for b in range(3):   # a batch computes multi-row products: a few float32 ulps apart
        np.testing.assert_allclose(batch.logprobs[b], expected[b][2], atol=1e-4, rtol=0)
    # sampled: row b of a batch with int seed s uses seed s + b. In float64: batched products move float32 logits
    # by an ulp, and over ~1e5 near-equal probabilities that moves the inverse-CDF pick now and then
    model = scaled("tiny-qwen3-moe", "float64")
    kw = dict(max_new_tokens=6, temperature=0.5, top_p=0.95, eos_token_id=eos)
    batch = refimpl.generate(model, prompts, seed=7, **kw)
    for b, p in enumerate(prompts):
        assert batch.tokens[b] == refimpl.generate(model, p, seed=7 + b, **kw).tokens[0]


def test_left_padded_array_with_mask_equals_ragged_list(models):
    model = models["tiny-qwen3-next"]
    ids = np.array([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    a = refimpl.generate(model, ids, attention_mask=mask, max_new_tokens=6, eos_token_id=())
    b = refimpl.generate(model, [[5, 6, 7], [1, 2, 3, 4, 5]], max_new_tokens=6, eos_token_id=())
    assert a.tokens == b.tokens and a.prompts == [[5, 6, 7], [1, 2, 3, 4, 5]]


class _Chars:
    """A stand-in tokenizer: id t decodes to chr(97 + t % 26)."""
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + t % 26) for t in ids)


def test_stop_strings_end_a_row_and_keep_the_completing_token(models):
    model = models["tiny-qwen3.5-moe"]
    full = refimpl.generate(model, PROMPT, max_new_tokens=20, eos_token_id=(), tokenizer=_Chars())
    text = full.texts[0]
    stop = text[5:7]
    first = text.find(stop)                 # the row ends at the token completing the first occurrence
    r = refimpl.generate(model, PROMPT, max_new_tokens=20, eos_token_id=(), stop=[stop, "#"], tokenizer=_Chars())
    assert r.finish_reasons == ["stop"] and r.tokens[0] == full.tokens[0][:first + 2]
    assert r.texts[0].endswith(stop)


def test_text_prompts_are_encoded_with_the_tokenizer(models):
    model = models["tiny-qwen3"]
    tok = refimpl.load_tokenizer("tiny-qwen3")
    a = refimpl.generate(model, ["Hello world", "你好"], max_new_tokens=3, tokenizer=tok, eos_token_id=())
    b = refimpl.generate(model, [tok.encode("Hello world"), tok.encode("你好")], max_new_tokens=3, eos_token_id=())
    assert a.tokens == b.tokens and a.prompts[0] == [9707, 1879] and a.texts == [tok.decode(t) for t in a.tokens]
    with pytest.raises(InputError, match="text prompt needs a tokenizer"):
        refimpl.generate(model, "Hello")


def test_streaming_callback_sees_every_token_in_order(models):
    seen = []
    r = refimpl.generate(models["tiny-qwen3"], [[1, 2], [3]], max_new_tokens=5, eos_token_id=(),
                         callback=lambda row, tok: seen.append((row, tok)))
    assert [t for row, t in seen if row == 0] == r.tokens[0] and [t for row, t in seen if row == 1] == r.tokens[1]
    assert [row for row, _ in seen] == [0, 1] * 5


def test_return_logits_and_logprobs(models):
    model = models["tiny-qwen3"]
    r = refimpl.generate(model, PROMPT, max_new_tokens=3, eos_token_id=(), return_logits=True)
    assert r.logits[0].shape == (3, 151936)
    np.testing.assert_array_equal(r.logits[0][0], model.forward(np.array([PROMPT]), logits_to_keep=1)[0, -1])
    for k, t in enumerate(r.tokens[0]):
        l = r.logits[0][k].astype(np.float64)
        assert r.logprobs[0][k] == exact.log_softmax_at(l, t)       # the exact value, correctly rounded
        assert r.logprobs[0][k] == log_softmax_at(r.logits[0][k], t)


def test_default_eos_is_the_configs():
    cfg = config_from_dict({**PRESETS["tiny-qwen3"], "vocab_size": 64, "eos_token_id": None})
    weights = Weights(random_weights(cfg, seed=1))
    free = refimpl.generate(Model(cfg, weights), [5, 6], max_new_tokens=8)
    assert free.finish_reasons == ["length"] and free.tokens[0][:2] == [6, 38]
    cfg = config_from_dict({**PRESETS["tiny-qwen3"], "vocab_size": 64, "eos_token_id": [1, 38]})
    r = refimpl.generate(Model(cfg, weights), [5, 6], max_new_tokens=8)
    assert r.finish_reasons == ["eos"] and r.tokens[0] == [6, 38]


def test_context_limit():
    cfg = config_from_dict({**PRESETS["tiny-qwen3"], "vocab_size": 64, "max_position_embeddings": 16})
    model = Model(cfg, Weights(random_weights(cfg, seed=1)))
    assert len(refimpl.generate(model, list(range(10)), max_new_tokens=6, eos_token_id=()).tokens[0]) == 6
    with pytest.raises(InputError, match=r"prompt \(10 tokens\) \+ max_new_tokens \(7\) = 17 exceeds the model's "
                                         r"context limit \(max_position_embeddings 16\)"):
        refimpl.generate(model, [list(range(10)), [1]], max_new_tokens=7)


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": -1.0}, "temperature must be"),
    ({"temperature": float("nan")}, "temperature must be"),
    ({"top_k": -1}, "top_k must be"),
    ({"top_k": 2.5}, "top_k must be"),
    ({"top_p": 0.0}, "top_p must be"),
    ({"top_p": 1.5}, "top_p must be"),
    ({"min_p": -0.1}, "min_p must be"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be"),
    ({"max_new_tokens": -1}, "max_new_tokens must be"),
    ({"temperature": 1.0, "seed": [1, 2]}, "seed must be"),
    ({"temperature": 1.0, "seed": -1}, "seed must be"),
    ({"stop": ["x"]}, "need a tokenizer"),
    ({"stop": [""]}, "non-empty strings"),
    ({"eos_token_id": "x"}, "eos_token_id must be"),
])
def test_bad_arguments(models, kwargs, message):
    with pytest.raises(InputError, match=message):
        refimpl.generate(models["tiny-qwen3"], PROMPT, **kwargs)


@pytest.mark.parametrize("prompt,mask,message", [
    ([[1, 2], []], None, "prompt row 1 must be"),
    ([1, 999999], None, "outside the vocabulary"),
    (np.array([[1, 2], [3, 4]]), np.array([[1, 0], [1, 1]]), "left padding"),
    (np.array([[1, 2]]), np.array([[1, 1, 1]]), "attention_mask has shape"),
    ([1.5, 2.0], None, "integer ids"),
])
def test_bad_prompts(models, prompt, mask, message):
    with pytest.raises(InputError, match=message):
        refimpl.generate(models["tiny-qwen3"], prompt, attention_mask=mask)
