"""The parallel layout's rules (``ParallelLayout``) and the model's rules against it
(``check_parallel_settings``), each accepted and refused; and the three places that check a layout
(``validate_args`` from the flags, the bootstrap before megatron's groups exist, the model config from a
TransformerConfig) giving the same answer in the same words. In-process: no ranks, one single-process
bootstrap."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_lev.arguments import parse_args
from megatron_lev.distributed import DistributedConfigError, ParallelLayout, check_layout, destroy_distributed, \
    init_distributed
from megatron_lev.lev.config import ConfigError
from megatron_lev.models import LevModelConfig, build_transformer_config
from megatron_lev.models.config import check_parallel_settings

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32",
        "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--vocab-size", "256"]


def _refusal(fn, *args, **kw) -> str:
    """The one-line ConfigError of ``fn(*args, **kw)``."""
    with pytest.raises(ConfigError) as e:
        fn(*args, **kw)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------------ the layout's own rules


def test_data_parallel_size_is_derived_from_the_world():
    assert ParallelLayout(world_size=8, tp=2, pp=2).dp == 2
    assert ParallelLayout(world_size=8, tp=2, pp=2, cp=2).dp == 1
    assert ParallelLayout(world_size=1).dp == 1
    assert ParallelLayout(world_size=12, tp=3).dp == 4


@pytest.mark.parametrize("sizes, flag", [
    (dict(tp=0), "--tensor-model-parallel-size"),
    (dict(pp=-1), "--pipeline-model-parallel-size"),
    (dict(cp=0), "--context-parallel-size"),
    (dict(ep=0), "--expert-model-parallel-size"),
    (dict(etp=0), "--expert-tensor-parallel-size"),
    (dict(vpp=0, pp=2), "--virtual-pipeline-model-parallel-size"),
    (dict(tp=True), "--tensor-model-parallel-size"),
    (dict(tp=2.0), "--tensor-model-parallel-size"),
])
def test_every_size_is_a_positive_integer(sizes, flag):
    msg = _refusal(ParallelLayout, world_size=4, **sizes)
    assert msg.startswith(f"{flag} must be >= 1 (an integer"), msg
    assert "WORLD_SIZE" in _refusal(ParallelLayout, world_size=0)


def test_tp_pp_cp_tile_the_world():
    msg = _refusal(ParallelLayout, world_size=4, tp=3)
    assert msg == ("--tensor-model-parallel-size 3 x --pipeline-model-parallel-size 1 = 3 does not divide the world "
                   "size 4; start a multiple of 3 processes or change the parallel sizes")
    msg = _refusal(ParallelLayout, world_size=6, tp=2, cp=2)
    assert "x --context-parallel-size 2 = 4 does not divide the world size 6" in msg
    ParallelLayout(world_size=8, tp=2, pp=2, cp=2)


def test_expert_layout_tiles_the_ranks_of_a_stage():
    # etp unset is TP (megatron-core's default): 2 x 2 expert ranks, expert-DP 1
    assert ParallelLayout(world_size=4, tp=2, ep=2).expert_dp == 1
    one = ParallelLayout(world_size=4, tp=2, ep=2, etp=1)
    assert (one.expert_tp, one.expert_dp, one.dp) == (1, 2, 2)
    assert ParallelLayout(world_size=8, tp=2, ep=4).expert_dp == 1  # EP borrows the data-parallel ranks
    msg = _refusal(ParallelLayout, world_size=2, tp=2, ep=2)
    assert msg.startswith("--expert-model-parallel-size 2 x --expert-tensor-parallel-size 2 = 4 does not divide the "
                          "2 ranks of a pipeline stage")
    assert "divide the 2 ranks of a pipeline stage (world 4 / PP 2)" in _refusal(
        ParallelLayout, world_size=4, pp=2, ep=4, etp=1)


def test_virtual_stages_need_a_pipeline_and_one_is_none():
    assert ParallelLayout(world_size=1, vpp=1).vpp is None
    assert ParallelLayout(world_size=2, pp=2, vpp=1).vpp is None
    two = ParallelLayout(world_size=2, pp=2, vpp=2)
    assert (two.vpp, two.stages) == (2, 4)
    msg = _refusal(ParallelLayout, world_size=1, vpp=2)
    assert msg.startswith("--virtual-pipeline-model-parallel-size 2 (or --num-layers-per-virtual-pipeline-stage) "
                          "needs --pipeline-model-parallel-size > 1"), msg


def test_smallest_layout_and_megatron_field_names():
    assert ParallelLayout.smallest(tp=2, pp=2).world_size == 4
    assert ParallelLayout.smallest(tp=2, ep=4, etp=1).world_size == 4
    assert ParallelLayout.smallest(tp=2, pp=2, ep=2).world_size == 8  # 2 x 2 expert ranks per stage
    assert "--tensor-model-parallel-size must be" in _refusal(ParallelLayout.smallest, tp=0)
    fields = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                  virtual_pipeline_model_parallel_size=None, context_parallel_size=1, expert_model_parallel_size=2,
                  expert_tensor_parallel_size=None)
    layout = ParallelLayout.from_fields(fields, world_size=8)
    assert (layout.dp, layout.ep, layout.etp, layout.expert_tp) == (2, 2, None, 2)
    assert layout.megatron_sizes() == fields
    assert ParallelLayout.from_fields({}) == ParallelLayout(world_size=1)  # megatron-core's defaults
    assert check_layout(4, 2, 1, ep=2, etp=1) == ParallelLayout(world_size=4, tp=2, ep=2, etp=1)


def test_the_size_flags_are_the_layouts_fields():
    """Each size's flag is generated from its ParallelLayout field under Megatron-LM's name: the destination
    is megatron-core's field name, the default the field's (an int, not a float), the range the field's
    metadata, the help the field's docstring; so the parsed defaults make the default layout."""
    from dataclasses import fields

    from megatron_lev.arguments import build_parser
    from megatron_lev.config_flags import field_docs
    from megatron_lev.distributed.layout import MEGATRON_FIELDS, size_flag

    parser, docs = build_parser(), field_docs(ParallelLayout)
    by_flag = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    for f in fields(ParallelLayout):
        if f.name == "world_size":
            continue
        action = by_flag[size_flag(f.name)]
        assert action.dest == MEGATRON_FIELDS[f.name] and action.config_field == (ParallelLayout, f.name)
        default = parser.get_default(action.dest)
        assert default == f.default and type(default) is type(f.default), (action.dest, default, f.default)
        assert action.type.min == f.metadata["min"] and action.help.startswith(docs[f.name]), action.dest
    assert ParallelLayout.from_fields(vars(parse_args(BASE, world_size=2)), world_size=2) == ParallelLayout(world_size=2)
    assert "--context-parallel-size: must be >= 1" in _refusal(parse_args, BASE + ["--context-parallel-size", "0"])


# ------------------------------------------------------------------------ the model against the layout


def _model(layout=ParallelLayout(world_size=1), **kw):
    kw = dict(dict(num_layers=4, num_attention_heads=8), **kw)
    return check_parallel_settings(layout, **kw)


@pytest.mark.parametrize("heads, groups, tp, refusal", [
    (8, None, 2, None),
    (8, 2, 4, None),  # fewer groups than TP ranks: megatron-core replicates the keys and values
    (8, 8, 2, None),
    (8, 1, 2, None),
    (6, 3, 2, "--num-query-groups 3 and --tensor-model-parallel-size 2 must divide one another"),
    (6, 4, 1, "--num-attention-heads 6 is not divisible by --num-query-groups 4"),
    (4, 8, 1, "--num-attention-heads 4 is not divisible by --num-query-groups 8"),
    (6, None, 4, "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4"),
])
def test_heads_and_query_groups_against_tp(heads, groups, tp, refusal):
    layout = ParallelLayout(world_size=tp, tp=tp)
    if refusal is None:
        _model(layout, num_attention_heads=heads, num_query_groups=groups)
        return
    assert _refusal(_model, layout, num_attention_heads=heads, num_query_groups=groups).startswith(refusal)


def test_experts_against_ep():
    ep2 = ParallelLayout(world_size=2, ep=2)
    _model(ep2, num_moe_experts=4)
    _model(num_moe_experts=3)
    assert _refusal(_model, ep2).startswith("--expert-model-parallel-size 2 needs --num-experts")
    assert _refusal(_model, ep2, num_moe_experts=3).startswith(
        "--num-experts 3 is not divisible by --expert-model-parallel-size 2")


def test_layers_against_model_chunks_and_sequence_parallel_against_tp():
    _model(ParallelLayout(world_size=2, pp=2, vpp=2), num_layers=8)
    assert _refusal(_model, ParallelLayout(world_size=2, pp=2, vpp=2), num_layers=6).startswith(
        "--num-layers 6 is not divisible by --pipeline-model-parallel-size 2 x 2 virtual stages = 4")
    _model(ParallelLayout(world_size=2, pp=2), num_layers=3, uneven_pipeline=True)  # the stages are given
    _model(ParallelLayout(world_size=2, tp=2), sequence_parallel=True)
    assert _refusal(_model, sequence_parallel=True).startswith("--sequence-parallel needs")


# ------------------------------------------------------------------------ the three places agree


def _flags(world_size, *extra):
    return parse_args(BASE + [str(x) for x in extra], world_size=world_size)


def _transformer_config(**kw):
    kw = dict(dict(num_layers=4, hidden_size=48, num_attention_heads=8), **kw)
    return build_transformer_config(**kw)


def _model_config_check(**kw):
    """LevModelConfig.validate on a TransformerConfig that megatron-core itself accepted."""
    from megatron.core.transformer import TransformerConfig

    kw = dict(dict(num_layers=4, hidden_size=48, num_attention_heads=8), **kw)
    LevModelConfig(vocab_size=256, max_sequence_length=32).validate(TransformerConfig(**kw))


def test_query_groups_that_do_not_split_the_heads_are_refused_everywhere():
    """megatron-core's TransformerConfig takes 6 heads in 4 groups, but its attention splits each group's
    fused QKV into heads / groups queries, so the model would fail at its first forward: every check
    refuses it, in the words of the flags."""
    flags = _refusal(_flags, 1, "--num-attention-heads", 6, "--hidden-size", 48, "--group-query-attention",
                     "--num-query-groups", 4)
    built = _refusal(_transformer_config, num_attention_heads=6, num_query_groups=4)
    model = _refusal(_model_config_check, num_attention_heads=6, num_query_groups=4)
    assert flags == built == model == ("--num-attention-heads 6 is not divisible by --num-query-groups 4; choose "
                                       "--num-query-groups among the divisors of 6")
    # and fewer groups than TP ranks pass everywhere (megatron-core replicates the keys and values)
    assert _flags(4, "--group-query-attention", "--num-query-groups", 2, "--tensor-model-parallel-size", 4) \
        .num_query_groups == 2
    assert _transformer_config(num_query_groups=2, tensor_model_parallel_size=4).num_query_groups == 2


def test_expert_parallelism_is_refused_alike_by_flags_and_model():
    dense = _refusal(_flags, 2, "--expert-model-parallel-size", 2)
    assert dense == _refusal(_transformer_config, expert_model_parallel_size=2)
    assert dense.startswith("--expert-model-parallel-size 2 needs --num-experts")
    uneven = _refusal(_flags, 2, "--num-experts", 3, "--expert-model-parallel-size", 2, "--disable-bias-linear")
    assert uneven == _refusal(_transformer_config, num_moe_experts=3, moe_ffn_hidden_size=32,
                              expert_model_parallel_size=2)
    assert uneven.startswith("--num-experts 3 is not divisible by --expert-model-parallel-size 2")


def test_world_size_refusal_is_one_rule():
    flags = _refusal(_flags, 4, "--tensor-model-parallel-size", 3)
    assert flags == _refusal(check_layout, 4, 3, 1) == _refusal(ParallelLayout, world_size=4, tp=3)
    experts = _refusal(_flags, 2, "--tensor-model-parallel-size", 2, "--expert-model-parallel-size", 2,
                       "--num-experts", 4)
    assert experts == _refusal(check_layout, 2, 2, 1, ep=2)


def test_virtual_stages_at_pp1_agree_in_flags_model_and_bootstrap(single_process):
    """One virtual stage is no interleaving everywhere; more need PP > 1 everywhere (the bootstrap used to
    hand both to megatron-core, which raised RuntimeError for either)."""
    assert _flags(1, "--virtual-pipeline-model-parallel-size", 1).virtual_pipeline_model_parallel_size is None
    flags = _refusal(_flags, 1, "--virtual-pipeline-model-parallel-size", 2)
    assert flags == _refusal(_transformer_config, virtual_pipeline_model_parallel_size=2)
    with pytest.raises(DistributedConfigError) as e:
        init_distributed(pp=1, vpp=2)
    assert str(e.value) == flags
    assert not dist.is_initialized(), "a refused layout leaves no process group behind"
    setup = init_distributed(pp=1, vpp=1)
    try:
        assert setup.layout == ParallelLayout(world_size=1)
        assert ps.get_virtual_pipeline_model_parallel_world_size() is None
    finally:
        destroy_distributed(setup)


def test_bootstrap_takes_a_layout(single_process):
    layout = ParallelLayout(world_size=1)
    setup = init_distributed(layout=layout)
    try:
        assert setup.layout is layout and ps.get_data_parallel_world_size() == layout.dp
    finally:
        destroy_distributed(setup)
    msg = _refusal(init_distributed, layout=ParallelLayout(world_size=2))
    assert msg.startswith("the parallel layout is for 2 processes but this job has 1")
    assert "not both" in _refusal(init_distributed, layout=layout, tp=1)


def test_training_hands_the_bootstrap_its_validated_layout():
    """The trainer starts megatron's groups from the RunConfig's ParallelLayout (made once, by
    validate_args), not from its sizes read back out of it (which the bootstrap would check again)."""
    import ast
    from pathlib import Path

    import megatron_lev.training as training

    calls = []
    for path in sorted(Path(training.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == \
                    "init_distributed":
                calls.append((path.name, node.lineno, {k.arg for k in node.keywords}))
    assert calls, "training/ starts no process group"
    for name, line, keywords in calls:
        assert "layout" in keywords and not keywords & {"tp", "pp", "vpp", "ep", "etp"}, (name, line, keywords)
