"""Counting what would block the host on an accelerator, on the CPU.

Run a function on the ``meta`` device (every branch of the code that tests ``device.type != "cpu"``
takes its accelerator side) or on the CPU, and record each operation that on a GPU waits for the
device or copies host data to it:
- a tensor built from Python data on a non-CPU device (``torch.tensor(list, device=...)``) or copied
  there from a CPU tensor, including the CPU scalar of ``t[idx] = True``: a host-to-device copy from
  pageable memory;
- ``.item()`` / ``bool()`` / ``int()`` of a tensor (``_local_scalar_dense``), and the ops whose output
  size depends on the values (``nonzero``, ``unique``, ``masked_select``): a device-to-host sync.
"""

from __future__ import annotations

from typing import List

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

DATA_DEPENDENT = {"nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select",
                  "_local_scalar_dense", "is_nonzero", "equal"}


def _off_cpu(device) -> bool:
    return device is not None and torch.device(device).type != "cpu"


class _Factories(TorchFunctionMode):
    def __init__(self, events: List[str]):
        super().__init__()
        self.events = events

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and _off_cpu(kwargs.get("device")):
            self.events.append(f"host data -> {kwargs['device']} ({func.__name__})")
        return func(*args, **kwargs)


class _Ops(TorchDispatchMode):
    def __init__(self, events: List[str]):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if name in DATA_DEPENDENT:
            self.events.append(name)
        elif name in ("index_put_", "index_put", "_index_put_impl_"):
            # A CPU scalar value written into a device tensor is copied there first, blocking.
            value = args[2] if len(args) > 2 else kwargs.get("values")
            if isinstance(value, torch.Tensor) and value.device.type == "cpu" and _off_cpu(args[0].device):
                self.events.append(f"cpu value -> {args[0].device} ({name})")
        elif name in ("_to_copy", "copy_"):
            src = args[1] if name == "copy_" else args[0]
            dst = kwargs.get("device") if name == "_to_copy" else args[0].device
            if isinstance(src, torch.Tensor) and src.device.type == "cpu" and _off_cpu(dst):
                self.events.append(f"cpu tensor -> {dst} ({name})")
        return func(*args, **kwargs)


class HostSyncs:
    """``with HostSyncs() as s: ...`` then ``s.events``: the operations listed in the module docstring."""

    def __enter__(self):
        self.events: List[str] = []
        self._modes = [_Factories(self.events), _Ops(self.events)]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)
