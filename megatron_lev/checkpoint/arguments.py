"""Command-line arguments of ``pretrain_lev.py``: Megatron-LM's flag names, a YAML config, validation.

They are also what every checkpoint saves (``config.yaml``), so they live here, below training: the
conversions write complete argument sets for the checkpoints they create with the same parser. The
``--lev-*`` flags and the input-arm flags are generated from the fields of ``LEVConfig`` and
``LevModelConfig`` (``add_config_flags``): type, default, choices and help are written once, there.

Precedence: built-in defaults < ``--config FILE.yaml`` < flags on the command line.

The YAML file maps argument names to values. Names may be written as the flag (``num-layers``,
``--num-layers``) or as the attribute (``num_layers``); a nested mapping is flattened with ``_``
(``lev: {heads: 8}`` is ``lev_heads``). Unknown names are an error that names the key.

``validate_args`` checks the combination (batch sizes, parallel sizes against the world size, data
source, precision, ...) and derives what Megatron-LM derives (data-parallel size, number of
micro-batches, ffn size, padded vocabulary lives in the training set-up). Every failure is a
:class:`ConfigError` whose message is one line naming the flag to change.

``resolved_config(args)`` is the flat mapping of every argument after validation; it is printed at
start-up and written as ``config.yaml`` beside each checkpoint. Feeding that file back through
``--config`` reproduces the same arguments (tested).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import fields
from typing import Any, Dict, List, Optional, Sequence

from megatron_lev.config_flags import add_config_flags
from megatron_lev.lev.config import ConfigError, LEVConfig, lev_flag
from megatron_lev.models.config import NORMALIZATIONS, POSITION_EMBEDDING_TYPES, LevModelConfig, \
    check_parallel_settings
from megatron_lev.tokenizer import ALLOW_TOKENIZER_MISMATCH_FLAG
from megatron_lev.tokenizer.spec import TokenizerSpec

# Arguments that describe the run rather than the model/optimisation: not compared on resume.
_DERIVED = ("data_parallel_size", "world_size", "num_microbatches", "padded_vocab_size", "params_dtype_name",
            "tokenizer_fingerprint")
# LevModelConfig fields that are flags of their own name (--albert-dim ...); the others come from
# Megatron-LM's flags (--seq-length, --swiglu, --disable-bias-linear, ...) in model_config_from_args.
_MODEL_FLAG_FIELDS = ("input_embedding", "albert_dim", "flat_mlp_dim", "mlp_hidden")
_MODEL_SHAPE_FLAG_FIELDS = ("rotary_base", "rotary_percent", "transformer_impl")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block) raised as ConfigError."""

    def error(self, message: str):  # type: ignore[override]
        raise ConfigError(message)


def _str2bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {v!r}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pretrain_lev.py",
        description="Pretrain a GPT model with the LEV input embedding (or a baseline arm) on megatron-core.",
        allow_abbrev=False,
    )
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="YAML file of arguments; flags on the command line override it")

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="default 4*hidden, or int(8*hidden/3) rounded down to a multiple of 64 with --swiglu")
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    # Megatron-LM's command-line defaults (learned positions, LayerNorm), not LevModelConfig's.
    g.add_argument("--position-embedding-type", default="learned_absolute", choices=POSITION_EMBEDDING_TYPES)
    g.add_argument("--normalization", default="LayerNorm", choices=NORMALIZATIONS)
    add_config_flags(g, LevModelConfig, _model_flag, _MODEL_SHAPE_FLAG_FIELDS)
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (default: GeLU, as Megatron-LM)")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="Megatron's flag; the same as --input-embedding untied")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)

    g = p.add_argument_group("input embedding (the paper's arms) and LEV")
    # Default: tied (Megatron's shared embedding/head), or untied with --untie-embeddings-and-output-weights.
    add_config_flags(g, LevModelConfig, _model_flag, _MODEL_FLAG_FIELDS, defaults={"input_embedding": None})
    add_config_flags(g, LEVConfig, lev_flag)

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--no-overlap-p2p-communication", action="store_true",
                   help="interleaved schedule: batched, non-overlapped p2p (default overlaps, as Megatron-LM)")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int, default=None)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                   help="default nccl with CUDA, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)

    g = p.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--fp8-format", default=None, choices=["e4m3", "hybrid"])
    g.add_argument("--fp8-recipe", default="delayed", choices=["delayed", "tensorwise", "blockwise", "mxfp8"])
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale (fp16); default dynamic")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)

    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"],
                   help="adam is AdamW (decoupled weight decay), as in megatron-core")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"])
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", default="constant", choices=["constant", "linear", "cosine"])
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro x data-parallel size")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--exit-interval", type=int, default=None, help="stop (after saving) at an iteration multiple of N")
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM: save a checkpoint at the end of the current iteration and exit 0")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_true",
                   default=True, help="check loss and gradients for NaN/Inf every iteration (the default); "
                                      "see --nan-action")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false", help="do not check every iteration (a checkpoint is still refused "
                                              "when the parameters hold NaN/Inf)")
    g.add_argument("--nan-action", default="save-and-stop", choices=["stop", "save-and-stop", "skip"],
                   help="on NaN/Inf: stop; save the last good state (when --save is given) and stop; "
                        "or skip the optimizer step and continue (counted as a nan iteration)")
    g.add_argument("--inject-nan-at-iteration", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--debug-kill-during-save", default=None, help=argparse.SUPPRESS)  # "RANK:ITER"
    g.add_argument("--debug-stall-during-save", default=None, help=argparse.SUPPRESS)  # "RANK:ITER"
    g.add_argument("--debug-enospc-during-save", default=None, help=argparse.SUPPRESS)  # "RANK:ITER"

    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=None, help="prefix, or 'weight prefix weight prefix ...'")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--train-data-path", nargs="*", default=None)
    g.add_argument("--valid-data-path", nargs="*", default=None)
    g.add_argument("--test-data-path", nargs="*", default=None)
    g.add_argument("--mock-data", action="store_true", help="megatron-core's MockGPTDataset (no files)")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes per rank")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    TokenizerSpec.add_flags(g)  # --vocab-size also sizes --mock-data
    g.add_argument(ALLOW_TOKENIZER_MISMATCH_FLAG, action="store_true",
                   help="train on datasets, or resume a checkpoint, made with another tokenizer (warns instead "
                        "of refusing)")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load model weights only; start at iteration 0 with fresh optimizer/scheduler")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="save the distributed optimizer so that it reloads with any TP/PP (gathers on DP rank 0)")
    g.add_argument("--ckpt-format", default="torch_dist", choices=["torch_dist"])
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="load iter_N of --load instead of the one latest_checkpointed_iteration.txt names")
    g.add_argument("--overwrite-checkpoints", action="store_true",
                   help="allow saving into a --save directory that holds another run's checkpoints "
                        "(without it, such a run is refused unless --load names the same directory)")

    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--skip-train", action="store_true", help="only evaluate (after --load)")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--wandb-project", default=None)
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--wandb-save-dir", default=None)
    g.add_argument("--log-throughput", action="store_true", help="accepted for Megatron compatibility (always on)")
    g.add_argument("--peak-tflops-per-device", type=float, default=None,
                   help="for MFU; default: known GPUs' dense bf16 peak, unknown (no MFU) on CPU")
    g.add_argument("--metrics-file", default=None,
                   help="append one JSON line per iteration/evaluation with exact values (rank 0)")
    g.add_argument("--quiet-config", action="store_true", help="do not print the resolved config at start-up")
    _add_negations(p)
    return p


def _model_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_negations(p: argparse.ArgumentParser) -> None:
    """Give every on/off flag a ``--no-...`` form, so a value set by ``--config`` can be turned off on the
    command line (e.g. ``--config 400m.yaml --no-overlap-grad-reduce``)."""
    taken = set(p._option_string_actions)
    for action in list(p._actions):
        if not isinstance(action, argparse._StoreTrueAction):
            continue
        for opt in action.option_strings:
            if opt.startswith("--") and "_" not in opt and not opt.startswith("--no-") and f"--no-{opt[2:]}" not in taken:
                p.add_argument(f"--no-{opt[2:]}", dest=action.dest, action="store_false",
                               help=f"turn {opt} off (when a --config file sets it)")


# ----------------------------------------------------------------------------------------------
# YAML config


def _flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        key = str(k).lstrip("-").replace("-", "_")
        key = f"{prefix}_{key}" if prefix else key
        if isinstance(v, dict):
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def load_yaml_config(path: str, parser: argparse.ArgumentParser) -> Dict[str, Any]:
    """Read a YAML file of arguments; return ``{dest: value}`` converted with each flag's type."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file")
    try:
        with open(path, "r", encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "parse error"
        raise ConfigError(f"--config {path}: not valid YAML ({first})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of argument names to values")
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    out: Dict[str, Any] = {}
    # Derived values (a saved config.yaml holds them) are dropped before nested mappings are flattened:
    # the tokenizer fingerprint is a mapping whose fields are no flags.
    data = {k: v for k, v in data.items() if k not in _DERIVED}
    for key, value in _flatten(data).items():
        if key in _DERIVED:
            continue
        if key not in actions:
            raise ConfigError(f"--config {path}: unknown argument {key!r} (flag --{key.replace('_', '-')})")
        action = actions[key]
        flag = action.option_strings[0]
        try:
            out[key] = _convert(action, value)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
            raise ConfigError(f"--config {path}: {key}: invalid value {value!r} for {flag} ({e})") from None
    return out


def _convert(action: argparse.Action, value: Any) -> Any:
    if value is None:
        return None
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return _str2bool(value)
    conv = action.type or (lambda x: x)
    if action.nargs in ("*", "+"):
        items = value if isinstance(value, (list, tuple)) else str(value).split()
        vals = [conv(v) if not isinstance(v, str) or action.type is None else conv(v) for v in items]
        vals = [str(v) if action.type is None else v for v in vals]
        if action.choices is not None:
            for v in vals:
                if v not in action.choices:
                    raise ValueError(f"choose from {', '.join(map(str, action.choices))}")
        return vals
    if action.type is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError("expected an integer")
        v = int(value)
    elif action.type is float:
        if isinstance(value, bool):
            raise ValueError("expected a number")
        v = float(value)
    else:
        v = conv(value) if action.type else value
        if action.type is None and not isinstance(v, str):
            v = str(v)
    if action.choices is not None and v not in action.choices:
        raise ValueError(f"choose from {', '.join(map(str, action.choices))}")
    return v


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> argparse.Namespace:
    """Parse flags (and ``--config``), then validate. Raises ConfigError with a one-line message."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    pre, _ = parser.parse_known_args(argv) if "--config" in " ".join(argv) else (None, None)
    if pre is not None and pre.config:
        parser.set_defaults(**load_yaml_config(pre.config, parser))
    args = parser.parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate_args(args, world_size)
    return args


# ----------------------------------------------------------------------------------------------
# validation


def _require(args, name: str) -> None:
    if getattr(args, name) is None:
        raise ConfigError(f"--{name.replace('_', '-')} is required")


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """Check the combination and derive Megatron-LM's implied values (in place), one named check after
    another (each raises a one-line ConfigError naming the flag)."""
    args.world_size = world_size
    for check in _CHECKS:
        check(args)


def _check_required_and_ranges(args) -> None:
    """Required flags, and the ranges of single values."""
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "train_iters", "lr"):
        _require(args, name)
    positive = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                "tensor_model_parallel_size", "pipeline_model_parallel_size", "log_interval", "eval_interval",
                "make_vocab_size_divisible_by")
    for name in positive:
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    for name in ("train_iters", "eval_iters", "lr_warmup_iters", "num_workers"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0 (got {getattr(args, name)})")
    if args.lr < 0 or args.min_lr < 0:
        raise ConfigError(f"--lr and --min-lr must be >= 0 (got {args.lr}, {args.min_lr})")
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    if args.clip_grad < 0:
        raise ConfigError(f"--clip-grad must be >= 0 (got {args.clip_grad})")
    for name in ("hidden_dropout", "attention_dropout"):
        v = getattr(args, name)
        if not 0.0 <= v < 1.0:
            raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 1) (got {v})")


def _check_parallel_sizes(args) -> None:
    """TP x PP against the world size, query groups, virtual stages; then the model's own layout check."""
    tp, pp, world_size = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.world_size
    if world_size % (tp * pp) != 0:
        raise ConfigError(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} = {tp * pp} "
            f"does not divide the world size {world_size}"
        )
    args.data_parallel_size = world_size // (tp * pp)
    if args.group_query_attention or args.num_query_groups is not None:
        if args.num_query_groups is None:
            raise ConfigError("--group-query-attention needs --num-query-groups")
        if args.num_attention_heads % args.num_query_groups != 0:
            raise ConfigError(
                f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                f"--num-query-groups {args.num_query_groups}"
            )
        if args.num_query_groups % tp != 0:
            raise ConfigError(
                f"--num-query-groups {args.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}"
            )
        args.group_query_attention = True
    if args.num_layers_per_virtual_pipeline_stage is not None:
        if args.virtual_pipeline_model_parallel_size is not None:
            raise ConfigError("give only one of --num-layers-per-virtual-pipeline-stage and "
                              "--virtual-pipeline-model-parallel-size")
        per_stage = args.num_layers // pp
        if (args.num_layers % pp or args.num_layers_per_virtual_pipeline_stage < 1
                or per_stage % args.num_layers_per_virtual_pipeline_stage):
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage} does "
                f"not divide the {per_stage} layers of each of the --pipeline-model-parallel-size {pp} stages"
            )
        args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage
    vpp = args.virtual_pipeline_model_parallel_size
    if vpp is not None and vpp < 1:
        raise ConfigError(f"--virtual-pipeline-model-parallel-size must be >= 1 (got {vpp})")
    # Heads and layers against TP/PP/virtual stages, sequence parallelism: the model config's check.
    check_parallel_settings(tp=tp, pp=pp, vpp=vpp, num_layers=args.num_layers,
                            num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                            sequence_parallel=args.sequence_parallel)
    if vpp == 1:
        args.virtual_pipeline_model_parallel_size = None


def _check_batch_sizes(args) -> None:
    """Batch sizes."""
    dp = args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size < 1 or args.global_batch_size % (args.micro_batch_size * dp) != 0:
        raise ConfigError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {dp}"
        )
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    pp = args.pipeline_model_parallel_size
    if args.virtual_pipeline_model_parallel_size is not None and args.num_microbatches % pp != 0:
        raise ConfigError(
            f"the interleaved schedule needs the number of micro-batches ({args.num_microbatches} = "
            f"--global-batch-size / (--micro-batch-size x data-parallel size)) divisible by "
            f"--pipeline-model-parallel-size {pp}"
        )


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
    elif args.input_embedding == "tied" and args.untie_embeddings_and_output_weights:
        raise ConfigError("--untie-embeddings-and-output-weights contradicts --input-embedding tied")
    args.untie_embeddings_and_output_weights = args.input_embedding != "tied"
    # The LEV settings that need no vocabulary (the heads shard over TP in the lev arm only).
    tp = args.tensor_model_parallel_size if args.input_embedding == "lev" else 1
    LEVConfig.from_args(vars(args)).validate_settings(tp)


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


def _check_lr_schedule(args) -> None:
    """Learning-rate schedule."""
    if args.lr_decay_iters is None:
        args.lr_decay_iters = max(1, args.train_iters)
    if args.lr_decay_iters < 1:
        raise ConfigError(f"--lr-decay-iters must be >= 1 (got {args.lr_decay_iters})")
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters:
            raise ConfigError("give only one of --lr-warmup-fraction and --lr-warmup-iters")
        if not 0.0 <= args.lr_warmup_fraction <= 1.0:
            raise ConfigError(f"--lr-warmup-fraction must be in [0, 1] (got {args.lr_warmup_fraction})")
    elif args.lr_warmup_iters > 0 and args.lr_warmup_iters >= args.lr_decay_iters:
        raise ConfigError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --lr-decay-iters {args.lr_decay_iters} "
            "(default: --train-iters)"
        )
    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None:
        raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters")
    if args.start_weight_decay is None:
        args.start_weight_decay = args.weight_decay
    if args.end_weight_decay is None:
        args.end_weight_decay = args.weight_decay


def _check_data(args) -> None:
    """Data."""
    split_paths = any(getattr(args, n) for n in ("train_data_path", "valid_data_path", "test_data_path"))
    if args.mock_data:
        if args.data_path or split_paths:
            raise ConfigError("--mock-data cannot be combined with --data-path/--train-data-path")
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
        parts = str(args.split).replace("/", ",").split(",")
        try:
            weights = [float(x) for x in parts]
        except ValueError:
            raise ConfigError(f"--split {args.split!r}: expected comma-separated weights like 969,30,1") from None
        if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ConfigError(f"--split {args.split!r}: expected up to 3 non-negative weights with a positive sum")


def _check_checkpointing(args) -> None:
    """Checkpointing."""
    if args.save_interval is not None and args.save_interval < 1:
        raise ConfigError(f"--save-interval must be >= 1 (got {args.save_interval})")
    if args.save_interval is not None and args.save is None:
        raise ConfigError("--save-interval needs --save DIR")
    if args.exit_interval is not None and args.exit_interval < 1:
        raise ConfigError(f"--exit-interval must be >= 1 (got {args.exit_interval})")
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
    _check_required_and_ranges,
    _check_parallel_sizes,
    _check_batch_sizes,
    _check_model_shape,
    _check_input_arm,
    _check_precision,
    _check_lr_schedule,
    _check_data,
    _check_checkpointing,
)


def _validate_tokenizer_files(args) -> None:
    t = args.tokenizer_type
    need: List[str] = []
    if t == "GPT2BPETokenizer":
        need = ["vocab_file", "merge_file"]
    elif t in ("HuggingFaceTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "TikTokenizer"):
        need = ["tokenizer_model"]
    elif t == "NullTokenizer" and args.vocab_size is None:
        raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size")
    for name in need:
        flag = "--" + name.replace("_", "-")
        path = getattr(args, name)
        if path is None:
            raise ConfigError(f"--tokenizer-type {t} needs {flag}")
        if not os.path.exists(path):
            raise ConfigError(f"{flag} {path}: no such file")
    if args.vocab_size is not None and args.vocab_size < 2:
        raise ConfigError(f"--vocab-size must be >= 2 (got {args.vocab_size})")
    if args.vocab_size is not None and t != "NullTokenizer":
        raise ConfigError(f"--vocab-size {args.vocab_size} applies to NullTokenizer only; {t} takes its vocabulary "
                          "from its files: drop --vocab-size")


# ----------------------------------------------------------------------------------------------
# resolved config


def resolved_config(args: argparse.Namespace) -> Dict[str, Any]:
    """Every argument after validation, as plain YAML-able values (sorted by name)."""
    out: Dict[str, Any] = {}
    for k, v in sorted(vars(args).items()):
        if k == "config" or k.startswith("_"):
            continue
        if isinstance(v, tuple):
            v = list(v)
        if isinstance(v, float) and (math.isinf(v) or math.isnan(v)):
            v = str(v)
        out[k] = v
    return out


def config_to_yaml(cfg: Dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(cfg, sort_keys=True, default_flow_style=False)


def format_config(cfg: Dict[str, Any]) -> str:
    """Megatron-LM's start-up block: ``------ arguments ------`` then ``  name .... value`` lines."""
    lines = ["------------------------ arguments ------------------------"]
    for k, v in cfg.items():
        dots = "." * max(1, 48 - len(k))
        lines.append(f"  {k} {dots} {v}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)
