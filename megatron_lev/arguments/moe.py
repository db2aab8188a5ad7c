"""Mixture-of-experts and multi-token-prediction flags under Megatron-LM's names, and their checks.

The flags whose name is a megatron-core ``TransformerConfig`` field (``--moe-router-topk``,
``--mtp-num-layers``, the ``--moe-grouped-gemm`` switches, ...) are
generated from the installed ``TransformerConfig`` (type, default, help); the others are written here:
``--num-experts`` (``num_moe_experts``), and the flags whose field type has no single command-line form
(``--moe-layer-freq``: an int or a pattern; the load-balancing type and aux-loss coefficient: one value
here, where the field also takes a list; the dispatcher: the choices this project runs).
``models.factory.MOE_FIELDS`` maps the settings to the TransformerConfig fields. The expert-parallel sizes
(``--expert-model-parallel-size``, ``--expert-tensor-parallel-size``) are the parallel layout's flags
(``arguments.parallel``).
"""

from __future__ import annotations

import argparse
import ast
import operator
from types import SimpleNamespace
from typing import List, Union

from megatron.core.transformer import TransformerConfig

from megatron_lev.config_flags import NON_NEGATIVE_FLOAT, POSITIVE_INT, add_config_flags, add_switch_flags
from megatron_lev.lev.config import ConfigError
from megatron_lev.models.config import use_transformer_engine
from megatron_lev.models.moe import MOE_LOAD_BALANCING_TYPES, MOE_TOKEN_DISPATCHERS, check_moe_settings

from .model import field_flag

# TransformerConfig fields that are flags of their own name.
_VALUE_FIELDS = ("moe_ffn_hidden_size", "moe_router_topk", "moe_z_loss_coeff", "moe_router_dtype", "mtp_num_layers",
                 "mtp_loss_scaling_factor")
# Their ranges (TransformerConfig has no range metadata): sizes >= 1, loss coefficients >= 0.
_RANGES = {"moe_ffn_hidden_size": {"min": 1}, "moe_router_topk": {"min": 1}, "moe_z_loss_coeff": {"min": 0},
           "mtp_num_layers": {"min": 1}, "mtp_loss_scaling_factor": {"min": 0}}
_SWITCHES = (
    ("--moe-grouped-gemm", "moe_grouped_gemm", True),
    ("--moe-permute-fusion", "moe_permute_fusion", True),
    ("--moe-per-layer-logging", "moe_per_layer_logging", True),
)
# The argument names of the MoE / MTP settings (Megatron-LM's), as the TransformerConfig check reads them.
_FIELD_OF_ARG = {"num_experts": "num_moe_experts"}

_OPS = {ast.Add: operator.add, ast.Mult: operator.mul}


def _pattern_value(node):
    """The value of a list pattern expression: int and list literals joined by + and * (what
    Megatron-LM's ``eval`` of ``--moe-layer-freq`` is given, e.g. ``([0]*1+[1]*3)*2``)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_pattern_value(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_pattern_value(node.left), _pattern_value(node.right))
    raise ValueError("not a pattern")


def moe_layer_freq(text: Union[int, str]) -> Union[int, List[int]]:
    """``--moe-layer-freq`` as Megatron-LM parses it: an int N (every N-th layer is MoE) or a Python list
    expression of 0/1 per layer (``[1,0,1,0]``, ``([0]+[1]*3)*2``), evaluated without ``eval``."""
    if isinstance(text, int):
        return text
    try:
        value = int(text) if "[" not in text else _pattern_value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        value = None
    if not isinstance(value, (int, list)):
        raise argparse.ArgumentTypeError(f"{text!r} is neither an int nor a list of 0/1 like [1,0,1,0]")
    return value


def add_moe_flags(p) -> None:
    g = p.add_argument_group("mixture of experts and multi-token prediction (megatron-core TransformerConfig fields)")
    g.add_argument("--num-experts", type=POSITIVE_INT, default=None,
                   help="experts per MoE layer (TransformerConfig.num_moe_experts); unset: a dense model")
    g.add_argument("--moe-layer-freq", type=moe_layer_freq, default=1,
                   help="every N-th layer is an MoE layer (an int), or a list of 0/1 per layer, e.g. "
                        "'([0]+[1]*3)*2'")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss", choices=MOE_LOAD_BALANCING_TYPES,
                   help="the router's load balancing: aux_loss (GShard), seq_aux_loss (per sequence, "
                        "DeepSeek), sinkhorn (S-BASE), none")
    g.add_argument("--moe-aux-loss-coeff", type=NON_NEGATIVE_FLOAT, default=0.0, help="scale of the load-balancing loss")
    g.add_argument("--moe-token-dispatcher-type", default="allgather", choices=MOE_TOKEN_DISPATCHERS,
                   help="how tokens reach the experts' ranks (alltoall needs CUDA here)")
    add_config_flags(g, TransformerConfig, field_flag, _VALUE_FIELDS, ranges=_RANGES)
    add_switch_flags(g, TransformerConfig, _SWITCHES)


def check_moe_flags(args) -> None:
    """The MoE settings against the model (``models.moe.check_moe_settings``), a one-line ConfigError naming
    the flag. The expert layout is part of the parallel layout (``validate._check_parallel_sizes``), where
    --expert-tensor-parallel-size stays unset when not given (None: the TP size, megatron-core's default)
    rather than written out as Megatron-LM does, so that a checkpoint's saved arguments stay right after a
    conversion to another TP size."""
    try:
        te = use_transformer_engine(args.transformer_impl)
    except ConfigError:
        return  # the model build refuses the impl in its own words
    names = ("num_experts", "moe_layer_freq", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
             "moe_token_dispatcher_type") + _VALUE_FIELDS + tuple(f for _, f, _ in _SWITCHES)
    settings = {_FIELD_OF_ARG.get(n, n): getattr(args, n) for n in names}
    check_moe_settings(SimpleNamespace(num_layers=args.num_layers, add_bias_linear=not args.disable_bias_linear,
                                       **settings), use_transformer_engine=te)
