"""Pretraining: arguments/config, the loop over megatron-core schedules, optimizer + LR schedule,
logging (stdout, TensorBoard, wandb) and fault handling; checkpoints, the arguments and the model
construction come from ``megatron_lev.checkpoint`` (shared with evaluation and conversion).

Entry point: ``pretrain(argv)`` (used by ``pretrain_lev.py``).
"""

from megatron_lev._procutil import guard_process_tree
from megatron_lev.lev.config import ConfigError

from megatron_lev.arguments import build_parser, parse_args, resolved_config


def pretrain(argv=None) -> int:
    guard_process_tree()  # before the imports of the loop, which take seconds
    from .loop import pretrain as _pretrain

    return _pretrain(argv)


__all__ = ["ConfigError", "build_parser", "parse_args", "pretrain", "resolved_config"]
