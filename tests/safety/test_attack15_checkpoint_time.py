"""The checkpoint's physicMsgTimestamp attacked with store times that are not monotonic (attack15).

Recovery after a power loss refuses to truncate at damage when an intact record after it has a store time at or
before physicMsgTimestamp: that record was flushed, so the damage is no torn tail of unflushed writes.  The
inference holds only while every flushed record's store time is at or below physicMsgTimestamp.  An imported
record keeps its original store time (``rocketstore import``, a replay): flushed last, it set physicMsgTimestamp
back to a time years before the records flushed ahead of it, and damage among those after a later power loss
was truncated as a torn tail, deleting the durable records after it."""

from __future__ import annotations

import pytest

from helpers.powerloss import process_crashed, rebooted
from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.errors import CommitLogDamagedError
from rocketstore.format import codec
from rocketstore.storage.checkpoint import StoreCheckpoint

IMPORTED_AT = 1_500_000_000_000  # 2017: an imported message's original store time


def _cfg() -> StoreConfig:
    return StoreConfig(mappedFileSizeCommitLog=64 * 1024, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=64,
                       maxIndexNum=256, flushDiskType="SYNC_FLUSH", warmAheadBytes=0)


def _records(seg: bytes) -> list[tuple[int, int]]:
    out = []
    for pos, size, parsed, _ in codec.walk(seg, 0, len(seg), check_crc=True, parsed=True):
        if parsed is None or size == 0:
            break
        out.append((pos, size))
    return out


def test_an_imported_record_flushed_last_does_not_move_physic_msg_timestamp_back(tmp_path):
    store = tmp_path / "store"
    with MessageStore.open(str(store), _cfg()) as s:
        for i in range(12):  # live SYNC_FLUSH puts, each acknowledged once durable
            assert s.put(Message("TopicT", bytes([65 + i]) * 700, queue_id=0, keys=[f"k{i}"])).ok
        r = s.put(Message("TopicT", b"imported" * 50, queue_id=0, store_timestamp=IMPORTED_AT))
        assert r.ok and r.store_timestamp == IMPORTED_AT
    seg = sorted((store / "commitlog").iterdir())[0]
    data = bytearray(seg.read_bytes())
    recs = _records(data)
    assert len(recs) == 13
    cp = StoreCheckpoint.load(str(store / "checkpoint"))
    assert cp.physicMsgTimestamp == IMPORTED_AT < codec.read_store_timestamp(data, recs[6][0])  # the setting
    # A later power loss damages a flushed record in the middle (a body byte: BODYCRC fails).
    pos, _ = recs[5]
    h, topic_at, _, _ = codec.parse(data, pos, len(data))
    data[topic_at - 1 - h[16] + 10] ^= 0xFF
    seg.write_bytes(bytes(data))
    rebooted(store)
    with pytest.raises(CommitLogDamagedError) as e:  # not truncated at record 5 with records 6-12 after it
        MessageStore.open(str(store), _cfg(), start_services=False)
    assert str(recs[6][0]) in str(e.value) and "--repair" in str(e.value)
    assert seg.read_bytes() == bytes(data)


def test_records_a_recovery_synced_count_as_flushed_when_the_last_is_imported(tmp_path):
    """Store model seed 2253's case with an imported record last: recovery synced what a crashed writer left
    unflushed and moved physicMsgTimestamp to its last kept record's store time only when that was higher,
    so an old imported record last left it at the crashed writer's flush: damage among the synced records after
    a later power loss was truncated as a torn tail, deleting the durable records after it."""
    store = tmp_path / "store"
    with MessageStore.open(str(store), _cfg(), start_services=False) as s:
        for i in range(12):
            assert s.put(Message("TopicT", bytes([65 + i]) * 700, queue_id=0, keys=[f"k{i}"])).ok
        assert s.put(Message("TopicT", b"imported" * 50, queue_id=0, store_timestamp=IMPORTED_AT)).ok
    seg = sorted((store / "commitlog").iterdir())[0]
    recs = _records(seg.read_bytes())
    cp = StoreCheckpoint.load(str(store / "checkpoint"))  # the crashed writer's last thorough flush: none
    cp.physicMsgTimestamp = codec.read_store_timestamp(seg.read_bytes(), recs[0][0]) - 1
    cp.flush()
    process_crashed(store)
    with MessageStore.open(str(store), _cfg(), start_services=False) as s:  # recovery syncs what the writer left
        assert s.commitlog.max_offset() == recs[-1][0] + recs[-1][1]
    data = bytearray(seg.read_bytes())
    pos, _ = recs[5]
    h, topic_at, _, _ = codec.parse(data, pos, len(data))
    data[topic_at - 1 - h[16] + 10] ^= 0xFF
    seg.write_bytes(bytes(data))
    rebooted(store)
    with pytest.raises(CommitLogDamagedError) as e:
        MessageStore.open(str(store), _cfg(), start_services=False)
    assert str(recs[6][0]) in str(e.value) and "--repair" in str(e.value)
    assert seg.read_bytes() == bytes(data)
