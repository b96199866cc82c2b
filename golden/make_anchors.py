"""Regenerate the committed regression anchors: one small golden bundle per built-in preset.

    python golden/make_anchors.py            # writes golden/<preset>/ (replacing what is there)

Provenance: written by refimpl itself in float32 with its correctly rounded arithmetic (docs/numerics.md), so every
file but platform.json (where it was made: numpy 2.4.6, OpenBLAS 0.3.31 on an AVX-512 x86_64 machine) is the same
on any platform. tests/test_golden.py regenerates each anchor and requires every file bit-identical;
tests/test_platforms.py does so under 5 OpenBLAS kernels x 3 NumPy SIMD levels x 1 and 2 BLAS threads. A change of
bits means a change of refimpl's semantics: inspect the difference before regenerating.
"""

from pathlib import Path

import refimpl
from refimpl.golden import write_golden
from refimpl.presets import PRESETS

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
