"""Parallel layout and gradient communication: TP, PP, virtual stages, CP, EP and ETP, sequence
parallelism, the distributed optimizer and the DDP overlap flags, the process-group backend. The sizes'
flags are generated from :class:`~megatron_lev.distributed.layout.ParallelLayout`'s fields under Megatron-LM's
names (``size_flag``: ``tp`` is ``--tensor-model-parallel-size``, its destination
``tensor_model_parallel_size``), the others from the groups' fields; the layout's rules are
``ParallelLayout``'s (made by ``validate_args``)."""

from __future__ import annotations

from megatron.core.transformer import TransformerConfig

from megatron_lev.config_flags import add_config_flags, add_switch_flags, field_flag
from megatron_lev.distributed.layout import ParallelLayout, size_flag

from megatron_lev.config.groups import DistributedConfig, FoldedFlagsConfig, OptimizerRunConfig

_DDP_VALUES = ("ddp_bucket_size", "num_distributed_optimizer_instances", "distributed_backend",
               "distributed_timeout_minutes")
_DDP_SWITCHES = tuple((field_flag(name), name, True) for name in (
    "no_overlap_p2p_communication", "overlap_grad_reduce", "overlap_param_gather",
    "accumulate_allreduce_grads_in_fp32"))


def add_parallel_flags(p) -> None:
    g = p.add_argument_group("parallelism")
    add_config_flags(g, ParallelLayout, size_flag, ("tp", "pp"))
    add_config_flags(g, FoldedFlagsConfig, field_flag, ("num_layers_per_virtual_pipeline_stage",))
    add_config_flags(g, ParallelLayout, size_flag, ("vpp", "cp", "ep", "etp"))
    # A TransformerConfig field (megatron-core's ModelParallelConfig), as the model's switches.
    add_switch_flags(g, TransformerConfig, (("--sequence-parallel", "sequence_parallel", True),))
    add_switch_flags(g, OptimizerRunConfig, (("--use-distributed-optimizer", "use_distributed_optimizer", True),))
    add_switch_flags(g, DistributedConfig, _DDP_SWITCHES)
    add_config_flags(g, DistributedConfig, field_flag, _DDP_VALUES)

