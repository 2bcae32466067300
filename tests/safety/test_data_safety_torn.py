"""A record torn by a power cut after its body (found by the model-based test, not listed in issue 24).

RocketMQ's BODYCRC covers the body alone; the topic and the properties follow it.  A power cut that keeps the
pages holding a record's header and body but loses its last page leaves zeros for (part of) its properties: every
other check passes, and ``get`` returned tags ``'TagB\\x00'``.  Such a record is the torn tail, not a message.

Session 14: a disk writes a page in 512-byte sectors, and a lost sector holds zeros or what an earlier write left
there; when it lies inside the tail with written bytes before it in the page (or after it), the last page is not
all zeros and the record passed.  After a power loss, recovery now takes a record past the checkpoint's flushed
point whose topic is no legal name or whose properties are not ``name\\x01value\\x02`` pairs (zero bytes, bad
UTF-8) for a torn write (codec.tail_problem; the put path refuses such properties), and refuses to cut a record
the checkpoint says was flushed whole.
"""

from __future__ import annotations

import glob
import mmap
import os
from pathlib import Path

import pytest

from conftest import GOLDEN_NAMES, golden_store
from helpers.powerloss import process_crashed, rebooted
from rocketstore.errors import CommitLogDamagedError
from rocketstore.format import codec
from rocketstore.config import StoreConfig
from rocketstore.format.message import Message
from rocketstore.store import MessageStore

PAGE = codec.PAGE_SIZE
SECTOR = 512


def _config() -> StoreConfig:
    return StoreConfig(mappedFileSizeCommitLog=64 * 1024, mappedFileSizeConsumeQueue=20 * 100, maxHashSlotNum=64,
                       maxIndexNum=256, warmAheadBytes=0)


def _store_with_a_record_across_a_page(tmp_path: Path) -> tuple[Path, list, dict]:
    """Messages whose properties are long enough that one record's last page starts after its body."""
    path = tmp_path / "s"
    with MessageStore.open(str(path), _config()) as store:
        for i in range(60):
            store.put(Message("Busy", b"b%03d" % i, tags="TagB", keys=[f"k{i}"], queue_id=0,
                              properties={"pad": "x" * (150 + i % 7)}))
        assert store.wait_dispatched()
        msgs = store.get("Busy", 0, 0, 32).messages + store.get("Busy", 0, 32, 32).messages
    data = (path / "commitlog" / f"{0:020d}").read_bytes()
    for m in msgs:
        end = m.commit_log_offset + m.size
        page = (end - 1) // PAGE * PAGE
        _h, tp, tl, plen = codec.parse(data, m.commit_log_offset, len(data))
        if tp + tl + 2 <= page < end - 20:  # the page starts inside its properties
            return path, msgs, {"msg": m, "page": page, "end": end}
    pytest.fail("no record crosses a page boundary inside its properties")


def _tear(path: Path, page: int) -> None:
    """The power cut lost the page at ``page`` and everything after it (zeros)."""
    seg = path / "commitlog" / f"{0:020d}"
    with open(seg, "r+b") as fh:
        fh.seek(page)
        fh.write(bytes(64 * 1024 - page))


def _flushed_until(path: Path, store_timestamp: int) -> None:
    """The checkpoint as a power cut leaves it when the last thorough flush covered records up to
    ``store_timestamp`` (the page is written whole: its other fields stay)."""
    cp = path / "checkpoint"
    data = bytearray(cp.read_bytes())
    data[0:8] = store_timestamp.to_bytes(8, "big")
    cp.write_bytes(bytes(data))


def test_a_record_whose_last_page_was_lost_is_the_torn_tail_not_a_message(tmp_path):
    path, msgs, torn = _store_with_a_record_across_a_page(tmp_path)
    m = torn["msg"]
    _tear(path, torn["page"])
    _flushed_until(path, msgs[0].store_timestamp - 1)  # the torn record came after the last thorough flush
    rebooted(path)
    with MessageStore.open(str(path), _config()) as store:
        before = [x for x in msgs if x.commit_log_offset < m.commit_log_offset]
        got = store.get("Busy", 0, 0, 32).messages + store.get("Busy", 0, 32, 32).messages
        assert [(x.queue_offset, x.body) for x in got] == [(x.queue_offset, x.body) for x in before]
        assert all(x.tags == "TagB" for x in got)
        assert store.max_phy_offset() == m.commit_log_offset  # the log ends before the torn record
        r = store.put(Message("Busy", b"next", tags="TagB", queue_id=0))
        assert r.queue_offset == m.queue_offset  # the torn record was never acknowledged durable: its slot is reused
    with MessageStore.open(str(path), _config(), read_only=True) as store:
        [nxt] = store.get("Busy", 0, m.queue_offset, 1).messages
        assert nxt.body == b"next" and nxt.tags == "TagB"


def test_the_trusted_record_check_names_a_torn_record(tmp_path):
    path, _msgs, torn = _store_with_a_record_across_a_page(tmp_path)
    m = torn["msg"]
    _tear(path, torn["page"])
    with open(path / "commitlog" / f"{0:020d}", "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        size, msg, reason = codec.check(mm, m.commit_log_offset, len(mm), check_crc=True, base=0)
        assert msg is None and "torn record" in reason and str(torn["page"]) in reason
        # Without the trusted-record check (no base) the bytes still decode: that is what got through before.
        size, msg, reason = codec.check(mm, m.commit_log_offset, len(mm), check_crc=True, read_body=True)
        assert msg is not None and msg.body == m.body and msg.tags != "TagB"
    with MessageStore.open(str(path), _config(), read_only=True) as store:  # a reader's log ends before it
        assert store.max_phy_offset() == m.commit_log_offset
        assert [x.commit_log_offset for _o, _s, x, _p in store.messages(0, read_body=False, skip_damaged=True)
                if x is not None][-1] < m.commit_log_offset


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_no_golden_record_looks_torn(name):
    """Every record RocketMQ wrote passes: the rule matches only the torn-page shape."""
    checked = 0
    for seg in sorted(glob.glob(os.path.join(golden_store(name), "commitlog", "*"))):
        base = int(os.path.basename(seg))
        with open(seg, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for pos, size, msg, reason in codec.walk(mm, 0, len(mm), check_crc=True, base=base):
                if size == 0:
                    break
                assert msg is not None, f"{seg}@{pos}: {reason}"
                assert codec.torn_tail(mm, pos, pos + size, base) is None
                checked += 1
    assert checked > 0


# ---------------------------------------------------------------- torn sectors (session 14)

LONG_TOPIC = "Torn_" + "t" * 110  # a V1 topic long enough that some record's topic crosses a sector boundary


def _store_of_long_tails(tmp_path: Path, topic: str, pad: int) -> tuple[Path, list]:
    """Messages whose topic and properties (``pad`` bytes of one property) make long record tails."""
    path = tmp_path / "s"
    with MessageStore.open(str(path), _config()) as store:
        for i in range(40):
            assert store.put(Message(topic, b"b%03d" % i, tags="TagB", keys=[f"k{i}"], queue_id=0,
                                     properties={"pad": "x" * (pad + i % 7)})).ok
        assert store.wait_dispatched()
        msgs = _all(store, topic)
    assert len(msgs) == 40
    return path, msgs


def _all(store: MessageStore, topic: str) -> list:
    """Every message of ``topic``'s queue 0 through ``get`` (which hands out at most 32 a call)."""
    out: list = []
    while True:
        got = store.get(topic, 0, len(out), 32).messages
        if not got:
            return out
        out += got


def _sector_in(msgs: list, data: bytes, part: str, room: int) -> tuple:
    """A record and a sector start inside its ``part`` ("topic" or "properties") after the record's last page
    start (written bytes of the record lie between the two), with ``room`` bytes of the record after it."""
    for m in msgs:
        pos, end = m.commit_log_offset, m.commit_log_offset + m.size
        _h, tp, tl, _plen = codec.parse(data, pos, len(data))
        lo, hi = (tp, tp + tl) if part == "topic" else (tp + tl + 2, end)
        for s in range((lo + SECTOR - 1) // SECTOR * SECTOR, hi, SECTOR):
            if (end - 1) // PAGE * PAGE < s and s + room < end and m is not msgs[0] and m is not msgs[-1]:
                return m, s
    pytest.fail(f"no record has a sector start inside its {part}")


def _opened_after_the_cut(path: Path, topic: str, msgs: list, m) -> None:
    """Recovery after the power cut ends the log before the torn record ``m``: the records before it read back
    intact, the torn one is not served, and its queue offset is given to the next put."""
    with MessageStore.open(str(path), _config()) as store:
        got = _all(store, topic)
        before = [x for x in msgs if x.commit_log_offset < m.commit_log_offset]
        assert [(x.queue_offset, x.body, x.topic, x.properties) for x in got] == \
            [(x.queue_offset, x.body, x.topic, x.properties) for x in before]
        assert store.max_phy_offset() == m.commit_log_offset
        r = store.put(Message(topic, b"next", tags="TagB", queue_id=0))
        assert r.ok and r.queue_offset == m.queue_offset
    with MessageStore.open(str(path), _config(), read_only=True) as store:
        [nxt] = store.get(topic, 0, m.queue_offset, 1).messages
        assert nxt.body == b"next" and nxt.tags == "TagB"
        walked = [x for _o, _s, x, _p in store.messages(0, read_body=True, skip_damaged=True) if x is not None]
        assert [x.body for x in walked] == [x.body for x in before] + [b"next"]


def test_the_last_sectors_of_a_write_lost_inside_the_properties_are_a_torn_write(tmp_path):
    """The cut kept the first sectors of the record's last page and lost the rest (zeros from a sector start
    inside the properties to the segment's end): the page is not all zeros, so the torn-page rule did not see it
    and ``get`` served the record with zeros in its properties.  (Zeros from inside the topic on also zero the
    properties length: the lengths disagree, which every check saw before.)"""
    path, msgs = _store_of_long_tails(tmp_path, "Busy", 300)
    seg = path / "commitlog" / f"{0:020d}"
    data = seg.read_bytes()
    m, s = _sector_in(msgs, data, "properties", 1)
    with open(seg, "r+b") as fh:
        fh.seek(s)
        fh.write(bytes(len(data) - s))
    _flushed_until(path, msgs[0].store_timestamp - 1)
    rebooted(path)
    _opened_after_the_cut(path, "Busy", msgs, m)


def test_tail_problem_names_what_no_producer_writes():
    """codec.tail_problem on records whose lengths agree: the topic and the properties are checked as bytes."""
    def problem(topic: bytes, props: bytes, v2: bool = False) -> str | None:
        rec = bytearray(codec.encode_bytes("T" * (200 if v2 else 1), b"body", properties="a\x01b\x02"))
        h, tp, tl, _pl = codec.parse(rec, 0, len(rec))
        head = len(topic).to_bytes(2 if v2 else 1, "big") + topic + len(props).to_bytes(2, "big") + props
        rec[tp - (2 if v2 else 1):] = head
        rec[0:4] = len(rec).to_bytes(4, "big")
        codec.parse(rec, 0, len(rec))  # the lengths agree
        return codec.tail_problem(rec, 0, len(rec))

    assert problem(b"TopicA", b"a\x01b\x02") is None
    assert problem(b"%RETRY%g|x-y_z", b"") is None
    assert problem(b"T" * 200, "n\x01ünï\x01\x02e\x01\x02".encode(), v2=True) is None
    assert "topic" in problem(b"Top\x00cA", b"a\x01b\x02")
    assert "topic" in problem(b"Topic/A", b"a\x01b\x02")
    assert "topic" in problem(b"", b"a\x01b\x02")
    assert "zero byte" in problem(b"TopicA", b"a\x01b\x00\x02")
    assert "pairs" in problem(b"TopicA", b"a\x01b\x02garbage")
    assert "pairs" in problem(b"TopicA", b"\x01b\x02")
    assert "UTF-8" in problem(b"TopicA", b"a\x01\xff\xfe\x02")
    assert "zero byte" in problem(b"T" * 200, b"a\x01b\x02\x00\x00", v2=True)


def test_a_stale_sector_inside_the_properties_is_a_torn_write(tmp_path):
    """One sector inside a record's properties holds what an earlier write left there (bytes of another record,
    as after a segment's stale tail), the sectors after it were written: only the tail check sees it."""
    path, msgs = _store_of_long_tails(tmp_path, "Busy", 1200)
    seg = path / "commitlog" / f"{0:020d}"
    data = bytearray(seg.read_bytes())
    m, s = _sector_in(msgs, bytes(data), "properties", SECTOR + 1)
    data[s:s + SECTOR] = data[0:SECTOR]  # the bytes of the first record, as a reused page would hold
    seg.write_bytes(bytes(data))
    with open(seg, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        size, msg, reason = codec.check(mm, m.commit_log_offset, len(mm), check_crc=True, base=0)
        assert msg is not None  # every other check passes: BODYCRC, lengths, PHYSICALOFFSET, the torn-page rule
        size, msg, reason = codec.check(mm, m.commit_log_offset, len(mm), check_crc=True, base=0, strict=True)
        assert msg is None and "damaged record tail" in reason and str(m.commit_log_offset) in reason
    _flushed_until(path, msgs[0].store_timestamp - 1)
    rebooted(path)
    _opened_after_the_cut(path, "Busy", msgs, m)


def _torn_in_place(tmp_path: Path) -> tuple[Path, list, object, bytes]:
    path, msgs = _store_of_long_tails(tmp_path, "Busy", 300)
    seg = path / "commitlog" / f"{0:020d}"
    data = bytearray(seg.read_bytes())
    m = msgs[-1]  # the last record: nothing intact after it
    _h, tp, tl, _plen = codec.parse(bytes(data), m.commit_log_offset, len(data))
    data[tp + tl + 2 + 40:tp + tl + 2 + 60] = bytes(20)  # zeros inside its properties
    seg.write_bytes(bytes(data))
    return path, msgs, m, bytes(data)


def test_damage_in_the_tail_of_a_record_the_checkpoint_counts_as_flushed_is_refused(tmp_path):
    """A power cut cannot tear a record a thorough flush covered: damage in its tail is the disk's.  Recovery
    refuses to open (naming the file and the offset) and changes no commitlog byte, rather than cut the record
    and hide it, or serve it with zeros in its properties."""
    path, msgs, m, before = _torn_in_place(tmp_path)
    _flushed_until(path, m.store_timestamp + 1)
    rebooted(path)
    with pytest.raises(CommitLogDamagedError) as e:
        MessageStore.open(str(path), _config())
    seg = path / "commitlog" / f"{0:020d}"
    assert str(seg) in str(e.value) and f"offset {m.commit_log_offset}" in str(e.value)
    assert seg.read_bytes() == before


def test_a_crash_of_the_process_alone_keeps_the_narrower_rule(tmp_path):
    """Without a power loss no sector is lost: a record whose properties hold zeros mid-string (written by an
    older version, which let a zero byte through) is served as it is, and nothing is cut."""
    path, msgs, m, before = _torn_in_place(tmp_path)
    process_crashed(path)
    with MessageStore.open(str(path), _config()) as store:
        assert store.max_phy_offset() == m.commit_log_offset + m.size
        got = _all(store, "Busy")
        assert [x.body for x in got] == [x.body for x in msgs]
        assert "\x00" in got[-1].properties_string and got[-1].tags == "TagB"


@pytest.mark.parametrize("props", ["a\x01b\x00c\x02", "a\x01b\x02\x00", "\x01b\x02", "ab\x02", "a\x01b", "a\x01b\x02c"])
def test_put_refuses_properties_recovery_would_take_for_a_torn_write(tmp_path, props):
    with MessageStore.open(str(tmp_path / "s"), _config(), start_services=False) as s:
        m = Message(topic="TopicT", body=b"x", queue_id=0)
        m.properties_string = props
        assert not s.put(m).ok
        assert s.commitlog.max_offset() == 0
        ok = Message(topic="TopicT", body=b"x", queue_id=0, properties={"a": "v\x01w", "e": "", "u": "ünï"})
        assert s.put(ok).ok


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_no_golden_record_has_a_tail_a_producer_does_not_write(name):
    """Every record RocketMQ wrote passes the strict tail check recovery applies after a power loss."""
    checked = 0
    for seg in sorted(glob.glob(os.path.join(golden_store(name), "commitlog", "*"))):
        base = int(os.path.basename(seg))
        with open(seg, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for pos, size, msg, reason in codec.walk(mm, 0, len(mm), check_crc=True, base=base, strict=True):
                if size == 0:
                    break
                assert msg is not None, f"{seg}@{pos}: {reason}"
                checked += 1
    assert checked > 0


def test_a_flushed_record_with_damaged_topic_bytes_after_a_reboot_is_refused_not_cut(tmp_path):
    """Topic bytes damaged (BODYCRC still holds) in a record before the checkpoint's flushed point, then an unclean
    start after a reboot: the tail check stops there, and recovery refuses (the file and offset named, the
    commitlog untouched) rather than truncate the log at a record that was on disk.  After a crash of the process
    alone the dispatch leaves such a record out of the queues (tests/services/test_store_guards.py)."""
    path = tmp_path / "s"
    with MessageStore.open(str(path), _config()) as store:
        assert store.put(Message("Good", b"before")).ok
        bad = store.put(Message("A" * 100, b"damaged"))
        assert store.put(Message("Good", b"after")).ok
    seg = path / "commitlog" / f"{0:020d}"
    data = seg.read_bytes().replace(b"A" * 100, b"\xff" * 100)
    seg.write_bytes(data)
    rebooted(path)
    with pytest.raises(CommitLogDamagedError) as e:
        MessageStore.open(str(path), _config())
    assert str(seg) in str(e.value) and f"offset {bad.commit_log_offset}" in str(e.value)
    assert "not a legal topic name" in str(e.value)
    assert seg.read_bytes() == data


def test_intact_head_wants_the_whole_header_and_the_body():
    """The refusal to cut a flushed record rests on codec.intact_head: a record zeroed from inside its header
    (queue model seed 6121: a cut at STORETIMESTAMP left BODYLENGTH 0, so no body was checked) is no intact
    record, and a power cut may well have torn it."""
    rec = bytes(codec.encode_bytes("T", b"abc", properties="a\x01b\x02", physical_offset=4096,
                                   store_timestamp=5))
    assert codec.intact_head(rec, 0, len(rec), 4096) == 5
    assert codec.intact_head(rec, 0, len(rec), 0) is None  # PHYSICALOFFSET is not its position
    assert codec.intact_head(rec[:-4] + bytes(4), 0, len(rec), 4096) == 5  # the tail does not matter
    for cut in (61, 84, 88, 90):  # inside the header (STORETIMESTAMP, BODYLENGTH), or in the body
        assert codec.intact_head(rec[:cut] + bytes(len(rec) - cut), 0, len(rec), 4096) is None, cut
    empty = bytes(codec.encode_bytes("T", b"", physical_offset=0, store_timestamp=7))
    assert codec.intact_head(empty, 0, len(empty), 0) == 7
