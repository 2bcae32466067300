"""Flush services: async real-time flush, group commit (sync flush), consume-queue flush, checkpoint.

None of them holds the put lock: they read positions and call ``fdatasync``,
which releases the GIL, so producers keep appending while the disk works.
A failing ``fdatasync`` (EIO, ENOSPC) turns the store read-only with the reason.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from .service import ServiceThread

if TYPE_CHECKING:
    from .store import MessageStore

log = logging.getLogger(__name__)


class FlushRealTimeService(ServiceThread):
    """ASYNC_FLUSH: every flushIntervalCommitLog, flush when enough pages are dirty; thoroughly every 10 s."""

    name = "FlushRealTimeService"

    def __init__(self, store: "MessageStore") -> None:
        super().__init__(interval=store.config.flushIntervalCommitLog / 1000)
        self.store = store
        self.last_thorough = 0.0

    def run_once(self) -> None:
        cfg = self.store.config
        now = time.monotonic()
        thorough = (now - self.last_thorough) * 1000 >= cfg.flushCommitLogThoroughInterval
        if thorough:
            self.last_thorough = now
        self.store.flush_commitlog(0 if thorough else cfg.flushCommitLogLeastPages, thorough)

    def on_shutdown(self) -> None:
        for _ in range(10):
            if self.store.flush_commitlog(0, True):
                break


class GroupCommitService(ServiceThread):
    """SYNC_FLUSH: one fdatasync serves every producer waiting when it starts.

    Leader/follower: the first producer that finds no flush under way calls
    ``fdatasync`` itself, for everything written so far; producers arriving
    meanwhile wait on one condition and are all released when it returns
    (the next leader steps up if their bytes came too late).  There is no
    hand-off to another thread on the hot path.  The service thread only
    flushes for messages put with ``WAIT=false``.

    A leader released together with other producers first gives them up to
    ``GATHER_SECONDS`` to append their next message and wait again (it is woken
    as soon as they all have): without that it would flush only its own
    message while they are still writing theirs, and every fdatasync would
    cover half the producers.  A lone producer never waits.
    """

    name = "GroupCommitService"
    GATHER_SECONDS = 0.001

    def __init__(self, store: "MessageStore") -> None:
        super().__init__(interval=0.01)
        self.store = store
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # producers wait here for a flush
        self._gathered = threading.Condition(lock)  # a leader waits here for the others to append
        self._flushing = False
        self._wanted = 0
        self._arrived = 0  # producers that began waiting since the current leader took over
        self._group = 1  # producers the last flush released (the leader included)
        self.failed = False

    def wait_flushed(self, next_offset: int, timeout: float) -> bool:
        """Block until the log is durable up to ``next_offset``; False on timeout or a flush error."""
        queue = self.store.commitlog.queue
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                while queue.flushed_where < next_offset and not self.failed and self._flushing:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    self._arrived += 1
                    if self._arrived >= self._group - 1:
                        self._gathered.notify()
                    self._cond.wait(remaining)
                if queue.flushed_where >= next_offset or self.failed:
                    return not self.failed and queue.flushed_where >= next_offset
                self._flushing = True  # this producer leads the next flush
                self._arrived = 0
                if self._group > 1:
                    self._gathered.wait_for(lambda: self._arrived >= self._group - 1, self.GATHER_SECONDS)
            self._flush_up_to(self.store.commitlog.max_offset())

    def request(self, next_offset: int) -> None:
        """Ask for a flush without waiting (WAIT=false messages)."""
        with self._cond:
            if next_offset > self._wanted:
                self._wanted = next_offset
        self.wakeup()

    def _flush_up_to(self, target: int) -> None:
        """Flush as the leader (``_flushing`` is set), then release every waiter."""
        store = self.store
        try:
            for _ in range(1000):
                if store.commitlog.queue.flushed_where >= target:
                    break
                if not store.flush_commitlog(0, True) and store.flush_error:
                    self.failed = True
                    break
        finally:
            with self._cond:
                self._flushing = False
                self._group = self._arrived + 1
                self._cond.notify_all()

    def run_once(self) -> None:
        if self.store.commitlog.queue.flushed_where >= self._wanted:
            return
        with self._cond:
            if self._flushing:
                return
            self._flushing = True
            self._arrived = 0
        self._flush_up_to(self._wanted)

    def on_shutdown(self) -> None:
        self._wanted = self.store.commitlog.max_offset()
        self.run_once()


class FlushConsumeQueueService(ServiceThread):
    """Flush consume queues every flushIntervalConsumeQueue; thoroughly (and the checkpoint) every 60 s."""

    name = "FlushConsumeQueueService"

    def __init__(self, store: "MessageStore") -> None:
        super().__init__(interval=store.config.flushIntervalConsumeQueue / 1000)
        self.store = store
        self.last_thorough = 0.0

    def run_once(self, force: bool = False) -> None:
        cfg = self.store.config
        now = time.monotonic()
        thorough = force or (now - self.last_thorough) * 1000 >= cfg.flushConsumeQueueThoroughInterval
        if thorough:
            self.last_thorough = now
        logics_ts = self.store.checkpoint.logicsMsgTimestamp
        for cq in self.store.consume_queues():
            cq.flush(0 if thorough else cfg.flushConsumeQueueLeastPages)
        if thorough:
            self.store.checkpoint.logicsMsgTimestamp = logics_ts
            self.store.flush_checkpoint()

    def on_shutdown(self) -> None:
        self.run_once(force=True)


class CheckpointService(ServiceThread):
    """Rewrites the checkpoint page every second, as RocketMQ's scheduled task does."""

    name = "StoreCheckpointService"

    def __init__(self, store: "MessageStore") -> None:
        super().__init__(interval=1.0, initial_delay=1.0)
        self.store = store

    def run_once(self) -> None:
        self.store.flush_checkpoint()
