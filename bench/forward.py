"""Forward-pass benchmark: refimpl (correctly rounded float32, the default: with float64 copies of the weights kept
resident, and converting them on every product instead) vs refimpl's plain BLAS float32 path (fast=True) vs
transformers (torch CPU, float32, eager) on a Qwen3-0.6B-shaped model.

Workload, identical on every side: prefill 128 tokens (batch 1, logits for every position), then 32 cached
single-token decode steps with fixed token ids. Every side runs the same seeded random weights
(refimpl.presets.random_weights, copied into torch tensors), so the bench also prints how far their logits
are apart, and how many elements the correctly rounded path had to sum exactly (docs/numerics.md); then a
profile per kernel stage of the correctly rounded sides (bench/_profile.py: products, conversion, error-bound
norms, rounding check, exact fallback, sums, elementary functions, attention, MoE) on one more prefill and decode,
and the resident and plain decode steps once more with every weight product replaced by zeros: what a step costs
beside the products, against the bound (the products' own floor is bench/decode_products.py's).

Each side runs in its own process, so its peak memory (peak RSS minus the process's RSS before the weights
are built) is its own. All stay resident while the timed rounds alternate between them (A B C C B A ...), one
at a time, so all see the same machine state; times are medians over rounds, and every ratio is also given per
round (min / median / max: the noise of a shared machine; /proc/loadavg is printed). The decode step is also
compared with its memory-bandwidth bound: the bytes one step must read (every weight matrix, the tied
embedding as lm_head, the KV cache) over the streaming-read bandwidth measured just before and just after each
side's round (the machine's varies by tens of percent within minutes: 34 to 60 GB/s in one afternoon), each side's
steps against the mean of the two around them.

    python bench/forward.py            # full 28-layer model (about 2.4 GB of float32 weights per side, and
                                       # 4.8 GB of float64 copies on the resident correctly rounded side)
    python bench/forward.py --quick    # 4 layers, 32-token prefill, 8 decode steps: a smoke run
    python bench/forward.py --plain    # plain-text table instead of rich

Prints times, ratios and PASS/MISS against the targets; never asserts.
"""

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    cpu_pressure_total,
    fmt_bytes,
    fmt_s,
    maxrss_bytes,
    memory_bandwidth,
    print_table,
    reset_peak_rss,
    verdict,
    wait_idle,
)
from _profile import Profile, profile_table  # noqa: E402

THREADS = 2
SEED = 0
QWEN3_0_6B = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 3072, "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": True,
    "attention_bias": False, "use_sliding_window": False, "bos_token_id": 151643, "eos_token_id": 151645,
}
TARGETS = {"prefill": 1.0, "decode": 1.0, "bound": 1.2, "memory": 1.2,   # the plain path against transformers
           "exact_prefill": 2.5, "exact_bound": 2.5, "convert_bound": 4.0}  # correctly rounded: vs plain, vs the bound
SIDES = ("refimpl", "refimpl-convert", "refimpl-fast", "transformers")
PROFILED = ("refimpl", "refimpl-convert")
RESTED = ("refimpl", "refimpl-fast")        # sides whose decode step is also timed without its weight products


def model_config(layers: int) -> dict:
    return {**QWEN3_0_6B, "num_hidden_layers": layers}


def workload(vocab: int, prompt_len: int, steps: int):
    """Fixed token ids, the same on every side: prompt [1, T] and one id per decode step."""
    rng = np.random.default_rng(SEED)
    return rng.integers(0, vocab, (1, prompt_len)), rng.integers(0, vocab, steps)


# ------------------------------------------------------------------------------------------------ the sides

def build_refimpl(d: dict, fast: bool = False, float64_copies: bool = True):
    from refimpl.models.config import config_from_dict
    from refimpl.models.model import Model
    from refimpl.models.weights import Weights
    from refimpl.precision import Policy
    from refimpl.presets import random_weights

    cfg = config_from_dict(d, source="bench:qwen3-0.6b")
    weights = Weights(random_weights(cfg, SEED), "float32")
    weights.float64_copies = float64_copies
    model = Model(cfg, weights, precision=Policy(fast=fast))
    weight_bytes = model.weights.nbytes()
    print(f"{'plain BLAS' if fast else 'correctly rounded'}: {weights.residency()}", file=sys.stderr, flush=True)

    def forward(ids, cache):
        return model.forward(ids, cache=cache)

    @contextlib.contextmanager
    def without_weight_products():
        """Every projection (Weights.linear: a step's weight products, lm_head included) returns zeros of its shape:
        what a step costs beside them (norms, RoPE, attention's products over the cache, activations, Python)."""
        weights.linear = lambda x, name, bias=None: np.zeros((*x.shape[:-1], weights.shape(name)[0]), x.dtype)
        try:
            yield
        finally:
            del weights.linear

    return model.new_cache, forward, np.asarray, weight_bytes, lambda: weights.float64_nbytes, without_weight_products


def build_transformers(d: dict):
    import torch
    from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

    from refimpl.models.config import config_from_dict
    from refimpl.presets import random_weights

    torch.set_num_threads(THREADS)
    hf_cfg = Qwen3Config(**{k: v for k, v in d.items() if k not in ("model_type", "architectures")})
    hf_cfg._attn_implementation = "eager"
    with torch.device("meta"):
        model = Qwen3ForCausalLM(hf_cfg)
    arrays = random_weights(config_from_dict(d), SEED)
    # each array becomes a torch-owned (aligned) copy and is freed at once, so the peak stays near one copy of
    # the weights; the rotary buffer is not a checkpoint tensor, so it is rebuilt on the CPU
    state = {k: torch.from_numpy(arrays.pop(k)).clone() for k in sorted(arrays)}
    model.load_state_dict(state, strict=False, assign=True)
    del state
    model.model.rotary_emb = type(model.model.rotary_emb)(config=hf_cfg)
    model.tie_weights()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_meta:
            raise SystemExit(f"transformers side: {name} was not loaded")
    model.eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: counted once

    def forward(ids, cache):
        with torch.no_grad():
            return model(input_ids=torch.from_numpy(ids), past_key_values=cache, use_cache=True).logits

    def new_cache():
        return DynamicCache(config=hf_cfg)

    def to_numpy(t):
        return t.detach().numpy()

    return new_cache, forward, to_numpy, weight_bytes, lambda: 0, None


def serve_side(side: str, layers: int, prompt_len: int, steps: int, out_dir: str) -> None:
    """Child process: build one side's model, then obey the parent's commands, one per stdin line:
    warmup (one prefill and two decode steps), round (one timed prefill + `steps` decode steps on a fresh cache),
    finish (write the last round's logits to out_dir, report memory, exit). Each reply is one JSON line."""
    if side == "transformers":
        import torch  # noqa: F401  (imported before the baseline, as NumPy is on the refimpl side)
        from transformers import Qwen3ForCausalLM  # noqa: F401
    else:
        import refimpl  # noqa: F401
    d = model_config(layers)
    prompt, tokens = workload(d["vocab_size"], prompt_len, steps)
    decode_ids = [np.array([[t]]) for t in tokens]
    gc.collect()
    reset_peak_rss()
    baseline = maxrss_bytes()

    t0 = time.perf_counter()
    builders = {"refimpl": build_refimpl, "refimpl-fast": lambda d: build_refimpl(d, fast=True),
                "refimpl-convert": lambda d: build_refimpl(d, float64_copies=False),
                "transformers": build_transformers}
    new_cache, forward, to_numpy, weight_bytes, float64_bytes, without_weight_products = builders[side](d)
    counts = count_fallbacks() if side in PROFILED else {}
    build_time = time.perf_counter() - t0
    gc.collect()
    build_peak = maxrss_bytes() - baseline
    phases_separate = reset_peak_rss()
    reply({"weight_bytes": weight_bytes, "build_time": build_time, "build_peak": build_peak})

    def decode(cache) -> tuple[list, list]:
        """The decode steps over `cache`: their logits, and each step's time."""
        logits, stamps = [], [time.perf_counter()]
        for ids in decode_ids:
            logits.append(forward(ids, cache))
            stamps.append(time.perf_counter())
        return logits, np.diff(stamps).tolist()

    prefill = logits = None
    for command in sys.stdin:
        command = command.strip()
        if command == "warmup":
            cache = new_cache()
            forward(prompt, cache)
            for ids in decode_ids[:2]:
                forward(ids, cache)
            del cache
            reply({})
        elif command == "round":
            prefill = logits = None  # free the previous round's outputs before this one runs
            cache = new_cache()
            t0 = time.perf_counter()
            prefill = forward(prompt, cache)
            t1 = time.perf_counter()
            logits, steps = decode(cache)
            del cache
            reply({"prefill": t1 - t0, "decode": sum(steps), "steps": steps})
        elif command == "rest":      # the decode steps again, every weight product replaced by zeros
            cache = new_cache()
            forward(prompt, cache)
            with without_weight_products():
                steps = decode(cache)[1]
            del cache
            reply({"rest": steps})
        elif command == "profile":   # one more prefill and decode, every kernel stage timed (bench/_profile.py)
            from _profile import kernel_profile
            rows = {}
            cache = new_cache()
            with kernel_profile() as prof, prof.phase():
                forward(prompt, cache)
            rows["prefill"] = (prof.wall, prof.rows())
            with kernel_profile() as prof, prof.phase():
                for ids in decode_ids:
                    forward(ids, cache)
            rows["decode"] = (prof.wall / len(decode_ids), {k: v / len(decode_ids) for k, v in prof.rows().items()})
            del cache
            reply({"profile": rows})
        elif command == "finish":
            forward_peak = maxrss_bytes() - baseline
            np.save(os.path.join(out_dir, f"{side}_prefill.npy"), to_numpy(prefill)[0])
            np.save(os.path.join(out_dir, f"{side}_decode.npy"), np.concatenate([to_numpy(x)[0] for x in logits]))
            reply({"forward_peak": forward_peak, "phases_separate": phases_separate, "float64_bytes": float64_bytes(),
                   "peak": max(build_peak, forward_peak) if phases_separate else forward_peak, "counts": counts})
            return


def count_fallbacks() -> dict:
    """Count, over the whole run, the product elements the float64 bound decides and those that need the exact
    fallback (kernels/products.py steps 3 and 4), and the elementary-function values that need mpmath."""
    from refimpl.kernels import elementary, products
    counts = {"products": 0, "products_fallback": 0, "products_fsum": 0, "functions": 0, "functions_mpmath": 0}
    rounded, kept, exact_sums, exact_one, to_float32 = (
        products._rounded_product, products._few_rows_kept, products._exact_sums, products._exact_sum_rounded,
        elementary.to_float32)

    def _rounded_product(a64, b64, c, *bound):
        counts["products"] += c.size
        return rounded(a64, b64, c, *bound)

    def _few_rows_kept(a, const):
        out = kept(a, const)
        counts["products"] += 0 if out is None else out.size
        return out

    def _exact_sums(a, b, *args):
        counts["products_fallback"] += a.shape[0]
        return exact_sums(a, b, *args)

    def _exact_sum_rounded(terms):
        counts["products_fsum"] += 1
        return exact_one(terms)

    correctly_rounded = elementary.correctly_rounded

    def counted(x, *args, **kw):
        counts["functions"] += np.size(x)
        return correctly_rounded(x, *args, **kw)

    def _to_float32(value):
        counts["functions_mpmath"] += 1
        return to_float32(value)

    products._rounded_product, products._few_rows_kept, products._exact_sums, products._exact_sum_rounded = (
        _rounded_product, _few_rows_kept, _exact_sums, _exact_sum_rounded)
    elementary.correctly_rounded, elementary.to_float32 = counted, _to_float32
    return counts


def reply(obj: dict) -> None:
    print(PROTOCOL + json.dumps(obj), flush=True)


PROTOCOL = "@@bench "


class Side:
    """The parent's handle on one side's child process."""

    def __init__(self, side: str, argv: list[str]):
        self.name = side
        self.proc = subprocess.Popen([sys.executable, *argv, "--side", side], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.info = self.read()
        self.prefill, self.decode, self.bandwidth = [], [], []     # per round: times, the read rate around them
        self.steps = []                                            # every decode step's time, all rounds

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(PROTOCOL):
                return json.loads(line[len(PROTOCOL):])
            sys.stderr.write(line)
        raise SystemExit(f"{self.name} side exited with code {self.proc.wait()}")

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def profile(self) -> None:
        self.info["profile"] = self.ask("profile")["profile"]

    def round(self) -> None:
        r = self.ask("round")
        self.prefill.append(r["prefill"])
        self.decode.append(r["decode"])
        self.steps += r["steps"]

    def finish(self) -> dict:
        self.info.update(self.ask("finish"))
        self.proc.wait()
        self.info.update(prefill_all=self.prefill, decode_all=self.decode, bandwidth_all=self.bandwidth,
                         steps=self.steps, prefill=statistics.median(self.prefill),
                         decode=statistics.median(self.decode))
        return self.info


# ------------------------------------------------------------------------------------------------ the report

def report(args, r: dict, c: dict, f: dict, h: dict, bws: list, out_dir: str, contention, loads) -> None:
    """r: refimpl (correctly rounded, float64 copies resident), c: the same converting the float32 weights on every
    product, f: refimpl fast (plain BLAS), h: transformers; bws: every bandwidth measurement, in order (each side's
    round between two of them: its bound is from their mean read rate, its bandwidth_all)."""
    d = model_config(args.layers)
    L, Hkv, D = d["num_hidden_layers"], d["num_key_value_heads"], d["head_dim"]
    W = r["weight_bytes"]
    # one decode step reads every weight once (the tied embedding as lm_head; the gather reads one row) and the
    # K and V cache of every layer; the cache grows from P to P + steps - 1 positions over the run
    mean_past = args.prompt_len + (args.steps - 1) / 2
    kv_bytes = 2 * L * Hkv * D * 4 * mean_past
    step_bytes = W + kv_bytes
    bound = lambda x: [step_bytes / bw for bw in x["bandwidth_all"]]              # noqa: E731 (per round)
    per_token = lambda x: [t / args.steps for t in x["decode_all"]]                # noqa: E731
    load = lambda side, phase: np.load(f"{out_dir}/{side}_{phase}.npy")          # noqa: E731
    rp, cp, fp, hp = (load(s, "prefill") for s in SIDES)
    rd, cd, fd, hd = (load(s, "decode") for s in SIDES)
    scale = float(np.abs(hp).max())

    def row(name, a, b, target=None, fmt=fmt_s):
        """a, b: per-round times (lists, paired by round) or one number each; ratio of medians, and per round."""
        a_all, b_all = (x if isinstance(x, list) else [x] for x in (a, b))
        ratios = [x / y for x, y in zip(a_all, b_all)] if len(a_all) == len(b_all) else \
            [x / statistics.median(b_all) for x in a_all]
        ratio = statistics.median(a_all) / statistics.median(b_all)
        spread = f"{min(ratios):.2f} / {statistics.median(ratios):.2f} / {max(ratios):.2f}" if len(ratios) > 1 else ""
        ok = "" if target is None else f"<= {target:.1f}x  {verdict(ratio <= target)}"
        return [name, fmt(statistics.median(a_all)), fmt(statistics.median(b_all)), f"{ratio:.2f}x", spread, ok]

    rows = [
        row(f"prefill {args.prompt_len} tok: correctly rounded / plain", r["prefill_all"], f["prefill_all"],
            TARGETS["exact_prefill"]),
        row("  (converting the weights) / plain", c["prefill_all"], f["prefill_all"]),
        row("prefill: plain / transformers", f["prefill_all"], h["prefill_all"], TARGETS["prefill"]),
        row("decode per token: correctly rounded, float64 copies resident / bound", per_token(r), bound(r),
            TARGETS["exact_bound"]),
        row("decode per token: correctly rounded, converting float32 / bound", per_token(c), bound(c),
            TARGETS["convert_bound"]),
        row("decode per token: plain / bandwidth bound", per_token(f), bound(f), TARGETS["bound"]),
        row("decode per token: correctly rounded / plain", per_token(r), per_token(f)),
        row("decode per token: plain / transformers", per_token(f), per_token(h), TARGETS["decode"]),
        row("decode per token: transformers / bound", per_token(h), bound(h)),
        row("prefill: correctly rounded / transformers", r["prefill_all"], h["prefill_all"]),
        row("peak memory - baseline (correctly rounded, float64 copies) / weights", r["peak"], W, fmt=fmt_bytes),
        row("peak memory - baseline (correctly rounded, converting) / weights", c["peak"], W, TARGETS["memory"],
            fmt=fmt_bytes),
        row("peak memory - baseline (plain) / weights", f["peak"], W, fmt=fmt_bytes),
        row("peak memory - baseline (transformers) / weights", h["peak"], W, fmt=fmt_bytes),
    ]
    title = (f"Qwen3-0.6B-shaped forward, {d['num_hidden_layers']} layers, float32, {THREADS} threads, "
             f"median of {args.repeats}")
    print_table(title, ["", "refimpl", "plain / bound / transformers / weights", "ratio",
                        "per round min / median / max", "target"], rows, args.plain)
    print_table(*profile_table({f"{phase} ({side})": Profile.of(*x["profile"][phase])
                                for phase in ("prefill", "decode") for side, x in (("resident", r), ("convert", c))},
                               "Where the correctly rounded time goes (one more run, every stage timed; decode: "
                               "per token; 'resident': float64 copies kept, 'convert': converted per product)"),
                args.plain)
    k = r["counts"]
    print(f"correctly rounded products: {k['products']:,} elements, {k['products_fallback']:,} needed the exact "
          f"fallback ({1e6 * k['products_fallback'] / max(1, k['products']):.0f} per million), "
          f"{k['products_fsum']:,} of them summed one by one; elementary functions: {k['functions']:,} values, "
          f"{k['functions_mpmath']:,} by mpmath "
          f"({1e6 * k['functions_mpmath'] / max(1, k['functions']):.1f} per million)")
    print(f"weights: {fmt_bytes(W)} ({W:,} B); bytes read per decode step: {fmt_bytes(step_bytes)} "
          f"(weights + mean KV cache {fmt_bytes(kv_bytes)}); the resident correctly rounded side also holds "
          f"float64 copies of the matrices: {fmt_bytes(r['float64_bytes'])} (its products read those instead: a "
          f"decode step reads twice the bound's bytes)")
    bw = min(bws, key=lambda x: x["read"])
    reads = ", ".join(f"{x['read'] / 1e9:.1f}" for x in bws)
    rates = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in bw.items() if k not in ("read", "read_method"))
    print(f"bandwidth, GB/s (1 GiB float32, best of 3 per method, measured before and after every side's round: "
          f"this machine's varies by tens of percent within minutes, so each side's steps are held against the mean "
          f"of the two around them): best read, in order, {reads}; the least: {rates}")
    for name, x in zip(SIDES, (r, c, f, h)):
        print(f"bound per round, {name}: {', '.join(fmt_s(b) for b in bound(x))} per step")
    for name, x in zip(SIDES, (r, c, f, h)):
        steps = x["steps"]
        deciles = statistics.quantiles(steps, n=10, method="inclusive") if len(steps) > 1 else steps
        p10, p90 = deciles[0], deciles[-1]
        print(f"decode steps, {name}: min {fmt_s(min(steps))}, p10 {fmt_s(p10)}, median "
              f"{fmt_s(statistics.median(steps))}, p90 {fmt_s(p90)}, max {fmt_s(max(steps))} over "
              f"{len(steps)} steps (the rows above: a round's mean; the machine's slow spells last seconds)")
    for name, x in zip(SIDES, (r, c, f, h)):
        if "rest" in x:
            rest, b = statistics.median(x["rest"]), step_bytes / x["rest_read"]
            print(f"decode steps without their weight products (each replaced by zeros), {name}: min "
                  f"{fmt_s(min(x['rest']))}, median {fmt_s(rest)} = {rest / b:.2f}x the bound around them "
                  f"({fmt_s(b)}): what a step costs beside the products (whose own floor bench/decode_products.py "
                  f"measures)")
    for name, x in zip(SIDES, (r, c, f, h)):
        print(f"runs (s), {name}: prefill {fmt_list(x['prefill_all'])} decode {fmt_list(x['decode_all'])}; "
              f"build {x['build_time']:.1f} s")
    for name, (p, q) in (("correctly rounded", (rp, rd)), ("plain", (fp, fd))):
        print(f"logits, refimpl {name} vs transformers: max |diff| prefill {np.abs(p - hp).max():.3g}, "
              f"decode {np.abs(q - hd).max():.3g} (max |logit| {scale:.3g}); "
              f"argmax agree prefill {np.mean(p.argmax(-1) == hp.argmax(-1)):.0%}, "
              f"decode {np.mean(q.argmax(-1) == hd.argmax(-1)):.0%}")
    print(f"logits, correctly rounded vs plain: max |diff| prefill {np.abs(rp - fp).max():.3g}, "
          f"decode {np.abs(rd - fd).max():.3g}; resident float64 copies vs converting: bit-identical "
          f"{'yes' if np.array_equal(rp, cp) and np.array_equal(rd, cd) else 'NO'}")
    if contention is not None:
        print(f"cpu pressure while timing: some task waited for a CPU {contention:.0%} of the time"
              + (" -- other load on the machine; times are noisy (try --wait-idle 600)" if contention > 0.1 else ""))
    print(f"load average (1, 5, 15 min) before the rounds {loads[0]}, after {loads[1]} ({os.cpu_count()} CPUs)")
    if h["weight_bytes"] != W:
        print(f"note: transformers holds {fmt_bytes(h['weight_bytes'])} of parameters, refimpl {fmt_bytes(W)}")
    if not r["phases_separate"]:
        print("note: could not reset the peak-RSS mark; peaks include the build")


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def fmt_list(xs):
    return "[" + ", ".join(f"{x:.3f}" for x in xs) + "]"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 layers, 32-token prefill, 8 decode steps")
    ap.add_argument("--plain", action="store_true", help="plain-text table")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--prompt-len", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                    help="before the bandwidth test and each round, wait up to this long for other CPU load to stop")
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    quick = {"layers": 4, "prompt_len": 32, "steps": 8, "repeats": 3}
    full = {"layers": 28, "prompt_len": 128, "steps": 32, "repeats": 3}
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    if args.side:  # child: one side, JSON replies on stdout
        serve_side(args.side, args.layers, args.prompt_len, args.steps, args.out_dir)
        return

    if args.wait_idle:
        wait_idle(args.wait_idle)
    gc.collect()
    with tempfile.TemporaryDirectory(prefix="refimpl-bench-") as out_dir:
        argv = [__file__, "--layers", str(args.layers), "--prompt-len", str(args.prompt_len),
                "--steps", str(args.steps), "--out-dir", out_dir]
        # every model stays resident (each in its own process); the timed rounds alternate A B C C B A ..., so
        # every side sees the same machine state, and only one runs at a time
        sides = []
        for name in SIDES:
            print(f"building {name} ...", file=sys.stderr, flush=True)
            sides.append(Side(name, argv))
        for s in sides:
            s.ask("warmup")
        loads = loadavg()
        waited = timed = 0.0  # seconds some task waited for a CPU during the timed rounds, and their length
        # the streaming bandwidth, measured before and after each side's round (the one after a side is the one
        # before the next): a side's steps are held against the mean read rate of the two around them
        bws = []
        for i in range(args.repeats):
            print(f"round {i + 1}/{args.repeats} ...", file=sys.stderr, flush=True)
            gc.collect()
            before = None
            for s in (sides if i % 2 == 0 else sides[::-1]):
                if args.wait_idle:
                    wait_idle(args.wait_idle)
                    before = None                                    # (measured again after the wait)
                if before is None:
                    before = memory_bandwidth(repeats=3)
                    bws.append(before)
                p0, t0 = cpu_pressure_total(), time.perf_counter()
                s.round()
                if p0 is not None:
                    waited += cpu_pressure_total() - p0
                    timed += time.perf_counter() - t0
                after = memory_bandwidth(repeats=3)
                bws.append(after)
                s.bandwidth.append((before["read"] + after["read"]) / 2)
                before = after
        loads = (loads, loadavg())
        for s in sides:
            if s.name in RESTED:                                  # its bound: the read rate around it, as a round's
                print(f"timing {s.name} without its weight products ...", file=sys.stderr, flush=True)
                before = memory_bandwidth(repeats=3)
                s.info["rest"] = s.ask("rest")["rest"]
                s.info["rest_read"] = (before["read"] + memory_bandwidth(repeats=3)["read"]) / 2
        for s in sides:
            if s.name in PROFILED:
                print(f"profiling {s.name} ...", file=sys.stderr, flush=True)
                s.profile()
        r, c, f, h = (s.finish() for s in sides)
        contention = waited / timed if timed else None
        report(args, r, c, f, h, bws, out_dir, contention, loads)


if __name__ == "__main__":
    main()
