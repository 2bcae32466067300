"""Issue 24, the tier's share of the model-based test's findings: the commitlog is local segments plus the tier's.

- An index rebuild (a damaged index file) reads the records the tier holds too, not the local commitlog alone:
  keys of tier-held records whose index file was never uploaded stay findable (model seed 1027).
- A sealed segment with a damaged record is never uploaded: damage sealed into the tier could not be repaired
  there (model seed 1008).  A walk that meets damage already in the tier resumes after it, as the local walk
  does, instead of losing every message after one bad record.
- A read-only follower goes past a damaged record in the middle of the log: the read of it names the damage,
  the messages after it are read (model seed 1018).
- A consume-queue file cut short is rebuilt from the records the tier holds too: its units pointing below the
  local log's start are placed, not written blank (model seed 20096).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from typing import Any
from pathlib import Path

import pytest

from conftest import GOLDEN_CONF, copy_store, flip_body_bit, golden_expected, golden_store, run_cli
from helpers.workloads import read_queue
from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.errors import StoreError
from rocketstore.tier.upload import upload_round

SEG = 1048576
EXPECTED = golden_expected("basic")
INDEX_HEADER_COUNT = 36  # indexCount's position in an index file's header


def _free_local(store: MessageStore) -> None:
    for _ in range(10):
        store.clean_service.request_manual_delete()
        store.clean_service.clean_commitlog()
        store.clean_service.clean_consume_queues()


def _tiered(tmp_path: Path) -> tuple[Path, Path]:
    """Golden basic with a file:// tier: its 3 sealed segments uploaded and deleted locally.  Of its two index
    files the first (records up to 1838741) goes up; the second, still written, stays local only, and holds the
    keys of the records in [1838741, 3145728) that only the tier holds now."""
    store = copy_store(golden_store("basic"), tmp_path / "store")
    tier = tmp_path / "tier"
    (store / "broker.conf").write_text(GOLDEN_CONF + f"tieredStoreUri=file://{tier}\nfileReservedTime=0\n"
                                       "tieredStoreFileReservedTime=0\n")
    with MessageStore.open(str(store), start_services=False) as s:
        assert upload_round(s.files)["segments"] == 3
        _free_local(s)
        assert s.min_phy_offset() == 3 * SEG
        assert [i.end_phy_offset for i in s.tier.manifest.index] == [1838741]
    return store, tier


def _damage_index_count(store: Path, which: int) -> str:
    f = sorted((store / "index").iterdir())[which]
    with open(f, "r+b") as fh:
        fh.seek(INDEX_HEADER_COUNT)
        fh.write((40000).to_bytes(4, "big"))
    return f.name


def _unfound(store: MessageStore) -> list[tuple[int, str]]:
    """(commitlog offset, UNIQ_KEY) of each golden message a query by its UNIQ_KEY does not return."""
    out = []
    for e in EXPECTED:
        uniq = e["properties"]["UNIQ_KEY"]
        r = store.query(e["topic"], uniq, 4)
        if e["commitLogOffset"] not in [m.commit_log_offset for m in r.messages]:
            out.append((e["commitLogOffset"], uniq))
    return out


@pytest.mark.parametrize("which", [0, -1])
@pytest.mark.parametrize("unclean", [False, True])
def test_index_rebuild_reads_the_records_only_the_tier_holds(tmp_path, which, unclean):
    """Model seed 1027: an index file damaged (indexCount 40000) is rebuilt on the next writable open.  The
    rebuild walked the local commitlog only, so the 1,002 tier-held records whose index file was never
    uploaded were unfindable by key.  Damaging the first file (the tier holds its copy) or the second (it
    does not): every key is found.  Seed 1093: found after an unclean stop of another boot, recovery indexed
    the local records first, and the rebuild could no longer add the tier's before them."""
    store_path, _tier = _tiered(tmp_path)
    _damage_index_count(store_path, which)
    if unclean:
        (store_path / "abort").write_text("")
        (store_path / "abort.bootid").write_text("another-boot")
    with MessageStore.open(str(store_path), start_services=False) as store:
        assert _unfound(store) == []
    with MessageStore.open(str(store_path), read_only=True) as store:
        assert _unfound(store) == []
    assert not (store_path / "index.rebuild").exists()


def test_index_rebuild_with_the_tier_down_refuses_then_finishes(tmp_path):
    """The rebuild must read tier-held records and the tier is unmounted: index entries go in commitlog order,
    so the tier's records cannot be indexed after the local ones.  The writable open refuses, naming the
    rebuild and the tier, and keeps the marker; with the tier back, the next open finishes the rebuild."""
    store_path, tier = _tiered(tmp_path)
    _damage_index_count(store_path, -1)
    tier.rename(tmp_path / "tier.away")
    with pytest.raises(StoreError, match=r"index.rebuild: the index rebuild must read the records the tier holds "
                                         r"from commitlog offset 1838741.*does not exist"):
        MessageStore.open(str(store_path), start_services=False)
    assert (store_path / "index.rebuild").exists()
    (tmp_path / "tier.away").rename(tier)
    with MessageStore.open(str(store_path), start_services=False) as store:
        assert _unfound(store) == []
    assert not (store_path / "index.rebuild").exists()


def _golden_with_tier(tmp_path: Path) -> tuple[Path, Path]:
    store = copy_store(golden_store("basic"), tmp_path / "store")
    tier = tmp_path / "tier"
    (store / "broker.conf").write_text(GOLDEN_CONF + f"tieredStoreUri=file://{tier}\nfileReservedTime=0\n"
                                       "tieredStoreFileReservedTime=0\n")
    return store, tier


def _in_segment(n: int) -> dict:
    """A golden message in the middle of segment ``n`` (bodies of more than 4 bytes: one can be flipped)."""
    cands = [e for e in EXPECTED if n * SEG <= e["commitLogOffset"] < (n + 1) * SEG]
    return cands[len(cands) // 2]


def _walk(store: MessageStore) -> tuple[list[int], list[int]]:
    """store.messages(skip_damaged=True), the walk of ``dump --skip-damaged``: (messages, damage) offsets."""
    good, bad = [], []
    for off, _size, m, _problem in store.messages(skip_damaged=True):
        (good if m is not None else bad).append(off)
    return good, bad


def test_a_segment_with_a_damaged_record_is_not_uploaded(tmp_path):
    """Model seed 1008: a repair rolled back after Ctrl-C left a damaged record; ``tier upload`` sealed that
    segment into the tier and retention deleted the local copy (which repair could have mended).  The upload
    must refuse it (and every later segment: the tier has no gaps), say so in one line and in ``tier status``,
    and go on once ``verify --repair`` has mended the segment."""
    store_path, tier = _golden_with_tier(tmp_path)
    victim = _in_segment(1)
    flip_body_bit(store_path, victim["commitLogOffset"], f"commitlog/{SEG:020d}")
    r = run_cli("tier", "upload", store_path)
    assert r.returncode == 2, r.stderr
    err = r.stderr.decode()
    assert len(err.splitlines()) == 1 and f"{SEG:020d} at file position {victim['commitLogOffset'] - SEG}" in err \
        and "verify --repair" in err and "Traceback" not in err, err
    manifest = json.loads((tier / "tier.json").read_bytes())
    assert [s["name"] for s in manifest["commitlog"]] == [f"{0:020d}"]
    r = run_cli("tier", "status", store_path, "--format", "json")
    assert r.returncode == 1 and "body CRC" in json.loads(r.stdout)["uploadBlocked"], r.stdout
    with MessageStore.open(str(store_path), start_services=False) as store:
        _free_local(store)
        assert store.min_phy_offset() == SEG  # the damaged segment stays, for repair
        assert store.tier.upload_blocked is None  # (no round in this open yet)
    r = run_cli("verify", "--repair", store_path)
    assert b"Traceback" not in r.stderr, r.stderr
    r = run_cli("tier", "upload", store_path)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tier / "tier.json").read_bytes())
    assert len(manifest["commitlog"]) == 3
    with MessageStore.open(str(store_path), start_services=False) as store:
        _free_local(store)
        assert store.min_phy_offset() == 3 * SEG
        good, bad = _walk(store)
    want = sorted(e["commitLogOffset"] for e in EXPECTED if e is not victim)
    assert bad == [] and [o for o in good if o in set(want)] == want


def test_a_walk_resumes_after_damage_in_a_tier_segment(tmp_path):
    """Damage already in the tier (an object damaged there, or uploaded by an older version): the walk names it
    once and goes on with the next trusted record, as over local segments.  It ended there, losing the
    2,000-odd messages after it, local ones included."""
    store_path, tier = _tiered(tmp_path)
    victim = _in_segment(1)
    flip_body_bit(tier, victim["commitLogOffset"], f"commitlog/{SEG:020d}")
    with MessageStore.open(str(store_path), read_only=True) as store:
        good, bad = _walk(store)
    assert bad == [victim["commitLogOffset"]]
    assert good == sorted(e["commitLogOffset"] for e in EXPECTED if e is not victim)
    r = run_cli("dump", store_path, "--skip-damaged")
    assert r.returncode == 1 and b"Traceback" not in r.stderr, r.stderr
    assert len(r.stdout.splitlines()) == len(EXPECTED) - 1


def test_a_resync_in_the_tier_reaches_the_next_segment_and_the_local_ones(tmp_path):
    """Damage whose segment holds no trusted record after it (the last record before the blank, or zeros to the
    end): the walk resumes at the next tier segment, and after the tier's last one at the local segments."""
    store_path, tier = _tiered(tmp_path)
    last_in_0 = max((e for e in EXPECTED if e["commitLogOffset"] < SEG), key=lambda e: e["commitLogOffset"])
    last_in_2 = max((e for e in EXPECTED if e["commitLogOffset"] < 3 * SEG), key=lambda e: e["commitLogOffset"])
    flip_body_bit(tier, last_in_0["commitLogOffset"])
    flip_body_bit(tier, last_in_2["commitLogOffset"], f"commitlog/{2 * SEG:020d}")
    with MessageStore.open(str(store_path), read_only=True) as store:
        good, bad = _walk(store)
    assert bad == [last_in_0["commitLogOffset"], last_in_2["commitLogOffset"]]
    assert good == sorted(e["commitLogOffset"] for e in EXPECTED if e not in (last_in_0, last_in_2))


def test_a_follower_consumer_names_damage_a_writer_left_and_reads_on(tmp_path):
    """Model seed 1018: a read-only follower ``Consumer`` of a directory another store writes, with a damaged
    record in the middle (a repair rolled back after Ctrl-C left it).  Its view stopped at the damage and it
    polled empty forever while the writer went on: a silent stop.  The invariant: the read of that offset
    raises an error naming the damage, the messages after it (and those put later) are read."""
    from rocketstore import Message, StoreConfig
    from rocketstore.consumer import Consumer
    from rocketstore.errors import CorruptRecordError
    root = tmp_path / "store"
    cfg = StoreConfig(mappedFileSizeCommitLog=64 * 1024, mappedFileSizeConsumeQueue=200, maxHashSlotNum=32,
                      maxIndexNum=128)
    with MessageStore.open(str(root), cfg) as writer:
        for i in range(20):
            assert writer.put(Message("Busy", b"m%d|" % i + bytes(50), queue_id=0)).ok
        writer.wait_dispatched()
        writer.files.flush_commitlog(0, True)
        victim = writer.get("Busy", 0, 5, 1).messages[0].commit_log_offset
        flip_body_bit(root, victim)
        got: list[int] = []
        with Consumer(str(root), "g", "Busy", poll_interval=0.01) as c:
            with pytest.raises(CorruptRecordError, match=f"at offset {victim}.*body CRC mismatch"):
                for _ in range(50):
                    got += [m.queue_offset for m in c.poll(0.02)]
            assert got == [0, 1, 2, 3, 4]
            for i in range(20, 25):
                assert writer.put(Message("Busy", b"m%d|" % i + bytes(50), queue_id=0)).ok
            writer.wait_dispatched()
            c.seek(0, 6)  # the operator skips the damaged message
            for _ in range(50):
                got += [m.queue_offset for m in c.poll(0.02)]
                if got[-1] == 24:
                    break
    assert got == [0, 1, 2, 3, 4] + list(range(6, 25))


def test_repair_of_a_tier_held_segment_keeps_the_tier_copy_findable(tmp_path):
    """A record damaged in the local copy of a segment the tier already holds intact: the commitlog (local plus
    tier) still has the message.  After ``verify --repair`` and retention, ``get`` returns the tier's record, and
    a query by its key finds it too: repair writes the tier's intact copy back (model seed 1148: it wrote a
    tombstone and rebuilt the index without the message's keys, so after retention no key found it)."""
    store_path, _tier = _golden_with_tier(tmp_path)
    with MessageStore.open(str(store_path), start_services=False) as s:
        assert upload_round(s.files)["segments"] == 3
    victim = _in_segment(2)  # past the index file the tier holds (records up to 1838741)
    seg = store_path / f"commitlog/{2 * SEG:020d}"
    original = seg.read_bytes()
    flip_body_bit(store_path, victim["commitLogOffset"], f"commitlog/{2 * SEG:020d}")
    dry = json.loads(run_cli("verify", "--repair", "--dry-run", "--json", store_path).stdout)
    assert dry["lost"] == [] and [s["offset"] for s in dry["restored"]] == [victim["commitLogOffset"]]
    assert dry["repaired"] == [f"commitlog: would rewrite {victim['size']} bytes at "
                               f"{victim['commitLogOffset']} as tier copy"]
    r = run_cli("verify", "--repair", "--json", store_path)
    assert b"Traceback" not in r.stderr, r.stderr
    result = json.loads(r.stdout)
    assert r.returncode == 0 and result["ok"] and result["lost"] == [], result
    assert seg.read_bytes() == original, "the local segment is the tier's copy again, byte for byte"
    with MessageStore.open(str(store_path), start_services=False) as store:
        [m] = store.get(victim["topic"], victim["queueId"], victim["queueOffset"], 1).messages
        assert m.body == base64.b64decode(victim["body"])
        _free_local(store)
        assert store.min_phy_offset() == 3 * SEG
        got = store.get(victim["topic"], victim["queueId"], victim["queueOffset"], 1).messages
        assert [m.commit_log_offset for m in got] == [victim["commitLogOffset"]]
        hits = store.query(victim["topic"], victim["properties"]["UNIQ_KEY"], 4).messages
        assert victim["commitLogOffset"] in [m.commit_log_offset for m in hits]


def test_a_writable_open_republishes_a_manifest_a_crash_left_one_generation_behind(tmp_path):
    """A publish writes the local copy and tierStore.json's generation before the bucket's tier.json: a crash
    between leaves the bucket one generation behind (model seed 1125, a child killed inside an upload round).
    The next writable open must read tier-held messages at once; they raised "an older manifest" until the
    open's first upload round (tieredStoreUploadInterval later) republished it.  A read-only open still reports
    the stale manifest by name (it may not write the bucket) and reads after the writable open work."""
    store, tier = _tiered(tmp_path)
    stale = (tier / "tier.json").read_bytes()
    with MessageStore.open(str(store), start_services=False) as s:
        s.tier.publish(s.tier.new_manifest() if s.tier.manifest is None else s.tier.manifest)
    (tier / "tier.json").write_bytes(stale)  # the bucket write of that publish lost to the crash
    first = EXPECTED[0]
    with MessageStore.open(str(store), start_services=False, read_only=True) as s:
        with pytest.raises(StoreError, match="older manifest"):
            s.get(first["topic"], first["queueId"], first["queueOffset"], 1)
    with MessageStore.open(str(store), start_services=False) as s:
        got = s.get(first["topic"], first["queueId"], first["queueOffset"], 1).messages
        assert [m.commit_log_offset for m in got] == [first["commitLogOffset"]]
        assert _unfound(s) == []
    with MessageStore.open(str(store), start_services=False, read_only=True) as s:
        assert s.get(first["topic"], first["queueId"], first["queueOffset"], 1).messages[0].commit_log_offset == 0


def test_repair_writes_a_tombstone_when_the_tier_copy_is_damaged_as_well(tmp_path):
    """The tier's copy is taken only when its bytes are trusted records covering the damaged span: a copy with
    the same flipped bit is not, so the span gets its tombstone as before (reported lost, originals kept), and
    the tier's object is never read as the message."""
    store_path, tier = _golden_with_tier(tmp_path)
    with MessageStore.open(str(store_path), start_services=False) as s:
        assert upload_round(s.files)["segments"] == 3
    victim = _in_segment(2)
    name = f"{2 * SEG:020d}"
    flip_body_bit(store_path, victim["commitLogOffset"], f"commitlog/{name}")
    [obj] = [p for p in tier.rglob(name) if p.is_file()]
    flip_body_bit(obj.parent, victim["commitLogOffset"], name)
    r = run_cli("verify", "--repair", "--json", store_path)
    result = json.loads(r.stdout)
    assert r.returncode == 1 and not result["ok"] and result["restored"] == [], result
    assert [s["offset"] for s in result["lost"]] == [victim["commitLogOffset"]]
    assert result["repaired"][0] == (f"commitlog: {victim['size']} bytes at {victim['commitLogOffset']} rewritten "
                                     "as tombstone")


def _tiered_store_with_a_torn_queue_file(tmp_path: Path, *, keep_first_queue_files: bool = False
                                         ) -> tuple[Path, Path, Any, dict[int, bytes]]:
    """Segment 0 in the tier and deleted locally, the queue files the tier holds deleted too; the next local queue
    file (units 60.. of T-1, their records in segment 0) cut to a size that is no multiple of 20.
    ``keep_first_queue_files``: the queue's files are not cleaned (queue cleaning runs after the commitlog's) and
    its second file (units 10..19, records only the tier holds) is the one cut.
    Returns (store root, tier root, config maker, queue offset -> body)."""
    root, tier = tmp_path / "s", tmp_path / "tier"

    def cfg(**kw) -> StoreConfig:
        return StoreConfig(mappedFileSizeCommitLog=32 * 1024, mappedFileSizeConsumeQueue=10 * 20, maxHashSlotNum=32,
                           maxIndexNum=128, warmAheadBytes=0, tieredStoreUri=f"file://{tier}",
                           tieredStoreFileReservedTime=0, tieredStoreUploadInterval=3600_000, **kw)

    bodies = {}
    with MessageStore.open(str(root), cfg()) as st:
        for i in range(150):
            r = st.put(Message("T", b"m%d|" % i + bytes(400), queue_id=1))
            bodies[r.queue_offset] = b"m%d|" % i + bytes(400)
    with MessageStore.open(str(root), cfg(), start_services=False) as st:  # (the upload service's round would race)
        assert upload_round(st.files, max_segments=1)["segments"] == 1
    first = sorted((root / "commitlog").iterdir())[0]
    old = first.stat().st_mtime - 3 * 3600
    os.utime(first, (old, old))
    qdir = root / "consumequeue" / "T" / "1"
    kept = {p.name: p.read_bytes() for p in qdir.iterdir()}
    with MessageStore.open(str(root), cfg(fileReservedTime=1, deleteCommitLogFilesInterval=0)) as st:
        st.delete_expired_commit_log()
        st.clean_service.clean_consume_queues()
        assert st.commitlog.min_offset() == 32768
    if keep_first_queue_files:  # as a stop between the commitlog's cleaning and the queues' leaves them
        for name, data in kept.items():
            if not (qdir / name).exists():
                (qdir / name).write_bytes(data)
    queue_files = sorted(qdir.iterdir())
    torn = queue_files[1] if keep_first_queue_files else queue_files[0]
    assert int(queue_files[0].name) == 0 or not keep_first_queue_files
    assert int(torn.name) // 20 < 78  # its first units point into segment 0 (the tier's only)
    with open(torn, "r+b") as fh:
        fh.truncate(150)
    return root, tier, cfg, bodies


def test_a_torn_queue_file_is_rebuilt_from_the_records_the_tier_holds(tmp_path):
    """Model seed 20096 (``put,kill,recover,retention,reimport,repair_int,tier_upload,tier_fault,index_damage``):
    the open moved the torn queue file aside and refilled the queue from the local log only: units 60..65 were
    written blank and a read there returned OFFSET_FOUND_NULL, skipping acknowledged messages the tier holds."""
    root, _tier, cfg, bodies = _tiered_store_with_a_torn_queue_file(tmp_path)
    with MessageStore.open(str(root), cfg()) as st:
        assert read_queue(st, "T", 1) == bodies


def test_a_torn_queue_file_after_a_kept_one_is_rebuilt_from_the_records_the_tier_holds(tmp_path):
    """Model seed 2138: the queue's first file (units 0..9) kept, its second torn, every record of both only in the
    tier.  The refill from the tier ran before recovery had read where the kept units end, so it offered the
    records from the log's start again, and the one at queue offset 0 was appended after unit 9 (a unit at
    queue offset 0 was never checked against the units in place); recovery then cut the queue at that unit and
    wrote units 10.. blank: the tier's records were never read back.  Each unit is placed at its own queue
    offset, and the refill starts where the kept units end."""
    root, _tier, cfg, bodies = _tiered_store_with_a_torn_queue_file(tmp_path, keep_first_queue_files=True)
    with MessageStore.open(str(root), cfg()) as st:
        assert read_queue(st, "T", 1) == bodies
    with MessageStore.open(str(root), cfg(), read_only=True) as st:
        assert read_queue(st, "T", 1) == bodies


def test_a_lost_queue_directory_is_rebuilt_from_the_records_the_tier_holds_too(tmp_path):
    """Store model seed 60024 (all ops): a consume-queue directory removed after retention had deleted the local
    copy of a segment the tier holds was rebuilt from the local segments only: the units of the records only the
    tier holds were written blank and a read there answered OFFSET_FOUND_NULL, skipping acknowledged messages."""
    root, _tier, cfg, bodies = _tiered_store_with_a_torn_queue_file(tmp_path)
    shutil.rmtree(root / "consumequeue" / "T")
    with MessageStore.open(str(root), cfg()) as st:
        assert read_queue(st, "T", 1) == bodies
    with MessageStore.open(str(root), cfg(), read_only=True) as st:
        assert read_queue(st, "T", 1) == bodies


@pytest.mark.parametrize("lost", ["bucket", "bucket-and-local"])
def test_a_torn_queue_file_is_never_rebuilt_blank_while_the_tier_manifest_is_lost(tmp_path, lost):
    """As above, with the tier's ``tier.json`` lost (and, in one case, the store's local copy too) when the
    torn queue file is found: a read-only open is refused naming the torn file and touches nothing; a writable open
    puts the manifest back first (from the local copy, or rebuilt from the tier's objects), then places the
    units of the records only the tier holds from it; never written blank (missing is not empty).  Before, the
    writable open was refused as well, and nothing short of restoring tier.json by hand opened the store."""
    root, tier, cfg, bodies = _tiered_store_with_a_torn_queue_file(tmp_path)
    manifests = list(tier.rglob("tier.json"))
    assert manifests, "the bucket holds a tier.json"
    for p in manifests:
        p.unlink()
    if lost == "bucket-and-local":
        for p in (root / "config").glob("tierManifest.json*"):
            p.unlink()
    before = _tree_bytes(root)
    with pytest.raises(StoreError, match="consumequeue/T/1/.*150 bytes"):
        MessageStore.open(str(root), cfg(), read_only=True)
    assert _tree_bytes(root) == before, "a refused read-only open changed the store"
    with MessageStore.open(str(root), cfg()) as st:
        assert read_queue(st, "T", 1) == bodies
    assert list(tier.rglob("tier.json")), "the writable open republished the manifest"
    with MessageStore.open(str(root), cfg(), read_only=True) as st:
        assert read_queue(st, "T", 1) == bodies


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
