"""refimpl command line: `refimpl info MODEL`, `refimpl run MODEL --input-ids 1,2,3`.

Bad arguments and bad files print one line, `refimpl: error: ...`, and exit with status 2.
"""

import argparse
import sys

import numpy as np

from .errors import RefimplError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, exit 2
        self.exit(2, f"refimpl: error: {message}\n")


def _ids(text: str) -> np.ndarray:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--input-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--input-ids is empty")
    return np.array([ids], dtype=np.int64)


def cmd_info(args) -> int:
    from . import load
    model = load(args.model, dtype=args.dtype)
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
              + (f", shared expert {cfg.shared_expert_intermediate_size}" if cfg.shared_expert_intermediate_size else ""))
    print(f"parameters   {n_params:,} ({w.nbytes() / 2**20:.1f} MiB stored)"
          f"{', tied embeddings' if cfg.tie_word_embeddings else ''}")
    if w.set_aside:
        print(f"note         {len(w.set_aside)} tensors set aside (multi-token prediction / vision), not run")
    if args.verbose:
        for k, v in cfg.to_dict().items():
            print(f"  {k}: {v}")
    return 0


def cmd_run(args) -> int:
    from . import load
    model = load(args.model, dtype=args.dtype)
    logits = model.forward(args.input_ids, logits_to_keep=1)[0, -1].astype(np.float64)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    top = np.argsort(-logits, kind="stable")[:args.top]
    print(f"next-token top-{args.top} after {args.input_ids.shape[1]} tokens:")
    for rank, t in enumerate(top, 1):
        print(f"  {rank}. id {int(t):>7}  logit {logits[t]:+10.4f}  p {p[t]:.4f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="refimpl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    info = sub.add_parser("info", help="print a model's config and parameter count")
    info.add_argument("model", help="preset name, HF checkpoint directory or .gguf file")
    info.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    info.add_argument("-v", "--verbose", action="store_true", help="print every config field")
    info.set_defaults(func=cmd_info)
    run = sub.add_parser("run", help="one forward pass; print the top next tokens")
    run.add_argument("model", help="preset name, HF checkpoint directory or .gguf file")
    run.add_argument("--input-ids", type=_ids, required=True, help="comma-separated token ids, e.g. 1,2,3")
    run.add_argument("--top", type=int, default=5)
    run.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    run.set_defaults(func=cmd_run)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RefimplError as e:
        print(f"refimpl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("refimpl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
