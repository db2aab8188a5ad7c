"""Tests of the bench/ scripts (loaded as modules; bench/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


BENCH = REPO / "bench"


def bench_module(name: str):
    """``bench/<name>.py`` imported under its own name (bench/ put on sys.path, where the scripts import each
    other by bare name): one module object shared by every test, unlike :func:`load_bench`'s fresh copy."""
    import importlib

    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def load_bench(name: str):
    """Import ``bench/<name>.py`` as a module (bench/ on sys.path for the scripts' own imports)."""
    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
