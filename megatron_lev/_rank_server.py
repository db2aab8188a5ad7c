"""What the rank server imports once, before it forks local ranks (``distributed.spawn.rank_context``).

A local rank started fresh pays the imports of torch and megatron-core (about 3 s of CPU a rank, several
times that on a loaded node); ranks forked from a server that imported them once start in a fraction of
a second. Only imports here: the server holds no state, no thread and no CUDA context, so each rank
forked from it is as fresh as a spawned one. CUDA is hidden from the server before torch is imported,
and torch's availability check asks NVML instead of initialising the driver, so no import can create a
CUDA context that a fork would copy. The server ends when the process that started it ends
(multiprocessing's forkserver watches it), and its ranks with it (``spawn.leave_server``). This module
sits outside ``distributed/``, whose package imports torch before any line here would run.
"""

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"

import warnings  # noqa: E402

# Ignored while importing only (the filters the modules add at import are kept, as a new process has them):
# the import prints megatron-core's notes on missing fused kernels once, which quiet ranks silence anyway.
_IGNORE_ALL = ("ignore", None, Warning, None, 0)
warnings.filters.insert(0, _IGNORE_ALL)
try:
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (a run's first steps import it: 0.4 s)
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.models.gpt.gpt_model  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.parallel_state  # noqa: F401

    import megatron_lev.distributed  # noqa: F401
except Exception:  # a broken optional install (Transformer Engine raising OSError): each rank imports for
    pass  # itself and reports the failure as a rank failure, instead of the server dying unreported
finally:
    warnings.filters.remove(_IGNORE_ALL)
    warnings._filters_mutated()

import gc  # noqa: E402

# What the imports created lives as long as a rank does: kept out of the ranks' collections, which then
# scan only what the rank itself makes (a full collection over the imported modules took 0.15 s of CPU,
# and a rank of the test pool or a run that tears down its process groups collects after every job).
gc.freeze()
