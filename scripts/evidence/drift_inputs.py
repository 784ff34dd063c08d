"""Prompts for `eaglespec drift` in the issue-14 conditions: JSONL of {"prompt_ids"} for the standard suites and
for the perturbed formats (the same held-out conversations the comparison protocol uses).

    python scripts/evidence/drift_inputs.py --out runs/e14/drift [--conversations 2] [--target DIR_OR_GGUF]
writes OUT/standard.jsonl and OUT/perturbed.jsonl.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--conversations", type=int, default=2, help="per suite (chat, docs_qa, summarization)")
    ap.add_argument("--target", default=str(REPO / "models" / "target"),
                    help="whose tokenizer renders the prompts (default: the 8.4M test model of the e14 study)")
    args = ap.parse_args()
    from eaglespec.api import load_tokenizer
    from eaglespec.bench.compare import build_prompts

    prompts = build_prompts(load_tokenizer(args.target), conversations=args.conversations, long_limit=0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, keep in (("standard", lambda c: c == "standard"), ("perturbed", lambda c: c.startswith("perturbed/"))):
        rows = [{"prompt_ids": p.ids, "id": p.id} for p in prompts if keep(p.condition)]
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{len(rows)} prompts -> {out / (name + '.jsonl')}")


if __name__ == "__main__":
    main()
