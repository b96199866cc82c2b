"""Gated delta rule benchmark: refimpl vs transformers' torch fallback at Qwen3.5 shapes, float32, CPU.

Workload: one Gated DeltaNet core call, Hk 16, Hv 32, Dk = Dv = 128, B 1, chunk 64, prefill T = 1024 and 4096,
with the gates as the Qwen layers make them. Timed in the same run, in alternating rounds (A B B A ...): refimpl's
gated_delta_chunked and transformers' torch_chunk_gated_delta_rule; the times are medians over rounds. refimpl's
gated_delta_recurrent is timed once per T (every step does the same work). Both float32 chunked outputs are also
compared with refimpl's float64 mode (fla's error ratio).

Targets: refimpl chunked <= 1.0x torch chunked; refimpl chunked >= 10x faster than refimpl recurrent at T = 4096.

    python bench/gated_delta.py            # T = 1024 and 4096
    python bench/gated_delta.py --quick    # T = 256, 1 round: a smoke run
    python bench/gated_delta.py --plain    # plain-text tables instead of rich

Prints times, ratios and PASS/MISS against the targets; never asserts.
"""

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_pressure_total, fmt_s, print_table, verdict  # noqa: E402

from refimpl.kernels.gated_delta import gated_delta_chunked, gated_delta_recurrent  # noqa: E402

THREADS = 2
B, Hk, Hv, Dk, Dv = 1, 16, 32, 128, 128
TARGET_TORCH = 1.0  # refimpl chunked / torch chunked, at most
TARGET_RECURRENT = 10.0  # refimpl recurrent / refimpl chunked at T = 4096, at least


def inputs(T: int, seed: int = 0):
    """q, k, v ~ N(0, 1); beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias), dt_bias = 1, A = U(1, 16) / 16
    (mostly mild decays, some strong). All float32, transformers' layout."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, Hk, Dk), dtype=np.float32)
    k = rng.standard_normal((B, T, Hk, Dk), dtype=np.float32)
    v = rng.standard_normal((B, T, Hv, Dv), dtype=np.float32)
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, Hv))))
    g = -rng.uniform(1, 16, Hv) / 16 * np.log1p(np.exp(rng.standard_normal((B, T, Hv)) + 1.0))
    return q, k, v, g.astype(np.float32), beta.astype(np.float32)


def alternating_medians(fa, fb, rounds: int):
    """Median seconds of fa and fb over `rounds` each, run A B B A ... after one untimed call of each, so that
    other load on the machine hits both alike. Returns (median a, median b, last result a, last result b)."""
    out = [fa(), fb()]
    times = [[], []]
    for i in range(rounds):
        for j in ((0, 1) if i % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            out[j] = (fa, fb)[j]()
            times[j].append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1]), out[0], out[1]


def err_ratio(ref, x) -> float:
    """fla's metric: rms(x - ref) / rms(ref)."""
    ref, x = np.asarray(ref, np.float64), np.asarray(x, np.float64)
    return math.sqrt(np.mean((x - ref) ** 2)) / (math.sqrt(np.mean(ref**2)) + 1e-8)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="T = 256, 1 round: a smoke run")
    ap.add_argument("--plain", action="store_true", help="plain-text tables")
    ap.add_argument("--T", type=int, nargs="+", help="sequence lengths (default 1024 4096)")
    ap.add_argument("--rounds", type=int, help="timed rounds per contender (default 5)")
    args = ap.parse_args()
    Ts = args.T or ([256] if args.quick else [1024, 4096])
    rounds = args.rounds or (1 if args.quick else 5)

    import torch
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    torch.set_num_threads(THREADS)
    times, errors = [], []
    wait0, wall0 = cpu_pressure_total(), time.perf_counter()
    for T in Ts:
        x = inputs(T)
        xt = [torch.from_numpy(a) for a in x]

        def torch_chunked():
            with torch.no_grad():
                o, S = torch_chunk_gated_delta_rule(*xt, output_final_state=True, use_qk_l2norm_in_kernel=True)
            return o.numpy(), S.numpy()

        t_c, t_t, (o_c, S_c), (o_t, S_t) = alternating_medians(lambda: gated_delta_chunked(*x), torch_chunked, rounds)
        t0 = time.perf_counter()
        gated_delta_recurrent(*x)
        t_r = time.perf_counter() - t0
        o_64, S_64 = gated_delta_chunked(*(a.astype(np.float64) for a in x))  # = the recurrence to ~1e-15 (P1)

        torch_ok = f"<={TARGET_TORCH:g}x {verdict(t_c / t_t <= TARGET_TORCH)}"
        rec_ok = f">={TARGET_RECURRENT:g}x {verdict(t_r / t_c >= TARGET_RECURRENT)}" if T == 4096 else ""
        times.append([str(T), fmt_s(t_c), fmt_s(t_t), f"{t_c / t_t:.2f}x", torch_ok,
                      fmt_s(t_r), f"{t_r / t_c:.1f}x", rec_ok])
        errors.append([str(T), *(f"{err_ratio(o_64, o):.1e}" for o in (o_c, o_t)),
                       *(f"{err_ratio(S_64, S):.1e}" for S in (S_c, S_t))])

    wait1, wall = cpu_pressure_total(), time.perf_counter() - wall0
    blas = os.environ.get("OPENBLAS_NUM_THREADS", "default")
    print_table(f"GDN core, Qwen3.5 shapes, float32, median of {rounds}",
                ["T", "chunked", "torch", "c/t", "target", "recurrent", "r/c", "target"], times, args.plain)
    print(f"chunked, recurrent: refimpl; torch: transformers' torch_chunk_gated_delta_rule ({torch.get_num_threads()} "
          f"threads; OpenBLAS threads {blas}); c/t = chunked / torch; r/c = recurrent / chunked (one run)")
    if wait0 is not None and wait1 is not None:
        busy = (wait1 - wait0) / wall
        print(f"CPU pressure: some task waited for a CPU {100 * busy:.0f}% of the run"
              + ("  -- other load on this machine: the times are not trustworthy" if busy > 0.1 else ""))
    print_table("float32 error vs refimpl float64 (rms ratio)",
                ["T", "o refimpl", "o torch", "S refimpl", "S torch"], errors, args.plain)


if __name__ == "__main__":
    main()
