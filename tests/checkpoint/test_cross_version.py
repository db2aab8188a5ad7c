"""Checkpoints across megatron-core releases, each written and read by its own environment: make test's
.venv (Python 3.11, megatron-core 0.16.1) and make test-next's .venv-next (Python 3.12, 0.19.x).

A 0.16.1 checkpoint (common state in ``common.pt``) resumed under 0.19 reproduces the uninterrupted 0.16.1
run bit for bit at TP=2 with the distributed optimizer; a 0.19 checkpoint (common state inside the
torch_dist files) is refused by 0.16.1 in one line. Runs from the newer environment (make test-next), and
needs both virtual environments beside the repository."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_lev.compat.versions import megatron_core_version
from megatron_lev.testing import free_port, train_records

REPO = Path(__file__).resolve().parents[2]
OLD, NEXT = REPO / ".venv" / "bin" / "python", REPO / ".venv-next" / "bin" / "python"

ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3", "--min-lr", "3e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.0", "--position-embedding-type", "rope",
        "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--mock-data", "--vocab-size", "1000",
        "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1", "--quiet-config",
        "--input-embedding", "lev", "--lev-seed-dim", "16", "--lev-rank", "8", "--lev-heads", "2", "--lev-knots", "8",
        "--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]


def _version_of(python: Path) -> str:
    r = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('megatron-core'))"],
                       capture_output=True, text=True, timeout=60)
    return r.stdout.strip() if r.returncode == 0 else f"unusable ({r.stderr.strip().splitlines()[-1:]})"


@pytest.fixture(scope="module")
def interpreters():
    if megatron_core_version().release[:2] < (0, 19):
        pytest.skip(f"cross-release checkpoints are checked from the megatron-core 0.19 environment (make "
                    f"test-next); this one has {megatron_core_version()}")
    missing = [str(p) for p in (OLD, NEXT) if not p.exists()]
    if missing:
        pytest.skip(f"cross-release checkpoints need both environments; missing {', '.join(missing)} "
                    "(make setup and make test-next build them)")
    old, new = _version_of(OLD), _version_of(NEXT)
    assert old.startswith("0.16."), f"{OLD}: megatron-core {old}, expected 0.16.x"
    assert new.startswith("0.19."), f"{NEXT}: megatron-core {new}, expected 0.19.x"
    return OLD, NEXT


def _run(python: Path, args, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [str(python), "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(REPO / "pretrain_lev.py")] + ARGS + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=str(REPO))
    if check and r.returncode != 0:
        raise AssertionError(f"{python}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    return r


def _checkpoint_at(src: Path, iteration: int, dst: Path) -> Path:
    dst.mkdir()
    name = f"iter_{iteration:07d}"
    shutil.copytree(src / name, dst / name)
    (dst / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    return dst


@pytest.mark.slow
def test_a_0161_checkpoint_resumes_bit_for_bit_under_019(interpreters, tmp_path):
    old, new = interpreters
    _run(old, ["--train-iters", "6", "--save", str(tmp_path / "ck"), "--save-interval", "3",
               "--metrics-file", str(tmp_path / "ref.jsonl")])
    assert (tmp_path / "ck" / "iter_0000003" / "common.pt").is_file()  # 0.16.1's layout
    ck3 = _checkpoint_at(tmp_path / "ck", 3, tmp_path / "ck3")
    r = _run(new, ["--train-iters", "6", "--load", str(ck3), "--metrics-file", str(tmp_path / "resumed.jsonl")])
    assert "successfully loaded checkpoint" in r.stdout
    ref, resumed = train_records(tmp_path / "ref.jsonl"), train_records(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == [4, 5, 6]
    for it in (4, 5, 6):
        assert resumed[it]["lm loss hex"] == ref[it]["lm loss hex"], it
        assert resumed[it]["grad norm"] == ref[it]["grad norm"], it
        assert resumed[it]["lr"] == ref[it]["lr"], it
    assert r.stdout.count("GPTModel IS DEPRECATED") + r.stderr.count("GPTModel IS DEPRECATED") <= 1


@pytest.mark.slow
def test_a_019_checkpoint_is_refused_by_0161_in_one_line(interpreters, tmp_path):
    old, new = interpreters
    _run(new, ["--train-iters", "3", "--save", str(tmp_path / "ck"), "--save-interval", "3"])
    assert not (tmp_path / "ck" / "iter_0000003" / "common.pt").exists()  # 0.19's layout
    r = _run(old, ["--train-iters", "6", "--load", str(tmp_path / "ck")], check=False)
    assert r.returncode != 0
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "written by megatron-core" in ln]
    assert lines, r.stderr[-3000:]
    assert "import-hf" in lines[0] and "0.16.1" in lines[0]
    assert "exitcode: 2" in r.stderr  # each rank's own exit: a checkpoint error, no traceback of ours
    assert f'File "{REPO / "megatron_lev"}' not in r.stdout + r.stderr, r.stderr[-3000:]
