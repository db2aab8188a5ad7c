"""Rank-side helpers of the conversions over ``megatron_lev.checkpoint``: saved arguments at a target
layout, the model built from them, and the weights of a source checkpoint loaded into it by
dist_checkpointing (which reshards on load: its ``torch_dist`` format stores global tensors, whatever
the layout that wrote them). Problems are :class:`ConversionError` (one line).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from megatron_lev import checkpoint
from megatron_lev.config import ConfigError, RunConfig
from megatron_lev.models import factory

from .source import ConversionError


def layout_args(saved: Dict[str, Any], tp: int, pp: int, vpp: Optional[int] = None) -> Dict[str, Any]:
    """The saved arguments with the parallel layout replaced (data-parallel size 1; ``RunConfig.relayout``);
    keys of the file that no setting reads are kept as they were."""
    try:
        return dict(saved, **RunConfig.from_saved_args(saved).relayout(tp, pp, vpp).to_saved_args())
    except ConfigError as e:
        raise ConversionError(f"target layout --target-tp {tp} --target-pp {pp}: {e}") from None


def build_model(a: Dict[str, Any], *, fast_init: bool = True):
    """(chunks, TransformerConfig, LevModelConfig) of this rank for the arguments ``a``.

    ``fast_init``: weights are about to be overwritten by a checkpoint, so no layer (LEV included)
    initialises its parameters. A model trained with Transformer Engine is rebuilt with the local spec
    where TE or CUDA is missing (same checkpoint keys); ``a`` keeps the saved settings for the checkpoint
    written from it."""
    try:
        config, model_config = factory.build_configs(RunConfig.from_saved_args(a), for_loading=fast_init)
        chunks = factory.build_model_chunks(config, model_config)
    except ConfigError as e:
        raise ConversionError(f"target layout: {str(e).strip().splitlines()[0]}") from None
    for c in chunks:
        c.eval()
    return chunks, config, model_config


def load_model_weights(chunks, checkpoint_path: str, log=None) -> None:
    """Load the model part of the dist checkpoint at ``checkpoint_path`` into ``chunks`` (any layout,
    Transformer Engine or local layer spec on either side; see ``models.checkpoint_keys``)."""
    try:
        checkpoint.load_model_state(chunks, checkpoint_path, log=log)
    except Exception as e:
        msg = " ".join(str(e).split())
        if len(msg) > 400:
            msg = msg[:400] + " ..."
        raise ConversionError(
            f"{checkpoint_path}: the model saved there does not match the one its configuration describes "
            f"({type(e).__name__}: {msg})") from None


class _SchedulerState:
    """Carries a source's LR-scheduler state into a new checkpoint unchanged."""

    def __init__(self, state):
        self._state = state

    def state_dict(self):
        return self._state


def save_model_checkpoint(chunks, dst_root: str, iteration: int, a: Dict[str, Any], common: Dict[str, Any],
                          log=lambda m: None) -> None:
    """Save ``chunks`` with the training checkpointer as iteration ``iteration`` of ``dst_root`` (no
    optimizer state; the consumed samples, counters and scheduler state of ``common`` carried over), so
    that ``pretrain_lev.py --load dst_root`` continues from it."""
    sched = common.get("opt_param_scheduler")
    try:
        checkpoint.save_checkpoint(
            dst_root, iteration, chunks, None, _SchedulerState(sched) if sched is not None else None,
            consumed_train_samples=int(common.get("consumed_train_samples", 0) or 0),
            counters=dict(common.get("counters") or {}), config=a, log=log)
    except checkpoint.CheckpointSaveError as e:  # a full disk: one line, the partial folder already removed
        raise ConversionError(f"{str(e).rsplit('; make room', 1)[0]}; make room and run the conversion again") from None
