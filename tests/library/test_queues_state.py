"""The shared pop state's files (issue 27): the journal survives a write cut short, a stale journal is
ignored, compaction keeps everything, and an ack is durable (ack_sync_flush) before ack() returns."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.queues import ReceiptHandleError, journal, state
from rocketstore.queues.pop import PopService, TagFilter
from rocketstore.storage.consumer_offsets import ConsumerOffsetManager, read_json_lenient


@pytest.fixture
def store(tmp_path: Path):
    with MessageStore.open(str(tmp_path / "s"), StoreConfig()) as st:
        for i in range(6):
            st.put(Message("T", f"m{i}".encode()))
        assert st.wait_dispatched()
        yield st


def paths(store: MessageStore) -> tuple[Path, Path]:
    config = Path(store.root) / "config"
    return config / "popState.json", config / "popState.journal"


def test_a_journal_line_cut_short_is_ignored_and_cut_off_before_the_next_append(store: MessageStore) -> None:
    with store.simple_consumer("G", "T", ack_sync_flush=True) as c:
        first = c.receive(2)
        c.ack(first[0])
    _, jpath = paths(store)
    whole = jpath.read_bytes()
    with open(jpath, "ab") as fh:
        fh.write(b'{"group":"G","topic":"T","queueId":0,"committed":6,"next":6,"ent')  # a crash mid-append
    with store.simple_consumer("G", "T", ack_sync_flush=True) as c:
        got = c.receive(10)
        assert [m.body for m in got] == [b"m2", b"m3", b"m4", b"m5"]  # m1 still in flight, m0 acked
        c.ack(got[0])
    data = jpath.read_bytes()
    assert data.startswith(whole) and b'"ent{' not in data and data.endswith(b"\n")
    assert b'"committed":6,"next":6,"ent' not in data


def test_a_journal_of_an_older_popstate_is_ignored(store: MessageStore) -> None:
    with store.simple_consumer("G", "T", ack_sync_flush=True) as c:
        assert len(c.receive(6)) == 6  # all in flight, journaled
    spath, _ = paths(store)
    config = str(spath.parent)
    # The broker writes popState.json afresh (its own state: nothing received): the journal is now stale.
    pop = PopService(store, ConsumerOffsetManager(config), config, load=False)
    pop.write([])
    with store.simple_consumer("G", "T") as c:
        assert len(c.receive(10)) == 6  # the stale journal's in-flight entries did not come back


def test_compaction_keeps_the_state_and_starts_a_new_journal(store: MessageStore, monkeypatch) -> None:
    monkeypatch.setattr(state, "COMPACT_BYTES", 1)
    spath, jpath = paths(store)
    with store.simple_consumer("G", "T", ack_sync_flush=True) as c:
        got = c.receive(3)
        c.ack(got[1])
    base = read_json_lenient(str(spath))
    assert base["id"] and jpath.read_bytes() == journal.header(base["id"])
    [q] = base["queues"]
    assert sorted(e[0] for e in q["entries"]) == [0, 2] and q["acked"] == [[1, 2]]
    with store.simple_consumer("G", "T") as c:
        assert [m.body for m in c.receive(10)] == [b"m3", b"m4", b"m5"]


def test_broker_loads_the_journal(store: MessageStore) -> None:
    with store.simple_consumer("G", "T", ack_sync_flush=True) as c:
        got = c.receive(2)
        c.ack(got[0])
    spath, _ = paths(store)
    config = str(spath.parent)
    pop = PopService(store, ConsumerOffsetManager(config), config)
    out, _ = pop.receive("G", "T", [0], 10, 60_000, TagFilter("*"), fifo=False, max_attempts=17, client="b",
                         auto_renew=False)
    assert [d.entry.offset for d in out] == [2, 3, 4, 5]  # 0 acked, 1 in flight: as the library left them


def test_non_durable_acks_are_gathered_until_receive_or_close(store: MessageStore) -> None:
    with store.simple_consumer("G", "T") as c:
        got = c.receive(2)
        size = os.path.getsize(paths(store)[1])
        c.ack(got[0])
        assert os.path.getsize(paths(store)[1]) == size  # the documented window: not written yet
        c.receive(1)
        assert os.path.getsize(paths(store)[1]) > size


def test_ack_sync_flush_config_key_makes_each_ack_durable_before_it_returns(tmp_path: Path) -> None:
    with MessageStore.open(str(tmp_path / "s"), StoreConfig(ackSyncFlush=True)) as st:
        st.put(Message("T", b"a"))
        assert st.wait_dispatched()
        with st.simple_consumer("G", "T") as c:
            assert c.ack_sync_flush
            m = c.receive(1)[0]
            size = os.path.getsize(paths(st)[1])
            c.ack(m)
            assert os.path.getsize(paths(st)[1]) > size  # written (and fsynced) before ack() returned
            with pytest.raises(ReceiptHandleError):
                c.ack(m)  # acked already: the handle is unknown now


def test_a_broker_and_library_receivers_never_share_the_pop_state(store: MessageStore) -> None:
    """The broker keeps the pop state in memory and writes snapshots over what library receivers journal: each
    side is refused while the other holds config/popState.owner (no hang, the other side named), and either
    may go once the other has stopped."""
    import asyncio

    from rocketstore.broker.broker import Broker
    from rocketstore.broker.config import BrokerConfig
    from rocketstore.errors import StoreLockedError

    c = store.simple_consumer("G", "T")
    broker = Broker(store, BrokerConfig())
    with pytest.raises(StoreLockedError, match="SimpleConsumer receivers"):
        asyncio.run(broker.start())
    c.close()

    async def serve_then_try() -> None:
        await broker.start()
        try:
            with pytest.raises(StoreLockedError, match=r"a broker \(broker pid \d+\) serves this store"):
                store.simple_consumer("G", "T")
        finally:
            await broker.stop()

    asyncio.run(serve_then_try())
    with store.simple_consumer("G", "T") as again:  # the broker stopped: the library may go on
        assert [m.body for m in again.receive(6)] == [f"m{i}".encode() for i in range(6)]


def test_a_receiver_whose_view_is_a_moment_older_keeps_the_others_in_flight_messages(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    """A receiver extends its read-only view before taking the state lock, so another receiver's journal record
    may name messages its view does not hold yet: the record is taken as written (clamping it to the older view
    forgot them, and they were handed out a second time while invisible), and such a message due again is left
    for the next look (not dropped as deleted from the store)."""
    import rocketstore
    from rocketstore import Message, MessageStore, StoreConfig

    root = str(tmp_path / "s")
    real = rocketstore.extend_view
    with MessageStore.open(root, StoreConfig()) as w:
        w.put(Message("T", b"m0"))
        w.wait_dispatched()
        with MessageStore.open(root, read_only=True) as r1, MessageStore.open(root, read_only=True) as r2:
            c1 = r1.simple_consumer("G", "T", ack_sync_flush=True, invisible_duration=0.3)
            c2 = r2.simple_consumer("G", "T", ack_sync_flush=True)
            assert [m.body for m in c2.receive(4)] == [b"m0"]
            monkeypatch.setattr(rocketstore, "extend_view", lambda st, topics: False if st is r2 else real(st, topics))
            w.put(Message("T", b"m1"))  # c2's view stays at m0 for now
            w.put(Message("T", b"m2"))
            w.wait_dispatched()
            assert [m.body for m in c1.receive(4)] == [b"m1", b"m2"]
            assert c2.receive(4) == []  # in flight with c1 (the record names them; c2's view does not hold them)
            time.sleep(0.35)
            assert c2.receive(4) == []  # due again, but not in c2's view yet: not dropped as gone from the store
            monkeypatch.setattr(rocketstore, "extend_view", real)
            again = c2.receive(4, wait=1.0)
            assert [(m.body, m.delivery_attempt) for m in again] == [(b"m1", 2), (b"m2", 2)]
            c1.close()
            c2.close()


def test_the_broker_dead_letters_a_message_library_receivers_parked(store: MessageStore, monkeypatch) -> None:
    """A message parked for the DLQ by library receivers (no writer moved it) in a store the broker then serves:
    the broker's PopService keeps it parked (never delivers it) and the shared protocol moves it, once."""
    from rocketstore.queues.revive import DeadLetterMover, DeadLetterMoves
    from rocketstore.queues import RetryPolicy

    monkeypatch.setattr(DeadLetterMover, "run", lambda self: 0)  # nobody moves it
    with store.simple_consumer("G", "T", retry_policy=RetryPolicy(0, (0,))) as c:
        first = c.receive(1)
        c.nack(first[0])
        assert [m.body for m in c.receive(5)] == [b"m1", b"m2", b"m3", b"m4", b"m5"]  # m0 parked, not delivered
    spath, _ = paths(store)
    config = str(spath.parent)
    pop = PopService(store, ConsumerOffsetManager(config), config)
    out, dead = pop.receive("G", "T", [0], 10, 60_000, TagFilter("*"), fifo=False, max_attempts=1, client="b",
                            auto_renew=False)
    assert out == [] and dead == [] and [d.entry.offset for d in pop.parked()] == [0]
    moves = DeadLetterMoves(store, pop)
    assert moves.mark() is False
    [d] = moves.marked()
    assert moves.placed(d, store.put(moves.letter(d))) and pop.parked() == []
    assert store.wait_dispatched(10)
    got = store.get("%DLQ%G", 0, 0, 10).messages
    assert [m.body for m in got] == [b"m0"] and got[0].properties["DLQ_ORIGIN_TOPIC"] == "T"


def test_a_queue_record_is_written_as_json_dumps_would_and_reads_back() -> None:
    """QueueState.to_text writes its JSON by hand (speed): the same text as json.dumps of the record, for
    awkward strings (quotes, backslashes, control and non-ASCII characters), None tags and parked entries."""
    import json
    import random

    from rocketstore.queues.pop import PARKED, Entry, QueueState

    rnd = random.Random(7)
    texts = ["", "a", 'q"uo\\te', "tab\tnl\n\x01", "ünï \u2028 \U0001f600", "||", None]
    for _ in range(200):
        qs = QueueState(rnd.choice(["G", 'g"1', "gr\u00fcppe"]), rnd.choice(["T", "%RETRY%x", "t\\\\"]),
                        rnd.randrange(8), rnd.randrange(1 << 40), rnd.random() < 0.5)
        qs.next = qs.committed + 50
        qs.acked = {qs.committed + rnd.randrange(50) for _ in range(rnd.randrange(10))}
        for off in rnd.sample(range(qs.committed, qs.next), rnd.randrange(6)):
            e = Entry(off, rnd.randrange(1 << 50), rnd.randrange(1 << 20), rnd.choice(texts), rnd.choice(texts),
                      rnd.randrange(20), rnd.randrange(1 << 42), rnd.choice(["", "ab12f", 'x"y']),
                      rnd.random() < 0.5, rnd.random() < 0.5, rnd.choice(["", "123-4", "c\u00e9"]),
                      rnd.randrange(1 << 42), rnd.random() < 0.5, rnd.randrange(1 << 20))
            if rnd.random() < 0.3:
                e.parked, e.dlq_from = True, rnd.randrange(-1, 1000)
            qs.entries[off] = e
        ranges: list[list[int]] = []
        for o in sorted(qs.acked):
            if ranges and ranges[-1][1] == o:
                ranges[-1][1] = o + 1
            else:
                ranges.append([o, o + 1])
        entries = [[e.offset, e.phy, e.size, e.attempts, e.visible_at, e.token, e.tag, e.msg_group, e.blocked,
                    e.auto_renew, e.client, e.first_pop, e.suspend, e.invisible_ms]
                   + ([PARKED, e.dlq_from] if e.parked else []) for _, e in sorted(qs.entries.items())]
        record = {"group": qs.group, "topic": qs.topic, "queueId": qs.queue_id, "committed": qs.committed,
                  "next": qs.next, "fifo": qs.fifo, "acked": ranges, "entries": entries}
        text = qs.to_text()
        assert text == json.dumps(record, ensure_ascii=False, separators=(",", ":"))
        back = [Entry.from_json(a) for a in json.loads(text)["entries"]]
        assert back == [e for _, e in sorted(qs.entries.items())]


def test_an_operation_that_failed_is_forgotten_not_written_by_close(store: MessageStore) -> None:
    """Found with session 16's one-flush dead-letter round: an operation that raised inside ``locked()`` had
    its changes left in the in-memory state, unjournaled, and close() wrote them into consumerOffset.json (the
    old mover, killed by an error at its second put after settling the first letter, committed past a
    message whose copy then stood for a resend with the same UNIQ_KEY: the resend never reached the DLQ).
    Now the state of a failed operation is dropped: close writes nothing of it, the next operation reads the
    files again."""
    with store.simple_consumer("G", "T", invisible_duration=60) as c:
        m = c.receive(1)[0]
        qid = m.message.queue_id
        with pytest.raises(RuntimeError, match="failed"):
            with c.state.locked() as pop:
                assert pop.ack("G", "T", m.receipt_handle)
                raise RuntimeError("the operation failed after the ack")
    assert ConsumerOffsetManager(str(Path(store.root) / "config")).get("T", "G", qid) in (None, 0)
    with store.simple_consumer("G", "T", invisible_duration=60) as c:
        got = c.receive(8)
        assert len(got) == 5 and m.message.commit_log_offset not in [d.message.commit_log_offset for d in got]
        c.ack(m)  # the handle is still good: the failed ack was not taken
        c.flush()
    assert ConsumerOffsetManager(str(Path(store.root) / "config")).get("T", "G", qid) == 1



def test_a_load_cut_short_by_a_lost_queue_is_not_used_half_loaded(tmp_path: Path, monkeypatch) -> None:
    """A read-only receiver's reload of the pop state (another process compacted it) stopped at a queue its
    store holds as lost (the lost-queue error, raised while clamping that queue's state): the queues after it
    were never loaded, yet the next call took the half-loaded state as current (the files had not changed)
    and handed out a message another receiver held in flight, as new.  Now a load cut short is dropped: the
    next call loads again (and refuses again while the queue is lost)."""
    import shutil

    from rocketstore.errors import CorruptRecordError
    monkeypatch.setattr(state, "COMPACT_BYTES", 1)  # every journal append rewrites popState.json
    root = str(tmp_path / "s")
    with MessageStore.open(root, StoreConfig()) as w:
        w.put(Message("T", b"t0"))
        assert w.wait_dispatched()
        shutil.rmtree(Path(root) / "consumequeue" / "T")  # (the writer keeps its open queue)
        with MessageStore.open(root, read_only=True) as r, \
                r.simple_consumer("GZ", "F", invisible_duration=60) as c:
            assert c.receive(8) == []  # its state loaded: nothing of T in it yet
            with w.simple_consumer("GT", "T", invisible_duration=60) as x:
                assert [m.body for m in x.receive(1)] == [b"t0"]
            w.put(Message("F", b"f0"))
            assert w.wait_dispatched()
            with w.simple_consumer("GZ", "F", invisible_duration=60) as z:
                assert [m.body for m in z.receive(1)] == [b"f0"]  # held in flight; GZ/F after GT/T
            for _ in range(2):  # (the second call handed out f0, attempt 1, from the half-loaded state)
                with pytest.raises(CorruptRecordError, match="a lost consume queue"):
                    c.receive(8)
