"""Where the correctly rounded forward pass spends its time: a profile per kernel stage.

`kernel_profile()` wraps the stages of refimpl's kernels (module functions, so every caller goes through the
wrapper) with timers that count each stage's own time (time in a nested stage is counted there, not twice):

    float64 products (BLAS)      products._sliced_matmul / _vector_product: the float64 product itself
    float32 -> float64           products._to_float64 / _convert: converting an operand (weights without a float64
                                 copy; one token's products convert a cache-sized block of the weight at a time)
    column norms (error bound)   products.column_norms and products.constant: the bound's per-column quantities
    rounding check               products._rounded_product: both ends of the interval rounded, compared (and
                                 _few_rows_kept: a decode step's product over a kept float64 copy, its activations'
                                 conversion and norms included)
    exact fallback               products._exact_sums / _exact_sum_rounded: undecided elements summed again
    product set-up               the rest of products.matmul (the activations' conversion and norms, the blocks)
    sums (norms, softmax)        products.sumprod / cumsum: correctly rounded sums
    elementary functions         elementary.correctly_rounded: exp, silu, sigmoid, ... and their mpmath fallback
    weight conversion (stored)   Weights.convert: a stored tensor read and converted (bf16 -> float32, streaming)
    rest                         everything else: RMSNorm's elementwise steps, RoPE, masks, copies, Python

and, counted inclusively beside them (their products are also in the rows above), the attention score and value
products (qwen3's attention_scores + attend) and the MoE experts (mix_experts). Stage times are CPU seconds of
the threads that ran them: with the one-token products spread over the cores they may add up to more than the
wall time of the phase.

Run alone, it profiles the refimpl found on the path (so a checkout before a change can be profiled the same way):

    PYTHONPATH=/path/to/checkout python bench/_profile.py --layers 4 --prompt-len 128 --steps 8
"""

import contextlib
import threading
import time

STAGES = {   # (module, attribute) -> stage
    ("products", "_sliced_matmul"): "float64 products (BLAS)",
    ("products", "_vector_product"): "float64 products (BLAS)",
    ("products", "_to_float64"): "float32 -> float64 conversion",
    ("products", "_convert"): "float32 -> float64 conversion",
    ("products", "column_norms"): "column norms (error bound)",
    ("products", "constant"): "column norms (error bound)",
    ("products", "_rounded_product"): "rounding check",
    ("products", "_few_rows_kept"): "rounding check",
    ("products", "_exact_sums"): "exact fallback",
    ("products", "_exact_sum_rounded"): "exact fallback",
    ("products", "matmul"): "product set-up",
    ("products", "sumprod"): "sums (norms, softmax)",
    ("products", "cumsum"): "sums (norms, softmax)",
    ("elementary", "correctly_rounded"): "elementary functions",
    ("Weights", "convert"): "weight conversion (stored)",
}
INCLUSIVE = {("qwen3", "attention_scores"): "attention q.k", ("qwen3", "attend"): "attention p.v",
             ("qwen3", "mix_experts"): "MoE experts"}
ORDER = [*dict.fromkeys(STAGES.values()), "rest", *INCLUSIVE.values()]


class Profile:
    def __init__(self, cpu: bool = False):
        # wall time, or (cpu) CPU time: each stage its thread's, a phase the whole process's (all threads); CPU
        # time is what a loaded, shared machine still measures fairly (run BLAS on one thread then)
        self.clock = time.thread_time if cpu else time.perf_counter
        self.phase_clock = time.process_time if cpu else time.perf_counter
        self.own: dict[str, float] = {}        # stage -> own seconds
        self.inclusive: dict[str, float] = {}
        self.wall = 0.0
        self._local = threading.local()
        self._lock = threading.Lock()

    def _add(self, table, stage, seconds):
        with self._lock:
            table[stage] = table.get(stage, 0.0) + seconds

    def exclusive(self, stage, fn):
        def timed(*args, **kw):
            stack = self._local.__dict__.setdefault("stack", [])
            stack.append(0.0)                  # time spent in nested stages
            t0 = self.clock()
            try:
                return fn(*args, **kw)
            finally:
                total = self.clock() - t0
                nested = stack.pop()
                self._add(self.own, stage, total - nested)
                if stack:
                    stack[-1] += total
        return timed

    def inclusive_timer(self, stage, fn):
        def timed(*args, **kw):
            t0 = self.clock()
            try:
                return fn(*args, **kw)
            finally:
                self._add(self.inclusive, stage, self.clock() - t0)
        return timed

    @classmethod
    def of(cls, wall: float, rows: dict) -> "Profile":
        """A profile from its `rows()` (as sent between processes)."""
        prof = cls()
        prof.wall = wall
        prof.own = {k: v for k, v in rows.items() if k not in INCLUSIVE.values() and k != "rest"}
        prof.inclusive = {k: v for k, v in rows.items() if k in INCLUSIVE.values()}
        return prof

    @contextlib.contextmanager
    def phase(self):
        """Time a phase (its wall time is the denominator of the shares)."""
        t0 = self.phase_clock()
        try:
            yield self
        finally:
            self.wall += self.phase_clock() - t0

    def rows(self) -> dict[str, float]:
        """stage -> seconds, with `rest` = wall - the stages' own time (>= 0)."""
        out = {s: self.own.get(s, 0.0) for s in dict.fromkeys(STAGES.values())}
        out["rest"] = max(0.0, self.wall - sum(out.values()))
        out.update({s: self.inclusive.get(s, 0.0) for s in INCLUSIVE.values()})
        return out


@contextlib.contextmanager
def kernel_profile(cpu: bool = False):
    """Within the block every stage is timed into the yielded Profile (cpu: CPU time); the kernels are restored
    afterwards."""
    from refimpl.kernels import elementary, products
    from refimpl.models import qwen3
    from refimpl.models.weights import Weights
    modules = {"products": products, "elementary": elementary, "qwen3": qwen3, "Weights": Weights}
    prof = Profile(cpu)
    saved = []
    for table, wrap in ((STAGES, prof.exclusive), (INCLUSIVE, prof.inclusive_timer)):
        for (module, attr), stage in table.items():
            owner = modules[module]
            fn = getattr(owner, attr, None)
            if fn is None:                     # an older refimpl (a before / after comparison): not there
                continue
            saved.append((owner, attr, fn))
            setattr(owner, attr, wrap(stage, fn))
    try:
        yield prof
    finally:
        for owner, attr, fn in reversed(saved):
            setattr(owner, attr, fn)


def profile_table(profiles: dict, title: str) -> tuple[str, list[str], list[list[str]]]:
    """(title, columns, rows) of profiles {phase: Profile}: seconds and share of each phase's wall time."""
    columns = ["stage", *(f"{phase} ({p.wall:.2f} s)" for phase, p in profiles.items())]
    rows = []
    for stage in ORDER:
        cells = []
        for p in profiles.values():
            t = p.rows()[stage]
            cells.append(f"{t:.3f} s  {100 * t / p.wall:5.1f} %" if p.wall else "")
        rows.append([stage if stage not in INCLUSIVE.values() else f"(incl.) {stage}", *cells])
    return title, columns, rows


def main(argv=None) -> None:
    import argparse
    import sys
    from pathlib import Path

    import numpy as np
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import print_table
    from forward import SEED, model_config, workload

    import refimpl
    from refimpl.models.config import config_from_dict
    from refimpl.models.model import Model
    from refimpl.models.weights import Weights
    from refimpl.precision import Policy
    from refimpl.presets import random_weights
    ap = argparse.ArgumentParser(description="profile the correctly rounded forward pass per kernel stage")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--no-float64-copies", action="store_true", help="convert the weights on every product")
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--cpu-time", action="store_true", help="CPU time instead of wall time (a loaded machine; set "
                    "OPENBLAS_NUM_THREADS=1)")
    ap.add_argument("--fast", action="store_true", help="the plain BLAS path (for its time beside)")
    args = ap.parse_args(argv)
    d = model_config(args.layers)
    cfg = config_from_dict(d, source="bench:qwen3-0.6b")
    weights = Weights(random_weights(cfg, SEED), "float32")
    weights.float64_copies = not args.no_float64_copies
    model = Model(cfg, weights, precision=Policy(fast=args.fast))
    prompt, tokens = workload(d["vocab_size"], args.prompt_len, args.steps)
    cache = model.new_cache()
    model.forward(prompt, cache=cache)                            # warm-up: constants made, caches touched
    model.forward(np.array([[tokens[0]]]), cache=cache)
    profiles = {}
    cache = model.new_cache()
    with kernel_profile(args.cpu_time) as prof, prof.phase():
        model.forward(prompt, cache=cache)
    profiles[f"prefill {args.prompt_len}"] = prof
    with kernel_profile(args.cpu_time) as prof, prof.phase():
        for t in tokens:
            model.forward(np.array([[t]]), cache=cache)
    profiles[f"decode x{args.steps}"] = prof
    print(f"refimpl from {Path(refimpl.__file__).parent}; {args.layers} layers of the Qwen3-0.6B shape; "
          f"{getattr(weights, 'residency', lambda: '')()}")
    print_table(*profile_table(profiles, "kernel profile"), args.plain)


if __name__ == "__main__":
    main()
