"""``make demo``: write a real store, read it back through queues, keys and time, print a summary.

The store is left in ``./demo-store`` (override with ``ROCKETSTORE_DEMO_DIR``)
so that the CLI can be tried on it afterwards.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import time

from ..config import StoreConfig
from ..format.message import GetMessageStatus, Message
from .progress import progress_bar
from ..store import MessageStore

TOPICS = {"Orders": 4, "Payments": 2, "Audit": 1}


# Written into every store the demo makes: the only kind of directory it will delete to start afresh.
MARKER = ".rocketstore-demo"


class DemoDirError(Exception):
    """The demo directory exists and is not a store the demo made."""


def prepare(path: str) -> None:
    """Empty ``path`` for a new demo store, deleting it only if an earlier demo made it."""
    if os.path.exists(path):
        if not os.path.isfile(os.path.join(path, MARKER)):
            if not os.path.isdir(path) or os.listdir(path):
                raise DemoDirError(f"{path} exists and is not a store made by the demo ({MARKER} missing); "
                                   "refusing to delete it: remove it yourself or set ROCKETSTORE_DEMO_DIR elsewhere")
        shutil.rmtree(path)
    os.makedirs(path)
    with open(os.path.join(path, MARKER), "w", encoding="utf-8") as fh:
        fh.write("made by rocketstore.cli.demo; deleted and rewritten by the next demo run\n")


def run(path: str, count: int = 300_000) -> dict[str, float]:
    prepare(path)
    cfg = StoreConfig(mappedFileSizeCommitLog=64 * 1024 * 1024, mappedFileSizeConsumeQueue=300_000 * 20,
                      maxHashSlotNum=500_000, maxIndexNum=2_000_000)
    rng = random.Random(7)
    bodies = [rng.randbytes(n) for n in (128, 512, 1024, 2048)]
    topics = list(TOPICS)
    stats: dict[str, float] = {}
    with MessageStore.open(path, cfg) as store:
        t0 = time.perf_counter()
        batches: dict[tuple[str, int], list[Message]] = {}
        refused = 0
        with progress_bar(count, "put", unit="msg") as bar:
            for i in range(count):
                topic = topics[i % 3]
                msg = Message(topic, bodies[i % 4], queue_id=i % TOPICS[topic], tags=f"Tag{'ABC'[i % 3]}",
                              keys=f"order-{i}")
                if i % 2:  # half the traffic goes in batches of 32 (one topic/queue per batch)
                    batch = batches.setdefault((topic, msg.queue_id), [])
                    batch.append(msg)
                    if len(batch) == 32:
                        refused += not store.put_batch(batch).ok
                        batch.clear()
                else:
                    refused += not store.put(msg).ok
                if i % 4096 == 4095:
                    bar.update(4096)
            for batch in batches.values():
                if batch:
                    refused += not store.put_batch(batch).ok
        if refused:
            raise RuntimeError(f"{refused} puts were refused")
        store.wait_dispatched()
        stats["put_seconds"] = time.perf_counter() - t0
        stats["messages"] = sum(store.max_offset_in_queue(t, q) for t, n in TOPICS.items() for q in range(n))
        t0 = time.perf_counter()
        read = 0
        for topic, n in TOPICS.items():
            for q in range(n):
                off = 0
                while True:
                    r = store.get(topic, q, off, 32, read_body=False)
                    if r.status is not GetMessageStatus.FOUND:
                        break
                    read += len(r.messages)
                    off = r.next_begin_offset
        stats["consumed"] = read
        stats["consume_seconds"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        lookups = range(0, count, max(1, count // 1000))  # about 1,000 keys spread over the store
        found = sum(len(store.query(topics[i % 3], f"order-{i}").messages) for i in lookups)
        stats["key_lookups"] = len(lookups)
        stats["key_hits"] = found
        stats["lookup_seconds"] = time.perf_counter() - t0
        state = store.state()
        mid = state["queues"][0]
        stats["offset_at_midpoint"] = store.offset_by_time(mid["topic"], mid["queueId"], int(time.time() * 1000) - 1)
        stats["max_phy_offset"] = state["maxPhyOffset"]
    return stats


def main() -> int:
    path = os.environ.get("ROCKETSTORE_DEMO_DIR", "demo-store")
    raw = os.environ.get("ROCKETSTORE_DEMO_MESSAGES", "300000")
    count = int(raw) if raw.strip().isdigit() else 0
    if count < 1:
        sys.stderr.write(f"rocketstore demo: error: ROCKETSTORE_DEMO_MESSAGES={raw!r}: expected a whole number of "
                         "messages, at least 1\n")
        return 2
    try:
        s = run(path, count)
    except DemoDirError as e:
        sys.stderr.write(f"rocketstore demo: error: {e}\n")
        return 2
    rows = [
        ("store", os.path.abspath(path)),
        ("messages written", f"{int(s['messages']):,}"),
        ("commitlog bytes", f"{int(s['max_phy_offset']):,}"),
        ("put + dispatch", f"{s['put_seconds']:.2f} s ({s['messages'] / s['put_seconds']:,.0f} msg/s)"),
        ("read back via consume queues", f"{int(s['consumed']):,} in {s['consume_seconds']:.2f} s "
                                         f"({s['consumed'] / s['consume_seconds']:,.0f} msg/s)"),
        ("key lookups via index", f"{int(s['key_hits'])}/{int(s['key_lookups'])} found in "
                                  f"{s['lookup_seconds'] * 1000:.0f} ms"),
        ("offset by time (now - 1 ms)", f"{int(s['offset_at_midpoint'])}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        sys.stdout.write(f"{k:<{width}}  {v}\n")
    sys.stdout.write(f"\nTry: .venv/bin/rocketstore state {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
