"""Checkpoints below training: find one (tracker file), read its saved arguments, build the configs and
model chunks from them, load and save (megatron-core ``dist_checkpointing``).

- ``files``: the tracker, ``iter_*`` directories, ``open_checkpoint`` (saved arguments and common state).
- ``build``: flat arguments -> TransformerConfig + LevModelConfig -> model chunks; ``relayout``;
  ``SavedModel``, the rest of what evaluation reads of them, typed.
- ``lock``: ``take_save_lock``, one training run at a time in a ``--save`` directory.
- ``sharded``: ``save_checkpoint`` / ``load_checkpoint`` (model, optimizer, scheduler, RNG) and
  ``load_model_state`` (model only, any layout).

Training, evaluation and conversion all use this package; it imports ``models`` and ``lev`` only.
"""

from .build import SavedModel, build_configs, build_model_chunks, lev_table_modules, model_config_from_args, \
    params_dtype, relayout, transformer_config_kwargs
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
    "SavedModel",
    "build_configs",
    "build_model_chunks",
    "check_checkpoint_tokenizer",
    "check_intact",
    "check_save_and_load",
    "checkpoint_dir",
    "find_checkpoint",
    "find_damage",
    "lev_table_modules",
    "load_checkpoint",
    "load_common",
    "load_model_state",
    "mark_verified",
    "model_config_from_args",
    "older_complete_checkpoint",
    "open_checkpoint",
    "params_dtype",
    "read_tracker",
    "refuse_newer_checkpoints",
    "relayout",
    "save_checkpoint",
    "take_save_lock",
    "transformer_config_kwargs",
    "verify_checksums",
]
