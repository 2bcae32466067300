"""The group commit's put path (services/group_commit.py; the lone-producer path of merge c6aab23) attacked:
a second producer arriving while the lone one's fdatasync fails; a store opened without services; a mix of
SYNC puts, WAIT=false puts and batches from producers that come and go, cut by power losses while they run.

Linux reports a writeback error to one fdatasync and marks the pages clean: the next fdatasync of the same file
succeeds although the bytes the failed one was to write may never reach the disk.  A flush after a failed one
therefore proves nothing about the log before it: a SYNC_FLUSH put written after the failure and answered PUT_OK
would sit, after a power cut, behind a hole where the failed put's bytes were, and recovery ends the log there.
So once a flush has failed no SYNC_FLUSH put is acknowledged as durable."""

from __future__ import annotations

import errno
import os
import random
import threading
import time

from helpers.powerloss import SyncShadow, crash_image, fd_path, mark_names_durable, rebooted

import rocketstore.storage.mapped_file as mapped_file_mod
from rocketstore import MessageStore, StoreConfig
from rocketstore.format.message import Message, PutMessageStatus


class FailsOnce:
    """The commitlog's first fdatasync waits for the test's go, then fails with EIO; every later one succeeds
    (the kernel reported the error once)."""

    def __init__(self, real) -> None:
        self.real = real
        self.entered = threading.Event()
        self.go = threading.Event()
        self.calls = 0

    def __call__(self, fd: int) -> None:
        if "/commitlog/" not in fd_path(fd):
            return self.real(fd)
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            assert self.go.wait(10)
            raise OSError(errno.EIO, "Input/output error (test)")
        return self.real(fd)


def _put(store: MessageStore, body: bytes, out: dict, key: str) -> None:
    out[key] = store.put(Message("GC", body))


def test_a_put_written_after_a_failed_flush_is_not_acknowledged_by_the_next_flush(tmp_path, monkeypatch):
    disk = FailsOnce(mapped_file_mod.fdatasync)
    monkeypatch.setattr(mapped_file_mod, "fdatasync", disk)
    store = MessageStore.open(str(tmp_path / "s"), StoreConfig(flushDiskType="SYNC_FLUSH", syncFlushTimeout=5000,
                                                              mappedFileSizeCommitLog=64 * 1024, warmAheadBytes=0))
    try:
        answers: dict = {}
        lone = threading.Thread(target=_put, args=(store, b"A" * 5000, answers, "a"))
        lone.start()  # alone: writes its put and flushes it in its own thread
        assert disk.entered.wait(10)
        second = threading.Thread(target=_put, args=(store, b"B" * 5000, answers, "b"))
        second.start()  # store still writeable: publishes its put and waits for the writer
        deadline = time.monotonic() + 10
        while not store.commit._pending and time.monotonic() < deadline:
            time.sleep(0.001)
        assert store.commit._pending, "the second producer never waited for the writer"
        disk.go.set()  # the lone producer's flush fails now
        lone.join(10)
        second.join(10)
        assert not lone.is_alive() and not second.is_alive()
        a, b = answers["a"], answers["b"]
        assert a.status is not PutMessageStatus.PUT_OK
        assert store.running_flags.why_not_writeable() is not None
        # The second put, if it was written at all, came after the failed one's bytes: a later fdatasync that
        # succeeds does not make those durable, so it must not be acknowledged as durable either.
        assert b.status is not PutMessageStatus.PUT_OK, (b.status, b.commit_log_offset, a.commit_log_offset)
    finally:
        store.close()


class Spy:
    """Counts the commitlog's fdatasync calls."""

    def __init__(self, real) -> None:
        self.real = real
        self.commitlog = 0

    def __call__(self, fd: int) -> None:
        if "/commitlog/" in os.readlink(f"/proc/self/fd/{fd}"):
            self.commitlog += 1
        return self.real(fd)


def test_a_store_without_services_acknowledges_a_sync_put_only_once_flushed(tmp_path, monkeypatch):
    """MessageStore.open(..., start_services=False) made no GroupCommitService and its put path then never
    flushed: a SYNC_FLUSH put was answered PUT_OK with no fdatasync at all, and close() did not flush the log
    either before saying clean."""
    spy = Spy(mapped_file_mod.fdatasync)
    monkeypatch.setattr(mapped_file_mod, "fdatasync", spy)
    cfg = StoreConfig(flushDiskType="SYNC_FLUSH", mappedFileSizeCommitLog=64 * 1024, warmAheadBytes=0)
    store = MessageStore.open(str(tmp_path / "s"), cfg, start_services=False)
    try:
        for i in range(3):
            before = spy.commitlog
            r = store.put(Message("GC", b"x" * 100))
            assert r.status is PutMessageStatus.PUT_OK
            assert spy.commitlog > before, "PUT_OK without an fdatasync of the commitlog"
            assert store.commitlog.queue.flushed_where >= r.commit_log_offset + r.wrote_bytes
        r = store.put_batch([Message("GC", b"y"), Message("GC", b"z")])
        assert r.status is PutMessageStatus.PUT_OK
        assert store.commitlog.queue.flushed_where >= r.commit_log_offset + r.wrote_bytes
    finally:
        store.close()


def test_an_async_store_without_services_flushes_its_log_at_close(tmp_path, monkeypatch):
    spy = Spy(mapped_file_mod.fdatasync)
    monkeypatch.setattr(mapped_file_mod, "fdatasync", spy)
    cfg = StoreConfig(flushDiskType="ASYNC_FLUSH", mappedFileSizeCommitLog=64 * 1024, warmAheadBytes=0)
    store = MessageStore.open(str(tmp_path / "s"), cfg, start_services=False)
    r = store.put(Message("GC", b"x" * 100))
    assert r.status is PutMessageStatus.PUT_OK
    store.close()
    assert spy.commitlog >= 1
    assert store.commitlog.queue.flushed_where >= r.commit_log_offset + r.wrote_bytes


def _mixed_body(i: int, k: int) -> bytes:
    return b"m%d-%05d-" % (i, k) + bytes([97 + i]) * (60 + 53 * i)


def test_sync_puts_mixed_with_wait_false_puts_and_batches_are_durable_when_acknowledged(tmp_path, monkeypatch):
    """The lone-producer path under a mix: producers that come and go (each pausing between puts, so a put is
    often alone and a second arrives while the lone one flushes), WAIT=false puts (answered written, flushed
    later by the service) and batches, over a disk whose fdatasync takes a random while.  Every put that waited
    and was answered PUT_OK is in the sync shadow's power-loss image byte for byte."""
    rng = random.Random(15)
    real = os.fdatasync

    def slow(fd: int) -> None:
        time.sleep(rng.uniform(0, 0.004))
        real(fd)

    live, shadow = tmp_path / "live", tmp_path / "shadow"
    cfg = StoreConfig(flushDiskType="SYNC_FLUSH", syncFlushTimeout=5000, mappedFileSizeCommitLog=32 * 1024,
                      warmAheadBytes=0, maxHashSlotNum=64, maxIndexNum=512)
    acked: list[tuple[int, int, int, bytes]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    monkeypatch.setattr(os, "fdatasync", slow)  # under the shadow, as in test_data_safety_group_commit.py
    with SyncShadow(live, shadow):
        store = MessageStore.open(str(live), cfg)
        mark_names_durable(live, shadow)

        def produce(i: int) -> None:
            prng = random.Random(i)
            try:
                for k in range(60):
                    kind = prng.random()
                    if kind < 0.2:
                        r = store.put(Message("MX", _mixed_body(i, k), queue_id=i % 2, properties={"WAIT": "false"}))
                        assert r.status is PutMessageStatus.PUT_OK, r
                        continue
                    if kind < 0.4:
                        msgs = [Message("MX", _mixed_body(i, k) + b"/%d" % j, queue_id=i % 2) for j in range(3)]
                        r = store.put_batch(msgs)
                        if r.status is PutMessageStatus.PUT_OK:
                            with lock:
                                acked.extend((i, k, off, m.body) for off, m in zip(r.offsets, msgs, strict=True))
                    else:
                        body = _mixed_body(i, k)
                        r = store.put(Message("MX", body, queue_id=i % 2))
                        if r.status is PutMessageStatus.PUT_OK:
                            with lock:
                                acked.append((i, k, r.commit_log_offset, body))
                    time.sleep(prng.uniform(0, 0.003))
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)

        ts = [threading.Thread(target=produce, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        cuts = []
        for n, pause in enumerate([0.04] + [0.025] * 9):  # power cuts while the producers run
            time.sleep(pause)
            with lock:
                answered = list(acked)  # answered before the cut began: durable in its image
            crash_image(live, shadow, tmp_path / f"image{n}")
            cuts.append((tmp_path / f"image{n}", answered))
        for t in ts:
            t.join(60)
        assert not any(t.is_alive() for t in ts), "a producer hangs"
        assert not errors, errors[0]
        store.close()
    assert len(acked) > 100 and len(cuts[0][1]) > 5
    for image, answered in cuts:
        rebooted(image)
        with MessageStore.open(str(image), cfg, start_services=False) as again:
            for i, k, off, body in answered:
                m = again.look(off)
                assert m is not None and m.body == body, f"put {i}/{k} answered PUT_OK at {off} is not durable"
