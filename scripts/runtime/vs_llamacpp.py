"""Issue 31's goal table: our decoding on the llama.cpp runtime vs llama.cpp itself, same GGUF file, batch 1.

For each weights type (F32 and Q8_0 GGUFs written by llama.cpp's converter from SmolLM2's folder, and the shipped
Q4_1 file), passed as the target, one `eaglespec bench --runtime llamacpp` run with our plain and `auto` (both
drafters) beside llama-server's plain and EAGLE-3 (our EAGLE-3 drafter, exported) on the very file our runtime
loads; then one table of decode-only rates (ours: new tokens / (wall - prefill); llama-server: its own clock) and
end-to-end rates. Run alone on the machine:
    python scripts/runtime/vs_llamacpp.py [--out docs/runtime/vs-llamacpp] [--limit 2] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

WEIGHTS = {"F32": "f32", "Q8_0": "q8_0", "Q4_1 (shipped file)": None}  # name -> llama.cpp converter type
DRAFTS = "models/smollm2/drafter-eagle3.1,models/smollm2/drafter-eagle3"


def rates(report: dict) -> dict:
    """{method: (end-to-end tok/s, decode-only tok/s, tau)} over all categories."""
    out = {}
    settings = {m["name"]: m.get("settings", {}) for m in report["methods"] if isinstance(m, dict)}
    for r in report["results"]:
        if r["category"] != "all":
            continue
        split = r.get("time_split_s")
        if split:
            decode = r["new_tokens"] / (r["wall_s"] - split["prefill"])
        else:
            decode = (settings.get(r["method"], {}).get("llamacpp_clock") or {}).get("decode_tokens_per_s")
        out[r["method"]] = (r["tokens_per_s"], decode, r["tau"])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/runtime/vs-llamacpp")
    p.add_argument("--limit", default="2")
    p.add_argument("--max-new-tokens", default="64")
    p.add_argument("--weights", default=",".join(WEIGHTS), help="which of: " + ", ".join(WEIGHTS))
    p.add_argument("--reuse", action="store_true", help="keep a weights type's run where OUT already holds it")
    args = p.parse_args()
    from eaglespec.export.llamacpp_convert import convert_target
    from eaglespec.models.gguf import gguf_folder
    from eaglespec.models.llamacpp.library import llamacpp_root
    from eaglespec.settings import smollm2_gguf

    gguf = smollm2_gguf()
    out = Path(args.out)
    lines = ["| weights | method | tok/s (prefill incl.) | decode tok/s | tau | decode vs llama.cpp plain |",
             "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for name in args.weights.split(","):
        kind = WEIGHTS[name]  # the file our runtime and llama-server both load
        target = str(convert_target(llamacpp_root(), gguf_folder(gguf), kind) if kind else gguf)
        folder = out / name.split()[0].lower()
        cmd = ["eaglespec", "bench", "--target", target, "--runtime", "llamacpp",
               "--methods", "plain,auto,llamacpp_plain,llamacpp_eagle3", "--drafts", DRAFTS,
               "--categories", "chat,code,docs_qa,summarization", "--limit", args.limit,
               "--max-new-tokens", args.max_new_tokens, "--threads", "2", "--out", str(folder)]  # fmt: skip
        if not (args.reuse and (folder / "bench.json").is_file()):
            print("+", " ".join(cmd), file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True)
        found = rates(json.loads((folder / "bench.json").read_text()))
        base = (found.get("llamacpp_plain") or (None, None, None))[1]
        for method, (e2e, decode, tau) in found.items():
            ratio = f"{decode / base:.2f}x" if decode and base else "-"
            lines.append(f"| {name} | {method} | {e2e:.1f} | {decode or 0:.1f} | {tau or 1:.2f} | {ratio} |")
        print("\n".join(lines[-len(found) :]), flush=True)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
