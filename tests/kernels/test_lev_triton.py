"""The fused Triton kernel of the separable product against the eager fp64 layer.

Without CUDA the kernel runs in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1 before it is imported); with CUDA the same checks run the compiled kernel on the
GPU. Interpreted sizes are kept small: each program tile runs as numpy in Python.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron_lev.kernels import lev_triton, register_default_kernels
from megatron_lev.lev import LEVConfig, LEVEmbedding, separable_product
from megatron_lev.lev import functional
from megatron_lev.arguments import build_parser

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, scope="module")
def _kernels():
    register_default_kernels()
REPO = Path(__file__).resolve().parents[2]


def _case(n, h, ds, kappa, r, seed=0, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, h, ds, generator=g, dtype=torch.float64)
    x[0, 0, : min(ds, 2)] = 0.0  # coordinates exactly 0 and 1 (the end knots)
    x[-1, -1, -1] = 1.0
    x[min(1, n - 1), 0, -1] = 1.0
    delta = scale * torch.randn(h, ds, kappa, r, generator=g, dtype=torch.float64)
    up = torch.randn(n, h, r, generator=g, dtype=torch.float64)
    return x, delta, up


def _run(basis, x, delta, up, kappa, dtype, device):
    xx = x.to(device=device, dtype=dtype).clone().requires_grad_()
    dd = delta.to(device=device, dtype=dtype).clone().requires_grad_()
    m = separable_product(xx, dd, kappa, basis=basis)
    (m * up.to(device=device, dtype=m.dtype)).sum().backward()
    return [t.detach().double().cpu() for t in (m, xx.grad, dd.grad)]


def _assert_close_scaled(got, want, rtol):
    for a, b, name in zip(got, want, ("M", "dL/dx", "dL/dDelta")):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.abs().max()), msg=name)


def test_kernel_is_registered_for_this_device():
    assert lev_triton.available()
    assert functional.has_fused_product(DEVICE, "triton")
    assert lev_triton.interpreted() == (DEVICE == "cpu")


# d_s, kappa, r, h not powers of two (masking), r and kappa below the 16-wide dot tile, N over
# several id tiles and not a multiple of the tile, N below one tile, one head.
@pytest.mark.parametrize("shape", [(5, 2, 3, 3, 2), (70, 3, 7, 5, 20), (40, 2, 9, 16, 64), (1, 1, 5, 7, 3),
                                   (37, 1, 6, 4, 5)])
def test_values_and_gradients_match_eager_fp64(shape):
    n, h, ds, kappa, r = shape
    x, delta, up = _case(*shape)
    want = _run("dense", x, delta, up, kappa, torch.float64, "cpu")
    got = _run("triton", x, delta, up, kappa, torch.float32, DEVICE)
    _assert_close_scaled(got, want, rtol=2e-5)


def _tiles(n, kappa, r):
    return -(-n // lev_triton._bwd_config(kappa, r)["BLOCK_N"])


# The backward's id partitions: several, the last one shorter (tiles not a multiple of P); and a
# single partition over many tiles, where the kernel writes dL/dDelta itself (as at the defaults).
@pytest.mark.parametrize("target, shape, parts", [(18, (6 * 32 + 3, 2, 3, 5, 6), 3),
                                                  (1, (3 * 32 + 1, 2, 3, 5, 6), 1)])
def test_backward_partitions_match_eager_fp64(monkeypatch, target, shape, parts):
    monkeypatch.setattr(lev_triton, "_TARGET_PROGRAMS", target)
    n, h, ds, kappa, r = shape
    block_n = lev_triton._bwd_config(kappa, r)["BLOCK_N"]
    p, per = lev_triton._partitions(n, h, ds, block_n)
    assert p == parts and (p == 1 or _tiles(n, kappa, r) % per != 0)
    x, delta, up = _case(*shape, seed=7)
    want = _run("dense", x, delta, up, kappa, torch.float64, "cpu")
    got = _run("triton", x, delta, up, kappa, torch.float32, DEVICE)
    _assert_close_scaled(got, want, rtol=2e-5)


def _grads(variant, x, delta, up, kappa):
    xx = x.to(device=DEVICE, dtype=torch.float32).requires_grad_()
    dd = delta.to(device=DEVICE, dtype=torch.float32).requires_grad_()
    m = lev_triton.triton_separable_product(xx, dd, kappa, backward=variant)
    (m * up.to(device=DEVICE, dtype=torch.float32)).sum().backward()
    return [t.detach().double().cpu() for t in (m, xx.grad, dd.grad)]


# The grouped backward against the reference and the fp64 eager product: several id partitions and a
# group of 2 dimensions with d_s odd (a masked dimension); an exact zero factor (logsum about -69:
# the direct form exp(logsum) / max(|phi|, log_eps)); a product below fp32's normal range (logsum about -92:
# the log form).
def _zero_factor():
    x, delta, up = _case(6, 2, 4, 5, 3, seed=1)
    delta[0, 1] = -1.0
    return x, delta, up, 5


def _underflow():
    x, delta, up = _case(8, 2, 40, 4, 3, seed=2, scale=0.01)  # 40 factors near 0.1 (head 1: -0.1 on half)
    delta -= 0.9
    delta[1, ::2] *= -1.0
    delta[1, ::2] -= 2.0
    return x, delta, up, 4


@pytest.mark.parametrize("case", ["partitions", "zero factor", "underflow"])
def test_grouped_backward_matches_the_reference(case):
    if case == "partitions":
        shape = (6 * 16 + 3, 2, 3, 5, 6)
        assert lev_triton._bwd_partitions(*shape, "grouped")[0] > 1
        x, delta, up = _case(*shape, seed=7)
        kappa, rtol = shape[3], 2e-5
    else:
        (x, delta, up, kappa), rtol = (_zero_factor() if case == "zero factor" else _underflow()), 1e-4
        _, logsum, _ = lev_triton._run_forward(x.float().permute(1, 2, 0).contiguous().to(DEVICE),
                                               delta.float().to(DEVICE), 1e-30)
        assert (float(logsum.min()) >= -lev_triton.DIRECT_LOG) == (case == "zero factor")  # the form tested
    want = _run("dense", x, delta, up, kappa, torch.float64, "cpu")
    ref = _grads("reference", x, delta, up, kappa)
    got = _grads("grouped", x, delta, up, kappa)
    assert torch.equal(got[0], ref[0])  # one forward kernel
    _assert_close_scaled(got, ref, rtol=1e-6)
    _assert_close_scaled(got, want, rtol=rtol)


def test_unknown_backward_variant_is_a_one_line_error():
    x, delta, _ = _case(4, 1, 2, 3, 2)
    with pytest.raises(ValueError, match="backward must be one of reference, grouped") as e:
        lev_triton.triton_separable_product(x.float(), delta.float(), 3, backward="fast")
    assert "\n" not in str(e.value)


def test_partitions_cover_the_tiles_and_are_sized_by_n():
    block_n = lev_triton._bwd_config(16, 64)["BLOCK_N"]
    assert lev_triton._partitions(4096, 8, 128, block_n) == (1, 4096 // block_n)  # defaults: no partials
    for n, h, ds in [(1, 1, 1), (33, 1, 3), (5000, 2, 7), (10**6, 1, 4), (10**6, 8, 128), (64, 4, 4)]:
        p, per = lev_triton._partitions(n, h, ds, block_n)
        tiles = -(-n // block_n)
        assert 1 <= p <= tiles and (p - 1) * per < tiles <= p * per  # no empty partition, all covered
        assert p * h * ds < lev_triton._TARGET_PROGRAMS + h * ds  # bounded whatever N is
    assert lev_triton._partitions(64, 1, 4, block_n)[0] == 2  # small N: at most one partition per tile


def test_launches_run_on_the_inputs_device():
    on = lev_triton._on_device(types.SimpleNamespace(device=torch.device("cuda", 1)))
    assert isinstance(on, torch.cuda.device) and on.idx == 1  # not the current device
    assert isinstance(lev_triton._on_device(torch.empty(1)), contextlib.nullcontext)


def test_zero_factor_gives_zero_product_and_the_product_of_the_others():
    x, delta, up = _case(6, 2, 4, 5, 3, seed=1)
    delta[0, 1] = -1.0  # S = 0 on every knot of (head 0, dim 1): phi = 0 exactly
    want = _run("dense", x, delta, up, 5, torch.float64, "cpu")
    got = _run("triton", x, delta, up, 5, torch.float32, DEVICE)
    assert torch.all(got[0][:, 0] == 0)
    assert torch.isfinite(got[1]).all() and torch.isfinite(got[2]).all()
    assert got[2][0, 1].abs().sum() > 0  # the zero factor's gradient does not vanish
    _assert_close_scaled(got, want, rtol=2e-5)


def test_long_product_near_fp32_underflow():
    # 60 factors near 1/4: |M| ~ 1e-36, next to fp32's smallest normal number (1.2e-38).
    x, delta, up = _case(8, 2, 60, 4, 3, seed=2, scale=0.01)
    delta -= 0.75
    delta[1, ::2] *= -1.0  # negative factors in head 1: the sign comes from the parity
    delta[1, ::2] -= 2.0
    want = _run("dense", x, delta, up, 4, torch.float64, "cpu")
    assert 1e-40 < float(want[0][:, 0].abs().max()) < 1e-33
    got = _run("triton", x, delta, up, 4, torch.float32, DEVICE)
    assert torch.equal(torch.sign(got[0]), torch.sign(want[0]))
    _assert_close_scaled(got, want, rtol=1e-4)


def test_backward_is_deterministic():
    # 3 heads over 3 id tiles: more than one partition of the dL/dDelta reduction.
    shape = (2 * lev_triton.BLOCK_N + 5, 3, 3, 6, 7)
    assert lev_triton._partitions(*shape[:3], lev_triton._bwd_config(6, 7)["BLOCK_N"])[0] > 1
    x, delta, up = _case(*shape, seed=3)
    first = _run("triton", x, delta, up, 6, torch.float32, DEVICE)
    second = _run("triton", x, delta, up, 6, torch.float32, DEVICE)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_bf16_parameters_use_the_fp32_product():
    x, delta, up = _case(12, 2, 6, 5, 4, seed=4)
    xb, db = x.bfloat16().double(), delta.bfloat16().double()  # the values bf16 can hold
    want = _run("dense", xb, db, up, 5, torch.float64, "cpu")
    xx = xb.to(device=DEVICE, dtype=torch.bfloat16).requires_grad_()
    dd = db.to(device=DEVICE, dtype=torch.bfloat16).requires_grad_()
    m = separable_product(xx, dd, 5, basis="triton")
    assert m.dtype == torch.float32
    (m * up.to(device=DEVICE, dtype=torch.float32)).sum().backward()
    assert xx.grad.dtype == torch.bfloat16 and dd.grad.dtype == torch.bfloat16
    torch.testing.assert_close(m.double().cpu(), want[0], rtol=2e-5, atol=2e-5 * float(want[0].abs().max()))
    for a, b in ((xx.grad, want[1]), (dd.grad, want[2])):  # gradients rounded to bf16 (8 bits)
        torch.testing.assert_close(a.double().cpu(), b, rtol=1e-2, atol=1e-2 * float(b.abs().max()))


@pytest.mark.parametrize("mode", ["token", "unique", "table"])
def test_layer_with_kernel_matches_fp64_eager_layer(mode):
    kw = dict(seed_dim=8, num_knots=5, rank=4, num_heads=2, compute_mode=mode)
    ref = LEVEmbedding(300, 16, LEVConfig(basis="dense", **kw), dtype=torch.float64)
    lev = LEVEmbedding(300, 16, LEVConfig(basis="triton", **kw), init_statistics=False, device=DEVICE)
    lev.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    ids = torch.randint(0, 300, (3, 7), generator=torch.Generator().manual_seed(5))
    up = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    outs = []
    for m, dev in ((ref, "cpu"), (lev, DEVICE)):
        out = m(ids.to(dev))
        (out * up.to(device=dev, dtype=out.dtype)).sum().backward()
        if mode == "table":
            m.finish_table_step()
        outs.append(out.detach().double().cpu())
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5 * float(outs[0].abs().max()))
    for (name, pr), pl in zip(ref.named_parameters(), lev.parameters()):
        want, got = pr.grad, pl.grad.double().cpu()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()), msg=name)


def test_auto_picks_triton_on_cuda_and_the_flag_accepts_it(monkeypatch):
    monkeypatch.setitem(functional._FUSED_PRODUCTS, ("triton", "cuda"), lev_triton.triton_separable_product)
    assert LEVConfig().resolved_basis("cuda") == "triton"
    assert LEVConfig(basis="sparse").resolved_basis("cuda") == "sparse"
    assert LEVConfig().resolved_basis("cpu") == "fused"  # the numba kernel stays the CPU default
    LEVConfig(basis="triton").validate(300)
    assert build_parser().parse_args(["--lev-basis", "triton"]).lev_basis == "triton"


def test_forced_triton_without_a_kernel_is_a_one_line_error():
    x = torch.empty(4, 2, 3, device="meta")
    delta = torch.empty(2, 3, 5, 4, device="meta")
    with pytest.raises(ValueError, match="--lev-basis triton: no Triton kernel for meta tensors") as e:
        separable_product(x, delta, 5, basis="triton")
    assert "\n" not in str(e.value)


@pytest.mark.gpu
def test_kernel_timing_on_gpu(tmp_path):
    """Times the compiled kernel at a small shape through the benchmark (no timed assertion)."""
    out = tmp_path / "kernel.json"
    cmd = [sys.executable, str(REPO / "bench" / "lev_layer.py"), "--device", "cuda", "--kernel-only",
           "--kernel-hidden", "1024", "--kernel-ids", "4096", "--json", str(out)]
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run(cmd, check=True, cwd=REPO, env=env)
    import json

    rows = json.loads(out.read_text())["kernel"]["rows"]
    assert rows and all(r["triton_fwd_ms_per_1k"] > 0 and r["triton_bwd_ms_per_1k"] > 0 for r in rows)


def test_kernel_benchmark_table_runs_and_says_when_no_gpu_figure_exists(capsys):
    sys.path.insert(0, str(REPO / "bench"))
    import lev_layer

    if DEVICE == "cpu":  # the default CPU run reports plainly that there is no GPU figure
        r = {"kernel": {"rows": [], "note": "no GPU figure exists: this run had no CUDA device"}}
        lev_layer._report_kernel(r)
        assert "no GPU figure exists" in capsys.readouterr().out
    tcfg = lambda D: __import__("megatron.core.transformer", fromlist=["x"]).TransformerConfig(  # noqa: E731
        num_layers=1, hidden_size=D, num_attention_heads=1, use_cpu_initialization=True)
    from megatron_lev.distributed import destroy_distributed

    setup = lev_layer._init_parallel(DEVICE)  # VocabParallelEmbedding needs megatron's groups
    try:
        k = lev_layer.kernel_table(60, torch.float32, 1, tcfg, hidden=(8,), n_ids=(40,), device=DEVICE,
                                   lev_kw=dict(seed_dim=4, num_knots=4, rank=3, num_heads=2))
    finally:
        destroy_distributed(setup)
    (row,) = k["rows"]
    assert row["hidden"] == 8 and row["ids"] == 40
    for key in ("triton", "sparse", "table"):
        assert row[f"{key}_fwd_ms_per_1k"] > 0 and row[f"{key}_bwd_ms_per_1k"] > 0
    lev_layer._report_kernel({"kernel": k, "dtype": "float32", "vocab": 60})
    assert "speed-up" in capsys.readouterr().out
