"""The model's settings: :class:`ModelRunConfig`, every model flag under its Megatron-LM name, LEV's nested.

Below every package that builds or reads a model (``models``, ``checkpoint``, ``evaluation``,
``conversion``, ``training``); no argparse. ``models.factory`` turns it into megatron-core's
``TransformerConfig`` and the project's ``LevModelConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Union

from megatron_lev.lev.config import ConfigError, LEVConfig


_DTYPE_NAMES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True, kw_only=True)
class ModelRunConfig:
    """The model: every model flag under its Megatron-LM name (the shape, the input arm and its LEV
    settings, positions and norms, precision, recomputation, the TransformerConfig switches, MoE and MTP).
    ``models.factory.build_configs`` builds megatron-core's ``TransformerConfig`` and ``LevModelConfig``
    from it; a field None where the flag was not given keeps that config's default. Each default is the
    flag's (the flags of Megatron-LM's names are declared in ``arguments.model``, and a test holds the two
    equal); a numeric field's range is its metadata, checked when a saved ``config.yaml`` is read back."""

    # ---------------------------------------------------------------- shape
    num_layers: int = field(metadata={"min": 1})
    """Transformer layers (--num-layers)."""

    hidden_size: int = field(metadata={"min": 1})
    """Hidden width D (--hidden-size)."""

    ffn_hidden_size: Optional[int] = field(default=None, metadata={"min": 1})
    """MLP width (--ffn-hidden-size; validation derives 4 x hidden, or 8/3 x hidden to a multiple of 64 with
    --swiglu)."""

    num_attention_heads: int = field(metadata={"min": 1})
    """Attention heads (--num-attention-heads)."""

    num_query_groups: Optional[int] = field(default=None, metadata={"min": 1})
    """Key/value groups of grouped-query attention (--num-query-groups); None = one per head."""

    kv_channels: Optional[int] = field(default=None, metadata={"min": 1})
    """Channels per attention head (--kv-channels); None = hidden / heads."""

    max_position_embeddings: int = field(metadata={"min": 1})
    """Positions the model embeds (--max-position-embeddings; validation sets it to --seq-length when unset)."""

    padded_vocab_size: Optional[int] = None
    """Embedding rows: the tokenizer's vocabulary padded to --make-vocab-size-divisible-by x TP; None until
    the tokenizer is built."""

    make_vocab_size_divisible_by: int = field(default=128, metadata={"min": 1})
    """Pad the vocabulary to a multiple of this times the tensor-parallel size (--make-vocab-size-divisible-by)."""

    # ---------------------------------------------------------------- input arm
    input_embedding: str
    """The input representation, a registered input arm (``models.arms``: tied, untied, albert, flat_mlp,
    factored_mlp, lev; --input-embedding)."""

    albert_dim: Optional[int] = field(default=None, metadata={"min": 1})
    """e of the albert arm (--albert-dim); None = parameter-matched to LEV."""

    flat_mlp_dim: Optional[int] = field(default=None, metadata={"min": 1})
    """e of the flat_mlp arm (--flat-mlp-dim); None = matched."""

    mlp_hidden: Optional[int] = field(default=None, metadata={"min": 1})
    """m, hidden width of the flat_mlp and factored_mlp MLPs (--mlp-hidden); None = matched."""

    lev: LEVConfig = field(default_factory=LEVConfig)
    """LEV's settings (the ``--lev-*`` flags, saved flat under their names: ``LEVConfig.to_args``)."""

    # ---------------------------------------------------------------- positions, norms, MLP
    position_embedding_type: str = "learned_absolute"
    """Positions: learned_absolute, rope or none (--position-embedding-type)."""

    rope_type: str = "rope"
    """The rotary embedding's type (--rope-type)."""

    rotary_percent: float = field(default=1.0, metadata={"above": 0, "max": 1})
    """Fraction of a head's channels RoPE rotates (--rotary-percent)."""

    rotary_base: int = field(default=10000, metadata={"min": 1})
    """RoPE's base period (--rotary-base)."""

    use_rope_scaling: bool = False
    """Llama 3.1's RoPE scaling (--use-rope-scaling)."""

    rope_scaling_factor: float = field(default=8.0, metadata={"above": 0})
    """Its factor (--rope-scaling-factor)."""

    normalization: str = "LayerNorm"
    """LayerNorm or RMSNorm (--normalization)."""

    norm_epsilon: float = field(default=1e-05, metadata={"above": 0})
    """The norms' epsilon (--norm-epsilon; TransformerConfig.layernorm_epsilon)."""

    swiglu: bool = False
    """SwiGLU MLP instead of GeLU (--swiglu)."""

    disable_bias_linear: bool = False
    """No biases in the transformer's linear layers (--disable-bias-linear)."""

    init_method_std: float = field(default=0.02, metadata={"above": 0})
    """Standard deviation of the weights' initialisation (--init-method-std)."""

    hidden_dropout: float = field(default=0.1, metadata={"min": 0, "max": 1})
    """Dropout after attention and MLP (--hidden-dropout)."""

    attention_dropout: float = field(default=0.1, metadata={"min": 0, "max": 1})
    """Dropout of the attention probabilities (--attention-dropout)."""

    transformer_impl: str = "auto"
    """Layer spec: auto, local or transformer_engine (--transformer-impl)."""

    linear_cross_entropy_chunk_size: Optional[int] = field(default=None, metadata={"min": 1})
    """Tokens per chunk of --cross-entropy-fusion-impl linear (--linear-cross-entropy-chunk-size); None = the
    device's default."""

    # ---------------------------------------------------------------- precision
    bf16: bool = False
    """Train in bfloat16 (--bf16)."""

    fp16: bool = False
    """Train in float16 with loss scaling (--fp16)."""

    params_dtype_name: Optional[str] = None
    """The parameters' torch dtype name: derived from --bf16 / --fp16 (None here: derived on construction)."""

    fp8_format: Optional[str] = None
    """FP8 format for Transformer Engine layers (--fp8-format); None = no FP8."""

    fp8_recipe: str = "delayed"
    """FP8 scaling recipe (--fp8-recipe)."""

    fp8_margin: int = 0
    """Margin of the FP8 scaling factor (--fp8-margin)."""

    fp8_amax_history_len: int = 1
    """Length of the FP8 amax history (--fp8-amax-history-len)."""

    fp8_amax_compute_algo: str = "most_recent"
    """How the FP8 amax is chosen from its history: most_recent or max (--fp8-amax-compute-algo)."""

    fp8_param_gather: bool = False
    """Keep the parameters in FP8 and all-gather them in FP8 (--fp8-param-gather; TransformerConfig.fp8_param)."""

    # ---------------------------------------------------------------- loss
    cross_entropy_loss_fusion: bool = False
    """Fused cross-entropy loss (--cross-entropy-loss-fusion)."""

    cross_entropy_fusion_impl: str = "native"
    """The fused cross-entropy implementation (--cross-entropy-fusion-impl)."""

    calculate_per_token_loss: bool = False
    """Average the loss over all tokens of the global batch rather than per micro-batch
    (--calculate-per-token-loss)."""

    # ---------------------------------------------------------------- recomputation, sequence parallelism
    recompute_granularity: Optional[str] = None
    """Activation recomputation: full or selective (--recompute-granularity, or --recompute-activations)."""

    recompute_method: Optional[str] = None
    """Full recomputation's layer grouping: uniform or block (--recompute-method)."""

    recompute_num_layers: Optional[int] = field(default=None, metadata={"min": 1})
    """Layers per recomputed group (--recompute-num-layers)."""

    recompute_modules: Optional[List[str]] = None
    """The parts selective recomputation recomputes (--recompute-modules); None = megatron-core's (core_attn)."""

    sequence_parallel: bool = False
    """Split the norms' and dropouts' activations over the tensor-parallel ranks (--sequence-parallel)."""

    # ---------------------------------------------------------------- TransformerConfig switches
    layernorm_zero_centered_gamma: bool = False
    """Zero-centred norm weights (--apply-layernorm-1p)."""

    attention_softmax_in_fp32: bool = False
    """Attention masking and softmax in float32 (--attention-softmax-in-fp32)."""

    masked_softmax_fusion: Optional[bool] = None
    """Fused masked softmax (--no-masked-softmax-fusion turns it off); None = where the kernel is present."""

    bias_dropout_fusion: Optional[bool] = None
    """Fused bias + dropout (--no-bias-dropout-fusion turns it off); None = where the kernel is present."""

    apply_rope_fusion: Optional[bool] = None
    """Fused RoPE (--no-rope-fusion turns it off); None = where the kernel is present."""

    gradient_accumulation_fusion: Optional[bool] = None
    """Weight-gradient accumulation fused into the GEMMs (--no-gradient-accumulation-fusion turns it off);
    None = where the kernel is present."""

    disable_bf16_reduced_precision_matmul: bool = False
    """No reduced-precision reductions in bfloat16 matmuls (--disable-bf16-reduced-precision-matmul)."""

    qk_layernorm: bool = False
    """A norm over each head's queries and keys before attention (--qk-layernorm; the spec's norm)."""

    use_cpu_initialization: Optional[bool] = None
    """Initialise the weights on the CPU, then move them to the device (--use-cpu-initialization); None =
    megatron-core's default (on the device), the CPU where there is no GPU."""

    attention_backend: str = "auto"
    """The attention kernel: flash, fused, unfused, local or auto (--attention-backend)."""

    bias_gelu_fusion: Optional[bool] = None
    """Fused bias + GeLU (--no-bias-gelu-fusion turns it off); None = where the kernel is present."""

    bias_swiglu_fusion: Optional[bool] = None
    """Fused bias + SwiGLU (--no-bias-swiglu-fusion turns it off); None = where the kernel is present."""

    # ---------------------------------------------------------------- mixture of experts, MTP
    num_experts: Optional[int] = field(default=None, metadata={"min": 1})
    """Experts per MoE layer (--num-experts; TransformerConfig.num_moe_experts); None = a dense model."""

    moe_ffn_hidden_size: Optional[int] = field(default=None, metadata={"min": 1})
    """An expert's MLP width (--moe-ffn-hidden-size); None = --ffn-hidden-size."""

    moe_layer_freq: Union[int, List[int]] = 1
    """Every N-th layer is an MoE layer, or a 0/1 pattern per layer (--moe-layer-freq)."""

    moe_router_topk: int = field(default=2, metadata={"min": 1})
    """Experts each token is routed to (--moe-router-topk)."""

    moe_router_load_balancing_type: str = "aux_loss"
    """The router's load balancing (--moe-router-load-balancing-type)."""

    moe_aux_loss_coeff: float = 0.0
    """Scale of the load-balancing loss (--moe-aux-loss-coeff)."""

    moe_z_loss_coeff: Optional[float] = None
    """Scale of the router's z-loss (--moe-z-loss-coeff); None = none."""

    moe_token_dispatcher_type: str = "allgather"
    """How tokens reach the experts' ranks: allgather or alltoall (--moe-token-dispatcher-type)."""

    moe_router_dtype: Optional[str] = None
    """The router's dtype: fp32 or fp64 (--moe-router-dtype); None = the model's."""

    moe_grouped_gemm: bool = False
    """The experts of a rank in one grouped GEMM (--moe-grouped-gemm)."""

    moe_permute_fusion: bool = False
    """Fused token permutation in the dispatcher (--moe-permute-fusion)."""

    moe_per_layer_logging: bool = False
    """Log the MoE losses per layer (--moe-per-layer-logging)."""

    mtp_num_layers: Optional[int] = field(default=None, metadata={"min": 1})
    """Multi-token-prediction layers (--mtp-num-layers); None = none."""

    mtp_loss_scaling_factor: float = 0.1
    """Weight of the multi-token-prediction loss (--mtp-loss-scaling-factor)."""

    def __post_init__(self) -> None:
        derived = "bfloat16" if self.bf16 else ("float16" if self.fp16 else "float32")
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 are both set; choose one")
        if self.params_dtype_name is None:
            object.__setattr__(self, "params_dtype_name", derived)  # frozen: derived once, here
        elif self.params_dtype_name != derived:
            raise ConfigError(f"params_dtype_name {self.params_dtype_name!r} contradicts "
                              f"{'--bf16' if self.bf16 else '--fp16' if self.fp16 else 'fp32 (no --bf16/--fp16)'}: "
                              f"the parameters are {derived}")

    @property
    def params_dtype(self):
        """The parameters' torch dtype (from --bf16 / --fp16)."""
        import torch

        return getattr(torch, self.params_dtype_name)

