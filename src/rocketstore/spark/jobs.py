"""Distributed jobs over a store: verify, rebuild, export, import and stats.

Each job is a plain function taking a SparkSession (see :func:`session`) and
returning a JSON-able dict; ``rocketstore spark ...`` (``cli.py``) is a thin
layer over them.  Executors only ever map commitlog segments read-only; every
write (rebuilt consume queues and index) happens on the driver under the
store's lock.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterable
from datetime import UTC
from types import SimpleNamespace
from typing import Any

from ..format import codec
from ..errors import StoreError
from ..selection import Selection
from ..paths import StorePaths
from ..store import MessageStore
from ..storage.store_lock import StoreLock

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- the session

# Arrow Java checks every value a JVM reads from an Arrow vector: the index against the buffer, the buffer's
# reference count, and (in get) the validity bit even of a non-null column.  Spark's JVM reads every value of a
# Python data source's batches that way, so the checks cost about a quarter of its task thread's CPU (bench/results/
# profile-spark-2026-11-27-angles.txt).  Spark checks nulls itself before each read of a nullable column, and the
# batches come from Arrow's own IPC reader, so the JVMs of a session made here run without them, as Iceberg's and
# Comet's Arrow readers recommend.  ``session(..., arrow_checks=True)`` keeps them.
ARROW_UNCHECKED = ("-Darrow.enable_unsafe_memory_access=true", "-Darrow.enable_null_check_for_get=false")
JAVA_OPTION_KEYS = ("spark.driver.extraJavaOptions", "spark.executor.extraJavaOptions")


def java_options(conf: dict[str, str], arrow_checks: bool = False) -> dict[str, str]:
    """``conf`` with :data:`ARROW_UNCHECKED` appended to the driver's and executors' Java options, unless
    ``arrow_checks`` or the options already set an ``arrow.enable_`` property (the user's choice wins)."""
    out = dict(conf)
    if arrow_checks:
        return out
    for key in JAVA_OPTION_KEYS:
        given = out.get(key, "").strip()
        if "-Darrow.enable_" not in given:
            out[key] = " ".join([given, *ARROW_UNCHECKED]).strip()
    return out


def session(master: str | None = None, conf: dict[str, str] | None = None, app_name: str = "rocketstore",
            arrow_checks: bool = False) -> Any:
    """A SparkSession with the ``rocketstore`` format registered.

    ``master`` defaults to ``local[*]`` unless the process runs under
    spark-submit (which sets the master itself).  SPARK_LOCAL_IP and
    PYSPARK_PYTHON default to the loopback address and this Python.  The
    JVMs run without Arrow Java's per-value checks (:data:`ARROW_UNCHECKED`)
    unless ``arrow_checks``; under spark-submit the driver's JVM is already
    running, so only the executors get them.
    """
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise StoreError("pyspark is not installed (pip install 'rocketstore[spark]')") from None

    from . import register
    builder = SparkSession.builder.appName(app_name)
    under_submit = "PYSPARK_GATEWAY_PORT" in os.environ
    if master is not None or not under_submit:
        builder = builder.master(master or "local[*]")
    defaults = {"spark.ui.showConsoleProgress": "false", "spark.sql.session.timeZone": "UTC"}
    for k, v in java_options({**defaults, **(conf or {})}, arrow_checks).items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    _serve_submitted_py_files(spark)
    register(spark)
    return spark


def _serve_submitted_py_files(spark: Any) -> None:
    """Make sure executors receive the ``spark.submit.pyFiles`` of this session.

    spark-submit serves those files to executors when it starts the driver's JVM; a later
    SparkContext in the same Python process (the JVM is reused) only puts them on the driver's
    path, and executors then fail with "No module named 'rocketstore'".  Add any file Spark does not
    serve yet.
    """
    try:
        sc = spark.sparkContext
        wanted = [p for p in sc.getConf().get("spark.submit.pyFiles", "").split(",") if p]
        served = {os.path.basename(f.rstrip("/")) for f in sc.listFiles}
    except Exception:  # noqa: BLE001 - Spark Connect has no SparkContext: nothing to serve from here
        return
    for path in wanted:
        if os.path.basename(path) not in served:
            log.info("adding %s (spark.submit.pyFiles) for executors", path)
            sc.addPyFile(path)


# ---------------------------------------------------------------- verify

def _segment_list(store: MessageStore) -> list[tuple[str, int, int, int, bool]]:
    files = list(store.commitlog.queue.files)
    return [(f.path, f.file_from_offset, f.wrote_position, f.file_size, i == len(files) - 1)
            for i, f in enumerate(files)]


def _check_segment(seg: tuple[str, int, int, int, bool]) -> Any:
    """Executor side of verify: the single-machine per-segment check, on a read-only map of the file."""
    import mmap as _mmap

    from ..recovery.verify import check_segment
    path, base, limit, file_size, is_last = seg
    with open(path, "rb") as fh:
        mm = _mmap.mmap(fh.fileno(), 0, access=_mmap.ACCESS_READ)
    try:
        return check_segment(mm, path, base, limit, file_size, is_last)
    finally:
        mm.close()


def verify(spark: Any, store_path: str, config: Any = None) -> dict[str, Any]:
    """CRC-check every record in parallel (one task per segment) and cross-check consume queues and index.

    The findings and counts are those of ``rocketstore verify`` (:func:`rocketstore.recovery.verify.verify_store`):
    the per-segment check is the same function, run on the executors, and the cross-check runs on the
    driver with the records they return.
    """
    from ..recovery.verify import verify_report
    root = os.path.abspath(store_path)
    with MessageStore.open(root, config, read_only=True) as store:
        segs = _segment_list(store)
        sc = spark.sparkContext
        results = sc.parallelize(segs, max(1, len(segs))).map(_check_segment).collect() if segs else []
        return verify_report(store.files, results)


# ---------------------------------------------------------------- rebuild

_DISPATCH_COLUMNS = ["commitLogOffset", "size", "topic", "queueId", "queueOffset", "sysFlag", "storeTimestamp",
                     "propertiesString"]


def _dispatch_rows(task: tuple[str, int, int]) -> bytes:
    """Executor side of rebuild: what dispatch needs of each record of one segment, as Arrow IPC bytes."""
    import pyarrow as pa

    from .segment import read_range
    path, start, end = task
    sink = io.BytesIO()
    schema = None
    writer = None
    for b in read_range(path, start, end, _DISPATCH_COLUMNS):
        if writer is None:
            schema = b.schema
            writer = pa.ipc.new_stream(sink, schema)
        writer.write_batch(b)
    if writer is not None:
        writer.close()
    return sink.getvalue()


class _RebuildTarget:
    """What CommitLogDispatcher needs of a store, pointing at fresh consume-queue and index directories."""

    def __init__(self, config: Any, cq_root: str, index_dir: str) -> None:
        from ..storage.consume_queue import ConsumeQueue
        from ..storage.index import IndexService
        self._cq_class = ConsumeQueue
        self.config = config
        self.cq_root = cq_root
        self.checkpoint = SimpleNamespace(logicsMsgTimestamp=0)
        self.index_service = IndexService(index_dir, config.maxHashSlotNum, config.maxIndexNum)
        self.queues: dict[tuple[str, int], Any] = {}

    def find_consume_queue(self, topic: str, queue_id: int) -> Any:
        cq = self.queues.get((topic, queue_id))
        if cq is None:
            cq = self._cq_class(self.cq_root, topic, queue_id, self.config.mappedFileSizeConsumeQueue)
            os.makedirs(cq.directory, exist_ok=True)
            self.queues[(topic, queue_id)] = cq
        return cq

    def close(self) -> None:
        for cq in self.queues.values():
            cq.flush(0)
            cq.close()
        self.index_service.flush()
        self.index_service.close()


def rebuild(spark: Any, store_path: str, config: Any = None) -> dict[str, Any]:
    """Rebuild the consume queues and the index from the commitlog.

    Executors decode their segments in parallel; the driver applies the records
    in commitlog order with :class:`rocketstore.services.dispatch.CommitLogDispatcher`
    (the code recovery and the live dispatcher use) into fresh directories,
    then swaps them in.  The store must not be open for writing meanwhile (its
    lock is held for the whole job).  The commitlog is not changed.

    ``config`` (a StoreConfig or a broker.conf path) gives the geometry when the
    consume queues or the index are gone and cannot be measured from their files.
    """
    import pyarrow as pa
    import pyarrow.compute

    from ..storage.checkpoint import StoreCheckpoint
    from ..services.dispatch import CommitLogDispatcher
    root = os.path.abspath(store_path)
    t0 = time.monotonic()
    paths = StorePaths(root)
    if not os.path.isdir(paths.commitlog):
        raise StoreError(f"{root}: not a message store (no commitlog directory)")
    with StoreLock(root):
        with MessageStore.open(root, config, read_only=True) as store:
            config = store.config
            tasks = [(f.path, 0, f.wrote_position) for f in store.commitlog.queue.files if f.wrote_position > 0]
            max_phy = store.max_phy_offset()
        work = os.path.join(root, f".rebuild-{int(time.time() * 1000)}")
        os.makedirs(work)
        try:
            target = _RebuildTarget(config, StorePaths(work).consumequeue, StorePaths(work).index)
            os.makedirs(target.cq_root)
            dispatcher = CommitLogDispatcher(target)  # type: ignore[arg-type]
            records = 0
            last_ts = 0
            sc = spark.sparkContext
            rdd = sc.parallelize(tasks, max(1, len(tasks))).map(_dispatch_rows)
            for blob in rdd.toLocalIterator():
                if not blob:
                    continue
                for batch in pa.ipc.open_stream(blob):
                    cols = []
                    for name in _DISPATCH_COLUMNS:
                        col = batch.column(batch.schema.get_field_index(name))
                        if name == "storeTimestamp":
                            col = pa.compute.divide(col.cast(pa.int64()), 1000)
                        cols.append(col.to_pylist())
                    for off, size, topic, qid, qoff, sysflag, ts, props in zip(*cols):
                        if off + size > max_phy:
                            break
                        header = (size, codec.MAGIC_V1, 0, qid, 0, qoff, off, sysflag, 0, b"", 0, ts, b"", 0, 0, 0, 0)
                        dispatcher.dispatch(codec.MessageExt(header, topic, props or "", None))
                        records += 1
                        last_ts = ts
            if target.index_service.build_error:  # dispatch notes an index failure and goes on; a rebuild must not
                raise StoreError(f"{root}: index rebuild failed from commitlog offset "
                                 f"{target.index_service.missed_from}: {target.index_service.build_error}")
            index_files = len(target.index_service.files)
            index_entries = sum(f.index_count - 1 for f in target.index_service.files)
            index_end_ts = target.index_service.files[-1].end_timestamp if target.index_service.files else 0
            queues = len(target.queues)
            cq_files = sum(len(cq.queue.files) for cq in target.queues.values())
            target.close()
            for name in ("consumequeue", "index"):
                live = os.path.join(root, name)
                if os.path.exists(live):
                    os.replace(live, os.path.join(work, f"old-{name}"))
                new = os.path.join(work, name)
                if os.path.exists(new):
                    os.replace(new, live)
            if os.path.exists(paths.checkpoint):
                cp = StoreCheckpoint.load(paths.checkpoint)
                cp.logicsMsgTimestamp = last_ts or cp.logicsMsgTimestamp
                cp.indexMsgTimestamp = index_end_ts or cp.indexMsgTimestamp
                cp.flush()
        finally:
            shutil.rmtree(work, ignore_errors=True)
    result = {"store": root, "segments": len(tasks), "records": records, "consumeQueues": queues,
              "consumeQueueFiles": cq_files, "indexFiles": index_files, "indexEntries": index_entries,
              "seconds": round(time.monotonic() - t0, 3)}
    log.info("rebuilt %s: %s", root, result)
    return result


# ---------------------------------------------------------------- export / import

PARTITION_COLUMNS = ("topic", "queueId", "date", "hour")


def _with_partition_columns(df: Any, cols: Iterable[str]) -> Any:
    from pyspark.sql import functions as F
    for c in cols:
        if c == "date":  # the UTC day of storeTimestamp, whatever the session time zone
            df = df.withColumn("date", F.expr("date_from_unix_date(cast(floor(unix_millis(storeTimestamp) / "
                                              "86400000) as int))"))
        elif c == "hour":
            df = df.withColumn("hour", F.expr("cast(pmod(floor(unix_millis(storeTimestamp) / 3600000), 24) "
                                              "as int)"))
    return df


def export(spark: Any, store_path: str, to: str, *, fmt: str = "parquet", partition_by: Iterable[str] = (),
           mode: str = "errorifexists", options: dict[str, str] | None = None,
           selection: Selection | None = None) -> dict[str, Any]:
    """Write every message (all ``dump`` fields, body included) as Parquet (or ORC) under ``to``.

    ``partition_by`` may name topic, queueId, date and hour (the UTC day and hour of storeTimestamp).
    Reading the files back and writing them with ``format("rocketstore")`` gives the same messages.
    ``selection`` limits the export to what ``rocketstore dump`` with the same flags prints.
    """
    fmt = fmt.lower()
    if fmt not in ("parquet", "orc"):
        raise StoreError(f"export format {fmt!r}: parquet or orc")
    cols = [c.strip() for c in partition_by if c.strip()]
    bad = [c for c in cols if c not in PARTITION_COLUMNS]
    if bad:
        raise StoreError(f"--partition-by {','.join(bad)}: choose from {', '.join(PARTITION_COLUMNS)}")
    t0 = time.monotonic()
    reader = spark.read.format("rocketstore")
    options = {"dropCache": "true", **(options or {})}
    if selection is not None and selection != Selection():  # (everything needs no driver-side look)
        options.update(selection_options(store_path, selection))
    for k, v in options.items():
        reader = reader.option(k, v)
    df = _with_partition_columns(reader.load(os.path.abspath(store_path)), cols)
    writer = df.write.mode(mode).format(fmt)
    if cols:
        writer = writer.partitionBy(*cols)
    writer.save(to)
    rows = files = 0
    for d, _dirs, names in os.walk(to):
        for n in names:
            if n.endswith(f".{fmt}") and not n.startswith("."):
                files += 1
                if fmt == "parquet":
                    import pyarrow.parquet as pq
                    rows += pq.ParquetFile(os.path.join(d, n)).metadata.num_rows
    out = {"store": os.path.abspath(store_path), "to": os.path.abspath(to), "format": fmt, "partitionBy": cols,
           "files": files, "seconds": round(time.monotonic() - t0, 3)}
    if fmt == "parquet":
        out["rows"] = rows
    return out


def selection_options(store_path: str, sel: Selection) -> dict[str, str]:
    """Reader options that read exactly ``sel``: its start (and, under a size limit, its end) is found on
    the driver through the consume queues and a header-only walk; times and topic are reader filters."""
    with MessageStore.open(os.path.abspath(store_path), read_only=True) as store:
        start, end = sel.offset_range(store)
    out = {"startingOffsets": str(start)}
    if end is not None:
        out["endingOffsets"] = str(end)
    if sel.topic is not None:
        out["topics"] = sel.topic
    if sel.from_time is not None:
        out["startingTimestamp"] = str(sel.from_time)
    if sel.to_time is not None:
        out["endingTimestamp"] = str(sel.to_time + 1)  # the reader's end is exclusive
    return out


def import_files(spark: Any, source: str, store_path: str, *, fmt: str = "parquet", replay: bool = False,
                 options: dict[str, str] | None = None) -> dict[str, Any]:
    """Append the messages of an export (or any Parquet/ORC with topic and body columns) to a store."""
    t0 = time.monotonic()
    df = spark.read.format(fmt).load(source)
    writer = df.write.format("rocketstore").mode("append").option("replay", str(replay).lower())
    for k, v in (options or {}).items():
        writer = writer.option(k, v)
    root = os.path.abspath(store_path)
    before = _max_offset(root)
    writer.save(root)
    after = _max_offset(root)
    return {"store": root, "from": os.path.abspath(source), "appendedBytes": after - before,
            "maxPhyOffset": after, "seconds": round(time.monotonic() - t0, 3)}


def _max_offset(root: str) -> int:
    if not os.path.isdir(StorePaths(root).commitlog):
        return 0
    with MessageStore.open(root, read_only=True) as store:
        return store.max_phy_offset()


# ---------------------------------------------------------------- stats

_BUCKETS = [(100, "100 ms"), (1000, "1 s"), (10000, "10 s"), (60000, "1 min"), (600000, "10 min"),
            (3600000, "1 h"), (86400000, "1 day")]  # (milliseconds, label)


def stats(spark: Any, store_path: str, *, plot: str | None = None, options: dict[str, str] | None = None
          ) -> dict[str, Any]:
    """Messages and bytes per topic, queue and hour; body-size percentiles; key cardinality; dispatch lag.

    ``plot``: write a PNG of traffic over time (messages and bytes per time bucket, per topic).
    """
    from pyspark.sql import functions as F
    root = os.path.abspath(store_path)
    reader = spark.read.format("rocketstore").option("withBody", "false")
    for k, v in (options or {}).items():
        reader = reader.option(k, v)
    df = reader.load(root).select("topic", "queueId", "queueOffset", "commitLogOffset", "size", "sysFlag",
                                  "storeTimestamp", "bodyLength", "keys", "tags",
                                  F.col("properties")["UNIQ_KEY"].alias("uniqKey"),
                                  F.expr("unix_millis(storeTimestamp)").alias("ts"))
    df = df.cache()
    try:
        tot = df.agg(F.count(F.lit(1)).alias("messages"), F.sum("size").alias("bytes"),
                     F.sum("bodyLength").alias("bodyBytes"), F.min("ts").alias("first"),
                     F.max("ts").alias("last"), F.max(F.col("commitLogOffset") + F.col("size")).alias("end"),
                     F.countDistinct("topic").alias("topics"),
                     F.count("keys").alias("withKeys"), F.count("tags").alias("withTags"),
                     F.countDistinct("uniqKey").alias("uniqKeys"), F.countDistinct("tags").alias("tagValues"),
                     ).first().asDict()
        messages = tot["messages"]
        out: dict[str, Any] = {"store": root, "messages": messages, "bytes": tot["bytes"] or 0,
                               "bodyBytes": tot["bodyBytes"] or 0, "firstStoreTimestamp": tot["first"],
                               "lastStoreTimestamp": tot["last"]}
        by_topic = df.groupBy("topic").agg(F.count(F.lit(1)).alias("messages"), F.sum("size").alias("bytes"),
                                           F.sum("bodyLength").alias("bodyBytes"),
                                           F.countDistinct("queueId").alias("queues")).orderBy("topic").collect()
        out["byTopic"] = [r.asDict() for r in by_topic]
        by_queue = df.groupBy("topic", "queueId").agg(
            F.count(F.lit(1)).alias("messages"), F.sum("size").alias("bytes"),
            F.min("queueOffset").alias("minQueueOffset"), F.max("queueOffset").alias("maxQueueOffset"),
        ).orderBy("topic", "queueId").collect()
        out["byQueue"] = [r.asDict() for r in by_queue]
        hour = F.expr("floor(ts / 3600000) * 3600000")
        by_hour = df.groupBy(hour.alias("hour"), "topic").agg(F.count(F.lit(1)).alias("messages"),
                                                             F.sum("size").alias("bytes")).collect()
        hours: dict[int, dict[str, Any]] = {}
        for r in by_hour:
            h = hours.setdefault(r["hour"], {"hour": _iso_hour(r["hour"]), "messages": 0, "bytes": 0, "topics": {}})
            h["messages"] += r["messages"]
            h["bytes"] += r["bytes"]
            h["topics"][r["topic"]] = r["messages"]
        out["byHour"] = [hours[k] for k in sorted(hours)]
        qs = [0.5, 0.9, 0.99, 0.999]
        pct = df.agg(F.percentile_approx("bodyLength", qs, 100000).alias("p"), F.min("bodyLength").alias("min"),
                     F.max("bodyLength").alias("max"), F.avg("bodyLength").alias("mean")).first()
        out["bodySize"] = {"min": pct["min"], "p50": pct["p"][0] if pct["p"] else None,
                           "p90": pct["p"][1] if pct["p"] else None, "p99": pct["p"][2] if pct["p"] else None,
                           "p999": pct["p"][3] if pct["p"] else None, "max": pct["max"],
                           "mean": round(pct["mean"], 1) if pct["mean"] is not None else None}
        tokens = df.select("topic", F.explode(F.split(F.col("keys"), " ")).alias("key")).where("key != ''")
        key_stats = tokens.agg(F.countDistinct("key").alias("distinct"), F.count(F.lit(1)).alias("total")).first()
        per_topic_keys = tokens.groupBy("topic").agg(F.countDistinct("key").alias("distinctKeys")).collect()
        out["keys"] = {"messagesWithKeys": tot["withKeys"], "keyTokens": key_stats["total"],
                       "distinctKeys": key_stats["distinct"], "distinctUniqKeys": tot["uniqKeys"],
                       "distinctTags": tot["tagValues"], "messagesWithTags": tot["withTags"],
                       "distinctKeysByTopic": {r["topic"]: r["distinctKeys"] for r in per_topic_keys}}
        out["dispatchLag"] = _dispatch_lag(root, df, by_queue)
        if plot:
            span = (tot["last"] or 0) - (tot["first"] or 0)
            size, label = next(((s, lbl) for s, lbl in _BUCKETS if span / s <= 300), _BUCKETS[-1])
            bucket = F.expr(f"floor(ts / {size}) * {size}")
            series = df.groupBy(bucket.alias("t"), "topic").agg(F.count(F.lit(1)).alias("messages"),
                                                               F.sum("size").alias("bytes")).collect()
            _plot_traffic(series, plot, label, size, root)
            out["plot"] = os.path.abspath(plot)
        return out
    finally:
        df.unpersist()


def _iso_hour(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:00Z", time.gmtime(ms / 1000))


def _dispatch_lag(root: str, df: Any, by_queue: list[Any]) -> dict[str, Any]:
    """How far the consume queues and the index are behind the commitlog (a live store's reput lag)."""
    from pyspark.sql import functions as F

    from ..services.metrics import read_metrics
    with MessageStore.open(root, read_only=True) as store:
        max_phy = store.max_phy_offset()
        cq_end = 0
        cq_max: dict[tuple[str, int], int] = {}
        for cq in store.consume_queues():
            last = cq.last_unit()
            if last is not None:
                cq_end = max(cq_end, last[0] + last[1])
            cq_max[(cq.topic, cq.queue_id)] = cq.max_offset_in_queue
        idx = store.index_service.files
        index_end = idx[-1].end_phy_offset if idx else 0
    queued = (F.col("sysFlag").bitwiseAND(codec.TRANSACTION_MASK)).isin(codec.TRANSACTION_NOT_TYPE,
                                                                      codec.TRANSACTION_COMMIT)
    behind = df.where((F.col("commitLogOffset") >= cq_end) & queued)
    lag = behind.agg(F.count(F.lit(1)).alias("n"), F.min("ts").alias("first")).first()
    last_ts = df.agg(F.max("ts")).first()[0]
    queues = []
    for r in by_queue:
        in_log = r["maxQueueOffset"] + 1 if r["maxQueueOffset"] is not None else 0
        in_cq = cq_max.get((r["topic"], r["queueId"]), 0)
        if in_log > in_cq:
            queues.append({"topic": r["topic"], "queueId": r["queueId"], "behindMessages": in_log - in_cq})
    out = {"commitLogMaxOffset": max_phy, "consumeQueueMaxOffset": cq_end,
           "behindBytes": max(0, max_phy - cq_end), "behindMessages": lag["n"],
           "behindMs": (last_ts - lag["first"]) if lag["n"] and last_ts is not None else 0,
           "indexMaxOffset": index_end, "queuesBehind": queues}
    live = read_metrics(root)
    if live is not None and "dispatchBehindBytes" in live:
        out["liveDispatchBehindBytes"] = live["dispatchBehindBytes"]
    return out


def _plot_traffic(series: list[Any], path: str, label: str, bucket_ms: int, root: str) -> None:
    """Stacked bars of messages per time bucket and topic, and bytes per bucket below."""
    import matplotlib
    matplotlib.use("Agg")
    from datetime import datetime

    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    topics = sorted({r["topic"] for r in series})
    times = sorted({r["t"] for r in series})
    index = {t: i for i, t in enumerate(times)}
    xs = [mdates.date2num(datetime.fromtimestamp(t / 1000, tz=UTC)) for t in times]
    width = bucket_ms / 86400000 * 0.9  # matplotlib dates are in days
    msgs = {tp: [0] * len(times) for tp in topics}
    size = [0] * len(times)
    for r in series:
        msgs[r["topic"]][index[r["t"]]] += r["messages"]
        size[index[r["t"]]] += r["bytes"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    bottom = [0] * len(times)
    for tp in topics:
        ax1.bar(xs, msgs[tp], width=width, bottom=bottom, label=tp, align="edge")
        bottom = [a + b for a, b in zip(bottom, msgs[tp])]
    ax2.bar(xs, [b / 1e6 for b in size], width=width, color="tab:gray", align="edge")
    ax1.set_ylabel(f"messages per {label}")
    ax2.set_ylabel(f"MB per {label}")
    ax2.set_xlabel("store time (UTC)")
    if topics:
        ax1.legend(loc="upper left", fontsize="small", ncol=min(4, len(topics)))
    ax1.set_title(f"traffic of {root}")
    locator = mdates.AutoDateLocator()
    ax2.xaxis.set_major_locator(locator)
    ax2.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def stats_table(result: dict[str, Any]) -> str:
    """The stats as a plain-text table."""
    lines = [(f"store {result['store']}: {result['messages']:,} messages, {result['bytes']:,} bytes "
              f"({result['bodyBytes']:,} in bodies)")]
    if result.get("firstStoreTimestamp") is not None:
        lines.append(f"store time {_iso(result['firstStoreTimestamp'])} .. {_iso(result['lastStoreTimestamp'])}")
    lines.append("")
    lines.append(f"{'topic':<40} {'queues':>6} {'messages':>12} {'bytes':>14}")
    for r in result["byTopic"]:
        lines.append(f"{r['topic']:<40} {r['queues']:>6} {r['messages']:>12,} {r['bytes']:>14,}")
    lines.append("")
    lines.append(f"{'topic':<40} {'queue':>6} {'messages':>12} {'bytes':>14} {'offsets':>17}")
    for r in result["byQueue"]:
        lines.append(f"{r['topic']:<40} {r['queueId']:>6} {r['messages']:>12,} {r['bytes']:>14,} "
                     f"{r['minQueueOffset']:>8}..{r['maxQueueOffset']:<8}")
    lines.append("")
    lines.append(f"{'hour (UTC)':<20} {'messages':>12} {'bytes':>14}")
    for h in result["byHour"]:
        lines.append(f"{h['hour']:<20} {h['messages']:>12,} {h['bytes']:>14,}")
    b = result["bodySize"]
    lines.append("")
    lines.append(f"body size: min {b['min']}  p50 {b['p50']}  p90 {b['p90']}  p99 {b['p99']}  p99.9 {b['p999']}  "
                 f"max {b['max']}  mean {b['mean']}")
    k = result["keys"]
    lines.append(f"keys: {k['distinctKeys']:,} distinct of {k['keyTokens']:,} in {k['messagesWithKeys']:,} "
                 f"messages; {k['distinctUniqKeys']:,} distinct UNIQ_KEY; {k['distinctTags']} tag values")
    d = result["dispatchLag"]
    lines.append(f"dispatch lag: {d['behindBytes']:,} bytes, {d['behindMessages']:,} messages, {d['behindMs']} ms "
                 f"(commitlog end {d['commitLogMaxOffset']}, consume queues reach {d['consumeQueueMaxOffset']}, "
                 f"index reaches {d['indexMaxOffset']})")
    if result.get("plot"):
        lines.append(f"plot: {result['plot']}")
    return "\n".join(lines) + "\n"


def _iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"
