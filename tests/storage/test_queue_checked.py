"""queue_checked.checked_prefix, recovery's vectorised tier: followed by scan_records it decides every record
exactly as scan_records alone does, whatever the consume queues claim."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from rocketstore import MessageStore, StoreConfig
from rocketstore.format import codec
from rocketstore.storage import queue_checked
from rocketstore.recovery import recover as recovery
from conftest import GOLDEN_NAMES, copy_store, golden_store
from recovery.test_recovery_scan import reference, scan_all

SEGMENT = 1048576
CONF = dict(mappedFileSizeCommitLog=SEGMENT, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=1000, maxIndexNum=4000)


def golden_units(name: str, tmp_path: Path) -> list[tuple[int, bytes, queue_checked.QueueUnits]]:
    """Each commitlog segment of a golden store with the units its consume queues hold for it."""
    root = copy_store(golden_store(name), tmp_path / name)
    out = []
    with MessageStore.open(str(root), StoreConfig(**CONF), read_only=True) as store:
        for f in store.commitlog.queue.files:
            base = f.file_from_offset
            out.append((base, bytes(f.mm), queue_checked.units_by_queue(store, base, base + f.file_size)))
    return out


def combined(buf: bytes, base: int, units, check_crc: bool, **kw) -> tuple[int, int, int, list[int], int]:
    """checked_prefix, then scan_records from where it stopped (as recovery runs them)."""
    pos, last, n = queue_checked.checked_prefix(buf, 0, len(buf), base=base, units=units, check_crc=check_crc, **kw)
    nxt, last2, n2, wanted = scan_from(buf, pos, base, check_crc, **kw)
    return nxt, (last2 if n2 else last), n + n2, wanted, n


def scan_from(buf: bytes, pos: int, base: int, check_crc: bool, **kw) -> tuple[int, int, int, list[int]]:
    return codec.scan_records(buf, pos, len(buf), len(buf), base=base, check_crc=check_crc, **kw)


def assert_same(buf: bytes, base: int, units, check_crc: bool = True, **kw) -> int:
    alone = scan_all(buf, len(buf), base, check_crc, **kw)
    nxt, last, n, wanted, fast = combined(buf, base, units, check_crc, **kw)
    assert (nxt, last, n, wanted) == alone
    return fast


def held_by(buf: bytes, base: int, rnd: random.Random | None) -> dict[tuple[bytes, int], int]:
    """Each queue's max physical offset as its units give it, or (with ``rnd``) a random bound."""
    out: dict[tuple[bytes, int], int] = {}
    for pos, size, (h, tp, tl, _) in reference(buf, len(buf), base, False):
        key = (bytes(buf[tp:tp + tl]), h[3])
        out[key] = max(out.get(key, -1), base + pos + size)
    if rnd is not None:
        out = {k: rnd.choice([v, -1, base + rnd.randrange(len(buf)), 1 << 62]) for k, v in out.items()
               if rnd.random() < 0.9}
    return out


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_prefix_then_scan_agrees_with_the_scan_on_golden_stores(name, tmp_path):
    rnd = random.Random(name)
    vouched = 0
    for base, buf, units in golden_units(name, tmp_path):
        vouched += assert_same(buf, base, units, held=held_by(buf, base, None), index_from=codec.NO_INDEX)
        assert_same(buf, base, units, check_crc=False, held=None)
        for _ in range(6):
            assert_same(buf, base, units, check_crc=rnd.random() < 0.8, held=held_by(buf, base, rnd),
                        index_from=rnd.choice([codec.NO_INDEX, base + rnd.randrange(len(buf))]))
    if name != "txn":  # transaction halves are in no queue: the prefix stops at the first one
        assert vouched > 0


def test_prefix_then_scan_agrees_with_the_scan_on_corrupted_records_and_queues(tmp_path):
    rnd = random.Random(11)
    for name in GOLDEN_NAMES:
        base, orig, units = golden_units(name, tmp_path)[0]
        ref = reference(orig, len(orig), base, True)
        held = held_by(orig, base, None)
        for _ in range(60):
            buf = bytearray(orig)
            u = {k: v.copy() for k, v in units.items()}
            pos, size, (h, tp, tl, _) = rnd.choice(ref)
            kind = rnd.randrange(9)
            if kind == 0:  # one byte anywhere in the record
                buf[pos + rnd.randrange(size)] ^= 1 << rnd.randrange(8)
            elif kind == 1:  # a header field: size, magic, CRC, queue id, PHYSICALOFFSET, sysFlag, body length
                buf[pos + rnd.choice([0, 3, 4, 7, 8, 11, 15, 28, 35, 39, 87])] ^= 1 << rnd.randrange(8)
            elif kind == 2:  # the tail: topic length, a topic byte, properties length
                buf[rnd.choice([tp - 1, tp, tp + tl - 1, tp + tl, tp + tl + 1])] = rnd.randrange(256)
            elif kind == 3:  # torn: zeros from the middle on
                cut = pos + rnd.randrange(1, size)
                buf[cut:] = bytes(len(buf) - cut)
            elif kind == 4 and u:  # a unit moved, or duplicated
                k = rnd.choice(list(u))
                if len(u[k]):
                    i = rnd.randrange(len(u[k]))
                    u[k][i, 0] += rnd.choice([-1, 1, 8, -size])
            elif kind == 5 and len(u) > 1:  # a queue's units filed under another queue
                a, b = rnd.sample(list(u), 2)
                u[a], u[b] = u[b], u[a]
            elif kind == 6 and u:  # a queue that lost its units from some point on
                k = rnd.choice(list(u))
                u[k] = u[k][: rnd.randrange(len(u[k]) + 1)]
            elif kind == 7:  # units for the records no queue points at (transaction halves)
                u = with_every_record(u, orig, base, ref)
            else:  # a unit for the same record in a second queue
                k = rnd.choice(list(u))
                if len(u[k]):
                    other = (k[0], k[1] + 1)
                    u[other] = np.concatenate([u.get(other, np.zeros((0, 2), np.int64)), u[k][:1]])
            assert_same(bytes(buf), base, u, check_crc=rnd.random() < 0.8,
                        held=rnd.choice([held, held_by(orig, base, rnd), None]),
                        index_from=rnd.choice([codec.NO_INDEX, base + rnd.randrange(len(orig))]))


def with_every_record(units, buf: bytes, base: int, ref) -> dict:
    """``units`` plus a unit for each record no queue points at, filed under the record's own topic and queue."""
    u = dict(units)
    claimed = {int(o) for v in u.values() for o in v[:, 0]}
    for pos, size, (h, tp, tl, _) in ref:
        if base + pos not in claimed:
            k = (bytes(buf[tp:tp + tl]).decode(), h[3])
            more = np.concatenate([u.get(k, np.zeros((0, 2), np.int64)), np.array([[base + pos, size]], np.int64)])
            u[k] = more[np.argsort(more[:, 0])]
    return u


def test_a_queue_claiming_a_transaction_half_does_not_hide_it_from_dispatch(tmp_path):
    """PREPARED and ROLLBACK records belong in no queue; a queue that claims one must not keep the scan from
    handing a PREPARED record back for the index."""
    (base, buf, units), = golden_units("txn", tmp_path)
    ref = reference(buf, len(buf), base, True)
    halves = [base + p for p, _, (h, _, _, _) in ref if h[7] & codec.TRANSACTION_MASK in
              (codec.TRANSACTION_PREPARED, codec.TRANSACTION_ROLLBACK)]
    assert halves
    u = with_every_record(units, buf, base, ref)
    for index_from in (codec.NO_INDEX, base, halves[0], halves[-1]):
        assert_same(buf, base, u, held=held_by(buf, base, None), index_from=index_from)


def test_crashed_store_recovers_through_the_prefix_and_agrees_with_the_walk(tmp_path: Path, monkeypatch):
    """A store written here and crashed: the prefix checks nearly every record, and recovery ends exactly as
    the record-by-record tiers alone end it (report and files)."""
    root = tmp_path / "w"
    conf = StoreConfig(**CONF)
    with MessageStore.open(str(root), conf) as store:
        from rocketstore.format.message import Message
        for i in range(3000):
            store.put(Message(f"T{i % 3}", b"x" * (i % 700), queue_id=i % 4, keys=f"k{i}"))
        store.wait_dispatched(timeout=30)
    fast, slow = copy_store(root, tmp_path / "fast"), copy_store(root, tmp_path / "slow")
    seg = sorted((root / "commitlog").iterdir())[-1]
    records = reference(seg.read_bytes(), SEGMENT, int(seg.name), False)
    pos, _size, (h, _tp, _tl, _) = next(r for r in records[len(records) * 2 // 3:] if r[2][0][16] > 10)
    victim = pos + 88 + 5  # a body byte (IPv4 hosts)
    for s in (fast, slow):
        (s / "abort").write_text("1")  # a crash of the process alone: the index files stay
        (s / "abort.bootid").write_text(Path("/proc/sys/kernel/random/boot_id").read_text())
        with open(s / "commitlog" / seg.name, "r+b") as fh:
            fh.seek(victim)
            b = fh.read(1)
            fh.seek(victim)
            fh.write(bytes([b[0] ^ 0x40]))
            # Nothing intact after it: damage followed by an intact record is refused after a crash of the process
            # alone (no page can be torn), so the crash's torn tail is the damaged record and what follows.
            fh.seek(pos + h[0])
            fh.write(bytes(SEGMENT - pos - h[0]))
    monkeypatch.setattr(recovery, "VECTORISED_MIN_BYTES", 0)  # segments of 1 MiB: use the tier all the same
    seen = []
    real = queue_checked.checked_prefix
    monkeypatch.setattr(queue_checked, "checked_prefix", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    with MessageStore.open(str(fast), conf, start_services=False) as store:
        a = store.recovery_report.to_json()
    assert sum(n for _, _, n in seen) > 0.5 * a["recordsChecked"] > 0
    monkeypatch.setattr(queue_checked, "checked_prefix", lambda buf, pos, *a, **k: (pos, -1, 0))
    with MessageStore.open(str(slow), conf, start_services=False) as store:
        b = store.recovery_report.to_json()
    a.pop("seconds")
    b.pop("seconds")
    assert json.dumps(a).replace(str(fast), "") == json.dumps(b).replace(str(slow), "")
    assert a["stoppedBecause"], a
    for p in sorted(fast.rglob("*")):
        rel = p.relative_to(fast)
        if p.is_file() and rel.parts[0] in ("consumequeue", "commitlog", "index"):
            assert p.read_bytes() == (slow / rel).read_bytes(), rel


def test_small_recoveries_walk_without_numpy(tmp_path):
    """A store whose queues cover little of a segment is only walked: opening it does not import numpy."""
    import subprocess
    import sys
    root = copy_store(golden_store("basic"), tmp_path / "basic")
    (root / "abort").write_text("1")
    code = ("import sys; from rocketstore import MessageStore, StoreConfig; "
            f"s = MessageStore.open({str(root)!r}, StoreConfig(**{CONF!r}), start_services=False); "
            "print(s.recovery_report.records_checked, 'numpy' in sys.modules); s.close()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) > 0 and out[1] == "False"


def test_units_by_queue_reads_only_the_range_asked(tmp_path):
    root = copy_store(golden_store("basic"), tmp_path / "basic")
    with MessageStore.open(str(root), StoreConfig(**CONF), read_only=True) as store:
        every = queue_checked.units_by_queue(store)
        base = store.commitlog.queue.files[-1].file_from_offset
        tail = queue_checked.units_by_queue(store, base, base + SEGMENT)
    assert sum(len(u) for u in every.values()) > sum(len(u) for u in tail.values()) > 0
    for k, u in tail.items():
        assert ((u[:, 0] >= base) & (u[:, 0] < base + SEGMENT)).all()
        assert np.array_equal(u, every[k][every[k][:, 0] >= base])
