"""The strict torn-tail rule after a power loss attacked with imported records (attack16).

After a reboot recovery refuses to cut a record whose header and body are intact (only its topic/properties
fail) when the checkpoint counts it as flushed, and refuses to cut damage with an intact record after it that
the checkpoint counts as flushed.  Counting by store time (before physicMsgTimestamp) takes every imported
record (its original store time, years back) for flushed: a record torn by the power cut while it was being
written, never acknowledged as durable, made the store refuse to open until ``verify --repair``.  The page's
physicFlushedOffset says where the last thorough flush ended: a record at or past it was not flushed."""

from __future__ import annotations

import shutil
import struct

import pytest

from helpers.powerloss import rebooted
from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.errors import CommitLogDamagedError
from rocketstore.format import codec
from rocketstore.storage.checkpoint import StoreCheckpoint

IMPORTED_AT = 1_500_000_000_000  # 2017: an imported message's original store time


def _cfg(**kw) -> StoreConfig:
    base = dict(mappedFileSizeCommitLog=64 * 1024, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=64,
                maxIndexNum=256, flushDiskType="ASYNC_FLUSH", warmAheadBytes=0, messageIndexEnable=False)
    base.update(kw)
    return StoreConfig(**base)


def _torn_import(tmp_path, *, tear_last: bool, lost: str = "tail"):
    """Live records flushed (a clean close); then imported records written (ASYNC_FLUSH, the commitlog not
    flushed again) and the power cut while they are in the page cache: the image keeps them, with the tail
    (properties) of one imported record lost (zeros, a sector that never reached the disk), or, ``lost="all"``,
    the whole record."""
    live, image = tmp_path / "live", tmp_path / "image"
    with MessageStore.open(str(live), _cfg()) as s:
        for i in range(6):
            assert s.put(Message("TopicT", bytes([65 + i]) * 700, queue_id=0, keys=[f"k{i}"])).ok
    slow = _cfg(flushIntervalCommitLog=600_000, flushCommitLogThoroughInterval=600_000,
                flushIntervalConsumeQueue=600_000, flushConsumeQueueThoroughInterval=600_000)
    s = MessageStore.open(str(live), slow)
    try:
        imported = [s.put(Message("TopicI", b"imported-%d|" % i + bytes(600), queue_id=0, keys=[f"i{i}"],
                              store_timestamp=IMPORTED_AT + i)) for i in range(4)]
        assert all(r.ok for r in imported)
        assert s.wait_dispatched()  # their queue units exist (in the page cache): past the log's recovered end
        shutil.copytree(live, image)
    finally:
        s.close()
    victim = imported[-1] if tear_last else imported[1]
    (seg,) = (image / "commitlog").iterdir()
    data = bytearray(seg.read_bytes())
    end = victim.commit_log_offset + victim.wrote_bytes
    h, topic_at, topic_len, _ = codec.parse(data, victim.commit_log_offset, len(data))
    props_at = topic_at + topic_len + 2
    start = props_at if lost == "tail" else victim.commit_log_offset
    data[start:end] = bytes(end - start)  # the sectors that never reached the disk
    seg.write_bytes(bytes(data))
    rebooted(image)
    return image, imported, victim


def test_a_torn_imported_record_at_the_end_is_cut_not_refused(tmp_path):
    image, imported, victim = _torn_import(tmp_path, tear_last=True)
    with MessageStore.open(str(image), _cfg(), start_services=False) as s:
        assert s.max_phy_offset() == victim.commit_log_offset
        assert s.max_offset_in_queue("TopicT", 0) == 6
        assert s.max_offset_in_queue("TopicI", 0) == 3


@pytest.mark.parametrize("lost", ["tail", "all"])
def test_damage_before_intact_imported_records_past_the_flush_is_a_torn_tail(tmp_path, lost):
    """Pages of a write reach the disk in any order: the records after the torn one were written after the
    last flush too (past physicFlushedOffset), whatever store time they carry."""
    image, imported, victim = _torn_import(tmp_path, tear_last=False, lost=lost)
    with MessageStore.open(str(image), _cfg(), start_services=False) as s:
        assert s.max_phy_offset() == victim.commit_log_offset
        assert s.max_offset_in_queue("TopicT", 0) == 6
        assert s.max_offset_in_queue("TopicI", 0) == 1


def test_a_damaged_imported_record_the_flush_covered_is_still_refused(tmp_path):
    """The guard the other way: imported records flushed (a clean close), one damaged after the power loss
    (its properties zeroed) with the live records after it: the offset counts it as flushed, so the open
    refuses and changes no commitlog byte."""
    store = tmp_path / "store"
    with MessageStore.open(str(store), _cfg()) as s:
        imported = [s.put(Message("TopicI", b"imported-%d|" % i + bytes(600), queue_id=0, keys=[f"i{i}"],
                                  store_timestamp=IMPORTED_AT + i)) for i in range(4)]
        for i in range(3):
            assert s.put(Message("TopicT", bytes([65 + i]) * 700, queue_id=0, keys=[f"k{i}"])).ok
    victim = imported[2]
    (seg,) = (store / "commitlog").iterdir()
    data = bytearray(seg.read_bytes())
    h, topic_at, topic_len, _ = codec.parse(data, victim.commit_log_offset, len(data))
    end = victim.commit_log_offset + victim.wrote_bytes
    data[topic_at + topic_len + 2:end] = bytes(end - topic_at - topic_len - 2)
    seg.write_bytes(bytes(data))
    rebooted(store)
    with pytest.raises(CommitLogDamagedError, match="physicFlushedOffset"):
        MessageStore.open(str(store), _cfg(), start_services=False)
    assert seg.read_bytes() == bytes(data)


def test_a_page_rocketmq_rewrote_leaves_the_flushed_decision_to_the_store_times(tmp_path):
    """RocketMQ rewrites its five longs and leaves the rest of the page: the offset is then older than the
    times, and taking it would count records RocketMQ flushed after it as torn writes.  The stamp (the
    physicMsgTimestamp the offset was written with) no longer matches: the offset is not used for it (it still
    moves recovery's start back)."""
    path = str(tmp_path / "checkpoint")
    cp = StoreCheckpoint.load(path)
    cp.note_physic_flushed(1_795_000_000_000, 9000)
    cp.logicsDispatchedOffset = 4500
    cp.flush()
    again = StoreCheckpoint.load(path)
    assert (again.flushed_offset(), again.recovery_offset()) == (9000, 4500)
    data = bytearray((tmp_path / "checkpoint").read_bytes())
    struct.pack_into(">5q", data, 0, 1_795_000_100_000, 1_795_000_100_000, 0, 0, 20000)  # RocketMQ's flush
    (tmp_path / "checkpoint").write_bytes(bytes(data))
    rewritten = StoreCheckpoint.load(path)
    assert (rewritten.flushed_offset(), rewritten.recovery_offset()) == (None, 4500)
    data[64:72] = bytes(8)  # a page of the version before the stamp: not used either
    struct.pack_into(">q", data, 0, 1_795_000_000_000)
    (tmp_path / "checkpoint").write_bytes(bytes(data))
    assert StoreCheckpoint.load(path).flushed_offset() is None
