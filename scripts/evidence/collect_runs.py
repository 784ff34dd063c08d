"""Copy the issue-14 training runs' metrics and final configs into the repo and summarise them.

    python scripts/evidence/collect_runs.py --runs runs/e14 --out docs/eagle31/runs

Per run: OUT/<name>/metrics.jsonl and OUT/<name>/config.json; OUT/summary.json and OUT/summary.md hold, per run,
its switches, steps, training tokens and seconds, and the mean loss and per-step TTT accuracy over its last 50
steps (the trainer logs every 10 steps).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path


def summarize(run: Path) -> dict:
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    train = [r for r in recs if r.get("kind") == "train"]
    cfg = json.loads((run / "final" / "config.json").read_text())
    last = [r for r in train if r["step"] > train[-1]["step"] - 50]
    acc = [sum(r["step_accuracy"][i] for r in last) / len(last) for i in range(len(last[0]["step_accuracy"]))]
    tps = sum(r["tokens_per_s"] for r in train) / len(train)
    seconds = train[-1]["time"] - train[0]["time"]
    return {"fc_norm": cfg.get("fc_norm", False), "norm_output": cfg.get("norm_output", False),
            "draft_vocab_size": cfg["draft_vocab_size"], **cfg.get("eaglespec_training", {}),
            "final_loss": sum(r["loss"] for r in last) / len(last), "final_step_accuracy": acc,
            "tokens_per_s": tps, "seconds_logged": seconds}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    summary = {}
    for run in sorted(p.parent.parent for p in Path(args.runs).glob("*/final/config.json")):
        (out / run.name).mkdir(parents=True, exist_ok=True)
        shutil.copy(run / "metrics.jsonl", out / run.name / "metrics.jsonl")
        shutil.copy(run / "final" / "config.json", out / run.name / "config.json")
        summary[run.name] = summarize(run)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = ["| run | fc_norm | norm_output | Vd | depth | steps | loss (last 50) | TTT acc step 1 / 4 / 7 | tok/s |",
             "|---|---|---|---:|---:|---:|---:|---|---:|"]  # fmt: skip
    for name, s in summary.items():
        a = s["final_step_accuracy"]
        accs = " / ".join(f"{a[i]:.3f}" for i in (0, 3, 6) if i < len(a))
        lines.append(f"| {name} | {s['fc_norm']} | {s['norm_output']} | {s['draft_vocab_size']} | {s.get('depth')} | "
                     f"{s.get('steps')} | {s['final_loss']:.3f} | {accs} | {s['tokens_per_s']:.0f} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
