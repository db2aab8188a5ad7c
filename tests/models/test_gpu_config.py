"""The GPU-side configuration, checked on the CPU with the detection functions monkeypatched:
evaluation without FP8, megatron's fusion defaults on CUDA, the FP8 start-up checks, which layer spec a
broken Transformer Engine gives, and the LEV compute-mode rule."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from megatron_lev.lev.config import ConfigError, LEVConfig
from megatron_lev.models import LevModelConfig, build_transformer_config
from megatron_lev.models import config as mconfig

from .test_config_and_params import LLAMA
from .test_config_and_params import _one_line_error as _one_line

REPO = Path(__file__).resolve().parents[2]

FUSIONS = ("gradient_accumulation_fusion", "apply_rope_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
           "bias_activation_fusion")


def _mc(**kw):
    base = dict(vocab_size=512, max_sequence_length=16, input_embedding="lev",
                lev=LEVConfig(seed_dim=8, rank=4, num_knots=5, num_heads=4), **LLAMA)
    base.update(kw)
    return LevModelConfig(**base)


@pytest.fixture
def machine(monkeypatch):
    """Pretend this CPU machine has a GPU of compute capability ``cc`` and, optionally, Transformer Engine
    (``te``: its version) and apex's kernels. Only what megatron-core reads to decide is patched: its TE
    flag and fused RoPE function, its gradient-accumulation-fusion flag, and torch's CUDA queries."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import layers

    def set_(cuda=True, te=None, apex=False, cc=(9, 0), triton=True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
        monkeypatch.setattr(mconfig, "te_available", lambda: te is not None)
        monkeypatch.setattr(mconfig, "te_version", lambda: Version(te) if te else None)
        monkeypatch.setattr(mconfig, "triton_available", lambda: triton)
        monkeypatch.setattr(mconfig, "apex_softmax_available", lambda: apex)
        monkeypatch.setattr(layers, "_grad_accum_fusion_available", apex)
        monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", (lambda *a, **k: None) if te else None)

    return set_


def _build(mc=None, megatron_ddp=True, **kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128)
    base.update(kw)
    mc = mc or _mc()
    cfg = build_transformer_config(mc, megatron_ddp=megatron_ddp, **base)
    mc.validate(cfg)
    return cfg


# ------------------------------------------------------------------------ evaluation of an FP8 checkpoint


def _saved_fp8_args():
    """The arguments an FP8 run saves (config.yaml), as the evaluation re-lays them out."""
    from megatron_lev.arguments import parse_args

    args = parse_args(["--mock-data", "--vocab-size", "511", "--num-layers", "2", "--hidden-size", "64",
                       "--num-attention-heads", "4", "--ffn-hidden-size", "128", "--seq-length", "32",
                       "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
                       "--lev-seed-dim", "16", "--lev-rank", "8", "--lev-heads", "2", "--lev-knots", "8",
                       "--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--train-iters", "1", "--lr", "1e-3",
                       "--save", "unused"],
                      world_size=1)
    a = vars(args)
    a["padded_vocab_size"] = 512
    return a


def test_fp8_checkpoint_is_evaluated_without_fp8_where_te_and_cuda_are_present(machine):
    from megatron_lev.config import RunConfig
    from megatron_lev.models.factory import build_configs
    from megatron_lev.evaluation.megatron_scorer import eval_args

    machine(cuda=True, te="2.8.0", apex=True)
    saved = _saved_fp8_args()
    assert saved["fp8_format"] == "hybrid"
    # Training with these arguments builds FP8 (the machine passes every FP8 check) ...
    train_cfg, _ = build_configs(RunConfig.from_saved_args(saved))
    assert train_cfg.fp8 == "hybrid" and train_cfg.fp8_recipe == "tensorwise"
    # ... the evaluation of its checkpoint does not: the scorer pads each batch to its own length only.
    a = eval_args(saved, micro_batch_size=3)
    config, model_config = build_configs(a, for_loading=True)
    assert config.fp8 is None and config.bf16
    assert model_config.transformer_impl == "auto" and model_config.use_transformer_engine()
    assert mconfig.settings_for_loading(saved.get("transformer_impl"))["fp8_format"] is None


# ------------------------------------------------------------------------ fusion defaults


def test_cuda_with_te_and_apex_turns_megatron_lm_fusions_on(machine):
    machine(cuda=True, te="2.8.0", apex=True)
    cfg = _build()
    assert {f: getattr(cfg, f) for f in FUSIONS} == dict.fromkeys(FUSIONS, True)
    # Megatron-LM's own default for the fused cross entropy is off (opt-in there too).
    assert cfg.cross_entropy_loss_fusion is False


def test_cpu_keeps_every_fusion_off(machine):
    machine(cuda=False, te=None, apex=False)
    cfg = _build()
    assert {f: getattr(cfg, f) for f in FUSIONS} == dict.fromkeys(FUSIONS, False)
    assert cfg.use_cpu_initialization


def test_cuda_without_te_or_apex_keeps_the_fusions_that_need_them_off(machine):
    machine(cuda=True, te=None, apex=False)
    cfg = _build()
    # Gradient-accumulation fusion and the masked softmax are apex's; RoPE fusion is TE's kernel or, without
    # it, models.rope's, which the build installs as megatron's.
    assert not cfg.gradient_accumulation_fusion and not cfg.masked_softmax_fusion
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_lev.models import rope

    assert cfg.apply_rope_fusion and rope_utils.fused_apply_rotary_pos_emb is rope.apply_rotary_pos_emb
    # bias-dropout-add and bias-SwiGLU are megatron's own torch.compile'd functions.
    assert cfg.bias_dropout_fusion and cfg.bias_activation_fusion
    machine(cuda=True, te="2.8.0", apex=False)
    cfg = _build()
    assert cfg.apply_rope_fusion and not cfg.gradient_accumulation_fusion  # the output head is megatron's
    machine(cuda=True, te=None, apex=True)
    assert _build().gradient_accumulation_fusion and _build().apply_rope_fusion
    machine(cuda=True, te="2.8.0", apex=True, triton=False)  # torch.compile has no backend
    cfg = _build()
    assert not cfg.bias_dropout_fusion and not cfg.bias_activation_fusion and cfg.apply_rope_fusion


def test_fusion_defaults_follow_the_model(machine):
    machine(cuda=True, te="2.8.0", apex=True)
    # gelu without biases: megatron refuses the bias-gelu fusion (Megatron-LM turns it off)
    assert not _build(_mc(activation="gelu")).bias_activation_fusion
    assert _build(_mc(activation="gelu", add_bias_linear=True), add_bias_linear=True).bias_activation_fusion
    assert not _build(_mc(position_embedding_type="learned_absolute")).apply_rope_fusion
    # gradient-accumulation fusion writes into main_grad, which only megatron's DDP gives the parameters
    assert not _build(megatron_ddp=False).gradient_accumulation_fusion
    # what the caller asks for is kept
    assert not _build(bias_dropout_fusion=False).bias_dropout_fusion


def test_training_configs_get_grad_accumulation_fusion_loading_does_not(machine):
    from megatron_lev.config import RunConfig
    from megatron_lev.models.factory import build_configs

    machine(cuda=True, te="2.8.0", apex=True)
    a = dict(_saved_fp8_args(), fp8_format=None)
    rc = RunConfig.from_saved_args(a)
    assert build_configs(rc)[0].gradient_accumulation_fusion
    assert not build_configs(rc, for_loading=True)[0].gradient_accumulation_fusion


# ------------------------------------------------------------------------ FP8 start-up checks


def _fp8(recipe="delayed", fmt="hybrid", **kw):
    base = dict(bf16=True, fp8=fmt, fp8_recipe=recipe)
    base.update(kw)
    return _build(**base)


def test_fp8_settings_that_work_pass(machine):
    machine(cuda=True, te="2.8.0", cc=(9, 0))
    for recipe in ("delayed", "tensorwise", "blockwise"):
        assert _fp8(recipe).fp8_recipe == recipe
    machine(cuda=True, te="2.8.0", cc=(10, 0))
    assert _fp8("mxfp8", hidden_size=64, ffn_hidden_size=128).fp8_recipe == "mxfp8"
    mconfig.check_fp8_tokens("hybrid", "delayed", micro_batch_size=2, seq_length=4, tp=1)
    mconfig.check_fp8_tokens("hybrid", "mxfp8", micro_batch_size=1, seq_length=64, tp=2, sequence_parallel=True)


def test_fp8_format_and_machine_refusals(machine):
    machine(cuda=True, te="2.8.0")
    _one_line(lambda: _fp8(fmt="e5m2"), "--fp8-format", "e4m3 or hybrid")
    _one_line(lambda: _fp8(mc=_mc(transformer_impl="local")), "--fp8-format", "--transformer-impl")
    machine(cuda=False, te=None)
    _one_line(lambda: _fp8(), "--fp8-format", "Transformer Engine")
    machine(cuda=True, te="2.8.0", cc=(8, 0))
    _one_line(lambda: _fp8(), "--fp8-format", "8.0", "8.9")


def test_mxfp8_only_on_blackwell(machine):
    machine(cuda=True, te="2.8.0", cc=(9, 0))
    _one_line(lambda: _fp8("mxfp8"), "--fp8-recipe mxfp8", "Blackwell", "9.0")


@pytest.mark.parametrize("recipe,needs", [("tensorwise", "2.2"), ("blockwise", "2.3"), ("mxfp8", "2.1")])
def test_fp8_recipe_needs_te_version(machine, recipe, needs):
    machine(cuda=True, te="2.0.0", cc=(10, 0))
    _one_line(lambda: _fp8(recipe), f"--fp8-recipe {recipe}", f"Transformer Engine >= {needs}", "2.0.0")


def test_fp8_widths_divisible_by_16(machine):
    machine(cuda=True, te="2.8.0")
    _one_line(lambda: _fp8(hidden_size=72, num_attention_heads=4), "--hidden-size 72", "16")
    # ffn / TP: 200 / 2 = 100
    _one_line(lambda: _fp8(ffn_hidden_size=200, tensor_model_parallel_size=2), "--ffn-hidden-size 200",
              "--tensor-model-parallel-size 2", "100")
    # QKV / TP: 4 heads x 24 channels + 2 x 2 groups x 24 = 192 / 2 = 96 fine; 4 x 20 + 2 x 4 x 20 = 240 / 2 = 120
    _one_line(lambda: _fp8(num_attention_heads=4, kv_channels=20, tensor_model_parallel_size=2), "--kv-channels",
              "--tensor-model-parallel-size 2", "16")
    machine(cuda=True, te="2.8.0", cc=(10, 0))
    _one_line(lambda: _fp8("mxfp8", hidden_size=48, num_attention_heads=4, kv_channels=16), "--hidden-size 48", "32")


def test_fp8_tokens_per_micro_batch(machine):
    machine(cuda=True, te="2.8.0")
    _one_line(lambda: mconfig.check_fp8_tokens("hybrid", "delayed", micro_batch_size=3, seq_length=5, tp=1),
              "--micro-batch-size 3", "--seq-length 5", "8")
    # under sequence parallelism each TP rank's share: 1 x 16 / 4 = 4
    _one_line(lambda: mconfig.check_fp8_tokens("hybrid", "delayed", micro_batch_size=1, seq_length=16, tp=4,
                                               sequence_parallel=True), "--sequence-parallel", "4", "8")
    _one_line(lambda: mconfig.check_fp8_tokens("hybrid", "mxfp8", micro_batch_size=2, seq_length=8, tp=1),
              "--fp8-recipe mxfp8", "32")
    mconfig.check_fp8_tokens(None, "delayed", micro_batch_size=3, seq_length=5, tp=1)  # no FP8: no check


def test_fp8_token_check_runs_at_start_up(machine):
    from megatron_lev.config import RunConfig
    from megatron_lev.models.factory import build_configs

    machine(cuda=True, te="2.8.0")
    a = dict(_saved_fp8_args(), micro_batch_size=3, seq_length=5, max_position_embeddings=5)
    _one_line(lambda: build_configs(RunConfig.from_saved_args(a)), "--micro-batch-size 3", "--seq-length 5")


# ------------------------------------------------------------------------ a broken Transformer Engine


def test_broken_transformer_engine_falls_back_to_the_local_spec(tmp_path):
    """A Transformer Engine that imports only in part (here its ``pytorch.fp8`` lacks ``fp8_autocast``, as
    with a TE PyTorch package of another version than its core): find_spec finds it, megatron's HAVE_TE is
    False. te_available must agree with megatron, and "auto" must pick the local spec. (Where
    ``import transformer_engine`` itself fails, megatron-core 0.16.1 cannot be imported at all.)"""
    te = tmp_path / "transformer_engine"
    (te / "pytorch" / "tensor").mkdir(parents=True)
    (te / "__init__.py").write_text('__version__ = "2.8.0"\n')
    (te / "pytorch" / "__init__.py").write_text("")
    (te / "pytorch" / "tensor" / "__init__.py").write_text("class QuantizedTensor:\n    pass\n")
    (te / "pytorch" / "fp8.py").write_text("class FP8GlobalStateManager:\n    pass\n")
    code = textwrap.dedent("""
        import importlib.util, torch
        torch.cuda.is_available = lambda: True
        from megatron_lev.models import config, specs
        from megatron_lev.models.attention import SDPAttention
        assert importlib.util.find_spec("transformer_engine") is not None
        from megatron.core.extensions import transformer_engine as te_ext
        assert te_ext.HAVE_TE is False
        assert config.te_available() is False
        assert config.use_transformer_engine("auto") is False
        class C: qk_layernorm = False
        spec = specs.get_layer_spec(C(), None)
        assert spec.submodules.self_attention.submodules.core_attention is SDPAttention
        print("local spec")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]), PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "local spec" in r.stdout, r.stderr[-3000:]


def test_te_available_is_megatrons_flag(monkeypatch):
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.models.gpt import gpt_layer_specs

    monkeypatch.setattr(te_ext, "HAVE_TE", True)
    monkeypatch.setattr(gpt_layer_specs, "HAVE_TE", True)
    assert mconfig.te_available() is True
    monkeypatch.setattr(gpt_layer_specs, "HAVE_TE", False)
    assert mconfig.te_available() is False


# ------------------------------------------------------------------------ CUDA_DEVICE_MAX_CONNECTIONS


def test_tp_on_cuda_needs_cuda_device_max_connections_1(machine, monkeypatch):
    machine(cuda=True, te=None, cc=(9, 0))
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    _one_line(lambda: mconfig.check_cuda_device_max_connections(2), "CUDA_DEVICE_MAX_CONNECTIONS=1",
              "--tensor-model-parallel-size 2")
    mconfig.check_cuda_device_max_connections(1)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    mconfig.check_cuda_device_max_connections(2)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    machine(cuda=True, te=None, cc=(10, 0))  # Blackwell no longer needs it (Megatron-LM's check)
    mconfig.check_cuda_device_max_connections(2)
    machine(cuda=False)
    mconfig.check_cuda_device_max_connections(2)


# ------------------------------------------------------------------------ LEV compute mode


def test_compute_mode_rule():
    # table evaluates V ids per data-parallel rank and step; unique at most the rank's tokens
    assert mconfig.lev_compute_mode_for(vocab_size=50_304, tokens_per_rank_per_step=65_536) == "table"
    assert mconfig.lev_compute_mode_for(vocab_size=200_064, tokens_per_rank_per_step=8_192) == "unique"
    assert mconfig.lev_compute_mode_for(vocab_size=8_192, tokens_per_rank_per_step=8_192) == "table"
    assert mconfig.tokens_per_data_parallel_rank(global_batch_size=512, seq_length=512, data_parallel_size=32) \
        == 8_192
    _one_line(lambda: mconfig.tokens_per_data_parallel_rank(global_batch_size=100, seq_length=512,
                                                            data_parallel_size=32), "--global-batch-size 100")


def test_triton_counts_only_where_it_can_build_its_launcher(monkeypatch, tmp_path):
    """Triton builds a C launcher at the first compiled call (torch.compile's fusions and LEV's kernel):
    without a compiler or Python's headers it counts as absent (instead of failing at the first step), and
    the probe names what is missing."""
    import shutil
    import sysconfig

    from megatron_lev import kernels

    monkeypatch.delenv("CC", raising=False)
    have_compiler = any(shutil.which(c) for c in ("gcc", "clang"))
    assert mconfig.triton_available() is have_compiler  # triton is a dev dependency: installed here
    monkeypatch.setattr(shutil, "which", lambda name: name if name == "/usr/bin/cc" else None)
    assert mconfig.triton_available() is False and "C compiler" in kernels.triton_build_missing()
    monkeypatch.setenv("CC", "/usr/bin/cc")
    assert mconfig.triton_available() is True and kernels.triton_build_missing() is None
    monkeypatch.setenv("CC", "/no/such/cc")
    assert "$CC='/no/such/cc'" in kernels.triton_build_missing()
    monkeypatch.setenv("CC", "/usr/bin/cc")
    paths = sysconfig.get_paths()
    monkeypatch.setattr(sysconfig, "get_paths", lambda scheme=None: dict(paths, include=str(tmp_path)))
    assert mconfig.triton_available() is False and "Python.h" in kernels.triton_build_missing()


def test_lev_triton_only_where_it_can_build(monkeypatch, capsys):
    """On a CUDA machine whose Triton cannot build its launcher, LEV's Triton kernel is not registered,
    one warning line says why and auto runs "sparse"; an explicit --lev-basis triton is refused in one line
    naming what is missing, at the flags and at the layer's build."""
    from megatron_lev import kernels
    from megatron_lev.arguments import parse_args
    from megatron_lev.kernels import lev_triton
    from megatron_lev.lev import functional

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(lev_triton, "devices", lambda: ("cuda",))  # as without TRITON_INTERPRET on a GPU
    monkeypatch.setattr(functional, "_FUSED_PRODUCTS", {})
    monkeypatch.setattr(kernels, "_registered", False)
    monkeypatch.setattr(kernels, "triton_build_missing", lambda: "a C compiler (gcc or clang on PATH, or $CC)")
    monkeypatch.delenv("RANK", raising=False)
    kernels.register_default_kernels()
    assert not functional.has_fused_product("cuda", "triton") and not functional.has_fused_product("cuda")
    assert LEVConfig().resolved_basis("cuda") == "sparse"
    warning = capsys.readouterr().err.strip()
    assert "\n" not in warning and "C compiler" in warning and "sparse" in warning, warning
    args = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--vocab-size", "255",
            "--input-embedding", "lev", "--lev-basis", "triton"]
    _one_line(lambda: parse_args(args, world_size=1), "--lev-basis triton", "C compiler")
    parse_args(args[:-1] + ["auto"], world_size=1)
    _one_line(lambda: kernels.refuse_unbuildable_triton("triton", "cuda"), "--lev-basis triton", "C compiler")
    # Where it can build: registered, and auto picks it.
    monkeypatch.setattr(kernels, "_registered", False)
    monkeypatch.setattr(kernels, "triton_build_missing", lambda: None)
    kernels.register_default_kernels()
    assert functional.has_fused_product("cuda", "triton") and LEVConfig().resolved_basis("cuda") == "triton"
    assert "Triton" not in capsys.readouterr().err
    parse_args(args, world_size=1)


# ------------------------------------------------------------------------ attention softmax in fp32


class _OneRankGroup:
    def size(self):
        return 1


def test_softmax_in_fp32_keeps_16_bit_attention(monkeypatch):
    """megatron's flag means the softmax in fp32: SDPA gets bf16 q, k and v (so flash / cuDNN can run), not
    fp32 copies, and the result equals attention with an fp32 softmax to bf16 rounding."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_lev.models import attention

    gcfg = build_transformer_config(_mc(), num_layers=1, hidden_size=32, num_attention_heads=2, bf16=True,
                                    attention_dropout=0.0, attention_softmax_in_fp32=True)
    attn = attention.SDPAttention(gcfg, 1, AttnMaskType.causal,
                                  pg_collection=ProcessGroupCollection(tp=_OneRankGroup()))
    seen = []
    sdpa = attention.F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: seen.append((q.dtype, k.dtype, v.dtype)) or sdpa(q, k, v, **kw))
    torch.manual_seed(0)
    q, k, v = (torch.randn(6, 2, 2, 16, dtype=torch.bfloat16) for _ in range(3))  # [s, b, heads, dim]
    out = attn(q, k, v, None)
    assert seen == [(torch.bfloat16,) * 3] and out.dtype == torch.bfloat16
    scores = torch.einsum("sbhd,tbhd->bhst", q.float(), k.float()) / 4.0
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v.float()).reshape(6, 2, 32)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    monkeypatch.setattr(torch.backends.cuda, "fp16_bf16_reduction_math_sdp_allowed", lambda: True)
    _one_line(lambda: attn(q, k, v, None), "--attention-softmax-in-fp32", "allow_fp16_bf16_reduction_math_sdp")


def test_cuda_capability_asks_this_ranks_gpu(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or (9, 0))
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert mconfig.cuda_capability() == (9, 0) and asked == [5]
