"""`eaglespec bench`: arguments and the command (a report, a sweep, or --auto)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from ..settings import add_engine_args, resolve_models, settings_from_args

MISMATCH_EXIT = 3  # the lossless check failed (report written); 2 = bad input, as for every command


SWEEP_KINDS = ("plain", "auto", "chain", "tree")  # our engine methods; peers are not swept


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark plain / chain / tree decoding per drafter against transformers peers on the prompt suites",
        description="Measure methods side by side on the same prompts; check greedy outputs are identical. "
        f"Exit code {MISMATCH_EXIT} when a lossless method's output differs (the report is still written).",
    )
    p.add_argument("--categories", help="comma-separated suites (default: all; sweeps: chat,code)")
    p.add_argument("--limit", help="first N prompts per category, or 'all' (default: 4; sweeps 2; context 1)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--methods", help="plain,auto,chain,tree,hf_generate,hf_assisted,prompt_lookup (default: all); "
                   "also llamacpp_plain,llamacpp_eagle3 (after scripts/llamacpp/build.sh)")
    p.add_argument("--batch-size", type=int, default=1, help="our methods' batch size (peers run at 1)")
    p.add_argument("--out", default="runs/bench", help="output folder for JSON, Markdown and PNG files")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the lossless check needs 0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep", choices=["batch", "context", "tree"], help="sweep batch size, context length or shape")
    p.add_argument("--sweep-values", help="batch sizes or context lengths, comma-separated (default: 1..64 / 512..32K)")
    p.add_argument("--grid", help="shape grid for --sweep tree/--auto, e.g. 'depth=2,4;topk=2,4;tokens=8,16;chain=2,4'")
    p.add_argument("--synthetic-acceptance", metavar="P1,P2,...",
                   help="cost benchmark: chain/tree accept by this per-position profile (share of drafts "
                   "with >= i accepted tokens, non-increasing, in [0, 1]) instead of by the target; "
                   "their rows are not lossless")  # fmt: skip
    p.add_argument("--shape", help="built-in random-weight target + drafter instead of --target/--draft: "
                   "qwen2-365m or llama-3.2-1b (bench/shapes.py; random token-id prompts)")  # fmt: skip
    p.add_argument("--prompt-len", type=int, default=128, help="--shape: tokens per random prompt (default 128)")
    p.add_argument("--auto", action="store_true",
                   help="quick shape sweep; save the best per drafter for `eaglespec generate` "
                   "(see speculation/tuned.py)")
    # the engine's flags, as generate and serve have them (--methods names the modes to measure)
    add_engine_args(p, several_drafts=True, with_mode=False,
                    quantize_effect="transformers peers run it unquantized, llama.cpp on q8_0 (int8, w8a8) or "
                    "q4_0 (int4)")  # fmt: skip
    p.set_defaults(func=cmd_bench)


def parse_profile(text: str | None) -> list[float] | None:
    """'0.9,0.8' -> [0.9, 0.8], checked by speculation/synthetic.check_profile; None when not given."""
    if text is None:
        return None
    from ..speculation.synthetic import check_profile

    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--synthetic-acceptance takes comma-separated numbers, got {text!r}") from None
    return check_profile(values)


def check_shape_args(args, kinds: list[str], profile) -> list[str]:
    """Errors for combinations the shape/synthetic modes do not support; the methods a --shape run measures."""
    from .engine_methods import OUR_KINDS

    if (args.shape or profile) and (args.sweep or args.auto):
        raise ValueError("--shape and --synthetic-acceptance make a plain report; they cannot be used with "
                         "--sweep or --auto (--auto would save settings tuned on fake acceptance)")  # fmt: skip
    if not args.shape:
        return kinds
    if args.target or args.draft or args.drafts:
        raise ValueError("--shape replaces --target/--draft/--drafts; give one or the other")
    if args.prompt_len < 1:
        raise ValueError(f"--prompt-len must be >= 1, got {args.prompt_len}")
    if args.methods is None:
        return ["plain", "chain", "tree"]
    other = [k for k in kinds if k not in OUR_KINDS and k != "llamacpp_plain"]
    if other:
        raise ValueError(f"--shape runs random token ids without a tokenizer: peers {other} cannot run on it; "
                         "use --methods plain,chain,tree,llamacpp_plain")  # fmt: skip
    return kinds if "plain" in kinds else ["plain", *kinds]  # plain is the baseline of every speedup


def parse_limit(text: str | None, default: int | None) -> int | None:
    if text is None:
        return default
    if text == "all":
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--limit must be a positive integer or 'all', got {text!r}")
    return int(text)


def cmd_bench(args) -> int:
    from ..sampling import SamplingParams
    from ..speculation.config import TreeShape
    from ..suites import load_prompts, parse_categories
    from . import report as rep
    from .engine_methods import OUR_KINDS, compile_models, load_models, use_synthetic_acceptance
    from .hardware import bandwidth_reference
    from .methods import build_methods, parse_kinds
    from .metrics import add_bandwidth_share
    from .runner import RunConfig, describe_mismatches, run_bench

    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise ValueError("--batch-size and --max-new-tokens must be >= 1")
    settings, _ = settings_from_args(args)
    if settings.threads is not None:
        if settings.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {settings.threads}")
        import torch

        torch.set_num_threads(settings.threads)
    if args.auto and args.sweep not in (None, "tree"):
        raise ValueError("--auto runs a shape sweep; it cannot be combined with --sweep batch/context")
    sweep = "tree" if args.auto else args.sweep
    params = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    profile = parse_profile(args.synthetic_acceptance)
    kinds = check_shape_args(args, parse_kinds(args.methods), profile)
    log = lambda msg: print(msg, file=sys.stderr)
    if args.shape:
        from .shapes import ensure_shape

        target, drafts = ensure_shape(args.shape, log=log)
        drafts = [drafts]
    else:
        target, drafts = resolve_models(settings.target, settings.draft or (), every_default=True)
    if args.methods is None and not drafts:
        kinds = [k for k in kinds if k not in ("chain", "tree")]
        print("[bench] no drafter: measuring plain decoding and the peers only", file=sys.stderr)
    tree = TreeShape(settings.tree_depth or TreeShape.depth, settings.tree_topk, settings.tree_tokens)
    categories = parse_categories(args.categories or ("chat,code" if sweep in ("batch", "tree") else None))
    rows = args.batch_size
    if sweep == "batch":
        from . import sweeps

        rows = max(sweeps.parse_values(args.sweep_values, sweeps.BATCH_SIZES, "batch"))
    models = load_models(target, drafts, settings.dtype, settings.quantize, settings.quantize_group,
                         settings.draft_window, runtime=settings.runtime, max_num_seqs=rows,
                         draft_runtime=settings.draft_runtime)  # fmt: skip
    models.draft_prefill_window = settings.draft_prefill_window
    per_run = (parse_limit(args.limit, 4) or 4) * len(categories) * args.max_new_tokens * args.batch_size
    _, why = compile_models(models, settings.compile, per_run * max(1, len([k for k in kinds if k in OUR_KINDS])))
    log(f"[bench] forwards: {why}")
    cfg = RunConfig(args.max_new_tokens, args.batch_size, params)
    out = Path(args.out)
    from_shell = sys.argv[0].endswith("eaglespec")
    command = "eaglespec " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if from_shell else None
    max_len = models.target.cfg.max_position_embeddings

    if sweep is None:
        if args.shape:
            from .shapes import describe, random_prompts

            if args.prompt_len + args.max_new_tokens > max_len:
                raise ValueError(f"--prompt-len + --max-new-tokens exceeds the {args.shape} context {max_len}")
            count = parse_limit(args.limit, 4) or 4
            prompts, skipped = random_prompts(models.target.cfg.vocab_size, count, args.prompt_len, args.seed), []
        else:
            prompts, skipped = load_prompts(categories, models.tokenizer, limit=parse_limit(args.limit, 4),
                                            max_new_tokens=args.max_new_tokens, max_length=max_len)  # fmt: skip
        source = None
        if args.shape and "llamacpp_plain" in kinds:
            from .shapes import gguf_source

            source = gguf_source(args.shape, target)
        methods = build_methods(kinds, models, tree=tree, chain_k=settings.chain_k, adaptive=settings.adaptive,
                                gguf_source=source)  # fmt: skip
        if profile:
            use_synthetic_acceptance(methods, profile)
        memory = bandwidth_reference()  # measured once per machine and thread count, then cached
        report = run_bench(methods, prompts, cfg, log)
        add_bandwidth_share(report["results"], memory["read_gb_s"])
        report.update(target=str(target), drafts=[str(d) for d in drafts], skipped=skipped, command=command,
                      memory_bandwidth=memory, synthetic_acceptance=profile, forwards=models.compiled,
                      shape=describe(args.shape) if args.shape else None)  # fmt: skip
        files = rep.write_bench(report, out)
        print(rep.bench_markdown(report))
        print(f"[bench] wrote {', '.join(str(f) for f in files)}", file=sys.stderr)
        check = report["lossless_check"]
        if check["applicable"] and not check["passed"]:
            for line in describe_mismatches(check):
                print(line, file=sys.stderr)
            return MISMATCH_EXIT
        return 0
    return run_sweep(args, settings, sweep, models, kinds, categories, cfg, tree, out, command, log)


def run_sweep(args, settings, sweep, models, kinds, categories, cfg, tree, out, command, log) -> int:
    from ..speculation.tuned import describe, save_tuned
    from ..suites import context_prompts, load_prompts
    from . import report as rep
    from . import sweeps
    from .engine_methods import engine_methods

    max_len = models.target.cfg.max_position_embeddings
    if sweep == "context":
        lengths = sweeps.parse_values(args.sweep_values, sweeps.CONTEXTS, "context")
        # a length at the context's end leaves room for the reply: 32K on a 32,768-token target is 32,704 + 64
        room = max_len - args.max_new_tokens
        fits = sorted({min(n, room) for n in lengths if n > 0 and room > 0})
        by_length = context_prompts(models.tokenizer, fits, parse_limit(args.limit, 1) or 2)  # all: both texts
        methods = engine_methods(models, [k for k in kinds if k in SWEEP_KINDS], tree=tree,
                                 chain_k=settings.chain_k, adaptive=settings.adaptive)  # fmt: skip
        decode = lambda ids: models.tokenizer.decode(ids, skip_special_tokens=True)
        result = sweeps.sweep_context(methods, by_length, cfg, log, decode)
    else:
        prompts, _ = load_prompts(categories, models.tokenizer, limit=parse_limit(args.limit, 2),
                                  max_new_tokens=args.max_new_tokens, max_length=max_len)  # fmt: skip
        pool = [p for items in prompts.values() for p in items]
        if sweep == "batch":
            sizes = sweeps.parse_values(args.sweep_values, sweeps.BATCH_SIZES, "batch")
            methods = engine_methods(models, [k for k in kinds if k in SWEEP_KINDS], tree=tree,
                                     chain_k=settings.chain_k, adaptive=settings.adaptive)  # fmt: skip
            result = sweeps.sweep_batch(methods, pool, cfg, sizes, log)
        else:
            grid = sweeps.parse_grid(args.grid, sweeps.QUICK_GRID if args.auto else sweeps.FULL_GRID)
            result = sweeps.sweep_tree(models, pool, cfg, grid, log)
    result.update(target=str(models.target_dir), command=command, forwards=models.compiled, config={
        "max_new_tokens": cfg.max_new_tokens, "batch_size": cfg.batch_size, "temperature": cfg.params.temperature})
    files = rep.write_sweep(result, out)
    print(rep.sweep_markdown(result))
    print(f"[bench] wrote {', '.join(str(f) for f in files)}", file=sys.stderr)
    if args.auto:
        for label, best in result["best"].items():
            path = save_tuned(models.target_dir, best["drafter_path"], best["settings"],
                              {**{k: best[k] for k in ("tokens_per_s", "tau", "speedup")},
                               "batch_size": cfg.batch_size, "max_new_tokens": cfg.max_new_tokens})  # fmt: skip
            note = "" if (best["speedup"] or 0) >= 1 else " (slower than plain here: generate's governor falls back)"
            print(f"[bench] --auto: {label}: saved {describe(best['settings'])} to {path}{note}")
    return 0
