"""Model-shape flags under Megatron-LM's names (``--num-layers``, ``--swiglu``, ...); the
``LevModelConfig`` fields that are flags of their own name (``--position-embedding-type``,
``--normalization``, ``--rotary-base``, ``--transformer-impl``) are generated from that dataclass.
``models.factory.lev_model_config`` reads them back (typed, from ``config.ModelRunConfig``). Each flag
takes its default from one field: the ``LevModelConfig`` field (Megatron-LM's default where the flag is
Megatron-LM's: learned positions, LayerNorm, GeLU, biases), or megatron-core's ``TransformerConfig`` field
the flag sets (``--norm-epsilon``, ``--init-method-std``, the dropouts); ``config.ModelRunConfig``'s
field of the flag's name states it again, held equal by ``tests/training/test_defaults.py``, and is what a
saved ``config.yaml`` without the key reads (``RunConfig.from_saved_args``).

The attention, norm and fusion flags that are megatron-core ``TransformerConfig`` fields are generated
from the installed ``TransformerConfig`` (type, choices, help; a flag whose field the installed release
lacks is not offered); their destinations are the field names, and ``models.factory`` passes every
one that is set to the ``TransformerConfig`` (``models.config.TRANSFORMER_FLAG_FIELDS``)."""

from __future__ import annotations

from typing import Any, Dict

from megatron.core.transformer import TransformerConfig

from megatron_lev.config_flags import POSITIVE_FLOAT, POSITIVE_INT, PROBABILITY, add_config_flags, add_switch_flags, \
    field_flag
from megatron_lev.lev.config import ConfigError
from megatron_lev.models.arms import find_arm
from megatron_lev.models.config import LevModelConfig, check_lev_basis, check_rope_scaling, model_field_default, \
    use_transformer_engine

# LevModelConfig fields that are model-shape flags of their own name (their defaults, Megatron-LM's, are
# the fields'); the other shape fields come from Megatron-LM's flags (--seq-length, --swiglu,
# --disable-bias-linear, ...) in models.factory.lev_model_config.
_MODEL_SHAPE_FLAG_FIELDS = ("position_embedding_type", "rotary_base", "rotary_percent", "rope_scaling_factor",
                            "normalization", "transformer_impl")

# (Megatron-LM flag, TransformerConfig field, the value the flag sets). The fusions default to None:
# on where CUDA and the kernel are present (models.config.fusion_defaults), the flag turns them off.
# Megatron-LM's --no-bias-gelu-fusion / --no-bias-swiglu-fusion both set bias_activation_fusion, for
# the activation in use: they are hand-written below.
TRANSFORMER_SWITCHES = (
    ("--apply-layernorm-1p", "layernorm_zero_centered_gamma", True),
    ("--attention-softmax-in-fp32", "attention_softmax_in_fp32", True),
    ("--no-masked-softmax-fusion", "masked_softmax_fusion", False),
    ("--no-bias-dropout-fusion", "bias_dropout_fusion", False),
    ("--no-rope-fusion", "apply_rope_fusion", False),
    ("--rope-fusion", "apply_rope_fusion", True),  # not Megatron-LM's: on where CUDA is not (models.rope)
    ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion", False),
    ("--disable-bf16-reduced-precision-matmul", "disable_bf16_reduced_precision_matmul", True),
    ("--qk-layernorm", "qk_layernorm", True),
    ("--use-cpu-initialization", "use_cpu_initialization", True),
)
# megatron-core's selective-recompute modules (TransformerConfig.recompute_modules).
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
# Those this fork's models cannot honour, and why.
_RECOMPUTE_REFUSED = {"mla_up_proj": "multi-latent attention is not implemented here",
                      "shared_experts": "shared experts are not implemented here (no --moe-shared-expert-* flags)"}

# TransformerConfig fields that are flags of their own name (--attention-backend, --fp8-margin, ...).
TRANSFORMER_VALUE_FIELDS = ("attention_backend", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo")
# The ranges of the numeric ones (TransformerConfig has no range metadata).
TRANSFORMER_RANGES = {"fp8_margin": {"min": 0}, "fp8_amax_history_len": {"min": 1}}
# Megatron-LM's command-line defaults where they differ from TransformerConfig's (attention softmax in
# the input dtype unless asked; TransformerConfig says True but only its unfused attention reads it).
_SWITCH_DEFAULTS = {"layernorm_zero_centered_gamma": False, "attention_softmax_in_fp32": False,
                    "masked_softmax_fusion": None, "bias_dropout_fusion": None, "apply_rope_fusion": None,
                    "gradient_accumulation_fusion": None, "qk_layernorm": False,
                    # None: megatron-core's on a GPU, the CPU where there is none (models.config)
                    "use_cpu_initialization": None}


def _transformer_default(name: str):
    """A TransformerConfig field's default: Megatron-LM generates --norm-epsilon, --init-method-std and the
    dropouts from these fields, so theirs are these."""
    return TransformerConfig.__dataclass_fields__[name].default


def add_model_flags(p) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=POSITIVE_INT, default=None)
    g.add_argument("--hidden-size", type=POSITIVE_INT, default=None)
    g.add_argument("--ffn-hidden-size", type=POSITIVE_INT, default=None,
                   help="default 4*hidden, or int(8*hidden/3) rounded down to a multiple of 64 with --swiglu")
    g.add_argument("--num-attention-heads", type=POSITIVE_INT, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=POSITIVE_INT, default=None)
    g.add_argument("--kv-channels", type=POSITIVE_INT, default=None)
    g.add_argument("--seq-length", type=POSITIVE_INT, default=None)
    g.add_argument("--max-position-embeddings", type=POSITIVE_INT, default=None, help="default: --seq-length")
    g.add_argument("--rope-type", default="rope", metavar="rope",
                   help="rotary embedding type (Megatron-LM's; YaRN is refused: multi-latent attention only)")
    add_config_flags(g, LevModelConfig, field_flag, _MODEL_SHAPE_FLAG_FIELDS)
    add_switch_flags(g, LevModelConfig, [("--use-rope-scaling", "use_rope_scaling", True)])
    g.add_argument("--norm-epsilon", type=POSITIVE_FLOAT, default=_transformer_default("layernorm_epsilon"))
    g.add_argument("--swiglu", action="store_true", default=model_field_default("activation") == "swiglu",
                   help="SwiGLU MLP (default: GeLU, as Megatron-LM)")
    g.add_argument("--disable-bias-linear", action="store_true", default=not model_field_default("add_bias_linear"),
                   help="no biases in the transformer's linear layers (default: biases, as Megatron-LM)")
    g.add_argument("--init-method-std", type=POSITIVE_FLOAT, default=_transformer_default("init_method_std"))
    g.add_argument("--hidden-dropout", type=PROBABILITY, default=_transformer_default("hidden_dropout"))
    g.add_argument("--attention-dropout", type=PROBABILITY, default=_transformer_default("attention_dropout"))
    g.add_argument("--make-vocab-size-divisible-by", type=POSITIVE_INT, default=128)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="Megatron's flag; the same as --input-embedding untied")
    g.add_argument("--recompute-activations", action="store_true",
                   help="recompute the core attention in the backward pass (= --recompute-granularity selective)")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=POSITIVE_INT, default=None)
    g.add_argument("--recompute-modules", nargs="*", default=None, choices=RECOMPUTE_MODULES,
                   help="with --recompute-granularity selective: the parts recomputed in the backward pass "
                        "(megatron-core's; default core_attn): core_attn, mlp (with --disable-bias-linear), layernorm "
                        "(Transformer Engine), and with "
                        "--num-experts moe (the MoE layer) or moe_act (with --moe-grouped-gemm)")

    g = p.add_argument_group("attention, norms and fusions (megatron-core TransformerConfig fields)")
    add_switch_flags(g, TransformerConfig, TRANSFORMER_SWITCHES, defaults=_SWITCH_DEFAULTS)
    add_config_flags(g, TransformerConfig, field_flag, [n for n in TRANSFORMER_VALUE_FIELDS if n.startswith("attn")
                                                        or n.startswith("attention")])
    g.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false", default=None,
                   help="turn off the fused bias + GeLU (bias_activation_fusion with GeLU)")
    g.add_argument("--no-bias-swiglu-fusion", dest="bias_swiglu_fusion", action="store_false", default=None,
                   help="turn off the fused bias + SwiGLU (bias_activation_fusion with --swiglu)")


def check_model_flags(args) -> None:
    """--recompute-activations (Megatron-LM's selective recompute) and --attention-backend against the
    attention this run builds; --use-rope-scaling against the positions."""
    check_rope_scaling(args.position_embedding_type, args.use_rope_scaling, args.rope_scaling_factor)
    if args.recompute_activations:
        if args.recompute_granularity not in (None, "selective"):
            raise ConfigError(f"--recompute-activations is --recompute-granularity selective; it contradicts "
                              f"--recompute-granularity {args.recompute_granularity}")
        args.recompute_granularity = "selective"
    _check_recompute_modules(args)
    arm = find_arm(args.input_embedding)  # None until _check_input_arm makes it tied or untied
    if arm is not None and arm.lev_layer:
        check_lev_basis(args.lev_basis)
    backend = getattr(args, "attention_backend", "auto")
    try:
        te = use_transformer_engine(args.transformer_impl)
    except ConfigError:
        return  # the model build refuses the impl in its own words
    if te and backend == "local":
        raise ConfigError("--attention-backend local is megatron's local attention: use --transformer-impl local")
    if not te and backend == "fused":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--attention-backend fused: torch's fused attention kernels (memory-efficient, cuDNN) "
                              "need CUDA; on CPU use auto, flash or unfused")


def _check_recompute_modules(args) -> None:
    """--recompute-modules against the granularity and the model (megatron-core reads them only with selective
    recompute, and refuses moe_act without the grouped GEMM)."""
    modules = args.recompute_modules
    if modules is None:
        return
    if args.recompute_granularity != "selective":
        raise ConfigError(f"--recompute-modules {' '.join(modules)} needs --recompute-granularity selective (or "
                          "--recompute-activations)")
    for name in modules:
        if name in _RECOMPUTE_REFUSED:
            raise ConfigError(f"--recompute-modules {name}: {_RECOMPUTE_REFUSED[name]}")
        if name in ("moe", "moe_act") and args.num_experts is None:
            raise ConfigError(f"--recompute-modules {name} needs an MoE model (--num-experts)")
        if name == "mlp" and not args.disable_bias_linear:
            raise ConfigError("--recompute-modules mlp needs --disable-bias-linear (megatron-core's MLP recompute "
                              "hands the output bias through its checkpoint, whose backward then never ends)")
        if name == "layernorm" and not _te_spec(args):
            raise ConfigError("--recompute-modules layernorm needs the Transformer Engine layer spec (megatron-core's "
                              "norm recompute reads Transformer Engine's FP8 state); use core_attn or mlp here")
        if name == "moe_act" and not args.moe_grouped_gemm:
            raise ConfigError("--recompute-modules moe_act needs --moe-grouped-gemm (megatron-core recomputes the "
                              "experts' activation in the grouped GEMM only)")


def _te_spec(args) -> bool:
    try:
        return use_transformer_engine(args.transformer_impl)
    except ConfigError:
        return False
