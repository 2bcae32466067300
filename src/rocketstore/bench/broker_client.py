"""Throughput through the official client: ``rocketstore serve`` with producer and consumer processes.

Two phases on one broker (topic ``BenchT``, 8 queues): first every producer
process sends its share of 1 KiB messages (``send_async`` with a window of
outstanding sends), then consumer processes (SimpleConsumer, several threads
each, receive 32 and ack every message) drain the topic.  Each phase starts
when every process of it has started up (a "go" file), and its rate is
messages / (last finish - go).  Several client processes drive each phase (4
producers, 4 consumers), so that one official client's own CPU is not what sets
the pace.  The server's CPU time per message of each phase is its user + system
time (/proc/PID/stat) over exactly that window, go to the last message, divided
by the messages: a :class:`CpuClock` samples the server every 20 ms and the
figure is interpolated at both ends, so neither the clients' start-up and
shutdown nor the consumers' idle long polls after the last message count.

:func:`bench_vs_bare` runs the same load against the bare reference server
(:mod:`rocketstore.bench.broker_bare`: grpc.aio answering from memory) right after
the broker, so that the broker's rates can be given as a share of gRPC's own.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
import statistics
import threading
import time
from typing import Any, Callable

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


class CpuClock:
    """The CPU seconds a process has used, sampled every ``period`` seconds in a thread with the wall clock.

    :meth:`between` interpolates the used CPU between two wall times, so a phase's window can end at the
    moment its last message was handled (known only afterwards, from the clients' reports).
    """

    def __init__(self, read: Callable[[], float], period: float = 0.02) -> None:
        self._read = read
        self._period = period
        self.times: list[float] = []
        self.cpu: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-clock", daemon=True)

    def _sample(self) -> None:
        self.times.append(time.time())
        self.cpu.append(self._read())

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self._sample()

    def start(self) -> "CpuClock":
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def at(self, t: float) -> float:
        """CPU seconds used by wall time ``t`` (linear between the samples around it)."""
        ts, cs = self.times, self.cpu
        i = bisect.bisect_left(ts, t)
        if i <= 0:
            return cs[0]
        if i >= len(ts):
            return cs[-1]
        t0, t1 = ts[i - 1], ts[i]
        return cs[i - 1] + (cs[i] - cs[i - 1]) * ((t - t0) / (t1 - t0) if t1 > t0 else 1.0)

    def between(self, start: float, end: float) -> float:
        return max(0.0, self.at(end) - self.at(start))


def bench_client_throughput(workdir: str, messages: int = 20000, producers: int = 4, *, consumers: int = 4,
                            consumer_threads: int = 2, body_size: int = 1024, window: int = 64,
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
    clock = CpuClock(proc.cpu_seconds).start()
    try:
        share = [messages // producers + (1 if i < messages % producers else 0) for i in range(producers)]
        go = os.path.join(workdir, "go-produce")
        ready = [os.path.join(workdir, f"ready-p{i}") for i in range(producers)]
        procs = [start_client(proc.endpoint, PRODUCER, home, args=[n, body_size, window, go, r])
                 for n, r in zip(share, ready)]
        _wait_files(ready, procs, 120)
        t_go = time.time()
        open(go, "w").close()
        results = [collect(p, timeout)[0][-1] for p in procs]
        produced = sum(r["n"] for r in results)
        produce_end = max(r["end"] for r in results)
        produce_s = produce_end - t_go

        go = os.path.join(workdir, "go-consume")
        ready = [os.path.join(workdir, f"ready-c{i}") for i in range(consumers)]
        procs = [start_client(proc.endpoint, CONSUMER, home, args=[consumer_threads, go, r, 3])
                 for r in ready]
        _wait_files(ready, procs, 120)
        c_go = time.time()
        open(go, "w").close()
        results = [collect(p, timeout)[0][-1] for p in procs]
        consumed = sum(r["n"] for r in results)
        consume_end = max(r["end"] for r in results)
        consume_s = consume_end - c_go
    finally:
        clock.stop()
        proc.stop()
    produce_cpu = clock.between(t_go, produce_end)
    consume_cpu = clock.between(c_go, consume_end)
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

    Each phase's rate is its best round (as for every throughput figure of the suite: on a shared machine
    the best round is the one least disturbed), and so is its server CPU per message: the lowest of the
    rounds (``*_cpu_rounds`` keeps them all).  ``ratio_*`` = broker / bare, for the rates and for the CPU
    (``ratio_produce_cpu``, ``ratio_consume_cpu``: lower is better).
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
            for f in (f"{k}_msgs_per_s", f"{k}d", f"{k}_seconds"):
                best[f] = top[f]
            best[f"{k}_rounds"] = [d[f"{k}_msgs_per_s"] for d in results]
            cpu = [d[f"{k}_server_cpu_us_per_msg"] for d in results if d[f"{k}_server_cpu_us_per_msg"]]
            best[f"{k}_server_cpu_us_per_msg"] = min(cpu) if cpu else None
            best[f"{k}_cpu_rounds"] = cpu
            best[f"{k}_cpu_median"] = statistics.median(cpu) if cpu else None
        out[server] = best
    for k in ("produce", "consume"):
        b, r = out["broker"][f"{k}_msgs_per_s"], out["bare"][f"{k}_msgs_per_s"]
        out[f"ratio_{k}"] = b / r if r else None
        b, r = out["broker"][f"{k}_server_cpu_us_per_msg"], out["bare"][f"{k}_server_cpu_us_per_msg"]
        out[f"ratio_{k}_cpu"] = b / r if b and r else None
        # each round's broker / bare pair was taken minutes apart at most: their spread is the machine's
        out[f"ratio_{k}_cpu_rounds"] = [bk[f"{k}_server_cpu_us_per_msg"] / bb[f"{k}_server_cpu_us_per_msg"]
                                        for bk, bb in zip(runs["broker"], runs["bare"])
                                        if bk[f"{k}_server_cpu_us_per_msg"] and bb[f"{k}_server_cpu_us_per_msg"]]
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m rocketstore.bench.broker_client",
                                 description="the broker against the bare server, official clients")
    ap.add_argument("messages", type=int, nargs="?", default=5000)
    ap.add_argument("workdir", nargs="?", default="/tmp/rs-broker-bench")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--producers", type=int, default=4)
    ap.add_argument("--consumers", type=int, default=4)
    args = ap.parse_args(argv)
    print(json.dumps(bench_vs_bare(args.workdir, args.messages, args.producers, rounds=args.rounds,
                                   consumers=args.consumers), indent=2))
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
