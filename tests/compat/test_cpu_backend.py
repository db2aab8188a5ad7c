"""megatron-core 0.16.1 on CPU/gloo through megatron_lev.compat.

Covers the CPU notes' list at its narrowest: TP groups and layers, the RNG tracker, GPTModel with the
local spec, megatron DDP + optimizer with clipping, dist_checkpointing across TP layouts. Pipeline
schedules, the distributed optimizer and sequence parallelism run on this backend in tests/models and
tests/training. Each launch does several checks to keep process start-up off the clock.
"""

from __future__ import annotations

import torch

from megatron_lev.testing import DistributedFailure, run_distributed

VOCAB, SEQ, BATCH = 256, 16, 2


def _build_gpt(pp_size: int = 1):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=pp_size, pipeline_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, batch_p2p_sync=False,
    )
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB, max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
    )
    return model, config


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    return tokens, labels, position_ids


def _save_tp2(ckpt_dir: str):
    """TP=2: forward, RNG tracker fork, dist_checkpointing save; return logits and patch hits."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megatron_lev import compat

    model, _ = _build_gpt()
    tokens, labels, pos = _batch()
    with torch.no_grad():
        logits = model(tokens, pos, attention_mask=None)
        logits = gather_from_tensor_model_parallel_region(logits)
    with get_cuda_rng_tracker().fork():
        a = torch.rand(3)
    with get_cuda_rng_tracker().fork():
        b = torch.rand(3)
    assert not torch.equal(a, b), "the tracker's RNG state must advance inside fork()"
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)

    # One optimizer step with clipping through megatron DDP + its optimizer (CUDA type checks).
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = model.config
    ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(), module=model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0, bf16=False, params_dtype=torch.float32), [ddp]
    )
    ddp(tokens, pos, attention_mask=None, labels=labels).float().mean().backward()
    ddp.finish_grad_sync()
    ok, grad_norm, _ = optimizer.step()
    assert ok and grad_norm > 0
    return {
        "logits": logits,
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "hits": compat.hit_counts(),
    }


def _load_tp1(ckpt_dir: str):
    from megatron.core import dist_checkpointing

    model, _ = _build_gpt()
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
    model.load_state_dict(state)
    tokens, labels, pos = _batch()
    with torch.no_grad():
        return model(tokens, pos, attention_mask=None)


def test_tp2_save_tp1_load_same_logits(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    ckpt = str(ckpt)
    res = run_distributed(_save_tp2, world_size=2, tp=2, args=(ckpt,))
    assert [r["tp_rank"] for r in res] == [0, 1]
    torch.testing.assert_close(res[0]["logits"], res[1]["logits"])
    # The backend really carried these paths (a megatron-core upgrade may drop some).
    hits = res[0]["hits"]
    assert hits.get("megatron.rng.get", 0) > 0 and hits.get("megatron.rng.set", 0) > 0
    assert hits.get("torch.cuda.current_device", 0) > 0
    assert hits.get("Tensor.type", 0) > 0  # the optimizer's CUDA type checks went through
    (logits_tp1,) = run_distributed(_load_tp1, world_size=1, args=(ckpt,))
    torch.testing.assert_close(logits_tp1, res[0]["logits"], atol=2e-6, rtol=1e-5)


def _fail_on_rank_one():
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_rank() == 1:
        raise RuntimeError("deliberate failure on rank 1")
    return "ok"


def test_harness_reports_the_failing_rank():
    try:
        run_distributed(_fail_on_rank_one, world_size=2, tp=2)
    except DistributedFailure as e:
        msg = str(e)
        assert "rank 1" in msg and "deliberate failure on rank 1" in msg
        assert "rank 0 ---" not in msg
    else:
        raise AssertionError("a failing rank must raise DistributedFailure")
