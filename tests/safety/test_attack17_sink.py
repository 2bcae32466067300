"""Attack 17: the stream sink's exactly-once journal (spark/sink.py ``commit_batch``) across kills at every step of
a commit, with equal rows in a batch, a journal cut between the two renames of its atomic write, and a damaged
record among an earlier attempt's rows.  No Spark session: the parts are staged as the sink's tasks stage them
(``write.stage`` with ``sink.RowMarker``) and ``commit_batch`` is called the way the driver's ``commit`` calls it."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

pytest.importorskip("pyspark")

from rocketstore import MessageStore, StoreConfig
from rocketstore.errors import StoreError
from rocketstore.spark import sink, write

CFG = StoreConfig(mappedFileSizeCommitLog=1 << 20, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=1000,
                  maxIndexNum=4000)
QUERY = "5b1c0f6e-2d6a-4c55-9a51-0d3f3c1e7a10"
OPTS = write.WriteOptions(config={"mappedFileSizeCommitLog": str(1 << 20), "mappedFileSizeConsumeQueue": "6000",
                                    "maxHashSlotNum": "1000", "maxIndexNum": "4000"})
ROW_SCHEMA = pa.schema([("topic", pa.string()), ("body", pa.binary()), ("queueId", pa.int32()),
                        ("keys", pa.string())])


def _rows() -> list[list[dict]]:
    """Two partitions' rows: equal rows (same topic, body, queue, keys) within and across the partitions, over
    three queues, beside distinct ones; each partition's rows are three put units (one per queue)."""
    parts = []
    for p in range(2):
        rows = []
        for q in range(3):
            rows += [{"topic": "S", "body": b"same", "queueId": q, "keys": "k"}] * (3 + p)
            rows += [{"topic": "S", "body": b"row-%d-%d-%d" % (p, q, i), "queueId": q, "keys": None} for i in range(4)]
        parts.append(rows)
    return parts


def _stage(tmp: Path, batch_id: int, rows: list[list[dict]], tag: str = "") -> list[write.StagedPart]:
    staging = tmp / f"staging{tag}-{batch_id}"
    return [write.stage(iter([pa.RecordBatch.from_pylist(r, schema=ROW_SCHEMA)]), str(staging), p, 0, OPTS,
                        CFG.maxMessageSize, CFG.mappedFileSizeCommitLog, True, sink.RowMarker(QUERY, batch_id))
            for p, r in enumerate(rows)]


def _stored(root: Path) -> Counter:
    """Every message of topic S as (body, queue, keys, batch id), counted."""
    with MessageStore.open(str(root), CFG, read_only=True) as s:
        return Counter((m.body, m.queue_id, m.keys, m.properties[sink.SINK_PROPERTY].split(":")[1])
                       for _, _, m, _ in s.messages() if m is not None and m.topic == "S")


def _want(batches: dict[int, list[list[dict]]]) -> Counter:
    return Counter((r["body"], r["queueId"], r["keys"] or None, str(b))
                   for b, parts in batches.items() for rows in parts for r in rows)


def _new_store(tmp: Path) -> Path:
    root = tmp / "store"
    MessageStore.open(str(root), CFG).close()
    return root


_KILLED = r"""
import os, pickle, sys
from rocketstore import MessageStore
from rocketstore.spark import sink, write
root, query, batch, where, n, parts_file = sys.argv[1:7]
checkpoint = sys.argv[7] if len(sys.argv) > 7 else None
batch, n = int(batch), int(n)
with open(parts_file, "rb") as fh:
    parts, opts = pickle.load(fh)
if where == "put":  # killed after n put units
    put, done = MessageStore.put_encoded, [0]
    def killing_put(self, *a, **kw):
        if done[0] == n:
            os._exit(9)
        done[0] += 1
        return put(self, *a, **kw)
    MessageStore.put_encoded = killing_put
elif where == "close":  # every put made, the store neither flushed nor closed
    MessageStore.close = lambda self: os._exit(9)
elif where == "committed":  # the store closed, the journal not yet saying so
    journal_write = sink.SinkJournal.write
    def killing_write(self, state):
        if state["pending"] is None:
            os._exit(9)
        journal_write(self, state)
    sink.SinkJournal.write = killing_write
sink.commit_batch(root, query, batch, parts, opts, checkpoint)
os._exit(0)
"""


def _killed_attempt(tmp: Path, root: Path, batch_id: int, parts: list[write.StagedPart], where: str,
                    n: int = 0, checkpoint: Path | None = None) -> None:
    parts_file = tmp / f"parts-{batch_id}-{where}-{n}.pickle"
    parts_file.write_bytes(pickle.dumps((parts, OPTS)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(sink.__file__).parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", _KILLED, str(root), QUERY, str(batch_id), where, str(n),
                        str(parts_file)] + ([str(checkpoint)] if checkpoint is not None else []), env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 9, p.stderr[-2000:]


def test_equal_rows_survive_a_kill_at_every_step_of_a_commit(tmp_path):
    """Batch 1 (equal rows within and across partitions and queues) is cut by a kill after two of its six put
    units, its retry after one more, the next retry after its last put (the store not closed), the next after the
    store's close but before the journal's ``committed``; the last retry completes.  Each retry is staged anew (a
    re-run task's parts).  The store then holds every row of batches 0 and 1 exactly as often as the batch has
    it, and a retry after ``committed`` appends nothing."""
    root = _new_store(tmp_path)
    rows = _rows()
    sink.commit_batch(str(root), QUERY, 0, _stage(tmp_path, 0, rows), OPTS)
    for i, (where, n) in enumerate([("put", 2), ("put", 1), ("close", 0), ("committed", 0)]):
        _killed_attempt(tmp_path, root, 1, _stage(tmp_path, 1, rows, f"-try{i}"), where, n)
        got = _stored(root)
        assert all(got[k] <= v for k, v in _want({0: rows, 1: rows}).items()), (where, n)
        assert sum(got.values()) <= 2 * sum(map(len, rows))
    assert sum(1 for k in _stored(root) if k[3] == "1") > 0  # the killed attempts did write rows of batch 1
    summary = sink.commit_batch(str(root), QUERY, 1, _stage(tmp_path, 1, rows, "-last"), OPTS)
    assert summary["messages"] == 0  # the attempt killed before "committed" had written them all
    assert _stored(root) == _want({0: rows, 1: rows})
    assert sink.commit_batch(str(root), QUERY, 1, _stage(tmp_path, 1, rows, "-again"), OPTS)["skipped"]
    assert _stored(root) == _want({0: rows, 1: rows})


def test_a_journal_cut_between_its_two_renames_is_not_read_as_no_journal(tmp_path):
    """The journal's atomic write moves the current file to ``.bak`` and then the new one into place; a kill (or
    a power cut) between the two leaves no journal, the previous state in ``.bak``.  When that write was the
    ``committed`` of a batch whose rows are all in the store, Spark re-runs the batch: the retry must find the
    pending state in ``.bak`` and append nothing, not read "no journal" and append the whole batch again."""
    root = _new_store(tmp_path)
    rows = _rows()
    sink.commit_batch(str(root), QUERY, 0, _stage(tmp_path, 0, rows), OPTS)
    journal = Path(sink.SinkJournal(str(root), QUERY).path)
    assert sink.SinkJournal(str(root), QUERY).read()["committed"] == 0
    # The state a kill between write_bytes_atomic's renames leaves: .bak = the pending state, .tmp = the new one.
    os.replace(journal, f"{journal}.tmp")
    summary = sink.commit_batch(str(root), QUERY, 0, _stage(tmp_path, 0, rows, "-retry"), OPTS)
    assert summary["messages"] == 0  # before the fix: the whole batch again
    assert _stored(root) == _want({0: rows})
    assert sink.SinkJournal(str(root), QUERY).read() == {"queryId": QUERY, "committed": 0, "pending": None}
    # the same cut in the pending write of the next batch: .bak says batch 0 is committed, nothing pending
    sink.SinkJournal(str(root), QUERY).write({"queryId": QUERY, "committed": 0, "pending": None})
    os.replace(journal, f"{journal}.tmp")
    assert sink.commit_batch(str(root), QUERY, 1, _stage(tmp_path, 1, rows), OPTS)["messages"] == sum(map(len, rows))
    assert _stored(root) == _want({0: rows, 1: rows})


def test_a_damaged_record_among_an_earlier_attempts_rows_is_refused(tmp_path):
    """An earlier attempt of batch 0 wrote nine of its twelve put units (over two commitlog segments) and was
    killed; the store was opened and closed cleanly since; then a record of that attempt in the first segment is
    damaged (a body byte changed on disk).  A clean open re-checks only the newest segment, so the store opens;
    the retry's count of what was written cannot see past the damage (the commitlog walk ends there), and
    appending "the rest" would put every row written after it a second time.  The commit refuses, naming the
    offset, and appends nothing."""
    root = _new_store(tmp_path)
    rows = [[dict(r, body=r["body"] + bytes(60000)) for r in part] for part in _rows()]
    _killed_attempt(tmp_path, root, 0, _stage(tmp_path, 0, rows), "put", 9)
    with MessageStore.open(str(root), CFG) as s:  # recovered, closed cleanly
        recs = [(off, size) for off, size, m, _ in s.messages() if m is not None]
    before = _stored(root)
    assert sum(before.values()) == len(recs) and recs[-1][0] > CFG.mappedFileSizeCommitLog
    off, size = recs[2]
    seg = root / "commitlog" / "00000000000000000000"
    with open(seg, "r+b") as fh:
        fh.seek(off)
        record = fh.read(size)
        at = off + max(record.find(b"same"), record.find(b"row-"))  # the body: its CRC no longer matches
        assert at > off
        fh.seek(at)
        fh.write(b"X")
    with pytest.raises(StoreError, match=f"commitlog offset {off} is damaged"):
        sink.commit_batch(str(root), QUERY, 0, _stage(tmp_path, 0, rows, "-retry"), OPTS)
    with MessageStore.open(str(root), CFG, read_only=True) as s:
        assert sum(1 for _, _, m, _ in s.messages(skip_damaged=True) if m is not None) == len(recs) - 1


def test_a_pending_offset_past_the_log_end_is_not_kept_for_the_next_retry(tmp_path):
    """``pending.from`` past the commitlog's end: a power cut took the log's unflushed tail (another writer's
    records before the pending offset, and the attempt's rows after it) while the journal, fsynced, kept the
    offset.  The retry finds nothing there and appends the batch from the log's end, below that offset; if it is
    killed too, the next retry must look from where the rows now are, not from the old offset (it would miss the
    rows the killed retry wrote and append them a second time)."""
    root = _new_store(tmp_path)
    rows = _rows()
    sink.commit_batch(str(root), QUERY, 0, _stage(tmp_path, 0, rows), OPTS)
    with MessageStore.open(str(root), CFG, read_only=True) as s:
        end = s.max_phy_offset()
    sink.SinkJournal(str(root), QUERY).write({"queryId": QUERY, "committed": 0,
                                              "pending": {"batch": 1, "from": end + 4096}})
    _killed_attempt(tmp_path, root, 1, _stage(tmp_path, 1, rows, "-try0"), "put", 2)
    assert 0 < sum(n for k, n in _stored(root).items() if k[3] == "1") < sum(map(len, rows))
    sink.commit_batch(str(root), QUERY, 1, _stage(tmp_path, 1, rows, "-last"), OPTS)
    assert _stored(root) == _want({0: rows, 1: rows})


def test_two_queries_with_equal_rows_in_one_store_each_append_theirs_once(tmp_path):
    """Query A's batch 0 is cut by a kill half-way; query B then appends its batch 0, the same rows (same digests,
    another query id), after A's rows; A's retry scans from its pending offset over B's rows and must count only
    its own: in the end each query's rows are in the store exactly once, B's untouched."""
    other = "0c9e2a41-7d3b-4f0e-8e21-5a6b7c8d9e0f"
    root = _new_store(tmp_path)
    rows = _rows()
    _killed_attempt(tmp_path, root, 0, _stage(tmp_path, 0, rows, "-a"), "put", 3)
    b_parts = [write.stage(iter([pa.RecordBatch.from_pylist(r, schema=ROW_SCHEMA)]), str(tmp_path / "staging-b"), p,
                           0, OPTS, CFG.maxMessageSize, CFG.mappedFileSizeCommitLog, True, sink.RowMarker(other, 0))
               for p, r in enumerate(rows)]
    assert sink.commit_batch(str(root), other, 0, b_parts, OPTS)["messages"] == sum(map(len, rows))
    sink.commit_batch(str(root), QUERY, 0, _stage(tmp_path, 0, rows, "-a-retry"), OPTS)
    with MessageStore.open(str(root), CFG, read_only=True) as s:
        by_query = Counter((m.properties[sink.SINK_PROPERTY].split(":")[0], m.body, m.queue_id, m.keys)
                           for _, _, m, _ in s.messages() if m is not None)
    want = Counter((r["body"], r["queueId"], r["keys"]) for part in rows for r in part)
    for q in (QUERY, other):
        assert Counter({k[1:]: n for k, n in by_query.items() if k[0] == q}) == want, q


@pytest.mark.parametrize("damage", ["torn", "other query", "torn backup"])
def test_a_damaged_journal_is_refused_and_nothing_is_appended(tmp_path, damage):
    """A journal that does not parse, or names another query (and, the journal missing, such a ``.bak``), is
    not read as "no journal" nor replaced by an older state: the commit refuses, naming the file, and the store
    keeps exactly what it had."""
    root = _new_store(tmp_path)
    rows = _rows()
    sink.commit_batch(str(root), QUERY, 0, _stage(tmp_path, 0, rows), OPTS)
    journal = Path(sink.SinkJournal(str(root), QUERY).path)
    if damage == "torn":
        journal.write_bytes(journal.read_bytes()[:20])
    elif damage == "other query":
        journal.write_text(journal.read_text().replace(QUERY, "ffffffff-2d6a-4c55-9a51-0d3f3c1e7a10"))
    else:
        Path(f"{journal}.bak").write_bytes(b'{"queryId": "' + QUERY.encode() + b'", "comm')
        journal.unlink()
    before = _stored(root)
    with pytest.raises(StoreError, match="journal|unreadable"):
        sink.commit_batch(str(root), QUERY, 0, _stage(tmp_path, 0, rows, "-retry"), OPTS)
    assert _stored(root) == before == _want({0: rows})


def test_a_lost_journal_is_not_read_as_a_new_query(tmp_path):
    """Batch 1's attempt is killed half-way, then the journal and its ``.bak`` are lost (deleted).  The retry of
    batch 1 (a query past its first batch with no journal: missing is not empty) looks through the whole log for
    the rows of its batch and appends only the rest."""
    root = _new_store(tmp_path)
    rows = _rows()
    sink.commit_batch(str(root), QUERY, 0, _stage(tmp_path, 0, rows), OPTS)
    _killed_attempt(tmp_path, root, 1, _stage(tmp_path, 1, rows, "-try0"), "put", 3)
    assert 0 < sum(n for k, n in _stored(root).items() if k[3] == "1") < sum(map(len, rows))
    for f in (root / sink.JOURNALS).iterdir():
        f.unlink()
    sink.commit_batch(str(root), QUERY, 1, _stage(tmp_path, 1, rows, "-retry"), OPTS)
    assert _stored(root) == _want({0: rows, 1: rows})


def test_a_lost_journal_of_the_first_batch_is_told_apart_by_the_query_checkpoint(tmp_path, monkeypatch):
    """Session 15 left batch 0 out of the lost-journal rule: with no journal a first batch looks like a new
    query's, so a retry of batch 0 whose journal was lost after its append started appended every row again.
    The sink now marks the query's checkpoint (``<checkpointLocation>/rocketstore-sink/``) before its first
    append to a store: batch 0 killed half-way, journal and .bak deleted, the retry finds the mark and appends
    only the rest.  A new query (no mark) does not look through the log, and marks its checkpoint."""
    root = _new_store(tmp_path)
    rows = _rows()
    checkpoint = tmp_path / "checkpoint"
    _killed_attempt(tmp_path, root, 0, _stage(tmp_path, 0, rows, "-try0"), "put", 3, checkpoint)
    assert 0 < sum(_stored(root).values()) < sum(map(len, rows))
    assert len(list((checkpoint / sink.SinkStart.DIR).glob("*.json"))) == 1
    for f in (root / sink.JOURNALS).iterdir():
        f.unlink()
    sink.commit_batch(str(root), QUERY, 0, _stage(tmp_path, 0, rows, "-retry"), OPTS, f"file://{checkpoint}")
    assert _stored(root) == _want({0: rows})

    def no_scan(*a, **kw):
        raise AssertionError("a new query's first batch looked through the log")
    other = _new_store(tmp_path / "other")
    monkeypatch.setattr(sink, "written_rows", no_scan)
    sink.commit_batch(str(other), QUERY, 0, _stage(tmp_path, 0, rows, "-other"), OPTS, str(tmp_path / "cp2"))
    assert _stored(other) == _want({0: rows})
    assert len(list((tmp_path / "cp2" / sink.SinkStart.DIR).glob("*.json"))) == 1
