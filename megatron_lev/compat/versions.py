"""What differs between the megatron-core releases this project supports.

Python 3.11 gets megatron-core 0.16.1 (the newest that installs there); Python 3.12 gets 0.19.x. Every
behaviour that depends on the release is decided here, from the installed version or by feature
detection, so the rest of the package is written once.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
from typing import Optional

from packaging.version import Version

# Checkpoints written before the version was recorded were all written by the one release then pinned.
UNRECORDED_CHECKPOINT_VERSION = "0.16.1"


@functools.lru_cache(maxsize=None)
def megatron_core_version() -> Version:
    return Version(importlib.metadata.version("megatron-core"))


def checkpoint_refusal(saved: Optional[str], path: str) -> Optional[str]:
    """One line refusing a checkpoint that this megatron-core cannot read, or None when it can.

    ``saved``: the megatron-core version recorded in the checkpoint (None: written before it was recorded).
    A newer release may change the dist_checkpointing layout of optimizer and RNG state in ways an older
    one does not know, so a checkpoint is read only by the release that wrote it or a newer one."""
    current = megatron_core_version()
    written = Version(saved or UNRECORDED_CHECKPOINT_VERSION)
    if written.release[:2] <= current.release[:2]:
        return None
    return (f"{path}: written by megatron-core {written}, which is newer than this environment's {current}; "
            f"load it where megatron-core >= {written.major}.{written.minor} is installed (make test-next's "
            f".venv-next), or carry the model over with tools/convert_checkpoint.py export-hf there and import-hf here")


class _Once(logging.Filter):
    """Pass the first record whose message starts with ``prefix``; drop the repeats."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix, self.seen = prefix, False

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(self.prefix):
            return True
        if self.seen:
            return False
        self.seen = True
        return True


_QUIETED = False


def quiet_repeated_warnings() -> None:
    """Keep megatron-core's per-construction deprecation notices to one line per process.

    megatron-core 0.19 logs "GPTModel IS DEPRECATED ..." (in favour of HybridModel) from every
    ``GPTModel.__init__``: once per model chunk, per evaluation model and per rebuild. Idempotent; on
    releases that do not log it the filter never matches."""
    global _QUIETED
    if _QUIETED:
        return
    logging.getLogger("megatron.core.models.gpt.gpt_model").addFilter(_Once("GPTModel IS DEPRECATED"))
    _QUIETED = True
