"""bench/megatron_lm_flags.py, the counter of a Megatron-LM launch script's flags: which words count as
flags, how each launcher's training argv and world size are found, and that ``--stops`` reports a launch
it cannot read in one line. Small scripts written here (no Megatron-LM checkout needed)."""

from __future__ import annotations

import pytest

from tests.bench import load_bench

TAIL = ("pretrain_gpt.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
        "--expert-model-parallel-size 2 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
        "--seq-length 32 --micro-batch-size 1 --global-batch-size 8 --train-iters 2 --lr 1e-3 --mock-data "
        "--vocab-size 100 --disable-bias-linear --num-experts 4")


@pytest.fixture(scope="module")
def mf():
    return load_bench("megatron_lm_flags")


def test_layer_patterns_nsys_options_and_launcher_flags_are_not_counted(mf):
    text = ("nsys profile -s none -t nvtx,cuda --capture-range=cudaProfilerApi --force-overwrite true "
            "torchrun --nproc_per_node 8 --nnodes=2 pretrain_gpt.py --num-layers 4 \\\n"
            "  --hybrid-override-pattern --M-M-M*- --use-mcore-models  # --not-this\n"
            "PROF=\"nsys profile --trace=cuda,nvtx -o out\"\n")
    assert mf.script_flags(text) == ["--num-layers", "--hybrid-override-pattern", "--use-mcore-models"]


@pytest.mark.parametrize("launcher, world", [
    ("uv run --frozen python -m torch.distributed.run --nproc_per_node 4 --nnodes 2", 8),
    ("python3 -m torch.distributed.launch --nproc-per-node=8", 8),
    ("torchrun --nproc-per-node 2 --nnodes=1:4", 8),  # elastic min:max nodes: the max counts
    ("srun -N 2 --ntasks-per-node=8 --container-image=x python", None),
])
def test_each_launcher_gives_the_training_argv_and_its_world_size(mf, tmp_path, launcher, world):
    script = tmp_path / "train.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --nodes=2\nTP=2\n{launcher} {TAIL}\n")
    words, argv = mf.launch(str(script))
    assert argv[:2] == ["--tensor-model-parallel-size", "2"] and argv[-2:] == ["--num-experts", "4"]
    assert mf.launcher_world_size(words) == world


def test_stops_use_the_launch_world_size_not_tp_x_pp(mf, tmp_path, capsys):
    script = tmp_path / "ep.sh"
    script.write_text(f"torchrun --nproc_per_node 8 {TAIL}\n")
    # at TP x PP = 4 ranks, EP 2 x ETP 2 cannot fit in a stage of 2 ranks; at the launch's 8 ranks it does
    words, argv = mf.launch(str(script))
    assert any("expert" in m for m in mf.stops(argv)), mf.stops(argv)
    assert mf.stops(argv, mf.launcher_world_size(words)) == []
    other = tmp_path / "other.sh"
    other.write_text("echo no launch here\n")
    assert mf.main([str(other), "--stops"]) == 0
    out = capsys.readouterr().out
    assert f"- cannot tell: {other}: no training command was launched" in out, out
