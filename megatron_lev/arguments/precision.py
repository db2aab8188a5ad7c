"""Mixed precision: bf16/fp16 (with fp16's loss scaling) and FP8 through Transformer Engine
(``models.config.check_fp8`` refuses what the machine cannot run)."""

from __future__ import annotations

from megatron.core.transformer import TransformerConfig

from megatron_lev.config_flags import add_config_flags
from megatron_lev.lev.config import ConfigError

from .model import TRANSFORMER_VALUE_FIELDS, field_flag


def add_precision_flags(p) -> None:
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
    # FP8 scaling: TransformerConfig fields of the installed megatron-core (they need --fp8-format).
    add_config_flags(g, TransformerConfig, field_flag, [n for n in TRANSFORMER_VALUE_FIELDS if n.startswith("fp8")])
    g.add_argument("--fp8-param-gather", action="store_true",
                   help="keep the parameters in FP8 and all-gather them in FP8 (TransformerConfig.fp8_param; "
                        "needs --fp8-format and --use-distributed-optimizer)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="reduce gradients in bf16 instead of fp32 (with --bf16)")


def check_precision_flags(args) -> None:
    """The FP8 scaling flags need --fp8-format; --grad-reduce-in-bf16 needs --bf16 (after the default
    fp32 gradient reduction of bf16 runs is set)."""
    from dataclasses import fields

    defaults = {f.name: f.default for f in fields(TransformerConfig)}
    if args.fp8_format is None:
        for name in [n for n in TRANSFORMER_VALUE_FIELDS if n.startswith("fp8")] + ["fp8_param_gather"]:
            if name in vars(args) and getattr(args, name) != defaults.get(name, False):
                raise ConfigError(f"--{name.replace('_', '-')} needs --fp8-format (FP8 through Transformer Engine)")
    if args.fp8_param_gather and not args.use_distributed_optimizer:
        raise ConfigError("--fp8-param-gather needs --use-distributed-optimizer (it gathers the sharded FP8 params)")
    if args.grad_reduce_in_bf16:
        if not args.bf16:
            raise ConfigError("--grad-reduce-in-bf16 needs --bf16")
        args.accumulate_allreduce_grads_in_fp32 = False
