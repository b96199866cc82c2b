"""Chat templates against transformers 5.23's apply_chat_template, on generated conversations (hypothesis): the
released Qwen-family templates of the llama-cpp-python sdist (tests/fixtures/chat_templates), conversations with
messages of every role, content as a str or a list of parts, tools (schemas and Python functions), tool calls with
dict or JSON-string arguments, reasoning under its three names, NumPy scalars, dates and bytes, and the options
(add_generation_prompt, enable_thinking, continue_final_message). On every conversation transformers renders,
refimpl's text and ids are identical; wherever transformers raises, refimpl raises a refimpl error (never a raw
exception). EXAMPLES conversations per template (6 templates), derandomized so every run draws the same ones.
"""

import dataclasses
import datetime
import enum
import json
from pathlib import Path
from typing import Any, Literal, Union

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refimpl.errors import InputError, RefimplError
from refimpl.formats.chat_template import REFUSED_OPTIONS, read_chat_templates
from refimpl.formats.tokenizer import Tokenizer, qwen_tokenizer

# one xdist worker runs the module: its module-scoped `tokenizers` (transformers over a Qwen vocabulary, ~2 s) is
# then built once, not once per worker (`make test` runs --dist loadgroup)
pytestmark = [pytest.mark.oracle, pytest.mark.xdist_group("chat-template-oracle")]
transformers = pytest.importorskip("transformers")

TEMPLATES = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates").glob("*.jinja"))
EXAMPLES = 60
SPECIAL = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
TALLY = {"renders": 0, "identical": 0, "both raise": 0, "raises": {}, "identical with": {}, "refused with": {},
         "refusals": {}}


def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius", days: int | None = None) -> dict:
    """The current weather of a city.

    Args:
        city: The city, e.g. 巴黎
        unit: The unit of temperature
        days: How many days ahead
            (0 for today)
    Returns:
        The forecast
    """


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "城市 / city"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1}}}}}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(refimpl Tokenizer factory for a template, transformers tokenizer) over the same Qwen3 vocabulary (the
    templates' markers are added tokens of it); transformers gets its own copy of the tokenizers object. The
    special tokens refimpl gives the template are read from the tokenizer_config.json transformers saves (with
    a model-specific "image_token" and a named extra special token, which transformers gives the template too)."""
    from tokenizers import Tokenizer as HFTokenizer
    hf = qwen_tokenizer("qwen3").hf
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(hf.to_str()), **SPECIAL,
                                                  image_token="<|image_pad|>",
                                                  extra_special_tokens={"audio_token": "<|box_start|>"})
    saved = tmp_path_factory.mktemp("tokenizer")
    theirs.save_pretrained(saved)
    special = read_chat_templates(saved)[1]
    assert special == theirs.special_tokens_map and special["audio_token"] == "<|box_start|>"
    yield (lambda template, name: Tokenizer(hf, name, template, special)), theirs
    print(f"\nchat templates vs transformers: {TALLY['renders']} renders compared, {TALLY['identical']} identical "
          f"(text and ids); {TALLY['both raise']} conversations transformers refuses, refused by refimpl too: "
          f"{json.dumps(TALLY['raises'], ensure_ascii=False)}; identical renders with: {TALLY['identical with']}; "
          f"refusals: {TALLY['refusals']} with {TALLY['refused with']}")


def features(messages, kw) -> set:
    """What a conversation exercises (for the tally printed at the end of the module)."""
    found = {k for k in ("continue_final_message", "enable_thinking") if k in kw}
    found |= {"function tool" for t in kw.get("tools") or [] if callable(t)}
    found |= {"tools" for t in kw.get("tools") or [] if isinstance(t, dict)}

    def walk(x, inside=""):
        if isinstance(x, dict):
            for k, v in x.items():
                if k in ("reasoning_content", "thinking", "reasoning"):
                    found.add("reasoning")
                if k == "tool_calls":
                    found.add("tool calls")
                if k == "arguments" and isinstance(v, str):
                    found.add("JSON-string arguments")
                walk(v, k)
        elif isinstance(x, (list, tuple)):
            if inside == "content" and x:
                found.add("content parts")
            for v in x:
                walk(v)
        elif isinstance(x, np.generic):
            found.add("NumPy scalars")
        elif isinstance(x, (datetime.date, bytes)):
            found.add("dates / bytes")
    walk(messages)
    return found


# ------------------------------------------------------------------------------------------------ generators

WORDS = ["Hello", "你好", "What is 2+2?", " spaced ", "\n", "<think>", "</think>", "<tool_call>", "</tool_call>",
         "<tool_response>", "é", "😀", "a\n\nb", "CONTINUE", "{\"k\": 1}", "  "]
# every character UTF-8 encodes (all but the surrogates, Cs): no codec= (the same set, the same draws; with a codec
# Hypothesis encodes all 1.1M code points once per process when its on-disk charmap cache is absent, as on CI)
text = st.one_of(st.lists(st.sampled_from(WORDS), max_size=4).map("".join),
                 st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=12))
SPECIAL_VALUES = st.sampled_from([np.int64(3), np.float32(0.5), np.float64(-2.25), np.bool_(False), np.str_("np"),
                                  np.int8(-7), datetime.date(2024, 2, 29), datetime.datetime(2025, 1, 2, 3, 4),
                                  b"\x00bytes", None])
scalar = st.one_of(text, st.integers(-5, 10**6), st.floats(allow_nan=False, width=32), st.booleans(), SPECIAL_VALUES,
                   SPECIAL_VALUES, SPECIAL_VALUES)


def nested(inner):
    return st.one_of(st.lists(inner, max_size=3),
                     st.dictionaries(st.sampled_from(["a", "b", "城市", "n"]), inner, max_size=3))


value = st.recursive(scalar, nested, max_leaves=6)
parts = st.lists(st.one_of(st.builds(lambda t: {"type": "text", "text": t}, text),
                           st.just({"type": "image"}), st.just({"type": "image", "image": np.zeros(2)})),
                 min_size=1, max_size=3)
content = st.integers(0, 7).flatmap(lambda i: parts if i == 0 else text)   # parts: 1 message in 8
arguments = st.one_of(st.dictionaries(st.sampled_from(["city", "unit", "days", "query"]), value, max_size=3),
                      st.dictionaries(st.sampled_from(["city", "days"]), st.one_of(text, st.integers(0, 9)),
                                      max_size=2).map(json.dumps))


@st.composite
def tool_call(draw):
    call = {"name": draw(st.sampled_from(["get_weather", "search"])), "arguments": draw(arguments)}
    return draw(st.sampled_from([{"type": "function", "function": call}, call, {"id": "call_0", "function": call}]))


@st.composite
def message(draw, role):
    m = {"role": role, "content": draw(content)}
    if role == "assistant":
        if draw(st.booleans()):
            m[draw(st.sampled_from(["reasoning_content", "thinking", "reasoning"]))] = draw(text)
        if draw(st.booleans()):
            m["tool_calls"] = draw(st.lists(tool_call(), min_size=1, max_size=2))
            m["content"] = draw(st.sampled_from(["", None, m["content"]]))
    if role == "tool":
        m["content"] = draw(st.one_of(text, st.dictionaries(st.sampled_from(["t", "when", "raw"]), value, max_size=3)))
        if draw(st.booleans()):
            m["name"] = "get_weather"
    if draw(st.integers(0, 5)) == 0:
        m["name"] = None      # a None value: the key is dropped
    return m


@st.composite
def conversation(draw):
    """Mostly well-formed turns (system?, user, assistant with tool calls and their tool replies, ...), sometimes
    any roles in any order."""
    if draw(st.integers(0, 4)) == 0:
        roles = draw(st.lists(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), min_size=1,
                              max_size=5))
        return [draw(message(r)) for r in roles]
    out = [draw(message("system"))] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 3))):
        out.append(draw(message("user")))
        if draw(st.booleans()):
            a = draw(message("assistant"))
            out.append(a)
            for _ in a.get("tool_calls", []):
                out.append(draw(message("tool")))
    return out


options = st.fixed_dictionaries({   # None: not given
    "add_generation_prompt": st.sampled_from([None, True, False]),
    "enable_thinking": st.sampled_from([None, True, False, np.bool_(False)]),
    "continue_final_message": st.sampled_from([None, None, None, True, "reasoning_content"])}).map(
        lambda kw: {k: v for k, v in kw.items() if v is not None})
tools = st.sampled_from([None, None, [WEATHER], [WEATHER, SEARCH], [get_weather], [], [get_weather, SEARCH]])


# ------------------------------------------------------------------------------------------------ the comparison

@pytest.mark.parametrize("path", TEMPLATES, ids=[p.stem for p in TEMPLATES])
def test_generated_conversations_render_as_transformers_renders(path, tokenizers):
    make, theirs = tokenizers
    template = path.read_text(encoding="utf-8")
    ours = make(template, path.name)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(conversation(), options, tools)
    def check(messages, kw, tools):
        kw = {"add_generation_prompt": not kw.get("continue_final_message"), **kw,
              **({} if tools is None else {"tools": tools})}
        try:
            expected = theirs.apply_chat_template(messages, chat_template=template, tokenize=False, **kw)
            expected_ids = theirs.apply_chat_template(messages, chat_template=template, return_dict=False, **kw)
        except Exception as e:  # noqa: BLE001 — whatever transformers raises, refimpl must refuse with its own error
            key = f"{type(e).__name__}: {str(e)[:60]}"
            with pytest.raises(RefimplError) as refused:
                ours.apply_chat_template(messages, **kw)
            TALLY["both raise"] += 1
            for f in features(messages, kw):
                TALLY["refused with"][f] = TALLY["refused with"].get(f, 0) + 1
            TALLY["refusals"][key] = TALLY["refusals"].get(key, 0) + 1
            TALLY["raises"].setdefault(key, str(refused.value)[:160])
            return
        TALLY["renders"] += 1
        assert ours.apply_chat_template(messages, **kw) == expected
        assert ours.chat_ids(messages, **kw) == expected_ids
        TALLY["identical"] += 1
        for f in features(messages, kw):
            TALLY["identical with"][f] = TALLY["identical with"].get(f, 0) + 1

    check()


# ------------------------------------------------------------------------------------------------ options, tools

QWEN3 = next(p for p in TEMPLATES if p.name == "Qwen-Qwen3-0.6B.jinja").read_text()


@pytest.mark.parametrize("option", list(REFUSED_OPTIONS))
def test_options_refimpl_lacks_are_refused(option, tokenizers):
    ours = tokenizers[0](QWEN3, "qwen3")
    with pytest.raises(InputError, match=f"option {option}= is transformers'"):
        ours.apply_chat_template("hi", **{option: False})


def test_continue_final_message_and_chat_template_name(tokenizers):
    make, theirs = tokenizers
    ours = make({"default": QWEN3, "other": "{{ messages[-1].content }}!"}, "two")
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel",
                                                "reasoning_content": "think"}]
    for kw in ({"continue_final_message": True}, {"continue_final_message": "reasoning_content"},
               {"chat_template": QWEN3, "continue_final_message": True}):
        expected = theirs.apply_chat_template(chat, tokenize=False, **{**kw, "chat_template": QWEN3})
        assert ours.apply_chat_template(chat, **kw) == expected
    assert ours.apply_chat_template(chat, continue_final_message=True).endswith("Hel")
    assert ours.apply_chat_template(chat, chat_template="other") == "Hel!"
    with pytest.raises(InputError, match="exclude each other"):
        ours.apply_chat_template(chat, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(InputError, match="a batch of chats"):
        ours.apply_chat_template([chat, chat])


def test_template_failure_names_the_template_and_the_message(tokenizers):
    ours = tokenizers[0]({"default": QWEN3, "tool_use": QWEN3}, "tok.json")
    chat = [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}]}]
    with pytest.raises(InputError, match=r"^tok.json: chat template 'tool_use' failed at message 1: "
                                         r"UndefinedError: 'list object' has no attribute 'startswith'$"):
        ours.apply_chat_template(chat, tools=[])


class Colour(enum.Enum):
    RED = "red"
    ONE = 1


class Tools:
    def paint(self, colour: Colour, sizes: list[int], at: tuple[float, str] | None = None,
              extra: dict[str, bool] | None = None, mode: int | str = 0) -> None:
        """Paint something.

        Args:
            colour: The colour
            sizes: Sizes to paint (choices: [1, 2, 3])
            at: Where
            extra: Flags
                for the painter
            mode: The mode
        """


    @classmethod
    def locate(cls, names: "list[str]", depth: Union[int, list[int]] = 1, anything: Any = None,
               flag: Literal["a", 1, True] = "a") -> "Tools":
        """Locate things,
        over two lines.

        Args:
            names: The names
            depth: How deep
            anything: Whatever
            flag: A flag
        Raises:
            ValueError: never
        """


def ping() -> int:
    """Ping."""


def no_hint(x):
    """No hint.

    Args:
        x: x
    """


def no_description(x: int):
    """Only a description."""


def one_tuple(x: tuple[int]):
    """A one-element tuple.

    Args:
        x: x
    """


def custom(x: Tools):
    """A custom class.

    Args:
        x: x
    """


def test_functions_as_tools_have_transformers_schemas():
    from transformers.utils import get_json_schema

    from refimpl.formats.tool_schema import tool_schema
    for f in (get_weather, Tools().paint, Tools.locate, ping):
        assert tool_schema(f) == get_json_schema(f)
    for f in (no_hint, no_description, custom, one_tuple, lambda: None):
        with pytest.raises(Exception):  # noqa: B017 — transformers refuses each
            get_json_schema(f)
        with pytest.raises(InputError, match="tool"):
            tool_schema(f)


@dataclasses.dataclass
class Reading:
    when: datetime.date
    value: np.float32


def test_inputs_are_converted_as_transformers_converts_them(tokenizers):
    """The issue's cases: NumPy scalars in tool-call arguments, a tool reply holding a date, bytes, an array and a
    dataclass; a function as a tool; enable_thinking as np.bool_."""
    make, theirs = tokenizers
    qwq = next(p for p in TEMPLATES if p.name == "Qwen-QwQ-32B.jinja").read_text()
    ours = make(qwq, "qwq")
    chat = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                "name": "get_weather", "arguments": {"city": np.str_("Paris"), "days": np.int64(3)}}}]},
            {"role": "tool", "content": {"when": datetime.date(2024, 2, 29), "raw": b"\x00", "grid": np.zeros(2),
                                         "reading": Reading(datetime.date(2024, 1, 1), np.float32(0.5))}}]
    kw = {"tools": [get_weather], "enable_thinking": np.bool_(False), "add_generation_prompt": True}
    text = ours.apply_chat_template(chat, **kw)
    assert text == theirs.apply_chat_template(chat, chat_template=qwq, tokenize=False, **kw)
    assert '"arguments": {"city": "Paris", "days": 3}' in text
    assert "{'when': '<date>', 'raw': '<bytes>', 'grid': '<ndarray>', 'reading': {'when': '<date>', 'value': 0.5}}" \
        in text
    assert '"description": "How many days ahead (0 for today)"' in text and text.endswith("<think>\n</think>")
    assert chat[2]["content"]["raw"] == b"\x00"      # the caller's messages are left as they were
