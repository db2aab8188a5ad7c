"""Rank-side helpers: training arguments at a target layout, the model built from them, and the
weights of a source checkpoint loaded into it by dist_checkpointing (which reshards on load: its
``torch_dist`` format stores global tensors, whatever the layout that wrote them).
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional

import torch

from megatron_lev.models.config import settings_for_loading

from .source import ConversionError


def layout_args(saved: Dict[str, Any], tp: int, pp: int, vpp: Optional[int] = None) -> Dict[str, Any]:
    """The saved arguments with the parallel layout replaced (data-parallel size 1).

    The padded vocabulary is kept (the tensors have that many rows); ``make_vocab_size_divisible_by``
    is changed when needed so that a run at the new TP pads the tokenizer's vocabulary to the same
    size (Megatron pads to a multiple of ``make_vocab_size_divisible_by x TP``).
    """
    a = dict(saved)
    tp, pp = int(tp), int(pp)
    if tp < 1 or pp < 1:
        raise ConversionError("target layout: --target-tp and --target-pp must be >= 1")
    padded = int(a["padded_vocab_size"])
    if padded % tp != 0:
        raise ConversionError(
            f"target layout: the padded vocabulary ({padded} rows) is not divisible by --target-tp {tp}")
    a["make_vocab_size_divisible_by"] = _divisible_by_for(a, padded, tp)
    a.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
             virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
             num_layers_per_virtual_pipeline_stage=None, world_size=tp * pp, data_parallel_size=1)
    if tp == 1:
        a["sequence_parallel"] = False
    mbs, gbs = a.get("micro_batch_size"), a.get("global_batch_size")
    if mbs and gbs:
        a["num_microbatches"] = max(1, int(gbs) // int(mbs))
    return a


def _divisible_by_for(a: Dict[str, Any], padded: int, tp: int) -> int:
    """A ``make_vocab_size_divisible_by`` that pads the original vocabulary to ``padded`` at ``tp``."""
    old = int(a.get("make_vocab_size_divisible_by") or 128)
    old_tp = int(a.get("tensor_model_parallel_size") or 1)
    # The source padded to a multiple of old * old_tp; the same multiple at ``tp`` pads identically.
    if (old * old_tp) % tp == 0 and padded % (old * old_tp) == 0:
        return old * old_tp // tp
    return padded // tp  # always reproduces ``padded`` (any vocabulary <= padded rounds up to it)


def namespace(a: Dict[str, Any]) -> argparse.Namespace:
    return argparse.Namespace(**a)


def build_model(a: Dict[str, Any], *, fast_init: bool = True):
    """(chunks, TransformerConfig, LevModelConfig) of this rank for the arguments ``a``.

    ``fast_init``: weights are about to be overwritten by a checkpoint, so no layer (LEV included)
    initialises its parameters."""
    from megatron_lev.models import ConfigError, build_transformer_config
    from megatron_lev.training.model_provider import build_model_chunks, model_config_from_args, \
        transformer_config_kwargs

    args = namespace(a)
    # Conversions run on CPU: a model trained with Transformer Engine is rebuilt with the local spec
    # (same checkpoint keys); ``a`` keeps the saved settings for the checkpoint written from it.
    build = namespace(dict(a, **settings_for_loading(a)))
    try:
        model_config = model_config_from_args(build)
        kw = transformer_config_kwargs(build)
        if fast_init:
            kw["perform_initialization"] = False
        config = build_transformer_config(model_config, **kw)
        model_config.validate(config)
        chunks = build_model_chunks(args, config, model_config)
    except (ConfigError, ValueError) as e:
        raise ConversionError(f"target layout: {str(e).strip().splitlines()[0]}") from None
    for c in chunks:
        c.eval()
    return chunks, config, model_config


def model_keys(n: int) -> List[str]:
    return ["model"] if n == 1 else [f"model{i}" for i in range(n)]


def load_model_weights(chunks, checkpoint_path: str, log=None) -> None:
    """Load the model part of the dist checkpoint at ``checkpoint_path`` into ``chunks`` (any layout,
    Transformer Engine or local layer spec on either side; see ``models.checkpoint_keys``)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy

    from megatron_lev.models.checkpoint_keys import KeyMatch, fit_to_checkpoint, restore_missing_extra_state, \
        saved_keys

    try:
        saved, match = saved_keys(checkpoint_path), KeyMatch()
        state = {k: fit_to_checkpoint(c.sharded_state_dict(), saved, match)
                 for k, c in zip(model_keys(len(chunks)), chunks)}
        loaded = dist_checkpointing.load(state, checkpoint_path,
                                         sharded_strategy=get_default_load_sharded_strategy(checkpoint_path))
        for k, c in zip(model_keys(len(chunks)), chunks):
            c.load_state_dict(restore_missing_extra_state(c, loaded[k]), strict=True)
    except Exception as e:
        msg = " ".join(str(e).split())
        if len(msg) > 400:
            msg = msg[:400] + " ..."
        raise ConversionError(
            f"{checkpoint_path}: the model saved there does not match the one its configuration describes "
            f"({type(e).__name__}: {msg})") from None
    if log is not None:
        for note in match.describe(saved):
            log(f"{checkpoint_path}: {note}")


def set_seed(seed: int) -> None:
    """Seed as a fresh training run does (per pipeline stage; megatron's tracker per TP rank)."""
    import random

    import numpy as np
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    seed = int(seed) + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


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
    from megatron_lev.training import checkpointing

    args = namespace(dict(a, no_save_optim=False, no_save_rng=False, debug_kill_during_save=None,
                          debug_stall_during_save=None))
    if not hasattr(args, "dist_ckpt_optim_fully_reshardable"):
        args.dist_ckpt_optim_fully_reshardable = False
    sched = common.get("opt_param_scheduler")
    checkpointing.save_checkpoint(
        dst_root, iteration, chunks, None, _SchedulerState(sched) if sched is not None else None,
        consumed_train_samples=int(common.get("consumed_train_samples", 0) or 0),
        counters=dict(common.get("counters") or {}), config=a, args=args, log=log)
