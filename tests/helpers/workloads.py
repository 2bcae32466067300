"""Store workloads and probes shared by several test files."""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator

from rocketstore import GetMessageStatus, MessageStore
from rocketstore.storage.consume_queue import ConsumeQueue
from rocketstore.format.message import Message


def mixed_puts(store: MessageStore, rnd: random.Random, count: int = 600,
               after_each: Callable[[], None] | None = None) -> list[tuple[str, int, int]]:
    """Puts across three queues of topics T and U: every 7th a batch of 1-12, every 3rd with keys
    ``k<i> j<i>``, tags on half; returns (topic, i, commitlog offset) of the keyed ones."""
    keyed = []
    for i in range(count):
        q = rnd.randrange(3)
        if i % 7 == 0:
            batch = [Message("T", b"b" * rnd.randrange(1, 300), queue_id=q, tags=f"t{i}")
                     for _ in range(rnd.randrange(1, 13))]
            assert store.put_batch(batch).ok
        else:
            topic = "T" if i % 5 else "U"
            r = store.put(Message(topic, b"x" * rnd.randrange(1, 300), queue_id=q,
                                  keys=f"k{i} j{i}" if i % 3 == 0 else None, tags="TagA" if i % 2 else None))
            assert r.ok
            if i % 3 == 0:
                keyed.append((topic, i, r.commit_log_offset))
        if after_each is not None:
            after_each()
    return keyed


@contextlib.contextmanager
def put_units_threads() -> Iterator[list[int]]:
    """Record the thread of every ConsumeQueue.put_units call made inside the block."""
    writers: list[int] = []
    real = ConsumeQueue.put_units

    def put_units(cq, *a):
        writers.append(threading.get_ident())
        return real(cq, *a)
    ConsumeQueue.put_units = put_units
    try:
        yield writers
    finally:
        ConsumeQueue.put_units = real


def read_queue(store: MessageStore, topic: str, qid: int, start: int | None = None) -> dict[int, bytes]:
    """Every message of a queue, queue offset -> body, from ``start`` (the queue's minimum when None; 0 fails a
    queue whose first offsets were hidden) to its end; every get must find messages."""
    off = store.min_offset_in_queue(topic, qid) if start is None else start
    end = store.max_offset_in_queue(topic, qid)
    got: dict[int, bytes] = {}
    while off < end:
        r = store.get(topic, qid, off, 32)
        assert r.status is GetMessageStatus.FOUND, \
            f"get {topic}-{qid} @{off}: {r.status.name} (queue ..{end}), next {r.next_begin_offset}"
        got.update((m.queue_offset, m.body) for m in r.messages)
        off = r.next_begin_offset
    return got
