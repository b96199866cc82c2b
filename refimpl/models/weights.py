"""Weights: HF checkpoint name -> array in the compute dtype, loaded lazily.

Stored arrays (memory maps, or in-memory arrays for presets) are converted to the compute dtype on first use
(then rounded or fake-quantised when a precision policy emulates bf16 / fp16 / integer weights) and kept; a float32 checkpoint in float32 mode is used in place, with no copy at all.
Names are the checkpoint's own; the multimodal prefix `model.language_model.` is mapped to `model.`, and
`mtp.*` (multi-token prediction) and `model.visual.*` tensors are set aside, not loaded.
"""

import hashlib
import re
import warnings

import numpy as np

from ..errors import WeightsError

FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")


class NonFiniteWeightWarning(UserWarning):
    """A checkpoint tensor holds NaN or Inf values: the forward pass propagates them as IEEE arithmetic does."""


def warn_nonfinite(source: str, name: str, a: np.ndarray) -> None:
    """Warn, naming the tensor, when a weight holds NaN / Inf (one pass over it; silent when all are finite)."""
    finite = np.isfinite(a)
    if finite.all():
        return
    nan = int(np.isnan(a).sum())
    pos = int(np.isposinf(a).sum())
    where = np.unravel_index(int(np.argmin(finite)), a.shape) if a.ndim else ()
    counts = ", ".join(f"{n} {what}" for n, what in ((nan, "NaN"), (pos, "+Inf"), (a.size - int(finite.sum()) - nan -
                                                                                   pos, "-Inf")) if n)
    warnings.warn(f"{source}: tensor {name!r} holds {counts} of {a.size} values (first at {list(map(int, where))}); "
                  f"the forward pass carries them as IEEE arithmetic does", NonFiniteWeightWarning, stacklevel=3)
_SET_ASIDE = re.compile(r"^(mtp\.|model\.visual\.|visual\.|model\.mtp\.)")


class Weights:
    def __init__(self, stored: dict[str, np.ndarray], dtype="float32", source: str = "<memory>", transform=None):
        self.dtype = np.dtype(dtype)
        self.source = source
        self.transform = transform  # (name, array) -> array: weight emulation of a precision policy, or None
        self.stored: dict[str, np.ndarray] = {}
        self.set_aside: list[str] = []
        for name, array in stored.items():
            if _SET_ASIDE.match(name):
                self.set_aside.append(name)
                continue
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model."):]
            self.stored[name] = array
        self._converted: dict[str, np.ndarray] = {}
        self.aliases: dict[str, str] = {}  # name -> stored name it reads (a tied lm_head quantised on its own)

    def __contains__(self, name: str) -> bool:
        return name in self.stored

    def __getitem__(self, name: str) -> np.ndarray:
        out = self._converted.get(name)
        if out is None:
            try:
                raw = self.stored[self.aliases.get(name, name)]
            except KeyError:
                raise WeightsError(f"{self.source}: missing tensor {name!r}") from None
            if not isinstance(raw, np.ndarray):   # a lazy tensor (GGUF: dequantised / transformed on first use)
                raw = np.asarray(raw)
            out = raw if raw.dtype == self.dtype else raw.astype(self.dtype)
            warn_nonfinite(self.source, name, out)
            if self.transform is not None:
                out = self.transform(name, out)
            self._converted[name] = out
        return out

    def expert(self, prefix: str, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate [Ie, H], up [Ie, H], down [H, Ie]) of expert e under `prefix` (e.g. model.layers.0.mlp.experts),
        from per-expert tensors or the fused gate_up_proj [E, 2Ie, H] / down_proj [E, H, Ie]."""
        if f"{prefix}.{e}.gate_proj.weight" in self.stored:
            return tuple(self[f"{prefix}.{e}.{p}_proj.weight"] for p in ("gate", "up", "down"))
        gate_up = self[f"{prefix}.gate_up_proj"][e]
        half = gate_up.shape[0] // 2
        return gate_up[:half], gate_up[half:], self[f"{prefix}.down_proj"][e]

    def check(self, expected: dict[str, tuple]) -> None:
        """Every expected tensor present, floating point, of the expected shape; fused experts may be stored
        per expert instead. Reads headers only."""
        for name, shape in expected.items():
            if name not in self.stored and self._check_per_expert(name, shape):
                continue
            if name not in self.stored:
                raise WeightsError(f"{self.source}: missing tensor {name!r} (expected shape {list(shape)})")
            self._check_one(name, shape)

    def _check_one(self, name, shape):
        a = self.stored[name]
        if a.dtype.name not in FLOAT_DTYPES:
            raise WeightsError(f"{self.source}: tensor {name!r} has dtype {a.dtype.name}, expected a float type "
                               f"(F32, F16, BF16)")
        if tuple(a.shape) != tuple(shape):
            raise WeightsError(f"{self.source}: tensor {name!r} has shape {list(a.shape)}, expected {list(shape)}")

    def _check_per_expert(self, name, shape) -> bool:
        m = re.match(r"^(.*\.experts)\.(gate_up_proj|down_proj)$", name)
        if not m or f"{m.group(1)}.0.gate_proj.weight" not in self.stored:
            return False
        E = shape[0]
        parts = {"gate_up_proj": (("gate", (shape[1] // 2, shape[2])), ("up", (shape[1] // 2, shape[2]))),
                 "down_proj": (("down", tuple(shape[1:])),)}[m.group(2)]
        for e in range(E):
            for proj, s in parts:
                sub = f"{m.group(1)}.{e}.{proj}_proj.weight"
                if sub not in self.stored:
                    raise WeightsError(f"{self.source}: missing tensor {sub!r} (expected shape {list(s)})")
                self._check_one(sub, s)
        return True

    def sha256(self) -> str:
        """Digest of every stored tensor (name, dtype, shape, bytes), in name order."""
        h = hashlib.sha256()
        for name in sorted(self.stored):
            a = np.ascontiguousarray(self.stored[name])
            h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
            h.update(a.view(np.uint8).reshape(-1).data if a.size else b"")
        return h.hexdigest()

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.stored.values())
