"""Fused CPU kernel for LEV's separable product (numba).

The eager form of the product (``megatron_lev.lev.functional``) moves the N x h x d_s x r factors
through memory several times per chunk (matmul out, product, division, gradient matmuls); on a CPU
that memory traffic, not the arithmetic, sets its speed. Here each (id, head) is one loop nest that
builds phi[d, :] from the 3 non-zero spline knots in registers and multiplies it into M[:] straight
away, so the factors never exist in memory; the backward recomputes them the same way and writes
dL/dw (the 3 spline weights) and dL/dS directly.

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

import os

import numpy as np
import torch

# Numba starts one pool thread per core in every process unless told otherwise; with several ranks
# per machine those pools oversubscribe the cores (see _match_torch_threads). Size it like torch's.
os.environ.setdefault("NUMBA_NUM_THREADS", str(max(1, torch.get_num_threads())))

try:
    import numba
    from numba import njit, prange
except ImportError:  # numba is an optional accelerator
    numba = None

_LO, _HI = 1e-30, 1e30
_BLOCK = 16  # seed dimensions between range checks
_TILE = 16  # ids per forward task


def available() -> bool:
    return numba is not None


if numba is not None:
    _FM = {"reassoc", "contract", "arcp"}  # lets LLVM vectorise the r-loops; no nan/inf assumptions

    @njit(inline="always")
    def _basis(xv, K):  # pragma: no cover - compiled
        """Nearest knot c and the 3 normalised weights, as ``functional._sparse_weights``; plus the
        derivatives of the weights with respect to x."""
        u = xv * (K - 1)
        c = np.floor(u + 0.5)
        if c < 0.0:
            c = 0.0
        if c > K - 1:
            c = np.float32(K - 1)
        f = u - c
        lo = 0.5 * (0.5 - f) * (0.5 - f)
        dlo = f - 0.5
        if c <= 0.0:
            lo = 0.0
            dlo = 0.0
        mid = 0.75 - f * f
        dmid = -2.0 * f
        hi = 0.5 * (0.5 + f) * (0.5 + f)
        dhi = 0.5 + f
        if c >= K - 1:
            hi = 0.0
            dhi = 0.0
        tot = lo + mid + hi
        dtot = dlo + dmid + dhi
        w0 = lo / tot
        w1 = mid / tot
        w2 = hi / tot
        scale = (K - 1) / tot  # df/dx over the normaliser
        d0 = (dlo - w0 * dtot) * scale
        d1 = (dmid - w1 * dtot) * scale
        d2 = (dhi - w2 * dtot) * scale
        ci = int(c)
        return max(ci - 1, 0), ci, min(ci + 1, K - 1), w0, w1, w2, d0, d1, d2

    @njit(parallel=True, cache=True, fastmath=_FM)
    def _forward(xt, S2, K, M, bad):  # pragma: no cover - compiled
        # xt = x transposed to [h, d_s, N]; S2 = S.reshape(h * d_s * kappa, r), rows addressed as
        # (h * d_s + d) * kappa + knot. One task per (head, tile of _TILE ids): the tile's running
        # products stay in L1 and each (head, dim)'s rows of S are read once per tile, not once per id.
        H, DS, N = xt.shape
        R = S2.shape[1]
        NT = (N + _TILE - 1) // _TILE
        for task in prange(H * NT):
            h = task // NT
            n0 = (task % NT) * _TILE
            n1 = min(N, n0 + _TILE)
            m = np.ones((n1 - n0, R), dtype=np.float32)
            for d in range(DS):
                base = (h * DS + d) * K
                for n in range(n0, n1):
                    k0, k1, k2, w0, w1, w2, _, _, _ = _basis(xt[h, d, n], K)
                    j0 = base + k0
                    j1 = base + k1
                    j2 = base + k2
                    for r in range(R):
                        m[n - n0, r] *= w0 * S2[j0, r] + w1 * S2[j1, r] + w2 * S2[j2, r]
                if (d + 1) % _BLOCK == 0 or d == DS - 1:
                    for n in range(n0, n1):
                        for r in range(R):
                            a = abs(m[n - n0, r])
                            if not (a >= _LO and a <= _HI):
                                bad[n] = True  # only ever set True: concurrent writers agree
            for n in range(n0, n1):
                for r in range(R):
                    M[n, h, r] = m[n - n0, r]

    @njit(parallel=True, cache=True, fastmath=_FM)
    def _backward(xt, S2, K, GMt, grad_xt, grad_s):  # pragma: no cover - compiled
        # GMt = dL/dM * M as [h, N, r]; grad_xt [h, d_s, N]; grad_s like S2, zeroed. One task per
        # (head, dim): it owns that dim's kappa x r rows of dL/dS (L1-resident, no per-thread copies)
        # and sums over the ids in order, so the result does not depend on the thread count.
        H, DS, N = xt.shape
        R = S2.shape[1]
        for hd in prange(H * DS):
            h = hd // DS
            d = hd % DS
            base = hd * K
            gp = np.empty(R, dtype=np.float32)
            for n in range(N):
                k0, k1, k2, w0, w1, w2, d0, d1, d2 = _basis(xt[h, d, n], K)
                j0 = base + k0
                j1 = base + k1
                j2 = base + k2
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                a2 = np.float32(0.0)
                for r in range(R):
                    s0 = S2[j0, r]
                    s1 = S2[j1, r]
                    s2 = S2[j2, r]
                    g = GMt[h, n, r] / (w0 * s0 + w1 * s1 + w2 * s2)  # dL/dphi_d
                    gp[r] = g
                    a0 += g * s0
                    a1 += g * s1
                    a2 += g * s2
                grad_xt[h, d, n] = a0 * d0 + a1 * d1 + a2 * d2
                # Separate loops: j0..j2 may coincide at the ends (weight 0 there).
                for r in range(R):
                    grad_s[j0, r] += w0 * gp[r]
                for r in range(R):
                    grad_s[j1, r] += w1 * gp[r]
                for r in range(R):
                    grad_s[j2, r] += w2 * gp[r]


def _match_torch_threads() -> None:
    """Use as many kernel threads as torch's intra-op pool (OMP_NUM_THREADS / torch.set_num_threads).

    Numba's default is one pool thread per core in every process; with several ranks on one
    machine (torchrun with OMP_NUM_THREADS=1) those pools oversubscribe the cores. Measured on the
    quickstart's 2-rank LEV run (2 cores): 1,302 ms per iteration with numba's default pool, 552 ms
    with the pool sized at import (tied: 548 ms). This call keeps the count in step when
    torch.set_num_threads changes later.
    """
    want = max(1, min(numba.config.NUMBA_NUM_THREADS, torch.get_num_threads()))
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)


def forward(xt: np.ndarray, S: np.ndarray):
    """M [N, h, r] and a per-id flag (product out of [1e-30, 1e30] or a zero factor).

    xt [h, d_s, N] fp32 coordinates (x transposed), S = 1 + Delta [h, d_s, kappa, r] fp32, contiguous.
    """
    _match_torch_threads()
    H, _, N = xt.shape
    M = np.empty((N, H, S.shape[3]), dtype=np.float32)
    bad = np.zeros(N, dtype=np.bool_)
    _forward(xt, S.reshape(-1, S.shape[3]), S.shape[2], M, bad)
    return M, bad


def backward(xt: np.ndarray, S: np.ndarray, gmt: np.ndarray):
    """(dL/dx [h, d_s, N], dL/dS [h, d_s, kappa, r]) from gmt = dL/dM * M as [h, N, r]."""
    _match_torch_threads()
    r = S.shape[3]
    grad_xt = np.empty(xt.shape, dtype=np.float32)
    grad_s = np.zeros((S.size // r, r), dtype=np.float32)
    _backward(xt, S.reshape(-1, r), S.shape[2], gmt, grad_xt, grad_s)
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
