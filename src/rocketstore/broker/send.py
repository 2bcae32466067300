"""Producing: SendMessage (each message through small steps), EndTransaction, RecallMessage, and a client's
ForwardMessageToDeadLetterQueue (moved by the broker's dead letters, rocketstore.broker.deadletters)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import zlib
from typing import Any

from ..format.message import Message, PutMessageResult, PutMessageStatus
from .dedup import digest
from .convert import FIFO, GZIP, P_TAGS, TRANSACTION, TYPE_NAMES, BadMessage, Code, host_from, validate
from ..queues.pop import now_ms
from .topics import TopicConfig
from .proto import pb, svc
from .calls import (INTERNAL_CODE, MAX_SEND_MESSAGES, OK_CODE, OK_TEXT, PUB, PUT_CODES, Caller, guarded,
                    set_status)

log = logging.getLogger(__name__)
PUT_OK = PutMessageStatus.PUT_OK


class Sending:
    """The producing part of :class:`~rocketstore.broker.service.MessagingService`."""

    @guarded(svc.SendMessageResponse)
    async def SendMessage(self, request: Any, context: Any) -> Any:
        resp = svc.SendMessageResponse()
        caller = self._caller(context, resp.status)
        if caller is None:
            return resp
        if not caller.client_id:
            set_status(resp.status, Code.CLIENT_ID_REQUIRED, "x-mq-client-id is missing")
            return resp
        messages = request.messages
        n = len(messages)
        if not n:
            set_status(resp.status, Code.BAD_REQUEST, "no message to send")
            return resp
        if n > MAX_SEND_MESSAGES:
            set_status(resp.status, Code.BAD_REQUEST, f"more than {MAX_SEND_MESSAGES} messages in one request")
            return resp
        peer = caller.peer
        budget = [self._inflate_budget]  # what the request's GZIP bodies may inflate to, together
        entries = resp.entries
        all_ok = True
        for m in messages:
            if not await self._send_one(caller, m, entries.add(), peer, budget):
                all_ok = False
        if all_ok:
            resp.status.code, resp.status.message = OK_CODE, OK_TEXT
            return resp
        first = entries[0].status
        if n == 1 or all(e.status.code == first.code for e in entries):
            resp.status.code, resp.status.message = first.code, first.message  # (Status: these two fields)
        else:
            set_status(resp.status, Code.MULTIPLE_RESULTS, "entries have different results")
        return resp

    async def _send_one(self, caller: Caller, m: Any, entry: Any, peer: str, budget: list[int]) -> bool:
        """One message of a SendMessage: each step fills ``entry.status`` and returns None when it refuses;
        True when the message is stored (or was, by an earlier send of it): the entry's status is OK.

        A send to a known topic, not seen before, put on the loop (ASYNC_FLUSH) awaits nothing: the steps that
        may wait (creating the topic, looking for an earlier send in the store, a transaction, a delay, a put
        in the pool) are coroutines entered only when needed (each coroutine entered costs its frame)."""
        sp = m.system_properties
        mid = entry.message_id = sp.message_id  # (each read of a protobuf string field builds a new str)
        status = entry.status
        name = self._resolve(caller, status, m.topic, "Topic", PUB)
        if name is None:
            return False
        t = self._writable_topic(name)
        if t is None:
            t = await self._send_target(name, status)
            if t is None:
                return False
        now = now_ms()  # one clock reading for the delivery-time check, the born fallback and the routing
        checked = self._checked_body(m, sp, mid, t, status, budget, now)
        if checked is None:
            return False
        mtype, body, props, born, deliver_at = checked
        body_digest = digest(body)
        tname = t.name
        seen = self.dedup.recent(tname, mid, body_digest)
        if seen is None and mtype != TRANSACTION and self.dedup.needs_lookup(tname, mid):
            seen = await self._stored_before(tname, mid, body)
        if seen is not None:  # a resend: answered with the first send's result
            entry.offset, entry.transaction_id = seen
            status.code, status.message = OK_CODE, OK_TEXT
            return True
        qid = self._choose_queue(t, mtype, sp)
        # (positional: topic, body, queue id, tags, keys, properties, flag, sys flag, born time, born host,
        # store host; keyword arguments cost a tenth of the construction)
        msg = Message(tname, body, qid, None, None, props, 0, 0, born or now, host_from(sp.born_host, peer),
                      self.broker.store_host)
        plain = mtype != TRANSACTION and deliver_at <= now
        res = self.broker.put_inline(msg) if plain else None
        txid = ""
        if res is None:
            res, txid = await self._route(msg, mtype, deliver_at, now)
        if res.status is not PUT_OK:
            if self._refused_by_store(res, tname, status):
                return False
        elif plain:
            self.broker.notify(tname, qid, props.get(P_TAGS))
        offset = entry.offset = res.queue_offset if res.queue_offset >= 0 else 0
        if txid:
            entry.transaction_id = txid
        self.dedup.remember(tname, mid, offset, txid, body_digest)
        status.code, status.message = OK_CODE, OK_TEXT
        return True

    def _writable_topic(self, name: str) -> TopicConfig | None:
        """The topic a send may go to, when it passed :meth:`_send_target` before and still takes writes; None:
        ask :meth:`_send_target` (a first send, a topic being created, changed or refused)."""
        if name in self._send_topics:
            t = self.topics.ready_topic(name)
            if t is not None and t.writable and t.write_queue_nums > 0:
                return t
        return None

    async def _send_target(self, name: str, status: Any) -> TopicConfig | None:
        """The (auto-created) topic of a send, when its name is legal and it takes writes."""
        t = await self._topic_for(name, create=True, status=status, send=True)
        if t is None:
            return None
        if not t.writable or t.write_queue_nums <= 0:
            set_status(status, Code.FORBIDDEN, f"topic {t.name} is not writable")
            return None
        if len(self._send_topics) >= 10000:
            self._send_topics.clear()
        self._send_topics.add(name)
        return t

    def _checked_body(self, m: Any, sp: Any, mid: str, t: TopicConfig, status: Any, budget: list[int],
                      now: int) -> tuple[int, bytes, dict[str, str], int, int] | None:
        """Validation (:func:`~.convert.validate`: type, plain body, stored properties, born and delivery
        times), the GZIP budget charged for the inflating, the topic's accepted types, the delay's limit."""
        max_body = self._max_body
        try:
            checked = validate(m, sp, mid, max_body, budget[0])
        except BadMessage as e:
            if sp.body_encoding == GZIP:  # refused, but the inflating was done: it counts
                budget[0] -= min(max_body, max(0, budget[0])) + 1
            set_status(status, e.code, str(e))
            return None
        mtype, body, _, _, deliver_at = checked
        if sp.body_encoding == GZIP:
            budget[0] -= len(body)
        tname = TYPE_NAMES[mtype]
        if tname not in t.accepts():
            set_status(status, Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE,
                       f"topic {t.name} accepts {'/'.join(t.accepts())} messages, not {tname}")
            return None
        if deliver_at and deliver_at > now + self.cfg.maxDelayTime:
            set_status(status, Code.ILLEGAL_DELIVERY_TIME,
                       f"delivery time is more than {self.cfg.maxDelayTime} ms ahead")
            return None
        return checked

    async def _stored_before(self, topic: str, message_id: str, body: bytes) -> tuple[int, str] | None:
        """Dedup after a restart: (queue offset, "") of this message stored before this process started, found
        through the store's index in the pool (:meth:`~.dedup.SendDedup.stored`); None if it is not."""
        off = await asyncio.get_running_loop().run_in_executor(self.broker.executor, self.dedup.stored,
                                                               topic, message_id, body)
        return None if off is None else (off, "")

    def _choose_queue(self, t: TopicConfig, mtype: int, sp: Any) -> int:
        """FIFO messages of one group share a queue (crc32 of the group); the rest go round-robin per topic."""
        if mtype == FIFO:
            return zlib.crc32(sp.message_group.encode("utf-8")) % t.write_queue_nums
        rr = self._rr.get(t.name)
        if rr is None:
            rr = self._rr[t.name] = itertools.count()
        return next(rr) % t.write_queue_nums

    async def _route(self, msg: Message, mtype: int, deliver_at: int, now: int) -> tuple[PutMessageResult, str]:
        """Routing of what is not put on the loop (:meth:`~.broker.Broker.put_inline`): a transaction's half
        message, a delay message to the timer, a put in the pool (SYNC_FLUSH); the store's result and the
        transaction id."""
        if mtype == TRANSACTION:
            return await self.broker.transactions.submit(msg)
        if deliver_at > now:
            return await self.broker.timer.submit(msg, deliver_at), ""
        return await self.broker.put(msg), ""

    @staticmethod
    def _refused_by_store(res: PutMessageResult, topic: str, status: Any) -> bool:
        """Status mapping: the store's put status as the client's code; True (and logged) when it is not OK."""
        code = PUT_CODES.get(res.status, INTERNAL_CODE)
        if res.status is PutMessageStatus.MESSAGE_ILLEGAL and res.error and "maxMessageSize" in res.error:
            code = Code.MESSAGE_BODY_TOO_LARGE
        if code == OK_CODE:
            return False
        set_status(status, code, f"{res.status.value}: {res.error or ''}".strip(": "))
        log.warning("send to %s failed: %s %s", topic, res.status.value, res.error or "")
        return True

    @guarded(svc.EndTransactionResponse)
    async def EndTransaction(self, request: Any, context: Any) -> Any:
        resp = svc.EndTransactionResponse()
        caller = self._caller(context, resp.status)
        topic = caller and self._resolve(caller, resp.status, request.topic, "Topic", PUB)
        if topic is None:
            return resp
        if request.resolution not in pb.TransactionResolution.values() \
                or request.source not in pb.TransactionSource.values():
            set_status(resp.status, Code.BAD_REQUEST, f"unknown transaction resolution {request.resolution} "
                                                f"or source {request.source}")
            return resp
        code, text = await self.broker.transactions.end(topic, request.message_id,
                                                        request.transaction_id, request.resolution, request.source)
        set_status(resp.status, code, text)
        return resp

    @guarded(svc.RecallMessageResponse)
    async def RecallMessage(self, request: Any, context: Any) -> Any:
        resp = svc.RecallMessageResponse()
        set_status(resp.status, Code.UNSUPPORTED, "recalling delay messages is not supported")
        return resp

    @guarded(svc.ForwardMessageToDeadLetterQueueResponse)
    async def ForwardMessageToDeadLetterQueue(self, request: Any, context: Any) -> Any:
        resp = svc.ForwardMessageToDeadLetterQueueResponse()
        target = self._ack_target(request, context, resp.status)
        if target is None:
            return resp
        d = self.broker.pop.take_for_dlq(*target, self._pop_handle(target, request.receipt_handle))
        if d is None:
            set_status(resp.status, Code.INVALID_RECEIPT_HANDLE, "receipt handle is unknown, expired or superseded")
            return resp
        if await self.broker.dead_letters.forward(d):
            set_status(resp.status, Code.OK)
        else:
            set_status(resp.status, Code.INTERNAL_SERVER_ERROR, "could not write to the dead letter queue")
        return resp
