"""What the GPU/bf16/DDP path of the pure layer relies on, checked on the CPU:

- low-precision parameters: built directly in bf16/fp16 they equal the fp32 initialisation rounded once
  (as a Float16Module would hold them), the forward returns that dtype, a backward works, and the values
  agree with the fp32 layer within the dtype's tolerance; the table mode accumulates in fp32;
- the table mode delivers each parameter's gradient exactly once per step whatever the chunking
  (megatron DDP's overlapped grad reduce counts these hooks);
- the product's log form (used without host syncs on accelerators) equals the default form;
- ``initialize=False`` computes nothing (no vocabulary statistics).
"""

from __future__ import annotations

import pytest
import torch

import megatron_lev.lev.layer as layer_mod
from megatron_lev.lev import LEVConfig, LEVEmbedding
from megatron_lev.lev.functional import separable_product

V, D = 300, 16


def _cfg(mode="unique", **kw) -> LEVConfig:
    base = dict(num_digits=2, seed_dim=8, num_knots=5, rank=4, num_heads=2, chunk_size=64, product_chunk=4,
                compute_mode=mode)
    base.update(kw)
    return LEVConfig(**base)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_low_precision_parameters_equal_rounded_fp32_and_agree(dtype, tol):
    ref = LEVEmbedding(V, D, _cfg(), init_seed=5)
    low = LEVEmbedding(V, D, _cfg(), init_seed=5, dtype=dtype)
    for (name, p), (_, q) in zip(ref.named_parameters(), low.named_parameters()):
        assert q.dtype == dtype, name
        assert torch.equal(q, p.detach().to(dtype)), name  # fp32 initialisation rounded once
    ids = torch.randint(0, V, (4, 9), generator=torch.Generator().manual_seed(0))
    out_ref, out = ref(ids), low(ids)
    assert out.dtype == dtype
    scale = out_ref.detach().abs().max()
    assert (out.float() - out_ref.detach()).abs().max() <= tol * scale
    # The compute path itself rounds once: against the fp32 layer holding the same (rounded) parameters,
    # every value is within half a unit in the last place of the low-precision format.
    same = LEVEmbedding(V, D, _cfg(), initialize=False)
    with torch.no_grad():
        for p, q in zip(same.parameters(), low.parameters()):
            p.copy_(q.float())
    exact = same(ids).detach()
    half_ulp = torch.finfo(dtype).eps / 2
    assert ((out.float() - exact).abs() <= half_ulp * exact.abs() + 1e-6 * scale).all()
    out.float().square().sum().backward()
    for name, q in low.named_parameters():
        assert q.grad is not None and q.grad.dtype == dtype and torch.isfinite(q.grad.float()).all(), name


def test_bf16_table_mode_accumulates_in_fp32_and_matches_unique_mode():
    grads = {}
    mbs = [torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3)]
    for mode in ("unique", "table"):
        emb = LEVEmbedding(V, D, _cfg(mode), init_seed=5, dtype=torch.bfloat16)
        for ids in mbs:
            out = emb(ids)
            if mode == "table":
                assert emb.table.dtype == torch.float32 and out.dtype == torch.bfloat16
            out.float().sum().backward()
        if mode == "table":
            emb.finish_table_step()
        grads[mode] = {n: p.grad.float() for n, p in emb.named_parameters()}
    for name, g in grads["unique"].items():
        assert torch.allclose(grads["table"][name], g, rtol=5e-2, atol=5e-2 * g.abs().max().item()), name


@pytest.mark.parametrize("chunk_size", [7, 300])
def test_table_mode_fires_each_gradient_hook_once_per_step(chunk_size):
    emb = LEVEmbedding(V, D, _cfg("table", chunk_size=chunk_size), init_seed=1, dtype=torch.float64)
    counts = {}
    accs = []  # kept alive, as megatron DDP keeps them: a freed node would take its hook with it
    for name, p in emb.named_parameters():
        # The node megatron DDP hooks: the parameter's AccumulateGrad.
        acc = p.expand_as(p).grad_fn.next_functions[0][0]
        acc.register_hook(lambda *a, n=name: counts.__setitem__(n, counts.get(n, 0) + 1))
        accs.append(acc)
    ref = LEVEmbedding(V, D, _cfg("unique"), init_seed=1, dtype=torch.float64)
    for step in range(2):
        counts.clear()
        for s in range(3):  # three micro-batches, 40+ distinct ids: several chunks at chunk_size 7
            ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(10 * step + s))
            emb(ids).sum().backward()
            ref(ids).sum().backward()
        emb.finish_table_step()
        assert counts == {n: 1 for n, _ in emb.named_parameters()}, counts
    for (name, p), (_, q) in zip(emb.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-12), name
    # A step in which no row got a gradient still delivers (zeros) once per parameter.
    counts.clear()
    with torch.no_grad():
        emb.begin_table_step()
    emb.finish_table_step()
    assert counts == {n: 1 for n, _ in emb.named_parameters()}


def test_log_form_only_equals_default_form():
    g = torch.Generator().manual_seed(3)
    x = torch.rand(60, 2, 8, generator=g, dtype=torch.float64).requires_grad_()
    delta = (0.2 * torch.randn(2, 8, 5, 4, generator=g, dtype=torch.float64)).requires_grad_()
    w = torch.randn(60, 2, 4, generator=g, dtype=torch.float64)
    res = []
    for log_form_only in (False, True):
        m = separable_product(x, delta, 5, basis="dense", product_chunk=3, log_form_only=log_form_only)
        gx, gd = torch.autograd.grad((m * w).sum(), (x, delta))
        res.append((m.detach(), gx, gd))
    for a, b in zip(*res):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)


def test_no_initialisation_computes_no_statistics(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("statistics computed")

    monkeypatch.setattr(layer_mod, "lev_init_statistics", boom)
    LEVEmbedding(V, D, _cfg(), initialize=False)
    with pytest.raises(AssertionError, match="statistics computed"):
        LEVEmbedding(V, D, _cfg())


def test_table_mode_adds_its_fp32_sum_into_megatron_main_grads():
    """With megatron DDP's ``main_grad`` on the parameters, the step's fp32 sum over id chunks goes there directly
    (not through a param.grad rounded to bf16); the delivered param.grad is zeros, flagged as added."""
    ids = [torch.randint(0, V, (3, 7), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]

    def step(main_grads: bool):
        emb = LEVEmbedding(V, D, _cfg("table", chunk_size=8), init_seed=3, dtype=torch.bfloat16)
        pushed = list(emb.seed.parameters()) + list(emb.heads.parameters())
        if main_grads:
            for p in pushed:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
                p.grad_added_to_main_grad = False
        for x in ids:
            emb(x).float().pow(2).sum().backward()
        emb.finish_table_step()
        return pushed

    plain, fused = step(False), step(True)
    finer = False
    for p, q in zip(plain, fused):
        assert q.grad_added_to_main_grad and torch.count_nonzero(q.grad) == 0
        assert torch.equal(q.main_grad.to(torch.bfloat16), p.grad)  # the same sum, rounded once here
        finer |= not torch.equal(q.main_grad, q.main_grad.to(torch.bfloat16).float())
    assert finer  # the main grads keep what bf16 rounding drops
