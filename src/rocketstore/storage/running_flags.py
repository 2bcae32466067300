"""RunningFlags: why the store refuses writes, with the reason kept for ``state`` and errors."""

from __future__ import annotations

import threading

NOT_READABLE = 0x1
NOT_WRITEABLE = 0x2
WRITE_LOGICS_QUEUE_ERROR = 0x4
WRITE_INDEX_FILE_ERROR = 0x8
DISK_FULL = 0x10
FENCED = 0x20
LOGIC_DISK_FULL = 0x40
_NOT_WRITEABLE_BITS = NOT_WRITEABLE | WRITE_LOGICS_QUEUE_ERROR | WRITE_INDEX_FILE_ERROR | DISK_FULL | FENCED | LOGIC_DISK_FULL


class RunningFlags:
    def __init__(self) -> None:
        self.flags = 0
        self._reasons: dict[int, str] = {}
        self._lock = threading.Lock()

    def _set(self, bit: int, reason: str) -> None:
        with self._lock:
            self.flags |= bit
            self._reasons[bit] = reason

    def _clear(self, bit: int) -> None:
        with self._lock:
            self.flags &= ~bit
            self._reasons.pop(bit, None)

    def make_not_writeable(self, reason: str) -> None:
        self._set(NOT_WRITEABLE, reason)

    def make_writeable(self) -> None:
        self._clear(NOT_WRITEABLE)

    def make_disk_full(self, reason: str) -> None:
        self._set(DISK_FULL, reason)

    def clear_disk_full(self) -> None:
        self._clear(DISK_FULL)

    def is_disk_full(self) -> bool:
        return bool(self.flags & DISK_FULL)

    def make_logics_queue_error(self, reason: str) -> None:
        self._set(WRITE_LOGICS_QUEUE_ERROR, reason)

    def make_index_file_error(self, reason: str) -> None:
        self._set(WRITE_INDEX_FILE_ERROR, reason)

    def is_writeable(self) -> bool:
        return not self.flags & _NOT_WRITEABLE_BITS

    def why_not_writeable(self) -> str | None:
        """The reason puts are refused, or None when the store is writeable."""
        if not self.flags & _NOT_WRITEABLE_BITS:
            return None
        with self._lock:
            return "; ".join(r for b, r in sorted(self._reasons.items()) if b & _NOT_WRITEABLE_BITS)
