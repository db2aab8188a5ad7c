"""Rank-side helpers for the mixture-of-experts tests (module level: run_distributed spawns fresh processes).

Every layout trains the same small LEV MoE model (4 layers, MoE on layers 0, 2, 3: both pipeline stages
of PP=2 hold MoE layers) for a few steps through the training loop's own functions (megatron DDP,
megatron's optimizer and LR schedule, the forward step, the loss reduction, ``optimizer.step``), from
the reference's initial weights (saved through dist_checkpointing at TP=1/EP=1, loaded into any
layout) and on the same global batch: GLOBAL_MICRO micro-batches per step, split evenly over the
data-parallel ranks in order. Each layout's figures are the loss and the gradient norm of every step.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import torch

from tests.models._harness import load_weights, save_weights

VOCAB, SEQ, MBS, GLOBAL_MICRO, STEPS = 512, 16, 2, 4, 3
HIDDEN, HEADS, LAYERS, EXPERTS, TOPK = 64, 4, 4, 4, 2
MOE_PATTERN = [1, 0, 1, 1]
MTP = dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.3)
ALL_ARMS = ("tied", "untied", "albert", "flat_mlp", "factored_mlp", "lev")


def model_config(arm: str = "lev", compute_mode: str = "token"):
    from megatron_lev.lev.config import LEVConfig
    from megatron_lev.models import LevModelConfig

    return LevModelConfig(
        vocab_size=VOCAB, max_sequence_length=SEQ, input_embedding=arm,
        lev=LEVConfig(seed_dim=8, rank=4, num_knots=5, num_heads=4, compute_mode=compute_mode),
        albert_dim=4,  # tiny shapes cannot be parameter-matched within 2% for albert
        # A Llama-style transformer (the model defaults are Megatron-LM's GPT); MoE layers have no biases.
        position_embedding_type="rope", normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
    )


def transformer_config(mc, *, sp: bool = False, dispatcher: str = "allgather", **extra):
    from megatron.core import parallel_state as ps

    from megatron_lev.models import build_transformer_config

    kw = dict(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=128,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        sequence_parallel=sp,
        num_moe_experts=EXPERTS, moe_ffn_hidden_size=32, moe_router_topk=TOPK,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
        moe_token_dispatcher_type=dispatcher, moe_layer_freq=list(MOE_PATTERN), moe_router_dtype="fp32",
    )
    kw.update(extra)
    return build_transformer_config(mc, megatron_ddp=True, **kw)


def loop_args(*, distributed_optimizer: bool, overlap: bool, num_microbatches: int):
    """The training arguments the loop's step functions read: the parser's defaults for every flag, with
    this harness's settings over them."""
    from megatron.core import parallel_state as ps

    from megatron_lev.arguments import parse_args

    defaults = parse_args(["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads",
                           str(HEADS), "--seq-length", str(SEQ), "--micro-batch-size", str(MBS), "--train-iters",
                           "10", "--lr", "3e-3", "--mock-data", "--vocab-size", str(VOCAB)], world_size=1)
    ours = _harness_args(distributed_optimizer, overlap, num_microbatches)
    return SimpleNamespace(**{**vars(defaults), **vars(ours), "data_parallel_size": ps.get_data_parallel_world_size()})


def loop_run_config(args):
    """The RunConfig of the harness's arguments, its layout the process groups' (the loop's model and
    optimizer builders read the typed configuration)."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_lev.config import RunConfig

    sizes = dict(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                 pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                 virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
                 context_parallel_size=ps.get_context_parallel_world_size(),
                 expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
                 expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
                 world_size=torch.distributed.get_world_size())
    # params_dtype_name None: derived again from the bf16/fp16 the harness set over the parsed defaults.
    return RunConfig.from_saved_args({**vars(args), **sizes, "params_dtype_name": None},
                                     source="the harness's arguments")


def _harness_args(distributed_optimizer: bool, overlap: bool, num_microbatches: int):
    return SimpleNamespace(
        fp16=False, bf16=False, accumulate_allreduce_grads_in_fp32=True,
        overlap_grad_reduce=overlap, overlap_param_gather=overlap and distributed_optimizer,
        use_distributed_optimizer=distributed_optimizer, ddp_bucket_size=None,
        optimizer="adam", lr=3e-3, min_lr=3e-4, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95,
        adam_eps=1e-8, sgd_momentum=0.9, clip_grad=1.0, loss_scale=None, initial_loss_scale=2 ** 32,
        min_loss_scale=1.0, loss_scale_window=1000, hysteresis=2,
        global_batch_size=GLOBAL_MICRO * MBS, lr_decay_iters=10, lr_warmup_fraction=None, lr_warmup_iters=1,
        lr_warmup_init=0.0, lr_decay_style="cosine", start_weight_decay=0.01, end_weight_decay=0.01,
        train_iters=10, weight_decay_incr_style="constant", use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=False, lr_wsd_decay_iters=None, lr_wsd_decay_style="exponential",
        num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=MBS,
        check_for_nan_in_loss_and_grad=True, nan_action="stop", inject_nan_at_iteration=None,
    )


def global_batches(step: int) -> List[Dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for _ in range(GLOBAL_MICRO):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        out.append({"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1),
                    "loss_mask": torch.ones(MBS, SEQ), "position_ids": torch.arange(SEQ).expand(MBS, SEQ)})
    return out


def my_batches(step: int) -> List[Dict[str, torch.Tensor]]:
    """This data-parallel rank's share of the step's global batch."""
    from megatron.core import parallel_state as ps

    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = GLOBAL_MICRO // dp
    return global_batches(step)[r * per:(r + 1) * per]


def reinit(tp: int = 1, pp: int = 1, ep: int = 1, etp: Optional[int] = None):
    """Megatron's groups for another layout inside a running launch, through the bootstrap."""
    from megatron.core import parallel_state as ps

    from megatron_lev.distributed import init_distributed

    torch.distributed.barrier()
    ps.destroy_model_parallel()
    return init_distributed(tp=tp, pp=pp, ep=ep, etp=etp, seed=1234)


def _setup(root: str, *, arm: str = "lev", weights: Optional[str] = None, save: bool = False, sp: bool = False,
           dispatcher: str = "allgather", distributed_optimizer: bool = False, overlap: bool = False,
           compute_mode: str = "token", **config_extra) -> SimpleNamespace:
    """This layout's chunks, from the reference's initial weights (the reference, ``save``, writes them),
    wrapped, with optimizer, scheduler and hooks as the loop sets them up."""
    from megatron.core import parallel_state as ps

    from megatron_lev.models.factory import build_model_chunks, lev_table_modules
    from megatron_lev.training import loop
    from megatron_lev.training.moe_metrics import reset_aux_loss_trackers

    # megatron's trackers are sized by the first model that writes them; each layout has its own
    reset_aux_loss_trackers()
    mc = model_config(arm, compute_mode)
    config = transformer_config(mc, sp=sp, dispatcher=dispatcher, **config_extra)
    chunks = build_model_chunks(config, mc)
    path = os.path.join(root, weights or arm, "initial")
    if save:
        save_weights(chunks, path)
    else:
        load_weights(chunks, path)
    num_micro = GLOBAL_MICRO // ps.get_data_parallel_world_size()
    args = loop_args(distributed_optimizer=distributed_optimizer, overlap=overlap, num_microbatches=num_micro)
    rc = loop_run_config(args)
    model = loop._wrap_model(rc, config, chunks)
    optimizer, scheduler = loop._build_optimizer(rc, config, model)
    tables = lev_table_modules(chunks)  # LEV in table mode: the loop's per-step hooks
    loop._configure_hooks(rc, config, model, optimizer, tables)
    return SimpleNamespace(config=config, chunks=chunks, model=model, optimizer=optimizer, scheduler=scheduler,
                           rc=rc, num_micro=num_micro, state=loop._State(), tables=tables)


def _step(run: SimpleNamespace, tag: str):
    """One training step on this rank's share of the step's global batch: (loss, grad norm, aux losses)."""
    from megatron_lev.training import loop
    from megatron_lev.training.moe_metrics import step_aux_losses

    it = iter(my_batches(run.state.iteration))
    loss, grad_norm, ok, _ = loop._train_step(run.rc, run.state, run.model, run.optimizer, run.scheduler, it,
                                              run.tables)
    assert ok, f"{tag}: step {run.state.iteration} was not applied"
    run.state.iteration += 1
    return loss, grad_norm, step_aux_losses(run.config, run.num_micro, iteration=run.state.iteration)


def train_layout(root: str, tag: str, **kw) -> Dict[str, Any]:
    """STEPS training steps of this layout (keywords: ``_setup``'s)."""
    from megatron.core import parallel_state as ps

    run = _setup(root, **kw)
    losses, norms, aux = [], [], []
    for _ in range(STEPS):
        loss, grad_norm, step_aux = _step(run, tag)
        losses.append(loss)
        norms.append(grad_norm)
        aux.append(step_aux)
    expert_params = {n: tuple(p.shape) for c in run.chunks for n, p in c.named_parameters() if ".experts." in n}
    return {"tag": tag, "losses": losses, "grad_norms": norms, "aux": aux,
            "rank": torch.distributed.get_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "ep_rank": ps.get_expert_model_parallel_rank(), "expert_params": expert_params,
            "mlp_types": [type(layer.mlp).__name__ for c in run.chunks for layer in c.decoder.layers]}


def resume_check(root: str, overlap: bool = False) -> Dict[str, Any]:
    """Train 2 steps at this layout (distributed optimizer), save a full checkpoint (model, optimizer,
    scheduler, RNG) through ``checkpoint.sharded``, train a third step; then rebuild everything, load the
    checkpoint and train the third step again. ``overlap``: grad reduce and param gather overlapped; the
    parameters' all-gather of the last update then waits for the next forward, so it is forced before the
    save (as Megatron-LM's ``disable_forward_pre_hook(param_sync=True)`` does around its saves)."""
    from megatron_lev.checkpoint.sharded import load_checkpoint, save_checkpoint

    kw = dict(distributed_optimizer=True, overlap=overlap)
    ckpt = os.path.join(root, f"resume_ckpt_overlap{int(overlap)}")
    args = {"num_layers": LAYERS, "hidden_size": HIDDEN, "input_embedding": "lev", "padded_vocab_size": VOCAB}
    run = _setup(root, **kw)
    for _ in range(2):
        _step(run, "resume: before the save")
    if overlap:
        for chunk in run.model:
            chunk.start_param_sync(force_sync=True)
    save_checkpoint(ckpt, run.state.iteration, run.model, run.optimizer, run.scheduler,
                    consumed_train_samples=2 * GLOBAL_MICRO * MBS, counters={}, config=args, log=lambda *a: None)
    straight = _step(run, "resume: uninterrupted")[:2]
    run = _setup(root, **kw)  # fresh model and optimizer from the initial weights
    common = load_checkpoint(ckpt, run.model, run.optimizer, run.scheduler, run_args=args, log=lambda *a: None)
    run.state.iteration = int(common["iteration"])
    resumed = _step(run, "resume: resumed")[:2]
    return {"iteration": run.state.iteration, "straight": straight, "resumed": resumed}


def arms_check() -> Dict[str, Any]:
    """Every input arm with MoE layers at TP=1: one forward-backward (each parameter gets a finite,
    non-zero gradient), and the parameter counts of the model against ``parameter_breakdown``."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, clear_aux_losses_tracker

    from megatron_lev.models import build_gpt_model
    from megatron_lev.models.params import parameter_breakdown

    # Outside a schedule: the aux-loss gradient scale the schedule would set (one micro-batch, no
    # loss scaling), as a [1] tensor like the schedule's (megatron copies into it later).
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    out = {}
    # Every micro-batch of the first global batch (128 tokens): with 32, a top-2 router of 4 experts can leave
    # an expert of a layer without a token, and its weights without a gradient, for some initialisations.
    batches = global_batches(0)
    for arm in ALL_ARMS:
        mc = model_config(arm)
        config = transformer_config(mc)
        model = build_gpt_model(config=config, model_config=mc)
        routed = _count_routed_tokens(model)
        loss = sum(model(b["tokens"], b["position_ids"], None, labels=b["labels"]).mean() for b in batches)
        loss.backward()
        named = dict(model.named_parameters())
        # An expert no token was routed to has no gradient to have (an arm whose inputs are alike at
        # initialisation, such as flat_mlp, can leave one idle); every other parameter must have one.
        idle = [f"decoder.layers.{i}.mlp.experts.local_experts.{e}." for i, n in routed.items()
                for e, c in enumerate(n.tolist()) if c == 0]
        out[arm] = {
            "loss": float(loss.detach()),
            "idle_experts": idle,
            "bad_grad": [n for n, p in named.items() if not any(n.startswith(x) for x in idle) and (
                p.grad is None or not bool(torch.isfinite(p.grad).all()) or not p.grad.abs().sum() > 0)],
            "numel": sum(p.numel() for p in named.values()),
            "experts_numel": sum(p.numel() for n, p in named.items() if ".mlp.experts." in n),
            "breakdown": parameter_breakdown(mc, config),
        }
    clear_aux_losses_tracker()  # these forwards are not part of the layouts' first step
    return out


def _count_routed_tokens(model) -> Dict[int, torch.Tensor]:
    """Tokens routed to each expert, per MoE layer, counted by hooks on the routers as the model runs."""
    counts: Dict[int, torch.Tensor] = {}

    def hook(i):
        def count(module, inputs, output):
            routing_map = output[1]
            counts[i] = counts.get(i, 0) + routing_map.reshape(-1, routing_map.shape[-1]).sum(0)
        return count

    for i, layer in enumerate(model.decoder.layers):
        if getattr(layer.mlp, "router", None) is not None:
            layer.mlp.router.register_forward_hook(hook(i))
    return counts


def build_refusal(**config_extra) -> Optional[str]:
    """The ConfigError message of building this rank's LEV chunks with these settings (None: built)."""
    from megatron_lev.models.factory import build_model_chunks
    from megatron_lev.lev.config import ConfigError

    mc = model_config("lev")
    try:
        build_model_chunks(transformer_config(mc, **config_extra), mc)
    except ConfigError as e:
        return str(e)
    return None


def mtp_check() -> Dict[str, Any]:
    """LEV with a multi-token-prediction layer (an MoE layer, like the decoder's last) at TP=1: the same
    weights with the MTP loss scaled by 0.5, by 0, and without MTP (router losses off, so that only the
    two cross-entropies send gradients into the input arm)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, clear_aux_losses_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    from megatron_lev.models import build_gpt_model, lev_modules
    from megatron_lev.models.params import parameter_breakdown

    mc = model_config("lev")
    batch = global_batches(0)[0]
    no_router_loss = dict(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
    models, grads = {}, {}
    for name, extra in (("mtp", dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.5)),
                        ("mtp_scale0", dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.0)), ("plain", {})):
        config = transformer_config(mc, **no_router_loss, **extra)
        model = build_gpt_model(config=config, model_config=mc)
        if models:
            missing, unexpected = model.load_state_dict(models["mtp"][0].state_dict(), strict=False)
            assert not unexpected or name == "plain", unexpected
            assert not [k for k in missing if not k.endswith("_extra_state")], missing
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))  # as the schedule sets them, one micro-batch
        MTPLossAutoScaler.set_loss_scale(torch.ones(1))
        model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).mean().backward()
        models[name] = (model, config)
        grads[name] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if n.startswith("embedding.")}
    clear_aux_losses_tracker()
    MTPLossLoggingHelper.tracker.clear()
    model, config = models["mtp"]
    named = dict(model.named_parameters())

    def max_diff(a, b):
        return max(float((grads[a][k] - grads[b][k]).abs().max()) for k in grads[a])

    return {
        "lev_modules": len(list(lev_modules(model))),
        "embedding_params": sorted(n for n in named if n.startswith("embedding.")),
        "plain_embedding_params": sorted(n for n, _ in models["plain"][0].named_parameters()
                                         if n.startswith("embedding.")),
        "mtp_params_with_embedding": [n for n in named if n.startswith("mtp.") and "embedding" in n],
        "children": list(model._modules),
        "numel": sum(p.numel() for p in named.values()),
        "mtp_numel": sum(p.numel() for n, p in named.items() if n.startswith("mtp.")),
        "breakdown": parameter_breakdown(mc, config),
        "grad_scale0_vs_plain": max_diff("mtp_scale0", "plain"),
        "grad_scale_vs_scale0": max_diff("mtp", "mtp_scale0"),
        "grad_scale0_size": max(float(g.abs().max()) for g in grads["mtp_scale0"].values()),
    }


def two_rank_run(root: str) -> Dict[str, Any]:
    """The TP=1/EP=1 reference (data-parallel 2), EP=2 (allgather dispatcher) and PP=2 with MoE layers on
    both stages, with the distributed optimizer and overlapped grad reduce / param gather (EP=2 also
    without them)."""
    from megatron_lev.distributed import destroy_distributed

    out: Dict[str, Any] = {}
    setup = reinit()
    out["arms"] = arms_check()
    out["mtp"] = mtp_check()
    out["ref"] = train_layout(root, "ref", save=True)
    out["ref_tied"] = train_layout(root, "ref_tied", arm="tied", save=True)
    out["ref_mtp"] = train_layout(root, "ref_mtp", weights="lev_mtp", save=True, **MTP)
    # Table mode: the step's materialised table feeds both the decoder and the MTP block, and its gradient
    # (both losses) goes back into the LEV parameters once, by the loop's hooks.
    out["ref_mtp_table"] = train_layout(root, "ref_mtp_table", weights="lev_mtp", compute_mode="table", **MTP)
    destroy_distributed(setup)
    setup = reinit(ep=2)
    out["ep2"] = train_layout(root, "ep2", distributed_optimizer=True, overlap=True)
    out["ep2_plain"] = train_layout(root, "ep2_plain")
    out["ep2_resume"] = [resume_check(root), resume_check(root, overlap=True)]
    out["ep2_mtp"] = train_layout(root, "ep2_mtp", weights="lev_mtp", distributed_optimizer=True, overlap=True, **MTP)
    destroy_distributed(setup)
    setup = reinit(pp=2)
    out["pp2"] = train_layout(root, "pp2", distributed_optimizer=True, overlap=True)
    out["pp2_tied"] = train_layout(root, "pp2_tied", arm="tied", distributed_optimizer=True, overlap=True)
    out["pp2_mtp_refusal"] = build_refusal(mtp_num_layers=1)
    destroy_distributed(setup)
    return out


def four_rank_run(root: str) -> Dict[str, Any]:
    """TP=2 x EP=2 with expert-tensor-parallel 1 and sequence parallelism (megatron-core wants SP with
    EP x TP), and PP=2 x EP=2 (data-parallel 2 on each stage, MoE layers on both), each with the distributed
    optimizer and overlap on."""
    from megatron_lev.distributed import destroy_distributed

    setup = reinit(tp=2, ep=2, etp=1)
    out = {"tp2ep2": train_layout(root, "tp2ep2", sp=True, distributed_optimizer=True, overlap=True)}
    destroy_distributed(setup)
    setup = reinit(pp=2, ep=2)
    out["pp2ep2"] = train_layout(root, "pp2ep2", distributed_optimizer=True, overlap=True)
    destroy_distributed(setup)
    return out
