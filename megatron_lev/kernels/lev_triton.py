"""Fused Triton kernel for LEV's separable product (GPU; Triton's interpreter on CPU for tests).

The eager form (``megatron_lev.lev.functional``) writes the N x h x d_s x r factors phi through
memory chunk by chunk, several times per step. Here one program takes a block of ids and one head and
walks the d_s seed dimensions: for each it evaluates the 3 non-zero normalised B-spline weights of
x[n, l, d], gathers the 3 matching rows of S = 1 + Delta (a few MB, cache-resident), forms
phi[n, :] in registers and adds log|phi| into an fp32 accumulator, so neither the basis nor the
factors ever reach memory. The coordinates x (N x h x d_s, 1/r of the factors) come from eager torch,
so the seed and head projections run as cuBLAS GEMMs; the projection of M to D is a GEMM after it.

Numerics (spec step 6): the product is accumulated in fp32 in sign/log form for every input dtype
(bf16 or fp32 parameters): logsum = sum_d log(max(|phi_d|, log_eps)), sign from the parity of
negative factors (sign(0) = +1), M = 0 exactly where a factor is exactly 0. The backward recomputes
phi per tile and uses dM/dphi_d = sign(M) sign(phi_d) exp(logsum - log max(|phi_d|, log_eps)): the
product of the other factors, finite and non-zero at phi_d = 0 and exact near fp32 underflow. These
are the eager log form's formulas, so both agree to fp32 rounding.

Determinism: no float atomics. dL/dx is written by the program that owns (ids, head). dL/dS, a sum
over ids, is reduced in two fixed stages: each program of a fixed partition of the ids into
``_partitions(N, h)`` groups owns its own [d_s, kappa, r] slab of a partial buffer (its per-tile
contribution is a small matmul, dense basis^T @ dL/dphi, accumulated in a fixed order); the partials
are then summed by torch in a fixed order. The partition depends only on N and h, so two runs give
bit-identical gradients on any device.

Any d_s, kappa, r and h: the rank and the knots are padded to powers of two (at least 16, the
smallest ``tl.dot`` tile) and masked; d_s and h are loop/grid bounds.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is an optional accelerator
    triton = None

__all__ = ["available", "interpreted", "devices", "triton_separable_product", "BLOCK_N"]

BLOCK_N = 32  # ids per program tile
_TARGET_PROGRAMS = 512  # backward: about this many (partition, head) programs (a few per SM)
_PARTIAL_BYTES = 256 << 20  # backward: cap on the dL/dS partial buffer


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
    def _bwd_kernel(x_ptr, delta_ptr, logsum_ptr, gsign_ptr, grad_x_ptr, partial_ptr, N, H, DS, K, R, P,
                    log_eps, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        # gsign = dL/dM * sign(M), [N, H, R]; grad_x: [H, DS, N] fp32; partial: [P, H, DS, K, R] fp32.
        part = tl.program_id(0)
        head = tl.program_id(1)
        rho = tl.arange(0, BLOCK_R)
        knot = tl.arange(0, BLOCK_K)
        r_ok = rho < R
        slab_ok = (knot[:, None] < K) & r_ok[None, :]
        num_blocks = tl.cdiv(N, BLOCK_N)
        for blk in range(part, num_blocks, P):  # a fixed set of id tiles, always in the same order
            n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < N
            ok = n_ok[:, None] & r_ok[None, :]
            nhr = (n.to(tl.int64)[:, None] * H + head) * R + rho[None, :]
            gsign = tl.load(gsign_ptr + nhr, mask=ok, other=0.0)
            logsum = tl.load(logsum_ptr + nhr, mask=ok, other=0.0)
            for d in range(DS):
                row = head * DS + d
                xv = tl.load(x_ptr + row.to(tl.int64) * N + n, mask=n_ok, other=0.5).to(tl.float32)
                j0, j1, j2, w0, w1, w2, d0, d1, d2 = _basis(xv, K)
                base = delta_ptr + row * K * R + rho[None, :]
                s0 = tl.load(base + j0[:, None] * R, mask=ok, other=0.0).to(tl.float32) + 1.0
                s1 = tl.load(base + j1[:, None] * R, mask=ok, other=0.0).to(tl.float32) + 1.0
                s2 = tl.load(base + j2[:, None] * R, mask=ok, other=0.0).to(tl.float32) + 1.0
                phi = w0[:, None] * s0 + w1[:, None] * s1 + w2[:, None] * s2
                # dL/dphi_d = dL/dM * (product of the other factors), in the log form.
                others = tl.exp(logsum - tl.log(tl.maximum(tl.abs(phi), log_eps)))
                gphi = tl.where(phi < 0.0, -gsign, gsign) * others
                a0 = tl.sum(gphi * s0, axis=1)
                a1 = tl.sum(gphi * s1, axis=1)
                a2 = tl.sum(gphi * s2, axis=1)
                tl.store(grad_x_ptr + row.to(tl.int64) * N + n, a0 * d0 + a1 * d1 + a2 * d2, mask=n_ok)
                # dL/dS[knot, :] += sum_n Bhat_knot(x_n) dL/dphi[n, :]: a dense-basis matmul per tile.
                dense = (tl.where(knot[None, :] == j0[:, None], w0[:, None], 0.0)
                         + tl.where(knot[None, :] == j1[:, None], w1[:, None], 0.0)
                         + tl.where(knot[None, :] == j2[:, None], w2[:, None], 0.0))
                contrib = tl.dot(tl.trans(dense), gphi, input_precision="ieee")
                slab = partial_ptr + ((part * H + head) * DS + d).to(tl.int64) * K * R
                offs = knot[:, None] * R + rho[None, :]
                acc = tl.load(slab + offs, mask=slab_ok, other=0.0)
                tl.store(slab + offs, acc + contrib, mask=slab_ok)


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (int(n) - 1).bit_length())


def _partitions(n: int, h: int, ds: int, kappa: int, r: int) -> int:
    """Id groups of the backward's dL/dS reduction: a function of the shape only (determinism)."""
    blocks = -(-n // BLOCK_N)
    by_memory = max(1, _PARTIAL_BYTES // (4 * h * ds * kappa * r))
    return max(1, min(blocks, max(1, _TARGET_PROGRAMS // h), by_memory))


class _TritonProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, delta, log_eps):
        n, h, ds = x.shape
        kappa, r = delta.shape[2], delta.shape[3]
        xt = x.detach().permute(1, 2, 0).contiguous()  # [h, d_s, N]: coalesced loads per seed dimension
        dl = delta.detach().contiguous()
        m = torch.empty(n, h, r, dtype=torch.float32, device=x.device)
        logsum = torch.empty_like(m)
        sign = torch.empty_like(m)
        if n > 0:
            grid = (triton.cdiv(n, BLOCK_N), h)
            _fwd_kernel[grid](xt, dl, m, logsum, sign, n, h, ds, kappa, r, float(log_eps),
                              BLOCK_N=BLOCK_N, BLOCK_R=_pow2(r))
        ctx.save_for_backward(xt, dl, logsum, sign)
        ctx.log_eps = float(log_eps)
        ctx.dtypes = (x.dtype, delta.dtype)
        return m

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_m):
        xt, dl, logsum, sign = ctx.saved_tensors
        h, ds, n = xt.shape
        kappa, r = dl.shape[2], dl.shape[3]
        gsign = (grad_m.to(torch.float32) * sign).contiguous()
        grad_xt = torch.zeros(h, ds, n, dtype=torch.float32, device=xt.device)
        parts = _partitions(n, h, ds, kappa, r)
        partial = torch.zeros(parts, h, ds, kappa, r, dtype=torch.float32, device=xt.device)
        if n > 0:
            _bwd_kernel[(parts, h)](xt, dl, logsum, gsign, grad_xt, partial, n, h, ds, kappa, r, parts,
                                    ctx.log_eps, BLOCK_N=BLOCK_N, BLOCK_R=_pow2(r), BLOCK_K=_pow2(kappa))
        x_dtype, delta_dtype = ctx.dtypes
        grad_x = grad_xt.permute(2, 0, 1).to(x_dtype) if ctx.needs_input_grad[0] else None
        grad_delta = partial.sum(dim=0).to(delta_dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_delta, None


def triton_separable_product(x, delta, num_knots, *, fallback=None, log_eps: float = 1e-30):
    """M [N, h, r] fp32 from x [N, h, d_s] and delta [h, d_s, kappa, r] (bf16 or fp32), with autograd.

    Same contract as the eager ``separable_product``; the log form needs no fallback (the argument is
    accepted for the registry's signature).
    """
    if delta.shape[2] != num_knots:
        raise ValueError(f"triton product: delta has {delta.shape[2]} knots, expected {num_knots}")
    return _TritonProduct.apply(x, delta, log_eps)
