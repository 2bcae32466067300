"""Issue 29 point 1: the group commit groups.  Producers waiting at the same time are written with one gathered
write and made durable with one fdatasync; each put still gets its own offsets back, a put that cannot be
written fails alone, and an acknowledged SYNC_FLUSH put survives a power cut."""

from __future__ import annotations

import os
import threading
import time

import pytest
from helpers.powerloss import SyncShadow, crash_image, mark_names_durable, rebooted

import rocketstore.storage.mapped_file as mapped_file_mod
from rocketstore import MessageStore, StoreConfig
from rocketstore.format import codec
from rocketstore.format.message import Message, PutMessageStatus
from rocketstore.storage.commitlog import CommitLog

THREADS = 16


def _run_threads(n: int, target) -> list:
    """Run ``target(i)`` in ``n`` threads started together; their return values, by thread."""
    out: list = [None] * n
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def run(i: int) -> None:
        try:
            start.wait()
            out[i] = target(i)
        except BaseException as e:  # reported below
            errors.append(e)
    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors[0]
    return out


def _slow_disk(monkeypatch, seconds: float = 0.002) -> dict[str, int]:
    """fdatasync that takes ``seconds`` (a slow disk: producers pile up while a flush runs), and counts of the
    commitlog's fdatasync and pwritev calls."""
    counts = {"fdatasync": 0, "pwritev": 0}
    real_sync, real_pwritev = mapped_file_mod.fdatasync, os.pwritev

    def fdatasync(fd: int) -> None:
        if "/commitlog/" in os.readlink(f"/proc/self/fd/{fd}"):
            counts["fdatasync"] += 1
        time.sleep(seconds)
        real_sync(fd)

    def pwritev(fd: int, buffers, offset: int, *flags: int) -> int:
        if "/commitlog/" in os.readlink(f"/proc/self/fd/{fd}"):
            counts["pwritev"] += 1
        return real_pwritev(fd, buffers, offset, *flags)
    monkeypatch.setattr(mapped_file_mod, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "pwritev", pwritev)
    return counts


def _body(i: int, k: int) -> bytes:
    return b"producer-%02d-put-%04d-" % (i, k) + bytes([i]) * 300


def test_sixteen_sync_producers_each_read_back_their_own_message(tmp_path):
    """Every put's returned commitlog offset, queue offset and msgId lead to its own message; queue offsets of a
    shared queue are handed out once each, in commitlog order."""
    per = 40
    with MessageStore.open(str(tmp_path / "s"), StoreConfig(flushDiskType="SYNC_FLUSH")) as store:
        def produce(i: int) -> list:
            return [(k, store.put(Message("GC", _body(i, k), queue_id=i % 4, keys=f"k{i}-{k}")))
                    for k in range(per)]
        results = _run_threads(THREADS, produce)
        assert store.wait_dispatched(30)
        flushed = store.commitlog.queue.flushed_where
        seen_ids = set()
        by_queue: dict[int, list[tuple[int, int]]] = {}
        for i, puts in enumerate(results):
            for k, r in puts:
                assert r.status is PutMessageStatus.PUT_OK, r.error
                assert r.commit_log_offset + r.wrote_bytes <= flushed  # answered once durable
                m = store.look(r.commit_log_offset)
                assert m.body == _body(i, k) and m.queue_id == i % 4 and m.queue_offset == r.queue_offset
                got = store.get("GC", i % 4, r.queue_offset, 1).messages
                assert [x.body for x in got] == [_body(i, k)]
                assert r.msg_id == m.msg_id and r.msg_id not in seen_ids
                seen_ids.add(r.msg_id)
                by_queue.setdefault(i % 4, []).append((r.commit_log_offset, r.queue_offset))
        for q, pairs in by_queue.items():
            pairs.sort()
            assert [qo for _, qo in pairs] == list(range(len(pairs)))  # no gap, no duplicate, commit order
        assert store.query("GC", "k7-33").phy_offsets == [dict(results[7])[33].commit_log_offset]


def test_one_write_and_one_flush_cover_many_waiting_puts(tmp_path, monkeypatch):
    """With a slow disk, sixteen producers waiting on SYNC_FLUSH share writes and fdatasyncs: far fewer than one
    of each per put (before, every put made its own pwritev under the put lock)."""
    counts = _slow_disk(monkeypatch)
    per = 20
    with MessageStore.open(str(tmp_path / "s"), StoreConfig(flushDiskType="SYNC_FLUSH")) as store:
        store.put(Message("GC", b"first"))
        before = dict(counts)
        results = _run_threads(THREADS, lambda i: [store.put(Message("GC", _body(i, k), queue_id=i))
                                                   for k in range(per)])
        puts = THREADS * per
        assert all(r.ok for rs in results for r in rs)
        syncs, writes = counts["fdatasync"] - before["fdatasync"], counts["pwritev"] - before["pwritev"]
        assert syncs <= puts / 4, f"{syncs} fdatasync calls for {puts} puts"
        assert writes <= puts / 4, f"{writes} pwritev calls for {puts} puts"
        assert store.commit.rounds < puts / 4


class _WakeCounter:
    """Stand-in for the ``threading`` module in services.group_commit, put in once the store is open (so only the
    producers' parks are its locks): they count, per thread, how many sleeping producers a thread wakes in a row
    (reset when that thread itself sleeps or calls fdatasync)."""

    def __init__(self) -> None:
        self.in_a_row: dict[int, int] = {}
        self.most = 0
        self.wakes = 0
        self.current_thread = threading.current_thread
        self._guard = threading.Lock()

    def reset(self) -> None:
        with self._guard:
            self.in_a_row[threading.get_ident()] = 0

    def Lock(self) -> "_CountingLock":  # noqa: N802 (threading's name)
        return _CountingLock(self)


class _CountingLock:
    def __init__(self, counter: _WakeCounter) -> None:
        self._lock = threading.Lock()
        self._counter = counter
        self._held = False
        self._sleeper = False  # acquired by one thread and waited on by another (a producer's park)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._held:
            self._sleeper = True
            self._counter.reset()  # this thread sleeps now
        got = self._lock.acquire(blocking, timeout)
        self._held = self._held or got
        return got

    def release(self) -> None:
        if self._sleeper:
            c = self._counter
            with c._guard:
                me = threading.get_ident()
                n = c.in_a_row[me] = c.in_a_row.get(me, 0) + 1
                c.most = max(c.most, n)
                c.wakes += 1
            self._sleeper = False
        self._held = False
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


def test_a_flush_wakes_its_producers_one_after_another_not_as_a_herd(tmp_path, monkeypatch):
    """The thread that flushed wakes the first producer its flush covered; each woken producer wakes the next.
    Woken all at once (as before), fifteen threads woke only to queue for the GIL, one context switch more per
    put.  Counted with a stand-in lock: no thread wakes more than the next producer and the next writer in a
    row (before: a flush covering sixteen producers woke fifteen in a row)."""
    from rocketstore.services import group_commit
    counts = _slow_disk(monkeypatch)
    counter = _WakeCounter()
    real_sync = mapped_file_mod.fdatasync

    def fdatasync(fd: int) -> None:
        counter.reset()
        real_sync(fd)
    monkeypatch.setattr(mapped_file_mod, "fdatasync", fdatasync)
    per = 20
    # A producer left out of a chain would wake only at its syncFlushTimeout: a long one makes that a failure.
    cfg = StoreConfig(flushDiskType="SYNC_FLUSH", syncFlushTimeout=60_000)
    with MessageStore.open(str(tmp_path / "s"), cfg) as store:
        monkeypatch.setattr(group_commit, "threading", counter)
        t0 = time.monotonic()
        results = _run_threads(THREADS, lambda i: [store.put(Message("GC", _body(i, k), queue_id=i))
                                                   for k in range(per)])
        assert time.monotonic() - t0 < 20
        assert all(r.ok for rs in results for r in rs)
        assert counts["fdatasync"] <= THREADS * per / 4  # grouped (else the test proves nothing)
        assert counter.wakes >= THREADS * per / 2
        assert counter.most <= 2, f"a thread woke {counter.most} producers in a row"
        flushed = store.commitlog.queue.flushed_where
        assert all(r.commit_log_offset + r.wrote_bytes <= flushed for rs in results for r in rs)


def test_sixteen_sync_producers_cost_one_wake_up_per_put_at_most(tmp_path, monkeypatch):
    """A put that sleeps costs one wake-up, the least it can: a round's flush wakes its first producer, each woken
    producer the next; a producer is not woken once to queue and again to be answered.  Counted by the group
    commit itself (``GroupCommit.wakes``, which the bench reports per put next to the context switches).  A
    producer told to take over the writing may sleep once more if a flush of the service's covers its own put:
    at most one such producer per write round."""
    _slow_disk(monkeypatch)
    per = 20
    with MessageStore.open(str(tmp_path / "s"), StoreConfig(flushDiskType="SYNC_FLUSH")) as store:
        store.put(Message("GC", b"first"))
        commit = store.commit
        wakes, rounds = commit.wakes, commit.rounds
        results = _run_threads(THREADS, lambda i: [store.put(Message("GC", _body(i, k), queue_id=i))
                                                   for k in range(per)])
        puts = THREADS * per
        assert all(r.ok for rs in results for r in rs)
        wakes, rounds = commit.wakes - wakes, commit.rounds - rounds
        assert rounds <= puts / 4  # grouped (else the count proves nothing)
        assert puts / 2 <= wakes <= puts + rounds, f"{wakes} wake-ups for {puts} puts in {rounds} rounds"


def test_a_lone_sync_producer_is_never_woken(tmp_path):
    """One producer writes and flushes its own puts in its own thread: no lock hand-over at all."""
    with MessageStore.open(str(tmp_path / "s"), StoreConfig(flushDiskType="SYNC_FLUSH")) as store:
        for k in range(50):
            assert store.put(Message("GC", _body(0, k))).ok
        assert store.commit.wakes == 0


def test_a_lone_sync_producer_flushes_in_its_own_thread(tmp_path, monkeypatch):
    """One producer alone: no hand-off to the service thread; the fdatasync runs in the caller's thread."""
    threads_seen = set()
    real = mapped_file_mod.fdatasync

    def fdatasync(fd: int) -> None:
        if "/commitlog/" in os.readlink(f"/proc/self/fd/{fd}"):
            threads_seen.add(threading.current_thread().name)
        real(fd)
    monkeypatch.setattr(mapped_file_mod, "fdatasync", fdatasync)
    with MessageStore.open(str(tmp_path / "s"), StoreConfig(flushDiskType="SYNC_FLUSH")) as store:
        for k in range(50):
            r = store.put(Message("GC", _body(0, k)))
            assert r.ok and store.commitlog.queue.flushed_where >= r.commit_log_offset + r.wrote_bytes
        assert threads_seen == {threading.current_thread().name}


@pytest.mark.parametrize("flush", ["SYNC_FLUSH", "ASYNC_FLUSH"])
def test_a_put_too_big_for_a_segment_fails_alone_among_concurrent_puts(tmp_path, monkeypatch, flush):
    """A record larger than a commitlog segment, put while fifteen others wait in the same rounds, is refused
    naming the limit; the others are written, and the shared queue's offsets have no hole where it was."""
    _slow_disk(monkeypatch)
    cfg = StoreConfig(flushDiskType=flush, mappedFileSizeCommitLog=64 * 1024)
    with MessageStore.open(str(tmp_path / "s"), cfg) as store:
        def produce(i: int) -> list:
            out = []
            for k in range(10):
                body = bytes(100 * 1024) if (i, k) == (5, 4) else _body(i, k)
                out.append(store.put(Message("GC", body, queue_id=0)))
            return out
        results = _run_threads(THREADS, produce)
        bad = results[5][4]
        assert bad.status is PutMessageStatus.MESSAGE_ILLEGAL and "mappedFileSizeCommitLog" in bad.error
        good = [(i, k, r) for i, rs in enumerate(results) for k, r in enumerate(rs) if (i, k) != (5, 4)]
        assert all(r.ok for _, _, r in good)
        assert sorted(r.queue_offset for _, _, r in good) == list(range(len(good)))
        for i, k, r in good:
            assert store.look(r.commit_log_offset).body == _body(i, k)
        assert store.wait_dispatched(30) and store.max_offset_in_queue("GC", 0) == len(good)


def test_a_put_refused_as_read_only_fails_with_the_reason_while_others_were_written(tmp_path):
    with MessageStore.open(str(tmp_path / "s"), StoreConfig(flushDiskType="SYNC_FLUSH")) as store:
        assert store.put(Message("GC", b"a")).ok
        store.running_flags.make_not_writeable("disk full guard (test)")
        r = store.put(Message("GC", b"b"))
        assert r.status is PutMessageStatus.SERVICE_NOT_AVAILABLE and "disk full guard" in r.error


def test_units_written_together_cross_a_segment_whole_and_read_back(tmp_path):
    """CommitLog.append_units: several puts in one gathered write per segment; a unit that does not fit the
    rest of a segment goes whole to the next, after a blank record."""
    cl = CommitLog(str(tmp_path), 4096)
    cl.load()
    units = []
    for u in range(6):
        recs = [codec.encode("TopicU", bytes([u]) * 300, queue_id=u % 2) for _ in range(u % 3 + 1)]
        units.append((recs, u * 10, 1795000000000 + u))
    with cl.put_lock:
        done, error = cl.append_units(units)
    assert error is None and len(done) == 6
    assert len({off // 4096 for off, _, _, _ in done}) > 1  # crossed a segment
    for u, (off, total, ts, offsets) in enumerate(done):
        assert offsets[0] == off and total == sum(r[1] for r in units[u][0])
        assert off // 4096 == (off + total - 1) // 4096  # a unit is never split
        for j, o in enumerate(offsets):
            m = cl.read_message(o, check_crc=True)
            assert (m.body, m.queue_offset, m.store_timestamp, m.queue_id) == \
                (bytes([u]) * 300, u * 10 + j, ts, u % 2)
    assert cl.max_offset() == done[-1][0] + done[-1][1]
    cl.close()


def test_units_after_a_segment_that_cannot_be_made_are_not_written(tmp_path, monkeypatch):
    cl = CommitLog(str(tmp_path), 4096)
    cl.load()
    units = [([codec.encode("TopicU", bytes([u]) * 1500)], u, None) for u in range(4)]
    real = cl.queue.last_for_append
    calls = [0]

    def last_for_append(start: int = 0):
        calls[0] += 1
        if calls[0] > 1:
            raise OSError(28, "No space left on device", "00000000000000004096")
        return real(start)
    monkeypatch.setattr(cl.queue, "last_for_append", last_for_append)
    with cl.put_lock:
        done, error = cl.append_units(units)
    assert len(done) == 2 and isinstance(error, OSError)
    assert cl.max_offset() == 4096  # two records and the blank; nothing of the third
    assert cl.read_message(done[1][0]).body == bytes([1]) * 1500
    cl.close()


def test_an_acknowledged_sync_put_survives_a_power_cut(tmp_path):
    """Sixteen producers on SYNC_FLUSH; the disk keeps only what a sync covered when the power goes.  Every put
    answered PUT_OK before the cut is found after recovery, at its offsets, byte for byte."""
    live, shadow, image = tmp_path / "live", tmp_path / "shadow", tmp_path / "image"
    cfg = StoreConfig(flushDiskType="SYNC_FLUSH", mappedFileSizeCommitLog=64 * 1024, warmAheadBytes=0,
                      maxHashSlotNum=256, maxIndexNum=1024)  # small index files: the shadow copies each whole
    acked: list[tuple[int, int, int, int]] = []  # (producer, k, commitlog offset, queue offset)
    lock = threading.Lock()
    stop = threading.Event()
    with SyncShadow(live, shadow):
        store = MessageStore.open(str(live), cfg)
        mark_names_durable(live, shadow)

        def produce(i: int) -> None:
            k = 0
            while not stop.is_set():
                r = store.put(Message("GC", _body(i, k), queue_id=i % 3))
                assert r.ok, r.error
                with lock:
                    acked.append((i, k, r.commit_log_offset, r.queue_offset))
                k += 1
        ts = [threading.Thread(target=produce, args=(i,)) for i in range(THREADS)]
        for t in ts:
            t.start()
        time.sleep(0.3)
        with lock:  # the power goes: what was acknowledged by now must be on the disk image
            cut = list(acked)
            crash_image(live, shadow, image)
        stop.set()
        for t in ts:
            t.join(30)
        store.close()
    rebooted(image)
    assert len(cut) > THREADS
    with MessageStore.open(str(image), cfg) as again:
        for i, k, off, qoff in cut:
            m = again.look(off)
            assert m.body == _body(i, k) and m.queue_offset == qoff
            assert [x.body for x in again.get("GC", i % 3, qoff, 1).messages] == [_body(i, k)]


def test_puts_waiting_on_a_stuck_flush_time_out_saying_whether_they_were_written(tmp_path, monkeypatch):
    """syncFlushTimeout: a put written but not yet durable is answered FLUSH_DISK_TIMEOUT with its offsets; a put
    not even written (the writer is the one stuck in fdatasync) is refused OS_PAGE_CACHE_BUSY and never
    written; the stuck flush's own put is answered once the disk returns."""
    gate = threading.Event()
    stuck = threading.Event()
    real = mapped_file_mod.fdatasync

    def fdatasync(fd: int) -> None:
        if "/commitlog/" in os.readlink(f"/proc/self/fd/{fd}") and not gate.is_set():
            stuck.set()
            gate.wait(10)
        real(fd)
    cfg = StoreConfig(flushDiskType="SYNC_FLUSH", syncFlushTimeout=300)
    with MessageStore.open(str(tmp_path / "s"), cfg) as store:
        gate.set()
        assert store.put(Message("GC", b"before")).ok
        monkeypatch.setattr(mapped_file_mod, "fdatasync", fdatasync)
        gate.clear()
        # The service flushes for a WAIT=false put and sticks; a put written meanwhile waits for that flush.
        assert store.put(Message("GC", b"nowait", properties={"WAIT": "false"})).ok
        assert stuck.wait(5)
        written = store.put(Message("GC", b"written"))
        assert written.status is PutMessageStatus.FLUSH_DISK_TIMEOUT and written.commit_log_offset > 0
        gate.set()
        assert store.wait_dispatched(10)
        assert store.look(written.commit_log_offset).body == b"written"
        # Now the writer itself is stuck in fdatasync: the put behind it is not written at all.
        gate.clear()
        stuck.clear()
        first: list = []
        t = threading.Thread(target=lambda: first.append(store.put(Message("GC", b"leader"))))
        t.start()
        assert stuck.wait(5)
        end = store.commitlog.max_offset()
        refused = store.put(Message("GC", b"refused"))
        assert refused.status is PutMessageStatus.OS_PAGE_CACHE_BUSY and "not written" in refused.error
        gate.set()
        t.join(10)
        assert first[0].ok and store.commitlog.max_offset() == end
        assert store.wait_dispatched(10)
        assert [m.body for m in store.get("GC", 0, 0, 10).messages] == [b"before", b"nowait", b"written", b"leader"]


def test_a_lone_put_written_during_a_flush_waits_for_a_flush_that_covers_it(tmp_path, monkeypatch):
    """A lone producer is written as a round of its own, unpublished (issue 29: the short path); when a flush
    is already under way (the service's, for a WAIT=false put), that flush started before the put was written
    and cannot cover it: the put is acknowledged only after a later fdatasync, never by the one under way."""
    gate = threading.Event()
    stuck = threading.Event()
    syncs: list[int] = []  # the commitlog end each finished commitlog fdatasync covered at least
    real = mapped_file_mod.fdatasync

    def fdatasync(fd: int) -> None:
        if "/commitlog/" in os.readlink(f"/proc/self/fd/{fd}"):
            end = store.commitlog.max_offset()  # written before the sync started: covered by it
            if not gate.is_set():
                stuck.set()
                gate.wait(10)
            real(fd)
            syncs.append(end)
            return
        real(fd)
    cfg = StoreConfig(flushDiskType="SYNC_FLUSH", syncFlushTimeout=10_000)
    with MessageStore.open(str(tmp_path / "s"), cfg) as store:
        gate.set()
        assert store.put(Message("GC", b"before")).ok
        monkeypatch.setattr(mapped_file_mod, "fdatasync", fdatasync)
        gate.clear()
        assert store.put(Message("GC", b"nowait", properties={"WAIT": "false"})).ok
        assert stuck.wait(5)  # the service is inside fdatasync for the WAIT=false put
        before = len(syncs)
        got: list = []
        t = threading.Thread(target=lambda: got.append(store.put(Message("GC", b"lone"))))
        t.start()
        time.sleep(0.2)
        assert not got, "acknowledged while the only fdatasync under way had started before its write"
        gate.set()
        t.join(10)
        r = got[0]
        end = r.commit_log_offset + r.wrote_bytes
        assert r.ok and store.commitlog.queue.flushed_where >= end
        assert len(syncs) >= before + 2 and any(s >= end for s in syncs[before + 1:])
        assert store.wait_dispatched(10)
        assert [m.body for m in store.get("GC", 0, 0, 10).messages] == [b"before", b"nowait", b"lone"]
