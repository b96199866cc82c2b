"""Errors refimpl raises on bad input.

Every message names what is wrong and where: the file, the tensor or field, the expected and the actual
value. The CLI prints the message on one line and exits 2.
"""


MAX_MESSAGE = 900


class RefimplError(Exception):
    """Base class: bad input that refimpl detected and explained. The message is one line whatever it quotes (a
    file name or a value holding a line break is shown with the break escaped), and at most MAX_MESSAGE characters
    (a huge quoted value is cut in the middle: the start names the file, the end what was expected)."""

    def __init__(self, *args):
        super().__init__(*(_one_line(a) if isinstance(a, str) else a for a in args))


def _one_line(text: str) -> str:
    text = text.replace("\r", "\\r").replace("\n", "\\n")
    if len(text) <= MAX_MESSAGE:
        return text
    keep = (MAX_MESSAGE - 5) // 2
    return f"{text[:keep]} ... {text[-keep:]}"


class ConfigError(RefimplError):
    """A config.json (or GGUF metadata) that is malformed, incomplete or unsupported."""


class WeightsError(RefimplError):
    """A checkpoint that is missing a tensor, or holds one of the wrong shape or dtype."""


class FormatError(RefimplError):
    """A file that is not what it claims to be: truncated, corrupt or of an unknown format."""


class InputError(RefimplError):
    """Bad arguments to a forward pass, a CLI command or a convention (ids, masks, shapes)."""


def brief(value, limit: int = 80) -> str:
    """repr(value) cut to `limit` characters: a message quotes bad input without repeating a huge or deeply nested
    document (whose repr could itself fail)."""
    try:
        text = repr(value) if not isinstance(value, (dict, list)) or len(value) < 64 else \
            f"<{type(value).__name__} of {len(value)} items>"
    except RecursionError:
        text = f"<deeply nested {type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 4] + " ..."
