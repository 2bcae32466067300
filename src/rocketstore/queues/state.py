"""The pop state of a store shared by processes: ``config/popState.json`` plus its journal, under an ``flock``.

Every operation of a :class:`~rocketstore.queues.simple_consumer.SimpleConsumer` runs inside
:meth:`SharedPopState.locked`: extend a read-only store's view to what the writer appended (before the lock),
take ``config/popState.lock`` (an flock: the OS releases it when the process
dies, so a SIGKILL never leaves it held), catch up with what other processes did (a new popState.json:
load it all; else the journal records appended since we last looked, each queue's last one, taken as
written), run the operation on the
in-memory :class:`~rocketstore.queues.pop.PopService`, append the records of the queues it changed to
``config/popState.journal`` (see :mod:`rocketstore.queues.journal`), and release the lock.  When the
journal passes COMPACT_BYTES, popState.json is written again (temporary file, fsync, rename) with a new id
and the journal starts over; a crash between the two leaves a journal naming the old id: ignored, and
everything in it is in the new file.

Durability: an append is in the page cache when ``locked()`` returns, so it survives the process being
killed (SIGKILL) at any point after.  ``durable=True`` (``ackSyncFlush``) also fsyncs the journal, so
the change survives a power loss.  ``consumerOffset.json`` (RocketMQ's committed offsets, read by
RocketMQ and by the offset-only Consumer) follows at most every OFFSETS_EVERY seconds and at close; it may
lag, which only lowers the floor popState's committed offsets are clamped to.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import StoreLockedError
from ..storage.consumer_offsets import ConsumerOffsetManager, read_json_lenient
from ..storage.jsonfile import fsync_dir
from . import journal
from .pop import PopService, state_document

log = logging.getLogger(__name__)
OFFSETS_EVERY = 1.0
COMPACT_BYTES = 4 << 20
OWNER_FILE = "popState.owner"


def claim_pop_state(config_dir: str, *, exclusive: bool) -> int:
    """Hold ``config/popState.owner`` for as long as the returned descriptor is open.

    The broker keeps the pop state in memory and writes whole snapshots, so it must never run beside
    library receivers that journal theirs: the broker holds the owner file exclusively, every library
    receiver holds it shared.  Whoever comes second is refused here, naming the other side (never a hang:
    both attempts are non-blocking); the OS drops the hold when the process dies.
    """
    os.makedirs(config_dir, exist_ok=True)
    path = os.path.join(config_dir, OWNER_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
        os.close(fd)
        if exclusive:
            raise StoreLockedError(f"{path}: SimpleConsumer receivers in other processes use this store's pop state; "
                                   "stop them before serving the store with a broker") from None
        raise StoreLockedError(f"{path}: a broker ({holder or 'pid unknown'}) serves this store and owns its pop "
                               "state; receive through the broker, or stop it first") from None
    if exclusive:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"broker pid {os.getpid()}".encode("ascii"), 0)
    return fd


def write_clamped_state(store: Any, config_dir: str) -> None:
    """At a writable open, before a put is taken: write the pop state clamped to the queues' ends.

    A power cut can take the log's unflushed tail (ASYNC_FLUSH) while acks of those messages survive in the
    fsynced journal (ackSyncFlush), or an operator cuts the log.  The group's state then reaches past the end of
    the queue, and the next puts are given those queue offsets again.  A writable store clamps such a state
    when it loads it, but a read-only receiver cannot tell a lost tail from its own view lagging behind, keeps
    it, and skips the new messages; so the writer writes the clamped state (journal, fsynced; consumerOffset.json)
    before anything is put."""
    state_path = os.path.join(config_dir, "popState.json")
    # (consumerOffset.json too: a group's queue state is built from its committed offset when neither popState.json
    # nor the journal holds the queue, e.g. both lost with the log's tail, nothing fsynced without ackSyncFlush)
    pop_files = (state_path, journal.journal_path(state_path))
    if not any(os.path.exists(p) and os.path.getsize(p) for p in pop_files) and \
            not _committed_past_queue_end(store, config_dir):
        return  # (a store that never popped gets no pop-state files for nothing)
    try:
        state = SharedPopState(config_dir, lambda offsets: PopService(store, offsets, config_dir, load=False))
    except StoreLockedError:
        return  # a broker owns the pop state: it clamps what it loads and writes it itself
    try:
        with state.locked(durable=True) as pop:
            if pop.clamped:
                log.warning("%s: pop state of %d queue(s) reached past the queue end (a lost log tail); clamped",
                            config_dir, len(pop.clamped))
            else:
                pop.offsets.dirty = False  # nothing to clamp: an open rewrites no file
    finally:
        state.close()


def _committed_past_queue_end(store: Any, config_dir: str) -> bool:
    """Whether consumerOffset.json commits an offset past its queue's end (a lost log tail)."""
    if not os.path.exists(os.path.join(config_dir, "consumerOffset.json")):
        return False
    for key, queues in ConsumerOffsetManager(config_dir).table.items():
        topic = key.split("@", 1)[0]
        for qid, offset in queues.items():
            if offset > store.max_offset_in_queue(topic, qid):
                return True
    return False


class SharedPopState:
    """One process's handle on a store's pop state; thread-safe."""

    def __init__(self, config_dir: str, make_pop: Callable[[ConsumerOffsetManager], PopService],
                 follow: Callable[[], Any] | None = None) -> None:
        os.makedirs(config_dir, exist_ok=True)
        self._owner_fd = claim_pop_state(config_dir, exclusive=False)  # refused while a broker owns the state
        self.config_dir = config_dir
        self.path = os.path.join(config_dir, "popState.json")
        self._lock_fd = os.open(os.path.join(config_dir, "popState.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        self._journal_fd = os.open(journal.journal_path(self.path), os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self._thread_lock = threading.RLock()
        self._make_pop = make_pop
        self._follow = follow or (lambda: None)
        self._base: tuple[int, int] | None = None  # popState.json's (inode, mtime) as we loaded it
        self._base_id = ""
        self._pos = 0  # journal bytes applied (complete lines)
        self._journal_ok = False  # its header names our base
        self._offsets_written = 0.0
        self.pop: PopService | None = None

    def _stat_base(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns

    @contextlib.contextmanager
    def locked(self, durable: bool = False) -> Iterator[PopService]:
        """The current state under the cross-process lock; its changes journaled before the lock goes."""
        with self._thread_lock:
            # The store's view first, before the lock (the bulk of it: checking what the writer appended runs
            # beside the other receivers' lock sections).  Journal records are applied as written, never
            # clamped to this view; a reload of popState.json is, so it extends the view again under the lock.
            self._follow()
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                try:
                    self._catch_up()
                    pop = self.pop
                    assert pop is not None
                    yield pop
                    self._append(pop, durable)
                except BaseException:
                    # What the failed operation (or a load cut short) changed was not journaled: forgotten, so
                    # that neither close() (consumerOffset.json), nor a later operation, nor a compaction writes
                    # it; the next operation reads the files again.
                    self.pop = None
                    raise
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _read_journal(self, start: int) -> bytes:
        size = os.fstat(self._journal_fd).st_size
        return os.pread(self._journal_fd, size - start, start) if size > start else b""

    def _catch_up(self) -> None:
        base = self._stat_base()
        size = os.fstat(self._journal_fd).st_size
        if self.pop is None or base != self._base or size < self._pos or (size > self._pos and not self._journal_ok):
            self._follow()  # state must never be clamped to an older view than the writers of the file had
            self._reload()  # a new popState.json, or a journal started again (for it) by another process
            return
        if size > self._pos:
            records, used, _ = journal.parse(self._read_journal(self._pos), self._base_id, False)
            self._pos += used
            self.pop.apply(records)

    def _reload(self) -> None:
        self._base = self._stat_base()
        data = read_json_lenient(self.path) or {}
        if not isinstance(data, dict):
            data = {}
        self._base_id = str(data.get("id", ""))
        records, self._pos, self._journal_ok = journal.parse(self._read_journal(0), self._base_id, True)
        offsets = ConsumerOffsetManager(self.config_dir)
        if self.pop is None:
            self.pop = self._make_pop(offsets)
        else:
            self.pop.offsets = offsets
        self.pop.load(data, records)
        self.pop.changed_keys.clear()
        self.pop.dirty = False
        if self.pop.clamped:  # records past the end of their queue (a lost log tail): journal the clamped state
            self.pop.changed_keys |= self.pop.clamped
            self.pop.dirty = True

    def _append(self, pop: PopService, durable: bool) -> None:
        texts = pop.changed_records()
        if texts:
            size = os.fstat(self._journal_fd).st_size
            if not self._journal_ok or size != self._pos:
                # A stale journal (another base), or a line cut short by a crash: start it again / cut it off.
                os.ftruncate(self._journal_fd, 0 if not self._journal_ok else self._pos)
                if not self._journal_ok:
                    os.write(self._journal_fd, journal.header(self._base_id))
                    self._journal_ok = True
            data = ("\n".join(texts) + "\n").encode("utf-8")
            os.write(self._journal_fd, data)
            self._pos = os.fstat(self._journal_fd).st_size
            if durable:
                os.fsync(self._journal_fd)
            if self._pos > COMPACT_BYTES:
                self._compact(pop)
        pop.dirty = False
        now = time.monotonic()
        if pop.offsets.dirty and (durable or now - self._offsets_written >= OFFSETS_EVERY):
            self.write_offsets(pop)

    def _compact(self, pop: PopService) -> None:
        """popState.json from the whole state (new id), then an empty journal continuing it."""
        pop.dirty = True
        snap = pop.snapshot() or []
        self._base_id = os.urandom(8).hex()
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(state_document(snap, self._base_id))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.config_dir)
        self._base = self._stat_base()
        os.ftruncate(self._journal_fd, 0)
        os.write(self._journal_fd, journal.header(self._base_id))
        self._pos = os.fstat(self._journal_fd).st_size
        self._journal_ok = True

    def write_offsets(self, pop: PopService) -> None:
        snap = pop.offsets.snapshot()
        if snap is not None:
            pop.offsets.write(snap)
        self._offsets_written = time.monotonic()

    def close(self) -> None:
        with self._thread_lock:
            if self._lock_fd < 0:
                return
            if self.pop is not None and self.pop.offsets.dirty:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
                try:
                    self._catch_up()
                    self.write_offsets(self.pop)
                finally:
                    fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            os.close(self._journal_fd)
            os.close(self._owner_fd)
            self._lock_fd = self._journal_fd = self._owner_fd = -1
