"""Weight-decay rule for megatron-core's optimizer with LEV parameters.

Megatron's default skips decay for 1-D parameters and ``*.bias``. LEV keeps its per-head LayerNorm
gamma/beta and projection bias as 2-D [h, d_s] tensors (head dimension first, for TP sharding), so that
rule would decay them. The rule here adds LEV's names: Delta (never S, which is not stored), A, W and
the codebooks are decayed; LayerNorm parameters, biases and the offset c are not.
"""

from __future__ import annotations

from typing import Dict

from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer import ParamGroupOverride, ParamKey, ParamWithNamePredicate

from megatron_lev.lev import no_weight_decay as lev_no_weight_decay

__all__ = ["weight_decay_overrides", "is_no_weight_decay"]

_LEV_CONTAINERS = (".heads.", "offset")


def is_no_weight_decay(name: str, param) -> bool:
    """True when ``param`` (named as in ``model.named_parameters()``) must not be weight-decayed."""
    if len(param.shape) == 1 or name.endswith(".bias"):
        return True
    # LEV's own parameters: decide by their name inside the LEV module.
    if any(c in name for c in _LEV_CONTAINERS) and lev_no_weight_decay(name):
        return True
    return False


def _marked_decoupled(override: ParamGroupOverride) -> ParamGroupOverride:
    """The --decoupled-lr override with ``is_decoupled_lr`` set: megatron-core tells the optimizer's
    param groups apart on a load by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr) alone, and its
    override leaves the flag False, so the decoupled group and the default one look alike there (the
    distributed optimizer gives both the decoupled max/min lr, the others fail on the group sizes)."""
    if "max_lr" in override or "min_lr" in override:
        return ParamGroupOverride(**{**override, "is_decoupled_lr": True})
    return override


def weight_decay_overrides(config: OptimizerConfig) -> Dict[ParamKey, ParamGroupOverride]:
    """``config_overrides`` for ``get_megatron_optimizer``: wd_mult 0 for :func:`is_no_weight_decay`
    parameters, plus Megatron's decoupled-LR override when configured."""
    from megatron.core.optimizer import get_standard_config_overrides

    overrides = {
        key: _marked_decoupled(value) for key, value in get_standard_config_overrides(config).items()
        if "wd_mult" not in value  # replaced by the rule below
    }
    overrides[ParamKey(with_name_predicate=ParamWithNamePredicate(
        name="no_weight_decay", fn=lambda param, name: is_no_weight_decay(name, param)
    ))] = ParamGroupOverride(wd_mult=0.0)
    return overrides
