"""Run a function on N local CPU ranks (gloo) with megatron-core's model-parallel groups.

Shared by the test harness (``megatron_lev.testing.run_distributed``) and the checkpoint converter,
which both need "build a model at some TP/PP layout on this machine and do something with it":

    results = spawn_ranks(fn, world_size=4, tp=2, pp=2, args=(...))

Each rank is a fresh process, so ``fn`` must be a module-level function. Ranks that cannot touch CUDA (CUDA
hidden from them, or a machine without it) fork from a server that imported torch and megatron-core
once (multiprocessing "forkserver", :mod:`megatron_lev._rank_server`): a rank then starts in a fraction of a second
instead of paying the imports, which a conversion at TP x PP = 4 paid four times over. Ranks that may
use CUDA are spawned (a process must not fork once CUDA is initialised, and an import may initialise it).
Either way a rank gets the launcher's environment and working directory of the moment it is started.
Each rank starts through :func:`megatron_lev.distributed.init_distributed`: the CPU backend without
CUDA, a gloo group joined through a file store (no TCP port to pick and lose to a concurrent job),
``parallel_state`` and, if asked, megatron's RNG tracker seeded. Return values travel back as
``torch.save`` bytes (tensors sent through a multiprocessing queue are shared-memory handles that die
with the rank). A failure on any rank
raises ``failure_cls`` carrying every failed rank's traceback; exceptions of a ``passthrough`` type
come back as that type with their one-line message. The process groups are always torn down, and
ranks stuck behind a failed peer are stopped after a short grace period.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import multiprocessing.forkserver
import os
import queue as queue_mod
import tempfile
import time
import traceback
from typing import Any, Callable, List, Optional, Sequence, Tuple, Type

from megatron_lev._procutil import die_with_parent

from .bootstrap import destroy_distributed, init_distributed
from .layout import ParallelLayout

__all__ = ["LaunchState", "RankFailure", "leave_server", "rank_context", "spawn_ranks"]


class RankFailure(RuntimeError):
    """One or more ranks failed; the message holds each failed rank's traceback."""


def _dumps(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: Optional[bytes]) -> Any:
    import torch

    return None if data is None else torch.load(io.BytesIO(data), weights_only=False)


def run_task(fn, args, kwargs, layout, seed, collective_timeout, passthrough, init_method=None):
    """Run one job on this rank inside megatron's groups of ``layout`` (tp, pp, vpp); returns
    ``(payload, error, one_line)`` for the launcher's queue. The groups are always torn down; a
    default process group that exists (a long-lived rank's) is reused and kept."""
    tp, pp, vpp = layout
    result, error, one_line, setup = None, None, False, None
    try:
        # A short collective timeout turns a rank stuck behind a failed peer into an error.
        setup = init_distributed(tp=tp, pp=pp, vpp=vpp, backend="gloo", timeout_minutes=collective_timeout / 60,
                                 init_method=init_method, seed=seed)
        result = fn(*args, **kwargs)
    except passthrough as e:
        error, one_line = f"{type(e).__name__}: {e}", True
    except BaseException:  # report everything, including assertion failures
        error = traceback.format_exc()
    finally:
        if setup is not None:
            destroy_distributed(setup)
    try:
        payload = _dumps(result)
    except Exception:
        payload, error = None, (error or "") + "\nresult could not be serialised:\n" + traceback.format_exc()
    return payload, error, one_line


_SERVER_MODULE = "megatron_lev._rank_server"
_server: Optional[str] = None  # "ours": the forkserver was started from here with the rank server; "other"


def rank_context(hide_cuda: bool):
    """The multiprocessing context to start local ranks from (see the module docstring): the rank server
    where the ranks cannot touch CUDA, "spawn" where they may, or where other code of this process had
    already started multiprocessing's one forkserver (its imports and environment are not the rank
    server's). The server starts with the first rank and lives as long as this process."""
    import torch

    global _server
    if not hide_cuda and torch.cuda.device_count() > 0:  # NVML: no CUDA context in the launcher
        return mp.get_context("spawn")
    if _server is None:
        _server = "other" if multiprocessing.forkserver._forkserver._forkserver_pid is not None else "ours"
        if _server == "ours":
            multiprocessing.forkserver.set_forkserver_preload([_SERVER_MODULE])
    return mp.get_context("forkserver" if _server == "ours" else "spawn")


class LaunchState:
    """What a rank takes from its launcher: the environment and working directory of the moment it is
    started. Passed as the rank's first argument, it is applied while the rank's arguments are read, before
    the module of the rank's function is imported (a forked rank would otherwise import it in the server's
    environment, of the moment the server started). Variables the launcher does not have are removed; what
    the rank's own imports set afterwards stays. ``hide_cuda``: CUDA is hidden in that environment already,
    so no import of the rank's function module (one may ask torch whether CUDA is there, which initialises
    the driver) sees a GPU."""

    def __init__(self, ctx, env: Optional[dict] = None, cwd: Optional[str] = None, hide_cuda: bool = False):
        self.env = dict(os.environ if env is None else env)
        if hide_cuda:
            self.env["CUDA_VISIBLE_DEVICES"] = ""
        self.cwd = os.getcwd() if cwd is None else cwd
        self.forked = ctx.get_start_method() == "forkserver"

    def __reduce__(self):
        return _apply_launch_state, (self.env, self.cwd, self.forked)


def _apply_launch_state(env: dict, cwd: str, forked: bool) -> bool:
    for name in set(os.environ) - set(env):
        del os.environ[name]
    os.environ.update(env)
    os.chdir(cwd)
    if forked:
        leave_server()
    return forked


def leave_server() -> None:
    """In a process forked from the rank server: give up its copy of the pipe by which the server knows
    that its launcher is alive (the server ends only when every holder has closed it), and die with the
    server, which ends with the launcher."""
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    die_with_parent()
    launcher = multiprocessing.parent_process()
    if launcher is not None and not launcher.is_alive():  # gone before the signal was armed
        os._exit(1)


def start_rank(rank: int, world: int, quiet: bool, hide_cuda: bool) -> None:
    """What every local rank does first (its launcher's environment is already applied: ``LaunchState``):
    its launcher variables, Ctrl-C, warnings, devices and threads."""
    from megatron_lev._procutil import ignore_interrupt

    ignore_interrupt()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if quiet:  # megatron-core's notes on missing fused kernels, deprecations
        import warnings

        warnings.filterwarnings("ignore")
    if hide_cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the cores


def _rank_main(_state, rank, world, store_file, layout, seed, fn, args, kwargs, out_q, collective_timeout,
               passthrough, hide_cuda, quiet):
    start_rank(rank, world, quiet, hide_cuda)
    payload, error, one_line = run_task(fn, args, kwargs, layout, seed, collective_timeout, passthrough,
                                        init_method=f"file://{store_file}")
    out_q.put((rank, payload, error, one_line))


def _died_silently(procs, reported: set) -> List[int]:
    """Ranks that exited without putting their report on the queue.

    A rank that reported may still be flushing the queue's feeder thread when it exits, so only a
    non-zero exit of an unreported rank counts (a zero exit always follows a put).
    """
    return [r for r, p in enumerate(procs) if r not in reported and not p.is_alive() and p.exitcode]


def spawn_ranks(
    fn: Callable,
    world_size: int,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: Optional[int] = None,
    seed: Optional[int] = None,
    args: Sequence = (),
    kwargs: Optional[dict] = None,
    timeout: float = 600.0,
    collective_timeout: float = 120.0,
    passthrough: Tuple[Type[BaseException], ...] = (),
    failure_cls: Type[Exception] = RankFailure,
    hide_cuda: bool = False,
    quiet: bool = False,
) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results."""
    ParallelLayout(world_size=world_size, tp=tp, pp=pp, vpp=vpp)  # refused here, before any rank is started
    ctx = rank_context(hide_cuda)
    out_q = ctx.Queue()
    fd, store_file = tempfile.mkstemp(prefix="megatron_lev_ranks_", suffix=".store")
    os.close(fd)
    os.remove(store_file)  # the file store creates it
    procs = [
        ctx.Process(target=_rank_main, args=(LaunchState(ctx, hide_cuda=hide_cuda), r, world_size, store_file, (tp, pp, vpp), seed, fn,
                                             tuple(args), kwargs or {}, out_q, collective_timeout,
                                             tuple(passthrough), hide_cuda, quiet))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    failed = True
    try:
        results = collect_reports(procs, out_q, world_size, timeout, failure_cls, passthrough, f"tp={tp}, pp={pp}")
        failed = False
        return results
    finally:
        for p in procs:
            p.join(timeout=2 if failed else 30)
            if p.is_alive():
                p.kill()
                p.join()
        if os.path.exists(store_file):
            os.remove(store_file)


def collect_reports(procs, out_q, world_size: int, timeout: float, failure_cls: Type[Exception],
                    passthrough: Tuple[Type[BaseException], ...], layout: str,
                    unpack: Callable = lambda report: report) -> List[Any]:
    """Wait for one report per rank from ``out_q`` (``unpack(report)`` gives ``(rank, payload, error,
    one_line)``) and return the per-rank results; raise ``failure_cls`` (or a passthrough error) when a
    rank failed, died without reporting or the ``timeout`` passed. After the first failure the other
    ranks get a short grace period, then waiting stops."""
    results: List[Any] = [None] * world_size
    errors: dict = {}
    received = 0
    reported: set = set()
    deadline = time.monotonic() + timeout
    grace = deadline
    while received < world_size:
        now = time.monotonic()
        if now >= (grace if errors else deadline):
            if errors:
                break
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode]
            raise failure_cls(
                f"timed out after {timeout:.0f}s waiting for ranks; ranks that died: {dead or 'none'} "
                f"(exit codes {[procs[r].exitcode for r in dead]})")
        try:
            # Short polls: a rank that dies without reporting is noticed at once, not at the deadline.
            rank, payload, error, one_line = unpack(out_q.get(timeout=1.0))
        except queue_mod.Empty:
            silent = _died_silently(procs, reported)
            if silent and not errors:
                raise failure_cls(
                    f"rank(s) {silent} died without reporting (exit codes "
                    f"{[procs[r].exitcode for r in silent]}); out of memory or killed?") from None
            if errors and not any(p.is_alive() for r, p in enumerate(procs) if r not in reported):
                break
            continue
        reported.add(rank)
        received += 1
        results[rank] = _loads(payload)
        if error is not None:
            if not errors:
                grace = time.monotonic() + 10.0
            errors[rank] = (error, one_line)
    if errors:
        for rank, (msg, one_line) in sorted(errors.items()):
            if one_line:  # a passthrough error: re-raise its own type with its one-line message
                for cls in passthrough:
                    if msg.startswith(cls.__name__ + ": "):
                        raise cls(msg[len(cls.__name__) + 2:])
        parts = [f"--- rank {r} ---\n{msg}" for r, (msg, _) in sorted(errors.items())]
        raise failure_cls(f"{len(errors)} of {world_size} ranks failed ({layout}):\n" + "\n".join(parts))
    return results
