"""bench/throughput.py times the model pretrain_lev.py trains: at every bench shape, the same parameters
and the same FLOPs per token as pretrain_lev.py's model built from the flags its users write."""

from __future__ import annotations

import pytest

from tests.bench import load_bench

ARMS = ({"arm": "tied"}, {"arm": "untied"}, {"arm": "lev", "mode": "unique", "basis": "dense"})


@pytest.fixture(scope="module")
def tp():
    return load_bench("throughput")


@pytest.fixture(scope="module")
def one_rank():
    from megatron_lev.distributed import destroy_distributed, init_distributed

    setup = init_distributed(tp=1, pp=1, backend="gloo", timeout_minutes=1, seed=1)
    yield
    destroy_distributed(setup)


def _pretrain_argv(shape, arm) -> list:
    """pretrain_lev.py's flags for the shape, as examples/ and the GPU check's profile stage write them."""
    s = {k: str(v) for k, v in shape.items()}
    argv = ["--num-layers", s["layers"], "--hidden-size", s["hidden"], "--num-attention-heads", s["heads"],
            "--seq-length", s["seq"], "--max-position-embeddings", s["seq"], "--micro-batch-size", s["micro_batch"],
            "--global-batch-size", s["micro_batch"], "--mock-data", "--vocab-size", "50257", "--train-iters", "10",
            "--lr", "3e-4", "--bf16", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
            "--disable-bias-linear", "--input-embedding", arm["arm"]]
    if arm["arm"] == "lev":
        argv += ["--lev-compute-mode", arm["mode"], "--lev-basis", arm["basis"]]
    return argv


def _per_token_flops(config, model_config, shape) -> float:
    from megatron_lev.training.flops import flops_per_iteration

    tokens = shape["micro_batch"] * shape["seq"]
    return flops_per_iteration(config, model_config, global_batch_size=shape["micro_batch"], seq_length=shape["seq"],
                               data_parallel_size=1) / tokens


@pytest.mark.parametrize("name", ["quick", "cpu", "gpu-400m"])
def test_the_bench_model_has_pretrain_lev_parameters_and_flops_per_token(tp, name):
    from megatron_lev.models import parameter_breakdown
    from megatron_lev.training import model_configs

    shape = tp.CONFIGS[name]
    for arm in ARMS:
        config, model_config = model_configs(_pretrain_argv(shape, arm))
        bench_config, bench_model_config = tp.bench_configs(arm, shape, "float32")
        assert bench_config.ffn_hidden_size == config.ffn_hidden_size == int(shape["hidden"] * 8 / 3) // 64 * 64
        assert parameter_breakdown(bench_model_config, bench_config) == parameter_breakdown(model_config, config)
        assert _per_token_flops(bench_config, bench_model_config, shape) == _per_token_flops(config, model_config, shape)


def test_the_bench_builds_the_parameters_pretrain_lev_builds(tp, one_rank):
    import torch

    from megatron_lev.models.factory import build_model_chunks
    from megatron_lev.training import model_configs

    shape = tp.CONFIGS["quick"]
    for arm in ARMS[:2]:  # LEV's initialisation takes a minute here; its parameters are counted above
        config, model_config = model_configs(_pretrain_argv(shape, arm))
        (trained,) = build_model_chunks(config, model_config)
        benched, _config, _breakdown, flops = tp._build(arm, shape, "cpu", "float32", None)
        assert flops == _per_token_flops(config, model_config, shape)
        shapes = sorted((n, tuple(p.shape)) for n, p in trained.named_parameters())
        assert sorted((n, tuple(p.shape)) for n, p in benched.named_parameters()) == shapes
        assert {p.dtype for p in benched.parameters()} == {torch.float32}


def test_the_bench_refuses_a_shape_pretrain_lev_refuses(tp):
    from megatron_lev.lev.config import ConfigError

    with pytest.raises(ConfigError, match="--hidden-size 100 is not divisible by --num-attention-heads 3"):
        tp.bench_configs({"arm": "tied"}, dict(tp.CONFIGS["quick"], hidden=100, heads=3), "float32")
