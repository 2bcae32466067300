"""WarmAheadService: keeps the page cache of the commitlog filled a window ahead of the writer.

A commitlog segment is created with its blocks reserved but its pages absent
from the page cache.  The first write to each page then allocates and zeroes
it in the writer's own thread, under the GIL: on virtual machines whose guest
memory is backed lazily this costs several times the copy itself (measured
here: 330 MB/s into absent pages, 3-4 GB/s into cached ones).  RocketMQ's
``warmMapedFileEnable`` pays that price up front by writing zeros over the
whole new segment and flushing them, which doubles the disk writes.

This service does the cheap half of it: it reads the next ``warmAheadBytes``
past the write position, which puts zero-filled, clean pages into the page
cache (reserved but unwritten blocks read as zeros without any I/O) on the
other core, with the GIL released.  Nothing is written and nothing is dirtied,
so an idle or crashed store loses nothing.  The writer wakes it each time it has
used up half the window; at the end of a segment it warms the pre-allocated next
one.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .base import ServiceThread

if TYPE_CHECKING:
    from ..storage.mapped_file import MappedFile, MappedFileQueue

CHUNK = 4 * 1024 * 1024
WOKEN = 1 << 62  # ``wake_at`` once the writer has called for a round


class WarmAheadService(ServiceThread):
    """Reads ahead of the commitlog's write position; ``wake_at`` is the logical offset whose crossing by the
    writer calls for the next round (compared on the put path, so it is one integer)."""

    name = "WarmAheadService"

    def __init__(self, queue: "MappedFileQueue", window: int) -> None:
        super().__init__(interval=1.0)
        self.queue = queue
        self.window = window
        self.warmed = queue.max_offset()  # logical offset up to which the pages have been read
        self.wake_at = self.warmed  # the first append starts the first round; an idle store reads nothing
        self._buf = b""  # the read buffer, made at the first round (a store that never writes needs none)

    def wake(self) -> None:
        """Called by the writer once it passes ``wake_at``."""
        self.wake_at = WOKEN
        self.wakeup()

    def run_once(self) -> None:
        if self.wake_at != WOKEN:
            return  # the periodic round: the writer has not moved far enough
        while not self.stopped:
            write = self.queue.max_offset()
            self._read_ahead(write, write + self.window)
            mark = max(write, self.warmed - self.window // 2)
            self.wake_at = mark
            # A writer that passed the mark before it was set had its wake-up overwritten: go round again.
            if self.queue.max_offset() <= mark:
                return

    def _read_ahead(self, start: int, target: int) -> None:
        if not self._buf:
            self._buf = bytearray(min(CHUNK, self.window))
        view = memoryview(self._buf)
        start = max(self.warmed, start)
        while start < target and not self.stopped:
            f = self._file_at(start)
            if f is None:  # no next segment (its allocation failed): the writer's next wake-up retries
                return
            # A descriptor of our own, not a reference to the MappedFile: a pre-allocated segment discarded
            # meanwhile is then deleted at once (a held one would outlive its destroy on disk), and a read of a
            # deleted file only warms pages nobody will use.
            try:
                fd = os.open(f.path, os.O_RDONLY)
            except OSError:
                return
            try:
                end = min(target, f.end_offset)
                while start < end and not self.stopped:
                    n = min(len(self._buf), end - start)
                    os.preadv(fd, [view[:n]], start - f.file_from_offset)
                    start += n
                    self.warmed = start
            except OSError:
                return  # advice only: the writer faults the pages in itself
            finally:
                os.close(fd)

    def _file_at(self, offset: int) -> "MappedFile | None":
        f = self.queue.find(offset)
        if f is not None:
            return f
        nxt = self.queue.preallocated()  # waits for an allocation under way
        return nxt if nxt is not None and nxt.file_from_offset <= offset < nxt.end_offset else None
