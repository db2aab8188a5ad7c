"""The saved arguments of a checkpoint moved to another layout by one function (``relayout``)."""

from __future__ import annotations

import pytest

from megatron_lev.checkpoint import relayout
from megatron_lev.lev.config import ConfigError


def test_relayout_keeps_the_padded_vocabulary_and_refuses_a_tp_it_cannot_take():
    saved = {"padded_vocab_size": 384, "make_vocab_size_divisible_by": 128, "tensor_model_parallel_size": 1,
             "pipeline_model_parallel_size": 1, "sequence_parallel": False, "micro_batch_size": 2,
             "global_batch_size": 8}
    a = relayout(saved, tp=2, pp=2, world_size=8)
    assert a["padded_vocab_size"] == 384 and a["tensor_model_parallel_size"] == 2
    assert a["data_parallel_size"] == 2 and a["num_microbatches"] == 4
    assert 384 % (a["make_vocab_size_divisible_by"] * 2) == 0  # a run at TP=2 pads to the same rows
    with pytest.raises(ConfigError, match="not divisible by TP 5"):
        relayout(saved, tp=5, pp=1)
    with pytest.raises(ConfigError, match="does not divide the world size 6"):
        relayout(saved, tp=2, pp=2, world_size=6)


def test_relayout_regathers_the_experts_of_an_moe_model():
    saved = {"padded_vocab_size": 256, "make_vocab_size_divisible_by": 64, "tensor_model_parallel_size": 2,
             "pipeline_model_parallel_size": 1, "num_experts": 4, "expert_model_parallel_size": 2,
             "expert_tensor_parallel_size": 1}
    a = relayout(saved, tp=1, pp=1)
    assert (a["expert_model_parallel_size"], a["expert_tensor_parallel_size"]) == (1, None)
    dense = relayout({k: v for k, v in saved.items() if k != "num_experts"}, tp=1, pp=1)
    assert dense["expert_model_parallel_size"] == 2  # a dense model's saved value is left as it was
