"""refimpl's genie bundles against Qualcomm AI Hub's own export code (qai-hub-models 0.65.0, tests/conformance/
aihub.py says what is loaded and how): the exported graph run on each bundle call's inputs reproduces its outputs,
and AI Hub's host driver prepares the same inputs for the same prompt.

Cases: Qwen3, Qwen3-MoE (AI Hub exports no MoE: its Qwen3 graph code on transformers' Qwen3-MoE), Qwen3.5 and
Qwen3.5-MoE (AI Hub's Qwen3.5 graph); prompts of 3, 4 and 10 tokens at AR = 4 (under-filled, filled and split
over chunks), left and right padding, then 3 decode steps through the token graph (AR = 1), CL = 16.
Models: the presets with seeded random weights, output projection scaled to logits of size ~2 (tests/helpers.py
`scaled`), written as an HF checkpoint that refimpl and transformers both load.

Bars (float32 noise, relative to the largest magnitude of the expected tensor's valid region): refimpl and AI Hub
compute the same float32 graph with other kernels (SHA per-head convs, q pre-scaled, AI Hub's chunked delta rule
with its Newton-Schulz triangular inverse), so they agree to rounding that grows over the layers; bars are the
largest error measured over all cases times about 3 (the measured margins are in the module's report).
"""

import json

import aihub
import numpy as np
import pytest
from aihub import torch

import refimpl
from refimpl.bundle import read_bundle, valid_mask
from refimpl.conventions import genie
from refimpl.formats.safetensors import write_safetensors
from refimpl.golden import write_golden
from refimpl.models.config import config_from_dict
from refimpl.presets import PRESETS, checkpoint_layout, random_weights

pytestmark = pytest.mark.oracle

CASES = ["tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3.5", "tiny-qwen3.5-moe"]
AR, CL, DECODE_STEPS = 4, 16, 3
PROMPTS = {"under-fill": 3, "fill": 4, "split": 10}
RATIOS = []   # (name, error / bar) of every comparison, for measuring the margins
BARS = {"dense": 5e-6, "hybrid": 5e-5, "position_ids_": 1.2e-7}   # of the largest magnitude of the valid region


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """name -> (refimpl model, checkpoint directory, AI Hub graph), built once per worker."""
    built = {}

    def get(name):
        if name not in built:
            directory = tmp_path_factory.mktemp(name)
            cfg = config_from_dict(PRESETS[name])
            arrays = random_weights(cfg, seed=11)          # helpers.scaled: logits of size ~2
            head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
            arrays[head] = arrays[head] * np.float32(0.05)
            (directory / "config.json").write_text(json.dumps(PRESETS[name]))
            write_safetensors(directory / "model.safetensors", checkpoint_layout(cfg, arrays))
            model = refimpl.load(str(directory))
            built[name] = model, directory, aihub.graph(directory, CL, model.config.eos_token_id)
        return built[name]
    return get


def prompt(model, n: int) -> list:
    return [int(t) for t in np.random.default_rng(n).integers(0, model.config.vocab_size, size=n)]


def bundle(model, tmp_path, n: int, pad_side: str | None = None):
    """A genie bundle at AR, CL; every other option at refimpl's default unless given."""
    params = {"ar": AR, "cl": CL} | ({"pad_side": pad_side} if pad_side else {})
    path = write_golden(tmp_path / "bundle", model, prompt(model, n), source="conformance", convention="genie",
                        params=params, decode_steps=DECODE_STEPS, taps=None)
    return read_bundle(path)


def test_default_graph_sizes_are_the_exporters():
    """refimpl's default AR, CL and token-graph AR are AI Hub's export defaults (templates/llm/model.py)."""
    source = aihub.root() / "models/templates/llm/model.py"
    exported = aihub.constants(source, "DEFAULT_SEQUENCE_LENGTH", "DEFAULT_CONTEXT_LENGTH",
                               "DEFAULT_EXPORT_SEQUENCE_LENGTHS")
    opts = genie.Options()
    assert (opts.ar, opts.cl, opts.decode_ar) == (exported[0], exported[1], min(exported[2]))


def assert_close(actual, expected, valid, name: str, where: str, hybrid: bool):
    """|actual - expected| <= bar * max|expected| on the valid region; outside it nothing is compared."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{where} {name}: shape {actual.shape}, expected {expected.shape}"
    mask = valid_mask(expected.shape, valid)
    if not mask.any():
        return
    err = float(np.abs(actual - expected)[mask].max())
    scale = float(np.abs(expected[mask]).max())
    bar = BARS["position_ids_" if name.startswith("position_ids_") else "hybrid" if hybrid else "dense"]
    if scale == 0:   # a zero state (before any token): exactly zero
        assert err == 0, f"{where} {name}: expected zeros, max abs error {err:.3g}"
        return
    RATIOS.append((name, err / (bar * scale)))
    assert err <= bar * scale, f"{where} {name}: max abs error {err:.3g} at scale {scale:.3g} exceeds {bar:g} of it"


@pytest.mark.parametrize("length", PROMPTS, ids=list(PROMPTS))
@pytest.mark.parametrize("pad_side", ["left", "right"])
@pytest.mark.parametrize("name", CASES)
def test_exported_graph_reproduces_the_bundle(case, tmp_path, name, pad_side, length):
    """Each call of the bundle, fed positionally in the bundle's input order to AI Hub's graph, has the graph's
    input names, order, shapes and dtypes, and the graph's outputs (names, order, shapes) match the bundle's on
    their valid regions."""
    model, _, graph = case(name)
    b = bundle(model, tmp_path, PROMPTS[length], pad_side)
    for k, step in enumerate(b.manifest["steps"]):
        ar = b.tensor(k, "input", "input_ids").shape[1]
        spec = graph.input_spec(ar)
        assert step["inputs"] == list(spec), f"step {k}: inputs differ from the exported graph's"
        inputs = [b.tensor(k, "input", n) for n in step["inputs"]]
        for n, a in zip(step["inputs"], inputs):
            assert (list(a.shape), a.dtype.name) == (list(spec[n][0]), spec[n][1]), f"step {k} input {n}"
        outputs = graph(*[torch.as_tensor(np.array(a)) for a in inputs])
        assert step["outputs"] == graph.output_names, f"step {k}: outputs differ from the exported graph's"
        for n, actual in zip(step["outputs"], outputs):
            rec = b.manifest["tensors"][f"{k}/output/{n}"]
            assert_close(actual.numpy(), b.tensor(k, "output", n), rec["valid"], n, f"step {k}",
                         model.config.is_hybrid)


def host_cache(b, k: int, layer_types) -> list:
    """AI Hub's host-side cache before call k, from the bundle: per layer (descriptor order) [key, value] in HF
    layout [1, Hkv, cur, D] (the cached entries of the input window), or [conv_state, recurrent_state]."""
    flat = []
    for i, kind in enumerate(layer_types):
        if kind == "linear_attention":
            flat += [torch.as_tensor(np.array(b.tensor(k, "input", f"{s}_{i}_in")))
                     for s in ("conv_state", "recurrent_state")]
            continue
        for kv in ("key", "value"):
            rec = b.manifest["tensors"][f"{k}/input/past_{kv}_{i}_in"]
            a = np.array(b.tensor(k, "input", f"past_{kv}_{i}_in"))[:, 0]          # [Hkv, D, W] / [Hkv, W, D]
            a = a.swapaxes(1, 2) if kv == "key" else a                             # [Hkv, W, D]
            lo, hi = rec["valid"][0][3 if kv == "key" else 2]
            flat.append(torch.as_tensor(np.ascontiguousarray(a[None, :, lo:hi])))
    return flat


def check_host_inputs(model, b, k: int, prepared: dict, positions, exact_windows: bool):
    """AI Hub's prepared inputs for call k against the bundle's: names and order, ids and mask bit for bit,
    positions bit for bit (the bundle's tables are refimpl's RoPE at AI Hub's positions), cos / sin and the KV
    windows and states within float32 noise (bit for bit when built from the bundle's own cache), empty window
    slots zero."""
    step = b.manifest["steps"][k]
    assert list(prepared) == step["inputs"], f"step {k}: AI Hub's host prepares other inputs"
    for n, a in prepared.items():
        a, expected = a.numpy(), b.tensor(k, "input", n)
        assert (a.shape, a.dtype) == (expected.shape, expected.dtype), f"step {k} input {n}"
        if n in ("input_ids", "attention_mask") or exact_windows and n.startswith(("past_", "conv_", "recurrent_")):
            np.testing.assert_array_equal(a, expected, err_msg=f"step {k} input {n}")
        elif n.startswith("position_ids_"):
            assert_close(a, expected, None, n, f"step {k}", model.config.is_hybrid)
        else:
            rec = b.manifest["tensors"][f"{k}/input/{n}"]
            assert_close(a, expected, rec["valid"], n, f"step {k}", model.config.is_hybrid)
            assert not a[~valid_mask(a.shape, rec["valid"])].any(), f"step {k} input {n}: empty slots are not zero"
    cos, sin = model.rope(positions.numpy().astype(np.int64), None)
    np.testing.assert_array_equal(cos[:, None], b.tensor(k, "input", "position_ids_cos"), err_msg=f"step {k} positions")
    np.testing.assert_array_equal(sin[:, None], b.tensor(k, "input", "position_ids_sin"), err_msg=f"step {k} positions")


def prepare(aihub_, graph, b, k: int, host: list, pad_side: str):
    """AI Hub's Generator.prepare_inputs for bundle call k (HubCompatibleGenerator: cos / sin, Hub KV layout), and
    the positions it computed (the base Generator's output, before the tables replace them). Left padding: the
    host is given the call's real tokens and pads them itself; right padding (which its slicing never produces):
    the padded chunk with its 0 / 1 mask, as a transformers-API caller passes one."""
    ids = np.array(b.tensor(k, "input", "input_ids"))
    box = b.manifest["tensors"][f"{k}/output/logits"]["valid"]
    lo, hi = box[0][1] if box else (0, ids.shape[1])
    if pad_side == "left":
        input_ids, mask = torch.as_tensor(ids[:, lo:hi]), None
    else:
        input_ids, mask = torch.as_tensor(ids), torch.as_tensor((np.arange(ids.shape[1]) < hi)[None].astype(np.int64))
    adapter = aihub_.factory._ModelAdapter(graph.model, rope_embedding=graph.model.embedding)
    kwargs = {"model": adapter, "input_ids": input_ids, "attention_mask": mask, "sequence_length": ids.shape[1],
              "context_length": CL, "pad_token": b.manifest["convention"]["params"]["pad_id"],
              "layer_cache_descriptors": aihub_.layer_cache.build_layer_cache_descriptors(graph.model.llm_config)}
    prepared = aihub_.generator.HubCompatibleGenerator.prepare_inputs(past_key_values=list(host), **kwargs)
    base = aihub_.generator.Generator.prepare_inputs(past_key_values=list(host), **kwargs)
    return prepared, base["position_ids"]


@pytest.mark.parametrize("length", PROMPTS, ids=list(PROMPTS))
@pytest.mark.parametrize("pad_side", ["left", "right"])
@pytest.mark.parametrize("name", CASES)
def test_host_preparation_of_each_call(case, tmp_path, name, pad_side, length):
    """Given the host's cache before each call (the bundle's), AI Hub's host-side preparation gives exactly the
    bundle's inputs: padded ids, the clipped 4-D mask (floor -100), positions, the shifted KV window with dummy
    entries, the GDN states; cos / sin within float32 noise."""
    model, _, graph = case(name)
    b = bundle(model, tmp_path, PROMPTS[length], pad_side)
    aihub_ = aihub.load()
    for k in range(b.steps):
        prepared, positions = prepare(aihub_, graph, b, k, host_cache(b, k, model.config.layer_types), pad_side)
        check_host_inputs(model, b, k, prepared, positions, exact_windows=True)


@pytest.mark.parametrize("length", PROMPTS, ids=list(PROMPTS))
@pytest.mark.parametrize("name", CASES)
def test_host_driver_end_to_end(case, tmp_path, name, length):
    """AI Hub's whole host loop (Generator.forward: slicing the prompt from its end, left-padding, the shift
    window, the cache it accumulates from its own graph's outputs) on the bundle's prompt, then on the bundle's
    greedy tokens one by one: every call's inputs are the bundle's (ids and mask bit for bit, KV and states within
    float32 noise), and AI Hub's graph picks the same greedy tokens."""
    model, _, graph = case(name)
    b = bundle(model, tmp_path, PROMPTS[length])           # refimpl's defaults: left padding, mask floor -100
    aihub_ = aihub.load()
    recorded = []

    class Recording(aihub_.generator.HubCompatibleGenerator):
        @classmethod
        def prepare_inputs(cls, **kwargs):
            prepared = super().prepare_inputs(**kwargs)
            base = aihub_.generator.Generator.prepare_inputs(**kwargs)
            recorded.append((prepared, base["position_ids"]))
            return prepared

    generator = aihub_.factory.make_generator(graph.model, sequence_length=[1, AR], context_length=CL,
                                              model_cls=type("Model", (), {"GeneratorClass": Recording}))
    ids = torch.as_tensor([b.manifest["prompt_ids"]])
    with torch.no_grad():
        out = generator(input_ids=ids)
        tokens = [int(out.logits[0, -1].argmax())]
        for token in b.manifest["generated_ids"]:
            out = generator(input_ids=torch.as_tensor([[token]]), past_key_values=out.past_key_values)
            tokens.append(int(out.logits[0, -1].argmax()))
    assert tokens == b.manifest["generation"]["tokens"]
    assert len(recorded) == b.steps
    for k, (prepared, positions) in enumerate(recorded):
        check_host_inputs(model, b, k, prepared, positions, exact_windows=False)
