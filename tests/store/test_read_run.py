"""Issue 29 point 3: a get decodes runs of units in one ``codec.decode_run`` call.  It must decide exactly what the
unit-at-a-time path (``codec.decode_unit`` and the reader's slow paths) decides, for intact records and for every
single-bit flip in a record's header, topic, properties and body: same status, next offset, messages, or error."""

from __future__ import annotations

import os

import pytest

from rocketstore import CorruptRecordError, Message, MessageStore
from rocketstore.config import StoreConfig
from rocketstore.format import codec

TOPIC = "RunTopic"
N = 12
SEG = "commitlog/00000000000000000000"
VICTIM = 5  # queue offset of the record whose bits are flipped


def _config() -> StoreConfig:
    return StoreConfig(mappedFileSizeCommitLog=32 * 1024, mappedFileSizeConsumeQueue=100 * 20, maxHashSlotNum=32,
                       maxIndexNum=128, warmAheadBytes=0)


def _outcome(store: MessageStore, offset: int, read_body: bool) -> tuple:
    try:
        r = store.get(TOPIC, 0, offset, 32, read_body=read_body)
    except CorruptRecordError as e:
        return ("error", str(e), e.path, e.offset)
    return (r.status, r.next_begin_offset, [m.to_json() for m in r.messages])


def _both(path: str, monkeypatch: pytest.MonkeyPatch, flip: tuple[int, int] | None = None) -> tuple[list, list]:
    """Outcomes of gets from several offsets with the run decoder, then with it off (unit at a time).

    ``flip`` (commitlog offset, bit mask) is applied to the segment after the store is open and undone after:
    the damage a read meets that the open's recovery did not see (which would cut the log there)."""
    runs, units = [], []
    seg = os.path.join(path, SEG)
    with MessageStore.open(path, _config(), read_only=True) as s:
        fd = os.open(seg, os.O_RDWR)
        try:
            if flip is not None:
                old = os.pread(fd, 1, flip[0])
                os.pwrite(fd, bytes([old[0] ^ flip[1]]), flip[0])
            for want in (runs, units):
                if want is units:
                    monkeypatch.setattr(codec, "unit_run_head", lambda topic_bytes: None)
                for off in (0, VICTIM - 1, VICTIM, VICTIM + 1):
                    for read_body in (True, False):
                        want.append(_outcome(s, off, read_body))
                monkeypatch.undo()
        finally:
            if flip is not None:
                os.pwrite(fd, old, flip[0])
            os.close(fd)
    return runs, units


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("run") / "s"
    with MessageStore.open(str(path), _config()) as s:
        for i in range(N):
            s.put(Message(TOPIC, bytes([i]) * (20 + i), keys=f"k{i}", tags="TagA" if i % 2 else "TagB"))
        assert s.wait_dispatched(timeout=30)
        victim = s.get(TOPIC, 0, VICTIM, 1).messages[0]
    return path, victim.commit_log_offset, victim.size


def test_intact_store_reads_the_same_with_and_without_runs(written, monkeypatch):
    path, _, _ = written
    runs, units = _both(str(path), monkeypatch)
    assert runs == units
    assert [m["queueOffset"] for m in runs[0][2]] == list(range(N))  # and the run read them all


def test_every_bit_flip_in_a_record_is_judged_the_same_with_and_without_runs(written, monkeypatch):
    path, phy, size = written
    intact = _both(str(path), monkeypatch)[0]
    differed = 0
    for at in range(size):  # every byte of the record, one bit each
        bit = 1 << (at % 8)
        runs, units = _both(str(path), monkeypatch, (phy + at, bit))
        assert runs == units, f"byte {at} of the record, bit {bit}"
        differed += runs != intact
    assert _both(str(path), monkeypatch)[0] == intact  # each flip was undone
    assert differed > size // 2  # the flips did change what a get sees (the test compares something)
