"""Helpers for the data tests: tokenizer arguments and a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tok_args(shared_data):
    """Tokenizer keyword arguments per family, as PreprocessConfig fields."""
    t = shared_data / "tokenizers"
    return {
        "gpt2": dict(tokenizer_type="GPT2BPETokenizer", vocab_file=str(t / "gpt2" / "vocab.json"),
                     merge_file=str(t / "gpt2" / "merges.txt")),
        "neox": dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(t / "neox" / "tokenizer.json")),
        "mistral": dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(t / "mistral" / "tokenizer.model")),
    }


def cli_flags(kw):
    flags = ["--tokenizer-type", kw["tokenizer_type"]]
    for k in ("vocab_file", "merge_file", "tokenizer_model"):
        if kw.get(k):
            flags += ["--" + k.replace("_", "-"), kw[k]]
    return flags


def run_tool(name, *args):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / name), *map(str, args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(REPO_ROOT),
    )
