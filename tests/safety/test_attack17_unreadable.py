"""Attack 17: a message the dead-letter mover or the timer cannot read *for now* (the tier's bucket does not
answer: TierError; an I/O error) was dropped as if it were damaged: left out of its group and of the DLQ, or
marked delivered without its copy.  A transient read failure must leave the message where it is (parked; due),
to be moved or delivered when it reads again; only a damaged or gone record (CorruptRecordError) is dropped."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.errors import TierError
from rocketstore.queues import RetryPolicy
from rocketstore.queues.revive import DeadLetterMover, DeadLetterService

SMALL = StoreConfig(mappedFileSizeCommitLog=1024 * 1024, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=100,
                    maxIndexNum=400)


class FlakyLook:
    """``store.look`` failing like an unreachable bucket for the next ``n`` calls at ``offsets``."""

    def __init__(self, store: MessageStore, offsets: set[int], n: int) -> None:
        self.real, self.offsets, self.left = store.look, offsets, n

    def __call__(self, offset: int, **kw: object):
        if offset in self.offsets and self.left > 0:
            self.left -= 1
            raise TierError(f"s3://bucket/commitlog/{offset:020d}: connection refused (a test's outage)")
        return self.real(offset, **kw)


def test_a_dead_letter_whose_message_cannot_be_read_for_now_stays_parked(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(tmp_path / "s")
    monkeypatch.setattr(DeadLetterService, "run_once", lambda self: None)  # the test drives the mover
    with MessageStore.open(root, SMALL) as st:
        phy = st.put(Message("T", b"poison")).commit_log_offset
        st.wait_dispatched()
        with st.simple_consumer("G", "T", retry_policy=RetryPolicy(0, (0,))) as c:
            monkeypatch.setattr(st, "look", FlakyLook(st, {phy}, 1))
            got = c.receive(4)
            assert [m.body for m in got] == [b"poison"]
            c.nack(got[0])
            assert c.receive(4) == []  # parked; its move found the bucket down
            st.wait_dispatched()
            assert st.get("%DLQ%G", 0, 0, 32).messages == []
            assert DeadLetterMover(st, st.paths.config).run() == 1  # the bucket answers again
            st.wait_dispatched()
            assert [m.body for m in st.get("%DLQ%G", 0, 0, 32).messages] == [b"poison"]
            assert c.receive(4) == []


def test_a_delay_message_that_cannot_be_read_for_now_is_delivered_later(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(tmp_path / "s")
    with MessageStore.open(root, SMALL) as st:
        at = int(time.time() * 1000) + 200
        assert st.put(Message("Later", b"delayed", deliver_at=at)).ok
        st.wait_dispatched()
        timer_phy = st.get("rmq_sys_wheel_timer", 0, 0, 1).messages[0].commit_log_offset
        flaky = FlakyLook(st, {timer_phy}, 1)
        monkeypatch.setattr(st, "look", flaky)
        end = time.time() + 6
        got: list = []
        while time.time() < end and not got:
            st.wait_dispatched(1)
            got = st.get("Later", 0, 0, 32).messages
            time.sleep(0.02)
        assert flaky.left == 0, "the timer never tried to read it"
        assert [m.body for m in got] == [b"delayed"], "the delay message was dropped"


def test_a_redelivery_that_cannot_read_its_message_for_now_keeps_it(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A nacked message due again, its record unreadable for now at the receive: it is not delivered this time
    and not dropped (dropping acks it: the group would never see it again); the next receive delivers it."""
    root = str(tmp_path / "s")
    with MessageStore.open(root, SMALL) as st:
        phy = st.put(Message("T", b"again")).commit_log_offset
        st.wait_dispatched()
        with st.simple_consumer("G", "T", retry_policy=RetryPolicy(3, (0,))) as c:
            got = c.receive(4)
            assert [m.body for m in got] == [b"again"]
            c.nack(got[0])
            monkeypatch.setattr(st, "look", FlakyLook(st, {phy}, 1))
            assert c.receive(4) == []  # the bucket is down
            got = c.receive(4)
            assert [(m.body, m.delivery_attempt) for m in got] == [(b"again", 2)]
            c.ack(got[0])
