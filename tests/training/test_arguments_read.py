"""Every argument ``pretrain_lev.py``'s parser can produce is read by the code that trains, evaluates or
converts (outside ``megatron_lev/arguments/``), or is declared: a no-op with its reason
(``megatron_lm.NO_OPS``), a flag accepted at one value only (``megatron_lm.FIXED``, any other refused in
one line), or a flag validation folds into another argument (``validate.FOLDED_INTO``, whose target is
read). The vocabulary test sees that a flag changes the parsed arguments; this one sees that something
reads them.

Found by walking the sources (no run): an argument is read where the code loads ``<...>args.NAME`` (any
receiver named ``args``, ``run.args``, ``saved_args``...), looks a constant ``"NAME"`` up
(``a["NAME"]``, ``a.get("NAME")``, ``getattr(x, "NAME")``), lists it in a collection of names (a tuple,
list, set or dict keys of strings, such as ``MOE_ARGS``), imports such a collection from
``megatron_lev.arguments``, hands the arguments to a dataclass's ``from_args`` that takes every field
(``TokenizerSpec``) or that a ``RunConfig`` group holds whole (``LEVConfig``), whose field is then used,
or reads a field of a ``RunConfig`` group
(``typed_reads``: ``<...>.data.seq_length``, or a name bound to a group, ``cfg: LoggingConfig``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from functools import lru_cache
from pathlib import Path
from typing import Dict, Set

import pytest

from megatron_lev.arguments import build_parser, parse_args
from megatron_lev.arguments.megatron_lm import FIXED, NO_OPS
from megatron_lev.config import RunConfig
from megatron_lev.distributed.layout import MEGATRON_FIELDS
from megatron_lev.arguments.validate import FOLDED_INTO
from megatron_lev.lev.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
ARGUMENTS = ROOT / "megatron_lev" / "arguments"
BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--train-iters 4 --lr 1e-3 --mock-data --vocab-size 100").split()
# The parser's own: the YAML file it reads its defaults from.
PARSER_OWN = {"config"}
_ARGS_RECEIVER = re.compile(r"(^|\.)\w*args$")


def _group_fields():
    """{group name and class name: the group's field names} (the layout's as its Megatron-LM names too)."""
    import typing

    hints = typing.get_type_hints(RunConfig)
    out = {}
    for name, klass in hints.items():
        names = {f.name for f in dataclasses.fields(klass)}
        out[name] = out[klass.__name__] = names
    return out


def typed_reads(tree: ast.AST) -> Set[str]:
    """The RunConfig fields a module reads: ``<...>.GROUP.FIELD``, or ``NAME.FIELD`` where NAME is bound to
    ``<...>.GROUP`` (an assignment, tuple assignments included) or is a parameter annotated with a group's
    class."""
    groups = _group_fields()
    bound: Dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            pairs = []
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += zip(target.elts, node.value.elts)
                else:
                    pairs.append((target, node.value))
            for target, value in pairs:
                if isinstance(target, ast.Name) and isinstance(value, ast.Attribute) and value.attr in groups:
                    bound[target.id] = value.attr
        elif isinstance(node, ast.arg) and node.annotation is not None:
            annotation = node.annotation.value if isinstance(node.annotation, ast.Constant) else \
                getattr(node.annotation, "id", None)
            if annotation in groups:
                bound[node.arg] = annotation
    out: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            receiver = node.value
            group = receiver.attr if isinstance(receiver, ast.Attribute) else bound.get(getattr(receiver, "id", None))
            if group in groups and node.attr in groups[group]:  # the layout's sizes under their flags' names
                out.add(MEGATRON_FIELDS.get(node.attr, node.attr) if group in ("layout", "ParallelLayout") else node.attr)
    return out


def held_whole(loaded: Set[str]) -> Set[str]:
    """The dataclasses a RunConfig group holds whole as one field (``ModelRunConfig.lev: LEVConfig``) that the
    code loads by that field's name (``rc.model.lev``, handed to the model): their fields are read where the
    code loads them, as those of a ``from_args`` class."""
    import typing

    out = set()
    for klass in typing.get_type_hints(RunConfig).values():
        for name, hint in typing.get_type_hints(klass).items():
            if dataclasses.is_dataclass(hint) and name in loaded:
                out.add(hint.__name__)
    return out


def _sources():
    files = [p for p in (ROOT / "megatron_lev").rglob("*.py") if ARGUMENTS not in p.parents]
    return files + [ROOT / "pretrain_lev.py"] + sorted((ROOT / "tools").glob("*.py"))


def _strings(node) -> Set[str]:
    """The string constants of a collection literal (a dict's keys)."""
    elts = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", [])
    return {e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}


def _module_name_lists(module: str) -> Dict[str, Set[str]]:
    """The module-level collections of strings of ``megatron_lev.arguments.<module>``, by name."""
    path = ARGUMENTS / (module.replace(".", "/") + ".py")
    if not path.is_file():
        path = ARGUMENTS / module / "__init__.py"
    out: Dict[str, Set[str]] = {}
    if path.is_file():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    if isinstance(target, ast.Name):
                        out[target.id] = _strings(node.value)
    return out


def _takes_every_field(cls_name: str) -> bool:
    """The class ``cls_name`` (a dataclass somewhere in megatron_lev) has a ``from_args`` over ``fields(...)``."""
    for path in (ROOT / "megatron_lev").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.name == cls_name:
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "from_args":
                        return any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "fields"
                                   for n in ast.walk(item))
    return False


@lru_cache(maxsize=None)
def code_reads():
    """(names read, classes whose ``from_args`` is called, every name the code loads) outside arguments/."""
    read: Set[str] = set()
    from_args: Set[str] = set()
    loaded: Set[str] = set()
    for path in _sources():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        read |= typed_reads(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                loaded.add(node.attr)
                if _ARGS_RECEIVER.search(ast.unparse(node.value)):
                    read.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                loaded.add(node.id)
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                read.add(node.slice.value)
            elif isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                read |= _strings(node)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_lev.arguments"):
                lists = _module_name_lists(node.module[len("megatron_lev.arguments."):] or "__init__")
                for alias in node.names:
                    read |= lists.get(alias.name, set())
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if name in ("get", "getattr", "hasattr", "pop"):
                    read |= {a.value for a in node.args[:2] if isinstance(a, ast.Constant) and isinstance(a.value, str)}
                if name == "from_args" and isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                    from_args.add(func.value.id)
    return read, frozenset(c for c in from_args if _takes_every_field(c)), loaded


def unread(parser: argparse.ArgumentParser):
    """The destinations of ``parser`` that nothing reads and nothing declares, with their flags."""
    read, from_args, loaded = code_reads()
    out = {}
    for action in parser._actions:
        dest = action.dest
        if dest in (argparse.SUPPRESS, "help") or dest in PARSER_OWN or dest in read:
            continue
        flags = [o for o in action.option_strings if o.startswith("--")]
        if flags and all(f in NO_OPS or f in FIXED for f in flags):
            continue
        if dest in FOLDED_INTO and FOLDED_INTO[dest] in read:
            continue
        field = getattr(action, "config_field", None)  # generated from a dataclass field
        if field is not None and field[0].__name__ in from_args | held_whole(loaded) and field[1] in loaded:
            continue
        out.setdefault(dest, flags)  # (a --no-... negation shares its flag's destination)
    return out


def test_every_argument_is_read_outside_the_parser_or_declared():
    missing = unread(build_parser())
    assert not missing, ("arguments nothing outside megatron_lev/arguments/ reads (read them, or declare them in "
                         f"megatron_lm.NO_OPS / FIXED or validate.FOLDED_INTO): {missing}")


def test_a_new_flag_that_nothing_reads_is_found():
    parser = build_parser()
    parser.add_argument("--flag-read-nowhere-xyz", action="store_true")
    parser.add_argument("--value-read-nowhere-xyz", type=int, default=3)
    assert set(unread(parser)) == {"flag_read_nowhere_xyz", "value_read_nowhere_xyz"}


def test_the_walk_sees_each_way_of_reading():
    read, from_args, loaded = code_reads()
    assert {"train_iters", "seq_length"} <= read  # args.X
    assert {"padded_vocab_size", "fp8_format"} <= read  # a["X"], a.get("X")
    assert {"moe_router_topk", "main_grads_dtype"} <= read  # MOE_ARGS' keys, OPTIMIZER_DTYPE_FIELDS imported
    assert "TokenizerSpec" in from_args and "LEVConfig" in held_whole(loaded) and "basis" in loaded
    typed = ast.parse("def f(rc, cfg: 'LoggingConfig'):\n    d, s = rc.data, rc.schedule\n"
                      "    return rc.run.seed, d.split, s.eval_iters, cfg.metrics_file, rc.layout.vpp, rc.data.other")
    assert typed_reads(typed) == {"seed", "split", "eval_iters", "metrics_file", "virtual_pipeline_model_parallel_size"}
    assert {"data_path", "metrics_file"} <= read  # RunConfig's fields, read by training/data.py and logger.py


# Each folded flag with what it needs, the argument it sets and the world size.
FOLD_CASES = {
    "num_layers_per_virtual_pipeline_stage": (["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                                               "--num-layers-per-virtual-pipeline-stage", "1"], 2),
    "recompute_activations": (["--recompute-activations"], 1),
    "untie_embeddings_and_output_weights": (["--untie-embeddings-and-output-weights"], 1),
    "grad_reduce_in_bf16": (["--bf16", "--grad-reduce-in-bf16"], 1),
    "group_query_attention": (["--num-query-groups", "2", "--group-query-attention"], 1),
}


@pytest.mark.parametrize("dest", sorted(FOLDED_INTO))
def test_a_folded_flag_sets_the_argument_it_folds_into(dest):
    argv, world = FOLD_CASES[dest]
    target = FOLDED_INTO[dest]
    flag = "--" + dest.replace("_", "-")
    without = [w for i, w in enumerate(argv) if w != flag and not (i and argv[i - 1] == flag and not w.startswith("--"))]
    base = BASE + (["--global-batch-size", "4"] if world > 1 else [])
    assert getattr(parse_args(base + argv, world_size=world), target) != getattr(
        parse_args(base + without, world_size=world), target), (dest, target)


@pytest.mark.parametrize("flag", sorted(FIXED))
def test_a_fixed_flag_takes_its_one_value_and_refuses_any_other_in_one_line(flag):
    value, other, _ = FIXED[flag]
    dest = flag[2:].replace("-", "_")
    default = getattr(parse_args(BASE, world_size=1), dest)
    assert str(default) == value and getattr(parse_args(BASE + [flag, value], world_size=1), dest) == default
    with pytest.raises(ConfigError) as e:
        parse_args(BASE + [flag, other], world_size=2)
    assert str(e.value).startswith(f"{flag} {other}") and "\n" not in str(e.value)
