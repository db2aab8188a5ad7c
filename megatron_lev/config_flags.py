"""Command-line flags generated from the fields of a config dataclass.

A field's type, default, ``choices`` metadata, range metadata (``min``/``max`` inclusive,
``above``/``below`` exclusive, ``inf``: infinity allowed; see :class:`Number`) and docstring (the string
literal after the field) make its flag, as megatron-core's ``core_transformer_config_from_args`` reads a ``TransformerConfig`` back from
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
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

# CPython 3.11's AST construction is not safe from several threads at once (parsers built in a thread
# pool fail with "AST constructor recursion depth mismatch"): read each class's source once, under a lock.
_SOURCE_LOCK = threading.Lock()


# The range keys of a numeric field's metadata (and of ``Number``).
RANGE_KEYS = ("min", "max", "above", "below", "inf")


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
                     defaults: Optional[Dict[str, Any]] = None,
                     ranges: Optional[Dict[str, Dict[str, Any]]] = None) -> Dict[str, Any]:
    """One flag per field of dataclass ``cls`` (or of ``names``): type, default, ``choices`` metadata,
    range metadata and help (the field docstring) come from the field, as megatron-core's
    ``core_transformer_config_from_args`` reads a TransformerConfig from the flags of its fields.
    ``defaults`` replaces a field's default on the command line (where the flag's default is resolved
    later); ``ranges`` gives the range of fields of a class that is not ours (megatron-core's
    TransformerConfig), in the keys of the metadata. A field of a type without a flag form, or a numeric
    field without a range, is an error, so a new field cannot go without its flag and its range. Returns
    the argparse actions by field name."""
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
        if typ in (int, float) and choices is None:
            number = Number.of_field(typ, ranges.get(f.name, f.metadata))
            if number is None:
                raise TypeError(f"{cls.__name__}.{f.name}: a numeric flag needs its range (field metadata "
                                f"{', '.join(RANGE_KEYS)})")
            typ = number
        actions[f.name] = group.add_argument(flag_of(f.name), type=typ, default=default, choices=choices,
                                             help=with_range(docs.get(f.name, "").replace("%", "%%"), typ))
        actions[f.name].config_field = (cls, f.name)  # where the value goes (the read-flags test follows it)
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
