"""MessageEncoder: a message as a record ready for the put lock, and what the dispatcher needs of it.

RocketMQ's MessageExtEncoder serialises a message on the send path before the
put lock is taken; the fields only known under the lock (queue offset,
physical offset, store time) are stamped when the record is written.  The store
encodes each put with one of these, and a Spark append's tasks encode their
rows with one too, so that the driver's commit only stamps and writes.
"""

from __future__ import annotations

import struct
from typing import Any

from . import codec
from ..config import StoreConfig
from .message import (DEFAULT_STORE_HOST, LOCALHOST, Message, batch_bodies, host_tuple, illegal_topic, is_plain,
                      more_fields)

# (tagsCode, KEYS, UNIQ_KEY) of a message with no properties: nothing for the dispatcher to parse.
PLAIN_DISPATCH = (0, None, None)
# Per-put dispatch columns (tagsCodes, KEYS, UNIQ_KEYs, index key hashes), each None when all are 0 or absent.
PLAIN_COLUMNS = (None, None, None, None)

# From this many messages a batch that differs only in its bodies is encoded as a RecordRun (numpy's
# per-call cost is paid once per batch; below this a tuple per record is cheaper).
RUN_MIN = 8

_record_run = None  # format.run.RecordRun, imported with the first batch (numpy), not with the package


def _import_record_run() -> type:
    global _record_run
    from .run import RecordRun
    _record_run = RecordRun
    return RecordRun


_CACHE_TOPICS = 10000
_CACHE_TAGS = 100000


class MessageEncoder:
    """Encodes messages for one store's limits (maxMessageSize, autoMessageVersionOnTopicLen), caching the
    per-topic record tail and the per-tags hash code (a writer sees few of either)."""

    def __init__(self, max_message_size: int = StoreConfig.maxMessageSize, auto_v2: bool = True) -> None:
        self.max_message_size = max_message_size
        self.auto_v2 = auto_v2
        self._topics: dict[str, tuple[bytes, int, bytes]] = {}  # codec.topic_tail per topic
        self._tags_codes: dict[str, int] = {}

    @classmethod
    def for_config(cls, cfg: StoreConfig) -> MessageEncoder:
        return cls(cfg.maxMessageSize, cfg.autoMessageVersionOnTopicLen)

    def topic(self, name: str) -> tuple[bytes, int, bytes]:
        """The topic's record tail (:func:`codec.topic_tail`); raises codec.RecordError for an illegal topic."""
        t = self._topics.get(name)
        if t is None:
            err = illegal_topic(name)
            if err:
                raise codec.RecordError(err)
            t = codec.topic_tail(name, self.auto_v2)
            if len(self._topics) > _CACHE_TOPICS:
                self._topics.clear()
            self._topics[name] = t
        return t

    def encode(self, m: Message, now_ms: int) -> codec.EncodedRecord:
        """Validate and encode one message (raises codec.RecordError subclasses or ValueError)."""
        topic = self._topics.get(m.topic) or self.topic(m.topic)
        body = m.body
        if type(body) is not bytes:
            if not isinstance(body, (bytearray, memoryview)):
                raise codec.RecordError(f"body must be bytes, not {type(body).__name__}")
            body = bytes(body)
        queue_id = m.queue_id
        if not 0 <= queue_id < 2 ** 31:
            raise codec.RecordError(f"queue id {queue_id} out of range")
        if is_plain(m):  # topic, body and queue: every other field is its default
            return codec.encode_with_tail(topic, body, b"", queue_id, 0, 0, now_ms, LOCALHOST[0], 0,
                                          DEFAULT_STORE_HOST[0], DEFAULT_STORE_HOST[1], 0, 0, self.max_message_size)
        (tags, keys, properties, flag, sys_flag, born_ts, born_host, store_host, reconsume, prepared,
         properties_string, store_ts, _, _) = more_fields(m)
        if properties_string is not None:
            props = properties_string.encode("utf-8")
        elif tags is None and keys is None:  # (what build_properties does then, from the fields read above)
            props = codec.properties_to_string(properties).encode("utf-8") if properties else b""
        else:
            props = m.build_properties().encode("utf-8")
        if props:  # never a record recovery after a power loss would take for a torn write (codec.tail_problem)
            if properties_string is None:
                # One 0x02 ends each pair and one 0x01 ends each name: more of either, a separator is inside a
                # name or value.
                pairs = props.count(b"\x02")
                if pairs != props.count(b"\x01") or pairs != _entries(properties, tags, keys):
                    _refuse_separators(properties, tags, keys)
            why = codec.properties_problem(props)
            if why is not None:
                raise codec.RecordError(f"{why}: a torn write could not be told from this (RocketMQ writes "
                                        "name\\x01value\\x02 pairs, no zero byte)")
        born_addr, born_port = LOCALHOST if born_host is None else host_tuple(born_host)
        store_addr, store_port = DEFAULT_STORE_HOST if store_host is None else host_tuple(store_host)
        try:  # the header packs these under the put lock: a value it cannot hold must be refused here
            _NUMBERS.pack(flag, sys_flag, reconsume, born_port, store_port, 0 if born_ts is None else born_ts,
                          prepared, 0 if store_ts is None else store_ts)
        except struct.error:
            _refuse_number(flag=flag, sys_flag=sys_flag, reconsume_times=reconsume, born_port=born_port,
                           store_port=store_port, born_timestamp=born_ts, prepared_transaction_offset=prepared,
                           store_timestamp=store_ts)
        if sys_flag & 0x30 or len(born_addr) != 4 or len(store_addr) != 4:
            sys_flag = codec.with_host_flags(sys_flag, born_addr, store_addr)
        return codec.encode_with_tail(topic, body, props, queue_id, flag, sys_flag,
                                      now_ms if born_ts is None else born_ts, born_addr, born_port,
                                      store_addr, store_port, reconsume, prepared, self.max_message_size)

    def encode_batch(self, messages: list[Message], now_ms: int,
                     bodies: list[bytes] | None = None) -> tuple[list[codec.EncodedRecord], bool]:
        """Encode a batch of one topic and queue (``batch_problem`` has said so) in one pass.

        A batch of at least RUN_MIN plain messages of one topic and queue
        (:func:`~rocketstore.format.message.batch_bodies`) becomes a :class:`~rocketstore.format.run.RecordRun`:
        the first message is encoded as a single put is, the rest are a column
        of bodies.  Otherwise the topic tail, the queue check, the header
        format and the hosts are settled once for the batch; a plain message
        (bytes body, no properties, default hosts) then costs one CRC and one
        tuple.  Any other message goes through :meth:`encode`, so the records
        are byte for byte the ones :meth:`encode` makes.  Also returns whether
        every message was plain: then the dispatcher needs nothing parsed of
        them (:data:`PLAIN_COLUMNS`, outside the delay topic).  ``bodies``: what
        the caller had from ``batch_bodies`` (None: look here).
        """
        first = messages[0]
        if bodies is None and len(messages) >= RUN_MIN:
            bodies = batch_bodies(messages)
        if bodies is not None:
            lens = list(map(len, bodies))
            if max(lens) <= self.max_message_size:  # (else the general pass refuses the message that is over)
                run = _record_run or _import_record_run()
                return run(self.encode(first, now_ms), bodies, lens), True
        topic = self._topics.get(first.topic) or self.topic(first.topic)
        queue_id = first.queue_id
        if not 0 <= queue_id < 2 ** 31:
            raise codec.RecordError(f"queue id {queue_id} out of range")
        header = codec.IPV4_HEADER
        _, magic, tail = topic
        fixed = header.size + len(tail)
        limit = self.max_message_size
        born_addr, born_port = LOCALHOST
        store_addr, store_port = DEFAULT_STORE_HOST
        crc32 = codec.crc32
        encode = self.encode
        out: list[codec.EncodedRecord] = []
        append = out.append
        plain = True
        for m in messages:
            body = m.body
            if type(body) is not bytes or len(body) > limit or not is_plain(m):
                append(encode(m, now_ms))  # (the general path also raises what a bad message deserves)
                plain = plain and is_plain(m)
                continue
            append((header, fixed + len(body), magic, crc32(body) & 0x7FFFFFFF, queue_id, 0, 0, now_ms, born_addr,
                    born_port, store_addr, store_port, 0, 0, body, tail))
        return out, plain

    def tags_code(self, tags: str) -> int:
        """ConsumeQueue tagsCode of a message's TAGS (Java's hashCode), cached per tags string."""
        code = self._tags_codes.get(tags)
        if code is None:
            if len(self._tags_codes) > _CACHE_TAGS:
                self._tags_codes.clear()
            code = self._tags_codes[tags] = codec.java_hash(tags)
        return code

    def dispatch_info(self, m: Message) -> tuple[int, str | None, str | None] | None:
        """(tagsCode, KEYS, UNIQ_KEY) as dispatch would parse them from the stored properties, or None when
        only the stored record can tell (a verbatim properties string, the delay topic, separator characters)."""
        if m.topic == codec.SCHEDULE_TOPIC:
            return None
        if is_plain(m):
            return PLAIN_DISPATCH  # the common message: no tags, no keys
        tags, keys, props, _, _, _, _, _, _, _, properties_string, _, _, _ = more_fields(m)
        if properties_string is not None:
            return None
        if not props and tags is None and keys is None:
            return PLAIN_DISPATCH
        if tags is None:
            tags = props.get("TAGS")
        if keys is None:
            keys = props.get("KEYS")
        elif not isinstance(keys, str):
            keys = " ".join(keys)
        uniq = props.get("UNIQ_KEY")
        for v in (tags, keys, uniq):
            if v is not None and ("\x01" in v or "\x02" in v):
                return None
        return (self.tags_code(tags) if tags else 0), keys or None, uniq or None

    def dispatch_columns(self, messages: list[Message]) -> tuple | None:
        """The dispatch columns of a put's messages (see PLAIN_COLUMNS), or None when the log must tell."""
        if len(messages) == 1:
            info = self.dispatch_info(messages[0])
            if info is None or info is PLAIN_DISPATCH:
                return None if info is None else PLAIN_COLUMNS
            code, keys, uniq = info
            return (None if not code else [code], None if keys is None else [keys],
                    None if uniq is None else [uniq], None)
        infos = [self.dispatch_info(m) for m in messages]
        if infos.count(PLAIN_DISPATCH) == len(infos):
            return PLAIN_COLUMNS
        if None in infos:
            return None
        codes, keys, uniqs = zip(*infos)
        return (list(codes) if any(codes) else None, None if keys.count(None) == len(keys) else list(keys),
                None if uniqs.count(None) == len(uniqs) else list(uniqs), None)


def _entries(properties: dict[str, str] | None, tags: str | None, keys: Any) -> int:
    """How many name/value pairs the properties string of these fields holds (exactly: one more 0x02 than
    this is a separator inside a name or value)."""
    if not properties:
        return (tags is not None) + (keys is not None)
    n = len(properties)
    if None in properties.values():  # not written (properties_to_string skips it)
        n -= sum(v is None for v in properties.values())
    if tags is not None and properties.get("TAGS") is None:
        n += 1
    if keys is not None and properties.get("KEYS") is None:
        n += 1
    return n


def _refuse_separators(properties: dict[str, str] | None, tags: str | None, keys: Any) -> None:
    """Refuse a name holding 0x01 or 0x02, or a value holding 0x02 (RocketMQ's separators, never escaped): the
    record would read back as other properties (``{"k": "v\\x02x\\x01y"}`` as k=v and x=y; tags as another tag),
    not the message that was put.  A value may hold 0x01: the first 0x01 of a pair ends its name."""
    fields = dict(properties or {})
    if tags is not None:
        fields["TAGS"] = tags
    if keys is not None:
        fields["KEYS"] = keys if isinstance(keys, str) else " ".join(keys)
    for name, value in fields.items():
        if value is None:
            continue  # (not written)
        name, value = str(name), str(value)  # (written as formatted)
        if "\x01" in name or "\x02" in name:
            sep = "\\x01" if "\x01" in name else "\\x02"
            raise codec.RecordError(f"property name {name!r} holds {sep}, a separator of the properties string: "
                                    "it would read back as another property")
        if "\x02" in value:
            raise codec.RecordError(f"property {name!r}: its value holds \\x02, the pair separator of the "
                                    "properties string: it would read back as other properties")


# The record header's types: flag, sysFlag, reconsumeTimes, the two ports (int32); bornTimestamp,
# preparedTransactionOffset, storeTimestamp (int64).
_NUMBERS = struct.Struct(">iiiiiqqq")


def _refuse_number(**fields: Any) -> None:
    """Name the field the record header cannot hold (MESSAGE_ILLEGAL), not a struct.error from the put lock."""
    for bits, (name, value) in zip((32, 32, 32, 32, 32, 64, 64, 64), fields.items()):
        if value is None and name in ("born_timestamp", "store_timestamp"):
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not -2 ** (bits - 1) <= value < 2 ** (bits - 1):
            raise codec.RecordError(f"{name} {value!r}: the record holds a signed {bits}-bit integer there")
    raise codec.RecordError(f"{fields}: not integers the record header can hold")
