"""Forward-pass benchmark: refimpl (correctly rounded float32, the default) vs refimpl's plain BLAS float32 path
(fast=True) vs transformers (torch CPU, float32, eager) on a Qwen3-0.6B-shaped model.

Workload, identical on every side: prefill 128 tokens (batch 1, logits for every position), then 32 cached
single-token decode steps with fixed token ids. Every side runs the same seeded random weights
(refimpl.presets.random_weights, copied into torch tensors), so the bench also prints how far their logits
are apart, and how many elements the correctly rounded path had to sum exactly (docs/numerics.md).

Each side runs in its own process, so its peak memory (peak RSS minus the process's RSS before the weights
are built) is its own. All stay resident while the timed rounds alternate between them (A B C C B A ...), one
at a time, so all see the same machine state; times are medians over rounds. The decode step is also
compared with its memory-bandwidth bound: the bytes one step must read (every weight matrix, the tied
embedding as lm_head, the KV cache) over the streaming-read bandwidth measured in the same run.

    python bench/forward.py            # full 28-layer model (about 2.4 GB of float32 weights per side)
    python bench/forward.py --quick    # 4 layers, 32-token prefill, 8 decode steps: a smoke run
    python bench/forward.py --plain    # plain-text table instead of rich

Prints times, ratios and PASS/MISS against the targets; never asserts.
"""

import argparse
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

THREADS = 2
SEED = 0
QWEN3_0_6B = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 3072, "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": True,
    "attention_bias": False, "use_sliding_window": False, "bos_token_id": 151643, "eos_token_id": 151645,
}
TARGETS = {"prefill": 1.0, "decode": 1.0, "bound": 1.3, "memory": 1.2,   # the plain path against transformers
           "exact_prefill": 2.5, "exact_bound": 1.5}                     # correctly rounded: vs plain, vs the bound
SIDES = ("refimpl", "refimpl-fast", "transformers")


def model_config(layers: int) -> dict:
    return {**QWEN3_0_6B, "num_hidden_layers": layers}


def workload(vocab: int, prompt_len: int, steps: int):
    """Fixed token ids, the same on every side: prompt [1, T] and one id per decode step."""
    rng = np.random.default_rng(SEED)
    return rng.integers(0, vocab, (1, prompt_len)), rng.integers(0, vocab, steps)


# ------------------------------------------------------------------------------------------------ the sides

def build_refimpl(d: dict, fast: bool = False):
    from refimpl.models.config import config_from_dict
    from refimpl.models.model import Model
    from refimpl.models.weights import Weights
    from refimpl.precision import Policy
    from refimpl.presets import random_weights

    cfg = config_from_dict(d, source="bench:qwen3-0.6b")
    model = Model(cfg, Weights(random_weights(cfg, SEED), "float32"), precision=Policy(fast=fast))
    weight_bytes = model.weights.nbytes()

    def forward(ids, cache):
        return model.forward(ids, cache=cache)

    return model.new_cache, forward, np.asarray, weight_bytes


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

    return new_cache, forward, to_numpy, weight_bytes


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
                "transformers": build_transformers}
    new_cache, forward, to_numpy, weight_bytes = builders[side](d)
    counts = count_fallbacks() if side == "refimpl" else {}
    build_time = time.perf_counter() - t0
    gc.collect()
    build_peak = maxrss_bytes() - baseline
    phases_separate = reset_peak_rss()
    reply({"weight_bytes": weight_bytes, "build_time": build_time, "build_peak": build_peak})

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
            logits = [forward(ids, cache) for ids in decode_ids]
            t2 = time.perf_counter()
            del cache
            reply({"prefill": t1 - t0, "decode": t2 - t1})
        elif command == "finish":
            forward_peak = maxrss_bytes() - baseline
            np.save(os.path.join(out_dir, f"{side}_prefill.npy"), to_numpy(prefill)[0])
            np.save(os.path.join(out_dir, f"{side}_decode.npy"), np.concatenate([to_numpy(x)[0] for x in logits]))
            reply({"forward_peak": forward_peak, "phases_separate": phases_separate,
                   "peak": max(build_peak, forward_peak) if phases_separate else forward_peak, "counts": counts})
            return


def count_fallbacks() -> dict:
    """Count, over the whole run, the product elements the float64 bound decides and those that need the exact
    fallback (kernels/products.py steps 3 and 4), and the elementary-function values that need mpmath."""
    from refimpl.kernels import elementary, products
    counts = {"products": 0, "products_fallback": 0, "products_fsum": 0, "functions": 0, "functions_mpmath": 0}
    rounded, exact_sums, exact_one, to_float32 = (products._rounded_product, products._exact_sums,
                                                  products._exact_sum_rounded, elementary.to_float32)

    def _rounded_product(a64, b64, c, e):
        counts["products"] += c.size
        return rounded(a64, b64, c, e)

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

    products._rounded_product, products._exact_sums, products._exact_sum_rounded = (
        _rounded_product, _exact_sums, _exact_sum_rounded)
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
        self.prefill, self.decode = [], []

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

    def round(self) -> None:
        r = self.ask("round")
        self.prefill.append(r["prefill"])
        self.decode.append(r["decode"])

    def finish(self) -> dict:
        self.info.update(self.ask("finish"))
        self.proc.wait()
        self.info.update(prefill_all=self.prefill, decode_all=self.decode,
                         prefill=statistics.median(self.prefill), decode=statistics.median(self.decode))
        return self.info


# ------------------------------------------------------------------------------------------------ the report

def report(args, r: dict, f: dict, h: dict, bw: dict, out_dir: str, contention) -> None:
    """r: refimpl (correctly rounded), f: refimpl fast (plain BLAS), h: transformers."""
    d = model_config(args.layers)
    L, Hkv, D = d["num_hidden_layers"], d["num_key_value_heads"], d["head_dim"]
    W = r["weight_bytes"]
    # one decode step reads every weight once (the tied embedding as lm_head; the gather reads one row) and the
    # K and V cache of every layer; the cache grows from P to P + steps - 1 positions over the run
    mean_past = args.prompt_len + (args.steps - 1) / 2
    kv_bytes = 2 * L * Hkv * D * 4 * mean_past
    step_bytes = W + kv_bytes
    bound = step_bytes / bw["read"]
    r_tok, f_tok, h_tok = (x["decode"] / args.steps for x in (r, f, h))
    load = lambda side, phase: np.load(f"{out_dir}/{side}_{phase}.npy")          # noqa: E731
    rp, fp, hp = (load(s, "prefill") for s in SIDES)
    rd, fd, hd = (load(s, "decode") for s in SIDES)
    scale = float(np.abs(hp).max())

    def row(name, a, b, ratio, target=None, fmt=fmt_s):
        ok = "" if target is None else f"<= {target:.1f}x  {verdict(ratio <= target)}"
        return [name, fmt(a), fmt(b) if b is not None else "", f"{ratio:.2f}x", ok]

    rows = [
        row(f"prefill {args.prompt_len} tok: correctly rounded / plain", r["prefill"], f["prefill"],
            r["prefill"] / f["prefill"], TARGETS["exact_prefill"]),
        row("decode per token: correctly rounded / bandwidth bound", r_tok, bound, r_tok / bound,
            TARGETS["exact_bound"]),
        row("decode per token: correctly rounded / plain", r_tok, f_tok, r_tok / f_tok),
        row("prefill: correctly rounded / transformers", r["prefill"], h["prefill"], r["prefill"] / h["prefill"]),
        row("decode per token: correctly rounded / transformers", r_tok, h_tok, r_tok / h_tok),
        row("prefill: plain / transformers", f["prefill"], h["prefill"], f["prefill"] / h["prefill"],
            TARGETS["prefill"]),
        row("decode per token: plain / transformers", f_tok, h_tok, f_tok / h_tok, TARGETS["decode"]),
        row("decode per token: plain / bandwidth bound", f_tok, bound, f_tok / bound, TARGETS["bound"]),
        row("transformers decode vs bound", h_tok, bound, h_tok / bound),
        row("peak memory - baseline (correctly rounded) / weights", r["peak"], W, r["peak"] / W, TARGETS["memory"],
            fmt=fmt_bytes),
        row("  while running forward", r["forward_peak"], W, r["forward_peak"] / W, fmt=fmt_bytes),
        row("peak memory - baseline (plain) / weights", f["peak"], W, f["peak"] / W, fmt=fmt_bytes),
        row("peak memory - baseline (transformers) / weights", h["peak"], W, h["peak"] / W, fmt=fmt_bytes),
    ]
    title = (f"Qwen3-0.6B-shaped forward, {d['num_hidden_layers']} layers, float32, {THREADS} threads, "
             f"median of {args.repeats}")
    print_table(title, ["", "refimpl", "plain / bound / transformers / weights", "ratio", "target"], rows,
                args.plain)
    c = r["counts"]
    print(f"correctly rounded products: {c['products']:,} elements, {c['products_fallback']:,} needed the exact "
          f"fallback ({1e6 * c['products_fallback'] / max(1, c['products']):.0f} per million), "
          f"{c['products_fsum']:,} of them summed one by one; elementary functions: {c['functions']:,} values, "
          f"{c['functions_mpmath']:,} by mpmath "
          f"({1e6 * c['functions_mpmath'] / max(1, c['functions']):.1f} per million)")
    print(f"weights: {fmt_bytes(W)} ({W:,} B); bytes read per decode step: {fmt_bytes(step_bytes)} "
          f"(weights + mean KV cache {fmt_bytes(kv_bytes)})")
    rates = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in bw.items() if k not in ("read", "read_method"))
    print(f"bandwidth, GB/s (1 GiB float32, best of 5; copy counts read + write, for information): {rates}; "
          f"bound uses the best read, {bw['read_method']} = {bw['read'] / 1e9:.1f} GB/s -> {fmt_s(bound)} per step")
    for name, x in zip(SIDES, (r, f, h)):
        print(f"runs (s), {name}: prefill {fmt_list(x['prefill_all'])} decode {fmt_list(x['decode_all'])}; "
              f"build {x['build_time']:.1f} s")
    for name, (p, q) in (("correctly rounded", (rp, rd)), ("plain", (fp, fd))):
        print(f"logits, refimpl {name} vs transformers: max |diff| prefill {np.abs(p - hp).max():.3g}, "
              f"decode {np.abs(q - hd).max():.3g} (max |logit| {scale:.3g}); "
              f"argmax agree prefill {np.mean(p.argmax(-1) == hp.argmax(-1)):.0%}, "
              f"decode {np.mean(q.argmax(-1) == hd.argmax(-1)):.0%}")
    print(f"logits, correctly rounded vs plain: max |diff| prefill {np.abs(rp - fp).max():.3g}, "
          f"decode {np.abs(rd - fd).max():.3g}")
    if contention is not None:
        print(f"cpu pressure while timing: some task waited for a CPU {contention:.0%} of the time"
              + (" -- other load on the machine; times are noisy (try --wait-idle 600)" if contention > 0.1 else ""))
    if h["weight_bytes"] != W:
        print(f"note: transformers holds {fmt_bytes(h['weight_bytes'])} of parameters, refimpl {fmt_bytes(W)}")
    if not r["phases_separate"]:
        print("note: could not reset the peak-RSS mark; peaks include the build")


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
    bw = memory_bandwidth()
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
        waited = timed = 0.0  # seconds some task waited for a CPU during the timed rounds, and their length
        for i in range(args.repeats):
            print(f"round {i + 1}/{args.repeats} ...", file=sys.stderr, flush=True)
            for s in (sides if i % 2 == 0 else sides[::-1]):
                if args.wait_idle:
                    wait_idle(args.wait_idle)
                p0, t0 = cpu_pressure_total(), time.perf_counter()
                s.round()
                if p0 is not None:
                    waited += cpu_pressure_total() - p0
                    timed += time.perf_counter() - t0
        r, f, h = (s.finish() for s in sides)
        contention = waited / timed if timed else None
        report(args, r, f, h, bw, out_dir, contention)


if __name__ == "__main__":
    main()
