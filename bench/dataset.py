"""Dataset-reference benchmark: windows per minute of `refimpl reference` on a Qwen3-0.6B-shaped model (seeded
random weights, float32, written once as an HF checkpoint that every worker memory-maps), with 1 local worker,
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

Prints times and ratios; never asserts.
"""

import argparse
import filecmp
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import cpu_pressure_total, fmt_bytes, print_table, verdict, wait_idle  # noqa: E402
from forward import model_config  # noqa: E402

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


def run(source: Path, windows, out: Path, workers: int, ray: bool) -> tuple[float, float]:
    """(wall seconds from start to the last window, seconds per window after the first one was written)."""
    from refimpl.dataset.reference import Job, write_reference
    from refimpl.precision import Policy
    job = Job(str(source), Policy(), first=windows.first, scored=windows.scored)
    stamps = []
    t0 = time.perf_counter()
    write_reference(out, job, windows, {"stride": None}, workers=workers, ray=ray,
                    progress=lambda done, total, tokens: stamps.append(time.perf_counter()) if tokens else None)
    return time.perf_counter() - t0, (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)


def same_files(a: Path, b: Path) -> bool:
    cmp = filecmp.dircmp(a / "windows", b / "windows")
    return not (cmp.diff_files or cmp.left_only or cmp.right_only) and \
        all(filecmp.cmp(a / f, b / f, shallow=False) for f in ("manifest.json", "tokens.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ctx", type=int)
    ap.add_argument("--windows", type=int)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every mode, alternating their order")
    ap.add_argument("--workers", type=int, help="N (default: the cores this process may use)")
    ap.add_argument("--plain", action="store_true")
    a = ap.parse_args()
    layers, ctx, n = (4, 128, 4) if a.quick else (28, 512, 6)
    ctx, n = a.ctx or ctx, a.windows or n
    import numpy as np

    from refimpl.dataset import cut
    try:
        import ray  # noqa: F401
        have_ray = True
    except ImportError:
        have_ray = False
    with tempfile.TemporaryDirectory(prefix="bench-dataset-") as tmp:
        tmp = Path(tmp)
        print(f"writing the Qwen3-0.6B-shaped checkpoint ({layers} layers) ...", flush=True)
        source = checkpoint(tmp / "model", layers)
        windows = cut([np.random.default_rng(SEED).integers(0, 151643, ctx * n).tolist()], ctx)
        print(f"{n} windows of {ctx} tokens, {windows.scored} scored each; waiting for an idle CPU ...", flush=True)
        idle = wait_idle(60)
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


if __name__ == "__main__":
    main()
