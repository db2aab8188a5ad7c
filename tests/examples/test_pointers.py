"""The entry point, the README and the docs/ pages name example configs and scripts that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))


def named_examples(doc: str) -> set:
    return set(re.findall(r"examples/[\w./-]+\.(?:yaml|sh|sbatch|py|md)", (REPO / doc).read_text(encoding="utf-8")))


@pytest.mark.parametrize("doc", ["pretrain_lev.py", "README.md", *DOCS])
def test_named_example_files_exist(doc):
    named = named_examples(doc)
    assert sorted(p for p in named if not (REPO / p).is_file()) == []


@pytest.mark.parametrize("doc", ["pretrain_lev.py", "README.md", "docs/gpu.md", "docs/running.md"])
def test_the_first_pages_name_example_files(doc):
    assert named_examples(doc), f"{doc} names no example file"
