"""Issue #24 (repair, part 2): a repair of a tiered store keeps the units of the records only the tier holds,
a repair refuses a live writer whose lock file was removed, and a stale record copy is never a message."""
from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from conftest import GOLDEN_CONF, golden_expected, run_cli
from rocketstore.config import StoreConfig, golden_config
from rocketstore.store import MessageStore
from rocketstore.tier.upload import upload_round
from rocketstore.recovery.verify import verify_store
from test_data_safety_repair import assert_every_golden_message_readable

SEG = 1048576


def _tree(root: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and str(p.relative_to(root)) not in skip}


def _tiered(basic_copy: Path, tmp_path: Path) -> tuple[Path, StoreConfig]:
    """The golden store with its 3 sealed segments uploaded to a file:// tier and deleted locally."""
    tier = tmp_path / "tier"
    (basic_copy / "broker.conf").write_text(GOLDEN_CONF + f"tieredStoreUri=file://{tier}\n"
                                            "fileReservedTime=0\ntieredStoreFileReservedTime=0\n")
    cfg = StoreConfig.load(str(basic_copy / "broker.conf"))
    with MessageStore.open(str(basic_copy), cfg, start_services=False) as store:
        assert upload_round(store.files)["segments"] == 3
        for _ in range(10):
            store.clean_service.request_manual_delete()
            store.clean_service.clean_commitlog()
        assert store.min_phy_offset() == 3 * SEG
    assert sorted(os.listdir(basic_copy / "commitlog")) == [f"{3 * SEG:020d}"]
    return tier, cfg


# ---------------------------------------------------------------- 1: the tier is part of the commitlog

def test_verify_repair_of_a_tiered_store_keeps_the_units_of_tier_held_records(basic_copy, tmp_path):
    _tier, cfg = _tiered(basic_copy, tmp_path)
    r = run_cli("verify", "--repair", basic_copy)
    assert r.returncode in (0, 1), r.stderr
    assert b"blank unit" not in r.stdout + r.stderr
    assert_every_golden_message_readable(basic_copy, config=cfg)  # tier-held messages read through their units


def test_verify_repair_refuses_a_tiered_store_whose_tier_cannot_be_read_and_changes_nothing(basic_copy, tmp_path):
    tier, _cfg = _tiered(basic_copy, tmp_path)
    tier.rename(tmp_path / "tier-away")  # the tier is unmounted: it holds the records below the local start
    before = _tree(basic_copy, skip=("lock",))
    r = run_cli("verify", "--repair", basic_copy)
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = r.stderr.decode().strip()
    assert len(err.splitlines()) == 1 and "tier" in err and "refused" in err and "Traceback" not in err, err
    assert _tree(basic_copy, skip=("lock",)) == before


# ---------------------------------------------------------------- 2: a live writer whose lock file was removed

WRITER = """
import sys, time
from rocketstore.config import golden_config
from rocketstore.store import MessageStore
store = MessageStore.open(sys.argv[1], golden_config(), start_services=False)
print("ready", flush=True)
time.sleep(60)
"""


def test_verify_repair_refuses_a_live_writer_whose_lock_file_was_removed(basic_copy):
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(basic_copy)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"ready", p.stderr.read()
        os.unlink(basic_copy / "lock")  # the writer still holds the directory's flock
        before = _tree(basic_copy, skip=("lock",))
        r = run_cli("verify", "--repair", basic_copy)
        assert r.returncode == 2, (r.stdout, r.stderr)
        err = r.stderr.decode().strip()
        assert len(err.splitlines()) == 1 and str(basic_copy / "lock") in err and "locked" in err, err
        assert _tree(basic_copy, skip=("lock",)) == before
        assert not (basic_copy / "quarantine").exists() and not (basic_copy / "repair.json").exists()
    finally:
        p.kill()
        p.wait()


# ---------------------------------------------------------------- 3: a stale record copy is not a message

def _same_size_pair(store_path: Path) -> tuple[dict, dict]:
    """Two records of one segment and one size, the first earlier: the bytes of the first are copied over the
    second (a misdirected write), so the second's position holds a CRC-valid record naming another offset."""
    recs = sorted((e for e in golden_expected("basic") if e["commitLogOffset"] < SEG),
                  key=lambda e: e["commitLogOffset"])
    by_size: dict[int, list[dict]] = {}
    for e in recs:
        by_size.setdefault(e["size"], []).append(e)
    pair = next(v for v in by_size.values() if len(v) >= 2)
    return pair[0], pair[-1]


def test_verify_counts_a_stale_record_copy_as_damage_not_as_a_record(basic_copy):
    src, dst = _same_size_pair(basic_copy)
    seg = basic_copy / "commitlog" / f"{0:020d}"
    data = bytearray(seg.read_bytes())
    data[dst["commitLogOffset"]:dst["commitLogOffset"] + dst["size"]] = \
        data[src["commitLogOffset"]:src["commitLogOffset"] + src["size"]]
    seg.write_bytes(bytes(data))
    with MessageStore.open(str(basic_copy), golden_config(), read_only=True) as store:
        res = verify_store(store.files)
    assert not res["ok"]
    bad = [f for f in res["problems"] if f.get("kind") == "bad-record"]
    assert [f["offset"] for f in bad] == [dst["commitLogOffset"]], bad
    assert "stale record copy" in bad[0]["detail"], bad
    assert res["records"] == len(golden_expected("basic")) - 1  # the copy is not counted (nor cross-checked)
    # the copy's queue offset is held once, by the original record only
    assert Counter(f["kind"] for f in res["problems"]).get("duplicate", 0) == 0
