"""Full-size checkpoints in bounded memory: synthetic checkpoints of released shapes, run by refimpl with its
default residency (streamed per layer when the converted model does not fit in half of memory).

Shapes (config.json as released; seeded random bf16 weights, sharded safetensors + index as released):
  qwen3-8b        Qwen3-8B dense, 36 layers (16.4 GB)
  qwen3-30b-a3b   Qwen3-30B-A3B MoE, 128 experts top-8, per-expert tensors; 48 layers (61 GB) when the disk has
                  room for them and a margin, else fewer (the count is printed)
  qwen3.5-9b      Qwen3.5-9B hybrid (Gated DeltaNet + gated attention), in the multimodal layout
                  (model.language_model.*, plus small vision / MTP tensors that are set aside)

For each shape: write the checkpoint; then, in a fresh process (refimpl's default arithmetic: correctly rounded
float32 products, BLAS on its own threads): load, prefill PROMPT tokens (logits for every position, with a cache),
decode DECODE greedy tokens. Measured: load time, prefill time, decode time per token,
peak anonymous memory (RssAnon sampled every ms from /proc by this process: file-backed pages of the memory-
mapped checkpoint are page cache, not the process's), the KV cache's bytes, and each decode step against the
read-and-convert bound of the weights it touched: the same tensor parts read from the map and converted again,
timed on their own right after the step (each step run --repeats times on a copy of the cache: the least time of
each counts, the machine being shared). Both start from the disk: the checkpoint's pages are dropped from the
page cache before each (posix_fadvise on its own files only), as a checkpoint larger than the page cache is read
(a 30B-A3B decode step reads 8 of 128 experts a layer, mostly not cached); the bound from the page cache (warm)
is printed too. Targets: 8B peak anonymous <= 2 GiB + KV cache, 30B-A3B <= 3 GiB, decode <= 2x the bound. The
checkpoint is deleted afterwards unless --keep.

    python bench/scale.py                                  # all three shapes, one after the other
    python bench/scale.py --shape qwen3-8b --keep --dir /work/scale
    python bench/scale.py --shape qwen3-30b-a3b --layers 8 --decode 3

Prints a table and PASS/MISS against the targets; never asserts.
"""

import argparse
import copy
import json
import math
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_pressure_total, fmt_bytes, fmt_s, print_table, verdict, wait_idle  # noqa: E402

GiB = 2**30
SHARD_BYTES = 4 * 10**9          # released Qwen checkpoints come in ~4 GB shards

_QWEN3 = {"hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
          "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
          "sliding_window": None, "max_window_layers": 36, "bos_token_id": 151643, "eos_token_id": 151645,
          "vocab_size": 151936, "tie_word_embeddings": False, "head_dim": 128, "initializer_range": 0.02,
          "use_cache": True, "torch_dtype": "bfloat16"}
SHAPES = {
    "qwen3-8b": {**_QWEN3, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
                 "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8},
    "qwen3-30b-a3b": {**_QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                      "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "moe_intermediate_size": 768,
                      "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                      "decoder_sparse_step": 1, "mlp_only_layers": [], "max_window_layers": 48,
                      "output_router_logits": False, "router_aux_loss_coef": 0.001},
    "qwen3.5-9b": {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                   "tie_word_embeddings": False, "image_token_id": 248056, "video_token_id": 248057,
                   "vision_start_token_id": 248053, "vision_end_token_id": 248054,
                   "text_config": {"model_type": "qwen3_5_text", "hidden_size": 4096, "intermediate_size": 12288,
                                   "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
                                   "head_dim": 256, "hidden_act": "silu", "max_position_embeddings": 262144,
                                   "rms_norm_eps": 1e-6, "vocab_size": 248320, "attention_bias": False,
                                   "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
                                   "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                                   "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                                   "mtp_num_hidden_layers": 1, "eos_token_id": 248044, "dtype": "bfloat16",
                                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                                       "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                                       "mrope_section": [11, 11, 10]}},
                   "vision_config": {"depth": 27, "hidden_size": 1152}},
}
TARGETS = {"qwen3-8b": 2 * GiB, "qwen3-30b-a3b": 3 * GiB}   # peak anonymous memory, + the KV cache
# tensors of the released multimodal / MTP checkpoints that refimpl sets aside (a few, small here)
SET_ASIDE = {"model.visual.patch_embed.proj.weight": (1152, 3, 2, 16, 16), "model.visual.merger.norm.weight": (1152,),
             "mtp.fc.weight": (4096, 8192), "mtp.norm.weight": (4096,)}


# ---------------------------------------------------------------------------------------------------- writing

def checkpoint_tensors(config: dict) -> dict[str, tuple]:
    """Checkpoint name -> shape, in the released layout (per-expert Qwen3-MoE tensors, multimodal prefix)."""
    from refimpl.models import hybrid, qwen3
    from refimpl.models.config import config_from_dict
    cfg = config_from_dict(config)
    shapes = (hybrid if cfg.is_hybrid else qwen3).expected_tensors(cfg)
    out = {}
    for name, shape in shapes.items():
        if cfg.model_type == "qwen3_moe" and name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            p = name.rsplit(".", 1)[0]
            E, rows, cols = shape
            for e in range(E):
                if name.endswith("gate_up_proj"):
                    out[f"{p}.{e}.gate_proj.weight"] = out[f"{p}.{e}.up_proj.weight"] = (rows // 2, cols)
                else:
                    out[f"{p}.{e}.down_proj.weight"] = (rows, cols)
            continue
        if config["model_type"] == "qwen3_5" and name.startswith("model."):
            name = "model.language_model." + name[len("model."):]
        out[name] = shape
    if config["model_type"] == "qwen3_5":
        out.update(SET_ASIDE)
    return out


class Values:
    """Seeded random bf16 values, written fast: matrices N(0, 1/fan_in) taken from a pool of 16M such values per
    fan-in at random offsets, 1-D tensors drawn on their own (norm weights around 1, or 0 when zero-centred)."""
    POOL = 1 << 24

    def __init__(self, seed: int, zero_centered: bool):
        self.rng, self.zero_centered, self.pools = np.random.default_rng(seed), zero_centered, {}

    def _pool(self, fan_in: int) -> np.ndarray:
        if fan_in not in self.pools:
            x = self.rng.standard_normal(self.POOL, dtype=np.float32) / np.float32(math.sqrt(fan_in))
            self.pools[fan_in] = x.astype(ml_dtypes.bfloat16).view(np.uint16)
        return self.pools[fan_in]

    def write(self, f, name: str, shape: tuple) -> None:
        n = math.prod(shape)
        if len(shape) == 1:
            x = 0.1 * self.rng.standard_normal(n, dtype=np.float32)
            if name.endswith(".A_log"):
                x = np.log(self.rng.uniform(1, 16, n)).astype(np.float32)
            elif "norm" in name and (not self.zero_centered or ".linear_attn.norm" in name):
                x += 1
            f.write(x.astype(ml_dtypes.bfloat16).view(np.uint16).tobytes())
            return
        pool = self._pool(1 if "embed_tokens" in name else math.prod(shape[1:]))
        while n:
            k = min(n, self.POOL // 2)
            start = int(self.rng.integers(0, self.POOL - k + 1))
            f.write(pool[start:start + k].data)
            n -= k


def write_checkpoint(directory: Path, config: dict, seed: int = 0) -> int:
    """config.json, model-0000k-of-0000n.safetensors shards and their index; returns the bytes written."""
    from refimpl.progress import layer_progress
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tensors = checkpoint_tensors(config)
    shards, current, size = [], [], 0
    for name, shape in tensors.items():
        nbytes = 2 * math.prod(shape)
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    shards.append(current)
    text = config.get("text_config", config)
    values = Values(seed, text["model_type"] != "qwen3" and text["model_type"] != "qwen3_moe")
    weight_map, total = {}, 0
    with layer_progress("writing", sum(2 * math.prod(s) for s in tensors.values()) >> 20, "MiB") as advance:
        for k, shard in enumerate(shards, 1):
            fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for name, shape in shard:
                end = offset + 2 * math.prod(shape)
                header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, end]}
                offset = end
                weight_map[name] = fname
            blob = json.dumps(header, separators=(",", ":")).encode()
            blob += b" " * (-len(blob) % 8)
            with open(directory / fname, "wb") as f:
                f.write(struct.pack("<Q", len(blob)) + blob)
                for name, shape in shard:
                    values.write(f, name, shape)
                    advance(2 * math.prod(shape) / 2**20)
            total += 8 + len(blob) + offset
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def checkpoint_bytes(config: dict) -> int:
    return sum(2 * math.prod(s) for s in checkpoint_tensors(config).values())


# ---------------------------------------------------------------------------------------------------- measuring

def child(args) -> None:
    """The measured process: load, prefill, decode; phases and results as JSON on stdout."""
    import refimpl
    from refimpl.models.stored import read
    from refimpl.models.weights import Weights
    if args.no_read_ahead:            # A/B: the layer-ahead and routed-expert disk hints off
        Weights.prefetch = lambda self, names: None
    marks = {"start": time.time()}
    t0 = time.perf_counter()
    model = refimpl.load(args.child, max_resident_bytes=args.max_resident)
    t_load = time.perf_counter() - t0
    marks["loaded"] = time.time()
    w, cfg = model.weights, model.config
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg.vocab_size, (1, args.prompt))
    pressure = [cpu_pressure_total()]
    wait_idle(30)
    cache = model.new_cache()
    marks["prefill"] = time.time()
    t0 = time.perf_counter()
    logits = model.forward(ids, cache=cache)
    t_prefill = time.perf_counter() - t0
    marks["decode"] = time.time()
    steps = []
    token = int(np.argmax(logits[0, -1]))
    del logits
    for _ in range(args.decode):
        # each step is run `repeats` times on a copy of the cache (the machine is shared: the least time of each
        # measure is the one least disturbed), from the disk each time, and timed against its bound
        runs = []
        for _ in range(args.repeats):
            trial = copy.deepcopy(cache)
            evict(w)                      # the step reads its weights from the disk, as the bound does below
            w.conversion_log = []
            t0 = time.perf_counter()
            logits = model.forward(np.array([[token]]), cache=trial)
            t_step = time.perf_counter() - t0
            log, w.conversion_log = w.conversion_log, None
            bounds = []
            for cold in (True, False):    # the same parts read and converted again: from the disk, then cached
                if cold:
                    evict(w)
                t0 = time.perf_counter()
                for name, index in log:
                    w.convert(name, index)
                bounds.append(time.perf_counter() - t0)
            runs.append((t_step, *bounds))
        touched = sum(read(w.stored[w.aliases.get(n, n)], i).nbytes for n, i in log)
        cache = trial
        token = int(np.argmax(logits[0, -1]))
        steps.append({"seconds": min(r[0] for r in runs), "bound_seconds": min(r[1] for r in runs),
                      "warm_bound_seconds": min(r[2] for r in runs), "runs": runs, "touched_bytes": touched,
                      "converted_parts": len(log)})
    marks["end"] = time.time()
    kv = sum(x.nbytes for layer in cache.layers if layer is not None
             for x in (vars(layer).values()) if isinstance(x, np.ndarray))
    pressure.append(cpu_pressure_total())
    print(json.dumps({"load_seconds": t_load, "prefill_seconds": t_prefill, "steps": steps, "kv_bytes": kv,
                      "residency": w.residency(), "budget": None if math.isinf(w.budget) else w.budget,
                      "converted_bytes": w.converted_nbytes(), "stored_bytes": w.nbytes(),
                      "set_aside": len(w.set_aside), "layers": cfg.num_hidden_layers, "marks": marks,
                      "cpu_wait_seconds": None if None in pressure else pressure[1] - pressure[0]}))


def evict(weights) -> None:
    """Drop the checkpoint's pages from this process's mappings (madvise) and from the page cache (fadvise), so
    the next read of any tensor comes from the disk (only this checkpoint's files are touched)."""
    import mmap
    seen = set()
    for a in weights.stored.values():
        while a is not None and getattr(a, "_mmap", None) is None:
            a = getattr(a, "base", None)
        if a is not None and id(a._mmap) not in seen:
            seen.add(id(a._mmap))
            a._mmap.madvise(mmap.MADV_DONTNEED)
    for f in set(weights.origins.values()):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rss_anon(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def measure(directory: Path, args) -> dict:
    """Run the child on the checkpoint, sampling its RssAnon every millisecond."""
    cmd = [sys.executable, __file__, "--child", str(directory), "--prompt", str(args.prompt),
           "--decode", str(args.decode), "--repeats", str(args.repeats)]
    if args.max_resident is not None:
        cmd += ["--max-resident", str(args.max_resident)]
    if args.no_read_ahead:
        cmd += ["--no-read-ahead"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    samples = []
    while proc.poll() is None:
        a = rss_anon(proc.pid)
        if a is not None:
            samples.append((time.time(), a))
        time.sleep(0.001)
    out = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(f"the measured process failed (exit {proc.returncode})")
    result = json.loads(out)
    marks = result["marks"]
    phases = [("load", "start", "loaded"), ("prefill", "prefill", "decode"), ("decode", "decode", "end")]
    result["peak_anon"] = max(a for _, a in samples)
    result["phase_peak_anon"] = {p: max((a for t, a in samples if marks[s] <= t <= marks[e]), default=0)
                                 for p, s, e in phases}
    result["samples"] = len(samples)
    result["trace"] = samples
    return result


# ---------------------------------------------------------------------------------------------------- main

def run_shape(shape: str, args) -> dict:
    config = json.loads(json.dumps(SHAPES[shape]))
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    directory = root / shape
    if shape == "qwen3-30b-a3b":
        one = checkpoint_bytes({**config, "num_hidden_layers": 1})
        per_layer = checkpoint_bytes({**config, "num_hidden_layers": 2}) - one
        free = shutil.disk_usage(root).free + (_du(directory) if directory.exists() else 0)
        fits = int((free - args.disk_margin * GiB - (one - per_layer)) // per_layer)
        layers = min(48, args.layers or 48, fits)
        if layers < 1:
            raise SystemExit(f"{root}: {fmt_bytes(free)} free is not enough for one MoE layer plus a margin")
        config.update(num_hidden_layers=layers, max_window_layers=layers)
    elif args.layers:
        text = config.get("text_config", config)
        text.update(num_hidden_layers=args.layers, **({"max_window_layers": args.layers}
                                                      if "max_window_layers" in text else {}))
    if directory.exists() and (not (directory / "config.json").exists()
                               or json.loads((directory / "config.json").read_text()) != config):
        shutil.rmtree(directory)      # a kept checkpoint of another layer count
    need = checkpoint_bytes(config)
    free = shutil.disk_usage(root).free + (_du(directory) if directory.exists() else 0)
    if need + args.disk_margin * GiB > free:
        raise SystemExit(f"{root}: {shape} needs {fmt_bytes(need)} + a {args.disk_margin} GiB margin, "
                         f"{fmt_bytes(free)} free")
    try:
        if not (directory / "model.safetensors.index.json").exists():
            t0 = time.perf_counter()
            written = write_checkpoint(directory, config)
            print(f"{shape}: wrote {fmt_bytes(written)} in {fmt_s(time.perf_counter() - t0)} to {directory}",
                  file=sys.stderr)
        result = measure(directory, args)
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    result.update(shape=shape, checkpoint_bytes=need)
    return result


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def report(results: list[dict], plain: bool) -> None:
    rows = []
    for r in results:
        steps = r["steps"]
        dec = statistics.median(s["seconds"] for s in steps)
        bound = statistics.median(s["bound_seconds"] for s in steps)
        touched = statistics.median(s["touched_bytes"] for s in steps)
        warm = statistics.median(s["warm_bound_seconds"] for s in steps)
        target = TARGETS.get(r["shape"])
        ok_mem = target is None or r["peak_anon"] <= target + r["kv_bytes"]
        ok_dec = dec <= 2 * bound
        rows.append([r["shape"], str(r["layers"]), fmt_bytes(r["checkpoint_bytes"]), fmt_s(r["load_seconds"]),
                     fmt_s(r["prefill_seconds"]), fmt_s(dec),
                     f"{fmt_bytes(touched)} / {fmt_s(bound)} (cached {fmt_s(warm)})",
                     f"{dec / bound:.2f}", fmt_bytes(r["peak_anon"]),
                     " / ".join(fmt_bytes(r["phase_peak_anon"][p]) for p in ("load", "prefill", "decode")),
                     fmt_bytes(r["kv_bytes"]),
                     (fmt_bytes(target) + " + KV" if target else "-"),
                     verdict(ok_mem and ok_dec)])
    print_table("refimpl on full-size checkpoints (bf16 safetensors, default residency)",
                ["shape", "layers", "checkpoint", "load", f"prefill {results[0]['prompt']}", "decode / token",
                 "touched / read+convert bound", "decode / bound", "peak anon", "peak anon load / prefill / decode",
                 "KV cache", "anon target", "verdict"], rows, plain)
    for r in results:
        print(f"{r['shape']}: {r['residency']}; {r['set_aside']} tensors set aside; {r['samples']} RssAnon samples; "
              f"CPU wait during the run {r['cpu_wait_seconds'] or 0:.1f} s (other load on the machine)")


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.6 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        t0 = r["marks"]["start"]
        t, a = zip(*r["trace"])
        ax.plot(np.array(t) - t0, np.array(a) / GiB, lw=0.8)
        for name, color in (("prefill", "tab:orange"), ("decode", "tab:green")):
            ax.axvline(r["marks"][name] - t0, color=color, ls="--", lw=0.8, label=f"{name} starts")
        if r["shape"] in TARGETS:
            ax.axhline((TARGETS[r["shape"]] + r["kv_bytes"]) / GiB, color="tab:red", lw=0.8, label="target")
        ax.set_title(f"{r['shape']} ({r['layers']} layers): RssAnon of the refimpl process")
        ax.set_ylabel("GiB")
        ax.legend(loc="lower right", fontsize=7)
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    ap.add_argument("--dir", default=os.environ.get("REFIMPL_SCALE_DIR", "/tmp/refimpl-scale"),
                    help="where checkpoints are written")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints (default: delete them)")
    ap.add_argument("--disk-margin", type=float, default=16, help="GiB left free on the disk (it is shared)")
    ap.add_argument("--layers", type=int, help="layers (default: the released count; the MoE: 48, or what fits "
                                               "on the disk)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=3, help="decode steps measured")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each step (the least time counts)")
    ap.add_argument("--max-resident", type=int, help="bytes (default: refimpl's default residency)")
    ap.add_argument("--no-read-ahead", action="store_true", help="A/B: no read-ahead hints (Weights.prefetch)")
    ap.add_argument("--plot", help="write RssAnon over time to this PNG")
    ap.add_argument("--json", help="write the results to this JSON file")
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    results = []
    for shape in (SHAPES if args.shape == "all" else [args.shape]):   # one at a time: disk and memory are shared
        r = run_shape(shape, args)
        r["prompt"] = args.prompt
        results.append(r)
        report([r], args.plain)
    if len(results) > 1:
        report(results, args.plain)
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "trace"} for r in results],
                                              indent=1))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
