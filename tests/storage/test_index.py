"""IndexFile / IndexService on their own: put keys, reopen, query by key and time range, hash-collision
chains, a full file rolls; the golden index answers the golden keys."""

from __future__ import annotations

import os
import struct

import pytest
from conftest import golden_expected, golden_store

from rocketstore.errors import StoreLoadError
from rocketstore.format.codec import index_key_hash
from rocketstore.storage.index import HEADER_SIZE, IndexFile, IndexService, index_file_name, index_file_size

SLOTS, ENTRIES = 16, 8  # 7 entries a file (entry 0 is never used)
T0 = 1795000000000
ALL = (0, 2 ** 62)


def _service(d, **kw) -> IndexService:
    s = IndexService(str(d), SLOTS, ENTRIES, clock=lambda: T0 / 1000, **kw)
    s.load(True, 0)
    return s


def _put_five(s: IndexService) -> None:
    """Five messages, three keys each (UNIQ_KEY, k<i>, shared): 15 entries, so three files of 7, 7 and 1."""
    for i in range(5):
        s.build_index("TopicI", 1000 * i, T0 + 1000 * i, 0, f"U{i}", f"k{i} shared")


def test_put_reopen_query_by_key_and_time(tmp_path):
    s = _service(tmp_path)
    _put_five(s)
    s.flush()
    s.close()
    names = sorted(os.listdir(tmp_path))
    assert names == [index_file_name(T0), index_file_name(T0 + 1), index_file_name(T0 + 2)]  # unique names
    assert all(os.path.getsize(tmp_path / n) == index_file_size(SLOTS, ENTRIES) for n in names)

    r = IndexService(str(tmp_path), SLOTS, ENTRIES, read_only=True)
    assert r.load(True, 0) == []
    assert [(f.index_count, f.begin_phy_offset, f.end_phy_offset) for f in r.files] == \
        [(8, 0, 2000), (8, 2000, 4000), (2, 4000, 4000)]
    assert r.resume_offset() == 4000
    assert r.query_offset("TopicI", "shared", 100, *ALL) == ([4000, 3000, 2000, 1000, 0], T0 + 4000, 4000)
    assert r.query_offset("TopicI", "k3", 100, *ALL)[0] == [3000]
    assert r.query_offset("TopicI", "U0", 100, *ALL)[0] == [0]
    assert r.query_offset("TopicI", "shared", 2, *ALL)[0] == [4000, 3000]  # newest first, max_num honoured
    assert r.query_offset("TopicI", "shared", 100, T0 + 1000, T0 + 3000)[0] == [3000, 2000, 1000]
    assert r.query_offset("OtherTopic", "shared", 100, *ALL)[0] == []
    r.close()


def test_header_and_entries_on_disk(tmp_path):
    s = _service(tmp_path)
    s.build_index("T", 500, T0 + 2500, 0, None, "a")
    s.build_index("T", 900, T0 + 7900, 0, None, "b")
    s.flush()
    path = s.files[0].path
    s.close()
    data = open(path, "rb").read()
    assert struct.unpack_from(">qqqqii", data, 0) == (T0 + 2500, T0 + 7900, 500, 900, 2, 3)
    h = index_key_hash("T#b")
    slot = struct.unpack_from(">i", data, HEADER_SIZE + (h % SLOTS) * 4)[0]
    assert slot == 2
    base = HEADER_SIZE + 4 * SLOTS
    assert struct.unpack_from(">iqii", data, base + 2 * 20) == (h, 900, 5, 0)  # time diff in seconds


def test_hash_collisions_chain_and_are_returned(tmp_path):
    """Keys that share a slot are chained newest first; a query matches by hash, so only equal hashes come
    back, and a key sharing the hash (a true collision) is returned too, as in RocketMQ."""
    f = IndexFile(str(tmp_path / index_file_name(T0)), SLOTS, 64, create=True)
    keys = [f"T#key{i}" for i in range(200)]
    by_slot: dict[int, list[str]] = {}
    for k in keys:
        by_slot.setdefault(index_key_hash(k) % SLOTS, []).append(k)
    same_slot = max(by_slot.values(), key=len)[:4]
    assert len(same_slot) == 4 and len({index_key_hash(k) for k in same_slot}) == 4
    f.put_keys([(index_key_hash(k), 100 * n) for n, k in enumerate(same_slot)], 0, T0)
    assert f.hash_slot_count == 1  # one slot, one chain of four
    for n, k in enumerate(same_slot):
        out: list[int] = []
        f.select(out, k, 10, *ALL)
        assert out == [100 * n]
        assert f.holds(index_key_hash(k), 100 * n) and not f.holds(index_key_hash(k), 100 * n + 1)
    assert [e[3] for e in f.entries_iter()] == [0, 1, 2, 3]  # each entry links to the one before
    # "Aa" and "BB" have the same Java hash: both offsets answer either key
    assert index_key_hash("T#Aa") == index_key_hash("T#BB")
    f.put_keys([(index_key_hash("T#Aa"), 900), (index_key_hash("T#BB"), 950)], 0, T0)
    out = []
    f.select(out, "T#Aa", 10, *ALL)
    assert out == [950, 900]
    f.close()


def test_a_full_file_rolls_and_reports_the_full_one(tmp_path):
    full = []
    s = _service(tmp_path, on_file_full=full.append)
    _put_five(s)
    assert len(s.files) == 3 and [f.is_full() for f in s.files] == [True, True, False]
    assert [f.path for f in full] == [g.path for g in s.files[:2]]
    assert s.files[1].begin_phy_offset == s.files[0].end_phy_offset  # a new file starts where the last ended
    s.close()


def test_reopen_after_unclean_exit_drops_files_newer_than_the_checkpoint(tmp_path):
    s = _service(tmp_path)
    _put_five(s)
    s.flush()
    s.close()
    r = IndexService(str(tmp_path), SLOTS, ENTRIES)
    dropped = r.load(False, T0 + 2000)  # indexMsgTimestamp covers the first file only
    assert [os.path.basename(p) for p in dropped] == [index_file_name(T0 + 1), index_file_name(T0 + 2)]
    assert len(r.files) == 1 and r.resume_offset() == 2000
    assert sorted(os.listdir(tmp_path)) == [index_file_name(T0)]
    r.close()


def test_reopen_after_unclean_exit_drops_every_file_after_one_newer_than_the_checkpoint(tmp_path):
    """Store model seed 42025 (imported records): the later files end with records imported with store times a
    year back, so they end "older" than indexMsgTimestamp while the first file, newer, is dropped.  Kept, they
    made the index resume past the first file's records: their keys were never indexed again.  Every file after
    a dropped one goes too, and the rebuild resumes at the start."""
    s = _service(tmp_path)
    for i in range(3):  # 9 entries: the first file's 7 (records 0..2000), two in the second
        s.build_index("TopicI", 1000 * i, T0 + 1000 * i, 0, f"U{i}", f"k{i} shared")
    old = T0 - 365 * 86_400_000
    for i in range(3, 5):  # imported: the second and third files end a year before the first
        s.build_index("TopicI", 1000 * i, old + i, 0, f"U{i}", f"k{i} shared")
    s.flush()
    s.close()
    assert len(os.listdir(tmp_path)) == 3
    r = IndexService(str(tmp_path), SLOTS, ENTRIES)
    dropped = r.load(False, T0 + 1000)  # indexMsgTimestamp: the checkpoint's, before the first file ended
    assert len(dropped) == 3 and not r.files and r.resume_offset() == 0
    r.close()


def test_truncate_drops_entries_at_or_past_an_offset(tmp_path):
    s = _service(tmp_path)
    _put_five(s)
    assert s.truncate(3000, lambda off: T0 + off) == 6  # three keys each of records 3000 and 4000
    assert s.resume_offset() == 2000
    assert s.query_offset("TopicI", "shared", 100, *ALL)[0] == [2000, 1000, 0]
    s.build_index("TopicI", 3000, T0 + 3000, 0, None, "shared")  # indexed again after the cut
    assert s.query_offset("TopicI", "shared", 100, *ALL)[0] == [3000, 2000, 1000, 0]
    s.close()


def test_a_damaged_header_is_refused(tmp_path):
    s = _service(tmp_path)
    s.build_index("T", 0, T0, 0, None, "a")
    path = s.files[0].path
    s.close()
    with open(path, "r+b") as fh:
        fh.seek(36)
        fh.write(struct.pack(">i", ENTRIES + 5))  # indexCount past maxIndexNum
    with pytest.raises(StoreLoadError, match="indexCount 13 outside 0..8"):
        IndexService(str(tmp_path), SLOTS, ENTRIES, read_only=True).load(True, 0)


def test_golden_index_answers_every_key():
    expected = golden_expected("basic")
    s = IndexService(str(golden_store("basic") / "index"), 1000, 4000, read_only=True)
    s.load(True, 0)
    try:
        for e in expected:
            for k in [e["properties"]["UNIQ_KEY"]] + [k for k in (e.get("keys") or "").split(" ") if k]:
                offsets, _, _ = s.query_offset(e["topic"], k, 100000, 0, 2 ** 62)
                assert e["commitLogOffset"] in offsets, (e["idx"], k)
    finally:
        s.close()


@pytest.mark.xfail(strict=True, reason="IndexFile.put_keys computes the first entry's time diff against the "
                   "beginTimestamp a new file inherits from the previous file's end, then resets beginTimestamp to "
                   "the entry's store time: the entry reads back later by the gap and a time-bounded query misses "
                   "it (RocketMQ's IndexFile.putKey does the same)")
def test_first_key_of_a_rolled_file_is_found_by_its_store_time(tmp_path):
    s = IndexService(str(tmp_path), SLOTS, 3, clock=lambda: T0 / 1000)  # two entries a file
    s.load(True, 0)
    s.build_index("T", 0, T0, 0, None, "a b")  # fills the first file
    s.build_index("T", 100, T0 + 100_000, 0, None, "c")  # 100 s later: a new file
    try:
        assert s.query_offset("T", "c", 10, *ALL)[0] == [100]
        assert s.query_offset("T", "c", 10, T0 + 50_000, T0 + 150_000)[0] == [100]
    finally:
        s.close()


def test_close_waits_for_the_flush_of_a_full_index_file_and_its_checkpoint_time(tmp_path, monkeypatch):
    """A full index file is flushed by a thread of its own, which then moves the checkpoint's indexMsgTimestamp to
    the file's end.  A close that went on without it unmapped the file under the flush (ValueError in the thread)
    and wrote its last checkpoint without that time (model19's note)."""
    import threading
    import time as _time

    from rocketstore import Message, MessageStore, StoreConfig
    from rocketstore.storage.checkpoint import StoreCheckpoint
    from rocketstore.storage.index import IndexFile
    real_flush = IndexFile.flush
    errors: list[BaseException] = []

    def slow_flush(self):  # the flush thread is late: the close gets there first
        if threading.current_thread().name == "IndexFlush":
            _time.sleep(0.3)
        real_flush(self)
    monkeypatch.setattr(IndexFile, "flush", slow_flush)
    monkeypatch.setattr(threading, "excepthook", lambda a: errors.append(a.exc_value))
    cfg = StoreConfig(mappedFileSizeCommitLog=64 * 1024, maxHashSlotNum=8, maxIndexNum=16, warmAheadBytes=0)
    with MessageStore.open(str(tmp_path / "s"), cfg) as st:
        for i in range(20):  # 16 entries fill the first index file; the 17th makes the second
            assert st.put(Message("T", b"x", keys=f"k{i}")).ok
        st.wait_dispatched()
        first_end = min((f.end_timestamp for f in st.index_service.files), default=0)
    cp = StoreCheckpoint.load(str(tmp_path / "s" / "checkpoint"))
    assert errors == []
    assert cp.indexMsgTimestamp == first_end > 0
