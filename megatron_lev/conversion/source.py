"""The checkpoint a conversion reads (``megatron_lev.checkpoint.open_checkpoint``), with its problems
reported as :class:`ConversionError` (one line)."""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from typing import Any, Mapping, Optional, Union

from megatron_lev._procutil import unwritable
from megatron_lev.config import RunConfig
from megatron_lev.checkpoint import CONFIG_NAME, TRACKER, CheckpointError, SavedCheckpoint
from megatron_lev.checkpoint import open_checkpoint as _open_checkpoint
from megatron_lev.distributed import RankFailure
from megatron_lev.lev.config import ConfigError

SourceCheckpoint = SavedCheckpoint


class ConversionError(RuntimeError):
    """A checkpoint cannot be converted (missing, incomplete, inconsistent, unsupported); one line."""


class ConversionInterrupted(ConversionError):
    """Ctrl-C while a conversion wrote its output; one line saying what became of the partial output."""


def open_checkpoint(path: str, iteration: Optional[int] = None, *, read_common: bool = True,
                    allow_missing_checksums: bool = False) -> SavedCheckpoint:
    """Locate and check the checkpoint at ``path`` (a root with a tracker file, or an ``iter_*`` dir);
    ``allow_missing_checksums``: --allow-missing-ckpt-checksums."""
    try:
        return _open_checkpoint(path, iteration, read_common=read_common,
                                allow_missing_checksums=allow_missing_checksums)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None


def saved_config(saved: Union[SavedCheckpoint, Mapping[str, Any]], where: str = CONFIG_NAME) -> RunConfig:
    """The typed configuration of a checkpoint's saved arguments (``RunConfig.from_saved_args``: a setting
    the file lacks is its flag's default), or of the arguments a conversion re-laid out (``where`` names
    them); a broken one is one ConversionError line naming it."""
    if isinstance(saved, SavedCheckpoint):
        where, saved = os.path.join(saved.path, CONFIG_NAME), saved.args
    try:
        return RunConfig.from_saved_args(saved, source=where)
    except ConfigError as e:
        raise ConversionError(str(e)) from None


def check_writable(save: str) -> None:
    """Refuse in one line, before any work, a ``save`` directory that cannot be written: a probe file is
    written and removed in it, or (when it does not exist yet) in the nearest folder above it."""
    why = unwritable(save)
    if why:
        raise ConversionError(f"--save {save}: {why}; choose a writable directory")


def _no_space(error: BaseException) -> bool:
    text = str(error)
    return (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "No space left on device" in text \
        or "Errno 28" in text


@contextmanager
def disk_full_is_one_line(save: str, what: str, again: str = "run again"):
    """A full disk while writing ``what`` into ``save`` (here or on a conversion rank) becomes one
    :class:`ConversionError` line naming ``--save``, the free space and what became of the partial
    output: what the block added to ``save`` is removed (named where it cannot be), so that ``again``
    (how to rerun) finds the folder as it was. Ctrl-C removes it alike (:class:`ConversionInterrupted`)."""
    before = set(os.listdir(save)) if os.path.isdir(save) else None
    try:
        yield
    except ConversionInterrupted:  # in a nested block (import-hf's reshard): what this block added goes too
        _remove_new(save, before)
        raise
    except ConversionError:
        raise
    except KeyboardInterrupt:
        raise ConversionInterrupted(f"--save {save}: interrupted (Ctrl-C) while writing {what}; "
                                    f"{_remove_new(save, before)}") from None
    except (OSError, RankFailure) as e:
        if not _no_space(e):
            raise
        try:
            free = f"{shutil.disk_usage(save).free / 2**30:.1f} GiB"
        except OSError:
            free = "unknown"
        raise ConversionError(f"--save {save}: no space left on device while writing {what} ({free} free there); "
                              f"{_remove_new(save, before)}; make room and {again}") from None


def _remove_new(save: str, before: Optional[set]) -> str:
    """Remove what was added to ``save`` since ``before`` (all of it when it did not exist); say what."""
    if not os.path.isdir(save):
        return "nothing was written"
    new = sorted(set(os.listdir(save)) - (before or set()))
    for name in new:
        path = os.path.join(save, name)
        try:
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        except OSError:
            pass
    left = [n for n in new if os.path.lexists(os.path.join(save, n))]
    if before is None and not left:
        try:
            os.rmdir(save)
        except OSError:
            pass
    if left:
        return f"its partial files are left in {save} ({', '.join(left[:3])}{' ...' if len(left) > 3 else ''}): remove them"
    return f"its partial files were removed ({len(new)} written)" if new else "nothing was left in it"


def save_target(save: str, source_root: Optional[str] = None) -> str:
    """The absolute ``--save`` directory of a conversion, refused in one line when it is the source's
    directory, a file, or already holds a checkpoint (a conversion never writes over one)."""
    save = os.path.abspath(os.path.expanduser(str(save)))
    if source_root is not None and os.path.realpath(save) == os.path.realpath(source_root):
        raise ConversionError(f"--save {save}: the target is the source checkpoint's directory; choose another")
    if os.path.exists(save) and not os.path.isdir(save):
        raise ConversionError(f"--save {save}: exists and is not a directory")
    if os.path.isfile(os.path.join(save, TRACKER)):
        raise ConversionError(f"--save {save}: already holds a checkpoint ({TRACKER}); choose an empty directory")
    check_writable(save)
    return save
