"""Fused CPU kernel for LEV's separable product (numba).

The eager form of the product (``megatron_lev.lev.functional``) moves the N x h x d_s x r factors
through memory several times per chunk (matmul out, product, division, gradient matmuls); on a CPU
that memory traffic, not the arithmetic, sets its speed. Here the forward walks the seed dimensions
for one head and a tile of ids at a time: it evaluates the tile's 3 non-zero spline weights in SIMD
lanes, builds phi[d, :] from the 3 matching rows of S in registers and multiplies it into the tile's
M straight away, so the factors never exist in memory. The backward takes one (head, seed dimension)
per task, recomputes phi the same way and writes dL/dx and that dimension's rows of dL/dS directly.

Same values and gradients as the eager form (tested); used for fp32 on CPU when numba is installed
(``LEVConfig.basis = "auto"`` or ``"fused"``). Numerics:
- forward multiplies the factors directly in fp32. A product that leaves [1e-30, 1e30] at a block
  boundary, or any exact zero factor, is flagged and the caller redoes the call in the eager log form
  (spec step 6), so tiny/huge products and phi = 0 keep an exact, finite gradient.
- backward uses dM/dphi_d = M / phi_d, exact when the forward was not flagged.
- dL/dS: each (head, seed dimension) is one task that sums over the ids in order: deterministic, and
  independent of the thread count.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import torch


_kernels = None  # the compiled kernels' module, imported by _load
_broken: str = ""  # why numba, though installed, did not import (the kernel is off then)
# The pool size this module put in the environment, so that a process started from this one tells it from
# a NUMBA_NUM_THREADS its user set.
_SIZED_BY_US = "MEGATRON_LEV_NUMBA_NUM_THREADS"


def available() -> bool:
    """numba is installed and imports (it is imported here, the first time, as :func:`_load` says). One
    that is installed but fails to import (a numba older than the NumPy beside it) turns the kernel off with
    a one-line warning, as Triton's is turned off where it cannot build: ``--lev-basis auto`` runs the eager
    basis."""
    global _broken
    if _kernels is not None:
        return True
    if _broken or importlib.util.find_spec("numba") is None:
        return False
    try:
        _load()
        return True
    except ImportError as e:
        _broken = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if os.environ.get("RANK", "0") == "0":
            print(f"warning: LEV's fused CPU kernel is off: numba is installed but does not import ({_broken}); "
                  "--lev-basis auto runs the eager basis", file=sys.stderr, flush=True)
        return False


def _load():
    """The kernels' module, numba imported with its pool sized to torch's intra-op pool (OMP_NUM_THREADS /
    torch.set_num_threads).

    Numba's OpenMP pool is fixed at ``import numba`` from ``NUMBA_NUM_THREADS`` (one thread per core
    unless set), and a pool thread the kernels leave unused still busy-waits after each call, taking a
    core from this process's torch threads and from the other ranks on the machine. So numba is imported
    only when the kernels are registered or first called, when the process's thread count is settled (a
    torchrun rank's OMP_NUM_THREADS, a local rank's share of the cores), with ``NUMBA_NUM_THREADS`` set to
    it. A value set by the user is kept; one this module set in a parent process (a launcher, a test
    session, which pass their environment on) is not. Measured on 2 cores: the quickstart's 2-rank LEV
    run, 1,302 ms per iteration with numba's default pool, 552 ms with pools sized like torch's (tied:
    548 ms); a 4-rank TP=2 LEV run, 130 ms per iteration with one-thread pools, 2,000 ms with the
    two-thread pools its ranks got from an inherited ``NUMBA_NUM_THREADS=2``.
    """
    global _kernels
    if _kernels is None:
        if "numba" not in sys.modules:  # imported by other code first, numba keeps the size it found
            ours = os.environ.get(_SIZED_BY_US)
            if "NUMBA_NUM_THREADS" not in os.environ or os.environ["NUMBA_NUM_THREADS"] == ours:
                size = str(max(1, torch.get_num_threads()))
                # numba re-reads its settings from the environment when it compiles: the value stays there
                os.environ["NUMBA_NUM_THREADS"] = os.environ[_SIZED_BY_US] = size
        from . import _lev_cpu_numba

        _kernels = _lev_cpu_numba
    return _kernels


def _match_torch_threads():
    """The kernels' module, computing on as many threads as torch does now, up to the pool's size (a pool
    cannot grow or shrink once numba is imported)."""
    kernels = _load()
    import numba

    want = max(1, min(numba.config.NUMBA_NUM_THREADS, torch.get_num_threads()))
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)
    return kernels


def forward(xt: np.ndarray, S: np.ndarray):
    """M [N, h, r] and a per-id flag (product out of [1e-30, 1e30] or a zero factor).

    xt [h, d_s, N] fp32 coordinates (x transposed), S = 1 + Delta [h, d_s, kappa, r] fp32, contiguous.
    """
    kernels = _match_torch_threads()
    H, _, N = xt.shape
    M = np.empty((N, H, S.shape[3]), dtype=np.float32)
    bad = np.zeros(N, dtype=np.bool_)
    kernels._forward(xt, S.reshape(-1, S.shape[3]), S.shape[2], M, bad)
    return M, bad


def backward(xt: np.ndarray, S: np.ndarray, gmt: np.ndarray):
    """(dL/dx [h, d_s, N], dL/dS [h, d_s, kappa, r]) from gmt = dL/dM * M as [h, N, r]."""
    kernels = _match_torch_threads()
    r = S.shape[3]
    grad_xt = np.empty(xt.shape, dtype=np.float32)
    grad_s = np.zeros((S.size // r, r), dtype=np.float32)
    kernels._backward(xt, S.reshape(-1, r), S.shape[2], gmt, grad_xt, grad_s)
    return grad_xt, grad_s.reshape(S.shape)


# ------------------------------------------------------------------------------------------------
# autograd wrapper

class _FusedProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, delta, m, xt, s):
        ctx.save_for_backward(m, xt, s)
        ctx.dtypes = (x.dtype, delta.dtype)
        return m

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_m):
        m, xt, s = ctx.saved_tensors
        gmt = (grad_m.float() * m).permute(1, 0, 2).contiguous()
        grad_xt, grad_s = backward(xt.numpy(), s.numpy(), gmt.numpy())
        x_dtype, delta_dtype = ctx.dtypes
        grad_x = torch.from_numpy(grad_xt).permute(2, 0, 1).to(x_dtype) if ctx.needs_input_grad[0] else None
        grad_delta = torch.from_numpy(grad_s).to(delta_dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_delta, None, None, None


def fused_separable_product(x, delta, num_knots, *, fallback, log_eps: float = 1e-30):
    """M [N, h, r] fp32 from x [N, h, d_s] and delta [h, d_s, kappa, r] (CPU); ``fallback(x, delta)``
    computes it in the eager log form (with ``log_eps``) when the fused forward flags a product out of
    range; the direct product needs no floor."""
    with torch.no_grad():
        xt = x.detach().float().permute(1, 2, 0).contiguous()  # [h, d_s, N]: the kernels walk ids innermost
        s = (delta.detach().float() + 1.0).contiguous()
        if s.shape[2] != num_knots:
            raise ValueError(f"fused product: delta has {s.shape[2]} knots, expected {num_knots}")
        m, bad = forward(xt.numpy(), s.numpy())
    if bad.any():
        return fallback(x, delta)
    return _FusedProduct.apply(x, delta, torch.from_numpy(m), xt, s)
