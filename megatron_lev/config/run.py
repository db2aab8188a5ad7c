"""The run's configuration as typed groups: :class:`RunConfig`, read from the parsed arguments or from a
checkpoint's saved ones (``config.yaml``, flat, every version written so far).

Each group holds the settings one part of the trainer reads, under Megatron-LM's argument names (a
field is the flag ``--field-name``), as Megatron-LM's ``megatron/training/config/`` groups its
``TrainingConfig``, ``SchedulerConfig`` and ``LoggerConfig``; the parallel sizes are one
:class:`~megatron_lev.distributed.layout.ParallelLayout`, checked once where it is made. Each field holds
its flag's default (``arguments`` generates most flags from these fields, and a test holds the hand-written
ones equal), so a key a saved file lacks takes it. Required: a setting without a default (``lr``) or that
validation resolves (``global_batch_size``, ``num_microbatches``, ``input_embedding``). Values the tokenizer
decides (``padded_vocab_size``, ``tokenizer_fingerprint``) are None until it is built.

``from_saved_args`` reads a saved flat dictionary: a key it lacks (a file written before the flag
existed) takes the field's default, a derived value it lacks (world size, data-parallel size, micro-batches,
parameter dtype) is derived again as validation derives it, ``"inf"`` (how ``config.yaml`` writes an
infinite float) is the float, and each numeric value is checked against its field's range (a hand-edited
file is refused in one line naming the key). ``to_saved_args`` writes the flat names back (LEV's nested
settings under their ``lev_*`` names).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import typing
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Mapping, Optional, Union

from megatron_lev.config_flags import Number
from megatron_lev.distributed.layout import MEGATRON_FIELDS, ParallelLayout
from megatron_lev.lev.config import ConfigError, LEVConfig, lev_arg

from .groups import CheckpointingConfig, DataConfig, DistributedConfig, FoldedFlagsConfig, LoggingConfig, \
    OptimizerRunConfig, RunControlConfig, ScheduleConfig
from .model import ModelRunConfig

__all__ = ["CheckpointingConfig", "DataConfig", "DistributedConfig", "FoldedFlagsConfig", "LoggingConfig",
           "ModelRunConfig", "OptimizerRunConfig", "RunConfig", "RunControlConfig", "ScheduleConfig", "LAYOUT_ARGS"]

# The saved arguments the layout holds (its sizes under Megatron-LM's names, and what validation derives).
LAYOUT_ARGS = tuple(MEGATRON_FIELDS.values()) + ("world_size", "data_parallel_size")


# The flat groups, by their RunConfig field (the layout is made separately).
_GROUPS = {"model": ModelRunConfig, "data": DataConfig, "schedule": ScheduleConfig, "optimizer": OptimizerRunConfig,
           "distributed": DistributedConfig, "checkpointing": CheckpointingConfig, "logging": LoggingConfig,
           "run": RunControlConfig, "folded": FoldedFlagsConfig}


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything a training run reads, in groups; made from the parsed arguments or the saved ones."""

    model: ModelRunConfig
    """Model settings the trainer reads."""

    layout: ParallelLayout
    """TP, PP, virtual stages, CP, EP, ETP and the world size; DP derived."""

    data: DataConfig
    """Datasets, loader, tokenizer."""

    schedule: ScheduleConfig
    """Length, batch sizes, evaluation, learning-rate and weight-decay schedules."""

    optimizer: OptimizerRunConfig
    """Optimizer, learning rates, clipping, loss scaling."""

    distributed: DistributedConfig
    """Backend and gradient reduction."""

    checkpointing: CheckpointingConfig
    """Save, load, resume."""

    logging: LoggingConfig
    """Log lines, TensorBoard, wandb, metrics file."""

    run: RunControlConfig
    """Seed, exits, faults, garbage collection, profiling."""

    folded: FoldedFlagsConfig
    """Flags validation folds into other fields, as given (saved, read by nothing)."""

    @classmethod
    def from_args(cls, args: Any) -> "RunConfig":
        """The run configuration of validated arguments (the namespace ``arguments.parse_args`` returns)."""
        # As argparse typed them: config.yaml keeps writing what the flags gave (--loss-scale-window's
        # default is the int 1000, as in Megatron-LM).
        return cls._from_flat(vars(args), "the arguments", coerce=False)

    @classmethod
    def from_saved_args(cls, saved: Mapping[str, Any], source: str = "config.yaml") -> "RunConfig":
        """The run configuration of saved arguments (a ``config.yaml`` of any version so far)."""
        values = dict(saved)
        _derive_missing(values, source)
        return cls._from_flat(values, source)

    def to_saved_args(self) -> Dict[str, Any]:
        """The flat saved arguments of this configuration (``config.yaml``'s names and values)."""
        out: Dict[str, Any] = {}
        for group in _GROUPS:
            for f in fields(getattr(self, group)):
                value = getattr(getattr(self, group), f.name)
                if isinstance(value, LEVConfig):
                    out.update(value.to_args())
                else:
                    out[f.name] = copy.deepcopy(value)  # as dataclasses.asdict: no list shared with the config
        out.update(self.layout.megatron_sizes())
        out.update(world_size=self.layout.world_size, data_parallel_size=self.layout.dp)
        return out

    def relayout(self, tp: int, pp: int, vpp: Optional[int] = None, world_size: Optional[int] = None) -> "RunConfig":
        """This configuration at TP=``tp`` x PP=``pp`` (``vpp`` virtual stages; data-parallel size from
        ``world_size``, default 1). ConfigError (one line) when the checkpoint cannot take that layout.

        The padded vocabulary is kept (the tensors have that many rows); ``make_vocab_size_divisible_by``
        is changed when needed so that a run at the new TP pads the tokenizer's vocabulary to the same
        size (Megatron pads to a multiple of ``make_vocab_size_divisible_by x TP``). An MoE model's experts
        are not split at the new layout (expert-parallel size 1, expert TP unset: the TP size), as the
        conversion and evaluation ranks build it; dist_checkpointing regathers them from any saved EP, and
        a run resumed from the result chooses its own ``--expert-model-parallel-size``.
        """
        # The sizes' rules are the layout's (vpp 1 is no interleaving there too).
        layout = ParallelLayout(world_size=int(world_size or max(1, tp * pp)), tp=int(tp), pp=int(pp), vpp=vpp)
        padded = self.model.padded_vocab_size
        if padded is None:
            raise ConfigError("the saved arguments have no padded_vocab_size (the embedding's rows)")
        if padded % layout.tp != 0:
            raise ConfigError(f"the padded vocabulary ({padded} rows) is not divisible by TP {layout.tp}")
        model = dataclasses.replace(
            self.model, make_vocab_size_divisible_by=self._divisible_by_for(layout.tp),
            sequence_parallel=self.model.sequence_parallel and layout.tp > 1)
        s, schedule = self.schedule, self.schedule
        if s.micro_batch_size and s.global_batch_size:  # a conversion's arguments may have no batch sizes
            schedule = dataclasses.replace(
                s, num_microbatches=max(1, s.global_batch_size // (s.micro_batch_size * layout.dp)))
        folded = dataclasses.replace(self.folded, num_layers_per_virtual_pipeline_stage=None)
        return dataclasses.replace(self, model=model, layout=layout, schedule=schedule, folded=folded)

    def _divisible_by_for(self, tp: int) -> int:
        """A ``make_vocab_size_divisible_by`` that pads the original vocabulary to the same rows at ``tp``."""
        padded, old, old_tp = self.model.padded_vocab_size, self.model.make_vocab_size_divisible_by, self.layout.tp
        # The source padded to a multiple of old * old_tp; the same multiple at ``tp`` pads identically.
        if (old * old_tp) % tp == 0 and padded % (old * old_tp) == 0:
            return old * old_tp // tp
        return padded // tp  # always reproduces ``padded`` (any vocabulary <= padded rounds up to it)

    def with_padded_vocab(self, rows: int) -> "RunConfig":
        """This configuration with ``rows`` embedding rows (what :meth:`with_tokenizer` derives from a tokenizer)."""
        return dataclasses.replace(self, model=dataclasses.replace(self.model, padded_vocab_size=rows))

    def with_tokenizer(self, tokenizer) -> "RunConfig":
        """This configuration with what ``tokenizer`` decides: the embedding's rows (its vocabulary padded to
        --make-vocab-size-divisible-by x TP) and the fingerprint checkpoints and datasets are checked against."""
        from megatron_lev.tokenizer import padded_vocab_size, tokenizer_fingerprint
        from megatron_lev.tokenizer.tokenizers import model_vocab_size

        try:
            vocab = model_vocab_size(tokenizer, self.data.tokenizer_type, self.data.vocab_size,
                                     self.data.tiktoken_pattern)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        rows = padded_vocab_size(vocab, self.model.make_vocab_size_divisible_by, self.layout.tp)
        return dataclasses.replace(
            self, model=dataclasses.replace(self.model, padded_vocab_size=rows),
            data=dataclasses.replace(self.data, tokenizer_fingerprint=tokenizer_fingerprint(tokenizer)))

    @classmethod
    def _from_flat(cls, values: Mapping[str, Any], source: str, coerce: bool = True) -> "RunConfig":
        groups = {name: _group(klass, values, source, coerce) for name, klass in _GROUPS.items()}
        if "world_size" not in values:
            raise ConfigError(f"{source}: no world_size (the number of processes the arguments were validated for)")
        layout = ParallelLayout.from_fields(values, world_size=values["world_size"])
        if "data_parallel_size" in values and values["data_parallel_size"] != layout.dp:
            raise ConfigError(f"{source}: data_parallel_size {values['data_parallel_size']} is not the world size "
                              f"{layout.world_size} over TP x PP x CP ({layout.dp})")
        return cls(layout=layout, **groups)


def flat_names() -> List[str]:
    """Every flat argument name a :class:`RunConfig` reads (the groups' fields and the layout's)."""
    lev = [lev_arg(f.name) for f in fields(LEVConfig)]
    return [n for klass in _GROUPS.values() for f in fields(klass)
            for n in (lev if f.name == "lev" else [f.name])] + list(LAYOUT_ARGS)


def _derive_missing(values: Dict[str, Any], source: str) -> None:
    """What validation derives, for saved arguments that lack it (validation's own rules)."""
    model = 1
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        model *= values.get(name) or 1
    if "world_size" not in values and values.get("data_parallel_size"):
        values["world_size"] = values["data_parallel_size"] * model
    if "data_parallel_size" not in values and values.get("world_size"):
        values["data_parallel_size"] = values["world_size"] // model
    if values.get("num_microbatches") is None and values.get("global_batch_size") and values.get("micro_batch_size"):
        values["num_microbatches"] = values["global_batch_size"] // (
            values["micro_batch_size"] * (values.get("data_parallel_size") or 1))


def _group(klass, values: Mapping[str, Any], source: str, coerce: bool = True):
    hints = typing.get_type_hints(klass)
    kwargs = {}
    for f in fields(klass):
        if hints[f.name] is LEVConfig:
            kwargs[f.name] = _lev(values, source, coerce)
        elif f.name in values:
            kwargs[f.name] = _checked(f, _coerce(hints[f.name], values[f.name], f.name, source) if coerce
                                      else values[f.name], source)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{source}: no {f.name} (flag --{f.name.replace('_', '-')})")
    return klass(**kwargs)


def _lev(values: Mapping[str, Any], source: str, coerce: bool) -> LEVConfig:
    """LEV's settings from their flat ``lev_*`` names (a missing or None value keeps the field's default),
    checked as the flags are (``LEVConfig.validate_settings``)."""
    hints = typing.get_type_hints(LEVConfig)
    kwargs = {}
    for f in fields(LEVConfig):
        value = values.get(lev_arg(f.name))
        if value is not None:
            kwargs[f.name] = _coerce(hints[f.name], value, lev_arg(f.name), source) if coerce else value
    config = LEVConfig(**kwargs)
    if coerce:
        try:
            config.validate_settings()
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
    return config


def _checked(f: dataclasses.Field, value: Any, source: str) -> Any:
    """``value`` if it lies in the range of field ``f``'s metadata (a saved file may have been edited)."""
    number = Number.of_field(float, f.metadata)
    if number is not None and isinstance(value, (int, float)) and not isinstance(value, bool) \
            and not number.allows(value):
        finite = "finite and " if math.isinf(value) and not number.inf else ""
        raise ConfigError(f"{source}: {f.name} is {value!r}, which must be {finite}{number.describe()}; put back the "
                          f"value the run was started with")
    return value


def _coerce(hint: Any, value: Any, name: str, source: str) -> Any:
    """``value`` as the field's type where the saved form differs: a float written as an int or as
    ``"inf"``, a whole number written as a float or a string, a list written as a tuple."""
    if value is None:
        return None
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    # Optional[X] is X here; another union (moe_layer_freq: an int or a list) is taken as written.
    base = (args[0] if len(args) == 1 else None) if typing.get_origin(hint) is typing.Union else hint
    if base is float and not isinstance(value, bool) and isinstance(value, (int, str)):
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{source}: {name}: {value!r} is not a number") from None
    if base is int and not (isinstance(value, int) and not isinstance(value, bool)):
        whole = (isinstance(value, float) and value.is_integer()) or \
            (isinstance(value, str) and value.strip().isdigit())
        if not whole:
            raise ConfigError(f"{source}: {name} is {value!r}, not a whole number: the file was edited or damaged; put "
                              f"back the value the run was started with")
        return int(value)
    if typing.get_origin(base) is list and isinstance(value, tuple):
        return list(value)
    return value
