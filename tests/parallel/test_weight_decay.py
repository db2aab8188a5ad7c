"""The optimizer's weight-decay groups for a LEV model, through megatron-core's get_megatron_optimizer."""

from __future__ import annotations

import torch

from megatron_lev.testing import run_distributed


def _groups():
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_lev.lev import LEVConfig
    from megatron_lev.models import LevModelConfig, build_gpt_model, build_transformer_config
    from megatron_lev.parallel.weight_decay import weight_decay_overrides

    mc = LevModelConfig(vocab_size=512, max_sequence_length=16, input_embedding="lev",
                        lev=LEVConfig(seed_dim=8, rank=4, num_knots=5, num_heads=2))
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = build_transformer_config(mc, num_layers=1, hidden_size=32, num_attention_heads=4)
    model = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(),
                                    module=build_gpt_model(config=config, model_config=mc))
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, bf16=False,
                                 params_dtype=torch.float32)
    optimizer = get_megatron_optimizer(opt_config, [model], config_overrides=weight_decay_overrides(opt_config))
    names = {id(p): n.removeprefix("module.") for n, p in model.named_parameters()}
    decayed, not_decayed = set(), set()
    for group in optimizer.optimizer.param_groups:
        target = not_decayed if group["wd_mult"] == 0.0 else decayed
        target.update(names[id(p)] for p in group["params"])
    return decayed, not_decayed


def test_lev_weight_decay_groups():
    (result,) = run_distributed(_groups, world_size=1)
    decayed, not_decayed = result

    def leaf(names):
        return {n.split(".")[-1] for n in names if ".heads." in n or n.endswith("seed.codebooks") or n.endswith("offset")}

    assert leaf(decayed) == {"delta", "proj_weight", "out_weight", "codebooks"}, sorted(decayed)
    assert leaf(not_decayed) == {"norm_weight", "norm_bias", "proj_bias", "offset"}, sorted(not_decayed)
    # Transformer norms and biases stay out of decay, matrices in (Megatron's own rule).
    assert any("layernorm" in n or "norm" in n.split(".")[-2] for n in not_decayed)
    assert any(n.endswith("linear_fc1.weight") for n in decayed)
    assert all(n.startswith(("embedding", "decoder", "output_layer")) for n in decayed | not_decayed)
