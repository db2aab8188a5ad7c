"""The lock of a checkpoint root: one training run at a time writes into a ``--save`` directory.

Two runs given the same ``--save`` would each replace the other's ``iter_*`` folders and tracker, and both
end well. So a run takes ``--save/run.lock`` before it writes anything there and removes it however it ends
(normally, on an error, SIGTERM or Ctrl-C). The file is JSON naming the holder: host, pid, start time,
command line, and what tells a dead holder from a live one on the same host (the boot, the pid namespace,
the process's start time, so a reused pid is not taken for the holder).

- Taken atomically: the holder's record is written under a private name and hard-linked to ``run.lock``
  (a link fails where the name exists, on NFS as on a local disk); where the filesystem has no hard
  links, ``O_CREAT | O_EXCL``.
- A lock whose holder is gone (on this host, in this pid namespace: no such process, another process
  under its pid, a process that ended but is not yet collected by its parent, or the host rebooted since)
  is stale: taken over with one notice line. It is first renamed aside and read back, so two runs taking
  over the same stale lock cannot both win.
- A lock held by a live process, or by one this host cannot check (another host, another container), is
  a refusal in one line naming the holder and the file to remove if that run is gone.
- Readers (evaluation, the conversions) never need it: a checkpoint is complete once the tracker names it.

Plain functions over paths; on several ranks, rank 0 takes it and the caller sends the verdict.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from .files import CheckpointError

LOCK_NAME = "run.lock"


class SaveLockError(CheckpointError):
    """``--save`` is locked by another run (one line naming it), or its lock cannot be taken."""


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, "r", encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def _process_stat(pid: int) -> Optional[List[str]]:
    """The fields of ``/proc/PID/stat`` from the state on (field 3: ``[0]`` is the state, ``[19]`` the
    start time in clock ticks since boot), or None."""
    text = _read_text(f"/proc/{pid}/stat")
    if not text:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    return fields if len(fields) > 19 else None


def _process_start(pid: int) -> Optional[str]:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22), or None."""
    stat = _process_stat(pid)
    return stat[19] if stat else None


def _pid_namespace() -> Optional[str]:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def this_process() -> Dict[str, Any]:
    """The lock record of this process."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime()),
            "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:])[:500] if sys.argv else "",
            "boot_id": _read_text("/proc/sys/kernel/random/boot_id"), "pid_namespace": _pid_namespace(),
            "pid_start": _process_start(pid), "token": uuid.uuid4().hex}


def holder_is_gone(holder: Dict[str, Any]) -> bool:
    """Whether the process ``holder`` names has certainly ended: only decidable on its own host, in its own
    pid namespace (elsewhere: False)."""
    me = this_process()
    if holder.get("host") != me["host"]:
        return False
    if holder.get("boot_id") and me["boot_id"] and holder["boot_id"] != me["boot_id"]:
        return True  # the host rebooted since the lock was taken
    if holder.get("pid_namespace") != me["pid_namespace"]:
        return False  # a container sharing the host name: its pids are not ours to look up
    try:
        pid = int(holder["pid"])
    except (KeyError, TypeError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    stat = _process_stat(pid)
    if stat and stat[0] in ("Z", "X"):
        # Ended, not yet collected by its parent (a rank whose launcher was killed waits for init to
        # reap it): it writes nothing more.
        return True
    started = stat[19] if stat else None
    return bool(holder.get("pid_start") and started and started != holder["pid_start"])  # pid reused


def describe(holder: Dict[str, Any]) -> str:
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {holder.get('started', '?')}"


def _publish(path: str, record: Dict[str, Any]) -> bool:
    """Create ``path`` holding ``record``, atomically; False when it exists."""
    body = json.dumps(record, indent=1, sort_keys=True) + "\n"
    tmp = f"{path}.{record['token']}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links on this filesystem
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(body)
        return True
    finally:
        os.unlink(tmp)


def read_lock(path: str) -> Optional[Dict[str, Any]]:
    """The record in the lock file ``path``; None when there is none; ``{}`` when it is not a record (being
    written without hard links, or not this release's)."""
    text = _read_text(path)
    if text is None:
        return None if not os.path.exists(path) else {}
    try:
        record = json.loads(text)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


@dataclass
class SaveLock:
    """A lock this process holds; :meth:`release` removes it (if it is still this process's)."""

    path: str
    record: Dict[str, Any]

    def release(self) -> None:
        held = read_lock(self.path)
        if held and held.get("token") == self.record["token"]:
            try:
                os.unlink(self.path)
            except OSError:  # --save removed or made read-only meanwhile: nothing more to do
                pass


def _take_over(path: str, stale: Dict[str, Any]) -> bool:
    """Remove the stale lock ``stale`` at ``path`` (True), unless another run replaced it meanwhile (then
    put back: False)."""
    aside = f"{path}.stale.{uuid.uuid4().hex}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # another run took it over first
        return False
    if read_lock(aside) == stale:
        os.unlink(aside)
        return True
    try:  # not the stale lock any more: another run's, taken over since we read it
        os.link(aside, path)
    except OSError:
        pass
    os.unlink(aside)
    return False


def take_save_lock(root: str, *, flag: str = "--save", log: Callable[[str], None] = print,
                   attempts: int = 20) -> SaveLock:
    """Take the lock of the checkpoint root ``root`` (created if missing) for this process; a live holder
    is :class:`SaveLockError` (one line naming it), a gone one is taken over with one ``log`` line."""
    path = os.path.join(root, LOCK_NAME)
    record = this_process()
    try:
        os.makedirs(root, exist_ok=True)
        for _ in range(attempts):
            if _publish(path, record):
                return SaveLock(path, record)
            holder = read_lock(path)
            if holder is None:  # released between the two looks
                continue
            if not holder:  # being written by a run without hard links, or not a lock record
                time.sleep(0.05)
                holder = read_lock(path)
                if holder is None:
                    continue
                if not holder:
                    raise SaveLockError(f"{flag} {root}: {path} is not a lock record this release reads; remove it "
                                        "if no run is writing checkpoints there")
            if not holder_is_gone(holder):
                raise SaveLockError(
                    f"{flag} {root}: another run is writing its checkpoints there ({describe(holder)}; lock file "
                    f"{path}); wait for it to end or choose another {flag} (if that run is gone, remove the lock "
                    "file)")
            if _take_over(path, holder):
                log(f"WARNING: {flag} {root}: took over the lock of a run that is gone ({describe(holder)})")
    except OSError as e:
        raise SaveLockError(f"{flag} {root}: cannot take its lock {path} ({type(e).__name__}: "
                            f"{e.strerror or e})") from None
    raise SaveLockError(f"{flag} {root}: its lock {path} changed hands {attempts} times while this run tried to "
                        "take it; is another run starting there?")
