"""CommitLog record codec: the one place that knows RocketMQ's record layout.

Every integer is big-endian and signed, as Java writes it.  A record (V1 magic,
IPv4 hosts) looks like this; each IPv6 host adds 12 bytes and the V2 magic
widens the topic length to a short::

    0   TOTALSIZE        int32     48  BORNHOST      4|16 + port int32
    4   MAGICCODE        int32     ..  STORETIMESTAMP int64
    8   BODYCRC          int32     ..  STOREHOST     4|16 + port int32
    12  QUEUEID          int32     ..  RECONSUMETIMES int32
    16  FLAG             int32     ..  PREPARED TRANSACTION OFFSET int64
    20  QUEUEOFFSET      int64     ..  BODYLENGTH int32 + BODY
    28  PHYSICALOFFSET   int64     ..  TOPICLENGTH int8|int16 + TOPIC
    36  SYSFLAG          int32     ..  PROPERTIESLENGTH int16 + PROPERTIES
    40  BORNTIMESTAMP    int64

Decoding works on any buffer (``mmap``, ``bytes``, ``memoryview``) with
``struct.unpack_from`` so that a scan never copies a record it does not return.
"""

from __future__ import annotations

import base64
import functools
import ipaddress
import operator
import re
import struct
import zlib
from itertools import islice
from typing import Any, Iterator, Mapping

try:  # ISA-L's CRC-32 (carry-less multiply): 5-15 times zlib's; every put and every checked read takes one
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - depends on the installation
    _crc32 = zlib.crc32
crc32 = _crc32  # (unmasked; BODYCRC is body_crc)

MAGIC_V1 = 0xDAA320A7
MAGIC_V2 = 0xDAA320AB
BLANK_MAGIC = 0xCBD43194
BLANK_RECORD_SIZE = 8

SYSFLAG_COMPRESSED = 0x1
SYSFLAG_MULTI_TAGS = 0x2
TRANSACTION_NOT_TYPE = 0x0
TRANSACTION_PREPARED = 0x4
TRANSACTION_COMMIT = 0x8
QUEUED_TXN = (TRANSACTION_NOT_TYPE, TRANSACTION_COMMIT)  # the kinds that get a consume-queue unit
TRANSACTION_ROLLBACK = 0xC
TRANSACTION_MASK = 0xC
SYSFLAG_BORNHOST_V6 = 0x10
SYSFLAG_STOREHOST_V6 = 0x20

PROPERTY_NAME_VALUE_SEPARATOR = "\x01"
PROPERTY_SEPARATOR = "\x02"
MAX_PROPERTIES_BYTES = 32767
# RocketMQ's TopicValidator pattern ^[%|a-zA-Z0-9_-]+$; a topic also names its consume-queue directory.
LEGAL_TOPIC_BYTES = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789%|-_"
MAX_TOPIC_BYTES = 255
SCHEDULE_TOPIC = "SCHEDULE_TOPIC_XXXX"
DELAY_LEVELS_MS = (1000, 5000, 10000, 30000, 60000, 120000, 180000, 240000, 300000,
                   360000, 420000, 480000, 540000, 600000, 1200000, 1800000, 3600000, 7200000)

PREFIX_SIZE = 48  # TOTALSIZE .. BORNTIMESTAMP
_INT = struct.Struct(">i")
_UINT = struct.Struct(">I")
_LONG = struct.Struct(">q")
_SHORT = struct.Struct(">h")
_BYTE = struct.Struct(">b")
_HEAD8 = struct.Struct(">iI")  # TOTALSIZE + MAGICCODE


class RecordError(ValueError):
    """A record that RocketMQ's checkMessageAndReturnSize would refuse."""


def body_crc(body: Any) -> int:
    """BODYCRC of a body (RocketMQ's UtilAll.crc32: CRC-32 masked to 31 bits); any buffer, no copy."""
    return _crc32(body) & 0x7FFFFFFF


def crc32_many(buf: Any, starts: list[int], ends: list[int]) -> list[int]:
    """CRC-32 (unmasked) of ``buf[starts[i]:ends[i]]`` for every i, with no Python frame per range: the bodies
    of a batch of records checked at once (BODYCRC is the value ``& 0x7FFFFFFF``)."""
    with memoryview(buf) as mv:
        return list(map(_crc32, map(mv.__getitem__, map(slice, starts, ends))))


_POWERS: list[tuple[int, ...]] = [()]


def _powers(n: int) -> tuple[int, ...]:
    """31**(n-1-i) mod 2**32 for i in range(n): the weights of Java's polynomial string hash."""
    while len(_POWERS) <= n:
        k = len(_POWERS)
        _POWERS.append(tuple(pow(31, k - 1 - i, 1 << 32) for i in range(k)))
    return _POWERS[n]


def java_hash(s: str) -> int:
    """Java's ``String.hashCode`` (UTF-16 code units, signed 32-bit).

    Evaluated as a dot product with precomputed powers of 31 so that the loop
    runs in C (``sum(map(mul, ...))``), several times faster than a Python loop.
    """
    if s.isascii():
        units: Any = s.encode("ascii")
    else:
        data = s.encode("utf-16-be", "surrogatepass")
        units = struct.unpack(f">{len(data) // 2}H", data)
    n = len(units)
    if n > 512:
        h = 0
        for u in units:
            h = (31 * h + u) & 0xFFFFFFFF
    else:
        h = sum(map(operator.mul, units, _powers(n))) & 0xFFFFFFFF
    return h - 0x100000000 if h & 0x80000000 else h


def java_len(s: str) -> int:
    """Length in Java chars (UTF-16 units): the V2 decision counts these."""
    if s.isascii():
        return len(s)
    return len(s.encode("utf-16-be", "surrogatepass")) // 2


def index_key_hash(key: str) -> int:
    """keyHash of an index entry: abs(hashCode), with Integer.MIN_VALUE mapped to 0."""
    h = java_hash(key)
    return 0 if h == -0x80000000 else abs(h)


def tags_code(tags: str | None) -> int:
    """ConsumeQueue tagsCode of an ordinary message: hashCode of the whole TAGS string, 0 without."""
    return java_hash(tags) if tags else 0


def dispatch_tags_code(topic: str, properties: Mapping[str, str], store_timestamp: int) -> int:
    """tagsCode as dispatch computes it, including the delay-queue rule of SCHEDULE_TOPIC_XXXX."""
    if topic == SCHEDULE_TOPIC and "DELAY" in properties:
        level = min(int(properties["DELAY"]), len(DELAY_LEVELS_MS))
        if level > 0:
            return store_timestamp + DELAY_LEVELS_MS[level - 1]
    return tags_code(properties.get("TAGS"))


# ---------------------------------------------------------------- properties

def parse_properties(s: str) -> dict[str, str]:
    """Java ``string2messageProperties``: tolerant split, later duplicates win."""
    out: dict[str, str] = {}
    if not s:
        return out
    for seg in s.split(PROPERTY_SEPARATOR):
        if len(seg) < 3:
            continue
        k = seg.find(PROPERTY_NAME_VALUE_SEPARATOR)
        if 0 < k < len(seg) - 1:
            out[seg[:k]] = seg[k + 1:]
    return out


# What producers write (messageProperties2String): ``name 0x01 value 0x02`` pairs, a name never empty, no zero byte.
# (possessive: nothing to backtrack into; about 0.5 us for a client message's 80 bytes)
_PROPERTIES_SHAPE = re.compile(rb"(?:[^\x00-\x02]++\x01[^\x00\x02]*+\x02)*+")


def properties_problem(props: bytes) -> str | None:
    """Why a PROPERTIES string is not one a producer writes, or None when it is.

    The put path refuses such a string (MessageEncoder.encode), so a record that
    holds one was damaged after its body (no CRC covers the properties): recovery
    takes it, past the checkpoint's flushed point after a power loss, for a torn
    write (:func:`tail_problem`).  Records of other writers (RocketMQ, tools) may
    hold anything: readers parse them as Java does.
    """
    if _PROPERTIES_SHAPE.fullmatch(props) is not None:
        return None
    if 0 in props:
        return f"properties hold a zero byte (at {props.index(0)} of {len(props)})"
    return "properties are not name\\x01value\\x02 pairs"


def _hashmap_capacity(n: int, initial: int) -> int:
    cap = 1
    while cap < initial:
        cap <<= 1
    while n > cap * 3 // 4:
        cap <<= 1
    return cap


_ORDER_CACHE: dict[tuple[tuple[str, ...], int], tuple[int, ...]] = {}


def properties_to_string(props: Mapping[str, str], capacity: int = 16) -> str:
    """Serialise in Java ``HashMap`` iteration order, as a producer's message map would.

    RocketMQ stores the string it is given; producers build it by iterating a
    HashMap (initial capacity 16 for a client message), so buckets ascend and
    keys sharing a bucket keep insertion order.  Null values are skipped.  The
    order depends only on the names, so it is computed once per name tuple.
    """
    if not props:
        return ""
    names = tuple(props) if None not in props.values() else tuple(k for k, v in props.items() if v is not None)
    order = _ORDER_CACHE.get((names, capacity))
    if order is None:
        cap = _hashmap_capacity(len(names), capacity)

        def bucket(i: int) -> tuple[int, int]:
            h = java_hash(names[i]) & 0xFFFFFFFF
            return ((h ^ (h >> 16)) & (cap - 1), i)

        order = tuple(sorted(range(len(names)), key=bucket))
        if len(_ORDER_CACHE) > 4096:
            _ORDER_CACHE.clear()
        _ORDER_CACHE[(names, capacity)] = order
    return "".join([f"{names[i]}\x01{props[names[i]]}\x02" for i in order])


# ---------------------------------------------------------------- hosts

@functools.lru_cache(maxsize=4096)
def parse_host(text: str) -> tuple[bytes, int]:
    """``"a.b.c.d:port"`` or ``"[v6]:port"`` to (address bytes, port).

    Cached: a replay or a Spark append gives the same few client hosts row after row, and ``ipaddress``
    costs about 10 us a parse."""
    try:
        if text.startswith("["):
            addr, _, port = text[1:].rpartition("]:")
            return ipaddress.IPv6Address(addr).packed, int(port)
        addr, _, port = text.rpartition(":")
        return ipaddress.ip_address(addr).packed, int(port)
    except ValueError as e:
        raise ValueError(f"bad host address {text!r}: expected a.b.c.d:port or [v6]:port") from e


def format_host(addr: bytes, port: int) -> str:
    """Java's text form: dotted IPv4, or uncompressed unpadded lowercase IPv6 in brackets."""
    if len(addr) == 4:
        return f"{addr[0]}.{addr[1]}.{addr[2]}.{addr[3]}:{port}"
    groups = struct.unpack(">8H", addr)
    return "[" + ":".join(f"{g:x}" for g in groups) + f"]:{port}"


def offset_msg_id(store_addr: bytes, store_port: int, commit_log_offset: int) -> str:
    """offsetMsgId: store host address, port and commitlog offset as uppercase hex."""
    return (store_addr + struct.pack(">iq", store_port, commit_log_offset)).hex().upper()


def decode_offset_msg_id(msg_id: str) -> tuple[bytes, int, int] | None:
    """(store address, port, commitlog offset) of an offsetMsgId (32 hex digits for IPv4, 56 for IPv6), or
    None when ``msg_id`` is not of that form (a UNIQ_KEY client id, say)."""
    if len(msg_id) not in (32, 56):
        return None
    try:
        raw = bytes.fromhex(msg_id)
    except ValueError:
        return None
    port, offset = struct.unpack(">iq", raw[-12:])
    return raw[:-12], port, offset


def record_length(body_len: int, topic_len: int, props_len: int, sys_flag: int, v2: bool) -> int:
    """RocketMQ's calMsgLength."""
    born = 20 if sys_flag & SYSFLAG_BORNHOST_V6 else 8
    store = 20 if sys_flag & SYSFLAG_STOREHOST_V6 else 8
    return (4 + 4 + 4 + 4 + 4 + 8 + 8 + 4 + 8 + born + 8 + store + 4 + 8
            + 4 + body_len + (2 if v2 else 1) + topic_len + 2 + props_len)


# ---------------------------------------------------------------- records

def _field(i: int, doc: str) -> property:
    return property(lambda self: self._h[i], doc=doc)


class MessageExt:
    """One decoded CommitLog record (RocketMQ's MessageExt).

    The fixed fields stay in the tuple that one ``unpack_from`` produced and are
    read through properties, so decoding a message builds one small object.
    """

    __slots__ = ("_h", "topic", "_ps", "body", "_props")

    def __init__(self, header: tuple, topic: str, properties_string: str, body: bytes | None) -> None:
        self._h = header
        self.topic = topic
        self._ps: str | bytes = properties_string
        self.body = body
        self._props: dict[str, str] | None = None

    @property
    def properties_string(self) -> str:
        """PROPERTIES as text; a get keeps the record's bytes and decodes them on first use (as :func:`decode`
        does: invalid UTF-8 replaced), which a consumer that never reads them does not pay for."""
        ps = self._ps
        if type(ps) is bytes:
            ps = self._ps = str(ps, "utf-8", "replace")
        return ps  # type: ignore[return-value]

    @properties_string.setter
    def properties_string(self, value: str) -> None:
        self._ps = value

    size = _field(0, "TOTALSIZE")
    magic = _field(1, "MAGICCODE")
    body_crc = _field(2, "BODYCRC")
    queue_id = _field(3, "QUEUEID")
    flag = _field(4, "FLAG")
    queue_offset = _field(5, "QUEUEOFFSET")
    commit_log_offset = _field(6, "PHYSICALOFFSET")
    sys_flag = _field(7, "SYSFLAG")
    born_timestamp = _field(8, "BORNTIMESTAMP")
    born_addr = _field(9, "BORNHOST address")
    born_port = _field(10, "BORNHOST port")
    store_timestamp = _field(11, "STORETIMESTAMP")
    store_addr = _field(12, "STOREHOST address")
    store_port = _field(13, "STOREHOST port")
    reconsume_times = _field(14, "RECONSUMETIMES")
    prepared_transaction_offset = _field(15, "PREPARED TRANSACTION OFFSET")
    body_length = _field(16, "BODYLENGTH")

    def __repr__(self) -> str:
        return (f"MessageExt(topic={self.topic!r}, queue_id={self.queue_id}, queue_offset={self.queue_offset}, "
                f"commit_log_offset={self.commit_log_offset}, size={self.size})")

    def __eq__(self, other: object) -> bool:
        # (the header tuple of a message decode_run built goes on past BODYLENGTH: its first 17 fields count)
        return isinstance(other, MessageExt) and (self._h[:17], self.topic, self.properties_string, self.body) == (
            other._h[:17], other.topic, other.properties_string, other.body)

    @property
    def properties(self) -> dict[str, str]:
        if self._props is None:
            self._props = parse_properties(self.properties_string)
        return self._props

    @property
    def tags(self) -> str | None:
        return self.properties.get("TAGS")

    @property
    def keys(self) -> str | None:
        return self.properties.get("KEYS")

    @property
    def uniq_key(self) -> str | None:
        return self.properties.get("UNIQ_KEY")

    @property
    def born_host(self) -> str:
        return format_host(self.born_addr, self.born_port)

    @property
    def store_host(self) -> str:
        return format_host(self.store_addr, self.store_port)

    @property
    def msg_id(self) -> str:
        return offset_msg_id(self.store_addr, self.store_port, self.commit_log_offset)

    @property
    def transaction_type(self) -> int:
        return self.sys_flag & TRANSACTION_MASK

    def to_json(self, with_body: bool = True) -> dict[str, Any]:
        """The field names and values of ``rocketstore dump`` (and golden expected.jsonl)."""
        d: dict[str, Any] = {
            "topic": self.topic, "queueId": self.queue_id, "queueOffset": self.queue_offset,
            "commitLogOffset": self.commit_log_offset, "size": self.size, "sysFlag": self.sys_flag,
            "flag": self.flag, "bodyCrc": self.body_crc, "reconsumeTimes": self.reconsume_times,
            "preparedTransactionOffset": self.prepared_transaction_offset,
            "bornTimestamp": self.born_timestamp, "storeTimestamp": self.store_timestamp,
            "bornHost": self.born_host, "storeHost": self.store_host, "msgId": self.msg_id,
            "tags": self.tags, "keys": self.keys,
            "properties": dict(sorted(self.properties.items())),
            "propertiesString": self.properties_string,
        }
        if with_body and self.body is not None:
            d["body"] = base64.b64encode(self.body).decode("ascii")
        d["bodyLength"] = self.body_length
        d["magicCode"] = f"0x{self.magic:08X}"
        return d


def read_total_size(buf: Any, pos: int) -> int:
    return _INT.unpack_from(buf, pos)[0]


# The whole fixed part of a record, TOTALSIZE to BODYLENGTH, per host family (sysFlag & 0x30).
_HEADERS = {
    0x00: struct.Struct(">iIiiiqqiq4siq4siiqi"),
    SYSFLAG_BORNHOST_V6: struct.Struct(">iIiiiqqiq16siq4siiqi"),
    SYSFLAG_STOREHOST_V6: struct.Struct(">iIiiiqqiq4siq16siiqi"),
    SYSFLAG_BORNHOST_V6 | SYSFLAG_STOREHOST_V6: struct.Struct(">iIiiiqqiq16siq16siiqi"),
}
_SYSFLAG_POS = 36
IPV4_HEADER = _HEADERS[0x00]  # the fixed part of a record whose hosts are both IPv4 (the batch encoder's case)


def parse(buf: Any, pos: int, limit: int, *, check_crc: bool = False) -> tuple[tuple, int, int, int]:
    """Validate the record at ``pos`` without building strings: (header tuple, topic position,
    topic length, properties length).  The body starts at ``pos + header size``.

    Raises :class:`RecordError` with the reason when RocketMQ would refuse the
    record.  One ``unpack_from`` reads the whole fixed part; the host family
    comes from the low byte of SYSFLAG.  ``limit`` is the end of readable bytes.
    """
    try:
        header = _HEADERS[buf[pos + _SYSFLAG_POS + 3] & 0x30]
        if limit - pos < header.size:
            raise RecordError("record header runs past the readable end")
        h = header.unpack_from(buf, pos)
    except (IndexError, struct.error):
        raise RecordError("record header runs past the readable end") from None
    total, magic, crc, sys_flag, body_len = h[0], h[1], h[2], h[7], h[16]
    if magic != MAGIC_V1 and magic != MAGIC_V2:
        if magic == BLANK_MAGIC:
            raise RecordError("blank end-of-file record")
        raise RecordError(f"bad magic code 0x{magic:08X}")
    end = pos + total
    if total < header.size or end > limit:
        raise RecordError(f"record size {total} runs past the readable end")
    p = pos + header.size
    if body_len < 0 or p + body_len > end:
        raise RecordError(f"body length {body_len} runs past the record")
    if check_crc and body_len > 0:
        with memoryview(buf) as mv:
            actual = _crc32(mv[p:p + body_len]) & 0x7FFFFFFF
        if actual != crc:
            raise RecordError(f"body CRC mismatch (stored {crc}, computed {actual})")
    p += body_len
    try:
        if magic == MAGIC_V1:
            topic_len = buf[p]
            if topic_len > 127:
                topic_len -= 256
            p += 1
        else:
            topic_len = _SHORT.unpack_from(buf, p)[0]
            p += 2
        if topic_len < 0 or p + topic_len > end:
            raise RecordError(f"topic length {topic_len} runs past the record")
        props_len = _SHORT.unpack_from(buf, p + topic_len)[0]
    except (IndexError, struct.error):
        raise RecordError("record fields run past the readable end") from None
    if props_len < 0 or p + topic_len + 2 + props_len != end:
        if props_len < 0 or p + topic_len + 2 + props_len > end:
            raise RecordError(f"properties length {props_len} runs past the record")
        expect = record_length(body_len, topic_len, props_len, sys_flag, magic == MAGIC_V2)
        raise RecordError(f"record size {total} disagrees with its fields ({expect})")
    return h, p, topic_len, props_len


def decode(buf: Any, pos: int, limit: int, *, check_crc: bool = False, read_body: bool = True) -> MessageExt:
    """Decode the record at ``pos`` (see :func:`parse` for what is checked)."""
    h, p, topic_len, props_len = parse(buf, pos, limit, check_crc=check_crc)
    body = None
    if read_body:
        b = pos + _HEADERS[h[7] & 0x30].size
        body = buf[b:b + h[16]]
        if type(body) is not bytes:
            body = bytes(body)
    topic = str(buf[p:p + topic_len], "utf-8", "replace")
    q = p + topic_len + 2
    props = str(buf[q:q + props_len], "utf-8", "replace") if props_len else ""
    return MessageExt(h, topic, props, body)


def decode_at(buf: Any, pos: int, limit: int, offset: int, *, check_crc: bool = False,
              read_body: bool = True) -> MessageExt:
    """:func:`decode` of the record that must sit at commitlog ``offset`` (``buf[pos]``): a trusted record
    only, so a lookup by offset never returns a stale copy of another record (see :func:`check`)."""
    m = decode(buf, pos, limit, check_crc=check_crc, read_body=read_body)
    if m.commit_log_offset != offset:
        raise RecordError(stale_copy_reason(m.commit_log_offset, offset))
    return m


HEADER_BY_HOST_FLAGS = _HEADERS  # an EncodedRecord's header struct by sysFlag & 0x30 (staged records)
_V4_HEADER = _HEADERS[0]
_V4_UNPACK = _V4_HEADER.unpack_from
_V4_SIZE = _V4_HEADER.size
_new = object.__new__


def decode_unit(buf: Any, pos: int, size: int, read_body: bool, topic: str, topic_bytes: bytes, queue_id: int,
                queue_offset: int) -> MessageExt | None:
    """The record a consume-queue unit points at, or None when that is not the unit's record intact.

    The unit claims a record of ``size`` bytes at ``pos`` of (``topic``, whose
    UTF-8 is ``topic_bytes``, ``queue_id``, ``queue_offset``).  None when the
    record does not decode, when it is another record than the claimed one
    (RocketMQ trusts the unit; a damaged unit would hand out the wrong
    message), or when ``read_body`` and the body fails its BODYCRC.

    The common record (V1 magic, IPv4 hosts) is checked and built inline:
    consuming spends most of its time here, and one function frame with no
    ``parse`` call, ``_HEADERS`` lookup or ``__init__`` is about 1.7 times as
    fast; its topic is compared as bytes, not decoded.  Anything else goes
    through :func:`decode`.  ``buf`` must slice to ``bytes`` (an ``mmap`` or
    ``bytes``, as segments are).
    """
    try:
        h = _V4_UNPACK(buf, pos)
        end = pos + size
        b = pos + _V4_SIZE
        p = b + h[16]  # topic length byte
        if h[1] == MAGIC_V1 and h[0] == size and h[5] == queue_offset and h[3] == queue_id and not h[7] & 0x30 \
                and b <= p and p + 3 <= end:
            tl = buf[p]
            q = p + 1 + tl  # properties length
            # signed lengths: a high bit set is negative, which decode refuses (an index past the end: too)
            if tl < 128 and buf[q] < 128 and q + 2 + (buf[q] << 8 | buf[q + 1]) == end and \
                    buf[p + 1:q] == topic_bytes:  # another topic's bytes: decode says what they are
                m = _new(MessageExt)
                m._h = h
                m.topic = topic
                m._ps = buf[q + 2:end]  # decoded on first use
                m._props = None
                if read_body:
                    body = m.body = buf[b:p]
                    if body and _crc32(body) & 0x7FFFFFFF != h[2]:
                        return None
                else:
                    m.body = None
                return m
    except (struct.error, IndexError):
        pass
    try:
        m = decode(buf, pos, pos + size, read_body=read_body, check_crc=read_body)
    except RecordError:
        return None
    h = m._h
    if h[0] != size or h[5] != queue_offset or h[3] != queue_id or m.topic != topic:
        return None
    return m


class _RunMessage(MessageExt):
    """A MessageExt built by :func:`decode_run`: the class call without ``__init__`` is the cheapest way to make
    the object (cheaper than ``object.__new__``), its slots are then set directly.

    A message of a contiguous run holds the tuple its checks unpacked (``_c``: :func:`_run_check_shape`'s fields)
    and the run's copied bytes (``_run``: bytes, first queue offset, record size, topic part, properties length)
    in place of the header tuple;
    the header is unpacked on the first read of a field (most consumers read only topic, body and properties),
    and the message then lets go of the run's bytes.  Pickled, it is the plain message it was before."""

    __slots__ = ("_c", "_run", "_full")
    __init__ = object.__init__  # type: ignore[assignment]

    @property  # type: ignore[override]
    def _h(self) -> tuple:
        try:
            return self._full
        except AttributeError:
            pass
        run = self._run
        if run is None:  # another thread unpacked it meanwhile (it sets _full before letting go of the run)
            return self._full
        raw, first, size, head, pl = run
        c = self._c
        h = self._full = _V4_UNPACK(raw, (c[3] - first) * size) + (c[6], head, pl, c[8])
        self._run = None
        return h

    @_h.setter
    def _h(self, h: tuple) -> None:
        self._full = h

    @property
    def properties(self) -> dict[str, str]:
        # (a run leaves ``_props`` unset: one store less per message)
        try:
            props = self._props
        except AttributeError:
            props = None
        if props is None:
            props = self._props = parse_properties(self.properties_string)
        return props

    def __getstate__(self) -> tuple[None, dict[str, Any]]:
        """The slots of a MessageExt (what pickling stored before the header became lazy)."""
        return None, {"_h": self._h, "topic": self.topic, "_ps": self._ps, "body": self.body,
                      "_props": getattr(self, "_props", None)}


def decode_run(buf: Any, units: tuple[int, ...], j: int, base: int, wrote: int, count: int, byte_budget: int,
               read_body: bool, topic: str, head: bytes, queue_id: int, queue_offset: int, out: list[MessageExt]
               ) -> tuple[int, int, int]:
    """Append to ``out`` the records of the units ``units[j:]`` (flattened as offset, size, tagsCode) while
    each is the unit's record intact in the common form; (next j, messages appended, their bytes).

    The run stops before ``count`` messages or ``byte_budget`` bytes would be
    passed, and before the first unit that is not plainly its record in this
    segment (``base`` its first commitlog offset, ``wrote`` its written end):
    not in it whole, not V1 magic with IPv4 hosts, another topic (``head``:
    the topic's length byte and UTF-8), queue id or queue offset (the first
    unit's is ``queue_offset``), sizes that disagree, properties longer than
    a record holds, or, reading bodies, a BODYCRC mismatch.  The caller reads
    that unit through :func:`decode_unit` and its slow paths, which decide
    whether it is another form of a good record or damage; so this makes the
    same checks as :func:`decode_unit`, with no call or frame per message: a
    consumer's get spends most of its time on them.

    Units that point at back-to-back records of one size (a batch's, or a
    queue written alone) are read together (:func:`_contiguous_run`: one
    copy and one ``iter_unpack``); the others one record at a time
    (:func:`_record_run`).  Either way a record is unpacked by a Struct of
    its whole shape (header, body, topic length and topic, properties
    length, properties; :func:`_run_shape`), learnt from the body length:
    one call instead of a header unpack and three slices.  A record's tuple
    is the message's header tuple (the fields past BODYLENGTH are the body
    and the rest, which the message holds anyway).
    """
    n0, total = len(out), 0
    end = len(units)
    while count > 0 and j < end:
        if count >= _RUN_MIN and end - j >= 3 * _RUN_MIN:
            k, t = _contiguous_run(buf, units, j, base, wrote, count, byte_budget, read_body, topic, head, queue_id,
                                   queue_offset, out)
            if k:
                j, count, byte_budget, queue_offset = j + 3 * k, count - k, byte_budget - t, queue_offset + k
                total += t
                continue
        gap = _units_before_run(units, j, end if end < j + 3 * count else j + 3 * count)
        j, k, t = _record_run(buf, units, j, base, wrote, gap, byte_budget, read_body, topic, head, queue_id,
                              queue_offset, out)
        total += t
        if k < gap:  # stopped at a unit it could not read, or at the budget
            break
        count, byte_budget, queue_offset = count - k, byte_budget - t, queue_offset + k
    return j, len(out) - n0, total


_RUN_MIN = 4  # fewer back-to-back records than this are read one at a time


def _units_before_run(units: tuple[int, ...], j: int, stop: int) -> int:
    """How many units from ``units[j]`` (at least one) come before ``_RUN_MIN`` back-to-back ones of one size
    (all up to ``stop`` when none do): the stretch :func:`decode_run` reads one record at a time."""
    streak, at, size = 1, units[j] + units[j + 1], units[j + 1]
    for i in range(j + 3, stop, 3):
        p, z = units[i], units[i + 1]
        if p == at and z == size:
            streak += 1
            if streak == _RUN_MIN:
                first = (i - j) // 3 - _RUN_MIN + 1
                return first if first > 0 else 1
        else:
            streak, size = 1, z
        at = p + z
    return (stop - j) // 3


def _contiguous_run(buf: Any, units: tuple[int, ...], j: int, base: int, wrote: int, count: int, byte_budget: int,
                    read_body: bool, topic: str, head: bytes, queue_id: int, queue_offset: int,
                    out: list[MessageExt]) -> tuple[int, int]:
    """:func:`decode_run` of the units from ``units[j]`` that name back-to-back records of the first unit's size:
    (messages appended, their bytes); (0, 0) when fewer than ``_RUN_MIN`` do, or the first record is not of
    the common form.  One slice copies them all and ``iter_unpack`` splits the copy by their shape (a call
    and a buffer export per record is what reading them one by one costs most); each is then checked as
    :func:`_record_run` checks it (the units' offsets and sizes were), and the run stops before the first
    that fails: :func:`decode_run` goes on from there, so the two decide alike."""
    phy, size = units[j], units[j + 1]
    hs = _V4_SIZE
    pos = phy - base
    if pos < 0 or size < hs:
        return 0, 0
    k = (len(units) - j) // 3
    if count < k:
        k = count
    if byte_budget < k * size:
        k = byte_budget // size
    if wrote < pos + k * size:
        k = (wrote - pos) // size
    if k < _RUN_MIN:
        return 0, 0
    stop = j + 3 * k
    if units[j + 1:stop:3] != (size,) * k or units[j:stop:3] != tuple(range(phy, phy + k * size, size)):
        k, at = 1, phy + size  # not all back to back: how many first ones are
        for p, z in zip(islice(units, j + 3, stop, 3), islice(units, j + 4, stop, 3)):
            if p != at or z != size:
                break
            k, at = k + 1, at + size
        if k < _RUN_MIN:
            return 0, 0
    bl = _INT.unpack_from(buf, pos + hs - 4)[0]  # BODYLENGTH
    tl = len(head)
    pl = size - hs - bl - tl - 2
    if bl < 0 or pl < 0 or pl > MAX_PROPERTIES_BYTES:
        return 0, 0
    known = _RUN_CHECK_SHAPES.get((bl, tl, pl))
    raw = buf[pos:pos + k * size]
    records = (known if known is not None else _run_check_shape(bl, tl, pl)).iter_unpack(raw)
    crc, cls, append, magic = _crc32, _RunMessage, out.append, MAGIC_V1
    first, check = queue_offset, read_body and bl > 0  # (an empty body has no CRC to check)
    run = (raw, first, size, head, pl)
    lead, tail = _RUN_LEAD.pack(size, magic), head + _SHORT.pack(pl)  # the bytes every record of the run has
    body = None
    for c in records:  # size+magic, BODYCRC, queue id, queue offset, sysFlag, body length, body, topic+props length,
        #              properties (see _run_check_shape)
        if c[0] != lead or c[3] != queue_offset or c[2] != queue_id or c[4] & 0x30 or c[5] != bl or c[7] != tail:
            break
        if check:
            body = c[6]
            if crc(body) & 0x7FFFFFFF != c[1]:
                break
        elif read_body:
            body = c[6]
        m = cls()
        m._c = c
        m._run = run
        m.topic = topic
        m._ps = c[8]  # decoded on first use
        m.body = body
        append(m)
        queue_offset += 1
    return queue_offset - first, (queue_offset - first) * size


def _record_run(buf: Any, units: tuple[int, ...], j: int, base: int, wrote: int, count: int, byte_budget: int,
                read_body: bool, topic: str, head: bytes, queue_id: int, queue_offset: int, out: list[MessageExt]
                ) -> tuple[int, int, int]:
    """:func:`decode_run` one record at a time: (next j, messages appended, their bytes)."""
    hs, crc, cls, append, shapes, magic = _V4_SIZE, _crc32, _RunMessage, out.append, _RUN_SHAPES, MAGIC_V1
    tl = len(head)
    n0, total = len(out), 0
    shape_size = bl = pl = -1  # the size, body length and properties length ``unpack`` reads
    unpack: Any = None

    def shape(size: int, bl: int) -> tuple[int, Any] | None:
        """(properties length, whole-record unpack) of a ``size``-byte record with a ``bl``-byte body; None when
        the lengths cannot be a record's."""
        pl = size - hs - bl - tl - 2
        if bl < 0 or pl < 0 or pl > MAX_PROPERTIES_BYTES:
            return None
        known = shapes.get((bl, tl, pl))
        return pl, (known if known is not None else _run_shape(bl, tl, pl)).unpack_from

    it = islice(units, j, j + 3 * count if count > 0 else j)  # at most ``count`` units
    for phy, size, _tags in zip(it, it, it):
        pos = phy - base
        if pos < 0 or size < hs or pos + size > wrote or total + size > byte_budget:
            break
        if size != shape_size:
            bl = _INT.unpack_from(buf, pos + hs - 4)[0]  # BODYLENGTH
            learnt = shape(size, bl)
            if learnt is None:
                break
            pl, unpack = learnt
            shape_size = size
        h = unpack(buf, pos)
        if h[16] != bl:  # the same size, another body length: learn this record's shape
            bl = h[16]
            learnt = shape(size, bl)
            if learnt is None:
                break
            pl, unpack = learnt
            h = unpack(buf, pos)
        if h[0] != size or h[1] != magic or h[5] != queue_offset or h[3] != queue_id or h[7] & 0x30 or \
                h[18] != head or h[19] != pl:
            break
        if read_body:
            body = h[17]
            if body and crc(body) & 0x7FFFFFFF != h[2]:
                break
        else:
            body = None
        m = cls()
        m._full = h
        m.topic = topic
        m._ps = h[20]  # decoded on first use
        m.body = body
        m._props = None
        append(m)
        queue_offset += 1
        total += size
    n = len(out) - n0
    return j + 3 * n, n, total


_RUN_SHAPES: dict[tuple[int, int, int], struct.Struct] = {}  # (body, topic part, properties lengths) -> Struct


def _run_shape(body_len: int, topic_part: int, props_len: int) -> struct.Struct:
    """The Struct of a whole V1 IPv4 record of these lengths: the header's 17 fields, the body, the topic length
    byte with the topic, the properties length, the properties (kept for the next records: a queue's records are
    mostly of a few shapes; the cache is emptied past 1024 shapes)."""
    if len(_RUN_SHAPES) >= 1024:
        _RUN_SHAPES.clear()
    f = _RUN_SHAPES[(body_len, topic_part, props_len)] = struct.Struct(
        f"{_V4_HEADER.format}{body_len}s{topic_part}sh{props_len}s")
    return f


# The fields of a whole V1 IPv4 record that decode_run's checks read, the others skipped: 9 objects per record
# instead of 21 (FLAG, PHYSICALOFFSET and BORNTIMESTAMP to PREPARED TRANSACTION OFFSET are unpacked only when
# a message's field is first read).  TOTALSIZE with MAGICCODE, and the topic with the properties length, are
# read as bytes: each pair is then one comparison (bytes equal exactly when both fields do).
_V4_CHECK_FORMAT = ">8sii4xq8xi44xi"
_RUN_LEAD = struct.Struct(">iI")  # TOTALSIZE, MAGICCODE
_RUN_CHECK_SHAPES: dict[tuple[int, int, int], struct.Struct] = {}


def _run_check_shape(body_len: int, topic_part: int, props_len: int) -> struct.Struct:
    """:func:`_run_shape` with only the checked fields (size and magic as bytes, BODYCRC, queue id, queue offset,
    sysFlag, body length, body, topic part with the properties length as bytes, properties)."""
    if len(_RUN_CHECK_SHAPES) >= 1024:
        _RUN_CHECK_SHAPES.clear()
    f = _RUN_CHECK_SHAPES[(body_len, topic_part, props_len)] = struct.Struct(
        f"{_V4_CHECK_FORMAT}{body_len}s{topic_part + 2}s{props_len}s")
    assert f.size == _V4_SIZE + body_len + topic_part + 2 + props_len
    return f


def unit_run_head(topic_bytes: bytes) -> bytes | None:
    """The bytes a V1 record of this topic has after its body (length byte, UTF-8) for :func:`decode_run`, or
    None when the topic is too long for a V1 record (its records go through :func:`decode_unit`)."""
    return bytes((len(topic_bytes),)) + topic_bytes if len(topic_bytes) < 128 else None


def check(buf: Any, pos: int, limit: int, *, check_crc: bool, read_body: bool = False,
          parsed: bool = False, base: int | None = None, strict: bool = False) -> tuple[int, Any, str | None]:
    """RocketMQ's checkMessageAndReturnSize as ``(size, message, reason)``.

    ``size > 0`` with a message: a valid record.  ``size == 0``: a blank record
    (end of file).  ``size == -1``: not a record (``reason`` says why).  A
    positive size with no message: the size field disagrees with the fields.
    ``parsed=True`` gives :func:`parse`'s tuple in place of the message.

    Given ``base`` (the commitlog offset of ``buf[0]``), the record must also be
    a *trusted record* (data-safety rule 1): its PHYSICALOFFSET must equal
    ``base + pos``.  Bytes that decode (CRC included) at another position are a
    stale copy of the record that was written there (a torn or misdirected
    write), not a message: ``(-1, None, reason)``.  Every walk that hands out
    messages passes ``base``.  ``strict`` (with ``base``): the topic and properties must also be what a
    producer writes (:func:`tail_problem`), as recovery requires of the records a power loss may have torn.
    """
    if limit - pos <= 4:
        return -1, None, "no record header before the readable end"
    if limit - pos < 8:
        return -1, None, "record header runs past the readable end"
    total, magic = _HEAD8.unpack_from(buf, pos)
    if total - 4 > limit - pos:
        return -1, None, f"record size {total} runs past the readable end"
    if magic == BLANK_MAGIC:
        return 0, None, None
    if magic != MAGIC_V1 and magic != MAGIC_V2:
        return -1, None, f"bad magic code 0x{magic:08X}"
    try:
        msg = parse(buf, pos, limit, check_crc=check_crc) if parsed else \
            decode(buf, pos, limit, check_crc=check_crc, read_body=read_body)
    except RecordError as e:
        reason = str(e)
        if reason.startswith("record size") and "disagrees" in reason:
            return total, None, reason
        return -1, None, reason
    if base is not None:
        phy = msg[0][6] if parsed else msg.commit_log_offset
        if phy != base + pos:
            return -1, None, stale_copy_reason(phy, base + pos)
        torn = torn_tail(buf, pos, pos + total, base)
        if torn is not None:
            return -1, None, torn_reason(torn, base + pos + total)
        if strict:
            why = tail_problem(buf, pos, pos + total)
            if why is not None:
                return -1, None, tail_reason(why, base + pos)
    return total, msg, None


def stale_copy_reason(phy: int, offset: int) -> str:
    """Why a record that decodes is still not a message: its PHYSICALOFFSET names another position."""
    return (f"stale record copy: PHYSICALOFFSET field says {phy}, not its position {offset} "
            f"(bytes of another record, not a message)")


PAGE_SIZE = 4096  # the unit a power cut keeps or loses (segments start on a page boundary)


def torn_tail(buf: Any, pos: int, end: int, base: int) -> int | None:
    """Where a record whose bytes from a page start to its end are all zeros was torn, else None.

    BODYCRC covers the body alone; the topic and the properties come after it.
    A power cut that keeps the pages holding a record's header and body but
    loses its last page leaves a record every other check accepts, with zeros
    for (part of) its topic and properties.  No record is written that way: a
    topic is never zero bytes, and RocketMQ ends a properties string with
    0x02, so zeros from the last page start inside the tail to the record's end
    are a lost page, except when they are only an empty properties string's
    length field.  ``base`` is the commitlog offset of ``buf[0]``.
    """
    page = (base + end - 1) // PAGE_SIZE * PAGE_SIZE - base  # the last page start before the record's end
    if page <= pos:
        return None
    sys_flag = _INT.unpack_from(buf, pos + _SYSFLAG_POS)[0]
    body = pos + 88 + _V6_EXTRA[sys_flag & 0x30]
    tail = body + _INT.unpack_from(buf, body - 4)[0]  # topic length field: CRC coverage ends here
    if page < tail or buf[page:end].count(0) != end - page:
        return None
    if _UINT.unpack_from(buf, pos + 4)[0] == MAGIC_V2:
        props = tail + 2 + _SHORT.unpack_from(buf, tail)[0]
    else:
        props = tail + 1 + buf[tail]
    if props == end - 2 and page >= props:  # only an empty properties string's length field (zeros as written)
        return None
    return base + page


def torn_reason(at: int, end: int) -> str:
    return (f"torn record: bytes {at}..{end} (from a page start to the record's end) are zeros after its body, "
            "a write a power loss cut short (no CRC covers the topic and properties)")


def tail_problem(buf: Any, pos: int, end: int) -> str | None:
    """Why the topic or properties of the record at ``pos`` (ending at ``end``, its lengths already checked)
    are not what a producer writes, or None.

    BODYCRC stops at the body: a power cut that loses a sector or page of the
    tail (zeros, or the bytes an earlier write left there) while the pages of
    the header and body reach the disk leaves a record every other check
    accepts.  The put path writes only a legal topic (letters, digits, ``%|-_``,
    at most 255 bytes) and properties :func:`properties_problem` accepts, as
    UTF-8, so anything else in a record written after the checkpoint's flushed
    point is such a tear.  (:func:`torn_tail` is the narrower rule every
    reader applies.)
    """
    sys_flag = _INT.unpack_from(buf, pos + _SYSFLAG_POS)[0]
    body = pos + 88 + _V6_EXTRA[sys_flag & 0x30]
    t = body + _INT.unpack_from(buf, body - 4)[0]  # the topic length field
    if _UINT.unpack_from(buf, pos + 4)[0] == MAGIC_V2:
        tl = _SHORT.unpack_from(buf, t)[0]
        t += 2
    else:
        tl = buf[t]
        t += 1
    topic = bytes(buf[t:t + tl])
    if not topic or topic.translate(None, LEGAL_TOPIC_BYTES) or tl > MAX_TOPIC_BYTES:
        return f"topic {topic[:40]!r} is not a legal topic name"
    props = bytes(buf[t + tl + 2:end])
    why = properties_problem(props)
    if why is None and not props.isascii():
        try:
            props.decode("utf-8")
        except UnicodeDecodeError as e:
            why = f"properties are not UTF-8 ({e.reason} at {e.start})"
    return why


def intact_head(buf: Any, pos: int, limit: int, base: int) -> int | None:
    """STORETIMESTAMP of the record at ``pos`` when its header and body are intact (magic, size in bounds,
    PHYSICALOFFSET equal to its position, BODYCRC) whatever its topic and properties hold; None otherwise.

    Such a record was written whole once: when recovery stops at it, its store time says whether the
    checkpoint counts it as flushed (then the damage is the disk's, not a torn write).
    """
    try:
        header = _HEADERS[buf[pos + _SYSFLAG_POS + 3] & 0x30]
        h = header.unpack_from(buf, pos)
    except (IndexError, struct.error):
        return None
    total, magic, crc, phy, blen = h[0], h[1], h[2], h[6], h[16]
    b = pos + header.size
    if magic not in (MAGIC_V1, MAGIC_V2) or phy != base + pos or not header.size <= total <= limit - pos or \
            not 0 <= blen <= total - header.size:
        return None
    with memoryview(buf) as mv:  # (an empty body's BODYCRC is 0: a header zeroed from its BODYLENGTH on fails)
        if _crc32(mv[b:b + blen]) & 0x7FFFFFFF != crc:
            return None
    return h[11]


def tail_reason(why: str, offset: int) -> str:
    return (f"damaged record tail at commitlog offset {offset}: {why}; no CRC covers the topic and properties "
            "(a write a power loss cut short)")


def walk(buf: Any, pos: int, limit: int, *, check_crc: bool, read_body: bool = False,
         parsed: bool = False, base: int | None = None, strict: bool = False
         ) -> Iterator[tuple[int, int, Any, str | None]]:
    """Records of one segment from ``pos`` as (position, size, message, problem), per :func:`check`.

    Ends after a blank record (size 0), or after the first record that is not
    valid (message None, with the reason); all-zero bytes end it silently, as
    the normal end of written data.  ``parsed=True`` yields :func:`parse`'s
    tuple instead of a message, for walks that decode only what they need.
    ``base`` (the commitlog offset of ``buf[0]``): accept only trusted records,
    whose PHYSICALOFFSET is their position (see :func:`check`); a walk that hands
    out messages must pass it, or a stale copy of a record reads as a second message.
    ``strict``: also :func:`tail_problem` (see :func:`check`).
    """
    while pos < limit:
        size, msg, reason = check(buf, pos, limit, check_crc=check_crc, read_body=read_body, parsed=parsed,
                                  base=base, strict=strict)
        if msg is None and size != 0 and buf[pos:pos + 8] == _ZERO8:
            return
        yield pos, size, msg, reason
        if msg is None:
            return
        pos += size


_ZERO8 = bytes(8)
_MAGIC_BYTES = (_UINT.pack(MAGIC_V1), _UINT.pack(MAGIC_V2), _UINT.pack(BLANK_MAGIC))


def find_record(buf: Any, pos: int, limit: int, base: int, *, check_crc: bool) -> int | None:
    """The first position at or after ``pos`` where an intact record starts, or None before ``limit``.

    How a reader resynchronises past a damaged record: a candidate is a magic
    code found by ``find`` (C speed), accepted when the record there passes
    :func:`check` and its PHYSICALOFFSET is ``base`` plus its position, or when
    it is a blank record that ends the file (``len(buf)`` is the file size).
    """
    nexts = [buf.find(m, pos + 4, limit) for m in _MAGIC_BYTES]
    while True:
        live = [h for h in nexts if h >= 0]
        if not live:
            return None
        h = min(live)
        p = h - 4
        which = nexts.index(h)
        if which == 2:
            if _INT.unpack_from(buf, p)[0] == len(buf) - p:
                return p
        elif p + 36 <= limit and _LONG.unpack_from(buf, p + 28)[0] == base + p and \
                check(buf, p, limit, check_crc=check_crc, parsed=True, base=base)[1] is not None:
            return p
        nexts[which] = buf.find(_MAGIC_BYTES[which], h + 1, limit)

# TOTALSIZE, MAGICCODE, BODYCRC, QUEUEID, PHYSICALOFFSET, SYSFLAG and (IPv4 hosts) BODYLENGTH: only what a scan needs.
_SCAN = struct.Struct(">iIii12xqi44xi")
_V6_EXTRA = {0x00: 0, SYSFLAG_BORNHOST_V6: 12, SYSFLAG_STOREHOST_V6: 12, SYSFLAG_BORNHOST_V6 | SYSFLAG_STOREHOST_V6: 24}
NO_INDEX = 1 << 63


def scan_records(buf: Any, pos: int, stop: int, limit: int, *, base: int, check_crc: bool,
                 held: Mapping[tuple[bytes, int], int] | None = None,
                 index_from: int = NO_INDEX, strict: bool = False) -> tuple[int, int, int, list[int]]:
    """Recovery's hot loop: accept the valid records from ``pos`` while they start before ``stop``.

    A record is accepted only where :func:`walk` (``parsed=True``) would accept
    it *and* its PHYSICALOFFSET equals ``base + position``; the scan ends
    silently at the first record it does not accept (invalid, blank, zeros, or
    past ``stop``), so the caller re-checks that one with :func:`walk` for the
    exact reason.  Per record it costs one small ``unpack_from``, a few byte
    reads and the CRC-32 over a memoryview of the body (no copies, no
    objects), which is what lets recovery run near CRC speed.

    Returns (position after the last accepted record, position of that record
    or -1, records accepted, wanted).  ``wanted`` lists the accepted records
    that recovery may still have to dispatch: those at or past ``index_from``
    (ROLLBACK excluded), and NOT_TYPE/COMMIT records whose ``(topic bytes,
    queue id)`` is missing from ``held`` or whose end passes the offset held
    there (a consume queue's max physical offset); ``held=None`` asks for
    none of those.  ``buf`` must slice to ``bytes`` (an ``mmap`` or ``bytes``).
    ``strict``: as :func:`walk`'s (recovery after a power loss).
    """
    up = _SCAN.unpack_from
    short_at = _SHORT.unpack_from
    crc32 = _crc32
    get = (held if held is not None else {}).get
    miss = -1 if held is not None else NO_INDEX  # held=None: no record is wanted for a queue
    wanted: list[int] = []
    want = wanted.append
    n, last = 0, -1
    held_topic, held_qid, held_end = None, None, miss
    mv = memoryview(buf)
    try:
        while pos < stop:
            total, magic, crc, qid, phy, sf, blen = up(buf, pos)
            b = pos + 88  # body
            if sf & 0x30:
                b += _V6_EXTRA[sf & 0x30]
                blen = _INT.unpack_from(buf, b - 4)[0]
            end = pos + total
            p = b + blen  # topic length
            if phy != base + pos or not b <= p < end <= limit:
                break
            if magic == MAGIC_V1:
                tl = buf[p]
                t = p + 1
                if tl > 127:
                    break
            elif magic == MAGIC_V2:
                tl = _SHORT.unpack_from(buf, p)[0]
                t = p + 2
                if tl < 0:
                    break
            else:
                break
            q = t + tl  # properties length
            plen = short_at(buf, q)[0]
            if plen < 0 or q + 2 + plen != end:
                break
            if check_crc and blen and crc32(mv[b:p]) & 0x7FFFFFFF != crc:
                break
            page = (base + end - 1) // PAGE_SIZE * PAGE_SIZE - base
            if page >= p and page > pos and torn_tail(buf, pos, end, base) is not None:
                break  # (walk gives the reason)
            if strict and tail_problem(buf, pos, end) is not None:
                break
            txn = sf & TRANSACTION_MASK
            if txn == TRANSACTION_NOT_TYPE or txn == TRANSACTION_COMMIT:
                topic = buf[t:q]
                if qid != held_qid or topic != held_topic:  # runs of one queue look ``held`` up once
                    held_end = get((topic, qid), miss)
                    held_topic, held_qid = topic, qid
                if held_end < base + end or phy >= index_from:
                    want(pos)
            elif phy >= index_from and txn != TRANSACTION_ROLLBACK:
                want(pos)
            n += 1
            last = pos
            pos = end
    except (struct.error, IndexError):
        pass
    finally:
        mv.release()
    return pos, last, n, wanted


def read_store_timestamp(buf: Any, pos: int) -> int:
    """STORETIMESTAMP of the record at ``pos`` (its position depends on the born host family)."""
    sys_flag = _INT.unpack_from(buf, pos + 36)[0]
    return _LONG.unpack_from(buf, pos + (68 if sys_flag & SYSFLAG_BORNHOST_V6 else 56))[0]


# ---------------------------------------------------------------- encoding

# An encoded record, ready to be written under the put lock (a tuple: cheap to build and unpack):
# (header struct, total, magic, bodyCRC, queueId, flag, sysFlag, bornTimestamp, bornAddr, bornPort,
#  storeAddr, storePort, reconsumeTimes, preparedTransactionOffset, body, tail = topic and properties).
EncodedRecord = tuple


def encode(topic: str, body: bytes, *, queue_id: int = 0, flag: int = 0, sys_flag: int = 0,
           born_timestamp: int = 0, born_host: tuple[bytes, int] = (b"\x7f\x00\x00\x01", 0),
           store_host: tuple[bytes, int] = (b"\x7f\x00\x00\x01", 10911), reconsume_times: int = 0,
           prepared_transaction_offset: int = 0, properties: str = "", max_message_size: int = 4194304,
           auto_v2: bool = True) -> EncodedRecord:
    """Encode one record (RocketMQ's MessageExtEncoder) except the fields stamped under the put lock.

    The IPv6 sysFlag bits are set from the host address lengths.  Raises
    ``RecordError`` subclasses for bodies, properties and topics RocketMQ refuses.
    """
    born_addr, born_port = born_host
    store_addr, store_port = store_host
    sys_flag = with_host_flags(sys_flag, born_addr, store_addr)
    return encode_with_tail(topic_tail(topic, auto_v2), body, properties.encode("utf-8"), queue_id, flag, sys_flag,
                            born_timestamp, born_addr, born_port, store_addr, store_port, reconsume_times,
                            prepared_transaction_offset, max_message_size)


def with_host_flags(sys_flag: int, born_addr: bytes, store_addr: bytes) -> int:
    """sysFlag with the IPv6 bits set from the actual address lengths (the store ORs them in itself)."""
    sys_flag &= ~(SYSFLAG_BORNHOST_V6 | SYSFLAG_STOREHOST_V6)
    if len(born_addr) == 16:
        sys_flag |= SYSFLAG_BORNHOST_V6
    if len(store_addr) == 16:
        sys_flag |= SYSFLAG_STOREHOST_V6
    return sys_flag


def topic_tail(topic: str, auto_v2: bool = True) -> tuple[bytes, int, bytes]:
    """The topic part of a record (length + UTF-8 bytes), its magic (V2 when the topic has > 127 Java chars),
    and the record's whole tail when it has no properties (the common case, built once per topic)."""
    tb = topic.encode("utf-8")
    v2 = auto_v2 and java_len(topic) > 127
    if len(tb) > 32767:
        raise RecordError("topic longer than 32767 bytes")
    if not v2 and len(tb) > 127:
        raise RecordError(f"topic is {len(tb)} UTF-8 bytes; a V1 record holds at most 127")
    head = (_SHORT.pack(len(tb)) if v2 else _BYTE.pack(len(tb))) + tb
    return head, MAGIC_V2 if v2 else MAGIC_V1, head + _SHORT.pack(0)


def encode_with_tail(topic: tuple[bytes, int, bytes], body: bytes, props: bytes, queue_id: int, flag: int, sys_flag: int,
                     born_ts: int, born_addr: bytes, born_port: int, store_addr: bytes, store_port: int,
                     reconsume: int, prepared: int, max_message_size: int) -> EncodedRecord:
    """The shared encoder; ``topic`` comes from :func:`topic_tail` (callers cache it per topic)."""
    if len(props) > MAX_PROPERTIES_BYTES:
        raise PropertiesTooLarge(f"properties are {len(props)} bytes, more than {MAX_PROPERTIES_BYTES}")
    blen = len(body)
    if blen > max_message_size:
        raise MessageTooLarge(f"body is {blen} bytes, more than maxMessageSize {max_message_size}")
    header = _HEADERS[sys_flag & 0x30]
    tail = topic[0] + _SHORT.pack(len(props)) + props if props else topic[2]
    total = header.size + blen + len(tail)
    if total > max_message_size + 65536:
        raise MessageTooLarge(f"record is {total} bytes, more than maxMessageSize + 64 KiB")
    return (header, total, topic[1], _crc32(body) & 0x7FFFFFFF, queue_id, flag, sys_flag, born_ts, born_addr,
            born_port, store_addr, store_port, reconsume, prepared, body, tail)


def record_parts(rec: EncodedRecord, queue_offset: int, physical_offset: int, store_ts: int) -> tuple[bytes, bytes,
                                                                                                   bytes]:
    """The record as (header, body, tail) with the fields known only under the put lock: what a gathered
    ``pwritev`` takes as it is, so the body goes from the caller's buffer to the file in one copy."""
    (header, total, magic, crc, queue_id, flag, sys_flag, born_ts, born_addr, born_port, store_addr, store_port,
     reconsume, prepared, body, tail) = rec
    return (header.pack(total, magic, crc, queue_id, flag, queue_offset, physical_offset, sys_flag, born_ts,
                        born_addr, born_port, store_ts, store_addr, store_port, reconsume, prepared, len(body)),
            body, tail)


def batch_parts(records: list[EncodedRecord], queue_offset: int, step: int, physical_offset: int,
                store_ts: int) -> tuple[list[bytes], list[int]]:
    """:func:`record_parts` of a whole batch in one pass: the (header, body, tail) buffers of every record,
    one after another, and each record's physical offset.  Queue offsets go up by ``step`` (0 for
    transaction halves, which store 0).  A :class:`~rocketstore.format.run.RecordRun` lays out its own."""
    if type(records) is not list:
        return records.parts(queue_offset, step, physical_offset, store_ts)
    iov: list[bytes] = []
    offsets: list[int] = []
    add = offsets.append
    q = queue_offset
    p = physical_offset
    for (header, total, magic, crc, queue_id, flag, sys_flag, born_ts, born_addr, born_port, store_addr, store_port,
         reconsume, prepared, body, tail) in records:
        iov += (header.pack(total, magic, crc, queue_id, flag, q, p, sys_flag, born_ts, born_addr, born_port,
                            store_ts, store_addr, store_port, reconsume, prepared, len(body)), body, tail)
        add(p)
        p += total
        q += step
    return iov, offsets


def records_size(records: list[EncodedRecord]) -> int:
    """Bytes the records take in the commitlog (a RecordRun knows its own)."""
    if type(records) is not list:
        return records.size
    return records[0][1] if len(records) == 1 else sum(r[1] for r in records)


def record_sizes(records: list[EncodedRecord]) -> list[int] | tuple[int]:
    """Each record's TOTALSIZE, in order (a RecordRun has them as a column)."""
    if type(records) is not list:
        return records.sizes
    return (records[0][1],) if len(records) == 1 else [r[1] for r in records]


def write_record(buf: Any, pos: int, rec: EncodedRecord, queue_offset: int, physical_offset: int,
                 store_ts: int) -> None:
    """Write an encoded record at ``pos`` of a buffer or map: :func:`record_parts`'s fields, the header packed
    in place (no header bytes made and copied: a single put's record goes into the map this way)."""
    (header, total, magic, crc, queue_id, flag, sys_flag, born_ts, born_addr, born_port, store_addr, store_port,
     reconsume, prepared, body, tail) = rec
    header.pack_into(buf, pos, total, magic, crc, queue_id, flag, queue_offset, physical_offset, sys_flag, born_ts,
                     born_addr, born_port, store_ts, store_addr, store_port, reconsume, prepared, len(body))
    p = pos + header.size
    e = p + len(body)
    buf[p:e] = body
    buf[e:pos + total] = tail


def encode_bytes(*args: Any, queue_offset: int = 0, physical_offset: int = 0, store_timestamp: int = 0,
                 **kw: Any) -> bytearray:
    """A whole record as bytes (tests and tools; the store writes straight into its segments)."""
    rec = encode(*args, **kw)
    out = bytearray(rec[1])
    write_record(out, 0, rec, queue_offset, physical_offset, store_timestamp)
    return out


def blank_record(remaining: int) -> bytes:
    """The 8-byte end-of-file record: the bytes left in the file, then the blank magic."""
    return _HEAD8.pack(remaining, BLANK_MAGIC)


class MessageTooLarge(RecordError):
    """Body or record over maxMessageSize (MESSAGE_ILLEGAL)."""


class PropertiesTooLarge(RecordError):
    """Properties over 32767 bytes (PROPERTIES_SIZE_EXCEEDED)."""
