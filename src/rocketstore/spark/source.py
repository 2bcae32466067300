"""The ``rocketstore`` Spark data source: batch and streaming reads, and appends.

Registered with :func:`rocketstore.spark.register`.  Every class here is
pickled to Python workers, so all state is plain data (paths, offsets,
filters); files are opened inside ``read``/``write`` on the executors.
"""

from __future__ import annotations

import json
import logging
import os
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
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from ..config import StoreConfig
from ..errors import StoreError
from . import plan as planner
from . import remote, segment
from .segment import RowFilter

log = logging.getLogger(__name__)

FORMAT = "rocketstore"
_SPARK_TYPES = {"string": StringType(), "int": IntegerType(), "bigint": LongType(), "timestamp": TimestampType(),
                "binary": BinaryType(), "map<string,string>": MapType(StringType(), StringType())}


def spark_schema(with_body: bool = True) -> StructType:
    """The rows' schema: the fields of ``rocketstore dump`` (body omitted with ``withBody=false``)."""
    return StructType([StructField(n, _SPARK_TYPES[t], nullable=n in ("tags", "keys"))
                       for n, t, _ in segment.COLUMNS if with_body or n != "body"])


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
        return self.names("topics")

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
    expected = {f.name: f.dataType for f in spark_schema()}
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


def read_task(tasks: list[planner.ScanTask] | None, names: list[str], arrow_schema: Any,
              batch_rows: int, skip_damaged: bool = False) -> Iterator[Any]:
    """The rows of one partition, as Arrow batches of exactly the Spark schema.

    A record whose body fails its BODYCRC fails the task naming file and offset, unless ``skip_damaged``
    (option ``skipDamaged``), which drops it with a warning in the executor's log."""
    if not tasks:
        return
    import pyarrow as pa
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
        for b in batches:
            if b.schema.equals(arrow_schema):
                yield b
            else:
                yield pa.RecordBatch.from_arrays(b.columns, schema=arrow_schema)


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
        self.base = options_filter(opts, self.roots)
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
        tasks, _ = self.plan()
        parts = pack(tasks, self.max_partition_bytes, self.min_partitions)
        # A task keeps about two cores busy (its Python worker decoding, its JVM thread converting the
        # Arrow batches to rows): split segments only up to half the cores.
        parts = spread(parts, -(-self.min_partitions // 2))
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
    """Follows the stores' commitlogs; offsets are ``{"<store path>": commitlog offset}``."""

    def __init__(self, options: Any, schema: StructType) -> None:
        opts = Options(options)
        self.roots = opts.roots()
        self.tiers = opts.tiers(self.roots)
        self.names = _check_schema(schema)
        self.arrow_schema = _arrow_schema(schema)
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
        self.skip_damaged = opts.flag("skipDamaged", False)
        self.flt = RowFilter(topics=opts.topics(), queue_ids=opts.queue_ids())
        self.batch_rows = opts.int("batchRows", segment.DEFAULT_BATCH_ROWS)
        self.target: dict[str, int] | None = None
        self.group = group_committer(opts, self.roots)

    def initialOffset(self) -> dict:
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
        return ReadMaxBytes(self.max_bytes) if self.max_bytes else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = {r: planner.find_tail(r, tier=self.tiers[r]) for r in self.roots}

    def latestOffset(self, start: dict | None = None, limit: ReadLimit | None = None) -> dict:
        if self.group is not None and start is not None:
            # ``start`` is the end of the last batch, committed: Spark calls commit(end) only when it plans
            # the next batch, so the last batch of a stream (availableNow) would otherwise never be written.
            self.group.commit(start)
        start = start if start is not None else self.initialOffset()
        budget = limit.max_bytes if isinstance(limit, ReadMaxBytes) else None
        out = {}
        for r in self.roots:
            s = int(start.get(r, planner.earliest_offset(r, self.tiers[r])))
            s = self._check_loss(r, s)
            end = planner.find_tail(r, s, budget, self.tiers[r])
            if self.target is not None:
                end = min(end, max(s, self.target[r]))
            out[r] = end
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
        return spark_schema(Options(self.options).flag("withBody", True))

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
        if overwrite:
            raise StoreError("rocketstore sink: only outputMode('append') is supported (a store is append-only)")
        return RocketStoreStreamWriter(self.options, schema)
