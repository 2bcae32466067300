"""Issue 19 item 2: tiered storage on an S3 API server (moto, a real HTTP server on 127.0.0.1).

Sealed segments, their consume-queue and index files go to s3://bucket/prefix; retention frees local disk only
for what the tier's manifest lists; get, look, query, dump and the CLI read old offsets from the bucket.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rocketstore import GetMessageStatus, MessageStore
from rocketstore.format.message import Message
from rocketstore.tier.manifest import MANIFEST
from rocketstore.tier.upload import upload_round
from conftest import GOLDEN_CONF, copy_store, golden_expected, golden_queries, golden_store, run_cli
from store.test_read_golden import DUMP_FIELDS

SMALL = dict(mappedFileSizeCommitLog=64 * 1024, mappedFileSizeConsumeQueue=20 * 50, maxHashSlotNum=100,
             maxIndexNum=400)


def _conf_file(path: Path, values: dict) -> Path:
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    return path


def _golden_tiered(tmp_path: Path, s3_server, name: str = "basic") -> tuple[Path, str, dict]:
    """A writable copy of a golden store with a broker.conf pointing at a new bucket."""
    store = copy_store(golden_store(name), tmp_path / "store")
    bucket = s3_server.new_bucket()
    conf = s3_server.conf(f"s3://{bucket}/stores/{name}")
    (store / "broker.conf").write_text(GOLDEN_CONF + "".join(f"{k}={v}\n" for k, v in conf.items())
                                       + "fileReservedTime=0\ntieredStoreFileReservedTime=0\n")
    return store, bucket, conf


def _free_local(store: MessageStore) -> None:
    """Run retention until it has nothing more to delete (fileReservedTime=0: everything sealed has expired)."""
    for _ in range(10):
        store.clean_service.request_manual_delete()
        store.clean_service.clean_commitlog()
        store.clean_service.clean_consume_queues()


def _dump(store_path: Path, *extra: str) -> list[dict]:
    r = run_cli("dump", store_path, *extra)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.decode().splitlines()]


def test_golden_store_reads_through_the_tier_after_retention(tmp_path, s3_server):
    """A Java-written store: its 3 sealed segments go up, are deleted locally, and every message still reads
    exactly as Java decoded it (dump, get, query), from a new process too."""
    store_path, bucket, _ = _golden_tiered(tmp_path, s3_server)
    expected = sorted(golden_expected("basic"), key=lambda e: e["commitLogOffset"])
    with MessageStore.open(str(store_path), start_services=False) as store:
        done = upload_round(store.files)
        assert done["segments"] == 3 and done["queueFiles"] > 0 and done["indexFiles"] == 1
        assert store.look(0).commit_log_offset == 0  # a read must release its segment, or retention waits
        _free_local(store)
        assert store.min_phy_offset() == 3 * 1048576  # only the active segment is left on disk
        assert store.min_readable_offset() == 0
    assert sorted(os.listdir(store_path / "commitlog")) == ["00000000000003145728"]
    keys = s3_server.keys(bucket)
    assert "stores/basic/commitlog/00000000000000000000" in keys and f"stores/basic/{MANIFEST}" in keys
    assert not any(k.startswith("stores/basic/commitlog/00000000000003145728") for k in keys)  # active: local only

    got = _dump(store_path)  # a new process: it learns the tier from STORE/broker.conf
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert {k: e[k] for k in DUMP_FIELDS} == g

    with MessageStore.open(str(store_path), read_only=True) as store:
        for (topic, qid) in sorted({(e["topic"], e["queueId"]) for e in expected}):
            want = [e for e in expected if (e["topic"], e["queueId"]) == (topic, qid)]
            assert store.min_offset_in_queue(topic, qid) == 0
            seen, off = [], 0
            while True:
                r = store.get(topic, qid, off, 32)
                if r.status != GetMessageStatus.FOUND:
                    assert r.status == GetMessageStatus.OFFSET_OVERFLOW_ONE, r.status
                    break
                seen += [(m.queue_offset, m.commit_log_offset, m.body_crc) for m in r.messages]
                off = r.next_begin_offset
            assert seen == [(e["queueOffset"], e["commitLogOffset"], e["bodyCrc"]) for e in want]
        for q in golden_queries("basic")["queryMessage"]:
            r = store.query(q["topic"], q["key"], q["maxNum"], q["begin"], q["end"])
            assert r.phy_offsets == q["resultPhyOffsets"], q
        first = store.look(0)
        assert first.msg_id == expected[0]["msgId"]


def test_retention_keeps_what_the_tier_does_not_hold(tmp_path, s3_server):
    """Unreachable tier, or a segment not yet uploaded: expired files stay on disk and nothing is lost."""
    store_path, bucket, conf = _golden_tiered(tmp_path, s3_server)
    down = dict(conf, objectStoreEndpoint="http://127.0.0.1:9")  # nothing listens on the discard port
    (store_path / "broker.conf").write_text(GOLDEN_CONF + "".join(f"{k}={v}\n" for k, v in down.items())
                                            + "fileReservedTime=0\ntieredStoreFileReservedTime=0\n")
    with MessageStore.open(str(store_path), start_services=False) as store:
        assert store.tier.error is not None and "127.0.0.1:9" in store.tier.error
        _free_local(store)
        assert len(store.commitlog.queue.files) == 4
    r = run_cli("tier", "status", store_path, "--format", "json")
    assert r.returncode == 1 and json.loads(r.stdout)["error"]

    # Reachable, but only the first segment uploaded: only it may go.
    (store_path / "broker.conf").write_text(GOLDEN_CONF + "".join(f"{k}={v}\n" for k, v in conf.items())
                                            + "fileReservedTime=0\ntieredStoreFileReservedTime=0\n")
    with MessageStore.open(str(store_path), start_services=False) as store:
        from rocketstore.tier import upload
        store.commitlog.flush(0)
        upload._upload_segments(store, store.tier.refresh() or store.tier.new_manifest(), max_segments=1)
        _free_local(store)
        assert store.min_phy_offset() == 1048576
    assert len(_dump(store_path)) == len(golden_expected("basic"))


def test_an_object_the_manifest_does_not_list_does_not_count(tmp_path, s3_server):
    """An upload cut short (object written, manifest not) must not let retention delete the local file."""
    store_path, bucket, conf = _golden_tiered(tmp_path, s3_server)
    s3 = s3_server.client()
    seg = (store_path / "commitlog" / "00000000000000000000").read_bytes()
    s3.put_object(Bucket=bucket, Key="stores/basic/commitlog/00000000000000000000", Body=seg)
    with MessageStore.open(str(store_path), start_services=False) as store:
        assert store.tier.manifest is None
        _free_local(store)
        assert len(store.commitlog.queue.files) == 4


def test_a_tier_of_another_store_or_geometry_is_refused(tmp_path, s3_server):
    store_path, bucket, conf = _golden_tiered(tmp_path, s3_server)
    with MessageStore.open(str(store_path), start_services=False) as store:
        upload_round(store.files)
    other = copy_store(golden_store("basic"), tmp_path / "other")
    (other / "broker.conf").write_text(GOLDEN_CONF + "".join(f"{k}={v}\n" for k, v in conf.items())
                                       + "fileReservedTime=0\n")
    with MessageStore.open(str(other), start_services=False) as store:
        assert "belongs to store" in store.tier.error
        with pytest.raises(Exception, match="belongs to store"):
            upload_round(store.files)
        _free_local(store)
        assert len(store.commitlog.queue.files) == 4  # nothing freed on another store's manifest
    r = run_cli("tier", "upload", other)
    assert r.returncode == 2 and b"belongs to store" in r.stderr and len(r.stderr.splitlines()) == 1

    small = tmp_path / "small"
    _conf_file(tmp_path / "small.conf", {**SMALL, **conf})
    with MessageStore.open(str(small), str(tmp_path / "small.conf"), start_services=False) as store:
        assert "mappedFileSizeCommitLog=1048576 in the tier" in store.tier.error


def test_background_upload_then_restart_reads_everything(tmp_path, s3_server):
    """The upload service runs by itself; after retention and a restart, get/query/dump reach every message."""
    bucket = s3_server.new_bucket()
    conf = _conf_file(tmp_path / "broker.conf", {**SMALL, **s3_server.conf(f"s3://{bucket}/live"),
                                                  "tieredStoreUploadInterval": 200, "fileReservedTime": 0,
                                                  "tieredStoreFileReservedTime": 0})
    root = str(tmp_path / "store")
    n = 3000
    with MessageStore.open(root, str(conf)) as store:
        for i in range(n):
            store.put(Message(topic=f"T{i % 3}", body=f"message {i} ".encode() * 8, queue_id=i % 2,
                              properties={"KEYS": f"k{i}"}))
        store.wait_dispatched()
        from rocketstore.tier.upload import wait_uploaded
        sealed_end = store.commitlog.queue.files[-1].file_from_offset
        assert wait_uploaded(store.files, sealed_end, timeout=60)
        _free_local(store)
        assert store.min_phy_offset() > 0
    with MessageStore.open(root, str(conf)) as store:
        assert store.min_phy_offset() > 0 and store.min_readable_offset() == 0
        bodies = []
        for t in range(3):
            for q in range(2):
                off = store.min_offset_in_queue(f"T{t}", q)
                assert off == 0
                while True:
                    r = store.get(f"T{t}", q, off, 32)
                    if not r.messages:
                        break
                    bodies += [m.body for m in r.messages]
                    off = r.next_begin_offset
        assert sorted(bodies) == sorted(f"message {i} ".encode() * 8 for i in range(n))
        for i in (0, 1, 777, n - 1):
            hits = store.query(f"T{i % 3}", f"k{i}").messages
            assert [m.body for m in hits] == [f"message {i} ".encode() * 8]
        assert sum(1 for x in store.messages() if x[2] is not None) == n
        assert store.offset_by_time("T0", 0, 0) == 0


def test_tier_status_cli(tmp_path, s3_server):
    store_path, bucket, _ = _golden_tiered(tmp_path, s3_server)
    r = run_cli("tier", "upload", store_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["uploaded"]["segments"] == 3
    r = run_cli("tier", "status", store_path, "--format", "json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    cl = next(x for x in st["files"] if x["kind"] == "commitlog")
    assert (cl["localOnly"], cl["both"], cl["tierOnly"]) == (1, 3, 0)
    assert st["sealedNotUploaded"] == 0 and st["endOffset"] == 3 * 1048576
    with MessageStore.open(str(store_path), start_services=False) as store:
        _free_local(store)
    st = json.loads(run_cli("tier", "status", store_path, "--format", "json").stdout)
    cl = next(x for x in st["files"] if x["kind"] == "commitlog")
    assert (cl["localOnly"], cl["both"], cl["tierOnly"]) == (1, 0, 3)
    r = run_cli("tier", "status", store_path)
    assert r.returncode == 0 and b"tierOnly" in r.stdout
    r = run_cli("tier", "status", golden_store("basic"))
    assert r.returncode == 2 and b"no tieredStoreUri" in r.stderr


def test_bad_tier_uri_is_a_config_error(tmp_path):
    r = run_cli("state", golden_store("basic"), "--config",
                _conf_file(tmp_path / "c.conf", {"tieredStoreUri": "ftp://x/y"}))
    assert r.returncode == 2 and b"tieredStoreUri=ftp://x/y" in r.stderr


def test_tier_retention_drops_the_oldest_segments(tmp_path, s3_server):
    """tieredStoreFileReservedTime: a tier segment goes once the next one's first record is older than the
    reserved time; queue minimums move past it and every later message still reads exactly."""
    store_path, bucket, conf = _golden_tiered(tmp_path, s3_server)
    with (store_path / "broker.conf").open("a") as fh:
        fh.write("tieredStoreFileReservedTime=1\n")
    expected = sorted(golden_expected("basic"), key=lambda e: e["commitLogOffset"])
    # The golden messages were stored days before the test runs: older than the one hour kept.
    with MessageStore.open(str(store_path), start_services=False) as store:
        done = upload_round(store.files)
        assert (done["segments"], done["expiredSegments"]) == (3, 2)  # the newest tier segment stays
        _free_local(store)  # the local copies of segments the tier dropped may go too
        assert store.min_phy_offset() == 3 * 1048576
        assert store.min_readable_offset() == 2 * 1048576
        keys = s3_server.keys(bucket)
        assert not any(k.endswith("commitlog/00000000000000000000") or k.endswith("commitlog/00000000000001048576")
                       for k in keys)
        for (topic, qid) in sorted({(e["topic"], e["queueId"]) for e in expected}):
            want = [e for e in expected if (e["topic"], e["queueId"]) == (topic, qid)
                    and e["commitLogOffset"] >= 2 * 1048576]
            lo = store.min_offset_in_queue(topic, qid)
            assert lo == want[0]["queueOffset"]
            assert store.get(topic, qid, lo - 1).status == GetMessageStatus.OFFSET_TOO_SMALL
            seen, off = [], lo
            while True:
                r = store.get(topic, qid, off, 32)
                if not r.messages:
                    break
                seen += [(m.queue_offset, m.commit_log_offset) for m in r.messages]
                off = r.next_begin_offset
            assert seen == [(e["queueOffset"], e["commitLogOffset"]) for e in want]
    got = _dump(store_path)
    assert [g["commitLogOffset"] for g in got] == [e["commitLogOffset"] for e in expected
                                                   if e["commitLogOffset"] >= 2 * 1048576]


def test_bucket_down_at_open_fails_reads_loudly_and_hides_nothing(tmp_path, s3_server):
    """Opened while the bucket cannot be reached, a store still knows (from config/tierManifest.json) what the
    tier holds: queue minimums stay at the tier's start and a read there is an error naming the object, never
    OFFSET_TOO_SMALL or a skipped message; once the bucket is back the same reads succeed."""
    store_path, bucket, conf = _golden_tiered(tmp_path, s3_server)
    with MessageStore.open(str(store_path), start_services=False) as store:
        upload_round(store.files)
        _free_local(store)
    good = (store_path / "broker.conf").read_text()
    (store_path / "broker.conf").write_text(good.replace(s3_server.endpoint, "http://127.0.0.1:9"))
    from rocketstore.errors import StoreError
    with MessageStore.open(str(store_path), read_only=True) as store:
        assert store.min_offset_in_queue("TopicA", 0) == 0
        with pytest.raises(StoreError, match="consumequeue/TopicA/0/"):
            store.get("TopicA", 0, 0)
        with pytest.raises(StoreError, match="commitlog/00000000000000000000"):
            store.look(0)
    r = run_cli("dump", store_path)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and b"commitlog/00000000000000000000" in r.stderr
    (store_path / "broker.conf").write_text(good)
    with MessageStore.open(str(store_path), read_only=True) as store:
        assert store.get("TopicA", 0, 0).status == GetMessageStatus.FOUND


def test_recovery_after_a_crash_keeps_units_that_point_into_the_tier(tmp_path, s3_server):
    """Abnormal recovery of a store whose older segments are only in the bucket: the consume-queue units that
    point there are kept (not truncated as dangling) and every message still reads."""
    store_path, bucket, conf = _golden_tiered(tmp_path, s3_server)
    expected = sorted(golden_expected("basic"), key=lambda e: e["commitLogOffset"])
    with MessageStore.open(str(store_path), start_services=False) as store:
        upload_round(store.files)
        _free_local(store)
    (store_path / "abort").write_bytes(b"")  # as a kill -9 leaves it
    with MessageStore.open(str(store_path)) as store:
        assert store.recovery_report.abnormal
        got = []
        for (topic, qid) in sorted({(e["topic"], e["queueId"]) for e in expected}):
            off = store.min_offset_in_queue(topic, qid)
            assert off == 0
            while (r := store.get(topic, qid, off, 32)).messages:
                got += [m.commit_log_offset for m in r.messages]
                off = r.next_begin_offset
        assert sorted(got) == [e["commitLogOffset"] for e in expected]


def test_a_malformed_manifest_is_refused_with_its_name_and_the_store_stays_readable(tmp_path, s3_server):
    """Garbage in the bucket's tier.json, or in the local copy: a read-only open still works on local data, the
    error names the file, nothing is deleted on the strength of it, and `tier status` exits 1 with one line.
    A writable open puts a manifest rebuilt from the tier's objects back before anything reads the tier."""
    store_path, bucket, conf = _golden_tiered(tmp_path, s3_server)
    with MessageStore.open(str(store_path), start_services=False) as store:
        upload_round(store.files)
    s3_server.client().put_object(Bucket=bucket, Key=f"stores/basic/{MANIFEST}", Body=b'{"format": "x"')
    (store_path / "config" / "tierManifest.json").write_text("not json")
    with MessageStore.open(str(store_path), start_services=False, read_only=True) as store:
        assert f"{MANIFEST}: bad tier manifest" in store.tier.error
        assert store.get("TopicA", 0, 0).status == GetMessageStatus.FOUND
    r = run_cli("tier", "status", store_path, "--format", "json")
    assert r.returncode == 1 and "bad tier manifest" in json.loads(r.stdout)["error"]
    assert len(_dump(store_path)) == len(golden_expected("basic"))
    with MessageStore.open(str(store_path), start_services=False) as store:
        assert store.tier.error is None, store.tier.error
        _free_local(store)
        assert store.get("TopicA", 0, 0).status == GetMessageStatus.FOUND
    assert len(_dump(store_path)) == len(golden_expected("basic"))
