"""GroupCommit: many producers' puts written with one gathered write and made durable with one flush.

RocketMQ's GroupCommitService swaps a list of flush requests: every producer
waiting when a flush starts is answered by it.  Here the write is grouped too
(flat combining): a producer publishes its encoded records as a request; the
one producer that finds no leader becomes the leader, takes every request
published so far, stamps and writes them under the put lock in one pass (one
``pwritev``, the put order is the commit order), hands them to the dispatcher,
calls ``fdatasync`` once when any of them waits for the disk, and then wakes
each of them.  Producers arriving meanwhile only publish and sleep on a lock of
their own: sixteen waiting producers cost one lock hand-over, one write and one
flush, where each of them taking the put lock in turn queued sixteen threads
for it and for the GIL.

A producer alone never leaves its own thread (no hand-off to a flush thread:
that alone cost more than the put).  A leader leads one round for its own
put; if requests wait when it is done, the rounds go on in the
GroupCommitService thread (SYNC_FLUSH) or in the longest-waiting producer
(ASYNC_FLUSH), so no producer's put is held up by other producers' rounds.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import CommitLogWriteError, StoreClosedError
from ..format import codec
from ..format.codec import EncodedRecord
from .dispatch import HAND_OVER_LIMIT

if TYPE_CHECKING:
    from ..storage.files import StoreFiles
    from .base import ServiceThread
    from .dispatch import ReputMessageService

log = logging.getLogger(__name__)

# A leader of ASYNC_FLUSH puts takes this many further rounds (each a few microseconds) before it passes the
# lead to a waiting producer; one of SYNC_FLUSH puts passes it to the GroupCommitService thread at once.
ASYNC_EXTRA_ROUNDS = 8
# The service gathers the producers of the last round for about one flush's time, within these bounds.
MIN_GATHER = 0.00005
MAX_GATHER = 0.001
_NEVER = 1 << 62


class GroupCommitRequest:
    """One put on its way to the log: the records of one topic/queue and, once written, where they went."""

    __slots__ = ("topic", "queue_id", "records", "dispatch", "store_timestamp", "assigns", "wait_flush",
                 "written", "queue_offset", "error", "flushed", "lead", "park")

    def __init__(self, topic: str, queue_id: int, records: list[EncodedRecord], dispatch: tuple | None,
                 store_timestamp: int | None, wait_flush: bool) -> None:
        self.topic = topic
        self.queue_id = queue_id
        self.records = records
        self.dispatch = dispatch
        self.store_timestamp = store_timestamp
        self.assigns = records[0][6] & codec.TRANSACTION_MASK in codec.QUEUED_TXN  # takes queue offsets
        self.wait_flush = wait_flush  # answered only once durable (SYNC_FLUSH, WAIT not false)
        self.written: tuple[int, int, int, list[int]] | None = None  # CommitLog.append's result
        self.queue_offset = 0
        self.error: BaseException | None = None  # why it was not written (raised in the producer)
        self.flushed = False
        self.lead = False  # woken to lead the next rounds rather than with its put done
        self.park: Any = None  # the lock this producer sleeps on


class PutRefused(Exception):
    """A put the group commit did not write, with the PutMessageStatus name that says why."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


class GroupCommit:
    """The put path's commit queue (see the module docstring)."""

    def __init__(self, files: "StoreFiles", reput: "ReputMessageService | None", *, sync: bool,
                 service: "ServiceThread | None" = None) -> None:
        self.files = files
        self.reput = reput
        self.sync = sync
        self.service = service  # SYNC_FLUSH: the GroupCommitService thread, which leads when asked to
        self._m = threading.Lock()  # guards _pending, _leading, _service_leads (the lead passed, not yet taken)
        self._pending: list[GroupCommitRequest] = []
        self._leading = False
        self._service_leads = False
        self.wanted = 0  # a flush asked for without waiting (WAIT=false puts, wait_flushed)
        self.failed = False
        self._target = _NEVER  # the service waits for this many requests (see _lead)
        self._arrived = threading.Event()
        self.flush_seconds = 0.0  # how long a flush takes (moving average): how long the service gathers
        self.rounds = 0  # rounds led (tests and the bench read how many puts one flush covered)
        self.flushes = 0

    # ------------------------------------------------------------ producers
    def submit(self, req: GroupCommitRequest, timeout: float) -> None:
        """Return once ``req`` is written (and durable, if it waits for the flush) or has failed."""
        m = self._m
        with m:
            pending = self._pending
            pending.append(req)
            if len(pending) >= self._target:
                self._arrived.set()
            lead = not self._leading
            if lead:
                self._leading = True
            else:
                park = req.park = threading.Lock()
                park.acquire()
        if lead:
            self._lead(req)
            return
        if park.acquire(timeout=timeout):
            if req.lead:
                self._lead(req)
            return
        with m:  # timed out: not taken by a leader yet, taken, or just told to lead
            if req.lead:
                lead = True
            elif any(r is req for r in self._pending):
                self._pending.remove(req)
                raise PutRefused("OS_PAGE_CACHE_BUSY", f"the put waited {timeout * 1000:.0f} ms (syncFlushTimeout) "
                                 "for the commit of other puts and was not written")
        if lead:
            park.acquire()  # released by the leader that handed over
            self._lead(req)
            return
        while req.written is None and req.error is None:  # taken: the write is microseconds away
            park.acquire(timeout=0.001)

    # ------------------------------------------------------------ the leader
    def _lead(self, own: GroupCommitRequest | None) -> None:
        """Run commit rounds until no request waits, or pass the lead on once ``own`` is done.

        The service (``own`` None) waits, before a round, for the producers the last round answered to come
        back, up to one flush's time: they need the GIL one after another to make their next put, and a
        round started at once would flush for the first of them only and make the rest wait a whole flush
        more (rounds alternating between one put and fifteen).
        """
        extra = 0 if self.sync else ASYNC_EXTRA_ROUNDS
        gather = own is None and self.sync
        last = 0  # puts in the last round
        waited = False
        while True:
            wait = False
            with self._m:
                batch = self._pending
                if gather and not waited and len(batch) < last:
                    self._target = last
                    self._arrived.clear()
                    wait = True
                elif not batch and not (own is None and self.sync and self._flush_wanted()):
                    self._leading = self._service_leads = False
                    return
                elif own is not None and (own.written is not None or own.error is not None):
                    if extra <= 0:  # own put answered: the next rounds are someone else's
                        self._pass_lead(batch)
                        return
                    extra -= 1
                if not wait:
                    self._pending = []
            if wait:
                self._arrived.wait(min(MAX_GATHER, max(MIN_GATHER, self.flush_seconds)))
                self._target = _NEVER
                waited = True
                continue
            waited = False
            last = len(batch)
            try:
                self._round(batch)
            except BaseException as e:  # each put of the round fails with it; the lead goes on
                log.exception("%s: a group commit round failed", self.files.root)
                for r in batch:
                    if r.written is None and r.error is None:
                        r.error = e
            finally:
                for r in batch:
                    if r is not own and r.park is not None:
                        r.park.release()

    def _pass_lead(self, batch: list[GroupCommitRequest]) -> None:
        """Called with ``_m`` held and requests waiting: give the next rounds to the service or a producer."""
        service = self.service
        if service is not None and not service.stopped:
            self._service_leads = True
            service.wakeup()
        else:
            nxt = batch[0]
            nxt.lead = True
            nxt.park.release()

    def lead_as_service(self) -> None:
        """The GroupCommitService's round: lead if the lead was passed to it, or if nobody leads and there is
        work (requests, or a flush asked for)."""
        with self._m:
            if self._leading:
                if not self._service_leads:
                    return  # a producer, or the service already, leads
                self._service_leads = False  # the passed lead is taken (once)
            elif not self._pending and not self._flush_wanted():
                return
            self._leading = True
        self._lead(None)

    def _flush_wanted(self) -> bool:
        return self.wanted > self.files.commitlog.queue.flushed_where and not self.failed

    def _round(self, batch: list[GroupCommitRequest]) -> None:
        """Write the batch in order under the put lock, hand it to the dispatcher, flush once if asked to."""
        if batch:
            self.rounds += 1
            self._write(batch)
        if not self.sync:
            return
        end = 0
        flush = False
        for r in batch:
            if r.written is not None:
                end = r.written[0] + r.written[1]
                flush |= r.wait_flush
        if flush or self._flush_wanted():
            ok = self._flush_up_to(max(end, self.wanted))
            for r in batch:
                r.flushed = ok and r.written is not None and r.written[0] + r.written[1] <= \
                    self.files.commitlog.queue.flushed_where

    def _write(self, batch: list[GroupCommitRequest]) -> None:
        files = self.files
        commitlog = files.commitlog
        table = files.topic_queue_table
        size = commitlog.file_size - codec.BLANK_RECORD_SIZE
        with commitlog.put_lock:
            if files.closed:
                err = StoreClosedError(f"{files.root}: store is closed")
                for r in batch:
                    r.error = err
                return
            units = []
            taken = []
            for r in batch:  # queue offsets in commit order; a unit too big for a segment fails alone
                recs = r.records
                total = recs[0][1] if len(recs) == 1 else sum(x[1] for x in recs)
                if total > size:
                    r.error = PutRefused("MESSAGE_ILLEGAL", f"{total} bytes do not fit a {commitlog.file_size}"
                                         "-byte commitlog segment (mappedFileSizeCommitLog)")
                    continue
                if r.assigns:
                    key = (r.topic, r.queue_id)
                    q = r.queue_offset = table.get(key, 0)
                    table[key] = q + len(recs)
                    units.append((recs, q, r.store_timestamp))
                else:
                    units.append((recs, None, r.store_timestamp))
                taken.append(r)
            if len(units) == 1 and len(taken[0].records) == 1:  # one small put: straight into the map
                try:
                    results, error = [commitlog.append(*units[0])], None
                except (OSError, CommitLogWriteError) as e:
                    results, error = [], e
            else:
                results, error = commitlog.append_units(units)
            for r, res in zip(taken, results):
                r.written = res
            if error is not None:
                self._fail_unwritten(taken[len(results):], error)
            reput = self.reput
            if reput is None:
                return
            handed = reput.handed_over
            for r, res in zip(taken, results):
                # Else the dispatcher decodes these records from the log: so too past HAND_OVER_LIMIT puts not
                # yet dispatched (a stalled flush under SYNC_FLUSH), which bounds what the hand-over holds.
                if r.dispatch is not None and len(handed) < HAND_OVER_LIMIT:
                    wrote_offset, wrote_bytes, store_ts, offsets = res
                    recs = r.records
                    reput.hand_over((wrote_offset, wrote_offset + wrote_bytes, r.topic, r.queue_id,
                                     r.queue_offset if r.assigns else -1, store_ts,
                                     recs[0][6] & codec.TRANSACTION_MASK, offsets,
                                     (wrote_bytes,) if len(recs) == 1 else [x[1] for x in recs], *r.dispatch))

    def _fail_unwritten(self, failed: list[GroupCommitRequest], error: BaseException) -> None:
        """The puts from ``failed[0]`` on were not written: give their queue offsets back, say why."""
        table = self.files.topic_queue_table
        for r in reversed(failed):
            if r.assigns:
                table[(r.topic, r.queue_id)] = r.queue_offset
        if isinstance(error, CommitLogWriteError):  # nothing more is acknowledged: stop taking writes
            self.files.running_flags.make_not_writeable(str(error))
            log.error("%s: %s; store is now read-only", self.files.root, error)
            refused = PutRefused("UNKNOWN_ERROR", str(error))
        else:
            where = getattr(error, "filename", None) or self.files.paths.commitlog
            refused = PutRefused("CREATE_MAPPED_FILE_FAILED", f"cannot create commitlog segment {where}: "
                                 f"{getattr(error, 'strerror', None) or error}")
        for r in failed:
            r.error = refused

    def _flush_up_to(self, target: int) -> bool:
        """fdatasync until the log is durable up to ``target`` (the rounds cross segments); False on an error."""
        files = self.files
        queue = files.commitlog.queue
        t0 = time.perf_counter()
        for _ in range(1000):
            if queue.flushed_where >= target:
                break
            self.flushes += 1
            if not files.flush_commitlog(0, True) and files.flush_error:
                self.failed = True
                return False
        self.flush_seconds += (time.perf_counter() - t0 - self.flush_seconds) / 8
        return queue.flushed_where >= target

    # ------------------------------------------------------------ flush without a put
    def request_flush(self, next_offset: int) -> None:
        """Ask for the log to be durable up to ``next_offset`` soon, without waiting (WAIT=false puts): the
        leader's next round or the service flushes it."""
        if next_offset > self.wanted:
            self.wanted = next_offset
        if self.service is not None:
            self.service.wakeup()

    def wait_flushed(self, next_offset: int, timeout: float) -> bool:
        """Block until the log is durable up to ``next_offset``; False on timeout or a flush error.  (Not on the
        put path: closing, ``wait_dispatched``.)"""
        queue = self.files.commitlog.queue
        self.request_flush(next_offset)
        deadline = time.monotonic() + timeout
        while queue.flushed_where < next_offset and not self.failed:
            if self.service is None or self.service.stopped or threading.current_thread() is self.service.thread:
                self.lead_as_service()  # nobody else would
            if queue.flushed_where >= next_offset or time.monotonic() >= deadline:
                break
            time.sleep(0.0005)
        return not self.failed and queue.flushed_where >= next_offset
