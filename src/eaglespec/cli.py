"""Command line: argument parsing and printing only."""

from __future__ import annotations

import argparse
import json
import sys

from .settings import add_engine_args, resolve_models, settings_from_args


def _add_generate(sub):
    p = sub.add_parser("generate", help="generate text with speculative decoding (or plain with --mode off)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--input", help='JSONL file: {"prompt": str} | {"prompt_ids": [int]} | {"messages": [...]}')
    p.add_argument("--chat", action="store_true", help="render --prompt as a user message with the chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--no-stream", action="store_true", help="do not stream a single prompt's text")
    # speculation flags not given: the settings saved by `eaglespec bench --auto`, else the defaults
    add_engine_args(p, quantize_effect="speculative output equals the quantized target's own")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    from .api import generate, load_engine, parse_inputs, read_jsonl
    from .outputs import TextStream
    from .sampling import SamplingParams
    from .speculation.tuned import describe

    params = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    if args.prompt is None and args.input is None:
        raise ValueError("give --prompt TEXT or --input FILE.jsonl")
    settings, given = settings_from_args(args)
    target, drafts = resolve_models(settings.target, settings.draft or ())
    draft = drafts[0] if drafts else None
    settings, source = settings.with_tuned(given, target, draft)
    _set_threads(settings)
    if args.prompt is not None:
        item = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
        items = [item]
    else:
        items = read_jsonl(args.input)
    engine = load_engine(target, draft, expected_tokens=len(items) * args.max_new_tokens,
                         **settings.load_kwargs())  # fmt: skip
    dtype, why = engine.precision
    print(f"[eaglespec] runtime: {engine.runtime[1]}; drafter: {engine.draft_runtime}", file=sys.stderr)
    print(f"[eaglespec] precision: {dtype} ({why})", file=sys.stderr)
    q = getattr(engine.target, "quantization", None)  # --quantize, or a saved `eaglespec quantize` directory
    if q is not None:
        group = f", groups of {q['group']}" if q["group"] else ""
        how = ("with int8 activations per token (w8a8, exact int32 sums)" if q.get("activations")
               else f"weight-only ({dtype} matmuls)")  # fmt: skip
        print(f"[eaglespec] weights: int{q['bits']} in the decoder layers{group}, {how}", file=sys.stderr)
    print(f"[eaglespec] forwards: {engine.compiled[1]}", file=sys.stderr)
    if engine.drafter is not None:
        shown = {**settings.speculation(), "tree_depth": settings.tree().depth}
        print(f"[eaglespec] settings: {describe(shown)} ({source})", file=sys.stderr)
    prompts = parse_inputs(items, engine.tokenizer, where="--prompt" if args.prompt is not None else args.input)
    stream = len(prompts) == 1 and not args.json and not args.no_stream and engine.tokenizer is not None
    text = TextStream(engine.tokenizer) if stream else None

    def on_tokens(_i, ids):
        sys.stdout.write(text.push(ids))
        sys.stdout.flush()

    if stream and args.prompt is not None and not args.chat:
        sys.stdout.write(args.prompt)
    out = generate(engine, prompts, params, max_new_tokens=args.max_new_tokens, stop_strings=tuple(args.stop),
                   batch_size=args.batch_size, on_tokens=on_tokens if stream else None)  # fmt: skip
    for i, r in enumerate(out.results):
        if args.json:
            obj = {"index": i, "prompt_ids": r.prompt_ids, "output_ids": r.output_ids, "finish_reason": r.finish_reason}
            if r.text is not None:
                obj["text"] = r.text
            obj["stats"] = r.stats.to_dict()
            print(json.dumps(obj))
        elif not stream:
            print(f"--- [{i}] " + (r.text if r.text is not None else " ".join(map(str, r.output_ids))))
    s = out.stats
    mode = engine.mode if engine.drafter is not None else "off"
    summary = (
        f"[eaglespec] mode={mode} prompts={len(prompts)} new_tokens={s.new_tokens} tau={s.tau:.2f} "
        f"tokens/s={s.tokens_per_second:.1f} target_forwards/token={s.target_forwards / max(s.new_tokens, 1):.2f} "
        f"time: prefill {s.time_prefill:.2f}s draft {s.time_draft:.2f}s verify {s.time_verify:.2f}s "
        f"other {s.time_other:.2f}s"
    )
    if stream:
        print()
    print(summary, file=sys.stderr if args.json else sys.stdout)
    if engine.policy is not None:
        where = sys.stderr if args.json else sys.stdout
        print(f"[eaglespec] policy: {_policy_line(engine.policy.summary())}", file=where)
    return 0


def _set_threads(settings) -> None:
    if settings.threads:
        import torch

        torch.set_num_threads(settings.threads)


def _policy_line(summary: dict) -> str:
    parts = [f"speculative steps {summary['speculative_steps']}, plain steps {summary['plain_steps']}"]
    if summary.get("mean_nodes") is not None:
        parts.append(f"mean depth {summary['mean_depth']}, mean nodes {summary['mean_nodes']}")
    if summary.get("width_share"):
        share = ", ".join(f"{'chain' if w == 1 else f'top-{w}'} {v:.0%}" for w, v in summary["width_share"].items())
        parts.append(f"width {share}")
    return "; ".join(parts)


def cmd_toy_models(args) -> int:
    from .toy import make_toy_models

    paths = make_toy_models(args.out, seed=args.seed)
    print(f"wrote toy target to {paths[0]} and EAGLE-3.1 drafter to {paths[1]} (random weights: for plumbing only)")
    return 0


def _add_drift(sub):
    from .drift.command import add_drift_parser

    add_drift_parser(sub)


def _add_serve(sub):
    from .bench.serving import add_parser as add_bench_serving
    from .serve.cli import add_parser

    add_parser(sub)
    add_bench_serving(sub)


def _add_bench(sub):
    from .bench.cli import add_parser

    add_parser(sub)


def cmd_quantize(args) -> int:
    from .models.checkpoint import load_target
    from .models.quantize import quantize_target, save_quantized, scheme_name
    from .models.quantized_linear import DEFAULT_GROUP

    activations = None if args.activations == "none" else args.activations
    folder, _ = resolve_models(args.target)
    target = load_target(folder)
    quantize_target(target, args.bits, DEFAULT_GROUP if args.group is None else args.group, activations)
    out = save_quantized(target, folder, args.out)
    print(f"[eaglespec] wrote {scheme_name(target.quantization)} quantized target to {out}", file=sys.stderr)
    return 0


def _add_export(sub):
    from .export import FORMATS
    from .export.gguf import OUTTYPES

    p = sub.add_parser("export", help="write a drafter for vLLM / SGLang (eagle3), vLLM's speculators layout, or "
                       "llama.cpp (gguf: target + EAGLE-3 drafter), and print the serving commands")  # fmt: skip
    p.add_argument("drafter", help="drafter directory in any layout eaglespec reads (dialect A, speculators, "
                   "EAGLE's pytorch_model.bin)")  # fmt: skip
    p.add_argument("--format", required=True, choices=FORMATS, dest="fmt")
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--target", help="the drafter's target (default: SmolLM2-135M-Instruct), checked "
                   "against the drafter; gives the default aux layer ids, embedding, GGUF tokenizer")  # fmt: skip
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="eagle3/speculators: weight dtype (default: as stored)")
    p.add_argument("--outtype", choices=OUTTYPES, default="f32", help="gguf: weight type (default f32)")
    p.add_argument("--target-gguf", default=None,
                   help="gguf: an existing GGUF of the target (e.g. from llama.cpp's converter): its tokenizer is "
                   "copied into the drafter GGUF and no target GGUF is written")  # fmt: skip
    p.add_argument("--verifier", default=None, help="speculators: the target's name as serving machines know it "
                   "(a Hugging Face id); default: the absolute --target path")  # fmt: skip
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="draft tokens per step for the printed commands and the speculators config (default: "
                   "measured here, chain acceptance and this machine's step costs)")  # fmt: skip
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    from .export import check_format, engine_ignored_keys, export_drafter, open_source
    from .export.commands import serving_commands

    target, _ = resolve_models(args.target)
    k = args.num_speculative_tokens
    if k is not None and k < 1:
        raise ValueError(f"--num-speculative-tokens must be >= 1, got {k}")
    src = open_source(args.drafter, target)  # validates before anything is measured or written
    check_format(src, args.fmt)
    k_cpu = k_gpu = k
    if k is None:
        print("[eaglespec] measuring chain acceptance to choose the speculation length ...", file=sys.stderr)
        c = _measure_chain_length(target, args.drafter)
        k_cpu, k_gpu = c.k_here, c.k_bandwidth
        rounded = lambda xs: [round(x, 2) for x in xs]
        print(f"[eaglespec] chain acceptance per position (depth 8, {c.prompts} prompts): {rounded(c.acceptance)}\n"
              f"[eaglespec] speed vs plain for k = 1..8, this machine's measured costs: {rounded(c.speed_here)} "
              f"-> k={k_cpu} (llama.cpp here)\n[eaglespec] the same when a forward costs its weight bytes "
              f"(drafter/target = {c.drafter_to_target_bytes:.3f}): {rounded(c.speed_bandwidth)} -> k={k_gpu} "
              "(vLLM / SGLang on GPUs)", file=sys.stderr)  # fmt: skip
    files = export_drafter(args.drafter, args.fmt, args.out, target_dir=target, dtype=args.dtype,
                           outtype=args.outtype, target_gguf=args.target_gguf, verifier=args.verifier,
                           speculative_tokens=k_gpu)  # fmt: skip
    print(f"[eaglespec] wrote {src.cfg.eagle_version} drafter ({args.fmt}): " + ", ".join(str(f) for f in files),
          file=sys.stderr)  # fmt: skip
    for note in engine_ignored_keys(src.cfg, args.fmt):
        print(f"[eaglespec] note: {note}", file=sys.stderr)
    k = k_cpu if args.fmt == "gguf" else k_gpu
    for engine, command in serving_commands(args.fmt, files, str(target), k).items():
        print(f"# {engine}\n{command}")
    return 0


def _measure_chain_length(target, drafter_dir, prompts_per_category: int = 2, max_new_tokens: int = 48):
    """Chain acceptance with speculation forced at chain_length.DEPTH on a few prompts of the bundled
    suites (fp32, greedy), turned into the lengths to start other engines with."""
    from .api import generate, load_engine
    from .speculation.chain_length import CATEGORIES, DEPTH, choose_length
    from .stats import SpecStats
    from .suites import load_prompts

    engine = load_engine(target, drafter_dir, mode="chain", chain_k=DEPTH, adaptive=False, dtype="fp32")
    if engine.tokenizer is None:
        raise ValueError(f"{target} has no tokenizer; pass --num-speculative-tokens to skip the measurement")
    prompts, _ = load_prompts(list(CATEGORIES), engine.tokenizer, limit=prompts_per_category,
                              max_new_tokens=max_new_tokens,
                              max_length=engine.target.cfg.max_position_embeddings)  # fmt: skip
    stats = SpecStats()
    flat = [p.ids for ps in prompts.values() for p in ps]
    for ids in flat:
        stats = stats.merge(generate(engine, [ids], max_new_tokens=max_new_tokens).stats)
    return choose_length(engine, stats, DEPTH, len(flat))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglespec", description="EAGLE-3/3.1 speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    p = sub.add_parser("quantize", help="write an int8/int4 (weight-only) or w8a8 quantized copy of a target (loads "
                       "without re-quantizing)")  # fmt: skip
    p.add_argument("--target", required=True, help="HF target directory or .gguf file (Llama, Mistral, Qwen2, Qwen3)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--bits", type=int, choices=[8, 4], required=True)
    p.add_argument("--group", type=int, default=None, help="int4: channels per scale (32/64/128/256; 128)")
    p.add_argument("--activations", choices=["none", "int8"], default="none",
                   help="int8: activations quantized per token at run time (w8a8; with --bits 8)")
    p.set_defaults(func=cmd_quantize)
    p = sub.add_parser("toy-models", help="write a tiny random target + drafter (with a tokenizer) for trying things")
    p.add_argument("out", help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_toy_models)
    from .train.cli import add_parsers as _add_training

    _add_training(sub)
    _add_bench(sub)
    _add_export(sub)
    _add_drift(sub)
    _add_serve(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .models.io import CheckpointError

    try:
        return args.func(args)
    except (ValueError, CheckpointError, OSError) as e:
        print(f"eaglespec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\neaglespec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
