"""The tensor-parallel LEV layer as megatron-core's config places it (one TP=2 launch, gloo):

- ``params_dtype`` bf16/fp16 without ``Float16Module``: parameter dtypes, output dtype, a backward, the
  fp32 initialisation rounded once, agreement with the fp32 layer within the format's tolerance;
- ``use_cpu_initialization`` on and off build the same initial function;
- ``init_seed`` (``--seed``) changes every randomly drawn LEV parameter and the factored_mlp codebooks;
- a whole bf16 LEV GPT (local spec, TP=2) without ``Float16Module`` trains: loss falls, everything bf16.
"""

from __future__ import annotations

import torch

from megatron_lev.testing import run_distributed

V, D = 600, 32
LEV_KW = dict(num_digits=2, seed_dim=8, num_knots=5, rank=4, num_heads=4, chunk_size=128, product_chunk=4)
RANDOM_PARAMS = ("seed.codebooks", "heads.proj_weight", "heads.delta", "heads.out_weight")


def _build(dtype=torch.float32, seed=3, cpu_init=True, mode="unique"):
    from megatron.core.transformer import TransformerConfig

    from megatron_lev.lev import LEVConfig
    from megatron_lev.parallel.lev_embedding import LEVParallelEmbedding

    config = TransformerConfig(num_layers=1, hidden_size=D, num_attention_heads=4, tensor_model_parallel_size=2,
                               use_cpu_initialization=cpu_init, params_dtype=dtype, init_method_std=0.02)
    return LEVParallelEmbedding(config=config, lev_config=LEVConfig(compute_mode=mode, **LEV_KW), vocab_size=V,
                                init_seed=seed)


def _params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _bf16_gpt_trains():
    from megatron.core import parallel_state

    from megatron_lev.lev import LEVConfig
    from megatron_lev.models import LevModelConfig, build_gpt_model, build_transformer_config

    mc = LevModelConfig(vocab_size=V, max_sequence_length=16, input_embedding="lev", init_seed=7,
                        lev=LEVConfig(compute_mode="table", **LEV_KW), position_embedding_type="rope",
                        normalization="RMSNorm", activation="swiglu", add_bias_linear=False)
    config = build_transformer_config(mc, num_layers=2, hidden_size=D, num_attention_heads=4, hidden_dropout=0.0,
                                      attention_dropout=0.0, bf16=True, tensor_model_parallel_size=2)
    model = build_gpt_model(config=config, model_config=mc)
    dtypes = {p.dtype for p in model.parameters()}
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (2, 16), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    pos = torch.arange(16).unsqueeze(0).expand(2, 16)
    emb_dtype = model.embedding(tokens, pos).dtype
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = model(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
        model.embedding.arm.finish_table_step()
        for p in model.parameters():  # TP-replicated parameters see the same gradient on both ranks
            assert p.grad is not None and p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad.float()).all()
        opt.step()
        losses.append(float(loss))
    return {"dtypes": dtypes, "emb_dtype": emb_dtype, "losses": losses,
            "tp_rank": parallel_state.get_tensor_model_parallel_rank()}


def _checks():
    from megatron_lev.lev import LEVConfig
    from megatron_lev.models import LevModelConfig, build_transformer_config
    from megatron_lev.parallel.arms import FactoredMLPEmbedding

    out = {}
    ids = torch.randint(0, V, (3, 8), generator=torch.Generator().manual_seed(1))
    ref = _build()
    ref_params, ref_out = _params(ref), ref(ids).detach()
    scale = ref_out.abs().max()
    for dtype in (torch.bfloat16, torch.float16):
        low = _build(dtype)
        for name, p in low.named_parameters():
            assert p.dtype == dtype, name
            assert torch.equal(p.detach(), ref_params[name].to(dtype)), name
        y = low(ids)
        assert y.dtype == dtype and y.shape == (8, 3, D)
        # Against fp32 with the same (rounded) parameters: rounded once, half an ulp of the format.
        same = _build()
        with torch.no_grad():
            for p, q in zip(same.parameters(), low.parameters()):
                p.copy_(q.float())
        exact = same(ids).detach()
        assert ((y.float() - exact).abs() <= torch.finfo(dtype).eps / 2 * exact.abs() + 1e-6 * scale).all(), dtype
        y.float().square().sum().backward()
        assert all(p.grad is not None and p.grad.dtype == dtype for p in low.parameters())
    # The same initial function with and without CPU initialisation.
    other = _build(cpu_init=False)
    assert all(torch.equal(p.detach(), ref_params[n]) for n, p in other.named_parameters())
    # --seed reaches every randomly drawn parameter.
    reseeded = _params(_build(seed=4))
    out["changed"] = {n: not torch.equal(reseeded[n], ref_params[n]) for n in RANDOM_PARAMS}
    out["same_norms"] = torch.equal(reseeded["heads.norm_weight"], ref_params["heads.norm_weight"])
    codebooks = []
    for seed in (3, 4):
        mc = LevModelConfig(vocab_size=V, max_sequence_length=8, input_embedding="factored_mlp", init_seed=seed,
                            lev=LEVConfig(**LEV_KW))
        config = build_transformer_config(mc, num_layers=1, hidden_size=D, num_attention_heads=4,
                                          tensor_model_parallel_size=2)
        arm = FactoredMLPEmbedding(config=config, vocab_size=V, lev_config=mc.lev, mlp_hidden=16, init_seed=seed)
        codebooks.append(arm.seed.codebooks.detach().clone())
    out["factored_changed"] = not torch.equal(*codebooks)
    out["gpt"] = _bf16_gpt_trains()
    return out


def test_lev_layer_follows_the_config_device_dtype_and_seed():
    results = run_distributed(_checks, world_size=2, tp=2)
    for r in results:
        assert all(r["changed"].values()), r["changed"]
        assert r["same_norms"] and r["factored_changed"]
        gpt = r["gpt"]
        assert gpt["dtypes"] == {torch.bfloat16} and gpt["emb_dtype"] == torch.bfloat16
        assert gpt["losses"][-1] < gpt["losses"][0], gpt["losses"]
    assert results[0]["gpt"]["losses"] == results[1]["gpt"]["losses"]
