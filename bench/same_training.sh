#!/usr/bin/env bash
# The same training before and after a change: a short run of every input arm (tied, untied, lev, albert,
# flat_mlp, factored_mlp on one rank) and a TP=2 lev run (sequence parallelism, the distributed optimizer,
# bf16) from git revision BASE and from the work tree, with the same flags; then each run's per-iteration
# loss (exact, as hex), grad norm and learning rate, the validation losses and the saved config.yaml are
# compared. A refactor must print "same" for every run.
#
#   bash bench/same_training.sh BASE [OUT]      (e.g. bash bench/same_training.sh origin/main)
#
# Runs on the CPU in about a minute per tree (mock data, 2 layers, hidden 64, 6 iterations).
set -euo pipefail
base=${1:?usage: bash bench/same_training.sh BASE [OUT]}
out=${2:-$(mktemp -d)}
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
git -C "$here" worktree add -f --detach "$out/base-tree" "$base" >/dev/null
trap 'git -C "$here" worktree remove --force "$out/base-tree"' EXIT
common="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2
 --global-batch-size 4 --train-iters 6 --lr 1e-3 --lr-decay-style cosine --lr-warmup-iters 1 --mock-data
 --vocab-size 1000 --tokenizer-type NullTokenizer --log-interval 1 --eval-interval 3 --eval-iters 1 --quiet-config
 --hidden-dropout 0 --attention-dropout 0 --lev-seed-dim 16 --lev-rank 8 --lev-heads 2 --lev-knots 8
 --save-interval 3 --seed 7"
train() {  # TREE NAME LAUNCHER FLAGS...: one run of TREE's pretrain_lev.py into $out/NAME/<tree>
  local tree=$1 dir=$out/$2/$(basename "$1") launcher=$3; shift 3
  mkdir -p "$dir"
  PYTHONPATH="$tree" $launcher "$tree/pretrain_lev.py" $common "$@" --save "$dir/ck" \
    --metrics-file "$dir/metrics.jsonl" > "$dir/log.txt" 2>&1 || { echo "failed: $dir (see $dir/log.txt)"; exit 1; }
}
for tree in "$out/base-tree" "$here"; do
  for arm in tied untied lev albert flat_mlp factored_mlp; do
    extra=""; [ "$arm" = albert ] && extra="--albert-dim 4"  # no width matches LEV's within 2% at this size
    train "$tree" "$arm" "$py" --input-embedding "$arm" $extra
  done
  train "$tree" tp2 "$py -m torch.distributed.run --nproc-per-node 2 --master-port 29613" \
    --input-embedding lev --tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer --bf16
done
"$py" - "$out" "$(basename "$out/base-tree")" "$(basename "$here")" <<'PY'
import json, sys
from pathlib import Path
out, a, b = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
key = lambda r: (r.get("kind"), r.get("iteration"), r.get("lm loss hex"), r.get("grad norm"), r.get("lr"))
ok = True
for run in ("tied", "untied", "lev", "albert", "flat_mlp", "factored_mlp", "tp2"):
    recs = [[key(json.loads(l)) for l in open(out / run / t / "metrics.jsonl")] for t in (a, b)]
    # config.yaml as text (a value written as 1000.0 instead of 1000 differs), the paths apart.
    text = [[line for line in open(out / run / t / "ck" / "iter_0000006" / "config.yaml")
             if not line.startswith(("save:", "metrics_file:"))] for t in (a, b)]
    differ = [line.strip() for line in text[1] if line not in text[0]]
    same = recs[0] == recs[1] and not differ
    ok &= same
    print(f"{run}: {'same' if same else 'DIFFERENT'} ({len(recs[0])} records"
          f"{'' if recs[0] == recs[1] else ', losses differ'}{', config.yaml differs in ' + str(differ) if differ else ''})")
sys.exit(0 if ok else 1)
PY
