"""Spark streams as consumer groups: option ``groupId`` of the stream reader.

After each micro-batch Spark has committed, the driver writes how far the stream has read to the store's
``config/consumerOffset.json`` under that group, as the embedded Consumer commits
(:func:`rocketstore.storage.group_offsets.updating_offsets`: the offsets file's lock, re-read, change only this
group's entries, atomic write), so ``rocketstore lag`` and ``groups`` show the Spark job beside other consumers.

The stream's own position is its checkpoint: nothing here is ever read back by the stream.

Who owns the file.  A running broker keeps the offset table in memory and rewrites the whole file, so a
commit made beside it would be silently reverted (and a broker starting between our read and write would
not see it).  The write therefore holds the store's lock (:class:`StoreLock`, as ``reset-offset`` does) for
the few milliseconds it takes.  When another process holds the store (a broker serving it, or any writer),
the position is not written: a warning says so, and the next committed batch tries again.  The file never
holds a position the stream has not reached: a queue's offset is the number of its units that point below
the stream's commitlog offset, so a unit not yet dispatched counts as unread.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

from ..errors import StoreError, StoreLockedError
from ..storage.group_offsets import updating_offsets
from ..storage.store_lock import StoreLock
from ..store import MessageStore

log = logging.getLogger(__name__)

Queue = tuple[str, int]
# RocketMQ's own topics: a stream reading "every topic" is not their consumer.
_SYSTEM_PREFIXES = ("RMQ_SYS_", "rmq_sys_", "SCHEDULE_TOPIC_XXXX", "TBW102", "BenchmarkTest", "OFFSET_MOVED_EVENT",
                    "SELF_TEST_TOPIC", "TRANS_CHECK_MAX_TIME_TOPIC")


def check_group(group: str) -> str:
    """A group name RocketMQ would store (``topic@group`` keys: no '@', not empty)."""
    group = str(group).strip()
    if not group or "@" in group:
        raise StoreError(f"option groupId={group!r}: a consumer group name, not empty and without '@'")
    return group


def queue_position(store: MessageStore, topic: str, queue_id: int, offset: int) -> int | None:
    """The queue offset of the first unit of ``topic``/``queue_id`` pointing at or past commitlog ``offset``
    (everything below it was read), or None when the local queue cannot tell (the stream is behind the units
    still on disk, in a store whose tier holds older ones)."""
    cq = store.find_consume_queue(topic, queue_id)
    lo, hi = cq.min_offset_in_queue, cq.max_offset_in_queue
    if lo >= hi:
        return hi
    first = cq.get_unit(lo)
    if first is None:
        return None
    if first[0] >= offset:
        return lo if lo == store.min_offset_in_queue(topic, queue_id) else None
    while lo < hi:  # units ascend by commitlog offset within a queue
        mid = (lo + hi) // 2
        unit = cq.get_unit(mid)
        if unit is None:
            return None
        if unit[0] >= offset:
            hi = mid
        else:
            lo = mid + 1
    return lo


def positions_at(store: MessageStore, offset: int, topics: Iterable[str] | None,
                 queue_ids: Iterable[int] | None) -> dict[Queue, int]:
    """Per selected queue, the position of a stream that has read the commitlog up to ``offset``."""
    topic_set = None if topics is None else set(topics)
    qid_set = None if queue_ids is None else set(queue_ids)
    out: dict[Queue, int] = {}
    for topic, qid in store.queue_keys():
        if topic_set is None and topic.startswith(_SYSTEM_PREFIXES):
            continue
        if (topic_set is not None and topic not in topic_set) or (qid_set is not None and qid not in qid_set):
            continue
        pos = queue_position(store, topic, qid, offset)
        if pos is None:
            log.info("%s: %s/%d: the stream is behind the local units; its position there is not written",
                     store.root, topic, qid)
            continue
        out[(topic, qid)] = pos
    return out


def stream_positions(root: str, end: Any, topics: Iterable[str] | None,
                     queue_ids: Iterable[int] | None) -> dict[Queue, int]:
    """The queue positions of a stream offset: ``{"<topic>": {"<queue id>": offset}}`` (the queue view) as it
    is, or a commitlog offset (``{"<store>": offset}``) through the store's consume queues."""
    value = end.get(root) if isinstance(end, dict) else None
    if isinstance(end, dict) and value is None and all(isinstance(v, dict) for v in end.values()):
        return {(str(t), int(q)): int(o) for t, qs in end.items() for q, o in qs.items()
                if (topics is None or t in topics) and int(o) >= 0}
    if value is None:
        raise StoreError(f"groupId: the stream's offset {end!r} names no position in {root}")
    with MessageStore.open(root, read_only=True) as store:
        return positions_at(store, int(value), topics, queue_ids)


class GroupCommitter:
    """Writes a stream's position under ``group`` after each committed micro-batch (the reader's ``commit``)."""

    def __init__(self, group: str, roots: list[str], topics: Iterable[str] | None,
                 queue_ids: Iterable[int] | None) -> None:
        self.group = check_group(group)
        self.roots = roots
        self.topics = None if topics is None else frozenset(topics)
        self.queue_ids = None if queue_ids is None else frozenset(queue_ids)
        self._skipping: set[str] = set()  # stores whose last write was skipped (warned once until it works again)
        self._written: dict[str, Any] = {}  # per store, the stream offset last written (not written again)

    def commit(self, end: Any) -> dict[str, dict[Queue, int] | None]:
        """Write the position of ``end`` to each store; per store what was written ({} when that stream offset
        was already written), None when skipped."""
        return {root: self.commit_store(root, end) for root in self.roots}

    def commit_store(self, root: str, end: Any) -> dict[Queue, int] | None:
        key = json.dumps(end.get(root, end) if isinstance(end, dict) else end, sort_keys=True)
        if self._written.get(root) == key:
            return {}
        lock = StoreLock(root)
        try:
            lock.acquire()
        except StoreLockedError as e:
            if root not in self._skipping:
                log.warning("groupId %s: %s is held by another process (a broker serving it owns "
                            "config/consumerOffset.json, a writer may be one); the stream's position is not "
                            "written until a committed batch finds the store free (%s)", self.group, root, e)
                self._skipping.add(root)
            return None
        try:
            positions = stream_positions(root, end, self.topics, self.queue_ids)
            with updating_offsets(root) as offsets:  # the embedded Consumer's commit path, all queues at once
                for (topic, qid), off in sorted(positions.items()):
                    offsets.commit(topic, self.group, qid, off)
        finally:
            lock.release()
        self._written[root] = key
        if root in self._skipping:
            log.warning("groupId %s: %s is free again; the stream's position is written", self.group, root)
            self._skipping.discard(root)
        log.debug("groupId %s: %s: %d queue positions written", self.group, root, len(positions))
        return positions
