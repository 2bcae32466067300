"""Issue 29 point 3: a get decodes runs of units in one ``codec.decode_run`` call.  It must decide exactly what the
unit-at-a-time path (``codec.decode_unit`` and the reader's slow paths) decides, for intact records and for every
single-bit flip in a record's header, topic, properties and body: same status, next offset, messages, or error."""

from __future__ import annotations

import base64
import contextlib
import os
from collections.abc import Iterator

import pytest

from rocketstore import CorruptRecordError, Message, MessageStore, StoreError
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


def _both(path: str, monkeypatch: pytest.MonkeyPatch, flip: tuple[int, int] | None = None,
          victim: int = VICTIM) -> tuple[list, list]:
    """Outcomes of gets from several offsets with the run decoder, then with it off (unit at a time).

    ``flip`` (commitlog offset, bit mask) is applied to the segment after the store is open and undone after:
    the damage a read meets that the open's recovery did not see (which would cut the log there)."""
    runs, units = [], []
    for want in (runs, units):
        if want is units:  # (before the open: a reader keeps a topic's run head)
            monkeypatch.setattr(codec, "unit_run_head", lambda topic_bytes: None)
        with _flipped(path, flip) as s:
            for off in (0, victim - 1, victim, victim + 1):
                for read_body in (True, False):
                    want.append(_outcome(s, off, read_body))
        monkeypatch.undo()
    return runs, units


@contextlib.contextmanager
def _flipped(path: str, flip: tuple[int, int] | None) -> Iterator[MessageStore]:
    """The store opened read-only with ``flip`` (commitlog offset, bit mask) applied to its segment, undone after."""
    with MessageStore.open(path, _config(), read_only=True) as s:
        fd = os.open(os.path.join(path, SEG), os.O_RDWR)
        try:
            if flip is not None:
                old = os.pread(fd, 1, flip[0])
                os.pwrite(fd, bytes([old[0] ^ flip[1]]), flip[0])
            yield s
        finally:
            if flip is not None:
                os.pwrite(fd, old, flip[0])
            os.close(fd)


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


# ---------------------------------------------------------------- back-to-back records (one unpack for a run)

BATCH_VICTIMS = (11, 19)  # in the middle of the second batch (shapes change), of the third (one shape)


@pytest.fixture(scope="module")
def batched(tmp_path_factory):
    """Three batches of eight same-size records, each followed by another queue's put (so the runs of back-to-back
    records end there), the second batch with bodies and keys one byte apart (same size, other shapes), and a
    last batch of two: the runs ``codec._contiguous_run`` reads whole and the cases it must hand back."""
    path = tmp_path_factory.mktemp("batched") / "s"
    with MessageStore.open(str(path), _config()) as s:
        for b in range(3):
            msgs = [Message(TOPIC, bytes([b * 8 + i]) * (40 + (i % 2 if b == 1 else 0)),
                            keys="kk" if b != 1 or i % 2 == 0 else "k") for i in range(8)]
            assert s.put_batch(msgs).ok
            assert s.put(Message(TOPIC, b"other queue", queue_id=1)).ok
        assert s.put_batch([Message(TOPIC, b"tail" * 10, keys="kk") for _ in range(2)]).ok
        assert s.wait_dispatched(timeout=30)
        victims = {v: s.get(TOPIC, 0, v, 1).messages[0] for v in BATCH_VICTIMS}
    return path, {v: (m.commit_log_offset, m.size) for v, m in victims.items()}


def test_back_to_back_records_are_read_as_runs_and_the_same_as_unit_at_a_time(batched, monkeypatch):
    path, _ = batched
    took = []
    real = codec._contiguous_run
    monkeypatch.setattr(codec, "_contiguous_run", lambda *a: took.append(real(*a)) or took[-1])
    with MessageStore.open(str(path), _config(), read_only=True) as s:
        r = s.get(TOPIC, 0, 0, 32)
    monkeypatch.undo()
    assert [m.queue_offset for m in r.messages] == list(range(26))
    assert [m.body for m in r.messages[8:10]] == [bytes([8]) * 40, bytes([9]) * 41]
    assert sorted(k for k, _ in took if k) == [1, 1, 1, 1, 1, 8, 8]  # batch 2: its shape changes every record
    for victim in BATCH_VICTIMS:
        runs, units = _both(str(path), monkeypatch, victim=victim)
        assert runs == units
        assert [m["queueOffset"] for m in runs[0][2]] == list(range(26))


@pytest.mark.parametrize("victim", BATCH_VICTIMS)
def test_every_bit_flip_in_a_record_of_a_run_is_judged_the_same_with_and_without_runs(batched, monkeypatch, victim):
    path, where = batched
    phy, size = where[victim]
    intact = _both(str(path), monkeypatch, victim=victim)[0]
    differed = 0
    for at in range(size):
        bit = 1 << (at % 8)
        runs, units = _both(str(path), monkeypatch, (phy + at, bit), victim=victim)
        assert runs == units, f"byte {at} of the record, bit {bit}"
        differed += runs != intact
    assert _both(str(path), monkeypatch, victim=victim)[0] == intact
    assert differed > size // 2


def test_a_run_of_empty_bodies_reads_as_unit_at_a_time(tmp_path, monkeypatch):
    path = tmp_path / "s"
    with MessageStore.open(str(path), _config()) as s:
        assert s.put_batch([Message(TOPIC, b"") for _ in range(6)]).ok
        assert s.wait_dispatched(timeout=30)
    runs, units = _both(str(path), monkeypatch, victim=3)
    assert runs == units
    assert [m["queueOffset"] for m in runs[0][2]] == list(range(6)) and runs[0][2][0]["body"] == ""


# ---------------------------------------------------------------- the column-wise read (read_batch)

BODYLESS = ["topic", "queueId", "queueOffset", "commitLogOffset", "size", "bodyCrc", "storeTimestamp", "msgId",
            "tags", "keys", "properties"]


def _rows_json(batch) -> list[dict]:
    """read_batch rows in MessageExt.to_json's form (base64 body, millisecond timestamps, sorted properties);
    timestamps read as integers (a flipped bit can put one past what datetime holds)."""
    import pyarrow as pa
    cols = {}
    for name in batch.schema.names:
        c = batch.column(name)
        if name in ("bornTimestamp", "storeTimestamp"):
            cols[name] = [v // 1000 for v in c.cast(pa.int64()).to_pylist()]
        elif name == "properties":
            cols[name] = [dict(sorted(v)) for v in c.to_pylist()]
        elif name == "body":
            cols[name] = [base64.b64encode(v).decode("ascii") for v in c.to_pylist()]
        else:
            cols[name] = c.to_pylist()
    return [{k: cols[k][i] for k in batch.schema.names} for i in range(batch.num_rows)]


def _gets(store: MessageStore, offset: int, count: int, names: list[str] | None) -> tuple:
    """What successive gets (bodies read) return from ``offset``: the reference read_batch must equal."""
    msgs, off = [], offset
    while len(msgs) < count:
        try:
            r = store.get(TOPIC, 0, off, min(32, count - len(msgs)))
        except CorruptRecordError as e:
            if msgs:
                break
            return ("error", str(e), e.path, e.offset)
        if not r.messages:
            break
        msgs += r.messages
        off = r.next_begin_offset
    limit = (2 ** 63 - 1) // 1000  # a time past what Arrow's microsecond timestamps hold ends the batch there
    for i, m in enumerate(msgs):
        if any(k in (names or ["bornTimestamp", "storeTimestamp"]) and not -limit <= t <= limit
               for k, t in (("bornTimestamp", m.born_timestamp), ("storeTimestamp", m.store_timestamp))):
            if not i:
                return ("error", "time out of range", m.commit_log_offset)
            msgs, off = msgs[:i], m.queue_offset
            break
    rows = [m.to_json() for m in msgs]
    if names is not None:
        rows = [{k: v for k, v in j.items() if k in names} for j in rows]
    return (off, rows)


def _batch(store: MessageStore, offset: int, count: int, names: list[str] | None) -> tuple:
    try:
        b = store.read_batch(TOPIC, 0, offset, count, columns=names)
    except CorruptRecordError as e:
        if "outside the range of the timestamp columns" in str(e):
            return ("error", "time out of range", e.offset)
        return ("error", str(e), e.path, e.offset)
    return (int(b.schema.metadata[b"nextBeginOffset"]), _rows_json(b))


def _batch_and_gets(path: str, flip: tuple[int, int] | None = None) -> tuple[list, list]:
    batches, gets = [], []
    with _flipped(path, flip) as s:
        for off in (0, VICTIM - 1, VICTIM, VICTIM + 1):
            for names in (None, BODYLESS):
                batches.append(_batch(s, off, N, names))
                gets.append(_gets(s, off, N, names))
    return batches, gets


def test_read_batch_returns_what_gets_return(written, monkeypatch):
    path, _, _ = written
    batches, gets = _batch_and_gets(str(path))
    assert batches == gets
    assert [r["queueOffset"] for r in batches[0][1]] == list(range(N)) and batches[0][0] == N
    # the intact queue is read column-wise, without a get
    from rocketstore.storage.read import StoreReader

    def no_get(*a, **k):
        raise AssertionError("read_batch fell back to get on an intact queue")
    monkeypatch.setattr(StoreReader, "get", no_get)
    with MessageStore.open(str(path), _config(), read_only=True) as s:
        assert s.read_batch(TOPIC, 0, 2, N - 2).num_rows == N - 2


def test_every_bit_flip_in_a_record_is_judged_by_read_batch_as_by_get(written):
    """For every one-bit flip of a record, read_batch raises the error or returns exactly the rows get does,
    with or without the body column (bodies are CRC-checked either way)."""
    path, phy, size = written
    intact = _batch_and_gets(str(path))[0]
    differed = 0
    for at in range(size):
        bit = 1 << (at % 8)
        batches, gets = _batch_and_gets(str(path), (phy + at, bit))
        assert batches == gets, f"byte {at} of the record, bit {bit}"
        differed += batches != intact
    assert differed > size // 2


def test_read_batch_across_segments_and_queues_equals_gets(tmp_path):
    """A queue whose records lie in several commitlog segments, interleaved with another queue's: one batch,
    the same rows as the gets, in queue order, and reads from any offset with any count agree too."""
    path = str(tmp_path / "s")
    with MessageStore.open(path, _config()) as s:
        for i in range(300):
            s.put(Message(TOPIC, bytes([i % 256]) * (100 + i % 50), queue_id=i % 2, keys=f"k{i}"))
        assert s.wait_dispatched(timeout=30)
    with MessageStore.open(path, _config(), read_only=True) as s:
        assert len(os.listdir(os.path.join(path, "commitlog"))) >= 3
        n = s.max_offset_in_queue(TOPIC, 0)
        assert n == 150
        assert _batch(s, 0, n, None) == _gets(s, 0, n, None)
        for off, count in ((0, 1), (7, 40), (100, 100), (149, 5), (150, 3)):
            assert _batch(s, off, count, BODYLESS) == _gets(s, off, count, BODYLESS), (off, count)


def test_read_batch_refuses_bad_arguments_naming_them_and_the_store_stays_readable(written):
    path, _, _ = written
    with MessageStore.open(str(path), _config(), read_only=True) as s:
        with pytest.raises(StoreError, match=r"unknown columns \['bodyy'\]"):
            s.read_batch(TOPIC, 0, 0, 4, columns=["queueOffset", "bodyy"])
        empty = s.read_batch("NoSuchTopic", 0, 0, 4)  # a queue that does not exist: no rows, not an error
        assert empty.num_rows == 0
        assert s.read_batch(TOPIC, 0, 0, 0).num_rows == 0
        got = s.read_batch(TOPIC, 0, 0, N, columns=["queueOffset"])
        assert got.column("queueOffset").to_pylist() == list(range(N))
    with pytest.raises(StoreError, match="closed"):
        s.read_batch(TOPIC, 0, 0, 4)


# ---------------------------------------------------------------- a run's messages unpack their header lazily

_PUBLIC = sorted(n for n in dir(codec.MessageExt) if not n.startswith("_") and n != "to_json")


def _public(m: codec.MessageExt) -> dict:
    return {n: getattr(m, n) for n in _PUBLIC} | {"json": m.to_json(), "repr": repr(m)}


@pytest.mark.parametrize("first_use", ["pickle", "deepcopy", "field", "json", "eq", "properties"])
def test_messages_of_a_run_read_and_pickle_as_unit_at_a_time_ones(batched, monkeypatch, first_use):
    """A contiguous run's messages keep only their checked fields and the run's bytes until a field is read:
    whatever is done with one first (pickled, copied, a field, to_json, compared, properties), every public
    attribute then equals the unit-at-a-time message's, and a pickled message carries no run bytes."""
    import copy
    import pickle
    path, _ = batched
    with MessageStore.open(str(path), _config(), read_only=True) as s:
        runs = s.get(TOPIC, 0, 16, 8).messages  # the third batch: one contiguous run of eight
    monkeypatch.setattr(codec, "unit_run_head", lambda topic_bytes: None)
    with MessageStore.open(str(path), _config(), read_only=True) as s:
        units = s.get(TOPIC, 0, 16, 8).messages
    assert len(runs) == len(units) == 8
    assert all(type(m) is codec._RunMessage for m in runs) and not any(type(m) is codec._RunMessage for m in units)
    for m, u in zip(runs, units):
        if first_use == "pickle":
            data = pickle.dumps(m)
            assert len(data) < 2 * m.size  # the message, not the run's bytes
            got = pickle.loads(data)
            assert _public(got) == _public(u) and got == u and type(got) is type(m)
        elif first_use == "deepcopy":
            got = copy.deepcopy(m)
            assert _public(got) == _public(u) and got == u
        elif first_use == "field":
            assert (m.commit_log_offset, m.store_port, m.flag) == (u.commit_log_offset, u.store_port, u.flag)
        elif first_use == "json":
            assert m.to_json() == u.to_json()
        elif first_use == "eq":
            assert m == u and u == m
        else:
            assert m.properties == u.properties and m.keys == u.keys == "kk"
        assert _public(m) == _public(u) and m == u
        assert pickle.loads(pickle.dumps(m)) == u
    assert [m.queue_offset for m in runs] == list(range(16, 24))
