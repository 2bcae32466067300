"""Profiles of the workloads whose targets were missed (``rocketstore bench --profile``).

Each workload runs in a child process: it sets up (a store, a data set, a
crashed store), prints READY and waits; the parent then attaches py-spy to it
(all threads, so group commit and the dispatcher show too) and lets it run.
Without py-spy the child profiles its own main thread with pyinstrument.  The
summary (self and inclusive samples per function, top stacks) is written to
``<stem>-profile-<workload>.txt`` beside the results.

``python -m rocketstore.bench.profiling WORKLOAD WORKDIR SECONDS [PYINSTRUMENT_OUT]`` is the child.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

from .harness import MiB, Mode, Results

log = logging.getLogger("rocketstore.bench")

PROFILES = ("put", "batch", "sync", "sync16", "consume", "lookup", "recovery")


def find_py_spy() -> str | None:
    cand = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return cand if os.access(cand, os.X_OK) else shutil.which("py-spy")


# ---------------------------------------------------------------- child side

def _setup(workload: str, workdir: str) -> Callable[[float], int]:
    """Prepare ``workload``; return a function that runs it for some seconds and returns the operations done."""
    from rocketstore.config import StoreConfig
    from rocketstore.format.message import Message
    from rocketstore.store import MessageStore

    from . import rs
    from .floors import make_body

    body = make_body(1024)
    if workload in ("put", "batch", "sync", "sync16"):
        flush = "SYNC_FLUSH" if workload.startswith("sync") else "ASYNC_FLUSH"
        store = MessageStore.open(os.path.join(workdir, "profile-store"), StoreConfig(flushDiskType=flush))
        if workload == "batch":  # (Message objects built in the loop, as the bench's put rows do)
            def run(seconds: float) -> int:
                n, end = 0, time.perf_counter() + seconds
                while time.perf_counter() < end:
                    for _ in range(10):
                        store.put_batch([Message(rs.TOPIC, body) for _ in range(rs.BATCH)])
                    n += 10 * rs.BATCH
                store.close()
                return n
            return run
        threads = 16 if workload == "sync16" else 1

        def run(seconds: float) -> int:
            counts = [0] * threads
            end = time.perf_counter() + seconds

            def producer(i: int) -> None:
                while time.perf_counter() < end:
                    for _ in range(20):
                        store.put(Message(rs.TOPIC, body, queue_id=i))
                    counts[i] += 20
            if threads == 1:
                producer(0)
            else:
                ts = [threading.Thread(target=producer, args=(i,)) for i in range(threads)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
            store.close()
            return sum(counts)
        return run
    if workload in ("consume", "lookup"):
        ds = rs.Dataset(workdir, 50000)
        ds.build()
        store = ds.store
        assert store is not None
        if workload == "consume":
            def run(seconds: float) -> int:
                n, off, end = 0, 0, time.perf_counter() + seconds
                while time.perf_counter() < end:
                    for _ in range(50):
                        if off >= ds.n:
                            off = 0
                        r = store.get(rs.TOPIC, 0, off, 32)
                        n += len(r.messages)
                        off = r.next_begin_offset
                ds.close()
                return n
            return run
        keys = rs.lookup_keys(ds, 5000)

        def run(seconds: float) -> int:
            n, end = 0, time.perf_counter() + seconds
            while time.perf_counter() < end:
                for _ in range(50):
                    store.query(rs.TOPIC, keys[n % len(keys)], 1)
                    n += 1
            ds.close()
            return n
        return run
    if workload == "recovery":
        seg = 256 * MiB
        path = os.path.join(workdir, "profile-recovery")
        if not write_crashed_store(path, seg):
            raise SystemExit("the crashed store could not be written")

        def run(seconds: float) -> int:
            store = MessageStore.open(path, StoreConfig(mappedFileSizeCommitLog=seg))
            n = store.recovery_report.records_checked if store.recovery_report else 0
            store.close()
            return n
        return run
    raise SystemExit(f"unknown profile workload {workload!r}")


def child_main(argv: list[str]) -> None:
    workload, workdir, seconds = argv[0], argv[1], float(argv[2])
    pyinstrument_out = argv[3] if len(argv) > 3 else None
    run = _setup(workload, workdir)
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    sys.stdin.readline()
    if pyinstrument_out:
        from pyinstrument import Profiler
        prof = Profiler(interval=0.0005)
        prof.start()
        n = run(seconds)
        prof.stop()
        with open(pyinstrument_out, "w", encoding="utf-8") as fh:
            fh.write(f"# pyinstrument (main thread only), {n} operations\n")
            fh.write(prof.output_text(unicode=False, color=False, show_all=False))
    else:
        n = run(seconds)
    sys.stdout.write(f"DONE {n}\n")
    sys.stdout.flush()


# ---------------------------------------------------------------- parent side

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]*?)(?::(?P<line>\d+))?\)$")


def summarize_raw(raw: str, top: int = 25) -> str:
    """py-spy's collapsed stacks to tables: per thread group, then self and inclusive samples per function."""
    self_c: collections.Counter[str] = collections.Counter()
    self_f: collections.Counter[str] = collections.Counter()
    incl_c: collections.Counter[str] = collections.Counter()
    stacks: collections.Counter[str] = collections.Counter()
    by_thread: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_short(f) for f in stack.split(";") if not f.startswith("process ")]
        thread = "all threads"
        if frames and frames[0].startswith("thread ("):
            thread = _thread_group(frames.pop(0))
        if not frames:
            continue
        self_c[frames[-1]] += n
        self_f[_no_line(frames[-1])] += n
        by_thread[thread][_no_line(frames[-1])] += n
        for f in {_no_line(f) for f in frames}:
            incl_c[f] += n
        stacks[" > ".join(frames[-6:])] += n
    if not total:
        return "no samples\n"
    out = [f"samples: {total}", ""]
    if len(by_thread) > 1 or "all threads" not in by_thread:
        out.append("by thread (share of all samples; where each thread's samples were taken):")
        for th, c in sorted(by_thread.items(), key=lambda kv: -sum(kv[1].values())):
            tn = sum(c.values())
            out.append(f"  {100 * tn / total:5.1f}%  {th}")
            out += [f"      {100 * n / tn:5.1f}%  {f}" for f, n in c.most_common(6)]
        out.append("")
    out.append("self, by function:")
    out += [f"  {100 * n / total:5.1f}%  {f}" for f, n in self_f.most_common(top)]
    out += ["", "self, by line (where the samples were taken):"]
    out += [f"  {100 * n / total:5.1f}%  {f}" for f, n in self_c.most_common(top)]
    out += ["", "inclusive, by function (on the stack):"]
    out += [f"  {100 * n / total:5.1f}%  {f}" for f, n in incl_c.most_common(top)]
    out += ["", "top stacks (innermost 6 frames):"]
    out += [f"  {100 * n / total:5.1f}%  {s}" for s, n in stacks.most_common(12)]
    return "\n".join(out) + "\n"


def _thread_group(frame: str) -> str:
    """'thread (0x7f..): Thread-3 (producer)' -> 'Thread-N (producer)'; one group per kind of thread."""
    name = frame.split(":", 1)[1].strip() if ":" in frame else frame
    return re.sub(r"\d+", "N", name)


def _no_line(frame: str) -> str:
    return re.sub(r":\d+\)$", ")", frame)


def _short(frame: str) -> str:
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    path = m.group("file") or ""
    parts = path.replace("\\", "/").split("/")
    if "rocketstore" in parts:
        path = "/".join(parts[parts.index("rocketstore"):])
    else:
        path = parts[-1]
    return f"{m.group('func')} ({path}:{m.group('line')})" if m.group("line") else f"{m.group('func')} ({path})"


def profile_workload(workload: str, seconds: float, out_path: str) -> str | None:
    """Run one workload under py-spy (or pyinstrument); write the summary to ``out_path``."""
    tmp = tempfile.mkdtemp(prefix="rocketstore-profile-")
    spy = find_py_spy()
    pyi_out = None if spy else os.path.join(tmp, "pyinstrument.txt")
    args = [sys.executable, "-m", "rocketstore.bench.profiling", workload, tmp, str(seconds)]
    if pyi_out:
        args.append(pyi_out)
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        if proc.stdout.readline().strip() != "READY":
            proc.kill()
            return None
        spy_proc = None
        raw = os.path.join(tmp, "raw.txt")
        if spy:
            spy_proc = subprocess.Popen([spy, "record", "--pid", str(proc.pid), "--rate", "500", "--format", "raw",
                                         "--output", raw, "--nonblocking", "--threads"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # let py-spy attach
        proc.stdin.write("go\n")
        proc.stdin.flush()
        done = proc.stdout.readline().strip()
        proc.wait(timeout=600)
        if spy_proc is not None:
            spy_proc.wait(timeout=60)
        header = f"# profile of '{workload}' ({done}); "
        if spy and os.path.exists(raw):
            with open(raw, encoding="utf-8", errors="replace") as fh:
                text = header + "py-spy record --threads, every thread sampled at 500 Hz\n" + summarize_raw(fh.read())
        elif pyi_out and os.path.exists(pyi_out):
            with open(pyi_out, encoding="utf-8") as fh:
                text = header + fh.read()
        else:
            return None
        with open(out_path, "w", encoding="utf-8") as fh:
            fh.write(text)
        return out_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def write_crashed_store(path: str, segment: int) -> bool:
    """Fill one commitlog segment (all but its last 4 MiB) in a child process and SIGKILL it."""
    import signal
    proc = subprocess.Popen([sys.executable, "-m", "rocketstore.bench.child", "write-crash", path,
                             str(segment - 4 * MiB), str(segment)], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline().decode()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    return line.startswith("READY")


def profile_spark(out_path: str, segment: int = 256 * MiB) -> str | None:
    """py-spy over the Spark job (driver, JVM-launched Python workers) scanning a fresh 256 MiB store.

    The summary keeps only the samples of Spark's Python workers, where the data source runs.
    """
    spy = find_py_spy()
    if spy is None:
        return None
    tmp = tempfile.mkdtemp(prefix="rocketstore-profile-")
    try:
        path = os.path.join(tmp, "store")
        if not write_crashed_store(path, segment):
            return None
        subprocess.run([sys.executable, "-m", "rocketstore.bench.child", "recover", path, str(segment)],
                       capture_output=True, timeout=900, check=True)
        raw = os.path.join(tmp, "raw.txt")
        job = subprocess.run([spy, "record", "--subprocesses", "--rate", "200", "--format", "raw", "--output", raw,
                              "--", sys.executable, "-m", "rocketstore.bench.spark_job", path, tmp, "2"],
                             capture_output=True, text=True, timeout=1800)
        done = next((ln for ln in job.stdout.splitlines() if ln.startswith("DONE ")), "no result")
        if not os.path.exists(raw):
            return None
        with open(raw, encoding="utf-8", errors="replace") as fh:
            workers = "\n".join(ln for ln in fh.read().splitlines() if "daemon.py" in ln)
        text = (f"# profile of 'spark' ({done[:400]}); py-spy record --subprocesses at 200 Hz, samples of "
                f"Spark's Python workers only (where the rocketstore data source runs)\n" + summarize_raw(workers))
        with open(out_path, "w", encoding="utf-8") as fh:
            fh.write(text)
        return out_path
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def profile_missed(res: Results, targets: list[dict[str, Any]], out_dir: str, stem: str, mode: Mode) -> None:
    wanted = []
    for t in targets:
        if t["met"] is False and t.get("profile") and t["profile"] not in wanted:
            wanted.append(t["profile"])
    for w in wanted:
        path = os.path.join(out_dir, f"{stem}-profile-{w}.txt")
        try:
            got = profile_spark(path) if w == "spark" else profile_workload(w, max(2.0, mode.seconds), path)
        except Exception as e:
            res.note(f"profile of {w} failed: {e}")
            continue
        if got:
            res.profiles[w] = got


if __name__ == "__main__":
    child_main(sys.argv[1:])
