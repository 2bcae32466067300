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


class _Request:
    __slots__ = ("next_offset", "done", "ok")

    def __init__(self, next_offset: int) -> None:
        self.next_offset = next_offset
        self.done = threading.Event()
        self.ok = False


class GroupCommitService(ServiceThread):
    """SYNC_FLUSH: one fdatasync serves every producer waiting when it starts."""

    name = "GroupCommitService"

    def __init__(self, store: "MessageStore") -> None:
        super().__init__(interval=0.01)
        self.store = store
        self._lock = threading.Lock()
        self._requests: list[_Request] = []

    def submit(self, next_offset: int) -> _Request:
        req = _Request(next_offset)
        with self._lock:
            self._requests.append(req)
        self.wakeup()
        return req

    def run_once(self) -> None:
        with self._lock:
            batch, self._requests = self._requests, []
        if not batch:
            return
        target = max(r.next_offset for r in batch)
        store = self.store
        ok = True
        for _ in range(1000):
            if store.commitlog.queue.flushed_where >= target:
                break
            if not store.flush_commitlog(0, True):
                if store.flush_error:
                    ok = False
                    break
        flushed = store.commitlog.queue.flushed_where
        for r in batch:
            r.ok = ok and flushed >= r.next_offset
            r.done.set()

    def on_shutdown(self) -> None:
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
