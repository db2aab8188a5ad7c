"""The GPT model on megatron-core with a choice of input representation (tied, untied, albert, flat_mlp,
factored_mlp, lev: the input-arm registry, ``models.arms``), its layer specs, parameter matching and parameter
report."""

from .config import ConfigError, LevModelConfig, build_transformer_config
from .gpt import LevGPTModel, build_gpt_model, lev_modules, materialize_input_embedding
from .params import format_parameter_breakdown, matched_widths, parameter_breakdown
from .specs import get_block_spec, get_layer_spec

__all__ = [
    "LevModelConfig",
    "ConfigError",
    "LevGPTModel",
    "build_gpt_model",
    "build_transformer_config",
    "get_layer_spec",
    "get_block_spec",
    "parameter_breakdown",
    "format_parameter_breakdown",
    "matched_widths",
    "lev_modules",
    "materialize_input_embedding",
]
