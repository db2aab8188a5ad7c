"""Tests of the plain-torch LEV maths: digits, basis, separable product, modules, init, modes."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_lev.lev import (
    LEVConfig,
    LEVEmbedding,
    LEVHeads,
    LEVSeed,
    bspline_basis_dense,
    bspline_basis_sparse,
    lev_init_statistics,
    lev_param_count,
    lev_weight_decay_groups,
    no_weight_decay,
    separable_product,
    separable_product_reference,
    token_digits,
)


def tiny_config(**kw) -> LEVConfig:
    base = dict(num_digits=2, seed_dim=6, num_knots=4, rank=3, num_heads=2, chunk_size=7, product_chunk=4)
    base.update(kw)
    return LEVConfig(**base)


# -------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "vocab,k,expected",
    [(50257, 3, 37), (200000, 3, 59), (37**3, 3, 37), (37**3 + 1, 3, 38), (1000, 3, 10), (1001, 3, 11),
     (2**20, 4, 32), (10, 1, 10), (1, 3, 1)],
)
def test_resolved_base_is_smallest(vocab, k, expected):
    b = LEVConfig(num_digits=k).resolved_base(vocab)
    assert b == expected
    assert b**k >= vocab and (b == 1 or (b - 1) ** k < vocab)


@pytest.mark.parametrize(
    "kw,vocab,tp,flag",
    [
        (dict(base=10), 50257, 1, "--lev-base"),
        (dict(num_knots=2), 100, 1, "--lev-knots"),
        (dict(num_heads=8), 100, 3, "--lev-heads"),
        (dict(seed_dim=0), 100, 1, "--lev-seed-dim"),
        (dict(rank=-1), 100, 1, "--lev-rank"),
        (dict(num_digits=0), 100, 1, "--lev-digits"),
        (dict(num_heads=0), 100, 1, "--lev-heads"),
        (dict(compute_mode="dense"), 100, 1, "--lev-compute-mode"),
        (dict(basis="fancy"), 100, 1, "--lev-basis"),
        (dict(init_sample_size=100), 100, 1, "--lev-init-sample-size"),
        (dict(log_eps=0.5), 100, 1, "--lev-log-eps"),
    ],
)
def test_config_validation_errors(kw, vocab, tp, flag):
    with pytest.raises(ValueError) as err:
        LEVConfig(**kw).validate(vocab, 64, tp_size=tp)
    msg = str(err.value)
    assert flag in msg and "\n" not in msg


def test_config_validation_accepts_defaults():
    LEVConfig().validate(50257, 512, tp_size=8)
    LEVConfig(base=37).validate(50257, 512)


def test_param_count_formula_and_module():
    cfg = LEVConfig()
    p = lev_param_count(200000, 2048, cfg)
    k, b, ds, kappa, r, h, D = 3, 59, 128, 16, 64, 8, 2048
    assert p == k * b * ds + h * (ds * ds + ds + 2 * ds + ds * kappa * r + r * D) + D
    assert abs(p - 2.25e6) / 2.25e6 < 0.01
    big = LEVEmbedding(200000, 2048, cfg, init_statistics=False)
    assert sum(t.numel() for t in big.parameters()) == p
    small_cfg = tiny_config(num_heads=3, base=None)
    small = LEVEmbedding(50, 10, small_cfg)
    assert sum(t.numel() for t in small.parameters()) == lev_param_count(50, 10, small_cfg)
    meta = LEVEmbedding(200000, 2048, cfg, device="meta")
    assert sum(t.numel() for t in meta.parameters()) == p


# -------------------------------------------------------------------------------------------- digits


@pytest.mark.parametrize("vocab,base,k", [(50257, 37, 3), (37**3, 37, 3), (1000, 10, 3), (97, 97, 1), (300, 5, 4)])
def test_digits_bijection(vocab, base, k):
    ids = torch.arange(vocab)
    d = token_digits(ids, base, k)
    assert d.shape == (vocab, k)
    assert int(d.min()) >= 0 and int(d.max()) < base
    weights = torch.tensor([base ** (k - 1 - m) for m in range(k)])
    assert torch.equal((d * weights).sum(-1), ids)  # inverse map: injective, so a bijection onto its image
    assert torch.unique(d, dim=0).shape[0] == vocab


def test_digits_most_significant_first():
    assert token_digits(torch.tensor([37 * 37 * 2 + 37 * 5 + 7]), 37, 3).tolist() == [[2, 5, 7]]


# -------------------------------------------------------------------------------------------- basis


@pytest.mark.parametrize("kappa", [3, 4, 16])
def test_basis_partition_of_unity_and_sparsity(kappa):
    x = torch.cat([torch.linspace(0, 1, 2001, dtype=torch.float64), torch.rand(500, dtype=torch.float64)])
    b = bspline_basis_dense(x, kappa)
    assert b.shape == (x.numel(), kappa)
    assert (b >= 0).all()
    assert torch.allclose(b.sum(-1), torch.ones_like(x), atol=1e-12)
    # At t = 3/2 exactly, rounding of (kappa-1)|x - g_j| can leave a ~1e-32 value in the dense formula.
    assert int((b > 1e-20).sum(-1).max()) <= 3
    idx, w = bspline_basis_sparse(x, kappa)
    assert idx.shape == (x.numel(), 3) and w.shape == (x.numel(), 3)
    assert int(idx.min()) >= 0 and int(idx.max()) < kappa
    dense_from_sparse = torch.zeros_like(b).scatter_add_(-1, idx, w)
    assert torch.allclose(dense_from_sparse, b, atol=1e-12)


def test_basis_matches_spec_formula_at_points():
    kappa = 5
    # x on knot 2 (u = 2): interior, raw B = (1/8, 3/4, 1/8), already normalised.
    b = bspline_basis_dense(torch.tensor([0.5], dtype=torch.float64), kappa)[0]
    assert torch.allclose(b, torch.tensor([0, 0.125, 0.75, 0.125, 0], dtype=torch.float64))
    # x = 0: raw B = (3/4, 1/8, 0...), normalised by 7/8.
    b0 = bspline_basis_dense(torch.tensor([0.0], dtype=torch.float64), kappa)[0]
    assert torch.allclose(b0[:2], torch.tensor([6 / 7, 1 / 7], dtype=torch.float64))


@pytest.mark.parametrize("kappa", [4, 16])
def test_basis_is_c1(kappa):
    # Around every knot and every knot midpoint, values and finite-difference slopes are continuous.
    h = 1e-7
    pts = [j / (kappa - 1) for j in range(1, kappa - 1)] + [(j + 0.5) / (kappa - 1) for j in range(kappa - 1)]
    for p in pts:
        x = torch.tensor([p - 2 * h, p - h, p, p + h, p + 2 * h], dtype=torch.float64)
        for fn in (lambda v: bspline_basis_dense(v, kappa),
                   lambda v: torch.zeros(5, kappa, dtype=v.dtype).scatter_add_(-1, *bspline_basis_sparse(v, kappa))):
            b = fn(x)
            assert (b[3] - b[1]).abs().max() < 1e-5  # continuity
            left = (b[2] - b[0]) / (2 * h)
            right = (b[4] - b[2]) / (2 * h)
            assert (left - right).abs().max() < 1e-3 * (kappa - 1) ** 2  # continuous derivative
    # A discontinuous derivative would show: the slope jumps by O(kappa) with linear splines.


# -------------------------------------------------------------------------------------------- product


def _inputs(n, h, ds, kappa, r, dtype, scale=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, h, ds, generator=g, dtype=dtype)
    delta = scale * torch.randn(h, ds, kappa, r, generator=g, dtype=dtype)
    return x.requires_grad_(), delta.requires_grad_()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("basis", ["dense", "sparse"])
@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_product_matches_reference(dtype, tol, basis, chunk):
    x, delta = _inputs(9, 2, 10, 5, 4, dtype)
    m = separable_product(x, delta, 5, basis=basis, product_chunk=chunk)
    ref = separable_product_reference(x, delta, 5)
    assert m.dtype == dtype and m.shape == (9, 2, 4)
    assert torch.allclose(m, ref, rtol=tol, atol=tol)
    g = torch.randn_like(m)
    gx, gd = torch.autograd.grad(m, (x, delta), g)
    rx, rd = torch.autograd.grad(ref, (x, delta), g)
    assert torch.allclose(gx, rx, rtol=10 * tol, atol=10 * tol)
    assert torch.allclose(gd, rd, rtol=10 * tol, atol=10 * tol)


def test_product_log_form_matches_reference_with_large_factors():
    # Large Delta puts chunk products outside [1e-30, 1e30] and triggers the log form; negatives too.
    x, delta = _inputs(5, 2, 40, 4, 3, torch.float64, scale=30.0)
    m = separable_product(x, delta, 4, product_chunk=40, log_eps=1e-300)
    ref = separable_product_reference(x, delta, 4)
    assert (ref < 0).any() and (ref > 0).any()
    assert torch.allclose(m, ref, rtol=1e-10, atol=0)
    g = torch.randn_like(m)
    gd = torch.autograd.grad(m, delta, g)[0]
    rd = torch.autograd.grad(ref, delta, g)[0]
    assert torch.allclose(gd, rd, rtol=1e-9, atol=0)


def test_product_bf16_inputs_compute_in_fp32():
    x, delta = _inputs(6, 2, 8, 4, 3, torch.float32)
    m = separable_product(x.detach().bfloat16(), delta.detach().bfloat16(), 4)
    assert m.dtype == torch.float32
    ref = separable_product_reference(x.detach().bfloat16().float(), delta.detach().bfloat16().float(), 4)
    assert torch.allclose(m, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("basis", ["dense", "sparse"])
def test_product_gradient_at_exact_zero_factor(basis):
    torch.manual_seed(0)
    h, ds, kappa, r = 1, 5, 4, 2
    x = torch.full((1, h, ds), 0.5, dtype=torch.float64)  # u = 1.5: weights 1/2, 1/2 on knots 1 and 2
    delta = 0.2 * torch.randn(h, ds, kappa, r, dtype=torch.float64)
    # Make phi[d=2, rho=0] = 1 + (delta[.,1] + delta[.,2]) / 2 exactly 0.
    delta[0, 2, 1, 0] = -1.0
    delta[0, 2, 2, 0] = -1.0
    x.requires_grad_()
    delta.requires_grad_()
    m = separable_product(x, delta, kappa, basis=basis, product_chunk=2)
    assert m[0, 0, 0].item() == 0.0
    gd = torch.autograd.grad(m[0, 0, 0], delta)[0]
    assert torch.isfinite(gd).all()
    # dM/dDelta[2, j, 0] = Bhat_j * (product of the other factors), non-zero.
    with torch.no_grad():
        b = bspline_basis_dense(x[0, 0], kappa)
        phi = 1 + torch.einsum("dk,dkr->dr", b, delta[0])
        others = torch.cat([phi[:2, 0], phi[3:, 0]]).prod()
    assert others.abs() > 1e-3
    assert torch.allclose(gd[0, 2, :, 0], b[2] * others, rtol=1e-10, atol=1e-14)
    assert gd[0, 2, 1, 0].abs() > 1e-4


@pytest.mark.parametrize("basis", ["dense", "sparse"])
def test_product_gradcheck_float64(basis):
    x, delta = _inputs(3, 2, 5, 4, 3, torch.float64)
    assert torch.autograd.gradcheck(
        lambda a, b: separable_product(a, b, 4, basis=basis, product_chunk=2), (x, delta)
    )


class _MaxNumel(TorchDispatchMode):
    """Records the largest tensor produced by any aten op (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_product_never_holds_all_factors():
    n, h, ds, kappa, r = 64, 4, 32, 6, 8
    full = n * h * ds * r
    x, delta = _inputs(n, h, ds, kappa, r, torch.float32, scale=0.1)
    for basis in ("dense", "sparse"):
        with _MaxNumel() as probe:
            m = separable_product(x, delta, kappa, basis=basis, product_chunk=4)
            m.sum().backward()
        assert probe.max_numel > 0
        assert probe.max_numel <= full // 4, (basis, probe.max_numel, full)
    # Sanity: the probe sees the big tensor of the reference.
    with _MaxNumel() as probe:
        separable_product_reference(x, delta, kappa).sum().backward()
    assert probe.max_numel >= full


# -------------------------------------------------------------------------------------------- modules


def test_seed_sums_codebook_rows():
    cfg = tiny_config()
    seed = LEVSeed(30, cfg)
    assert seed.base == 6 and seed.codebooks.shape == (2, 6, 6)
    ids = torch.tensor([[0, 13], [29, 7]])
    z = seed(ids)
    c = seed.codebooks
    assert z.shape == (2, 2, 6)
    assert torch.allclose(z[0, 1], c[0, 2] + c[1, 1])
    assert torch.allclose(z[1, 0], c[0, 4] + c[1, 5])


def test_heads_shapes_and_coordinates():
    cfg = tiny_config()
    heads = LEVHeads(cfg, 10, 2)
    assert heads.proj_weight.shape == (2, 6, 6)
    assert heads.delta.shape == (2, 6, 4, 3)
    assert heads.out_weight.shape == (2, 10, 3)
    z = torch.randn(5, 6)
    x = heads.coordinates(z)
    assert x.shape == (5, 2, 6) and (x > 0).all() and (x < 1).all()
    y = heads(z)
    assert y.shape == (5, 10)
    m = separable_product_reference(x, heads.delta, 4)
    assert torch.allclose(y, torch.einsum("nhr,hdr->nd", m, heads.out_weight), atol=1e-6)


def test_head_shards_sum_to_full_heads():
    cfg = tiny_config(num_heads=4)
    full = LEVHeads(cfg, 10)
    shards = [LEVHeads(cfg, 10, 2, head_offset=0), LEVHeads(cfg, 10, 2, head_offset=2)]
    assert torch.equal(torch.cat([s.delta for s in shards]), full.delta)
    z = torch.randn(7, 6)
    assert torch.allclose(shards[0](z) + shards[1](z), full(z), atol=1e-6)


def _emb(mode="token", dtype=torch.float64, vocab=40, D=5, **kw):
    cfg = tiny_config(compute_mode=mode, **kw)
    return LEVEmbedding(vocab, D, cfg, init_method_std=0.02, dtype=dtype)


def test_embedding_gradcheck_float64():
    emb = _emb(vocab=20, D=3, seed_dim=3, num_knots=3, rank=2, product_chunk=2)
    ids = torch.tensor([[1, 5, 5], [19, 0, 7]])
    params = [p for _, p in emb.named_parameters()]

    # gradcheck differentiates a function of tensors: every parameter through functional_call.
    names = [n for n, _ in emb.named_parameters()]

    def f(*ps):
        return torch.func.functional_call(emb, dict(zip(names, ps)), (ids,))

    inputs = tuple(p.detach().clone().requires_grad_() for p in params)
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, fast_mode=True)


def _grads(emb):
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in emb.named_parameters()}


def test_compute_modes_agree_values_and_grads():
    torch.manual_seed(1)
    mbs = [torch.randint(0, 40, (3, 6)), torch.randint(0, 40, (3, 6))]
    mbs[1][0, 0] = mbs[0][0, 0]  # an id shared by both micro-batches
    weights = torch.randn(3, 6, 5, dtype=torch.float64)

    results = {}
    for mode in ("token", "unique", "table"):
        emb = _emb(mode)
        outs = []
        if mode == "table":
            emb.begin_table_step()
        for ids in mbs:
            out = emb(ids)
            (out * weights).sum().backward()
            outs.append(out.detach())
        if mode == "table":
            assert emb.table is not None and emb._modes.table_grad is not None
            emb.finish_table_step()
            assert emb.table is None
        results[mode] = (outs, _grads(emb))

    ref_outs, ref_grads = results["token"]
    assert all(g.abs().sum() > 0 for g in ref_grads.values())
    for mode in ("unique", "table"):
        outs, grads = results[mode]
        for a, b in zip(outs, ref_outs):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-14), mode
        for name in ref_grads:
            assert torch.allclose(grads[name], ref_grads[name], rtol=1e-10, atol=1e-13), (mode, name)


def test_table_mode_begins_automatically_and_eval_builds_no_table():
    emb = _emb("table")
    ids = torch.tensor([3, 4, 3])
    with torch.no_grad():
        out = emb(ids)
    assert emb.table is None
    out2 = emb(ids)  # grad enabled: table built on first use
    assert emb.table is not None
    assert torch.allclose(out, out2.detach())
    out2.sum().backward()
    emb.finish_table_step()
    assert emb.table is None and emb.offset.grad is not None
    assert torch.allclose(emb.offset.grad, torch.full_like(emb.offset, 3.0))


def test_materialize_rows_equal_forward():
    emb = _emb("unique", dtype=torch.float32, vocab=53)
    table = emb.materialize()
    assert table.shape == (53, 5) and not table.requires_grad
    ids = torch.tensor([[52, 0, 17], [17, 8, 1]])
    assert torch.allclose(table[ids], emb(ids), atol=1e-6)


def test_ids_out_of_range_raise():
    emb = _emb("unique", dtype=torch.float32)
    for bad in (40, 1000, -1):
        with pytest.raises(ValueError, match=r"outside \[0, 40\).*vocabulary size 40"):
            emb(torch.tensor([1, bad]))


def test_init_per_coordinate_std_and_centred():
    D, std = 24, 0.02
    cfg = LEVConfig(num_digits=2, seed_dim=16, num_knots=8, rank=8, num_heads=2, chunk_size=512, product_chunk=8)
    emb = LEVEmbedding(3000, D, cfg, init_method_std=std, init_seed=3)
    table = emb.materialize().double()
    per_coord = table.std(dim=0, unbiased=False)
    assert ((per_coord - std).abs() / std).max() < 0.05
    mean = table.mean(dim=0)
    assert (mean.abs() < 1e-3 * std).all()
    # Without the offset the vocabulary mean would be a shared shift of the size of the spread.
    assert (emb.offset.detach().abs().mean() > 0.1 * std)


def test_init_sample_and_reduce_fn():
    D = 6
    cfg = LEVConfig(num_digits=2, seed_dim=8, num_knots=4, rank=4, num_heads=2, chunk_size=1000,
                    init_sample_size=4096)
    emb = LEVEmbedding(5000, D, cfg, init_method_std=0.02)
    table = emb.materialize().double()
    per_coord = table.std(dim=0, unbiased=False)
    assert ((per_coord - 0.02).abs() / 0.02).max() < 0.1  # sample of 4096 of 5000 ids
    # reduce_fn sees each chunk's partial output; doubling it doubles the sums.
    calls = []

    def reduce_fn(y):
        calls.append(y.shape)
        return 2 * y

    s1, s2, n = lev_init_statistics(emb.seed, emb.heads, 5000, 1000)
    r1, r2, rn = lev_init_statistics(emb.seed, emb.heads, 5000, 1000, reduce_fn=reduce_fn)
    assert n == rn == 5000 and len(calls) == 5 and calls[0] == (1000, D)
    assert torch.allclose(r1, 2 * s1) and torch.allclose(r2, 4 * s2)


def test_same_seed_same_function():
    a, b = _emb("unique"), _emb("unique")
    ids = torch.arange(40)
    assert torch.equal(a(ids), b(ids))
    c = LEVEmbedding(40, 5, tiny_config(), init_seed=1, dtype=torch.float64)
    assert not torch.allclose(a(ids), c(ids))


def test_weight_decay_grouping():
    emb = _emb()
    names = dict(emb.named_parameters())
    expected_no_decay = {"heads.norm_weight", "heads.norm_bias", "heads.proj_bias", "offset"}
    expected_decay = {"heads.delta", "heads.proj_weight", "heads.out_weight", "seed.codebooks"}
    assert set(names) == expected_no_decay | expected_decay
    assert {n for n in names if no_weight_decay(n)} == expected_no_decay
    decay, no_decay = lev_weight_decay_groups(emb, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(names[n]) for n in expected_decay}
    assert {id(p) for p in no_decay["params"]} == {id(names[n]) for n in expected_no_decay}


def test_bf16_module_outputs_bf16():
    emb = _emb("unique", dtype=torch.bfloat16)
    out = emb(torch.tensor([1, 2, 3]))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    out.float().sum().backward()
    assert emb.heads.delta.grad is not None and torch.isfinite(emb.heads.delta.grad.float()).all()
