"""Model FLOPs of LEV: the spec's per-id count (3 active knots), the same whatever basis computes it."""

from __future__ import annotations

from argparse import Namespace

from megatron_lev.training.flops import flops_per_iteration, lev_forward_flops_per_id


def _args(**kw):
    base = dict(lev_heads=8, lev_seed_dim=128, lev_rank=64, hidden_size=2048, lev_knots=16, lev_basis="auto",
                input_embedding="lev", lev_compute_mode="unique", global_batch_size=2, seq_length=4,
                num_layers=1, num_attention_heads=16, kv_channels=None, num_query_groups=None,
                ffn_hidden_size=4096, swiglu=True, padded_vocab_size=1000, albert_dim=None, flat_mlp_dim=None,
                mlp_hidden=None)
    base.update(kw)
    return Namespace(**base)


def test_lev_flops_per_id_is_the_specs_count_for_every_basis():
    # spec "Cost": h d_s 3 r + h d_s r + h r D + h d_s^2 = 1,441,792 multiply-adds at the defaults, D = 2048
    expected = 2.0 * (8 * 128 * 3 * 64 + 8 * 128 * 64 + 8 * 64 * 2048 + 8 * 128 * 128)
    for basis in ("auto", "dense", "sparse", "fused", "triton"):
        assert lev_forward_flops_per_id(_args(lev_basis=basis)) == expected


def test_table_mode_counts_the_vocabulary_once_per_iteration():
    unique, table = flops_per_iteration(_args()), flops_per_iteration(_args(lev_compute_mode="table"))
    per_id = lev_forward_flops_per_id(_args())
    assert table - unique == 3.0 * per_id * (1000 - 2 * 4)
