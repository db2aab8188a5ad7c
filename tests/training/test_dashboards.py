"""Dashboards made for Megatron-LM work on this project's runs: TensorBoard gets Megatron-LM's tags
(``megatron/training/training.py``: ``lm loss validation``, ``throughput``, the ``... vs samples`` tags
against the consumed samples), and wandb, from the last rank as in Megatron-LM, the same scalars. wandb
itself is never installed or reached here: a stand-in module records what the run gives it."""

from __future__ import annotations

import os

import pytest

from megatron_lev.arguments import parse_args
from megatron_lev.lev.config import ConfigError

MODEL = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-3",
         "--mock-data", "--vocab-size", "1000", "--quiet-config"]

# What Megatron-LM's training_log and evaluate_and_print_results write with these flags (--log-interval 2
# --tensorboard-log-interval 1 --log-timers-to-tensorboard --log-validation-ppl-to-tensorboard
# --log-world-size-to-tensorboard --log-params-norm).
MEGATRON_LM_TAGS = {
    "lm loss", "learning-rate", "batch-size", "loss-scale", "world-size", "grad-norm", "params-norm",
    "lm loss validation", "lm loss validation ppl", "iteration-time", "throughput"}
VS_SAMPLES = MEGATRON_LM_TAGS - {"iteration-time", "throughput"}


def _train_with_a_wandb_stand_in(argv):
    """pretrain on this rank with a stand-in ``wandb`` module (WANDB_MODE=offline: the run's files stay in its
    folder); what each rank gave wandb."""
    import sys
    import types

    from megatron_lev.training import pretrain

    calls = {"init": [], "log": [], "config": 0, "finish": 0}

    class Run:
        def __init__(self):
            self.config = types.SimpleNamespace(update=self._config)

        def _config(self, cfg, allow_val_change=False):
            calls["config"] += len(cfg)

        def log(self, data, step=None):
            calls["log"].append((step, dict(data)))

        def finish(self):
            calls["finish"] += 1

    def init(**kwargs):
        calls["init"].append(kwargs)
        os.makedirs(os.path.join(kwargs["dir"], "wandb", "offline-run"), exist_ok=True)
        return Run()

    module = types.ModuleType("wandb")
    module.init = init
    sys.modules["wandb"] = module
    os.environ["WANDB_MODE"] = "offline"
    try:
        calls["code"] = pretrain(argv)
    finally:
        del sys.modules["wandb"]
        del os.environ["WANDB_MODE"]
    return calls


def test_tensorboard_has_megatron_lm_tags_and_the_last_rank_logs_the_same_scalars_to_wandb(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_lev.testing import run_distributed

    argv = MODEL + ["--eval-interval", "2", "--eval-iters", "1", "--log-interval", "2",
                    "--tensorboard-dir", str(tmp_path / "tb"), "--log-timers-to-tensorboard",
                    "--log-validation-ppl-to-tensorboard", "--log-world-size-to-tensorboard", "--log-params-norm",
                    "--wandb-project", "p", "--wandb-exp-name", "e", "--wandb-entity", "team",
                    "--wandb-save-dir", str(tmp_path / "wb")]
    first, last = run_distributed(_train_with_a_wandb_stand_in, 2, args=(argv,))  # DP=2
    assert first["code"] == last["code"] == 0
    assert not first["init"] and not first["log"]  # wandb from the last rank alone, as Megatron-LM
    assert last["init"] == [{"project": "p", "name": "e", "dir": str(tmp_path / "wb"), "config": None,
                             "entity": "team"}]
    assert last["config"] > 100 and last["finish"] == 1  # the resolved arguments; closed at the end
    assert (tmp_path / "wb" / "wandb" / "offline-run").is_dir()

    tb = EventAccumulator(str(tmp_path / "tb")).Reload()
    tags = set(tb.Tags()["scalars"])
    want = MEGATRON_LM_TAGS | {f"{t} vs samples" for t in VS_SAMPLES}
    assert want <= tags, sorted(want - tags)
    assert {"validation/lm loss", "throughput-tflops-per-device"} <= tags  # this project's own stay beside them
    # "vs samples": the consumed samples (global batch 4 per iteration) on the x-axis, the same values.
    for tag in VS_SAMPLES:
        by_step = tb.Scalars(tag)
        by_samples = tb.Scalars(f"{tag} vs samples")
        assert [e.step * 4 for e in by_step] == [e.step for e in by_samples], tag
        assert [e.value for e in by_step] == [e.value for e in by_samples], tag
    assert [e.step for e in tb.Scalars("lm loss")] == [1, 2, 3, 4]
    assert [e.step for e in tb.Scalars("lm loss validation")] == [2, 4]
    assert [e.step for e in tb.Scalars("throughput")] == [2, 4]
    assert [e.value for e in tb.Scalars("throughput")] == [e.value for e in tb.Scalars("throughput-tflops-per-device")]

    # wandb: every TensorBoard scalar but the "vs samples" ones, at the same steps with the same values (the
    # timings are each rank's own), and Megatron-LM's "samples vs steps".
    timings = {"iteration-time", "throughput", "throughput-tflops-per-device", "tokens-per-second"}
    logged = {}
    for step, data in last["log"]:
        for k, v in data.items():
            logged.setdefault(k, {})[step] = v
    assert set(logged) == {t for t in tags if not t.endswith(" vs samples")} | {"samples vs steps"}
    for tag in logged.keys() - {"samples vs steps"}:
        assert [e.step for e in tb.Scalars(tag)] == sorted(logged[tag]), tag
        if tag not in timings:
            assert {e.step: pytest.approx(e.value, rel=1e-6) for e in tb.Scalars(tag)} == logged[tag], tag
    assert logged["samples vs steps"] == {1: 4, 2: 8, 3: 12, 4: 16}


def test_wandb_flags_without_wandb_installed_or_without_a_project_are_refused_in_one_line(monkeypatch):
    import sys

    from megatron_lev.config.groups import LoggingConfig
    from megatron_lev.training.logger import LogWriterError, TrainingLogger

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: its import raises ImportError
    with pytest.raises(LogWriterError) as e:
        TrainingLogger(LoggingConfig(wandb_project="p"))
    assert str(e.value) == "--wandb-project p: the wandb package is not installed; pip install wandb, or drop the " \
                           "--wandb-* flags"
    for flag in ("--wandb-exp-name", "--wandb-save-dir", "--wandb-entity"):
        with pytest.raises(ConfigError) as e:
            parse_args(MODEL + [flag, "x"], world_size=1)
        assert str(e.value) == f"{flag} needs --wandb-project (nothing is logged to wandb without a project)"
