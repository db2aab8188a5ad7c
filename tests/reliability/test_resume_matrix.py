"""The resume matrix: {distributed optimizer on/off} x {fp32, bf16, fp16} x {--decoupled-lr on/off} x {stopped
after a skipped step / after a normal one}. Every cell resumes bit-exact: the loss, grad norm and the
parameters' norm after the update of each iteration after the resume equal the uninterrupted run's.

Each of the 12 settings trains once for 3 iterations with a checkpoint after every one; iteration 1 is skipped
(a NaN loss injected: --nan-action skip in fp32 and bf16, the loss scaler's own skip in fp16, the NaN check
off), so the checkpoint of iteration 1 holds an optimizer that has not stepped yet and that of iteration 2 one
that has stepped once. Both are resumed to iteration 3. All 36 runs share one single-rank job (a tiny LEV
model on mock data).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from tests.training._multi_run import launch_plan

ITERS = 3
SKIPPED, NORMAL = 1, 2  # the iterations the resumes start from

PRECISIONS = {
    "fp32": ["--nan-action", "skip"],
    "bf16": ["--bf16", "--nan-action", "skip"],
    # The NaN reaches the gradients and the loss scaler skips the step (and halves the scale).
    "fp16": ["--fp16", "--initial-loss-scale", "4096", "--no-check-for-nan-in-loss-and-grad"],
}
OPTIMIZERS = {"local": [], "distopt": ["--use-distributed-optimizer"]}
DECOUPLED = {"lr": [], "decoupled": ["--decoupled-lr", "3e-3", "--decoupled-min-lr", "3e-4"]}
SETTINGS = list(itertools.product(OPTIMIZERS, PRECISIONS, DECOUPLED))


def _name(setting):
    return "-".join(setting)


def _args(setting, metrics: Path):
    opt, precision, decoupled = setting
    return ["--input-embedding", "lev", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(ITERS),
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
            "--mock-data", "--vocab-size", "128", "--log-interval", "1", "--log-params-norm", "--eval-iters", "0",
            "--quiet-config",
            "--inject-nan-at-iteration", "1", "--metrics-file", str(metrics),
            *OPTIMIZERS[opt], *PRECISIONS[precision], *DECOUPLED[decoupled]]


def _train_rows(path: Path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["iteration"]: r for r in rows if r["kind"] == "train"}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    work = tmp_path_factory.mktemp("resume_matrix")
    plan = []
    for setting in SETTINGS:
        name, ck = _name(setting), work / _name(setting)
        plan.append({"name": f"{name}/full", "argv": _args(setting, work / f"{name}.full.jsonl") + [
            "--save", str(ck), "--save-interval", "1"]})
        for start in (SKIPPED, NORMAL):
            plan.append({"name": f"{name}/from{start}", "argv": _args(setting, work / f"{name}.from{start}.jsonl")
                         + ["--load", str(ck), "--ckpt-step", str(start)]})
    return work, launch_plan(1, plan, work / "job")


@pytest.mark.parametrize("setting", SETTINGS, ids=_name)
def test_every_cell_resumes_bit_exact(matrix, setting):
    work, runs = matrix
    name = _name(setting)
    for run in ("full", f"from{SKIPPED}", f"from{NORMAL}"):
        assert runs[f"{name}/{run}"].code == 0, runs[f"{name}/{run}"].stdout[-3000:]
    full = _train_rows(work / f"{name}.full.jsonl")
    # The setting is what the cells say: iteration 1 skipped, 2 and 3 applied.
    assert [full[i]["skipped"] for i in range(1, ITERS + 1)] == [True, False, False], full
    for start in (SKIPPED, NORMAL):
        resumed = _train_rows(work / f"{name}.from{start}.jsonl")
        assert f"successfully loaded checkpoint" in runs[f"{name}/from{start}"].stdout
        assert sorted(resumed) == list(range(start + 1, ITERS + 1))
        for it in resumed:
            got, want = resumed[it], full[it]
            keys = ("lm loss hex", "grad norm", "params norm", "lr")  # the params norm: after the step's update
            assert [got[k] for k in keys] == [want[k] for k in keys], \
                f"{name}, resumed from iteration {start}: iteration {it} differs ({got} vs {want})"
