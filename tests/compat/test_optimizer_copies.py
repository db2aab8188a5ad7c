"""compat.optimizer's parameter copy after the distributed optimizer's update: one foreach copy a destination
dtype, the same values as megatron's shard-by-shard copy, and megatron's own copy kept where it quantizes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from megatron.core.optimizer import distrib_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

from megatron_lev.compat import optimizer as compat_optimizer


def _distributed_optimizer(ddp=None, config=None):
    """A DistributedOptimizer's copy-relevant state without a process group: bf16 parameters in one buffer
    (two buckets), fp32 parameters in another, each with its fp32 main shard."""
    g = torch.Generator().manual_seed(0)
    buffers, gbuf_map, ranges = [], {}, {}
    groups = {torch.bfloat16: ([], []), torch.float32: ([], [])}
    for gbuf_index, (dtype, buckets) in enumerate([(torch.bfloat16, [(7, 300), (1,)]), (torch.float32, [(5, 33)])]):
        bucket_objs = []
        for bucket_id, sizes in enumerate(buckets):
            bucket_objs.append(SimpleNamespace(param_data=torch.zeros(sum(sizes) + 3, dtype=dtype)))
            start = 3  # the shards need not start at the bucket's beginning
            for n in sizes:
                model_param = torch.zeros(n, dtype=dtype)
                gbuf_map[model_param] = (gbuf_index, dtype, bucket_id)
                ranges[model_param] = {"gbuf_world_in_bucket": Range(start, start + n)}
                groups[dtype][0].append(model_param)
                groups[dtype][1].append(torch.randn(n, generator=g, dtype=torch.float32) * 3)
                start += n
        buffers.append(SimpleNamespace(buckets=bucket_objs))
    opt = DistributedOptimizer.__new__(DistributedOptimizer)
    opt.__dict__.update(
        buffers=buffers, model_param_gbuf_map=gbuf_map, is_stub_optimizer=False,
        _get_model_param_range_map=ranges.__getitem__, _is_distopt_quantized_param=lambda t: False,
        _get_fp8_params_and_shard_fp32_from_fp8=lambda: ([], [], []), data_parallel_group=None,
        model_float16_groups=[groups[torch.bfloat16][0]], shard_fp32_from_float16_groups=[groups[torch.bfloat16][1]],
        model_fp32_groups=[groups[torch.float32][0]], shard_fp32_groups=[groups[torch.float32][1]],
        ddp_config=ddp or SimpleNamespace(use_megatron_fsdp=False, fp8_param_gather=False, fp4_param_gather=False),
        config=config or SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False))
    return opt


def test_the_copy_equals_megatrons_in_one_foreach_copy_a_destination_dtype(monkeypatch):
    """torch's CUDA foreach copy dispatches on the first destination's dtype, so bf16 and fp32 destinations go
    in a copy each. On the CPU one mixed copy would give the same values too: the group count shows the split."""
    monkeypatch.setattr(distrib_optimizer, "quantize_param_shard", lambda *a, **k: None)  # no FP8 parameters
    want, got = _distributed_optimizer(), _distributed_optimizer()
    DistributedOptimizer._copy_main_params_to_model_params(want)

    grouped, by_dtype = [], compat_optimizer._pairs_by_dst_dtype

    def spy(dst, src):
        grouped.append(groups := by_dtype(dst, src))
        return groups

    monkeypatch.setattr(compat_optimizer, "_pairs_by_dst_dtype", spy)
    compat_optimizer._copy_main_params_in_one_launch(got)
    assert [[d.dtype for d in dsts] for dsts, _ in grouped[0]] == [[torch.bfloat16] * 3, [torch.float32] * 2]
    for a, b in zip(want.buffers, got.buffers):
        for bucket_a, bucket_b in zip(a.buckets, b.buckets):
            assert bucket_a.param_data.dtype == bucket_b.param_data.dtype
            assert torch.equal(bucket_a.param_data, bucket_b.param_data)
    assert want.buffers[0].buckets[0].param_data.abs().sum() > 0  # the copies wrote something


@pytest.mark.parametrize("ddp_flag, config_flag", [
    ("fp8_param_gather", None), ("fp4_param_gather", None), ("reuse_grad_buf_for_mxfp8_param_ag", None),
    (None, "reuse_grad_buf_for_mxfp8_param_ag"), (None, None)])
def test_megatrons_copy_is_kept_where_it_quantizes(ddp_flag, config_flag):
    ddp = SimpleNamespace(use_megatron_fsdp=False, fp8_param_gather=False)
    config = SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
    for ns, flag in ((ddp, ddp_flag), (config, config_flag)):
        if flag:
            setattr(ns, flag, True)
    opt = _distributed_optimizer(ddp, config)
    replaced = ddp_flag is None and config_flag is None
    assert compat_optimizer.copy_main_params_in_one_launch(opt) is replaced
    assert ("_copy_main_params_to_model_params" in opt.__dict__) is replaced
