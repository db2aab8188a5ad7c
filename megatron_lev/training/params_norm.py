"""``--log-params-norm``: the L2 norm of the model's parameters, as Megatron-LM's ``calc_params_l2_norm``
counts it: each parameter once over the tensor-parallel ranks (a duplicate counts on TP rank 0 only), a
weight shared between pipeline stages once, the dense parameters summed over the model-parallel group
(TP x PP) and the experts' over the expert tensor-model-pipeline group. The model's own parameters are
read (their training dtype, squared and summed in fp32), not the optimizer's fp32 copies."""

from __future__ import annotations

from typing import List

import torch

from megatron_lev.parallel.collectives import all_reduce_


def _expert(param) -> bool:
    return not getattr(param, "allreduce", True)


def _counted_here(param) -> bool:
    """Whether this rank counts ``param``: not a shared copy, and its own shard or TP rank 0's copy."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    if not param_is_not_shared(param):
        return False
    if _expert(param):
        return bool(getattr(param, "tensor_model_parallel", False)) or ps.get_expert_tensor_parallel_rank() == 0
    return param_is_not_tensor_parallel_duplicate(param)


def _squares(params: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        # Reduced in fp32 without an fp32 copy of the parameter (a 128k x 4096 embedding's would be 2 GiB).
        total += torch.linalg.vector_norm(p.detach(), dtype=torch.float32).square()
    return total


def params_l2_norm(model) -> float:
    """The L2 norm of the parameters of ``model`` (its chunks) over every rank of the model: a collective on
    every rank. Read on the host (one sync), on the iterations that log it only."""
    from megatron.core import parallel_state as ps

    params = [p for chunk in model for p in chunk.parameters() if _counted_here(p)]
    device = next((p.device for chunk in model for p in chunk.parameters()), torch.device("cpu"))
    dense = _squares([p for p in params if not _expert(p)], device)
    all_reduce_(dense, group=ps.get_model_parallel_group())
    experts = _squares([p for p in params if _expert(p)], device)
    # On every rank, experts or not (a pipeline stage of dense layers still joins the expert group's reduce).
    all_reduce_(experts, group=ps.get_expert_tensor_model_pipeline_parallel_group())
    return float((dense + experts).sqrt())
