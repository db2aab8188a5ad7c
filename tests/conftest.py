"""Shared test fixtures: the ../shared data folder and the CPU backend."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without CUDA, Triton kernels run in Triton's interpreter on CPU tensors, so their tests check them
# there. Set before anything imports megatron_lev.kernels: a kernel is built for the interpreter or
# the GPU when its module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("MEGATRON_LEV_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The shared corpus/tokenizers folder; a missing folder is a hard error, not a skip."""
    if not SHARED_DATA.is_dir():
        raise FileNotFoundError(
            f"shared data folder not found at {SHARED_DATA}; clone the project next to ../shared "
            "or set MEGATRON_LEV_SHARED_DATA"
        )
    return SHARED_DATA


def pytest_collection_modifyitems(config, items):
    # GPU-marked tests run only where CUDA exists; elsewhere they are deselected and counted
    # in the summary (never reported as passed).
    if torch.cuda.is_available():
        return
    selected, deselected = [], []
    for item in items:
        (deselected if item.get_closest_marker("gpu") else selected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected
