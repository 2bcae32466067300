"""ConsumeQueue on its own: 20-byte units, put, reopen (load + recover), read by queue offset, min/max, time
lookup, truncate to a physical offset; golden queues checked against expected.jsonl."""

from __future__ import annotations

import os
import struct
from collections import defaultdict

import pytest
from conftest import golden_expected, golden_store

from rocketstore.storage.consume_queue import CQ_STORE_UNIT_SIZE, LOWER, PRE_BLANK_UNIT, UPPER, ConsumeQueue

SIZE = 20 * 10  # ten units a file


def _made(cq: ConsumeQueue) -> ConsumeQueue:
    """The queue table makes a queue's directory before its first unit (storage/files.py); so do the tests."""
    if not cq.queue.read_only:
        os.makedirs(cq.directory, exist_ok=True)
    return cq


def _queue(root, **kw) -> ConsumeQueue:
    cq = _made(ConsumeQueue(str(root), "TopicQ", 3, SIZE, **kw))
    cq.load()
    return cq


def _units(n: int, start_phy: int = 0) -> list[tuple[int, int, int]]:
    return [(start_phy + 100 * i, 100, 1000 + i) for i in range(n)]


def test_put_reopen_read_by_queue_offset(tmp_path):
    cq = _queue(tmp_path)
    units = _units(25)
    for q, (off, size, code) in enumerate(units):
        assert cq.put_unit(off, size, code, q)
    cq.flush()
    cq.close()
    d = tmp_path / "TopicQ" / "3"
    assert sorted(os.listdir(d)) == [f"{0:020d}", f"{200:020d}", f"{400:020d}"]
    raw = (d / f"{0:020d}").read_bytes()
    assert struct.unpack_from(">qiq", raw, 3 * CQ_STORE_UNIT_SIZE) == units[3]  # big-endian, 20 bytes a unit

    r = _queue(tmp_path, read_only=True)
    r.recover()
    assert (r.min_offset_in_queue, r.max_offset_in_queue, r.message_total_in_queue) == (0, 25, 25)
    assert r.max_physic_offset == 2500
    for q, u in enumerate(units):
        assert r.get_unit(q) == u
    assert r.get_unit(25) is None
    f = r.hold_file_at(12)
    try:
        assert r.read_units(f, 12, 5) == sum(units[12:17], ())
        assert r.read_units(f, 18, 5) == sum(units[18:20], ())  # cut at the file's end
    finally:
        f.release()
    assert r.first_unit() == (0, 0) and r.last_unit() == units[-1]
    assert r.unit_pointing_at(1300) == 13 and r.unit_pointing_at(1350) is None
    r.close()


def test_duplicates_are_skipped_and_put_units_matches_put_unit(tmp_path):
    a = _made(ConsumeQueue(str(tmp_path / "a"), "T", 0, SIZE))
    b = _made(ConsumeQueue(str(tmp_path / "b"), "T", 0, SIZE))
    units = _units(23)
    for q, u in enumerate(units):
        a.put_unit(*u, q)
    a.put_unit(*units[5], 5)  # re-dispatch of an old record: nothing added
    b.put_units([u[0] for u in units], [u[1] for u in units], [u[2] for u in units], 0)
    assert a.max_offset_in_queue == b.max_offset_in_queue == 23
    for x, y in zip(a.queue, b.queue):
        assert x.mm[:x.wrote_position] == y.mm[:y.wrote_position]
    a.close()
    b.close()


def test_a_queue_starting_past_zero_keeps_its_minimum(tmp_path):
    cq = _queue(tmp_path)
    cq.put_unit(5000, 100, 7, 13)  # first unit at queue offset 13: file 200 (units 10..19)
    assert cq.queue.first().file_from_offset == 200
    assert cq.min_offset_in_queue == 13 and cq.max_offset_in_queue == 14
    assert cq.get_unit(12) is None and cq.get_unit(13) == (5000, 100, 7)
    assert cq.first_unit() == (5000, 13)  # the blank units before it are skipped
    cq.close()


def test_truncate_dirty_logic_drops_and_zeroes_units_at_or_past_the_offset(tmp_path):
    cq = _queue(tmp_path)
    for q, u in enumerate(_units(25)):
        cq.put_unit(*u, q)
    assert cq.truncate_dirty_logic(1250) == 12  # units 13.. point at 1300 and later
    assert cq.max_offset_in_queue == 13 and cq.max_physic_offset == 1300
    assert [f.file_from_offset for f in cq.queue] == [0, 200]
    f = cq.queue.last()
    assert f.mm[60:SIZE] == bytes(SIZE - 60)  # stale units zeroed: they cannot come back
    assert not (tmp_path / "TopicQ" / "3" / f"{400:020d}").exists()
    cq.put_unit(1300, 100, 1, 13)  # the queue grows again from the cut
    assert cq.get_unit(13) == (1300, 100, 1)
    cq.close()


def test_a_cut_after_blank_units_leaves_no_record_end_and_later_records_are_placed(tmp_path):
    """Store model seed 6078: a queue whose kept units were all blank (their records expired) had units appended
    at the wrong slots by recovery's first pass; cutting those (truncate_dirty_logic) set the queue's record end to
    the cut offset although no kept unit names a record, so the re-placing pass judged "0 bytes before the record
    cannot hold the records missing before it" and wrote blank units over acknowledged messages."""
    cq = _queue(tmp_path)
    for q in range(17):  # units 0..16: blank (a rebuild found their records expired)
        cq.queue.last_for_append(q * CQ_STORE_UNIT_SIZE).append(PRE_BLANK_UNIT)
    for q, u in enumerate(_units(3, start_phy=98304), 17):  # recovery's first pass: appended at 17.. (misplaced)
        cq.put_unit(*u, q)
    assert cq.truncate_dirty_logic(98304) == 3
    assert cq.max_offset_in_queue == 17 and cq.max_physic_offset == -1  # no kept unit names a record
    cq.pad_gaps = True  # the second pass places each record at its own queue offset
    for q, u in enumerate(_units(3, start_phy=98304), 78):
        cq.put_unit(*u, q)
    assert [cq.get_unit(q) for q in (78, 79, 80)] == _units(3, start_phy=98304)
    assert cq.blank_units == [(17, 77)]
    cq.close()


def test_recover_cuts_at_the_end_of_valid_units(tmp_path):
    cq = _queue(tmp_path)
    for q, u in enumerate(_units(7)):
        cq.put_unit(*u, q)
    cq.close()
    r = _queue(tmp_path)
    assert r.max_offset_in_queue == 10  # a load counts the file as full
    assert r.recover() == []
    assert r.max_offset_in_queue == 7 and r.rebuild_from is None
    r.close()


def test_offset_by_time(tmp_path):
    cq = _queue(tmp_path)
    units = _units(25)
    for q, u in enumerate(units):
        cq.put_unit(*u, q)
    times = {off: 10_000 + 10 * (q // 2) for q, (off, _, _) in enumerate(units)}  # two records per time

    def store_time(off: int, size: int) -> int:
        return times.get(off, -1)

    assert cq.offset_by_time(10_050, LOWER, store_time, 0) == 10
    assert cq.offset_by_time(10_050, UPPER, store_time, 0) == 11
    assert cq.offset_by_time(10_055, LOWER, store_time, 0) == 12
    assert cq.offset_by_time(10_055, UPPER, store_time, 0) == 11
    assert cq.offset_by_time(0, LOWER, store_time, 0) == 0
    assert cq.offset_by_time(99_999, LOWER, store_time, 0) == 25
    cq.close()


@pytest.mark.parametrize("name", ["basic", "ipv6"])
def test_golden_consume_queues_hold_the_expected_units(name):
    want: dict[tuple[str, int], dict[int, tuple]] = defaultdict(dict)
    for e in golden_expected(name):
        if e.get("cqUnit"):
            u = e["cqUnit"]
            want[(e["topic"], e["queueId"])][e["queueOffset"]] = (u["pos"], u["size"], u["tagsCode"])
    assert want
    root = str(golden_store(name) / "consumequeue")
    for (topic, qid), units in want.items():
        cq = ConsumeQueue(root, topic, qid, 6000, read_only=True)
        cq.load()
        try:
            cq.recover()
            assert cq.max_offset_in_queue == max(units) + 1
            for q, u in units.items():
                assert cq.get_unit(q) == u, (topic, qid, q)
        finally:
            cq.close()




def _started_past_zero(root) -> ConsumeQueue:
    """A queue whose first message has queue offset 13 (units 10..12 of its first file are blank units)."""
    cq = _queue(root)
    for q in range(13, 18):
        cq.put_unit(100 * q, 100, 0, q)
    return cq


def test_truncate_below_the_first_unit_of_a_queue_started_past_zero_then_refill(tmp_path):
    cq = _started_past_zero(tmp_path)
    assert cq.truncate_dirty_logic(1300) == 5  # recovery cut the commitlog at the queue's first record
    assert cq.max_offset_in_queue == 13
    cq.put_unit(1300, 100, 0, 13)  # re-dispatch of the record recovery kept offering again
    try:
        assert cq.max_physic_offset == 1400
        assert cq.get_unit(13) == (1300, 100, 0)
    finally:
        cq.close()


def test_reopen_of_a_queue_left_with_only_blank_units_then_refill(tmp_path):
    cq = _started_past_zero(tmp_path)
    cq.truncate_dirty_logic(1300)
    cq.flush()
    cq.close()
    r = _queue(tmp_path)
    r.recover()
    assert r.max_offset_in_queue == 13
    r.put_unit(1300, 100, 0, 13)
    try:
        assert r.max_physic_offset == 1400
        assert r.get_unit(13) == (1300, 100, 0)
    finally:
        r.close()


def test_the_last_naming_unit_and_the_naming_end_step_over_blank_units(tmp_path):
    """Units 0..9 name records (the first file), 10..19 are blank (expired or lost records: the second file).
    The naming end before a position walks back over files to unit 9's record; the last naming unit is looked
    for in the last file holding units only (none there: its units are all blank); blank units alone name no
    end."""
    cq = _queue(tmp_path)
    try:
        for i in range(10):
            cq.put_unit(1000 + 100 * i, 90, 0, i)
        last = cq.queue.last_for_append(SIZE)
        last.append(PRE_BLANK_UNIT * 10)  # units 10..19, blank
        assert cq.max_offset_in_queue == 20
        assert cq._naming_end(last, last.wrote_position) == 1000 + 100 * 9 + 90
        assert cq._naming_end(last, 0) == 1000 + 100 * 9 + 90  # from the file before
        assert cq._naming_end(cq.queue.files[0], 40) == 1190
        assert cq._last_naming_unit() is None
        cq.put_unit(5000, 80, 0, 20)
        assert cq._last_naming_unit() == (20, 5000)
        assert cq._naming_end(cq.queue.last(), cq.queue.last().wrote_position) == 5080
    finally:
        cq.close()
    blank = _made(ConsumeQueue(str(tmp_path), "TopicB", 0, SIZE))
    blank.load()
    try:
        blank.queue.last_for_append(0).append(PRE_BLANK_UNIT * 3)
        assert blank._naming_end(blank.queue.last(), blank.queue.last().wrote_position) == -1
        assert blank._last_naming_unit() is None
    finally:
        blank.close()
