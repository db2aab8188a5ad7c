"""The parser of ``pretrain_lev.py``'s flags: every group's flags (in ``--help`` order), the ``--no-...``
negations, the ranges in the help, and ``parse_args`` (flags, ``--config``, validation)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from megatron_lev.config_flags import Number, with_range
from megatron_lev.lev.config import ConfigError

from .checkpointing import add_checkpointing_flags
from .config_file import load_yaml_config
from .data import add_data_flags
from .lev import add_lev_flags
from .megatron_lm import add_megatron_lm_flags, refusal
from .model import add_model_flags
from .moe import add_moe_flags
from .parallel import add_parallel_flags
from .precision import add_precision_flags
from .run import add_run_flags
from .schedule import add_schedule_flags
from .validate import validate_args

# The flag groups, in --help order.
_GROUPS = (add_model_flags, add_lev_flags, add_parallel_flags, add_moe_flags, add_precision_flags, add_schedule_flags,
           add_data_flags, add_checkpointing_flags, add_run_flags, add_megatron_lm_flags)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block) raised as ConfigError."""

    def error(self, message: str):  # type: ignore[override]
        raise ConfigError(message)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """As argparse, but a Megatron-LM flag of a feature not implemented here is refused by name."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            reason = next((refusal(a) for a in extra if a.startswith("--") and refusal(a)), None)
            self.error(reason or f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pretrain_lev.py",
        description="Pretrain a GPT model with the LEV input embedding (or a baseline arm) on megatron-core.",
        allow_abbrev=False,
    )
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="YAML file of arguments; flags on the command line override it")
    for add_flags in _GROUPS:
        add_flags(p)
    _add_negations(p)
    for action in p._actions:  # every numeric flag's help ends with its range (generated flags' already do)
        if isinstance(action.type, Number) and not (action.help or "").endswith(f"[{action.type.describe()}]"):
            action.help = with_range(action.help, action.type)
    return p


def _add_negations(p: argparse.ArgumentParser) -> None:
    """Give every on/off flag a ``--no-...`` form, so a value set by ``--config`` can be turned off on the
    command line (e.g. ``--config 400m.yaml --no-overlap-grad-reduce``)."""
    taken = set(p._option_string_actions)
    for action in list(p._actions):
        if not isinstance(action, argparse._StoreTrueAction):
            continue
        for opt in action.option_strings:
            if opt.startswith("--") and "_" not in opt and not opt.startswith("--no-") and f"--no-{opt[2:]}" not in taken:
                # A default of None (resolved later) stays None for the readers of the parser's defaults, which
                # would otherwise get store_false's True.
                extra = {"default": None} if action.default is None else {}
                p.add_argument(f"--no-{opt[2:]}", dest=action.dest, action="store_false",
                               help=f"turn {opt} off (when a --config file sets it)", **extra)


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> argparse.Namespace:
    """Parse flags (and ``--config``), then validate. Raises ConfigError with a one-line message."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    pre, _ = parser.parse_known_args(argv) if "--config" in " ".join(argv) else (None, None)
    if pre is not None and pre.config:
        parser.set_defaults(**load_yaml_config(pre.config, parser))
    args = parser.parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate_args(args, world_size)
    return args
