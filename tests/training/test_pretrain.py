"""End-to-end pretraining on CPU ranks through torchrun: loss falls at TP=2 and at PP=2 (interleaved);
a resumed run reproduces the uninterrupted one bit for bit; a rank killed (-9) in the middle of a save
leaves the previous checkpoint as the latest; a checkpoint written at PP=2 loads at PP=1; the NaN
check fires on an injected NaN (stop after saving, or skip); SIGTERM saves and exits cleanly.

The corpus is the sample corpus's valid.jsonl.zst tokenised with the test BPE in GPT-2 format.
The two-rank runs share one job (tests/training/_multi_run.py, its ranks forked by ``run_torchrun``
from a process that imported torch once); the killed run has a job of its own (the kill ends it), the
signalled run a process of its own; every run is reused by several checks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_lev.testing.cli import free_port, run_cli, run_torchrun
from tests.training._multi_run import launch_plan

# Its tests share multi-process jobs (~54 s for the module on 2 cores): not in make test-fast.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = str(REPO / "pretrain_lev.py")


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def launch(nproc, args, timeout=300, check=True, launcher=False):
    """``torchrun --nproc-per-node nproc pretrain_lev.py *args``: its ranks forked as torchrun runs them
    (``run_torchrun``: no interpreter start-up paid per rank), or, with ``launcher``, torchrun itself, for a
    test whose subject is the launcher (its failure summary, its signals)."""
    if launcher:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), PRETRAIN] + args
        r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout, cwd=str(REPO))
    else:
        r = run_torchrun(PRETRAIN, args, nproc=nproc, env=_env(), timeout=timeout, cwd=str(REPO))
    if check and r.returncode != 0:
        raise AssertionError(f"exit {r.returncode}\nSTDOUT:\n{r.stdout[-4000:]}\nSTDERR:\n{r.stderr[-6000:]}")
    return r


def run_single(args, timeout=300):
    """One process without torchrun (the exit code is the script's own)."""
    return run_cli(PRETRAIN, args, env=_env(), timeout=timeout, cwd=str(REPO))


def metrics(path, kind="train"):
    rows = [json.loads(ln) for ln in Path(path).read_text().splitlines()]
    return {r["iteration"]: r for r in rows if r["kind"] == kind}


@pytest.fixture(scope="module")
def corpus(valid_corpus, tokenizer_files, tmp_path_factory):
    """valid.jsonl.zst -> .bin/.idx with the test BPE (~150k tokens; the session's ``valid_corpus``)."""
    return {"prefix": valid_corpus.prefix, "vocab": tokenizer_files.vocab_file,
            "merges": tokenizer_files.merge_file, "cache": str(tmp_path_factory.mktemp("corpus_cache"))}


def model_args(corpus, iters, extra=()):
    return [
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters),
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--hidden-dropout", "0.1", "--attention-dropout", "0.0",
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
        "--data-path", corpus["prefix"], "--split", "90,10,0", "--data-cache-path", corpus["cache"],
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", corpus["vocab"], "--merge-file", corpus["merges"],
        "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "2", "--quiet-config",
    ] + list(extra)


def _tp2_args(corpus):
    return model_args(corpus, 10, ["--tensor-model-parallel-size", "2", "--input-embedding", "untied",
                                   "--use-distributed-optimizer"])


def _pp2_args(corpus):
    return model_args(corpus, 8, ["--pipeline-model-parallel-size", "2", "--hidden-dropout", "0.0",
                                  "--num-layers-per-virtual-pipeline-stage", "1", "--input-embedding", "tied"])


LEV_MODES = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3",
             "--mock-data", "--vocab-size", "1000", "--log-interval", "1", "--eval-interval", "3", "--eval-iters",
             "1", "--quiet-config", "--hidden-dropout", "0", "--attention-dropout", "0", "--input-embedding", "lev",
             "--tensor-model-parallel-size", "2", "--lev-seed-dim", "16", "--lev-rank", "8", "--lev-heads", "2",
             "--lev-knots", "8"]


@pytest.fixture(scope="module")
def two_rank_runs(corpus, tmp_path_factory):
    """Every two-rank run of this module's checks. The run whose rank is killed in the middle of a save
    has a launch of its own (the kill ends the job); the others share one job (one launch instead of
    seven), each in its own folder under ``root``:
    tp2-ref (TP=2, uninterrupted), tp2-resumed (from the killed run's checkpoint), pp2-a (PP=2
    interleaved, saves at 4 and 8), pp2-b (resumed from a copy of pp2-a's iteration 4), lev-unique,
    lev-table and lev-linear-ce."""
    root = tmp_path_factory.mktemp("two_rank")
    tp2, pp2 = _tp2_args(corpus), _pp2_args(corpus)
    ck = root / "tp2_ck"
    killed = launch(2, tp2 + ["--save", str(ck), "--save-interval", "3", "--debug-kill-during-save", "1:6",
                              "--metrics-file", str(root / "killed.jsonl")], check=False)
    # What the killed run left, before the resumed run saves over it.
    after_kill = {"tracker": (ck / "latest_checkpointed_iteration.txt").read_text().strip()
                  if (ck / "latest_checkpointed_iteration.txt").exists() else None,
                  "iter3": [(ck / "iter_0000003" / n).is_file() for n in ("metadata.json", "config.yaml")],
                  "iter6_config": (ck / "iter_0000006" / "config.yaml").exists()}
    plan = [
        {"name": "tp2-ref", "argv": tp2 + ["--metrics-file", str(root / "ref.jsonl"), "--log-interval", "5",
                                           "--tensorboard-dir", str(root / "tb"), "--tensorboard-log-interval", "3"]},
        {"name": "tp2-resumed", "argv": tp2 + ["--save", str(ck), "--load", str(ck), "--save-interval", "3",
                                               "--metrics-file", str(root / "resumed.jsonl")]},
        {"name": "pp2-a", "argv": pp2 + ["--save", str(root / "pp2_ck"), "--save-interval", "4",
                                         "--metrics-file", str(root / "a.jsonl")]},
        # Resume from the checkpoint at iteration 4 (as if the run had stopped there).
        {"name": "pp2-b", "copy_checkpoint": [str(root / "pp2_ck"), 4, str(root / "pp2_ck4")],
         "argv": pp2 + ["--load", str(root / "pp2_ck4"), "--metrics-file", str(root / "b.jsonl")]},
    ] + [{"name": f"lev-{mode}", "argv": LEV_MODES + ["--lev-compute-mode", mode, "--metrics-file",
                                                      str(root / f"lev-{mode}.jsonl")]}
         for mode in ("unique", "table")] + [
        # lev-unique with the loss computed without its logits (chunks of 16 of the 64 tokens per rank) and
        # the distributed optimizer (one data-parallel rank: the same steps).
        {"name": "lev-linear-ce", "argv": LEV_MODES + ["--lev-compute-mode", "unique", "--cross-entropy-loss-fusion",
                                                       "--cross-entropy-fusion-impl", "linear",
                                                       "--linear-cross-entropy-chunk-size", "16",
                                                       "--use-distributed-optimizer",
                                                       "--metrics-file", str(root / "lev-linear-ce.jsonl")]}] + [
        # Two data-parallel replicas: saved at 2 of 4, resumed from a copy with --ckpt-fully-parallel-load.
        {"name": "dp2-a", "argv": LEV_MODES[:LEV_MODES.index("--tensor-model-parallel-size")] + DP2 + [
            "--save", str(root / "dp2_ck"), "--save-interval", "2", "--metrics-file", str(root / "dp2-a.jsonl")]},
        {"name": "dp2-b", "copy_checkpoint": [str(root / "dp2_ck"), 2, str(root / "dp2_ck2")],
         "argv": LEV_MODES[:LEV_MODES.index("--tensor-model-parallel-size")] + DP2 + [
             "--load", str(root / "dp2_ck2"), "--ckpt-fully-parallel-load", "--metrics-file", str(root / "dp2-b.jsonl")]},
        {"name": "dp2-strategy", "call": "tests.training.test_pretrain:load_strategy_kinds",
         "args": [str(root / "dp2_ck" / "iter_0000002")]}]
    return {"root": root, "killed": killed, "after_kill": after_kill, "runs": launch_plan(2, plan, root / "job")}


def load_strategy_kinds(path):
    """The load strategies of a data-parallel rank with and without --ckpt-fully-parallel-load."""
    from megatron_lev.checkpoint.sharded import _load_strategy

    return tuple(type(_load_strategy(path, fully_parallel=f)).__name__ for f in (True, False))


DP2 = ["--train-iters", "4", "--eval-iters", "0", "--use-distributed-optimizer", "--lev-seed-dim", "16",
       "--lev-rank", "8", "--lev-heads", "2", "--lev-knots", "8"]


def _ok(runs, *names):
    for name in names:
        r = runs[name]
        assert r.code == 0, f"{name}: exit {r.code}\nSTDOUT:\n{r.stdout[-4000:]}\nSTDERR:\n{r.job_stderr[-6000:]}"
    return [runs[n] for n in names]


def test_tp2_loss_falls_resume_is_bit_exact_and_kill_during_save(two_rank_runs):
    root, runs = two_rank_runs["root"], two_rank_runs["runs"]
    # Uninterrupted reference.
    ref, res = _ok(runs, "tp2-ref", "tp2-resumed")
    a = metrics(root / "ref.jsonl")
    assert sorted(a) == list(range(1, 11))
    first, last = a[1]["lm loss"], sum(a[i]["lm loss"] for i in (8, 9, 10)) / 3
    assert last < first - 0.5, (first, last)
    # Megatron-LM's log line, printed once (rank 0 only).
    lines = [ln for ln in ref.stdout.splitlines() if " iteration       10/      10 |" in ln]
    assert len(lines) == 1
    for field in ("consumed samples: 80 |", "iteration 10/ 10 |", "lm loss:", "learning rate:", "grad norm:", "loss scale:",
                  "number of skipped iterations: 0", "number of nan iterations: 0", "tokens per second:",
                  "elapsed time per iteration (ms):", "global batch size: 8"):
        assert field in " ".join(lines[0].split()).replace("| ", "| "), field
    assert ref.stdout.count("validation loss at iteration 4 |") == 1
    assert "lm loss PPL:" in ref.stdout
    # TensorBoard as Megatron-LM writes it: each --tensorboard-log-interval (3) iteration's own values, the
    # throughput with each --log-interval (5) line
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(root / "tb")).Reload()
    assert [e.step for e in tb.Scalars("lm loss")] == [3, 6, 9]
    for e in tb.Scalars("lm loss"):
        assert e.value == pytest.approx(a[e.step]["lm loss"], rel=1e-6), e
    assert [e.step for e in tb.Scalars("grad-norm")] == [3, 6, 9]
    assert [e.step for e in tb.Scalars("tokens-per-second")] == [5, 10]

    # A run that saves every 3 iterations and loses rank 1 (kill -9) in the middle of the save at 6.
    ck = root / "tp2_ck"
    assert two_rank_runs["killed"].returncode != 0
    left = two_rank_runs["after_kill"]
    assert left["tracker"] == "3"
    assert left["iter3"] == [True, True]  # metadata.json and config.yaml
    assert not left["iter6_config"]  # the interrupted save is not complete
    # Resume picks iteration 3 and reproduces the reference bit for bit (loss and grad norm).
    assert "successfully loaded checkpoint from" in res.stdout and "at iteration 3" in res.stdout
    b = metrics(root / "resumed.jsonl")
    assert sorted(b) == list(range(4, 11))
    for i in range(4, 11):
        assert b[i]["lm loss hex"] == a[i]["lm loss hex"], (i, a[i]["lm loss"], b[i]["lm loss"])
        assert b[i]["grad norm"] == a[i]["grad norm"], i
    assert metrics(root / "resumed.jsonl", "valid")[8]["lm loss hex"] == \
        metrics(root / "ref.jsonl", "valid")[8]["lm loss hex"]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "9" or \
        (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    assert not (ck / "run.lock").exists()  # --save's lock, released by the run that ended well


def test_pp2_interleaved_loss_falls_resumes_exactly_and_reloads_at_pp1(corpus, two_rank_runs, tmp_path):
    root, runs = two_rank_runs["root"], two_rank_runs["runs"]
    _ok(runs, "pp2-a", "pp2-b")
    a = metrics(root / "a.jsonl")
    assert a[8]["lm loss"] < a[1]["lm loss"] - 0.4, (a[1]["lm loss"], a[8]["lm loss"])
    # Resumed from the checkpoint at iteration 4 (as if the run had stopped there).
    b = metrics(root / "b.jsonl")
    for i in range(5, 9):
        assert b[i]["lm loss hex"] == a[i]["lm loss hex"], i
    # The PP=2 (interleaved) checkpoint loads into a single process (dist_checkpointing reshards):
    # the loss of iteration 5 needs only the weights and the data, so it must match.
    # (5 iterations instead of 8: the saved schedule's length is overridden.)
    single = model_args(corpus, 5, ["--input-embedding", "tied", "--no-load-optim", "--no-load-rng",
                                    "--override-opt-param-scheduler",
                                    "--hidden-dropout", "0.0",
                                    "--load", str(root / "pp2_ck4"), "--eval-iters", "0"])
    r = run_single(single + ["--metrics-file", str(tmp_path / "c.jsonl")])
    assert r.returncode == 0, r.stderr[-4000:]
    c = metrics(tmp_path / "c.jsonl")
    assert abs(c[5]["lm loss"] - a[5]["lm loss"]) < 1e-4, (c[5]["lm loss"], a[5]["lm loss"])


def test_nan_check_stops_after_saving_or_skips(corpus, tmp_path):
    common = model_args(corpus, 6, ["--input-embedding", "untied", "--check-for-nan-in-loss-and-grad",
                                    "--inject-nan-at-iteration", "3", "--eval-iters", "0"])
    ck = tmp_path / "ck"
    r = run_single(common + ["--save", str(ck)])
    assert r.returncode == 3, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "NaN/Inf in the loss at iteration 3" in errors[0]
    assert "Traceback" not in r.stderr
    # The last good state (after iteration 2) was saved before stopping.
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    r = run_single(common + ["--nan-action", "skip", "--metrics-file", str(tmp_path / "skip.jsonl")])
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(tmp_path / "skip.jsonl")
    assert m[3]["nan"] and m[3]["skipped"] and not m[4]["nan"]
    assert "number of nan iterations:   1" in r.stdout and "number of skipped iterations:   1" in r.stdout


def test_sigterm_saves_and_exits_cleanly(corpus, tmp_path):
    """SIGTERM to every process of the run, as Slurm delivers it: the rank's helpers (checkpoint writer
    queue, data-loader worker) ignore it and the rank saves through them."""
    import psutil

    ck = tmp_path / "ck"
    args = model_args(corpus, 100000, ["--input-embedding", "untied", "--exit-signal-handler", "--save", str(ck),
                                       "--save-interval", "2", "--num-workers", "1", "--eval-iters", "0"])
    env = _env()
    proc = subprocess.Popen([sys.executable, PRETRAIN] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=str(REPO))
    deadline = time.time() + 120
    seen = False
    while time.time() < deadline:
        line = proc.stdout.readline()
        if " iteration        3/" in line:
            seen = True
            break
    assert seen, "training did not start"
    helpers = psutil.Process(proc.pid).children(recursive=True)
    assert helpers  # the saved checkpoint at 2 started the writer queue
    for p in [proc] + helpers:
        p.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "exiting on SIGTERM" in out
    it = int((ck / "latest_checkpointed_iteration.txt").read_text())
    assert it >= 3 and (ck / f"iter_{it:07d}" / "metadata.json").is_file()


def test_lev_table_mode_matches_unique_mode(two_rank_runs):
    """LEV's table compute mode hooked into the step (begin before the micro-batches, finish before the
    gradient reduction) trains exactly like the per-id mode at TP=2."""
    root = two_rank_runs["root"]
    _ok(two_rank_runs["runs"], "lev-unique", "lev-table")
    out = {mode: metrics(root / f"lev-{mode}.jsonl") for mode in ("unique", "table")}
    for i in (1, 2, 3):
        assert out["table"][i]["lm loss"] == pytest.approx(out["unique"][i]["lm loss"], rel=1e-5, abs=1e-6)
        assert out["table"][i]["grad norm"] == pytest.approx(out["unique"][i]["grad norm"], rel=1e-4)
    assert all(r["grad norm"] > 0 for r in out["table"].values())


def test_linear_cross_entropy_trains_like_the_logits(two_rank_runs):
    """--cross-entropy-fusion-impl linear at TP=2 (LEV, the distributed optimizer, validation) reproduces the
    run with megatron's logits and loss step by step."""
    root = two_rank_runs["root"]
    _ok(two_rank_runs["runs"], "lev-unique", "lev-linear-ce")
    ref, got = metrics(root / "lev-unique.jsonl"), metrics(root / "lev-linear-ce.jsonl")
    assert sorted(got) == sorted(ref) == [1, 2, 3]
    for i in ref:
        assert got[i]["lm loss"] == pytest.approx(ref[i]["lm loss"], rel=1e-5), i
        assert got[i]["grad norm"] == pytest.approx(ref[i]["grad norm"], rel=1e-4), i
    valid_ref, valid = metrics(root / "lev-unique.jsonl", "valid"), metrics(root / "lev-linear-ce.jsonl", "valid")
    assert valid and valid.keys() == valid_ref.keys()
    for i in valid_ref:
        assert valid[i]["lm loss"] == pytest.approx(valid_ref[i]["lm loss"], rel=1e-5), i


def test_fully_parallel_load_of_two_data_parallel_replicas_resumes_bit_exact(two_rank_runs):
    """--ckpt-fully-parallel-load: each replica reads its share and they exchange the rest (megatron-core's
    FullyParallelLoadStrategyWrapper over the data-parallel group); the resumed run's last iteration is the
    uninterrupted one's, bit for bit."""
    root = two_rank_runs["root"]
    _ok(two_rank_runs["runs"], "dp2-a", "dp2-b")
    kinds = two_rank_runs["runs"]["dp2-strategy"].results
    assert kinds == [("FullyParallelLoadStrategyWrapper", "TorchDistLoadShardedStrategy")] * 2, kinds
    a, b = (metrics(root / f"dp2-{x}.jsonl") for x in "ab")
    assert sorted(b) == [3, 4] and all(a[i]["lm loss hex"] == b[i]["lm loss hex"] for i in (3, 4)), (a, b)
    assert a[4]["grad norm"] == b[4]["grad norm"]
