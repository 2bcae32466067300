"""Issue 28: the options of Spark's Kafka source on the ``rocketstore`` source, against the golden stores.

Consume queues are Kafka's partitions, queue offsets its offsets. One SparkSession (local[2]) serves the module;
the driver-side rules (errors, admission control) are also checked on the reader classes directly, without Spark.
"""

from __future__ import annotations

import base64
import json
import time

import pytest

pyspark = pytest.importorskip("pyspark")

from conftest import copy_store, golden_expected, golden_store, local_spark
from spark.test_spark import ms

from rocketstore import Message, MessageStore
from rocketstore.errors import StoreError
from rocketstore.spark import queues, source
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows, ReadMinRows

BASIC = str(golden_store("basic"))
EXP = golden_expected("basic")


@pytest.fixture(scope="module")
def spark():
    s = local_spark("rocketstore kafka options", 4)
    yield s
    s.stop()


def kafka_read(spark, path=BASIC, **options):
    r = spark.read.format("rocketstore")
    for k, v in options.items():
        r = r.option(k, v)
    return r.load(path)


def ids(rows) -> list[tuple[str, int, int]]:
    return sorted((r.topic, r.queueId, r.queueOffset) for r in rows)


def expected(pred) -> list[tuple[str, int, int]]:
    return sorted((e["topic"], e["queueId"], e["queueOffset"]) for e in EXP if pred(e))


def queue_of(e) -> tuple[str, int]:
    return e["topic"], e["queueId"]


def stream_reader(path=BASIC, **options) -> source.RocketStoreStreamReader:
    return source.RocketStoreStreamReader({"path": path, **options}, source.spark_schema())


def batch_error(**options) -> str:
    with pytest.raises(StoreError) as ei:
        source.RocketStoreReader({"path": BASIC, **options}, source.spark_schema()).partitions()
    return str(ei.value)


# ---------------------------------------------------------------- point 7: Kafka's columns

def test_kafka_job_runs_with_only_the_format_name_changed(spark):
    """The query text of a Kafka batch job (subscribe, startingOffsets, CAST(value AS STRING), partition,
    offset, timestamp, headers), with kafkaColumns=true: every field equals the golden message's."""
    df = (spark.read.format("rocketstore").option("subscribe", "TopicA,TopicB").option("startingOffsets", "earliest")
          .option("kafkaColumns", "true").load(BASIC))
    assert dict(df.dtypes).items() >= {"key": "binary", "value": "binary", "topic": "string", "partition": "int",
                                     "offset": "bigint", "timestamp": "timestamp", "timestampType": "int",
                                     "headers": "array<struct<key:string,value:binary>>"}.items()
    rows = df.selectExpr("CAST(key AS STRING) AS k", "CAST(value AS STRING) AS v", "value", "topic", "partition",
                         "offset", "timestamp", "timestampType", "headers").collect()
    want = {(e["topic"], e["queueId"], e["queueOffset"]): e for e in EXP if e["topic"] in ("TopicA", "TopicB")}
    assert len(rows) == len(want) == sum(1 for e in EXP if e["topic"] != "TopicC")
    for r in rows:
        e = want.pop((r.topic, r.partition, r.offset))
        body = base64.b64decode(e["body"])
        assert bytes(r.value) == body
        try:
            assert r.v == body.decode("utf-8")  # half the golden bodies are UTF-8 text
        except UnicodeDecodeError:
            pass
        assert r.k == (e["keys"].split(" ")[0] if e.get("keys") else None)
        assert ms(r.timestamp) == e["storeTimestamp"] and r.timestampType == 1
        assert {h.key: bytes(h.value).decode() for h in r.headers} == e["properties"]
        assert len(r.headers) == len(e["properties"])
    assert not want


def test_kafka_columns_off_by_default(spark):
    assert "value" not in kafka_read(spark).columns


# ---------------------------------------------------------------- point 1: per-queue offsets, assign, pattern

def test_per_queue_offsets_with_assign(spark):
    df = kafka_read(spark, assign='{"TopicA": [0, 1]}', startingOffsets='{"TopicA": {"0": 23, "1": -2}}',
                    endingOffsets='{"TopicA": {"0": 50, "1": 10}}')
    got = ids(df.select("topic", "queueId", "queueOffset").collect())
    assert got == expected(lambda e: e["topic"] == "TopicA" and (
        e["queueId"] == 0 and 23 <= e["queueOffset"] < 50 or e["queueId"] == 1 and e["queueOffset"] < 10))
    assert len(got) == 27 + 10


def test_subscribe_pattern_batch_reads_every_matching_queue_once(spark):
    df = kafka_read(spark, subscribePattern="Topic[BC]", startingOffsets="earliest", maxRecordsPerPartition="100")
    rows = df.select("topic", "queueId", "queueOffset", "commitLogOffset").collect()
    assert ids(rows) == expected(lambda e: e["topic"] in ("TopicB", "TopicC"))
    assert sorted(r.commitLogOffset for r in rows) == sorted(e["commitLogOffset"] for e in EXP
                                                             if e["topic"] in ("TopicB", "TopicC"))
    assert df.rdd.getNumPartitions() == sum(-(-n // 100) for n in (415, 452, 604))  # maxRecordsPerPartition


def test_option_errors_name_the_option_and_value():
    msg = batch_error(startingOffsets='{"TopicA": {"0": 1')
    assert msg.startswith("option startingOffsets='{\"TopicA\"") and "not valid JSON" in msg
    msg = batch_error(startingOffsets='{"Nope": {"0": 1}}')
    assert "startingOffsets" in msg and "Nope" in msg and "no topic" in msg
    msg = batch_error(assign='{"TopicZ": [0]}')
    assert msg.startswith("option assign=") and "TopicZ" in msg
    msg = batch_error(assign='{"TopicA": [9]}')
    assert "no queue 9 of topic TopicA" in msg
    msg = batch_error(assign='["TopicA"]')
    assert "assign" in msg and '["TopicA"]' in msg
    msg = batch_error(endingOffsets='{"TopicA": {"0": 100000}}')
    assert "endingOffsets" in msg and "past the queue's end 380" in msg
    assert "only one of" in batch_error(assign='{"TopicA": [0]}', subscribePattern="Topic.*")
    assert "not a regular expression" in batch_error(subscribePattern="Topic(")
    assert "latest" in batch_error(assign='{"TopicA": [0]}', startingOffsets="latest")


def test_stream_errors_name_the_option():
    with pytest.raises(StoreError, match="startingOffsets.*TopicQ"):
        stream_reader(startingOffsets='{"TopicQ": {"0": 0}}').initialOffset()
    with pytest.raises(StoreError, match="maxOffsetsPerTrigger=0"):
        stream_reader(maxOffsetsPerTrigger="0")


# ---------------------------------------------------------------- point 2: offsets by timestamp

def _times(topic, qid):
    return sorted((e["queueOffset"], e["storeTimestamp"]) for e in EXP if queue_of(e) == (topic, qid))


def test_offsets_by_timestamp_batch(spark):
    a0 = _times("TopicA", 0)
    t_start = a0[100][1]
    t_end = a0[300][1]
    first = next(o for o, t in a0 if t >= t_start)
    end = next(o for o, t in a0 if t >= t_end)
    df = kafka_read(spark, assign='{"TopicA": [0]}',
                    startingOffsetsByTimestamp=json.dumps({"TopicA": {"0": t_start}}),
                    endingOffsetsByTimestamp=json.dumps({"TopicA": {"0": t_end}}))
    got = ids(df.select("topic", "queueId", "queueOffset").collect())
    assert got == [("TopicA", 0, o) for o in range(first, end)] and first <= 100 and len(got) > 150


def test_starting_timestamp_strategy():
    late = max(e["storeTimestamp"] for e in EXP) + 1
    spec = json.dumps({"TopicB": {"1": late}})
    msg = batch_error(assign='{"TopicB": [1]}', startingOffsetsByTimestamp=spec)
    assert "startingOffsetsByTimestamp" in msg and "TopicB/1" in msg and "no message stored at or after" in msg
    r = stream_reader(assign='{"TopicB": [1]}', startingOffsetsByTimestamp=spec,
                      startingOffsetsByTimestampStrategy="latest")
    assert r.initialOffset() == {"TopicB": {"1": 452}}
    with pytest.raises(StoreError, match="startingOffsetsByTimestampStrategy='bogus'"):
        stream_reader(startingOffsetsByTimestampStrategy="bogus", assign='{"TopicB": [1]}')


def test_stream_from_offsets_by_timestamp(spark, tmp_path):
    b1 = _times("TopicB", 1)
    t = b1[400][1]
    first = next(o for o, ts in b1 if ts >= t)
    q = (spark.readStream.format("rocketstore").option("assign", '{"TopicB": [1], "TopicA": [0, 1]}')
         .option("startingOffsets", '{"TopicA": {"0": 370}}')  # TopicA/1 not named: latest, a stream's default
         .option("startingOffsetsByTimestamp", json.dumps({"TopicB": {"1": t}})).load(BASIC)
         .writeStream.format("memory").queryName("by_ts").option("checkpointLocation", str(tmp_path / "c"))
         .trigger(availableNow=True).start())
    q.awaitTermination(120)
    got = ids(spark.sql("select topic, queueId, queueOffset from by_ts").collect())
    assert got == [("TopicA", 0, o) for o in range(370, 380)] + [("TopicB", 1, o) for o in range(first, 452)]


# ---------------------------------------------------------------- points 3 and 4: rate control, lag

def test_available_now_with_max_offsets_per_trigger_reads_everything_once(spark, tmp_path):
    q = (spark.readStream.format("rocketstore").option("subscribePattern", "Topic[AB]")
         .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", "600").option("kafkaColumns", "true")
         .load(BASIC).selectExpr("topic", "partition", "offset")
         .writeStream.format("memory").queryName("rate").option("checkpointLocation", str(tmp_path / "c"))
         .trigger(availableNow=True).start())
    q.awaitTermination(120)
    total = sum(1 for e in EXP if e["topic"] != "TopicC")
    batches = [p for p in q.recentProgress if p.numInputRows]
    assert [p.numInputRows for p in batches] == [600] * (total // 600) + ([total % 600] if total % 600 else [])
    got = sorted((r.topic, r.partition, r.offset) for r in spark.sql("select * from rate").collect())
    assert got == expected(lambda e: e["topic"] != "TopicC")  # every message, once
    # point 4: the progress shows the latest offsets, and the lag follows from them
    latest = json.loads(batches[0].sources[0].latestOffset)
    assert latest == {"TopicA": {"0": 380, "1": 382, "2": 388, "3": 379}, "TopicB": {"0": 415, "1": 452}}
    lag = queues.offsets_behind(batches[0].sources[0])
    first_end = queues.from_json(json.loads(batches[0].sources[0].endOffset))
    lags = [v - first_end[k] for k, v in queues.from_json(latest).items()]
    assert lag == {"minOffsetsBehindLatest": str(min(lags)), "maxOffsetsBehindLatest": str(max(lags)),
                   "avgOffsetsBehindLatest": str(sum(lags) / len(lags))}
    assert sum(lags) == total - 600
    assert queues.offsets_behind(batches[-1].sources[0])["maxOffsetsBehindLatest"] == "0"
    assert not batches[0].sources[0].metrics  # PySpark 4.3's Python sources cannot report metrics (docs/spark.md)


def test_max_offsets_split_in_proportion_to_each_queue():
    r = stream_reader(assign='{"TopicA": [0, 1], "TopicC": [0]}', startingOffsets="earliest",
                      maxOffsetsPerTrigger="100")
    assert r.getDefaultReadLimit() == ReadMaxRows(100)
    start = r.initialOffset()
    end = r.latestOffset(start, ReadMaxRows(100))
    # available 380, 382, 604 (1366): shares 27.8, 27.96, 44.2 -> 27, 28, 44 (largest remainders), 100 in all
    assert end == {"TopicA": {"0": 28, "1": 28}, "TopicC": {"0": 44}}
    assert r.latestOffset(start, ReadAllAvailable()) == {"TopicA": {"0": 380, "1": 382}, "TopicC": {"0": 604}}
    assert r.reportLatestOffset() == {"TopicA": {"0": 380, "1": 382}, "TopicC": {"0": 604}}


def test_min_offsets_per_trigger_waits_up_to_max_trigger_delay():
    r = stream_reader(assign='{"TopicA": [0]}', startingOffsets='{"TopicA": {"0": 370}}',
                      minOffsetsPerTrigger="50", maxTriggerDelay="15m")
    assert r.getDefaultReadLimit() == ReadMinRows(50)
    start = r.initialOffset()
    assert start == {"TopicA": {"0": 370}}
    assert r.latestOffset(start, ReadMinRows(50)) == start  # 10 < 50 available: no batch yet
    assert r.reportLatestOffset() == {"TopicA": {"0": 380}}
    r.last_trigger -= 15 * 60 + 1  # maxTriggerDelay passed since the last batch
    assert r.latestOffset(start, ReadMinRows(50)) == {"TopicA": {"0": 380}}
    r.prepareForTriggerAvailableNow()  # AvailableNow never waits
    r.last_trigger = time.monotonic()
    assert r.latestOffset(start, ReadMinRows(50)) == {"TopicA": {"0": 380}}
    with pytest.raises(StoreError, match="maxTriggerDelay"):
        stream_reader(assign='{"TopicA": [0]}', minOffsetsPerTrigger="5", maxTriggerDelay="soon")


def test_running_stream_picks_up_new_topics_and_queues(spark, tmp_path):
    """subscribePattern: a topic created while the stream runs is read from its earliest offset; the stream
    starts at latest (nothing old is read)."""
    store_dir = copy_store(golden_store("basic"), tmp_path / "s")
    store = MessageStore.open(str(store_dir))
    try:
        q = (spark.readStream.format("rocketstore").option("subscribePattern", "Topic(A|New)")
             .option("kafkaColumns", "true").load(str(store_dir))
             .selectExpr("topic", "partition", "offset", "CAST(value AS STRING) AS v")
             .writeStream.format("memory").queryName("pattern").option("checkpointLocation", str(tmp_path / "c"))
             .trigger(processingTime="100 milliseconds").start())
        try:
            deadline = time.monotonic() + 60
            while q.lastProgress is None and time.monotonic() < deadline:
                time.sleep(0.1)
            for i in range(12):
                assert store.put(Message("TopicNew", f"n{i}".encode(), queue_id=i % 3)).ok
            assert store.put(Message("TopicA", b"a-new", queue_id=2)).ok
            assert store.put(Message("TopicB", b"not matched", queue_id=0)).ok
            while time.monotonic() < deadline and spark.sql("select * from pattern").count() < 13:
                time.sleep(0.2)
        finally:
            q.stop()
    finally:
        store.close()
    rows = spark.sql("select * from pattern").collect()
    assert sorted((r.topic, r.partition, r.offset, r.v) for r in rows) == sorted(
        [("TopicNew", i % 3, i // 3, f"n{i}") for i in range(12)] + [("TopicA", 2, 388, "a-new")])


def test_commitlog_view_reports_the_tail_as_latest_offset():
    """Outside the queue view the progress's latestOffset is the store's tail while maxBytesPerTrigger cuts."""
    import os
    root = os.path.abspath(BASIC)
    tail = max(e["commitLogOffset"] + e["size"] for e in EXP)
    r = stream_reader(root, startingOffsets="earliest", maxBytesPerTrigger="1000000")
    end = r.latestOffset(r.initialOffset(), r.getDefaultReadLimit())
    assert end[root] < tail  # cut by maxBytesPerTrigger
    assert r.reportLatestOffset() == {root: tail}


def test_queue_view_fail_on_data_loss(tmp_path):
    """Messages deleted before a stream read them fail it (naming the queue) unless failOnDataLoss=false, which
    skips to each queue's earliest remaining offset."""
    import glob
    import os
    store_dir = str(copy_store(golden_store("basic"), tmp_path / "s"))
    first = sorted(glob.glob(store_dir + "/commitlog/*"))[0]
    second_base = int(os.path.basename(sorted(glob.glob(store_dir + "/commitlog/*"))[1]))
    os.remove(first)  # as retention deletes the oldest segment
    gone = 1 + max(e["queueOffset"] for e in EXP
                   if queue_of(e) == ("TopicA", 0) and e["commitLogOffset"] < second_base)
    start = {"TopicA": {"0": 0}}
    r = stream_reader(store_dir, assign='{"TopicA": [0]}')
    with pytest.raises(StoreError, match="TopicA/0 queue offset 0 is gone.*failOnDataLoss=false"):
        r.latestOffset(start, ReadAllAvailable())
    r = stream_reader(store_dir, assign='{"TopicA": [0]}', failOnDataLoss="false")
    assert r.latestOffset(start, ReadAllAvailable()) == {"TopicA": {"0": 380}}
    spans = [s for p in r.partitions(start, {"TopicA": {"0": 380}}) for s in p.value]
    assert [(s.lo, s.hi) for s in spans] == [(gone, 380)]
    rows = [row for p in r.partitions(start, {"TopicA": {"0": 380}}) for b in r.read(p) for row in
            b.select(["queueOffset"]).to_pylist()]
    assert [x["queueOffset"] for x in rows] == list(range(gone, 380))
