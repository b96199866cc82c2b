"""Stored tensors read and converted: a tensor (or a block of its rows) in its stored dtype, widened to the compute
dtype (bf16 exactly, by a 16-bit shift), the page-cache hint for a memory map, and the machine's memory. What
refimpl/models/weights.py builds its residency on.
"""

import math
import mmap
import os
from pathlib import Path

import ml_dtypes
import numpy as np

ROW_BLOCK_BYTES = 64 * 2**20            # a tensor read by blocks of rows: this many converted bytes each
_BF16 = np.dtype(ml_dtypes.bfloat16)


def bf16_to_float32(a: np.ndarray, block: int = 2**18) -> np.ndarray:
    """bfloat16 -> float32, exactly: a bf16 is the high 16 bits of the float32 of the same value, so widen the
    bits to 32 and shift them up 16 (NaN payloads and signed zeros included). Done `block` values at a time, so
    the shift reads the widened bits from cache: one pass over memory."""
    bits = np.ascontiguousarray(a).view(np.uint16).reshape(-1)
    out = np.empty(bits.size, np.uint32)
    for start in range(0, bits.size, block):
        part = out[start:start + block]
        np.copyto(part, bits[start:start + block])
        part <<= 16
    return out.view(np.float32).reshape(a.shape)


def to_dtype(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A stored array in the compute dtype (no copy when it already is)."""
    if a.dtype == dtype:
        return a
    if a.dtype == _BF16:
        a = bf16_to_float32(a)
        return a if a.dtype == dtype else a.astype(dtype)
    return a.astype(dtype)


def read(stored, index=None) -> np.ndarray:
    """A stored tensor, or part `index` of its leading axis, in its stored dtype (a view of the map where it can be)."""
    if isinstance(stored, np.ndarray):
        return stored if index is None else stored[index]
    return np.asarray(stored.read(index))


def blocks(stored, itemsize: int):
    """A stored tensor read leading-axis block by block (ROW_BLOCK_BYTES at `itemsize` per value each), in its
    stored dtype; in one piece when it is 0-d, or when reading a part would compute the whole (`partial` False)."""
    shape = tuple(stored.shape)
    if not shape or not (isinstance(stored, np.ndarray) or getattr(stored, "partial", False)):
        yield read(stored)
        return
    step = max(1, ROW_BLOCK_BYTES // max(1, math.prod(shape[1:]) * itemsize))
    for r in range(0, shape[0], step):
        yield read(stored, slice(r, r + step))


def will_need(a: np.ndarray) -> None:
    """madvise(WILLNEED) the pages of an array that views a memory map (else nothing)."""
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not isinstance(root.base, mmap.mmap) or not a.size:
        return
    page = mmap.PAGESIZE
    start = a.ctypes.data - root.ctypes.data + getattr(root, "offset", 0) % mmap.ALLOCATIONGRANULARITY
    aligned = start - start % page
    try:
        root.base.madvise(mmap.MADV_WILLNEED, aligned, start - aligned + a.nbytes)
    except (OSError, ValueError):
        pass   # a hint only


def machine_memory() -> int:
    """Physical memory in bytes, or the cgroup's limit when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def size_text(n: float) -> str:
    """Bytes as a short human size (binary units): 1.5 GiB, 64 MiB, 512 B."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
