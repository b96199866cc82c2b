"""The closing table of issue 25 (docs/htp.md, section 7): per architecture, the honest HTP run's margin under its
three-way bar, the gain test's margins (the honest run's worst channel, and one output channel x1.02 planted in
each projection, against the test's bar), the share of elements bit-identical to the HTP per op kind (free run and
teacher-forced: tests/e2e/htp_bits.py), and each planted fault of tests/e2e/test_htp.py -> first divergence ->
its fault class -> what replay blames.

    python tests/e2e/htp_table.py [--presets dense,moe,...] [--no-bits]

Not a test: it takes minutes (an export per architecture and call shape, a compile per planted graph).
"""

import argparse
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import htp_bits  # noqa: E402
import htp_runs as T  # noqa: E402
import test_htp  # noqa: E402

from refimpl.diff.channels import GAIN_CONTRAST, gain_guard, judged_channel_nmse  # noqa: E402
from refimpl.diff.divergence import localise  # noqa: E402
from refimpl.diff.dump import read_dump  # noqa: E402
from refimpl.diff.policy import make_policy  # noqa: E402
from refimpl.diff.replay import replay  # noqa: E402


def gain_margin(r) -> float | None:
    """dB by which a tensor's gain-test channel stays under (> 0) or exceeds (< 0) the test (z^2 / s_c against
    GAIN_CONTRAST q, and its nmse against channels.gain_guard: both must be exceeded to fail); None: not
    scored."""
    ch = (r.metrics or {}).get("channels") or {}
    if "gain_z2" not in ch or not r.bar or r.bar.get("max_nmse") is None:
        return None
    power = r.metrics.get("run_power") if r.bar.get("run_power") else None
    nmse = judged_channel_nmse({"mse": ch["gain_mse"], "power": ch["gain_power"], "tensor_power": ch["tensor_power"]},
                               power)
    over = [ch["gain_z2"] / (GAIN_CONTRAST * ch["gain_q"]), nmse / gain_guard(ch, r.bar["max_nmse"])]
    return -10 * math.log10(max(min(over), 1e-30))


def fault_row(case, fault, steps, layer):
    """(first divergence, its fault class line, the ops replay blames at that step and layer)."""
    dump_path = case.dump(fault, steps=steps)
    report = case.judge(dump_path, steps=steps)
    where = T.first(report)
    if where is None:
        return None, None, [], report
    hit = next(r for r in report.results if r.step == where[0] and r.name == where[1])
    cls = hit.fault and f"{hit.fault['class']}: {hit.fault['summary']}"
    bundle = case.golden(steps=steps)
    rows = replay(bundle, read_dump(dump_path, bundle), T.D.reference(case.config, case.arrays, "htp-fp16"),
                  layer=layer, step=where[0], policy=make_policy(T.HTP_POLICY, "fp16"))
    return where, cls, [r.name for r in rows if r.adds_error], report


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(T.ARCHITECTURES))
    ap.add_argument("--no-bits", action="store_true", help="skip the bit-identical shares")
    ap.add_argument("--no-faults", action="store_true", help="skip the planted faults")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="refimpl-htp-table-"))
    cases = {}
    print("## honest runs (prompt call + 2 decode calls, three-way k = 4 against htp-fp16)\n")
    print("| architecture | verdict | margin | worst tensor | gain test, honest worst channel | x1.02 on one output "
          "channel: gain test margin (worst .. best), first divergence right |")
    print("|---|---|---|---|---|---|")
    bits = {}
    for arch in args.presets.split(","):
        case = cases[arch] = T.case(arch, root / arch)
        report = case.judge(case.dump())
        worst, where = T.margin(report)
        after = localise(report)   # tensors after a tie or fork follow another branch: not counted (T.margin)
        honest = [(m, f"step {r.step} {r.name}") for r in report.results
                  if r.key not in after and (m := gain_margin(r)) is not None]
        hm, hwhere = min(honest) if honest else (math.inf, "-")
        planted, forked = [], []
        for op in ([] if args.no_faults else T.PROJECTIONS.get(arch, [])):
            rep = case.judge(case.dump(T.D.Fault(scale_channel=(f"{op}.weight", 5, 1.02)), steps=0), steps=0)
            hit = next((r for r in rep.results if r.step == 0 and r.name == op), None)
            if hit is not None and hit.key in localise(rep):   # after a fork: not judged (replay would be)
                forked.append(op)
            elif hit is not None and gain_margin(hit) is not None:
                planted.append((-gain_margin(hit), op, T.first(rep) == (0, op)))
        verdict = "PASS" if report.exit_code == 0 else f"FAIL at {T.first(report)}"
        caught = (f"{min(planted)[0]:+.1f} .. {max(planted)[0]:+.1f} dB over ({min(planted)[1]} .. "
                  f"{max(planted)[1]}); {sum(p[2] for p in planted)} / {len(planted)}") if planted else "-"
        if forked:
            caught += f"; after the fork, not judged: {', '.join(op[13:] for op in forked)}"
        print(f"| {arch} ({T.ARCHITECTURES[arch]}) | {verdict} | {worst:.1f} dB | {where} | {hm:.1f} dB under "
              f"({hwhere}) | {caught} |", flush=True)
        if not args.no_bits:
            bits[arch] = htp_bits.shares(case)[0]
    if bits:
        print("\n## share of elements bit-identical to the HTP, per op kind: free run / teacher-forced\n")
        kinds = sorted({k for b in bits.values() for k in b})
        print("| op | " + " | ".join(bits) + " |")
        print("|---|" + "---|" * len(bits))
        for k in kinds:
            cells = [(f"{100 * b[k][1] / b[k][0]:.0f} / {100 * b[k][2] / b[k][0]:.0f} %" if k in b else "")
                     for b in bits.values()]
            print(f"| {k} | " + " | ".join(cells) + " |")
    if args.no_faults:
        return 0
    print("\n## planted faults -> first divergence -> replay\n")
    print("| fault | first divergence (step, tensor) | expected | fault class | replay blames |")
    print("|---|---|---|---|---|")
    for name, (arch, fault, expected, (step, layer), _) in test_htp.FAULTS.items():
        if arch not in cases:
            continue
        where, cls, blamed, _ = fault_row(cases[arch], fault, T.STEPS, layer)
        print(f"| {name} | {where} | {'right' if where == expected else expected} | {cls} | {blamed} |", flush=True)
    if "dense" in cases:
        for op in T.PROJECTIONS["dense"]:
            where, cls, blamed, _ = fault_row(cases["dense"], T.D.Fault(scale_channel=(f"{op}.weight", 5, 1.02)), 0,
                                              int(op.split(".")[2]))
            print(f"| one output channel x1.02 (dense {op[13:]}) | {where} | "
                  f"{'right' if where == (0, op) else (0, op)} | {cls} | {blamed} |", flush=True)
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
