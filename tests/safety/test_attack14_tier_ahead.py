"""Attack on a store whose tier is ahead of it (session 13's manifest work: "a stale local manifest with a newer
bucket one"): the store's files restored from a backup taken before later segments went up to the tier.  The
open trusted the bucket's newer tier.json, and new puts were written at commitlog offsets the tier already
holds; once their segment was sealed, the upload skipped it (below the tier's end) and retention deleted it on
the tier's word, so ``get`` returned the tier's older messages at those queue offsets in place of the ones
acknowledged there."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.errors import StoreError
from rocketstore.tier.upload import upload_round


def _cfg(tier: Path, **kw) -> StoreConfig:
    return StoreConfig(mappedFileSizeCommitLog=32 * 1024, mappedFileSizeConsumeQueue=10 * 20, maxHashSlotNum=32,
                       maxIndexNum=128, warmAheadBytes=0, tieredStoreUri=f"file://{tier}",
                       tieredStoreFileReservedTime=0, tieredStoreUploadInterval=3600_000, **kw)


def _put(root: Path, tier: Path, tag: bytes, n: int, start: int) -> None:
    with MessageStore.open(str(root), _cfg(tier)) as st:
        for i in range(start, start + n):
            assert st.put(Message("T", b"%s%d|" % (tag, i) + bytes(400), queue_id=1)).ok
    with MessageStore.open(str(root), _cfg(tier), start_services=False) as st:
        assert upload_round(st.files)["segments"] >= 1


def test_a_store_restored_behind_its_tier_is_refused_before_it_writes_over_the_tiers_offsets(tmp_path):
    root, tier, backup = tmp_path / "s", tmp_path / "tier", tmp_path / "backup"
    _put(root, tier, b"a", 100, 0)
    shutil.copytree(root, backup)
    _put(root, tier, b"old", 150, 100)  # segments the tier holds past where the backup's log ends
    shutil.rmtree(root)
    shutil.copytree(backup, root)
    with pytest.raises(StoreError, match=r"commitlog ends at \d+.*tier.*holds .*up to 98304"):
        MessageStore.open(str(root), _cfg(tier))
    with MessageStore.open(str(root), _cfg(tier), read_only=True) as st:  # a reader writes nothing: it may look
        assert [m.body[:4] for m in st.get("T", 1, 99, 1).messages] == [b"a99|"]
