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


def model_configs(argv):
    """(TransformerConfig, LevModelConfig) that ``pretrain_lev.py`` builds its model from for the flags
    ``argv`` (parsed, validated, the tokenizer's padded vocabulary in them), so that a benchmark times the
    model that trains; ConfigError in one line on flags pretrain_lev.py would refuse."""
    from .loop import _StartupError, _setup_configs

    try:
        _rc, _tokenizer, config, model_config = _setup_configs(list(argv))
    except _StartupError as e:
        raise ConfigError(str(e)) from None
    return config, model_config


__all__ = ["ConfigError", "build_parser", "model_configs", "parse_args", "pretrain", "resolved_config"]
