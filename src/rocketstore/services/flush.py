"""Flush services: async real-time flush, group commit (sync flush), consume-queue flush, checkpoint.

None of them holds the put lock: they read positions and call ``fdatasync``,
which releases the GIL, so producers keep appending while the disk works.
A failing ``fdatasync`` (EIO, ENOSPC) turns the store read-only with the reason.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from .base import ServiceThread

if TYPE_CHECKING:
    from ..storage.files import StoreFiles
    from .group_commit import GroupCommit

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
    """SYNC_FLUSH: leads the group commit's rounds (services.group_commit) while producers keep coming.

    A producer alone writes and flushes its own put in its own thread.  When
    others wait once its round is done, it passes the lead here and returns;
    this thread then takes every waiting put, writes them with one gathered
    write, calls ``fdatasync`` once and wakes them, round after round, until
    none waits (RocketMQ's GroupCommitService swapping its request lists).
    It also flushes for messages put with ``WAIT=false``.
    """

    name = "GroupCommitService"

    def __init__(self, files: "StoreFiles") -> None:
        super().__init__(interval=0.01)
        self.files = files
        self.commit: "GroupCommit | None" = None  # set by the store once the dispatcher exists

    def run_once(self) -> None:
        if self.commit is not None:
            self.commit.lead_as_service()

    def on_shutdown(self) -> None:
        if self.commit is not None:  # leads what is left (its own thread: wait_flushed leads here)
            self.commit.wait_flushed(self.files.commitlog.max_offset(), 30.0)


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
        dispatched_end = checkpoint.logics_dispatched_end
        units_end = dispatched_end  # (the queues' own: what the index missed does not hold it back)
        index = self.files.index_service
        if index.missed_from is not None:  # records the index missed: a crash must recover from them on
            dispatched = min(dispatched, index.missed_ts)
            dispatched_end = min(dispatched_end, index.missed_from)
        for cq in self.files.consume_queues():
            cq.flush(0 if thorough else cfg.flushConsumeQueueLeastPages)
            if thorough:
                cq.flush_dirty()  # every file with unsynced units, wherever the queue's flush point is
        if thorough:  # every queue is flushed whole: the checkpoint may say so
            if dispatched > checkpoint.logicsMsgTimestamp:
                checkpoint.logicsMsgTimestamp = dispatched
            if dispatched_end > checkpoint.logicsDispatchedOffset:
                checkpoint.logicsDispatchedOffset = dispatched_end
            if units_end > checkpoint.logics_units_flushed:
                checkpoint.logics_units_flushed = units_end
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
