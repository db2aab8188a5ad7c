"""The package layering of ``megatron_lev`` (drawn in docs/architecture.md), checked on the sources.

Every ``import`` and ``from ... import`` in the package, at module level or inside a function, counts.
A package may import only the packages listed for it below; adding an arrow means changing this table
and the picture in docs/architecture.md together.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, Set

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_lev"

# package -> the project packages it may import (the arrows of docs/architecture.md).
ALLOWED: Dict[str, Set[str]] = {
    "lev": set(),
    "jsonl": set(),
    "config_flags": set(),
    "compat": set(),
    "__init__": {"compat"},  # the package root installs a logging filter before megatron-core is imported
    "kernels": {"lev"},
    "parallel": {"kernels", "lev"},
    "distributed": {"_procutil", "compat", "lev"},
    # distributed: the layout a model is checked against; config: the run configuration models.factory builds from
    "models": {"config", "distributed", "kernels", "lev", "parallel"},
    "tokenizer": {"config_flags", "jsonl"},
    "config": {"config_flags", "distributed", "lev", "tokenizer"},  # the typed run configuration, below its readers
    "data": {"_procutil", "jsonl", "progress", "tokenizer"},
    "_procutil": set(),
    "progress": set(),
    "_rank_server": {"distributed"},  # what the server that forks local ranks imports once
    "checkpoint": {"compat", "config", "distributed", "lev", "models", "parallel", "tokenizer"},
    "arguments": {"_procutil", "compat", "config", "config_flags", "distributed", "lev", "models", "tokenizer"},
    "evaluation": {"_procutil", "checkpoint", "config", "data", "distributed", "jsonl", "lev", "models", "parallel",
                   "progress", "tokenizer"},
    "conversion": {"_procutil", "arguments", "checkpoint", "config", "distributed", "evaluation", "kernels", "lev",
                   "models", "parallel", "tokenizer"},
    "training": {"_procutil", "arguments", "checkpoint", "compat", "config", "data", "distributed", "lev", "models",
                 "parallel", "tokenizer"},
    "testing": {"distributed"},
}


def _unit(path: Path, root: Path = PACKAGE) -> str:
    """The top-level package (or module) of ``megatron_lev`` a source file belongs to."""
    first = path.relative_to(root).parts[0]
    return first[:-3] if first.endswith(".py") else first


def _imported_modules(path: Path, root: Path = PACKAGE):
    """Absolute names of every module imported in ``path`` (relative imports resolved)."""
    package = ["megatron_lev", *path.relative_to(root).parts[:-1]]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            yield module
            if module == "megatron_lev" or not node.module:  # `from megatron_lev import compat`
                yield from (f"{module}.{a.name}" for a in node.names)


def _project_edges(root: Path = PACKAGE) -> Dict[str, Set[str]]:
    edges: Dict[str, Set[str]] = defaultdict(set)
    for path in root.rglob("*.py"):
        src = _unit(path, root)
        for module in _imported_modules(path, root):
            parts = module.split(".")
            if parts[0] == "megatron_lev" and len(parts) > 1 and parts[1] != src:
                edges[src].add(parts[1])
    return edges


def test_every_package_is_in_the_layering():
    units = {_unit(p) for p in PACKAGE.rglob("*.py")} - {"__init__"}
    assert units <= set(ALLOWED), f"add {sorted(units - set(ALLOWED))} to ALLOWED and docs/architecture.md"


def test_no_package_imports_one_above_it():
    wrong = {src: sorted(dst - ALLOWED.get(src, set())) for src, dst in _project_edges().items()}
    assert not {k: v for k, v in wrong.items() if v}, wrong


def test_the_layering_has_no_cycle():
    seen: Dict[str, int] = {}

    def visit(node: str, stack: tuple) -> None:
        assert node not in stack, " -> ".join(stack + (node,))
        if seen.get(node):
            return
        for nxt in ALLOWED[node]:
            visit(nxt, stack + (node,))
        seen[node] = 1

    for unit in ALLOWED:
        visit(unit, ())


def test_lev_imports_only_torch_and_the_standard_library():
    allowed = set(sys.stdlib_module_names) | {"torch", "__future__", "megatron_lev"}
    for path in (PACKAGE / "lev").rglob("*.py"):
        for module in _imported_modules(path):
            top = module.split(".")[0]
            if top == "megatron_lev":
                assert module.startswith("megatron_lev.lev"), (path.name, module)
            else:
                assert top in allowed, (path.name, module)


def test_one_config_error_class():
    defined = [str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
               for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
               if isinstance(node, ast.ClassDef) and node.name == "ConfigError"]
    assert defined == ["megatron_lev/lev/config.py"]
    from megatron_lev import distributed, models, training
    from megatron_lev.lev.config import ConfigError

    assert models.ConfigError is ConfigError and training.ConfigError is ConfigError
    # The bootstrap's refusals are configuration errors too: one except clause catches them all.
    assert issubclass(distributed.DistributedConfigError, ConfigError)


def test_the_checker_sees_relative_and_function_level_imports(tmp_path):
    # The checks above are only as good as the import scan: it must resolve relative imports of any
    # depth, `from megatron_lev import x`, and imports inside functions.
    pkg = tmp_path / "megatron_lev"
    (pkg / "evaluation" / "sub").mkdir(parents=True)
    (pkg / "evaluation" / "sub" / "m.py").write_text(
        "from ...models import gpt\n"
        "from .. import report\n"
        "def f():\n"
        "    from megatron_lev import training\n"
        "    import megatron_lev.compat.cpu\n")
    assert _project_edges(pkg) == {"evaluation": {"models", "training", "compat"}}


def _body_lines(node) -> int:
    """Lines of a function's body, its docstring left out."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0


def test_the_median_library_function_is_short():
    """Plain model code in short functions: the median function of the package (its body, docstring aside) stays
    under 12 lines (6 when this test was written)."""
    lengths = sorted(_body_lines(n) for p in PACKAGE.rglob("*.py")
                     for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    assert len(lengths) > 500 and lengths[len(lengths) // 2] < 12, lengths[len(lengths) // 2]
