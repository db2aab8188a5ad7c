"""LEV's launches per forward+backward, counted exactly on the CPU so that a regression fails.

A launch is an aten operator that runs a kernel on a GPU (``bench/step_ops.launches``: no views, no
allocations, no host reads) or a call of the fused product's kernel (numba's forward and backward here,
Triton's on CUDA). The count is LEV's own: from the ids to the rows and back to the parameters' gradients,
with the gradients unset before the step (as megatron's DDP hands each one on and clears it), so autograd's
accumulation into existing ``.grad`` (one add per parameter) is not counted.
"""

import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from step_ops import HOST_READ, launches  # noqa: E402

from megatron_lev.kernels import lev_cpu, register_default_kernels  # noqa: E402
from megatron_lev.lev import LEVConfig, LEVEmbedding  # noqa: E402

LAUNCHES_AT_MOST = 30  # issue 48's floor: a lookup is 4


class _Launches(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if launches(name, func) and name != HOST_READ:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _count(monkeypatch, emb, ids):
    counter = _Launches()
    for name in ("forward", "backward"):  # the fused kernel's two calls, invisible to the dispatcher
        real = getattr(lev_cpu, name)

        def counted(*a, _real=real, _name=name):
            counter.ops[f"lev_cpu.{_name}"] += 1
            return _real(*a)

        monkeypatch.setattr(lev_cpu, name, counted)
    out = emb(ids)
    grad = torch.ones_like(out)
    for p in emb.parameters():
        p.grad = None
    counter.ops.clear()  # the first call's (it compiles and allocates)
    with counter:
        out = emb(ids)
        out.backward(grad)
    return counter.ops


def test_token_mode_forward_backward_launches_are_counted_exactly(monkeypatch):
    register_default_kernels()
    cfg = LEVConfig(compute_mode="token")
    emb = LEVEmbedding(1000, 64, cfg)
    assert cfg.resolved_basis("cpu") == "fused"  # numba is a dependency: the default CPU path
    ops = _count(monkeypatch, emb, torch.randint(0, 1000, (2, 64)))
    # Forward: id check (1, a host read on the CPU), digits (3), seed gather-sum (2), projection GEMM,
    # group norm, sigmoid (3), product (x transposed, S = 1 + Delta, the kernel: 3), W as [D, h r] and
    # the output GEMM with the offset (2) = 14 + kernel; backward: output GEMM (3), dL/dM x M and its
    # transpose (2), kernel, sigmoid, transpose, group norm (3), projection GEMM (3), seed (1) = 12 + kernel.
    assert sum(ops.values()) == 28, dict(ops)
    assert sum(ops.values()) <= LAUNCHES_AT_MOST
    assert ops["lev_cpu.forward"] == ops["lev_cpu.backward"] == 1


def test_the_fused_token_path_equals_the_fp64_reference():
    """The fused path (stacked projection GEMM, group norm, one output GEMM with the offset, numba product)
    against the same layer in fp64 (the eager dense basis): relative error below 1e-4, about 30 fp32
    roundings (2^-24 each) compounded through a product over d_s factors; measured 2.4e-6."""
    import copy

    register_default_kernels()
    emb = LEVEmbedding(1000, 64, LEVConfig(compute_mode="token"))
    ref = copy.deepcopy(emb).double()
    ids = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(0))
    grad = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(1))
    out, want = emb(ids), ref(ids)
    out.backward(grad)
    want.backward(grad.double())
    assert ((out.double() - want).norm() / want.norm()).item() < 1e-4
    for (name, p), q in zip(emb.named_parameters(), ref.parameters()):
        assert ((p.grad.double() - q.grad).norm() / q.grad.norm()).item() < 1e-4, name
