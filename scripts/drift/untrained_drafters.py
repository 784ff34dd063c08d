"""Write an untrained EAGLE-3.1 and EAGLE-3 drafter for a target, with identical weights (same seed):
only the recurrence differs (`norm_output`, `fc_norm` whose norms start at weight 1). A controlled
baseline for `eaglespec drift` before trained drafters exist:

    python scripts/drift/untrained_drafters.py --target models/target --out runs/drift-untrained
"""

from __future__ import annotations

import argparse

import torch

from eaglespec.models.checkpoint import load_target, save_drafter
from eaglespec.models.drafter import Eagle3Drafter
from eaglespec.models.drafter_config import new_drafter_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="models/target")
    ap.add_argument("--out", default="runs/drift-untrained")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    target = load_target(args.target)
    for name, v31 in (("drafter-eagle3.1", True), ("drafter-eagle3", False)):
        torch.manual_seed(args.seed)
        drafter = Eagle3Drafter(new_drafter_config(target.cfg, fc_norm=v31, norm_output=v31))
        with torch.no_grad():  # lm_head from the target's rows, as `eaglespec train` starts
            drafter.lm_head.weight.copy_(target.lm_head.weight[drafter.draft_to_target])
        save_drafter(drafter, f"{args.out}/{name}", dtype="fp32")
        print(f"wrote {args.out}/{name}")


if __name__ == "__main__":
    main()
