"""The pop state of a store shared by processes: ``config/popState.json`` under an ``flock``.

Every operation of a :class:`~rocketstore.queues.simple_consumer.SimpleConsumer` runs inside
:meth:`SharedPopState.locked`: take ``config/popState.lock`` (flock, released by the OS when the process
dies, so a SIGKILL never leaves it held), load the file again if another process replaced it since we
last read or wrote it (its inode changes with every write: the file is replaced by rename), run the
operation on the in-memory :class:`~rocketstore.queues.pop.PopService`, and, if it changed anything,
write the file (a temporary file renamed over the old one: a reader, or a process SIGKILLed mid-write,
sees the old state or the new one, never half of one) before the lock is released.

Durability: the rename makes the state safe against a process crash (SIGKILL) as soon as ``locked()``
returns.  ``durable=True`` (``ackSyncFlush``) also fsyncs the file and the directory, so the state
survives a power loss.  ``consumerOffset.json`` (RocketMQ's committed offsets, read by RocketMQ and by the
offset-only Consumer) follows at most every OFFSETS_EVERY seconds and at close; it may lag popState.json,
which is the truth for pop groups (a lagging committed offset only makes the floor lower).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..storage.consumer_offsets import ConsumerOffsetManager, read_json_lenient
from ..storage.jsonfile import fsync_dir
from .pop import PopService

OFFSETS_EVERY = 1.0


class SharedPopState:
    """One process's handle on a store's pop state; thread-safe."""

    def __init__(self, config_dir: str, make_pop: Callable[[ConsumerOffsetManager], PopService],
                 follow: Callable[[], Any] | None = None) -> None:
        os.makedirs(config_dir, exist_ok=True)
        self.config_dir = config_dir
        self.path = os.path.join(config_dir, "popState.json")
        self._fd = os.open(os.path.join(config_dir, "popState.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        self._thread_lock = threading.RLock()
        self._make_pop = make_pop
        self._follow = follow or (lambda: None)
        self._seen: tuple[int, int, int] | None = None
        self._offsets_written = 0.0
        self.pop: PopService | None = None

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    @contextlib.contextmanager
    def locked(self, durable: bool = False) -> Iterator[PopService]:
        """The current state under the cross-process lock; written back (if changed) before the lock goes."""
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                self._follow()  # the store's view first: state must never be clamped to an older view
                seen = self._stat()
                if self.pop is None or seen != self._seen:
                    self._reload()
                pop = self.pop
                assert pop is not None
                yield pop
                self._write(pop, durable)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _reload(self) -> None:
        offsets = ConsumerOffsetManager(self.config_dir)
        if self.pop is None:
            self.pop = self._make_pop(offsets)
        else:
            self.pop.offsets = offsets
            self.pop.load(read_json_lenient(self.path) or {})
        self.pop.dirty = False
        self._seen = self._stat()

    def _write(self, pop: PopService, durable: bool) -> None:
        snap = pop.snapshot()
        if snap is not None:
            data = ('{"version":1,"queues":[' + ",".join(snap) + "]}").encode("utf-8")
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as fh:
                fh.write(data)
                if durable:
                    fh.flush()
                    os.fsync(fh.fileno())
            os.replace(tmp, self.path)
            if durable:
                fsync_dir(self.config_dir)
            self._seen = self._stat()
        now = time.monotonic()
        if pop.offsets.dirty and (durable or now - self._offsets_written >= OFFSETS_EVERY):
            self.write_offsets(pop)

    def write_offsets(self, pop: PopService) -> None:
        snap = pop.offsets.snapshot()
        if snap is not None:
            pop.offsets.write(snap)
        self._offsets_written = time.monotonic()

    def close(self) -> None:
        with self._thread_lock:
            if self._fd >= 0:
                if self.pop is not None and self.pop.offsets.dirty:
                    fcntl.flock(self._fd, fcntl.LOCK_EX)
                    try:
                        if self._stat() == self._seen:  # nobody moved on since: our offsets are current
                            self.write_offsets(self.pop)
                    finally:
                        fcntl.flock(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
                self._fd = -1
