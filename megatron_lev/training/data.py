"""Tokenizer, datasets and the resumable micro-batch iterators of the training loop.

The training iterator follows Megatron-LM's ``MegatronPretrainingSampler``: the dataset is
index-addressable, global batch ``g`` covers samples ``[g*G, (g+1)*G)`` and data-parallel rank ``r``
reads micro-batch ``j`` of it as samples ``start + j*(m*dp) + r*m .. + m``. Starting the sampler at
``consumed_samples`` therefore resumes exactly where an interrupted run stopped.

Validation always reads the first ``eval_iters`` global batches of the validation split, so every
evaluation (and every run) measures the same tokens.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Dict, Iterator, Optional

import numpy as np
import torch

from megatron_lev._procutil import ignore_stop_signals
from megatron_lev.data.datasets import build_train_valid_test_datasets
from megatron_lev.tokenizer import TokenizerSpec

if TYPE_CHECKING:
    from megatron_lev.config import RunConfig


def build_tokenizer_from_args(args):
    """The tokenizer the flags (or a ``DataConfig``, or saved arguments) name."""
    return TokenizerSpec.from_args(args).build()


def build_datasets(config: "RunConfig", tokenizer):
    """(train, valid, test) megatron-core datasets sized for this run (valid/test may be None)."""
    data, schedule = config.data, config.schedule
    gbs = schedule.global_batch_size
    # As Megatron-LM: --train-samples when given (a ramped-up run takes fewer than train_iters x gbs).
    train = schedule.train_samples if schedule.train_samples is not None else schedule.train_iters * gbs
    num_samples = [train, schedule.eval_iters * gbs, schedule.eval_iters * gbs]  # 0: not built
    join = lambda v: " ".join(v) if v else None  # noqa: E731
    return build_train_valid_test_datasets(
        tokenizer, data.seq_length, num_samples,
        data_path=join(data.data_path), split=data.split,
        train_data_path=join(data.train_data_path), valid_data_path=join(data.valid_data_path),
        test_data_path=join(data.test_data_path), mock=data.mock_data, seed=config.run.seed,
        data_cache_path=data.data_cache_path, reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask, eod_mask_loss=data.eod_mask_loss,
        # The dense mask only where documents must not see each other (else the kernel's causal mask).
        create_attention_mask=data.reset_attention_mask, mmap_bin_files=data.mmap_bin_files,
        vocab_size=config.model.padded_vocab_size, tokenizer_fp=data.tokenizer_fingerprint,
        allow_tokenizer_mismatch=data.allow_tokenizer_mismatch, warn=_warn_first_rank,
    )


def _warn_first_rank(msg: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(msg, file=sys.stderr, flush=True)


class PretrainingSampler:
    """Megatron-LM's MegatronPretrainingSampler: per-DP-rank micro-batches from ``consumed_samples``."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, cyclic: bool = False) -> None:
        self.total = int(total_samples)
        self.consumed = int(consumed_samples)
        self.mbs = int(micro_batch_size)
        self.rank = int(data_parallel_rank)
        self.dp = int(data_parallel_size)
        self.cyclic = cyclic
        if self.total <= 0:
            raise ValueError("the dataset is empty")

    def __iter__(self) -> Iterator[list]:
        step = self.mbs * self.dp
        start = self.consumed
        while True:
            if not self.cyclic and start + step > self.total:
                return
            base = start + self.rank * self.mbs
            yield [(base + j) % self.total for j in range(self.mbs)]
            start += step


def batch_device() -> torch.device:
    """Where a micro-batch goes: the current CUDA device, where megatron-core's layers hold the model,
    else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _collate(samples, pin: bool = False) -> Dict[str, torch.Tensor]:
    out = {}
    for key in samples[0]:
        vals = [s[key] for s in samples]
        if isinstance(vals[0], torch.Tensor):
            out[key] = torch.stack(vals)
        else:
            out[key] = torch.from_numpy(np.stack([np.asarray(v) for v in vals]))
        if pin:
            out[key] = out[key].pin_memory()
    return out


def make_iterator(dataset, consumed_samples: int, config: "RunConfig", cyclic: bool = False) -> Optional[Iterator]:
    """Micro-batch iterator of this data-parallel rank (None when there is no dataset)."""
    if dataset is None:
        return None
    from megatron.core import parallel_state as ps

    sampler = PretrainingSampler(len(dataset), consumed_samples, config.schedule.micro_batch_size,
                                 ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), cyclic=cyclic)
    # Pinned host memory makes get_batch's copies to the GPU asynchronous (as Megatron-LM's loader).
    pin = batch_device().type == "cuda"
    workers = config.data.num_workers
    if workers > 0:
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers,
                                             collate_fn=_collate, persistent_workers=False,
                                             worker_init_fn=ignore_stop_signals, pin_memory=pin)
        return iter(loader)
    return (_collate([dataset[i] for i in idx], pin=pin) for idx in sampler)


def close_iterators(iterators) -> None:
    """Stop the worker processes of ``iterators`` (one, a list, or None) now.

    A data-loader iterator stops its workers when it is freed; one held in a reference cycle outlives the
    run until the interpreter exits, where multiprocessing's exit hook sends its workers SIGTERM (which they
    ignore, see ``ignore_stop_signals``) and then waits for them without a limit: the rank never exits."""
    for it in iterators if isinstance(iterators, (list, tuple)) else [iterators]:
        shutdown = getattr(it, "_shutdown_workers", None)  # torch's multi-process loader iterator
        if shutdown is not None:
            shutdown()


def train_iterators(dataset, consumed_samples: int, config: "RunConfig"):
    """One iterator per model chunk (the interleaved schedule pulls from each chunk's own)."""
    vpp = config.layout.vpp
    if vpp is None:
        return make_iterator(dataset, consumed_samples, config)
    return [make_iterator(dataset, consumed_samples, config) for _ in range(vpp)]


def valid_iterators(dataset, config: "RunConfig"):
    vpp = config.layout.vpp
    if dataset is None:
        return None
    if vpp is None:
        return make_iterator(dataset, 0, config, cyclic=True)
    return [make_iterator(dataset, 0, config, cyclic=True) for _ in range(vpp)]


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """megatron's boolean attention mask (True = masked out) as the additive mask SDPA adds to the scores
    (0 or -inf) in ``dtype``, on the mask's device."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))


def get_batch(data_iterator, device: Optional[torch.device] = None, mask_dtype: Optional[torch.dtype] = None):
    """tokens, labels, loss_mask, attention_mask (None: causal), position_ids of the next micro-batch,
    on ``device`` (default ``batch_device()``: the model's device). With ``mask_dtype`` the document mask
    comes additive in that dtype (the compute dtype), built once here for every layer: from the boolean
    mask each layer's SDPA would make (and keep for backward) its own additive copy."""
    batch = next(data_iterator)
    device = batch_device() if device is None else device

    def move(t, dtype=None):
        # non_blocking: from pinned memory the copy is queued behind the step's work, no host sync.
        return None if t is None else t.to(device=device, dtype=dtype, non_blocking=True)

    attention_mask = move(batch.get("attention_mask"))
    if attention_mask is not None and mask_dtype is not None:
        attention_mask = additive_mask(attention_mask.bool(), mask_dtype)
    return (move(batch["tokens"], torch.long), move(batch["labels"], torch.long),
            move(batch["loss_mask"], torch.float), attention_mask, move(batch["position_ids"], torch.long))
