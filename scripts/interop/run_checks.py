"""Run the external interop checks on the bundled models and record the outcome with versions.

    python scripts/interop/run_checks.py [--out docs/interop/checks.json] [--prompts 2] [--max-new-tokens 48]

- speculators: both bundled drafters exported as speculators, loaded by speculators' own loader and run
  through its own forward (3 TTT steps) on target states of a real prompt; logits compared with ours.
- llama.cpp: the bundled target and EAGLE-3 drafter exported as GGUF by `eaglespec export`, run in
  llama-server, greedy; outputs compared with `eaglespec generate`, acceptance side by side (chain of k).
Each check is skipped, with the reason in the record, when its environment is missing
(scripts/interop/build_envs.sh builds both).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "models"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "interop" / "checks.json"))
    ap.add_argument("--prompts", type=int, default=2, help="prompts per category (chat, code, docs_qa)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step for the llama.cpp comparison")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    from eaglespec.api import load_tokenizer
    from eaglespec.bench.peers.interop import check_llamacpp, check_speculators, speculators_unavailable
    from eaglespec.bench.peers.llamacpp import not_built_reason
    from eaglespec.machine import cpu_name
    from eaglespec.suites import load_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    target = MODELS / "target"
    tok = load_tokenizer(target)
    by_cat, _ = load_prompts(["chat", "code", "docs_qa"], tok, limit=args.prompts, max_new_tokens=args.max_new_tokens,
                             max_length=4096)  # fmt: skip
    prompts = [p.ids for ps in by_cat.values() for p in ps]
    record = {"machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "python": platform.python_version(),
                          "torch": torch.__version__},
              "command": "python " + " ".join([str(Path(sys.argv[0]).relative_to(REPO)
                                                    if Path(sys.argv[0]).is_absolute() else sys.argv[0]),
                                               *sys.argv[1:]]),
              "checks": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as work:
        reason = speculators_unavailable()
        for name in ("drafter-eagle3.1", "drafter-eagle3"):
            key = f"speculators/{name}"
            if reason:
                record["checks"][key] = {"skipped": reason}
                continue
            t0 = time.time()
            r = check_speculators(MODELS / name, target, Path(work) / name, ids=torch.tensor([prompts[0]]), steps=3)
            record["checks"][key] = {**r, "seconds": round(time.time() - t0, 1)}
        reason = not_built_reason()
        if reason:
            record["checks"]["llama.cpp/drafter-eagle3"] = {"skipped": reason}
        else:
            t0 = time.time()
            r = check_llamacpp(MODELS / "drafter-eagle3", target, Path(work) / "llamacpp", prompts,
                               max_new_tokens=args.max_new_tokens, k=args.k)  # fmt: skip
            record["checks"]["llama.cpp/drafter-eagle3"] = {**r, "seconds": round(time.time() - t0, 1)}
        record["checks"]["llama.cpp/drafter-eagle3.1"] = {
            "skipped": "not convertible: llama.cpp's EAGLE-3 has no fc_norm / norm_output (export refuses it)"}
    for rec in record["checks"].values():  # temporary paths mean nothing after the run
        for k in ("target_gguf", "drafter_gguf"):
            rec.pop(k, None)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    for key, rec in record["checks"].items():
        status = "skipped: " + rec["skipped"] if "skipped" in rec else ("PASSED" if rec.get("passed") else "FAILED")
        print(f"{key}: {status}")
    failed = [k for k, r in record["checks"].items() if "skipped" not in r and not r.get("passed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
