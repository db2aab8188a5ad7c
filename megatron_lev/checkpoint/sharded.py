"""Sharded checkpoints with megatron-core ``dist_checkpointing`` (``torch_dist`` backend).

Layout (Megatron-LM's)::

    SAVE_DIR/latest_checkpointed_iteration.txt     "N": the newest *complete* checkpoint
    SAVE_DIR/iter_000000N/                         dist_checkpointing directory
        metadata.json, common.pt, .metadata, __*.distcp   (written by every rank)
        checksums.json                              size and CRC32 of each of those files
        config.yaml                                 the resolved run configuration

A checkpoint holds the model chunks (``model`` or ``model0``, ``model1``... with virtual stages),
the optimizer (distributed optimizer state in megatron-core's model-space sharding, so it can be
loaded with another TP/PP/DP layout where dist_checkpointing allows), the LR scheduler, the RNG
states of every rank (python, numpy, torch CPU, CUDA and megatron's model-parallel tracker),
the iteration, consumed samples, skipped/NaN counters and the resolved arguments.

Completion protocol: every rank writes its shards (``dist_checkpointing.save`` ends with a
barrier), then a second barrier; each rank hashes the files it wrote (``checksums``), rank 0 gathers
them into ``checksums.json``, then writes ``config.yaml`` and finally replaces the tracker
file atomically (write to a temporary name, fsync, ``os.replace``, fsync the directory). A crash at
any point before that leaves the tracker naming the previous checkpoint, which ``--load`` then uses.
A leftover incomplete ``iter_*`` directory is removed before the same iteration is saved again.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import re
import shutil
import signal
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from megatron_lev.compat.versions import checkpoint_writer_errors, megatron_core_version

from . import checksums
from .files import CONFIG_NAME, STRUCTURE_ARGS, TRACKER, CheckpointError, _failure_reason, _first_line, _read_yaml, \
    _wrapped, check_checkpoint_tokenizer, check_intact, checkpoint_dir, complete_iterations, config_mismatch, \
    damaged_checkpoint_message, describe_damage, find_checkpoint, find_damage, load_common, looks_like_one_checkpoint, \
    missing_manifest, newest_complete_checkpoint, raise_stop_inside, read_tracker, write_tracker
from .lock import LOCK_NAME

CHECKPOINT_VERSION = 3.0


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def _model_keys(n: int) -> List[str]:
    return ["model"] if n == 1 else [f"model{i}" for i in range(n)]


def _rng_state() -> Dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _layout() -> Dict[str, int]:
    from megatron.core import parallel_state as ps

    return {"world_size": torch.distributed.get_world_size(),
            "tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(),
            "etp": ps.get_expert_tensor_parallel_world_size()}


def _saved_layout(common: Dict[str, Any]) -> Dict[str, Any]:
    """The layout a checkpoint was saved at; one saved before the expert sizes were recorded had none
    (EP 1, expert TP = TP, megatron-core's defaults)."""
    layout = dict(common.get("layout") or {})
    if layout:
        layout.setdefault("ep", 1)
        layout.setdefault("etp", layout.get("tp"))
    return layout


def _ensure_optimizer_state(optimizer) -> None:
    """Give a not-yet-stepped Adam its state (zeros, step 0) so megatron-core can map it for saving and
    loading: the state torch's Adam creates at its first step, so a run that goes on from here steps as
    it would have.

    Without Apex/Transformer Engine, megatron-core 0.16.1's DistributedOptimizer.state_dict() reads
    the per-parameter ``step`` of torch's Adam, which exists only after a first step (its save asserted
    on an optimizer that had not stepped: an fp16 run whose every step so far the loss scaler skipped);
    its own init_state_fn does not create it. A checkpoint of the other optimizers saved without the
    moments lacked the keys a load asks for. On a load, the checkpoint overwrites every value set here.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                if len(st) == 0:
                    st["exp_avg"] = torch.zeros_like(p.data)
                    st["exp_avg_sq"] = torch.zeros_like(p.data)
                if "step" not in st:
                    st["step"] = torch.tensor(0.0)


def _step_zero_where_unsaved(loaded) -> None:
    """Give the loaded state of an optimizer that had not stepped its step 0, in place.

    megatron-core's Float16 and FP32 optimizers save Adam's step once, as ``common_step``, and only when
    it is non-zero; torch's Adam refuses a parameter's state without one."""
    if isinstance(loaded, dict):
        state = loaded.get("state")
        if "param_groups" in loaded and isinstance(state, dict) and "common_step" not in state and any(
                isinstance(st, dict) and st and "step" not in st for st in state.values()):
            state["common_step"] = torch.tensor(0.0)
        children = loaded.values()
    elif isinstance(loaded, list):
        children = loaded
    else:
        return
    for child in children:
        _step_zero_where_unsaved(child)


def _mark_decoupled_groups(loaded, optimizer) -> None:
    """Mark, in place, the saved param groups of a --decoupled-lr checkpoint written before the decoupled
    group was marked ``is_decoupled_lr`` (``parallel.weight_decay``), as the run's groups at the same places
    are: megatron-core finds the saved group of each of the run's by that mark (among others), and without it
    the decoupled group is not found. Only where the saved groups are the run's, place for place (the same
    count and the same max/min lr each); otherwise the load goes on unchanged."""
    saved: List[list] = []

    def walk(node):
        if isinstance(node, dict) and isinstance(node.get("param_groups"), list):
            saved.append(node["param_groups"])
        elif isinstance(node, (dict, list)):
            for child in (node.values() if isinstance(node, dict) else node):
                walk(child)

    walk(loaded)
    current = [getattr(opt, "optimizer", None) for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    if len(saved) != len(current):
        return
    for groups, inner in zip(saved, current):
        now = getattr(inner, "param_groups", [])
        if (len(groups) != len(now) or any(g.get("is_decoupled_lr") for g in groups)
                or not any(g.get("is_decoupled_lr") for g in now)):
            continue
        if all((g.get("max_lr"), g.get("min_lr")) == (n.get("max_lr"), n.get("min_lr")) for g, n in zip(groups, now)):
            for g, n in zip(groups, now):
                g["is_decoupled_lr"] = bool(n.get("is_decoupled_lr"))


def _unshare_adam_steps(optimizer) -> None:
    """Give every parameter its own Adam ``step`` tensor after loading.

    megatron-core 0.16.1's DistributedOptimizer.load_state_dict (path without Apex/TE) assigns one
    ``step`` tensor to every parameter's state; torch's Adam increments it in place per parameter,
    so the shared counter would advance by the number of parameters per step and change the bias
    correction (the resumed run would no longer match the uninterrupted one).
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None or not hasattr(inner, "state"):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state.get(p)
                if not isinstance(st, dict) or not isinstance(st.get("step"), torch.Tensor):
                    continue
                if "step" in group and group["step"] is not None:
                    # The distributed optimizer keeps the checkpoint's step on the param group.
                    st["step"] = torch.tensor(float(group["step"]), dtype=st["step"].dtype)
                else:
                    st["step"] = st["step"].detach().clone()


def _sharded_state_dict(model, optimizer, include_optim: bool, include_rng: bool, is_loading: bool,
                        sharding_type: str = "dp_reshardable", saved=None, match=None):
    """The state to save or load; when loading, ``saved`` (the checkpoint's keys) fits the model part to
    the checkpoint's layout first (``checkpoint_keys.fit_to_checkpoint``, counts in ``match``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = _model_state(model, saved, match)
    if include_optim and optimizer is not None:
        _ensure_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": sharding_type})
        if saved is not None:
            _drop_unsaved_moments(state["optimizer"], saved)
    if include_rng:
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        state["rng_state"] = ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)
    return state


_MOMENTS = ("optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq.")


def _drop_unsaved_moments(optim_state, saved) -> None:
    """Leave Adam's moments out of the optimizer state to load, in place, when the checkpoint ``saved`` (its
    keys) holds none: an optimizer that had not stepped, saved before its zero moments were (an fp16 run
    whose every step the loss scaler skipped; the load asked for keys the checkpoint lacks, a raw KeyError).
    Its state stays empty and torch's Adam creates it at the first step, as the saved run would have."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def walk(node, visit):
        for key, value in list(node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(value, ShardedTensor) and value.key.startswith(_MOMENTS):
                visit(node, key, value)
            elif isinstance(value, (dict, list)):
                walk(value, visit)

    asked = []
    walk(optim_state, lambda node, key, t: asked.append(t.key))
    if asked and not any(k in saved for k in asked):
        walk(optim_state, lambda node, key, t: node.pop(key))


def _model_state(model, saved=None, match=None) -> Dict[str, Any]:
    """The chunks' sharded state dicts under ``model``/``model0``...; fitted to the checkpoint's keys
    ``saved`` when loading (``models.checkpoint_keys``, counts in ``match``)."""
    from megatron_lev.models.checkpoint_keys import fit_to_checkpoint

    state: Dict[str, Any] = {}
    for key, chunk in zip(_model_keys(len(model)), model):
        state[key] = _unwrap(chunk).sharded_state_dict()
        if saved is not None:
            state[key] = fit_to_checkpoint(state[key], saved, match)
    return state


def _restore_model(model, loaded) -> None:
    from megatron_lev.models.checkpoint_keys import restore_missing_extra_state

    for key, chunk in zip(_model_keys(len(model)), model):
        _unwrap(chunk).load_state_dict(restore_missing_extra_state(_unwrap(chunk), loaded[key]), strict=True)


class CheckpointReadError(RuntimeError):
    """``dist_checkpointing.load`` failed; the message is the first line of the error of the first rank
    that failed (torch's CheckpointException, which wraps it, names only ranks)."""


def _read(state, path: str, **kw):
    """``dist_checkpointing.load(state, path, **kw)``, whose failures come out as exceptions a caller's
    ``except Exception`` holds: torch's CheckpointException is a BaseException (a 60-line traceback
    escaped the handlers around a load), and a Ctrl-C during the read reaches the caller inside it, as
    one rank's error; it is raised again as the KeyboardInterrupt it was (the one-line Ctrl-C report), as is a
    SIGTERM's ``Terminated`` (its exit code kept)."""
    from megatron.core import dist_checkpointing

    try:
        return dist_checkpointing.load(state, path, **kw)
    except (Exception, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        raise_stop_inside(e)  # a Ctrl-C or SIGTERM during the read: the one-line report with its exit code
        raise CheckpointReadError(_failure_reason(e)) from e


def load_model_state(model, path: str, log=None) -> None:
    """Load the model part of the dist checkpoint directory ``path`` into the chunks ``model`` (any
    TP/PP layout, Transformer Engine or local layer spec on either side; no optimizer, no RNG)."""
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy

    from megatron_lev.models.checkpoint_keys import KeyMatch, saved_keys

    saved, match = saved_keys(path), KeyMatch()
    state = _model_state(model, saved, match)
    loaded = _read(state, path, sharded_strategy=get_default_load_sharded_strategy(path))
    _restore_model(model, loaded)
    if log is not None:
        for note in match.describe(saved):
            log(f"  {path}: {note}")


def _save_strategy():
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    strategy = get_default_save_sharded_strategy("torch_dist")
    if ps.get_data_parallel_world_size() > 1:
        strategy = FullyParallelSaveStrategyWrapper(strategy, ps.get_data_parallel_group(with_context_parallel=True))
    return strategy


def _load_strategy(path: str, *, fully_parallel: bool):
    """megatron-core's load strategy for ``path``; ``fully_parallel`` (--ckpt-fully-parallel-load): each
    data-parallel replica reads a share and the replicas exchange the rest (with one replica, as it is)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    strategy = get_default_load_sharded_strategy(path)
    if fully_parallel and ps.get_data_parallel_world_size() > 1:
        strategy = FullyParallelLoadStrategyWrapper(strategy, ps.get_data_parallel_group(with_context_parallel=True))
    return strategy


def _install_write_queue() -> None:
    """Give dist_checkpointing's writer an in-process result queue.

    Saves here are synchronous: the writer's results are put and got by this same process (its forked
    writer processes report through queues of their own). megatron-core's default, a
    ``mp.get_context("spawn").Manager()`` queue, starts a fresh interpreter per rank that imports torch
    to unpickle the results (about 2 s of CPU a rank at the first save, more on a loaded node), may
    re-run the launching script, outlives a rank killed by the launcher and can keep it from exiting.
    A ``queue.Queue`` has the ``put``/``get_nowait`` the writer uses and none of that.
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    if getattr(fa, "_results_queue", None) is None:
        fa._results_queue = queue.Queue()


def _stall_writers() -> None:
    """Test hook: dist_checkpointing's writers of this save say so and hang (to be killed). They are
    child processes up to megatron-core 0.18 and threads of the rank from 0.19, so the rank's pid is
    named beside the writer's."""
    import sys
    import time

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    rank_pid = os.getpid()

    def stalled(*a, **kw):
        print(f"debug: checkpoint writer {os.getpid()} of rank process {rank_pid} stalled", file=sys.stderr,
              flush=True)
        while True:
            time.sleep(60)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(stalled)


def _fail_writers_with_enospc() -> None:
    """Test hook: dist_checkpointing's writer processes of this save fail as on a full disk (after
    writing a few bytes of their first item)."""
    import errno

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    def full(*args, **kw):
        stream = next(a for a in args if hasattr(a, "write"))
        stream.write(b"\0" * 64)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    fa._write_item = full


class CheckpointSaveError(CheckpointError):
    """A save failed (disk full, I/O error); the partial folder is removed and the tracker unchanged."""


def _no_space(error: BaseException) -> bool:
    """Whether ``error`` (or what it wraps, as megatron's worker failures do) is ENOSPC."""
    import errno

    seen = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(e) or "Errno 28" in str(e):
            return True
        stack += [e.__cause__, e.__context__] + _wrapped(e)
    return False


def _disk_is_full(root: str) -> bool:
    """Whether 1 MiB more can be written under ``root`` now: a full disk often reaches us without its
    errno (torch's stream writer says only "file write failed")."""
    import errno
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=root) as f:
            f.write(b"\0" * (1 << 20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    return False


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


_WRITTEN, _FAILED, _NO_SPACE = 0, 1, 2


def _local_outcome(error: Optional[BaseException], root: str) -> int:
    """This rank's outcome: _WRITTEN, _NO_SPACE (the error says ENOSPC, or ``root``'s disk is full now),
    or _FAILED."""
    if error is None:
        return _WRITTEN
    return _NO_SPACE if _no_space(error) or _disk_is_full(root) else _FAILED


def _outcome_on_all_ranks(error: Optional[BaseException], root: str) -> int:
    """The worst outcome of this step over all ranks: _WRITTEN, _FAILED, or _NO_SPACE (a full disk on
    some rank, which the others' errors need not say: a rank's CheckpointException carries the other
    ranks' writer errors only as text, and from megatron-core 0.19 without their errno)."""
    from megatron_lev.parallel.collectives import all_reduce_

    t = torch.tensor([_local_outcome(error, root)], dtype=torch.int32)
    return int(all_reduce_(t, op=torch.distributed.ReduceOp.MAX).item())


def _save_failed(root: str, iteration: int, path: str, error: Optional[BaseException],
                 no_space: bool) -> CheckpointSaveError:
    """Remove the partial ``path`` (rank 0) and describe the failure in one line (on every rank);
    ``no_space``: some rank's disk was full."""
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    torch.distributed.barrier()
    try:
        free = _human_bytes(shutil.disk_usage(root).free)
    except OSError:
        free = "unknown"
    if no_space:
        reason = "no space left on device"
    elif error is None:
        reason = "another rank failed to write its part"
    else:
        reason = _failure_reason(error)
    try:
        last = read_tracker(root)
    except (CheckpointError, OSError):  # on one rank alone it must not replace the line every rank raises
        last = None
    kept = f"the last complete checkpoint is {checkpoint_dir(root, last)}" if last is not None else \
        "there is no complete checkpoint yet"
    gone = "removed" if not os.path.exists(path) else "left in place (remove it)"
    return CheckpointSaveError(
        f"--save {root}: the checkpoint of iteration {iteration} could not be written ({reason}; {free} free "
        f"there); its partial folder {path} was {gone}; {kept}; "
        f"{'make room and resume' if no_space else 'once --save can be written, resume'} with --load {root}")


def save_checkpoint(
    root: str, iteration: int, model, optimizer, scheduler, *, consumed_train_samples: int,
    counters: Dict[str, int], config: Dict[str, Any], save_optim: bool = True, save_rng: bool = True,
    optim_fully_reshardable: bool = False, kill_at: Optional[str] = None, stall_at: Optional[str] = None,
    enospc_at: Optional[str] = None, record_checksums: bool = True, log=print,
) -> str:
    """Save a complete checkpoint of this iteration on every rank; return its directory.

    ``config``: the resolved arguments (saved inside and as ``config.yaml``). ``optim_fully_reshardable``:
    megatron-core's distributed-optimizer layout fully_reshardable (gathers on DP rank 0; reloads with
    any TP/PP/DP) instead of dp_reshardable (fast; reloads with the same TP/PP). ``kill_at`` /
    ``stall_at`` / ``enospc_at`` ("RANK:ITERATION"): test hooks that kill this rank, stall its writers or
    fail them as on a full disk, in this save. ``record_checksums``: write ``checksums.json`` (each rank
    hashes the files it wrote; see :mod:`.checksums`). A failed save raises :class:`CheckpointSaveError` on every
    rank (one line: ``--save``, the iteration, the free space, the last complete checkpoint) after the
    partial folder is removed; the tracker still names the last complete checkpoint."""
    import yaml
    from megatron.core import dist_checkpointing

    rank = torch.distributed.get_rank()
    path = checkpoint_dir(root, iteration)
    _install_write_queue()
    error: Optional[BaseException] = None
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            if os.path.isdir(path):  # an incomplete attempt at this iteration (or an older run): replace it
                shutil.rmtree(path)
            os.makedirs(path)
        except OSError as e:  # --save made read-only (or full) during the run: one line on every rank
            error = e
    outcome = _outcome_on_all_ranks(error, root)  # also the barrier before the other ranks write
    if outcome != _WRITTEN:
        raise _save_failed(root, iteration, path, error, outcome == _NO_SPACE)

    sharding = "fully_reshardable" if optim_fully_reshardable else "dp_reshardable"
    state = _sharded_state_dict(model, optimizer, include_optim=save_optim,
                                include_rng=save_rng, is_loading=False, sharding_type=sharding)
    state.update(
        optim_sharding_type=sharding,
        checkpoint_version=CHECKPOINT_VERSION,
        megatron_core_version=str(megatron_core_version()),
        iteration=iteration,
        consumed_train_samples=consumed_train_samples,
        counters=dict(counters),
        args=dict(config),
        layout=_layout(),
        checksums=bool(record_checksums),  # a load refuses this checkpoint without its checksums.json
    )
    if scheduler is not None:  # small and layout-free: kept without the optimizer too (--no-save-optim, reshard)
        state["opt_param_scheduler"] = scheduler.state_dict()

    if kill_at is not None and tuple(int(x) for x in kill_at.split(":")) == (rank, iteration):
        # Test hook: die abruptly while the other ranks are writing this checkpoint.
        os.kill(os.getpid(), signal.SIGKILL)
    if stall_at is not None and tuple(int(x) for x in stall_at.split(":")) == (rank, iteration):
        _stall_writers()

    if enospc_at is not None and tuple(int(x) for x in enospc_at.split(":")) == (rank, iteration):
        _fail_writers_with_enospc()

    writers_before = set(multiprocessing.active_children())
    with checkpoint_writer_errors() as writer_errors:
        try:
            dist_checkpointing.save(state, path, sharded_strategy=_save_strategy(), validate_access_integrity=True)
        except (KeyboardInterrupt, SystemExit):  # a second Ctrl-C, or SIGTERM's deadline: the save is cut short
            _stop_writers(writers_before)
            raise
        except BaseException as e:  # a full disk, an I/O error (torch's CheckpointException is a BaseException)
            error = e
    if writer_errors:  # this rank's writer failed: its own error says more than the save's wrapping of it
        error = writer_errors[0]
    outcome = _outcome_on_all_ranks(error, root)
    if outcome != _WRITTEN:  # every rank's shards are on disk, or none goes on
        raise _save_failed(root, iteration, path, error, outcome == _NO_SPACE)
    parts = _gather_own_checksums(path, rank) if record_checksums else None
    if rank == 0:
        try:
            # config.yaml stays the save's last file (the mark of a complete save); the manifest written
            # before it covers it by the bytes about to be written.
            config_text = yaml.safe_dump(dict(config), sort_keys=True).encode("utf-8")
            if parts is not None:
                _write_checksums(path, parts, {CONFIG_NAME: checksums.bytes_entry(config_text)})
            with open(os.path.join(path, CONFIG_NAME), "wb") as f:
                f.write(config_text)
            write_tracker(root, iteration)
        except OSError as e:
            error = e
    outcome = _outcome_on_all_ranks(error, root)
    if outcome != _WRITTEN:
        raise _save_failed(root, iteration, path, error, outcome == _NO_SPACE)
    log(f"  successfully saved checkpoint from iteration {iteration:7d} to {root}")
    return path


def _stop_writers(before) -> None:
    """Kill the writer processes this save forked (up to megatron-core 0.18) when the save is cut short: the
    interpreter's exit waits for child processes, and a hung writer would keep the rank from exiting."""
    for proc in set(multiprocessing.active_children()) - before:
        proc.kill()
        proc.join(5)


def _gather_own_checksums(path: str, rank: int) -> Optional[list]:
    """Each rank's (entries, error text) for the files it wrote, on rank 0 (read back at once: they are
    still in the page cache)."""
    from megatron_lev.parallel.collectives import gather_objects

    try:
        part = (checksums.hash_files(path, checksums.files_written_by(path, rank)), None)
    except OSError as e:
        part = ({}, f"{e.filename or path}: {e.strerror or e}")
    return gather_objects(part)


def _write_checksums(path: str, parts: list, later: Optional[Dict[str, checksums.Entry]] = None) -> None:
    """Rank 0: merge the ranks' entries, hash any covered file none of them named, write the manifest (with
    the entries ``later`` of files written after it)."""
    entries: Dict[str, checksums.Entry] = dict(later or {})
    for part, error in parts:
        if error:
            raise OSError(f"cannot read back a file just written to compute its checksum ({error})")
        entries.update(part)
    entries.update(checksums.hash_files(path, checksums.uncovered(path, entries)))
    checksums.write_manifest(path, entries)


def verify_checksums(root: str, iteration: int, path: str, older_hint=None, log=print, *,
                     local_error: Optional[str] = None, checksums_on: bool = True,
                     allow_missing: bool = False) -> None:
    """Check the files of ``path`` against its ``checksums.json`` on every rank together (rank ``r``
    reads files ``r, r + world, ...``); damage is :class:`CheckpointError` on every rank, one line naming
    the file and the newest complete older checkpoint. A checkpoint without a manifest gets one warning
    line (rank 0).

    Collective, and every rank takes the same branch: rank 0 alone reads the manifest and sends it, and
    each rank's verdict goes through one all-gather, so a rank whose filesystem fails it (or whose own
    earlier check found ``local_error``, the one-line message of a missing or short file) stops every rank
    with the same line instead of leaving the others waiting in the load's collectives.
    ``checksums_on=False`` (--no-ckpt-checksums) agrees on ``local_error`` alone. A manifest that is
    missing though the checkpoint's own metadata says its save wrote one is refused like a damaged file,
    unless ``allow_missing`` (--allow-missing-ckpt-checksums: one warning line)."""
    from megatron_lev.parallel.collectives import all_gather_objects, broadcast_object

    hint = older_hint or _ckpt_step_hint
    manifest_file = os.path.join(path, checksums.MANIFEST)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    manifest = None
    if checksums_on:
        if rank == 0:
            try:
                sent = ("ok", checksums.read_manifest(path))
                if sent[1] is None:  # none: refused where the save recorded one, else one warning line
                    lines: List[str] = []
                    missing = missing_manifest(path, load_common(path), allow_missing, lines.append)
                    sent = ("missing", missing) if missing else ("none", lines)
            except (checksums.ManifestError, OSError, CheckpointError) as e:
                sent = ("bad", str(e))
        # Once per load: the manifest is a few hundred bytes a rank's files.
        kind, manifest = broadcast_object(sent if rank == 0 else None)
    verdict = local_error
    try:  # nothing here may raise on one rank alone: the others would wait in the all-gather
        if checksums_on and kind == "bad":
            verdict = verdict or damaged_checkpoint_message(root, iteration, path, manifest_file, manifest, hint)
            manifest = None
        elif checksums_on and kind == "missing":
            verdict = verdict or damaged_checkpoint_message(root, iteration, path, *manifest, hint)
            manifest = None
        elif checksums_on and kind == "none":
            warnings, manifest = manifest, None
        if verdict is None and manifest:
            found = checksums.first_damage(path, manifest, rank, world)
            if found is not None:
                file, what = describe_damage(path, manifest, *found)
                verdict = (found[0], found[1], damaged_checkpoint_message(root, iteration, path, file, what, hint))
    except Exception as e:  # an I/O error of this rank's filesystem, while finding the older checkpoint too
        verdict = f"{path}: cannot be checked on rank {rank} ({type(e).__name__}: {_first_line(e)})"
    verdicts = all_gather_objects(verdict)  # once per load, before any read of the state
    errors = [v for v in verdicts if isinstance(v, str)]
    damage = sorted(v for v in verdicts if isinstance(v, tuple))
    if errors:  # the lowest rank's own error
        raise CheckpointError(errors[0])
    if damage:  # the first damaged file in the manifest's order
        raise ChecksumDamage(damage[0][2], kind=damage[0][1])
    if checksums_on and kind == "none" and rank == 0:
        for line in warnings:
            log(line)


class ChecksumDamage(CheckpointError):
    """A file of a checkpoint differs from its ``checksums.json`` (``kind``: ``checksums.MISSING``,
    ``WRONG_SIZE``, ``WRONG_SUM`` or ``UNREADABLE``)."""

    def __init__(self, message: str, *, kind: int) -> None:
        super().__init__(message)
        self.kind = kind


def check_save_and_load(args, *, newer: bool = True) -> None:
    """Refuse, before anything is written, a run that would clobber or silently ignore checkpoints.

    ``--save`` holding another run's checkpoints (a tracker, or complete ``iter_*`` folders) is refused
    unless ``--load`` names the same directory (a resume) or ``--overwrite-checkpoints`` is given: the new
    run would remove its iterations one by one and move the tracker back. ``--load`` must be a checkpoint
    directory (with a tracker), an empty or missing directory, or one holding only ``iter_*`` folders of a
    first save that never completed; anything else is a wrong path, not a fresh start. A run never
    writes over a complete checkpoint newer than the one it loads (a missing, empty, bad or stale
    tracker beside complete ``iter_*`` folders): it is refused naming the newest one and ``--ckpt-step``.
    That last check is :func:`refuse_newer_checkpoints`; ``newer=False`` leaves it to the caller, to run
    once the process group exists (with checksums).
    """
    load, save = args.load, args.save
    overwrite = bool(args.overwrite_checkpoints)
    step = getattr(args, "ckpt_step", None)
    same = load is not None and save is not None and os.path.realpath(load) == os.path.realpath(save)
    start: Optional[int] = None  # the iteration this run continues from; None: from scratch
    if load is not None and os.path.exists(load):
        if not os.path.isdir(load):
            raise CheckpointError(f"--load {load}: not a directory")
        tracker = read_tracker(load, _ckpt_step_hint) if step is None else None  # --ckpt-step: the tracker is not read
        if step is not None:
            start = step
        elif tracker is not None:
            start = tracker
            named = checkpoint_dir(load, tracker)  # the tracker may name a save that is not (or no longer) there
            gone = next((p for p in [named] + [os.path.join(named, n) for n in ("metadata.json", CONFIG_NAME)]
                         if not os.path.exists(p)), None)
            if gone is not None:
                raise CheckpointError(damaged_checkpoint_message(load, tracker, named, gone,
                                                                 f"missing (named by {TRACKER})", _ckpt_step_hint))
        else:
            if looks_like_one_checkpoint(load):
                raise CheckpointError(
                    f"--load {load}: this is one checkpoint's folder; pass the directory above it "
                    f"(--load {os.path.dirname(os.path.abspath(load))}), which holds {TRACKER}")
            others = sorted(n for n in os.listdir(load) if not (n.startswith("iter_") or n.startswith(f".{TRACKER}")
                                                                 or n == LOCK_NAME))
            # --save DIR --load DIR without a tracker or a complete save there: a job that stopped before its
            # first save (its TensorBoard folder inside DIR, say) starts from scratch, as Megatron-LM's does,
            # with the load's one warning. A --load elsewhere that holds no checkpoint is a wrong path.
            if others and not same:
                raise CheckpointError(
                    f"--load {load}: not a checkpoint directory (no {TRACKER}; holds {others[0]!r}"
                    f"{' and more' if len(others) > 1 else ''}); check the path")
            if not overwrite and complete_iterations(load):
                raise CheckpointError(_untracked_message(load, "--load"))
        if getattr(args, "finetune", False):
            start = 0
    if save is None or overwrite or not os.path.isdir(save):
        return
    if not same:
        latest = read_tracker(save)
        if latest is not None:
            raise CheckpointError(
                f"--save {save} holds another run's checkpoints (latest iteration {latest}) that this run would "
                f"replace; resume with --load {save}, choose another --save, or pass --overwrite-checkpoints")
        if complete_iterations(save):
            raise CheckpointError(_untracked_message(save, "--save"))
        return
    if newer:
        refuse_newer_checkpoints(args, start)


def _start_iteration(args) -> Optional[int]:
    """The iteration a run with these flags continues from (None: from scratch), as
    :func:`check_save_and_load` resolves it."""
    if getattr(args, "finetune", False):
        return 0
    if getattr(args, "ckpt_step", None) is not None:
        return args.ckpt_step
    return read_tracker(args.load, _ckpt_step_hint) if args.load and os.path.isdir(args.load) else None


def refuse_newer_checkpoints(args, start: Optional[int] = None, *, checksums_on: bool = False) -> None:
    """Refuse a run that would write over a complete checkpoint in ``--save`` newer than the iteration it
    continues from (``start``; None: resolved from the flags): :class:`CheckpointError`, one line naming the
    newest such checkpoint, ``--ckpt-step`` and ``--overwrite-checkpoints``.

    A newer checkpoint that is damaged may be trained over (it is why an older one is loaded). Without
    ``checksums_on`` damage is judged by sizes (every rank alone, before the process group exists: reading
    the newer checkpoints whole there would read them once per rank); with it (collective, after the
    process group is set up), each newer one is also verified against its checksums, spread over the
    ranks, so one whose bytes changed is not in the way of resuming from an older one."""
    load, save = args.load, args.save
    if save is None or args.overwrite_checkpoints:
        return
    if load is None or os.path.realpath(load) != os.path.realpath(save):
        return  # another --save than --load: check_save_and_load refused any complete checkpoint there
    if checksums_on:  # collective: every rank takes rank 0's view of the folder and verifies the same list
        start, newer = _newer_in_the_way(args, start)
    else:
        if not os.path.isdir(save):
            return
        if start is None:
            start = _start_iteration(args)
        newer = [it for it in complete_iterations(save) if it > (-1 if start is None else start)
                 and find_damage(checkpoint_dir(save, it)) is None]
    if newer:
        step = getattr(args, "ckpt_step", None)
        loads = (f"--ckpt-step {step} loads iteration {step}" if step is not None else
                 f"--finetune starts at iteration 0" if getattr(args, "finetune", False) else
                 f"{os.path.join(save, TRACKER)} names iteration {start} (stale)")
        raise CheckpointError(
            f"--save {save}: {loads}, but {checkpoint_dir(save, newer[0])} is a newer complete checkpoint that "
            f"this run would write over; resume from it with --ckpt-step {newer[0]}, or pass "
            f"--overwrite-checkpoints to replace it")


def _newer_in_the_way(args, start: Optional[int]) -> Tuple[Optional[int], List[int]]:
    """Collective. The iteration the run continues from (``start``; None: resolved from the flags) and the
    first complete checkpoint under ``--save`` newer than it that matches its checksums, as a list (empty:
    none). Rank 0 reads the folder and sends what it found: a rank's own look could differ (another rank,
    the TensorBoard writer among them, may be creating ``--save`` at that moment), and every rank must make
    the same collective calls and run the same verifications. A newer checkpoint whose files changed or
    went missing may be written over (one line on rank 0 says so), one that cannot be read or checked stays
    in the way."""
    from megatron_lev.parallel.collectives import broadcast_object

    save = args.save
    rank = torch.distributed.get_rank()
    if rank == 0:
        try:
            if not os.path.isdir(save):
                sent = (start, [])
            else:
                start = _start_iteration(args) if start is None else start
                sent = (start, [it for it in complete_iterations(save) if it > (-1 if start is None else start)
                                and find_damage(checkpoint_dir(save, it)) is None])
        except CheckpointError as e:  # a bad tracker: its own line, on every rank
            sent = str(e)
        except OSError as e:
            sent = f"--save {save}: cannot be listed ({type(e).__name__}: {_first_line(e)})"
    got = broadcast_object(sent if rank == 0 else None)
    if isinstance(got, str):
        raise CheckpointError(got)
    start, candidates = got
    if not candidates:
        return start, []
    for it in candidates:
        path = checkpoint_dir(save, it)
        try:
            verify_checksums(save, it, path, log=lambda _line: None)
        except ChecksumDamage as e:
            if e.kind != checksums.UNREADABLE:
                if rank == 0:
                    print(f"WARNING: {path}, newer than the checkpoint this run loads, is damaged "
                          f"({_first_line(e).split(';')[0]}); this run may write over it", flush=True)
                continue
            return start, [it]
        except CheckpointError:  # its manifest unreadable, or a rank could not check it: keep it
            return start, [it]
        return start, [it]
    return start, []


def _untracked_message(root: str, flag: str) -> str:
    """One line for complete ``iter_*`` folders under ``root`` without a tracker naming them."""
    newest = newest_complete_checkpoint(root)
    if newest is None:
        it = complete_iterations(root)[0]
        file, what = find_damage(checkpoint_dir(root, it))
        found = f"{checkpoint_dir(root, it)} is a complete but damaged checkpoint ({file}: {what})"
        way = "restore it, or pass --overwrite-checkpoints to train from scratch over it"
    else:
        found = f"{newest[1]} is a complete checkpoint (the newest there)"
        way = (f"resume from it with --load {root} --ckpt-step {newest[0]}, choose another --save, or pass "
               f"--overwrite-checkpoints to train from scratch over it")
    return f"{flag} {root}: no {TRACKER} (missing or deleted), but {found} that this run would write over; {way}"


def scheduler_mismatch_message(error: AssertionError, path: str) -> str:
    """megatron-core's OptimizerParamScheduler assertion -> one line naming the flag and the way out."""
    import re

    flags = {
        "learning rate": "--lr", "minimum learning rate": "--min-lr",
        "warmup iterations": "--lr-warmup-iters/--lr-warmup-fraction (or --global-batch-size)",
        "total number of iterations": "--lr-decay-iters/--train-iters (or --global-batch-size)",
        "learning rate decay style": "--lr-decay-style", "start weight decay": "--start-weight-decay/--weight-decay",
        "end weight decay": "--end-weight-decay/--weight-decay",
        "total number of weight decay iterations": "--train-iters (or --global-batch-size)",
        "weight decay incr style": "--weight-decay-incr-style",
    }
    m = re.search(r"class input value (.*?) and checkpoint\s*value (.*?) for (.*?) do not match", str(error))
    if m is None:
        what = str(error).strip().splitlines()[0] if str(error).strip() else "a scheduler value"
    else:
        now, saved, name = m.groups()
        # The scheduler counts samples; megatron-core's names say iterations.
        what = f"{flags.get(name, name)} changed: {name.replace('iterations', 'samples')} {saved} in the checkpoint, {now} now"
    return (f"{path}: {what}; pass --override-opt-param-scheduler to use this run's values or "
            "--use-checkpoint-opt-param-scheduler to keep the checkpoint's")


def restore_schedule(scheduler, common: Dict[str, Any], path: str, log=print) -> None:
    """Put the LR/weight-decay schedule where the checkpoint ``common`` left it, with or without its
    optimizer state: its saved scheduler state, or (a checkpoint saved without one) the schedule advanced
    to its consumed samples, said in one line."""
    state = common.get("opt_param_scheduler")
    if state is not None:
        try:
            scheduler.load_state_dict(state)
        except AssertionError as e:
            raise CheckpointError(scheduler_mismatch_message(e, path)) from None
        return
    consumed = int(common.get("consumed_train_samples", 0) or 0)
    if consumed == 0:  # e.g. an imported model at iteration 0: the fresh schedule is the right one
        return
    scheduler.step(increment=consumed)  # the schedule counts samples (Megatron-LM)
    log(f"WARNING: {path} holds no learning-rate scheduler state: the schedule is advanced to its "
        f"{consumed} consumed samples (iteration {common.get('iteration')})")


def _structure_mismatch(name: str, saved, current, saved_layout: Dict[str, Any], layout: Dict[str, int],
                        path: str) -> str:
    """One line for a structural argument that differs from the checkpoint's.

    The padded vocabulary is derived from the tensor-parallel size, so a TP change shows up there
    first: name the TP change and the converter instead of the derived number.
    """
    if name == "padded_vocab_size" and saved_layout.get("tp") not in (None, layout["tp"]):
        return (f"{path}: saved at TP={saved_layout['tp']}, this run has TP={layout['tp']} (padded vocabulary "
                f"{saved} -> {current}); convert it first: python tools/convert_checkpoint.py reshard "
                f"--load CKPT --save NEW --target-tp {layout['tp']} --target-pp {layout['pp']}")
    if name == "padded_vocab_size":
        return (f"{path}: padded vocabulary {saved} in the checkpoint, {current} in this run (another tokenizer, or "
                "another --make-vocab-size-divisible-by); give the checkpoint's tokenizer and settings")
    flag = f"--{name.replace('_', '-')}"
    was = f"with {_as_flag(flag, saved)}" if _as_flag(flag, saved) else f"without {flag}"
    why = (" (the learned position table has a row per position; it defaults to --seq-length)"
           if name == "max_position_embeddings" else "")
    return (f"{path} was saved {was} but this run has {_as_flag(flag, current) or f'no {flag}'}{why}; give the "
            f"checkpoint's setting")


def _as_flag(flag: str, value) -> str:
    """A structural argument's value as on the command line; "" for None and False (the flag not given)."""
    if value is None or value is False:
        return ""
    return flag if value is True else f"{flag} {value}"


def _ckpt_step_hint(it: int, path: str) -> str:
    return f"resume from it with --ckpt-step {it}"


def strictness_refusal(error: BaseException, strict: str, path: str) -> Optional[str]:
    """The one line for dist_checkpointing's key-mismatch error under a raising ``--dist-ckpt-strictness``
    (None for any other error)."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    text = str(error)
    if not (strict.startswith("raise") and isinstance(error, CheckpointingException)
            and ("Missing keys" in text or "Unexpected keys" in text)):
        return None
    found = {}
    for what, name in (("Missing keys (for all ranks): ", "in the checkpoint but not loaded by this run"),
                       ("Unexpected keys (for this rank): ", "asked for by this run but not in the checkpoint")):
        if what in text:
            keys = sorted(re.findall(r"'([^']+)'", text.split(what, 1)[1].split(". ", 1)[0]))
            found[name] = keys
    said = "; ".join(f"{len(k)} {name} (e.g. {k[0]})" if k else name for name, k in found.items())
    return (f"--dist-ckpt-strictness {strict}: {path}: {said}; load with --dist-ckpt-strictness log_all to see "
            "them and go on")


def load_checkpoint(root: str, model, optimizer, scheduler, *, run_args: Dict[str, Any], load_optim: bool = True,
                    load_rng: bool = True, finetune: bool = False, exit_on_missing: bool = False,
                    iteration: Optional[int] = None, verify: bool = True, allow_missing_checksums: bool = False,
                    log=print) -> Optional[Dict[str, Any]]:
    """Load the newest complete checkpoint under ``root`` (or ``iteration``'s) into model/optimizer/scheduler/RNG.

    A damaged file is refused in one line naming it and the newest complete older checkpoint
    (``--ckpt-step N`` loads that one); nothing is loaded from a damaged checkpoint. ``verify``: check
    the files against their recorded checksums too (:func:`verify_checksums`), not only their sizes;
    ``allow_missing_checksums``: a checkpoint whose save recorded them may be loaded without them. Its
    ``config.yaml`` must agree with the arguments saved inside it (every key).

    ``run_args``: this run's resolved arguments (the model structure must match the checkpoint's).
    ``finetune``: model weights only, from iteration 0. Returns the checkpoint's common state (iteration,
    consumed samples, counters, args), or None when there is no checkpoint (the run starts from scratch).
    """
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy

    from megatron_lev.models.checkpoint_keys import KeyMatch, saved_keys

    found = _checkpoint_to_load(root, iteration, exit_on_missing)
    if found is None:
        log(f"WARNING: --load {root}: no checkpoint found; training from scratch")
        return None
    iteration, path = found
    try:  # sizes, the files a save writes last and config.yaml, here; the ranks agree on the verdict below
        check_intact(root, iteration, path, _ckpt_step_hint, checksums=False)
        common = load_common(path)  # refuses, in one line, a checkpoint of a newer megatron-core
        cfg_path = os.path.join(path, CONFIG_NAME)
        local_error = config_mismatch(cfg_path, _read_yaml(cfg_path), common.get("args"))
    except CheckpointError as e:
        local_error = str(e)
    except OSError as e:
        local_error = f"{path}: cannot be checked ({type(e).__name__}: {_first_line(e)})"
    verify_checksums(root, iteration, path, _ckpt_step_hint, log, local_error=local_error, checksums_on=verify,
                     allow_missing=allow_missing_checksums)
    saved_args = common.get("args", {})
    check_checkpoint_tokenizer(saved_args, run_args.get("tokenizer_fingerprint"), run_args.get("tokenizer_type"),
                               path, allow_mismatch=bool(run_args.get("allow_tokenizer_mismatch")), log=log)
    for name in STRUCTURE_ARGS:
        if name == "max_position_embeddings" and saved_args.get("position_embedding_type") != "learned_absolute":
            continue  # only a learned position table is shaped by it (rotary positions have no parameters)
        if name in saved_args and saved_args[name] != run_args.get(name):
            raise CheckpointError(_structure_mismatch(name, saved_args[name], run_args.get(name),
                                                      _saved_layout(common), _layout(), path))
    same_layout = _saved_layout(common) == _layout()
    want_rng = load_rng and not finetune
    load_optim = load_optim and not finetune and "optimizer" in _saved_keys(common, path)
    load_rng = want_rng and same_layout
    sharding = common.get("optim_sharding_type", "dp_reshardable")
    layout = _layout()
    saved_layout = _saved_layout(common)
    if load_optim and sharding == "dp_reshardable" and any(
            saved_layout.get(k) != layout[k] for k in ("tp", "pp", "ep", "etp")):
        raise CheckpointError(
            f"{path}: optimizer state saved at TP={saved_layout.get('tp')} PP={saved_layout.get('pp')} "
            f"EP={saved_layout.get('ep')} ETP={saved_layout.get('etp')} (dp_reshardable) cannot be loaded at "
            f"TP={layout['tp']} PP={layout['pp']} EP={layout['ep']} ETP={layout['etp']}; pass --no-load-optim "
            "(or save with --dist-ckpt-optim-fully-reshardable)")
    saved, match = saved_keys(path), KeyMatch()
    state = _sharded_state_dict(model, optimizer, include_optim=load_optim, include_rng=load_rng, is_loading=True,
                                sharding_type=sharding, saved=saved, match=match)
    strategy = _load_strategy(path, fully_parallel=bool(run_args.get("ckpt_fully_parallel_load")))
    strict = run_args.get("dist_ckpt_strictness") or "assume_ok_unexpected"  # --dist-ckpt-strictness
    try:
        loaded = _read(state, path, sharded_strategy=strategy, strict=strict)
    except CheckpointError:
        raise
    except Exception as e:
        mismatch = strictness_refusal(e, strict, path)
        if mismatch is not None:
            raise CheckpointError(mismatch) from None
        if isinstance(e, ValueError) and "'param_groups'" in str(e):  # another count of param groups
            raise CheckpointError(_param_groups_refusal(path, e)) from None
        # damage the file checks cannot see (bytes changed inside a shard)
        reason = str(e) if isinstance(e, CheckpointReadError) else _first_line(e)
        raise CheckpointError(damaged_checkpoint_message(root, iteration, path, path, f"cannot be read ({reason})",
                                                         _ckpt_step_hint)) from None
    _restore_model(model, loaded)
    for note in match.describe(saved):
        log(f"  {path}: {note}")
    if load_optim:
        _step_zero_where_unsaved(loaded["optimizer"])
        _mark_decoupled_groups(loaded["optimizer"], optimizer)
        try:
            with torch.no_grad():  # fp32 main params are views of the model's (leaf) parameters
                optimizer.load_state_dict(loaded["optimizer"])
        except (KeyError, ValueError) as e:  # megatron-core finds no saved param group for one of the run's
            raise CheckpointError(_param_groups_refusal(path, e)) from None
        _unshare_adam_steps(optimizer)
    elif optimizer is not None and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()
    if scheduler is not None and not finetune:
        restore_schedule(scheduler, common, path, log)
    if load_rng:
        _set_rng_state(loaded["rng_state"])
    elif want_rng:
        log(f"WARNING: checkpoint layout {saved_layout} differs from this run's {_layout()}: "
            "RNG states not restored")
    log(f"  successfully loaded checkpoint from {root} at iteration {iteration}")
    if finetune:
        return {"iteration": 0, "consumed_train_samples": 0, "counters": {}, "args": saved_args}
    return {"iteration": common.get("iteration", iteration),
            "consumed_train_samples": common.get("consumed_train_samples", 0),
            "counters": common.get("counters", {}), "args": saved_args}


def _param_groups_refusal(path: str, error: BaseException) -> str:
    """The line for an optimizer state saved with other param groups than the run's."""
    return (f"{path}: its optimizer state does not fit this run's parameter groups ({_first_line(error)}); give "
            "the checkpoint's optimizer settings (--decoupled-lr, --decoupled-min-lr, --lr, --min-lr), or pass "
            "--no-load-optim to start the optimizer afresh")


def _checkpoint_to_load(root: str, iteration: Optional[int], exit_on_missing: bool) -> Optional[Tuple[int, str]]:
    """Collective. (iteration, directory) of the checkpoint under ``root`` to load (``iteration``'s, else the
    tracker's), or None to train from scratch; a refusal is :class:`CheckpointError` on every rank. Rank 0
    looks and sends what it found: a rank's own look at the tracker could differ (a save of another job
    completing while the ranks start, a node whose filesystem cache still holds the previous tracker), and
    a rank that trains from scratch or loads another iteration than the others leaves them waiting in the
    load's collectives."""
    from megatron_lev.parallel.collectives import broadcast_object

    if torch.distributed.get_rank() == 0:
        try:
            if iteration is not None:
                path = checkpoint_dir(root, iteration)
                if not all(os.path.isfile(os.path.join(path, n)) for n in ("metadata.json", CONFIG_NAME)):
                    raise CheckpointError(f"--ckpt-step {iteration}: {path} is not a complete checkpoint")
                sent = (iteration, path)
            else:
                sent = find_checkpoint(root, _ckpt_step_hint) if os.path.isdir(root) else None
            if sent is None and complete_iterations(root):
                raise CheckpointError(_untracked_message(root, "--load"))
            if sent is None and exit_on_missing:
                raise CheckpointError(f"--load {root}: no checkpoint found ({TRACKER} missing)")
        except CheckpointError as e:
            sent = str(e)
        except OSError as e:
            sent = f"--load {root}: cannot be read ({_first_line(e)})"
    got = broadcast_object(sent if torch.distributed.get_rank() == 0 else None)
    if isinstance(got, str):
        raise CheckpointError(got)
    return None if got is None else (int(got[0]), got[1])


def _saved_keys(common: Dict[str, Any], path: str) -> set:
    """Top-level keys holding sharded data in the checkpoint (from its tensor metadata)."""
    from megatron.core import dist_checkpointing

    try:
        meta = dist_checkpointing.load_tensors_metadata(path)
    except Exception:  # pragma: no cover - metadata unreadable: assume everything is there
        return {"optimizer"}
    keys = {k.split(".")[0] for k in meta}
    # A chained optimizer (the dense and the expert parameters of an MoE model) saves under chained_<i>.
    if any(k.startswith(("optimizer", "chained_")) for k in meta):
        keys.add("optimizer")
    return keys
