"""The LEV input embedding in plain torch (no Megatron imports): config, maths, modules.

See ``shared/spec/lev.md``. ``layer`` documents the design choices.
"""

from .config import BASIS_KINDS, COMPUTE_MODES, ConfigError, LEVConfig, lev_param_count, smallest_base
from .functional import (
    bspline_basis_dense,
    bspline_basis_sparse,
    compute_dtype,
    separable_product,
    separable_product_reference,
    token_digits,
)
from .layer import (
    LN_EPS,
    NO_WEIGHT_DECAY_PARAMS,
    LEVEmbedding,
    LEVHeads,
    LEVSeed,
    ComputeModes,
    apply_lev_init,
    check_token_ids,
    compute_table,
    lev_init_generator,
    lev_init_sample_ids,
    lev_init_scale,
    lev_init_statistics,
    initialize_lev_parameters,
    lev_weight_decay_groups,
    no_weight_decay,
    table_backward,
)

__all__ = [
    "BASIS_KINDS",
    "COMPUTE_MODES",
    "ConfigError",
    "LEVConfig",
    "lev_param_count",
    "smallest_base",
    "bspline_basis_dense",
    "bspline_basis_sparse",
    "compute_dtype",
    "separable_product",
    "separable_product_reference",
    "token_digits",
    "LN_EPS",
    "NO_WEIGHT_DECAY_PARAMS",
    "LEVEmbedding",
    "LEVHeads",
    "LEVSeed",
    "ComputeModes",
    "apply_lev_init",
    "check_token_ids",
    "compute_table",
    "lev_init_generator",
    "lev_init_sample_ids",
    "lev_init_scale",
    "lev_init_statistics",
    "initialize_lev_parameters",
    "lev_weight_decay_groups",
    "no_weight_decay",
    "table_backward",
]
