"""MappedFile / MappedFileQueue on their own: append, flush, reopen, find, roll, truncate (cf. RocketMQ's
MappedFileQueueTest)."""

from __future__ import annotations

import os

import pytest

from rocketstore.errors import StoreLoadError
from rocketstore.storage.mapped_file import MappedFile, MappedFileQueue, file_name

SIZE = 1024


def _fill(q: MappedFileQueue, n: int, unit: bytes) -> list[int]:
    """Append ``n`` units of ``unit``; return each unit's logical offset."""
    out = []
    for _ in range(n):
        f = q.last_for_append(0)
        out.append(f.file_from_offset + f.append(unit))
    return out


def test_file_names_are_start_offsets_zero_padded_to_20_digits(tmp_path):
    assert file_name(0) == "00000000000000000000"
    assert file_name(1073741824) == "00000000001073741824"
    q = MappedFileQueue(str(tmp_path), SIZE)
    _fill(q, 3 * SIZE // 64, b"x" * 64)  # exactly three files
    q.close()
    assert sorted(os.listdir(tmp_path)) == [file_name(0), file_name(SIZE), file_name(2 * SIZE)]
    assert all(os.path.getsize(tmp_path / n) == SIZE for n in os.listdir(tmp_path))


def test_append_flush_reopen_read_back(tmp_path):
    q = MappedFileQueue(str(tmp_path), SIZE)
    units = [bytes([i]) * 100 for i in range(1, 25)]  # 2400 bytes: rolls twice (100 does not divide 1024)
    offsets = []
    for u in units:
        f = q.last_for_append(0)
        if SIZE - f.wrote_position < len(u):
            f.wrote_position = SIZE  # the caller pads a file it cannot fill, as the commitlog does
            f = q.last_for_append(0)
        offsets.append(f.file_from_offset + f.append(u))
    assert q.max_offset() == offsets[-1] + 100
    assert q.flush() is False  # something was written
    assert q.flushed_where == q.max_offset()
    assert q.flush() is True  # nothing left
    q.close()

    r = MappedFileQueue(str(tmp_path), SIZE, read_only=True)
    r.load()
    assert [f.file_from_offset for f in r] == [0, SIZE, 2 * SIZE]
    assert r.min_offset() == 0 and r.max_offset() == 3 * SIZE  # a load counts every file as full
    for off, u in zip(offsets, units):
        f = r.find(off)
        assert f is not None and f.file_from_offset <= off < f.end_offset
        p = off - f.file_from_offset
        assert f.mm[p:p + 100] == u
    assert r.find(3 * SIZE) is None
    assert r.find(3 * SIZE, return_first=True) is r.first()
    r.close()


def test_roll_to_next_file_when_full(tmp_path):
    q = MappedFileQueue(str(tmp_path), SIZE)
    f0 = q.last_for_append(0)
    f0.append(b"a" * SIZE)
    assert f0.is_full()
    f1 = q.last_for_append(0)
    assert f1 is not f0 and f1.file_from_offset == SIZE and f1.wrote_position == 0
    assert q.last_for_append(0) is f1  # not full: the same file
    q.close()


def test_first_file_starts_at_the_segment_holding_start_offset(tmp_path):
    q = MappedFileQueue(str(tmp_path), SIZE)
    f = q.last_for_append(5 * SIZE + 17)
    assert f.file_from_offset == 5 * SIZE
    q.close()
    assert os.listdir(tmp_path) == [file_name(5 * SIZE)]


def test_truncate_dirty_moves_positions_back_and_deletes_later_files(tmp_path):
    q = MappedFileQueue(str(tmp_path), SIZE)
    _fill(q, 3 * SIZE // 64, b"y" * 64)
    removed = q.truncate_dirty(SIZE + 100)
    assert removed == [str(tmp_path / file_name(2 * SIZE))]
    assert not (tmp_path / file_name(2 * SIZE)).exists()
    assert [f.file_from_offset for f in q] == [0, SIZE]
    assert q.max_offset() == SIZE + 100
    assert q.last().flushed_position == 100
    # bytes past the cut are not zeroed by truncate_dirty (zero_from does that)
    assert q.last().mm[100:164] == b"y" * 64
    assert q.last().zero_from(100) > 0
    assert q.last().mm[100:SIZE].count(0) == SIZE - 100
    q.close()


def test_truncate_dirty_makes_its_deletions_durable_before_it_returns(tmp_path, monkeypatch):
    """A file recovery dropped must not come back after a power cut with its stale records (attack19): the
    directory is fsynced after the unlinks; a read-only view deletes nothing and syncs nothing."""
    from rocketstore.storage import mapped_file
    q = MappedFileQueue(str(tmp_path), SIZE)
    _fill(q, 3 * SIZE // 64, b"y" * 64)
    events: list[tuple[str, str]] = []
    real_unlink, real_sync = os.unlink, mapped_file.fsync_dir
    monkeypatch.setattr(os, "unlink", lambda p, *a, **k: (events.append(("unlink", str(p))), real_unlink(p, *a, **k)))
    monkeypatch.setattr(mapped_file, "fsync_dir", lambda d: (events.append(("fsync_dir", str(d))), real_sync(d)))
    q.truncate_dirty(SIZE + 100)
    assert events == [("unlink", str(tmp_path / file_name(2 * SIZE))), ("fsync_dir", str(tmp_path))]
    q.close()
    events.clear()
    view = MappedFileQueue(str(tmp_path), SIZE, read_only=True)
    view.load()
    view.truncate_dirty(100)
    assert events == [] and (tmp_path / file_name(SIZE)).exists()
    view.close()


def test_load_refuses_a_file_of_the_wrong_size_and_a_bad_name(tmp_path):
    q = MappedFileQueue(str(tmp_path), SIZE)
    _fill(q, 2, b"z" * 64)
    q.close()
    (tmp_path / file_name(SIZE)).write_bytes(b"short")
    with pytest.raises(StoreLoadError, match="is 5 bytes, expected 1024"):
        MappedFileQueue(str(tmp_path), SIZE).load()
    (tmp_path / file_name(SIZE)).unlink()
    (tmp_path / "stray").write_bytes(b"")
    seen = []
    q2 = MappedFileQueue(str(tmp_path), SIZE)
    q2.load(on_bad_file=lambda p, why: seen.append((os.path.basename(p), why)))
    assert seen == [("stray", "file name is not a 20-digit offset")]
    assert [f.file_from_offset for f in q2] == [0]
    q2.close()


def test_load_skips_and_removes_an_empty_last_file(tmp_path):
    q = MappedFileQueue(str(tmp_path), SIZE)
    _fill(q, 1, b"w" * 64)
    q.close()
    (tmp_path / file_name(SIZE)).write_bytes(b"")
    q2 = MappedFileQueue(str(tmp_path), SIZE)
    q2.load()
    assert [f.file_from_offset for f in q2] == [0]
    assert not (tmp_path / file_name(SIZE)).exists()
    q2.close()


def test_destroy_waits_for_readers_but_unlinks_at_once(tmp_path):
    path = str(tmp_path / file_name(0))
    mf = MappedFile(path, SIZE, create=True)
    mf.append(b"held")
    assert mf.hold()
    assert mf.destroy() is False  # a reader holds it
    assert not os.path.exists(path)  # the name goes at the first call
    assert mf.mm[0:4] == b"held" and not mf.closed
    assert not mf.hold()  # no new reader
    mf.release()
    assert mf.closed


def test_load_refuses_a_missing_middle_file(tmp_path):
    q = MappedFileQueue(str(tmp_path), SIZE)
    _fill(q, 3 * SIZE // 64, b"m" * 64)
    q.close()
    (tmp_path / file_name(SIZE)).unlink()
    with pytest.raises(StoreLoadError, match=f"start offset {2 * SIZE} does not follow"):
        MappedFileQueue(str(tmp_path), SIZE).load()


def test_preallocated_next_file_is_handed_out_and_discarded_at_close(tmp_path):
    q = MappedFileQueue(str(tmp_path), SIZE, preallocate=True)
    f0 = q.last_for_append(0)
    nxt = q.preallocated()
    assert nxt is not None and nxt.file_from_offset == SIZE and q.next_file_reserved()
    f0.append(b"p" * SIZE)
    assert q.last_for_append(0) is nxt  # the roll takes the file made ahead
    assert q.preallocated().file_from_offset == 2 * SIZE
    q.close()
    assert sorted(os.listdir(tmp_path)) == [file_name(0), file_name(SIZE)]  # the unused one is gone
