"""Saving, loading and resuming checkpoints (megatron-core ``dist_checkpointing``, torch_dist): the flags,
generated from ``CheckpointingConfig``'s fields."""

from __future__ import annotations

from megatron_lev._procutil import unwritable
from megatron_lev.config_flags import add_config_flags, add_switch_flags, field_flag
from megatron_lev.lev.config import ConfigError

from megatron_lev.config.groups import DIST_CKPT_STRICTNESS, CheckpointingConfig

__all__ = ["DIST_CKPT_STRICTNESS", "add_checkpointing_flags", "check_output_dirs"]


# The on/off flags (Megatron-LM's spellings are the fields').
_SWITCHES = tuple((field_flag(name), name, True) for name in (
    "no_save_optim", "no_save_rng", "no_load_optim", "no_load_rng", "finetune", "dist_ckpt_optim_fully_reshardable",
    "exit_on_missing_checkpoint", "no_ckpt_checksums", "allow_missing_ckpt_checksums", "overwrite_checkpoints",
    "ckpt_fully_parallel_load"))
# The value flags of this module (the fault-injection ones are declared with the run's flags).
_VALUES = ("save", "load", "save_interval", "ckpt_format", "dist_ckpt_strictness", "ckpt_step")


def add_checkpointing_flags(p) -> None:
    g = p.add_argument_group("checkpointing")
    add_config_flags(g, CheckpointingConfig, field_flag, _VALUES)
    add_switch_flags(g, CheckpointingConfig, _SWITCHES)


def check_output_dirs(args) -> None:
    """The directories a run writes into, checked before any work (else a read-only --save is found at the
    first save, after the training it was to keep)."""
    for flag, path in (("--save", args.save), ("--tensorboard-dir", args.tensorboard_dir),
                       ("--wandb-save-dir", args.wandb_save_dir), ("--data-cache-path", args.data_cache_path)):
        why = unwritable(path) if path else None
        if why:
            raise ConfigError(f"{flag} {path}: {why}; choose a writable directory")
