"""The resume matrix: {distributed optimizer on/off} x {fp32, bf16, fp16} x {--decoupled-lr on/off} x {stopped
after a skipped step / after a normal one}. Every cell resumes bit-exact: the loss, grad norm and the
parameters' norm after the update of each iteration after the resume equal the uninterrupted run's.

Each of the 12 settings trains once for 3 iterations with a checkpoint after every one; iteration 1 is skipped
(a NaN loss injected: --nan-action skip in fp32 and bf16, the loss scaler's own skip in fp16, the NaN check
off), so the checkpoint of iteration 1 holds an optimizer that has not stepped yet and that of iteration 2 one
that has stepped once. Both are resumed to iteration 3. All 36 runs share one single-rank job (a tiny LEV
model on mock data).

The same checkpoints serve the resumes refused in one line: another --seq-length under learned positions (the
position table's shape), an optimizer state of other param groups (--decoupled-lr dropped), and a Ctrl-C while
the checkpoint is read (torch's CheckpointException, a BaseException, carries it out of the read); and their
uninterrupted runs are the reference for --decoupled-lr checkpoints saved before the decoupled param group was
marked. About 40 s of CPU in all (31 s for the job's 36 runs).
"""

from __future__ import annotations

import itertools
import re
import textwrap
from pathlib import Path

import pytest

from megatron_lev.testing import run_cli, train_records
from tests.training._multi_run import launch_plan
from tests.training.test_pretrain import PRETRAIN, REPO, _env

# The tests of the shared job (about 30 s of CPU): not in make test-fast.
slow = pytest.mark.slow

ITERS = 3
SKIPPED, NORMAL = 1, 2  # the iterations the resumes start from

PRECISIONS = {
    "fp32": ["--nan-action", "skip"],
    "bf16": ["--bf16", "--nan-action", "skip"],
    # The NaN reaches the gradients and the loss scaler skips the step and halves the scale.
    "fp16": ["--fp16", "--initial-loss-scale", "4096", "--hysteresis", "1", "--no-check-for-nan-in-loss-and-grad"],
}
OPTIMIZERS = {"local": [], "distopt": ["--use-distributed-optimizer"]}
DECOUPLED = {"lr": [], "decoupled": ["--decoupled-lr", "3e-3", "--decoupled-min-lr", "3e-4"]}
SETTINGS = list(itertools.product(OPTIMIZERS, PRECISIONS, DECOUPLED))


def _name(setting):
    return "-".join(setting)


def _args(setting, metrics: Path):
    opt, precision, decoupled = setting
    return ["--input-embedding", "lev", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
            # 128 tokens: the mock data's shuffle index is a sample per 128 of its 2e8 tokens (at 16, 0.8 s a split)
            "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", str(ITERS),
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
            "--mock-data", "--vocab-size", "128", "--log-interval", "1", "--log-params-norm", "--eval-iters", "0",
            "--quiet-config",
            "--inject-nan-at-iteration", "1", "--metrics-file", str(metrics),
            *OPTIMIZERS[opt], *PRECISIONS[precision], *DECOUPLED[decoupled]]


def _logged(stdout: str):
    """{iteration: (loss scale, skipped iterations so far)} from the log lines."""
    found = re.findall(r" iteration +(\d+)/.*?\| loss scale: ([^ ]+) \|.*?\| number of skipped iterations: +(\d+) \|",
                       stdout)
    return {int(it): (scale, int(skipped)) for it, scale, skipped in found}


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
    # Learned absolute positions (the default), their table sized by --seq-length.
    plan.append({"name": "longer-sequences", "argv": _args(SETTINGS[0], work / "longer.jsonl")
                 + ["--load", str(work / _name(SETTINGS[0])), "--seq-length", "256"]})
    # The local optimizer's --decoupled-lr checkpoint without --decoupled-lr: a param group fewer.
    plan.append({"name": "without-decoupled", "argv": _args(("local", "fp32", "lr"), work / "without.jsonl")
                 + ["--load", str(work / _name(("local", "fp32", "decoupled"))), "--ckpt-step", str(NORMAL)]})
    return work, launch_plan(1, plan, work / "job")


@slow
@pytest.mark.parametrize("setting", SETTINGS, ids=_name)
def test_every_cell_resumes_bit_exact(matrix, setting):
    work, runs = matrix
    name = _name(setting)
    for run in ("full", f"from{SKIPPED}", f"from{NORMAL}"):
        assert runs[f"{name}/{run}"].code == 0, runs[f"{name}/{run}"].stdout[-3000:]
    full = train_records(work / f"{name}.full.jsonl")
    # The setting is what the cells say: iteration 1 skipped, 2 and 3 applied.
    assert [full[i]["skipped"] for i in range(1, ITERS + 1)] == [True, False, False], full
    full_log = _logged(runs[f"{name}/full"].stdout)
    assert sorted(full_log) == list(range(1, ITERS + 1)), runs[f"{name}/full"].stdout[-2000:]
    for start in (SKIPPED, NORMAL):
        # The loss scaler's state and the counters continue too.
        resumed_log = _logged(runs[f"{name}/from{start}"].stdout)
        assert resumed_log == {it: full_log[it] for it in range(start + 1, ITERS + 1)}
        resumed = train_records(work / f"{name}.from{start}.jsonl")
        assert f"successfully loaded checkpoint" in runs[f"{name}/from{start}"].stdout
        assert sorted(resumed) == list(range(start + 1, ITERS + 1))
        for it in resumed:
            got, want = resumed[it], full[it]
            keys = ("lm loss hex", "grad norm", "params norm", "lr")  # the params norm: after the step's update
            assert [got[k] for k in keys] == [want[k] for k in keys], \
                f"{name}, resumed from iteration {start}: iteration {it} differs ({got} vs {want})"


def _error_lines(text: str):
    return [line for line in text.splitlines() if line.startswith("error:") or "Traceback" in line]


@slow
def test_another_seq_length_under_learned_positions_is_refused_in_one_line(matrix):
    work, runs = matrix
    ck = work / _name(SETTINGS[0])
    run = runs["longer-sequences"]
    assert run.code == 2
    line = (f"error: {ck / 'iter_0000003'} was saved with --max-position-embeddings 128 but this run has "
            f"--max-position-embeddings 256 (the learned position table has a row per position; it defaults to "
            f"--seq-length); give the checkpoint's setting")
    assert line in run.job_stderr.splitlines()
    assert "Global shape mismatch" not in run.job_stderr


@slow
def test_an_optimizer_state_of_other_param_groups_is_refused_in_one_line(matrix):
    work, runs = matrix
    run = runs["without-decoupled"]
    assert run.code == 2
    path = work / _name(("local", "fp32", "decoupled")) / f"iter_{NORMAL:07d}"
    lines = [line for line in run.job_stderr.splitlines() if line.startswith(f"error: {path}")]
    assert lines == [f"error: {path}: its optimizer state does not fit this run's parameter groups (ValueError: Cannot "
                     "merge two lists with different lengths (4 and 2, encountered at level ('optimizer', "
                     "'param_groups'))); give "
                     "the checkpoint's optimizer settings (--decoupled-lr, --decoupled-min-lr, --lr, --min-lr), or "
                     "pass --no-load-optim to start the optimizer afresh"], \
        [line for line in run.job_stderr.splitlines() if line.startswith("error:")]


@slow
def test_ctrl_c_while_a_resume_reads_its_checkpoint_is_one_line(matrix, tmp_path):
    """The read is interrupted inside torch's checkpoint load, which hands it on wrapped in its
    CheckpointException (a BaseException that escaped the handlers around the load: a 60-78 line traceback)."""
    work, _ = matrix
    ck = work / _name(SETTINGS[0])
    script = tmp_path / "pretrain_interrupted_read.py"
    script.write_text(textwrap.dedent(f"""
        import runpy
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        def read_data(self, plan, planner):
            raise KeyboardInterrupt  # Ctrl-C while the shards are read

        FileSystemReader.read_data = read_data
        runpy.run_path({PRETRAIN!r}, run_name="__main__")
    """))
    r = run_cli(script, _args(SETTINGS[0], tmp_path / "m.jsonl") + ["--load", str(ck)], env=_env(), cwd=str(REPO),
                timeout=300)
    assert r.returncode == 130, r.stderr[-3000:]
    assert _error_lines(r.stderr) == [
        f"error: interrupted (Ctrl-C) during start-up, before training started; the last checkpoint is iteration 3 "
        f"({ck / 'iter_0000003'}; resume with --load {ck})"], r.stderr


def test_the_read_hands_on_what_torch_wraps(monkeypatch):
    """checkpoint's read of a dist checkpoint: a Ctrl-C inside torch's CheckpointException comes out as the
    KeyboardInterrupt it was, any other failure as an Exception with the failing rank's first line."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_lev.checkpoint import sharded

    def failing(error):
        def load(*_a, **_kw):
            raise CheckpointException("read", {0: (error, None)})
        return load

    monkeypatch.setattr(dist_checkpointing, "load", failing(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        sharded._read({}, "ck")
    monkeypatch.setattr(dist_checkpointing, "load", failing(KeyError("optimizer.state.exp_avg.x not in state dict")))
    with pytest.raises(sharded.CheckpointReadError) as e:
        sharded._read({}, "ck")
    assert str(e.value) == "KeyError: 'optimizer.state.exp_avg.x not in state dict'"


def test_a_checkpoint_without_adam_moments_loads_into_an_empty_state():
    """A checkpoint of an optimizer that had not stepped, written before its zero moments were saved, holds
    no optimizer.state.exp_avg*: the load leaves the moments out (Adam creates them at its first step) instead
    of asking for keys the checkpoint lacks; a checkpoint that holds some of them is loaded as asked."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_lev.checkpoint.sharded import _drop_unsaved_moments

    def tensor(key):
        return ShardedTensor.from_rank_offsets(key, torch.zeros(2))

    def optim_state():
        return {"optimizer": {"state": {0: {"exp_avg": tensor("optimizer.state.exp_avg.w"),
                                            "exp_avg_sq": tensor("optimizer.state.exp_avg_sq.w")}},
                              "param_groups": [{"params": [0]}]},
                "fp32_from_fp16_params": [[tensor("optimizer.state.fp32_param.w")]]}

    never_stepped = optim_state()
    _drop_unsaved_moments(never_stepped, {"w", "optimizer.state.fp32_param.w"})
    assert never_stepped["optimizer"]["state"] == {0: {}}
    assert never_stepped["fp32_from_fp16_params"][0][0].key == "optimizer.state.fp32_param.w"
    stepped = optim_state()
    _drop_unsaved_moments(stepped, {"w", "optimizer.state.fp32_param.w", "optimizer.state.exp_avg.w"})
    assert sorted(stepped["optimizer"]["state"][0]) == ["exp_avg", "exp_avg_sq"]


@slow
def test_a_decoupled_lr_checkpoint_of_the_unmarked_groups_resumes_bit_exact(matrix, tmp_path):
    """A --decoupled-lr checkpoint saved while the decoupled param group was not yet marked is_decoupled_lr
    (the group megatron-core did not tell from the default one on a load) resumes as the marked ones do."""
    work, _ = matrix
    cases = [s for s in SETTINGS if s[1:] == ("fp32", "decoupled")]
    saves = [_args(s, tmp_path / f"{_name(s)}.saved.jsonl") + ["--save", str(tmp_path / _name(s)), "--save-interval",
                                                                str(NORMAL)] for s in cases]
    resumes = [_args(s, tmp_path / f"{_name(s)}.resumed.jsonl") + ["--load", str(tmp_path / _name(s)), "--ckpt-step",
                                                                    str(NORMAL)] for s in cases]
    script = tmp_path / "unmarked_then_resumed.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from megatron_lev.parallel import weight_decay
        from megatron_lev.training import pretrain

        marked, weight_decay._marked_decoupled = weight_decay._marked_decoupled, lambda override: override
        codes = [pretrain(argv) for argv in {saves!r}]
        weight_decay._marked_decoupled = marked
        codes += [pretrain(argv) for argv in {resumes!r}]
        sys.exit(max(codes))
    """))
    r = run_cli(script, [], env=_env(), cwd=str(REPO), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for setting in cases:
        full = train_records(work / f"{_name(setting)}.full.jsonl")
        resumed = train_records(tmp_path / f"{_name(setting)}.resumed.jsonl")
        assert sorted(resumed) == [3]
        assert [resumed[3][k] for k in ("lm loss hex", "grad norm", "params norm")] == \
            [full[3][k] for k in ("lm loss hex", "grad norm", "params norm")], setting
