"""verify --repair after a crash of the process alone, then a power cut (attack18).

A crashed writer leaves its last records in the page cache only (ASYNC_FLUSH acknowledges them before any
flush).  A normal open after the crash fdatasyncs them (recovery's _sync_written_before_crash) before the
checkpoint can count on them.  ``verify --repair`` moves the abort file into its quarantine directory and
rebuilds through a clean open, which syncs nothing: the next run's flushes start at the log's end, a segment
the crashed writer filled was never synced, and the clean shutdown's checkpoint said every record was
flushed.  A power cut then lost those records: the open refused (damage before intact records of a store
shut down cleanly) and the messages were gone from the disk."""

from __future__ import annotations


from helpers.powerloss import SyncShadow, crash_image
from helpers.workloads import crashed_writer
from rocketstore import GetMessageStatus, Message, MessageStore, StoreConfig
from rocketstore.recovery.repair import repair_store

CFG = dict(mappedFileSizeCommitLog=32 * 1024, mappedFileSizeConsumeQueue=10 * 20, maxHashSlotNum=32,
           maxIndexNum=128, warmAheadBytes=0, flushDiskType="ASYNC_FLUSH", flushIntervalCommitLog=600_000,
           flushCommitLogThoroughInterval=600_000, flushIntervalConsumeQueue=600_000)


def test_repair_after_a_process_crash_makes_the_crashed_writers_records_durable(tmp_path):
    root, shadow, image = tmp_path / "s", tmp_path / "shadow", tmp_path / "image"
    with SyncShadow(root, shadow):
        want = crashed_writer(root, CFG, 100)
        assert (root / "abort").exists() and (root / "commitlog" / "00000000000000032768").exists()
        result = repair_store(str(root), StoreConfig(**CFG))
        assert not [m for s in result["lost"] for m in s["messages"]], result["lost"]  # (the zeros past the end)
        with MessageStore.open(str(root), StoreConfig(**CFG)) as st:  # the next run, shut down cleanly
            for i in range(101, 106):
                assert st.put(Message("T", b"m%d|" % i + bytes(400), queue_id=0)).ok
                want[i] = b"m%d|" % i + bytes(400)
        crash_image(root, shadow, image)  # then the power fails
    with MessageStore.open(str(image), StoreConfig(**CFG)) as st:
        got, off = {}, 0
        while off < 106:
            r = st.get("T", 0, off, 32)
            assert r.status is GetMessageStatus.FOUND, (off, r.status)
            got.update((m.queue_offset, m.body) for m in r.messages)
            off = r.next_begin_offset
        assert got == want
