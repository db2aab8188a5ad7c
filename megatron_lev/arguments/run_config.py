"""The run's configuration as typed groups: :class:`RunConfig`, read from the parsed arguments or from a
checkpoint's saved ones (``config.yaml``, flat, every version written so far).

Each group holds the settings one part of the trainer reads, under Megatron-LM's argument names (a
field is the flag ``--field-name``), as Megatron-LM's ``megatron/training/config/`` groups its
``TrainingConfig``, ``SchedulerConfig`` and ``LoggerConfig``; the parallel sizes are one
:class:`~megatron_lev.distributed.layout.ParallelLayout`, checked once where it is made. The fields
that flags are generated from (most of ``groups.py``'s, and the layout's sizes) hold the flags' defaults, so
each default is written once. The others are required: a setting without a default (``lr``) or that
validation resolves (``global_batch_size``, ``num_microbatches``), and the fields whose flags another
class declares (the model group's, ``TokenizerSpec``'s), whose defaults are those flags'
(``build_parser``). Values the tokenizer decides (``padded_vocab_size``, ``tokenizer_fingerprint``) are
None until it is built.

``from_saved_args`` reads a saved flat dictionary: a key it lacks (a file written before the flag
existed) takes the flag's default, a derived value it lacks (world size, data-parallel size, micro-batches,
parameter dtype) is derived again as validation derives it, and ``"inf"`` (how ``config.yaml`` writes an
infinite float) is the float. ``to_saved_args`` writes the flat names back.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any, Dict, List, Mapping, Optional, Union

from megatron_lev.distributed.layout import MEGATRON_FIELDS, ParallelLayout
from megatron_lev.lev.config import ConfigError

from .groups import CheckpointingConfig, DataConfig, DistributedConfig, FoldedFlagsConfig, LoggingConfig, \
    OptimizerRunConfig, RunControlConfig, ScheduleConfig
from .parser import build_parser

__all__ = ["CheckpointingConfig", "DataConfig", "DistributedConfig", "FoldedFlagsConfig", "LoggingConfig",
           "ModelRunConfig", "OptimizerRunConfig", "RunConfig", "RunControlConfig", "ScheduleConfig", "LAYOUT_ARGS"]

# The saved arguments the layout holds (its sizes under Megatron-LM's names, and what validation derives).
LAYOUT_ARGS = tuple(MEGATRON_FIELDS.values()) + ("world_size", "data_parallel_size")


@dataclass(frozen=True, kw_only=True)
class ModelRunConfig:
    """The model: every model flag under its Megatron-LM name (the shape, the input arm and its LEV
    settings, positions and norms, precision, recomputation, the TransformerConfig switches, MoE and MTP).
    ``models.factory.build_configs`` builds megatron-core's ``TransformerConfig`` and ``LevModelConfig``
    from it; a field None where the flag was not given keeps that config's default."""

    # ---------------------------------------------------------------- shape
    num_layers: int
    """Transformer layers (--num-layers)."""

    hidden_size: int
    """Hidden width D (--hidden-size)."""

    ffn_hidden_size: Optional[int]
    """MLP width (--ffn-hidden-size; validation derives 4 x hidden, or 8/3 x hidden to a multiple of 64 with
    --swiglu)."""

    num_attention_heads: int
    """Attention heads (--num-attention-heads)."""

    num_query_groups: Optional[int]
    """Key/value groups of grouped-query attention (--num-query-groups); None = one per head."""

    kv_channels: Optional[int]
    """Channels per attention head (--kv-channels); None = hidden / heads."""

    max_position_embeddings: int
    """Positions the model embeds (--max-position-embeddings; validation sets it to --seq-length when unset)."""

    padded_vocab_size: Optional[int] = None
    """Embedding rows: the tokenizer's vocabulary padded to --make-vocab-size-divisible-by x TP; None until
    the tokenizer is built."""

    make_vocab_size_divisible_by: int
    """Pad the vocabulary to a multiple of this times the tensor-parallel size (--make-vocab-size-divisible-by)."""

    # ---------------------------------------------------------------- input arm
    input_embedding: str
    """The input representation, a registered input arm (``models.arms``: tied, untied, albert, flat_mlp,
    factored_mlp, lev; --input-embedding)."""

    albert_dim: Optional[int]
    """e of the albert arm (--albert-dim); None = parameter-matched to LEV."""

    flat_mlp_dim: Optional[int]
    """e of the flat_mlp arm (--flat-mlp-dim); None = matched."""

    mlp_hidden: Optional[int]
    """m, hidden width of the flat_mlp and factored_mlp MLPs (--mlp-hidden); None = matched."""

    lev_digits: int
    """LEV's k, digits of a token id (--lev-digits; ``LEVConfig.num_digits``)."""

    lev_base: Optional[int]
    """LEV's b, base of the digits (--lev-base); None = the smallest b with b**k >= V."""

    lev_seed_dim: int
    """LEV's d_s, width of a codebook row (--lev-seed-dim)."""

    lev_knots: int
    """LEV's kappa, knots of each spline (--lev-knots)."""

    lev_rank: int
    """LEV's r, modes per head (--lev-rank)."""

    lev_heads: int
    """LEV's h, parallel heads (--lev-heads)."""

    lev_compute_mode: str
    """How LEV evaluates a micro-batch: token, unique or table (--lev-compute-mode)."""

    lev_basis: str
    """LEV's spline-basis evaluation: auto, dense, sparse, fused or triton (--lev-basis)."""

    lev_log_eps: float
    """LEV's floor on |phi| before the log (--lev-log-eps)."""

    lev_chunk_size: int
    """Ids per chunk of LEV's initialisation statistics and table mode (--lev-chunk-size)."""

    lev_product_chunk: int
    """Seed dimensions per chunk of LEV's separable-product kernel (--lev-product-chunk)."""

    lev_init_sample_size: Optional[int]
    """Ids of LEV's initialisation statistics (--lev-init-sample-size); None = all."""

    # ---------------------------------------------------------------- positions, norms, MLP
    position_embedding_type: str
    """Positions: learned_absolute, rope or none (--position-embedding-type)."""

    rope_type: str
    """The rotary embedding's type (--rope-type)."""

    rotary_percent: float
    """Fraction of a head's channels RoPE rotates (--rotary-percent)."""

    rotary_base: int
    """RoPE's base period (--rotary-base)."""

    use_rope_scaling: bool
    """Llama 3.1's RoPE scaling (--use-rope-scaling)."""

    rope_scaling_factor: float
    """Its factor (--rope-scaling-factor)."""

    normalization: str
    """LayerNorm or RMSNorm (--normalization)."""

    norm_epsilon: float
    """The norms' epsilon (--norm-epsilon; TransformerConfig.layernorm_epsilon)."""

    swiglu: bool
    """SwiGLU MLP instead of GeLU (--swiglu)."""

    disable_bias_linear: bool
    """No biases in the transformer's linear layers (--disable-bias-linear)."""

    init_method_std: float
    """Standard deviation of the weights' initialisation (--init-method-std)."""

    hidden_dropout: float
    """Dropout after attention and MLP (--hidden-dropout)."""

    attention_dropout: float
    """Dropout of the attention probabilities (--attention-dropout)."""

    transformer_impl: str
    """Layer spec: auto, local or transformer_engine (--transformer-impl)."""

    linear_cross_entropy_chunk_size: Optional[int]
    """Tokens per chunk of --cross-entropy-fusion-impl linear (--linear-cross-entropy-chunk-size); None = the
    device's default."""

    # ---------------------------------------------------------------- precision
    bf16: bool
    """Train in bfloat16 (--bf16)."""

    fp16: bool
    """Train in float16 with loss scaling (--fp16)."""

    params_dtype_name: str
    """The parameters' torch dtype name, derived from --bf16 / --fp16."""

    fp8_format: Optional[str]
    """FP8 format for Transformer Engine layers (--fp8-format); None = no FP8."""

    fp8_recipe: str
    """FP8 scaling recipe (--fp8-recipe)."""

    fp8_margin: int
    """Margin of the FP8 scaling factor (--fp8-margin)."""

    fp8_amax_history_len: int
    """Length of the FP8 amax history (--fp8-amax-history-len)."""

    fp8_amax_compute_algo: str
    """How the FP8 amax is chosen from its history: most_recent or max (--fp8-amax-compute-algo)."""

    fp8_param_gather: bool
    """Keep the parameters in FP8 and all-gather them in FP8 (--fp8-param-gather; TransformerConfig.fp8_param)."""

    # ---------------------------------------------------------------- loss
    cross_entropy_loss_fusion: bool
    """Fused cross-entropy loss (--cross-entropy-loss-fusion)."""

    cross_entropy_fusion_impl: str
    """The fused cross-entropy implementation (--cross-entropy-fusion-impl)."""

    calculate_per_token_loss: bool
    """Average the loss over all tokens of the global batch rather than per micro-batch
    (--calculate-per-token-loss)."""

    # ---------------------------------------------------------------- recomputation, sequence parallelism
    recompute_granularity: Optional[str]
    """Activation recomputation: full or selective (--recompute-granularity, or --recompute-activations)."""

    recompute_method: Optional[str]
    """Full recomputation's layer grouping: uniform or block (--recompute-method)."""

    recompute_num_layers: Optional[int]
    """Layers per recomputed group (--recompute-num-layers)."""

    recompute_modules: Optional[List[str]]
    """The parts selective recomputation recomputes (--recompute-modules); None = megatron-core's (core_attn)."""

    sequence_parallel: bool
    """Split the norms' and dropouts' activations over the tensor-parallel ranks (--sequence-parallel)."""

    # ---------------------------------------------------------------- TransformerConfig switches
    layernorm_zero_centered_gamma: bool
    """Zero-centred norm weights (--apply-layernorm-1p)."""

    attention_softmax_in_fp32: bool
    """Attention masking and softmax in float32 (--attention-softmax-in-fp32)."""

    masked_softmax_fusion: Optional[bool]
    """Fused masked softmax (--no-masked-softmax-fusion turns it off); None = where the kernel is present."""

    bias_dropout_fusion: Optional[bool]
    """Fused bias + dropout (--no-bias-dropout-fusion turns it off); None = where the kernel is present."""

    apply_rope_fusion: Optional[bool]
    """Fused RoPE (--no-rope-fusion turns it off); None = where the kernel is present."""

    gradient_accumulation_fusion: Optional[bool]
    """Weight-gradient accumulation fused into the GEMMs (--no-gradient-accumulation-fusion turns it off);
    None = where the kernel is present."""

    disable_bf16_reduced_precision_matmul: bool
    """No reduced-precision reductions in bfloat16 matmuls (--disable-bf16-reduced-precision-matmul)."""

    qk_layernorm: bool = False
    """A norm over each head's queries and keys before attention (--qk-layernorm; the spec's norm)."""

    use_cpu_initialization: Optional[bool] = None
    """Initialise the weights on the CPU, then move them to the device (--use-cpu-initialization); None =
    megatron-core's default (on the device), the CPU where there is no GPU."""

    attention_backend: str
    """The attention kernel: flash, fused, unfused, local or auto (--attention-backend)."""

    bias_gelu_fusion: Optional[bool]
    """Fused bias + GeLU (--no-bias-gelu-fusion turns it off); None = where the kernel is present."""

    bias_swiglu_fusion: Optional[bool]
    """Fused bias + SwiGLU (--no-bias-swiglu-fusion turns it off); None = where the kernel is present."""

    # ---------------------------------------------------------------- mixture of experts, MTP
    num_experts: Optional[int]
    """Experts per MoE layer (--num-experts; TransformerConfig.num_moe_experts); None = a dense model."""

    moe_ffn_hidden_size: Optional[int]
    """An expert's MLP width (--moe-ffn-hidden-size); None = --ffn-hidden-size."""

    moe_layer_freq: Union[int, List[int]]
    """Every N-th layer is an MoE layer, or a 0/1 pattern per layer (--moe-layer-freq)."""

    moe_router_topk: int
    """Experts each token is routed to (--moe-router-topk)."""

    moe_router_load_balancing_type: str
    """The router's load balancing (--moe-router-load-balancing-type)."""

    moe_aux_loss_coeff: float
    """Scale of the load-balancing loss (--moe-aux-loss-coeff)."""

    moe_z_loss_coeff: Optional[float]
    """Scale of the router's z-loss (--moe-z-loss-coeff); None = none."""

    moe_token_dispatcher_type: str
    """How tokens reach the experts' ranks: allgather or alltoall (--moe-token-dispatcher-type)."""

    moe_router_dtype: Optional[str]
    """The router's dtype: fp32 or fp64 (--moe-router-dtype); None = the model's."""

    moe_grouped_gemm: bool
    """The experts of a rank in one grouped GEMM (--moe-grouped-gemm)."""

    moe_permute_fusion: bool
    """Fused token permutation in the dispatcher (--moe-permute-fusion)."""

    moe_per_layer_logging: bool
    """Log the MoE losses per layer (--moe-per-layer-logging)."""

    mtp_num_layers: Optional[int]
    """Multi-token-prediction layers (--mtp-num-layers); None = none."""

    mtp_loss_scaling_factor: float
    """Weight of the multi-token-prediction loss (--mtp-loss-scaling-factor)."""


# The flat groups, by their RunConfig field (the layout is made separately).
_GROUPS = {"model": ModelRunConfig, "data": DataConfig, "schedule": ScheduleConfig, "optimizer": OptimizerRunConfig,
           "distributed": DistributedConfig, "checkpointing": CheckpointingConfig, "logging": LoggingConfig,
           "run": RunControlConfig, "folded": FoldedFlagsConfig}


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything a training run reads, in groups; made from the parsed arguments or the saved ones."""

    model: ModelRunConfig
    """Model settings the trainer reads."""

    layout: ParallelLayout
    """TP, PP, virtual stages, CP, EP, ETP and the world size; DP derived."""

    data: DataConfig
    """Datasets, loader, tokenizer."""

    schedule: ScheduleConfig
    """Length, batch sizes, evaluation, learning-rate and weight-decay schedules."""

    optimizer: OptimizerRunConfig
    """Optimizer, learning rates, clipping, loss scaling."""

    distributed: DistributedConfig
    """Backend and gradient reduction."""

    checkpointing: CheckpointingConfig
    """Save, load, resume."""

    logging: LoggingConfig
    """Log lines, TensorBoard, wandb, metrics file."""

    run: RunControlConfig
    """Seed, exits, faults, garbage collection, profiling."""

    folded: FoldedFlagsConfig
    """Flags validation folds into other fields, as given (saved, read by nothing)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RunConfig":
        """The run configuration of validated arguments (``parse_args``)."""
        # As argparse typed them: config.yaml keeps writing what the flags gave (--loss-scale-window's
        # default is the int 1000, as in Megatron-LM).
        return cls._from_flat(vars(args), "the arguments", coerce=False)

    @classmethod
    def from_saved_args(cls, saved: Mapping[str, Any], source: str = "config.yaml") -> "RunConfig":
        """The run configuration of saved arguments (a ``config.yaml`` of any version so far)."""
        values = dict(saved)
        defaults = _flag_defaults()
        for name in flat_names():
            if name not in values and name in defaults:
                values[name] = defaults[name]
        _derive_missing(values, source)
        return cls._from_flat(values, source)

    def to_saved_args(self) -> Dict[str, Any]:
        """The flat saved arguments of this configuration (``config.yaml``'s names and values)."""
        out: Dict[str, Any] = {}
        for group in _GROUPS:
            out.update(dataclasses.asdict(getattr(self, group)))
        out.update(self.layout.megatron_sizes())
        out.update(world_size=self.layout.world_size, data_parallel_size=self.layout.dp)
        return out

    def flat(self) -> argparse.Namespace:
        """The flat arguments (``to_saved_args``) as a namespace, for the functions of ``arguments`` and
        ``checkpoint`` that check the flat form (batch schedules, --save and --load)."""
        return argparse.Namespace(**self.to_saved_args())

    def with_tokenizer(self, tokenizer) -> "RunConfig":
        """This configuration with what ``tokenizer`` decides: the embedding's rows (its vocabulary padded to
        --make-vocab-size-divisible-by x TP) and the fingerprint checkpoints and datasets are checked against."""
        from megatron_lev.tokenizer import padded_vocab_size, tokenizer_fingerprint
        from megatron_lev.tokenizer.tokenizers import model_vocab_size

        try:
            vocab = model_vocab_size(tokenizer, self.data.tokenizer_type, self.data.vocab_size,
                                     self.data.tiktoken_pattern)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        rows = padded_vocab_size(vocab, self.model.make_vocab_size_divisible_by, self.layout.tp)
        return dataclasses.replace(
            self, model=dataclasses.replace(self.model, padded_vocab_size=rows),
            data=dataclasses.replace(self.data, tokenizer_fingerprint=tokenizer_fingerprint(tokenizer)))

    @classmethod
    def _from_flat(cls, values: Mapping[str, Any], source: str, coerce: bool = True) -> "RunConfig":
        groups = {name: _group(klass, values, source, coerce) for name, klass in _GROUPS.items()}
        if "world_size" not in values:
            raise ConfigError(f"{source}: no world_size (the number of processes the arguments were validated for)")
        layout = ParallelLayout.from_fields(values, world_size=values["world_size"])
        if "data_parallel_size" in values and values["data_parallel_size"] != layout.dp:
            raise ConfigError(f"{source}: data_parallel_size {values['data_parallel_size']} is not the world size "
                              f"{layout.world_size} over TP x PP x CP ({layout.dp})")
        return cls(layout=layout, **groups)


def flat_names() -> List[str]:
    """Every flat argument name a :class:`RunConfig` reads (the groups' fields and the layout's)."""
    return [f.name for klass in _GROUPS.values() for f in fields(klass)] + list(LAYOUT_ARGS)


@lru_cache(maxsize=None)
def _flag_defaults() -> Dict[str, Any]:
    """Each argument's value when its flag is not given (the first flag of a destination sets it, as in argparse)."""
    parser = build_parser()
    return {a.dest: parser.get_default(a.dest) for a in parser._actions if a.dest not in (argparse.SUPPRESS, "help")}


def _derive_missing(values: Dict[str, Any], source: str) -> None:
    """What validation derives, for saved arguments that lack it (validation's own rules)."""
    model = 1
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        model *= values.get(name) or 1
    if "world_size" not in values and values.get("data_parallel_size"):
        values["world_size"] = values["data_parallel_size"] * model
    if "data_parallel_size" not in values and values.get("world_size"):
        values["data_parallel_size"] = values["world_size"] // model
    if values.get("params_dtype_name") is None:
        values["params_dtype_name"] = "bfloat16" if values.get("bf16") else ("float16" if values.get("fp16") else "float32")
    if values.get("num_microbatches") is None and values.get("global_batch_size") and values.get("micro_batch_size"):
        values["num_microbatches"] = values["global_batch_size"] // (
            values["micro_batch_size"] * (values.get("data_parallel_size") or 1))


def _group(klass, values: Mapping[str, Any], source: str, coerce: bool = True):
    hints = typing.get_type_hints(klass)
    kwargs = {}
    for f in fields(klass):
        if f.name in values:
            kwargs[f.name] = _coerce(hints[f.name], values[f.name], f.name, source) if coerce else values[f.name]
        elif f.default is dataclasses.MISSING:
            raise ConfigError(f"{source}: no {f.name} (flag --{f.name.replace('_', '-')})")
    return klass(**kwargs)


def _coerce(hint: Any, value: Any, name: str, source: str) -> Any:
    """``value`` as the field's type where the saved form differs: a float written as an int or as
    ``"inf"``, a list written as a tuple."""
    if value is None:
        return None
    args = typing.get_args(hint)
    base = next((a for a in args if a is not type(None)), hint) if typing.get_origin(hint) is typing.Union else hint
    if base is float and not isinstance(value, bool) and isinstance(value, (int, str)):
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{source}: {name}: {value!r} is not a number") from None
    if typing.get_origin(base) is list and isinstance(value, tuple):
        return list(value)
    return value
