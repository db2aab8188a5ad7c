"""The training step's NaN check reads one number per step, and allocates nothing buffer-sized."""

from __future__ import annotations

import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lev.training import loop
from tests.host_syncs import HostSyncs


class _LargestBool(TorchDispatchMode):
    """The largest boolean tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.bool:
                self.largest = max(self.largest, t.numel())
        return out


def _chunk(*grads):
    return types.SimpleNamespace(buffers=[types.SimpleNamespace(grad_data=g) for g in grads])


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_grads_finite_reads_one_number(bad):
    a, b = torch.randn(10_000), torch.randn(3_000)
    if bad is not None:
        b[1234] = bad
    model = [_chunk(a), _chunk(b)]
    with HostSyncs() as s, _LargestBool() as big:
        finite = loop._grads_finite(model)
    assert finite is (bad is None)
    assert s.events == ["_local_scalar_dense"]
    assert big.largest <= 1


def test_grads_finite_without_buffers_reads_the_parameters():
    p = torch.nn.Parameter(torch.zeros(4))
    p.main_grad = torch.tensor([0.0, float("nan"), 0.0, 0.0])
    assert loop._grads_finite([torch.nn.Linear(2, 2), types.SimpleNamespace(
        parameters=lambda: [p])]) is False
