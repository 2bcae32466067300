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

    Producers publish how far they need the log flushed and wait on one
    condition; the service flushes up to the furthest request and wakes them all.
    """

    name = "GroupCommitService"

    def __init__(self, store: "MessageStore") -> None:
        super().__init__(interval=0.01)
        self.store = store
        self._cond = threading.Condition()
        self._wanted = 0
        self.failed = False

    def wait_flushed(self, next_offset: int, timeout: float) -> bool:
        """Block until the log is durable up to ``next_offset``; False on timeout or a flush error."""
        queue = self.store.commitlog.queue
        with self._cond:
            if next_offset > self._wanted:
                self._wanted = next_offset
            self.wakeup()
            self._cond.wait_for(lambda: queue.flushed_where >= next_offset or self.failed or self.stopped, timeout)
            return queue.flushed_where >= next_offset and not self.failed

    def request(self, next_offset: int) -> None:
        """Ask for a flush without waiting (WAIT=false messages)."""
        with self._cond:
            if next_offset > self._wanted:
                self._wanted = next_offset
        self.wakeup()

    def run_once(self) -> None:
        store = self.store
        queue = store.commitlog.queue
        target = self._wanted
        if queue.flushed_where >= target:
            return
        for _ in range(1000):
            if queue.flushed_where >= target:
                break
            if not store.flush_commitlog(0, True) and store.flush_error:
                self.failed = True
                break
        with self._cond:
            self._cond.notify_all()

    def on_shutdown(self) -> None:
        self.run_once()
        with self._cond:
            self._cond.notify_all()


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
