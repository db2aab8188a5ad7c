"""flat_mlp: a V x e table, then an MLP e -> m -> D with GELU (``parallel.arms.FlatMLPEmbedding``).

Parameters V*e + (e*m + m) + (m*D + D). Matching: half of the budget to the table, e = max(1, round(P / (2 V)))
(lowered until the MLP gets at least one hidden unit), then m = the integer nearest to (P - V e - D) / (e + 1 + D);
m has a granularity of about D parameters, so the match is tight whenever e fits. If V alone (e = 1) exceeds the
budget, flat_mlp cannot be matched: ``ConfigError``. FLOPs per token: 2 (e m + m D).
"""

from __future__ import annotations

from typing import Any, Dict

from megatron_lev.lev.config import ConfigError, LEVConfig, lev_param_count
from megatron_lev.parallel.arms import FlatMLPEmbedding

from .base import MATCH_TOLERANCE, InputArm, checked_match, closest_width


def flat_mlp_params(vocab_size: int, hidden_size: int, e: int, m: int) -> int:
    return vocab_size * e + e * m + m + m * hidden_size + hidden_size


def match_flat_mlp_hidden(vocab_size: int, hidden_size: int, lev: LEVConfig, e: int) -> int:
    """m for a given e: the MLP takes what the V x e table leaves of LEV's budget."""
    V, D = vocab_size, hidden_size
    P = lev_param_count(V, D, lev)
    rest = P - V * e - D
    if rest < e + 1 + D:
        raise ConfigError(
            f"--flat-mlp-dim {e}: the V x e table ({V * e:,} parameters) leaves no room for the MLP "
            f"within the LEV budget of {P:,}; lower --flat-mlp-dim or give --mlp-hidden explicitly"
        )
    return closest_width(rest / (e + 1 + D), lambda m: flat_mlp_params(V, D, e, m), P)


class FlatMLPArm(InputArm):
    name = "flat_mlp"
    settings = ("flat_mlp_dim", "mlp_hidden")
    matched = True

    def build(self, *, config, vocab_size, model_config, reduce_scatter_embeddings=False, tp_group=None):
        w = self.widths(model_config, config.hidden_size)
        return FlatMLPEmbedding(config=config, vocab_size=vocab_size, table_dim=w["flat_mlp_dim"],
                                mlp_hidden=w["mlp_hidden"], reduce_scatter_embeddings=reduce_scatter_embeddings,
                                tp_group=tp_group)

    def widths(self, model_config, hidden_size: int) -> Dict[str, int]:
        mc, V = model_config, model_config.vocab_size
        matched = {}
        if mc.flat_mlp_dim is None or mc.mlp_hidden is None:
            matched = self.match(V, hidden_size, mc.lev, lev_param_count(V, hidden_size, mc.lev))
        if mc.flat_mlp_dim is not None and mc.mlp_hidden is None:
            # e given, m matched to the remaining budget.
            return {"flat_mlp_dim": mc.flat_mlp_dim,
                    "mlp_hidden": match_flat_mlp_hidden(V, hidden_size, mc.lev, mc.flat_mlp_dim)}
        return {"flat_mlp_dim": mc.flat_mlp_dim if mc.flat_mlp_dim is not None else matched["flat_mlp_dim"],
                "mlp_hidden": mc.mlp_hidden if mc.mlp_hidden is not None else matched["flat_mlp_hidden"]}

    def match(self, vocab_size: int, hidden_size: int, lev: LEVConfig, budget: int,
              tolerance: float = MATCH_TOLERANCE) -> Dict[str, Any]:
        V, D, P = vocab_size, hidden_size, budget
        e = max(1, round(P / (2 * V)))
        while e > 1 and P - V * e - D < e + 1 + D:
            e -= 1
        if P - V * e - D < e + 1 + D:
            raise ConfigError(
                f"flat_mlp: a V x 1 table ({V:,} parameters) already exhausts LEV's {P:,} for V={V}, "
                f"D={D}; parameter matching is impossible, give --flat-mlp-dim and --mlp-hidden explicitly"
            )
        m = match_flat_mlp_hidden(V, D, lev, e)
        return {"flat_mlp_dim": e, "flat_mlp_hidden": m,
                **checked_match(self.name, flat_mlp_params(V, D, e, m), P, tolerance, "--flat-mlp-dim/--mlp-hidden",
                                V, D)}

    def input_params(self, model_config, hidden_size: int) -> int:
        w = self.widths(model_config, hidden_size)
        return flat_mlp_params(model_config.vocab_size, hidden_size, w["flat_mlp_dim"], w["mlp_hidden"])

    def forward_flops_per_token(self, model_config, hidden_size: int) -> float:
        w = self.widths(model_config, hidden_size)
        e, m = w["flat_mlp_dim"], w["mlp_hidden"]
        return 2.0 * (e * m + m * hidden_size)
