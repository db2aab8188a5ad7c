"""The checkpoint writers' result-queue server cannot keep a rank from exiting (checkpoint.sharded).

multiprocessing's own exit hook gives a manager 1 s, then SIGTERM (which this server ignores), then joins
without a limit; ``_stop_write_queue`` ends a server that does not stop with SIGKILL."""

from __future__ import annotations

import multiprocessing as mp
import signal
import time

from megatron_lev.checkpoint.sharded import _stop_write_queue


def _deaf_server(ready):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    while True:
        time.sleep(1)


class _DeafManager:
    """A manager whose shutdown request is not answered (a server too slow, or stuck)."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.ready = ctx.Event()
        self._process = ctx.Process(target=_deaf_server, args=(self.ready,))
        self._process.start()
        self.shutdown_calls = 0

    def shutdown(self):
        self.shutdown_calls += 1
        self._process.terminate()  # what multiprocessing's own finaliser ends with


def test_a_server_that_does_not_stop_is_killed():
    manager = _DeafManager()
    try:
        assert manager.ready.wait(60)  # the child ignores SIGTERM from here on
        _stop_write_queue(manager, wait_s=1.0)
        assert manager.shutdown_calls == 1
        assert not manager._process.is_alive()
        assert manager._process.exitcode == -signal.SIGKILL
    finally:
        if manager._process.is_alive():
            manager._process.kill()


def test_a_real_write_queue_server_stops_at_once():
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start()
    manager.Queue().put(1)
    _stop_write_queue(manager, wait_s=30.0)
    assert manager._process.exitcode == 0
