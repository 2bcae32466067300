"""Recovery's start segment attacked with store times that are not monotonic (attack15).

After a power loss recovery re-dispatches from the newest commitlog segment whose first record's store time is
at or before the checkpoint's min(physicMsgTimestamp, logicsMsgTimestamp) - 3 s (RocketMQ's
isMappedFileMatchedRecover): with monotonic store times every record before that segment was dispatched into
consume-queue files a thorough flush made durable.  An imported record keeps its original store time: first in
a segment it makes that segment the start whatever lies before it, and the records of the segment before,
their queue units lost with the unsynced consume-queue file, were never dispatched again."""

from __future__ import annotations

import shutil

from helpers.powerloss import lose_queue_units, rebooted
from rocketstore import Message, MessageStore, StoreConfig

IMPORTED_AT = 1_500_000_000_000  # 2017: an imported message's original store time


def _cfg() -> StoreConfig:
    """No index: its resume point would move the start back by chance (the index file is not flushed here)."""
    return StoreConfig(mappedFileSizeCommitLog=16 * 1024, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=64,
                       maxIndexNum=256, flushDiskType="SYNC_FLUSH", warmAheadBytes=0, messageIndexEnable=False)


def test_a_segment_starting_with_an_imported_record_is_no_recovery_start_past_undispatched_records(tmp_path):
    live, image = tmp_path / "live", tmp_path / "image"
    with MessageStore.open(str(live), _cfg()) as s:  # a thorough flush of everything: the checkpoint's times
        for i in range(4):
            assert s.put(Message("TopicA", b"a" * 700, queue_id=0)).ok
    quiet = _cfg()  # the consume queues are not flushed again before the power cut
    quiet.flushIntervalConsumeQueue = quiet.flushConsumeQueueThoroughInterval = 600_000
    s = MessageStore.open(str(live), quiet)
    try:
        first_seg = s.commitlog.queue.files[-1].file_from_offset
        acked = []
        while s.commitlog.queue.files[-1].file_from_offset == first_seg:  # SYNC_FLUSH puts, durable when acked
            r = s.put(Message("TopicB", b"b%05d" % len(acked) + b"b" * 700, queue_id=0))
            assert r.ok
            acked.append(r)
        # An imported message too big for what is left of the segment: the first record of the next one.
        imp = s.put(Message("TopicA", b"i" * (15 * 1024 + 400), queue_id=0, store_timestamp=IMPORTED_AT))
        assert imp.ok and imp.commit_log_offset % (16 * 1024) == 0
        assert s.wait_dispatched()
        assert s.max_offset_in_queue("TopicB", 0) == len(acked)
        shutil.copytree(live, image)  # the power cut: the commitlog is synced, TopicB's queue file only up to unit 5
    finally:
        s.close()
    lose_queue_units(image, "TopicB", 0, kept=5)  # only its first 5 units reached the disk
    rebooted(image)
    with MessageStore.open(str(image), _cfg(), start_services=False) as s:
        assert s.max_offset_in_queue("TopicB", 0) == len(acked)
