"""BrokerConfig: the broker's own settings, read from the same ``broker.conf`` as the store's.

Keys use RocketMQ's BrokerConfig/ProxyConfig names where RocketMQ has one
(``brokerName``, ``autoCreateTopicEnable``, ``defaultTopicQueueNums``,
``transactionTimeOut``, ``transactionCheckInterval``, ``transactionCheckMax``,
``messageDelayLevel`` ...).  Keys of StoreConfig go to the store; anything else
is refused so that typos show.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Mapping

from ..config import StoreConfig, _convert, read_conf_file, require
from ..errors import ConfigError

DEFAULT_DELAY_LEVELS = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
_UNITS = {"ms": 1, "s": 1000, "m": 60000, "h": 3600000, "d": 86400000}


@dataclass
class BrokerConfig:
    """Broker settings (times in milliseconds unless the name says otherwise)."""

    brokerName: str = "rocketstore"
    # Unset: on, unless authorizationEnabled (serve --acl), where every name a user may publish to would
    # otherwise cost a topic (config entry, consume queue files) on first use.
    autoCreateTopicEnable: bool | None = None
    defaultTopicQueueNums: int = 8
    autoCreateSubscriptionGroup: bool = True
    # Topics and groups created on first use, per second (burst as large); more get TOO_MANY_REQUESTS.
    autoCreateRatePerSecond: int = 10
    # Where a new consumer group starts: FIRST (oldest message still stored) or LAST (only new messages).
    consumeFromWhere: str = "FIRST"
    # retryMaxTimes of auto-created groups: max deliveries = retryMaxTimes + 1 (RocketMQ: 16 -> 17).
    defaultRetryMaxTimes: int = 16
    # Push consumers NACK with these delays (settings.backoff_policy.customized_backoff), by attempt.
    messageDelayLevel: str = DEFAULT_DELAY_LEVELS
    # Invisible time of auto-renewed (push) receipts, renewed this long before expiry, for at most renewMaxTime.
    popAutoRenewInvisibleTime: int = 60000
    popRenewAheadTime: int = 10000
    popRenewMaxTime: int = 3 * 3600 * 1000
    # Invisible time bounds of ReceiveMessage and ChangeInvisibleDuration (proxy: 10 s .. 12 h for receive).
    minInvisibleTime: int = 1000
    maxInvisibleTime: int = 12 * 3600 * 1000
    # Long polling: the client's value is clamped to this maximum (and to its deadline).
    longPollingTimeout: int = 20000
    maxLongPollingTimeout: int = 30000
    maxReceiveBatchSize: int = 32
    # Receives waiting for messages at once (RocketMQ's maxPopPollingSize); one more gets TOO_MANY_REQUESTS.
    maxPopPollingSize: int = 100000
    # Unacked span per (group, queue) after which no new message is popped from that queue.
    popMaxSpan: int = 100000
    # Delay messages: at most this far ahead (proxy: one day).
    maxDelayTime: int = 24 * 3600 * 1000
    # Transactions: first check after transactionTimeOut, then every transactionCheckInterval, at most
    # transactionCheckMax checks, then the half message is discarded.
    transactionTimeOut: int = 6000
    transactionCheckInterval: int = 30000
    transactionCheckMax: int = 15
    # Consumer offsets and receipt state are written this often when they changed.
    flushConsumerOffsetInterval: int = 1000
    # An ack is answered only once its effect (popState.json and consumerOffset.json) is on disk, so a crash
    # never brings an acked message back; acks arriving meanwhile share a write.
    popAckSyncFlush: bool = False
    # A client is gone when it has no Telemetry stream and sent no heartbeat for this long.
    clientExpireTime: int = 60000
    # Threads that run blocking store calls (puts wait for the flush in SYNC_FLUSH mode).
    storeThreads: int = 32
    # ACL 2.0 (``serve --acl`` sets both): check the clients' signatures, and their users' permissions, against
    # authConfigPath (default <store>/config/acl.json).  A signed date-time further than authDateTimeSkew from
    # the broker's clock is refused.
    authenticationEnabled: bool = False
    authorizationEnabled: bool = False
    authConfigPath: str = ""
    authDateTimeSkew: int = 15 * 60 * 1000
    # Admin endpoint (HTTP: the CLI's live verbs and /metrics) on adminHost:adminPort; 0 picks a free port,
    # -1 turns it off.  Its address is written to <store>/config/admin.json while the broker runs.
    adminHost: str = "127.0.0.1"
    adminPort: int = 0
    # Request bytes being read or handled at once, overall and per connection.  A call reserves the largest frame
    # it could carry (grpc.max_receive_message_length) before its request is read, and waits up to a second for
    # room; then it gets gRPC RESOURCE_EXHAUSTED.  Each must be at least that frame (~9 MiB at the default
    # maxMessageSize).  Unauthenticated calls (ACL on) are refused before any of their bytes are read.
    maxInflightRequestBytes: int = 256 * 1024 * 1024
    maxInflightRequestBytesPerConnection: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, key: str, why: str) -> None:
            require(self, ok, key, why)

        need(1 <= self.defaultTopicQueueNums <= 1024, "defaultTopicQueueNums", "must be in 1..1024")
        need(1 <= self.autoCreateRatePerSecond <= 100000, "autoCreateRatePerSecond", "must be in 1..100000")
        need(self.consumeFromWhere in ("FIRST", "LAST"), "consumeFromWhere", "must be FIRST or LAST")
        need(self.defaultRetryMaxTimes >= 0, "defaultRetryMaxTimes", "must not be negative")
        need(0 < self.minInvisibleTime <= self.maxInvisibleTime, "minInvisibleTime",
             "must be positive and at most maxInvisibleTime")
        need(self.popAutoRenewInvisibleTime > self.popRenewAheadTime > 0, "popRenewAheadTime",
             "must be positive and below popAutoRenewInvisibleTime")
        need(1 <= self.maxReceiveBatchSize <= 1024, "maxReceiveBatchSize", "must be in 1..1024")
        need(self.maxPopPollingSize >= 1, "maxPopPollingSize", "must be at least 1")
        need(self.popMaxSpan >= 100, "popMaxSpan", "must be at least 100")
        need(self.longPollingTimeout > 0 and self.maxLongPollingTimeout >= self.longPollingTimeout,
             "longPollingTimeout", "must be positive and at most maxLongPollingTimeout")
        for key in ("transactionTimeOut", "transactionCheckInterval", "flushConsumerOffsetInterval",
                    "clientExpireTime", "maxDelayTime", "authDateTimeSkew"):
            need(getattr(self, key) > 0, key, "must be positive")
        need(self.transactionCheckMax >= 1, "transactionCheckMax", "must be at least 1")
        need(self.maxInflightRequestBytes >= self.maxInflightRequestBytesPerConnection > 0,
             "maxInflightRequestBytesPerConnection", "must be positive and at most maxInflightRequestBytes")
        need(1 <= self.storeThreads <= 512, "storeThreads", "must be in 1..512")
        need(-1 <= self.adminPort <= 65535, "adminPort", "must be a port (0 picks a free one, -1 turns it off)")
        try:
            levels = self.delay_levels_seconds()
        except ValueError as e:
            raise ConfigError(f"messageDelayLevel={self.messageDelayLevel}: {e}") from None
        need(bool(levels), "messageDelayLevel", "needs at least one delay")

    @property
    def auto_create_topics(self) -> bool:
        if self.autoCreateTopicEnable is None:
            return not self.authorizationEnabled
        return self.autoCreateTopicEnable

    def delay_levels_seconds(self) -> list[int]:
        """``messageDelayLevel`` as whole seconds (the Python client reads whole seconds), at least 1 each."""
        return [max(1, parse_duration_ms(t) // 1000) for t in self.messageDelayLevel.split()]

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, source: str = "config") -> "BrokerConfig":
        types = {f.name: f.type for f in fields(cls)}
        kwargs = {}
        for key, raw in values.items():
            if key not in types:
                raise ConfigError(f"{source}: unknown broker key {key!r}")
            typ = types[key]
            if typ == "bool | None":  # unset means a computed default, a set value is a plain bool
                typ = "bool"
            kwargs[key] = _convert(raw, typ, f"{source}: {key}")
        return cls(**kwargs)

    def replace(self, **changes: Any) -> "BrokerConfig":
        return dataclasses.replace(self, **changes)


BROKER_KEYS = frozenset(f.name for f in fields(BrokerConfig))
_STORE_KEYS = frozenset(f.name for f in fields(StoreConfig))


def parse_duration_ms(text: str) -> int:
    """``500ms``, ``1s``, ``2m``, ``1h``, ``1d`` or a bare number of milliseconds."""
    t = text.strip().lower()
    for unit in ("ms", "s", "m", "h", "d"):
        if t.endswith(unit) and t[: -len(unit)].strip().isdigit():
            return int(t[: -len(unit)]) * _UNITS[unit]
    if t.isdigit():
        return int(t)
    raise ValueError(f"bad duration {text!r}: expected e.g. 500ms, 1s, 2m, 1h")


def load_broker_conf(path: str | None) -> tuple[StoreConfig | None, BrokerConfig]:
    """Split one ``broker.conf`` into the store's settings (None when it sets none) and the broker's."""
    if not path:
        return None, BrokerConfig()
    values = read_conf_file(path)
    broker = {k: v for k, v in values.items() if k in BROKER_KEYS}
    store = {k: v for k, v in values.items() if k not in BROKER_KEYS}
    store_cfg = StoreConfig.from_mapping(store, source=path)  # refuses unknown keys
    if not any(k in _STORE_KEYS for k in store):
        store_cfg = None  # let the store infer its geometry from its files
    return store_cfg, BrokerConfig.from_mapping(broker, source=path)
