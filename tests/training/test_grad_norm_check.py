"""The step's NaN/Inf check on the gradients rides on the grad norm megatron-core's optimizer computes anyway:
the gradients are read once per step, and a NaN or Inf in one rank's gradients still stops every rank (or
skips the step on every rank with ``--nan-action skip``) before any parameter changes.

One two-rank job (data-parallel 2) trains a one-layer model through the loop's own step for each optimizer
setting: fp32 (megatron DDP, the optimizer not sharded), the distributed optimizer in bf16, clipping off, bf16
with a constant loss scale (megatron's found-inf path) and fp16 (its dynamic loss scale skips the step
itself). A NaN is written into rank 1's local gradients before the data-parallel reduction.
"""

from __future__ import annotations

import dataclasses

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lev.testing import run_distributed

NORM_OPS = {"linalg_vector_norm", "norm", "_foreach_norm", "frobenius_norm"}

SETTINGS = {
    "fp32": dict(),
    "distributed-bf16": dict(use_distributed_optimizer=True, bf16=True),
    "no-clip": dict(clip_grad=0.0),
    "bf16-loss-scale": dict(bf16=True, loss_scale=1024.0),
    "fp16": dict(fp16=True, initial_loss_scale=1024.0),
}


class _NormReads(TorchDispatchMode):
    """How many tensor elements norm reductions read."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if func._schema.name.split("::")[-1] in NORM_OPS:
            first = args[0]
            self.elements += sum(t.numel() for t in (first if isinstance(first, (list, tuple)) else [first]))
        return func(*args, **(kwargs or {}))


def _setup(setting: str):
    from megatron.core import parallel_state as ps

    from megatron_lev.models.factory import build_model_chunks
    from megatron_lev.models import build_transformer_config
    from megatron_lev.training import loop
    from tests.moe._harness import GLOBAL_MICRO, HEADS, HIDDEN, loop_args, loop_run_config, model_config

    over = SETTINGS[setting]
    mc = model_config("tied")
    config = build_transformer_config(mc, megatron_ddp=True, num_layers=1, hidden_size=HIDDEN,
                                      num_attention_heads=HEADS, ffn_hidden_size=128, hidden_dropout=0.0,
                                      attention_dropout=0.0, bf16=over.get("bf16", False),
                                      fp16=over.get("fp16", False))
    num_micro = GLOBAL_MICRO // ps.get_data_parallel_world_size()
    args = loop_args(distributed_optimizer=over.get("use_distributed_optimizer", False), overlap=False,
                     num_microbatches=num_micro)
    for k, v in over.items():
        setattr(args, k, v)
    rc = loop_run_config(args)
    model = loop._wrap_model(rc, config, build_model_chunks(config, mc))
    optimizer, scheduler = loop._build_optimizer(rc, config, model)
    loop._configure_hooks(rc, config, model, optimizer, [])
    run = SimpleNamespace(rc=rc, config=config, model=model, optimizer=optimizer, scheduler=scheduler,
                          state=loop._State(), poison=False)
    finalize = config.finalize_model_grads_func

    def poisoned_finalize(*a, **kw):
        # This rank's own backward produced a NaN: written before the data-parallel reduction.
        if run.poison and torch.distributed.get_rank() == 1:
            next(model[0].parameters()).main_grad.view(-1)[0] = float("nan")
        return finalize(*a, **kw)

    config.finalize_model_grads_func = poisoned_finalize
    return run


def _params(run):
    return [p.detach().clone() for chunk in run.model for p in chunk.parameters()]


def _step(run):
    from megatron_lev.training import loop
    from tests.moe._harness import my_batches

    return loop._train_step(run.rc, run.state, run.model, run.optimizer, run.scheduler,
                            iter(my_batches(run.state.iteration)), [])


def _check_setting(setting: str):
    from megatron_lev.training import loop

    run = _setup(setting)
    out = {}
    with _NormReads() as reads:
        loss, grad_norm, ok, got_nan = _step(run)
    assert ok and not got_nan and grad_norm is not None and grad_norm > 0, (setting, grad_norm, ok)
    run.state.iteration += 1
    out["norm_reads"] = reads.elements
    from megatron.core.optimizer import clip_grads

    out["l2_norm_impl"] = clip_grads.l2_norm_impl.__name__
    out["grad_elements"] = sum(b.grad_data.numel() for chunk in run.model for b in chunk.buffers)

    run.poison = True
    for action in ("stop", "skip"):
        run.rc = dataclasses.replace(run.rc, run=dataclasses.replace(run.rc.run, nan_action=action))
        before = _params(run)
        try:
            out[action] = _step(run)[1:]
        except loop.NanDetected as e:
            out[action] = str(e)
        out[f"{action}_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _params(run)))
    return out


def _all_settings():
    return {s: _check_setting(s) for s in SETTINGS}


@pytest.fixture(scope="module")
def checked():
    return run_distributed(_all_settings, world_size=2)


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s != "fp16"])
def test_gradients_are_read_once_and_a_nan_on_one_rank_stops_or_skips_every_rank(checked, setting):
    for rank, results in enumerate(checked):
        r = results[setting]
        # One pass over the gradients (megatron's grad norm): the NaN check reads none of its own.
        assert r["norm_reads"] <= 1.05 * r["grad_elements"], (rank, setting, r["norm_reads"], r["grad_elements"])
        assert r["l2_norm_impl"] == "device_multi_tensor_l2_norm", r  # no TE or Apex here: the loop's stand-in
        assert r["stop"] == "NaN/Inf in the gradients at iteration 2 (--check-for-nan-in-loss-and-grad)", (rank, r)
        assert r["skip"] == (None, False, True), (rank, r)
        assert r["stop_unchanged"] and r["skip_unchanged"], (rank, setting)


def test_fp16_leaves_a_nan_step_to_its_loss_scaler(checked):
    for results in checked:
        r = results["fp16"]
        assert r["norm_reads"] <= 1.05 * r["grad_elements"]
        # megatron's dynamic loss scaler finds the Inf/NaN and skips the update (not a NaN stop).
        assert r["stop"] == r["skip"] == (None, False, False), r
        assert r["stop_unchanged"] and r["skip_unchanged"]


# ------------------------------------------------------------------------- which step method is checked


class _Lone:
    """A single Float16/FP32/distributed optimizer as the check sees it."""

    def __init__(self, clip_grad: float, norm=1.0, found_inf: bool = False):
        self.config = SimpleNamespace(clip_grad=clip_grad)
        self.norm, self.found_inf = norm, found_inf

    def prepare_grads(self):
        return self.found_inf

    def clip_grad_norm(self, clip_grad):
        return self.norm


def _chained(norm):
    from megatron.core.optimizer import ChainedOptimizer

    opt = object.__new__(ChainedOptimizer)  # only the methods the check wraps
    opt.get_grad_norm, opt.prepare_grads = (lambda: norm), (lambda: False)
    return opt


_DENSE = SimpleNamespace()  # a TransformerConfig without mtp_detach_heads


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), torch.tensor(float("nan"))])
def test_the_norm_step_computes_is_the_check(bad):
    from megatron_lev.compat.optimizer import NonFiniteGrads, check_grads_in_step, grads_checked_in_step

    chained = _chained(bad)
    assert check_grads_in_step(chained, _DENSE) and grads_checked_in_step(chained)
    with pytest.raises(NonFiniteGrads):
        chained.get_grad_norm()
    lone = _Lone(clip_grad=1.0, norm=bad)
    assert check_grads_in_step(lone, _DENSE)
    with pytest.raises(NonFiniteGrads):
        lone.clip_grad_norm(1.0)
    # A finite norm goes on to megatron's clipping as the host float (0.19 may compute a device tensor).
    lone = _Lone(clip_grad=1.0, norm=torch.tensor(2.5))
    check_grads_in_step(lone, _DENSE)
    assert check_grads_in_step(lone, _DENSE)  # installed once
    assert lone.clip_grad_norm(1.0) == 2.5 and type(lone.clip_grad_norm(1.0)) is float


def test_a_grad_scalers_found_inf_is_the_check():
    from megatron_lev.compat.optimizer import NonFiniteGrads, check_grads_in_step

    lone = _Lone(clip_grad=1.0, found_inf=True)
    check_grads_in_step(lone, _DENSE)
    with pytest.raises(NonFiniteGrads):
        lone.prepare_grads()


def test_a_step_without_a_norm_over_every_gradient_leaves_the_check_to_the_loop():
    from megatron_lev.compat.optimizer import check_grads_in_step, grads_checked_in_step

    lone = _Lone(clip_grad=0.0, norm=float("nan"))
    assert not check_grads_in_step(lone, _DENSE) and not grads_checked_in_step(lone)
    assert lone.clip_grad_norm(0.0) != lone.clip_grad_norm(0.0)  # untouched (NaN)
    chained = _chained(float("nan"))
    assert not check_grads_in_step(chained, SimpleNamespace(mtp_detach_heads=True))
    assert not grads_checked_in_step(chained)


# ------------------------------------------------- the gradients megatron's norm leaves out (TP duplicates)


class _TpGroup:
    def __init__(self, rank: int):
        self._rank = rank

    def rank(self):
        return self._rank


def _tp_optimizer(tp_rank: int, nan_in=None):
    """A megatron FP32Optimizer (only what its grad norm reads) over a tensor-parallel weight, a replicated
    LayerNorm-like weight (a duplicate on every tensor-parallel rank) and a ``shared`` one."""
    from megatron.core.optimizer import ChainedOptimizer, FP32Optimizer, OptimizerConfig

    params = {name: torch.nn.Parameter(torch.ones(4)) for name in ("parallel", "replicated", "shared")}
    params["parallel"].tensor_model_parallel = True
    params["shared"].shared = True
    for name, p in params.items():
        p.grad = torch.full((4,), 0.5)
        if name == nan_in:
            p.grad[1] = float("nan")
    sub = object.__new__(FP32Optimizer)  # only the state get_grad_norm reads
    sub.optimizer = torch.optim.SGD(list(params.values()), lr=1.0)
    sub.config = OptimizerConfig(clip_grad=1.0)
    sub.tp_group, sub.grad_stats_parallel_group = _TpGroup(tp_rank), None
    chained = object.__new__(ChainedOptimizer)
    chained.chained_optimizers = [sub]
    chained.prepare_grads = lambda: False
    return chained, sub


def _grads_for_norm(sub):
    name = "get_grads_for_grad_norm" if hasattr(sub, "get_grads_for_grad_norm") else "get_main_grads_for_grad_norm"
    return getattr(sub, name)()


def _sum_of_squares(grads):
    return sum(float(g.float().pow(2).sum()) for g in grads)


def test_a_nan_only_in_a_replicated_gradient_on_tensor_parallel_rank_1_poisons_the_norm(monkeypatch):
    from megatron.core.optimizer import optimizer as megatron_optimizer

    from megatron_lev.compat.optimizer import NonFiniteGrads, check_grads_in_step

    # The norm's reduction without a process group: this rank's own sum of squares.
    monkeypatch.setattr(megatron_optimizer, "get_grad_norm_fp32",
                        lambda grads, **kw: _sum_of_squares(grads) ** 0.5)
    finite = {}
    for tp_rank in (0, 1):
        chained, sub = _tp_optimizer(tp_rank)
        assert check_grads_in_step(chained, _DENSE)
        grads = _grads_for_norm(sub)
        # The left-out gradients (the shared one; on rank 1 the replicated one too) add one 0 to the norm.
        assert len(grads) == (3 if tp_rank == 0 else 2) and grads[-1].tolist() == [0.0], (tp_rank, grads)
        assert grads[-1].dtype == torch.float32
        finite[tp_rank] = _sum_of_squares(grads)
        assert chained.get_grad_norm() == pytest.approx(finite[tp_rank] ** 0.5)
    assert finite == {0: pytest.approx(2.0), 1: pytest.approx(1.0)}  # megatron's counting, unchanged

    # A NaN in the replicated weight's gradient on TP rank 1 only: megatron's norm does not see it there, the
    # marker does; reduced over the model-parallel ranks, the norm is NaN on both and both refuse the step.
    chained, sub = _tp_optimizer(1, nan_in="replicated")
    assert _sum_of_squares(_grads_for_norm(sub)) == pytest.approx(1.0)  # megatron's own norm misses it
    assert check_grads_in_step(chained, _DENSE)
    poisoned = _sum_of_squares(_grads_for_norm(sub))
    assert poisoned != poisoned  # NaN
    reduced = finite[0] + poisoned  # the model-parallel reduction (rank 0's gradients are finite)
    assert reduced != reduced
    with pytest.raises(NonFiniteGrads):
        chained.get_grad_norm()
    # A NaN only in a shared parameter's gradient, on any rank.
    chained, sub = _tp_optimizer(0, nan_in="shared")
    check_grads_in_step(chained, _DENSE)
    with pytest.raises(NonFiniteGrads):
        chained.get_grad_norm()


# ------------------------------------------------------------------- the grad norm without TE or Apex


def test_the_grad_norm_stand_in_matches_megatrons_and_reads_nothing_on_the_host(monkeypatch, request):
    """megatron's stand-in for the fused L2 norm (no TE, no Apex) reads each gradient's norm on the host: a
    host sync per gradient tensor on a GPU. The loop's replacement computes the same norm on the device:
    on the meta device, where any host read fails, it runs and megatron's does not."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    from megatron_lev import compat
    from megatron_lev.compat.optimizer import device_multi_tensor_l2_norm, keep_grad_norm_on_device

    if not compat.is_applied() and compat.apply():  # megatron's stand-in puts its result on "cuda": the CPU here
        request.addfinalizer(compat.remove)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(7, 5, generator=g), torch.randn(300, generator=g).bfloat16(), torch.randn(1, generator=g)]
    flag = torch.zeros(1, dtype=torch.int)
    want, _ = utils.local_multi_tensor_l2_norm(2048, flag, [grads], False)
    got, none = device_multi_tensor_l2_norm(2048, flag, [grads], False)
    assert none is None and got.shape == (1,) and got.dtype == torch.float32
    truth = torch.cat([t.double().flatten() for t in grads]).norm()
    assert abs(got.item() - truth.item()) < 1e-6 * truth.item()  # fp32 norms of the bf16 gradient too
    assert torch.allclose(got, want.to(got.device), rtol=1e-3)  # megatron's takes the bf16 one in bf16
    with pytest.raises(NotImplementedError, match="per-tensor"):
        device_multi_tensor_l2_norm(2048, flag, [grads], True)
    empty, _ = device_multi_tensor_l2_norm(2048, flag, [[]], False)
    assert empty.tolist() == [0.0]

    meta = [t.to("meta") for t in grads]
    assert device_multi_tensor_l2_norm(2048, flag.to("meta"), [meta], False)[0].device.type == "meta"
    with pytest.raises(RuntimeError, match=r"item\(\) cannot be called on meta"):  # its host reads
        utils.local_multi_tensor_l2_norm(2048, flag, [meta], False)

    monkeypatch.setattr(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm)
    assert keep_grad_norm_on_device() and clip_grads.l2_norm_impl is device_multi_tensor_l2_norm
    assert keep_grad_norm_on_device()  # once

    def fused(*args):  # Transformer Engine's or Apex's kernel: kept
        raise AssertionError

    monkeypatch.setattr(clip_grads, "l2_norm_impl", fused)
    assert not keep_grad_norm_on_device() and clip_grads.l2_norm_impl is fused


def test_the_multi_tensor_scale_stand_in_equals_megatrons_in_two_launches(monkeypatch):
    """megatron's stand-in for amp_C.multi_tensor_scale (no TE, no Apex) multiplies and copies per tensor; the
    loop's replacement gives the same values bit for bit (fp32 shards into bf16 parameters, in-place clipping)
    in foreach operators."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    from megatron_lev.compat.optimizer import device_multi_tensor_scale, keep_multi_tensor_scale_batched

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    src = [torch.randn(n, generator=g) * 3 for n in (7, 300, 1, 4097)]
    flag = torch.zeros(1, dtype=torch.int)
    for scale in (1.0, 0.3721):
        want = [torch.zeros(len(t), dtype=torch.bfloat16) for t in src]
        got = [w.clone() for w in want]
        utils.local_multi_tensor_scale(2048, flag, [src, want], scale)
        with Ops() as ops:
            device_multi_tensor_scale(2048, flag, [src, got], scale)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), scale
        assert len(ops.names) <= 2, ops.names
        # in place, as clipping calls it
        want = [t.clone() for t in src]
        got = [t.clone() for t in src]
        utils.local_multi_tensor_scale(2048, flag, [want, want], scale)
        device_multi_tensor_scale(2048, flag, [got, got], scale)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), scale
    device_multi_tensor_scale(2048, flag, [[], []], 0.5)

    for module in (clip_grads, megatron_optimizer):
        monkeypatch.setattr(module, "multi_tensor_scale_impl", utils.local_multi_tensor_scale)
    assert keep_multi_tensor_scale_batched()
    assert clip_grads.multi_tensor_scale_impl is megatron_optimizer.multi_tensor_scale_impl is device_multi_tensor_scale

    def fused(*args):  # Transformer Engine's or Apex's kernel: kept
        raise AssertionError

    for module in (clip_grads, megatron_optimizer):
        monkeypatch.setattr(module, "multi_tensor_scale_impl", fused)
    assert not keep_multi_tensor_scale_batched() and clip_grads.multi_tensor_scale_impl is fused
