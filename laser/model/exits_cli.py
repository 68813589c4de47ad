"""``laser train-exits``: train the early exits of a model (:mod:`laser.model.exits`) on CPU and
save them beside the model cache, where ``--speculative self`` finds them."""

from __future__ import annotations

import sys


def register(subparsers) -> None:
    from ..cli import positive_int

    p = subparsers.add_parser(
        "train-exits", help="train early-exit adapters and a reduced draft head (for --speculative self)",
        description="Distil small exit adapters at a few depths of a frozen model from its final layer, on its "
                    "own greedy continuations of ShareGPT and HumanEval prompts; measure agreement with the full "
                    "model on held-out prompts; save beside the model cache ($LASER_CACHE_DIR/exits or "
                    "~/.cache/laser/exits).")
    p.add_argument("--model", default=None, help="HF checkpoint dir or GGUF file (default: embedded SmolLM2)")
    p.add_argument("--depths", type=positive_int, nargs="+", default=None,
                   help="exit after these many layers (default: every 5th layer)")
    p.add_argument("--prompts", type=positive_int, default=24, help="training prompts (default %(default)s)")
    p.add_argument("--gen-tokens", type=positive_int, default=96,
                   help="greedy tokens generated per prompt (default %(default)s)")
    p.add_argument("--eval-prompts", type=positive_int, default=8, help="held-out prompts (default %(default)s)")
    p.add_argument("--vocab", type=positive_int, default=4096,
                   help="draft vocabulary size, tokens (default %(default)s)")
    p.add_argument("--rank", type=positive_int, default=256, help="adapter hidden size (default %(default)s)")
    p.add_argument("--epochs", type=positive_int, default=12, help="distillation epochs (default %(default)s)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: physical cores)")
    p.add_argument("--output", default=None, help="where to save (default: beside the model cache)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_train_exits)


def cmd_train_exits(args) -> int:
    from ..cli import set_threads
    from ..frontend.engine import Engine
    from .exits import exits_path, format_report, model_key, train_exits

    set_threads(args.threads)
    engine = Engine(args.model, policy="vllm", dtype="float32", latency_calibration=False)
    heads = train_exits(engine, args.depths, num_prompts=args.prompts, gen_tokens=args.gen_tokens,
                        vocab_size=args.vocab, rank=args.rank, epochs=args.epochs, eval_prompts=args.eval_prompts,
                        seed=args.seed)
    out = args.output or exits_path(engine.model_path)
    heads.save(out, model_key(engine.model_path))
    print(format_report(heads.report))
    print(f"saved {out}", file=sys.stderr)
    return 0
