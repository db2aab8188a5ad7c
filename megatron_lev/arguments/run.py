"""The run itself: seed, exit conditions, NaN handling (and the fault-injection flags the tests use),
logging, TensorBoard/wandb, evaluation cadence; garbage collection, memory and profiling (Megatron-LM's
``--manual-gc*``, ``--empty-unused-memory-level``, ``--profile*``); and their checks."""

from __future__ import annotations

import argparse

from megatron_lev.config_flags import NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, add_config_flags, \
    add_switch_flags, field_flag
from megatron_lev.lev.config import ConfigError

from .groups import LoggingConfig

# The logging flags, generated from LoggingConfig's fields (--logging-level is declared with the
# garbage-collection and profiling flags, as in Megatron-LM's help).
_LOGGING_VALUES = ("log_interval", "tensorboard_dir", "tensorboard_log_interval", "tensorboard_queue_size",
                   "wandb_project", "wandb_exp_name", "wandb_save_dir", "peak_tflops_per_device", "metrics_file")
_LOGGING_SWITCHES = tuple((field_flag(name), name, True) for name in (
    "log_params_norm", "log_num_zeros_in_grad", "log_timers_to_tensorboard", "log_validation_ppl_to_tensorboard",
    "log_memory_to_tensorboard", "log_world_size_to_tensorboard", "quiet_config")) + (
    (("--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard"), "log_loss_scale_to_tensorboard",
     False),)


def add_run_flags(p) -> None:
    g = p.add_argument_group("run control")
    g.add_argument("--seed", type=NON_NEGATIVE_INT, default=1234)
    g.add_argument("--exit-interval", type=POSITIVE_INT, default=None, help="stop (after saving) at an iteration multiple of N")
    g.add_argument("--exit-duration-in-mins", type=POSITIVE_FLOAT, default=None)
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
    g.add_argument("--inject-nan-at-iteration", type=POSITIVE_INT, default=None, help=argparse.SUPPRESS)
    g.add_argument("--debug-kill-during-save", default=None, help=argparse.SUPPRESS)  # "RANK:ITER"
    g.add_argument("--debug-stall-during-save", default=None, help=argparse.SUPPRESS)  # "RANK:ITER"
    g.add_argument("--debug-enospc-during-save", default=None, help=argparse.SUPPRESS)  # "RANK:ITER"
    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--eval-interval", type=POSITIVE_INT, default=1000)
    g.add_argument("--eval-iters", type=NON_NEGATIVE_INT, default=100)
    g.add_argument("--skip-train", action="store_true", help="only evaluate (after --load)")
    add_config_flags(g, LoggingConfig, field_flag, _LOGGING_VALUES)
    add_switch_flags(g, LoggingConfig, _LOGGING_SWITCHES)

    g = p.add_argument_group("garbage collection, memory and profiling")
    g.add_argument("--manual-gc", action="store_true",
                   help="turn Python's threshold-based garbage collector off and collect at fixed points "
                        "(the same on every rank): at start-up, around each evaluation (--manual-gc-eval) and "
                        "every --manual-gc-interval iterations")
    g.add_argument("--manual-gc-interval", type=NON_NEGATIVE_INT, default=0,
                   help="with --manual-gc: collect every N training iterations (0: never between steps)")
    g.add_argument("--manual-gc-eval", dest="manual_gc_eval", action="store_true", default=True,
                   help="with --manual-gc: collect before and after each evaluation (the default)")
    g.add_argument("--no-manual-gc-eval", "--disable-manual-gc-eval", dest="manual_gc_eval", action="store_false",
                   help="with --manual-gc: no collection around evaluations")
    g.add_argument("--empty-unused-memory-level", type=NON_NEGATIVE_INT, default=0, choices=[0, 1, 2],
                   help="release the CUDA caching allocator's unused blocks (torch.cuda.empty_cache): 1 after "
                        "each step's backward and each evaluation step, 2 also after the optimizer step")
    add_config_flags(g, LoggingConfig, field_flag, ("logging_level",))
    g.add_argument("--profile", action="store_true",
                   help="profile iterations --profile-step-start to --profile-step-end on --profile-ranks: with "
                        "--use-pytorch-profiler a torch.profiler trace in --tensorboard-dir, else nsys ranges "
                        "(CUDA only)")
    g.add_argument("--profile-step-start", type=NON_NEGATIVE_INT, default=10)
    g.add_argument("--profile-step-end", type=POSITIVE_INT, default=12)
    g.add_argument("--profile-ranks", type=NON_NEGATIVE_INT, nargs="+", default=[0], help="global ranks to profile")
    g.add_argument("--record-memory-history", action="store_true",
                   help="record the CUDA caching allocator's history on the --profile-ranks and write a snapshot "
                        "(torch.cuda.memory._dump_snapshot) to --memory-snapshot-path, one file per rank, at "
                        "each --log-interval (CUDA only)")
    g.add_argument("--memory-snapshot-path", default="snapshot.pickle",
                   help="with --record-memory-history: the snapshot file (rank R writes NAME_R.pickle)")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="with --profile: torch.profiler, trace written under --tensorboard-dir "
                        "(TensorBoard, Perfetto/chrome://tracing)")


# The flags that only add scalars to TensorBoard/wandb.
_TENSORBOARD_ONLY = ("log_timers_to_tensorboard", "log_validation_ppl_to_tensorboard", "log_memory_to_tensorboard",
                     "log_world_size_to_tensorboard")


def check_run(args) -> None:
    """Logging, garbage collection, memory and profiling flags (each needs the flag it modifies)."""
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
    elif args.memory_snapshot_path != "snapshot.pickle":
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
