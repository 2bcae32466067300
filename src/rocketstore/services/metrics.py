"""Live store metrics: put latency and lock-hold percentiles, flush and dispatch lag, disk usage.

The open store counts every put and times one in ``SAMPLE_EVERY`` into
fixed-size rings (no allocation on the put path; three clock reads and the
ring stores on every put were 8 % of a put's instructions), and a
MetricsService writes a snapshot to ``<store>/metrics.json`` every second, so ``rocketstore stats STORE --live`` can show another process's
store: when it says "busy", the numbers say whether the lock, the disk or the
dispatcher is the cause.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any, Callable

from .base import ServiceThread

if TYPE_CHECKING:
    from ..storage.files import StoreFiles
    from .clean import DiskGuard

RING = 8192  # a power of two: the slot of sample n is n & (RING - 1)
SAMPLE_EVERY = 16  # a power of two: put n is timed when n & (SAMPLE_EVERY - 1) == 0


class Ring:
    """The last RING samples (seconds)."""

    __slots__ = ("samples", "n")

    def __init__(self) -> None:
        self.samples = [0.0] * RING
        self.n = 0

    def percentiles(self) -> dict[str, float]:
        k = min(self.n, RING)
        if not k:
            return {"count": 0}
        vals = sorted(self.samples[:k])

        def pct(p: float) -> float:
            return round(vals[min(k - 1, int(p * k))] * 1000, 4)
        return {"count": self.n, "p50Ms": pct(0.5), "p90Ms": pct(0.9), "p99Ms": pct(0.99),
                "maxMs": round(vals[-1] * 1000, 4)}


class StoreMetrics:
    def __init__(self) -> None:
        self.put_latency = Ring()
        self.lock_hold = Ring()
        self.started = time.time()
        self.puts = 0  # every put call (counted without a lock: an increment lost to a race only shifts a sample)

    def record_put(self, lock_hold: float, latency: float) -> None:
        """One put's samples (one call on the put path rather than two)."""
        i = self.put_latency.n & (RING - 1)
        self.lock_hold.samples[i] = lock_hold
        self.put_latency.samples[i] = latency
        self.lock_hold.n += 1
        self.put_latency.n += 1


def snapshot(files: "StoreFiles", m: StoreMetrics, disk_guard: "DiskGuard", dispatch_behind_bytes: int
             ) -> dict[str, Any]:
    """What metrics.json holds: the put counters and latencies, flush and dispatch lag, the disk, the flags."""
    max_phy = files.max_phy_offset()
    return {
        "time": int(time.time() * 1000), "pid": os.getpid(), "pidStartTicks": process_start_ticks(os.getpid()),
        "uptimeSeconds": round(time.time() - m.started, 1),
        "puts": m.puts, "putLatency": m.put_latency.percentiles(), "lockHold": m.lock_hold.percentiles(),
        "maxPhyOffset": max_phy, "flushLagBytes": max(0, max_phy - files.commitlog.queue.flushed_where),
        "dispatchBehindBytes": dispatch_behind_bytes, "disk": disk_guard.to_json(),
        "writeable": files.running_flags.is_writeable(), "notWriteableReason": files.running_flags.why_not_writeable(),
        "indexError": files.index_service.build_error,
    }


def metrics_path(root: str) -> str:
    return os.path.join(root, "metrics.json")


class MetricsService(ServiceThread):
    """Writes the snapshot every second (temp file + rename; no fsync: it is only a view)."""

    name = "MetricsService"

    def __init__(self, root: str, take_snapshot: Callable[[], dict[str, Any]]) -> None:
        super().__init__(interval=1.0)
        self.root = root
        self.take_snapshot = take_snapshot

    def run_once(self) -> None:
        path = metrics_path(self.root)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(self.take_snapshot(), fh)
        os.replace(tmp, path)

    def on_shutdown(self) -> None:
        try:
            os.unlink(metrics_path(self.root))
        except FileNotFoundError:
            pass


def process_start_ticks(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (/proc/PID/stat field 22); None if unknown.

    With the pid it names one process: a pid reused by a later process has another start time."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def writer_gone(m: dict[str, Any]) -> str | None:
    """Why the process that wrote these metrics no longer has the store open, or None while it runs."""
    pid = m.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return "metrics.json names no process"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"metrics.json was written by process {pid}, which is no longer running"
    except PermissionError:
        pass  # alive, under another user
    started = m.get("pidStartTicks")
    if started is not None and process_start_ticks(pid) not in (None, started):
        return f"metrics.json was written by process {pid}, which has ended (the pid now names another process)"
    return None


def _read(root: str) -> dict[str, Any] | None:
    try:
        with open(metrics_path(root), encoding="utf-8") as fh:
            m = json.load(fh)
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) else None


def read_metrics(root: str) -> dict[str, Any] | None:
    """The metrics of the process that has the store open; None when none does (no file, or its writer died)."""
    m = _read(root)
    return m if m is not None and writer_gone(m) is None else None


def not_live_reason(root: str) -> str:
    """What to tell a user for whom :func:`read_metrics` found nothing."""
    m = _read(root)
    why = "is the store open in a running process?" if m is None else writer_gone(m)
    return f"no live metrics ({why})"
