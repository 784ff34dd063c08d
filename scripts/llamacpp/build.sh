#!/usr/bin/env bash
# Build llama.cpp once, from the llama-cpp-python sdist's vendored copy, for the bench peer
# (src/eaglespec/bench/peers/llamacpp.py). Output: $EAGLESPEC_LLAMACPP (default ~/.cache/eaglespec/llama.cpp)
# with src/ (the llama.cpp sources, also the GGUF converter) and build/bin/llama-server.
# Idempotent: exits early when the binaries are there. JOBS=N sets the parallel compile jobs (default 2).
set -euo pipefail

VERSION="${LLAMACPP_SDIST_VERSION:-0.3.36}"
ROOT="${EAGLESPEC_LLAMACPP:-$HOME/.cache/eaglespec/llama.cpp}"
JOBS="${JOBS:-2}"
# llama-server: the peer drives it over localhost HTTP because /completion takes token ids and returns
# token ids plus llama.cpp's own timings and draft counts (plain and --spec-type draft-eagle3 alike).
# llama-speculative-simple: the same EAGLE-3 path from the command line, for manual cross-checks.
# llama-quantize: q4_0 GGUFs for the int4 peer (the HF converter writes f32/bf16/f16/q8_0 only).
# Shared libraries: the llama.cpp target runtime (src/eaglespec/models/llamacpp/) loads bin/libllama.so
# through ctypes; the tools link the same libraries.
TARGETS=(llama-server llama-speculative-simple llama-quantize)
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

all_built() {
    for t in "${TARGETS[@]}"; do [[ -x "$ROOT/build/bin/$t" ]] || return 1; done
    [[ -f "$ROOT/build/bin/libllama.so" ]] || return 1
}

if all_built; then
    echo "llama.cpp already built in $ROOT/build/bin"
else
    mkdir -p "$ROOT"
    if [[ ! -f "$ROOT/src/CMakeLists.txt" ]]; then
        SDIST="$(ls "$ROOT"/dl/llama_cpp_python-"$VERSION".tar.gz /tmp/llsdist/llama_cpp_python-"$VERSION".tar.gz \
            2>/dev/null | head -n1 || true)"
        if [[ -z "$SDIST" ]]; then
            mkdir -p "$ROOT/dl"
            python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$ROOT/dl"
            SDIST="$ROOT/dl/llama_cpp_python-$VERSION.tar.gz"
        fi
        rm -rf "$ROOT/src" "$ROOT/src.tmp" && mkdir -p "$ROOT/src.tmp"
        tar -xzf "$SDIST" -C "$ROOT/src.tmp" "llama_cpp_python-$VERSION/vendor/llama.cpp"
        mv "$ROOT/src.tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$ROOT/src" && rm -rf "$ROOT/src.tmp"
    fi
    # Local files only: no curl/openssl, no web UI download or npm build, no tests.
    cmake -S "$ROOT/src" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF -DBUILD_SHARED_LIBS=ON >"$ROOT/cmake-configure.log"
    nice -n 10 cmake --build "$ROOT/build" --config Release -j"$JOBS" --target "${TARGETS[@]}"
    all_built && echo "llama.cpp built in $ROOT/build/bin"
fi

# convert_hf_to_gguf.py takes gguf from its own gguf-py (our wrapper puts it on sys.path, same version as the
# binaries); it also imports torch, numpy, safetensors, transformers (in our venv), tqdm and pyyaml (gguf-py's
# deps) and sentencepiece (imported even for BPE tokenizers). Install the light ones into the venv if missing;
# they are not project dependencies.
PY="${PYTHON:-$REPO/.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
for mod_pkg in sentencepiece:sentencepiece tqdm:tqdm yaml:pyyaml; do
    "$PY" -c "import ${mod_pkg%%:*}" 2>/dev/null || "$PY" -m pip install --quiet "${mod_pkg##*:}"
done
