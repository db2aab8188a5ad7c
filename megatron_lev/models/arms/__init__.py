"""The input-arm registry: every input representation --input-embedding can name, one module per arm.

Each arm is an :class:`InputArm` subclass in its own module here, registered by one line in the table at the
bottom of this file. Everything that depends on the arm reads its entry, never its name:

=========================  ==========================================  ===================================
what                       declared by the arm                         read by
=========================  ==========================================  ===================================
the input module           ``build(config=, vocab_size=, model_config=, ``models.embedding.InputArmEmbedding``
                           reduce_scatter_embeddings=, tp_group=)``
megatron's own embedding   ``megatron_embedding``, ``ties_output_head`` ``models.gpt.LevGPTModel``, conversion
parameter count            ``input_params``                            ``models.params.parameter_breakdown``
matching to LEV's count    ``matched``, ``match``, ``widths``          ``models.params.matched_widths``,
                                                                       ``LevModelConfig.resolved_widths``
FLOPs                      ``forward_flops_per_token``,                ``training.flops.flops_per_iteration``
                           ``forward_flops_per_iteration``
flags and saved settings   ``settings`` (``LevModelConfig`` fields)    ``arguments.lev`` (the flags),
                                                                       ``checkpoint.STRUCTURE_ARGS``
LEV's own checks           ``lev_layer``, ``matched``                  ``LevModelConfig.validate``,
                                                                       ``arguments.validate``
checkpoint keys            ``megatron_embedding``: ``embedding.word_embeddings.weight``; otherwise
                           ``embedding.arm.<the built module's parameter names>``
=========================  ==========================================  ===================================

--input-embedding's choices are this registry's names (``arm_names()``, a live view), in registration order.

Adding an input arm
-------------------

1. Write its module: an ``InputArm`` subclass with ``name``, ``build`` (a module with the interface of
   ``parallel.arms.TableArm``: ``forward``, ``materialize``, ``sharded_state_dict``; subclassing
   ``TableArm`` gives a vocab-parallel V x e table and all three) and ``input_params``; override
   ``forward_flops_per_token`` where the arm computes more than a row gather, and set the flags above where
   they hold. A built-in arm goes in this package (``models/arms/<name>.py``).
2. Register it with one line: a built-in arm in the table below, ``register_arm(MyArm)``; an arm of your own
   in the script that starts training, before the flags are parsed::

       from megatron_lev.models.arms import register_arm
       from megatron_lev.training import pretrain
       from my_arm import MyArm

       register_arm(MyArm)
       raise SystemExit(pretrain())

   Then ``--input-embedding my_arm`` trains it, and the parameter report, the FLOPs and checkpoints count it.

An arm that needs a width of its own (as albert's --albert-dim) names a ``LevModelConfig`` field in
``settings``; a new setting is a new field there (its docstring is the flag's help) and in
``config.ModelRunConfig`` (the name ``config.yaml`` saves it under).
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional, Sequence, Tuple, Type

from megatron_lev.lev.config import ConfigError

from .albert import AlbertArm
from .base import MATCH_TOLERANCE, InputArm
from .factored_mlp import FactoredMLPArm
from .flat_mlp import FlatMLPArm
from .lev import LevArm
from .tied import TiedArm
from .untied import UntiedArm

__all__ = ["InputArm", "MATCH_TOLERANCE", "arm_names", "arm_settings", "find_arm", "get_arm", "matched_arms",
           "register_arm", "unregister_arm"]

_ARMS: Dict[str, InputArm] = {}


def register_arm(arm_class: Type[InputArm]) -> InputArm:
    """Add ``arm_class`` (an ``InputArm`` subclass) to the arms --input-embedding accepts; returns its entry."""
    if not (isinstance(arm_class, type) and issubclass(arm_class, InputArm)):
        raise TypeError(f"register_arm takes an InputArm subclass, not {arm_class!r}")
    arm = arm_class()
    if not arm.name or not arm.name.isidentifier():
        raise ValueError(f"{arm_class.__name__}.name must be a non-empty identifier (got {arm.name!r})")
    if arm.name in _ARMS:
        raise ValueError(f"input arm {arm.name!r} is already registered ({type(_ARMS[arm.name]).__name__})")
    _ARMS[arm.name] = arm
    return arm


def unregister_arm(name: str) -> None:
    """Remove the arm ``name`` (an arm registered for one run or one test)."""
    del _ARMS[name]


def find_arm(name: Optional[str]) -> Optional[InputArm]:
    """The registered arm ``name``, or None."""
    return _ARMS.get(name) if isinstance(name, str) else None


def get_arm(name: str) -> InputArm:
    """The registered arm ``name``; ``ConfigError`` naming --input-embedding and its choices otherwise."""
    arm = find_arm(name)
    if arm is None:
        raise ConfigError(f"--input-embedding must be one of {', '.join(_ARMS)} (got {name!r}); an arm of your own "
                          "is registered with megatron_lev.models.arms.register_arm before the flags are parsed")
    return arm


class _ArmNames(Sequence):
    """The registered arms' names, read at each use (argparse's choices for --input-embedding)."""

    def __getitem__(self, i):
        return tuple(_ARMS)[i]

    def __len__(self) -> int:
        return len(_ARMS)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(_ARMS))

    def __contains__(self, name) -> bool:
        return find_arm(name) is not None

    def __repr__(self) -> str:
        return repr(tuple(_ARMS))


_NAMES = _ArmNames()


def arm_names() -> Sequence[str]:
    """Every registered arm's name, in registration order (a live view: an arm registered later is in it)."""
    return _NAMES


def matched_arms() -> Tuple[InputArm, ...]:
    """The parameter-matched arms, in registration order."""
    return tuple(arm for arm in _ARMS.values() if arm.matched)


def arm_settings() -> Tuple[str, ...]:
    """The ``LevModelConfig`` fields the registered arms read, each once, in registration order."""
    return tuple(dict.fromkeys(name for arm in _ARMS.values() for name in arm.settings))


# The table, in the order of the paper's tables (the order of --input-embedding's choices).
register_arm(TiedArm)
register_arm(UntiedArm)
register_arm(AlbertArm)
register_arm(FlatMLPArm)
register_arm(FactoredMLPArm)
register_arm(LevArm)
