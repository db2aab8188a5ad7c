"""Reshard a megatron-lev checkpoint to another tensor/pipeline-parallel layout.

megatron-core's dist_checkpointing does the work: the model is built at the *target* layout on
``tp x pp`` CPU ranks, the source checkpoint (any layout: its ``torch_dist`` shards are pieces of
global tensors) is loaded into it, and it is saved with the training checkpointer
(``megatron_lev.checkpoint.save_checkpoint``), so the result has the structure of a
training checkpoint: ``iter_XXXXXXX/`` with the model shards, the iteration, consumed samples and
counters, the LR-scheduler state, fresh RNG states and ``config.yaml`` with the new layout; the
tracker file is written last. Every input arm is handled the same way (the LEV heads are split over
TP on dim 0, codebooks and offset replicated, as their sharded state dict says).

Optimizer state is not converted (model-only conversion). To continue training from the result,
run ``pretrain_lev.py --load DST`` at the new layout: the checkpoint has no optimizer, so the loader
restores the weights, the iteration, the data position and the LR schedule (the scheduler state is
carried) and starts Adam's moments afresh (as ``--no-load-optim`` does). The converted ``config.yaml`` holds the new TP/PP and a
``make_vocab_size_divisible_by`` that pads the tokenizer's vocabulary to the checkpoint's row count
at the new TP; pass ``--config DST/iter_XXXXXXX/config.yaml`` (or that flag) when resuming.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

from megatron_lev.config.saved import SavedConfig
from megatron_lev.distributed import set_seed

from .launch import run_ranks
from .source import ConversionError, disk_full_is_one_line, open_checkpoint, save_target, saved_config


def _reshard_rank(src_path: str, dst_root: str, iteration: int, a: SavedConfig, common: Dict[str, Any],
                  progress: bool) -> Dict[str, Any]:
    import torch

    from .model_io import build_model, load_model_weights, save_model_checkpoint

    rank = torch.distributed.get_rank()

    def log(msg: str) -> None:
        if progress and rank == 0:
            print(msg, flush=True)

    set_seed(a.run.run.seed)
    chunks, config, _mc = build_model(a)
    log(f"  loading {src_path} at TP={config.tensor_model_parallel_size} PP={config.pipeline_model_parallel_size}")
    load_model_weights(chunks, src_path, log=log)
    save_model_checkpoint(chunks, dst_root, iteration, a, common, log=log)
    n = sum(p.numel() for c in chunks for p in c.parameters())
    return {"rank": rank, "params": int(n)}


def reshard_checkpoint(src: str, dst: str, *, tp: int, pp: int = 1, vpp: Optional[int] = None,
                       iteration: Optional[int] = None, progress: bool = True,
                       allow_missing_checksums: bool = False) -> str:
    """Write the checkpoint at ``src`` (root or ``iter_*`` dir) to the root ``dst`` at layout
    TP=``tp`` x PP=``pp`` (x ``vpp`` virtual stages); return the new ``iter_*`` directory."""
    from .model_io import layout_args

    source = open_checkpoint(src, iteration, allow_missing_checksums=allow_missing_checksums)
    dst = save_target(dst, source.root)
    a = layout_args(saved_config(source), tp, pp, vpp)
    target = a.run
    num_layers, stages = target.model.num_layers, target.layout.stages
    if num_layers % stages != 0:
        raise ConversionError(f"target layout: --num-layers {num_layers} is not divisible by "
                              f"{stages} pipeline stages (--target-pp {pp}" + (f" x --target-vpp {vpp})" if vpp else ")"))
    if progress:
        lay = source.layout
        print(f"resharding {source.path} (TP={lay['tp']} PP={lay['pp']}, iteration {source.iteration}) "
              f"-> {dst} (TP={tp} PP={pp}{f' VPP={vpp}' if vpp else ''})", flush=True)
    common = {k: source.common.get(k) for k in ("consumed_train_samples", "counters", "opt_param_scheduler")}
    with disk_full_is_one_line(dst, "the resharded checkpoint"):
        os.makedirs(dst, exist_ok=True)
        run_ranks(_reshard_rank, tp=tp, pp=pp, vpp=target.layout.vpp,
                  args=(source.path, dst, source.iteration, a, common, progress))
    out = os.path.join(dst, f"iter_{source.iteration:07d}")
    if progress:
        print(f"done: {out} (model weights, iteration {source.iteration}; no optimizer state). Resume with "
              f"pretrain_lev.py --load {dst} --tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} "
              f"--make-vocab-size-divisible-by {target.model.make_vocab_size_divisible_by} ...", flush=True)
    return out
