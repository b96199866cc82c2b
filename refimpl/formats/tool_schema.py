"""A Python function as a chat-template tool: its JSON schema from its signature and Google-style docstring, as
transformers 5.23's `get_json_schema` (transformers/utils/chat_template_utils.py) builds it.

    {"type": "function", "function": {"name": f.__name__, "description": <the docstring before Args:>,
     "parameters": {"type": "object", "properties": {arg: {<its type>, "description": <its Args: line>}},
                    "required": [<args without a default>]},
     "return": {<the return type>, "description": <Returns:>}}}        (return only when its hint converts)

Type hints: int "integer", float "number", str "string", bool "boolean", None "null", list / tuple "array",
dict "object", Any {}, PIL's Image "image", torch.Tensor "audio" (recognised by name: refimpl imports neither);
list[X] adds "items", tuple[X, Y] "prefixItems", dict[K, V] "additionalProperties"; an Enum class or
Literal[...] is an "enum" of its values (with their JSON types); Optional / Union of plain types is a list of
types (sorted), of others "anyOf", plus "nullable" when None is one of them. A description ending in
`(choices: [...])` (JSON) becomes an "enum". A self / cls first argument without a hint is skipped. Anything
else (no docstring, an argument without a hint or without a description, a custom class) is an InputError.
"""

import inspect
import json
import re
import types
from enum import Enum
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from ..errors import InputError

# the docstring sections, as transformers' regexes cut them
DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
ARGS = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
ARG_SPLIT = re.compile(r"(?:^|\n)([ \t]*)(\w+):\s*(.*?)\s*(?=\n(?!\1[ \t])[ \t]*\w+:|\Z)", re.DOTALL)
RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)

JSON_SCALAR_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
PLAIN_TYPES = {int: {"type": "integer"}, float: {"type": "number"}, str: {"type": "string"},
               bool: {"type": "boolean"}, type(None): {"type": "null"}, list: {"type": "array"},
               tuple: {"type": "array"}, dict: {"type": "object"}, Any: {}}
NAMED_TYPES = {("PIL.Image", "Image"): {"type": "image"}, ("torch", "Tensor"): {"type": "audio"}}


class HintError(ValueError):
    """A type hint with no JSON schema."""


def tool_schema(func) -> dict:
    """The tool JSON schema of a function or method (see the module doc)."""
    name = getattr(func, "__name__", "operation")
    try:
        doc = inspect.getdoc(func)
        if not doc:
            raise InputError(f"tool {name}: a function given as a tool needs a docstring (its description)")
        description, arg_docs, return_doc = parse_docstring(doc.strip())
        parameters = _parameters(func, name)
    except HintError as e:
        raise InputError(f"tool {name}: {e}") from None
    except (NameError, TypeError, ValueError) as e:   # get_type_hints / inspect.signature of a broken function
        raise InputError(f"tool {name}: cannot read its signature ({type(e).__name__}: {e})") from None
    returned = parameters["properties"].pop("return", None)
    if returned is not None and return_doc is not None:
        returned["description"] = return_doc
    for arg, schema in parameters["properties"].items():
        if arg not in arg_docs:
            raise InputError(f"tool {name}: the docstring has no description for the argument '{arg}' (Args:)")
        text = arg_docs[arg]
        choices = CHOICES.search(text)
        if choices:
            try:
                values = json.loads(choices.group(1))
                schema["enum"] = [c.strip() if isinstance(c, str) else c for c in values]
            except (ValueError, TypeError) as e:
                raise InputError(f"tool {name}: argument '{arg}': (choices: ...) is not a JSON list ({e})") from None
            text = text[:choices.start()].strip()
        schema["description"] = text
    out = {"name": name, "description": description, "parameters": parameters}
    if returned is not None:
        out["return"] = returned
    return {"type": "function", "function": out}


def parse_docstring(doc: str) -> tuple:
    """(description or None, {argument: description}, returns or None) of a Google-style docstring."""
    description, args, returns = DESCRIPTION.search(doc), ARGS.search(doc), RETURNS.search(doc)
    arg_docs = {}
    if args is not None:
        block = "\n".join(line for line in args.group(1).split("\n") if line.strip())
        arg_docs = {m[1]: re.sub(r"\s*\n+\s*", " ", m[2].strip()) for m in ARG_SPLIT.findall(block)}
    return (description.group(1).strip() if description else None, arg_docs,
            returns.group(1).strip() if returns else None)


def _parameters(func, name: str) -> dict:
    """{"type": "object", "properties", "required"} from the signature's hints."""
    hints = get_type_hints(func)
    signature = inspect.signature(func)
    first = next(iter(signature.parameters), None)
    implicit = first if first in {"self", "cls"} and \
        signature.parameters[first].annotation == inspect.Parameter.empty else None
    required = []
    for arg, p in signature.parameters.items():
        if arg == implicit:
            continue
        if p.annotation == inspect.Parameter.empty:
            raise HintError(f"argument {arg} has no type hint")
        if p.default == inspect.Parameter.empty:
            required.append(arg)
    properties = {}
    for arg, hint in hints.items():
        if arg == implicit:
            continue
        if arg == "return":     # the model never writes the return value: a hint without a schema is left out
            try:
                properties[arg] = hint_schema(hint)
            except HintError:
                pass
        else:
            properties[arg] = hint_schema(hint)
    out = {"type": "object", "properties": properties}
    if required:
        out["required"] = required
    return out


def _enum(values: list) -> dict:
    kinds = list(dict.fromkeys(JSON_SCALAR_TYPES[type(v)] for v in values))   # each JSON type once, first seen first
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def hint_schema(hint) -> dict:
    """The JSON schema of one type hint."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is None and isinstance(hint, type) and issubclass(hint, Enum):
        values = [member.value for member in hint]
        if not values:
            raise HintError(f"the Enum {hint.__name__} has no members")
        if any(type(v) not in JSON_SCALAR_TYPES for v in values):
            raise HintError(f"the Enum {hint.__name__} has values that are not JSON scalars: {values}")
        return _enum(values)
    if origin is None:
        found = PLAIN_TYPES.get(hint) if _hashable(hint) else None
        if found is None and isinstance(hint, type):
            found = NAMED_TYPES.get((hint.__module__, hint.__qualname__))
        if found is None:
            raise HintError(f"no JSON schema for the type hint {hint!r} (a custom class?)")
        return dict(found)
    if origin is Union or origin is types.UnionType:
        subtypes = [hint_schema(t) for t in args if t is not type(None)]
        if len(subtypes) == 1:
            out = subtypes[0]
        elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subtypes):
            names = sorted({s["type"] for s in subtypes})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": subtypes}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is Literal and args:
        if any(type(a) not in JSON_SCALAR_TYPES for a in args):
            raise HintError("only JSON scalars can be listed in typing.Literal")
        return _enum(list(args))
    if origin is list:
        return {"type": "array", "items": hint_schema(args[0])} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1:
            raise HintError(f"{str(hint).replace('typing.', '')} is a tuple of one element (use the element or a list)")
        if ... in args:
            raise HintError("'...' in a tuple hint (use a list for a variable length)")
        return {"type": "array", "prefixItems": [hint_schema(t) for t in args]}
    if origin is dict:
        return {"type": "object", **({"additionalProperties": hint_schema(args[1])} if len(args) == 2 else {})}
    raise HintError(f"no JSON schema for the type hint {hint!r}")


def _hashable(x) -> bool:
    try:
        hash(x)
        return True
    except TypeError:
        return False
