"""Issue 29 point 2: put_batch's column-wise encoding (RecordRun) writes the bytes single puts write.

The same messages go into one store through put_batch and into another one by
one (and into a third through put_batch with the run switched off: the tuple
pass of before); commitlog segments, consume queues and index files must be
equal byte for byte.  The clock is fixed, so a batch and the single puts stamp
the same store time.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

import rocketstore.format.encoder as encoder_mod
import rocketstore.store as store_mod
from rocketstore import Message, MessageStore, PutMessageStatus, StoreConfig
from rocketstore.format import codec
from rocketstore.format.encoder import MessageEncoder
from rocketstore.format.run import CONTIGUOUS_MAX_BODY, RecordRun

from conftest import short_pwritev

NOW = 1795400000.123  # a fixed clock (seconds): every put stamps this store time


def _config(segment: int) -> StoreConfig:
    return StoreConfig(mappedFileSizeCommitLog=segment, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=1000,
                       maxIndexNum=4000)


def _work(seed: int) -> list[list[Message] | Message]:
    """Batches (lists) of every shape the encoder tells apart, and messages a batch may not hold (put alone)."""
    rnd = random.Random(seed)
    body = rnd.randbytes
    long_topic = "L" * 130  # more than 127 characters: a V2 record
    return [
        [Message("T", body(1024), queue_id=0) for _ in range(32)],  # one length: one contiguous array
        [Message("T", body(rnd.choice([0, 1, 99, 4096])), queue_id=1) for _ in range(20)],  # lengths differ
        [Message("T", body(CONTIGUOUS_MAX_BODY + 1), queue_id=2) for _ in range(8)],  # large: gathered
        [Message("T", b"", queue_id=0) for _ in range(9)],  # empty bodies
        [Message("T", body(64), queue_id=3, born_timestamp=1700000000000, flag=7,  # (not plain: per record)
                 sys_flag=codec.SYSFLAG_COMPRESSED | codec.SYSFLAG_BORNHOST_V6) for _ in range(10)],  # (stale bit)
        [Message(long_topic, body(50), queue_id=0) for _ in range(12)],  # V2 topic, run
        [Message(long_topic, body(50), tags="TagA", keys=f"k{i} shared", properties={"UNIQ_KEY": f"U{i:04d}"},
                 born_host="[2001:db8::1]:4000") for i in range(8)],  # properties, keys, IPv6: per record
        [Message("T", body(10), queue_id=0) for _ in range(3)],  # fewer than RUN_MIN
        [Message("T", bytearray(body(30)), queue_id=4) for _ in range(9)],  # not bytes: per record
        Message("T", body(40), queue_id=1, sys_flag=codec.TRANSACTION_PREPARED,
                properties={"TRAN_MSG": "true", "PGROUP": "pg", "UNIQ_KEY": "TX1"}),
        Message("T", body(40), queue_id=1, sys_flag=codec.TRANSACTION_COMMIT, keys="txkey"),
        Message("T", body(40), queue_id=0, deliver_at=4102444800000, keys="later",  # (2100: the timer reads the real clock)
                properties={"UNIQ_KEY": "DELAY1"}),  # (else the timer makes a random one)
        [Message("T", body(300), queue_id=0, born_host="10.1.2.3:9876") for _ in range(16)],  # a host: per record
        [Message("T", body(300), queue_id=0) for _ in range(16)],  # the queue goes on after the others
    ]


def _files(root: Path) -> dict[str, bytes]:
    out = {}
    for sub in ("commitlog", "consumequeue", "index"):
        for p in sorted((root / sub).rglob("*")):
            if p.is_file():
                out[str(p.relative_to(root))] = p.read_bytes()
    return out


def _write(path: Path, segment: int, rounds: int, batched: bool) -> dict[str, bytes]:
    with MessageStore.open(str(path), _config(segment), clock=lambda: NOW) as store:
        for _ in range(rounds):
            for item in _work(29):
                if isinstance(item, Message):
                    r = store.put(item)
                    assert r.ok, r.error
                elif batched:
                    r = store.put_batch(item)
                    assert r.ok and r.msg_num == len(item), r.error
                else:
                    for m in item:
                        assert store.put(m).ok
        assert store.wait_dispatched()
    return _files(path)


def test_put_batch_writes_the_bytes_single_puts_write(tmp_path):
    batched = _write(tmp_path / "batch", 4 * 1024 * 1024, 2, batched=True)
    single = _write(tmp_path / "single", 4 * 1024 * 1024, 2, batched=False)
    assert sorted(batched) == sorted(single)
    assert len([k for k in batched if k.startswith("consumequeue")]) > 6 and \
        any(k.startswith("index/") for k in batched)
    for k in batched:
        assert batched[k] == single[k], f"{k} differs"


def test_the_run_writes_the_bytes_of_the_per_record_pass_across_segments(tmp_path, monkeypatch):
    """Small segments: batches move to a new segment whole, the same way with either encoding."""
    runs = _write(tmp_path / "run", 256 * 1024, 4, batched=True)
    monkeypatch.setattr(store_mod, "RUN_MIN", 10 ** 9)
    monkeypatch.setattr(encoder_mod, "RUN_MIN", 10 ** 9)
    tuples = _write(tmp_path / "tuples", 256 * 1024, 4, batched=True)
    assert len([k for k in runs if k.startswith("commitlog")]) >= 3
    assert runs.keys() == tuples.keys()
    for k in runs:
        assert runs[k] == tuples[k], f"{k} differs"


@pytest.mark.parametrize("sizes", [[100] * 8, [100, 0, 7, 100, 3000, 1, 100, 100], [CONTIGUOUS_MAX_BODY + 5] * 8])
def test_run_parts_are_the_per_record_parts(sizes):
    enc = MessageEncoder()
    msgs = [Message("T", os.urandom(n), queue_id=5) for n in sizes]
    run, plain = enc.encode_batch(msgs, 1000)
    assert isinstance(run, RecordRun) and plain
    tuples = [enc.encode(m, 1000) for m in msgs]
    assert list(run) == tuples and run[-1] == tuples[-1] and len(run) == len(msgs)
    assert codec.records_size(run) == sum(r[1] for r in tuples)
    assert list(codec.record_sizes(run)) == [r[1] for r in tuples]
    for step in (1, 0):
        iov, offsets = codec.batch_parts(run, 40, step, 9000, 123456)
        want_iov, want_offsets = codec.batch_parts(tuples, 40, step, 9000, 123456)
        assert b"".join(map(bytes, iov)) == b"".join(want_iov) and offsets == want_offsets
        assert sum(map(len, iov)) == codec.records_size(run)  # (what the writer counts a short write by)


def test_a_batch_that_differs_in_more_than_bodies_is_not_a_run():
    enc = MessageEncoder()
    base = [Message("T", b"x" * 5) for _ in range(10)]
    assert isinstance(enc.encode_batch(base, 1)[0], RecordRun)
    for change in ({"tags": "a"}, {"keys": "k"}, {"properties": {"a": "b"}}, {"flag": 1}, {"born_timestamp": 5},
                   {"born_host": "10.0.0.1:1"}, {"store_host": "10.0.0.1:1"}, {"reconsume_times": 1},
                   {"prepared_transaction_offset": 1}, {"properties_string": "a\x01b\x02"}, {"queue_id": 1},
                   {"body": bytearray(b"x")}):
        msgs = list(base)
        msgs[7] = Message("T", **{"body": b"y", **change})
        records, _ = enc.encode_batch(msgs, 1)
        assert type(records) is list, change
        assert [r[14] for r in records][:7] == [b"x" * 5] * 7


def test_a_bad_message_in_a_uniform_batch_is_refused_and_nothing_is_written(tmp_path):
    cfg = StoreConfig(mappedFileSizeCommitLog=64 * 1024, maxMessageSize=1024)
    with MessageStore.open(str(tmp_path / "s"), cfg) as store:
        assert store.put_batch([Message("T", b"ok") for _ in range(8)]).ok
        before = store.max_phy_offset()
        r = store.put_batch([Message("T", b"x" * 10) for _ in range(8)] + [Message("T", b"x" * 1025)])
        assert r.status is PutMessageStatus.MESSAGE_ILLEGAL and "maxMessageSize" in r.error
        r = store.put_batch([Message("bad topic!", b"x") for _ in range(8)])
        assert r.status is PutMessageStatus.MESSAGE_ILLEGAL and "illegal characters" in r.error
        r = store.put_batch([Message("T", b"x", queue_id=2 ** 31) for _ in range(8)])
        assert r.status is PutMessageStatus.MESSAGE_ILLEGAL and "queue id" in r.error
        r = store.put_batch([Message("T", b"x" * 1000) for _ in range(70)])  # 70 KiB: over a 64 KiB segment
        assert r.status is PutMessageStatus.MESSAGE_ILLEGAL and "do not fit" in r.error
        r = store.put_batch([Message("T", b"x") for _ in range(8)] + [Message("U", b"x")])
        assert r.status is PutMessageStatus.MESSAGE_ILLEGAL and "one topic and queue" in r.error
        r = store.put_batch([Message("T", b"x", sys_flag=codec.TRANSACTION_PREPARED) for _ in range(8)])
        assert r.status is PutMessageStatus.MESSAGE_ILLEGAL and "transaction" in r.error
        r = store.put_batch([Message("T", b"x", delay_level=2) for _ in range(8)])
        assert r.status is PutMessageStatus.MESSAGE_ILLEGAL and "delay" in r.error
        assert store.max_phy_offset() == before
        store.running_flags.make_not_writeable("disk full (test)")
        r = store.put_batch([Message("T", b"x") for _ in range(8)])
        assert r.status is PutMessageStatus.SERVICE_NOT_AVAILABLE and "disk full" in r.error
        assert store.max_phy_offset() == before


def test_a_field_set_after_construction_is_written(tmp_path):
    """A message built plain and given tags, keys, properties or a host afterwards is stored with them, in a
    batch that is then no run, as by a single put."""
    late = [Message("T", b"a%d" % i) for i in range(10)]
    late[2].tags = "TagB"
    late[4].keys = ["k1", "k2"]
    late[6].properties["UNIQ_KEY"] = "U6"  # (the default dict is the message's own)
    late[8].born_host = "[::1]:7"
    with MessageStore.open(str(tmp_path / "s"), _config(1024 * 1024), clock=lambda: NOW) as store:
        assert store.put_batch(late).ok
        assert store.wait_dispatched()
        got = store.get("T", 0, 0, 32).messages
        assert [m.body for m in got] == [m.body for m in late]
        assert got[2].tags == "TagB" and got[4].keys == "k1 k2" and got[6].uniq_key == "U6"
        assert got[8].born_host == codec.format_host(*codec.parse_host("[::1]:7")) and got[8].sys_flag & 0x10
        assert store.query("T", "k2").messages[0].body == b"a4"


def test_message_reads_sets_compares_and_pickles_as_before():
    import pickle
    m = Message("T", b"x")
    assert (m.tags, m.keys, m.flag, m.sys_flag, m.born_timestamp, m.born_host, m.store_host, m.reconsume_times,
            m.prepared_transaction_offset, m.properties_string, m.store_timestamp, m.deliver_at,
            m.delay_level) == (None, None, 0, 0, None, None, None, 0, 0, None, None, None, 0)
    assert m == Message("T", b"x", properties={}) and m != Message("T", b"x", flag=1)
    assert m.properties == {} and m.properties is m.properties
    p = {"a": "b"}
    n = Message("T", b"x", 3, "tg", properties=p, delay_level=2)
    assert n.properties is p and n.queue_id == 3 and n.tags == "tg" and n.delay_level == 2
    n.flag = 9
    assert pickle.loads(pickle.dumps(n)) == n and pickle.loads(pickle.dumps(m)) == m
    assert repr(Message("T")).startswith("Message(topic='T', body=b'', queue_id=0, tags=None")
    with pytest.raises(AttributeError):
        m.no_such_field = 1  # (slots, as the dataclass had)


@pytest.mark.parametrize("sizes", [[700] * 40, [700, 5, 1200, 0] * 10])
def test_a_short_write_of_a_run_is_finished(tmp_path, monkeypatch, sizes):
    """pwritev may write less than asked: the run's buffers must say their length in bytes, so the rest is
    written before the put is acknowledged."""
    from rocketstore.storage import commitlog
    real = os.pwritev
    calls = []

    short = short_pwritev(calls)
    msgs = [Message("T", bytes([i]) * n) for i, n in enumerate(sizes)]
    with MessageStore.open(str(tmp_path / "s"), _config(1024 * 1024)) as store:
        monkeypatch.setattr(commitlog.os, "pwritev", short)
        r = store.put_batch(msgs)
        monkeypatch.setattr(commitlog.os, "pwritev", real)
        assert r.ok and calls
        assert store.wait_dispatched()
        got = [m.body for i in (0, 32) for m in store.get("T", 0, i, 32, max_total_bytes=1 << 20).messages]
        assert got == [m.body for m in msgs]
        assert store.max_phy_offset() == r.commit_log_offset + r.wrote_bytes


@pytest.mark.parametrize("n", [1, 47, 48, 300])
def test_consume_queue_units_packed_in_one_array_are_the_struct_units(n):
    import struct
    from rocketstore.storage.consume_queue import pack_units
    rnd = random.Random(n)
    offsets = [rnd.randrange(2 ** 62) for _ in range(n)]
    sizes = [rnd.randrange(2 ** 31) for _ in range(n)]
    codes = [rnd.randrange(-2 ** 63, 2 ** 63) for _ in range(n)]  # tagsCodes (and delay times) are signed
    unit = struct.Struct(">qiq")
    assert pack_units(offsets, sizes, codes) == b"".join(map(unit.pack, offsets, sizes, codes))
