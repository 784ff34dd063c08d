#!/usr/bin/env bash
# The SmolLM2 figures of BENCHMARKS.md (goal table of the real default model): one command per table.
# Run on a quiet machine (nothing else on the cores), from the repository root with the venv active:
#   bash scripts/smollm2/bench.sh [speed|quant|main|all]   (default all)
# Records: docs/smollm2/<table>/ (bench.json, bench.md) and docs/smollm2/main_job.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-docs/smollm2}
LIMIT=${LIMIT:-3}                  # prompts per suite (held-out: the suites come from the corpus test split)
MAX_NEW=${MAX_NEW:-128}
SUITES=${SUITES:-chat,code,docs_qa,summarization}
DRAFTS=models/smollm2/drafter-eagle3.1,models/smollm2/drafter-eagle3
what=${1:-all}

speed() {  # batch 1: plain, auto, forced tree and chain with both drafters, transformers, prompt lookup
    eaglespec bench --methods plain,auto,tree,chain,hf_generate,prompt_lookup --drafts "$DRAFTS" \
        --categories "$SUITES" --limit "$LIMIT" --max-new-tokens "$MAX_NEW" --threads 2 --out "$OUT/speed"
}
quant() {  # quantized targets: plain and auto with the EAGLE-3.1 drafter, lossless check per scheme
    for q in int8 int4 w8a8; do
        extra=(); [ "$q" = int4 ] && extra=(--quantize-group 64)  # 576 is not a multiple of 128
        eaglespec bench --methods plain,auto --quantize "$q" "${extra[@]}" --categories "$SUITES" \
            --limit "$LIMIT" --max-new-tokens "$MAX_NEW" --threads 2 --out "$OUT/quant-$q"
    done
}
main_job() {  # the README's main job, timed from the command to the answer (model converted and cached)
    { /usr/bin/time -f "wall %e s, max RSS %M KB" eaglespec generate --chat \
        --prompt "What is the capital of France? Answer in one sentence." --max-new-tokens 64; } \
        > "$OUT/main_job.txt" 2>&1
    cat "$OUT/main_job.txt"
}
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
case $what in
    speed) speed ;; quant) quant ;; main) main_job ;;
    all) main_job; speed; quant ;;
    *) echo "usage: $0 [speed|quant|main|all]" >&2; exit 2 ;;
esac
