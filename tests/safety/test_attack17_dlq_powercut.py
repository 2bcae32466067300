"""Attack 17: a message moved to ``%DLQ%<group>`` and a power cut (ASYNC_FLUSH).  The mover puts the dead letter,
then removes the message from the group's pop state and fsyncs the state's journal.  If the dead letter was still
only in the page cache, a power cut loses it while the state survives: the message is neither in its topic for
the group nor in the DLQ (lost), though it was durable before the move."""

from __future__ import annotations

import shutil
from pathlib import Path

from rocketstore.config import StoreConfig
from rocketstore.format.message import Message
from rocketstore.queues import RetryPolicy, SimpleConsumer
from rocketstore.store import MessageStore

SMALL = StoreConfig(mappedFileSizeCommitLog=1024 * 1024, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=100,
                    maxIndexNum=400)
DLQ = "%DLQ%G"
POLICY = RetryPolicy(0, (0,))  # one delivery, then the DLQ


def _dead_letters(s: MessageStore) -> list[bytes]:
    s.wait_dispatched(5)
    return [m.body for m in s.get(DLQ, 0, 0, 32).messages]


def test_a_dead_letter_is_durable_before_the_state_lets_its_message_go(tmp_path):
    """A durable message is delivered once, nacked, and moved to the DLQ at the next receive; the power cut is
    taken the moment after (the store's files less the commitlog bytes not fsynced yet).  Opening that image,
    the message must be in the DLQ, or be delivered to the group again: not lost."""
    root = tmp_path / "store"
    with MessageStore.open(str(root), SMALL) as s:
        assert s.put(Message("T", b"poison")).ok
    image = tmp_path / "image"
    with MessageStore.open(str(root), SMALL) as s:
        c = SimpleConsumer(s, "G", "T", retry_policy=POLICY, ack_sync_flush=True)
        got = c.receive(4)
        assert [m.body for m in got] == [b"poison"]
        c.nack(got[0])
        assert c.receive(4) == []
        assert _dead_letters(s) == [b"poison"]
        flushed = s.commitlog.queue.flushed_where
        shutil.copytree(root, image, ignore=shutil.ignore_patterns("lock"))
        c.close()
    with open(image / "commitlog" / "00000000000000000000", "r+b") as fh:
        fh.seek(flushed)
        fh.write(bytes(SMALL.mappedFileSizeCommitLog - flushed))
    with MessageStore.open(str(image), SMALL) as s:
        c = SimpleConsumer(s, "G", "T", retry_policy=POLICY, ack_sync_flush=True)
        again = [m.body for m in c.receive(4)]
        c.close()
        assert again + _dead_letters(s) == [b"poison"], "the message was lost"
