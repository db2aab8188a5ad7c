"""The production path on CPU ranks: what the GPU path shares with the CPU path, checked where CPU can.

One 4-rank job (TP=2 x DP=2, gloo; tests/training/_multi_run.py, run as torchrun runs it) runs, in one process group:
- each shipped ``examples/pile/configs/*.yaml`` as a user runs it (bf16, LEV unique mode, distributed
  optimizer, overlapped grad reduce), with only the sizes scaled down (layers, widths, vocabulary,
  batch, iterations), and the same run with ``--no-overlap-grad-reduce``: losses and grad norms equal;
- LEV at TP=2 with the distributed optimizer in unique and table mode, and with overlapped param
  gather: an uninterrupted run and a run stopped after iteration 2 and resumed give bit-identical
  losses and grad norms;
- LEV in table mode at PP=2 with two virtual stages per rank (the interleaved schedule, which starts
  each chunk's grad sync before finalize) x DP=2, distributed optimizer: overlapped grad reduce on and
  off give identical losses and grad norms, in fp32 and in bf16.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from megatron_lev.testing import train_records

from tests.training._multi_run import launch_plan

# Its tests share multi-process jobs (~68 s for the module on 2 cores): not in make test-fast.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "examples" / "pile" / "configs").glob("*.yaml"))

# Sizes only: every other setting comes from the shipped file.
SCALE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", "3", "--lr-warmup-iters", "1", "--mock-data",
         "--vocab-size", "256", "--tensor-model-parallel-size", "2", "--log-interval", "1",
         "--eval-iters", "0", "--quiet-config", "--lev-chunk-size", "100"]

LEV_TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4", "--lr", "1e-3",
            "--mock-data", "--vocab-size", "256", "--log-interval", "1", "--eval-iters", "0", "--quiet-config",
            "--input-embedding", "lev", "--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
            "--lev-seed-dim", "16", "--lev-rank", "8", "--lev-heads", "2", "--lev-knots", "8",
            "--lev-chunk-size", "64"]


VPP_TABLE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "16",
             "--train-iters", "3", "--lr", "1e-3", "--mock-data", "--vocab-size", "256", "--log-interval", "1",
             "--eval-iters", "0", "--quiet-config", "--input-embedding", "lev", "--pipeline-model-parallel-size",
             "2", "--num-layers-per-virtual-pipeline-stage", "1", "--use-distributed-optimizer",
             "--lev-compute-mode", "table", "--lev-seed-dim", "16", "--lev-rank", "8", "--lev-heads", "2",
             "--lev-knots", "8", "--lev-chunk-size", "64"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("production")
    plan = []
    for cfg in CONFIGS:
        for overlap in ("on", "off"):
            name = f"{cfg.stem}-{overlap}"
            argv = ["--config", str(cfg), *SCALE, "--input-embedding", "lev", "--save", str(tmp / name),
                    "--metrics-file", str(tmp / f"{name}.jsonl")]
            if overlap == "off":
                argv.append("--no-overlap-grad-reduce")
            plan.append({"name": name, "argv": argv})
    for mode in ("unique", "table", "param-gather"):
        extra = {"unique": ["--lev-compute-mode", "unique"],
                 "table": ["--lev-compute-mode", "table", "--overlap-grad-reduce"],
                 # the last update's all-gather is still pending when the save starts
                 "param-gather": ["--overlap-grad-reduce", "--overlap-param-gather"]}[mode]
        ck = str(tmp / f"resume-{mode}")
        plan.append({"name": f"{mode}-full", "argv": LEV_TINY + extra + [
            "--metrics-file", str(tmp / f"{mode}-full.jsonl")]})
        plan.append({"name": f"{mode}-first", "argv": LEV_TINY + extra + [
            "--save", ck, "--exit-interval", "2", "--metrics-file", str(tmp / f"{mode}-first.jsonl")]})
        plan.append({"name": f"{mode}-resumed", "argv": LEV_TINY + extra + [
            "--load", ck, "--save", ck, "--metrics-file", str(tmp / f"{mode}-resumed.jsonl")]})
    for dtype in ("fp32", "bf16"):
        for overlap in ("on", "off"):
            name = f"vpp-table-{dtype}-{overlap}"
            argv = VPP_TABLE + (["--bf16"] if dtype == "bf16" else []) + (
                ["--overlap-grad-reduce"] if overlap == "on" else []) + ["--metrics-file", str(tmp / f"{name}.jsonl")]
            plan.append({"name": name, "argv": argv})
    # rank 0's gloo socket threads after the first run and after the shipped configs' runs: a run's groups
    # must end with it
    count = "tests.training._threads:record_gloo_threads"
    shipped = len(CONFIGS) * 2
    plan.insert(shipped, {"name": "threads-after-shipped", "rank0": count,
                          "args": [str(tmp / "threads-after-shipped.json")]})
    plan.insert(1, {"name": "threads-after-one", "rank0": count, "args": [str(tmp / "threads-after-one.json")]})
    plan.append({"name": "threads-after-all", "rank0": count, "args": [str(tmp / "threads-after-all.json")]})
    res = launch_plan(4, plan, tmp)
    assert all(r.code == 0 for r in res.values()), {n: r.code for n, r in res.items()}
    return tmp


def test_a_run_in_a_longer_job_takes_its_process_groups_threads_with_it(runs):
    """Before, each of the shipped configs' runs left its ~17 gloo groups alive (their socket loops polling)
    while the config holding the run's hooks was alive (18 socket threads after the first run, and more after
    each), and so did every fp32 run with the distributed optimizer (the LEV_TINY and fp32 VPP runs: its
    shards' autograd graph leads back to the model); now a run leaves at most one or two (a save's)."""
    one = json.loads((runs / "threads-after-one.json").read_text())
    after = json.loads((runs / "threads-after-shipped.json").read_text())
    assert one >= 1 and after - one <= 2 * (len(CONFIGS) * 2 - 1), (one, after)
    every = json.loads((runs / "threads-after-all.json").read_text())
    n_runs = len(list(runs.glob("*.jsonl")))  # one metrics file a run
    assert every - one <= 2 * (n_runs - 1), (one, after, every, n_runs)


@pytest.mark.parametrize("config", [c.stem for c in CONFIGS])
def test_shipped_pile_config_trains_with_overlap_like_without(runs, config):
    tmp = runs
    on, off = train_records(tmp / f"{config}-on.jsonl"), train_records(tmp / f"{config}-off.jsonl")
    assert sorted(on) == sorted(off) == [1, 2, 3]
    for i in on:
        assert on[i]["lm loss"] == off[i]["lm loss"], (config, i)
        assert on[i]["grad norm"] == pytest.approx(off[i]["grad norm"], rel=1e-6), (config, i)
        assert on[i]["grad norm"] > 0 and not on[i]["skipped"]
    # The shipped file's own settings were in force: bf16, LEV in unique mode, distributed optimizer.
    cfg = (tmp / f"{config}-on" / "iter_0000003" / "config.yaml").read_text()
    for setting in ("bf16: true", "lev_compute_mode: unique", "use_distributed_optimizer: true",
                    "overlap_grad_reduce: true"):
        assert setting in cfg.splitlines(), setting


@pytest.mark.parametrize("mode", ["unique", "table", "param-gather"])
def test_lev_resume_is_bit_exact_at_tp2_with_distributed_optimizer(runs, mode):
    tmp = runs
    full = train_records(tmp / f"{mode}-full.jsonl")
    first = train_records(tmp / f"{mode}-first.jsonl")
    resumed = train_records(tmp / f"{mode}-resumed.jsonl")
    assert sorted(first) == [1, 2] and sorted(resumed) == [3, 4]
    for i in (1, 2):
        assert first[i]["lm loss hex"] == full[i]["lm loss hex"]
    for i in (3, 4):
        assert resumed[i]["lm loss hex"] == full[i]["lm loss hex"], (mode, i)
        assert resumed[i]["grad norm"] == full[i]["grad norm"], (mode, i)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_table_mode_with_virtual_stages_overlaps_grad_reduce_like_without(runs, dtype):
    on = train_records(runs / f"vpp-table-{dtype}-on.jsonl")
    off = train_records(runs / f"vpp-table-{dtype}-off.jsonl")
    assert sorted(on) == sorted(off) == [1, 2, 3]
    for i in on:
        assert on[i]["lm loss hex"] == off[i]["lm loss hex"], (dtype, i)
        assert on[i]["grad norm"] == off[i]["grad norm"], (dtype, i)
        assert on[i]["grad norm"] > 0 and not on[i]["skipped"]
