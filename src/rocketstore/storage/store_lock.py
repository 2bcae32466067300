"""StoreLock: the one writer's hold on a store directory.

Two locks, both released by the OS when the process dies:

* a record lock on ``<store>/lock`` (RocketMQ's ``FileChannel.tryLock``), so a Java broker and
  rocketstore exclude each other;
* an ``flock`` on the store directory itself, through a descriptor kept open, which still holds
  when someone deletes the ``lock`` file under an open store (a new file would carry no lock).

Record locks do not exclude a second open within one process, so the process keeps its own
registry of the directories it holds.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading

from ..errors import StoreError, StoreLockedError

_HELD: set[str] = set()  # real paths of the store directories this process holds
_HELD_LOCK = threading.Lock()


def held_here(root: str) -> bool:
    """True when this process holds the store at ``root`` open for writing (a second open in it would deadlock
    on its own flock, so callers that only probe the lock step aside)."""
    with _HELD_LOCK:
        return os.path.realpath(root) in _HELD


class StoreLock:
    def __init__(self, root: str) -> None:
        self.root = root
        self.path = os.path.join(root, "lock")
        self._real_root = os.path.realpath(root)
        self._fds: tuple[int, int] | None = None  # the lock file's and the directory's

    def acquire(self) -> None:
        """Take both locks and write "lock" into the file (as RocketMQ does).

        StoreLockedError only when another holder has a lock; a store this process may not write (no
        permission, read-only file system) is a StoreError saying so, not "locked by another process".
        """
        with _HELD_LOCK:
            if self._real_root in _HELD:
                raise StoreLockedError(f"{self.path}: store already open in this process")
            try:
                dir_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
            except OSError as e:
                raise StoreError(f"{self.root}: cannot open the store directory: {e.strerror}") from None
            fd = -1
            try:
                try:
                    fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise self._held() from None
                try:
                    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                except OSError as e:
                    raise self._not_writable(e) from None
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
                except (BlockingIOError, PermissionError):  # held (EAGAIN, or EACCES on some systems)
                    raise self._held() from None
                try:
                    os.pwrite(fd, b"lock", 0)
                    os.fsync(fd)
                except OSError as e:
                    raise self._not_writable(e) from None
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                os.close(dir_fd)
                raise
            self._fds = (fd, dir_fd)
            _HELD.add(self._real_root)

    def _held(self) -> StoreLockedError:
        return StoreLockedError(f"{self.path}: store is locked by another process (Lock failed, MQ already started)")

    def _not_writable(self, e: OSError) -> StoreError:
        why = "no write permission" if e.errno in (errno.EACCES, errno.EPERM) else \
            "read-only file system" if e.errno == errno.EROFS else e.strerror
        return StoreError(f"{self.path}: cannot write the store's lock file ({why}); open the store read-only "
                          "or as a user who may write it")

    def release(self) -> None:
        if self._fds is None:
            return
        fd, dir_fd = self._fds
        with _HELD_LOCK:
            try:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, 0)
            finally:
                os.close(fd)
                os.close(dir_fd)  # closing the last descriptor releases the flock
                self._fds = None
                _HELD.discard(self._real_root)

    def __enter__(self) -> "StoreLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
