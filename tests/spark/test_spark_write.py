"""The Spark append's two halves without a Spark session: tasks encode their rows (stage), the driver stamps
and writes them (commit).  What the tasks computed for the dispatcher (tagsCodes, index key hashes) must be
what the store computes on its own put path, or keys would be unfindable."""

from __future__ import annotations

import pyarrow as pa
import pytest

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.format import codec
from rocketstore.errors import ReadOnlyStoreError, StoreError
from rocketstore.storage.index import key_hashes, key_hashes_many
from rocketstore.spark import write

CFG = StoreConfig(mappedFileSizeCommitLog=1 << 20, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=1000,
                  maxIndexNum=4000)


def _key_with_hash(prefix: str, target: int, width: int = 7) -> str:
    """``prefix`` plus ASCII characters so that Java's hashCode of the whole is ``target``."""
    rest = (target - codec.java_hash(prefix) * pow(31, width, 1 << 32) - 48 * sum(31 ** k for k in range(width))) \
        % (1 << 32)
    digits = []
    for _ in range(width):
        rest, d = divmod(rest, 31)
        digits.append(chr(48 + d))
    return prefix + "".join(reversed(digits))


def test_key_hashes_many_equals_one_by_one():
    """The vectorised hash agrees with Java's hashCode on ASCII, non-ASCII, long and empty keys, and maps a
    key hashing to Integer.MIN_VALUE to 0 as RocketMQ does."""
    topic_min = _key_with_hash("T#", -0x80000000)
    assert codec.java_hash(topic_min) == -0x80000000
    messages = [("T", "UNIQ1", "a b"), ("T", None, "  double  spaced  "), ("T", "only-uniq", None),
                ("T", None, None), ("Tópico", "é", "中 😀 x"), ("T", "x" * 300, "y" * 256 + " " + "z" * 257),
                ("T", topic_min[2:], None), ("T", "", ""), ("T", None, "k" * 40)]
    got = key_hashes_many(messages)
    assert got == [key_hashes(*m) or None for m in messages]
    assert got[6] == [0] and got[3] is None and got[7] is None
    assert len(got[1]) == 2  # empty tokens are not keys


ROW_SCHEMA = pa.schema([("topic", pa.string()), ("body", pa.binary()), ("queueId", pa.int32()),
                        ("tags", pa.string()), ("keys", pa.string()),
                        ("properties", pa.map_(pa.string(), pa.string())), ("bornTimestamp", pa.int64()),
                        ("bornHost", pa.string())])


def _rows(n: int) -> list[dict]:
    out = []
    for i in range(n):
        out.append({"topic": f"T{i % 3}", "body": b"body-%d" % i, "queueId": i % 4,
                    "tags": None if i % 5 == 0 else f"Tag{i % 7}" + ("é" if i % 11 == 0 else ""),
                    "keys": None if i % 6 == 0 else f"k-{i} order-{i // 2}" + (" 鍵" if i % 13 == 0 else ""),
                    "properties": [("UNIQ_KEY", f"U{i:08d}"), ("a", "b")] if i % 2 else None,
                    "bornTimestamp": 1_700_000_000_000 + i, "bornHost": "10.1.2.3:4567" if i % 9 else "[::1]:9"})
    return out


def _put_path_store(root, rows: list[dict]) -> None:
    with MessageStore.open(str(root), CFG) as store:
        for r in rows:
            m = Message(r["topic"], r["body"], r["queueId"], r["tags"], r["keys"], dict(r["properties"] or []),
                        born_timestamp=r["bornTimestamp"], born_host=r["bornHost"])
            assert store.put(m).ok
        store.wait_dispatched()


def _spark_path_store(root, tmp_path, rows: list[dict], parts: int = 2) -> dict:
    staged = []
    for p in range(parts):
        batch = pa.RecordBatch.from_pylist(rows[p::parts], schema=ROW_SCHEMA)
        staged.append(write.stage(iter([batch]), str(tmp_path / "staging"), p, 0, write.WriteOptions(),
                                  CFG.maxMessageSize, CFG.mappedFileSizeCommitLog))
    MessageStore.open(str(root), CFG).close()
    return write.commit(str(root), staged, write.WriteOptions())


def _queue(store: MessageStore, topic: str, q: int, tag_filter: str | None = None) -> list:
    out, offset = [], 0
    while offset < store.max_offset_in_queue(topic, q):
        r = store.get(topic, q, offset, tag_filter=tag_filter)
        out += r.messages
        offset = r.next_begin_offset
    return out


def _index_hashes(store: MessageStore) -> list[int]:
    return sorted(e[0] for f in store.index_service.files for e in f.entries_iter())


def test_staged_commit_dispatches_as_the_put_path_does(tmp_path):
    """The same rows put one by one and appended through stage + commit: every queue holds the same messages
    with the same tagsCodes, the index holds the same key hashes, and every key and UNIQ_KEY is found."""
    rows = _rows(600)
    _put_path_store(tmp_path / "put", rows)
    assert _spark_path_store(tmp_path / "spark", tmp_path, rows)["messages"] == 600
    with MessageStore.open(str(tmp_path / "put"), read_only=True) as a, \
            MessageStore.open(str(tmp_path / "spark"), read_only=True) as b:
        for t in range(3):
            for q in range(4):
                fields = [[(m.body, m.properties, m.born_timestamp, m.born_host) for m in _queue(s, f"T{t}", q)]
                          for s in (a, b)]
                assert fields[0] == fields[1] and len(fields[0]) == 50
                codes = [[s._cq_table[(f"T{t}", q)].get_unit(i)[2] for i in range(50)] for s in (a, b)]
                assert codes[0] == codes[1] and any(codes[0])
        assert _index_hashes(a) == _index_hashes(b) and len(_index_hashes(a)) > 1000
        for i in range(0, 600, 7):
            r = rows[i]
            want = [r["body"]]
            if r["keys"]:
                for k in r["keys"].split(" "):
                    assert want == [m.body for m in b.query(r["topic"], k).messages if m.body == r["body"]], k
            if r["properties"]:
                assert [m.body for m in b.query(r["topic"], f"U{i:08d}").messages] == want
        tagged = _queue(b, "T1", 1, "Tag1")  # tagsCode filtering sees the tasks' codes
        assert tagged and [m.body for m in tagged] == [m.body for m in _queue(a, "T1", 1, "Tag1")]


def test_commit_refuses_records_over_the_stores_limit(tmp_path):
    """Rows staged for a larger maxMessageSize than the store's are refused at the commit, naming what was
    written; the store keeps what it had and stays readable."""
    root = tmp_path / "store"
    small = StoreConfig(mappedFileSizeCommitLog=1 << 20, maxMessageSize=1000)
    with MessageStore.open(str(root), small) as store:
        assert store.put(Message("T", b"first")).ok
    rows = [{"topic": "T", "body": b"a" * 10}, {"topic": "T", "body": b"b" * 5000}]
    part = write.stage(iter([pa.RecordBatch.from_pylist(rows)]), str(tmp_path / "s"), 0, 0, write.WriteOptions(),
                       4 << 20, 1 << 20)
    with pytest.raises(StoreError, match=r"was refused: MESSAGE_ILLEGAL: a \d+-byte record is over maxMessageSize "
                                         r"1000"):
        write.commit(str(root), [part], write.WriteOptions(config={"maxMessageSize": "1000"}))
    with MessageStore.open(str(root), small, read_only=True) as store:
        assert [m.body for _, _, m, _ in store.messages()] == [b"first"]


def test_put_encoded_checks_what_the_writer_vouches_for(tmp_path):
    """put_encoded refuses a batch mixing queues or topics or holding a transaction record among others, and a
    read-only store; nothing is written."""
    enc = write.MessageEncoder(CFG.maxMessageSize)
    with MessageStore.open(str(tmp_path / "s"), CFG) as store:
        recs = [enc.encode(Message("T", b"x", 0), 0), enc.encode(Message("T", b"y", 1), 0)]
        assert store.put_encoded("T", 0, recs, None).status.value == "MESSAGE_ILLEGAL"
        txn = [enc.encode(Message("T", b"x", 0), 0), enc.encode(Message("T", b"y", 0, sys_flag=4), 0)]
        assert store.put_encoded("T", 0, txn, None).status.value == "MESSAGE_ILLEGAL"
        other = [enc.encode(Message("T", b"x", 0), 0), enc.encode(Message("Tx", b"y", 0), 0)]
        wrong = store.put_encoded("T", 0, other, None)  # a record of topic Tx must not land in T's queue
        assert wrong.status.value == "MESSAGE_ILLEGAL" and "not of topic 'T'" in wrong.error
        assert store.put_encoded("bad topic", 0, recs[:1], None).status.value == "MESSAGE_ILLEGAL"
        assert store.put_encoded("T", 0, [], None).error == "empty batch"
        assert store.max_phy_offset() == 0
        ok = store.put_encoded("T", 0, [enc.encode(Message("T", b"x", 0, keys="k1"), 0)], ([0], [key_hashes("T", None, "k1")]))
        assert ok.ok
        store.wait_dispatched()
        assert [m.body for m in store.query("T", "k1").messages] == [b"x"]
    with MessageStore.open(str(tmp_path / "s"), CFG, read_only=True) as store:
        with pytest.raises(ReadOnlyStoreError):  # as put does
            store.put_encoded("T", 0, recs[:1], None)


def test_append_batches_units(tmp_path):
    """A plain append puts each staged batch queue by queue (each queue in its rows' order) in runs of at most
    BATCH_MESSAGES; a replay batches only runs of one queue and store time, and puts transaction records alone,
    so that the commitlog order is the rows' order."""

    def staged(rows, replay=False):
        part = write.stage(iter([pa.RecordBatch.from_pylist(rows)]), str(tmp_path / "stage"), 0, 0,
                           write.WriteOptions(replay=replay), 4 << 20)
        return list(write.batches(write._staged_rows([part], replay), 1 << 20))

    plain = staged([{"topic": "A", "body": b"%d" % i, "queueId": i % 2} for i in range(10)])
    assert [[(r[0], r[1], r[2][14]) for r in b] for b in plain] == [
        [("A", 0, b"%d" % i) for i in range(0, 10, 2)], [("A", 1, b"%d" % i) for i in range(1, 10, 2)]]
    many = staged([{"topic": "A", "body": b"b", "queueId": 0}] * (write.BATCH_MESSAGES + 3))
    assert [len(b) for b in many] == [write.BATCH_MESSAGES, 3]

    def row(q, ts, flag=0):
        return {"topic": "A", "body": b"b", "queueId": q, "storeTimestamp": ts, "sysFlag": flag}
    replay = staged([row(0, 5), row(0, 5), row(1, 5), row(0, 5), row(0, 6), row(0, 6, 4), row(0, 6)], replay=True)
    got = [[(r[1], r[3], r[2][6]) for r in b] for b in replay]
    assert got == [[(0, 5, 0), (0, 5, 0)], [(1, 5, 0)], [(0, 5, 0)], [(0, 6, 0)], [(0, 6, 4)], [(0, 6, 0)]]


_COMMIT_CHILD = r"""
import sys, pyarrow as pa
from rocketstore import MessageStore, StoreConfig
from rocketstore.spark import write
root, staging, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = StoreConfig(mappedFileSizeCommitLog=4 << 20, mappedFileSizeConsumeQueue=60000, maxHashSlotNum=5000,
                  maxIndexNum=400000)
rows = [{"topic": "T", "body": b"%d" % i + b"." * 300, "queueId": i % 3, "keys": f"k{i}"} for i in range(n)]
parts = [write.stage(iter([pa.RecordBatch.from_pylist(rows[p::2])]), staging, p, 0, write.WriteOptions(),
                     cfg.maxMessageSize, cfg.mappedFileSizeCommitLog) for p in range(2)]
opts = write.WriteOptions(config={"mappedFileSizeCommitLog": str(4 << 20), "mappedFileSizeConsumeQueue": "60000",
                                  "maxHashSlotNum": "5000", "maxIndexNum": "400000"})
print("staged", flush=True)
write.commit(root, parts, opts)
print("committed", flush=True)
"""


def test_commit_killed_midway_leaves_every_queue_a_prefix(tmp_path):
    """SIGKILL of the driver's commit half-way: the store opens (abnormal recovery), verifies clean but for a
    torn last record, and each queue holds a prefix of its rows (partition 0's before partition 1's), every one intact and found by key."""
    import signal
    import subprocess
    import sys
    import time

    from rocketstore.recovery.verify import verify_store
    root, n = tmp_path / "store", 80000
    p = subprocess.Popen([sys.executable, "-c", _COMMIT_CHILD, str(root), str(tmp_path / "staging"), str(n)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "staged"
    deadline = time.monotonic() + 60
    second = root / "commitlog" / f"{4 << 20:020d}"
    while time.monotonic() < deadline:  # kill once records reach the second segment, well before the end
        try:
            with open(second, "rb") as fh:
                head = fh.read(4)
                if len(head) == 4 and head != bytes(4):  # a record's size, not a pre-allocated file's zeros (nor
                    break  # the empty file the next segment is for an instant after its creation)
        except FileNotFoundError:
            pass
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    p.wait(30)
    cfg = StoreConfig(mappedFileSizeCommitLog=4 << 20, mappedFileSizeConsumeQueue=60000, maxHashSlotNum=5000,
                      maxIndexNum=400000)
    with MessageStore.open(str(root), cfg) as store:
        assert not store.last_exit_ok
        # A record the kill tore (its put never returned) is cut by recovery, which verify names as torn-tail.
        problems = [f for f in verify_store(store.files)["problems"] if f["kind"] != "torn-tail"]
        assert not problems, problems[:5]
        total = 0
        for q in range(3):
            want = [i for i in range(0, n, 2) if i % 3 == q] + [i for i in range(1, n, 2) if i % 3 == q]
            got, offset = [], 0
            while offset < store.max_offset_in_queue("T", q):
                r = store.get("T", q, offset)
                got += r.messages
                offset = r.next_begin_offset
            ids = [int(m.body.split(b".")[0]) for m in got]
            assert ids == want[:len(ids)], q
            assert all(m.body == b"%d" % i + b"." * 300 for m, i in zip(got, ids))
            total += len(ids)
            for i in ids[:: max(1, len(ids) // 20)]:
                assert [int(m.body.split(b".")[0]) for m in store.query("T", f"k{i}").messages] == [i]
        assert 0 < total < n, total  # killed half-way, not before or after
