"""Real checkpoint directories, as transformers 5.23 itself writes them (save_pretrained of a tokenizer and of a
model): the released Qwen3 / Qwen3.5 chat templates (tests/fixtures/chat_templates, from llama.cpp's copies)
rendered as transformers' apply_chat_template renders them, generation_config.json's eos ids and sampling
defaults, and the multimodal Qwen3.5 layout (text weights under model.language_model., vision tensors set aside).
"""

import functools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import refimpl
from oracle import build_hf
from refimpl.formats.tokenizer import qwen_tokenizer

# one xdist worker runs the module: its saved tokenizers (transformers takes seconds to load a Qwen vocabulary) and
# checkpoints, module-scoped, are then built once, not once per worker (`make test` runs --dist loadgroup)
pytestmark = [pytest.mark.oracle, pytest.mark.xdist_group("models-checkpoint-dirs")]
transformers = pytest.importorskip("transformers")

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
QWEN3, QWEN35 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(), (TEMPLATES / "Qwen3.5-4B.jinja").read_text()
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "城市 / city"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}]
CHATS = {
    "plain": ([{"role": "user", "content": "Hello! Who are you?"}], None),
    "system": ([{"role": "system", "content": "You are terse. 用中文回答。"},
                {"role": "user", "content": "What is 2+2?"}], None),
    "multi-turn with thinking": ([{"role": "user", "content": "Pick a number."},
                                  {"role": "assistant", "content": "<think>\nAny will do.\n</think>\n\nSeven."},
                                  {"role": "user", "content": "Why?"}], None),
    "reasoning_content": ([{"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."},
                           {"role": "user", "content": "Bye", "name": None}], None),
    "tool call": ([{"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                       "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
                   {"role": "tool", "content": "{\"temperature\": 21}"},
                   {"role": "user", "content": "And <tool_call> tokens in text?"}], TOOLS),
}
THINKING = {"default": {}, "thinking on": {"enable_thinking": True}, "thinking off": {"enable_thinking": False}}


@functools.cache
def _transformers_tokenizer(vocab: str):
    """transformers' tokenizer of a Qwen vocabulary (made once: ~1.4 s each)."""
    return transformers.PreTrainedTokenizerFast(tokenizer_object=qwen_tokenizer(vocab).hf, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")


def save_tokenizer(directory, vocab: str, template, legacy: bool = False):
    """A tokenizer saved by transformers: tokenizer.json, tokenizer_config.json and chat_template.jinja (or, legacy,
    the template inside tokenizer_config.json)."""
    tok = _transformers_tokenizer(vocab)
    tok.chat_template = template
    tok.save_pretrained(directory, save_jinja_files=not legacy)
    return directory


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """get(template, legacy) -> (refimpl tokenizer, transformers tokenizer) of one saved directory, built once
    (transformers takes 6-9 s to load a Qwen vocabulary)."""
    built = {}

    def get(name, legacy):
        if (name, legacy) not in built:
            d = save_tokenizer(tmp_path_factory.mktemp(f"{name}-{legacy}"), name, {"qwen3": QWEN3,
                                                                                   "qwen3.5": QWEN35}[name], legacy)
            files = {f.name for f in d.iterdir()}
            assert ("chat_template.jinja" in files) != legacy
            assert legacy == ("chat_template" in json.loads((d / "tokenizer_config.json").read_text()))
            built[name, legacy] = refimpl.load_tokenizer(d), transformers.AutoTokenizer.from_pretrained(d)
        return built[name, legacy]
    return get


STORED = [("qwen3", False), ("qwen3", True), ("qwen3.5", False)]   # where the template is: the reader is shared


@pytest.mark.parametrize("thinking", list(THINKING))
@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("template,legacy", STORED, ids=[f"{t}-{'tokenizer_config.json' if legacy else 'jinja'}"
                                                         for t, legacy in STORED])
def test_chat_template_renders_the_ids_transformers_renders(template, legacy, chat, thinking, tokenizers):
    ours, theirs = tokenizers(template, legacy)
    messages, tools = CHATS[chat]
    kw = {"tools": tools} if tools else {}
    for generation_prompt in (True, False):
        expected_text = theirs.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                                   **kw, **THINKING[thinking])
        expected_ids = theirs.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                  return_dict=False, **kw, **THINKING[thinking])
        text = ours.apply_chat_template(messages, generation_prompt, **kw, **THINKING[thinking])
        assert text == expected_text
        assert ours.chat_ids(messages, generation_prompt, **kw, **THINKING[thinking]) == expected_ids
    if chat == "tool call":
        assert '"name": "get_weather"' in text and "<tool_response>" in text


def test_several_templates_choose_tool_use_with_tools(tmp_path):
    """{"default", "tool_use"} templates (saved as chat_template.jinja + additional_chat_templates/, and legacy as a
    list in tokenizer_config.json): tools select "tool_use", as transformers' get_chat_template does."""
    for legacy in (False, True):
        d = save_tokenizer(tmp_path / str(legacy), "qwen3", {"default": QWEN3, "tool_use": QWEN35}, legacy)
        ours, theirs = refimpl.load_tokenizer(d), transformers.AutoTokenizer.from_pretrained(d)
        messages = CHATS["tool call"][0]
        for kw in ({}, {"tools": TOOLS}):
            assert ours.apply_chat_template(messages, **kw) == theirs.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **kw)
        assert "<function=get_weather>" in ours.apply_chat_template(messages, tools=TOOLS)


def test_template_errors_are_one_line_input_errors(tokenizers):
    ours, _ = tokenizers("qwen3.5", False)
    with pytest.raises(refimpl.errors.InputError, match="No user query found in messages"):
        ours.apply_chat_template([{"role": "system", "content": "alone"}])
    plain = refimpl.load_tokenizer("qwen3")
    with pytest.raises(refimpl.errors.InputError, match="no chat template to pass tools"):
        plain.apply_chat_template("hi", tools=TOOLS)


# ---------------------------------------------------------------------------------------------------- model dirs

QWEN3_TINY = dict(model_type="qwen3", vocab_size=151936, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, intermediate_size=48, max_position_embeddings=512,
                  tie_word_embeddings=False, eos_token_id=151645, bos_token_id=151643)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A Qwen3 checkpoint as save_pretrained writes it, with a sampling generation_config (as Qwen3's) and the
    released template."""
    d = tmp_path_factory.mktemp("qwen3-dir")
    hf = build_hf(QWEN3_TINY, seed=5)
    hf.generation_config = transformers.GenerationConfig(do_sample=True, temperature=0.6, top_k=20, top_p=0.95,
                                                         eos_token_id=[151645, 151643], bos_token_id=151643,
                                                         pad_token_id=151643)
    hf.save_pretrained(d)
    save_tokenizer(d, "qwen3", QWEN3)
    return d


def test_generation_config_eos_and_sampling_defaults(qwen3_dir):
    model = refimpl.load(qwen3_dir)
    assert model.generation_config == {"eos_token_id": [151645, 151643], "do_sample": True, "temperature": 0.6,
                                       "top_k": 20, "top_p": 0.95}
    from refimpl.generate import checkpoint_sampling, default_eos
    assert checkpoint_sampling(model.generation_config) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95,
                                                             "min_p": 0.0, "repetition_penalty": 1.0}
    assert default_eos(model) == [151645, 151643]
    prompt = [9707, 11, 1879]
    kw = dict(max_new_tokens=6, seed=4, return_logits=True)
    a = refimpl.generate(model, prompt, **kw)     # the checkpoint's defaults
    b = refimpl.generate(model, prompt, temperature=0.6, top_k=20, top_p=0.95, eos_token_id=[151645, 151643], **kw)
    assert a.tokens == b.tokens and a.uniforms == b.uniforms and len(a.uniforms[0]) == len(a.tokens[0])
    greedy = refimpl.generate(model, prompt, temperature=0.0, max_new_tokens=3)
    assert greedy.uniforms == [[]]                  # an explicit argument wins over the checkpoint


def test_cli_chat_generation_uses_the_template_and_generation_config(qwen3_dir):
    theirs = transformers.AutoTokenizer.from_pretrained(qwen3_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    prompt = theirs.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False,
                                        return_dict=False)
    run = subprocess.run([sys.executable, "-m", "refimpl.cli", "generate", "--model", str(qwen3_dir), "--chat",
                          "--system", "Be brief.", "--prompt", "Hi there", "--no-thinking", "--ids",
                          "--max-new-tokens", "5", "--seed", "2"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "[generation_config.json: temperature 0.6, top_k 20, top_p 0.95, min_p 0.0, repetition_penalty 1.0]" \
        in run.stderr
    model = refimpl.load(qwen3_dir)
    tok = refimpl.load_tokenizer(qwen3_dir)
    expected = refimpl.generate(model, prompt, max_new_tokens=5, seed=2,
                                eos_token_id=sorted({151645, 151643, *tok.stop_ids()}))
    assert [int(t) for t in run.stdout.split()] == expected.tokens[0]


QWEN35_MM = dict(model_type="qwen3_5", tie_word_embeddings=False, text_config=dict(
    vocab_size=248320, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    intermediate_size=48, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2, max_position_embeddings=512,
    eos_token_id=248044, rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                          "mrope_section": [1, 1, 0], "mrope_interleaved": True}),
    vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                       num_position_embeddings=16, patch_size=4))


def test_multimodal_qwen35_checkpoint_loads_its_text_model(tmp_path):
    """Qwen3_5ForConditionalGeneration.save_pretrained: the language model under model.language_model., the
    vision tower under model.visual. (set aside); refimpl's logits match transformers' on text ids."""
    hf = build_hf(QWEN35_MM, seed=9, logit_scale=0.1, auto=transformers.AutoModelForImageTextToText)
    hf.save_pretrained(tmp_path)
    save_tokenizer(tmp_path, "qwen3.5", QWEN35)
    names = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"] \
        if (tmp_path / "model.safetensors.index.json").exists() else None
    from refimpl.formats.safetensors import read_safetensors
    names = names or read_safetensors(tmp_path / "model.safetensors")
    assert any(n.startswith("model.language_model.layers.") for n in names)
    assert any(n.startswith("model.visual.") for n in names)
    model = refimpl.load(tmp_path)
    assert model.config.model_type == "qwen3_5_text" and model.weights.set_aside
    assert all(n.startswith("model.visual.") for n in model.weights.set_aside)
    tok = refimpl.load_tokenizer(tmp_path)
    ids = np.array([tok.chat_ids([{"role": "user", "content": "Describe Paris in one line."}])])
    import torch
    with torch.no_grad():
        expected = hf(input_ids=torch.as_tensor(ids)).logits.numpy()
    got = model.forward(ids)
    err = np.abs(got - expected).max()
    print(f"multimodal Qwen3.5 text logits vs transformers: max abs {err:.3g} (logits ~{np.abs(expected).max():.2g})")
    assert err <= 1e-4
    streamed = refimpl.load(tmp_path, max_resident_bytes=model.weights.plan()[1])
    np.testing.assert_array_equal(streamed.forward(ids), got)
