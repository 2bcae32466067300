"""CommitLog on its own: append encoded records, reopen, read back by offset with the CRC check; the blank
record at a segment's end; min/max offsets; the golden commitlog read against expected.jsonl
(cf. Kafka's LogSegmentTest)."""

from __future__ import annotations

import base64
import struct

import pytest
from conftest import golden_expected, golden_store

from rocketstore.errors import CorruptRecordError
from rocketstore.format import codec
from rocketstore.storage.commitlog import CommitLog

SIZE = 4096


def _record(i: int, n: int = 200) -> codec.EncodedRecord:
    return codec.encode("TopicK", bytes([i % 251]) * n, queue_id=1, born_timestamp=1700000000000 + i,
                        properties=f"KEYS\x01k{i}\x02")


def _put(cl: CommitLog, count: int, n: int = 200) -> list[tuple[int, int, int]]:
    """Append ``count`` records; (offset, size, store timestamp) of each."""
    out = []
    with cl.put_lock:
        for i in range(count):
            off, size, ts, offs = cl.append([_record(i, n)], i, store_timestamp=1795000000000 + i)
            assert offs == [off]
            out.append((off, size, ts))
    return out


def test_append_reopen_read_back_with_crc(tmp_path):
    cl = CommitLog(str(tmp_path), SIZE)
    cl.load()
    put = _put(cl, 50)  # about 15 KiB: four segments
    assert cl.min_offset() == 0 and cl.max_offset() == put[-1][0] + put[-1][1]
    cl.flush()
    cl.close()

    r = CommitLog(str(tmp_path), SIZE, read_only=True)
    r.load()
    assert r.min_offset() == 0
    for i, (off, size, ts) in enumerate(put):
        m = r.read_message(off, check_crc=True)
        assert (m.topic, m.queue_id, m.queue_offset, m.commit_log_offset, m.size) == ("TopicK", 1, i, off, size)
        assert m.store_timestamp == ts and m.born_timestamp == 1700000000000 + i
        assert m.body == bytes([i % 251]) * 200
        assert m.properties == {"KEYS": f"k{i}"}
        assert r.pickup_store_timestamp(off, size) == ts
    walked = [(off, size) for off, size, m, why in r.scan(0, check_crc=True) if m is not None]
    assert walked == [(o, s) for o, s, _ in put]
    r.close()


def test_a_record_that_does_not_fit_leaves_a_blank_record_and_goes_to_the_next_segment(tmp_path):
    cl = CommitLog(str(tmp_path), SIZE)
    put = _put(cl, 30)
    rolled = [(a, b) for a, b in zip(put, put[1:]) if b[0] // SIZE != a[0] // SIZE]
    assert rolled
    for (off, size, _), (nxt, _, _) in rolled:
        end = off + size
        assert nxt % SIZE == 0 and nxt > end  # the next record starts the next segment
        f = cl.queue.find(end)
        remaining, magic = struct.unpack_from(">iI", f.mm, end - f.file_from_offset)
        assert magic == codec.BLANK_MAGIC and remaining == nxt - end  # the blank tells how much is left
        assert remaining >= codec.BLANK_RECORD_SIZE
    cl.close()


def test_a_record_larger_than_a_segment_is_refused(tmp_path):
    cl = CommitLog(str(tmp_path), SIZE)
    with cl.put_lock, pytest.raises(codec.MessageTooLarge, match="mappedFileSizeCommitLog"):
        cl.append([_record(0, SIZE)], 0)
    assert cl.max_offset() == 0
    cl.close()


def test_reading_an_offset_outside_every_segment_names_it(tmp_path):
    cl = CommitLog(str(tmp_path), SIZE)
    _put(cl, 2)
    with pytest.raises(CorruptRecordError, match=f"commitlog offset {10 * SIZE} is not in any segment"):
        cl.read_message(10 * SIZE)
    assert cl.pickup_store_timestamp(10 * SIZE, 100) == -1
    cl.close()


def test_crc_check_catches_a_flipped_body_bit(tmp_path):
    cl = CommitLog(str(tmp_path), SIZE)
    (off, size, _), = _put(cl, 1)
    f = cl.queue.find(off)
    f.mm[size - 40] ^= 0x01  # inside the body (the tail is topic + properties, about 25 bytes)
    assert cl.read_message(off).body != bytes(200)  # read without the check: served
    with pytest.raises(CorruptRecordError, match="at offset 0"):
        cl.read_message(off, check_crc=True)
    cl.close()


@pytest.mark.parametrize("name", ["basic", "ipv6", "v2"])
def test_golden_commitlog_reads_every_expected_record(name):
    cl = CommitLog(str(golden_store(name) / "commitlog"), 1048576, read_only=True)
    cl.load()
    try:
        expected = golden_expected(name)
        assert cl.min_offset() == 0
        for e in expected:
            m = cl.read_message(e["commitLogOffset"], check_crc=True)
            assert (m.topic, m.queue_id, m.queue_offset, m.size, m.body_crc, m.store_timestamp, m.sys_flag) == \
                (e["topic"], e["queueId"], e["queueOffset"], e["size"], e["bodyCrc"], e["storeTimestamp"],
                 e["sysFlag"])
            assert m.body == base64.b64decode(e["body"])
        last = max(expected, key=lambda e: e["commitLogOffset"])
        assert cl.max_offset() >= last["commitLogOffset"] + last["size"]
    finally:
        cl.close()
