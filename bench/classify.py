"""What naming the fault costs: `refimpl diff`'s time (compare) on the golden anchors with and without classifying
the first divergences (refimpl.diff.classify), in the same run. Target: classification adds <= 10 %.

Each anchor is diffed against itself read as a dump (an honest device: no divergence, nothing to classify) and
against the same dump with one fault planted per step (layer 0's input RMSNorm output scaled by 1.02: a
first divergence every step, each classified). Process CPU time (other processes on the machine do not count):
the share is the time spent inside the classification over the rest of compare in the same runs; compare with
and without it also alternate round by round (A B B A ...), medians, as a cross-check.

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


def timed(bundle, dump, classify: bool) -> tuple[float, float, object]:
    """(process CPU seconds of compare, of which in classify_divergences, the report)."""
    policy = make_policy(None, "fp32")
    spent = [0.0]
    real = compare_module.classify_divergences

    def counted(*args):
        t = time.process_time()
        real(*args)
        spent[0] += time.process_time() - t
    with mock.patch.object(compare_module, "classify_divergences", counted if classify else lambda *a: None):
        t0 = time.process_time()
        report = compare(bundle, dump, policy)
        return time.process_time() - t0, spent[0], report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    totals = {}
    print(f"{'anchor':20s} {'dump':7s} {'diff s':>8s} {'+classify s':>12s} {'ratio':>7s} {'in classify s':>14s} "
          f"{'share':>7s}  first divergences: fault")
    for anchor in sorted(p for p in (ROOT / "golden").iterdir() if (p / "manifest.json").exists()):
        bundle, variants, _ = dumps(anchor)
        for name, dump in variants.items():
            times, inside = {False: [], True: []}, []
            for i in range(args.rounds):
                for flag in ((False, True) if i % 2 == 0 else (True, False)):
                    t, c, report = timed(bundle, dump, flag)
                    times[flag].append(t)
                    if flag:
                        inside.append(c)
            base, full, cls = (statistics.median(x) for x in (times[False], times[True], inside))
            for key, t in (("base", base), ("full", full), ("inside", cls)):
                totals.setdefault((name, key), []).append(t)
            faults = [r.fault["class"] for r in report.results if r.fault]
            print(f"{anchor.name:20s} {name:7s} {base:8.4f} {full:12.4f} {full / base:7.3f} {cls:14.4f} "
                  f"{cls / (full - cls):7.3%}  {len(faults)}: {', '.join(sorted(set(faults))) or '-'}")
    for name in ("honest", "faulty"):
        base, full, cls = (sum(totals[name, k]) for k in ("base", "full", "inside"))
        print(f"all anchors, {name} dumps: classification adds {100 * cls / (full - cls):.2f} % to diff's CPU time "
              f"(time inside it over the rest of compare; A/B medians: ratio {full / base:.3f}); target <= 10 %")


if __name__ == "__main__":
    main()
