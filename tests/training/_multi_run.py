"""Several ``pretrain_lev.py`` runs in one torchrun job (one launch pays the imports once).

    torchrun --nproc-per-node N tests/training/_multi_run.py PLAN.json RESULT.json

(the tests run it with ``megatron_lev.testing.run_torchrun``, whose ranks skip the imports too).

PLAN.json is a list of steps, run one after the other in the job's process group:

* {"name": ..., "argv": [...]}: a ``pretrain`` run, optionally with "copy_checkpoint": [src, iteration,
  dst]: before it, rank 0 copies iteration ``iteration`` of the checkpoint directory src into dst as
  dst's latest (a run stopped there, without stopping the run);
* {"name": ..., "rank0": "module:function", "args": [...]}: a function that rank 0 runs while the
  others wait (e.g. converting the checkpoints just written);
* {"name": ..., "call": "module:function", "args": [...], "tp": 1, "pp": 1}: a function every rank runs
  with megatron's parallel groups of that layout set up and its RNG tracker seeded (1234) as
  ``run_distributed`` does; each rank's return value is saved for the test.

Rank 0 prints ``MARKER name`` before each step, so that each step's output can be told apart;
RESULT.json (rank 0) maps each name to its exit code (0 for functions).

From a test: ``launch_plan(nproc, plan, workdir)`` -> {name: PlanRun(code, stdout, job_stderr, results)}.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the checkout's megatron_lev, and tests/ for the functions steps name

from megatron_lev.testing.cli import run_torchrun  # noqa: E402
from megatron_lev.training import pretrain  # noqa: E402

MARKER = "=== multi-run:"


def _copy_checkpoint(src: str, iteration: int, dst: str) -> None:
    name = f"iter_{iteration:07d}"
    os.makedirs(dst, exist_ok=True)
    shutil.copytree(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(f"{iteration}\n")


def _function(spec: str):
    import importlib

    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def _call(step: dict, rank: int, workdir: str) -> None:
    # The bootstrap run_distributed uses (CPU backend, groups, seed), so a call step does not depend on an
    # earlier pretrain step having installed the CPU backend; the job's default group is left as it is.
    from megatron_lev.distributed import destroy_distributed, init_distributed

    setup = init_distributed(tp=step.get("tp", 1), pp=step.get("pp", 1), backend="gloo", seed=1234)
    try:
        result = _function(step["call"])(*step.get("args", ()))
    finally:
        destroy_distributed(setup)
    torch.save(result, os.path.join(workdir, f"{step['name']}.rank{rank}.pt"))


def main(plan_path: str, result_path: str) -> int:
    plan = json.loads(open(plan_path).read())
    workdir = os.path.dirname(os.path.abspath(result_path))
    dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    rank = dist.get_rank()
    codes, seconds = {}, {}
    for step in plan:
        t0 = time.monotonic()
        if rank == 0:
            if step.get("copy_checkpoint"):
                _copy_checkpoint(*step["copy_checkpoint"])
            print(f"{MARKER} {step['name']}", flush=True)
            if step.get("rank0"):
                _function(step["rank0"])(*step.get("args", ()))
        dist.barrier()
        if step.get("argv") is not None:
            codes[step["name"]] = pretrain(step["argv"])
        elif step.get("call"):
            _call(step, rank, workdir)
            codes[step["name"]] = 0
        else:
            codes[step["name"]] = 0
        sys.stdout.flush()
        dist.barrier()
        seconds[step["name"]] = round(time.monotonic() - t0, 2)
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(codes, f)
        # each step's wall time, for finding what a test's job spends its time on
        with open(result_path + ".seconds", "w") as f:
            json.dump(seconds, f)
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------- test side


class PlanRun(NamedTuple):
    code: int  # pretrain()'s exit code
    stdout: str  # what the job printed during this run (rank 0 logs)
    job_stderr: str  # the whole job's stderr (for failure messages)
    results: Optional[List[Any]] = None  # a "call" step's return value on each rank


def launch_plan(nproc: int, plan: List[dict], workdir: Path, timeout: float = 900) -> Dict[str, PlanRun]:
    """Run ``plan`` in one ``nproc``-rank job, as torchrun would run it (``megatron_lev.testing.run_torchrun``:
    the ranks are forked from the process that imported torch and megatron-core once); the job itself must
    succeed (each run's exit code is returned for its test to check)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    plan_file, result_file = workdir / "plan.json", workdir / "codes.json"
    plan_file.write_text(json.dumps(plan))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = run_torchrun(Path(__file__).resolve(), [plan_file, result_file], nproc=nproc, env=env, timeout=timeout,
                     cwd=str(REPO))
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
    runs = {}
    for step in plan:
        name = step["name"]
        results = None
        if step.get("call"):
            results = [torch.load(workdir / f"{name}.rank{i}.pt", weights_only=False) for i in range(nproc)]
        runs[name] = PlanRun(codes[name], "".join(outs.get(name, [])), r.stderr, results)
    return runs


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
