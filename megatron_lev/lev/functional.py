"""Pure functions of the LEV layer: digits, the quadratic B-spline basis, the separable product.

The separable product is the memory-critical part (spec, "Cost"): the per-dimension factors
phi[n, l, d, rho] form an N x h x d_s x r tensor that must never be held at once. ``separable_product``
is a custom autograd function that walks the seed dimensions in chunks of ``product_chunk``,
accumulating sum_d log|phi| and the number of negative factors in N x h x r buffers, and recomputes each
chunk's phi in the backward pass. Its extra peak memory is O(N h r + N h product_chunk r).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

__all__ = [
    "token_digits",
    "bspline_basis_dense",
    "bspline_basis_sparse",
    "separable_product",
    "separable_product_reference",
    "compute_dtype",
    "register_fused_product",
    "has_fused_product",
]


def token_digits(ids: torch.Tensor, base: int, num_digits: int) -> torch.Tensor:
    """Digits of token ids, most significant first: i_m = floor(i / b^(k-m)) mod b, shape [..., k]."""
    ids = ids.long()
    # Built on the ids' device (a kernel, not a copy of host data: no host sync on an accelerator).
    powers = torch.pow(base, torch.arange(num_digits - 1, -1, -1, dtype=torch.long, device=ids.device))
    return torch.div(ids.unsqueeze(-1), powers, rounding_mode="floor") % base


def _quadratic_bspline(t: torch.Tensor) -> torch.Tensor:
    """Centred quadratic B-spline of t = (kappa-1)|x - g_j| >= 0 (spec step 4), before normalisation."""
    inner = 0.75 - t * t
    outer = 0.5 * (1.5 - t) ** 2
    zero = torch.zeros((), dtype=t.dtype, device=t.device)
    return torch.where(t < 0.5, inner, torch.where(t < 1.5, outer, zero))


def bspline_basis_dense(x: torch.Tensor, num_knots: int) -> torch.Tensor:
    """Normalised quadratic B-spline basis on knots g_j = j/(kappa-1): [...] -> [..., kappa].

    x is expected in [0, 1] (a sigmoid output); the nearest knot then always has B >= 1/2, so the
    normalising sum is bounded away from zero.
    """
    kappa = int(num_knots)
    knots = torch.arange(kappa, dtype=x.dtype, device=x.device) / (kappa - 1)
    t = (kappa - 1) * (x.unsqueeze(-1) - knots).abs()
    basis = _quadratic_bspline(t)
    return basis / basis.sum(dim=-1, keepdim=True)


def bspline_basis_sparse(x: torch.Tensor, num_knots: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The same normalised basis as ``bspline_basis_dense``, from the 3 possibly non-zero knots.

    Returns (index [..., 3] long, weight [..., 3]). For u = (kappa-1) x and c = the knot nearest to u,
    only knots c-1, c, c+1 can have t < 3/2. At the ends a knot index outside [0, kappa) is clamped
    into range and gets weight exactly 0, so sum_o weight_o * S[index_o] equals the dense contraction.
    """
    return _sparse_weights(x, num_knots)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """max(fp32, input dtypes): the product's logs and exp run in fp32 even for bf16/fp16 inputs."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _sparse_weights(x: torch.Tensor, num_knots: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(index, weight) of the 3 possibly non-zero knots, written with u = (kappa-1) x and its nearest knot c.

    Same values as ``bspline_basis_sparse`` (a cheaper closed form: with f = u - c in [-1/2, 1/2] the
    three weights are (1/2 - f)^2/2, 3/4 - f^2, (1/2 + f)^2/2). Differentiable in x.
    """
    kappa = int(num_knots)
    u = x * (kappa - 1)
    centre = torch.floor(u.detach() + 0.5).clamp_(0, kappa - 1)
    f = u - centre
    lo = 0.5 * (0.5 - f) ** 2
    mid = 0.75 - f * f
    hi = 0.5 * (0.5 + f) ** 2
    # End knots: the neighbour outside [0, kappa) gets weight exactly 0 (its index is clamped).
    lo = torch.where(centre > 0, lo, torch.zeros((), dtype=x.dtype, device=x.device))
    hi = torch.where(centre < kappa - 1, hi, torch.zeros((), dtype=x.dtype, device=x.device))
    weight = torch.stack((lo, mid, hi), dim=-1)
    weight = weight / weight.sum(dim=-1, keepdim=True)
    offsets = torch.arange(-1, 2, dtype=torch.long, device=x.device)  # -1, 0, 1 (no host-to-device copy)
    index = (centre.long().unsqueeze(-1) + offsets).clamp_(0, kappa - 1)
    return index, weight


class _Workspace:
    """Chunk-sized buffers reused across the seed-dimension chunks of one call.

    Reusing them (``out=``) matters on CPU: a fresh multi-hundred-MB allocation per chunk is returned
    to the OS on free and page-faults again on the next chunk, which measured 2-3x slower.
    """

    def __init__(self, h, c, n, r, kappa, dtype, device):
        self.phi = torch.empty(h * c * n * r, dtype=dtype, device=device)
        self.dense = torch.empty(h * c * n * kappa, dtype=dtype, device=device)
        self.n, self.r, self.kappa = n, r, kappa

    def phi_view(self, hc):
        return self.phi[: hc * self.n * self.r].view(hc, self.n, self.r)

    def dense_view(self, hc):
        return self.dense[: hc * self.n * self.kappa].view(hc, self.n, self.kappa)


def _phi_chunk(index, weight, s_c, basis, ws):
    """phi for one chunk of seed dimensions (no autograd), as a [h*c, N, r] view of the workspace.

    index, weight: [h, c, N, 3] sparse basis; s_c = 1 + Delta: [h, c, kappa, r]. Since the basis sums
    to one, phi = 1 + sum_j Bhat_j Delta_j = sum_j Bhat_j S_j, which saves a pass over the big tensor.
    """
    h, c, n, _ = index.shape
    kappa, r = s_c.shape[-2:]
    if basis == "dense":
        dense = ws.dense_view(h * c).zero_().scatter_add_(-1, index.reshape(h * c, n, 3), weight.reshape(h * c, n, 3))
        return torch.bmm(dense, s_c.reshape(h * c, kappa, r), out=ws.phi_view(h * c))
    phi = _sparse_contract(index, weight, s_c)
    return ws.phi_view(h * c).copy_(phi.view(h * c, n, r))


def _sparse_contract(index, weight, s_c):
    """phi[h, c, n, :] = sum_o weight[h, c, n, o] * s_c[h, c, index[h, c, n, o], :], differentiable.

    A fused gather-and-weighted-sum (embedding_bag), so the 3 gathered rows are never materialised.
    """
    h, c, n, three = index.shape
    kappa, r = s_c.shape[-2:]
    offset = (torch.arange(h * c, device=index.device) * kappa).view(h, c, 1, 1)
    out = torch.nn.functional.embedding_bag(
        (index + offset).view(-1, three),
        s_c.reshape(h * c * kappa, r),
        per_sample_weights=weight.reshape(-1, three),
        mode="sum",
    )
    return out.view(h, c, n, r)


def _chunk_grads(x_c, s_c, grad_phi, num_knots, basis, need_x, need_s, ws):
    """(grad x_c, grad s_c) of sum(phi * grad_phi) for one chunk; the basis derivative comes from autograd.

    grad_phi: [h*c, N, r]. Returns grads shaped like x_c [h, c, N] and s_c [h, c, kappa, r].
    """
    h, c, n = x_c.shape
    kappa, r = s_c.shape[-2:]
    x_c = x_c.detach().requires_grad_(need_x)
    with torch.enable_grad():
        index, weight = _sparse_weights(x_c, num_knots)
    if basis == "dense":
        # phi = B @ S: the two matmul gradients explicitly, then autograd through the 3 basis weights.
        s3 = s_c.reshape(h * c, kappa, r)
        grad_s = None
        if need_s:
            dense = ws.dense_view(h * c).zero_()
            dense.scatter_add_(-1, index.reshape(h * c, n, 3), weight.detach().reshape(h * c, n, 3))
            grad_s = torch.bmm(dense.transpose(1, 2), grad_phi).view(h, c, kappa, r)
        grad_x = None
        if need_x:
            grad_dense = torch.bmm(grad_phi, s3.transpose(1, 2), out=ws.dense_view(h * c))
            grad_w = torch.gather(grad_dense, -1, index.reshape(h * c, n, 3)).view(h, c, n, 3)
            (grad_x,) = torch.autograd.grad(weight, x_c, grad_w)
        return grad_x, grad_s
    s_req = s_c.detach().requires_grad_(need_s)
    with torch.enable_grad():
        phi = _sparse_contract(index, weight, s_req)
    inputs = [t for t, need in ((x_c, need_x), (s_req, need_s)) if need]
    grads = list(torch.autograd.grad(phi, inputs, grad_phi.view(h, c, n, r)))
    grad_x = grads.pop(0) if need_x else None
    grad_s = grads.pop(0) if need_s else None
    return grad_x, grad_s


# Fast path bounds: a chunk product, and M, must lie in [_LO, _HI] for the direct (prod / division)
# form; otherwise the whole call uses the log form, which is exact at phi = 0 and for any magnitude.
_LO, _HI = 1e-30, 1e30


class _SeparableProduct(torch.autograd.Function):
    """M[n, l, rho] = prod_d phi[n, l, d, rho] in (sign, log-magnitude) form; see the module doc.

    Forward, per chunk of seed dimensions: the chunk's product (one pass over the chunk) goes into the
    [h, N, r] log-magnitude and sign buffers. If any chunk product is 0, subnormal or out of
    [1e-30, 1e30] (possible only far from initialisation), the call is redone in the log form:
    sum_d log(max(|phi_d|, log_eps)) and the parity of negative factors (sign(0) = +1).
    Backward, per chunk: phi is recomputed and dM/dphi_d = product of the other factors is
    g * M / phi_d when every |M| lies in [1e-30, 1e30] (the forward's fast path held), else
    g * sign(M) * sign(phi_d) * exp(logsum - log max(|phi_d|, log_eps)), finite and non-zero at phi_d = 0.
    """

    @staticmethod
    def forward(ctx, x, delta, num_knots, basis, product_chunk, log_eps, log_form_only):
        dtype = compute_dtype(x, delta)
        n, h, ds = x.shape
        r = delta.shape[-1]
        xt = x.detach().to(dtype).permute(1, 2, 0).contiguous()  # [h, ds, N]
        st = delta.detach().to(dtype) + 1.0  # S = 1 + Delta
        chunks = [(d0, min(ds, d0 + product_chunk)) for d0 in range(0, ds, product_chunk)]
        ws = _Workspace(h, min(ds, product_chunk), n, r, num_knots, dtype, x.device)

        def run(log_form: bool):
            logsum = torch.zeros(h, n, r, dtype=dtype, device=x.device)
            sign = torch.ones(h, n, r, dtype=dtype, device=x.device)
            negatives = torch.zeros(h, n, r, dtype=torch.int32, device=x.device) if log_form else None
            zeros = torch.zeros(h, n, r, dtype=torch.bool, device=x.device) if log_form else None
            bad = torch.zeros((), dtype=torch.bool, device=x.device)
            for d0, d1 in chunks:
                index, weight = _sparse_weights(xt[:, d0:d1], num_knots)
                phi = _phi_chunk(index, weight, st[:, d0:d1], basis, ws).view(h, d1 - d0, n, r)
                if log_form:
                    negatives += (phi < 0).sum(dim=1, dtype=torch.int32)
                    zeros |= (phi == 0).any(dim=1)
                    logsum += phi.abs_().clamp_min_(log_eps).log_().sum(dim=1)
                else:
                    p = phi.prod(dim=1)
                    mag = p.abs()
                    bad |= ((mag >= _LO) & (mag <= _HI)).logical_not_().any()
                    sign.mul_(torch.sign(p))
                    logsum += mag.clamp_min_(log_eps).log_()
            if log_form:
                sign = 1.0 - 2.0 * (negatives % 2).to(dtype)
            return logsum, sign, bad, zeros

        with torch.no_grad():
            if not log_form_only:
                logsum, sign, bad, zeros = run(log_form=False)
                # One host sync per call decides the form (the values are identical up to rounding).
                fast_forward = not bool(bad)
            else:
                # No host sync (accelerators): the log form, exact for every magnitude, throughout.
                fast_forward = False
            if not fast_forward:
                logsum, sign, _, zeros = run(log_form=True)
            lo, hi = math.log(_LO), math.log(_HI)
            fast_backward = fast_forward and bool(((logsum >= lo) & (logsum <= hi)).all())
            m = sign * logsum.exp()  # [h, N, r]
            if zeros is not None:
                # An exact zero factor makes M exactly 0; the backward keeps the floored logsum, so the
                # gradient of that factor is still the product of the others.
                m.masked_fill_(zeros, 0.0)
        ctx.save_for_backward(x, delta, logsum, sign, m)
        ctx.num_knots, ctx.basis, ctx.product_chunk, ctx.log_eps = num_knots, basis, product_chunk, log_eps
        ctx.fast_backward = fast_backward
        return m.permute(1, 0, 2).contiguous()  # [N, h, r]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_m):
        x, delta, logsum, sign, m = ctx.saved_tensors
        dtype = logsum.dtype
        n, h, ds = x.shape
        r = delta.shape[-1]
        need_x, need_delta = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.zeros(h, ds, n, dtype=dtype, device=x.device) if need_x else None
        grad_delta = torch.zeros(delta.shape, dtype=dtype, device=x.device) if need_delta else None
        g = grad_m.to(dtype).permute(1, 0, 2)  # [h, N, r]
        if ctx.fast_backward:
            g_m = (g * m).unsqueeze(1)  # g * M, [h, 1, N, r]
        else:
            g_signed = (g * sign).unsqueeze(1)  # g * sign(M)
            logsum_c = logsum.unsqueeze(1)
        xt = x.detach().to(dtype).permute(1, 2, 0).contiguous()
        st = delta.detach().to(dtype) + 1.0
        ws = _Workspace(h, min(ds, ctx.product_chunk), n, r, ctx.num_knots, dtype, x.device)
        with torch.no_grad():
            for d0 in range(0, ds, ctx.product_chunk):
                d1 = min(ds, d0 + ctx.product_chunk)
                x_c, s_c = xt[:, d0:d1], st[:, d0:d1]
                index, weight = _sparse_weights(x_c, ctx.num_knots)
                phi = _phi_chunk(index, weight, s_c, ctx.basis, ws)
                phi4 = phi.view(h, d1 - d0, n, r)
                # dM/dphi_d = product of the other factors, computed in phi's buffer.
                if ctx.fast_backward:
                    torch.div(g_m, phi4, out=phi4)
                else:
                    sgn = torch.where(phi4 < 0, -1.0, 1.0).to(dtype)  # sign(0) = +1
                    phi4.abs_().clamp_min_(ctx.log_eps).log_()  # |phi| floored at log_eps
                    phi4.neg_().add_(logsum_c).exp_().mul_(sgn).mul_(g_signed)
                    del sgn
                gx, gs = _chunk_grads(x_c, s_c, phi, ctx.num_knots, ctx.basis, need_x, need_delta, ws)
                if need_x:
                    grad_x[:, d0:d1] = gx
                if need_delta:
                    grad_delta[:, d0:d1] = gs
        if need_x:
            grad_x = grad_x.permute(2, 0, 1).to(x.dtype)
        if need_delta:
            grad_delta = grad_delta.to(delta.dtype)
        return grad_x, grad_delta, None, None, None, None, None


def separable_product(
    x: torch.Tensor,
    delta: torch.Tensor,
    num_knots: int,
    *,
    basis: str = "dense",
    product_chunk: int = 16,
    log_eps: float = 1e-30,
    log_form_only: Optional[bool] = None,
) -> torch.Tensor:
    """Rank-r separable product M[n, l, rho] = prod_d (1 + sum_j Bhat_j(x[n, l, d]) delta[l, d, j, rho]).

    x: [N, h, d_s] coordinates in [0, 1]; delta: [h, d_s, kappa, r] (S = 1 + delta).
    Returns M [N, h, r] in max(fp32, input dtype). Never holds the N x h x d_s x r factor tensor:
    peak extra memory is O(N h r + N h product_chunk r). ``basis`` is "dense" or "sparse" (eager), or
    "fused" / "triton" (a registered kernel; fp64 inputs and "fused" without a kernel run the eager form).
    ``log_form_only`` (default: True off the CPU) skips the eager form's direct-product fast path, whose
    choice costs a host sync per call; the values agree up to rounding.
    """
    if x.dim() != 3 or delta.dim() != 4:
        raise ValueError(f"separable_product expects x [N, h, d_s] and delta [h, d_s, kappa, r], got "
                         f"{tuple(x.shape)} and {tuple(delta.shape)}")
    if x.shape[1:] != delta.shape[:2] or delta.shape[2] != num_knots:
        raise ValueError(f"separable_product: shapes x {tuple(x.shape)} and delta {tuple(delta.shape)} "
                         f"do not match (kappa={num_knots})")
    if basis in ("fused", "triton"):
        fused = _FUSED_PRODUCTS.get((basis, x.device.type))
        if fused is None and basis == "triton":
            raise ValueError(
                f"--lev-basis triton: no Triton kernel for {x.device.type} tensors; it needs a CUDA device and "
                "the triton package (TRITON_INTERPRET=1 runs it on CPU, for tests); use --lev-basis auto")
        if fused is not None and compute_dtype(x, delta) == torch.float32:
            return fused(
                x, delta, int(num_knots), log_eps=float(log_eps),
                fallback=lambda x_, d_: separable_product(
                    x_, d_, num_knots, basis="dense", product_chunk=product_chunk, log_eps=log_eps),
            )
        basis = "sparse" if x.device.type == "cuda" else "dense"
    if basis not in ("dense", "sparse"):
        raise ValueError(f"separable_product: basis must be 'dense', 'sparse', 'fused' or 'triton', got {basis!r}")
    if log_form_only is None:
        log_form_only = x.device.type != "cpu"
    return _SeparableProduct.apply(
        x, delta, int(num_knots), basis, max(1, int(product_chunk)), float(log_eps), bool(log_form_only)
    )


# Fused kernels by (basis, device type), registered by accelerator modules (megatron_lev.kernels) so
# that this file stays plain torch. Signature: fn(x, delta, num_knots, *, log_eps, fallback) -> M [N, h, r]
# fp32, where fallback(x, delta) is the eager form for inputs the kernel flags (products out of range).
_FUSED_PRODUCTS: dict = {}


def register_fused_product(device_type: str, fn, basis: str = "fused") -> None:
    """Make ``fn`` the separable product of ``basis`` ("fused" or "triton") for tensors on ``device_type``."""
    _FUSED_PRODUCTS[(basis, device_type)] = fn


def has_fused_product(device_type: str, basis: str = "fused") -> bool:
    return (basis, device_type) in _FUSED_PRODUCTS


def separable_product_reference(x: torch.Tensor, delta: torch.Tensor, num_knots: int) -> torch.Tensor:
    """The plain formula with torch.prod over the full N x h x d_s x r tensor (tests only)."""
    b = bspline_basis_dense(x, num_knots)  # [N, h, d_s, kappa]
    phi = 1.0 + torch.einsum("nhdk,hdkr->nhdr", b, delta)
    return phi.prod(dim=2)
