"""Issue 24, items 8, 9, 12, 13 and three of 15: the tools' walks accept only trusted records, import
refuses bodies that are not the dumped ones, a consumer overtaken by retention skips ahead, offline
tools take the directory lock, and errors name the damage (data-safety.md rule 1)."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest

from rocketstore import MessageStore
from rocketstore.format import codec
from conftest import REPO, golden_expected, run_cli

STALE_FROM, STALE_TO, STALE_SIZE = 776764, 2355278, 739  # record at 776764 copied over 2355278 (and 2355636)
SEG2 = "commitlog/00000000000002097152"


def _stale_copy(store: Path) -> None:
    """Bytes of the intact record at 776764 written again at 2355278: a misdirected write of a golden copy."""
    rec = (store / "commitlog/00000000000000000000").read_bytes()[STALE_FROM:STALE_FROM + STALE_SIZE]
    with open(store / SEG2, "r+b") as fh:
        fh.seek(STALE_TO - 2097152)
        fh.write(rec)


def _rows(out: bytes) -> list[dict]:
    return [json.loads(x) for x in out.decode().splitlines()]


# ---------------------------------------------------------------- item 8: walks accept only trusted records

def test_walk_with_base_refuses_a_crc_valid_record_at_the_wrong_position():
    data = bytes(codec.encode_bytes("T", b"body", physical_offset=1000))
    assert codec.check(data, 0, len(data), check_crc=True, base=1000)[1] is not None
    size, msg, reason = codec.check(data, 0, len(data), check_crc=True, base=5000)
    assert (size, msg) == (-1, None) and "PHYSICALOFFSET field says 1000" in reason and "5000" in reason
    assert [(p, m) for p, _s, m, _r in codec.walk(data, 0, len(data), check_crc=True, base=5000)] == [(0, None)]


@pytest.mark.parametrize("flags", [[], ["--topic", "TopicA"], ["--from-offset", "2097152"], ["--no-body"]])
def test_dump_stops_at_a_stale_record_copy_instead_of_printing_it(basic_copy, flags):
    _stale_copy(basic_copy)
    r = run_cli("dump", basic_copy, *flags)
    assert r.returncode == 2, r.stderr
    err = r.stderr.decode()
    assert "2355278" in err and "PHYSICALOFFSET" in err and "Traceback" not in err
    offsets = [row["commitLogOffset"] for row in _rows(r.stdout)]
    assert len(offsets) == len(set(offsets)) and all(o < STALE_TO for o in offsets)


def test_dump_skip_damaged_reports_a_stale_copy_and_prints_each_message_once(basic_copy, tmp_path):
    _stale_copy(basic_copy)
    r = run_cli("dump", basic_copy, "--skip-damaged")
    assert r.returncode == 1, r.stderr
    err = r.stderr.decode()
    assert "skipped damaged record at commitlog offset 2355278" in err and "stale record copy" in err
    rows = _rows(r.stdout)
    offsets = [row["commitLogOffset"] for row in rows]
    assert len(offsets) == len(set(offsets)) == 2998  # the two records the copy overwrote are lost, no more
    keys = [(row["topic"], row["queueId"], row["queueOffset"]) for row in rows]
    assert len(keys) == len(set(keys))
    expected = {e["commitLogOffset"] for e in golden_expected("basic")} - {2355278, 2355636}
    assert set(offsets) == expected
    # what import would replay: every message once
    dump = tmp_path / "d.jsonl"
    dump.write_bytes(r.stdout)
    imp = run_cli("import", tmp_path / "new", "--from", dump)
    assert imp.returncode == 0, imp.stderr
    assert json.loads(imp.stdout)["imported"] == 2998


def test_messages_api_names_the_stale_copy(basic_copy):
    _stale_copy(basic_copy)
    with MessageStore.open(str(basic_copy), read_only=True) as store:
        bad = [(off, problem) for off, _s, m, problem in store.messages(2097152, skip_damaged=True) if m is None]
        assert [off for off, _ in bad] == [STALE_TO] and "stale record copy" in bad[0][1]
        seen = [m.commit_log_offset for _o, _s, m, _p in store.messages(0, read_body=False, skip_damaged=True) if m]
        assert STALE_FROM in seen and seen.count(STALE_FROM) == 1 and len(seen) == 2998
        from rocketstore.errors import CorruptRecordError
        with pytest.raises(CorruptRecordError, match="stale record copy"):  # a lookup by offset: the same check
            store.look(STALE_TO)
        assert store.look(STALE_FROM).commit_log_offset == STALE_FROM


# ---------------------------------------------------------------- item 9: import refuses bodies that are not the record's

def _dump_lines(tmp_path: Path, *flags: str) -> Path:
    src = REPO / "tests" / "golden" / "basic" / "store"
    r = run_cli("dump", src, "--limit", "6", *flags)
    assert r.returncode == 0, r.stderr
    p = tmp_path / "dump.jsonl"
    p.write_bytes(r.stdout)
    return p


def test_import_refuses_a_no_body_dump_and_writes_nothing(tmp_path):
    dump = _dump_lines(tmp_path, "--no-body")
    r = run_cli("import", tmp_path / "new", "--from", dump)
    assert r.returncode == 2
    err = r.stderr.decode()
    assert f"{dump}:1:" in err and "no body" in err and "nothing imported" in err and "Traceback" not in err
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("edit", ["body", "length"])
def test_import_refuses_an_edited_body_naming_the_line(tmp_path, basic_copy, edit):
    dump = _dump_lines(tmp_path)
    rows = [json.loads(x) for x in dump.read_text().splitlines()]
    if edit == "body":
        body = bytearray(base64.b64decode(rows[4]["body"]))
        body[0] ^= 1
        rows[4]["body"] = base64.b64encode(bytes(body)).decode()
    else:
        rows[4]["body"] = base64.b64encode(base64.b64decode(rows[4]["body"]) + b"x").decode()
    dump.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = {p: p.read_bytes() for p in (basic_copy / "commitlog").iterdir()}
    r = run_cli("import", basic_copy, "--from", dump)
    assert r.returncode == 2
    err = r.stderr.decode()
    assert f"{dump}:5:" in err and ("bodyCrc" if edit == "body" else "bodyLength") in err
    assert {p: p.read_bytes() for p in (basic_copy / "commitlog").iterdir()} == before  # nothing written
    ok = run_cli("import", basic_copy, "--from", dump, "--continue-on-error")
    assert ok.returncode == 0 and json.loads(ok.stdout) == {**json.loads(ok.stdout), "imported": 5, "skipped": 1}


# ---------------------------------------------------------------- item 13: offline tools take the directory lock

def test_reset_offset_refuses_a_live_writer_whose_lock_file_was_deleted(basic_copy):
    from rocketstore.config import golden_config
    (basic_copy / "config").mkdir(exist_ok=True)
    offsets = basic_copy / "config" / "consumerOffset.json"
    offsets.write_text(json.dumps({"offsetTable": {"TopicA@billing": {"0": 7}}}))
    before = offsets.read_bytes()
    with MessageStore.open(str(basic_copy), golden_config()):
        os.unlink(basic_copy / "lock")  # an operator's `rm STORE/lock` under the live writer
        r = run_cli("reset-offset", basic_copy, "--group", "billing", "--topic", "TopicA", "--to-earliest")
        err = r.stderr.decode()
        assert r.returncode == 2 and "open by a running process" in err and "Traceback" not in err, err
        assert offsets.read_bytes() == before
    r = run_cli("reset-offset", basic_copy, "--group", "billing", "--topic", "TopicA", "--to-earliest")
    assert r.returncode == 0, r.stderr  # the writer is gone: the reset goes through
    assert set(json.loads(offsets.read_text())["offsetTable"]["TopicA@billing"].values()) == {0}


# ---------------------------------------------------------------- item 15: errors that name what is wrong

def test_a_store_without_write_permission_is_not_reported_as_locked(basic_copy, monkeypatch):
    """Root ignores file modes, so the kernel's EACCES on the lock file is injected."""
    from rocketstore.storage import store_lock
    from rocketstore.errors import StoreError, StoreLockedError
    real_open = os.open
    lock_path = str(basic_copy / "lock")

    def no_write(path, flags, *a):
        if str(path) == lock_path and flags & (os.O_RDWR | os.O_WRONLY):
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *a)

    monkeypatch.setattr(store_lock.os, "open", no_write)
    with pytest.raises(StoreError) as e:
        store_lock.StoreLock(str(basic_copy)).acquire()
    assert not isinstance(e.value, StoreLockedError)
    assert "no write permission" in str(e.value) and "locked by another process" not in str(e.value)
    monkeypatch.setattr(store_lock.os, "open", real_open)
    with MessageStore.open(str(basic_copy)) as store:  # the failed attempt left nothing held
        assert not store.read_only


def test_msg_id_of_a_crc_damaged_record_names_the_damage(basic_copy):
    from conftest import flip_body_bit
    e = golden_expected("basic")[17]
    flip_body_bit(basic_copy, e["commitLogOffset"])
    r = run_cli("msg", basic_copy, "--id", e["msgId"])
    err = r.stderr.decode()
    assert r.returncode == 2 and "no message" not in err and "damaged" in err, err
    assert str(e["commitLogOffset"]) in err and "CRC" in err and "Traceback" not in err
    other = golden_expected("basic")[18]  # its neighbour still reads
    assert json.loads(run_cli("msg", basic_copy, "--id", other["msgId"]).stdout)["messages"][0]["msgId"] == \
        other["msgId"]


def test_dump_follow_to_time_returns_on_an_idle_store(tmp_path):
    import subprocess
    import sys
    import time
    from rocketstore import Message
    from rocketstore.config import golden_config
    root = tmp_path / "s"
    with MessageStore.open(str(root), golden_config()) as store:
        store.put(Message("T", b"only"))
        store.wait_dispatched()
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "rocketstore", "dump", str(root), "--follow", "--to-time", "+1s",
                            "--interval", "0.05"], capture_output=True, timeout=30)
        assert p.returncode == 0, p.stderr
        assert [json.loads(x)["topic"] for x in p.stdout.decode().splitlines()] == ["T"]
        assert time.monotonic() - t0 < 15


# ---------------------------------------------------------------- item 12: a consumer overtaken by retention

def _age_all_but_last_segment(root: Path) -> None:
    import time
    old = time.time() - 100 * 3600
    for d in ("commitlog", "consumequeue"):
        for dirpath, _dirs, files in os.walk(root / d):
            for f in files:
                os.utime(os.path.join(dirpath, f), (old, old))
    last = sorted((root / "commitlog").iterdir())[-1]
    os.utime(last)


@pytest.mark.parametrize("follow", [True, False], ids=["read-only-follower", "same-process-writer"])
def test_consumer_overtaken_by_retention_skips_ahead_with_a_warning(tmp_path, caplog, follow):
    import logging
    from rocketstore import Message
    from rocketstore.config import golden_config
    from rocketstore.consumer import Consumer
    root = tmp_path / "s"
    body = b"x" * 1000
    with MessageStore.open(str(root), golden_config()) as writer:
        for _ in range(2000):
            assert writer.put(Message("T", body)).ok
        writer.wait_dispatched()
        c = Consumer(str(root) if follow else writer, "G", "T", max_messages=100)
        got: list[int] = []
        while len(got) < 1000:
            got += [m.queue_offset for m in c.poll(1)]
        for _ in range(2000):  # the writer goes on, and its retention removes what the consumer has not read
            assert writer.put(Message("T", body)).ok
        writer.wait_dispatched()
        _age_all_but_last_segment(root)
        assert writer.delete_expired_commit_log()
        lo, hi = writer.min_offset_in_queue("T", 0), writer.max_offset_in_queue("T", 0)
        assert 2000 < lo < hi == 4000
        with caplog.at_level(logging.WARNING, logger="rocketstore"):
            for _ in range(200):
                got += [m.queue_offset for m in c.poll(0.05)]
                if got[-1] == hi - 1:
                    break
        c.close()
    assert got[-1] == hi - 1, f"stalled at {got[-1] + 1} of {hi}"
    assert got == sorted(set(got))  # queue order, none twice
    assert lo in got and all(o < 2000 or o >= lo for o in got)  # what retention removed is skipped, not invented
    assert any("skipping ahead" in r.getMessage() for r in caplog.records)


def test_a_read_only_load_meeting_a_file_retention_just_deleted_starts_after_it(tmp_path, monkeypatch):
    from rocketstore.storage import mapped_file
    from rocketstore.errors import StoreLoadError
    d = tmp_path / "cq"
    d.mkdir()
    for name in ("00000000000000000000", "00000000000000012000"):
        (d / name).write_bytes(bytes(6000))
    listed = ["00000000000000000000", "00000000000000006000", "00000000000000012000"]  # 6000 gone since listed
    real = os.listdir
    monkeypatch.setattr(mapped_file.os, "listdir", lambda p: list(listed) if str(p) == str(d) else real(p))
    q = mapped_file.MappedFileQueue(str(d), 6000, read_only=True)
    q.load()
    assert [f.file_from_offset for f in q.files] == [12000]
    q.close()
    with pytest.raises(StoreLoadError):  # a writer still refuses a listing that does not add up
        mapped_file.MappedFileQueue(str(d), 6000).load()


def test_dump_follow_overtaken_by_retention_goes_on_from_the_new_minimum(tmp_path, caplog):
    import logging
    import time
    from rocketstore import Message
    from rocketstore.config import golden_config
    from rocketstore.selection import Selection
    from rocketstore.tail_view import follower
    root = tmp_path / "s"
    body = b"y" * 1000
    with MessageStore.open(str(root), golden_config()) as writer:
        for _ in range(1500):
            assert writer.put(Message("T", body)).ok
        writer.wait_dispatched()
        ran = []

        def overtake() -> None:  # at the end of what the follower saw: the writer goes on and cleans
            if ran:
                return
            ran.append(True)
            for _ in range(2500):
                assert writer.put(Message("T", body)).ok
            writer.wait_dispatched()
            _age_all_but_last_segment(root)
            assert writer.delete_expired_commit_log()

        with MessageStore.open(str(root), read_only=True) as view, caplog.at_level(logging.WARNING, "rocketstore"):
            more = follower(view, 0.01, overtake, until=int(time.time() * 1000) + 1000)
            got = [m.commit_log_offset for m in Selection().scan(view, read_body=False, more=more)]
        left = [m.commit_log_offset for _o, _s, m, _p in writer.messages(writer.min_phy_offset(), read_body=False)]
    assert len(got) == len(set(got)) and got == sorted(got)
    assert got[-len(left):] == left  # every record still there, after the 1500 read before the cleaning
    assert len(got) == 1500 + len(left)
    assert any("removed (retention)" in r.getMessage() for r in caplog.records)
