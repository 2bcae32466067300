"""Issue 6 (and the disk guard of issue 10): expired-file cleaning and the disk-space guard."""

from __future__ import annotations

import json
import os
import time


from rocketstore import GetMessageStatus, Message, MessageStore, PutMessageStatus
from conftest import GOLDEN_CONF, golden_expected, run_cli

HOUR = 3600


def age_files(root, hours: float) -> None:
    t = time.time() - hours * HOUR
    for d, _dirs, files in os.walk(root):
        for f in files:
            os.utime(os.path.join(d, f), (t, t))


class Disk:
    """An injectable disk-usage reading."""

    def __init__(self, ratio: float = 0.5) -> None:
        self.ratio = ratio

    def __call__(self, path: str) -> float:
        return self.ratio


def open_store(path, disk=None, clock=time.time, **kw):
    sleeps = []
    store = MessageStore.open(str(path), clock=clock, disk_usage=disk or Disk(), sleep=sleeps.append,
                              start_services=False, **kw)
    return store, sleeps


def first_unit_at_or_above(expected, topic, qid, min_phy):
    units = sorted((e["queueOffset"], e["commitLogOffset"]) for e in expected
                   if (e["topic"], e["queueId"]) == (topic, qid) and e["cqUnit"])
    return next(q for q, off in units if off >= min_phy)


def test_manual_delete_of_expired_segments_and_queue_minimums(basic_copy):
    age_files(basic_copy, 100)
    expected = golden_expected("basic")
    store, sleeps = open_store(basic_copy)
    with store:
        deleted = store.delete_expired_commit_log()
        assert [os.path.basename(p) for p in deleted] == [f"{i * 1048576:020d}" for i in range(3)]
        assert sorted(os.listdir(basic_copy / "commitlog")) == ["00000000000003145728"]
        # deleteCommitLogFilesInterval between the 3 segments, deleteConsumeQueueFilesInterval after each of
        # the 7 queues that lost a file
        assert sleeps == [0.1] * 9
        assert store.min_phy_offset() == 3145728
        state = store.state()
        for q in state["queues"]:
            assert q["minOffsetInQueue"] == first_unit_at_or_above(expected, q["topic"], q["queueId"], 3145728)
        q = state["queues"][0]
        r = store.get(q["topic"], q["queueId"], 0, 32)
        assert (r.status, r.next_begin_offset) == (GetMessageStatus.OFFSET_TOO_SMALL, q["minOffsetInQueue"])
        r = store.get(q["topic"], q["queueId"], q["minOffsetInQueue"], 32)
        assert r.status is GetMessageStatus.FOUND and r.messages[0].commit_log_offset >= 3145728
        hot = store.query("TopicA", "hot-key", 64)
        assert hot.messages and all(m.commit_log_offset >= 3145728 for m in hot.messages)
        # consume-queue files wholly below the new minimum are gone (never the last one)
        assert not (basic_copy / "consumequeue/TopicC/0/00000000000000000000").exists()
        assert (basic_copy / "consumequeue/TopicC/0/00000000000000012000").exists()
        assert len(os.listdir(basic_copy / "index")) == 1  # the first index file ends below the minimum
    rows = [json.loads(x) for x in run_cli("dump", basic_copy, "--no-body").stdout.decode().splitlines()]
    assert rows[0]["commitLogOffset"] == 3145728
    assert len(rows) == sum(1 for e in expected if e["commitLogOffset"] >= 3145728)
    with MessageStore.open(str(basic_copy)) as store:  # recovery after cleaning
        assert store.min_phy_offset() == 3145728 and store.max_phy_offset() == 3711299
    assert run_cli("verify", basic_copy).returncode == 0


def test_nothing_is_deleted_before_its_time(basic_copy):
    hour = time.localtime().tm_hour
    age_files(basic_copy, 10)
    store, _ = open_store(basic_copy)
    with store:
        store.config.deleteWhen = f"{hour:02d}"
        assert store.clean_service.clean_commitlog() == []  # the hour matches but nothing is 72 h old
        age_files(basic_copy, 100)
        store.config.deleteWhen = str((hour + 1) % 24)
        assert store.clean_service.clean_commitlog() == []  # expired, but not the hour, no pressure
        store.config.deleteWhen = f"{(hour + 5) % 24};{hour:02d}"
        assert len(store.clean_service.clean_commitlog()) == 3


def test_deletion_stops_at_the_first_unexpired_segment(basic_copy):
    age_files(basic_copy, 100)
    fresh = time.time()
    os.utime(basic_copy / "commitlog" / "00000000000001048576", (fresh, fresh))
    store, _ = open_store(basic_copy)
    with store:
        assert [os.path.basename(p) for p in store.delete_expired_commit_log()] == ["00000000000000000000"]


def test_disk_pressure_deletes_unexpired_segments_and_guards_puts(basic_copy):
    disk = Disk(0.86)
    store, _ = open_store(basic_copy, disk)
    with store:
        assert len(store.clean_service.clean_commitlog()) == 3  # above 85 %: regardless of age
        disk.ratio = 0.912
        store.disk_guard.check()
        r = store.put(Message("TopicA", b"x"))
        assert r.status is PutMessageStatus.SERVICE_NOT_AVAILABLE
        assert "disk 91.2 % used (commitlog) > diskSpaceWarningLevelRatio 90 %" in r.error
        assert "disk 91.2 %" in store.state()["notWriteableReason"]
        disk.ratio = 0.70
        store.disk_guard.check()  # no restart needed
        assert store.put(Message("TopicA", b"x")).ok


def test_disk_min_free_bytes_rule(tmp_path):
    store, _ = open_store(tmp_path / "s", config=None)
    with store:
        store.config.diskMinFreeBytes = 10 ** 18
        store.disk_guard.check()
        r = store.put(Message("T", b"x"))
        assert r.status is PutMessageStatus.SERVICE_NOT_AVAILABLE and "diskMinFreeBytes" in r.error
        store.config.diskMinFreeBytes = 0
        store.disk_guard.check()
        assert store.put(Message("T", b"x")).ok


def test_disk_guard_service_runs_on_its_own_timer(tmp_path):
    disk = Disk(0.95)
    with MessageStore.open(str(tmp_path / "s"), disk_usage=disk) as store:
        deadline = time.time() + 5
        while store.running_flags.is_writeable() and time.time() < deadline:
            time.sleep(0.05)
        assert store.put(Message("T", b"x")).status is PutMessageStatus.SERVICE_NOT_AVAILABLE
        disk.ratio = 0.5
        deadline = time.time() + 5
        while not store.running_flags.is_writeable() and time.time() < deadline:
            time.sleep(0.05)
        assert store.put(Message("T", b"x")).ok


def test_a_segment_being_read_survives_until_released_or_forced(basic_copy):
    age_files(basic_copy, 100)
    now = [time.time()]
    store, _ = open_store(basic_copy, clock=lambda: now[0])
    with store:
        first, second, third = store.commitlog.queue.files[:3]
        assert first.hold() and second.hold()  # two readers
        head = bytes(first.mm[:4096])
        assert store.delete_expired_commit_log() == []
        # The name is gone at once (a crash now cannot bring the segment back); its reader still has the bytes.
        assert not os.path.exists(first.path) and bytes(first.mm[:4096]) == head
        assert store.commitlog.queue.files[0] is first  # listed until the last reader lets go
        r = store.get("TopicA", 1, 0, 1)  # a get on the file being deleted returns a status
        assert r.status in (GetMessageStatus.MESSAGE_WAS_REMOVING, GetMessageStatus.OFFSET_TOO_SMALL)
        assert store.min_phy_offset() == 1048576
        first.release()  # the first reader finishes: the next round deletes its file
        now[0] += 200
        assert store.clean_service.clean_commitlog() == [first.path]  # the second is still read
        assert first.closed and not os.path.exists(second.path) and not second.closed
        assert store.commitlog.queue.files[0] is second
        now[0] += 121  # destroyMapedFileIntervalForcibly has passed since the second was first asked to go
        assert store.clean_service.clean_commitlog() == [second.path, third.path]
        assert not os.path.exists(second.path)


def test_retention_dry_run_and_admin_command(basic_copy, tmp_path):
    age_files(basic_copy, 100)
    # Neither this machine's disk usage nor the hour the test runs at may trigger a deletion rule.
    conf = tmp_path / "quiet.conf"
    conf.write_text(GOLDEN_CONF + "diskMaxUsedSpaceRatio=100\ndiskSpaceCleanForciblyRatio=100\n"
                    f"diskSpaceWarningLevelRatio=100\ndeleteWhen={(time.localtime().tm_hour + 12) % 24:02d}\n")
    r = run_cli("retention", basic_copy, "--json", "--config", conf)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    segs = plan["segments"]
    assert [s["expired"] for s in segs] == [True] * 4
    assert [s["wouldDelete"] for s in segs] == [False] * 4  # expired, but waits for 04h / pressure / manual
    assert "last segment is never deleted" in segs[-1]["reason"]
    assert set(plan["disk"]) >= {"usedRatio", "diskMaxUsedSpaceRatio", "diskSpaceWarningLevelRatio"}
    (basic_copy / "config").mkdir()
    (basic_copy / "config" / "consumerOffset.json").write_text(json.dumps(
        {"offsetTable": {"TopicA@group1": {"0": 5}}}))
    r = run_cli("retention", basic_copy, "--config", conf)
    assert r.returncode == 0 and b"keep" in r.stdout
    r = run_cli("admin", "delete-expired", basic_copy)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["deleted"]) == 3
    assert sorted(os.listdir(basic_copy / "commitlog")) == ["00000000000003145728"]


def test_retention_warns_about_unconsumed_messages(basic_copy):
    (basic_copy / "config").mkdir()
    (basic_copy / "config" / "consumerOffset.json").write_text(json.dumps(
        {"offsetTable": {"TopicA@group1": {"0": 5}}}))
    store, _ = open_store(basic_copy, Disk(0.87))
    with store:
        from rocketstore.services.clean import retention_plan
        plan = retention_plan(store.files, store.clean_service)
        assert [s["wouldDelete"] for s in plan["segments"]] == [True, True, True, False]
        assert any("TopicA-0" in w for w in plan["warnings"])


def test_clean_service_schedule_and_clean_stop(tmp_path):
    cfg_store = MessageStore.open(str(tmp_path / "s"), disk_usage=Disk())
    svc = cfg_store.clean_service
    assert (svc.initial_delay, svc.interval) == (60.0, 10.0)  # first run 60 s after open, then cleanResourceInterval
    t = time.time()
    cfg_store.close()  # stops the service (sleeping in its initial delay) at once
    assert time.time() - t < 5 and svc.stopped
