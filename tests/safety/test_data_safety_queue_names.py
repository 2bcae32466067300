"""Session 12 writes the queue records of popState.json and its journal by hand (pop.QueueState.to_text) and
reads the journal line by line, keyed by the record's first bytes (journal._latest_records).  Attacked with
names a user may pick: groups, topics, tags and FIFO message groups with quotes, backslashes, control characters,
Unicode line separators (U+0085, U+2028: ``str.splitlines`` would cut there), text that looks like the record's
own key end (``,"committed":``), a group whose record begins like another's, non-BMP characters.  An ack must hold
and nothing may be lost, read from the journal (a second process's view) and after the compaction of a close."""

from __future__ import annotations

import time

import pytest

from rocketstore import Message, MessageStore, StoreConfig

NAMES = ['G"q\\b', "G\x01\t\n", "G\x85\u2028\u2029", 'G","committed":99,"x":"', 'G","topic":"T', "G",
         "G\U0001f600\u00e9", "G\x1c\x1d\x1e"]
TOPIC = "T%|-_x"  # topics are checked (ASCII letters, digits, %|-_): the awkward ones are refused at the put
TAGS = ['a"b', "c\u2028d", "e\\f"]
SMALL = StoreConfig(mappedFileSizeCommitLog=256 * 1024, mappedFileSizeConsumeQueue=600 * 20)


def _bodies(ms) -> list[bytes]:
    return sorted(m.body for m in ms)


def _receive_all(consumer, want: int, seconds: float = 5.0) -> list:
    got: list = []
    end = time.monotonic() + seconds
    while len(got) < want and time.monotonic() < end:
        got += consumer.receive(32, wait=0.05)
    return got


def test_awkward_names_keep_acks_and_in_flight_messages_through_the_journal_and_a_compaction(tmp_path):
    root = str(tmp_path / "s")
    store = MessageStore.open(root, SMALL)
    put = {}
    for i in range(12):
        body = b"m%02d" % i
        props = {"__SHARDINGKEY": f'k"{i % 3}\u2028'} if i % 2 else {}
        assert store.put(Message(TOPIC, body, queue_id=i % 2, tags=TAGS[i % 3], properties=props)).ok
        put[body] = TAGS[i % 3]
    assert store.wait_dispatched(10)
    acked: dict[str, set[bytes]] = {}
    for g in NAMES:
        c = store.simple_consumer(g, TOPIC, invisible_duration=0.4, ack_sync_flush=True)
        got = _receive_all(c, 12)
        assert _bodies(got) == sorted(put), (g, _bodies(got))
        assert all(m.tags == put[m.body] for m in got)
        done = acked[g] = set()
        for m in got:
            if m.body[-1] % 3:  # two thirds acked, one third left to come back
                c.ack(m)
                done.add(m.body)
        c.close()
    time.sleep(0.5)  # the unacked ones are visible again
    # A second process's view reads the writer's journal (no compaction has run)
    follower = MessageStore.open(root, SMALL, read_only=True)
    try:
        for g in NAMES:
            c = follower.simple_consumer(g, TOPIC, invisible_duration=0.4)
            again = _receive_all(c, 12 - len(acked[g]), seconds=2.0)
            assert _bodies(again) == sorted(set(put) - acked[g]), (g, _bodies(again))
            c.close()
    finally:
        follower.close()
    store.close()
    time.sleep(0.5)
    with MessageStore.open(root, SMALL) as store:  # popState.json compacted by the close
        for g in NAMES:
            c = store.simple_consumer(g, TOPIC, invisible_duration=30)
            again = _receive_all(c, 12 - len(acked[g]), seconds=2.0)
            assert _bodies(again) == sorted(set(put) - acked[g]), (g, _bodies(again))
            c.close()


@pytest.mark.parametrize("where", ["group", "topic"])
def test_a_name_the_pop_state_cannot_encode_is_refused_at_once_and_others_are_untouched(tmp_path, where):
    """A lone surrogate: the receive used to take the message and fail writing the state (UnicodeEncodeError)."""
    with MessageStore.open(str(tmp_path / "s"), SMALL) as store:
        assert store.put(Message("T", b"one")).ok
        assert store.wait_dispatched(10)
        good = store.simple_consumer("Good", "T")
        bad = {"group": ("G\udc80", "T"), "topic": ("G", "T\udc80")}[where]
        with pytest.raises(ValueError, match="not encodable as UTF-8"):
            store.simple_consumer(*bad)
        [m] = _receive_all(good, 1)
        good.ack(m)
        good.close()
