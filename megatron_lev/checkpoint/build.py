"""Flat arguments -> megatron-core ``TransformerConfig`` + ``LevModelConfig`` -> model chunks.

The arguments are the resolved training arguments under Megatron-LM's names (``num_layers``,
``lev_heads``, ``padded_vocab_size``, ...): a parsed command line (``vars(args)``) or the arguments
saved with a checkpoint (``config.yaml``). Training, evaluation and conversion all build their model
here. ``relayout`` moves saved arguments to another tensor/pipeline layout (the padded vocabulary,
which fixes the tensors' rows, is kept).

One chunk per virtual pipeline stage (a single chunk without interleaving). The input arm and the
output head are placed by ``megatron_lev.models.build_gpt_model`` on the first/last stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from megatron_lev.distributed.layout import ParallelLayout
from megatron_lev.lev.config import ConfigError, LEVConfig
from megatron_lev.models import LevModelConfig, build_gpt_model, build_transformer_config, lev_modules
from megatron_lev.models.arms import arm_settings
from megatron_lev.models.config import TRANSFORMER_FLAG_FIELDS, check_cuda_device_max_connections, check_fp8_tokens, \
    settings_for_loading

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def params_dtype(a: Mapping[str, Any]) -> torch.dtype:
    """The parameter dtype of the resolved arguments (``params_dtype_name``)."""
    return _DTYPES.get(a.get("params_dtype_name") or "float32", torch.float32)


def model_config_from_args(a: Mapping[str, Any]) -> LevModelConfig:
    """The project's ``LevModelConfig`` for these arguments (``padded_vocab_size`` must be set)."""
    return LevModelConfig(
        vocab_size=a["padded_vocab_size"],
        max_sequence_length=a["max_position_embeddings"],
        input_embedding=a["input_embedding"],
        lev=LEVConfig.from_args(a),
        position_embedding_type=a["position_embedding_type"],
        rotary_percent=a["rotary_percent"],
        rotary_base=a["rotary_base"],
        use_rope_scaling=bool(a.get("use_rope_scaling", False)),
        rope_scaling_factor=float(a.get("rope_scaling_factor", 8.0)),
        **{name: a.get(name) for name in arm_settings()},  # the input arms' widths (models.arms)
        normalization=a["normalization"],
        activation="swiglu" if a.get("swiglu") else "gelu",
        add_bias_linear=not a.get("disable_bias_linear"),
        transformer_impl=a.get("transformer_impl") or "auto",
        init_seed=a.get("seed") or 0,
        linear_cross_entropy_chunk_size=a.get("linear_cross_entropy_chunk_size"),
    )


def transformer_config_kwargs(a: Mapping[str, Any]) -> Dict[str, Any]:
    """Keyword arguments of megatron-core's TransformerConfig (unset arguments keep its defaults)."""
    dtype = params_dtype(a)
    kw: Dict[str, Any] = dict(
        num_layers=a["num_layers"],
        hidden_size=a["hidden_size"],
        ffn_hidden_size=a.get("ffn_hidden_size"),
        num_attention_heads=a["num_attention_heads"],
        num_query_groups=a.get("num_query_groups"),
        kv_channels=a.get("kv_channels"),
        layernorm_epsilon=a.get("norm_epsilon"),
        init_method_std=a.get("init_method_std"),
        hidden_dropout=a.get("hidden_dropout"),
        attention_dropout=a.get("attention_dropout"),
        tensor_model_parallel_size=a.get("tensor_model_parallel_size") or 1,
        pipeline_model_parallel_size=a.get("pipeline_model_parallel_size") or 1,
        virtual_pipeline_model_parallel_size=a.get("virtual_pipeline_model_parallel_size"),
        sequence_parallel=bool(a.get("sequence_parallel")),
        bf16=bool(a.get("bf16")),
        fp16=bool(a.get("fp16")),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        recompute_granularity=a.get("recompute_granularity"),
        recompute_method=a.get("recompute_method"),
        recompute_num_layers=a.get("recompute_num_layers"),
        # The loss is averaged per micro-batch by our loss function; the schedule divides by the
        # number of micro-batches (Megatron-LM's default, calculate_per_token_loss=False).
        calculate_per_token_loss=False,
    )
    # Megatron-LM's p2p defaults: the interleaved schedule overlaps p2p communication and issues it
    # unbatched (with PP=2 the batched form pairs sends and receives between the same two ranks by
    # issue order, which mixes activations and gradients on gloo); 1F1B batches its p2p ops.
    overlap_p2p = a.get("virtual_pipeline_model_parallel_size") is not None and not a.get(
        "no_overlap_p2p_communication")
    kw.update(overlap_p2p_comm=overlap_p2p, batch_p2p_comm=not overlap_p2p)
    if a.get("fp8_format") is not None:
        kw.update(fp8=a["fp8_format"], fp8_recipe=a.get("fp8_recipe") or "delayed",
                  fp8_param=bool(a.get("fp8_param_gather")))
    kw.update(_transformer_flag_kwargs(a))
    kw.update(moe_config_kwargs(a))
    return {k: v for k, v in kw.items() if v is not None}


# Megatron-LM's argument names -> megatron-core TransformerConfig fields, for MoE and MTP.
MOE_ARGS = {
    "num_experts": "num_moe_experts", "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "moe_router_topk": "moe_router_topk", "moe_router_load_balancing_type": "moe_router_load_balancing_type",
    "moe_aux_loss_coeff": "moe_aux_loss_coeff", "moe_z_loss_coeff": "moe_z_loss_coeff",
    "moe_token_dispatcher_type": "moe_token_dispatcher_type", "moe_layer_freq": "moe_layer_freq",
    "moe_router_dtype": "moe_router_dtype", "moe_grouped_gemm": "moe_grouped_gemm",
    "moe_permute_fusion": "moe_permute_fusion", "moe_per_layer_logging": "moe_per_layer_logging",
    "expert_model_parallel_size": "expert_model_parallel_size",
    "expert_tensor_parallel_size": "expert_tensor_parallel_size",
    "mtp_num_layers": "mtp_num_layers", "mtp_loss_scaling_factor": "mtp_loss_scaling_factor",
}


def moe_config_kwargs(a: Mapping[str, Any]) -> Dict[str, Any]:
    """The TransformerConfig fields of the MoE / MTP arguments that are set (absent or None: megatron's
    defaults; arguments saved before MoE existed have none)."""
    return {field: a[name] for name, field in MOE_ARGS.items() if a.get(name) is not None}


def _transformer_flag_kwargs(a: Mapping[str, Any]) -> Dict[str, Any]:
    """The TransformerConfig fields set by the flags generated from it (arguments.model; None = not set:
    megatron-core's default, or the machine's for the fusions), with Megatron-LM's bias-fusion switches
    folded into ``bias_activation_fusion`` for the activation in use."""
    from dataclasses import fields

    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    have = {f.name for f in fields(TransformerConfig)}
    kw = {n: a[n] for n in TRANSFORMER_FLAG_FIELDS if n in have and a.get(n) is not None}
    if isinstance(kw.get("attention_backend"), str):
        kw["attention_backend"] = AttnBackend[kw["attention_backend"]]
    off = a.get("bias_swiglu_fusion") is False if a.get("swiglu") else a.get("bias_gelu_fusion") is False
    if off:
        kw["bias_activation_fusion"] = False
    return kw


def build_configs(a: Mapping[str, Any], *, for_loading: bool = False, **overrides: Any) -> Tuple[Any, LevModelConfig]:
    """(TransformerConfig, LevModelConfig) for the arguments ``a``; ConfigError (one line) on an impossible
    combination. ``for_loading``: the weights come from a checkpoint, built on this machine (a model
    trained with Transformer Engine is rebuilt with the local spec where TE or CUDA is missing; never with
    FP8; no layer initialises its parameters). Otherwise the model is trained, wrapped in megatron's DDP
    (gradient-accumulation fusion where available). ``overrides``: TransformerConfig fields to set."""
    if for_loading:
        a = dict(a, **settings_for_loading(a.get("transformer_impl")))
    model_config = model_config_from_args(a)
    kw = transformer_config_kwargs(a)
    if for_loading:
        kw["perform_initialization"] = False
        model_config.weights_from_checkpoint = True
    kw.update(overrides)
    config = build_transformer_config(model_config, megatron_ddp=not for_loading, **kw)
    model_config.validate(config)
    if a.get("micro_batch_size") and a.get("seq_length"):
        check_fp8_tokens(config.fp8, config.fp8_recipe, micro_batch_size=a["micro_batch_size"],
                         seq_length=a["seq_length"], tp=config.tensor_model_parallel_size,
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


@dataclass(frozen=True)
class SavedModel:
    """What saved arguments (a checkpoint's ``config.yaml``) say beside the configs :func:`build_configs`
    makes of them, typed, for the readers of a checkpoint without the ``arguments`` package (evaluation).
    A setting the file lacks is None."""

    seq_length: Optional[int]
    """Tokens per training sequence (--seq-length)."""

    padded_vocab_size: Optional[int]
    """Embedding rows of the saved model: the tokenizer's vocabulary padded as training padded it."""

    mtp_num_layers: Optional[int]
    """Multi-token-prediction layers the model was trained with (--mtp-num-layers); None = none."""

    @classmethod
    def from_saved_args(cls, saved: Mapping[str, Any]) -> "SavedModel":
        """The view of ``saved`` (flat saved arguments of any version); ConfigError (one line, naming the
        setting) where a count is not a whole number."""
        def number(name: str) -> Optional[int]:
            value = saved.get(name)
            if not value:
                return None
            whole = (isinstance(value, int) and not isinstance(value, bool)) or (
                isinstance(value, float) and value.is_integer()) or (isinstance(value, str) and value.strip().isdigit())
            if not whole:
                raise ConfigError(f"the saved {name} is {value!r}, not a whole number: the checkpoint's config.yaml "
                                  f"was edited or damaged; put back the value the run was trained with")
            return int(value)

        return cls(seq_length=number("seq_length"), padded_vocab_size=number("padded_vocab_size"),
                   mtp_num_layers=number("mtp_num_layers"))


def lev_table_modules(chunks) -> list:
    """LEV embedding modules in compute mode ``table`` (they need the per-step hooks)."""
    return [m for m in lev_modules(chunks) if m.lev_config.compute_mode == "table"]


def relayout(saved: Mapping[str, Any], tp: int, pp: int, vpp: Optional[int] = None,
             world_size: Optional[int] = None) -> Dict[str, Any]:
    """The saved arguments at TP=``tp`` x PP=``pp`` (``vpp`` virtual stages; data-parallel size from
    ``world_size``, default 1). ConfigError (one line) when the checkpoint cannot take that layout.

    The padded vocabulary is kept (the tensors have that many rows); ``make_vocab_size_divisible_by``
    is changed when needed so that a run at the new TP pads the tokenizer's vocabulary to the same
    size (Megatron pads to a multiple of ``make_vocab_size_divisible_by x TP``). An MoE model's experts
    are not split at the new layout (expert-parallel size 1, expert TP unset: the TP size), as the
    conversion and evaluation ranks build it; dist_checkpointing regathers them from any saved EP, and
    a run resumed from the result chooses its own ``--expert-model-parallel-size``.
    """
    a = dict(saved)
    # The sizes' rules are the layout's (vpp 1 is no interleaving there too); the experts go to EP 1 below.
    layout = ParallelLayout(world_size=int(world_size or max(1, tp * pp)), tp=int(tp), pp=int(pp), vpp=vpp)
    tp, pp = layout.tp, layout.pp
    padded = int(a["padded_vocab_size"])
    if padded % tp != 0:
        raise ConfigError(f"the padded vocabulary ({padded} rows) is not divisible by TP {tp}")
    a["make_vocab_size_divisible_by"] = _divisible_by_for(a, padded, tp)
    a.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
             virtual_pipeline_model_parallel_size=layout.vpp, num_layers_per_virtual_pipeline_stage=None,
             world_size=layout.world_size, data_parallel_size=layout.dp)
    if tp == 1:
        a["sequence_parallel"] = False
    if a.get("num_experts"):
        a.update(expert_model_parallel_size=1, expert_tensor_parallel_size=None)
    mbs, gbs = a.get("micro_batch_size"), a.get("global_batch_size")
    if mbs and gbs:
        a["num_microbatches"] = max(1, int(gbs) // int(mbs))
    return a


def _divisible_by_for(a: Mapping[str, Any], padded: int, tp: int) -> int:
    """A ``make_vocab_size_divisible_by`` that pads the original vocabulary to ``padded`` at ``tp``."""
    old = int(a.get("make_vocab_size_divisible_by") or 128)
    old_tp = int(a.get("tensor_model_parallel_size") or 1)
    # The source padded to a multiple of old * old_tp; the same multiple at ``tp`` pads identically.
    if (old * old_tp) % tp == 0 and padded % (old * old_tp) == 0:
        return old * old_tp // tp
    return padded // tp  # always reproduces ``padded`` (any vocabulary <= padded rounds up to it)
