"""Transformer layer specs: Transformer Engine (fused, FP8-capable) or local (CPU-capable).

- TE spec: megatron-core's ``get_gpt_layer_with_transformer_engine_spec`` (fused norm+linear,
  TE attention; FP8 is switched on by ``config.fp8`` / ``config.fp8_recipe``), final norm
  ``TENorm``. Used when ``transformer_impl`` is "transformer_engine", or "auto" with TE and CUDA.
- Local spec: megatron-core's local modules (Column/RowParallelLinear, SelfAttention, MLP) with
  two substitutions: ``SDPAttention`` (torch SDPA, runs on CPU) as the core attention, and
  ``SequenceParallelNorm`` (supports sequence parallelism) for every norm, the final one included.
  RMSNorm/LayerNorm from ``config.normalization``; SwiGLU or GeLU from ``config.gated_linear_unit``
  and ``config.activation_func``; biases from ``config.add_bias_linear``.

Both specs write the same checkpoint keys. Transformer Engine fuses the input and pre-MLP norms
into ``linear_qkv`` / ``linear_fc1`` (parameters ``layer_norm_weight``/``layer_norm_bias``); the local
layer keeps them as separate modules and saves them under TE's names through megatron-core's
``sharded_state_dict_keys_map`` (the map of megatron-core's own local GPT spec). The q/k norms and
the final norm are separate modules in both specs and have the same names already. TE's extra
entries (``*._extra_state``, FP8 metadata) are matched on load by ``checkpoint_keys``.
"""

from __future__ import annotations

from typing import Dict, Optional

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_lev.parallel.norms import SequenceParallelNorm

from .attention import SDPAttention
from .config import LevModelConfig, use_transformer_engine
from .moe import is_moe, legacy_grouped_gemm_kwargs, moe_layer_pattern, moe_mlp_spec


def get_layer_spec(config, model_config: Optional[LevModelConfig] = None, moe: bool = False) -> ModuleSpec:
    """The ``ModuleSpec`` of one transformer layer for ``config`` on this machine; ``moe``: with
    megatron-core's MoE layer (``config.num_moe_experts`` experts) as its MLP."""
    impl = model_config.transformer_impl if model_config is not None else "auto"
    if use_transformer_engine(impl):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts if moe else None,
            moe_grouped_gemm=bool(moe and config.moe_grouped_gemm), qk_layernorm=config.qk_layernorm,
            **legacy_grouped_gemm_kwargs(config))
    return get_local_layer_spec(config, moe=moe)


def te_layer_keys_map() -> Dict[str, str]:
    """Local-layer key prefix -> Transformer Engine key prefix, as megatron-core's local GPT spec maps
    them (``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``, and the pre-MLP norm)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return dict(get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map)


def get_local_layer_spec(config, moe: bool = False) -> ModuleSpec:
    """Local (non-TE) layer: SDPA core attention and sequence-parallel-capable norms; checkpoint keys
    are Transformer Engine's (see ``te_layer_keys_map``). ``moe``: megatron-core's MoE layer
    (SequentialMLP experts) as the MLP; its pre-MLP norm is a module of its own in TE's MoE layer too
    (no fused linear to hold it), so only the input norm's keys are mapped."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    norm = SequenceParallelNorm
    qk_norm = norm if config.qk_layernorm else IdentityOp
    keys_map = te_layer_keys_map()
    if moe:
        mlp = moe_mlp_spec(config, use_transformer_engine=False)
        keys_map = {k: v for k, v in keys_map.items() if not k.startswith("pre_mlp_layernorm")}
    else:
        mlp = ModuleSpec(
            module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=SDPAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys_map,
        ),
    )


def get_block_spec(
    config, model_config: Optional[LevModelConfig] = None, vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
) -> TransformerBlockSubmodules:
    """The decoder block of this pipeline stage (and virtual stage): its layers (dense or MoE by
    ``config.moe_layer_freq``, counted from the first layer of the whole model) and final norm.
    ``pp_rank`` defaults to this process's pipeline rank (needs initialised model-parallel groups)."""
    impl = model_config.transformer_impl if model_config is not None else "auto"
    if use_transformer_engine(impl):
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm = TENorm
    else:
        final_norm = SequenceParallelNorm
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    if not is_moe(config):
        return TransformerBlockSubmodules(layer_specs=[get_layer_spec(config, model_config)] * n,
                                          layer_norm=final_norm)
    specs = {moe: get_layer_spec(config, model_config, moe=bool(moe)) for moe in (0, 1)}
    pattern = moe_layer_pattern(config.num_layers, config.moe_layer_freq)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[specs[x] for x in pattern[offset:offset + n]],
                                      layer_norm=final_norm)


def get_mtp_block_spec(config, model_config: Optional[LevModelConfig], block_spec: TransformerBlockSubmodules,
                       vp_stage: Optional[int] = None):
    """megatron-core's multi-token-prediction block spec for this stage (None where the stage holds no
    MTP layers, or without ``config.mtp_num_layers``): each MTP layer's transformer layer is the block's
    last layer spec; its norms are TE's, or on the local spec ``SequenceParallelNorm`` as everywhere."""
    if not getattr(config, "mtp_num_layers", None):
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend

    impl = model_config.transformer_impl if model_config is not None else "auto"
    if use_transformer_engine(impl):
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        backend = TESpecProvider()
    else:
        backend = _LocalBackend()
    return get_gpt_mtp_block_spec_for_backend(config=config, spec=block_spec, backend=backend, vp_stage=vp_stage)


class _LocalBackend(LocalSpecProvider):
    """megatron-core's local modules with the project's sequence-parallel-capable norm."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return SequenceParallelNorm
