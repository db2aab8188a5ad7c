"""Arguments -> megatron-core TransformerConfig + the project's model config -> model chunks.

One chunk per virtual pipeline stage (a single chunk without interleaving). The input arm and the
output head are placed by ``megatron_lev.models.build_gpt_model`` on the first/last stage.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import torch


def params_dtype(args) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(args.params_dtype_name, torch.float32)


def lev_config_from_args(args):
    from megatron_lev.lev.config import LEVConfig

    return LEVConfig(
        num_digits=args.lev_digits, base=args.lev_base, seed_dim=args.lev_seed_dim, num_knots=args.lev_knots,
        rank=args.lev_rank, num_heads=args.lev_heads, compute_mode=args.lev_compute_mode, basis=args.lev_basis,
        log_eps=args.lev_log_eps, chunk_size=args.lev_chunk_size, product_chunk=args.lev_product_chunk,
        init_sample_size=args.lev_init_sample_size,
    )


def model_config_from_args(args):
    """The project's ``LevModelConfig`` for these arguments (``args.padded_vocab_size`` must be set)."""
    from megatron_lev.models import LevModelConfig

    return LevModelConfig(
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        input_embedding=args.input_embedding,
        lev=lev_config_from_args(args),
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        albert_dim=args.albert_dim,
        flat_mlp_dim=args.flat_mlp_dim,
        mlp_hidden=args.mlp_hidden,
        normalization=args.normalization,
        activation="swiglu" if args.swiglu else "gelu",
        add_bias_linear=not args.disable_bias_linear,
        transformer_impl=args.transformer_impl,
        init_seed=args.seed,
    )


def transformer_config_kwargs(args) -> dict:
    dtype = params_dtype(args)
    kw: dict = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        layernorm_epsilon=args.norm_epsilon,
        init_method_std=args.init_method_std,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        # The loss is averaged per micro-batch by our loss function; the schedule divides by the
        # number of micro-batches (Megatron-LM's default, calculate_per_token_loss=False).
        calculate_per_token_loss=False,
    )
    # Megatron-LM's p2p defaults: the interleaved schedule overlaps p2p communication and issues it
    # unbatched (with PP=2 the batched form pairs sends and receives between the same two ranks by
    # issue order, which mixes activations and gradients on gloo); 1F1B batches its p2p ops.
    overlap_p2p = args.virtual_pipeline_model_parallel_size is not None and not args.no_overlap_p2p_communication
    kw.update(overlap_p2p_comm=overlap_p2p, batch_p2p_comm=not overlap_p2p)
    if args.fp8_format is not None:
        kw.update(fp8=args.fp8_format, fp8_recipe=args.fp8_recipe)
    if args.kv_channels is None:
        kw.pop("kv_channels")
    if args.num_query_groups is None:
        kw.pop("num_query_groups")
    return kw


def build_configs(args) -> Tuple[Any, Any]:
    """(TransformerConfig, LevModelConfig); ConfigError on an impossible combination."""
    from megatron_lev.models import build_transformer_config

    model_config = model_config_from_args(args)
    config = build_transformer_config(model_config, **transformer_config_kwargs(args))
    model_config.validate(config)
    return config, model_config


def build_model_chunks(args, config, model_config) -> List[torch.nn.Module]:
    """The (unwrapped) model chunks of this rank, in virtual-stage order."""
    from megatron.core import parallel_state as ps

    from megatron_lev.models import build_gpt_model

    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for i in range(vpp or 1):
        vp_stage = i if vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=vpp is None, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=vpp is None, vp_stage=vp_stage)
        model = build_gpt_model(
            config=config, model_config=model_config, pre_process=pre, post_process=post, vp_stage=vp_stage
        )
        chunks.append(model)
    return chunks


def lev_table_modules(chunks) -> list:
    """LEV embedding modules in compute mode ``table`` (they need the per-step hooks)."""
    try:
        from megatron_lev.models import lev_modules
    except ImportError:  # pragma: no cover - older model package
        return []
    mods = []
    for c in chunks:
        for m in lev_modules(c):
            mode = getattr(m, "compute_mode", None) or getattr(getattr(m, "lev_config", None), "compute_mode", None)
            if mode == "table" and hasattr(m, "begin_table_step"):
                mods.append(m)
    return mods

