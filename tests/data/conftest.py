"""Helpers for the data tests: a CLI runner (tokenizer arguments come from tests/conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path

from megatron_lev.testing.cli import run_cli
from tests.conftest import tokenizer_flags as cli_flags  # noqa: F401  (used by the data tests)

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_tool(name, *args):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return run_cli(REPO_ROOT / "tools" / name, args, env=env, cwd=str(REPO_ROOT))
