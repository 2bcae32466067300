"""An embedded consumer: a group's position in a topic's queues, blocking polls, committed offsets.

``Consumer(store, group, topic)`` reads the topic's consume queues from the
group's committed offsets (``config/consumerOffset.json``, RocketMQ's layout,
see :mod:`rocketstore.storage.group_offsets`), or from the queues' start (``start=
"earliest"``) or end (``"latest"``) for a group with none.  ``poll(timeout)``
returns the next messages of any queue, blocking until some arrive;
``commit()`` persists the position.  Iterating yields messages one by one and
(with ``auto_commit``) commits what the loop has finished with.

Waiting for new messages:

- on a writable store of this process, the consumer sleeps on the dispatcher's
  condition (``ReputMessageService.caught_up``) and wakes when a put has been
  dispatched to the consume queues: latency is the dispatcher's (about a
  millisecond);
- on a read-only store (``Consumer(path, ...)`` opens one), typically of a
  directory another process writes, it extends the view every
  ``poll_interval`` (default 50 ms) to the records and consume-queue units
  appended since, each checked (:mod:`rocketstore.tail_view`): latency is
  ``poll_interval`` plus the check of what is new.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator

from .format.codec import MessageExt
from .errors import StoreError
from .storage.group_offsets import commit_offsets, read_offsets
from .format.message import GetMessageStatus, parse_tag_filter
from .store import MessageStore
from .tail_view import extend_view

log = logging.getLogger(__name__)

EARLIEST, LATEST = "earliest", "latest"
# Statuses after which the queue has nothing more for now.
_IDLE = (GetMessageStatus.OFFSET_OVERFLOW_ONE, GetMessageStatus.NO_MESSAGE_IN_QUEUE)


class Consumer:
    """One group's consumer of one topic (all its queues, or ``queues``), for one thread at a time.

    ``store`` is an open :class:`MessageStore` (not closed by the consumer) or a
    store directory, which the consumer opens read-only and follows.  The
    methods take an internal lock, so ``commit`` may be called from another
    thread than ``poll``.
    """

    def __init__(self, store: MessageStore | str, group: str, topic: str, queues: Iterable[int] | None = None,
                 tag_filter: str | None = None, *, start: str = EARLIEST, max_messages: int = 32,
                 auto_commit: bool = False, poll_interval: float = 0.05) -> None:
        if start not in (EARLIEST, LATEST):
            raise ValueError(f"start must be {EARLIEST!r} or {LATEST!r}, not {start!r}")
        if not group or "@" in group:
            raise ValueError(f"bad consumer group {group!r}: empty or containing '@'")
        if isinstance(store, str):
            self._store = MessageStore.open(store, read_only=True)
            self._own_store = True
        else:
            self._store = store
            self._own_store = False
        self.root = self._store.root
        self.group = group
        self.topic = topic
        self.tag_filter = parse_tag_filter(tag_filter) if isinstance(tag_filter, str) else tag_filter
        self.max_messages = max_messages
        self.auto_commit = auto_commit
        self.poll_interval = poll_interval
        self._fixed_queues = None if queues is None else sorted(set(queues))
        self._lock = threading.RLock()
        self._next: dict[int, int] = {}       # where the next read of each queue begins
        self._consumed: dict[int, int] = {}   # what commit() writes: the next offset to consume per queue
        self._committed: dict[int, int] = dict(read_offsets(self.root).table.get(f"{topic}@{group}", {}))
        self._rr = 0
        self._closed = False
        self._refresh_queues(start)

    # ------------------------------------------------------------ queues and positions
    @property
    def store(self) -> MessageStore:
        return self._store

    def queues(self) -> list[int]:
        """The queue ids this consumer reads."""
        with self._lock:
            return sorted(self._next)

    def position(self) -> dict[int, int]:
        """The next offset to consume per queue (what ``commit`` would write)."""
        with self._lock:
            return dict(self._consumed)

    def committed(self) -> dict[int, int]:
        """The offsets last committed (or read from the file at start)."""
        with self._lock:
            return dict(self._committed)

    def seek(self, queue_id: int, offset: int) -> None:
        """Read ``queue_id`` from ``offset`` on (committed by the next ``commit``)."""
        with self._lock:
            self._next[queue_id] = self._consumed[queue_id] = offset

    def seek_to_time(self, timestamp_ms: int) -> None:
        """Every queue from its first message stored at or after ``timestamp_ms``."""
        with self._lock:
            for q in list(self._next):
                self.seek(q, self._store.offset_by_time(self.topic, q, timestamp_ms))

    def _refresh_queues(self, start: str = EARLIEST) -> None:
        """Take in the topic's queues; one without a committed offset starts at ``start`` (queues that appear
        later start at their beginning: everything in them came after this consumer started)."""
        ids = self._fixed_queues
        if ids is None:
            ids = [q for t, q in self._store.queue_keys() if t == self.topic]
        for q in ids:
            if q in self._next:
                continue
            if q in self._committed:
                off = self._committed[q]
            elif start == LATEST:
                off = self._store.max_offset_in_queue(self.topic, q)
            else:
                off = self._store.min_offset_in_queue(self.topic, q)
            self._next[q] = self._consumed[q] = off

    # ------------------------------------------------------------ polling
    def poll(self, timeout: float | None = 0.0, max_messages: int | None = None) -> list[MessageExt]:
        """The next messages (of one queue, in queue order), waiting up to ``timeout`` seconds for some
        (None: until some arrive).  The position moves past what is returned."""
        msgs = self._fetch(timeout, max_messages)
        with self._lock:
            self._consumed.update(self._next)
        return msgs

    def _fetch(self, timeout: float | None, max_messages: int | None) -> list[MessageExt]:
        """The next batch; the read position moves past it, the consumed position does not (the caller's job).
        Raises StoreError once the consumer is closed."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            with self._lock:
                if self._closed:
                    raise StoreError(f"{self.root}: consumer of group {self.group} is closed")
                mark = self._dispatch_mark()
                msgs = self._read_once(max_messages or self.max_messages)
            if msgs:
                return msgs
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return []
            self._wait_for_more(mark, remaining)

    def _batches(self, batch_timeout: float | None) -> Iterator[list[MessageExt]]:
        """Batches for the iterators, until the consumer is closed."""
        while not self._closed:
            try:
                yield self._fetch(batch_timeout, None)
            except StoreError:
                if self._closed:
                    return
                raise

    def _yielded(self, m: MessageExt) -> None:
        """The loop asked for the message after ``m``: ``m`` is consumed."""
        with self._lock:
            self._consumed[m.queue_id] = max(self._consumed.get(m.queue_id, 0), m.queue_offset + 1)

    def _batch_done(self) -> None:
        with self._lock:
            self._consumed.update(self._next)  # including units the tag filter skipped after the batch

    def _read_once(self, max_messages: int) -> list[MessageExt]:
        self._refresh_queues()
        order = sorted(self._next)
        if not order:
            return []
        n = len(order)
        for i in range(n):
            q = order[(self._rr + i) % n]
            while True:
                offset = self._next[q]
                try:
                    r = self._store.get(self.topic, q, offset, max_messages, self.tag_filter)
                except OSError as e:  # never a raw OSError out of poll: name the queue and offset
                    raise StoreError(f"{self.root}: {self.topic}@{self.group} queue {q} at offset {offset}: "
                                     f"read failed: {e}") from e
                if r.status in _IDLE:
                    break
                if r.status is GetMessageStatus.OFFSET_TOO_SMALL:
                    log.warning("%s: %s@%s queue %d: offset %d is gone (the queue now starts at %d); skipping ahead",
                                self.root, self.topic, self.group, q, offset, r.next_begin_offset)
                elif r.status is GetMessageStatus.OFFSET_OVERFLOW_BADLY:
                    log.warning("%s: %s@%s queue %d: offset %d is past the queue's end %d; moving to the end",
                                self.root, self.topic, self.group, q, offset, r.max_offset)
                self._next[q] = r.next_begin_offset
                if r.status is not GetMessageStatus.FOUND and self._consumed.get(q, 0) < r.next_begin_offset:
                    self._consumed[q] = r.next_begin_offset  # filtered, removed or reset: nothing to hand out
                if r.messages:
                    self._rr = (self._rr + i + 1) % n
                    return r.messages
                if r.next_begin_offset == offset:
                    break
        return []

    # ------------------------------------------------------------ waiting
    def _dispatch_mark(self) -> int | None:
        reput = self._store.reput
        return None if reput is None else reput.reput_from_offset

    def _wait_for_more(self, mark: int | None, remaining: float | None) -> None:
        reput = self._store.reput
        if reput is not None and not self._store.closed:
            slice_s = 1.0 if remaining is None else min(remaining, 1.0)
            with reput.caught_up:
                reput.caught_up.wait_for(lambda: reput.reput_from_offset != mark or reput.stopped, slice_s)
            return
        # Another process writes: extend the read-only view to what it has appended since (and past what its
        # retention removed: the queue's minimum moves up and _read_once skips ahead with a warning).
        time.sleep(self.poll_interval if remaining is None else min(remaining, self.poll_interval))
        with self._lock:
            if not self._closed and self._store.read_only:
                try:
                    extend_view(self._store, [self.topic])
                except OSError as e:  # a file the writer removed between two looks: the next look sees it gone
                    log.warning("%s: %s@%s: extending the view failed (%s); looking again", self.root, self.topic,
                                self.group, e)

    # ------------------------------------------------------------ committing
    def commit(self) -> dict[int, int]:
        """Write the consumed position to ``config/consumerOffset.json`` (atomic, under the offsets lock);
        returns what was written.  Only queues whose position moved are written."""
        with self._lock:
            changed = {q: o for q, o in self._consumed.items() if self._committed.get(q) != o}
            if changed:
                commit_offsets(self.root, self.topic, self.group, changed)
                self._committed.update(changed)
            return changed

    # ------------------------------------------------------------ iteration and closing
    def __iter__(self) -> Iterator[MessageExt]:
        """Messages one by one until :meth:`close` (from another thread); a message counts as consumed once
        the loop asks for the next one, and ``auto_commit`` commits each finished batch."""
        for batch in self._batches(1.0):
            for m in batch:
                yield m
                self._yielded(m)
            self._batch_done()
            if self.auto_commit and batch:
                self.commit()

    def close(self) -> None:
        """Commit (with ``auto_commit``) and close the store if the consumer opened it."""
        with self._lock:
            if self._closed:
                return
            if self.auto_commit:
                self.commit()
            self._closed = True
            if self._own_store:
                self._store.close()

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncConsumer:
    """:class:`Consumer` for asyncio: ``await poll(timeout)``, ``async for msg in consumer``.

    The blocking waits run in the default executor in slices of at most
    ``slice_s`` seconds, so a cancelled task stops within one slice; reads
    themselves (memory-mapped, microseconds) also run there.
    """

    def __init__(self, store: MessageStore | str, group: str, topic: str, queues: Iterable[int] | None = None,
                 tag_filter: str | None = None, *, slice_s: float = 0.2, **kw: object) -> None:
        self.consumer = Consumer(store, group, topic, queues, tag_filter, **kw)  # type: ignore[arg-type]
        self.slice_s = slice_s

    async def poll(self, timeout: float | None = 0.0, max_messages: int | None = None) -> list[MessageExt]:
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait = self.slice_s if remaining is None else min(self.slice_s, remaining)
            msgs = await asyncio.to_thread(self.consumer.poll, wait, max_messages)
            if msgs or (deadline is not None and time.monotonic() >= deadline):
                return msgs

    async def commit(self) -> dict[int, int]:
        return await asyncio.to_thread(self.consumer.commit)

    async def __aiter__(self) -> AsyncIterator[MessageExt]:
        c = self.consumer
        while not c._closed:
            try:
                batch = await asyncio.to_thread(c._fetch, self.slice_s, None)
            except StoreError:
                if c._closed:
                    return
                raise
            for m in batch:
                yield m
                c._yielded(m)
            c._batch_done()
            if c.auto_commit and batch:
                await self.commit()

    async def close(self) -> None:
        await asyncio.to_thread(self.consumer.close)

    async def __aenter__(self) -> "AsyncConsumer":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
