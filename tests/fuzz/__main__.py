"""`python -m fuzz` (from tests/, as `make fuzz` runs it): N cases per format, a table of outcomes per format.

    python -m fuzz --cases 10000                      # every format, seeds 0..9999
    python -m fuzz --formats gguf,bundle --cases 500 --first 20000
    python -m fuzz --replay bundle:1234               # one case: its ops and its outcome
Exit status 1 when a case crashed, hung or ran out of memory; --save FILE writes those cases (format, seed, ops,
signature) as JSON, the form tests/fuzz/regressions.json keeps them in.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def main(argv=None) -> int:
    from .engine import TIME_LIMIT, Pool, table
    from .formats import FORMATS
    p = argparse.ArgumentParser(prog="python -m fuzz", description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=1000, help="cases per format")
    p.add_argument("--first", type=int, default=0, help="first seed")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--time-limit", type=float, default=TIME_LIMIT, help="seconds of CPU per case")
    p.add_argument("--memory", type=int, default=1536, help="MiB a worker may allocate beyond its start")
    p.add_argument("--save", help="write the crash / hang / memory cases here (JSON)")
    p.add_argument("--replay", help="FORMAT:SEED: run that one case and print its ops and outcome")
    args = p.parse_args(argv)
    if args.replay:
        name, seed = args.replay.split(":")
        with Pool({name: FORMATS[name]}, workers=1, time_limit=args.time_limit, memory_mib=args.memory) as pool:
            (r,) = pool.run([(name, int(seed), None)])
        print(json.dumps(r.ops))
        print(r.outcome, r.signature, r.message)
        return 0
    names = [n for n in args.formats.split(",") if n]
    unknown = [n for n in names if n not in FORMATS]
    if unknown:
        p.error(f"unknown format(s) {unknown}; choose from {', '.join(FORMATS)}")
    formats = {n: FORMATS[n] for n in names}
    # seed-major: every format advances together, so a run stopped early has covered each format alike
    jobs = [(n, s, None) for s in range(args.first, args.first + args.cases) for n in names]
    results, start, last = [], time.monotonic(), time.monotonic()
    with Pool(formats, workers=args.workers, time_limit=args.time_limit, memory_mib=args.memory) as pool:
        try:
            for r in pool.run(jobs):
                results.append(r)
                if r.outcome in ("crash", "hang", "memory"):
                    print(f"{r.format}:{r.seed} {r.outcome}: {r.signature}: {r.message[:200]}", flush=True)
                if time.monotonic() - last > 60:
                    last = time.monotonic()
                    print(f"[{len(results)}/{len(jobs)} cases, {last - start:.0f} s]", flush=True)
        except KeyboardInterrupt:   # Ctrl-C: the table of the cases run so far (seed-major: every format alike)
            print(f"\ninterrupted: {len(results)} of {len(jobs)} cases run")
    print(f"\n{len(results)} cases in {time.monotonic() - start:.0f} s "
          f"({args.workers} workers, {args.time_limit:g} s of CPU and {args.memory} MiB per case)")
    print(table(results, formats))
    bad = [r for r in results if r.outcome in ("crash", "hang", "memory")]
    if args.save:
        with open(args.save, "w") as f:
            json.dump([{"format": r.format, "seed": r.seed, "outcome": r.outcome, "signature": r.signature,
                        "ops": r.ops} for r in bad], f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
