"""megatron-core's import-time ``torch.compile`` decorations, deferred to their first call.

``megatron.core.jit.jit_fuser`` is ``torch.compile`` from torch 2.2, and about forty of megatron-core's fused
functions (bias-GeLU, bias-SwiGLU, bias-dropout-add, the MoE helpers...) are decorated with it when
``megatron.core`` is imported. ``torch.compile(fn)`` compiles nothing until ``fn`` is called, but it imports
TorchDynamo and Inductor to build its wrapper: 1-2 s of CPU per process (both stacks, measured),
a third of ``import megatron.core``, paid by every rank, every tool and ``--help``, also where those
functions never run (CPU, fusions off, conversions, evaluation without them).

While ``megatron.core`` itself is imported, ``torch.compile(fn, **options)`` is replaced by a wrapper that
calls ``torch.compile(fn, **options)`` at the first call of ``fn`` and that compiled function from then on:
what runs on a device is what megatron-core asked for, compiled at the moment it would have been anyway. megatron-core's
``jit_fuser`` keeps the wrapper, so its modules imported later are deferred the same way. A call whose
tensors are all on the CPU runs the function as written, uncompiled: Inductor builds C++ for the CPU, and the
first build of megatron's fused cross-entropy took about 100 s of CPU on 2 cores (125 s of a 3-iteration
test run), then several seconds of tracing in every new process, for milliseconds of work at the sizes CPU
runs have (tests, the quickstart); a device's calls compile as before. Other callers of
``torch.compile`` (this project's, a user's) are untouched. A process that builds a torch optimizer still
imports TorchDynamo there (``torch.optim`` disables it around ``add_param_group``).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import threading

__all__ = ["defer_megatron_compiles"]

_TARGET = "megatron.core"


def _cpu_only(args, kwargs) -> bool:
    """Some tensor among the arguments, and every one of them on the CPU."""
    tensor = sys.modules["torch"].Tensor
    devices = {a.device.type for a in (*args, *kwargs.values()) if isinstance(a, tensor)}
    return devices == {"cpu"}


def _deferred(compile_fn):
    """``torch.compile``'s signature; compiles at the first call of the decorated function."""

    def deferred_compile(model=None, **options):
        if model is None:  # used as @torch.compile(**options)
            return lambda fn: deferred_compile(fn, **options)
        compiled = []
        lock = threading.Lock()

        @functools.wraps(model)
        def first_call_compiles(*args, **kwargs):
            if _cpu_only(args, kwargs):
                return model(*args, **kwargs)
            if not compiled:
                with lock:
                    if not compiled:
                        compiled.append(compile_fn(model, **options))
            return compiled[0](*args, **kwargs)

        return first_call_compiles

    return deferred_compile


class _DeferringLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        import torch

        real = torch.compile
        torch.compile = _deferred(real)
        try:
            self._loader.exec_module(module)
        finally:
            torch.compile = real


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of ``megatron.core``'s own import, once; inert from then on.

    It stays in ``sys.meta_path``: removing it while another thread walks that list (an import of its
    own) would make the walk skip a finder, and that import fail with a ModuleNotFoundError.
    """

    def __init__(self) -> None:
        self._done = False

    def find_spec(self, name, path=None, target=None):
        if name != _TARGET or self._done:
            return None
        self._done = True  # one import: the package's own
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _DeferringLoader(spec.loader)
        return spec


def defer_megatron_compiles() -> None:
    """Defer megatron-core's import-time ``torch.compile`` decorations (see the module docstring). Call it
    before ``megatron.core`` is imported; a no-op once it is (or when already called). Imports nothing."""
    if _TARGET in sys.modules or any(isinstance(f, _Finder) and not f._done for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
