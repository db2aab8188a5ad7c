"""The entry point and the README name example configs and scripts that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("doc", ["pretrain_lev.py", "README.md"])
def test_named_example_files_exist(doc):
    named = set(re.findall(r"examples/[\w./-]+\.(?:yaml|sh|sbatch)", (REPO / doc).read_text(encoding="utf-8")))
    assert named, f"{doc} names no example file"
    assert sorted(p for p in named if not (REPO / p).is_file()) == []
