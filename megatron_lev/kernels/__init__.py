"""Accelerated kernels for the LEV layer, registered with ``megatron_lev.lev.functional`` on import.

- CPU: a fused numba kernel for the separable product (``lev_cpu``), used for fp32 when numba is
  installed; without numba the eager torch form runs.
- GPU: a fused Triton kernel (``lev_triton``), basis "triton" (and "fused") on CUDA when triton is
  installed; ``--lev-basis auto`` picks it there. With TRITON_INTERPRET=1 it is registered for CPU
  tensors instead (basis "triton" only), so its tests run in Triton's interpreter. Triton is imported
  only where it can run: on a CPU machine without the interpreter, training never loads it.
"""

import os

import torch

from megatron_lev.lev.functional import register_fused_product

from . import lev_cpu

if lev_cpu.available():
    register_fused_product("cpu", lev_cpu.fused_separable_product)

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    from . import lev_triton

    for _device in lev_triton.devices():
        register_fused_product(_device, lev_triton.triton_separable_product, basis="triton")
        if _device == "cuda":
            register_fused_product(_device, lev_triton.triton_separable_product, basis="fused")

__all__ = ["lev_cpu"]
