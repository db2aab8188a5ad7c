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

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from megatron_lev.parallel.norms import SequenceParallelNorm

from .attention import SDPAttention
from .config import LevModelConfig, use_transformer_engine


def get_layer_spec(config, model_config: Optional[LevModelConfig] = None) -> ModuleSpec:
    """The ``ModuleSpec`` of one transformer layer for ``config`` on this machine."""
    impl = model_config.transformer_impl if model_config is not None else "auto"
    if use_transformer_engine(impl):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    return get_local_layer_spec(config)


def te_layer_keys_map() -> Dict[str, str]:
    """Local-layer key prefix -> Transformer Engine key prefix, as megatron-core's local GPT spec maps
    them (``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``, and the pre-MLP norm)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return dict(get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map)


def get_local_layer_spec(config) -> ModuleSpec:
    """Local (non-TE) layer: SDPA core attention and sequence-parallel-capable norms; checkpoint keys
    are Transformer Engine's (see ``te_layer_keys_map``)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    norm = SequenceParallelNorm
    qk_norm = norm if config.qk_layernorm else IdentityOp
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
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            ),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=te_layer_keys_map(),
        ),
    )


def get_block_spec(
    config, model_config: Optional[LevModelConfig] = None, vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
) -> TransformerBlockSubmodules:
    """The decoder block of this pipeline stage (and virtual stage): its layers and final norm.
    ``pp_rank`` defaults to this process's pipeline rank (needs initialised model-parallel groups)."""
    layer = get_layer_spec(config, model_config)
    impl = model_config.transformer_impl if model_config is not None else "auto"
    if use_transformer_engine(impl):
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm = TENorm
    else:
        final_norm = SequenceParallelNorm
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=final_norm)
