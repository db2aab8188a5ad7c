"""``RunConfig`` holds everything ``megatron_lev/training/`` reads from the arguments, and reads the same
configuration from the parsed arguments and from the saved ones (``config.yaml``, including a file that
predates some flags and derived values). Parsing only: no model, no process group."""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path

import pytest
import yaml

from megatron_lev.arguments import config_to_yaml, parse_args, parse_run_config, resolved_config
from megatron_lev.config import RunConfig, flat_names
from megatron_lev.arguments.validate import FOLDED_INTO
from megatron_lev.lev.config import ConfigError

from .test_arguments_read import _ARGS_RECEIVER, typed_reads

ROOT = Path(__file__).resolve().parents[2]
TRAINING = ROOT / "megatron_lev" / "training"
BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--train-iters 8 --lr 1e-3 --mock-data --vocab-size 100").split()
# (extra flags, world size): defaults, a data-parallel world, TP x PP with virtual stages and experts,
# every group's non-default values.
CASES = {
    "defaults": ([], 1),
    "data_parallel": (["--global-batch-size", "8", "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
                       "--overlap-param-gather"], 4),
    "model_parallel": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
                        "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "8",
                        "--num-experts", "2", "--expert-model-parallel-size", "2", "--disable-bias-linear"], 8),
    "groups": (["--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--min-lr", "1e-5", "--clip-grad", "0.5",
                "--optimizer", "sgd", "--exit-duration-in-mins", "30", "--save", "/tmp/rc_ckpt", "--save-interval",
                "4", "--log-interval", "2", "--tensorboard-dir", "/tmp/rc_tb", "--seed", "7", "--profile",
                "--profile-ranks", "0", "1", "--global-batch-size", "4",
                "--eod-mask-loss", "--no-mmap-bin-files", "--fp16", "--loss-scale-window", "500"], 2),
}


def _parsed(case):
    extra, world = CASES[case]
    args = parse_args(BASE + extra, world_size=world)
    args.padded_vocab_size = 128  # what training sets once the tokenizer is built
    args.tokenizer_fingerprint = {"type": "NullTokenizer", "vocab_size": 100}
    return args


def namespace_reads(source: str):
    """Where ``source`` reads an argument namespace: ``<...>args.NAME``, ``getattr(<...>args, ...)``,
    ``vars(<...>args)``; as (line, code) pairs."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _ARGS_RECEIVER.search(ast.unparse(node.value)):
            out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "vars") and node.args \
                and _ARGS_RECEIVER.search(ast.unparse(node.args[0])):
            out.append((node.lineno, ast.unparse(node)))
    return out


@pytest.mark.parametrize("module", sorted(p.name for p in TRAINING.glob("*.py")))
def test_training_reads_the_run_config_not_an_argument_namespace(module):
    """Every module of megatron_lev/training/ reads the typed RunConfig; the flat namespace is what the
    parser makes and ``arguments`` checks; ``RunConfig.flat()`` is gone (every call took typed fields)."""
    reads = namespace_reads((TRAINING / module).read_text(encoding="utf-8"))
    assert not reads, f"megatron_lev/training/{module} reads the argument namespace (read RunConfig's fields): {reads}"


def test_the_namespace_walk_finds_each_way_of_reading():
    code = "def f(args, run):\n    return args.lr, run.args.seed, getattr(args, 'bf16'), vars(run.args), run.rc.lr"
    assert [c for _, c in namespace_reads(code)] == ["args.lr", "run.args.seed", "getattr(args, 'bf16')",
                                                     "vars(run.args)"]


def test_every_field_training_reads_is_a_run_config_field():
    reads = set()
    for path in TRAINING.glob("*.py"):
        reads |= typed_reads(ast.parse(path.read_text(encoding="utf-8")))
    assert {"train_iters", "tokenizer_type", "inject_nan_at_iteration", "metrics_file", "seq_length"} <= reads
    assert reads <= set(flat_names())


@pytest.mark.parametrize("case", sorted(CASES))
def test_saved_arguments_give_the_parsed_configuration(case):
    args = _parsed(case)
    rc = RunConfig.from_args(args)
    assert RunConfig.from_saved_args(vars(args)) == rc
    saved = yaml.safe_load(config_to_yaml(resolved_config(args)))  # config.yaml as written beside a checkpoint
    assert RunConfig.from_saved_args(saved) == rc
    assert RunConfig.from_saved_args(rc.to_saved_args()) == rc
    for name in flat_names():  # every field holds the argument's value
        if name in vars(args) and name != "virtual_pipeline_model_parallel_size":
            assert rc.to_saved_args()[name] == getattr(args, name), name


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_saved_arguments_are_config_yaml(case):
    """``to_saved_args`` is today's config.yaml, key by key: the checkpoint writer can save it instead of
    the namespace."""
    args = _parsed(case)
    written = yaml.safe_load(config_to_yaml(resolved_config(args)))
    assert yaml.safe_load(config_to_yaml(RunConfig.from_args(args).to_saved_args())) == written
    # Training writes resolved_config(rc.to_saved_args()): the same text (1000 stays 1000, not 1000.0).
    assert config_to_yaml(resolved_config(RunConfig.from_args(args).to_saved_args())) == config_to_yaml(resolved_config(args))


def test_each_argument_has_one_field():
    names = flat_names()
    assert len(names) == len(set(names)), sorted(n for n in set(names) if names.count(n) > 1)


def test_the_folded_flags_are_saved_as_given():
    args = parse_args(BASE + ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                              "--num-layers-per-virtual-pipeline-stage", "1", "--recompute-activations",
                              "--untie-embeddings-and-output-weights", "--group-query-attention",
                              "--num-query-groups", "2", "--bf16", "--grad-reduce-in-bf16", "--global-batch-size", "4"],
                      world_size=2)
    rc = RunConfig.from_args(args)
    assert set(f.name for f in dataclasses.fields(rc.folded)) == set(FOLDED_INTO)
    assert dataclasses.asdict(rc.folded) == {"num_layers_per_virtual_pipeline_stage": 1, "recompute_activations": True,
                                             "untie_embeddings_and_output_weights": True, "grad_reduce_in_bf16": True,
                                             "group_query_attention": True}
    assert "_no_position_embedding" not in flat_names()  # a check's flag only, never written to config.yaml


def test_parse_run_config_is_the_configuration_of_the_validated_arguments(tmp_path):
    extra, world = CASES["model_parallel"]
    rc = parse_run_config(BASE + extra, world_size=world)
    assert rc == RunConfig.from_args(parse_args(BASE + extra, world_size=world))
    assert rc.layout.vpp == 2 and rc.model.padded_vocab_size is None  # validated: the folded flag is the layout's
    config = tmp_path / "run.yaml"
    config.write_text("micro_batch_size: 1\n")
    assert parse_run_config(["--config", str(config)] + BASE[:8] + BASE[10:], world_size=1).schedule.micro_batch_size == 1
    with pytest.raises(ConfigError, match=r"^--train-iters \(or --train-samples\) is required$"):
        parse_run_config([a for a in BASE if a not in ("--train-iters", "8")], world_size=1)


def test_the_groups_hold_the_values_the_flags_set():
    rc = RunConfig.from_args(_parsed("model_parallel"))
    assert (rc.layout.tp, rc.layout.pp, rc.layout.vpp, rc.layout.ep, rc.layout.dp) == (2, 2, 2, 2, 2)
    assert rc.schedule.num_microbatches == 2 and rc.schedule.global_batch_size == 8
    rc = RunConfig.from_args(_parsed("groups"))
    assert rc.optimizer.optimizer == "sgd" and rc.schedule.lr_decay_style == "cosine"
    assert rc.run.profile_ranks == [0, 1] and (rc.schedule.num_microbatches, rc.layout.dp) == (1, 2)
    assert rc.checkpointing.save == "/tmp/rc_ckpt" and rc.logging.tensorboard_dir == "/tmp/rc_tb"
    assert isinstance(rc.optimizer.loss_scale_window, float) and rc.model.params_dtype_name == "float16"
    assert rc.data.mmap_bin_files is False and rc.model.padded_vocab_size == 128


def test_an_older_config_yaml_loads_with_the_flag_defaults_and_derived_values():
    args = _parsed("data_parallel")
    saved = resolved_config(args)
    for key in ("world_size", "num_microbatches", "params_dtype_name", "log_world_size_to_tensorboard",
                "tokenizer_fingerprint", "dist_ckpt_optim_fully_reshardable"):
        saved.pop(key)
    saved["log_throughput"] = False  # a key of an older file that no field takes
    old, new = RunConfig.from_saved_args(saved), RunConfig.from_args(args)
    assert old.layout == new.layout and old.schedule == new.schedule and old.model == new.model
    assert old.data == dataclasses.replace(new.data, tokenizer_fingerprint=None)


def test_an_infinite_float_reads_back_from_config_yaml_and_meets_the_fields_range():
    args = _parsed("defaults")
    args.moe_aux_loss_coeff = math.inf  # a field without a range
    saved = yaml.safe_load(config_to_yaml(resolved_config(args)))
    assert saved["moe_aux_loss_coeff"] == "inf"
    assert RunConfig.from_saved_args(saved).model.moe_aux_loss_coeff == math.inf
    saved["clip_grad"] = "inf"  # --clip-grad refuses inf; so does its field when the file is read back
    with pytest.raises(ConfigError, match=r"^config.yaml: clip_grad is inf, which must be finite and >= 0; put back"):
        RunConfig.from_saved_args(saved)


def test_a_broken_saved_file_is_one_line_naming_the_key():
    saved = resolved_config(_parsed("defaults"))
    saved["lr"] = "fast"
    with pytest.raises(ConfigError, match=r"^config.yaml: lr: 'fast' is not a number$"):
        RunConfig.from_saved_args(saved)
    saved = resolved_config(_parsed("data_parallel"))
    saved["data_parallel_size"] = 3
    with pytest.raises(ConfigError, match="data_parallel_size 3") as e:
        RunConfig.from_saved_args(saved)
    assert "\n" not in str(e.value)


def test_the_tokenizer_fills_the_rows_and_the_fingerprint():
    from megatron_lev.tokenizer import TokenizerSpec, tokenizer_fingerprint

    rc = parse_run_config(BASE + ["--tensor-model-parallel-size", "2"], world_size=2)
    tokenizer = TokenizerSpec.from_args(rc.data).build()
    filled = rc.with_tokenizer(tokenizer)
    assert filled.model.padded_vocab_size == 256  # 100 ids padded to a multiple of 128 x TP 2
    assert filled.data.tokenizer_fingerprint == tokenizer_fingerprint(tokenizer)
    assert dataclasses.replace(filled, model=rc.model, data=rc.data) == rc  # nothing else changes


# config.yaml as the last release before RunConfig wrote it (0a9b888; bench/same_training.sh's TP=2 lev run,
# its paths replaced): TP=2 with sequence parallelism, the distributed optimizer, bf16, a cosine schedule.
RELEASED = Path(__file__).parent / "data" / "config_0a9b888_lev_tp2.yaml"
RELEASED_ARGV = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --global-batch-size 4 "
    "--train-iters 6 --lr 1e-3 --lr-decay-style cosine --lr-warmup-iters 1 --mock-data --vocab-size 1000 "
    "--tokenizer-type NullTokenizer --log-interval 1 --eval-interval 3 --eval-iters 1 --quiet-config "
    "--hidden-dropout 0 --attention-dropout 0 --lev-seed-dim 16 --lev-rank 8 --lev-heads 2 --lev-knots 8 "
    "--save-interval 3 --seed 7 --input-embedding lev --tensor-model-parallel-size 2 --sequence-parallel "
    "--use-distributed-optimizer --bf16 --save /checkpoints/lev-tp2 --metrics-file /checkpoints/lev-tp2/metrics.jsonl"
).split()


# Saved settings that flags added after that release brought, with the value a run without them has.
ADDED_SINCE_0A9B888 = {"ckpt_fully_parallel_load": False, "qk_layernorm": False, "use_cpu_initialization": None,
                       "log_progress": False, "wandb_entity": None,
                       "allow_missing_ckpt_checksums": False, "use_rope_scaling": False, "rope_scaling_factor": 8.0,
                       "adam_impl": "auto", "pytorch_profiler_collect_shapes": False}


def test_a_released_config_yaml_reads_as_the_same_flags_parse_today():
    from megatron_lev.tokenizer import TokenizerSpec

    saved = yaml.safe_load(RELEASED.read_text(encoding="utf-8"))
    rc = RunConfig.from_saved_args(saved, source=str(RELEASED))
    now = parse_run_config(RELEASED_ARGV, world_size=2)
    assert rc == now.with_tokenizer(TokenizerSpec.from_args(now.data).build())
    assert rc.layout.tp == 2 and rc.layout.dp == 1 and rc.model.sequence_parallel and rc.model.bf16
    # Written back, it is the released file key by key, and the settings added since at their defaults.
    written = yaml.safe_load(config_to_yaml(resolved_config(rc.to_saved_args())))
    assert {k: v for k, v in written.items() if k in saved} == saved
    assert {k: v for k, v in written.items() if k not in saved} == ADDED_SINCE_0A9B888
