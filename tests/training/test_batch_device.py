"""Batches reach the model's device.

The training loop's micro-batches come from CPU datasets; on a GPU the model lives on the current CUDA
device, so every batch tensor must be moved there before the forward. On CPU both are the CPU, so these
checks stand in another device for the model's (``meta``: tensors without storage, which a real CPU tensor
cannot be mixed with) and see that everything the model and the loss receive is on it.
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron_lev.training import data as data_mod
from megatron_lev.training import loop


def _batches(n=3, b=2, s=5, with_mask=False):
    for i in range(n):
        tokens = torch.arange(b * s, dtype=torch.int64).view(b, s) + i
        batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(b, s, dtype=torch.float32),
                 "position_ids": torch.arange(s).repeat(b, 1)}
        if with_mask:
            batch["attention_mask"] = torch.ones(b, 1, s, s, dtype=torch.bool)
        yield batch


@pytest.fixture
def meta_device(monkeypatch):
    dev = torch.device("meta")
    monkeypatch.setattr(data_mod, "batch_device", lambda: dev, raising=False)
    return dev


@pytest.mark.parametrize("with_mask", [False, True])
def test_get_batch_moves_every_tensor(meta_device, with_mask):
    tokens, labels, loss_mask, attention_mask, position_ids = data_mod.get_batch(_batches(with_mask=with_mask))
    for name, t in (("tokens", tokens), ("labels", labels), ("loss_mask", loss_mask),
                    ("position_ids", position_ids)) + ((("attention_mask", attention_mask),) if with_mask else ()):
        assert t.device == meta_device, f"{name} stayed on {t.device}"
    assert tokens.dtype == labels.dtype == position_ids.dtype == torch.long
    assert loss_mask.dtype == torch.float32
    if not with_mask:
        assert attention_mask is None


def test_forward_step_hands_the_model_device_tensors(meta_device):
    seen = {}

    class Model(torch.nn.Module):
        training = True

        def forward(self, tokens, position_ids, attention_mask, labels=None):
            seen.update(tokens=tokens.device, position_ids=position_ids.device, labels=labels.device)
            return torch.zeros(labels.shape, device=meta_device)

    rc = types.SimpleNamespace(run=types.SimpleNamespace(inject_nan_at_iteration=None),
                               model=types.SimpleNamespace(params_dtype_name="bfloat16"))
    output, loss_fn = loop._forward_step(loop._State(), rc, _batches(), Model())
    assert set(seen.values()) == {meta_device}
    # The loss multiplies the model's output by the batch's loss mask: both on the model's device.
    loss, num_tokens, report = loss_fn(output)
    assert loss.device == meta_device and num_tokens.device == meta_device


def test_batch_device_is_the_cpu_without_cuda():
    assert not torch.cuda.is_available()
    assert data_mod.batch_device() == torch.device("cpu")
