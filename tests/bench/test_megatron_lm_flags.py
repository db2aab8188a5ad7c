"""bench/megatron_lm_flags.py, the counter of a Megatron-LM launch script's flags: which words count as
flags, how each launcher's training argv and world size are found, and that ``--stops`` reports a launch
it cannot read in one line; and where Megatron-LM's Llama-3 8B FP8 and Mixtral 8x7B launches stop (their
recorded launcher words and argv, ``tests/training/data/megatron_lm_examples.json``): only at what a machine
without CUDA and Transformer Engine cannot do, and nowhere with ``--assume-cuda-te``. Small scripts written
here (no Megatron-LM checkout needed)."""

from __future__ import annotations

import json
import shlex

import pytest

from tests.bench import REPO, load_bench

EXAMPLES = json.loads((REPO / "tests" / "training" / "data" / "megatron_lm_examples.json").read_text())
LLAMA = "examples/llama/train_llama3_8b_h100_fp8.sh"
MIXTRAL = "examples/mixtral/train_mixtral_8x7b_distributed.sh"

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


def test_env_sets_the_scripts_environment(mf, tmp_path):
    script = tmp_path / "nodes.sh"
    script.write_text(f'NNODES=${{SLURM_NNODES:-1}}\ntorchrun --nproc_per_node 8 --nnodes $NNODES {TAIL}\n')
    assert mf.launcher_world_size(mf.launch(str(script))[0]) == 8
    assert mf.launcher_world_size(mf.launch(str(script), env={"SLURM_NNODES": "4"})[0]) == 32


def _recorded_launch(tmp_path, script: str, sp_model: str):
    """A launch script of the recorded torchrun words and argv, its paths filled in."""
    paths = {"$CHECKPOINT_PATH": str(tmp_path / "ckpt"), "$TENSORBOARD_LOGS_PATH": str(tmp_path / "tb"),
             "$TOKENIZER_MODEL": sp_model, "$DATA_PATH": str(tmp_path / "data_text_document"),
             "$PWD": str(tmp_path)}
    words = [w for line in EXAMPLES["scripts"][script] for w in line.split(" ", 1)]
    for placeholder, value in paths.items():
        words = [w.replace(placeholder, value) for w in words]
    path = tmp_path / "launch.sh"
    path.write_text(f"torchrun {shlex.join(EXAMPLES['launchers'][script])} pretrain_gpt.py {shlex.join(words)}\n")
    return path


@pytest.mark.parametrize("script, world", [(LLAMA, 8), (MIXTRAL, 32)])
def test_llama3_fp8_and_mixtral_stop_only_at_cuda_and_transformer_engine(mf, tmp_path, capsys, tokenizer_files,
                                                                         script, world):
    path = _recorded_launch(tmp_path, script, tokenizer_files.sentencepiece_model)
    launcher, argv = mf.launch(str(path))
    assert mf.launcher_world_size(launcher) == world  # their own TP/PP/EP fit this world size
    here = mf.stops(argv, world)
    assert here and all(("CUDA" in m or "Transformer Engine" in m) and "\n" not in m for m in here), here
    assert mf.stops(argv, world, assume_cuda_te=True) == []
    capsys.readouterr()
    assert mf.main([str(path), "--stops", "--assume-cuda-te"]) == 0
    out = capsys.readouterr().out
    assert "stops on:\n- nothing: it parses" in out and "refused" not in out.split("stops on:")[1], out


def test_wrapping_commands_options_are_not_counted_over_continued_lines_and_capitalised_flags_are(mf):
    text = ('#SBATCH --nodes=2 --exclusive\n'
            'srun -l \\\n     --container-image "nvcr.io#nvidia/pytorch:24.01-py3" \\\n'
            '     --container-mounts "/a:/a" \\\n     --output=log.txt sh -c "${CMD}"\n'
            'mpirun --allow-run-as-root -np 8 python pretrain_gpt.py --DDP-impl local \\\n'
            '    --num-layers 2  # --not-this\n'
            'while [[ $# -gt 0 ]]; do case $1 in --checkpoint-path) CK=$2; shift 2;; --tokenizer|--tok) shift;; esac; done\n'
            'echo "  --checkpoint-path PATH   its checkpoint"; usage() { printf "  --data DIR\\n"; }\n'
            'PROFILE_CMD=(\n    nsys profile\n    --sample=none --cpuctxsw=none\n    # --a-comment\n'
            '    --capture-range=cudaProfilerApi -o "$OUT"\n)\nARGS=(\n    --hidden-size 8  # its width\n)\n')
    assert mf.script_flags(text) == ["--DDP-impl", "--num-layers", "--hidden-size"]


def test_sbatch_here_documents_scripts_and_wrap_commands_are_followed(mf, tmp_path):
    heredoc = tmp_path / "heredoc.sh"
    heredoc.write_text(f"#!/bin/bash\nsbatch --nodes=2 -J run <<EOF\n#!/bin/bash\n#SBATCH -t 1:00:00\n"
                       f"srun -N 2 --ntasks-per-node=8 python -u {TAIL}\nEOF\n")
    words, argv = mf.launch(str(heredoc))
    assert argv[:2] == ["--tensor-model-parallel-size", "2"] and argv[-2:] == ["--num-experts", "4"]
    inner = tmp_path / "SRUN.sh"
    inner.write_text(f'CMD="python -u {TAIL}"\nsrun -l --container-image "x#y" --output=o.log sh -c "${{CMD}}"\n')
    outer = tmp_path / "SBATCH.sh"
    outer.write_text("source conf/args.sh\nsbatch -p part -A acct --nodes=4 SRUN.sh\nexit 0\n")  # beside it
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "args.sh").write_text("export UNUSED=1\n")
    assert mf.launch(str(outer))[1][-2:] == ["--num-experts", "4"]
    wrapped = tmp_path / "wrap.sh"
    wrapped.write_text(f"sbatch --nodes=1 --wrap='torchrun --nproc_per_node 8 {TAIL}'\n")
    words, argv = mf.launch(str(wrapped))
    assert mf.launcher_world_size(words) == 8 and argv[-2:] == ["--num-experts", "4"]


def test_script_args_pass_flags_with_their_values_and_help_is_whole(mf, tmp_path, capsys):
    script = tmp_path / "args.sh"
    script.write_text('torchrun --nproc_per_node 8 pretrain_gpt.py "$@"\n')
    argv = TAIL.split()[1:]
    assert mf.launch(str(script), argv)[1] == argv
    assert mf.main([str(script), "--stops", "--script-args", " ".join(argv)]) == 0
    assert "stops on:\n- nothing: it parses" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        mf.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "accepts, refuses by name, or does not know." in help_text, help_text
