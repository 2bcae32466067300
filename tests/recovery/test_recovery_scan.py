"""codec.scan_records, recovery's fast walker, accepts exactly what codec.walk plus the PHYSICALOFFSET check accepts."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest

from rocketstore import MessageStore, StoreConfig
from rocketstore.format import codec
from rocketstore.recovery import recover as recovery
from conftest import GOLDEN_NAMES, copy_store, golden_expected, golden_store

SEGMENT = 1048576


def segments(name: str) -> list[tuple[int, bytes]]:
    d = golden_store(name) / "commitlog"
    return [(int(p.name), p.read_bytes()) for p in sorted(d.iterdir())]


def reference(buf: bytes, limit: int, base: int, check_crc: bool) -> list[tuple[int, int, tuple]]:
    """The records recovery accepts, the slow way: walk(parsed=True) with the trusted-record check (base)."""
    out = []
    for pos, size, parsed, _ in codec.walk(buf, 0, limit, check_crc=check_crc, parsed=True, base=base):
        if size <= 0 or parsed is None or parsed[0][6] != base + pos:
            break
        out.append((pos, size, parsed))
    return out


def scan_all(buf: bytes, limit: int, base: int, check_crc: bool, chunk: int | None = None,
             **kw) -> tuple[int, int, int, list[int]]:
    """scan_records over [0, limit), in chunks of ``chunk`` bytes as recovery calls it."""
    pos, last, n, wanted = 0, -1, 0, []
    while pos < limit:
        stop = min(limit, pos + chunk) if chunk else limit
        pos, l, k, w = codec.scan_records(buf, pos, stop, limit, base=base, check_crc=check_crc, **kw)
        n += k
        wanted += w
        if k:
            last = l
        if pos < stop:
            break
    return pos, last, n, wanted


def assert_agrees(buf: bytes, limit: int, base: int, check_crc: bool = True, chunk: int | None = None) -> int:
    ref = reference(buf, limit, base, check_crc)
    nxt, last, n, wanted = scan_all(buf, limit, base, check_crc, chunk, held={}, index_from=0)
    assert n == len(ref)
    assert last == (ref[-1][0] if ref else -1)
    assert nxt == (ref[-1][0] + ref[-1][1] if ref else 0)
    # held={} and index_from=0: every record but a ROLLBACK is wanted
    assert wanted == [p for p, _, h in ref if h[0][7] & codec.TRANSACTION_MASK != codec.TRANSACTION_ROLLBACK]
    return n


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_scan_agrees_with_walk_on_golden_stores(name):
    total = 0
    for base, buf in segments(name):
        total += assert_agrees(buf, len(buf), base)
        assert_agrees(buf, len(buf), base, check_crc=False, chunk=4096)
    assert total > 0


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_scan_wants_what_the_queues_and_index_do_not_hold(name):
    rnd = random.Random(name)
    for base, buf in segments(name):
        ref = reference(buf, len(buf), base, True)
        if not ref:
            continue
        keys = {(bytes(buf[h[1]:h[1] + h[2]]), h[0][3]) for _, _, h in ref}
        for _ in range(5):
            held = {k: rnd.choice([-1, base + rnd.randrange(len(buf)), 1 << 62]) for k in keys if rnd.random() < 0.8}
            index_from = rnd.choice([codec.NO_INDEX, base + rnd.randrange(len(buf))])
            expect = []
            for pos, size, (h, tp, tl, _) in ref:
                txn = h[7] & codec.TRANSACTION_MASK
                queue = txn in (codec.TRANSACTION_NOT_TYPE, codec.TRANSACTION_COMMIT) and \
                    held.get((bytes(buf[tp:tp + tl]), h[3]), -1) < h[6] + size
                if queue or (h[6] >= index_from and txn != codec.TRANSACTION_ROLLBACK):
                    expect.append(pos)
            got = scan_all(buf, len(buf), base, True, 65536, held=held, index_from=index_from)[3]
            assert got == expect
            if index_from == codec.NO_INDEX:
                assert scan_all(buf, len(buf), base, True, held=None, index_from=index_from)[3] == []


def test_scan_agrees_with_walk_on_corrupted_copies():
    rnd = random.Random(8)
    for name in GOLDEN_NAMES:
        base, orig = segments(name)[0]
        ref = reference(orig, len(orig), base, True)
        starts = [p for p, _, _ in ref]
        for _ in range(60):
            buf = bytearray(orig)
            rec = rnd.choice(ref)
            pos, size = rec[0], rec[1]
            kind = rnd.randrange(6)
            if kind == 0:  # one byte anywhere in the record
                buf[pos + rnd.randrange(size)] ^= 1 << rnd.randrange(8)
            elif kind == 1:  # a header field: size, magic, CRC, PHYSICALOFFSET, sysFlag
                off = rnd.choice([0, 3, 4, 7, 8, 28, 35, 39])
                buf[pos + off] ^= 1 << rnd.randrange(8)
            elif kind == 2:  # the tail: topic length, properties length
                tp, tl = rec[2][1], rec[2][2]
                q = rnd.choice([tp - 1, tp + tl, tp + tl + 1])
                buf[q] = rnd.randrange(256)
            elif kind == 3:  # torn: zeros from the middle on
                cut = pos + rnd.randrange(1, size)
                buf[cut:] = bytes(len(buf) - cut)
            elif kind == 4:  # stale bytes: the record copied to another position
                dst = rnd.choice(starts)
                buf[dst:dst + size] = orig[pos:pos + size]
            else:  # the readable end inside the record
                assert_agrees(bytes(buf), pos + rnd.randrange(size), base)
                continue
            assert_agrees(bytes(buf), len(buf), base, check_crc=rnd.random() < 0.8, chunk=rnd.choice([None, 777]))


def test_recovery_takes_the_slow_path_for_each_record_the_scan_refuses(tmp_path: Path, monkeypatch, caplog):
    """With the scan refusing everything, recovery still reaches the same outcome through walk alone."""
    fast = copy_store(golden_store("txn"), tmp_path / "fast")
    slow = copy_store(golden_store("txn"), tmp_path / "slow")
    records = sorted(golden_expected("txn"), key=lambda e: e["commitLogOffset"])
    victim = records[len(records) * 2 // 3]["commitLogOffset"] + 88 + 5  # a body byte (IPv4 hosts)
    for s in (fast, slow):
        (s / "abort").write_text("1")
        with open(s / "commitlog" / f"{0:020d}", "r+b") as fh:
            fh.seek(victim)
            b = fh.read(1)
            fh.seek(victim)
            fh.write(bytes([b[0] ^ 0x40]))
        cp = bytearray((s / "checkpoint").read_bytes())  # physicMsgTimestamp 0: nothing counted as flushed,
        cp[0:8] = bytes(8)                                # so the damage is a torn tail, truncated
        (s / "checkpoint").write_bytes(bytes(cp))
    conf = StoreConfig(mappedFileSizeCommitLog=SEGMENT, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=1000,
                       maxIndexNum=4000)
    monkeypatch.setattr(recovery, "PROGRESS_INTERVAL_S", 0.0)
    with caplog.at_level(logging.INFO, logger="rocketstore.recovery.recover"), \
            MessageStore.open(str(fast), conf, start_services=False) as store:
        a = store.recovery_report.to_json()
    assert any("bytes checked" in r.getMessage() for r in caplog.records)  # progress is still logged
    monkeypatch.setattr(codec, "scan_records", lambda buf, pos, *a, **k: (pos, -1, 0, []))
    with MessageStore.open(str(slow), conf, start_services=False) as store:
        b = store.recovery_report.to_json()
    a.pop("seconds")
    b.pop("seconds")
    assert json.dumps(a).replace(str(fast), "") == json.dumps(b).replace(str(slow), "")
    assert "body CRC mismatch" in a["stoppedBecause"] and a["recordsChecked"] > 0
    files = sorted(p.relative_to(fast) for p in fast.rglob("*") if p.is_file() and p.name not in ("lock",))
    for rel in files:
        if rel.parts[0] in ("consumequeue", "commitlog"):
            assert (fast / rel).read_bytes() == (slow / rel).read_bytes(), rel
    index = [sorted(p.read_bytes() for p in (s / "index").iterdir()) for s in (fast, slow)]
    assert index[0] == index[1] and index[0]  # rebuilt the same (the crash dropped the index files)


def test_consume_queue_valid_prefix_column_check_agrees_with_the_unit_loop(monkeypatch):
    """The C-speed column test of _valid_prefix gives what unpacking unit by unit gives, on damaged files."""
    import random
    import struct

    from rocketstore.storage import consume_queue as cqm

    def by_units(buf: bytes) -> tuple:
        with monkeypatch.context() as m:
            m.setattr(cqm, "_all_valid", lambda mm, end: False)
            return cqm._valid_prefix(buf, len(buf))

    good = bytearray(3000 * 20)
    for i in range(2500):
        cqm._UNIT.pack_into(good, i * 20, 1000 * i, 1 + i % 900, i % 7)
    want = (50000, (2499000, 1 + 2499 % 900, 2499 % 7))
    assert cqm._valid_prefix(bytes(good), len(good)) == by_units(bytes(good)) == want
    rnd = random.Random(3)
    for _ in range(200):
        m = bytearray(good)
        k = rnd.randrange(2500)
        fmt, at, value = rnd.choice([(">q", 0, -5), (">i", 8, 0), (">i", 8, -1), (">i", 8, 256), (">q", 12, -1)])
        struct.pack_into(fmt, m, k * 20 + at, value)
        assert cqm._valid_prefix(bytes(m), len(m)) == by_units(bytes(m))
