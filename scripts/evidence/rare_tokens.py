"""Issue 14, rare tokens: how often the target writes tokens outside the draft vocabulary, what that costs in
acceptance, and whether the hybrid proposer's context n-grams recover it.

    python scripts/evidence/rare_tokens.py --records docs/eagle31/hybrid --out docs/eagle31/rare_tokens.json

Reads the comparison protocol's records (scripts/evidence/compare_drafters.py --shapes tree,tree+ngram). A token
outside the draft vocabulary can never be drafted by the EAGLE drafter, so each one the target writes ends a
verification step as its bonus token: `oov_per_step` = such tokens / verification steps is the share of steps cut
short by the vocabulary alone. Copied n-gram candidates are not limited to the draft vocabulary; the records
keep how many copied tokens were drafted and accepted, and tau with and without them on the same prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from eaglespec.models.drafter import load_drafter

    rec_dir = Path(args.records)
    conds = {pid: cond for pid, cond, _ in json.loads((rec_dir / "prompts.json").read_text())}
    group = lambda pid, cond: cond if cond != "standard" else "standard/" + pid.split("/")[0]
    report = {}
    for path in sorted(rec_dir.glob("*--*.json")):
        rec = json.loads(path.read_text())
        in_vocab = load_drafter(rec["drafter"]).t2d
        per = {}
        for shape, rows in rec["measured"].items():
            for pid, row in rows.items():
                g = per.setdefault(shape, {}).setdefault(group(pid, conds[pid]), [0, 0, 0, 0, 0, 0])
                out = row[3]
                g[0] += len(out)
                g[1] += sum(1 for t in out if not in_vocab[t])
                g[2] += row[0]  # drafts (verification steps)
                g[3] += row[1]  # accepted draft tokens
                g[4] += row[4] if len(row) > 4 else 0  # copied draft tokens
                g[5] += row[5] if len(row) > 5 else 0  # copied tokens accepted
        report[path.stem] = {
            shape: {g: {"tokens": v[0], "oov_fraction": v[1] / v[0] if v[0] else 0.0,
                        "oov_per_step": v[1] / v[2] if v[2] else 0.0, "tau": 1 + v[3] / v[2] if v[2] else 1.0,
                        "copied_drafted": v[4], "copied_accepted": v[5]} for g, v in sorted(groups.items())}
            for shape, groups in per.items()}  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for name, shapes in report.items():
        for shape, groups in shapes.items():
            for g, v in groups.items():
                print(f"{name:28s} {shape:11s} {g:32s} oov {v['oov_fraction']:.3f}  oov/step {v['oov_per_step']:.3f}  "
                      f"tau {v['tau']:.2f}  copied {v['copied_accepted']}/{v['copied_drafted']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
