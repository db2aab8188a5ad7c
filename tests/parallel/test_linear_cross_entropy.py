"""The linear cross-entropy (``--cross-entropy-loss-fusion --cross-entropy-fusion-impl linear``): the loss
and every gradient against megatron-core's own head + ``vocab_parallel_cross_entropy``.

One two-rank job (tests/parallel/_linear_ce_ranks.py, on the rank pool) runs every multi-rank case: the
function at TP = 2 with and without sequence parallelism and at TP = 1, in fp32 and bf16, under a loss
mask; LevGPTModel through megatron-core's schedule with DDP and the training loop's loss function at
TP = 2 + SP with MoE, MTP and the per-token loss, with the tied arm, at PP = 2 with MTP, and at TP = 1.
The rest runs in this process: gradient-accumulation fusion's ``main_grad`` convention, a frozen head,
chunk sizes, and the flags.
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron_lev.lev.config import ConfigError
from megatron_lev.parallel.linear_cross_entropy import CPU_TILE_BYTES, Tiling, default_chunk_size, \
    linear_cross_entropy, tiling
from megatron_lev.testing import run_distributed
from tests.parallel import _linear_ce_ranks as R

FP32 = 1e-6  # relative, on norms: fp32 rounding in two summation orders
BF16 = 1.6e-2  # relative: torch.testing's bf16 tolerance (a few roundings at 2^-8 = 3.9e-3)


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(R.all_checks, 2, tp=2)


def _cases(ranks, prefix):
    cases = [(name, rank, r) for rank, out in enumerate(ranks) for name, r in out.items() if name.startswith(prefix)]
    assert cases, prefix
    return cases


def test_function_equals_megatron_at_fp32_with_and_without_sequence_parallelism(ranks):
    for name, rank, r in _cases(ranks, "fn"):
        if "bfloat16" in name:
            continue
        for what, figures in r.items():
            assert figures["vs_megatron"] < FP32, (name, rank, what, figures)


def test_function_within_bf16_rounding_of_megatron(ranks):
    for name, rank, r in _cases(ranks, "fn"):
        if "bfloat16" not in name:
            continue
        # The same bf16 logits taken to fp32: the loss as in fp32.
        assert r["loss"]["vs_megatron"] < FP32, (name, rank, r["loss"])
        for what in ("grad_input", "grad_weight"):
            f = r[what]
            assert f["vs_megatron"] < BF16, (name, rank, what, f)
            # As far from the float64 result as megatron's own (the weight gradient's chunks add in fp32).
            assert f["err"] <= 1.5 * f["megatron_err"] + FP32, (name, rank, what, f)


def test_through_the_model_every_layout_arm_and_precision(ranks):
    seen = set()
    for name, rank, r in _cases(ranks, "model"):
        seen.add(name)
        assert r["fused_head"], (name, rank)
        tol = BF16 if "bf16" in name else FP32
        if "loss" in r:  # the last pipeline stage
            assert r["loss"] < (FP32 if "bf16" not in name else 1e-5), (name, rank, r["loss"])
        assert r["grad"] < tol, (name, rank, r["grad_worst"], r["grad"])
        assert r["params"] > 10
        if "logits_equal" in r:
            assert r["logits_equal"], (name, rank)  # without labels the head still gives its logits
    # Each pipeline stage reported; the last stage (rank 1 at PP=2) computed the loss.
    assert all("loss" in out["model pp2 untied mtp per-token"] for out in ranks[1:])
    assert {"model tp2 sp untied moe mtp per-token", "model tp2 sp lev mtp per-token float64", "model tp2 tied bf16",
            "model pp2 untied mtp per-token", "model pp2 lev bf16", "model tp1 factored_mlp"} <= seen
    # The head's (or the tied table's) gradient was compared on every rank that holds it.
    tied = [out["model tp2 tied bf16"]["head_grad"] for out in ranks]
    assert all("0.module.embedding.word_embeddings.weight" in t for t in tied)


# --------------------------------------------------------------------------------- in this process


def _reference(x, w, y, up):
    x, w = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(x.reshape(-1, x.shape[-1]) @ w.t(), y.reshape(-1), reduction="none")
    (loss * up.reshape(-1)).sum().backward()
    return loss.detach(), x.grad, w.grad


def _data(n=37, h=8, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, generator=g), torch.randn(v, h, generator=g), torch.randint(0, v, (n,), generator=g),
            torch.rand(n, generator=g))


def test_tiles_give_the_same_loss_and_gradients():
    x, w, y, up = _data()
    ref = _reference(x, w, y, up)
    for chunk, block in ((1, None), (5, 7), (37, 1), (1000, 49), (None, None), (None, 50)):
        xg, wg = x.clone().requires_grad_(True), torch.nn.Parameter(w.clone())
        loss = linear_cross_entropy(xg, wg, y, chunk_size=chunk, vocab_block=block)
        (loss * up).sum().backward()
        for got, want in zip((loss, xg.grad, wg.grad), ref):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for bad in (dict(chunk_size=0), dict(vocab_block=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            linear_cross_entropy(x, w, y, **bad)


def test_default_tiles():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # CUDA: one block of the rank's rows, 256 MiB of fp32 logits a chunk.
    assert default_chunk_size(200_000) == 335 and default_chunk_size(10**12) == 1
    assert tiling(8192, 100_000, cuda) == Tiling(671, 100_000) and tiling(100, 100_000, cuda) == Tiling(100, 100_000)
    # CPU: cache-sized tiles of 512 tokens (fewer if the step has fewer).
    assert tiling(8192, 100_000, cpu) == Tiling(512, CPU_TILE_BYTES // (4 * 512))
    assert tiling(100, 50, cpu) == Tiling(100, 50) and tiling(8192, 100_000, cpu, 64, 1000) == Tiling(64, 1000)


def test_gradient_accumulation_fusion_adds_into_main_grad_as_megatrons_linear_layer():
    x, w, y, up = _data()
    x, w = x.bfloat16(), w.bfloat16()
    _, _, want = _reference(x.float(), w.float(), y, up)
    for placeholder in (True, False):
        weight = torch.nn.Parameter(w.clone())
        weight.main_grad = torch.full(w.shape, 0.5)  # megatron DDP's fp32 buffer, holding earlier micro-batches
        if placeholder:
            weight.grad_added_to_main_grad = False
        xg = x.clone().requires_grad_(True)
        loss = linear_cross_entropy(xg, weight, y, chunk_size=8, vocab_block=None if placeholder else 9,
                                    gradient_accumulation_fusion=True)
        (loss * up).sum().backward()
        assert weight.main_grad.dtype == torch.float32
        assert float((weight.main_grad - 0.5 - want).norm() / want.norm()) < BF16
        if placeholder:  # DDP's hook sees a gradient but adds nothing: it is already in main_grad
            assert weight.grad is not None and weight.grad.shape == w.shape and weight.grad_added_to_main_grad
        else:
            assert weight.grad is None


def test_a_frozen_head_gets_no_weight_gradient():
    x, w, y, up = _data()
    _, want_x, _ = _reference(x, w, y, up)
    xg = x.clone().requires_grad_(True)
    frozen = w.clone()  # as megatron-core 0.19's --mtp-detach-heads passes the head's weight
    (linear_cross_entropy(xg, frozen, y, chunk_size=4, vocab_block=11) * up).sum().backward()
    torch.testing.assert_close(xg.grad, want_x, rtol=1e-5, atol=1e-6)
    assert frozen.grad is None


def _parse(extra):
    from megatron_lev.arguments import parse_args

    return parse_args(("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
                       "--train-iters 4 --lr 1e-3 --mock-data --vocab-size 100").split() + extra, world_size=1)


def test_flags_build_the_linear_loss_and_bad_combinations_are_one_line():
    from megatron_lev.config import RunConfig
    from megatron_lev.models.config import check_linear_cross_entropy, linear_cross_entropy_on
    from megatron_lev.models.factory import build_configs

    args = _parse(["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "linear",
                   "--linear-cross-entropy-chunk-size", "64"])
    a = RunConfig.from_args(args).with_padded_vocab(128)  # the loop pads the tokenizer's vocabulary
    # As the training loop builds its configs.
    config, model_config = build_configs(a, calculate_per_token_loss=args.calculate_per_token_loss,
                                         cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
                                         cross_entropy_fusion_impl=args.cross_entropy_fusion_impl)
    assert linear_cross_entropy_on(config) and model_config.linear_cross_entropy_chunk_size == 64
    # Evaluation and conversion build theirs without the loss flags: logits as always.
    config, _ = build_configs(a, for_loading=True)
    assert not linear_cross_entropy_on(config)

    for extra, flag in ((["--linear-cross-entropy-chunk-size", "64"], "--linear-cross-entropy-chunk-size"),
                        (["--cross-entropy-fusion-impl", "linear"], "--cross-entropy-fusion-impl linear")):
        with pytest.raises(ConfigError) as e:
            _parse(extra)
        assert flag in str(e.value) and "\n" not in str(e.value)
    on = dict(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="linear")
    for bad in (dict(defer_embedding_wgrad_compute=True), dict(use_mup=True, mup_output_mult=0.5)):
        with pytest.raises(ConfigError, match="--cross-entropy-fusion-impl linear") as e:
            check_linear_cross_entropy(types.SimpleNamespace(**on, **bad), None)
        assert "\n" not in str(e.value)
    check_linear_cross_entropy(types.SimpleNamespace(**on), 8)
