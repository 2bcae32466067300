"""A delay message whose record cannot be read for a long time (a tier segment the bucket lost, a disk that
keeps failing) held back every other delay message (attack19).

attack17 made the timer keep such a message due and try it again a second later instead of dropping it; the
second was a pause of the whole timer (``retry_at``): while the message stayed unreadable, every other
message came due waited for the next try, each up to a second late, and a round every second (at most
MAX_ROUND copies) capped the delivery rate.  The unreadable message alone now waits its second."""

from __future__ import annotations

from pathlib import Path

import pytest

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.errors import TierError
from rocketstore.queues.timer import TIMER_TOPIC, TimerService

SMALL = StoreConfig(mappedFileSizeCommitLog=1024 * 1024, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=100,
                    maxIndexNum=400)


def test_an_unreadable_delay_message_does_not_hold_back_the_others(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1_000.0]  # the store's clock, in seconds: the test drives the timer's rounds
    run_once = TimerService.run_once
    monkeypatch.setattr(TimerService, "run_once", lambda self: None)
    with MessageStore.open(str(tmp_path / "s"), SMALL, clock=lambda: now[0]) as st:
        assert st.put(Message("Later", b"stuck", deliver_at=1_000_050)).ok
        for i in range(3):
            assert st.put(Message("Later", b"next%d" % i, deliver_at=1_000_100 + 100 * i)).ok
        st.wait_dispatched()
        stuck = st.get(TIMER_TOPIC, 0, 0, 1).messages[0].commit_log_offset
        real = st.look

        def look(offset: int, **kw: object):
            if offset == stuck:
                raise TierError(f"commitlog/{offset:020d}: the bucket lost it (a test's lasting fault)")
            return real(offset, **kw)

        monkeypatch.setattr(st, "look", look)
        now[0] = 1_000.05
        run_once(st.timer)  # the stuck message is due: it cannot be read
        assert st.get("Later", 0, 0, 32).messages == []
        for i in range(3):
            now[0] += 0.1
            run_once(st.timer)
            st.wait_dispatched()
            got = [m.body for m in st.get("Later", 0, 0, 32).messages]
            assert got == [b"next%d" % j for j in range(i + 1)], (now[0], got)
        assert 1_000_050 <= min(st.timer.scheduled_times()) <= 1_002_000  # still due, tried again
        monkeypatch.setattr(st, "look", real)  # readable again
        now[0] += 1.0
        run_once(st.timer)
        st.wait_dispatched()
        assert [m.body for m in st.get("Later", 0, 0, 32).messages] == [b"next0", b"next1", b"next2", b"stuck"]
