"""Issue 24, the tier's share of the model-based test's findings: the commitlog is local segments plus the tier's.

- An index rebuild (a damaged index file) reads the records the tier holds too, not the local commitlog alone:
  keys of tier-held records whose index file was never uploaded stay findable (model seed 1027).
- A sealed segment with a damaged record is never uploaded: damage sealed into the tier could not be repaired
  there (model seed 1008).  A walk that meets damage already in the tier resumes after it, as the local walk
  does, instead of losing every message after one bad record.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import GOLDEN_CONF, copy_store, flip_body_bit, golden_expected, golden_store, run_cli
from rocketstore import MessageStore, codec
from rocketstore.errors import StoreError
from rocketstore.tier.upload import upload_round

SEG = 1048576
EXPECTED = golden_expected("basic")
INDEX_HEADER_COUNT = 36  # indexCount's position in an index file's header


def _free_local(store: MessageStore) -> None:
    for _ in range(10):
        store.clean_service.request_manual_delete()
        store.clean_service.clean_commitlog()
        store.clean_service.clean_consume_queues()


def _tiered(tmp_path: Path) -> tuple[Path, Path]:
    """Golden basic with a file:// tier: its 3 sealed segments uploaded and deleted locally.  Of its two index
    files the first (records up to 1838741) goes up; the second, still written, stays local only, and holds the
    keys of the records in [1838741, 3145728) that only the tier holds now."""
    store = copy_store(golden_store("basic"), tmp_path / "store")
    tier = tmp_path / "tier"
    (store / "broker.conf").write_text(GOLDEN_CONF + f"tieredStoreUri=file://{tier}\nfileReservedTime=0\n"
                                       "tieredStoreFileReservedTime=0\n")
    with MessageStore.open(str(store), start_services=False) as s:
        assert upload_round(s)["segments"] == 3
        _free_local(s)
        assert s.min_phy_offset() == 3 * SEG
        assert [i.end_phy_offset for i in s.tier.manifest.index] == [1838741]
    return store, tier


def _damage_index_count(store: Path, which: int) -> str:
    f = sorted((store / "index").iterdir())[which]
    with open(f, "r+b") as fh:
        fh.seek(INDEX_HEADER_COUNT)
        fh.write((40000).to_bytes(4, "big"))
    return f.name


def _unfound(store: MessageStore) -> list[tuple[int, str]]:
    """(commitlog offset, UNIQ_KEY) of each golden message a query by its UNIQ_KEY does not return."""
    out = []
    for e in EXPECTED:
        uniq = e["properties"]["UNIQ_KEY"]
        r = store.query(e["topic"], uniq, 4)
        if e["commitLogOffset"] not in [m.commit_log_offset for m in r.messages]:
            out.append((e["commitLogOffset"], uniq))
    return out


@pytest.mark.parametrize("which", [0, -1])
def test_index_rebuild_reads_the_records_only_the_tier_holds(tmp_path, which):
    """Model seed 1027: an index file damaged (indexCount 40000) is rebuilt on the next writable open.  The
    rebuild walked the local commitlog only, so the 1,002 tier-held records whose index file was never
    uploaded were unfindable by key.  Damaging the first file (the tier holds its copy) or the second (it
    does not): every key is found."""
    store_path, _tier = _tiered(tmp_path)
    _damage_index_count(store_path, which)
    with MessageStore.open(str(store_path), start_services=False) as store:
        assert _unfound(store) == []
    with MessageStore.open(str(store_path), read_only=True) as store:
        assert _unfound(store) == []
    assert not (store_path / "index.rebuild").exists()


def test_index_rebuild_with_the_tier_down_refuses_then_finishes(tmp_path):
    """The rebuild must read tier-held records and the tier is unmounted: index entries go in commitlog order,
    so the tier's records cannot be indexed after the local ones.  The writable open refuses, naming the
    rebuild and the tier, and keeps the marker; with the tier back, the next open finishes the rebuild."""
    store_path, tier = _tiered(tmp_path)
    _damage_index_count(store_path, -1)
    tier.rename(tmp_path / "tier.away")
    with pytest.raises(StoreError, match=r"index.rebuild: the index rebuild must read the records the tier holds "
                                         r"from commitlog offset 1838741.*does not exist"):
        MessageStore.open(str(store_path), start_services=False)
    assert (store_path / "index.rebuild").exists()
    (tmp_path / "tier.away").rename(tier)
    with MessageStore.open(str(store_path), start_services=False) as store:
        assert _unfound(store) == []
    assert not (store_path / "index.rebuild").exists()
