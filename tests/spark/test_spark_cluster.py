"""Issue 19: the Spark source and jobs on a standalone cluster (a master and a worker on 127.0.0.1).

The cluster (tests/helpers/spark_cluster.py, the session fixture ``spark_cluster``) runs executors in
their own JVMs whose Python cannot import rocketstore except from the zip the driver ships
(``spark.submit.pyFiles``, built by ``rocketstore.spark.package.build_zip``): what passes here passes
on a cluster whose executors have only the zip, pyarrow and numpy (and isal).  Every result is compared
with local[2]'s and with RocketMQ's golden ``expected.jsonl``.

Only one SparkContext may live in a process, so each test starts and stops its own sessions in turn
(the driver's JVM stays up between them, as in a notebook).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from conftest import copy_store, golden_expected, golden_store

from rocketstore.spark import jobs
from rocketstore.spark.cli import main as spark_main
from rocketstore.spark.package import build_zip

LOCAL_CONF = {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "4", "spark.default.parallelism": "2"}


@pytest.fixture(scope="module")
def shipped(tmp_path_factory) -> str:
    """The zip executors import rocketstore from (what ``rocketstore spark package`` writes)."""
    return build_zip(str(tmp_path_factory.mktemp("pyfiles") / "rocketstore.zip"))


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return copy_store(golden_store("basic"), tmp_path_factory.mktemp("cluster-store") / "store")


def _summary(spark, path: Path) -> dict:
    """Count and checksums of a full read: the bodies' CRC-32s and the commitlog offsets, summed."""
    from pyspark.sql import functions as F
    row = (spark.read.format("rocketstore").load(str(path))
           .agg(F.count("*").alias("count"), F.sum(F.crc32("body")).alias("bodyCrc32"),
                F.sum("commitLogOffset").alias("offsets"))
           .collect()[0])
    return row.asDict()


def _golden_summary() -> dict:
    expected = golden_expected("basic")
    return {"count": len(expected), "bodyCrc32": sum(zlib.crc32(base64.b64decode(e["body"])) for e in expected),
            "offsets": sum(e["commitLogOffset"] for e in expected)}


def test_read_on_the_cluster_equals_local_and_golden(spark_cluster, store, shipped, monkeypatch):
    # Defined here, not at module level: cloudpickle ships a nested function by value (a module-level one
    # by reference, and executors cannot import this test module).
    def _where_tasks_import_from(_: object) -> dict:
        """Runs inside a task: where rocketstore came from, and whether anything but the zip could provide it."""
        import importlib.machinery
        import os
        import sys

        import rocketstore
        others = [p for p in sys.path if not p.endswith("rocketstore.zip")]
        return {"file": rocketstore.__file__, "cwd": os.getcwd(), "pid": os.getpid(), "no_site": sys.flags.no_site,
                "executable": sys.executable,
                "elsewhere": importlib.machinery.PathFinder.find_spec("rocketstore", others) is not None
                or any("editable" in type(f).__name__.lower() for f in sys.meta_path)}

    # local[2] first, so that the cluster's session reuses this process's JVM, as a notebook's second
    # session does: spark.submit.pyFiles must still reach executors then (jobs.session sees to it).
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    local = jobs.session("local[2]", LOCAL_CONF, app_name="rocketstore local read")
    try:
        local_summary = _summary(local, store)
    finally:
        local.stop()

    for k, v in spark_cluster.driver_env().items():
        monkeypatch.setenv(k, v)
    spark = jobs.session(spark_cluster.master_url, spark_cluster.driver_conf(shipped), app_name="rocketstore cluster read")
    try:
        spark.sparkContext.setLogLevel("ERROR")
        assert spark.sparkContext.master == spark_cluster.master_url
        where = spark.sparkContext.parallelize(range(4), 4).map(_where_tasks_import_from).collect()
        on_cluster_summary = _summary(spark, store)
        apps = spark_cluster.state()["activeapps"]
    finally:
        spark.stop()
    work = str(spark_cluster.base / "work")
    for w in where:
        # An executor process (its cwd is the worker's directory for this app), the venv's Python without
        # site, rocketstore from the shipped zip, and no other copy it could have used.
        assert w["cwd"].startswith(work), w
        assert w["file"].endswith(os.path.join("rocketstore.zip", "rocketstore", "__init__.py")), w
        assert w["no_site"] == 1 and w["executable"] == sys.executable and not w["elsewhere"], w
        assert w["pid"] != os.getpid(), w
    assert [a["name"] for a in apps] == ["rocketstore cluster read"]
    assert on_cluster_summary == local_summary == _golden_summary()


def _cli_json(capsys, *argv: str) -> tuple[int, dict]:
    """``rocketstore spark ...`` in this process (its JVM reused): exit code and the JSON it printed."""
    code = spark_main(list(argv))
    out, err = capsys.readouterr()
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert lines, f"no output from rocketstore spark {' '.join(argv)}; stderr: {err[-2000:]}"
    return code, json.loads(lines[-1])


def _cli_json_subprocess(env: dict[str, str], *argv: str) -> tuple[int, dict]:
    """``rocketstore spark ...`` as a user runs it: a fresh process whose JVM spark-submit starts."""
    p = subprocess.run([sys.executable, "-m", "rocketstore", "spark", *argv], capture_output=True, timeout=240,
                       env={**os.environ, **env})
    lines = [ln for ln in p.stdout.decode().splitlines() if ln.strip()]
    assert lines, f"no output from rocketstore spark {' '.join(argv)}; stderr: {p.stderr.decode()[-2000:]}"
    return p.returncode, json.loads(lines[-1])


@pytest.mark.parametrize("job", ["verify", "stats"])
def test_cli_job_through_master_url_equals_local(job, spark_cluster, store, shipped, monkeypatch, capsys):
    """``rocketstore spark verify|stats --master spark://...`` gives local[2]'s answer.

    verify runs as a command (a new process), stats in this process: both ways of starting the driver.
    """
    conf = [a for k, v in spark_cluster.driver_conf(shipped).items() for a in ("--conf", f"{k}={v}")]
    argv = (job, str(store), "--json", "--master", spark_cluster.master_url, *conf)
    if job == "verify":
        code, result = _cli_json_subprocess(spark_cluster.driver_env(), *argv)
    else:
        for k, v in spark_cluster.driver_env().items():
            monkeypatch.setenv(k, v)
        code, result = _cli_json(capsys, *argv)
    assert f"rocketstore {job}" in [a["name"] for a in spark_cluster.state()["completedapps"]]  # it ran there

    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    local_conf = [a for k, v in LOCAL_CONF.items() for a in ("--conf", f"{k}={v}")]
    local_code, local = _cli_json(capsys, job, str(store), "--json", "--master", "local[2]", *local_conf)
    assert (code, result) == (local_code, local)
    assert code == 0
    if job == "verify":
        assert result["ok"] is True
    else:
        assert result["messages"] == len(golden_expected("basic"))


def test_append_on_the_cluster_gives_every_golden_message_and_key(spark_cluster, store, shipped, monkeypatch,
                                                                  tmp_path):
    """A store read and appended through the cluster: executors encode the records and hash the index keys with
    the zip's rocketstore, the driver commits them. Every queue holds RocketMQ's messages in their order, and
    every key of queries.json finds the messages RocketMQ's index found."""
    from conftest import golden_queries

    from rocketstore import MessageStore
    for k, v in spark_cluster.driver_env().items():
        monkeypatch.setenv(k, v)
    spark = jobs.session(spark_cluster.master_url, spark_cluster.driver_conf(shipped),
                         app_name="rocketstore cluster append")
    target = tmp_path / "appended"
    try:
        spark.sparkContext.setLogLevel("ERROR")
        (spark.read.format("rocketstore").load(str(store))
         .select("topic", "body", "queueId", "tags", "keys", "properties", "bornTimestamp", "bornHost")
         .write.format("rocketstore").mode("append").option("mappedFileSizeCommitLog", str(1 << 20))
         .save(str(target)))
    finally:
        spark.stop()
    expected = golden_expected("basic")
    queues: dict[tuple[str, int], list[dict]] = {}
    for e in sorted(expected, key=lambda e: e["queueOffset"]):
        queues.setdefault((e["topic"], e["queueId"]), []).append(e)
    body_at = {e["commitLogOffset"]: base64.b64decode(e["body"]) for e in expected}
    with MessageStore.open(str(target), read_only=True) as s:
        for (topic, q), want in queues.items():
            got, offset = [], 0
            while offset < s.max_offset_in_queue(topic, q):
                r = s.get(topic, q, offset)
                got += r.messages
                offset = r.next_begin_offset
            assert [(m.body, m.properties, m.born_timestamp) for m in got] == \
                [(base64.b64decode(e["body"]), e["properties"], e["bornTimestamp"]) for e in want], (topic, q)
        checked = 0
        for case in golden_queries("basic")["queryMessage"]:
            if len(case["resultPhyOffsets"]) >= case["maxNum"] or case["begin"] or case["end"] < 2 ** 63 - 1:
                continue  # which of more hits come back depends on the commitlog order; store times are new
            found = s.query(case["topic"], case["key"], case["maxNum"]).messages
            assert sorted(m.body for m in found) == sorted(body_at[o] for o in case["resultPhyOffsets"]), case["key"]
            checked += 1
        assert checked >= 10


def test_stream_with_group_id_on_the_cluster(spark_cluster, store, shipped, monkeypatch, tmp_path):
    """Issue 28: a stream on the cluster with groupId (executors read with the zip's rocketstore, the driver
    writes the group's position after each batch): afterwards config/consumerOffset.json holds, for every queue
    of the topic, RocketMQ's message count, and ``rocketstore lag`` shows the group with lag 0."""
    from conftest import copy_store, golden_store, run_cli

    from rocketstore.storage.group_offsets import read_offsets
    root = copy_store(golden_store("basic"), tmp_path / "grouped")
    for k, v in spark_cluster.driver_env().items():
        monkeypatch.setenv(k, v)
    spark = jobs.session(spark_cluster.master_url, spark_cluster.driver_conf(shipped),
                         app_name="rocketstore cluster stream group")
    try:
        spark.sparkContext.setLogLevel("ERROR")
        reader = (spark.readStream.format("rocketstore").option("startingOffsets", "earliest")
                  .option("topics", "TopicA").option("groupId", "spark-cluster"))
        reader = reader.option("maxOffsetsPerTrigger", "700")  # the queue view, several batches
        q = (reader.load(str(root)).writeStream.format("noop").option("checkpointLocation", str(tmp_path / "chk"))
             .trigger(availableNow=True).start())
        q.awaitTermination(240)
        assert q.exception() is None
        rows = sum(p["numInputRows"] for p in q.recentProgress)
        per_batch = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    finally:
        spark.stop()
    want: dict[int, int] = {}
    for e in golden_expected("basic"):
        if e["topic"] == "TopicA":
            want[e["queueId"]] = want.get(e["queueId"], 0) + 1
    assert rows == sum(want.values())
    assert len(per_batch) > 1 and max(per_batch) <= 700, per_batch
    assert read_offsets(str(root)).table["TopicA@spark-cluster"] == want
    lag = run_cli("lag", str(root), "--group", "spark-cluster", "--format", "json")
    assert lag.returncode == 0, lag.stderr
    assert json.loads(lag.stdout)["totalLag"] == 0
    assert {r["queueId"]: r["consumerOffset"] for r in json.loads(lag.stdout)["lag"]} == want
