"""Who is calling and may they: the caller's identity, ACL checks, names in the caller's namespace, the topics and
groups a call looks up or creates, and the helpers every RPC shares (status codes, the guard)."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
from typing import Any, Callable, NamedTuple

from ..format.message import PutMessageStatus
from . import namespace as nsutil
from .acl import AuthenticationError, AuthorizationError
from .convert import Code
from .proto import pb
from .topics import (MAX_GROUP_LEN, MAX_TOPIC_LEN, CreationThrottled, TopicConfig, illegal_name,
                     is_broker_topic, is_system_topic)
from .wire import Undecodable, hard_frame_limit

log = logging.getLogger(__name__)
REFUSED = object()  # a creation that was throttled or failed (None means "does not exist")

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


class Caller(NamedTuple):
    """Who sent a request: the authenticated user ("" with ACL off), client id, namespace and address.

    A named tuple rather than a frozen dataclass: one is built for every request, and a frozen dataclass's
    ``__init__`` sets each field through ``object.__setattr__``.  ``peer`` is gRPC's peer string
    (``ipv4:1.2.3.4:5``), read once per request.
    """

    user: str
    client_id: str
    namespace: str
    ip: str
    peer: str = ""


def peer_ip(peer: str) -> str:
    """The address of a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    host = rest.rsplit(":", 1)[0]
    return host.strip("[]")

PUT_CODES = {
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


class _HandOver:
    """One value handed from admission to the handler of one call: only that call's handler takes it, once."""

    __slots__ = ("context", "value")

    def __init__(self) -> None:
        self.context: Any = None
        self.value: Any = None

    def give(self, context: Any, value: Any) -> None:
        self.context, self.value = (None, None) if value is None else (context, value)

    def take(self, context: Any) -> Any:
        """The value handed over for this very context (then forgotten), else None."""
        if self.context is not context:
            return None
        value, self.context, self.value = self.value, None, None
        return value


_handed = _HandOver()  # the call's metadata: see hand_metadata
_handed_peer = _HandOver()  # the call's peer string: see call_peer


def hand_metadata(context: Any, metadata: Any, peer: str | None = None) -> None:
    """Give the handler about to start for ``context`` the metadata gRPC built for the call's handler lookup
    (:class:`~rocketstore.broker.admission.Admission` saw it there): ``context.invocation_metadata()`` builds
    it again, a named tuple per header, ~17 us for the official client's nine.  The handler takes it with
    :func:`call_metadata` before its first await; None (not known) makes that ask the context.  ``peer``:
    the call's ``context.peer()`` when admission read it already (each read asks gRPC's core for a copy)."""
    _handed.give(context, metadata)
    _handed_peer.give(context, peer)


def call_metadata(context: Any) -> Any:
    """The call's metadata: the one handed over for this very context, else the context's own."""
    md = _handed.take(context)
    return md if md is not None else (context.invocation_metadata() or ())


def call_peer(context: Any) -> str:
    """The call's gRPC peer string: the one handed over for this very context, else the context's own."""
    peer = _handed_peer.take(context)
    return peer if peer is not None else (context.peer() or "")


def header(context: Any, name: str) -> str:
    for item in context.invocation_metadata() or ():
        if item[0] == name:
            v = item[1]
            return v if isinstance(v, str) else v.decode("latin-1")
    return ""


def caller_headers(context: Any) -> dict[str, str]:
    """The headers :meth:`MessagingService._caller` reads (client id, namespace, authorization, date), the
    first of each name as :func:`header` takes it: one dict built in C from the metadata reversed (a later
    duplicate is overwritten by an earlier one), instead of a Python loop over every header."""
    md = call_metadata(context)
    return dict(md[::-1]) if type(md) is tuple else dict(reversed(list(md)))


def _text(v: Any) -> str:
    """A metadata value as text (gRPC gives bytes only for ``-bin`` keys, which these are not)."""
    return v if type(v) is str else v.decode("latin-1")


_CODE_NAMES = {v: k for k, v in pb.Code.items()}
OK_CODE, INTERNAL_CODE = Code.OK, Code.INTERNAL_SERVER_ERROR  # plain ints: each Code.X is a Python-level lookup
OK_TEXT = _CODE_NAMES[OK_CODE]  # what set_status(status, OK_CODE) writes


def set_status(status: Any, code: int, text: str = "") -> None:
    status.code = code
    status.message = text or _CODE_NAMES.get(code) or pb.Code.Name(code)


def internal_error(status: Any, context: Any, what: str) -> None:
    """INTERNAL_SERVER_ERROR for an unexpected exception (already logged): no Python text goes to the client."""
    rid = header(context, "x-mq-request-id")[:64]
    set_status(status, Code.INTERNAL_SERVER_ERROR,
         f"{what} failed inside the broker; see its log" + (f" (request {rid})" if rid else ""))


def guarded(response_type: Callable[[], Any]) -> Callable:
    """A unary handler: an undecodable request, or an unexpected exception, becomes a body status."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        async def inner(self: Any, request: Any, context: Any) -> Any:
            if isinstance(request, Undecodable):
                resp = response_type()
                set_status(resp.status, request.code, request.why)
                return resp
            try:
                return await fn(self, request, context)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s failed (request %s)", fn.__name__, header(context, "x-mq-request-id"))
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

class Calls:
    """The caller / ACL / names part of :class:`~rocketstore.broker.service.MessagingService`."""

    def _endpoints_for(self, requested: Any, out: Any) -> None:
        if requested is not None and requested.addresses and requested.scheme:
            out.CopyFrom(requested)
        else:
            make_endpoints(out, *self.advertised)

    def _client_id(self, context: Any) -> str:
        return header(context, "x-mq-client-id").strip()

    def _caller(self, context: Any, status: Any) -> Caller | None:
        """Authenticate the request (with ACL on) and check that its client id is the caller's own."""
        h = caller_headers(context)
        peer = call_peer(context)
        if self.access is None:
            # The same few callers send again and again: their Caller is kept (a pure function of the three
            # header values and the peer), found before the values are checked and stripped.
            key = (h.get("x-mq-client-id", ""), h.get("x-mq-namespace", ""), peer)
            c = self._callers.get(key)
            if c is not None:
                return c
        cid = _text(h.get("x-mq-client-id", "")).strip()
        ns = _text(h.get("x-mq-namespace", "")).strip()
        why = nsutil.illegal_namespace(ns)
        if why:
            set_status(status, Code.BAD_REQUEST, why)
            return None
        if self.access is None:
            if len(self._callers) >= 4096:
                self._callers.clear()
            c = self._callers[key] = Caller("", cid, ns, peer_ip(peer), peer)
            return c
        ip = peer_ip(peer)
        try:
            user = self.access.authenticate(_text(h.get("authorization", "")), _text(h.get("x-mq-date-time", "")))
        except AuthenticationError as e:
            log.info("unauthenticated request from %s: %s", ip or "?", e)
            set_status(status, Code.UNAUTHORIZED, str(e))
            self.broker.metrics.refused("unauthenticated")
            return None
        owner = self.owners.claim(cid, user) if cid else None
        if owner is not None:
            log.warning("user %s used client id %s of user %s; refused", user, cid, owner)
            set_status(status, Code.FORBIDDEN, f"client id {cid} belongs to another user")
            self.broker.metrics.refused("forbidden")
            return None
        return Caller(user, cid, ns, ip, peer)

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
            set_status(status, Code.FORBIDDEN, str(e))
            self.broker.metrics.refused("forbidden")
            return False

    def _resolve(self, caller: Caller, status: Any, res: Any, rtype: str, actions: tuple[str, ...]) -> str | None:
        """A resource's stored name once the caller may act on it; None with ``status`` set otherwise."""
        name = self._name(caller, res)
        if name is None:
            set_status(status, Code.BAD_REQUEST, nsutil.illegal_namespace(res.resource_namespace) or "illegal namespace")
            return None
        if self.access is not None and not self._permit(caller, status, rtype, name, actions):
            return None
        return name

    async def _topic_for(self, name: str, *, create: bool, status: Any, send: bool = False) -> TopicConfig | None:
        if name not in self._legal_topics:  # (a regular expression per send otherwise)
            why = illegal_name(name, "topic", MAX_TOPIC_LEN)
            if why:
                set_status(status, Code.ILLEGAL_TOPIC, why)
                return None
            if is_system_topic(name):
                set_status(status, Code.ILLEGAL_TOPIC, f"{name} is a system topic")
                return None
            if len(self._legal_topics) >= 10000:
                self._legal_topics.clear()
            self._legal_topics.add(name)
        if send and is_broker_topic(name):
            set_status(status, Code.ILLEGAL_TOPIC, f"{name} is a retry or dead letter topic; only the broker writes it")
            return None
        if create:
            t = self.topics.ready_topic(name)
            if t is None:
                t = await self._create(self.topics.ensure_topic(name), status, "topic", name, self.topics.topics_path)
                if t is REFUSED:
                    return None
        else:
            t = self.topics.get_topic(name)
        if t is None:
            set_status(status, Code.TOPIC_NOT_FOUND, f"topic {name} does not exist")
        return t

    @staticmethod
    async def _create(creation: Any, status: Any, kind: str, name: str, path: str) -> Any:
        """Await a topic or group creation; a throttled or failed one sets ``status`` and gives REFUSED."""
        try:
            return await creation
        except CreationThrottled as e:
            set_status(status, Code.TOO_MANY_REQUESTS, str(e))
        except OSError as e:
            log.error("cannot write %s: %s", path, e)
            set_status(status, Code.INTERNAL_SERVER_ERROR, f"{kind} {name} could not be created: {e.strerror or e}")
        return REFUSED

    async def _group_for(self, name: str, status: Any, orderly_hint: bool = False):
        why = illegal_name(name, "group", MAX_GROUP_LEN)
        if why:
            set_status(status, Code.ILLEGAL_CONSUMER_GROUP, why)
            return None
        g = await self._create(self.topics.ensure_group(name, orderly_hint), status, "group", name,
                               self.topics.groups_path)
        if g is REFUSED:
            return None
        if g is None:
            set_status(status, Code.CONSUMER_GROUP_NOT_FOUND, f"consumer group {name} does not exist")
        elif not g.consume_enable:
            set_status(status, Code.FORBIDDEN, f"consumer group {name} may not consume")
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
