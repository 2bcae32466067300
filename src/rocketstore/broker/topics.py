"""Topics and consumer groups, kept in RocketMQ's ``config/topics.json`` and ``config/subscriptionGroup.json``.

topics.json (TopicConfigManager)::

    {"dataVersion": {"counter": 3, "stateVersion": 0, "timestamp": 1700000000000},
     "topicConfigTable": {"Orders": {"topicName": "Orders", "readQueueNums": 8, "writeQueueNums": 8,
                                     "perm": 6, "topicFilterType": "SINGLE_TAG", "topicSysFlag": 0,
                                     "order": false, "attributes": {"message.type": "FIFO"}}}}

``perm`` is RocketMQ's bit set (4 read, 2 write, 1 inherit).  The message type
is the ``message.type`` attribute: NORMAL, FIFO, DELAY, TRANSACTION or MIXED;
a topic without it accepts every type.

subscriptionGroup.json (SubscriptionGroupManager)::

    {"subscriptionGroupTable": {"GroupA": {"groupName": "GroupA", "consumeEnable": true,
                                           "consumeMessageOrderly": false, "retryMaxTimes": 16, ...}}}

``consumeMessageOrderly`` makes the group FIFO; ``retryMaxTimes + 1`` is the
group's maximum number of deliveries before a message goes to ``%DLQ%<group>``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..queues.timer import TIMER_TOPIC
from ..storage.jsonfile import read_json, write_json_atomic
from .writer import CoalescedWriter

log = logging.getLogger(__name__)

PERM_READ = 4
PERM_WRITE = 2
PERM_INHERIT = 1
MESSAGE_TYPES = ("NORMAL", "FIFO", "DELAY", "TRANSACTION")
TOPIC_TYPES = MESSAGE_TYPES + ("MIXED",)

TRANS_HALF_TOPIC = "RMQ_SYS_TRANS_HALF_TOPIC"
TRANS_OP_HALF_TOPIC = "RMQ_SYS_TRANS_OP_HALF_TOPIC"
SCHEDULE_TOPIC = "SCHEDULE_TOPIC_XXXX"
SYSTEM_TOPICS = (TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC, TIMER_TOPIC)
# RocketMQ's TopicValidator system topics: no client may route to, send to or consume from them.
RESERVED_TOPICS = frozenset(SYSTEM_TOPICS + (
    SCHEDULE_TOPIC, "TBW102", "BenchmarkTest", "RMQ_SYS_TRACE_TOPIC", "TRANS_CHECK_MAX_TIME_TOPIC",
    "SELF_TEST_TOPIC", "OFFSET_MOVED_EVENT"))
SYSTEM_TOPIC_PREFIXES = ("rmq_sys_", "RMQ_SYS_")
DLQ_PREFIX = "%DLQ%"
RETRY_PREFIX = "%RETRY%"
TRANS_GROUP = "CID_RMQ_SYS_TRANS"

_NAME = re.compile(r"[%a-zA-Z0-9_-]+")
MAX_TOPIC_LEN = 127
MAX_GROUP_LEN = 255


def illegal_name(name: str, what: str, max_len: int) -> str | None:
    """Why a topic or group name is not acceptable (the clients' own pattern), or None."""
    if not name or not name.strip():
        return f"{what} name is blank"
    if len(name) > max_len:
        return f"{what} name is longer than {max_len} characters"
    if not _NAME.fullmatch(name):  # fullmatch: "$" of re.match would let a trailing newline through
        return f"{what} name {name[:60]!r} does not match ^[%a-zA-Z0-9_-]+$"
    return None


def is_system_topic(name: str) -> bool:
    return name in RESERVED_TOPICS or name.startswith(SYSTEM_TOPIC_PREFIXES)


def is_broker_topic(name: str) -> bool:
    """A retry or dead letter topic: the broker writes them, clients only read them."""
    return name.startswith((RETRY_PREFIX, DLQ_PREFIX))


def dlq_topic(group: str) -> str:
    return DLQ_PREFIX + group


def _data_version(counter: int) -> dict[str, int]:
    return {"counter": counter, "stateVersion": 0, "timestamp": int(time.time() * 1000)}


@dataclass
class TopicConfig:
    name: str
    read_queue_nums: int = 8
    write_queue_nums: int = 8
    perm: int = PERM_READ | PERM_WRITE
    message_type: str | None = None  # None: accepts every type
    order: bool = False
    extra: dict[str, Any] | None = None  # fields we do not interpret, written back unchanged

    @property
    def readable(self) -> bool:
        return bool(self.perm & PERM_READ)

    @property
    def writable(self) -> bool:
        return bool(self.perm & PERM_WRITE)

    @property
    def queue_count(self) -> int:
        return max(self.read_queue_nums, self.write_queue_nums)

    def accepts(self) -> tuple[str, ...]:
        if self.message_type in MESSAGE_TYPES:
            return (self.message_type,)
        return MESSAGE_TYPES

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(self.extra or {})
        attrs = dict(d.get("attributes") or {})
        if self.message_type:
            attrs["message.type"] = self.message_type
        else:
            attrs.pop("message.type", None)
        d.update({"topicName": self.name, "readQueueNums": self.read_queue_nums,
                  "writeQueueNums": self.write_queue_nums, "perm": self.perm,
                  "topicFilterType": d.get("topicFilterType", "SINGLE_TAG"),
                  "topicSysFlag": d.get("topicSysFlag", 0), "order": self.order, "attributes": attrs})
        return d

    @classmethod
    def from_json(cls, name: str, d: dict[str, Any]) -> "TopicConfig":
        attrs = d.get("attributes") or {}
        mtype = attrs.get("message.type") or attrs.get("+message.type")
        mtype = str(mtype).upper() if mtype else None
        if mtype in ("UNSPECIFIED", "MIXED"):
            mtype = None if mtype == "UNSPECIFIED" else "MIXED"
        if mtype is not None and mtype not in TOPIC_TYPES:
            raise ConfigError(f"topic {name}: unknown message.type {mtype!r} (expected one of {', '.join(TOPIC_TYPES)})")
        try:
            rq = int(d.get("readQueueNums", 8))
            wq = int(d.get("writeQueueNums", rq))
            perm = int(d.get("perm", PERM_READ | PERM_WRITE))
        except (TypeError, ValueError):
            raise ConfigError(f"topic {name}: queue numbers and perm must be integers") from None
        if not (0 <= rq <= 1024 and 0 <= wq <= 1024) or rq + wq == 0:
            raise ConfigError(f"topic {name}: readQueueNums/writeQueueNums must be in 0..1024, not both 0")
        return cls(name, rq, wq, perm, mtype, bool(d.get("order", False)), dict(d))


@dataclass
class GroupConfig:
    name: str
    orderly: bool = False
    retry_max_times: int = 16
    consume_enable: bool = True
    extra: dict[str, Any] | None = None

    @property
    def max_attempts(self) -> int:
        return self.retry_max_times + 1

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"groupName": self.name, "consumeEnable": True, "consumeFromMinEnable": True,
                             "consumeBroadcastEnable": True, "consumeMessageOrderly": False,
                             "retryQueueNums": 1, "retryMaxTimes": 16, "brokerId": 0,
                             "whichBrokerWhenConsumeSlowly": 1, "notifyConsumerIdsChangedEnable": True,
                             "groupSysFlag": 0, "consumeTimeoutMinute": 15, "subscriptionDataSet": None,
                             "attributes": {}}
        d.update(self.extra or {})
        d.update({"groupName": self.name, "consumeMessageOrderly": self.orderly,
                  "retryMaxTimes": self.retry_max_times, "consumeEnable": self.consume_enable})
        return d

    @classmethod
    def from_json(cls, name: str, d: dict[str, Any]) -> "GroupConfig":
        try:
            retries = int(d.get("retryMaxTimes", 16))
        except (TypeError, ValueError):
            raise ConfigError(f"group {name}: retryMaxTimes must be an integer") from None
        if retries < 0:
            raise ConfigError(f"group {name}: retryMaxTimes must not be negative")
        return cls(name, bool(d.get("consumeMessageOrderly", False)), retries,
                   bool(d.get("consumeEnable", True)), dict(d))


class CreationThrottled(Exception):
    """More topics or groups asked to be created on first use than ``autoCreateRatePerSecond`` allows."""


class TokenBucket:
    """``rate`` tokens a second, at most ``rate`` saved up."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.tokens = float(rate)
        self.at = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class TopicManager:
    """topics.json and subscriptionGroup.json: loaded at start, rewritten atomically on every change.

    The broker's event loop creates topics and groups with the ``ensure_*`` coroutines: rate-limited, and
    written by a thread (one write for all creations made meanwhile); each returns once its entry is durable,
    so no message is acknowledged in a topic that a crash could forget.  ``put_*`` and ``get_*(create=True)``
    write at once (start-up, tools, tests).
    """

    def __init__(self, config_dir: str, *, auto_create_topics: bool, default_queues: int,
                 auto_create_groups: bool, default_retry_max_times: int, create_rate: int = 10) -> None:
        self.config_dir = config_dir
        self.topics_path = os.path.join(config_dir, "topics.json")
        self.groups_path = os.path.join(config_dir, "subscriptionGroup.json")
        self.auto_create_topics = auto_create_topics
        self.default_queues = default_queues
        self.auto_create_groups = auto_create_groups
        self.default_retry_max_times = default_retry_max_times
        self.topics: dict[str, TopicConfig] = {}
        self.groups: dict[str, GroupConfig] = {}
        self._topic_version = 0
        self._group_version = 0
        self._lock = threading.Lock()
        self._bucket = TokenBucket(create_rate)
        self._written: dict[str, int] = {}  # path -> dataVersion counter last written
        self._creating: dict[tuple[str, str], asyncio.Future] = {}  # ("topic"|"group", name) being written
        self._topic_writer = CoalescedWriter(self._topics_doc, self._write_topics)
        self._group_writer = CoalescedWriter(self._groups_doc, self._write_groups)
        self._load()

    def _load(self) -> None:
        data = read_json(self.topics_path) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{self.topics_path}: expected a JSON object")
        self._topic_version = int((data.get("dataVersion") or {}).get("counter", 0) or 0)
        for name, d in (data.get("topicConfigTable") or {}).items():
            if isinstance(d, dict):
                self.topics[name] = TopicConfig.from_json(name, d)
        data = read_json(self.groups_path) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{self.groups_path}: expected a JSON object")
        self._group_version = int((data.get("dataVersion") or {}).get("counter", 0) or 0)
        for name, d in (data.get("subscriptionGroupTable") or {}).items():
            if isinstance(d, dict):
                self.groups[name] = GroupConfig.from_json(name, d)
        for name in SYSTEM_TOPICS:
            if name not in self.topics:
                self.topics[name] = TopicConfig(name, 1, 1, PERM_READ | PERM_WRITE)
        log.info("%d topics, %d consumer groups", len(self.topics), len(self.groups))

    # ------------------------------------------------------------ topics
    def get_topic(self, name: str, *, create: bool = False) -> TopicConfig | None:
        t = self.topics.get(name)
        if t is None and create and self.auto_create_topics and not is_system_topic(name) \
                and not is_broker_topic(name):
            t = self.put_topic(TopicConfig(name, self.default_queues, self.default_queues))
            log.info("auto-created topic %s with %d queues", name, self.default_queues)
        return t

    def put_topic(self, t: TopicConfig) -> TopicConfig:
        self.topics[t.name] = t
        self._topic_version += 1
        self._write_topics(self._topics_doc())
        return t

    def delete_topic(self, name: str) -> TopicConfig | None:
        """Drop a topic's entry (the admin endpoint's deleteTopic); its messages stay until retention."""
        t = self.topics.pop(name, None)
        if t is not None:
            self._topic_version += 1
            self._write_topics(self._topics_doc())
        return t

    def _topics_doc(self) -> dict[str, Any]:
        return {"dataVersion": _data_version(self._topic_version),
                "topicConfigTable": {n: t.to_json() for n, t in sorted(self.topics.items())}}

    def _write_topics(self, doc: dict[str, Any]) -> None:
        self._write_newer(self.topics_path, doc)

    def _write_newer(self, path: str, doc: dict[str, Any]) -> None:
        """Write ``doc`` unless a newer version of the file was written meanwhile (by another thread)."""
        version = doc["dataVersion"]["counter"]
        with self._lock:
            if version >= self._written.get(path, -1):
                write_json_atomic(path, doc)
                self._written[path] = version

    def ready_topic(self, name: str) -> TopicConfig | None:
        """The topic when it exists and is not being written: what :meth:`ensure_topic` gives at once (the
        send path asks this first, without a coroutine)."""
        if ("topic", name) in self._creating:
            return None
        return self.topics.get(name)

    async def ensure_topic(self, name: str) -> TopicConfig | None:
        """The topic, created on first use when auto-creation allows it (None: unknown).

        Raises CreationThrottled past the creation rate, OSError when the file cannot be written.
        """
        await self._created(("topic", name))
        t = self.topics.get(name)
        if t is not None or not self.auto_create_topics or is_system_topic(name) or is_broker_topic(name):
            return t
        if not self._bucket.take():
            raise CreationThrottled(f"topic {name} not created: more than {self._bucket.rate} topics and groups "
                                    f"created per second")
        t = await self._create(("topic", name), TopicConfig(name, self.default_queues, self.default_queues))
        log.info("auto-created topic %s with %d queues", name, self.default_queues)
        return t

    async def ensure_dlq_topic(self, group: str) -> TopicConfig:
        name = dlq_topic(group)
        await self._created(("topic", name))
        t = self.topics.get(name)
        if t is None:
            t = await self._create(("topic", name), TopicConfig(name, 1, 1, PERM_READ | PERM_WRITE))
            log.info("created dead letter topic %s", name)
        return t

    async def _created(self, key: tuple[str, str]) -> None:
        """Wait until an entry being created by another request is written (or its write failed)."""
        pending = self._creating.get(key)
        if pending is not None:
            await asyncio.wait((pending,))

    async def _create(self, key: tuple[str, str], item: Any) -> Any:
        """Add ``item`` and return once its file is written; a cancelled caller does not stop the creation."""
        task = asyncio.get_running_loop().create_task(self._add_and_write(key, item))
        self._creating[key] = task
        task.add_done_callback(lambda _t: self._creating.pop(key, None))
        return await asyncio.shield(task)

    async def _add_and_write(self, key: tuple[str, str], item: Any) -> Any:
        kind, name = key
        table, writer = (self.topics, self._topic_writer) if kind == "topic" else (self.groups, self._group_writer)
        table[name] = item
        if kind == "topic":
            self._topic_version += 1
        else:
            self._group_version += 1
        try:
            await writer.flush()
        except Exception:
            if table.get(name) is item:
                del table[name]  # not durable: not created (a later request tries again)
            raise
        return item

    # ------------------------------------------------------------ groups
    def get_group(self, name: str, *, create: bool = False, orderly_hint: bool = False) -> GroupConfig | None:
        g = self.groups.get(name)
        if g is None and create and self.auto_create_groups:
            g = self.put_group(GroupConfig(name, orderly_hint, self.default_retry_max_times))
            log.info("auto-created consumer group %s (orderly=%s)", name, orderly_hint)
        return g

    def put_group(self, g: GroupConfig) -> GroupConfig:
        self.groups[g.name] = g
        self._group_version += 1
        self._write_groups(self._groups_doc())
        return g

    def delete_group(self, name: str) -> GroupConfig | None:
        """Drop a group's entry (deleteSubscriptionGroup); its committed offsets are kept."""
        g = self.groups.pop(name, None)
        if g is not None:
            self._group_version += 1
            self._write_groups(self._groups_doc())
        return g

    def _groups_doc(self) -> dict[str, Any]:
        return {"dataVersion": _data_version(self._group_version),
                "subscriptionGroupTable": {n: x.to_json() for n, x in sorted(self.groups.items())}}

    def _write_groups(self, doc: dict[str, Any]) -> None:
        self._write_newer(self.groups_path, doc)

    async def ensure_group(self, name: str, orderly_hint: bool = False) -> GroupConfig | None:
        """The group, created on first use when auto-creation allows it (see :meth:`ensure_topic`)."""
        await self._created(("group", name))
        g = self.groups.get(name)
        if g is not None or not self.auto_create_groups:
            return g
        if not self._bucket.take():
            raise CreationThrottled(f"group {name} not created: more than {self._bucket.rate} topics and groups "
                                    f"created per second")
        g = await self._create(("group", name), GroupConfig(name, orderly_hint, self.default_retry_max_times))
        log.info("auto-created consumer group %s (orderly=%s)", name, orderly_hint)
        return g


def parse_topic_spec(spec: str) -> TopicConfig:
    """``NAME[:QUEUES[:TYPE]]`` from the command line."""
    parts = spec.split(":")
    name = parts[0]
    why = illegal_name(name, "topic", MAX_TOPIC_LEN)
    if why:
        raise ConfigError(f"--topic {spec}: {why}")
    queues = 8
    mtype = None
    if len(parts) > 1 and parts[1]:
        if not parts[1].isdigit() or not 1 <= int(parts[1]) <= 1024:
            raise ConfigError(f"--topic {spec}: queue count must be in 1..1024")
        queues = int(parts[1])
    if len(parts) > 2 and parts[2]:
        mtype = parts[2].upper()
        if mtype not in TOPIC_TYPES:
            raise ConfigError(f"--topic {spec}: type must be one of {', '.join(TOPIC_TYPES)}")
    if len(parts) > 3:
        raise ConfigError(f"--topic {spec}: expected NAME[:QUEUES[:TYPE]]")
    return TopicConfig(name, queues, queues, PERM_READ | PERM_WRITE, mtype)


def parse_group_spec(spec: str, default_retry_max_times: int = 16) -> GroupConfig:
    """``NAME[:orderly=true,retryMaxTimes=N]`` from the command line."""
    name, _, opts = spec.partition(":")
    why = illegal_name(name, "group", MAX_GROUP_LEN)
    if why:
        raise ConfigError(f"--group {spec}: {why}")
    g = GroupConfig(name, False, default_retry_max_times)
    for opt in filter(None, (o.strip() for o in opts.split(","))):
        key, _, value = opt.partition("=")
        key = key.strip().lower()
        value = value.strip().lower() or "true"
        if key in ("orderly", "fifo", "consumemessageorderly"):
            if value not in ("true", "false"):
                raise ConfigError(f"--group {spec}: {key} must be true or false")
            g.orderly = value == "true"
        elif key in ("retrymaxtimes", "retries"):
            if not value.isdigit():
                raise ConfigError(f"--group {spec}: retryMaxTimes must be a non-negative integer")
            g.retry_max_times = int(value)
        else:
            raise ConfigError(f"--group {spec}: unknown option {key!r} (orderly, retryMaxTimes)")
    return g
