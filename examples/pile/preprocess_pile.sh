#!/usr/bin/env bash
# Tokenise The Pile (30 training shards 00..29.jsonl.zst, plus val/test) into megatron-core .bin/.idx.
# Multi-node: run the same command on every node with NNODES/NODE_RANK set (or under Slurm, where
# SLURM_NNODES/SLURM_NODEID are used); node r takes shards r, r+NNODES, ... Each shard becomes its own
# prefix (pile_NN_text_document), so no merge is needed: train with the blend written to
# $OUT/data_path.txt (--data-path "$(cat $OUT/data_path.txt)").
#
#   PILE=/data/pile OUT=/data/pile_o200k TOKENIZER=/data/tok/o200k_base.tiktoken WORKERS=32 \
#     NNODES=4 NODE_RANK=0 bash examples/pile/preprocess_pile.sh
#
# TOKENIZER: a .tiktoken rank file (o200k_base, the paper's vocabulary; TOKENIZER_TYPE=TikTokenizer) or
# TOKENIZER_TYPE=GPT2BPETokenizer with VOCAB_FILE/MERGE_FILE. Idempotent: finished shards are skipped.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
PILE=${PILE:?set PILE to the folder holding 00.jsonl.zst .. 29.jsonl.zst, val.jsonl.zst, test.jsonl.zst}
OUT=${OUT:?set OUT to the output folder}
WORKERS=${WORKERS:-$(nproc)}
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-TikTokenizer}
if [ "$TOKENIZER_TYPE" = GPT2BPETokenizer ]; then
  TOK=(--tokenizer-type GPT2BPETokenizer --vocab-file "${VOCAB_FILE:?}" --merge-file "${MERGE_FILE:?}")
else
  TOK=(--tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "${TOKENIZER:?set TOKENIZER}" --tiktoken-pattern o200k)
fi
mkdir -p "$OUT"

shards=()
for i in $(seq 0 29); do shards+=("$(printf '%02d' "$i")"); done
shards+=(val test)
for idx in "${!shards[@]}"; do
  [ $((idx % NNODES)) -eq "$NODE_RANK" ] || continue
  s=${shards[$idx]}
  prefix="$OUT/pile_$s"
  if [ -f "${prefix}_text_document.idx" ]; then echo "shard $s: done"; continue; fi
  echo "shard $s on node $NODE_RANK/$NNODES"
  "$PYTHON" tools/preprocess_data.py --input "$PILE/$s.jsonl.zst" --output-prefix "$prefix" "${TOK[@]}" \
    --append-eod --workers "$WORKERS" --output-token-counts --no-progress-bar
done

# The blend (equal weight per shard: megatron-core weights by the given numbers; Megatron-LM users
# usually give each shard weight 1, i.e. proportional sampling within the concatenation).
if [ "$NODE_RANK" -eq 0 ]; then
  : > "$OUT/data_path.txt"
  for i in $(seq 0 29); do printf '1 %s/pile_%02d_text_document ' "$OUT" "$i" >> "$OUT/data_path.txt"; done
  echo "train blend: $OUT/data_path.txt; validation: $OUT/pile_val_text_document; test: $OUT/pile_test_text_document"
fi
