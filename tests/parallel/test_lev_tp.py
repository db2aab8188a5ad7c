"""Tensor-parallel LEV embedding on gloo ranks: TP = 1, 2, 4, with and without sequence parallelism.

One 4-rank launch runs every TP size in turn, in float64 so that "equal" can be tested tightly (the
fp32 product of d_s factors and the LayerNorm backward leave ~1e-5 of rounding noise); each rank
checks, against the pure-torch layer holding the gathered weights: forward values, every parameter's
gradient (gathered), the three compute modes (run by the pure layer's ``ComputeModes`` in both
layers), materialize(), the sharded-state-dict layout, and that the fused kernels are registered by
building the layer, not by importing it. The TP sizes' initial functions are compared with each other.
"""

from __future__ import annotations

import pytest
import torch

from megatron_lev.testing import run_distributed

V, D, B, S = 997, 32, 2, 12
LEV_KW = dict(num_digits=3, seed_dim=8, num_knots=5, rank=4, num_heads=4, chunk_size=256)
SEED = 1234  # megatron's RNG tracker, as run_distributed seeds it


def _ids():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V, (B, S), generator=g)
    ids[0, :3] = ids[1, :3]  # repeated ids exercise the unique/table paths
    return ids


def _upstream():
    return torch.randn(S, B, D, generator=torch.Generator().manual_seed(11), dtype=torch.float64)


def _tp_gather(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    world = torch.distributed.get_world_size(group)
    if world == 1:
        return t.clone()
    parts = [torch.empty_like(t) for _ in range(world)]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _build(mode: str, sequence_parallel: bool):
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    from megatron_lev.lev import LEVConfig
    from megatron_lev.parallel.lev_embedding import LEVParallelEmbedding

    tp = parallel_state.get_tensor_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=1, hidden_size=D, num_attention_heads=4, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel, init_method_std=0.02,
        params_dtype=torch.float64,
    )
    torch.manual_seed(1234)  # the same CPU stream on every rank, as Megatron's CPU initialisation
    return LEVParallelEmbedding(
        config=config, lev_config=LEVConfig(compute_mode=mode, **LEV_KW), vocab_size=V,
        reduce_scatter_embeddings=sequence_parallel,
    )


def _full_params(module) -> dict:
    """Every parameter gathered over TP (heads concatenated on dim 0)."""
    out = {}
    for name, p in module.named_parameters():
        out[name] = _tp_gather(p.detach(), 0) if getattr(p, "tensor_model_parallel", False) else p.detach().clone()
    return out


def _full_grads(module, sequence_parallel: bool) -> dict:
    from megatron.core import parallel_state

    out = {}
    for name, p in module.named_parameters():
        g = p.grad.detach().clone()
        if getattr(p, "tensor_model_parallel", False):
            g = _tp_gather(g, 0)
        elif sequence_parallel and getattr(p, "sequence_parallel", False):
            # What finalize_model_grads does for sequence-parallel replicated parameters.
            torch.distributed.all_reduce(g, group=parallel_state.get_tensor_model_parallel_group())
        out[name] = g
    return out


def _reference(params: dict):
    """The pure-torch layer with the gathered weights (no Megatron involved)."""
    from megatron_lev.lev import LEVConfig, LEVEmbedding

    ref = LEVEmbedding(V, D, LEVConfig(compute_mode="token", **LEV_KW), init_statistics=False)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(params[name])
    return ref


def _run_case(mode: str, sequence_parallel: bool):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    ids, up = _ids(), _upstream()
    module = _build(mode, sequence_parallel)
    params = _full_params(module)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()

    if mode == "table":
        module.begin_table_step()
    out = module(ids)
    local_up = up.chunk(tp, dim=0)[tp_rank] if sequence_parallel else up
    (out * local_up).sum().backward()
    if mode == "table":
        module.finish_table_step()
    if sequence_parallel:
        assert out.shape == (S // tp, B, D)
        out = gather_from_sequence_parallel_region(out.detach(), tensor_parallel_output_grad=False)
    grads = _full_grads(module, sequence_parallel)

    ref = _reference(params)
    ref_out = ref(ids).transpose(0, 1)
    (ref_out * up).sum().backward()
    torch.testing.assert_close(out.detach(), ref_out.detach(), atol=1e-10, rtol=1e-8)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-10, rtol=1e-8, msg=lambda m: f"{name}: {m}")
    return module, out.detach(), grads


def _tp_checks():
    from megatron.core import parallel_state

    from megatron_lev.kernels import lev_cpu
    from megatron_lev.lev import functional
    from megatron_lev.lev.layer import ComputeModes

    torch.set_default_dtype(torch.float64)

    # Building the layer registers the fused kernels (explicitly; see the fresh-rank check below).
    _build("unique", False)
    assert functional.has_fused_product("cpu") == lev_cpu.available()

    # The compute modes are the pure layer's ComputeModes, evaluating this rank's partial sums.
    modes_seen = []
    call = ComputeModes.__call__

    def recording_call(self, ids, fn, device):
        modes_seen.append(self.config.compute_mode)
        return call(self, ids, fn, device)

    ComputeModes.__call__ = recording_call
    tp = parallel_state.get_tensor_model_parallel_world_size()
    results = {}
    try:
        for mode in ("token", "unique", "table"):
            for sp in ((False, True) if tp > 1 else (False,)):
                module, out, grads = _run_case(mode, sp)
                results[(mode, sp)] = (out, grads)
    finally:
        ComputeModes.__call__ = call
    # Each case: one call from the parallel layer, then one from the pure reference layer ("token").
    assert modes_seen == [m for mode, _ in results for m in (mode, "token")], modes_seen
    # Compute modes agree with each other (values and gradients).
    base_out, base_grads = results[("token", False)]
    for key, (out, grads) in results.items():
        torch.testing.assert_close(out, base_out, atol=1e-10, rtol=1e-8)
        for name in base_grads:
            torch.testing.assert_close(grads[name], base_grads[name], atol=1e-10, rtol=1e-8)

    # materialize(): the rows equal the layer's output, on every TP rank.
    module = _build("unique", False)
    table = module.materialize()
    ids = _ids()
    with torch.no_grad():
        out = module(ids).transpose(0, 1)
    torch.testing.assert_close(table[ids], out, atol=1e-10, rtol=1e-8)

    # Ids outside [0, V) are an error, never clamped.
    for bad in (V, -1):
        with pytest.raises(ValueError, match=r"outside \[0, 997\)"):
            module(torch.tensor([[0, bad]]))

    # Checkpoint layout: heads sharded on dim 0 across TP, codebooks and offset replicated.
    sd = module.sharded_state_dict(prefix="embedding.")
    delta = sd["embedding.heads.delta"]
    assert delta.global_shape[0] == LEV_KW["num_heads"] and delta.local_shape[0] == LEV_KW["num_heads"] // tp
    assert sd["embedding.seed.codebooks"].global_shape == sd["embedding.seed.codebooks"].local_shape
    return {"table": table, "init_params": _full_params(_build("unique", False))}


def _tp_checks_at_every_size():
    """``_tp_checks`` at TP = 4, 2 and 1 in one launch (a launch costs seconds of imports; re-creating
    megatron's groups does not), each seeded as a launch of its own would be. At TP = 2 and 1 the other
    data-parallel replicas run the same checks side by side."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_lev.lev import functional
    from megatron_lev.parallel import lev_embedding  # noqa: F401  (imported, not yet built)

    # A fresh rank: importing the layer registers no kernel; building it does (checked in _tp_checks).
    assert functional._FUSED_PRODUCTS == {}, functional._FUSED_PRODUCTS
    out = {}
    for tp in (4, 2, 1):
        if tp != parallel_state.get_tensor_model_parallel_world_size():
            parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        torch.manual_seed(SEED)
        model_parallel_cuda_manual_seed(SEED)
        out[tp] = _tp_checks()
    return out


@pytest.fixture(scope="module")
def tp_results():
    # fresh: the body checks that importing the layer registers no kernel, which only a new process shows
    # (a reused rank holds what earlier jobs' layers registered).
    return run_distributed(_tp_checks_at_every_size, world_size=4, tp=4, seed=SEED, fresh=True)[0]


def test_tp_matches_pure_layer_and_modes_agree(tp_results):
    # Each launch asserted forward/gradient equality with the pure layer on every rank.
    assert set(tp_results) == {1, 2, 4}


def test_same_initial_function_for_every_tp_layout(tp_results):
    ref = tp_results[1]
    for tp in (2, 4):
        torch.testing.assert_close(tp_results[tp]["table"], ref["table"], atol=1e-10, rtol=1e-8)
        for name, p in ref["init_params"].items():
            torch.testing.assert_close(tp_results[tp]["init_params"][name], p, atol=1e-10, rtol=1e-8)
