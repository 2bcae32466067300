"""Issue #24, found by the model-based test's ``truncate`` op: a last segment cut short is a torn last segment
(extended, then recovered as any torn tail), never a stray moved aside at open; a store whose records were all cut
off is empty, not one with a lost index."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import GOLDEN_CONF, golden_expected, run_cli
from rocketstore import Message
from rocketstore.errors import StoreLoadError
from rocketstore.store import MessageStore
from rocketstore.recovery.verify import verify_store

SEG = 1048576
LAST = f"{3 * SEG:020d}"  # golden basic's last segment: 454 records, the first (TopicB-1 @373) 3668 bytes long


def _before_last() -> list[dict]:
    return [e for e in golden_expected("basic") if e["commitLogOffset"] < 3 * SEG]


@pytest.mark.parametrize("cut", [1006, 20, 6, 3])
def test_a_last_segment_cut_inside_its_first_record_is_torn_not_a_stray(basic_copy: Path, cut: int):
    """Cut inside its first record (no whole record left): the segment was moved to quarantine/ as a stray
    (recover exit 0, verify INCONSISTENT "quarantined ... moved aside at open"; model seed 4002).  It is the
    log's torn tail: extended, the cut records gone, every record before it kept, verify clean."""
    (basic_copy / "broker.conf").write_text(GOLDEN_CONF)
    seg = basic_copy / "commitlog" / LAST
    os.truncate(seg, cut)
    with pytest.raises(StoreLoadError, match=rf"torn last segment \({cut} of {SEG} bytes\).*rocketstore recover"):
        MessageStore.open(str(basic_copy), read_only=True)
    assert seg.stat().st_size == cut  # a reader changes nothing
    r = run_cli("recover", basic_copy)
    assert r.returncode == 0, r.stderr
    assert not (basic_copy / "quarantine").exists()
    assert seg.stat().st_size == SEG
    with MessageStore.open(str(basic_copy), read_only=True) as store:
        assert store.max_phy_offset() == 3 * SEG
        assert verify_store(store.files)["problems"] == []
        for e in _before_last()[-40:]:
            [m] = store.get(e["topic"], e["queueId"], e["queueOffset"], 1).messages
            assert (m.commit_log_offset, m.body_crc) == (e["commitLogOffset"], e["bodyCrc"])
    with MessageStore.open(str(basic_copy)) as store:  # the cut took TopicB-1 @373 on: the next put is 373
        r = store.put(Message("TopicB", b"after the cut", queue_id=1))
        assert (r.queue_offset, r.commit_log_offset) == (373, 3 * SEG)


def test_a_last_segment_whose_only_whole_record_is_damaged_is_not_a_stray(basic_copy: Path):
    """Cut at 4000 bytes (inside the second record) with a body bit of the first flipped: no trusted record, yet
    a record of this position starts there.  The segment was moved aside as a stray (and ``verify --repair``
    refused it: "repair refuses to guess its records"); it is the log's torn tail, recovered as one."""
    (basic_copy / "broker.conf").write_text(GOLDEN_CONF)
    seg = basic_copy / "commitlog" / LAST
    os.truncate(seg, 4000)
    with open(seg, "r+b") as fh:
        fh.seek(200)
        b = fh.read(1)
        fh.seek(200)
        fh.write(bytes([b[0] ^ 1]))
    dry = run_cli("verify", basic_copy, "--repair", "--dry-run", "--json")
    assert dry.returncode in (0, 1) and b"refuses to guess" not in dry.stderr, dry.stderr
    assert seg.stat().st_size == 4000
    r = run_cli("recover", basic_copy)
    assert r.returncode == 0, r.stderr
    assert not (basic_copy / "quarantine").exists()
    assert seg.stat().st_size == SEG
    with MessageStore.open(str(basic_copy), read_only=True) as store:
        assert store.max_phy_offset() == 3 * SEG
        assert verify_store(store.files)["problems"] == []
        for e in _before_last()[-40:]:
            [m] = store.get(e["topic"], e["queueId"], e["queueOffset"], 1).messages
            assert m.commit_log_offset == e["commitLogOffset"]


def test_a_short_last_segment_out_of_place_holding_a_cut_record_is_refused_not_moved(basic_copy: Path):
    """A short file after a gap (not the log's next segment) whose bytes are a record of its position, cut: it
    may hold messages, so the open refuses (naming --allow-quarantine) and moves nothing."""
    (basic_copy / "broker.conf").write_text(GOLDEN_CONF)
    data = (basic_copy / "commitlog" / LAST).read_bytes()[:1006]
    os.unlink(basic_copy / "commitlog" / LAST)
    # the record's PHYSICALOFFSET names 3*SEG: put it at 3*SEG with segment 2*SEG missing
    os.unlink(basic_copy / "commitlog" / f"{2 * SEG:020d}")
    (basic_copy / "commitlog" / LAST).write_bytes(data)
    r = run_cli("recover", basic_copy)
    assert r.returncode == 2 and r.stderr.count(b"\n") == 1 and b"--allow-quarantine" in r.stderr, r.stderr
    assert not (basic_copy / "quarantine").exists()
    assert (basic_copy / "commitlog" / LAST).stat().st_size == 1006


def test_a_store_whose_only_segment_lost_every_record_has_no_lost_index(tmp_path: Path):
    """Model seed 1020: every record of the only segment cut off, the segment zero-filled back to size by the
    operator.  Recovery deleted the index file (every entry pointed past the end), after which every read-only
    open (verify) reported "no index file, yet the commitlog holds records (a lost index)" for an empty log."""
    path = tmp_path / "s"
    path.mkdir()
    (path / "broker.conf").write_text("mappedFileSizeCommitLog=32768\nmappedFileSizeConsumeQueue=6000\n"
                                      "maxHashSlotNum=32\nmaxIndexNum=128\n")
    with MessageStore.open(str(path)) as store:
        for i in range(10):
            assert store.put(Message("T", b"x" * 100, keys=f"k{i}")).ok
    seg = path / "commitlog" / f"{0:020d}"
    os.truncate(seg, 2)  # zeros (the high bytes of the first TOTALSIZE): nothing says a record was there
    os.truncate(seg, 32768)
    with MessageStore.open(str(path)) as store:
        assert store.max_phy_offset() == 0
    assert os.listdir(path / "index") == []
    with MessageStore.open(str(path), read_only=True) as store:
        assert verify_store(store.files)["problems"] == []
    with MessageStore.open(str(path)) as store:
        assert store.put(Message("T", b"again", keys="k-again")).queue_offset == 0
    with MessageStore.open(str(path), read_only=True) as store:
        assert [m.body for m in store.query("T", "k-again", 4).messages] == [b"again"]
        assert verify_store(store.files)["problems"] == []



def test_a_record_the_cut_went_through_after_its_body_is_not_read_as_whole(basic_copy: Path):
    """Model seed 1004 (``put,kill,recover,retention,truncate,repair_int,reimport,rm_cq``): the last segment cut 5
    bytes before the end of its second record (TopicA-1 @322, 673 bytes at 3149396), inside its properties,
    which no CRC covers, and not at a page start (which codec.torn_tail would see).  Extended with zeros, the
    record read as whole, with properties cut short, and the walk handed out a message that was cut."""
    (basic_copy / "broker.conf").write_text(GOLDEN_CONF)
    seg = basic_copy / "commitlog" / LAST
    second = 3149396
    os.truncate(seg, second + 673 - 5 - 3 * SEG)
    r = run_cli("recover", basic_copy)
    assert r.returncode == 0, r.stderr
    with MessageStore.open(str(basic_copy), read_only=True) as store:
        assert store.max_phy_offset() == second
        assert [off for off, *_ in store.messages(3 * SEG, skip_damaged=True)] == [3 * SEG]
        assert not store.get("TopicA", 1, 322, 1).messages
        [m] = store.get("TopicB", 1, 373, 1).messages  # the record before the cut stays
        assert m.commit_log_offset == 3 * SEG
        assert verify_store(store.files)["problems"] == []
