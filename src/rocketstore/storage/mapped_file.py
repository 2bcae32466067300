"""MappedFile and MappedFileQueue: fixed-size memory-mapped segments named by their start offset.

The CommitLog and every ConsumeQueue are a MappedFileQueue: a sorted list of
files of one size, each named by its first byte's logical offset, zero-padded
to 20 digits.  A file is created at full size (sparse) before it is written,
and its name is made durable (the directory fsynced) before anything is
written to it: a file whose data was synced but whose directory entry was
not would vanish in a power cut, and the checkpoint may already count on it.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
from typing import Callable, Iterator

from ..errors import StoreLoadError
from .jsonfile import fsync_dir

log = logging.getLogger(__name__)

OS_PAGE_SIZE = 4096

# The one call that makes data durable; tests replace it to inject EIO/ENOSPC.
fdatasync = os.fdatasync


def allocate(fd: int, size: int) -> None:
    """Reserve the file's disk blocks up front.

    A sparse file would take its blocks when a page is first written through
    the map, and a full disk then kills the process with SIGBUS.  Allocating at
    creation turns that into an ENOSPC error here, where it can be reported.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)  # a file system without fallocate


def file_name(offset: int) -> str:
    return f"{offset:020d}"


def warm(mf: "MappedFile") -> None:
    """RocketMQ's warmMapedFileEnable: write the new file's pages with zeros and flush them.

    The put path then never pays for first-touch page faults (on some machines
    several times the cost of the copy itself).  ``os.pwrite`` releases the GIL
    (an ``mmap`` with MAP_POPULATE would hold it for the whole file); only a
    file no writer has been given yet is warmed.
    """
    chunk = bytes(1 << 20)
    for pos in range(0, mf.file_size, len(chunk)):
        os.pwrite(mf.fd, chunk[:min(len(chunk), mf.file_size - pos)], pos)
    os.fdatasync(mf.fd)
    mf.zeroed_position = mf.file_size


class MappedFile:
    """One segment.  Positions are relative to the file start.

    ``wrote_position`` is where the next append goes; ``flushed_position`` is
    what ``fdatasync`` has made durable.  Readers take a reference with
    :meth:`hold` so that a cleaner does not unmap a file under them.
    """

    def __init__(self, path: str, file_size: int, *, read_only: bool = False, create: bool = False) -> None:
        self.path = path
        self.file_size = file_size
        self.file_from_offset = int(os.path.basename(path))
        self.read_only = read_only
        flags = os.O_RDONLY if read_only else os.O_RDWR
        created = create and not os.path.exists(path)
        if create:
            flags |= os.O_CREAT
        self.fd = os.open(path, flags, 0o644)
        try:
            if create and os.fstat(self.fd).st_size < file_size:
                try:
                    allocate(self.fd, file_size)
                except OSError as e:
                    raise OSError(e.errno, e.strerror, path) from None
            self.mm = mmap.mmap(self.fd, file_size, access=mmap.ACCESS_READ if read_only else mmap.ACCESS_WRITE)
        except BaseException:
            os.close(self.fd)
            if created:
                os.unlink(path)  # never leave a half-made segment behind
            raise
        self.created = created
        if created:
            try:
                fsync_dir(os.path.dirname(path) or ".")  # the new name survives a power cut
            except BaseException:
                self.mm.close()
                os.close(self.fd)
                os.unlink(path)
                raise
        self.wrote_position = 0
        self.flushed_position = 0
        # Up to where the file's blocks hold written bytes (zeros past the write position, see
        # CommitLog.zero_ahead): 0 for a new file, whose fallocated blocks are unwritten extents.
        self.zeroed_position = 0
        self.store_timestamp = 0
        self._refs = 1
        self._available = True
        self._shutdown_at = 0.0
        self._unlinked = False  # the path is deleted once, by the first destroy
        self._ref_lock = threading.Lock()
        self.closed = False

    # ------------------------------------------------------------ positions
    @property
    def end_offset(self) -> int:
        return self.file_from_offset + self.file_size

    def is_full(self) -> bool:
        return self.wrote_position >= self.file_size

    def set_positions(self, pos: int) -> None:
        self.wrote_position = pos
        self.flushed_position = pos
        self.zeroed_position = pos

    def data_ranges(self, pos: int, end: int) -> Iterator[tuple[int, int]]:
        """The [start, stop) ranges of [pos, end) that may hold non-zero bytes.

        ``SEEK_DATA``/``SEEK_HOLE`` skip what the file system knows to read as
        zeros (holes, reserved blocks never written) without reading it, so a
        mostly empty segment is checked without faulting in its pages.  Where
        the file system cannot tell, the whole range is returned.
        """
        while pos < end:
            try:
                start = os.lseek(self.fd, pos, os.SEEK_DATA)
                stop = os.lseek(self.fd, start, os.SEEK_HOLE) if start < end else end
            except OSError as e:
                if e.errno != errno.ENXIO:  # ENXIO: no data past pos
                    yield pos, end
                return
            if start >= end:
                return
            yield start, min(stop, end)
            pos = stop

    def zero_from(self, pos: int, end: int | None = None, chunk: int = 1 << 20) -> int:
        """Zero the non-zero bytes of [pos, end) (to the file's end by default) and make that durable.

        What lies past a recovered end must not come back once later writes make
        it look continuous again (stale units, records).  Only chunks holding
        non-zero bytes are written; returns how many bytes were zeroed.
        """
        end = self.file_size if end is None else min(end, self.file_size)
        zeroed = 0
        for pos, end_of_data in self.data_ranges(pos, end):
            while pos < end_of_data:
                stop = min(end_of_data, (pos // chunk + 1) * chunk)
                if self.mm[pos:stop].count(0) != stop - pos:
                    self.mm[pos:stop] = bytes(stop - pos)
                    zeroed += stop - pos
                pos = stop
        if zeroed:
            fdatasync(self.fd)
        return zeroed

    # ------------------------------------------------------------ writes
    def append(self, data: bytes | bytearray | memoryview) -> int:
        """Copy ``data`` at the write position; return the position it was written at."""
        pos = self.wrote_position
        n = len(data)
        self.mm[pos:pos + n] = data
        self.wrote_position = pos + n
        return pos

    def flush(self, least_pages: int = 0) -> int:
        """fdatasync if enough pages are dirty; return the flushed position.

        ``os.fdatasync`` releases the GIL (``mmap.flush`` would hold it for the
        whole msync), and on Linux it writes back pages dirtied through the map.
        """
        wrote = self.wrote_position
        if self.closed or not self._is_able_to_flush(wrote, least_pages):
            return self.flushed_position
        if not self.hold():
            return self.flushed_position
        try:
            fdatasync(self.fd)
        finally:
            self.release()
        self.flushed_position = wrote
        return wrote

    def _is_able_to_flush(self, wrote: int, least_pages: int) -> bool:
        flushed = self.flushed_position
        if wrote >= self.file_size and flushed < wrote:
            return True
        if least_pages > 0:
            return wrote // OS_PAGE_SIZE - flushed // OS_PAGE_SIZE >= least_pages
        return wrote > flushed

    def drop_cache(self, pos: int, length: int) -> None:
        """Unmap and drop the page-cache pages of a range this process has finished reading."""
        if length <= 0 or not self.read_only:
            return
        start = pos - pos % mmap.PAGESIZE
        length += pos - start
        try:
            self.mm.madvise(mmap.MADV_DONTNEED, start, min(length, self.file_size - start))
            os.posix_fadvise(self.fd, start, length, os.POSIX_FADV_DONTNEED)
        except (OSError, ValueError, AttributeError):
            pass  # advice only

    # ------------------------------------------------------------ references
    def hold(self) -> bool:
        with self._ref_lock:
            if not self._available or self.closed:
                return False
            self._refs += 1
            return True

    def release(self) -> None:
        with self._ref_lock:
            self._refs -= 1
            if self._refs <= 0 and not self._available:
                self._cleanup()

    @property
    def available(self) -> bool:
        return self._available

    def destroy(self, interval_forcibly_ms: int = 0, now: float | None = None) -> bool:
        """Delete the file and drop the creator's reference; the mapping closes once no reader holds it.

        The name goes at the first call, held or not: a reader keeps its
        mapping and the space is freed when the last one closes, so neither a
        crash nor a later file of the same name can meet the old one again
        (RocketMQ keeps the file until it can unmap it).  Returns False while
        readers hold it; one still held ``interval_forcibly_ms`` after the
        first call is closed anyway (RocketMQ's destroyMapedFileIntervalForcibly).
        """
        now = time.monotonic() if now is None else now
        with self._ref_lock:
            if self._available:
                self._available = False
                self._shutdown_at = now
                self._refs -= 1
            elif self._refs > 0 and (now - self._shutdown_at) * 1000 >= interval_forcibly_ms:
                self._refs = -1000 - self._refs
            unlink, self._unlinked = not self._unlinked, True
            held = self._refs > 0
            if not held:
                self._cleanup()
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        return not held

    def _cleanup(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.mm.close()
        except BufferError:
            # A memoryview into the map is still alive; the map is unmapped when it goes.
            log.debug("mapping of %s still exported; closing later", self.path)
        os.close(self.fd)

    def close(self) -> None:
        with self._ref_lock:
            self._available = False
            self._cleanup()

    def __repr__(self) -> str:
        return f"MappedFile({self.path!r}, wrote={self.wrote_position})"


class MappedFileQueue:
    """The sorted segments of one directory, all ``file_size`` bytes long."""

    def __init__(self, directory: str, file_size: int, *, read_only: bool = False,
                 preallocate: bool = False, warm: bool = False, durable_parents: int = 1) -> None:
        self.directory = directory
        # How many directories above ``directory`` were made with it (a consume queue's topic and queue-id
        # directories, consumequeue/ itself): their entries are fsynced once, with the first file made here.
        self.durable_parents = durable_parents
        self._parents_synced = False
        self.file_size = file_size
        self.read_only = read_only
        self.files: list[MappedFile] = []
        self.flushed_where = 0
        self.store_timestamp = 0
        self._preallocate = preallocate
        self._warm = warm
        self._next: MappedFile | None = None
        self._next_done: threading.Event | None = None  # set when the allocation under way has ended
        self._lock = threading.Lock()

    # ------------------------------------------------------------ load
    def load(self, *, on_bad_file: Callable[[str, str], None] | None = None) -> None:
        """Open every file, sorted by name, validating names and sizes.

        ``on_bad_file(path, reason)`` may move a bad file aside (quarantine);
        without it, a bad file raises :class:`StoreLoadError`.  A zero-length
        last file is skipped (and removed when writable), as RocketMQ does.
        """
        if not os.path.isdir(self.directory):
            return
        names = []
        for name in sorted(os.listdir(self.directory)):
            if len(name) == 20 and name.isdigit():
                names.append(name)
                continue
            path = os.path.join(self.directory, name)
            if on_bad_file is None:
                raise StoreLoadError(f"{path}: file name is not a 20-digit offset")
            on_bad_file(path, "file name is not a 20-digit offset")
        for i, name in enumerate(names):
            path = os.path.join(self.directory, name)
            reason = None
            if not os.path.isfile(path):
                if self.read_only and not os.path.lexists(path):
                    self._retention_ran(path, i == len(names) - 1)
                    continue
                reason = "not a regular file"
            else:
                try:
                    size = os.path.getsize(path)
                except FileNotFoundError:
                    if not self.read_only:
                        raise
                    self._retention_ran(path, i == len(names) - 1)
                    continue
                if size == 0 and i == len(names) - 1:
                    log.warning("%s: empty last file skipped", path)
                    if not self.read_only:
                        os.unlink(path)
                    continue
                if size != self.file_size:
                    reason = f"file is {size} bytes, expected {self.file_size}"
                elif int(name) % self.file_size != 0:
                    reason = f"start offset {int(name)} is not a multiple of the file size {self.file_size}"
                elif self.files and int(name) != self.files[-1].end_offset:
                    reason = f"start offset {int(name)} does not follow {self.files[-1].path}"
            if reason:
                if on_bad_file is None:
                    raise StoreLoadError(f"{path}: {reason}")
                on_bad_file(path, reason)
                continue
            try:
                mf = MappedFile(path, self.file_size, read_only=self.read_only)
            except FileNotFoundError:
                if not self.read_only:
                    raise
                self._retention_ran(path, i == len(names) - 1)
                continue
            mf.set_positions(self.file_size)
            self.files.append(mf)

    def _retention_ran(self, path: str, last: bool) -> None:
        """A read-only load met a file that was listed and is gone: a writer's retention deletes the oldest
        files first, so the files loaded before it are going too.  Start the view after it, as a load a
        moment later would.  (The last name gone is a made-ahead file the writer dropped: just skipped.)"""
        log.info("%s: deleted while loading (the writer's retention); the view starts after it", path)
        if last:
            return
        for f in self.files:
            f.close()
        self.files.clear()

    # ------------------------------------------------------------ lookup
    def first(self) -> MappedFile | None:
        return self.files[0] if self.files else None

    def last(self) -> MappedFile | None:
        return self.files[-1] if self.files else None

    def find(self, offset: int, return_first: bool = False) -> MappedFile | None:
        files = self.files
        if not files:
            return None
        first = files[0]
        i = offset // self.file_size - first.file_from_offset // self.file_size
        if 0 <= i < len(files):
            f = files[i]
            if f.file_from_offset <= offset < f.end_offset:
                return f
        for f in files:
            if f.file_from_offset <= offset < f.end_offset:
                return f
        return first if return_first else None

    def min_offset(self) -> int:
        for f in self.files:
            if f.available:
                return f.file_from_offset
        return -1 if not self.files else self.files[-1].end_offset

    def max_offset(self) -> int:
        last = self.last()
        return last.file_from_offset + last.wrote_position if last else 0

    def __iter__(self) -> Iterator[MappedFile]:
        return iter(list(self.files))

    # ------------------------------------------------------------ create
    def last_for_append(self, start_offset: int = 0) -> MappedFile:
        """The last file if it has room, else a new one (taken from pre-allocation when ready)."""
        last = self.last()
        if last is not None and not last.is_full():
            return last
        create_at = start_offset - start_offset % self.file_size if last is None else last.end_offset
        return self._create(create_at)

    def _take_preallocated(self) -> MappedFile | None:
        """Wait for a pre-allocation under way and take its file (None if there is none)."""
        self.preallocated()
        with self._lock:
            nxt, self._next, self._next_done = self._next, None, None
        return nxt

    def preallocated(self) -> MappedFile | None:
        """The next segment made ahead of time, once the allocator has finished it."""
        with self._lock:
            done = self._next_done
        if done is not None:
            done.wait()  # an Event, not Thread.join: a waiter may come before the thread has started
        return self._next

    def _create(self, offset: int) -> MappedFile:
        nxt = self._take_preallocated()
        if nxt is not None and nxt.file_from_offset == offset:
            mf = nxt
        else:
            if nxt is not None:
                nxt.destroy()
            mf = MappedFile(os.path.join(self.directory, file_name(offset)), self.file_size, create=True)
            self._sync_parents(mf)
        self.files.append(mf)
        if self._preallocate:
            self.start_preallocation(offset + self.file_size)
        return mf

    def start_preallocation(self, offset: int) -> None:
        """Create (and fault in) the next file off the put path (AllocateMappedFileService)."""
        done = threading.Event()

        def run() -> None:
            try:
                mf = MappedFile(os.path.join(self.directory, file_name(offset)), self.file_size, create=True)
                self._sync_parents(mf)
                if self._warm:
                    warm(mf)
                with self._lock:
                    self._next = mf
            except OSError as e:
                log.warning("pre-allocation of %s failed: %s", file_name(offset), e)
            finally:
                done.set()
        with self._lock:
            self._next_done = done
        threading.Thread(target=run, name="AllocateMappedFileService", daemon=True).start()

    def _sync_parents(self, mf: MappedFile) -> None:
        """Once per queue, with its first new file: fsync the directories above this one, so the names
        leading to the file (made by ``os.makedirs``, which syncs nothing) survive a power cut too."""
        if self._parents_synced or not mf.created:
            return
        d = self.directory
        for _ in range(self.durable_parents):
            d = os.path.dirname(os.path.abspath(d))
            fsync_dir(d)
        self._parents_synced = True

    def next_file_reserved(self) -> bool:
        """Whether the next file is made ahead (or being made), so its space is already taken from the disk."""
        with self._lock:
            done, nxt = self._next_done, self._next
        return done is not None and (nxt is not None or not done.is_set())

    def discard_preallocated(self) -> None:
        """Delete a pre-allocated file that was never handed out (done at clean shutdown)."""
        nxt = self._take_preallocated()
        if nxt is not None:
            nxt.destroy()

    # ------------------------------------------------------------ flush
    def flush(self, least_pages: int = 0) -> bool:
        """Flush every dirty file from ``flushed_where`` on; return True if nothing was written.

        Filled files are flushed whole and the round goes on to the next; the file being written is
        flushed when ``least_pages`` of it are dirty.  (RocketMQ flushes one file a round: with small
        files and fast puts the lag would grow without bound.)
        """
        start = self.flushed_where
        f = self.find(start, return_first=start == 0)
        while f is not None:
            ts = f.store_timestamp
            pos = f.flush(least_pages)
            self.flushed_where = f.file_from_offset + pos
            if least_pages == 0:
                self.store_timestamp = ts
            if pos < f.file_size:
                break
            f = self.find(self.flushed_where)
        return self.flushed_where == start

    # ------------------------------------------------------------ truncation and deletion
    def truncate_dirty(self, offset: int) -> list[str]:
        """Move positions back to ``offset``; delete files wholly beyond it.  Bytes are not zeroed.

        The deletions are made durable (the directory fsynced) before this returns: a power cut must not bring
        back a file recovery dropped, with its stale records, beside what the store writes after it."""
        removed = []
        for f in list(self.files):
            if f.end_offset > offset:
                if offset >= f.file_from_offset:
                    f.set_positions(offset % self.file_size)
                else:
                    removed.append(f.path)
                    if self.read_only:
                        f.close()  # a read-only view only forgets the file
                    else:
                        f.destroy()
                    self.files.remove(f)
        if removed and not self.read_only:
            fsync_dir(self.directory)
        return removed

    def delete_files(self, victims: list[MappedFile]) -> None:
        for f in victims:
            if f in self.files:
                self.files.remove(f)

    def close(self) -> None:
        if not self.read_only:
            self.discard_preallocated()
        for f in self.files:
            f.close()
