"""The ``rocketstore`` Spark data source: batch and streaming reads, and appends.

Registered with :func:`rocketstore.spark.register`.  Every class here is
pickled to Python workers, so all state is plain data (paths, offsets,
filters); files are opened inside ``read``/``write`` on the executors.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from ..errors import StoreError
from . import plan as planner
from . import queues, remote, segment
from .segment import RowFilter

log = logging.getLogger(__name__)

FORMAT = "rocketstore"
_SPARK_TYPES = {"string": StringType(), "int": IntegerType(), "bigint": LongType(), "timestamp": TimestampType(),
                "binary": BinaryType(), "map<string,string>": MapType(StringType(), StringType())}


# Option kafkaColumns=true: the columns of Spark's Kafka source (``topic`` is already one of ours), computed
# from the record's own fields, so that a job written for Kafka runs with only the format name changed.
KAFKA_FIELDS = [
    StructField("key", BinaryType(), True),  # the first KEYS entry (null without KEYS)
    StructField("value", BinaryType(), True),  # the body
    StructField("partition", IntegerType(), False),  # the queue id
    StructField("offset", LongType(), False),  # the queue offset
    StructField("timestamp", TimestampType(), False),  # the store time
    StructField("timestampType", IntegerType(), False),  # 1, Kafka's LogAppendTime: the broker stamped it
    StructField("headers", ArrayType(StructType([StructField("key", StringType(), True),
                                                StructField("value", BinaryType(), True)]), True), True),
]
KAFKA_SOURCES = {"key": "keys", "value": "body", "partition": "queueId", "offset": "queueOffset",
                 "timestamp": "storeTimestamp", "timestampType": "queueId", "headers": "properties"}
LOG_APPEND_TIME = 1


def spark_schema(with_body: bool = True, kafka_columns: bool = False) -> StructType:
    """The rows' schema: the fields of ``rocketstore dump`` (body omitted with ``withBody=false``), then
    Kafka's columns with ``kafkaColumns=true``."""
    fields = [StructField(n, _SPARK_TYPES[t], nullable=n in ("tags", "keys"))
              for n, t, _ in segment.COLUMNS if with_body or n != "body"]
    return StructType(fields + (KAFKA_FIELDS if kafka_columns else []))


# ---------------------------------------------------------------- options

class Options:
    """Case-insensitive view of the reader/writer options (Spark lower-cases the keys)."""

    def __init__(self, options: Any) -> None:
        self.raw = {str(k).lower(): v for k, v in dict(options or {}).items()}

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key.lower(), default)

    def flag(self, key: str, default: bool) -> bool:
        v = self.get(key)
        if v is None:
            return default
        s = str(v).strip().lower()
        if s not in ("true", "false"):
            raise StoreError(f"option {key}={v!r}: expected true or false")
        return s == "true"

    def int(self, key: str, default: int | None = None) -> int | None:
        v = self.get(key)
        if v is None or str(v).strip() == "":
            return default
        try:
            return int(str(v).strip())
        except ValueError:
            raise StoreError(f"option {key}={v!r}: expected an integer") from None

    def names(self, key: str) -> frozenset[str] | None:
        """A comma-separated list option (topics, keys); None when not given."""
        v = self.get(key)
        if v is None:
            return None
        items = frozenset(t.strip() for t in str(v).split(",") if t.strip())
        if not items:
            raise StoreError(f"option {key}: expected a comma-separated list")
        return items

    def topics(self) -> frozenset[str] | None:
        """Option ``topics``, or Kafka's name for it, ``subscribe``."""
        return self.names("topics") if self.get("topics") is not None else self.names("subscribe")

    def queue_ids(self) -> frozenset[int] | None:
        items = self.names("queueIds")
        if items is None:
            return None
        if not all(i.isdigit() for i in items):
            raise StoreError(f"option queueIds={self.get('queueIds')!r}: expected comma-separated queue ids (0, 1, ...)")
        return frozenset(int(i) for i in items)

    def roots(self) -> list[str]:
        roots = planner.store_roots({"path": self.get("path"), "paths": self.get("paths")})
        if not roots:
            raise StoreError("rocketstore: no store path given (load(path) or option path)")
        return roots

    def tiers(self, roots: list[str]) -> dict[str, remote.TierRef | None]:
        """Each store's tier (options ``tieredStoreUri``/``objectStore*``, else its broker.conf); an
        ``s3://`` path is a tier read alone."""
        return {r: remote.tier_of(r, self.raw) for r in roots}

    def config_options(self) -> dict[str, str]:
        from dataclasses import fields as dc_fields

        from ..config import StoreConfig
        names = {f.name.lower(): f.name for f in dc_fields(StoreConfig)}
        out = {names[k]: v for k, v in self.raw.items() if k in names}
        for k in ("replay", "lockTimeoutMs", "config", "topic"):
            if self.get(k) is not None:
                out[k] = self.get(k)
        return out


EARLIEST, LATEST = "earliest", "latest"


def parse_offsets(value: Any, roots: list[str], name: str, default: str) -> dict[str, int | str]:
    """``earliest`` / ``latest`` / a commitlog offset / JSON ``{"<store path>": offset}`` (-2 earliest, -1 latest)."""
    out: dict[str, int | str] = {r: default for r in roots}
    if value is None:
        return out
    text = str(value).strip()
    if text.lower() in (EARLIEST, LATEST):
        return {r: text.lower() for r in roots}
    if text.lstrip("-").isdigit():
        v = int(text)
        return {r: _special(v, name) for r in roots}
    try:
        data = json.loads(text)
    except ValueError:
        raise StoreError(f"option {name}={text!r}: expected earliest, latest, a commitlog offset or "
                         '{"<store path>": offset}') from None
    if not isinstance(data, dict):
        raise StoreError(f"option {name}: expected a JSON object of store path to offset")
    for k, v in data.items():
        root = planner.store_roots({"path": k})[0]
        if root not in out:
            raise StoreError(f"option {name}: {k} is not one of the stores read ({', '.join(roots)})")
        if isinstance(v, str) and v.lower() in (EARLIEST, LATEST):
            out[root] = v.lower()
        elif isinstance(v, int) and not isinstance(v, bool):
            out[root] = _special(v, name)
        else:
            raise StoreError(f"option {name}: offset of {k} must be an integer, earliest or latest")
    return out


def _special(v: int, name: str) -> int | str:
    if v == -2:
        return EARLIEST
    if v == -1:
        return LATEST
    if v < 0:
        raise StoreError(f"option {name}: offset {v} is negative")
    return v


def options_filter(opts: Options, roots: list[str]) -> dict[str, RowFilter]:
    """The rows a batch read is limited to by its options, per store."""
    starts = parse_offsets(opts.get("startingOffsets"), roots, "startingOffsets", EARLIEST)
    ends = parse_offsets(opts.get("endingOffsets"), roots, "endingOffsets", LATEST)
    t0 = opts.int("startingTimestamp")
    t1 = opts.int("endingTimestamp")
    topics, queue_ids, keys = opts.topics(), opts.queue_ids(), opts.names("keys")
    out = {}
    for r in roots:
        s, e = starts[r], ends[r]
        if s == LATEST:
            raise StoreError("startingOffsets=latest is for streams; a batch read starts at earliest or an offset")
        if e == EARLIEST:
            raise StoreError("endingOffsets=earliest is not allowed for a batch read")
        out[r] = RowFilter(offset_lo=None if s == EARLIEST else int(s), offset_hi=None if e == LATEST else int(e) - 1,
                           ts_lo=None if t0 is None else t0 * 1000, ts_hi=None if t1 is None else t1 * 1000 - 1,
                           topics=topics, queue_ids=queue_ids, keys=keys)
    return out


# ---------------------------------------------------------------- the queue view (Kafka's partitions)

class QueueView:
    """Driver side of a read in Kafka's partition view (:mod:`rocketstore.spark.queues`): which queues, from and
    to which queue offsets, how many messages per trigger."""

    def __init__(self, opts: Options, roots: list[str], stream: bool) -> None:
        if len(roots) != 1 or remote.is_tier_uri(roots[0]):
            given = ", ".join(o for o in queues.QUEUE_OPTIONS if opts.get(o) is not None) or "per-queue offsets"
            raise StoreError(f"options {given}: the queue view reads exactly one local store directory "
                             f"(not {', '.join(roots)})")
        self.root = roots[0]
        self.opts = opts
        self.stream = stream
        self.selection = queues.Selection.from_options(opts)
        for o in ("keys", "maxBytesPerTrigger", "startingOffsets", "endingOffsets"):
            v = opts.get(o)
            if v is None or o.endswith("Offsets") and (str(v).strip().lower() in (EARLIEST, LATEST)
                                                       or queues.per_queue_json(opts, o)):
                continue
            raise StoreError(f"option {o}={v!r}: not with the queue view (options assign, subscribePattern, "
                             "per-queue offsets ...); use per-queue JSON offsets, earliest or latest"
                             + ("; maxOffsetsPerTrigger counts messages" if o == "maxBytesPerTrigger" else ""))
        self.start_default = self._default("startingOffsets", LATEST if stream else EARLIEST)
        self.end_default = self._default("endingOffsets", LATEST)
        if not stream and self.start_default == queues.LATEST:
            raise StoreError("startingOffsets=latest is for streams; a batch read starts at earliest or an offset")
        if not stream and self.end_default == queues.EARLIEST:
            raise StoreError("endingOffsets=earliest is not allowed for a batch read")
        if stream and opts.get("endingOffsets") is not None:
            raise StoreError("endingOffsets is for batch reads; a stream follows the store (use "
                             "trigger(availableNow=True) to stop at the current end)")
        self.start_spec = queues.parse_per_queue(opts, "startingOffsets") if queues.per_queue_json(
            opts, "startingOffsets") else None
        self.end_spec = queues.parse_per_queue(opts, "endingOffsets") if queues.per_queue_json(
            opts, "endingOffsets") else None
        for name, spec, bad in (("startingOffsets", self.start_spec, None if stream else queues.LATEST),
                                ("endingOffsets", self.end_spec, queues.EARLIEST)):
            for (t, q), v in (spec or {}).items():
                if v == bad:
                    raise StoreError(f"option {name}={opts.get(name)!r}: {t}/{q}: {v} is not allowed for a batch "
                                     "read")
        self.start_ts = queues.parse_per_queue(opts, "startingOffsetsByTimestamp", timestamps=True)
        self.end_ts = queues.parse_per_queue(opts, "endingOffsetsByTimestamp", timestamps=True)
        self.start_ts_all = opts.int("startingTimestamp")
        self.end_ts_all = opts.int("endingTimestamp")
        if self.end_ts_all is not None and stream:
            raise StoreError("endingTimestamp is for batch reads")
        self.strategy = str(opts.get("startingOffsetsByTimestampStrategy", "error")).strip().lower()
        if self.strategy not in ("error", "latest"):
            raise StoreError("option startingOffsetsByTimestampStrategy="
                             f"{opts.get('startingOffsetsByTimestampStrategy')!r}: expected error or latest")
        self.max_rows = opts.int("maxOffsetsPerTrigger")
        self.min_rows = opts.int("minOffsetsPerTrigger")
        self.max_delay_ms = queues.parse_duration_ms(opts, "maxTriggerDelay", "15m")
        self.max_records = opts.int("maxRecordsPerPartition")
        for name, v in (("maxOffsetsPerTrigger", self.max_rows), ("minOffsetsPerTrigger", self.min_rows),
                        ("maxRecordsPerPartition", self.max_records)):
            if v is not None and v <= 0:
                raise StoreError(f"option {name}={v}: must be positive")
        self.fail_on_data_loss = opts.flag("failOnDataLoss", True)

    def _default(self, name: str, default: str) -> int:
        """-2 / -1 for earliest / latest; per-queue JSON leaves the queues it omits at the read's default."""
        codes = {EARLIEST: queues.EARLIEST, LATEST: queues.LATEST}
        return codes.get(str(self.opts.get(name, default)).strip().lower(), codes[default])

    def ranges(self) -> tuple[dict[queues.Queue, planner.QueueRange], dict[queues.Queue, planner.QueueRange]]:
        """All the store's queues and the selected ones, now."""
        ranges = planner.queue_ranges(self.root)
        self.selection.check_assigned(ranges, self.root, self.opts.get("assign"))
        return ranges, self.selection.pick(ranges)

    def _times(self, spec: dict[queues.Queue, int] | None, everywhere: int | None,
               selected: dict[queues.Queue, planner.QueueRange]) -> dict[queues.Queue, int] | None:
        if everywhere is not None:  # startingTimestamp / endingTimestamp: every queue, as Kafka's
            return {k: everywhere for k in selected}
        return spec

    def starts(self, ranges: dict, selected: dict) -> dict[queues.Queue, int]:
        out = queues.resolve("startingOffsets", self.opts.get("startingOffsets"), self.start_spec,
                             self.start_default, ranges, selected)
        times = self._times(self.start_ts, self.start_ts_all, selected)
        if times:
            name = "startingTimestamp" if self.start_ts_all is not None else "startingOffsetsByTimestamp"
            out.update(queues.by_timestamp(self.root, name, self.opts.get(name), times, selected, ranges,
                                           self.strategy))
        return out

    def ends(self, ranges: dict, selected: dict) -> dict[queues.Queue, int]:
        out = queues.resolve("endingOffsets", self.opts.get("endingOffsets"), self.end_spec, self.end_default,
                             ranges, selected)
        times = self._times(self.end_ts, self.end_ts_all, selected)
        if times:
            name = "endingTimestamp" if self.end_ts_all is not None else "endingOffsetsByTimestamp"
            out.update(queues.by_timestamp(self.root, name, self.opts.get(name), times, selected, ranges, "end"))
        return out

    def batch_spans(self) -> list[queues.QueueSpan]:
        ranges, selected = self.ranges()
        start, end = self.starts(ranges, selected), self.ends(ranges, selected)
        for k in selected:
            if start[k] > end[k]:
                raise StoreError(f"{k[0]}/{k[1]}: starting offset {start[k]} is after the ending offset {end[k]}")
            if start[k] < ranges[k].earliest:
                self.lost(k, start[k], ranges[k].earliest)
                start[k] = ranges[k].earliest
        return queues.spans(self.root, start, end, ranges, self.max_records)

    def lost(self, k: queues.Queue, offset: int, earliest: int) -> None:
        msg = (f"{self.root}: {k[0]}/{k[1]} queue offset {offset} is gone (the queue now starts at {earliest}); "
               "messages were deleted before this query read them")
        if self.fail_on_data_loss:
            raise StoreError(msg + " (set failOnDataLoss=false to skip ahead)")
        log.warning("%s; skipping ahead", msg)


class QueuePartition(InputPartition):
    """Queue offset ranges of consume queues (a list of :class:`rocketstore.spark.queues.QueueSpan`)."""

    def __init__(self, spans: list[queues.QueueSpan]) -> None:
        super().__init__(spans)


# ---------------------------------------------------------------- batch reads

class ScanPartition(InputPartition):
    """Whole consecutive segments of one store (a list of :class:`rocketstore.spark.plan.ScanTask`)."""

    def __init__(self, tasks: list[planner.ScanTask]) -> None:
        super().__init__(tasks)


DEFAULT_MAX_PARTITION_BYTES = 256 * 1024 * 1024
MIN_PARTITION_BYTES = 8 * 1024 * 1024


def pack(tasks: list[planner.ScanTask], max_bytes: int, min_partitions: int) -> list[list[planner.ScanTask]]:
    """Group consecutive segments of a store into partitions, as Spark splits files.

    Each partition holds whole segments (a task decodes its own files).  With
    RocketMQ's 1 GiB segments that is one segment each; small segments are
    packed up to ``min(max_bytes, max(8 MiB, total / min_partitions))`` so that
    the fixed cost of a task (tens of milliseconds) does not dominate.
    """
    total = sum(t.end - t.start for t in tasks)
    target = min(max_bytes, max(MIN_PARTITION_BYTES, -(-total // max(1, min_partitions))))
    out: list[list[planner.ScanTask]] = []
    size = 0
    for t in tasks:
        n = t.end - t.start
        if out and out[-1][-1].store == t.store and size + n <= target:
            out[-1].append(t)
            size += n
        else:
            out.append([t])
            size = n
    return out


def spread(parts: list[list[planner.ScanTask]], min_partitions: int) -> list[list[planner.ScanTask]]:
    """Cut single-segment partitions into pieces (:func:`rocketstore.spark.plan.split_task`) until there are
    ``min_partitions``, as Spark splits a large file, so that a store of fewer segments than task slots (a
    single 1 GiB segment on 8 cores, say) is not scanned by one task while the other cores wait.

    The largest share is cut first; no piece gets smaller than ``MIN_PARTITION_BYTES``.
    """
    splittable = [i for i, p in enumerate(parts) if len(p) == 1 and p[0].queues]
    pieces = {i: 1 for i in splittable}
    size = {i: parts[i][0].end - parts[i][0].start for i in splittable}
    for _ in range(min_partitions - len(parts)):
        best = max(splittable, key=lambda i: size[i] / pieces[i], default=None)
        if best is None or size[best] / (pieces[best] + 1) < MIN_PARTITION_BYTES:
            break
        pieces[best] += 1
    out: list[list[planner.ScanTask]] = []
    for i, p in enumerate(parts):
        if pieces.get(i, 1) > 1:
            out += [[t] for t in planner.split_task(p[0], pieces[i])]
        else:
            out.append(p)
    return out


def _check_schema(schema: StructType) -> list[str]:
    expected = {f.name: f.dataType for f in spark_schema(True, True)}
    names = []
    for f in schema.fields:
        if f.name not in expected:
            raise StoreError(f"rocketstore: no column {f.name!r} (columns: {', '.join(expected)})")
        if f.dataType != expected[f.name]:
            raise StoreError(f"rocketstore: column {f.name} is {expected[f.name].simpleString()}, "
                             f"not {f.dataType.simpleString()}")
        names.append(f.name)
    return names


def _arrow_schema(schema: StructType):
    from pyspark.sql.pandas.types import to_arrow_schema
    return to_arrow_schema(schema, timezone="UTC")


def decoded_names(names: list[str]) -> list[str]:
    """The record fields to decode for the columns ``names`` (Kafka's columns are made from ours)."""
    out = [n for n in names if n in segment.ARROW_TYPES]
    for n in names:
        src = KAFKA_SOURCES.get(n)
        if src is not None and src not in out:
            out.append(src)
    return out


def kafka_column(name: str, batch: Any, arrow_type: Any) -> Any:
    """Kafka's column ``name`` from a decoded batch (see :data:`KAFKA_FIELDS`)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    col = batch.column(KAFKA_SOURCES[name])
    if name == "key":
        first = pc.list_element(pc.split_pattern(pc.utf8_ltrim(col, " "), " ", max_splits=1), 0)
        first = pc.if_else(pc.equal(first, ""), pa.scalar(None, pa.string()), first)
        return first.cast(pa.binary())
    if name == "timestampType":
        return pa.array(np.full(batch.num_rows, LOG_APPEND_TIME, np.int32), pa.int32())
    if name == "headers":
        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        pairs = pa.StructArray.from_arrays([col.keys, col.items.cast(pa.binary())], names=["key", "value"])
        return pa.ListArray.from_arrays(col.offsets, pairs, type=arrow_type, mask=col.is_null())
    return col.cast(arrow_type) if col.type != arrow_type else col


def shape(batches: Iterator[Any], arrow_schema: Any) -> Iterator[Any]:
    """Decoded batches as batches of exactly the Spark schema: its columns, in its order, Kafka's added."""
    import pyarrow as pa
    for b in batches:
        if b.schema.equals(arrow_schema):
            yield b
        elif all(f.name in segment.ARROW_TYPES for f in arrow_schema):
            yield pa.RecordBatch.from_arrays([b.column(f.name) for f in arrow_schema], schema=arrow_schema)
        else:
            yield pa.RecordBatch.from_arrays(
                [b.column(f.name) if f.name in segment.ARROW_TYPES else kafka_column(f.name, b, f.type)
                 for f in arrow_schema], schema=arrow_schema)


def read_task(tasks: list[planner.ScanTask] | None, names: list[str], arrow_schema: Any,
              batch_rows: int, skip_damaged: bool = False) -> Iterator[Any]:
    """The rows of one partition, as Arrow batches of exactly the Spark schema.

    A record whose body fails its BODYCRC fails the task naming file and offset, unless ``skip_damaged``
    (option ``skipDamaged``), which drops it with a warning in the executor's log."""
    if not tasks:
        return
    if isinstance(tasks[0], queues.QueueSpan):
        for span in tasks:
            yield from shape(queues.read_span(span, decoded_names(names), batch_rows, skip_damaged), arrow_schema)
        return
    yield from shape(_read_scan_tasks(tasks, decoded_names(names), batch_rows, skip_damaged), arrow_schema)


def _read_scan_tasks(tasks: list[planner.ScanTask], names: list[str], batch_rows: int,
                     skip_damaged: bool) -> Iterator[Any]:
    for task in tasks:
        key = task.key
        if key is None and task.tier is not None and not os.path.exists(task.path):
            from ..tier.reader import segment_key  # deleted by retention since planning: it is in the tier
            log.info("%s: gone since the scan was planned; reading it from %s", task.path, task.tier.uri)
            key = segment_key(os.path.basename(task.path))
        if key is not None:
            batches = remote.read_tier_range(task.tier, key, task.base, task.file_size, task.start, task.end, names,
                                             task.filter, batch_rows=batch_rows,
                                             boundary_known=task.boundary_known, skip_damaged=skip_damaged)
        else:
            batches = segment.read_range(task.path, task.start, task.end, names, task.filter, batch_rows=batch_rows,
                                         boundary_known=task.boundary_known, queues=task.queues,
                                         drop_cache=task.drop_cache, skip_damaged=skip_damaged)
        yield from batches


class RocketStoreReader(DataSourceReader):
    """A batch scan, limited only by its options (never by pushed filters).

    Spark 4.3 keeps the partitions planned during filter pushdown on the relation and reuses them
    for the next query on the same DataFrame that pushes no filter, so a reader that pruned with
    ``where(topic = 'A')`` would make a later ``df.count()`` count only topic A.  The source
    therefore implements no ``pushFilters``: Spark evaluates ``where`` itself over an unpruned
    scan, and pruning is asked for with options (topics, queueIds, keys, offsets, timestamps),
    which belong to the relation and so stay right on every reuse.
    """

    def __init__(self, options: Any, schema: StructType, default_min_partitions: int | None = None) -> None:
        opts = Options(options)
        self.roots = opts.roots()
        self.tiers = opts.tiers(self.roots)
        self.names = _check_schema(schema)
        self.arrow_schema = _arrow_schema(schema)
        self.queue_view = QueueView(opts, self.roots, stream=False) if queues.wants_queues(opts, False) else None
        self.base = {} if self.queue_view else options_filter(opts, self.roots)
        self.batch_rows = opts.int("batchRows", segment.DEFAULT_BATCH_ROWS)
        self.max_partition_bytes = opts.int("maxPartitionBytes", DEFAULT_MAX_PARTITION_BYTES)
        self.min_partitions = opts.int("minPartitions", default_min_partitions or os.cpu_count() or 1)
        self.drop_cache = opts.flag("dropCache", False)
        self.skip_damaged = opts.flag("skipDamaged", False)
        if self.max_partition_bytes <= 0 or self.min_partitions <= 0:
            raise StoreError("options maxPartitionBytes and minPartitions must be positive")

    def plan(self) -> tuple[list[planner.ScanTask], list[planner.PlanReport]]:
        tasks: list[planner.ScanTask] = []
        reports = []
        for root in self.roots:
            rep = planner.PlanReport(root)
            tasks += planner.plan_scan(root, self.base[root], report=rep,
                                       drop_cache=self.drop_cache, tier=self.tiers[root])
            reports.append(rep)
        return tasks, reports

    def partitions(self) -> list[InputPartition]:
        if self.queue_view is not None:
            return [QueuePartition([s]) for s in self.queue_view.batch_spans()]
        tasks, _ = self.plan()
        parts = pack(tasks, self.max_partition_bytes, self.min_partitions)
        # A task keeps a Python worker decoding and a JVM thread converting the Arrow batches to rows; the
        # JVM thread is the slower (2026-11-27), so one task per core: on local[2] a lone segment is cut in two
        # (4-8 % less wall time than one task in five paired runs of the bench's scan).
        parts = spread(parts, self.min_partitions)
        return [ScanPartition(p) for p in parts]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return read_task(partition.value, self.names, self.arrow_schema, self.batch_rows, self.skip_damaged)


# ---------------------------------------------------------------- streaming reads

def group_committer(opts: Options, roots: list[str]) -> Any:
    """Option groupId: a :class:`~rocketstore.spark.group_commit.GroupCommitter` for the stream, or None."""
    group = opts.get("groupId")
    if group is None:
        return None
    from .group_commit import GroupCommitter
    tiers = [r for r in roots if remote.is_tier_uri(r)]
    if tiers:
        raise StoreError(f"option groupId: {tiers[0]} is a tier; consumer offsets live in a store directory")
    return GroupCommitter(group, roots, opts.topics(), opts.queue_ids())

class RocketStoreStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Follows the stores' commitlogs; offsets are ``{"<store path>": commitlog offset}``.

    In the queue view (:class:`QueueView`) it follows the selected consume queues instead; offsets are then
    Kafka's ``{"<topic>": {"<queue id>": queue offset}}``, and queues that appear while it runs (new topics
    matching ``subscribePattern``, new queues) are read from their earliest offset, as Kafka reads new partitions.
    """

    def __init__(self, options: Any, schema: StructType) -> None:
        opts = Options(options)
        self.roots = opts.roots()
        self.tiers = opts.tiers(self.roots)
        self.names = _check_schema(schema)
        self.arrow_schema = _arrow_schema(schema)
        self.batch_rows = opts.int("batchRows", segment.DEFAULT_BATCH_ROWS)
        self.skip_damaged = opts.flag("skipDamaged", False)
        self.target: dict[str, int] | None = None
        self.latest: dict | None = None  # the newest offsets seen by latestOffset (reportLatestOffset)
        self.group = group_committer(opts, self.roots)  # option groupId (both views)
        self.view = QueueView(opts, self.roots, stream=True) if queues.wants_queues(opts, True) else None
        if self.view is not None:
            self.queue_target: dict[queues.Queue, int] | None = None
            self.last_trigger = time.monotonic()
            return
        self.starting = parse_offsets(opts.get("startingOffsets"), self.roots, "startingOffsets", LATEST)
        for r, v in self.starting.items():
            if v == LATEST and opts.get("startingTimestamp") is not None:
                self.starting[r] = "timestamp"
        if opts.get("endingOffsets") is not None:
            raise StoreError("endingOffsets is for batch reads; a stream follows the store (use "
                             "trigger(availableNow=True) to stop at the current end)")
        self.starting_ts = opts.int("startingTimestamp")
        self.max_bytes = opts.int("maxBytesPerTrigger")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise StoreError("option maxBytesPerTrigger must be positive")
        self.fail_on_data_loss = opts.flag("failOnDataLoss", True)
        self.flt = RowFilter(topics=opts.topics(), queue_ids=opts.queue_ids())

    def initialOffset(self) -> dict:
        if self.view is not None:
            ranges, selected = self.view.ranges()
            return queues.to_json(self.view.starts(ranges, selected))
        out = {}
        for r in self.roots:
            v = self.starting[r]
            t = self.tiers[r]
            if v == EARLIEST:
                out[r] = planner.earliest_offset(r, t)
            elif v == LATEST:
                out[r] = planner.find_tail(r, tier=t)
            elif v == "timestamp":
                out[r] = planner.offset_for_timestamp(r, self.starting_ts, t)
            else:
                out[r] = planner.check_boundary(r, int(v), t)
        return out

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.view is not None:
            # PySpark takes one limit, not Kafka's composite of both: the reader applies its own
            # maxOffsetsPerTrigger and minOffsetsPerTrigger whenever the engine passes either.
            if self.view.max_rows:
                return ReadMaxRows(self.view.max_rows)
            return ReadMinRows(self.view.min_rows) if self.view.min_rows else ReadAllAvailable()
        return ReadMaxBytes(self.max_bytes) if self.max_bytes else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        if self.view is not None:
            _ranges, selected = self.view.ranges()
            self.queue_target = {k: r.end for k, r in selected.items()}
            return
        self.target = {r: planner.find_tail(r, tier=self.tiers[r]) for r in self.roots}

    def reportLatestOffset(self) -> dict | None:
        """The newest offsets seen by the last latestOffset, so that the query's progress shows the lag."""
        return self.latest

    def _queue_latest(self, start: dict, limit: ReadLimit | None) -> dict:
        view = self.view
        ranges, selected = view.ranges()
        begin = queues.from_json(start)
        for k, r in selected.items():
            if k not in begin:
                log.info("%s: new queue %s/%d, read from its earliest offset %d", view.root, k[0], k[1], r.earliest)
                begin[k] = r.earliest
            elif begin[k] < r.earliest:
                view.lost(k, begin[k], r.earliest)
                begin[k] = r.earliest
        latest = dict(begin)  # queues no longer selected (or gone) stay where they are
        latest.update({k: max(begin[k], r.end) for k, r in selected.items()})
        self.latest = queues.to_json(latest)
        end = dict(latest)
        if self.queue_target is not None:  # Trigger.AvailableNow: what there was when the query started
            end = {k: min(v, max(begin[k], self.queue_target.get(k, begin[k]))) for k, v in end.items()}
        if limit is not None and not isinstance(limit, ReadAllAvailable):
            available = sum(end[k] - begin[k] for k in end)
            if view.min_rows and self.queue_target is None and available < view.min_rows and \
                    (time.monotonic() - self.last_trigger) * 1000 < view.max_delay_ms:
                log.debug("%s: %d messages available, fewer than minOffsetsPerTrigger=%d: waiting",
                          view.root, available, view.min_rows)
                return start
            if view.max_rows:
                end = queues.limit_rows(begin, end, view.max_rows)
        out = queues.to_json(end)
        if out != start:
            self.last_trigger = time.monotonic()
        log.info("%s: batch to %s; messages behind the latest: %s", view.root, out, queues.behind(end, latest))
        return out

    def latestOffset(self, start: dict | None = None, limit: ReadLimit | None = None) -> dict:
        if self.group is not None and start is not None:
            # ``start`` is the end of the last batch, committed: Spark calls commit(end) only when it plans
            # the next batch, so the last batch of a stream (availableNow) would otherwise never be written.
            self.group.commit(start)
        start = start if start is not None else self.initialOffset()
        if self.view is not None:
            return self._queue_latest(start, limit)
        budget = limit.max_bytes if isinstance(limit, ReadMaxBytes) else None
        out = {}
        for r in self.roots:
            s = int(start.get(r, planner.earliest_offset(r, self.tiers[r])))
            s = self._check_loss(r, s)
            end = planner.find_tail(r, s, budget, self.tiers[r])
            if self.target is not None:
                end = min(end, max(s, self.target[r]))
            out[r] = end
        self.latest = {r: max(out[r], planner.find_tail(r, tier=self.tiers[r])) if budget or self.target
                       else out[r] for r in self.roots}
        return out

    def _check_loss(self, root: str, offset: int) -> int:
        if planner.in_local_segments(root, offset):
            return offset  # in the local segments: the tier need not be asked (nor be up)
        earliest = planner.earliest_offset(root, self.tiers[root])
        if offset < earliest:
            msg = (f"{root}: commitlog offset {offset} is gone (the store now starts at {earliest}); "
                   "messages were deleted before this query read them")
            if self.fail_on_data_loss:
                raise StoreError(msg + " (set failOnDataLoss=false to skip ahead)")
            log.warning("%s; skipping ahead", msg)
            return earliest
        return offset

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        if self.view is not None:
            ranges = planner.queue_ranges(self.view.root)
            begin = queues.from_json(start)
            for k, v in list(begin.items()):
                r = ranges.get(k)
                if r is not None and v < r.earliest:
                    self.view.lost(k, v, r.earliest)
                    begin[k] = r.earliest
            return [QueuePartition([s]) for s in queues.spans(self.view.root, begin, queues.from_json(end), ranges,
                                                                self.view.max_records)]
        tasks = []
        for r in self.roots:
            s, e = int(start.get(r, 0)), int(end.get(r, 0))
            if not self.fail_on_data_loss and not planner.in_local_segments(r, s):
                s = max(s, planner.earliest_offset(r, self.tiers[r]))
            tasks += planner.stream_tasks(r, s, e, None if self.flt.trivial() else self.flt, self.tiers[r])
        return [ScanPartition([t]) for t in tasks]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return read_task(partition.value, self.names, self.arrow_schema, self.batch_rows, self.skip_damaged)

    def commit(self, end: dict) -> None:
        if self.group is not None:  # option groupId: the position shown to `rocketstore lag` (never read back)
            self.group.commit(end)


# ---------------------------------------------------------------- writes

@dataclass
class StagedCommit(WriterCommitMessage):
    part: Any


class RocketStoreWriter(DataSourceArrowWriter):
    def __init__(self, options: Any, schema: StructType) -> None:
        from .write import STAGING, writer_setup
        opts = Options(options)
        setup = writer_setup(opts.roots(), opts.config_options(), schema.fieldNames())
        self.root, self.opts = setup.root, setup.opts
        self.max_message_size, self.segment_size, self.auto_v2 = setup.max_message_size, setup.segment_size, \
            setup.auto_v2
        self.staging = os.path.join(self.root, STAGING, uuid.uuid4().hex)
        os.makedirs(self.staging, exist_ok=True)

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        from pyspark import TaskContext

        from .write import stage
        ctx = TaskContext.get()
        pid = ctx.partitionId() if ctx else 0
        attempt = ctx.attemptNumber() if ctx else 0
        return StagedCommit(stage(iterator, self.staging, pid, attempt, self.opts, self.max_message_size,
                                  self.segment_size, self.auto_v2))

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        from .write import cleanup, commit
        try:
            parts = [m.part for m in messages if m is not None and m.part.rows]
            commit(self.root, parts, self.opts)
        finally:
            cleanup(self.staging)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        from .write import cleanup
        cleanup(self.staging)
        log.warning("write to %s aborted; nothing was appended", self.root)


# ---------------------------------------------------------------- the source

class RocketStoreDataSource(DataSource):
    """``spark.read.format("rocketstore")``: RocketMQ commitlogs as rows (see docs/spark.md)."""

    # The session's default parallelism, set by register() on a subclass of its own (the planning
    # worker has no SparkContext to ask; without it, minPartitions falls back to the local cores).
    default_min_partitions: int | None = None

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        opts = Options(self.options)
        return spark_schema(opts.flag("withBody", True), opts.flag("kafkaColumns", False))

    def reader(self, schema: StructType) -> DataSourceReader:
        return RocketStoreReader(self.options, schema, self.default_min_partitions)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return RocketStoreStreamReader(self.options, schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceArrowWriter:
        if overwrite:
            raise StoreError("rocketstore write: only mode('append') is supported (a store is append-only)")
        return RocketStoreWriter(self.options, schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> Any:
        from .sink import RocketStoreStreamWriter
        from .write import writer_setup
        if overwrite:
            raise StoreError("rocketstore sink: only outputMode('append') is supported (a store is append-only)")
        opts = Options(self.options)
        return RocketStoreStreamWriter(writer_setup(opts.roots(), opts.config_options(), schema.fieldNames()),
                                       opts.get("checkpointLocation"))
