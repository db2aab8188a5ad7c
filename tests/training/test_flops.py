"""Model FLOPs of LEV: the spec's per-id count (3 active knots), the same whatever basis computes it; table
mode's ids per data-parallel rank; the peak of each device name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_lev.lev import functional
from megatron_lev.lev.config import BASIS_KINDS, LEVConfig
from megatron_lev.models import LevModelConfig
from megatron_lev.training.flops import flops_per_iteration, lev_forward_flops_per_id, peak_statement, \
    peak_tflops_per_device

# spec "Cost": h d_s 3 r + h d_s r + h r D + h d_s^2 = 1,441,792 multiply-adds at the defaults, D = 2048
SPEC_PER_ID = 2.0 * (8 * 128 * 3 * 64 + 8 * 128 * 64 + 8 * 64 * 2048 + 8 * 128 * 128)


def _configs(compute_mode="unique"):
    # The TransformerConfig fields the count reads (a full one needs megatron's parallel state checks).
    config = SimpleNamespace(hidden_size=2048, num_layers=1, num_attention_heads=16, kv_channels=128,
                             num_query_groups=16, ffn_hidden_size=4096, gated_linear_unit=True)
    model_config = LevModelConfig(vocab_size=1000, max_sequence_length=4, input_embedding="lev",
                                  lev=LEVConfig(compute_mode=compute_mode))
    return config, model_config


def test_lev_flops_per_id_is_the_specs_count_for_every_basis():
    for basis in BASIS_KINDS:
        assert lev_forward_flops_per_id(LEVConfig(basis=basis), 2048) == SPEC_PER_ID


def test_lev_flops_on_the_basis_auto_resolves_to_on_cuda(monkeypatch):
    # On CUDA without a fused kernel "auto" is the sparse basis, with Triton the triton one; the count
    # follows the model, not the kernel (no kappa-wide count for any resolution).
    for registered in (set(), {"triton"}):
        monkeypatch.setattr(functional, "has_fused_product", lambda dev, kind="fused", r=registered: kind in r)
        resolved = LEVConfig().resolved_basis("cuda")
        assert resolved == ("triton" if registered else "sparse")
        assert lev_forward_flops_per_id(LEVConfig(basis=resolved), 2048) == SPEC_PER_ID


def test_table_mode_counts_the_vocabulary_once_per_data_parallel_rank():
    config, unique_mc = _configs()
    _, table_mc = _configs("table")
    unique = flops_per_iteration(config, unique_mc, global_batch_size=2, seq_length=4, data_parallel_size=1)
    table = flops_per_iteration(config, table_mc, global_batch_size=2, seq_length=4, data_parallel_size=1)
    assert table - unique == 3.0 * SPEC_PER_ID * (1000 - 2 * 4)
    # Every data-parallel rank builds its own table: 32 ranks evaluate the 1000 ids 32 times.
    unique = flops_per_iteration(config, unique_mc, global_batch_size=64, seq_length=4, data_parallel_size=32)
    table = flops_per_iteration(config, table_mc, global_batch_size=64, seq_length=4, data_parallel_size=32)
    assert table - unique == 3.0 * SPEC_PER_ID * (32 * 1000 - 64 * 4)
    # Without the size given: megatron's data-parallel size, 1 where its parallel state is not set up.
    assert flops_per_iteration(config, table_mc, global_batch_size=2, seq_length=4) == \
        flops_per_iteration(config, table_mc, global_batch_size=2, seq_length=4, data_parallel_size=1)


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.0),  # SXM5
    ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0),
    ("NVIDIA H200 NVL", 835.0),
    ("NVIDIA GH200 480GB", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA B200", 2250.0),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_peak_of_each_device_name(name, peak):
    assert peak_tflops_per_device(device_name=name) == peak
    assert peak_tflops_per_device(123.0, device_name=name) == 123.0  # --peak-tflops-per-device wins
    assert peak_statement(123.0, device_name=name) == "MFU is of 123 TFLOP/s per device (--peak-tflops-per-device)"
    if peak is None:
        assert peak_statement(device_name=name).startswith("MFU: n/a (no peak known")
    else:
        assert peak_statement(device_name=name).startswith(f"MFU is of {peak:g} TFLOP/s per device ({name}'s dense bf16")


def test_peak_asks_the_current_device(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert peak_tflops_per_device() == 756.0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert peak_tflops_per_device() is None
