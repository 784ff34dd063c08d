"""Ship a training checkpoint as a bundled drafter: `python scripts/smollm2/ship.py CHECKPOINT OUT [--note TEXT]`.

Writes OUT (config.json + model.safetensors) in bf16, as `eaglespec train` writes final/, with the checkpoint's
training record and a note (e.g. what it was warm-started from). For a run stopped at a checkpoint (a session's
time ran out) whose drafter is worth shipping; a finished run's final/ is copied as it is by recipe.sh."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from eaglespec.models.checkpoint import load_drafter, save_drafter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--note", default=None, help="added to the training record as 'note'")
    args = p.parse_args()
    record = json.loads((Path(args.checkpoint) / "config.json").read_text()).get("eaglespec_training", {})
    if args.note:
        record["note"] = args.note
    tmp = Path(args.out).with_name(Path(args.out).name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_drafter(load_drafter(args.checkpoint), tmp, dtype="bf16", extra_config={"eaglespec_training": record})
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
