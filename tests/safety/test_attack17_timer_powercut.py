"""Attack 17: a delayed message's delivery and a power cut (ASYNC_FLUSH).  The timer puts the copy into the real
topic, then writes timerState.json durably (fsync) saying the message was delivered.  If the copy was still only
in the page cache (a small record waits up to the thorough flush interval), a power cut then loses the copy while
the state survives: the message, whose timer record was durable long before, would never be delivered."""

from __future__ import annotations

import shutil
import time

from rocketstore.config import StoreConfig
from rocketstore.format.message import Message
from rocketstore.queues.timer import TIMER_TOPIC
from rocketstore.store import MessageStore

SMALL = StoreConfig(mappedFileSizeCommitLog=1024 * 1024, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=100,
                    maxIndexNum=400)


def _delivered(s: MessageStore, topic: str, timeout: float) -> list:
    end = time.time() + timeout
    while True:
        s.wait_dispatched(1)
        got = s.get(topic, 0, 0, 32).messages
        if got or time.time() >= end:
            return got
        time.sleep(0.01)


def test_a_delivered_copy_is_durable_before_the_timer_state_says_delivered(tmp_path):
    """A delay message is put and the store closed (its timer record is durable); the next open's timer delivers
    it.  The power cut is taken the moment after: the store's files as they are, less the commitlog bytes not
    fsynced yet (zeros, as a preallocated segment reads after a reboot).  Opening that image, the message must be
    in its topic or be delivered again: it must not be lost."""
    root = tmp_path / "store"
    with MessageStore.open(str(root), SMALL) as s:
        assert s.put(Message("Later", b"after-a-while", deliver_at=int(time.time() * 1000) + 300)).ok
        durable_end = s.max_phy_offset()
    time.sleep(0.4)
    image = tmp_path / "image"
    with MessageStore.open(str(root), SMALL) as s:
        got = _delivered(s, "Later", 5)
        assert [m.body for m in got] == [b"after-a-while"]
        assert s.timer.scheduled_times() == []
        # the power cut: what fdatasync made durable, and every other file as written (the state was fsynced)
        flushed = s.commitlog.queue.flushed_where
        shutil.copytree(root, image, ignore=shutil.ignore_patterns("lock"))
    assert durable_end <= flushed
    seg = image / "commitlog" / "00000000000000000000"
    with open(seg, "r+b") as fh:
        fh.seek(flushed)
        fh.write(bytes(SMALL.mappedFileSizeCommitLog - flushed))
    with MessageStore.open(str(image), SMALL) as s:
        assert s.max_offset_in_queue(TIMER_TOPIC, 0) == 1  # the timer record survived the cut
        got = _delivered(s, "Later", 3)
        assert [m.body for m in got] == [b"after-a-while"], "the delayed message was lost"
        time.sleep(0.3)
        assert [m.body for m in s.get("Later", 0, 0, 32).messages] == [b"after-a-while"]


def test_a_failed_flush_after_a_delivery_leaves_the_doubt_for_the_next_start(tmp_path):
    """When the copies cannot be made durable, the state keeps them as "delivering" (written before the puts)
    and the timer delivers nothing more (a copy it put could not be recorded); the next start finds the copy that
    is there (not put twice) and delivers the message that was due meanwhile."""
    root = tmp_path / "store"
    now = int(time.time() * 1000)
    with MessageStore.open(str(root), SMALL) as s:
        s.timer.sync = lambda: False
        assert s.put(Message("Later", b"first", deliver_at=now + 200)).ok
        assert s.put(Message("Later", b"second", deliver_at=now + 900)).ok
        assert [m.body for m in _delivered(s, "Later", 5)] == [b"first"]
        state = (root / "config" / "timerState.json").read_text()
        assert '"delivering"' in state
        time.sleep(max(0.0, (now + 1200 - time.time() * 1000) / 1000))
        assert [m.body for m in s.get("Later", 0, 0, 32).messages] == [b"first"]  # frozen: nothing more
    assert (root / "config" / "timerState.json").read_text() == state
    with MessageStore.open(str(root), SMALL) as s:
        end = time.time() + 5
        while len(s.get("Later", 0, 0, 32).messages) < 2 and time.time() < end:
            s.wait_dispatched(1)
            time.sleep(0.01)
        time.sleep(0.3)
        s.wait_dispatched(1)
        assert [m.body for m in s.get("Later", 0, 0, 32).messages] == [b"first", b"second"]
