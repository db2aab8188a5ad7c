"""Collectives on the device their process group needs.

NCCL takes only CUDA tensors and gloo only CPU tensors (for the operations used here), so a collective
on a tensor that lives elsewhere (an initialisation statistic computed under ``use_cpu_initialization``,
a host-side flag) is moved to the group's device and the result copied back in place.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["group_device", "all_reduce_", "broadcast_", "gather_objects", "all_gather_objects", "broadcast_object"]


def group_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """The device whose tensors a collective on ``group`` (default: the world) takes."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _on_group_device(tensor: torch.Tensor, group, collective) -> torch.Tensor:
    device = group_device(group)
    work = tensor if tensor.device == device and tensor.is_contiguous() else tensor.to(device).contiguous()
    collective(work)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def all_reduce_(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """In-place all-reduce of ``tensor`` wherever it lives; returns ``tensor``."""
    return _on_group_device(tensor, group, lambda t: dist.all_reduce(t, op=op, group=group))


def broadcast_(tensor: torch.Tensor, src: int, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """In-place broadcast of ``tensor`` from global rank ``src`` wherever it lives; returns ``tensor``."""
    return _on_group_device(tensor, group, lambda t: dist.broadcast(t, src=src, group=group))


def gather_objects(obj, dst: int = 0, group: Optional[dist.ProcessGroup] = None) -> Optional[list]:
    """Every rank's picklable ``obj``, in rank order, on global rank ``dst``; None on the other ranks.
    (torch's ``gather_object``: its NCCL path packs the objects on the current CUDA device.)"""
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def all_gather_objects(obj, group: Optional[dist.ProcessGroup] = None) -> list:
    """Every rank's picklable ``obj``, in rank order, on every rank (torch's ``all_gather_object``)."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, src: int = 0, group: Optional[dist.ProcessGroup] = None):
    """Global rank ``src``'s picklable ``obj`` on every rank (torch's ``broadcast_object_list``)."""
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
