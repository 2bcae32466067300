"""Derived files (consume queues, the index) lost or damaged: missing is not empty (issue #24 items 3, 5, 11, 14).

The commitlog is the truth and consume queues and index files are caches of
it: a cache that vanished, was torn or was damaged is rebuilt from the
commitlog by the first writable open, before any read or put, and a read that
meets damage it cannot see past raises an error naming it.  A read never
answers MESSAGE_WAS_REMOVING (or skips) for a record retention did not remove.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from conftest import GOLDEN_CONF, copy_store, flip_body_bit, golden_expected, golden_store, run_cli
from rocketstore import GetMessageStatus, MessageStore
from rocketstore.config import golden_config
from rocketstore.storage.consume_queue import PRE_BLANK_UNIT
from rocketstore.errors import CorruptRecordError, StoreLoadError
from rocketstore.format.message import Message


def _problem_kinds(store: Path) -> set[str]:
    r = run_cli("verify", store, "--json")
    assert r.returncode in (0, 1), r.stderr
    return {p["kind"] for p in json.loads(r.stdout)["problems"]}


def _golden(name: str, topic: str, qid: int) -> list[dict]:
    return [e for e in golden_expected(name) if (e["topic"], e["queueId"]) == (topic, qid)]


def _reads_every_message(store: MessageStore, name: str, topic: str, qid: int) -> None:
    """Every golden message of the queue reads back at its own queue offset (by 1 and in blocks)."""
    want = _golden(name, topic, qid)
    assert (store.min_offset_in_queue(topic, qid), store.max_offset_in_queue(topic, qid)) >= (0, len(want))
    got, off = [], 0
    while off < len(want):
        r = store.get(topic, qid, off, 32)
        assert r.status is GetMessageStatus.FOUND, (off, r.status)
        got += r.messages
        off = r.next_begin_offset
    assert [(m.queue_offset, m.commit_log_offset) for m in got[:len(want)]] == \
        [(e["queueOffset"], e["commitLogOffset"]) for e in want]
    for e in want[::37]:
        m = store.get(topic, qid, e["queueOffset"], 1).messages[0]
        assert (m.queue_offset, m.commit_log_offset, m.body_crc) == (e["queueOffset"], e["commitLogOffset"],
                                                                      e["bodyCrc"])


# ---------------------------------------------------------------- item 3: a consume-queue directory lost

@pytest.mark.parametrize("how", ["api", "cli-put"])
def test_a_lost_queue_directory_is_rebuilt_by_the_first_open(basic_copy: Path, how):
    """``rm -r consumequeue/TopicC`` then one put: the first open rebuilds TopicC from the commitlog, so
    ``get TopicC 0 @300`` is message 300 (it was 527: the units of 227 messages skipped) and the put takes
    the queue's next offset."""
    shutil.rmtree(basic_copy / "consumequeue" / "TopicC")
    n = len(_golden("basic", "TopicC", 0))
    if how == "cli-put":
        r = run_cli("put", basic_copy, "--topic", "TopicC", "--body", "after")
        assert r.returncode == 0, r.stderr
        assert b'"queueOffset": %d' % n in r.stdout
    else:
        with MessageStore.open(str(basic_copy), golden_config()) as store:
            assert store.queues_to_rebuild == ["TopicC/0"]
            r = store.get("TopicC", 0, 300, 1)
            assert r.status is GetMessageStatus.FOUND and r.messages[0].queue_offset == 300
            _reads_every_message(store, "basic", "TopicC", 0)
            assert store.put(Message("TopicC", b"after")).queue_offset == n
    assert not (basic_copy / "consumequeue.rebuild").exists()
    with MessageStore.open(str(basic_copy), golden_config(), read_only=True) as store:
        _reads_every_message(store, "basic", "TopicC", 0)
        assert store.max_offset_in_queue("TopicC", 0) == n + 1
    golden = golden_store("basic") / "consumequeue" / "TopicC" / "0" / "00000000000000000000"
    assert (basic_copy / "consumequeue" / "TopicC" / "0" / "00000000000000000000").read_bytes() == \
        golden.read_bytes()  # RocketMQ's units, byte for byte
    r = run_cli("verify", basic_copy)
    assert r.returncode == 0, r.stdout[-2000:]


def test_a_lost_queue_directory_is_rebuilt_with_a_gap_where_a_record_is_damaged(basic_copy: Path):
    """Place, never append: a record of the lost queue that fails its CRC leaves its queue offset a gap (a
    read of it names the damage), and every later message keeps its own queue offset."""
    want = _golden("basic", "TopicC", 0)
    lost = next(e for e in want if e["queueOffset"] >= 10 and e["commitLogOffset"] < 1048576)
    k = lost["queueOffset"]
    flip_body_bit(basic_copy, lost["commitLogOffset"])  # in a segment a clean open does not re-check
    shutil.rmtree(basic_copy / "consumequeue" / "TopicC")
    with MessageStore.open(str(basic_copy), golden_config()) as store:
        assert "TopicC-0" in store.recovery_report.not_rebuilt
        assert store.max_offset_in_queue("TopicC", 0) == len(want)
        r = store.get("TopicC", 0, 0, k + 5)
        assert [m.queue_offset for m in r.messages] == list(range(k)) and r.next_begin_offset == k
        with pytest.raises(CorruptRecordError, match=f"TopicC/0 offset {k} .*blank unit"):
            store.get("TopicC", 0, k, 1)
        for e in want[k + 1::41]:
            m = store.get("TopicC", 0, e["queueOffset"], 1).messages[0]
            assert (m.queue_offset, m.commit_log_offset) == (e["queueOffset"], e["commitLogOffset"])


def test_a_rebuild_does_not_place_a_record_whose_queue_offset_is_damaged_far_ahead(basic_copy: Path):
    """QUEUEOFFSET (no CRC covers it) of one record of the lost queue bit-flipped far ahead: the rebuild
    cannot take it at its word (the bytes before it cannot hold the records it would leave missing), so it
    pads no gap up to there and every later record keeps its own offset; the one unplaced names the damage."""
    want = _golden("basic", "TopicC", 0)
    bad = next(e for e in want if e["queueOffset"] >= 10 and e["commitLogOffset"] < 1048576)
    k = bad["queueOffset"]
    with open(basic_copy / "commitlog" / "00000000000000000000", "r+b") as fh:
        fh.seek(bad["commitLogOffset"] + 20)  # QUEUEOFFSET
        fh.write(struct.pack(">q", k + 100000))
    shutil.rmtree(basic_copy / "consumequeue" / "TopicC")
    with MessageStore.open(str(basic_copy), golden_config()) as store:
        assert store.max_offset_in_queue("TopicC", 0) == len(want)
        with pytest.raises(CorruptRecordError, match=f"TopicC/0 offset {k} .*blank unit"):
            store.get("TopicC", 0, k, 1)
        for e in want[k + 1::41]:
            m = store.get("TopicC", 0, e["queueOffset"], 1).messages[0]
            assert (m.queue_offset, m.commit_log_offset) == (e["queueOffset"], e["commitLogOffset"])


def test_every_lost_queue_directory_is_rebuilt_at_its_own_offsets(basic_copy: Path):
    """The whole consumequeue/ directory lost: every queue is rebuilt from the commitlog on the first open."""
    shutil.rmtree(basic_copy / "consumequeue")
    with MessageStore.open(str(basic_copy), golden_config()) as store:
        keys = sorted({(e["topic"], e["queueId"]) for e in golden_expected("basic")})
        assert store.queue_keys() == keys
        for topic, qid in keys:
            _reads_every_message(store, "basic", topic, qid)


# ---------------------------------------------------------------- item 5: a blank unit in a live segment

def _blank_unit(store_dir: Path, unit: int) -> int:
    """Overwrite ShortTopic-1's unit with a blank one (0, 2147483647, 0); return the offset it pointed at."""
    q = store_dir / "consumequeue" / "ShortTopic" / "1" / "00000000000000000000"
    data = bytearray(q.read_bytes())
    phy = struct.unpack_from(">q", data, unit * 20)[0]
    data[unit * 20:unit * 20 + 20] = PRE_BLANK_UNIT
    q.write_bytes(bytes(data))
    return phy


def test_a_blank_unit_whose_record_is_intact_reads_its_record(tmp_path):
    path = copy_store(golden_store("v2"), tmp_path / "s")
    _blank_unit(path, 3)
    want = _golden("v2", "ShortTopic", 1)
    with MessageStore.open(str(path), read_only=True) as store:
        for tags in (None, "*"):
            r = store.get("ShortTopic", 1, 0, 32, tag_filter=tags)
            assert r.status is GetMessageStatus.FOUND
            assert [(m.queue_offset, m.commit_log_offset) for m in r.messages] == \
                [(e["queueOffset"], e["commitLogOffset"]) for e in want]
        assert store.get("ShortTopic", 1, 3, 1).messages[0].commit_log_offset == want[3]["commitLogOffset"]


@pytest.mark.parametrize("damage", ["queue-id", "body"])
def test_a_blank_unit_in_a_live_segment_is_damage_not_removal(tmp_path, damage):
    """A blank unit whose record is not to be found either (its queue id or its body damaged): the read names
    the damage (it answered MESSAGE_WAS_REMOVING, units 3-9 skipped), the reads before it return their
    messages, and the next offset is readable."""
    path = copy_store(golden_store("v2"), tmp_path / "s")
    phy = _blank_unit(path, 3)
    if damage == "body":
        flip_body_bit(path, phy)
    else:
        with open(path / "commitlog" / "00000000000000000000", "r+b") as fh:
            fh.seek(phy + 12)  # QUEUEID: no CRC covers it, so the commitlog walk still accepts the record
            fh.write(struct.pack(">i", 7))
    want = _golden("v2", "ShortTopic", 1)
    with MessageStore.open(str(path), read_only=True) as store:
        r = store.get("ShortTopic", 1, 0, 32)
        assert r.status is GetMessageStatus.FOUND and [m.queue_offset for m in r.messages] == [0, 1, 2]
        assert r.next_begin_offset == 3
        for tags in (None, "*", "TagA"):  # a tag filter cannot skip it either: its tag is unknown
            with pytest.raises(CorruptRecordError, match=r"ShortTopic/1 offset 3 .*00000000000000000000 "
                                                         r"position 60.*blank unit"):
                store.get("ShortTopic", 1, 3, 32, tag_filter=tags)
        if damage == "queue-id":  # (a body CRC failure ends a read-only store's log there, after a clean stop)
            r = store.get("ShortTopic", 1, 4, 32)
            assert r.status is GetMessageStatus.FOUND
            assert [m.queue_offset for m in r.messages] == [e["queueOffset"] for e in want[4:]]


# (Blank units standing for records retention removed still read as MESSAGE_WAS_REMOVING: see
# test_recovery_truncation.py::test_a_hole_whose_records_are_gone_keeps_later_units_at_their_queue_offsets.)


# ---------------------------------------------------------------- item 11: a damaged index header

def _set_index_count(path: Path, n: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(36)
        fh.write(struct.pack(">i", n))


@pytest.mark.parametrize("count", [40000, -5])
def test_an_index_file_with_a_damaged_count_is_rebuilt_from_the_commitlog(basic_copy: Path, count):
    first = sorted((basic_copy / "index").iterdir())[0]
    _set_index_count(first, count)
    with MessageStore.open(str(basic_copy), read_only=True) as store:  # a reader reads on, and a query names it
        assert store.get("TopicA", 0, 0, 1).status is GetMessageStatus.FOUND
        with pytest.raises(StoreLoadError, match=f"{first.name}: damaged header: indexCount {count} .*recover"):
            store.query("TopicA", "order-0")
    r = run_cli("query", basic_copy, "--topic", "TopicA", "--key", "order-0")
    assert r.returncode == 2 and r.stderr.count(b"\n") == 1 and b"damaged header" in r.stderr
    r = run_cli("verify", basic_copy)
    assert r.returncode == 1 and b"index-damaged" in r.stdout
    r = run_cli("recover", basic_copy)
    assert r.returncode == 0, r.stderr
    assert not (basic_copy / "index.rebuild").exists()
    assert (basic_copy / "quarantine" / f"index__{first.name}").exists()
    expected = golden_expected("basic")
    with MessageStore.open(str(basic_copy), golden_config(), read_only=True) as store:
        for key in ("order-0", "order-1", "user-22", "hot-key"):
            want = sorted(e["commitLogOffset"] for e in expected
                          if e["topic"] == "TopicA" and key in (e["keys"] or "").split(" "))
            got = store.query("TopicA", key, 1000, read_body=False).phy_offsets
            assert sorted(got) == want[-len(got):] and got, key
        for e in expected[::97]:  # every message findable by its UNIQ_KEY again
            uniq = e["properties"]["UNIQ_KEY"]
            assert store.query(e["topic"], uniq, 4, read_body=False).phy_offsets == [e["commitLogOffset"]]
    assert _problem_kinds(basic_copy) <= {"quarantined"}  # (the damaged file kept there)


def test_a_lowered_index_count_is_mended_by_a_writable_open(basic_copy: Path):
    """indexCount lowered (in range) in the last index file: the last records' keys are found again after
    recover (they were lost for good: the index resumed at the header's end offset)."""
    last_file = sorted((basic_copy / "index").iterdir())[-1]
    count = struct.unpack_from(">i", last_file.read_bytes(), 36)[0]
    _set_index_count(last_file, count - 40)
    r = run_cli("recover", basic_copy)
    assert r.returncode == 0, r.stderr
    expected = sorted(golden_expected("basic"), key=lambda e: e["commitLogOffset"])
    with MessageStore.open(str(basic_copy), golden_config(), read_only=True) as store:
        for e in expected[-20:]:
            assert store.query(e["topic"], e["properties"]["UNIQ_KEY"], 4, read_body=False).phy_offsets == \
                [e["commitLogOffset"]]
    assert _problem_kinds(basic_copy) == set()


def test_an_unfinished_index_rebuild_is_finished_by_the_next_writable_open(basic_copy: Path):
    """A crash while the index was being rebuilt: the marker makes the next open finish it."""
    for f in (basic_copy / "index").iterdir():
        f.unlink()
    (basic_copy / "index.rebuild").write_text("index/lost\n")
    with pytest.raises(StoreLoadError, match="has not finished"):
        MessageStore.open(str(basic_copy), read_only=True)
    with MessageStore.open(str(basic_copy), golden_config()) as store:
        e = golden_expected("basic")[5]
        assert store.query(e["topic"], e["properties"]["UNIQ_KEY"], 4, read_body=False).phy_offsets == \
            [e["commitLogOffset"]]
    assert not (basic_copy / "index.rebuild").exists()


def test_a_lost_index_directory_is_rebuilt_by_the_first_open(basic_copy: Path):
    """Missing is not empty: no index file beside records is a lost index, not an index without keys."""
    shutil.rmtree(basic_copy / "index")
    e = golden_expected("basic")[7]
    with MessageStore.open(str(basic_copy), golden_config(), read_only=True) as store:
        with pytest.raises(StoreLoadError, match="no index file, yet the commitlog holds records"):
            store.query(e["topic"], e["properties"]["UNIQ_KEY"])
    with MessageStore.open(str(basic_copy), golden_config()) as store:
        assert store.query(e["topic"], e["properties"]["UNIQ_KEY"], 4, read_body=False).phy_offsets == \
            [e["commitLogOffset"]]
    r = run_cli("verify", basic_copy)
    assert r.returncode == 0, r.stdout[-2000:]


# ---------------------------------------------------------------- item 14: the one file of its kind torn

def _one_queue_store(path: Path) -> None:
    path.mkdir()
    (path / "broker.conf").write_text(GOLDEN_CONF)
    with MessageStore.open(str(path)) as store:
        for i in range(5):
            store.put(Message("T", f"body-{i}".encode(), keys=f"k{i}"))


@pytest.mark.parametrize("kind", ["index", "consumequeue"])
@pytest.mark.parametrize("tool", ["recover", "verify --repair"])
def test_the_one_torn_file_of_its_kind_is_rebuilt_not_refused(tmp_path, kind, tool):
    path = tmp_path / "s"
    _one_queue_store(path)
    torn = next(p for p in (path / kind).rglob("*") if p.is_file())
    os.truncate(torn, 30)
    if kind == "index":  # a reader reads on; a query names the damage
        with MessageStore.open(str(path), read_only=True) as store:
            assert len(store.get("T", 0, 0, 32).messages) == 5
            with pytest.raises(StoreLoadError, match="30 bytes.*rocketstore recover"):
                store.query("T", "k1")
    else:  # a reader cannot read the queue: it names the file, and the way on
        with pytest.raises(StoreLoadError, match="30 bytes.*rocketstore recover"):
            MessageStore.open(str(path), read_only=True)
        r = run_cli("get", path, "--topic", "T", "--queue-id", "0", "--offset", "0")
        assert r.returncode == 2 and r.stderr.count(b"\n") == 1 and str(torn).encode() in r.stderr
    r = run_cli(*tool.split(), path)
    assert r.returncode == 0, r.stderr
    assert b"does not fit" not in r.stderr
    with MessageStore.open(str(path), read_only=True) as store:
        r = store.get("T", 0, 0, 32)
        assert [m.body for m in r.messages] == [f"body-{i}".encode() for i in range(5)]
        for i in range(5):
            assert [m.body for m in store.query("T", f"k{i}").messages] == [f"body-{i}".encode()]
    if kind == "consumequeue":  # rebuilt where it was
        assert os.path.getsize(torn) == 6000
    assert all(os.path.getsize(p) > 30 for p in (path / kind).rglob("*") if p.is_file())
    assert any(p.stat().st_size == 30 for p in (path / "quarantine").rglob("*") if p.is_file())  # kept there
    assert _problem_kinds(path) <= {"quarantined"}  # (the torn file kept there)
