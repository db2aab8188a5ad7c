"""The run's typed configuration -> megatron-core ``TransformerConfig`` + ``LevModelConfig`` -> model chunks.

Training, evaluation and conversion all build their model here, from a :class:`~megatron_lev.config.RunConfig`
(parsed flags, or a checkpoint's ``config.yaml`` through ``RunConfig.from_saved_args``). One chunk per
virtual pipeline stage (a single chunk without interleaving); the input arm and the output head are placed
by :func:`~megatron_lev.models.gpt.build_gpt_model` on the first/last stage.

Design choices: the factory reads typed fields only (a setting the model does not know is an
AttributeError here, not a silent ``None``); a field left None keeps megatron-core's default (or this
machine's, for the fusions); a checkpoint is rebuilt on this machine with :func:`settings_for_loading`
(the local spec where Transformer Engine or CUDA is missing, never FP8).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

import torch

from .arms import arm_settings
from .config import TRANSFORMER_FLAG_FIELDS, LevModelConfig, build_transformer_config, \
    check_cuda_device_max_connections, check_fp8_tokens, settings_for_loading
from .gpt import build_gpt_model, lev_modules

if TYPE_CHECKING:
    from megatron_lev.config import ModelRunConfig, RunConfig

# ModelRunConfig's MoE / MTP fields -> megatron-core TransformerConfig fields (where the names differ).
MOE_FIELDS = {
    "num_experts": "num_moe_experts", "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "moe_router_topk": "moe_router_topk", "moe_router_load_balancing_type": "moe_router_load_balancing_type",
    "moe_aux_loss_coeff": "moe_aux_loss_coeff", "moe_z_loss_coeff": "moe_z_loss_coeff",
    "moe_token_dispatcher_type": "moe_token_dispatcher_type", "moe_layer_freq": "moe_layer_freq",
    "moe_router_dtype": "moe_router_dtype", "moe_grouped_gemm": "moe_grouped_gemm",
    "moe_permute_fusion": "moe_permute_fusion", "moe_per_layer_logging": "moe_per_layer_logging",
    "mtp_num_layers": "mtp_num_layers", "mtp_loss_scaling_factor": "mtp_loss_scaling_factor",
}


def lev_model_config(rc: "RunConfig") -> LevModelConfig:
    """The project's ``LevModelConfig`` of this run (``rc.model.padded_vocab_size`` must be set)."""
    m = rc.model
    return LevModelConfig(
        vocab_size=m.padded_vocab_size,
        max_sequence_length=m.max_position_embeddings,
        input_embedding=m.input_embedding,
        lev=dataclasses.replace(m.lev),  # the model's own copy: LEVConfig is mutable
        position_embedding_type=m.position_embedding_type,
        rotary_percent=m.rotary_percent,
        rotary_base=m.rotary_base,
        use_rope_scaling=m.use_rope_scaling,
        rope_scaling_factor=m.rope_scaling_factor,
        **{name: getattr(m, name) for name in arm_settings()},  # the input arms' widths (models.arms)
        normalization=m.normalization,
        activation="swiglu" if m.swiglu else "gelu",
        add_bias_linear=not m.disable_bias_linear,
        transformer_impl=m.transformer_impl or "auto",  # a config.yaml may say null
        init_seed=rc.run.seed,
        linear_cross_entropy_chunk_size=m.linear_cross_entropy_chunk_size,
    )


def transformer_config_kwargs(rc: "RunConfig") -> Dict[str, Any]:
    """Keyword arguments of megatron-core's TransformerConfig (a None field keeps its default)."""
    m, layout = rc.model, rc.layout
    kw: Dict[str, Any] = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        layernorm_epsilon=m.norm_epsilon,
        init_method_std=m.init_method_std,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        sequence_parallel=m.sequence_parallel,
        bf16=m.bf16,
        fp16=m.fp16,
        params_dtype=m.params_dtype,
        pipeline_dtype=m.params_dtype,
        recompute_granularity=m.recompute_granularity,
        recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers,
        # The loss is averaged per micro-batch by our loss function; the schedule divides by the
        # number of micro-batches (Megatron-LM's default, calculate_per_token_loss=False).
        calculate_per_token_loss=False,
    )
    # Megatron-LM's p2p defaults: the interleaved schedule overlaps p2p communication and issues it
    # unbatched (with PP=2 the batched form pairs sends and receives between the same two ranks by
    # issue order, which mixes activations and gradients on gloo); 1F1B batches its p2p ops.
    overlap_p2p = layout.vpp is not None and not rc.distributed.no_overlap_p2p_communication
    kw.update(overlap_p2p_comm=overlap_p2p, batch_p2p_comm=not overlap_p2p)
    if m.fp8_format is not None:
        kw.update(fp8=m.fp8_format, fp8_recipe=m.fp8_recipe, fp8_param=m.fp8_param_gather)
    kw.update(_transformer_flag_kwargs(m))
    kw.update(moe_config_kwargs(rc))
    return {k: v for k, v in kw.items() if v is not None}


def moe_config_kwargs(rc: "RunConfig") -> Dict[str, Any]:
    """The TransformerConfig fields of the MoE / MTP settings that are set (None: megatron's defaults), with
    the expert-parallel sizes."""
    kw = {field: getattr(rc.model, name) for name, field in MOE_FIELDS.items() if getattr(rc.model, name) is not None}
    kw.update(expert_model_parallel_size=rc.layout.ep, expert_tensor_parallel_size=rc.layout.etp)
    return kw


def _transformer_flag_kwargs(m: "ModelRunConfig") -> Dict[str, Any]:
    """The TransformerConfig fields set by the flags generated from it (arguments.model; None = not set:
    megatron-core's default, or the machine's for the fusions), with Megatron-LM's bias-fusion switches
    folded into ``bias_activation_fusion`` for the activation in use."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    have = {f.name for f in dataclasses.fields(TransformerConfig)}
    kw = {n: getattr(m, n) for n in TRANSFORMER_FLAG_FIELDS if n in have and getattr(m, n) is not None}
    if isinstance(kw.get("attention_backend"), str):
        kw["attention_backend"] = AttnBackend[kw["attention_backend"]]
    off = m.bias_swiglu_fusion is False if m.swiglu else m.bias_gelu_fusion is False
    if off:
        kw["bias_activation_fusion"] = False
    return kw


def build_configs(rc: "RunConfig", *, for_loading: bool = False, **overrides: Any) -> Tuple[Any, LevModelConfig]:
    """(TransformerConfig, LevModelConfig) for the run ``rc``; ConfigError (one line) on an impossible
    combination. ``for_loading``: the weights come from a checkpoint, built on this machine (a model
    trained with Transformer Engine is rebuilt with the local spec where TE or CUDA is missing; never with
    FP8; no layer initialises its parameters). Otherwise the model is trained, wrapped in megatron's DDP
    (gradient-accumulation fusion where available). ``overrides``: TransformerConfig fields to set."""
    if for_loading:
        loading = settings_for_loading(rc.model.transformer_impl)
        rc = dataclasses.replace(rc, model=dataclasses.replace(rc.model, **loading))
    model_config = lev_model_config(rc)
    kw = transformer_config_kwargs(rc)
    if for_loading:
        kw["perform_initialization"] = False
        model_config.weights_from_checkpoint = True
    kw.update(overrides)
    config = build_transformer_config(model_config, megatron_ddp=not for_loading, **kw)
    model_config.validate(config)
    if rc.schedule.micro_batch_size and rc.data.seq_length:  # an imported model's arguments have no batch
        check_fp8_tokens(config.fp8, config.fp8_recipe, micro_batch_size=rc.schedule.micro_batch_size,
                         seq_length=rc.data.seq_length, tp=config.tensor_model_parallel_size,
                         sequence_parallel=config.sequence_parallel)
    if not for_loading:
        check_cuda_device_max_connections(config.tensor_model_parallel_size)
    return config, model_config


def build_model_chunks(config, model_config: LevModelConfig) -> List[torch.nn.Module]:
    """The (unwrapped) model chunks of this rank, in virtual-stage order (needs megatron's parallel state)."""
    from megatron.core import parallel_state as ps

    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for i in range(vpp or 1):
        vp_stage = i if vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=vpp is None, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=vpp is None, vp_stage=vp_stage)
        chunks.append(build_gpt_model(config=config, model_config=model_config, pre_process=pre, post_process=post,
                                      vp_stage=vp_stage))
    return chunks


def lev_table_modules(chunks) -> list:
    """LEV embedding modules in compute mode ``table`` (they need the per-step hooks)."""
    return [m for m in lev_modules(chunks) if m.lev_config.compute_mode == "table"]
