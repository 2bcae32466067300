"""verify (issue 16, items 4-6): holes in consume queues, index keys missing or indexed twice; golden stores clean."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from conftest import GOLDEN_NAMES, copy_store, golden_expected, golden_store, run_cli
from rocketstore.format import codec

SLOTS = 1000  # golden maxHashSlotNum
ENTRIES_BASE = 40 + 4 * SLOTS


def verify(store: Path) -> tuple[int, list[dict]]:
    r = run_cli("verify", store, "--json")
    return r.returncode, json.loads(r.stdout)["problems"]


def last_index_file(store: Path) -> Path:
    return sorted((store / "index").iterdir())[-1]


def index_count(path: Path) -> int:
    return struct.unpack_from(">i", path.read_bytes(), 36)[0]


def set_index_count(path: Path, n: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(36)
        fh.write(struct.pack(">i", n))


def index_keys(e: dict) -> list[str]:
    keys = [f"{e['topic']}#{e['properties']['UNIQ_KEY']}"] if e["properties"].get("UNIQ_KEY") else []
    return keys + [f"{e['topic']}#{k}" for k in (e["keys"] or "").split(" ") if k]


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_golden_stores_verify_clean(name):
    code, problems = verify(golden_store(name))
    assert (code, problems) == (0, [])


def write_unit(cq_file: Path, n: int, unit: bytes = bytes(20)) -> None:
    with open(cq_file, "r+b") as fh:
        fh.seek(n * 20)
        fh.write(unit)


@pytest.mark.parametrize("file_from, unit, end", [(0, 10, 10), (6000, 5, 305)], ids=["first-file", "last-file"])
def test_a_zeroed_unit_among_the_files_recovery_checks_is_a_hole(basic_copy, file_from, unit, end):
    """Recovery checks a queue's last three files and ends it at the first invalid unit, which hides the
    units after it: still a hole."""
    write_unit(basic_copy / "consumequeue" / "TopicA" / "0" / f"{file_from:020d}", unit)
    code, problems = verify(basic_copy)
    assert code == 1
    holes = [p for p in problems if p["kind"] == "cq-hole"]
    assert len(holes) == 1 and holes[0]["offset"] == file_from + unit * 20
    assert f"TopicA-0 ends at unit {end}," in holes[0]["detail"]


@pytest.mark.parametrize("unit", [bytes(20), struct.pack(">qiq", 0, 0x7FFFFFFF, 0)], ids=["zeros", "pre-blank"])
def test_an_invalid_unit_below_the_max_offset_is_a_hole(tmp_path, unit):
    """A hole in a file older than the last three (recovery does not look there) is still found."""
    from rocketstore.config import golden_config
    from rocketstore.format.message import Message
    from rocketstore.store import MessageStore
    path = tmp_path / "s"
    with MessageStore.open(str(path), golden_config()) as store:
        for i in range(1250):  # 4 full CQ files of 300 units and a fifth
            assert store.put(Message("H", b"m%d" % i)).ok
    write_unit(path / "consumequeue" / "H" / "0" / f"{0:020d}", 10, unit)
    code, problems = verify(path)
    assert code == 1
    assert [(p["kind"], p["offset"]) for p in problems] == [("cq-hole", 200), ("cq-missing", problems[1]["offset"])]
    assert "H-0 unit 10 below the queue's max offset 1250" in problems[0]["detail"]


def test_index_entries_missing_for_a_record_are_reported(basic_copy):
    """The last index entries dropped (indexCount lowered): the last message's keys are no longer indexed."""
    f = last_index_file(basic_copy)
    last = max(golden_expected("basic"), key=lambda e: e["commitLogOffset"])
    n = len(index_keys(last))
    set_index_count(f, index_count(f) - n)
    code, problems = verify(basic_copy)
    assert code == 1
    missing = [p for p in problems if p["kind"] == "index-missing"]
    assert {p["offset"] for p in missing} == {last["commitLogOffset"]}
    assert sum(int(p["detail"].split(": ")[1].split()[0]) for p in missing) == n
    # The slots of the dropped entries still name them, past the count, so a query of any key sharing such
    # a slot stops there: the older entries of those chains are unreachable too.
    assert {p["kind"] for p in problems} == {"index-missing", "index-unreachable"}


def test_a_damaged_hash_slot_hides_its_chain_and_is_reported_then_repaired(basic_copy):
    """Fuzz seeds 2002074 and 2002112 (a byte run over an index file's hash slots): every entry still pointed
    at its record, so verify was clean, but a query walks only the chain from its key's slot, and the keys
    of the chains whose slot was overwritten were not found.  verify reports the unreachable entries, and
    verify --repair (which rebuilds the index) makes the keys found again."""
    from rocketstore.config import golden_config
    from rocketstore.recovery.repair import repair_store
    from rocketstore.store import MessageStore
    e = golden_expected("basic")[1234]
    uniq = e["properties"]["UNIQ_KEY"]
    slot = codec.index_key_hash(f"{e['topic']}#{uniq}") % SLOTS
    for f in (basic_copy / "index").iterdir():
        data = bytearray(f.read_bytes())
        data[40 + 4 * slot:44 + 4 * slot] = bytes(4)
        f.write_bytes(bytes(data))
    with MessageStore.open(str(basic_copy), read_only=True) as store:
        assert store.query(e["topic"], uniq).phy_offsets == []
    code, problems = verify(basic_copy)
    assert code == 1 and {p["kind"] for p in problems} == {"index-unreachable"}, problems
    assert "cannot be reached from their hash slot" in problems[0]["detail"]
    result = repair_store(str(basic_copy), golden_config())
    assert result["ok"], result["problems"]
    with MessageStore.open(str(basic_copy), read_only=True) as store:
        assert store.query(e["topic"], uniq).phy_offsets == [e["commitLogOffset"]]


def test_a_duplicate_index_entry_is_reported(basic_copy):
    """The last entry written once more (same key hash and offset) after it."""
    f = last_index_file(basic_copy)
    n = index_count(f)
    data = bytearray(f.read_bytes())
    entry = data[ENTRIES_BASE + 20 * (n - 1):ENTRIES_BASE + 20 * n]
    h, off, diff, _prev = struct.unpack(">iqii", entry)
    data[ENTRIES_BASE + 20 * n:ENTRIES_BASE + 20 * (n + 1)] = struct.pack(">iqii", h, off, diff, n - 1)
    slot = h % SLOTS
    struct.pack_into(">i", data, 40 + 4 * slot, n)
    struct.pack_into(">i", data, 36, n + 1)
    f.write_bytes(bytes(data))
    code, problems = verify(basic_copy)
    assert code == 1
    assert [(p["kind"], p["offset"]) for p in problems] == [("index-duplicate", n)]
    assert f"-> {off}" in problems[0]["detail"]


def test_prepared_records_are_expected_in_the_index_and_rollback_records_are_not(tmp_path):
    """RocketMQ's buildIndex skips only ROLLBACK records (golden txn: PREPARED keys are found by queryMessage)."""
    store = copy_store(golden_store("txn"), tmp_path / "s")
    expected = sorted(golden_expected("txn"), key=lambda e: e["commitLogOffset"])
    f = last_index_file(store)
    # Drop the entries of every record after the last PREPARED one, and one of its own.
    prepared = [e for e in expected if e["sysFlag"] & codec.TRANSACTION_MASK == codec.TRANSACTION_PREPARED][-1]
    after = [e for e in expected if e["commitLogOffset"] > prepared["commitLogOffset"]]
    dropped = sum(len(index_keys(e)) for e in after
                  if e["sysFlag"] & codec.TRANSACTION_MASK != codec.TRANSACTION_ROLLBACK) + 1
    set_index_count(f, index_count(f) - dropped)
    code, problems = verify(store)
    assert code == 1
    flagged = {p["offset"] for p in problems if p["kind"] == "index-missing"}
    indexed = {e["commitLogOffset"] for e in after if e["sysFlag"] & codec.TRANSACTION_MASK != codec.TRANSACTION_ROLLBACK}
    assert flagged == indexed | {prepared["commitLogOffset"]}  # and no ROLLBACK record among them
    assert len(indexed) < len(after)


def test_a_bad_record_is_one_finding_and_the_records_after_it_are_still_checked(basic_copy):
    e = golden_expected("basic")[1500]
    seg = e["commitLogOffset"] // 1048576 * 1048576
    with open(basic_copy / "commitlog" / f"{seg:020d}", "r+b") as fh:
        fh.seek(e["commitLogOffset"] - seg + 88)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x10]))
    r = run_cli("verify", basic_copy, "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 1 and out["records"] == 2999
    assert sorted(p["kind"] for p in out["problems"]) == ["bad-record", "cq-dangling"] + ["index-dangling"] * len(
        index_keys(e))
