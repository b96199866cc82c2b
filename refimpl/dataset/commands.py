"""CLI: `refimpl reference`, `refimpl compare-logits`, `refimpl export-kld-base`.

Exit codes: 0 done (compare-logits: every --policy bar met), 1 a bar missed, 2 bad input, 130 interrupted
(a reference run resumes where it stopped when the same command runs again).
"""

import json
import sys
import time
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ..arguments import load_model, positive, precision_flags
from ..diff.dump import read_mapping
from ..errors import InputError
from ..files import write_atomic
from ..formats.gguf import GGUFFile
from ..sources import load_tokenizer
from .compare import compare_logits, judge, parse_policy
from .llama import write_kld_base
from .reference import Job, open_reference, write_reference
from .report import print_report, render_html
from .windows import cut, read_documents


def add_commands(sub) -> None:
    r = sub.add_parser("reference", help="the reference's compact log-softmax and NLL over a dataset's windows "
                                         "(resumable; local processes or Ray)")
    r.add_argument("--model", required=True, help="preset name, HF checkpoint directory or .gguf file (workers "
                                                  "load it from this path)")
    data = r.add_mutually_exclusive_group(required=True)
    data.add_argument("--text", help="a text file: one document (as llama-perplexity -f reads it)")
    data.add_argument("--jsonl", help="a JSON-lines file: one document per line, its --field text or input_ids")
    r.add_argument("--field", default="text", help="--jsonl: the text field (default: text)")
    r.add_argument("--tokenizer", help="tokenizer source if not the model's")
    r.add_argument("--ctx", type=positive, default=512, help="window length in tokens (default 512)")
    r.add_argument("--stride", type=positive, help="llama-perplexity --ppl-stride: overlapping windows, the last "
                                                   "STRIDE positions scored (default: consecutive windows, the "
                                                   "second half scored)")
    r.add_argument("--convention", default="hf", choices=["hf", "genie", "qeff"])
    r.add_argument("--ar", type=positive, help="genie: token slots per call; qeff: seq_len")
    r.add_argument("--cl", type=positive, help="genie: context length; qeff: ctx_len")
    precision_flags(r)
    r.add_argument("--top-k", type=positive, default=10, help="reference top ids kept per position (default 10)")
    r.add_argument("--workers", type=positive, default=1, help="local processes (with --ray: Ray actors)")
    r.add_argument("--ray", nargs="?", const=True, default=None, metavar="ADDRESS",
                   help="run windows as Ray actors: a new local Ray instance, or the cluster at ADDRESS ('auto')")
    r.add_argument("--out", required=True, help="reference directory (resumed if it exists with the same settings)")
    r.add_argument("--overwrite", action="store_true", help="replace a reference made with other settings")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_reference)

    c = sub.add_parser("compare-logits", help="KLD, top-1 agreement and perplexity of the device's logits against "
                                              "a dataset reference")
    c.add_argument("reference", help="directory written by `refimpl reference`")
    c.add_argument("device", help="device logits per window: qnn-net-run output dir (Result_<k>/logits.raw), dir "
                                  "of <k>/logits.raw|.npy, .npz or .safetensors with keys <k>/logits")
    c.add_argument("--dump-dtype", help="dtype of raw files: float32 (default), float16, ...")
    c.add_argument("--mapping", help="JSON {golden name: device name}, e.g. {\"logits\": \"output_0\"}")
    c.add_argument("--top-k", type=positive, help="top-k overlap's k (default: the reference's)")
    c.add_argument("--policy", help="bars: a JSON file or 'max_mean_kld=0.01,min_top1=0.9' (exit 1 if missed)")
    c.add_argument("--json", help="write the full report (statistics, curves, worst positions) as JSON")
    c.add_argument("--html", help="write the HTML report with plots")
    c.add_argument("--worst", type=positive, default=10, help="worst windows / positions listed (default 10)")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_compare_logits)

    e = sub.add_parser("export-kld-base", help="write a reference as llama.cpp's --kl-divergence-base file")
    e.add_argument("reference")
    e.add_argument("out", help="the .kld file for llama-perplexity --kl-divergence-base FILE --kl-divergence")
    e.set_defaults(func=cmd_export_kld_base)


def _progress_bar(quiet: bool, what: str, unit: str):
    return Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TextColumn(unit), TextColumn(
        "{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        disable=quiet or not sys.stdout.isatty())  # on a terminal only: rich ends even a hidden bar with a newline


def cmd_reference(args) -> int:
    if args.stride is not None and args.stride >= args.ctx:
        raise InputError(f"--stride must be smaller than --ctx ({args.ctx}), got {args.stride}")
    params = {k: v for k, v in (("ar", args.ar), ("cl", args.cl)) if v is not None}
    if params and args.convention == "hf":
        raise InputError("--ar / --cl apply to --convention genie or qeff")
    if args.convention == "qeff":
        params = {{"ar": "seq_len", "cl": "ctx_len"}[k]: v for k, v in params.items()}
    model = load_model(args)
    used = []                           # the tokenizer, loaded only if some document is text

    def tokenizer():
        if not used:
            used.append(load_tokenizer(args.tokenizer or args.model))
        return used[0]
    bos = _gguf_bos(args.model) if str(args.model).lower().endswith(".gguf") else None
    documents = read_documents(args.text, args.jsonl, args.field, tokenizer)
    windows = cut(documents, args.ctx, args.stride, bos)
    data = {"file": Path(args.text or args.jsonl).name, "kind": "text" if args.text else "jsonl",
            "field": args.field if args.jsonl else None, "tokenizer": used[0].source if used else None,
            "stride": args.stride, "documents": len({d for d, _ in windows.documents})}
    job = Job(str(args.model), model.precision, args.convention, tuple(sorted(params.items())), windows.first,
              windows.scored, args.top_k)
    start, seen = time.perf_counter(), [None, 0]
    with _progress_bar(args.quiet, "reference windows", "") as bar:
        task = bar.add_task("", total=len(windows.tokens), rate="")

        def progress(done, total, tokens):
            if seen[0] is None:
                seen[0] = done
                if 0 < done < total and not args.quiet:
                    bar.console.print(f"resuming: {done} of {total} windows are already in {args.out}")
            seen[1] += tokens
            rate = seen[1] / max(time.perf_counter() - start, 1e-9)
            bar.update(task, completed=done, rate=f"{rate:,.0f} tok/s" if seen[1] else "")
        try:
            summary = write_reference(args.out, job, windows, data, bos=bos, workers=args.workers, ray=args.ray,
                                      overwrite=args.overwrite, progress=progress,
                                      model=model if args.workers == 1 and not args.ray else None)
        except KeyboardInterrupt:
            bar.stop()
            done = len(open_reference(args.out).finished())
            print(f"refimpl: interrupted: {done} of {len(windows.tokens)} windows are in {args.out}; run the same "
                  f"command again to resume")
            return 130
    print(f"wrote {args.out}: {summary['windows']} windows, {summary['scored_tokens']} scored tokens, reference "
          f"perplexity {summary['perplexity']:.6f}, {summary['bytes_per_scored_token']:,.0f} bytes per scored token")
    return 0


def _gguf_bos(path):
    """The BOS id llama-perplexity puts first in each window, if the GGUF's vocabulary asks for one."""
    meta = GGUFFile(path).metadata
    if meta.get("tokenizer.ggml.add_bos_token") and meta.get("tokenizer.ggml.bos_token_id") is not None:
        return int(meta["tokenizer.ggml.bos_token_id"])
    return None


def cmd_compare_logits(args) -> int:
    for out in (args.json, args.html):
        if out and not Path(out).resolve().parent.is_dir():
            raise InputError(f"{out}: its directory does not exist")
    bars = parse_policy(args.policy) if args.policy else {}
    ref = open_reference(args.reference)
    with _progress_bar(args.quiet, "comparing windows", "") as bar:
        task = bar.add_task("", total=None, rate="")
        report = compare_logits(ref, args.device, mapping=read_mapping(args.mapping) if args.mapping else None,
                                dtype=args.dump_dtype, top_k=args.top_k, worst=args.worst,
                                progress=lambda i, n: bar.update(task, completed=i, total=n))
    failures = judge(report, bars)
    report["policy"] = {"bars": bars, "failures": failures}
    print_report(report, failures)
    page = render_html(report, failures) if args.html else None
    if args.json:
        write_atomic(args.json, json.dumps(report, indent=1, default=lambda o: o.tolist()))
    if page is not None:
        write_atomic(args.html, page)
    return 1 if failures else 0


def cmd_export_kld_base(args) -> int:
    path = write_kld_base(open_reference(args.reference), args.out)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB): llama-perplexity -m MODEL.gguf -c CTX "
          f"--kl-divergence-base {path} --kl-divergence")
    return 0
