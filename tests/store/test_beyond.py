"""Issue 10: where rocketstore goes beyond RocketMQ (file format unchanged)."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rocketstore import GetMessageStatus, Message, MessageStore, StoreConfig
from rocketstore.storage.jsonfile import read_json, write_json_atomic
from conftest import REPO, golden_expected, golden_store, run_cli


def _append_at_end(store_dir, record: bytes) -> int:
    """Write bytes right after the last message of golden/basic's last segment; return that offset."""
    end = 3711299
    seg = end // 1048576 * 1048576
    with open(store_dir / "commitlog" / f"{seg:020d}", "r+b") as fh:
        fh.seek(end - seg)
        fh.write(record)
    return end


def test_a_valid_record_at_the_wrong_position_is_not_accepted(basic_copy):
    """A stale record (valid magic, size and CRC) left in a reused segment must not come back after a crash."""
    e = golden_expected("basic")[10]
    with open(golden_store("basic") / "commitlog" / f"{0:020d}", "rb") as fh:
        fh.seek(e["commitLogOffset"])
        stale = fh.read(e["size"])
    end = _append_at_end(basic_copy, stale)
    (basic_copy / "abort").write_text("1")
    with MessageStore.open(str(basic_copy)) as store:
        rep = store.recovery_report
        assert rep.process_offset == end and "PHYSICALOFFSET" in rep.stopped_because
        assert store.max_phy_offset() == end
        assert store.max_offset_in_queue(e["topic"], e["queueId"]) == \
            golden_store_state("basic")[(e["topic"], e["queueId"])]
    seg = basic_copy / "commitlog" / f"{end // 1048576 * 1048576:020d}"
    with open(seg, "rb") as fh:  # and the stale bytes are zeroed, so they cannot line up with a later write
        fh.seek(end % 1048576)
        assert fh.read(len(stale)) == bytes(len(stale))


def golden_store_state(name):
    from conftest import golden_queries
    return {(q["topic"], q["queueId"]): q["maxOffsetInQueue"] for q in golden_queries(name)["storeState"]["queues"]}


def test_torn_message_followed_by_old_valid_records(basic_copy):
    last = max(golden_expected("basic"), key=lambda x: x["commitLogOffset"])
    seg = last["commitLogOffset"] // 1048576 * 1048576
    path = basic_copy / "commitlog" / f"{seg:020d}"
    data = bytearray(path.read_bytes())
    pos = last["commitLogOffset"] - seg
    old = bytes(data[pos - 5000:pos])  # older, valid records
    data[pos + last["size"] // 2:pos + last["size"]] = bytes(last["size"] - last["size"] // 2)  # torn
    data[pos + last["size"]:pos + last["size"] + len(old)] = old
    path.write_bytes(bytes(data))
    (basic_copy / "abort").write_text("1")
    with MessageStore.open(str(basic_copy)) as store:
        assert store.max_phy_offset() == last["commitLogOffset"]
        n = store.put(Message(last["topic"], b"z" * 10, queue_id=last["queueId"]))
        assert n.ok
    with MessageStore.open(str(basic_copy), read_only=True) as store:
        offsets = [o for o, _s, m, _p in store.messages(read_body=False) if m is not None]
    assert offsets[-1] == last["commitLogOffset"] and len(offsets) == 3000  # 2999 + the new one, nothing stale


def test_check_crc_on_recover_false_reads_headers_only(basic_copy, monkeypatch):
    last = max(golden_expected("basic"), key=lambda x: x["commitLogOffset"])
    seg = last["commitLogOffset"] // 1048576 * 1048576
    with open(basic_copy / "commitlog" / f"{seg:020d}", "r+b") as fh:
        fh.seek(last["commitLogOffset"] - seg + 88 + 1)
        fh.write(b"\xee")
    (basic_copy / "abort").write_text("1")
    import zlib
    from rocketstore.format import codec
    calls = []
    real = zlib.crc32
    monkeypatch.setattr(codec.zlib, "crc32", lambda b, *a: calls.append(len(b)) or real(b, *a))
    cfg = StoreConfig(mappedFileSizeCommitLog=1048576, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=1000,
                      maxIndexNum=4000, checkCRCOnRecover=False)
    store = MessageStore.open(str(basic_copy), cfg, start_services=False)
    try:
        assert calls == []  # no body was read, so nothing was CRC'd
        assert store.max_phy_offset() == 3711299  # the flipped body passes a header-only check
    finally:
        store.close()


def test_stale_checkpoint_does_not_restart_from_file_zero(basic_copy):
    """After a crash of the process alone (same boot: every unit it wrote is intact) the queues and the index
    say how far dispatch got.  After a reboot they do not (a quiet queue's file may be zeros): see
    test_data_safety_powerloss.py, where the same checkpoint re-dispatches from the first segment."""
    cp = bytearray((basic_copy / "checkpoint").read_bytes())
    cp[0:16] = bytes(16)  # physicMsgTimestamp and logicsMsgTimestamp lost; indexMsgTimestamp kept
    (basic_copy / "checkpoint").write_bytes(bytes(cp))
    (basic_copy / "abort").write_text("1")
    (basic_copy / "abort.bootid").write_text(Path("/proc/sys/kernel/random/boot_id").read_text())
    with MessageStore.open(str(basic_copy), start_services=False) as store:
        rep = store.recovery_report
        assert rep.abnormal and rep.start_offset > 0  # not 0: the queues and index say how far it got
        assert store.max_phy_offset() == 3711299
        assert len(store.query("TopicA", "hot-key", 64).messages) == 64
    assert run_cli("verify", basic_copy).returncode == 0


def test_recovery_progress_is_logged(basic_copy, caplog, monkeypatch):
    from rocketstore.recovery import recover as recovery
    monkeypatch.setattr(recovery, "PROGRESS_INTERVAL_S", 0.0)
    (basic_copy / "abort").write_text("1")
    (basic_copy / "checkpoint").write_bytes(bytes(4096))
    monkeypatch.setattr(recovery, "_start_file", lambda *a: 0)
    with caplog.at_level(logging.INFO, logger="rocketstore.recovery.recover"):
        MessageStore.open(str(basic_copy), start_services=False).close()
    lines = [r.getMessage() for r in caplog.records if "bytes checked" in r.getMessage()]
    assert lines and "MB/s" in lines[0] and "segment" in lines[0]


def test_killing_recovery_repeatedly_never_prevents_the_next_start(tmp_path):
    from recovery.test_recovery import _read_all, _run_writer
    path = tmp_path / "s"
    acked, _ = _run_writer(path, "SYNC_FLUSH", 0, 100000, kill_after=1.5)
    ok = {n for n, (st, _q) in acked.items() if st == "PUT_OK"}
    rng = random.Random(7)
    for _ in range(8):
        p = subprocess.Popen([sys.executable, "-m", "rocketstore", "recover", str(path)], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.05, 0.6))
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    r = run_cli("recover", path)
    assert r.returncode == 0, r.stderr
    seen = _read_all(path)
    assert ok <= set(seen)
    assert run_cli("verify", path).returncode == 0


def test_stray_files_are_quarantined_and_listed(basic_copy):
    (basic_copy / "consumequeue" / "TopicA" / "0" / "garbage.tmp").write_bytes(b"junk")
    (basic_copy / "consumequeue" / "TopicA" / "1" / "00000000000000012000").write_bytes(b"")  # empty last
    (basic_copy / "consumequeue" / "TopicB" / "0" / "00000000000000012000").write_bytes(b"x" * 10)
    with MessageStore.open(str(basic_copy)) as store:
        assert store.max_offset_in_queue("TopicB", 0) == 415
    q = sorted(os.listdir(basic_copy / "quarantine"))
    assert q == ["consumequeue__TopicA__0__garbage.tmp", "consumequeue__TopicB__0__00000000000000012000"]
    out = json.loads(run_cli("verify", basic_copy, "--json").stdout)
    assert {p["kind"] for p in out["problems"]} == {"quarantined"} and len(out["problems"]) == 2


def test_json_files_are_atomic_with_a_backup(tmp_path, caplog):
    p = tmp_path / "config" / "consumerOffset.json"
    write_json_atomic(str(p), {"offsetTable": {"T@g": {"0": 1}}})
    write_json_atomic(str(p), {"offsetTable": {"T@g": {"0": 2}}})
    assert json.loads(p.read_text())["offsetTable"]["T@g"]["0"] == 2
    assert json.loads((tmp_path / "config" / "consumerOffset.json.bak").read_text())["offsetTable"]["T@g"]["0"] == 1
    p.write_text('{"offsetTable": {"T@g": {"0": 3')  # torn by a power cut
    with caplog.at_level(logging.WARNING):
        assert read_json(str(p))["offsetTable"]["T@g"]["0"] == 1
    assert "using" in caplog.text and ".bak" in caplog.text
    assert not list((tmp_path / "config").glob("*.tmp"))


def test_dump_seeks_by_time_and_limits(tmp_path):
    expected = sorted(golden_expected("basic"), key=lambda e: e["commitLogOffset"])
    mid = expected[1500]["storeTimestamp"]
    to = expected[1700]["storeTimestamp"]
    r = run_cli("dump", golden_store("basic"), "--no-body", "--from-time", mid, "--to-time", to)
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    want = [e["commitLogOffset"] for e in expected if mid <= e["storeTimestamp"] <= to]
    assert [x["commitLogOffset"] for x in rows] == want
    r = run_cli("dump", golden_store("basic"), "--no-body", "--topic", "TopicB", "--from-time", mid,
                "--max-messages", "3")
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    assert [x["commitLogOffset"] for x in rows] == [e["commitLogOffset"] for e in expected
                                                    if e["topic"] == "TopicB" and e["storeTimestamp"] >= mid][:3]
    r = run_cli("dump", golden_store("basic"), "--no-body", "--max-bytes", "5000")
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    assert sum(x["size"] for x in rows[:-1]) < 5000 <= sum(x["size"] for x in rows)
    with MessageStore.open(str(golden_store("basic")), read_only=True) as store:
        start = store.seek_offset("TopicB", mid)
        assert start == min(e["commitLogOffset"] for e in expected if e["topic"] == "TopicB"
                            and e["storeTimestamp"] >= mid)


def _rss_of(path: str) -> int:
    total, inside = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def test_scans_drop_the_pages_they_read_behind_them():
    with MessageStore.open(str(golden_store("basic")), read_only=True) as store:
        first = os.path.realpath(store.commitlog.queue.files[0].path)  # smaps shows resolved paths
        for _ in store.messages(read_body=True):
            pass
        kept = _rss_of(first)
        for _ in store.messages(read_body=True, drop_cache=True):
            pass
        assert kept > 500 and _rss_of(first) < kept / 4


def test_stats_live_shows_latency_lock_and_lags(tmp_path):
    path = tmp_path / "s"
    with MessageStore.open(str(path), StoreConfig(mappedFileSizeCommitLog=1 << 20)) as store:
        for i in range(2000):
            store.put(Message("Live", b"x" * 100))
        deadline = time.time() + 10
        while not (path / "metrics.json").exists() and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(1.2)
        r = run_cli("stats", path, "--live", "--count", "1", "--json")
        assert r.returncode == 0, r.stderr
        m = json.loads(r.stdout)
        # every put is counted, one in SAMPLE_EVERY (16) is timed
        assert m["puts"] == 2000 and m["putLatency"]["p99Ms"] > 0 and m["lockHold"]["count"] == 2000 // 16
        assert {"flushLagBytes", "dispatchBehindBytes", "disk"} <= set(m)
        r = run_cli("stats", path, "--live", "--count", "2", "--interval", "0.1")
        assert r.returncode == 0 and b"lock p99 ms" in r.stdout and b"writeable" in r.stdout
    r = run_cli("stats", path, "--live", "--count", "1")
    assert r.returncode == 2 and b"no live metrics" in r.stderr
    r = run_cli("stats", path, "--json")
    assert json.loads(r.stdout)["topics"] == {"Live": 2000}


def test_per_topic_logical_retention(tmp_path):
    path = tmp_path / "s"
    now = int(time.time() * 1000)
    cfg = StoreConfig(mappedFileSizeCommitLog=1 << 20, topicRetentionMs="Short:3600000")
    with MessageStore.open(str(path), cfg) as store:
        for i in range(10):  # five messages two hours old, five fresh (store times kept, as import does)
            ts = now - 7200_000 if i < 5 else now
            for topic in ("Short", "Long"):
                assert store.put(Message(topic, b"x", store_timestamp=ts + i)).ok
        store.wait_dispatched()
        store.clean_service.clean_consume_queues()
        assert store.min_offset_in_queue("Short", 0) == 5 and store.min_offset_in_queue("Long", 0) == 0
        r = store.get("Short", 0, 0, 32)
        assert (r.status, r.next_begin_offset) == (GetMessageStatus.OFFSET_TOO_SMALL, 5)
    r = run_cli("retention", path, "--json", "--config", _conf(tmp_path, "topicRetentionMs=Short:3600000\n"))
    plan = json.loads(r.stdout)
    assert plan["topicRetention"] == [{"topic": "Short", "queueId": 0, "topicRetentionMs": 3600000,
                                       "physicalMinOffset": 0, "logicalMinOffset": 5, "maxOffset": 10}]
    assert len(os.listdir(path / "commitlog")) == 1  # files are untouched


def _conf(tmp_path, text):
    p = tmp_path / "r.conf"
    p.write_text("mappedFileSizeCommitLog=1048576\n" + text)
    return p


def test_index_survives_a_process_crash_but_is_rebuilt_after_a_reboot(tmp_path):
    from recovery.test_recovery import _run_writer
    path = tmp_path / "s"
    acked, _ = _run_writer(path, "ASYNC_FLUSH", 0, 100000, kill_after=1.2)
    assert (path / "abort").exists() and (path / "abort.bootid").exists()
    import shutil
    shutil.copytree(path, tmp_path / "rebooted")
    (tmp_path / "rebooted" / "abort.bootid").write_text("another-boot")
    keys = [f"key-{n}" for n in sorted(acked)[:: max(1, len(acked) // 50)]]
    found = {}
    for name in ("s", "rebooted"):
        with MessageStore.open(str(tmp_path / name), start_services=False) as store:
            rep = store.recovery_report
            if name == "s":
                assert rep.index_files_dropped == []  # same boot: the maps' bytes are all there
            else:
                assert rep.index_files_dropped  # rebooted: index files newer than the checkpoint are rebuilt
            found[name] = [store.query("Kill", k).phy_offsets for k in keys]
        assert not (tmp_path / name / "abort.bootid").exists()
    assert found["s"] == found["rebooted"] and all(len(x) == 1 for x in found["s"])


def test_an_unfinished_index_file_creation_never_blocks_an_open(tmp_path, monkeypatch):
    """A crash or a full disk while an index file is created leaves no file that stops the next open."""
    import errno

    from rocketstore.storage import index as index_mod
    path = tmp_path / "s"
    with MessageStore.open(str(path)) as store:
        for i in range(30):
            assert store.put(Message("T", b"x", keys=f"k{i}")).ok
        store.wait_dispatched()
        real = index_mod.IndexFile

        def full_disk(p, *a, create=False, **kw):
            if create:
                open(p, "wb").close()  # creation got as far as making the file
                raise OSError(errno.ENOSPC, "No space left on device", p)
            return real(p, *a, **kw)
        monkeypatch.setattr(index_mod, "IndexFile", full_disk)
        monkeypatch.setattr(real, "is_full", lambda self: True)  # the next key needs a new file
        with pytest.raises(OSError):
            store.index_service.build_index("T", 10 ** 9, 0, 0, None, "late")
        monkeypatch.undo()
        assert not list((path / "index").glob("*.tmp"))
    # A leftover from a crash in the middle of the creation: read-only opens skip it, a writer removes it.
    stray = path / "index" / "20261123010203004.tmp"
    stray.write_bytes(b"\0" * 100)
    assert run_cli("verify", path).returncode == 0
    assert stray.exists()
    with MessageStore.open(str(path)) as store:
        assert store.query("T", "k3").messages
    assert not stray.exists()
