"""The input-arm flags (``--input-embedding``, the matched widths of the baselines) and every ``--lev-*``
flag, all generated from the fields of ``LevModelConfig`` and ``LEVConfig``: type, default, choices and
help are written once, on the dataclass."""

from __future__ import annotations

from megatron_lev.config_flags import add_config_flags
from megatron_lev.lev.config import LEVConfig, lev_flag
from megatron_lev.models.arms import arm_settings
from megatron_lev.models.config import LevModelConfig

from .model import field_flag



def add_lev_flags(p) -> None:
    g = p.add_argument_group("input embedding (the paper's arms) and LEV")
    # Default: tied (Megatron's shared embedding/head), or untied with --untie-embeddings-and-output-weights.
    # The LevModelConfig fields that choose the input arm and size it (the registry's arms' settings).
    add_config_flags(g, LevModelConfig, field_flag, ("input_embedding",) + arm_settings(),
                     defaults={"input_embedding": None})
    add_config_flags(g, LEVConfig, lev_flag)
