"""attack20: buffered acks across a failed write of the shared pop state.

fbb6b02 drops the in-memory pop state when an operation raises (its changes were not journaled).  A receiver
without ack_sync_flush hands its buffered acks to the state at the start of its next locked call and
forgot them there: when that call's journal write then failed (a full disk, say), the acks were dropped with
the state, the linger thread's retry ("the next call retries") found nothing left to write, and the acked
messages came back to the group after their invisible time, with no process killed (the module doc promises
that only a process killed in the linger window loses acks)."""

from __future__ import annotations

import errno
import time
from pathlib import Path

import pytest

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.queues.state import SharedPopState


def test_buffered_acks_survive_a_failed_state_write(tmp_path: Path, monkeypatch) -> None:
    with MessageStore.open(str(tmp_path / "s"), StoreConfig()) as w:
        for i in range(2):
            w.put(Message("T", f"m{i}".encode(), queue_id=0))
        w.wait_dispatched()
        with w.simple_consumer("G", "T", invisible_duration=0.5, ack_sync_flush=False) as c:
            got = c.receive(8)
            assert sorted(m.body for m in got) == [b"m0", b"m1"]
            for m in got:
                c.ack(m)  # buffered
            append, fails = SharedPopState._append, [1]

            def full_disk(self, pop, durable):
                if fails:
                    fails.pop()
                    raise OSError(errno.ENOSPC, "No space left on device")
                return append(self, pop, durable)
            monkeypatch.setattr(SharedPopState, "_append", full_disk)
            with pytest.raises(OSError, match="No space"):
                c.flush()
            c.flush()  # the disk has room again: the acks are written now
            time.sleep(0.8)  # past the invisible time
            with w.simple_consumer("G", "T", invisible_duration=30) as other:
                assert other.receive(8) == [], "acked messages delivered again"
