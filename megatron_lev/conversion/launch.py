"""Run a conversion step on ``tp x pp`` CPU processes (gloo) with megatron-core's parallel groups.

Conversions run on CPU whatever the machine: each rank holds only its shard of the model, and
dist_checkpointing reads and writes the shards. CUDA is hidden from the ranks (gloo carries CPU
tensors; the CPU backend of ``megatron_lev.compat`` is installed). A ``ConversionError`` raised on a
rank comes back as one line; any other failure carries the rank's traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence

from .source import ConversionError


def _rank_main(rank, world, store_file, tp, pp, vpp, fn, args, out_q, timeout_s) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), CUDA_VISIBLE_DEVICES="")
    result, error, expected = None, None, False
    import warnings

    warnings.filterwarnings("ignore")  # megatron-core's notes on missing fused kernels, deprecations
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        from megatron_lev import compat

        compat.apply()
        from megatron.core import parallel_state

        # A file store: no TCP port to pick (and lose to a concurrent job) between choosing and binding.
        dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp)
        result = fn(*args)
    except ConversionError as e:
        error, expected = str(e), True
    except BaseException:
        error = traceback.format_exc()
    finally:
        try:
            from megatron.core import parallel_state
            import torch.distributed as dist

            parallel_state.destroy_model_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
    try:
        out_q.put((rank, result, error, expected))
    except Exception:
        out_q.put((rank, None, "result could not be sent:\n" + traceback.format_exc(), False))


def run_ranks(fn: Callable, *, tp: int = 1, pp: int = 1, vpp: Optional[int] = None, args: Sequence = (),
              timeout: float = 24 * 3600.0, collective_timeout: float = 3600.0) -> List[Any]:
    """``fn(*args)`` on ``tp*pp`` ranks (data-parallel size 1); the per-rank results (picklable)."""
    world = tp * pp
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    fd, store_file = tempfile.mkstemp(prefix="megatron_lev_convert_", suffix=".store")
    os.close(fd)
    os.remove(store_file)  # the file store creates it
    procs = [ctx.Process(target=_rank_main, args=(r, world, store_file, tp, pp, vpp, fn, tuple(args), out_q,
                                                  collective_timeout)) for r in range(world)]
    for p in procs:
        p.start()
    results: List[Any] = [None] * world
    errors = {}
    received = 0
    deadline = time.monotonic() + timeout
    try:
        while received < world:
            wait = deadline - time.monotonic()
            if errors:
                wait = min(wait, 15.0)  # the others are probably stuck behind the failed rank
            try:
                rank, result, error, expected = out_q.get(timeout=max(wait, 0.1))
            except queue_mod.Empty:
                if errors:
                    break
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode]
                raise ConversionError(f"conversion ranks timed out (dead ranks: {dead or 'none'})") from None
            received += 1
            results[rank] = result
            if error is not None:
                errors[rank] = (error, expected)
            if received < world and not errors:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode]
                if dead:
                    raise ConversionError(f"conversion rank(s) {dead} died (exit codes "
                                          f"{[procs[r].exitcode for r in dead]}); out of memory?")
    finally:
        for p in procs:
            p.join(timeout=2 if errors else 60)
            if p.is_alive():
                p.kill()
                p.join()
        if os.path.exists(store_file):
            os.remove(store_file)
    if errors:
        expected = [msg for msg, exp in errors.values() if exp]
        if expected:
            raise ConversionError(expected[0])
        rank, (msg, _) = sorted(errors.items())[0]
        raise RuntimeError(f"conversion failed on rank {rank}:\n{msg}")
    return results
