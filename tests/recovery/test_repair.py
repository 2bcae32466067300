"""verify --repair (issue 16, item 2): every CRC-valid record survives, damaged spans are reported, --dry-run writes nothing."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from conftest import GOLDEN_NAMES, copy_store, golden_expected, golden_store, run_cli
from rocketstore.format import codec
from rocketstore.format.message import parse_tag_filter
from rocketstore.recovery.damage import FILLER_TOPIC, LOST_PROPERTY, LOST_TAG, MAX_FILLER_BYTES, filler_pieces, filler_record
from rocketstore.store import MessageStore

SEG = 1048576


def flip_body_bit(store: Path, e: dict) -> None:
    seg = e["commitLogOffset"] // SEG * SEG
    with open(store / "commitlog" / f"{seg:020d}", "r+b") as fh:
        fh.seek(e["commitLogOffset"] - seg + 88 + e["bodyLength"] // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 1]))


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def walk_like_rocketmq(store: Path) -> list[int]:
    """checkMessageAndReturnSize over every segment with CRC on: offsets of the records a RocketMQ walker keeps
    (it stops for good at the first record that fails; a blank record sends it to the next file)."""
    kept = []
    for seg in sorted((store / "commitlog").iterdir()):
        buf = seg.read_bytes()
        base = int(seg.name)
        for pos, size, msg, _reason in codec.walk(buf, 0, len(buf), check_crc=True):
            if size == 0:
                break
            if msg is None:
                return kept
            kept.append(base + pos)
    return kept


def golden_offsets(name: str = "basic") -> list[int]:
    return sorted(e["commitLogOffset"] for e in golden_expected(name))


def assert_intact_except(store: Path, start: int, end: int) -> None:
    """Every commitlog byte outside [start, end) equals the golden one."""
    for seg in sorted((golden_store("basic") / "commitlog").iterdir()):
        base = int(seg.name)
        old, new = seg.read_bytes(), (store / "commitlog" / seg.name).read_bytes()
        lo, hi = max(0, start - base), max(0, min(len(old), end - base))
        assert old[:lo] == new[:lo] and old[max(lo, hi):] == new[max(lo, hi):], seg.name


def test_a_flipped_body_bit_loses_only_its_record(basic_copy):
    """The issue's case: one flipped bit in segment 2 made repair delete 3 segments and print OK."""
    expected = golden_expected("basic")
    bad = expected[1500]
    flip_body_bit(basic_copy, bad)
    damaged = (basic_copy / "commitlog" / f"{SEG:020d}").read_bytes()
    r = run_cli("verify", basic_copy, "--repair", "--json")
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert not out["ok"]
    assert len(out["lost"]) == 1
    lost = out["lost"][0]
    assert (lost["offset"], lost["length"], lost["action"]) == (bad["commitLogOffset"], bad["size"], "filler")
    assert "CRC" in lost["reason"] and lost["file"].endswith(f"{SEG:020d}")
    assert lost["messages"] == [{"topic": bad["topic"], "queueId": bad["queueId"], "queueOffset": bad["queueOffset"],
                                 "commitLogOffset": bad["commitLogOffset"], "size": bad["size"], "tombstone": True}]
    assert lost["rewrite"] == [{"offset": bad["commitLogOffset"], "length": bad["size"], "as": "tombstone"}]
    # Nothing else changed in the commitlog, and the damaged original is kept.
    assert_intact_except(basic_copy, bad["commitLogOffset"], bad["commitLogOffset"] + bad["size"])
    q = Path(out["quarantine"])
    assert (q / "commitlog" / f"{SEG:020d}").read_bytes() == damaged
    assert json.loads((q / "report.json").read_text())["lost"][0]["offset"] == bad["commitLogOffset"]
    # A RocketMQ-style walker keeps every other record (and the tombstone).
    walked = walk_like_rocketmq(basic_copy)
    assert sorted(set(walked) - {bad["commitLogOffset"]}) == sorted(set(golden_offsets()) - {bad["commitLogOffset"]})
    # So does rocketstore's abnormal recovery from the first segment, and every other message is readable.
    (basic_copy / "abort").write_text("1")
    (basic_copy / "checkpoint").write_bytes(bytes(4096))
    with MessageStore.open(str(basic_copy)) as store:
        assert store.max_phy_offset() == 3711299
        got, tombstones = {}, []
        for topic, qid in store.queue_keys():
            off = 0
            while (res := store.get(topic, qid, off, 32, read_body=False)).messages:
                for i, m in enumerate(res.messages):
                    assert m.queue_offset == off + i  # no queue offset moved
                    if LOST_PROPERTY in m.properties:
                        tombstones.append(m)
                    else:
                        got[m.commit_log_offset] = (m.topic, m.queue_id, m.body_crc)
                off = res.next_begin_offset
        assert got == {e["commitLogOffset"]: (e["topic"], e["queueId"], e["bodyCrc"]) for e in expected if e is not bad}
        [t] = tombstones
        assert (t.topic, t.queue_id, t.queue_offset, t.commit_log_offset, t.size, t.tags) == (
            bad["topic"], bad["queueId"], bad["queueOffset"], bad["commitLogOffset"], bad["size"], LOST_TAG)
        assert t.properties[LOST_PROPERTY] == q.name
        # a tag subscription never sees it
        res = store.get(bad["topic"], bad["queueId"], bad["queueOffset"], 1, parse_tag_filter(bad["tags"]))
        assert [m.commit_log_offset for m in res.messages] != [bad["commitLogOffset"]]
        other = expected[1501]
        assert store.query(other["topic"], other["keys"].split()[0]).phy_offsets == [other["commitLogOffset"]]
        assert store.query(bad["topic"], bad["properties"]["UNIQ_KEY"]).messages == []
    # Every consume-queue file keeps the configured size.
    assert {f.stat().st_size for f in (basic_copy / "consumequeue").rglob("0*") if f.is_file()} == {6000}
    # verify lists the kept originals (not a problem: issue 24 item 15); the queues are consistent.
    r = run_cli("verify", basic_copy, "--json")
    v = json.loads(r.stdout)
    assert r.returncode == 0 and v["problems"] == [], v["problems"]
    assert [(k["kind"], k["file"]) for k in v["kept"]] == [("kept", str(q))] and "1 damaged span" in v["kept"][0]["detail"]


def test_dry_run_reports_and_writes_nothing(basic_copy):
    bad = golden_expected("basic")[1500]
    flip_body_bit(basic_copy, bad)
    before = tree_digest(basic_copy)
    r = run_cli("verify", basic_copy, "--repair", "--dry-run", "--json")
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["dryRun"] and not out["ok"]
    assert [(s["offset"], s["action"]) for s in out["lost"]] == [(bad["commitLogOffset"], "filler")]
    assert tree_digest(basic_copy) == before
    table = run_cli("verify", basic_copy, "--repair", "--dry-run")
    assert table.returncode == 1 and b"would repair" in table.stdout and b"not kept" in table.stdout
    assert tree_digest(basic_copy) == before


def test_dry_run_needs_repair(basic_copy):
    r = run_cli("verify", basic_copy, "--dry-run")
    assert r.returncode == 2 and r.stderr.decode().count("\n") == 1 and b"--repair" in r.stderr


def test_garbage_over_a_record_header_resynchronises_on_the_next_record(basic_copy):
    """The size field itself is gone: repair finds the next record by magic, PHYSICALOFFSET and CRC."""
    first = next(e for e in golden_expected("basic") if e["commitLogOffset"] == SEG)
    nxt = min(e["commitLogOffset"] for e in golden_expected("basic") if e["commitLogOffset"] > SEG)
    with open(basic_copy / "commitlog" / f"{SEG:020d}", "r+b") as fh:
        fh.write(bytes(range(7, 71)))  # 64 bytes over TOTALSIZE, magic, CRC, ... PHYSICALOFFSET
    out = json.loads(run_cli("verify", basic_copy, "--repair", "--json").stdout)
    assert [(s["offset"], s["length"]) for s in out["lost"]] == [(SEG, first["size"])] == [(SEG, nxt - SEG)]
    assert sorted(set(walk_like_rocketmq(basic_copy)) - {SEG}) == sorted(set(golden_offsets()) - {SEG})
    assert_intact_except(basic_copy, SEG, nxt)


def test_damaged_last_record_of_a_segment_becomes_a_tombstone_and_a_blank(basic_copy):
    """Nothing valid follows it in its file: after its tombstone a blank record sends both walkers on."""
    last = max((e for e in golden_expected("basic") if e["commitLogOffset"] < SEG), key=lambda e: e["commitLogOffset"])
    flip_body_bit(basic_copy, last)
    out = json.loads(run_cli("verify", basic_copy, "--repair", "--json").stdout)
    off, end = last["commitLogOffset"], last["commitLogOffset"] + last["size"]
    assert [(s["offset"], s["action"], s["length"]) for s in out["lost"]] == [(off, "blank", SEG - off)]
    assert out["lost"][0]["rewrite"] == [{"offset": off, "length": last["size"], "as": "tombstone"},
                                         {"offset": end, "length": SEG - end, "as": "blank"}]
    seg0 = (basic_copy / "commitlog" / f"{0:020d}").read_bytes()
    assert seg0[end:end + 8] == codec.blank_record(SEG - end)
    assert sorted(walk_like_rocketmq(basic_copy)) == golden_offsets()  # the tombstone stands where it was
    v = json.loads(run_cli("verify", basic_copy, "--json").stdout)
    assert v["problems"] == [] and [k["kind"] for k in v["kept"]] == ["kept"]


def test_a_span_without_consume_queue_knowledge_becomes_a_blank(basic_copy):
    """With the consume queues gone, nothing says which message was lost: a blank.  The rebuilt queue places
    every other record at its own queue offset and leaves the lost one a gap (it used to shift them down)."""
    import shutil
    last = max((e for e in golden_expected("basic") if e["commitLogOffset"] < SEG), key=lambda e: e["commitLogOffset"])
    flip_body_bit(basic_copy, last)
    shutil.rmtree(basic_copy / "consumequeue")
    out = json.loads(run_cli("verify", basic_copy, "--repair", "--json").stdout)
    off = last["commitLogOffset"]
    assert out["lost"][0]["messages"] == []
    assert out["lost"][0]["rewrite"] == [{"offset": off, "length": SEG - off, "as": "blank"}]
    seg0 = (basic_copy / "commitlog" / f"{0:020d}").read_bytes()
    assert seg0[off:off + 8] == codec.blank_record(SEG - off)
    assert sorted(walk_like_rocketmq(basic_copy)) == sorted(set(golden_offsets()) - {off})
    assert out["gaps"] == [{"topic": last["topic"], "queueId": last["queueId"], "from": last["queueOffset"],
                            "to": last["queueOffset"]}]
    assert [p["kind"] for p in out["problems"]] == ["cq-hole"], out["problems"]
    assert not [p for p in out["problems"] if p["kind"] in ("cq-gap", "cq-missing")]
    queue = sorted((e for e in golden_expected("basic") if (e["topic"], e["queueId"]) == (last["topic"], last["queueId"])
                    and e["commitLogOffset"] != last["commitLogOffset"]), key=lambda e: e["queueOffset"])
    with MessageStore.open(str(basic_copy), read_only=True) as store:
        for e in queue:
            if e["queueOffset"] > last["queueOffset"] - 3:
                [m] = store.get(e["topic"], e["queueId"], e["queueOffset"], 1).messages
                assert (m.queue_offset, m.commit_log_offset) == (e["queueOffset"], e["commitLogOffset"])


def test_a_truncated_consume_queue_file_keeps_every_queue_file_size(basic_copy):
    """The first CQ file found was 1000 bytes long: that must not become every queue's file size."""
    os.truncate(basic_copy / "consumequeue" / "TopicA" / "0" / f"{0:020d}", 1000)
    before = tree_digest(basic_copy)
    dry = run_cli("verify", basic_copy, "--repair", "--dry-run")
    assert dry.returncode == 1 and b"1000 bytes" in dry.stdout and tree_digest(basic_copy) == before
    r = run_cli("verify", basic_copy, "--repair", "--json")
    assert r.returncode == 0, r.stdout[-2000:]
    out = json.loads(r.stdout)
    assert out["ok"] and out["lost"] == []
    golden = golden_store("basic") / "consumequeue"
    for f in (f for f in golden.rglob("0*") if f.is_file()):
        assert (basic_copy / "consumequeue" / f.relative_to(golden)).read_bytes() == f.read_bytes(), f
    assert run_cli("verify", basic_copy).returncode == 0


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_repair_of_an_intact_golden_store_changes_nothing(tmp_path, name):
    store = copy_store(golden_store(name), tmp_path / "s")
    r = run_cli("verify", store, "--repair", "--json")
    assert r.returncode == 0, r.stdout[-2000:]
    out = json.loads(r.stdout)
    assert out["ok"] and out["lost"] == [] and not (store / "quarantine").exists()
    for d in ("commitlog", "consumequeue"):
        assert tree_digest(store / d) == tree_digest(golden_store(name) / d)


@pytest.mark.parametrize("size", [92, 116, 117, 5000, MAX_FILLER_BYTES])
def test_filler_record_is_a_valid_rollback_record_of_exactly_the_span(size):
    rec = filler_record(size, 4242, 1795375975099)
    n, msg, reason = codec.check(rec, 0, len(rec), check_crc=True)
    assert (n, reason) == (size, None)
    assert msg.transaction_type == codec.TRANSACTION_ROLLBACK and msg.commit_log_offset == 4242
    assert msg.store_timestamp == 1795375975099 and msg.topic == FILLER_TOPIC[:len(msg.topic)]


def test_filler_pieces_cover_any_span():
    assert filler_pieces(91) == []
    for length in (92, 3 * MAX_FILLER_BYTES + 1, 2 * MAX_FILLER_BYTES):
        pieces = filler_pieces(length)
        assert sum(pieces) == length and max(pieces) <= MAX_FILLER_BYTES and min(pieces) >= 92


def test_a_torn_last_message_is_reported_and_the_log_ends_before_it(basic_copy):
    from test_recovery import tear_last_message
    last = tear_last_message(basic_copy)
    r = run_cli("verify", basic_copy, "--repair", "--json")
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert [(s["offset"], s["action"]) for s in out["lost"]] == [(last["commitLogOffset"], "end-of-log")]
    assert out["lost"][0]["messages"][0]["queueOffset"] == last["queueOffset"]
    assert not (basic_copy / "abort").exists() and (Path(out["quarantine"]) / "abort").exists()
    with MessageStore.open(str(basic_copy), read_only=True) as store:
        assert store.max_phy_offset() == last["commitLogOffset"]
        assert store.max_offset_in_queue(last["topic"], last["queueId"]) == last["queueOffset"]
    assert sorted(walk_like_rocketmq(basic_copy)) == sorted(set(golden_offsets()) - {last["commitLogOffset"]})


def test_repair_refuses_a_store_another_process_has_open(basic_copy):
    bad = golden_expected("basic")[1500]
    flip_body_bit(basic_copy, bad)
    before = tree_digest(basic_copy)
    import fcntl
    fd = os.open(basic_copy / "lock", os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)  # as a running broker holds it
        r = run_cli("verify", basic_copy, "--repair")
    finally:
        os.close(fd)
    assert r.returncode == 2 and r.stderr.decode().count("\n") == 1 and b"locked" in r.stderr
    assert tree_digest(basic_copy) == before


@pytest.mark.parametrize("topic", ["TopicB", "T" * 200])
def test_tombstone_is_a_valid_record_of_the_lost_message_queue_offset(topic):
    from rocketstore.recovery.damage import tombstone_record
    lost = {"topic": topic, "queueId": 3, "queueOffset": 224, "commitLogOffset": 4242, "size": 700}
    rec = tombstone_record(700, lost, 4242, 1795375975099, "repair-1795611563933")
    n, msg, reason = codec.check(rec, 0, len(rec), check_crc=True)
    assert (n, reason) == (700, None)
    assert (msg.topic, msg.queue_id, msg.queue_offset, msg.commit_log_offset) == (topic, 3, 224, 4242)
    assert msg.transaction_type == codec.TRANSACTION_NOT_TYPE and msg.tags == LOST_TAG
    assert msg.properties[LOST_PROPERTY] == "repair-1795611563933" and not msg.keys and not msg.uniq_key
    assert tombstone_record(100, lost, 4242, 0, "x") is None  # too small for its header


def test_a_long_damaged_span_gets_tombstones_of_the_lost_sizes_and_fillers_between():
    """Zeros over three records: one tombstone per record the old queues knew, each its record's size."""
    from rocketstore.recovery.damage import DamagedSpan, layout
    lost = [{"topic": "T", "queueId": 0, "queueOffset": q, "commitLogOffset": 1000 + 700 * q, "size": 500}
            for q in range(3)]
    span = DamagedSpan("seg", 900, 3000, "zero bytes", "filler", True, 1, lost)
    assert [(o, n, kind) for o, n, kind, _m in layout(span, set())] == [
        (900, 100, "filler"), (1000, 500, "tombstone"), (1500, 200, "filler"), (1700, 500, "tombstone"),
        (2200, 200, "filler"), (2400, 500, "tombstone"), (2900, 1000, "filler")]
    held = {("T", 0, 1)}  # a surviving record holds queue offset 1: no tombstone for it
    assert [kind for _o, _n, kind, _m in layout(span, held)] == ["filler", "tombstone", "filler", "tombstone",
                                                                 "filler"]
    span.action = "blank"  # nothing valid after it in its file: a blank after the last tombstone
    assert [(o, n, kind) for o, n, kind, _m in layout(span, set())][-2:] == [(2400, 500, "tombstone"),
                                                                            (2900, 1000, "blank")]


def _flip_header(store: Path, e: dict, at: int, mask: int) -> None:
    """XOR one byte of the record ``e`` at record position ``at`` (no CRC covers the header)."""
    seg = e["commitLogOffset"] // SEG * SEG
    with open(store / "commitlog" / f"{seg:020d}", "r+b") as fh:
        fh.seek(e["commitLogOffset"] - seg + at)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ mask]))


@pytest.mark.parametrize("field,at,mask", [
    ("queueId", 15, 0x01),        # queue 3 -> 2: another queue's record at the same offset exists
    ("queueId", 12, 0x02),        # a queue that does not exist (fuzz seed 1600136 flipped this field)
    ("queueOffset", 27, 0x04),    # another offset of the same queue
    ("topic", None, 0x02),        # TopicA -> TopicC: another topic's queue
])
def test_a_flipped_routing_field_is_reported_never_rewritten(basic_copy, field, at, mask):
    """A bit flip in a record's topic, queue id or queue offset (no CRC covers them).  Repair used to write the
    old unit's values into the record; the old unit is a cache (swapped units made it rewrite two intact
    records, issue 24 item 6), so the record stays as it reads and is reported.  Its own queue offset is
    left a gap, never given to another record, and no other message moves."""
    from rocketstore.config import golden_config
    from rocketstore.recovery.repair import repair_store
    e = next(x for x in golden_expected("basic") if x["topic"] == "TopicA" and x["queueId"] == 3
             and x["queueOffset"] == 204)
    if at is None:
        at = e["size"] - len(e["propertiesString"].encode()) - 2 - 1  # the last topic character ("A")
    _flip_header(basic_copy, e, at, mask)
    flipped = tree_digest(basic_copy / "commitlog")
    result = repair_store(str(basic_copy), golden_config())
    assert result["lost"] == []
    [fix] = result["suspect"]
    assert fix["offset"] == e["commitLogOffset"] and list(fix["fields"]) == [field]
    assert fix["fields"][field]["unitSays"] == {"topic": "TopicA", "queueId": 3, "queueOffset": 204}[field]
    assert tree_digest(basic_copy / "commitlog") == flipped  # not one commitlog byte changed
    assert {"topic": "TopicA", "queueId": 3, "from": 204, "to": 204} in result["gaps"]
    with MessageStore.open(str(basic_copy), read_only=True) as store:
        for x in golden_expected("basic"):
            if x["commitLogOffset"] != e["commitLogOffset"] and (x["topic"], x["queueId"]) in (("TopicA", 3), ("TopicA", 2), ("TopicC", 3)):
                [m] = store.get(x["topic"], x["queueId"], x["queueOffset"], 1, read_body=False).messages
                assert (m.commit_log_offset, m.queue_offset) == (x["commitLogOffset"], x["queueOffset"])


def test_a_routing_field_two_units_claim_is_left_as_it_reads(basic_copy):
    """When another unit points at the record too, repair cannot tell which is right: it restores nothing."""
    from rocketstore.config import golden_config
    from rocketstore.recovery.damage import header_fixes
    e = next(x for x in golden_expected("basic") if x["topic"] == "TopicA" and x["queueId"] == 3
             and x["queueOffset"] == 204)
    _flip_header(basic_copy, e, 15, 0x01)  # now it reads TopicA-2
    cq = basic_copy / "consumequeue"
    assert len(header_fixes(str(cq), str(basic_copy / "commitlog"), SEG, [])) == 1
    other = cq / "TopicA" / "2" / "00000000000000000000"
    data = bytearray(other.read_bytes())
    data[204 * 20:205 * 20] = (cq / "TopicA" / "3" / "00000000000000000000").read_bytes()[204 * 20:205 * 20]
    other.write_bytes(bytes(data))
    assert header_fixes(str(cq), str(basic_copy / "commitlog"), SEG, []) == []
    assert golden_config().mappedFileSizeCommitLog == SEG


def test_units_shifted_by_a_gap_are_not_taken_for_flipped_queue_offsets(basic_copy):
    """Fuzz seed 1801196: dispatch writes the records after a gap at the lost units, so each of those units
    points at a record of a later queue offset, with its size and tagsCode.  Repair took them for records
    whose QUEUEOFFSET a bit flip had changed and wrote the unit's offsets into 62 intact records.  A
    restore needs sound units on both sides; here no commitlog byte may change."""
    from rocketstore.config import golden_config
    from rocketstore.recovery.repair import repair_store
    cq = basic_copy / "consumequeue" / "TopicA" / "0" / "00000000000000000000"
    data = cq.read_bytes()
    cq.write_bytes(data[:100 * 20] + data[103 * 20:] + bytes(3 * 20))  # units 100..102 lost, the rest moved down
    result = repair_store(str(basic_copy), golden_config())
    assert result["lost"] == [] and result["gaps"] == [] and result["unplaced"] == []
    assert tree_digest(basic_copy / "commitlog") == tree_digest(golden_store("basic") / "commitlog")
    queue = sorted((e for e in golden_expected("basic") if (e["topic"], e["queueId"]) == ("TopicA", 0)),
                   key=lambda e: e["queueOffset"])
    with MessageStore.open(str(basic_copy), read_only=True) as store:
        got, off = [], 0
        while (r := store.get("TopicA", 0, off, 32, read_body=False)).messages:
            got += [(m.queue_offset, m.commit_log_offset) for m in r.messages]
            off = r.next_begin_offset
    assert got == [(e["queueOffset"], e["commitLogOffset"]) for e in queue]


def test_a_record_whose_queue_id_and_offset_flipped_is_neither_dispatched_nor_queried_as_it_reads(basic_copy):
    """Fuzz seed 1900113 (ipv6 store, bits of QUEUEID and QUEUEOFFSET of a queue's first record flipped):
    recovery dispatched the record into a new queue TopicV6-8 at offset 2310348807864320000, query handed it
    out with those fields, and repair could not restore it (no unit before a queue's first).  Another queue's
    unit pointing at the record proves the header changed: recovery does not dispatch it, query raises
    CorruptRecordError naming it, and repair restores it from that unit."""
    from rocketstore.config import golden_config
    from rocketstore.errors import CorruptRecordError
    from rocketstore.recovery.repair import repair_store
    e = next(x for x in golden_expected("basic") if x["commitLogOffset"] == 0)  # TopicA-1 offset 0
    _flip_header(basic_copy, e, 15, 0x08)  # queue 1 -> 9 (no such queue)
    _flip_header(basic_copy, e, 22, 0x20)  # queue offset 0 -> 2**45
    uniq = e["properties"]["UNIQ_KEY"]
    with MessageStore.open(str(basic_copy), golden_config(), start_services=False) as store:
        assert ("TopicA", 9) not in store.queue_keys()
        with pytest.raises(CorruptRecordError, match=r"at offset 0 .*says TopicA/9 offset 35184372088832, but "
                                                     r"consume queue TopicA/1 offset 0 points at it"):
            store.query("TopicA", uniq)
    result = repair_store(str(basic_copy), golden_config())
    assert [f["fields"] for f in result["suspect"]] == [
        {"queueId": {"read": 9, "unitSays": 1}, "queueOffset": {"read": 1 << 45, "unitSays": 0}}]
    # Kept as it reads, and not placed at queue offset 2**45 (no queue of blank units up to there): a gap at 0.
    assert [(u["topic"], u["queueId"], u["commitLogOffset"]) for u in result["unplaced"]] == [("TopicA", 9, 0)]
    with MessageStore.open(str(basic_copy), read_only=True) as store:
        assert sorted(store.queue_keys()) == sorted({(x["topic"], x["queueId"]) for x in golden_expected("basic")})
        [m] = store.query("TopicA", uniq).messages  # still found by its key, body intact, fields as they read
        assert (m.commit_log_offset, m.body_crc, m.queue_id) == (0, e["bodyCrc"], 9)


def test_recovery_does_not_open_a_queue_for_a_record_another_queue_s_unit_points_at(tmp_path):
    """The ipv6 store is one segment, so its clean recovery offers every record: the record of fuzz seed
    1900113 was dispatched into a queue of its own (TopicV6-8, at a queue offset above 2**60)."""
    from rocketstore.config import golden_config
    store_dir = copy_store(golden_store("ipv6"), tmp_path / "s")
    e = next(x for x in golden_expected("ipv6") if x["commitLogOffset"] == 0)
    assert e["queueOffset"] == 0
    with open(store_dir / "commitlog" / f"{0:020d}", "r+b") as fh:
        for at, mask in ((15, 0x08), (22, 0x20)):
            fh.seek(at)
            b = fh.read(1)
            fh.seek(at)
            fh.write(bytes([b[0] ^ mask]))
    with MessageStore.open(str(store_dir), golden_config(), start_services=False) as store:
        assert sorted(store.queue_keys()) == sorted({(x["topic"], x["queueId"]) for x in golden_expected("ipv6")})


def test_query_refuses_a_record_whose_queue_offset_flipped_within_its_own_queue(basic_copy):
    """Fuzz seed 2200162 (txn store, a bit of QUEUEOFFSET's high byte flipped: 0 -> 2**57): the unit pointing
    at the record is its own queue's, at another offset; query handed the record out with the flipped
    offset."""
    from rocketstore.config import golden_config
    from rocketstore.errors import CorruptRecordError
    from rocketstore.recovery.repair import repair_store
    e = next(x for x in golden_expected("basic") if x["commitLogOffset"] == 0)  # TopicA-1 offset 0
    _flip_header(basic_copy, e, 20, 0x02)
    with MessageStore.open(str(basic_copy), read_only=True) as store:
        with pytest.raises(CorruptRecordError, match="consume queue TopicA/1 offset 0 points at it"):
            store.query("TopicA", e["properties"]["UNIQ_KEY"])
    result = repair_store(str(basic_copy), golden_config())
    assert [f["fields"] for f in result["suspect"]] == [{"queueOffset": {"read": 1 << 57, "unitSays": 0}}]
    assert [u["queueOffset"] for u in result["unplaced"]] == [1 << 57]  # kept as it reads, placed nowhere
    assert tree_digest(basic_copy / "commitlog") != tree_digest(golden_store("basic") / "commitlog")
