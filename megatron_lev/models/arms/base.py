"""``InputArm``: what the rest of megatron_lev knows of one input representation (the registry's entries)."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Tuple

from megatron_lev.lev.config import ConfigError, LEVConfig

MATCH_TOLERANCE = 0.02


class InputArm:
    """One input representation: ``input_ids [b, s] -> [s, b, D]`` before the transformer.

    Subclass it, set the class attributes and override the methods the arm needs; the defaults describe an
    arm with no settings, nothing matched, no FLOPs of its own and an untied output head. ``model_config`` is a
    ``LevModelConfig``, ``config`` megatron-core's ``TransformerConfig``, ``hidden_size`` D.
    """

    name: str = ""
    """The value of --input-embedding (and of ``input_embedding`` in config.yaml)."""

    settings: Tuple[str, ...] = ()
    """``LevModelConfig`` fields this arm reads (its flags; saved in config.yaml; a resumed run and a
    config.yaml must agree on them, ``checkpoint.STRUCTURE_ARGS``)."""

    ties_output_head: bool = False
    """The input table is the output head's weight (megatron's ``share_embeddings_and_output_weights``)."""

    megatron_embedding: bool = False
    """The input layer is megatron-core's own ``LanguageModelEmbedding`` (``build`` is never called); saved
    under ``embedding.word_embeddings.*``. Otherwise ``build``'s module is ``InputArmEmbedding.arm``, saved
    under ``embedding.arm.*`` with the module's own parameter names."""

    matched: bool = False
    """Its widths are parameter-matched to LEV's input side (``match``); the LEV settings are validated at
    TP=1 for it."""

    lev_layer: bool = False
    """It is the LEV layer: its heads split over TP, --lev-basis and --lev-compute-mode apply."""

    def build(self, *, config, vocab_size: int, model_config, reduce_scatter_embeddings: bool = False,
              tp_group=None):
        """The input module: ``forward(input_ids [b, s])`` -> ``[s, b, D]`` identical on every TP rank (or, with
        ``reduce_scatter_embeddings``, this rank's sequence shard ``[s/t, b, D]``); ``materialize()`` -> the dense
        ``[V, D]`` table; ``sharded_state_dict`` for checkpoints (``parallel.arms.TableArm`` has all three)."""
        raise NotImplementedError(f"input arm {self.name!r} builds no module of its own")

    def widths(self, model_config, hidden_size: int) -> Dict[str, int]:
        """The arm's widths: explicit settings where given, else matched (the parameter report prints them)."""
        return {}

    def match(self, vocab_size: int, hidden_size: int, lev: LEVConfig, budget: int,
              tolerance: float = MATCH_TOLERANCE) -> Dict[str, Any]:
        """Widths whose input-side count is within ``tolerance`` of ``budget`` (LEV's), with ``<name>_params``
        and ``<name>_rel_error`` (``models.params.matched_widths``); ``ConfigError`` when none is."""
        raise NotImplementedError(f"input arm {self.name!r} is not parameter-matched")

    def input_params(self, model_config, hidden_size: int) -> int:
        """Parameters of the input side (position embeddings excluded; for a tied arm the shared table)."""
        raise NotImplementedError(f"input arm {self.name!r} does not count its input-side parameters")

    def forward_flops_per_token(self, model_config, hidden_size: int) -> float:
        """Forward FLOPs of the input side per token (a multiply-add is 2; a row gather is 0)."""
        return 0.0

    def forward_flops_per_iteration(self, model_config, hidden_size: int, *, tokens: int,
                                    data_parallel_size: Callable[[], int]) -> float:
        """Forward FLOPs of one optimizer step that do not scale with the tokens one by one (LEV's table mode),
        or that an arm prefers to count per step; ``data_parallel_size()`` is asked only where needed."""
        return 0.0

    def __repr__(self) -> str:
        return f"<input arm {self.name}>"


def closest_width(width_estimate: float, count: Callable[[int], int], budget: int) -> int:
    """floor or ceil of ``width_estimate`` (at least 1), whichever ``count`` brings nearer to ``budget``."""
    cands = {max(1, int(math.floor(width_estimate))), max(1, int(math.ceil(width_estimate)))}
    return min(sorted(cands), key=lambda x: abs(count(x) - budget))


def checked_match(name: str, count: int, budget: int, tolerance: float, flag: str, vocab_size: int,
                  hidden_size: int) -> Dict[str, Any]:
    """``<name>_params`` and ``<name>_rel_error`` of a matched width; ``ConfigError`` naming ``flag`` when the
    error exceeds ``tolerance``."""
    err = (count - budget) / budget
    if abs(err) > tolerance:
        raise ConfigError(
            f"{name}: no width matches LEV's {budget:,} input-side parameters within {tolerance:.0%} "
            f"(closest {count:,}, {err:+.1%}) for V={vocab_size}, D={hidden_size}; give {flag} explicitly"
        )
    return {f"{name}_params": count, f"{name}_rel_error": err}
