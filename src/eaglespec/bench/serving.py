"""`eaglespec bench-serving`: load an OpenAI-compatible server at several concurrency levels.

Each system (eaglespec with and without speculation, llama-server plain and EAGLE-3 when built) runs
as its own child process on a free port, with the same model, prompts (the bench suites) and thread
count; clients stream /v1/completions greedily with `concurrency` requests in flight at all times.
Per request: TTFT (first text), TPOT ((end - TTFT) / (tokens - 1)), end-to-end latency; per level:
output tokens/s over the makespan and errors. A warm-up round at each level comes first (it also
lets our policy calibrate for that batch size), outside the measurement.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ..machine import cpu_steal_counters, steal_share
from ..suites import load_suite
from .report import fmt, table, write_json

# a server's first start on a machine measures its step costs per batch bucket (7+ minutes for 128 on 2 cores);
# startup is not timed, so waiting long costs nothing
STARTUP_TIMEOUT_S = 1800


def add_parser(sub) -> None:
    p = sub.add_parser("bench-serving", help="serving benchmark: eaglespec serve (spec / plain) vs llama-server")
    p.add_argument("--target", help="HF target model directory (default: SmolLM2-135M-Instruct, the default target)")
    p.add_argument("--draft", help="drafter for our speculative server (default: bundled EAGLE-3.1)")
    p.add_argument("--llamacpp-draft", help="EAGLE-3 drafter for llama-server (default: bundled EAGLE-3)")
    p.add_argument("--systems", default="eaglespec_spec,eaglespec_plain,llamacpp_plain,llamacpp_eagle3")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--requests-per-level", type=int, default=2, help="requests per level = this x concurrency "
                   "(at least 8)")
    p.add_argument("--repeats", type=int, default=1, help="measure each level this many times, the systems in "
                   "alternating order (the ratio table gives each repeat and the median)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--categories", default="chat,code,docs_qa,summarization")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="fp32", help="our dtype (auto, fp32, bf16); llama.cpp uses the same")
    p.add_argument("--out", default="runs/bench-serving")
    p.set_defaults(func=cmd_bench_serving)


# -- the load generator ----------------------------------------------------------------------------
async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    first, chunks, usage, spec = None, 0, None, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    return {"error": str(data["error"])[:200]}
                if data.get("usage"):
                    usage, spec = data["usage"], data.get("spec_decode")
                for c in data.get("choices") or []:
                    if c.get("text"):
                        chunks += 1
                        first = first or time.perf_counter()
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else chunks
    first = first or end
    return {"ttft": first - t0, "e2e": end - t0, "tokens": tokens,
            "tpot": (end - first) / (tokens - 1) if tokens > 1 else None, "spec": spec}  # fmt: skip


async def run_level(url: str, model: str, prompts: list[str], concurrency: int, n: int, max_tokens: int) -> dict:
    """n requests, `concurrency` in flight at all times; summary of the level."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as client:
        queue = list(range(n))
        results: list[dict] = []

        async def worker():
            while queue:
                i = queue.pop()
                results.append(await _one(client, url, model, prompts[i % len(prompts)], max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        makespan = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    tokens = sum(r["tokens"] for r in ok)
    tpots = [r["tpot"] for r in ok if r["tpot"] is not None]
    drafts = sum((r["spec"] or {}).get("num_drafts", 0) for r in ok)
    accepted = sum((r["spec"] or {}).get("num_accepted_tokens", 0) for r in ok)
    return {"concurrency": concurrency, "requests": n, "errors": len(errors), "error_examples": errors[:3],
            "output_tokens": tokens, "makespan_s": makespan, "output_tok_s": tokens / makespan if makespan else 0,
            "ttft_mean_s": _mean([r["ttft"] for r in ok]), "ttft_p50_s": _median([r["ttft"] for r in ok]),
            "tpot_mean_s": _mean(tpots), "tpot_p50_s": _median(tpots),
            "e2e_mean_s": _mean([r["e2e"] for r in ok]),
            "tau": 1 + accepted / drafts if drafts else None}  # fmt: skip


def _mean(xs):
    return statistics.fmean(xs) if xs else None


def _median(xs):
    return statistics.median(xs) if xs else None


# -- the systems -----------------------------------------------------------------------------------
class ChildServer:
    """A server child process on a free port, ready when GET /health answers 200."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path, env=None):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}: {log.read_text()[-1500:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"{name} not ready after {STARTUP_TIMEOUT_S}s: {log.read_text()[-1500:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _start(system: str, args, target: Path, out: Path, max_conc: int) -> ChildServer | None:
    from .peers.llamacpp import OUTTYPE, SERVER, free_port, llamacpp_root, not_built_reason

    port = free_port()
    log = out / "logs" / f"{system}.log"
    if system.startswith("eaglespec"):
        mode = "auto" if system == "eaglespec_spec" else "off"
        argv = [sys.executable, "-m", "eaglespec.cli", "serve", "--target", str(target), "--port", str(port),
                "--mode", mode, "--dtype", args.dtype, "--max-num-seqs", str(max_conc), "--threads",
                str(args.threads), "--max-queue", str(4 * max_conc), "--served-model-name", "target"]  # fmt: skip
        if mode == "auto":
            argv += ["--draft", str(args.draft)]
        return ChildServer(system, argv, port, log)
    reason = not_built_reason()
    if reason:
        print(f"[bench-serving] skipping {system}: {reason}", file=sys.stderr)
        return None
    from ..export.llamacpp_convert import convert_drafter, convert_target

    root = llamacpp_root()
    kv = OUTTYPE.get(args.dtype if args.dtype != "auto" else "fp32", "f32")
    gguf = convert_target(root, target, kv)
    slots = min(max_conc, 16)  # llama-server's parallel slots; more requests queue inside it
    argv = [str(root / "build" / "bin" / SERVER), "-m", str(gguf), "-t", str(args.threads), "-tb", str(args.threads),
            "-np", str(slots), "-c", str(slots * 1024), "-ctk", kv, "-ctv", kv, "--metrics", "--no-webui",
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    if system == "llamacpp_eagle3":
        draft = convert_drafter(root, args.llamacpp_draft, target, kv)
        argv += ["-md", str(draft), "--spec-type", "draft-eagle3", "--spec-draft-n-max", "4", "--spec-draft-n-min",
                 "0", "-td", str(args.threads), "-tbd", str(args.threads), "-ctkd", kv, "-ctvd", kv]  # fmt: skip
    return ChildServer(system, argv, port, log)


def cmd_bench_serving(args) -> int:
    from ..api import load_tokenizer
    from ..settings import bundled_folder_for, resolve_models, smollm2_gguf
    from ..suites import parse_choices
    from .runner import cpu_name

    systems = parse_choices(args.systems, ("eaglespec_spec", "eaglespec_plain", "llamacpp_plain", "llamacpp_eagle3"),
                            "--systems")  # fmt: skip
    target, drafts = resolve_models(args.target, [args.draft] if args.draft else [],
                                    need_drafter="eaglespec_spec" in systems)  # fmt: skip
    args.draft = drafts[0] if drafts else None
    bundled = bundled_folder_for(args.target or smollm2_gguf())
    if not args.llamacpp_draft and "llamacpp_eagle3" in systems:  # llama.cpp runs EAGLE-3 drafters only
        if bundled is None or not (bundled / "drafter-eagle3" / "config.json").is_file():
            raise ValueError("llamacpp_eagle3 needs --llamacpp-draft DIR (an EAGLE-3 drafter of this target)")
        args.llamacpp_draft = bundled / "drafter-eagle3"
    levels = [int(x) for x in args.concurrency.split(",")]
    if not levels or min(levels) < 1:
        raise ValueError("--concurrency takes positive integers, e.g. 1,4,16,64")
    tok = load_tokenizer(target)
    prompts = [item["prompt"] if "prompt" in item else tok.apply_chat_template(item["messages"], tokenize=False,
               add_generation_prompt=True) for c in args.categories.split(",") for item in load_suite(c)]  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"cpu": cpu_name(), "threads": args.threads, "dtype": args.dtype, "max_tokens": args.max_tokens,
              "target": str(target), "draft": str(args.draft), "prompts": len(prompts),
              "command": "eaglespec " + " ".join(sys.argv[1:]), "systems": {}}  # fmt: skip
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    # level by level, the systems in alternating order, each on a fresh server: on a shared VM the host's load
    # drifts over minutes, and measuring one system's levels after the other's turned that drift into a ratio
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    rounds = [(c, r) for c in levels for r in range(args.repeats)]
    for i, (c, _) in enumerate(rounds):
        for system in systems if i % 2 == 0 else systems[::-1]:
            server = _start(system, args, target, out, max(levels))
            if server is None:
                continue
            try:
                n = max(8, args.requests_per_level * c)
                asyncio.run(run_level(server.url, "target", prompts, c, min(n, 2 * c), args.max_tokens))  # warm-up
                before = cpu_steal_counters()
                row = asyncio.run(run_level(server.url, "target", prompts, c, n, args.max_tokens))
                row["cpu_steal"] = steal_share(before, cpu_steal_counters())
                print(f"[bench-serving] {system} c={c}: {row['output_tok_s']:.0f} tok/s, TTFT "
                      f"{fmt(row['ttft_mean_s'], 3)} s, TPOT {fmt(row['tpot_mean_s'], 4)} s, errors {row['errors']}, "
                      f"CPU steal {fmt(row['cpu_steal'] and 100 * row['cpu_steal'], 0)}%", file=sys.stderr)  # fmt: skip
                report["systems"].setdefault(system, []).append(row)
            finally:
                server.stop()
    write_json(report, out / "serving.json")
    (out / "serving.md").write_text(serving_markdown(report))
    _plot(report, out / "serving.png")
    print(serving_markdown(report))
    return 0


def serving_markdown(report: dict) -> str:
    systems = report["systems"]
    lines = [f"CPU: {report['cpu']}; {report['threads']} threads; dtype {report['dtype']}; greedy, "
             f"{report['max_tokens']} new tokens per request; `{report['command']}`", ""]  # fmt: skip
    rows = []
    for name, levels in systems.items():
        for r in levels:
            ms = [fmt(r[k] and r[k] * 1e3, d) for k, d in (("ttft_mean_s", 1), ("tpot_mean_s", 2))]
            steal = r.get("cpu_steal")
            rows.append([name, str(r["concurrency"]), str(r["requests"]), fmt(r["output_tok_s"], 0), *ms,
                         fmt(r["e2e_mean_s"], 2), fmt(r["tau"]), str(r["errors"]),
                         fmt(steal and 100 * steal, 0)])  # fmt: skip
    lines.append(table(["system", "concurrency", "requests", "output tok/s", "TTFT ms", "TPOT ms", "e2e s", "tau",
                        "errors", "CPU steal %"], rows))  # fmt: skip
    spec, plain = systems.get("eaglespec_spec"), systems.get("eaglespec_plain")
    if spec and plain:
        lines += ["", "eaglespec speculative vs plain, same run:", ""]
        ratio_rows, by_level = [], {}
        for s, p in zip(spec, plain):  # each system's rows are in the same order: level by level, repeat by repeat
            ratios = [_ratio(s[k], p[k]) for k in ("tpot_mean_s", "ttft_mean_s", "output_tok_s")]
            by_level.setdefault(s["concurrency"], []).append(ratios)
            ratio_rows.append([str(s["concurrency"]), *map(fmt, ratios)])
        if any(len(v) > 1 for v in by_level.values()):  # repeats: the median of each ratio per level
            ratio_rows += [[f"{c} (median of {len(v)})", *(fmt(_median([r[j] for r in v])) for j in range(3))]
                           for c, v in by_level.items()]  # fmt: skip
        lines.append(table(["concurrency", "TPOT spec/plain", "TTFT spec/plain", "throughput spec/plain"], ratio_rows))
    return "\n".join(lines) + "\n"


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(a, b):
    return a / b if a is not None and b else None


def _plot(report: dict, path: Path) -> None:
    from .report import _plt

    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, levels in report["systems"].items():
        c = [r["concurrency"] for r in levels]
        axes[0].plot(c, [r["output_tok_s"] for r in levels], marker="o", label=name)
        axes[1].plot(c, [(r["tpot_mean_s"] or 0) * 1e3 for r in levels], marker="o", label=name)
    for ax, ylabel in zip(axes, ["output tokens/s", "TPOT ms"]):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(report["cpu"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
