"""A checkpoint's saved configuration moved to another layout by one method (``RunConfig.relayout``), and
read back typed (``RunConfig.from_saved_args``: whole numbers, ranges)."""

from __future__ import annotations

import pytest

from megatron_lev.arguments import parse_run_config
from megatron_lev.config import ConfigError, RunConfig

_FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
          "--global-batch-size 8 --train-iters 2 --lr 1e-3 --mock-data --vocab-size 300 --tokenizer-type NullTokenizer")


def _saved(*flags: str, world_size: int = 1, **values) -> dict:
    """The saved arguments of a run of these flags (384 padded rows), with ``values`` put in."""
    rc = parse_run_config(_FLAGS.split() + list(flags), world_size=world_size)
    return {**rc.to_saved_args(), "padded_vocab_size": 384, **values}


def test_relayout_keeps_the_padded_vocabulary_and_refuses_a_tp_it_cannot_take():
    rc = RunConfig.from_saved_args(_saved()).relayout(tp=2, pp=2, world_size=8)
    assert rc.model.padded_vocab_size == 384 and rc.layout.tp == 2 and rc.layout.dp == 2
    assert rc.schedule.num_microbatches == 2  # 8 samples over DP 2 in micro-batches of 2 (before: 4, DP left out)
    assert 384 % (rc.model.make_vocab_size_divisible_by * 2) == 0  # a run at TP=2 pads to the same rows
    assert rc.to_saved_args()["data_parallel_size"] == 2
    with pytest.raises(ConfigError, match="not divisible by TP 5"):
        RunConfig.from_saved_args(_saved()).relayout(tp=5, pp=1)
    with pytest.raises(ConfigError, match="does not divide the world size 6"):
        RunConfig.from_saved_args(_saved()).relayout(tp=2, pp=2, world_size=6)


def test_relayout_regathers_the_experts_of_an_moe_model():
    saved = _saved("--num-experts", "4", "--disable-bias-linear", "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                   "--expert-tensor-parallel-size", "1", "--sequence-parallel", world_size=4)
    rc = RunConfig.from_saved_args(saved)
    assert (rc.layout.ep, rc.layout.etp) == (2, 1)
    one = rc.relayout(tp=1, pp=1)
    assert (one.layout.ep, one.layout.etp) == (1, None) and not one.model.sequence_parallel


def test_relayout_refuses_a_layout_in_the_layouts_own_words():
    """The target layout's sizes are checked by ParallelLayout's rules, not restated: the same one line as
    the flags get, and virtual stages at PP 1 (which megatron-core refuses) are refused here too."""
    from megatron_lev.distributed import ParallelLayout

    rc = RunConfig.from_saved_args(_saved())
    for sizes in (dict(tp=2, pp=2, world_size=6), dict(tp=1, pp=1, vpp=2), dict(tp=0, pp=1)):
        with pytest.raises(ConfigError) as got:
            rc.relayout(**sizes)
        with pytest.raises(ConfigError) as want:
            ParallelLayout(world_size=sizes.pop("world_size", 1), **sizes)
        assert str(got.value) == str(want.value)
    a = rc.relayout(tp=1, pp=2, vpp=1, world_size=4)
    assert (a.layout.vpp, a.layout.dp) == (None, 2)


def test_saved_counts_are_whole_numbers_and_in_range_or_refused_in_one_line():
    rc = RunConfig.from_saved_args(_saved(seq_length="32", padded_vocab_size=384.0, mtp_num_layers=None))
    assert (rc.data.seq_length, rc.model.padded_vocab_size, rc.model.mtp_num_layers) == (32, 384, None)
    for bad in ("abc", 32.5, True):  # before: a bare "invalid literal for int()", or 32 and 1 taken silently
        with pytest.raises(ConfigError, match=r"^config.yaml: seq_length is .*, not a whole number: ") as e:
            RunConfig.from_saved_args(_saved(seq_length=bad))
        assert "\n" not in str(e.value)
    # Ranges, as the flags check them (before: a hand-edited file was taken as written).
    for key, bad in (("num_layers", 0), ("hidden_dropout", 1.5), ("lev_heads", 0), ("lr_warmup_iters", -1)):
        with pytest.raises(ConfigError, match=rf"^config.yaml: .*{key.replace('lev_', '--lev-').replace('_', '.')}") as e:
            RunConfig.from_saved_args(_saved(**{key: bad}))
        assert "\n" not in str(e.value)
