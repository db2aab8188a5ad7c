"""Model-shape flags under Megatron-LM's names (``--num-layers``, ``--swiglu``, ...); the
``LevModelConfig`` fields that are flags of their own name (``--rotary-base``, ``--transformer-impl``)
are generated from that dataclass. ``checkpoint.build.model_config_from_args`` reads them back."""

from __future__ import annotations

from megatron_lev.config_flags import add_config_flags
from megatron_lev.models.config import NORMALIZATIONS, POSITION_EMBEDDING_TYPES, LevModelConfig

# LevModelConfig fields that are model-shape flags of their own name; the other shape fields come from
# Megatron-LM's flags (--seq-length, --swiglu, --disable-bias-linear, ...) in model_config_from_args.
_MODEL_SHAPE_FLAG_FIELDS = ("rotary_base", "rotary_percent", "transformer_impl")


def field_flag(name: str) -> str:
    """The flag of a config field: ``albert_dim`` -> ``--albert-dim``."""
    return "--" + name.replace("_", "-")


def add_model_flags(p) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="default 4*hidden, or int(8*hidden/3) rounded down to a multiple of 64 with --swiglu")
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    # Megatron-LM's command-line defaults (learned positions, LayerNorm), not LevModelConfig's.
    g.add_argument("--position-embedding-type", default="learned_absolute", choices=POSITION_EMBEDDING_TYPES)
    g.add_argument("--normalization", default="LayerNorm", choices=NORMALIZATIONS)
    add_config_flags(g, LevModelConfig, field_flag, _MODEL_SHAPE_FLAG_FIELDS)
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (default: GeLU, as Megatron-LM)")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="Megatron's flag; the same as --input-embedding untied")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
