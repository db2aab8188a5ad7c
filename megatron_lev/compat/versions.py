"""What differs between the megatron-core releases this project supports.

Python 3.11 gets megatron-core 0.16.1 (the newest that installs there); Python 3.12 gets 0.19.x. Every
behaviour that depends on the release is decided here, from the installed version or by feature
detection, so the rest of the package is written once.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import logging
import os
import warnings
from typing import Iterator, List, Optional

from packaging.version import Version

# Checkpoints written before the version was recorded were all written by the one release then pinned.
UNRECORDED_CHECKPOINT_VERSION = "0.16.1"


@functools.lru_cache(maxsize=None)
def megatron_core_version() -> Version:
    return Version(importlib.metadata.version("megatron-core"))


def _refusal(path: str, written: str) -> str:
    return (f"{path}: written by megatron-core {written}, newer than this environment's {megatron_core_version()}; "
            f"load it where that release is installed (make test-next's .venv-next), or carry the model over "
            f"with tools/convert_checkpoint.py export-hf there and import-hf here")


def unreadable_checkpoint(path: str) -> Optional[str]:
    """One line refusing a dist_checkpointing directory whose format this megatron-core cannot read, else None.

    Up to 0.16.1 dist_checkpointing writes the common (non-tensor) state to ``common.pt``; 0.19 stores it as a
    ``common_state`` object inside the torch_dist files and writes no ``common.pt`` (it still reads the old
    layout). A release without the reader of the new layout (``serialization._legacy_common_state_exists``
    marks it) would fail deep inside torch on such a checkpoint."""
    from megatron.core.dist_checkpointing import serialization

    if hasattr(serialization, "_legacy_common_state_exists"):
        return None
    if os.path.isfile(os.path.join(path, "common.pt")) or not os.path.isfile(os.path.join(path, "metadata.json")):
        return None
    return _refusal(path, ">= 0.19 (common state inside the torch_dist files, no common.pt)")


def checkpoint_refusal(saved: Optional[str], path: str) -> Optional[str]:
    """One line refusing a checkpoint whose recorded megatron-core release is newer than this one, else None.

    ``saved``: the version recorded in its common state (None: written before it was recorded). A newer
    release may lay out optimizer and RNG state in ways an older one does not know, so a checkpoint is read
    only by the release (major.minor) that wrote it or a newer one."""
    written = Version(saved or UNRECORDED_CHECKPOINT_VERSION)
    if written.release[:2] <= megatron_core_version().release[:2]:
        return None
    return _refusal(path, str(written))


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


def quiet_cuda_runtime_notice() -> None:
    """Drop torch's "No CUDA runtime is found, using CUDA_HOME=..." line.

    megatron-core 0.19's ``tensor_parallel/random.py`` imports ``torch.utils.cpp_extension`` at module level;
    with the CUDA build of torch on a machine without a GPU that import logs the line on every process start,
    ahead of everything else a command prints (its one-line errors included). Logging only: no torch import."""
    logging.getLogger("torch.utils.cpp_extension").addFilter(
        lambda record: not record.getMessage().startswith("No CUDA runtime is found"))


# megatron-core's import-time notices that it runs its torch fallbacks (optimizers, grad clipping,
# multi-tensor ops, norms) without Transformer Engine and Apex; the wording is the same in 0.16 and 0.19.
_FALLBACK_WARNINGS = r"(Transformer Engine and Apex are|Apex is) not installed\. Falling back"


def quiet_fallback_warnings() -> None:
    """Drop megatron-core's TE/Apex fallback ``UserWarning``s (six blocks, twelve lines, on every start, even
    ``--help``). On CPU the fallbacks are the design; on CUDA training says it once (``fallback_notice``).
    Only these messages: megatron-core's other warnings still show. No torch import."""
    warnings.filterwarnings("ignore", message=_FALLBACK_WARNINGS, category=UserWarning)


def fallback_notice() -> Optional[str]:
    """The one line a CUDA training start prints when neither Transformer Engine nor Apex is installed, else
    None (asked only on CUDA: on CPU the torch fallbacks are the design)."""
    if importlib.util.find_spec("transformer_engine") is not None or importlib.util.find_spec("apex") is not None:
        return None
    return ("note: Transformer Engine and Apex are not installed: megatron-core uses its torch fallbacks (Adam, "
            "grad clipping, multi-tensor ops, norms; megatron-lev keeps the grad norm on the device), slower on GPU, "
            "and FP8 is unavailable; "
            "pip install transformer-engine[pytorch] for the fused kernels")


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


def batch_size_calculator(kind: str):
    """megatron-core's micro-batch calculator class for a changing global batch size, or None where the
    installed release lacks it. ``kind``: ``"rampup"`` (``--rampup-batch-size``) or ``"step"``
    (``--step-batch-size-schedule``).

    Up to 0.17 ``num_microbatches_calculator`` has ``RampupBatchsizeNumMicroBatchesCalculator``; 0.18
    removed it (``init_num_microbatches_calculator`` only warns that ``rampup_batch_size`` is deprecated and
    builds a constant calculator) and added ``StepBatchsizeNumMicroBatchesCalculator``, whose schedule is
    ``"T0:B0 T1:B1 ..."`` in tokens (with ``seq_length``) or samples."""
    from megatron.core import num_microbatches_calculator as nmc

    name = {"rampup": "RampupBatchsizeNumMicroBatchesCalculator", "step": "StepBatchsizeNumMicroBatchesCalculator"}
    return getattr(nmc, name[kind], None)


@contextlib.contextmanager
def checkpoint_writer_errors() -> Iterator[List[BaseException]]:
    """Collect, for the duration of a ``dist_checkpointing.save``, the exceptions its file writers hit.

    Up to 0.16.1 the writers are forked processes whose exceptions (an ``OSError`` with its errno) come back
    through a queue into the ``CheckpointException`` the save raises. 0.19 writes with threads
    (``FileSystemWriterAsync.write_preloaded_data_multithread``) and the last bucket in the calling thread,
    whose failure it re-raises as ``AssertionError(<class 'OSError'>)``: the save then says only
    "Worker failure: ... <class 'OSError'>", and a full disk cannot be told from any other error. There the
    writer's own result is recorded here (same process); on older releases the list stays empty."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    errors: List[BaseException] = []
    if not hasattr(FileSystemWriterAsync, "write_preloaded_data_multithread"):
        yield errors
        return
    original = FileSystemWriterAsync.__dict__["write_preloaded_data"]
    write = original.__func__ if isinstance(original, staticmethod) else original

    def recorded(*args, **kwargs):
        out = write(*args, **kwargs)  # (worker index, write results or the exception it caught)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], BaseException):
            errors.append(out[1])
        return out

    FileSystemWriterAsync.write_preloaded_data = staticmethod(recorded)
    try:
        yield errors
    finally:
        FileSystemWriterAsync.write_preloaded_data = original


def reset_moe_metrics() -> None:
    """Forget megatron-core's MoE loss tracker (a process global whose per-layer tensors are sized by the first
    model that records into it, so a second model of another depth in the same process would index past
    them).

    Up to 0.16.1 the tracker is the dict ``moe_utils.get_moe_layer_wise_logging_tracker()`` returns, emptied
    in place. From 0.19 it is ``moe_logging.MoEMetricsTracker``, and that function builds a fresh dict from it
    on every call (clearing the dict clears nothing): the tracker itself is dropped, and the next record makes
    a new one."""
    try:
        from megatron.core.transformer.moe import moe_logging
    except ImportError:
        moe_logging = None
    if moe_logging is not None and hasattr(moe_logging, "destroy_moe_metrics_tracker"):
        moe_logging.destroy_moe_metrics_tracker()
        return
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()


def report_moe_metrics(**kwargs) -> None:
    """Reduce and clear the MoE loss tracker (megatron-core's ``report``/``track_moe_metrics`` arguments:
    ``loss_scale``, ``iteration``, ``total_loss_dict``, ``track_names``, ``num_layers``, ...).

    0.19 deprecates ``moe_utils.track_moe_metrics`` (a wrapper, due for removal) for
    ``get_moe_metrics_tracker().report()``; 0.16.1 has only the function."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import track_moe_metrics

        track_moe_metrics(**kwargs)
        return
    get_moe_metrics_tracker().report(**kwargs)
