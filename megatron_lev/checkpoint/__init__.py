"""Checkpoints below training: find one (tracker file), read its saved arguments, load and save
(megatron-core ``dist_checkpointing``). The model a checkpoint holds is built by ``models.factory`` from
its typed configuration (``config.RunConfig.from_saved_args`` of its ``config.yaml``).

- ``files``: the tracker, ``iter_*`` directories, ``open_checkpoint`` (saved arguments and common state).
- ``lock``: ``take_save_lock``, one training run at a time in a ``--save`` directory.
- ``sharded``: ``save_checkpoint`` / ``load_checkpoint`` (model, optimizer, scheduler, RNG) and
  ``load_model_state`` (model only, any layout).

Training, evaluation and conversion all use this package; it sits below them (its imports: the
``checkpoint`` row of docs/architecture.md).
"""

from .files import CONFIG_NAME, STRUCTURE_ARGS, TRACKER, CheckpointError, SavedCheckpoint, check_checkpoint_tokenizer, \
    check_intact, checkpoint_dir, find_checkpoint, find_damage, older_complete_checkpoint, load_common, mark_verified, \
    open_checkpoint, read_tracker
from .lock import LOCK_NAME, SaveLock, SaveLockError, take_save_lock
from .sharded import CheckpointSaveError, check_save_and_load, load_checkpoint, load_model_state, \
    refuse_newer_checkpoints, save_checkpoint, verify_checksums

__all__ = [
    "CONFIG_NAME",
    "STRUCTURE_ARGS",
    "TRACKER",
    "CheckpointError",
    "CheckpointSaveError",
    "LOCK_NAME",
    "SavedCheckpoint",
    "SaveLock",
    "SaveLockError",
    "check_checkpoint_tokenizer",
    "check_intact",
    "check_save_and_load",
    "checkpoint_dir",
    "find_checkpoint",
    "find_damage",
    "load_checkpoint",
    "load_common",
    "load_model_state",
    "mark_verified",
    "older_complete_checkpoint",
    "open_checkpoint",
    "read_tracker",
    "refuse_newer_checkpoints",
    "save_checkpoint",
    "take_save_lock",
    "verify_checksums",
]
