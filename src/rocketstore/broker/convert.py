"""Between gRPC ``apache.rocketmq.v2.Message`` and stored records, the way RocketMQ's proxy maps them.

System properties become RocketMQ message properties: tag -> ``TAGS``, keys ->
``KEYS`` (space separated), message_id -> ``UNIQ_KEY``, message_group ->
``__SHARDINGKEY``, delivery_timestamp -> ``TIMER_DELIVER_MS``, a transaction ->
``TRAN_MSG``.  User properties are stored as they are; their names may not be
one of RocketMQ's reserved property names.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import re
import zlib
from typing import Mapping

from ..format import codec
from ..format.codec import MessageExt
from ..queues.dlq import P_DLQ_MSG_ID, P_DLQ_TOPIC
from .proto import pb

Code = pb.Code

P_TAGS = "TAGS"
P_KEYS = "KEYS"
P_UNIQ = "UNIQ_KEY"
P_SHARDING = "__SHARDINGKEY"
P_TIMER_DELIVER = "TIMER_DELIVER_MS"
P_TRAN = "TRAN_MSG"
P_PGROUP = "PGROUP"
P_REAL_TOPIC = "REAL_TOPIC"
P_REAL_QID = "REAL_QID"
P_TRACE = "TRACE_CONTEXT"
P_CHECK_IMMUNITY = "CHECK_IMMUNITY_TIME_IN_SECONDS"
P_MAX_RECONSUME = "MAX_RECONSUME_TIMES"
P_STARTDELIVER = "__STARTDELIVERTIME"
P_TIMER_DELAY_SEC = "TIMER_DELAY_SEC"
P_DELAY = "DELAY"

# RocketMQ's MessageConst.STRING_HASH_SET (the names a user property may not take), plus 5.x additions.
RESERVED = frozenset("""
TRACE_ON MSG_REGION KEYS TAGS WAIT DELAY RETRY_TOPIC REAL_TOPIC REAL_QID TRAN_MSG PGROUP MIN_OFFSET
MAX_OFFSET BUYER_ID ORIGIN_MESSAGE_ID TRANSFER_FLAG CORRECTION_FLAG MQ2_FLAG RECONSUME_TIME UNIQ_KEY
MAX_RECONSUME_TIMES CONSUME_START_TIME POP_CK POP_CK_OFFSET 1ST_POP_TIME TRAN_PREPARED_QUEUE_OFFSET DUP_INFO
EXTEND_UNIQ_INFO INSTANCE_ID CORRELATION_ID REPLY_TO_CLIENT TTL ARRIVE_TIME PUSH_REPLY_TIME CLUSTER MSG_TYPE
__SHARDINGKEY __STARTDELIVERTIME TIMER_DELAY_SEC TIMER_DELIVER_MS TIMER_ENQUEUE_MS TIMER_DEQUEUE_MS
TIMER_ROLL_TIMES TIMER_OUT_MS TIMER_DEL_UNIQKEY TIMER_DELAY_LEVEL CHECK_IMMUNITY_TIME_IN_SECONDS
TRANSACTION_CHECK_TIMES INNER_MULTI_DISPATCH INNER_MULTI_QUEUE_OFFSET TRACE_CONTEXT DLQ_ORIGIN_TOPIC
DLQ_ORIGIN_MESSAGE_ID INNER_NUM INNER_BASE BORN_HOST BORN_TIMESTAMP
""".split())

COMPRESSION_TYPE = 0x7 << 8  # sysFlag bits 8-10: the compression of a compressed body (0: zlib, older records)
COMPRESSION_ZLIB = 0x3 << 8

MT = pb.MessageType
TYPE_NAMES = {MT.NORMAL: "NORMAL", MT.FIFO: "FIFO", MT.DELAY: "DELAY", MT.TRANSACTION: "TRANSACTION"}
# The enum values as plain ints: each ``pb.X.Y`` is a Python-level __getattr__ call, on the path of every send.
NORMAL, FIFO, DELAY, TRANSACTION = MT.NORMAL, MT.FIFO, MT.DELAY, MT.TRANSACTION
UNSPECIFIED = MT.MESSAGE_TYPE_UNSPECIFIED
GZIP = pb.Encoding.GZIP
PLAIN_ENCODINGS = (pb.Encoding.IDENTITY, pb.Encoding.ENCODING_UNSPECIFIED)


class BadMessage(Exception):
    """A message the broker refuses: carries the RocketMQ status code."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(text)
        self.code = code


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _has_control(s: str) -> bool:
    """Whether ``s`` holds an ASCII control character (U+0000-U+001F, U+007F).

    An ASCII string has one exactly when it is not printable (``str.isprintable`` is C-speed, about a third
    of a regular expression search); other strings are searched.
    """
    if s.isascii():
        return not s.isprintable()
    return _CONTROL.search(s) is not None


def ts_ms(ts) -> int:
    """A google.protobuf.Timestamp as epoch milliseconds."""
    return ts.seconds * 1000 + ts.nanos // 1_000_000


def stored_ms(ts) -> tuple[int, str | None]:
    """A Timestamp as epoch milliseconds, and why it cannot be a stored time (before 1970, nanos out of range,
    past int64 milliseconds) or None; each field read once (a read is a call into protobuf)."""
    seconds, nanos = ts.seconds, ts.nanos
    if not 0 <= nanos < 1_000_000_000:
        return 0, f"has nanos {nanos} outside 0..999999999"
    if seconds < 0:
        return 0, f"is before 1970 ({seconds} s)"
    ms = seconds * 1000 + nanos // 1_000_000
    if ms >= 1 << 63:
        return 0, f"is out of range ({seconds} s)"
    return ms, None


def set_ts(ts, ms: int) -> None:
    ts.seconds, ts.nanos = divmod(ms, 1000)
    ts.nanos *= 1_000_000


def inflate(data: bytes, limit: int) -> bytes:
    """A GZIP-encoded body (gzip members, or a zlib stream) decompressed, never to more than ``limit`` bytes.

    Decompression stops one byte past the limit, so a small "zip bomb" costs at most ``limit`` bytes of memory
    and the time to produce them.
    """
    gz = data[:2] == b"\x1f\x8b"
    out = bytearray()
    rest = data
    try:
        while True:
            d = zlib.decompressobj(31 if gz else 15)
            out += d.decompress(rest, limit + 1 - len(out))
            if len(out) > limit:
                raise BadMessage(Code.MESSAGE_BODY_TOO_LARGE,
                                 f"message body inflates to more than the limit of {limit} bytes")
            if not d.eof:
                raise BadMessage(Code.MESSAGE_CORRUPTED, "compressed body is truncated")
            rest = d.unused_data
            if not (gz and rest[:2] == b"\x1f\x8b"):  # another gzip member follows, or the end
                break
    except zlib.error:
        raise BadMessage(Code.MESSAGE_CORRUPTED, "body is not valid gzip or zlib data") from None
    if rest.strip(b"\x00"):
        raise BadMessage(Code.MESSAGE_CORRUPTED, "trailing bytes after the compressed body")
    return bytes(out)


def validate(m, sp, message_id: str, max_body: int,
             inflate_left: int | None = None) -> tuple[int, bytes, dict[str, str], int, int]:
    """Check one SendMessage entry and read what is stored of it, each field once: (message type, plain body,
    stored properties, born time in epoch ms or 0 when not given, delivery time of a DELAY message or 0);
    raises BadMessage.  ``sp`` is ``m.system_properties`` and ``message_id`` its message id, as the caller
    read them (each read of a protobuf field builds a new object).

    ``inflate_left``: how many bytes GZIP bodies of the request may still inflate to (a request of many small
    bombs would otherwise cost many times ``max_body`` of work).

    The stored properties are the user properties, then TAGS, KEYS (space separated), UNIQ_KEY, __SHARDINGKEY,
    TIMER_DELIVER_MS, TRACE_CONTEXT and, for a transaction, TRAN_MSG, PGROUP (the topic: the proxy's producer
    group for gRPC clients) and CHECK_IMMUNITY_TIME_IN_SECONDS, in that order (the order they are written in).
    """
    mid = message_id
    if not mid or not mid.strip() or len(mid) > 128 or _has_control(mid):
        raise BadMessage(Code.ILLEGAL_MESSAGE_ID, "message_id is blank or malformed")
    body = m.body
    encoding = sp.body_encoding
    if encoding == GZIP:
        limit = max_body if inflate_left is None else max(0, min(max_body, inflate_left))
        try:
            body = inflate(body, limit)
        except BadMessage as e:
            if e.code != Code.MESSAGE_BODY_TOO_LARGE or limit == max_body:
                raise
            raise BadMessage(e.code, "the GZIP bodies of this request inflate to more than the request may carry "
                                     "in total") from None
    elif encoding not in PLAIN_ENCODINGS:
        raise BadMessage(Code.BAD_REQUEST, f"unknown body encoding {encoding}")
    if not body:
        raise BadMessage(Code.MESSAGE_BODY_EMPTY, "message body is empty")
    if len(body) > max_body:
        raise BadMessage(Code.MESSAGE_BODY_TOO_LARGE,
                         f"message body of {len(body)} bytes exceeds the limit of {max_body} bytes")
    has = sp.HasField
    tag = None
    if has("tag"):
        tag = sp.tag
        if not tag.strip() or "|" in tag or _has_control(tag):
            raise BadMessage(Code.ILLEGAL_MESSAGE_TAG, "tag is blank or contains '|' or control characters")
    keys = sp.keys
    if keys:
        for k in keys:
            if not k.strip() or _has_control(k):
                raise BadMessage(Code.ILLEGAL_MESSAGE_KEY, "a key is blank or contains control characters")
    group = None
    if has("message_group"):
        group = sp.message_group
        if not group.strip() or len(group) > 64 or _has_control(group):
            raise BadMessage(Code.ILLEGAL_MESSAGE_GROUP, "message group is blank, longer than 64 or has control characters")
    up = m.user_properties
    if up:  # (an empty map is not iterated: its items() is a Python-level view)
        for k, v in up.items():
            if not k or k in RESERVED or _has_control(k):
                raise BadMessage(Code.ILLEGAL_MESSAGE_PROPERTY_KEY, f"property name {k[:40]!r} is reserved or malformed")
            if "\x00" in v or "\x01" in v or "\x02" in v:  # (a zero byte: the store refuses it, see codec.tail_problem)
                raise BadMessage(Code.ILLEGAL_MESSAGE_PROPERTY_KEY, f"property {k[:40]!r} has a control character value")
    born = 0
    if has("born_timestamp"):
        ms, why = stored_ms(sp.born_timestamp)
        if why:
            raise BadMessage(Code.BAD_REQUEST, f"born_timestamp {why}")
        if ms >= 1000:  # (a born time within the epoch's first second is taken as not given)
            born = ms
    deliver = None
    if has("delivery_timestamp"):
        deliver, why = stored_ms(sp.delivery_timestamp)
        if why:
            raise BadMessage(Code.ILLEGAL_DELIVERY_TIME, f"delivery_timestamp {why}")
    mtype = sp.message_type
    if mtype not in TYPE_NAMES:
        if mtype != UNSPECIFIED:  # LITE, PRIORITY, ...
            name = pb.MessageType.Name(mtype) if mtype in pb.MessageType.values() else str(mtype)
            raise BadMessage(Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE, f"message type {name} is not supported")
        mtype = FIFO if group is not None else DELAY if deliver is not None else NORMAL  # implied by the fields
    if mtype == TRANSACTION and (group is not None or deliver is not None):
        raise BadMessage(Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE,
                         "a transactional message cannot carry a message group or a delivery timestamp")
    if mtype == FIFO and group is None:
        raise BadMessage(Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE, "a FIFO message needs a message group")
    if mtype == DELAY and deliver is None:
        raise BadMessage(Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE, "a DELAY message needs a delivery timestamp")
    props = dict(up) if up else {}
    if tag is not None:
        props[P_TAGS] = tag
    if keys:
        props[P_KEYS] = " ".join(keys)
    props[P_UNIQ] = mid
    if group is not None:
        props[P_SHARDING] = group
    if deliver is not None:
        props[P_TIMER_DELIVER] = str(deliver)
    if has("trace_context"):
        trace = sp.trace_context
        if trace:
            props[P_TRACE] = trace
    if mtype == TRANSACTION:
        props[P_TRAN] = "true"
        props[P_PGROUP] = m.topic.name
        if has("orphaned_transaction_recovery_duration"):
            props[P_CHECK_IMMUNITY] = str(max(1, sp.orphaned_transaction_recovery_duration.seconds))
    return mtype, body, props, born, deliver if mtype == DELAY else 0


# Longest born host / peer text kept in the caches below: an IP text with a port is under 50 characters, and a
# client's made-up kilobytes must not be kept (1,024 entries of a frame's size each).
CACHED_HOST_TEXT = 128


@functools.lru_cache(maxsize=1024)
def _packed_ip(text: str) -> bytes | None:
    """An IP text's packed bytes (None if it is not one); cached: a client sends its own address every time."""
    try:
        return ipaddress.ip_address(text).packed
    except ValueError:
        return None


def host_from(text: str, peer: str) -> tuple[bytes, int]:
    """The born host: an IP text (optionally with a port), else the gRPC peer's address.

    Cached when short: a client sends the same born host over the same connection every time (the result is a
    tuple of immutables, a pure function of the two texts).
    """
    if len(text) <= CACHED_HOST_TEXT and len(peer) <= CACHED_HOST_TEXT:
        return _cached_host_from(text, peer)
    return _host_from(text, peer)


def _host_from(text: str, peer: str) -> tuple[bytes, int]:
    t = (text or "").strip()
    port = 0
    if peer:
        _, _, p = peer.rpartition(":")
        port = int(p) if p.isdigit() else 0
    packed = _packed_ip(t) if len(t) <= CACHED_HOST_TEXT else _packed_ip.__wrapped__(t)
    if packed is not None:
        return packed, port
    try:
        return codec.parse_host(t)
    except ValueError:
        return peer_host(peer)


_cached_host_from = functools.lru_cache(maxsize=1024)(_host_from)


def peer_host(peer: str) -> tuple[bytes, int]:
    """grpc's ``context.peer()`` (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``) as (address bytes, port)."""
    try:
        kind, _, rest = peer.partition(":")
        if kind == "ipv6":
            rest = rest.replace("%5B", "[").replace("%5D", "]")
            if not rest.startswith("["):
                addr, _, port = rest.rpartition(":")
                rest = f"[{addr}]:{port}"
        return codec.parse_host(rest)
    except (ValueError, AttributeError):
        return b"\x7f\x00\x00\x01", 0


@functools.lru_cache(maxsize=1024)
def _host_text(addr: bytes, port: int) -> str:
    """``codec.format_host``, cached: a broker has one store host, a producer one born host."""
    return codec.format_host(addr, port)


@functools.lru_cache(maxsize=1024)
def _address_text(addr: bytes, port: int) -> str:
    """The address of a host without its port (and IPv6 brackets), as the gRPC born_host carries it."""
    return codec.format_host(addr, port).rsplit(":", 1)[0].strip("[]")


def _user_properties(props: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in props.items() if k not in RESERVED}


def derived_type(props: Mapping[str, str]) -> int:
    if props.get(P_TRAN) == "true":
        return MT.TRANSACTION
    if P_SHARDING in props:
        return MT.FIFO
    if P_TIMER_DELIVER in props or P_STARTDELIVER in props or P_TIMER_DELAY_SEC in props or P_DELAY in props:
        return MT.DELAY
    return MT.NORMAL


def to_pb(msg: MessageExt, out, *, namespace: str = "", receipt_handle: str | None = None,
          delivery_attempt: int | None = None, invisible_ms: int | None = None) -> None:
    """Fill ``out`` (a pb.Message) from a stored message."""
    props = msg.properties
    out.topic.name = msg.topic
    out.topic.resource_namespace = namespace
    body = msg.body or b""
    # A compressed record (written by RocketMQ's remoting clients) goes out as stored, marked GZIP, as the proxy
    # does; both clients inflate zlib data themselves.  The broker never inflates it: no bomb to defuse here.
    # LZ4/ZSTD bodies (type bits 1, 2) are not understood by the clients either and go out as stored.
    zlib_body = bool(msg.sys_flag & codec.SYSFLAG_COMPRESSED) \
        and (msg.sys_flag & COMPRESSION_TYPE) in (0, COMPRESSION_ZLIB)
    out.body = body
    for k, v in _user_properties(props).items():
        out.user_properties[k] = v
    sp = out.system_properties
    sp.message_id = props.get(P_UNIQ) or msg.msg_id
    tags = props.get(P_TAGS)
    if tags:
        sp.tag = tags
    keys = props.get(P_KEYS)
    if keys:
        sp.keys.extend(k for k in keys.split(" ") if k)
    sp.body_digest.type = pb.DigestType.MD5
    sp.body_digest.checksum = hashlib.md5(body).hexdigest().upper()
    sp.body_encoding = pb.Encoding.GZIP if zlib_body else pb.Encoding.IDENTITY
    sp.message_type = derived_type(props)
    set_ts(sp.born_timestamp, msg.born_timestamp)
    sp.born_host = _address_text(msg.born_addr, msg.born_port)
    set_ts(sp.store_timestamp, msg.store_timestamp)
    sp.store_host = _host_text(msg.store_addr, msg.store_port)
    sp.queue_id = msg.queue_id
    sp.queue_offset = msg.queue_offset
    deliver = props.get(P_TIMER_DELIVER)
    if deliver and deliver.lstrip("-").isdigit():
        set_ts(sp.delivery_timestamp, int(deliver))
    group = props.get(P_SHARDING)
    if group:
        sp.message_group = group
    trace = props.get(P_TRACE)
    if trace:
        sp.trace_context = trace
    if receipt_handle is not None:
        sp.receipt_handle = receipt_handle
    if delivery_attempt is not None:
        sp.delivery_attempt = delivery_attempt
    if invisible_ms is not None:
        sp.invisible_duration.seconds, ms = divmod(invisible_ms, 1000)
        sp.invisible_duration.nanos = ms * 1_000_000
    origin = props.get(P_DLQ_TOPIC)
    if origin:
        sp.dead_letter_queue.topic = origin
        sp.dead_letter_queue.message_id = props.get(P_DLQ_MSG_ID) or sp.message_id
