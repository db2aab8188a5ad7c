"""Each default is written once: a flag of pretrain_lev.py whose destination is a field of a config dataclass
it fills (the run's own groups of ``megatron_lev.config``, LevModelConfig, LEVConfig, TokenizerSpec,
megatron-core's TransformerConfig, OptimizerConfig and DistributedDataParallelConfig) defaults to that field's
default, or DIFFERS says why not. In-process: the parser and the dataclasses' field defaults only."""

from __future__ import annotations

import enum
from dataclasses import MISSING, fields

import pytest
import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer import TransformerConfig

from megatron_lev.arguments import build_parser
from megatron_lev.arguments.precision import OPTIMIZER_DTYPE_FIELDS, OPTIMIZER_DTYPES
from megatron_lev.config.run import _GROUPS
from megatron_lev.lev.config import LEVConfig, lev_arg
from megatron_lev.models.config import LevModelConfig, build_transformer_config
from megatron_lev.models.factory import MOE_FIELDS
from megatron_lev.tokenizer import TokenizerSpec

FILLED = (*_GROUPS.values(), LevModelConfig, LEVConfig, TokenizerSpec, TransformerConfig, OptimizerConfig,
          DistributedDataParallelConfig)

# Destinations that are not their field's name: dest -> (class, field, the field value a flag value means).
RENAMED = {
    "swiglu": (LevModelConfig, "activation", lambda on: "swiglu" if on else "gelu"),
    "disable_bias_linear": (LevModelConfig, "add_bias_linear", lambda off: not off),
    "seed": (LevModelConfig, "init_seed", None),
    "seq_length": (LevModelConfig, "max_sequence_length", None),
    "norm_epsilon": (TransformerConfig, "layernorm_epsilon", None),
    "fp8_format": (TransformerConfig, "fp8", None),
    "fp8_param_gather": (TransformerConfig, "fp8_param", None),
    "bias_gelu_fusion": (TransformerConfig, "bias_activation_fusion", None),
    "bias_swiglu_fusion": (TransformerConfig, "bias_activation_fusion", None),
    "accumulate_allreduce_grads_in_fp32": (DistributedDataParallelConfig, "grad_reduce_in_fp32", None),
    "ddp_bucket_size": (DistributedDataParallelConfig, "bucket_size", None),
    **{dest: (TransformerConfig, name, None) for dest, name in MOE_FIELDS.items() if dest != name},
    **{lev_arg(f.name): (LEVConfig, f.name, None) for f in fields(LEVConfig)},
}

# (dest, class name): why the command line's default is not the field's.
_RESOLVED_FUSION = "None: on where CUDA and the kernel are present (models.config.fusion_defaults), as Megatron-LM"
_REQUIRED = "required: the run gives it (0 is megatron-core's placeholder)"
DIFFERS = {
    ("num_layers", "TransformerConfig"): _REQUIRED,
    ("hidden_size", "TransformerConfig"): _REQUIRED,
    ("num_attention_heads", "TransformerConfig"): _REQUIRED,
    ("input_embedding", "LevModelConfig"): "None: tied, or untied with Megatron-LM's "
                                           "--untie-embeddings-and-output-weights; the dataclass is LEV's model",
    ("transformer_impl", "TransformerConfig"): "the flag picks the layer spec (LevModelConfig.transformer_impl: auto, "
                                               "Transformer Engine only where TE and CUDA are); TransformerConfig "
                                               "keeps its own",
    ("attention_softmax_in_fp32", "TransformerConfig"): "Megatron-LM's command line: the softmax in the input dtype "
                                                        "unless asked",
    ("apply_rope_fusion", "TransformerConfig"): _RESOLVED_FUSION,
    ("bias_dropout_fusion", "TransformerConfig"): _RESOLVED_FUSION,
    ("masked_softmax_fusion", "TransformerConfig"): _RESOLVED_FUSION,
    ("gradient_accumulation_fusion", "TransformerConfig"): _RESOLVED_FUSION,
    ("bias_gelu_fusion", "TransformerConfig"): _RESOLVED_FUSION,
    ("bias_swiglu_fusion", "TransformerConfig"): _RESOLVED_FUSION,
    ("fp8_recipe", "OptimizerConfig"): "the optimizer gets the recipe only with --fp8-format (TransformerConfig's "
                                       "default is the flag's)",
    ("min_lr", "OptimizerConfig"): "Megatron-LM's command line: the schedule decays to 0.0 (None: unset)",
    ("use_cpu_initialization", "TransformerConfig"): "None: megatron-core's (on the device) where there is a GPU, "
                                                     "the CPU where there is none (models.config)",
}


def _default(f):
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _pairs():
    """(dest, class, field, the parser's default as a field value, the field's default, the parser's default)
    for every destination of the parser that names a field with a default of a FILLED class."""
    by_class = {cls: {f.name: f for f in fields(cls)} for cls in FILLED}
    parser = build_parser()
    out = []
    for dest in dict.fromkeys(a.dest for a in parser._actions):  # a --no-... negation shares its flag's dest
        default = parser.get_default(dest)  # the first action's: what argparse gives
        # (LEVConfig's destinations are lev_arg(field), in RENAMED); a renamed destination is also checked
        # against the run configuration's field of its own name
        targets = [(cls, dest, None) for cls in FILLED if cls is not LEVConfig and dest in by_class[cls]
                   and (dest not in RENAMED or cls in _GROUPS.values())]
        if dest in RENAMED:
            targets.append(RENAMED[dest])
        for cls, name, convert in targets:
            f = by_class[cls].get(name)
            if f is None:  # a field this megatron-core release lacks
                continue
            want = _default(f)
            if want is MISSING:
                continue  # a required field: no default to agree with
            got = convert(default) if convert else default
            if isinstance(want, enum.Enum):  # an Enum field's flag takes the member's name
                want = want.name
            if name in OPTIMIZER_DTYPE_FIELDS and got in OPTIMIZER_DTYPES and cls is OptimizerConfig:
                # megatron-core's field holds the torch dtype of Megatron-LM's name
                got = getattr(torch, OPTIMIZER_DTYPES[got])
            out.append((dest, cls, name, got, want, default))
    return out


def test_every_flag_defaults_to_its_fields_default():
    wrong = {(dest, cls.__name__): f"{dest} = {raw!r} (so {name} = {got!r}) but {cls.__name__}.{name} = {want!r}"
             for dest, cls, name, got, want, raw in _pairs() if got != want and (dest, cls.__name__) not in DIFFERS}
    assert not wrong, f"defaults written twice that disagree: {sorted(wrong.values())}"


def test_each_listed_difference_is_one():
    """A DIFFERS entry whose flag and field now agree (or that names no flag's field) is stale."""
    found = {(dest, cls.__name__): got != want for dest, cls, name, got, want, _ in _pairs()}
    stale = [key for key in DIFFERS if found.get(key) is False]
    assert not stale, f"these now agree: drop them from DIFFERS: {stale}"


def test_the_model_defaults_are_megatron_lms():
    from megatron_lev.models.config import model_field_default

    # Megatron-LM's: learned absolute positions, LayerNorm, GeLU, biases, seed 1234.
    assert [model_field_default(n) for n in ("position_embedding_type", "normalization", "activation",
                                             "add_bias_linear", "init_seed")] == \
        ["learned_absolute", "LayerNorm", "gelu", True, 1234]
    defaults = build_parser().get_default
    assert [defaults(d) for d in ("position_embedding_type", "normalization", "swiglu", "disable_bias_linear",
                                  "seed")] == ["learned_absolute", "LayerNorm", False, False, 1234]


def test_a_transformer_config_without_a_model_config_has_the_model_defaults():
    config = build_transformer_config(num_layers=1, hidden_size=8, num_attention_heads=2)
    assert (config.normalization, config.gated_linear_unit, config.add_bias_linear) == ("LayerNorm", False, True)


def test_saved_arguments_without_a_setting_read_the_flags_default():
    """A saved config.yaml that lacks a model key is read with the flag's default (the field's)."""
    from megatron_lev.arguments import parse_args, resolved_config
    from megatron_lev.config import RunConfig

    defaults = build_parser().get_default
    saved = resolved_config(parse_args(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --train-iters 4 "
        "--lr 1e-3 --mock-data --vocab-size 100 --normalization RMSNorm --swiglu --rotary-base 500".split(),
        world_size=1))
    names = ("position_embedding_type", "normalization", "swiglu", "disable_bias_linear", "rotary_percent",
             "rotary_base", "init_method_std", "norm_epsilon")
    given = RunConfig.from_saved_args(saved).model
    assert (given.normalization, given.swiglu, given.rotary_base) == ("RMSNorm", True, 500)
    missing = RunConfig.from_saved_args({k: v for k, v in saved.items() if k not in names}).model
    for dest in names:
        assert getattr(missing, dest) == defaults(dest), dest


@pytest.mark.parametrize("missing,named", [("position_embedding_type", "--position-embedding-type learned_absolute"),
                                           ("normalization", "--normalization LayerNorm")])
def test_the_hf_export_reads_a_missing_setting_as_the_flags_default(missing, named):
    from megatron_lev.arguments import parse_args, resolved_config
    from megatron_lev.config import RunConfig
    from megatron_lev.conversion import check_hf_compatible
    from megatron_lev.conversion.source import ConversionError

    llama = resolved_config(parse_args(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --train-iters 4 "
        "--lr 1e-3 --mock-data --vocab-size 100 --normalization RMSNorm --swiglu --disable-bias-linear "
        "--position-embedding-type rope".split(), world_size=1))
    check_hf_compatible(RunConfig.from_saved_args(llama).model)
    del llama[missing]  # a config.yaml written before the flag existed
    with pytest.raises(ConversionError, match=named):
        check_hf_compatible(RunConfig.from_saved_args(llama).model)


def test_the_tables_name_destinations_of_the_parser():
    dests = {a.dest for a in build_parser()._actions}
    assert {dest for dest, _ in DIFFERS} <= dests and set(RENAMED) <= dests
