"""Issue 16 items 3 and 7: reads never return a damaged record, nor one that is not what the consume-queue unit or
index entry claims.  Every case damages a copy of the golden store written by RocketMQ 5.3.3."""

from __future__ import annotations

import base64
import json
import os
import struct

import pytest

from rocketstore import CorruptRecordError, GetMessageStatus, Message, MessageStore
from rocketstore.format import codec
from conftest import GOLDEN_CONF, copy_store, flip_body_bit, golden_expected, golden_store, run_cli
from test_read_bad_input import one_error_line

SEG0 = "commitlog/00000000000000000000"
DAMAGED = 696  # the second record of the basic store: TopicA, queue 1, queue offset 1


@pytest.fixture
def flipped(tmp_path):
    store = copy_store(golden_store("basic"), tmp_path / "s")
    flip_body_bit(store, DAMAGED)
    return store


def test_get_refuses_a_damaged_body_and_never_steps_over_it(flipped):
    with MessageStore.open(str(flipped), read_only=True) as s:
        r = s.get("TopicA", 1, 0, 32)  # the message before it, and no further
        assert r.status is GetMessageStatus.FOUND and r.next_begin_offset == 1
        assert [m.commit_log_offset for m in r.messages] == [0]
        with pytest.raises(CorruptRecordError) as e:
            s.get("TopicA", 1, 1, 32)
        assert e.value.path == str(flipped / SEG0) and e.value.offset == DAMAGED
        assert f"{flipped / SEG0} at offset {DAMAGED}" in str(e.value) and "body CRC mismatch" in str(e.value)
        # without the body there is nothing damaged to return: headers still read
        r = s.get("TopicA", 1, 1, 32, read_body=False)
        assert r.status is GetMessageStatus.FOUND and r.messages[0].commit_log_offset == DAMAGED
        with pytest.raises(CorruptRecordError, match=f"at offset {DAMAGED}"):
            s.look(DAMAGED)
        assert s.look(DAMAGED, read_body=False).queue_offset == 1


def test_cli_get_and_query_of_a_damaged_body_exit_2_naming_file_and_offset(flipped):
    line = one_error_line(run_cli("get", flipped, "--topic", "TopicA", "--queue-id", "1", "--offset", "1"))
    assert f"{flipped / SEG0} at offset {DAMAGED}" in line and "body CRC mismatch" in line
    key = [e for e in golden_expected("basic") if e["commitLogOffset"] == DAMAGED][0]["keys"].split()[0]
    line = one_error_line(run_cli("query", flipped, "--topic", "TopicA", "--key", key))
    assert f"{flipped / SEG0} at offset {DAMAGED}" in line and "body CRC mismatch" in line
    r = run_cli("query", flipped, "--topic", "TopicA", "--key", key, "--no-body")
    assert r.returncode == 0 and DAMAGED in json.loads(r.stdout)["phyOffsets"]


def test_dump_stops_at_a_damaged_body_and_skip_damaged_resumes_after_it(flipped):
    line = one_error_line(run_cli("dump", flipped))
    assert f"{flipped / SEG0} at file position {DAMAGED}" in line and "body CRC mismatch" in line
    expected = [e["commitLogOffset"] for e in golden_expected("basic")]
    r = run_cli("dump", flipped, "--skip-damaged")
    assert r.returncode == 1
    got = [json.loads(x)["commitLogOffset"] for x in r.stdout.decode().splitlines()]
    assert got == [o for o in expected if o != DAMAGED]
    err = r.stderr.decode()
    assert f"skipped damaged record at commitlog offset {DAMAGED}" in err and str(flipped / SEG0) in err
    assert "1 damaged record(s) skipped" in err and "Traceback" not in err


def test_dump_skip_damaged_resynchronises_past_garbage(tmp_path):
    store = copy_store(golden_store("basic"), tmp_path / "s")
    expected = [e["commitLogOffset"] for e in golden_expected("basic")]
    # garbage over the header of one record and into the next: the walk cannot step over it by its size
    start = expected[5]
    with open(store / SEG0, "r+b") as fh:
        fh.seek(start)
        fh.write(os.urandom(expected[6] - start + 30))
    r = run_cli("dump", store, "--skip-damaged", "--no-body")
    assert r.returncode == 1, r.stderr
    got = [json.loads(x)["commitLogOffset"] for x in r.stdout.decode().splitlines()]
    assert got == [o for o in expected if o not in (expected[5], expected[6])]
    assert f"at commitlog offset {start}" in r.stderr.decode()


def test_get_through_a_unit_pointing_at_another_queues_record_is_an_error(tmp_path):
    store = copy_store(golden_store("basic"), tmp_path / "s")
    # unit 0 of TopicA/0 now claims the record at offset 0, which is TopicA/1's offset 0 (size 696)
    with open(store / "consumequeue/TopicA/0/00000000000000000000", "r+b") as fh:
        fh.write(struct.pack(">qi", 0, 696))
    with MessageStore.open(str(store), read_only=True) as s:
        with pytest.raises(CorruptRecordError) as e:
            s.get("TopicA", 0, 0, 32)
        assert e.value.offset == 0
        assert "TopicA/1 offset 0" in str(e.value) and "consumequeue/TopicA/0/00000000000000000000" in str(e.value)
    line = one_error_line(run_cli("get", store, "--topic", "TopicA", "--queue-id", "0", "--offset", "0", "--no-body"))
    assert "TopicA/1 offset 0" in line and f"{store / SEG0} at offset 0" in line


@pytest.mark.parametrize("field,at,mask", [("size", 8, 0x40), ("size", 11, 0x08),
                                            ("offset", 6, 0x01), ("offset", 7, 0x40)])
@pytest.mark.parametrize("read_only", [True, False])
def test_get_finds_the_record_of_a_unit_with_a_flipped_size_or_offset(tmp_path, field, at, mask, read_only):
    """Fuzz seeds 1601031 (size) and 1701039 (offset): a bit flip in a unit made its intact record unreadable
    (CorruptRecordError at that offset until verify --repair).  The record that names itself as the unit's
    (topic, queue id, queue offset, PHYSICALOFFSET, body CRC) is found at the offset by its own size, or
    between the records of the units before and after; nothing else is returned."""
    store = copy_store(golden_store("basic"), tmp_path / "s")
    queue = sorted((e for e in golden_expected("basic") if (e["topic"], e["queueId"]) == ("TopicA", 1)),
                   key=lambda e: e["queueOffset"])
    with open(store / "consumequeue/TopicA/1/00000000000000000000", "r+b") as fh:
        fh.seek(37 * 20 + at)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ mask]))
    with MessageStore.open(str(store), read_only=read_only, start_services=False) as s:
        [m] = s.get("TopicA", 1, 37, 1).messages
        assert (m.commit_log_offset, m.queue_offset, m.body) == (queue[37]["commitLogOffset"], 37,
                                                                   base64.b64decode(queue[37]["body"]))
        got, off = [], 30  # a consumer's loop: every message once, in order (a huge size may end a call early)
        while off < 62:
            r = s.get("TopicA", 1, off, 32)
            got += r.messages
            off = r.next_begin_offset
        assert [m.queue_offset for m in got][:32] == list(range(30, 62))
        assert [m.commit_log_offset for m in got][:32] == [e["commitLogOffset"] for e in queue[30:62]]


def test_query_drops_an_index_entry_pointing_at_an_unrelated_record(tmp_path):
    store = copy_store(golden_store("basic"), tmp_path / "s")
    rows = golden_expected("basic")
    target = next(e for e in rows if e["topic"] == "TopicA" and e["keys"])
    other = next(e for e in rows if e["topic"] == "TopicB")
    key = target["keys"].split()[0]
    slots = 1000  # golden geometry: maxHashSlotNum
    moved = 0
    for name in sorted(os.listdir(store / "index")):
        path = store / "index" / name
        data = bytearray(path.read_bytes())
        for at in range(40 + 4 * slots, len(data) - 19, 20):
            key_hash, phy, _diff, _prev = struct.unpack_from(">iqii", data, at)
            if phy == target["commitLogOffset"] and key_hash == codec.index_key_hash(f"TopicA#{key}"):
                struct.pack_into(">q", data, at + 4, other["commitLogOffset"])
                path.write_bytes(bytes(data))
                moved += 1
    assert moved == 1
    with MessageStore.open(str(store), read_only=True) as s:
        r = s.query("TopicA", key)
        assert other["commitLogOffset"] not in r.phy_offsets
        assert all(m.topic == "TopicA" and key in m.keys.split() for m in r.messages)


def test_query_drops_hash_collisions(tmp_path):
    """"Aa" and "BB" have the same Java hashCode, so TopicX#Aa and TopicX#BB share index slot and key hash."""
    assert codec.java_hash("TopicX#Aa") == codec.java_hash("TopicX#BB")
    conf = tmp_path / "broker.conf"
    conf.write_text(GOLDEN_CONF)
    with MessageStore.open(str(tmp_path / "s"), str(conf)) as s:
        assert s.put(Message("TopicX", b"a", keys="Aa")).ok
        assert s.put(Message("TopicX", b"b", keys="x BB")).ok
        assert s.put(Message("TopicY", b"c", keys="BB")).ok
        assert s.wait_dispatched()
        assert [m.body for m in s.query("TopicX", "BB").messages] == [b"b"]
        assert [m.body for m in s.query("TopicX", "Aa").messages] == [b"a"]
        assert [m.body for m in s.query("TopicY", "BB").messages] == [b"c"]


def test_pop_consumer_stops_at_a_damaged_message_and_never_acks_it(tmp_path):
    from rocketstore.storage.consumer_offsets import ConsumerOffsetManager
    from rocketstore.queues.pop import PopService, TagFilter
    conf = tmp_path / "broker.conf"
    conf.write_text(GOLDEN_CONF)
    with MessageStore.open(str(tmp_path / "s"), str(conf)) as s:
        for i in range(5):
            assert s.put(Message("T", f"body-{i}".encode(), queue_id=0)).ok
        assert s.put(Message("T", b"other", queue_id=1)).ok
        assert s.wait_dispatched()
        seg = s.commitlog.queue.files[0]
        m = s.get("T", 0, 2, 1).messages[0]
        at = m.commit_log_offset + m.size - len(m.body) - 1 - 1 - 2 - len(m.properties_string.encode())
        assert seg.mm[at:at + len(m.body)] == m.body
        seg.mm[at] ^= 0x01
        offsets = ConsumerOffsetManager(s.paths.config)
        pop = PopService(s, offsets, s.paths.config)

        def recv(qids):
            return pop.receive("G", "T", list(qids), 32, 10_000, TagFilter("*"), fifo=False, max_attempts=16,
                               client="c1", auto_renew=False)

        out, _ = recv([0])
        assert [d.entry.offset for d in out] == [0, 1]
        for d in out:
            assert pop.ack("G", "T", d.handle)
        with pytest.raises(CorruptRecordError, match=f"at offset {m.commit_log_offset}"):
            recv([0])
        out, _ = recv([0, 1])  # the other queue still delivers
        assert [(d.queue_id, d.entry.offset) for d in out] == [(1, 0)]
        with pytest.raises(CorruptRecordError):
            recv([0])
        assert offsets.get("T", "G", 0) == 2  # the damaged message is neither delivered nor acked


@pytest.mark.timeout(120)
def test_broker_answers_message_corrupted_naming_file_and_offset(tmp_path):
    pytest.importorskip("grpc")
    from broker.test_broker_bad_input import md, receive, send_req

    from rocketstore.bench.broker_harness import BrokerProcess
    from rocketstore.broker.proto import pb, svc_grpc
    import grpc
    root = tmp_path / "store"
    b = BrokerProcess(str(root), conf={"mappedFileSizeCommitLog": 1048576, "mappedFileSizeConsumeQueue": 6000},
                      args=["--no-auto-create-topics", "--topic", "Damaged:1:NORMAL"])
    b.start()
    try:
        with grpc.insecure_channel(b.endpoint) as ch:
            stub = svc_grpc.MessagingServiceStub(ch)
            for body in (b"first message", b"second message"):
                r = stub.SendMessage(send_req(topic="Damaged", body=body), metadata=md(), timeout=5)
                assert r.status.code == pb.Code.OK, r.status
            data = (root / SEG0).read_bytes()  # an acknowledged send is in the file (no store opened here)
            (offset,) = [p for p, _size, m, _ in codec.walk(data, 0, len(data), check_crc=True, read_body=True)
                         if m is not None and m.body == b"first message"]
            flip_body_bit(root, offset)
            first = receive(stub, topic="Damaged", group="G")[0]
            assert first.status.code == pb.Code.MESSAGE_CORRUPTED, first.status
            assert f"{root / SEG0} at offset {offset}" in first.status.message
            again = receive(stub, topic="Damaged", group="G")[0]  # neither skipped nor acked
            assert again.status.code == pb.Code.MESSAGE_CORRUPTED
            r = stub.SendMessage(send_req(topic="Damaged", body=b"still serving"), metadata=md(), timeout=5)
            assert r.status.code == pb.Code.OK
    finally:
        assert b.stop() == 0, b.tail_log()


def test_cli_get_at_the_end_the_record_check_cut_names_the_damage(tmp_path):
    """A damaged body inside the range the open re-checks ends the readable log there (the queues are cut);
    a get that would answer "no more messages" at that cut names the damaged record instead."""
    store = copy_store(golden_store("basic"), tmp_path / "s")
    last = "commitlog/00000000000003145728"
    row = [e for e in golden_expected("basic") if e["commitLogOffset"] > 3145728][100]
    flip_body_bit(store, row["commitLogOffset"], last)
    args = ["--topic", row["topic"], "--queue-id", str(row["queueId"])]
    line = one_error_line(run_cli("get", store, *args, "--offset", str(row["queueOffset"])))
    assert f"{store / last} at file position {row['commitLogOffset'] - 3145728}" in line
    assert "body CRC mismatch" in line and f"queue offset {row['queueOffset']}" in line
    r = run_cli("get", store, *args, "--offset", "0", "--max", "1")
    assert r.returncode == 0 and json.loads(r.stdout)["status"] == "FOUND"
