"""Recovery's tail check after a power loss (codec.tail_problem: a record's topic and properties must be what a
producer writes) attacked with records that are legal but unusual (attack15).

Every record re-checked after a reboot is held to that rule, and one that fails it past the checkpoint's flushed
point is cut as a torn write with everything after it.  So RocketMQ's own stores (tests/golden, written by the Java
store) and legal properties (empty values, unicode, separators inside values, a properties string the caller
built) must pass it: opened after a power loss with the checkpoint counting nothing as flushed, no record is lost
and no commitlog byte changes."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import GOLDEN_CONF, copy_store, golden_store
from helpers.powerloss import rebooted

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.format import codec
from rocketstore.storage.checkpoint import StoreCheckpoint


def _golden_cfg() -> StoreConfig:
    kv = dict(line.split("=") for line in GOLDEN_CONF.split())
    return StoreConfig(**{k: int(v) for k, v in kv.items()})


def _segments(store: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((store / "commitlog").iterdir())}


def _records_end(segs: dict[str, bytes]) -> int:
    """Where the records end, walked as every reader walks them (not the strict tail rule)."""
    end = 0
    for name, data in segs.items():
        base = int(name)
        pos = 0
        for pos, size, parsed, _ in codec.walk(data, 0, len(data), check_crc=True, parsed=True, base=base):
            if size == 0:  # the blank record that ends a segment
                pos = len(data)
                break
            if parsed is None:
                break
            end = base + pos + size
        if pos < len(data):
            break
    return end


def _open_after_power_loss(store: Path, cfg: StoreConfig) -> None:
    cp = StoreCheckpoint.load(str(store / "checkpoint"))
    cp.physicMsgTimestamp = 1  # nothing counted as flushed: every record is held to the tail rule and cut if failing
    cp.flush()
    rebooted(store)
    with MessageStore.open(str(store), cfg, start_services=False) as s:
        report = s.recovery_report
        assert report.abnormal and report.stopped_because is None, report.stopped_because


@pytest.mark.parametrize("name", ["basic", "batch", "ipv6", "txn", "v2"])
def test_a_golden_store_loses_no_record_to_the_tail_rule_after_a_power_loss(tmp_path, name):
    store = copy_store(golden_store(name), tmp_path / "store")
    before = _segments(store)
    end = _records_end(before)
    assert end > 0
    _open_after_power_loss(store, _golden_cfg())
    after = _segments(store)
    assert set(after) >= set(before)
    for seg, data in before.items():
        assert after[seg] == data, f"{name}: commitlog segment {seg} changed"
    with MessageStore.open(str(store), _golden_cfg(), read_only=True) as s:
        assert s.commitlog.max_offset() == end


UNUSUAL = [
    {"k": ""},  # an empty value
    {"ключ": "значение ✓ 𝄞"},  # unicode name and value (non-BMP too)
    {"a b": "x=y;z", "UNIQ_KEY": "", "c": " "},
    {"k": "a\x01b"},  # a value holding the name/value separator: Java's parser splits at the first 0x01
    {"k" * 200: "v" * 3000},
]


def test_legal_but_unusual_properties_survive_the_tail_rule_after_a_power_loss(tmp_path):
    store = tmp_path / "store"
    cfg = StoreConfig(mappedFileSizeCommitLog=64 * 1024, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=64,
                      maxIndexNum=256, flushDiskType="SYNC_FLUSH", warmAheadBytes=0)
    written = []
    with MessageStore.open(str(store), cfg) as s:
        for i, props in enumerate(UNUSUAL):
            r = s.put(Message("TopicU", b"u%d" % i, properties=props, tags="" if i == 0 else None))
            assert r.ok, (props, r.error)
            written.append(r.commit_log_offset)
        r = s.put(Message("TopicU", b"raw", properties_string="TAGS\x01t\x02k\x01\x02"))
        assert r.ok, r.error
        written.append(r.commit_log_offset)
        r = s.put(Message("TopicU", b"last"))  # a plain record after them: cutting at one would lose it too
        assert r.ok
        written.append(r.commit_log_offset)
    before = _segments(store)
    _open_after_power_loss(store, cfg)
    assert _segments(store) == before
    with MessageStore.open(str(store), cfg, read_only=True) as s:
        assert s.max_offset_in_queue("TopicU", 0) == len(written)
        for off in written:
            assert s.look(off).commit_log_offset == off
