"""Throughput through the official client: ``rocketstore serve`` with producer and consumer processes.

Two phases on one broker (topic ``BenchT``, 8 queues): first every producer
process sends its share of 1 KiB messages (``send_async`` with a window of
outstanding sends), then consumer processes (SimpleConsumer, several threads
each, receive 32 and ack every message) drain the topic.  Each phase starts
when every process of it has started up (a "go" file), and its rate is
messages / (last finish - go).  The server's CPU time per message of each phase
is taken from /proc.

:func:`bench_vs_bare` runs the same load against the bare reference server
(:mod:`rocketstore.bench.broker_bare`: grpc.aio answering from memory) right after
the broker, so that the broker's rates can be given as a share of gRPC's own.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

from .broker_harness import BareProcess, BrokerProcess, collect, start_client

PRODUCER = '''
import sys
n, size, window, go = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
from collections import deque
p = Producer(cfg(10), ("BenchT",)); p.startup()
p.send(msg("BenchT", b"w" * size))  # route and channel ready
open(sys.argv[5], "w").close()
while not os.path.exists(go): time.sleep(0.005)
body = os.urandom(size)
t0 = time.time(); pending = deque(); errors = 0
for i in range(n):
    m = Message(); m.topic = "BenchT"; m.body = body; m.tag = "bench"
    pending.append(p.send_async(m))
    while len(pending) >= window:
        try: pending.popleft().result(timeout=60)
        except Exception: errors += 1
while pending:
    try: pending.popleft().result(timeout=60)
    except Exception: errors += 1
emit({"n": n - errors, "errors": errors, "start": t0, "end": time.time()})
p.shutdown()
'''

CONSUMER = '''
import sys
threads_n, go, ready, idle_s = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
c = SimpleConsumer(cfg(10), "BenchG", {"BenchT": FilterExpression("bench")}, await_duration=1); c.startup()
open(ready, "w").close()
while not os.path.exists(go): time.sleep(0.005)
counts = []; lock = threading.Lock(); last = [time.time()]
def run():
    n = 0; idle = time.time()
    while time.time() - idle < idle_s:
        try: ms = c.receive(32, 30)
        except Exception: time.sleep(0.1); continue
        for m in ms:
            c.ack(m); n += 1
        if ms:
            idle = time.time()
            with lock: last[0] = max(last[0], idle)
    counts.append(n)
ts = [threading.Thread(target=run) for _ in range(threads_n)]
[t.start() for t in ts]; [t.join() for t in ts]
emit({"n": sum(counts), "end": last[0]})
c.shutdown()
'''


def _wait_files(paths: list[str], procs: list[Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        for pr in procs:
            if pr.poll() is not None and pr.returncode != 0:
                raise RuntimeError(f"a benchmark client exited with {pr.returncode}: "
                                   f"{pr.stderr.read().decode('utf-8', 'replace')[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError("benchmark clients did not start in time")
        time.sleep(0.02)


def bench_client_throughput(workdir: str, messages: int = 20000, producers: int = 4, *, consumers: int = 2,
                            consumer_threads: int = 4, body_size: int = 1024, window: int = 64,
                            flush_disk_type: str = "ASYNC_FLUSH", timeout: float = 600.0,
                            server: str = "broker") -> dict[str, Any]:
    """Produce then consume ``messages`` 1 KiB messages through the official Python client; rates in msg/s.

    ``server`` is "broker" (``rocketstore serve`` on a new store) or "bare" (the reference server).
    """
    if os.path.exists(workdir):
        shutil.rmtree(workdir)
    home = os.path.join(workdir, "home")
    os.makedirs(home)
    if server == "bare":
        proc: BrokerProcess = BareProcess(os.path.join(workdir, "store"))
    elif server == "broker":
        proc = BrokerProcess(os.path.join(workdir, "store"), conf={"flushDiskType": flush_disk_type},
                             args=["--topic", "BenchT:8:NORMAL"])
    else:
        raise ValueError(f"server must be 'broker' or 'bare', not {server!r}")
    proc.start()
    try:
        share = [messages // producers + (1 if i < messages % producers else 0) for i in range(producers)]
        go = os.path.join(workdir, "go-produce")
        ready = [os.path.join(workdir, f"ready-p{i}") for i in range(producers)]
        procs = [start_client(proc.endpoint, PRODUCER, home, args=[n, body_size, window, go, r])
                 for n, r in zip(share, ready)]
        _wait_files(ready, procs, 120)
        cpu0 = proc.cpu_seconds()
        t_go = time.time()
        open(go, "w").close()
        results = [collect(p, timeout)[0][-1] for p in procs]
        produce_cpu = proc.cpu_seconds() - cpu0
        produced = sum(r["n"] for r in results)
        produce_s = max(r["end"] for r in results) - t_go

        go = os.path.join(workdir, "go-consume")
        ready = [os.path.join(workdir, f"ready-c{i}") for i in range(consumers)]
        procs = [start_client(proc.endpoint, CONSUMER, home, args=[consumer_threads, go, r, 3])
                 for r in ready]
        _wait_files(ready, procs, 120)
        cpu0 = proc.cpu_seconds()
        t_go = time.time()
        open(go, "w").close()
        results = [collect(p, timeout)[0][-1] for p in procs]
        consume_cpu = proc.cpu_seconds() - cpu0  # includes the consumers' idle receives at the end
        consumed = sum(r["n"] for r in results)
        consume_s = max(r["end"] for r in results) - t_go
    finally:
        proc.stop()
    return {
        "produce_msgs_per_s": produced / produce_s if produce_s > 0 else 0.0,
        "consume_msgs_per_s": consumed / consume_s if consume_s > 0 else 0.0,
        "produced": produced, "produce_seconds": produce_s,
        "consumed": consumed, "consume_seconds": consume_s,
        "produce_server_cpu_us_per_msg": produce_cpu / produced * 1e6 if produced else None,
        "consume_server_cpu_us_per_msg": consume_cpu / consumed * 1e6 if consumed else None,
        "server": server, "producers": producers, "consumers": consumers, "consumer_threads": consumer_threads,
        "body_size": body_size, "send_window": window, "flush_disk_type": flush_disk_type,
        "client": "rocketmq-python-client", "protocol": "gRPC (apache.rocketmq.v2)",
    }


def bench_vs_bare(workdir: str, messages: int = 20000, producers: int = 4, *, rounds: int = 2,
                  **kw: Any) -> dict[str, Any]:
    """The broker, then the bare reference server, under the same load, ``rounds`` times interleaved.

    Each phase's figure is its best round (as for every throughput figure of the suite: on a shared machine
    the best round is the one least disturbed); ``ratio_*`` = broker / bare.
    """
    runs: dict[str, list[dict[str, Any]]] = {"broker": [], "bare": []}
    for r in range(max(1, rounds)):
        for server in runs:
            runs[server].append(bench_client_throughput(os.path.join(workdir, f"{server}-{r}"), messages, producers,
                                                        server=server, **kw))
    out: dict[str, Any] = {}
    for server, results in runs.items():
        best: dict[str, Any] = dict(results[0])
        for k in ("produce", "consume"):
            top = max(results, key=lambda d: d[f"{k}_msgs_per_s"])
            for f in (f"{k}_msgs_per_s", f"{k}d", f"{k}_seconds", f"{k}_server_cpu_us_per_msg"):
                best[f] = top[f]
            best[f"{k}_rounds"] = [d[f"{k}_msgs_per_s"] for d in results]
        out[server] = best
    for k in ("produce", "consume"):
        b, r = out["broker"][f"{k}_msgs_per_s"], out["bare"][f"{k}_msgs_per_s"]
        out[f"ratio_{k}"] = b / r if r else None
    return out


if __name__ == "__main__":
    import sys
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    print(json.dumps(bench_vs_bare(sys.argv[2] if len(sys.argv) > 2 else "/tmp/rs-broker-bench", n), indent=2))
