"""The executors' half of the data source: commitlog segments into Arrow record batches.

It needs numpy and pyarrow but not Spark, and it never opens a ``MessageStore``:
a task maps its own segment file read-only and finds the record boundaries,
from the consume queues when their units tile the segment (checked against
every record's TOTALSIZE and PHYSICALOFFSET), else with one walk over the
TOTALSIZE fields.  Then :func:`rocketstore.format.columns.decode` (the decoder
``MessageStore.read_batch`` uses too) decodes every field of a batch of records
at once; a record that does not decode, or whose body (when the body column is
read) fails its BODYCRC, stops the read with :class:`RecordFormatError` naming
the file and offset.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import struct
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Self

import numpy as np
import pyarrow as pa

from ..format import codec
# (the decoder's names, used by the data source through this module)
from ..format.columns import (ARROW_TYPES, COLUMN_NAMES, COLUMNS, HEADER_BYTES, RecordFormatError, arrow_schema,
                              decode, headers)
from ..format.gather import fixed
from ..storage.queue_checked import UNIT_DTYPE

log = logging.getLogger(__name__)

DEFAULT_BATCH_ROWS = 16384
_HEAD8 = struct.Struct(">iI")
_MAGICS = (codec.MAGIC_V1, codec.MAGIC_V2)


# ---------------------------------------------------------------- filters

@dataclass
class RowFilter:
    """What a scan keeps: bounds are inclusive; None means unbounded."""

    offset_lo: int | None = None  # commitLogOffset
    offset_hi: int | None = None
    ts_lo: int | None = None  # storeTimestamp in microseconds
    ts_hi: int | None = None
    topics: frozenset[str] | None = None
    queue_ids: frozenset[int] | None = None
    keys: frozenset[str] | None = None  # the whole KEYS property (pruned with the index)

    def empty(self) -> bool:
        if self.offset_lo is not None and self.offset_hi is not None and self.offset_lo > self.offset_hi:
            return True
        if self.ts_lo is not None and self.ts_hi is not None and self.ts_lo > self.ts_hi:
            return True
        return any(s is not None and not s for s in (self.topics, self.queue_ids, self.keys))

    def intersect(self, other: RowFilter) -> RowFilter:
        def lo(a, b):
            return b if a is None else a if b is None else max(a, b)

        def hi(a, b):
            return b if a is None else a if b is None else min(a, b)

        def both(a, b):
            return b if a is None else a if b is None else a & b
        return RowFilter(lo(self.offset_lo, other.offset_lo), hi(self.offset_hi, other.offset_hi),
                         lo(self.ts_lo, other.ts_lo), hi(self.ts_hi, other.ts_hi),
                         both(self.topics, other.topics), both(self.queue_ids, other.queue_ids),
                         both(self.keys, other.keys))

    def trivial(self) -> bool:
        return self == RowFilter()


# ---------------------------------------------------------------- the mapped file

class Segment:
    """One commitlog file mapped read-only (no store object, no lock: a reader of the files only)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.base = int(os.path.basename(path))
        fd = os.open(path, os.O_RDONLY)
        try:
            self.size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, self.size, access=mmap.ACCESS_READ) if self.size else None
        finally:
            os.close(fd)
        self.np = np.frombuffer(self.mm, dtype=np.uint8) if self.mm is not None else np.zeros(0, np.uint8)
        self.pa = pa.py_buffer(self.mm) if self.mm is not None else pa.py_buffer(b"")

    def close(self) -> None:
        self.np = np.zeros(0, np.uint8)
        self.pa = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # an Arrow array still points into the map; it is unmapped when that goes
                pass
            self.mm = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Walk:
    positions: np.ndarray  # file positions of the records found, ascending
    end: int  # file position after the last record (file size after a blank record)
    blank: bool = False  # stopped at the end-of-file blank record
    problem: str | None = None  # stopped at something that is not a record


MIN_RECORD_SIZE = 88 + 1 + 2  # header, topic length byte, properties length


def walk(mm: Any, pos: int, limit: int, *, zeros_end: bool = False, max_bytes: int | None = None,
         path: str = "") -> Walk:
    """Record boundaries from ``pos`` up to ``limit`` (the readable end), reading only TOTALSIZE and MAGICCODE.

    ``zeros_end``: a zero header is the end of the written data (a live or pre-allocated file), not a problem.
    ``max_bytes``: stop before the record that would take the walk past this many bytes (at least one record).
    The fields of each record are checked when it is decoded (:func:`decode`).
    """
    out = array("q")
    append = out.append
    unpack = _HEAD8.unpack_from
    start = pos
    v1, v2 = codec.MAGIC_V1, codec.MAGIC_V2
    lowest = MIN_RECORD_SIZE
    try:
        if max_bytes is None:
            while pos < limit:
                total, magic = unpack(mm, pos)
                if (magic == v1 or magic == v2) and lowest <= total <= limit - pos:
                    append(pos)
                    pos += total
                else:
                    break
        else:
            while pos < limit:
                total, magic = unpack(mm, pos)
                if not ((magic == v1 or magic == v2) and lowest <= total <= limit - pos):
                    break
                if out and pos + total - start > max_bytes:
                    return Walk(_positions(out), pos)
                append(pos)
                pos += total
    except struct.error:
        pass
    problem = None
    blank = False
    if pos < limit:
        if limit - pos < 8:
            if not (zeros_end and not any(mm[pos:limit])):
                problem = "record header runs past the readable end"
        else:
            total, magic = unpack(mm, pos)
            if magic == codec.BLANK_MAGIC:
                blank = True
            elif not (zeros_end and total == 0 and magic == 0):
                problem = codec.check(mm, pos, limit, check_crc=False)[2] or f"bad record size {total}"
    if problem is not None:
        problem = f"{path} at file position {pos}: {problem}"
    return Walk(_positions(out), pos, blank, problem)


def _positions(out: array) -> np.ndarray:
    return np.frombuffer(out, dtype=np.int64).copy() if out else np.zeros(0, np.int64)


# ---------------------------------------------------------------- a whole range

def read_range(path: str, start: int, end: int, names: Sequence[str], flt: RowFilter | None = None,
               batch_rows: int = DEFAULT_BATCH_ROWS, zeros_end: bool = False,
               boundary_known: bool = True, queues: Sequence[QueueSlice] | None = None,
               drop_cache: bool = False, skip_damaged: bool = False) -> Iterator[pa.RecordBatch]:
    """Batches of the records of one segment file between file positions ``start`` and ``end``.

    ``start`` must be a record boundary unless ``boundary_known`` is False, in
    which case the walk starts at the file start and skips what lies before.
    ``queues``: the consume-queue units that point into this segment (see
    :func:`queue_layout`), which spare the walk over record headers.
    ``drop_cache``: tell the kernel the range's pages are not needed any more
    (``posix_fadvise`` DONTNEED), so an export of a live store keeps its hot set.
    ``skip_damaged``: drop (and log) records whose body fails its CRC rather than fail (see :func:`decode`).
    """
    seg = Segment(path)
    try:
        end = min(end, seg.size)
        units = queue_layout(seg, queues, end, start) if queues else None
        if units is None:
            yield from _decode_batches(seg, _walked(seg, path, start, end, zeros_end, boundary_known), names, flt,
                                       batch_rows, end, skip_damaged)
            return
        pos, size = units
        # Each batch's records are checked against their units just before it is decoded (not all up front),
        # so the first rows reach Spark without waiting for a pass over the whole segment.
        for i in range(0, len(pos), batch_rows):
            p = pos[i:i + batch_rows]
            head = headers(seg, p, HEADER_BYTES)  # read once: checked against the units, then decoded
            if not records_match_units(seg, p, size[i:i + batch_rows], head):
                # Up to here the records matched their units, so p[0] is a record start (the one at the
                # segment's or piece's start for the first batch): walk on from there, as a walk from the
                # start would.
                log.info("%s: a record from file position %d on does not match its consume-queue unit; "
                         "walking the record headers", path, int(p[0]))
                if i == 0:
                    rest = _walked(seg, path, start, end, zeros_end, boundary_known)
                else:
                    rest = _walked(seg, path, int(p[0]), end, zeros_end, True)
                yield from _decode_batches(seg, rest, names, flt, batch_rows, end, skip_damaged)
                return
            b = decode(seg, p, names, flt, limit=end, skip_damaged=skip_damaged, head=head)
            if b is not None and b.num_rows:
                yield b
    finally:
        seg.close()
        if drop_cache:
            drop_page_cache(path, start, end)


def _walked(seg: Segment, path: str, start: int, end: int, zeros_end: bool, boundary_known: bool) -> np.ndarray:
    """Record positions from ``start`` to ``end`` by a walk over the headers (from the file start when
    ``start`` is not known to be a record boundary); a walk that stops at something that is not a record
    raises :class:`RecordFormatError`."""
    w = walk(seg.mm, 0 if not boundary_known and start > 0 else start, end, zeros_end=zeros_end, path=path)
    if w.problem is not None:
        raise RecordFormatError(w.problem)
    pos = w.positions
    if start > 0 and len(pos) and pos[0] < start:
        pos = pos[pos >= start]
    return pos


def _decode_batches(seg: Segment, pos: np.ndarray, names: Sequence[str], flt: RowFilter | None, batch_rows: int,
                    end: int, skip_damaged: bool) -> Iterator[pa.RecordBatch]:
    for i in range(0, len(pos), batch_rows):
        b = decode(seg, pos[i:i + batch_rows], names, flt, limit=end, skip_damaged=skip_damaged)
        if b is not None and b.num_rows:
            yield b


def drop_page_cache(path: str, start: int, end: int) -> None:
    """Advise the kernel to drop ``path``'s cached pages in [start, end) (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, start, max(0, end - start), os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


# (consume-queue directory, its file size, first unit, end unit): units that point into one segment.
QueueSlice = tuple[str, int, int, int]


def read_units(directory: str, file_size: int, lo: int, hi: int) -> np.ndarray:
    """Units ``lo`` to ``hi`` of a consume queue as an (n, 2) array of (commitlog offset, size)."""
    off, size = _unit_columns(directory, file_size, lo, hi)
    return np.stack([off, size], axis=1)


def _unit_columns(directory: str, file_size: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Units ``lo`` to ``hi`` of a consume queue as two arrays: commitlog offsets and sizes."""
    offs, sizes = [], []
    unit = UNIT_DTYPE.itemsize
    i = lo
    while i < hi:
        start = i * unit - (i * unit) % file_size
        first = (i * unit - start) // unit
        count = min(hi - i, file_size // unit - first)
        path = os.path.join(directory, f"{start:020d}")
        with open(path, "rb") as fh:
            fh.seek(first * unit)
            raw = fh.read(count * unit)
        u = np.frombuffer(raw, dtype=UNIT_DTYPE, count=len(raw) // unit)
        offs.append(u["off"].astype(np.int64))
        sizes.append(u["size"].astype(np.int64))
        if len(raw) < count * unit:
            break
        i += count
    if not offs:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return (offs[0], sizes[0]) if len(offs) == 1 else (np.concatenate(offs), np.concatenate(sizes))


def queue_units(queues: Sequence[QueueSlice]) -> tuple[np.ndarray, np.ndarray] | None:
    """The units of ``queues`` by offset, as (commitlog offsets, sizes); None when a file is unreadable or
    none."""
    try:
        cols = [_unit_columns(*q) for q in queues]
    except OSError:
        return None
    off = np.concatenate([c[0] for c in cols]) if len(cols) != 1 else cols[0][0]
    if not len(off):
        return None
    size = np.concatenate([c[1] for c in cols]) if len(cols) != 1 else cols[0][1]
    if len(off) > 1 and not (off[1:] >= off[:-1]).all():
        order = np.argsort(off, kind="stable")
        off, size = off[order], size[order]
    return off, size


def records_match_units(seg: Segment, pos: np.ndarray, size: np.ndarray, head: np.ndarray | None = None) -> bool:
    """Whether every record at ``pos`` says it is the unit: the right magic, TOTALSIZE ``size`` and
    PHYSICALOFFSET its own offset (what a header walk would have found, checked in one vectorised pass).
    ``head``: at least the first 36 bytes at each of ``pos``, when the caller has read them."""
    if head is None:
        head = headers(seg, pos, 36)  # TOTALSIZE .. PHYSICALOFFSET
    h = np.ascontiguousarray(head).view(_unit_fields(head.shape[1])).ravel()
    magic = h["magic"]
    ok = (h["total"] == size) & (h["phy"] == pos + seg.base) & ((magic == codec.MAGIC_V1) | (magic == codec.MAGIC_V2))
    return bool(ok.all())


@functools.cache
def _unit_fields(width: int) -> np.dtype:
    """TOTALSIZE, MAGICCODE and PHYSICALOFFSET of a ``width``-byte row of header bytes (a view, no copy)."""
    return np.dtype({"names": ["total", "magic", "phy"], "formats": [">i4", ">u4", ">i8"], "offsets": [0, 4, 28],
                     "itemsize": width})


def unit_positions(seg: Segment, off: np.ndarray, size: np.ndarray, start: int) -> np.ndarray | None:
    """File positions of the units (commitlog offsets ``off``, ascending, and ``size``) if they tile the
    segment from ``start`` with no gap or overlap (the units alone: the records are not read), else None."""
    pos = off - seg.base
    if pos[0] != start or (size < MIN_RECORD_SIZE).any() or (pos[1:] != pos[:-1] + size[:-1]).any():
        return None
    if int(pos[-1] + size[-1]) > seg.size:
        return None
    return pos


def queue_layout(seg: Segment, queues: Sequence[QueueSlice], end: int, start: int = 0
                 ) -> tuple[np.ndarray, np.ndarray] | None:
    """(file positions, sizes) of the records from ``start`` to ``end`` by the consume queues, or None when
    their units do not account for every record.

    The units must tile the segment from its start (or from ``start``, the first
    record of a piece of a split segment) to ``end`` (or to its blank record)
    with no gap or overlap.  Otherwise (a transaction half in no queue, a queue
    behind or damaged) the caller walks the record headers instead.  The records
    themselves must still say so (the right magic, TOTALSIZE equal to the unit's
    size and PHYSICALOFFSET equal to its own offset: :func:`records_match_units`),
    which the caller checks batch by batch before decoding them.
    """
    units = queue_units(queues)
    if units is None:
        return None
    off, size = units
    first = int(off[0]) - seg.base
    if first != 0 and first != start:
        return None
    last_end = int(off[-1] + size[-1]) - seg.base
    if last_end > end:
        return None
    if last_end != end:
        head = seg.mm[last_end:last_end + 8] if last_end + 8 <= seg.size else b""
        if len(head) < 8 or _HEAD8.unpack(head)[1] != codec.BLANK_MAGIC:
            return None
    pos = unit_positions(seg, off, size, first)
    if pos is None:
        return None
    if start > 0 and pos[0] < start:
        keep = pos >= start
        pos, size = pos[keep], size[keep]
        if not len(pos) or pos[0] != start:
            return None  # ``start`` is not where a unit starts
    return pos, size


def store_times(seg: Segment, positions: np.ndarray) -> np.ndarray:
    """STORETIMESTAMP (ms) of the records at ``positions`` (its place depends on the born host family)."""
    if not len(positions):
        return np.zeros(0, np.int64)
    sysflag = fixed(seg.np, positions + 36, 4).view(">i4").ravel()
    at = positions + np.where(sysflag & codec.SYSFLAG_BORNHOST_V6, 68, 56)
    return fixed(seg.np, at, 8).view(">i8").ravel().astype(np.int64)


def first_store_timestamp(path: str) -> int | None:
    """Store time of a segment's first record (None when the file holds no record)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(128)
    except OSError:
        return None
    if len(head) < 80:
        return None
    magic = struct.unpack_from(">I", head, 4)[0]
    if magic not in _MAGICS:
        return None
    return codec.read_store_timestamp(head, 0)
