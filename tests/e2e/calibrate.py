"""Calibration of the diff's default bars on independent honest runs (docs/diff.md, "Calibration").

    python tests/e2e/calibrate.py [--steps 16] [--presets tiny-qwen3,...] [--runtimes eager,sdpa,ort,bf16,ort-fp16]

For every preset, convention and runtime (tests/e2e/devices.py): a golden bundle from refimpl (float32; for the
reduced-precision runtimes also the emulated bundle at that precision), an honest dump from the runtime, and
`refimpl diff` with the default policy of the runtime's dtype (three-way for bf16 / fp16). Prints one row per run:
the verdict, the number of compared tensors, the worst SQNR over every compared float tensor of every step and
where it sits, and the margin to the bar (fp32: worst SQNR - the bar's SQNR; three-way: how far the worst tensor's
NMSE stays under its three-way bar, in dB; tensors after an exact tie the device broke the other way are not
judged), and how far the worst channel stays under its per-channel bar (refimpl.diff.channels), in dB. Notes the
report raised are printed too (an honest run raises none but a tie's).
Not a test: it takes minutes (the ONNX exports of the prompt graphs dominate).
"""

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import devices as D

from refimpl.bundle import read_bundle
from refimpl.diff.channels import channel_bar, judged_channel_nmse
from refimpl.diff.compare import compare
from refimpl.diff.dump import read_dump
from refimpl.diff.policy import judged_nmse, make_policy
from refimpl.golden import write_golden
from refimpl.presets import PRESETS, build, save_preset

CASES = {  # convention -> (prompt, params)
    "hf": ([9707, 11, 1879, 13, 42, 7, 99], {}),
    "genie": ([9707, 11, 1879, 13, 42, 7, 99], {"ar": 8, "cl": 64, "mask_floor": -1000.0}),        # one padded chunk
    "genie-chunks": ([9707, 11, 1879, 13, 42, 7, 99, 5, 17, 300, 1200, 64], {"ar": 4, "cl": 64,
                                                                             "mask_floor": -1000.0}),  # 3 chunks
}
RUNTIMES = {  # name -> (dtype of the device, attention, conventions it runs)
    "eager": ("float32", "eager", ("hf", "genie", "genie-chunks")),
    "sdpa": ("float32", "sdpa", ("hf", "genie", "genie-chunks")),
    "ort": ("float32", "eager", ("genie",)),
    "bf16": ("bfloat16", "eager", ("hf", "genie")),
    "ort-fp16": ("float16", "eager", ("genie",)),
}


def prompts(case: str, extra: int) -> list:
    """The case's prompt and `extra` seeded random ones of the same length (ids below 100000: every preset's)."""
    prompt, _ = CASES[case]
    rng = np.random.default_rng(len(prompt))
    return [prompt] + [[int(t) for t in rng.integers(0, 100000, len(prompt))] for _ in range(extra)]


def honest_run(preset: str, runtime: str, case: str, steps: int, root: Path, goldens: dict, prompt: list,
               graphs: dict) -> dict:
    dtype, attn, _ = RUNTIMES[runtime]
    _, params = CASES[case]
    convention = "hf" if case == "hf" else "genie"
    key = (preset, case, "float32", tuple(prompt))
    if key not in goldens:
        goldens[key] = read_bundle(write_golden(root / f"{preset}-{case}-golden-{len(goldens)}", build(preset), prompt,
                                                source=preset, convention=convention, params=params, decode_steps=steps,
                                                taps="."))
    bundle = goldens[key]
    emulated = None
    if dtype != "float32":
        key = (preset, case, dtype, tuple(prompt))
        if key not in goldens:
            precision = {"float16": "fp16", "bfloat16": "bf16"}[dtype]
            goldens[key] = read_bundle(write_golden(root / f"{preset}-{case}-{dtype}-{len(goldens)}",
                                                    build(preset, precision=precision),
                                                    prompt, source=preset, convention=convention, params=params,
                                                    decode_steps=steps, taps=".",
                                                    decode_ids=bundle.manifest["generated_ids"]))
        emulated = goldens[key]
    if not (root / f"{preset}-ckpt").is_dir():
        save_preset(preset, root / f"{preset}-ckpt")
    model = D.load_hf(root / f"{preset}-ckpt", dtype, attn, "batched_mm" if runtime.startswith("ort") else None)
    m = bundle.manifest
    t = time.time()
    if convention == "hf":
        calls = D.run_hf(model, m["prompt_ids"], m["generated_ids"])
    else:
        p = m["convention"]["params"]
        if runtime.startswith("ort"):  # one export per preset, runtime and call shape, kept across prompts
            key = (preset, runtime)
            if key not in graphs:
                graphs[key] = D.ort_graph(model, model.config, p, None, Path(tempfile.mkdtemp(dir=root)))
            graph = graphs[key]
        else:
            graph = D.eager_graph(model, model.config, p)
        calls = D.run_genie(graph, model.config, [(s["graph"], s["tokens"]) for s in m["steps"]], p)
    seconds = time.time() - t
    dump = read_dump(D.write_dump(calls, Path(tempfile.mkdtemp(dir=root))), bundle)
    policy = make_policy({"layouts": {".": "hf-hooks"}}, dtype)
    report = compare(bundle, dump, policy, emulated=emulated)
    scored = [r for r in report.results if r.metrics and not r.metrics.get("integer") and r.metrics["n"]
              and r.status != "diverged"]  # after a tie the device follows another valid path: not judged
    def judged_sqnr(r):  # what the default bar judges: error over the tensor's power at the step or in the run
        return -10 * math.log10(max(judged_nmse(r.metrics), 1e-300)) if emulated is None else r.metrics["sqnr_db"]
    worst = min(scored, key=judged_sqnr)
    if emulated is None:
        bar = -10 * math.log10(policy.criteria(worst.name, False)["max_nmse"])
        margin, where = judged_sqnr(worst) - bar, worst
    else:  # three-way: 10 log10(k^2 NMSE_emulated / NMSE_device), the worst tensor
        def slack(r):
            limit = policy.criteria(r.name, False, r.reference)["max_nmse"]
            return 10 * math.log10(limit / max(r.metrics["nmse"], 1e-300))
        where = min(scored, key=slack)
        margin = slack(where)
    def channel_slack(r):  # how far the worst channel stays under its bar, in dB (refimpl.diff.channels)
        ch, c = r.metrics.get("channels"), policy.criteria(r.name, False, r.reference)
        if not ch or c.get("max_nmse") is None:
            return math.inf
        value = judged_channel_nmse(ch, r.metrics.get("run_power") if c.get("run_power") else None)
        return 10 * math.log10(channel_bar(ch, c["max_nmse"]) / max(value, 1e-300))
    channel_at = min(scored, key=channel_slack)
    return {"preset": preset, "runtime": runtime, "case": case, "verdict": "PASS" if report.exit_code == 0 else "FAIL",
            "channel_margin": channel_slack(channel_at),
            "channel_at": f"step {channel_at.step} {channel_at.name} channel {channel_at.metrics['channels']['worst']}"
            if channel_at.metrics.get("channels") else "",
            "tensors": len(report.results), "failed": len(report.failed), "worst_sqnr": judged_sqnr(worst),
            "worst": f"step {worst.step} {worst.name}", "margin": margin,
            "margin_at": f"step {where.step} {where.name}",
            "notes": report.notes, "seconds": seconds,
            "failures": [(r.key, r.failures) for r in report.failed][:3]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--runtimes", default=",".join(RUNTIMES))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--prompts", type=int, default=0, help="seeded random prompts per case besides the default one")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="refimpl-calibration-"))
    goldens, graphs, rows = {}, {}, []
    print(f"{'preset':18} {'runtime':9} {'case':13} {'verdict':7} {'n':>5} {'fail':>4} {'worst SQNR':>10} "
          f"{'margin dB':>9}  where")
    for preset in args.presets.split(","):
        for runtime in args.runtimes.split(","):
            for case in RUNTIMES[runtime][2]:
                if case not in args.cases.split(","):
                    continue
                for prompt in prompts(case, args.prompts):
                    r = honest_run(preset, runtime, case, args.steps, root, goldens, prompt, graphs)
                    rows.append(r)
                    print(f"{preset:18} {runtime:9} {case:13} {r['verdict']:7} {r['tensors']:5d} {r['failed']:4d} "
                          f"{r['worst_sqnr']:10.1f} {r['margin']:9.1f}  {r['margin_at']} ({r['seconds']:.0f} s)",
                          flush=True)
                    print(f"    worst channel: {r['channel_margin']:.1f} dB under its bar at {r['channel_at']}")
                    for note in r["notes"]:
                        print(f"    note: {note}")
                    for key, why in r["failures"]:
                        print(f"    fail: {key}: {'; '.join(why)}")
    by = {}
    for r in rows:
        k = (r["runtime"], "hybrid" if PRESETS[r["preset"]].get("linear_conv_kernel_dim") else "attention")
        by[k] = min(by.get(k, math.inf), r["margin"])
    print("\nworst margin per runtime and architecture (dB):")
    for (runtime, arch), m in sorted(by.items()):
        print(f"  {runtime:9} {arch:9} {m:6.1f}")
    return 0 if all(r["verdict"] == "PASS" and all(n.startswith("tie at") for n in r["notes"]) for r in rows) else 1


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
