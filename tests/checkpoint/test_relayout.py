"""The saved arguments of a checkpoint moved to another layout by one function (``relayout``), and read
as ``SavedModel``."""

from __future__ import annotations

import pytest

from megatron_lev.checkpoint import SavedModel, relayout
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


def test_relayout_refuses_a_layout_in_the_layouts_own_words():
    """The target layout's sizes are checked by ParallelLayout's rules, not restated: the same one line as
    the flags get, and virtual stages at PP 1 (which megatron-core refuses) are refused here too."""
    from megatron_lev.distributed import ParallelLayout

    saved = {"padded_vocab_size": 384, "make_vocab_size_divisible_by": 128, "tensor_model_parallel_size": 1,
             "pipeline_model_parallel_size": 1}
    for sizes in (dict(tp=2, pp=2, world_size=6), dict(tp=1, pp=1, vpp=2), dict(tp=0, pp=1)):
        with pytest.raises(ConfigError) as got:
            relayout(saved, **sizes)
        with pytest.raises(ConfigError) as want:
            ParallelLayout(world_size=sizes.pop("world_size", 1), **sizes)
        assert str(got.value) == str(want.value)
    a = relayout(saved, tp=1, pp=2, vpp=1, world_size=4)
    assert (a["virtual_pipeline_model_parallel_size"], a["data_parallel_size"]) == (None, 2)


def test_saved_model_reads_counts_and_refuses_one_that_is_not_a_whole_number_in_one_line():
    saved = SavedModel.from_saved_args({"seq_length": "32", "padded_vocab_size": 384.0, "mtp_num_layers": 0})
    assert saved == SavedModel(seq_length=32, padded_vocab_size=384, mtp_num_layers=None)
    for bad in ("abc", 32.5, True):  # before: a bare "invalid literal for int()", or 32 and 1 taken silently
        with pytest.raises(ConfigError, match=r"^the saved seq_length is .*, not a whole number: .*config.yaml") as e:
            SavedModel.from_saved_args({"seq_length": bad})
        assert "\n" not in str(e.value)
