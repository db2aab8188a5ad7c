"""CPU backend for megatron-core (0.16.1 and 0.19.x).

megatron-core assumes CUDA throughout: it asks ``torch.cuda.current_device()`` for buffer
devices, builds tensors with ``device="cuda"``, synchronises streams, keeps its RNG tracker in
the CUDA generator and checks ``tensor.type() == 'torch.cuda.FloatTensor'`` in the optimizer.
On a machine without CUDA (development boxes, CI) this module redirects each of those to the
CPU so that the real megatron-core code paths (TP layers, GPTModel, pipeline schedules, DDP,
distributed optimizer, dist_checkpointing) run unchanged on gloo.

Design:
- ``apply()`` is idempotent and does nothing when CUDA is available, so GPU runs use
  megatron-core untouched.
- Every patch counts its hits (``hit_counts()``) so tests can show which ones a code path
  exercised, and a megatron-core upgrade that stops needing one is noticed.
- Tensor factories are wrapped individually (not a global ``TorchFunctionMode``) so that
  ordinary ops pay no per-call dispatch cost.
- The patches are process-wide: they are for rank processes. Loading a Hugging Face model in a
  patched process is not supported (transformers 5 leaves a Llama's rotary buffers uninitialised
  when ``torch.tensor`` is wrapped); the HF evaluation and export paths never apply them.
  ``remove()`` puts every patched attribute back (``destroy_distributed`` calls it when its
  ``init_distributed`` installed the backend), so a process that goes on after its distributed work,
  such as a test process, gets torch as it was.
"""

from __future__ import annotations

import collections
import functools
import logging
from typing import Any, Callable, Dict

import torch

_HITS: "collections.Counter[str]" = collections.Counter()
_APPLIED = False
# (owner, attribute, original value) of every patch, for remove().
_SAVED: "list[tuple[Any, str, Any]]" = []
_RNG_FILTER: "list[logging.Filter]" = []


def _set(owner: Any, name: str, value: Any) -> None:
    _SAVED.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)

# Tensor factories that megatron-core calls with a CUDA device.
_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "rand", "randn",
    "randint", "empty_like", "zeros_like", "ones_like", "full_like", "empty_strided",
)


def _is_cuda_device(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int):  # an ordinal means a CUDA device in torch
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _count(name: str) -> None:
    _HITS[name] += 1


def _wrap_factory(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
            _count(f"factory.{name}")
        return fn(*args, **kwargs)

    wrapper.__megatron_lev_original__ = fn  # type: ignore[attr-defined]
    return wrapper


def _patch_factories() -> None:
    for name in _FACTORIES:
        fn = getattr(torch, name)
        if not hasattr(fn, "__megatron_lev_original__"):
            _set(torch, name, _wrap_factory(name, fn))


def _patch_tensor_methods() -> None:
    orig_to = torch.Tensor.to
    orig_type = torch.Tensor.type

    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        _count("Tensor.cuda")
        return self

    def to(self, *args, **kwargs):
        if args and _is_cuda_device(args[0]):
            args = ("cpu",) + args[1:]
            _count("Tensor.to")
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
            _count("Tensor.to")
        return orig_to(self, *args, **kwargs)

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        # megatron's optimizer and clip_grads assert 'torch.cuda.FloatTensor' etc.
        if dtype is None and not kwargs:
            name = orig_type(self)
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                _count("Tensor.type")
                return "torch.cuda." + name[len("torch."):]
            return name
        return orig_type(self, dtype, non_blocking, **kwargs)

    _set(torch.Tensor, "cuda", cuda)
    _set(torch.Tensor, "to", to)
    _set(torch.Tensor, "type", type_)


def _patch_cuda_module() -> None:
    def counted(name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            _count(f"torch.cuda.{name}")
            return fn(*args, **kwargs)

        return wrapper

    replacements: Dict[str, Callable] = {
        "current_device": lambda: "cpu",
        "synchronize": lambda device=None: None,
        "set_device": lambda device: None,
        # megatron-core 0.19: DDP's bucket group start_grad_sync/finish_grad_sync ask
        # torch.cuda.current_stream() (to wait on CUDA-graph wgrad events) on every sync, even
        # without overlap; the CPU stream's wait_event/wait_stream are no-ops.
        "current_stream": lambda device=None: torch.cpu.current_stream(),
        # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator
        # directly and make the "all devices" variant a no-op to avoid recursion.
        "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "manual_seed_all": lambda seed: None,
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda new_state, device="cuda": torch.set_rng_state(new_state),
    }
    for name, fn in replacements.items():
        _set(torch.cuda, name, counted(name, fn))
    _set(torch.cuda.random, "get_rng_state", torch.cuda.get_rng_state)
    _set(torch.cuda.random, "set_rng_state", torch.cuda.set_rng_state)


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        _count("megatron.rng.get")
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        _count("megatron.rng.set")
        torch.set_rng_state(new_state)

    _set(mrandom, "_get_cuda_rng_state", get_state)
    _set(mrandom, "_set_cuda_rng_state", set_state)

    # On CPU the tracker's "CUDA" generator is the CPU generator, so fork() always sees the
    # CPU state change; its warning says nothing here.
    class _DropCpuRngWarning(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if "CPU RNG state changed within GPU RNG context" in record.getMessage():
                _count("megatron.rng.fork_warning")
                return False
            return True

    _RNG_FILTER.append(_DropCpuRngWarning())
    logging.getLogger(mrandom.__name__).addFilter(_RNG_FILTER[-1])


def apply(force: bool = False) -> bool:
    """Install the CPU backend when CUDA is unavailable. Returns True when it is active.

    Call once at process start-up, before any model is built. ``force`` installs it even
    where CUDA is present (tests only).
    """
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available() and not force:
        return False
    _patch_factories()
    _patch_tensor_methods()
    _patch_cuda_module()
    _patch_megatron_rng()
    _APPLIED = True
    return True


def remove() -> None:
    """Undo ``apply()``: every patched attribute gets its original back (a no-op when not applied)."""
    global _APPLIED
    while _SAVED:
        owner, name, value = _SAVED.pop()  # last patched first: an attribute patched twice ends original
        setattr(owner, name, value)
    # torch caches the factories that device contexts (``with torch.device("meta")``) redirect at their
    # first use: cached while the wrappers were installed, it would leave the originals out, so a model
    # built under a meta device context afterwards (transformers' from_pretrained) would be built on the
    # CPU and keep uninitialised buffers.
    constructors = getattr(getattr(torch.utils, "_device", None), "_device_constructors", None)
    if hasattr(constructors, "cache_clear"):
        constructors.cache_clear()
    while _RNG_FILTER:
        from megatron.core.tensor_parallel import random as mrandom

        logging.getLogger(mrandom.__name__).removeFilter(_RNG_FILTER.pop())
    _APPLIED = False


def reset_hit_counts() -> None:
    """Start the counts of ``hit_counts()`` again (a long-lived rank reports them per job)."""
    _HITS.clear()


def is_applied() -> bool:
    return _APPLIED


def hit_counts() -> Dict[str, int]:
    """How often each patch fired in this process (name -> count)."""
    return dict(_HITS)
