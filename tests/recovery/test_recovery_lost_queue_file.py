"""A consume-queue file lost (deleted, or quarantined for its size) while its records are still in the commitlog.

Retention deletes a queue's first file only once every unit in it points below
the commitlog's minimum; a first file whose records are still in the commitlog
was lost, and recovery must refill the queue from the commitlog, not take the
gap for expiry.  Likewise a lost last file: its records come back at their
queue offsets.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import golden_expected, run_cli
from rocketstore import GetMessageStatus, MessageStore
from rocketstore.config import golden_config


def _reads_every_golden_message(store: MessageStore, topic: str, qid: int) -> None:
    want = [e for e in golden_expected("basic") if (e["topic"], e["queueId"]) == (topic, qid)]
    assert store.min_offset_in_queue(topic, qid) == 0
    assert store.max_offset_in_queue(topic, qid) == len(want)
    for e in want:
        r = store.get(topic, qid, e["queueOffset"], 1)
        assert r.status is GetMessageStatus.FOUND, (e["queueOffset"], r.status)
        m = r.messages[0]
        assert (m.queue_offset, m.commit_log_offset, m.keys) == (e["queueOffset"], e["commitLogOffset"], e["keys"])


@pytest.mark.parametrize("crash", [False, True])
@pytest.mark.parametrize("lost", ["00000000000000000000", "00000000000000006000", "both"])
def test_a_lost_queue_file_whose_records_are_in_the_commitlog_is_refilled(basic_copy: Path, lost, crash):
    qdir = basic_copy / "consumequeue" / "TopicA" / "0"
    for name in (["00000000000000000000", "00000000000000006000"] if lost == "both" else [lost]):
        os.unlink(qdir / name)
    if crash:
        (basic_copy / "abort").write_text("4242")
        (basic_copy / "abort.bootid").write_text("00000000-0000-0000-0000-000000000000")
    with MessageStore.open(str(basic_copy), golden_config()) as store:
        _reads_every_golden_message(store, "TopicA", 0)
    with MessageStore.open(str(basic_copy), golden_config(), read_only=True) as store:
        _reads_every_golden_message(store, "TopicA", 0)
    r = run_cli("verify", basic_copy)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def test_a_queue_whose_first_file_expired_is_not_refilled(basic_copy: Path):
    """Real retention: the first commitlog segment and the queue files whose units all point into it are gone;
    the queue starts at the first unit whose record is left, and no file is rewritten."""
    seg = 3 * 1048576
    for n in range(3):
        os.unlink(basic_copy / "commitlog" / f"{n * 1048576:020d}")
    expected = golden_expected("basic")
    removed = []
    for qdir in (basic_copy / "consumequeue").glob("*/*"):
        first = qdir / "00000000000000000000"
        data = first.read_bytes()
        if int.from_bytes(data[-20:-12], "big") < seg and len(list(qdir.iterdir())) > 1:
            os.unlink(first)
            removed.append((qdir.parent.name, int(qdir.name)))
    assert removed
    before = {p: p.stat().st_mtime_ns for p in (basic_copy / "consumequeue").rglob("0000*")}
    with MessageStore.open(str(basic_copy), golden_config()) as store:
        assert store.recovery_report.queues_rebuilt == {}
        for topic, qid in removed:
            kept = [e for e in expected if (e["topic"], e["queueId"]) == (topic, qid) and e["commitLogOffset"] >= seg]
            assert store.min_offset_in_queue(topic, qid) == kept[0]["queueOffset"]
            r = store.get(topic, qid, kept[0]["queueOffset"], 1)
            assert r.messages[0].commit_log_offset == kept[0]["commitLogOffset"]
    assert {p: p.stat().st_mtime_ns for p in (basic_copy / "consumequeue").rglob("0000*")} == before


def test_a_damaged_unit_just_before_a_hole_is_rebuilt_too(basic_copy: Path):
    """Damage that zeroes units 77..87 and overwrites unit 76's size with another valid-looking one: the queue
    is cut at the hole, and unit 76, which no longer matches its record, is rebuilt with it."""
    first = basic_copy / "consumequeue" / "TopicA" / "0" / "00000000000000000000"
    data = bytearray(first.read_bytes())
    data[76 * 20 + 8:76 * 20 + 12] = (512).to_bytes(4, "big")
    data[77 * 20:88 * 20] = bytes(11 * 20)
    first.write_bytes(bytes(data))
    with MessageStore.open(str(basic_copy), golden_config()) as store:
        assert store.recovery_report.queues_rebuilt == {"TopicA-0": 76}
        _reads_every_golden_message(store, "TopicA", 0)
    r = run_cli("verify", basic_copy)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.parametrize("offset", [1 << 40, 1000])
def test_a_unit_damaged_into_a_valid_looking_offset_out_of_order_is_rebuilt(basic_copy: Path, offset):
    """A unit in the middle of a queue points far ahead (or back): every unit after it would be cut as
    pointing past the commitlog's end (or the read fails); recovery cuts the queue at the unit out of
    order and refills it from the commitlog."""
    qfile = basic_copy / "consumequeue" / "TopicC" / "0" / "00000000000000006000"
    data = bytearray(qfile.read_bytes())
    data[160 * 20:160 * 20 + 8] = offset.to_bytes(8, "big")  # unit 460
    qfile.write_bytes(bytes(data))
    with MessageStore.open(str(basic_copy), golden_config()) as store:
        assert store.recovery_report.queues_rebuilt["TopicC-0"] in (459, 460)
        _reads_every_golden_message(store, "TopicC", 0)
    r = run_cli("verify", basic_copy)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.parametrize("vectorised", [False, True])
def test_ascending_end_finds_the_earlier_of_two_units_out_of_order(monkeypatch, vectorised):
    """Both ways of checking unit order (a Python loop for small files, numpy for big ones) agree."""
    import struct
    from rocketstore.storage import consume_queue

    monkeypatch.setattr(consume_queue, "_NUMPY_MIN_UNITS", 1 if vectorised else 1 << 30)

    def units(*pairs):
        return b"".join(struct.pack(">qiq", o, s, 0) for o, s in pairs)
    blank = (0, 0x7FFFFFFF)
    good = [blank, blank, (100, 10), (110, 10), (200, 5), (300, 5)]
    end = consume_queue._ascending_end
    assert end(units(*good), 6 * 20, -1) == (120, 305)  # blank units before the first message are skipped
    assert end(units(*good), 6 * 20, 150) == (0, 150)  # the first unit points below the file before's end
    far = good[:4] + [(1 << 40, 5), (300, 5)]
    assert end(units(*far), 6 * 20, -1) == (80, 120)  # unit 4 points far ahead: cut at it
    back = good[:4] + [(50, 5), (300, 5)]
    assert end(units(*back), 6 * 20, -1) == (60, 110)  # unit 4 points back: cut at unit 3, the earlier one
