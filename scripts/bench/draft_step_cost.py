#!/usr/bin/env python3
"""Drafter step cost vs context length, with and without the drafter's attention window.

One drafting step as the engine runs it: `extend` with the accepted pairs (here 3) and `propose` of the
EAGLE-2 tree (depth 4, top-k 4, 16 nodes), on a drafter KV cache holding N committed positions (filled
with random keys: the cost does not depend on their values). Median of --repeats steps per point.

  python scripts/bench/draft_step_cost.py [--draft models/drafter-eagle3.1] [--window 256] [--lengths 512,...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def step_cost(proposer, drafter, length: int, repeats: int, accepted: int = 3) -> float:
    from eaglespec.speculation.config import TreeShape
    from eaglespec.speculation.proposer import FixedShape

    cache = drafter.new_cache(1, length + 64, initial_capacity=length + 64)
    for t in cache.k + cache.v:
        t.normal_()
    h = drafter.fc.in_features
    ids, aux = torch.randint(0, drafter.cfg.vocab_size, (1, accepted)), torch.randn(1, accepted, h)
    root = torch.tensor([1])
    times = []
    with torch.inference_mode():
        for i in range(repeats + 3):
            cache.lengths[0] = length
            t0 = time.perf_counter()
            logits, state = proposer.extend(cache, None, ids, aux, torch.tensor([accepted]))
            proposer.propose(cache, None, root, logits, state, FixedShape(TreeShape(4, 4, 16)))
            if i >= 3:
                times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main():
    from eaglespec.models.checkpoint import load_drafter, load_target
    from eaglespec.speculation.proposer import EagleProposer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(ROOT / "models/target"))
    ap.add_argument("--draft", default=str(ROOT / "models/drafter-eagle3.1"))
    ap.add_argument("--window", type=int, default=None, help="window to compare (default: the drafter's, else 256)")
    ap.add_argument("--lengths", default="512,2048,8192,32768")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target)
    drafter = load_drafter(args.draft, target=target)
    drafter.attach_target_embedding(target.model.embed_tokens)
    window = args.window or drafter.cfg.draft_attention_window or 256
    proposer = EagleProposer(drafter)
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []
    for w in (None, window):
        drafter.cfg.draft_attention_window = w
        costs = {n: step_cost(proposer, drafter, n, args.repeats) for n in lengths}
        rows.append({"window": w, "ms": costs, "ratio_to_first": {n: costs[n] / costs[lengths[0]] for n in lengths}})
    from eaglespec.bench.runner import cpu_name

    res = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "drafter": args.draft, "rows": rows}
    print(f"drafter step (extend 3 + tree d4/k4/16), ms, {res['cpu']}, {res['threads']} threads")
    print("| window | " + " | ".join(str(n) for n in lengths) + f" | {lengths[-1]} / {lengths[0]} |")
    print("|---|" + "---:|" * (len(lengths) + 1))
    for r in rows:
        cells = " | ".join(f"{r['ms'][n]:.2f}" for n in lengths)
        print(f"| {r['window'] or 'none'} | {cells} | {r['ratio_to_first'][lengths[-1]]:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
