"""Pretraining: arguments/config, the loop over megatron-core schedules, optimizer + LR schedule,
dist_checkpointing checkpoints, logging (stdout, TensorBoard, wandb) and fault handling.

Entry point: ``pretrain(argv)`` (used by ``pretrain_lev.py``); the checkpoint reader
(``checkpointing.load_checkpoint``/``find_checkpoint``) is shared with evaluation and conversion.
"""

from megatron_lev.lev.config import ConfigError

from .arguments import build_parser, parse_args, resolved_config


def pretrain(argv=None) -> int:
    from ._procutil import guard_process_tree

    guard_process_tree()  # before the imports of the loop, which take seconds
    from .loop import pretrain as _pretrain

    return _pretrain(argv)


__all__ = ["ConfigError", "build_parser", "parse_args", "pretrain", "resolved_config"]
