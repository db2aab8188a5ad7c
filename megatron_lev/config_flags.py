"""Command-line flags generated from the fields of a config dataclass.

A field's type, default, ``choices`` metadata and docstring (the string literal after the field) make
its flag, as megatron-core's ``core_transformer_config_from_args`` reads a ``TransformerConfig`` back from
the flags of its fields: each default, choice list and help text is written once, on the dataclass.
Used by the training arguments (``LEVConfig``, ``LevModelConfig``) and the tokenizer flags
(``TokenizerSpec``) of every tool. Standard library only, so any package can use it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import threading
import typing
from dataclasses import MISSING, fields
from typing import Any, Callable, Dict, Iterable, Optional

# CPython 3.11's AST construction is not safe from several threads at once (parsers built in a thread
# pool fail with "AST constructor recursion depth mismatch"): read each class's source once, under a lock.
_SOURCE_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def _field_docs(cls) -> Dict[str, str]:
    with _SOURCE_LOCK:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs: Dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(nxt.value.value.replace("``", "").split())  # plain text for --help
    return docs


def field_docs(cls) -> Dict[str, str]:
    """The field docstrings of dataclass ``cls`` (the string after each field), read from its source."""
    return dict(_field_docs(cls))


def add_config_flags(group, cls, flag_of: Callable[[str], str], names: Optional[Iterable[str]] = None,
                     defaults: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One flag per field of dataclass ``cls`` (or of ``names``): type, default, ``choices`` metadata and
    help (the field docstring) come from the field, as megatron-core's ``core_transformer_config_from_args``
    reads a TransformerConfig from the flags of its fields. ``defaults`` replaces a field's default on the
    command line (where the flag's default is resolved later). A field of a type without a flag form is an
    error, so a new field cannot go without its flag. Returns the argparse actions by field name."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    defaults = defaults or {}
    wanted = None if names is None else set(names)
    actions = {}
    for f in fields(cls):
        if wanted is not None and f.name not in wanted:
            continue
        typ = hints[f.name]
        if typing.get_origin(typ) is typing.Union:  # Optional[X]: unset is None
            (typ,) = [t for t in typing.get_args(typ) if t is not type(None)]
        if typ not in (int, float, str) or (f.default is MISSING and f.name not in defaults):
            raise TypeError(f"{cls.__name__}.{f.name}: no command-line form for a {typ!r} field without a default")
        default = defaults.get(f.name, f.default)
        actions[f.name] = group.add_argument(flag_of(f.name), type=typ, default=default,
                                             choices=f.metadata.get("choices"),
                                             help=docs.get(f.name, "").replace("%", "%%"))
    return actions
