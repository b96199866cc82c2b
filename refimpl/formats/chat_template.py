"""A checkpoint's Jinja chat template, rendered as transformers 5.23 renders it (`apply_chat_template`).

Where a checkpoint directory keeps its template (transformers' loading order): `chat_template.jinja` (and named
ones in `additional_chat_templates/*.jinja`) take priority over `tokenizer_config.json`'s "chat_template" (a
string, or a list of {"name", "template"}); a processor's `chat_template.json` is read last. Several templates:
"tool_use" when tools are given and it exists, else "default". A GGUF keeps one in `tokenizer.chat_template`.

Rendering: jinja2's sandbox with trim_blocks and lstrip_blocks, the loopcontrols extension and transformers'
`{% generation %}` block (its body rendered as is); `tojson` is json.dumps (ensure_ascii=False, optional indent,
separators, sort_keys: no HTML escaping); `raise_exception(msg)` fails the render; `strftime_now(fmt)` is the
local time. The template sees `messages` (keys whose value is None dropped; a message's reasoning under
"reasoning_content", "thinking" or "reasoning" is given under both "reasoning_content" and "thinking"), `tools`,
`documents`, `add_generation_prompt`, the named special tokens (bos_token, eos_token, unk_token, sep_token,
pad_token, cls_token, mask_token: their text) and any extra variable (e.g. enable_thinking=False), which wins
over a special token of the same name. The rendered text is encoded without adding special tokens.
"""

import datetime
import functools
import json
from pathlib import Path

from ..errors import FormatError, InputError

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING = ("reasoning_content", "thinking", "reasoning")


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
    """The named special tokens' text (a token is stored as a string or as an AddedToken dict with "content")."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def select(template, tools=None, source: str = "") -> str:
    """The template to render: the only one, or of several "tool_use" (when tools are given) / "default"."""
    if isinstance(template, dict):
        if tools is not None and "tool_use" in template:
            return template["tool_use"]
        if "default" not in template:
            raise InputError(f"{source}: several chat templates ({', '.join(sorted(template))}) and none is "
                             f"'default'")
        return template["default"]
    if not template:
        raise InputError(f"{source}: this tokenizer has no chat template")
    return template


def render(template: str, messages, *, tools=None, documents=None, add_generation_prompt: bool = False,
           special_tokens: dict | None = None, source: str = "", **variables) -> str:
    """The chat as the template writes it (see the module doc for what the template sees)."""
    import jinja2  # lazy (heavy third-party): imported only when a checkpoint's own template is rendered
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InputError("a chat is a non-empty list of messages")
    chat = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InputError(f"chat message {k} must be a dict, got {type(m).__name__}")
        m = {key: value for key, value in m.items() if value is not None}
        reasoning = next((m[key] for key in _REASONING if key in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        chat.append(m)
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise InputError("tools must be JSON schemas (dicts)")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise InputError("documents must be dicts (e.g. with 'title' and 'text')")
    try:
        return _compile(template).render(messages=chat, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt,
                                         **{**(special_tokens or {}), **variables})
    except jinja2.TemplateError as e:
        raise InputError(f"{source or 'chat template'}: {type(e).__name__}: {e}") from None


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2  # lazy, as in render
    import jinja2.ext
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
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise FormatError(f"chat template, line {e.lineno}: {e.message}") from None
