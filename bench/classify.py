"""What naming the fault costs: `refimpl diff`'s time (compare) on the golden anchors with and without classifying
the first divergences (refimpl.diff.classify), in the same run. Target: classification adds <= 10 %.

Each anchor is diffed against itself read as a dump (an honest device: no divergence, nothing to classify) and
against the same dump with one fault planted per step (layer 0's input RMSNorm output scaled by 1.02: a
first divergence every step, each classified). The two variants alternate round by round (A B B A ...);
times are medians.

    python bench/classify.py             # 7 rounds
    python bench/classify.py --rounds 3

Prints the times and the ratio; never asserts.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from refimpl.bundle import read_bundle  # noqa: E402
from refimpl.diff.compare import compare  # noqa: E402
from refimpl.diff.dump import read_dump  # noqa: E402
from refimpl.diff.policy import make_policy  # noqa: E402

FAULTY = "model.layers.0.input_layernorm"
compare_module = sys.modules["refimpl.diff.compare"]   # the module (refimpl.diff.compare is also the function)


def dumps(anchor: Path):
    bundle = read_bundle(anchor)
    honest = read_dump(anchor, bundle)
    faulty = read_dump(anchor, bundle)
    planted = 0
    for key, item in faulty.items.items():
        if key.split("/", 2)[2] == FAULTY and item.array is not None:
            a = np.array(item.array, copy=True).reshape(bundle.manifest["tensors"][key]["shape"])
            a *= a.dtype.type(1.02)
            item.array = a.reshape(item.array.shape)
            planted += 1
    return bundle, {"honest": honest, "faulty": faulty}, planted


def timed(bundle, dump, classify: bool) -> tuple[float, object]:
    policy = make_policy(None, "fp32")
    patch = mock.patch.object(compare_module, "classify_divergences", lambda *a: None) if not classify else \
        mock.patch.object(compare_module, "classify_divergences", compare_module.classify_divergences)
    with patch:
        t0 = time.perf_counter()
        report = compare(bundle, dump, policy)
        return time.perf_counter() - t0, report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    totals = {}
    print(f"{'anchor':20s} {'dump':7s} {'diff s':>8s} {'+classify s':>12s} {'ratio':>7s}  first divergences: fault")
    for anchor in sorted(p for p in (ROOT / "golden").iterdir() if (p / "manifest.json").exists()):
        bundle, variants, _ = dumps(anchor)
        for name, dump in variants.items():
            times = {False: [], True: []}
            for i in range(args.rounds):
                for flag in ((False, True) if i % 2 == 0 else (True, False)):
                    t, report = timed(bundle, dump, flag)
                    times[flag].append(t)
            base, full = statistics.median(times[False]), statistics.median(times[True])
            for flag, t in ((False, base), (True, full)):
                totals.setdefault((name, flag), []).append(t)
            faults = [r.fault["class"] for r in report.results if r.fault]
            print(f"{anchor.name:20s} {name:7s} {base:8.4f} {full:12.4f} {full / base:7.3f}  "
                  f"{len(faults)}: {', '.join(sorted(set(faults))) or '-'}")
    for name in ("honest", "faulty"):
        base, full = sum(totals[name, False]), sum(totals[name, True])
        print(f"all anchors, {name} dumps: classification adds {100 * (full / base - 1):+.1f} % to diff's time "
              f"(ratio {full / base:.3f}; target <= 1.10)")


if __name__ == "__main__":
    main()
