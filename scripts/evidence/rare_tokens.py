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

    from eaglespec.bench.compare import rare_tokens
    from eaglespec.models.checkpoint import load_drafter

    report = rare_tokens(args.records, lambda d: load_drafter(d).t2d.numpy())
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for name, shapes in report.items():
        for shape, groups in shapes.items():
            for g, v in groups.items():
                print(f"{name:28s} {shape:11s} {g:32s} oov {v['oov_fraction']:.3f}  oov/step {v['oov_per_step']:.3f}  "
                      f"tau {v['tau']:.2f}  copied {v['copied_accepted']}/{v['copied_drafted']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
