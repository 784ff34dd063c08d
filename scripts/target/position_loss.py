#!/usr/bin/env python3
"""Held-out loss per position bucket: how well a target model holds up as the context grows.

For every corpus part whose test split (never trained on) has at least --min-tokens tokens, one window
of up to --max-len tokens (the part's test documents, concatenated in order: related text) goes through
`transformers` (the reference implementation, fp32, SDPA); the cross-entropy of each position is
averaged per bucket. Needs data/tokens (scripts/target/train_target.py --prepare).

  python scripts/target/position_loss.py --target models/target [--max-len 32768] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUCKETS = (0, 512, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def bucket_names(max_len: int) -> list[tuple[int, int, str]]:
    out = []
    for lo, hi in zip(BUCKETS, BUCKETS[1:]):
        if lo >= max_len:
            break
        out.append((lo, min(hi, max_len), f"{_k(lo)}-{_k(min(hi, max_len))}"))
    return out


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def position_loss(target_dir, max_len: int = 32768, min_tokens: int = 16384, threads: int | None = None) -> dict:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    buckets = bucket_names(max_len)
    parts = {}
    for part_dir in sorted((ROOT / "data/tokens").iterdir()):
        f = part_dir / "test.bin"
        if not f.is_file() or f.stat().st_size < 2 * (min_tokens + 1):
            continue
        arr = np.memmap(f, dtype=np.uint16, mode="r")
        n = min(len(arr) - 1, max_len)
        x = torch.from_numpy(np.asarray(arr[: n + 1], dtype=np.int64))[None]
        t0 = time.time()
        with torch.no_grad():
            logits = model(input_ids=x[:, :-1]).logits[0]
        loss = F.cross_entropy(logits, x[0, 1:], reduction="none")
        parts[part_dir.name] = {"tokens": n, "seconds": round(time.time() - t0, 1),
                                "buckets": {name: round(float(loss[lo:hi].mean()), 3)
                                            for lo, hi, name in buckets if lo < n}}  # fmt: skip
    names = [name for _, _, name in buckets]
    mean = {}
    for name in names:
        vals = [p["buckets"][name] for p in parts.values() if name in p["buckets"]]
        if vals:
            mean[name] = round(sum(vals) / len(vals), 3)
    return {"target": str(target_dir), "max_len": max_len, "parts": parts, "mean": mean}


def markdown(res: dict) -> str:
    names = list(res["mean"])
    lines = ["| part | tokens | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for part, p in res["parts"].items():
        cells = [f"{p['buckets'][n]:.3f}" if n in p["buckets"] else "" for n in names]
        lines.append(f"| {part} | {p['tokens']} | " + " | ".join(cells) + " |")
    lines.append("| **mean** | | " + " | ".join(f"**{res['mean'][n]:.3f}**" for n in names) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(ROOT / "models/target"))
    ap.add_argument("--max-len", type=int, default=32768)
    ap.add_argument("--min-tokens", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    res = position_loss(args.target, args.max_len, args.min_tokens, args.threads)
    print(markdown(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
