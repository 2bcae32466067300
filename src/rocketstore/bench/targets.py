"""The targets of issues 8 and 18: each a ratio of two figures taken in the same run (or a memory ceiling)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .harness import Results


@dataclass(frozen=True)
class Target:
    id: str
    workload: str
    figure: str  # measurement id (rocketstore's figure)
    ref: str | None  # measurement id it is divided by; None for an absolute ceiling
    threshold: float
    text: str  # the target as written in the issue
    ceiling: bool = False  # met when figure <= threshold (memory), or figure / ref <= threshold (CPU per message)
    floor: bool = False  # an absolute figure: met when figure >= threshold (no reference)
    profile: str | None = None  # workload to profile when missed


# (measurement prefix, name, rocketstore's put figure to compare with).  A peer that batches its puts is
# compared with put_batch of the same size: Redis streams' XADDs go 32 to a pipeline (one round trip, as
# one put_batch(32) takes the lock once); the queue libraries put one message per call, as put does.
PEERS = (("persist-queue", "persist-queue", "rs.put.async.t1.1024"),
         ("diskcache", "diskcache Deque", "rs.put.async.t1.1024"),
         ("litequeue", "litequeue", "rs.put.async.t1.1024"),
         ("redis", "Redis streams", "rs.batch32.async.t1.1024"))

# Queue workloads (issue 27): rocketstore's SimpleConsumer against the ack queues (bench/queues.py).
QUEUE_PEERS = (("persist-queue", "persist-queue SQLiteAckQueue"), ("litequeue", "litequeue"),
               ("diskcache", "diskcache push/pull + in-flight record"))

TARGETS: list[Target] = [
    Target("put.vs.sqlite.normal", "put, single, async, 1 thread", "rs.put.async.t1.1024", "sqlite.txn.normal", 2.0,
           ">= 2x SQLite WAL, 1 txn/msg, synchronous=NORMAL", profile="put"),
    Target("put.vs.sqlite.off", "put, single, async, 1 thread", "rs.put.async.t1.1024", "sqlite.txn.off", 1.0,
           ">= 1x SQLite WAL, 1 txn/msg, synchronous=OFF", profile="put"),
    Target("put.vs.floor", "put, single, async, 1 thread", "rs.put.async.t1.1024", "floor.append.1024", 0.5,
           ">= 50 % of the bare-append floor", profile="put"),
    Target("batch.vs.sqlite", "put_batch(32), async", "rs.batch32.async.t1.1024", "sqlite.batch32.off", 1.5,
           ">= 1.5x SQLite WAL, 32/txn, synchronous=OFF", profile="batch"),
    Target("batch.vs.floor", "put_batch(32), async", "rs.batch32.async.t1.1024", "floor.append.1024", 1.0,
           ">= 100 % of the bare-append floor", profile="batch"),
    Target("sync.vs.sqlite.full", "put, SYNC_FLUSH, 1 thread", "rs.put.sync.t1.1024", "sqlite.txn.full", 1.3,
           ">= 1.3x SQLite WAL, 1 txn/msg, synchronous=FULL", profile="sync"),
    Target("sync16.vs.sqlite.full", "put, SYNC_FLUSH, 16 threads", "rs.put.sync.t16.1024", "sqlite.txn.full", 3.0,
           ">= 3x SQLite WAL, 1 txn/msg, synchronous=FULL (group commit)", profile="sync16"),
    Target("sync16.vs.sync1", "put, SYNC_FLUSH, 16 threads", "rs.put.sync.t16.1024", "rs.put.sync.t1.1024", 5.0,
           ">= 5x the 1-thread sync figure (group commit)", profile="sync16"),
    Target("consume.vs.sqlite", "consume via consume queue, 32/call", "rs.consume32", "sqlite.consume32", 0.7,
           ">= 0.7x SQLite rowid range scan, LIMIT 32", profile="consume"),
    Target("consume.vs.floor", "consume via consume queue, 32/call", "rs.consume32", "floor.read.1024", 0.5,
           ">= 50 % of the bare-read floor", profile="consume"),
    Target("lookup.vs.sqlite", "lookup by key (index)", "rs.lookup", "sqlite.lookup", 0.5,
           ">= 0.5x SQLite indexed lookup", profile="lookup"),
    *[Target(f"put.vs.{p}", f"put vs {name}" if fig.startswith("rs.put") else f"put_batch(32) vs {name}", fig,
             f"{p}.put", 3.0, f">= 3x {name} put" + ("" if fig.startswith("rs.put") else " (pipelined 32)"),
             profile="put" if fig.startswith("rs.put") else "batch") for p, name, fig in PEERS],
    *[Target(f"consume.vs.{p}", f"consume vs {name}", "rs.consume32", f"{p}.consume", 3.0,
             f">= 3x {name} consume", profile="consume") for p, name, _fig in PEERS],
    *[Target(f"queue.p{n}.vs.{p}", f"queue: put + receive + ack, {'1 process' if n == 1 else '4 processes'}",
             f"queue.rs.p{n}", f"queue.{p}.p{n}", 3.0, f">= 3x {name}, put + receive + ack per message, "
             f"{'1 process' if n == 1 else '1 producer + 3 consumer processes'}")
      for n in (1, 4) for p, name in QUEUE_PEERS],
    Target("recovery.vs.crc32", "abnormal recovery", "rs.recovery", "crc32.recovery", 0.3,
           ">= 30 % of zlib.crc32 speed over the same bytes", profile="recovery"),
    Target("spark.vs.parquet", "Spark body-less scan, local[2]", "spark.scan", "parquet.scan", 0.7,
           ">= 0.7x Spark over the same messages in Parquet", profile="spark"),
    Target("spark.write", "Spark append, local[2]", "spark.write", None, 50000.0,
           ">= 50k rows/s appended through the data source on local[2]", floor=True, profile="spark"),
    Target("broker.produce.vs.bare", "gRPC broker, official client send_async, 4 producer processes",
           "broker.produce", "bare.produce", 0.8, ">= 0.8x a bare grpc.aio server answering the same sends"),
    Target("broker.consume.vs.bare", "gRPC broker, official client receive + ack, 4 consumer processes",
           "broker.consume", "bare.consume", 0.8,
           ">= 0.8x a bare grpc.aio server answering the same receives and acks"),
    Target("broker.send.cpu.vs.bare", "gRPC broker, server CPU per message sent", "broker.send.cpu", "bare.send.cpu",
           1.4, "<= 1.4x the bare grpc.aio server's CPU per send", ceiling=True),
    Target("broker.receive.cpu.vs.bare", "gRPC broker, server CPU per message received + acked", "broker.receive.cpu",
           "bare.receive.cpu", 1.4, "<= 1.4x the bare grpc.aio server's CPU per receive + ack", ceiling=True),
    Target("memory", "memory while writing", "rs.memory", None, 300.0, "private memory < 300 MB", ceiling=True),
]


def evaluate(res: Results) -> list[dict[str, Any]]:
    rows = []
    for t in TARGETS:
        fig = res.get(t.figure)
        ref = res.get(t.ref) if t.ref else None
        value = res.value(t.figure)
        ref_value = res.value(t.ref) if t.ref else None
        if t.ceiling and t.ref:  # a cost: at most threshold times the reference's
            ratio = value / ref_value if value is not None and ref_value else None
            met = None if ratio is None else ratio <= t.threshold
        elif t.ceiling:
            ratio = value
            met = None if value is None else value <= t.threshold
        elif t.floor:  # the ratio to the target itself (1.0 = exactly on target)
            ratio = None if value is None else value / t.threshold
            met = None if ratio is None else ratio >= 1.0
        else:
            ratio = value / ref_value if value is not None and ref_value else None
            met = None if ratio is None else ratio >= t.threshold
        why = None
        if met is None:
            missing = [m for m in (fig, ref) if m is not None and m.status != "ok"]
            why = "; ".join(f"{m.id}: {m.note}" for m in missing) or "not measured in this run"
        rows.append({"id": t.id, "workload": t.workload, "target": t.text, "figure": t.figure, "ref": t.ref,
                     "value": value, "unit": fig.unit if fig else None, "ref_value": ref_value,
                     "ref_unit": ref.unit if ref else None, "ratio": ratio, "threshold": t.threshold,
                     "ceiling": t.ceiling, "floor": t.floor, "met": met, "why_not_measured": why, "profile": t.profile})
    return rows
