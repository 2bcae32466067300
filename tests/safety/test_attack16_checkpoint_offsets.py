"""The checkpoint's recovery offsets attacked (attack16).

The page keeps, behind "RSTORE01" at 40, physicFlushedOffset (48) and logicsDispatchedOffset (56); recovery after
a power loss starts no later than the segment holding the lower one, which matters where store times are not
monotonic (an imported record first in a segment makes that segment the timestamp rule's start).  The offsets
only help while they are not above what they stand for: a log that recovery cut below them (an ASYNC_FLUSH power
loss after the consume queues, dispatched from unflushed records, were flushed whole) must not leave them there,
else the next records written below them are covered by nothing."""

from __future__ import annotations

import shutil
import struct

from helpers.powerloss import lose_queue_units, rebooted
from rocketstore import Message, MessageStore, StoreConfig

IMPORTED_AT = 1_500_000_000_000  # 2017: an imported message's original store time
SEGMENT = 16 * 1024


def _cfg(**kw) -> StoreConfig:
    """No index: its resume point would move recovery's start back by chance."""
    base = dict(mappedFileSizeCommitLog=SEGMENT, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=64,
                maxIndexNum=256, flushDiskType="SYNC_FLUSH", warmAheadBytes=0, messageIndexEnable=False)
    base.update(kw)
    return StoreConfig(**base)


def _page(store) -> tuple:
    data = (store / "checkpoint").read_bytes()
    return struct.unpack_from(">5q8sqq", data, 0)


def test_offsets_left_above_a_log_recovery_cut_do_not_hide_later_undispatched_records(tmp_path):
    live, image = tmp_path / "live", tmp_path / "image"
    with MessageStore.open(str(live), _cfg()) as s:  # four records, flushed everywhere
        for _ in range(4):
            assert s.put(Message("TopicA", b"a" * 700, queue_id=0)).ok
    page1 = _page(live)
    (ts1, _, _, _, _, magic, flushed1, dispatched1) = page1
    assert magic == b"RSTORE01" and flushed1 == dispatched1
    durable_end = flushed1
    commitlog_before = {p.name: p.read_bytes() for p in (live / "commitlog").iterdir()}
    # ASYNC_FLUSH: three segments of TopicC dispatched and their queue flushed whole (the checkpoint's logics
    # fields say so), while the commitlog never reached the disk (its flush interval is long).
    with MessageStore.open(str(live), _cfg(flushDiskType="ASYNC_FLUSH")) as s:
        for _ in range(70):
            assert s.put(Message("TopicC", b"c" * 700, queue_id=0)).ok
    page = bytearray((live / "checkpoint").read_bytes())
    (_, logics_ts, _, _, _, magic, _, dispatched_end) = _page(live)
    assert magic == b"RSTORE01" and dispatched_end > 3 * SEGMENT
    # The power cut's image: the commitlog as the first session synced it (later segments never synced: zeros),
    # the page as a thorough consume-queue flush wrote it after the first session's last commitlog flush.
    for p in (live / "commitlog").iterdir():
        old = commitlog_before.get(p.name)
        p.write_bytes(old if old is not None else bytes(p.stat().st_size))
    struct.pack_into(">q", page, 0, ts1)
    struct.pack_into(">q", page, 48, flushed1)
    (live / "checkpoint").write_bytes(bytes(page))
    rebooted(live)
    with MessageStore.open(str(live), _cfg(), start_services=False) as s:  # recovery cuts TopicC away
        assert s.max_phy_offset() == durable_end
        assert s.max_offset_in_queue("TopicC", 0) == 0
    # The attack15 scenario on that store: SYNC_FLUSH puts (durable when acknowledged) fill the segment; an
    # imported record begins the next one; the consume queues are not flushed again before the next power cut.
    quiet = _cfg()
    quiet.flushIntervalConsumeQueue = quiet.flushConsumeQueueThoroughInterval = 600_000
    s = MessageStore.open(str(live), quiet)
    try:
        first_seg = s.commitlog.queue.files[-1].file_from_offset
        acked = []
        while s.commitlog.queue.files[-1].file_from_offset == first_seg:
            r = s.put(Message("TopicB", b"b%05d" % len(acked) + b"b" * 700, queue_id=0))
            assert r.ok
            acked.append(r)
        imp = s.put(Message("TopicA", b"i" * (15 * 1024 + 400), queue_id=0, store_timestamp=IMPORTED_AT))
        assert imp.ok and imp.commit_log_offset % SEGMENT == 0
        after = s.put(Message("TopicA", b"n" * 50, queue_id=0))  # a record of now after it: physicMsgTimestamp
        assert after.ok and after.commit_log_offset // SEGMENT == imp.commit_log_offset // SEGMENT
        assert s.wait_dispatched()
        assert s.max_offset_in_queue("TopicB", 0) == len(acked)
        s.files.flush_checkpoint()  # the checkpoint service's once-a-second rewrite
        shutil.copytree(live, image)
    finally:
        s.close()
    lose_queue_units(image, "TopicB", 0, kept=5)  # only its first 5 units reached the disk
    rebooted(image)
    with MessageStore.open(str(image), _cfg(), start_services=False) as s:
        assert s.max_offset_in_queue("TopicB", 0) == len(acked)
        got = s.get("TopicB", 0, 0, max_msgs=len(acked) + 1)
        assert [m.commit_log_offset for m in got.messages] == [r.commit_log_offset for r in acked]
