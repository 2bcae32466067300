"""StoreCheckpoint on its own: write the five fields, flush, reload; the golden page round-trips byte for byte
(cf. RocketMQ's StoreCheckpointTest)."""

from __future__ import annotations

import shutil
import struct

import pytest
from conftest import golden_store

from rocketstore.errors import StoreLoadError
from rocketstore.storage.checkpoint import CHECKPOINT_SIZE, StoreCheckpoint

FIELDS = ("physicMsgTimestamp", "logicsMsgTimestamp", "indexMsgTimestamp", "masterFlushedOffset", "confirmPhyOffset")


def test_write_flush_reload(tmp_path):
    path = str(tmp_path / "checkpoint")
    cp = StoreCheckpoint.load(path)  # missing: created, zeros
    assert (tmp_path / "checkpoint").stat().st_size == CHECKPOINT_SIZE
    assert cp.to_dict() == dict.fromkeys(FIELDS, 0)
    values = dict(zip(FIELDS, (1795375975501, 1795375978312, 1795375976812, 7, 3711299)))
    for k, v in values.items():
        setattr(cp, k, v)
    cp.flush()
    data = (tmp_path / "checkpoint").read_bytes()
    assert len(data) == CHECKPOINT_SIZE
    assert struct.unpack_from(">5q", data) == tuple(values.values())  # big-endian longs at 0, 8, ..., 32
    assert data[40:] == bytes(CHECKPOINT_SIZE - 40)
    again = StoreCheckpoint.load(path)
    assert again.to_dict() == values
    assert again.min_timestamp() == 1795375975501 - 3000
    assert again.min_timestamp_index() == 1795375975501 - 3000


def test_the_recovery_offsets_follow_rocketmqs_fields_and_survive_a_rewrite_of_them(tmp_path):
    """rocketstore's two offsets sit after RocketMQ's five longs, behind a marker: a page without it (RocketMQ's)
    holds none; RocketMQ rewriting its own fields leaves them (older values only move recovery's start back)."""
    path = str(tmp_path / "checkpoint")
    cp = StoreCheckpoint.load(path)
    assert (cp.physicFlushedOffset, cp.logicsDispatchedOffset, cp.recovery_offset()) == (-1, -1, None)
    cp.physicMsgTimestamp, cp.physicFlushedOffset, cp.logicsDispatchedOffset = 17, 9000, 4500
    cp.flush()
    data = bytearray((tmp_path / "checkpoint").read_bytes())
    assert struct.unpack_from(">8sqq", data, 40) == (b"RSTORE01", 9000, 4500)
    struct.pack_into(">5q", data, 0, 99, 98, 97, 0, 5)  # as RocketMQ's StoreCheckpoint.flush writes its page
    (tmp_path / "checkpoint").write_bytes(bytes(data))
    again = StoreCheckpoint.load(path)
    assert (again.physicMsgTimestamp, again.recovery_offset()) == (99, 4500)
    data[40:48] = bytes(8)  # no marker: not ours
    (tmp_path / "checkpoint").write_bytes(bytes(data))
    assert StoreCheckpoint.load(path).recovery_offset() is None


def test_read_only_load_of_a_missing_file_reads_zeros_and_creates_nothing(tmp_path):
    cp = StoreCheckpoint.load(str(tmp_path / "checkpoint"), read_only=True)
    assert cp.to_dict() == dict.fromkeys(FIELDS, 0)
    cp.physicMsgTimestamp = 5
    cp.flush()
    assert not (tmp_path / "checkpoint").exists()


@pytest.mark.parametrize("name", ["basic", "ipv6", "batch", "v2", "txn"])
def test_golden_checkpoint_reloads_and_rewrites_byte_identical(tmp_path, name):
    dst = tmp_path / "checkpoint"
    shutil.copyfile(golden_store(name) / "checkpoint", dst)
    before = dst.read_bytes()
    cp = StoreCheckpoint.load(str(dst))
    assert tuple(cp.to_dict().values()) == struct.unpack_from(">5q", before)
    assert cp.physicMsgTimestamp > 0 and cp.logicsMsgTimestamp > 0
    cp.flush()
    assert dst.read_bytes() == before


@pytest.mark.parametrize("size", [0, 40, CHECKPOINT_SIZE - 1, CHECKPOINT_SIZE + 1])
def test_torn_checkpoint_is_refused_or_handed_to_on_bad(tmp_path, size):
    path = tmp_path / "checkpoint"
    path.write_bytes(b"\x01" * size)
    with pytest.raises(StoreLoadError, match=f"checkpoint is {size} bytes, expected {CHECKPOINT_SIZE}"):
        StoreCheckpoint.load(str(path))
    seen = []

    def quarantine(p: str, why: str) -> None:
        seen.append(why)
        path.rename(tmp_path / "checkpoint.bad")

    cp = StoreCheckpoint.load(str(path), on_bad=quarantine)
    assert seen and "expected 4096" in seen[0]
    assert cp.to_dict() == dict.fromkeys(FIELDS, 0)  # nothing believed from the torn file
    assert path.read_bytes() == bytes(CHECKPOINT_SIZE)  # moved aside, a fresh page written
    assert (tmp_path / "checkpoint.bad").stat().st_size == size


def test_dispatch_marks_kept_restores_both_marks_together(tmp_path):
    """A queue refill dispatches old records out of commitlog order: the two in-memory dispatch marks come back as
    they were after it, also when the refill raises."""
    cp = StoreCheckpoint.load(str(tmp_path / "checkpoint"))
    cp.logics_dispatched, cp.logics_dispatched_end = 1_700_000_000_000, 4096
    with cp.dispatch_marks_kept():
        cp.logics_dispatched, cp.logics_dispatched_end = 1_600_000_000_000, 128
    assert (cp.logics_dispatched, cp.logics_dispatched_end) == (1_700_000_000_000, 4096)
    with pytest.raises(RuntimeError), cp.dispatch_marks_kept():
        cp.logics_dispatched_end = 7
        raise RuntimeError("refill failed")
    assert (cp.logics_dispatched, cp.logics_dispatched_end) == (1_700_000_000_000, 4096)
