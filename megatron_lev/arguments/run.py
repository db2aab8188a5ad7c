"""The run itself: seed, exit conditions, NaN handling (and the fault-injection flags the tests use),
logging, TensorBoard/wandb, evaluation cadence."""

from __future__ import annotations

import argparse


def add_run_flags(p) -> None:
    g = p.add_argument_group("run control")
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
