"""Command-line arguments of ``pretrain_lev.py``: Megatron-LM's flag names, a YAML config, validation.

One module per flag group, in ``--help`` order:

- ``model``: model shape under Megatron-LM's names (``--num-layers``, ``--swiglu``, ...).
- ``lev``: the input arm and every ``--lev-*`` flag, generated from ``LevModelConfig`` and ``LEVConfig``.
- ``parallel``: TP/PP/virtual stages, sequence parallelism, distributed optimizer, DDP overlap.
- ``moe``: mixture of experts (``--num-experts``, ``--moe-*``, expert parallelism) and multi-token prediction.
- ``precision``: bf16/fp16, loss scaling, FP8.
- ``schedule``: optimizer, learning-rate and weight-decay schedule, batch sizes, training length.
- ``data``: datasets, loader, tokenizer (``TokenizerSpec.add_flags``).
- ``checkpointing``: save/load/resume.
- ``run``: seed, exit conditions, NaN handling, logging and evaluation.
- ``megatron_lm``: the Megatron-LM flags refused here (one line naming the feature) and the no-ops.

``parser`` builds the parser from the groups (``build_parser``) and parses (``parse_args``: flags,
``--config``, validation); ``parse_run_config`` returns the result as typed groups, a
:class:`megatron_lev.config.RunConfig` (the package below this one, whose fields most flags are generated from).

``validate`` checks the combination and derives what Megatron-LM derives; ``config_file`` reads
``--config FILE.yaml`` and writes the resolved config (``config.yaml`` beside every checkpoint).
Every failure is a :class:`ConfigError` whose message is one line naming the flag to change. Every
numeric flag's type is a ``config_flags.Number`` holding its valid range (written where the flag is
declared; a generated flag's comes from its field), checked as the value is parsed from the command line
or a ``--config`` file and stated at the end of its ``--help``.

Precedence: built-in defaults < ``--config FILE.yaml`` < flags on the command line.

The package sits below training, evaluation and conversion: the conversions write complete argument
sets for the checkpoints they create with the same parser.
"""

from __future__ import annotations

from typing import Optional, Sequence

from megatron_lev.lev.config import ConfigError

from .config_file import config_to_yaml, format_config, load_yaml_config, resolved_config
from .parser import build_parser, parse_args
from megatron_lev.config import RunConfig
from .validate import validate_args

__all__ = ["ConfigError", "RunConfig", "build_parser", "config_to_yaml", "format_config", "load_yaml_config",
           "parse_args", "parse_run_config", "resolved_config", "validate_args"]


def parse_run_config(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> RunConfig:
    """The run configuration of these flags (``parse_args``: parsed, ``--config`` read, validated), as
    typed groups. Values the tokenizer decides (``model.padded_vocab_size``, ``data.tokenizer_fingerprint``)
    are None until it is built. Raises ConfigError with a one-line message."""
    return RunConfig.from_args(parse_args(argv, world_size))
