"""The committed anchors regenerate bit for bit on every platform this machine can emulate: OpenBLAS's kernels
(OPENBLAS_CORETYPE) x NumPy's SIMD dispatch levels (NPY_DISABLE_CPU_FEATURES) x BLAS thread counts. A combination
is skipped only when the CPU cannot execute the kernel (its instruction set is missing); the skips are named.

Each combination runs in a fresh process (both variables are read when the libraries load) that regenerates every
anchor under 1 and 2 BLAS threads and prints the sha256 of every file; platform.json (where a bundle was made,
for information only) is the one file expected to differ."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
KERNELS = {"Prescott": "pni", "Nehalem": "sse4_2", "Sandybridge": "avx", "Haswell": "avx2", "SkylakeX": "avx512f"}


def _dispatch() -> list[str]:
    from numpy._core._multiarray_umath import __cpu_dispatch__
    return list(__cpu_dispatch__)


def _simd_levels() -> dict[str, str]:
    """NPY_DISABLE_CPU_FEATURES values: none, the AVX-512 dispatch targets, and those plus the AVX2 ones
    (numpy >= 2.4 names them X86_V4 / AVX512_* and X86_V3; older numpy AVX512* and AVX2 / FMA3)."""
    dispatch = _dispatch()
    avx512 = [d for d in dispatch if d.startswith("AVX512") or d == "X86_V4"]
    avx2 = [d for d in dispatch if d in ("X86_V3", "AVX2", "FMA3")]
    return {"all": "", "no-avx512": " ".join(avx512), "no-avx2-avx512": " ".join(avx2 + avx512)}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


# The same bytes at less cost per platform: fsync returns at once (it makes the data durable, it does not change it:
# tests/test_crash_points.py tests where it is called), and each preset's seeded weights are drawn once for both BLAS
# thread counts (NumPy's generator, and the correctly rounded log of a few A_log values in one chunk: no BLAS, no
# thread, so the second draw is the first one's code on the same bits); the model, its weights' digest, every
# forward and the writer still run under each thread count.
CHILD = r"""
import hashlib, json, os, sys
from pathlib import Path
from threadpoolctl import threadpool_info, threadpool_limits
sys.path.insert(0, sys.argv[1])
import make_anchors
from refimpl import presets
from refimpl.presets import PRESETS
os.fsync = lambda fd: None
drawn, draw = {}, presets.random_weights
def random_weights(config, seed=0, *args):
    key = (config.source, seed, *args)
    if key not in drawn:
        drawn[key] = draw(config, seed, *args)
    return drawn[key]
presets.random_weights = random_weights
out, digests = Path(sys.argv[2]), {}
for threads in (1, 2):
    with threadpool_limits(limits=threads, user_api="blas"):
        for name in PRESETS:
            path = make_anchors.write_anchor(name, out / str(threads) / name)
            for f in sorted(p for p in path.rglob("*") if p.is_file() and p.name != "platform.json"):
                digests[f"{threads}:{name}/{f.relative_to(path)}"] = hashlib.sha256(f.read_bytes()).hexdigest()
blas = [lib.get("architecture") for lib in threadpool_info() if lib.get("user_api") == "blas"]
print(json.dumps({"digests": digests, "blas": blas}))
"""


def _committed() -> dict[str, str]:
    from refimpl.presets import PRESETS
    digests = {}
    for name in PRESETS:
        root = ROOT / "golden" / name
        for f in sorted(p for p in root.rglob("*") if p.is_file() and p.name != "platform.json"):
            digests[f"{name}/{f.relative_to(root)}"] = hashlib.sha256(f.read_bytes()).hexdigest()
    return digests


@pytest.mark.parametrize("simd", list(_simd_levels()))
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_anchors_regenerate_on_every_platform(kernel, simd, tmp_path):
    if KERNELS[kernel] not in _cpu_flags():
        pytest.skip(f"this CPU cannot execute OpenBLAS's {kernel} kernel (no {KERNELS[kernel]})")
    env = {**os.environ, "OPENBLAS_CORETYPE": kernel, "NPY_DISABLE_CPU_FEATURES": _simd_levels()[simd],
           "OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "golden"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    committed = _committed()
    for threads in (1, 2):
        got = {k.split(":", 1)[1]: v for k, v in result["digests"].items() if k.startswith(f"{threads}:")}
        assert got.keys() == committed.keys(), f"{threads} thread(s): files differ: {got.keys() ^ committed.keys()}"
        differ = [k for k in committed if got[k] != committed[k]]
        assert not differ, (f"OPENBLAS_CORETYPE={kernel} (BLAS reports {result['blas']}), "
                            f"NPY_DISABLE_CPU_FEATURES={_simd_levels()[simd]!r}, {threads} thread(s): "
                            f"{len(differ)} files differ, e.g. {differ[:3]}")
