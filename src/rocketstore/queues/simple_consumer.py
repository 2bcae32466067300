"""RocketMQ 5's SimpleConsumer in the library: receive, ack, nack, change the invisible duration.

``store.simple_consumer(group, topic)`` gives one; any number of them, in any number of processes on one
store (one writer, the others opened read-only), share the group's work: a received message is invisible
to every other receiver of the group until it is acked or its invisible time passes, then it is delivered
again (``delivery_attempt`` + 1).  After ``max_reconsume_times`` redeliveries it moves to ``%DLQ%<group>``.
In a FIFO group (``fifo=True``) a message group's (``__SHARDINGKEY``) next message waits until the
previous one is acked or dead-lettered.  The state is ``config/popState.json`` (see
:mod:`rocketstore.queues.state`), the broker's own file: one implementation (:mod:`rocketstore.queues.pop`).

Acks: with ``ack_sync_flush`` (the store config's ``ackSyncFlush``; the broker's ``popAckSyncFlush``) an ack
is in popState.json, fsynced, before ``ack()`` returns.  Without it acks are gathered and written with the
receiver's next call, after ACK_BATCH acks, at close, and at the latest ACK_LINGER seconds after the first of
them (a thread of the receiver does it when no call came): a process killed in that window loses those acks,
and the messages are delivered again after their invisible time (at least once).

A message due for the DLQ is parked in the pop state (never delivered again) and moved to ``%DLQ%<group>``
by the writer (:mod:`rocketstore.queues.revive`, exactly once): at once by a receiver on the writable store,
within moments by the writer's dead-letter service for a receiver on a read-only store (it rings the
service), or when a writer next opens the store.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from ..errors import StoreError
from ..format.codec import MessageExt
from ..format.message import Message, PutMessageResult
from .doorbell import Doorbell, Waiter
from .pop import PopService, TagFilter
from .retry import RetryPolicy
from . import revive
from .state import SharedPopState

log = logging.getLogger(__name__)

ACK_BATCH = 256
ACK_LINGER = 0.2
ACK_RETRY = 1.0  # seconds before the linger thread writes buffered acks again after a failed write
OWN_DISPATCH_WAIT = 0.01  # seconds a writer's receive waits for the dispatch thread's round under way
_clients = itertools.count(1)
# How a read-only store extends its view to what the writer appended (registered by the package root:
# rocketstore.tail_view sits above the facade, this package below it).
_view_follower: Callable[[Any, list[str]], Any] | None = None


def set_view_follower(follow: Callable[[Any, list[str]], Any]) -> None:
    global _view_follower
    _view_follower = follow


class QueueStore(Protocol):
    """What a SimpleConsumer needs of the store."""

    root: str
    read_only: bool

    def queue_keys(self) -> list[tuple[str, int]]: ...
    def min_offset_in_queue(self, topic: str, queue_id: int) -> int: ...
    def max_offset_in_queue(self, topic: str, queue_id: int) -> int: ...
    def look(self, commit_log_offset: int, *, read_body: bool = True) -> MessageExt: ...
    def put(self, message: Message) -> PutMessageResult: ...
    def get(self, topic: str, queue_id: int, offset: int, max_msgs: int = 32) -> Any: ...
    def wait_dispatched(self, timeout: float = 30.0) -> bool: ...
    def max_phy_offset(self) -> int: ...
    def dispatched_to(self, offset: int) -> bool: ...


class ReceiptHandleError(StoreError):
    """The receipt handle is unknown, expired (its invisible time passed) or superseded."""


class ReceivedMessage:
    """A received message: the store's :class:`MessageExt` fields, its receipt handle and delivery attempt."""

    __slots__ = ("message", "receipt_handle", "delivery_attempt")

    def __init__(self, message: MessageExt, receipt_handle: str, delivery_attempt: int) -> None:
        self.message = message
        self.receipt_handle = receipt_handle
        self.delivery_attempt = delivery_attempt

    def __getattr__(self, name: str) -> Any:
        return getattr(self.message, name)

    def __repr__(self) -> str:
        return (f"ReceivedMessage(topic={self.message.topic!r}, queue_id={self.message.queue_id}, "
                f"queue_offset={self.message.queue_offset}, attempt={self.delivery_attempt})")


def _handle(m: ReceivedMessage | str) -> str:
    return m if isinstance(m, str) else m.receipt_handle


class SimpleConsumer:
    """One receiver of ``group`` on ``topic``; thread-safe; a context manager."""

    def __init__(self, store: QueueStore, group: str, topic: str, *, tag_filter: str = "*",
                 invisible_duration: float = 30.0, max_reconsume_times: int | None = None,
                 fifo: bool | None = None, ack_sync_flush: bool | None = None,
                 retry_policy: RetryPolicy | None = None, config_dir: str | None = None) -> None:
        if not group or "@" in group:
            raise ValueError(f"bad consumer group {group!r}")
        if not topic:
            raise ValueError("topic is required")
        for what, name in (("consumer group", group), ("topic", topic)):
            try:  # (a lone surrogate) the pop state is UTF-8 JSON: its first write would fail, not this call
                name.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"bad {what} {name!r}: not encodable as UTF-8") from None
        if invisible_duration <= 0:
            raise ValueError(f"invisible_duration must be positive, not {invisible_duration}")
        self.store = store
        self.group, self.topic = group, topic
        self.filter = TagFilter(tag_filter)
        self.invisible_ms = int(invisible_duration * 1000)
        policy = retry_policy or RetryPolicy()
        if max_reconsume_times is not None:
            policy = RetryPolicy(max_reconsume_times, policy.backoff_ms)
        self.retry = policy
        self.fifo = bool(fifo)
        cfg = getattr(store, "config", None)
        self.ack_sync_flush = bool(getattr(cfg, "ackSyncFlush", False)) if ack_sync_flush is None \
            else ack_sync_flush
        self.client = f"{os.getpid()}-{next(_clients)}"
        self._bell = Doorbell(store.root)
        follow = None
        if store.read_only and _view_follower is not None:
            follower = _view_follower
            follow = lambda: follower(store, [topic])  # noqa: E731
        store_clock = getattr(store, "clock", time.time)  # seconds; the store's, so that tests can drive time
        self._now_ms = lambda: int(store_clock() * 1000)
        self.state = SharedPopState(config_dir or os.path.join(store.root, "config"),
                                    lambda offsets: PopService(store, offsets, self.state.config_dir,
                                                               on_visible=self._on_visible,
                                                               load=True, clock=self._now_ms),
                                    follow)
        self._mover = None if store.read_only else revive.DeadLetterMover(store, self.state.config_dir)
        # The writer dispatches what it wrote itself before a receive (as the broker's loop does): a put just
        # before is receivable at once, not after the dispatch thread's next round and its doorbell ring.
        self._dispatch = None if store.read_only else getattr(store, "dispatch_ready", None)
        self._follow = follow
        self._pending_acks: list[str] = []
        self._first_pending = 0.0
        self._lock = threading.Lock()
        self._linger_cv = threading.Condition(self._lock)  # wakes the ack-linger thread (see _linger_loop)
        self._linger: threading.Thread | None = None
        self._linger_idle = False  # the ack-linger thread waits for a first buffered ack (not for a deadline)
        self._waiter: Waiter | None = None
        self._rang = False
        self.closed = False

    # ------------------------------------------------------------ receive
    def receive(self, max_messages: int = 16, wait: float = 0.0) -> list[ReceivedMessage]:
        """Up to ``max_messages`` messages now invisible to the group's other receivers; blocks up to ``wait``
        seconds for some (woken by a put in any process, or by a message becoming visible again)."""
        if max_messages <= 0:
            raise ValueError(f"max_messages must be positive, not {max_messages}")
        deadline = time.monotonic() + max(0.0, wait)
        while True:
            self._check_open()
            if wait > 0 and self._waiter is None:
                self._waiter = Waiter(self.store.root)  # bound before looking: a put after the look rings it
            elif self._waiter is not None and self._dispatch is None:
                # A read-only receiver: rings are its only news, and one left from before this look would cost
                # another look after it.  The writer skips this socket call per receive: it dispatches its own
                # puts before looking, and a stale ring costs it at most one more look.
                self._waiter.drain()
            out, due = self._receive_once(max_messages)
            left = deadline - time.monotonic()
            if out or left <= 0:
                return out
            assert self._waiter is not None
            self._waiter.wait(min(left, max(0.0, (due - self._now_ms()) / 1000)))

    def _queue_ids(self) -> list[int]:
        return sorted(q for t, q in self.store.queue_keys() if t == self.topic)

    def _receive_once(self, n: int) -> tuple[list[ReceivedMessage], int]:
        out: list[ReceivedMessage] = []
        if self._dispatch is not None:
            self._dispatch_own_puts()
        with self._lock, self._locked(False) as pop:
            qids = self._queue_ids()
            deliveries, parked = pop.receive(self.group, self.topic, qids, n, self.invisible_ms, self.filter,
                                             fifo=self.fifo, max_attempts=self.retry.max_attempts,
                                             client=self.client, auto_renew=False)
            for d in deliveries:
                out.append(ReceivedMessage(d.message, d.handle, d.entry.attempts))
            due = pop.next_due(self.group, self.topic, qids)
        self._ring_if_needed()
        if parked:
            self._move_parked()
        return out, due

    def _dispatch_own_puts(self) -> None:
        """(The writer.)  Make what was written so far receivable: dispatched here, or, when the dispatch
        thread is in a round, after it (at most OWN_DISPATCH_WAIT; else the doorbell wakes a waiting receive)."""
        store = self.store
        end = store.max_phy_offset()
        if store.dispatched_to(end):
            return
        assert self._dispatch is not None
        self._dispatch()
        if not store.dispatched_to(end):
            store.wait_dispatched(OWN_DISPATCH_WAIT)

    def _move_parked(self) -> None:
        """Messages parked for the DLQ: moved now on the writer, else by the writer's dead-letter service."""
        if self._mover is not None:
            self._mover.run()
        else:
            revive.ring(self.store.root)

    # ------------------------------------------------------------ receipts
    def ack(self, m: ReceivedMessage | str) -> None:
        """The message is done; with ack_sync_flush durable before this returns (else see the module doc)."""
        handle = _handle(m)
        if self.ack_sync_flush:
            self._check_open()
            with self._lock, self._locked(True) as pop:
                ok = pop.ack(self.group, self.topic, handle)
            self._ring_if_needed()
            if not ok:
                raise ReceiptHandleError(f"{self.topic}@{self.group}: receipt handle {handle!r} is unknown, "
                                         "expired or superseded")
            return
        with self._lock:
            self._check_open()
            if not self._pending_acks:
                self._first_pending = time.monotonic()
                self._start_linger()
            self._pending_acks.append(handle)
            due = len(self._pending_acks) >= ACK_BATCH or time.monotonic() - self._first_pending >= ACK_LINGER
        if due:
            self.flush()

    def _start_linger(self) -> None:
        """(Under ``self._lock``.)  The first ack of a batch was buffered: make sure it is written ACK_LINGER
        seconds from now even if this receiver makes no other call; else a receiver that acks and then works
        on something else lets the message come back after its invisible time, to another receiver."""
        if self._linger is None:
            self._linger = threading.Thread(target=SimpleConsumer._linger_loop, args=(weakref.ref(self),),
                                            name=f"ack-linger-{self.client}", daemon=True)
            self._linger.start()
        elif self._linger_idle:
            self._linger_cv.notify()  # (a thread waiting for an earlier deadline looks again then)

    @staticmethod
    def _linger_loop(ref: "weakref.ref[SimpleConsumer]") -> None:
        """Writes a receiver's buffered acks ACK_LINGER seconds after the first; ends when it is closed or gone
        (it holds the receiver for at most a second at a time, so an unclosed receiver can be collected)."""
        while True:
            c = ref()
            if c is None or c.closed:
                return
            with c._linger_cv:
                if not c._pending_acks:
                    c._linger_idle = True
                    c._linger_cv.wait(1.0)
                    c._linger_idle = False
                    c = None
                    continue
                wait = c._first_pending + ACK_LINGER - time.monotonic()
                if wait > 0:
                    c._linger_cv.wait(min(wait, 1.0))
                    c = None
                    continue
            try:
                c.flush()
            except Exception as e:  # noqa: BLE001 - closed meanwhile, or the state file failed: the next call retries
                if not c.closed:
                    log.warning("%s@%s: writing buffered acks failed: %s", c.topic, c.group, e)
                    with c._linger_cv:  # tried again later, not at once: a lasting failure made this a busy loop
                        c._linger_cv.wait(ACK_RETRY)
            c = None

    def flush(self) -> None:
        """Write the gathered acks now."""
        with self._lock:
            if not self._pending_acks:
                return
            with self._locked(self.ack_sync_flush):
                pass
        self._ring_if_needed()

    @contextlib.contextmanager
    def _locked(self, durable: bool) -> Iterator[PopService]:
        """(Under ``self._lock``.)  The shared state with this receiver's gathered acks applied.  They are
        forgotten only once the section's journal write succeeded: a section that raises drops the state, the
        acks it held included (:meth:`SharedPopState.locked`), so they stay gathered for the next call (else
        acked messages came back after their invisible time, no process killed)."""
        n = len(self._pending_acks)
        with self.state.locked(durable=durable) as pop:
            for h in self._pending_acks[:n]:
                if not pop.ack(self.group, self.topic, h):
                    log.debug("%s@%s: ack of an unknown or expired receipt handle %s", self.topic, self.group, h)
            yield pop
        del self._pending_acks[:n]

    def nack(self, m: ReceivedMessage | str) -> None:
        """Delivery failed: the message comes back after the retry policy's back-off (or goes to the DLQ)."""
        handle = _handle(m)
        with self._lock, self._locked(self.ack_sync_flush) as pop:
            e = pop.entry(self.group, self.topic, handle)
            new = None if e is None else pop.change_invisible(self.group, self.topic, handle,
                                                              self.retry.next_delay_ms(e.attempts))
        self._ring_if_needed()
        if new is None:
            raise ReceiptHandleError(f"{self.topic}@{self.group}: receipt handle {handle!r} is unknown, expired "
                                     "or superseded")

    def change_invisible_duration(self, m: ReceivedMessage | str, seconds: float) -> ReceivedMessage | str:
        """Hide the message ``seconds`` from now; the new receipt handle (the old one stops working)."""
        if seconds < 0:
            raise ValueError(f"seconds must not be negative, not {seconds}")
        handle = _handle(m)
        with self._lock, self._locked(self.ack_sync_flush) as pop:
            new = pop.change_invisible(self.group, self.topic, handle, int(seconds * 1000))
        self._ring_if_needed()
        if new is None:
            raise ReceiptHandleError(f"{self.topic}@{self.group}: receipt handle {handle!r} is unknown, expired "
                                     "or superseded")
        if isinstance(m, ReceivedMessage):
            return ReceivedMessage(m.message, new, m.delivery_attempt)
        return new

    # ------------------------------------------------------------ wake-ups
    def _on_visible(self, topic: str, group: str) -> None:
        self._rang = True  # under the state lock: rung after it is released

    def _ring_if_needed(self) -> None:
        if self._rang:
            self._rang = False
            self._bell.ring()

    def _check_open(self) -> None:
        if self.closed:
            raise StoreError(f"{self.topic}@{self.group}: the simple consumer is closed")

    def close(self) -> None:
        """Write the gathered acks, release the wake-up socket and the state file."""
        if self.closed:
            return
        try:
            self.flush()
        finally:
            self.closed = True
            with self._lock:
                self._linger_cv.notify_all()
            if self._waiter is not None:
                self._waiter.close()
            self._bell.close()
            self.state.close()

    def __enter__(self) -> "SimpleConsumer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        waiter = getattr(self, "_waiter", None)
        if waiter is not None and not getattr(self, "closed", True):
            waiter.close()
