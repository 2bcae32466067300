"""MessageEncoder.encode_batch: the batch pass makes byte for byte the records encode makes, one by one."""

from __future__ import annotations

import pytest

from rocketstore.format import codec
from rocketstore.format.encoder import MessageEncoder
from rocketstore.format.message import Message


def _bytes(rec: codec.EncodedRecord) -> bytes:
    out = bytearray(rec[1])
    codec.write_record(out, 0, rec, 7, 4096, 1700000000123)
    return bytes(out)


def test_batch_records_are_the_ones_encode_makes():
    enc = MessageEncoder()
    msgs = [Message("T", b"plain", queue_id=3),
            Message("T", bytearray(b"a bytearray body"), queue_id=3),
            Message("T", b"tagged", queue_id=3, tags="TagA", keys="k1 k2"),
            Message("T", b"born", queue_id=3, born_timestamp=1234, flag=5, reconsume_times=2),
            Message("T", b"host", queue_id=3, born_host="10.0.0.1:4321"),
            Message("T", b"v6", queue_id=3, store_host=(bytes(15) + b"\x01", 10911)),
            Message("T", b"props", queue_id=3, properties={"UNIQ_KEY": "u1"}),
            Message("T", b"", queue_id=3)]
    records, plain = enc.encode_batch(msgs, 1700000000000)
    assert not plain
    assert [_bytes(r) for r in records] == [_bytes(enc.encode(m, 1700000000000)) for m in msgs]


def test_a_plain_batch_says_so_and_a_bad_message_is_refused():
    enc = MessageEncoder(max_message_size=100)
    records, plain = enc.encode_batch([Message("T", b"x" * 10) for _ in range(3)], 1)
    assert plain and [r[14] for r in records] == [b"x" * 10] * 3
    with pytest.raises(codec.MessageTooLarge):
        enc.encode_batch([Message("T", b"x"), Message("T", b"y" * 101)], 1)
    with pytest.raises(codec.RecordError):
        enc.encode_batch([Message("T", b"x", queue_id=-1)], 1)


def test_batch_parts_are_record_parts_one_after_another():
    enc = MessageEncoder()
    records, _ = enc.encode_batch([Message("T", b"a" * n, queue_id=1, flag=n) for n in (0, 5, 300)], 42)
    records.append(enc.encode(Message("T", b"t", queue_id=1, tags="x", born_host="10.1.2.3:9"), 42))
    iov, offsets = codec.batch_parts(records, 10, 1, 5000, 77)
    want, at = [], 5000
    for i, r in enumerate(records):
        want += codec.record_parts(r, 10 + i, at, 77)
        at += r[1]
    assert iov == want and offsets == [5000, 5000 + records[0][1], 5000 + records[0][1] + records[1][1],
                                       5000 + sum(r[1] for r in records[:3])]
    iov, _ = codec.batch_parts(records[:2], 10, 0, 5000, 77)  # transaction halves: queue offset stays
    assert iov == [*codec.record_parts(records[0], 10, 5000, 77),
                   *codec.record_parts(records[1], 10, 5000 + records[0][1], 77)]
