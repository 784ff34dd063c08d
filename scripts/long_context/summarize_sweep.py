#!/usr/bin/env python3
"""Summarize `eaglespec bench --sweep context` JSON files into the long-context goal table of BENCHMARKS.md, Long context.

Per length: tau of each drafter and shape (mean over the text and needle prompts, weighted by drafts),
tau relative to the same method at the shortest length, the EAGLE-3.1 / EAGLE-3 tau ratio, and the
decode-only speedup over plain.

  python scripts/long_context/summarize_sweep.py docs/long-context/sweep/sweep_context.json [more.json ...]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def summarize(paths: list[str]) -> str:
    points = [p for path in paths for p in json.load(open(path))["points"]]
    tau, speed = defaultdict(list), defaultdict(list)
    for p in points:
        key = (p["context"], p["method"])
        if p["drafts"]:
            tau[key].append((p["tau"], p["drafts"]))
        if p.get("decode_speedup"):
            speed[key].append(p["decode_speedup"])
    mean_tau = {k: sum(t * d for t, d in v) / sum(d for _, d in v) for k, v in tau.items()}
    mean_speed = {k: sum(v) / len(v) for k, v in speed.items()}
    lengths = sorted({c for c, _ in mean_tau})
    methods = sorted({m for _, m in mean_tau})
    lines = ["| context | " + " | ".join(f"{m} tau (x of {lengths[0]}) / decode speedup" for m in methods)
             + " | tree 3.1/3 | chain 3.1/3 |", "|---:|" + "---|" * (len(methods) + 2)]
    for n in lengths:
        cells = []
        for m in methods:
            t, t0 = mean_tau.get((n, m)), mean_tau.get((lengths[0], m))
            cells.append(f"{t:.2f} ({t / t0:.2f}x) / {mean_speed.get((n, m), 0):.2f}x" if t and t0 else "")
        ratios = []
        for kind in ("tree", "chain"):
            a, b = mean_tau.get((n, f"{kind}[EAGLE-3.1]")), mean_tau.get((n, f"{kind}[EAGLE-3]"))
            ratios.append(f"{a / b:.2f}" if a and b else "")
        lines.append(f"| {n} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(sys.argv[1:]))
