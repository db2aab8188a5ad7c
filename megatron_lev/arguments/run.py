"""The run itself: seed, exit conditions, NaN handling (and the fault-injection flags the tests use),
logging, TensorBoard/wandb, evaluation cadence; garbage collection, memory and profiling (Megatron-LM's
``--manual-gc*``, ``--empty-unused-memory-level``, ``--profile*``); and their checks."""

from __future__ import annotations

from megatron_lev.config_flags import add_config_flags, add_switch_flags, field_flag
from megatron_lev.lev.config import ConfigError

from megatron_lev.config.groups import CheckpointingConfig, DistributedConfig, LoggingConfig, RunControlConfig, ScheduleConfig

# The logging flags, generated from LoggingConfig's fields (--logging-level is declared with the
# garbage-collection and profiling flags, as in Megatron-LM's help).
_LOGGING_VALUES = ("log_interval", "tensorboard_dir", "tensorboard_log_interval", "tensorboard_queue_size",
                   "wandb_project", "wandb_exp_name", "wandb_save_dir", "wandb_entity", "peak_tflops_per_device",
                   "metrics_file")
_LOGGING_SWITCHES = tuple((field_flag(name), name, True) for name in (
    "log_params_norm", "log_num_zeros_in_grad", "log_timers_to_tensorboard", "log_validation_ppl_to_tensorboard",
    "log_memory_to_tensorboard", "log_world_size_to_tensorboard", "quiet_config", "log_progress")) + (
    (("--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard"), "log_loss_scale_to_tensorboard",
     False),)


_RUN_VALUES = ("seed", "exit_interval", "exit_duration_in_mins", "nan_action", "inject_nan_at_iteration")
_FAULT_INJECTION = ("debug_kill_during_save", "debug_stall_during_save", "debug_enospc_during_save")
# The NaN check is on by default (Megatron-LM's); both spellings are kept.
_NAN_CHECK_SWITCHES = (("--check-for-nan-in-loss-and-grad", "check_for_nan_in_loss_and_grad", True),
                       ("--no-check-for-nan-in-loss-and-grad", "check_for_nan_in_loss_and_grad", False))
_GC_SWITCHES = (("--manual-gc", "manual_gc", True), ("--manual-gc-eval", "manual_gc_eval", True),
                (("--no-manual-gc-eval", "--disable-manual-gc-eval"), "manual_gc_eval", False))
_PROFILE_SWITCHES = tuple((field_flag(name), name, True) for name in (
    "profile", "record_memory_history", "use_pytorch_profiler", "pytorch_profiler_collect_shapes"))


def add_run_flags(p) -> None:
    g = p.add_argument_group("run control")
    add_config_flags(g, RunControlConfig, field_flag, _RUN_VALUES)
    add_switch_flags(g, RunControlConfig, (("--exit-signal-handler", "exit_signal_handler", True),))
    add_switch_flags(g, DistributedConfig, _NAN_CHECK_SWITCHES)
    add_config_flags(g, CheckpointingConfig, field_flag, _FAULT_INJECTION)
    g = p.add_argument_group("logging and evaluation")
    add_config_flags(g, ScheduleConfig, field_flag, ("eval_interval", "eval_iters"))
    add_switch_flags(g, ScheduleConfig, (("--skip-train", "skip_train", True),))
    add_config_flags(g, LoggingConfig, field_flag, _LOGGING_VALUES)
    add_switch_flags(g, LoggingConfig, _LOGGING_SWITCHES)

    g = p.add_argument_group("garbage collection, memory and profiling")
    add_switch_flags(g, RunControlConfig, _GC_SWITCHES)
    add_config_flags(g, RunControlConfig, field_flag, ("manual_gc_interval", "empty_unused_memory_level"))
    add_config_flags(g, LoggingConfig, field_flag, ("logging_level",))
    add_switch_flags(g, RunControlConfig, _PROFILE_SWITCHES)
    add_config_flags(g, RunControlConfig, field_flag, ("profile_step_start", "profile_step_end", "profile_ranks",
                                                       "memory_snapshot_path"))


# The flags that only add scalars to TensorBoard/wandb.
_TENSORBOARD_ONLY = ("log_timers_to_tensorboard", "log_validation_ppl_to_tensorboard", "log_memory_to_tensorboard",
                     "log_world_size_to_tensorboard")


def check_run(args) -> None:
    """Logging, garbage collection, memory and profiling flags (each needs the flag it modifies)."""
    if not args.wandb_project:
        given = next((n for n in ("wandb_exp_name", "wandb_save_dir", "wandb_entity") if getattr(args, n)), None)
        if given is not None:
            raise ConfigError(f"--{given.replace('_', '-')} needs --wandb-project (nothing is logged to wandb without "
                              "a project)")
    if not (args.tensorboard_dir or args.wandb_project):
        given = next((n for n in _TENSORBOARD_ONLY if getattr(args, n)), None)
        if given is not None:
            raise ConfigError(f"--{given.replace('_', '-')} writes to TensorBoard or wandb: give --tensorboard-dir DIR "
                              "(or --wandb-project)")
    if args.record_memory_history:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--record-memory-history records the CUDA caching allocator's history: it needs CUDA "
                              "(drop the flag on CPU)")
    elif args.memory_snapshot_path != RunControlConfig.memory_snapshot_path:  # the flag's default
        raise ConfigError("--memory-snapshot-path needs --record-memory-history")
    if not args.manual_gc and (args.manual_gc_interval or not args.manual_gc_eval):
        flag = "--manual-gc-interval" if args.manual_gc_interval else "--no-manual-gc-eval"
        raise ConfigError(f"{flag} needs --manual-gc (Python's own collector runs otherwise)")
    if args.use_pytorch_profiler and not args.profile:
        raise ConfigError("--use-pytorch-profiler needs --profile (and --profile-step-start/--profile-step-end)")
    if args.profile:
        if not 0 <= args.profile_step_start < args.profile_step_end:
            raise ConfigError(f"--profile-step-start {args.profile_step_start} must be >= 0 and smaller than "
                              f"--profile-step-end {args.profile_step_end}")
        if args.use_pytorch_profiler and not args.tensorboard_dir:
            raise ConfigError("--use-pytorch-profiler writes its trace under --tensorboard-dir: give --tensorboard-dir DIR")
        bad = [r for r in args.profile_ranks if not 0 <= r < args.world_size]
        if bad:
            raise ConfigError(f"--profile-ranks {bad[0]} is not a rank of this run (world size {args.world_size})")
