"""Weights: HF checkpoint name -> array in the compute dtype, read from storage under a resident budget.

Stored tensors stay where they are, in their stored dtype: read-only memory maps of safetensors files, GGUF
tensors (dequantised when read), or in-memory arrays (presets). A tensor is converted when the forward pass reads
it: bf16 by a 16-bit shift (exact; as fast as ml_dtypes' cast), other floats by a cast; then rounded or
fake-quantised when a precision policy emulates bf16 / fp16 / integer weights (`transform`). A float32
checkpoint in float32 mode is used in place, with no copy at all.

Residency. `budget` bounds the converted bytes held at once: the tensors kept, plus the piece in use. Tensors are
kept in the order the forward pass first reads them while they fit in the budget less `reserve` (the largest
piece read at once); the others are converted each time they are read and dropped after use, so a model larger
than memory runs layer by layer. Three tensors are read in parts, never converted whole unless kept: the
embedding by the rows a call looks up, lm_head in fixed row blocks (`row_blocks`, the same blocks whatever the
budget, so streamed and resident runs compute the same products), and fused MoE experts one routed expert at a
time (`expert`). A budget too small for one piece is refused when the model is built.
Default: keep everything when the converted model fits in half of the machine's memory, else stream under
max(DEFAULT_STREAM_BUDGET, reserve).

Constants of the correctly rounded products (float32 mode, kernels/products.py). A matrix read by `linear` is
handed to the product kernel as a products.Constant: its column norms (the per-weight quantities of the error
bound, 1 / K of its size) are computed on first use and kept for every later product, streamed or not; and when
the whole model is resident and the model plus float64 copies of its matrices still fit the budget (the default:
half of memory), each matrix's float64 copy is kept too (`float64_copies`), so no product converts it again.
Stored tensors are constants: replacing an entry of `stored` is noticed, changing an array in place is not
(call `drop`).

Stored tensors are numpy arrays or objects with `shape`, `dtype` (what `read` returns), `nbytes` (stored bytes),
`read(index=None)`: the tensor, or part `index` (int, slice or int array) of its leading axis, as a float array,
and `partial`: whether reading a part touches only that part (GGUF's LazyTensor).

Names are the checkpoint's own; the multimodal prefix `model.language_model.` is mapped to `model.`, and
`mtp.*` (multi-token prediction) and `model.visual.*` tensors are set aside, not loaded.
"""

import dataclasses
import hashlib
import math
import re
import warnings
from typing import Callable

import numpy as np

from ..errors import WeightsError
from ..kernels import products
from ..kernels.linear import linear
from ..progress import layer_progress
from .experts import FUSED, PER_EXPERT, expert_names, per_expert_tensors, split_gate_up
from .stored import ROW_BLOCK_BYTES, blocks, machine_memory, read, size_text, to_dtype, will_need

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
VECTOR_BLOCK_BYTES = 4 * 2**20          # every matrix's for one token (a block stays in cache for its product)
DEFAULT_STREAM_BUDGET = 2**30           # the default budget of a model that does not fit in half of memory
_ROW_READ = ("model.embed_tokens.weight", "lm_head.weight")   # read by rows: looked-up ids, lm_head blocks


@dataclasses.dataclass(frozen=True)
class Part:
    """What a transform is given with part of a tensor: `index` into the leading axis of the tensor of `shape`,
    and `chunks()`, the whole tensor converted block by block along that axis (for a whole-tensor statistic)."""
    index: object
    shape: tuple
    chunks: Callable


class Weights:
    def __init__(self, stored: dict, dtype="float32", source: str = "<memory>", transform=None,
                 max_resident_bytes: int | None = None, origins: dict | None = None):
        self.dtype = np.dtype(dtype)
        self.source = source
        self.transform = transform  # (name, array, part=None) -> array: a precision policy's weight emulation
        self.stored: dict = {}
        self.origins: dict[str, str] = {}   # name -> the file that holds it (for error messages)
        self.set_aside: list[str] = []
        for name, array in stored.items():
            if _SET_ASIDE.match(name):
                self.set_aside.append(name)
                continue
            origin = (origins or {}).get(name)
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model."):]
            self.stored[name] = array
            if origin is not None:
                self.origins[name] = str(origin)
        self.aliases: dict[str, str] = {}  # name -> stored name it reads (a tied lm_head quantised on its own)
        self.max_resident_bytes = max_resident_bytes
        self._kept: dict = {}               # name, or (name, expert), -> converted array
        self._finite: set = set()           # tensors (and parts) whose values were checked for NaN / Inf
        self.kept_nbytes = 0
        self._plan = None                   # (budget, reserve, largest piece's name), computed on first need
        self._ranges: dict = {}
        self.conversions = 0                # tensors (or parts) converted, and their converted bytes
        self.converted_bytes = 0
        self.conversion_log: list | None = None   # a list: (name, index) of each conversion is appended
        self.float64_copies = True          # keep float64 copies of the matrices when they fit (see the module doc)
        self._constants: dict = {}          # (name, rows) -> (stored tensor, column norms, float64 copy or None)
        self.float64_nbytes = 0             # bytes of the float64 copies kept

    def __contains__(self, name: str) -> bool:
        return name in self.stored

    # ------------------------------------------------------------------------------------------------ reading

    def __getitem__(self, name: str) -> np.ndarray:
        """The whole tensor, converted."""
        out = self._kept.get(name)
        if out is not None:
            return out
        size = self.converted_size(name)
        budget = self.budget
        if size > budget:
            raise WeightsError(f"{self.origin(name)}: tensor {name!r} ({size_text(size)} converted) does not fit the "
                               f"resident budget of {size_text(budget)} (max_resident_bytes)")
        out = self.convert(name)
        if size == 0 or self._fits(size):
            self._keep(name, out, size)
        return out

    def rows(self, name: str, index) -> np.ndarray:
        """Part `index` (int array, slice or int) of the leading axis of tensor `name`, converted: a slice of the
        whole when the whole is kept (or fits and is kept now), else read and converted alone (an expert of a
        fused tensor is then kept if it fits)."""
        whole = self._kept.get(name)
        if whole is None and (self.converted_size(name) == 0 or self._fits(self.converted_size(name))):
            whole = self[name]
        if whole is not None:
            return whole[index]
        key = (name, index) if isinstance(index, (int, np.integer)) else None
        out = self._kept.get(key) if key else None
        if out is None:
            out = self.convert(name, index)
            if key and self._fits(out.nbytes):
                self._keep(key, out, out.nbytes)
        return out

    def row_blocks(self, name: str, tokens: int = 2) -> list[slice]:
        """The row blocks in which a [rows, in] matrix multiplies `tokens` rows of activations: for one token,
        VECTOR_BLOCK_BYTES converted each when it is converted as read (a block is converted and multiplied while
        in cache); for several, or a matrix used in place (stored in the compute dtype: nothing to convert, and
        one BLAS call over the whole reads it fastest), lm_head / a tied embedding in ROW_BLOCK_BYTES blocks and any
        other matrix whole. They depend on shapes and the stored dtype alone, never on the budget: kept and
        streamed tensors compute the same products."""
        shape = self.shape(name)
        in_place = self.converted_size(name) == 0
        if (tokens > 1 or in_place) and name not in _ROW_READ:
            return [slice(0, shape[0])]
        size = VECTOR_BLOCK_BYTES if tokens == 1 and not in_place else ROW_BLOCK_BYTES
        step = max(1, size // (math.prod(shape[1:]) * self.dtype.itemsize))
        return [slice(r, min(r + step, shape[0])) for r in range(0, shape[0], step)]

    def linear(self, x: np.ndarray, name: str, bias: str | None = None) -> np.ndarray:
        """kernels.linear.linear(x, W, b) with W the matrix `name` [out, in] and b the vector `bias` (a name, or
        None): x [..., in] -> [..., out]; a streamed matrix block by block of `row_blocks` (each converted alone),
        a kept one whole when its products are correctly rounded (the product kernel blocks it; the bits are the
        same), else by `row_blocks` too (plain BLAS's and float64's bits may depend on the blocks)."""
        rounded = self.dtype == np.float32 and not products.plain_blas_active()
        whole = rounded and (name in self._kept or self.converted_size(name) == 0 or
                             self._fits(self.converted_size(name)))
        blocks = [None] if whole else self.row_blocks(name, math.prod(x.shape[:-1]))
        b = None if bias is None else self[bias]
        if len(blocks) == 1:
            return linear(x, self.matrix(name), b)
        out = np.empty((math.prod(x.shape[:-1]), self.shape(name)[0]), np.result_type(x.dtype, self.dtype))
        for rows in blocks:                                                     # each block's product in place
            linear(x, self.matrix(name, rows), None if b is None else b[rows], out=out[:, rows])
        return out.reshape(*x.shape[:-1], -1)

    def matrix(self, name: str, rows: slice | None = None):
        """Matrix `name` [out, in] (or its row block `rows`) for `linear`: in float32 mode a products.Constant of
        its transpose, with its column norms (kept after the first use: of the whole matrix when it is kept, else
        of the block) and its float64 copy when `float64_copies_planned`; else the array itself (float64 mode
        and plain BLAS need neither)."""
        W = self[name] if rows is None else self.rows(name, rows)
        if self.dtype != np.float32 or products.plain_blas_active():
            return W
        stored = self._stored(name)
        whole = name in self._kept or self.converted_size(name) == 0
        key = name if whole or rows is None else (name, rows.start, rows.stop)
        hit = self._constants.get(key)
        if hit is None or hit[0] is not stored:
            if hit is not None and hit[2] is not None:
                self.float64_nbytes -= hit[2].nbytes
            c = products.constant((self[name] if whole else W).T, keep_float64=whole and self.float64_copies_planned())
            hit = self._constants[key] = (stored, c.norms, c.b64, c.positive)
            self.float64_nbytes += 0 if c.b64 is None else c.b64.nbytes
        if rows is None or not whole:
            return products.Constant(W.T, *hit[1:])
        return products.Constant(W.T, hit[1][..., rows], None if hit[2] is None else hit[2][:, rows], hit[3])

    def float64_copies_planned(self) -> bool:
        """Whether the matrices' float64 copies are kept: `float64_copies` is on, the model is resident, and the
        converted model plus the copies fit the budget (the default budget: half of the machine's memory)."""
        return self.float64_room() >= 0

    def float64_room(self) -> float:
        """Bytes of the budget left beside the converted model and the matrices' float64 copies (negative, -1 when
        the copies are not kept): what a KV cache's float64 copies may take (Model.new_cache)."""
        if not self.float64_copies or self.dtype != np.float32 or not self.resident:
            return -1
        budget, reserve, _ = self.plan()
        limit = machine_memory() / 2 if budget == math.inf else budget - reserve
        return limit - self.compute_nbytes() - self.float64_copies_nbytes()

    def compute_nbytes(self) -> int:
        """Bytes of the whole model in the compute dtype (converted, or used in place)."""
        return sum(math.prod(self.shape(n)) * self.dtype.itemsize for n in [*self.stored, *self.aliases])

    def float64_copies_nbytes(self) -> int:
        """Bytes of float64 copies of the matrices `linear` reads (2-D tensors; an untied embedding is only
        gathered, never copied)."""
        names = [n for n in [*self.stored, *self.aliases] if len(self.shape(n)) == 2]
        if "lm_head.weight" in names:
            names = [n for n in names if n != "model.embed_tokens.weight"]
        return sum(math.prod(self.shape(n)) * 8 for n in names)

    def expert(self, prefix: str, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate [Ie, H], up [Ie, H], down [H, Ie]) of expert e under `prefix` (e.g. model.layers.0.mlp.experts),
        from per-expert tensors or the fused gate_up_proj [E, 2Ie, H] / down_proj [E, H, Ie] (expert e only)."""
        names = expert_names(prefix, e)
        if names[0] in self.stored:
            return tuple(self[name] for name in names)
        gate, up = split_gate_up(self.rows(f"{prefix}.gate_up_proj", e))
        return gate, up, self.rows(f"{prefix}.down_proj", e)

    def convert(self, name: str, index=None) -> np.ndarray:
        """Tensor `name` (or part `index` of its leading axis) read from storage and converted, transform applied;
        not kept. Logged in `conversion_log` when that is a list."""
        stored = self._stored(name)
        raw = read(stored, index)
        out = to_dtype(raw, self.dtype)
        self._check_finite(name, index, out)
        if self.transform is not None:
            part = None if index is None else Part(index, tuple(stored.shape), lambda: self._chunks(name))
            out = self.transform(name, out, part)
        if out is not raw:
            self.conversions += 1
            self.converted_bytes += out.nbytes
            if self.conversion_log is not None:
                self.conversion_log.append((name, index))
        return out

    def _check_finite(self, name: str, index, out: np.ndarray) -> None:
        """warn_nonfinite on a converted tensor or part, once per tensor / part (streamed tensors are converted on
        every use: their values are checked the first time only); looked-up rows (an index array) every time."""
        key = name if index is None else (name, int(index)) if isinstance(index, (int, np.integer)) else \
            (name, index.start, index.stop, index.step) if isinstance(index, slice) else None
        if key is None or key not in self._finite:
            warn_nonfinite(self.origin(name), name, out)
            if key is not None:
                self._finite.add(key)

    def prefetch(self, names) -> None:
        """Ask the kernel to start reading these tensors (names, or (name, expert index) pairs) from the disk
        while the current layer computes (madvise WILLNEED on the memory map: asynchronous, no data copied). Kept
        tensors and tensors not memory-mapped (presets, dequantised GGUF blocks) are skipped."""
        for item in names:
            name, index = item if isinstance(item, tuple) else (item, None)
            stored = self.stored.get(self.aliases.get(name, name))
            if not isinstance(stored, np.ndarray) or name in self._kept or (name, index) in self._kept:
                continue
            will_need(read(stored, index))

    def prefetch_experts(self, prefix: str, experts) -> None:
        """prefetch the routed experts' matrices under `prefix` (per-expert tensors or fused ones)."""
        if f"{prefix}.gate_up_proj" in self.stored:
            self.prefetch((f"{prefix}.{p}", int(e)) for e in experts for p in ("gate_up_proj", "down_proj"))
        else:
            self.prefetch(name for e in experts for name in expert_names(prefix, int(e)))

    def _chunks(self, name: str):
        """The whole tensor converted (before any transform), leading-axis block by block."""
        for block in blocks(self._stored(name), self.dtype.itemsize):
            yield to_dtype(block, self.dtype)

    def _stored(self, name: str):
        try:
            return self.stored[self.aliases.get(name, name)]
        except KeyError:
            raise WeightsError(f"{self.source}: missing tensor {name!r}") from None

    def shape(self, name: str) -> tuple:
        """A tensor's shape (read from the header: no data)."""
        return tuple(self._stored(name).shape)

    def origin(self, name: str) -> str:
        return self.origins.get(self.aliases.get(name, name), self.source)

    # ------------------------------------------------------------------------------------------------ residency

    def converted_size(self, name: str) -> int:
        """Bytes the tensor takes converted; 0 when it is used in place (stored in the compute dtype, no transform)."""
        stored = self._stored(name)
        if isinstance(stored, np.ndarray) and stored.dtype == self.dtype and self.transform is None:
            return 0
        return math.prod(stored.shape) * self.dtype.itemsize

    def converted_nbytes(self) -> int:
        """Bytes of the whole model converted (what keeping everything costs)."""
        return sum(self.converted_size(n) for n in [*self.stored, *self.aliases])

    def pieces(self) -> dict[str, int]:
        """name -> the converted bytes of the largest piece of it read at once: an lm_head / embedding row block,
        one expert of a fused tensor (with its down_proj: read together), an expert's three matrices, or the
        whole tensor."""
        out = {}
        for name in [*self.stored, *self.aliases]:
            size = self.converted_size(name)
            if size == 0:
                continue
            shape = self.shape(name)
            if name in _ROW_READ:   # its largest block, of one token's products or several's
                rows = max(len(range(*self.row_blocks(name, tokens)[0].indices(shape[0]))) for tokens in (1, 2))
                out[name] = rows * size // shape[0]
            elif m := FUSED.match(name):
                out[name] = sum(self.converted_size(f"{m[1]}.{p}") // shape[0] for p in ("gate_up_proj", "down_proj")
                                if f"{m[1]}.{p}" in self.stored)
            elif m := PER_EXPERT.match(name):
                out[name] = sum(self.converted_size(f"{m[1]}.{p}_proj.weight") for p in ("gate", "up", "down")
                                if f"{m[1]}.{p}_proj.weight" in self.stored)
            else:
                out[name] = size
        return out

    def plan(self) -> tuple[int, int, str | None]:
        """(budget, reserve, the tensor of the largest piece): checks an explicit budget against that piece."""
        if self._plan is None:
            pieces = self.pieces()
            largest = max(pieces, key=pieces.get, default=None)
            reserve = pieces.get(largest, 0)
            if self.max_resident_bytes is None:
                total = self.converted_nbytes()
                budget = math.inf if total <= machine_memory() / 2 else max(DEFAULT_STREAM_BUDGET, reserve)
            else:
                budget = self.max_resident_bytes
                if not isinstance(budget, (int, np.integer)) or isinstance(budget, bool) or budget < 0:
                    raise WeightsError(f"{self.source}: max_resident_bytes must be a number of bytes >= 0, "
                                       f"got {budget!r}")
                if budget < reserve:
                    raise WeightsError(f"{self.origin(largest)}: the resident budget of {size_text(budget)} is "
                                       f"smaller than tensor {largest!r}, which needs {size_text(reserve)} "
                                       f"converted at once; give at least {size_text(reserve)} ({reserve} bytes)")
            self._plan = (budget, reserve, largest)
        return self._plan

    @property
    def budget(self) -> float:
        return self.plan()[0]

    @property
    def resident(self) -> bool:
        """Whether every tensor is kept once converted (else some are streamed: converted on each use)."""
        budget, reserve, _ = self.plan()
        return self.converted_nbytes() <= budget - reserve or budget == math.inf

    def residency(self) -> str:
        """One line: resident or streamed, and why."""
        budget, reserve, _ = self.plan()
        total = self.converted_nbytes()
        why = (f"max_resident_bytes {size_text(budget)}" if self.max_resident_bytes is not None else
               f"{'fits in' if budget == math.inf else 'exceeds'} half of {size_text(machine_memory())} memory")
        if self.resident:
            copies = "" if self.dtype != np.float32 else \
                (f"; float64 copies of the matrices kept for the correctly rounded products "
                 f"(+{size_text(self.float64_copies_nbytes())}; and of a KV cache: twice its bytes)"
                 if self.float64_copies_planned() else
                 "; no float64 copies of the matrices (" + ("float64_copies is off" if not self.float64_copies else
                                                            f"+{size_text(self.float64_copies_nbytes())} would exceed "
                                                            "the budget") + ")")
            return f"resident ({size_text(total)} converted, {why}{copies})"
        return (f"streamed per layer ({size_text(total)} converted, {why}; at most {size_text(budget)} held, "
                f"largest piece {size_text(reserve)})")

    def alias(self, name: str, target: str) -> None:
        """Read stored tensor `target` under `name` too (converted and transformed on its own)."""
        self.aliases[name] = target
        self._plan = None

    def _fits(self, size: int) -> bool:
        budget, reserve, _ = self.plan()
        return self.kept_nbytes + size <= budget - reserve

    def _keep(self, key, array, size: int) -> None:
        self._kept[key] = array
        self.kept_nbytes += size

    def drop(self) -> None:
        """Forget every converted tensor (they are converted again when read), and the products' constants."""
        self._kept.clear()
        self.kept_nbytes = 0
        self._constants.clear()
        self.float64_nbytes = 0

    # ------------------------------------------------------------------------------------------------ checking

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
        if np.dtype(a.dtype).name not in FLOAT_DTYPES:
            raise WeightsError(f"{self.origin(name)}: tensor {name!r} has dtype {np.dtype(a.dtype).name}, expected a "
                               f"float type (F32, F16, BF16)")
        if tuple(a.shape) != tuple(shape):
            raise WeightsError(f"{self.origin(name)}: tensor {name!r} has shape {list(a.shape)}, expected "
                               f"{list(shape)}")

    def _check_per_expert(self, name, shape) -> bool:
        """A fused expert tensor stored per expert instead (`per_expert_tensors`): check each part; False when the
        experts are not stored per expert."""
        m = FUSED.match(name)
        if not m or expert_names(m[1], 0)[0] not in self.stored:
            return False
        fused = np.broadcast_to(np.float32(0), shape)   # no data: the split's views give the parts' shapes
        for sub, part in per_expert_tensors(m[1], **{m[2]: fused}).items():
            if sub not in self.stored:
                raise WeightsError(f"{self.source}: missing tensor {sub!r} (expected shape {list(part.shape)})")
            self._check_one(sub, part.shape)
        return True

    def sha256(self) -> str:
        """Digest of every stored tensor (name, dtype, shape, bytes), in name order, read leading-axis block by
        block (a GGUF tensor: dequantised, as the model reads it); a progress bar on a terminal when it is long."""
        h = hashlib.sha256()
        with layer_progress("weights sha256", max(1, self.nbytes() >> 20), "MiB") as advance:
            for name in sorted(self.stored):
                stored = self.stored[name]
                dtype = np.dtype(stored.dtype)
                h.update(f"{name}:{dtype.str}:{tuple(stored.shape)};".encode())
                for block in blocks(stored, dtype.itemsize):
                    a = np.ascontiguousarray(block, dtype)
                    h.update(a.view(np.uint8).reshape(-1).data if a.size else b"")
                    advance(a.nbytes / 2**20)
        return h.hexdigest()

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.stored.values())
