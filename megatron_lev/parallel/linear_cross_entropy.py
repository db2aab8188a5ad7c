"""The output head and its cross-entropy in one, chunk by chunk over the tokens: the per-token loss of a
vocab-parallel linear head without the [tokens, V/TP] logits.

For tokens x_t (rows of the final hidden states) and the head's weight W, split by rows over the
tensor-parallel group (rank r holds the rows [r V/TP, (r+1) V/TP), as megatron's ColumnParallelLinear
output layer), the loss of token t with target y_t is

    loss_t = log sum_v exp(x_t . w_v) - x_t . w_{y_t}

Per chunk of tokens each rank forms its local logits x_c W_r^T in the compute dtype, takes them to fp32
as megatron's ``vocab_parallel_cross_entropy`` does, and keeps three numbers per token: the local
maximum, the local sum of exp(logit - local maximum) and the target's logit where the target is one of
its rows (0 elsewhere). After the last chunk the statistics are reduced over the TP group with
megatron's reductions: MAX for the maximum, then SUM for the sums (each rescaled to the global maximum)
and for the target logit. Two collectives of [tokens] per call, whatever the number of chunks.

Only the per-token log-sum-exp is kept for the backward (fp32, [tokens]), beside the inputs. The
backward recomputes each chunk's logits, forms softmax - one_hot(target) times the upstream gradient
in fp32 (megatron's formula), casts it to the compute dtype (as autograd casts megatron's fp32 logit
gradient to the logits' dtype) and accumulates the input gradient and the weight gradient chunk by
chunk. The input gradient is then reduced as the output layer reduces it: all-reduced over TP, or with
sequence parallelism (the hidden states arrive split along the sequence) the forward all-gathers them
and the backward all-gathers them again and reduce-scatters their gradient, saving only the local
slice as megatron's linear layer does. With gradient-accumulation fusion (megatron DDP's fp32
``main_grad`` on the weight) each chunk's weight gradient is added into ``main_grad`` and the weight's
``grad_added_to_main_grad`` convention of megatron's linear layer is followed.

Memory beyond the inputs: one chunk's logits (fp32, plus the compute-dtype copy under bf16) and the
weight gradient; never a [tokens, V/TP] tensor. Compute: one more logits GEMM than megatron's path
(the recomputation), in exchange for never writing or reading the logits in memory.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear
from torch import Tensor

__all__ = ["linear_cross_entropy", "default_chunk_size", "CHUNK_BYTES", "LinearCrossEntropyHead", "DeferredLogits"]

# Default chunk: the fp32 logits of one chunk about this large (V/TP = 200k: 320 tokens). Large enough
# for full-speed GEMMs, small enough that the chunk's logits stay far below the head's weight gradient.
CHUNK_BYTES = 256 * 2**20


def default_chunk_size(local_vocab: int) -> int:
    """Tokens per chunk when none is given: fp32 logits of about ``CHUNK_BYTES`` per chunk (at least 1)."""
    return max(1, CHUNK_BYTES // (4 * max(1, local_vocab)))


def _group_size(group) -> int:
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


def _group_rank(group) -> int:
    return 0 if group is None or not dist.is_initialized() else dist.get_rank(group)


def _gather_sequence(x: Tensor, group) -> Tensor:
    """All-gather along dim 0 over ``group`` (the sequence-parallel split of the hidden states)."""
    size = _group_size(group)
    out = torch.empty((x.shape[0] * size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _local_targets(target: Tensor, start: int, rows: int) -> Tuple[Tensor, Tensor]:
    """(index into this rank's rows, whether the target is one of them), as megatron masks its targets."""
    local = target - start
    mine = (local >= 0) & (local < rows)
    return torch.where(mine, local, torch.zeros_like(local)), mine


class _ChunkBuffers:
    """One chunk's logits buffers, reused by every chunk of a call: a fresh [chunk, V/TP] tensor per chunk
    would be a fresh allocation (and, on CPU, fresh pages to fault in) each time. ``f32`` holds the fp32
    logits; ``native`` their compute-dtype GEMM output when that is not fp32."""

    def __init__(self, chunk: int, rows: int, dtype: torch.dtype, device: torch.device) -> None:
        self.f32 = torch.empty((chunk, rows), dtype=torch.float32, device=device)
        self.native = None if dtype == torch.float32 else torch.empty((chunk, rows), dtype=dtype, device=device)

    def logits(self, xc: Tensor, w_t: Tensor) -> Tensor:
        """fp32 logits of the chunk ``xc``, computed in its dtype (megatron: the head's GEMM, then .float())."""
        n = xc.shape[0]
        if self.native is None:
            return torch.matmul(xc, w_t, out=self.f32[:n])
        return self.f32[:n].copy_(torch.matmul(xc, w_t, out=self.native[:n]))

    def to_compute_dtype(self, d: Tensor) -> Tensor:
        """``d`` in the compute dtype (autograd casts megatron's fp32 logit gradient so)."""
        if self.native is None:
            return d
        return self.native[:d.shape[0]].copy_(d)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, target: Tensor, tp_group, sequence_parallel: bool,
                chunk_size: Optional[int], gradient_accumulation_fusion: bool) -> Tensor:
        tp = _group_size(tp_group)
        sp = bool(sequence_parallel) and tp > 1
        total = _gather_sequence(hidden, tp_group) if sp else hidden
        h = total.shape[-1]
        x = total.reshape(-1, h)
        y = target.reshape(-1)
        if y.numel() != x.shape[0]:
            raise ValueError(f"linear cross-entropy: {x.shape[0]} tokens of hidden states but {y.numel()} targets")
        rows = weight.shape[0]
        start = _group_rank(tp_group) * rows
        n = x.shape[0]
        step = chunk_size or default_chunk_size(rows)
        stats = torch.empty((3, n), dtype=torch.float32, device=x.device)  # local max, local sum-exp, target
        local_argmax = torch.empty(n, dtype=torch.long, device=x.device)
        bufs = _ChunkBuffers(min(step, n), rows, x.dtype, x.device)
        w_t = weight.t()
        for i in range(0, n, step):
            xc = x[i:i + step]
            logits = bufs.logits(xc, w_t)
            idx, mine = _local_targets(y[i:i + step], start, rows)
            top, arg = logits.max(dim=-1)
            stats[0, i:i + step] = top
            local_argmax[i:i + step] = arg
            picked = logits.gather(1, idx.unsqueeze(1)).squeeze(1)
            stats[2, i:i + step] = torch.where(mine, picked, torch.zeros_like(picked))
            stats[1, i:i + step] = logits.sub_(top.unsqueeze(1)).exp_().sum(dim=-1)
        del bufs
        local_max, sums = stats[0], stats[1:]
        if tp > 1:
            top = local_max.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp_group)
            sums[0].mul_(torch.exp(local_max - top))
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
        else:
            top = local_max
        lse = torch.log(sums[0]).add_(top)
        loss = lse - sums[1]

        ctx.save_for_backward(hidden, weight, target, lse)
        ctx.tp_group, ctx.sp, ctx.step, ctx.start = tp_group, sp, step, start
        # Saved here, not with save_for_backward: the same head may serve several losses (MTP), as in
        # megatron's linear layer.
        ctx.main_grad = weight.main_grad if gradient_accumulation_fusion and hasattr(weight, "main_grad") else None
        ctx.fusion = bool(gradient_accumulation_fusion)
        local_max = local_max.view(target.shape)
        ctx.mark_non_differentiable(local_max, local_argmax)
        return loss.view(target.shape), local_max, local_argmax.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_max, _grad_argmax):
        hidden, weight, target, lse = ctx.saved_tensors
        tp_group, sp, step, start = ctx.tp_group, ctx.sp, ctx.step, ctx.start
        total = _gather_sequence(hidden, tp_group) if sp else hidden
        h = total.shape[-1]
        x = total.reshape(-1, h)
        y = target.reshape(-1)
        g = grad_loss.reshape(-1).float()
        rows = weight.shape[0]
        n = x.shape[0]
        grad_x = torch.empty_like(x)
        main_grad = ctx.main_grad
        fused_wgrad = ctx.fusion and main_grad is not None
        need_w = ctx.needs_input_grad[1]  # not for a frozen (detached) head weight, as megatron's linear layer
        grad_w = None
        if need_w and fused_wgrad:
            weight.main_grad = main_grad
            grad_w = main_grad
        elif need_w:
            # Summed in fp32 whatever the weight's dtype: a bf16 sum would round once per chunk.
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        bufs = _ChunkBuffers(min(step, n), rows, x.dtype, x.device)
        w_t = weight.t()
        for i in range(0, n, step):
            xc = x[i:i + step]
            # softmax - one_hot(target), times the upstream gradient: megatron's backward, in fp32.
            d = bufs.logits(xc, w_t).sub_(lse[i:i + step].unsqueeze(1)).exp_()
            idx, mine = _local_targets(y[i:i + step], start, rows)
            d.scatter_add_(1, idx.unsqueeze(1), -mine.to(d.dtype).unsqueeze(1))
            d.mul_(g[i:i + step].unsqueeze(1))
            d = bufs.to_compute_dtype(d)
            torch.matmul(d, weight, out=grad_x[i:i + step])
            if grad_w is None:
                pass
            elif grad_w.dtype == d.dtype:
                grad_w.addmm_(d.t(), xc)
            else:  # the chunk's GEMM in the compute dtype, as megatron's, added in fp32
                grad_w.add_(torch.matmul(d.t(), xc))
        del bufs
        if _group_size(tp_group) > 1:
            if sp:
                out = torch.empty_like(hidden).reshape(-1, h)
                dist.reduce_scatter_tensor(out, grad_x, group=tp_group)
                grad_x = out
            else:
                dist.all_reduce(grad_x, group=tp_group)
        grad_hidden = grad_x.view(hidden.shape)

        if need_w and fused_wgrad:
            # megatron's convention: the gradient is in main_grad; a placeholder keeps DDP's hooks on the
            # main backward thread where megatron's DDP asks for one (grad_added_to_main_grad).
            if hasattr(weight, "grad_added_to_main_grad"):
                make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
                grad_weight = make(main_grad.shape, dtype=weight.dtype, device=weight.device)
                weight.grad_added_to_main_grad = True
            else:
                grad_weight = None
        else:
            grad_weight = grad_w if grad_w is None or grad_w.dtype == weight.dtype else grad_w.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, *,
                         tp_group: Optional[dist.ProcessGroup] = None, sequence_parallel: bool = False,
                         chunk_size: Optional[int] = None, gradient_accumulation_fusion: bool = False) -> Tensor:
    """Per-token cross-entropy of the vocab-parallel head ``weight`` on ``hidden``, without its logits.

    Args:
        hidden: final hidden states [s, b, h] ([s/TP, b, h] under ``sequence_parallel``) or [tokens, h].
        weight: this rank's head rows [V/TP, h] (rank r: rows r V/TP ...), in the compute dtype of ``hidden``.
        target: token ids [s, b] (the whole sequence on every rank, as megatron's loss takes them), or [tokens].
        tp_group: the tensor-parallel group (None: one rank).
        sequence_parallel: ``hidden`` is split along dim 0 over ``tp_group`` (megatron's sequence parallelism).
        chunk_size: tokens per chunk (None: ``default_chunk_size``).
        gradient_accumulation_fusion: add the weight gradient into ``weight.main_grad`` (megatron DDP).

    Returns:
        fp32 loss shaped like ``target``; equal to megatron's ``vocab_parallel_cross_entropy`` of the
        head's logits, without label smoothing.
    """
    return _apply(hidden, weight, target, tp_group, sequence_parallel, chunk_size, gradient_accumulation_fusion)[0]


def _apply(hidden, weight, target, tp_group, sequence_parallel, chunk_size, gradient_accumulation_fusion):
    """(loss, this rank's largest logit per token, its index among this rank's rows)."""
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"linear cross-entropy: chunk_size must be >= 1 (got {chunk_size})")
    return _LinearCrossEntropy.apply(hidden, weight, target, tp_group, sequence_parallel, chunk_size,
                                     gradient_accumulation_fusion)


class DeferredLogits:
    """What ``LinearCrossEntropyHead`` returns in place of its [s, b, V/TP] logits: its input and the weight it
    was given, for ``LinearCrossEntropyHead.loss`` to turn into the per-token loss.

    Once the loss is computed it also answers what megatron-core 0.19 asks of an MTP head's logits to count
    the accepted predictions (``_compute_mtp_acceptance_counts``): ``size()`` and ``max(dim=-1)`` (this
    rank's largest logit and its index per token) and ``torch.argmax(.., dim=-1)``, from the statistics
    the loss's forward kept."""

    __slots__ = ("hidden", "weight", "head", "local_max")

    def __init__(self, hidden: Tensor, weight: Tensor, head: "LinearCrossEntropyHead") -> None:
        self.hidden, self.weight, self.head = hidden, weight, head
        self.local_max: Optional[Tuple[Tensor, Tensor]] = None

    def size(self, dim: Optional[int] = None):
        shape = list(self.hidden.shape[:-1]) + [self.weight.shape[0]]
        if self.head.sequence_parallel:
            shape[0] *= _group_size(self.head.tp_group)
        shape = torch.Size(shape)
        return shape if dim is None else shape[dim]

    def max(self, dim: int):
        if dim not in (-1, len(self.size()) - 1):
            raise NotImplementedError("deferred logits answer max over the vocabulary only")
        if self.local_max is None:
            raise RuntimeError("deferred logits: the loss is computed before their maximum is asked")
        return self.local_max

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.argmax and isinstance(args[0], cls):
            return args[0].max(kwargs.get("dim", args[1] if len(args) > 1 else None))[1]
        return NotImplemented


class LinearCrossEntropyHead(ColumnParallelLinear):
    """megatron-core's vocab-parallel output layer which, while ``defer_logits`` is set, returns
    ``DeferredLogits`` instead of computing its logits; ``loss`` then gives the per-token loss by
    ``linear_cross_entropy`` with the layer's TP group, sequence parallelism and gradient-accumulation
    fusion. Unset, it is the ColumnParallelLinear it was (logits for evaluation and generation).

    ``adopt`` turns the ColumnParallelLinear megatron's GPTModel built into this class in place: the
    parameters, their attributes and the checkpoint layout stay those of megatron's layer."""

    chunk_size: Optional[int] = None
    defer_logits: bool = False

    @classmethod
    def adopt(cls, layer: ColumnParallelLinear, chunk_size: Optional[int] = None) -> "LinearCrossEntropyHead":
        if type(layer) is not ColumnParallelLinear:
            raise TypeError(f"the output layer is a {type(layer).__name__}, not megatron-core's ColumnParallelLinear")
        layer.__class__ = cls
        layer.chunk_size = chunk_size
        layer.defer_logits = False
        return layer

    def forward(self, input_: Tensor, weight: Optional[Tensor] = None, runtime_gather_output: Optional[bool] = None):
        if not self.defer_logits:
            return super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        weight = self.weight if weight is None else weight
        if weight is None:
            raise RuntimeError("the output layer has no weight and none was given")
        return DeferredLogits(input_, weight, self), None

    def loss(self, deferred: DeferredLogits, labels: Tensor) -> Tensor:
        """Per-token loss [b, s] for ``labels`` [b, s], as megatron's ``compute_language_model_loss``."""
        loss, top, arg = _apply(deferred.hidden, deferred.weight, labels.transpose(0, 1).contiguous(), self.tp_group,
                                self.sequence_parallel, self.chunk_size, self.gradient_accumulation_fusion)
        deferred.local_max = torch.return_types.max((top, arg))
        return loss.transpose(0, 1).contiguous()
