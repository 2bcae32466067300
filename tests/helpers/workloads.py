"""Store workloads and probes shared by several test files."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from rocketstore import GetMessageStatus, MessageStore, StoreConfig
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


_CRASHING_WRITER = textwrap.dedent("""
    import os, sys
    from rocketstore import Message, MessageStore, StoreConfig
    st = MessageStore.open(sys.argv[1], StoreConfig(**eval(sys.argv[2])))
    keyed, dispatched = sys.argv[4] == "1", sys.argv[5] == "1"
    for i in range(1, int(sys.argv[3]) + 1):
        assert st.put(Message("T", b"m%d|" % i + bytes(400), queue_id=0, keys="k%d" % i if keyed else None)).ok
    if dispatched:
        st.wait_dispatched(10.0)  # the queues hold every record (in the page cache too)
    os._exit(0)  # the process dies: no flush, no close; its records are in the page cache only
""")


def crashed_writer(root: Path, cfg: dict, n: int, *, keyed: bool = False, dispatched: bool = False
                   ) -> dict[int, bytes]:
    """One put (m0) by a clean open and close, then a writer process that puts m1..m``n`` on T/0 and dies
    without a flush or a close (ASYNC_FLUSH: its records reach the page cache only).  Returns the bodies by
    queue offset.  Run it under a power-loss shadow to see what a later power cut keeps."""
    with MessageStore.open(str(root), StoreConfig(**cfg)) as st:
        assert st.put(Message("T", b"m0|" + bytes(400), queue_id=0)).ok
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    subprocess.run([sys.executable, "-c", _CRASHING_WRITER, str(root), repr(cfg), str(n), "1" if keyed else "0",
                    "1" if dispatched else "0"], check=True, env=env, timeout=60)
    return {i: b"m%d|" % i + bytes(400) for i in range(n + 1)}
