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
    def _tile_basis(xr, K, c, w, dw):  # pragma: no cover - compiled
        """For each coordinate of the tile xr: nearest knot c and the 3 normalised weights of knots
        c-1, c, c+1 (as ``functional._sparse_weights``) into w [T, 3], their x-derivatives into dw.

        One loop over the tile's ids with no data-dependent control flow, so LLVM evaluates it in SIMD
        lanes (a scalar evaluation per (id, head, dim) was half the forward's time). fp32 throughout.
        """
        km1 = np.float32(K - 1)
        half = np.float32(0.5)
        zero = np.float32(0.0)
        for i in range(xr.shape[0]):
            u = xr[i] * km1
            ci = min(max(np.floor(u + half), zero), km1)
            f = u - ci
            has_lo = ci > zero
            has_hi = ci < km1
            lo = half * (half - f) * (half - f) if has_lo else zero
            dlo = f - half if has_lo else zero
            mid = np.float32(0.75) - f * f
            dmid = np.float32(-2.0) * f
            hi = half * (half + f) * (half + f) if has_hi else zero
            dhi = half + f if has_hi else zero
            tot = lo + mid + hi
            dtot = dlo + dmid + dhi
            w0 = lo / tot
            w1 = mid / tot
            w2 = hi / tot
            scale = km1 / tot  # df/dx over the normaliser
            w[i, 0] = w0
            w[i, 1] = w1
            w[i, 2] = w2
            dw[i, 0] = (dlo - w0 * dtot) * scale
            dw[i, 1] = (dmid - w1 * dtot) * scale
            dw[i, 2] = (dhi - w2 * dtot) * scale
            c[i] = np.int64(ci)

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
            T = n1 - n0
            m = np.ones((T, R), dtype=np.float32)
            c = np.empty(T, dtype=np.int64)
            w = np.empty((T, 3), dtype=np.float32)
            dw = np.empty((T, 3), dtype=np.float32)
            for d in range(DS):
                base = (h * DS + d) * K
                _tile_basis(xt[h, d, n0:n1], K, c, w, dw)
                for i in range(T):
                    s0 = S2[base + max(c[i] - 1, 0)]
                    s1 = S2[base + c[i]]
                    s2 = S2[base + min(c[i] + 1, K - 1)]
                    w0 = w[i, 0]
                    w1 = w[i, 1]
                    w2 = w[i, 2]
                    mi = m[i]
                    for r in range(R):
                        mi[r] *= w0 * s0[r] + w1 * s1[r] + w2 * s2[r]
                if (d + 1) % _BLOCK == 0 or d == DS - 1:
                    for i in range(T):
                        for r in range(R):
                            a = abs(m[i, r])
                            if not (a >= _LO and a <= _HI):
                                bad[n0 + i] = True  # only ever set True: concurrent writers agree
            for i in range(T):
                for r in range(R):
                    M[n0 + i, h, r] = m[i, r]

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
            c = np.empty(_TILE, dtype=np.int64)
            w = np.empty((_TILE, 3), dtype=np.float32)
            dw = np.empty((_TILE, 3), dtype=np.float32)
            for n0 in range(0, N, _TILE):
                n1 = min(N, n0 + _TILE)
                _tile_basis(xt[h, d, n0:n1], K, c, w, dw)
                for i in range(n1 - n0):
                    j0 = base + max(c[i] - 1, 0)
                    j1 = base + c[i]
                    j2 = base + min(c[i] + 1, K - 1)
                    w0 = w[i, 0]
                    w1 = w[i, 1]
                    w2 = w[i, 2]
                    s0 = S2[j0]
                    s1 = S2[j1]
                    s2 = S2[j2]
                    gm = GMt[h, n0 + i]
                    a0 = np.float32(0.0)
                    a1 = np.float32(0.0)
                    a2 = np.float32(0.0)
                    for r in range(R):
                        g = gm[r] / (w0 * s0[r] + w1 * s1[r] + w2 * s2[r])  # dL/dphi_d
                        gp[r] = g
                        a0 += g * s0[r]
                        a1 += g * s1[r]
                        a2 += g * s2[r]
                    grad_xt[h, d, n0 + i] = a0 * dw[i, 0] + a1 * dw[i, 1] + a2 * dw[i, 2]
                    # Separate loops: j0..j2 may coincide at the ends (weight 0 there).
                    g0 = grad_s[j0]
                    for r in range(R):
                        g0[r] += w0 * gp[r]
                    g1 = grad_s[j1]
                    for r in range(R):
                        g1[r] += w1 * gp[r]
                    g2 = grad_s[j2]
                    for r in range(R):
                        g2[r] += w2 * gp[r]


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
