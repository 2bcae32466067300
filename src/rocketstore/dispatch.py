"""Dispatch: turning CommitLog records into ConsumeQueue units and index entries.

``DispatchRequest`` is what one record contributes; ``CommitLogDispatcher``
applies it (used by recovery, rebuilds and the live ReputMessageService,
which follows the CommitLog's confirmed end in its own thread).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from itertools import repeat
from typing import TYPE_CHECKING, Callable

from . import codec
from .codec import MessageExt
from .service import ServiceThread

if TYPE_CHECKING:
    from .store import MessageStore

log = logging.getLogger(__name__)


class CommitLogDispatcher:
    """Builds the consume queue (NOT_TYPE and COMMIT only) and the index (all but ROLLBACK) from a record.

    The request fields come from the record itself (PHYSICALOFFSET, QUEUEOFFSET,
    TAGS, KEYS, UNIQ_KEY), as RocketMQ's DispatchRequest does.
    """

    def __init__(self, store: "MessageStore") -> None:
        self.store = store
        self._tags_codes: dict[str, int] = {}

    def dispatch(self, msg: MessageExt, index: bool = True, queue: bool = True) -> None:
        """Apply one record; ``index=False`` builds only the consume queue (duplicates are skipped there),
        ``queue=False`` only the index (recovery re-indexing records their queues hold)."""
        store = self.store
        props = msg.properties
        txn = msg.sys_flag & codec.TRANSACTION_MASK
        if queue and (txn == codec.TRANSACTION_NOT_TYPE or txn == codec.TRANSACTION_COMMIT):
            tags = props.get("TAGS")
            if msg.topic == codec.SCHEDULE_TOPIC:
                code = codec.dispatch_tags_code(msg.topic, props, msg.store_timestamp)
            elif not tags:
                code = 0
            else:
                code = self._tags_codes.get(tags)
                if code is None:
                    code = self._tags_codes[tags] = codec.java_hash(tags)
                    if len(self._tags_codes) > 100000:
                        self._tags_codes.clear()
            cq = store.find_consume_queue(msg.topic, msg.queue_id)
            cq.put_unit(msg.commit_log_offset, msg.size, code, msg.queue_offset)
            store.checkpoint.logicsMsgTimestamp = msg.store_timestamp
        if index and store.config.messageIndexEnable:
            store.index_service.build_index(msg.topic, msg.commit_log_offset, msg.store_timestamp, txn,
                                            props.get("UNIQ_KEY"), props.get("KEYS"))


class ReputMessageService(ServiceThread):
    """Follows the CommitLog from ``reput_from_offset`` to its confirmed end and dispatches each record.

    The put path hands over what it already knows of the records of each put
    (``hand_over``, one tuple per put call: first offset, end offset, topic,
    queue, first queue offset, store time, transaction type, then per record
    the offsets, sizes, tagsCodes, KEYS and UNIQ_KEYs; each of the last three
    None when all are 0 or absent), so the common case needs no re-decoding.
    Anything not handed over (after a restart, replayed imports,
    delay-topic records) is decoded from the CommitLog, as RocketMQ does.
    Either way a record is dispatched only once it is below the confirmed end.
    """

    name = "ReputMessageService"

    def __init__(self, store: "MessageStore", from_offset: int, interval: float = 0.001) -> None:
        super().__init__(interval=interval)
        self.store = store
        self.reput_from_offset = from_offset
        self.dispatcher = CommitLogDispatcher(store)
        self.caught_up = threading.Condition()
        self.handed_over: deque[tuple] = deque()
        # What the put path knows of a record it appended, called under the put lock in commitlog order
        # (the deque's own append: a method of ours around it would double the cost of the call).
        self.hand_over: Callable[[tuple], None] = self.handed_over.append

    def behind(self) -> int:
        return max(0, self.store.confirm_offset() - self.reput_from_offset)

    def run_once(self) -> None:
        store = self.store
        commitlog = store.commitlog
        if self.reput_from_offset < commitlog.min_offset():
            self.reput_from_offset = commitlog.min_offset()
        end = store.confirm_offset()
        progressed = False
        pending = self.handed_over
        while self.reput_from_offset < end and not self.stopped:
            while pending and pending[0][0] < self.reput_from_offset:
                pending.popleft()  # already dispatched from the log
            if pending and pending[0][0] == self.reput_from_offset:
                progressed |= self._dispatch_handed_over(pending, end)
                continue
            before = self.reput_from_offset
            stop_at = min(end, pending[0][0]) if pending else end
            progressed |= self._dispatch_from_log(stop_at)
            if self.reput_from_offset == before:
                break
        if progressed or self.reput_from_offset >= end:
            with self.caught_up:
                self.caught_up.notify_all()

    def _dispatch_handed_over(self, pending: deque, end: int) -> bool:
        """Dispatch the handed-over puts that continue at the reput offset and end below ``end``.

        Units of one queue that follow each other (across puts too) are packed
        into the consume queue with one write: per record this is the
        dispatcher's whole cost unless the record has keys to index.
        """
        store = self.store
        index = store.index_service if store.config.messageIndexEnable else None
        expected = self.reput_from_offset
        run_key = None
        run_next = run_first = 0
        offsets: list[int] = []
        sizes: list[int] = []
        codes: list[int] = []
        last_ts = None
        while pending:
            offset, stop, topic, qid, qoff, ts, txn, offs, szs, cds, keys, uniqs = pending[0]
            if offset != expected or stop > end:
                break
            pending.popleft()
            expected = stop
            if qoff >= 0:
                if offsets and (run_key != (topic, qid) or qoff != run_next):
                    self._put_units(run_key, offsets, sizes, codes, run_first)
                    offsets, sizes, codes = [], [], []
                if not offsets:
                    run_key, run_first = (topic, qid), qoff
                run_next = qoff + len(offs)
                offsets += offs
                sizes += szs
                codes += cds if cds is not None else (0,) * len(offs)
                last_ts = ts
            if index is not None:
                if keys is None and uniqs is None:  # one call stands for all: it only makes a first index file
                    index.build_index(topic, offset, ts, txn, None, None)
                else:
                    for off, key, uniq in zip(offs, keys or repeat(None), uniqs or repeat(None)):
                        index.build_index(topic, off, ts, txn, uniq, key)
        if offsets:
            self._put_units(run_key, offsets, sizes, codes, run_first)
        if last_ts is not None:
            store.checkpoint.logicsMsgTimestamp = last_ts
        done = expected != self.reput_from_offset
        self.reput_from_offset = expected
        return done

    def _put_units(self, key: tuple[str, int], offsets: list[int], sizes: list[int], codes: list[int],
                   first_qoff: int) -> None:
        cq = self.store._cq_table.get(key) or self.store.find_consume_queue(*key)
        cq.put_units(offsets, sizes, codes, first_qoff)

    def _dispatch_from_log(self, end: int) -> bool:
        commitlog = self.store.commitlog
        f = commitlog.queue.find(self.reput_from_offset)
        if f is None or not f.hold():
            return False
        progressed = False
        try:
            pos = self.reput_from_offset - f.file_from_offset
            limit = min(f.wrote_position, end - f.file_from_offset)
            mm = f.mm
            while pos < limit:
                size, msg, reason = codec.check(mm, pos, limit, check_crc=False, read_body=False)
                if size == 0:
                    pos = f.file_size
                    break
                if msg is None:
                    if size > 0:
                        log.error("[BUG] %s at %d: %s; skipped", f.path, pos, reason)
                        pos += size
                        continue
                    if limit < f.wrote_position:
                        break  # the rest of the record is not confirmed yet (sync flush)
                    log.error("dispatch stopped at %s position %d: %s", f.path, pos, reason)
                    pos = limit
                    break
                self.dispatcher.dispatch(msg)
                pos += size
                progressed = True
            self.reput_from_offset = f.file_from_offset + pos
        finally:
            f.release()
        return progressed

    def wait_dispatched(self, offset: int, timeout: float) -> bool:
        """Block until everything before ``offset`` is dispatched (or the timeout passes)."""
        self.wakeup()
        with self.caught_up:
            return self.caught_up.wait_for(lambda: self.reput_from_offset >= offset or self.stopped, timeout)
