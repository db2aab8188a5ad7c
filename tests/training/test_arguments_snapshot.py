"""The parser's flags are what they were before they were generated from RunConfig's fields: each flag's
spellings, destination, action, default (and its type: 1000 is not 1000.0 in config.yaml), nargs,
choices, range and metavar, and the validated arguments of a minimal command line, against a snapshot
written by the hand-written parser (the same with megatron-core 0.16 and 0.19). And every flag generated from a group's field defaults to that field's default
(one default per fact). In-process: the parser only."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from megatron_lev.arguments import build_parser, parse_args
from megatron_lev.config.run import _GROUPS
from megatron_lev.config_flags import Number, field_default

SNAPSHOT = Path(__file__).parent / "data" / "parser_snapshot.json"
MINIMAL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
           "--train-iters 8 --lr 1e-3 --mock-data --vocab-size 100").split()


def encode(value):
    """``value`` as JSON that keeps its type (an int default is not a float one)."""
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return ["float", str(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return [type(value).__name__, value]
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [encode(v) for v in value]]
    if isinstance(value, dict):
        return ["dict", {str(k): encode(v) for k, v in value.items()}]
    return [type(value).__name__, repr(value)]


def _type_name(kind):
    if kind is None:
        return None
    return repr(kind) if isinstance(kind, Number) else getattr(kind, "__name__", repr(kind))


def describe(parser: argparse.ArgumentParser):
    """Each flag (by its first spelling) as the command line sees it."""
    out = {}
    for a in parser._actions:
        if a.dest == "help":
            continue
        out[a.option_strings[0]] = {
            "flags": list(a.option_strings), "dest": a.dest, "action": type(a).__name__,
            "default": encode(a.default), "nargs": encode(a.nargs), "const": encode(a.const),
            "choices": encode(None if a.choices is None else list(a.choices)), "type": _type_name(a.type),
            "metavar": encode(a.metavar), "hidden": a.help == argparse.SUPPRESS, "required": a.required}
    return out


def snapshot() -> str:
    """The snapshot file's text (``python -m tests.training.test_arguments_snapshot`` writes it): one line
    per flag."""
    flags = describe(build_parser())
    lines = [f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(flags.items())]
    parsed = json.dumps(encode(vars(parse_args(MINIMAL, world_size=1))), sort_keys=True)
    return '{"flags": {\n' + ",\n".join(lines) + f'\n}},\n"parsed": {parsed}}}\n'


def _conversion(entry):
    """A flag's description with ``type`` str as None: argparse converts a value without a type with str."""
    return {**entry, "type": None if entry["type"] == "str" else entry["type"]}


def test_every_flag_is_the_hand_written_one():
    want = {k: _conversion(v) for k, v in json.loads(SNAPSHOT.read_text(encoding="utf-8"))["flags"].items()}
    got = {k: _conversion(v) for k, v in json.loads(json.dumps(describe(build_parser()))).items()}
    assert sorted(got) == sorted(want), (sorted(set(got) - set(want)), sorted(set(want) - set(got)))
    changed = {flag: {k: (got[flag][k], v) for k, v in want[flag].items() if got[flag][k] != v}
               for flag in want if got[flag] != want[flag]}
    assert not changed, changed


def test_the_parsed_defaults_are_unchanged():
    want = json.loads(SNAPSHOT.read_text(encoding="utf-8"))["parsed"]
    got = json.loads(json.dumps(encode(vars(parse_args(MINIMAL, world_size=1)))))
    assert got[1] == want[1]


def test_every_flag_generated_from_a_field_has_the_fields_default():
    """One default per fact: a flag made from a RunConfig group's field defaults to the field's default,
    or (a required field, or one validation derives) to None."""
    groups = set(_GROUPS.values())
    parser = build_parser()
    seen = set()
    for action in parser._actions:
        cls, name = getattr(action, "config_field", (None, None))
        if cls not in groups:
            continue
        seen.add(cls)
        f = next(f for f in fields(cls) if f.name == name)
        want = None if f.default is MISSING and f.default_factory is MISSING else field_default(f)
        assert parser.get_default(action.dest) == want and type(parser.get_default(action.dest)) is type(want), \
            (action.option_strings, parser.get_default(action.dest), want)
    assert seen, "no flag is generated from a RunConfig group"


@pytest.mark.parametrize("bad", [1000.0, 1, "x"])
def test_a_changed_default_is_found(bad):
    parser = build_parser()
    parser.set_defaults(loss_scale_window=bad)
    want = json.loads(SNAPSHOT.read_text(encoding="utf-8"))["flags"]["--loss-scale-window"]["default"]
    assert json.loads(json.dumps(describe(parser)))["--loss-scale-window"]["default"] != want


if __name__ == "__main__":
    SNAPSHOT.write_text(snapshot(), encoding="utf-8")
    print(SNAPSHOT)
