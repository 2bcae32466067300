"""ConsumeQueue: the per topic/queue list of 20-byte units pointing into the CommitLog.

::

    +---------------------------+-------------+---------------------------+
    | commitlog offset (int64)  | size (int32)| tagsCode (int64)          |
    +---------------------------+-------------+---------------------------+

Unit ``n`` sits at byte ``20 * n`` of the queue; its file is named by the
byte offset of its first unit.  A queue that starts past 0 (after cleaning, or
whose first message had a non-zero offset) keeps ``min_logic_offset``.
"""

from __future__ import annotations

import logging
import os
import struct
from typing import Callable, Iterator, Sequence

from .mapped_file import MappedFile, MappedFileQueue

log = logging.getLogger(__name__)

CQ_STORE_UNIT_SIZE = 20
_UNIT = struct.Struct(">qiq")
BLANK_SIZE = 0x7FFFFFFF  # the size of a blank unit: it names no record
PRE_BLANK_UNIT = _UNIT.pack(0, BLANK_SIZE, 0)

_ZERO_UNIT = bytes(CQ_STORE_UNIT_SIZE)
MIN_RECORD_BYTES = 88  # no commitlog record is shorter than its fixed fields (a rebuild's bound on a gap)

LOWER = "lower"
UPPER = "upper"

TimestampReader = Callable[[int, int], int]  # (commitlog offset, size) -> storeTimestamp or -1


def _valid_prefix(mm, file_size: int) -> tuple[int, tuple[int, int, int] | None]:
    """Bytes of valid units (offset >= 0, size > 0) at the start of a file, and the last valid unit.

    The written part ends at the first all-zero unit (found by ``find`` in C; a
    valid unit has a non-zero size, so 20 zero bytes never straddle two valid
    units); the units before it are then checked in one ``iter_unpack`` pass.
    """
    end = 0
    while True:
        hit = mm.find(_ZERO_UNIT, end)
        if hit < 0:
            end = file_size
            break
        aligned = hit - hit % CQ_STORE_UNIT_SIZE
        if mm[aligned:aligned + CQ_STORE_UNIT_SIZE] == _ZERO_UNIT:
            end = aligned
            break
        end = aligned + CQ_STORE_UNIT_SIZE
    if end and _all_valid(mm, end):
        return end, _UNIT.unpack_from(mm, end - CQ_STORE_UNIT_SIZE)
    last = None
    n = 0
    for unit in struct.iter_unpack(">qiq", mm[:end]):
        if unit[0] < 0 or unit[1] <= 0:
            break
        last = unit
        n += 1
    return n * CQ_STORE_UNIT_SIZE, last


def _all_valid(mm, end: int) -> bool:
    """Whether every unit before ``end`` has offset >= 0 and size > 0, tested on whole columns of bytes
    (strided slices, ``isascii`` for the sign bits, one big-integer OR for non-zero sizes), all in C: the
    common answer at recovery, which would otherwise unpack every unit of the last files in Python."""
    if not (mm[0:end:CQ_STORE_UNIT_SIZE].isascii() and mm[8:end:CQ_STORE_UNIT_SIZE].isascii()):
        return False  # a negative offset or size
    n = end // CQ_STORE_UNIT_SIZE
    size_bytes = 0
    for i in range(8, 12):
        size_bytes |= int.from_bytes(mm[i:end:CQ_STORE_UNIT_SIZE], "big")
    return size_bytes.to_bytes(n, "big").find(0) < 0  # every size has a non-zero byte


_NUMPY_MIN_UNITS = 65536  # below this a Python loop (about 12 ms) beats importing numpy (about 0.1 s)


def _ascending_end(mm, end: int, prev_end: int) -> tuple[int, int]:
    """Where the units of [0, ``end``) stop pointing at ascending, non-overlapping records, and the end of the
    last record they point at (``prev_end``: the one before the file).

    Dispatch appends records in commitlog order, so a unit that points below
    the end of the one before it was damaged into a valid-looking value, and
    so may the one before it: the answer is the position of that one (the
    earlier of the two), or ``end`` when every unit is in order.  Blank units
    (before a queue's first message, or standing for expired records) are
    skipped.
    """
    n = end // CQ_STORE_UNIT_SIZE
    if n >= _NUMPY_MIN_UNITS:
        import numpy as np
        a = np.frombuffer(mm, dtype=np.dtype([("o", ">i8"), ("s", ">i4"), ("t", ">i8")]), count=n)
        pos = np.flatnonzero(a["s"] != 0x7FFFFFFF)
        if not len(pos):
            return end, prev_end
        offs = a["o"][pos].astype(np.int64)
        ends = offs + a["s"][pos].astype(np.int64)
        if offs[0] < prev_end:
            return 0, prev_end
        bad = np.flatnonzero(offs[1:] < ends[:-1])
        if not len(bad):
            return end, int(ends[-1])
        k = int(bad[0])
        return int(pos[k]) * CQ_STORE_UNIT_SIZE, int(ends[k - 1]) if k else prev_end
    last_pos, before, last_end = None, prev_end, prev_end  # the last unit seen: position, end before it, end
    for i, (off, size, _tags) in enumerate(struct.iter_unpack(">qiq", mm[:end])):
        if size == 0x7FFFFFFF:
            continue
        if off < last_end:
            return (0, prev_end) if last_pos is None else (last_pos, before)
        last_pos, before, last_end = i * CQ_STORE_UNIT_SIZE, last_end, off + size
    return end, last_end


_PACK_NUMPY_MIN = 48  # units from which one numpy record array packs a run faster than a struct call per unit
_unit_dtype = None


def pack_units(offsets: Sequence[int], sizes: Sequence[int], codes: Sequence[int]) -> bytes:
    """Consume-queue units (offset, size, tagsCode), big-endian, one after another: a dispatch round's run
    of a queue is packed with three column copies instead of one ``struct`` call per unit."""
    n = len(offsets)
    if n < _PACK_NUMPY_MIN:
        return b"".join(map(_UNIT.pack, offsets, sizes, codes))
    global _unit_dtype
    import numpy as np
    if _unit_dtype is None:
        _unit_dtype = np.dtype([("o", ">i8"), ("s", ">i4"), ("c", ">i8")])
    a = np.empty(n, _unit_dtype)
    a["o"] = offsets
    a["s"] = sizes
    a["c"] = codes
    return a.tobytes()


_UNIT_BLOCKS: list[struct.Struct] = [struct.Struct(">" + "qiq" * n) for n in range(65)]
_MAX_BLOCK = len(_UNIT_BLOCKS) - 1


class ConsumeQueue:
    UNITS_PER_READ = _MAX_BLOCK  # the most units one :meth:`read_units` returns

    def __init__(self, root: str, topic: str, queue_id: int, file_size: int, *, read_only: bool = False) -> None:
        self.topic = topic
        self.queue_id = queue_id
        self.file_size = file_size
        self.directory = os.path.join(root, topic, str(queue_id))
        # consumequeue/TOPIC/QUEUEID: the names of the two directories and of consumequeue/ must be durable
        self.queue = MappedFileQueue(self.directory, file_size, read_only=read_only, durable_parents=3)
        self.min_logic_offset = 0
        self.retention_min_offset = 0  # per-topic logical retention, in units (rocketstore extension)
        self.max_physic_offset = -1
        self.rebuild_from: int | None = None  # set by recover() when it cut the queue at a hole
        self.hole_at = -1  # the first unit recover() cut, when it found a hole
        self.lost_units: tuple[int, int] | None = None  # what lay beyond it (see _last_unit_beyond)
        self.pad_gaps = False  # while recovery rebuilds a queue cut at a hole: see _pad
        self.blank_units: list[tuple[int, int]] = []  # (first, last) unit ranges _pad wrote
        self.gap_at: int | None = None  # the unit where put_unit first wrote a record of a later queue offset
        self._time_cache: dict[str, tuple[int, int]] = {}
        # (queue offset, first unit after it naming a record or None) when the minimum rests on a blank unit
        # whose record retention may or may not have removed: the store settles it (MessageStore.settle_queue_min)
        self.blank_min: tuple[int, int | None] | None = None

    def load(self, on_bad_file=None) -> None:
        self.queue.load(on_bad_file=on_bad_file)

    # ------------------------------------------------------------ offsets
    def max_offset_bytes(self) -> int:
        return self.queue.max_offset()

    @property
    def physical_min_offset(self) -> int:
        return self.min_logic_offset // CQ_STORE_UNIT_SIZE

    @property
    def min_offset_in_queue(self) -> int:
        return self.offset_range()[0]

    @property
    def max_offset_in_queue(self) -> int:
        return self.queue.max_offset() // CQ_STORE_UNIT_SIZE

    def offset_range(self) -> tuple[int, int]:
        """(min_offset_in_queue, max_offset_in_queue) from one look at the queue's end: every get asks for both."""
        hi = self.queue.max_offset() // CQ_STORE_UNIT_SIZE
        lo = self.min_logic_offset // CQ_STORE_UNIT_SIZE
        if lo < self.retention_min_offset:
            lo = self.retention_min_offset
        return (lo if lo < hi else hi), hi

    @property
    def message_total_in_queue(self) -> int:
        return self.max_offset_in_queue - self.min_offset_in_queue

    # ------------------------------------------------------------ reading
    def get_unit(self, index: int) -> tuple[int, int, int] | None:
        """The unit at queue offset ``index``, or None below the minimum or past the written end."""
        pos = index * CQ_STORE_UNIT_SIZE
        if pos < self.min_logic_offset:
            return None
        f = self.queue.find(pos)
        if f is None or pos - f.file_from_offset + CQ_STORE_UNIT_SIZE > f.wrote_position:
            return None
        return _UNIT.unpack_from(f.mm, pos - f.file_from_offset)

    def unit_pointing_at(self, phy: int) -> int | None:
        """Queue offset of the unit whose record starts at commitlog offset ``phy``, or None: a binary search,
        units ascending in commitlog offset (blank units before a queue's first message point at 0)."""
        files = [f for f in self.queue.files if f.wrote_position >= CQ_STORE_UNIT_SIZE]
        lo, hi = 0, len(files)
        while lo < hi:  # the last file whose first unit points at or below phy
            mid = (lo + hi) // 2
            if _UNIT.unpack_from(files[mid].mm, 0)[0] <= phy:
                lo = mid + 1
            else:
                hi = mid
        if not lo:
            return None
        f = files[lo - 1]
        a, b = 0, f.wrote_position // CQ_STORE_UNIT_SIZE
        while a < b:  # the first unit at or past phy
            mid = (a + b) // 2
            if _UNIT.unpack_from(f.mm, mid * CQ_STORE_UNIT_SIZE)[0] < phy:
                a = mid + 1
            else:
                b = mid
        if a * CQ_STORE_UNIT_SIZE + CQ_STORE_UNIT_SIZE > f.wrote_position:
            return None
        off, size, _ = _UNIT.unpack_from(f.mm, a * CQ_STORE_UNIT_SIZE)
        if off != phy or not 0 < size < 0x7FFFFFFF:
            return None
        return (f.file_from_offset + a * CQ_STORE_UNIT_SIZE) // CQ_STORE_UNIT_SIZE

    def hold_file_at(self, index: int) -> MappedFile | None:
        """The file holding unit ``index``, held for the caller to :meth:`read_units` from and then release;
        None below the minimum or when the file is gone (a get answers OFFSET_FOUND_NULL)."""
        pos = index * CQ_STORE_UNIT_SIZE
        if pos < self.min_logic_offset:
            return None
        f = self.queue.find(pos)
        if f is None or not f.hold():
            return None
        return f

    @staticmethod
    def read_units(f: MappedFile, index: int, count: int) -> tuple[int, ...]:
        """Up to ``count`` (at most :attr:`UNITS_PER_READ`) units from ``index`` in the held file ``f``,
        flattened as (offset, size, tagsCode) * n and cut at its written end.

        One precompiled ``Struct`` reads the whole block: a reader consuming 32
        units a call would otherwise spend more on a generator step per unit
        than on the unpacking itself.
        """
        p = index * CQ_STORE_UNIT_SIZE - f.file_from_offset
        n = (f.wrote_position - p) // CQ_STORE_UNIT_SIZE
        if count < n:
            n = count
        if n <= 0:
            return ()
        return _UNIT_BLOCKS[n if n < _MAX_BLOCK else _MAX_BLOCK].unpack_from(f.mm, p)

    def first_unit(self) -> tuple[int, int] | None:
        """(commitlog offset, queue offset) of the first unit that points at a record (blank units before
        a queue's first message skipped), or None when the first file has none."""
        if not self.queue.files:
            return None
        f = self.queue.files[0]
        for p in range(0, f.wrote_position - CQ_STORE_UNIT_SIZE + 1, CQ_STORE_UNIT_SIZE):
            off, size, _ = _UNIT.unpack_from(f.mm, p)
            if off >= 0 and 0 < size < 0x7FFFFFFF:
                return off, (f.file_from_offset + p) // CQ_STORE_UNIT_SIZE
            if size == 0:  # the end of the written units
                break
        return None

    def holds_no_unit(self) -> bool:
        """Whether every file's first unit is zeros (read before recovery, whatever the written positions say):
        units are written from a file's start (blank ones before a queue's first message), so such files hold
        none, named records or blank."""
        return all(f.mm[0:CQ_STORE_UNIT_SIZE] == _ZERO_UNIT for f in self.queue.files)

    def last_unit(self) -> tuple[int, int, int] | None:
        last = self.queue.last()
        if last is None or last.wrote_position < CQ_STORE_UNIT_SIZE:
            return None
        return _UNIT.unpack_from(last.mm, last.wrote_position - CQ_STORE_UNIT_SIZE)

    # ------------------------------------------------------------ recovery
    def recover(self, check_from: int | None = None) -> list[str]:
        """Find the end of valid units and truncate (and, writable, zero) what lies beyond; return deleted files.

        RocketMQ checks the last three files.  After a power loss (``check_from``
        given: the commitlog offset recovery re-checks from) every file whose
        units may point at or past ``check_from`` is checked too, since a file
        whose pages never reached the disk survives as zeros below valid units:
        a hole (older files are glanced at by their first and last units).
        When units (or other bytes) lie beyond the end found, the queue is cut
        there and :attr:`rebuild_from` says from which commitlog offset
        recovery must offer records again to rebuild it.
        """
        self.rebuild_from = None
        self.hole_at = -1
        self.lost_units = None
        files = self.queue.files
        if not files:
            return []
        idx = max(0, len(files) - 3)
        if check_from is not None:
            idx = min(idx, self._first_file_reaching(check_from), self._first_with_blank_ends(idx))
        max_phy = -1
        prev_end = -1
        while True:
            f = files[idx]
            valid, last = _valid_prefix(f.mm, self.file_size)
            ordered, prev_end = _ascending_end(f.mm, valid, prev_end)
            if ordered < valid:
                log.warning("%s-%d: unit %d and the one after point at records out of commitlog order (a "
                            "damaged unit); the queue is cut there", self.topic, self.queue_id,
                            (f.file_from_offset + ordered) // CQ_STORE_UNIT_SIZE)
                valid = ordered
                last = _UNIT.unpack_from(f.mm, valid - CQ_STORE_UNIT_SIZE) if valid else None
            # the end of the last record a unit points at: blank units (expired or lost records) point at none
            max_phy = prev_end if last is not None else max_phy
            if valid == self.file_size and idx + 1 < len(files):
                idx += 1
                continue
            break
        cut_file, cut = files[idx], files[idx].file_from_offset + valid
        if self._data_after(idx, valid, thorough=check_from is not None):
            if max_phy < 0 and idx > 0:
                before = _UNIT.unpack_from(files[idx - 1].mm, self.file_size - CQ_STORE_UNIT_SIZE)
                max_phy = before[0] + before[1] if before[0] >= 0 and 0 < before[1] < 0x7FFFFFFF else -1
            self.rebuild_from = max(max_phy, 0)
            self.hole_at = cut // CQ_STORE_UNIT_SIZE
            self.lost_units = self._last_unit_beyond(idx, valid)
            self.pad_gaps = True
            log.warning("%s-%d: units lie beyond unit %d, where the valid units end (a hole); the queue is cut "
                        "there and rebuilt from commitlog offset %d", self.topic, self.queue_id, self.hole_at,
                        self.rebuild_from)
            if not self.queue.read_only:
                cut_file.zero_from(valid)
        self.max_physic_offset = max_phy
        return self.queue.truncate_dirty(cut)

    def note_kept_end(self) -> None:
        """(A queue being rebuilt, before recovery.)  Set :attr:`max_physic_offset` to the end of the last record
        the kept units name, checked as recovery checks them (valid, ascending): a rebuild that offers records
        from before it then skips the ones already placed instead of placing them again."""
        prev_end = -1
        for f in self.queue.files:
            valid, _last = _valid_prefix(f.mm, self.file_size)
            ordered, prev_end = _ascending_end(f.mm, valid, prev_end)
            if ordered < self.file_size:
                break
        self.max_physic_offset = prev_end

    def _last_unit_beyond(self, idx: int, valid: int) -> tuple[int, int] | None:
        """(queue offset just past it, commitlog offset) of the last valid-looking unit after the cut: what
        the rebuild should reach again unless the commitlog ends before that offset."""
        for f, start in [(g, 0) for g in reversed(self.queue.files[idx + 1:])] + [(self.queue.files[idx], valid)]:
            mm = f.mm
            written = len(mm[start:self.file_size].rstrip(b"\0"))  # the zeros at the end are never units
            for p in range(start + (written - 1) // CQ_STORE_UNIT_SIZE * CQ_STORE_UNIT_SIZE, start - 1,
                           -CQ_STORE_UNIT_SIZE):
                off, size, _ = _UNIT.unpack_from(mm, p)
                if off >= 0 and size > 0 and size != 0x7FFFFFFF:
                    return (f.file_from_offset + p) // CQ_STORE_UNIT_SIZE + 1, off
        return None

    def _first_with_blank_ends(self, stop: int) -> int:
        """Index of the first file before ``stop`` whose first or last unit is not valid (``stop`` if none):
        older files are only glanced at, and a file that survived a power loss as zeros shows it at both
        ends (every file but the last is full)."""
        for i, f in enumerate(self.queue.files[:stop]):
            for p in (0, self.file_size - CQ_STORE_UNIT_SIZE):
                off, size, _ = _UNIT.unpack_from(f.mm, p)
                if off < 0 or size <= 0:
                    return i
        return stop

    def _first_file_reaching(self, phy: int) -> int:
        """Index of the newest file whose first unit is valid and points below ``phy`` (0 if none)."""
        files = self.queue.files
        for i in range(len(files) - 1, 0, -1):
            off, size, _ = _UNIT.unpack_from(files[i].mm, 0)
            if 0 <= off < phy and size > 0:
                return i
        return 0

    def _data_after(self, idx: int, valid: int, thorough: bool) -> bool:
        """Whether any byte after the valid units of file ``idx`` is non-zero: in the rest of that file and
        in the later files when ``thorough``, else only in the unit at the cut and the later files' first."""
        files = self.queue.files
        f = files[idx]
        if valid < self.file_size and f.mm[valid:valid + CQ_STORE_UNIT_SIZE] != _ZERO_UNIT:
            return True
        for g in files[idx + 1:]:
            if g.mm[0:CQ_STORE_UNIT_SIZE] != _ZERO_UNIT:
                return True
        if not thorough:
            return False
        views = [(f, valid)] + [(g, 0) for g in files[idx + 1:]]
        return any(g.mm[a:b].count(0) != b - a for g, p in views for a, b in g.data_ranges(p, self.file_size))

    def truncate_dirty_logic(self, phy: int) -> int:
        """Drop units pointing at or past commitlog offset ``phy`` and zero them; return how many went."""
        before = self.max_offset_in_queue
        self.max_physic_offset = phy
        while True:
            f = self.queue.last()
            if f is None:
                break
            wrote = f.wrote_position
            f.set_positions(0)
            off0, size0, _ = _UNIT.unpack_from(f.mm, 0)
            valid = -1 if off0 >= phy else _valid_prefix(f.mm, self.file_size)[0]
            # A file starting at or past ``phy`` goes whole; so does an empty last file (a power loss kept none of
            # its units, or recovery cut the queue at its start), which says nothing about the file before it,
            # whose units may point past ``phy`` too: dropped (the next unit creates it again), look there.
            if valid < 0 or (valid == 0 and len(self.queue.files) > 1):
                self.queue.files.remove(f)
                if self.queue.read_only:
                    f.close()
                else:
                    f.destroy()
                continue
            # the units before the cut are ascending: find the first one at or past ``phy``
            lo, hi = 0, valid // CQ_STORE_UNIT_SIZE
            while lo < hi:
                mid = (lo + hi) // 2
                if _UNIT.unpack_from(f.mm, mid * CQ_STORE_UNIT_SIZE)[0] >= phy:
                    hi = mid
                else:
                    lo = mid + 1
            p = lo * CQ_STORE_UNIT_SIZE
            # The end of the last record a unit kept names (-1: none), in this file or an earlier one: a rebuild
            # placing records after the cut judges by it how many records the bytes before each can hold.
            self.max_physic_offset = self._naming_end(f, p)
            if not self.queue.read_only:
                f.zero_from(p, max(wrote, valid))  # stale units must not come back once the queue grows again
            f.set_positions(p)
            break
        if self.min_logic_offset > self.queue.max_offset():
            self.min_logic_offset = self.queue.max_offset()
        return before - self.max_offset_in_queue

    def _naming_end(self, last: MappedFile, stop: int) -> int:
        """End of the record named by the last unit before position ``stop`` of ``last`` (or in a file before it)
        that names one; -1 when every unit kept is blank (expired or lost records name no end)."""
        for _qoff, off, size in self._naming_units_back(last, stop):
            return off + size
        return -1

    def _naming_units_back(self, last: MappedFile, stop: int) -> Iterator[tuple[int, int, int]]:
        """(queue offset, commitlog offset, size) of each unit that names a record, last first: from position
        ``stop`` of ``last`` back to the queue's first file.  Blank units (expired or lost records) name none,
        so their offset and size are no record's: skipped."""
        files = self.queue.files
        for f in reversed(files[:files.index(last) + 1]):
            end = stop if f is last else f.wrote_position
            for p in range(end - CQ_STORE_UNIT_SIZE, -1, -CQ_STORE_UNIT_SIZE):
                off, size, _ = _UNIT.unpack_from(f.mm, p)
                if 0 < size < BLANK_SIZE:
                    yield (f.file_from_offset + p) // CQ_STORE_UNIT_SIZE, off, size

    def correct_min_offset(self, min_commit_log_offset: int) -> None:
        """Move ``min_logic_offset`` just past the last unit whose record lies below the commitlog minimum.

        Blank units (0, 2147483647) name no record: one after the last expired
        unit may stand for a record that is still in the commitlog (a damaged
        or lost unit), so it stays inside the queue and a read of it decides
        (see MessageStore.get); only units pointing at a record tell how far
        retention reached.  Units are in commitlog order, so the first unit
        whose next record-naming unit points at or above the minimum is found
        by a binary search that steps over blank units.
        """
        self._correct_min_offset(min_commit_log_offset)
        self._note_blank_min()

    def _correct_min_offset(self, min_commit_log_offset: int) -> None:
        files = self.queue.files
        if not files or self.min_logic_offset >= self.queue.max_offset():
            return
        last = self._last_naming_unit()
        if last is not None and last[1] < min_commit_log_offset:
            self.min_logic_offset = max(self.min_logic_offset, (last[0] + 1) * CQ_STORE_UNIT_SIZE)
            return
        first = files[0]
        start = max(0, self.min_logic_offset - first.file_from_offset)
        end = first.wrote_position
        if start + CQ_STORE_UNIT_SIZE > end:
            return
        mm, hi = first.mm, end // CQ_STORE_UNIT_SIZE
        lo = start // CQ_STORE_UNIT_SIZE

        def kept(i: int) -> bool:  # the first unit from i naming a record points at or above the minimum
            for p in range(i * CQ_STORE_UNIT_SIZE, end, CQ_STORE_UNIT_SIZE):
                off, size, _ = _UNIT.unpack_from(mm, p)
                if 0 < size < BLANK_SIZE:
                    return off >= min_commit_log_offset
            return True

        if not kept(lo):
            lo += 1
            while lo < hi:  # the first i in (lo - 1, hi] that is kept
                mid = (lo + hi) // 2
                if kept(mid):
                    hi = mid
                else:
                    lo = mid + 1
            if lo * CQ_STORE_UNIT_SIZE >= end:
                return  # every unit of the first file points below: it goes next (RocketMQ leaves the minimum)
        self.min_logic_offset = max(self.min_logic_offset, first.file_from_offset + lo * CQ_STORE_UNIT_SIZE)

    def _note_blank_min(self) -> None:
        """Set :attr:`blank_min` when the unit at the minimum is blank, else clear it."""
        self.blank_min = None
        pos = self.min_logic_offset
        f = self.queue.find(pos)
        if f is None:
            return
        p, end = pos - f.file_from_offset, f.wrote_position
        if p < 0 or p + CQ_STORE_UNIT_SIZE > end or _UNIT.unpack_from(f.mm, p)[1] != BLANK_SIZE:
            return
        naming = None
        for q in range(p, end, CQ_STORE_UNIT_SIZE):
            off, size, _ = _UNIT.unpack_from(f.mm, q)
            if 0 < size < BLANK_SIZE:
                naming = (f.file_from_offset + q) // CQ_STORE_UNIT_SIZE
                break
        self.blank_min = (pos // CQ_STORE_UNIT_SIZE, naming)

    def _last_naming_unit(self) -> tuple[int, int] | None:
        """(queue offset, commitlog offset) of the last unit that names a record (blank units skipped), looked
        for in the last file holding units, or None."""
        last = next((f for f in reversed(self.queue.files) if f.wrote_position >= CQ_STORE_UNIT_SIZE), None)
        if last is None:
            return None
        for qoff, off, _size in self._naming_units_back(last, last.wrote_position):
            return (qoff, off) if qoff * CQ_STORE_UNIT_SIZE >= last.file_from_offset else None
        return None

    # ------------------------------------------------------------ writing (dispatch)
    def put_unit(self, offset: int, size: int, tags_code: int, cq_offset: int) -> bool:
        """Append a unit the way dispatch does; duplicates are skipped, a gap is logged and written in place."""
        if offset + size <= self.max_physic_offset:
            return True
        expect = cq_offset * CQ_STORE_UNIT_SIZE
        queue = self.queue
        files = queue.files
        first_ever = not files
        if cq_offset != 0 and len(files) == 1 and files[0].wrote_position == 0 and not self.pad_gaps and \
                not files[0].file_from_offset <= expect < files[0].file_from_offset + self.file_size:
            files.pop().destroy()  # (see below) an empty file that cannot hold the unit at its place
            first_ever = True
        f = queue.last_for_append(expect)
        # The first unit of a new queue, or of one whose every unit a lost log tail took (recovery keeps its file,
        # empty) while the queue registry keeps its offsets: at its own queue offset, blank units before it.  (A
        # rebuild's gap at an empty queue's start is padded below: its blank units are judged when read.)
        if cq_offset != 0 and len(files) == 1 and f.wrote_position == 0 and (first_ever or not self.pad_gaps):
            self.min_logic_offset = expect
            fill = expect - f.file_from_offset
            f.mm[0:fill] = PRE_BLANK_UNIT * (fill // CQ_STORE_UNIT_SIZE)
            f.wrote_position = fill
        if cq_offset != 0 or self.pad_gaps:  # (a rebuild places queue offset 0 too: never after other units)
            current = f.file_from_offset + f.wrote_position
            if expect < current:
                if self.pad_gaps:  # a rebuild places: the slot is taken by the record before, in commitlog order
                    log.error("%s-%d: record at commitlog offset %d says queue offset %d, a unit already placed; "
                              "not placed again (two records claim one queue offset)", self.topic, self.queue_id,
                              offset, cq_offset)
                return True
            if expect != current and self.pad_gaps:
                room = offset - max(self.max_physic_offset, 0)  # where the missing records would have lain
                if (expect - current) // CQ_STORE_UNIT_SIZE * MIN_RECORD_BYTES > room:
                    log.error("%s-%d: record at commitlog offset %d says queue offset %d, but the %d bytes after "
                              "the previous unit's record cannot hold the %d records missing before it (its "
                              "queue offset is damaged); not placed", self.topic, self.queue_id, offset, cq_offset,
                              room, (expect - current) // CQ_STORE_UNIT_SIZE)
                    return True
                f = self._pad(current, expect)
            elif expect != current:
                log.error("%s-%d: queue offset gap, expected unit %d, writing at %d",
                          self.topic, self.queue_id, cq_offset, current // CQ_STORE_UNIT_SIZE)
                if self.gap_at is None:
                    self.gap_at = current // CQ_STORE_UNIT_SIZE
        self.max_physic_offset = offset + size
        f.append(_UNIT.pack(offset, size, tags_code))
        return True

    def _pad(self, current: int, expect: int) -> MappedFile:
        """Fill units [current, expect) with blank units (offset 0: below any commitlog minimum, so read as
        expired) and return the file for unit ``expect``: a queue rebuilt after a hole whose records are gone
        keeps every later unit at its own queue offset."""
        log.error("%s-%d: units %d..%d have no record left in the commitlog; written as blank units",
                  self.topic, self.queue_id, current // CQ_STORE_UNIT_SIZE, expect // CQ_STORE_UNIT_SIZE - 1)
        self.blank_units.append((current // CQ_STORE_UNIT_SIZE, expect // CQ_STORE_UNIT_SIZE - 1))
        while current < expect:
            g = self.queue.last_for_append(current)
            n = min(expect - current, self.file_size - g.wrote_position) // CQ_STORE_UNIT_SIZE
            g.append(PRE_BLANK_UNIT * n)
            current += n * CQ_STORE_UNIT_SIZE
        return self.queue.last_for_append(expect)

    def put_units(self, offsets: Sequence[int], sizes: Sequence[int], codes: Sequence[int], first_qoff: int) -> None:
        """Append units with consecutive queue offsets from ``first_qoff``, the way put_unit would one by one;
        a run that continues the queue's end within one file is packed and copied as one write."""
        i, n = 0, len(offsets)
        while i < n:
            f = self.queue.last()
            qoff = first_qoff + i
            k = 0 if f is None else min(n - i, (self.file_size - f.wrote_position) // CQ_STORE_UNIT_SIZE)
            if k == 0 or offsets[i] + sizes[i] <= self.max_physic_offset or \
                    qoff * CQ_STORE_UNIT_SIZE != f.file_from_offset + f.wrote_position:
                self.put_unit(offsets[i], sizes[i], codes[i], qoff)  # first unit, a duplicate, a gap or a full file
                i += 1
                continue
            j = i + k
            f.append(pack_units(offsets[i:j], sizes[i:j], codes[i:j]))
            self.max_physic_offset = offsets[j - 1] + sizes[j - 1]
            i = j

    def flush(self, least_pages: int = 0) -> None:
        self.queue.flush(least_pages)

    def flush_dirty(self) -> None:
        """fdatasync every file with unflushed units (``flush`` does the one at the queue's flush point)."""
        for f in list(self.queue.files):
            if f.wrote_position > f.flushed_position:
                f.flush(0)

    # ------------------------------------------------------------ time lookups
    def offset_by_time(self, ts: int, boundary: str, store_time: TimestampReader, min_phy: int) -> int:
        """Queue offset for a store time: LOWER = first unit at or after, UPPER = last unit at or before."""
        f = self._file_by_time(ts, boundary, store_time)
        result = 0
        if f is not None:
            result = self._search_file(f, ts, boundary, store_time, min_phy)
        return max(self.min_offset_in_queue, min(result, self.max_offset_in_queue))

    def _file_times(self, f: MappedFile, last: bool, store_time: TimestampReader) -> tuple[int, int]:
        cached = self._time_cache.get(f.path)
        if cached is not None and not last:
            return cached
        off, size, _ = _UNIT.unpack_from(f.mm, 0)
        start = store_time(off, size)
        stop = -1
        if not last:
            off, size, _ = _UNIT.unpack_from(f.mm, self.file_size - CQ_STORE_UNIT_SIZE)
            stop = store_time(off, size)
            self._time_cache[f.path] = (start, stop)
        return start, stop

    def _file_by_time(self, ts: int, boundary: str, store_time: TimestampReader) -> MappedFile | None:
        files = [f for f in self.queue.files if f.wrote_position > 0]
        if not files:
            return None
        if boundary == LOWER:
            for f in files[:-1]:
                if self._file_times(f, False, store_time)[1] >= ts:
                    return f
            return files[-1]
        for i in range(len(files) - 1, -1, -1):
            if self._file_times(files[i], i == len(files) - 1, store_time)[0] <= ts:
                return files[i]
        return None

    def _search_file(self, f: MappedFile, ts: int, boundary: str, store_time: TimestampReader,
                     min_phy: int) -> int:
        mm, base = f.mm, f.file_from_offset
        floor = max(0, self.min_logic_offset - base)
        ceiling = f.wrote_position - CQ_STORE_UNIT_SIZE
        if ceiling < floor:
            return 0

        def time_at(p: int) -> int:
            off, size, _ = _UNIT.unpack_from(mm, p)
            return store_time(off, size)

        if time_at(ceiling) < ts:
            return (base + ceiling + (CQ_STORE_UNIT_SIZE if boundary == LOWER else 0)) // CQ_STORE_UNIT_SIZE
        if time_at(floor) > ts:
            return base // CQ_STORE_UNIT_SIZE if boundary == LOWER else 0
        low, high = floor, ceiling
        left = right = target = -1
        while high >= low:
            mid = (low + high) // (2 * CQ_STORE_UNIT_SIZE) * CQ_STORE_UNIT_SIZE
            off, size, _ = _UNIT.unpack_from(mm, mid)
            if off < min_phy:
                low, left = mid + CQ_STORE_UNIT_SIZE, mid
                continue
            t = store_time(off, size)
            if t < 0:
                return 0
            if t == ts:
                target = mid
                break
            if t > ts:
                high, right = mid - CQ_STORE_UNIT_SIZE, mid
            else:
                low, left = mid + CQ_STORE_UNIT_SIZE, mid
        if target != -1:
            pos = target
            step = -CQ_STORE_UNIT_SIZE if boundary == LOWER else CQ_STORE_UNIT_SIZE
            while floor <= pos + step <= ceiling and time_at(pos + step) == ts:
                pos += step
        else:
            pos = right if boundary == LOWER else left
        return int((base + pos) / CQ_STORE_UNIT_SIZE)  # Java truncates toward zero

    # ------------------------------------------------------------ cleaning
    def delete_expired_file(self, min_commit_log_offset: int, interval_forcibly_ms: int = 60000, *,
                            may_delete: Callable[[str, int], bool] | None = None, readable_min: int | None = None
                            ) -> int:
        """Delete files (never the last) whose last unit points below the commitlog minimum.

        ``may_delete(name, last unit's offset)``: with a tier, only files it holds go (the first one it lacks
        stops the round).
        ``readable_min``: the lowest offset still readable (the tier's start), for the queue's minimum.
        """
        deleted = 0
        for f in list(self.queue.files[:-1]):
            if f.available:
                off, _, _ = _UNIT.unpack_from(f.mm, self.file_size - CQ_STORE_UNIT_SIZE)
                if off >= min_commit_log_offset:
                    break
                if may_delete is not None and not may_delete(os.path.basename(f.path), off):
                    break
            if not f.destroy(interval_forcibly_ms):
                break
            self.queue.files.remove(f)
            self._time_cache.pop(f.path, None)
            deleted += 1
        self.correct_min_offset(min_commit_log_offset if readable_min is None else readable_min)
        return deleted

    def close(self) -> None:
        self.queue.close()
