"""Issue 3: reading RocketMQ's own stores exactly as RocketMQ does (every field, query and time lookup)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from rocketstore import CorruptRecordError, GetMessageStatus, MessageStore, parse_tag_filter
from conftest import GOLDEN_NAMES, copy_store, golden_expected, golden_queries, golden_store, run_cli

DUMP_FIELDS = ["topic", "queueId", "queueOffset", "commitLogOffset", "size", "sysFlag", "flag", "bodyCrc",
               "reconsumeTimes", "preparedTransactionOffset", "bornTimestamp", "storeTimestamp", "bornHost",
               "storeHost", "msgId", "tags", "keys", "properties", "propertiesString", "body", "bodyLength",
               "magicCode"]


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_dump_reproduces_every_field_of_every_message(name):
    r = run_cli("dump", golden_store(name))
    assert r.returncode == 0, r.stderr
    got = [json.loads(line) for line in r.stdout.decode().splitlines()]
    expected = sorted(golden_expected(name), key=lambda e: e["commitLogOffset"])
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert list(g) == DUMP_FIELDS
        assert {k: e[k] for k in DUMP_FIELDS} == g


def test_dump_options_topic_limit_offset_no_body():
    store = golden_store("basic")
    expected = [e for e in golden_expected("basic") if e["topic"] == "TopicB"]
    r = run_cli("dump", store, "--topic", "TopicB", "--limit", "5", "--no-body")
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    assert [x["commitLogOffset"] for x in rows] == [e["commitLogOffset"] for e in expected[:5]]
    assert all("body" not in x and x["bodyLength"] > 0 for x in rows)
    start = expected[3]["commitLogOffset"]
    r = run_cli("dump", store, "--from-offset", start, "--limit", "1")
    assert json.loads(r.stdout)["commitLogOffset"] == start


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_state_equals_recorded_store_state(name):
    r = run_cli("state", golden_store(name))
    assert r.returncode == 0, r.stderr
    state = json.loads(r.stdout)
    want = golden_queries(name)["storeState"]
    assert state["minPhyOffset"] == want["minPhyOffset"]
    assert state["maxPhyOffset"] == want["maxPhyOffset"]
    assert state["queues"] == want["queues"]
    assert state["abortFilePresent"] is False
    with open(golden_store(name) / "checkpoint", "rb") as fh:
        raw = fh.read(40)
    cp = state["checkpoint"]
    assert [cp[k] for k in ("physicMsgTimestamp", "logicsMsgTimestamp", "indexMsgTimestamp",
                            "masterFlushedOffset", "confirmPhyOffset")] == \
        [int.from_bytes(raw[i:i + 8], "big", signed=True) for i in range(0, 40, 8)]


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_every_recorded_query_message(name):
    with MessageStore.open(str(golden_store(name)), read_only=True) as store:
        for q in golden_queries(name)["queryMessage"]:
            r = store.query(q["topic"], q["key"], q["maxNum"], q["begin"], q["end"])
            assert r.phy_offsets == q["resultPhyOffsets"], q
            assert [m.commit_log_offset for m in r.messages] == q["resultPhyOffsets"]
            assert r.index_last_update_timestamp == q["resultIndexLastUpdateTimestamp"]
            assert r.index_last_update_phyoffset == q["resultIndexLastUpdatePhyoffset"]
            raw, _, _ = store.index_service.query_offset(q["topic"], q["key"], min(q["maxNum"], 64), q["begin"],
                                                         q["end"])
            assert raw == q["indexServiceQueryOffset_phyOffsets"]
            hits = [f"{m.topic}#{m.keys}#{m.uniq_key}" for m in r.messages]
            assert hits == q["resultHits(topic#keys#uniq)"]


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_every_recorded_offset_by_time(name):
    with MessageStore.open(str(golden_store(name)), read_only=True) as store:
        for q in golden_queries(name)["getOffsetInQueueByTime"]:
            args = (q["topic"], q["queueId"], q["timestamp"])
            assert store.offset_by_time(*args) == q["result"], q
            assert store.offset_by_time(*args, "lower") == q["resultLower"], q
            assert store.offset_by_time(*args, "upper") == q["resultUpper"], q


def test_query_and_offset_by_time_through_the_cli():
    store = golden_store("basic")
    for q in golden_queries("basic")["queryMessage"][:8]:
        r = run_cli("query", store, "--topic", q["topic"], "--key", q["key"], "--max", q["maxNum"],
                    "--begin", q["begin"], "--end", q["end"], "--no-body")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["phyOffsets"] == q["resultPhyOffsets"]
        assert [m["commitLogOffset"] for m in out["messages"]] == q["resultPhyOffsets"]
    for q in golden_queries("basic")["getOffsetInQueueByTime"][:6]:
        r = run_cli("offset-by-time", store, "--topic", q["topic"], "--queue-id", q["queueId"],
                    "--timestamp", q["timestamp"], "--boundary", "upper")
        assert json.loads(r.stdout) == {"offset": q["resultUpper"]}


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_consume_queues_hold_the_recorded_units(name):
    expected = golden_expected(name)
    with MessageStore.open(str(golden_store(name)), read_only=True) as store:
        for e in expected:
            cq = store.find_consume_queue(e["topic"], e["queueId"])
            if e["cqUnit"] is None:
                continue
            assert cq.get_unit(e["queueOffset"]) == (e["cqUnit"]["pos"], e["cqUnit"]["size"],
                                                      e["cqUnit"]["tagsCode"])


def test_get_reads_whole_queues_with_filters_and_statuses():
    expected = golden_expected("basic")
    with MessageStore.open(str(golden_store("basic")), read_only=True) as store:
        for (topic, qid) in store.queue_keys():
            want = [e for e in expected if (e["topic"], e["queueId"]) == (topic, qid)]
            got, off = [], 0
            while True:
                r = store.get(topic, qid, off, 32)
                if r.status is not GetMessageStatus.FOUND:
                    assert r.status is GetMessageStatus.OFFSET_OVERFLOW_ONE
                    break
                got += r.messages
                off = r.next_begin_offset
            assert [m.commit_log_offset for m in got] == [e["commitLogOffset"] for e in want]
            assert [m.body for m in got[:3]] == [__import__("base64").b64decode(e["body"]) for e in want[:3]]
        # tag filter by tagsCode
        r = store.get("TopicA", 0, 0, 32, parse_tag_filter("TagA || TagB"))
        assert r.status is GetMessageStatus.FOUND and {m.tags for m in r.messages} <= {"TagA", "TagB"}
        want = [e for e in expected if (e["topic"], e["queueId"]) == ("TopicA", 0)
                and e["queueOffset"] < r.next_begin_offset and e["tags"] in ("TagA", "TagB")]
        assert [m.commit_log_offset for m in r.messages] == [e["commitLogOffset"] for e in want]
        assert store.get("TopicA", 0, 380, 32).status is GetMessageStatus.OFFSET_OVERFLOW_ONE
        r = store.get("TopicA", 0, 500, 32)
        assert (r.status, r.next_begin_offset) == (GetMessageStatus.OFFSET_OVERFLOW_BADLY, 380)
        r = store.get("NoSuchTopic", 0, 0, 32)
        assert (r.status, r.next_begin_offset) == (GetMessageStatus.NO_MESSAGE_IN_QUEUE, 0)


def test_get_cli_with_tags():
    r = run_cli("get", golden_store("basic"), "--topic", "TopicC", "--queue-id", 0, "--offset", 600, "--tags",
                "TagA||TagB||TagC||TagD||TagE", "--no-body")
    out = json.loads(r.stdout)
    assert out["status"] == "FOUND" and out["maxOffset"] == 604 and out["nextBeginOffset"] == 604
    assert all(m["tags"] for m in out["messages"])


def test_txn_store_prepared_and_rollback_have_no_queue_entry():
    r = run_cli("dump", golden_store("txn"), "--no-body")
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    assert len(rows) == 24 and {x["sysFlag"] for x in rows} == {0, 4, 8, 12}
    with MessageStore.open(str(golden_store("txn")), read_only=True) as store:
        assert store.max_offset_in_queue("TopicTxn", 0) == 12


def _tree_digest(root: Path) -> dict[str, tuple[str, float]]:
    out = {}
    for d, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = (hashlib.sha1(open(p, "rb").read()).hexdigest(), os.path.getmtime(p))
    return out


def test_read_tools_never_write(tmp_path):
    store = copy_store(golden_store("basic"), tmp_path / "s")
    before = _tree_digest(store)
    for args in (["dump", "--no-body"], ["state"], ["verify"], ["get", "--topic", "TopicA", "--queue-id", "0",
                 "--offset", "0"], ["query", "--topic", "TopicA", "--key", "hot-key"], ["retention"]):
        r = run_cli(args[0], store, *args[1:])
        assert r.returncode == 0, r.stderr
    assert _tree_digest(store) == before
    assert not (store / "abort").exists()


def test_geometry_is_inferred_and_can_be_overridden(tmp_path):
    with MessageStore.open(str(golden_store("basic")), read_only=True) as s:
        assert (s.config.mappedFileSizeCommitLog, s.config.mappedFileSizeConsumeQueue, s.config.maxHashSlotNum,
                s.config.maxIndexNum) == (1048576, 6000, 1000, 4000)
    conf = tmp_path / "bad.conf"
    conf.write_text("mappedFileSizeCommitLog=2097152\n")
    r = run_cli("state", golden_store("basic"), "--config", conf)
    assert r.returncode == 2
    assert b"00000000000000000000: file is 1048576 bytes, expected 2097152" in r.stderr


def _reference_get(store, topic, queue_id, offset, max_msgs=32, tag_filter=None, max_total_bytes=128 * 1024 * 1024,
                   read_body=True):
    """getMessage written plainly, one unit and one ``codec.decode`` at a time: the specification that the
    block-reading ``MessageStore.get`` must match result for result."""
    from rocketstore.format.message import GetMessageResult
    S = GetMessageStatus
    cq = store._cq_table.get((topic, queue_id))
    if cq is None:
        return GetMessageResult(S.NO_MESSAGE_IN_QUEUE, 0, 0, 0)
    lo, hi = cq.min_offset_in_queue, cq.max_offset_in_queue
    if hi == 0:
        return GetMessageResult(S.NO_MESSAGE_IN_QUEUE, 0, lo, hi)
    if offset < lo:
        return GetMessageResult(S.OFFSET_TOO_SMALL, lo, lo, hi)
    if offset == hi:
        return GetMessageResult(S.OFFSET_OVERFLOW_ONE, offset, lo, hi)
    if offset > hi:
        return GetMessageResult(S.OFFSET_OVERFLOW_BADLY, hi, lo, hi)
    f = cq.hold_file_at(offset)
    per_file = cq.file_size // 20
    if f is None:
        return GetMessageResult(S.OFFSET_FOUND_NULL, offset + per_file - offset % per_file, lo, hi)
    try:
        return _reference_get_units(store, cq, f, offset, lo, hi, max_msgs, tag_filter, max_total_bytes, read_body)
    finally:
        f.release()


def _reference_get_units(store, cq, f, offset, lo, hi, max_msgs, tag_filter, max_total_bytes, read_body):
    import struct

    from rocketstore.format import codec
    from rocketstore.format.message import GetMessageResult
    from rocketstore.storage.read_units import signed32 as _signed32
    S = GetMessageStatus
    base = f.file_from_offset
    units = ((p // 20,) + struct.unpack_from(">qiq", f.mm, p - base)
             for p in range(offset * 20, base + f.wrote_position - 19, 20))
    cfg, clog = store.config, store.commitlog
    status, nxt, out, total = S.NO_MATCHED_MESSAGE, offset, [], 0
    max_pull = min(max(max_total_bytes, 100), 128 * 1024 * 1024)
    count_cap, byte_cap = max_msgs, max_pull
    stop = min(hi, offset + -(-max(cfg.maxFilterMessageSize, max_msgs * 20) // 20))
    skip_end = -1
    for idx, phy, size, tags in units:
        if idx >= stop or (out and (len(out) >= count_cap or total + size > byte_cap)):
            break
        nxt = idx + 1
        if tag_filter is not None and _signed32(tags) not in tag_filter:
            if not out:
                status = S.NO_MATCHED_MESSAGE
            continue
        if phy < skip_end:
            continue
        seg = clog.queue.find(phy)
        if seg is None or phy - seg.file_from_offset + size > seg.wrote_position:
            if not out:
                status = S.MESSAGE_WAS_REMOVING
            skip_end = phy - phy % clog.file_size + clog.file_size
            continue
        try:
            msg = codec.decode(seg.mm, phy - seg.file_from_offset, phy - seg.file_from_offset + size,
                               read_body=read_body, check_crc=read_body)
            if (msg.size, msg.topic, msg.queue_id, msg.queue_offset) != (size, cq.topic, cq.queue_id, idx):
                msg = None
        except codec.RecordError:
            msg = None
        if msg is None:  # damaged, or not the unit's record: never returned, never stepped over
            if not out:
                raise CorruptRecordError(f"commitlog offset {phy}")
            nxt = idx
            break
        if not out:
            in_mem = clog.max_offset() - phy <= store.reader._ram * cfg.accessMessageInMemoryMaxRatio // 100
            count_cap = min(max_msgs, cfg.maxTransferCountOnMessageInMemory if in_mem
                            else cfg.maxTransferCountOnMessageInDisk)
            byte_cap = min(max_pull, cfg.maxTransferBytesOnMessageInMemory if in_mem
                           else cfg.maxTransferBytesOnMessageInDisk)
        out.append(msg)
        total += size
        status = S.FOUND
    return GetMessageResult(status, nxt, lo, hi, out)


def _result_or_error(fn, *args):
    """What a get returns, or the commitlog offset of the damaged record it refuses."""
    try:
        return fn(*args)
    except CorruptRecordError as e:
        return ("damaged", int(str(e).split("offset ")[1].split()[0]))


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_get_equals_the_unit_by_unit_reference(name, tmp_path):
    """Block reads, the inline decoder and the early stop change no result: every status, next offset, cap
    (in memory and on disk), tag filter and damaged record gives what the plain loop gives."""
    from rocketstore.format import codec
    path = copy_store(golden_store(name), tmp_path / "s")
    with MessageStore.open(str(path), start_services=False) as store:
        # damage a few records so that decode fails in the middle of queues (MESSAGE_WAS_REMOVING, skips)
        seg = store.commitlog.queue.files[0]
        pos = [p for p, size, m, _ in codec.walk(seg.mm, 0, seg.wrote_position, check_crc=False, parsed=True)
               if m is not None]
        for p in pos[len(pos) // 3::max(1, len(pos) // 7)][:5]:
            seg.mm[p + 4:p + 8] = b"\0\0\0\0"
        codes = sorted({codec.tags_code(e["tags"]) for e in golden_expected(name) if e["tags"]})
        filters = [None, set(codes[:1]), set(codes[1:3]), {12345}]
        checked = 0
        for ratio in (store.config.accessMessageInMemoryMaxRatio, 0):  # in-memory caps, then on-disk caps
            store.config.accessMessageInMemoryMaxRatio = ratio
            for topic, qid in store.queue_keys() + [("NoSuchTopic", 0)]:
                cq = store.find_consume_queue(topic, qid)
                hi = cq.max_offset_in_queue if cq else 0
                offsets = sorted({*range(-1, hi + 3, 1 if hi < 100 else 7), 298, 299, 300, 301, 599, 600})
                for off in offsets:
                    for max_msgs, flt, max_bytes, body in ((32, None, 128 << 20, True), (1, None, 128 << 20, False),
                                                           (5, filters[1], 128 << 20, True),
                                                           (200, filters[2], 128 << 20, False),
                                                           (100, filters[3], 128 << 20, False),
                                                           (70, None, 3000, True), (0, None, 50, True)):
                        args = (topic, qid, off, max_msgs, flt, max_bytes, body)
                        assert _result_or_error(store.get, *args) == \
                            _result_or_error(_reference_get, store, *args), args
                        checked += 1
        assert checked > 100
