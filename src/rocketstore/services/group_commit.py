"""GroupCommit: many producers' puts written with one gathered write and made durable with one flush.

RocketMQ's GroupCommitService swaps a list of flush requests: every producer
waiting when a flush starts is answered by it.  Here the write is grouped too
(flat combining).  A producer publishes its encoded records as a request; the
one that finds no writer becomes the writer: it takes every request published
so far, stamps and writes them under the put lock in one pass (one
``pwritev``; the put order is the commit order) and hands them to the
dispatcher.  Producers arriving meanwhile only publish and sleep on a lock of
their own, once per put: sixteen waiting producers cost one lock hand-over and
one write, where each taking the put lock in turn queued sixteen threads for it
and for the GIL.

Under SYNC_FLUSH the written requests then wait for a flush.  One thread at a
time flushes: ``fdatasync`` for everything written when it starts, then it
wakes the first request it covered, which wakes the next, and so on: woken all
at once, fifteen of sixteen threads only woke to sleep again on the GIL (about
one context switch more per put).  What was written during that flush is
covered by the next, which starts at once.  Nobody waits for producers to gather (that
was tried: on a loaded machine, slow to wake threads, the flusher then idled
waiting for producers that had no CPU).  A producer alone writes and flushes
its own put in its own thread (a hand-off to a flush thread cost more than the
put); once its put is durable it passes the flushing on to the
GroupCommitService thread if others wait, so no producer is held up by other
producers' flushes, and the service's flushes overlap the next writes.
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

# A writer takes this many further rounds (each a few microseconds) once its own put is written, before it
# passes the writing to the longest-waiting producer.
EXTRA_WRITE_ROUNDS = 8


class GroupCommitRequest:
    """One put on its way to the log: the records of one topic/queue and, once written, where they went."""

    __slots__ = ("topic", "queue_id", "records", "dispatch", "store_timestamp", "assigns", "wait_flush",
                 "written", "end", "queue_offset", "error", "flushed", "lead", "park", "chain", "left")

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
        self.end = 0  # the commitlog offset after its records, once written
        self.queue_offset = 0
        self.error: BaseException | None = None  # why it was not written (raised in the producer)
        self.flushed = False
        self.lead = False  # woken to write the next rounds rather than with its put done
        self.park: Any = None  # the lock this producer sleeps on
        self.chain: GroupCommitRequest | None = None  # the next answered producer this one wakes once woken
        self.left = False  # stopped waiting on its own (a timeout): left out of wake chains


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
        self.service = service  # SYNC_FLUSH: the GroupCommitService thread, which flushes when asked to
        self._m = threading.Lock()  # guards _pending and _writing
        self._pending: list[GroupCommitRequest] = []
        self._writing = False
        self._fm = threading.Lock()  # guards _waiters, _flushing, _service_flushes
        self._waiters: list[GroupCommitRequest] = []  # written, waiting for a flush, in commit order
        self._flushing = False
        self._service_flushes = False  # the flushing was passed to the service and not yet taken up
        self.wanted = 0  # a flush asked for without waiting (WAIT=false puts, wait_flushed)
        self.failed = False
        self.rounds = 0  # write rounds (tests and the bench read how many puts one write or flush covered)
        self.flushes = 0
        self.wakes = 0  # sleeping producers woken (see _wake)

    # ------------------------------------------------------------ producers
    def submit(self, req: GroupCommitRequest, timeout: float) -> None:
        """Return once ``req`` is written (and durable, if it waits for the flush) or has failed; raises
        PutRefused when it waited ``timeout`` without being written."""
        m = self._m
        with m:
            lead = not self._writing  # (then nothing is pending either: see _lead_writes)
            if lead:
                self._writing = True
            else:
                self._pending.append(req)
                park = req.park = threading.Lock()
                park.acquire()
        if lead:
            self._write_alone(req, timeout)
            return
        if not park.acquire(timeout=timeout):
            with m:  # not taken by a writer yet, taken, or just told to write
                if not req.lead and any(r is req for r in self._pending):
                    self._pending.remove(req)
                    raise PutRefused("OS_PAGE_CACHE_BUSY", f"the put waited {timeout * 1000:.0f} ms "
                                     "(syncFlushTimeout) for the commit of other puts and was not written")
            if not req.lead:
                self._wait_taken(req, timeout)
                return
            park.acquire()  # released by the writer that passed the writing on
        if not req.lead:
            self._pass_on(req)
            return  # written (and flushed, if it waits for that) by another thread
        self._lead_writes(req)  # told to write: the writer that passed it on left ``req`` published
        if self.sync and req.wait_flush and req.written is not None:
            self._await_flush(req, timeout)

    def _wait_taken(self, req: GroupCommitRequest, timeout: float) -> None:
        """A request a writer has taken: the write is microseconds away; the flush is waited for no longer."""
        park = req.park
        while req.written is None and req.error is None:
            park.acquire(timeout=0.001)
        self._leave(req)

    def _leave(self, req: GroupCommitRequest) -> None:
        """A producer that stopped waiting on its own (a timeout): out of the flush's waiters (it is answered
        FLUSH_DISK_TIMEOUT unless covered already) and out of the wake chains, its place passed on."""
        with self._fm:
            if req.wait_flush and any(r is req for r in self._waiters):
                self._waiters.remove(req)
            req.left = True
            nxt = req.chain
            req.chain = None
        if nxt is not None:
            self._wake(nxt)

    def _pass_on(self, req: GroupCommitRequest) -> None:
        """(A woken producer.)  Wake the next producer answered by the same round (see _chain)."""
        nxt = req.chain
        if nxt is not None:
            req.chain = None
            self._wake(nxt)

    def _wake(self, r: GroupCommitRequest) -> None:
        """Release the lock the producer of ``r`` sleeps on, counted: one wake-up per waiting put is the least a
        put that sleeps can cost (the bench reports wake-ups per put next to the process's context switches)."""
        self.wakes += 1
        r.park.release()

    @staticmethod
    def _chain(answered: list[GroupCommitRequest]) -> GroupCommitRequest | None:
        """(Under ``_fm``.)  Link the sleeping producers of ``answered`` so that each, once woken, wakes the
        next; return the first, which the caller wakes.  Woken all at once, fifteen of sixteen threads only
        woke to sleep again on the GIL (a context switch more per put)."""
        live = [r for r in answered if not r.left]
        for a, b in zip(live, live[1:]):
            a.chain = b
        return live[0] if live else None

    # ------------------------------------------------------------ writing
    def _write_alone(self, req: GroupCommitRequest, timeout: float) -> None:
        """No writer: ``req`` is written as a round of its own, without being published (the broker's loop, a
        lone producer: the common case, kept short), and under SYNC_FLUSH flushed by this thread unless a
        flush is under way; the puts published meanwhile are then written by this thread as any writer's
        (:meth:`_lead_writes`)."""
        self._write_round([req])
        extra = EXTRA_WRITE_ROUNDS
        if self.sync and self._answer([req], req):
            self._lead_flushes(req)
            extra = 0
        with self._m:
            done = not self._pending
            if done:
                self._writing = False
        if not done:
            self._lead_writes(req, extra)
        if self.sync and req.wait_flush and req.written is not None:
            self._await_flush(req, timeout)

    def _lead_writes(self, own: GroupCommitRequest, extra: int = EXTRA_WRITE_ROUNDS) -> None:
        """Write rounds until no request waits, or pass the writing on a few rounds after ``own`` is written.
        When written puts wait for a flush and none is under way, this thread flushes before its next round:
        the producers arriving meanwhile are then written with one write after it (handing the writing on
        before the flush, so that each wrote its own put during it, cost a fifth more CPU per put for the
        same rate with 16 producers).  ``extra`` is how many more rounds it writes once ``own`` is written."""
        while True:
            with self._m:
                batch = self._pending
                if not batch:
                    self._writing = False
                    return
                if own.written is not None or own.error is not None:
                    if extra <= 0:
                        nxt = batch[0]  # still published: it takes the batch itself
                        nxt.lead = True
                        self._wake(nxt)
                        return
                    extra -= 1
                self._pending = []
            flush = False
            try:
                self._write_round(batch)
            finally:
                flush = self._answer(batch, own)
            if flush:
                self._lead_flushes(own)
                extra = 0  # own put durable (or it waits for none): hand the writing on at the next round

    def _write_round(self, batch: list[GroupCommitRequest]) -> None:
        """One write round; when it fails, each put of it not yet answered fails with the error (the writing
        goes on: the next round is tried)."""
        self.rounds += 1
        try:
            if len(batch) == 1:
                self._write_one(batch[0])
            else:
                self._write(batch)
        except BaseException as e:
            log.exception("%s: a group commit round failed", self.files.root)
            for r in batch:
                if r.written is None and r.error is None:
                    r.error = e

    def _answer(self, batch: list[GroupCommitRequest], own: GroupCommitRequest) -> bool:
        """Wake the written puts that wait for no flush (and the failed ones); queue the others for the flush.
        True when no flush is under way: the caller is to lead one (and ``own`` needs no lock to sleep on)."""
        waiting: list[GroupCommitRequest] = []
        answered: list[GroupCommitRequest] = []
        sync = self.sync
        own_waits = False
        for r in batch:
            if sync and r.wait_flush and r.written is not None:
                waiting.append(r)
                if r is own:
                    own_waits = True
            elif r is not own and r.park is not None:
                answered.append(r)
        if not waiting and not answered:
            return False
        head = None
        with self._fm:
            if answered:
                head = self._chain(answered)
            if not waiting:
                flush = False
            elif self._flushing:  # another thread flushes: ``own`` sleeps until that flush covers it
                if own_waits:
                    own.park = threading.Lock()
                    own.park.acquire()
                self._waiters += waiting
                flush = False
            else:  # this thread flushes: the flush answers ``own`` if written in this round
                if own_waits:
                    own.park = None
                self._waiters += waiting
                self._flushing = flush = True
        if head is not None:
            self._wake(head)
        return flush

    def _write_one(self, r: GroupCommitRequest) -> None:
        """:meth:`_write` of a round of one put (a producer alone: the common case, kept short)."""
        files = self.files
        commitlog = files.commitlog
        recs = r.records
        with commitlog.put_lock:
            if files.closed:
                r.error = StoreClosedError(f"{files.root}: store is closed")
                return
            if r.assigns:
                table = files.topic_queue_table
                key = (r.topic, r.queue_id)
                q = r.queue_offset = table.get(key, 0)
            else:
                q = None
            try:
                res = commitlog.append(recs, q, r.store_timestamp)
            except codec.MessageTooLarge as e:
                r.error = PutRefused("MESSAGE_ILLEGAL", str(e))
                return
            except (OSError, CommitLogWriteError) as e:
                self._fail_unwritten([], e, r)
                return
            if q is not None:
                table[key] = q + len(recs)
            r.written = res
            r.end = res[0] + res[1]
            if self.reput is not None:
                self._hand_over(self.reput, r, res)

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
                total = codec.records_size(recs)
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
                r.end = res[0] + res[1]
            if error is not None:
                self._fail_unwritten(taken[len(results):], error)
            reput = self.reput
            if reput is None:
                return
            for r, res in zip(taken, results):
                self._hand_over(reput, r, res)

    @staticmethod
    def _hand_over(reput: Any, r: GroupCommitRequest, res: Any) -> None:
        """(Under ``put_lock``.)  Give the dispatcher what it needs of a written put.  Else it decodes the records
        from the log: so too past HAND_OVER_LIMIT puts not yet dispatched (a stalled flush under SYNC_FLUSH),
        which bounds what the hand-over holds in memory."""
        if r.dispatch is None or len(reput.handed_over) >= HAND_OVER_LIMIT:
            return
        wrote_offset, wrote_bytes, store_ts, offsets = res
        recs = r.records
        reput.hand_over((wrote_offset, wrote_offset + wrote_bytes, r.topic, r.queue_id,
                         r.queue_offset if r.assigns else -1, store_ts, recs[0][6] & codec.TRANSACTION_MASK,
                         offsets, codec.record_sizes(recs), *r.dispatch))

    def _fail_unwritten(self, failed: list[GroupCommitRequest], error: BaseException,
                        alone: GroupCommitRequest | None = None) -> None:
        """The puts from ``failed[0]`` on (or ``alone``, which took no queue offset) were not written: give
        their queue offsets back, say why."""
        table = self.files.topic_queue_table
        for r in reversed(failed):
            if r.assigns:
                table[(r.topic, r.queue_id)] = r.queue_offset
        if alone is not None:
            failed = [alone]
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

    # ------------------------------------------------------------ flushing
    def _await_flush(self, own: GroupCommitRequest, timeout: float) -> None:
        """The writer's own put, written: wait for the flush under way to cover it (the writer flushed
        already if none was)."""
        if own.park is None:
            return  # answered by this thread's own flush
        if own.flushed or self.failed:  # covered already: its place in the wake chain is passed on now
            self._leave(own)
            return
        if own.park.acquire(timeout=timeout):
            self._pass_on(own)
        else:
            self._leave(own)

    def _lead_flushes(self, own: GroupCommitRequest | None) -> None:
        """Flush (``_flushing`` is set) for everything written, wake the requests covered, and go on while
        requests wait; a producer (``own``) passes that on to the service once its own put is durable."""
        queue = self.files.commitlog.queue
        while True:
            ok = self._flush_up_to(self.files.commitlog.max_offset())
            with self._fm:
                done = queue.flushed_where
                waiters = self._waiters
                i = 0
                for r in waiters:
                    if r.end > done and ok:
                        break
                    r.flushed = ok
                    i += 1
                head = None
                if i > 1 or (i == 1 and waiters[0] is not own):
                    head = self._chain([r for r in waiters[:i] if r is not own])
                del waiters[:i]
                stop = not waiters and not self._flush_wanted()
                if stop:
                    self._flushing = False
                elif own is not None:
                    service = self.service
                    if service is not None and not service.stopped:
                        self._service_flushes = True
                        service.wakeup()
                        stop = True
            if head is not None:
                self._wake(head)
            if stop:
                return
            own = None  # (the service is gone: this thread goes on flushing for the others)

    def lead_as_service(self) -> None:
        """The GroupCommitService's round: flush if the flushing was passed to it, or if nobody flushes and
        something waits for it (requests, or a flush asked for without waiting)."""
        with self._fm:
            if self._flushing:
                if not self._service_flushes:
                    return  # a producer, or the service already, flushes
                self._service_flushes = False  # taken up (once)
            elif not self._waiters and not self._flush_wanted():
                return
            self._flushing = True
        self._lead_flushes(None)

    def _flush_wanted(self) -> bool:
        return self.wanted > self.files.commitlog.queue.flushed_where and not self.failed

    def _flush_up_to(self, target: int) -> bool:
        """fdatasync until the log is durable up to ``target`` (the rounds cross segments); False on an error."""
        files = self.files
        queue = files.commitlog.queue
        for _ in range(1000):
            if queue.flushed_where >= target:
                break
            self.flushes += 1
            if not files.flush_commitlog(0, True) and files.flush_error:
                self.failed = True
                return False
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
