"""Issue 5: flush, checkpoint, and recovery after clean and unclean shutdowns."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rocketstore import GetMessageStatus, Message, MessageStore, StoreConfig, StoreLoadError
from rocketstore.storage import mapped_file
from conftest import REPO, golden_expected, golden_store, run_cli

WRITER = REPO / "tests" / "helpers" / "writer.py"


def tear_last_message(store: Path, name: str = "basic") -> dict:
    """Zero-fill the second half of the store's last message and mark the exit unclean (as golden/crash)."""
    last = max(golden_expected(name), key=lambda e: e["commitLogOffset"])
    seg = last["commitLogOffset"] // 1048576 * 1048576
    cut = last["commitLogOffset"] - seg + last["size"] // 2
    with open(store / "commitlog" / f"{seg:020d}", "r+b") as fh:
        fh.seek(cut)
        fh.write(bytes(1048576 - cut))
    (store / "abort").write_text("31961")
    return last


def test_abnormal_recovery_of_a_torn_last_message(basic_copy):
    last = tear_last_message(basic_copy)
    expected = golden_expected("basic")
    previous = max((e for e in expected if e["commitLogOffset"] < last["commitLogOffset"]),
                   key=lambda e: e["commitLogOffset"])
    r = run_cli("recover", basic_copy)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    rec, state = out["recovery"], out["state"]
    assert rec["abnormal"] and rec["processOffset"] == last["commitLogOffset"]
    assert "body CRC mismatch" in rec["stoppedBecause"]
    assert rec["queuesTruncated"] == {f"{last['topic']}-{last['queueId']}": 1}
    assert state["maxPhyOffset"] == last["commitLogOffset"]
    assert state["checkpoint"]["confirmPhyOffset"] == previous["commitLogOffset"]
    q = {(x["topic"], x["queueId"]): x["maxOffsetInQueue"] for x in state["queues"]}
    assert q[(last["topic"], last["queueId"])] == last["queueOffset"]
    assert not (basic_copy / "abort").exists()
    with MessageStore.open(str(basic_copy), read_only=True) as store:
        assert store.query(last["topic"], last["keys"].split()[0]).messages == []
        assert store.query(last["topic"], last["properties"]["UNIQ_KEY"]).messages == []
        readable = 0
        for (topic, qid) in store.queue_keys():
            off = 0
            while (res := store.get(topic, qid, off, 32, read_body=False)).status is GetMessageStatus.FOUND:
                readable += len(res.messages)
                off = res.next_begin_offset
        assert readable == len(expected) - 1
        for e in expected[:50]:
            if e is not last and e["keys"]:
                assert e["commitLogOffset"] in store.query(e["topic"], e["keys"].split()[0], 64).phy_offsets
    # writing resumes with the freed queue offset
    with MessageStore.open(str(basic_copy)) as store:
        res = store.put(Message(last["topic"], b"after", queue_id=last["queueId"]))
        assert res.queue_offset == last["queueOffset"] and res.commit_log_offset == last["commitLogOffset"]
    assert run_cli("verify", basic_copy).returncode == 0


def test_read_only_view_of_a_crashed_store_reports_the_torn_tail(basic_copy):
    last = tear_last_message(basic_copy)
    r = run_cli("dump", basic_copy, "--no-body")
    assert r.returncode == 2 and f"commitlog offset {last['commitLogOffset']}" in r.stderr.decode()
    assert len(r.stdout.decode().splitlines()) == 2999
    assert (basic_copy / "abort").exists()  # read tools change nothing


def test_clean_reopen_keeps_everything(tmp_path):
    path = str(tmp_path / "s")
    cfg = StoreConfig(mappedFileSizeCommitLog=64 * 1024, mappedFileSizeConsumeQueue=400)
    with MessageStore.open(path, cfg) as store:
        for i in range(500):
            store.put(Message("T", os.urandom(300), queue_id=i % 2, keys=f"k{i}"))
    with MessageStore.open(path, cfg) as store:
        assert store.recovery_report.abnormal is False
        assert store.max_offset_in_queue("T", 0) == 250 and store.max_offset_in_queue("T", 1) == 250
        assert store.put(Message("T", b"x")).queue_offset == 250
        assert len(store.query("T", "k499").messages) == 1


def _run_writer(path: Path, flush: str, start: int, count: int, kill_after: float | None):
    p = subprocess.Popen([sys.executable, str(WRITER), str(path), flush, str(start), str(count)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    first = b""
    if kill_after is not None:
        # The kill clock starts at the first acknowledged put, not at the spawn: on a loaded machine the
        # writer's start-up alone can take longer than the shortest kill delay.
        ready, _, _ = select.select([p.stdout], [], [], 60)
        first = p.stdout.readline() if ready else b""
        time.sleep(kill_after)
        p.send_signal(signal.SIGKILL)
    out, err = p.communicate(timeout=120)
    out = first + out
    acked = {}
    for line in out.decode().splitlines():
        parts = line.split()
        if len(parts) == 3:
            acked[int(parts[0])] = (parts[1], int(parts[2]))
    return acked, err


def _read_all(path: Path) -> dict[int, tuple[int, int]]:
    """message number -> (queue id, queue offset), read through the consume queues."""
    seen = {}
    with MessageStore.open(str(path), read_only=True) as store:
        for (topic, qid) in store.queue_keys():
            off = 0
            while (r := store.get(topic, qid, off, 32)).status is GetMessageStatus.FOUND:
                for m in r.messages:
                    n = int(m.body[8:16])
                    assert m.body == f"message-{n:08d}".encode() * (1 + n % 7)
                    assert n not in seen
                    seen[n] = (qid, m.queue_offset)
                off = r.next_begin_offset
    return seen


@pytest.mark.parametrize("flush", ["SYNC_FLUSH", "ASYNC_FLUSH"])
def test_sigkill_at_random_moments(tmp_path, flush):
    rng = random.Random(42)
    path = tmp_path / "store"
    acked_all: dict[int, tuple[str, int]] = {}
    start = 0
    for _round in range(6):
        acked, err = _run_writer(path, flush, start, 100000, kill_after=rng.uniform(0.6, 1.4))
        assert acked, err.decode()[-2000:]
        acked_all.update(acked)
        # reopen (recovery runs), check, and let the next round continue writing
        seen = _read_all(path) if (path / "abort").exists() else {}
        r = run_cli("recover", path)
        assert r.returncode == 0, r.stderr
        seen = _read_all(path)
        ok = {n for n, (status, _) in acked_all.items() if status == "PUT_OK"}
        if flush == "SYNC_FLUSH":
            assert ok <= set(seen), "an acknowledged put was lost"
        present = sorted(seen)
        assert present == list(range(len(present))), "the surviving messages are not a prefix"
        for n in present:
            qid, qoff = seen[n]
            assert qid == n % 3
        for q in range(3):
            offs = sorted(qoff for n, (qid, qoff) in seen.items() if qid == q)
            assert offs == list(range(len(offs))), "queue offsets have a gap"
        v = run_cli("verify", path, "--json")
        assert v.returncode == 0, v.stdout.decode()[:2000]
        start = len(present)


def test_power_loss_drops_unflushed_bytes(tmp_path):
    path = tmp_path / "s"
    cfg = StoreConfig(mappedFileSizeCommitLog=256 * 1024, mappedFileSizeConsumeQueue=2000, flushDiskType="SYNC_FLUSH")
    with MessageStore.open(str(path), cfg) as store:
        rs = [store.put(Message("P", f"m{i}".encode() * 50, keys=f"k{i}")) for i in range(300)]
        assert all(r.ok for r in rs)
        durable = rs[199].commit_log_offset + rs[199].wrote_bytes
    # Simulate losing everything after message 199 (as if never flushed), keep the CQ that points further.
    seg = path / "commitlog" / f"{0:020d}"
    with open(seg, "r+b") as fh:
        fh.seek(durable)
        fh.write(bytes(256 * 1024 - durable))
    (path / "abort").write_text("1")
    with MessageStore.open(str(path), cfg) as store:
        assert store.max_phy_offset() == durable
        assert store.max_offset_in_queue("P", 0) == 200
        assert store.query("P", "k250").messages == [] and len(store.query("P", "k199").messages) == 1
        assert store.put(Message("P", b"next")).queue_offset == 200
    assert run_cli("verify", path).returncode == 0


def test_crc_flip_in_the_middle_truncates_from_there_on_abnormal_start(basic_copy):
    e = golden_expected("basic")[1500]
    seg = e["commitLogOffset"] // 1048576 * 1048576
    with open(basic_copy / "commitlog" / f"{seg:020d}", "r+b") as fh:
        fh.seek(e["commitLogOffset"] - seg + 88 + e["bodyLength"] // 2)  # inside the body
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))
    # A clean store does not re-check old segments: verify finds the flip and recovery is not fooled by it.
    v = run_cli("verify", basic_copy, "--json")
    assert v.returncode == 1 and any(p["offset"] == e["commitLogOffset"] for p in json.loads(v.stdout)["problems"])
    (basic_copy / "abort").write_text("1")
    (basic_copy / "checkpoint").write_bytes(bytes(4096))  # timestamps zero: RocketMQ would start at file 0
    with MessageStore.open(str(basic_copy)) as store:
        rep = store.recovery_report
        assert rep.process_offset == e["commitLogOffset"] and "CRC" in rep.stopped_because
        assert store.max_phy_offset() == e["commitLogOffset"]
    assert run_cli("verify", basic_copy).returncode == 0


def test_missing_and_truncated_consume_queue_files_are_rebuilt(basic_copy):
    cq = basic_copy / "consumequeue" / "TopicC" / "0"
    golden = golden_store("basic") / "consumequeue"
    os.unlink(cq / "00000000000000012000")  # the last file of TopicC-0
    with open(basic_copy / "consumequeue/TopicB/1/00000000000000006000", "r+b") as fh:
        fh.seek((448 - 300) * 20)  # units 448..451 of TopicB-1 torn to zeros
        fh.write(bytes(80))
    with MessageStore.open(str(basic_copy)) as store:
        assert store.max_offset_in_queue("TopicC", 0) == 604 and store.max_offset_in_queue("TopicB", 1) == 452
    assert (cq / "00000000000000012000").read_bytes() == (golden / "TopicC/0/00000000000000012000").read_bytes()
    assert (basic_copy / "consumequeue/TopicB/1/00000000000000006000").read_bytes() == \
        (golden / "TopicB/1/00000000000000006000").read_bytes()
    assert run_cli("verify", basic_copy).returncode == 0


def test_verify_repair_rebuilds_lost_consume_queues_and_index(basic_copy):
    import shutil
    shutil.rmtree(basic_copy / "consumequeue" / "TopicA")
    os.unlink(next((basic_copy / "index").iterdir()))
    r = run_cli("verify", basic_copy, "--json")
    assert r.returncode == 1
    r = run_cli("verify", basic_copy, "--repair", "--json")
    assert r.returncode == 0, r.stdout
    out = json.loads(r.stdout)
    assert out["ok"] and any(x.startswith("consumequeue") for x in out["repaired"])
    golden = golden_store("basic") / "consumequeue"
    for f in golden.rglob("0000*"):
        assert (basic_copy / "consumequeue" / f.relative_to(golden)).read_bytes() == f.read_bytes()
    from conftest import golden_queries
    with MessageStore.open(str(basic_copy), read_only=True) as store:
        for q in golden_queries("basic")["queryMessage"]:
            if q["begin"] == 0:
                assert store.query(q["topic"], q["key"], q["maxNum"]).phy_offsets == q["resultPhyOffsets"]
    r = run_cli("verify", basic_copy, "--repair", "--json")
    assert json.loads(r.stdout)["repaired"] == []  # nothing left to change


def test_checkpoint_of_the_wrong_size_is_quarantined(basic_copy):
    (basic_copy / "checkpoint").write_bytes(b"short")
    with MessageStore.open(str(basic_copy)) as store:
        assert store.max_phy_offset() == 3711299
    assert (basic_copy / "quarantine").is_dir() and os.path.getsize(basic_copy / "checkpoint") == 4096
    r = run_cli("state", basic_copy)
    assert r.returncode == 0
    os.truncate(basic_copy / "checkpoint", 10)
    r = run_cli("state", basic_copy)  # read-only tools refuse instead of fixing
    assert r.returncode == 2 and b"checkpoint is 10 bytes, expected 4096" in r.stderr


def test_stale_lock_from_a_dead_process(tmp_path):
    path = tmp_path / "s"
    acked, _ = _run_writer(path, "ASYNC_FLUSH", 0, 100000, kill_after=0.8)
    assert acked and (path / "abort").exists()
    with MessageStore.open(str(path)) as store:  # the OS released the dead process's lock
        assert store.recovery_report.abnormal
        assert store.put(Message("Kill", b"x", queue_id=0)).ok


def test_flush_error_is_not_acknowledged_and_turns_the_store_read_only(tmp_path, monkeypatch):
    cfg = StoreConfig(mappedFileSizeCommitLog=64 * 1024, flushDiskType="SYNC_FLUSH", syncFlushTimeout=2000)
    store = MessageStore.open(str(tmp_path / "s"), cfg)
    try:
        assert store.put(Message("F", b"ok")).ok

        def failing(fd):
            raise OSError(5, "Input/output error")
        monkeypatch.setattr(mapped_file, "fdatasync", failing)
        r = store.put(Message("F", b"lost?"))
        assert r.status.value == "FLUSH_DISK_TIMEOUT" and "Input/output error" in r.error
        r = store.put(Message("F", b"refused"))
        assert r.status.value == "SERVICE_NOT_AVAILABLE" and "fdatasync" in r.error
        st = store.state()
        assert st["writeable"] is False and "Input/output error" in st["notWriteableReason"]
    finally:
        monkeypatch.undo()
        store.close()
    assert (tmp_path / "s" / "abort").exists()  # an unwritable store keeps abort: next start recovers


def test_sync_flush_group_commit_serves_many_producers(tmp_path):
    cfg = StoreConfig(mappedFileSizeCommitLog=1024 * 1024, flushDiskType="SYNC_FLUSH")
    calls = []
    real = mapped_file.fdatasync

    def counting(fd):
        calls.append(fd)
        real(fd)
    mapped_file.fdatasync = counting
    try:
        import threading
        with MessageStore.open(str(tmp_path / "s"), cfg) as store:
            results = []

            def produce():
                for _ in range(50):
                    results.append(store.put(Message("G", b"x" * 100)))
            ts = [threading.Thread(target=produce) for _ in range(16)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert len(results) == 800 and all(r.ok for r in results)
            assert store.commitlog.queue.flushed_where >= max(r.commit_log_offset for r in results)
    finally:
        mapped_file.fdatasync = real
    assert len(calls) < 800  # one fdatasync served several waiting producers


def test_load_refuses_a_commitlog_file_of_the_wrong_size_read_only_and_quarantines_writable(basic_copy):
    (basic_copy / "commitlog" / "00000000000004194304").write_bytes(b"x" * 100)
    with pytest.raises(StoreLoadError, match="100 bytes, expected 1048576"):
        MessageStore.open(str(basic_copy), read_only=True)
    with MessageStore.open(str(basic_copy)) as store:
        assert store.max_phy_offset() == 3711299
    assert os.listdir(basic_copy / "quarantine") == ["commitlog__00000000000004194304"]
    v = run_cli("verify", basic_copy, "--json")
    assert v.returncode == 1 and json.loads(v.stdout)["problems"][0]["kind"] == "quarantined"
