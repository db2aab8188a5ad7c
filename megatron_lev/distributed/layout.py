"""The parallel layout of a job: how its processes split into tensor-, pipeline-, context- and
data-parallel ranks, and the expert layout over the same ranks, with megatron-core's rules for it.

A :class:`ParallelLayout` is checked when it is made, so every holder of one has a layout that
megatron-core's ``initialize_model_parallel`` accepts:

- ``validate_args`` makes it from the flags and the world size, before any process group exists;
- ``init_distributed`` takes it (or makes it from its arguments and the process group's size) and sets
  megatron's groups up from it;
- the model config checks a megatron-core ``TransformerConfig`` against ``ParallelLayout.smallest``
  (a config holds the sizes but not the world size).

The rules that tie a model to the layout (attention heads, query groups and experts against TP and EP,
layers against the pipeline stages) are the model's: ``models.config.check_parallel_settings``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from megatron_lev.lev.config import ConfigError

__all__ = ["DistributedConfigError", "MEGATRON_FIELDS", "ParallelLayout", "check_layout", "size_flag"]


class DistributedConfigError(ConfigError):
    """The requested backend or parallel layout cannot be set up; one-line message (a ConfigError)."""


# The sizes as megatron-core's ModelParallelConfig fields (and Megatron-LM's arguments, --flags) name them.
MEGATRON_FIELDS = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "vpp": "virtual_pipeline_model_parallel_size",
    "cp": "context_parallel_size",
    "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size",
}


def size_flag(size: str) -> str:
    """A size's flag under Megatron-LM's spelling: ``tp`` -> ``--tensor-model-parallel-size``."""
    return "--" + MEGATRON_FIELDS[size].replace("_", "-")


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class ParallelLayout:
    """TP x CP x DP ranks in each of PP pipeline stages (megatron-core's order), and over the same ranks of
    a stage the expert layout: EP x ETP x expert-DP. Made only valid (:class:`DistributedConfigError`)."""

    world_size: int
    """Processes in the job (torchrun's WORLD_SIZE)."""

    # The sizes' defaults, ranges and docstrings are also their flags' (arguments.parallel generates them).
    tp: int = field(default=1, metadata={"min": 1})
    """Tensor-parallel size: the ranks that split each layer's weights."""

    pp: int = field(default=1, metadata={"min": 1})
    """Pipeline stages: the ranks that split the layers."""

    vpp: Optional[int] = field(default=None, metadata={"min": 1})
    """Model chunks per pipeline rank, the interleaved schedule (or derived from
    --num-layers-per-virtual-pipeline-stage); unset: one chunk. 1 is kept as unset: it means no
    interleaving, and megatron-core refuses any virtual size at PP 1."""

    cp: int = field(default=1, metadata={"min": 1})
    """Context-parallel size: the ranks that split each sequence (context parallelism is not implemented in
    the trainer: only 1 is accepted)."""

    ep: int = field(default=1, metadata={"min": 1})
    """Expert-parallel size: the ranks that share one MoE layer's experts."""

    etp: Optional[int] = field(default=None, metadata={"min": 1})
    """Expert tensor-parallel size; unset: the tensor-parallel size, megatron-core's default (kept unset so
    that saved arguments stay right after a conversion to another TP size)."""

    def __post_init__(self) -> None:
        if self.vpp == 1:
            object.__setattr__(self, "vpp", None)
        self._check_sizes()
        self._check_world()

    # ------------------------------------------------------------------ derived sizes

    @property
    def dp(self) -> int:
        """Data-parallel size: the world over TP x PP x CP."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size in effect (``etp``, or TP when unset)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: the ranks of a stage over EP x ETP."""
        return self.world_size // (self.pp * self.ep * self.expert_tp)

    @property
    def stages(self) -> int:
        """Model chunks in the whole pipeline: PP x virtual stages."""
        return self.pp * (self.vpp or 1)

    # ------------------------------------------------------------------ the rules

    def _check_sizes(self) -> None:
        """Each size a positive integer (vpp and etp may be unset); virtual stages need a pipeline."""
        if not _positive(self.world_size):
            raise DistributedConfigError(
                f"the world size (WORLD_SIZE) must be >= 1 (an integer; got {self.world_size!r})")
        for size in ("tp", "pp", "vpp", "cp", "ep", "etp"):
            value = getattr(self, size)
            if not (_positive(value) or (value is None and size in ("vpp", "etp"))):
                unset = " or unset" if size in ("vpp", "etp") else ""
                raise DistributedConfigError(f"{size_flag(size)} must be >= 1 (an integer{unset}; got {value!r})")
        if self.vpp is not None and self.pp == 1:
            # megatron-core's initialize_model_parallel: the interleaved schedule splits each stage's layers.
            raise DistributedConfigError(
                f"{size_flag('vpp')} {self.vpp} (or --num-layers-per-virtual-pipeline-stage) needs "
                f"{size_flag('pp')} > 1; raise the pipeline size or drop the virtual stages")

    def _check_world(self) -> None:
        """megatron-core's two tilings of the world: TP x PP x CP (x DP), and per stage EP x ETP (x expert DP)."""
        model = self.tp * self.pp * self.cp
        if self.world_size % model:
            sizes = f"{size_flag('tp')} {self.tp} x {size_flag('pp')} {self.pp}"
            if self.cp > 1:
                sizes += f" x {size_flag('cp')} {self.cp}"
            raise DistributedConfigError(
                f"{sizes} = {model} does not divide the world size {self.world_size}; start a multiple of "
                f"{model} processes or change the parallel sizes")
        per_stage, experts = self.world_size // self.pp, self.ep * self.expert_tp
        if per_stage % experts:
            raise DistributedConfigError(
                f"{size_flag('ep')} {self.ep} x {size_flag('etp')} {self.expert_tp} = {experts} does not divide "
                f"the {per_stage} ranks of a pipeline stage (world {self.world_size} / PP {self.pp}); change the "
                "expert parallel sizes or the number of processes")

    # ------------------------------------------------------------------ construction

    @classmethod
    def smallest(cls, *, tp: int = 1, pp: int = 1, vpp: Optional[int] = None, cp: int = 1, ep: int = 1,
                 etp: Optional[int] = None) -> "ParallelLayout":
        """The layout of these sizes on the fewest processes that hold it: what a model config, which has no
        world size, is checked against (DP is 1 unless the expert layout needs more ranks per stage)."""
        probe = [tp, pp, cp, ep] + [v for v in (vpp, etp) if v is not None]
        if not all(_positive(v) for v in probe):
            return cls(world_size=1, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp)  # raises, naming the size
        expert_tp = tp if etp is None else etp
        return cls(world_size=pp * math.lcm(tp * cp, ep * expert_tp), tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp)

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any], world_size: Optional[int] = None) -> "ParallelLayout":
        """The layout of megatron-core's field names (a ``TransformerConfig``'s, its keyword arguments, or the
        parsed flags); without ``world_size``, :meth:`smallest`. An absent field has megatron-core's default."""
        sizes = {size: fields.get(name) for size, name in MEGATRON_FIELDS.items()}
        sizes = {k: (cls.__dataclass_fields__[k].default if v is None else v) for k, v in sizes.items()}
        if world_size is None:
            return cls.smallest(**sizes)
        return cls(world_size=world_size, **sizes)

    def megatron_sizes(self) -> dict:
        """The sizes under megatron-core's field names, as ``initialize_model_parallel`` takes them (``etp``
        as given: None is TP there too)."""
        return {name: getattr(self, size) for size, name in MEGATRON_FIELDS.items()}


def check_layout(world_size: int, tp: int, pp: int, ep: int = 1, etp: Optional[int] = None) -> ParallelLayout:
    """The :class:`ParallelLayout` of ``world_size`` processes at these sizes (DistributedConfigError, one
    line, when megatron-core cannot set it up); for callers that check sizes before starting ranks."""
    return ParallelLayout(world_size=world_size, tp=tp, pp=pp, ep=ep, etp=etp)
