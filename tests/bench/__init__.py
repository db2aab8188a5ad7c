"""Tests of the bench/ scripts (loaded as modules; bench/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_bench(name: str):
    """Import ``bench/<name>.py`` as a module (bench/ on sys.path for the scripts' own imports)."""
    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
