"""SYNC_FLUSH writes zeros a chunk ahead of the commitlog's write position (CommitLog._zero_ahead), so that a
put's fdatasync lands on blocks that are already written: with fallocated (unwritten) blocks, the first write
to each block also made its fdatasync write the extent tree and the inode.  The zeros go only past the write
position, never over a record, and leave the file's bytes as they were."""

from __future__ import annotations

import fcntl
import os
import struct

import pytest

from rocketstore.format import codec
from rocketstore.storage import commitlog as commitlog_mod
from rocketstore.storage.commitlog import ZERO_AHEAD_BYTES, CommitLog

SIZE = 4 * 1024 * 1024
HALF = ZERO_AHEAD_BYTES // 2


def _open(path, size: int = SIZE, **kw) -> CommitLog:
    os.makedirs(path, exist_ok=True)
    cl = CommitLog(str(path), size, **kw)
    cl.load()
    return cl


def _record(i: int) -> codec.EncodedRecord:
    return codec.encode("TopicZ", bytes([i % 251]) * 1024, queue_id=0, born_timestamp=1700000000000 + i)


class _ZeroWrites:
    """Every all-zero os.pwrite into the commitlog directory's files, with the write position at that moment."""

    def __init__(self, cl: CommitLog, monkeypatch) -> None:
        self.cl = cl
        self.calls: list[tuple[int, int, int]] = []  # (file position, length, write position then)
        real = os.pwrite

        def spy(fd, data, pos):
            if not any(data):
                f = cl.queue.last()
                self.calls.append((pos, len(data), f.wrote_position if f is not None else 0))
            return real(fd, data, pos)
        monkeypatch.setattr(commitlog_mod.os, "pwrite", spy)


def _put(cl: CommitLog, start: int, count: int) -> list[tuple[int, int]]:
    out = []
    for i in range(start, start + count):
        with cl.put_lock:
            off, size, _, _ = cl.append([_record(i)], i, store_timestamp=1795000000000 + i)
        out.append((off, size))
        f = cl.queue.last()
        assert f.zeroed_position - f.wrote_position >= min(HALF, f.file_size - f.wrote_position), \
            f"after put {i}: zeros reach only {f.zeroed_position}, the write position is {f.wrote_position}"
    return out


def test_sync_flush_keeps_zeros_ahead_of_the_writer_and_never_writes_them_over_a_record(tmp_path, monkeypatch):
    cl = _open(tmp_path / "new", gather_all=True)
    spy = _ZeroWrites(cl, monkeypatch)
    put = _put(cl, 0, 1500)  # ~1.7 MiB of records
    end = put[-1][0] + put[-1][1]
    assert spy.calls, "no zeros were written ahead of the writer"
    for pos, n, wrote in spy.calls:
        assert pos >= wrote, f"zeros written at {pos}, below the write position {wrote}"
    # A chunk at a time, not per put: the chunks follow each other from the end of the first put on.
    assert len(spy.calls) <= end // HALF + 1
    assert spy.calls[0][0] == put[0][1]
    for (p, n, _), (q, _, _) in zip(spy.calls, spy.calls[1:]):
        assert (q, n) == (p + n, ZERO_AHEAD_BYTES)
    assert spy.calls[-1][0] + spy.calls[-1][1] >= end + HALF

    # A reopen resumes from the recovered end (set_positions), never below it.
    cl.flush()
    cl.close()
    cl = _open(tmp_path / "new", gather_all=True)
    cl.queue.files[-1].set_positions(end)
    spy = _ZeroWrites(cl, monkeypatch)
    put += _put(cl, 1500, 10)
    assert put[1500][0] == end and spy.calls and spy.calls[0][0] == end + put[1500][1]
    for i, (off, size) in enumerate(put):
        m = cl.read_message(off, check_crc=True)
        assert (m.queue_offset, m.body) == (i, bytes([i % 251]) * 1024)
    cl.flush()
    cl.close()

    # The file holds the same bytes as one written without zeros ahead.
    ref = _open(tmp_path / "ref", gather_all=True)
    ref.zero_ahead = 0
    monkeypatch.undo()
    spy = _ZeroWrites(ref, monkeypatch)
    _ = [ref.append([_record(i)], i, store_timestamp=1795000000000 + i) for i in range(1510)]
    assert spy.calls == []
    ref.flush()
    ref.close()
    name = f"{0:020d}"
    assert (tmp_path / "new" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()


def test_async_flush_writes_no_zeros(tmp_path, monkeypatch):
    cl = _open(tmp_path)
    spy = _ZeroWrites(cl, monkeypatch)
    with cl.put_lock:
        for i in range(300):
            cl.append([_record(i)], i)
    assert cl.zero_ahead == 0 and spy.calls == []
    cl.close()


def test_zeros_reach_the_end_of_a_segment_and_start_again_in_the_next(tmp_path, monkeypatch):
    size = 3 * ZERO_AHEAD_BYTES // 2 + 4096
    cl = _open(tmp_path, size, gather_all=True)
    spy = _ZeroWrites(cl, monkeypatch)
    put = _put(cl, 0, 3 * size // 2 // 1200)
    assert len(cl.queue.files) == 2
    first, second = cl.queue.files
    assert first.zeroed_position == size
    ends = [p + n for p, n, _ in spy.calls]
    assert size in ends  # the last chunk of the first segment stops at its end
    assert spy.calls[-1][0] < second.zeroed_position and second.wrote_position < second.zeroed_position
    for i, (off, _) in enumerate(put):
        assert cl.read_message(off, check_crc=True).queue_offset == i
    cl.close()


# ---------------------------------------------------------------- the blocks themselves (FIEMAP)
FS_IOC_FIEMAP = 0xC020660B
FIEMAP_EXTENT_UNWRITTEN = 0x800
_EXTENT = struct.Struct("=QQQ2Q I3I")


def _unwritten(fd: int, start: int, length: int) -> list[tuple[int, int]] | None:
    """The unwritten extents overlapping [start, start + length), or None where FIEMAP is not supported."""
    count = 64
    buf = bytearray(struct.pack("=QQIIII", start, length, 0, 0, count, 0) + bytes(_EXTENT.size * count))
    try:
        fcntl.ioctl(fd, FS_IOC_FIEMAP, buf)
    except OSError:
        return None
    mapped = struct.unpack_from("=I", buf, 20)[0]
    out = []
    for i in range(mapped):
        logical, _, n, _, _, flags, *_ = _EXTENT.unpack_from(buf, 32 + i * _EXTENT.size)
        if flags & FIEMAP_EXTENT_UNWRITTEN:
            out.append((logical, n))
    return out


@pytest.mark.parametrize("zero_ahead", [True, False], ids=["sync", "without-zeros-ahead"])
def test_after_a_flush_the_blocks_the_next_puts_land_on_are_written(tmp_path, zero_ahead):
    """The cause the zeros remove, seen in the file system: without them, the block holding the write
    position stays an unwritten extent after the flush, so the next put's flush converts it."""
    cl = _open(tmp_path, gather_all=True)
    if not zero_ahead:
        cl.zero_ahead = 0
    with cl.put_lock:
        cl.append([_record(0)], 0)
    f = cl.queue.last()
    fresh = _unwritten(f.fd, SIZE // 2, SIZE // 2)
    if not fresh:
        pytest.skip("the file system does not report unwritten extents for a fallocated file")
    with cl.put_lock:
        for i in range(1, 40):
            cl.append([_record(i)], i)
    cl.flush()
    ahead = _unwritten(f.fd, f.wrote_position, HALF)
    if zero_ahead:
        assert ahead == [], f"unwritten extents {ahead} within {HALF} bytes past the write position"
    else:
        assert ahead, "expected the blocks past the write position to be unwritten without zeros ahead"
    cl.close()


def test_a_failing_zero_write_stops_zeroing_that_segment_and_the_puts_go_on(tmp_path, monkeypatch):
    """Zeroing ahead is advice: an error there (an I/O error, a full disk on a file system without fallocate)
    is not the put's; the record itself is written and read back, and the segment is not zeroed again."""
    cl = _open(tmp_path, gather_all=True)
    tries = []
    real = os.pwrite

    def failing(fd, data, pos):
        if not any(data):
            tries.append(pos)
            raise OSError(5, "Input/output error")
        return real(fd, data, pos)
    monkeypatch.setattr(commitlog_mod.os, "pwrite", failing)
    with cl.put_lock:
        put = [cl.append([_record(i)], i) for i in range(400)]
    assert len(tries) == 1
    assert cl.queue.last().zeroed_position == SIZE
    for i, (off, *_rest) in enumerate(put):
        assert cl.read_message(off, check_crc=True).queue_offset == i
    cl.close()


def test_the_group_commits_gathered_writes_keep_zeros_ahead_too(tmp_path, monkeypatch):
    """append_units (several producers' puts in one pwritev) goes through _write_units: the same rule."""
    cl = _open(tmp_path, gather_all=True)
    spy = _ZeroWrites(cl, monkeypatch)
    offsets = []
    for r in range(150):
        units = [([_record(r * 8 + k)], r * 8 + k, None) for k in range(8)]
        with cl.put_lock:
            done, error = cl.append_units(units)
        assert error is None and len(done) == 8
        offsets += [d[0] for d in done]
        f = cl.queue.last()
        assert f.zeroed_position - f.wrote_position >= HALF
    assert spy.calls and all(pos >= wrote for pos, _, wrote in spy.calls)
    for i, off in enumerate(offsets):
        assert cl.read_message(off, check_crc=True).queue_offset == i
    cl.close()


@pytest.mark.parametrize("flush", ["SYNC_FLUSH", "ASYNC_FLUSH"])
def test_a_store_zeroes_ahead_under_sync_flush_only(tmp_path, flush):
    """The store's put path (group commit, default geometry): zeros ahead of the log's write position under
    SYNC_FLUSH, where every put waits for an fdatasync; none under ASYNC_FLUSH."""
    from rocketstore import MessageStore, StoreConfig
    from rocketstore.format.message import Message

    store = MessageStore.open(str(tmp_path / "s"), StoreConfig(flushDiskType=flush, warmAheadBytes=0))
    try:
        for i in range(20):
            assert store.put(Message("TopicZ", bytes(1024), queue_id=i % 2)).ok
        f = store.commitlog.queue.last()
        if flush == "SYNC_FLUSH":
            assert f.zeroed_position - f.wrote_position >= HALF
        else:
            assert f.zeroed_position == 0
    finally:
        store.close()
