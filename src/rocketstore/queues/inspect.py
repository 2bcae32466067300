"""The operator's view of pop groups: in flight, waiting for a retry, blocked (FIFO) and dead-lettered.

Read from ``config/popState.json`` and its journal as they are (complete lines only), without the state
lock, so a live store's numbers are a moment's snapshot.  Per (group, topic):

- ``inflight``: received and not acked, still invisible (includes nacked messages backing off);
- ``retry_depth``: not acked and delivered before, waiting to be delivered again (its invisible time has
  passed, or it was nacked) -- RocketMQ's retry backlog;
- ``blocked``: FIFO messages waiting behind an unacked one of their message group;
- ``dlq_pending``: parked for the DLQ by a read-only receiver, waiting for the writer to move them;
- ``dlq_depth``: messages in ``%DLQ%<group>`` (needs ``store``; None without one).
"""

from __future__ import annotations

import os
import time
from typing import Any, Protocol

from ..storage.consumer_offsets import read_json_lenient
from . import journal
from .pop import Entry
from .retry import dlq_topic


class QueueRanges(Protocol):
    def queue_keys(self) -> list[tuple[str, int]]: ...
    def min_offset_in_queue(self, topic: str, queue_id: int) -> int: ...
    def max_offset_in_queue(self, topic: str, queue_id: int) -> int: ...


def dlq_depth(store: QueueRanges, group: str) -> int:
    topic = dlq_topic(group)
    return sum(max(0, store.max_offset_in_queue(t, q) - store.min_offset_in_queue(t, q))
               for t, q in store.queue_keys() if t == topic)


def group_stats(store_root: str, store: QueueRanges | None = None, now_ms: int | None = None) -> list[dict[str, Any]]:
    """One dict per (group, topic) of popState.json: group, topic, inflight, retry_depth, blocked, dlq_depth and
    ``queues`` ({queue id: inflight}), sorted by group and topic."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    path = os.path.join(store_root, "config", "popState.json")
    stats: dict[tuple[str, str], dict[str, Any]] = {}
    for q in journal.current_queues(path, read_json_lenient(path)):
        try:
            group, topic, qid = str(q["group"]), str(q["topic"]), int(q["queueId"])
            entries = [Entry.from_json(raw) for raw in q.get("entries") or []]
        except (KeyError, TypeError, ValueError, IndexError):
            continue  # PopService logs it when it loads the file
        s = stats.setdefault((group, topic), {"group": group, "topic": topic, "inflight": 0, "retry_depth": 0,
                                              "blocked": 0, "dlq_pending": 0, "dlq_depth": None, "queues": {}})
        s["dlq_pending"] += sum(1 for e in entries if e.parked)
        entries = [e for e in entries if not e.parked]
        inflight = sum(1 for e in entries if not e.blocked and e.visible_at > now)
        s["inflight"] += inflight
        s["retry_depth"] += sum(1 for e in entries if not e.blocked and e.attempts >= 1
                                and (e.visible_at <= now or e.attempts >= 2))
        s["blocked"] += sum(1 for e in entries if e.blocked)
        s["queues"][qid] = inflight
    if store is not None:
        for s in stats.values():
            s["dlq_depth"] = dlq_depth(store, s["group"])
    return [stats[k] for k in sorted(stats)]
