"""The tools a Python user would pick instead, on the same payloads and machine.

SQLite (WAL; one transaction per message and 32 per transaction; synchronous
OFF / NORMAL / FULL; a rowid range scan and an indexed key lookup over the
same messages as rocketstore's data set), persist-queue's SQLiteQueue,
diskcache's Deque, litequeue and Redis streams (pipelined XADD, XRANGE).
"""

from __future__ import annotations

import os
import random
import shutil
import sqlite3
from typing import Callable

from .floors import make_body
from .harness import Measurement, Results, rate_measurement, timed

TOPIC = "BenchTopic"


# ---------------------------------------------------------------- SQLite

def _sqlite(path: str, synchronous: str) -> sqlite3.Connection:
    for suffix in ("", "-wal", "-shm"):
        try:
            os.unlink(path + suffix)
        except FileNotFoundError:
            pass
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute("CREATE TABLE IF NOT EXISTS m (id INTEGER PRIMARY KEY, topic TEXT, qid INTEGER, k TEXT, body BLOB)")
    return conn


def _drop(path: str) -> None:
    for suffix in ("", "-wal", "-shm"):
        try:
            os.unlink(path + suffix)
        except FileNotFoundError:
            pass


def sqlite_put(res: Results, workdir: str, *, synchronous: str, batch: int, seconds: float,
               body_size: int = 1024) -> Measurement:
    body = make_body(body_size)
    path = os.path.join(workdir, f"sqlite-{synchronous}-{batch}.db")
    conn = _sqlite(path, synchronous)
    sql = "INSERT INTO m (topic, qid, body) VALUES (?, ?, ?)"
    try:
        if batch == 1:
            ex = conn.execute
            chunk = 100 if synchronous != "FULL" else 5

            def step() -> int:
                for _ in range(chunk):
                    ex(sql, (TOPIC, 0, body))  # autocommit: one transaction per message
                return chunk
        else:
            rows = [(TOPIC, 0, body)] * batch

            def step() -> int:
                conn.execute("BEGIN")
                conn.executemany(sql, rows)
                conn.execute("COMMIT")
                return batch
        n, elapsed = timed(step, seconds)
    finally:
        conn.close()
        _drop(path)
    sync = synchronous.lower()
    id = f"sqlite.txn.{sync}" if batch == 1 else f"sqlite.batch{batch}.{sync}"
    label = (f"SQLite WAL, one transaction per message, synchronous={synchronous}" if batch == 1 else
             f"SQLite WAL, {batch} per transaction, synchronous={synchronous}")
    ref = "floor.fdatasync" if synchronous == "FULL" else f"floor.append.{body_size}"
    return res.add(rate_measurement(id, "sqlite", label, n, elapsed, ref=ref, bytes_per_msg=body_size,
                                    synchronous=synchronous, batch=batch))


def sqlite_build_dataset(path: str, n: int, body: bytes, key_of: Callable[[int], str]) -> None:
    conn = _sqlite(path, "OFF")
    conn.execute("CREATE INDEX m_k ON m (k)")
    conn.execute("BEGIN")
    conn.executemany("INSERT INTO m (topic, qid, k, body) VALUES (?, 0, ?, ?)",
                     ((TOPIC, key_of(i), body) for i in range(n)))
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def sqlite_consume(res: Results, path: str, n_rows: int, seconds: float, per_call: int = 32) -> Measurement:
    conn = sqlite3.connect(path, isolation_level=None)
    sql = "SELECT id, topic, qid, k, body FROM m WHERE id > ? ORDER BY id LIMIT ?"
    state = [0]
    try:
        def step() -> int:
            last = state[0]
            got = 0
            ex = conn.execute
            for _ in range(20):
                if last >= n_rows:
                    last = 0
                rows = ex(sql, (last, per_call)).fetchall()
                if not rows:
                    raise RuntimeError(f"SQLite scan after rowid {last} returned nothing")
                got += len(rows)
                last = rows[-1][0]
            state[0] = last
            return got
        n, elapsed = timed(step, seconds)
    finally:
        conn.close()
    return res.add(rate_measurement("sqlite.consume32", "sqlite",
                                    f"SQLite SELECT ... WHERE rowid > ? ORDER BY rowid LIMIT {per_call}", n, elapsed,
                                    ref="floor.read.1024", bytes_per_msg=1024, per_call=per_call, messages=n_rows))


def sqlite_lookup(res: Results, path: str, keys: list[str], seconds: float) -> Measurement:
    conn = sqlite3.connect(path, isolation_level=None)
    sql = "SELECT id, topic, qid, k, body FROM m WHERE k = ?"
    state = [0]
    try:
        def step() -> int:
            i = state[0]
            ex = conn.execute
            for _ in range(50):
                k = keys[i % len(keys)]
                rows = ex(sql, (k,)).fetchall()
                if len(rows) != 1:
                    raise RuntimeError(f"SQLite lookup of {k} found {len(rows)} rows")
                i += 1
            state[0] = i
            return 50
        n, elapsed = timed(step, seconds)
    finally:
        conn.close()
    return res.add(rate_measurement("sqlite.lookup", "sqlite", "SQLite indexed lookup by key, body read", n, elapsed,
                                    unit="lookups/s"))


# ---------------------------------------------------------------- queue libraries

def _put_then_consume(res: Results, system: str, label_put: str, label_get: str, id: str, seconds: float,
                      put_step: Callable[[], int], get_step: Callable[[int], int], note: str | None = None,
                      **params) -> None:
    """Put for ``seconds`` (counting), then consume at most what was put, for at most ``seconds``."""
    n_put, t_put = timed(put_step, seconds, warmup=0)
    m = rate_measurement(f"{id}.put", system, label_put, n_put, t_put, ref="floor.append.1024",
                         bytes_per_msg=1024, **params)
    m.note = note
    res.add(m)
    left = [n_put]

    def step() -> int:
        if left[0] <= 0:
            raise _Drained
        k = get_step(left[0])
        left[0] -= k
        return k

    n_get, t_get = _timed_until_drained(step, seconds)
    m = rate_measurement(f"{id}.consume", system, label_get, n_get, t_get, ref="floor.read.1024",
                         bytes_per_msg=1024, **params)
    m.note = note
    res.add(m)


class _Drained(Exception):
    pass


def _timed_until_drained(step: Callable[[], int], seconds: float) -> tuple[int, float]:
    import time
    n = 0
    t0 = time.perf_counter()
    while True:
        try:
            n += step()
        except _Drained:
            break
        if time.perf_counter() - t0 >= seconds:
            break
    return n, time.perf_counter() - t0


def persist_queue(res: Results, workdir: str, seconds: float) -> None:
    try:
        import persistqueue
    except ImportError as e:
        for k in ("put", "consume"):
            res.skip(f"persist-queue.{k}", "persist-queue", f"persist-queue SQLiteQueue {k}", "msg/s",
                     f"not installed: {e}")
        return
    path = os.path.join(workdir, "persist-queue")
    shutil.rmtree(path, ignore_errors=True)
    body = make_body(1024)
    q = persistqueue.SQLiteQueue(path, auto_commit=True)
    try:
        def put_step() -> int:
            for _ in range(20):
                q.put(body)
            return 20

        def get_step(left: int) -> int:
            k = min(20, left)
            for _ in range(k):
                if q.get(block=False) is None:
                    raise RuntimeError("persist-queue returned None")
            return k

        _put_then_consume(res, "persist-queue", "persist-queue SQLiteQueue.put (auto_commit)",
                          "persist-queue SQLiteQueue.get (auto_commit)", "persist-queue", seconds, put_step,
                          get_step)
    finally:
        q.close()
        shutil.rmtree(path, ignore_errors=True)


def diskcache_deque(res: Results, workdir: str, seconds: float) -> None:
    try:
        import diskcache
    except ImportError as e:
        for k in ("put", "consume"):
            res.skip(f"diskcache.{k}", "diskcache", f"diskcache Deque {k}", "msg/s", f"not installed: {e}")
        return
    path = os.path.join(workdir, "diskcache")
    shutil.rmtree(path, ignore_errors=True)
    body = make_body(1024)
    dq = diskcache.Deque(directory=path)
    try:
        def put_step() -> int:
            for _ in range(20):
                dq.append(body)
            return 20

        def get_step(left: int) -> int:
            k = min(20, left)
            for _ in range(k):
                dq.popleft()
            return k

        _put_then_consume(res, "diskcache", "diskcache Deque.append", "diskcache Deque.popleft", "diskcache",
                          seconds, put_step, get_step)
    finally:
        dq.cache.close()
        shutil.rmtree(path, ignore_errors=True)


def litequeue_peer(res: Results, workdir: str, seconds: float) -> None:
    try:
        import litequeue
    except ImportError as e:
        for k in ("put", "consume"):
            res.skip(f"litequeue.{k}", "litequeue", f"litequeue {k}", "msg/s", f"not installed: {e}")
        return
    path = os.path.join(workdir, "litequeue.db")
    _drop(path)
    data = random.Random(3).randbytes(768).hex()[:1024]  # litequeue stores TEXT: 1 KiB of text
    q = litequeue.LiteQueue(path)
    try:
        def put_step() -> int:
            for _ in range(20):
                q.put(data)
            return 20

        def get_step(left: int) -> int:
            k = min(20, left)
            for _ in range(k):
                m = q.pop()
                if m is None:
                    raise RuntimeError("litequeue pop returned None")
                q.done(m.message_id)
            return k

        _put_then_consume(res, "litequeue", "litequeue put", "litequeue pop + done", "litequeue", seconds,
                          put_step, get_step)
    finally:
        q.close()
        _drop(path)


def redis_streams(res: Results, workdir: str, seconds: float, server) -> None:
    """Redis streams on a server the suite started (``server`` is a RedisServer or None with a reason)."""
    if server is None or getattr(server, "port", None) is None:
        why = getattr(server, "why_not", None) or "redis-server not available"
        for k in ("put", "consume"):
            res.skip(f"redis.{k}", "redis", f"Redis streams {k}", "msg/s", why)
        return
    try:
        import redis
    except ImportError as e:
        for k in ("put", "consume"):
            res.skip(f"redis.{k}", "redis", f"Redis streams {k}", "msg/s", f"redis client not installed: {e}")
        return
    r = redis.Redis(host="127.0.0.1", port=server.port)
    stream = "bench-stream"
    r.delete(stream)
    body = make_body(1024)
    pipe_n = 32
    last = [b"-"]
    try:
        def put_step() -> int:
            p = r.pipeline(transaction=False)
            for _ in range(pipe_n):
                p.xadd(stream, {b"body": body})
            p.execute()
            return pipe_n

        def get_step(left: int) -> int:
            entries = r.xrange(stream, min=last[0], max="+", count=min(32, left))
            if not entries:
                raise RuntimeError("XRANGE returned nothing")
            last[0] = b"(" + entries[-1][0]
            return len(entries)

        _put_then_consume(res, "redis", f"Redis streams XADD, pipelined {pipe_n}", "Redis streams XRANGE COUNT 32",
                          "redis", seconds, put_step, get_step, server=server.version)
    finally:
        try:
            r.delete(stream)
            r.close()
        except Exception:
            pass
