"""Named taps of every intermediate tensor, recorded only while a `trace()` is active.

    with refimpl.trace() as tr:
        model.forward(ids)
    tr["model.layers.0.self_attn.q_norm"]

A tap is `<module path>.<what>` from the checkpoint's module tree (see docs/taps.md for the list). When no
trace is active, `tap` returns after one truthiness check: the name is not even formatted.

Teacher forcing (refimpl.diff.replay): `trace(overrides={name: array})` records the reference's own value of
each tap but hands the override on to the rest of the forward pass, so downstream ops run on the given
(e.g. a device's dumped) tensor. Every tap's return value is what the model computes with.
"""

import contextlib
import re

import numpy as np

from .errors import InputError

_active: list["Trace"] = []


class Trace:
    """Taps in execution order. `tr[name]` is the latest value of that tap; `tr.records` holds all of them
    (a trace over several forward calls records each call's taps in turn)."""

    def __init__(self, pattern: str | None = None, overrides: dict | None = None):
        self.pattern = re.compile(pattern) if pattern else None
        self.overrides = overrides or {}
        self.records: list[tuple[str, np.ndarray]] = []
        self._latest: dict[str, np.ndarray] = {}

    def record(self, name: str, value) -> None:
        if self.pattern is not None and not self.pattern.search(name):
            return
        value = np.array(value, copy=True)
        self.records.append((name, value))
        self._latest[name] = value

    def __getitem__(self, name: str) -> np.ndarray:
        return self._latest[name]

    def __contains__(self, name: str) -> bool:
        return name in self._latest

    def __len__(self) -> int:
        return len(self._latest)

    def names(self) -> list[str]:
        """Distinct tap names in first-recorded order."""
        return list(self._latest)

    def all(self, name: str) -> list[np.ndarray]:
        return [v for n, v in self.records if n == name]


@contextlib.contextmanager
def trace(pattern: str | None = None, overrides: dict | None = None):
    """Record every tap (or those whose name matches the regex `pattern`) until the block ends; taps named
    in `overrides` pass the given array downstream instead of their computed value (teacher forcing)."""
    t = Trace(pattern, overrides)
    _active.append(t)
    try:
        yield t
    finally:
        _active.remove(t)


def tracing() -> bool:
    return bool(_active)


def tap(prefix: str, what: str | None, value):
    """Record `value` as `prefix.what` (or `prefix` when what is None) in every active trace; return the
    value the forward pass continues with: `value`, or an active trace's override of that name."""
    if _active:
        name = prefix if what is None else f"{prefix}.{what}"
        for t in _active:
            t.record(name, value)
        given = override(name)
        if given is not None:
            return conform(name, given, value)
    return value


def override(name: str):
    """The override of tap `name` in the innermost active trace that has one, else None."""
    for t in reversed(_active):
        if name in t.overrides:
            return t.overrides[name]
    return None


def conform(name: str, given, value: np.ndarray) -> np.ndarray:
    given = np.asarray(given)
    if given.shape != value.shape:
        raise InputError(f"override of tap {name!r}: shape {list(given.shape)}, the forward pass has "
                         f"{list(value.shape)}")
    return given.astype(value.dtype, copy=False)
