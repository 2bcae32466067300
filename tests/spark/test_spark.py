"""Issue 7: the PySpark data source and jobs, against RocketMQ's golden stores.

One SparkSession (local[2]) serves the whole module.
"""

from __future__ import annotations

import base64
import filecmp
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

pyspark = pytest.importorskip("pyspark")

from conftest import local_spark, GOLDEN, copy_store, flip_body_bit, golden_expected, golden_queries, golden_store, run_cli

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.config import golden_config
from rocketstore.spark import plan, segment
from rocketstore.recovery.verify import verify_store

BASIC = str(golden_store("basic"))
GOLDEN_GEOMETRY = {"mappedFileSizeCommitLog": "1048576", "mappedFileSizeConsumeQueue": "6000",
                   "maxHashSlotNum": "1000", "maxIndexNum": "4000"}
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@pytest.fixture(scope="module")
def spark():
    s = local_spark("rocketstore tests", 4)
    yield s
    s.stop()


def ms(ts) -> int:
    """Epoch milliseconds of a collected timestamp (PySpark gives naive local datetimes)."""
    if ts.tzinfo is not None:
        return (ts - EPOCH) // timedelta(milliseconds=1)
    return round(ts.timestamp() * 1000)


def rs(spark, path=BASIC, **options):
    """A read with one segment per partition (unless told otherwise), so that partitions count segments."""
    r = spark.read.format("rocketstore")
    options.setdefault("maxPartitionBytes", "1")
    for k, v in options.items():
        r = r.option(k, v)
    return r.load(path)


def offsets(df) -> list[int]:
    return sorted(r.commitLogOffset for r in df.select("commitLogOffset").collect())


# ---------------------------------------------------------------- batch reads

def test_count_schema_and_partitions_per_segment(spark):
    df = rs(spark)
    assert df.count() == 3000
    assert df.columns == segment.COLUMN_NAMES
    assert dict(df.dtypes)["storeTimestamp"] == "timestamp"
    assert dict(df.dtypes)["properties"] == "map<string,string>"
    assert dict(df.dtypes)["body"] == "binary"
    assert df.rdd.getNumPartitions() == len(glob.glob(BASIC + "/commitlog/*")) == 4
    no_body = rs(spark, withBody="false")
    assert "body" not in no_body.columns and no_body.count() == 3000


def test_small_segments_are_packed_into_fewer_partitions(spark):
    packed = spark.read.format("rocketstore").load(BASIC)  # 3.7 MB: one task decodes all four files
    assert packed.rdd.getNumPartitions() == 1 and packed.count() == 3000
    two = rs(spark, maxPartitionBytes=str(2 * 1024 * 1024))
    assert two.rdd.getNumPartitions() == 2 and offsets(two) == sorted(e["commitLogOffset"]
                                                                    for e in golden_expected("basic"))


def test_per_topic_and_per_queue_counts_equal_the_recorded_state(spark):
    want = {(q["topic"], q["queueId"]): q["messageTotalInQueue"] for q in golden_queries("basic")["storeState"]["queues"]}
    got = {(r.topic, r.queueId): r["count"] for r in rs(spark, withBody="false").groupBy("topic", "queueId").count()
           .collect()}
    assert got == want
    by_topic = {r.topic: r["count"] for r in rs(spark, withBody="false").groupBy("topic").count().collect()}
    assert by_topic == {t: sum(n for (tt, _), n in want.items() if tt == t) for t, _ in want}


@pytest.mark.parametrize("name", ["basic", "ipv6", "batch", "v2", "txn"])
def test_every_field_of_every_message_equals_what_java_decoded(spark, name):
    expected = {e["commitLogOffset"]: e for e in golden_expected(name)}
    rows = rs(spark, str(golden_store(name))).collect()
    assert len(rows) == len(expected)
    for r in rows:
        e = expected[r.commitLogOffset]
        d = r.asDict()
        d["bornTimestamp"], d["storeTimestamp"] = ms(d["bornTimestamp"]), ms(d["storeTimestamp"])
        d["body"] = base64.b64encode(d["body"]).decode()
        assert d == {k: e[k] for k in segment.COLUMN_NAMES}, r.commitLogOffset


def test_several_stores_in_one_read(spark):
    df = rs(spark, [BASIC, str(golden_store("txn")), str(golden_store("v2"))], withBody="false")
    assert df.count() == 3000 + 24 + 40
    assert df.rdd.getNumPartitions() == 6


# ---------------------------------------------------------------- pruning (options) and DataFrame reuse

def test_reused_dataframe_after_a_filter_counts_every_row(spark):
    """Spark 4.3 reuses the partitions planned during filter pushdown for the next query on the same
    DataFrame that pushes no filter: a source that pruned there made df.count() return 604, not 3000."""
    exp = golden_expected("basic")
    n_c = sum(e["topic"] == "TopicC" for e in exp)
    for pushdown in ("true", "false"):
        spark.conf.set("spark.sql.python.filterPushdown.enabled", pushdown)
        try:
            df = spark.read.format("rocketstore").option("withBody", "false").load(BASIC)
            assert df.where("topic = 'TopicC'").count() == n_c
            assert df.count() == len(exp), pushdown
            assert df.where("length(topic) > 0").count() == len(exp), pushdown
            late = max(e["storeTimestamp"] for e in exp) - 500
            assert df.where(f"storeTimestamp > timestamp_millis({late})").count() == \
                sum(e["storeTimestamp"] > late for e in exp)
            assert df.groupBy("topic").count().count() == 3
        finally:
            spark.conf.unset("spark.sql.python.filterPushdown.enabled")


def test_where_filters_return_exactly_the_matching_rows(spark):
    """Without pushdown Spark evaluates where() itself; the rows are the same as with pruning options."""
    exp = sorted(golden_expected("basic"), key=lambda e: e["commitLogOffset"])
    lo, hi = exp[1000]["commitLogOffset"], exp[1200]["commitLogOffset"]
    df = rs(spark, withBody="false", maxPartitionBytes=str(256 << 20))
    assert offsets(df.where(f"commitLogOffset >= {lo} and commitLogOffset < {hi}")) == \
        [e["commitLogOffset"] for e in exp[1000:1200]]
    assert [r.commitLogOffset for r in df.where(f"msgId = '{exp[2222]['msgId']}'").collect()] == \
        [exp[2222]["commitLogOffset"]]
    e = exp[1717]
    assert [r.commitLogOffset for r in df.where(f"keys = '{e['keys']}'").collect()] == [e["commitLogOffset"]]


def test_time_options_read_fewer_segments(spark):
    firsts = sorted(segment.first_store_timestamp(p) for p in glob.glob(BASIC + "/commitlog/*"))
    cut = firsts[1] - 1
    df = rs(spark, withBody="false", endingTimestamp=str(cut + 1))
    assert df.rdd.getNumPartitions() == 1
    want = [e["commitLogOffset"] for e in golden_expected("basic") if e["storeTimestamp"] <= cut]
    assert offsets(df) == sorted(want)
    late = rs(spark, withBody="false", startingTimestamp=str(firsts[3] + 1))
    assert late.rdd.getNumPartitions() == 1
    assert offsets(late) == sorted(e["commitLogOffset"] for e in golden_expected("basic")
                                   if e["storeTimestamp"] > firsts[3])


def test_offset_options_read_fewer_segments(spark):
    exp = sorted(golden_expected("basic"), key=lambda e: e["commitLogOffset"])
    lo, hi = exp[1000]["commitLogOffset"], exp[1200]["commitLogOffset"]
    df = rs(spark, withBody="false", startingOffsets=str(lo), endingOffsets=str(hi))
    assert df.rdd.getNumPartitions() == 1
    assert offsets(df) == [e["commitLogOffset"] for e in exp[1000:1200]]


def test_keys_option_uses_the_index(spark):
    e = golden_expected("basic")[1717]
    df = rs(spark, withBody="false", keys=e["keys"])
    assert df.rdd.getNumPartitions() == 1
    assert [r.commitLogOffset for r in df.collect()] == [e["commitLogOffset"]]


def test_bad_queue_ids_option_is_a_clear_error(spark):
    with pytest.raises(Exception, match="option queueIds='1,x'"):
        rs(spark, withBody="false", queueIds="1,x").count()


def _clustered_store(root: Path) -> tuple[str, dict[str, list[int]]]:
    """A store whose first segments hold only TopicX and the last only TopicY, plus a PREPARED TopicY half
    (no consume-queue unit) in the middle of the TopicX segments."""
    cfg = StoreConfig(mappedFileSizeCommitLog=16384, mappedFileSizeConsumeQueue=2000, maxHashSlotNum=100,
                      maxIndexNum=400)
    put: dict[str, list[int]] = {"TopicX": [], "TopicY": []}
    with MessageStore.open(str(root), cfg) as store:
        for i in range(120):
            r = store.put(Message("TopicX", b"x" * 300, queue_id=i % 2, keys=f"x-{i}"))
            put["TopicX"].append(r.commit_log_offset)
            if i == 50:
                r = store.put(Message("TopicY", b"half", sys_flag=4, keys="half"))  # PREPARED
                put["TopicY"].append(r.commit_log_offset)
        for i in range(60):
            r = store.put(Message("TopicY", b"y" * 300, queue_id=0, keys=f"y-{i}"))
            put["TopicY"].append(r.commit_log_offset)
        store.wait_dispatched()
    return str(root), put


def test_topic_and_queue_options_prune_with_the_consume_queues(spark, tmp_path):
    root, put = _clustered_store(tmp_path / "store")
    full = rs(spark, root, withBody="false")
    n_segments = full.rdd.getNumPartitions()
    y = rs(spark, root, withBody="false", topics="TopicY")
    assert y.rdd.getNumPartitions() < n_segments
    assert offsets(y) == sorted(put["TopicY"])  # the PREPARED half's segment was not skipped
    x1 = rs(spark, root, withBody="false", topics="TopicX", queueIds="1")
    assert x1.rdd.getNumPartitions() < n_segments
    assert offsets(x1) == sorted(put["TopicX"][1::2])
    none = rs(spark, root, withBody="false", topics="TopicY", queueIds="5")
    assert none.count() == 0
    report = plan.PlanReport(root)
    plan.plan_scan(root, segment.RowFilter(topics=frozenset({"TopicY"})), report=report)
    assert report.pruned.get("consumeQueue", 0) == n_segments - y.rdd.getNumPartitions()


# ---------------------------------------------------------------- options

def test_offsets_and_timestamps_options_return_exactly_those_messages(spark):
    exp = sorted(golden_expected("basic"), key=lambda e: e["commitLogOffset"])
    a, b = exp[500]["commitLogOffset"], exp[2600]["commitLogOffset"]
    df = rs(spark, withBody="false", startingOffsets=str(a), endingOffsets=str(b))
    assert offsets(df) == [e["commitLogOffset"] for e in exp[500:2600]]
    mid = exp[500]["commitLogOffset"] + 3  # not a record start: records from the next one
    assert offsets(rs(spark, withBody="false", startingOffsets=str(mid), endingOffsets=str(b)))[0] == \
        exp[501]["commitLogOffset"]
    t0, t1 = exp[900]["storeTimestamp"], exp[1900]["storeTimestamp"]
    df = rs(spark, withBody="false", startingTimestamp=str(t0), endingTimestamp=str(t1))
    assert offsets(df) == [e["commitLogOffset"] for e in exp if t0 <= e["storeTimestamp"] < t1]
    both = rs(spark, withBody="false", topics="TopicB,TopicC", startingOffsets=json.dumps({BASIC: a}))
    assert offsets(both) == [e["commitLogOffset"] for e in exp[500:] if e["topic"] in ("TopicB", "TopicC")]
    # A queue with nothing between the bounds is not an error.
    c = [e for e in exp if e["topic"] == "TopicC"]
    gap_lo, gap_hi = c[10]["commitLogOffset"] + 1, c[11]["commitLogOffset"]
    assert rs(spark, withBody="false", topics="TopicC", startingOffsets=str(gap_lo),
              endingOffsets=str(gap_hi)).count() == 0
    assert rs(spark, withBody="false", startingOffsets="earliest", endingOffsets="latest").count() == 3000


def test_bad_options_are_clear_errors(spark):
    with pytest.raises(Exception, match="startingOffsets=latest is for streams"):
        rs(spark, startingOffsets="latest").count()
    with pytest.raises(Exception, match="not a message store|no such store"):
        rs(spark, str(GOLDEN / "basic")).count()
    with pytest.raises(Exception, match="no column"):
        spark.read.format("rocketstore").schema("nope string").load(BASIC).count()


def test_a_damaged_body_fails_the_job_naming_file_and_offset_unless_skip_damaged(spark, tmp_path):
    root = copy_store(golden_store("basic"), tmp_path / "s")
    flip_body_bit(root, 696)
    with pytest.raises(Exception, match="00000000000000000000 at offset 696 .*body CRC mismatch"):
        rs(spark, str(root)).select("commitLogOffset", "body").collect()
    no_body = spark.read.format("rocketstore").schema("commitLogOffset bigint").load(str(root))
    assert no_body.count() == 3000  # no body read: nothing damaged is returned
    got = offsets(rs(spark, str(root), skipDamaged="true"))
    assert got == sorted(e["commitLogOffset"] for e in golden_expected("basic") if e["commitLogOffset"] != 696)


def test_user_schema_selects_columns(spark):
    df = spark.read.format("rocketstore").schema("commitLogOffset bigint, topic string").load(BASIC)
    rows = df.collect()
    assert len(rows) == 3000 and df.columns == ["commitLogOffset", "topic"]


# ---------------------------------------------------------------- writes

def _same_messages(rows, expected):
    def key(topic, qid, body, props):
        return (topic, qid, body, tuple(sorted(props.items())))
    got = Counter(key(r.topic, r.queueId, bytes(r.body), dict(r.properties)) for r in rows)
    want = Counter(key(e["topic"], e["queueId"], base64.b64decode(e["body"]), e["properties"]) for e in expected)
    return got == want


def test_export_to_parquet_round_trips_through_append(spark, tmp_path):
    from rocketstore.spark import jobs
    out = jobs.export(spark, BASIC, str(tmp_path / "exp"), partition_by=["topic", "date"])
    assert out["rows"] == 3000 and out["files"] >= 3
    assert sorted(glob.glob(str(tmp_path / "exp" / "topic=*" / "date=*"))) == \
        [str(tmp_path / "exp" / f"topic={t}" / "date=2026-11-22") for t in ("TopicA", "TopicB", "TopicC")]
    parquet = spark.read.parquet(str(tmp_path / "exp"))
    # Replay into an empty store of the same geometry: RocketMQ's commitlog and queues, byte for byte.
    replay = tmp_path / "replay"
    parquet.write.format("rocketstore").mode("append").option("replay", "true").options(**GOLDEN_GEOMETRY) \
        .save(str(replay))
    for sub in ("commitlog/*", "consumequeue/*/*/*"):
        a, b = sorted(glob.glob(f"{BASIC}/{sub}")), sorted(glob.glob(f"{replay}/{sub}"))
        assert [os.path.relpath(x, BASIC) for x in a] == [os.path.relpath(x, replay) for x in b]
        assert all(filecmp.cmp(x, y, shallow=False) for x, y in zip(a, b))
    # A plain append (store-assigned times and offsets) gives the same messages.
    plain = tmp_path / "plain"
    parquet.select("topic", "body", "queueId", "tags", "keys", "properties") \
        .write.format("rocketstore").mode("append").save(str(plain))
    assert _same_messages(rs(spark, str(plain)).collect(), golden_expected("basic"))
    with MessageStore.open(str(plain), read_only=True) as store:
        assert verify_store(store.files)["ok"]
        assert {q["topic"] for q in store.state()["queues"]} == {"TopicA", "TopicB", "TopicC"}


def test_export_with_dump_flags_takes_what_dump_prints(spark, tmp_path):
    """--topic/--from-time/--to-time/--max-messages/--max-bytes select the same messages in both tools."""
    from rocketstore.cli.main import main
    from rocketstore.cli.store import selection_from_args
    expected = sorted(golden_expected("basic"), key=lambda e: e["commitLogOffset"])
    mid, to = str(expected[1500]["storeTimestamp"]), str(expected[2600]["storeTimestamp"])
    cases = [["--from-time", mid, "--to-time", to],
             ["--topic", "TopicB", "--from-time", mid, "--max-messages", "7"],
             ["--from-time", mid, "--max-bytes", "5000"],
             ["--topic", "TopicC", "--to-time", to, "--max-messages", "0"]]
    for i, flags in enumerate(cases):
        dumped = [json.loads(x)["commitLogOffset"] for x in
                  run_cli("dump", BASIC, "--no-body", *flags).stdout.decode().splitlines()]
        out = tmp_path / f"e{i}"
        assert main(["spark", "export", BASIC, "--to", str(out), *flags, "--keep-session"]) == 0
        exported = sorted(r.commitLogOffset for r in spark.read.parquet(str(out)).collect())
        assert exported == dumped, flags
    assert len(dumped) == 0
    # The size-limited start and end were found without reading bodies, through the consume queues.
    import argparse
    sel = selection_from_args(argparse.Namespace(topic="TopicB", from_time=int(mid), to_time=None,
                                                 max_messages=7, max_bytes=None))
    with MessageStore.open(BASIC, read_only=True) as store:
        start, end = sel.offset_range(store)
    b = [e for e in expected if e["topic"] == "TopicB" and e["storeTimestamp"] >= int(mid)][:7]
    assert (start, end) == (b[0]["commitLogOffset"], b[-1]["commitLogOffset"] + b[-1]["size"])


def test_append_with_keys_list_string_body_and_default_queue(spark, tmp_path):
    from pyspark.sql import Row
    df = spark.createDataFrame([Row(topic="W", body="héllo", keys=["k1", "k2"], tags="T", properties={"p": "1"}),
                                Row(topic="W", body="second", keys=None, tags=None, properties=None)])
    df.write.format("rocketstore").mode("append").save(str(tmp_path / "s"))
    rows = rs(spark, str(tmp_path / "s")).orderBy("commitLogOffset").collect()
    assert [(r.topic, r.queueId, bytes(r.body).decode(), r.keys, r.tags) for r in rows] == \
        [("W", 0, "héllo", "k1 k2", "T"), ("W", 0, "second", None, None)]
    assert rows[0].properties["p"] == "1" and rows[1].queueOffset == 1
    with MessageStore.open(str(tmp_path / "s"), read_only=True) as store:
        assert store.query("W", "k2").phy_offsets == [rows[0].commitLogOffset]


def test_append_with_the_topic_option(spark, tmp_path):
    """``.option("topic", T)`` gives every row of a DataFrame without a topic column that topic; with a topic
    column as well, or an illegal topic, the write is refused before anything is staged."""
    from pyspark.sql import Row
    df = spark.createDataFrame([Row(body=f"m{i}", keys=f"k{i}") for i in range(5)])
    df.write.format("rocketstore").mode("append").option("topic", "Orders").save(str(tmp_path / "s"))
    rows = rs(spark, str(tmp_path / "s")).orderBy("commitLogOffset").collect()
    assert [(r.topic, bytes(r.body).decode()) for r in rows] == [("Orders", f"m{i}") for i in range(5)]
    with MessageStore.open(str(tmp_path / "s"), read_only=True) as store:
        assert store.query("Orders", "k3").phy_offsets == [rows[3].commitLogOffset]
    with pytest.raises(Exception, match="has a topic column and the topic option"):
        spark.createDataFrame([Row(topic="T", body=b"x")]).write.format("rocketstore").mode("append") \
            .option("topic", "Orders").save(str(tmp_path / "s"))
    with pytest.raises(Exception, match="option topic: topic 'bad topic!' has illegal characters"):
        df.write.format("rocketstore").mode("append").option("topic", "bad topic!").save(str(tmp_path / "s"))
    with pytest.raises(Exception, match=r"needs the columns topic \(or the topic option\) and body; missing: topic"):
        df.write.format("rocketstore").mode("append").save(str(tmp_path / "s"))
    assert rs(spark, str(tmp_path / "s"), withBody="false").count() == 5
    assert not os.path.exists(tmp_path / "s" / ".spark-staging")


def test_append_takes_the_limits_of_the_stores_own_broker_conf(spark, tmp_path):
    """A store made by ``rocketstore init`` (a broker.conf, no files yet): the tasks encode for its
    maxMessageSize, so a row over it fails the job before anything is written (not half-way through the commit)."""
    from pyspark.sql import Row
    store = tmp_path / "s"
    store.mkdir()
    (store / "broker.conf").write_text("maxMessageSize=1000\nmappedFileSizeCommitLog=1048576\n")
    df = spark.createDataFrame([Row(topic="T", body=b"a" * 10), Row(topic="T", body=b"b" * 5000)]).coalesce(1)
    with pytest.raises(Exception, match="body is 5000 bytes, more than maxMessageSize 1000"):
        df.write.format("rocketstore").mode("append").save(str(store))
    assert sorted(os.listdir(store)) == ["broker.conf"]


def test_failed_write_leaves_the_store_readable_and_unchanged(spark, tmp_path):
    from pyspark.sql import Row
    store = copy_store(golden_store("basic"), tmp_path / "s")
    before = {p: Path(p).read_bytes() for p in glob.glob(f"{store}/commitlog/*")}
    bad = spark.createDataFrame([Row(topic="Fine", body=b"x")] * 5 + [Row(topic="bad topic!", body=b"y")])
    with pytest.raises(Exception, match="illegal characters"):
        bad.repartition(2).write.format("rocketstore").mode("append").save(str(store))
    assert {p: Path(p).read_bytes() for p in glob.glob(f"{store}/commitlog/*")} == before
    assert not os.path.exists(store / ".spark-staging")
    assert rs(spark, str(store), withBody="false").count() == 3000
    with pytest.raises(Exception, match="unknown column"):
        spark.createDataFrame([Row(topic="T", body=b"x", tag="t")]).write.format("rocketstore") \
            .mode("append").save(str(store))
    with pytest.raises(Exception, match="append"):
        spark.createDataFrame([Row(topic="T", body=b"x")]).write.format("rocketstore").mode("overwrite") \
            .save(str(store))


def test_one_writer_at_a_time(spark, tmp_path):
    from pyspark.sql import Row
    store_dir = copy_store(golden_store("basic"), tmp_path / "s")
    holder = MessageStore.open(str(store_dir))  # another writer holds the lock
    try:
        df = spark.createDataFrame([Row(topic="T", body=b"x")])
        with pytest.raises(Exception, match="lock"):
            df.write.format("rocketstore").mode("append").option("lockTimeoutMs", "300").save(str(store_dir))
        assert holder.max_phy_offset() == 3711299
        assert not os.path.exists(store_dir / ".spark-staging"), "the refused write's staged rows are removed"
    finally:
        holder.close()
    df.write.format("rocketstore").mode("append").save(str(store_dir))
    assert rs(spark, str(store_dir), withBody="false").count() == 3001


def test_append_batches_keep_every_queues_order(spark, tmp_path):
    """The commit appends with put_batch per queue: each queue still holds its rows in the DataFrame's order."""
    from pyspark.sql import functions as F
    n = 5000
    df = spark.range(n).select(F.concat(F.lit("T"), (F.col("id") % 3).cast("string")).alias("topic"),
                               F.col("id").cast("string").cast("binary").alias("body"),
                               (F.col("id") % 4).cast("int").alias("queueId"),
                               F.concat(F.lit("k-"), F.col("id").cast("string")).alias("keys")).coalesce(1)
    df.write.format("rocketstore").mode("append").options(**GOLDEN_GEOMETRY).save(str(tmp_path / "s"))
    with MessageStore.open(str(tmp_path / "s"), read_only=True) as store:
        seen = 0
        for t in range(3):
            for q in range(4):
                want = [i for i in range(n) if i % 3 == t and i % 4 == q]
                got, offset = [], 0
                while offset < store.max_offset_in_queue(f"T{t}", q):
                    r = store.get(f"T{t}", q, offset)
                    got += [int(m.body) for m in r.messages]
                    offset = r.next_begin_offset
                assert got == want, (t, q)
                seen += len(got)
        assert seen == n
        e = store.query("T2", "k-4997").messages
        assert [m.body for m in e] == [b"4997"]


def test_default_min_partitions_is_the_sessions_parallelism():
    """register() gives the source the session's default parallelism (a cluster's cores), and it survives the
    pickling that takes the source to Spark's planning worker."""
    from pyspark import cloudpickle

    import rocketstore.spark
    registered = []

    class FakeSpark:
        class sparkContext:
            defaultParallelism = 7

        class dataSource:
            register = staticmethod(registered.append)
    rocketstore.spark.register(FakeSpark)
    source = cloudpickle.loads(cloudpickle.dumps(registered[0]))
    reader = source(options={"path": BASIC}).reader(source(options={"path": BASIC}).schema())
    assert reader.min_partitions == 7
    explicit = source(options={"path": BASIC, "minPartitions": "3"})
    assert explicit.reader(explicit.schema()).min_partitions == 3

def test_session_jvm_reads_arrow_without_per_value_checks(spark):
    """A session from jobs.session runs its JVM without Arrow Java's per-value bounds, reference-count and
    null checks (about a quarter of the JVM task thread's CPU for a Python source); the golden comparisons in this
    module run in that JVM, so the values read stay exactly those Java decoded."""
    jvm = spark.sparkContext._jvm
    assert jvm.java.lang.System.getProperty("arrow.enable_unsafe_memory_access") == "true"
    assert jvm.java.lang.System.getProperty("arrow.enable_null_check_for_get") == "false"
    assert jvm.org.apache.arrow.memory.BoundsChecking.BOUNDS_CHECKING_ENABLED is False
    assert jvm.org.apache.arrow.vector.NullCheckingForGet.NULL_CHECKING_ENABLED is False


def test_session_java_options_keep_the_users_and_can_keep_arrow_checks():
    from rocketstore.spark import jobs
    conf = jobs.java_options({"spark.executor.extraJavaOptions": "-Dx=1", "spark.app.name": "a"})
    assert conf["spark.executor.extraJavaOptions"] == "-Dx=1 " + " ".join(jobs.ARROW_UNCHECKED)
    assert conf["spark.driver.extraJavaOptions"] == " ".join(jobs.ARROW_UNCHECKED)
    assert conf["spark.app.name"] == "a"
    mine = {"spark.driver.extraJavaOptions": "-Darrow.enable_unsafe_memory_access=false"}
    assert jobs.java_options(mine)["spark.driver.extraJavaOptions"] == "-Darrow.enable_unsafe_memory_access=false"
    assert jobs.java_options({"k": "v"}, arrow_checks=True) == {"k": "v"}



def test_worker_errors_show_the_workers_exception(spark):
    """The CLI's one line for a failure inside a Python worker is that worker's exception, not Spark's
    "An exception was thrown from the Python worker:"."""
    from pyspark.sql import functions as F

    from rocketstore.spark.cli import _spark_error

    @F.udf("int")
    def boom(x):
        raise ValueError(f"bad value {x} in column")
    with pytest.raises(Exception) as failed:
        spark.range(1).select(boom("id")).collect()
    assert str(_spark_error(failed.value)) == "ValueError: bad value 0 in column"
    worker = ("An exception was thrown from the Python worker:\nTraceback (most recent call last):\n"
              '  File "w.py", line 3, in commit\nrocketstore.errors.StoreLockedError: /s: another writer holds '
              "the store's lock\n")
    assert str(_spark_error(Exception(worker))) == "/s: another writer holds the store's lock"
    java = Exception("Job aborted due to stage failure\norg.apache.spark.SparkException: Task failed: lost\n")
    assert str(_spark_error(java)) == "Job aborted due to stage failure"


# ---------------------------------------------------------------- streaming

class _Sink:
    """A foreachBatch sink that is idempotent by batch id, as the foreachBatch contract asks: a batch that
    ran but was not yet committed when its query stopped is run again, with the same offsets, on restart."""

    def __init__(self) -> None:
        self.batches: dict[int, list[tuple[int, bytes]]] = {}

    def __call__(self, df, batch_id: int) -> None:
        rows = df.select("commitLogOffset", "body").collect()
        self.batches[batch_id] = [(r.commitLogOffset, bytes(r.body)) for r in rows]

    def rows(self) -> list[tuple[int, bytes]]:
        return [r for b in sorted(self.batches) for r in self.batches[b]]

    def nonempty(self) -> int:
        return sum(1 for rows in self.batches.values() if rows)


def _wait(pred, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.1)
    return False


def test_stream_follows_a_store_being_written_and_restarts_exactly(spark, tmp_path):
    store_dir = copy_store(golden_store("basic"), tmp_path / "s")
    chk = str(tmp_path / "chk")
    sink = _Sink()
    store = MessageStore.open(str(store_dir))
    try:
        q = (spark.readStream.format("rocketstore").load(str(store_dir)).writeStream.foreachBatch(sink)
             .option("checkpointLocation", chk).trigger(processingTime="100 milliseconds").start())
        try:
            assert _wait(lambda: q.lastProgress is not None)
            for i in range(40):
                assert store.put(Message("Live", f"m{i}".encode())).ok
            assert _wait(lambda: len(sink.rows()) >= 40)
        finally:
            q.stop()
        for i in range(40, 70):  # written while no query runs
            assert store.put(Message("Live", f"m{i}".encode())).ok
        q = (spark.readStream.format("rocketstore").load(str(store_dir)).writeStream.foreachBatch(sink)
             .option("checkpointLocation", chk).trigger(availableNow=True).start())
        q.awaitTermination(120)
    finally:
        store.close()
    bodies = [b for _, b in sink.rows()]
    assert bodies == [f"m{i}".encode() for i in range(70)]  # nothing skipped, nothing repeated


def test_stream_available_now_with_max_bytes_per_trigger(spark, tmp_path):
    sink = _Sink()
    q = (spark.readStream.format("rocketstore").option("startingOffsets", "earliest")
         .option("maxBytesPerTrigger", "1000000").option("topics", "TopicA").load(BASIC)
         .writeStream.foreachBatch(sink).option("checkpointLocation", str(tmp_path / "chk"))
         .trigger(availableNow=True).start())
    q.awaitTermination(120)
    assert sink.nonempty() >= 4  # 3.7 MB in steps of at most 1 MB
    got = [o for o, _ in sink.rows()]
    assert got == sorted(e["commitLogOffset"] for e in golden_expected("basic") if e["topic"] == "TopicA")


def test_stream_from_a_timestamp(spark, tmp_path):
    exp = sorted(golden_expected("basic"), key=lambda e: e["commitLogOffset"])
    t = exp[2900]["storeTimestamp"]
    sink = _Sink()
    q = (spark.readStream.format("rocketstore").option("startingTimestamp", str(t)).load(BASIC)
         .writeStream.foreachBatch(sink).option("checkpointLocation", str(tmp_path / "chk"))
         .trigger(availableNow=True).start())
    q.awaitTermination(120)
    first = next(e for e in exp if e["storeTimestamp"] >= t)
    got = [o for o, _ in sink.rows()]
    assert got == [e["commitLogOffset"] for e in exp if e["commitLogOffset"] >= first["commitLogOffset"]]


# ---------------------------------------------------------------- jobs

def test_verify_job_has_the_findings_of_rocketstore_verify(spark, tmp_path):
    from rocketstore.spark import jobs
    with MessageStore.open(BASIC, read_only=True) as store:
        assert jobs.verify(spark, BASIC) == verify_store(store.files)
    bad = copy_store(golden_store("basic"), tmp_path / "bad")
    seg = Path(sorted(glob.glob(f"{bad}/commitlog/*"))[1])
    data = bytearray(seg.read_bytes())
    data[5000] ^= 0xFF  # inside some body: a CRC mismatch
    seg.write_bytes(bytes(data))
    cq = Path(min(glob.glob(f"{bad}/consumequeue/TopicB/0/*")))
    data = bytearray(cq.read_bytes())
    data[40 + 8:40 + 12] = (123).to_bytes(4, "big")  # unit 2's size
    cq.write_bytes(bytes(data))
    got = jobs.verify(spark, str(bad))
    with MessageStore.open(str(bad), read_only=True) as store:
        want = verify_store(store.files)
    assert got == want and not got["ok"]
    assert {p["kind"] for p in got["problems"]} >= {"bad-record", "cq-mismatch"}


def test_rebuild_job_gives_rocketmqs_consume_queues_and_an_index_that_answers_every_query(spark, tmp_path):
    from rocketstore.spark import jobs
    store_dir = copy_store(golden_store("basic"), tmp_path / "s")
    shutil.rmtree(store_dir / "consumequeue")
    shutil.rmtree(store_dir / "index")
    result = jobs.rebuild(spark, str(store_dir), golden_config())
    assert result["records"] == 3000 and result["consumeQueueFiles"] == 15 and result["indexFiles"] == 2
    a = sorted(glob.glob(f"{BASIC}/consumequeue/*/*/*"))
    b = sorted(glob.glob(f"{store_dir}/consumequeue/*/*/*"))
    assert [os.path.relpath(x, BASIC) for x in a] == [os.path.relpath(x, store_dir) for x in b]
    assert all(filecmp.cmp(x, y, shallow=False) for x, y in zip(a, b))
    with MessageStore.open(str(store_dir), read_only=True) as store:
        for q in golden_queries("basic")["queryMessage"]:
            r = store.query(q["topic"], q["key"], q["maxNum"], q["begin"], q["end"])
            assert r.phy_offsets == q["resultPhyOffsets"], q
            raw, _, _ = store.index_service.query_offset(q["topic"], q["key"], min(q["maxNum"], 64), q["begin"],
                                                         q["end"])
            assert raw == q["indexServiceQueryOffset_phyOffsets"]
        assert verify_store(store.files)["ok"]
    # Over damaged files (geometry measured from them), with the store locked against writers meanwhile.
    cq = Path(max(glob.glob(f"{store_dir}/consumequeue/TopicA/2/*")))
    cq.write_bytes(bytes(200) + cq.read_bytes()[200:])
    jobs.rebuild(spark, str(store_dir))
    b = sorted(glob.glob(f"{store_dir}/consumequeue/*/*/*"))
    assert all(filecmp.cmp(x, y, shallow=False) for x, y in zip(a, b))
    holder = MessageStore.open(str(store_dir))
    try:
        with pytest.raises(Exception, match="lock"):
            jobs.rebuild(spark, str(store_dir))
    finally:
        holder.close()


def test_stats_job(spark, tmp_path):
    from rocketstore.spark import jobs
    png = tmp_path / "traffic.png"
    st = jobs.stats(spark, BASIC, plot=str(png))
    want = {(q["topic"], q["queueId"]): q["messageTotalInQueue"] for q in golden_queries("basic")["storeState"]["queues"]}
    assert {(r["topic"], r["queueId"]): r["messages"] for r in st["byQueue"]} == want
    exp = golden_expected("basic")
    assert st["messages"] == 3000 and st["bytes"] == sum(e["size"] for e in exp)
    assert {r["topic"]: r["bytes"] for r in st["byTopic"]} == \
        {t: sum(e["size"] for e in exp if e["topic"] == t) for t in ("TopicA", "TopicB", "TopicC")}
    assert sum(h["messages"] for h in st["byHour"]) == 3000
    sizes = sorted(e["bodyLength"] for e in exp)
    assert st["bodySize"]["min"] == sizes[0] and st["bodySize"]["max"] == sizes[-1]
    assert abs(st["bodySize"]["p50"] - sizes[1500]) <= 2
    tokens = {k for e in exp for k in (e["keys"] or "").split(" ") if k}
    assert st["keys"]["distinctKeys"] == len(tokens) and st["keys"]["distinctUniqKeys"] == 3000
    assert st["dispatchLag"]["behindBytes"] == 0 and st["dispatchLag"]["behindMessages"] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = jobs.stats_table(st)
    assert "TopicC" in table and "body size" in table and "dispatch lag" in table


def test_cli_spark_subcommands(spark, tmp_path, capsys):
    from rocketstore.cli.main import main
    assert main(["spark", "verify", BASIC, "--json", "--keep-session"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["records"] == 3000
    assert main(["spark", "stats", BASIC, "--keep-session"]) == 0
    assert "TopicA" in capsys.readouterr().out
    assert main(["spark", "export", BASIC, "--to", str(tmp_path / "e"), "--partition-by", "topic",
                 "--keep-session"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 3000
    assert main(["spark", "import", str(tmp_path / "n"), "--from", str(tmp_path / "e"), "--keep-session"]) == 0
    assert json.loads(capsys.readouterr().out)["appendedBytes"] == sum(e["size"] for e in golden_expected("basic"))
    assert main(["spark", "verify", str(tmp_path / "missing"), "--keep-session"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rocketstore: error:") and len(err.strip().splitlines()) == 1


def test_bench_function(spark, tmp_path):
    from rocketstore.bench.spark_scan import bench_spark_scan
    r = bench_spark_scan(BASIC, str(tmp_path), spark=spark, repeats=1)
    assert r["rows"] == 3000 and r["rocketstoreRowsPerSec"] > 0 and r["parquetRowsPerSec"] > 0 and r["ratio"] > 0
    # diagnostics: where each side's CPU went, how many tasks each side had, the export's row groups
    for side in ("rocketstore", "parquet"):
        split = r["runs"][side][0]["cpuSplit"]
        assert set(split) == {"jvm", "tasks", "python"}
        assert r["runs"][side][0]["cpuSeconds"] == pytest.approx(split["jvm"] + split["python"], abs=0.002)
        assert r["partitions"][side] >= 1
    assert r["runs"]["rocketstore"][0]["cpuSplit"]["python"] > 0  # the source decodes in Python workers
    assert r["parquetRowGroups"] >= 1


def test_spark_submit_with_the_package_zipped_into_py_files(tmp_path):
    from rocketstore.spark.package import build
    built = build(str(tmp_path / "dist"))
    spark_submit = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_GATEWAY")}
    env.update(SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               PYTHONPATH="")  # the zip, not the source tree, must provide rocketstore
    r = subprocess.run([spark_submit, "--master", "local[2]", "--conf", "spark.ui.enabled=false",
                        "--py-files", built["pyFiles"], built["launcher"], "verify", BASIC, "--json"],
                       capture_output=True, timeout=180, env=env, cwd=str(tmp_path), check=False)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert json.loads(r.stdout.decode().strip().splitlines()[-1])["records"] == 3000
