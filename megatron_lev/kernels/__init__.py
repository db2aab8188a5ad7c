"""Accelerated kernels for the LEV layer, behind ``megatron_lev.lev.functional``'s dispatch.

- CPU: a fused numba kernel for the separable product (``lev_cpu``), used for fp32 when numba is
  installed; without numba the eager torch form runs.
- GPU: a fused Triton kernel (``lev_triton``), basis "triton" (and "fused") on CUDA when triton is
  installed; ``--lev-basis auto`` picks it there. With TRITON_INTERPRET=1 it is registered for CPU
  tensors instead (basis "triton" only), so its tests run in Triton's interpreter. Triton is imported
  only where it can run: on a CPU machine without the interpreter, training never loads it.
  ``lev_triton.compile_report()`` compiles both Triton kernels ahead of time for sm_90 and sm_80 (no GPU
  needed) and returns ptxas's registers, spills and shared memory per kernel, arch and shape.

Importing this package registers nothing: ``register_default_kernels()`` does, and the tensor-parallel
LEV layer calls it when it is built (so every model uses the kernels). The pure-torch ``LEVEmbedding``
(``megatron_lev.lev``, which imports only torch) uses them once anything in the process has called it.
"""

import os

import torch

from megatron_lev.lev.functional import register_fused_product

from . import lev_cpu

__all__ = ["lev_cpu", "register_default_kernels"]

_registered = False


def register_default_kernels() -> None:
    """Register the fused kernels this machine can run with ``megatron_lev.lev.functional``.

    Idempotent: the first call registers, later calls do nothing. Whether Triton's kernels are
    registered (and for which device) is decided at the first call, from CUDA and TRITON_INTERPRET.
    """
    global _registered
    if _registered:
        return
    if lev_cpu.available():
        register_fused_product("cpu", lev_cpu.fused_separable_product)
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        from . import lev_triton

        for device in lev_triton.devices():
            register_fused_product(device, lev_triton.triton_separable_product, basis="triton")
            if device == "cuda":
                register_fused_product(device, lev_triton.triton_separable_product, basis="fused")
    _registered = True
