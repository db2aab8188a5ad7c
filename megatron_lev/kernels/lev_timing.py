"""The fused Triton product alone: kernel timings per backward variant, and their error on the device.

Signatures (what ``bench/gpu_check.py`` calls; ``bench/lev_kernel_timing.py`` is the CLI)::

    default_shapes() -> tuple[KernelShape, ...]
    time_kernels(shapes=None, variants=None, *, reps=20, warmup=3, device=None,
                 delta_dtype=torch.bfloat16, seed=0) -> list[dict]
        one dict per (shape, variant): shape, n, h, d_s, kappa, r, variant, partitions, delta_dtype,
        device, timer ("cuda-events" or "perf_counter"), reps, fwd_ms, bwd_ms, bwd_fwd_ratio
    compare_backward(shapes=None, variants=None, *, device=None, seed=0, tolerance=GRAD_TOLERANCE)
        -> list[dict]
        one dict per (shape, variant): shape, n, h, d_s, kappa, r, variant, partitions, device,
        max_rel_err_m, max_rel_err_grad_x, max_rel_err_grad_delta, tolerance, ok

``variants`` defaults to ``lev_triton.BACKWARD_VARIANTS``, ``device`` to "cuda" where CUDA is available,
else "cpu" (Triton's interpreter: TRITON_INTERPRET=1 before ``lev_triton`` is imported, and tiny
shapes, as the tests run it). ``default_shapes()`` are the paper's defaults (one id partition for the
reference backward) and the 1.2B config's tensor-parallel rank at TP=2 (4 heads per rank: 2
partitions), both at 4,096 ids: table mode's chunk.

Timing: the forward is the forward kernel's launch; the backward is the variant's backward launch plus
torch's sum over its id partitions where it has several: what ``triton_separable_product``'s autograd
runs, without the eager transposes and casts around it. Each is timed by CUDA events around the launch
(on CPU by ``time.perf_counter``), ``warmup`` calls first (they compile), and reported as the median of
``reps`` in ms. No host sync inside a timed region beyond the events' own.

Errors: max |got - want| / max |want| per output, the Triton product from fp32 inputs against the eager
dense product in fp64 on the same device (``megatron_lev.lev.functional.separable_product``), for M,
dL/dx and dL/dDelta under one random upstream gradient.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Iterable, Optional

import torch

from megatron_lev.lev.functional import separable_product

from . import lev_triton

__all__ = ["KernelShape", "default_shapes", "time_kernels", "compare_backward", "GRAD_TOLERANCE"]

GRAD_TOLERANCE = 2e-5
"""Largest accepted max-relative error against the fp64 eager product (the kernel tests' rtol)."""


@dataclasses.dataclass(frozen=True)
class KernelShape:
    """One launch shape of the separable product (per tensor-parallel rank)."""

    label: str
    n: int
    """Ids (rows of x)."""
    h: int
    """Heads on this rank."""
    d_s: int
    kappa: int
    r: int


def default_shapes() -> tuple:
    """The paper's defaults, and the 1.2B config's rank at TP=2 (h = 8 / 2: several id partitions)."""
    return (KernelShape("default", 4096, 8, 128, 16, 64), KernelShape("tp2", 4096, 4, 128, 16, 64))


def _device(device: Optional[str]) -> str:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not lev_triton.available():
        raise RuntimeError("LEV kernel timing: triton is not installed (pip install triton)")
    if torch.device(device).type not in lev_triton.devices():
        raise RuntimeError(f"LEV kernel timing: the Triton kernels run on {lev_triton.devices() or 'nothing'} "
                           f"here, not {device} (CPU needs TRITON_INTERPRET=1 before megatron_lev.kernels "
                           "is imported)")
    return device


def _variants(variants: Optional[Iterable[str]]) -> list:
    names = list(lev_triton.BACKWARD_VARIANTS if variants is None else variants)
    for v in names:
        lev_triton._check_variant(v)
    return names


def _inputs(shape: KernelShape, device: str, delta_dtype, seed: int):
    """x [N, h, d_s] in (0, 1), Delta ~ N(0, 0.1^2) (the layer's initialisation) and an upstream dL/dM."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(shape.n, shape.h, shape.d_s, generator=g, dtype=torch.float64)
    delta = 0.1 * torch.randn(shape.h, shape.d_s, shape.kappa, shape.r, generator=g, dtype=torch.float64)
    up = torch.randn(shape.n, shape.h, shape.r, generator=g, dtype=torch.float64)
    return x.to(device), delta.to(device=device, dtype=delta_dtype), up.to(device)


def _timer(device: str):
    """fn -> its duration in ms: CUDA events on a GPU, perf_counter elsewhere."""
    if device.startswith("cuda"):
        def run(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()  # the measurement itself: read the events once the launch is done
            return start.elapsed_time(end)
        return run, "cuda-events"

    def run(fn):
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    return run, "perf_counter"


def _median_ms(timer, fn, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(timer(fn) for _ in range(reps))


def time_kernels(shapes=None, variants=None, *, reps: int = 20, warmup: int = 3, device: Optional[str] = None,
                 delta_dtype=torch.bfloat16, seed: int = 0) -> list:
    """Median forward and backward ms of the fused product per shape and backward variant (module doc)."""
    if reps < 1 or warmup < 0:
        raise ValueError(f"LEV kernel timing: reps must be >= 1 and warmup >= 0 (got {reps}, {warmup})")
    device = _device(device)
    names = _variants(variants)
    timer, kind = _timer(device)
    rows = []
    for shape in (default_shapes() if shapes is None else shapes):
        x, delta, up = _inputs(shape, device, delta_dtype, seed)
        with torch.no_grad():
            xt = x.float().permute(1, 2, 0).contiguous()
            dl = delta.contiguous()
            fwd_ms = _median_ms(timer, lambda: lev_triton._run_forward(xt, dl, 1e-30), reps, warmup)
            _m, logsum, sign = lev_triton._run_forward(xt, dl, 1e-30)
            gsign = (up.float() * sign).contiguous()
            for variant in names:
                bwd_ms = _median_ms(timer, lambda v=variant: lev_triton._run_backward(xt, dl, logsum, gsign, 1e-30, v),
                                    reps, warmup)
                rows.append(dict(
                    shape=shape.label, n=shape.n, h=shape.h, d_s=shape.d_s, kappa=shape.kappa, r=shape.r,
                    variant=variant, partitions=_partitions(shape, variant), delta_dtype=str(delta_dtype).split(".")[-1],
                    device=device, timer=kind, reps=reps, fwd_ms=fwd_ms, bwd_ms=bwd_ms,
                    bwd_fwd_ratio=bwd_ms / fwd_ms if fwd_ms > 0 else float("inf")))
    return rows


def _partitions(shape: KernelShape, variant: str) -> int:
    return lev_triton._bwd_partitions(shape.n, shape.h, shape.d_s, shape.kappa, shape.r, variant)[0]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = float(want.abs().max())
    return float((got.double() - want).abs().max()) / (scale if scale > 0 else 1.0)


def compare_backward(shapes=None, variants=None, *, device: Optional[str] = None, seed: int = 0,
                     tolerance: float = GRAD_TOLERANCE) -> list:
    """Max relative errors of M, dL/dx and dL/dDelta per shape and backward variant against the fp64
    eager product on the same device (module doc); ``ok`` where all three are within ``tolerance``."""
    device = _device(device)
    names = _variants(variants)
    rows = []
    for shape in (default_shapes() if shapes is None else shapes):
        x, delta, up = _inputs(shape, device, torch.float64, seed)
        xx, dd = x.clone().requires_grad_(), delta.clone().requires_grad_()
        m = separable_product(xx, dd, shape.kappa, basis="dense")
        (m * up).sum().backward()
        want = (m.detach(), xx.grad, dd.grad)
        del m, xx, dd
        for variant in names:
            xx, dd = x.float().requires_grad_(), delta.float().requires_grad_()
            m = lev_triton.triton_separable_product(xx, dd, shape.kappa, backward=variant)
            (m * up.float()).sum().backward()
            errs = [_rel_err(g, w) for g, w in zip((m.detach(), xx.grad, dd.grad), want)]
            rows.append(dict(
                shape=shape.label, n=shape.n, h=shape.h, d_s=shape.d_s, kappa=shape.kappa, r=shape.r,
                variant=variant, partitions=_partitions(shape, variant), device=device,
                max_rel_err_m=errs[0], max_rel_err_grad_x=errs[1], max_rel_err_grad_delta=errs[2],
                tolerance=tolerance, ok=all(e <= tolerance for e in errs)))
            del m, xx, dd
    return rows
