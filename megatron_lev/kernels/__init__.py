"""Accelerated kernels for the LEV layer, registered with ``megatron_lev.lev.functional`` on import.

- CPU: a fused numba kernel for the separable product (``lev_cpu``), used for fp32 when numba is
  installed; without numba the eager torch form runs.
"""

from megatron_lev.lev.functional import register_fused_product

from . import lev_cpu

if lev_cpu.available():
    register_fused_product("cpu", lev_cpu.fused_separable_product)

__all__ = ["lev_cpu"]
