"""Session 12's group commit wake chain (services/group_commit.py) attacked: a flush that fails while producers
of its chain time out, and a disk that stalls.  Whatever the interleaving, a SYNC_FLUSH put answered PUT_OK must
be in what the disk made durable (the sync shadow's crash image), byte for byte; nobody hangs."""

from __future__ import annotations

import errno
import os
import random
import threading
import time

import pytest
from helpers.powerloss import SyncShadow, crash_image, fd_path, mark_names_durable, rebooted

from rocketstore import MessageStore, StoreConfig, StoreError
from rocketstore.format.message import Message, PutMessageStatus

THREADS = 16


class FailingDisk:
    """The commitlog's fdatasync takes a random while; from the ``fail_at``-th on it fails with EIO (a disk gone
    bad stays bad: a later sync that succeeded would make the image more complete than the truth)."""

    def __init__(self, rng: random.Random, fail_at: int, stall: tuple[float, float]) -> None:
        self.rng = rng
        self.fail_at = fail_at
        self.stall = stall
        self.calls = 0
        self.failed = threading.Event()
        self._lock = threading.Lock()
        self._real = os.fdatasync

    def __call__(self, fd: int) -> None:
        if "/commitlog/" not in fd_path(fd):
            return self._real(fd)
        with self._lock:
            self.calls += 1
            n = self.calls
            pause = self.rng.uniform(*self.stall)
        time.sleep(pause)
        if n >= self.fail_at:
            self.failed.set()
            raise OSError(errno.EIO, "Input/output error (test)")
        self._real(fd)


def _body(i: int, k: int) -> bytes:
    return b"p%02d-k%05d-" % (i, k) + bytes([65 + i]) * (100 + 37 * i)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_sync_put_is_acknowledged_past_a_flush_that_failed_while_its_chain_timed_out(tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    live, shadow, image = tmp_path / "live", tmp_path / "shadow", tmp_path / "image"
    # syncFlushTimeout below the stall: members of wake chains time out while the flush they wait on runs
    cfg = StoreConfig(flushDiskType="SYNC_FLUSH", syncFlushTimeout=20, mappedFileSizeCommitLog=64 * 1024,
                      warmAheadBytes=0, maxHashSlotNum=256, maxIndexNum=1024)
    disk = FailingDisk(rng, fail_at=rng.randint(4, 12), stall=(0.002, 0.035))
    monkeypatch.setattr(os, "fdatasync", disk)  # under the shadow: a failed sync is not recorded as durable
    acked: list[tuple[int, int, int, int]] = []
    answers: dict[str, int] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []
    with SyncShadow(live, shadow):
        store = MessageStore.open(str(live), cfg)
        mark_names_durable(live, shadow)

        def produce(i: int) -> None:
            try:
                for k in range(400):
                    r = store.put(Message("GC", _body(i, k), queue_id=i % 3))
                    with lock:
                        answers[r.status.name] = answers.get(r.status.name, 0) + 1
                        if r.status is PutMessageStatus.PUT_OK:
                            acked.append((i, k, r.commit_log_offset, r.queue_offset))
                    if disk.failed.is_set() and r.status is not PutMessageStatus.PUT_OK:
                        return
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)
        ts = [threading.Thread(target=produce, args=(i,)) for i in range(THREADS)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not any(t.is_alive() for t in ts), "a producer hangs"
        assert not errors, errors[0]
        assert disk.failed.is_set(), "the flush never failed: the attack did not happen"
        crash_image(live, shadow, image)
        store.close()
    assert answers.get("FLUSH_DISK_TIMEOUT"), f"no chain member timed out: {answers}"
    assert acked, answers
    rebooted(image)
    with MessageStore.open(str(image), StoreConfig(flushDiskType="SYNC_FLUSH", mappedFileSizeCommitLog=64 * 1024,
                                                   maxHashSlotNum=256, maxIndexNum=1024)) as again:
        for i, k, off, qoff in acked:
            try:
                m = again.look(off)
            except StoreError as e:
                raise AssertionError(f"put {i}/{k} answered PUT_OK at {off} is not durable: {e} ({answers})") from None
            assert m is not None and m.body == _body(i, k) and m.queue_offset == qoff, \
                f"put {i}/{k} answered PUT_OK at {off} is not durable ({answers})"
