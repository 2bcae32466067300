"""Issue 24 item 10 (and the pyarrow line of item 15): a tier is never read as empty.

"Missing is not empty": the manifest carries a generation that only grows, the store keeps the highest it
published and how far it deleted local segments on the manifest's word (config/tierStore.json).  An unmounted
``file://`` directory, a lost ``tier.json``, an older one, or a lost local copy with the tier down make reads
below the local disk fail with an error naming the manifest or object, never OFFSET_TOO_SMALL; a lost
``tier.json`` whose objects are all there is republished by ``tier upload``.  Objects are fsynced and checked
by CRC-32 read back before the manifest lists them (and so before retention may delete the local file).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from rocketstore import GetMessageStatus, MessageStore
from rocketstore.errors import ConfigError, StoreError
from rocketstore.tier.manifest import MANIFEST
from rocketstore.tier.upload import upload_round
from conftest import GOLDEN_CONF, REPO, copy_store, golden_expected, golden_store, run_cli

SEG = 1048576
EXPECTED = golden_expected("basic")
QUEUES = sorted({(e["topic"], e["queueId"]) for e in EXPECTED})


def _free_local(store: MessageStore) -> None:
    for _ in range(10):
        store.clean_service.request_manual_delete()
        store.clean_service.clean_commitlog()
        store.clean_service.clean_consume_queues()


def _tiered(tmp_path: Path, *, upload: bool = True) -> tuple[Path, Path]:
    """Golden basic with a file:// tier: its 3 sealed segments uploaded and deleted locally."""
    store = copy_store(golden_store("basic"), tmp_path / "store")
    tier = tmp_path / "tier"
    (store / "broker.conf").write_text(GOLDEN_CONF + f"tieredStoreUri=file://{tier}\nfileReservedTime=0\n"
                                       "tieredStoreFileReservedTime=0\n")
    if upload:
        with MessageStore.open(str(store), start_services=False) as s:
            done = upload_round(s.files)
            assert done["segments"] == 3
            _free_local(s)
            assert s.min_phy_offset() == 3 * SEG
    return store, tier


def _read_all(store: MessageStore) -> list[tuple[str, int, int, int]]:
    """Every message by get, from each queue's minimum: (topic, queue, queue offset, commitlog offset)."""
    got = []
    for topic, qid in QUEUES:
        off = store.min_offset_in_queue(topic, qid)
        while (r := store.get(topic, qid, off, 32)).messages:
            got += [(topic, qid, m.queue_offset, m.commit_log_offset) for m in r.messages]
            off = r.next_begin_offset
    return sorted(got)


ALL = sorted((e["topic"], e["queueId"], e["queueOffset"], e["commitLogOffset"]) for e in EXPECTED)


def _reads_below_local_fail(store: MessageStore, match: str) -> None:
    """Each queue still starts at 0, and reading there raises (naming ``match``), never OFFSET_TOO_SMALL."""
    for topic, qid in QUEUES:
        lo = store.min_offset_in_queue(topic, qid)
        assert lo == 0, (topic, qid, lo)
        with pytest.raises(StoreError, match=match):
            r = store.get(topic, qid, 0, 32)
            pytest.fail(f"{topic}-{qid} @0 answered {r.status} instead of raising")


def test_unmounted_tier_directory_is_an_error_not_an_empty_tier(tmp_path):
    store_path, tier = _tiered(tmp_path)
    tier.rename(tmp_path / "tier.unmounted")
    with MessageStore.open(str(store_path), read_only=True) as store:
        _reads_below_local_fail(store, "does not exist")
        assert "does not exist (not mounted?)" in store.tier.error
        with pytest.raises(StoreError, match="commitlog/00000000000000000000"):
            store.look(0)
    r = run_cli("dump", store_path)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and b"does not exist" in r.stderr
    # A writable open (its upload round) must not write into the empty mount point.
    r = run_cli("tier", "upload", store_path)
    assert r.returncode == 2 and b"does not exist" in r.stderr
    with MessageStore.open(str(store_path), start_services=False) as store:
        with pytest.raises(StoreError, match="does not exist"):
            upload_round(store.files)
        _free_local(store)
        assert len(store.commitlog.queue.files) == 1
    assert not tier.exists()
    (tmp_path / "tier.unmounted").rename(tier)  # mounted again: everything reads
    with MessageStore.open(str(store_path), read_only=True) as store:
        assert store.tier.error is None
        assert _read_all(store) == ALL


def test_lost_tier_json_is_an_error_then_republished_from_the_local_copy(tmp_path):
    store_path, tier = _tiered(tmp_path)
    before = json.loads((tier / MANIFEST).read_bytes())
    (tier / MANIFEST).unlink()
    with MessageStore.open(str(store_path), read_only=True) as store:
        _reads_below_local_fail(store, f"{MANIFEST} is missing")
    r = run_cli("dump", store_path)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and b"tier.json is missing" in r.stderr
    r = run_cli("tier", "upload", store_path)
    assert r.returncode == 0, r.stderr
    after = json.loads((tier / MANIFEST).read_bytes())
    assert after["generation"] > before["generation"]
    assert after["commitlog"] == before["commitlog"] and after["consumequeue"] == before["consumequeue"]
    with MessageStore.open(str(store_path), read_only=True) as store:
        assert store.tier.error is None
        assert _read_all(store) == ALL
    assert len([line for line in run_cli("dump", store_path).stdout.splitlines()]) == len(EXPECTED)


def test_lost_tier_json_with_an_object_missing_is_not_republished(tmp_path):
    store_path, tier = _tiered(tmp_path)
    (tier / MANIFEST).unlink()
    (tier / "commitlog" / "00000000000001048576").unlink()
    r = run_cli("tier", "upload", store_path)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1
    assert b"commitlog/00000000000001048576 is missing" in r.stderr
    assert not (tier / MANIFEST).exists()


def test_lost_tier_json_with_an_altered_object_still_local_is_not_republished(tmp_path):
    """Republishing lets retention delete the local copies of what the manifest lists: a segment still on
    local disk must match its object by CRC-32 (an object altered in place, same size, does not)."""
    store_path, tier = _tiered(tmp_path, upload=False)
    with MessageStore.open(str(store_path), start_services=False) as s:
        upload_round(s.files)
    (tier / MANIFEST).unlink()
    seg = tier / "commitlog" / "00000000000000000000"
    data = bytearray(seg.read_bytes())
    data[5000] ^= 1
    seg.write_bytes(bytes(data))
    r = run_cli("tier", "upload", store_path)
    assert r.returncode == 2 and b"CRC-32" in r.stderr and not (tier / MANIFEST).exists()
    with MessageStore.open(str(store_path), start_services=False) as s:
        reads = []
        real = s.tier.objects.checksum
        s.tier.objects.checksum = lambda key: reads.append(key) or real(key)
        # The open tried to republish and read the object back once; the upload service's rounds keep that
        # verdict (the tier is not read back every round).
        for _ in range(3):
            with pytest.raises(StoreError, match="CRC-32"):
                upload_round(s.files)
        assert reads == []
        _free_local(s)
        assert len(s.commitlog.queue.files) == 4  # the good local copies stay


def test_damaged_local_copy_with_the_tier_down_tries_the_bak_and_fails_reads(tmp_path):
    store_path, tier = _tiered(tmp_path)
    local = store_path / "config" / "tierManifest.json"
    assert (store_path / "config" / "tierManifest.json.bak").exists()  # several publishes: a .bak is kept
    local.write_text("not json")
    tier.rename(tmp_path / "tier.down")
    with MessageStore.open(str(store_path), read_only=True) as store:
        assert store.tier.manifest is not None  # the .bak says what the tier holds: queue minimums stay at 0
        _reads_below_local_fail(store, "does not exist|generation")
    # The .bak lost too: nothing says what the tier holds, yet the store knows it published there.
    (store_path / "config" / "tierManifest.json.bak").unlink()
    with MessageStore.open(str(store_path), read_only=True) as store:
        assert store.tier.fault is not None
        _reads_below_local_fail(store, "tierManifest.json")
        assert store.min_readable_offset() == 0
        with pytest.raises(StoreError, match="tierManifest.json"):
            store.look(0)
    r = run_cli("dump", store_path)  # not a dump of the local segments alone, exit 0
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and b"tierManifest.json" in r.stderr
    (tmp_path / "tier.down").rename(tier)  # the tier is back: its tier.json is trusted again
    with MessageStore.open(str(store_path), read_only=True) as store:
        assert store.tier.error is None and _read_all(store) == ALL
    with MessageStore.open(str(store_path), start_services=False):
        pass  # a writable open puts the local copy back
    assert json.loads(local.read_bytes()) == json.loads((tier / MANIFEST).read_bytes())


def test_an_older_or_emptied_tier_json_is_damage(tmp_path):
    """A tier.json of an earlier generation (a restored copy), or one not listing segments the store deleted
    locally on the manifest's word, is refused: reads raise, `tier upload` republishes the store's own."""
    store_path, tier = _tiered(tmp_path, upload=False)
    with MessageStore.open(str(store_path), start_services=False) as store:
        upload_round(store.files, max_segments=1)
        old = (tier / MANIFEST).read_bytes()
        upload_round(store.files)
        _free_local(store)
        assert store.min_phy_offset() == 3 * SEG
    good = (tier / MANIFEST).read_bytes()
    (tier / MANIFEST).write_bytes(old)
    with MessageStore.open(str(store_path), read_only=True) as store:
        _reads_below_local_fail(store, "an older manifest")
    assert json.loads(old)["generation"] < json.loads(good)["generation"]
    assert run_cli("tier", "upload", store_path).returncode == 0
    with MessageStore.open(str(store_path), read_only=True) as store:
        assert _read_all(store) == ALL

    emptied = json.loads(good)
    emptied.update(generation=10 ** 6, commitlog=[], consumequeue={}, index=[])
    (tier / MANIFEST).write_text(json.dumps(emptied))
    with MessageStore.open(str(store_path), read_only=True) as store:
        _reads_below_local_fail(store, "deleted its local segments below 3145728")


def test_file_tier_objects_and_manifest_are_fsynced(tmp_path, monkeypatch):
    """Each object and tier.json is fsynced, and so is the directory that names it."""
    store_path, tier = _tiered(tmp_path, upload=False)
    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    with MessageStore.open(str(store_path), start_services=False) as store:
        upload_round(store.files)
    # A rename follows the fsync of a temp file: the object's name, or its .tmp, was synced, then its directory.
    for rel in ("commitlog/00000000000000000000", "consumequeue/TopicA/0/00000000000000000000",
                MANIFEST):
        path = str(tier / rel)
        assert path in synced or path + ".tmp" in synced, rel
        assert os.path.dirname(path) in synced, rel
    assert str(tier) in synced  # the new commitlog/ directory's entry


class _CorruptingFs:
    """A pyarrow filesystem whose uploads of segments arrive with one byte changed (same size)."""

    def __init__(self, fs):
        self._fs = fs

    def __getattr__(self, name):
        return getattr(self._fs, name)

    def open_output_stream(self, path, *a, **kw):
        out = self._fs.open_output_stream(path, *a, **kw)
        if "/commitlog/" not in path:
            return out

        class Stream:
            first = True

            def write(self, data):
                if Stream.first and len(data) > 100:
                    data = bytearray(data)
                    data[100] ^= 0xFF
                    Stream.first = False
                return out.write(bytes(data))

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                out.close()

        return Stream()


def test_an_upload_is_checked_by_checksum_before_local_deletion(tmp_path, s3_server):
    store = copy_store(golden_store("basic"), tmp_path / "store")
    bucket = s3_server.new_bucket()
    conf = s3_server.conf(f"s3://{bucket}/x")
    (store / "broker.conf").write_text(GOLDEN_CONF + "".join(f"{k}={v}\n" for k, v in conf.items())
                                       + "fileReservedTime=0\ntieredStoreFileReservedTime=0\n")
    with MessageStore.open(str(store), start_services=False) as s:
        s.tier.objects.fs = _CorruptingFs(s.tier.objects.fs)
        with pytest.raises(StoreError, match="CRC-32"):
            upload_round(s.files)
        assert s.tier.manifest is None or not s.tier.manifest.commitlog
        _free_local(s)
        assert len(s.commitlog.queue.files) == 4  # nothing deleted on the word of a damaged upload
    assert len(run_cli("dump", store).stdout.splitlines()) == len(EXPECTED)


def test_without_pyarrow_a_tiered_store_is_one_line_error(tmp_path):
    """A plain `pip install .` has no pyarrow: a store with tieredStoreUri says to install the `tier` extra."""
    store_path, _ = _tiered(tmp_path, upload=False)
    fake = tmp_path / "nopyarrow" / "pyarrow"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'pyarrow'\", name='pyarrow')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake.parent), *filter(None, sys.path)]))
    for cmd in (["state"], ["get", "--topic", "TopicA", "--queue-id", "0", "--offset", "0"]):
        r = subprocess.run([sys.executable, "-m", "rocketstore", cmd[0], str(store_path), *cmd[1:]],
                           capture_output=True, env=env, timeout=120)
        assert r.returncode == 2, r.stderr.decode()[-2000:]
        assert len(r.stderr.splitlines()) == 1 and b"rocketstore[tier]" in r.stderr, r.stderr
    sys.modules.pop("pyarrow.fs", None)
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "pyarrow" or k.startswith("pyarrow.")}
    try:
        sys.modules["pyarrow"] = None  # import pyarrow raises ImportError
        with pytest.raises(ConfigError, match=r"rocketstore\[tier\]"):
            MessageStore.open(str(store_path), read_only=True)
    finally:
        del sys.modules["pyarrow"]
        sys.modules.update(saved)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("pyarrow") for d in extras.get("tier", []))


def test_a_running_store_republishes_a_lost_tier_json_and_reads_again(tmp_path):
    """The upload service of a running store sees tier.json gone, fails reads meanwhile, and puts it back
    (generation higher) once every object checks out; reads below the local disk then succeed."""
    store_path, tier = _tiered(tmp_path)
    with (store_path / "broker.conf").open("a") as fh:
        fh.write("tieredStoreUploadInterval=200\n")
    gen = json.loads((tier / MANIFEST).read_bytes())["generation"]
    with MessageStore.open(str(store_path)) as store:
        with store.tier.lock:  # the upload service waits: the fault is seen before it is repaired
            (tier / MANIFEST).unlink()
            store.tier.refresh(quiet=True)
            with pytest.raises(StoreError, match=f"{MANIFEST} is missing"):
                store.get("TopicA", 0, 0)
        deadline = time.time() + 30
        while not (tier / MANIFEST).exists() and time.time() < deadline:
            time.sleep(0.05)
        assert json.loads((tier / MANIFEST).read_bytes())["generation"] > gen
        while store.tier.fault is not None and time.time() < deadline:
            time.sleep(0.05)
        assert _read_all(store) == ALL


def test_tier_json_and_the_local_copy_lost_are_rebuilt_from_the_objects(tmp_path):
    """tier.json, config/tierManifest.json and its .bak all lost: reads fail naming the loss, and `tier upload`
    lists the tier's objects and publishes the same manifest again (generation higher)."""
    store_path, tier = _tiered(tmp_path)
    before = json.loads((tier / MANIFEST).read_bytes())
    for p in (tier / MANIFEST, store_path / "config" / "tierManifest.json",
              store_path / "config" / "tierManifest.json.bak"):
        p.unlink()
    with MessageStore.open(str(store_path), read_only=True) as store:
        _reads_below_local_fail(store, f"{MANIFEST} is missing")
    r = run_cli("tier", "upload", store_path)
    assert r.returncode == 0, r.stderr
    after = json.loads((tier / MANIFEST).read_bytes())
    assert after["generation"] > before["generation"]
    for k in ("commitlog", "consumequeue", "index", "storeId"):
        assert after[k] == before[k], k
    with MessageStore.open(str(store_path), read_only=True) as store:
        assert store.tier.error is None and _read_all(store) == ALL


def test_a_rebuild_refuses_a_tier_that_lacks_deleted_segments(tmp_path):
    store_path, tier = _tiered(tmp_path)
    for p in (tier / MANIFEST, store_path / "config" / "tierManifest.json",
              store_path / "config" / "tierManifest.json.bak", tier / "commitlog" / "00000000000002097152"):
        p.unlink()
    r = run_cli("tier", "upload", store_path)
    assert r.returncode == 2 and b"below 3145728" in r.stderr and len(r.stderr.splitlines()) == 1
    assert not (tier / MANIFEST).exists()


def test_on_s3_a_lost_tier_json_is_an_error_then_rebuilt(tmp_path, s3_server):
    store_path = copy_store(golden_store("basic"), tmp_path / "store")
    bucket = s3_server.new_bucket()
    conf = s3_server.conf(f"s3://{bucket}/p/q")
    (store_path / "broker.conf").write_text(GOLDEN_CONF + "".join(f"{k}={v}\n" for k, v in conf.items())
                                            + "fileReservedTime=0\ntieredStoreFileReservedTime=0\n")
    with MessageStore.open(str(store_path), start_services=False) as s:
        upload_round(s.files)
        _free_local(s)
    s3 = s3_server.client()
    before = json.loads(s3.get_object(Bucket=bucket, Key=f"p/q/{MANIFEST}")["Body"].read())
    s3.delete_object(Bucket=bucket, Key=f"p/q/{MANIFEST}")
    with MessageStore.open(str(store_path), read_only=True) as store:
        _reads_below_local_fail(store, f"{MANIFEST} is missing")
    for p in ("tierManifest.json", "tierManifest.json.bak"):
        (store_path / "config" / p).unlink()
    r = run_cli("tier", "upload", store_path)
    assert r.returncode == 0, r.stderr
    after = json.loads(s3.get_object(Bucket=bucket, Key=f"p/q/{MANIFEST}")["Body"].read())
    assert after["generation"] > before["generation"]
    assert [after[k] for k in ("commitlog", "consumequeue", "index")] == \
        [before[k] for k in ("commitlog", "consumequeue", "index")]
    with MessageStore.open(str(store_path), read_only=True) as store:
        assert _read_all(store) == ALL


def test_a_publish_cut_short_leaves_the_bucket_behind_and_nothing_deleted(tmp_path, monkeypatch):
    """The local copy and tierStore.json are written before tier.json: a publish that fails at the bucket
    leaves tier.json one generation behind, which is not trusted (nothing is deleted on it) until the next
    round republishes."""
    from rocketstore.tier.objectstore import ObjectStore, TierError
    store_path, tier = _tiered(tmp_path, upload=False)
    with MessageStore.open(str(store_path), start_services=False) as store:
        upload_round(store.files, max_segments=1)
        real = ObjectStore.put_bytes
        calls = []

        def flaky(self, key, data):
            calls.append(key)
            raise TierError(f"{self.loc.uri}: cannot write {key}: injected")

        monkeypatch.setattr(ObjectStore, "put_bytes", flaky)
        with pytest.raises(TierError, match="injected"):
            upload_round(store.files, max_segments=1)
        assert calls == [MANIFEST]
        _free_local(store)
        assert store.min_phy_offset() == 0  # while the bucket's manifest is in doubt, nothing is deleted
        monkeypatch.setattr(ObjectStore, "put_bytes", real)
    local = json.loads((store_path / "config" / "tierManifest.json").read_bytes())
    assert local["generation"] == json.loads((tier / MANIFEST).read_bytes())["generation"] + 1
    with MessageStore.open(str(store_path), read_only=True) as store:
        assert "an older manifest" in store.tier.fault
        assert _read_all(store) == ALL  # all still local: the tier's doubt blocks no local read
    assert run_cli("tier", "upload", store_path).returncode == 0
    with MessageStore.open(str(store_path), start_services=False) as store:
        _free_local(store)
        assert store.min_phy_offset() == 3 * SEG and _read_all(store) == ALL


def test_a_new_store_makes_its_file_tier_directory_once(tmp_path):
    """The first publish creates the tier's directory (even with nothing sealed yet); after that a missing
    directory is an unmounted disk, never made again."""
    from rocketstore.format.message import Message
    tier = tmp_path / "archive" / "broker-a"
    conf = tmp_path / "broker.conf"
    conf.write_text(f"tieredStoreUri=file://{tier}\nmappedFileSizeCommitLog=65536\n")
    with MessageStore.open(str(tmp_path / "store"), str(conf), start_services=False) as store:
        store.put(Message(topic="T", body=b"x"))
        upload_round(store.files)
        assert json.loads((tier / MANIFEST).read_bytes())["generation"] == 1
    (tier / MANIFEST).unlink()
    tier.rmdir()
    with MessageStore.open(str(tmp_path / "store"), str(conf), start_services=False) as store:
        with pytest.raises(StoreError, match="does not exist"):
            upload_round(store.files)
    assert not tier.exists()


def test_seeded_tier_faults_never_skip_an_acknowledged_message(tmp_path):
    """A seeded run of puts, upload rounds, retention, reopenings and tier faults (unmount and remount, tier.json
    deleted or replaced by an older one, the local copy damaged or lost).  After each step every acknowledged
    message reads back at its queue offset with its body, or the read raises naming the damage: never
    OFFSET_TOO_SMALL, NO_MESSAGE, FOUND_NULL or a skipped offset.  At the end, with the faults undone and one
    upload round, every message reads.  ROCKETSTORE_TIER_FAULT_STEPS sets the number of steps (default 60),
    ROCKETSTORE_TIER_FAULT_SEED the seed (default 19; 1-48 pass), ROCKETSTORE_TIER_FAULT_DEBUG prints each step.

    Reverted bugs the default seed finds (checked when written): refresh reading a missing tier.json as "no
    manifest" (OFFSET_TOO_SMALL at lose_tier_json); TieredStorage._doubt not checking the generation and
    localDeletedEnd (OFFSET_FOUND_NULL at old_tier_json); republish putting back a stale .bak as it is
    (OFFSET_TOO_SMALL after upload).  Seeds 2, 8 and 37 found a republish while the tier was unmounted, an
    empty tier refused as "not rebuilt", and the stale .bak."""
    import random
    from rocketstore.format.message import Message
    from rocketstore.tier.objectstore import TierError
    seed = int(os.environ.get("ROCKETSTORE_TIER_FAULT_SEED", "19"))
    steps = int(os.environ.get("ROCKETSTORE_TIER_FAULT_STEPS", "60"))
    rnd = random.Random(seed)
    tier = tmp_path / "tier"
    away = tmp_path / "tier.unmounted"
    root = str(tmp_path / "store")
    conf = tmp_path / "broker.conf"
    conf.write_text(f"tieredStoreUri=file://{tier}\nmappedFileSizeCommitLog=65536\nmappedFileSizeConsumeQueue=1000\n"
                    "maxHashSlotNum=100\nmaxIndexNum=400\nfileReservedTime=0\ntieredStoreFileReservedTime=0\n"
                    "tieredStoreUploadInterval=3600000\n")
    model: dict[tuple[str, int], list[bytes]] = {}
    old_manifests: list[bytes] = []
    local = Path(root) / "config" / "tierManifest.json"

    seen = {"errors": 0, "fromTier": 0}
    trail: list[str] = []  # the steps so far, for the failure message

    def check(store: MessageStore) -> None:
        local_min = store.min_phy_offset()
        for (topic, qid), bodies in model.items():
            off = 0
            while off < len(bodies):
                try:
                    r = store.get(topic, qid, off, 32)
                except StoreError:
                    seen["errors"] += 1
                    off += 1  # named damage: allowed; the next offset must still be reachable
                    continue
                seen["fromTier"] += sum(1 for m in r.messages if m.commit_log_offset < local_min)
                assert r.status == GetMessageStatus.FOUND, (f"seed {seed} step {trail[-1:]}", topic, qid, off, r.status,
                                                            len(bodies), store.min_phy_offset(), store.tier.error,
                                                            store.min_offset_in_queue(topic, qid), trail)
                for i, m in enumerate(r.messages):
                    assert (m.queue_offset, m.body) == (off + i, bodies[off + i])
                assert r.next_begin_offset == off + len(r.messages)
                off = r.next_begin_offset

    def open_writable() -> MessageStore:
        """With the dispatcher running (puts reach the consume queues), but no background upload round:
        the run's rounds are its own steps, so a seed replays the same way."""
        from rocketstore.tier.upload import TierUploadService
        s = MessageStore.open(root, str(conf))
        for svc in s._services:
            if isinstance(svc, TierUploadService):
                svc.shutdown()
        return s

    store = open_writable()
    try:
        for step in range(steps):
            op = rnd.choice(["put"] * 4 + ["upload"] * 4 + ["free"] * 2 + ["remount"] * 3 +
                            ["reopen", "unmount", "lose_tier_json", "old_tier_json", "damage_local", "lose_local"])
            trail.append(op)
            if op == "put":
                for _ in range(rnd.randint(100, 800)):
                    key = (f"T{rnd.randint(0, 2)}", rnd.randint(0, 1))
                    body = f"{step}-{rnd.random()}".encode() * rnd.randint(1, 8)
                    r = store.put(Message(topic=key[0], body=body, queue_id=key[1]))
                    assert r.queue_offset == len(model.setdefault(key, []))
                    model[key].append(body)
                store.commitlog.flush(0)
                store.wait_dispatched()
            elif op == "upload":
                try:
                    upload_round(store.files)
                except (TierError, StoreError):
                    pass  # a tier fault: the round refuses, and nothing is deleted on its word
                if (tier / MANIFEST).exists():
                    old_manifests.append((tier / MANIFEST).read_bytes())
                if rnd.random() < 0.7:
                    _free_local(store)
            elif op == "free":
                _free_local(store)
            elif op == "reopen":
                store.close()
                with MessageStore.open(root, str(conf), read_only=True) as ro:
                    check(ro)
                store = open_writable()
            elif op == "unmount" and tier.exists():
                tier.rename(away)
            elif op == "remount" and away.exists():
                away.rename(tier)
            elif op == "lose_tier_json" and (tier / MANIFEST).exists():
                (tier / MANIFEST).unlink()
            elif op == "old_tier_json" and old_manifests and tier.exists():
                (tier / MANIFEST).write_bytes(rnd.choice(old_manifests))
            elif op == "damage_local" and local.exists():
                local.write_text("{")
            elif op == "lose_local":
                for p in (local, Path(f"{local}.bak")):
                    if p.exists():
                        p.unlink()
            store.tier.refresh(quiet=True)
            check(store)
            if os.environ.get("ROCKETSTORE_TIER_FAULT_DEBUG"):
                print(step, op, store.min_phy_offset(), store.tier.error, seen)
        # Undo what can be undone; one round republishes or rebuilds tier.json; then everything reads.
        if away.exists():
            away.rename(tier)
        if tier.exists():
            store.tier.refresh(quiet=True)
            try:
                upload_round(store.files)
            except TierError as e:  # a republish refused (e.g. an old tier.json and no local copy): say why
                pytest.fail(f"seed {seed}: the final round failed: {e}")
        store.tier.refresh(quiet=True)
        assert store.tier.fault is None, store.tier.fault
        for (topic, qid), bodies in model.items():
            got, off = [], 0
            while (r := store.get(topic, qid, off, 32)).messages:
                got += [m.body for m in r.messages]
                off = r.next_begin_offset
            assert got == bodies, (topic, qid)
        if seed == 19:  # the default run reaches what it is about: reads from the tier, and refused under faults
            assert store.min_phy_offset() > 0 and seen["fromTier"] > 0 and seen["errors"] > 0, seen
    finally:
        store.close()


def test_no_republish_while_the_tier_cannot_be_reached(tmp_path):
    """tier.json lost, then the directory unmounted: the open and the round must not check objects they cannot
    see (and remember that as the verdict); once remounted, the next round republishes."""
    store_path, tier = _tiered(tmp_path)
    (tier / MANIFEST).unlink()
    with MessageStore.open(str(store_path), start_services=False, read_only=True) as store:
        assert store.tier.republishable
    tier.rename(tmp_path / "away")
    with MessageStore.open(str(store_path), start_services=False) as store:
        assert store.tier.error is not None and not store.tier.republishable
        with pytest.raises(StoreError, match="does not exist"):
            upload_round(store.files)
        (tmp_path / "away").rename(tier)
        upload_round(store.files)
        assert store.tier.fault is None and _read_all(store) == ALL


def test_a_stale_local_copy_is_not_republished_as_it_is(tmp_path):
    """tier.json lost and the local copy damaged: its .bak is one generation old and lacks the queue files the
    last round added (and retention deleted locally on that round's word).  Putting the .bak back would hide
    them: the manifest is rebuilt from the tier's objects instead."""
    store_path, tier = _tiered(tmp_path)
    before = json.loads((tier / MANIFEST).read_bytes())
    bak = json.loads((store_path / "config" / "tierManifest.json.bak").read_bytes())
    assert bak["consumequeue"] != before["consumequeue"]
    (tier / MANIFEST).unlink()
    (store_path / "config" / "tierManifest.json").write_text("{")
    r = run_cli("tier", "upload", store_path)
    assert r.returncode == 0, r.stderr
    after = json.loads((tier / MANIFEST).read_bytes())
    assert [after[k] for k in ("commitlog", "consumequeue", "index")] == \
        [before[k] for k in ("commitlog", "consumequeue", "index")]
    with MessageStore.open(str(store_path), read_only=True) as store:
        assert _read_all(store) == ALL
