"""Delay messages: kept in the system topic ``rmq_sys_wheel_timer`` until due, then put into their topic.

As RocketMQ 5's timer does, a message with a delivery time is stored first in
``rmq_sys_wheel_timer`` (queue 0) with ``REAL_TOPIC``/``REAL_QID`` and
``TIMER_DELIVER_MS`` properties, so that no consumer sees it.  When it is due
the broker puts a copy, with its own properties, into the real topic and queue.

``config/timerState.json`` says how far that went: ``offset`` (every timer
message below it was delivered) and ``delivered`` (delivered ones at or above
it).  At start the timer topic is read from ``offset`` to rebuild the schedule,
so delay messages survive restarts.  A crash between the copy and the state
write delivers that message twice (at least once).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import os
from typing import Any, Awaitable, Callable

from ..format import codec
from ..format.codec import MessageExt
from ..storage.jsonfile import read_json, write_json_atomic
from ..format.message import GetMessageStatus, Message, PutMessageResult
from .convert import P_REAL_QID, P_REAL_TOPIC, P_TIMER_DELIVER
from .pop import now_ms
from .tasks import cancel
from .topics import TIMER_TOPIC

log = logging.getLogger(__name__)


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


class TimerService:
    def __init__(self, store: Any, config_dir: str, store_host: tuple[bytes, int],
                 put: Callable[[Message], Awaitable[PutMessageResult]], notify: Callable[[str], None]) -> None:
        self.store = store
        self.path = os.path.join(config_dir, "timerState.json")
        self.store_host = store_host
        self.put = put
        self.notify = notify
        self.heap: list[tuple[int, int, int]] = []  # (deliver at ms, timer queue offset, commitlog offset)
        self.pending: set[int] = set()
        self.delivered: set[int] = set()
        self.watermark = 0
        self.seen_next = 0
        self.put_floors: list[int] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._load()

    def _load(self) -> None:
        data = read_json(self.path) or {}
        try:
            self.watermark = int(data.get("offset", 0))
            self.delivered = {int(o) for o in data.get("delivered") or []}
        except (TypeError, ValueError, AttributeError):
            log.warning("%s: malformed; rebuilding the schedule from the start of the timer topic", self.path)
            self.watermark, self.delivered = 0, set()
        lo = self.store.min_offset_in_queue(TIMER_TOPIC, 0)
        hi = self.store.max_offset_in_queue(TIMER_TOPIC, 0)
        off = max(self.watermark, lo)
        while off < hi:
            res = self.store.get(TIMER_TOPIC, 0, off, 32, read_body=False)
            if res.status is GetMessageStatus.OFFSET_TOO_SMALL:
                off = res.min_offset
                continue
            if not res.messages and res.next_begin_offset <= off:
                break
            for m in res.messages:
                if m.queue_offset not in self.delivered:
                    self._schedule(m.queue_offset, m.commit_log_offset, m.properties)
            off = max(res.next_begin_offset, off + 1) if not res.messages else res.next_begin_offset
        self.seen_next = max(hi, self.watermark)
        if self.heap:
            log.info("%d delay messages scheduled", len(self.heap))

    def _schedule(self, queue_offset: int, phy: int, props: dict[str, str]) -> None:
        try:
            at = int(props.get(P_TIMER_DELIVER, "0"))
        except ValueError:
            at = 0
        heapq.heappush(self.heap, (at, queue_offset, phy))
        self.pending.add(queue_offset)
        self.seen_next = max(self.seen_next, queue_offset + 1)

    def wrap(self, msg: Message, deliver_at: int) -> Message:
        """The timer-topic record for a delay message bound for ``msg.topic``/``msg.queue_id``."""
        props = dict(msg.properties)
        props[P_REAL_TOPIC] = msg.topic
        props[P_REAL_QID] = str(msg.queue_id)
        props[P_TIMER_DELIVER] = str(deliver_at)
        return Message(topic=TIMER_TOPIC, body=msg.body, queue_id=0, properties=props, flag=msg.flag,
                       born_timestamp=msg.born_timestamp, born_host=msg.born_host, store_host=msg.store_host)

    async def submit(self, msg: Message, deliver_at: int) -> PutMessageResult:
        """Store a delay message in the timer topic and schedule it."""
        floor = self.store.max_offset_in_queue(TIMER_TOPIC, 0)
        self.put_floors.append(floor)
        try:
            res = await self.put(self.wrap(msg, deliver_at))
        finally:
            self.put_floors.remove(floor)
        if res.ok:
            heapq.heappush(self.heap, (deliver_at, res.queue_offset, res.commit_log_offset))
            self.pending.add(res.queue_offset)
            self.seen_next = max(self.seen_next, res.queue_offset + 1)
            self._wake.set()
        return res

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="timer")

    async def stop(self) -> None:
        await cancel(self._task)

    async def _run(self) -> None:
        while True:
            now = now_ms()
            delay = 1.0 if not self.heap else min(1.0, max(0.0, (self.heap[0][0] - now) / 1000))
            if delay > 0:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                continue
            try:
                await self._deliver_due()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("timer delivery failed; retrying in 1 s")
                await asyncio.sleep(1)

    async def _deliver_due(self) -> None:
        now = now_ms()
        done = 0
        topics: set[str] = set()
        while self.heap and self.heap[0][0] <= now and done < 256:
            at, qoff, phy = self.heap[0]
            try:
                m = self.store.look(phy)
            except Exception as e:
                log.error("timer message at commitlog offset %d unreadable (%s); dropped", phy, e)
                heapq.heappop(self.heap)
                self._mark(qoff)
                continue
            res = await self.put(restore(m, self.store_host))
            if not res.ok:
                log.warning("delay message %s to %s not delivered yet: %s %s", m.uniq_key,
                            m.properties.get(P_REAL_TOPIC), res.status.value, res.error or "")
                await asyncio.sleep(0.5)
                return
            heapq.heappop(self.heap)
            self._mark(qoff)
            topics.add(m.properties.get(P_REAL_TOPIC, ""))
            done += 1
        if done:
            await self.persist()
            for t in topics:
                self.notify(t)

    def _mark(self, qoff: int) -> None:
        self.pending.discard(qoff)
        self.delivered.add(qoff)

    def snapshot(self) -> dict[str, Any]:
        # Every timer offset below the watermark is delivered.  A put still in flight gets an offset at or
        # above the queue's size when it started (its floor); the watermark never moves back.
        w = min([self.seen_next, *self.pending, *self.put_floors])
        self.watermark = max(self.watermark, w)
        self.delivered = {o for o in self.delivered if o >= self.watermark}
        return {"offset": self.watermark, "delivered": sorted(self.delivered)}

    async def persist(self) -> None:
        snap = self.snapshot()
        await asyncio.get_running_loop().run_in_executor(None, write_json_atomic, self.path, snap)
