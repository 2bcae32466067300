"""The broker's consumer state at a clean stop (tests/broker/test_broker.py::test_restart_keeps_offsets_and_inflight
failed once under load: no committed offset for the group in consumerOffset.json after a clean stop, 4 acks done).

``Broker.persist`` takes its snapshots (which clear the dirty flags) on the loop and writes them in the state
writer's thread.  ``stop()`` cancels the periodic persist task; cancelled while its write was still queued behind
the writer thread, the write was dropped (a pending executor job is cancelled with the task) and the final persist
found nothing dirty: the acks of the last second were in no file after a clean stop, and came back after the
restart.  The same holds for an ack's RPC cut by the server's grace with popAckSyncFlush.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest

from rocketstore.broker.broker import Broker
from rocketstore.broker.config import BrokerConfig
from rocketstore.config import StoreConfig
from rocketstore.format.message import Message
from rocketstore.queues.pop import TagFilter
from rocketstore.store import MessageStore

SMALL = StoreConfig(mappedFileSizeCommitLog=1024 * 1024, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=100,
                    maxIndexNum=400)


def _receive_and_ack(broker: Broker, n_ack: int) -> list[int]:
    out, dead = broker.pop.receive("G", "T", [0], 16, 10_000, TagFilter("*"), fifo=False, max_attempts=17,
                                   client="c1", auto_renew=False)
    assert len(out) == 6 and not dead
    for d in out[:n_ack]:
        assert broker.pop.ack("G", "T", broker.pop.handle_of(0, d.entry))
    return [d.entry.offset for d in out[n_ack:]]


def _run_stop_race(tmp_path: Path, cancel_during_write: bool) -> tuple[dict, dict]:
    root = str(tmp_path / "store")
    store = MessageStore.open(root, SMALL)
    for i in range(6):
        assert store.put(Message(topic="T", body=b"m%d" % i, queue_id=0)).ok
    assert store.wait_dispatched(10)

    async def main() -> None:
        broker = Broker(store, BrokerConfig(flushConsumerOffsetInterval=3_600_000))
        await broker.start()
        held = _receive_and_ack(broker, 4)
        assert held == [4, 5]
        gate = threading.Event()
        # The state writer thread is busy (a slow disk, a loaded machine): the periodic persist's write waits.
        broker.io_executor.submit(gate.wait, 10)
        periodic = asyncio.get_running_loop().create_task(broker.persist())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not broker.offsets.dirty, "the persist has taken its snapshot"
        if cancel_during_write:
            periodic.cancel()  # what stop() does to the periodic task
            try:
                await periodic
            except asyncio.CancelledError:
                pass
            gate.set()
            await broker.stop()
        else:
            stopping = asyncio.get_running_loop().create_task(broker.stop())
            for _ in range(20):
                await asyncio.sleep(0)
            gate.set()
            await stopping
            await periodic

    try:
        asyncio.run(main())
    finally:
        store.close()
    config = Path(root) / "config"
    return _read(config / "consumerOffset.json", {"offsetTable": {}}), _read(config / "popState.json", {"queues": []})


def _read(path: Path, missing: dict) -> dict:
    """The file's JSON; ``missing`` when the stop did not write it (what the old code did here)."""
    return json.loads(path.read_text()) if path.exists() else missing


def _pop_queue(pop: dict) -> dict:
    found = [q for q in pop["queues"] if q["group"] == "G" and q["topic"] == "T"]
    assert len(found) == 1, pop
    return found[0]


def test_a_clean_stop_writes_the_acks_whose_periodic_write_it_cancelled(tmp_path):
    """Fails on the old code: consumerOffset.json has no T@G entry (the flake's KeyError) and popState.json is not
    written at all, so the four acked messages would be delivered again after the restart."""
    offsets, pop = _run_stop_race(tmp_path, cancel_during_write=True)
    assert offsets["offsetTable"].get("T@G") == {"0": 4}, offsets
    q = _pop_queue(pop)
    assert q["committed"] == 4 and sorted(e[0] for e in q["entries"]) == [4, 5], q


def test_a_clean_stop_while_a_periodic_write_waits_keeps_its_order(tmp_path):
    """The ordinary path (stop while the periodic write is queued, not cancelled first): same files."""
    offsets, pop = _run_stop_race(tmp_path, cancel_during_write=False)
    assert offsets["offsetTable"].get("T@G") == {"0": 4}, offsets
    q = _pop_queue(pop)
    assert q["committed"] == 4 and sorted(e[0] for e in q["entries"]) == [4, 5], q


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), ValueError("a bug in a writer")])
def test_a_failed_state_write_is_written_by_the_next_persist(tmp_path, error):
    """The write fails (a full disk; or an unexpected error): persist says False, the changes stay dirty, and the
    next persist writes them (a failure is never left in the way of every later persist)."""
    root = str(tmp_path / "store")
    store = MessageStore.open(root, SMALL)
    for i in range(6):
        assert store.put(Message(topic="T", body=b"m%d" % i, queue_id=0)).ok
    assert store.wait_dispatched(10)

    async def main() -> tuple[bool, bool]:
        broker = Broker(store, BrokerConfig(flushConsumerOffsetInterval=3_600_000))
        await broker.start()
        _receive_and_ack(broker, 4)
        real = broker.offsets.write
        calls = []

        def failing(snapshot):
            calls.append(1)
            if len(calls) == 1:
                raise error
            real(snapshot)
        broker.offsets.write = failing
        first = await broker.persist()
        assert broker.offsets.dirty and broker.pop.dirty, "the failed write's changes are dirty again"
        second = await broker.persist()
        await broker.stop()
        return first, second

    try:
        first, second = asyncio.run(main())
    finally:
        store.close()
    assert (first, second) == (False, True)
    offsets = _read(Path(root) / "config" / "consumerOffset.json", {"offsetTable": {}})
    assert offsets["offsetTable"].get("T@G") == {"0": 4}, offsets
