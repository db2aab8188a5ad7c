"""Command-line flags generated from the fields of a config dataclass.

A field's type, default, ``choices`` metadata and docstring (the string literal after the field) make
its flag, as megatron-core's ``core_transformer_config_from_args`` reads a ``TransformerConfig`` back from
the flags of its fields: each default, choice list and help text is written once, on the dataclass.
Used by the training arguments (``LEVConfig``, ``LevModelConfig``) and the tokenizer flags
(``TokenizerSpec``) of every tool. Standard library only, so any package can use it.
"""

from __future__ import annotations

import ast
import enum
import functools
import inspect
import textwrap
import threading
import typing
from dataclasses import MISSING, fields
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

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
    """The field docstrings of dataclass ``cls`` and of its dataclass bases (the string after each field),
    read from their sources."""
    docs: Dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if "__dataclass_fields__" in vars(klass):
            docs.update(_field_docs(klass))
    return docs


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
        choices = f.metadata.get("choices")
        default = defaults.get(f.name, f.default)
        if typing.get_origin(typ) is typing.Literal:  # Literal["a", "b"]: a str flag with those choices
            choices, typ = typing.get_args(typ), str
        elif isinstance(typ, type) and issubclass(typ, enum.Enum):  # an Enum: its member names
            choices, typ = tuple(m.name for m in typ), str
            default = default.name if isinstance(default, enum.Enum) else default
        if typ not in (int, float, str) or (f.default is MISSING and f.name not in defaults):
            raise TypeError(f"{cls.__name__}.{f.name}: no command-line form for a {typ!r} field without a default")
        actions[f.name] = group.add_argument(flag_of(f.name), type=typ, default=default, choices=choices,
                                             help=docs.get(f.name, "").replace("%", "%%"))
    return actions


def add_switch_flags(group, cls, switches: Iterable[Tuple[str, str, bool]],
                     defaults: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """On/off flags of the bool fields of dataclass ``cls``: ``(flag, field, value the flag sets)``, the
    destination being the field's name and the help its docstring. A switch whose field ``cls`` lacks is
    left out, so the set follows the installed class. ``defaults``: the value without the flag (a field's
    own default otherwise; None for one resolved later). Returns the argparse actions by field name."""
    docs = field_docs(cls)
    have = {f.name: f for f in fields(cls)}
    defaults = defaults or {}
    actions = {}
    for flag, name, value in switches:
        if name not in have:
            continue
        default = defaults.get(name, have[name].default)
        actions[name] = group.add_argument(flag, dest=name, action="store_true" if value else "store_false",
                                           default=default, help=docs.get(name, "").replace("%", "%%"))
    return actions
