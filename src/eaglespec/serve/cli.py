"""`eaglespec serve`: arguments, model loading and the uvicorn server."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ..settings import add_engine_args, resolve_models, settings_from_args, smollm2_gguf


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, streaming, vLLM metrics)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model name clients send (default: the target folder's name)")
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
    add_engine_args(p, quantize_effect="responses equal the quantized target's own plain output")
    p.set_defaults(func=cmd_serve)


def build_server(args):
    """(app, DrainingServer) from parsed arguments; tests and benchmarks start it on their own port."""
    import uvicorn

    from ..api import load_engine
    from .app import ServerConfig, create_app
    from .async_engine import AsyncEngine
    from .metrics import ServerMetrics
    from .server import DrainingServer

    settings, _ = settings_from_args(args)
    if settings.threads:
        import torch

        torch.set_num_threads(settings.threads)
    target, drafts = resolve_models(settings.target, settings.draft or ())
    engine = load_engine(target, drafts[0] if drafts else None, max_num_seqs=args.max_num_seqs,
                         **settings.load_kwargs())  # fmt: skip
    print(f"[eaglespec] forwards: {engine.compiled[1]}", file=sys.stderr)
    if getattr(engine.target, "quantization", None) is not None:
        from ..models.quantize import scheme_name

        print(f"[eaglespec] target quantized: {scheme_name(engine.target.quantization)}", file=sys.stderr)
    if engine.tokenizer is None:
        raise ValueError(f"the target {target} has no tokenizer; the server needs one (tokenizer.json)")
    name = args.served_model_name or _served_name(settings.target or smollm2_gguf())
    if engine.drafter is not None and engine.mode == "auto":
        t0 = time.perf_counter()
        print(f"[eaglespec] speculation costs for batch sizes up to {args.max_num_seqs}: cached ones load, missing "
              "ones are measured now (minutes on a small CPU, once per machine, model and precision)",
              file=sys.stderr)  # fmt: skip
        buckets = engine.prepare_policies(args.max_num_seqs)  # cached on disk after the first start
        print(f"[eaglespec] speculation costs ready for batch sizes {buckets} ({time.perf_counter() - t0:.1f} s)",
              file=sys.stderr)  # fmt: skip
    core_engine = AsyncEngine(engine, ServerMetrics(name), max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              kv_budget_tokens=args.kv_budget_tokens, max_queue=args.max_queue)  # fmt: skip
    app = create_app(core_engine, ServerConfig(name, api_key=args.api_key, request_timeout=args.request_timeout))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.graceful_timeout)  # fmt: skip
    server = DrainingServer(config, core_engine)
    dtype, why = engine.precision
    print(f"[eaglespec] serving {name!r} ({'plain' if engine.drafter is None else engine.mode}, {dtype}: {why}) "
          f"on http://{args.host}:{args.port}/v1", file=sys.stderr)  # fmt: skip
    return app, server


def _served_name(target) -> str:
    """The model name clients send by default: a GGUF file's stem, else the folder's name."""
    path = Path(target)
    return path.stem if path.suffix.lower() == ".gguf" else path.resolve().name


def cmd_serve(args) -> int:
    _, server = build_server(args)
    server.run()
    return 0
