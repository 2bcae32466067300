"""A cross-process doorbell: receivers waiting for messages sleep on a Unix datagram socket; the writer rings.

Each waiting :class:`~rocketstore.queues.simple_consumer.SimpleConsumer` binds one socket in the store's
bell directory (``$TMPDIR/rocketstore-bell-<uid>/<hash of the store's real path>/``: a socket path must stay
under ~100 bytes, a store path need not).  The writer's dispatcher calls :meth:`Doorbell.ring` after each
round that made messages readable; a ring costs one ``stat`` when nobody waits, and a ``sendto`` per waiter
otherwise.  A lost ring only delays a receiver to its next safety wake-up (``MAX_SLEEP``): rings are hints.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import logging
import os
import select
import socket
import tempfile
import threading
import time

log = logging.getLogger(__name__)

MAX_SLEEP = 1.0  # a waiter looks again at least this often, even without a ring
_names = itertools.count()
RELIST_NS = 50_000_000


def bell_dir(root: str, channel: str = "") -> str:
    """The store's bell directory; ``channel`` names another bell of the same store (e.g. REVIVE)."""
    digest = hashlib.sha1(os.path.realpath(root).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"rocketstore-bell-{os.getuid()}", digest + channel)


class Doorbell:
    """The ringing side (a writer's dispatcher, or a receiver whose ack/nack made a message visible)."""

    def __init__(self, root: str, channel: str = "") -> None:
        self.dir = bell_dir(root, channel)
        self._seen: tuple[int, int] | None = None
        self._waiters: list[str] = []
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def ring(self) -> None:
        try:
            st = os.stat(self.dir)
        except OSError:
            return  # nobody ever waited on this store
        key = (st.st_ino, st.st_mtime_ns)
        # Directory times are coarse (a clock tick): a socket bound in the tick of our last listing
        # leaves the time unchanged, so a directory changed in the last moments is listed again.
        fresh = time.time_ns() - st.st_mtime_ns < RELIST_NS
        if key == self._seen and not self._waiters and not fresh:
            return
        with self._lock:
            if key != self._seen or fresh:
                self._seen = key
                try:
                    self._waiters = [os.path.join(self.dir, n) for n in os.listdir(self.dir) if n.endswith(".sock")]
                except OSError:
                    self._waiters = []
            if not self._waiters:
                return
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            for path in self._waiters:
                try:
                    self._sock.sendto(b"!", path)
                except BlockingIOError:
                    pass  # its queue is full: it has rings enough to wake
                except OSError as e:
                    if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
                        _unlink_quietly(path)  # its owner died without closing: a stale socket

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


class Waiter:
    """The receiving side: one bound socket; :meth:`wait` sleeps until a ring or the timeout."""

    def __init__(self, root: str, channel: str = "") -> None:
        self.dir = bell_dir(root, channel)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self.path = os.path.join(self.dir, f"{os.getpid()}-{next(_names)}.sock")
        _unlink_quietly(self.path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setblocking(False)

    def drain(self) -> None:
        try:
            while self.sock.recv(64):
                pass
        except (BlockingIOError, OSError):
            pass

    def wait(self, timeout: float) -> bool:
        """True when rung within ``timeout`` seconds (at most MAX_SLEEP)."""
        ready, _, _ = select.select([self.sock], [], [], max(0.0, min(timeout, MAX_SLEEP)))
        if ready:
            self.drain()
        return bool(ready)

    def wake(self) -> None:
        """Ring this waiter only (from its own process: a service shutting down)."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(b"!", self.path)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        _unlink_quietly(self.path)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
