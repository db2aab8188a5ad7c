"""The input-arm registry (``megatron_lev.models.arms``): the six arms' numbers as before the registry, the
registry's choices and one-line refusals, and an arm of one's own, written as a new module and registered with
one line, trained two steps by pretrain_lev's library entry."""

from __future__ import annotations

import importlib
import json
import math
import sys
from types import SimpleNamespace

import pytest

from megatron_lev.checkpoint import STRUCTURE_ARGS
from megatron_lev.lev.config import ConfigError, LEVConfig
from megatron_lev.models import LevModelConfig, parameter_breakdown
from megatron_lev.models.arms import InputArm, arm_names, get_arm, register_arm, unregister_arm
from megatron_lev.training.flops import flops_per_iteration

ARMS = ("tied", "untied", "albert", "flat_mlp", "factored_mlp", "lev")

# A golden table, which is fine here because it guards a refactor: every figure was computed by the code before
# the registry existed (models/params.py's and training/flops.py's string chains) at main e0cf5df, for a 2-layer
# Llama-style model, global batch 8 x 64 tokens, DP=1. Key: (shape, arm) -> (widths, input side, total
# parameters, FLOPs per iteration, ties the head).
SHAPES = {
    "small": dict(vocab_size=512, hidden=64, lev=dict(seed_dim=8, rank=4, num_knots=5, num_heads=4), albert_dim=4),
    "paper": dict(vocab_size=50304, hidden=1024, lev=dict(), albert_dim=None),  # the spec's LEV defaults, matched
}
BEFORE = {
    ("small", "tied"): ({}, 32768, 164160, 553648128.0, True),
    ("small", "untied"): ({}, 32768, 196928, 553648128.0, False),
    ("small", "albert"): ({"albert_dim": 4}, 2368, 166528, 554434560.0, False),
    ("small", "flat_mlp"): ({"flat_mlp_dim": 2, "mlp_hidden": 18}, 2294, 166454, 557297664.0, False),
    ("small", "factored_mlp"): ({"factored_mlp_hidden": 28}, 2300, 166460, 559841280.0, False),
    ("small", "lev"): ({}, 2272, 166432, 559153152.0, False),
    ("paper", "tied"): ({}, 51511296, 85070848, 262127222784.0, True),
    ("paper", "untied"): ({}, 51511296, 136582144, 262127222784.0, False),
    ("paper", "albert"): ({"albert_dim": 34}, 1746176, 86817024, 262234177536.0, False),
    ("paper", "flat_mlp"): ({"flat_mlp_dim": 17, "mlp_hidden": 831}, 1722094, 86792942, 264784720896.0, False),
    ("paper", "factored_mlp"): ({"factored_mlp_hidden": 1480}, 1721672, 86792520, 267364859904.0, False),
    ("paper", "lev"): ({}, 1722240, 86793088, 264945795072.0, False),
}
# LEV's FLOPs per compute mode at the small shape with DP=2 (table mode: V ids on each data-parallel rank).
LEV_FLOPS_BEFORE = {"token": 559153152.0, "unique": 559153152.0, "table": 564658176.0}
# The names each arm's parameters are saved under (sharded state dict keys outside the decoder, TP=1).
KEYS_BEFORE = {
    "tied": ["embedding.word_embeddings.weight"],
    "untied": ["embedding.word_embeddings.weight", "output_layer.weight"],
    "albert": ["embedding.arm.proj_bias", "embedding.arm.proj_weight", "embedding.arm.word_embeddings.weight",
               "output_layer.weight"],
    "flat_mlp": ["embedding.arm.fc1_bias", "embedding.arm.fc1_weight", "embedding.arm.fc2_bias",
                 "embedding.arm.fc2_weight", "embedding.arm.word_embeddings.weight", "output_layer.weight"],
    "factored_mlp": ["embedding.arm.fc1_bias", "embedding.arm.fc1_weight", "embedding.arm.fc2_bias",
                     "embedding.arm.fc2_weight", "embedding.arm.seed.codebooks", "output_layer.weight"],
    "lev": ["embedding.arm.heads.delta", "embedding.arm.heads.norm_bias", "embedding.arm.heads.norm_weight",
            "embedding.arm.heads.out_weight", "embedding.arm.heads.proj_bias", "embedding.arm.heads.proj_weight",
            "embedding.arm.offset", "embedding.arm.seed.codebooks", "output_layer.weight"],
}


def _configs(shape: str, arm: str, **lev):
    s = SHAPES[shape]
    mc = LevModelConfig(vocab_size=s["vocab_size"], max_sequence_length=64, input_embedding=arm,
                        lev=LEVConfig(**s["lev"], **lev), albert_dim=s["albert_dim"], position_embedding_type="rope",
                        normalization="RMSNorm", activation="swiglu", add_bias_linear=False)
    D = s["hidden"]
    # The TransformerConfig fields the counts read.
    config = SimpleNamespace(hidden_size=D, num_layers=2, num_attention_heads=4, kv_channels=D // 4,
                             num_query_groups=4, ffn_hidden_size=4 * D, gated_linear_unit=True,
                             normalization="RMSNorm", add_bias_linear=False, moe_layer_freq=1,
                             num_moe_experts=None, mtp_num_layers=None, moe_router_topk=2)
    return mc, config


@pytest.mark.parametrize("shape,arm", sorted(BEFORE))
def test_counts_widths_and_flops_are_those_before_the_registry(shape, arm):
    mc, config = _configs(shape, arm)
    widths, input_side, total, flops, tied = BEFORE[shape, arm]
    b = parameter_breakdown(mc, config)
    assert (b["widths"], b["input_side"], b["total"]) == (widths, input_side, total)
    assert flops_per_iteration(config, mc, global_batch_size=8, seq_length=64, data_parallel_size=1) == flops
    assert mc.share_embeddings_and_output_weights is tied
    # And straight from the registry's entry.
    entry = get_arm(arm)
    assert (entry.widths(mc, config.hidden_size), entry.input_params(mc, config.hidden_size)) == (widths, input_side)


def test_lev_flops_per_compute_mode_are_those_before_the_registry():
    for mode, flops in LEV_FLOPS_BEFORE.items():
        mc, config = _configs("small", "lev", compute_mode=mode)
        assert flops_per_iteration(config, mc, global_batch_size=8, seq_length=64, data_parallel_size=2) == flops


def test_choices_flags_and_structure_args_come_from_the_registry():
    from megatron_lev.arguments import build_parser

    assert tuple(arm_names()) == ARMS
    actions = {a.dest: a for a in build_parser()._actions}
    assert tuple(actions["input_embedding"].choices) == ARMS
    assert {"albert_dim", "flat_mlp_dim", "mlp_hidden"} <= set(actions)
    assert STRUCTURE_ARGS[STRUCTURE_ARGS.index("lev_heads") + 1:][:3] == ("albert_dim", "flat_mlp_dim", "mlp_hidden")
    with pytest.raises(ConfigError, match=r"^--input-embedding must be one of tied, untied, .*lev \(got 'nope'\); "
                                          r"an arm of your own is registered with .*register_arm"):
        get_arm("nope")


def test_registration_refuses_a_taken_name_and_what_is_not_an_arm():
    class Lev2(InputArm):
        name = "lev"

    with pytest.raises(ValueError, match="'lev' is already registered"):
        register_arm(Lev2)
    with pytest.raises(TypeError, match="InputArm subclass"):
        register_arm(object)
    assert tuple(arm_names()) == ARMS


def test_saved_key_names_are_those_before_the_registry():
    """One in-process TP=1 world; each arm's model (one layer) built and its sharded keys outside the decoder."""
    from megatron_lev.distributed import destroy_distributed, init_distributed
    from tests.models import _harness

    setup = init_distributed(tp=1, pp=1, backend="gloo", timeout_minutes=1, seed=1234)
    try:
        for arm in ARMS:
            mc = _harness.model_config(arm)
            (chunk,) = _harness.build_chunks(mc, _harness.transformer_config(mc))
            assert sorted(k for k in chunk.sharded_state_dict() if not k.startswith("decoder.")) == KEYS_BEFORE[arm]
    finally:
        destroy_distributed(setup)


# ------------------------------------------------------------------ an arm of one's own

# What a user writes: one new module (here a V x D table scaled by one learned scalar). BUILT is the test's window
# on the modules pretrain builds.
TOY_ARM = '''
"""scaled_table: an untied V x D table times one learned scalar."""
import torch

from megatron_lev.models.arms import InputArm
from megatron_lev.parallel.arms import TableArm

BUILT = []


class ScaledTable(TableArm):
    def __init__(self, *, config, vocab_size, reduce_scatter_embeddings=False, tp_group=None):
        super().__init__(config=config, vocab_size=vocab_size, table_dim=config.hidden_size,
                         reduce_scatter_embeddings=reduce_scatter_embeddings, tp_group=tp_group)
        self.scale = torch.nn.Parameter(torch.full((1,), 0.5, dtype=config.params_dtype,
                                                   device=self.word_embeddings.weight.device))
        self._finish_replicated()

    def forward(self, input_ids):
        return self._lookup(input_ids) * self.scale


class ScaledTableArm(InputArm):
    name = "scaled_table"

    def build(self, *, config, vocab_size, model_config, reduce_scatter_embeddings=False, tp_group=None):
        module = ScaledTable(config=config, vocab_size=vocab_size,
                             reduce_scatter_embeddings=reduce_scatter_embeddings, tp_group=tp_group)
        BUILT.append((module, {n: p.detach().clone() for n, p in module.named_parameters()}))
        return module

    def input_params(self, model_config, hidden_size):
        return model_config.vocab_size * hidden_size + 1
'''

TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-2",
        "--mock-data", "--vocab-size", "255", "--log-interval", "1", "--eval-iters", "0", "--quiet-config"]


@pytest.fixture
def toy_arm(tmp_path, monkeypatch):
    (tmp_path / "toy_arm.py").write_text(TOY_ARM)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("toy_arm")
    yield module
    if "scaled_table" in arm_names():  # the next test sees the six arms again
        unregister_arm("scaled_table")
    module.BUILT.clear()  # the trained model (and its process groups' handles) goes with it
    sys.modules.pop("toy_arm", None)


def test_an_arm_in_a_new_module_registered_with_one_line_trains(toy_arm, tmp_path, capsys):
    from megatron_lev.training import pretrain

    register_arm(toy_arm.ScaledTableArm)  # the one registration line

    assert "scaled_table" in arm_names()
    metrics = tmp_path / "metrics.jsonl"
    assert pretrain(TINY + ["--input-embedding", "scaled_table", "--metrics-file", str(metrics)]) == 0
    assert "input arm: scaled_table" in capsys.readouterr().out  # the parameter report counts it
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [r["lm loss"] for r in rows if r["kind"] == "train"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    (module, before), = toy_arm.BUILT
    for name, p in module.named_parameters():
        assert not p.detach().equal(before[name]), f"{name} did not change: no gradient reached it"
