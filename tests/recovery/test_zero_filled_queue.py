"""A consume-queue file found all zeros where units were (store model seed 60082, ``all`` ops, ``cq_damage``
tail-zero+reboot from unit 0): missing is not empty (data-safety rule 4), the queue is rebuilt from the commitlog,
the tier's records included."""

from __future__ import annotations

import os
from pathlib import Path

from helpers.workloads import read_queue
from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.tier.upload import upload_round


def _config(tier: Path, **kw) -> StoreConfig:
    return StoreConfig(mappedFileSizeCommitLog=32 * 1024, mappedFileSizeConsumeQueue=10 * 20, maxHashSlotNum=32,
                       maxIndexNum=128, warmAheadBytes=0, tieredStoreUri=f"file://{tier}",
                       tieredStoreFileReservedTime=0, tieredStoreUploadInterval=3600_000, **kw)


def _zero_after_a_reboot(root: Path, qdir: Path) -> None:
    """The queue's only file torn to zeros from its first unit, found after a power cut of another boot."""
    (f,) = qdir.iterdir()
    f.write_bytes(bytes(f.stat().st_size))
    (root / "abort").write_text("")
    (root / "abort.bootid").write_text("another-boot")


def test_a_zero_filled_queue_whose_records_only_the_tier_holds_is_rebuilt(tmp_path):
    """Seed 60082: Quiet-3's records all in segment 0, which retention deleted once the tier held it; its file
    then torn to zeros.  Recovery saw an empty queue (no unit, no hole), re-checked the local log only, and the
    open answered NO_MESSAGE_IN_QUEUE for the acknowledged messages the tier holds (the queue registry said the
    queue had reached offset 5, and new puts took offsets from 6)."""
    root, tier = tmp_path / "s", tmp_path / "tier"
    quiet = {}
    with MessageStore.open(str(root), _config(tier)) as st:
        for i in range(6):
            r = st.put(Message("Quiet", b"q%d" % i, queue_id=3))
            quiet[r.queue_offset] = b"q%d" % i
        for i in range(200):
            assert st.put(Message("Busy", b"b%d|" % i + bytes(400), queue_id=0)).ok
    with MessageStore.open(str(root), _config(tier), start_services=False) as st:  # (no upload round racing)
        assert upload_round(st.files, max_segments=1)["segments"] == 1
    first = sorted((root / "commitlog").iterdir())[0]
    old = first.stat().st_mtime - 3 * 3600
    os.utime(first, (old, old))
    with MessageStore.open(str(root), _config(tier, fileReservedTime=1, deleteCommitLogFilesInterval=0)) as st:
        st.delete_expired_commit_log()
        assert st.commitlog.min_offset() == 32768, "segment 0 (every Quiet-3 record) is in the tier only"
    assert "Quiet/3 6" in (root / "config" / "consumeQueues.registry").read_text()
    _zero_after_a_reboot(root, root / "consumequeue" / "Quiet" / "3")
    with MessageStore.open(str(root), _config(tier)) as st:
        assert read_queue(st, "Quiet", 3) == quiet
        assert st.put(Message("Quiet", b"next", queue_id=3)).queue_offset == 6
    with MessageStore.open(str(root), _config(tier), read_only=True) as st:
        assert read_queue(st, "Quiet", 3) == {**quiet, 6: b"next"}
