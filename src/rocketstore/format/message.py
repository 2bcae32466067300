"""What callers put and what they get back: Message, PutMessageResult, GetMessageResult and statuses."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import codec
from .codec import MessageExt


class PutMessageStatus(str, enum.Enum):
    PUT_OK = "PUT_OK"
    FLUSH_DISK_TIMEOUT = "FLUSH_DISK_TIMEOUT"
    FLUSH_SLAVE_TIMEOUT = "FLUSH_SLAVE_TIMEOUT"
    SLAVE_NOT_AVAILABLE = "SLAVE_NOT_AVAILABLE"
    SERVICE_NOT_AVAILABLE = "SERVICE_NOT_AVAILABLE"
    CREATE_MAPPED_FILE_FAILED = "CREATE_MAPPED_FILE_FAILED"
    MESSAGE_ILLEGAL = "MESSAGE_ILLEGAL"
    PROPERTIES_SIZE_EXCEEDED = "PROPERTIES_SIZE_EXCEEDED"
    OS_PAGE_CACHE_BUSY = "OS_PAGE_CACHE_BUSY"
    UNKNOWN_ERROR = "UNKNOWN_ERROR"


class GetMessageStatus(str, enum.Enum):
    FOUND = "FOUND"
    NO_MATCHED_MESSAGE = "NO_MATCHED_MESSAGE"
    MESSAGE_WAS_REMOVING = "MESSAGE_WAS_REMOVING"
    OFFSET_FOUND_NULL = "OFFSET_FOUND_NULL"
    OFFSET_OVERFLOW_BADLY = "OFFSET_OVERFLOW_BADLY"
    OFFSET_OVERFLOW_ONE = "OFFSET_OVERFLOW_ONE"
    OFFSET_TOO_SMALL = "OFFSET_TOO_SMALL"
    NO_MATCHED_LOGIC_QUEUE = "NO_MATCHED_LOGIC_QUEUE"
    NO_MESSAGE_IN_QUEUE = "NO_MESSAGE_IN_QUEUE"


LOCALHOST = (b"\x7f\x00\x00\x01", 0)
DEFAULT_STORE_HOST = (b"\x7f\x00\x00\x01", 10911)


# Message's fields past (topic, body, queue_id), in constructor order, with their defaults ("properties": a
# fresh dict per message).
_MORE_FIELDS = ("tags", "keys", "properties", "flag", "sys_flag", "born_timestamp", "born_host", "store_host",
                "reconsume_times", "prepared_transaction_offset", "properties_string", "store_timestamp", "deliver_at",
                "delay_level")
_MORE_DEFAULTS = (None, None, None, 0, 0, None, None, None, 0, 0, None, None, None, 0)
_PROPERTIES = _MORE_FIELDS.index("properties")


def _more_field(i: int, name: str) -> property:
    default = _MORE_DEFAULTS[i]

    def get(self: "Message") -> Any:
        more = self._more
        return default if more is None else more[i]

    def set_(self: "Message", value: Any) -> None:
        more = self._more
        if more is None:
            more = self._more = [*_MORE_DEFAULTS]
            more[_PROPERTIES] = {}
        more[i] = value

    return property(get, set_, doc=f"Message.{name}")


class Message:
    """A message to put.  ``tags``/``keys`` are shorthands for the TAGS/KEYS properties.

    ``properties_string`` (exact stored bytes) wins over ``properties`` when
    given: ``import`` uses it to reproduce RocketMQ's files byte for byte.
    ``store_timestamp`` is honoured only by imports (replay); a live put stamps
    the time itself.  ``deliver_at`` (epoch ms) or ``delay_level`` (RocketMQ's
    levels 1..18: 1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h)
    make it a delay message: the store keeps it in the timer topic until then
    (a put refuses a level outside 1..18, or a negative time, MESSAGE_ILLEGAL).

    Most messages a program builds have only a topic, a body and a queue: such
    a message keeps nothing else (its other fields read as their defaults), so
    building it costs three stores, and ``put_batch`` tells a batch of them
    apart from the rest with one look per message (:func:`batch_bodies`).  Any
    other field, given or set later, keeps all of them; every field reads and
    sets as a plain attribute either way.
    """

    __slots__ = ("topic", "body", "queue_id", "_more")
    __match_args__ = ("topic", "body", "queue_id", *_MORE_FIELDS)
    __hash__ = None  # type: ignore[assignment]  # (mutable, compared by value)

    topic: str
    body: bytes
    queue_id: int
    tags: str | None
    keys: str | list[str] | None
    properties: Mapping[str, str]
    flag: int
    sys_flag: int
    born_timestamp: int | None
    born_host: str | tuple[bytes, int] | None
    store_host: str | tuple[bytes, int] | None
    reconsume_times: int
    prepared_transaction_offset: int
    properties_string: str | None
    store_timestamp: int | None
    deliver_at: int | None
    delay_level: int

    def __init__(self, topic: str, body: bytes = b"", queue_id: int = 0, tags: str | None = None,
                 keys: str | list[str] | None = None, properties: Mapping[str, str] | None = None, flag: int = 0,
                 sys_flag: int = 0, born_timestamp: int | None = None, born_host: str | tuple[bytes, int] | None = None,
                 store_host: str | tuple[bytes, int] | None = None, reconsume_times: int = 0,
                 prepared_transaction_offset: int = 0, properties_string: str | None = None,
                 store_timestamp: int | None = None, deliver_at: int | None = None, delay_level: int = 0) -> None:
        self.topic = topic
        self.body = body
        self.queue_id = queue_id
        if tags is None and keys is None and properties is None and flag == 0 and sys_flag == 0 and \
                born_timestamp is None and born_host is None and store_host is None and reconsume_times == 0 and \
                prepared_transaction_offset == 0 and properties_string is None and store_timestamp is None and \
                deliver_at is None and delay_level == 0:
            self._more: list[Any] | None = None
        else:
            self._more = [tags, keys, {} if properties is None else properties, flag, sys_flag, born_timestamp,
                          born_host, store_host, reconsume_times, prepared_transaction_offset, properties_string,
                          store_timestamp, deliver_at, delay_level]

    def _values(self) -> tuple[Any, ...]:
        more = self._more
        return (self.topic, self.body, self.queue_id,
                *((None, None, {}, *_MORE_DEFAULTS[3:]) if more is None else more))

    def __eq__(self, other: object) -> Any:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        names = ("topic", "body", "queue_id", *_MORE_FIELDS)
        return f"Message({', '.join(f'{n}={v!r}' for n, v in zip(names, self._values()))})"

    def __getstate__(self) -> tuple[Any, ...]:
        return self.topic, self.body, self.queue_id, self._more

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.topic, self.body, self.queue_id, self._more = state

    def build_properties(self) -> str:
        if self.properties_string is not None:
            return self.properties_string
        if self.tags is None and self.keys is None:
            return codec.properties_to_string(self.properties)
        props = dict(self.properties)
        if self.tags is not None:
            props["TAGS"] = self.tags
        if self.keys is not None:
            props["KEYS"] = self.keys if isinstance(self.keys, str) else " ".join(self.keys)
        return codec.properties_to_string(props)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Message":
        """A message from one ``dump`` line, keeping every stored field (``body`` is base64 unless
        ``bodyEncoding`` is ``"utf-8"``, as ``dump --text-bodies`` writes valid UTF-8 bodies)."""
        import base64
        encoding = d.get("bodyEncoding", "base64")
        if encoding not in ("base64", "utf-8"):
            raise ValueError(f"bodyEncoding {encoding!r}: expected 'base64' or 'utf-8'")
        if "topic" not in d:
            raise ValueError("no topic")
        f = functools.partial(_json_field, d)
        raw = f("body", str, None) or ""
        body = raw.encode("utf-8") if encoding == "utf-8" else base64.b64decode(raw)
        return cls(topic=f("topic", str, None), body=body, queue_id=f("queueId", int, 0),
                   flag=f("flag", int, 0), sys_flag=f("sysFlag", int, 0), born_timestamp=f("bornTimestamp", int, None),
                   born_host=f("bornHost", str, None), store_host=f("storeHost", str, None),
                   reconsume_times=f("reconsumeTimes", int, 0),
                   prepared_transaction_offset=f("preparedTransactionOffset", int, 0),
                   properties_string=f("propertiesString", str, None), properties=f("properties", dict, None) or {},
                   store_timestamp=f("storeTimestamp", int, None))


def _json_field(d: Mapping[str, Any], key: str, kind: type, default: Any) -> Any:
    """``d[key]`` when it is of JSON type ``kind`` (``default`` when absent or null): a dump line edited by hand
    is refused naming the field, never handed to the encoder (whose struct packing would fail mid-put)."""
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        name = {int: "an integer", str: "a string", dict: "an object"}[kind]
        raise ValueError(f"{key} {value!r}: expected {name}")
    return value


for _i, _name in enumerate(_MORE_FIELDS):
    if _i != _PROPERTIES:
        setattr(Message, _name, _more_field(_i, _name))


def _get_properties(self: Message) -> Mapping[str, str]:
    more = self._more
    if more is None:  # a dict the caller may fill in: kept, as a field default would be
        more = self._more = [*_MORE_DEFAULTS]
        more[_PROPERTIES] = {}
    return more[_PROPERTIES]


def _set_properties(self: Message, value: Mapping[str, str]) -> None:
    _get_properties(self)
    self._more[_PROPERTIES] = value  # type: ignore[index]


Message.properties = property(_get_properties, _set_properties, doc="Message.properties")  # type: ignore[assignment]
del _i, _name

def is_plain(m: Message) -> bool:
    """Whether ``m`` has nothing but a topic, a body and a queue id (every other field at its default)."""
    return m._more is None


def more_fields(m: Message) -> tuple[Any, ...]:
    """``m``'s fields past (topic, body, queue_id) in constructor order (:data:`_MORE_FIELDS`), in one call:
    what an encoder reads of a message that is not plain."""
    more = m._more
    return (None, None, {}, *_MORE_DEFAULTS[3:]) if more is None else tuple(more)


def batch_bodies(messages: list[Message]) -> list[bytes] | None:
    """The bodies of a batch whose messages are all plain (:func:`is_plain`), of one topic and queue, with
    ``bytes`` bodies; None for any other batch.  Each test is one pass over the batch: a comprehension, whose
    attribute reads the interpreter specialises to slot reads (a third cheaper than ``map`` with an
    ``attrgetter``, which looks each attribute up through the type), and one ``count``."""
    n = len(messages)
    first = messages[0]
    topic, queue_id = first.topic, first.queue_id
    if [m._more for m in messages].count(None) != n or [m.topic for m in messages].count(topic) != n or \
            [m.queue_id for m in messages].count(queue_id) != n:
        return None
    bodies = [m.body for m in messages]
    return bodies if list(map(type, bodies)).count(bytes) == n else None


def host_tuple(h: str | tuple[bytes, int]) -> tuple[bytes, int]:
    """A host as (address bytes, port), from Java's text form or a tuple."""
    if isinstance(h, str):
        return codec.parse_host(h)
    return h


class PutMessageResult:
    """What a put returns.  ``msg_id`` (offset message ids, comma-joined for a batch) is formatted only when
    read, from the store host and the offsets: most callers never look at it, and for a batch it is most of
    the result's cost."""

    __slots__ = ("status", "commit_log_offset", "wrote_bytes", "queue_offset", "store_timestamp", "msg_num",
                 "error", "_msg_id", "_id_host", "_offsets")

    def __init__(self, status: PutMessageStatus, commit_log_offset: int = -1, wrote_bytes: int = 0,
                 queue_offset: int = -1, msg_id: str = "", store_timestamp: int = 0, msg_num: int = 0,
                 error: str | None = None, id_host: tuple[bytes, int] | None = None,
                 offsets: list[int] | None = None) -> None:
        self.status = status
        self.commit_log_offset = commit_log_offset
        self.wrote_bytes = wrote_bytes
        self.queue_offset = queue_offset
        self.store_timestamp = store_timestamp
        self.msg_num = msg_num
        self.error = error
        self._msg_id = msg_id
        self._id_host = id_host  # (store address, port): with the offsets, what msg_id is formatted from
        self._offsets = offsets

    @property
    def msg_id(self) -> str:
        if self._id_host is not None:
            addr, port = self._id_host
            self._msg_id = ",".join(codec.offset_msg_id(addr, port, o)
                                    for o in self._offsets or (self.commit_log_offset,))
            self._id_host = None
        return self._msg_id

    @property
    def offsets(self) -> list[int]:
        """The commitlog offset of each message put, in put order (one for a single put)."""
        return list(self._offsets) if self._offsets else [self.commit_log_offset]

    @property
    def ok(self) -> bool:
        return self.status is PutMessageStatus.PUT_OK

    def to_json(self) -> dict[str, Any]:
        d = {"status": self.status.value, "commitLogOffset": self.commit_log_offset, "wroteBytes": self.wrote_bytes,
             "queueOffset": self.queue_offset, "msgId": self.msg_id, "storeTimestamp": self.store_timestamp,
             "msgNum": self.msg_num}
        if self.error:
            d["error"] = self.error
        return d

    def __repr__(self) -> str:
        return (f"PutMessageResult(status={self.status.name}, commit_log_offset={self.commit_log_offset}, "
                f"wrote_bytes={self.wrote_bytes}, queue_offset={self.queue_offset}, msg_id={self.msg_id!r}, "
                f"store_timestamp={self.store_timestamp}, msg_num={self.msg_num}, error={self.error!r})")


@dataclass(slots=True)
class GetMessageResult:
    status: GetMessageStatus
    next_begin_offset: int
    min_offset: int
    max_offset: int
    messages: list[MessageExt] = field(default_factory=list)

    def to_json(self, with_body: bool = True) -> dict[str, Any]:
        return {"status": self.status.value, "nextBeginOffset": self.next_begin_offset,
                "minOffset": self.min_offset, "maxOffset": self.max_offset,
                "messages": [m.to_json(with_body) for m in self.messages]}


@dataclass(slots=True)
class QueryMessageResult:
    phy_offsets: list[int]
    messages: list[MessageExt]
    index_last_update_timestamp: int = 0
    index_last_update_phyoffset: int = 0

    def to_json(self, with_body: bool = True) -> dict[str, Any]:
        return {"phyOffsets": self.phy_offsets, "messages": [m.to_json(with_body) for m in self.messages],
                "indexLastUpdateTimestamp": self.index_last_update_timestamp,
                "indexLastUpdatePhyoffset": self.index_last_update_phyoffset}


def parse_tag_filter(expr: str | None) -> set[int] | None:
    """``"TagA || TagB"`` to the set of tag hash codes; ``*``/empty/None means every tag."""
    if expr is None:
        return None
    expr = expr.strip()
    if not expr or expr == "*":
        return None
    return {codec.java_hash(t.strip()) for t in expr.split("||") if t.strip()}


_TOPIC_CHARS = frozenset(codec.LEGAL_TOPIC_BYTES.decode("ascii"))  # (recovery's codec.tail_problem: the same)
NAME_MAX = codec.MAX_TOPIC_BYTES  # bytes in one file name: a topic names its consume-queue directory


def illegal_topic(topic: object) -> str | None:
    """Why a topic is refused (None when it is legal): RocketMQ's broker checks (present, of legal
    characters), and short enough to name its consume-queue directory."""
    if not isinstance(topic, str) or not topic:
        return "topic is empty"
    if not set(topic) <= _TOPIC_CHARS:
        bad = sorted(set(topic) - _TOPIC_CHARS)[:3]
        return f"topic {topic[:40]!r} has illegal characters {bad} (allowed: letters, digits, %|-_)"
    if len(topic) > NAME_MAX:  # legal characters are ASCII: one byte each
        return (f"topic {topic[:40]!r}... is {len(topic)} characters; a consume-queue directory name holds "
                f"at most {NAME_MAX}")
    return None
