"""Mixture of experts through megatron-core's own MoE layers: the checks, the layer pattern, the MLP spec.

megatron-core's ``TransformerConfig`` carries every MoE setting (``num_moe_experts``,
``moe_ffn_hidden_size``, ``moe_router_topk``, ``moe_router_load_balancing_type``, ``moe_aux_loss_coeff``,
``moe_z_loss_coeff``, ``moe_token_dispatcher_type``, ``moe_layer_freq``, ``moe_router_dtype``,
``moe_grouped_gemm``, ``moe_permute_fusion``, ``moe_per_layer_logging``, ``expert_model_parallel_size``,
``expert_tensor_parallel_size``), so ``build_transformer_config`` passes them through unchanged. This
module adds what it does not check, as one-line errors naming the Megatron-LM flag:

- ``--moe-grouped-gemm`` runs Transformer Engine's ``TEGroupedMLP``; the local spec (``SequentialMLP``)
  has no grouped GEMM (megatron's local ``GroupedMLP`` needs the ``grouped_gemm`` CUDA package);
- ``--moe-permute-fusion`` needs Transformer Engine's fused permutation (megatron-core 0.16.1's own check
  imports names its moe_utils only defines with TE, which fails as ImportError, not a config error);
- the router, dispatcher and load-balancing choices that this project runs and tests; the alltoall
  dispatcher only with CUDA (gloo has the ``all_to_all_single`` it needs, but megatron-core 0.16.1's
  dispatcher builds a ``torch.cuda.Stream`` when it is constructed): CPU runs use allgather;
- top-k within the experts (the experts against the expert-parallel size are checked with the rest of the
  parallel layout, ``config.check_parallel_settings``).

The MoE layer spec is megatron-core's (``get_moe_module_spec_for_backend``): SequentialMLP of
ColumnParallelLinear / RowParallelLinear experts on the local backend.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from megatron_lev.lev.config import ConfigError

# The choices this project runs (megatron-core has more: global_aux_loss, flex, alltoall_seq).
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")
MOE_TOKEN_DISPATCHERS = ("allgather", "alltoall")
MOE_ROUTER_DTYPES = ("fp32", "fp64")


def is_moe(config: Any) -> bool:
    """Whether ``config`` (a TransformerConfig) has MoE layers."""
    return bool(getattr(config, "num_moe_experts", None))


def moe_layer_pattern(num_layers: int, moe_layer_freq) -> List[int]:
    """1 for an MoE layer, 0 for a dense one, per decoder layer: megatron-core's rule (its
    ``get_gpt_decoder_layer_specs``): an integer N makes every N-th layer from the first an MoE layer,
    a list gives the pattern itself."""
    if isinstance(moe_layer_freq, int):
        if moe_layer_freq < 1:
            raise ConfigError(f"--moe-layer-freq must be >= 1 or a list of 0/1 (got {moe_layer_freq})")
        return [1 if i % moe_layer_freq == 0 else 0 for i in range(num_layers)]
    pattern = list(moe_layer_freq)
    if len(pattern) != num_layers or any(x not in (0, 1) for x in pattern):
        raise ConfigError(
            f"--moe-layer-freq {pattern}: a pattern needs one 0 (dense) or 1 (MoE) per layer, "
            f"{num_layers} in all (--num-layers)"
        )
    return pattern


def _choice(flag: str, value: Any, choices) -> None:
    values = value if isinstance(value, list) else [value]
    for v in values:
        if v not in choices:
            raise ConfigError(f"{flag} must be one of {', '.join(choices)} (got {v!r})")


def check_moe_settings(config: Any, *, use_transformer_engine: bool) -> None:
    """One-line ``ConfigError`` for MoE settings this model cannot run (``config``: a TransformerConfig).
    Dense configs pass. The experts against the expert-parallel size: ``config.check_parallel_settings``."""
    if not is_moe(config):
        return
    experts = config.num_moe_experts
    if not 1 <= config.moe_router_topk <= experts:
        raise ConfigError(f"--moe-router-topk {config.moe_router_topk} must be between 1 and --num-experts {experts}")
    _choice("--moe-router-load-balancing-type", config.moe_router_load_balancing_type, MOE_LOAD_BALANCING_TYPES)
    _choice("--moe-token-dispatcher-type", config.moe_token_dispatcher_type, MOE_TOKEN_DISPATCHERS)
    if config.moe_router_dtype is not None:
        _choice("--moe-router-dtype", config.moe_router_dtype, MOE_ROUTER_DTYPES)
    moe_layer_pattern(config.num_layers, config.moe_layer_freq)
    if config.moe_token_dispatcher_type == "alltoall" and not torch.cuda.is_available():
        raise ConfigError(
            "--moe-token-dispatcher-type alltoall needs CUDA (megatron-core's alltoall dispatcher makes a "
            "torch.cuda.Stream for its device-to-host copies); use --moe-token-dispatcher-type allgather on CPU")
    if config.add_bias_linear and not use_transformer_engine:
        # megatron-core's expert MLP (0.16.1 and 0.19) adds its bias in place into the output of the local
        # RowParallelLinear, a view that autograd refuses to modify ("Output 0 of
        # _ReduceFromModelParallelRegion is a view and is being modified inplace").
        raise ConfigError(
            "--num-experts with biases fails in megatron-core's expert MLP on the local spec (it adds the bias in "
            "place into the row-parallel output); pass --disable-bias-linear, as Megatron-LM's MoE examples do")
    check_te_only_moe_flags(vars(config), use_transformer_engine=use_transformer_engine)


def check_te_only_moe_flags(settings: Dict[str, Any], *, use_transformer_engine: bool) -> None:
    """The MoE settings that only the Transformer Engine spec runs (``settings``: TransformerConfig fields,
    checked before the TransformerConfig is built, whose own permute-fusion check fails with ImportError)."""
    if settings.get("moe_grouped_gemm") and not use_transformer_engine:
        raise ConfigError(
            "--moe-grouped-gemm needs the Transformer Engine spec (TEGroupedMLP); the local spec runs "
            "SequentialMLP: drop --moe-grouped-gemm or use --transformer-impl transformer_engine on a GPU")
    if settings.get("moe_permute_fusion") and not use_transformer_engine:
        raise ConfigError(
            "--moe-permute-fusion needs Transformer Engine's fused permutation (a GPU with TE >= 2.1); "
            "drop --moe-permute-fusion")


def moe_mlp_spec(config: Any, *, use_transformer_engine: bool):
    """megatron-core's MoE module spec for ``config``: TE (TEGroupedMLP with --moe-grouped-gemm, else
    SequentialMLP of TE linears) or local (SequentialMLP of Column/RowParallelLinear)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend

    if use_transformer_engine:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        backend = TESpecProvider()
    else:
        backend = LocalSpecProvider()
    return get_moe_module_spec_for_backend(backend=backend, num_experts=config.num_moe_experts,
                                           moe_grouped_gemm=config.moe_grouped_gemm,
                                           **legacy_grouped_gemm_kwargs(config))


def legacy_grouped_gemm_kwargs(config: Any) -> Dict[str, Any]:
    """The ``moe_use_legacy_grouped_gemm`` argument of megatron-core's layer and MoE spec builders, where the
    release has it (0.19 removed the legacy grouped GEMM: the TransformerConfig field and the argument).
    Here rather than in ``compat``, which ``models`` does not import (docs/architecture.md)."""
    if hasattr(config, "moe_use_legacy_grouped_gemm"):
        return {"moe_use_legacy_grouped_gemm": config.moe_use_legacy_grouped_gemm}
    return {}
