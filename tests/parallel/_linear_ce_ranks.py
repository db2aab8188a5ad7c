"""Rank-side checks of the linear cross-entropy (module level: the rank pool imports them).

Function level: ``linear_cross_entropy`` against megatron-core's own output path (a ColumnParallelLinear
head, then ``vocab_parallel_cross_entropy``) on the same shard of the same weights, with a per-token
upstream gradient that is a loss mask over its token count. Model level: the same LevGPTModel weights
trained through megatron-core's schedule with DDP and the training loop's loss function, once with the
logits and megatron's loss and once with ``--cross-entropy-fusion-impl linear``. Each check returns the
relative differences (||got - ref|| / ||ref||) for the test to judge.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Dict, List, Optional

import torch

from tests.models import _harness as H

S, B, HID, V = 12, 2, 16, 96


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref, got = ref.detach().double(), got.detach().double()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-300))


def _inputs(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(S, B, HID, generator=g)
    w = torch.randn(V, HID, generator=g) * 0.6  # logits of a few units: a peaked softmax
    y = torch.randint(0, V, (S, B), generator=g)
    mask = (torch.rand(S, B, generator=g) > 0.3).float()
    return x.to(dtype), w.to(dtype), y, mask / mask.sum()


def _exact(x, w, y, up, tp: int, rank: int, sp: bool):
    """Loss and gradients in float64 from the same (rounded) inputs: this rank's input and weight slices."""
    x64 = x.double().requires_grad_(True)
    w64 = w.double().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy((x64 @ w64.t()).reshape(-1, V), y.reshape(-1), reduction="none")
    (loss * up.reshape(-1).double()).sum().backward()
    gx = x64.grad.chunk(tp, dim=0)[rank] if sp else x64.grad
    return loss.view(S, B), gx, w64.grad.chunk(tp, dim=0)[rank]


def function_case(sp: bool, dtype: torch.dtype, chunk: Optional[int] = 5,
                  block: Optional[int] = 13) -> Dict[str, Dict[str, float]]:
    """One rank's figures for the loss, the input gradient and the weight-shard gradient: ``vs_megatron``,
    the relative difference from megatron's path; ``err`` and ``megatron_err``, each one's relative error
    from the float64 result of the same inputs."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear, vocab_parallel_cross_entropy
    from megatron.core.transformer import TransformerConfig

    from megatron_lev.parallel.linear_cross_entropy import linear_cross_entropy

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    group = ps.get_tensor_model_parallel_group()
    x, w, y, up = _inputs(dtype)
    shard = w.chunk(tp, dim=0)[rank].clone()
    local_x = x.chunk(tp, dim=0)[rank].clone() if sp else x.clone()

    config = TransformerConfig(num_layers=1, hidden_size=HID, num_attention_heads=4, use_cpu_initialization=True,
                               tensor_model_parallel_size=tp, sequence_parallel=sp, params_dtype=dtype,
                               bf16=dtype == torch.bfloat16)
    head = ColumnParallelLinear(HID, V, config=config, init_method=torch.nn.init.zeros_, bias=False,
                                gather_output=False, tp_group=group)
    with torch.no_grad():
        head.weight.copy_(shard)
    ref_x = local_x.clone().requires_grad_(True)
    logits, _ = head(ref_x)
    ref_loss = vocab_parallel_cross_entropy(logits, y)
    (ref_loss * up).sum().backward()

    got_w = torch.nn.Parameter(shard.clone())
    got_x = local_x.clone().requires_grad_(True)
    got_loss = linear_cross_entropy(got_x, got_w, y, tp_group=group, sequence_parallel=sp, chunk_size=chunk,
                                    vocab_block=block)
    (got_loss * up).sum().backward()
    assert got_loss.dtype == torch.float32 and got_loss.shape == (S, B)
    assert got_x.grad.dtype == dtype and got_w.grad.dtype == dtype and got_x.grad.shape == local_x.shape

    exact = _exact(x, w, y, up, tp, rank, sp)
    out = {}
    for name, got, ref, ex in zip(("loss", "grad_input", "grad_weight"), (got_loss, got_x.grad, got_w.grad),
                                  (ref_loss, ref_x.grad, head.weight.grad), exact):
        out[name] = {"vs_megatron": _rel(got, ref), "err": _rel(got, ex), "megatron_err": _rel(ref, ex)}
    return out


def _masked_batches(n_micro: int):
    g = torch.Generator().manual_seed(17)
    out = []
    for _ in range(n_micro):
        tokens = torch.randint(0, H.VOCAB, (H.MBS, H.SEQ), generator=g)
        labels = torch.randint(0, H.VOCAB, (H.MBS, H.SEQ), generator=g)
        mask = (torch.rand(H.MBS, H.SEQ, generator=g) > 0.25).float()
        out.append((tokens, labels, mask))
    return out


def _schedule(wrapped, config) -> Optional[List[float]]:
    """Forward-backward of two masked micro-batches with the training loop's loss function; the
    micro-batches' summed losses on the last stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_lev.training.loop import _loss_func

    data = _masked_batches(H.NUM_MICRO)
    pos = torch.arange(H.SEQ).unsqueeze(0).expand(H.MBS, H.SEQ)

    def forward_step(data_iterator, model):
        tokens, labels, mask = next(data_iterator)
        return model(tokens, pos, None, labels=labels), partial(_loss_func, mask, False)

    for m in wrapped:
        m.zero_grad_buffer()
    iters = [iter(data) for _ in wrapped] if len(wrapped) > 1 else iter(data)
    out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iters, model=wrapped,
                                      num_microbatches=H.NUM_MICRO, seq_length=H.SEQ, micro_batch_size=H.MBS,
                                      forward_only=False)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        return [float(o["lm loss"][0]) for o in out]
    return None


def _grads(chunks) -> Dict[str, torch.Tensor]:
    return {f"{i}.{n}": p.main_grad.detach().clone() for i, c in enumerate(chunks)
            for n, p in c.named_parameters() if p.requires_grad}


def model_case(arm: str, *, sp: bool = False, bf16: bool = False, per_token: bool = False, moe: bool = False,
               chunk: int = 7, block: Optional[int] = None, **extra) -> Dict[str, Any]:
    """The same weights trained one step with megatron's loss and with the linear cross-entropy (tiles of
    ``chunk`` tokens by ``block`` vocabulary rows: the CPU tile's size is set for it)."""
    from megatron_lev.parallel import linear_cross_entropy as lce
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from megatron_lev.compat.versions import reset_moe_metrics
    from megatron_lev.parallel.linear_cross_entropy import LinearCrossEntropyHead

    reset_moe_metrics()  # sized by the first MoE model of the process
    if moe:
        extra.update(num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2, moe_layer_freq=[1, 0, 1, 1],
                     moe_token_dispatcher_type="allgather", moe_router_dtype="fp32", moe_aux_loss_coeff=1e-2,
                     moe_router_load_balancing_type="aux_loss", ffn_hidden_size=128)
    if bf16:
        extra.update(bf16=True)
    mc = H.model_config(arm)
    fused_mc = dataclasses.replace(mc, linear_cross_entropy_chunk_size=chunk)
    results: Dict[str, Any] = {}
    runs = {}
    for name, model_config, fusion in (("megatron", mc, {}), ("linear", fused_mc, dict(
            cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="linear"))):
        config = H.transformer_config(model_config, sp=sp, calculate_per_token_loss=per_token, **fusion, **extra)
        torch.manual_seed(1234)
        model_parallel_cuda_manual_seed(1234)
        chunks = H.build_chunks(model_config, config)
        if name == "megatron":
            state = [c.state_dict() for c in chunks]
        else:
            for c, sd in zip(chunks, state):
                c.load_state_dict(sd)
            last = chunks[-1]
            results["fused_head"] = (not last.post_process) or isinstance(last.output_layer, LinearCrossEntropyHead)
        if len(chunks) == 1 and chunks[0].pre_process and chunks[0].post_process and not config.mtp_num_layers:
            # Without labels (evaluation, generation) the head computes its logits, fused or not (megatron-core
            # needs labels with MTP: evaluation builds its model without the MTP block).
            tokens = _masked_batches(1)[0][0]
            with torch.no_grad():
                runs.setdefault("logits", []).append(chunks[0](tokens, torch.arange(H.SEQ).expand(H.MBS, -1), None))
        if bf16:
            chunks = [Float16Module(config, c) for c in chunks]
        wrapped = H.wrap_ddp(chunks, config)
        tile_bytes = lce.CPU_TILE_BYTES
        if name == "linear" and block is not None:
            lce.CPU_TILE_BYTES = 4 * chunk * block
        try:
            losses = _schedule(wrapped, config)
        finally:
            lce.CPU_TILE_BYTES = tile_bytes
        runs[name] = (losses, _grads(chunks))
    if "logits" in runs:
        ref_logits, logits = runs.pop("logits")
        results["logits_equal"] = logits.shape[-1] * ps.get_tensor_model_parallel_world_size() == H.VOCAB and \
            torch.equal(logits, ref_logits)
    (ref_losses, ref_grads), (losses, grads) = runs["megatron"], runs["linear"]
    if ref_losses is not None:
        results["loss"] = max(abs(a - b) / abs(a) for a, b in zip(losses, ref_losses))
    assert ref_grads.keys() == grads.keys()
    rel = {k: _rel(grads[k], ref_grads[k]) for k in ref_grads if ref_grads[k].abs().sum() > 0}
    results["grad"] = max(rel.values())
    results["grad_worst"] = max(rel, key=rel.get)
    results["params"] = len(rel)
    results["head_grad"] = {k: v for k, v in rel.items() if "output_layer" in k or "word_embeddings" in k}
    return results


def all_checks() -> Dict[str, Any]:
    """Every case on one two-rank world: TP=2 (with and without SP), PP=2, then TP=1 (two replicas)."""
    out: Dict[str, Any] = {}
    for sp in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            out[f"fn tp2 sp={sp} {dtype} blocks"] = function_case(sp, dtype)  # 48 rows a rank: 4 blocks
            out[f"fn tp2 sp={sp} {dtype} one block"] = function_case(sp, dtype, block=None)
    out["fn tp2 sp=True default tiles"] = function_case(True, torch.float32, chunk=None, block=None)
    mtp = dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.3)
    out["model tp2 sp untied moe mtp per-token"] = model_case("untied", sp=True, moe=True, per_token=True, block=100,
                                                             **mtp)
    # LEV's codebook gradient sums many cancelling terms, so fp32 rounding shows there at ~1e-6 in either
    # path: its arm is compared in float64.
    out["model tp2 sp lev mtp per-token float64"] = model_case("lev", sp=True, per_token=True,
                                                               params_dtype=torch.float64, **mtp)
    out["model tp2 tied bf16"] = model_case("tied", bf16=True)
    H._reinit(pp=2)
    out["model pp2 untied mtp per-token"] = model_case("untied", per_token=True, mtp_num_layers=1)
    out["model pp2 lev bf16"] = model_case("lev", bf16=True, block=100)
    H._reinit(tp=1)
    for dtype in (torch.float32, torch.bfloat16):
        out[f"fn tp1 {dtype} blocks"] = function_case(False, dtype)
    out["model tp1 factored_mlp"] = model_case("factored_mlp")
    return out
