"""The writer's dead-letter mover (issue 27): a message parked for %DLQ%<group> by a read-only receiver lands
there exactly once, also when the writer dies between the DLQ put and the state write."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.queues import RetryPolicy
from rocketstore.queues.revive import DeadLetterMover, DeadLetterService


def park_two_with_one_uniq_key(root: str) -> None:
    """Two messages with the same UNIQ_KEY and born time (a producer's resend), both dead: parked by a
    read-only receiver while the writer moves nothing."""
    with MessageStore.open(root, StoreConfig()) as st:
        for body in (b"first", b"resent"):
            assert st.put(Message("T", body, properties={"UNIQ_KEY": "ID-1"}, born_timestamp=1_700_000_000_000)).ok
        st.wait_dispatched()
    with MessageStore.open(root, read_only=True) as r:
        with r.simple_consumer("G", "T", retry_policy=RetryPolicy(0, (0,))) as c:
            got = c.receive(8)
            assert sorted(m.body for m in got) == [b"first", b"resent"]
            for m in got:
                c.nack(m)
            assert c.receive(8) == []  # both parked (maxReconsumeTimes 0)
            assert c.receive(8) == []


def dlq_bodies(st: MessageStore) -> list[bytes]:
    st.wait_dispatched()
    return sorted(m.body for m in st.get("%DLQ%G", 0, 0, 32).messages)


def test_a_move_cut_short_after_the_put_is_settled_at_restart_never_put_twice(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(tmp_path / "s")
    park_two_with_one_uniq_key(root)
    run_once = DeadLetterService.run_once
    monkeypatch.setattr(DeadLetterService, "run_once", lambda self: None)  # the test drives the mover
    with MessageStore.open(root, StoreConfig()) as st:
        real, puts = st.put, []

        def crash(msg: Message, *a: object, **kw: object) -> object:
            # (a round puts all its dead letters, flushes once, then settles them: killed after the first put)
            if puts:
                raise RuntimeError("killed between the DLQ put and the state write")
            puts.append(msg)
            return real(msg, *a, **kw)

        monkeypatch.setattr(st, "put", crash)
        with pytest.raises(RuntimeError, match="killed"):
            DeadLetterMover(st, st.paths.config).run()
        monkeypatch.setattr(st, "put", real)
        assert dlq_bodies(st) == [b"first"]  # put; its state write never happened
    monkeypatch.setattr(DeadLetterService, "run_once", run_once)
    with MessageStore.open(root, StoreConfig()) as st:  # the restart: the service settles and moves the rest
        for _ in range(200):
            if len(dlq_bodies(st)) >= 2:
                break
            time.sleep(0.02)
        assert dlq_bodies(st) == [b"first", b"resent"]  # first found (not put again); resent put (not mistaken
        #                                                 for first's copy: same UNIQ_KEY and born time)
        assert DeadLetterMover(st, st.paths.config).run() == 0
        with st.simple_consumer("G", "T") as c:
            assert c.receive(8, wait=0.2) == []
    with MessageStore.open(root, StoreConfig()) as st:
        assert dlq_bodies(st) == [b"first", b"resent"]


def test_a_receiver_on_the_writer_moves_its_dead_letters_at_once(tmp_path: Path) -> None:
    root = str(tmp_path / "s")
    with MessageStore.open(root, StoreConfig()) as st:
        assert st.put(Message("T", b"x")).ok
        st.wait_dispatched()
        with st.simple_consumer("G", "T", retry_policy=RetryPolicy(0, (0,))) as c:
            c.nack(c.receive(1)[0])
            assert c.receive(1) == []
            assert st.wait_dispatched()  # the put was made by then; a moment for its consume queue unit
        assert [m.body for m in st.get("%DLQ%G", 0, 0, 8).messages] == [b"x"]


def test_a_writable_open_with_nothing_parked_leaves_the_queue_state_alone(tmp_path: Path) -> None:
    """The service looks for the parked mark in the files first: a store with queue state but nothing parked is
    not loaded nor written (no consumerOffset.json write behind an operator's back at every open)."""
    root = str(tmp_path / "s")
    with MessageStore.open(root, StoreConfig()) as st:
        assert st.put(Message("T", b"x")).ok
        st.wait_dispatched()
        with st.simple_consumer("G", "T") as c:
            c.ack(c.receive(1)[0])
    config = Path(root, "config")
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in config.iterdir() if p.is_file()}
    with MessageStore.open(root, StoreConfig()) as st:
        time.sleep(0.3)  # the service's first round
        assert st.dead_letters is not None and not st.dead_letters.stopped
    after = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in config.iterdir() if p.is_file()}
    assert {n: v for n, v in after.items() if n.startswith(("popState", "consumerOffset"))} == \
        {n: v for n, v in before.items() if n.startswith(("popState", "consumerOffset"))}


def _record_placed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record each ``DeadLetterMoves.placed`` (a message let go) in the returned list, and keep the store's own
    dead-letter service idle: the test drives the moves."""
    from rocketstore.queues.revive import DeadLetterMoves
    calls: list[str] = []
    real_placed = DeadLetterMoves.placed

    def placed(self, d, res):
        calls.append("placed")
        return real_placed(self, d, res)
    monkeypatch.setattr(DeadLetterMoves, "placed", placed)
    monkeypatch.setattr(DeadLetterService, "run_once", lambda self: None)
    return calls


def test_one_flush_makes_a_rounds_dead_letters_durable_before_any_leaves_the_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mover fsynced the commitlog once per dead letter (session 15's review): one make_puts_durable after
    all of a round's puts, before the first ``placed`` lets a message go, serves the whole round.  The two
    messages share a UNIQ_KEY and born time (a resend): the second's look for a copy must not take the first's
    dead letter, put a moment before and not yet settled, for its own: each is put once."""
    root = str(tmp_path / "s")
    park_two_with_one_uniq_key(root)
    calls = _record_placed(monkeypatch)
    with MessageStore.open(root, StoreConfig()) as st:
        real_put, real_durable = st.put, st.make_puts_durable

        def put(msg, *a, **kw):
            calls.append(f"put {msg.topic}")
            return real_put(msg, *a, **kw)

        def durable():
            calls.append("flush")
            return real_durable()
        monkeypatch.setattr(st, "put", put)
        monkeypatch.setattr(st, "make_puts_durable", durable)
        st.wait_dispatched()
        assert DeadLetterMover(st, st.paths.config).run() == 2
        assert calls == ["put %DLQ%G", "put %DLQ%G", "flush", "placed", "placed"]
        assert dlq_bodies(st) == [b"first", b"resent"]
        assert DeadLetterMover(st, st.paths.config).run() == 0
        assert dlq_bodies(st) == [b"first", b"resent"]


def test_the_brokers_round_makes_its_dead_letters_durable_with_one_flush(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker's round (broker/deadletters.py) on the same protocol: its puts, one make_puts_durable, then
    the ``placed`` calls that let the messages go (it flushed once per letter).  A stand-in broker over a real
    store and the pop state the read-only receivers parked the two messages in."""
    import asyncio
    from types import SimpleNamespace

    from rocketstore.broker.deadletters import BrokerDeadLetters
    from rocketstore.queues.pop import PopService
    from rocketstore.storage.consumer_offsets import ConsumerOffsetManager
    root = str(tmp_path / "s")
    park_two_with_one_uniq_key(root)
    calls = _record_placed(monkeypatch)
    with MessageStore.open(root, StoreConfig()) as st:
        real_durable = st.make_puts_durable

        def durable():
            calls.append("flush")
            return real_durable()
        monkeypatch.setattr(st, "make_puts_durable", durable)

        async def ensure_dlq_topic(group: str) -> None:
            return None

        class Broker:
            store, store_host = st, None
            pop = PopService(st, ConsumerOffsetManager(st.paths.config), st.paths.config)
            topics = SimpleNamespace(ensure_dlq_topic=ensure_dlq_topic)

            async def persist(self, *, final: bool = False) -> bool:
                return True

            async def put(self, msg: Message):
                calls.append(f"put {msg.topic}")
                return st.put(msg)

            def notify(self, topic: str, *a: object) -> None:
                pass
        assert asyncio.run(BrokerDeadLetters(Broker()).move()) == 2
        assert calls == ["put %DLQ%G", "put %DLQ%G", "flush", "placed", "placed"]
        assert dlq_bodies(st) == [b"first", b"resent"]
