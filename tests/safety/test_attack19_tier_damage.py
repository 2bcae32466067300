"""A tiered store whose first segments only the tier holds (attack19): opened or repaired without its tier, and
a lost consume-queue directory rebuilt from a tier whose copy of a segment is damaged or gone: never a queue
read short.  A damaged record is a blank unit whose read
names the loss (CorruptRecordError, not skipped); a segment the bucket lost refuses the open (the rebuild must
read it; its marker stays).  Nothing found: kept because no other test loses the tier's copy under a rebuild."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from helpers.workloads import read_queue
from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.errors import CorruptRecordError, StoreError, StoreLoadError
from rocketstore.recovery.repair import repair_store
from rocketstore.tier.upload import upload_round

from test_attack16_tier_refill import SEG, _cfg  # the same small tiered store


def _tiered_store(root: Path, tier: Path) -> dict[int, bytes]:
    """Queue T/0 over three segments, the first two only in the tier."""
    bodies = {}
    with MessageStore.open(str(root), _cfg(tier)) as st:
        for i in range(200):
            r = st.put(Message("T", b"m%d|" % i + bytes(400), queue_id=0))
            assert r.ok
            bodies[r.queue_offset] = b"m%d|" % i + bytes(400)
    with MessageStore.open(str(root), _cfg(tier), start_services=False) as st:
        assert upload_round(st.files, max_segments=2)["segments"] == 2
        st.clean_service.delete_expired_commitlog_files(True)
        st.clean_service.clean_consume_queues()
        assert st.commitlog.min_offset() == 2 * SEG
    return bodies


def _read_all(root: Path, tier: Path) -> dict[int, bytes]:
    with MessageStore.open(str(root), _cfg(tier), start_services=False) as st:
        return read_queue(st, "T", 0, start=0)


@pytest.mark.parametrize("how", ["damaged", "gone"])
def test_a_lost_queue_rebuilt_from_a_tier_segment_damaged_or_gone_is_never_read_short(tmp_path, how):
    root, tier = tmp_path / "s", tmp_path / "tier"
    bodies = _tiered_store(root, tier)
    seg = tier / "commitlog" / f"{SEG:020d}"
    assert seg.exists(), sorted(p.name for p in (tier / "commitlog").iterdir())
    if how == "damaged":  # a byte of a body in the bucket's copy flipped (the local copy is gone)
        data = bytearray(seg.read_bytes())
        data[1000] ^= 0xFF
        seg.write_bytes(bytes(data))
    else:
        seg.unlink()
    shutil.rmtree(root / "consumequeue")
    if how == "gone":
        with pytest.raises(StoreLoadError, match="the rebuild of consume queues .* must read the records the tier"):
            _read_all(root, tier)
        assert (root / "consumequeue.rebuild").exists()
        return
    with pytest.raises(CorruptRecordError, match="blank unit"):
        _read_all(root, tier)
    with MessageStore.open(str(root), _cfg(tier), start_services=False) as st:  # every other message reads
        got, named = {}, []
        for off in bodies:
            try:
                got.update((m.queue_offset, m.body) for m in st.get("T", 0, off, 1).messages)
            except CorruptRecordError:
                named.append(off)
        assert len(named) == 1 and got == {k: v for k, v in bodies.items() if k not in named}


def test_a_store_that_deleted_segments_on_its_tiers_word_is_refused_without_the_tier(tmp_path):
    """Repaired without tieredStoreUri, a store whose first segments only the tier holds had its queues rebuilt
    from the local records alone: the units of the tier-held messages became blank, and with the tier back a
    read of them named damage (acknowledged messages, intact in the tier, unreadable for good).  Opened
    without it, its first messages read as expired (OFFSET_TOO_SMALL).  Both are refused now, before anything
    changes; with the tier every message reads."""
    root, tier = tmp_path / "s", tmp_path / "tier"
    bodies = _tiered_store(root, tier)
    plain = StoreConfig(mappedFileSizeCommitLog=SEG, mappedFileSizeConsumeQueue=10 * 20, maxHashSlotNum=32,
                        maxIndexNum=128, warmAheadBytes=0, messageIndexEnable=False)
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != "lock"}
    for read_only in (False, True):
        with pytest.raises(StoreLoadError, match="local segments below commitlog offset .* were deleted, but tieredStoreUri is not set"):
            MessageStore.open(str(root), plain, read_only=read_only)
    with pytest.raises(StoreLoadError, match="tieredStoreUri is not set"):
        repair_store(str(root), plain)
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != "lock"} == before
    assert _read_all(root, tier) == bodies


def test_a_receiver_without_the_tier_does_not_skip_the_messages_only_the_tier_holds(tmp_path):
    """A read-only store opened without tieredStoreUri (a receiver process whose config lacks the tier) read
    the queue's tier-held messages as expired: its SimpleConsumer moved group G past all of them and dropped
    the redelivery of one G had received, as 'no longer in the store'; with the tier back, G never saw any of
    them again (131 acknowledged messages skipped)."""
    root, tier = tmp_path / "s", tmp_path / "tier"
    bodies = _tiered_store(root, tier)
    plain = StoreConfig(mappedFileSizeCommitLog=SEG, mappedFileSizeConsumeQueue=10 * 20, maxHashSlotNum=32,
                        maxIndexNum=128, warmAheadBytes=0, messageIndexEnable=False)
    with MessageStore.open(str(root), _cfg(tier)) as st:
        with st.simple_consumer("G", "T", invisible_duration=0.2) as c:
            assert [m.queue_offset for m in c.receive(1)] == [0]  # received, not acked: due again in 0.2 s
    time.sleep(0.3)
    try:
        with MessageStore.open(str(root), plain, read_only=True) as st:
            with st.simple_consumer("G", "T", invisible_duration=0.2) as c:
                c.receive(4)
    except StoreError:
        pass  # refused, or the receive names the tier it cannot see: fine
    seen: dict[int, bytes] = {}
    with MessageStore.open(str(root), _cfg(tier)) as st:
        with st.simple_consumer("G", "T", invisible_duration=0.2) as c:
            deadline = time.monotonic() + 20
            while len(seen) < len(bodies) and time.monotonic() < deadline:
                got = c.receive(32)
                for m in got:
                    seen[m.queue_offset] = m.body
                    c.ack(m)
                if not got:
                    time.sleep(0.05)
    assert sorted(set(bodies) - set(seen)) == []
