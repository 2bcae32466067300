"""StoreCheckpoint: one 4096-byte page of five big-endian longs.

::

    0   physicMsgTimestamp    store time of the last thoroughly flushed commitlog message
    8   logicsMsgTimestamp    store time of the last message flushed to the consume queues
    16  indexMsgTimestamp     end time of the last index file that filled up and was flushed
    24  masterFlushedOffset   HA bookkeeping (0 on a master)
    32  confirmPhyOffset      start of the last valid record, as recovery found it
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

from ..errors import StoreLoadError
from .jsonfile import fsync_dir

CHECKPOINT_SIZE = 4096
_LAYOUT = struct.Struct(">qqqqq")


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
            values = _LAYOUT.unpack(fh.read(_LAYOUT.size))
        (cp.physicMsgTimestamp, cp.logicsMsgTimestamp, cp.indexMsgTimestamp,
         cp.masterFlushedOffset, cp.confirmPhyOffset) = values
        return cp

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
        created = not os.path.exists(self.path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, page, 0)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        if created:  # a new file's name is durable only once its directory is synced
            fsync_dir(os.path.dirname(os.path.abspath(self.path)))
