"""Delayed and scheduled messages: kept in the system topic ``rmq_sys_wheel_timer`` until due, then put into
their topic by the store's timer service.

Layout, as RocketMQ 5's timer (and the broker before this moved here) writes it: a message with a delivery
time is stored first in ``rmq_sys_wheel_timer`` queue 0 with the ``REAL_TOPIC``/``REAL_QID`` and
``TIMER_DELIVER_MS`` properties, so that no consumer of its topic sees it.  When it is due, the service puts a
copy with the same body and properties (less ``REAL_TOPIC``/``REAL_QID``, and ``DELAY``, as RocketMQ's
schedule service clears it) into the real topic and queue.  A delay level (``Message.delay_level`` or the
``DELAY`` property; RocketMQ's 18 levels 1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h) becomes a
delivery time at put; it is kept in the timer topic too (RocketMQ's ``SCHEDULE_TOPIC_XXXX`` is not used: one
timer, one state file).

Progress: ``config/timerState.json``.  ``offset``: every timer message below it was delivered; ``delivered``:
the delivered ones at or above it; ``delivering``: the ones whose copy is being put right now, each with its
real queue and that queue's end before the put (written durably before the puts, cleared after).  At start the
timer topic is read from ``offset`` to rebuild the schedule, so delays survive a restart and SIGKILL.  A crash
between a copy's put and the state write leaves the message in ``delivering``: the next start looks for the copy
(same ``UNIQ_KEY`` and born time) in its real queue from the recorded end on, and counts it delivered if it is
there.  Under asynchronous flush a round fsyncs the commitlog after its puts and before the state says
"delivered", so a power cut cannot keep that state and lose a copy (if the flush fails, the state is no longer
written and the timer stops: the durable state still names the round's messages as ``delivering``).  So every
due message is put into its topic exactly once, as far as the store can tell.
A store whose timer records RocketMQ's own timer handled (its ``timercheck``/``timerwheel`` files, no
``timerState.json``) has them left alone: they were delivered by RocketMQ.

Precision: a message is never delivered before its time; the service wakes at the earliest due time, so it is
delivered within tens of milliseconds after it on an idle machine (plus the dispatcher's round for a consumer
to see it), later while the commitlog refuses writes.  Only a writable store with its services (the process
holding the store lock) runs the timer; a store opened otherwise keeps delay messages until such an open.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
import uuid
from typing import Any, Callable, Protocol

from ..format import codec
from ..format.codec import MessageExt
from ..format.message import GetMessageResult, GetMessageStatus, Message, PutMessageResult
from ..errors import TierError
from ..services.base import ServiceThread
from ..storage.jsonfile import read_json, write_json_atomic

log = logging.getLogger(__name__)

TIMER_TOPIC = "rmq_sys_wheel_timer"
P_REAL_TOPIC = "REAL_TOPIC"
P_REAL_QID = "REAL_QID"
P_TIMER_DELIVER = "TIMER_DELIVER_MS"
P_DELAY = "DELAY"
P_UNIQ = "UNIQ_KEY"
STATE_FILE = "timerState.json"
DELAY_LEVELS_MS = (1_000, 5_000, 10_000, 30_000, 60_000, 120_000, 180_000, 240_000, 300_000, 360_000, 420_000,
                   480_000, 540_000, 600_000, 1_200_000, 1_800_000, 3_600_000, 7_200_000)
MAX_ROUND = 256  # copies put per round: the state is written at least that often


class TimerStore(Protocol):
    """What the timer needs of the store (the facade passes itself)."""

    def get(self, topic: str, queue_id: int, offset: int, max_msgs: int = 32, tag_filter: Any = None,
            max_total_bytes: int = ..., read_body: bool = True) -> GetMessageResult: ...

    def look(self, commit_log_offset: int, *, read_body: bool = True) -> MessageExt: ...

    def min_offset_in_queue(self, topic: str, queue_id: int) -> int: ...

    def max_offset_in_queue(self, topic: str, queue_id: int) -> int: ...

    def wait_dispatched(self, timeout: float = 30.0) -> bool: ...


def now_ms() -> int:
    return int(time.time() * 1000)


def delay_level_ms(level: int | str) -> int:
    """The delay of RocketMQ level ``level`` (1..18) in ms; ValueError naming the level otherwise."""
    try:
        n = int(level)
    except (TypeError, ValueError):
        raise ValueError(f"delay level {level!r} is not a number (1..{len(DELAY_LEVELS_MS)})") from None
    if not 1 <= n <= len(DELAY_LEVELS_MS):
        raise ValueError(f"delay level {n} is out of range 1..{len(DELAY_LEVELS_MS)} "
                         "(1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h)")
    return DELAY_LEVELS_MS[n - 1]


def deliver_time(msg: Message, now: int) -> int | None:
    """When ``msg`` is due (epoch ms), from ``deliver_at``, ``delay_level`` or a ``DELAY``/``TIMER_DELIVER_MS``
    property; None when it asks for no delay.  ValueError says what is wrong with a bad value."""
    at = msg.deliver_at
    if at is not None:
        if isinstance(at, bool) or not isinstance(at, int) or at < 0:
            raise ValueError(f"deliver_at {at!r} is not an epoch time in ms")
        return at
    if msg.delay_level:
        return now + delay_level_ms(msg.delay_level)
    props = msg.properties if msg.properties_string is None else codec.parse_properties(msg.properties_string)
    if P_DELAY in props and props[P_DELAY] not in ("", "0"):
        return now + delay_level_ms(props[P_DELAY])
    if P_TIMER_DELIVER in props:
        try:
            return int(props[P_TIMER_DELIVER])
        except ValueError:
            raise ValueError(f"{P_TIMER_DELIVER}={props[P_TIMER_DELIVER]!r} is not an epoch time in ms") from None
    return None


def wrap(msg: Message, deliver_at: int) -> Message:
    """The timer-topic record for a message bound for ``msg.topic``/``msg.queue_id`` at ``deliver_at``.  A message
    without a UNIQ_KEY gets one (RocketMQ's producers always set it): it is how a restart finds a copy put just
    before a crash."""
    props = dict(msg.properties) if msg.properties_string is None else codec.parse_properties(msg.properties_string)
    if msg.tags is not None:
        props["TAGS"] = msg.tags
    if msg.keys is not None:
        props["KEYS"] = msg.keys if isinstance(msg.keys, str) else " ".join(msg.keys)
    if not props.get(P_UNIQ):
        props[P_UNIQ] = uuid.uuid4().hex.upper()
    props[P_REAL_TOPIC] = msg.topic
    props[P_REAL_QID] = str(msg.queue_id)
    props[P_TIMER_DELIVER] = str(deliver_at)
    return Message(topic=TIMER_TOPIC, body=msg.body, queue_id=0, properties=props, flag=msg.flag,
                   born_timestamp=msg.born_timestamp, born_host=msg.born_host, store_host=msg.store_host)


def restore(m: MessageExt, store_host: tuple[bytes, int], *, sys_flag: int | None = None,
            drop: tuple[str, ...] = (P_REAL_TOPIC, P_REAL_QID)) -> Message:
    """The message a system-topic record stands for, to be put into its real topic and queue."""
    props = dict(m.properties)
    topic = props.get(P_REAL_TOPIC, m.topic)
    qid = int(props.get(P_REAL_QID, m.queue_id))
    for k in drop:
        props.pop(k, None)
    return Message(topic=topic, body=m.body or b"", queue_id=qid, properties=props, flag=m.flag,
                   sys_flag=(m.sys_flag & ~codec.TRANSACTION_MASK) if sys_flag is None else sys_flag,
                   born_timestamp=m.born_timestamp, born_host=(m.born_addr, m.born_port), store_host=store_host,
                   reconsume_times=m.reconsume_times)


class TimerService(ServiceThread):
    """Delivers the timer topic's messages when due.  ``put`` is the store's put that does not route delays
    (the timer's own records and copies must not come back here)."""

    name = "TimerService"

    def __init__(self, store: TimerStore, config_dir: str, put: Callable[[Message], PutMessageResult],
                 store_host: tuple[bytes, int] = (b"\x7f\x00\x00\x01", 10911),
                 clock: Callable[[], float] = time.time, sync: Callable[[], bool] = lambda: True) -> None:
        super().__init__(interval=1.0)
        # Makes the copies put so far durable (False: it could not); under asynchronous flush a copy can sit in
        # the page cache for seconds, and the state saying "delivered" must not outlive it in a power cut.
        self.sync = sync
        self.frozen: str | None = None  # why the state is no longer written (the durable one keeps the doubt)
        self.clock = clock  # seconds: the store's clock (tests drive it); due times are compared with it
        self.store = store
        self.path = os.path.join(config_dir, STATE_FILE)
        self.put = put
        self.store_host = store_host
        self.heap: list[tuple[int, int, int]] = []  # (deliver at ms, timer queue offset, commitlog offset)
        self.pending: set[int] = set()
        self.delivered: set[int] = set()
        self.watermark = 0
        self.seen_next = 0
        self.put_floors: list[int] = []
        self.listeners: list[Callable[[set[str]], None]] = []
        self.lock = threading.RLock()  # the schedule and the state; never held across a put of a copy
        self._round = threading.Lock()  # one delivery round at a time
        self.retry_at = 0  # after a refused put, the next round waits until then (ms)
        self._load()

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    # ------------------------------------------------------------ loading
    def _load(self) -> None:
        data = read_json(self.path) or {}
        delivering: dict[int, tuple[str, int, int]] = {}
        try:
            self.watermark = int(data.get("offset", 0))
            self.delivered = {int(o) for o in data.get("delivered") or []}
            for k, v in (data.get("delivering") or {}).items():
                delivering[int(k)] = (str(v[0]), int(v[1]), int(v[2]))
        except (TypeError, ValueError, AttributeError, IndexError):
            log.warning("%s: malformed; rebuilding the schedule from the start of the timer topic", self.path)
            self.watermark, self.delivered, delivering = 0, set(), {}
        lo = self.store.min_offset_in_queue(TIMER_TOPIC, 0)
        hi = self.store.max_offset_in_queue(TIMER_TOPIC, 0)
        if not data and hi > 0 and self._rocketmq_timer_ran():
            # RocketMQ's own timer (timercheck/timerwheel) delivered these: putting them again would duplicate
            log.warning("%s: %d timer records were written under RocketMQ's own timer (its timercheck/timerwheel "
                        "files are here); left to it, not delivered again", self.path, hi)
            self.watermark = self.seen_next = hi
            self._write_state()
            return
        off = max(self.watermark, lo)
        while off < hi:
            res = self.store.get(TIMER_TOPIC, 0, off, 32, read_body=False)
            if res.status is GetMessageStatus.OFFSET_TOO_SMALL:
                off = res.min_offset
                continue
            if not res.messages and res.next_begin_offset <= off:
                break
            for m in res.messages:
                if m.queue_offset in self.delivered:
                    continue
                if m.queue_offset in delivering and self._copy_stored(m, *delivering[m.queue_offset]):
                    log.info("delay message %s was put into %s before the last exit; not put again",
                             m.uniq_key, delivering[m.queue_offset][0])
                    self.delivered.add(m.queue_offset)
                    continue
                self._schedule(m.queue_offset, m.commit_log_offset, m.properties)
            off = max(res.next_begin_offset, off + 1) if not res.messages else res.next_begin_offset
        self.seen_next = max(hi, self.watermark)
        if delivering:
            self._write_state()  # the doubt is settled: record it before anything else is put
        if self.heap:
            log.info("%d delay messages scheduled", len(self.heap))

    def _rocketmq_timer_ran(self) -> bool:
        config_dir = os.path.dirname(os.path.abspath(self.path))
        root = os.path.dirname(config_dir)
        return any(os.path.exists(p) for p in (os.path.join(config_dir, "timercheck"),
                                               os.path.join(root, "timerwheel"), os.path.join(root, "timerlog")))

    def _copy_stored(self, timer_msg: MessageExt, topic: str, queue_id: int, from_offset: int) -> bool:
        """True when the real queue holds, from ``from_offset`` on, the copy of ``timer_msg``."""
        uniq, born = timer_msg.uniq_key, timer_msg.born_timestamp
        if not uniq:
            return False
        off = max(from_offset, self.store.min_offset_in_queue(topic, queue_id))
        hi = self.store.max_offset_in_queue(topic, queue_id)
        while off < hi:
            res = self.store.get(topic, queue_id, off, 64, read_body=False)
            if not res.messages:
                if res.next_begin_offset <= off:
                    return False
                off = res.next_begin_offset
                continue
            for m in res.messages:
                if m.uniq_key == uniq and m.born_timestamp == born:
                    return True
            off = res.next_begin_offset
        return False

    def _schedule(self, queue_offset: int, phy: int, props: dict[str, str]) -> None:
        try:
            at = int(props.get(P_TIMER_DELIVER, "0"))
        except ValueError:
            at = 0
        heapq.heappush(self.heap, (at, queue_offset, phy))
        self.pending.add(queue_offset)
        self.seen_next = max(self.seen_next, queue_offset + 1)

    # ------------------------------------------------------------ taking
    def submit(self, msg: Message, deliver_at: int) -> PutMessageResult:
        """Store a delay message in the timer topic and schedule it."""
        floor = self.floor()
        try:
            res = self.put(wrap(msg, deliver_at))
            self.scheduled(res, deliver_at)  # before the floor goes: the watermark must not pass the record
        finally:
            self.unfloor(floor)
        return res

    def scheduled(self, res: PutMessageResult, deliver_at: int) -> None:
        """A timer record was put (``res``): schedule it, and wake the service if it is the next due."""
        if not res.ok:
            return
        with self.lock:
            heapq.heappush(self.heap, (deliver_at, res.queue_offset, res.commit_log_offset))
            self.pending.add(res.queue_offset)
            self.seen_next = max(self.seen_next, res.queue_offset + 1)
            first = self.heap[0][1] == res.queue_offset
        if first:
            self.wakeup()

    def floor(self) -> int:
        """Register a timer put about to be made elsewhere (the broker's loop); pass it to :meth:`unfloor`."""
        with self.lock:
            floor = self.store.max_offset_in_queue(TIMER_TOPIC, 0)
            self.put_floors.append(floor)
            return floor

    def unfloor(self, floor: int) -> None:
        with self.lock:
            self.put_floors.remove(floor)

    def scheduled_times(self) -> list[int]:
        """The delivery times still scheduled, earliest first."""
        with self.lock:
            return sorted(at for at, _, _ in self.heap)

    # ------------------------------------------------------------ delivering
    def run_once(self) -> None:
        if self._now_ms() >= self.retry_at:
            self.deliver_due()
        with self.lock:
            nxt = self.heap[0][0] if self.heap else None
        if nxt is not None:
            nxt = max(nxt, self.retry_at)
        self.interval = 1.0 if nxt is None else min(1.0, max(0.001, (nxt - self._now_ms()) / 1000))

    def deliver_due(self, now: int | None = None) -> int:
        """Put every due message into its topic (at most MAX_ROUND); returns how many were."""
        with self._round:
            if self.frozen is not None:
                return 0  # a copy put now would not be recorded: the next start delivers it
            now = self._now_ms() if now is None else now
            with self.lock:
                due = []
                while self.heap and self.heap[0][0] <= now and len(due) < MAX_ROUND:
                    due.append(heapq.heappop(self.heap))
            if not due:
                return 0
            copies: list[tuple[tuple[int, int, int], Message | None]] = []
            later = []
            for item in due:
                try:
                    m = self.store.look(item[2])
                except (TierError, OSError) as e:  # unreadable for now (the bucket, the disk): due again soon
                    log.warning("timer message at commitlog offset %d cannot be read now (%s); tried again",
                                item[2], e)
                    later.append(item)
                    continue
                except Exception as e:
                    log.error("timer message at commitlog offset %d unreadable (%s); dropped", item[2], e)
                    copies.append((item, None))
                    continue
                copies.append((item, restore(m, self.store_host, drop=(P_REAL_TOPIC, P_REAL_QID, P_DELAY))))
            if later:  # due again in a second, each alone: a pause of the whole timer (retry_at) would hold
                retry = self._now_ms() + 1000  # back every other message for as long as one stays unreadable
                with self.lock:
                    for _at, queue_offset, phy in later:
                        heapq.heappush(self.heap, (retry, queue_offset, phy))
            doubt = {item[1]: [c.topic, c.queue_id, self.store.max_offset_in_queue(c.topic, c.queue_id)]
                     for item, c in copies if c is not None}
            self._write_state(doubt)  # durably, before any copy is put
            done, topics = 0, set()
            try:
                for i, (item, copy) in enumerate(copies):
                    if copy is not None:
                        res = self.put(copy)
                        if not res.ok:
                            log.warning("delay message %s to %s not delivered yet: %s %s",
                                        copy.properties.get(P_UNIQ), copy.topic, res.status.value, res.error or "")
                            with self.lock:
                                for rest in copies[i:]:
                                    heapq.heappush(self.heap, rest[0])
                            self.retry_at = self._now_ms() + 1000
                            break
                        topics.add(copy.topic)
                        done += 1
                    with self.lock:
                        self.pending.discard(item[1])
                        self.delivered.add(item[1])
                self._delivered_hook()
            finally:
                if done and not self.sync():
                    # The state written before the puts names them as "delivering": left so, the next start
                    # looks for the copies that reached the disk and puts the others again.
                    self.frozen = "the commitlog could not be flushed after delivering delay messages"
                    log.error("%s: %s; the timer state is no longer written", self.path, self.frozen)
                self._write_state()
            if topics:
                self.store.wait_dispatched(5.0)
                for listener in list(self.listeners):
                    try:
                        listener(topics)
                    except Exception:
                        log.exception("timer listener failed")
            return done

    def _delivered_hook(self) -> None:
        """Between the copies' puts and the state write (a test puts a crash here)."""

    # ------------------------------------------------------------ state
    def snapshot(self, delivering: dict[int, list] | None = None) -> dict[str, Any]:
        # Every timer offset below the watermark is delivered.  A put still in flight gets an offset at or
        # above the queue's size when it started (its floor); the watermark never moves back.
        with self.lock:
            w = min([self.seen_next, *self.pending, *self.put_floors])
            self.watermark = max(self.watermark, w)
            self.delivered = {o for o in self.delivered if o >= self.watermark}
            snap: dict[str, Any] = {"offset": self.watermark, "delivered": sorted(self.delivered)}
        if delivering:
            snap["delivering"] = {str(k): v for k, v in delivering.items()}
        return snap

    def _write_state(self, delivering: dict[int, list] | None = None) -> None:
        if self.frozen is not None:
            return
        if not delivering and self.seen_next == 0 and not self.heap and not os.path.exists(self.path):
            return  # a store that never held a delay message gets no state file
        write_json_atomic(self.path, self.snapshot(delivering))

    def persist(self) -> None:
        """Write the state now (a round writes it too)."""
        with self._round:
            self._write_state()

    def on_shutdown(self) -> None:
        self.persist()

