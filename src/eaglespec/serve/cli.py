"""`eaglespec serve`: arguments, model loading and the uvicorn server."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ..cli_options import add_quantize_args
from ..machine import COMPILE_HELP


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, streaming, vLLM metrics)")
    p.add_argument("--target", help="HF target model directory (default: the bundled target)")
    p.add_argument("--draft", help="EAGLE-3/3.1 drafter directory (default: bundled; plain decoding with --mode off)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model name clients send (default: the target folder's name)")
    p.add_argument("--mode", "--speculation", dest="mode", choices=["auto", "tree", "chain", "off"], default="auto")
    p.add_argument("--no-adaptive", action="store_true",
                   help="always speculate (default: plain steps while speculation measures slower)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--compile", default="off", choices=["auto", "on", "off"],
                   help=COMPILE_HELP)
    p.add_argument("--draft-prefill-window", type=int, default=None, metavar="N",
                   help="prompt tokens the drafter reads at prefill, the last N (default 128; 0: the whole prompt)")
    p.add_argument("--draft-window", type=int, default=None, metavar="N",
                   help="sliding window of the drafter's own attention (default: the drafter's "
                        "draft_attention_window, if it was trained with one; 0: none)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="most requests decoding at once (default 8)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="prompt tokens prefilled per step, shared by the prefilling requests (default 512)")
    p.add_argument("--kv-budget-tokens", type=int, default=None,
                   help="KV cache positions over all running requests (default: max-num-seqs x context)")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests beyond which new ones get 429")
    p.add_argument("--request-timeout", type=float, default=None, help="seconds per request before it is aborted")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds to let running requests finish on shutdown (SIGINT/SIGTERM)")
    p.add_argument("--threads", type=int, help="torch threads (default: one per core)")
    add_quantize_args(p, "responses equal the quantized target's own plain output")
    p.set_defaults(func=cmd_serve)


def build_server(args):
    """(app, uvicorn config) from parsed arguments; tests and benchmarks start it on their own port."""
    import uvicorn

    from ..api import load_engine
    from ..cli import _resolve_models
    from .app import ServerConfig, create_app
    from .async_engine import AsyncEngine
    from .metrics import ServerMetrics

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    target, draft = _resolve_models(args)
    engine = load_engine(target, draft if args.mode != "off" else None, mode=args.mode, device=args.device,
                         dtype=args.dtype, adaptive=not args.no_adaptive,
                         draft_prefill_window=args.draft_prefill_window, draft_window=args.draft_window,
                         compile=args.compile, quantize=args.quantize, quantize_group=args.quantize_group)  # fmt: skip
    print(f"[eaglespec] forwards: {engine.compiled[1]}", file=sys.stderr)
    if getattr(engine.target, "quantization", None) is not None:
        from ..models.quantize import scheme_name

        print(f"[eaglespec] target quantized: {scheme_name(engine.target.quantization)}", file=sys.stderr)
    if engine.tokenizer is None:
        raise ValueError(f"the target {target} has no tokenizer; the server needs one (tokenizer.json)")
    name = args.served_model_name or Path(target).resolve().name
    if engine.drafter is not None and engine.mode == "auto":
        t0 = time.perf_counter()
        buckets = engine.prepare_policies(args.max_num_seqs)  # cached on disk after the first start
        print(f"[eaglespec] speculation costs ready for batch sizes {buckets} ({time.perf_counter() - t0:.1f} s)",
              file=sys.stderr)  # fmt: skip
    core_engine = AsyncEngine(engine, ServerMetrics(name), max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              kv_budget_tokens=args.kv_budget_tokens, max_queue=args.max_queue)  # fmt: skip
    app = create_app(core_engine, ServerConfig(name, api_key=args.api_key, request_timeout=args.request_timeout))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.graceful_timeout)  # fmt: skip
    dtype, why = engine.precision
    print(f"[eaglespec] serving {name!r} ({'plain' if engine.drafter is None else engine.mode}, {dtype}: {why}) "
          f"on http://{args.host}:{args.port}/v1", file=sys.stderr)  # fmt: skip
    return app, config


def cmd_serve(args) -> int:
    import uvicorn

    _, config = build_server(args)
    uvicorn.Server(config).run()
    return 0
