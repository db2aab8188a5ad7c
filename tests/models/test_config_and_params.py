"""Configuration checks, parameter matching and the parameter report (no process groups needed),
plus the GPU-only FP8 check."""

from __future__ import annotations

import pytest
import torch

from megatron_lev.lev.config import LEVConfig, lev_param_count
from megatron_lev.models import (
    ConfigError,
    LevModelConfig,
    build_transformer_config,
    format_parameter_breakdown,
    matched_widths,
    parameter_breakdown,
)
from megatron_lev.models.config import check_fp8, te_available
from megatron_lev.models.params import albert_params, factored_mlp_params, flat_mlp_params


# A Llama-style transformer (LevModelConfig's defaults are Megatron-LM's GPT: learned positions, LayerNorm,
# GeLU, biases).
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", activation="swiglu", add_bias_linear=False)


def _mc(**kw):
    base = dict(vocab_size=512, max_sequence_length=16, input_embedding="lev",
                lev=LEVConfig(seed_dim=8, rank=4, num_knots=5, num_heads=4), **LLAMA)
    base.update(kw)
    return LevModelConfig(**base)


def _tc(mc=None, **kw):
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4)
    base.update(kw)
    return build_transformer_config(mc or _mc(), **base)


# ------------------------------------------------------------------------ parameter matching


@pytest.mark.parametrize("vocab", [8000, 50257, 200000])
def test_matching_within_two_percent(vocab):
    lev = LEVConfig()  # the spec's defaults
    D = 2048
    w = matched_widths(vocab, D, lev)
    P = lev_param_count(vocab, D, lev)
    assert w["lev_params"] == P
    counts = {
        "albert": albert_params(vocab, D, w["albert_dim"]),
        "flat_mlp": flat_mlp_params(vocab, D, w["flat_mlp_dim"], w["flat_mlp_hidden"]),
        "factored_mlp": factored_mlp_params(vocab, D, lev, w["factored_mlp_hidden"]),
    }
    for arm, n in counts.items():
        assert abs(n - P) / P <= 0.02, (arm, n, P)
        assert w[f"{arm}_params"] == n
    # and the model's own report agrees for every arm
    for arm in counts:
        mc = LevModelConfig(vocab_size=vocab, max_sequence_length=2048, input_embedding=arm, lev=lev)
        bd = parameter_breakdown(mc, _tc_like(D))
        assert abs(bd["input_side"] - P) / P <= 0.02


def _tc_like(D):
    class C:  # enough of a TransformerConfig for the analytic count
        hidden_size = D
        num_layers = 2
        num_attention_heads = 16
        num_query_groups = 16
        kv_channels = D // 16
        ffn_hidden_size = 4 * D
        gated_linear_unit = True
        add_bias_linear = False
        normalization = "RMSNorm"
        qk_layernorm = False

    return C()


@pytest.mark.parametrize("vocab", [8000, 50257, 200000])
@pytest.mark.parametrize("hidden", [512, 1024])
def test_flat_and_factored_match_at_smaller_widths(vocab, hidden):
    w = matched_widths(vocab, hidden, LEVConfig(), arms=("flat_mlp", "factored_mlp"))
    assert abs(w["flat_mlp_rel_error"]) <= 0.02 and abs(w["factored_mlp_rel_error"]) <= 0.02


def test_unmatchable_albert_is_a_clear_error():
    # V = 200k, D = 512: albert's width moves the count in steps of V + D (~14% of the budget).
    with pytest.raises(ConfigError, match="--albert-dim") as e:
        matched_widths(200000, 512, LEVConfig(), arms=("albert",))
    assert "\n" not in str(e.value)
    # an explicit width is accepted
    mc = LevModelConfig(vocab_size=200000, max_sequence_length=16, input_embedding="albert", albert_dim=7)
    assert mc.resolved_widths(512) == {"albert_dim": 7}


def test_vocabulary_larger_than_budget_is_a_clear_error():
    with pytest.raises(ConfigError, match="impossible"):
        matched_widths(5_000_000, 64, LEVConfig(seed_dim=8, rank=4, num_knots=5, num_heads=4), arms=("albert",))


def test_breakdown_report_is_printable():
    mc = _mc(input_embedding="factored_mlp")
    bd = parameter_breakdown(mc, _tc(mc))
    text = format_parameter_breakdown(bd)
    assert "input side" in text and "transformer" in text and "output head" in text and "total" in text
    assert bd["total"] == bd["input_side"] + bd["position_embeddings"] + bd["transformer"] + bd["output_head"]
    tied = parameter_breakdown(_mc(input_embedding="tied"), _tc(_mc(input_embedding="tied")))
    assert tied["output_head"] == 0 and tied["input_side"] == 512 * 32
    assert "shared" in format_parameter_breakdown(tied)


# ------------------------------------------------------------------------ one-line config errors


def _one_line_error(fn, *flags):
    with pytest.raises(ConfigError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for flag in flags:
        assert flag in msg, (flag, msg)
    return msg


def test_attention_heads_not_divisible_by_tp():
    _one_line_error(lambda: _tc(num_attention_heads=3, tensor_model_parallel_size=2), "--num-attention-heads")


def test_lev_heads_not_divisible_by_tp():
    mc = _mc(lev=LEVConfig(seed_dim=8, rank=4, num_knots=5, num_heads=3))
    cfg = _tc(mc, tensor_model_parallel_size=2)
    _one_line_error(lambda: mc.validate(cfg), "--lev-heads")


def test_layers_not_divisible_by_pipeline_stages():
    _one_line_error(lambda: _tc(num_layers=3, pipeline_model_parallel_size=2), "--num-layers")
    _one_line_error(
        lambda: _tc(num_layers=6, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        "--num-layers", "virtual",
    )


def test_sequence_parallel_without_tp():
    _one_line_error(lambda: _tc(sequence_parallel=True), "--sequence-parallel")


def test_fp8_refused_on_cpu():
    if te_available() and torch.cuda.is_available():
        pytest.skip("Transformer Engine and CUDA are present: FP8 is allowed here")
    msg = _one_line_error(lambda: _tc(fp8="hybrid"), "--fp8-format")
    assert "Transformer Engine" in msg
    _one_line_error(lambda: check_fp8("hybrid"), "--fp8-format")
    _one_line_error(lambda: check_fp8("hybrid", "local"), "--fp8-format", "--transformer-impl")


def test_vocab_too_small_for_lev_base():
    mc = _mc(vocab_size=64, lev=LEVConfig(seed_dim=8, rank=4, num_knots=5, num_heads=4, base=10))
    _one_line_error(lambda: mc.validate(_tc(mc)), "--vocab-size", "--lev-base")
    mc = _mc(vocab_size=4096, lev=LEVConfig(seed_dim=8, rank=4, num_knots=5, num_heads=4, base=10))
    _one_line_error(lambda: mc.validate(_tc(mc)), "--lev-base")  # 10^3 < 4096


def test_vocab_not_divisible_by_tp():
    mc = _mc(vocab_size=511)
    # megatron pads the vocabulary; an unpadded size cannot be split over TP ranks
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=2,
                            normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False)
    _one_line_error(lambda: mc.validate(cfg), "--vocab-size")


def test_bad_choices_and_mismatched_configs():
    _one_line_error(lambda: _mc(input_embedding="dense").validate(_tc()), "--input-embedding")
    _one_line_error(lambda: _mc(position_embedding_type="alibi").validate(_tc()), "--position-embedding-type")
    mc = _mc(normalization="LayerNorm")
    _one_line_error(lambda: mc.validate(_tc(_mc())), "--normalization")


def test_transformer_config_defaults_follow_model_config():
    cfg = _tc(_mc(normalization="LayerNorm", activation="gelu"))
    assert cfg.normalization == "LayerNorm" and not cfg.gated_linear_unit and not cfg.add_bias_linear
    cfg = _tc(_mc())
    assert cfg.normalization == "RMSNorm" and cfg.gated_linear_unit
    assert cfg.activation_func is torch.nn.functional.silu
    if not torch.cuda.is_available():
        assert cfg.use_cpu_initialization and not cfg.batch_p2p_sync
    cfg = _tc(pipeline_model_parallel_size=2)
    assert cfg.pipeline_dtype == torch.float32


def test_local_spec_on_cpu_uses_sdpa_and_sp_norms():
    from megatron_lev.models import get_block_spec, get_layer_spec
    from megatron_lev.models.attention import SDPAttention
    from megatron_lev.parallel.norms import SequenceParallelNorm

    if te_available() and torch.cuda.is_available():
        pytest.skip("Transformer Engine present: the TE spec is selected")
    mc = _mc()
    cfg = _tc(mc)
    spec = get_layer_spec(cfg, mc)
    assert spec.submodules.self_attention.submodules.core_attention is SDPAttention
    assert spec.submodules.input_layernorm is SequenceParallelNorm
    assert spec.submodules.pre_mlp_layernorm is SequenceParallelNorm
    block = get_block_spec(cfg, mc, pp_rank=0)
    assert block.layer_norm is SequenceParallelNorm and len(block.layer_specs) == 4
    with pytest.raises(ConfigError, match="--transformer-impl"):
        get_layer_spec(cfg, _mc(transformer_impl="transformer_engine"))


def test_sequence_parallel_norm_marks_weights_and_matches_torch():
    from megatron_lev.parallel.norms import SequenceParallelNorm

    class Cfg:
        sequence_parallel = True
        params_dtype = torch.float32
        use_cpu_initialization = True
        layernorm_zero_centered_gamma = False

    x = torch.randn(5, 3, 16)
    for norm, ref in (("RMSNorm", torch.nn.RMSNorm(16, eps=1e-5)), ("LayerNorm", torch.nn.LayerNorm(16, eps=1e-5))):
        m = SequenceParallelNorm(Cfg(), 16, eps=1e-5, normalization=norm)
        assert all(p.sequence_parallel for p in m.parameters())
        with torch.no_grad():
            m.weight.uniform_(0.5, 1.5)
            ref.weight.copy_(m.weight)
        torch.testing.assert_close(m(x), ref(x))
        assert set(dict(m.named_parameters())) == set(dict(ref.named_parameters()))


def test_sdpa_attention_matches_reference():
    """SDPAttention on [s, b, n, d] equals an explicit causal softmax attention."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_lev.models.attention import SDPAttention

    class TP:
        @staticmethod
        def size():
            return 1

    class PG:
        tp = TP()

    cfg = _tc(num_query_groups=2, attention_dropout=0.0)
    attn = SDPAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, pg_collection=PG())
    s, b, n, d = 6, 2, 4, 8
    q, k, v = torch.randn(s, b, n, d), torch.randn(s, b, 2, d), torch.randn(s, b, 2, d)
    out = attn(q, k, v, None)
    k2, v2 = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k2) / d**0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v2).reshape(s, b, n * d)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # an explicit megatron-style mask (True = masked) gives the same
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
    torch.testing.assert_close(attn(q, k, v, mask), ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------ GPU / FP8


def _gpu_fp8_step(arm: str):
    from megatron_lev.models import build_gpt_model

    mc = LevModelConfig(vocab_size=1024, max_sequence_length=32, input_embedding=arm,
                        lev=LEVConfig(seed_dim=8, rank=4, num_knots=5, num_heads=4), **LLAMA)
    cfg = build_transformer_config(mc, num_layers=2, hidden_size=64, num_attention_heads=4, fp8="hybrid",
                                   bf16=True, params_dtype=torch.bfloat16)
    model = build_gpt_model(config=cfg, model_config=mc).cuda()
    ids = torch.randint(0, 1024, (2, 32), device="cuda")
    pos = torch.arange(32, device="cuda").unsqueeze(0).expand(2, 32)
    loss = model(ids, pos, None, labels=ids).float().mean()
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None or getattr(p, "main_grad", None) is not None
               for p in model.parameters() if p.requires_grad)


@pytest.mark.gpu
@pytest.mark.te
@pytest.mark.parametrize("arm", ["lev", "tied"])
def test_fp8_forward_backward_on_gpu(arm):
    if not te_available():
        pytest.fail("GPU test needs Transformer Engine (pip install megatron-lev[gpu])")
    from megatron_lev.testing import run_distributed

    run_distributed(_gpu_fp8_step, 1, args=(arm,))
