"""Command-line flags generated from the fields of a config dataclass.

A field's type, default, ``choices`` metadata, range metadata (``min``/``max`` inclusive,
``above``/``below`` exclusive, ``inf``: infinity allowed; see :class:`Number`) and docstring (the string
literal after the field) make its flag, with the flag metadata of Megatron-LM's ``argparse_meta``
(``FLAG_KEYS``: the spellings, ``nargs`` of a list field, a custom ``type``, the ``metavar``, ``hidden``
for a flag kept out of ``--help``), as megatron-core's ``core_transformer_config_from_args`` reads a ``TransformerConfig`` back from
the flags of its fields: each default, choice list and help text is written once, on the dataclass.
Used by the training arguments (``LEVConfig``, ``LevModelConfig``) and the tokenizer flags
(``TokenizerSpec``) of every tool. Standard library only, so any package can use it.
"""

from __future__ import annotations

import argparse
import ast
import enum
import math
import functools
import inspect
import textwrap
import threading
import typing
from dataclasses import MISSING, fields
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

# CPython 3.11's AST construction is not safe from several threads at once (parsers built in a thread
# pool fail with "AST constructor recursion depth mismatch"): read each class's source once, under a lock.
_SOURCE_LOCK = threading.Lock()


# The range keys of a numeric field's metadata (and of ``Number``).
RANGE_KEYS = ("min", "max", "above", "below", "inf")
# The flag keys of a field's metadata, as Megatron-LM's ``argparse_meta``: ``flags``, the option strings
# (Megatron-LM's spellings, where the flag is not ``flag_of(name)``); ``nargs``, for a list field (``"*"``,
# ``"+"``, ``3``); ``type``, a conversion of the command-line text other than the field's type (a
# ``Number`` from the range otherwise); ``metavar``; ``hidden``: no ``--help`` line (fault injection).
FLAG_KEYS = ("flags", "nargs", "type", "metavar", "hidden")


class Number:
    """The type of a numeric flag with its valid range, checked where argparse converts the value (so a
    bad value is refused at parse time, in one line naming the flag) and where a ``--config`` file's value
    is converted. ``kind``: int or float; ``min``/``max``: inclusive bounds, ``above``/``below``: exclusive
    ones; ``inf``: infinity is a meaningful value (never NaN). The range is appended to the flag's help."""

    def __init__(self, kind: type, *, min: Optional[float] = None, max: Optional[float] = None,
                 above: Optional[float] = None, below: Optional[float] = None, inf: bool = False) -> None:
        self.kind, self.min, self.max, self.above, self.below, self.inf = kind, min, max, above, below, inf
        self.__name__ = kind.__name__  # argparse's "invalid int value: 'x'"

    @classmethod
    def of_field(cls, kind: type, metadata: Dict[str, Any]) -> Optional["Number"]:
        """The type of a field from its range metadata (None when the field has none)."""
        bounds = {k: metadata[k] for k in RANGE_KEYS if k in metadata}
        return cls(kind, **bounds) if bounds else None

    def allows(self, value: float) -> bool:
        if isinstance(value, float) and math.isnan(value):
            return False
        if isinstance(value, float) and math.isinf(value):
            return self.inf and value > 0
        return ((self.min is None or value >= self.min) and (self.max is None or value <= self.max)
                and (self.above is None or value > self.above) and (self.below is None or value < self.below))

    def describe(self) -> str:
        """The range in words: ``>= 1``, ``>= 0 and < 1``, ``> 0 (inf allowed)`` (+inf only)."""
        parts = [f"{op} {v:g}" for op, v in ((">=", self.min), (">", self.above), ("<=", self.max),
                                              ("<", self.below)) if v is not None]
        text = " and ".join(parts) or "any number"
        return text + (" (inf allowed)" if self.inf else "")

    def check(self, value: float) -> float:
        """``value`` if it lies in the range, else ArgumentTypeError (argparse adds the flag)."""
        if not self.allows(value):
            raise argparse.ArgumentTypeError(f"must be {self.describe()} (got {value})")
        return value

    def __call__(self, text: str) -> float:
        return self.check(self.kind(text))

    def __repr__(self) -> str:
        return f"Number({self.kind.__name__}, {self.describe()})"


POSITIVE_INT = Number(int, min=1)
NON_NEGATIVE_INT = Number(int, min=0)
POSITIVE_FLOAT = Number(float, above=0)
NON_NEGATIVE_FLOAT = Number(float, min=0)
PROBABILITY = Number(float, min=0, below=1)  # dropout, Adam's betas, momentum


def with_range(help_text: Optional[str], number: Any) -> Optional[str]:
    """``help_text`` followed by the valid range of a ``Number`` type (unchanged for other types)."""
    if not isinstance(number, Number) or help_text == argparse.SUPPRESS:
        return help_text
    return f"{help_text} [{number.describe()}]" if help_text else f"[{number.describe()}]"


def field_flag(name: str) -> str:
    """The flag of a config field under Megatron-LM's spelling: ``albert_dim`` -> ``--albert-dim``."""
    return "--" + name.replace("_", "-")


@functools.lru_cache(maxsize=None)
def _module_classes(filename: str) -> Dict[str, ast.ClassDef]:
    """Every class of a source file by qualified name, from one parse of the file (``inspect.getsource``
    parses the whole module again for each class: about 40 ms a class, most of a parser's start-up)."""
    with open(filename, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename)
    found: Dict[str, ast.ClassDef] = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                found.setdefault(prefix + child.name, child)
                visit(child, prefix + child.name + ".")

    visit(tree, "")
    return found


def _class_node(cls) -> ast.ClassDef:
    try:
        filename = inspect.getsourcefile(cls)
        node = _module_classes(filename).get(cls.__qualname__) if filename else None
    except (OSError, TypeError, SyntaxError):
        node = None
    if node is None:  # a class made at run time, or one whose file is gone: inspect's own search
        node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    return node


@functools.lru_cache(maxsize=None)
def _field_docs(cls) -> Dict[str, str]:
    with _SOURCE_LOCK:
        body = _class_node(cls).body
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


def field_default(f) -> Any:
    """A dataclass field's default (its factory's value for a list), MISSING for a required field."""
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _help(docs: Dict[str, str], f) -> Optional[str]:
    return argparse.SUPPRESS if f.metadata.get("hidden") else docs.get(f.name, "").replace("%", "%%")


def add_config_flags(group, cls, flag_of: Callable[[str], str], names: Optional[Iterable[str]] = None,
                     defaults: Optional[Dict[str, Any]] = None,
                     ranges: Optional[Dict[str, Dict[str, Any]]] = None) -> Dict[str, Any]:
    """One flag per field of dataclass ``cls`` (or of ``names``): type, default, ``choices`` metadata,
    range metadata, flag metadata (``FLAG_KEYS``) and help (the field docstring) come from the field, as
    megatron-core's ``core_transformer_config_from_args`` reads a TransformerConfig from the flags of its
    fields. ``defaults`` replaces a field's default on the command line (where the flag's default is
    resolved later, or a required field's flag defaults to None until validation asks for it); ``ranges``
    gives the range of fields of a class that is not ours (megatron-core's TransformerConfig), in the keys
    of the metadata. A field of a type without a flag form (a list without ``nargs``), or a numeric field
    without a range or a ``type``, is an error, so a new field cannot go without its flag and its range.
    Returns the argparse actions by field name."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    defaults = defaults or {}
    ranges = ranges or {}
    wanted = None if names is None else set(names)
    actions = {}
    for f in fields(cls):
        if wanted is not None and f.name not in wanted:
            continue
        typ = hints[f.name]
        meta = f.metadata
        if typing.get_origin(typ) is typing.Union:  # Optional[X]: unset is None
            (typ,) = [t for t in typing.get_args(typ) if t is not type(None)]
        choices = meta.get("choices")
        default = defaults.get(f.name, field_default(f))
        extra = {k: meta[k] for k in ("nargs", "metavar") if k in meta}
        if typing.get_origin(typ) in (list, List) and "nargs" in meta:  # List[X]: nargs values of X
            (typ,) = typing.get_args(typ)
        if typing.get_origin(typ) is typing.Literal:  # Literal["a", "b"]: a str flag with those choices
            choices, typ = typing.get_args(typ), str
        elif isinstance(typ, type) and issubclass(typ, enum.Enum):  # an Enum: its member names
            choices, typ = tuple(m.name for m in typ), str
            default = default.name if isinstance(default, enum.Enum) else default
        if typ not in (int, float, str) or (default is MISSING):
            raise TypeError(f"{cls.__name__}.{f.name}: no command-line form for a {typ!r} field without a default")
        if "type" in meta:
            typ = meta["type"]
        elif typ in (int, float):
            number = Number.of_field(typ, ranges.get(f.name, meta))
            if number is None and choices is None:
                raise TypeError(f"{cls.__name__}.{f.name}: a numeric flag needs its range (field metadata "
                                f"{', '.join(RANGE_KEYS)})")
            typ = number or typ
        help_text = _help(docs, f)
        if "flags" in meta:
            extra["dest"] = f.name
        actions[f.name] = group.add_argument(*meta.get("flags", (flag_of(f.name),)), type=typ, default=default,
                                             choices=choices, help=with_range(help_text, typ), **extra)
        actions[f.name].config_field = (cls, f.name)  # where the value goes (the read-flags test follows it)
    return actions


def add_switch_flags(group, cls, switches: Iterable[Tuple[Union[str, Tuple[str, ...]], str, bool]],
                     defaults: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """On/off flags of the bool fields of dataclass ``cls``: ``(flag, field, value the flag sets)``, the
    flag being one option string or a tuple of them (Megatron-LM's spellings), the destination the field's
    name and the help its docstring (a field may have a switch each way: the second one's help says it
    turns the first's setting back). A switch whose field ``cls`` lacks is left out, so the set follows the
    installed class. ``defaults``: the value without the flag (a field's own default otherwise; None for
    one resolved later). Returns the argparse actions by field name (the first switch of each field)."""
    docs = field_docs(cls)
    have = {f.name: f for f in fields(cls)}
    defaults = defaults or {}
    actions: Dict[str, Any] = {}
    for flag, name, value in switches:
        if name not in have:
            continue
        flags = (flag,) if isinstance(flag, str) else tuple(flag)
        default = defaults.get(name, have[name].default)
        help_text = _help(docs, have[name])
        if name in actions and help_text != argparse.SUPPRESS:
            help_text = f"turn {actions[name].option_strings[0]} {'on' if value else 'off'}"
        action = group.add_argument(*flags, dest=name, action="store_true" if value else "store_false",
                                    default=default, help=help_text)
        action.config_field = (cls, name)
        actions.setdefault(name, action)
    return actions
