"""Attack on the rebuild of a queue after a torn file that follows kept files (session 14, commit 4ac8328):
the kept units say where the refill takes up the queue, so a kept unit damaged into a valid-looking larger
offset must not make the refill skip the records after it as already placed (they would be written blank:
acknowledged messages hidden, "no record in the commitlog" said of records that are there)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

from rocketstore import GetMessageStatus, Message, MessageStore, StoreConfig
from rocketstore.tier.upload import upload_round

UNIT = struct.Struct(">qiq")


def _cfg(**kw) -> StoreConfig:
    return StoreConfig(mappedFileSizeCommitLog=32 * 1024, mappedFileSizeConsumeQueue=10 * 20, maxHashSlotNum=32,
                       maxIndexNum=128, warmAheadBytes=0, **kw)


def _tier_cfg(tier: Path, **kw) -> StoreConfig:
    return _cfg(tieredStoreUri=f"file://{tier}", tieredStoreFileReservedTime=0, tieredStoreUploadInterval=3600_000,
                **kw)


def _store(root: Path) -> tuple[dict[int, bytes], dict[int, tuple[int, int, int]]]:
    """Queue T-1 with 25 messages, interleaved with queue T-2's; returns T-1's bodies and units by queue offset."""
    bodies = {}
    with MessageStore.open(str(root), _cfg()) as st:
        for i in range(25):
            body = b"m%d|" % i + bytes(100)
            r = st.put(Message("T", body, queue_id=1))
            bodies[r.queue_offset] = body
            st.put(Message("T", b"other%d" % i + bytes(100), queue_id=2))
    qdir = root / "consumequeue" / "T" / "1"
    data = b"".join(p.read_bytes() for p in sorted(qdir.iterdir()))
    units = {i: UNIT.unpack_from(data, i * 20) for i in range(25)}
    return bodies, units


def _read_queue(st: MessageStore) -> tuple[dict[int, bytes], list[str]]:
    off, end = st.min_offset_in_queue("T", 1), st.max_offset_in_queue("T", 1)
    got, problems = {}, []
    while off < end:
        try:
            r = st.get("T", 1, off, 32)
        except Exception as e:  # a read naming damage is an answer, not a skip
            problems.append(f"@{off}: {e}")
            off += 1
            continue
        if r.status is not GetMessageStatus.FOUND:
            problems.append(f"@{off}: {r.status.name} next {r.next_begin_offset}")
            off = max(off + 1, r.next_begin_offset)
            continue
        got.update((m.queue_offset, m.body) for m in r.messages)
        off = r.next_begin_offset
    return got, problems


def test_a_kept_unit_damaged_into_a_later_offset_does_not_blank_the_refilled_records(tmp_path):
    root = tmp_path / "s"
    bodies, units = _store(root)
    qdir = root / "consumequeue" / "T" / "1"
    first, second = sorted(qdir.iterdir())[:2]
    # unit 9 (the kept file's last) now names the record of unit 14: valid-looking, ascending
    with open(first, "r+b") as fh:
        fh.seek(9 * 20)
        fh.write(UNIT.pack(*units[14]))
    with open(second, "r+b") as fh:
        fh.truncate(150)
    with MessageStore.open(str(root), _cfg()) as st:
        got, problems = _read_queue(st)
    assert not problems and got == bodies, f"missing {sorted(set(bodies) - set(got))}; problems {problems}"
    with MessageStore.open(str(root), _cfg(), read_only=True) as st:
        assert _read_queue(st) == (bodies, [])


def test_a_kept_unit_damaged_into_a_later_tier_held_offset_does_not_blank_the_refilled_records(tmp_path):
    """As above with every record of the kept file and the torn one only in the tier (segment 0 uploaded and
    deleted locally; the queue's files kept, as a stop between the commitlog's cleaning and the queues' leaves
    them): the refill from the tier takes up the queue where the kept units end."""
    root, tier = tmp_path / "s", tmp_path / "tier"
    bodies = {}
    with MessageStore.open(str(root), _tier_cfg(tier)) as st:
        for i in range(150):
            body = b"m%d|" % i + bytes(400)
            bodies[st.put(Message("T", body, queue_id=1)).queue_offset] = body
    with MessageStore.open(str(root), _tier_cfg(tier), start_services=False) as st:
        assert upload_round(st.files, max_segments=1)["segments"] == 1
    first_seg = sorted((root / "commitlog").iterdir())[0]
    old = first_seg.stat().st_mtime - 3 * 3600
    os.utime(first_seg, (old, old))
    qdir = root / "consumequeue" / "T" / "1"
    kept = {p.name: p.read_bytes() for p in qdir.iterdir()}
    with MessageStore.open(str(root), _tier_cfg(tier, fileReservedTime=1, deleteCommitLogFilesInterval=0)) as st:
        st.delete_expired_commit_log()
        st.clean_service.clean_consume_queues()
        assert st.commitlog.min_offset() == 32768
    for name, data in kept.items():
        if not (qdir / name).exists():
            (qdir / name).write_bytes(data)
    data = b"".join(kept[n] for n in sorted(kept))
    unit14 = UNIT.unpack_from(data, 14 * 20)
    assert unit14[0] + unit14[1] < 32768, "unit 14's record is the tier's only"
    first, second = sorted(qdir.iterdir())[:2]
    with open(first, "r+b") as fh:
        fh.seek(9 * 20)
        fh.write(UNIT.pack(*unit14))
    with open(second, "r+b") as fh:
        fh.truncate(150)
    with MessageStore.open(str(root), _tier_cfg(tier)) as st:
        got, problems = _read_queue(st)
    assert not problems and got == bodies, f"missing {sorted(set(bodies) - set(got))}; problems {problems}"
    local = b"".join(p.read_bytes() for p in sorted(qdir.iterdir()))
    rebuilt = [UNIT.unpack_from(local, i * 20) for i in range(150)]
    assert rebuilt == [UNIT.unpack_from(data, i * 20) for i in range(150)], \
        "the local queue holds blank or wrong units for records the tier holds (the reads went to the tier's copy)"

