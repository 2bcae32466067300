"""The suite: an ordered list of tasks (each takes one or more measurements), workloads that select them,
and the run that executes the selection, evaluates the targets and writes the reports."""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import floors, peers, queues, rs, system
from .harness import GiB, MODES, Mode, Results, machine_info, on_tmpfs
from .redis_server import RedisServer
from .report import doc_block, targets_table, update_doc, write_reports
from .targets import evaluate

log = logging.getLogger("rocketstore.bench")


@dataclass
class Context:
    mode: Mode
    workdir: str
    res: Results = field(default_factory=Results)
    dataset: rs.Dataset | None = None
    recovery_store: str | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.mode.seconds


Task = Callable[[Context], Any]


def _dataset(ctx: Context) -> None:
    if ctx.dataset is None:
        ds = rs.Dataset(ctx.workdir, ctx.mode.dataset_msgs)
        ds.build()
        ctx.dataset = ds
        ctx.res.series["dataset"] = {"messages": ds.n, "build_seconds": ds.build_seconds}


def _need_dataset(fn: Callable[[Context, rs.Dataset], Any]) -> Task:
    def run(ctx: Context) -> Any:
        _dataset(ctx)
        assert ctx.dataset is not None
        return fn(ctx, ctx.dataset)
    return run


def _redis(ctx: Context) -> None:
    with RedisServer(ctx.workdir, install=ctx.mode.install_redis) as srv:
        if srv.installed_by_suite:
            ctx.res.note("Debian's redis-server was installed by the suite (apt-get install -y redis-server).")
        peers.redis_streams(ctx.res, ctx.workdir, ctx.seconds, srv)


def _enough_disk(ctx: Context, need: int, what: str) -> bool:
    free = shutil.disk_usage(ctx.workdir).free
    if free < need:
        ctx.res.note(f"{what}: skipped, {free / GiB:.1f} GiB free in {ctx.workdir}, needs {need / GiB:.1f} GiB")
        return False
    return True


def _recovery(ctx: Context) -> None:
    if _enough_disk(ctx, int(ctx.mode.recovery_bytes * 1.6) + GiB, "recovery"):
        ctx.recovery_store = system.recovery(ctx.res, ctx.workdir, ctx.mode)
    else:
        ctx.res.skip("rs.recovery", "rocketstore", "abnormal recovery", "MB/s", "not enough disk space")


def _memory(ctx: Context) -> None:
    if _enough_disk(ctx, int(ctx.mode.memory_bytes * 1.3) + GiB, "memory"):
        system.memory(ctx.res, ctx.workdir, ctx.mode)
    else:
        ctx.res.skip("rs.memory", "rocketstore", "memory while writing", "MB", "not enough disk space")


def _spark(ctx: Context) -> None:
    if ctx.recovery_store is None and ctx.mode.spark:
        _recovery(ctx)
    system.spark_scan(ctx.res, ctx.workdir, ctx.recovery_store, ctx.mode)


def _put(size: int, threads: int, flush: str, batch: int = 1) -> Task:
    return lambda ctx: rs.put(ctx.res, ctx.workdir, body_size=size, threads=threads, flush=flush, batch=batch,
                              seconds=ctx.seconds)


def _sqlite(sync: str, batch: int) -> Task:
    return lambda ctx: peers.sqlite_put(ctx.res, ctx.workdir, synchronous=sync, batch=batch, seconds=ctx.seconds)


def _queue(name: str, procs: int) -> Task:
    return lambda ctx: queues.measure(ctx.res, ctx.workdir, name, procs, ctx.mode.queue_messages,
                                      deadline_s=30.0 if ctx.mode.name == "smoke" else 120.0)


def build_tasks(mode: Mode) -> dict[str, Task]:
    """Every task, in the order they run (sync first while the disk is quiet, big writers last)."""
    S, A = "SYNC_FLUSH", "ASYNC_FLUSH"
    t: dict[str, Task] = {}
    t["floor.fdatasync"] = lambda ctx: floors.fdatasync_rate(ctx.res, ctx.workdir, ctx.seconds)
    t["sqlite.txn.full"] = _sqlite("FULL", 1)
    t["sqlite.batch32.full"] = _sqlite("FULL", 32)
    for n in (1, 4, 16):
        t[f"rs.put.sync.t{n}.1024"] = _put(1024, n, S)
    t["rs.batch32.sync.t1.1024"] = _put(1024, 1, S, 32)
    for s in mode.sizes:
        t[f"floor.append.{s}"] = (lambda s: lambda ctx: floors.bare_append(ctx.res, ctx.workdir, s, ctx.seconds))(s)
    t["floor.append.1024.warm"] = lambda ctx: floors.bare_append(ctx.res, ctx.workdir, 1024, ctx.seconds, warm=True)
    t["floor.read.1024"] = lambda ctx: floors.bare_read(ctx.res, ctx.workdir, 1024, ctx.seconds)
    t["floor.crc32"] = lambda ctx: floors.crc32_floor(ctx.res, ctx.seconds)
    for s in mode.sizes:
        t[f"rs.put.async.t1.{s}"] = _put(s, 1, A)
    t["sqlite.txn.off"] = _sqlite("OFF", 1)
    t["sqlite.txn.normal"] = _sqlite("NORMAL", 1)
    for s in mode.sizes:
        t[f"rs.batch32.async.t1.{s}"] = _put(s, 1, A, 32)
    t["sqlite.batch32.off"] = _sqlite("OFF", 32)
    for n in (4, 16):
        t[f"rs.put.async.t{n}.1024"] = _put(1024, n, A)
    t["dataset"] = _dataset
    t["rs.consume32"] = _need_dataset(lambda ctx, ds: rs.consume(ctx.res, ds, ctx.seconds))
    t["sqlite.consume32"] = _need_dataset(lambda ctx, ds: peers.sqlite_consume(ctx.res, ds.sqlite_path, ds.n,
                                                                               ctx.seconds))
    t["rs.lookup"] = _need_dataset(lambda ctx, ds: rs.lookup(ctx.res, ds, ctx.seconds, ctx.mode.lookups))
    t["sqlite.lookup"] = _need_dataset(lambda ctx, ds: peers.sqlite_lookup(
        ctx.res, ds.sqlite_path, rs.lookup_keys(ds, ctx.mode.lookups), ctx.seconds))
    t["persist-queue"] = lambda ctx: peers.persist_queue(ctx.res, ctx.workdir, ctx.seconds)
    t["diskcache"] = lambda ctx: peers.diskcache_deque(ctx.res, ctx.workdir, ctx.seconds)
    t["litequeue"] = lambda ctx: peers.litequeue_peer(ctx.res, ctx.workdir, ctx.seconds)
    t["redis"] = _redis
    for procs in (1, 4):
        for q in queues.SYSTEMS:
            t[f"queue.{q}.p{procs}"] = _queue(q, procs)
    t["broker"] = lambda ctx: system.broker_client(ctx.res, ctx.workdir, ctx.mode)
    t["floor.write"] = lambda ctx: floors.raw_write(ctx.res, ctx.workdir, ctx.mode.raw_write_bytes, ctx.seconds,
                                                    floors.record_size(1024))
    t["floor.dd"] = lambda ctx: floors.dd_write(ctx.res, ctx.workdir, ctx.mode.raw_write_bytes)
    t["recovery"] = _recovery
    t["spark"] = _spark
    t["memory"] = _memory
    return t


# Tasks that run once (big writers, whole-process workloads, plugins); every other task is a throughput
# measurement, repeated mode.rounds times with the rounds interleaved, keeping the best of each.
ONCE = ("dataset", "broker", "floor.write", "floor.dd", "recovery", "spark", "memory")


def schedule(mode: Mode, names: list[str]) -> list[str]:
    """The run order: every repeated task once per round, then the run-once tasks."""
    repeated = [n for n in names if n not in ONCE]
    once = [n for n in names if n in ONCE]
    if "dataset" in once:  # built before the first consume/lookup, not after the rounds
        once.remove("dataset")
    return repeated * max(1, mode.rounds) + once


def workloads(mode: Mode) -> dict[str, list[str]]:
    """What ``--only NAME`` runs: a workload's own tasks plus the peers and limits its ratios need."""
    sizes = mode.sizes
    peer_refs = ["floor.append.1024", "floor.read.1024", "rs.put.async.t1.1024", "rs.batch32.async.t1.1024",
                 "rs.consume32"]
    w = {
        "floors": ["floor.fdatasync", *[f"floor.append.{s}" for s in sizes], "floor.append.1024.warm",
                   "floor.read.1024", "floor.crc32",
                   "floor.write", "floor.dd"],
        "put": [*[f"floor.append.{s}" for s in sizes], *[f"rs.put.async.t1.{s}" for s in sizes], "sqlite.txn.off",
                "sqlite.txn.normal"],
        "batch": [*[f"floor.append.{s}" for s in sizes], *[f"rs.batch32.async.t1.{s}" for s in sizes],
                  "sqlite.batch32.off"],
        "sync": ["floor.fdatasync", "sqlite.txn.full", "sqlite.batch32.full", "rs.put.sync.t1.1024",
                 "rs.put.sync.t4.1024", "rs.put.sync.t16.1024", "rs.batch32.sync.t1.1024"],
        "threads": ["floor.append.1024", "rs.put.async.t1.1024", "rs.put.async.t4.1024", "rs.put.async.t16.1024"],
        "consume": ["floor.read.1024", "rs.consume32", "sqlite.consume32"],
        "lookup": ["rs.lookup", "sqlite.lookup"],
        "peers": [*peer_refs, "persist-queue", "diskcache", "litequeue", "redis"],
        "sqlite": ["sqlite.txn.full", "sqlite.batch32.full", "sqlite.txn.off", "sqlite.txn.normal",
                   "sqlite.batch32.off", "sqlite.consume32", "sqlite.lookup"],
        "recovery": ["recovery"],
        "spark": ["recovery", "spark"],
        "memory": ["memory"],
        "broker": ["rs.put.async.t4.1024", "rs.consume32", "broker"],
        "queues": [f"queue.{q}.p{procs}" for procs in (1, 4) for q in queues.SYSTEMS],
    }
    for p in ("persist-queue", "diskcache", "litequeue", "redis"):
        w[p] = [*peer_refs, p]
    return w


WORKLOAD_NAMES = sorted(workloads(MODES["full"]))


def select(mode: Mode, only: list[str] | None) -> list[str]:
    tasks = build_tasks(mode)
    if not only:
        return list(tasks)
    wanted: set[str] = set()
    w = workloads(mode)
    for name in only:
        wanted.update(w[name])
    return [t for t in tasks if t in wanted]


def repo_root() -> Path | None:
    """The checkout this package runs from (src layout), if any."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "pyproject.toml").exists() and (root / "src" / "rocketstore").is_dir() else None


def default_out_dir() -> str:
    root = repo_root()
    return str((root or Path.cwd()) / "bench" / "results")


def run_suite(mode_name: str = "full", out_dir: str | None = None, only: list[str] | None = None,
              workdir: str | None = None, keep: bool = False, profile: bool = False,
              update_docs: bool | None = None, seconds: float | None = None,
              progress: bool | None = None) -> dict[str, Any]:
    """Run the selected workloads; write JSON, Markdown and PNGs into ``out_dir``; return a summary."""
    mode = MODES[mode_name]
    if seconds is not None:
        from dataclasses import replace
        mode = replace(mode, seconds=seconds)
    default_out = out_dir is None
    out_dir = out_dir or default_out_dir()
    os.makedirs(out_dir, exist_ok=True)
    own_workdir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="rocketstore-bench-")
    os.makedirs(workdir, exist_ok=True)
    t_start = time.monotonic()
    ctx = Context(mode, workdir)
    if on_tmpfs(workdir):
        ctx.res.note(f"the work directory {workdir} is on tmpfs: disk figures (fdatasync, sync flush) are not "
                     "those of a disk; use --workdir on a disk")
    tasks = build_tasks(mode)
    names = schedule(mode, select(mode, only))
    meta: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                            "mode": mode.name, "mode_params": mode.to_json(), "only": only or [],
                            **machine_info(workdir)}
    from tqdm import tqdm
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=len(names), desc="bench", unit="task", disable=not show, file=sys.stderr,
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]")
    loads = [os.getloadavg()[0]]
    done: dict[str, int] = {}
    try:
        for name in names:
            done[name] = done.get(name, 0) + 1
            bar.set_description(f"bench {name}" + (f" (round {done[name]})" if mode.rounds > 1 and name not in ONCE
                                                   else ""))
            try:
                tasks[name](ctx)
            except Exception as e:  # a broken workload is reported, the rest still runs
                log.error("task %s failed:\n%s", name, traceback.format_exc())
                ctx.failures.append(f"{name}: {type(e).__name__}: {e}")
                ctx.res.note(f"task {name} failed: {type(e).__name__}: {e}")
            loads.append(os.getloadavg()[0])
            bar.update(1)
    finally:
        bar.close()
        if ctx.dataset is not None:
            ctx.dataset.close()
        if own_workdir and not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        elif keep:
            log.warning("work directory kept: %s", workdir)
    meta["load_max"] = round(max(loads), 2)
    meta["rounds"] = mode.rounds
    if max(loads) > meta["nproc"]:
        ctx.res.note(f"the machine was busy during the run (1-minute load average up to {max(loads):.1f} on "
                     f"{meta['nproc']} cores, the store's own background threads included): figures are noisier "
                     f"than usual; each throughput figure is the best of {mode.rounds} interleaved round(s).")
    targets = evaluate(ctx.res)
    host = re.sub(r"[^A-Za-z0-9._-]+", "_", socket.gethostname()) or "host"
    stem = f"{meta['date']}-{host}"
    if profile:
        from .profiling import profile_missed
        profile_missed(ctx.res, targets, out_dir, stem, mode)
    meta["duration_s"] = round(time.monotonic() - t_start, 1)
    meta["failures"] = ctx.failures
    paths = write_reports(ctx.res, meta, targets, out_dir, stem)
    if update_docs is None:
        update_docs = default_out and mode.name == "full" and not only
    updated = []
    root = repo_root()
    if update_docs and root is not None:
        block = doc_block(meta, targets, stem, [n for n in ctx.res.notes if "busy" in n or "skipped" in n])
        for doc in (root / "docs" / "bench.md", root / "README.md"):
            if update_doc(str(doc), block):
                updated.append(str(doc))
    return {"paths": paths, "targets": targets, "failures": ctx.failures, "meta": meta, "docs_updated": updated,
            "table": "\n".join(targets_table(targets))}
