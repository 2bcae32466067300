"""Found by the model-based test (tests/safety/test_model_based.py): an unclean start truncated the commitlog at damage
with intact, acknowledged records after it where a clean start refuses; and the put path must never write a
record that recovery would read as torn (tests/safety/test_data_safety_torn.py).

A reboot is simulated by an ``abort`` file whose ``abort.bootid`` names another boot; a crash of the process
alone by one naming this boot (see MessageStore.process_crash_only).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.powerloss import process_crashed, rebooted
from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.format import codec
from rocketstore.storage.checkpoint import StoreCheckpoint
from rocketstore.errors import CommitLogDamagedError

PAGE = 4096


def _cfg() -> StoreConfig:
    return StoreConfig(mappedFileSizeCommitLog=64 * 1024, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=64,
                       maxIndexNum=256, flushDiskType="SYNC_FLUSH", warmAheadBytes=0)


def _fill(store: Path, n: int = 12) -> list[tuple[int, int]]:
    """n messages with tags and keys on one queue (body 700 bytes: records straddle page boundaries), shut
    down cleanly; (position, size) of each record in the first segment."""
    with MessageStore.open(str(store), _cfg(), start_services=False) as s:
        for i in range(n):
            m = Message(topic="TopicT", body=bytes([65 + i % 26]) * 700, queue_id=0, tags="TagB", keys=[f"k{i}"])
            s.put(m)
    seg = sorted((store / "commitlog").iterdir())[0].read_bytes()
    out = []
    for pos, size, parsed, _ in codec.walk(seg, 0, len(seg), check_crc=True, parsed=True):
        if parsed is None or size == 0:
            break
        out.append((pos, size))
    assert len(out) == n
    return out


def _set_physic(store: Path, ts: int) -> None:
    cp = StoreCheckpoint.load(str(store / "checkpoint"))
    cp.physicMsgTimestamp = ts
    cp.flush()


def _damage_middle(store: Path, recs: list[tuple[int, int]]) -> tuple[Path, bytes, int]:
    seg = sorted((store / "commitlog").iterdir())[0]
    data = bytearray(seg.read_bytes())
    pos, size = recs[5]
    h, topic_at, _, _ = codec.parse(data, pos, len(data))
    body_at = topic_at - 1 - h[16]  # (a V1 record: one topic-length byte before the topic)
    data[body_at + 10] ^= 0xFF  # a body byte of the sixth record: BODYCRC fails
    seg.write_bytes(bytes(data))
    return seg, bytes(data), pos


def test_process_crash_refuses_to_cut_intact_records_after_damage(tmp_path):
    """After a crash of the process alone no page can be torn: damage followed by intact records is damage,
    refused exactly as after a clean shutdown (no byte changed)."""
    store = tmp_path / "store"
    recs = _fill(store)
    seg, before, pos = _damage_middle(store, recs)
    process_crashed(store)
    with pytest.raises(CommitLogDamagedError) as e:
        MessageStore.open(str(store), _cfg(), start_services=False)
    assert str(recs[6][0]) in str(e.value) and "verify" in str(e.value) and "--repair" in str(e.value)
    assert seg.read_bytes() == before


def test_power_loss_refuses_to_cut_flushed_records_after_damage(tmp_path):
    """After a reboot, intact records after the damage whose store time is at or before the checkpoint's
    physicMsgTimestamp were flushed: the damage is no torn tail of unflushed writes, so refuse."""
    store = tmp_path / "store"
    recs = _fill(store)
    seg, before, pos = _damage_middle(store, recs)
    _set_physic(store, codec.read_store_timestamp(before, recs[-1][0]))  # a thorough flush covered every record
    rebooted(store)
    with pytest.raises(CommitLogDamagedError) as e:
        MessageStore.open(str(store), _cfg(), start_services=False)
    assert str(recs[6][0]) in str(e.value) and "--repair" in str(e.value)
    assert seg.read_bytes() == before


def test_power_loss_still_truncates_damage_among_unflushed_records(tmp_path):
    """Damage among records the checkpoint does not count as flushed is the torn tail: truncated, as before."""
    store = tmp_path / "store"
    recs = _fill(store)
    seg, before, pos = _damage_middle(store, recs)
    with pytest.raises(codec.RecordError):
        codec.parse(before, pos, len(before), check_crc=True)
    _set_physic(store, codec.read_store_timestamp(before, recs[4][0]) - 1)
    rebooted(store)
    with MessageStore.open(str(store), _cfg(), start_services=False) as s:
        assert s.commitlog.max_offset() == pos
        assert s.max_offset_in_queue("TopicT", 0) == 5


def test_records_a_recovery_synced_count_as_flushed_at_the_next_power_loss(tmp_path):
    """Store model seed 2253: records a crashed writer left unflushed were synced by the recovery of the next open
    (which then closed cleanly), but the checkpoint's physicMsgTimestamp stayed where the crashed writer's last
    thorough flush had left it.  Damage to one of them later, then a power loss: recovery took the durable records
    after the damage for a torn tail of unflushed writes and truncated the log there, deleting them."""
    store = tmp_path / "store"
    recs = _fill(store)
    seg = sorted((store / "commitlog").iterdir())[0]
    _set_physic(store, codec.read_store_timestamp(seg.read_bytes(), recs[0][0]) - 1)  # the writer's last flush
    process_crashed(store)
    with MessageStore.open(str(store), _cfg(), start_services=False) as s:  # recovery syncs what the writer left
        assert s.commitlog.max_offset() == recs[-1][0] + recs[-1][1]
    seg, before, pos = _damage_middle(store, recs)
    rebooted(store)
    with pytest.raises(CommitLogDamagedError) as e:
        MessageStore.open(str(store), _cfg(), start_services=False)
    assert str(recs[6][0]) in str(e.value) and "--repair" in str(e.value)
    assert seg.read_bytes() == before


def test_a_whole_record_with_empty_properties_at_a_page_boundary_is_kept(tmp_path):
    """A record with empty properties ends with its zero properties length: whole, even when that field
    begins right at a page boundary (only a zero byte where the topic or properties end means torn)."""
    probe = tmp_path / "probe"
    with MessageStore.open(str(probe), _cfg(), start_services=False) as s:
        s.put(Message(topic="TopicT", body=b"x" * 700, queue_id=0))
        size = s.commitlog.max_offset()
    store = tmp_path / "store"
    with MessageStore.open(str(store), _cfg(), start_services=False) as s:
        s.put(Message(topic="TopicT", body=b"x" * (PAGE + 2 - 2 * size + 700), queue_id=0))
        s.put(Message(topic="TopicT", body=b"y" * 700, queue_id=0))  # its properties length: the page's first bytes
        assert s.commitlog.max_offset() == PAGE + 2
    seg = sorted((store / "commitlog").iterdir())[0]
    assert codec.torn_tail(seg.read_bytes(), PAGE + 2 - size, PAGE + 2, 0) is None
    rebooted(store)
    with MessageStore.open(str(store), _cfg(), start_services=False) as s:
        assert s.commitlog.max_offset() == PAGE + 2
        assert s.get("TopicT", 0, 1, 1).messages[0].body == b"y" * 700


def test_put_refuses_a_verbatim_properties_string_ending_with_a_zero_byte(tmp_path):
    """Such a record would read as torn after a power cut: the put path never writes one."""
    with MessageStore.open(str(tmp_path / "s"), _cfg(), start_services=False) as s:
        m = Message(topic="TopicT", body=b"x", queue_id=0)
        m.properties_string = "TAGS\x01a\x02\x00"
        assert not s.put(m).ok
        with pytest.raises(codec.RecordError):
            s.encoder.encode(m, 0)
        assert s.commitlog.max_offset() == 0
