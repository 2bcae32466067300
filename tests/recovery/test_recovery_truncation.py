"""Issue 16 (items 3-6): what recovery leaves behind after a truncation, a power loss, a reboot or a crash.

Power loss and reboot are simulated by editing the files of a stopped store:
``abort`` present with an ``abort.bootid`` of another boot (so the index files
count as torn), then damage (a flipped bit, a zero-filled consume-queue file).
A process crash is a real SIGKILL of a writer child.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rocketstore import GetMessageStatus, Message, MessageStore, StoreConfig
from rocketstore.storage.consume_queue import CQ_STORE_UNIT_SIZE
from conftest import GOLDEN_CONF, REPO, golden_expected, run_cli

GOLDEN_CFG = StoreConfig(**{k: int(v) for k, v in (line.split("=") for line in GOLDEN_CONF.split())})


def simulate_reboot(store: Path) -> None:
    """Mark the store as left by a process of an earlier OS boot (power loss / reboot)."""
    (store / "abort").write_text("4242")
    (store / "abort.bootid").write_text("00000000-0000-0000-0000-000000000000")


def flip_body_bit(store: Path, e: dict) -> None:
    seg = e["commitLogOffset"] // 1048576 * 1048576
    with open(store / "commitlog" / f"{seg:020d}", "r+b") as fh:
        fh.seek(e["commitLogOffset"] - seg + 88 + e["bodyLength"] // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x40]))


def lose_tail(store: Path, offset: int) -> None:
    """Zero every commitlog byte from ``offset`` on: after a crash of the process alone, damage with intact
    records after it is refused (not truncated), so truncation is exercised at a lost tail."""
    for seg in sorted((store / "commitlog").iterdir()):
        base, size = int(seg.name), seg.stat().st_size
        if base + size > offset:
            with open(seg, "r+b") as fh:
                fh.seek(max(0, offset - base))
                fh.write(bytes(size - max(0, offset - base)))


def set_physic_timestamp(store: Path, ts: int) -> None:
    """The checkpoint's physicMsgTimestamp: records stored after it were not covered by a thorough flush."""
    cp = bytearray((store / "checkpoint").read_bytes())
    cp[0:8] = ts.to_bytes(8, "big")
    (store / "checkpoint").write_bytes(bytes(cp))


def read_queue(store: MessageStore, topic: str, qid: int) -> list:
    out, off = [], store.min_offset_in_queue(topic, qid)
    while (r := store.get(topic, qid, off, 32)).status is GetMessageStatus.FOUND:
        out += r.messages
        off = r.next_begin_offset
    assert off == store.max_offset_in_queue(topic, qid), (topic, qid, off, r.status)
    return out


@pytest.mark.parametrize("crash", ["process", "reboot"])
def test_truncation_zeroes_stale_units_and_index_entries_and_new_keys_are_indexed(basic_copy, crash):
    expected = golden_expected("basic")
    cut = expected[2800]  # in the last segment, where recovery starts from the golden checkpoint
    flip_body_bit(basic_copy, cut)
    if crash == "process":  # the index files are kept: their entries past the cut must go
        lose_tail(basic_copy, cut["commitLogOffset"])
        (basic_copy / "abort").write_text("4242")
        (basic_copy / "abort.bootid").write_text(Path("/proc/sys/kernel/random/boot_id").read_text())
    else:
        simulate_reboot(basic_copy)
    before = [e for e in expected if e["commitLogOffset"] < cut["commitLogOffset"]]
    after = [e for e in expected if e["commitLogOffset"] >= cut["commitLogOffset"]]
    with MessageStore.open(str(basic_copy), GOLDEN_CFG) as store:
        assert store.max_phy_offset() == cut["commitLogOffset"]
        # nothing of the index points at or past the new end, so new keyed messages are indexed again
        for f in store.index_service.files:
            assert all(off < cut["commitLogOffset"] for _h, off, _d, _p in f.entries_iter())
        # 400 KiB of new TopicA-0 messages: the stale units and index entries of the other queues and keys
        # would now point into them
        new = [store.put(Message("TopicA", b"new-%d-" % i + bytes(2000), queue_id=0, keys=f"fresh-{i}"))
               for i in range(200)]
        assert all(r.ok for r in new)
        assert store.wait_dispatched()
    # No unit past a queue's end survived in its file: a clean reopen finds every queue as recovery left it.
    with MessageStore.open(str(basic_copy), GOLDEN_CFG) as store:
        assert not store.recovery_report.abnormal
        for topic, qid in store.queue_keys():
            msgs = read_queue(store, topic, qid)
            assert all((m.topic, m.queue_id) == (topic, qid) for m in msgs)
            want = [e["commitLogOffset"] for e in before if (e["topic"], e["queueId"]) == (topic, qid)]
            if (topic, qid) == ("TopicA", 0):
                want += [r.commit_log_offset for r in new]
            assert [m.commit_log_offset for m in msgs] == want
        for i, r in enumerate(new):
            assert store.query("TopicA", f"fresh-{i}").phy_offsets == [r.commit_log_offset]
        for e in after:  # old keys past the cut: no stale entry answers for them
            for k in e["keys"].split():
                assert all(k in m.keys.split() for m in store.query(e["topic"], k, 64).messages), k
        for e in before[-200:]:
            assert e["commitLogOffset"] in store.query(e["topic"], e["keys"].split()[0], 64).phy_offsets
    for cq_dir in (basic_copy / "consumequeue").glob("*/*"):
        last = max(cq_dir.iterdir())
        data = last.read_bytes()
        end = len(data)
        while end and data[end - CQ_STORE_UNIT_SIZE:end] == bytes(CQ_STORE_UNIT_SIZE):
            end -= CQ_STORE_UNIT_SIZE
        assert bytes(CQ_STORE_UNIT_SIZE) not in [data[p:p + 20] for p in range(0, end, 20)], cq_dir
    assert run_cli("verify", basic_copy).returncode == 0


def _small_store(path: Path, n: int, **kw) -> tuple[StoreConfig, list]:
    kw = {"maxHashSlotNum": 100, "maxIndexNum": 400, **kw}
    cfg = StoreConfig(mappedFileSizeCommitLog=64 * 1024, mappedFileSizeConsumeQueue=200,
                      flushDiskType="SYNC_FLUSH", **kw)
    now = [1.7e9]

    def clock() -> float:  # 5 ms a call: the messages span many seconds, so the checkpoint's times matter
        now[0] += 0.005
        return now[0]
    with MessageStore.open(str(path), cfg, clock=clock) as store:
        rs = [store.put(Message("H", f"m{i}-".encode() * 40, queue_id=i % 2, keys=f"k{i}")) for i in range(n)]
        assert all(r.ok for r in rs)
    return cfg, rs


@pytest.mark.parametrize("n", [200, 2000])  # 2000: the hole lies long before where the checkpoint says to start
def test_power_loss_hole_of_a_zero_filled_consume_queue_file_is_rebuilt(tmp_path, n):
    path = tmp_path / "s"
    cfg, rs = _small_store(path, n)
    # Queue H-0 has 100 units in 10 files; its third file (units 20..29) survives the power loss as zeros.
    hole = path / "consumequeue" / "H" / "0" / f"{20 * CQ_STORE_UNIT_SIZE:020d}"
    hole.write_bytes(bytes(os.path.getsize(hole)))
    simulate_reboot(path)
    with MessageStore.open(str(path), cfg) as store:
        for qid in (0, 1):
            msgs = read_queue(store, "H", qid)
            assert [m.commit_log_offset for m in msgs] == [r.commit_log_offset for r in rs[qid::2]]
            assert [m.queue_offset for m in msgs] == list(range(n // 2))
        assert store.recovery_report.to_json()["queuesRebuilt"] == {"H-0": 20}
        assert store.recovery_report.not_rebuilt == {}
    assert run_cli("verify", path).returncode == 0


def test_reboot_reindexes_the_keys_the_dropped_index_file_held(tmp_path):
    path = tmp_path / "s"
    cfg, rs = _small_store(path, 2300, maxHashSlotNum=300, maxIndexNum=1200)  # the active index file
    # covers many segments (one key a message)
    with MessageStore.open(str(path), cfg, read_only=True) as store:
        active = store.index_service.files[-1]
        assert active.begin_phy_offset < rs[-1].commit_log_offset - 2 * cfg.mappedFileSizeCommitLog
    simulate_reboot(path)
    with MessageStore.open(str(path), cfg) as store:
        assert store.recovery_report.index_files_dropped
        for i, r in enumerate(rs):
            assert store.query("H", f"k{i}").phy_offsets == [r.commit_log_offset], i
    assert run_cli("verify", path).returncode == 0


def test_sigkill_then_recover_indexes_each_message_once(tmp_path):
    path = tmp_path / "store"
    p = subprocess.Popen([sys.executable, str(REPO / "tests" / "helpers" / "writer.py"), str(path), "ASYNC_FLUSH",
                          "0", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    acked = 0
    deadline = time.monotonic() + 60
    while acked < 300 and time.monotonic() < deadline and p.stdout.readline():  # killed mid-run, > 100 acked
        acked += 1
    p.send_signal(signal.SIGKILL)
    out, err = p.communicate(timeout=60)
    assert acked == 300, err.decode()[-2000:]
    assert (path / "abort").exists()
    r = run_cli("recover", path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["recovery"]["abnormal"]
    with MessageStore.open(str(path), read_only=True) as store:
        present = {}
        for qid in range(3):
            for m in read_queue(store, "Kill", qid):
                present[m.keys] = m.commit_log_offset
        assert len(present) > 100
        for key, off in present.items():
            assert store.query("Kill", key, 64).phy_offsets == [off], key


def test_entries_a_crash_left_past_the_index_header_do_not_break_the_chain(tmp_path):
    """A crash between writing a message's index entries and the header: re-indexing it must not link the
    entry to itself (which lost every older key of its hash slot)."""
    import struct
    path = tmp_path / "s"
    cfg = StoreConfig(mappedFileSizeCommitLog=64 * 1024, maxHashSlotNum=1, maxIndexNum=100)  # one chain
    with MessageStore.open(str(path), cfg) as store:
        rs = [store.put(Message("C", b"x" * 100, keys=f"k{i}")) for i in range(11)]
    index_file = next((path / "index").iterdir())
    with open(index_file, "r+b") as fh:  # the header as it was before k10's entry: count and end one back
        begin_ts, _end_ts, begin_phy, _end_phy, slots, count = struct.unpack(">qqqqii", fh.read(40))
        fh.seek(0)
        fh.write(struct.pack(">qqqqii", begin_ts, rs[9].store_timestamp, begin_phy, rs[9].commit_log_offset,
                             slots, count - 1))
    (path / "abort").write_text("4242")
    (path / "abort.bootid").write_text(Path("/proc/sys/kernel/random/boot_id").read_text())
    with MessageStore.open(str(path), cfg) as store:
        for i, r in enumerate(rs):
            assert store.query("C", f"k{i}").phy_offsets == [r.commit_log_offset], i
    conf = tmp_path / "broker.conf"
    conf.write_text("mappedFileSizeCommitLog=65536\nmaxHashSlotNum=1\nmaxIndexNum=100\n")
    assert run_cli("verify", path, "--config", conf).returncode == 0


def test_a_hole_whose_records_are_gone_keeps_later_units_at_their_queue_offsets(tmp_path):
    path = tmp_path / "s"
    cfg, rs = _small_store(path, 600)
    # The first segment is gone (as if expired), and the H-0 file whose units straddle its end is zeros.
    first_kept = cfg.mappedFileSizeCommitLog
    os.unlink(path / "commitlog" / f"{0:020d}")
    straddle = next(r.queue_offset for r in rs[0::2] if r.commit_log_offset >= first_kept) // 10 * 10
    assert rs[2 * straddle].commit_log_offset < first_kept  # the file's first units point into the lost one
    hole = path / "consumequeue" / "H" / "0" / f"{straddle * CQ_STORE_UNIT_SIZE:020d}"
    hole.write_bytes(bytes(os.path.getsize(hole)))
    simulate_reboot(path)
    with MessageStore.open(str(path), cfg) as store:
        assert store.recovery_report.queues_rebuilt == {"H-0": straddle}
        assert store.recovery_report.not_rebuilt == {}
        for qid in (0, 1):
            msgs, off = [], 0
            while off < store.max_offset_in_queue("H", qid):  # units of the lost segment read as removed
                r = store.get("H", qid, off, 32)
                assert r.status in (GetMessageStatus.FOUND, GetMessageStatus.MESSAGE_WAS_REMOVING) and \
                    r.next_begin_offset > off
                msgs += r.messages
                off = r.next_begin_offset
            kept = [(r.queue_offset, r.commit_log_offset) for r in rs[qid::2] if r.commit_log_offset >= first_kept]
            assert [(m.queue_offset, m.commit_log_offset) for m in msgs] == kept
            for qoff, off in kept[::17]:
                assert store.get("H", qid, qoff, 1).messages[0].commit_log_offset == off
        assert store.max_offset_in_queue("H", 0) == 300
    assert run_cli("verify", path).returncode == 0


def test_power_loss_of_a_middle_page_leaves_no_stale_record_past_the_new_end(tmp_path):
    """Pages past a lost one may reach the disk: their records sit at their own positions, and would pass
    every check again once new records end exactly where one of them starts."""
    path = tmp_path / "s"
    cfg, rs = _small_store(path, 150)
    lost = rs[100].commit_log_offset
    seg = path / "commitlog" / f"{0:020d}"
    with open(seg, "r+b") as fh:
        fh.seek(lost)
        fh.write(bytes(8192))
    set_physic_timestamp(path, rs[100].store_timestamp - 1)  # the lost page was never flushed
    simulate_reboot(path)
    with MessageStore.open(str(path), cfg) as store:
        assert store.max_phy_offset() == lost
        assert store.max_offset_in_queue("H", 0) == 50 and store.max_offset_in_queue("H", 1) == 50
    assert seg.read_bytes()[lost:].count(0) == cfg.mappedFileSizeCommitLog - lost
    assert run_cli("verify", path).returncode == 0


def test_truncation_before_the_last_index_file_began_deletes_it_and_cuts_the_one_before(basic_copy):
    from conftest import golden_queries
    cut = next(e for e in golden_expected("basic") if e["commitLogOffset"] > 1200000)  # inside index file 1
    flip_body_bit(basic_copy, cut)
    lose_tail(basic_copy, cut["commitLogOffset"])  # (with intact records after it, a process crash refuses)
    (basic_copy / "abort").write_text("4242")  # a process crash: the index files are kept
    (basic_copy / "abort.bootid").write_text(Path("/proc/sys/kernel/random/boot_id").read_text())
    cp = bytearray((basic_copy / "checkpoint").read_bytes())  # physic and logics times: the flip's
    cp[0:16] = (cut["storeTimestamp"] + 3000).to_bytes(8, "big") * 2  # so the check starts before it
    (basic_copy / "checkpoint").write_bytes(bytes(cp))
    end = cut["commitLogOffset"]
    with MessageStore.open(str(basic_copy), GOLDEN_CFG) as store:
        assert store.max_phy_offset() == end
        files = store.index_service.files
        assert len(files) == 1 and files[0].end_phy_offset < end
        assert max(off for _h, off, _d, _p in files[0].entries_iter()) == files[0].end_phy_offset
        assert store.recovery_report.index_entries_removed > 3816
        for q in golden_queries("basic")["queryMessage"]:
            if q["begin"] == 0 and len(q["resultPhyOffsets"]) < q["maxNum"]:  # every hit of the key
                want = [o for o in q["resultPhyOffsets"] if o < end]
                assert store.query(q["topic"], q["key"], q["maxNum"]).phy_offsets == want, q["key"]
        r = store.put(Message("TopicB", b"after", queue_id=1, keys=cut["keys"]))
        assert store.wait_dispatched()
        assert store.query("TopicB", cut["keys"].split()[0], 64).phy_offsets[-1] == r.commit_log_offset
    assert run_cli("verify", basic_copy).returncode == 0


def test_a_crash_while_a_message_s_keys_span_two_index_files_loses_none_and_doubles_none(tmp_path):
    """The index file fills part-way through a message's keys; the process dies once the next file exists
    but before the rest of the keys are in it."""
    import struct
    path = tmp_path / "s"
    cfg = StoreConfig(mappedFileSizeCommitLog=64 * 1024, maxHashSlotNum=10, maxIndexNum=10)  # 9 entries a file
    keys = [" ".join(f"{c}{i}" for c in "abcd") for i in range(3)]  # 4 keys a message: message 2 spans files
    with MessageStore.open(str(path), cfg) as store:
        rs = [store.put(Message("S", b"x" * 100, keys=k)) for k in keys]
    first, second = sorted((path / "index").iterdir())
    data = second.read_bytes()
    assert struct.unpack_from(">qqqqii", data)[3:] == (rs[2].commit_log_offset, 3, 4)
    m, ts = rs[2].commit_log_offset, rs[2].store_timestamp  # as just created: no entry, ends at message 2
    second.write_bytes(struct.pack(">qqqqii", ts, ts, m, m, 0, 1) + bytes(len(data) - 40))
    (path / "abort").write_text("4242")
    (path / "abort.bootid").write_text(Path("/proc/sys/kernel/random/boot_id").read_text())
    with MessageStore.open(str(path), cfg) as store:
        for r, k in zip(rs, keys):
            for key in k.split():
                assert store.query("S", key).phy_offsets == [r.commit_log_offset], key


def test_consume_queue_units_rebuilt_by_a_clean_recovery_are_flushed_before_the_open_returns(basic_copy, monkeypatch):
    """Recovery advances the checkpoint's logics time as it dispatches: the units must be durable too."""
    from rocketstore.storage import mapped_file
    synced = []
    real = mapped_file.fdatasync

    def recording(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)
    monkeypatch.setattr(mapped_file, "fdatasync", recording)
    os.unlink(basic_copy / "consumequeue" / "TopicC" / "0" / "00000000000000012000")  # lost after a clean exit
    with MessageStore.open(str(basic_copy), GOLDEN_CFG, start_services=False) as store:
        assert not store.recovery_report.abnormal and store.max_offset_in_queue("TopicC", 0) == 604
        assert str(basic_copy / "consumequeue" / "TopicC" / "0" / "00000000000000012000") in synced


@pytest.mark.parametrize("lost", ["last", "middle", "last two"])
def test_reboot_with_a_zero_filled_index_file_indexes_each_key_once(tmp_path, lost):
    """A power loss leaves an index file that was never synced as zeros (header included): recovery must
    re-index from where the files before it end, not from commitlog offset 0 (every key twice), and keys
    the lost file held must be found again."""
    path = tmp_path / "s"
    cfg, rs = _small_store(path, 300, maxHashSlotNum=16, maxIndexNum=64)  # 63 keys a file: 5 files
    files = sorted((path / "index").iterdir())
    assert len(files) == 5
    zeroed = {"last": files[-1:], "middle": files[2:3], "last two": files[-2:]}[lost]
    for f in zeroed:
        f.write_bytes(bytes(f.stat().st_size))
    simulate_reboot(path)
    with MessageStore.open(str(path), cfg) as store:
        for i, r in enumerate(rs):
            assert store.query("H", f"k{i}", 64).phy_offsets == [r.commit_log_offset], i
    assert run_cli("verify", path, "--config", _conf(tmp_path, cfg)).returncode == 0


def _conf(tmp_path: Path, cfg: StoreConfig) -> Path:
    conf = tmp_path / "broker.conf"
    conf.write_text(f"mappedFileSizeCommitLog={cfg.mappedFileSizeCommitLog}\n"
                    f"mappedFileSizeConsumeQueue={cfg.mappedFileSizeConsumeQueue}\n"
                    f"maxHashSlotNum={cfg.maxHashSlotNum}\nmaxIndexNum={cfg.maxIndexNum}\n")
    return conf


def test_reboot_without_a_checkpoint_start_gets_back_the_lost_tail_of_a_queue_that_ended_early(tmp_path):
    """The checkpoint names no start segment: recovery starts one segment before the lowest queue end, not the
    highest, so a queue whose last units a power loss took (while another queue went on for segments) gets
    them back at their own queue offsets."""
    path = tmp_path / "s"
    cfg = StoreConfig(mappedFileSizeCommitLog=64 * 1024, mappedFileSizeConsumeQueue=200, flushDiskType="SYNC_FLUSH",
                      messageIndexEnable=False)  # the index would make recovery start at its own resume point
    with MessageStore.open(str(path), cfg) as store:
        rs = [store.put(Message("H", b"a" * 300, queue_id=0, keys=f"a{i}")) for i in range(57)]
        rs += [store.put(Message("H", b"b" * 300, queue_id=1, keys=f"b{i}")) for i in range(800)]
    assert rs[-1].commit_log_offset - rs[56].commit_log_offset > 3 * cfg.mappedFileSizeCommitLog
    last = path / "consumequeue" / "H" / "0" / f"{50 * CQ_STORE_UNIT_SIZE:020d}"
    data = last.read_bytes()
    last.write_bytes(data[:2 * CQ_STORE_UNIT_SIZE] + bytes(len(data) - 2 * CQ_STORE_UNIT_SIZE))  # units 52..56 lost
    simulate_reboot(path)
    cp = bytearray((path / "checkpoint").read_bytes())
    cp[0:16] = bytes(16)  # physic and logics times: no segment is older, so no start segment
    (path / "checkpoint").write_bytes(bytes(cp))
    with MessageStore.open(str(path), cfg) as store:
        assert store.max_offset_in_queue("H", 0) == 57
        msgs = read_queue(store, "H", 0)
        assert [(m.queue_offset, m.commit_log_offset) for m in msgs] == \
            [(r.queue_offset, r.commit_log_offset) for r in rs[:57]]
    conf = _conf(tmp_path, cfg)
    conf.write_text(conf.read_text() + "messageIndexEnable=false\n")
    assert run_cli("verify", path, "--config", conf).returncode == 0


@pytest.mark.parametrize("index", [False, True])
def test_clean_recovery_gets_back_zeroed_tail_units_whose_records_lie_before_its_scan(tmp_path, index):
    """Fuzz seed 1801196: the tail of a queue's last file zeroed after a clean shutdown.  Recovery scans from
    the segment of the highest queue end, so the queue's next records (in earlier segments) were never
    offered, and the later ones it met were appended at the lost units (a gap): every read of the queue past
    the damage raised, and verify --repair was needed.  The scan now goes back once to where such a queue
    ends."""
    path = tmp_path / "s"
    cfg = StoreConfig(mappedFileSizeCommitLog=64 * 1024, mappedFileSizeConsumeQueue=200, messageIndexEnable=index)
    with MessageStore.open(str(path), cfg) as store:
        rs = [store.put(Message("H", b"a" * 300, queue_id=0, keys=f"a{i}")) for i in range(57)]
        rs += [store.put(Message("H", b"b" * 300, queue_id=1, keys=f"b{i}")) for i in range(800)]
        rs += [store.put(Message("H", b"c" * 300, queue_id=0, keys=f"c{i}")) for i in range(3)]
    assert rs[-1].commit_log_offset - rs[56].commit_log_offset > 3 * cfg.mappedFileSizeCommitLog
    last = path / "consumequeue" / "H" / "0" / f"{50 * CQ_STORE_UNIT_SIZE:020d}"
    data = last.read_bytes()
    last.write_bytes(data[:2 * CQ_STORE_UNIT_SIZE] + bytes(len(data) - 2 * CQ_STORE_UNIT_SIZE))  # units 52..59 lost
    queue0 = rs[:57] + rs[-3:]
    with MessageStore.open(str(path), cfg) as store:
        assert not store.recovery_report.abnormal
        assert store.max_offset_in_queue("H", 0) == 60
        assert [(m.queue_offset, m.commit_log_offset) for m in read_queue(store, "H", 0)] == \
            [(r.queue_offset, r.commit_log_offset) for r in queue0]
        assert len(read_queue(store, "H", 1)) == 800
    conf = _conf(tmp_path, cfg)
    conf.write_text(conf.read_text() + f"messageIndexEnable={str(index).lower()}\n")
    r = run_cli("verify", path, "--config", conf)
    assert r.returncode == 0, r.stdout.decode()[-2000:]


@pytest.mark.parametrize("garbage", [b"\x13\x37" * 4, bytes(8)])  # a header that fails its checks, zeros
def test_clean_recovery_refuses_to_cut_intact_records_after_damage_and_repair_keeps_them(tmp_path, garbage):
    """Fuzz seed 1900075: after a clean shutdown, 8 damaged bytes in a record header of the batch store made
    recovery truncate the log there, zeroing the 38 intact records after it (1 MB) in the last segment.
    A clean shutdown leaves no torn tail, so an intact record after the damage means damage: the writable
    open refuses before any commitlog byte changes, and verify --repair keeps every other record."""
    from conftest import copy_store, golden_store
    from rocketstore.config import golden_config
    from rocketstore.errors import CommitLogDamagedError
    from rocketstore.recovery.repair import repair_store
    root = copy_store(golden_store("batch"), tmp_path / "s")
    seg = root / "commitlog" / "00000000000000000000"
    data = bytearray(seg.read_bytes())
    data[43462:43470] = garbage  # TopicBatch-1 offset 17; 46142 is the next record
    seg.write_bytes(bytes(data))
    with pytest.raises(CommitLogDamagedError, match=r"at commitlog offset 46142\).*verify .* --repair") as e:
        MessageStore.open(str(root), golden_config(), start_services=False)
    assert "43462" in str(e.value)
    assert seg.read_bytes() == bytes(data)
    result = repair_store(str(root), golden_config())
    [span] = result["lost"]
    assert span["offset"] == 43462 and [m["queueOffset"] for m in span["messages"]] == [17]
    assert [p for p in result["problems"] if p["kind"] != "quarantined"] == []
    expected = golden_expected("batch")
    with MessageStore.open(str(root), golden_config(), read_only=True) as store:
        for e in expected:
            if e.get("cqUnit") and e["commitLogOffset"] != 43462:
                [m] = store.get(e["topic"], e["queueId"], e["queueOffset"], 1).messages
                assert m.commit_log_offset == e["commitLogOffset"]


@pytest.mark.parametrize("torn", [2, 4])  # a middle file, the last file
def test_reboot_with_index_entries_lost_below_the_header_s_count_reindexes_them(tmp_path, torn):
    """The header's page reached the disk but a page of entries did not: the file is dropped with the files
    after it and their records re-indexed, so every key is found, once."""
    path = tmp_path / "s"
    cfg, rs = _small_store(path, 300, maxHashSlotNum=16, maxIndexNum=64)
    files = sorted((path / "index").iterdir())
    assert len(files) == 5
    entries = 40 + 4 * 16
    with open(files[torn], "r+b") as fh:
        fh.seek(entries + 10 * 20)
        fh.write(bytes(10 * 20))  # entries 10..19, below the count of the (kept) header
    simulate_reboot(path)
    with MessageStore.open(str(path), cfg) as store:
        for i, r in enumerate(rs):
            assert store.query("H", f"k{i}", 64).phy_offsets == [r.commit_log_offset], i
    assert run_cli("verify", path, "--config", _conf(tmp_path, cfg)).returncode == 0
