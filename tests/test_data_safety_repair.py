"""Issue 24, items 2, 6, 7 and 15 (last point): quarantine never hides trusted records, repair places and never
rewrites an intact record, an interrupted repair leaves the old state or the new, and kept originals are not
problems."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import GOLDEN_CONF, copy_store, golden_expected, golden_store, run_cli
from rocketstore.config import StoreConfig, golden_config
from rocketstore.errors import StoreLoadError
from rocketstore.message import Message
from rocketstore.store import MessageStore

SEG = 1048576
LAST = f"{3 * SEG:020d}"


def read_queue(store: MessageStore, topic: str, qid: int) -> list[tuple[int, int, int]]:
    """(queue offset, commitlog offset, body CRC) of every message a plain consumer reads from offset 0."""
    got, off = [], 0
    while True:
        r = store.get(topic, qid, off, 32)
        if not r.messages:
            break
        got += [(m.queue_offset, m.commit_log_offset, m.body_crc) for m in r.messages]
        off = r.next_begin_offset
    return got


def assert_every_golden_message_readable(path: Path, name: str = "basic", config: StoreConfig | None = None) -> None:
    expected = golden_expected(name)
    with MessageStore.open(str(path), config or golden_config(), read_only=True) as store:
        for key in sorted({(e["topic"], e["queueId"]) for e in expected}):
            want = sorted((e["queueOffset"], e["commitLogOffset"], e["bodyCrc"]) for e in expected
                          if (e["topic"], e["queueId"]) == key and e["sysFlag"] & 0xC in (0, 8))
            assert read_queue(store, *key)[:len(want)] == want, key


# ---------------------------------------------------------------- item 2: a short last segment is torn, not a stray

@pytest.mark.parametrize("size", [1048000, 600000])
@pytest.mark.parametrize("how", ["recover", "put", "open"])
def test_a_short_last_segment_holding_records_is_extended_not_quarantined(basic_copy, tmp_path, size, how):
    """The segment was moved to quarantine/ (exit 0), hiding 454 messages, and the next put took the first
    hidden message's queue offset at commitlog offset 3145728."""
    os.truncate(basic_copy / "commitlog" / LAST, size)
    tail = [e for e in golden_expected("basic") if e["commitLogOffset"] >= 3 * SEG]
    assert len(tail) == 454
    a0 = [e for e in golden_expected("basic") if (e["topic"], e["queueId"]) == ("TopicA", 0)]
    if how == "recover":
        r = run_cli("recover", basic_copy)
        assert r.returncode == 0, r.stderr
    elif how == "put":
        conf = tmp_path / "flush.conf"
        conf.write_text("flushDiskType=SYNC_FLUSH\n")
        r = run_cli("put", basic_copy, "--config", conf, "--topic", "TopicA", "--queue-id", "0", "--body", "new")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["queueOffset"] == len(a0)
        assert json.loads(r.stdout)["commitLogOffset"] == 3711299  # after the last golden record
    else:
        with MessageStore.open(str(basic_copy), golden_config()) as store:
            res = store.put(Message("TopicA", b"new", queue_id=0))
            assert res.ok and (res.queue_offset, res.commit_log_offset) == (len(a0), 3711299)
    assert not (basic_copy / "quarantine").exists()
    assert os.path.getsize(basic_copy / "commitlog" / LAST) == SEG
    assert_every_golden_message_readable(basic_copy)


def test_a_read_only_open_of_a_torn_last_segment_names_it_and_changes_nothing(basic_copy):
    os.truncate(basic_copy / "commitlog" / LAST, 600000)
    with pytest.raises(StoreLoadError, match=r"torn last segment \(600000 of 1048576 bytes\).*rocketstore recover"):
        MessageStore.open(str(basic_copy), golden_config(), read_only=True)
    assert os.path.getsize(basic_copy / "commitlog" / LAST) == 600000
    r = run_cli("get", basic_copy, "--topic", "TopicA", "--queue-id", "0", "--offset", "0")
    assert r.returncode == 2 and r.stderr.count(b"\n") == 1 and b"torn last segment" in r.stderr


def test_a_torn_last_segment_cut_inside_its_records_keeps_those_before_the_cut(basic_copy):
    """Cut at 300000 bytes: the records wholly before the cut stay messages; the log ends there."""
    os.truncate(basic_copy / "commitlog" / LAST, 300000)
    r = run_cli("recover", basic_copy)
    assert r.returncode == 0, r.stderr
    kept = [e for e in golden_expected("basic") if e["commitLogOffset"] + e["size"] <= 3 * SEG + 300000]
    with MessageStore.open(str(basic_copy), golden_config(), read_only=True) as store:
        assert store.max_phy_offset() == max(e["commitLogOffset"] + e["size"] for e in kept)
        for e in kept[-50:]:
            [m] = store.get(e["topic"], e["queueId"], e["queueOffset"], 1).messages
            assert (m.commit_log_offset, m.body_crc) == (e["commitLogOffset"], e["bodyCrc"])
    assert not (basic_copy / "quarantine").exists()


def test_a_last_segment_longer_than_the_segment_size_holding_records_is_not_quarantined(basic_copy):
    """Quarantine never takes a file holding trusted records unless --allow-quarantine says so."""
    with open(basic_copy / "commitlog" / LAST, "ab") as fh:
        fh.write(bytes(4096))
    r = run_cli("recover", basic_copy)
    assert r.returncode == 2 and r.stderr.count(b"\n") == 1 and b"--allow-quarantine" in r.stderr, r.stderr
    assert not (basic_copy / "quarantine").exists()
    assert os.path.getsize(basic_copy / "commitlog" / LAST) == SEG + 4096


def test_a_short_last_segment_without_a_trusted_record_still_goes_to_quarantine(basic_copy):
    """Nothing in it is a message (zeros): the old rule stands, its bytes are kept in quarantine/."""
    (basic_copy / "commitlog" / f"{4 * SEG:020d}").write_bytes(bytes(5000))
    r = run_cli("recover", basic_copy)
    assert r.returncode == 0, r.stderr
    assert os.listdir(basic_copy / "quarantine") == [f"commitlog__{4 * SEG:020d}"]
    assert_every_golden_message_readable(basic_copy)


def test_verify_repair_extends_a_torn_last_segment(basic_copy):
    """repair refused ("repair refuses to guess its records"); a dry run walks it as it is, the repair extends it."""
    os.truncate(basic_copy / "commitlog" / LAST, 600000)
    dry = run_cli("verify", basic_copy, "--repair", "--dry-run", "--json")
    assert os.path.getsize(basic_copy / "commitlog" / LAST) == 600000
    assert json.loads(dry.stdout)["lost"] == []
    r = run_cli("verify", basic_copy, "--repair", "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert os.path.getsize(basic_copy / "commitlog" / LAST) == SEG
    assert_every_golden_message_readable(basic_copy)


# ---------------------------------------------------------------- item 6: place, never shift; never rewrite a record

def _txn_units(path: Path) -> bytearray:
    return bytearray((path / "consumequeue" / "TopicTxn" / "0" / f"{0:020d}").read_bytes())


def _txn_queue() -> list[dict]:
    return sorted((e for e in golden_expected("txn") if e["topic"] == "TopicTxn" and e["sysFlag"] & 0xC in (0, 8)),
                  key=lambda e: e["queueOffset"])


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_swapped_units_are_rebuilt_from_the_records_and_no_record_is_rewritten(tmp_path):
    """Units 6 and 8 swapped: repair wrote the units' queue offsets into the two intact records, after which
    verify said cq-gap/cq-missing and get @6 failed."""
    path = copy_store(golden_store("txn"), tmp_path / "s")
    data = _txn_units(path)
    data[120:140], data[160:180] = data[160:180], data[120:140]
    (path / "consumequeue" / "TopicTxn" / "0" / f"{0:020d}").write_bytes(bytes(data))
    r = run_cli("verify", path, "--repair", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["ok"] and out["problems"] == [], out
    assert out["gaps"] == [] and out["unplaced"] == [] and len(out["suspect"]) == 2
    assert _tree(path / "commitlog") == _tree(golden_store("txn") / "commitlog")
    assert _tree(path / "consumequeue") == _tree(golden_store("txn") / "consumequeue")
    assert json.loads(run_cli("verify", path, "--json").stdout)["problems"] == []
    with MessageStore.open(str(path), golden_config(), read_only=True) as store:
        for e in _txn_queue():
            [m] = store.get("TopicTxn", 0, e["queueOffset"], 1).messages
            assert (m.queue_offset, m.commit_log_offset) == (e["queueOffset"], e["commitLogOffset"])


def test_a_lost_queue_file_and_a_damaged_record_leave_a_gap_not_a_shift(tmp_path):
    """The queue's file lost and the record of queue offset 4 damaged: the rebuild appended record 5 at unit 4
    and every later one an offset down, so every get from offset 4 raised CorruptRecordError."""
    from conftest import flip_body_bit
    path = copy_store(golden_store("txn"), tmp_path / "s")
    queue = _txn_queue()
    lost = queue[4]
    flip_body_bit(path, lost["commitLogOffset"])
    os.unlink(path / "consumequeue" / "TopicTxn" / "0" / f"{0:020d}")
    conf = tmp_path / "golden.conf"
    conf.write_text(GOLDEN_CONF)  # no queue file is left to measure the queue file size from
    out = json.loads(run_cli("verify", path, "--repair", "--json", "--config", conf).stdout)
    with MessageStore.open(str(path), golden_config(), read_only=True) as store:
        for e in queue:
            if e["queueOffset"] != 4:
                [m] = store.get("TopicTxn", 0, e["queueOffset"], 1).messages
                assert (m.queue_offset, m.commit_log_offset, m.body_crc) == (
                    e["queueOffset"], e["commitLogOffset"], e["bodyCrc"])
        got = store.get("TopicTxn", 0, 4, 1).messages
        assert all(m.commit_log_offset != lost["commitLogOffset"] for m in got)  # never the damaged bytes
        assert store.max_offset_in_queue("TopicTxn", 0) == len(queue)  # the next put takes a new offset
    assert out["gaps"] == [{"topic": "TopicTxn", "queueId": 0, "from": 4, "to": 4}]
    assert not [p for p in out["problems"] if p["kind"] in ("cq-gap", "cq-missing", "cq-mismatch")], out["problems"]


# ---------------------------------------------------------------- item 15: kept originals are not problems

def test_verify_after_a_repair_that_lost_a_record_lists_the_kept_originals_and_is_ok(basic_copy):
    """verify said INCONSISTENT ("quarantined") after every repair that lost a record, until the operator
    deleted quarantine/repair-* by hand, though the store the repair left was whole."""
    from conftest import flip_body_bit
    bad = golden_expected("basic")[1500]
    flip_body_bit(basic_copy, bad["commitLogOffset"], f"commitlog/{bad['commitLogOffset'] // SEG * SEG:020d}")
    assert run_cli("verify", basic_copy, "--repair").returncode == 1  # the repair itself reports the loss
    r = run_cli("verify", basic_copy, "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["ok"] and out["problems"] == [], out["problems"]
    [kept] = out["kept"]
    assert os.path.basename(kept["file"]).startswith("repair-") and "1 damaged span" in kept["detail"]
    table = run_cli("verify", basic_copy)
    assert table.returncode == 0 and b"originals kept by verify --repair" in table.stdout
    assert table.stdout.rstrip().endswith(b"OK")
    # A stray file moved aside at open is still a problem: it may hold what the operator must look at.
    (basic_copy / "quarantine" / "commitlog__junk").write_bytes(b"x")
    assert run_cli("verify", basic_copy).returncode == 1
