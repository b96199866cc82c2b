"""refimpl command line: `refimpl info MODEL`, `refimpl run MODEL --input-ids 1,2,3`, `refimpl golden ...`,
`refimpl generate --prompt TEXT ...`, `refimpl convert MODEL --to gguf --out F --type q8_0`,
`refimpl diff BUNDLE DUMP`, `refimpl replay`, `refimpl explain`, `refimpl reference --model M --text F --out REF`,
`refimpl compare-logits REF DUMP`, `refimpl export-kld-base REF F.kld`.

Bad arguments and bad files print one line, `refimpl: error: ...`, and exit with status 2.
"""

import argparse
import logging
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn

from .arguments import finite, load_model, nonnegative, positive, precision_flags, regex, token_ids
from .bundle import read_bundle
from .dataset.commands import add_commands as add_dataset_commands
from .diff.commands import add_commands as add_diff_commands
from .errors import InputError, RefimplError
from .formats.gguf import GGUFFile, tokenizer_metadata, unreadable, write_gguf
from .generate import SamplingParams, checkpoint_sampling, default_eos, generate
from .golden import write_golden
from .presets import DEFAULT_PRESET
from .progress import attach
from .sources import load, load_tokenizer


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, exit 2
        self.exit(2, f"refimpl: error: {message}\n")


def _mib(n) -> str:
    return "size unknown" if n is None else f"{n / 2**20:.1f} MiB" if n >= 2**20 / 10 else f"{n / 2**10:.1f} KiB"


def cmd_info(args) -> int:
    model = load_model(args, strict=False)   # a tensor of a type that cannot be read is listed, not refused
    cfg, w = model.config, model.weights
    n_params = sum(int(np.prod(a.shape)) for a in w.stored.values())
    print(f"model        {args.model}")
    print(f"architecture {cfg.model_type}  ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size})")
    print(f"attention    {cfg.num_attention_heads} q heads / {cfg.num_key_value_heads} kv heads, head_dim "
          f"{cfg.head_dim}, rotary dim {cfg.rotary_dim}, rope {cfg.rope.get('rope_type')} "
          f"theta {cfg.rope.get('rope_theta'):g}")
    kinds = {k: cfg.layer_types.count(k) for k in dict.fromkeys(cfg.layer_types)}
    print("layers       " + ", ".join(f"{n} {k}" for k, n in kinds.items()))
    if cfg.num_experts:
        print(f"experts      {cfg.num_experts} x {cfg.moe_intermediate_size}, top-{cfg.num_experts_per_tok}, "
              f"renormalised: {cfg.norm_topk_prob}"
              + (f", shared expert {cfg.shared_expert_intermediate_size}"
                 if cfg.shared_expert_intermediate_size else ""))
    print(f"parameters   {n_params:,} ({_mib(w.nbytes())} stored, {_mib(n_params * w.dtype.itemsize)} as "
          f"{w.dtype.name}){', tied embeddings' if cfg.tie_word_embeddings else ''}")
    if str(args.model).lower().endswith(".gguf"):
        g = GGUFFile(args.model)
        print(f"file         {_mib(Path(args.model).stat().st_size)}; tensors by type: " + ", ".join(
            f"{kind} {_mib(size)} ({n})" for kind, n, size in g.storage()))
        for name, t in g.tensors.items():
            if (why := unreadable(t.ggml_type)) is not None:
                print(f"unreadable   tensor {name!r} has {why}")
    if cfg.semantics != "transformers" or cfg.semantic_differences():
        print(f"semantics    {cfg.semantics}" + "".join(f"; {d}" for d in cfg.semantic_differences()))
    p = model.precision
    placed = model.quantisers.describe(model.modules) if model.quantisers else None
    print(f"precision    activations {p.activations}, weights {p.weight_format}"
          + (f" ({p.encodings})" if p.encodings else "") + (f", kv {p.kv}" if p.kv else "")
          + (f", {len(placed['quantisers'])} activation quantisers" if placed and "total" not in placed else "")
          + (f", {placed['placed']} of {placed['total']} device-graph quantisers placed"
             + (f" ({len(placed['unplaced'])} unplaced)" if placed["unplaced"] else "")
             if placed and "total" in placed else ""))
    print(f"weights      {w.residency()}")
    if w.set_aside:
        print(f"note         {len(w.set_aside)} tensors set aside (multi-token prediction / vision), not run")
    if args.verbose:
        for k, v in cfg.to_dict().items():
            print(f"  {k}: {v}")
    return 0


def cmd_run(args) -> int:
    model = load_model(args)
    logits = model.forward(args.input_ids, logits_to_keep=1)[0, -1].astype(np.float64)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    top = np.argsort(-logits, kind="stable")[:args.top]
    print(f"next-token top-{args.top} after {args.input_ids.shape[1]} tokens:")
    for rank, t in enumerate(top, 1):
        print(f"  {rank}. id {int(t):>7}  logit {logits[t]:+10.4f}  p {p[t]:.4f}")
    return 0


def cmd_golden(args) -> int:
    source = args.model or DEFAULT_PRESET
    if args.prompt is not None:
        args.input_ids = np.array([_prompt_ids(load_tokenizer(source), args.prompt)], dtype=np.int64)
    if args.input_ids is None:
        raise InputError("give the prompt as --prompt TEXT or --input-ids 1,2,3")
    if args.pad_id is not None and args.pad_id < 0:
        raise InputError(f"--pad-id must be a token id >= 0, got {args.pad_id}")
    # flag -> option of each convention; a flag the chosen convention does not use is an error, not ignored
    flags = {"genie": {"ar": "ar", "cl": "cl", "decode_ar": "decode_ar", "pad_id": "pad_id", "pad_side": "pad_side",
                       "mask_floor": "mask_floor", "key_layout": "key_transposed", "kv_output": "kv_output",
                       "k_prescale": "k_prescale", "conv_state_len": "conv_state_len"},
             "qeff": {"ar": "seq_len", "cl": "ctx_len", "pad_id": "pad_id"}, "hf": {}}[args.convention]
    params = {}
    for flag in ("ar", "cl", "decode_ar", "pad_id", "pad_side", "mask_floor", "key_layout", "kv_output", "k_prescale",
                 "conv_state_len"):
        value = getattr(args, flag)
        if value is None or value is False:
            continue
        if flag not in flags:
            raise InputError(f"--{flag.replace('_', '-')} does not apply to --convention {args.convention}")
        params[flags[flag]] = value == "transposed" if flag == "key_layout" else value
    decode_ids = None
    if args.follow:
        followed = read_bundle(args.follow, verify=False).manifest
        if followed.get("prompt_ids") != [int(t) for t in args.input_ids[0]]:
            raise InputError(f"--follow {args.follow}: its prompt differs from this one")
        decode_ids = followed.get("generated_ids") or []
        args.decode_steps = args.decode_steps or len(decode_ids)
    model = load_model(args, source)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    # a bar only on a terminal: rich ends even a hidden one with a newline, output that a pipe or file would keep
    with Progress(*columns, transient=True, disable=args.quiet or not sys.stdout.isatty()) as bar, \
            attach(bar):   # forward bars join it
        task = bar.add_task(f"{args.convention} golden: computing {source}", total=None)

        def progress(k, total):
            bar.update(task, description="writing steps", completed=k + 1, total=total)
        path = write_golden(args.out, model, args.input_ids[0], source=source, convention=args.convention,
                            params=params, decode_steps=args.decode_steps, taps=args.taps,
                            exports=tuple(e for e in args.export.split(",") if e), aimet=args.aimet,
                            overwrite=args.overwrite, progress=progress, codes=args.codes, decode_ids=decode_ids)
    quantised = model.quantisers.describe(model.modules)["quantisers"] if model.quantisers else []
    print(f"wrote {path} ({args.convention}, {len(args.input_ids[0])} prompt tokens, "
          f"{args.decode_steps} decode steps, {model.precision.activations} activations"
          + (f", {len(quantised)} activation quantisers" if quantised else "") + ")")
    return 0


def _prompt_ids(tok, text: str, chat: bool = False, system: str | None = None, thinking: bool | None = None) -> list:
    """Prompt text -> ids with the tokenizer; when chat, a user turn (after an optional system turn) through the
    checkpoint's chat template (plain ChatML without one), enable_thinking set when `thinking` is not None."""
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        ids = tok.chat_ids(messages, **({} if thinking is None else {"enable_thinking": thinking}))
    else:
        ids = tok.encode(text)
    if not ids:
        raise InputError("--prompt encodes to no tokens")
    return ids


def cmd_generate(args) -> int:
    source = args.model or DEFAULT_PRESET
    sampling = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")}
    SamplingParams(**{k: v for k, v in sampling.items() if v is not None}).check()  # early: before loading
    if args.input_ids is None and args.prompt is None:
        raise InputError("give the prompt as --prompt TEXT or --input-ids 1,2,3")
    if args.input_ids is not None and (args.chat or args.system):
        raise InputError("--chat and --system apply to --prompt text, not --input-ids")
    if (args.system or args.thinking is not None) and not args.chat:
        flag = "--system" if args.system else "--thinking" if args.thinking else "--no-thinking"
        raise InputError(f"{flag} needs --chat")
    needs_text = args.prompt is not None or args.stop or args.tokenizer
    tok = None          # ids in, ids out: the tokenizer is optional (a checkpoint directory may have none)
    if needs_text or not args.ids:
        try:
            tok = load_tokenizer(args.tokenizer or source)
        except RefimplError:
            if needs_text:
                raise
    ids = _prompt_ids(tok, args.prompt, args.chat, args.system, args.thinking) if args.prompt is not None \
        else args.input_ids[0].tolist()
    model = load_model(args, source)
    eos = ()
    if not args.ignore_eos:
        eos = sorted({*default_eos(model), *(tok.stop_ids() if tok else [])})
    from_checkpoint = {k: v for k, v in checkpoint_sampling(model.generation_config).items() if sampling[k] is None}
    sampling.update(from_checkpoint)
    if model.generation_config and from_checkpoint:
        print("[generation_config.json: " + ", ".join(f"{k} {v}" for k, v in from_checkpoint.items()) + "]",
              file=sys.stderr)
    stream = tok.stream(skip_special_tokens=True) if tok is not None and not args.ids else None

    def show(row, token):
        sys.stdout.write(stream.step(token) if stream is not None else f"{token} ")
        sys.stdout.flush()
    start = time.perf_counter()
    out = generate(model, ids, max_new_tokens=args.max_new_tokens, seed=args.seed, eos_token_id=eos,
                   stop=args.stop or (), tokenizer=tok, callback=show, **sampling)
    seconds = time.perf_counter() - start
    n = len(out.tokens[0])
    sys.stdout.write("\n")
    print(f"[{len(ids)} prompt tokens, {n} generated, stopped by {out.finish_reasons[0]}; {seconds:.2f} s, "
          f"{n / seconds if seconds else 0:.1f} tokens/s]", file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    model = load(args.model)
    tokenizer = None
    if str(args.model).lower().endswith(".gguf") and "tokenizer.ggml.model" in (g := GGUFFile(args.model)).metadata:
        tokenizer = tokenizer_metadata(g)   # re-quantising a GGUF keeps its vocabulary
    path = write_gguf(args.out, model, args.type.upper(), tokenizer=tokenizer)
    print(f"wrote {path} (GGUF {args.type.upper()}, {path.stat().st_size / 2**20:.1f} MiB"
          f"{'' if tokenizer else ', no vocabulary'})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="refimpl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    info = sub.add_parser("info", help="print a model's config and parameter count")
    info.add_argument("model", help="preset name, HF checkpoint directory or .gguf file")
    precision_flags(info)
    info.add_argument("-v", "--verbose", action="store_true", help="print every config field")
    info.set_defaults(func=cmd_info)
    run = sub.add_parser("run", help="one forward pass; print the top next tokens")
    run.add_argument("model", help="preset name, HF checkpoint directory or .gguf file")
    run.add_argument("--input-ids", type=token_ids, required=True, help="comma-separated token ids, e.g. 1,2,3")
    run.add_argument("--top", type=positive, default=5)
    precision_flags(run)
    run.set_defaults(func=cmd_run)

    conv = sub.add_parser("convert", help="write a model as a llama.cpp GGUF file")
    conv.add_argument("model", help="preset name, HF checkpoint directory or .gguf file")
    conv.add_argument("--to", choices=["gguf"], default="gguf")
    conv.add_argument("--out", required=True, help="output .gguf file (written atomically)")
    conv.add_argument("--type", default="f32", type=str.lower, choices=["f32", "f16", "bf16", "q8_0", "q4_0"])
    conv.set_defaults(func=cmd_convert)

    g = sub.add_parser("golden", help="write a golden bundle: every graph call's inputs, outputs and taps")
    g.add_argument("--model", help="preset name, HF checkpoint directory or .gguf file (default: the built-in "
                                   "hybrid preset tiny-qwen3.5)")
    prompt = g.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (encoded with the model's tokenizer)")
    prompt.add_argument("--input-ids", type=token_ids, help="prompt token ids, e.g. 1,2,3")
    g.add_argument("--convention", default="hf", choices=["hf", "genie", "qeff"])
    g.add_argument("--ar", type=positive, help="genie: token slots per call (AR, default 128); qeff: seq_len "
                                                "(default 32)")
    g.add_argument("--cl", type=positive, help="genie: context length (CL, default 4096; a multiple of AR and of the "
                                                "decode AR); qeff: ctx_len (default 128)")
    g.add_argument("--decode-ar", type=positive, help="genie: token slots of the token graph (default 1; at most AR)")
    g.add_argument("--mask-floor", type=finite, help="genie: lower clamp of the additive mask (default -100, AI Hub's "
                                                    "host driver; Genie's fp16 runtime uses -1000, quantised -50)")
    g.add_argument("--pad-id", type=int, help="pad token id (default: eos; qeff: pad, else eos)")
    g.add_argument("--pad-side", choices=["left", "right"],
                   help="genie: left (default; AI Hub's host driver: the pads lead the first prompt chunk) or right "
                        "(the Genie runtime: the pads trail the last chunk)")
    g.add_argument("--conv-state-len", type=positive,
                   help="genie, hybrid models: columns of conv_state_{i} (default Kc, as AI Hub exports it)")
    g.add_argument("--key-layout", choices=["transposed", "plain"],
                   help="genie: past_key as [kvh, 1, D, T] (transposed) or [kvh, 1, T, D]")
    g.add_argument("--kv-output", choices=["new", "window"],
                   help="genie: past_key/value outputs hold the AR new entries or the updated window")
    g.add_argument("--k-prescale", action="store_true", help="genie: scores as q . (k / sqrt(D))")
    g.add_argument("--decode-steps", type=nonnegative, default=0, help="greedy tokens after the prompt")
    g.add_argument("--follow", metavar="BUNDLE", help="decode the tokens that bundle generated (teacher forcing) "
                                                     "instead of greedy ones: an emulated-precision bundle for "
                                                     "three-way judging that stays on the golden's tokens")
    g.add_argument("--taps", type=regex, default=".", help="regex of the trace taps to record per step (default: all "
                                                           "of them; e.g. 'layers\\.0\\.'); see docs/taps.md")
    g.add_argument("--no-taps", dest="taps", action="store_const", const=None, help="record no taps")
    precision_flags(g)
    g.add_argument("--export", default="", help="comma-separated extra exports: safetensors,npz")
    g.add_argument("--aimet", action="store_true", help="also write the AIMET layer-output layout")
    g.add_argument("--codes", action="store_true", help="with --encodings: also write each quantised tap's integer "
                                                         "codes (taps <name>.codes, uint8 / uint16)")
    g.add_argument("--out", required=True, help="bundle directory to create")
    g.add_argument("--overwrite", action="store_true", help="replace an existing bundle directory")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    g.set_defaults(func=cmd_golden)

    gen = sub.add_parser("generate", help="generate text (or ids), streamed to stdout")
    gen.add_argument("--model", help="preset name, HF checkpoint directory or .gguf file (default: tiny-qwen3.5)")
    prompt = gen.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--input-ids", type=token_ids, help="prompt token ids, e.g. 1,2,3")
    gen.add_argument("--chat", action="store_true", help="wrap --prompt as a user turn of the checkpoint's chat "
                                                         "template (plain ChatML without one) and add the assistant "
                                                         "generation prompt")
    gen.add_argument("--system", help="with --chat: a system message first")
    gen.add_argument("--thinking", action=argparse.BooleanOptionalAction,
                     help="with --chat: the template's enable_thinking (default: the template's own default)")
    gen.add_argument("--tokenizer", help="tokenizer source if not the model's: preset, qwen3 | qwen3.5, HF "
                                         "directory or tokenizer.json")
    gen.add_argument("--max-new-tokens", type=nonnegative, default=32)
    gen.add_argument("--temperature", type=finite, help="0: greedy (default: the checkpoint's "
                                                         "generation_config.json, else greedy)")
    gen.add_argument("--top-k", type=nonnegative, help="0: off (default: generation_config.json, else off)")
    gen.add_argument("--top-p", type=finite, help="1: off (default: generation_config.json, else off)")
    gen.add_argument("--min-p", type=finite, help="0: off (default: generation_config.json, else off)")
    gen.add_argument("--repetition-penalty", type=finite, help="1: off (default: generation_config.json, else off)")
    gen.add_argument("--seed", type=nonnegative, default=0)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-turn / eos tokens")
    gen.add_argument("--ids", action="store_true", help="print token ids instead of text")
    precision_flags(gen)
    gen.set_defaults(func=cmd_generate)

    add_diff_commands(sub)
    add_dataset_commands(sub)
    return parser


def _notes_to_stderr() -> None:
    """refimpl's notes (logged warnings: how llama.cpp's semantics change a GGUF's model) as `refimpl: note: ...`."""
    log = logging.getLogger("refimpl")
    if not any(getattr(h, "refimpl_cli", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("refimpl: note: %(message)s"))
        handler.refimpl_cli = True
        log.addHandler(handler)
        log.propagate = False


def _one_line(text) -> str:
    """A message as one line: line breaks (from a file name, a quoted value) shown escaped."""
    return str(text).replace("\r", "\\r").replace("\n", "\\n")


def _warning(message, category, filename, lineno, file=None, line=None):
    print(f"refimpl: warning: {_one_line(message)}", file=sys.stderr)


def main(argv=None) -> int:
    """Run the command line; returns the exit status: 0 done, 1 a diff found a mismatch, 2 bad input (one line
    on stderr, nothing written), 3 an internal error (one line; REFIMPL_TRACEBACK=1 prints the traceback), 130
    interrupted."""
    bad = next((a for a in (sys.argv[1:] if argv is None else argv) if "\0" in str(a)), None)
    if bad is not None:   # only main(argv) can pass one (a shell cannot); no path or name holds it
        print(f"refimpl: error: argument {_one_line(repr(bad)[:80])} holds a NUL character", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    _notes_to_stderr()
    warnings.showwarning = _warning  # one line each, as errors are
    try:
        return args.func(args)
    except RefimplError as e:
        print(f"refimpl: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader of our output went away (e.g. `| head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # an unreadable input or unwritable output the checks above did not name
        print(f"refimpl: error: {_one_line(e.filename or '')}: {e.strerror or e}", file=sys.stderr)
        return 2
    except MemoryError:
        print("refimpl: error: out of memory (a smaller --cl / --ar / prompt, or a machine with more memory)",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("refimpl: interrupted", file=sys.stderr)
        return 130
    except Exception as e:   # noqa: BLE001 - a bug of refimpl's: one line, and how to see where
        if os.environ.get("REFIMPL_TRACEBACK"):
            traceback.print_exc()
        where = traceback.extract_tb(e.__traceback__)[-1]
        print(f"refimpl: internal error: {type(e).__name__} in {where.name} ({Path(where.filename).name}:"
              f"{where.lineno}): {_one_line(str(e))[:300]}; please report it (REFIMPL_TRACEBACK=1 prints the "
              f"traceback)", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
