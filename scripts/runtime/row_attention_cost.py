"""What exactness by construction costs the PyTorch fp32 target: step costs with the row-invariant attention
kernel (models/row_attention.py) and with PyTorch's SDPA (EAGLESPEC_ROW_ATTENTION=0), side by side.

For SmolLM2-135M-Instruct fp32 (its Q4_1 values dequantized, as the engine runs it): the row gap (max |logit
difference| between a 17-row verification and one-token steps, after 40 and 600 tokens) and the milliseconds
of one forward (best of 7, logits at every row) over 1, 5 and 17 rows after 40, 800 and 4000 tokens. Each
attention runs in its own process (the kernel choice is made once per process). Run alone on the machine:
    python scripts/runtime/row_attention_cost.py [--out docs/runtime/row_attention.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROWS = (1, 5, 17)
CONTEXTS = (40, 800, 4000)


def measure() -> dict:
    from eaglespec.models.checkpoint import load_target
    from eaglespec.models.fast_linear import prepare_for_inference
    from eaglespec.models.gguf import gguf_folder
    from eaglespec.models.precision import row_gap
    from eaglespec.settings import smollm2_gguf

    sys.path.insert(0, str(Path(__file__).parent))
    from step_costs import forward_costs

    target = prepare_for_inference(load_target(gguf_folder(smollm2_gguf())))
    out = {"row_invariant": target.new_cache(1, max_length=8).row_invariant,
           "gap": max(row_gap(target), row_gap(target, prompt_len=600, seed=1))}  # fmt: skip
    out.update({f"{c}/{n}": ms for (c, n), ms in forward_costs(target, CONTEXTS, ROWS).items()})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/runtime/row_attention.md")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure()))
        return 0
    results = {}
    for name, flag in (("row-invariant kernel", "1"), ("SDPA", "0")):
        env = {**os.environ, "EAGLESPEC_ROW_ATTENTION": flag}
        child = [sys.executable, __file__, "--child"]
        done = subprocess.run(child, env=env, capture_output=True, text=True, check=True)
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(name, results[name], flush=True)
    cpu = platform.processor() or "cpu"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    head = " | ".join(f"{n} rows @{c}" for c in CONTEXTS for n in ROWS)
    lines = ["# PyTorch fp32 target: row-invariant attention vs SDPA (SmolLM2-135M-Instruct)\n",
             f"`python scripts/runtime/row_attention_cost.py`; {cpu}, {os.cpu_count()} threads. Milliseconds of one "
             "forward (best of 7, logits at every row) over n rows after c tokens of context; row gap: max |logit "
             "difference| between a 17-row verification and one-token steps (0 = exact by construction).\n",
             f"| attention | exact | row gap | {head} |",
             "|---|---|---:|" + "---:|" * len(CONTEXTS) * len(ROWS)]  # fmt: skip
    for name, r in results.items():
        cells = " | ".join(f"{r[f'{c}/{n}']:.1f}" for c in CONTEXTS for n in ROWS)
        lines.append(f"| {name} | {'yes' if r['row_invariant'] else 'no'} | {r['gap']:.2g} | {cells} |")
    k, s = results["row-invariant kernel"], results["SDPA"]
    ratio = " | ".join(f"{k[f'{c}/{n}'] / s[f'{c}/{n}']:.2f}" for c in CONTEXTS for n in ROWS)
    lines.append(f"| kernel / SDPA | | | {ratio} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
