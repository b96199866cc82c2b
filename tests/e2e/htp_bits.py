"""How much of the HTP's output refimpl's htp-fp16 emulation predicts to the bit, per op kind (docs/htp.md).

    python tests/e2e/htp_bits.py [--presets tiny-qwen3,...] [--steps 2]

For every preset: the honest HTP genie run of tests/e2e/test_htp.py (tests/e2e/htp_runs.py: float16 export, every
node on the HTP) and refimpl's htp-fp16 bundle on the same tokens; per tap, the share of elements where the two are
the same float16 value, grouped by the op of the tap (refimpl's graph), and each architecture's three-way margin.
Two shares: of the free run (a tap's inputs already differ by the upstream error), and teacher-forced (refimpl's
htp-fp16 op on the HTP's own inputs of that op, as `refimpl replay` runs it): the second is how well the op's
arithmetic is stated. tests/e2e/htp_table.py prints them with the rest of the closing table.
Not a test: it takes minutes (the exports).
"""

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import htp_runs as T  # noqa: E402

from refimpl.diff.dump import read_dump  # noqa: E402
from refimpl.diff.policy import make_policy  # noqa: E402
from refimpl.diff.replay import device_tensor, run_step  # noqa: E402
from refimpl.models.config import config_from_dict  # noqa: E402
from refimpl.models.model import graph  # noqa: E402


def shares(case) -> tuple[dict, float, str]:
    bundle, emulated = case.golden(), case.golden("genie", "htp-fp16")
    dump_path = case.dump()
    dump, policy = read_dump(dump_path, bundle), make_policy(T.HTP_POLICY, "fp16")
    nodes = graph(config_from_dict(case.config))
    model = T.D.reference(case.config, case.arrays, "htp-fp16")
    kinds = {}
    for k, s in enumerate(bundle.manifest["steps"]):
        forced, _ = run_step(bundle, dump, model, k, policy)
        for name in s["taps"]:
            d = device_tensor(bundle, dump, k, "tap", name, policy)
            node = nodes.get(name)
            if d is None or node is None or not np.issubdtype(np.asarray(d).dtype, np.floating):
                continue
            e, r = emulated.tensor(k, "tap", name), forced.get(name)
            if e.shape != np.shape(d) or r is None or np.shape(r) != np.shape(d):
                continue
            d16 = np.asarray(d).astype(np.float16)
            n, free, teacher = kinds.get(node.op, (0, 0, 0))
            kinds[node.op] = (n + d16.size, free + int((d16 == e.astype(np.float16)).sum()),
                              teacher + int((d16 == np.asarray(r).astype(np.float16)).sum()))
    worst, where = T.margin(case.judge(dump_path))
    return kinds, worst, where


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(T.ARCHITECTURES))
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="refimpl-htp-bits-"))
    for arch in args.presets.split(","):
        kinds, worst, where = shares(T.case(arch, root / arch))
        print(f"{arch}: margin {worst:.1f} dB under the three-way bar (worst: {where})")
        print(f"    {'op':24} {'elements':>9} {'free run':>9} {'teacher-forced':>15}  (share bit-identical)")
        for kind, (n, free, teacher) in sorted(kinds.items()):
            print(f"    {kind:24} {n:9d} {100 * free / n:8.1f}% {100 * teacher / n:14.1f}%")
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
