"""megatron-core without Transformer Engine: names its MoE code reads but only defines when TE imports.

megatron-core 0.16.1's ``transformer/moe/moe_utils.py`` imports ``te_general_gemm`` (and the fused MoE
kernels) inside ``try: import transformer_engine`` and defines nothing in the ``except``; the router's
``RouterGatingLinearFunction`` then tests ``te_general_gemm is not None`` on every call and fails with
NameError, so no MoE model runs without TE (CPU, or a GPU without TE). Defining the missing names as None
gives the torch path that the same function has for it. A release that defines them is left untouched.
"""

from __future__ import annotations

# The TE names moe_utils tests for None (the fused ones behind their own ``HAVE_TE`` checks as well).
_MOE_UTILS_TE_NAMES = (
    "te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
    "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function", "fused_unpermute",
)


def define_missing_te_names() -> list:
    """Set the TE names megatron-core's moe_utils lacks to None; returns the names it set."""
    from megatron.core.transformer.moe import moe_utils

    missing = [n for n in _MOE_UTILS_TE_NAMES if not hasattr(moe_utils, n)]
    for name in missing:
        setattr(moe_utils, name, None)
    return missing
