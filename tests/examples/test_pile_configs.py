"""The shipped Pile configs under their launch layout, and the environment the launch scripts give torchrun.

* Each config's LEV compute mode follows ``models.config.lev_compute_mode_for`` for train.sbatch's
  allocation (nodes x GPUs per node read from its #SBATCH lines, TP from the config): table mode only
  where the padded vocabulary is at most the tokens a data-parallel rank trains on per step. The
  config's comment states the figures it was chosen from.
* train.sh (alone, and under train.sbatch's srun) starts torchrun with CUDA_DEVICE_MAX_CONNECTIONS=1
  unless the caller set another value.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from megatron_lev.models.config import lev_compute_mode_for, tokens_per_data_parallel_rank
from megatron_lev.tokenizer import padded_vocab_size

from .test_pile_scripts import SCONTROL, SRUN

REPO = Path(__file__).resolve().parents[2]
PILE_DIR = REPO / "examples" / "pile"
O200K_VOCAB = 200_019  # o200k_base's ids, the tokenizer of the configs (README.md, param_breakdown.py)
SCALES = sorted(p.stem for p in (PILE_DIR / "configs").glob("*.yaml"))


def _sbatch_layout():
    text = (PILE_DIR / "train.sbatch").read_text()
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", text, re.M).group(1))
    gpus = int(re.search(r"^#SBATCH --gpus-per-node=(\d+)$", text, re.M).group(1))
    return nodes, gpus


def test_the_configs_are_the_ones_shipped():
    assert SCALES == ["1.2b", "200m", "400m"]
    assert _sbatch_layout() == (4, 8)


@pytest.mark.parametrize("scale", SCALES)
def test_shipped_lev_compute_mode_follows_the_rule_at_the_launch_layout(scale):
    from megatron_lev.arguments import parse_args

    nodes, gpus = _sbatch_layout()
    path = PILE_DIR / "configs" / f"{scale}.yaml"
    args = parse_args(["--config", str(path), "--mock-data", "--vocab-size", str(O200K_VOCAB), "--input-embedding", "lev",
                       "--save", "unused"],
                      world_size=nodes * gpus)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    assert args.data_parallel_size == nodes * gpus // (tp * pp)
    V = padded_vocab_size(O200K_VOCAB, args.make_vocab_size_divisible_by, tp)
    tokens = tokens_per_data_parallel_rank(global_batch_size=args.global_batch_size, seq_length=args.seq_length,
                                           data_parallel_size=args.data_parallel_size)
    expected = lev_compute_mode_for(vocab_size=V, tokens_per_rank_per_step=tokens)
    assert args.lev_compute_mode == expected, (scale, V, tokens, args.lev_compute_mode)
    # The reason is written next to the setting, with these figures.
    text = path.read_text()
    assert f"V = {V:,}" in text and f"= {tokens:,}" in text and f"DP {args.data_parallel_size}" in text, scale


def _fake_torchrun(tmp_path: Path) -> Path:
    stub = tmp_path / "torchrun"
    stub.write_text('#!/usr/bin/env bash\necho "CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS-unset}" '
                    '>> "$RECORD"\n')
    stub.chmod(0o755)
    return stub


def _inputs(tmp_path: Path):
    data = tmp_path / "pile"
    data.mkdir()
    (data / "data_path.txt").write_text("1 /nonexistent/pile_00_text_document")
    tok = tmp_path / "o200k.tiktoken"
    tok.write_text("")
    return data, tok


def _env(tmp_path: Path, **extra):
    data, tok = _inputs(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    env.update(PILE_DATA=str(data), TOKENIZER=str(tok), TORCHRUN=str(_fake_torchrun(tmp_path)),
               RECORD=str(tmp_path / "record.txt"), CKPT_ROOT=str(tmp_path / "ck"))
    env.update(extra)
    return env


def test_train_sh_starts_torchrun_with_one_cuda_connection(tmp_path):
    env = _env(tmp_path)
    r = subprocess.run(["bash", str(PILE_DIR / "train.sh"), "1.2b", "lev"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "record.txt").read_text().split() == ["CUDA_DEVICE_MAX_CONNECTIONS=1"]
    # A value the caller chose is kept (e.g. FSDP, which wants more than one connection).
    (tmp_path / "record.txt").unlink()
    r = subprocess.run(["bash", str(PILE_DIR / "train.sh"), "1.2b", "lev"],
                       env=dict(env, CUDA_DEVICE_MAX_CONNECTIONS="8"), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "record.txt").read_text().split() == ["CUDA_DEVICE_MAX_CONNECTIONS=8"]


def test_train_sbatch_nodes_start_torchrun_with_one_cuda_connection(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = _env(tmp_path, SLURM_JOB_ID="7", SLURM_NNODES="2", SLURM_JOB_NODELIST="node[0-1]",
               SLURM_SUBMIT_DIR=str(REPO), FAKE_SLURM_DIR=str(tmp_path))
    env["PATH"] = os.pathsep.join([str(bin_dir), env["PATH"]])
    r = subprocess.run(["bash", str(PILE_DIR / "train.sbatch"), "1.2b", "lev"], env=env, capture_output=True,
                       text=True, timeout=60, cwd=str(tmp_path))
    # The stand-in torchrun trains nothing, so the job ends without a checkpoint (an error): the nodes ran.
    assert "no newer checkpoint" in r.stderr, r.stderr
    assert (tmp_path / "record.txt").read_text().split() == ["CUDA_DEVICE_MAX_CONNECTIONS=1"] * 2


def test_param_breakdown_prints_the_readmes_table(capsys):
    """examples/pile/param_breakdown.py builds each arm at each shipped scale as pretrain_lev.py would and prints
    the README's parameter table, row for row (it broke unnoticed once when the model factory moved)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("param_breakdown", PILE_DIR / "param_breakdown.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([]) == 0
    row = re.compile(r"^\| ({}) \| (tied|untied|albert|flat_mlp|factored_mlp|lev)\b".format("|".join(map(re.escape, SCALES))))
    printed = [ln for ln in capsys.readouterr().out.splitlines() if row.match(ln)]
    readme = [ln for ln in (PILE_DIR / "README.md").read_text().splitlines() if row.match(ln)]
    assert len(printed) == len(SCALES) * 6 and printed == readme
