"""Pop-style consumption: invisible time, receipt handles, acks, retries, FIFO groups and dead letters.

State per (consumer group, topic, queue)::

      committed                 next                       max offset
    ----|--------------------------|---------------------------|----
        | every offset in between  | not yet read by the group |
        | is acked or an Entry     |                           |

``committed`` is what RocketMQ calls the consumer offset (written to
``consumerOffset.json``).  An :class:`Entry` is a message the group read but has
not acked: in flight (invisible until ``visible_at``), due again (redelivered
with ``delivery_attempt + 1``), or, in a FIFO group, blocked behind an earlier
unacked message of the same message group.  A message that would be delivered
more often than the group's maximum is parked instead (never delivered again) until
a mover of :mod:`rocketstore.queues.revive` puts it into ``%DLQ%<group>``, exactly once.

The entries, acked offsets and receipt tokens are written to
``config/popState.json`` (with the offsets), so that after a restart in-flight
messages stay invisible until their time and old receipt handles still ack.
Whatever was not written before a crash is delivered again: at least once.

One implementation for the gRPC broker (which runs it on its event loop thread)
and the library's :class:`~rocketstore.queues.simple_consumer.SimpleConsumer`
(which runs it under :class:`~rocketstore.queues.state.SharedPopState`'s file
lock, so that several processes share one group's work).  None of the methods
blocks on I/O except reads of the store's mapped files.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..format.codec import MessageExt, java_hash
from ..errors import CorruptRecordError, TierError
from ..storage.jsonfile import write_bytes_atomic
from ..format.message import GetMessageStatus
from ..storage.consumer_offsets import ConsumerOffsetManager, read_json_lenient
from . import journal

log = logging.getLogger(__name__)

MAX_BLOCKED_PER_QUEUE = 2048
MAX_READ_PER_QUEUE = 256
PARKED = "dlq"  # an entry's 15th field when it is parked for the DLQ (a string: found in the files unparsed)


_str = json.encoder.encode_basestring  # a str as json.dumps(ensure_ascii=False) writes it (C-accelerated)
_TF = {False: "false", True: "true"}


def _opt_str(v: str | None) -> str:
    return "null" if v is None else _str(v)


def now_ms() -> int:
    return int(time.time() * 1000)


class TagFilter:
    """A TAG expression: ``*``/empty matches everything; else ``A || B`` matches exactly those tags."""

    __slots__ = ("tags", "codes", "expression")

    def __init__(self, expression: str | None) -> None:
        self.expression = (expression or "").strip()
        if not self.expression or self.expression == "*":
            self.tags: frozenset[str] | None = None
            self.codes: set[int] | None = None
        else:
            self.tags = frozenset(t.strip() for t in self.expression.split("||") if t.strip())
            self.codes = {java_hash(t) for t in self.tags}

    def match(self, tag: str | None) -> bool:
        return self.tags is None or (tag is not None and tag in self.tags)


@dataclass(slots=True)
class Entry:
    offset: int
    phy: int
    size: int
    tag: str | None
    msg_group: str | None
    attempts: int = 0
    visible_at: int = 0
    token: str = ""
    blocked: bool = False
    auto_renew: bool = False
    client: str = ""
    first_pop: int = 0
    suspend: bool = False
    invisible_ms: int = 0
    # Due for the DLQ, parked until a dead-letter mover puts it there (never delivered again); ``dlq_from``:
    # the DLQ queue's end before the mover's put (-1: not attempted), where it looks for its copy after a
    # crash between the put and the state write (rocketstore.queues.revive: the library's and the broker's).
    parked: bool = False
    dlq_from: int = -1

    def to_text(self) -> str:
        """The entry as compact JSON: ``[offset, phy, size, attempts, visible_at, token, tag, msg_group,
        blocked, auto_renew, client, first_pop, suspend, invisible_ms]`` (then ``"dlq", dlq_from`` when parked).
        Written out here, not by ``json.dumps`` of a list: every lock section encodes the entries of each
        queue it changed, and this is several times faster (same text; the tests compare the two)."""
        t = (f"[{self.offset},{self.phy},{self.size},{self.attempts},{self.visible_at},{_str(self.token)},"
             f"{_opt_str(self.tag)},{_opt_str(self.msg_group)},{_TF[self.blocked]},{_TF[self.auto_renew]},"
             f"{_str(self.client)},{self.first_pop},{_TF[self.suspend]},{self.invisible_ms}")
        if self.parked:
            return f'{t},"{PARKED}",{self.dlq_from}]'
        return t + "]"

    @classmethod
    def from_json(cls, a: list[Any]) -> "Entry":
        # positional: the journal's records are read by every receiver in every lock section
        e = cls(int(a[0]), int(a[1]), int(a[2]), a[6], a[7], int(a[3]), int(a[4]), str(a[5]), bool(a[8]),
                bool(a[9]), str(a[10]), int(a[11]), bool(a[12]), int(a[13]))
        if len(a) > 15 and a[14]:
            e.parked, e.dlq_from = True, int(a[15])
        return e


class QueueState:
    __slots__ = ("group", "topic", "queue_id", "committed", "next", "entries", "acked", "fifo", "fifo_groups",
                 "next_due", "blocked", "text")

    def __init__(self, group: str, topic: str, queue_id: int, committed: int, fifo: bool) -> None:
        self.group, self.topic, self.queue_id = group, topic, queue_id
        self.committed = committed
        self.next = committed
        self.entries: dict[int, Entry] = {}
        self.acked: set[int] = set()
        self.fifo = fifo
        self.fifo_groups: dict[str, list[int]] = {}
        self.next_due = 1 << 62
        self.blocked = 0
        self.text: str | None = None  # this queue's popState.json record as of the last snapshot

    def recompute_due(self) -> None:
        due = 1 << 62
        for e in self.entries.values():
            if not e.blocked and not e.parked and e.visible_at < due:
                due = e.visible_at
        self.next_due = due

    def advance(self) -> bool:
        moved = False
        while self.committed in self.acked:
            self.acked.discard(self.committed)
            self.committed += 1
            moved = True
        if self.committed < self.next and self.committed not in self.entries and not self.acked \
                and not self.entries:
            self.committed = self.next  # nothing outstanding
            moved = True
        return moved

    def to_text(self) -> str:
        """This queue's record in popState.json and its journal, as compact JSON; its key comes first
        (``{"group":..,"topic":..,"queueId":..`` then ``,"committed":``: see journal._latest_lines)."""
        acked = ",".join([f"[{a},{b}]" for a, b in _ranges(self.acked)])
        entries = ",".join([e.to_text() for _, e in sorted(self.entries.items())])
        return (f'{{"group":{_str(self.group)},"topic":{_str(self.topic)},"queueId":{self.queue_id},'
                f'"committed":{self.committed},"next":{self.next},"fifo":{_TF[self.fifo]},"acked":[{acked}],'
                f'"entries":[{entries}]}}')


def _ranges(offsets: Iterable[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for o in sorted(offsets):
        if out and out[-1][1] == o:
            out[-1][1] = o + 1
        else:
            out.append([o, o + 1])
    return out


def state_document(queue_texts: list[str], base_id: str | None = None) -> bytes:
    """popState.json's bytes; a new ``id`` each write, so a journal continuing an older file is seen stale."""
    return ('{"version":1,"id":"%s","queues":[' % (base_id or os.urandom(8).hex())
            + ",".join(queue_texts) + "]}").encode("utf-8")


@dataclass
class Delivery:
    queue_id: int
    entry: Entry
    message: MessageExt
    handle: str


@dataclass
class DeadLetter:
    group: str
    topic: str
    queue_id: int
    entry: Entry


class PopService:
    def __init__(self, store: Any, offsets: ConsumerOffsetManager, config_dir: str, *, consume_from: str = "FIRST",
                 auto_renew_ms: int = 60000, renew_ahead_ms: int = 10000, renew_max_ms: int = 3 * 3600 * 1000,
                 max_span: int = 100000, on_visible: Callable[[str, str], Any] | None = None,
                 skip_groups: Iterable[str] = (), load: bool = True,
                 clock: Callable[[], int] = now_ms) -> None:
        self.store = store
        self.now_ms = clock  # epoch ms; the library passes the store's clock (tests drive it)
        self.offsets = offsets
        self.path = os.path.join(config_dir, "popState.json")
        self.consume_from = consume_from
        self.auto_renew_ms = auto_renew_ms
        self.renew_ahead_ms = renew_ahead_ms
        self.renew_max_ms = renew_max_ms
        self.max_span = max_span
        # Called with (topic, group) when something became receivable without a new message (long polls wake).
        self.on_visible = on_visible or (lambda topic, group: None)
        self.queues: dict[tuple[str, str, int], QueueState] = {}
        self.dirty = False
        self.changed_keys: set[tuple[str, str, int]] = set()  # for the journal (queues.state)
        # Queues whose record reached past the end of the queue on a writable store (a power cut or a cut of the
        # log took records whose acks survived): the clamped state must be written before a put reuses them.
        self.clamped: set[tuple[str, str, int]] = set()
        self._damaged_seen: set[tuple[str, str, int, int | None]] = set()  # logged once at error level
        self._run = os.urandom(3).hex()
        self._seq = itertools.count(1)
        self._rotation = itertools.count()
        self.skip_groups = frozenset(skip_groups)  # groups in consumerOffset.json that do not pop (transactions)
        if load:
            self._load()

    # ------------------------------------------------------------ state
    def load(self, data: Any, records: list[dict[str, Any]]) -> None:
        """Replace the in-memory state by popState.json's parsed ``data`` and its journal ``records``."""
        self._load(data, records)

    def apply(self, records: list[dict[str, Any]]) -> None:
        """Queue records another process appended to the journal: each replaces its queue's state.

        Taken as written (not clamped to this process's view of the store, which may be a moment older than
        the writer's of the record was: clamping would forget messages in flight and hand them out again)."""
        for q in records:
            qs = self._from_record(q)
            if qs is not None:
                self._derive(qs)
                self.queues[(qs.group, qs.topic, qs.queue_id)] = qs

    def _from_record(self, q: Any) -> QueueState | None:
        try:
            qs = QueueState(str(q["group"]), str(q["topic"]), int(q["queueId"]), int(q["committed"]),
                            bool(q.get("fifo")))
            qs.next = max(qs.committed, int(q.get("next", qs.committed)))
            for a, b in q.get("acked") or []:
                qs.acked.update(range(int(a), int(b)))
            for raw in q.get("entries") or []:
                e = Entry.from_json(raw)
                qs.entries[e.offset] = e
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            log.warning("%s: ignoring a bad queue record (%s)", self.path, e)
            return None
        return qs

    def _load(self, data: Any = None, records: list[dict[str, Any]] | None = None) -> None:
        """(Re)build the queues from popState.json (or ``data``, its parsed text), its journal (or ``records``)
        and consumerOffset.json."""
        self.queues = {}
        self.clamped = set()
        if data is None:
            data = read_json_lenient(self.path) or {}
        if not isinstance(data, dict):
            data = {}
        if records is None:
            records = journal.read(self.path, str(data.get("id", "")))
        for q in journal.merge(list(data.get("queues") or []) + records):
            qs = self._from_record(q)
            if qs is None:
                continue
            if self._reconcile(qs):
                self.clamped.add((qs.group, qs.topic, qs.queue_id))
            self.queues[(qs.group, qs.topic, qs.queue_id)] = qs
        # Groups known only from consumerOffset.json (e.g. written by RocketMQ) start at their offset.
        for key, queues in self.offsets.table.items():
            topic, _, group = key.rpartition("@")
            if group in self.skip_groups:
                continue  # the transaction service's own progress
            for qid, off in queues.items():
                if (group, topic, qid) not in self.queues:
                    qs = QueueState(group, topic, qid, off, False)
                    if self._reconcile(qs):
                        self.clamped.add((group, topic, qid))
                    self.queues[(group, topic, qid)] = qs
        now = self.now_ms()
        for qs in self.queues.values():
            for e in qs.entries.values():
                if e.auto_renew:  # its client is gone with the old process; give it back soon
                    e.auto_renew = False
                    e.visible_at = min(e.visible_at, now + 1000)
            qs.recompute_due()
        if self.queues:
            log.debug("consumer state: %d queues of %d groups", len(self.queues),
                     len({k[0] for k in self.queues}))

    def _reconcile(self, qs: QueueState) -> bool:
        """Clamp to what the store holds and to the committed offset of consumerOffset.json; True when the
        record reached past the end of the queue of a writable store (only a lost tail of the log does that)."""
        lo = self.store.min_offset_in_queue(qs.topic, qs.queue_id)
        hi = self.store.max_offset_in_queue(qs.topic, qs.queue_id)
        read_only = getattr(self.store, "read_only", False)
        committed = self.offsets.get(qs.topic, qs.group, qs.queue_id)
        # consumerOffset.json past the end counts too: left there, every later load (a read-only receiver's
        # included) would raise the committed offset over the next puts at those offsets again (queue model
        # seed 3188: a receiver's skip of a message the cut took was in consumerOffset.json, not the journal).
        past_end = (hi < qs.next or (committed is not None and committed > hi)) and not read_only
        if hi < qs.next and read_only:
            # A read-only view extends a topic's queues only when a receiver of that topic looks (tail_view):
            # a record another process wrote is ahead of this view, not wrong.  Clamped, its in-flight entries
            # and acks would be dropped, and the next write of this state (a compaction writes every queue)
            # would lose them: delivered again as new while held elsewhere, acked ones too.
            hi = qs.next
        floor = max(lo, committed if committed is not None else lo)
        if qs.committed < floor:
            qs.committed = floor
        if qs.committed > hi:
            qs.committed = hi
        qs.next = min(max(qs.next, qs.committed), hi)
        qs.entries = {o: e for o, e in qs.entries.items() if qs.committed <= o < qs.next}
        qs.acked = {o for o in qs.acked if qs.committed <= o < qs.next and o not in qs.entries}
        for o in range(qs.committed, qs.next):  # an offset the state does not know about: read it again
            if o not in qs.entries and o not in qs.acked:
                qs.next = o
                break
        qs.entries = {o: e for o, e in qs.entries.items() if o < qs.next}
        qs.acked = {o for o in qs.acked if o < qs.next}
        self._derive(qs)
        return past_end

    def _derive(self, qs: QueueState) -> None:
        """The FIFO groups, blocked count and next due time of a queue built from a record; its committed
        offset moved over what is acked (and handed to consumerOffset.json)."""
        qs.fifo_groups = {}
        qs.blocked = 0
        for o in sorted(qs.entries):
            e = qs.entries[o]
            if qs.fifo and e.msg_group:
                lst = qs.fifo_groups.setdefault(e.msg_group, [])
                e.blocked = bool(lst)
                lst.append(o)
            else:
                e.blocked = False
            qs.blocked += e.blocked
        qs.advance()
        qs.recompute_due()
        self.offsets.commit(qs.topic, qs.group, qs.queue_id, qs.committed)

    def _changed(self, qs: QueueState) -> None:
        qs.text = None
        self.dirty = True
        self.changed_keys.add((qs.group, qs.topic, qs.queue_id))

    def changed_records(self) -> list[str]:
        """JSON texts of the queues changed since the last call (the journal's next records)."""
        texts = []
        for key in sorted(self.changed_keys):
            qs = self.queues.get(key)
            if qs is not None:
                if qs.text is None:
                    qs.text = qs.to_text()
                texts.append(qs.text)
        self.changed_keys.clear()
        return texts

    def snapshot(self) -> list[str] | None:
        """The file's queues as JSON texts if something changed since the last snapshot, else None.

        Only queues changed since their last snapshot are encoded again; the others reuse their text.
        """
        if not self.dirty:
            return None
        self.dirty = False
        texts = []
        for _, qs in sorted(self.queues.items()):
            if qs.text is None:
                qs.text = qs.to_text()
            texts.append(qs.text)
        return texts

    def write(self, snapshot: list[str]) -> None:
        write_bytes_atomic(self.path, state_document(snapshot))
        self.changed_keys.clear()

    def _queue(self, group: str, topic: str, queue_id: int, fifo: bool) -> QueueState:
        key = (group, topic, queue_id)
        qs = self.queues.get(key)
        if qs is None:
            if self.consume_from == "LAST":
                start = self.store.max_offset_in_queue(topic, queue_id)
            else:
                start = self.store.min_offset_in_queue(topic, queue_id)
            qs = self.queues[key] = QueueState(group, topic, queue_id, start, fifo)
            self.offsets.commit(topic, group, queue_id, start)
            self._changed(qs)
        elif qs.fifo != fifo and not qs.entries:
            qs.fifo = fifo
            self._changed(qs)
        return qs

    def _token(self) -> str:
        return f"{self._run}{next(self._seq):x}"

    @staticmethod
    def handle_of(queue_id: int, e: Entry) -> str:
        return f"{queue_id}_{e.offset}_{e.token}"

    @staticmethod
    def parse_handle(handle: str) -> tuple[int, int, str] | None:
        parts = (handle or "").split("_")
        if len(parts) != 3 or not parts[2] or len(handle) > 200:
            return None
        try:
            q, off = int(parts[0]), int(parts[1])
        except ValueError:
            return None
        if q < 0 or off < 0:
            return None
        return q, off, parts[2]

    def next_due(self, group: str, topic: str, queue_ids: Iterable[int]) -> int:
        """When the first in-flight message of these queues becomes visible again (epoch ms; far away if none)."""
        due = 1 << 62
        for qid in queue_ids:
            qs = self.queues.get((group, topic, qid))
            if qs is not None and qs.next_due < due:
                due = qs.next_due
        return due

    # ------------------------------------------------------------ receive
    def receive(self, group: str, topic: str, queue_ids: list[int], batch: int, invisible_ms: int,
                flt: TagFilter, *, fifo: bool, max_attempts: int, client: str,
                auto_renew: bool) -> tuple[list[Delivery], list[DeadLetter]]:
        """Pop up to ``batch`` messages (redeliveries first, then new ones) and the messages this call parked
        for the DLQ (due there: a mover of :mod:`rocketstore.queues.revive` puts them).

        A queue whose next message is damaged stops there (it is neither delivered nor skipped); when no
        queue gave anything, the first such :class:`CorruptRecordError` is raised.
        """
        now = self.now_ms()
        out: list[Delivery] = []
        dead: list[DeadLetter] = []
        if not queue_ids:
            return out, dead
        start = next(self._rotation) % len(queue_ids)
        damaged: CorruptRecordError | None = None
        for qid in queue_ids[start:] + queue_ids[:start]:
            if len(out) >= batch:
                break
            qs = self._queue(group, topic, qid, fifo)
            try:
                if now >= qs.next_due:
                    self._redeliver(qs, now, batch, invisible_ms, flt, max_attempts, client, auto_renew, out, dead)
                if len(out) < batch:
                    self._read_new(qs, now, batch, invisible_ms, flt, client, auto_renew, out)
            except CorruptRecordError as e:  # this queue stops at the damaged message; the others go on
                seen = (group, topic, qid, e.offset)
                log.log(logging.DEBUG if seen in self._damaged_seen else logging.ERROR, "%s@%s queue %d: %s",
                        topic, group, qid, e)
                self._damaged_seen.add(seen)
                damaged = damaged or e
        if damaged is not None and not out and not dead:
            raise damaged
        return out, dead

    def _deliver(self, qs: QueueState, e: Entry, now: int, invisible_ms: int, client: str, auto_renew: bool) -> str:
        if e.suspend:
            e.suspend = False
        else:
            e.attempts += 1
        e.visible_at = now + invisible_ms
        e.invisible_ms = invisible_ms
        e.token = self._token()
        e.client = client
        e.auto_renew = auto_renew
        if not e.first_pop:
            e.first_pop = now
        if e.visible_at < qs.next_due:
            qs.next_due = e.visible_at
        self._changed(qs)
        return self.handle_of(qs.queue_id, e)

    def _redeliver(self, qs: QueueState, now: int, batch: int, invisible_ms: int, flt: TagFilter,
                   max_attempts: int, client: str, auto_renew: bool, out: list[Delivery],
                   dead: list[DeadLetter]) -> None:
        for off in sorted(o for o, e in qs.entries.items()
                          if e.visible_at <= now and not e.blocked and not e.parked):
            if len(out) >= batch:
                break
            e = qs.entries[off]
            if not flt.match(e.tag):
                continue
            if e.attempts >= max_attempts and not e.suspend:
                e.parked = True  # a mover puts it into the DLQ (rocketstore.queues.revive)
                self._changed(qs)
                dead.append(DeadLetter(qs.group, qs.topic, qs.queue_id, e))
                continue
            if e.phy >= self.store.max_phy_offset():
                continue  # a read-only view a moment older than the receiver's that read it: not here yet
            try:
                msg = self._read(e)
            except (TierError, OSError) as err:  # unreadable for now: not delivered this time, never dropped
                log.warning("%s@%s queue %d offset %d: message cannot be read now (%s); kept for a later receive",
                            qs.topic, qs.group, qs.queue_id, off, err)
                continue
            if msg is None:
                log.warning("%s@%s queue %d offset %d: message no longer in the store; dropped",
                            qs.topic, qs.group, qs.queue_id, off)
                self._remove(qs, off, now)
                continue
            handle = self._deliver(qs, e, now, invisible_ms, client, auto_renew)
            out.append(Delivery(qs.queue_id, e, msg, handle))
        qs.recompute_due()

    def _read(self, e: Entry) -> MessageExt | None:
        try:
            return self.store.look(e.phy)
        except CorruptRecordError:
            if self.store.min_readable_offset() <= e.phy < self.store.max_phy_offset():
                raise  # damaged in place: never dropped (acked) on the quiet
            return None  # deleted by retention, or a bad offset from an old state file
        except (TierError, OSError):
            raise  # the bucket or the disk, for now: dropping would ack the message
        except Exception:
            return None

    def _read_new(self, qs: QueueState, now: int, batch: int, invisible_ms: int, flt: TagFilter, client: str,
                  auto_renew: bool, out: list[Delivery]) -> None:
        store = self.store
        hi = store.max_offset_in_queue(qs.topic, qs.queue_id)
        read = 0
        while len(out) < batch and qs.next < hi and read < MAX_READ_PER_QUEUE:
            if qs.next - qs.committed >= self.max_span or qs.blocked >= MAX_BLOCKED_PER_QUEUE:
                break
            want = min(32, max(1, batch - len(out)))
            res = store.get(qs.topic, qs.queue_id, qs.next, want, tag_filter=flt.codes)
            st = res.status
            if st is GetMessageStatus.OFFSET_TOO_SMALL:
                self._jump(qs, res.min_offset, now)
                continue
            if st in (GetMessageStatus.OFFSET_OVERFLOW_ONE, GetMessageStatus.OFFSET_OVERFLOW_BADLY,
                      GetMessageStatus.NO_MESSAGE_IN_QUEUE, GetMessageStatus.NO_MATCHED_LOGIC_QUEUE):
                break
            end = max(res.next_begin_offset, qs.next)
            if end == qs.next:
                break
            got = {m.queue_offset: m for m in res.messages}
            for off in range(qs.next, end):
                m = got.get(off)
                tag = m.tags if m is not None else None
                if m is None or not flt.match(tag):
                    qs.acked.add(off)  # filtered out or unreadable: consumed for this group
                    continue
                read += 1
                group = m.properties.get("__SHARDINGKEY") if qs.fifo else None
                e = Entry(off, m.commit_log_offset, m.size, tag, group)
                qs.entries[off] = e
                if group is not None:
                    lst = qs.fifo_groups.setdefault(group, [])
                    lst.append(off)
                    if len(lst) > 1:
                        e.blocked = True
                        qs.blocked += 1
                        continue
                handle = self._deliver(qs, e, now, invisible_ms, client, auto_renew)
                out.append(Delivery(qs.queue_id, e, m, handle))
            qs.next = end
            self._changed(qs)
            if qs.advance():
                self.offsets.commit(qs.topic, qs.group, qs.queue_id, qs.committed)

    def _jump(self, qs: QueueState, lo: int, now: int) -> None:
        """Retention removed messages below ``lo``: forget them."""
        log.warning("%s@%s queue %d: messages below offset %d were deleted; skipping them",
                    qs.topic, qs.group, qs.queue_id, lo)
        for off in [o for o in qs.entries if o < lo]:
            self._remove(qs, off, now)
        qs.acked = {o for o in qs.acked if o >= lo}
        qs.committed = max(qs.committed, lo)
        qs.next = max(qs.next, lo)
        qs.advance()
        self.offsets.commit(qs.topic, qs.group, qs.queue_id, qs.committed)
        self._changed(qs)

    def _remove(self, qs: QueueState, off: int, now: int) -> None:
        e = qs.entries.pop(off, None)
        if e is None:
            return
        was_full = qs.next - qs.committed >= self.max_span or qs.blocked >= MAX_BLOCKED_PER_QUEUE
        qs.acked.add(off)
        if e.blocked:
            qs.blocked -= 1
        if e.msg_group is not None:
            lst = qs.fifo_groups.get(e.msg_group)
            if lst:
                try:
                    lst.remove(off)
                except ValueError:
                    pass
                if lst:
                    head = qs.entries.get(lst[0])
                    if head is not None and head.blocked:
                        head.blocked = False
                        qs.blocked -= 1
                        head.visible_at = now
                        qs.next_due = min(qs.next_due, now)
                        was_full = True
                else:
                    del qs.fifo_groups[e.msg_group]
        if qs.advance():
            self.offsets.commit(qs.topic, qs.group, qs.queue_id, qs.committed)
        self._changed(qs)
        if was_full:
            self.on_visible(qs.topic, qs.group)

    # ------------------------------------------------------------ receipts
    def _lookup(self, group: str, topic: str, handle: str) -> tuple[QueueState, Entry] | None:
        parsed = self.parse_handle(handle)
        if parsed is None:
            return None
        qid, off, token = parsed
        qs = self.queues.get((group, topic, qid))
        if qs is None:
            return None
        e = qs.entries.get(off)
        if e is None or e.token != token or e.blocked or e.parked:
            return None
        return qs, e

    def entry(self, group: str, topic: str, handle: str) -> Entry | None:
        """The in-flight message ``handle`` names (None: unknown, expired or superseded)."""
        found = self._lookup(group, topic, handle)
        return None if found is None else found[1]

    def ack(self, group: str, topic: str, handle: str) -> bool:
        found = self._lookup(group, topic, handle)
        if found is None:
            return False
        qs, e = found
        self._remove(qs, e.offset, self.now_ms())
        return True

    def change_invisible(self, group: str, topic: str, handle: str, invisible_ms: int,
                         suspend: bool = False) -> str | None:
        """Hide the message for ``invisible_ms`` from now; the new handle (the old one stops working)."""
        found = self._lookup(group, topic, handle)
        if found is None:
            return None
        qs, e = found
        now = self.now_ms()
        e.visible_at = now + invisible_ms
        e.invisible_ms = invisible_ms
        e.auto_renew = False  # a NACK: let it come back when the delay is over
        e.suspend = suspend
        e.token = self._token()
        qs.recompute_due()
        self._changed(qs)
        self.on_visible(topic, group)  # a waiting receive must look again at the new due time
        return self.handle_of(qs.queue_id, e)

    def take_for_dlq(self, group: str, topic: str, handle: str) -> DeadLetter | None:
        """Park the in-flight message ``handle`` names for the DLQ (a client's forward); None if unknown."""
        found = self._lookup(group, topic, handle)
        if found is None:
            return None
        qs, e = found
        e.parked = True
        qs.recompute_due()
        self._changed(qs)
        return DeadLetter(group, topic, qs.queue_id, e)

    def holds(self, d: DeadLetter) -> bool:
        """Whether ``d``'s message is still in its group's state (a parked one: not yet in the DLQ)."""
        qs = self.queues.get((d.group, d.topic, d.queue_id))
        return qs is not None and qs.entries.get(d.entry.offset) is d.entry

    def parked(self) -> list[DeadLetter]:
        """Every message parked for the DLQ, in queue order."""
        return [DeadLetter(qs.group, qs.topic, qs.queue_id, e) for _, qs in sorted(self.queues.items())
                for _, e in sorted(qs.entries.items()) if e.parked]

    def intend_dlq(self, d: DeadLetter, dlq_from: int) -> None:
        """Record, before the put, where the DLQ queue ended: a crash after the put finds the copy from there."""
        qs = self.queues[(d.group, d.topic, d.queue_id)]
        d.entry.dlq_from = dlq_from
        self._changed(qs)

    def settle_dlq(self, d: DeadLetter) -> None:
        """The parked message is in the DLQ: done for the group."""
        qs = self.queues.get((d.group, d.topic, d.queue_id))
        if qs is not None and qs.entries.get(d.entry.offset) is d.entry:
            self._remove(qs, d.entry.offset, self.now_ms())

    def release(self, deliveries: list[Delivery], group: str, topic: str) -> None:
        """Deliveries that never reached the client: visible again now, the attempt not counted."""
        now = self.now_ms()
        for d in deliveries:
            qs = self.queues.get((group, topic, d.queue_id))
            if qs is None or qs.entries.get(d.entry.offset) is not d.entry:
                continue
            d.entry.visible_at = now
            d.entry.suspend = True
            d.entry.token = self._token()
            qs.next_due = min(qs.next_due, now)
            self._changed(qs)
        if deliveries:
            self.on_visible(topic, group)

    def release_client(self, client: str, delay_ms: int = 1000) -> int:
        """A client left: its auto-renewed messages become visible after ``delay_ms``."""
        now = self.now_ms()
        n = 0
        for qs in self.queues.values():
            touched = False
            for e in qs.entries.values():
                if e.client == client and e.auto_renew:
                    e.auto_renew = False
                    e.visible_at = min(e.visible_at, now + delay_ms)
                    touched = True
                    n += 1
            if touched:
                qs.recompute_due()
                self._changed(qs)
                self.on_visible(qs.topic, qs.group)
        return n

    def renew(self, alive: Callable[[str], bool]) -> int:
        """Extend auto-changed receipts of live clients that are about to expire."""
        now = self.now_ms()
        n = 0
        for qs in self.queues.values():
            changed = False
            for e in qs.entries.values():
                if not e.auto_renew or e.blocked or e.visible_at - now > self.renew_ahead_ms:
                    continue
                if alive(e.client) and now - e.first_pop < self.renew_max_ms:
                    e.visible_at = now + self.auto_renew_ms
                    n += 1
                    changed = True
                else:
                    e.auto_renew = False
                    changed = True
            if changed:
                qs.recompute_due()
                self._changed(qs)
        return n
