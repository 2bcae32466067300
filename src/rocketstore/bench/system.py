"""Whole-process workloads: abnormal recovery, memory while writing, the Spark scan, the broker client."""

from __future__ import annotations

import json
import logging
import mmap
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from .floors import crc32_speed
from .harness import MiB, Measurement, Mode, Results

log = logging.getLogger("rocketstore.bench")


def _child(*args: str) -> list[str]:
    return [sys.executable, "-m", "rocketstore.bench.child", *args]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    """One line of the child's stdout, or '' if it exits or the timeout passes first."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    buf = b""
    fd = proc.stdout.fileno()
    while time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 0.5)
        if r:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
            if b"\n" in buf:
                return buf.split(b"\n", 1)[0].decode()
        elif proc.poll() is not None:
            break
    return buf.decode(errors="replace")


# ---------------------------------------------------------------- recovery

def recovery(res: Results, workdir: str, mode: Mode) -> str | None:
    """Fill a commitlog segment of ``mode.recovery_bytes``, SIGKILL the writer, time the recovering open.

    Returns the recovered store's path (cleanly closed: the Spark scan reads it), or None.
    """
    seg = mode.recovery_bytes
    path = os.path.join(workdir, "recovery-store")
    shutil.rmtree(path, ignore_errors=True)
    limit = seg - max(2 * MiB, seg // 64)
    label = f"abnormal recovery of a {seg // MiB} MiB commitlog (CRC checked, re-dispatch)"
    proc = subprocess.Popen(_child("write-crash", path, str(limit), str(seg)), stdout=subprocess.PIPE,
                            env=_env())
    try:
        line = _read_line(proc, 1800)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        if proc.stdout:
            proc.stdout.close()
    if not line.startswith("READY "):
        res.skip("rs.recovery", "rocketstore", label, "MB/s", f"writer failed: {line[-300:]!r}", status="failed")
        return None
    wrote = json.loads(line[6:])
    if not os.path.exists(os.path.join(path, "abort")):
        res.skip("rs.recovery", "rocketstore", label, "MB/s", "no abort file after SIGKILL", status="failed")
        return None
    out = subprocess.run(_child("recover", path, str(seg)), capture_output=True, text=True, timeout=3600, env=_env())
    done = next((ln for ln in out.stdout.splitlines() if ln.startswith("DONE ")), None)
    if out.returncode != 0 or done is None:
        res.skip("rs.recovery", "rocketstore", label, "MB/s", f"recovery failed: {out.stderr[-300:]!r}",
                 status="failed")
        return None
    info = json.loads(done[5:])
    rep = info["report"] or {}
    nbytes = rep.get("bytesChecked") or info["max_offset"]
    # The limit: zlib.crc32 over the same bytes of the same file (page cache warm for both).
    crc_s = _crc32_file(os.path.join(path, "commitlog", f"{0:020d}"), nbytes)
    res.add(Measurement("crc32.recovery", "limit", "zlib.crc32 over the same commitlog bytes (1 MiB chunks)",
                        nbytes / crc_s / 1e6, "MB/s", n=nbytes, seconds=crc_s))
    m = Measurement("rs.recovery", "rocketstore", label, nbytes / info["open_seconds"] / 1e6, "MB/s", n=nbytes,
                    seconds=info["open_seconds"], ref="crc32.recovery",
                    params={"segment_bytes": seg, "records": rep.get("recordsChecked"),
                            "abnormal": rep.get("abnormal")},
                    extra={"report": rep, "writer": wrote, "close_seconds": info.get("close_seconds")})
    if not rep.get("abnormal"):
        m.note = "the store did not see an unclean shutdown"
    res.add(m)
    return path


def _crc32_file(path: str, nbytes: int) -> float:
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            best = None
            for _ in range(3):  # the first pass may fault pages in; the best pass counts
                secs, _ = crc32_speed(memoryview(mm)[:nbytes])
                best = secs if best is None else min(best, secs)
            return best or 1e-9
        finally:
            mm.close()


# ---------------------------------------------------------------- memory

def _status_kib(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                k, _, v = line.partition(":")
                if k in ("RssAnon", "RssFile", "RssShmem", "VmHWM", "VmRSS"):
                    out[k] = int(v.split()[0])
    except OSError:
        pass
    return out


def memory(res: Results, workdir: str, mode: Mode) -> None:
    """Write ``mode.memory_bytes`` in a child process; sample its private (anonymous) RSS every 100 ms."""
    path = os.path.join(workdir, "memory-store")
    shutil.rmtree(path, ignore_errors=True)
    nbytes = mode.memory_bytes
    label = f"private (anonymous) memory while writing {nbytes / 2**30:g} GiB"
    proc = subprocess.Popen(_child("memory", path, str(nbytes)), stdout=subprocess.PIPE, env=_env())
    samples: list[tuple[float, float, float]] = []
    t0 = time.monotonic()
    try:
        while proc.poll() is None:
            st = _status_kib(proc.pid)
            if st:
                samples.append((time.monotonic() - t0, st.get("RssAnon", 0) / 1000, st.get("RssFile", 0) / 1000))
            time.sleep(0.1)
            if time.monotonic() - t0 > 3600:
                proc.kill()
        stdout = proc.stdout.read().decode() if proc.stdout else ""
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout:
            proc.stdout.close()
        shutil.rmtree(path, ignore_errors=True)
    done = next((ln for ln in stdout.splitlines() if ln.startswith("DONE ")), None)
    if proc.returncode != 0 or done is None or not samples:
        res.skip("rs.memory", "rocketstore", label, "MB", f"writer failed (exit {proc.returncode})", status="failed")
        return
    info = json.loads(done[5:])
    peak = max(s[1] for s in samples)
    res.series["memory"] = {"t": [round(s[0], 2) for s in samples], "anon_mb": [round(s[1], 1) for s in samples],
                            "file_mb": [round(s[2], 1) for s in samples]}
    res.add(Measurement("rs.memory", "rocketstore", label, peak, "MB", n=info["messages"], seconds=info["seconds"],
                        params={"bytes": nbytes, "body_size": 1024},
                        extra={"peak_rss_file_mb": max(s[2] for s in samples), "samples": len(samples),
                               "write_msg_per_s": info["messages"] / info["seconds"]}))


# ---------------------------------------------------------------- Spark and broker (other packages)

def _pick_rate(d: dict[str, Any], *words: str) -> tuple[str, float] | None:
    """A rate in a plugin's result dict: a key naming all ``words`` and a per-second unit, else rows / seconds."""
    flat = _flatten(d)
    for k, v in flat.items():
        lk = k.lower()
        if isinstance(v, (int, float)) and all(w in lk for w in words) and \
                any(u in lk for u in ("per_s", "per_sec", "_ps", "rate", "throughput")):
            return k, float(v)
    def find(units: tuple[str, ...]) -> float | None:
        return next((v for k, v in flat.items() if all(w in k.lower() for w in words)
                     and any(u in k.lower() for u in units) and isinstance(v, (int, float))), None)
    rows = find(("rows", "messages", "msgs", "count"))
    secs = find(("seconds", "secs", "elapsed", "time_s"))
    if rows and secs:
        return "/".join(words) + " rows/seconds", rows / secs
    return None


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def spark_scan(res: Results, workdir: str, store_path: str | None, mode: Mode) -> None:
    label = "Spark body-less scan, local[2]"
    plabel = "Spark reading the same messages exported to Parquet, local[2]"
    if not mode.spark:
        res.skip("spark.scan", "rocketstore", label, "rows/s", f"not run in {mode.name} mode")
        res.skip("parquet.scan", "spark-parquet", plabel, "rows/s", f"not run in {mode.name} mode")
        return
    if store_path is None:
        res.skip("spark.scan", "rocketstore", label, "rows/s", "no store to scan (the recovery workload failed)",
                 status="failed")
        return
    try:
        from rocketstore.spark.bench import bench_spark_scan  # type: ignore[import-not-found]
    except ImportError as e:
        res.skip("spark.scan", "rocketstore", label, "rows/s",
                 f"rocketstore.spark.bench is not importable yet ({e})")
        res.skip("parquet.scan", "spark-parquet", plabel, "rows/s", "skipped with the rocketstore scan")
        return
    sdir = os.path.join(workdir, "spark")
    os.makedirs(sdir, exist_ok=True)
    t0 = time.perf_counter()
    try:
        d = bench_spark_scan(store_path, sdir)
    except Exception as e:  # another team's code: report, never abort the suite
        log.exception("bench_spark_scan failed")
        res.skip("spark.scan", "rocketstore", label, "rows/s", f"bench_spark_scan failed: {e}", status="failed")
        return
    wall = time.perf_counter() - t0
    res.series["spark"] = d
    rs = _pick_rate(d, "rocketstore") or _pick_rate(d, "scan")
    pq = _pick_rate(d, "parquet")
    if rs is None:
        res.skip("spark.scan", "rocketstore", label, "rows/s", f"no rate in bench_spark_scan's result: {sorted(d)}",
                 status="failed")
    else:
        res.add(Measurement("spark.scan", "rocketstore", label, rs[1], "rows/s", seconds=wall, ref="parquet.scan",
                            extra={"source_key": rs[0], "result": d}))
    if pq is None:
        res.skip("parquet.scan", "spark-parquet", plabel, "rows/s",
                 "bench_spark_scan reported no Parquet figure", status="failed")
    else:
        res.add(Measurement("parquet.scan", "spark-parquet", plabel, pq[1], "rows/s", extra={"source_key": pq[0]}))


def broker_client(res: Results, workdir: str, mode: Mode) -> None:
    label = "gRPC broker, Python client producers (4)"
    if not mode.broker:
        res.skip("broker.client", "rocketstore", label, "msg/s", f"not run in {mode.name} mode")
        return
    try:
        from rocketstore.broker.bench import bench_client_throughput  # type: ignore[import-not-found]
    except ImportError as e:
        res.skip("broker.client", "rocketstore", label, "msg/s",
                 f"rocketstore.broker.bench is not importable yet ({e})")
        return
    bdir = os.path.join(workdir, "broker")
    os.makedirs(bdir, exist_ok=True)
    t0 = time.perf_counter()
    try:
        d = bench_client_throughput(bdir, mode.broker_messages, producers=4)
    except Exception as e:
        log.exception("bench_client_throughput failed")
        res.skip("broker.client", "rocketstore", label, "msg/s", f"bench_client_throughput failed: {e}",
                 status="failed")
        return
    wall = time.perf_counter() - t0
    r = _pick_rate(d, "") if d else None
    res.series["broker"] = d
    if r is None:
        res.skip("broker.client", "rocketstore", label, "msg/s", f"no rate in the result: {sorted(d or {})}",
                 status="failed")
        return
    res.add(Measurement("broker.client", "rocketstore", label, r[1], "msg/s", n=mode.broker_messages, seconds=wall,
                        ref="rs.put.async.t4.1024", extra={"source_key": r[0], "result": d}))
