"""A checkpoint's Jinja chat template, rendered as transformers 5.23 renders it (`apply_chat_template`).

Where a checkpoint directory keeps its template (transformers' loading order): `chat_template.jinja` (and named
ones in `additional_chat_templates/*.jinja`) take priority over `tokenizer_config.json`'s "chat_template" (a
string, or a list of {"name", "template"}); a processor's `chat_template.json` is read last. Several templates:
"tool_use" when tools are given and it exists, else "default". A GGUF keeps one in `tokenizer.chat_template`.

Rendering: jinja2's sandbox with trim_blocks and lstrip_blocks, the loopcontrols extension and transformers'
`{% generation %}` block (its body rendered as is); `tojson` is json.dumps (ensure_ascii=False, optional indent,
separators, sort_keys: no HTML escaping); `raise_exception(msg)` fails the render; `strftime_now(fmt)` is the
local time; `dict(...)` / `dict.fromkeys` and `namespace(...)` (no underscore-prefixed names). The template sees
`messages` (keys whose value is None dropped; a message's reasoning under "reasoning_content", "thinking" or
"reasoning" is given under both "reasoning_content" and "thinking"), `tools`, `documents`,
`add_generation_prompt`, the named special tokens (bos_token, eos_token, unk_token, sep_token, pad_token,
cls_token, mask_token: their text) and any extra variable (e.g. enable_thinking=False), which wins over a special
token of the same name. The rendered text is encoded without adding special tokens.

Converted first, as transformers converts them: every value the template sees goes through `template_data`
(NumPy scalars -> Python values, str / int / float subclasses -> the base type, dataclasses and pydantic models ->
dicts, anything else, e.g. a date, bytes or an array -> a placeholder "<date>", "<bytes>", "<ndarray>"); a
function or method among the tools becomes its JSON schema (refimpl/formats/tool_schema.py, as get_json_schema).

continue_final_message (True: the final message's "content"; a str: that field, e.g. "reasoning_content"): the
text ends inside the final message (no end-of-turn after it), for the model to continue it; it excludes
add_generation_prompt. `chat_template=` picks one of several templates by name or gives a template. The other
options of transformers' apply_chat_template (REFUSED_OPTIONS) are refused, never ignored; a batch of chats is
refused (render each). Whatever fails inside the template (its own raise_exception, a jinja2 error, a TypeError
of its code) is one InputError naming the tokenizer, the template (when there are several) and the message
the template was at.
"""

import dataclasses
import datetime
import functools
import inspect
import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..errors import FormatError, InputError, brief
from .tool_schema import tool_schema

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING = ("reasoning_content", "thinking", "reasoning")
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "   # transformers' marker of where the continued message ends
# transformers' apply_chat_template options that refimpl does not have -> why (refused when given, even a default)
REFUSED_OPTIONS = {
    "tokenize": "apply_chat_template returns the text, chat_ids the ids",
    "return_dict": "chat_ids returns the ids as a list",
    "return_tensors": "chat_ids returns the ids as a list",
    "padding": "one chat, nothing to pad",
    "truncation": "refimpl never truncates a chat",
    "max_length": "refimpl never truncates a chat",
    "tokenizer_kwargs": "the text is encoded as transformers encodes it by default",
    "return_assistant_tokens_mask": "no assistant mask ({% generation %} renders its body only)",
    "sanitize_control_tokens": "control tokens in the input are encoded as control tokens",
}


def read_chat_templates(directory: str | Path) -> tuple[str | dict | None, dict]:
    """(template: a str, a {name: template} dict or None; special tokens {name: text}) of a checkpoint directory."""
    directory = Path(directory)
    config = _json(directory / "tokenizer_config.json")
    templates = {}
    if (directory / "chat_template.jinja").is_file():
        templates["default"] = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if (directory / "additional_chat_templates").is_dir():
        for f in sorted((directory / "additional_chat_templates").glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if not templates:
        found = config.get("chat_template")
        if found is None:
            found = _json(directory / "chat_template.json").get("chat_template")
        if isinstance(found, list):
            try:
                found = {t["name"]: t["template"] for t in found}
            except (KeyError, TypeError):
                raise FormatError(f"{directory / 'tokenizer_config.json'}: chat_template is a list but not of "
                                  f"{{name, template}} entries") from None
        if found is not None and not isinstance(found, (str, dict)):
            raise FormatError(f"{directory / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                              f"templates, got {type(found).__name__}")
        templates = found if isinstance(found, dict) else {"default": found} if found else {}
    template = templates.get("default") if list(templates) == ["default"] else templates or None
    special = {**_special_tokens(_json(directory / "special_tokens_map.json")), **_special_tokens(config)}
    return template, special


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise FormatError(f"{path}: expected a JSON object")
    return out


def _special_tokens(config: dict) -> dict:
    """The named special tokens' text, as transformers' special_tokens_map gives them to the template: the standard
    names, any other "..._token" key whose value is a token (e.g. a multimodal "image_token") and the named
    "extra_special_tokens" (a token is stored as a string or as an AddedToken dict with "content")."""
    extra = config.get("extra_special_tokens")
    named = {**{k: v for k, v in config.items() if k in SPECIAL_TOKEN_NAMES or k.endswith("_token")},
             **(extra if isinstance(extra, dict) else {})}
    out = {}
    for name, value in named.items():
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def choose(template, requested=None, tools=None, source: str = "") -> tuple[str, str]:
    """(name, text) of the template to render, as transformers' get_chat_template picks it: `requested` names one
    of several templates or is a template itself; otherwise the only one, or of several "tool_use" (when tools
    are given) / "default". The name ("" for a single or given template) labels errors."""
    if isinstance(template, dict):
        if requested is not None:
            return (requested, template[requested]) if requested in template else ("", requested)
        if tools is not None and "tool_use" in template:
            return "tool_use", template["tool_use"]
        if "default" not in template:
            raise InputError(f"{source}: several chat templates ({', '.join(sorted(template))}) and none is "
                             f"'default': pass chat_template=<name>")
        return "default", template["default"]
    if requested is not None:
        return "", requested
    if not template:
        raise InputError(f"{source}: this tokenizer has no chat template")
    return "", template


def render(template: str, messages, *, tools=None, documents=None, add_generation_prompt=False,
           continue_final_message: bool | str = False, special_tokens: dict | None = None, source: str = "",
           name: str = "", **variables) -> str:
    """The chat as the template writes it (see the module doc for what the template sees and what is converted).
    source / name label errors (the tokenizer's file and the template's name among several)."""
    label = f"{source or 'chat template'}{f' (chat template {name!r})' if name else ''}"
    refused = [option for option in REFUSED_OPTIONS if option in variables]
    if refused:
        raise InputError(f"{label}: apply_chat_template option {refused[0]}= is transformers' and refimpl does not "
                         f"have it ({REFUSED_OPTIONS[refused[0]]})")
    if not isinstance(template, str):
        raise InputError(f"{label}: a chat template is a str, got {type(template).__name__}")
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InputError(f"{label}: a chat is a non-empty list of messages, got {brief(messages)}")
    if isinstance(messages[0], (list, tuple)) or hasattr(messages[0], "messages"):
        raise InputError(f"{label}: a batch of chats (a list of lists of messages): render each chat on its own")
    chat = []
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InputError(f"{label}: chat message {k} must be a dict, got {type(m).__name__}")
        chat.append({key: value for key, value in m.items() if value is not None})   # None values dropped
    if continue_final_message and add_generation_prompt:
        raise InputError(f"{label}: continue_final_message and add_generation_prompt exclude each other (continue "
                         f"the last message, or open a new assistant turn)")
    compiled = _compile(template, label)
    tools = _tool_schemas(tools, label)
    if documents is not None:
        try:
            bad = next((d for d in documents if not isinstance(d, dict)), None)
        except TypeError:
            raise InputError(f"{label}: documents must be a list of dicts, got {brief(documents)}") from None
        if bad is not None:
            raise InputError(f"{label}: documents must be dicts (e.g. with 'title' and 'text'), got {brief(bad)}")
    tools, documents, chat = template_data(tools, label), template_data(documents, label), template_data(chat, label)
    variables = template_data({**(special_tokens or {}), **variables}, label)   # a variable wins over a token
    chat = [_alias_reasoning(m) for m in chat]
    final = None
    if continue_final_message:
        final = _mark_final(chat, template, "content" if not isinstance(continue_final_message, str)
                            else continue_final_message, label)
    try:
        text = compiled.render(messages=chat, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **variables)
    except Exception as e:  # anything the template's code raises (its raise_exception, jinja2, TypeError, ...)
        k = _message_index(e, chat)
        where = f"at message {k}" if k is not None else "outside any message"
        what = "raise_exception" if isinstance(e, _raised()) else type(e).__name__
        raise InputError(f"{source or 'chat'}: chat template{f' {name!r}' if name else ''} failed {where}: {what}: "
                         f"{e}") from None
    if final is None:
        return text
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise InputError(f"{label}: continue_final_message: the template dropped (part of) the final message "
                         f"{brief(final.strip())}, so there is nothing to continue")
    at = text.rindex(CONTINUE_TAG.strip())
    # the template kept the spacing after the message: cut at the tag; it trimmed it: cut and trim
    return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


def _tool_schemas(tools, label: str):
    """Tools as the template sees them: JSON schemas (dicts) as given, functions and methods as their schema."""
    if tools is None:
        return None
    try:
        tools = list(tools)
    except TypeError:
        raise InputError(f"{label}: tools must be a list of JSON schemas or functions, got {brief(tools)}") from None
    out = []
    for tool in tools:
        if isinstance(tool, dict):
            out.append(tool)
        elif inspect.isfunction(tool) or inspect.ismethod(tool):
            try:
                out.append(tool_schema(tool))
            except InputError as e:
                raise InputError(f"{label}: {e}") from None
        else:
            raise InputError(f"{label}: a tool is a JSON schema (dict) or a function with type hints and a "
                             f"docstring, got {brief(tool)}")
    return out


def template_data(value, label: str = "chat template"):
    """What the template is given of a value: JSON scalars as they are; subclasses of str / int / float (enums,
    NumPy's str_) as the base type; NumPy scalars as their Python value (np.int64(3) -> 3, np.bool_ -> bool);
    mappings as dicts (keys converted too), lists and tuples item by item; a dataclass as the dict of its fields,
    a pydantic model as its model_dump(); anything else as a placeholder naming its type ("<date>", "<bytes>",
    "<datetime>", "<ndarray>"). The result is a fresh copy, so marking the final message never touches the
    caller's."""
    try:
        return _plain(value)
    except RecursionError:
        raise InputError(f"{label}: an input nests too deeply (or contains itself)") from None
    except TypeError as e:   # a key that is unhashable once converted (a dataclass as a dict key, ...)
        raise InputError(f"{label}: an input cannot be converted for the template ({e})") from None


def _plain(value):
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(m):
    """A message's reasoning (under any of _REASONING) also under "thinking" (first) and "reasoning_content"."""
    reasoning = next((m[key] for key in _REASONING if m.get(key) is not None), None)
    return m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning}


def _mark_final(chat: list, template: str, field: str, label: str) -> str:
    """continue_final_message: CONTINUE_TAG appended to the final message's `field` (every reasoning alias of
    it; in a list of parts, the last part with "text"), which the text is cut at after rendering. Returns the
    text continued."""
    last = chat[-1]
    final = last.get(field)
    if final is None:
        raise InputError(f"{label}: continue_final_message: the final message has no {field!r} to continue")
    fields = [f for f in _REASONING if last.get(f) == final] if field in _REASONING else [field]
    if not any(f in template for f in fields):
        raise InputError(f"{label}: continue_final_message={field!r}, but the template never reads {field!r}")
    if isinstance(final, (list, tuple)):
        for part in reversed(final):
            if not isinstance(part, (dict, str, list, tuple)):
                raise InputError(f"{label}: continue_final_message: a part of the final message is "
                                 f"{brief(part)}, not a dict")
            if "text" in part:
                if not isinstance(part, dict) or not isinstance(part["text"], str):
                    raise InputError(f"{label}: continue_final_message: the final message's part {brief(part)} "
                                     f"has no text to continue")
                final = part["text"]
                part["text"] = final + CONTINUE_TAG
                return final
        raise InputError(f"{label}: continue_final_message: no part of the final message has text to continue")
    if not isinstance(final, str):
        raise InputError(f"{label}: continue_final_message: the final message's {field!r} is "
                         f"{type(final).__name__}, not text")
    for f in fields:
        last[f] = last[f] + CONTINUE_TAG
    return final


def _message_index(error: BaseException, chat: list) -> int | None:
    """The message the template was at when it failed: the innermost template frame (jinja2 shows the
    template's variables as the frame's locals) holding one of the messages themselves."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for value in frame.f_locals.values():
            for k, m in enumerate(chat):
                if value is m:
                    return k
    return None


def _compile(template: str, label: str):
    import jinja2  # lazy (heavy third-party): imported only when a checkpoint's own template is rendered
    try:
        return _compiled(template)
    except jinja2.TemplateSyntaxError as e:
        raise FormatError(f"{label}: chat template line {e.lineno}: {e.message}") from None


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    """transformers' environment: sandbox, trim_blocks, lstrip_blocks, loopcontrols, {% generation %}, its
    tojson, raise_exception, strftime_now, dict and namespace (no underscore names)."""
    import jinja2  # lazy, as in _compile
    import jinja2.ext
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """transformers' {% generation %} ... {% endgeneration %}: marks the assistant's tokens; renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise _raised()(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        """dict(...) and dict.fromkeys(...) without the dict type itself (transformers' TemplateDict)."""
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class Namespace(jinja2.utils.Namespace):
        """namespace(...) refusing underscore-prefixed attributes (transformers' TemplateNamespace)."""
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for key in attrs:
                Namespace.check(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, key, value):
            Namespace.check(key)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def check(key):
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {key!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt),
                       dict=TemplateDict(), namespace=Namespace)
    return env.from_string(template)


@functools.cache
def _raised():
    """The class of error raise_exception(msg) raises: a jinja2.TemplateError, as transformers' (jinja2 is
    imported lazily, so the class is made on first use)."""
    import jinja2

    class TemplateRaised(jinja2.exceptions.TemplateError):
        """raise_exception(msg) in a template."""
    return TemplateRaised
