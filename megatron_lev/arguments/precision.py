"""Mixed precision: bf16/fp16 (with fp16's loss scaling), FP8 through Transformer Engine
(``models.config.check_fp8`` refuses what the machine cannot run), and megatron-core's precision-aware
optimizer (Transformer Engine's FusedAdam keeps the main parameters, main gradients and Adam moments in
the dtypes of ``--main-params-dtype`` ... ``--exp-avg-sq-dtype``; megatron-core's ``OptimizerConfig``
fields of the same names)."""

from __future__ import annotations

from megatron.core.transformer import TransformerConfig

from megatron_lev.config_flags import add_config_flags, add_switch_flags
from megatron_lev.lev.config import ConfigError

from megatron_lev.config.groups import OPTIMIZER_DTYPES, FoldedFlagsConfig, OptimizerRunConfig
from .model import TRANSFORMER_RANGES, TRANSFORMER_VALUE_FIELDS, field_flag

__all__ = ["OPTIMIZER_DTYPES", "OPTIMIZER_DTYPE_FIELDS", "add_precision_flags", "check_precision_flags",
           "precision_aware_optimizer_refusal"]

# The precision-aware optimizer's dtypes (fields of OptimizerRunConfig and of megatron-core's OptimizerConfig).
OPTIMIZER_DTYPE_FIELDS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
_LOSS_SCALING = ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")

# The arguments of Transformer Engine's FusedAdam that megatron-core's precision-aware optimizer passes.
_FUSED_ADAM_ARGS = ("master_weight_dtype", "exp_avg_dtype", "exp_avg_sq_dtype", "use_decoupled_grad")


def add_precision_flags(p) -> None:
    g = p.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--fp8-format", default=None, choices=["e4m3", "hybrid"])
    g.add_argument("--fp8-recipe", default="delayed", choices=["delayed", "tensorwise", "blockwise", "mxfp8"])
    add_config_flags(g, OptimizerRunConfig, field_flag, _LOSS_SCALING)
    # FP8 scaling: TransformerConfig fields of the installed megatron-core (they need --fp8-format).
    add_config_flags(g, TransformerConfig, field_flag, [n for n in TRANSFORMER_VALUE_FIELDS if n.startswith("fp8")],
                     ranges=TRANSFORMER_RANGES)
    g.add_argument("--fp8-param-gather", action="store_true",
                   help="keep the parameters in FP8 and all-gather them in FP8 (TransformerConfig.fp8_param; "
                        "needs --fp8-format and --use-distributed-optimizer)")
    add_switch_flags(g, FoldedFlagsConfig, (("--grad-reduce-in-bf16", "grad_reduce_in_bf16", True),))
    add_switch_flags(g, OptimizerRunConfig, (("--use-precision-aware-optimizer", "use_precision_aware_optimizer",
                                              True),))
    add_config_flags(g, OptimizerRunConfig, field_flag, OPTIMIZER_DTYPE_FIELDS)


def precision_aware_optimizer_refusal():
    """Why megatron-core cannot run its precision-aware optimizer here (None when it can): it passes the
    state dtypes to the Adam it imported, which must be Transformer Engine's FusedAdam (without TE it falls
    back to apex's or torch's, which take no such arguments)."""
    import inspect

    from megatron.core import optimizer as mcore_optimizer

    adam = mcore_optimizer.Adam
    if not adam.__module__.startswith("transformer_engine"):
        return (f"needs Transformer Engine's FusedAdam (megatron-core's Adam here is {adam.__module__}."
                f"{adam.__name__}: install transformer-engine[pytorch])")
    missing = [a for a in _FUSED_ADAM_ARGS if a not in inspect.signature(adam).parameters]
    if missing:
        return f"needs a Transformer Engine whose FusedAdam takes {', '.join(missing)}: update transformer-engine"
    return None


def check_precision_flags(args) -> None:
    """The FP8 scaling flags need --fp8-format; --grad-reduce-in-bf16 needs --bf16 (after the default
    fp32 gradient reduction of bf16 runs is set); the precision-aware optimizer's requirements."""
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
    _check_precision_aware_optimizer(args)


def _check_precision_aware_optimizer(args) -> None:
    """As Megatron-LM (and megatron-core's OptimizerConfig): the state dtypes other than fp32 need the
    precision-aware optimizer, which needs Adam, the distributed optimizer and Transformer Engine's
    FusedAdam; bf16 main gradients accumulate and reduce in bf16 (the gradient buffer's dtype)."""
    changed = [f for f in OPTIMIZER_DTYPE_FIELDS if getattr(args, f) != getattr(OptimizerRunConfig, f)]
    if not args.use_precision_aware_optimizer:
        if changed:
            name = changed[0]
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} needs "
                              "--use-precision-aware-optimizer (without it every optimizer state is fp32)")
        return
    if args.optimizer != "adam":
        raise ConfigError(f"--use-precision-aware-optimizer needs --optimizer adam (got {args.optimizer})")
    if not args.use_distributed_optimizer:
        raise ConfigError("--use-precision-aware-optimizer needs --use-distributed-optimizer (it keeps the "
                          "sharded main parameters and moments in its dtypes)")
    reason = precision_aware_optimizer_refusal()
    if reason is not None:
        raise ConfigError(f"--use-precision-aware-optimizer {reason}")
    if args.main_grads_dtype == "bf16":
        if not args.bf16:
            raise ConfigError("--main-grads-dtype bf16 needs --bf16")
        args.accumulate_allreduce_grads_in_fp32 = False
