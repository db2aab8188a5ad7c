"""Several ``pretrain_lev.py`` runs in one torchrun job (one launch pays the imports once).

    torchrun --nproc-per-node N tests/training/_multi_run.py PLAN.json RESULT.json

PLAN.json is a list of {"name": ..., "argv": [...]}, optionally with "copy_checkpoint": [src, iteration,
dst]: before that run, rank 0 copies iteration ``iteration`` of the checkpoint directory src into dst
as dst's latest (a run stopped there, without stopping the run). The runs share the job's process
group, one after the other; rank 0 prints ``MARKER name`` before each, so that each run's output
can be told apart; RESULT.json (rank 0) maps each name to its exit code.

From a test: ``launch_plan(nproc, plan, workdir)`` -> {name: PlanRun(code, stdout)}.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Dict, List, NamedTuple

import torch.distributed as dist

from megatron_lev.training import pretrain

REPO = Path(__file__).resolve().parents[2]
MARKER = "=== multi-run:"


def _copy_checkpoint(src: str, iteration: int, dst: str) -> None:
    name = f"iter_{iteration:07d}"
    os.makedirs(dst, exist_ok=True)
    shutil.copytree(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(f"{iteration}\n")


def main(plan_path: str, result_path: str) -> int:
    plan = json.loads(open(plan_path).read())
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    rank0 = dist.get_rank() == 0
    codes = {}
    for run in plan:
        if rank0:
            if run.get("copy_checkpoint"):
                _copy_checkpoint(*run["copy_checkpoint"])
            print(f"{MARKER} {run['name']}", flush=True)
        dist.barrier()
        codes[run["name"]] = pretrain(run["argv"])
        sys.stdout.flush()
        dist.barrier()
    if rank0:
        with open(result_path, "w") as f:
            json.dump(codes, f)
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------- test side


class PlanRun(NamedTuple):
    code: int  # pretrain()'s exit code
    stdout: str  # what the job printed during this run (rank 0 logs)
    job_stderr: str  # the whole job's stderr (for failure messages)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_plan(nproc: int, plan: List[dict], workdir: Path, timeout: float = 900) -> Dict[str, PlanRun]:
    """Run ``plan`` in one ``nproc``-rank torchrun job; the job itself must succeed (each run's exit
    code is returned for its test to check)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    plan_file, result_file = workdir / "plan.json", workdir / "codes.json"
    plan_file.write_text(json.dumps(plan))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(_free_port()), str(Path(__file__).resolve()), str(plan_file), str(result_file)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=str(REPO))
    assert r.returncode == 0, f"STDOUT:\n{r.stdout[-4000:]}\nSTDERR:\n{r.stderr[-6000:]}"
    codes = json.loads(result_file.read_text())
    outs: Dict[str, List[str]] = {}
    current = None
    for line in r.stdout.splitlines(keepends=True):
        if line.startswith(MARKER):
            current = line[len(MARKER):].strip()
            outs[current] = []
        elif current is not None:
            outs[current].append(line)
    return {name: PlanRun(codes[name], "".join(outs.get(name, [])), r.stderr) for name in codes}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
