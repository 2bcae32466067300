"""Scan throughput of the data source against Spark reading the same messages from Parquet.

:func:`bench_spark_scan` exports the store to Parquet once, then times a
body-less scan of every row through each: all ``dump`` fields except the
body, materialised by Spark's ``noop`` sink (so every column is decoded and
converted, as any query that uses them would).  Both are timed best of
``repeats`` after ``warmups`` runs each (the JIT compiles the source's JVM path, the Arrow stream reader
and the two row conversions, over its first three or four scans, Parquet's over one or two: 2026-11-27,
the task thread's CPU per scan 0.98, 0.66, 0.68, 0.60, then 0.54-0.61), and the CPU seconds of the Spark JVM and its
Python workers are reported too, since wall time on a shared machine is noisy.

    python -m rocketstore.bench.spark_scan STORE [--workdir DIR] [--messages N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from typing import Any


def make_bench_store(path: str, messages: int, *, seed: int = 7, segment_bytes: int = 64 * 1024 * 1024) -> str:
    """A store of ``messages`` messages shaped like the golden ones (3 topics, 4 queues, tags, keys, UNIQ_KEY)."""
    from ..config import StoreConfig
    from ..format.message import Message
    from ..store import MessageStore
    shutil.rmtree(path, ignore_errors=True)
    rnd = random.Random(seed)
    cfg = StoreConfig(mappedFileSizeCommitLog=segment_bytes)
    with MessageStore.open(path, cfg) as store:
        for i in range(messages):
            m = Message(topic=f"Topic{'ABC'[i % 3]}", body=rnd.randbytes(rnd.randint(1, 512)), queue_id=i % 4,
                        tags=f"Tag{'ABCDE'[i % 5]}", keys=f"order-{i} user-{i % 1000}",
                        properties={"UNIQ_KEY": f"FD{i:030X}", "WAIT": "true", "CLUSTER": "DefaultCluster"},
                        born_host=f"127.0.0.1:{40000 + i % 1000}")
            r = store.put(m)
            if not r.ok:
                raise RuntimeError(f"bench store: put {i} refused: {r.status.value} {r.error}")
        store.wait_dispatched()
    return path


def _process_cpu(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of every descendant of ``root_pid``: ``jvm`` (the Spark JVM, its task
    threads apart as ``tasks``) and ``python`` (its Python workers), which shows which side a scan waits on."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    names: dict[int, str] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                text = fh.read()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[-1].split()
        pid = int(name)
        names[pid] = text[text.find("(") + 1:text.rfind(")")]
        children.setdefault(int(fields[1]), []).append(pid)
        ticks[pid] = int(fields[11]) + int(fields[12])
    out = {"jvm": 0, "tasks": 0, "python": 0}
    stack = [root_pid]
    while stack:
        for c in children.get(stack.pop(), []):
            if names.get(c) == "java":
                out["jvm"] += ticks.get(c, 0)
                out["tasks"] += _task_thread_ticks(c)
            else:
                out["python"] += ticks.get(c, 0)
            stack.append(c)
    return {k: v / os.sysconf("SC_CLK_TCK") for k, v in out.items()}


def _task_thread_ticks(pid: int) -> int:
    """CPU ticks of the JVM's task threads (Spark names them "Executor task launch worker ...")."""
    total = 0
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for t in threads:
        try:
            with open(f"/proc/{pid}/task/{t}/stat") as fh:
                text = fh.read()
        except OSError:
            continue
        if "(Executor task" in text:
            fields = text.rsplit(")", 1)[-1].split()
            total += int(fields[11]) + int(fields[12])
    return total


def _timed(df: Any) -> tuple[float, float, dict[str, float]]:
    """Wall seconds of writing ``df`` to the noop sink, the CPU seconds it took, and those split by side."""
    have_proc = os.path.isdir("/proc")
    c0 = _process_cpu(os.getpid()) if have_proc else {}
    t0 = time.perf_counter()
    df.write.format("noop").mode("overwrite").save()
    wall = time.perf_counter() - t0
    split = {k: round(v - c0[k], 3) for k, v in _process_cpu(os.getpid()).items()} if have_proc else {}
    return wall, split.get("jvm", 0.0) + split.get("python", 0.0), split


def bench_spark_scan(store_path: str, workdir: str, *, spark: Any = None, repeats: int = 3,
                     warmups: int = 3) -> dict[str, Any]:
    """Rows/s of a body-less scan through the ``rocketstore`` source and through Parquet, on local[2].

    Uses ``spark`` if given (its master is kept), else starts a local[2] session
    (stopped at the end).  The Parquet copy is written to ``workdir``.
    """
    from ..spark import jobs
    own = spark is None
    if own:
        spark = jobs.session("local[2]", {"spark.ui.enabled": "false", "spark.driver.memory": "2g"},
                             app_name="rocketstore bench")
    try:
        root = os.path.abspath(store_path)
        os.makedirs(workdir, exist_ok=True)
        parquet = os.path.join(workdir, "export.parquet")
        t0 = time.perf_counter()
        exported = jobs.export(spark, root, parquet, mode="overwrite")
        export_s = time.perf_counter() - t0
        rows = exported["rows"]

        def rs() -> Any:
            return spark.read.format("rocketstore").option("withBody", "false").load(root)

        def pq() -> Any:
            return spark.read.parquet(parquet).drop("body")
        for _ in range(max(1, warmups)):  # warm-up: JVM JIT, Python workers
            _timed(rs())
            _timed(pq())
        runs: dict[str, list[tuple[float, float, dict[str, float]]]] = {"rocketstore": [], "parquet": []}
        for _ in range(max(1, repeats)):
            runs["rocketstore"].append(_timed(rs()))
            runs["parquet"].append(_timed(pq()))
        best = {k: min(w for w, _, _ in v) for k, v in runs.items()}
        cpu = {k: min(c for _, c, _ in v) for k, v in runs.items()}
        out: dict[str, Any] = {
            "rows": rows, "master": spark.sparkContext.master, "exportSeconds": round(export_s, 2), "warmups": warmups,
            "rocketstoreRowsPerSec": round(rows / best["rocketstore"]),
            "parquetRowsPerSec": round(rows / best["parquet"]),
            "ratio": round(best["parquet"] / best["rocketstore"], 3),
            "runs": {k: [{"seconds": round(w, 3), "cpuSeconds": round(c, 3), "cpuSplit": split} for w, c, split in v]
                     for k, v in runs.items()},
            # Spark's tasks on each side, and the export's row groups: a Parquet split without one reads nothing.
            "partitions": {"rocketstore": rs().rdd.getNumPartitions(), "parquet": pq().rdd.getNumPartitions()},
            "parquetRowGroups": _row_groups(parquet),
        }
        if all(cpu.values()):
            cores = _cores(spark.sparkContext.master)
            out["cpuRowsPerSec"] = {k: round(rows * cores / v) for k, v in cpu.items()}
            out["cpuRatio"] = round(cpu["parquet"] / cpu["rocketstore"], 3)
        out["write"] = bench_spark_write(spark, parquet, workdir, repeats=repeats)
        return out
    finally:
        if own:
            spark.stop()


def bench_spark_write(spark: Any, parquet: str, workdir: str, *, repeats: int = 3) -> dict[str, Any]:
    """Rows/s of appending the exported rows to a new store (``mode("append")``), against Spark writing the
    same DataFrame as Parquet; best of ``repeats``, each into a new directory."""
    df = spark.read.parquet(parquet).select("topic", "body", "queueId", "tags", "keys", "properties",
                                            "bornTimestamp", "bornHost").cache()
    rows = df.count()
    warm = os.path.join(workdir, "write-warm-up")  # the first write starts Python workers and loads the writer
    df.limit(2000).write.format("rocketstore").mode("append").option("mappedFileSizeCommitLog", str(4 * 1024 * 1024)) \
        .save(warm)
    shutil.rmtree(warm, ignore_errors=True)
    runs: dict[str, list[float]] = {"rocketstore": [], "parquet": []}
    for i in range(max(1, repeats)):
        target = os.path.join(workdir, f"write-store-{i}")
        shutil.rmtree(target, ignore_errors=True)
        t0 = time.perf_counter()
        df.write.format("rocketstore").mode("append").option("mappedFileSizeCommitLog", str(64 * 1024 * 1024)) \
            .save(target)
        runs["rocketstore"].append(time.perf_counter() - t0)
        shutil.rmtree(target, ignore_errors=True)
        pq = os.path.join(workdir, f"write-parquet-{i}")
        t0 = time.perf_counter()
        df.write.mode("overwrite").parquet(pq)
        runs["parquet"].append(time.perf_counter() - t0)
        shutil.rmtree(pq, ignore_errors=True)
    df.unpersist()
    best = {k: min(v) for k, v in runs.items()}
    return {"rows": rows, "rocketstoreRowsPerSec": round(rows / best["rocketstore"]),
            "parquetRowsPerSec": round(rows / best["parquet"]),
            "runs": {k: [round(x, 3) for x in v] for k, v in runs.items()}}


def _row_groups(path: str) -> int:
    import glob

    import pyarrow.parquet as pq
    return sum(pq.ParquetFile(f).metadata.num_row_groups for f in glob.glob(os.path.join(path, "*.parquet")))


def _cores(master: str) -> int:
    import re
    m = re.match(r"local\[(\d+)\]", master or "")
    if m:
        return int(m.group(1))
    return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rocketstore.bench.spark_scan", description=__doc__.splitlines()[0])
    p.add_argument("store", metavar="STORE", help="store to scan (created with --messages if given)")
    p.add_argument("--workdir", default=None, metavar="DIR")
    p.add_argument("--messages", type=int, default=None, help="first create a bench store of N messages")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.messages:
        make_bench_store(args.store, args.messages)
    import tempfile
    workdir = args.workdir or tempfile.mkdtemp(prefix="rocketstore-spark-bench-")
    sys.stdout.write(json.dumps(bench_spark_scan(args.store, workdir, repeats=args.repeats)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
