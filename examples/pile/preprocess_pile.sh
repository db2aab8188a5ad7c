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
# TOKENIZER: a .tiktoken rank file (o200k_base, the paper's vocabulary; TOKENIZER_TYPE=TikTokenizer,
# TIKTOKEN_PATTERN=o200k) or TOKENIZER_TYPE=GPT2BPETokenizer with VOCAB_FILE/MERGE_FILE.
# NUM_SHARDS (30): training shards 00..NUM_SHARDS-1. PYTHON (python): the interpreter to run.
#
# Restartable: a shard is done once its .idx exists (the tool writes under temporary names and renames
# the .bin, then the .idx, at the very end), so a rerun skips finished shards and redoes an interrupted
# one from scratch. data_path.txt is written by whichever node finds every shard done, so it never
# names a shard that is still being written.
set -euo pipefail
cd "$(dirname "$0")/../.."
die() { echo "preprocess_pile.sh: error: $*" >&2; exit 2; }

PYTHON=${PYTHON:-python}
[ -n "${PILE:-}" ] || die "set PILE to the folder holding 00.jsonl.zst .. 29.jsonl.zst, val.jsonl.zst, test.jsonl.zst"
[ -d "$PILE" ] || die "PILE=$PILE: no such folder"
[ -n "${OUT:-}" ] || die "set OUT to the output folder"
NUM_SHARDS=${NUM_SHARDS:-30}
WORKERS=${WORKERS:-$(nproc)}
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-TikTokenizer}
TIKTOKEN_PATTERN=${TIKTOKEN_PATTERN:-o200k}
[[ "$NNODES" =~ ^[1-9][0-9]*$ && "$NODE_RANK" =~ ^[0-9]+$ && "$NODE_RANK" -lt "$NNODES" ]] ||
  die "NODE_RANK=$NODE_RANK NNODES=$NNODES: need 0 <= NODE_RANK < NNODES"
[[ "$NUM_SHARDS" =~ ^[1-9][0-9]*$ ]] || die "NUM_SHARDS=$NUM_SHARDS: expected a positive number"
command -v "$PYTHON" >/dev/null || die "PYTHON=$PYTHON not found (activate the project's environment or set PYTHON)"

need_file() {  # need_file VAR: the variable must name an existing file
  [ -n "${!1:-}" ] || die "set $1 ($2)"
  [ -f "${!1}" ] || die "$1=${!1}: no such file"
}
if [ "$TOKENIZER_TYPE" = GPT2BPETokenizer ]; then
  need_file VOCAB_FILE "GPT-2 vocab.json"; need_file MERGE_FILE "GPT-2 merges.txt"
  TOK=(--tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
else
  need_file TOKENIZER "the .tiktoken rank file, e.g. o200k_base.tiktoken"
  TOK=(--tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER" --tiktoken-pattern "$TIKTOKEN_PATTERN")
fi

shards=()
for i in $(seq 0 $((NUM_SHARDS - 1))); do shards+=("$(printf '%02d' "$i")"); done
shards+=(val test)
missing=()
for s in "${shards[@]}"; do [ -f "$PILE/$s.jsonl.zst" ] || missing+=("$s.jsonl.zst"); done
[ ${#missing[@]} -eq 0 ] || die "PILE=$PILE lacks ${missing[*]} (NUM_SHARDS=$NUM_SHARDS training shards plus val, test)"
mkdir -p "$OUT"

done_shard() { [ -f "$OUT/pile_$1_text_document.idx" ] && [ -f "$OUT/pile_$1_text_document.bin" ]; }

for idx in "${!shards[@]}"; do
  [ $((idx % NNODES)) -eq "$NODE_RANK" ] || continue
  s=${shards[$idx]}
  if done_shard "$s"; then echo "shard $s: done, skipped"; continue; fi
  echo "shard $s: tokenising on node $NODE_RANK/$NNODES"
  # --overwrite: whatever an interrupted run left under this prefix is incomplete.
  "$PYTHON" tools/preprocess_data.py --input "$PILE/$s.jsonl.zst" --output-prefix "$OUT/pile_$s" "${TOK[@]}" \
    --append-eod --workers "$WORKERS" --output-token-counts --no-progress-bar --overwrite
done

# The blend (equal weight per shard: megatron-core weights by the given numbers; Megatron-LM users
# usually give each shard weight 1, i.e. proportional sampling within the concatenation).
pending=()
for s in "${shards[@]}"; do done_shard "$s" || pending+=("$s"); done
if [ ${#pending[@]} -gt 0 ]; then
  echo "node $NODE_RANK/$NNODES finished; shards still to do on other nodes: ${pending[*]} (the last node to finish writes $OUT/data_path.txt)"
  exit 0
fi
tmp=$(mktemp "$OUT/data_path.txt.XXXXXX")
for i in $(seq 0 $((NUM_SHARDS - 1))); do printf '1 %s/pile_%02d_text_document ' "$OUT" "$i"; done > "$tmp"
chmod 644 "$tmp"  # mktemp makes it private
mv -f "$tmp" "$OUT/data_path.txt"
echo "train blend: $OUT/data_path.txt; validation: $OUT/pile_val_text_document; test: $OUT/pile_test_text_document"
