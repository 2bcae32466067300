"""StoreConfig: RocketMQ's MessageStoreConfig fields, by their own names and defaults.

The field names are RocketMQ's camelCase names on purpose: the same key works
in a ``broker.conf`` file, in Python and in the docs.  Only fields that the
store uses are here; unknown keys in a file are refused so that typos show.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
from dataclasses import dataclass, fields
from typing import Any, Mapping
from urllib.parse import urlparse

from .errors import ConfigError

ASYNC_FLUSH = "ASYNC_FLUSH"
SYNC_FLUSH = "SYNC_FLUSH"
CQ_UNIT_SIZE = 20
MIN_COMMITLOG_FILE_SIZE = 4096

# The keys that fix the size of files already on disk: a store's files, not its config, decide them
# unless a key is set explicitly (see geometry.py).
GEOMETRY_KEYS = ("mappedFileSizeCommitLog", "mappedFileSizeConsumeQueue", "maxHashSlotNum", "maxIndexNum")

# ``rocketstore init --preset``: the geometry written into a new store's broker.conf.  ``default`` is
# RocketMQ's (1 GiB segments, 420 MB index files); ``small`` suits an embedded store: 64 MiB segments,
# consume-queue files of 30,000 units (600 KB) and 4.2 MB index files (50,000 slots, 200,000 entries).
PRESETS: dict[str, dict[str, int]] = {
    "default": {"mappedFileSizeCommitLog": 1024 * 1024 * 1024, "mappedFileSizeConsumeQueue": 300000 * CQ_UNIT_SIZE,
                "maxHashSlotNum": 5000000, "maxIndexNum": 5000000 * 4},
    "small": {"mappedFileSizeCommitLog": 64 * 1024 * 1024, "mappedFileSizeConsumeQueue": 30000 * CQ_UNIT_SIZE,
              "maxHashSlotNum": 50000, "maxIndexNum": 50000 * 4},
}

# Broker-side keys that may sit in a broker.conf beside the store's; accepted and ignored.
_BROKER_KEYS = {"brokerClusterName", "brokerName", "brokerId", "brokerRole", "namesrvAddr",
                "listenPort", "haListenPort", "brokerIP1", "brokerIP2", "storePathRootDir",
                "storePathCommitLog", "autoCreateTopicEnable", "defaultTopicQueueNums"}


def require(config: object, ok: bool, key: str, why: str) -> None:
    """Raise ConfigError naming ``key`` and its value unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}={getattr(config, key)}: {why}")


_FIELD_TYPES: dict[Any, type] = {"int": int, "bool": bool, "str": str}


@dataclass
class StoreConfig:
    """Store settings (RocketMQ 5.3.3 names and defaults).

    Each instance remembers which keys were given explicitly (as arguments, in
    a conf file, or through :meth:`replace`) and where: :attr:`explicit`.  Only
    those geometry keys may contradict the files of an existing store (and then
    the open is refused); the others are measured from the files.
    """

    mappedFileSizeCommitLog: int = 1024 * 1024 * 1024  # 1 GiB segments
    mappedFileSizeConsumeQueue: int = 300000 * CQ_UNIT_SIZE  # 6,000,000 bytes
    maxHashSlotNum: int = 5000000
    maxIndexNum: int = 5000000 * 4
    maxMessageSize: int = 1024 * 1024 * 4  # 4 MiB body
    maxMsgsNumBatch: int = 64  # queryMessage cap
    messageIndexEnable: bool = True
    messageIndexSafe: bool = False
    autoMessageVersionOnTopicLen: bool = True
    checkCRCOnRecover: bool = True
    flushDiskType: str = ASYNC_FLUSH
    flushIntervalCommitLog: int = 500  # ms
    flushCommitLogLeastPages: int = 4
    flushCommitLogThoroughInterval: int = 10000  # ms
    flushIntervalConsumeQueue: int = 1000  # ms
    flushConsumeQueueLeastPages: int = 2
    flushConsumeQueueThoroughInterval: int = 60000  # ms
    syncFlushTimeout: int = 5000  # ms
    cleanResourceInterval: int = 10000  # ms
    deleteWhen: str = "04"
    fileReservedTime: int = 72  # hours
    deleteCommitLogFilesInterval: int = 100  # ms
    deleteConsumeQueueFilesInterval: int = 100  # ms
    destroyMapedFileIntervalForcibly: int = 120000  # ms (RocketMQ's spelling)
    redeleteHangedFileInterval: int = 120000  # ms
    deleteFileBatchMax: int = 10
    diskMaxUsedSpaceRatio: int = 75  # percent
    diskSpaceWarningLevelRatio: int = 90  # percent
    diskSpaceCleanForciblyRatio: int = 85  # percent
    diskMinFreeBytes: int = 0  # rocketstore: refuse puts below this many free bytes (0 = off)
    cleanFileForciblyEnable: bool = True
    topicRetentionMs: str = ""  # rocketstore: logical per-topic retention, "TopicA:3600000;TopicB:60000"
    maxTransferBytesOnMessageInMemory: int = 256 * 1024
    maxTransferCountOnMessageInMemory: int = 32
    maxTransferBytesOnMessageInDisk: int = 64 * 1024
    maxTransferCountOnMessageInDisk: int = 8
    accessMessageInMemoryMaxRatio: int = 40
    maxFilterMessageSize: int = 16000
    warmMapedFileEnable: bool = False
    warmAheadBytes: int = 64 * 1024 * 1024  # rocketstore: page cache read ahead of the commitlog writer (0 = off)
    # Tiered storage (rocketstore; the object-store keys are RocketMQ tieredstore's): sealed segments and their
    # consume-queue and index files are copied to s3://bucket/prefix (or file:///dir), and old offsets read there.
    tieredStoreUri: str = ""
    tieredStoreUploadInterval: int = 10000  # ms between upload rounds
    tieredStoreFileReservedTime: int = 72  # hours the tier keeps a segment (RocketMQ's default; 0 = forever)
    objectStoreEndpoint: str = ""  # e.g. http://127.0.0.1:9000 (default: AWS, or $AWS_ENDPOINT_URL)
    objectStoreRegion: str = ""
    objectStoreAccessKey: str = ""  # default: the AWS environment / credential chain
    objectStoreSecretKey: str = ""
    # rocketstore.queues (issue 27): a SimpleConsumer's ack is fsynced before ack() returns (the broker's
    # popAckSyncFlush); off: acks are gathered and written with the next receive, at 256 or after 0.2 s.
    ackSyncFlush: bool = False

    def __new__(cls, *args: Any, **kwargs: Any) -> "StoreConfig":
        self = super().__new__(cls)
        names = [f.name for f in fields(cls)]
        self.__dict__["_explicit"] = dict.fromkeys([*names[:len(args)], *kwargs], "StoreConfig")
        return self

    def __post_init__(self) -> None:
        for f in fields(self):  # StoreConfig(maxMessageSize="4096"): named here, not a TypeError from a comparison
            want = _FIELD_TYPES.get(f.type)
            value = getattr(self, f.name)
            if want is not None and (not isinstance(value, want) or (want is int and isinstance(value, bool))):
                raise ConfigError(f"{f.name}={value!r}: expected {f.type}, not {type(value).__name__} "
                                  "(StoreConfig.load and from_mapping convert strings)")
        self.validate()

    @property
    def explicit(self) -> dict[str, str]:
        """The keys given explicitly, each with where it was given (a file path or ``StoreConfig``)."""
        return dict(self.__dict__.get("_explicit", {}))

    # ------------------------------------------------------------ validation
    def validate(self) -> None:
        """Refuse values the files cannot work with; the message names the key."""
        def need(ok: bool, key: str, why: str) -> None:
            require(self, ok, key, why)

        need(self.mappedFileSizeCommitLog >= MIN_COMMITLOG_FILE_SIZE, "mappedFileSizeCommitLog",
             f"a commitlog segment must be at least {MIN_COMMITLOG_FILE_SIZE} bytes")
        need(self.mappedFileSizeConsumeQueue > 0 and self.mappedFileSizeConsumeQueue % CQ_UNIT_SIZE == 0,
             "mappedFileSizeConsumeQueue", "must be a positive multiple of the 20-byte unit")
        need(self.maxHashSlotNum > 0, "maxHashSlotNum", "must be positive")
        need(self.maxIndexNum > 1, "maxIndexNum", "must be at least 2 (entry 0 is never used)")
        need(40 + 4 * self.maxHashSlotNum + 20 * self.maxIndexNum < 2 ** 31, "maxIndexNum",
             "index file would exceed 2 GiB")
        need(self.maxMessageSize > 0, "maxMessageSize", "must be positive")
        need(self.flushDiskType in (ASYNC_FLUSH, SYNC_FLUSH), "flushDiskType",
             f"must be {ASYNC_FLUSH} or {SYNC_FLUSH}")
        need(self.maxMsgsNumBatch > 0, "maxMsgsNumBatch", "must be positive")
        for key in ("diskMaxUsedSpaceRatio", "diskSpaceWarningLevelRatio", "diskSpaceCleanForciblyRatio"):
            need(0 < getattr(self, key) <= 100, key, "must be a percentage in (0, 100]")
        for key in ("warmAheadBytes", "flushIntervalCommitLog", "flushIntervalConsumeQueue", "syncFlushTimeout",
                    "cleanResourceInterval", "fileReservedTime", "deleteFileBatchMax", "tieredStoreFileReservedTime"):
            need(getattr(self, key) >= 0, key, "must not be negative")
        need(self.tieredStoreUploadInterval > 0, "tieredStoreUploadInterval", "must be positive")
        if self.tieredStoreUri:
            TierLocation.parse(self.tieredStoreUri)
        try:
            self.topic_retention()
        except ValueError:
            raise ConfigError(f"topicRetentionMs={self.topicRetentionMs}: expected TOPIC:MILLIS;TOPIC:MILLIS") from None
        try:
            [int(h) for h in self.deleteWhen.split(";") if h.strip()]
        except ValueError:
            raise ConfigError(f"deleteWhen={self.deleteWhen}: hours must be numbers separated by ';'") from None

    def topic_retention(self) -> dict[str, int]:
        """topicRetentionMs as {topic: milliseconds}."""
        out = {}
        for item in self.topicRetentionMs.split(";"):
            if item.strip():
                topic, sep, ms = item.strip().rpartition(":")
                if not sep or not topic or int(ms) <= 0:
                    raise ValueError(item)
                out[topic] = int(ms)
        return out

    # ------------------------------------------------------------ loading
    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, source: str = "config") -> "StoreConfig":
        """Build from string or typed values, converting each to its field's type."""
        types = {f.name: f.type for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, raw in values.items():
            if key in _BROKER_KEYS:
                continue
            if key not in types:
                raise ConfigError(f"{source}: unknown key {key!r}")
            kwargs[key] = _convert(raw, types[key], f"{source}: {key}")
        try:
            cfg = cls(**kwargs)
        except ConfigError as e:  # name where the refused value was written, as the conversion errors do
            raise ConfigError(f"{source}: {e}") from None
        cfg.__dict__["_explicit"] = dict.fromkeys(kwargs, source)
        return cfg

    @classmethod
    def load(cls, path: str) -> "StoreConfig":
        """Read a ``broker.conf`` style file: ``key=value`` lines, ``#`` comments."""
        return cls.from_mapping(read_conf_file(path), source=path)

    def replace(self, **changes: Any) -> "StoreConfig":
        """A copy with ``changes``, which count as set explicitly."""
        return self._copy(changes, {**self.explicit, **dict.fromkeys(changes, "StoreConfig")})

    def inferred(self, **changes: Any) -> "StoreConfig":
        """A copy with values measured from the files: they do not count as set explicitly."""
        return self._copy(changes, self.explicit)

    def overlay(self, other: "StoreConfig") -> "StoreConfig":
        """This config with the keys ``other`` sets explicitly; a geometry key both set differently is refused."""
        mine, theirs = self.explicit, other.explicit
        for key in GEOMETRY_KEYS:
            if key in mine and key in theirs and getattr(self, key) != getattr(other, key):
                raise ConfigError(f"{key}: {theirs[key]} says {getattr(other, key)} but {mine[key]} says "
                                  f"{getattr(self, key)}; refusing to open")
        return self._copy({k: getattr(other, k) for k in theirs}, {**mine, **theirs})

    def _copy(self, changes: dict[str, Any], explicit: dict[str, str]) -> "StoreConfig":
        cfg = dataclasses.replace(self, **changes)
        cfg.__dict__["_explicit"] = explicit
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def read_conf_file(path: str) -> dict[str, str]:
    """The ``key=value`` lines of a ``broker.conf`` style file (``#`` starts a comment line)."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror}") from None
    values: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise ConfigError(f"{path}:{n}: expected key=value, got {line!r}")
        k, _, v = line.partition("=")
        values[k.strip()] = v.strip()
    return values


def _convert(raw: Any, typ: Any, where: str) -> Any:
    name = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    try:
        if name == "bool":
            if isinstance(raw, bool):
                return raw
            s = str(raw).strip().lower()
            if s not in ("true", "false"):
                raise ValueError
            return s == "true"
        if name == "int":
            if isinstance(raw, bool):
                raise ValueError
            return int(str(raw).strip()) if not isinstance(raw, int) else raw
        return str(raw)
    except ValueError:
        raise ConfigError(f"{where}: {raw!r} is not a valid {name}") from None


def write_preset(path: str, preset: str) -> None:
    """Write a ``broker.conf`` holding a preset's geometry (``rocketstore init``)."""
    lines = [f"# rocketstore init --preset {preset}: this store's file geometry (RocketMQ key names)"]
    lines += [f"{k}={v}" for k, v in PRESETS[preset].items()]
    with open(path, "x", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")


def golden_config() -> StoreConfig:
    """The small geometry the golden stores (and tests) use."""
    return StoreConfig(mappedFileSizeCommitLog=1048576, mappedFileSizeConsumeQueue=6000,
                       maxHashSlotNum=1000, maxIndexNum=4000)


def total_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 * 1024 ** 3


@dataclass(frozen=True)
class TierLocation:
    """Where a tier lives: ``s3://bucket/prefix`` or ``file:///path``, and how to reach it."""

    uri: str
    scheme: str
    bucket: str  # s3 bucket, or "" for file://
    prefix: str  # key prefix inside the bucket (no leading/trailing slash), or the local directory
    endpoint: str = ""
    region: str = ""
    access_key: str = ""
    secret_key: str = ""

    @classmethod
    def parse(cls, uri: str, *, endpoint: str = "", region: str = "", access_key: str = "",
              secret_key: str = "") -> "TierLocation":
        u = urlparse(uri)
        if u.scheme in ("s3", "s3a"):
            if not u.netloc:
                raise ConfigError(f"tieredStoreUri={uri}: no bucket (expected s3://bucket/prefix)")
            return cls(uri, "s3", u.netloc, u.path.strip("/"), endpoint, region, access_key, secret_key)
        if u.scheme == "file":
            if not u.path.startswith("/"):
                raise ConfigError(f"tieredStoreUri={uri}: a file URI needs an absolute path (file:///dir)")
            return cls(uri, "file", "", u.path.rstrip("/") or "/")
        raise ConfigError(f"tieredStoreUri={uri}: expected s3://bucket/prefix or file:///directory")

    @classmethod
    def from_options(cls, uri: str, options: Mapping[str, Any]) -> "TierLocation":
        """From a URI and RocketMQ-named options (a StoreConfig's dict, Spark options, broker.conf keys)."""
        return cls.parse(uri, endpoint=str(options.get("objectStoreEndpoint") or ""),
                         region=str(options.get("objectStoreRegion") or ""),
                         access_key=str(options.get("objectStoreAccessKey") or ""),
                         secret_key=str(options.get("objectStoreSecretKey") or ""))

    def key(self, *parts: str) -> str:
        """The filesystem path of an object: ``bucket/prefix/part/...`` (or the local path)."""
        base = self.prefix if self.scheme == "file" else posixpath.join(self.bucket, self.prefix) if self.prefix \
            else self.bucket
        return posixpath.join(base, *parts)
