"""StoreCheckpoint: one 4096-byte page of five big-endian longs.

::

    0   physicMsgTimestamp    store time of the last thoroughly flushed commitlog message
    8   logicsMsgTimestamp    store time of the last message flushed to the consume queues
    16  indexMsgTimestamp     end time of the last index file that filled up and was flushed
    24  masterFlushedOffset   HA bookkeeping (0 on a master)
    32  confirmPhyOffset      start of the last valid record, as recovery found it

and, after them, rocketstore's own (RocketMQ reads and writes only its five longs and leaves the rest of
the page as it is, so a page it rewrote keeps older values here: they only move recovery's start back)::

    40  "RSTORE01"            says the two offsets below were written
    48  physicFlushedOffset   the commitlog offset the last thorough commitlog flush reached
    56  logicsDispatchedOffset  the commitlog offset dispatched when the consume queues were last flushed whole
    64  physicFlushedStamp    the physicMsgTimestamp physicFlushedOffset was written with (0: not known)

Recovery starts from the segment whose first record is older than the timestamps (RocketMQ's rule), or
earlier where the offsets say so: store times are not monotonic (an imported record keeps its own), and a
segment that begins with an old one would otherwise be taken as the start past records never made durable.
After a power loss physicFlushedOffset also says which records were flushed (:meth:`flushed_offset`): store
times say it only while they grow, and an imported record's would count a write the power cut tore as flushed.
When RocketMQ rewrote the page, physicMsgTimestamp no longer matches the stamp: the offset is older than the
time, and the time decides, as in RocketMQ.
"""

from __future__ import annotations

import os
import struct
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from ..errors import StoreLoadError
from .jsonfile import fsync_dir

CHECKPOINT_SIZE = 4096
_LAYOUT = struct.Struct(">qqqqq")
_OURS = struct.Struct(">8sqqq")
_OURS_AT = _LAYOUT.size
_OURS_MAGIC = b"RSTORE01"


@dataclass
class StoreCheckpoint:
    path: str
    physicMsgTimestamp: int = 0
    logicsMsgTimestamp: int = 0
    indexMsgTimestamp: int = 0
    masterFlushedOffset: int = 0
    confirmPhyOffset: int = 0
    read_only: bool = False
    # Store time of the last record dispatched to a consume queue, in memory only: it becomes
    # logicsMsgTimestamp once the consume queues are flushed up to it (FlushConsumeQueueService), so the
    # page never claims queue units a crash could still lose.
    logics_dispatched: int = field(default=0, repr=False, compare=False)
    physicFlushedOffset: int = -1  # (see the module docstring; -1: not known, a page RocketMQ wrote)
    logicsDispatchedOffset: int = -1
    physicFlushedStamp: int = 0
    # The commitlog offset dispatch has reached, in memory only (as logics_dispatched): it becomes
    # logicsDispatchedOffset once the consume queues are flushed whole.
    logics_dispatched_end: int = field(default=-1, repr=False, compare=False)
    # The commitlog offset below which every record's consume-queue unit is flushed, in memory only: as
    # logicsDispatchedOffset, but not held back by records the index missed (tiered retention's gate).
    logics_units_flushed: int = field(default=-1, repr=False, compare=False)

    @classmethod
    def load(cls, path: str, *, read_only: bool = False, on_bad: "callable | None" = None) -> "StoreCheckpoint":
        """Read the file if present (a missing file reads as zeros; writable stores create it)."""
        cp = cls(path, read_only=read_only)
        if not os.path.exists(path):
            if not read_only:
                cp.flush()
            return cp
        size = os.path.getsize(path)
        if size != CHECKPOINT_SIZE:
            reason = f"{path}: checkpoint is {size} bytes, expected {CHECKPOINT_SIZE}"
            if on_bad is None:
                raise StoreLoadError(reason)
            on_bad(path, reason)
            if not read_only and not os.path.exists(path):  # on_bad may move the file later (and then flush)
                cp.flush()
            return cp
        with open(path, "rb") as fh:
            head = fh.read(_OURS_AT + _OURS.size)
        (cp.physicMsgTimestamp, cp.logicsMsgTimestamp, cp.indexMsgTimestamp,
         cp.masterFlushedOffset, cp.confirmPhyOffset) = _LAYOUT.unpack_from(head)
        magic, physic, logics, stamp = _OURS.unpack_from(head, _OURS_AT)
        if magic == _OURS_MAGIC:
            cp.physicFlushedOffset, cp.logicsDispatchedOffset, cp.physicFlushedStamp = physic, logics, stamp
        return cp

    @contextmanager
    def dispatch_marks_kept(self) -> Iterator[None]:
        """Keep the two in-memory dispatch marks (``logics_dispatched``, ``logics_dispatched_end``) as they are
        across a block that dispatches records out of commitlog order (a queue refill places old records): the
        marks say how far dispatch has reached in order, and an old record must not move them back."""
        kept = self.logics_dispatched, self.logics_dispatched_end
        try:
            yield
        finally:
            self.logics_dispatched, self.logics_dispatched_end = kept

    def recovery_offset(self) -> int | None:
        """The commitlog offset from which every record may be neither flushed nor in a flushed consume queue
        (the lower of the two offsets), or None when this page does not hold them."""
        if self.physicFlushedOffset < 0 or self.logicsDispatchedOffset < 0:
            return None
        return min(self.physicFlushedOffset, self.logicsDispatchedOffset)

    def note_physic_flushed(self, store_timestamp: int, offset: int) -> None:
        """A thorough commitlog flush reached ``offset``, its last record stored at ``store_timestamp`` (0: keep
        the time).  The offset is set first and the stamp last: a page written in between holds either an
        offset no older than its time, or a stamp that does not match (then the time decides)."""
        self.physicFlushedOffset = offset
        if store_timestamp:
            self.physicMsgTimestamp = store_timestamp
        self.physicFlushedStamp = self.physicMsgTimestamp

    def flushed_offset(self) -> int | None:
        """The commitlog offset below which every record was flushed (thoroughly, then fdatasync'd), or None
        when the page does not say it for its physicMsgTimestamp (RocketMQ's page, or one RocketMQ rewrote)."""
        if self.physicFlushedOffset < 0 or not self.physicMsgTimestamp or \
                self.physicFlushedStamp != self.physicMsgTimestamp:
            return None
        return self.physicFlushedOffset

    def cut_offsets(self, end: int) -> None:
        """The commitlog ends at ``end`` now (recovery cut its torn tail, or it was restored shorter): an offset
        above it stands for records that are gone, and once the other offset moves past it, it would make the
        records written next below it count as flushed into the consume queues."""
        self.physicFlushedOffset = min(self.physicFlushedOffset, end)
        self.logicsDispatchedOffset = min(self.logicsDispatchedOffset, end)
        self.logics_units_flushed = min(self.logics_units_flushed, end)

    def min_timestamp(self) -> int:
        """Recovery's lower bound: min(physic, logics) - 3 s, never negative."""
        return max(0, min(self.physicMsgTimestamp, self.logicsMsgTimestamp) - 3000)

    def min_timestamp_index(self) -> int:
        return min(self.min_timestamp(), self.indexMsgTimestamp)

    def to_dict(self) -> dict[str, int]:
        return {"physicMsgTimestamp": self.physicMsgTimestamp, "logicsMsgTimestamp": self.logicsMsgTimestamp,
                "indexMsgTimestamp": self.indexMsgTimestamp, "masterFlushedOffset": self.masterFlushedOffset,
                "confirmPhyOffset": self.confirmPhyOffset}

    def flush(self) -> None:
        """Rewrite the page in place and fdatasync it (the page is written whole, so it never tears across fields)."""
        if self.read_only:
            return
        page = bytearray(CHECKPOINT_SIZE)
        _LAYOUT.pack_into(page, 0, self.physicMsgTimestamp, self.logicsMsgTimestamp, self.indexMsgTimestamp,
                          self.masterFlushedOffset, self.confirmPhyOffset)
        if self.physicFlushedOffset >= 0 or self.logicsDispatchedOffset >= 0:  # (else zeros, as RocketMQ's page)
            _OURS.pack_into(page, _OURS_AT, _OURS_MAGIC, self.physicFlushedOffset, self.logicsDispatchedOffset,
                            self.physicFlushedStamp)
        created = not os.path.exists(self.path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, page, 0)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        if created:  # a new file's name is durable only once its directory is synced
            fsync_dir(os.path.dirname(os.path.abspath(self.path)))
