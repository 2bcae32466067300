"""Issue 4: the write path produces RocketMQ's bytes and serves what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rocketstore import (ConfigError, GetMessageStatus, Message, MessageStore, PutMessageStatus, StoreClosedError,
                           StoreConfig, StoreLoadError, StoreLockedError)
from rocketstore.config import golden_config
from conftest import GOLDEN, GOLDEN_NAMES, golden_expected, golden_queries, golden_store, run_cli, short_pwritev
from helpers.workloads import mixed_puts


def _files(root: Path) -> dict[str, bytes]:
    out = {}
    for d, _dirs, names in os.walk(root):
        for n in names:
            p = Path(d) / n
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_import_reproduces_rocketmq_files_byte_for_byte(name, tmp_path, golden_conf):
    target = tmp_path / "store"
    r = run_cli("import", target, "--from", GOLDEN / name / "expected.jsonl", "--config", golden_conf)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["imported"] == len(golden_expected(name))
    want, got = golden_store(name), target
    for sub in ("commitlog", "consumequeue"):
        w, g = _files(want / sub), _files(got / sub)
        assert sorted(w) == sorted(g)
        for k in w:
            assert w[k] == g[k], f"{sub}/{k} differs"
    assert (got / "lock").read_bytes() == b"lock" and not (got / "abort").exists()
    with MessageStore.open(str(got), read_only=True) as store:
        for q in golden_queries(name)["queryMessage"]:
            r = store.query(q["topic"], q["key"], q["maxNum"], q["begin"], q["end"])
            assert r.phy_offsets == q["resultPhyOffsets"], q
        assert store.state()["queues"] == golden_queries(name)["storeState"]["queues"]


def test_put_get_look_query_and_offsets(tmp_path):
    with MessageStore.open(str(tmp_path / "s"), golden_config()) as store:
        results = [store.put(Message("Orders", f"body-{i}".encode(), queue_id=i % 2, tags="TagA" if i % 3 else "TagB",
                                     keys=[f"order-{i}", "shared"], properties={"city": "東京"}))
                   for i in range(50)]
        assert all(r.status is PutMessageStatus.PUT_OK for r in results)
        assert [r.queue_offset for r in results if r.commit_log_offset >= 0][:4] == [0, 0, 1, 1]
        assert results[1].commit_log_offset == results[0].commit_log_offset + results[0].wrote_bytes
        assert len(results[0].msg_id) == 32 and results[0].store_timestamp > 0
        store.wait_dispatched()
        assert store.dispatch_behind_bytes() == 0
        assert store.max_offset_in_queue("Orders", 0) == 25 and store.max_offset_in_queue("Orders", 1) == 25
        got = store.get("Orders", 1, 0, 100)
        assert got.status is GetMessageStatus.FOUND and [m.body for m in got.messages][:2] == [b"body-1", b"body-3"]
        assert got.messages[0].properties["city"] == "東京" and got.messages[0].keys == "order-1 shared"
        m = store.look(results[7].commit_log_offset)
        assert m.body == b"body-7" and m.msg_id == results[7].msg_id
        q = store.query("Orders", "order-7")
        assert [x.body for x in q.messages] == [b"body-7"]
        assert len(store.query("Orders", "shared", max_num=100).messages) == 50
        ts = results[10].store_timestamp
        assert store.offset_by_time("Orders", 0, ts) <= 5
        uniq = store.query("Orders", got.messages[0].uniq_key or "none")
        assert uniq.messages == [] or uniq.messages[0].body == b"body-1"


def test_a_file_destroyed_while_read_leaves_nothing_on_disk_and_spares_a_later_namesake(tmp_path):
    """Destroying a held file deletes its name at once (the reader keeps its mapping), so callers that destroy
    once (queue truncation, index expiry) leave no file behind to come back at the next start, and the last
    reader's release never touches a later file of the same name."""
    from rocketstore.storage.mapped_file import MappedFile

    path = str(tmp_path / f"{0:020d}")
    old = MappedFile(path, 4096, create=True)
    old.mm[:5] = b"hello"
    assert old.hold()
    assert old.destroy() is False  # still read
    assert not os.path.exists(path) and old.mm[:5] == b"hello"
    new = MappedFile(path, 4096, create=True)
    new.mm[:5] = b"fresh"
    old.release()  # the last reader goes: the old mapping closes
    assert old.closed and old.destroy() is True
    with open(path, "rb") as fh:
        assert fh.read(5) == b"fresh"
    assert new.destroy() and not os.path.exists(path)


def test_a_waiter_for_the_preallocated_segment_may_come_before_the_allocator_thread_starts(tmp_path, monkeypatch):
    """The allocation is published before its thread starts; a waiter arriving in between (the warm-ahead
    service did, in a CI run) waits for the file instead of failing on Thread.join."""
    from rocketstore.storage import mapped_file

    seen: list = []
    real = threading.Thread

    class LateStart(real):
        def start(self) -> None:
            waiter = real(target=lambda: seen.append(queue.preallocated()))
            waiter.start()
            waiter.join(0.2)  # the waiter asks while this thread has not started
            super().start()
            waiter.join(10)

    queue = mapped_file.MappedFileQueue(str(tmp_path), 4096, preallocate=True)
    monkeypatch.setattr(mapped_file.threading, "Thread", LateStart)
    queue.start_preallocation(4096)
    monkeypatch.undo()
    assert len(seen) == 1 and seen[0] is not None and seen[0].file_from_offset == 4096
    queue.discard_preallocated()
    assert os.listdir(tmp_path) == []


def test_segments_roll_over_with_a_blank_record_and_preallocate(tmp_path):
    cfg = StoreConfig(mappedFileSizeCommitLog=64 * 1024, mappedFileSizeConsumeQueue=200)
    with MessageStore.open(str(tmp_path / "s"), cfg) as store:
        for i in range(200):
            assert store.put(Message("Roll", os.urandom(1000), keys=f"k{i}")).ok
        store.wait_dispatched()
        current = store.commitlog.queue.last()
        ready = store.commitlog.queue.preallocated()  # made by the allocator thread, not the put path
        assert ready is not None and ready.file_from_offset == current.end_offset
        assert f"{current.end_offset:020d}" in os.listdir(tmp_path / "s" / "commitlog")
        assert store.max_offset_in_queue("Roll", 0) == 200
        bodies = []
        off = 0
        while True:
            r = store.get("Roll", 0, off, 32)
            if r.status is not GetMessageStatus.FOUND:
                break
            bodies += r.messages
            off = r.next_begin_offset
        assert len(bodies) == 200
    dump = [json.loads(x) for x in run_cli("dump", tmp_path / "s", "--no-body").stdout.decode().splitlines()]
    assert len(dump) == 200
    seg0 = (tmp_path / "s" / "commitlog" / "00000000000000000000").read_bytes()
    last = max(d["commitLogOffset"] + d["size"] for d in dump if d["commitLogOffset"] < 65536)
    assert int.from_bytes(seg0[last + 4:last + 8], "big") == 0xCBD43194  # the blank record
    assert int.from_bytes(seg0[last:last + 4], "big") == 65536 - last
    used = {f"{(d['commitLogOffset'] // 65536) * 65536:020d}" for d in dump}
    assert sorted(os.listdir(tmp_path / "s" / "commitlog")) == sorted(used)  # pre-allocated file removed at close


def test_transactions_prepared_and_rollback_get_no_queue_offset(tmp_path):
    with MessageStore.open(str(tmp_path / "s"), golden_config()) as store:
        kinds = [0, 4, 8, 12, 0]
        rs = [store.put(Message("Txn", b"x", sys_flag=k, keys=f"k{i}")) for i, k in enumerate(kinds)]
        assert [r.queue_offset for r in rs] == [0, 0, 1, 0, 2]
        store.wait_dispatched()
        assert store.max_offset_in_queue("Txn", 0) == 3
        assert [m.sys_flag for m in store.get("Txn", 0, 0, 10).messages] == [0, 8, 0]
        assert len(store.query("Txn", "k1").messages) == 1  # PREPARED is indexed
        assert store.query("Txn", "k3").messages == []  # ROLLBACK is not


def test_put_batch_is_one_unit_with_consecutive_offsets(tmp_path):
    with MessageStore.open(str(tmp_path / "s"), golden_config()) as store:
        store.put(Message("B", b"first"))
        r = store.put_batch([Message("B", f"m{i}".encode(), keys=f"b{i}") for i in range(10)])
        assert r.ok and r.msg_num == 10 and r.queue_offset == 1 and len(r.msg_id.split(",")) == 10
        store.wait_dispatched()
        assert [m.body for m in store.get("B", 0, 1, 32).messages] == [f"m{i}".encode() for i in range(10)]
        bad = store.put_batch([Message("B", b"1"), Message("C", b"2")])
        assert bad.status is PutMessageStatus.MESSAGE_ILLEGAL


def test_sixteen_producer_threads_lose_and_duplicate_nothing(tmp_path):
    per_thread, threads = 400, 16
    with MessageStore.open(str(tmp_path / "s"), StoreConfig(mappedFileSizeCommitLog=256 * 1024,
                                                            mappedFileSizeConsumeQueue=2000)) as store:
        errors = []

        def produce(t: int) -> None:
            for i in range(per_thread):
                r = store.put(Message("Load", f"{t}:{i}".encode(), queue_id=i % 4))
                if not r.ok:
                    errors.append(r)
        ts = [threading.Thread(target=produce, args=(t,)) for t in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors
        store.wait_dispatched()
        seen = []
        for q in range(4):
            off = 0
            while True:
                r = store.get("Load", q, off, 32)
                if r.status is not GetMessageStatus.FOUND:
                    break
                assert [m.queue_offset for m in r.messages] == list(range(off, off + len(r.messages)))
                seen += [m.body for m in r.messages]
                off = r.next_begin_offset
            assert off == store.max_offset_in_queue("Load", q)
        assert len(seen) == len(set(seen)) == per_thread * threads
    assert run_cli("verify", tmp_path / "s").returncode == 0


def test_lock_and_abort_file(tmp_path):
    path = str(tmp_path / "s")
    store = MessageStore.open(path, golden_config())
    try:
        assert (tmp_path / "s" / "abort").read_text() == str(os.getpid())
        with pytest.raises(StoreLockedError, match="already open"):
            MessageStore.open(path, golden_config())
        code = f"from rocketstore import MessageStore\nMessageStore.open({path!r})"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
        assert r.returncode != 0 and b"locked by another process" in r.stderr
        r = run_cli("put", path, "--topic", "T", "--body", "x")
        assert r.returncode == 2 and b"locked by another process" in r.stderr
    finally:
        store.close()
    assert not (tmp_path / "s" / "abort").exists() and (tmp_path / "s" / "abort.bak").exists()
    MessageStore.open(path).close()  # the lock is free again


def test_bad_puts_get_clear_statuses_and_write_nothing(tmp_path):
    cfg = StoreConfig(mappedFileSizeCommitLog=64 * 1024, maxMessageSize=1024)
    with MessageStore.open(str(tmp_path / "s"), cfg) as store:
        assert store.put(Message("T", b"ok")).ok
        before = store.max_phy_offset()
        r = store.put(Message("T", b"x" * 1025))
        assert r.status is PutMessageStatus.MESSAGE_ILLEGAL and "maxMessageSize" in r.error
        r = store.put(Message("T", b"x", properties={"k": "v" * 40000}))
        assert r.status is PutMessageStatus.PROPERTIES_SIZE_EXCEEDED
        r = store.put(Message("bad topic!", b"x"))
        assert r.status is PutMessageStatus.MESSAGE_ILLEGAL and "illegal characters" in r.error
        r = store.put(Message("", b"x"))
        assert r.status is PutMessageStatus.MESSAGE_ILLEGAL
        r = store.put(Message("T", "text"))  # type: ignore[arg-type]
        assert r.status is PutMessageStatus.MESSAGE_ILLEGAL and "bytes" in r.error
        assert store.max_phy_offset() == before
    store2 = MessageStore.open(str(tmp_path / "s2"), StoreConfig(mappedFileSizeCommitLog=4096))
    with store2:
        r = store2.put(Message("T", b"x" * 5000))
        assert r.status is PutMessageStatus.MESSAGE_ILLEGAL and "do not fit" in r.error
    with pytest.raises(StoreClosedError):
        store2.put(Message("T", b"x"))


@pytest.mark.parametrize("changes, needle", [
    ({"mappedFileSizeCommitLog": 100}, "at least 4096"),
    ({"mappedFileSizeConsumeQueue": 6001}, "multiple of the 20-byte unit"),
    ({"flushDiskType": "SOMETIMES"}, "ASYNC_FLUSH or SYNC_FLUSH"),
])
def test_impossible_config_values(changes, needle):
    with pytest.raises(ConfigError, match=needle):
        StoreConfig(**changes)


def test_directory_that_is_not_a_store(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(StoreLoadError, match="not a message store"):
        MessageStore.open(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_broker_conf_loading(tmp_path):
    p = tmp_path / "broker.conf"
    p.write_text("# comment\nbrokerName=b1\nmappedFileSizeCommitLog=1048576\nflushDiskType=SYNC_FLUSH\n"
                 "messageIndexEnable=false\n")
    cfg = StoreConfig.load(str(p))
    assert (cfg.mappedFileSizeCommitLog, cfg.flushDiskType, cfg.messageIndexEnable) == (1048576, "SYNC_FLUSH", False)
    p.write_text("mappedFileSizeCommitLog\n")
    with pytest.raises(ConfigError, match="broker.conf:1: expected key=value"):
        StoreConfig.load(str(p))


def test_put_cli(tmp_path, golden_conf):
    r = run_cli("put", tmp_path / "s", "--topic", "Cli", "--tags", "TagA", "--keys", "k1 k2", "--property",
                "a=b", "--body", "hello", "--config", golden_conf)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["status"] == "PUT_OK" and res["queueOffset"] == 0
    r = run_cli("put", tmp_path / "s", "--topic", "Cli", "--config", golden_conf, input=b"from stdin")
    assert json.loads(r.stdout)["queueOffset"] == 1
    got = json.loads(run_cli("query", tmp_path / "s", "--topic", "Cli", "--key", "k2").stdout)
    assert [m["properties"]["a"] for m in got["messages"]] == ["b"]
    r = run_cli("put", tmp_path / "s", "--topic", "Cli", "--property", "novalue", "--body", "x")
    assert r.returncode == 2 and b"expected key=value" in r.stderr
    r = run_cli("put", tmp_path / "s", "--topic", "bad topic", "--body", "x")
    assert r.returncode == 2 and b"MESSAGE_ILLEGAL" in r.stderr


def test_full_disk_when_a_segment_is_created(tmp_path, monkeypatch):
    """A full disk is an error the put reports (never a SIGBUS from a sparse page), and the store stays usable."""
    import errno
    from rocketstore.storage import mapped_file
    cfg = StoreConfig(mappedFileSizeCommitLog=64 * 1024, mappedFileSizeConsumeQueue=2000)
    with MessageStore.open(str(tmp_path / "s"), cfg) as store:
        assert store.put(Message("D", b"x" * 1000)).ok
        store.commitlog.queue.discard_preallocated()

        def no_space(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(mapped_file.os, "posix_fallocate", no_space)
        results = [store.put(Message("D", b"x" * 1000)) for _ in range(80)]
        failed = [r for r in results if not r.ok]
        assert failed and failed[0].status is PutMessageStatus.CREATE_MAPPED_FILE_FAILED
        assert "No space left on device" in failed[0].error and "00000000000000065536" in failed[0].error
        assert not (tmp_path / "s" / "commitlog" / "00000000000000065536").exists()
        monkeypatch.undo()
        r = store.put(Message("D", b"after"))
        assert r.ok and r.commit_log_offset == 65536
        store.wait_dispatched()
        ok = sum(1 for x in results if x.ok) + 2
        assert store.max_offset_in_queue("D", 0) == ok
    assert run_cli("verify", tmp_path / "s").returncode == 0


def test_warm_mapped_file_enable_warms_only_files_no_writer_has(tmp_path, monkeypatch):
    from rocketstore.storage import mapped_file
    warmed = []
    real = mapped_file.warm
    monkeypatch.setattr(mapped_file, "warm", lambda mf: warmed.append(mf.file_from_offset) or real(mf))
    cfg = StoreConfig(mappedFileSizeCommitLog=64 * 1024, warmMapedFileEnable=True)
    with MessageStore.open(str(tmp_path / "s"), cfg) as store:
        for _ in range(150):
            assert store.put(Message("W", b"w" * 1000)).ok
        store.commitlog.queue.preallocated()
        assert warmed and all(off % 65536 == 0 for off in warmed)
        assert store.wait_dispatched()  # the consume queue is built asynchronously
        assert store.get("W", 0, 0, 1).messages[0].body == b"w" * 1000  # nothing a writer wrote was zeroed
    with MessageStore.open(str(tmp_path / "s"), cfg, read_only=True) as store:
        assert sum(1 for _o, _s, m, _p in store.messages(read_body=False) if m) == 150


def test_live_dispatch_writes_the_consume_queues_a_rebuild_from_the_commitlog_writes(tmp_path):
    """The dispatcher appends runs of handed-over units in one write; the bytes must be those of
    dispatching record by record from the commitlog (what recovery does), across file boundaries."""
    import random
    cfg = StoreConfig(mappedFileSizeCommitLog=256 * 1024, mappedFileSizeConsumeQueue=200)  # 10 units a file
    rnd = random.Random(7)
    path = tmp_path / "s"
    with MessageStore.open(str(path), cfg) as store:
        mixed_puts(store, rnd)
        assert store.wait_dispatched()
    live = {p.relative_to(path): p.read_bytes() for p in sorted((path / "consumequeue").rglob("*")) if p.is_file()}
    assert len(live) > 60
    import shutil
    shutil.rmtree(path / "consumequeue")
    (path / "abort").write_bytes(b"")  # recovery rebuilds the queues from the commitlog
    with MessageStore.open(str(path), cfg) as store:
        assert store.wait_dispatched()
    rebuilt = {p.relative_to(path): p.read_bytes() for p in sorted((path / "consumequeue").rglob("*")) if p.is_file()}
    assert rebuilt == live
    with MessageStore.open(str(path), cfg, read_only=True) as store:
        assert store.query("T", "k3").messages or store.query("U", "k3").messages


def test_put_units_equals_put_unit_one_by_one(tmp_path):
    """Duplicates, a gap and a full file inside one run behave as put_unit does for each unit."""
    from rocketstore.storage.consume_queue import ConsumeQueue
    units = [(100 * i, 50, i % 4, i) for i in range(25)]
    runs = [units[:7], units[5:18], units[20:25]]  # overlap (duplicates) and a gap (18, 19 missing)
    a = ConsumeQueue(str(tmp_path / "a"), "T", 0, 200)
    b = ConsumeQueue(str(tmp_path / "b"), "T", 0, 200)
    os.makedirs(a.directory)
    os.makedirs(b.directory)
    for run in runs:
        offsets, sizes, codes, qoffs = (list(c) for c in zip(*run))
        a.put_units(offsets, sizes, codes, qoffs[0])
        for u in run:
            b.put_unit(*u)
    files = lambda root: {p.name: p.read_bytes() for p in sorted((root / "T" / "0").iterdir())}  # noqa: E731
    assert files(tmp_path / "a") == files(tmp_path / "b")
    assert a.max_physic_offset == b.max_physic_offset and a.max_offset_in_queue == b.max_offset_in_queue


def test_a_failed_segment_write_is_not_acknowledged_and_stops_writes(tmp_path, monkeypatch):
    """Batches are written with pwritev (like RocketMQ's transientStorePool): an I/O error there is a
    put status and a read-only store with the reason, never a SIGBUS, and what was stored stays readable."""
    import errno

    from rocketstore.storage import commitlog
    with MessageStore.open(str(tmp_path / "s")) as store:
        assert store.put_batch([Message("T", b"a" * 100) for _ in range(5)]).ok
        big = store.put(Message("T", b"b" * 5000))  # one record of a page or more takes the same path
        assert big.ok and store.look(big.commit_log_offset).body == b"b" * 5000

        def eio(fd, data, offset):
            raise OSError(errno.EIO, "Input/output error")
        monkeypatch.setattr(commitlog.os, "pwritev", eio)
        r = store.put_batch([Message("T", b"c" * 100) for _ in range(3)])
        assert r.status is PutMessageStatus.UNKNOWN_ERROR and "Input/output error" in r.error
        assert "00000000000000000000" in r.error
        monkeypatch.undo()
        assert store.put(Message("T", b"d")).status is PutMessageStatus.SERVICE_NOT_AVAILABLE
        assert "Input/output error" in store.state()["notWriteableReason"]
        assert store.wait_dispatched()
        got = store.get("T", 0, 0, 32)
        assert [m.body for m in got.messages] == [b"a" * 100] * 5 + [b"b" * 5000]
    assert run_cli("verify", tmp_path / "s").returncode == 0


def test_a_short_gathered_write_is_finished(tmp_path, monkeypatch):
    """pwritev may write less than asked; the rest is written before the put is acknowledged."""
    from rocketstore.storage import commitlog
    real = os.pwritev
    calls = []

    short = short_pwritev(calls)
    with MessageStore.open(str(tmp_path / "s")) as store:
        monkeypatch.setattr(commitlog.os, "pwritev", short)
        msgs = [Message("T", bytes([i]) * (100 + i), keys=f"k{i}") for i in range(40)]
        r = store.put_batch(msgs)
        monkeypatch.setattr(commitlog.os, "pwritev", real)
        assert r.ok and calls
        assert store.wait_dispatched()
        got = store.get("T", 0, 0, 64, max_total_bytes=1 << 20)
        assert [m.body for m in got.messages] == [m.body for m in msgs][:len(got.messages)]
        assert len(got.messages) == 32  # maxTransferCountOnMessageInMemory
        assert store.query("T", "k39").messages[0].body == msgs[39].body
    assert run_cli("verify", tmp_path / "s").returncode == 0


def test_key_less_puts_still_make_the_first_index_file(tmp_path):
    """RocketMQ's dispatcher makes an index file at the first message even when nothing has keys; the handed-over
    batches (one index call per put) do the same, and keyed messages after them are found."""
    with MessageStore.open(str(tmp_path / "s"), StoreConfig(mappedFileSizeCommitLog=1 << 20)) as store:
        assert store.put_batch([Message("T", b"a" * 10) for _ in range(8)]).ok
        assert store.put(Message("T", b"b")).ok
        assert store.wait_dispatched()
        assert len(os.listdir(tmp_path / "s" / "index")) == 1
        r = store.put_batch([Message("T", b"k", keys=f"key-{i}") for i in range(4)])
        assert r.ok and store.wait_dispatched()
        assert store.query("T", "key-3").phy_offsets == [r.commit_log_offset + 3 * (r.wrote_bytes // 4)]
