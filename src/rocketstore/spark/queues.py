"""Kafka's partition view of a store: each consume queue is a partition, its queue offsets are the offsets.

The reader switches to this view when an option of Spark's Kafka source that speaks of partitions is given
(per-queue JSON ``startingOffsets`` / ``endingOffsets``, ``assign``, ``subscribePattern``,
``*OffsetsByTimestamp``, ``maxOffsetsPerTrigger`` / ``minOffsetsPerTrigger``).  It then reads the units of the
selected consume queues and decodes the records they point at, as a consumer pulls them, instead of following
the commitlog: offsets count messages (what Kafka's rate limits and lag count), and records in no queue
(transaction halves not yet committed) are not rows, as no consumer sees them.

Offsets of a stream in this view are ``{"<topic>": {"<queue id>": next queue offset}}``, Kafka's JSON.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import StoreError
from ..paths import StorePaths
from . import plan as planner
from . import segment

log = logging.getLogger(__name__)

Queue = tuple[str, int]
EARLIEST, LATEST = -2, -1  # Kafka's special offsets in per-partition JSON

# Options that only make sense per queue: any of them selects the queue view.
QUEUE_OPTIONS = ("assign", "subscribePattern", "startingOffsetsByTimestamp", "endingOffsetsByTimestamp",
                 "maxOffsetsPerTrigger", "minOffsetsPerTrigger", "maxRecordsPerPartition")


def _json(opts: Any, name: str) -> Any:
    text = opts.get(name)
    if text is None:
        return None
    try:
        return json.loads(str(text))
    except ValueError:
        raise StoreError(f"option {name}={text!r}: not valid JSON") from None


def per_queue_json(opts: Any, name: str) -> bool:
    """Whether option ``name`` is Kafka's per-partition JSON ``{"topic": {"0": offset}}`` (not a store-path map)."""
    text = opts.get(name)
    if text is None or not str(text).strip().startswith("{"):
        return False
    data = _json(opts, name)
    return isinstance(data, dict) and bool(data) and all(isinstance(v, dict) for v in data.values())


def wants_queues(opts: Any, stream: bool) -> bool:
    """Whether the options ask for the queue view (the rate limits only in a stream: a batch ignores them)."""
    names = QUEUE_OPTIONS if stream else [o for o in QUEUE_OPTIONS if "PerTrigger" not in o]
    return any(opts.get(o) is not None for o in names) or \
        per_queue_json(opts, "startingOffsets") or per_queue_json(opts, "endingOffsets")


def parse_per_queue(opts: Any, name: str, *, timestamps: bool = False) -> dict[Queue, int] | None:
    """``{"topic": {"0": n}}`` as {(topic, 0): n}; offsets may be -2 (earliest) / -1 (latest), timestamps >= 0."""
    data = _json(opts, name)
    if data is None:
        return None
    text = opts.get(name)
    what = "a timestamp (ms)" if timestamps else "a queue offset, -2 (earliest) or -1 (latest)"
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise StoreError(f'option {name}={text!r}: expected {{"<topic>": {{"<queue id>": {what}}}}}')
    out: dict[Queue, int] = {}
    for topic, queues in data.items():
        for qid, v in queues.items():
            if not str(qid).isdigit():
                raise StoreError(f"option {name}={text!r}: queue id {qid!r} of {topic} is not a number")
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if timestamps else EARLIEST):
                raise StoreError(f"option {name}={text!r}: {topic}/{qid}: {v!r} is not {what}")
            out[(topic, int(qid))] = v
    return out


@dataclass(frozen=True)
class Selection:
    """Which consume queues are read: Kafka's ``assign`` / ``subscribe`` (``topics``) / ``subscribePattern``."""

    assign: frozenset[Queue] | None = None
    pattern: str | None = None
    topics: frozenset[str] | None = None
    queue_ids: frozenset[int] | None = None

    @classmethod
    def from_options(cls, opts: Any) -> Selection:
        given = [o for o in ("assign", "subscribePattern", "topics", "subscribe") if opts.get(o) is not None]
        if len(given) > 1:
            raise StoreError(f"options {', '.join(given)}: give only one of assign, subscribe (topics), "
                             "subscribePattern")
        assign = None
        if opts.get("assign") is not None:
            data = _json(opts, "assign")
            text = opts.get("assign")
            if not isinstance(data, dict) or not all(
                    isinstance(v, list) and all(isinstance(q, int) and not isinstance(q, bool) and q >= 0 for q in v)
                    for v in data.values()):
                raise StoreError(f'option assign={text!r}: expected {{"<topic>": [<queue id>, ...]}}')
            assign = frozenset((t, q) for t, qs in data.items() for q in qs)
        pattern = opts.get("subscribePattern")
        if pattern is not None:
            try:
                re.compile(str(pattern))
            except re.error as e:
                raise StoreError(f"option subscribePattern={pattern!r}: not a regular expression ({e})") from None
        return cls(assign, None if pattern is None else str(pattern), opts.topics(), opts.queue_ids())

    def pick(self, ranges: dict[Queue, planner.QueueRange]) -> dict[Queue, planner.QueueRange]:
        """The selected queues among the store's (a pattern matches whole topic names, as Java's ``matches``)."""
        rx = re.compile(self.pattern) if self.pattern is not None else None
        out = {}
        for k, r in ranges.items():
            if self.assign is not None and k not in self.assign:
                continue
            if rx is not None and not rx.fullmatch(k[0]):
                continue
            if self.topics is not None and k[0] not in self.topics:
                continue
            if self.queue_ids is not None and k[1] not in self.queue_ids:
                continue
            out[k] = r
        return out

    def check_assigned(self, ranges: dict[Queue, planner.QueueRange], root: str, text: Any) -> None:
        """``assign`` naming a topic the store does not have is a mistake (Kafka would wait for it forever)."""
        if self.assign is None:
            return
        topics = {t for t, _ in ranges}
        for t, q in sorted(self.assign):
            if t not in topics:
                raise StoreError(f"option assign={text!r}: {root} has no topic {t}")
            if (t, q) not in ranges:
                raise StoreError(f"option assign={text!r}: {root} has no queue {q} of topic {t}")


def resolve(name: str, text: Any, spec: dict[Queue, int] | None, default: int,
            ranges: dict[Queue, planner.QueueRange], selected: dict[Queue, planner.QueueRange]) -> dict[Queue, int]:
    """Queue offsets of the selected queues from a per-queue spec (-2/-1/offset); queues it omits get ``default``."""
    spec = spec or {}
    topics = {t for t, _ in ranges}
    for (t, q), v in spec.items():
        if t not in topics:
            raise StoreError(f"option {name}={text!r}: no topic {t} in the store")
        r = ranges.get((t, q))
        if r is None:
            raise StoreError(f"option {name}={text!r}: topic {t} has no queue {q}")
        if v > r.end:
            raise StoreError(f"option {name}={text!r}: {t}/{q} offset {v} is past the queue's end {r.end}")
    out = {}
    for k, r in selected.items():
        v = spec.get(k, default)
        out[k] = r.earliest if v == EARLIEST else r.end if v == LATEST else v
    return out


def by_timestamp(root: str, name: str, text: Any, times: dict[Queue, int], selected: dict[Queue, planner.QueueRange],
                 ranges: dict[Queue, planner.QueueRange], strategy: str) -> dict[Queue, int]:
    """Queue offsets of the first message stored at or after each queue's time; ``strategy`` says what a queue
    with no such message gets: ``error`` (fail, naming it), ``latest`` (its end), ``end`` (its end: endings)."""
    for t, q in times:
        if (t, q) not in ranges:
            raise StoreError(f"option {name}={text!r}: no queue {q} of topic {t} in the store")
    wanted = {k: ts for k, ts in times.items() if k in selected}
    found = planner.queue_offsets_by_time(root, wanted)
    out = {}
    for k, ts in wanted.items():
        r = selected[k]
        off = max(r.earliest, found[k])
        if off >= r.end:
            if strategy == "error":
                raise StoreError(f"option {name}={text!r}: {k[0]}/{k[1]} has no message stored at or after {ts} "
                                 "(set startingOffsetsByTimestampStrategy=latest to start at its end)")
            off = r.end
        out[k] = off
    return out


def to_json(offsets: dict[Queue, int]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for (t, q), v in sorted(offsets.items()):
        out.setdefault(t, {})[str(q)] = int(v)
    return out


def from_json(data: dict | None) -> dict[Queue, int]:
    return {(t, int(q)): int(v) for t, qs in (data or {}).items() for q, v in qs.items()}


def limit_rows(start: dict[Queue, int], end: dict[Queue, int], max_rows: int) -> dict[Queue, int]:
    """``end`` cut to at most ``max_rows`` messages over all queues, shared in proportion to each queue's
    available messages as Kafka shares ``maxOffsetsPerTrigger``; the leftover of the rounding goes to the
    largest remainders, so the batch is exactly ``max_rows`` messages when that many are available."""
    avail = {k: max(0, end[k] - start.get(k, end[k])) for k in end}
    total = sum(avail.values())
    if total <= max_rows:
        return dict(end)
    share = {k: max_rows * n / total for k, n in avail.items()}
    take = {k: int(s) for k, s in share.items()}
    left = max_rows - sum(take.values())
    for k in sorted(share, key=lambda k: (take[k] - share[k], k))[:left]:
        take[k] += 1
    return {k: start.get(k, end[k]) + take[k] for k in end}


def behind(end: dict[Queue, int], latest: dict[Queue, int]) -> dict[str, str]:
    """Kafka's source metrics: messages each queue's batch end is behind its latest offset (min/max/avg)."""
    lags = [max(0, latest[k] - end.get(k, latest[k])) for k in latest]
    if not lags:
        return {}
    return {"minOffsetsBehindLatest": str(min(lags)), "maxOffsetsBehindLatest": str(max(lags)),
            "avgOffsetsBehindLatest": str(float(sum(lags)) / len(lags))}


def offsets_behind(source_progress: Any) -> dict[str, str]:
    """The lag metrics of one ``StreamingQueryProgress.sources[i]`` of a queue-view stream, from the
    ``endOffset`` and ``latestOffset`` Spark reports (PySpark's Python data sources cannot add metrics)."""
    def load(v: Any) -> dict:
        return json.loads(v) if isinstance(v, str) else (v or {})
    get = source_progress.get if isinstance(source_progress, dict) else lambda k: getattr(source_progress, k)
    return behind(from_json(load(get("endOffset"))), from_json(load(get("latestOffset"))))


# ---------------------------------------------------------------- executors

@dataclass(frozen=True)
class QueueSpan:
    """Queue offsets [lo, hi) of one consume queue, read by one task."""

    root: str
    topic: str
    queue_id: int
    directory: str
    file_size: int
    lo: int
    hi: int


def spans(root: str, start: dict[Queue, int], end: dict[Queue, int], ranges: dict[Queue, planner.QueueRange],
          max_records: int | None = None) -> list[QueueSpan]:
    """The tasks of a queue-view read: one per queue with messages in [start, end), cut into pieces of at most
    ``max_records`` (Kafka's ``maxRecordsPerPartition``)."""
    out = []
    for k in sorted(end):
        r = ranges.get(k)
        if r is None:
            continue
        lo, hi = start.get(k, r.earliest), end[k]
        step = max_records or max(1, hi - lo)
        for a in range(lo, hi, step):
            out.append(QueueSpan(root, k[0], k[1], r.directory, r.file_size, a, min(hi, a + step)))
    return out


def read_span(span: QueueSpan, names: Sequence[str], batch_rows: int, skip_damaged: bool = False
              ) -> Iterator[Any]:
    """The messages at queue offsets [lo, hi) of one queue, in queue order, as Arrow batches of ``names``.

    Every unit's record is checked to be the unit's (magic, TOTALSIZE, PHYSICALOFFSET) before it is decoded; a
    unit that is missing or does not match fails the task naming queue, offset and file."""
    units = segment.read_units(span.directory, span.file_size, span.lo, span.hi)
    where = f"{span.topic}/{span.queue_id} queue offsets [{span.lo}, {span.hi})"
    if len(units) != span.hi - span.lo or (len(units) and (units[:, 1] <= 0).any()):
        raise segment.RecordFormatError(f"{span.directory}: {where}: the consume queue holds only "
                                        f"{int((units[:, 1] > 0).sum()) if len(units) else 0} of its units")
    if not len(units):
        return
    cl = StorePaths(span.root).commitlog
    names_cl = sorted(n for n in os.listdir(cl) if len(n) == 20 and n.isdigit())
    seg_size = os.path.getsize(os.path.join(cl, names_cl[0]))
    bases = units[:, 0] - units[:, 0] % seg_size
    cuts = np.flatnonzero(bases[1:] != bases[:-1]) + 1
    for group in np.split(np.arange(len(units)), cuts):
        base = int(bases[group[0]])
        path = os.path.join(cl, f"{base:020d}")
        if not os.path.exists(path):
            raise StoreError(f"{path}: gone (deleted by retention?) while reading {where}; the messages were "
                             "deleted before this query read them")
        with segment.Segment(path) as seg:
            for i in range(0, len(group), batch_rows):
                g = group[i:i + batch_rows]
                pos = units[g, 0] - base
                if int((pos + units[g, 1]).max()) > seg.size or not segment.records_match_units(seg, pos, units[g, 1]):
                    raise segment.RecordFormatError(f"{path}: {where}: a unit does not point at its record "
                                                    f"(units from commitlog offset {int(units[g[0], 0])})")
                b = segment.decode(seg, pos, names, None, limit=seg.size, skip_damaged=skip_damaged)
                if b is not None and b.num_rows:
                    yield b


def parse_duration_ms(opts: Any, name: str, default: str) -> int:
    """Spark's time strings (``15m``, ``30s``, ``500ms``, ``1h``; a bare number is milliseconds)."""
    text = str(opts.get(name, default)).strip().lower()
    m = re.fullmatch(r"(\d+)\s*(ms|s|m|min|h|d)?", text)
    if not m:
        raise StoreError(f"option {name}={text!r}: expected a duration such as 15m, 30s or 500ms")
    unit = {None: 1, "ms": 1, "s": 1000, "m": 60_000, "min": 60_000, "h": 3_600_000, "d": 86_400_000}[m.group(2)]
    return int(m.group(1)) * unit
