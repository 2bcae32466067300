"""Consuming: ReceiveMessage (with the long-polling hand-off), AckMessage, ChangeInvisibleDuration."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from ..errors import CorruptRecordError
from .convert import Code, set_ts, to_pb
from ..queues.pop import Delivery, TagFilter, now_ms
from .proto import pb, svc
from .topics import MAX_GROUP_LEN, MAX_TOPIC_LEN, illegal_name
from .wire import Undecodable
from .calls import LONG_POLL_RECHECK, MAX_ACK_ENTRIES, SUB, guarded, internal_error, set_status

log = logging.getLogger(__name__)


class Receiving:
    """The consuming part of :class:`~rocketstore.broker.service.MessagingService`."""

    async def ReceiveMessage(self, request: Any, context: Any) -> AsyncIterator[Any]:
        started = time.monotonic()
        first = svc.ReceiveMessageResponse()
        try:
            if isinstance(request, Undecodable):
                set_status(first.status, request.code, request.why)
                plan = None
            else:
                plan = await self._receive_plan(request, context, first.status)
        except Exception:
            log.exception("ReceiveMessage failed")
            plan = None
            internal_error(first.status, context, "ReceiveMessage")
        if plan is None:
            yield first
            return
        deliveries: list[Delivery] = []
        group, t, qids, batch, inv, flt, fifo, attempts, cid, auto_renew, poll = plan
        pop = self.broker.pop
        deadline = started + poll
        sent = False
        polling_full = False
        try:
            replies: list[Any] = []
            try:
                while True:
                    self.broker.dispatch_now()  # every message stored before this look is in the queues
                    deliveries, dead = pop.receive(group, t.name, qids, batch, inv, flt, fifo=fifo,
                                                   max_attempts=attempts, client=cid, auto_renew=auto_renew)
                    if dead:
                        self._background(self.broker.dead_letters.move())
                    if deliveries:
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    if self.broker.longpoll.size >= self.cfg.maxPopPollingSize:
                        polling_full = True
                        break
                    # Woken by a put or an unblocked message; else when an in-flight one becomes due again.
                    due_in = (pop.next_due(group, t.name, qids) - now_ms()) / 1000
                    wait = min(left, LONG_POLL_RECHECK, due_in + 0.001 if due_in > 0 else LONG_POLL_RECHECK)
                    await self.broker.longpoll.wait(t.name, group, qids, flt, wait)
                shown = request.message_queue.topic
                for d in deliveries:
                    r = svc.ReceiveMessageResponse()
                    to_pb(d.message, r.message, receipt_handle=self.receipts.seal(group, t.name, d.handle),
                          delivery_attempt=max(1, d.entry.attempts), invisible_ms=inv)
                    r.message.topic.CopyFrom(shown)  # as the client named it (no namespace prefix)
                    replies.append(r)
                if deliveries:
                    set_status(first.status, Code.OK)
                elif polling_full:
                    set_status(first.status, Code.TOO_MANY_REQUESTS,
                         f"{self.cfg.maxPopPollingSize} receives are already waiting (maxPopPollingSize)")
                else:
                    set_status(first.status, Code.MESSAGE_NOT_FOUND, "no new message")
            except CorruptRecordError as e:  # the next message is damaged: say so, deliver nothing in its place
                replies = []
                set_status(first.status, Code.MESSAGE_CORRUPTED, str(e)[:500])
            except Exception:
                log.exception("ReceiveMessage failed")
                replies = []
                internal_error(first.status, context, "ReceiveMessage")
            yield first
            for r in replies:
                yield r
            sent = bool(replies)
            r = svc.ReceiveMessageResponse()
            set_ts(r.delivery_timestamp, now_ms())
            yield r
        finally:
            if deliveries and not sent:
                # The client is gone before it got them (or they could not be sent): visible again at once.
                pop.release(deliveries, group, t.name)

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _receive_plan(self, request: Any, context: Any, status: Any) -> tuple | None:
        caller = self._caller(context, status)
        if caller is None:
            return None
        cid = caller.client_id
        if not cid:
            set_status(status, Code.CLIENT_ID_REQUIRED, "x-mq-client-id is missing")
            return None
        group = self._resolve(caller, status, request.group, "Group", SUB)
        topic = group and self._resolve(caller, status, request.message_queue.topic, "Topic", SUB)
        if topic is None:
            return None
        t = await self._topic_for(topic, create=False, status=status)
        if t is None:
            return None
        g = await self._group_for(group, status, t.message_type == "FIFO")
        if g is None:
            return None
        if not t.readable or t.read_queue_nums <= 0:
            set_status(status, Code.FORBIDDEN, f"topic {t.name} is not readable")
            return None
        fe = request.filter_expression
        if fe.type not in pb.FilterType.values():
            set_status(status, Code.ILLEGAL_FILTER_EXPRESSION, f"unknown filter type {fe.type}")
            return None
        if fe.type == pb.FilterType.SQL:
            set_status(status, Code.ILLEGAL_FILTER_EXPRESSION, "SQL92 filters are not supported; use a TAG expression")
            return None
        flt = TagFilter(fe.expression)
        if request.batch_size <= 0:
            set_status(status, Code.BAD_REQUEST, "batch_size must be positive")
            return None
        batch = min(request.batch_size, self.cfg.maxReceiveBatchSize)
        auto_renew = bool(request.auto_renew)
        if request.HasField("invisible_duration"):
            d = request.invisible_duration
            inv = d.seconds * 1000 + d.nanos // 1_000_000
            if not self.cfg.minInvisibleTime <= inv <= self.cfg.maxInvisibleTime:
                set_status(status, Code.ILLEGAL_INVISIBLE_TIME,
                     f"invisible duration must be within [{self.cfg.minInvisibleTime}, "
                     f"{self.cfg.maxInvisibleTime}] ms")
                return None
        else:
            inv = self.cfg.popAutoRenewInvisibleTime
        if request.HasField("long_polling_timeout"):
            d = request.long_polling_timeout
            poll = (d.seconds * 1000 + d.nanos // 1_000_000) / 1000
            if poll < 0:
                set_status(status, Code.ILLEGAL_POLLING_TIME, "long polling timeout must not be negative")
                return None
        else:
            poll = self.cfg.longPollingTimeout / 1000
        poll = max(0.0, min(poll, self.cfg.maxLongPollingTimeout / 1000))
        remaining = context.time_remaining()
        if remaining is not None:
            poll = max(0.0, min(poll, remaining - 0.5))
        qid = request.message_queue.id
        if auto_renew and g.orderly and 0 <= qid < t.read_queue_nums:
            qids = [qid]  # a FIFO push consumer's own queue assignment
        else:
            qids = list(range(t.read_queue_nums))
        return (g.name, t, qids, batch, inv, flt, g.orderly, g.max_attempts, cid, auto_renew, poll)

    def _ack_target(self, request: Any, context: Any, status: Any) -> tuple[str, str] | None:
        caller = self._caller(context, status)
        group = caller and self._resolve(caller, status, request.group, "Group", SUB)
        topic = group and self._resolve(caller, status, request.topic, "Topic", SUB)
        if topic is None:
            return None
        why = illegal_name(group, "group", MAX_GROUP_LEN)
        if why:
            set_status(status, Code.ILLEGAL_CONSUMER_GROUP, why)
            return None
        why = illegal_name(topic, "topic", MAX_TOPIC_LEN)
        if why:
            set_status(status, Code.ILLEGAL_TOPIC, why)
            return None
        return group, topic

    def _pop_handle(self, target: tuple[str, str], sealed: str) -> str:
        """The pop handle inside a receipt handle ("" when its MAC does not verify: no entry has that handle)."""
        return self.receipts.open(*target, sealed) or ""

    @guarded(svc.AckMessageResponse)
    async def AckMessage(self, request: Any, context: Any) -> Any:
        resp = svc.AckMessageResponse()
        target = self._ack_target(request, context, resp.status)
        if target is None:
            return resp
        if not request.entries:
            set_status(resp.status, Code.BAD_REQUEST, "no entry to ack")
            return resp
        if len(request.entries) > MAX_ACK_ENTRIES:
            set_status(resp.status, Code.BAD_REQUEST,
                 f"{len(request.entries)} entries in one ack; at most {MAX_ACK_ENTRIES}")
            return resp
        group, topic = target
        for e in request.entries:
            r = resp.entries.add()
            r.message_id, r.receipt_handle = e.message_id, e.receipt_handle
            if self.broker.pop.ack(group, topic, self._pop_handle(target, e.receipt_handle)):
                set_status(r.status, Code.OK)
            else:
                set_status(r.status, Code.INVALID_RECEIPT_HANDLE, "receipt handle is unknown, expired or superseded")
        if self.cfg.popAckSyncFlush and not await self.broker.persist(final=True):
            for r in resp.entries:  # applied, but a crash now would deliver them again
                if r.status.code == Code.OK:
                    set_status(r.status, Code.MASTER_PERSISTENCE_TIMEOUT, "acked, but writing the consumer state failed "
                                                                    "(see the broker log)")
        codes = {r.status.code for r in resp.entries}
        if len(codes) == 1:
            resp.status.CopyFrom(resp.entries[0].status)
        else:
            set_status(resp.status, Code.MULTIPLE_RESULTS, "entries have different results")
        return resp

    @guarded(svc.ChangeInvisibleDurationResponse)
    async def ChangeInvisibleDuration(self, request: Any, context: Any) -> Any:
        resp = svc.ChangeInvisibleDurationResponse()
        resp.receipt_handle = request.receipt_handle  # the client keeps whatever we answer
        target = self._ack_target(request, context, resp.status)
        if target is None:
            return resp
        d = request.invisible_duration
        inv = d.seconds * 1000 + d.nanos // 1_000_000
        if not 0 <= inv <= self.cfg.maxInvisibleTime:
            set_status(resp.status, Code.ILLEGAL_INVISIBLE_TIME,
                 f"invisible duration must be within [0, {self.cfg.maxInvisibleTime}] ms")
            return resp
        handle = self.broker.pop.change_invisible(*target, self._pop_handle(target, request.receipt_handle), inv,
                                                  bool(request.HasField("suspend") and request.suspend))
        if handle is None:
            set_status(resp.status, Code.INVALID_RECEIPT_HANDLE, "receipt handle is unknown, expired or superseded")
            return resp
        resp.receipt_handle = self.receipts.seal(*target, handle)
        set_status(resp.status, Code.OK)
        return resp
