"""The output head and its cross-entropy in one, tile by tile: the per-token loss of a vocab-parallel
linear head without the [tokens, V/TP] logits.

For tokens x_t (rows of the final hidden states) and the head's weight W, split by rows over the
tensor-parallel group (rank r holds the rows [r V/TP, (r+1) V/TP), as megatron's ColumnParallelLinear
output layer), the loss of token t with target y_t is

    loss_t = log sum_v exp(x_t . w_v) - x_t . w_{y_t}

The logits are formed in tiles of a chunk of tokens by a block of this rank's vocabulary rows
(``tiling``), in the compute dtype, and taken to fp32 as megatron's ``vocab_parallel_cross_entropy``
does. Per token each rank keeps three numbers over its blocks: the running maximum, the sum of
exp(logit - maximum) rescaled as the maximum grows, and the target's logit where the target is one of
its rows (0 elsewhere). After the last tile the statistics are reduced over the TP group with
megatron's reductions: MAX for the maximum, then SUM for the sums (each rescaled to the global maximum)
and for the target logit: two collectives of [tokens] per call, whatever the number of tiles.

Only the per-token log-sum-exp is kept for the backward (fp32, [tokens]), beside the inputs. The
backward recomputes each tile's logits, forms softmax - one_hot(target) times the upstream gradient in
fp32 (megatron's formula), casts it to the compute dtype (as autograd casts megatron's fp32 logit
gradient to the logits' dtype) and adds the tile's input- and weight-gradient GEMMs (in fp32 across
tiles; with one block, the input gradient is one GEMM as megatron's). The input gradient is then
reduced as the output layer reduces it: all-reduced over TP, or with sequence parallelism (the hidden
states arrive split along the sequence) the forward all-gathers them and the backward all-gathers them
again and reduce-scatters their gradient, saving only the local slice as megatron's linear layer does.
With gradient-accumulation fusion (megatron DDP's fp32 ``main_grad`` on the weight) the weight gradient
is added into ``main_grad`` and the weight's ``grad_added_to_main_grad`` convention of megatron's linear
layer is followed.

Memory beyond the inputs and gradients: one tile's logits (fp32, plus the compute-dtype copy under
bf16), an fp32 accumulator of one block's weight gradient (of the input gradient over several blocks),
and [tokens] statistics; never a [tokens, V/TP] tensor. Compute: one more logits GEMM than megatron's
path (the recomputation); on the CPU the tiles stay in the cache between their GEMM and the passes over
them, which megatron's path makes over the whole logits in fresh memory.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear
from torch import Tensor

__all__ = ["linear_cross_entropy", "tiling", "Tiling", "default_chunk_size", "LinearCrossEntropyHead",
           "DeferredLogits"]

# The tiles the logits are formed in: ``chunk`` tokens by ``block`` of this rank's vocabulary rows.
# On CUDA one block spans the rows, and a chunk holds about CHUNK_BYTES of fp32 logits (V/TP = 200k: 335
# tokens): large GEMMs, few launches. On the CPU a tile of CPU_TILE_BYTES (CPU_CHUNK = 512 tokens x 2,048
# rows) stays in the cache between its GEMM and the passes over it (max, exp, sum; the gradient's exp,
# target, scaling and cast), which megatron's path makes over the whole logits in fresh memory; measured
# on a 2-core Zen 5 (bench/linear_cross_entropy.py), 32 MiB tiles took ~10% and 64 MiB ones ~40% longer.
CHUNK_BYTES = 256 * 2**20
CPU_TILE_BYTES = 4 * 2**20
CPU_CHUNK = 512


class Tiling(NamedTuple):
    chunk: int
    """Tokens per chunk."""
    block: int
    """Vocabulary rows per block (this rank's rows: one block)."""


def default_chunk_size(local_vocab: int) -> int:
    """Tokens per chunk on CUDA when none is given: fp32 logits of about ``CHUNK_BYTES`` (at least 1)."""
    return max(1, CHUNK_BYTES // (4 * max(1, local_vocab)))


def tiling(tokens: int, rows: int, device: torch.device, chunk_size: Optional[int] = None,
           vocab_block: Optional[int] = None) -> Tiling:
    """The tiles for ``tokens`` tokens and ``rows`` vocabulary rows on ``device`` (see the constants)."""
    if device.type == "cpu":
        chunk = min(tokens, chunk_size or CPU_CHUNK)
        block = vocab_block or max(1, CPU_TILE_BYTES // (4 * max(1, chunk)))
    else:
        chunk = min(tokens, chunk_size or default_chunk_size(rows))
        block = vocab_block or rows
    return Tiling(max(1, chunk), max(1, min(rows, block)))


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


class _TileBuffers:
    """One tile's buffers, reused by every tile of a call: a fresh tensor per tile would be a fresh
    allocation (and, on the CPU, fresh pages to fault in) each time; mixed-dtype torch ops allocate one, so
    each dtype change here is a ``copy_`` into a buffer. ``f32``: the fp32 tile; ``native``: the tile in the
    compute dtype when that is not fp32; ``dx``, ``dw`` (and their fp32 ``dx32``, ``dw32``): the tile's
    input- and weight-gradient GEMMs before they are added in fp32."""

    def __init__(self, tiles: Tiling, hidden: int, dtype: torch.dtype, device: torch.device,
                 gradients: bool = False) -> None:
        self.f32 = torch.empty(tiles, dtype=torch.float32, device=device)
        self.native = self.dx = self.dw = self.dx32 = self.dw32 = None
        if dtype != torch.float32:
            self.native = torch.empty(tiles, dtype=dtype, device=device)
        if dtype != torch.float32 and gradients:
            self.dx = torch.empty((tiles.chunk, hidden), dtype=dtype, device=device)
            self.dw = torch.empty((tiles.block, hidden), dtype=dtype, device=device)
            self.dx32 = torch.empty((tiles.chunk, hidden), dtype=torch.float32, device=device)
            self.dw32 = torch.empty((tiles.block, hidden), dtype=torch.float32, device=device)

    def logits(self, xc: Tensor, w: Tensor) -> Tensor:
        """The logits of the tokens ``xc`` and the rows ``w`` in their dtype (megatron: the head's GEMM)."""
        n, m = xc.shape[0], w.shape[0]
        return torch.matmul(xc, w.t(), out=(self.f32 if self.native is None else self.native)[:n, :m])

    def shifted(self, logits: Tensor, shift: Tensor) -> Tensor:
        """fp32 ``logits - shift[:, None]`` (megatron: .float(), then the subtraction)."""
        f32 = logits if self.native is None else self.f32[:logits.shape[0], :logits.shape[1]].copy_(logits)
        return f32.sub_(shift.unsqueeze(1))

    def scaled(self, d: Tensor, g: Tensor) -> Tensor:
        """``d * g[:, None]`` in the compute dtype (megatron: the product in fp32, cast by autograd)."""
        d.mul_(g.unsqueeze(1))
        return d if self.native is None else self.native[:d.shape[0], :d.shape[1]].copy_(d)

    def add_input_grad(self, acc: Tensor, d: Tensor, w: Tensor) -> None:
        """``acc += d @ w`` (the GEMM in the compute dtype, as megatron's, summed in fp32)."""
        if acc.dtype == d.dtype:
            acc.addmm_(d, w)
        else:
            n = d.shape[0]
            acc.add_(self.dx32[:n].copy_(torch.matmul(d, w, out=self.dx[:n])))

    def add_weight_grad(self, acc: Tensor, d: Tensor, xc: Tensor) -> None:
        """``acc += d^T @ xc`` (likewise)."""
        if acc.dtype == d.dtype:
            acc.addmm_(d.t(), xc)
        else:
            m = d.shape[1]
            acc.add_(self.dw32[:m].copy_(torch.matmul(d.t(), xc, out=self.dw[:m])))


def _in_block(local: Tensor, mine: Tensor, j: int, rows: int) -> Tuple[Tensor, Tensor]:
    """(index into the block of rows [j, j + rows), whether the target is in it)."""
    inside = mine & (local >= j) & (local < j + rows)
    return (local - j).clamp_(0, rows - 1), inside


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, target: Tensor, tp_group, sequence_parallel: bool,
                chunk_size: Optional[int], vocab_block: Optional[int], gradient_accumulation_fusion: bool):
        tp = _group_size(tp_group)
        sp = bool(sequence_parallel) and tp > 1
        total = _gather_sequence(hidden, tp_group) if sp else hidden
        h = total.shape[-1]
        x = total.reshape(-1, h)
        y = target.reshape(-1)
        if y.numel() != x.shape[0]:
            raise ValueError(f"linear cross-entropy: {x.shape[0]} tokens of hidden states but {y.numel()} targets")
        rows, n = weight.shape[0], x.shape[0]
        start = _group_rank(tp_group) * rows
        tiles = tiling(n, rows, x.device, chunk_size, vocab_block)
        c, vb = tiles
        # Per token: this rank's max logit, sum of exp(logit - max), target logit (0 if not its row); argmax.
        stats = torch.empty((3, n), dtype=torch.float32, device=x.device)
        local_argmax = torch.empty(n, dtype=torch.long, device=x.device)
        stats[0].fill_(float("-inf"))
        stats[1:].zero_()
        local_argmax.zero_()
        local, mine = _local_targets(y, start, rows)
        bufs = _TileBuffers(tiles, h, x.dtype, x.device)
        # Vocabulary blocks outside, token chunks inside: a block's rows stay in the cache for every chunk.
        for j in range(0, rows, vb):
            w = weight[j:j + vb]
            for i in range(0, n, c):
                top, sums, picked = stats[0, i:i + c], stats[1, i:i + c], stats[2, i:i + c]
                arg = local_argmax[i:i + c]
                logits = bufs.logits(x[i:i + c], w)
                idx, inside = _in_block(local[i:i + c], mine[i:i + c], j, w.shape[0])
                picked.add_(torch.where(inside, logits.gather(1, idx.unsqueeze(1)).squeeze(1).float(), 0.0))
                block_top, block_arg = logits.max(dim=-1)
                block_top = block_top.float()
                new_top = torch.maximum(top, block_top)
                arg.copy_(torch.where(block_top > top, block_arg + j, arg))  # the first maximum, as torch.max
                # Running sum of exp over the blocks, rescaled to the running maximum (exactly megatron's
                # sum with one block: the previous sum is 0 before the first).
                sums.mul_(torch.exp(top - new_top)).add_(bufs.shifted(logits, new_top).exp_().sum(dim=-1))
                top.copy_(new_top)
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
        ctx.tp_group, ctx.sp, ctx.tiles, ctx.start = tp_group, sp, tiles, start
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
        tp_group, sp, tiles, start = ctx.tp_group, ctx.sp, ctx.tiles, ctx.start
        c, vb = tiles
        total = _gather_sequence(hidden, tp_group) if sp else hidden
        h = total.shape[-1]
        x = total.reshape(-1, h)
        y = target.reshape(-1)
        g = grad_loss.reshape(-1).float()
        rows, n = weight.shape[0], x.shape[0]
        several = vb < rows
        # Over several blocks the input gradient is summed in fp32 (one rounding, as one GEMM's).
        grad_x = torch.zeros_like(x) if several and x.dtype == torch.float32 else torch.empty_like(x)
        acc_x = torch.zeros((n, h), dtype=torch.float32, device=x.device) \
            if several and x.dtype != torch.float32 else grad_x
        main_grad = ctx.main_grad
        fused_wgrad = ctx.fusion and main_grad is not None
        need_w = ctx.needs_input_grad[1]  # not for a frozen (detached) head weight, as megatron's linear layer
        grad_w = acc_w = None
        if need_w and fused_wgrad:
            weight.main_grad = main_grad
        elif need_w:
            grad_w = torch.empty_like(weight)
            # A block's weight gradient is summed over the chunks in fp32: a bf16 sum would round per chunk.
            acc_w = None if weight.dtype == torch.float32 else torch.empty((vb, h), dtype=torch.float32,
                                                                          device=weight.device)
        local, mine = _local_targets(y, start, rows)
        bufs = _TileBuffers(tiles, h, x.dtype, x.device, gradients=True)
        for j in range(0, rows, vb):
            w = weight[j:j + vb]
            if not need_w:
                gw = None
            elif fused_wgrad:
                gw = main_grad[j:j + vb]
            elif acc_w is None:
                gw = grad_w[j:j + vb].zero_()
            else:
                gw = acc_w[:w.shape[0]].zero_()
            for i in range(0, n, c):
                xc = x[i:i + c]
                # softmax - one_hot(target), times the upstream gradient: megatron's backward, in fp32.
                d = bufs.shifted(bufs.logits(xc, w), lse[i:i + c]).exp_()
                idx, inside = _in_block(local[i:i + c], mine[i:i + c], j, w.shape[0])
                d.scatter_add_(1, idx.unsqueeze(1), -inside.to(d.dtype).unsqueeze(1))
                d = bufs.scaled(d, g[i:i + c])
                if several:
                    bufs.add_input_grad(acc_x[i:i + c], d, w)
                else:  # one GEMM over the rows, as megatron's
                    torch.matmul(d, w, out=acc_x[i:i + c])
                if gw is not None:
                    bufs.add_weight_grad(gw, d, xc)
            if acc_w is not None:
                grad_w[j:j + vb].copy_(gw)
        del bufs
        if acc_x is not grad_x:
            grad_x.copy_(acc_x)
        del acc_x, acc_w
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
            grad_weight = grad_w
        return grad_hidden, grad_weight, None, None, None, None, None, None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, *,
                         tp_group: Optional[dist.ProcessGroup] = None, sequence_parallel: bool = False,
                         chunk_size: Optional[int] = None, vocab_block: Optional[int] = None,
                         gradient_accumulation_fusion: bool = False) -> Tensor:
    """Per-token cross-entropy of the vocab-parallel head ``weight`` on ``hidden``, without its logits.

    Args:
        hidden: final hidden states [s, b, h] ([s/TP, b, h] under ``sequence_parallel``) or [tokens, h].
        weight: this rank's head rows [V/TP, h] (rank r: rows r V/TP ...), in the compute dtype of ``hidden``.
        target: token ids [s, b] (the whole sequence on every rank, as megatron's loss takes them), or [tokens].
        tp_group: the tensor-parallel group (None: one rank).
        sequence_parallel: ``hidden`` is split along dim 0 over ``tp_group`` (megatron's sequence parallelism).
        chunk_size, vocab_block: tokens and vocabulary rows per tile (None: ``tiling``'s defaults).
        gradient_accumulation_fusion: add the weight gradient into ``weight.main_grad`` (megatron DDP).

    Returns:
        fp32 loss shaped like ``target``; equal to megatron's ``vocab_parallel_cross_entropy`` of the
        head's logits, without label smoothing.
    """
    return _apply(hidden, weight, target, tp_group, sequence_parallel, chunk_size, vocab_block,
                  gradient_accumulation_fusion)[0]


def _apply(hidden, weight, target, tp_group, sequence_parallel, chunk_size, vocab_block,
           gradient_accumulation_fusion):
    """(loss, this rank's largest logit per token, its index among this rank's rows)."""
    for name, value in (("chunk_size", chunk_size), ("vocab_block", vocab_block)):
        if value is not None and value < 1:
            raise ValueError(f"linear cross-entropy: {name} must be >= 1 (got {value})")
    return _LinearCrossEntropy.apply(hidden, weight, target, tp_group, sequence_parallel, chunk_size,
                                     vocab_block, gradient_accumulation_fusion)


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
                                self.sequence_parallel, self.chunk_size, None, self.gradient_accumulation_fusion)
        deferred.local_max = torch.return_types.max((top, arg))
        return loss.transpose(0, 1).contiguous()
