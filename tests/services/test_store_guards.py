"""Issue 16 items 8 and 9: the store's lock, abort file, checkpoint, flush, metrics and dispatch guards."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rocketstore import Message, MessageStore, StoreConfig, StoreLockedError
from conftest import REPO

_HOLDER = """
import sys
from rocketstore import MessageStore
store = MessageStore.open(sys.argv[1])
print("open", flush=True)
sys.stdin.read()
store.close()
"""


def _hold_open(path) -> subprocess.Popen:
    """Another process that opens the store writable and keeps it open until its stdin closes."""
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=REPO)
    assert p.stdout.readline() == b"open\n", p.stderr.read()
    return p


def test_a_deleted_lock_file_lets_no_second_writer_in(tmp_path):
    path = tmp_path / "s"
    holder = _hold_open(path)
    try:
        with pytest.raises(StoreLockedError, match="locked by another process"):
            MessageStore.open(str(path))
        os.unlink(path / "lock")
        with pytest.raises(StoreLockedError, match="locked by another process"):
            MessageStore.open(str(path))
        assert not (path / "lock").exists()
    finally:
        holder.communicate(b"", timeout=60)
    assert holder.returncode == 0
    with MessageStore.open(str(path)) as store:  # the holder is gone: its locks went with it
        assert store.put(Message("T", b"x")).ok
    assert (path / "lock").read_bytes() == b"lock"  # still written, for RocketMQ


def test_abort_files_are_fsynced_with_their_directory(tmp_path, monkeypatch):
    path = tmp_path / "s"
    synced: list[str] = []
    real = os.fsync

    def recording(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)
    monkeypatch.setattr(os, "fsync", recording)
    with MessageStore.open(str(path)):
        root = os.path.realpath(path)
        want = {os.path.join(root, "abort"), root}
        if os.path.exists("/proc/sys/kernel/random/boot_id"):
            want.add(os.path.join(root, "abort.bootid"))
        assert want <= set(synced)


_METRICS_WRITER = """
import os, sys, time
from rocketstore import Message, MessageStore
store = MessageStore.open(sys.argv[1])
store.put(Message("T", b"x"))
while not os.path.exists(os.path.join(sys.argv[1], "metrics.json")):
    time.sleep(0.05)
print("live", flush=True)
time.sleep(60)
"""


def test_stats_live_says_not_live_when_the_writer_died(tmp_path):
    import json
    import signal

    from conftest import run_cli
    path = tmp_path / "s"
    p = subprocess.Popen([sys.executable, "-c", _METRICS_WRITER, str(path)], stdout=subprocess.PIPE, cwd=REPO)
    try:
        assert p.stdout.readline() == b"live\n"
        r = run_cli("stats", path, "--live", "--count", "1", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["pid"] == p.pid
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    assert (path / "metrics.json").exists()  # killed: nobody removed it
    r = run_cli("stats", path, "--live", "--count", "1")
    assert r.returncode == 2 and f"process {p.pid}, which is no longer running".encode() in r.stderr, r.stderr
    assert r.stderr.count(b"\n") == 1
    r = run_cli("stats", path, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["live"] is None
    # a pid that a later process reuses is told apart by its start time
    m = json.loads((path / "metrics.json").read_text())
    m["pid"], m["pidStartTicks"] = os.getpid(), 1
    (path / "metrics.json").write_text(json.dumps(m))
    r = run_cli("stats", path, "--live", "--count", "1")
    assert r.returncode == 2 and b"the pid now names another process" in r.stderr, r.stderr


@pytest.mark.parametrize("content, says", [
    ("[1, 2]", "the file holds a list"),
    ('{"offsetTable": [1]}', "offsetTable is a list"),
    ('{"offsetTable": {"TopicTest@g": 5}}', "offsetTable['TopicTest@g'] is not"),
    ('{"offsetTable": {"TopicTest@g": {"0": "x"}, "TopicTest@h": {"1": 3}}}', "offsetTable['TopicTest@g']['0'] = 'x'"),
    ('{"offsetTable": {"TopicTest@g": {"q": 1}}}', "offsetTable['TopicTest@g']['q'] = 1"),
])
def test_retention_reports_a_wrong_shaped_consumer_offset_file(basic_copy, content, says):
    import json

    from conftest import run_cli
    (basic_copy / "config").mkdir(exist_ok=True)
    (basic_copy / "config" / "consumerOffset.json").write_text(content)
    r = run_cli("retention", basic_copy, "--json")
    assert r.returncode == 0, r.stderr
    warnings = json.loads(r.stdout)["warnings"]
    assert any("consumerOffset.json" in w and says in w for w in warnings), warnings
    r = run_cli("retention", basic_copy)
    assert r.returncode == 0 and b"warning: " in r.stdout and b"Traceback" not in r.stderr


def test_consumer_offsets_read_rocketmq_fastjson_and_skip_only_bad_entries(basic_copy):
    (basic_copy / "config").mkdir(exist_ok=True)
    (basic_copy / "config" / "consumerOffset.json").write_text(
        '{"offsetTable":{"TopicTest@g":{0:12,1:7},"TopicTest@h":{0:3,1:"x"}}}')
    problems: list[str] = []
    with MessageStore.open(str(basic_copy), read_only=True) as store:
        assert store.consumer_offsets(problems) == {("TopicTest", 0): 3, ("TopicTest", 1): 7}
    assert len(problems) == 1 and "offsetTable['TopicTest@h']['1'] = 'x'" in problems[0]


def test_one_async_flush_round_flushes_every_filled_segment(tmp_path):
    cfg = StoreConfig(mappedFileSizeCommitLog=16 * 1024, mappedFileSizeConsumeQueue=20 * 200)
    with MessageStore.open(str(tmp_path / "s"), cfg, start_services=False) as store:
        for _ in range(100):  # about 10 segments
            assert store.put(Message("T", b"x" * 1500)).ok
        queue = store.commitlog.queue
        assert len(queue.files) >= 8 and queue.flushed_where == 0
        last = queue.files[-1]
        assert last.wrote_position < 4 * 4096  # fewer dirty pages than flushCommitLogLeastPages
        store.files.flush_commitlog(cfg.flushCommitLogLeastPages, False)  # one FlushRealTimeService round
        assert queue.flushed_where == last.file_from_offset
        assert all(f.flushed_position == f.file_size for f in queue.files[:-1])
        store.files.flush_commitlog(0, True)  # a thorough round takes the rest
        assert queue.flushed_where == store.max_phy_offset()


def test_checkpoint_logics_timestamp_never_runs_ahead_of_flushed_queues(tmp_path):
    import struct
    path = tmp_path / "s"
    cfg = StoreConfig(mappedFileSizeCommitLog=1 << 20, flushIntervalConsumeQueue=50,
                      flushConsumeQueueLeastPages=1000, flushConsumeQueueThoroughInterval=600000)
    base = int(time.time() * 1000) - 1000_000
    with MessageStore.open(str(path), cfg) as store:
        time.sleep(0.3)  # the consume-queue flusher's first (thorough) round is over
        for i in range(100):
            assert store.put(Message("T", b"x", store_timestamp=base + i * 1000)).ok
        store.wait_dispatched()
        time.sleep(1.5)  # the checkpoint page is rewritten every second
        on_disk = struct.unpack(">qq", (path / "checkpoint").read_bytes()[:16])[1]
        durable = store.find_consume_queue("T", 0).queue.flushed_where // 20
        assert durable < 100
        assert on_disk <= (base + (durable - 1) * 1000 if durable else 0)
    # a clean close flushes the queues, and then the page says so
    assert struct.unpack(">qq", (path / "checkpoint").read_bytes()[:16])[1] == base + 99 * 1000


def test_a_record_with_damaged_topic_bytes_is_left_out_of_the_queues_not_the_store(tmp_path, caplog):
    import logging

    from rocketstore import GetMessageStatus, PutMessageStatus
    path = tmp_path / "s"
    cfg = StoreConfig(mappedFileSizeCommitLog=1 << 20)
    with MessageStore.open(str(path), cfg) as store:
        assert store.put(Message("Good", b"before")).ok
        bad = store.put(Message("A" * 100, b"damaged"))
        assert store.put(Message("Good", b"after")).ok
        # a topic no directory can be named after is refused at the put, not at the dispatch
        r = store.put(Message("L" * 256, b"long"))
        assert r.status is PutMessageStatus.MESSAGE_ILLEGAL and "at most 255" in r.error
    seg = path / "commitlog" / f"{0:020d}"
    data = seg.read_bytes()
    assert data.count(b"A" * 100) == 1
    seg.write_bytes(data.replace(b"A" * 100, b"\xff" * 100))  # the body CRC still holds
    os.unlink(path / "consumequeue" / ("A" * 100) / "0" / f"{0:020d}")
    os.rmdir(path / "consumequeue" / ("A" * 100) / "0")
    os.rmdir(path / "consumequeue" / ("A" * 100))
    # Recovery re-dispatches every record.  A crash of the process alone: after a reboot the damaged tail of a
    # record the checkpoint counts as flushed is refused instead (tests/safety/test_data_safety_torn.py).
    from helpers.powerloss import process_crashed
    process_crashed(path)
    with caplog.at_level(logging.ERROR, logger="rocketstore.services.dispatch"):
        with MessageStore.open(str(path), cfg) as store:
            assert [k for k in store.queue_keys()] == [("Good", 0)]
            r = store.get("Good", 0, 0)
            assert r.status is GetMessageStatus.FOUND and [m.body for m in r.messages] == [b"before", b"after"]
            assert store.look(bad.commit_log_offset).body == b"damaged"  # still in the log
            assert store.put(Message("Good", b"later")).ok
            store.wait_dispatched()
            assert store.max_offset_in_queue("Good", 0) == 3
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(f"commitlog offset {bad.commit_log_offset}" in e and "illegal characters" in e for e in errors), errors


class _FailingAllocate:
    """Index file creation fails with ENOSPC while ``failing`` is set (a full disk, without a small file system)."""

    def __init__(self, real):
        self.real = real
        self.failing = False
        self.calls = 0

    def __call__(self, fd, size):
        import errno
        if self.failing:
            self.calls += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.real(fd, size)


def _wait(cond, timeout=10.0):
    deadline = time.time() + timeout
    while not cond() and time.time() < deadline:
        time.sleep(0.05)
    return cond()


def test_a_failing_index_never_stops_the_consume_queues_and_catches_up(tmp_path, monkeypatch, caplog):
    import logging

    from rocketstore import GetMessageStatus
    from rocketstore.storage import index as index_mod
    from rocketstore.services.metrics import snapshot
    alloc = _FailingAllocate(index_mod.allocate)
    monkeypatch.setattr(index_mod, "allocate", alloc)
    # 21 entries a file (entry 0 is never used): two keys a message, so a file fills in the middle of one
    cfg = StoreConfig(mappedFileSizeCommitLog=1 << 20, maxHashSlotNum=8, maxIndexNum=22)
    with caplog.at_level(logging.INFO):
        with MessageStore.open(str(tmp_path / "s"), cfg) as store:
            for i in range(3):  # the first index file is made
                assert store.put(Message("T", b"x", keys=[f"a{i}", f"b{i}"])).ok
            store.wait_dispatched()
            alloc.failing = True
            for i in range(3, 60):
                assert store.put(Message("T", f"m{i}".encode(), keys=[f"a{i}", f"b{i}"])).ok
            assert store.wait_dispatched(timeout=10)
            bodies, off = [], 0
            while (r := store.get("T", 0, off, 32)).status is GetMessageStatus.FOUND:
                bodies += [m.body for m in r.messages]
                off = r.next_begin_offset
            assert bodies == [b"x"] * 3 + [f"m{i}".encode() for i in range(3, 60)]  # readable all the same
            state = store.state()
            assert "No space left on device" in state["indexError"] and state["indexMissedFrom"] is not None
            assert snapshot(store.files, store.metrics, store.disk_guard, 0)["indexError"] == state["indexError"]  # what stats --live shows
            time.sleep(2.5)  # a few retries
            assert alloc.calls >= 2
            assert store.query("T", "a40").messages == []  # not indexed yet
            alloc.failing = False
            assert _wait(lambda: store.state()["indexError"] is None)
            for i in range(60, 65):
                assert store.put(Message("T", f"m{i}".encode(), keys=[f"a{i}", f"b{i}"])).ok
            store.wait_dispatched()
            for i in range(65):
                for k in (f"a{i}", f"b{i}"):
                    hits = store.query("T", k).messages
                    assert len(hits) == 1 and hits[0].keys == f"a{i} b{i}", (k, hits)
    records = [r for r in caplog.records if r.name.startswith("rocketstore")]
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING and "index file" in r.getMessage()]
    assert len(warnings) == 1 and "No space left on device" in warnings[0] and "commitlog offset" in warnings[0]
    assert not [r for r in records if r.exc_info], "no traceback"
    assert any("index builds again" in r.getMessage() for r in records)


def test_index_records_missed_at_close_are_recovered_by_the_next_open(tmp_path, monkeypatch):
    from rocketstore.storage import index as index_mod
    alloc = _FailingAllocate(index_mod.allocate)
    monkeypatch.setattr(index_mod, "allocate", alloc)
    path = tmp_path / "s"
    cfg = StoreConfig(mappedFileSizeCommitLog=1 << 20, maxHashSlotNum=8, maxIndexNum=21)
    with MessageStore.open(str(path), cfg) as store:
        alloc.failing = True
        for i in range(30):
            assert store.put(Message("T", b"x", keys=f"k{i}")).ok
        store.wait_dispatched()
        assert store.state()["indexError"]
    assert (path / "abort").exists()  # not a clean close: the index misses records
    alloc.failing = False
    with MessageStore.open(str(path), cfg) as store:
        assert store.recovery_report.abnormal
        assert all(len(store.query("T", f"k{i}").messages) == 1 for i in range(30))
        assert store.state()["indexError"] is None


def test_disk_guard_counts_the_next_segment_and_index_file(tmp_path):
    from rocketstore import PutMessageStatus
    from rocketstore.storage.index import index_file_size
    cfg = StoreConfig(mappedFileSizeCommitLog=1 << 20, maxHashSlotNum=1000, maxIndexNum=4000)
    need = (1 << 20) + index_file_size(1000, 4000)
    with MessageStore.open(str(tmp_path / "s"), cfg, start_services=False) as store:
        free = [need - 1]
        store.disk_guard.free_bytes = lambda path: free[0]
        store.disk_guard.check()
        r = store.put(Message("T", b"x"))
        assert r.status is PutMessageStatus.SERVICE_NOT_AVAILABLE
        assert (f"disk has {need - 1} bytes free < {need} needed (next commitlog segment 1048576 + "
                f"next index file {index_file_size(1000, 4000)})") in r.error
        assert store.disk_guard.to_json()["neededFreeBytes"] == need
        free[0] = need
        store.disk_guard.check()
        assert store.put(Message("T", b"x")).ok
        store.config.messageIndexEnable = False  # no index: only the segment counts
        free[0] = 1 << 20
        store.disk_guard.check()
        assert store.put(Message("T", b"x")).ok


def test_async_flush_service_keeps_up_with_small_segments(tmp_path):
    cfg = StoreConfig(mappedFileSizeCommitLog=16 * 1024, flushIntervalCommitLog=100,
                      flushCommitLogThoroughInterval=600000)
    with MessageStore.open(str(tmp_path / "s"), cfg) as store:
        for _ in range(2000):  # about 190 segments, put faster than one segment a round
            assert store.put(Message("T", b"x" * 1500)).ok
        queue = store.commitlog.queue
        assert len(queue.files) > 150
        # within a few rounds every filled segment is flushed (one segment a round would take ~19 s)
        assert _wait(lambda: queue.flushed_where >= queue.files[-1].file_from_offset, timeout=3.0), \
            (queue.flushed_where, queue.files[-1].file_from_offset)


def test_a_store_opened_without_services_flushes_its_queues_and_says_so_at_close(basic_copy):
    import shutil
    import struct

    from conftest import golden_expected
    cp = bytearray((basic_copy / "checkpoint").read_bytes())
    cp[8:16] = struct.pack(">q", 1)  # logicsMsgTimestamp
    (basic_copy / "checkpoint").write_bytes(bytes(cp))
    shutil.rmtree(basic_copy / "consumequeue")  # recovery re-dispatches every record
    with MessageStore.open(str(basic_copy), start_services=False) as store:
        assert store.recovery_report is not None
    last = max(e["storeTimestamp"] for e in golden_expected("basic") if e["cqUnit"])
    assert struct.unpack(">q", (basic_copy / "checkpoint").read_bytes()[8:16])[0] == last
