"""The loop's own NaN check on the gradients (for an optimizer whose step computes no grad norm) reads one
number per step and allocates nothing buffer-sized; the loss scale is read only on the steps that log it."""

from __future__ import annotations

import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lev.training import faults, loop
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
        finite = faults.grads_finite(model)
    assert finite is (bad is None)
    assert s.events == ["_local_scalar_dense"]
    assert big.largest <= 1


def test_grads_finite_without_buffers_reads_the_parameters():
    p = torch.nn.Parameter(torch.zeros(4))
    p.main_grad = torch.tensor([0.0, float("nan"), 0.0, 0.0])
    assert faults.grads_finite([torch.nn.Linear(2, 2), types.SimpleNamespace(
        parameters=lambda: [p])]) is False


@pytest.mark.parametrize("iteration,tensorboard,reads", [(7, False, 0), (7, True, 1), (10, False, 1)])
def test_the_loss_scale_is_read_only_on_the_steps_that_log_it(monkeypatch, iteration, tensorboard, reads):
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)  # the log line's TFLOP/s
    counted = []
    sink = types.SimpleNamespace(add_scalar=lambda *a: None, flush=lambda: None)
    logger = types.SimpleNamespace(tb=sink if tensorboard else None, wandb=None, record=lambda *a: None,
                                   log=lambda *a: None, training_line=lambda **kw: "",
                                   scalars=lambda *a, **kw: None)
    optimizer = types.SimpleNamespace(param_groups=[{"default_config": True, "lr": 1e-3}],
                                      get_loss_scale=lambda: counted.append(1) or torch.tensor([1.0]))
    from megatron_lev.arguments import build_parser
    from megatron_lev.config import RunConfig

    args = build_parser().parse_args([])  # every logging flag at its default
    args.__dict__.update(tensorboard_log_interval=1, log_interval=10, seq_length=8, train_iters=100, world_size=1,
                         num_microbatches=1,
                         tensorboard_dir="tb" if tensorboard else None)
    run = types.SimpleNamespace(rc=RunConfig.from_saved_args(vars(args)),
                                logger=logger, optimizer=optimizer, flops={}, peak=None)
    state = loop._State(iteration=iteration, consumed_train_samples=4 * iteration)
    loop._log_iteration(run, state, loop._Interval(start=0.0, iters=1, samples=4), 2.0, 1.0, True, False, 4)
    assert len(counted) == reads
