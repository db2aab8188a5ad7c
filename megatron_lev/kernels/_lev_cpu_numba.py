"""The compiled kernels of :mod:`megatron_lev.kernels.lev_cpu` (numba); see its docstring for the design.

Imported by ``lev_cpu`` on the first kernel call of a process, once the size of numba's thread pool,
which numba fixes when it is imported, has been set from the threads this process computes with.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

_LO, _HI = 1e-30, 1e30
_BLOCK = 16  # seed dimensions between range checks
_TILE = 16  # ids per forward task
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
