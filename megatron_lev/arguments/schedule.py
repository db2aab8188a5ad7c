"""Optimizer, learning-rate and weight-decay schedule, batch sizes (constant, ramped up, or stepped),
training length in iterations or samples, the loss normalisation; and their checks.

Training length is counted as Megatron-LM counts it: either ``--train-iters`` (then ``--lr-*-iters``)
or ``--train-samples`` (then ``--lr-*-samples``). Sample-based training derives the iteration count
(``train_iters``) as Megatron-LM's ``update_train_iters`` does; the LR scheduler counts samples in
both modes (megatron-core's ``OptimizerParamScheduler`` steps by the samples of each iteration).

Changing batch sizes come from megatron-core's micro-batch calculator
(``megatron.core.num_microbatches_calculator``): ``--rampup-batch-size`` (megatron-core 0.16/0.17's
``RampupBatchsizeNumMicroBatchesCalculator``; 0.18 removed it and ignores the argument) and
``--step-batch-size-schedule`` (``StepBatchsizeNumMicroBatchesCalculator``, megatron-core >= 0.18). Each
is refused in one line where the installed megatron-core lacks its calculator
(``compat.versions.batch_size_calculator``).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from megatron_lev.compat.versions import batch_size_calculator
from megatron_lev.config_flags import POSITIVE_INT, add_config_flags, add_switch_flags, field_flag
from megatron_lev.lev.config import ConfigError

from megatron_lev.config.groups import OptimizerRunConfig, ScheduleConfig


# The optimizer, schedule, batch-size and training-length flags, generated from the fields of the
# optimizer and schedule groups (the loss flags below are the model's).
_OPTIMIZER_VALUES = ("optimizer", "lr", "min_lr", "decoupled_lr", "decoupled_min_lr", "weight_decay", "adam_beta1",
                     "adam_beta2", "adam_eps", "sgd_momentum", "adam_impl", "clip_grad")
_LR_SCHEDULE_VALUES = ("lr_decay_style", "lr_decay_iters", "lr_decay_samples", "lr_wsd_decay_iters",
                       "lr_wsd_decay_samples", "lr_wsd_decay_style", "lr_warmup_iters", "lr_warmup_samples",
                       "lr_warmup_fraction", "lr_warmup_init", "start_weight_decay", "end_weight_decay",
                       "weight_decay_incr_style")
# Megatron-LM's first spelling of each keeps its underscore.
_LR_SCHEDULE_SWITCHES = (
    (("--override-opt_param-scheduler", "--override-opt-param-scheduler"), "override_opt_param_scheduler", True),
    (("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"),
     "use_checkpoint_opt_param_scheduler", True),
)
_BATCH_VALUES = ("train_iters", "train_samples", "micro_batch_size", "global_batch_size", "rampup_batch_size",
                 "step_batch_size_schedule")


def add_schedule_flags(p) -> None:
    g = p.add_argument_group("optimizer and learning rate")
    # --lr is required: validation asks for it (the field has no default).
    add_config_flags(g, OptimizerRunConfig, field_flag, _OPTIMIZER_VALUES, defaults={"lr": None})
    add_config_flags(g, ScheduleConfig, field_flag, _LR_SCHEDULE_VALUES)
    add_switch_flags(g, ScheduleConfig, _LR_SCHEDULE_SWITCHES)

    g = p.add_argument_group("batch size and training length")
    # Required (--micro-batch-size) or derived by validation (--global-batch-size): None until then.
    add_config_flags(g, ScheduleConfig, field_flag, _BATCH_VALUES,
                     defaults={"micro_batch_size": None, "global_batch_size": None})

    g = p.add_argument_group("loss")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="sum the loss over tokens and divide by the global batch's token count (default: the "
                        "mean over each micro-batch's tokens, averaged over micro-batches)")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="a fused vocab-parallel cross-entropy (--cross-entropy-fusion-impl)")
    g.add_argument("--cross-entropy-fusion-impl", default="native", choices=["native", "te", "linear"],
                   help="with --cross-entropy-loss-fusion: megatron-core's own kernel, Transformer Engine's, or "
                        "linear: the output head and the loss in one, chunk by chunk, never holding the "
                        "[tokens, V/TP] logits (training loss only; evaluation still gets logits)")
    g.add_argument("--linear-cross-entropy-chunk-size", type=POSITIVE_INT, default=None,
                   help="tokens per chunk of --cross-entropy-fusion-impl linear (default: on CUDA fp32 logits of "
                        "about 256 MiB a chunk; on the CPU 512 tokens, in cache-sized vocabulary blocks)")


# ----------------------------------------------------------------------------------------------
# checks (called by ``validate.validate_args`` in its order)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def batch_calculator(s, dp: int, seq_length: Optional[int] = None, rank: int = -1):
    """A micro-batch calculator of megatron-core for the batch settings ``s`` (a ``ScheduleConfig``, or the
    arguments during validation: the same names) at data-parallel size ``dp`` (constant, ramp-up or step
    schedule); ``rank`` 0 logs its schedule, as Megatron-LM's does."""
    from megatron.core import num_microbatches_calculator as nmc

    if s.step_batch_size_schedule is not None:
        return batch_size_calculator("step")(
            micro_batch_size=s.micro_batch_size, data_parallel_size=dp, decrease_batch_size_if_needed=False,
            rank=rank, schedule=s.step_batch_size_schedule, seq_length=seq_length)
    if s.rampup_batch_size is not None:
        start, incr, samples = s.rampup_batch_size
        return batch_size_calculator("rampup")(
            global_batch_size=s.global_batch_size, micro_batch_size=s.micro_batch_size,
            data_parallel_size=dp, decrease_batch_size_if_needed=False, rank=rank,
            start_global_batch_size=start, batch_size_increment=incr, ramup_samples=samples)
    return nmc.ConstantNumMicroBatchesCalculator(s.global_batch_size, s.micro_batch_size, dp, False, rank)


def batch_sizes(s, dp: int, seq_length: Optional[int] = None, start_samples: int = 0,
                iterations: Optional[int] = None) -> List[Tuple[int, int]]:
    """``(consumed_samples, global_batch)`` of each iteration from ``start_samples`` on, for
    ``iterations`` iterations (default: up to ``train_samples``, for a schedule whose iteration count is
    not fixed yet), as the calculator of :func:`batch_calculator` gives them."""
    calc = batch_calculator(s, dp, seq_length)
    out: List[Tuple[int, int]] = []
    consumed = start_samples
    while (iterations is None and consumed < (s.train_samples or 0)) or \
            (iterations is not None and len(out) < iterations):
        calc.update(consumed, consistency_check=False)
        gbs = calc.get_current_global_batch_size()
        out.append((consumed, gbs))
        consumed += gbs
    return out


def check_batch_sizes(args) -> None:
    """Batch sizes: the constant one, a ramp-up, or a step schedule; the micro-batches per step."""
    dp, mbs = args.data_parallel_size, args.micro_batch_size
    ramp, steps = args.rampup_batch_size, args.step_batch_size_schedule
    if ramp is not None and steps is not None:
        raise ConfigError("give only one of --rampup-batch-size and --step-batch-size-schedule")
    if ramp is not None and args.train_samples is None:
        raise ConfigError("--rampup-batch-size needs --train-samples (a ramp is counted in samples), not "
                          "--train-iters")
    if steps is not None:
        if batch_size_calculator("step") is None:
            raise ConfigError("--step-batch-size-schedule needs megatron-core >= 0.18 (the installed one has no "
                              "step-schedule calculator); use --rampup-batch-size START INCREMENT SAMPLES")
        if args.global_batch_size is not None:
            raise ConfigError("give only one of --step-batch-size-schedule and --global-batch-size (the "
                              "schedule's largest batch is the global batch size)")
        try:
            calc = batch_calculator(args, dp, args.seq_length)
        except (AssertionError, ValueError) as e:
            raise ConfigError(f"--step-batch-size-schedule {steps!r}: {str(e).splitlines()[0]}") from None
        args.global_batch_size = max(bs for _, bs in calc.schedule)
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    if steps is not None and args.global_batch_size % (mbs * dp) != 0:
        raise ConfigError(f"--step-batch-size-schedule {steps!r}: its largest batch {args.global_batch_size} is not "
                          f"divisible by --micro-batch-size {mbs} x data-parallel size {dp}")
    if args.global_batch_size < 1 or args.global_batch_size % (mbs * dp) != 0:
        raise ConfigError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{mbs} x data-parallel size {dp}"
        )
    if ramp is not None:
        if batch_size_calculator("rampup") is None:
            raise ConfigError("--rampup-batch-size: the installed megatron-core (>= 0.18) has no ramp-up calculator "
                              "(Megatron-LM ignores the flag there); use --step-batch-size-schedule")
        start, incr, samples = ramp
        if start < 1 or incr < 1 or samples < 0:
            raise ConfigError(f"--rampup-batch-size {start} {incr} {samples}: expected START >= 1, INCREMENT >= 1, "
                              "SAMPLES >= 0")
        diff = args.global_batch_size - start
        if diff <= 0 or diff % incr:
            raise ConfigError(f"--rampup-batch-size {start} {incr} {samples}: --global-batch-size "
                              f"{args.global_batch_size} must be START plus a positive multiple of INCREMENT")
        for bs in range(start, args.global_batch_size, incr):
            if bs % (mbs * dp):
                raise ConfigError(f"--rampup-batch-size {start} {incr} {samples}: the batch size {bs} of the ramp "
                                  f"is not divisible by --micro-batch-size {mbs} x data-parallel size {dp}")
    args.num_microbatches = args.global_batch_size // (mbs * dp)
    check_interleaved_microbatches(args, dp, args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size,
                                   [args.global_batch_size])


def check_interleaved_microbatches(s, dp: int, pp: int, vpp: Optional[int], sizes) -> None:
    """The interleaved schedule (``vpp`` virtual stages) needs every step's micro-batch count divisible by the
    pipeline size ``pp``; ``s``: the batch settings (``ScheduleConfig``'s names), ``sizes``: global batches."""
    mbs = s.micro_batch_size
    if vpp is None:
        return
    for bs in sizes:
        if (bs // (mbs * dp)) % pp:
            raise ConfigError(
                f"the interleaved schedule needs the number of micro-batches ({bs // (mbs * dp)} = global batch "
                f"{bs} / (--micro-batch-size x data-parallel size)) divisible by --pipeline-model-parallel-size {pp}"
            )


def check_training_length(args) -> None:
    """--train-iters or --train-samples (the iteration count then derived as Megatron-LM does)."""
    iters, samples = args.train_iters, args.train_samples
    if iters is None and samples is None:
        raise ConfigError("--train-iters (or --train-samples) is required")
    if iters is not None and iters < 0:
        raise ConfigError(f"--train-iters must be >= 0 (got {iters})")
    if samples is None:
        return
    if samples < 1:
        raise ConfigError(f"--train-samples must be >= 1 (got {samples})")
    if args.rampup_batch_size is not None:
        derived = _ramp_iterations(args)
    elif args.step_batch_size_schedule is not None:
        derived = len(batch_sizes(args, args.data_parallel_size, args.seq_length))
    else:
        derived = samples // args.global_batch_size
    # A resolved config (config.yaml) holds both: accepted when they agree.
    if iters is not None and iters != derived:
        raise ConfigError(f"give only one of --train-iters and --train-samples (--train-samples {samples} is "
                          f"{derived} iterations, not {iters})")
    if derived < 1:
        raise ConfigError(f"--train-samples {samples} is less than one global batch ({args.global_batch_size})")
    args.train_iters = derived
    if args.rampup_batch_size is not None or args.step_batch_size_schedule is not None:
        sizes = batch_sizes(args, args.data_parallel_size, args.seq_length, iterations=derived)
        check_interleaved_microbatches(args, args.data_parallel_size, args.pipeline_model_parallel_size,
                                       args.virtual_pipeline_model_parallel_size, sorted({bs for _, bs in sizes}))


def _ramp_iterations(args) -> int:
    """Megatron-LM's ``update_train_iters`` with a ramp-up: the ramp phase step by step, then whole
    global batches (a partial last batch is dropped)."""
    ramp_samples, samples = int(args.rampup_batch_size[2]), args.train_samples
    calc = batch_calculator(args, args.data_parallel_size, args.seq_length)
    iterations = consumed = 0
    while consumed <= ramp_samples and consumed <= samples:
        calc.update(consumed, consistency_check=False)
        consumed += calc.get_current_global_batch_size()
        iterations += 1
    if samples > consumed:
        iterations += (samples - consumed) // args.global_batch_size
    return iterations


def check_lr_schedule(args) -> None:
    """Learning-rate and weight-decay schedule, in iterations or in samples (as the training length)."""
    by_samples = args.train_samples is not None
    unit, other = ("samples", "iters") if by_samples else ("iters", "samples")
    for name in (f"lr_decay_{other}", f"lr_wsd_decay_{other}", f"lr_warmup_{other}"):
        if getattr(args, name):
            raise ConfigError(f"{_flag(name)} goes with --train-{other}; with --train-{unit} use "
                              f"{_flag(name.replace(other, unit))}")
    decay_name, warmup_name, wsd_name = f"lr_decay_{unit}", f"lr_warmup_{unit}", f"lr_wsd_decay_{unit}"
    if getattr(args, decay_name) is None:
        setattr(args, decay_name, max(1, args.train_samples if by_samples else args.train_iters))
    decay, warmup = getattr(args, decay_name), getattr(args, warmup_name)
    if decay < 1:
        raise ConfigError(f"{_flag(decay_name)} must be >= 1 (got {decay})")
    if args.lr_warmup_fraction is not None:
        if warmup:
            raise ConfigError(f"give only one of --lr-warmup-fraction and {_flag(warmup_name)}")
        if not 0.0 <= args.lr_warmup_fraction <= 1.0:
            raise ConfigError(f"--lr-warmup-fraction must be in [0, 1] (got {args.lr_warmup_fraction})")
    elif warmup > 0 and warmup >= decay:
        raise ConfigError(f"{_flag(warmup_name)} {warmup} must be smaller than {_flag(decay_name)} {decay} "
                          f"(default: --train-{unit})")
    if args.lr_decay_style == "WSD" and getattr(args, wsd_name) is None:
        raise ConfigError(f"--lr-decay-style WSD needs {_flag(wsd_name)}")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        raise ConfigError("--decoupled-min-lr needs --decoupled-lr (it is the floor of that learning rate)")
    if args.decoupled_lr is not None:
        low = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
        if args.decoupled_lr < 0 or low < 0 or low > args.decoupled_lr:
            raise ConfigError(f"--decoupled-lr {args.decoupled_lr} must be >= 0 and >= its minimum {low} "
                              "(--decoupled-min-lr, default --min-lr)")
    if args.start_weight_decay is None:
        args.start_weight_decay = args.weight_decay
    if args.end_weight_decay is None:
        args.end_weight_decay = args.weight_decay


def check_adam_impl(args) -> None:
    """--adam-impl chooses between torch's AdamW implementations: refused where megatron-core's Adam is not
    torch's (Transformer Engine's or Apex's FusedAdam, already one kernel) or the optimizer is SGD."""
    if args.adam_impl == "auto":
        return
    if args.optimizer != "adam":
        raise ConfigError(f"--adam-impl {args.adam_impl} needs --optimizer adam (got {args.optimizer})")
    from megatron.core import optimizer as mcore_optimizer

    if not getattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", False):
        raise ConfigError(f"--adam-impl {args.adam_impl}: megatron-core runs Transformer Engine's or Apex's "
                          "FusedAdam on this machine, not torch's AdamW; leave --adam-impl at auto")


def check_loss(args) -> None:
    """Cross-entropy fusion: megatron-core's native kernel, Transformer Engine's where installed, or the
    linear cross-entropy (its chunk size only with it)."""
    if args.cross_entropy_fusion_impl != "native" and not args.cross_entropy_loss_fusion:
        raise ConfigError(f"--cross-entropy-fusion-impl {args.cross_entropy_fusion_impl} needs "
                          "--cross-entropy-loss-fusion")
    if args.linear_cross_entropy_chunk_size is not None and not (
            args.cross_entropy_loss_fusion and args.cross_entropy_fusion_impl == "linear"):
        raise ConfigError("--linear-cross-entropy-chunk-size needs --cross-entropy-loss-fusion "
                          "--cross-entropy-fusion-impl linear")
    if args.cross_entropy_loss_fusion and args.cross_entropy_fusion_impl == "te":
        import importlib.util

        if importlib.util.find_spec("transformer_engine") is None:
            raise ConfigError("--cross-entropy-fusion-impl te needs Transformer Engine (not installed); use "
                              "--cross-entropy-fusion-impl native")
