"""factored_mlp: LEV's seed z(i) = sum_m C_m[i_m] (k codebooks), then an MLP d_s -> m -> D
(``parallel.arms.FactoredMLPEmbedding``).

Parameters k*b*d_s + (d_s*m + m) + (m*D + D). Matching: the codebooks are fixed by the LEV knobs;
m = the integer nearest to (P - k b d_s - D) / (d_s + 1 + D). FLOPs per token: 2 (d_s m + m D).
"""

from __future__ import annotations

from typing import Any, Dict

from megatron_lev.lev.config import ConfigError, LEVConfig, lev_param_count
from megatron_lev.parallel.arms import FactoredMLPEmbedding

from .base import MATCH_TOLERANCE, InputArm, checked_match, closest_width


def factored_mlp_params(vocab_size: int, hidden_size: int, lev: LEVConfig, m: int) -> int:
    b = lev.resolved_base(vocab_size)
    ds = lev.seed_dim
    return lev.num_digits * b * ds + ds * m + m + m * hidden_size + hidden_size


class FactoredMLPArm(InputArm):
    name = "factored_mlp"
    settings = ("mlp_hidden",)
    matched = True

    def build(self, *, config, vocab_size, model_config, reduce_scatter_embeddings=False, tp_group=None):
        w = self.widths(model_config, config.hidden_size)
        return FactoredMLPEmbedding(config=config, vocab_size=vocab_size, lev_config=model_config.lev,
                                    mlp_hidden=w["factored_mlp_hidden"],
                                    reduce_scatter_embeddings=reduce_scatter_embeddings, tp_group=tp_group,
                                    init_seed=model_config.init_seed)

    def widths(self, model_config, hidden_size: int) -> Dict[str, int]:
        mc = model_config
        if mc.mlp_hidden is not None:
            return {"factored_mlp_hidden": mc.mlp_hidden}
        P = lev_param_count(mc.vocab_size, hidden_size, mc.lev)
        return {"factored_mlp_hidden": self.match(mc.vocab_size, hidden_size, mc.lev, P)["factored_mlp_hidden"]}

    def match(self, vocab_size: int, hidden_size: int, lev: LEVConfig, budget: int,
              tolerance: float = MATCH_TOLERANCE) -> Dict[str, Any]:
        V, D, P = vocab_size, hidden_size, budget
        ds = lev.seed_dim
        fixed = lev.num_digits * lev.resolved_base(V) * ds + D
        if P - fixed < ds + 1 + D:
            raise ConfigError(f"factored_mlp: LEV's budget {P:,} leaves no room for the MLP; give --mlp-hidden")
        m = closest_width((P - fixed) / (ds + 1 + D), lambda x: factored_mlp_params(V, D, lev, x), P)
        return {"factored_mlp_hidden": m,
                **checked_match(self.name, factored_mlp_params(V, D, lev, m), P, tolerance, "--mlp-hidden", V, D)}

    def input_params(self, model_config, hidden_size: int) -> int:
        m = self.widths(model_config, hidden_size)["factored_mlp_hidden"]
        return factored_mlp_params(model_config.vocab_size, hidden_size, model_config.lev, m)

    def forward_flops_per_token(self, model_config, hidden_size: int) -> float:
        m = self.widths(model_config, hidden_size)["factored_mlp_hidden"]
        return 2.0 * (model_config.lev.seed_dim * m + m * hidden_size)
