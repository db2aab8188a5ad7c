"""The checkpoint writers' result queue lives in the rank (checkpoint.sharded._install_write_queue).

Saves are synchronous, so the writer's results never leave the rank: megatron-core's default spawn-based
manager queue would start an interpreter per rank (importing torch to unpickle the results), outlive a
killed rank and could keep one from exiting."""

from __future__ import annotations

import multiprocessing as mp
import queue

import torch

from megatron_lev.testing import run_distributed


def test_the_queue_is_installed_in_process_once(monkeypatch):
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    from megatron_lev.checkpoint.sharded import _install_write_queue

    monkeypatch.setattr(fa, "_results_queue", None)
    before = set(mp.active_children())
    _install_write_queue()
    installed = fa._results_queue
    assert isinstance(installed, queue.Queue)
    _install_write_queue()
    assert fa._results_queue is installed, "a second save must keep the queue (results of a save in flight)"
    assert set(mp.active_children()) == before, "installing the queue must start no process"


def _save_and_reload(ckpt_dir: str):
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    from megatron_lev.checkpoint.sharded import _install_write_queue, _save_strategy

    rank = parallel_state.get_data_parallel_rank()
    world = parallel_state.get_data_parallel_world_size()
    local = torch.arange(6.0).reshape(2, 3) + 10 * rank

    def state(t):
        return {"w": ShardedTensor.from_rank_offsets("w", t, (0, rank, world), replica_id=0)}

    # A pooled rank may have run another test's plain dist_checkpointing.save (megatron-core's manager
    # queue, whose process stays): start from no queue and count only what this save leaves.
    fa._results_queue = None
    before = {p.pid for p in mp.active_children()}
    _install_write_queue()
    dist_checkpointing.save(state(local), ckpt_dir, sharded_strategy=_save_strategy())
    lingering = [p.name for p in mp.active_children() if p.pid not in before]
    loaded = dist_checkpointing.load(state(torch.zeros(2, 3)), ckpt_dir)["w"]
    return lingering, torch.equal(loaded, local)


def test_a_sharded_save_leaves_no_process_behind_and_reloads(tmp_path):
    (tmp_path / "ckpt").mkdir()
    results = run_distributed(_save_and_reload, world_size=2, args=(str(tmp_path / "ckpt"),))
    for rank, (lingering, equal) in enumerate(results):
        assert lingering == [], f"rank {rank}: processes left after the save: {lingering}"
        assert equal, f"rank {rank}: the reloaded shard differs from the saved one"
