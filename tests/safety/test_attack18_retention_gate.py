"""Tiered retention's gate (services/clean.py ``_queue_units_durable``) attacked (attack18).

A segment the tier holds leaves the disk once the consume-queue units of its records are dispatched and
flushed.  The gate read the checkpoint's logicsDispatchedOffset, which also waits for the index: while the
index cannot grow (no file can be made: a full disk), it stays at the first record the index missed.  The
queues were flushed, yet no tiered segment left the disk again: a full disk (the very thing that stops index
files being made) stayed full and the store read-only.  A store without a tier deletes those segments (the
index catch-up skips records below the log's minimum), so the index was never a condition of retention."""

from __future__ import annotations

import errno
from pathlib import Path

from rocketstore import GetMessageStatus, Message, MessageStore, StoreConfig
from rocketstore.storage.index import IndexService
from rocketstore.tier.upload import upload_round

SEG = 32 * 1024


def _cfg(tier: Path) -> StoreConfig:
    return StoreConfig(mappedFileSizeCommitLog=SEG, mappedFileSizeConsumeQueue=10 * 20, maxHashSlotNum=32,
                       maxIndexNum=128, warmAheadBytes=0, tieredStoreUri=f"file://{tier}",
                       flushDiskType="SYNC_FLUSH", tieredStoreFileReservedTime=0,
                       tieredStoreUploadInterval=3600_000, messageIndexEnable=True)


def _no_space(*_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device", "index")


def test_an_index_that_cannot_grow_does_not_keep_tiered_segments_forever(tmp_path, monkeypatch):
    root, tier = tmp_path / "s", tmp_path / "tier"
    monkeypatch.setattr(IndexService, "build_index", _no_space)
    monkeypatch.setattr(IndexService, "build_index_hashes", _no_space)
    bodies = {}
    with MessageStore.open(str(root), _cfg(tier)) as st:
        for i in range(150):
            body = b"m%d|" % i + bytes(400)
            r = st.put(Message("T", body, queue_id=0))
            assert r.ok
            bodies[r.queue_offset] = body
        assert st.wait_dispatched()
        assert st.index_service.missed_from is not None, "the index failed (test precondition)"
        assert upload_round(st.files, max_segments=1)["segments"] == 1
        st.clean_service.delete_expired_commitlog_files(True)
        assert st.commitlog.min_offset() == SEG, \
            "the queues are flushed and the tier holds the segment: it leaves the disk, index or not"
        off = 0
        while off < 150:  # every message still readable (from the tier below the local log)
            r = st.get("T", 0, off, 32)
            assert r.status is GetMessageStatus.FOUND, (off, r.status)
            for m in r.messages:
                assert m.body == bodies[m.queue_offset]
            off = r.next_begin_offset
