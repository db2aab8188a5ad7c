#!/usr/bin/env bash
# Pretrain one arm at one scale on The Pile with torchrun (one node or many).
#
#   bash examples/pile/train.sh SCALE ARM        SCALE: 200m | 400m | 1.2b
#                                                ARM:   tied | untied | albert | flat_mlp | factored_mlp | lev
# Environment: PILE_DATA (output folder of preprocess_pile.sh), TOKENIZER (.tiktoken rank file),
# GPUS_PER_NODE (8), NNODES (1), NODE_RANK (0), MASTER_ADDR (localhost), MASTER_PORT (29500),
# CKPT_ROOT (checkpoints), EXTRA (more flags, e.g. "--wandb-project lev"). Flags given in EXTRA
# override the YAML config. Restarting the same command resumes from the latest complete checkpoint.
set -euo pipefail
cd "$(dirname "$0")/../.."
SCALE=${1:?usage: train.sh SCALE ARM}
ARM=${2:?usage: train.sh SCALE ARM}
PILE_DATA=${PILE_DATA:?set PILE_DATA to the preprocess_pile.sh output folder}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the o200k_base .tiktoken file}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
CKPT_ROOT=${CKPT_ROOT:-checkpoints}
RUN="pile_${SCALE}_${ARM}"
CKPT="$CKPT_ROOT/$RUN"

ARM_FLAGS=(--input-embedding "$ARM")
# albert cannot be parameter-matched within 2% for a 200k vocabulary at D=1024/1280 (its count moves in
# steps of V + D): give the nearest width explicitly (see README.md's table).
if [ "$ARM" = albert ] && [ "$SCALE" != 1.2b ]; then ARM_FLAGS+=(--albert-dim 9); fi

exec torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  pretrain_lev.py --config "examples/pile/configs/$SCALE.yaml" "${ARM_FLAGS[@]}" \
  --train-data-path $(cat "$PILE_DATA/data_path.txt") \
  --valid-data-path "$PILE_DATA/pile_val_text_document" --test-data-path "$PILE_DATA/pile_test_text_document" \
  --tokenizer-type TikTokenizer --tokenizer-model "$TOKENIZER" --tiktoken-pattern o200k \
  --data-cache-path "$CKPT_ROOT/index_cache" \
  --save "$CKPT" --load "$CKPT" --tensorboard-dir "$CKPT/tensorboard" ${EXTRA:-}
