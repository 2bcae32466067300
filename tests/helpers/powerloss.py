"""A power-loss model of the disk: each file as of its last successful sync, never-synced files zero-filled.

``SyncShadow`` intercepts every way the store makes bytes durable (``os.fsync``,
``os.fdatasync``, ``rocketstore.storage.mapped_file.fdatasync`` and the index's
``mmap.flush``).  At each sync of a file under the store root it reads the file's
bytes *before* the real call and, once the call has succeeded, stores them under
the shadow directory (temp file + rename, so a SIGKILL never leaves a torn copy).
Bytes written before a sync began are durable after it; bytes written while it ran
may or may not be, and the model takes the pessimistic answer.

A shadow copy stands for one file (an inode), not a name: a file's first sync tags
it with a token (an extended attribute; the inode number where the file system has
none, which a new file may reuse) and its copies are kept under that token.  The
tag moves with the file, so a file fsynced under a temp name and renamed is durable
as renamed, a name renamed over holds the new file, and a file deleted and made
again under the same name (a segment recovery truncated, then a new one at that
offset) has no synced bytes until it is synced itself; no kill between a rename
and any bookkeeping can make the model lose track.

``crash_image`` builds the directory a power cut would leave: every file the store
had, with its shadow bytes if it was ever synced, else zeros of its current length.
With ``dir_entries=True`` a name survives only if its directory was fsynced while
it held that name (each directory fsync under the root records the directory's
listing): a file whose data was synced but whose name never was is lost.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Callable

import rocketstore.storage.index as index_mod
from rocketstore import StoreConfig
import rocketstore.storage.mapped_file as mapped_file_mod

SHADOW_TMP = ".shadow-tmp"
BY_TAG = ".by-tag"  # in the shadow: one copy per tagged file, named by its token
TAG_XATTR = "user.rocketstore.shadow"
DIR_ENTRIES = ".dir-entries.json"  # in the shadow: directory (relative, "." the root) -> names its last fsync saw


QUIET_ENV = "ROCKETSTORE_POWERLOSS_QUIET"  # set: a quiet queue, and consume queues flushed by least pages


def quiet_mode() -> bool:
    return bool(os.environ.get(QUIET_ENV))


BOOT_ID = "/proc/sys/kernel/random/boot_id"


def rebooted(store: str | Path) -> None:
    """The power came back: the abort file says unclean, from another boot (MessageStore.process_crash_only is
    False, so recovery assumes pages may be lost)."""
    Path(store, "abort").write_text("4242")
    Path(store, "abort.bootid").write_text("boot-before-the-power-cut")


def lose_queue_units(store: str | Path, topic: str, queue_id: int, kept: int) -> None:
    """The power cut reached the queue's only file up to its first ``kept`` units: the rest reads as zeros."""
    (cq,) = Path(store, "consumequeue", topic, str(queue_id)).iterdir()
    data = bytearray(cq.read_bytes())
    data[kept * 20:] = bytes(len(data) - kept * 20)
    cq.write_bytes(bytes(data))


def process_crashed(store: str | Path) -> None:
    """The process died, the machine did not: the abort file is from this boot."""
    Path(store, "abort").write_text("4242")
    Path(store, "abort.bootid").write_text(Path(BOOT_ID).read_text())


def writer_config(seed: int) -> StoreConfig:
    """SYNC_FLUSH with a geometry small enough that commitlog segments, queue files and index files roll
    within a round; how often the consume queues are flushed varies with the round.  In quiet mode the
    queue files are larger and flushed only when two pages are dirty (RocketMQ's default), so a quiet
    queue's file is synced only by a thorough round."""
    if quiet_mode():
        return StoreConfig(mappedFileSizeCommitLog=32 * 1024, mappedFileSizeConsumeQueue=600 * 20, maxHashSlotNum=32,
                           maxIndexNum=128, flushDiskType="SYNC_FLUSH", warmAheadBytes=0,
                           flushIntervalConsumeQueue=(5, 50)[seed % 2], flushConsumeQueueLeastPages=2)
    return StoreConfig(mappedFileSizeCommitLog=32 * 1024, mappedFileSizeConsumeQueue=10 * 20, maxHashSlotNum=32,
                       maxIndexNum=128, flushDiskType="SYNC_FLUSH", warmAheadBytes=0,
                       flushIntervalConsumeQueue=(5, 50, 300, 1000)[seed % 4], flushConsumeQueueLeastPages=0)


def fd_path(fd: int) -> str:
    """The path an open file descriptor names ("" when the kernel cannot say): fdatasync fakes pick the
    commitlog's calls by it."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


class SyncShadow:
    """While installed, every successful sync of a file under ``root`` copies it to ``shadow``."""

    def __init__(self, root: str | Path, shadow: str | Path) -> None:
        self.root = os.path.realpath(root)
        self.shadow = str(shadow)
        self._lock = threading.Lock()  # syncs of one file commit in call order
        self._saved: list[tuple[object, str, object]] = []
        self.synced: dict[str, int] = {}  # relative path -> number of syncs recorded
        # Called with the file's relative path once a sync of it is recorded (a test cuts the power there).
        self.after_sync: Callable[[str], None] | None = None

    # ------------------------------------------------------------ install
    def install(self) -> "SyncShadow":
        real_fsync, real_fdatasync = os.fsync, os.fdatasync
        real_index_flush = index_mod.IndexFile.flush
        self._patch(os, "fsync", lambda fd: self._sync_fd(fd, real_fsync))
        self._patch(os, "fdatasync", lambda fd: self._sync_fd(fd, real_fdatasync))
        self._patch(mapped_file_mod, "fdatasync", lambda fd: self._sync_fd(fd, real_fdatasync))

        def index_flush(f: index_mod.IndexFile) -> None:  # mmap.flush is msync: the map's pages become durable
            self._sync_path(f.path, lambda: real_index_flush(f))
        self._patch(index_mod.IndexFile, "flush", index_flush)
        return self

    def uninstall(self) -> None:
        for obj, name, value in reversed(self._saved):
            setattr(obj, name, value)
        self._saved.clear()

    def __enter__(self) -> "SyncShadow":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _patch(self, obj: object, name: str, value: object) -> None:
        self._saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    # ------------------------------------------------------------ syncing
    def _sync_fd(self, fd: int, real: Callable[[int], None]) -> None:
        self._sync_path(fd_path(fd), lambda: real(fd), fd=fd)

    def _sync_path(self, path: str, real: Callable[[], None], fd: int | None = None) -> None:
        rel = self._relative(path)
        if rel is None:
            real()
            if self._is_store_dir(path):
                self._record_entries(path)
            return
        with self._lock:
            src = f"/proc/self/fd/{fd}" if fd is not None else path
            with open(src, "rb") as fh:  # reopened: the store's fd may be write-only
                tag = _tag(fh.fileno())
                data = fh.read()
            real()  # raises on failure: then nothing is recorded as durable
            _write_copy(self.shadow, tag, data)
            self.synced[rel] = self.synced.get(rel, 0) + 1
        if self.after_sync is not None:
            self.after_sync(rel)

    def seed(self) -> None:
        """Every file now under the root counts as synced (a disk after a reboot); under the lock, so that a sync
        a live store's thread makes meanwhile is recorded before or after, never overwritten with older bytes."""
        with self._lock:
            seed_shadow_files(self.root, self.shadow)

    def _is_store_dir(self, path: str) -> bool:
        return (path == self.root or path.startswith(self.root + os.sep)) and os.path.isdir(path)

    def _record_entries(self, path: str) -> None:
        """A directory fsync made its current names durable: record them (read after the real call)."""
        with self._lock:
            rel = os.path.relpath(path, self.root)
            dest = os.path.join(self.shadow, DIR_ENTRIES)
            entries = {}
            if os.path.exists(dest):
                with open(dest, encoding="utf-8") as fh:
                    entries = json.load(fh)
            entries[rel] = sorted(os.listdir(path))
            os.makedirs(self.shadow, exist_ok=True)
            with open(dest + SHADOW_TMP, "w", encoding="utf-8") as fh:
                json.dump(entries, fh)
            os.replace(dest + SHADOW_TMP, dest)

    def _relative(self, path: str) -> str | None:
        """The path under the store root of a regular file, or None (directories, other files)."""
        if not path.startswith(self.root + os.sep) or path.endswith(" (deleted)") or not os.path.isfile(path):
            return None
        return os.path.relpath(path, self.root)


def _tag(fd: int) -> str:
    """The open file's token (given at its first sync, kept for its life): its identity for its shadow copy."""
    try:
        return os.getxattr(fd, TAG_XATTR).decode()
    except OSError:
        pass
    token = uuid.uuid4().hex
    try:
        os.setxattr(fd, TAG_XATTR, token.encode())
    except OSError:  # no extended attributes here: the inode number alone
        token = f"ino{os.fstat(fd).st_ino}"
    return token


def _tag_of(path: str | Path) -> str | None:
    try:
        return os.getxattr(path, TAG_XATTR).decode()
    except OSError:
        try:
            return f"ino{os.stat(path).st_ino}"
        except OSError:
            return None


def _write_copy(shadow: str | Path, tag: str, data: bytes) -> None:
    """Store the synced bytes of the file tagged ``tag`` (temp file + rename: a kill leaves the last copy)."""
    dest = os.path.join(shadow, BY_TAG, tag)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(dest + SHADOW_TMP, "wb") as out:
        out.write(data)
    os.replace(dest + SHADOW_TMP, dest)


def synced_copy(live: str | Path, shadow: str | Path, rel: str | Path) -> Path | None:
    """The shadow copy of the live file ``rel`` (its bytes at its last sync), or None when this very file was
    never synced (an earlier file of that name may have been: deleted since and made again)."""
    tag = _tag_of(Path(live, rel))
    copy = Path(shadow, BY_TAG, tag) if tag else None
    return copy if copy is not None and copy.is_file() else None


def seed_shadow_files(live: str | Path, shadow: str | Path) -> None:
    """Before a power-loss run: every file now in ``live`` counts as synced (a disk after a reboot)."""
    for d, _dirs, files in os.walk(live):
        for name in files:
            seed_file(Path(d, name), shadow)


def seed_file(src: str | Path, shadow: str | Path) -> None:
    """The file ``src`` counts as synced as it is now (an operator's file, a disk after a reboot)."""
    try:
        fd = os.open(src, os.O_RDONLY)
    except FileNotFoundError:
        return  # a temp file renamed away meanwhile (a live store's thread): its new name is seen or not
    try:
        tag = _tag(fd)
        data = os.pread(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)
    _write_copy(shadow, tag, data)


def mirror_edit(live_file: str | Path, shadow: str | Path, before: bytes) -> None:
    """An edit of ``live_file`` that stands for the disk's own action (a flipped bit, a misdirected write, a cut):
    the same bytes change in its synced copy, which keeps everything else it had.  ``before`` is the file's
    content before the edit; bytes the edit left alone stay as durable (or not) as they were, so an edit never
    makes the unsynced bytes around it durable.  A file never synced has no copy: nothing to change."""
    copy = synced_copy(os.path.dirname(live_file), shadow, os.path.basename(live_file))
    if copy is None:
        return
    after = Path(live_file).read_bytes()
    data = bytearray(copy.read_bytes())
    if len(after) < len(data):
        del data[len(after):]  # cut: the disk's copy is cut too
    elif len(after) > len(before) and len(data) >= len(before):
        data.extend(after[len(data):])  # extended (with zeros) past what the copy held
    block = 512
    for pos in range(0, min(len(before), len(after), len(data)), block):
        if before[pos:pos + block] != after[pos:pos + block]:
            for i in range(pos, min(pos + block, len(before), len(after), len(data))):
                if before[i] != after[i]:
                    data[i] = after[i]
    _write_copy(shadow, _tag_of(live_file), bytes(data))


def mark_names_durable(root: str | Path, shadow: str | Path) -> None:
    """Record every name under ``root`` as durable (a disk restored from an image after a reboot)."""
    root = Path(root)
    entries = {os.path.relpath(d, root): sorted(dirs + files) for d, dirs, files in os.walk(root)}
    os.makedirs(shadow, exist_ok=True)
    with open(Path(shadow) / DIR_ENTRIES, "w", encoding="utf-8") as fh:
        json.dump(entries, fh)


def crash_image(live: str | Path, shadow: str | Path, dest: str | Path, *, dir_entries: bool = False) -> dict[str, str]:
    """Build the post-power-loss copy of ``live`` in ``dest``; returns each file's fate ("synced"/"zeroed", and
    with ``dir_entries`` "name lost" for a file whose name, or a directory's on its path, was never synced)."""
    live, shadow, dest = Path(live), Path(shadow), Path(dest)
    fate = {}
    durable: dict[str, list[str]] = {}
    if dir_entries and (shadow / DIR_ENTRIES).is_file():
        durable = json.loads((shadow / DIR_ENTRIES).read_text(encoding="utf-8"))
    for d, _dirs, files in os.walk(live):
        if not dir_entries:  # every name is durable: an empty directory too (a queue whose files recovery cut)
            (dest / Path(d).relative_to(live)).mkdir(parents=True, exist_ok=True)
        for name in files:
            src = Path(d) / name
            rel = src.relative_to(live)
            if dir_entries and not _name_durable(rel, durable):
                fate[str(rel)] = "name lost"
                continue
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            synced = synced_copy(live, shadow, rel)
            if synced is not None:
                shutil.copyfile(synced, out)
                fate[str(rel)] = "synced"
            else:
                try:
                    size = src.stat().st_size
                except FileNotFoundError:
                    continue
                with open(out, "wb") as fh:
                    fh.truncate(size)
                fate[str(rel)] = "zeroed"
    return fate


def _name_durable(rel: Path, durable: dict[str, list[str]]) -> bool:
    """Whether every name on the path ``rel`` was in its directory's listing at that directory's last fsync."""
    parent = "."
    for part in rel.parts:
        if part not in durable.get(parent, ()):
            return False
        parent = part if parent == "." else os.path.join(parent, part)
    return True
