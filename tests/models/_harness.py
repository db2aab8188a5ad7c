"""Rank-side helpers for the model tests (module level: run_distributed spawns fresh processes).

One launch per parallel layout runs every arm: build the model chunks of this rank, load the
TP=1 reference weights (dist_checkpointing) or save them, run megatron-core's forward-backward
schedule over two micro-batches with megatron DDP and ``finalize_model_grads``, then save the
gradients through the same sharded state dict and read them back unsharded on rank 0, so any
layout's gradients compare key by key with the reference.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, Optional

import torch

VOCAB, SEQ, MBS, NUM_MICRO = 512, 16, 2, 2
HIDDEN, HEADS, LAYERS = 32, 4, 4
ALL_ARMS = ("tied", "untied", "albert", "flat_mlp", "factored_mlp", "lev")


VARIANTS = {
    # Llama-style (the default) and GPT-2-style transformers.
    "llama": dict(position="rope", normalization="RMSNorm", activation="swiglu"),
    "gpt2": dict(position="learned_absolute", normalization="LayerNorm", activation="gelu"),
}


def model_config(arm: str, variant: str = "llama"):
    from megatron_lev.lev.config import LEVConfig
    from megatron_lev.models import LevModelConfig

    position, normalization, activation = (VARIANTS[variant][k] for k in ("position", "normalization", "activation"))
    return LevModelConfig(
        vocab_size=VOCAB, max_sequence_length=SEQ, input_embedding=arm,
        lev=LEVConfig(seed_dim=8, rank=4, num_knots=5, num_heads=4, compute_mode="token"),
        position_embedding_type=position, normalization=normalization, activation=activation,
        add_bias_linear=False,  # both variants without biases
        # Tiny shapes cannot be parameter-matched within 2% for albert: give its width.
        albert_dim=4,
    )


def transformer_config(mc, *, sp: bool = False, vpp: Optional[int] = None, **extra):
    from megatron.core import parallel_state

    from megatron_lev.models import build_transformer_config

    return build_transformer_config(
        mc, num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=vpp, sequence_parallel=sp, **extra,
    )


def build_chunks(mc, config, vpp: Optional[int] = None) -> List[torch.nn.Module]:
    from megatron.core import parallel_state

    from megatron_lev.models import build_gpt_model

    chunks = []
    for vp in range(vpp or 1):
        stage = vp if vpp else None
        chunks.append(build_gpt_model(
            config=config, model_config=mc,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            vp_stage=stage,
        ))
    return chunks


def batches():
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(NUM_MICRO):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        out.append((tokens, labels))
    return out


def _sharded(chunks) -> Dict[str, Any]:
    return {f"chunk{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def save_weights(chunks, path: str) -> None:
    from megatron.core import dist_checkpointing

    from megatron_lev.checkpoint.sharded import _install_write_queue

    _install_write_queue()  # no manager interpreter per rank (and none left in a pooled rank)
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(_sharded(chunks), path)


def load_weights(chunks, path: str) -> None:
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(_sharded(chunks), path)
    for i, c in enumerate(chunks):
        c.load_state_dict(state[f"chunk{i}"], strict=False)


def wrap_ddp(chunks, config):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    wrapped = [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=c, disable_bucketing=(i > 0))
        for i, c in enumerate(chunks)
    ]
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def run_schedule(wrapped, config) -> Optional[float]:
    """Forward-backward over NUM_MICRO micro-batches; the mean loss on the last stage, else None."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = batches()
    pos = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        out = model(tokens, pos, None, labels=labels)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach()}

        return out, loss_func

    for m in wrapped:
        m.zero_grad_buffer()
    iters = [iter(data) for _ in wrapped] if len(wrapped) > 1 else iter(data)
    out = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iters, model=wrapped,
        num_microbatches=NUM_MICRO, seq_length=SEQ, micro_batch_size=MBS, forward_only=False,
    )
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return float(torch.stack([o["lm loss"] for o in out]).mean())
    return None


def _grad_state(chunks) -> Dict[str, Any]:
    """The chunks' sharded state dict with every parameter's tensor replaced by its gradient."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    grads = {}
    for c in chunks:
        for p in c.parameters():
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            if g is not None:
                grads[id(p)] = g

    def conv(d):
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                sub = conv(v)
                if sub:
                    out[k] = sub
            elif isinstance(v, (ShardedTensor, ShardedTensorFactory)) and id(v.data) in grads:
                out[k] = dataclasses.replace(v, data=grads[id(v.data)].detach().float().clone())
        return out

    return conv(_sharded(chunks))


def gather_grads(chunks, path: str) -> Optional[Dict[str, torch.Tensor]]:
    """Full (unsharded) gradients keyed by checkpoint key, on global rank 0; None elsewhere."""
    from megatron.core import dist_checkpointing

    from megatron_lev.checkpoint.sharded import _install_write_queue

    _install_write_queue()
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(_grad_state(chunks), path)
    plain = dist_checkpointing.load_plain_tensors(path)  # collective over all ranks
    if torch.distributed.get_rank() != 0:
        return None
    return {k: v.float() for k, v in plain.items()}


def unchecked_parameters(chunks) -> List[str]:
    """Trainable parameters that no ShardedTensor of the state dict refers to."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    seen = set()

    def walk(d):
        for v in d.values():
            if isinstance(v, dict):
                walk(v)
            elif isinstance(v, (ShardedTensor, ShardedTensorFactory)):
                seen.add(id(v.data))

    walk(_sharded(chunks))
    return [n for c in chunks for n, p in c.named_parameters() if p.requires_grad and id(p) not in seen]


def construction(chunks) -> List[Dict[str, Any]]:
    """Per chunk, what GPTModel's constructor derives from ``pre_process``: the order of the chunk's
    children (it fixes the parameter order, hence DDP's buffer layout) and every ``pre_process`` flag."""
    return [
        {"children": list(c._modules),
         "pre_process": {n: m.pre_process for n, m in c.named_modules() if hasattr(m, "pre_process")}}
        for c in chunks
    ]


def _new_large_tensors(min_numel: int):
    """A dispatch mode counting (``.count``) the tensors of at least ``min_numel`` elements that ops
    create: outputs that share no input's storage (so in-place initialisation and views do not count)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class NewLargeTensors(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if (isinstance(t, torch.Tensor) and t.numel() >= min_numel
                        and t.untyped_storage().data_ptr() not in inputs):
                    self.count += 1
            return out

    return NewLargeTensors()


def input_side_allocations(arm: str) -> int:
    """Tensors of V x D elements or more created while building a first stage without the output head
    (LEV's vocabulary chunks kept below V ids, so that only a whole table can reach the size)."""
    from megatron_lev.models import build_gpt_model

    mc = model_config(arm)
    mc = dataclasses.replace(mc, lev=dataclasses.replace(mc.lev, chunk_size=VOCAB // 8))
    config = transformer_config(mc)
    with _new_large_tensors(VOCAB * HIDDEN) as counter:
        build_gpt_model(config=config, model_config=mc, pre_process=True, post_process=False)
    return counter.count


# ---------------------------------------------------------------------------------- launches


def reference_run(arms, root: str, variant: str = "llama") -> Dict[str, Any]:
    """TP=1, PP=1: per arm, plain forward/backward checks, then save weights and schedule gradients."""
    from megatron_lev.models import lev_modules, materialize_input_embedding, parameter_breakdown

    results = {}
    for arm in arms:
        torch.manual_seed(1234)
        mc = model_config(arm, variant)
        config = transformer_config(mc)
        (model,) = build_chunks(mc, config)
        r: Dict[str, Any] = {}
        # Plain autograd: finite loss, a gradient on every trainable parameter.
        tokens, labels = batches()[0]
        pos = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
        loss = model(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
        r["plain_loss"] = float(loss.detach())
        r["no_grad"] = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        r["zero_or_nonfinite_grad"] = [
            n for n, p in model.named_parameters()
            if p.grad is not None and (not torch.isfinite(p.grad).all() or not p.grad.abs().sum() > 0)
        ]
        model.zero_grad(set_to_none=True)
        # Shapes: which parameters are V x D, and where.
        r["vxd_params"] = [n for n, p in model.named_parameters() if tuple(p.shape) == (VOCAB, HIDDEN)]
        r["numel"] = sum(p.numel() for p in model.parameters())
        r["breakdown"] = parameter_breakdown(mc, config)
        if arm == "tied":
            w = model.embedding.word_embeddings.weight
            r["tied_same_object"] = model.shared_embedding_or_output_weight() is w and model.output_layer.weight is None
        table = materialize_input_embedding(model)
        r["table"] = table
        with torch.no_grad():  # the table is the input representation (positions excluded)
            emb = model.embedding.arm(tokens) if hasattr(model.embedding, "arm") else \
                model.embedding.word_embeddings(tokens).transpose(0, 1)
        r["table_err"] = float((emb - table[tokens].transpose(0, 1)).abs().max())
        r["lev_modules"] = len(list(lev_modules(model)))
        r["unchecked"] = unchecked_parameters([model])
        r["construction"] = construction([model])
        save_weights([model], os.path.join(root, variant, arm, "weights"))
        wrapped = wrap_ddp([model], config)
        r["loss"] = run_schedule(wrapped, config)
        r["grads"] = gather_grads([model], os.path.join(root, variant, arm, "grads_ref"))
        if variant == "llama":
            r["input_side_allocations"] = input_side_allocations(arm)
        results[arm] = r
    return results


def layout_run(arms, root: str, tag: str, sp: bool = False, vpp: Optional[int] = None,
               check_table: bool = False, variant: str = "llama") -> Dict[str, Any]:
    """Any TP/PP(/VPP) layout: load the reference weights, run the schedule, gather gradients."""
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import _get_shared_word_embedding_weight

    from megatron_lev.models import materialize_input_embedding

    results = {}
    for arm in arms:
        mc = model_config(arm, variant)
        config = transformer_config(mc, sp=sp, vpp=vpp)
        chunks = build_chunks(mc, config, vpp)
        load_weights(chunks, os.path.join(root, variant, arm, "weights"))
        r: Dict[str, Any] = {"construction": construction(chunks)}
        if check_table and chunks[0].pre_process:
            r["table"] = materialize_input_embedding(chunks)
        last = chunks[-1]
        if last.post_process and not chunks[0].pre_process:
            # Last stage without the embedding: a dead copy exists only for tied.
            r["last_stage_embedding_params"] = [
                n for c in chunks for n, p in c.named_parameters() if n.startswith("embedding.")
            ]
            r["last_stage_shared_weight"] = _get_shared_word_embedding_weight(last, config) is not None
        wrapped = wrap_ddp(chunks, config)
        r["loss"] = run_schedule(wrapped, config)
        r["grads"] = gather_grads(chunks, os.path.join(root, variant, arm, f"grads_{tag}"))
        r["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()
        r["tp_rank"] = parallel_state.get_tensor_model_parallel_rank()
        results[arm] = r
    return results


def _reinit(tp: int = 1, pp: int = 1, vpp: Optional[int] = None, seed: int = 1234) -> None:
    """Tear down and rebuild megatron's model-parallel groups inside a running launch."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def two_rank_run(arms, root: str) -> Dict[str, Any]:
    """All two-rank layouts in one launch (imports cost more than the runs):
    the TP=1 references (two identical data-parallel replicas; Llama- and GPT-2-style), TP=2,
    TP=2 + SP (both styles), PP=2 (1F1B)
    and PP=2 x 2 virtual stages (interleaved)."""
    from megatron.core import parallel_state

    out: Dict[str, Any] = {}
    out["ref"] = reference_run(arms, root)
    out["ref_gpt2"] = reference_run(arms, root, variant="gpt2")
    _reinit(tp=2)
    out["tp2"] = layout_run(arms, root, "tp2", sp=False, check_table=True)
    out["tp2sp"] = layout_run(arms, root, "tp2sp", sp=True)
    # learned absolute positions: the arm's output is all-reduced, positions added, then scattered
    out["tp2sp_gpt2"] = layout_run(arms, root, "tp2sp", sp=True, variant="gpt2")
    _reinit(pp=2)
    out["pp2"] = layout_run(arms, root, "pp2")
    parallel_state.set_virtual_pipeline_model_parallel_world_size(2)
    parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    out["pp2vpp2"] = layout_run(arms, root, "pp2vpp2", vpp=2)
    return out


def tp2pp2_run(arms, root: str) -> Dict[str, Any]:
    return {"tp2pp2sp": layout_run(arms, root, "tp2pp2sp", sp=True)}


def initial_weights_run(arms) -> Dict[str, Any]:
    """Each arm built on seed 1234 in the layouts TP=1, TP=2 and PP=2 (two ranks, one launch): this rank's
    initial decoder and output-head weights by parameter name, per layout and arm."""
    from megatron_lev.distributed.bootstrap import set_seed

    out: Dict[str, Any] = {}
    for layout, sizes in (("tp1", {}), ("tp2", {"tp": 2}), ("pp2", {"pp": 2})):
        _reinit(**sizes)
        out[layout] = {}
        for arm in arms:
            set_seed(1234)
            mc = model_config(arm)
            (model,) = build_chunks(mc, transformer_config(mc))
            out[layout][arm] = {n: p.detach().clone() for n, p in model.named_parameters()
                                if n.startswith(("decoder.", "output_layer."))}
    return out
