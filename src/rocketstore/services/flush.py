"""Flush services: async real-time flush, group commit (sync flush), consume-queue flush, checkpoint.

None of them holds the put lock: they read positions and call ``fdatasync``,
which releases the GIL, so producers keep appending while the disk works.
A failing ``fdatasync`` (EIO, ENOSPC) turns the store read-only with the reason.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from .base import ServiceThread

if TYPE_CHECKING:
    from ..storage.files import StoreFiles

log = logging.getLogger(__name__)


class FlushRealTimeService(ServiceThread):
    """ASYNC_FLUSH: every flushIntervalCommitLog, flush when enough pages are dirty; thoroughly every 10 s."""

    name = "FlushRealTimeService"

    def __init__(self, files: "StoreFiles") -> None:
        super().__init__(interval=files.config.flushIntervalCommitLog / 1000)
        self.files = files
        self.last_thorough = 0.0

    def run_once(self) -> None:
        cfg = self.files.config
        now = time.monotonic()
        thorough = (now - self.last_thorough) * 1000 >= cfg.flushCommitLogThoroughInterval
        if thorough:
            self.last_thorough = now
        self.files.flush_commitlog(0 if thorough else cfg.flushCommitLogLeastPages, thorough)

    def on_shutdown(self) -> None:
        for _ in range(10):
            if self.files.flush_commitlog(0, True):
                break


class GroupCommitService(ServiceThread):
    """SYNC_FLUSH: one fdatasync serves every producer waiting when it starts.

    Leader/follower: a producer that finds no flush under way calls
    ``fdatasync`` itself, for everything written so far; producers arriving
    meanwhile park, each on a lock of its own.  When the flush returns, the
    leader wakes the first producer it covered and each woken producer wakes
    the next before it returns: one thread at a time asks for the GIL, where
    waking them all at once had sixteen threads fight for it (and for a shared
    condition lock) on two cores.  The first producer left over, if any, is
    woken to lead the next flush, which then overlaps with the rest of the
    chain.  There is no hand-off to another thread on the hot path; the service
    thread only flushes for messages put with ``WAIT=false``.
    """

    name = "GroupCommitService"

    def __init__(self, files: "StoreFiles") -> None:
        super().__init__(interval=0.01)
        self.files = files
        self._lock = threading.Lock()  # guards _flushing and _parked
        self._flushing = False
        self._parked: list[tuple[int, threading.Lock]] = []  # (offset to be durable, the producer's parking lock)
        self._to_wake: deque[threading.Lock] = deque()  # released by the last flush, woken one after another
        self._wanted = 0
        self.failed = False

    def wait_flushed(self, next_offset: int, timeout: float) -> bool:
        """Block until the log is durable up to ``next_offset``; False on timeout or a flush error."""
        queue = self.files.commitlog.queue
        deadline = time.monotonic() + timeout
        while queue.flushed_where < next_offset and not self.failed:
            with self._lock:
                if queue.flushed_where >= next_offset or self.failed:
                    break
                lead = not self._flushing
                if lead:
                    self._flushing = True
                else:
                    park = threading.Lock()
                    park.acquire()
                    self._parked.append((next_offset, park))
            if lead:
                self._flush_up_to(self.files.commitlog.max_offset())
            elif not self._park(next_offset, park, deadline):
                return False
        return not self.failed and queue.flushed_where >= next_offset

    def _park(self, next_offset: int, park: threading.Lock, deadline: float) -> bool:
        """Wait to be woken by a flush (then wake the next producer); False on timeout."""
        if not park.acquire(timeout=max(0.0, deadline - time.monotonic())):
            with self._lock:
                if (next_offset, park) in self._parked:
                    self._parked.remove((next_offset, park))
                    return False
            park.acquire()  # a flush has just released it: take part in the chain after all
        self._wake_next()
        return True

    def _wake_next(self) -> None:
        try:
            self._to_wake.popleft().release()
        except IndexError:
            pass

    def request(self, next_offset: int) -> None:
        """Ask for a flush without waiting (WAIT=false messages)."""
        with self._lock:
            if next_offset > self._wanted:
                self._wanted = next_offset
        self.wakeup()

    def _flush_up_to(self, target: int) -> None:
        """Flush as the leader (``_flushing`` is set), then wake the producers it covered, one after another."""
        files = self.files
        queue = files.commitlog.queue
        try:
            for _ in range(1000):
                if queue.flushed_where >= target:
                    break
                if not files.flush_commitlog(0, True) and files.flush_error:
                    self.failed = True
                    break
        finally:
            with self._lock:
                self._flushing = False
                done = queue.flushed_where
                covered = [p for off, p in self._parked if off <= done or self.failed]
                self._parked = [(off, p) for off, p in self._parked if off > done and not self.failed]
                if self._parked:  # the first producer left over leads the next flush
                    covered.append(self._parked.pop(0)[1])
                self._to_wake.extend(covered)
            self._wake_next()

    def run_once(self) -> None:
        if self.files.commitlog.queue.flushed_where >= self._wanted:
            return
        with self._lock:
            if self._flushing:
                return
            self._flushing = True
        self._flush_up_to(self._wanted)

    def on_shutdown(self) -> None:
        self._wanted = self.files.commitlog.max_offset()
        self.run_once()


class FlushConsumeQueueService(ServiceThread):
    """Flush consume queues every flushIntervalConsumeQueue; thoroughly (and the checkpoint) every 60 s.

    Only a thorough round advances the checkpoint's logicsMsgTimestamp, to the store time dispatched
    before the round began: what the rounds in between flush is partial (a quiet queue's file may never
    reach ``flushConsumeQueueLeastPages``).  Recovery after a power loss re-dispatches from that time, so
    it must hold for every queue: see data-safety rule 3."""

    name = "FlushConsumeQueueService"

    def __init__(self, files: "StoreFiles") -> None:
        super().__init__(interval=files.config.flushIntervalConsumeQueue / 1000)
        self.files = files
        self.last_thorough = 0.0

    def run_once(self, force: bool = False) -> None:
        cfg = self.files.config
        now = time.monotonic()
        thorough = force or (now - self.last_thorough) * 1000 >= cfg.flushConsumeQueueThoroughInterval
        if thorough:
            self.last_thorough = now
        checkpoint = self.files.checkpoint
        dispatched = checkpoint.logics_dispatched  # read first: every unit up to it is in the queues' maps
        index = self.files.index_service
        if index.missed_from is not None:  # records the index missed: a crash must recover from them on
            dispatched = min(dispatched, index.missed_ts)
        for cq in self.files.consume_queues():
            cq.flush(0 if thorough else cfg.flushConsumeQueueLeastPages)
            if thorough:
                cq.flush_dirty()  # every file with unsynced units, wherever the queue's flush point is
        if thorough:  # every queue is flushed whole: the checkpoint may say so
            if dispatched > checkpoint.logicsMsgTimestamp:
                checkpoint.logicsMsgTimestamp = dispatched
            self.files.flush_checkpoint()

    def on_shutdown(self) -> None:
        self.run_once(force=True)


class CheckpointService(ServiceThread):
    """Rewrites the checkpoint page every second, as RocketMQ's scheduled task does."""

    name = "StoreCheckpointService"

    def __init__(self, files: "StoreFiles") -> None:
        super().__init__(interval=1.0, initial_delay=1.0)
        self.files = files

    def run_once(self) -> None:
        self.files.flush_checkpoint()
