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
import functools
import ipaddress
import itertools
import logging
import time
import zlib
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import grpc

from ..errors import CorruptRecordError
from ..format.message import Message, PutMessageStatus
from . import namespace as nsutil
from .acl import AccessControl, AuthenticationError, AuthorizationError
from .broker import Broker
from .clients import ClientOwners
from .dedup import SendDedup, digest
from .convert import (DELAY, FIFO, GZIP, P_DLQ_MSG_ID, P_DLQ_TOPIC, P_ORIGIN_MSG_ID, P_RECONSUME, P_RETRY_TOPIC,
                      TRANSACTION, TYPE_NAMES, BadMessage, Code, host_from, set_ts, store_properties, to_pb, ts_ms, validate)
from .pop import DeadLetter, Delivery, TagFilter, now_ms
from .proto import pb, svc, svc_grpc
from .receipts import ReceiptSigner
from .topics import (MAX_GROUP_LEN, MAX_TOPIC_LEN, CreationThrottled, TopicConfig, illegal_name,
                     is_broker_topic, is_system_topic)
from .wire import Undecodable, hard_frame_limit

log = logging.getLogger(__name__)
_REFUSED = object()  # a creation that was throttled or failed (None means "does not exist")

MAX_ACK_ENTRIES = 1024  # entries of one AckMessage request
MAX_SEND_MESSAGES = 1024  # messages of one SendMessage request


def inflate_budget(max_message_size: int) -> int:
    """What the GZIP bodies of one SendMessage may inflate to together: what the request could carry plain."""
    return hard_frame_limit(max_message_size)
# A waiting receive looks again at least this often (seconds), woken or not: bounds the delay of anything
# that becomes receivable without a wake-up.
LONG_POLL_RECHECK = 2.0
# A client whose last Telemetry stream ended and did not open another within this many seconds is gone: its
# auto-renewed receipts are released (the client's own reconnect, e.g. after a network blip, takes less).
STREAM_GRACE = 1.0
PUB, SUB = ("Pub",), ("Sub",)


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the authenticated user ("" with ACL off), client id, namespace and address."""

    user: str
    client_id: str
    namespace: str
    ip: str


def peer_ip(peer: str) -> str:
    """The address of a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    host = rest.rsplit(":", 1)[0]
    return host.strip("[]")

_PUT_CODES = {
    PutMessageStatus.PUT_OK: Code.OK,
    PutMessageStatus.FLUSH_DISK_TIMEOUT: Code.MASTER_PERSISTENCE_TIMEOUT,
    PutMessageStatus.FLUSH_SLAVE_TIMEOUT: Code.SLAVE_PERSISTENCE_TIMEOUT,
    PutMessageStatus.SLAVE_NOT_AVAILABLE: Code.HA_NOT_AVAILABLE,
    PutMessageStatus.SERVICE_NOT_AVAILABLE: Code.INTERNAL_SERVER_ERROR,
    PutMessageStatus.CREATE_MAPPED_FILE_FAILED: Code.INTERNAL_SERVER_ERROR,
    PutMessageStatus.MESSAGE_ILLEGAL: Code.BAD_REQUEST,
    PutMessageStatus.PROPERTIES_SIZE_EXCEEDED: Code.MESSAGE_PROPERTIES_TOO_LARGE,
    PutMessageStatus.OS_PAGE_CACHE_BUSY: Code.TOO_MANY_REQUESTS,
    PutMessageStatus.UNKNOWN_ERROR: Code.INTERNAL_SERVER_ERROR,
}


def _header(context: Any, name: str) -> str:
    for item in context.invocation_metadata() or ():
        if item[0] == name:
            v = item[1]
            return v if isinstance(v, str) else v.decode("latin-1")
    return ""


_CALLER_HEADERS = frozenset(("x-mq-client-id", "x-mq-namespace", "authorization", "x-mq-date-time"))


def _caller_headers(context: Any) -> dict[str, str]:
    """The headers :meth:`MessagingService._caller` reads, from one pass over the call's metadata
    (the first of each name, as :func:`_header` takes)."""
    md = dict(reversed(context.invocation_metadata() or ()))  # (reversed: the first of a name wins)
    out: dict[str, str] = {}
    for k in _CALLER_HEADERS:
        v = md.get(k)
        if v is not None:
            out[k] = v if isinstance(v, str) else v.decode("latin-1")
    return out


_CODE_NAMES = {v: k for k, v in pb.Code.items()}
_OK, _INTERNAL = Code.OK, Code.INTERNAL_SERVER_ERROR  # plain ints: each Code.X is a Python-level lookup


def _set(status: Any, code: int, text: str = "") -> None:
    status.code = code
    status.message = text or _CODE_NAMES.get(code) or pb.Code.Name(code)


def internal_error(status: Any, context: Any, what: str) -> None:
    """INTERNAL_SERVER_ERROR for an unexpected exception (already logged): no Python text goes to the client."""
    rid = _header(context, "x-mq-request-id")[:64]
    _set(status, Code.INTERNAL_SERVER_ERROR,
         f"{what} failed inside the broker; see its log" + (f" (request {rid})" if rid else ""))


def guarded(response_type: Callable[[], Any]) -> Callable:
    """A unary handler: an undecodable request, or an unexpected exception, becomes a body status."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        async def inner(self: "MessagingService", request: Any, context: Any) -> Any:
            if isinstance(request, Undecodable):
                resp = response_type()
                _set(resp.status, request.code, request.why)
                return resp
            try:
                return await fn(self, request, context)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s failed (request %s)", fn.__name__, _header(context, "x-mq-request-id"))
                resp = response_type()
                internal_error(resp.status, context, fn.__name__)
                return resp
        return inner
    return wrap


def make_endpoints(out: Any, host: str, port: int) -> None:
    try:
        ip = ipaddress.ip_address(host)
        out.scheme = pb.AddressScheme.IPv4 if ip.version == 4 else pb.AddressScheme.IPv6
    except ValueError:
        out.scheme = pb.AddressScheme.DOMAIN_NAME
    a = out.addresses.add()
    a.host, a.port = host, port


class MessagingService(svc_grpc.MessagingServiceServicer):
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
        self.dedup = SendDedup(broker.store)
        self._legal_topics: set[str] = set()  # names illegal_name has passed
        self._tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------ helpers
    def _endpoints_for(self, requested: Any, out: Any) -> None:
        if requested is not None and requested.addresses and requested.scheme:
            out.CopyFrom(requested)
        else:
            make_endpoints(out, *self.advertised)

    def _client_id(self, context: Any) -> str:
        return _header(context, "x-mq-client-id").strip()

    def _caller(self, context: Any, status: Any) -> Caller | None:
        """Authenticate the request (with ACL on) and check that its client id is the caller's own."""
        h = _caller_headers(context)
        cid = h.get("x-mq-client-id", "").strip()
        ns = h.get("x-mq-namespace", "").strip()
        why = nsutil.illegal_namespace(ns)
        if why:
            _set(status, Code.BAD_REQUEST, why)
            return None
        ip = peer_ip(context.peer() or "")
        if self.access is None:
            return Caller("", cid, ns, ip)
        try:
            user = self.access.authenticate(h.get("authorization", ""), h.get("x-mq-date-time", ""))
        except AuthenticationError as e:
            log.info("unauthenticated request from %s: %s", ip or "?", e)
            _set(status, Code.UNAUTHORIZED, str(e))
            return None
        owner = self.owners.claim(cid, user) if cid else None
        if owner is not None:
            log.warning("user %s used client id %s of user %s; refused", user, cid, owner)
            _set(status, Code.FORBIDDEN, f"client id {cid} belongs to another user")
            return None
        return Caller(user, cid, ns, ip)

    def _name(self, caller: Caller, res: Any) -> str | None:
        """The stored name of a request's topic or group resource (None: an illegal namespace)."""
        ns = res.resource_namespace or caller.namespace
        if nsutil.illegal_namespace(ns):
            return None
        return nsutil.wrap(ns, res.name)

    def _permit(self, caller: Caller, status: Any, rtype: str, name: str, actions: tuple[str, ...]) -> bool:
        if self.access is None:
            return True
        try:
            self.access.authorize(caller.user, rtype, name, actions, caller.ip)
            return True
        except AuthorizationError as e:
            log.info("refused: %s", e)
            _set(status, Code.FORBIDDEN, str(e))
            return False

    def _resolve(self, caller: Caller, status: Any, res: Any, rtype: str, actions: tuple[str, ...]) -> str | None:
        """A resource's stored name once the caller may act on it; None with ``status`` set otherwise."""
        name = self._name(caller, res)
        if name is None:
            _set(status, Code.BAD_REQUEST, nsutil.illegal_namespace(res.resource_namespace) or "illegal namespace")
            return None
        if not self._permit(caller, status, rtype, name, actions):
            return None
        return name

    async def _topic_for(self, name: str, *, create: bool, status: Any, send: bool = False) -> TopicConfig | None:
        if name not in self._legal_topics:  # (a regular expression per send otherwise)
            why = illegal_name(name, "topic", MAX_TOPIC_LEN)
            if why:
                _set(status, Code.ILLEGAL_TOPIC, why)
                return None
            if len(self._legal_topics) >= 10000:
                self._legal_topics.clear()
            self._legal_topics.add(name)
        if is_system_topic(name):
            _set(status, Code.ILLEGAL_TOPIC, f"{name} is a system topic")
            return None
        if send and is_broker_topic(name):
            _set(status, Code.ILLEGAL_TOPIC, f"{name} is a retry or dead letter topic; only the broker writes it")
            return None
        if create:
            t = await self._create(self.topics.ensure_topic(name), status, "topic", name, self.topics.topics_path)
            if t is _REFUSED:
                return None
        else:
            t = self.topics.get_topic(name)
        if t is None:
            _set(status, Code.TOPIC_NOT_FOUND, f"topic {name} does not exist")
        return t

    @staticmethod
    async def _create(creation: Any, status: Any, kind: str, name: str, path: str) -> Any:
        """Await a topic or group creation; a throttled or failed one sets ``status`` and gives _REFUSED."""
        try:
            return await creation
        except CreationThrottled as e:
            _set(status, Code.TOO_MANY_REQUESTS, str(e))
        except OSError as e:
            log.error("cannot write %s: %s", path, e)
            _set(status, Code.INTERNAL_SERVER_ERROR, f"{kind} {name} could not be created: {e.strerror or e}")
        return _REFUSED

    async def _group_for(self, name: str, status: Any, orderly_hint: bool = False):
        why = illegal_name(name, "group", MAX_GROUP_LEN)
        if why:
            _set(status, Code.ILLEGAL_CONSUMER_GROUP, why)
            return None
        g = await self._create(self.topics.ensure_group(name, orderly_hint), status, "group", name,
                               self.topics.groups_path)
        if g is _REFUSED:
            return None
        if g is None:
            _set(status, Code.CONSUMER_GROUP_NOT_FOUND, f"consumer group {name} does not exist")
        elif not g.consume_enable:
            _set(status, Code.FORBIDDEN, f"consumer group {name} may not consume")
            return None
        return g

    def _fill_queue(self, mq: Any, t: TopicConfig, qid: int, topic: Any, endpoints: Any) -> None:
        mq.topic.CopyFrom(topic)  # the name the client asked for, not the stored (namespaced) one
        mq.id = qid
        r = t.readable and (qid < 0 or qid < t.read_queue_nums)
        w = t.writable and (qid < 0 or qid < t.write_queue_nums)
        mq.permission = (pb.Permission.READ_WRITE if r and w else pb.Permission.READ if r
                         else pb.Permission.WRITE if w else pb.Permission.NONE)
        mq.broker.name = self.cfg.brokerName
        mq.broker.id = 0
        self._endpoints_for(endpoints, mq.broker.endpoints)

    # ------------------------------------------------------------ route, liveness, settings
    @guarded(svc.QueryRouteResponse)
    async def QueryRoute(self, request: Any, context: Any) -> Any:
        resp = svc.QueryRouteResponse()
        caller = self._caller(context, resp.status)
        name = caller and self._resolve(caller, resp.status, request.topic, "Topic", PUB + SUB)
        if name is None:
            return resp
        t = await self._topic_for(name, create=True, status=resp.status)
        if t is None:
            return resp
        for qid in range(t.queue_count):
            mq = resp.message_queues.add()
            self._fill_queue(mq, t, qid, request.topic, request.endpoints)
            mq.accept_message_types.extend(getattr(pb.MessageType, n) for n in t.accepts())
        _set(resp.status, Code.OK)
        return resp

    @guarded(svc.HeartbeatResponse)
    async def Heartbeat(self, request: Any, context: Any) -> Any:
        resp = svc.HeartbeatResponse()
        caller = self._caller(context, resp.status)
        if caller is None:
            return resp
        cid = caller.client_id
        if not cid:
            _set(resp.status, Code.CLIENT_ID_REQUIRED, "x-mq-client-id is missing")
            return resp
        group = None
        if request.HasField("group") and request.group.name:
            group = self._resolve(caller, resp.status, request.group, "Group", SUB)
            if group is None:
                return resp
            # Only check the name: the group is created by settings or a receive, which know its topics.
            why = illegal_name(group, "group", MAX_GROUP_LEN)
            if why:
                _set(resp.status, Code.ILLEGAL_CONSUMER_GROUP, why)
                return resp
        if request.client_type not in pb.ClientType.values():
            _set(resp.status, Code.UNRECOGNIZED_CLIENT_TYPE, f"unknown client type {request.client_type}")
            return resp
        c = self.broker.clients.touch(cid)
        c.user, c.namespace = caller.user, caller.namespace
        if request.client_type:
            c.client_type = request.client_type
        if group:
            c.group = group
        _set(resp.status, Code.OK)
        return resp

    async def _settings_reply(self, caller: Caller, cmd: Any) -> Any:
        s = cmd.settings
        reply = svc.TelemetryCommand()
        if s.client_type not in pb.ClientType.values():
            _set(reply.status, Code.UNRECOGNIZED_CLIENT_TYPE, f"unknown client type {s.client_type}")
            return reply
        if s.HasField("publishing"):
            topics = [self._resolve(caller, reply.status, r, "Topic", PUB) for r in s.publishing.topics]
            if None in topics:
                return reply
        elif s.HasField("subscription"):
            group = self._resolve(caller, reply.status, s.subscription.group, "Group", SUB)
            subs = {}
            for e in s.subscription.subscriptions:
                name = group and self._resolve(caller, reply.status, e.topic, "Topic", SUB)
                if name is None:
                    return reply
                subs[name] = (e.expression.type, e.expression.expression)
            if group is None:
                return reply
        c = self.broker.clients.touch(caller.client_id)
        c.user, c.namespace = caller.user, caller.namespace
        if s.HasField("client_type"):
            c.client_type = s.client_type
        c.language = pb.Language.Name(s.user_agent.language) if s.user_agent.language in pb.Language.values() else ""
        c.version = s.user_agent.version
        out = reply.settings
        out.CopyFrom(s)
        if s.HasField("publishing"):
            c.publishing = set(topics)
            out.publishing.max_body_size = self.broker.store.config.maxMessageSize
            out.publishing.validate_message_type = True
            bp = out.backoff_policy
            bp.max_attempts = 3
            bp.exponential_backoff.initial.nanos = 10_000_000
            bp.exponential_backoff.max.seconds = 1
            bp.exponential_backoff.multiplier = 2
        elif s.HasField("subscription"):
            sub = s.subscription
            c.subscriptions = subs
            fifo_topics = any((t := self.topics.topics.get(name)) is not None and t.message_type == "FIFO"
                              for name in c.subscriptions)
            g = await self._group_for(group, reply.status, fifo_topics)
            if g is None:
                return reply
            c.group = group
            out.subscription.fifo = g.orderly
            out.subscription.receive_batch_size = self.cfg.maxReceiveBatchSize
            if s.client_type == pb.ClientType.PUSH_CONSUMER or not sub.HasField("long_polling_timeout") \
                    or sub.long_polling_timeout.seconds <= 0:
                out.subscription.long_polling_timeout.seconds = max(1, self.cfg.longPollingTimeout // 1000)
            bp = out.backoff_policy
            bp.max_attempts = g.max_attempts
            for sec in self.cfg.delay_levels_seconds():
                bp.customized_backoff.next.add().seconds = sec
        else:
            _set(reply.status, Code.BAD_REQUEST, "settings carry neither publishing nor subscription")
            return reply
        out.metric.on = False
        _set(reply.status, Code.OK)
        return reply

    async def Telemetry(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        from .clients import TelemetryStream
        reply = svc.TelemetryCommand()
        caller = self._caller(context, reply.status)
        if caller is not None and not caller.client_id:
            _set(reply.status, Code.CLIENT_ID_REQUIRED, "x-mq-client-id is missing")
        if caller is None or not caller.client_id:
            yield reply
            return
        cid = caller.client_id
        stream = TelemetryStream(cid)
        clients = self.broker.clients
        clients.add_stream(cid, stream)

        async def read() -> None:
            try:
                async for cmd in request_iterator:
                    clients.touch(cid)
                    if isinstance(cmd, Undecodable):
                        bad = svc.TelemetryCommand()
                        _set(bad.status, cmd.code, cmd.why)
                        stream.send(bad)
                    elif cmd.HasField("settings"):
                        stream.send(await self._settings_reply(caller, cmd))
                    # thread_stack_trace / verify_message_result replies need no answer
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the client went away, or sent garbage
                log.debug("telemetry stream of %s ended: %s", cid, e)
            finally:
                stream.close()

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while True:
                item = await stream.queue.get()
                if item is None:
                    break
                yield item
        finally:
            reader.cancel()
            if clients.remove_stream(cid, stream):
                # Its last stream broke (a push consumer killed): unless it reconnects within a second, the
                # receipts it renewed go back then, not after clientExpireTime.
                asyncio.get_running_loop().call_later(STREAM_GRACE, self._stream_gone, cid)

    def _stream_gone(self, cid: str) -> None:
        if not self.broker.clients.has_stream(cid):
            n = self.broker.pop.release_client(cid)
            if n:
                log.info("client %s lost its Telemetry stream; %d in-flight messages released", cid, n)

    @guarded(svc.NotifyClientTerminationResponse)
    async def NotifyClientTermination(self, request: Any, context: Any) -> Any:
        resp = svc.NotifyClientTerminationResponse()
        caller = self._caller(context, resp.status)
        if caller is None:
            return resp
        cid = caller.client_id
        if cid:
            n = self.broker.pop.release_client(cid)
            self.broker.clients.remove(cid)
            log.debug("client %s terminated; %d messages released", cid, n)
        _set(resp.status, Code.OK)
        return resp

    # ------------------------------------------------------------ producing
    @guarded(svc.SendMessageResponse)
    async def SendMessage(self, request: Any, context: Any) -> Any:
        resp = svc.SendMessageResponse()
        caller = self._caller(context, resp.status)
        if caller is None:
            return resp
        if not caller.client_id:
            _set(resp.status, Code.CLIENT_ID_REQUIRED, "x-mq-client-id is missing")
            return resp
        if not request.messages:
            _set(resp.status, Code.BAD_REQUEST, "no message to send")
            return resp
        if len(request.messages) > MAX_SEND_MESSAGES:
            _set(resp.status, Code.BAD_REQUEST, f"more than {MAX_SEND_MESSAGES} messages in one request")
            return resp
        peer = context.peer() or ""
        max_body = self.broker.store.config.maxMessageSize
        budget = [inflate_budget(max_body)]  # what the request's GZIP bodies may inflate to, together
        for m in request.messages:
            entry = resp.entries.add()
            await self._send_one(caller, m, entry, peer, budget)
        if len(resp.entries) == 1 or len({e.status.code for e in resp.entries}) == 1:
            resp.status.CopyFrom(resp.entries[0].status)
        else:
            _set(resp.status, Code.MULTIPLE_RESULTS, "entries have different results")
        return resp

    async def _send_one(self, caller: Caller, m: Any, entry: Any, peer: str, budget: list[int]) -> None:
        sp = m.system_properties
        entry.message_id = sp.message_id
        name = self._resolve(caller, entry.status, m.topic, "Topic", PUB)
        if name is None:
            return
        t = await self._topic_for(name, create=True, status=entry.status, send=True)
        if t is None:
            return
        if not t.writable or t.write_queue_nums <= 0:
            _set(entry.status, Code.FORBIDDEN, f"topic {t.name} is not writable")
            return
        max_body = self.broker.store.config.maxMessageSize
        try:
            mtype, body = validate(m, max_body, budget[0])
        except BadMessage as e:
            if sp.body_encoding == GZIP:  # refused, but the inflating was done: it counts
                budget[0] -= min(max_body, max(0, budget[0])) + 1
            _set(entry.status, e.code, str(e))
            return
        if sp.body_encoding == GZIP:
            budget[0] -= len(body)
        tname = TYPE_NAMES[mtype]
        if tname not in t.accepts():
            _set(entry.status, Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE,
                 f"topic {t.name} accepts {'/'.join(t.accepts())} messages, not {tname}")
            return
        now = now_ms()
        deliver_at = ts_ms(sp.delivery_timestamp) if mtype == DELAY else 0
        if deliver_at and deliver_at > now + self.cfg.maxDelayTime:
            _set(entry.status, Code.ILLEGAL_DELIVERY_TIME,
                 f"delivery time is more than {self.cfg.maxDelayTime} ms ahead")
            return
        body_digest = digest(body)
        seen = self.dedup.recent(t.name, sp.message_id, body_digest)
        if seen is None and mtype != TRANSACTION and self.dedup.needs_lookup(t.name, sp.message_id):
            off = await asyncio.get_running_loop().run_in_executor(self.broker.executor, self.dedup.stored,
                                                                   t.name, sp.message_id, body)
            seen = None if off is None else (off, "")
        if seen is not None:  # a client resend of a message already stored
            entry.offset, entry.transaction_id = seen
            _set(entry.status, Code.OK)
            return
        if mtype == FIFO:
            qid = zlib.crc32(sp.message_group.encode("utf-8")) % t.write_queue_nums
        else:
            rr = self._rr.get(t.name)
            if rr is None:
                rr = self._rr[t.name] = itertools.count()
            qid = next(rr) % t.write_queue_nums
        born = ts_ms(sp.born_timestamp) if sp.HasField("born_timestamp") and sp.born_timestamp.seconds else now
        msg = Message(topic=t.name, body=body, queue_id=qid, properties=store_properties(m, mtype),
                      born_timestamp=born, born_host=host_from(sp.born_host, peer),
                      store_host=self.broker.store_host)
        txid = ""
        if mtype == TRANSACTION:
            res, txid = await self.broker.transactions.submit(msg)
        elif deliver_at > now:
            res = await self.broker.timer.submit(msg, deliver_at)
        else:
            res = await self.broker.put(msg)
            if res.ok:
                self.broker.notify(t.name, qid, sp.tag if sp.HasField("tag") else None)
        code = _PUT_CODES.get(res.status, _INTERNAL)
        if res.status is PutMessageStatus.MESSAGE_ILLEGAL and res.error and "maxMessageSize" in res.error:
            code = Code.MESSAGE_BODY_TOO_LARGE
        if code != _OK:
            _set(entry.status, code, f"{res.status.value}: {res.error or ''}".strip(": "))
            log.warning("send to %s failed: %s %s", t.name, res.status.value, res.error or "")
            return
        entry.offset = res.queue_offset if res.queue_offset >= 0 else 0
        entry.transaction_id = txid
        self.dedup.remember(t.name, sp.message_id, entry.offset, txid, body_digest)
        _set(entry.status, _OK)

    @guarded(svc.EndTransactionResponse)
    async def EndTransaction(self, request: Any, context: Any) -> Any:
        resp = svc.EndTransactionResponse()
        caller = self._caller(context, resp.status)
        topic = caller and self._resolve(caller, resp.status, request.topic, "Topic", PUB)
        if topic is None:
            return resp
        if request.resolution not in pb.TransactionResolution.values() \
                or request.source not in pb.TransactionSource.values():
            _set(resp.status, Code.BAD_REQUEST, f"unknown transaction resolution {request.resolution} "
                                                f"or source {request.source}")
            return resp
        code, text = await self.broker.transactions.end(topic, request.message_id,
                                                        request.transaction_id, request.resolution, request.source)
        _set(resp.status, code, text)
        return resp

    @guarded(svc.RecallMessageResponse)
    async def RecallMessage(self, request: Any, context: Any) -> Any:
        resp = svc.RecallMessageResponse()
        _set(resp.status, Code.UNSUPPORTED, "recalling delay messages is not supported")
        return resp

    # ------------------------------------------------------------ consuming
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
            _set(resp.status, Code.FORBIDDEN, f"topic {t.name} is not readable")
            return resp
        for qid in (range(t.read_queue_nums) if g.orderly else (-1,)):
            a = resp.assignments.add()
            self._fill_queue(a.message_queue, t, qid, request.topic, request.endpoints)
        _set(resp.status, Code.OK)
        return resp

    async def ReceiveMessage(self, request: Any, context: Any) -> AsyncIterator[Any]:
        started = time.monotonic()
        first = svc.ReceiveMessageResponse()
        try:
            if isinstance(request, Undecodable):
                _set(first.status, request.code, request.why)
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
                    deliveries, dead = pop.receive(group, t.name, qids, batch, inv, flt, fifo=fifo,
                                                   max_attempts=attempts, client=cid, auto_renew=auto_renew)
                    for d in dead:
                        self._background(self._dead_letter(d))
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
                    _set(first.status, Code.OK)
                elif polling_full:
                    _set(first.status, Code.TOO_MANY_REQUESTS,
                         f"{self.cfg.maxPopPollingSize} receives are already waiting (maxPopPollingSize)")
                else:
                    _set(first.status, Code.MESSAGE_NOT_FOUND, "no new message")
            except CorruptRecordError as e:  # the next message is damaged: say so, deliver nothing in its place
                replies = []
                _set(first.status, Code.MESSAGE_CORRUPTED, str(e)[:500])
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
            _set(status, Code.CLIENT_ID_REQUIRED, "x-mq-client-id is missing")
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
            _set(status, Code.FORBIDDEN, f"topic {t.name} is not readable")
            return None
        fe = request.filter_expression
        if fe.type not in pb.FilterType.values():
            _set(status, Code.ILLEGAL_FILTER_EXPRESSION, f"unknown filter type {fe.type}")
            return None
        if fe.type == pb.FilterType.SQL:
            _set(status, Code.ILLEGAL_FILTER_EXPRESSION, "SQL92 filters are not supported; use a TAG expression")
            return None
        flt = TagFilter(fe.expression)
        if request.batch_size <= 0:
            _set(status, Code.BAD_REQUEST, "batch_size must be positive")
            return None
        batch = min(request.batch_size, self.cfg.maxReceiveBatchSize)
        auto_renew = bool(request.auto_renew)
        if request.HasField("invisible_duration"):
            d = request.invisible_duration
            inv = d.seconds * 1000 + d.nanos // 1_000_000
            if not self.cfg.minInvisibleTime <= inv <= self.cfg.maxInvisibleTime:
                _set(status, Code.ILLEGAL_INVISIBLE_TIME,
                     f"invisible duration must be within [{self.cfg.minInvisibleTime}, "
                     f"{self.cfg.maxInvisibleTime}] ms")
                return None
        else:
            inv = self.cfg.popAutoRenewInvisibleTime
        if request.HasField("long_polling_timeout"):
            d = request.long_polling_timeout
            poll = (d.seconds * 1000 + d.nanos // 1_000_000) / 1000
            if poll < 0:
                _set(status, Code.ILLEGAL_POLLING_TIME, "long polling timeout must not be negative")
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

    async def _dead_letter(self, d: DeadLetter) -> bool:
        pop = self.broker.pop
        try:
            m = self.broker.store.look(d.entry.phy)
        except Exception as e:
            log.error("message at %d for %s unreadable (%s); dropped instead of dead-lettered", d.entry.phy,
                      d.group, e)
            pop.finish_dlq(d, True)
            return True
        try:
            dlq = await self.topics.ensure_dlq_topic(d.group)
        except OSError as e:
            log.error("cannot create the dead letter topic of %s: %s", d.group, e)
            pop.finish_dlq(d, False)
            return False
        props = dict(m.properties)
        uniq = props.get("UNIQ_KEY") or m.msg_id
        props.setdefault(P_DLQ_TOPIC, d.topic)
        props.setdefault(P_DLQ_MSG_ID, uniq)
        props.setdefault(P_ORIGIN_MSG_ID, uniq)
        props[P_RETRY_TOPIC] = d.topic
        props[P_RECONSUME] = str(d.entry.attempts)
        msg = Message(topic=dlq.name, body=m.body or b"", queue_id=0, properties=props, flag=m.flag,
                      sys_flag=m.sys_flag & ~0xC, born_timestamp=m.born_timestamp,
                      born_host=(m.born_addr, m.born_port), store_host=self.broker.store_host,
                      reconsume_times=d.entry.attempts)
        res = await self.broker.put(msg)
        pop.finish_dlq(d, res.ok)
        if res.ok:
            log.info("message %s of %s moved to %s after %d deliveries", uniq, d.topic, dlq.name, d.entry.attempts)
            self.broker.notify(dlq.name)
        else:
            log.error("moving message %s to %s failed: %s", uniq, dlq.name, res.status.value)
        return res.ok

    def _ack_target(self, request: Any, context: Any, status: Any) -> tuple[str, str] | None:
        caller = self._caller(context, status)
        group = caller and self._resolve(caller, status, request.group, "Group", SUB)
        topic = group and self._resolve(caller, status, request.topic, "Topic", SUB)
        if topic is None:
            return None
        why = illegal_name(group, "group", MAX_GROUP_LEN)
        if why:
            _set(status, Code.ILLEGAL_CONSUMER_GROUP, why)
            return None
        why = illegal_name(topic, "topic", MAX_TOPIC_LEN)
        if why:
            _set(status, Code.ILLEGAL_TOPIC, why)
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
            _set(resp.status, Code.BAD_REQUEST, "no entry to ack")
            return resp
        if len(request.entries) > MAX_ACK_ENTRIES:
            _set(resp.status, Code.BAD_REQUEST,
                 f"{len(request.entries)} entries in one ack; at most {MAX_ACK_ENTRIES}")
            return resp
        group, topic = target
        for e in request.entries:
            r = resp.entries.add()
            r.message_id, r.receipt_handle = e.message_id, e.receipt_handle
            if self.broker.pop.ack(group, topic, self._pop_handle(target, e.receipt_handle)):
                _set(r.status, Code.OK)
            else:
                _set(r.status, Code.INVALID_RECEIPT_HANDLE, "receipt handle is unknown, expired or superseded")
        if self.cfg.popAckSyncFlush and not await self.broker.persist(final=True):
            for r in resp.entries:  # applied, but a crash now would deliver them again
                if r.status.code == Code.OK:
                    _set(r.status, Code.MASTER_PERSISTENCE_TIMEOUT, "acked, but writing the consumer state failed "
                                                                    "(see the broker log)")
        codes = {r.status.code for r in resp.entries}
        if len(codes) == 1:
            resp.status.CopyFrom(resp.entries[0].status)
        else:
            _set(resp.status, Code.MULTIPLE_RESULTS, "entries have different results")
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
            _set(resp.status, Code.ILLEGAL_INVISIBLE_TIME,
                 f"invisible duration must be within [0, {self.cfg.maxInvisibleTime}] ms")
            return resp
        handle = self.broker.pop.change_invisible(*target, self._pop_handle(target, request.receipt_handle), inv,
                                                  bool(request.HasField("suspend") and request.suspend))
        if handle is None:
            _set(resp.status, Code.INVALID_RECEIPT_HANDLE, "receipt handle is unknown, expired or superseded")
            return resp
        resp.receipt_handle = self.receipts.seal(*target, handle)
        _set(resp.status, Code.OK)
        return resp

    @guarded(svc.ForwardMessageToDeadLetterQueueResponse)
    async def ForwardMessageToDeadLetterQueue(self, request: Any, context: Any) -> Any:
        resp = svc.ForwardMessageToDeadLetterQueueResponse()
        target = self._ack_target(request, context, resp.status)
        if target is None:
            return resp
        d = self.broker.pop.take_for_dlq(*target, self._pop_handle(target, request.receipt_handle))
        if d is None:
            _set(resp.status, Code.INVALID_RECEIPT_HANDLE, "receipt handle is unknown, expired or superseded")
            return resp
        if await self._dead_letter(d):
            _set(resp.status, Code.OK)
        else:
            _set(resp.status, Code.INTERNAL_SERVER_ERROR, "could not write to the dead letter queue")
        return resp

    # ------------------------------------------------------------ not offered
    async def _unsupported(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not supported by rocketstore")

    PullMessage = UpdateOffset = GetOffset = QueryOffset = SyncLiteSubscription = _unsupported
