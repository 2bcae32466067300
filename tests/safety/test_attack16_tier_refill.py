"""The lost-queue refill from the tier attacked (attack16): consume-queue units of records only the tier holds
(retention deleted their local segment once the tier had it) lost to a power cut, or their directory lost."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from helpers.powerloss import SyncShadow, crash_image, rebooted
from helpers.workloads import read_queue
from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.tier.upload import upload_round

SEG = 32 * 1024


def _cfg(tier: Path, **kw) -> StoreConfig:
    base = dict(mappedFileSizeCommitLog=SEG, mappedFileSizeConsumeQueue=10 * 20, maxHashSlotNum=32,
                maxIndexNum=128, warmAheadBytes=0, tieredStoreUri=f"file://{tier}", flushDiskType="SYNC_FLUSH",
                tieredStoreFileReservedTime=0, tieredStoreUploadInterval=3600_000, messageIndexEnable=False)
    base.update(kw)
    return StoreConfig(**base)


def _wait_uploaded(st: MessageStore) -> None:
    """The upload service's first round (0.5 s after the open) puts the sealed segments in the tier."""
    deadline = time.monotonic() + 10
    while not st.tier.manifest or not st.tier.manifest.commitlog:
        assert time.monotonic() < deadline, "the upload service put no segment in the tier"
        time.sleep(0.05)


def _power_cut(root: Path, shadow: Path, image: Path) -> None:
    """Each data file as its last sync left it.  The small state files (tier identity, manifest copy) are
    replaced atomically (temp file, fsync, rename, directory fsync): durable at once, and the shadow, which
    follows no rename, would zero them."""
    fate = crash_image(root, shadow, image)
    for rel, how in fate.items():
        if how == "zeroed" and Path(rel).parts[0] not in ("commitlog", "consumequeue", "index"):
            shutil.copyfile(root / rel, image / rel)


def test_queue_units_of_tier_only_records_are_durable_before_their_segment_leaves_the_disk(tmp_path):
    """Retention deleted a segment the tier holds (a full disk: at once) while the consume-queue units of its
    records were in no synced file yet; a power cut lost them.  Recovery re-dispatches the local segments
    only: the units of the records only the tier holds came back blank and reads skipped those acknowledged
    messages (OFFSET_FOUND_NULL).  A tiered segment now leaves the disk only once its units are flushed."""
    root, tier, image, shadow = tmp_path / "s", tmp_path / "tier", tmp_path / "image", tmp_path / "shadow"
    quiet = _cfg(tier, flushIntervalConsumeQueue=600_000, flushConsumeQueueThoroughInterval=600_000)
    bodies: dict[tuple[str, int], dict[int, bytes]] = {}
    with SyncShadow(root, shadow):
        st = MessageStore.open(str(root), quiet)
        try:
            for i in range(150):  # two queues interleaved, SYNC_FLUSH: durable when acknowledged
                key = ("T", i % 2)
                body = b"m%d|" % i + bytes(400)
                r = st.put(Message(key[0], body, queue_id=key[1]))
                assert r.ok
                bodies.setdefault(key, {})[r.queue_offset] = body
            assert st.wait_dispatched()
            _wait_uploaded(st)
            st.clean_service.delete_expired_commitlog_files(True)
            assert st.commitlog.min_offset() >= SEG
            for key, want in bodies.items():
                assert read_queue(st, *key, start=0) == want
            _power_cut(root, shadow, image)
        finally:
            st.close()
    rebooted(image)
    with MessageStore.open(str(image), _cfg(tier), start_services=False) as st:
        for key, want in bodies.items():
            assert read_queue(st, *key, start=0) == want


def test_a_tiered_segment_whose_records_were_never_dispatched_stays_on_disk(tmp_path):
    """A store opened without services (the CLI's delete-expired, a tool) appends SYNC_FLUSH puts that no
    dispatch places; retention then deleted their segment once the tier held it, and the next open's recovery,
    which walks the local segments only, never placed their units: reads skipped them.  The segment now stays
    until its records are dispatched (the next open's recovery does it)."""
    root, tier = tmp_path / "s", tmp_path / "tier"
    bodies: dict[tuple[str, int], dict[int, bytes]] = {}
    with MessageStore.open(str(root), _cfg(tier), start_services=False) as st:
        for i in range(150):
            key = ("T", i % 2)
            body = b"m%d|" % i + bytes(400)
            r = st.put(Message(key[0], body, queue_id=key[1]))
            assert r.ok
            bodies.setdefault(key, {})[r.queue_offset] = body
        assert upload_round(st.files, max_segments=1)["segments"] == 1
        st.clean_service.delete_expired_commitlog_files(True)
        kept = st.commitlog.min_offset()
    with MessageStore.open(str(root), _cfg(tier), start_services=False) as st:
        for key, want in bodies.items():
            assert read_queue(st, *key, start=0) == want
        st.clean_service.delete_expired_commitlog_files(True)  # dispatched by this open's recovery: it may go
        assert st.commitlog.min_offset() == SEG > kept
        for key, want in bodies.items():
            assert read_queue(st, *key, start=0) == want
    with MessageStore.open(str(root), _cfg(tier), start_services=False) as st:
        for key, want in bodies.items():
            assert read_queue(st, *key, start=0) == want


def test_a_lost_consumequeue_directory_of_a_tiered_store_then_a_power_cut(tmp_path):
    """The whole consumequeue/ directory lost on a tiered store whose first segment only the tier holds, three
    queues interleaved: the open rebuilds every queue from the tier's records then the local ones; new puts take
    queue offsets after every record (none given twice); a power cut while they run loses none of them."""
    root, tier, image, shadow = tmp_path / "s", tmp_path / "tier", tmp_path / "image", tmp_path / "shadow"
    keys = [("T", 0), ("T", 1), ("U", 0)]
    bodies: dict[tuple[str, int], dict[int, bytes]] = {k: {} for k in keys}

    def put(st: MessageStore, i: int) -> None:
        key = keys[i % 3] if i % 7 else keys[0]
        body = b"m%d|" % i + bytes(300 + i % 50)
        r = st.put(Message(key[0], body, queue_id=key[1]))
        assert r.ok and r.queue_offset not in bodies[key]
        bodies[key][r.queue_offset] = body

    with MessageStore.open(str(root), _cfg(tier)) as st:
        for i in range(200):
            put(st, i)
    with MessageStore.open(str(root), _cfg(tier), start_services=False) as st:
        assert upload_round(st.files, max_segments=2)["segments"] == 2
        st.clean_service.delete_expired_commitlog_files(True)
        st.clean_service.clean_consume_queues()
        assert st.commitlog.min_offset() == 2 * SEG
    shutil.rmtree(root / "consumequeue")
    with SyncShadow(root, shadow):
        st = MessageStore.open(str(root), _cfg(tier))
        try:
            for key in keys:
                assert read_queue(st, *key, start=0) == bodies[key]
            for i in range(200, 260):
                put(st, i)
            _power_cut(root, shadow, image)
        finally:
            st.close()
    rebooted(image)
    for _ in range(2):
        with MessageStore.open(str(image), _cfg(tier), start_services=False) as st:
            for key in keys:
                assert read_queue(st, *key, start=0) == bodies[key]


def test_a_queue_whose_only_file_was_lost_is_rebuilt_from_the_records_only_the_tier_holds(tmp_path):
    """A quiet queue's records all in a segment only the tier holds (its one consume-queue file is not full, so
    the tier has no copy of it); the file is lost, its directory stays.  The check for lost first files walked
    the local segments only: it found none of the queue's records, the queue opened empty (0..0) and its five
    acknowledged messages were hidden, though the tier holds them."""
    root, tier = tmp_path / "s", tmp_path / "tier"
    quiet: dict[int, bytes] = {}
    with MessageStore.open(str(root), _cfg(tier)) as st:
        for i in range(5):
            r = st.put(Message("Q", b"q%d" % i, queue_id=3))
            quiet[r.queue_offset] = b"q%d" % i
        for i in range(150):
            assert st.put(Message("T", bytes(400), queue_id=0)).ok
    with MessageStore.open(str(root), _cfg(tier), start_services=False) as st:
        assert upload_round(st.files, max_segments=2)["segments"] == 2
        st.clean_service.delete_expired_commitlog_files(True)
        st.clean_service.clean_consume_queues()
        assert st.commitlog.min_offset() == 2 * SEG
    (only,) = (root / "consumequeue" / "Q" / "3").iterdir()
    only.unlink()
    with MessageStore.open(str(root), _cfg(tier), start_services=False) as st:
        assert read_queue(st, "Q", 3, start=0) == quiet
    with MessageStore.open(str(root), _cfg(tier), read_only=True) as st:
        assert read_queue(st, "Q", 3, start=0) == quiet
    with MessageStore.open(str(root), _cfg(tier), start_services=False) as st:
        assert st.put(Message("Q", b"q5", queue_id=3)).queue_offset == 5
