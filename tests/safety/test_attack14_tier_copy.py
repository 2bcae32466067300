"""Attack on repair's tier-copy restore (session 13, recovery/placement.py tier_copies): the tier's bytes for a
damaged span are written into the local segment only when they are the span's trusted records."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from conftest import GOLDEN_CONF, copy_store, flip_body_bit, golden_expected, golden_store, run_cli
from rocketstore import MessageStore
from rocketstore.errors import StoreError
from rocketstore.format.codec import BLANK_MAGIC
from rocketstore.tier.upload import upload_round

SEG = 1048576  # the golden store's segment size
EXPECTED = golden_expected("basic")


def _tiered_golden(tmp_path: Path) -> tuple[Path, Path]:
    """Golden basic with a file:// tier holding its 3 sealed segments (still on local disk too)."""
    store_path = copy_store(golden_store("basic"), tmp_path / "store")
    tier = tmp_path / "tier"
    (store_path / "broker.conf").write_text(GOLDEN_CONF + f"tieredStoreUri=file://{tier}\nfileReservedTime=0\n"
                                            "tieredStoreFileReservedTime=0\n")
    with MessageStore.open(str(store_path), start_services=False) as s:
        assert upload_round(s.files)["segments"] == 3
    return store_path, tier


def test_repair_never_restores_a_tier_copy_that_is_an_end_of_file_record_mid_segment(tmp_path):
    """Repair's tier-copy restore (session 13) took the tier's bytes for a damaged span when they were trusted
    records "up to a blank end-of-file record": a tier object damaged at that very span into a blank record's
    header (a misdirected write of a segment's end) was taken as a whole trusted cover, and written into the
    middle of the local segment, where every walk (recovery's too) ends the segment: the records after it were
    hidden.  A blank record ends a cover only where the span reaches its segment's end; else the span gets its
    tombstone as with any damaged tier copy."""
    store_path, tier = _tiered_golden(tmp_path)
    seg_base = 2 * SEG
    in_seg = [e for e in EXPECTED if seg_base <= e["commitLogOffset"] < seg_base + SEG]
    victim = in_seg[len(in_seg) // 2]
    after = [e for e in in_seg if e["commitLogOffset"] > victim["commitLogOffset"]]
    name = f"{seg_base:020d}"
    flip_body_bit(store_path, victim["commitLogOffset"], f"commitlog/{name}")
    [obj] = [p for p in tier.rglob(name) if p.is_file()]
    with open(obj, "r+b") as fh:  # the tier's copy of the span: a blank end-of-file record's header
        fh.seek(victim["commitLogOffset"] - seg_base)
        fh.write(struct.pack(">iI", 8, BLANK_MAGIC))  # (a short end: the last 8 bytes of a file)
    r = run_cli("verify", "--repair", "--json", str(store_path))
    assert b"Traceback" not in r.stderr, r.stderr
    result = json.loads(r.stdout)
    hidden = []
    with MessageStore.open(str(store_path), start_services=False) as st:
        for e in after:
            try:
                got = st.get(e["topic"], e["queueId"], e["queueOffset"], 1).messages
            except StoreError:  # ("a blank unit, yet its record lay at or after ...": the queue rebuilt without it)
                got = []
            if [m.commit_log_offset for m in got] != [e["commitLogOffset"]]:
                hidden.append(e["commitLogOffset"])
    assert not hidden, f"{len(hidden)} of the {len(after)} records after the span hidden: {hidden[:5]}..."
    assert result["restored"] == [], result
    assert [s["offset"] for s in result["lost"]] == [victim["commitLogOffset"]], result


def test_repair_restores_a_tier_copy_that_ends_in_the_segments_blank_record(tmp_path):
    """The rule above keeps the legitimate case: the local copy of a segment's last record and its blank end
    record damaged (zeroed from inside the record to the file's end) takes the tier's bytes, blank record
    included, byte for byte."""
    store_path, _tier = _tiered_golden(tmp_path)
    seg_base = 2 * SEG
    last = max((e for e in EXPECTED if seg_base <= e["commitLogOffset"] < seg_base + SEG),
               key=lambda e: e["commitLogOffset"])
    seg = store_path / f"commitlog/{seg_base:020d}"
    original = seg.read_bytes()
    cut = last["commitLogOffset"] - seg_base + 40
    seg.write_bytes(original[:cut] + bytes(SEG - cut))
    r = run_cli("verify", "--repair", "--json", str(store_path))
    assert b"Traceback" not in r.stderr, r.stderr
    result = json.loads(r.stdout)
    assert [s["offset"] for s in result["restored"]] == [last["commitLogOffset"]], result
    assert result["lost"] == [], result
    assert seg.read_bytes() == original
