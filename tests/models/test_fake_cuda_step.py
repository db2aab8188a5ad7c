"""A whole training forward of every input arm with the model on (fake) CUDA in bf16, fed by the loop's
own data path: every tensor the model, the LEV layer and the loss meet is on the model's device.

Needs the CUDA build of torch (``tests/fake_cuda.py``), so these carry the ``cuda_build`` mark:
``make test-fake-cuda`` runs them in a Python 3.12 environment with that build; ``make test`` (the CPU
wheel) deselects them and counts them in its summary.
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.fake_cuda import cuda_visible, fake_cuda, to_fake_cuda
from tests.models import _harness as H

pytestmark = pytest.mark.cuda_build

ARMS = [(arm, "token") for arm in H.ALL_ARMS] + [("lev", "table")]


@pytest.fixture(scope="module")
def parallel_state():
    from megatron_lev.distributed import destroy_distributed, init_distributed, set_seed

    setup = init_distributed(tp=1, pp=1, vpp=None, backend="gloo", timeout_minutes=1)
    set_seed(1)
    yield
    destroy_distributed(setup)


def _samples(n=2):
    """Micro-batches as the datasets give them: CPU tensors."""
    g = torch.Generator().manual_seed(3)
    for _ in range(n):
        tokens = torch.randint(0, H.VOCAB, (H.MBS, H.SEQ), generator=g)
        yield {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": torch.ones(H.MBS, H.SEQ),
               "position_ids": torch.arange(H.SEQ).repeat(H.MBS, 1)}


def _model(arm, mode):
    import dataclasses

    mc = H.model_config(arm)
    mc = dataclasses.replace(mc, lev=dataclasses.replace(mc.lev, compute_mode=mode))
    return H.build_chunks(mc, H.transformer_config(mc))[0]


@pytest.mark.parametrize("arm,mode", ARMS)
def test_training_forward_on_cuda_meets_no_cpu_tensor(parallel_state, arm, mode):
    from megatron_lev.training import data as data_mod
    from megatron_lev.training import loop

    model = _model(arm, mode)
    batches = _samples()
    rc = types.SimpleNamespace(run=types.SimpleNamespace(inject_nan_at_iteration=None),
                               model=types.SimpleNamespace(params_dtype_name="bfloat16"))
    with fake_cuda() as fm:
        model = to_fake_cuda(fm, model, torch.bfloat16)
        with cuda_visible():
            assert data_mod.batch_device() == torch.device("cuda", 0)
            for _ in range(2):  # table mode: the first micro-batch builds the table, the second reads it
                output, loss_fn = loop._forward_step(loop._State(), rc, batches, model)
                loss, num_tokens, _ = loss_fn(output)
    assert output.device == loss.device == num_tokens.device == torch.device("cuda", 0)
    assert output.shape == (H.MBS, H.SEQ)


def test_cpu_batches_are_caught(parallel_state, monkeypatch):
    """The check itself: batches left on the CPU (no move in get_batch) fail at the first lookup."""
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    from megatron_lev.training import data as data_mod
    from megatron_lev.training import loop

    model = _model("tied", "token")
    monkeypatch.setattr(data_mod, "batch_device", lambda: torch.device("cpu"))
    with fake_cuda() as fm:
        model = to_fake_cuda(fm, model, torch.bfloat16)
        with pytest.raises(FakeTensorDeviceMismatchError):
            rc = types.SimpleNamespace(run=types.SimpleNamespace(inject_nan_at_iteration=None),
                                       model=types.SimpleNamespace(params_dtype_name="bfloat16"))
            loop._forward_step(loop._State(), rc, _samples(), model)
