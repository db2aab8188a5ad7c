"""Fused Triton kernels for LEV's separable product (GPU; Triton's interpreter on CPU for tests).

The eager form (``megatron_lev.lev.functional``) writes the N x h x d_s x r factors phi through
memory chunk by chunk, several times per step. Here neither the basis nor the factors ever reach
memory. The coordinates x (N x h x d_s, 1/r of the factors) come from eager torch, so the seed and
head projections run as cuBLAS GEMMs; the projection of M to D is a GEMM after it.

Forward: one program per (tile of ids, head) walks the d_s seed dimensions: for each it evaluates the
3 non-zero normalised B-spline weights of x[n, l, d], gathers the 3 matching rows of S = 1 + Delta
(a few MB, cache-resident), forms phi[n, :] in registers and adds log|phi| into an fp32 accumulator.

Backward: one program per (seed dimension d, head, partition of the ids). It holds dL/dS[head, d], a
[kappa, r] fp32 slab, in registers while it sweeps its partition's id tiles in order; per tile it
recomputes phi, writes dL/dx[:, head, d] for the tile and adds the tile's contribution to the slab
(a small matmul, dense basis^T @ dL/dphi); it stores the slab once at the end. The programs of one
head run side by side over the same tiles, so dL/dM and logsum are read from L2. With h x d_s
(head, dimension) pairs already enough programs (``_TARGET_PROGRAMS`` = 1,024, the defaults' count)
there is one partition and the kernel writes dL/dS itself. Otherwise the ids are split into
P = min(id tiles, ceil(1024 / (h d_s))) runs of consecutive tiles whose [P, h, d_s, kappa, r] partial
slabs torch sums: sized by N, and fewer than 1,024 + h d_s slabs whatever N is. No buffer is zero-filled: every
element is written by exactly one program. The tile, warps and
stages (``_fwd_config``, ``_bwd_config``) keep every default shape free of register spills on sm_80
and sm_90; ``compile_report`` compiles both kernels ahead of time and says what ptxas allocates.

Backward variants (``triton_separable_product(..., backward=...)``, ``BACKWARD_VARIANTS``; the
default ``DEFAULT_BACKWARD`` = "reference" until a GPU measures otherwise, with
``megatron_lev.kernels.lev_timing``): "reference" is the kernel above. "grouped" gives each program
``GROUP_DIMS`` = 2 consecutive seed dimensions (grid ceil(d_s / 2) x h x P, P sized for the same
~1,024 programs, so 2 partitions at the defaults): a tile's logsum and dL/dM x sign are read once for
both, halving the reads from L2, and where the tile's logsum lies in [-80, 80] (exp(logsum) normal
and finite in fp32) the product of the other factors is exp(logsum) / max(|phi|, log_eps), one exp per
tile and a division instead of a log and an exp per factor; elsewhere it takes the log form. Both
give the same gradients up to fp32 rounding (the reduction order differs: partitions and tiles of 16).

Numerics (spec step 6): the product is accumulated in fp32 in sign/log form for every input dtype
(bf16 or fp32 parameters): logsum = sum_d log(max(|phi_d|, log_eps)), sign from the parity of
negative factors (sign(0) = +1), M = 0 exactly where a factor is exactly 0. The backward recomputes
phi per tile and uses dM/dphi_d = sign(M) sign(phi_d) exp(logsum - log max(|phi_d|, log_eps)): the
product of the other factors, finite and non-zero at phi_d = 0 and exact near fp32 underflow. These
are the eager log form's formulas, so both agree to fp32 rounding.

Determinism: no float atomics. dL/dx[n, head, d] is written by the one program owning (d, head) and
n's partition. dL/dS is summed over the ids in a fixed order: tile after tile within a partition, then
(when P > 1) over the partitions by torch. The partition depends only on N, h and d_s, so two runs
give bit-identical gradients.

Any d_s, kappa, r and h: the rank and the knots are padded to powers of two (at least 16, the
smallest ``tl.dot`` tile) and masked; d_s and h are grid bounds. Launches run on the input's device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import tempfile
import warnings

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is an optional accelerator
    triton = None

__all__ = ["available", "interpreted", "devices", "triton_separable_product", "BLOCK_N", "compile_report",
           "KernelResources", "report_shapes"]

BLOCK_N = 32  # ids per program tile at r <= 64 (16 above: see _fwd_config, _bwd_config)
_TARGET_PROGRAMS = 1024  # backward: at least about this many programs (several per SM of an H100)
# The backward kernels ``triton_separable_product(..., backward=...)`` can launch; "reference" (one seed
# dimension per program, fp32 FMA slab matmul) is the default until a GPU measures the other faster.
BACKWARD_VARIANTS = ("reference", "grouped")
DEFAULT_BACKWARD = "reference"
GROUP_DIMS = 2  # seed dimensions per program of the "grouped" backward
DIRECT_LOG = 80.0  # the grouped backward's direct form where |logsum| <= this: exp(logsum) normal in fp32


def available() -> bool:
    return triton is not None


def interpreted() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def devices() -> tuple:
    """Device types whose tensors these kernels run on: the interpreter takes CPU tensors."""
    if triton is None:
        return ()
    return ("cpu",) if interpreted() else ("cuda",)


if triton is not None:
    _DIRECT_LOG = tl.constexpr(DIRECT_LOG)  # below 87.3, where exp leaves fp32's normal range

    @triton.jit
    def _basis(xv, K):
        """Nearest knot c, the 3 normalised weights of knots c-1, c, c+1 (0 outside [0, K)) and their
        derivatives in x; the closed form of ``functional._sparse_weights``."""
        km1 = (K - 1).to(tl.float32)
        u = xv * km1
        c = tl.minimum(tl.maximum(tl.floor(u + 0.5), 0.0), km1)
        f = u - c
        has_lo = c > 0.0
        has_hi = c < km1
        lo = tl.where(has_lo, 0.5 * (0.5 - f) * (0.5 - f), 0.0)
        dlo = tl.where(has_lo, f - 0.5, 0.0)
        mid = 0.75 - f * f
        dmid = -2.0 * f
        hi = tl.where(has_hi, 0.5 * (0.5 + f) * (0.5 + f), 0.0)
        dhi = tl.where(has_hi, 0.5 + f, 0.0)
        tot = lo + mid + hi
        dtot = dlo + dmid + dhi
        w0 = lo / tot
        w1 = mid / tot
        w2 = hi / tot
        scale = km1 / tot
        d0 = (dlo - w0 * dtot) * scale
        d1 = (dmid - w1 * dtot) * scale
        d2 = (dhi - w2 * dtot) * scale
        ci = c.to(tl.int32)
        j0 = tl.maximum(ci - 1, 0)
        j2 = tl.minimum(ci + 1, K - 1)
        return j0, ci, j2, w0, w1, w2, d0, d1, d2

    @triton.jit
    def _fwd_kernel(x_ptr, delta_ptr, m_ptr, logsum_ptr, sign_ptr, N, H, DS, K, R, log_eps,
                    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
        # x: [H, DS, N] (transposed, contiguous); delta: [H, DS, K, R]; outputs [N, H, R] fp32.
        pid_n = tl.program_id(0)
        head = tl.program_id(1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rho = tl.arange(0, BLOCK_R)
        n_ok = n < N
        r_ok = rho < R
        ok = n_ok[:, None] & r_ok[None, :]
        logsum = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
        negatives = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.int32)
        zeros = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.int32)
        for d in range(DS):
            row = head * DS + d
            xv = tl.load(x_ptr + row.to(tl.int64) * N + n, mask=n_ok, other=0.5).to(tl.float32)
            j0, j1, j2, w0, w1, w2, _d0, _d1, _d2 = _basis(xv, K)
            base = delta_ptr + row * K * R + rho[None, :]
            s0 = tl.load(base + j0[:, None] * R, mask=ok, other=0.0).to(tl.float32) + 1.0
            s1 = tl.load(base + j1[:, None] * R, mask=ok, other=0.0).to(tl.float32) + 1.0
            s2 = tl.load(base + j2[:, None] * R, mask=ok, other=0.0).to(tl.float32) + 1.0
            phi = w0[:, None] * s0 + w1[:, None] * s1 + w2[:, None] * s2
            negatives += (phi < 0.0).to(tl.int32)
            zeros |= (phi == 0.0).to(tl.int32)
            logsum += tl.log(tl.maximum(tl.abs(phi), log_eps))
        sign = 1.0 - 2.0 * (negatives % 2).to(tl.float32)
        m = tl.where(zeros != 0, 0.0, sign * tl.exp(logsum))
        out = (n.to(tl.int64)[:, None] * H + head) * R + rho[None, :]
        tl.store(m_ptr + out, m, mask=ok)
        tl.store(logsum_ptr + out, logsum, mask=ok)
        tl.store(sign_ptr + out, sign, mask=ok)

    @triton.jit
    def _bwd_kernel(x_ptr, delta_ptr, logsum_ptr, gsign_ptr, grad_x_ptr, grad_s_ptr, N, H, DS, K, R,
                    TILES_PER_PART, log_eps, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_K: tl.constexpr):
        # One program per (seed dimension d, head, id partition); d varies fastest, so the programs
        # resident at once share a head and sweep the same id tiles (gsign/logsum stay in L2).
        # gsign = dL/dM * sign(M), [N, H, R]; grad_x: [H, DS, N] fp32; grad_s: [P, H, DS, K, R] fp32.
        d = tl.program_id(0)
        head = tl.program_id(1)
        part = tl.program_id(2)
        row = head * DS + d
        rho = tl.arange(0, BLOCK_R)
        knot = tl.arange(0, BLOCK_K)
        r_ok = rho < R
        base = delta_ptr + row * K * R + rho[None, :]
        # dL/dS[head, d] over this partition's ids: a [K, R] slab held in registers across the tiles.
        acc = tl.zeros((BLOCK_K, BLOCK_R), dtype=tl.float32)
        first = part * TILES_PER_PART
        last = tl.minimum(first + TILES_PER_PART, tl.cdiv(N, BLOCK_N))
        for blk in range(first, last):  # consecutive id tiles, always in the same order
            n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < N
            ok = n_ok[:, None] & r_ok[None, :]
            xv = tl.load(x_ptr + row.to(tl.int64) * N + n, mask=n_ok, other=0.5).to(tl.float32)
            j0, j1, j2, w0, w1, w2, d0, d1, d2 = _basis(xv, K)
            s0 = tl.load(base + j0[:, None] * R, mask=ok, other=0.0).to(tl.float32) + 1.0
            s1 = tl.load(base + j1[:, None] * R, mask=ok, other=0.0).to(tl.float32) + 1.0
            s2 = tl.load(base + j2[:, None] * R, mask=ok, other=0.0).to(tl.float32) + 1.0
            phi = w0[:, None] * s0 + w1[:, None] * s1 + w2[:, None] * s2
            nhr = (n.to(tl.int64)[:, None] * H + head) * R + rho[None, :]
            logsum = tl.load(logsum_ptr + nhr, mask=ok, other=0.0)
            # dL/dphi_d = dL/dM * (product of the other factors), in the log form.
            others = tl.exp(logsum - tl.log(tl.maximum(tl.abs(phi), log_eps)))
            gsign = tl.load(gsign_ptr + nhr, mask=ok, other=0.0)
            gphi = tl.where(phi < 0.0, -gsign, gsign) * others
            gx = tl.sum(gphi * (d0[:, None] * s0 + d1[:, None] * s1 + d2[:, None] * s2), axis=1)
            tl.store(grad_x_ptr + row.to(tl.int64) * N + n, gx, mask=n_ok)
            # dL/dS[knot, :] += sum_n Bhat_knot(x_n) dL/dphi[n, :]: a dense-basis matmul per tile.
            dense = (tl.where(knot[None, :] == j0[:, None], w0[:, None], 0.0)
                     + tl.where(knot[None, :] == j1[:, None], w1[:, None], 0.0)
                     + tl.where(knot[None, :] == j2[:, None], w2[:, None], 0.0))
            acc = tl.dot(tl.trans(dense), gphi, acc, input_precision="ieee")
        slab = grad_s_ptr + ((part * H + head) * DS + d).to(tl.int64) * K * R
        tl.store(slab + knot[:, None] * R + rho[None, :], acc, mask=(knot[:, None] < K) & r_ok[None, :])

    @triton.jit
    def _bwd_grouped_kernel(x_ptr, delta_ptr, logsum_ptr, gsign_ptr, grad_x_ptr, grad_s_ptr, N, H, DS, K, R,
                            TILES_PER_PART, log_eps, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_K: tl.constexpr, DIMS: tl.constexpr, PRECISION: tl.constexpr):
        # The "grouped" backward: ``_bwd_kernel``'s sums for DIMS consecutive seed dimensions per program
        # (grid (ceil(d_s / DIMS), head, partition)), so one load of a tile's logsum and gsign serves
        # DIMS dimensions, as [DIMS, BLOCK_N, BLOCK_R] tiles. Where the tile's logsum lies in
        # [-_DIRECT_LOG, _DIRECT_LOG] (everywhere near initialisation), exp(logsum) is normal and finite
        # and the product of the other factors is exp(logsum) / max(|phi|, log_eps): one exp per tile
        # and a division instead of a log and an exp per dimension, the same quantity as the log form's
        # up to rounding. The DIMS dL/dS slabs are one batched dot per tile at PRECISION.
        group = tl.program_id(0)
        head = tl.program_id(1)
        part = tl.program_id(2)
        dim = group * DIMS + tl.arange(0, DIMS)
        d_ok = dim < DS
        row = head * DS + dim  # [DIMS]
        rho = tl.arange(0, BLOCK_R)
        knot = tl.arange(0, BLOCK_K)
        r_ok = rho < R
        base = delta_ptr + (row * K * R)[:, None, None] + rho[None, None, :]
        x_rows = x_ptr + row.to(tl.int64)[:, None] * N
        gx_rows = grad_x_ptr + row.to(tl.int64)[:, None] * N
        acc = tl.zeros((DIMS, BLOCK_K, BLOCK_R), dtype=tl.float32)
        first = part * TILES_PER_PART
        last = tl.minimum(first + TILES_PER_PART, tl.cdiv(N, BLOCK_N))
        for blk in range(first, last):  # consecutive id tiles, always in the same order
            n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < N
            ok = n_ok[:, None] & r_ok[None, :]
            dn_ok = d_ok[:, None] & n_ok[None, :]
            ok3 = d_ok[:, None, None] & ok[None, :, :]
            xv = tl.load(x_rows + n[None, :], mask=dn_ok, other=0.5).to(tl.float32)  # [DIMS, BLOCK_N]
            j0, j1, j2, w0, w1, w2, d0, d1, d2 = _basis(xv, K)
            s0 = tl.load(base + j0[:, :, None] * R, mask=ok3, other=0.0).to(tl.float32) + 1.0
            s1 = tl.load(base + j1[:, :, None] * R, mask=ok3, other=0.0).to(tl.float32) + 1.0
            s2 = tl.load(base + j2[:, :, None] * R, mask=ok3, other=0.0).to(tl.float32) + 1.0
            phi = w0[:, :, None] * s0 + w1[:, :, None] * s1 + w2[:, :, None] * s2
            nhr = (n.to(tl.int64)[:, None] * H + head) * R + rho[None, :]
            logsum = tl.load(logsum_ptr + nhr, mask=ok, other=0.0)
            gsign = tl.load(gsign_ptr + nhr, mask=ok, other=0.0)
            floored = tl.maximum(tl.abs(phi), log_eps)
            lo = tl.min(tl.min(logsum, axis=1), axis=0)
            hi = tl.max(tl.max(logsum, axis=1), axis=0)
            if (lo >= -_DIRECT_LOG) & (hi <= _DIRECT_LOG):  # uniform per tile: no divergence
                others = tl.exp(logsum)[None, :, :] / floored
            else:
                others = tl.exp(logsum[None, :, :] - tl.log(floored))
            gphi = tl.where(phi < 0.0, -gsign[None, :, :], gsign[None, :, :]) * others
            gx = tl.sum(gphi * (d0[:, :, None] * s0 + d1[:, :, None] * s1 + d2[:, :, None] * s2), axis=2)
            tl.store(gx_rows + n[None, :], gx, mask=dn_ok)
            dense = (tl.where(knot[None, None, :] == j0[:, :, None], w0[:, :, None], 0.0)
                     + tl.where(knot[None, None, :] == j1[:, :, None], w1[:, :, None], 0.0)
                     + tl.where(knot[None, None, :] == j2[:, :, None], w2[:, :, None], 0.0))
            acc = tl.dot(tl.trans(dense, 0, 2, 1), gphi, acc, input_precision=PRECISION)
        slabs = grad_s_ptr + (((part * H + head) * DS + dim).to(tl.int64) * K * R)[:, None, None]
        tl.store(slabs + knot[None, :, None] * R + rho[None, None, :], acc,
                 mask=d_ok[:, None, None] & (knot[None, :, None] < K) & r_ok[None, None, :])


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (int(n) - 1).bit_length())


def _fwd_config(kappa: int, r: int) -> dict:
    """Tile and warps of the forward launch (``compile_report`` compiles the same)."""
    block_r = _pow2(r)
    wide = block_r > 64  # keep each thread's share of a [BLOCK_N, BLOCK_R] tile at <= 16 values
    return dict(BLOCK_N=16 if wide else BLOCK_N, BLOCK_R=block_r, num_warps=8 if wide else 4)


def _bwd_config(kappa: int, r: int, variant: str = DEFAULT_BACKWARD) -> dict:
    """Tile, warps and stages of the backward launch (``compile_report`` compiles the same).

    About 8 values of each [BLOCK_N, BLOCK_R] tile per thread: the loop body holds some eight such
    tiles (S rows, phi, logsum, gsign, dL/dphi, ...) beside the [kappa, r] slab, so 8 warps at r = 64
    keep it near 128 registers (two programs per SM). One stage: Triton's software pipelining of the
    loads takes 37-90 KB of shared memory per program, and at 4 warps, or with N, d_s, kappa and r not
    multiples of 16, it pushed the loop body into spills on sm_80.
    """
    block_r = _pow2(r)
    if variant == "grouped":
        # [GROUP_DIMS, 16, BLOCK_R] tiles: the reference's 8 values per thread at r = 64 with 8 warps
        # (16 at r > 64); 16 ids is the smallest K of ``tl.dot``. The slab matmul stays "ieee": tf32x3
        # compiled to about as many instructions in the loop (the operand splitting replaces the FMAs)
        # and to 164 registers instead of 112 on Triton 3.7, and the interpreter cannot check its rounding.
        return dict(BLOCK_N=16, BLOCK_R=block_r, BLOCK_K=_pow2(kappa), DIMS=GROUP_DIMS, PRECISION="ieee",
                    num_warps=8 if block_r <= 64 else 16, num_stages=1)
    block_n = BLOCK_N if block_r <= 64 else 16
    warps = max(4, min(8, block_n * block_r // 256))
    return dict(BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_K=_pow2(kappa), num_warps=warps, num_stages=1)


def _partitions(n: int, h: int, ds: int, block_n: int, dims: int = 1) -> tuple[int, int]:
    """(P, tiles per partition): the backward splits the id tiles into P runs of consecutive tiles,
    enough for about ``_TARGET_PROGRAMS`` programs over the h x ceil(d_s / dims) (head, dimension
    group) pairs and never more than there are tiles. A function of the shape only, so the reduction
    order is fixed."""
    tiles = -(-n // block_n)
    want = min(tiles, -(-_TARGET_PROGRAMS // (h * -(-ds // dims))))
    per = -(-tiles // max(1, want))
    return -(-tiles // per), per


def _on_device(t: torch.Tensor):
    """Launch on the tensor's GPU, not the current one (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _fwd_launch(xt, dl, m, logsum, sign, log_eps):
    """(grid, arguments, launch options) of the forward; ``compile_report`` compiles the same."""
    h, ds, n = xt.shape
    kappa, r = dl.shape[2], dl.shape[3]
    cfg = _fwd_config(kappa, r)
    return (triton.cdiv(n, cfg["BLOCK_N"]), h), (xt, dl, m, logsum, sign, n, h, ds, kappa, r, float(log_eps)), cfg


def _bwd_partitions(n: int, h: int, ds: int, kappa: int, r: int, variant: str) -> tuple[int, int]:
    """``_partitions`` for the tile and dimension group of ``variant``'s launch."""
    cfg = _bwd_config(kappa, r, variant)
    return _partitions(n, h, ds, cfg["BLOCK_N"], cfg.get("DIMS", 1))


def _bwd_buffers(xt, kappa, r, variant: str = DEFAULT_BACKWARD):
    """grad_x [h, d_s, N] and the dL/dS partials [P, h, d_s, kappa, r] (fp32, P from ``_partitions``).
    Every element is written by exactly one program, so neither is zero-filled."""
    h, ds, n = xt.shape
    parts, _ = _bwd_partitions(n, h, ds, kappa, r, variant)
    return (torch.empty(h, ds, n, dtype=torch.float32, device=xt.device),
            torch.empty(parts, h, ds, kappa, r, dtype=torch.float32, device=xt.device))


def _bwd_launch(xt, dl, logsum, gsign, grad_xt, grad_s, log_eps, variant: str = DEFAULT_BACKWARD):
    """(kernel, grid, arguments, launch options) of ``variant``'s backward; ``compile_report`` compiles
    the same."""
    h, ds, n = xt.shape
    kappa, r = dl.shape[2], dl.shape[3]
    cfg = _bwd_config(kappa, r, variant)
    dims = cfg.get("DIMS", 1)
    parts, per = _partitions(n, h, ds, cfg["BLOCK_N"], dims)
    assert grad_s.shape[0] == parts
    args = (xt, dl, logsum, gsign, grad_xt, grad_s, n, h, ds, kappa, r, per, float(log_eps))
    kernel = _bwd_grouped_kernel if variant == "grouped" else _bwd_kernel
    return kernel, (-(-ds // dims), h, parts), args, cfg


def _check_variant(backward: str) -> str:
    if backward not in BACKWARD_VARIANTS:
        raise ValueError(f"triton product: backward must be one of {', '.join(BACKWARD_VARIANTS)} "
                         f"(got {backward!r})")
    return backward


def _run_forward(xt, dl, log_eps):
    """The forward launch: (M, logsum, sign), each [N, h, r] fp32, from xt [h, d_s, N] and dl = Delta."""
    h, ds, n = xt.shape
    r = dl.shape[3]
    m = torch.empty(n, h, r, dtype=torch.float32, device=xt.device)
    logsum = torch.empty_like(m)
    sign = torch.empty_like(m)
    if n > 0:
        grid, args, cfg = _fwd_launch(xt, dl, m, logsum, sign, log_eps)
        with _on_device(xt):
            _fwd_kernel[grid](*args, **cfg)
    return m, logsum, sign


def _run_backward(xt, dl, logsum, gsign, log_eps, variant):
    """The backward launch of ``variant``: (dL/dx as [h, d_s, N], dL/dDelta [h, d_s, kappa, r]), fp32."""
    h, ds, n = xt.shape
    kappa, r = dl.shape[2], dl.shape[3]
    if n == 0:
        return (torch.zeros(h, ds, 0, dtype=torch.float32, device=xt.device),
                torch.zeros(h, ds, kappa, r, dtype=torch.float32, device=xt.device))
    grad_xt, partials = _bwd_buffers(xt, kappa, r, variant)
    kernel, grid, args, cfg = _bwd_launch(xt, dl, logsum, gsign, grad_xt, partials, log_eps, variant)
    with _on_device(xt):
        kernel[grid](*args, **cfg)
    # One partition (the kernel wrote dL/dS itself); else a fixed-order sum over the partitions.
    return grad_xt, partials[0] if partials.shape[0] == 1 else partials.sum(dim=0)


class _TritonProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, delta, log_eps, backward=DEFAULT_BACKWARD):
        xt = x.detach().permute(1, 2, 0).contiguous()  # [h, d_s, N]: coalesced loads per seed dimension
        dl = delta.detach().contiguous()
        m, logsum, sign = _run_forward(xt, dl, log_eps)
        ctx.save_for_backward(xt, dl, logsum, sign)
        ctx.log_eps = float(log_eps)
        ctx.variant = backward
        ctx.dtypes = (x.dtype, delta.dtype)
        return m

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_m):
        xt, dl, logsum, sign = ctx.saved_tensors
        x_dtype, delta_dtype = ctx.dtypes
        gsign = (grad_m.to(torch.float32) * sign).contiguous()
        grad_xt, grad_s = _run_backward(xt, dl, logsum, gsign, ctx.log_eps, ctx.variant)
        grad_x = grad_xt.permute(2, 0, 1).to(x_dtype) if ctx.needs_input_grad[0] else None
        grad_delta = grad_s.to(delta_dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_delta, None, None


def triton_separable_product(x, delta, num_knots, *, fallback=None, log_eps: float = 1e-30,
                             backward: str = DEFAULT_BACKWARD):
    """M [N, h, r] fp32 from x [N, h, d_s] and delta [h, d_s, kappa, r] (bf16 or fp32), with autograd.

    Same contract as the eager ``separable_product``; the log form needs no fallback (the argument is
    accepted for the registry's signature). ``backward`` picks the backward kernel, one of
    ``BACKWARD_VARIANTS`` (the same gradients up to fp32 rounding; see the module doc).
    """
    if delta.shape[2] != num_knots:
        raise ValueError(f"triton product: delta has {delta.shape[2]} knots, expected {num_knots}")
    return _TritonProduct.apply(x, delta, log_eps, _check_variant(backward))


# --- Ahead-of-time compilation report (no GPU needed: Triton's bundled ptxas builds the cubin) ---

REPORT_ARCHS = (90, 80)
# N of the compiled launches: table mode's chunk (and the anchor's id count), which Triton's launcher
# specialises as a multiple of 16, and one N that is not (unique mode's id counts are arbitrary).
REPORT_IDS = (4096, 4095)


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one compiled kernel (per thread unless said otherwise)."""

    kernel: str
    """"forward", "backward" (the reference backward) or "backward-<variant>" (e.g. "backward-grouped")."""
    arch: str
    """Target, e.g. "sm_90"."""
    label: str
    """"default" (the paper's d_s, h, kappa, r: ``LEVConfig``'s defaults) or the field changed."""
    delta_dtype: str
    """Dtype of Delta (x, M and the gradients are fp32 either way)."""
    n: int
    d_s: int
    h: int
    kappa: int
    r: int
    num_warps: int
    num_stages: int
    registers: int
    spill: int
    """Bytes of spill stores per thread (0: nothing spilled)."""
    spill_loads: int
    stack: int
    """Bytes of stack frame per thread."""
    shared: int
    """Bytes of shared memory per program (Triton's allocation)."""

    def line(self) -> str:
        return (f"{self.kernel:16s} {self.arch} {self.label:8s} Delta {self.delta_dtype:4s} "
                f"(d_s={self.d_s} h={self.h} kappa={self.kappa} r={self.r} N={self.n}, {self.num_warps} warps): "
                f"registers {self.registers}, spill {self.spill}, stack {self.stack}, "
                f"shared memory {self.shared} B")


def report_shapes() -> list:
    """(label, LEVConfig overrides, Delta dtype) of the report: the defaults in bf16 and fp32, and r = 128."""
    return [("default", {}, torch.bfloat16), ("default", {}, torch.float32),
            ("r=128", {"rank": 128}, torch.bfloat16), ("r=128", {"rank": 128}, torch.float32)]


def report_kernels() -> tuple:
    """The kernels of the report: "forward", then one "backward[-<variant>]" per ``BACKWARD_VARIANTS``."""
    return ("forward",) + tuple("backward" if v == "reference" else f"backward-{v}" for v in BACKWARD_VARIANTS)


def _launch_arguments(kernel: str, n: int, h: int, ds: int, kappa: int, r: int, delta_dtype):
    """The kernel and (grid, arguments, launch options) the autograd function would launch ``kernel``
    (a name of ``report_kernels()``) with, on meta tensors."""
    meta = dict(device="meta", dtype=torch.float32)
    xt = torch.empty(h, ds, n, **meta)
    dl = torch.empty(h, ds, kappa, r, device="meta", dtype=delta_dtype)
    out = torch.empty(n, h, r, **meta)
    if kernel == "forward":
        return _fwd_kernel, _fwd_launch(xt, dl, out, out, out, 1e-30)
    variant = kernel.partition("-")[2] or "reference"
    grad_xt, partials = _bwd_buffers(xt, kappa, r, variant)
    fn, *launch = _bwd_launch(xt, dl, out, out, grad_xt, partials, 1e-30, variant)
    return fn, tuple(launch)


def _compile(fn, args, cfg, arch: int) -> tuple[str, int]:
    """Compile ``fn`` for ``args`` as Triton's launcher would specialise them; (ptxas log, shared bytes)."""
    from triton import knobs
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.runtime.jit import native_specialize_impl

    constexprs = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
    signature, attrs = {}, {}
    for i, (name, value) in enumerate(zip(fn.arg_names, args)):
        kind, spec = native_specialize_impl(BaseBackend, value, False, True, True)  # the launcher's
        if kind == "constexpr":  # ints equal to 1, as the launcher specialises them
            constexprs[name] = spec
        else:
            signature[name] = kind
            if isinstance(spec, str):
                attrs[(i,)] = BaseBackend.parse_attr(spec)
    for name in constexprs:
        signature[name] = "constexpr"
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": cfg["num_warps"], "num_stages": cfg.get("num_stages", 3)}
    log = io.StringIO()
    with tempfile.TemporaryDirectory() as cache, knobs.cache.scope(), knobs.nvidia.scope(), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Triton 3.9's FP-fusion default notice
        knobs.cache.dir = cache  # a fresh cache, so ptxas runs and prints its log
        knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    return log.getvalue(), int(compiled.metadata.shared)


def _ptxas_figure(log: str, pattern: str, what: str) -> int:
    import re

    found = re.search(pattern, log)
    if found is None:
        raise RuntimeError(f"compile report: no {what} in the ptxas log of this Triton ({triton.__version__}): "
                           f"{log.strip()[:300]!r}")
    return int(found.group(1))


def compile_report(archs=REPORT_ARCHS, shapes=None, ids=REPORT_IDS, kernels=None) -> list:
    """Compile the forward and every backward variant (``report_kernels()``, or ``kernels``) for each
    arch (compute capability, e.g. 90), shape of ``report_shapes()`` (or ``shapes``) and number of ids
    N in ``ids`` ahead of time, with the launch options and argument specialisation of the layer's own
    launches, and return one ``KernelResources`` per kernel, arch, shape and N. Needs triton, not a
    GPU; raises RuntimeError with the reason when compilation cannot run here."""
    from megatron_lev.lev.config import LEVConfig

    if triton is None:
        raise RuntimeError("compile report: triton is not installed (pip install triton)")
    if interpreted():
        raise RuntimeError("compile report: the kernels were built for Triton's interpreter "
                           "(TRITON_INTERPRET=1 at import); run it in a process without TRITON_INTERPRET")
    records = []
    cases = [(n, *shape) for n in ids for shape in (shapes if shapes is not None else report_shapes())]
    for n, label, overrides, delta_dtype in cases:
        c = LEVConfig(**overrides)
        ds, h, kappa, r = c.seed_dim, c.num_heads, c.num_knots, c.rank
        for kernel in (kernels if kernels is not None else report_kernels()):
            fn, (_grid, args, cfg) = _launch_arguments(kernel, n, h, ds, kappa, r, delta_dtype)
            for arch in archs:
                try:
                    log, shared = _compile(fn, args, cfg, int(arch))
                except Exception as e:  # a missing ptxas, an unsupported arch, ...: say which and why
                    raise RuntimeError(f"compile report: compiling the {kernel} for sm_{arch} failed: "
                                       f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}") from e
                records.append(KernelResources(
                    kernel=kernel, arch=f"sm_{arch}", label=label, delta_dtype=str(delta_dtype).split(".")[-1]
                    .replace("bfloat16", "bf16").replace("float32", "fp32"), n=n, d_s=ds, h=h, kappa=kappa, r=r,
                    num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 3),
                    registers=_ptxas_figure(log, r"Used (\d+) registers", "register count"),
                    spill=_ptxas_figure(log, r"(\d+) bytes spill stores", "spill stores"),
                    spill_loads=_ptxas_figure(log, r"(\d+) bytes spill loads", "spill loads"),
                    stack=_ptxas_figure(log, r"(\d+) bytes stack frame", "stack frame"), shared=shared))
    return records
