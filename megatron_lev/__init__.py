"""megatron-lev: Leviathan (LEV) continuous token embeddings on Megatron-core."""

__version__ = "0.1.0"

from megatron_lev.compat.startup import defer_megatron_compiles as _defer_megatron_compiles
from megatron_lev.compat.versions import quiet_cuda_runtime_notice as _quiet_cuda_runtime_notice
from megatron_lev.compat.versions import quiet_fallback_warnings as _quiet_fallback_warnings

_quiet_cuda_runtime_notice()  # before megatron-core is imported (see compat/versions.py)
_quiet_fallback_warnings()
_defer_megatron_compiles()  # before megatron-core is imported: start-up without TorchDynamo (compat/startup.py)
