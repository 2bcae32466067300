"""Issue 3: every bad input gets one clear line on stderr naming file and offset, exit 2, and nothing written."""

from __future__ import annotations

import json
import os

import pytest

from conftest import copy_store, golden_store, run_cli

SEG1 = "commitlog/00000000000001048576"


def one_error_line(r) -> str:
    lines = r.stderr.decode().strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0]
    return lines[0]


def corrupt(store, rel: str, pos: int, data: bytes) -> None:
    with open(store / rel, "r+b") as fh:
        fh.seek(pos)
        fh.write(data)


@pytest.fixture
def store(tmp_path):
    return copy_store(golden_store("basic"), tmp_path / "s")


def test_truncated_segment(store):
    os.truncate(store / SEG1, 1000)
    line = one_error_line(run_cli("dump", store))
    assert "00000000000001048576" in line and "1000 bytes, expected 1048576" in line


def test_segment_with_a_wrong_name(store):
    os.rename(store / SEG1, store / "commitlog" / "segment-two")
    line = one_error_line(run_cli("state", store))
    assert "segment-two" in line and "20-digit" in line


def test_garbage_bytes_stop_the_scan_at_their_offset(store):
    corrupt(store, SEG1, 0, os.urandom(64))
    r = run_cli("dump", store, "--no-body")
    line = one_error_line(r)
    assert "00000000000001048576 at file position 0" in line
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    assert rows and rows[-1]["commitLogOffset"] < 1048576  # everything before the garbage was dumped


def test_bad_magic(store):
    corrupt(store, "commitlog/00000000000000000000", 696 + 4, b"\x12\x34\x56\x78")
    line = one_error_line(run_cli("dump", store, "--no-body"))
    assert "at file position 696" in line and "bad magic code 0x12345678" in line


def test_record_size_running_past_its_file(store):
    corrupt(store, "commitlog/00000000000000000000", 696, (2 ** 30).to_bytes(4, "big"))
    line = one_error_line(run_cli("dump", store, "--no-body"))
    assert "at file position 696" in line and "runs past" in line


def test_verify_reports_a_flipped_body_byte(store):
    corrupt(store, "commitlog/00000000000000000000", 696 + 100, b"\xff\xff")
    r = run_cli("verify", store, "--json")
    assert r.returncode == 1
    problems = json.loads(r.stdout)["problems"]
    assert any(p["kind"] == "bad-record" and p["offset"] == 696 and "CRC" in p["detail"] for p in problems)


def test_verify_reports_a_consume_queue_unit_pointing_nowhere(store):
    corrupt(store, "consumequeue/TopicA/0/00000000000000000000", 20, (12345).to_bytes(8, "big"))
    r = run_cli("verify", store, "--json")
    assert r.returncode == 1
    kinds = {p["kind"] for p in json.loads(r.stdout)["problems"]}
    assert "cq-dangling" in kinds and "cq-missing" in kinds


def test_missing_directory(tmp_path):
    line = one_error_line(run_cli("state", tmp_path / "nope"))
    assert "nope: no such store directory" in line


@pytest.mark.parametrize("args, needle", [
    (["get", "STORE", "--topic", "T", "--queue-id", "x", "--offset", "0"], "'x' is not an integer"),
    (["get", "STORE", "--topic", "T", "--queue-id", "-1", "--offset", "0"], "must not be negative"),
    (["dump", "STORE", "--limit", "ten"], "'ten' is not an integer"),
    (["dump", "STORE", "--max-bytes", "0"], "--max-bytes: must be positive"),
    (["dump", "STORE", "--from-time", "yesterday"], "'yesterday' is not a time"),
    (["spark", "export", "STORE", "--to", "out", "--max-messages", "-3"], "-3 must not be negative"),
    (["spark", "export", "STORE", "--to", "out", "--to-time", "noon"], "'noon' is not a time"),
    (["spark", "export", "STORE"], "the following arguments are required: --to"),
    (["offset-by-time", "STORE", "--topic", "T", "--queue-id", "0", "--timestamp", "1", "--boundary", "mid"],
     "invalid choice"),
    (["no-such-command"], "invalid choice"),
])
def test_wrong_cli_arguments(args, needle):
    args = [str(golden_store("basic")) if a == "STORE" else a for a in args]
    assert needle in one_error_line(run_cli(*args))


def test_bad_config_file(tmp_path):
    conf = tmp_path / "c.conf"
    conf.write_text("mappedFileSizeConsumeQueue=6001\n")
    assert "mappedFileSizeConsumeQueue=6001: must be a positive multiple" in one_error_line(
        run_cli("state", golden_store("basic"), "--config", conf))
    conf.write_text("noSuchKey=1\n")
    assert "unknown key 'noSuchKey'" in one_error_line(run_cli("state", golden_store("basic"), "--config", conf))
    conf.write_text("maxIndexNum=lots\n")
    assert "'lots' is not a valid int" in one_error_line(run_cli("state", golden_store("basic"), "--config", conf))
