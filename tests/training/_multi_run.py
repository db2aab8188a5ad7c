"""Several ``pretrain_lev.py`` runs in one torchrun job (one launch pays the imports once).

    torchrun --nproc-per-node N tests/training/_multi_run.py PLAN.json RESULT.json

PLAN.json is a list of {"name": ..., "argv": [...]}; the runs share the job's process group, one after
the other; RESULT.json (rank 0) maps each name to its exit code.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch.distributed as dist

from megatron_lev.training import pretrain


def main(plan_path: str, result_path: str) -> int:
    plan = json.loads(open(plan_path).read())
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    codes = {}
    for run in plan:
        codes[run["name"]] = pretrain(run["argv"])
        dist.barrier()
    if dist.get_rank() == 0:
        with open(result_path, "w") as f:
            json.dump(codes, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
