"""The same transformer body for every input arm of a seed: the input side draws its initial weights from a
stream of its own.

megatron-core's ``GPTModel`` initialises its embedding (``LanguageModelEmbedding``: the V x D table, and
learned positions) before the decoder and the output layer, from the same generators (the default CPU one
under ``use_cpu_initialization``, else the tensor-parallel tracker's model-parallel stream and the current
device's). An arm of this fork builds no such table and its input module comes after the head, so, with
shared generators, the decoder and head of a seed would start from other numbers for every input arm.

``InputSideStreams`` forks them instead: the body and head draw from the generators as the seed left
them, whatever the arm, and the input side (megatron's table, or our arm) draws from streams derived from
those states (a hash of each state, so every tensor-parallel rank and seed gets its own). Nothing of V x D
is drawn and thrown away, so an arm of ours still never allocates such a tensor.
"""

from __future__ import annotations

import hashlib
from typing import Dict, Optional

import torch

_SALT = b"megatron-lev input side"


def _tracker():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return get_cuda_rng_tracker()


def _device_streams() -> bool:
    """Whether the current device has generators of its own (megatron's tracker states are theirs)."""
    return torch.cuda.is_available()


def _seed_of(state: torch.Tensor) -> int:
    digest = hashlib.sha256(_SALT + state.detach().cpu().numpy().tobytes()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


def _cpu_state(seed: int) -> torch.Tensor:
    return torch.Generator().manual_seed(seed).get_state()


def _device_state(seed: int) -> torch.Tensor:
    """A device generator state for ``seed``, made as megatron's tracker makes its states."""
    saved = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(seed)
    state = torch.cuda.get_rng_state()
    torch.cuda.set_rng_state(saved)
    return state


class InputSideStreams:
    """Captures the generators at the start of a model's construction; ``input_side()`` switches them to the
    derived input-side streams, ``body()`` back to where the body's construction is (the captured states
    the first time, then wherever the body had got to)."""

    def __init__(self) -> None:
        self._main = self._capture()
        self._input = self._derive(self._main)
        self._on_input = False

    @staticmethod
    def _capture() -> Dict[str, object]:
        tracker = _tracker()
        return {"cpu": torch.get_rng_state(),
                "device": torch.cuda.get_rng_state() if _device_streams() else None,
                "tracker": dict(tracker.get_states()) if tracker.is_initialized() else None}

    @staticmethod
    def _derive(states: Dict[str, object]) -> Dict[str, object]:
        tracker: Optional[dict] = states["tracker"]
        return {"cpu": _cpu_state(_seed_of(states["cpu"])),
                "device": None if states["device"] is None else _device_state(_seed_of(states["device"])),
                "tracker": None if tracker is None else {
                    # A CUDA-graph-safe tracker holds generators: left shared (no table of ours is drawn there).
                    name: _device_state(_seed_of(s)) if isinstance(s, torch.Tensor) else s
                    for name, s in tracker.items()}}

    @staticmethod
    def _apply(states: Dict[str, object]) -> None:
        torch.set_rng_state(states["cpu"])
        if states["device"] is not None:
            torch.cuda.set_rng_state(states["device"])
        if states["tracker"] is not None:
            _tracker().set_states(dict(states["tracker"]))

    def input_side(self) -> None:
        if not self._on_input:
            self._main = self._capture()
            self._apply(self._input)
            self._on_input = True

    def body(self) -> None:
        if self._on_input:
            self._input = self._capture()
            self._apply(self._main)
            self._on_input = False
