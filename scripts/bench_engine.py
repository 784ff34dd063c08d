"""First engine benchmark: plain vs chain vs tree decoding on one target, same prompts, one run.

Usage: python scripts/bench_engine.py --target DIR --draft DIR [--prompts N] [--max-new-tokens N]
Prints a Markdown table (tokens/s, target forwards per token, tau, time split) and writes JSON.
Each method runs once to warm up, then `--repeats` timed runs; the median is reported.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from eaglespec.api import load_engine
from eaglespec.engine import Request
from eaglespec.speculation.config import TreeShape


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    methods = {
        "plain": dict(mode="off"),
        "chain k=4 (adaptive)": dict(mode="chain", chain_k=4),
        "chain k=4 (forced)": dict(mode="chain", chain_k=4, adaptive=False),
        "tree d4/k4/16 (adaptive)": dict(mode="tree", tree=TreeShape(4, 4, 16)),
        "tree d4/k4/16 (forced)": dict(mode="tree", tree=TreeShape(4, 4, 16), adaptive=False),
    }
    rows, outputs = [], {}
    for name, kw in methods.items():
        adaptive = kw.pop("adaptive", True)
        engine = load_engine(args.target, args.draft, **kw)
        engine.configure(adaptive=adaptive)
        vocab = engine.target.cfg.vocab_size
        prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
        g.manual_seed(0)
        reqs = [Request(p, args.max_new_tokens) for p in prompts]
        engine.generate(reqs[:1])  # warm-up
        runs = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            out = engine.generate(reqs)
            runs.append((time.perf_counter() - t, out))
        wall, out = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
        s = out.stats
        outputs[name] = [r.output_ids for r in out.results]
        rows.append({
            "method": name, "tokens_per_s": s.new_tokens / wall,
            "target_forwards_per_token": s.target_forwards / s.new_tokens,
            "tau": s.tau, "draft_s": s.time_draft, "verify_s": s.time_verify, "other_s": s.time_other,
            "wall_s": wall, "all_walls_s": [r[0] for r in runs],
        })  # fmt: skip
    base = rows[0]["tokens_per_s"]
    same = all(v == outputs["plain"] for v in outputs.values())
    print(f"greedy outputs identical across methods: {same}")
    print("| method | tokens/s | speedup | target fwd/token | tau | draft s | verify s | other s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}x | "
              f"{r['target_forwards_per_token']:.3f} | {r['tau']:.2f} | {r['draft_s']:.2f} | {r['verify_s']:.2f} | "
              f"{r['other_s']:.2f} |")  # fmt: skip
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"rows": rows, "identical": same, "args": vars(args)}, f, indent=2)
    if not same:
        raise SystemExit("MISMATCH: a lossless method changed the greedy output")


if __name__ == "__main__":
    main()
