"""What the rank server imports once, before it forks local ranks (``spawn.rank_context``).

A local rank started fresh pays the imports of torch and megatron-core (about 3 s of CPU a rank, several
times that on a loaded node); ranks forked from a server that imported them once start in a fraction of
a second. Only imports here: the server holds no state, no thread and no CUDA context, so each rank
forked from it is as fresh as a spawned one. The server ends when the process that started it ends
(multiprocessing's forkserver watches it), and its ranks with it (``spawn.start_rank``). The import
prints megatron-core's notes on missing fused kernels once; they are silenced, as quiet ranks do.
"""

import warnings

# Ignored while importing only (the filters the modules add at import are kept, as a new process has them).
_IGNORE_ALL = ("ignore", None, Warning, None, 0)
warnings.filters.insert(0, _IGNORE_ALL)
try:
    import torch  # noqa: F401
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.models.gpt.gpt_model  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.parallel_state  # noqa: F401

    from . import bootstrap  # noqa: F401
finally:
    warnings.filters.remove(_IGNORE_ALL)
    warnings._filters_mutated()
