"""Convert the target (and an EAGLE-3 drafter) to GGUF with llama.cpp's converter; prints the cached paths.

    python scripts/llamacpp/convert.py [--target models/target] [--drafter models/drafter-eagle3] [--outtype f32]

Needs scripts/llamacpp/build.sh first (the converter comes from its source tree). Outputs are cached under
$EAGLESPEC_LLAMACPP/gguf (default ~/.cache/eaglespec/llama.cpp/gguf), keyed by the input files' sizes and mtimes.
EAGLE-3.1 drafters are refused (llama.cpp has no fc_norm mapping). See src/eaglespec/export/llamacpp_convert.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eaglespec.bench.peers.llamacpp import llamacpp_root, not_built_reason
from eaglespec.export.llamacpp_convert import OUTTYPES, UnsupportedDrafter, convert_drafter, convert_target

REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=str(REPO / "models" / "target"))
    p.add_argument("--drafter", help="EAGLE-3 drafter directory (e.g. models/drafter-eagle3)")
    p.add_argument("--outtype", default="f32", choices=OUTTYPES)
    args = p.parse_args()
    root = llamacpp_root()
    if not (root / "src" / "convert_hf_to_gguf.py").is_file():
        print(not_built_reason(root), file=sys.stderr)
        return 2
    print(convert_target(root, args.target, args.outtype))
    if args.drafter:
        try:
            print(convert_drafter(root, args.drafter, args.target, args.outtype))
        except UnsupportedDrafter as e:
            print(e, file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
