"""Issue 28, points 5 and 6: Spark streams as consumer groups (option ``groupId``) and the streaming sink
(``writeStream.format("rocketstore")``), exactly once across driver kills and task retries."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from conftest import copy_store, golden_expected, golden_store, run_cli

from rocketstore import Message, MessageStore
from rocketstore.spark import group_commit, sink
from rocketstore.storage.group_offsets import read_offsets


@pytest.fixture(scope="module")
def spark():
    # Task failures are retried (local[2, 4]: up to 4 attempts), as on a cluster; plain local[2] fails at once.
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from rocketstore.spark import jobs
    s = jobs.session("local[2,4]", {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "2",
                                    "spark.default.parallelism": "2"}, app_name="rocketstore sink tests")
    s.sparkContext.setLogLevel("ERROR")
    yield s
    s.stop()


def _golden_positions(topic: str, below: int | None = None) -> dict[int, int]:
    """Per queue of ``topic``: how many of RocketMQ's messages have a commitlog offset below ``below``."""
    out: dict[int, int] = {}
    for e in golden_expected("basic"):
        if e["topic"] == topic:
            out.setdefault(e["queueId"], 0)
            if below is None or e["commitLogOffset"] < below:
                out[e["queueId"]] += 1
    return out


# ---------------------------------------------------------------- groupId

def test_positions_at_a_commitlog_offset_match_golden(tmp_path):
    """A stream that has read up to commitlog offset X has, in each queue, consumed exactly RocketMQ's messages
    below X (golden expected.jsonl); X at a record start, inside one, at 0 and past the end."""
    exp = sorted(golden_expected("basic"), key=lambda e: e["commitLogOffset"])
    with MessageStore.open(str(golden_store("basic")), read_only=True) as store:
        for x in (0, exp[1234]["commitLogOffset"], exp[2900]["commitLogOffset"] + 7, store.max_phy_offset()):
            got = group_commit.positions_at(store, x, ["TopicA", "TopicB"], None)
            want = {("TopicA", q): n for q, n in _golden_positions("TopicA", x).items()}
            want.update({("TopicB", q): n for q, n in _golden_positions("TopicB", x).items()})
            assert got == want, x
        assert set(group_commit.positions_at(store, 0, None, [1])) == {(t, 1) for t, q in store.queue_keys() if q == 1}


_HOLDER = r"""
import sys, time
from rocketstore import MessageStore
with MessageStore.open(sys.argv[1]):
    print("open", flush=True)
    sys.stdin.read()
"""


def test_group_commit_skips_while_another_process_holds_the_store(tmp_path, caplog):
    """While another process (a broker, a writer) holds the store, consumerOffset.json is not touched (a broker
    owns it and would revert it): a warning says so; the next commit after the holder leaves writes it."""
    root = copy_store(golden_store("basic"), tmp_path / "store")
    offsets = root / "config" / "consumerOffset.json"
    offsets.parent.mkdir(exist_ok=True)
    offsets.write_text(json.dumps({"offsetTable": {"TopicA@other": {"0": 3}}}))
    before = offsets.read_bytes()
    committer = group_commit.GroupCommitter("spark-g", [str(root)], ["TopicA"], None)
    end = {str(root): 0}
    with MessageStore.open(str(root), read_only=True) as s:
        end[str(root)] = s.max_phy_offset()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with caplog.at_level("WARNING", logger="rocketstore.spark.group_commit"):
            assert committer.commit(end) == {str(root): None}
            assert committer.commit(end) == {str(root): None}
        assert offsets.read_bytes() == before
        warned = [r.getMessage() for r in caplog.records if "held by another process" in r.getMessage()]
        assert len(warned) == 1 and "spark-g" in warned[0] and str(root) in warned[0]  # once, not per batch
    finally:
        holder.stdin.close()
        holder.wait(30)
    written = committer.commit(end)[str(root)]
    assert written == {("TopicA", q): n for q, n in _golden_positions("TopicA").items()}
    table = read_offsets(str(root)).table
    assert table["TopicA@other"] == {0: 3}  # another group's entry is kept
    assert table["TopicA@spark-g"] == _golden_positions("TopicA")


def test_stream_with_group_id_shows_in_lag_and_groups(spark, tmp_path):
    """A stream with groupId writes its position after each batch: before the first batch nothing is consumed,
    after the first of several batches it is the golden count below that batch's end; at the end every queue of the topic is consumed, and
    ``rocketstore lag`` / ``groups`` show the group with lag 0.  The stream never reads it back: a second run
    from the same checkpoint continues from the checkpoint, not from a position reset in the file."""
    root = copy_store(golden_store("basic"), tmp_path / "store")
    ends: list[dict] = []

    def batch(df, batch_id):
        ends.append(read_offsets(str(root)).table.get("TopicB@spark-g"))  # the previous batch's position

    q = (spark.readStream.format("rocketstore").option("startingOffsets", "earliest").option("topics", "TopicB")
         .option("maxBytesPerTrigger", "1000000").option("groupId", "spark-g").load(str(root))
         .writeStream.foreachBatch(batch).option("checkpointLocation", str(tmp_path / "chk"))
         .trigger(availableNow=True).start())
    q.awaitTermination(180)
    assert q.exception() is None
    progress = q.recentProgress
    assert len(ends) >= 3
    first_end = json.loads(progress[0]["sources"][0]["endOffset"])[str(root)]
    assert ends[0] == _golden_positions("TopicB", 0)  # where the stream starts: nothing read yet
    assert ends[1] == _golden_positions("TopicB", first_end)
    want = _golden_positions("TopicB")
    assert read_offsets(str(root)).table["TopicB@spark-g"] == want
    lag = run_cli("lag", str(root), "--group", "spark-g", "--format", "json")
    assert lag.returncode == 0, lag.stderr
    rows = json.loads(lag.stdout)["lag"]
    assert {r["queueId"]: r["consumerOffset"] for r in rows} == want and json.loads(lag.stdout)["totalLag"] == 0
    groups = run_cli("groups", str(root), "--format", "json")
    row = next(g for g in json.loads(groups.stdout)["groups"] if (g["group"], g["topic"]) == ("spark-g", "TopicB"))
    assert (row["queues"], row["lag"], row["inflight"]) == (len(want), 0, 0)

    # Reset the group in the file: the stream's own position (its checkpoint) is unchanged by it.
    assert run_cli("reset-offset", str(root), "--group", "spark-g", "--topic", "TopicB", "--to-earliest").returncode == 0
    with MessageStore.open(str(root)) as s:
        assert s.put(Message("TopicB", b"after", 0)).ok
    seen: list[bytes] = []
    q = (spark.readStream.format("rocketstore").option("topics", "TopicB").option("groupId", "spark-g")
         .load(str(root)).writeStream.foreachBatch(lambda df, _: seen.extend(r.body for r in df.collect()))
         .option("checkpointLocation", str(tmp_path / "chk")).trigger(availableNow=True).start())
    q.awaitTermination(180)
    assert seen == [b"after"]
    assert read_offsets(str(root)).table["TopicB@spark-g"] == {**want, 0: want[0] + 1}


# ---------------------------------------------------------------- the sink

def _write_input(directory: Path, files: int, rows: int, pad: int = 0) -> list[dict]:
    """Parquet files of rows with body, keys, tags, queueId and properties; the rows, in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for f in range(files):
        chunk = []
        for i in range(f * rows, (f + 1) * rows):
            chunk.append({"body": b"row-%07d-" % i + bytes([i % 251]) * pad + "é".encode(), "keys": f"k{i} o{i // 3}",
                          "tags": f"T{i % 5}", "queueId": i % 4,
                          "properties": [("seq", str(i))] if i % 2 else None})
        table = pa.Table.from_pylist(chunk, schema=pa.schema([
            ("body", pa.binary()), ("keys", pa.string()), ("tags", pa.string()), ("queueId", pa.int32()),
            ("properties", pa.map_(pa.string(), pa.string()))]))
        pq.write_table(table, str(directory / f"part-{f:03d}.parquet"))
        out += chunk
    return out


INPUT_SCHEMA = "body binary, keys string, tags string, queueId int, properties map<string,string>"


def _sink_rows(root: Path, topic: str) -> list:
    with MessageStore.open(str(root), read_only=True) as s:
        return [m for _, _, m, _ in s.messages() if m is not None and m.topic == topic]


def _check_every_row_once(root: Path, topic: str, rows: list[dict]) -> list:
    got = _sink_rows(root, topic)
    ids = Counter(int(m.body[4:11]) for m in got)
    assert not [i for i, n in ids.items() if n > 1], "duplicates"
    assert sorted(ids) == list(range(len(rows))), "missing rows"
    for m in got:
        r = rows[int(m.body[4:11])]
        assert (m.body, m.keys, m.tags, m.queue_id) == (r["body"], r["keys"], r["tags"], r["queueId"])
        own = {k: v for k, v in m.properties.items() if k in ("seq",)}
        assert own == dict(r["properties"] or [])
        assert m.properties[sink.SINK_PROPERTY].count(":") == 2
    with MessageStore.open(str(root), read_only=True) as s:
        for i in range(0, len(rows), max(1, len(rows) // 25)):
            assert [m.body for m in s.query(topic, f"k{i}").messages] == [rows[i]["body"]]
    return got


def test_sink_with_a_retried_task_appends_every_row_once(spark, tmp_path):
    """A task whose first attempt fails after staging part of its rows is retried; the batch's commit takes the
    retry's rows only: every row once, every field as given (body bytes, keys, tags, queue, properties),
    found by key.  The batch writer's checks apply: a row over maxMessageSize fails the batch and the store
    is not touched; an unknown column is refused when the query starts."""
    rows = _write_input(tmp_path / "in", 3, 700)
    root = tmp_path / "store"

    def flaky(batches):
        from pyspark import TaskContext
        ctx = TaskContext.get()
        for k, b in enumerate(batches):
            yield b
            if k == 0 and ctx.attemptNumber() == 0:
                raise RuntimeError("first attempt of every task fails after its first rows")

    src = (spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", "1").option("maxRecordsPerFile", "0")
           .parquet(str(tmp_path / "in")))
    src = src.repartition(2).mapInArrow(flaky, INPUT_SCHEMA)
    q = (src.writeStream.format("rocketstore").option("checkpointLocation", str(tmp_path / "chk"))
         .option("topic", "Sunk").option("mappedFileSizeCommitLog", str(1 << 20)).trigger(availableNow=True)
         .start(str(root)))
    q.awaitTermination(180)
    assert q.exception() is None
    assert len([p for p in q.recentProgress if p["numInputRows"]]) == 3
    _check_every_row_once(root, "Sunk", rows)
    assert not (root / ".spark-staging").exists() or not list((root / ".spark-staging").iterdir())
    journal = json.loads(next((root / "spark-sinks").glob("*.json")).read_text())
    assert journal["committed"] == 2 and journal["pending"] is None

    before = sorted(p.name for p in (root / "commitlog").iterdir()), _sink_rows(root, "Sunk")
    big = spark.createDataFrame([(b"x" * (5 << 20),)], "body binary")
    big_dir = tmp_path / "big"
    big.write.parquet(str(big_dir))
    q = (spark.readStream.schema("body binary").parquet(str(big_dir)).writeStream.format("rocketstore")
         .option("checkpointLocation", str(tmp_path / "chk-big")).option("topic", "Sunk").start(str(root)))
    with pytest.raises(Exception, match="maxMessageSize|over"):
        q.awaitTermination(180)
        raise AssertionError(q.exception())
    assert len(_sink_rows(root, "Sunk")) == len(before[1])
    with pytest.raises(Exception, match="unknown column"):
        q = (spark.readStream.schema(INPUT_SCHEMA + ", colour string").parquet(str(tmp_path / "in"))
             .writeStream.format("rocketstore").option("checkpointLocation", str(tmp_path / "chk-bad"))
             .option("topic", "Sunk").start(str(root)))
        q.awaitTermination(120)
        raise AssertionError(q.exception())


_DRIVER = r"""
import logging, os, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
os.environ["PYSPARK_PYTHON"] = sys.executable
from rocketstore.spark import jobs
inp, chk, store = sys.argv[1:4]
spark = jobs.session("local[2]", {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "2"},
                     app_name="sink kill test")
spark.sparkContext.setLogLevel("ERROR")
q = (spark.readStream.schema(%r).option("maxFilesPerTrigger", "1").parquet(inp)
     .writeStream.format("rocketstore").option("checkpointLocation", chk).option("topic", "Killed")
     .option("mappedFileSizeCommitLog", str(4 << 20)).start(store))
print("started", flush=True)
q.processAllAvailable()
q.stop()
print("done", flush=True)
""" % INPUT_SCHEMA


def _journal(root: Path) -> tuple[tuple[int, int] | None, dict | None]:
    """The sink journal's identity (inode, mtime: it is replaced whole at each write) and its pending batch."""
    for p in (root / "spark-sinks").glob("*.json") if (root / "spark-sinks").is_dir() else []:
        try:
            st = p.stat()
            return (st.st_ino, st.st_mtime_ns), json.loads(p.read_text()).get("pending")
        except (OSError, ValueError):
            return None, None
    return None, None


def _append_started(root: Path, start: int) -> bool:
    """Whether the commitlog holds a message at offset ``start`` (or at the next segment's start, when a segment's
    blank end is at ``start``): the pending batch's append has begun.  Read through the page cache, as another
    process sees the driver's map."""
    from rocketstore.format import codec
    if not (root / "commitlog").is_dir():
        return False
    segments = sorted((int(p.name), p) for p in (root / "commitlog").iterdir() if p.name.isdigit())
    for base, path in reversed(segments):
        if base <= start:
            with open(path, "rb") as f:
                f.seek(start - base)
                head = f.read(8)
            if len(head) < 8 or head[:4] == bytes(4):
                return False
            if int.from_bytes(head[4:], "big") == codec.BLANK_MAGIC:
                return start != base + path.stat().st_size and _append_started(root, base + path.stat().st_size)
            return True
    return False


def _tail(log, n: int = 3000) -> str:
    log.seek(0)
    return log.read()[-n:]


def _kill_inside_append(p: subprocess.Popen, root: Path, start: int, deadline: float) -> bool:
    """SIGKILL the driver's process group once its append has begun, catching it between two slices: the group
    runs a millisecond at a time (SIGCONT, then SIGSTOP) and the log is looked at while it is stopped, so a slow
    or loaded machine cannot let the append finish unseen.  False when the driver ended or time ran out."""
    try:
        while time.monotonic() < deadline and p.poll() is None:
            os.killpg(p.pid, signal.SIGSTOP)
            if _append_started(root, start):
                os.killpg(p.pid, signal.SIGKILL)  # the driver's JVM, its executor threads and Python workers
                return True
            os.killpg(p.pid, signal.SIGCONT)
            time.sleep(0.001)
    except ProcessLookupError:
        pass
    return False


def test_sink_is_exactly_once_across_driver_kills(tmp_path):
    """A streaming query (its own driver process, local[2]) is killed with SIGKILL, driver, executors and Python
    workers at once, while the driver appends a micro-batch, at least twice, each time restarted from the same
    checkpoint.  The retried batches leave out what the killed attempts wrote: at the end every row is in the
    store exactly once, byte for byte, and found by key."""
    files, per_file = 6, 15000
    rows = _write_input(tmp_path / "in", files, per_file, pad=150)
    root, chk = tmp_path / "store", tmp_path / "chk"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(sink.__file__).parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-c", _DRIVER, str(tmp_path / "in"), str(chk), str(root)]
    kills, partial, logs, seen = 0, 0, [], []
    log_end = 0  # where the log's last whole message ends after the last kill: a retry's append begins there
    for attempt in range(10):
        err = open(tmp_path / f"driver-{attempt}.log", "w+")
        before = _journal(root)[0]
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True)
        try:
            if kills >= 2 and partial >= 1:
                assert p.wait(300) == 0, _tail(err)
                break
            # This driver's own "pending" (a retry writes the same one again: the journal is a new file).
            deadline = time.monotonic() + 240
            stamp, pending = _journal(root)
            while time.monotonic() < deadline and p.poll() is None and (stamp == before or pending is None):
                time.sleep(0.005)
                stamp, pending = _journal(root)
            start = max(int(pending["from"]), log_end) if pending is not None else -1
            if pending is not None and _kill_inside_append(p, root, start, deadline):
                kills += 1
                p.wait(30)
                with MessageStore.open(str(root), read_only=True) as s:
                    prefix = f":{pending['batch']}:"
                    n = 0
                    for offset, size, m, _ in s.messages(int(pending["from"]), read_body=False):
                        if m is not None:
                            n += prefix in m.properties.get(sink.SINK_PROPERTY, "")
                            log_end = offset + size
                partial += 0 < n < per_file
                seen.append(n)
            else:
                assert p.wait(300) == 0, _tail(err)
                break
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
            err.seek(0)
            logs.append(err.read())
            err.close()
    assert kills >= 2, logs[-1][-3000:]
    assert partial >= 1, f"no kill landed in the middle of an append (rows of the batch in the log after each kill: {seen})"
    assert any("an earlier attempt appended" in t and "appending the rest" in t for t in logs)
    _check_every_row_once(root, "Killed", rows)
    journal = json.loads(next((root / "spark-sinks").glob("*.json")).read_text())
    assert journal["committed"] == files - 1 and journal["pending"] is None
