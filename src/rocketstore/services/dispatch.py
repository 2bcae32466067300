"""Dispatch: turning CommitLog records into ConsumeQueue units and index entries.

``DispatchRequest`` is what one record contributes; ``CommitLogDispatcher``
applies it (used by recovery, rebuilds and the live ReputMessageService,
which follows the CommitLog's confirmed end in its own thread, or is helped
by the thread that put the records: see :meth:`ReputMessageService.dispatch_ready`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from itertools import repeat
from typing import TYPE_CHECKING, Callable

from ..format import codec
from ..format.codec import MessageExt
from ..storage.consume_queue import CQ_STORE_UNIT_SIZE
from ..format.encoder import MessageEncoder
from ..storage.index import key_hashes
from ..format.message import illegal_topic
from .base import ServiceThread

if TYPE_CHECKING:
    from ..storage.index import IndexService
    from ..storage.files import StoreFiles

log = logging.getLogger(__name__)

INDEX_RETRY_S = 1.0  # how often a failed index is tried again
CATCH_UP_SLICE_S = 0.2  # index catch-up work per dispatch round, so the consume queues keep up meanwhile
# Puts handed over and not yet dispatched, at most; later ones are decoded from the log (see MessageStore._append).
HAND_OVER_LIMIT = 16384
ASSISTED_INTERVAL = 0.05  # the service's own rounds while an assistant dispatches the puts (see dispatch_ready)


def note_index_failure(index: "IndexService", offset: int, store_ts: int, e: OSError) -> None:
    """Remember the first record the index missed and why; warn once per failure, not once per record.

    The consume queues go on being built: a message stays readable through them, and is found by key
    once the index can grow again (the reput service retries and indexes what it missed).
    """
    first = index.build_error is None
    if index.missed_from is None:
        index.missed_from, index.missed_ts = offset, store_ts
    index.build_error = f"cannot create an index file: {e.filename or index.directory}: {e.strerror or e}"
    if first:
        log.warning("%s; consume queues are still built, and the records from commitlog offset %d on are "
                    "indexed once a file can be made (tried every %.0f s)", index.build_error, index.missed_from,
                    INDEX_RETRY_S)


class CommitLogDispatcher:
    """Builds the consume queue (NOT_TYPE and COMMIT only) and the index (all but ROLLBACK) from a record.

    The request fields come from the record itself (PHYSICALOFFSET, QUEUEOFFSET,
    TAGS, KEYS, UNIQ_KEY), as RocketMQ's DispatchRequest does.
    """

    def __init__(self, files: "StoreFiles") -> None:
        self.files = files
        self._queue_topics: set[str] = set()  # topics seen to be legal directory names
        self._tags_code = MessageEncoder().tags_code  # (cached per tags string)

    def dispatch(self, msg: MessageExt, index: bool = True, queue: bool = True) -> None:
        """Apply one record; ``index=False`` builds only the consume queue (duplicates are skipped there),
        ``queue=False`` only the index (recovery re-indexing records their queues hold)."""
        files = self.files
        props = msg.properties
        txn = msg.sys_flag & codec.TRANSACTION_MASK
        if queue and (txn == codec.TRANSACTION_NOT_TYPE or txn == codec.TRANSACTION_COMMIT) and \
                (msg.topic in self._queue_topics or self._queue_topic_ok(msg)):
            tags = props.get("TAGS")
            if msg.topic == codec.SCHEDULE_TOPIC:
                code = codec.dispatch_tags_code(msg.topic, props, msg.store_timestamp)
            else:
                code = self._tags_code(tags) if tags else 0
            cq = files.find_consume_queue(msg.topic, msg.queue_id)
            cq.put_unit(msg.commit_log_offset, msg.size, code, msg.queue_offset)
            files.checkpoint.logics_dispatched = msg.store_timestamp
            files.checkpoint.logics_dispatched_end = msg.commit_log_offset + msg.size
        if index and files.config.messageIndexEnable and files.index_service.missed_from is None:
            try:
                files.index_service.build_index(msg.topic, msg.commit_log_offset, msg.store_timestamp, txn,
                                                props.get("UNIQ_KEY"), props.get("KEYS"))
            except OSError as e:
                note_index_failure(files.index_service, msg.commit_log_offset, msg.store_timestamp, e)

    def _queue_topic_ok(self, msg: MessageExt) -> bool:
        """Whether the record's topic can name a consume-queue directory; a record whose topic bytes are
        damaged or illegal (not UTF-8, ``/``, too long) is left out of the queues, never the store's end."""
        topic = msg.topic
        why = illegal_topic(topic)
        if why is None:
            if len(self._queue_topics) > 100000:
                self._queue_topics.clear()
            self._queue_topics.add(topic)
            return True
        log.error("record at commitlog offset %d (queue %d, offset %d) left out of the consume queues: %s",
                  msg.commit_log_offset, msg.queue_id, msg.queue_offset, why)
        return False


class ReputMessageService(ServiceThread):
    """Follows the CommitLog from ``reput_from_offset`` to its confirmed end and dispatches each record.

    The put path hands over what it already knows of the records of each put
    (``hand_over``, one tuple per put call: first offset, end offset, topic,
    queue, first queue offset, store time, transaction type, then per record
    the offsets, sizes, tagsCodes, KEYS, UNIQ_KEYs and index key hashes; each
    of the last four None when all are 0 or absent, and the hashes given
    instead of KEYS and UNIQ_KEYs by a writer that computed them already, as
    the Spark append's tasks do), so the common case needs no re-decoding.
    Anything not handed over (after a restart, replayed imports,
    delay-topic records) is decoded from the CommitLog, as RocketMQ does.
    Either way a record is dispatched only once it is below the confirmed end.

    A process whose puts all come from one thread (the broker's event loop)
    can take the common case off this thread: it sets ``assisted`` and calls
    :meth:`dispatch_ready` soon after its puts (within ASSISTED_INTERVAL).  The
    service then runs a round only every ASSISTED_INTERVAL (or when woken)
    for what the assistant leaves: records not handed over, new files, the
    index catch-up.  Polling every millisecond woke this thread for one or
    two records a time, and each wake-up fought the putting thread for the
    GIL; that cost more than dispatching the records.  For the same reason a
    round that was not woken leaves the handed-over puts younger than
    ASSISTED_INTERVAL to the assistant: the broker dispatches its puts a few
    milliseconds after them, so such a round always found some and took them
    (a tenth of the broker's puts, each with a fight for the GIL); older ones
    (another thread's put, an assistant that stopped) are taken as before.
    """

    name = "ReputMessageService"

    def __init__(self, files: "StoreFiles", from_offset: int, interval: float = 0.001) -> None:
        super().__init__(interval=interval)
        self.files = files
        self.reput_from_offset = from_offset
        self.dispatcher = CommitLogDispatcher(files)
        self.caught_up = threading.Condition()
        self.handed_over: deque[tuple] = deque()
        # What the put path knows of a record it appended, called under the put lock in commitlog order
        # (the deque's own append: a method of ours around it would double the cost of the call).
        self.hand_over: Callable[[tuple], None] = self.handed_over.append
        self._index_retry_at = 0.0
        self._round = threading.Lock()  # one dispatch round at a time: this thread's, or an assistant's
        self.assisted = False  # an assistant calls dispatch_ready after its puts (the broker's loop)
        self.on_dispatched: Callable[[], None] | None = None  # after a round made messages readable (doorbell)
        self._periodic = False  # this round runs because ASSISTED_INTERVAL passed, not because it was woken

    def behind(self) -> int:
        return max(0, self.files.confirm_offset() - self.reput_from_offset)

    def wait_for_running(self, timeout: float) -> None:
        if not self.assisted:
            self._periodic = False
            super().wait_for_running(timeout)
            return
        woken = self._wake.wait(max(timeout, ASSISTED_INTERVAL))
        if woken:
            self._wake.clear()
        self._periodic = not woken  # the next round is the periodic one (see _left_to_assistant)

    def _left_to_assistant(self, put: tuple) -> bool:
        """In a round that was not woken, while assisted: whether the handed-over ``put`` is younger than
        ASSISTED_INTERVAL, so the assistant's own dispatch takes it (a clock gone back counts as old)."""
        if not (self._periodic and self.assisted):
            return False
        age = self.files.clock() * 1000 - put[5]  # (its store timestamp)
        return 0 <= age < ASSISTED_INTERVAL * 1000

    def run_once(self) -> None:
        with self._round:
            self._run_round()

    def dispatch_ready(self) -> bool:
        """Dispatch, in the calling thread, the handed-over puts that are next and confirmed; True if any were.

        Only what is quick is done here: units appended to existing consume-queue files with room, keys
        added to an index file with room.  Whatever needs more (records to decode from the log, a new
        queue or file, the index catch-up, the lock held by a flush) is left to the service, which is
        woken for it.  The caller never waits for the service's round: when it is under way, the service
        is woken to go on.
        """
        if self.stopped or not self._round.acquire(blocking=False):
            self.wakeup()
            return False
        try:
            files = self.files
            index = files.index_service if files.config.messageIndexEnable else None
            if index is not None and not index.lock.acquire(blocking=False):
                self.wakeup()  # a flush or a cleaner has it: the service waits for it, not the caller
                return False
            try:
                end = files.confirm_offset()
                pending = self.handed_over
                done = False
                if self.reput_from_offset >= files.commitlog.min_offset() and \
                        (index is None or index.missed_from is None):
                    while pending and pending[0][0] < self.reput_from_offset:
                        pending.popleft()  # already dispatched from the log
                    if pending and pending[0][0] == self.reput_from_offset:
                        done = self._dispatch_handed_over(pending, end, quick=True)
                if self.reput_from_offset < end:
                    self.wakeup()  # left for the service
            finally:
                if index is not None:
                    index.lock.release()
        finally:
            self._round.release()
        if done:
            if self.on_dispatched is not None:
                self.on_dispatched()
            with self.caught_up:
                self.caught_up.notify_all()
        return done

    def _run_round(self) -> None:
        files = self.files
        commitlog = files.commitlog
        if self.reput_from_offset < commitlog.min_offset():
            self.reput_from_offset = commitlog.min_offset()
        if files.index_service.missed_from is not None and time.monotonic() >= self._index_retry_at:
            self._index_catch_up()
        end = files.confirm_offset()
        progressed = False
        pending = self.handed_over
        while self.reput_from_offset < end and not self.stopped:
            while pending and pending[0][0] < self.reput_from_offset:
                pending.popleft()  # already dispatched from the log
            if pending and pending[0][0] == self.reput_from_offset:
                if self._left_to_assistant(pending[0]):
                    break
                progressed |= self._dispatch_handed_over(pending, end)
                continue
            before = self.reput_from_offset
            stop_at = min(end, pending[0][0]) if pending else end
            progressed |= self._dispatch_from_log(stop_at)
            if self.reput_from_offset == before:
                break
        if progressed and self.on_dispatched is not None:
            self.on_dispatched()  # before the notify: a waiter woken here finds the round over as before
        if progressed or self.reput_from_offset >= end:
            with self.caught_up:
                self.caught_up.notify_all()

    def _dispatch_handed_over(self, pending: deque, end: int, quick: bool = False) -> bool:
        """Dispatch the handed-over puts that continue at the reput offset and end below ``end``.

        Units of one queue that follow each other (across puts too, and across
        puts to other queues in between: sixteen producers on sixteen queues
        interleave) are packed into the consume queue with one write per queue
        and round: per record this is the dispatcher's whole cost unless the
        record has keys to index.  Queues are independent files, so writing
        queue B's run before queue A's changes no byte; within a queue the
        units keep commitlog order.
        ``quick`` (dispatch_ready) stops before a put that needs a new queue
        or file, or that does not continue its queue's last unit.
        """
        files = self.files
        index = files.index_service if files.config.messageIndexEnable else None
        if index is not None and index.missed_from is not None:
            index = None  # the catch-up indexes these records, in commitlog order
        expected = self.reput_from_offset
        runs: dict[tuple[str, int], list] = {}  # queue: [first qoff, next qoff, offsets, sizes, codes]
        last_ts = None
        index_room = 0
        if quick and index is not None:
            last = index.files[-1] if index.files else None
            if last is None or last.is_full():
                return False  # the service makes the file
            index_room = last.entries - last.index_count
        while pending:
            offset, stop, topic, qid, qoff, ts, txn, offs, szs, cds, keys, uniqs, hashes = pending[0]
            if offset != expected or stop > end:
                break
            if quick:
                if qoff >= 0:
                    key = (topic, qid)
                    cq = files.cq_table.get(key)
                    f = None if cq is None else cq.queue.last()
                    if f is None:
                        break
                    run = runs.get(key)
                    held = len(run[2]) if run is not None and qoff == run[1] else 0
                    at = f.wrote_position + held * CQ_STORE_UNIT_SIZE
                    if qoff * CQ_STORE_UNIT_SIZE != f.file_from_offset + at or \
                            at + len(offs) * CQ_STORE_UNIT_SIZE > cq.file_size:
                        break
                if index is not None:  # at most this many keys: never a new index file here
                    if hashes is not None:
                        need = sum(map(len, hashes))
                    else:
                        need = 0 if uniqs is None else len(offs)
                        if keys is not None:
                            need += sum(k.count(" ") + 1 for k in keys if k)
                    if need > index_room or index_room == 0:
                        break
                    index_room -= need
            pending.popleft()
            expected = stop
            if qoff >= 0:
                key = (topic, qid)
                run = runs.get(key)
                if run is not None and qoff != run[1]:  # not the queue's next unit: write what came before
                    self._put_units(key, run[2], run[3], run[4], run[0])
                    run = None
                if run is None:
                    run = runs[key] = [qoff, qoff, [], [], []]
                run[1] = qoff + len(offs)
                run[2] += offs
                run[3] += szs
                run[4] += cds if cds is not None else (0,) * len(offs)
                last_ts = ts
            if index is not None:
                if hashes is None and (keys is not None or uniqs is not None):
                    hashes = [key_hashes(topic, uniq, key) for key, uniq in zip(keys or repeat(None),
                                                                                uniqs or repeat(None))]
                try:
                    index.build_index_hashes(offs, ts, txn, hashes)
                except OSError as e:  # missed from the message being indexed (its entries so far are kept)
                    last = index.files[-1].end_phy_offset if index.files else offset
                    note_index_failure(index, next((o for o in offs if o >= last), offset), ts, e)
                    index = None
        for key, (first, _, offsets, sizes, codes) in runs.items():
            self._put_units(key, offsets, sizes, codes, first)
        if last_ts is not None:
            files.checkpoint.logics_dispatched = last_ts
            files.checkpoint.logics_dispatched_end = expected
        done = expected != self.reput_from_offset
        self.reput_from_offset = expected
        return done

    def _put_units(self, key: tuple[str, int], offsets: list[int], sizes: list[int], codes: list[int],
                   first_qoff: int) -> None:
        cq = self.files.cq_table.get(key) or self.files.find_consume_queue(*key)
        cq.put_units(offsets, sizes, codes, first_qoff)

    def _dispatch_from_log(self, end: int) -> bool:
        commitlog = self.files.commitlog
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

    def _index_catch_up(self) -> None:
        """Index the records the index missed while it failed, in commitlog order, up to the reput offset.

        Runs in the dispatch thread, a slice at a time; live dispatch leaves the index alone until the
        catch-up reaches it, so every record is indexed once and in order.
        """
        files = self.files
        index = files.index_service
        commitlog = files.commitlog
        at = max(index.missed_from or 0, commitlog.min_offset())
        start, end = at, self.reput_from_offset
        deadline = time.monotonic() + CATCH_UP_SLICE_S
        ts = index.missed_ts
        try:
            while at < end and time.monotonic() < deadline:
                for off, size, msg, problem in commitlog.scan(at, read_body=False, end=end):
                    if msg is None:  # dispatch skipped it too
                        log.error("index catch-up: %s; skipped", problem)
                        at = off + size if size > 0 else end
                        break
                    ts = msg.store_timestamp
                    self._index_again(index, msg, off == start)
                    at = off + size
                    if time.monotonic() >= deadline:
                        break
                else:
                    at = end
        except OSError as e:
            index.missed_from, index.missed_ts = at, ts
            note_index_failure(index, at, ts, e)
            self._index_retry_at = time.monotonic() + INDEX_RETRY_S
            return
        if at < end:
            index.missed_from, index.missed_ts = at, ts  # more next round, without waiting
            return
        log.info("index builds again; records from commitlog offset %d to %d indexed (was: %s)",
                 start, end, index.build_error)
        index.missed_from, index.build_error = None, None

    @staticmethod
    def _index_again(index: "IndexService", msg: MessageExt, first: bool) -> None:
        """Index one record; the first record of a catch-up may hold keys indexed before the failure."""
        props = msg.properties
        uniq, keys = props.get("UNIQ_KEY"), props.get("KEYS")
        phy = msg.commit_log_offset
        if first and (uniq or keys) and index.files and index.files[-1].end_phy_offset == phy:
            def indexed(key: str) -> bool:
                return phy in index.query_offset(msg.topic, key, 64, 0, 2 ** 63 - 1)[0]
            if uniq and indexed(uniq):
                uniq = None
            if keys:
                keys = " ".join(k for k in keys.split(" ") if k and not indexed(k)) or None
        index.build_index(msg.topic, phy, msg.store_timestamp, msg.sys_flag & codec.TRANSACTION_MASK, uniq, keys)

    def wait_dispatched(self, offset: int, timeout: float) -> bool:
        """Block until everything before ``offset`` is dispatched (or the timeout passes)."""
        self.wakeup()
        with self.caught_up:
            return self.caught_up.wait_for(lambda: self.reput_from_offset >= offset or self.stopped, timeout)
