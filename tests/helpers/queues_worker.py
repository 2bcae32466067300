"""A SimpleConsumer (or writer) in its own process, for tests/library/test_queues_*.py.

Each line it prints is flushed at once, so a test that SIGKILLs it knows what it did before:
``recv <body> <attempt> <handle>``, ``acked <body>``, ``nacked <body>``, ``put <i>``, ``ready``,
``woke <body> <epoch s>``.
"""

from __future__ import annotations

import argparse
import sys
import time

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.queues import RetryPolicy


def say(*parts: object) -> None:
    sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["drain", "hold", "writer", "wake", "nack"])
    ap.add_argument("root")
    ap.add_argument("--group", default="G")
    ap.add_argument("--topic", default="T")
    ap.add_argument("--inv", type=float, default=30.0)
    ap.add_argument("--idle", type=float, default=2.0)
    ap.add_argument("--count", type=int, default=0)
    ap.add_argument("--sync-ack", action="store_true")
    ap.add_argument("--work", type=float, default=0.0, help="drain: seconds of 'work' per message before its ack")
    ap.add_argument("--hold-after", type=int, default=0, help="hold: receive this many, then sleep")
    ap.add_argument("--ack-first", type=int, default=0, help="hold: ack this many of them first")
    ap.add_argument("--max-reconsume", type=int, default=None, help="the group's maxReconsumeTimes")
    a = ap.parse_args()
    if a.mode == "writer":
        with MessageStore.open(a.root, StoreConfig()) as st:
            say("ready")
            i = 0
            while a.count == 0 or i < a.count:
                st.put(Message(a.topic, f"w{i}".encode()))
                say("put", i)
                i += 1
            st.wait_dispatched()
            say("done")
            time.sleep(3600) if a.count == 0 else None
        return
    st = MessageStore.open(a.root, read_only=True)
    policy = None if a.max_reconsume is None else RetryPolicy(a.max_reconsume, (100,))
    c = st.simple_consumer(a.group, a.topic, invisible_duration=a.inv, ack_sync_flush=a.sync_ack,
                           retry_policy=policy)
    if a.mode == "wake":
        say("ready")
        while True:
            got = c.receive(1, wait=10.0)
            now = time.time()
            for m in got:
                say("woke", m.body.decode(), f"{now:.6f}")
                c.ack(m)
                if m.body == b"stop":
                    c.close()
                    return
    if a.mode == "hold":  # receive --hold-after messages, ack the first --ack-first of them, then wait to be killed
        n = 0
        while n < a.hold_after:
            for m in c.receive(min(8, a.hold_after - n), wait=0.5):
                say("recv", m.body.decode(), m.delivery_attempt, m.receipt_handle)
                if n < a.ack_first:
                    c.ack(m)
                    say("acked", m.body.decode())
                n += 1
        say("holding")
        time.sleep(3600)
    say("ready")
    last = time.monotonic()
    while a.mode == "nack":  # every delivery fails: nack until nothing comes for --idle seconds
        got = c.receive(8, wait=0.2)
        if got:
            last = time.monotonic()
        elif time.monotonic() - last > a.idle:
            c.close()
            st.close()
            say("exit")
            return
        for m in got:
            say("recv", m.body.decode(), m.delivery_attempt, m.receipt_handle)
            c.nack(m)
            say("nacked", m.body.decode())
    while True:
        got = c.receive(8, wait=0.2)
        if got:
            last = time.monotonic()
        elif time.monotonic() - last > a.idle:
            break
        for m in got:
            say("recv", m.body.decode(), m.delivery_attempt, m.receipt_handle)
            time.sleep(a.work)
            c.ack(m)
            say("acked", m.body.decode())
    c.close()
    st.close()
    say("exit")


if __name__ == "__main__":
    main()
