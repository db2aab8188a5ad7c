"""``validate_args``: the checks of the flag combination, one named check per concern, each raising a
one-line :class:`ConfigError` naming the flag to change; and the values Megatron-LM derives
(data-parallel size, number of micro-batches, ffn size, the input arm, the params dtype name)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import List

from megatron_lev.distributed.layout import ParallelLayout
from megatron_lev.lev.config import ConfigError, LEVConfig
from megatron_lev.models.arms import get_arm
from megatron_lev.models.config import check_mtp_stage, check_parallel_settings
from megatron_lev.tokenizer.tokenizers import MEGATRON_NUM_SPECIAL_TOKENS, MEGATRON_TIKTOKEN_PATTERNS, \
    SENTENCEPIECE_TYPES, hub_cached_tokenizer

from .checkpointing import check_output_dirs
from .data import check_document_flags
from .megatron_lm import check_megatron_lm_flags
from .model import check_model_flags
from .moe import check_moe_flags
from .precision import check_precision_flags
from .run import check_run
from .schedule import check_adam_impl, check_batch_sizes, check_loss, check_lr_schedule, check_training_length


# Flags that validation folds into another argument, which is what the model, optimizer or loop reads.
FOLDED_INTO = {
    "num_layers_per_virtual_pipeline_stage": "virtual_pipeline_model_parallel_size",
    "recompute_activations": "recompute_granularity",
    "untie_embeddings_and_output_weights": "input_embedding",
    "grad_reduce_in_bf16": "accumulate_allreduce_grads_in_fp32",
    "group_query_attention": "num_query_groups",
}


def _warn(message: str) -> None:
    """One warning line on stderr, from the first rank only (every rank parses the same flags)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"WARNING: {message}", file=sys.stderr, flush=True)


def _require(args, name: str) -> None:
    if getattr(args, name) is None:
        raise ConfigError(f"--{name.replace('_', '-')} is required")


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """Check the combination and derive Megatron-LM's implied values (in place), one named check after
    another (each raises a one-line ConfigError naming the flag)."""
    args.world_size = world_size
    for check in _CHECKS:
        check(args)


def _check_required(args) -> None:
    """Required flags (each value's range is its flag's type, checked as it is parsed)."""
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "lr"):
        _require(args, name)
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")


def _check_parallel_sizes(args) -> None:
    """The parallel layout (``distributed.layout.ParallelLayout``: its sizes against the world size, the
    virtual stages, the expert layout; the data-parallel size derived from it), then the model against it
    (heads, query groups, experts and layers: ``models.config.check_parallel_settings``)."""
    if args.num_query_groups is not None and not args.group_query_attention:
        # As Megatron-LM, which passes the groups to the model only with --group-query-attention.
        _warn(f"--num-query-groups {args.num_query_groups} is ignored without --group-query-attention (every "
              "attention head keeps its own keys and values); add --group-query-attention for grouped-query attention")
        args.num_query_groups = None
    if args.group_query_attention and args.num_query_groups is None:
        raise ConfigError("--group-query-attention needs --num-query-groups")
    if args.num_layers_per_virtual_pipeline_stage is not None:
        if args.virtual_pipeline_model_parallel_size is not None:
            raise ConfigError("give only one of --num-layers-per-virtual-pipeline-stage and "
                              "--virtual-pipeline-model-parallel-size")
        pp = args.pipeline_model_parallel_size
        per_stage = args.num_layers // pp
        if args.num_layers % pp or per_stage % args.num_layers_per_virtual_pipeline_stage:
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage} does "
                f"not divide the {per_stage} layers of each of the --pipeline-model-parallel-size {pp} stages"
            )
        args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage
    layout = ParallelLayout.from_fields(vars(args), world_size=args.world_size)
    args.virtual_pipeline_model_parallel_size = layout.vpp  # 1 is no interleaving: None
    args.data_parallel_size = layout.dp
    if args.sequence_parallel and layout.tp == 1:
        # As Megatron-LM: its scripts pass --sequence-parallel whatever their TP; at TP=1 it means nothing.
        args.sequence_parallel = False
        _warn("--sequence-parallel is switched off: it needs --tensor-model-parallel-size > 1 (this run has 1)")
    check_parallel_settings(layout, num_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
                            num_query_groups=args.num_query_groups, num_moe_experts=args.num_experts,
                            sequence_parallel=args.sequence_parallel)


def _check_model_shape(args) -> None:
    """Model shape."""
    if args.hidden_size % args.num_attention_heads != 0 and args.kv_channels is None:
        raise ConfigError(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads} (or give --kv-channels)"
        )
    if args.ffn_hidden_size is None:
        if args.swiglu:
            args.ffn_hidden_size = max(64, int((4 * args.hidden_size * 2 / 3) / 64) * 64)
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.max_position_embeddings < args.seq_length:
        raise ConfigError(
            f"--max-position-embeddings {args.max_position_embeddings} is smaller than --seq-length {args.seq_length}"
        )


def _check_input_arm(args) -> None:
    """Input arm."""
    if args.input_embedding is None:
        args.input_embedding = "untied" if args.untie_embeddings_and_output_weights else "tied"
    arm = get_arm(args.input_embedding)
    if arm.ties_output_head and args.untie_embeddings_and_output_weights:
        raise ConfigError(f"--untie-embeddings-and-output-weights contradicts --input-embedding {arm.name}")
    args.untie_embeddings_and_output_weights = not arm.ties_output_head
    # The LEV settings that need no vocabulary (the heads shard over TP in the lev arm only).
    tp = args.tensor_model_parallel_size if arm.lev_layer else 1
    LEVConfig.from_args(vars(args)).validate_settings(tp)
    # MTP on the last stage needs this arm there (else rank 1's model build refuses while rank 0 waits).
    check_mtp_stage(args.input_embedding, args.mtp_num_layers, args.pipeline_model_parallel_size)


def _check_precision(args) -> None:
    """Precision."""
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 are mutually exclusive")
    if args.fp8_format is not None and not (args.bf16 or args.fp16):
        raise ConfigError("--fp8-format needs --bf16 (or --fp16)")
    args.params_dtype_name = "bfloat16" if args.bf16 else ("float16" if args.fp16 else "float32")
    if args.fp16 or args.bf16:
        args.accumulate_allreduce_grads_in_fp32 = True if args.bf16 else args.accumulate_allreduce_grads_in_fp32
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer")


def _check_data(args) -> None:
    """Data."""
    split_paths = any(getattr(args, n) for n in ("train_data_path", "valid_data_path", "test_data_path"))
    if args.mock_data:
        if args.data_path or split_paths:
            raise ConfigError("--mock-data cannot be combined with --data-path/--train-data-path/--valid-data-path/"
                              "--test-data-path")
        if args.tokenizer_type is None:
            if args.vocab_size is None:
                raise ConfigError("--mock-data needs --vocab-size N (or a --tokenizer-type)")
            args.tokenizer_type = "NullTokenizer"
    else:
        if not args.data_path and not split_paths:
            raise ConfigError("no training data: give --data-path (or --train-data-path), or --mock-data")
        if args.data_path and split_paths:
            raise ConfigError("--data-path and --train-data-path/--valid-data-path are mutually exclusive")
        if split_paths and not args.train_data_path:
            raise ConfigError("--valid-data-path/--test-data-path need --train-data-path")
        if args.tokenizer_type is None:
            raise ConfigError("--tokenizer-type is required with --data-path")
    _validate_tokenizer_files(args)
    if args.split is not None:
        # The numbers megatron-core's parse_and_normalize_split reads (it takes every run of digits and dots,
        # so "'99,1,0'" with the quotes a shell script left in is 99,1,0 there too).
        try:
            weights = [float(x) for x in re.findall(r"[.0-9]+", str(args.split))]
        except ValueError:
            raise ConfigError(f"--split {args.split!r}: expected comma-separated weights like 969,30,1") from None
        if not weights or len(weights) > 3 or sum(weights) <= 0:
            raise ConfigError(f"--split {args.split!r}: expected up to 3 non-negative weights with a positive sum, "
                              "like 969,30,1")


def _check_checkpointing(args) -> None:
    """Checkpointing."""
    if args.save_interval is not None and args.save is None:
        raise ConfigError("--save-interval needs --save DIR")
    if args.ckpt_step is not None and args.load is None:
        raise ConfigError("--ckpt-step needs --load DIR")
    if args.skip_train and args.load is None:
        raise ConfigError("--skip-train needs --load DIR")
    for name in ("debug_kill_during_save", "debug_stall_during_save", "debug_enospc_during_save"):
        value = getattr(args, name)
        if value is not None:
            try:
                r, it = value.split(":")
                setattr(args, name, f"{int(r)}:{int(it)}")
            except ValueError:
                raise ConfigError(f"--{name.replace('_', '-')} expects RANK:ITERATION") from None


_CHECKS = (
    check_megatron_lm_flags,
    _check_required,
    _check_parallel_sizes,
    check_batch_sizes,
    _check_model_shape,
    check_model_flags,
    check_moe_flags,
    _check_input_arm,
    _check_precision,
    check_precision_flags,
    check_training_length,
    check_lr_schedule,
    check_adam_impl,
    check_loss,
    _check_data,
    check_document_flags,
    _check_checkpointing,
    check_run,
    check_output_dirs,  # last: file-system probes only for an otherwise valid run
)


def _validate_tokenizer_files(args) -> None:
    t = args.tokenizer_type
    need: List[str] = []
    if t == "GPT2BPETokenizer":
        need = ["vocab_file", "merge_file"]
    elif t in ("HuggingFaceTokenizer", *SENTENCEPIECE_TYPES, "TikTokenizer"):
        need = ["tokenizer_model"]
    elif t == "NullTokenizer" and args.vocab_size is None:
        raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size")
    for name in need:
        flag = "--" + name.replace("_", "-")
        path = getattr(args, name)
        if path is None:
            raise ConfigError(f"--tokenizer-type {t} needs {flag}")
        if not os.path.exists(path):
            if (t == "HuggingFaceTokenizer" and name == "tokenizer_model"
                    and re.fullmatch(r"[\w.-]+/[\w.-]+", path) and not path.startswith(".")
                    and not path.endswith((".json", ".model", ".tiktoken", ".txt"))):
                # Megatron-LM would download a hub id; runs here read local files only (nodes are often offline),
                # from the Hugging Face cache where a download put them.
                cached, cache = hub_cached_tokenizer(path)
                if cached:
                    setattr(args, name, cached)
                    continue
                raise ConfigError(f"{flag} {path}: no such file; it looks like a Hugging Face hub id, and no local "
                                  f"copy is in the Hugging Face cache {cache} (HF_HUB_CACHE or HF_HOME): on a machine "
                                  f"online, `huggingface-cli download {path} --include 'tokenizer*'` fills that cache, "
                                  "or add --local-dir DIR and pass --tokenizer-model DIR")
            raise ConfigError(f"{flag} {path}: no such file")
    megatron_tiktoken = t == "TikTokenizer" and args.tiktoken_pattern in MEGATRON_TIKTOKEN_PATTERNS
    # --vocab-size beside a tokenizer with files is the model's vocabulary (at least the tokenizer's ids: checked
    # when the tokenizer is built, RunConfig.with_tokenizer).
    if (t == "TikTokenizer" and not megatron_tiktoken
            and args.tiktoken_num_special_tokens != MEGATRON_NUM_SPECIAL_TOKENS):
        raise ConfigError(f"--tiktoken-num-special-tokens applies to --tiktoken-pattern v1/v2 (Megatron-LM's id "
                          f"layout); with --tiktoken-pattern {args.tiktoken_pattern} the special tokens follow the file")

