"""lev: the LEV layer (``parallel.lev_embedding.LEVParallelEmbedding``; the spec's G).

Parameters P_LEV = k b d_s + h (d_s^2 + 3 d_s + d_s kappa r + r D) + D (``lev.config.lev_param_count``), the
budget the matched arms are fitted to. FLOPs: per evaluated id 2 h (d_s^2 + d_s r c + d_s r + r D) with c = 3
non-zero knots (seed projection, spline basis x Delta, the separable product, the head output; spec "Cost");
ids per step: every token in ``token`` mode, at most every token in ``unique`` mode (counted as every token: an
upper bound), V per data-parallel rank in ``table`` mode (every rank builds its own table; its TP ranks split
the heads, so one model replica evaluates each of the V ids once).
"""

from __future__ import annotations

from typing import Callable

from megatron_lev.lev.config import LEVConfig, lev_param_count
from megatron_lev.parallel.lev_embedding import LEVParallelEmbedding

from .base import InputArm


def lev_forward_flops_per_id(lev: LEVConfig, hidden_size: int) -> float:
    """Forward FLOPs of G for one id. The same for every ``lev.basis`` (and whatever ``auto`` resolves to
    on a device, ``LEVConfig.resolved_basis``): model FLOPs count the 3 non-zero knots of a quadratic
    B-spline; the dense basis's kappa - 3 zero products are work of that implementation."""
    h, ds, r, D = lev.num_heads, lev.seed_dim, lev.rank, hidden_size
    active_knots = 3
    return 2.0 * h * (ds * ds + ds * r * active_knots + ds * r + r * D)


class LevArm(InputArm):
    name = "lev"
    lev_layer = True

    def build(self, *, config, vocab_size, model_config, reduce_scatter_embeddings=False, tp_group=None):
        return LEVParallelEmbedding(config=config, lev_config=model_config.lev, vocab_size=vocab_size,
                                    reduce_scatter_embeddings=reduce_scatter_embeddings,
                                    init_seed=model_config.init_seed,
                                    initialize=not model_config.weights_from_checkpoint)

    def input_params(self, model_config, hidden_size: int) -> int:
        return lev_param_count(model_config.vocab_size, hidden_size, model_config.lev)

    def forward_flops_per_iteration(self, model_config, hidden_size: int, *, tokens: int,
                                    data_parallel_size: Callable[[], int]) -> float:
        if model_config.lev.compute_mode == "table":
            ids = model_config.vocab_size * data_parallel_size()
        else:
            ids = tokens
        return ids * lev_forward_flops_per_id(model_config.lev, hidden_size)
