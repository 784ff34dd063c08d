"""`eaglespec drift`: attention-drift diagnostics for one or more drafters on the same prompts."""

from __future__ import annotations

from pathlib import Path


def add_drift_parser(sub) -> None:
    p = sub.add_parser("drift", help="attention-drift diagnostics: attention, state RMS and acceptance per draft depth")
    p.add_argument("--target", help="HF target model directory (default: the bundled default target)")
    p.add_argument("--draft", action="append", default=[],
                   help="drafter directory; repeat to compare (default: the bundled EAGLE-3.1 and EAGLE-3 drafters)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (default: a few chat and code prompts)")
    src.add_argument("--input", help='JSONL file: {"prompt": str} | {"prompt_ids": [int]} | {"messages": [...]}')
    p.add_argument("--chat", action="store_true", help="render --prompt as a user message with the chat template")
    p.add_argument("--depth", type=int, default=8, help="draft chain length D")
    p.add_argument("--sink-tokens", type=int, default=4, help="the first S context tokens count as attention sinks")
    p.add_argument("--positions", type=int, default=16,
                   help="chains per prompt: one rooted at each of the target's first N generated tokens")
    p.add_argument("--out", default="runs/drift", help="output folder for drift.json, verdict.txt, table.md, plots")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_drift)


def resolve_paths(target: str | None, drafts: list[str]) -> tuple[Path, list[Path]]:
    """Like `generate`: the default target and every drafter bundled for it unless given."""
    from ..settings import resolve_models

    return resolve_models(target, drafts, every_default=True, need_drafter=True)


def drafter_name(path: Path) -> str:
    """The folder name, with its run folder for a training run's `final/` or `checkpoints/step-N/`."""
    if path.name == "final":
        return f"{path.resolve().parent.name}/final"
    if path.name.startswith("step-"):
        return f"{path.resolve().parent.parent.name}/{path.name}"
    return path.name


def prompt_items(args, tokenizer) -> tuple[list[dict], str]:
    """The prompts as `generate` input items, and where they come from (for error messages)."""
    from ..api import read_jsonl
    from .measure import DEFAULT_PROMPTS

    if args.prompt is not None:
        item = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
        return [item], "--prompt"
    if args.input is not None:
        return read_jsonl(args.input), args.input
    items = DEFAULT_PROMPTS
    if tokenizer is not None and not getattr(tokenizer, "chat_template", None):  # no template: chat turns as text
        items = [{"prompt": x["messages"][-1]["content"]} if "messages" in x else x for x in items]
    return items, "the default prompt set"


def cmd_drift(args) -> int:
    from ..api import load_engine, parse_inputs
    from ..models.checkpoint import load_drafter
    from .measure import DepthProfile, greedy_sequences, measure_drafter
    from .report import write_report

    for name in ("depth", "sink_tokens", "positions"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    target_dir, draft_dirs = resolve_paths(args.target, args.draft)
    engine = load_engine(target_dir, None, mode="off", device=args.device)
    drafters = [load_drafter(d, target=engine.target, device=args.device) for d in draft_dirs]
    items, where = prompt_items(args, engine.tokenizer)
    prompts = parse_inputs(items, engine.tokenizer, where=where)
    sequences = greedy_sequences(engine, prompts, args.positions + args.depth)
    prompt_lens = [len(p) for p in prompts]
    profiles = []
    for path, drafter in zip(draft_dirs, drafters):
        record = measure_drafter(engine.target, drafter, sequences, prompt_lens, depth=args.depth,
                                 sink_tokens=args.sink_tokens, positions=args.positions)  # fmt: skip
        label = f"{drafter.cfg.eagle_version} ({drafter_name(path)})"
        profiles.append(DepthProfile.from_record(label, str(path), drafter, record))
    settings = {
        "target": str(target_dir), "drafters": [str(d) for d in draft_dirs], "prompts": len(prompts),
        "prompt_source": where, "depth": args.depth, "sink_tokens": args.sink_tokens, "positions": args.positions,
        "device": args.device,
    }  # fmt: skip
    print(write_report(profiles, args.out, settings), end="")
    print(f"[eaglespec] wrote drift.json, verdict.txt, table.md and plots to {args.out}")
    return 0
