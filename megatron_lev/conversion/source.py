"""The checkpoint a conversion reads (``megatron_lev.checkpoint.open_checkpoint``), with its problems
reported as :class:`ConversionError` (one line)."""

from __future__ import annotations

import os
from typing import Optional

from megatron_lev.checkpoint import TRACKER, CheckpointError, SavedCheckpoint
from megatron_lev.checkpoint import open_checkpoint as _open_checkpoint

SourceCheckpoint = SavedCheckpoint


class ConversionError(RuntimeError):
    """A checkpoint cannot be converted (missing, incomplete, inconsistent, unsupported); one line."""


def open_checkpoint(path: str, iteration: Optional[int] = None, *, read_common: bool = True) -> SavedCheckpoint:
    """Locate and check the checkpoint at ``path`` (a root with a tracker file, or an ``iter_*`` dir)."""
    try:
        return _open_checkpoint(path, iteration, read_common=read_common)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None


def refuse_existing_checkpoint(save: str) -> None:
    """A conversion never writes over a checkpoint: one line naming ``--save`` and the fix."""
    if os.path.isfile(os.path.join(save, TRACKER)):
        raise ConversionError(f"--save {save}: already holds a checkpoint ({TRACKER}); choose an empty directory")
