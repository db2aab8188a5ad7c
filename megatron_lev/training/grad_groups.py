"""Gradient norms of the input side, the transformer body and the output head, and whether clipping fired.

Global clipping couples the groups: when one group's gradients dominate the global norm, every group takes
a smaller step. The loop records, on its logged iterations only, each group's norm before clipping, and on
every iteration whether the step was clipped (from the global norm the optimizer returns, already read on
the host: no extra sync).

Groups by parameter name (megatron's names, below the DDP wrapper): ``embedding.*`` is the input side (the
V x D table, or an arm's codebooks, heads and projections, with learned positions), ``output_layer.*`` the
head, everything else the body (decoder, final norm, MTP block). The tied table is the input side's (its one
gradient also carries the head's). As megatron's own norm: gradients (``main_grad`` under megatron DDP)
before the optimizer step, a tensor-parallel duplicate and the last stage's copy of the tied table counted
once, squares summed over the model-parallel ranks (the expert parameters' over their expert-parallel ranks).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

GROUPS = ("input", "body", "head")


def group_of(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    if name.startswith("embedding."):
        return "input"
    if name.startswith("output_layer."):
        return "head"
    return "body"


def supported(use_distributed_optimizer: bool, data_parallel_size: int) -> bool:
    """Whether every gradient is whole on each rank before the step: the distributed optimizer with data
    parallelism leaves only this rank's shard reduced (the rest of the buffer holds its local gradients)."""
    return not (use_distributed_optimizer and data_parallel_size > 1)


def group_squares(model_chunks, experts: bool = False) -> torch.Tensor:
    """Collective over the model-parallel ranks: the summed squared gradients per group, a device tensor
    ``[len(GROUPS)]`` (read it on the host only where it is logged). ``experts``: the model has MoE layers
    (a second reduction, over the expert ranks, joined by every rank)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    dense: Dict[str, List[torch.Tensor]] = {g: [] for g in GROUPS}
    expert: Dict[str, List[torch.Tensor]] = {g: [] for g in GROUPS}
    device: Optional[torch.device] = None
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            grad = getattr(p, "main_grad", None)
            grad = p.grad if grad is None else grad
            device = device or p.device
            if grad is None or not param_is_not_shared(p) or not param_is_not_tensor_parallel_duplicate(p):
                continue
            (dense if getattr(p, "allreduce", True) else expert)[group_of(name)].append(grad)

    def squares(by_group, group) -> torch.Tensor:
        out = torch.zeros(len(GROUPS), dtype=torch.float32, device=device)
        for i, g in enumerate(GROUPS):
            if by_group[g]:
                norms = torch.stack([n.float() for n in torch._foreach_norm(by_group[g])])
                out[i] = (norms * norms).sum()
        torch.distributed.all_reduce(out, group=group)
        return out

    total = squares(dense, ps.get_model_parallel_group())
    if experts:
        total = total + squares(expert, ps.get_expert_tensor_model_pipeline_parallel_group())
    return total


def norms(squares_on_host: List[float]) -> Dict[str, float]:
    return {f"grad norm {g}": max(0.0, s) ** 0.5 for g, s in zip(GROUPS, squares_on_host)}


def clipped(grad_norm: Optional[float], clip_grad: float) -> Optional[bool]:
    """Whether megatron's clipping scaled this step's gradients (its coefficient clip / (norm + 1e-6) < 1)."""
    if grad_norm is None or not clip_grad or clip_grad <= 0:
        return None
    return clip_grad / (grad_norm + 1.0e-6) < 1.0
