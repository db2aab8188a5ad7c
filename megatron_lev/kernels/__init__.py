"""Accelerated kernels for the LEV layer, behind ``megatron_lev.lev.functional``'s dispatch.

- CPU: a fused numba kernel for the separable product (``lev_cpu``), used for fp32 when numba is
  installed; without numba the eager torch form runs.
- GPU: a fused Triton kernel (``lev_triton``), basis "triton" (and "fused") on CUDA when triton is
  installed and can build its launcher (``triton_build_missing``: a C compiler and Python's headers; without
  them it is not registered, one line says what is missing, and ``--lev-basis auto`` runs "sparse");
  ``--lev-basis auto`` picks it there. With TRITON_INTERPRET=1 it is registered for CPU
  tensors instead (basis "triton" only), so its tests run in Triton's interpreter. Triton is imported
  only where it can run: on a CPU machine without the interpreter, training never loads it.
  ``lev_triton.compile_report()`` compiles both Triton kernels ahead of time for sm_90 and sm_80 (no GPU
  needed) and returns ptxas's registers, spills and shared memory per kernel, arch and shape.

Importing this package registers nothing: ``register_default_kernels()`` does, and the tensor-parallel
LEV layer calls it when it is built (so every model uses the kernels). The pure-torch ``LEVEmbedding``
(``megatron_lev.lev``, which imports only torch) uses them once anything in the process has called it.
"""

import importlib.util
import os
import shlex
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Optional

import torch

from megatron_lev.lev.config import ConfigError
from megatron_lev.lev.functional import register_fused_product

from . import lev_cpu

__all__ = ["lev_cpu", "refuse_unbuildable_triton", "register_default_kernels", "triton_build_missing"]

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
            missing = triton_build_missing() if device == "cuda" else None  # the interpreter builds nothing
            if missing:
                if os.environ.get("RANK", "0") == "0":
                    print(f"warning: LEV's Triton kernel is off: Triton cannot build its launcher without {missing}; "
                          "--lev-basis auto runs the sparse basis", file=sys.stderr, flush=True)
                continue
            register_fused_product(device, lev_triton.triton_separable_product, basis="triton")
            if device == "cuda":
                register_fused_product(device, lev_triton.triton_separable_product, basis="fused")
    _registered = True


def triton_build_missing() -> Optional[str]:
    """What Triton lacks here to build its C launcher at the first compiled call, looked up as Triton's
    ``runtime/build.py`` does (the package; a C compiler: ``$CC``, else gcc, else clang; ``Python.h`` in
    sysconfig's include directory), or None when nothing is missing. Asks no device."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package (pip install triton)"
    cc = os.environ.get("CC")
    if cc is not None:
        if not cc.strip() or shutil.which(shlex.split(cc)[0]) is None:
            return f"a C compiler ($CC={cc!r} is not found)"
    elif shutil.which("gcc") is None and shutil.which("clang") is None:
        return "a C compiler (gcc or clang on PATH, or $CC)"
    scheme = sysconfig.get_default_scheme()
    include = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]
    if not Path(include, "Python.h").exists():
        return f"Python's headers ({include}/Python.h: install python{sys.version_info[0]}.{sys.version_info[1]}-dev)"
    return None


def refuse_unbuildable_triton(basis: str, device_type: str) -> None:
    """One-line ``ConfigError`` for ``--lev-basis triton`` on CUDA where Triton cannot build its launcher
    (``--lev-basis auto`` runs the sparse basis there instead)."""
    if basis == "triton" and device_type == "cuda":
        missing = triton_build_missing()
        if missing:
            raise ConfigError(f"--lev-basis triton: Triton cannot build its launcher on this machine without "
                              f"{missing}; install it, or use --lev-basis auto (the sparse basis)")
