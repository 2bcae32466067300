"""Consume queues after retention (issue #24 round 2, the model test's ``cq_damage`` findings).

Retention removes the oldest segments and the consume-queue files whose units all point into them; what is
left must still tell the truth.  A unit after the last expired one that was blanked or damaged is damage (its
record is still in the commitlog), not OFFSET_TOO_SMALL / MESSAGE_WAS_REMOVING; and a queue whose records
expired keeps its offsets: the next put never reuses one (data-safety rules 2 and 4).
"""

from __future__ import annotations

import os
import shutil
import struct
import time
from pathlib import Path

import pytest

from rocketstore import GetMessageStatus, Message, MessageStore
from rocketstore.config import StoreConfig
from rocketstore.storage.consume_queue import CQ_STORE_UNIT_SIZE, PRE_BLANK_UNIT
from rocketstore.errors import CorruptRecordError, StoreLoadError

SEGMENT = 64 * 1024
CQ_FILE = 200  # ten units a consume-queue file


def _config(**kw) -> StoreConfig:
    return StoreConfig(mappedFileSizeCommitLog=SEGMENT, mappedFileSizeConsumeQueue=CQ_FILE, flushDiskType="SYNC_FLUSH",
                       maxHashSlotNum=100, maxIndexNum=400, **kw)


def _fill(path: Path, n: int, lead: int = 0) -> list:
    """``n`` messages of one size (some 200 a segment) alternating over queues Q-0 and Q-1, the first ``lead``
    to Q-1 only; the put results of Q-0's, in queue order."""
    q0 = []
    with MessageStore.open(str(path), _config()) as store:
        for i in range(n):
            qid = 1 if i < lead else (i - lead) % 2
            r = store.put(Message("Q", f"{i:05d}".encode() * 50, queue_id=qid, keys=f"k{i:05d}", tags="TagA"))
            assert r.ok
            if qid == 0:
                q0.append(r)
    return q0


def _expire_first_segments(path: Path, k: int) -> int:
    """Retention, the way RocketMQ's clean service does it: the first ``k`` segments are older than
    fileReservedTime and go, with the consume-queue files whose units all point into them; the new minimum."""
    segs = sorted((path / "commitlog").iterdir())
    old = time.time() - 3 * 3600
    for s in segs[:k]:
        os.utime(s, (old, old))
    with MessageStore.open(str(path), _config(fileReservedTime=1, deleteCommitLogFilesInterval=0)) as store:
        for _ in range(3):
            store.delete_expired_commit_log()
        assert store.min_phy_offset() == int(segs[k].name)
        return store.min_phy_offset()


def _set_unit(path: Path, topic: str, qid: int, index: int, unit: bytes) -> bytes:
    """Overwrite unit ``index`` of a queue's files with ``unit``; return what it was."""
    f = path / "consumequeue" / topic / str(qid) / f"{index * CQ_STORE_UNIT_SIZE // CQ_FILE * CQ_FILE:020d}"
    data = bytearray(f.read_bytes())
    p = index * CQ_STORE_UNIT_SIZE % CQ_FILE
    was = bytes(data[p:p + CQ_STORE_UNIT_SIZE])
    data[p:p + CQ_STORE_UNIT_SIZE] = unit
    f.write_bytes(bytes(data))
    return was


def _first_kept(rs: list, min_phy: int) -> int:
    return next(r.queue_offset for r in rs if r.commit_log_offset >= min_phy)


def _read_all(store: MessageStore, topic: str, qid: int, start: int) -> list:
    out, off = [], start
    while off < store.max_offset_in_queue(topic, qid):
        r = store.get(topic, qid, off, 32)
        assert r.status is GetMessageStatus.FOUND, (off, r.status)
        out += r.messages
        off = r.next_begin_offset
    return out


# ---------------------------------------------------------------- a damaged unit just after the expired ones

def _lead_for(tmp_path: Path, residue: int) -> int:
    """How many Q-1 messages to put first so that Q-0's first unit in the second segment is ``residue`` modulo
    the units of a consume-queue file (every record has one size; a record fits while 8 bytes stay for the
    segment's blank end record)."""
    q0 = _fill(tmp_path / "probe", 4)
    size = (q0[1].commit_log_offset - q0[0].commit_log_offset) // 2
    n = (SEGMENT - 8) // size  # records in a segment
    per_file = CQ_FILE // CQ_STORE_UNIT_SIZE
    return next(lead for lead in range(2 * per_file) if -(-(n - lead) // 2) % per_file == residue)


def _expired_then_blanked(tmp_path: Path, residue: int = 3, blank: tuple[int, ...] = (0,)
                          ) -> tuple[Path, list, int]:
    """A store whose first segment expired; Q-0's first kept unit ``i`` (its record intact in the second
    segment) is ``residue`` modulo the units of a file (0: it begins a consume-queue file and the file before it
    was deleted by retention, so that no unit before it is left to judge it by); the units ``i + d`` for ``d``
    in ``blank`` are blanked."""
    path = tmp_path / "s"
    q0 = _fill(path, 400, _lead_for(tmp_path, residue))
    min_phy = _expire_first_segments(path, 1)
    i = _first_kept(q0, min_phy)
    assert q0[i - 1].commit_log_offset < min_phy <= q0[i].commit_log_offset
    assert i % (CQ_FILE // CQ_STORE_UNIT_SIZE) == residue
    if residue == 0:
        assert not (path / "consumequeue" / "Q" / "0" / f"{(i - 1) * CQ_STORE_UNIT_SIZE // CQ_FILE * CQ_FILE:020d}"
                    ).exists()
    for d in blank:
        _set_unit(path, "Q", 0, i + d, PRE_BLANK_UNIT)
    return path, q0, i


@pytest.mark.parametrize("read_only", [True, False])
def test_a_blank_unit_after_the_expired_ones_is_not_offset_too_small(tmp_path, read_only):
    """Model seed 6013 (``cq_damage`` blank after ``retention``): the unit after the last expired one was
    blanked; the open moved the queue's minimum past it (its offset 0 lies below the commitlog minimum) and
    ``get`` answered OFFSET_TOO_SMALL for an intact record.  Its record is found (or the read names the
    damage), and every message after it reads."""
    path, q0, i = _expired_then_blanked(tmp_path)
    with MessageStore.open(str(path), _config(), read_only=read_only) as store:
        assert store.min_offset_in_queue("Q", 0) == i
        r = store.get("Q", 0, i, 1)
        assert r.status is GetMessageStatus.FOUND
        assert (r.messages[0].queue_offset, r.messages[0].commit_log_offset) == (i, q0[i].commit_log_offset)
        got = _read_all(store, "Q", 0, i)
        assert [(m.queue_offset, m.commit_log_offset) for m in got] == \
            [(r.queue_offset, r.commit_log_offset) for r in q0[i:]]


def test_a_blank_unit_at_the_start_of_the_first_queue_file_reads_its_record(tmp_path):
    """The blank unit begins the queue's first file (retention deleted the file before it): no unit before it
    is left to judge it by, so the queue's first record in the commitlog does."""
    path, q0, i = _expired_then_blanked(tmp_path, residue=0)
    with MessageStore.open(str(path), _config(), read_only=True) as store:
        assert store.min_offset_in_queue("Q", 0) == i
        assert store.get("Q", 0, i, 1).messages[0].commit_log_offset == q0[i].commit_log_offset


@pytest.mark.parametrize("lost", ["body", "queue-offset"])
def test_a_blank_unit_whose_record_is_lost_after_the_expired_ones_names_the_damage(tmp_path, lost):
    """The same blank unit with its record damaged as well: the read names the damage, never answers
    OFFSET_TOO_SMALL or MESSAGE_WAS_REMOVING, and the next offset reads."""
    path, q0, i = _expired_then_blanked(tmp_path)
    phy = q0[i].commit_log_offset
    seg = path / "commitlog" / f"{phy // SEGMENT * SEGMENT:020d}"
    with open(seg, "r+b") as fh:
        if lost == "body":
            fh.seek(phy % SEGMENT + 4)  # MAGICCODE: the record no longer decodes
            fh.write(b"\xde\xad\xbe\xef")
        else:
            fh.seek(phy % SEGMENT + 20)  # QUEUEOFFSET (no CRC covers it)
            fh.write(struct.pack(">q", 10 ** 6))
    with MessageStore.open(str(path), _config(), read_only=True) as store:
        assert store.min_offset_in_queue("Q", 0) <= i
        with pytest.raises(CorruptRecordError, match=rf"Q/0 offset {i} .*blank unit"):
            store.get("Q", 0, i, 32)
        assert store.get("Q", 0, i + 1, 1).messages[0].queue_offset == i + 1


def test_blank_units_whose_records_expired_read_as_removed(tmp_path):
    """Blank units standing for records retention removed (the last expired ones): not damage."""
    path, q0, i = _expired_then_blanked(tmp_path, residue=5, blank=(-1, -2))
    with MessageStore.open(str(path), _config(), read_only=True) as store:
        assert store.min_offset_in_queue("Q", 0) == i
        assert store.get("Q", 0, i - 1, 32).status is GetMessageStatus.OFFSET_TOO_SMALL
        got = _read_all(store, "Q", 0, i)
        assert [m.queue_offset for m in got] == [r.queue_offset for r in q0[i:]]


# ---------------------------------------------------------------- a queue whose records all expired keeps its offsets

def _quiet_queue_expired(tmp_path: Path) -> Path:
    """Quiet-0 got three messages at the start, Busy-0 the rest; retention removed the first segment, and with
    it every record of Quiet-0 (its last consume-queue file stays, as RocketMQ never deletes a queue's last)."""
    path = tmp_path / "s"
    with MessageStore.open(str(path), _config()) as store:
        for i in range(3):
            assert store.put(Message("Quiet", b"q%d" % i, queue_id=0)).queue_offset == i
        for i in range(300):
            assert store.put(Message("Busy", f"{i:05d}".encode() * 50, queue_id=0, keys=f"k{i}")).ok
    _expire_first_segments(path, 1)
    return path


@pytest.mark.parametrize("how", ["rm-cq", "verify-repair"])
def test_a_queue_whose_records_expired_never_hands_their_offsets_out_again(tmp_path, how):
    """Model seed 5002 (``retention`` then ``repair_int``) and 6013 with every op (``retention``, ``truncate``,
    ``rm_cq``): a queue rebuilt from the commitlog after its records expired (its directory lost, or rebuilt by
    ``verify --repair``) started at 0 again, and the next put took queue offset 0, which an expired message
    had: one queue offset given to two messages.  The registry keeps each queue's next offset, written before
    retention deletes a segment."""
    from conftest import run_cli
    path = _quiet_queue_expired(tmp_path)
    if how == "rm-cq":
        shutil.rmtree(path / "consumequeue" / "Quiet")
    else:  # a damaged record elsewhere: verify --repair rebuilds the consume queues from the commitlog
        seg = sorted((path / "commitlog").iterdir())[0]
        with MessageStore.open(str(path), _config(), read_only=True) as store:
            phy = store.get("Busy", 0, store.min_offset_in_queue("Busy", 0) + 3, 1).messages[0].commit_log_offset
        with open(seg, "r+b") as fh:
            fh.seek(phy - int(seg.name) + 100)  # a body byte
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 1]))
        r = run_cli("verify", "--repair", path)
        assert r.returncode in (0, 1), r.stderr.decode()
    with MessageStore.open(str(path), _config()) as store:
        assert store.max_offset_in_queue("Quiet", 0) in (0, 3)
        r = store.put(Message("Quiet", b"after", queue_id=0))
        assert r.ok and r.queue_offset == 3
        store.wait_dispatched()
        assert store.get("Quiet", 0, 3, 1).messages[0].body == b"after"
        assert store.get("Quiet", 0, 0, 1).status is GetMessageStatus.OFFSET_TOO_SMALL


# ---------------------------------------------------------------- the queue registry

@pytest.mark.parametrize("line", ["Busy-0 3", "Busy/x 3", "Busy/0 -4", "Busy/0 3 extra", "/0 3"])
def test_a_malformed_queue_registry_is_refused_naming_file_and_line(tmp_path, line):
    """A registry line that does not parse was skipped silently: a queue it named was forgotten (its lost
    directory read as an empty queue).  Now the open refuses, naming the file and the line, before any change."""
    from conftest import run_cli
    path = tmp_path / "s"
    _fill(path, 4)
    reg = path / "config" / "consumeQueues.registry"
    good = reg.read_text()
    assert good == "Q/0 0\nQ/1 0\n"  # (next offsets are written at an open and before retention)
    reg.write_text(good + line + "\n")
    with pytest.raises(StoreLoadError, match=r"consumeQueues\.registry line 3: .*damaged"):
        MessageStore.open(str(path), _config())
    r = run_cli("recover", path)
    assert r.returncode == 2 and b"consumeQueues.registry line 3" in r.stderr and b"Traceback" not in r.stderr
    assert reg.read_text() == good + line + "\n"


def test_the_queue_registry_is_written_only_when_it_changes(tmp_path, monkeypatch):
    """The registry was read back from disk on every write; it is kept in memory, and a put to a queue it
    already holds writes nothing."""
    import rocketstore.recovery.load as store_mod  # the queue registry is the loader's
    path = tmp_path / "s"
    _fill(path, 4)
    MessageStore.open(str(path), _config()).close()  # writes the queues' next offsets (2 and 2)
    writes = []
    real = store_mod.replace_file_durably
    monkeypatch.setattr(store_mod, "replace_file_durably", lambda p, data: (writes.append(p), real(p, data)))
    reads = []
    real_read = store_mod._read_utf8
    monkeypatch.setattr(store_mod, "_read_utf8", lambda p: (reads.append(p), real_read(p))[1])
    with MessageStore.open(str(path), _config()) as store:
        assert not [w for w in writes if w.endswith("consumeQueues.registry")]  # unchanged since the last open
        reads.clear()
        store.put(Message("Q", b"x", queue_id=0))
        store.put(Message("New", b"y", queue_id=0))
        store.wait_dispatched()
        assert len([w for w in writes if w.endswith("consumeQueues.registry")]) == 1  # the new queue only
        assert not [r for r in reads if r.endswith("consumeQueues.registry")]  # kept in memory, not read back
    assert (path / "config" / "consumeQueues.registry").read_text() == "New/0 0\nQ/0 2\nQ/1 2\n"


def test_a_read_only_open_names_a_lost_queue_directory(basic_copy):
    """``rm -r consumequeue/TopicC`` then a read-only open (``get``, a follower): the registry was read by
    writable opens only, so the reader answered NO_MESSAGE_IN_QUEUE for 604 messages in the commitlog.  It
    names the loss; ``recover`` rebuilds the queue and the same read returns the messages."""
    from conftest import run_cli
    MessageStore.open(str(basic_copy)).close()  # a writable open starts the registry from the directories
    shutil.rmtree(basic_copy / "consumequeue" / "TopicC")
    with MessageStore.open(str(basic_copy), read_only=True) as store:
        with pytest.raises(CorruptRecordError, match=r"consumequeue/TopicC/0: .*registry.*directory is gone"):
            store.get("TopicC", 0, 0, 4)
        with pytest.raises(CorruptRecordError, match="TopicC/0"):
            store.max_offset_in_queue("TopicC", 0)
        assert store.get("TopicA", 0, 0, 1).status is GetMessageStatus.FOUND  # other queues read
    r = run_cli("get", basic_copy, "--topic", "TopicC", "--queue-id", "0", "--offset", "0")
    assert r.returncode == 2 and b"directory is gone" in r.stderr and b"Traceback" not in r.stderr
    assert run_cli("recover", basic_copy).returncode == 0
    with MessageStore.open(str(basic_copy), read_only=True) as store:
        r = store.get("TopicC", 0, 0, 4)
        assert r.status is GetMessageStatus.FOUND and [m.queue_offset for m in r.messages] == [0, 1, 2, 3]
        assert store.max_offset_in_queue("TopicC", 0) == 604
