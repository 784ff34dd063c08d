#!/usr/bin/env bash
# Default drafters (issue 4): regenerate data with the bundled target, choose the draft vocabulary, train
# the EAGLE-3.1 and the EAGLE-3 drafter with the same data, vocabulary, schedule and budget (in parallel,
# one thread each), and copy them into models/. Run from the repository root with the venv active.
# Needs data/corpus (scripts/corpus/build_corpus.py). STEPS sets the budget (optimizer steps of 8 samples).
set -euo pipefail
STEPS=${STEPS:-450}
DEPTH=${DEPTH:-5}
python scripts/drafter/build_regen_input.py --out data/drafter/prompts.jsonl
OMP_NUM_THREADS=2 eaglespec data regen --target models/target --input data/drafter/prompts.jsonl \
    --out data/drafter/regen --max-new-tokens 96 --batch-size 32 --shard-size 100
eaglespec data vocab --target models/target --data data/drafter/regen --size 2048 --out data/drafter/vocab
common=(--target models/target --data data/drafter/regen --vocab data/drafter/vocab --steps "$STEPS"
        --depth "$DEPTH" --lr 1e-3 --warmup-steps 10 --batch-size 8 --micro-batch 4 --max-len 1024
        --eval-every 150 --eval-samples 32 --eval-prompts 16 --eval-max-new-tokens 48 --save-every 50 --seed 0 --no-progress)
OMP_NUM_THREADS=1 eaglespec train "${common[@]}" --out runs/drafter-eagle3.1 > runs/drafter-eagle3.1.log 2>&1 &
OMP_NUM_THREADS=1 eaglespec train "${common[@]}" --no-fc-norm --no-norm-output --out runs/drafter-eagle3 \
    > runs/drafter-eagle3.log 2>&1 &
wait
for v in eagle3.1 eagle3; do
    rm -rf "models/drafter-$v" && cp -r "runs/drafter-$v/final" "models/drafter-$v"
done
