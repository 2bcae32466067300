"""Work run in a child process, so that a crash can be real and memory can be measured alone.

``python -m rocketstore.bench.child write-crash STORE BYTES SEGMENT``
    fill the commitlog to BYTES, print ``READY <json>`` and wait to be killed (SIGKILL).
``python -m rocketstore.bench.child recover STORE SEGMENT``
    open the store (recovery runs because the abort file is there), print the report as JSON.
``python -m rocketstore.bench.child memory STORE BYTES``
    write BYTES through put_batch, print ``DONE <json>``; the parent samples /proc/PID meanwhile.
"""

from __future__ import annotations

import json
import os
import sys
import time

from rocketstore.config import StoreConfig
from rocketstore.format.message import Message
from rocketstore.store import MessageStore

TOPIC = "BenchTopic"
BATCH = 32


def _body(size: int = 1024) -> bytes:
    from .floors import make_body
    return make_body(size)


def _fill(store: MessageStore, limit_bytes: int, keys: bool) -> tuple[int, float]:
    """put_batch 1 KiB messages with unique keys until the commitlog holds ``limit_bytes``."""
    body = _body()
    n = 0
    t0 = time.perf_counter()
    commitlog = store.commitlog
    while True:
        msgs = [Message(TOPIC, body, queue_id=(n // BATCH) % 4, keys=f"order-{n + i:09d}" if keys else None)
                for i in range(BATCH)]
        r = store.put_batch(msgs)
        if not r.ok:
            raise SystemExit(f"put_batch failed: {r.status.value} {r.error}")
        n += BATCH
        if commitlog.max_offset() >= limit_bytes:
            break
    return n, time.perf_counter() - t0


def write_crash(path: str, limit: int, segment: int) -> None:
    store = MessageStore.open(path, StoreConfig(mappedFileSizeCommitLog=segment))
    n, secs = _fill(store, limit, keys=True)
    # Let the dispatcher finish, as a broker that had been running would have (recovery redoes it anyway).
    store.wait_dispatched(timeout=600)
    info = {"messages": n, "seconds": secs, "commitlog_bytes": store.commitlog.max_offset()}
    sys.stdout.write("READY " + json.dumps(info) + "\n")
    sys.stdout.flush()
    while True:  # killed with SIGKILL by the parent: no close, no flush, the abort file stays
        time.sleep(3600)


def recover(path: str, segment: int) -> None:
    # Code is imported before the clock starts, as a broker imports its code at start-up: the store's modules
    # at the top of this file, and recovery's vectorised tier (numpy), which recovery imports on first use.
    import rocketstore.storage.queue_checked  # noqa: F401
    had_abort = os.path.exists(os.path.join(path, "abort"))
    t0 = time.perf_counter()
    store = MessageStore.open(path, StoreConfig(mappedFileSizeCommitLog=segment))
    open_s = time.perf_counter() - t0
    rep = store.recovery_report
    out = {"open_seconds": open_s, "had_abort": had_abort, "report": rep.to_json() if rep else None,
           "max_offset": store.commitlog.max_offset()}
    t0 = time.perf_counter()
    store.close()
    out["close_seconds"] = time.perf_counter() - t0
    sys.stdout.write("DONE " + json.dumps(out) + "\n")


def memory(path: str, limit: int) -> None:
    store = MessageStore.open(path, StoreConfig())
    sys.stdout.write("STARTED\n")
    sys.stdout.flush()
    n, secs = _fill(store, limit, keys=True)
    t0 = time.perf_counter()
    store.close()
    out = {"messages": n, "seconds": secs, "close_seconds": time.perf_counter() - t0, "bytes": limit}
    sys.stdout.write("DONE " + json.dumps(out) + "\n")


def main(argv: list[str]) -> None:
    cmd = argv[0]
    if cmd == "write-crash":
        write_crash(argv[1], int(argv[2]), int(argv[3]))
    elif cmd == "recover":
        recover(argv[1], int(argv[2]))
    elif cmd == "memory":
        memory(argv[1], int(argv[2]))
    else:
        raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
