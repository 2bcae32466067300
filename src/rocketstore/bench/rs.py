"""rocketstore's own workloads: put (single, batched, threads, sync), consume, lookup."""

from __future__ import annotations

import os
import random
import resource
import shutil
import threading
from time import perf_counter
from contextlib import contextmanager
from typing import Iterator

from rocketstore.config import StoreConfig
from rocketstore.format.message import Message
from rocketstore.store import MessageStore

from .floors import make_body
from .harness import Measurement, Results, percentiles_us, rate_measurement, timed, timed_threads

TOPIC = "BenchTopic"
BATCH = 32


def key_of(i: int) -> str:
    return f"order-{i:09d}"


@contextmanager
def fresh_store(workdir: str, name: str, **cfg) -> Iterator[MessageStore]:
    path = os.path.join(workdir, name)
    shutil.rmtree(path, ignore_errors=True)
    store = MessageStore.open(path, StoreConfig(**cfg))
    try:
        yield store
    finally:
        store.close()
        shutil.rmtree(path, ignore_errors=True)


def _check(r) -> int:
    if not r.ok:
        raise RuntimeError(f"put failed: {r.status.value} {r.error or ''}")
    return r.msg_num


def put(res: Results, workdir: str, *, body_size: int, threads: int, flush: str, seconds: float,
        batch: int = 1) -> Measurement:
    """Single puts (batch=1) or put_batch of ``batch`` messages from ``threads`` producer threads.

    Each step builds its ``Message`` objects inside the timed loop, as a user's code does.  The clock starts
    after a warm-up (the first segment is made, the background services have started).  SYNC_FLUSH single
    puts also record every put's latency: p50/p99/p999 go with the figure, next to the disk's fdatasync.
    """
    body = make_body(body_size)
    kind = "put" if batch == 1 else f"batch{batch}"
    fl = "sync" if flush == "SYNC_FLUSH" else "async"
    id = f"rs.{kind}.{fl}.t{threads}.{body_size}"
    label = (f"put, {fl} flush, {threads} thread{'s' if threads > 1 else ''}, {body_size} B" if batch == 1 else
             f"put_batch({batch}), {fl} flush, {threads} thread{'s' if threads > 1 else ''}, {body_size} B")
    lat: list[float] = []
    with_latency = flush == "SYNC_FLUSH" and batch == 1
    with fresh_store(workdir, id, flushDiskType=flush) as store:
        def make_step(i: int):
            p = store.put
            if batch == 1 and with_latency:
                record = lat.append
                clock = perf_counter

                def step() -> int:
                    for _ in range(5):
                        t = clock()
                        r = p(Message(TOPIC, body, queue_id=i))
                        record(clock() - t)
                        _check(r)
                    return 5
            elif batch == 1:
                def step() -> int:
                    for _ in range(200):
                        r = p(Message(TOPIC, body, queue_id=i))
                    _check(r)
                    return 200
            else:
                chunk = 10 if flush == "ASYNC_FLUSH" else 1
                pb = store.put_batch

                def step() -> int:
                    for _ in range(chunk):
                        r = pb([Message(TOPIC, body, queue_id=i) for _ in range(batch)])
                    return _check(r) * chunk
            return step

        warm = min(0.5, seconds / 2)
        probe = _SyncProbe(store) if flush == "SYNC_FLUSH" else None

        def on_start() -> None:
            lat.clear()
            if probe is not None:
                probe.start()
        if threads == 1:
            n, elapsed = timed(make_step(0), seconds, warmup_seconds=warm, on_start=on_start)
        else:
            n, elapsed = timed_threads(make_step, threads, seconds, warmup_seconds=warm, on_start=on_start)
        diagnostics = probe.per_message(n) if probe is not None else {}
    if flush == "SYNC_FLUSH":
        ref = "floor.fdatasync" if threads == 1 else f"rs.{kind}.sync.t1.{body_size}"
    else:
        ref = f"floor.append.{body_size}" if threads == 1 else f"rs.{kind}.async.t1.{body_size}"
    m = rate_measurement(id, "rocketstore", label, n, elapsed, ref=ref, bytes_per_msg=body_size,
                         body_size=body_size, threads=threads, flush=flush, batch=batch)
    m.extra.update(percentiles_us(lat))
    m.extra.update(diagnostics)
    kept = res.add(m)
    if diagnostics:
        _note_sync_costs(res, kept)
    return kept


def _note_sync_costs(res: Results, m: Measurement) -> None:
    """One note per SYNC_FLUSH row, for the round the figure comes from (see Results.add)."""
    e = m.extra
    if "cpu_us_per_msg" not in e:
        return
    head = f"{m.id}: "
    res.notes[:] = [n for n in res.notes if not n.startswith(head)]
    res.notes.append(f"{head}{e['cpu_us_per_msg']:.1f} µs of CPU per put (all threads of the process, the kernel's "
                     f"share of each fdatasync included), {e['flushes_per_msg']:.2f} fdatasync and "
                     f"{e['writes_per_msg']:.2f} write rounds and {e['wakeups_per_msg']:.2f} producer wake-ups "
                     f"per put, {e['voluntary_switches_per_msg']:.2f} voluntary / "
                     f"{e['involuntary_switches_per_msg']:.2f} involuntary context switches per put (producers "
                     f"{e['producer_switches_per_msg'][0]:.2f} / {e['producer_switches_per_msg'][1]:.2f}, the "
                     f"store's services {e['service_switches_per_msg'][0]:.2f} / "
                     f"{e['service_switches_per_msg'][1]:.2f})")


class _SyncProbe:
    """What a SYNC_FLUSH put cost besides its wall time, over the timed window: the process's CPU and context
    switches (every thread: producers, the group commit service, the dispatcher) and the group commit's
    fdatasync calls, write rounds and producer wake-ups, per put: tells a row the disk decides from one the CPU
    and the GIL decide (CPU per put times the rate near one core's worth).

    The switches are also split by thread: the other threads alive when the probe is made (the store's services)
    against the rest (the producers, which start later, or the calling thread itself), so that a producer's
    switches beyond its one designed wake-up per put (the GIL taken back after it, a preemption by the thread it
    woke) show apart from the services' polls."""

    def __init__(self, store: MessageStore) -> None:
        self.commit = store.commit
        self.at: tuple[float, ...] | None = None
        me = threading.current_thread()  # the producer of a one-thread row; else it only waits for them
        self.services = [t.native_id for t in threading.enumerate() if t is not me and t.native_id is not None]

    def _services_switches(self) -> tuple[int, int]:
        vol = invol = 0
        for tid in self.services:
            try:
                with open(f"/proc/self/task/{tid}/status") as f:
                    for line in f:
                        if line.startswith("voluntary_ctxt_switches:"):
                            vol += int(line.split()[1])
                        elif line.startswith("nonvoluntary_ctxt_switches:"):
                            invol += int(line.split()[1])
            except (OSError, ValueError):
                continue  # a thread that ended (or no /proc): its switches count with the producers'
        return vol, invol

    def _now(self) -> tuple[float, ...]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        svol, sinvol = self._services_switches()
        return (ru.ru_utime + ru.ru_stime, ru.ru_nvcsw, ru.ru_nivcsw, self.commit.flushes, self.commit.rounds,
                self.commit.wakes, svol, sinvol)

    def start(self) -> None:
        self.at = self._now()

    def per_message(self, n: int) -> dict[str, float]:
        if self.at is None or n <= 0:
            return {}
        cpu, vol, invol, flushes, writes, wakes, svol, sinvol = (b - a for a, b in zip(self.at, self._now()))
        return {"cpu_us_per_msg": round(cpu / n * 1e6, 1), "flushes_per_msg": round(flushes / n, 3),
                "writes_per_msg": round(writes / n, 3), "wakeups_per_msg": round(wakes / n, 3),
                "voluntary_switches_per_msg": round(vol / n, 2),
                "involuntary_switches_per_msg": round(invol / n, 2),
                "producer_switches_per_msg": [round((vol - svol) / n, 2), round((invol - sinvol) / n, 2)],
                "service_switches_per_msg": [round(svol / n, 2), round(sinvol / n, 2)]}


class Dataset:
    """The same ``n`` messages (1 KiB bodies, unique keys) in a rocketstore store and in a SQLite table."""

    def __init__(self, workdir: str, n: int, body_size: int = 1024) -> None:
        self.n = n
        self.body_size = body_size
        self.store_path = os.path.join(workdir, "dataset-store")
        self.sqlite_path = os.path.join(workdir, "dataset.sqlite")
        self.store: MessageStore | None = None
        self.build_seconds: dict[str, float] = {}

    def build(self) -> None:
        import time
        from . import peers
        body = make_body(self.body_size)
        shutil.rmtree(self.store_path, ignore_errors=True)
        t0 = time.perf_counter()
        self.store = MessageStore.open(self.store_path, StoreConfig())
        for start in range(0, self.n, BATCH):
            msgs = [Message(TOPIC, body, keys=key_of(i)) for i in range(start, min(self.n, start + BATCH))]
            _check(self.store.put_batch(msgs))
        if not self.store.wait_dispatched(timeout=300):
            raise RuntimeError("dispatch did not catch up within 300 s")
        self.build_seconds["rocketstore"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        peers.sqlite_build_dataset(self.sqlite_path, self.n, body, key_of)
        self.build_seconds["sqlite"] = time.perf_counter() - t0

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


def consume(res: Results, ds: Dataset, seconds: float, per_call: int = 32) -> Measurement:
    store = ds.store
    assert store is not None
    n_total = ds.n
    state = [0]

    def step() -> int:
        off = state[0]
        got = 0
        for _ in range(20):
            if off >= n_total:
                off = 0
            r = store.get(TOPIC, 0, off, per_call)
            k = len(r.messages)
            if not k:
                raise RuntimeError(f"get at {off} returned {r.status.value}")
            got += k
            off = r.next_begin_offset
        state[0] = off
        return got

    n, elapsed = timed(step, seconds)
    return res.add(rate_measurement("rs.consume32", "rocketstore",
                                    f"consume through consume queue, {per_call} per call",
                                    n, elapsed, ref=f"floor.read.{ds.body_size}",
                                    bytes_per_msg=ds.body_size,
                                    messages=ds.n, per_call=per_call))


def lookup_keys(ds: Dataset, count: int) -> list[str]:
    rnd = random.Random(42)
    return [key_of(rnd.randrange(ds.n)) for _ in range(count)]


def lookup(res: Results, ds: Dataset, seconds: float, count: int) -> Measurement:
    store = ds.store
    assert store is not None
    keys = lookup_keys(ds, count)
    state = [0]

    def step() -> int:
        i = state[0]
        for _ in range(50):
            k = keys[i % len(keys)]
            r = store.query(TOPIC, k, 1)
            if len(r.messages) != 1 or r.messages[0].properties.get("KEYS") != k:
                raise RuntimeError(f"lookup of {k} found {len(r.messages)} messages")
            i += 1
        state[0] = i
        return 50

    n, elapsed = timed(step, seconds)
    return res.add(rate_measurement("rs.lookup", "rocketstore", "lookup by key (index), body read", n, elapsed,
                                    ref="sqlite.lookup", unit="lookups/s", messages=ds.n))
