"""WarmAheadService: the commitlog's next pages are put into the page cache before the writer reaches them,
without changing a byte of any file."""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import time
from pathlib import Path

import pytest

from rocketstore import ConfigError, Message, MessageStore, StoreConfig

KiB, MiB = 1024, 1024 * 1024
PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident(path: Path, start: int, length: int) -> float:
    """The share of the pages of [start, start + length) that are in the page cache (mincore(2) over a mapping of
    our own, which reports the page cache of a file whether or not any process has the pages mapped)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
    finally:
        os.close(fd)
    try:
        pages = (length + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * pages)()
        if _libc.mincore(addr, length, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return sum(b & 1 for b in vec) / pages
    finally:
        _libc.munmap(addr, length)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _wait(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_pages_ahead_of_the_writer_are_cached_and_no_byte_changes(tmp_path):
    cfg = StoreConfig(mappedFileSizeCommitLog=8 * MiB, warmAheadBytes=1 * MiB)
    root = tmp_path / "s"
    with MessageStore.open(str(root), cfg) as store:
        warmer = store.commitlog.warmer
        assert warmer is not None
        seg = root / "commitlog" / f"{0:020d}"
        assert _wait(seg.exists)
        # A new segment has its blocks reserved but none of its pages cached, and nothing is read before a put.
        assert resident(seg, 0, 4 * MiB) < 0.1
        r = store.put(Message("T", b"x" * 1000))
        assert r.ok
        assert _wait(lambda: warmer.warmed >= r.commit_log_offset + r.wrote_bytes + 1 * MiB)
        assert resident(seg, PAGE, 1 * MiB - PAGE) == 1.0
        # The writer wakes it again whenever it has used half the window: at least half stays ahead of it.
        for _ in range(3000):
            assert store.put(Message("T", b"y" * 1000)).ok
        end = store.max_phy_offset()
        assert end > 3 * MiB
        assert _wait(lambda: warmer.warmed >= end + 512 * KiB)
        assert resident(seg, end - end % PAGE + PAGE, 512 * KiB - PAGE) == 1.0
        store.wait_dispatched()
        before = _digest(seg)
        time.sleep(0.05)
        assert _digest(seg) == before  # reading ahead never writes
        assert bytes(seg.read_bytes()[end:end + 2 * MiB]) == bytes(2 * MiB)
    with MessageStore.open(str(root), read_only=True) as ro:
        assert [m.body for m in ro.get("T", 0, 0, 3).messages] == [b"x" * 1000, b"y" * 1000, b"y" * 1000]


def test_window_runs_into_the_preallocated_next_segment(tmp_path):
    cfg = StoreConfig(mappedFileSizeCommitLog=1 * MiB, warmAheadBytes=512 * KiB)
    root = tmp_path / "s"
    with MessageStore.open(str(root), cfg) as store:
        warmer = store.commitlog.warmer
        body = b"z" * 4000
        while store.max_phy_offset() < 900 * KiB:
            assert store.put(Message("T", body)).ok
        nxt = root / "commitlog" / f"{1 * MiB:020d}"
        assert _wait(lambda: warmer.warmed >= store.max_phy_offset() + 256 * KiB), \
            (warmer.warmed, warmer.wake_at, store.max_phy_offset())
        assert nxt.exists() and resident(nxt, 0, 128 * KiB) == 1.0
        while store.max_phy_offset() < 1 * MiB + 100 * KiB:  # the writer moves on into that segment
            assert store.put(Message("T", body)).ok
        store.wait_dispatched()
        bodies = [m.body for _off, _size, m, _why in store.messages()]
        assert len(bodies) == store.max_offset_in_queue("T", 0) and set(bodies) == {body}


def test_off_when_zero_and_refused_when_negative(tmp_path):
    with MessageStore.open(str(tmp_path / "s"), StoreConfig(mappedFileSizeCommitLog=1 * MiB, warmAheadBytes=0)) as s:
        assert s.commitlog.warmer is None
        assert s.put(Message("T", b"a")).ok
    with pytest.raises(ConfigError, match="warmAheadBytes=-1"):
        StoreConfig(warmAheadBytes=-1)


def test_a_preallocated_segment_discarded_while_it_is_read_is_deleted(tmp_path, monkeypatch):
    """The warmer reads through a descriptor of its own: a pre-allocated segment discarded in the middle of a read
    is deleted at once (a reference held by the reader used to keep it on disk, to be reused later unallocated)."""
    import threading

    from rocketstore.services import warm_ahead
    reading, release = threading.Event(), threading.Event()
    real = os.preadv

    def slow(fd, buffers, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(f"{64 * KiB:020d}"):
            reading.set()
            release.wait(10)
        return real(fd, buffers, offset)
    monkeypatch.setattr(warm_ahead.os, "preadv", slow)
    cfg = StoreConfig(mappedFileSizeCommitLog=64 * KiB, warmAheadBytes=1 * MiB)
    root = tmp_path / "s"
    with MessageStore.open(str(root), cfg) as store:
        assert store.put(Message("T", b"x" * 100)).ok
        assert reading.wait(10)  # the warmer is inside a read of the next segment
        store.commitlog.queue.discard_preallocated()
        assert not (root / "commitlog" / f"{64 * KiB:020d}").exists()
        release.set()
