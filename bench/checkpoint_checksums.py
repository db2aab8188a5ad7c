"""What checkpoint checksums cost: save and load time with and without them, in the same run.

    python bench/checkpoint_checksums.py [--mib 1024] [--repeats 3] [--dir /tmp]

One process (gloo, world 1) saves a state of ``--mib`` MiB of fp32 sharded tensors with megatron-core's
dist_checkpointing (torch_dist, the strategy training uses), alternately with and without the checksum
steps of ``checkpoint.save_checkpoint`` (each rank hashes the files it wrote; rank 0 writes
checksums.json), and loads it with and without ``verify_checksums`` first. Prints, as Markdown, the
median of ``--repeats`` rounds of each, the ratio with/without, and the machine's load average (the
figures are this machine's; state the load beside them). With W ranks each hashes 1/W of the files,
so the added time per rank falls with W.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _state(mib: int):
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor

    n = max(1, mib // 64)
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": ShardedTensor.from_rank_offsets(
        f"layer{i}.weight", torch.randn(4096, 4096, generator=g), replica_id=0) for i in range(n)}


def _save(state, path: str, checksums: bool) -> float:
    from megatron.core import dist_checkpointing

    from megatron_lev.checkpoint.sharded import _gather_own_checksums, _install_write_queue, _save_strategy, \
        _write_checksums

    if os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(path)
    _install_write_queue()
    t = time.perf_counter()
    dist_checkpointing.save(state, path, sharded_strategy=_save_strategy())
    if checksums:
        _write_checksums(path, _gather_own_checksums(path, 0))
    return time.perf_counter() - t


def _load(state, path: str, verify: bool) -> float:
    from megatron.core import dist_checkpointing

    from megatron_lev.checkpoint.sharded import verify_checksums

    t = time.perf_counter()
    if verify:
        verify_checksums(os.path.dirname(path), 1, path, log=lambda _line: None)
    dist_checkpointing.load(state, path)
    return time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024, help="state size in MiB (64 MiB a tensor)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = p.parse_args(argv)

    from megatron_lev.distributed import destroy_distributed, init_distributed

    setup = init_distributed(backend="gloo", seed=0)
    work = tempfile.mkdtemp(prefix="ckpt-checksums-", dir=args.dir)
    try:
        state = _state(args.mib)
        path = os.path.join(work, "iter_0000001")
        times = {k: [] for k in ("save", "save+checksums", "load", "verify+load")}
        _save(state, path, True)  # warm-up: imports, first write
        for _ in range(args.repeats):
            times["save"].append(_save(state, path, False))
            times["save+checksums"].append(_save(state, path, True))
            times["load"].append(_load(_state(args.mib), path, False))
            times["verify+load"].append(_load(_state(args.mib), path, True))
        size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
        med = {k: statistics.median(v) for k, v in times.items()}
        load1, load5, _ = os.getloadavg()
        print(f"Checkpoint of {size / 2**20:,.0f} MiB, 1 rank, median of {args.repeats} "
              f"(load average {load1:.1f} / {load5:.1f}, {os.cpu_count()} CPUs)\n")
        print("| step | without (s) | with checksums (s) | ratio |")
        print("|---|---|---|---|")
        print(f"| save | {med['save']:.2f} | {med['save+checksums']:.2f} | {med['save+checksums'] / med['save']:.2f} |")
        print(f"| load | {med['load']:.2f} | {med['verify+load']:.2f} | {med['verify+load'] / med['load']:.2f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        destroy_distributed(setup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
