#!/usr/bin/env bash
# Pretrain one arm at one scale on The Pile with torchrun (one node or many).
#
#   bash examples/pile/train.sh SCALE ARM        SCALE: 200m | 400m | 1.2b (examples/pile/configs/SCALE.yaml)
#                                                ARM:   tied | untied | albert | flat_mlp | factored_mlp | lev
# Environment: PILE_DATA (output folder of preprocess_pile.sh), TOKENIZER (.tiktoken rank file),
# TIKTOKEN_PATTERN (o200k), GPUS_PER_NODE (8), NNODES (1), NODE_RANK (0), MASTER_ADDR (localhost),
# MASTER_PORT (29500), CKPT_ROOT (checkpoints), EXTRA (more flags, e.g. "--wandb-project lev"; flags given
# in EXTRA override the YAML config), TORCHRUN (torchrun). RDZV_ID set: c10d rendezvous at
# MASTER_ADDR:MASTER_PORT under that id instead of NODE_RANK (what train.sbatch uses). DRY_RUN=1: check
# the inputs and print the command without running it. CUDA_DEVICE_MAX_CONNECTIONS: 1 unless set.
#
# Restarting the same command resumes from the latest complete checkpoint. SIGTERM (to torchrun, or to
# every process as Slurm does) makes the ranks save at the end of the current iteration and exit 0
# (--exit-signal-handler in the configs); torchrun itself then reports the signal and exits non-zero.
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT (100 s here, torchrun's default is 30 s) is how long torchrun waits for
# that save before it kills the ranks.
set -euo pipefail
cd "$(dirname "$0")/../.."
die() { echo "train.sh: error: $*" >&2; exit 2; }

ARMS="tied untied albert flat_mlp factored_mlp lev"
SCALES=$(cd examples/pile/configs && ls -- *.yaml | sed 's/\.yaml$//' | tr '\n' ' ')
[ $# -eq 2 ] || die "usage: train.sh SCALE ARM (SCALE: ${SCALES% }; ARM: $ARMS)"
SCALE=$1
ARM=$2
CONFIG="examples/pile/configs/$SCALE.yaml"
[ -f "$CONFIG" ] || die "unknown SCALE '$SCALE': no $CONFIG (choose one of ${SCALES% })"
[[ " $ARMS " == *" $ARM "* ]] || die "unknown ARM '$ARM' (choose one of $ARMS)"
[ -n "${PILE_DATA:-}" ] || die "set PILE_DATA to the preprocess_pile.sh output folder"
[ -f "$PILE_DATA/data_path.txt" ] ||
  die "PILE_DATA=$PILE_DATA has no data_path.txt: run preprocess_pile.sh (on every node) until it writes it"
[ -n "${TOKENIZER:-}" ] || die "set TOKENIZER to the o200k_base .tiktoken file"
[ -f "$TOKENIZER" ] || die "TOKENIZER=$TOKENIZER: no such file"
TORCHRUN=${TORCHRUN:-torchrun}
command -v "$TORCHRUN" >/dev/null || die "TORCHRUN=$TORCHRUN not found (activate the project's environment)"

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
CKPT_ROOT=${CKPT_ROOT:-checkpoints}
CKPT="$CKPT_ROOT/pile_${SCALE}_${ARM}"
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-100}
# megatron issues each tensor-parallel collective before the GEMM it overlaps with and relies on a single
# hardware queue to keep that order (Megatron-LM refuses TP without it before Blackwell; so does
# pretrain_lev.py). Set before torchrun, so every rank's CUDA context is created with it.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

if [ -n "${RDZV_ID:-}" ]; then
  LAUNCH=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID")
else
  LAUNCH=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
fi
ARM_FLAGS=(--input-embedding "$ARM")
# albert cannot be parameter-matched within 2% for a 200k vocabulary at D=1024/1280 (its count moves in
# steps of V + D): give the nearest width explicitly (see README.md's table).
if [ "$ARM" = albert ] && [ "$SCALE" != 1.2b ]; then ARM_FLAGS+=(--albert-dim 9); fi
# data_path.txt is one line of "weight prefix" pairs: word splitting makes them separate arguments.
read -r -a TRAIN_BLEND < "$PILE_DATA/data_path.txt" || true  # (no final newline)
[ ${#TRAIN_BLEND[@]} -gt 0 ] || die "$PILE_DATA/data_path.txt is empty: rerun preprocess_pile.sh"

CMD=("$TORCHRUN" --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" "${LAUNCH[@]}"
  pretrain_lev.py --config "$CONFIG" "${ARM_FLAGS[@]}"
  --train-data-path "${TRAIN_BLEND[@]}"
  --valid-data-path "$PILE_DATA/pile_val_text_document" --test-data-path "$PILE_DATA/pile_test_text_document"
  --tokenizer-type TikTokenizer --tokenizer-model "$TOKENIZER" --tiktoken-pattern "${TIKTOKEN_PATTERN:-o200k}"
  --data-cache-path "$CKPT_ROOT/index_cache"
  --save "$CKPT" --load "$CKPT" --tensorboard-dir "$CKPT/tensorboard")
# shellcheck disable=SC2206  # EXTRA is a list of flags, split on spaces
CMD+=(${EXTRA:-})
if [ "${DRY_RUN:-0}" = 1 ]; then echo "${CMD[*]}"; exit 0; fi
exec "${CMD[@]}"
