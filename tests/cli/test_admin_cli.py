"""Issue 17 (9): operator verbs (topics, groups, lag, reset-offset, msg), dump --follow, time flags in
ISO-8601 and relative form, text bodies, --format table|json|csv; each through the real CLI."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from rocketstore import Message, MessageStore
from rocketstore.format.codec import decode_offset_msg_id
from rocketstore.config import golden_config
from rocketstore.cli.timeparse import parse_time_ms
from conftest import GOLDEN_CONF, golden_expected, golden_queries, golden_store, run_cli


def _ok(*args: object) -> str:
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr.decode()
    return r.stdout.decode()


def _refused(*args: object, match: str) -> str:
    r = run_cli(*args)
    err = r.stderr.decode()
    assert r.returncode == 2 and r.stdout == b"", (r.returncode, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err and match in err, err
    return err


def _write_offsets(root: Path, text: str) -> None:
    (root / "config").mkdir(exist_ok=True)
    (root / "config" / "consumerOffset.json").write_text(text)


def _offsets(root: Path) -> dict:
    return json.loads((root / "config" / "consumerOffset.json").read_text())["offsetTable"]


QUEUES = {(q["topic"], q["queueId"]): q for q in golden_queries("basic")["storeState"]["queues"]}


# ---------------------------------------------------------------- time flags

def test_parse_time_forms():
    now = 1_800_000_000_000
    assert parse_time_ms("1700000000000", now) == 1700000000000
    assert parse_time_ms("now", now) == now
    assert parse_time_ms("-1h", now) == now - 3_600_000
    assert parse_time_ms("-30m", now) == now - 1_800_000
    assert parse_time_ms("-2d", now) == now - 2 * 86_400_000
    assert parse_time_ms("-500ms", now) == now - 500
    assert parse_time_ms("2026-11-22T19:32:56Z", now) == 1795375976000
    assert parse_time_ms("2026-11-22T20:32:56.5+01:00", now) == 1795375976500
    with pytest.raises(ValueError, match="ISO-8601"):
        parse_time_ms("yesterday", now)


def test_dump_from_time_iso_and_relative_equal_epoch_ms(tmp_path):
    store = golden_store("basic")
    ts = sorted(e["storeTimestamp"] for e in golden_expected("basic"))[1500]
    iso = datetime.fromtimestamp(ts / 1000, timezone.utc).isoformat(timespec="milliseconds")
    by_ms = _ok("dump", store, "--no-body", "--from-time", ts)
    assert by_ms and _ok("dump", store, "--no-body", "--from-time", iso) == by_ms
    days = (int(time.time() * 1000) - ts) // 86_400_000 + 1  # more days ago than the message's age
    assert _ok("dump", store, "--no-body", "--from-time", f"-{days}d", "--to-time", f"-{days - 1}d") == \
        _ok("dump", store, "--no-body")
    assert _ok("dump", store, "--from-time", "-1h") == ""  # the golden store was written days ago
    _refused("dump", store, "--from-time", "yesterday", match="--from-time")


# ---------------------------------------------------------------- topics, groups, lag

def test_topics_lists_queue_and_message_counts_including_configured_topics(basic_copy):
    (basic_copy / "config").mkdir()
    (basic_copy / "config" / "topics.json").write_text(json.dumps({"topicConfigTable": {
        "Empty": {"topicName": "Empty", "readQueueNums": 4, "writeQueueNums": 4},
        "TopicA": {"topicName": "TopicA", "readQueueNums": 4, "writeQueueNums": 4}}}))
    rows = {r["topic"]: r for r in json.loads(_ok("topics", basic_copy, "--format", "json"))["topics"]}
    assert sorted(rows) == ["Empty", "TopicA", "TopicB", "TopicC"]
    for topic in ("TopicA", "TopicB", "TopicC"):
        qs = [q for (t, _), q in QUEUES.items() if t == topic]
        assert rows[topic]["queues"] == len(qs)
        assert rows[topic]["messages"] == sum(q["messageTotalInQueue"] for q in qs)
    assert rows["Empty"]["messages"] == 0 and rows["Empty"]["readQueueNums"] == 4
    table = _ok("topics", basic_copy).splitlines()
    assert table[0].split() == ["topic", "queues", "messages", "readQueueNums", "writeQueueNums"]
    assert len({line.index("messages") for line in table[:1]}) == 1 and len(table) == 5
    assert table[2].split()[:3] == ["TopicA", "4", str(rows["TopicA"]["messages"])]
    parsed = list(csv.DictReader(io.StringIO(_ok("topics", basic_copy, "--format", "csv"))))
    assert [r["topic"] for r in parsed] == ["Empty", "TopicA", "TopicB", "TopicC"]


def test_lag_and_groups_from_consumer_offsets(basic_copy):
    # RocketMQ's own file: fastjson writes integer map keys unquoted
    _write_offsets(basic_copy, '{"offsetTable":{"TopicA@billing":{0:100,1:382,2:5},"TopicB@audit":{0:-1}}}')
    doc = json.loads(_ok("lag", basic_copy, "--group", "billing", "--format", "json"))
    by_q = {r["queueId"]: r for r in doc["lag"]}
    assert sorted(by_q) == [0, 1, 2, 3]  # queue 3 has no commit: it lags by all of it
    assert by_q[0]["lag"] == QUEUES[("TopicA", 0)]["maxOffsetInQueue"] - 100
    assert by_q[1]["lag"] == 0 and by_q[2]["consumerOffset"] == 5
    assert by_q[3]["consumerOffset"] is None and by_q[3]["lag"] == QUEUES[("TopicA", 3)]["messageTotalInQueue"]
    assert doc["totalLag"] == sum(r["lag"] for r in doc["lag"])
    groups = json.loads(_ok("groups", basic_copy, "--format", "json"))["groups"]
    assert [(g["group"], g["topic"]) for g in groups] == [("audit", "TopicB"), ("billing", "TopicA")]
    assert groups[1]["lag"] == doc["totalLag"] and groups[1]["queues"] == 4
    assert groups[0]["lag"] == sum(q["messageTotalInQueue"] for (t, _), q in QUEUES.items() if t == "TopicB")
    assert _ok("lag", basic_copy).splitlines()[0].split() == ["group", "topic", "queueId", "consumerOffset",
                                                             "brokerOffset", "lag"]
    _refused("lag", basic_copy, "--group", "nobody", match="nobody")
    _refused("lag", basic_copy, "--format", "xml", match="--format")


# ---------------------------------------------------------------- reset-offset

def test_reset_offset_by_time_offset_earliest_latest(basic_copy):
    _write_offsets(basic_copy, json.dumps({"offsetTable": {"TopicA@billing": {"0": 7}, "TopicB@other": {"0": 3}}}))
    ts = sorted(e["storeTimestamp"] for e in golden_expected("basic"))[1000]
    iso = datetime.fromtimestamp(ts / 1000, timezone.utc).isoformat(timespec="milliseconds")
    out = json.loads(_ok("reset-offset", basic_copy, "--group", "billing", "--topic", "TopicA", "--to-time", iso,
                         "--format", "json"))
    with MessageStore.open(str(golden_store("basic")), read_only=True) as store:
        want = {q: store.offset_by_time("TopicA", q, ts) for q in range(4)}
    assert {r["queueId"]: r["newOffset"] for r in out["reset"]} == want
    assert out["reset"][0]["oldOffset"] == 7
    table = _offsets(basic_copy)
    assert table["TopicA@billing"] == {str(q): o for q, o in want.items()}
    assert table["TopicB@other"] == {"0": 3}  # other groups untouched
    assert (basic_copy / "config" / "consumerOffset.json.bak").exists()  # the previous file kept
    _ok("reset-offset", basic_copy, "--group", "billing", "--topic", "TopicA", "--to-offset", "1000000000",
        "--queue-id", "1")
    assert _offsets(basic_copy)["TopicA@billing"]["1"] == QUEUES[("TopicA", 1)]["maxOffsetInQueue"]  # clamped
    _ok("reset-offset", basic_copy, "--group", "billing", "--topic", "TopicA", "--to-earliest")
    assert set(_offsets(basic_copy)["TopicA@billing"].values()) == {0}
    _ok("reset-offset", basic_copy, "--group", "new", "--topic", "TopicC", "--to-latest")
    assert _offsets(basic_copy)["TopicC@new"] == {"0": QUEUES[("TopicC", 0)]["maxOffsetInQueue"]}


def test_reset_offset_refuses_while_a_writer_has_the_store(basic_copy):
    _write_offsets(basic_copy, json.dumps({"offsetTable": {"TopicA@billing": {"0": 7}}}))
    before = (basic_copy / "config" / "consumerOffset.json").read_bytes()
    with MessageStore.open(str(basic_copy), golden_config()):
        _refused("reset-offset", basic_copy, "--group", "billing", "--topic", "TopicA", "--to-earliest",
                 match="open by a running process")
    assert (basic_copy / "config" / "consumerOffset.json").read_bytes() == before
    _refused("reset-offset", basic_copy, "--group", "billing", "--topic", "TopicA", match="--to-")
    (basic_copy / "config" / "consumerOffset.json").write_bytes(b'{"offsetTable": {"TopicA@bil')  # torn, no .bak
    _refused("reset-offset", basic_copy, "--group", "g", "--topic", "TopicA", "--to-earliest", match="unreadable")
    assert (basic_copy / "config" / "consumerOffset.json").read_bytes() == b'{"offsetTable": {"TopicA@bil'
    _refused("reset-offset", basic_copy, "--group", "g", "--topic", "Nope", "--to-earliest", match="'Nope'")
    _refused("reset-offset", basic_copy, "--group", "g", "--topic", "TopicC", "--queue-id", "5", "--to-earliest",
             match="no queue 5")


# ---------------------------------------------------------------- msg --id

@pytest.mark.parametrize("name", ["basic", "ipv6"])
def test_msg_by_offset_msg_id_and_by_uniq_key(name):
    store = golden_store(name)
    e = golden_expected(name)[17]
    assert decode_offset_msg_id(e["msgId"])[2] == e["commitLogOffset"]
    doc = json.loads(_ok("msg", store, "--id", e["msgId"]))
    assert doc["resolvedBy"] == "offsetMsgId"
    assert [m["commitLogOffset"] for m in doc["messages"]] == [e["commitLogOffset"]]
    assert doc["messages"][0]["body"] == e["body"]
    uniq = e["properties"]["UNIQ_KEY"]
    doc = json.loads(_ok("msg", store, "--id", uniq))
    assert doc["resolvedBy"] == "uniqKey" and [m["msgId"] for m in doc["messages"]] == [e["msgId"]]
    row = list(csv.DictReader(io.StringIO(_ok("msg", store, "--id", uniq, "--format", "csv"))))
    assert row[0]["msgId"] == e["msgId"] and row[0]["commitLogOffset"] == str(e["commitLogOffset"])
    _refused("msg", store, "--id", "7F00000100002A9F00000000DEADBEEF", match="no message with id")
    _refused("msg", store, "--id", uniq, "--topic", "TopicZ", match="TopicZ")


# ---------------------------------------------------------------- bodies and formats

def test_text_bodies_round_trip_through_import_byte_for_byte(tmp_path):
    out = _ok("dump", golden_store("basic"), "--text-bodies")
    rows = [json.loads(line) for line in out.splitlines()]
    encodings = {r["bodyEncoding"] for r in rows}
    assert encodings == {"utf-8", "base64"}
    text = next(r for r in rows if r["bodyEncoding"] == "utf-8")
    assert text["body"].encode("utf-8") == __import__("base64").b64decode(
        next(e for e in golden_expected("basic") if e["commitLogOffset"] == text["commitLogOffset"])["body"])
    (tmp_path / "d.jsonl").write_text(out)
    (tmp_path / "broker.conf").write_text(GOLDEN_CONF)
    _ok("import", tmp_path / "s", "--from", tmp_path / "d.jsonl", "--config", tmp_path / "broker.conf")
    golden = golden_store("basic") / "commitlog"
    for seg in sorted(golden.iterdir()):
        assert (tmp_path / "s" / "commitlog" / seg.name).read_bytes() == seg.read_bytes()
    (tmp_path / "bad.jsonl").write_text(json.dumps({**rows[0], "bodyEncoding": "hex"}) + "\n")
    _refused("import", tmp_path / "t", "--from", tmp_path / "bad.jsonl", match="bodyEncoding")


def test_format_table_and_csv_for_state_get_query():
    store = golden_store("basic")
    state = _ok("state", store, "--format", "table").splitlines()
    assert state[0].split() == ["topic", "queueId", "minOffsetInQueue", "maxOffsetInQueue", "messageTotalInQueue"]
    assert len(state) == 1 + len(QUEUES) and state[1].split() == ["TopicA", "0", "0", "380", "380"]
    assert json.loads(_ok("state", store))["queues"] == list(QUEUES.values())  # JSON stays the default
    got = json.loads(_ok("get", store, "--topic", "TopicA", "--queue-id", "0", "--offset", "0", "--max", "4"))
    rows = list(csv.DictReader(io.StringIO(_ok("get", store, "--topic", "TopicA", "--queue-id", "0", "--offset",
                                               "0", "--max", "4", "--format", "csv"))))
    assert [int(r["commitLogOffset"]) for r in rows] == [m["commitLogOffset"] for m in got["messages"]]
    for r, m in zip(rows, got["messages"]):
        raw = __import__("base64").b64decode(m["body"])
        assert r["body"] == (raw.decode("utf-8") if r["bodyEncoding"] == "utf-8" else m["body"])
    table = _ok("get", store, "--topic", "TopicA", "--queue-id", "0", "--offset", "0", "--max", "4", "--format",
                "table").splitlines()
    assert len(table) == 5 and table[0].split()[:3] == ["topic", "queueId", "queueOffset"]
    q = golden_queries("basic")["queryMessage"][0]
    rows = list(csv.DictReader(io.StringIO(_ok("query", store, "--topic", q["topic"], "--key", q["key"],
                                               "--format", "csv"))))
    assert [int(r["commitLogOffset"]) for r in rows] == q["resultPhyOffsets"]


# ---------------------------------------------------------------- dump --follow

def test_dump_follow_prints_messages_written_by_another_process(tmp_path):
    root = tmp_path / "s"
    with MessageStore.open(str(root), golden_config()) as store:
        store.put(Message("T", b"first"))
        store.put(Message("Other", b"x"))
        store.wait_dispatched()
        p = subprocess.Popen([sys.executable, "-m", "rocketstore", "dump", str(root), "--follow", "--topic", "T",
                              "--max-messages", "5", "--interval", "0.05", "--text-bodies"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert json.loads(p.stdout.readline())["body"] == "first"  # what was there, at once
            for i in range(2):
                store.put(Message("T", f"live-{i}".encode()))
            assert json.loads(p.stdout.readline())["body"] == "live-0"
            # past a segment boundary: bodies big enough to fill the 1 MiB segment
            store.put(Message("T", b"y" * 700_000))
            store.put(Message("T", b"z" * 700_000))
            bodies = [json.loads(p.stdout.readline())["body"] for _ in range(3)]  # (readline only: it buffers)
            assert p.wait(60) == 0, p.stderr.read().decode()
            assert p.stdout.read() == b""  # stopped at --max-messages
        finally:
            p.kill()
        assert bodies == ["live-1", "y" * 700_000, "z" * 700_000]
        assert len(list((root / "commitlog").iterdir())) >= 2


def test_retention_reads_rocketmqs_own_offsets_file(basic_copy):
    """store.consumer_offsets (the retention warning's input) reads the file as lag does: fastjson keys too."""
    _write_offsets(basic_copy, '{"offsetTable":{"TopicA@g1":{0:5,1:9},"TopicA@g2":{0:3},"TopicB@g1":{1:2}}}')
    with MessageStore.open(str(basic_copy), read_only=True) as store:
        assert store.consumer_offsets() == {("TopicA", 0): 3, ("TopicA", 1): 9, ("TopicB", 1): 2}
