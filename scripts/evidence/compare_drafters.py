"""Issue 14 comparison protocol over trained drafter variants (bench/compare.py), with bootstrap intervals.

    python scripts/evidence/compare_drafters.py --runs runs/e14 --depth 7 --out docs/eagle31/d7 \
        [--variants e31,e3,fcnorm,normout] [--baseline e3] [--conversations 8] [--max-new-tokens 32] \
        [--shapes chain7,tree,tree7] [--replay [--records DIR]] [--draft-window N] [--summarize-only]

Drafters are found as RUNS/d<depth>-<variant>-s<seed>/final, or given with --variant NAME=DIR[,DIR...].
Measurements are kept per drafter in OUT
(resumable); the summary goes to OUT/report.json and OUT/report.md (tau with 95% interval per variant,
ratio to the baseline with its interval, per condition and shape, the paper's ratio beside it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def find_variants(runs: Path, depth: int, wanted: list[str]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for d in sorted(runs.glob(f"d{depth}-*-s*/final/config.json")):
        m = re.fullmatch(rf"d{depth}-(.+)-s(\d+)", d.parent.parent.name)
        if m and m.group(1) in wanted:
            found.setdefault(m.group(1), []).append(str(d.parent))
    return {v: found[v] for v in wanted if v in found}


def fmt_ci(x, ci) -> str:
    return f"{x:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]"


def markdown(report: dict, baseline: str) -> str:
    from eaglespec.bench.compare import PAPER_RATIOS

    lines = []
    for shape, conds in report.items():
        if not isinstance(conds, dict):
            continue
        variants = list(next(iter(conds.values())))
        others = [v for v in variants if v != baseline]
        head = ["condition", "prompts", *[f"tau {v} (seeds)" for v in variants], *[f"{v}/{baseline}" for v in others],
                "paper 3.1/3"]  # fmt: skip
        lines += [f"\n### {shape}\n", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        order = ["standard", "perturbed", *sorted(c for c in conds if c.startswith("perturbed/")), "long"]
        for cond in [c for c in order if c in conds]:
            row = conds[cond]
            cells = [cond, str(row[baseline]["prompts"])]
            cells += [f"{fmt_ci(row[v]['tau'], row[v]['tau_ci'])} ({row[v]['seeds']})" for v in variants]
            cells += [fmt_ci(row[v]["ratio"], row[v]["ratio_ci"]) for v in others]
            cells.append(PAPER_RATIOS.get(cond.split("/")[0], "") if "/" not in cond else "")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default=str(REPO / "runs" / "e14"))
    ap.add_argument("--depth", type=int, default=7)
    ap.add_argument("--variants", default="e31,e3,fcnorm,normout")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=DIR[,DIR...]",
                    help="explicit drafters of a variant (repeat per variant); replaces the search under --runs")
    ap.add_argument("--baseline", default="e3")
    ap.add_argument("--out", required=True)
    ap.add_argument("--conversations", type=int, default=8, help="held-out conversations per suite (chat, docs_qa, "
                    "summarization), each rendered in every perturbed format")  # fmt: skip
    ap.add_argument("--long-limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--shapes", default="chain7,tree,tree7")
    ap.add_argument("--target", default=str(REPO / "models" / "target"),
                    help="the target (folder or .gguf; default: the 8.4M test model the e14 runs were trained for)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--replicates", type=int, default=2000)
    ap.add_argument("--summarize-only", action="store_true")
    ap.add_argument("--records", help="with --replay: keep the target's records in this folder (reused by "
                    "another process or a resumed run)")  # fmt: skip
    ap.add_argument("--draft-window", type=int, help="the drafters' attention window (default: their own; 0: none)")
    ap.add_argument("--replay", action="store_true", help="record the target's greedy continuations once and "
                    "replay them for every drafter (bench/replay.py): tau for drafter forwards only")  # fmt: skip
    ap.add_argument("--shape-baseline", help="also report each shape's tau ratio to this shape, per variant "
                    "(e.g. tree, to see what tree+ngram adds)")  # fmt: skip
    args = ap.parse_args()

    from eaglespec.api import load_tokenizer
    from eaglespec.bench.compare import build_prompts, run, shape_ratios, summarize_run

    torch.set_num_threads(args.threads)
    target = Path(args.target)
    out = Path(args.out)
    if args.variant:
        variants = {v.split("=", 1)[0]: v.split("=", 1)[1].split(",") for v in args.variant}
    else:
        variants = find_variants(Path(args.runs), args.depth, args.variants.split(","))
    if not args.summarize_only:
        if args.baseline not in variants:
            sys.exit(f"no trained drafters for the baseline {args.baseline!r} under {args.runs} (found {variants})")
        prompts = build_prompts(load_tokenizer(target), conversations=args.conversations,
                                long_limit=args.long_limit, max_new_tokens=args.max_new_tokens)  # fmt: skip
        print(f"[compare] {len(prompts)} prompts; variants {({v: len(d) for v, d in variants.items()})}",
              file=sys.stderr)  # fmt: skip
        run(target, variants, out, prompts, shapes=tuple(args.shapes.split(",")), max_new_tokens=args.max_new_tokens,
            replay=args.replay, records_dir=args.records, draft_window=args.draft_window)
    report = summarize_run(out, args.baseline, replicates=args.replicates)
    text = markdown(report, args.baseline)
    if args.shape_baseline:
        report["shape_ratios"] = shape_ratios(out, args.shape_baseline, replicates=args.replicates)
        text += f"\n### tau ratio to shape {args.shape_baseline}, same drafter\n\n"
        text += "| variant | shape | condition | ratio |\n|---|---|---|---|\n"
        for v, shapes in report["shape_ratios"].items():
            for s, conds in shapes.items():
                text += "".join(f"| {v} | {s} | {c} | {fmt_ci(r['ratio'], r['ratio_ci'])} |\n"
                                for c, r in conds.items())
    report["command"] = "python scripts/evidence/compare_drafters.py " + " ".join(sys.argv[1:])
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
