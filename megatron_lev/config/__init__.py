"""The run's typed configuration, below every package that reads it.

- ``model``: :class:`ModelRunConfig`, the model's settings (the shape, the input arm, LEV's nested
  ``LEVConfig``, positions and norms, precision, recomputation, megatron-core's switches, MoE and MTP).
- ``groups``: the other groups (data, schedule, optimizer, distributed, checkpointing, logging, run control,
  the folded flags), each field a flag of ``arguments``.
- ``run``: :class:`RunConfig`, the groups and the parallel layout, from parsed flags or a saved
  ``config.yaml`` (with its range checks) and back.

No argparse here: ``arguments`` generates flags from these fields and parses into them; ``models.factory``
builds megatron-core's configs from them; ``checkpoint`` saves them; ``evaluation`` and ``conversion`` read a
checkpoint's through :meth:`RunConfig.from_saved_args`.
"""

from megatron_lev.lev.config import ConfigError

from .groups import CheckpointingConfig, DataConfig, DistributedConfig, FoldedFlagsConfig, LoggingConfig, \
    OptimizerRunConfig, RunControlConfig, ScheduleConfig
from .model import ModelRunConfig
from .run import LAYOUT_ARGS, RunConfig, flat_names

__all__ = ["CheckpointingConfig", "ConfigError", "DataConfig", "DistributedConfig", "FoldedFlagsConfig", "LAYOUT_ARGS",
           "LoggingConfig", "ModelRunConfig", "OptimizerRunConfig", "RunConfig", "RunControlConfig", "ScheduleConfig",
           "flat_names"]
