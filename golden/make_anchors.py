"""Regenerate the committed regression anchors: one small golden bundle per built-in preset.

    python golden/make_anchors.py            # writes golden/<preset>/ (replacing what is there)

Provenance: written by refimpl itself (float32, BLAS on one thread) with numpy 2.4 / OpenBLAS 0.3.31 on the
project's x86_64 machines. tests/test_golden.py regenerates each anchor and requires every file bit-identical;
if a dependency upgrade changes bits, inspect the difference before regenerating.
"""

from pathlib import Path

import refimpl
from refimpl.golden import write_golden
from refimpl.models.presets import PRESETS

HERE = Path(__file__).parent
PROMPT = [9707, 11, 1879]            # three tokens: a left-padded AR=2 chunk, then a full one
PARAMS = {"ar": 2, "cl": 8}          # every other genie option at its default (AI Hub's exported I/O)
TAPS = r"^model\.layers\.0\."        # the first layer's intermediates


def write_anchor(name: str, out_dir) -> Path:
    return write_golden(out_dir, refimpl.load(name), PROMPT, source=name, convention="genie", params=PARAMS,
                        decode_steps=1, taps=TAPS, overwrite=True)


if __name__ == "__main__":
    for name in PRESETS:
        print(write_anchor(name, HERE / name))
