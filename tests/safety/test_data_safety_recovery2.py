"""Issue 24, data-safety rule 2 (the commitlog is the truth; place, never append): a consume queue torn after
retention deleted the segments of its first units is rebuilt with every surviving record at its own queue
offset, and the next put takes a queue offset past every record's."""

from __future__ import annotations

from pathlib import Path

from rocketstore import GetMessageStatus, Message, MessageStore, StoreConfig

SEG = 32 * 1024


def _cfg() -> StoreConfig:
    return StoreConfig(mappedFileSizeCommitLog=SEG, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=64,
                       maxIndexNum=256, flushDiskType="SYNC_FLUSH", warmAheadBytes=0)


def test_a_torn_queue_whose_first_records_expired_is_rebuilt_at_its_own_offsets(tmp_path: Path):
    path = tmp_path / "s"
    acked: dict[int, bytes] = {}
    with MessageStore.open(str(path), config=_cfg()) as store:
        i = 0
        while store.commitlog.max_offset() < 2 * SEG + 2000:
            body = f"busy-{i}".encode() * 40
            r = store.put(Message("Busy", body, queue_id=0, tags="TagA"))
            acked[r.queue_offset] = body
            i += 1
    (path / "commitlog" / "00000000000000000000").unlink()  # retention deleted the first segment
    cq = path / "consumequeue" / "Busy" / "0" / "00000000000000000000"
    data = bytearray(cq.read_bytes())
    data[11 * 20:] = bytes(len(data) - 11 * 20)  # torn by a power cut from unit 11 on
    cq.write_bytes(bytes(data))
    (path / "abort").write_text("4242")
    (path / "abort.bootid").write_text("boot-before-the-power-cut")
    with MessageStore.open(str(path), config=_cfg()) as store:
        live = {q: b for q, b in acked.items()}
        checked = 0
        for q, body in sorted(live.items()):
            r = store.get("Busy", 0, q, 1)
            if r.status is GetMessageStatus.FOUND and r.messages[0].queue_offset == q:
                assert r.messages[0].body == body
                checked += 1
            else:  # only a record of the deleted segment may be gone
                assert r.status is not GetMessageStatus.OFFSET_OVERFLOW_BADLY, (q, r.status)
                assert q < min(k for k, v in live.items()
                               if store.get("Busy", 0, k, 1).status is GetMessageStatus.FOUND), q
        assert checked >= 10
        r = store.put(Message("Busy", b"next", queue_id=0))
        assert r.queue_offset == max(acked) + 1


def test_the_only_segment_torn_short_is_extended_not_a_contradiction(tmp_path: Path):
    """With mappedFileSizeCommitLog set explicitly, a store whose only segment a power cut left short (holding
    trusted records) is a torn last segment: recover extends it and keeps its intact records."""
    from conftest import run_cli
    path = tmp_path / "s"
    path.mkdir()
    (path / "broker.conf").write_text(f"mappedFileSizeCommitLog={SEG}\nmappedFileSizeConsumeQueue=6000\n")
    with MessageStore.open(str(path)) as store:
        offs = [store.put(Message("T", f"body-{i}".encode() * 10)).commit_log_offset for i in range(8)]
    seg = path / "commitlog" / "00000000000000000000"
    with open(seg, "r+b") as f:
        f.truncate(8192)
    assert offs[-1] < 8192
    (path / "abort").write_text("4242")
    (path / "abort.bootid").write_text("boot-before-the-power-cut")
    r = run_cli("recover", str(path))
    assert r.returncode == 0, r.stderr
    assert seg.stat().st_size == SEG
    with MessageStore.open(str(path), read_only=True) as store:
        got = store.get("T", 0, 0, 32)
        assert [m.body for m in got.messages] == [f"body-{i}".encode() * 10 for i in range(8)]


def test_a_registered_queue_whose_directory_vanished_is_rebuilt_before_the_first_put(tmp_path: Path):
    """Rule 4, missing is not empty: a queue whose records all lie before the segments recovery re-checks, its
    directory removed after a clean shutdown, is rebuilt from the commitlog by the first open (the store
    registers each queue it creates): reads find its messages, and a put never reuses its queue offsets."""
    import shutil
    path = tmp_path / "s"
    with MessageStore.open(str(path), config=_cfg()) as store:
        for i in range(3):
            store.put(Message("Rare", f"rare-{i}".encode(), queue_id=1))
        i = 0
        while store.commitlog.max_offset() < 6 * SEG:
            store.put(Message("Busy", f"busy-{i}".encode() * 40, queue_id=0))
            i += 1
    shutil.rmtree(path / "consumequeue" / "Rare")
    with MessageStore.open(str(path), config=_cfg()) as store:
        got = store.get("Rare", 1, 0, 8)
        assert [m.body for m in got.messages] == [f"rare-{i}".encode() for i in range(3)]
        assert store.put(Message("Rare", b"rare-3", queue_id=1)).queue_offset == 3
    registry = (path / "config" / "consumeQueues.registry").read_text().splitlines()
    assert [line.split(" ")[0] for line in registry] == ["Busy/0", "Rare/1"]  # TOPIC/QUEUEID NEXTOFFSET
