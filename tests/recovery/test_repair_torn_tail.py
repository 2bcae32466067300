"""verify --repair after a power loss ends the log at the torn tail, as recovery would (store model seed 60050).

A power cut leaves the pages written since the last flush on disk in any order: a hole among them with intact
records after it is the log's torn end, and recovery truncates there.  When the open refuses because of damage
to a flushed record before it, the operator runs ``verify --repair``: it used to keep the records past the
hole, so the rebuilt queue had tombstones (or gaps) for messages the power loss took and that no open of the
same files without the earlier damage would have shown."""

from __future__ import annotations

import time

import pytest
from conftest import flip_body_bit

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.errors import CommitLogDamagedError
from rocketstore.recovery.damage import LOST_TAG
from rocketstore.recovery.repair import repair_store
from rocketstore.storage.checkpoint import StoreCheckpoint

CFG = dict(mappedFileSizeCommitLog=32 * 1024, mappedFileSizeConsumeQueue=10 * 20, warmAheadBytes=0)


def _power_loss_image(root, *, other_boot: bool = True, damage: bool = True,
                      imported_from: int | None = None) -> list[tuple[int, int, int]]:
    """60 records of T-0 in segment 0; the checkpoint says a flush covered records 0..39 (40.. stored later);
    record 10's body damaged (a disk error under a flushed record); records 45..47 zeros (pages a power cut
    lost, with the pages of 48..59 written back); an abort file of another boot.  ``imported_from``: records from
    that one on are imported with store times a year back.  Returns (offset, size, store time) of each record."""
    cfg = StoreConfig(flushDiskType="SYNC_FLUSH", **CFG)
    old = int(time.time() * 1000) - 365 * 86_400_000
    with MessageStore.open(str(root), cfg) as st:
        for i in range(60):
            if i == 40:
                time.sleep(0.01)  # records 40.. are stored after the flush that covered 39
            stored = old + i if imported_from is not None and i >= imported_from else None
            assert st.put(Message("T", b"m%d|" % i + bytes(200), queue_id=0, keys=f"k{i}",
                                  store_timestamp=stored)).ok
        recs = [(off, size, m.store_timestamp) for off, size, m, _ in st.messages()]
    cp = StoreCheckpoint.load(str(root / "checkpoint"))
    cp.logicsMsgTimestamp = recs[39][2]
    cp.note_physic_flushed(recs[39][2], recs[39][0] + recs[39][1])  # a thorough flush: offset, time and stamp
    cp.logicsDispatchedOffset = recs[39][0] + recs[39][1]
    cp.flush()
    if damage:
        flip_body_bit(root, recs[10][0])
    seg = root / "commitlog" / "00000000000000000000"
    with open(seg, "r+b") as fh:
        fh.seek(recs[45][0])
        fh.write(bytes(recs[48][0] - recs[45][0]))
    (root / "abort").write_text("")
    (root / "abort.bootid").write_text("another-boot" if other_boot else
                                       open("/proc/sys/kernel/random/boot_id").read().strip())
    return recs


def test_repair_after_a_power_loss_ends_the_log_at_the_torn_tail(tmp_path):
    root = tmp_path / "s"
    recs = _power_loss_image(root)
    cfg = StoreConfig(**CFG)
    with pytest.raises(CommitLogDamagedError, match="flushed before the power loss"):
        MessageStore.open(str(root), cfg)  # the damage under record 10 is no torn write
    result = repair_store(str(root), cfg)
    cut = [s for s in result["lost"] if s["action"] == "cut"]
    assert [s["offset"] for s in cut] == [recs[45][0]], result["lost"]
    assert sorted(m["queueOffset"] for m in cut[0]["messages"]) == list(range(45, 60))  # named in the report
    with MessageStore.open(str(root), cfg) as st:
        assert st.max_offset_in_queue("T", 0) == 45, "the log ends where recovery would end it"
        got = {}
        off = 0
        while off < 45:
            r = st.get("T", 0, off, 32)
            assert r.status.name == "FOUND", (off, r.status)
            got.update((m.queue_offset, m) for m in r.messages)
            off = r.next_begin_offset
        assert got[10].tags == LOST_TAG  # the damaged flushed record: its tombstone keeps offset 10
        assert all(got[i].body == b"m%d|" % i + bytes(200) for i in range(45) if i != 10)
        assert st.put(Message("T", b"next", queue_id=0)).queue_offset == 45
    kept = list((root / "quarantine").glob("repair-*/commitlog/00000000000000000000"))
    assert len(kept) == 1 and kept[0].read_bytes()[recs[48][0]:recs[48][0] + 4] != bytes(4), \
        "the segment's original, records 48.. included, is kept"


def test_repair_after_a_crash_of_the_process_alone_keeps_every_intact_record(tmp_path):
    """Same files, but the abort file is of this boot: only the process died, no page can be torn, so the
    zeros are damage like the other, and every intact record after them is kept (as before)."""
    root = tmp_path / "s"
    _power_loss_image(root, other_boot=False)
    cfg = StoreConfig(**CFG)
    result = repair_store(str(root), cfg)
    assert not [s for s in result["lost"] if s["action"] == "cut"]
    with MessageStore.open(str(root), cfg) as st:
        assert st.max_offset_in_queue("T", 0) == 60
        r = st.get("T", 0, 48, 1)
        assert r.messages[0].body == b"m48|" + bytes(200)


def test_a_torn_tail_whose_next_record_is_imported_is_cut_by_recovery(tmp_path):
    """Store model seed 42022 (imported records): the first intact record after the power cut's hole was
    imported with a store time a year back, so it looked flushed by physicMsgTimestamp and the open refused a
    plain torn tail (CommitLogDamagedError).  It lies past physicFlushedOffset, where the last thorough flush
    reached: no flush covered it, the hole is the torn tail, and recovery ends the log there."""
    root = tmp_path / "s"
    recs = _power_loss_image(root, damage=False, imported_from=48)
    assert recs[48][2] < recs[39][2], "record 48 looks older than the flush"
    cfg = StoreConfig(**CFG)
    with MessageStore.open(str(root), cfg) as st:
        assert st.recovery_report.process_offset == recs[45][0]
        assert st.max_offset_in_queue("T", 0) == 45
        assert st.get("T", 0, 44, 1).messages[0].body == b"m44|" + bytes(200)
