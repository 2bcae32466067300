"""An open after a crash of the process alone, then a power cut (attack19).

A crashed ASYNC_FLUSH writer leaves the records it wrote since its last flush in the page cache only.  The
open's recovery fdatasyncs them (``_sync_written_before_crash``) and then counts every record it kept as
flushed (``_count_synced_as_flushed``: physicFlushedOffset and physicMsgTimestamp move to the log's end; the
flush services start there).  It synced only the segments from where its scan started, and after a crash of
the process alone with no start in the checkpoint (its times newer than every segment's first record: a
store in its first minute) the scan starts one segment before the lowest queue end: the segments before, which
the crashed writer filled without a flush, were never synced by anyone while the checkpoint said they were.
A power cut then took their records (and their queue units): acknowledged messages gone from the disk."""

from __future__ import annotations

import os

from helpers.powerloss import SyncShadow, crash_image
from helpers.workloads import crashed_writer
from rocketstore import GetMessageStatus, Message, MessageStore, StoreConfig

CFG = dict(mappedFileSizeCommitLog=32 * 1024, mappedFileSizeConsumeQueue=10 * 20, maxHashSlotNum=32,
           maxIndexNum=128, warmAheadBytes=0, flushDiskType="ASYNC_FLUSH", flushIntervalCommitLog=600_000,
           flushCommitLogThoroughInterval=600_000, flushIntervalConsumeQueue=600_000)
N = 300  # about 4 segments of the crashed writer's records


def test_an_open_after_a_process_crash_makes_every_record_it_counts_as_flushed_durable(tmp_path):
    root, shadow, image = tmp_path / "s", tmp_path / "shadow", tmp_path / "image"
    with SyncShadow(root, shadow):
        want = crashed_writer(root, CFG, N, keyed=True, dispatched=True)
        assert (root / "abort").exists() and len(os.listdir(root / "commitlog")) >= 4
        with MessageStore.open(str(root), StoreConfig(**CFG)) as st:  # recovers the crash, then runs and stops
            assert st.recovery_report.abnormal and st.process_crash_only
            for i in range(N + 1, N + 6):
                assert st.put(Message("T", b"m%d|" % i + bytes(400), queue_id=0)).ok
                want[i] = b"m%d|" % i + bytes(400)
        crash_image(root, shadow, image)  # then the power fails
    with MessageStore.open(str(image), StoreConfig(**CFG)) as st:
        got, off = {}, 0
        while off < N + 6:
            r = st.get("T", 0, off, 32)
            assert r.status is GetMessageStatus.FOUND, (off, r.status)
            got.update((m.queue_offset, m.body) for m in r.messages)
            off = r.next_begin_offset
        assert got == want
        for i in range(1, N + 1, 7):  # the crashed writer's index entries too
            assert [m.body for m in st.query("T", "k%d" % i).messages] == [want[i]], i
