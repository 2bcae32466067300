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
from pathlib import Path

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
    # Each round recovers the same crash: the abort marks the kill left are put back on the recovered store
    # (same bytes, consume queues and index), so the best of the rounds counts, as for every throughput figure.
    marks = {n: Path(path, n).read_bytes() for n in ("abort", "abort.bootid") if Path(path, n).exists()}
    runs = []
    for r in range(max(1, mode.rounds)):
        if r:
            for n, data in marks.items():
                Path(path, n).write_bytes(data)
        out = subprocess.run(_child("recover", path, str(seg)), capture_output=True, text=True, timeout=3600,
                             env=_env())
        done = next((ln for ln in out.stdout.splitlines() if ln.startswith("DONE ")), None)
        if out.returncode != 0 or done is None:
            res.skip("rs.recovery", "rocketstore", label, "MB/s", f"recovery failed: {out.stderr[-300:]!r}",
                     status="failed")
            return None
        runs.append(json.loads(done[5:]))
    info = min(runs, key=lambda i: i["open_seconds"])
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
                    extra={"report": rep, "writer": wrote, "close_seconds": info.get("close_seconds"),
                           "first_report": runs[0]["report"],
                           "rounds": [nbytes / i["open_seconds"] / 1e6 for i in runs]})
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


# ---------------------------------------------------------------- Spark and broker

def spark_scan(res: Results, workdir: str, store_path: str | None, mode: Mode) -> None:
    """rocketstore's Spark scan (bodies left out) against Spark over the same rows exported to Parquet,
    measured by :func:`rocketstore.bench.spark_scan.bench_spark_scan` in a process of its own."""
    label = "Spark body-less scan, local[2] (rocketstore data source)"
    plabel = "Spark reading the same rows exported to Parquet, local[2]"

    def skip(note: str, status: str = "skipped") -> None:
        for id, sys_, lab in (("spark.scan", "rocketstore", label), ("parquet.scan", "spark-parquet", plabel),
                              ("spark.write", "rocketstore", "Spark append to a new store, local[2]"),
                              ("parquet.write", "spark-parquet", "Spark writing the same rows as Parquet")):
            res.skip(id, sys_, lab, "rows/s", note, status=status)

    if not mode.spark:
        return skip(f"not run in {mode.name} mode")
    if store_path is None:
        return skip("no store to scan (the recovery workload failed)", "failed")
    import importlib.util
    if importlib.util.find_spec("pyspark") is None:
        return skip("pyspark is not installed")
    sdir = os.path.join(workdir, "spark")
    os.makedirs(sdir, exist_ok=True)
    repeats = 3 if mode.name == "full" else 1
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "rocketstore.bench.spark_job", store_path, sdir, str(repeats)],
                         capture_output=True, text=True, timeout=1800, env=_env())
    wall = time.perf_counter() - t0
    done = next((ln for ln in out.stdout.splitlines() if ln.startswith("DONE ")), None)
    if out.returncode != 0 or done is None:
        err = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return skip(f"Spark job failed: {err[-300:]}", "failed")
    d = json.loads(done[5:])
    res.series["spark"] = d
    best = {k: min(r["seconds"] for r in runs) for k, runs in d["runs"].items()}
    res.add(Measurement("spark.scan", "rocketstore", label, d["rocketstoreRowsPerSec"], "rows/s", n=d["rows"],
                        seconds=best["rocketstore"], ref="parquet.scan", params={"repeats": repeats},
                        extra={"cpuRatio": d.get("cpuRatio"), "job_wall_seconds": wall}))
    res.add(Measurement("parquet.scan", "spark-parquet", plabel, d["parquetRowsPerSec"], "rows/s", n=d["rows"],
                        seconds=best["parquet"], extra={"export_seconds": d["exportSeconds"]}))
    w = d["write"]
    res.add(Measurement("spark.write", "rocketstore", "Spark append of the exported rows to a new store, local[2]",
                        w["rocketstoreRowsPerSec"], "rows/s", n=w["rows"], seconds=min(w["runs"]["rocketstore"]),
                        ref="parquet.write", params={"repeats": repeats}))
    res.add(Measurement("parquet.write", "spark-parquet", "Spark writing the same rows as Parquet, local[2]",
                        w["parquetRowsPerSec"], "rows/s", n=w["rows"], seconds=min(w["runs"]["parquet"])))


def broker_client(res: Results, workdir: str, mode: Mode) -> None:
    """The gRPC broker with the official Python client, then the bare reference server (grpc.aio answering the
    same RPCs from memory) under the same load (:func:`rocketstore.bench.broker_client.bench_vs_bare`)."""
    labels = {"produce": "gRPC broker: official Python client producers (4 processes), send_async",
              "consume": "gRPC broker: official Python client SimpleConsumers (4 processes), receive 32 + ack"}
    bare_labels = {"produce": "bare grpc.aio server, same RPCs answered from memory: producers (4), send_async",
                   "consume": "bare grpc.aio server, same RPCs answered from memory: consumers (4), receive 32 + ack"}
    cpu_labels = {"produce": "server CPU (user + sys) per message sent",
                  "consume": "server CPU (user + sys) per message received and acked"}
    refs = {"produce": "rs.put.async.t4.1024", "consume": "rs.consume32"}
    cpu_ids = {"produce": "send", "consume": "receive"}

    def skip_all(note: str, status: str = "skipped") -> None:
        for k in labels:
            res.skip(f"broker.{k}", "rocketstore", labels[k], "msg/s", note, status=status)
            res.skip(f"bare.{k}", "grpc-bare", bare_labels[k], "msg/s", note, status=status)
            res.skip(f"broker.{cpu_ids[k]}.cpu", "rocketstore", f"gRPC broker: {cpu_labels[k]}", "us/msg", note,
                     status=status)
            res.skip(f"bare.{cpu_ids[k]}.cpu", "grpc-bare", f"bare grpc.aio server: {cpu_labels[k]}", "us/msg", note,
                     status=status)

    if not mode.broker:
        return skip_all(f"not run in {mode.name} mode")
    try:
        from rocketstore.bench.broker_client import bench_vs_bare
    except ImportError as e:
        return skip_all(f"rocketstore.bench.broker_client is not importable ({e})")
    bdir = os.path.join(workdir, "broker")
    os.makedirs(bdir, exist_ok=True)
    t0 = time.perf_counter()
    try:
        d = bench_vs_bare(bdir, mode.broker_messages, producers=4, consumers=4, rounds=max(1, mode.rounds))
    except Exception as e:
        log.exception("bench_vs_bare failed")
        return skip_all(f"bench_vs_bare failed: {e}", "failed")
    wall = time.perf_counter() - t0
    res.series["broker"] = d
    for k in labels:
        for srv, id, sys_, lab, ref in (("broker", f"broker.{k}", "rocketstore", labels[k], refs[k]),
                                        ("bare", f"bare.{k}", "grpc-bare", bare_labels[k], None)):
            r = d[srv]
            res.add(Measurement(id, sys_, lab, r[f"{k}_msgs_per_s"], "msg/s", n=r[f"{k}d"],
                                seconds=r[f"{k}_seconds"], ref=ref, bytes_per_msg=1024,
                                extra={"job_wall_seconds": wall,
                                       "server_cpu_us_per_msg": r[f"{k}_server_cpu_us_per_msg"]}))
        # CPU per message: the lowest round of each server (as the rates take the best round); every round
        # and each round's broker / bare ratio are kept
        for srv, sys_, what in (("broker", "rocketstore", "gRPC broker"), ("bare", "grpc-bare",
                                                                            "bare grpc.aio server")):
            r = d[srv]
            id = f"{srv}.{cpu_ids[k]}.cpu"
            cpu = r[f"{k}_server_cpu_us_per_msg"]
            if cpu is None:
                res.skip(id, sys_, f"{what}: {cpu_labels[k]}", "us/msg", "no CPU figure (not Linux?)")
                continue
            res.add(Measurement(id, sys_, f"{what}: {cpu_labels[k]}", cpu, "us/msg", n=r[f"{k}d"],
                                seconds=r[f"{k}_seconds"],
                                ref=f"bare.{cpu_ids[k]}.cpu" if srv == "broker" else None,
                                extra={"cpu_rounds": r[f"{k}_cpu_rounds"], "cpu_median": r[f"{k}_cpu_median"],
                                       "ratio_rounds": d[f"ratio_{k}_cpu_rounds"] if srv == "broker" else None}))
