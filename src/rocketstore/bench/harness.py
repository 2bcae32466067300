"""Shared pieces of the suite: run modes, the result book, timing loops and machine facts."""

from __future__ import annotations

import gc
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

log = logging.getLogger("rocketstore.bench")

KiB = 1024
MiB = 1024 * 1024
GiB = 1024 * MiB


@dataclass(frozen=True)
class Mode:
    """How much work each measurement does; only sizes and durations differ between modes."""

    name: str
    seconds: float  # wall time of one throughput measurement
    sizes: tuple[int, ...]  # body sizes of the put workloads
    dataset_msgs: int  # messages in the consume / lookup data set
    lookups: int  # distinct random keys looked up (repeated until `seconds`)
    recovery_bytes: int  # commitlog size written then recovered abnormally
    memory_bytes: int  # bytes written while memory is sampled
    spark: bool  # run the Spark scan (a JVM start costs ~10 s)
    broker: bool  # run the gRPC broker client benchmark
    install_redis: bool  # apt-get install redis-server when missing
    broker_messages: int = 20000
    raw_write_bytes: int = 512 * MiB
    rounds: int = 1  # throughput measurements are repeated this many times, interleaved; the best counts
    queue_messages: int = 10000  # messages put, received and acked by each queue workload (bench/queues.py)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


MODES: dict[str, Mode] = {
    "smoke": Mode("smoke", seconds=0.03, sizes=(128, 1024, 4096), dataset_msgs=2000, lookups=200,
                  recovery_bytes=8 * MiB, memory_bytes=16 * MiB, spark=False, broker=False, install_redis=False,
                  broker_messages=500, raw_write_bytes=16 * MiB, queue_messages=64),
    "quick": Mode("quick", seconds=0.4, sizes=(128, 1024, 4096), dataset_msgs=50000, lookups=5000,
                  recovery_bytes=256 * MiB, memory_bytes=1 * GiB, spark=True, broker=True, install_redis=True,
                  broker_messages=2000, raw_write_bytes=256 * MiB, rounds=2, queue_messages=3000),
    "full": Mode("full", seconds=1.0, sizes=(128, 1024, 4096), dataset_msgs=200000, lookups=20000,
                 recovery_bytes=1 * GiB, memory_bytes=4 * GiB, spark=True, broker=True, install_redis=True,
                 broker_messages=8000, raw_write_bytes=1 * GiB, rounds=3),
}


@dataclass
class Measurement:
    """One figure.  ``ref`` names the measurement (peer or limit) it is shown as a ratio to."""

    id: str
    system: str  # rocketstore, sqlite, persist-queue, ..., limit
    label: str
    value: float | None  # None when skipped or failed
    unit: str  # msg/s, MB/s, MB, s, ...
    n: int = 0  # operations done (messages, lookups, bytes...)
    seconds: float = 0.0
    ref: str | None = None
    bytes_per_msg: int | None = None
    params: dict[str, Any] = field(default_factory=dict)
    note: str | None = None
    status: str = "ok"  # ok | skipped | failed
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def mb_per_s(self) -> float | None:
        if self.value is None or self.unit != "msg/s" or not self.bytes_per_msg:
            return None
        return self.value * self.bytes_per_msg / 1e6

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["mb_per_s"] = self.mb_per_s
        return d


class Results:
    """Every measurement of one run, by id, in the order taken."""

    def __init__(self) -> None:
        self.items: dict[str, Measurement] = {}
        self.notes: list[str] = []
        self.series: dict[str, Any] = {}  # time series for plots (memory samples)
        self.profiles: dict[str, str] = {}

    def add(self, m: Measurement) -> Measurement:
        """Record ``m``; a repeated measurement keeps its best round (highest rate) and lists every round."""
        try:
            m.extra.setdefault("load1", round(os.getloadavg()[0], 2))
        except OSError:
            pass
        old = self.items.get(m.id)
        if old is not None and old.status == "ok":
            rounds = old.extra.get("rounds", [old.value])
            if m.status == "ok" and m.value is not None:
                rounds = rounds + [m.value]
                if old.value is None or m.value > old.value:
                    m.extra["rounds"] = rounds
                    self.items[m.id] = m
                    return m
            old.extra["rounds"] = rounds
            return old
        if m.status == "ok":
            m.extra.setdefault("rounds", [m.value])
        self.items[m.id] = m
        if m.status == "ok":
            log.info("%-34s %14s %s", m.id, _fmt(m.value), m.unit)
        else:
            log.info("%-34s %s: %s", m.id, m.status, m.note)
        return m

    def skip(self, id: str, system: str, label: str, unit: str, note: str, status: str = "skipped",
             **kw: Any) -> Measurement:
        return self.add(Measurement(id, system, label, None, unit, note=note, status=status, **kw))

    def get(self, id: str) -> Measurement | None:
        return self.items.get(id)

    def value(self, id: str) -> float | None:
        m = self.items.get(id)
        return m.value if m is not None and m.status == "ok" else None

    def ratio(self, m: Measurement) -> float | None:
        if m.ref is None or m.value is None:
            return None
        r = self.value(m.ref)
        return m.value / r if r else None

    def note(self, text: str) -> None:
        log.warning("%s", text)
        self.notes.append(text)


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.3g}"


# ---------------------------------------------------------------- timing

def timed(step: Callable[[], int], seconds: float, *, warmup: int = 1, warmup_seconds: float = 0.0,
          on_start: Callable[[], None] | None = None) -> tuple[int, float]:
    """Call ``step`` (which does a chunk of work and returns how many operations) until ``seconds`` pass.

    ``warmup`` chunks run first, and more until ``warmup_seconds`` have passed; they are not counted.
    ``on_start`` is called just before the clock starts (to drop what the warm-up recorded).
    Returns (operations, elapsed seconds).
    """
    _warm_up(step, warmup, warmup_seconds)
    gc.collect()
    if on_start is not None:
        on_start()
    n = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    now = t0
    while True:
        n += step()
        now = time.perf_counter()
        if now >= deadline:
            break
    return n, now - t0


def _warm_up(step: Callable[[], int], chunks: int, seconds: float) -> None:
    t0 = time.perf_counter()
    done = 0
    while done < chunks or time.perf_counter() - t0 < seconds:
        step()
        done += 1


def timed_threads(make_step: Callable[[int], Callable[[], int]], threads: int, seconds: float,
                  *, warmup: int = 1, warmup_seconds: float = 0.0,
                  on_start: Callable[[], None] | None = None) -> tuple[int, float]:
    """``threads`` threads, each calling its own step until a shared deadline; total operations and wall time.
    The warm-up (see :func:`timed`) runs each step in turn, from this thread."""
    steps = [make_step(i) for i in range(threads)]
    for s in steps:
        _warm_up(s, warmup, warmup_seconds / threads)
    gc.collect()
    if on_start is not None:
        on_start()
    counts = [0] * threads
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)
    deadline = [0.0]

    def run(i: int) -> None:
        step = steps[i]
        try:
            start.wait()
            n = 0
            while time.perf_counter() < deadline[0]:
                n += step()
            counts[i] = n
        except BaseException as e:  # reported by the caller
            errors.append(e)

    ts = [threading.Thread(target=run, args=(i,), name=f"bench-producer-{i}") for i in range(threads)]
    for t in ts:
        t.start()
    t0 = time.perf_counter()
    deadline[0] = t0 + seconds
    start.wait()
    for t in ts:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return sum(counts), elapsed


def percentiles_us(latencies: list[float]) -> dict[str, float]:
    """p50/p99/p999 of latencies in seconds, in microseconds (nearest rank), with the sample count."""
    if not latencies:
        return {}
    xs = sorted(latencies)
    n = len(xs)

    def at(q: float) -> float:
        return round(xs[min(n - 1, max(0, int(q * n + 0.5) - 1))] * 1e6, 1)

    return {"p50_us": at(0.50), "p99_us": at(0.99), "p999_us": at(0.999), "latency_samples": n}


def rate_measurement(id: str, system: str, label: str, n: int, elapsed: float, *, ref: str | None = None,
                     bytes_per_msg: int | None = None, unit: str = "msg/s", **params: Any) -> Measurement:
    return Measurement(id, system, label, n / elapsed if elapsed > 0 else None, unit, n=n, seconds=elapsed,
                       ref=ref, bytes_per_msg=bytes_per_msg, params=params)


# ---------------------------------------------------------------- machine facts

def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def meminfo_kib(key: str) -> int | None:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return None


def filesystem_of(path: str) -> dict[str, str]:
    """The mount (device, mount point, type) that holds ``path``."""
    real = os.path.realpath(path)
    best = ("", "", "")
    for line in _read("/proc/mounts").splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        dev, mnt, typ = parts[0], parts[1].replace("\\040", " "), parts[2]
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
            best = (dev, mnt, typ)
    return {"device": best[0], "mount": best[1], "type": best[2]}


def machine_info(workdir: str) -> dict[str, Any]:
    try:
        uname_a = subprocess.run(["uname", "-a"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        uname_a = " ".join(platform.uname())
    cpu = ""
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    try:
        nproc = len(os.sched_getaffinity(0))
    except AttributeError:
        nproc = os.cpu_count() or 0
    mem = meminfo_kib("MemTotal")
    disk = shutil.disk_usage(workdir)
    import sqlite3
    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "uname": uname_a,
        "nproc": nproc,
        "cpu": cpu,
        "memory_gib": round(mem / 1024 / 1024, 1) if mem else None,
        "python": sys.version.split()[0],
        "sqlite": sqlite3.sqlite_version,
        "workdir_fs": filesystem_of(workdir),
        "workdir_free_gib": round(disk.free / GiB, 1),
        "versions": package_versions(),
    }
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                            timeout=5, cwd=os.path.dirname(__file__)).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], capture_output=True, text=True,
                               timeout=5, cwd=os.path.dirname(os.path.dirname(__file__))).stdout.strip()
        info["git_dirty_files"] = len(dirty.splitlines()) if dirty else 0
    except (OSError, subprocess.SubprocessError):
        info["git_commit"] = None
    return info


def package_versions() -> dict[str, str | None]:
    from importlib import metadata
    out: dict[str, str | None] = {}
    for name in ("rocketstore", "persist-queue", "diskcache", "litequeue", "redis", "pyspark", "pyarrow",
                 "matplotlib", "pyinstrument"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def on_tmpfs(path: str) -> bool:
    return filesystem_of(path)["type"] in ("tmpfs", "ramfs")
