"""A power cut that takes the commitlog's unflushed tail (ASYNC_FLUSH) with every record of a queue, found by the
queue model once its power cut also cuts the log (tests/safety/test_model_queues.py cut_log; seed 2 of the default
run): recovery cut all the queue's units and kept its first file, empty, while the queue registry kept its queue
offsets (the lost ones are not handed out again).  The next put was given queue offset 1, but its unit was written
at the empty file's start, unit 0: ``get`` at 0 raised "the record there is QT/2 offset 1 ... not the unit's
offset 0" and at 1 answered OFFSET_OVERFLOW_ONE: an acknowledged message nobody could read at its offset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rocketstore import GetMessageStatus, Message, MessageStore, StoreConfig

CONF = dict(mappedFileSizeCommitLog=64 * 1024, mappedFileSizeConsumeQueue=50 * 20, maxHashSlotNum=64,
            maxIndexNum=256, warmAheadBytes=0, flushDiskType="ASYNC_FLUSH")


def _power_cut_at(root: str, at: int, reopen: bool = True) -> None:
    """The image a power cut leaves when the log's pages from ``at`` on were never written back: zeros there, the
    abort file of another boot.  A writable open ran in between (the writer restarted after a crash, the page
    cache kept the records): it wrote the queue registry, durably, with the queues' next offsets."""
    if reopen:
        MessageStore.open(root, StoreConfig(**CONF)).close()
        assert Path(root, "config", "consumeQueues.registry").read_text().strip()
    seg = Path(root, "commitlog", "%020d" % (at - at % CONF["mappedFileSizeCommitLog"]))
    with open(seg, "r+b") as fh:
        length = fh.seek(0, 2)
        fh.seek(at % CONF["mappedFileSizeCommitLog"])
        fh.write(bytes(length - at % CONF["mappedFileSizeCommitLog"]))
    Path(root, "abort").write_text("4242")
    Path(root, "abort.bootid").write_text("boot-before-the-power-cut")


def _first_received(store: MessageStore, group: str = "G", tag_filter: str = "*") -> list[bytes]:
    """The bodies of ``group``'s first non-empty receive from QT (up to 2 s)."""
    with store.simple_consumer(group, "QT", tag_filter=tag_filter) as c:
        for _ in range(40):
            got = c.receive(8, wait=0.05)
            if got:
                return [m.body for m in got]
    return []


@pytest.mark.parametrize("kept,torn", [(0, 0), (0, 30), (3, 0), (3, 10)])
def test_the_next_put_after_a_lost_tail_took_a_queues_every_unit_is_read_at_its_offset(tmp_path, kept, torn):
    """``kept`` records of another queue stay before the cut; the lost queue's two records go (the cut at a
    record's start, or ``torn`` inside it)."""
    root = str(tmp_path / "s")
    with MessageStore.open(root, StoreConfig(**CONF)) as store:
        for i in range(kept):
            assert store.put(Message("Other", b"o%d" % i)).ok
        first = store.put(Message("QT", b"x" * 100 + b"lost-1", queue_id=2))
        assert store.put(Message("QT", b"x" * 100 + b"lost-2", queue_id=2)).ok
        assert store.wait_dispatched(10)
        lost_from = first.queue_offset
    _power_cut_at(root, first.commit_log_offset + torn)
    with MessageStore.open(root, StoreConfig(**CONF)) as store:
        lo, hi = store.min_offset_in_queue("QT", 2), store.max_offset_in_queue("QT", 2)
        new = store.put(Message("QT", b"after the power cut", queue_id=2))
        assert new.ok and new.queue_offset >= lost_from
        assert store.wait_dispatched(10)
        r = store.get("QT", 2, new.queue_offset, 32)
        assert r.status is GetMessageStatus.FOUND and [m.body for m in r.messages] == [b"after the power cut"], \
            (lo, hi, new.queue_offset, r.status, store.min_offset_in_queue("QT", 2),
             store.max_offset_in_queue("QT", 2))
        # a reader from the old end (a group whose state was clamped there) reaches it, skipping nothing
        r = store.get("QT", 2, lost_from, 32)
        if r.status is GetMessageStatus.OFFSET_TOO_SMALL:
            r = store.get("QT", 2, r.next_begin_offset, 32)
        assert [m.body for m in r.messages] == [b"after the power cut"], r.status
    with MessageStore.open(root, StoreConfig(**CONF)) as store:  # and again after a clean reopen
        r = store.get("QT", 2, new.queue_offset, 32)
        assert [m.body for m in r.messages] == [b"after the power cut"], r.status
        assert store.min_offset_in_queue("QT", 2) <= new.queue_offset < store.max_offset_in_queue("QT", 2)


def test_a_simple_consumer_whose_acks_outlived_the_lost_tail_gets_the_next_put(tmp_path):
    """The whole chain: the group acked both lost messages (ackSyncFlush, durable), the power cut took them; the
    writable open clamps the group's state (write_clamped_state) and the next put must be delivered."""
    root = str(tmp_path / "s")
    with MessageStore.open(root, StoreConfig(**CONF)) as store:
        first = store.put(Message("QT", b"x" * 100 + b"lost-1", queue_id=2))
        assert store.put(Message("QT", b"x" * 100 + b"lost-2", queue_id=2)).ok
        assert store.wait_dispatched(10)
        with store.simple_consumer("G", "QT", ack_sync_flush=True) as c:
            got = []
            for _ in range(20):
                got += c.receive(8, wait=0.05)
                if len(got) == 2:
                    break
            assert len(got) == 2
            for m in got:
                c.ack(m)
    _power_cut_at(root, first.commit_log_offset)
    with MessageStore.open(root, StoreConfig(**CONF)) as store:
        assert store.put(Message("QT", b"after the power cut", queue_id=2)).ok
        assert store.wait_dispatched(10)
        assert _first_received(store) == [b"after the power cut"]


def test_a_second_lost_tail_leaves_only_blank_units_and_the_queue_reads_as_empty(tmp_path):
    """The first unit after a lost tail sits behind blank units holding the queue's start; a second power cut
    takes it too.  The queue is then blank units only, and the commitlog holds no record of it: reads must not
    report damage (the queue model's walk raised "a blank unit ... a lost unit, not retention" at offset 0, and a
    receiver would stop there), and the next put is read at its offset."""
    root = str(tmp_path / "s")
    with MessageStore.open(root, StoreConfig(**CONF)) as store:
        first = store.put(Message("QT", b"x" * 100 + b"lost-1", queue_id=2))
        assert store.put(Message("QT", b"x" * 100 + b"lost-2", queue_id=2)).ok
    _power_cut_at(root, first.commit_log_offset)
    with MessageStore.open(root, StoreConfig(**CONF)) as store:
        second = store.put(Message("QT", b"x" * 100 + b"lost-3", queue_id=2))
        assert second.ok and second.queue_offset == 2
    _power_cut_at(root, second.commit_log_offset)
    with MessageStore.open(root, StoreConfig(**CONF)) as store:
        for off in range(0, 4):
            store.get("QT", 2, off, 32)  # no CorruptRecordError
        lo, hi = store.min_offset_in_queue("QT", 2), store.max_offset_in_queue("QT", 2)
        assert lo == hi, f"a queue of blank units only reads as empty, not {lo}..{hi}"
        new = store.put(Message("QT", b"after two power cuts", queue_id=2))
        assert new.ok and new.queue_offset >= 2  # (the lost offset 2 may be given again: group states were clamped)
        assert store.wait_dispatched(10)
        r = store.get("QT", 2, store.min_offset_in_queue("QT", 2), 32)
        assert [m.body for m in r.messages] == [b"after two power cuts"] and r.messages[0].queue_offset == \
            new.queue_offset
        assert _first_received(store) == [b"after two power cuts"]


def _cq(root: Path, file_units: int = 10):
    from rocketstore.storage.consume_queue import ConsumeQueue
    cq = ConsumeQueue(str(root), "QT", 2, 20 * file_units)
    Path(cq.directory).mkdir(parents=True, exist_ok=True)
    cq.load()
    return cq


@pytest.mark.parametrize("expired", [False, True])
def test_the_first_unit_of_a_queue_emptied_by_the_cut_goes_to_its_queue_offset(tmp_path, expired):
    """ConsumeQueue alone: every unit cut (truncate_dirty_logic, as recovery after a lost tail; the store-level
    tests above keep the file, empty), the next unit's queue offset past them.  ``expired``: the queue's first
    file had gone to retention, the cut takes the second (zeroed by the power cut) and the next unit belongs two
    files further."""
    cq = _cq(tmp_path)
    first = 10 if expired else 0
    for q in range(first + 3):
        assert cq.put_unit(100 * q, 100, q, q)
    if expired:
        cq.delete_expired_file(100 * first, 0)
        assert len(cq.queue.files) == 1
        f = cq.queue.files[0]
        f.zero_from(0, f.wrote_position)  # the power cut took the file's pages too: zeros, the file kept
    cq.truncate_dirty_logic(100 * first)  # the lost tail: every unit left goes
    nxt = first + 3 if not expired else 25  # the registry's next offset (expired: a later one, out of the file)
    assert cq.put_unit(100 * first, 100, 7, nxt)
    assert cq.get_unit(nxt) == (100 * first, 100, 7)
    assert cq.min_offset_in_queue == nxt and cq.max_offset_in_queue == nxt + 1
    cq.close()
    again = _cq(tmp_path)
    again.recover()
    assert again.get_unit(nxt) == (100 * first, 100, 7) and again.max_offset_in_queue == nxt + 1
    again.close()


def test_a_group_known_only_from_consumer_offsets_is_clamped_too(tmp_path):
    """Queue model seed 44 (the log cut): a group's receive passed over a message its filter does not take, so
    its committed offset (consumerOffset.json) went past it; the power cut took that message from the log and
    the pop state's journal (nothing fsynced: no ackSyncFlush), popState.json was never written.  The writable
    open's clamp (write_clamped_state) looked at popState.json and the journal only, found neither and did not
    look at consumerOffset.json, from which the group's queue state is then built: the next put at the lost
    offset, which the filter takes, was never delivered to the group."""
    root = str(tmp_path / "s")
    with MessageStore.open(root, StoreConfig(**CONF)) as store:
        lost = store.put(Message("QT", b"x" * 100 + b"not for GB", queue_id=0, tags="TagC"))
        assert store.wait_dispatched(10)
        with store.simple_consumer("GB", "QT", tag_filter="TagA || TagB") as c:
            assert c.receive(8, wait=0.05) == []  # passes over offset 0
    config = Path(root, "config")
    offsets = json.loads((config / "consumerOffset.json").read_text())
    assert offsets["offsetTable"]["QT@GB"]["0"] == 1, offsets
    for name in ("popState.json", "popState.journal"):  # never fsynced: the power cut took them
        if (config / name).exists():
            (config / name).unlink()
    _power_cut_at(root, lost.commit_log_offset, reopen=False)  # (no open since the put: its offset is given again)
    with MessageStore.open(root, StoreConfig(**CONF)) as store:
        new = store.put(Message("QT", b"for GB", queue_id=0, tags="TagA"))
        assert new.ok
        assert store.wait_dispatched(10)
        got = _first_received(store, "GB", "TagA || TagB")
        assert got == [b"for GB"], (new.queue_offset, got)


def test_a_committed_offset_past_the_end_in_consumer_offsets_alone_is_clamped_and_written(tmp_path):
    """Queue model seed 3188: the group's journal (fsynced by ackSyncFlush) ends its queue at the queue's end,
    but consumerOffset.json holds a later committed offset (its receive passed over a message the power cut then
    took from the log, and the file outlived the journal's unsynced tail).  The clamp took the journal's word, so
    nothing counted as past the end and the lowered offset was never written: every later load (a read-only
    receiver's as well) raised the committed offset from consumerOffset.json again, over the next put at that
    offset, which the group then never received."""
    root = str(tmp_path / "s")
    config = Path(root, "config")
    with MessageStore.open(root, StoreConfig(**CONF)) as store:
        assert store.put(Message("QT", b"first", queue_id=0, tags="TagA")).ok
        assert store.wait_dispatched(10)
        with store.simple_consumer("GB", "QT", tag_filter="TagA || TagB", ack_sync_flush=True) as c:
            [m] = c.receive(8, wait=0.05)
            c.ack(m)
        synced = (config / "popState.journal").read_bytes()  # what ackSyncFlush made durable
        lost = store.put(Message("QT", b"x" * 100 + b"not for GB", queue_id=0, tags="TagC"))
        assert store.wait_dispatched(10)
        with store.simple_consumer("GB", "QT", tag_filter="TagA || TagB") as c:
            assert c.receive(8, wait=0.05) == []  # passes over offset 1
    assert json.loads((config / "consumerOffset.json").read_text())["offsetTable"]["QT@GB"]["0"] == 2
    (config / "popState.journal").write_bytes(synced)  # the power cut took the journal's later bytes
    _power_cut_at(root, lost.commit_log_offset)
    with MessageStore.open(root, StoreConfig(**CONF)) as store:
        new = store.put(Message("QT", b"for GB", queue_id=0, tags="TagB"))
        assert new.ok and new.queue_offset == 1
        assert store.wait_dispatched(10)
        assert json.loads((config / "consumerOffset.json").read_text())["offsetTable"]["QT@GB"]["0"] == 1
        with MessageStore.open(root, StoreConfig(**CONF), read_only=True) as reader:
            assert _first_received(reader, "GB", "TagA || TagB") == [b"for GB"]
