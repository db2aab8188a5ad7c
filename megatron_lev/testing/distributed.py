"""Run a function on N gloo ranks with megatron-core's model-parallel groups set up.

    results = run_distributed(check_fn, world_size=4, tp=2, pp=2, args=(...))

Each rank is a fresh process (multiprocessing "spawn"), so ``check_fn`` must be a module-level
function. Before it runs, the rank initialises torch.distributed (gloo), installs the CPU
backend (``megatron_lev.compat``), calls ``parallel_state.initialize_model_parallel`` and seeds
megatron's RNG tracker. The return values (picklable) come back as a list indexed by rank; a
failure on any rank raises ``DistributedFailure`` carrying every failed rank's traceback, and
the process groups are always torn down. Start-up of a rank costs several seconds of imports,
so group several checks in one call.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence


class DistributedFailure(AssertionError):
    """One or more ranks failed; the message holds each failed rank's traceback."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, tp, pp, vpp, seed, fn, args, kwargs, queue, collective_timeout):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
    )
    # One intra-op thread per rank: ranks share the machine's cores.
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    result: Any = None
    error: Optional[str] = None
    try:
        import torch.distributed as dist

        from megatron_lev import compat

        compat.apply()
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        # A short collective timeout turns a rank stuck behind a failed peer into an error.
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=collective_timeout)
        )
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
        )
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        result = fn(*args, **kwargs)
    except BaseException:  # report everything, including assertion failures
        error = traceback.format_exc()
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
    # Tensors through a multiprocessing queue travel as shared-memory handles that die with
    # this process: send plain bytes instead.
    try:
        payload = _dumps(result)
    except Exception:
        payload, error = None, (error or "") + "\nresult could not be serialised:\n" + traceback.format_exc()
    queue.put((rank, payload, error))


def _dumps(obj: Any) -> bytes:
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: Optional[bytes]) -> Any:
    import io

    import torch

    if data is None:
        return None
    return torch.load(io.BytesIO(data), weights_only=False)


def run_distributed(
    fn: Callable,
    world_size: int,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: Optional[int] = None,
    seed: int = 1234,
    args: Sequence = (),
    kwargs: Optional[dict] = None,
    timeout: float = 600.0,
    collective_timeout: float = 120.0,
) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results."""
    if world_size % (tp * pp) != 0:
        raise ValueError(f"world_size {world_size} is not divisible by tp*pp = {tp * pp}")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, world_size, port, tp, pp, vpp, seed, fn, tuple(args), kwargs or {}, queue,
                  collective_timeout),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: List[Any] = [None] * world_size
    errors = {}
    received = 0
    deadline = time.monotonic() + timeout
    try:
        while received < world_size:
            # Once a rank failed, give the others a short grace period, then stop waiting.
            wait = deadline - time.monotonic()
            if errors:
                wait = min(wait, 10.0)
            try:
                rank, result, error = queue.get(timeout=max(wait, 0.1))
            except queue_mod.Empty:
                if errors:
                    break
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode]
                raise DistributedFailure(
                    f"timed out after {timeout:.0f}s waiting for ranks; "
                    f"ranks that died: {dead or 'none'} (exit codes "
                    f"{[procs[r].exitcode for r in dead]})"
                )
            received += 1
            results[rank] = _loads(result)
            if error is not None:
                errors[rank] = error
    finally:
        for p in procs:
            p.join(timeout=2 if errors else 30)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
        raise DistributedFailure(
            f"{len(errors)} of {world_size} ranks failed (tp={tp}, pp={pp}):\n" + "\n".join(parts)
        )
    return results
