"""Issue 19 item 2: the Spark source reads tiered stores through an S3 API server (moto on 127.0.0.1).

``load("s3://bucket/prefix")`` reads a tier alone; ``load(store)`` of a store whose older segments exist only in
the bucket reads the tier and the local segments as one continuous commitlog range, in batch and streaming,
each message exactly once.  Executors get tier segments with ranged GETs, never from a local path.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from conftest import local_spark, GOLDEN_CONF, copy_store, golden_expected, golden_store
from tier.test_tier import SMALL, _free_local

from rocketstore import Message, MessageStore
from rocketstore.errors import StoreError, StoreLoadError
from rocketstore.spark import plan, remote, segment
from rocketstore.spark.segment import RowFilter
from rocketstore.tier.upload import upload_round

MIB = 1048576
TIER_OPTS = ("objectStoreEndpoint", "objectStoreRegion", "objectStoreAccessKey", "objectStoreSecretKey")


@pytest.fixture(scope="module")
def spark():
    s = local_spark("rocketstore tier tests", 2)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def golden_tier(tmp_path_factory, s3_server):
    """golden/basic (4 segments of 1 MiB, written by RocketMQ) with its 3 sealed segments uploaded and
    deleted locally: offsets [0, 3 MiB) are only in the bucket, the active segment only on disk."""
    store = copy_store(golden_store("basic"), tmp_path_factory.mktemp("golden_tier") / "store")
    uri = f"s3://{s3_server.new_bucket()}/stores/basic"
    conf = s3_server.conf(uri)
    # (tieredStoreFileReservedTime=0: RocketMQ wrote these records on 2026-11-22, and the 72-hour default would
    # expire them from the tier; test_tier.py tests that retention)
    (store / "broker.conf").write_text(GOLDEN_CONF + "".join(f"{k}={v}\n" for k, v in conf.items())
                                       + "fileReservedTime=0\ntieredStoreFileReservedTime=0\n")
    with MessageStore.open(str(store), start_services=False) as st:
        assert upload_round(st.files)["segments"] == 3
        _free_local(st)
        assert st.min_phy_offset() == 3 * MIB and st.min_readable_offset() == 0
    assert sorted(os.listdir(store / "commitlog")) == ["00000000000003145728"]
    return store, uri, conf


def read(spark, path, options: dict, **more):
    r = spark.read.format("rocketstore")
    for k, v in {**options, **more}.items():
        r = r.option(k, str(v))
    return r.load(str(path))


def creds(conf: dict) -> dict:
    return {k: conf[k] for k in TIER_OPTS}


def as_expected(row) -> dict:
    """A collected row in the form of expected.jsonl (what RocketMQ's MessageDecoder gave)."""
    d = row.asDict()
    for k in ("bornTimestamp", "storeTimestamp"):
        d[k] = round(d[k].timestamp() * 1000)
    d["body"] = base64.b64encode(d["body"]).decode()
    return d


def assert_golden(rows, expected) -> None:
    got = sorted((as_expected(r) for r in rows), key=lambda d: d["commitLogOffset"])
    assert [g["commitLogOffset"] for g in got] == [e["commitLogOffset"] for e in expected]
    for g, e in zip(got, expected):
        assert g == {k: e[k] for k in segment.COLUMN_NAMES}, g["commitLogOffset"]


# ---------------------------------------------------------------- batch

def test_tier_alone_reads_every_field_of_the_uploaded_segments(spark, golden_tier):
    """load("s3://...") with RocketMQ's objectStore* options: the 3 uploaded segments, as RocketMQ decoded
    them; one ranged-read task per segment, no local path involved (the files are gone from disk)."""
    _store, uri, conf = golden_tier
    expected = sorted((e for e in golden_expected("basic") if e["commitLogOffset"] < 3 * MIB),
                      key=lambda e: e["commitLogOffset"])
    df = read(spark, uri, creds(conf), maxPartitionBytes=1)
    assert df.rdd.getNumPartitions() == 3
    assert_golden(df.collect(), expected)
    s3a = read(spark, uri.replace("s3://", "s3a://"), creds(conf), withBody="false")
    assert s3a.count() == len(expected)


def test_live_store_reads_tier_then_local_as_one_range(spark, golden_tier):
    """load(store): the tier below the local segments, then the local one; every message once, every field
    equal to RocketMQ's (the tier found through the store's broker.conf)."""
    store, _uri, _conf = golden_tier
    df = read(spark, store, {}, maxPartitionBytes=1)
    assert df.rdd.getNumPartitions() == 4
    assert_golden(df.collect(), sorted(golden_expected("basic"), key=lambda e: e["commitLogOffset"]))
    packed = read(spark, store, {}, withBody="false")  # 3 tier tasks packed with the local one
    assert packed.count() == 3000


def test_offsets_and_times_prune_tier_segments(spark, golden_tier):
    store, uri, conf = golden_tier
    exp = sorted(golden_expected("basic"), key=lambda e: e["commitLogOffset"])
    in1 = [e for e in exp if MIB <= e["commitLogOffset"] < 2 * MIB]
    lo, hi = in1[10]["commitLogOffset"], exp[-5]["commitLogOffset"]
    df = read(spark, store, {}, startingOffsets=lo + 1, endingOffsets=hi)  # inside a record: the next one
    assert sorted(r.commitLogOffset for r in df.select("commitLogOffset").collect()) == \
        [e["commitLogOffset"] for e in exp if lo < e["commitLogOffset"] < hi]
    rep = plan.PlanReport(str(store))
    tasks = plan.plan_scan(str(store), RowFilter(offset_lo=lo, offset_hi=hi), report=rep,
                           tier=remote.tier_of(str(store), {}))
    assert rep.pruned == {"commitLogOffset": 1} and [t.key is not None for t in tasks] == [True, True, False]
    assert tasks[0].start == lo - MIB and tasks[0].boundary_known  # a record starts there: checked with a GET

    t0, t1 = in1[5]["storeTimestamp"], in1[-5]["storeTimestamp"]
    rep = plan.PlanReport(uri)
    tasks = plan.plan_scan(uri, RowFilter(ts_lo=t0 * 1000, ts_hi=t1 * 1000 - 1), report=rep,
                           tier=remote.tier_of(uri, creds(conf)))
    assert [t.base for t in tasks] == [MIB] and rep.pruned == {"storeTimestamp": 2}
    df = read(spark, uri, creds(conf), startingTimestamp=t0, endingTimestamp=t1, topics="TopicA")
    assert sorted(r.commitLogOffset for r in df.select("commitLogOffset").collect()) == \
        [e["commitLogOffset"] for e in exp if t0 <= e["storeTimestamp"] < t1 and e["topic"] == "TopicA"]


def test_a_tier_that_is_not_the_stores_is_refused(golden_tier, s3_server, tmp_path):
    store, uri, conf = golden_tier
    other = copy_store(golden_store("basic"), tmp_path / "other")
    with pytest.raises(StoreLoadError, match="belongs to store"):  # no tierStore.json: never uploaded there
        plan.plan_scan(str(other), RowFilter(), tier=remote.tier_of(str(other), conf))
    empty = f"s3://{s3_server.new_bucket()}/nothing"
    with pytest.raises(StoreLoadError, match="no tier.json"):
        plan.plan_scan(empty, RowFilter(), tier=remote.tier_of(empty, creds(conf)))
    with pytest.raises(StoreLoadError, match="mappedFileSizeCommitLog=1048576 in the tier"):
        remote.tier_below(str(store), remote.tier_of(str(store), {}), 3 * MIB, 65536)


def test_executor_windows_and_parallel_gets_decode_exactly(golden_tier, monkeypatch):
    """The executor's tier read in windows far smaller than the records (8 KiB bodies in 5000-byte windows:
    each crossing record widens one window) and GETs of 3000 bytes in parallel gives RocketMQ's rows, also
    from a start inside the segment that is not known to be a record boundary."""
    _store, uri, conf = golden_tier
    monkeypatch.setattr(remote, "FETCH_CHUNK", 3000)
    ref = remote.tier_of(uri, creds(conf))
    exp = sorted((e for e in golden_expected("basic") if MIB <= e["commitLogOffset"] < 2 * MIB),
                 key=lambda e: e["commitLogOffset"])[:150]  # the first 150 records of segment 1 (~160 KB)
    end = exp[-1]["commitLogOffset"] + exp[-1]["size"] - MIB
    names = ["commitLogOffset", "body", "storeTimestamp"]

    def rows(start, known, window):
        out = []
        for b in remote.read_tier_range(ref, "commitlog/00000000000001048576", MIB, MIB, start, end, names,
                                        batch_rows=64, boundary_known=known, window=window):
            out += list(zip(b.column(0).to_pylist(), b.column(1).to_pylist()))
        return out

    want = [(e["commitLogOffset"], base64.b64decode(e["body"])) for e in exp]
    assert max(e["size"] for e in exp) > 5000
    assert rows(0, True, 5000) == want
    cut = exp[100]["commitLogOffset"] - MIB + 1  # inside record 100: the walk starts at the file start
    assert rows(cut, False, 7000) == want[101:]


def test_a_stream_in_the_local_segments_does_not_ask_the_tier(golden_tier):
    """Once a stream is past the tier, its triggers plan from the local files alone: an unreachable tier
    (nothing listens on the discard port) stops only what needs it, naming it."""
    store, uri, conf = golden_tier
    down = remote.TierRef.from_options(uri, {**creds(conf), "objectStoreEndpoint": "http://127.0.0.1:9"})
    tail = plan.find_tail(str(store))
    assert plan.find_tail(str(store), 3 * MIB, 1 << 20, down) == tail
    assert plan.find_tail(str(store), tier=down) == tail
    assert [t.key for t in plan.stream_tasks(str(store), 3 * MIB, tail, None, down)] == [None]
    with pytest.raises(StoreError, match="127.0.0.1:9"):
        plan.earliest_offset(str(store), down)
    with pytest.raises(StoreError, match="127.0.0.1:9"):
        plan.stream_tasks(str(store), 0, tail, None, down)


# ---------------------------------------------------------------- streaming

class Sink:
    """foreachBatch sink, idempotent by batch id; ``fail_at``: raise in that batch once (the query dies with
    that batch planned but not committed, as a crash would leave it)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.batches: dict[int, list[tuple[int, bytes]]] = {}
        self.fail_at = fail_at

    def __call__(self, df, batch_id: int) -> None:
        if batch_id == self.fail_at:
            self.fail_at = None
            raise RuntimeError(f"sink failed in batch {batch_id}")
        self.batches[batch_id] = [(r.commitLogOffset, bytes(r.body)) for r in
                                  df.select("commitLogOffset", "body").collect()]

    def rows(self) -> list[tuple[int, bytes]]:
        return [r for b in sorted(self.batches) for r in self.batches[b]]


def stream(spark, path, options: dict, sink: Sink, chk: Path):
    r = spark.readStream.format("rocketstore")
    for k, v in options.items():
        r = r.option(k, str(v))
    q = r.load(str(path)).writeStream.foreachBatch(sink).option("checkpointLocation", str(chk)) \
        .trigger(availableNow=True).start()
    q.awaitTermination(120)
    return q


def test_stream_from_earliest_crosses_from_tier_to_local_once(spark, golden_tier, tmp_path):
    store, _uri, _conf = golden_tier
    exp = sorted(golden_expected("basic"), key=lambda e: e["commitLogOffset"])
    sink = Sink()
    stream(spark, store, {"startingOffsets": "earliest", "maxBytesPerTrigger": MIB}, sink, tmp_path / "chk")
    assert [o for o, _ in sink.rows()] == [e["commitLogOffset"] for e in exp]
    assert [base64.b64encode(b).decode() for _, b in sink.rows()] == [e["body"] for e in exp]
    assert sum(1 for b in sink.batches.values() if b) == 4  # a segment per trigger: 3 from the tier, 1 local

    t = exp[500]["storeTimestamp"]  # in the tier: found with ranged reads of its headers
    sink = Sink()
    stream(spark, store, {"startingTimestamp": t}, sink, tmp_path / "chk-ts")
    first = next(i for i, e in enumerate(exp) if e["storeTimestamp"] >= t)
    assert [o for o, _ in sink.rows()] == [e["commitLogOffset"] for e in exp[first:]]

    mid = next(e["commitLogOffset"] for e in exp if e["commitLogOffset"] > MIB + 100000)  # inside tier segment 1
    tier = remote.tier_of(str(store), {})
    assert plan.check_boundary(str(store), mid, tier) == mid
    with pytest.raises(StoreError, match="no record starts at commitlog offset"):
        plan.check_boundary(str(store), mid + 1, tier)
    tasks = plan.stream_tasks(str(store), mid, plan.find_tail(str(store)), None, tier)
    assert [(t.base, t.start, t.key is not None) for t in tasks] == \
        [(MIB, mid - MIB, True), (2 * MIB, 0, True), (3 * MIB, 0, False)]


def _put(root: str, conf: Path, first: int, n: int) -> None:
    with MessageStore.open(root, str(conf), start_services=False) as st:
        for i in range(first, first + n):
            assert st.put(Message(topic=f"T{i % 3}", body=f"m{i} ".encode() * (1 + i % 40), queue_id=i % 2,
                                  properties={"KEYS": f"k{i}"})).ok
        st.commitlog.flush(0)


def _upload(root: str, conf: Path, free: bool) -> tuple[int, int]:
    """Upload what is sealed (and free the local copies): (tier end, first local offset)."""
    with MessageStore.open(root, str(conf), start_services=False) as st:
        upload_round(st.files)
        if free:
            _free_local(st)
        return st.tier.manifest.end_offset, st.min_phy_offset()


def _messages(root: str, conf: Path) -> list[tuple[int, bytes]]:
    with MessageStore.open(root, str(conf), read_only=True) as st:
        return [(o, m.body) for o, _s, m, _p in st.messages()]


def test_small_segments_overlap_and_a_checkpoint_that_moves_into_the_tier(spark, s3_server, tmp_path):
    """64 KiB segments, the tier given as read options only (the store's config lives elsewhere):

    * segments both uploaded and still local are read once (locally);
    * a stream from earliest fails in its third batch (in the tier) and restarts from its checkpoint;
    * after more writes, uploads and retention, the stream's checkpoint lies in a segment that is now
      only in the bucket; the stream continues there and reads exactly the new messages.
    """
    uri = f"s3://{s3_server.new_bucket()}/small"
    conf = s3_server.conf(uri)
    cfg = tmp_path / "tier.conf"
    cfg.write_text("".join(f"{k}={v}\n" for k, v in {**SMALL, **conf, "fileReservedTime": 0}.items()))
    root = str(tmp_path / "store")
    _put(root, cfg, 0, 1500)
    _upload(root, cfg, free=True)
    _put(root, cfg, 1500, 800)
    tier_end, local_min = _upload(root, cfg, free=False)
    assert local_min < tier_end  # segments in both places
    want = _messages(root, cfg)
    assert len(want) == 2300 and want[0][0] == 0

    opts = conf  # tieredStoreUri and the objectStore* keys
    df = read(spark, root, opts, maxPartitionBytes=1, withBody="true")
    got = sorted((r.commitLogOffset, bytes(r.body)) for r in df.select("commitLogOffset", "body").collect())
    assert got == want
    assert df.rdd.getNumPartitions() == want[-1][0] // 65536 + 1  # one per segment, none twice
    # Retention deletes an uploaded local segment between planning and reading: its task reads the tier.
    from rocketstore.spark.source import read_task
    tasks = plan.plan_scan(root, RowFilter(), tier=remote.tier_of(root, opts))
    first_local = next(t.path for t in tasks if t.key is None)
    os.rename(first_local, first_local + ".gone")
    try:
        names = ["commitLogOffset", "body"]
        got = [(o, b) for batch in read_task(tasks, names, segment.arrow_schema(names), 1000)
               for o, b in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist())]
    finally:
        os.rename(first_local + ".gone", first_local)
    assert got == want
    alone = read(spark, uri, creds(conf)).select("commitLogOffset", "body").collect()
    assert sorted((r.commitLogOffset, bytes(r.body)) for r in alone) == [w for w in want if w[0] < tier_end]

    chk = tmp_path / "chk"
    sink = Sink(fail_at=2)
    sopts = {**opts, "startingOffsets": "earliest", "maxBytesPerTrigger": 2 * 65536}  # 2 tier segments a batch
    with pytest.raises(Exception, match="sink failed in batch 2"):
        stream(spark, root, sopts, sink, chk)
    assert sorted(sink.batches) == [0, 1] and sink.rows()[-1][0] < local_min  # stopped inside the tier
    stream(spark, root, sopts, sink, chk)
    assert sink.rows() == want
    tier_sink = Sink()  # the tier alone, as a stream: what is uploaded so far
    topts = {**creds(conf), "startingOffsets": "earliest"}
    stream(spark, uri, topts, tier_sink, tmp_path / "chk-tier")
    assert tier_sink.rows() == [w for w in want if w[0] < tier_end]

    tail = want[-1][0]
    _put(root, cfg, 2300, 900)
    tier_end, local_min = _upload(root, cfg, free=True)
    assert local_min > tail  # the segment of the checkpointed end is now in a segment only the bucket has
    seen = len(sink.rows())
    stream(spark, root, sopts, sink, chk)
    new = _messages(root, cfg)
    assert len(new) == 3200 and sink.rows()[seen:] == new[2300:]
    assert len({o for o, _ in sink.rows()}) == len(sink.rows()) == 3200
    stream(spark, uri, topts, tier_sink, tmp_path / "chk-tier")  # and on, over what was uploaded since
    assert tier_sink.rows() == [w for w in new if w[0] < tier_end]


def test_write_to_a_tier_is_refused(golden_tier):
    from rocketstore.spark.source import RocketStoreWriter, spark_schema
    _store, uri, conf = golden_tier
    with pytest.raises(StoreError, match="is a tier"):
        RocketStoreWriter({"path": uri, **creds(conf)}, spark_schema())
