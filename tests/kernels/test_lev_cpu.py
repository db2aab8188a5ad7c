"""The fused CPU kernel of the separable product against the eager form."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_lev import kernels
from megatron_lev.kernels import lev_cpu, register_default_kernels
from megatron_lev.lev import LEVConfig, LEVEmbedding, separable_product, separable_product_reference
from megatron_lev.lev import functional
from megatron_lev.lev.functional import has_fused_product


@pytest.fixture(autouse=True, scope="module")
def _kernels():
    register_default_kernels()


def _case(n, h, ds, kappa, r, seed=0, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, h, ds, generator=g).requires_grad_()
    delta = (scale * torch.randn(h, ds, kappa, r, generator=g)).requires_grad_()
    up = torch.randn(n, h, r, generator=g)
    return x, delta, up


def _run(basis, x, delta, up, kappa):
    x.grad = delta.grad = None
    m = separable_product(x, delta, kappa, basis=basis)
    (m * up).sum().backward()
    return m.detach(), x.grad.clone(), delta.grad.clone()


@pytest.mark.parametrize("shape", [(5, 2, 3, 3, 2), (64, 4, 20, 7, 16), (33, 3, 17, 16, 8)])
def test_fused_equals_eager(shape):
    n, h, ds, kappa, r = shape
    x, delta, up = _case(*shape)
    eager = _run("dense", x, delta, up, kappa)
    fused = _run("fused", x, delta, up, kappa)
    ref = separable_product_reference(x.detach(), delta.detach(), kappa)
    torch.testing.assert_close(fused[0], ref, rtol=1e-5, atol=1e-7)
    for a, b in zip(fused, eager):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6 * float(b.abs().max()))


def test_auto_basis_picks_the_kernel_on_cpu():
    assert has_fused_product("cpu")
    assert LEVConfig().resolved_basis("cpu") == "fused"
    assert LEVConfig(basis="dense").resolved_basis("cpu") == "dense"


def test_zero_factor_falls_back_to_the_exact_log_form():
    x, delta, up = _case(6, 2, 4, 5, 3)
    with torch.no_grad():
        delta[0, 1] = -1.0  # S = 0 on every knot of (head 0, dim 1): phi = 0 exactly
    fused = _run("fused", x, delta, up, 5)
    eager = _run("dense", x, delta, up, 5)
    assert torch.all(fused[0][:, 0] == 0)
    for a, b in zip(fused, eager):
        torch.testing.assert_close(a, b)
    assert torch.isfinite(fused[1]).all() and fused[2][0, 1].abs().sum() > 0


def test_bf16_inputs_and_fp64_use_the_right_paths():
    x, delta, up = _case(8, 2, 6, 5, 4)
    m = separable_product(x.detach().bfloat16(), delta.detach().bfloat16(), 5, basis="fused")
    assert m.dtype == torch.float32 and torch.isfinite(m).all()
    m64 = separable_product(x.detach().double(), delta.detach().double(), 5, basis="fused")
    assert m64.dtype == torch.float64  # no fp64 kernel: the eager form ran


def test_layer_with_kernel_matches_dense_layer():
    kw = dict(seed_dim=8, num_knots=5, rank=4, num_heads=2)
    a = LEVEmbedding(300, 16, LEVConfig(basis="fused", **kw))
    b = LEVEmbedding(300, 16, LEVConfig(basis="dense", **kw))
    b.load_state_dict(a.state_dict())
    ids = torch.randint(0, 300, (3, 7))
    for m in (a, b):
        m(ids).square().sum().backward()
    ta, tb = a.materialize(), b.materialize()
    torch.testing.assert_close(ta, tb, rtol=1e-5, atol=1e-5 * float(tb.abs().max()))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        # fp32 rounding through the LayerNorm backward: compare relative to the gradient's scale.
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-4, atol=1e-5 * float(pb.grad.abs().max()),
                                   msg=name)


def test_default_cpu_path_keeps_its_values_and_gradients_at_the_default_widths():
    # d_s, kappa, r at the defaults, ids over several forward tiles: the tiled kernel must give the
    # eager form's values (the product's order over d is unchanged) and its gradients.
    x, delta, up = _case(37, 2, 128, 16, 64, seed=7)
    assert LEVConfig().resolved_basis("cpu") == "fused"
    fused = _run("fused", x, delta, up, 16)
    eager = _run("dense", x, delta, up, 16)
    torch.testing.assert_close(fused[0], eager[0], rtol=1e-5, atol=0.0)  # 128 fp32 factors
    for a, b in zip(fused[1:], eager[1:]):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6 * float(b.abs().max()))


def test_gradients_do_not_depend_on_the_thread_count():
    x, delta, up = _case(50, 3, 9, 5, 8, seed=8)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run("fused", x, delta, up, 5)
        torch.set_num_threads(2)
        two = _run("fused", x, delta, up, 5)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_registration_is_explicit_and_idempotent(monkeypatch):
    registered = dict(functional._FUSED_PRODUCTS)
    assert registered[("fused", "cpu")] is lev_cpu.fused_separable_product
    # Starting from an empty registry, as after a fresh import of the package: the first call
    # registers the same kernels, a second call changes nothing.
    monkeypatch.setattr(functional, "_FUSED_PRODUCTS", {})
    monkeypatch.setattr(kernels, "_registered", False)
    assert not has_fused_product("cpu")
    register_default_kernels()
    assert functional._FUSED_PRODUCTS == registered
    register_default_kernels()
    assert functional._FUSED_PRODUCTS == registered


_POOL_PROBE = """
import json, os, sys
import torch
import megatron_lev.training
from megatron_lev.kernels import lev_cpu

imported_early = "numba" in sys.modules
xt = torch.rand(2, 3, 8).numpy()
lev_cpu.forward(xt, torch.ones(2, 3, 4, 2).numpy())
import numba
print(json.dumps([imported_early, numba.config.NUMBA_NUM_THREADS, numba.get_num_threads()]))
"""


@pytest.mark.parametrize("given, pool", [
    ({}, 1),  # a torchrun rank's OMP_NUM_THREADS=1
    ({"NUMBA_NUM_THREADS": "2", "MEGATRON_LEV_NUMBA_NUM_THREADS": "2"}, 1),  # what a 2-thread launcher had set
    ({"NUMBA_NUM_THREADS": "2"}, 2),  # the user's own setting
])
def test_numba_pool_is_sized_in_each_process_from_its_own_threads(tmp_path, given, pool):
    """Numba's pool is fixed when numba is imported and its unused threads busy-wait. A 4-rank LEV run on 2
    cores took 2,000 ms per iteration instead of 130 when its ranks inherited NUMBA_NUM_THREADS=2 from the
    process that launched them (it had imported the kernels with 2 threads): each rank's pool had a
    spinning thread. Now numba is imported on the first kernel call, sized from that process's threads."""
    import json
    import os

    from megatron_lev.testing import run_cli

    script = tmp_path / "probe.py"
    script.write_text(_POOL_PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_NUM_THREADS", "MEGATRON_LEV_NUMBA_NUM_THREADS")}
    env.update(given, OMP_NUM_THREADS="1")
    r = run_cli(script, [], env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    imported_early, size, used = json.loads(r.stdout.strip().splitlines()[-1])
    assert not imported_early  # the training stack leaves numba to the first kernel call
    assert (size, used) == (pool, 1)


_BROKEN_PROBE = """
import sys
import torch
from megatron_lev.kernels import lev_cpu, register_default_kernels
from megatron_lev.lev import LEVConfig, LEVEmbedding
from megatron_lev.lev.functional import has_fused_product

register_default_kernels()
layer = LEVEmbedding(300, 16, LEVConfig(seed_dim=8, num_knots=5, rank=4, num_heads=2))  # basis "auto"
layer(torch.randint(0, 300, (3, 7))).square().sum().backward()
print(lev_cpu.available(), has_fused_product("cpu"), layer.config.basis)
"""


def test_a_numba_that_does_not_import_turns_the_kernel_off_in_one_warning(tmp_path):
    """A numba older than the NumPy beside it raises ImportError at import. Before, ``available()`` only
    asked whether numba was installed, and the first LEV forward failed with that traceback; now the
    kernel is off with one warning line and basis "auto" computes the eager form."""
    from megatron_lev.testing import run_cli

    (tmp_path / "numba").mkdir()  # found first: run_cli puts the script's folder first on sys.path
    (tmp_path / "numba" / "__init__.py").write_text('raise ImportError("Numba needs NumPy 2.2 or less")\n')
    script = tmp_path / "probe.py"
    script.write_text(_BROKEN_PROBE)
    r = run_cli(script, [], env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "False False auto"
    warnings = [ln for ln in r.stderr.splitlines() if "fused CPU kernel" in ln]
    assert warnings == ["warning: LEV's fused CPU kernel is off: numba is installed but does not import (Numba "
                        "needs NumPy 2.2 or less); --lev-basis auto runs the eager basis"], r.stderr[-3000:]
