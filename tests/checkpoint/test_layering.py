"""Where facts live: one ConfigError class, evaluation/conversion/checkpoint/models below training
(checked on the package sources), and the saved arguments moved to another layout by one function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megatron_lev.checkpoint import relayout
from megatron_lev.lev.config import ConfigError

PKG = Path(__file__).resolve().parents[2] / "megatron_lev"


def _imported_modules(path: Path):
    """Absolute names of every module ``path`` imports (relative imports resolved, ``from a import b``
    also as ``a.b``), at any depth of the file."""
    package = list(path.relative_to(PKG.parent).with_suffix("").parts)[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            yield module
            yield from (f"{module}.{a.name}" for a in node.names)


@pytest.mark.parametrize("package", ["evaluation", "conversion", "checkpoint", "models", "lev"])
def test_packages_below_training_do_not_import_it(package):
    offenders = [f"{p.relative_to(PKG.parent)} imports {m}" for p in sorted((PKG / package).rglob("*.py"))
                 for m in _imported_modules(p) if m == "megatron_lev.training" or m.startswith("megatron_lev.training.")]
    assert offenders == []


def test_the_import_scan_sees_relative_and_nested_imports():
    # The scan above is only worth something if it finds what is there: loop.py's imports of training
    # modules are relative (``from .flops import ...`` inside functions).
    found = set(_imported_modules(PKG / "training" / "loop.py"))
    assert "megatron_lev.training.flops" in found and "megatron_lev.checkpoint" in found


def test_one_config_error_class():
    defined = [str(p.relative_to(PKG.parent)) for p in PKG.rglob("*.py")
               for node in ast.walk(ast.parse(p.read_text()))
               if isinstance(node, ast.ClassDef) and node.name == "ConfigError"]
    assert defined == ["megatron_lev/lev/config.py"]
    from megatron_lev import models, training

    assert models.ConfigError is ConfigError and training.ConfigError is ConfigError


def test_relayout_keeps_the_padded_vocabulary_and_refuses_a_tp_it_cannot_take():
    saved = {"padded_vocab_size": 384, "make_vocab_size_divisible_by": 128, "tensor_model_parallel_size": 1,
             "pipeline_model_parallel_size": 1, "sequence_parallel": False, "micro_batch_size": 2,
             "global_batch_size": 8}
    a = relayout(saved, tp=2, pp=2, world_size=8)
    assert a["padded_vocab_size"] == 384 and a["tensor_model_parallel_size"] == 2
    assert a["data_parallel_size"] == 2 and a["num_microbatches"] == 4
    assert 384 % (a["make_vocab_size_divisible_by"] * 2) == 0  # a run at TP=2 pads to the same rows
    with pytest.raises(ConfigError, match="not divisible by TP 5"):
        relayout(saved, tp=5, pp=1)
    with pytest.raises(ConfigError, match="does not divide the world size 6"):
        relayout(saved, tp=2, pp=2, world_size=6)
