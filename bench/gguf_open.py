"""Opening a GGUF with a 250k-token vocabulary (and 250k merges): refimpl's reader vs gguf-py's GGUFReader, same
file, same run. Prints the ratio; asserts nothing.

    python bench/gguf_open.py [--vocab 250000]
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import gguf

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "formats")]
from test_gguf import big_vocabulary_gguf  # noqa: E402  (the file the test reads)

from refimpl.formats import gguf as G  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=250_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = big_vocabulary_gguf(Path(d) / "big.gguf", args.vocab)
        t0 = time.perf_counter()
        g = G.GGUFFile(path)
        opened = time.perf_counter() - t0
        G.tokenizer_metadata(g)
        ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        r = gguf.GGUFReader(path)
        tokens = r.fields["tokenizer.ggml.tokens"]
        [str(bytes(tokens.parts[i]), "utf-8") for i in tokens.data]
        peer = time.perf_counter() - t0
    print(f"{args.vocab} tokens + merges: refimpl opens the header in {opened:.3f} s, {ours:.3f} s with every string "
          f"decoded; gguf-py's GGUFReader + token strings {peer:.2f} s  (ratio {ours / peer:.4f})")


if __name__ == "__main__":
    main()
