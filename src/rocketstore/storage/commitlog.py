"""CommitLog: the shared append-only log of every topic's records, in fixed-size segments.

Producers encode outside the lock; under the put lock the store only assigns
the queue offset, stamps the store time and physical offset, and copies the
record into the mapped segment.  A record that does not fit the rest of a
segment (with 8 bytes to spare) is preceded by an 8-byte blank record and goes
to the next segment.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Iterator, Protocol

from ..format import codec
from ..format.codec import BLANK_RECORD_SIZE, EncodedRecord, MessageExt
from ..errors import CommitLogWriteError, CorruptRecordError
from .mapped_file import MappedFile, MappedFileQueue

log = logging.getLogger(__name__)


class Warmer(Protocol):
    """What the commitlog asks of a warm-ahead thread (services.warm_ahead): wake it once the writes pass
    ``wake_at``.  A protocol, so the file layer names no service."""

    wake_at: int

    def wake(self) -> None: ...


# What CommitLog.append returns: (first record's offset, bytes written, store timestamp, each record's offset).
AppendResult = tuple[int, int, int, list[int]]


# Batches, and records of at least this many bytes, are written with pwritev (see _write_gathered); smaller
# single records are copied into the map (a syscall costs more than the occasional page fault they share).
GATHER_MIN_BYTES = 4096
IOV_CHUNK = 1020  # buffers per pwritev call: under IOV_MAX (1024), whole records (3 buffers each)

# SYNC_FLUSH keeps at least half of this many bytes past the write position written with zeros (see
# CommitLog._zero_ahead).
ZERO_AHEAD_BYTES = 256 * 1024


class CommitLog:
    def __init__(self, directory: str, file_size: int, *, read_only: bool = False,
                 clock: Callable[[], float] = time.time, warm: bool = False, gather_all: bool = False) -> None:
        self.directory = directory
        self.file_size = file_size
        self.queue = MappedFileQueue(directory, file_size, read_only=read_only, preallocate=not read_only,
                                     warm=warm)
        self.put_lock = threading.Lock()
        self.clock = clock
        self.confirm_offset = 0
        # SYNC_FLUSH writes every record with pwritev: each put lands in the page the last fdatasync has just
        # cleaned, and a store through the map would take a write-protect fault there every time.
        self.gather_min_bytes = 0 if gather_all else GATHER_MIN_BYTES
        self.zero_ahead = ZERO_AHEAD_BYTES if gather_all else 0  # SYNC_FLUSH: see _zero_ahead
        self.warmer: Warmer | None = None  # set by the store when warmAheadBytes > 0
        self.tier: Any = None  # the store's TieredStorage: offsets below the local minimum are read there

    def load(self, on_bad_file=None) -> None:
        self.queue.load(on_bad_file=on_bad_file)

    # ------------------------------------------------------------ offsets
    def min_offset(self) -> int:
        return self.queue.min_offset() if self.queue.files else 0

    def max_offset(self) -> int:
        return self.queue.max_offset()

    # ------------------------------------------------------------ writing
    def append(self, records: list[EncodedRecord], queue_offset: int | None,
               store_timestamp: int | None = None) -> AppendResult:
        """Append records of one topic/queue as one unit (a batch moves to a new segment whole).

        ``queue_offset`` is the first queue offset to stamp (None for PREPARED and
        ROLLBACK records, which store 0).  Must be called with ``put_lock`` held.
        """
        total = codec.records_size(records)
        if total + BLANK_RECORD_SIZE > self.file_size:
            raise codec.MessageTooLarge(
                f"{total} bytes do not fit a {self.file_size}-byte commitlog segment (mappedFileSizeCommitLog)")
        ts = int(self.clock() * 1000) if store_timestamp is None else store_timestamp
        f = self.queue.last_for_append(0)
        if total + BLANK_RECORD_SIZE > self.file_size - f.wrote_position:
            f.append(codec.blank_record(self.file_size - f.wrote_position))
            f.wrote_position = self.file_size
            f = self.queue.last_for_append(0)
        base = f.file_from_offset
        first = pos = f.wrote_position
        if len(records) == 1 and total < self.gather_min_bytes:  # a small record: straight into the map
            codec.write_record(f.mm, pos, records[0], queue_offset or 0, base + pos, ts)
            offsets = [base + pos]
        else:
            offsets = self._write_gathered(f, records, queue_offset, ts, total)
        f.wrote_position = first + total
        f.store_timestamp = ts
        if self.zero_ahead and first + total > f.zeroed_position - self.zero_ahead // 2:
            self._zero_ahead(f)
        w = self.warmer
        if w is not None and base + first + total > w.wake_at:
            w.wake()
        return base + first, total, ts, offsets

    def append_units(self, units: list[tuple[list[EncodedRecord], int | None, int | None]]
                     ) -> tuple[list[AppendResult], BaseException | None]:
        """Append several puts' records (each a unit of one topic/queue, see :meth:`append`) in the order given,
        with one gathered write per segment they land in: the group commit's one write for many producers.

        Each unit is ``(records, queue_offset, store_timestamp)``; every unit must fit a segment (the caller
        checked, as :meth:`append` would refuse it alone).  Returns the results of the units written, in
        order, and the error that stopped the rest (a segment that cannot be made, a failed write), or None.
        Units before the error are written and stay; the failed one and those after it are not written.
        Must be called with ``put_lock`` held.
        """
        done: list[AppendResult] = []
        now = int(self.clock() * 1000)
        size = self.file_size
        f: MappedFile | None = None
        iov: list[bytes] = []
        unwritten: list[AppendResult] = []  # the units in ``iov``
        pos = base = 0
        try:
            for records, queue_offset, store_timestamp in units:
                total = codec.records_size(records)
                if f is None:
                    f = self.queue.last_for_append(0)
                    pos, base = f.wrote_position, f.file_from_offset
                if total + BLANK_RECORD_SIZE > size - pos:  # to the next segment, whole
                    self._write_units(f, iov, unwritten, done)
                    iov, unwritten = [], []
                    f.append(codec.blank_record(size - pos))
                    f.wrote_position = size
                    f = self.queue.last_for_append(0)
                    pos, base = f.wrote_position, f.file_from_offset
                ts = now if store_timestamp is None else store_timestamp
                parts, offsets = codec.batch_parts(records, queue_offset or 0, 0 if queue_offset is None else 1,
                                                   base + pos, ts)
                iov += parts
                unwritten.append((base + pos, total, ts, offsets))
                pos += total
            if f is not None:
                self._write_units(f, iov, unwritten, done)
        except (OSError, CommitLogWriteError) as e:
            return done, e
        w = self.warmer
        if w is not None and done and done[-1][0] + done[-1][1] > w.wake_at:
            w.wake()
        return done, None

    def _write_units(self, f: MappedFile, iov: list[bytes], units: list[AppendResult],
                     done: list[AppendResult]) -> None:
        """Write the gathered buffers of ``units`` at the file's write position, then move it past them."""
        if not units:
            return
        end = units[-1][0] + units[-1][1] - f.file_from_offset
        self._write_iov(f, iov, f.wrote_position, end - f.wrote_position)
        f.wrote_position = end
        f.store_timestamp = units[-1][2]
        done += units
        if self.zero_ahead and end > f.zeroed_position - self.zero_ahead // 2:
            self._zero_ahead(f)

    def _zero_ahead(self, f: MappedFile) -> None:
        """(SYNC_FLUSH, under ``put_lock``.)  Write zeros over the next ``zero_ahead`` bytes past the write
        position, so that the next puts land on blocks that are already written.

        A segment's blocks are reserved with ``fallocate``: unwritten extents.  The first write to each
        4 KiB block converts its extent at writeback, and the put's ``fdatasync`` must then make that
        metadata durable too (ext4 without a journal: the extent-tree leaf and the inode, written one after
        the other; with one: a journal commit): one put in four with 1 KiB bodies, measured as the
        commitlog's fdatasync taking 30-40 % longer than a floor's (docs/bench.md).  Converted here a chunk
        at a time, the next ``fdatasync`` writes the zeros in the same request as the put's own page, and the
        extent metadata once per chunk.

        Only bytes past the write position are written, and they are zeros already (a fresh segment reads
        as zeros; recovery zeroes what lies past a recovered end): the file's content does not change, and
        no sync is made here (the puts' own flushes write the zeros).  Advice only: an error stops it for
        this file (the writes that follow report their own errors).
        """
        start = max(f.zeroed_position, f.wrote_position)
        stop = min(start + self.zero_ahead, f.file_size)
        if stop <= start:
            f.zeroed_position = f.file_size
            return
        try:
            os.pwrite(f.fd, bytes(stop - start), start)
        except OSError as e:
            log.debug("%s: zeroing ahead at file position %d failed: %s", f.path, start, e)
            stop = f.file_size
        f.zeroed_position = stop

    def _write_iov(self, f: MappedFile, iov: list[bytes], pos: int, total: int) -> None:
        """pwritev ``iov`` (``total`` bytes) at file position ``pos``; CommitLogWriteError on failure."""
        at = pos
        n = len(iov)
        try:
            for i in range(0, n, IOV_CHUNK):
                if n <= IOV_CHUNK:  # the common case: all of it in one call
                    chunk, want = iov, total
                else:
                    chunk = iov[i:i + IOV_CHUNK]
                    want = sum(map(len, chunk))
                done = os.pwritev(f.fd, chunk, pos)
                if done < want:  # a short write (rare on a regular file): finish it from one buffer
                    rest = memoryview(b"".join(chunk))
                    while done < want:
                        done += os.pwrite(f.fd, rest[done:], pos + done)
                pos += want
        except OSError as e:
            raise CommitLogWriteError(f"{f.path}: write of {total} bytes at file position {at} "
                                      f"failed: {e.strerror or e}") from None

    def _write_gathered(self, f: MappedFile, records: list[EncodedRecord], queue_offset: int | None, ts: int,
                        total: int) -> list[int]:
        """Write the records with ``pwritev``: each record's header, body and tail straight from their buffers.

        RocketMQ's transientStorePool writes through a channel for the same
        reason: written through the map, every new page of a segment costs a
        page fault that allocates and zeroes it (several times the copy itself
        on virtual machines); ``pwritev`` fills whole page-cache pages without
        faulting, copies each body once, releases the GIL while it copies, and
        reports an I/O error as an exception where a store through the map
        would be a SIGBUS.  Readers and ``fdatasync`` see the same page cache
        either way.
        """
        iov, offsets = codec.batch_parts(records, queue_offset or 0, 0 if queue_offset is None else 1,
                                         f.file_from_offset + f.wrote_position, ts)
        self._write_iov(f, iov, f.wrote_position, total)
        return offsets

    # ------------------------------------------------------------ reading
    def read_message(self, offset: int, *, read_body: bool = True, check_crc: bool = False) -> MessageExt:
        """Decode the record at ``offset``; raises CorruptRecordError naming file and offset."""
        f = self.queue.find(offset)
        if f is None or not f.hold():
            if self.in_tier(offset):  # uploaded, and gone from local disk
                return self.tier.reader.read_message(offset, read_body=read_body, check_crc=check_crc)
            raise CorruptRecordError(f"commitlog offset {offset} is not in any segment of {self.directory}")
        try:
            pos = offset - f.file_from_offset
            try:
                return codec.decode_at(f.mm, pos, f.wrote_position, offset, check_crc=check_crc, read_body=read_body)
            except codec.RecordError as e:
                raise CorruptRecordError(f"{f.path} at offset {offset} (file position {pos}): {e}") from None
        finally:
            f.release()

    def in_tier(self, offset: int) -> bool:
        """Whether ``offset`` lies below the local segments, in the tier."""
        t = self.tier
        return t is not None and t.reader is not None and t.holds(offset) and \
            (not self.queue.files or offset < self.min_offset())

    def min_offset_with_tier(self) -> int:
        """The lowest readable offset: the tier's start when it reaches below the local segments."""
        local = self.min_offset()
        t = self.tier
        if t is not None and t.reader is not None and t.manifest.commitlog and \
                (not self.queue.files or t.manifest.min_offset < local) and t.manifest.end_offset >= local:
            return t.manifest.min_offset
        return local

    def pickup_store_timestamp(self, offset: int, size: int) -> int:
        if self.in_tier(offset):
            try:
                return self.tier.reader.store_timestamp(offset)
            except (CorruptRecordError, OSError):
                return -1
        if offset < self.min_offset() or offset + size > self.max_offset():
            return -1
        f = self.queue.find(offset)
        if f is None:
            return -1
        return codec.read_store_timestamp(f.mm, offset - f.file_from_offset)

    def scan(self, from_offset: int = -1, *, check_crc: bool = False, read_body: bool = True,
             end: int | None = None, drop_cache: bool = False
             ) -> Iterator[tuple[int, int, MessageExt | None, str | None]]:
        """Walk records in commitlog order as (offset, size, message, problem).

        Blank records are skipped silently.  The walk stops at the first record
        that is not valid, yielding it once with ``message`` None and the reason.
        ``drop_cache`` asks the kernel to drop the pages of every finished segment
        except the last (the hot tail), so a long scan of a live store does not
        push its working set out of the page cache.
        """
        files = list(self.queue.files)
        if from_offset < 0:
            from_offset = self.min_offset_with_tier()
        if self.in_tier(from_offset):
            local_min = self.min_offset() if files else self.tier.manifest.end_offset
            last = None
            for item in self.tier.reader.scan(from_offset, local_min if end is None else min(end, local_min),
                                              check_crc=check_crc, read_body=read_body):
                yield item
                if item[2] is None:
                    return
                last = item
            from_offset = local_min if last is None else max(local_min, last[0] + last[1])
            if end is not None and from_offset >= end:
                return
        if not files:
            return
        offset = files[0].file_from_offset if from_offset < 0 else from_offset
        stop = self.max_offset() if end is None else end
        while offset < stop:
            f = self.queue.find(offset)
            if f is None:
                return
            if not f.hold():
                return
            start_pos = end = offset - f.file_from_offset
            try:
                for pos, size, msg, reason in codec.walk(f.mm, start_pos, f.wrote_position, check_crc=check_crc,
                                                         read_body=read_body, base=f.file_from_offset):
                    if f.file_from_offset + pos >= stop:
                        break
                    if size == 0:
                        end = self.file_size  # blank: the rest of the file is unused
                        break
                    if msg is None:
                        yield f.file_from_offset + pos, size, None, f"{f.path} at file position {pos}: {reason}"
                        return
                    yield f.file_from_offset + pos, size, msg, None
                    end = pos + size
                pos = end
                if drop_cache and f is not self.queue.last():
                    f.drop_cache(start_pos, min(pos, f.file_size) - start_pos)
            finally:
                f.release()
            if pos < self.file_size:
                if f is self.queue.last() or f.file_from_offset + pos >= stop:
                    return
                # A non-last file that ends without a blank record.
                yield f.file_from_offset + pos, -1, None, f"{f.path} at file position {pos}: no record and no blank"
                return
            offset = f.end_offset

    def flush(self, least_pages: int = 0) -> bool:
        return self.queue.flush(least_pages)

    def close(self) -> None:
        self.queue.close()
