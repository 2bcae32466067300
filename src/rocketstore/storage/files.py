"""StoreFiles: the open files of one store and the tables over them.

Kafka's ``LocalLog`` under ``UnifiedLog``, RocketMQ's ``DefaultMessageStore``
without its threads: the commitlog, the consume-queue table, the index, the
checkpoint, the running flags, and the one store-wide rule over them that every
service needs (how far dispatch may read, how a flush failure turns the store
read-only).  ``MessageStore`` opens it; recovery, verify and the services
(flush, dispatch, clean, metrics, tier upload) are given it, so none of them
calls back into the facade.  It owns no thread and takes no lock but the
consume-queue table's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

from ..config import StoreConfig
from ..format import codec
from ..paths import StorePaths
from .checkpoint import StoreCheckpoint
from .commitlog import CommitLog
from .consume_queue import ConsumeQueue
from .index import IndexService
from .running_flags import RunningFlags

log = logging.getLogger(__name__)

QueueKey = tuple[str, int]


class InFiles:
    """An attribute of the facade, the reader or the loader that lives in their StoreFiles: one copy of each open
    file and table, whoever holds the files."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name.lstrip("_")

    def __get__(self, holder: Any, owner: type | None = None) -> Any:
        return self if holder is None else getattr(holder.files, self.name)

    def __set__(self, holder: Any, value: Any) -> None:
        setattr(holder.files, self.name, value)


class StoreFiles:
    """What a store has open: set up by StoreLoader, shared by the facade, the reader and every service."""

    def __init__(self, paths: StorePaths, config: StoreConfig, *, read_only: bool = False,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> None:
        self.paths = paths
        self.root = paths.root
        self.config = config
        self.read_only = read_only
        self.clock = clock  # seconds; injected by tests of retention and of the delete hour
        self.sleep = sleep
        self.running_flags = RunningFlags()
        self.flush_error: str | None = None
        self.closed = False
        # What the open found (recovery/load.py): no abort file = a clean shutdown; the abort file of this
        # OS boot = only the process crashed (every byte written through the maps is intact).
        self.last_exit_ok = True
        self.abort_file_present = False
        self.process_crash_only = False
        self.lost_queues: set[QueueKey] = set()  # read-only open: registered queues whose directory is gone
        self.commitlog: CommitLog = None  # type: ignore[assignment]  # opened by StoreLoader.load
        self.checkpoint: StoreCheckpoint = None  # type: ignore[assignment]
        self.index_service: IndexService = None  # type: ignore[assignment]
        self.tier: Any = None  # the TieredStorage (tier/), when tieredStoreUri is set
        self.cq_table: dict[QueueKey, ConsumeQueue] = {}
        self.cq_lock = threading.Lock()
        self.topic_queue_table: dict[QueueKey, int] = {}  # the next queue offset of each queue
        # While the store loads, queues named here are refilled from the commitlog by recovery: a unit is
        # placed at its record's queue offset (pad_gaps), never appended.
        self.queues_to_rebuild: list[str] = []
        # Called with the key of each queue made after loading (StoreLoader keeps the durable queue registry).
        self.on_new_queue: Callable[[QueueKey], None] = lambda key: None
        # Per-topic logical retention (topicRetentionMs) needs a time lookup that reaches the tier: StoreLoader
        # sets it to StoreReader's; without it nothing moves.
        self.apply_topic_retention: Callable[[], dict[QueueKey, int]] = lambda: {}
        # Before retention deletes a segment, StoreLoader saves each queue's next offset (the queue registry), so a
        # queue left with no unit never hands the offsets of its expired records out again.
        self.save_queue_registry: Callable[[], None] = lambda: None
        self.sync_flush = False  # a GroupCommitService runs: dispatch follows the flushed end, not the written one
        self.recovery_report: Any = None  # recovery/recover.py's RecoveryReport, once the store has recovered

    @property
    def loaded(self) -> bool:
        """Recovery has run: a queue made from now on is new, not a lost one being refilled."""
        return self.recovery_report is not None

    # ------------------------------------------------------------ queues
    def find_consume_queue(self, topic: str, queue_id: int) -> ConsumeQueue:
        """The queue's ConsumeQueue, made (with its directory) the first time a record names it."""
        key = (topic, queue_id)
        cq = self.cq_table.get(key)
        if cq is None:
            with self.cq_lock:
                cq = self.cq_table.get(key)
                if cq is None:
                    cq = ConsumeQueue(self.paths.consumequeue, topic, queue_id, self.config.mappedFileSizeConsumeQueue,
                                      read_only=self.read_only)
                    if not self.read_only:
                        os.makedirs(cq.directory, exist_ok=True)
                    if not self.loaded and f"{topic}/{queue_id}" in self.queues_to_rebuild:
                        cq.pad_gaps = True  # refilled by recovery: each unit placed at its queue offset
                    self.cq_table[key] = cq
                    if self.loaded:
                        self.on_new_queue(key)  # before its first unit: a lost directory is then noticed
        return cq

    def consume_queues(self) -> list[ConsumeQueue]:
        return list(self.cq_table.values())

    def queue_keys(self) -> list[QueueKey]:
        return sorted(self.cq_table)

    def recover_topic_queue_table(self) -> None:
        """The next queue offset of every queue from its units; units whose records are gone (below the
        local and the tier's minimum) are no longer readable."""
        min_phy = self.commitlog.min_offset_with_tier()  # units whose records are in the tier stay readable
        table = {}
        for key, cq in self.cq_table.items():
            table[key] = cq.max_offset_in_queue
            cq.correct_min_offset(min_phy)
        self.topic_queue_table = table
        self.apply_topic_retention()

    def queue_claiming(self, phy: int, topic: str, queue_id: int, queue_offset: int, sys_flag: int
                       ) -> tuple[str, int, int] | None:
        """(topic, queue id, queue offset) of another queue's unit pointing at the record at ``phy`` when the
        record's own queue (``topic``, ``queue_id``) has no unit ``queue_offset`` pointing there; else None.

        Dispatch writes a unit from its record's fields, so such a unit means
        the record's topic, queue id or queue offset was changed since (no CRC
        covers them): reading or dispatching it as it reads would misroute the
        message.  PREPARED and ROLLBACK records have no unit: never claimed.
        """
        if sys_flag & codec.TRANSACTION_MASK not in codec.QUEUED_TXN:
            return None
        own = self.cq_table.get((topic, queue_id))
        if own is not None and 0 <= queue_offset < 1 << 58:
            unit = own.get_unit(queue_offset)
            if unit is not None and unit[0] == phy:
                return None
        for (t, q), cq in list(self.cq_table.items()):  # its own queue too: at another offset
            if (i := cq.unit_pointing_at(phy)) is not None:
                return t, q, i
        return None

    # ------------------------------------------------------------ offsets
    def min_phy_offset(self) -> int:
        """The first offset of the local segments."""
        return self.commitlog.min_offset()

    def max_phy_offset(self) -> int:
        return self.commitlog.max_offset()

    def confirm_offset(self) -> int:
        """How far the dispatcher may read: the max offset (async) or what is flushed (sync)."""
        if self.sync_flush:
            return self.commitlog.queue.flushed_where
        return self.commitlog.max_offset()

    # ------------------------------------------------------------ flushing
    def flush_commitlog(self, least_pages: int, thorough: bool) -> bool:
        """One flush round of the commitlog; on an I/O error the store turns read-only."""
        try:
            done = self.commitlog.flush(least_pages)
        except OSError as e:
            self.flush_error = f"fdatasync of the commitlog failed: {os.strerror(e.errno or 0)} ({e})"
            self.running_flags.make_not_writeable(self.flush_error)
            log.error("%s: %s; store is now read-only", self.root, self.flush_error)
            return False
        if thorough:
            self.checkpoint.note_physic_flushed(self.commitlog.queue.store_timestamp, self.commitlog.queue.flushed_where)
        return done

    def flush_checkpoint(self) -> None:
        try:
            self.checkpoint.flush()
        except OSError as e:
            log.error("%s: checkpoint flush failed: %s", self.paths.checkpoint, e)

    def close(self) -> None:
        """Unmap and close every open file (no flush: the facade flushes what a clean close needs first)."""
        for obj in (self.commitlog, self.index_service):
            if obj is not None:
                obj.close()
        for cq in self.cq_table.values():
            cq.close()
