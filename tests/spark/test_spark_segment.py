"""Issue 7: the vectorised segment decoder behind the Spark source, checked against the codec (no Spark needed)."""

from __future__ import annotations

import base64
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("numpy")

import pyarrow as pa
from conftest import GOLDEN_NAMES, copy_store, flip_body_bit, golden_expected, golden_store
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rocketstore import Message, MessageStore
from rocketstore.format import codec
from rocketstore.errors import StoreError
from rocketstore.format import properties
from rocketstore.spark import plan, segment
from rocketstore.spark.segment import RowFilter

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def as_dump(row: dict) -> dict:
    """A decoded row in the shape of ``rocketstore dump`` / expected.jsonl."""
    d = dict(row)
    for k in ("bornTimestamp", "storeTimestamp"):
        d[k] = (d[k] - EPOCH) // timedelta(milliseconds=1)
    d["properties"] = dict(sorted(d["properties"]))
    if d.get("body") is not None:
        d["body"] = base64.b64encode(d["body"]).decode()
    return d


def read_store(root: str, names=segment.COLUMN_NAMES, flt=None, batch_rows=257) -> list[dict]:
    rows = []
    for task in plan.plan_scan(root, flt or RowFilter()):
        for b in segment.read_range(task.path, task.start, task.end, names, task.filter, batch_rows=batch_rows,
                                    boundary_known=task.boundary_known, queues=task.queues):
            rows += b.to_pylist()
    return rows


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_decoder_gives_every_field_of_every_golden_message(name):
    expected = sorted(golden_expected(name), key=lambda e: e["commitLogOffset"])
    rows = [as_dump(r) for r in read_store(str(golden_store(name)))]
    assert len(rows) == len(expected)
    for r, e in zip(rows, expected):
        assert list(r) == segment.COLUMN_NAMES
        assert r == {k: e[k] for k in segment.COLUMN_NAMES}


def test_decoder_filters_match_a_python_filter():
    root = str(golden_store("basic"))
    every = read_store(root, ["commitLogOffset", "topic", "queueId", "storeTimestamp", "keys"])
    t0 = every[700]["storeTimestamp"]
    us = (t0 - EPOCH) // timedelta(microseconds=1)
    flt = RowFilter(offset_lo=every[100]["commitLogOffset"] + 1, offset_hi=every[2500]["commitLogOffset"],
                    ts_lo=us, topics=frozenset({"TopicA", "TopicC"}), queue_ids=frozenset({0, 3}))
    got = read_store(root, ["commitLogOffset"], flt)
    want = [r["commitLogOffset"] for r in every
            if flt.offset_lo <= r["commitLogOffset"] <= flt.offset_hi and r["storeTimestamp"] >= t0
            and r["topic"] in flt.topics and r["queueId"] in flt.queue_ids]
    assert [r["commitLogOffset"] for r in got] == want and want
    keyed = read_store(root, ["commitLogOffset", "keys"], RowFilter(keys=frozenset({every[5]["keys"]})))
    assert [r["keys"] for r in keyed] == [every[5]["keys"]]


def test_plan_prunes_segments_by_time_and_offset():
    root = str(golden_store("basic"))
    tasks = plan.plan_scan(root, RowFilter())
    assert len(tasks) == 4
    first = [segment.first_store_timestamp(t.path) for t in tasks]
    early = plan.plan_scan(root, RowFilter(ts_hi=first[1] * 1000 - 1))
    assert [t.base for t in early] == [tasks[0].base]
    late = plan.plan_scan(root, RowFilter(offset_lo=tasks[3].base + 10))
    assert [t.base for t in late] == [tasks[3].base] and not late[0].boundary_known
    assert plan.plan_scan(root, RowFilter(topics=frozenset())) == []


# ---------------------------------------------------------------- generated records

HOSTS = st.one_of(st.tuples(st.binary(min_size=4, max_size=4), st.integers(0, 65535)),
                  st.tuples(st.binary(min_size=16, max_size=16), st.integers(0, 65535)))
PROP_TEXT = st.text(alphabet=st.sampled_from(["a", "B", "\x01", "\x02", "é", "中", "😀", "\x00", "k", "="]),
                    max_size=12)
PAIRS = st.lists(st.tuples(st.sampled_from(["TAGS", "KEYS", "UNIQ_KEY", "a", "k1", "中文键"]),
                           st.text(alphabet="xyz 中😀", max_size=5)), max_size=6)


@st.composite
def records(draw):
    n = draw(st.integers(1, 12))
    out = []
    for _ in range(n):
        topic = draw(st.sampled_from(["T", "TopicA", "x" * 127, "y" * 128, "Z" * 200]))
        if draw(st.booleans()):
            props = "".join(f"{k}\x01{v}\x02" for k, v in draw(PAIRS))
        else:
            # (the encoder refuses a properties string ending with a zero byte: it would read as a torn record)
            props = draw(PROP_TEXT.filter(lambda t: not t.endswith("\x00")))
        out.append({"topic": topic, "body": draw(st.binary(max_size=40)), "queue_id": draw(st.integers(0, 7)),
                    "flag": draw(st.integers(-5, 5)), "sys_flag": draw(st.sampled_from([0, 4, 8, 12])),
                    "born_timestamp": draw(st.integers(0, 2 ** 41)), "born_host": draw(HOSTS),
                    "store_host": draw(HOSTS), "reconsume_times": draw(st.integers(0, 3)), "properties": props})
    return out


def _write_segment(tmp_path, recs, file_size=8192):
    d = tmp_path / "commitlog"
    d.mkdir(exist_ok=True)
    buf = bytearray(file_size)
    pos = 0
    for i, r in enumerate(recs):
        rec = codec.encode_bytes(r["topic"], r["body"], queue_id=r["queue_id"], flag=r["flag"],
                                 sys_flag=r["sys_flag"], born_timestamp=r["born_timestamp"],
                                 born_host=r["born_host"], store_host=r["store_host"],
                                 reconsume_times=r["reconsume_times"], properties=r["properties"],
                                 queue_offset=i, physical_offset=pos, store_timestamp=1_700_000_000_000 + i)
        buf[pos:pos + len(rec)] = rec
        pos += len(rec)
    path = d / f"{0:020d}"
    path.write_bytes(bytes(buf))
    return str(path), pos


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(recs=records())
def test_decoder_equals_codec_on_generated_records(tmp_path, recs):
    path, end = _write_segment(tmp_path, recs)
    got = []
    for b in segment.read_range(path, 0, end, segment.COLUMN_NAMES, batch_rows=5):
        got += [as_dump(r) for r in b.to_pylist()]
    want = []
    with open(path, "rb") as fh:
        data = fh.read()
    pos = 0
    while pos < end:
        m = codec.decode(data, pos, end)
        want.append(m.to_json())
        pos += m.size
    assert got == want


def test_properties_map_edge_cases():
    strings = ["", "a\x01b\x02", "a\x01b", "\x01b\x02", "a\x01\x02", "a\x01b\x01c\x02", "k\x01v1\x02k\x01v2\x02",
               "x\x02\x02y\x01z\x02", "TAGS\x01t\x02KEYS\x01k1 k2\x02", "é\x01中\x02"]
    arr = pa.array([s.encode() for s in strings], pa.binary())
    m, found = properties.properties_map(arr, ("TAGS", "KEYS", "k"))
    for s, row in zip(strings, m.to_pylist()):
        assert dict(row) == codec.parse_properties(s)
        assert len(row) == len(codec.parse_properties(s))
    for name in ("TAGS", "KEYS", "k"):
        assert found[name].to_pylist() == [codec.parse_properties(s).get(name) for s in strings]


def _simple(body: bytes, props: str) -> dict:
    return {"topic": "T", "body": body, "queue_id": 0, "flag": 0, "sys_flag": 0, "born_timestamp": 1,
            "born_host": (b"\x7f\x00\x00\x01", 1), "store_host": (b"\x7f\x00\x00\x01", 2),
            "reconsume_times": 0, "properties": props}


def test_walk_stops_at_blank_zeros_and_garbage(tmp_path):
    recs = [_simple(b"x" * i, "a\x01b\x02") for i in range(3)]
    path, end = _write_segment(tmp_path, recs)
    with segment.Segment(path) as seg:
        w = segment.walk(seg.mm, 0, seg.size, zeros_end=True)
        assert len(w.positions) == 3 and w.end == end and w.problem is None
        w = segment.walk(seg.mm, 0, seg.size)
        assert w.problem is not None and "file position" in w.problem
    data = bytearray(Path(path).read_bytes())
    data[end:end + 8] = codec.blank_record(len(data) - end)
    Path(path).write_bytes(bytes(data))
    with segment.Segment(path) as seg:
        w = segment.walk(seg.mm, 0, seg.size)
        assert w.blank and len(w.positions) == 3 and w.problem is None
    data[0] ^= 0x7F  # TOTALSIZE of the first record
    Path(path).write_bytes(bytes(data))
    with pytest.raises(segment.RecordFormatError):
        list(segment.read_range(path, 0, end, ["topic"]))


def test_find_tail_ignores_a_record_still_being_written(tmp_path):
    recs = [_simple(b"x" * 50, "") for _ in range(3)]
    path, end = _write_segment(tmp_path, recs)
    root = str(tmp_path)
    assert plan.find_tail(root) == end
    data = bytearray(Path(path).read_bytes())
    last = end - (end // 3)
    data[last + 100:end] = bytes(end - last - 100)  # the last record's tail not written yet
    Path(path).write_bytes(bytes(data))
    assert plan.find_tail(root) == last
    assert plan.find_tail(root, 0, max_bytes=1) == end // 3
    assert plan.check_boundary(root, end // 3) == end // 3
    with pytest.raises(StoreError, match="no record starts"):
        plan.check_boundary(root, 5)


def test_store_opened_by_the_decoder_is_unchanged():
    root = golden_store("basic")
    before = {p: os.path.getmtime(os.path.join(root, p)) for p in os.listdir(root)}
    read_store(str(root), ["topic"])
    with MessageStore.open(str(root), read_only=True):
        pass
    assert {p: os.path.getmtime(os.path.join(root, p)) for p in os.listdir(root)} == before


def test_append_commit_reports_what_it_wrote_when_a_put_is_refused(tmp_path):
    from rocketstore import StoreConfig
    from rocketstore.spark import write
    root = tmp_path / "store"
    cfg = StoreConfig(mappedFileSizeCommitLog=16384, mappedFileSizeConsumeQueue=2000, maxHashSlotNum=100,
                      maxIndexNum=400)
    with MessageStore.open(str(root), cfg) as store:
        assert store.put(Message("T", b"first")).ok  # a segment file: the geometry can be measured
    rows = [{"topic": "T", "body": b"a" * 100}, {"topic": "T", "body": b"b" * 100},
            {"topic": "T", "body": b"c" * 20000}, {"topic": "T", "body": b"d"}]
    batch = pa.RecordBatch.from_pylist(rows)
    opts = write.WriteOptions()
    with pytest.raises(StoreError, match="segment"):  # staging refuses it: the job would abort untouched
        write.stage(iter([batch]), str(tmp_path / "stage"), 0, 0, opts, 4 * 1024 * 1024, 16384)
    # Staged without the segment check (a store whose geometry changed meanwhile): the commit reports.
    part = write.stage(iter([batch]), str(tmp_path / "stage"), 0, 0, opts, 4 * 1024 * 1024)
    with pytest.raises(StoreError, match=r"wrote 2 of 4 messages \(commitlog offsets \d+\.\.\d+\); message 3"):
        write.commit(str(root), [part], opts)
    with MessageStore.open(str(root), read_only=True) as store:
        assert [m.body for _, _, m, _ in store.messages()] == [b"first", b"a" * 100, b"b" * 100]
        assert store.state()["queues"][0]["maxOffsetInQueue"] == 3


def test_record_positions_come_from_the_consume_queues_and_are_checked(tmp_path, monkeypatch):
    from conftest import copy_store
    expected = sorted(e["commitLogOffset"] for e in golden_expected("basic"))
    tasks = plan.plan_scan(str(golden_store("basic")), RowFilter())
    assert all(t.queues for t in tasks)

    def no_walk(*a, **k):
        raise AssertionError("walked although the consume queues tile every segment")
    with monkeypatch.context() as m:
        m.setattr(segment, "walk", no_walk)
        assert [r["commitLogOffset"] for r in read_store(str(golden_store("basic")), ["commitLogOffset"])] == expected
    # A damaged unit (wrong size) or a missing queue: the positions do not check out, the walk takes over.
    store = copy_store(golden_store("basic"), tmp_path / "s")
    cq = Path(min((store / "consumequeue" / "TopicB" / "1").iterdir()))
    data = bytearray(cq.read_bytes())
    data[20 * 7 + 8:20 * 7 + 12] = (99).to_bytes(4, "big")
    cq.write_bytes(bytes(data))
    for f in (store / "consumequeue" / "TopicC" / "0").iterdir():
        f.unlink()
    rows = [as_dump(r) for r in read_store(str(store))]
    assert [r["commitLogOffset"] for r in rows] == expected
    assert rows[1234] == {k: v for k, v in sorted(golden_expected("basic"), key=lambda e: e["commitLogOffset"])[1234]
                          .items() if k in segment.COLUMN_NAMES}


def test_drop_cache_advises_every_read_segment_but_the_newest(monkeypatch):
    """Issue 10: an export of a live store drops what it read from the page cache, except the hot tail."""
    calls = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: (calls.append((off, n, advice)),
                                                                       real(fd, off, n, advice)))
    root = str(golden_store("basic"))
    tasks = plan.plan_scan(root, RowFilter(), drop_cache=True)
    assert [t.drop_cache for t in tasks] == [True] * (len(tasks) - 1) + [False]
    rows = 0
    for t in tasks:
        for b in segment.read_range(t.path, t.start, t.end, ["commitLogOffset"], drop_cache=t.drop_cache):
            rows += b.num_rows
    assert rows == 3000
    assert len(calls) == len(tasks) - 1 and all(a == os.POSIX_FADV_DONTNEED and n > 0 for _o, n, a in calls)
    assert not any(t.drop_cache for t in plan.plan_scan(root, RowFilter()))


def test_split_pieces_read_exactly_the_rows_of_the_whole_segment_without_a_walk(monkeypatch):
    """A segment cut at consume-queue record starts: the pieces give the segment's rows, in order, each
    piece finding its records through its own queue slices."""
    names = [n for n in segment.COLUMN_NAMES if n != "body"]
    tasks = plan.plan_scan(str(golden_store("basic")), RowFilter())

    def rows(ts):
        return [r for t in ts for b in segment.read_range(t.path, t.start, t.end, names, t.filter,
                                                          boundary_known=t.boundary_known, queues=t.queues)
                for r in b.to_pylist()]
    whole = rows(tasks)
    with monkeypatch.context() as m:
        m.setattr(segment, "walk", lambda *a, **k: pytest.fail("walked although the queue slices tile each piece"))
        for k in (2, 3, 7):
            per_task = [plan.split_task(t, k) for t in tasks]
            pieces = [p for ps in per_task for p in ps]
            assert len(pieces) == k * len(tasks)
            assert all(a.end == b.start for ps in per_task for a, b in zip(ps, ps[1:]))
            assert rows(pieces) == whole


def test_find_tail_through_the_consume_queues_equals_the_walk(tmp_path, monkeypatch):
    from conftest import copy_store
    for name in GOLDEN_NAMES:
        root = str(golden_store(name))
        with monkeypatch.context() as m:
            m.setattr(plan, "_queue_verified_prefix", lambda *a: None)
            walked = plan.find_tail(root)
        assert plan.find_tail(root) == walked, name
    # A queue unit that disagrees with its record: no shortcut, the walk decides.
    store = copy_store(golden_store("basic"), tmp_path / "s")
    newest = sorted((store / "commitlog").iterdir())[-1]
    cq = Path(max((store / "consumequeue" / "TopicB" / "1").iterdir()))
    data = bytearray(cq.read_bytes())
    last = max(i for i in range(0, len(data), 20) if any(data[i:i + 20]))  # the queue's newest unit
    assert int.from_bytes(data[last:last + 8], "big") >= int(newest.name)
    data[last + 8:last + 12] = (99).to_bytes(4, "big")
    cq.write_bytes(bytes(data))
    assert plan._queue_verified_prefix(str(store), int(newest.name), str(newest), newest.stat().st_size) is None
    assert plan.find_tail(str(store)) == plan.find_tail(str(golden_store("basic")))


def test_a_damaged_body_fails_the_read_naming_file_and_offset_or_is_skipped_on_request(tmp_path):
    """Issue 16 item 7: a flipped body bit is never returned; skipDamaged drops just that row."""
    root = copy_store(golden_store("basic"), tmp_path / "s")
    flip_body_bit(root, 696)
    seg0 = str(root / "commitlog" / "00000000000000000000")
    tasks = plan.plan_scan(str(root), RowFilter())

    def rows(names, skip=False):
        return [r for t in tasks for b in segment.read_range(t.path, t.start, t.end, names, t.filter,
                                                              boundary_known=t.boundary_known, queues=t.queues,
                                                              skip_damaged=skip) for r in b.to_pylist()]

    with pytest.raises(segment.RecordFormatError, match=f"{seg0} at offset 696 .*body CRC mismatch"):
        rows(["commitLogOffset", "body"])
    assert len(rows(["commitLogOffset", "topic"])) == 3000  # no body read, nothing damaged returned
    expected = [e for e in golden_expected("basic") if e["commitLogOffset"] != 696]
    got = rows(["commitLogOffset", "topic", "body"], skip=True)
    assert [r["commitLogOffset"] for r in got] == [e["commitLogOffset"] for e in expected]
    assert [r["topic"] for r in got] == [e["topic"] for e in expected]


def test_a_time_the_timestamp_column_cannot_hold_fails_the_read_naming_file_and_offset(tmp_path):
    """A flipped high bit of BORNTIMESTAMP makes a time past what a microsecond timestamp holds: the column
    would hold a wrapped, wrong time; the read refuses the record instead (columns not asked for: no refusal)."""
    root = copy_store(golden_store("basic"), tmp_path / "s")
    seg0 = root / "commitlog" / "00000000000000000000"
    with open(seg0, "r+b") as fh:  # BORNTIMESTAMP is at byte 40 of a record (big-endian: its high byte)
        fh.seek(696 + 40)
        b = fh.read(1)
        fh.seek(696 + 40)
        fh.write(bytes([b[0] ^ 0x40]))
    tasks = plan.plan_scan(str(root), RowFilter())

    def rows(names):
        return [r for t in tasks for b in segment.read_range(t.path, t.start, t.end, names, t.filter,
                                                              boundary_known=t.boundary_known, queues=t.queues)
                for r in b.to_pylist()]

    with pytest.raises(segment.RecordFormatError, match=f"{seg0} at offset 696 .*bornTimestamp .* outside"):
        rows(["commitLogOffset", "bornTimestamp"])
    assert len(rows(["commitLogOffset", "storeTimestamp"])) == 3000


def _record_offsets(root) -> list[int]:
    return sorted(e["commitLogOffset"] for e in golden_expected("basic"))


def test_a_record_that_disagrees_with_its_unit_is_walked_from_the_last_checked_batch(tmp_path, monkeypatch):
    """Issue 29.3: the records are checked against their consume-queue units batch by batch, just before each
    is decoded; at one that disagrees (its PHYSICALOFFSET here) the walk takes over from that batch's first
    record, which the batches before proved a record start: the same rows as a walk from the segment start."""
    store = copy_store(golden_store("basic"), tmp_path / "s")
    seg0 = store / "commitlog" / "00000000000000000000"
    offsets = [o for o in _record_offsets(store) if o < 1048576]
    damaged = offsets[600]
    data = bytearray(seg0.read_bytes())
    data[damaged + 28:damaged + 36] = (damaged + 1).to_bytes(8, "big")  # PHYSICALOFFSET
    seg0.write_bytes(bytes(data))
    task = plan.plan_scan(str(store), RowFilter())[0]
    assert task.path == str(seg0) and task.queues
    names = ["commitLogOffset", "queueOffset", "topic"]
    walked = [r for b in segment.read_range(task.path, task.start, task.end, names, batch_rows=100)
              for r in b.to_pylist()]
    assert [r["commitLogOffset"] for r in walked][:600] == offsets[:600]
    starts = []
    real_walk = segment.walk

    def walk(mm, pos, limit, **kw):
        starts.append(pos)
        return real_walk(mm, pos, limit, **kw)
    monkeypatch.setattr(segment, "walk", walk)
    got = [r for b in segment.read_range(task.path, task.start, task.end, names, batch_rows=100,
                                         queues=task.queues) for r in b.to_pylist()]
    assert got == walked
    assert starts == [offsets[600]]  # batch 7 (records 600..699) is the first that does not check out


def test_a_damaged_record_inside_the_newest_segment_fails_the_scan_naming_it(tmp_path):
    """A record in the middle of the newest segment that is not a record any more (its MAGICCODE zeroed)
    fails the scan naming file and offset; it used to end the scan there silently (the planner's tail
    stopped at it), hiding every message after it."""
    store = copy_store(golden_store("basic"), tmp_path / "s")
    newest = store / "commitlog" / "00000000000003145728"
    base = int(newest.name)
    offsets = [o for o in _record_offsets(store) if o >= base]
    damaged = offsets[len(offsets) // 2]
    data = bytearray(newest.read_bytes())
    data[damaged - base + 4:damaged - base + 8] = bytes(4)
    newest.write_bytes(bytes(data))
    assert plan.find_tail(str(store)) == plan.find_tail(str(golden_store("basic")))
    with pytest.raises(segment.RecordFormatError, match=f"{newest}.* {damaged - base}"):
        read_store(str(store), ["commitLogOffset"])


# ---------------------------------------------------------------- the decoder against the codec, byte by byte

def _shapes() -> list[dict]:
    """Records of every shape the decoder reads: V1 and V2 magic (a topic over 127 characters), IPv4 and IPv6
    hosts, no, one and several properties, an empty body."""
    v6 = (bytes(range(1, 17)), 7)
    return [_simple(b"body-0", "KEYS\x01k0\x02"),
            {**_simple(b"", "TAGS\x01t\x02KEYS\x01a b\x02UNIQ_KEY\x01u\x02"), "topic": "y" * 130},
            {**_simple(b"x" * 7, ""), "born_host": v6},
            {**_simple(b"yz", "a\x01b\x02"), "store_host": v6, "topic": "Q" * 128},
            _simple(b"last", "KEYS\x01k4\x02")]


def _codec_verdict(data: bytes, positions: list[int], end: int) -> tuple[list[dict], int | None]:
    """What the decoder must return for ``positions``: the codec's rows, or the position it must name (the
    first record the codec refuses; else the first whose time the timestamp columns cannot hold)."""
    from rocketstore.format.columns import timestamps_fit
    import numpy as np
    rows, unfit = [], None
    for pos in positions:
        try:
            m = codec.decode(data, pos, end)
        except codec.RecordError:
            return rows, pos
        if unfit is None and not timestamps_fit(np.array([m.born_timestamp, m.store_timestamp])).all():
            unfit = pos
        rows.append({k: v for k, v in m.to_json().items() if k != "body"})
    return rows, unfit


def _dump_rows(batch: pa.RecordBatch) -> list[dict]:
    """``as_dump`` of each row, the timestamps read as milliseconds (a damaged one may lie past year 9999)."""
    cols = {n: batch.column(n) for n in batch.schema.names}
    for n in ("bornTimestamp", "storeTimestamp"):
        cols[n] = pa.array([v // 1000 for v in cols[n].cast(pa.int64()).to_pylist()])
    rows = pa.RecordBatch.from_pydict(cols).to_pylist()
    for r in rows:
        r["properties"] = dict(sorted(r["properties"]))
    return rows


@pytest.mark.parametrize("tails", ["fixed-width items", "one gather"])
def test_every_damaged_byte_is_judged_by_the_decoder_as_by_the_codec(tmp_path, monkeypatch, tails):
    """Each byte of a segment of mixed records set to three other values: the decoder returns the codec's
    rows, or fails naming the first record the codec refuses (its checks of each record's fields against
    its size read the records' tails from one copy: this pins them to the codec's), whichever way the
    tails are copied."""
    from rocketstore.format import columns
    if tails == "one gather":
        monkeypatch.setattr(columns, "_WINDOW_TAIL", 0)
    path, end = _write_segment(tmp_path, _shapes(), file_size=2048)
    clean = Path(path).read_bytes()
    positions = [int(p) for p in segment.walk(clean, 0, end).positions]
    assert len(positions) == 5
    names = [n for n in segment.COLUMN_NAMES if n != "body"]
    import numpy as np
    refused = 0
    for at in range(end):
        for value in {0x00, 0xFF, clean[at] ^ 0x80}:
            data = bytearray(clean)
            data[at] = value
            rows, bad = _codec_verdict(bytes(data), positions, end)
            view = columns.MappedView(data, path, 0)
            if bad is None:
                assert _dump_rows(segment.decode(view, np.array(positions), names, limit=end)) == rows, (at, value)
            else:
                refused += 1
                with pytest.raises(segment.RecordFormatError, match=f"at offset {bad} "):
                    segment.decode(view, np.array(positions), names, limit=end)
    assert refused > 200  # the damage reached the fields the checks read


def test_records_out_of_file_order_decode_as_the_codec_reads_them(tmp_path):
    """Positions backwards and repeated (no caller passes such, but the tails are then read one by one rather
    than by one gather, which needs ranges in file order)."""
    path, end = _write_segment(tmp_path, _shapes())
    data = Path(path).read_bytes()
    positions = [int(p) for p in segment.walk(data, 0, end).positions]
    order = positions[::-1] + positions[:2]
    names = [n for n in segment.COLUMN_NAMES if n != "body"]
    import numpy as np
    with segment.Segment(path) as seg:
        got = segment.decode(seg, np.array(order), names, limit=end).to_pylist()
    assert [as_dump(r) for r in got] == [
        {k: v for k, v in codec.decode(data, p, end).to_json().items() if k != "body"} for p in order]


def test_hosts_and_message_ids_when_only_the_last_record_of_a_batch_differs(tmp_path):
    recs = [_simple(b"b", "") for _ in range(6)]
    recs[-1] = {**recs[-1], "born_host": (b"\x0a\x00\x00\x02", 9876), "store_host": (b"\x0a\x00\x00\x03", 10911)}
    path, end = _write_segment(tmp_path, recs)
    data = Path(path).read_bytes()
    got = [as_dump(r) for b in segment.read_range(path, 0, end, segment.COLUMN_NAMES) for r in b.to_pylist()]
    want = [codec.decode(data, int(p), end).to_json() for p in segment.walk(data, 0, end).positions]
    assert got == want and got[-1]["bornHost"] == "10.0.0.2:9876" and got[0]["bornHost"] == "127.0.0.1:1"


PAIR_NAMES = st.sampled_from(["TAGS", "KEYS", "UNIQ_KEY", "k", "中文键"])
PAIR_VALUES = st.text(alphabet="xyz 中😀", min_size=1, max_size=4)


@st.composite
def property_strings(draw):
    """A batch of properties strings: every non-empty one with the same number of pairs, or any number."""
    n = draw(st.integers(1, 8))
    same = draw(st.integers(1, 4)) if draw(st.booleans()) else None
    out = []
    for _ in range(n):
        k = same if same is not None and draw(st.integers(0, 4)) else draw(st.integers(0, 4))
        out.append("".join(f"{draw(PAIR_NAMES)}\x01{draw(PAIR_VALUES)}\x02" for _ in range(k)))
    return out


@settings(max_examples=150, deadline=None)
@given(strings=property_strings())
def test_properties_map_equals_the_codec_for_any_number_of_pairs(strings):
    arr = pa.array([s.encode() for s in strings], pa.binary())
    for valid in (False, True):
        m, found = properties.properties_map(arr, ("TAGS", "KEYS"), valid_utf8=valid)
        assert [dict(r) for r in m.to_pylist()] == [codec.parse_properties(s) for s in strings]
        for name in ("TAGS", "KEYS"):
            assert found[name].to_pylist() == [codec.parse_properties(s).get(name) for s in strings]


def test_headers_near_the_end_of_the_buffer_equal_a_byte_by_byte_read():
    from rocketstore.format import columns
    from rocketstore.format.gather import fixed
    import numpy as np
    data = bytearray(os.urandom(300))
    view = columns.MappedView(data, "buf", 0)
    for pos in ([0, 100, 212], [5, 250], [299], [0, 1, 2]):
        p = np.array(pos, np.int64)
        assert (columns.headers(view, p, 88) == fixed(view.np, p, 88)).all()


def _negative_length_segment(tmp_path, which: str) -> tuple[bytearray, list[int], int, int]:
    """Two records where a negative length field of the second one would make its fields add up to its size if
    the decoder read on from where that length points (the codec refuses it: the length is negative).
    Returns (segment bytes, positions, end, position of the damaged record)."""
    if which == "topic":
        # TOPICLENGTH -2 puts PROPERTIESLENGTH one byte before the tail: the previous record's last 0x02 and the
        # 0xFE itself read 0x02FE = 766, which is what the tail's 767 bytes then need.
        recs = [_simple(b"a", "a\x01b\x02"), {**_simple(b"b", "p\x01" + "v" * 661 + "\x02"), "topic": "T" * 100}]
    else:
        # TOPICLENGTH = the tail's length puts PROPERTIESLENGTH one byte into the next record's tail, where its
        # topic's first bytes are 0xFF 0xFD: -3, which is what the fields then need.
        recs = [_simple(b"a", ""), _simple(b"b", "k\x01v\x02"), {**_simple(b"c", ""), "topic": "XYZ"}]
    path, end = _write_segment(tmp_path, recs)
    data = bytearray(Path(path).read_bytes()[:end])
    positions = [int(p) for p in segment.walk(bytes(data), 0, end).positions]
    victim = positions[1]
    m = codec.decode(bytes(data), victim, end)
    tail = victim + 88 + m.body_length
    if which == "topic":
        data[tail] = 0xFE
    else:
        data[tail] = victim + m.size - tail  # the tail's length
        nxt = positions[2] + 88 + 1  # the third record's topic bytes
        data[nxt + 1:nxt + 3] = b"\xff\xfd"
    return data, positions, end, victim


@pytest.mark.parametrize("which", ["topic", "properties"])
def test_a_negative_length_whose_fields_add_up_is_refused(tmp_path, monkeypatch, which):
    from rocketstore.format import columns
    monkeypatch.setattr(columns, "_WINDOW_TAIL", 0)  # the tails one after another in one copy, no padding
    import numpy as np
    data, positions, end, victim = _negative_length_segment(tmp_path, which)
    with pytest.raises(codec.RecordError):
        codec.decode(bytes(data), victim, end)
    with pytest.raises(segment.RecordFormatError, match=f"at offset {victim} "):
        segment.decode(columns.MappedView(data, "seg", 0), np.array(positions), ["topic", "properties"], limit=end)
