"""The weight products of one decode step, back to back, against the memory-bandwidth bound measured before each
round: NumPy's sgemv over the float32 weights, its dgemv over float64 copies, refimpl's correctly rounded products
over those copies (the resident path) and over the float32 weights converted a block at a time (the converting
path: no copies), and refimpl's plain path. What a decode step's products cost before anything else runs: each
path's floor (docs/benchmarks.md, "The decode's parts"; issue 30's targets are ratios to the same bound).

    python bench/decode_products.py              # the Qwen3-0.6B shapes: 28 layers + the tied lm_head, ~7 GB
    python bench/decode_products.py --layers 4   # a smoke run

Prints per round the streaming read, the bound (float32 weight bytes / read) and each side's time over it, then
min / median / max over the rounds, and the correctly rounded side's exact fallback (undecided elements). Random
weights of the 0.6B shapes (scaled as a trained model's, ~0.03), one random activation row per product width.
"""

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

from refimpl.kernels import products

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median_time, memory_bandwidth  # noqa: E402
from forward import count_fallbacks  # noqa: E402

# [out, in] of one Qwen3-0.6B layer's projections: q, k, v, o, gate, up, down; the lm_head (the tied embedding)
LAYER = [(2048, 1024), (1024, 1024), (1024, 1024), (1024, 2048), (3072, 1024), (3072, 1024), (1024, 3072)]
LM_HEAD = (151936, 1024)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="timings per side per round (the least is kept)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal(s, dtype=np.float32) * np.float32(0.03) for s in LAYER * args.layers + [LM_HEAD]]
    consts = [products.constant(w.T, keep_float64=True) for w in weights]      # W^T with its norms and float64 copy
    converted = [products.constant(w.T) for w in weights]                      # W^T with its norms only
    x = {k: rng.standard_normal((1, k), dtype=np.float32) for k in {s[1] for s in LAYER}}
    x64 = {k: v[0].astype(np.float64) for k, v in x.items()}
    nbytes = sum(w.nbytes for w in weights)

    def plain():
        with products.plain_blas():
            for w in weights:
                products.matmul(x[w.shape[1]], w.T)
    sides = {"sgemv (float32)": lambda: [np.matmul(w, x[w.shape[1]][0]) for w in weights],
             "dgemv (float64 copies)": lambda: [np.matmul(c.b64.T, x64[c.b.shape[0]]) for c in consts],
             "correctly rounded, resident": lambda: [products.matmul(x[c.b.shape[0]], c) for c in consts],
             "correctly rounded, converting": lambda: [products.matmul(x[c.b.shape[0]], c) for c in converted],
             "plain": plain}
    for fn in sides.values():
        fn()                                                                       # warm: pages, threads
    print(f"{len(weights)} products, {nbytes / 1e9:.2f} GB of float32 weights ({2 * nbytes / 1e9:.2f} GB float64 "
          f"copies)")
    ratios = {name: [] for name in sides}
    for r in range(args.rounds):
        read = memory_bandwidth(repeats=3)["read"]
        bound = nbytes / read
        for name, fn in sides.items():
            ratios[name].append(min(median_time(fn, args.repeats)[1]) / bound)   # the least: noise only adds
        print(f"round {r}: read {read / 1e9:.1f} GB/s, bound {bound * 1e3:.1f} ms; "
              + ", ".join(f"{name} {v[-1]:.2f}x" for name, v in ratios.items()), flush=True)
    print("x the bound (min / median / max over the rounds):")
    for name, v in ratios.items():
        print(f"  {name:30s} {min(v):.2f} / {statistics.median(v):.2f} / {max(v):.2f}")
    counts = count_fallbacks()                                                     # (patches the products: last)
    sides["correctly rounded, resident"]()
    print(f"correctly rounded: {counts['products_fallback']} of {counts['products']:,} elements undecided by the "
          f"bound (exact sums)")


if __name__ == "__main__":
    main()
