"""Queue workloads (issue 27): put + receive + ack per message, one process and four, against the embedded
queues a Python user would pick instead.

Every system runs the same shape on 1 KiB bodies that carry a sequence number:

* ``p1``: one process puts a chunk of 32 messages, then receives and acks them one by one (receive returns
  what is there, up to 32), until N messages are put and acked;
* ``p4``: four processes share one queue, one producer putting N messages and three consumers receiving and
  acking until N are acked between them (rocketstore takes writes from one process, the store-lock holder;
  the peers are given the same shape).

The figure is N / the wall time from the start signal to the last ack (children are started, have opened
their queue and wait for the signal before the clock starts).  Every consumer returns the sequence numbers
it acked; the run is verified (each message acked exactly once) and the counts kept in the measurement.

Systems: rocketstore's SimpleConsumer (``store.simple_consumer(group, topic)``, ``receive``/``ack``; the
consumers of ``p4`` open the store read-only), persist-queue's ``SQLiteAckQueue`` (``put``/``get``/``ack``,
``auto_commit=True``; ``auto_resume=False`` in the consumers, or each one's start would hand back the others'
unacked messages), litequeue (``put``/``pop``/``done``: its pop locks a row in one IMMEDIATE transaction) and
diskcache (no ack of its own: ``Cache.push``, then ``pull`` plus an in-flight record written in one transaction
and deleted by the ack, the visibility bookkeeping an ack queue keeps).  persist-queue 1.x has no file-based
ack queue (its ``Queue`` has no ack), so only the SQLite one is measured.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import time
from typing import Any, Callable

from .floors import make_body
from .harness import Results, rate_measurement

TOPIC = "BenchQueue"
GROUP = "bench-queue"
CHUNK = 32
SYSTEMS = ("rs", "persist-queue", "litequeue", "diskcache")
LABELS = {"rs": "rocketstore SimpleConsumer receive + ack", "persist-queue": "persist-queue SQLiteAckQueue get + ack",
          "litequeue": "litequeue pop + done", "diskcache": "diskcache Cache push / pull + in-flight record"}
IDLE = 0.001  # a consumer's sleep when its queue is empty (the peers have no blocking receive across processes)


class Missing(Exception):
    """The system cannot run here (not installed, or rocketstore's queue API is not there)."""


def _payload(i: int, body: bytes) -> bytes:
    return b"%010d" % i + body[10:]


def _seq(data: Any) -> int:
    return int(bytes(data[:10]) if not isinstance(data, str) else data[:10])


# ---------------------------------------------------------------- adapters: open(path, role) -> object with
# put(i), take() -> list of sequence numbers acked (possibly empty), close()

class RocketstoreQueue:
    def __init__(self, path: str, role: str) -> None:
        from ..config import StoreConfig
        from ..format.message import Message
        from ..store import MessageStore
        self.Message = Message
        read_only = role == "consumer"
        self.store = MessageStore.open(path, None if read_only else StoreConfig(), read_only=read_only)
        self.body = make_body(1024)
        self.consumer = None
        if role != "producer":
            if not hasattr(self.store, "simple_consumer"):
                self.store.close()
                raise Missing("MessageStore.simple_consumer is not in this build (issue 27's SimpleConsumer)")
            self.consumer = self.store.simple_consumer(GROUP, TOPIC, invisible_duration=60.0)

    def put(self, i: int) -> None:
        r = self.store.put(self.Message(TOPIC, _payload(i, self.body), queue_id=i % 4))
        if not r.ok:
            raise RuntimeError(f"put failed: {r.status.value} {r.error}")

    def take(self) -> list[int]:
        got = self.consumer.receive(CHUNK, wait=0.05)
        out = []
        for m in got:
            self.consumer.ack(m)
            out.append(_seq(m.body))
        return out

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
        self.store.close()


class PersistQueue:
    def __init__(self, path: str, role: str) -> None:
        try:
            import persistqueue
        except ImportError as e:
            raise Missing(f"persist-queue not installed: {e}") from None
        self.Empty = persistqueue.Empty
        self.q = persistqueue.SQLiteAckQueue(path, auto_commit=True, multithreading=True,
                                             auto_resume=role == "solo")
        self.body = make_body(1024)

    def put(self, i: int) -> None:
        self.q.put(_payload(i, self.body))

    def take(self) -> list[int]:
        out = []
        for _ in range(CHUNK):
            try:
                item = self.q.get(block=False)  # (its size is this process's count: not asked)
            except self.Empty:
                break
            self.q.ack(item)
            out.append(_seq(item))
        return out

    def close(self) -> None:
        if hasattr(self.q, "close"):  # (not every persist-queue version has it)
            self.q.close()


class LiteQueuePeer:
    def __init__(self, path: str, role: str) -> None:
        try:
            import litequeue
        except ImportError as e:
            raise Missing(f"litequeue not installed: {e}") from None
        self.q = litequeue.LiteQueue(os.path.join(path, "queue.db"))
        self.text = make_body(1024).hex()[:1024]  # litequeue stores TEXT: 1 KiB of text

    def put(self, i: int) -> None:
        self.q.put("%010d" % i + self.text[10:])

    def take(self) -> list[int]:
        out = []
        for _ in range(CHUNK):
            m = self.q.pop()
            if m is None:
                break
            self.q.done(m.message_id)
            out.append(_seq(m.data))
        return out

    def close(self) -> None:
        self.q.close()


class DiskcacheQueue:
    def __init__(self, path: str, role: str) -> None:
        try:
            import diskcache
        except ImportError as e:
            raise Missing(f"diskcache not installed: {e}") from None
        self.cache = diskcache.Cache(path)
        self.body = make_body(1024)

    def put(self, i: int) -> None:
        self.cache.push(_payload(i, self.body), prefix="q")

    def take(self) -> list[int]:
        out = []
        cache = self.cache
        for _ in range(CHUNK):
            with cache.transact():  # taken and recorded in flight at once, as an ack queue does
                key, value = cache.pull(prefix="q")
                if key is None:
                    break
                cache.set(("inflight", key), (value, time.time() + 60.0))
            cache.delete(("inflight", key))  # the ack
            out.append(_seq(value))
        return out

    def close(self) -> None:
        self.cache.close()


ADAPTERS: dict[str, Callable[[str, str], Any]] = {"rs": RocketstoreQueue, "persist-queue": PersistQueue,
                                                  "litequeue": LiteQueuePeer, "diskcache": DiskcacheQueue}


def _prepare(system: str, path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, exist_ok=True)
    if system == "rs":
        os.rmdir(path)  # the store makes its own directory


# ---------------------------------------------------------------- one process

def run_solo(system: str, path: str, n: int, deadline_s: float) -> dict[str, Any]:
    """Put ``n`` (in chunks), receive and ack them, in this process; returns the counts and the time."""
    _prepare(system, path)
    q = ADAPTERS[system](path, "solo")
    acked: list[int] = []
    try:
        for i in range(CHUNK):  # warm-up chunk, not counted
            q.put(n + i)
        warm_until = time.perf_counter() + deadline_s
        while len(acked) < CHUNK:
            if time.perf_counter() > warm_until:
                raise RuntimeError(f"{system}: the warm-up chunk was not received within {deadline_s:.0f} s")
            acked += q.take()
        acked.clear()
        t0 = time.perf_counter()
        limit = t0 + deadline_s
        i = 0
        while i < n and time.perf_counter() < limit:
            k = min(CHUNK, n - i)
            for j in range(i, i + k):
                q.put(j)
            i += k
            want = i
            while len(acked) < want and time.perf_counter() < limit:
                acked += q.take()
        elapsed = time.perf_counter() - t0
    finally:
        q.close()
        shutil.rmtree(path, ignore_errors=True)
    return {"put": i, "acked": acked, "seconds": elapsed}


# ---------------------------------------------------------------- four processes

MISSING = "missing: "


def _why(e: Exception) -> str:
    return MISSING + str(e) if isinstance(e, Missing) else f"{type(e).__name__}: {e}"


def _producer(system: str, path: str, n: int, ready: Any, go: Any, out: Any) -> None:
    """Put ``n``; report once: ("put", count, None | error)."""
    try:
        q = ADAPTERS[system](path, "producer")
    except Exception as e:
        out.put(("put", 0, 0.0, _why(e)))
        ready.release()
        return
    ready.release()
    go.wait()
    put, err = 0, None
    try:
        for i in range(n):
            q.put(i)
            put += 1
    except Exception as e:
        err = _why(e)
    out.put(("put", put, time.time(), err))
    try:
        _wait_flag(path)  # rocketstore's consumers read the store this process holds open
    finally:
        q.close()


def _wait_flag(path: str, timeout: float = 600.0) -> bool:
    flag = path.rstrip("/") + ".done"
    end = time.time() + timeout
    while not os.path.exists(flag) and time.time() < end:
        time.sleep(0.01)
    return os.path.exists(flag)


def _consumer(system: str, path: str, n: int, ready: Any, go: Any, out: Any, count: Any, seen: Any,
              deadline_s: float) -> None:
    """Receive and ack until ``n`` are acked between the consumers; report once: ("acked", seqs, last ack time,
    None | error)."""
    try:
        q = ADAPTERS[system](path, "consumer")
    except Exception as e:
        out.put(("acked", [], 0.0, _why(e)))
        ready.release()
        return
    ready.release()
    go.wait()
    acked: list[int] = []
    last, err = 0.0, None
    end = time.time() + deadline_s
    try:
        while count.value < n and time.time() < end:
            got = q.take()
            if got:
                last = time.time()
                acked += got
                with count.get_lock():  # distinct messages: a peer that hands one out twice must not end the run
                    for i in got:
                        if 0 <= i < n and not seen[i]:
                            seen[i] = 1
                            count.value += 1
            else:
                time.sleep(IDLE)
    except Exception as e:
        err = _why(e)
    finally:
        out.put(("acked", acked, last, err))
        q.close()


def run_shared(system: str, path: str, n: int, deadline_s: float, consumers: int = 3) -> dict[str, Any]:
    """One producer and ``consumers`` consumer processes on one queue; returns counts and the wall time from
    the start signal to the last ack (wall clock, one machine)."""
    _prepare(system, path)
    flag = path.rstrip("/") + ".done"
    if os.path.exists(flag):
        os.unlink(flag)
    ctx = mp.get_context("spawn")
    ready, go, out, count = ctx.Semaphore(0), ctx.Event(), ctx.Queue(), ctx.Value("q", 0)
    seen = ctx.Array("b", n, lock=False)  # guarded by count's lock
    procs = [ctx.Process(target=_producer, args=(system, path, n, ready, go, out), daemon=True)]
    errors: list[str] = []
    acked: list[int] = []
    put, last = 0, 0.0
    try:
        procs[0].start()
        if not ready.acquire(timeout=60):  # the producer makes the queue before the consumers open it
            raise RuntimeError(f"{system}: the producer did not start")
        for _ in range(consumers):
            procs.append(ctx.Process(target=_consumer, daemon=True,
                                     args=(system, path, n, ready, go, out, count, seen, deadline_s)))
            procs[-1].start()
        for _ in range(consumers):
            if not ready.acquire(timeout=60):
                raise RuntimeError(f"{system}: a consumer did not start")
        t0 = time.time()
        go.set()
        reports, end = 0, t0 + deadline_s + 60
        while reports < consumers + 1 and time.time() < end:
            try:
                kind, val, at, err = out.get(timeout=1.0)
            except Exception:  # queue.Empty: a child that died says nothing
                if not any(p.is_alive() for p in procs):
                    break
                continue
            if err:
                errors.append(err)
            reports += 1
            if kind == "put":
                put = val
            else:
                acked += val
                last = max(last, at)
    finally:
        with open(flag, "w"):
            pass
        for p in procs:
            if p.pid is None:
                continue
            p.join(30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(path, ignore_errors=True)
        os.unlink(flag)
    if errors:
        why = "; ".join(sorted({e.removeprefix(MISSING) for e in errors}))
        raise Missing(why) if all(e.startswith(MISSING) for e in errors) else RuntimeError(why)
    return {"put": put, "acked": acked, "seconds": max(last - t0, 1e-9)}


# ---------------------------------------------------------------- measurements

def measure(res: Results, workdir: str, system: str, procs: int, n: int, deadline_s: float) -> None:
    """One row: ``queue.<system>.p<procs>`` in msg/s (put + receive + ack), with its verification."""
    id = f"queue.{system}.p{procs}"
    label = f"{LABELS[system]}, {'1 process' if procs == 1 else '1 producer + 3 consumer processes'}"
    path = os.path.join(workdir, f"queue-{system}-p{procs}")
    try:
        r = run_solo(system, path, n, deadline_s) if procs == 1 else run_shared(system, path, n, deadline_s)
    except Missing as e:
        res.skip(id, system, label, "msg/s", str(e))
        return
    except RuntimeError as e:
        res.skip(id, system, label, "msg/s", f"failed: {e}", status="failed")
        return
    acked = r["acked"]
    if not acked:
        res.skip(id, system, label, "msg/s", f"nothing was acked within {deadline_s:.0f} s", status="failed")
        return
    distinct = set(acked)
    dup = len(acked) - len(distinct)
    missing = r["put"] - len(distinct & set(range(r["put"])))
    m = rate_measurement(id, system, label, len(distinct), r["seconds"], bytes_per_msg=1024, processes=procs,
                         messages=n, put=r["put"], acked=len(acked), duplicates=dup, missing=missing)
    if dup or missing:
        m.note = f"verification: {dup} acked twice, {missing} of {r['put']} never acked within the time limit"
    res.add(m)
