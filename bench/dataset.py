"""Dataset-reference benchmark: `refimpl reference` (default correctly rounded, and --fast) beside llama.cpp's
llama-perplexity on the same F32 GGUF model and the same token windows, and (--workers-modes) windows per minute
with 1 local worker, N local processes and N Ray actors.

llama-perplexity side by side. The Qwen3-0.6B-shaped model (seeded random weights) is written once as an F32
GGUF (refimpl's GGUF writer, no vocabulary: the windows are token ids). Each round runs, in alternating order,
refimpl's default reference, refimpl's --fast reference (both in this process, model load included, every core)
and `llama-perplexity -m model.gguf -c CTX -b CTX -t CORES --kl-divergence-base ref.kld --kl-divergence` (a
fresh process; it reads the same windows' tokens from the base file refimpl's default reference exports, computes
its own logits and their KL divergence from refimpl's; f32 KV cache, flash attention off). Tokens per second =
windows x ctx / wall time (start-up and model load included on both sides); the ratios are refimpl's time over
llama-perplexity's (targets: --fast <= 1.5x, default <= 4x), per round min / median / max. Then one more
default window is profiled per kernel stage (bench/_profile.py).

llama-perplexity is found by --llama-perplexity, else $LLAMA_PERPLEXITY (e.g.
/tmp/i28data/build/bin/llama-perplexity). To build it from the llama-cpp-python sdist (as the project's llama.cpp
fixtures were, tests/fixtures/dataset/make_fixtures.py):

    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d /tmp/llama
    tar xzf /tmp/llama/llama_cpp_python-0.3.36.tar.gz -C /tmp/llama
    cmake -S /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp -B /tmp/llama/build -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF && ninja -C /tmp/llama/build llama-perplexity
    export LLAMA_PERPLEXITY=/tmp/llama/build/bin/llama-perplexity

Workers (--workers-modes): the model as an HF checkpoint that every worker memory-maps, with 1 local worker,
N local processes and N Ray actors on a local Ray instance (N = --workers, default: the cores), side by side;
Ray's overhead over local processes; the compact reference's bytes per scored token. The single worker runs in
this process with the BLAS's default threads (every core); each of N workers gets its share of the cores
(refimpl.dataset.reference.blas_share), as `refimpl reference --workers N` gives it.

Each mode computes the same windows into its own directory, from start (worker start-up and model load
included) to the last window written; the files of every mode are checked to be byte-identical. The modes run
in rounds, their order alternating (A B C, C B A), and each time is the median over rounds. A mode's
windows per minute = windows / wall time (the median, and min / ... / max over the rounds). Ray's overhead =
Ray's wall time / the local processes' - 1 (target <= 10 %).

    python bench/dataset.py                   # ctx 512, 6 windows per mode (the 28-layer model, ~2.4 GB)
    python bench/dataset.py --quick           # 4 layers, ctx 128, 4 windows: a smoke run
    python bench/dataset.py --workers-modes   # also 1 worker / N processes / N Ray actors

Prints times and ratios; never asserts.
"""

import argparse
import filecmp
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import cpu_pressure_total, fmt_bytes, print_table, verdict, wait_idle  # noqa: E402
from _profile import kernel_profile, profile_table  # noqa: E402
from forward import loadavg, model_config  # noqa: E402

SEED = 0


def checkpoint(directory: Path, layers: int) -> Path:
    import numpy as np

    from refimpl.formats.safetensors import write_safetensors
    from refimpl.models.config import config_from_dict
    from refimpl.presets import random_weights
    cfg = model_config(layers)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    arrays = random_weights(config_from_dict(cfg), seed=SEED)
    arrays.pop("lm_head.weight", None)                        # tied: the embedding is the output projection
    write_safetensors(directory / "model.safetensors", {k: np.ascontiguousarray(v) for k, v in arrays.items()})
    return directory


def gguf_model(path: Path, layers: int) -> Path:
    """The same model (seeded random weights) as an F32 GGUF without a vocabulary."""
    from refimpl.formats.gguf.writer import write_gguf
    from refimpl.models.config import config_from_dict
    from refimpl.models.model import Model
    from refimpl.models.weights import Weights
    from refimpl.presets import random_weights
    cfg = config_from_dict(model_config(layers), source="bench:qwen3-0.6b")
    return write_gguf(path, Model(cfg, Weights(random_weights(cfg, seed=SEED))), "F32")


def run(source: Path, windows, out: Path, workers: int, ray: bool, fast: bool = False) -> tuple[float, float]:
    """(wall seconds from start to the last window, seconds per window after the first one was written)."""
    from refimpl.dataset.reference import _MODELS, Job, write_reference
    from refimpl.precision import Policy
    _MODELS.clear()                               # every run loads its model (as a fresh `refimpl reference`)
    job = Job(str(source), Policy(fast=fast), first=windows.first, scored=windows.scored)
    stamps = []
    t0 = time.perf_counter()
    write_reference(out, job, windows, {"stride": None}, workers=workers, ray=ray,
                    progress=lambda done, total, tokens: stamps.append(time.perf_counter()) if tokens else None)
    return time.perf_counter() - t0, (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)


def same_files(a: Path, b: Path) -> bool:
    cmp = filecmp.dircmp(a / "windows", b / "windows")
    return not (cmp.diff_files or cmp.left_only or cmp.right_only) and \
        all(filecmp.cmp(a / f, b / f, shallow=False) for f in ("manifest.json", "tokens.safetensors"))


LLAMA_TIME = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")


def run_llama(binary: str, gguf: Path, kld: Path, ctx: int, threads: int) -> tuple[float, float | None, str]:
    """(wall seconds, llama.cpp's own prompt-eval seconds or None, its output) of llama-perplexity's KL divergence
    against refimpl's base file."""
    cmd = [binary, "-m", str(gguf), "-c", str(ctx), "-b", str(ctx), "-t", str(threads), "-ctk", "f32", "-ctv", "f32",
           "-fa", "off", "--kl-divergence-base", str(kld), "--kl-divergence"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"llama-perplexity failed ({proc.returncode}): {' '.join(cmd)}\n{text[-3000:]}")
    m = LLAMA_TIME.search(text)
    return wall, float(m[1]) / 1e3 if m else None, text


def compare_llama(a, tmp: Path, layers: int, ctx: int, n: int, windows, binary: str) -> None:
    """refimpl reference (default and --fast) beside llama-perplexity on the same F32 GGUF and windows."""
    from refimpl.dataset.llama import write_kld_base
    from refimpl.dataset.reference import Job, compute_window, cores, open_reference
    from refimpl.precision import Policy
    print(f"writing the Qwen3-0.6B-shaped F32 GGUF ({layers} layers) ...", flush=True)
    gguf = gguf_model(tmp / "model.gguf", layers)
    threads = cores()
    sides = ["refimpl default", "refimpl --fast", "llama-perplexity"]
    times = {s: [] for s in sides}
    llama_eval, kld, p0, loads = [], tmp / "ref.kld", cpu_pressure_total(), [loadavg()]
    for r in range(a.rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            print(f"round {r + 1}: {side} ...", flush=True)
            if side == "llama-perplexity":
                if not kld.exists():                   # the base file of refimpl's default reference
                    run(gguf, windows, tmp / "ref-base", 1, False)
                    write_kld_base(open_reference(tmp / "ref-base"), kld)
                wall, own, text = run_llama(binary, gguf, kld, ctx, threads)
                times[side].append(wall)
                llama_eval.append(own)
            else:
                fast = side.endswith("--fast")
                out = tmp / f"ref-{'fast' if fast else 'default'}-{r}"
                times[side].append(run(gguf, windows, out, 1, False, fast=fast)[0])
                if not fast and not kld.exists():
                    write_kld_base(open_reference(out), kld)
    loads.append(loadavg())
    pressure = None if p0 is None else (cpu_pressure_total() - p0) / sum(sum(v) for v in times.values())
    tokens = n * ctx
    llama = times["llama-perplexity"]

    def spread(xs):
        return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"

    rows = []
    for side, target in (("refimpl default", 4.0), ("refimpl --fast", 1.5), ("llama-perplexity", None)):
        t = times[side]
        ratios = [x / y for x, y in zip(t, llama)]
        ratio = statistics.median(t) / statistics.median(llama)
        rows.append([side, f"{statistics.median(t):.1f} s", f"{tokens / statistics.median(t):.1f}",
                     spread([tokens / x for x in t]), f"{ratio:.2f}x", spread(ratios),
                     "" if target is None else f"<= {target:.1f}x  {verdict(ratio <= target)}"])
    print_table(f"refimpl reference vs llama-perplexity: Qwen3-0.6B shape ({layers} layers) F32 GGUF, ctx {ctx}, "
                f"{n} windows ({tokens} tokens), {threads} threads each, median of {a.rounds} rounds",
                ["side", "wall (start-up, load, windows)", "tokens / s", "tokens / s min / median / max",
                 "time / llama-perplexity's", "per round min / median / max", "target"], rows, a.plain)
    own = [x for x in llama_eval if x is not None]
    if own:
        print(f"llama-perplexity's own prompt-eval time (its forward passes, without load and KLD): "
              f"{statistics.median(own):.1f} s ({tokens / statistics.median(own):.1f} tokens / s)")
    stats = [line.strip() for line in text.splitlines()
             if line.strip().startswith(("Mean PPL(Q)  ", "Mean    KLD", "Same top p"))]
    print("llama.cpp vs refimpl's reference on these windows: " +
          ("; ".join(" ".join(x.split()) for x in stats) if stats else "(no statistics found; its output ends: "
           + " | ".join(text.strip().splitlines()[-4:]) + ")"))
    job = Job(str(gguf), Policy(), first=windows.first, scored=windows.scored)
    compute_window(job, windows.tokens[0], windows.targets[0])                   # the model loaded, warm
    with kernel_profile() as prof, prof.phase():
        compute_window(job, windows.tokens[0], windows.targets[0])
    print_table(*profile_table({f"one window, ctx {ctx}": prof}, "Where a default (correctly rounded) window's "
                               "time goes"), a.plain)
    print(f"load average (1, 5, 15 min) before {loads[0]}, after {loads[1]} ({os.cpu_count()} CPUs); CPU pressure "
          f"during the runs {pressure if pressure is None else f'{pressure:.2f}'} (share of time another task "
          f"waited for a CPU: high values mean the machine was shared and times are noisy)")


def compare_workers(a, tmp: Path, layers: int, ctx: int, n: int, windows, idle) -> None:
    """1 local worker, N local processes and N Ray actors on the HF checkpoint, side by side."""
    try:
        import ray  # noqa: F401
        have_ray = True
    except ImportError:
        have_ray = False
    print(f"writing the Qwen3-0.6B-shaped checkpoint ({layers} layers) ...", flush=True)
    source = checkpoint(tmp / "model", layers)
    from refimpl.dataset.reference import blas_share, cores
    N = a.workers or cores()
    print(f"{cores()} cores; BLAS threads per worker: 1 worker: every core, {N} workers: {blas_share(N)} each")
    modes = [("1 local worker", 1, False), (f"{N} local processes", N, False)]
    if have_ray:
        modes.append((f"{N} Ray actors (local Ray instance)", N, True))
    runs, p0, ray_starts = {name: [] for name, _, _ in modes}, cpu_pressure_total(), []
    for r in range(a.rounds):                 # modes alternate order between rounds (A B C, C B A, ...)
        for name, workers, ray in (modes if r % 2 == 0 else modes[::-1]):
            print(f"round {r + 1}: {name} ...", flush=True)
            if ray:              # the instance's start-up is timed apart: a cluster is started once
                import ray as ray_module
                t0 = time.perf_counter()
                ray_module.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
                ray_starts.append(time.perf_counter() - t0)
            runs[name].append(run(source, windows, tmp / f"mode{[m[0] for m in modes].index(name)}-{r}",
                                  workers, ray))
            if ray:
                ray_module.shutdown()
    times = {name: (statistics.median(t for t, _ in v), statistics.median(p for _, p in v))
             for name, v in runs.items()}
    ray_start = statistics.median(ray_starts) if ray_starts else None
    pressure = None if p0 is None else (cpu_pressure_total() - p0) / sum(t for v in runs.values() for t, _ in v)
    summary = json.loads((tmp / "mode0-0" / "summary.json").read_text())
    base = times[modes[0][0]]
    spread = {name: "/".join(f"{60 * n / t:.2f}" for t in sorted((t for t, _ in v), reverse=True))
              for name, v in runs.items()}
    rows = [[name, f"{t:.1f} s", f"{60 * n / t:.2f} ({spread[name]})", f"{60 / per:.2f}", f"{base[0] / t:.2f}x",
             "yes" if all(same_files(tmp / "mode0-0", tmp / f"mode{i}-{r}") for r in range(a.rounds)) else "NO"]
            for i, (name, (t, per)) in enumerate(times.items())]
    print_table(f"refimpl reference: Qwen3-0.6B shape ({layers} layers), ctx {ctx}, {n} windows, median of "
                f"{a.rounds} rounds",
                ["mode", "wall time (start-up, load, windows)", "windows / min (min/…/max)",
                 "windows / min after the "
                 "first", "speed-up vs 1 worker", "files identical to 1 worker"], rows, a.plain)
    if have_ray:
        (tr, pr), (tp, pp) = times[modes[2][0]], times[modes[1][0]]
        print_table(f"Ray overhead over local processes ({N} workers each)", ["measure", "value", "target",
                                                                           "verdict"],
                    [["wall time (actors + model loads + windows) / processes' - 1",
                      f"{100 * (tr / tp - 1):+.1f} %",
                      "<= 10 %", verdict(tr / tp - 1 <= 0.10)],
                     ["time per window after the first / processes' - 1", f"{100 * (pr / pp - 1):+.1f} %",
                      "<= 10 %", verdict(pr / pp - 1 <= 0.10)],
                     ["local Ray instance start-up (once per cluster)", f"{ray_start:.1f} s", "", ""]], a.plain)
    else:
        print("Ray is not installed (pip install 'refimpl[scale]'): its row is skipped")
    print(f"compact reference: {summary['bytes_per_scored_token']:,.0f} bytes per scored token "
          f"({fmt_bytes(summary['window_bytes'])} for {summary['scored_tokens']} scored tokens; llama.cpp's base "
          f"file: {2 * (2 * ((151936 + 1) // 2) + 4):,} bytes per token for this vocabulary, without the NLL and "
          f"top ids)")
    print(f"CPU pressure before the runs {idle if idle is None else f'{idle:.2f}'}, during them "
          f"{pressure if pressure is None else f'{pressure:.2f}'} (share of time another task waited for a CPU; "
          f"high values mean the machine was shared and times are noisy)")



def llama_binary(arg: str | None) -> str | None:
    found = arg or os.environ.get("LLAMA_PERPLEXITY") or shutil.which("llama-perplexity")
    return found if found and Path(found).exists() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ctx", type=int)
    ap.add_argument("--windows", type=int)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every mode, alternating their order")
    ap.add_argument("--workers", type=int, help="N (default: the cores this process may use)")
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--layers", type=int, help="decoder layers (default 28; --quick 4)")
    ap.add_argument("--llama-perplexity", metavar="PATH", help="llama.cpp's llama-perplexity (default: "
                    "$LLAMA_PERPLEXITY, e.g. /tmp/i28data/build/bin/llama-perplexity, or on PATH)")
    ap.add_argument("--workers-modes", action="store_true", help="also 1 worker / N processes / N Ray actors")
    a = ap.parse_args()
    layers, ctx, n = (4, 128, 4) if a.quick else (28, 512, 6)
    ctx, n, layers = a.ctx or ctx, a.windows or n, a.layers or layers
    import numpy as np

    from refimpl.dataset import cut
    with tempfile.TemporaryDirectory(prefix="bench-dataset-") as tmp:
        tmp = Path(tmp)
        windows = cut([np.random.default_rng(SEED).integers(0, 151643, ctx * n).tolist()], ctx)
        print(f"{n} windows of {ctx} tokens, {windows.scored} scored each; waiting for an idle CPU ...", flush=True)
        idle = wait_idle(60)
        binary = llama_binary(a.llama_perplexity)
        if binary:
            compare_llama(a, tmp, layers, ctx, n, windows, binary)
        else:
            print("llama-perplexity not found (--llama-perplexity PATH or $LLAMA_PERPLEXITY; how to build it: "
                  "python bench/dataset.py --help, or this file's docstring): its comparison is skipped")
        if a.workers_modes:
            compare_workers(a, tmp, layers, ctx, n, windows, idle)

if __name__ == "__main__":
    main()
