"""albert: a V x e table, then a linear e -> D (``parallel.arms.AlbertEmbedding``).

Parameters V*e + e*D + D. Matching: e = the integer nearest to (P - D) / (V + D) (at least 1). Its
granularity is V + D parameters, so the match is within 2% only when (V + D) / 2 <= 2% of P; otherwise
(large V, small D) no albert width is within 2%, and matching raises ``ConfigError`` asking for an
explicit --albert-dim. FLOPs per token: 2 e D.
"""

from __future__ import annotations

from typing import Any, Dict

from megatron_lev.lev.config import ConfigError, LEVConfig, lev_param_count
from megatron_lev.parallel.arms import AlbertEmbedding

from .base import MATCH_TOLERANCE, InputArm, checked_match, closest_width


def albert_params(vocab_size: int, hidden_size: int, e: int) -> int:
    return vocab_size * e + e * hidden_size + hidden_size


class AlbertArm(InputArm):
    name = "albert"
    settings = ("albert_dim",)
    matched = True

    def build(self, *, config, vocab_size, model_config, reduce_scatter_embeddings=False, tp_group=None):
        w = self.widths(model_config, config.hidden_size)
        return AlbertEmbedding(config=config, vocab_size=vocab_size, albert_dim=w["albert_dim"],
                               reduce_scatter_embeddings=reduce_scatter_embeddings, tp_group=tp_group)

    def widths(self, model_config, hidden_size: int) -> Dict[str, int]:
        if model_config.albert_dim is not None:
            return {"albert_dim": model_config.albert_dim}
        lev = model_config.lev
        P = lev_param_count(model_config.vocab_size, hidden_size, lev)
        return {"albert_dim": self.match(model_config.vocab_size, hidden_size, lev, P)["albert_dim"]}

    def match(self, vocab_size: int, hidden_size: int, lev: LEVConfig, budget: int,
              tolerance: float = MATCH_TOLERANCE) -> Dict[str, Any]:
        V, D, P = vocab_size, hidden_size, budget
        if albert_params(V, D, 1) > P * (1 + tolerance):
            raise ConfigError(
                f"albert: even --albert-dim 1 needs {albert_params(V, D, 1):,} parameters, above LEV's "
                f"{P:,} for V={V}, D={D}; parameter matching is impossible, give --albert-dim explicitly"
            )
        e = closest_width((P - D) / (V + D), lambda x: albert_params(V, D, x), P)
        return {"albert_dim": e, **checked_match(self.name, albert_params(V, D, e), P, tolerance, "--albert-dim", V, D)}

    def input_params(self, model_config, hidden_size: int) -> int:
        return albert_params(model_config.vocab_size, hidden_size, self.widths(model_config, hidden_size)["albert_dim"])

    def forward_flops_per_token(self, model_config, hidden_size: int) -> float:
        return 2.0 * self.widths(model_config, hidden_size)["albert_dim"] * hidden_size
