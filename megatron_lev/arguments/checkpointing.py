"""Saving, loading and resuming checkpoints (megatron-core ``dist_checkpointing``, torch_dist)."""

from __future__ import annotations

from megatron_lev._procutil import unwritable
from megatron_lev.config_flags import NON_NEGATIVE_INT, POSITIVE_INT
from megatron_lev.lev.config import ConfigError


# megatron-core's StrictHandling values that load a checkpoint (its return_* ones hand the keys to a caller).
DIST_CKPT_STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                        "ignore_all")


def add_checkpointing_flags(p) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=POSITIVE_INT, default=None)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load model weights only; start at iteration 0 with fresh optimizer/scheduler")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="save the distributed optimizer so that it reloads with any TP/PP (gathers on DP rank 0)")
    g.add_argument("--ckpt-format", default="torch_dist", metavar="torch_dist",
                   help="the only format here (megatron-core dist_checkpointing); others are refused")
    g.add_argument("--dist-ckpt-strictness", default="assume_ok_unexpected", choices=DIST_CKPT_STRICTNESS,
                   help="on --load, keys of the checkpoint and of this run that do not match (megatron-core "
                        "dist_checkpointing's strict handling): assume_ok_unexpected (the default), log_* to list "
                        "them, raise_* to refuse the load, ignore_all")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")
    g.add_argument("--ckpt-step", type=NON_NEGATIVE_INT, default=None,
                   help="load iter_N of --load instead of the one latest_checkpointed_iteration.txt names")
    g.add_argument("--no-ckpt-checksums", action="store_true",
                   help="saves record no checksums.json and --load checks files by size only (by default every "
                        "save records each file's CRC32 and every load verifies them, reading the checkpoint once "
                        "more, spread over the ranks)")
    g.add_argument("--overwrite-checkpoints", action="store_true",
                   help="allow saving into a --save directory that holds another run's checkpoints "
                        "(without it, such a run is refused unless --load names the same directory)")


def check_output_dirs(args) -> None:
    """The directories a run writes into, checked before any work (else a read-only --save is found at the
    first save, after the training it was to keep)."""
    for flag, path in (("--save", args.save), ("--tensorboard-dir", args.tensorboard_dir),
                       ("--wandb-save-dir", args.wandb_save_dir), ("--data-cache-path", args.data_cache_path)):
        why = unwritable(path) if path else None
        if why:
            raise ConfigError(f"{flag} {path}: {why}; choose a writable directory")
