#!/usr/bin/env bash
# Build the environments the external interop checks run in (tests/test_export.py, scripts/interop/run_checks.py):
# - speculators (vLLM's drafter library) in its own venv, because it pins transformers <= 5.19 and we run newer:
#   $EAGLESPEC_SPECULATORS_VENV (default ~/.cache/eaglespec/venv-speculators), CPU torch 2.13.0 (the local build;
#   an unpinned install pulls a multi-GB CUDA torch), speculators 0.9.0. torchvision / torchaudio come in as
#   dependencies built for another torch and break transformers' imports, so they are removed: speculators'
#   Eagle-3 model and loader do not use them.
# - llama.cpp (llama-server, its GGUF converter): scripts/llamacpp/build.sh (~10 min on 2 cores).
# Idempotent. SKIP_LLAMACPP=1 builds the speculators venv only.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${EAGLESPEC_SPECULATORS_VENV:-$HOME/.cache/eaglespec/venv-speculators}"
SPECULATORS_VERSION="${SPECULATORS_VERSION:-0.9.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import speculators.models.eagle3.core" 2>/dev/null; then
    echo "speculators environment ready in $VENV"
else
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
    "$VENV/bin/pip" install -q "speculators==$SPECULATORS_VERSION" "torch==$TORCH_VERSION"
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio || true
    "$VENV/bin/python" -c "import speculators.models.eagle3.core" && echo "speculators environment built in $VENV"
fi
"$VENV/bin/python" -c "import importlib.metadata as m; print({p: m.version(p) for p in ('speculators', 'transformers', 'torch')})"

if [[ "${SKIP_LLAMACPP:-0}" != "1" ]]; then
    bash "$REPO/scripts/llamacpp/build.sh"
fi
