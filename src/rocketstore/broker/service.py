"""The gRPC service ``apache.rocketmq.v2.MessagingService`` over a :class:`~rocketstore.broker.broker.Broker`.

Every reply carries its outcome as a body ``Status`` (gRPC status OK), as
RocketMQ's proxy does; the clients map the codes to exceptions.  The contract
each RPC follows is described in ``grpc-broker.md`` (QueryRoute, Telemetry,
Heartbeat, SendMessage, ReceiveMessage, AckMessage, ChangeInvisibleDuration,
ForwardMessageToDeadLetterQueue, EndTransaction, QueryAssignment,
NotifyClientTermination).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import grpc

from .acl import AccessControl
from .broker import Broker
from .clients import ClientOwners
from .dedup import SendDedup
from .convert import Code
from .proto import svc, svc_grpc
from .receipts import ReceiptSigner
from .calls import PUB, SUB, Calls, guarded, inflate_budget, set_status
from .receive import Receiving
from .send import Sending
from .session import Sessions

log = logging.getLogger(__name__)


class MessagingService(Calls, Sessions, Sending, Receiving, svc_grpc.MessagingServiceServicer):
    """The servicer: holds the broker's parts; each RPC lives with its job (calls, session, send, receive)."""

    def __init__(self, broker: Broker, host: str, port: int, *, receipts: ReceiptSigner,
                 access: AccessControl | None = None) -> None:
        self.broker = broker
        self.receipts = receipts
        self.access = access
        self.owners = ClientOwners(broker.clients)
        if access is not None:
            broker.clients.may_check = lambda c, topic: access.allowed(c.user, "Topic", topic, PUB)
        self.cfg = broker.cfg
        self.topics = broker.topics
        adv = host
        if host in ("0.0.0.0", "", "::", "[::]"):
            adv = "127.0.0.1"
        self.advertised = (adv.strip("[]"), port)
        self._rr: dict[str, itertools.count] = {}
        self._max_body = broker.store.config.maxMessageSize  # (fixed while the store is open)
        self._inflate_budget = inflate_budget(self._max_body)
        self.dedup = SendDedup(broker.store)
        self._legal_topics: set[str] = set()  # names illegal_name has passed, of no system topic
        self._send_topics: set[str] = set()  # names a send was let through to before (Sending._writable_topic)
        self._callers: dict[tuple[str, str, str], Any] = {}  # (client id, namespace, peer): Caller, ACL off
        self._tasks: set[asyncio.Task] = set()

    @guarded(svc.QueryAssignmentResponse)
    async def QueryAssignment(self, request: Any, context: Any) -> Any:
        resp = svc.QueryAssignmentResponse()
        caller = self._caller(context, resp.status)
        group = caller and self._resolve(caller, resp.status, request.group, "Group", SUB)
        topic = group and self._resolve(caller, resp.status, request.topic, "Topic", SUB)
        if topic is None:
            return resp
        t = await self._topic_for(topic, create=False, status=resp.status)
        if t is None:
            return resp
        g = await self._group_for(group, resp.status, t.message_type == "FIFO")
        if g is None:
            return resp
        if not t.readable or t.read_queue_nums <= 0:
            set_status(resp.status, Code.FORBIDDEN, f"topic {t.name} is not readable")
            return resp
        for qid in (range(t.read_queue_nums) if g.orderly else (-1,)):
            a = resp.assignments.add()
            self._fill_queue(a.message_queue, t, qid, request.topic, request.endpoints)
        set_status(resp.status, Code.OK)
        return resp

    # ------------------------------------------------------------ not offered
    async def _unsupported(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not supported by rocketstore")

    PullMessage = UpdateOffset = GetOffset = QueryOffset = SyncLiteSubscription = _unsupported
