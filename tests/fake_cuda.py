"""Fake CUDA tensors on a machine without a GPU, for device-placement checks.

With the CUDA build of torch, ``FakeTensorMode`` creates tensors that carry a CUDA device and shapes but
no data: operations run their meta kernels, and an operation that mixes a CPU tensor with a CUDA one
raises ``FakeTensorDeviceMismatchError``, as it would on a GPU. Reading a value (``.item()``) raises too,
so a hidden host read shows up as well. Backward does not run (autograd asks for a real device).

``fake_cuda()`` also lifts the CPU backend's redirections (``device="cuda"`` -> CPU in factories and
``Tensor.to``) for its duration and makes ``torch.cuda.current_device()`` answer 0, so megatron-core's
own device choices are the ones a GPU run makes; ``cuda_visible()`` additionally makes
``torch.cuda.is_available()`` answer True, for code that picks the device from it.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_lev.compat import cpu as compat


def cuda_build() -> bool:
    return torch.version.cuda is not None


@contextlib.contextmanager
def _patched(pairs):
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in pairs]
    for obj, name, value in pairs:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


@contextlib.contextmanager
def fake_cuda():
    """``with fake_cuda() as mode:``; see ``to_fake_cuda`` for moving a built model in."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    pairs = [(torch, n, getattr(getattr(torch, n), "__megatron_lev_original__", getattr(torch, n)))
             for n in compat._FACTORIES]
    pairs += [(torch.Tensor, "to", torch._C.TensorBase.to), (torch.Tensor, "cuda", torch._C.TensorBase.cuda),
              (torch.cuda, "current_device", lambda: 0)]
    with _patched(pairs), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


@contextlib.contextmanager
def cuda_visible():
    with _patched([(torch.cuda, "is_available", lambda: True)]):
        yield


def to_fake_cuda(mode, module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The module's parameters and buffers as fake CUDA tensors of ``dtype``; plain tensor attributes
    (e.g. RoPE's inverse frequencies, moved to the device at the first forward) as fake CPU tensors."""
    module = module.to(device="cuda", dtype=dtype)
    for m in module.modules():
        for name, value in list(vars(m).items()):
            if type(value) is torch.Tensor:
                setattr(m, name, mode.from_tensor(value))
    return module
