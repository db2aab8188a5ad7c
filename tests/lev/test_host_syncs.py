"""The LEV layer's forward and backward do not block the host on an accelerator.

On ``meta`` (the accelerator's branches, no data) a token-mode micro-batch and a table-mode micro-batch
record no host sync and no host-to-device copy; the syncs that remain are data-dependent by nature and
counted on the CPU: unique mode's ``torch.unique`` (one per forward) and table mode's list of the ids
seen (one per optimizer step, in ``finish_table_step``).
"""

from __future__ import annotations

import pytest
import torch

from megatron_lev.lev import LEVConfig, LEVEmbedding
from tests.host_syncs import HostSyncs


def _emb(mode, device="cpu", **kw):
    cfg = LEVConfig(compute_mode=mode, seed_dim=8, num_heads=2, rank=4, num_knots=6, chunk_size=128, **kw)
    return LEVEmbedding(300, 16, cfg, init_statistics=False).to(device)


@pytest.mark.parametrize("basis", ["sparse", "dense"])
def test_token_mode_micro_batch_has_no_host_sync_on_an_accelerator(basis):
    emb = _emb("token", "meta", basis=basis)
    ids = torch.randint(0, 300, (2, 7)).to("meta")
    with HostSyncs() as s:
        out = emb(ids)
        out.sum().backward()
    assert s.events == []
    assert emb.heads.delta.grad is not None and emb.heads.delta.grad.device.type == "meta"


def test_table_mode_build_and_micro_batches_have_no_host_sync_on_an_accelerator():
    emb = _emb("table", "meta", basis="sparse")
    batches = [torch.randint(0, 300, (2, 7)).to("meta") for _ in range(2)]
    with HostSyncs() as s:
        emb.begin_table_step()  # G over all 300 ids, in 3 chunks
        for ids in batches:
            out = emb(ids)
            out.sum().backward()
    assert s.events == []
    assert emb.table.device.type == "meta"


def test_the_data_dependent_syncs_that_remain():
    ids = torch.randint(0, 300, (2, 7))
    unique = _emb("unique")
    with HostSyncs() as s:
        unique(ids).sum().backward()
    assert s.events.count("_unique2") == 1
    table = _emb("table")
    out = table(ids)
    out.sum().backward()
    with HostSyncs() as s:
        table.finish_table_step()
    assert s.events.count("nonzero") == 1


@pytest.mark.cuda_build
@pytest.mark.parametrize("mode", ["token", "table"])
def test_micro_batches_on_fake_cuda_copy_nothing_to_the_device(mode):
    """On fake CUDA tensors, where a CPU scalar written into a CUDA tensor shows as a CPU tensor (on
    ``meta`` the scalar is created on meta, so only this catches it)."""
    from tests.fake_cuda import fake_cuda

    emb = _emb(mode, basis="sparse")
    batches = [torch.randint(0, 300, (2, 7)) for _ in range(2)]
    with fake_cuda() as fm:
        emb = emb.to("cuda")
        batches = [fm.from_tensor(b).to("cuda") for b in batches]
        if mode == "table":
            emb.begin_table_step()
        with HostSyncs() as s:
            for ids in batches:
                emb(ids)
    assert s.events == []
