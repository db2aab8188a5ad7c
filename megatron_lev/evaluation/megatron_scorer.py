"""A megatron-lev checkpoint as a :class:`~megatron_lev.evaluation.scorer.Scorer`, at any TP/PP.

Loading: the checkpoint's ``config.yaml`` (the resolved training arguments saved beside every
checkpoint) gives the model; the tensor/pipeline sizes of *this* run choose the layout and
``dist_checkpointing`` reshards the weights (``megatron_lev.checkpoint``, model only: no optimizer,
no RNG). The padded vocabulary of the checkpoint is kept (padding it again for another
TP size would change the output layer's shape); it must be divisible by the new TP size. Virtual
pipeline stages, sequence parallelism and dropout are switched off for evaluation.

Scoring: each batch is cut into micro-batches that run through megatron-core's
``get_forward_backward_func`` with ``forward_only=True, collect_non_loss_data=True``; the last
stage turns its vocab-parallel logits into per-token log-probs and argmax flags (reductions over the
TP group, so nothing of size V is gathered), and broadcasts them over the pipeline group. With data
parallelism (world size > TP x PP) the batches are shared out between data-parallel ranks and the
results gathered, so every rank ends with every score.
"""

from __future__ import annotations

import dataclasses
import os
from functools import partial
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

from megatron_lev.config import ConfigError, RunConfig

from .scorer import Scorer, TokenScores, logprobs_from_logits


class EvalSetupError(RuntimeError):
    """The checkpoint cannot be evaluated with the requested layout; one-line message."""


# ------------------------------------------------------------------------------------------------
# process groups


def is_main_process() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


# ------------------------------------------------------------------------------------------------
# checkpoint -> arguments -> model


def checkpoint_config(load_dir: str, iteration: Optional[int] = None) -> Tuple[Dict[str, Any], int, str]:
    """(saved arguments, iteration, iteration directory) of the newest checkpoint under ``load_dir`` (or
    ``iteration``'s).

    ``load_dir`` is the ``--save`` directory of training (with ``latest_checkpointed_iteration.txt``).
    """
    from megatron_lev.checkpoint import CheckpointError, open_checkpoint

    if not os.path.isdir(load_dir):
        raise EvalSetupError(f"{load_dir}: no such checkpoint directory")
    try:
        saved = open_checkpoint(load_dir, iteration)
    except CheckpointError as e:
        raise EvalSetupError(str(e)) from None
    return saved.args, saved.iteration, saved.path


def eval_args(cfg: Dict[str, Any], tp: int = 1, pp: int = 1, world_size: int = 1,
              micro_batch_size: int = 4) -> RunConfig:
    """The checkpoint's saved configuration, re-laid-out for evaluation at TP x PP (no virtual stages,
    sequence parallelism, dropout, recomputation or multi-token prediction)."""
    try:
        rc = RunConfig.from_saved_args(cfg).relayout(tp, pp, world_size=world_size)
    except ConfigError as e:
        raise EvalSetupError(f"the checkpoint cannot be evaluated at TP={tp} PP={pp}: {e}") from None
    # Evaluation scores the main head: the multi-token-prediction block is built only for its training
    # loss (megatron-core's forward needs labels for it); its saved weights are left unread.
    model = dataclasses.replace(rc.model, sequence_parallel=False, hidden_dropout=0.0, attention_dropout=0.0,
                                recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                                mtp_num_layers=None)
    # relayout took the world size, so TP x PP divides it; the rest (its data-parallel size) is data parallel
    schedule = dataclasses.replace(rc.schedule, micro_batch_size=micro_batch_size,
                                   global_batch_size=micro_batch_size * rc.layout.dp, num_microbatches=1)
    return dataclasses.replace(rc, model=model, schedule=schedule)


def load_model(load_dir: str, tp: int = 1, pp: int = 1, micro_batch_size: int = 4, log=None,
               iteration: Optional[int] = None):
    """Build this rank's model chunk and load the newest checkpoint under ``load_dir`` (or ``iteration``'s)
    into it; every rank must name the same one (a tracker read on each rank could differ).

    Needs megatron's TP/PP groups (:func:`megatron_lev.distributed.init_distributed`) first. Returns
    ``(chunks, transformer_config, model_config, saved, info)`` with ``model_config`` the evaluated model's
    ``LevModelConfig``, ``saved`` the checkpoint's :class:`~megatron_lev.config.RunConfig` as saved and ``info`` =
    {checkpoint, iteration, iteration_dir, config}.
    """
    from megatron_lev.checkpoint import load_model_state
    from megatron_lev.models.factory import build_configs, build_model_chunks

    cfg, iteration, path = checkpoint_config(load_dir, iteration)
    try:
        saved = RunConfig.from_saved_args(cfg, source=os.path.join(path, "config.yaml"))
    except ConfigError as e:
        raise EvalSetupError(str(e)) from None
    rc = eval_args(cfg, tp, pp, torch.distributed.get_world_size(), micro_batch_size)
    if saved.model.mtp_num_layers and log is not None:
        log(f"  {path}: trained with --mtp-num-layers {saved.model.mtp_num_layers}; the main head is scored "
            f"(the MTP block is not loaded)")
    try:
        config, model_config = build_configs(rc, for_loading=True)
    except ConfigError as e:
        raise EvalSetupError(f"the checkpoint cannot be evaluated at TP={tp} PP={pp}: {e}") from None
    chunks = build_model_chunks(config, model_config)
    if torch.cuda.is_available():
        chunks = [c.cuda(torch.cuda.current_device()) for c in chunks]
    if config.bf16 or config.fp16:
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(config, c) for c in chunks]
    try:
        load_model_state(chunks, path, log=log)
    except Exception as e:  # dist_checkpointing's errors are many lines long
        raise EvalSetupError(f"{path}: cannot load the model ({type(e).__name__}: {_first_line(e)})") from None
    for c in chunks:
        c.eval()
    info = {"checkpoint": os.path.abspath(load_dir), "iteration": iteration, "iteration_dir": os.path.abspath(path),
            "config": cfg}
    return chunks, config, model_config, saved, info


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else ""


# ------------------------------------------------------------------------------------------------
# vocab-parallel log-probs


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, group=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Vocab-parallel logits [B, S, V/tp] -> (log p(target) [B, S], target == argmax [B, S]).

    The argmax is torch's (first index among equal maxima) over the full vocabulary.
    """
    import torch.distributed as dist

    if group is None:
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
    tp = dist.get_world_size(group)
    logits = logits.float()
    if tp == 1:
        return logprobs_from_logits(logits, targets)
    rank = dist.get_rank(group)
    v_local = logits.size(-1)
    start = rank * v_local
    local_max, local_arg = logits.max(dim=-1)
    gmax = local_max.clone()
    dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
    sumexp = torch.exp(logits - gmax.unsqueeze(-1)).sum(dim=-1)
    dist.all_reduce(sumexp, group=group)
    in_range = (targets >= start) & (targets < start + v_local)
    idx = (targets - start).clamp(0, v_local - 1)
    tlogit = logits.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * in_range
    dist.all_reduce(tlogit, group=group)
    big = torch.iinfo(torch.long).max
    cand = torch.where(local_max == gmax, local_arg + start, torch.full_like(local_arg, big))
    dist.all_reduce(cand, op=dist.ReduceOp.MIN, group=group)
    return tlogit - gmax - torch.log(sumexp), cand == targets


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None)
    return output, partial(_collect, batch["targets"])


def _collect(targets, output_tensor, non_loss_data: bool = False):
    lp, greedy = vocab_parallel_logprobs(output_tensor, targets)
    return {"logprobs": lp.double(), "greedy": greedy}


class MegatronScorer(Scorer):
    """Scores with the loaded model chunk(s) of this rank; every rank must call :meth:`score` with the
    same sequences (collective)."""

    def __init__(self, chunks, config, *, max_length: int, vocab_size: int, micro_batch_size: int = 4,
                 num_microbatches: Optional[int] = None, description: str = "megatron-lev") -> None:
        from megatron.core import parallel_state as ps

        self.model = list(chunks)
        self.config = config
        self.max_length = int(max_length)
        self.vocab_size = int(vocab_size)
        self.micro_batch_size = int(micro_batch_size)
        pp = ps.get_pipeline_model_parallel_world_size()
        self.num_microbatches = int(num_microbatches or (1 if pp == 1 else 2 * pp))
        self.batch_size = self.micro_batch_size * self.num_microbatches
        self.description = description
        self.is_main = is_main_process()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    @classmethod
    def from_checkpoint(cls, load_dir: str, *, tp: int = 1, pp: int = 1, micro_batch_size: int = 4,
                        num_microbatches: Optional[int] = None, max_length: Optional[int] = None, log=None,
                        iteration: Optional[int] = None):
        """Load ``load_dir`` (its tracker's checkpoint, or ``iteration``'s; after
        :func:`megatron_lev.distributed.init_distributed`); return ``(scorer, saved, info)`` (``saved``: the
        checkpoint's :class:`~megatron_lev.config.RunConfig` as saved)."""
        chunks, config, model_config, saved, info = load_model(load_dir, tp, pp, micro_batch_size, log=log,
                                                               iteration=iteration)
        # Learned absolute positions cap the window at max_position_embeddings; RoPE models may be
        # given a longer window than they were trained on.
        limit = saved.data.seq_length
        if model_config.position_embedding_type == "learned_absolute":
            limit = min(max_length or limit, model_config.max_sequence_length)
        elif max_length:
            limit = max_length
        scorer = cls(chunks, config, max_length=limit, vocab_size=model_config.vocab_size,
                     micro_batch_size=micro_batch_size, num_microbatches=num_microbatches,
                     description=f"megatron-lev {info['checkpoint']} (iteration {info['iteration']}, TP={tp}, PP={pp})")
        return scorer, saved, info

    def _score_batches(self, batches, progress) -> Iterable[List[TokenScores]]:
        from megatron.core import parallel_state as ps

        dp = ps.get_data_parallel_world_size()
        rank = ps.get_data_parallel_rank()
        mine = list(range(rank, len(batches), dp))
        results = {}
        for i in mine:
            results[i] = self._score_batch(batches[i])
            if progress is not None:  # the data-parallel ranks score batches i .. i + dp - 1 side by side
                progress.update(sum(len(b) for b in batches[i:i + dp]))
        if dp > 1:
            gathered: List[Any] = [None] * dp
            torch.distributed.all_gather_object(gathered, results, group=ps.get_data_parallel_group())
            for part in gathered:
                results.update(part)
        for i in range(len(batches)):
            yield results[i]

    @torch.no_grad()
    def _score_padded(self, tokens: torch.Tensor) -> Tuple[np.ndarray, np.ndarray]:
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        b, length = tokens.shape
        s = length - 1
        mbs = min(self.micro_batch_size, b)
        n_mb = -(-b // mbs)
        padded = torch.zeros((n_mb * mbs, length), dtype=torch.long)
        padded[:b] = tokens
        padded = padded.to(self.device)
        pos = torch.arange(s, device=self.device).unsqueeze(0).expand(mbs, s)
        micro = [{"tokens": padded[j * mbs:(j + 1) * mbs, :-1].contiguous(), "position_ids": pos,
                  "targets": padded[j * mbs:(j + 1) * mbs, 1:].contiguous()} for j in range(n_mb)]
        out = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iter(micro), model=self.model, num_microbatches=n_mb,
            seq_length=s, micro_batch_size=mbs, decoder_seq_length=s, forward_only=True, collect_non_loss_data=True)
        lp = torch.zeros((n_mb * mbs, s), dtype=torch.float64, device=self.device)
        greedy = torch.zeros((n_mb * mbs, s), dtype=torch.uint8, device=self.device)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            lp = torch.cat([d["logprobs"] for d in out]).to(self.device)
            greedy = torch.cat([d["greedy"] for d in out]).to(torch.uint8).to(self.device)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            src = ps.get_pipeline_model_parallel_last_rank()
            group = ps.get_pipeline_model_parallel_group()
            torch.distributed.broadcast(lp, src=src, group=group)
            torch.distributed.broadcast(greedy, src=src, group=group)
        return lp[:b].cpu().numpy(), greedy[:b].bool().cpu().numpy()
