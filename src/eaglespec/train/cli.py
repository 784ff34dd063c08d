"""Command line for the training pipeline: `eaglespec data regen|vocab|states` and `eaglespec train`."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

from ..settings import add_quantize_args


def add_parsers(sub) -> None:
    data = sub.add_parser("data", help="prepare drafter training data (regen, vocab, states)")
    dsub = data.add_subparsers(dest="data_command", required=True)

    p = dsub.add_parser("regen", help="regenerate assistant replies with the target -> token ids + loss masks")
    p.add_argument("--target", help="target folder or .gguf with a tokenizer (default: SmolLM2-135M-Instruct)")
    p.add_argument("--input", required=True, help='JSONL: {"messages": [...]} | {"prompt": str} | {"text": str}')
    p.add_argument("--out", required=True, help="output data directory (resumes when it exists)")
    p.add_argument("--draft", help="optional drafter to speed up generation (output is unchanged)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-len", type=int, default=2048, help="longest stored sample in tokens")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--shard-size", type=int, default=256, help="input lines per shard (unit of resume)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N input lines")
    p.add_argument("--part", default=None, metavar="I/N", help="machine I of N sharing --out: only shards I, "
                   "I+N, ... (run every part, e.g. one per machine, on a shared filesystem)")  # fmt: skip
    add_quantize_args(p, "the replies are the quantized target's", default=None)
    p.set_defaults(func=cmd_regen)

    p = dsub.add_parser("vocab", help="choose the draft vocabulary (d2t/t2d) and report its coverage")
    p.add_argument("--data", required=True, help="data directory from `data regen`")
    p.add_argument("--target", help="target model directory (default: SmolLM2-135M-Instruct, the default target)")
    p.add_argument("--size", type=int, required=True, help="draft vocabulary size Vd")
    p.add_argument("--out", required=True, help="directory for vocab.safetensors + vocab_report.json")
    p.set_defaults(func=cmd_vocab)

    p = dsub.add_parser("states", help="cache target aux states + top-k probabilities for offline training")
    p.add_argument("--data", required=True)
    p.add_argument("--target", help="target model directory (default: SmolLM2-135M-Instruct, the default target)")
    p.add_argument("--out", required=True)
    p.add_argument("--topk", type=int, default=32)
    p.add_argument("--part", default=None, metavar="I/N", help="machine I of N sharing --out: only shards I, I+N, ...")
    p.add_argument("--batch-size", type=int, default=8)
    add_quantize_args(p, "the cached states are the quantized target's", default=None)
    p.set_defaults(func=cmd_states)

    p = sub.add_parser("train", help="train an EAGLE-3.1 / EAGLE-3 drafter with training-time test")
    p.add_argument("--target", help="target model directory (default: SmolLM2-135M-Instruct, the default target)")
    p.add_argument("--data", required=True, help="data directory from `data regen`")
    p.add_argument("--out", required=True, help="run directory (checkpoints, final/, metrics, plots)")
    p.add_argument("--states", help="offline features from `data states` (default: online target forward)")
    p.add_argument("--vocab", help="draft vocabulary from `data vocab` (default: computed from --data)")
    p.add_argument("--draft-vocab-size", type=int)
    p.add_argument("--fc-norm", action=argparse.BooleanOptionalAction, default=True, help="EAGLE-3.1 input norms")
    p.add_argument("--norm-output", action=argparse.BooleanOptionalAction, default=True,
                   help="EAGLE-3.1 post-norm recurrent state (both off = EAGLE-3)")  # fmt: skip
    for name, typ in (("depth", int), ("decay", float), ("lr", float), ("min-lr-frac", float), ("warmup-steps", int),
                      ("weight-decay", float), ("grad-clip", float), ("epochs", float), ("steps", int),
                      ("stop-after", int), ("batch-size", int), ("micro-batch", int), ("max-len", int),
                      ("seed", int), ("save-every", int), ("keep-checkpoints", int), ("eval-every", int),
                      ("val-fraction", float), ("eval-samples", int), ("eval-prompts", int),
                      ("eval-max-new-tokens", int), ("eval-chain-k", int), ("log-every", int), ("threads", int),
                      ("intermediate-size", int), ("draft-window", int), ("draft-context", int)):  # fmt: skip
        p.add_argument(f"--{name}", type=typ, default=None)
    p.add_argument("--init-from", help="warm start from this drafter directory (keeps its draft vocabulary)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None)
    p.add_argument("--save-dtype", choices=["fp32", "bf16", "fp16"], default=None)
    p.add_argument("--eval-mode", choices=["chain", "tree"], default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--resume", action="store_true", help="continue the newest checkpoint in --out")
    p.add_argument("--no-progress", action="store_true")
    add_quantize_args(p, "the drafter learns the quantized target's states and outputs (fine-tune one for a "
                         "quantized target with --init-from)", default=None)  # fmt: skip
    p.set_defaults(func=cmd_train)


def _default_target(args) -> None:
    from ..settings import resolve_models

    args.target = str(resolve_models(args.target)[0])


def cmd_regen(args) -> int:
    from .regen import regen
    from .shards import parse_part

    _default_target(args)

    stats = regen(args.input, args.out, target=args.target, draft=args.draft, temperature=args.temperature,
                  top_p=args.top_p, seed=args.seed, max_new_tokens=args.max_new_tokens, max_len=args.max_len,
                  batch_size=args.batch_size, shard_size=args.shard_size, limit=args.limit,
                  part=parse_part(args.part), quantize=args.quantize, quantize_group=args.quantize_group)  # fmt: skip
    print(f"[eaglespec data regen] {json.dumps(stats)} -> {args.out}")
    return 0


def cmd_vocab(args) -> int:
    _default_target(args)
    from ..models.io import read_config
    from .regen import target_fingerprint
    from .shards import load_samples
    from .vocab import choose_draft_vocab, coverage_report, save_vocab, token_counts

    vocab_size = int(read_config(args.target)["vocab_size"])
    samples = load_samples(args.data, target_fingerprint=target_fingerprint(args.target))
    counts = token_counts(samples, vocab_size)
    used = choose_draft_vocab(counts, args.size)
    report = coverage_report(counts, used)
    save_vocab(args.out, used, vocab_size, report)
    print(f"[eaglespec data vocab] draft vocabulary {args.size} of {vocab_size}: covers {report['coverage']:.2%} of "
          f"{report['assistant_tokens']} assistant tokens; {report['tokens_outside']} tokens "
          f"({report['distinct_outside']} distinct ids) fall outside and are masked in training -> {args.out}")
    return 0


def cmd_states(args) -> int:
    _default_target(args)
    from .shards import parse_part
    from .states import build_states

    res = build_states(args.data, args.out, target=args.target, topk=args.topk, batch_size=args.batch_size,
                       part=parse_part(args.part), quantize=args.quantize, quantize_group=args.quantize_group)
    mib = res["bytes"] / 2**20
    print(f"[eaglespec data states] {res['shards_written']} shard(s), about {mib:.1f} MiB -> {args.out}")
    return 0


def cmd_train(args) -> int:
    _default_target(args)
    from .config import TrainConfig
    from .trainer import Trainer

    names = {f.name for f in fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
    cfg = TrainConfig(**given)
    trainer = Trainer(cfg, progress=not args.no_progress)
    res = trainer.train()
    if trainer.rank == 0:
        print(f"[eaglespec train] {json.dumps(res)}")
    return 0
