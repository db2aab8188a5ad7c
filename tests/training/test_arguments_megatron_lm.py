"""Megatron-LM's argument vocabulary against pretrain_lev.py's parser: every Megatron-LM flag we accept
changes the resolved arguments (parsed with and without it) or is a documented no-op; every refused one
is refused in one line naming it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from megatron_lev.arguments import build_parser, parse_args, resolved_config
from megatron_lev.arguments.megatron_lm import NO_OPS, REFUSED, refusal
from megatron_lev.lev.config import ConfigError

VOCABULARY = [line.strip() for line in (Path(__file__).parent / "data" / "megatron_lm_flags.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--train-iters 4 --lr 1e-3 --mock-data --vocab-size 100").split()
# Flags that need another flag to be valid, and flags whose value must be given.
NEEDS = {
    "--fp8-amax-history-len": ["--bf16", "--fp8-format", "hybrid"], "--fp8-amax-compute-algo": ["--bf16", "--fp8-format", "hybrid"],
    "--fp8-margin": ["--bf16", "--fp8-format", "hybrid"], "--fp8-recipe": ["--bf16", "--fp8-format", "hybrid"],
    "--fp8-param-gather": ["--bf16", "--fp8-format", "hybrid", "--use-distributed-optimizer"],
    "--grad-reduce-in-bf16": ["--bf16"], "--overlap-param-gather": ["--use-distributed-optimizer"],
    "--save-interval": ["--save", "ckpt"], "--ckpt-step": ["--load", "ckpt"], "--skip-train": ["--load", "ckpt"],
    "--lr-wsd-decay-iters": ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "1"],
    "--group-query-attention": ["--num-query-groups", "2"], "--num-query-groups": ["--group-query-attention", "--num-query-groups", "4"],
    "--manual-gc-interval": ["--manual-gc"], "--disable-manual-gc-eval": ["--manual-gc"],
    "--profile-step-start": ["--profile"], "--profile-step-end": ["--profile"], "--profile-ranks": ["--profile"],
    "--use-pytorch-profiler": ["--profile", "--tensorboard-dir", "tb"],
    "--recompute-method": ["--recompute-granularity", "full"], "--recompute-num-layers": ["--recompute-granularity", "full"],
    "--wandb-exp-name": ["--wandb-project", "p"], "--wandb-save-dir": ["--wandb-project", "p"],
    "--wandb-entity": ["--wandb-project", "p"],
    "--use-rope-scaling": ["--position-embedding-type", "rope"],
    "--rope-scaling-factor": ["--position-embedding-type", "rope", "--use-rope-scaling"],
}
VALUES = {"--split": "90,10,0", "--data-cache-path": "cache", "--tensorboard-dir": "tb", "--save": "ckpt", "--load": "ckpt",
          "--num-query-groups": "2", "--kv-channels": "8", "--max-position-embeddings": "64", "--global-batch-size": "4",
          "--num-layers": "4", "--wandb-project": "p", "--wandb-exp-name": "e", "--wandb-save-dir": "w",
          "--ffn-hidden-size": "96", "--lr-decay-iters": "3", "--lr-warmup-iters": "1", "--vocab-size": "120",
          "--micro-batch-size": "1", "--min-lr": "1e-4", "--moe-layer-freq": "[1,0]"}


def _value(action: argparse.Action, flag: str):
    """A valid value for ``flag`` other than its default (None for a flag without one)."""
    if action.nargs == 0:
        return []
    if flag in VALUES:
        return [VALUES[flag]]
    if action.choices:
        other = [c for c in action.choices if c != action.default]
        return [str(other[0])] if other else None  # one choice only (--ckpt-format torch_dist)
    kind = getattr(action.type, "kind", action.type)  # a numeric flag's type is a Number (with its range)
    if kind is int:
        default = action.default[0] if isinstance(action.default, list) else action.default
        return [str((default or 0) + 2)] * (action.nargs if isinstance(action.nargs, int) else 1)
    if kind is float:
        return [str((action.default or 0.0) / 2 + 0.037)]
    return ["x"]


def test_every_accepted_megatron_lm_flag_changes_the_resolved_arguments(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parser = build_parser()
    accepted = [f for f in VOCABULARY if f in parser._option_string_actions]
    assert len(accepted) > 100
    base = resolved_config(parse_args(BASE, world_size=1))
    unused, unnamed = [], []
    for flag in accepted:
        # --mock-data is in BASE; the parallel sizes need more ranks (the multi-rank tests use them), and so
        # does --sequence-parallel (switched off at TP=1: the test below).
        if flag in NO_OPS or flag in ("--help", "--mock-data", "--tensor-model-parallel-size",
                                      "--pipeline-model-parallel-size", "--sequence-parallel"):
            continue
        action = parser._option_string_actions[flag]
        pre = NEEDS.get(flag, [])
        before = base if not pre else resolved_config(parse_args(BASE + pre, world_size=1))
        value = _value(action, flag)
        if value is None:
            continue
        try:
            after = resolved_config(parse_args(BASE + pre + [flag] + value, world_size=1))
        except ConfigError as e:  # refused at this value (e.g. --context-parallel-size 2): named in one line
            if flag not in str(e) or "\n" in str(e):
                unnamed.append((flag, str(e)))
            continue
        if after == before:
            unused.append(flag)
    assert not unnamed, f"refusals that do not name their flag: {unnamed}"
    assert not unused, f"accepted Megatron-LM flags that change nothing and are not in NO_OPS: {unused}"


def test_no_ops_are_accepted_and_leave_the_arguments_alone():
    base = resolved_config(parse_args(BASE, world_size=1))
    assert set(NO_OPS) <= set(VOCABULARY) and set(NO_OPS) <= set(build_parser()._option_string_actions)
    for flag in ("--use-mcore-models", "--no-create-attention-mask-in-dataloader", "--use-flash-attn",
                 "--log-throughput", "--auto-detect-ckpt-format"):
        assert resolved_config(parse_args(BASE + [flag], world_size=1)) == base


def test_no_position_embedding_is_taken_with_rope_only_as_in_megatron_lm():
    rope = BASE + ["--position-embedding-type", "rope"]
    assert resolved_config(parse_args(rope + ["--no-position-embedding"], world_size=1)) == resolved_config(
        parse_args(rope, world_size=1))
    with pytest.raises(ConfigError) as e:
        parse_args(BASE + ["--position-embedding-type", "learned_absolute", "--no-position-embedding"], world_size=1)
    assert str(e.value) == ("--no-position-embedding is deprecated and taken only with --position-embedding-type "
                            "rope (got learned_absolute); use --position-embedding-type none")


@pytest.mark.parametrize("flag", sorted(REFUSED) + ["--moe-expert-capacity-factor", "--cuda-graph-scope", "--inference-max-requests",
                                  "--fsdp-double-buffer", "--megatron-fsdp-main-params-dtype", "--no-tp-comm-overlap-ag"])
def test_refused_flags_are_named_in_one_line(flag):
    assert flag in VOCABULARY, flag
    with pytest.raises(ConfigError) as e:
        parse_args(BASE + [flag, "1"] if flag not in ("--use-megatron-fsdp",) else BASE + [flag], world_size=1)
    assert str(e.value).startswith(flag + ":") and "\n" not in str(e.value)
    assert refusal(flag)


def test_an_unknown_flag_is_still_an_error():
    with pytest.raises(ConfigError, match="unrecognized arguments: --no-such-flag"):
        parse_args(BASE + ["--no-such-flag"], world_size=1)


def test_sequence_parallel_at_tp1_is_switched_off_with_one_warning_as_megatron_lm_does(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    args = parse_args(BASE + ["--sequence-parallel"], world_size=1)
    err = capsys.readouterr().err.strip().splitlines()
    assert args.sequence_parallel is False
    assert len(err) == 1 and err[0].startswith("WARNING: --sequence-parallel is switched off"), err
    monkeypatch.setenv("RANK", "1")  # the other ranks say nothing
    parse_args(BASE + ["--sequence-parallel"], world_size=1)
    assert capsys.readouterr().err == ""
    tp2 = parse_args(BASE + ["--sequence-parallel", "--tensor-model-parallel-size", "2"], world_size=2)
    assert tp2.sequence_parallel is True and capsys.readouterr().err == ""


def test_num_query_groups_without_group_query_attention_is_ignored_with_one_warning(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    args = parse_args(BASE + ["--num-query-groups", "2"], world_size=1)
    err = capsys.readouterr().err.strip().splitlines()
    assert args.num_query_groups is None and args.group_query_attention is False
    assert len(err) == 1 and err[0].startswith("WARNING: --num-query-groups 2 is ignored without "
                                               "--group-query-attention"), err
    gqa = parse_args(BASE + ["--num-query-groups", "2", "--group-query-attention"], world_size=1)
    assert gqa.num_query_groups == 2 and gqa.group_query_attention is True and capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match="^--group-query-attention needs --num-query-groups$"):
        parse_args(BASE + ["--group-query-attention"], world_size=1)


@pytest.mark.parametrize("heads, groups, tp, ok", [(4, 2, 2, True), (4, 1, 2, True), (8, 2, 4, True),
                                                   (6, 3, 2, False), (4, 4, 8, False)])
def test_query_groups_against_tp_follow_megatron_cores_rule(heads, groups, tp, ok):
    """megatron-core's TransformerConfig: the groups a multiple or a divisor of TP (fewer groups than TP
    ranks replicate the keys and values), checked once, by the model config."""
    argv = BASE + ["--num-attention-heads", str(heads), "--hidden-size", str(16 * heads), "--group-query-attention",
                   "--num-query-groups", str(groups), "--tensor-model-parallel-size", str(tp)]
    if ok:
        assert parse_args(argv, world_size=tp).num_query_groups == groups
        return
    with pytest.raises(ConfigError) as e:
        parse_args(argv, world_size=tp)
    assert str(e.value).startswith("--num-") and "\n" not in str(e.value)


def test_log_throughput_is_a_no_op_and_an_older_config_yaml_holding_it_still_loads(tmp_path):
    base = resolved_config(parse_args(BASE, world_size=1))
    assert resolved_config(parse_args(BASE + ["--log-throughput"], world_size=1)) == base
    assert "log_throughput" not in base  # not saved with the checkpoint as if it chose something
    old = tmp_path / "config.yaml"
    old.write_text("log_throughput: false\nnum_layers: 3\n")
    assert parse_args(BASE + ["--config", str(old)], world_size=1).num_layers == 2  # the command line wins
    assert BASE[:2] == ["--num-layers", "2"]
    assert parse_args(BASE[2:] + ["--config", str(old)], world_size=1).num_layers == 3


def test_llama2_tokenizer_is_megatron_lms_sentencepiece_tokenizer(tokenizer_files):
    from megatron_lev.tokenizer import TokenizerSpec, tokenizer_fingerprint

    sp = ["--tokenizer-model", tokenizer_files.sentencepiece_model]
    data = BASE[:BASE.index("--mock-data")] + ["--data-path", "corpus"]
    built = {}
    for name in ("Llama2Tokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        args = parse_args(data + ["--tokenizer-type", name] + sp, world_size=1)
        assert args.tokenizer_type == name
        built[name] = TokenizerSpec.from_args(args).build()
    text = "The quick brown fox, 1234."
    ids = {name: tok.tokenize(text) for name, tok in built.items()}
    assert ids["Llama2Tokenizer"] == ids["SentencePieceTokenizer"] == ids["GPTSentencePieceTokenizer"]
    # the same tokenizer: datasets preprocessed under one name train under another
    assert len({str(tokenizer_fingerprint(t)) for t in built.values()}) == 1
    with pytest.raises(ConfigError, match="^--tokenizer-type Llama2Tokenizer needs --tokenizer-model$"):
        parse_args(data + ["--tokenizer-type", "Llama2Tokenizer"], world_size=1)


@pytest.mark.parametrize("name", ["BertWordPieceLowerCase", "BertWordPieceCase", "MultimodalTokenizer",
                                  "NullMultimodalTokenizer", "SFTTokenizer"])
def test_megatron_lms_other_tokenizer_types_are_refused_with_the_reason(name):
    with pytest.raises(ConfigError) as e:
        parse_args(BASE + ["--tokenizer-type", name], world_size=1)
    msg = str(e.value)
    assert msg.startswith(f"argument --tokenizer-type: {name}: ") and "not" in msg and "\n" not in msg


@pytest.mark.parametrize("flag", ["--log-memory-to-tensorboard", "--log-timers-to-tensorboard",
                                  "--log-validation-ppl-to-tensorboard", "--log-world-size-to-tensorboard"])
def test_tensorboard_logging_flags_need_somewhere_to_write(flag, tmp_path):
    with pytest.raises(ConfigError) as e:
        parse_args(BASE + [flag], world_size=1)
    assert str(e.value) == f"{flag} writes to TensorBoard or wandb: give --tensorboard-dir DIR (or --wandb-project)"
    assert getattr(parse_args(BASE + [flag, "--tensorboard-dir", str(tmp_path)], world_size=1),
                   flag[2:].replace("-", "_"))


def test_record_memory_history_needs_cuda_and_the_snapshot_path_needs_it():
    import torch

    with pytest.raises(ConfigError, match="^--memory-snapshot-path needs --record-memory-history$"):
        parse_args(BASE + ["--memory-snapshot-path", "m.pickle"], world_size=1)
    if torch.cuda.is_available():
        assert parse_args(BASE + ["--record-memory-history"], world_size=1).record_memory_history
        return
    with pytest.raises(ConfigError, match="^--record-memory-history records the CUDA caching allocator's history: "
                                          "it needs CUDA"):
        parse_args(BASE + ["--record-memory-history"], world_size=1)


def test_common_megatron_lm_flags_are_implemented_accepted_as_the_behaviour_or_refused_with_why():
    """The flags Megatron-LM's example scripts use most that were unknown here: each is implemented (it changes
    the model or the run), accepted as what this fork always does, or refused in one line saying why."""
    from megatron_lev.arguments import parse_run_config
    from megatron_lev.models.factory import build_configs

    base = resolved_config(parse_args(BASE, world_size=1))
    for flag in ("--use-dist-ckpt", "--ckpt-fully-parallel-save"):  # already the behaviour
        assert flag in VOCABULARY and flag in NO_OPS
        assert resolved_config(parse_args(BASE + [flag], world_size=1)) == base
    for flag, why in (("--async-save", "saves are synchronous"), ("--use-checkpoint-args", "--config LOAD/"),
                      ("--eval-micro-batch-size", "runs at --micro-batch-size")):
        assert flag in VOCABULARY
        with pytest.raises(ConfigError) as e:
            parse_args(BASE + [flag] + ([] if flag != "--eval-micro-batch-size" else ["4"]), world_size=1)
        assert str(e.value).startswith(flag + ":") and why in str(e.value) and "\n" not in str(e.value)
    rc = parse_run_config(BASE + ["--qk-layernorm", "--use-cpu-initialization", "--ckpt-fully-parallel-load"],
                          world_size=1)
    assert rc.checkpointing.ckpt_fully_parallel_load and rc.model.qk_layernorm
    config, _ = build_configs(rc.with_padded_vocab(128))
    assert config.qk_layernorm is True and config.use_cpu_initialization is True
    plain, _ = build_configs(parse_run_config(BASE, world_size=1).with_padded_vocab(128))
    assert plain.qk_layernorm is False


def test_a_config_yaml_saved_before_qk_layernorm_existed_still_loads():
    from megatron_lev.arguments import parse_run_config
    from megatron_lev.config import RunConfig

    saved = parse_run_config(BASE, world_size=1).to_saved_args()
    for name in ("qk_layernorm", "use_cpu_initialization", "ckpt_fully_parallel_load"):
        saved.pop(name)
    rc = RunConfig.from_saved_args(saved)
    assert rc.model.qk_layernorm is False and rc.model.use_cpu_initialization is None
    assert rc.checkpointing.ckpt_fully_parallel_load is False
