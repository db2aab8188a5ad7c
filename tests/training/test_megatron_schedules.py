"""Megatron-LM's schedule, loss and run-hygiene flags through ``pretrain_lev.py``:

- ``--train-samples N`` trains exactly as ``--train-iters N/B`` (bit for bit), the sample-based LR
  schedule included; a growing batch size (megatron-core's calculator: ``--rampup-batch-size`` up to
  0.17, ``--step-batch-size-schedule`` from 0.18) resumes bit-exactly from a checkpoint in the middle of
  the schedule;
- ``--decoupled-lr``/``--decoupled-min-lr`` reach the LEV input arm and the output layer, nothing else;
- ``--calculate-per-token-loss`` normalises by the global token count: with unequal loss-mask counts per
  micro-batch the step no longer depends on how the batch is split (the default does), and with full
  masks it equals the default;
- ``--profile --use-pytorch-profiler`` writes a torch.profiler trace on CPU; ``--manual-gc*``,
  ``--empty-unused-memory-level`` and ``--logging-level`` do what they do in Megatron-LM;
- the flags that do not apply are refused in one line.

The two-rank runs share one job (tests/training/_multi_run.py, run as torchrun runs it); the counted one-process runs
share one process (tests/training/_counted_run.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lev.arguments import parse_args
from megatron_lev.compat.versions import batch_size_calculator
from megatron_lev.lev.config import ConfigError
from tests.training._multi_run import launch_plan

# Its tests share multi-process jobs (~54 s for the module on 2 cores): not in make test-fast.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

LEV = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
       "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--hidden-dropout", "0",
       "--attention-dropout", "0", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
       "--quiet-config", "--input-embedding", "lev", "--lev-seed-dim", "16", "--lev-rank", "8",
       "--lev-heads", "2", "--lev-knots", "8"]
MOCK = ["--mock-data", "--vocab-size", "1000"]


def _metrics(path, kind="train"):
    rows = [json.loads(ln) for ln in Path(path).read_text().splitlines()]
    return {r["iteration"]: r for r in rows if r["kind"] == kind}


# ------------------------------------------------------------------------------------------ parsing


def _parse(extra, world=1):
    return parse_args(LEV + MOCK + ["--micro-batch-size", "2"] + extra, world_size=world)


def test_train_samples_derive_iterations_and_sample_schedule():
    a = _parse(["--train-samples", "80", "--global-batch-size", "8", "--lr-warmup-samples", "16"])
    assert (a.train_iters, a.lr_decay_samples, a.lr_decay_iters) == (10, 80, None)
    # A partial last batch is dropped (Megatron-LM's update_train_iters).
    assert _parse(["--train-samples", "87", "--global-batch-size", "8"]).train_iters == 10


# megatron-core 0.16/0.17 ramp up the batch size, 0.18 on step it (the ramp-up calculator is gone): the
# batch-size schedule tests take the one the installed megatron-core has.
HAS_RAMPUP = batch_size_calculator("rampup") is not None


def test_batch_size_schedule_iterations_are_megatron_lms():
    """Batches 2, 2, 4, 6 (up to 14 samples), then 8: the ramp-up 2 -> 8 by 2 over 12 samples (4 samples
    per increment; the ramp phase ends past 12 samples), or the step schedule of the same batches."""
    from megatron_lev.arguments.schedule import batch_sizes

    if HAS_RAMPUP:
        a = _parse(["--train-samples", "60", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "12"])
        # Megatron-LM's update_train_iters: the ramp phase, then whole batches of 8 (a partial one dropped).
        iterations = 4 + (60 - 14) // 8
    else:
        a = _parse(["--train-samples", "60", "--step-batch-size-schedule", "0:2 128:4 256:6 384:8"])  # seq 32
        # Megatron-LM's update_train_iters: steps while fewer than --train-samples are consumed.
        iterations = 4 + -(-(60 - 14) // 8)
    got = [bs for _, bs in batch_sizes(a, a.data_parallel_size, a.seq_length, iterations=a.train_iters)]
    assert got[:4] == [2, 2, 4, 6] and set(got[4:]) == {8}
    assert a.global_batch_size == 8 and a.train_iters == iterations and a.num_microbatches == 4


@pytest.mark.parametrize("extra, flag", [
    (["--train-iters", "5", "--rampup-batch-size", "2", "2", "12"], "--rampup-batch-size needs --train-samples"),
    (["--train-samples", "64", "--rampup-batch-size", "2", "2", "12", "--step-batch-size-schedule", "0:8"],
     "give only one of --rampup-batch-size and --step-batch-size-schedule"),
    (["--train-iters", "5", "--lr-warmup-samples", "8"], "--lr-warmup-samples goes with --train-samples"),
    (["--train-samples", "64", "--lr-decay-iters", "3"], "--lr-decay-iters goes with --train-iters"),
    (["--train-samples", "64", "--lr-wsd-decay-iters", "3"], "--lr-wsd-decay-iters goes with --train-iters"),
    (["--train-samples", "64", "--global-batch-size", "8", "--train-iters", "3"],
     "give only one of --train-iters and --train-samples"),
    (["--train-iters", "5", "--decoupled-min-lr", "1e-5"], "--decoupled-min-lr needs --decoupled-lr"),
    (["--train-iters", "5", "--cross-entropy-fusion-impl", "te"], "needs --cross-entropy-loss-fusion"),
    (["--train-iters", "5", "--manual-gc-interval", "2"], "--manual-gc-interval needs --manual-gc"),
    (["--train-iters", "5", "--no-manual-gc-eval"], "--no-manual-gc-eval needs --manual-gc"),
    (["--train-iters", "5", "--use-pytorch-profiler"], "--use-pytorch-profiler needs --profile"),
    (["--train-iters", "5", "--profile", "--use-pytorch-profiler"], "give --tensorboard-dir"),
    (["--train-iters", "5", "--profile", "--profile-step-start", "3", "--profile-step-end", "3"],
     "--profile-step-start 3 must be >= 0 and smaller than --profile-step-end 3"),
    (["--train-iters", "5", "--profile", "--profile-ranks", "4"], "--profile-ranks 4 is not a rank"),
])
def test_refusals_are_one_line_naming_the_flag(extra, flag):
    with pytest.raises(ConfigError) as e:
        _parse(extra)
    assert flag in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("extra, flag", [
    (["--train-samples", "64", "--global-batch-size", "8", "--rampup-batch-size", "2", "4", "12"],
     "must be START plus a positive multiple of INCREMENT"),
    (["--train-samples", "64", "--global-batch-size", "8", "--rampup-batch-size", "1", "1", "12"],
     "the batch size 1 of the ramp is not divisible"),
] if HAS_RAMPUP else [
    (["--train-samples", "64", "--global-batch-size", "8", "--step-batch-size-schedule", "0:4 256:8"],
     "give only one of --step-batch-size-schedule and --global-batch-size"),
    (["--train-samples", "64", "--step-batch-size-schedule", "64:4 256:8"],
     "--step-batch-size-schedule '64:4 256:8': first schedule entry must have threshold 0"),
    (["--train-samples", "64", "--step-batch-size-schedule", "0:4 256:x"], "--step-batch-size-schedule '0:4 256:x'"),
    (["--train-samples", "64", "--step-batch-size-schedule", "0:4 256:5"],
     "--step-batch-size-schedule '0:4 256:5': its largest batch 5 is not divisible by --micro-batch-size 2"),
])
def test_batch_size_schedule_refusals_are_one_line(extra, flag):
    with pytest.raises(ConfigError) as e:
        _parse(extra)
    assert flag in str(e.value) and "\n" not in str(e.value)


def test_step_batch_size_schedule_follows_the_installed_calculator():
    """megatron-core >= 0.18 has the step-schedule calculator (Megatron-LM's flag), 0.16/0.17 the ramp-up
    one: each flag works where its calculator exists and is refused in one line where it does not."""
    from megatron.core import num_microbatches_calculator as nmc

    assert batch_size_calculator("step") is getattr(nmc, "StepBatchsizeNumMicroBatchesCalculator", None)
    assert batch_size_calculator("rampup") is getattr(nmc, "RampupBatchsizeNumMicroBatchesCalculator", None)
    steps = ["--train-samples", "64", "--step-batch-size-schedule", "0:4 256:8"]  # tokens (seq 32): 8 samples
    ramp = ["--train-samples", "64", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "12"]
    if hasattr(nmc, "StepBatchsizeNumMicroBatchesCalculator"):
        a = _parse(steps)
        assert a.global_batch_size == 8 and a.train_iters == 2 + (64 - 8) // 8
    else:
        with pytest.raises(ConfigError, match="--step-batch-size-schedule needs megatron-core >= 0.18"):
            _parse(steps)
    if hasattr(nmc, "RampupBatchsizeNumMicroBatchesCalculator"):
        assert _parse(ramp).train_iters > 0
    else:
        with pytest.raises(ConfigError, match="--rampup-batch-size: the installed megatron-core"):
            _parse(ramp)


# ------------------------------------------------------------------------------------------ two ranks


def decoupled_lr_groups(argv):
    """(parameter name, lr, max_lr, min_lr) of every parameter after one scheduler step, from the
    optimizer the loop builds (a "call" step of the multi-run job)."""
    from megatron_lev.models import factory
    from megatron_lev.training import loop

    rc, _tok, config, model_config = loop._setup_configs(argv)
    chunks = factory.build_model_chunks(config, model_config)
    names = {id(p): n for c in chunks for n, p in c.named_parameters()}
    model = loop._wrap_model(rc, config, chunks)
    optimizer, scheduler = loop._build_optimizer(rc, config, model)
    scheduler.step(increment=rc.schedule.global_batch_size)
    return [(names[id(p)], g["lr"], g["max_lr"], g["min_lr"]) for g in optimizer.param_groups for p in g["params"]]


def _short_documents(tok, root: Path) -> str:
    """Many short documents (3 to 30 words), each followed by the end-of-document token: with
    --eod-mask-loss every micro-batch masks a different number of tokens."""
    import random

    from megatron_lev.data.preprocessing import PreprocessConfig, preprocess

    rng = random.Random(0)
    words = "the king said that we shall go to the field and see what the night will bring us".split()
    src = root / "short.jsonl"
    src.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(3, 30)))})
                           + "\n" for _ in range(400)))
    preprocess(PreprocessConfig(inputs=[str(src)], output_prefix=str(root / "short"), tokenizer_type="GPT2BPETokenizer",
                                vocab_file=tok.vocab_file, merge_file=tok.merge_file, append_eod=True, workers=1,
                                progress=False))
    return str(root / "short_text_document")


@pytest.fixture(scope="module")
def runs(tokenizer_files, tmp_path_factory):
    root = tmp_path_factory.mktemp("schedules")
    real = ["--data-path", _short_documents(tokenizer_files, root), "--split", "90,10,0",
            "--data-cache-path", str(root / "cache"),
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", tokenizer_files.vocab_file,
            "--merge-file", tokenizer_files.merge_file]
    m = lambda name: ["--metrics-file", str(root / f"{name}.jsonl")]  # noqa: E731
    iters = LEV + MOCK + ["--micro-batch-size", "2", "--global-batch-size", "8", "--lr-decay-style", "WSD",
                          "--lr-wsd-decay-style", "linear"]
    # Batches 4, 4, 6, 6, then 8 (from sample 20): the ramp-up 4 -> 8 by 2 over 16 samples, or the step
    # schedule of the same batches (thresholds in tokens, seq 32) where megatron-core has no ramp-up.
    ramp = LEV + MOCK + ["--micro-batch-size", "1", "--train-samples", "60", "--save-interval", "3"] + (
        ["--global-batch-size", "8", "--rampup-batch-size", "4", "2", "16"] if HAS_RAMPUP
        else ["--step-batch-size-schedule", "0:4 256:6 512:8"])
    tok = LEV + real + ["--global-batch-size", "8", "--train-iters", "3", "--lr-warmup-iters", "1"]
    wsd = iters + ["--train-iters", "6", "--lr-warmup-iters", "2", "--lr-wsd-decay-iters", "3"]
    plan = [
        # First in the job: a call step must not rely on a pretrain step before it (the CPU backend, seeds).
        {"name": "decoupled", "call": "tests.training.test_megatron_schedules:decoupled_lr_groups", "tp": 2,
         "args": [LEV + MOCK + ["--micro-batch-size", "2", "--train-iters", "4", "--tensor-model-parallel-size",
                               "2", "--lr-decay-style", "constant", "--decoupled-lr", "3e-3",
                               "--decoupled-min-lr", "2e-4"]]},
        {"name": "iters", "argv": wsd + ["--save", str(root / "iters_ck"), "--save-interval", "3"] + m("iters")},
        # Resumed at iteration 3 without optimizer state: not loaded (saving none either), then a checkpoint
        # that has none, then resharded to TP=2 (reshard writes no optimizer state).
        {"name": "no-load-optim", "copy_checkpoint": [str(root / "iters_ck"), 3, str(root / "noopt_ck")],
         "argv": wsd + ["--load", str(root / "noopt_ck"), "--save", str(root / "noopt_ck"), "--save-interval", "1",
                        "--no-load-optim", "--no-save-optim"] + m("no-load-optim")},
        {"name": "saved-without-optim", "copy_checkpoint": [str(root / "noopt_ck"), 4, str(root / "noopt_ck4")],
         "argv": wsd + ["--load", str(root / "noopt_ck4")] + m("saved-without-optim")},
        {"name": "reshard", "rank0": "tests.training.test_megatron_schedules:reshard_to_tp2",
         "args": [str(root / "iters_ck"), 3, str(root / "tp2_ck")]},
        {"name": "resharded", "argv": wsd + ["--load", str(root / "tp2_ck"), "--tensor-model-parallel-size", "2"]
         + m("resharded")},
        {"name": "samples", "argv": iters + ["--train-samples", "48", "--lr-warmup-samples", "16",
                                             "--lr-wsd-decay-samples", "24"] + m("samples")},
        {"name": "ramp", "argv": ramp + ["--save", str(root / "ramp_ck")] + m("ramp")},
        {"name": "ramp-resumed", "copy_checkpoint": [str(root / "ramp_ck"), 3, str(root / "ramp_ck3")],
         "argv": ramp + ["--load", str(root / "ramp_ck3"), "--save", str(root / "ramp_ck3")] + m("ramp-resumed")},
        {"name": "profile", "argv": LEV + MOCK + ["--micro-batch-size", "2", "--train-iters", "4", "--profile",
                                                 "--use-pytorch-profiler", "--profile-step-start", "1",
                                                 "--profile-step-end", "3", "--profile-ranks", "0", "1",
                                                 "--tensorboard-dir", str(root / "tb")]},
        {"name": "nsys-on-cpu", "argv": LEV + MOCK + ["--micro-batch-size", "2", "--train-iters", "2", "--profile"]},
    ]
    # Loss normalisation on short documents with --eod-mask-loss (unequal mask counts per micro-batch) and
    # without (full masks): split 1 = one sample per micro-batch (4 per rank), split 2 = two.
    for mask in ("eod", "full"):
        for norm in ("token", "default"):
            for mbs in ("1", "2"):
                name = f"{mask}-{norm}-{mbs}"
                extra = ["--micro-batch-size", mbs] + (["--eod-mask-loss"] if mask == "eod" else []) + \
                    (["--calculate-per-token-loss"] if norm == "token" else [])
                plan.append({"name": name, "argv": tok + extra + m(name)})
    return {"root": root, "runs": launch_plan(2, plan, root / "job")}


def _ok(runs, *names):
    for n in names:
        r = runs[n]
        assert r.code == 0, f"{n}: exit {r.code}\nSTDOUT:\n{r.stdout[-3000:]}\nSTDERR:\n{r.job_stderr[-5000:]}"


def test_train_samples_is_train_iters_bit_for_bit(runs):
    _ok(runs["runs"], "iters", "samples")
    a, b = _metrics(runs["root"] / "iters.jsonl"), _metrics(runs["root"] / "samples.jsonl")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for i in a:
        assert (b[i]["lm loss hex"], b[i]["lr"], b[i]["grad norm"]) == (a[i]["lm loss hex"], a[i]["lr"],
                                                                        a[i]["grad norm"]), i
    assert len({a[i]["lr"] for i in a}) > 3  # warmup, stable and decay phases all taken


def test_learning_rate_resumes_without_optimizer_state_and_after_reshard(runs):
    """The schedule is restored apart from the optimizer: after --no-load-optim, from a checkpoint saved
    with --no-save-optim, and after reshard (no optimizer state), the learning rate of every iteration is
    the uninterrupted run's (it used to restart from warmup)."""
    _ok(runs["runs"], "iters", "no-load-optim", "saved-without-optim", "reshard", "resharded")
    a = _metrics(runs["root"] / "iters.jsonl")
    for name, first in (("no-load-optim", 4), ("saved-without-optim", 5), ("resharded", 4)):
        b = _metrics(runs["root"] / f"{name}.jsonl")
        assert sorted(b) == list(range(first, 7)), (name, sorted(b))
        assert [b[i]["lr"] for i in b] == [a[i]["lr"] for i in b], name
        assert "holds no learning-rate scheduler state" not in runs["runs"][name].stdout, name


def reshard_to_tp2(src: str, iteration: int, dst: str) -> None:
    """A "rank0" step: ``src``'s iteration resharded to TP=2 under ``dst``."""
    from megatron_lev.conversion import reshard_checkpoint

    reshard_checkpoint(src, dst, tp=2, pp=1, iteration=iteration, progress=False)


def test_batch_size_schedule_follows_the_calculator_and_resumes_bit_exactly(runs):
    _ok(runs["runs"], "ramp", "ramp-resumed")
    a = _metrics(runs["root"] / "ramp.jsonl")
    assert [a[i]["global_batch_size"] for i in sorted(a)] == [4, 4, 6, 6, 8, 8, 8, 8, 8]
    assert [a[i]["consumed_samples"] for i in sorted(a)] == [4, 8, 14, 20, 28, 36, 44, 52, 60]
    # As Megatron-LM: a checkpoint whenever the number of micro-batches changes (2 and 4), besides
    # the --save-interval ones.
    assert {p.name for p in (runs["root"] / "ramp_ck").iterdir() if p.name.startswith("iter_")} == \
        {f"iter_{i:07d}" for i in (2, 3, 4, 6, 9)}
    b = _metrics(runs["root"] / "ramp-resumed.jsonl")
    assert sorted(b) == list(range(4, 10))  # resumed from iteration 3, inside the ramp (batch 6)
    for i in b:
        assert (b[i]["lm loss hex"], b[i]["grad norm"], b[i]["lr"], b[i]["global_batch_size"]) == \
            (a[i]["lm loss hex"], a[i]["grad norm"], a[i]["lr"], a[i]["global_batch_size"]), i


def test_decoupled_lr_reaches_the_input_arm_and_output_layer_only(runs):
    _ok(runs["runs"], "decoupled")
    for rank_groups in runs["runs"]["decoupled"].results:
        decoupled = {n for n, lr, mx, mn in rank_groups if (lr, mx, mn) == (3e-3, 3e-3, 2e-4)}
        default = {n for n, lr, mx, mn in rank_groups if (lr, mx, mn) == (1e-3, 1e-3, 1e-4)}
        assert decoupled | default == {n for n, *_ in rank_groups}
        # The LEV module (codebooks, spline heads, projections) and the output layer.
        assert decoupled == {n for n, *_ in rank_groups if n.startswith(("embedding.arm.", "output_layer."))}
        assert any(".codebooks" in n or "codebook" in n for n in decoupled), sorted(decoupled)
        assert any(n.startswith("decoder.") for n in default) and "output_layer.weight" in decoupled


def test_per_token_loss_normalises_by_the_global_token_count(runs):
    r = runs["root"]
    names = [f"{k}-{n}-{s}" for k in ("eod", "full") for n in ("token", "default") for s in ("1", "2")]
    _ok(runs["runs"], *names)
    got = {n: _metrics(r / f"{n}.jsonl") for n in names}
    rel = lambda x, y: abs(x - y) / abs(y)  # noqa: E731
    # Unequal masks: per-token loss does not depend on the micro-batch split, the default does.
    for i in (1, 2, 3):
        assert rel(got["eod-token-1"][i]["grad norm"], got["eod-token-2"][i]["grad norm"]) < 1e-5, i
    assert rel(got["eod-default-1"][1]["grad norm"], got["eod-default-2"][1]["grad norm"]) > 1e-4
    assert rel(got["eod-default-1"][1]["grad norm"], got["eod-token-1"][1]["grad norm"]) > 1e-4
    # The first loss is measured before any update: the same for both normalisations.
    assert got["eod-token-1"][1]["lm loss"] == pytest.approx(got["eod-default-1"][1]["lm loss"], rel=1e-6)
    # Full masks: every micro-batch has the same token count, so the two normalisations agree.
    for i in (1, 2, 3):
        for s in ("1", "2"):
            assert rel(got[f"full-token-{s}"][i]["grad norm"], got[f"full-default-{s}"][i]["grad norm"]) < 1e-5
            assert got[f"full-token-{s}"][i]["lm loss"] == pytest.approx(got[f"full-default-{s}"][i]["lm loss"],
                                                                         rel=1e-5)


def test_pytorch_profiler_writes_a_trace_on_cpu_and_nsys_is_refused(runs):
    _ok(runs["runs"], "profile")
    traces = sorted((runs["root"] / "tb").glob("*.pt.trace.json"))
    assert len(traces) == 2  # --profile-ranks 0 1
    for t in traces:
        events = json.loads(t.read_text())["traceEvents"]
        steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
        assert steps == {"ProfilerStep#1", "ProfilerStep#2"}, steps  # --profile-step-start 1 to --profile-step-end 3
        assert any(e.get("cat") == "cpu_op" for e in events)
        # The loop's spans, by which bench/_profile_trace.py places the step's host syncs and scalar reads
        spans = {e["name"] for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("megatron_lev.")}
        # (and the model's own ranges: LEV's input layer, the loss's cross-entropy; RoPE's runs fused on CUDA only)
        assert spans == {f"megatron_lev.{n}" for n in ("batch", "step", "forward_backward", "loss", "optimizer", "log",
                                                       "lev", "cross_entropy")}
    nsys = runs["runs"]["nsys-on-cpu"]
    assert nsys.code == 2
    errors = [ln for ln in nsys.job_stderr.splitlines() if "--profile without --use-pytorch-profiler" in ln]
    assert errors and "add --use-pytorch-profiler" in errors[0]


# ------------------------------------------------------------------------------------------ one process


def test_manual_gc_empty_unused_memory_and_logging_level(tmp_path):
    base = " ".join(LEV + MOCK + ["--micro-batch-size", "2", "--train-iters", "4", "--eval-interval", "2"])
    argvs = [base + " --manual-gc --manual-gc-interval 2 --empty-unused-memory-level 1 --logging-level 10",
             base + " --manual-gc --no-manual-gc-eval --empty-unused-memory-level 2",
             base]
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PATH": "/usr/bin:/bin"}
    import os

    env.update({k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "MEGATRON_LEV_TEST_CACHE", "HOME")})
    r = subprocess.run([sys.executable, str(REPO / "tests/training/_counted_run.py"), str(tmp_path / "c.json")]
                       + argvs, capture_output=True, text=True, env=env, timeout=600, cwd=str(REPO))
    assert r.returncode == 0, r.stderr[-4000:]
    a, b, c = json.loads((tmp_path / "c.json").read_text())
    assert a["code"] == b["code"] == c["code"] == 0
    # Start-up 1, every 2 iterations 2, around the evaluations at 2 and at the end 2 + 2 (full, then gen 0).
    assert (a["gc_disable"], a["gc_collect"], a["gc_collect_gen0"]) == (1, 5, 2)
    assert (b["gc_disable"], b["gc_collect"], b["gc_collect_gen0"]) == (1, 1, 0)
    assert (c["gc_disable"], c["gc_collect"], c["gc_collect_gen0"]) == (0, 0, 0)
    # Level 1: after each of 4 backwards and 2 evaluation steps; level 2 also after 4 optimizer steps.
    assert (a["empty_cache"], b["empty_cache"], c["empty_cache"]) == (6, 10, 0)
    assert a["root_level"] == 10 and a["level_after"] == c["root_level"] == c["level_after"]
