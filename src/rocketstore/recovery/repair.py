"""Offline repair: keep every trusted CommitLog record as it is, then rebuild the consume queues, index and checkpoint.

The CommitLog is the source of truth and repair never deletes or zeroes bytes
that hold a valid record.  It walks every segment with the full checks (magic,
TOTALSIZE, stored PHYSICALOFFSET equal to the position, body CRC).  Where a
record fails, it resynchronises on the next record that passes them all and
calls the bytes in between a *damaged span*.

What happens to a damaged span, and why.  Both walkers (rocketstore's recovery
and RocketMQ's ``checkMessageAndReturnSize`` loop) stop at the first record
that fails and truncate the log there, so a damaged record left in place would
cost every intact record after it at the next abnormal start.  A blank record
(``BLANK_MAGIC``) makes both walkers jump to the next *file*, so it is only
safe where nothing valid follows in that file.  Repair therefore rewrites only
the damaged span, in place, as complete records both walkers step over by
their TOTALSIZE:

* a **tombstone** for each lost message the old consume queues place in the
  span (from its start to the next one's): a record of the same topic, queue
  and QUEUEOFFSET, zero body, TAGS ``LOST_TAG`` and property ``LOST_PROPERTY``
  naming the quarantine directory.  It keeps the queue's offsets: RocketMQ
  clients commit ``QUEUEOFFSET + 1`` of what they consumed, so a queue whose
  later units moved down one offset (what dispatch does with a missing record)
  would make every consumer group past the loss skip a message at its next
  start.  A tag subscription never matches a tombstone; a ``*`` subscription
  receives it in place of the message that is gone.  Only queue offsets no
  surviving record holds get one;
* **filler records** for the rest when a valid record follows in the same
  file: CRC-valid records of topic ``FILLER_TOPIC``, ROLLBACK transaction type,
  zero body (pieces of at most ``MAX_FILLER_BYTES``).  Both dispatchers put
  ROLLBACK records in no consume queue and no index, so no consumer or key
  query sees them;
* **a blank record** after the last tombstone (or over the whole span) when
  nothing valid follows in a file that is not the last;
* **nothing** at the end of the last file: that is the log's torn tail, and
  the rebuild's recovery ends the log there, as RocketMQ would.

Without consume-queue knowledge (queue files lost, or a PREPARED/ROLLBACK
record) the span gets only fillers or a blank; the lost message's queue offset
is then a gap in the rebuilt queue (see below).  New records take the next
valid record's store time, so RocketMQ's abnormal recovery never starts later
because of them.  They carry no ``__CRC32#`` property: a broker run with
``forceVerifyPropCRC=true`` (off by default) would refuse them, as it refuses
every record written without ``enabledAppendPropCRC``.

**An intact record is never rewritten.**  A trusted record (magic, size,
PHYSICALOFFSET equal to its position, body CRC) keeps every byte, even when the
old consume-queue unit pointing at it names another topic, queue or queue
offset (no CRC covers those fields): the old unit is a cache and may be the
damaged one (two swapped units made an earlier version rewrite two intact
records).  Such records are reported as ``suspect``.

**Place, never append.**  The consume queues and the index are rebuilt from
one walk over the trusted records: each record's unit goes to its own queue
offset.  A queue offset no trusted record holds stays a gap (a blank unit,
reported under ``gaps``), so no later message moves to another offset.  A
record that cannot be placed without moving others (out of commitlog order
with its queue: two records claiming one offset, or a flipped offset field) or
whose offset lies further past the one before than the bytes between could
hold records is left out and reported under ``unplaced``; it stays in the
commitlog as it reads.

**A marker, then the old state or the new.**  Before anything changes,
``STORE/repair.json`` names the operation, its quarantine directory and the
segments it rewrites (written beside, fsynced, renamed, directory fsynced).
Each touched segment's original is kept in ``quarantine/repair-<ms>/commitlog/``
(a hard link) and its new content is written in ``quarantine/repair-<ms>/new/``
and renamed over it.  The queues and the index are built in that directory and
swapped in; the old ones, the checkpoint and an ``abort`` file are kept there
(old files that come out identical are dropped).  While the marker exists,
readers refuse the store and the next writable open (``rocketstore recover``,
or ``verify --repair``) rolls the repair back if it was still rewriting
segments, or finishes it: Ctrl-C or SIGKILL at any point leaves the old state
or the new.  ``report.json`` in the quarantine directory lists every damaged
span; ``verify`` lists such directories as ``kept``, not as problems.  Records
in a damaged span are lost: each is reported with its file, offset and reason
(and its queue and queue offset when the old consume queues knew it), and
repair's result is then not OK.
"""

from __future__ import annotations

import filecmp
import itertools
import json
import logging
import mmap
import os
import shutil
import struct
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

from ..format import codec
from ..config import StoreConfig
from ..storage.consume_queue import CQ_STORE_UNIT_SIZE
from ..errors import StoreError, StoreLoadError, StoreLockedError
from ..storage.quarantine import extend_torn_last_segment, record_start_in
from ..storage.index import IndexService
from ..format.message import illegal_topic
from ..paths import StorePaths
from ..storage.geometry import store_config
from .load import loaded
from .verify import finding, resync, verify_store

log = logging.getLogger(__name__)

FILLER_TOPIC = "ROCKETSTORE_REPAIR_FILLER"
FILLER_SYS_FLAG = codec.TRANSACTION_ROLLBACK
MAX_FILLER_BYTES = 1 << 20  # well under maxMessageSize, so any reader takes a filler as an ordinary record
REPORT_NAME = "report.json"
# Phases of a repair, as its marker (StorePaths.repair_marker) names them: while "commitlog", an interrupted repair
# is rolled back (every segment's original is kept); from "rebuild" on it is finished (the rebuild is idempotent).
PHASES = ("commitlog", "rebuild", "finish")
GEOMETRY_KEYS = ("mappedFileSizeCommitLog", "mappedFileSizeConsumeQueue", "maxHashSlotNum", "maxIndexNum")
LOST_TAG = "ROCKETSTORE_LOST"  # TAGS of a tombstone: tag subscriptions never match it
LOST_PROPERTY = "ROCKETSTORE_LOST"  # its value names the quarantine directory holding the original bytes
MAX_NOTE = 40  # the longest such value ("repair-" and the time in ms)
MAX_TOMBSTONE_BYTES = 4194304 + 65536  # the largest record RocketMQ writes (maxMessageSize + 64 KiB)


@dataclass
class DamagedSpan:
    """Bytes of one segment that hold no valid record, from a failed record up to the next valid one."""

    file: str
    offset: int  # commitlog offset where the span starts
    length: int
    reason: str
    action: str  # "filler", "blank" or "end-of-log"
    all_zero: bool
    resume_store_timestamp: int = 0  # of the next valid record (or the one before), for the fillers
    messages: list[dict[str, Any]] = field(default_factory=list)  # what the old consume queues said was here
    # What the span is rewritten as: (commitlog offset, length, "filler"/"tombstone"/"blank", message or None).
    pieces: list[tuple[int, int, str, dict[str, Any] | None]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("resume_store_timestamp")
        d["allZero"] = d.pop("all_zero")
        d["rewrite"] = [{"offset": o, "length": n, "as": kind} for o, n, kind, _m in d.pop("pieces")]
        return d


@dataclass
class HeaderFix:
    """A record whose routing fields disagree with its old consume-queue unit: reported, never written."""

    file: str
    offset: int  # commitlog offset of the record
    fields: dict[str, tuple[Any, Any]]  # field name -> (value read, value the old unit says)
    writes: list[tuple[int, bytes]]  # (position in the file, bytes the unit's values would be): never written

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "offset": self.offset,
                "fields": {k: {"read": a, "unitSays": b} for k, (a, b) in self.fields.items()}}


def _is_zero(buf: Any, start: int, end: int) -> bool:
    step = 1 << 20
    for p in range(start, end, step):
        chunk = buf[p:min(end, p + step)]
        if chunk.count(0) != len(chunk):
            return False
    return True


def scan_segment(buf: Any, path: str, base: int, file_size: int, is_last: bool,
                 last_ts: int = 0) -> tuple[list[DamagedSpan], int]:
    """The damaged spans of one segment (nothing is written), and the store time of its last valid record
    (``last_ts``, that of the segments before, when it has none)."""
    spans: list[DamagedSpan] = []
    pos = 0
    while pos < file_size:
        end, last, _n, _w = codec.scan_records(buf, pos, file_size, file_size, base=base, check_crc=True)
        if last >= 0:
            last_ts = codec.read_store_timestamp(buf, last)
        pos = end
        if pos >= file_size:
            break
        size, parsed, reason = codec.check(buf, pos, file_size, check_crc=True, parsed=True, base=base)
        if size == 0:
            break  # a blank record: the file ends here
        if parsed is not None:  # a trusted record after all: scan_records leaves some to the exact check
            last_ts = parsed[0][11]
            pos += size
            continue
        nxt = resync(buf, pos, file_size, base)
        if nxt is None:
            zero = _is_zero(buf, pos, file_size)
            if is_last and zero:
                break  # the end of the written data
            if zero:
                reason = "zero bytes where a record or a blank end-of-file record should be"
            spans.append(DamagedSpan(path, base + pos, file_size - pos, reason or "invalid record",
                                     "end-of-log" if is_last else "blank", zero, last_ts))
            break
        q, ts = nxt
        zero = _is_zero(buf, pos, q)
        spans.append(DamagedSpan(path, base + pos, q - pos, "zero bytes" if zero else reason or "invalid record",
                                 "filler", zero, ts))
        pos = q
    return spans, last_ts


def filler_pieces(length: int) -> list[int]:
    """Sizes of the filler records that exactly cover ``length`` bytes (empty when too short for one)."""
    if length < _filler_min(1):
        return []
    n = -(-length // MAX_FILLER_BYTES)
    sizes = [length // n] * n
    for i in range(length % n):
        sizes[i] += 1
    return sizes


def _filler_min(topic_len: int) -> int:
    return codec.record_length(0, topic_len, 0, FILLER_SYS_FLAG, False)


def filler_record(size: int, physical_offset: int, store_timestamp: int) -> bytes:
    """One CRC-valid ROLLBACK record of exactly ``size`` bytes (the topic shortens for very small spans)."""
    topic = FILLER_TOPIC[:max(1, min(len(FILLER_TOPIC), size - _filler_min(0)))]
    body = bytes(size - _filler_min(len(topic)))
    out = codec.encode_bytes(topic, body, sys_flag=FILLER_SYS_FLAG, born_timestamp=store_timestamp,
                             physical_offset=physical_offset, store_timestamp=store_timestamp,
                             max_message_size=max(len(body), 4194304))
    assert len(out) == size
    return bytes(out)


def tombstone_record(size: int, msg: dict[str, Any], physical_offset: int, store_timestamp: int,
                     note: str) -> bytes | None:
    """A record of the lost message's topic, queue and queue offset, exactly ``size`` bytes (zero body), tagged
    ``LOST_TAG`` and carrying ``LOST_PROPERTY`` = ``note``; when that does not fit (a lost record smaller than
    about 150 bytes) tagged only; None when ``size`` is too small even for that."""
    for props in (f"TAGS\x01{LOST_TAG}\x02{LOST_PROPERTY}\x01{note}\x02", f"TAGS\x01{LOST_TAG}\x02"):
        try:
            head = codec.encode(msg["topic"], b"", queue_id=msg["queueId"], properties=props)[1]
        except codec.RecordError:
            return None
        if size < head:
            continue
        out = codec.encode_bytes(msg["topic"], bytes(size - head), queue_id=msg["queueId"], properties=props,
                                 born_timestamp=store_timestamp, queue_offset=msg["queueOffset"],
                                 physical_offset=physical_offset, store_timestamp=store_timestamp,
                                 max_message_size=max(size, 4194304))
        return bytes(out) if len(out) == size else None
    return None


def layout(span: DamagedSpan, held: set[tuple[str, int, int]],
           note: str = "x" * MAX_NOTE) -> list[tuple[int, int, str, dict[str, Any] | None]]:
    """How a span is rewritten: a tombstone of each lost message's size at its start (as the old consume
    queues place it, and only for a queue offset no surviving record holds), fillers between them, and for a
    blank span a blank after the last; plain fillers (or one blank) when that does not fit."""
    start, end = span.offset, span.offset + span.length
    plain = [(start, span.length, span.action, None)]
    if span.action == "end-of-log":
        return []
    at: dict[int, list[dict[str, Any]]] = {}
    for m in span.messages:
        if (m["topic"], m["queueId"], m["queueOffset"]) not in held:
            at.setdefault(m["commitLogOffset"], []).append(m)
    lost = [ms[0] for off, ms in sorted(at.items()) if len(ms) == 1]  # two units at one offset: trust neither
    if not lost:
        return plain
    pieces: list[tuple[int, int, str, dict[str, Any] | None]] = []
    if lost[0]["commitLogOffset"] > start:
        pieces.append((start, lost[0]["commitLogOffset"] - start, "filler", None))
    for i, m in enumerate(lost):
        off = m["commitLogOffset"]
        nxt = lost[i + 1]["commitLogOffset"] if i + 1 < len(lost) else end
        rest = "filler" if i + 1 < len(lost) or span.action == "filler" else "blank"
        stop = min(nxt, off + m["size"])  # the tombstone takes the lost record's own size ...
        if nxt - stop < (_filler_min(1) if rest == "filler" else codec.BLANK_RECORD_SIZE):
            stop = nxt  # ... and what is too little for a record of its own after it
        pieces.append((off, stop - off, "tombstone", m))
        if stop < nxt:
            pieces.append((stop, nxt - stop, rest, None))
    for off, n, kind, m in pieces:
        if kind == "filler" and not filler_pieces(n) or kind == "tombstone" and (
                n > MAX_TOMBSTONE_BYTES or tombstone_record(n, m, off, 0, note) is None):
            return plain
    return pieces


def _held_queue_offsets(spans: list[DamagedSpan], file_size: int) -> set[tuple[str, int, int]]:
    """(topic, queue id, queue offset) of the surviving records of every queue a lost message belonged to."""
    queues = {(m["topic"], m["queueId"]) for s in spans for m in s.messages}
    held: set[tuple[str, int, int]] = set()
    if not queues:
        return held
    skip = {s.offset: s.offset + s.length for s in spans}
    cdir = os.path.dirname(spans[0].file)
    for name in sorted(n for n in os.listdir(cdir) if len(n) == 20 and n.isdigit()):
        if os.path.getsize(os.path.join(cdir, name)) != file_size:
            continue
        base = int(name)
        with open(os.path.join(cdir, name), "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            pos = 0
            while pos < file_size:
                stopped = None
                # Only trusted records (PHYSICALOFFSET = position) hold a queue offset: a stale copy of a
                # record at another position is not a message and must not keep a lost message's slot.
                for p, size, parsed, _reason in codec.walk(mm, pos, file_size, check_crc=False, parsed=True,
                                                           base=base):
                    if size <= 0 or parsed is None or base + p in skip:  # a damaged record may still parse
                        stopped = p if size != 0 else None
                        break
                    h, tp, tl, _pl = parsed
                    if h[7] & codec.TRANSACTION_MASK in (codec.TRANSACTION_NOT_TYPE, codec.TRANSACTION_COMMIT):
                        key = (str(mm[tp:tp + tl], "utf-8", "replace"), h[3])
                        if key in queues:
                            held.add((key[0], key[1], h[5]))
                if stopped is None:
                    break
                if base + stopped in skip:
                    pos = skip[base + stopped] - base
                    continue
                nxt = resync(mm, stopped, file_size, base)  # past the untrusted bytes to the next trusted record
                if nxt is None:
                    break
                pos = nxt[0]
    return held


def _lost_messages(cq_root: str, spans: list[DamagedSpan]) -> None:
    """Fill each span's ``messages`` from the consume-queue units that point into it."""
    if not spans or not os.path.isdir(cq_root):
        return
    bounds = sorted((s.offset, s.offset + s.length, s) for s in spans)
    lo, hi = bounds[0][0], bounds[-1][1]
    unit = struct.Struct(">qiq")
    for topic in sorted(os.listdir(cq_root)):
        tdir = os.path.join(cq_root, topic)
        for qid in sorted(os.listdir(tdir)) if os.path.isdir(tdir) else []:
            qdir = os.path.join(tdir, qid)
            for name in sorted(os.listdir(qdir)) if qid.lstrip("-").isdigit() and os.path.isdir(qdir) else []:
                if not name.isdigit():
                    continue
                with open(os.path.join(qdir, name), "rb") as fh:
                    data = fh.read()
                usable = len(data) - len(data) % CQ_STORE_UNIT_SIZE
                for i, (off, size, _tags) in enumerate(unit.iter_unpack(data[:usable])):
                    if lo <= off < hi and size > 0:
                        for start, end, span in bounds:
                            if start <= off < end:
                                span.messages.append({"topic": topic, "queueId": int(qid),
                                                      "queueOffset": int(name) // CQ_STORE_UNIT_SIZE + i,
                                                      "commitLogOffset": off, "size": size})


def _queue_units(cq_root: str) -> Iterator[tuple[str, int, int, int, int, int]]:
    """(topic, queue id, queue offset, commitlog offset, size, tagsCode) of every unit of the consume queues
    under ``cq_root`` that points at a record (blank units and invalid ones left out)."""
    unit = struct.Struct(">qiq")
    for topic in sorted(os.listdir(cq_root)) if os.path.isdir(cq_root) else []:
        tdir = os.path.join(cq_root, topic)
        for qid in sorted(os.listdir(tdir)) if os.path.isdir(tdir) else []:
            qdir = os.path.join(tdir, qid)
            if not (qid.lstrip("-").isdigit() and os.path.isdir(qdir)):
                continue
            for name in sorted(os.listdir(qdir)):
                if not name.isdigit():
                    continue
                with open(os.path.join(qdir, name), "rb") as fh:
                    data = fh.read()
                first = int(name) // CQ_STORE_UNIT_SIZE
                usable = len(data) - len(data) % CQ_STORE_UNIT_SIZE
                for i, (off, size, tags) in enumerate(unit.iter_unpack(data[:usable])):
                    if off >= 0 and 0 < size < 0x7FFFFFFF:
                        yield topic, int(qid), first + i, off, size, tags


def header_fixes(cq_root: str, cdir: str, file_size: int, spans: list[DamagedSpan]) -> list[HeaderFix]:
    """The records whose topic, queue id or queue offset contradict the old consume-queue unit pointing at
    them, where that unit is the only one pointing there, matches the record's size and tagsCode, and sits
    between two units of its queue that agree with their records in every field (after one, for the queue's
    first unit).

    Reported (``suspect``), never written back: two swapped units look just the
    same, and the old unit is a cache that may be the damaged one.  Dispatch
    writes a unit from the record's fields, so a record that agrees with its
    unit on size and tagsCode but names another queue or offset may have been
    changed afterwards.  The sound neighbours rule out
    the one way dispatch itself writes units at other offsets than their
    records': a queue that lost units and was refilled from later records
    (RocketMQ's gap handling shifts every unit after the gap, not one).  A
    V1/V2 topic is named only at the same byte length, and only for records
    dispatch puts in a queue (not PREPARED or ROLLBACK: which of the two it was
    is unknown).
    """
    ranges = sorted((s.offset, s.offset + s.length) for s in spans)
    segments: dict[int, Any] = {}

    def record_at(off: int) -> tuple[Any, int, tuple, bytes, int] | None:
        """(segment map, position, header, topic bytes, topic position) of a structurally valid record
        starting at ``off``."""
        base = off - off % file_size
        if any(a <= off < b for a, b in ranges):
            return None  # a damaged span: its records are rewritten, not restored
        mm = segments.get(base)
        if mm is None:
            p = os.path.join(cdir, f"{base:020d}")
            mm = False
            if os.path.isfile(p) and os.path.getsize(p) == file_size:
                with open(p, "rb") as fh:
                    mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            segments[base] = mm
        if mm is False:
            return None
        try:
            h, tp, tl, _pl = codec.parse(mm, off - base, file_size)
        except codec.RecordError:
            return None  # a dangling unit: the rebuild drops it
        return (mm, off - base, h, bytes(mm[tp:tp + tl]), tp) if h[6] == off else None

    candidates: dict[int, tuple[tuple[str, int, int], HeaderFix]] = {}
    try:
        for topic, qid, qoff, off, size, tags in _queue_units(cq_root):
            rec = record_at(off)
            if rec is None or rec[2][0] != size:
                continue
            mm, pos, h, rtopic, tp = rec
            want = topic.encode("utf-8", "surrogatepass")
            if (rtopic, h[3], h[5]) == (want, qid, qoff):
                continue
            if h[7] & codec.TRANSACTION_MASK not in (codec.TRANSACTION_NOT_TYPE, codec.TRANSACTION_COMMIT) or \
                    (rtopic != want and len(rtopic) != len(want)):
                continue
            msg = codec.decode(mm, pos, pos + size, read_body=False)
            if codec.dispatch_tags_code(topic, msg.properties, msg.store_timestamp) != tags:
                continue
            fields: dict[str, tuple[Any, Any]] = {}
            writes: list[tuple[int, bytes]] = []
            if rtopic != want:
                fields["topic"] = (rtopic.decode("utf-8", "replace"), topic)
                writes.append((tp, want))
            if h[3] != qid:
                fields["queueId"] = (h[3], qid)
                writes.append((pos + 12, struct.pack(">i", qid)))
            if h[5] != qoff:
                fields["queueOffset"] = (h[5], qoff)
                writes.append((pos + 20, struct.pack(">q", qoff)))
            fix = HeaderFix(os.path.join(cdir, f"{off - off % file_size:020d}"), off, fields, writes)
            candidates.setdefault(off, ((topic, qid, qoff), fix))
        if not candidates:
            return []
        claims: dict[int, int] = dict.fromkeys(candidates, 0)  # a record two units point at: trust neither
        wanted = {(t, q, o + d) for t, q, o in (c[0] for c in candidates.values()) for d in (-1, 1)}
        sound: set[tuple[str, int, int]] = set()  # units among ``wanted`` that agree with their record
        first: dict[tuple[str, int], int] = {}  # each queue's first unit that points at a record
        for topic, qid, qoff, off, size, _tags in _queue_units(cq_root):
            first.setdefault((topic, qid), qoff)
            if off in claims:
                claims[off] += 1
            if (topic, qid, qoff) in wanted:
                rec = record_at(off)
                if rec is not None and (rec[2][0], rec[3], rec[2][3], rec[2][5]) == (
                        size, topic.encode("utf-8", "surrogatepass"), qid, qoff):
                    sound.add((topic, qid, qoff))
        return [fix for off, ((t, q, o), fix) in sorted(candidates.items())  # a queue's first unit follows no gap
                if claims[off] == 1 and ((t, q, o - 1) in sound or first.get((t, q)) == o) and (t, q, o + 1) in sound]
    finally:
        for mm in segments.values():
            if mm:
                mm.close()


@contextmanager
def _store_lock(paths: StorePaths, dry_run: bool) -> Iterator[int | None]:
    """Hold the store's lock (RocketMQ's, on byte 0 of ``lock``) so no broker runs while repair works; yields
    its descriptor (None for a dry run of a store without a lock file)."""
    if not os.path.exists(paths.lock) and dry_run:
        yield None
        return
    fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        import fcntl
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
        except OSError:
            raise StoreLockedError(f"{paths.lock}: store is locked by another process; stop it before repair") \
                from None
        _probe_directory_lock(paths)
        yield fd
    finally:
        # POSIX record locks belong to the process: the store opened inside takes the same lock without
        # waiting, and its close drops it (the rebuild takes it again after).
        os.close(fd)


def _probe_directory_lock(paths: StorePaths) -> None:
    """Refuse when another process holds the ``flock`` every writer takes on the store directory.

    The record lock on ``lock`` alone misses a live writer whose lock file was removed (``rm STORE/lock``
    makes a new file nobody locks).  The flock is only probed, not kept: it belongs to an open file
    description, so the store repair opens in this process would conflict with it; the record lock held
    from before the probe keeps a new writer out afterwards.  This process's own open store (a writable
    open finishing an interrupted repair) holds it already and passes.
    """
    import fcntl

    from ..storage.store_lock import held_here
    if held_here(paths.root):
        return
    try:
        dir_fd = os.open(paths.root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise StoreError(f"{paths.root}: cannot open the store directory: {e.strerror}") from None
    try:
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreLockedError(f"{paths.lock}: store directory {paths.root} is locked by a live writer "
                                   "(its lock file was replaced); stop it before repair") from None
    finally:
        os.close(dir_fd)  # drops the probe's flock


def plan(path: str, file_size: int) -> list[DamagedSpan]:
    """Every damaged span of every segment, read-only."""
    cdir = StorePaths(path).commitlog
    names = sorted(n for n in os.listdir(cdir) if len(n) == 20 and n.isdigit())
    spans: list[DamagedSpan] = []
    last_ts = 0
    for i, name in enumerate(names):
        p = os.path.join(cdir, name)
        size = os.path.getsize(p)
        if size == 0 and i == len(names) - 1:
            continue
        last = i == len(names) - 1
        torn = last and size < file_size and record_start_in(p, int(name), file_size) is not None
        if size != file_size and not torn:
            raise StoreLoadError(f"{p}: {size} bytes, expected {file_size}; repair refuses to guess its records "
                                 "(set mappedFileSizeCommitLog or move the file aside)")
        with open(p, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            found, last_ts = scan_segment(mm, p, int(name), size, last, last_ts)  # a torn last one: as far as it goes
            spans += found
    return spans


# ---------------------------------------------------------------- durable steps

def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: str, data: bytes) -> None:
    """Write ``data`` beside ``path``, fsync, rename over it, fsync the directory: old bytes or new, never half."""
    d, name = os.path.split(path)
    tmp = os.path.join(d, f".{name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(d)


def _keep_original(src: str, dest: str, link: bool = True) -> None:
    """Keep the file at ``src`` as ``dest``: a hard link where the file system allows and ``link`` (for a file
    that is replaced by a rename, never written in place), else a durable copy."""
    if os.path.exists(dest):
        return  # kept by an earlier, interrupted run of the same repair
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = dest + ".tmp"
    if os.path.exists(tmp):
        os.unlink(tmp)
    try:
        if not link:
            raise OSError("copy")
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
    os.replace(tmp, dest)
    _fsync_dir(os.path.dirname(dest))


def _step(name: str) -> None:
    """A point between two durable steps of a repair (tests interrupt the repair here)."""


def read_marker(root: str) -> dict[str, Any] | None:
    """The marker of a repair that has not finished (None when there is none); an unreadable one is an error."""
    path = StorePaths(root).repair_marker
    try:
        with open(path, encoding="utf-8") as fh:
            marker = json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise StoreLoadError(f"{path}: marker of an interrupted repair cannot be read ({e}); the store is in the "
                             "middle of a rewrite, nothing was changed (restore the originals kept in "
                             "quarantine/ by hand)") from None
    if not isinstance(marker, dict) or marker.get("phase") not in PHASES:
        raise StoreLoadError(f"{path}: not a repair marker this version knows ({str(marker)[:80]}); nothing was "
                             "changed")
    return marker


def describe_marker(root: str, marker: dict[str, Any]) -> str:
    """One line for errors: what is under way, and what finishes it."""
    return (f"{StorePaths(root).repair_marker}: {marker.get('operation', 'a repair')} of this store was interrupted "
            f"(phase {marker['phase']}, originals in {marker.get('quarantine')})")


def _write_marker(paths: StorePaths, marker: dict[str, Any]) -> None:
    _write_durably(paths.repair_marker, json.dumps(marker, indent=1).encode())


# ---------------------------------------------------------------- commitlog phase

def _apply(spans: list[DamagedSpan], qdir: str, file_size: int) -> list[DamagedSpan]:
    """Rewrite the damaged spans: each touched segment's original is kept in ``qdir/commitlog`` and its new
    content is written in ``qdir/new`` and renamed over it (a segment is always whole, old or new); the
    spans not rewritten are returned."""
    unfixed = []
    by_file: dict[str, list[DamagedSpan]] = {}
    for s in spans:
        by_file.setdefault(s.file, []).append(s)
    cdir = None
    for p, file_spans in by_file.items():
        cdir = os.path.dirname(p)
        name = os.path.basename(p)
        keep = os.path.join(qdir, "commitlog", name)
        _keep_original(p, keep)
        _step("kept " + name)
        new = os.path.join(qdir, "new", name)
        os.makedirs(os.path.dirname(new), exist_ok=True)
        shutil.copyfile(keep, new)
        base = int(name)
        with open(new, "r+b") as fh:
            for s in file_spans:
                log.warning("%s: %d bytes at commitlog offset %d (%s): %s; original kept in %s", p, s.length,
                            s.offset, s.reason, "left to recovery" if not s.pieces else
                            "rewritten as " + ", ".join(kind for _o, _n, kind, _m in s.pieces), keep)
                if not s.pieces:
                    unfixed.append(s)  # the torn tail: recovery ends the log here
                for off, length, kind, m in s.pieces:  # each fits: layout checked them
                    at = off - base
                    if kind == "blank":
                        os.pwrite(fh.fileno(), codec.blank_record(file_size - at), at)
                    elif kind == "tombstone":
                        rec = tombstone_record(length, m, off, s.resume_store_timestamp, os.path.basename(qdir))
                        os.pwrite(fh.fileno(), rec, at)
                    else:
                        for n in filler_pieces(length):
                            os.pwrite(fh.fileno(), filler_record(n, base + at, s.resume_store_timestamp), at)
                            at += n
            os.fsync(fh.fileno())
        _step("written " + name)
        os.replace(new, p)
        _fsync_dir(cdir)
        _step("replaced " + name)
    return unfixed


def _roll_back(paths: StorePaths, marker: dict[str, Any]) -> None:
    """Undo a repair interrupted while it rewrote segments: put every kept original back, drop the rest."""
    qdir = os.path.join(paths.quarantine, marker["quarantine"])
    for name in marker.get("segments", []):
        kept = os.path.join(qdir, "commitlog", name)
        if os.path.exists(kept):  # the segment is only replaced after its original is kept
            os.replace(kept, os.path.join(paths.commitlog, name))
    if os.path.isdir(paths.commitlog):
        _fsync_dir(paths.commitlog)
    shutil.rmtree(qdir, ignore_errors=True)
    if os.path.isdir(paths.quarantine) and not os.listdir(paths.quarantine):
        os.rmdir(paths.quarantine)
    os.unlink(paths.repair_marker)
    _fsync_dir(paths.root)
    log.warning("%s: an interrupted %s was rolled back before any segment stayed rewritten; the store is as it "
                "was before it", paths.root, marker.get("operation", "repair"))


# ---------------------------------------------------------------- rebuild phase: place, never append

_UNIT = struct.Struct(">qiq")
MIN_RECORD_SIZE = codec.record_length(0, 1, 0, 0, False)  # no record is shorter: bounds how many fit in a span


@dataclass
class _Placed:
    phy: int
    size: int
    queue_offset: int
    tags_code: int


def trusted_records(cdir: str, file_size: int) -> Iterator[codec.MessageExt]:
    """Every trusted record (magic, size, PHYSICALOFFSET equal to its position, body CRC) in commitlog order.

    A record that fails is skipped to the next trusted one (verify's resync) in
    every segment but the last, where recovery ends the log at it.
    """
    names = sorted(n for n in os.listdir(cdir) if len(n) == 20 and n.isdigit())
    for i, name in enumerate(names):
        path = os.path.join(cdir, name)
        size = os.path.getsize(path)
        if size == 0:
            continue
        base, last = int(name), i == len(names) - 1
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            pos = 0
            while pos < size:
                stopped = None
                for p, n, msg, _reason in codec.walk(mm, pos, size, check_crc=True, base=base):
                    if n == 0:
                        stopped = size  # a blank record ends the file
                        break
                    if msg is None:
                        stopped = p
                        break
                    yield msg
                    pos = p + n
                else:
                    break  # zeros: the written end
                if stopped >= size or last:
                    break
                nxt = resync(mm, stopped, size, base)
                if nxt is None:
                    break
                pos = nxt[0]


def _local_commitlog_min(cdir: str) -> int:
    """The commitlog offset of the first local segment holding data (0 for none): records below it, once
    retention deleted their segments, are held only by the tier."""
    names = sorted(n for n in os.listdir(cdir) if len(n) == 20 and n.isdigit()) if os.path.isdir(cdir) else []
    return next((int(n) for n in names if os.path.getsize(os.path.join(cdir, n)) > 0), 0)


def tier_records(root: str, cfg: StoreConfig) -> Iterator[codec.MessageExt]:
    """The trusted records the tier holds below the local commitlog, in commitlog order.

    The commitlog is local segments plus the tier's: a rebuild from the local segments alone would leave
    blank units where acknowledged tier-held messages are.  A tier that holds such records but cannot be
    read (unreachable, manifest faulty, a record failing its checks) raises StoreError naming it: the
    caller refuses the repair rather than drop their units.
    """
    below = _local_commitlog_min(StorePaths(root).commitlog)
    if not cfg.tieredStoreUri or below <= 0:
        return
    from ..tier.tiered import TieredStorage
    try:
        tier = TieredStorage(root, cfg, read_only=True)
        tier.refresh(quiet=True)
    except StoreError as e:
        raise StoreError(f"tier {cfg.tieredStoreUri}: {e}; it holds the records below commitlog offset {below} "
                         "(the local commitlog's start): repair refused, nothing was changed") from None
    reader = tier.reader
    why = tier.fault or (tier.error if reader is None else None)
    if reader is None and why is None and tier.deleted_end <= 0:
        return  # no tier published: nothing below the local start to read
    if reader is None or why is not None:
        raise StoreError(f"tier {tier.loc.uri}: cannot be read ({why or 'no manifest'}); it holds the records "
                         f"below commitlog offset {below}: repair refused, nothing was changed")
    try:
        for off, _size, msg, problem in reader.scan(reader.manifest.min_offset, below, check_crc=True):
            if msg is None:
                raise StoreError(f"tier {tier.loc.uri}: record at commitlog offset {off}: {problem}; repair "
                                 "refused, nothing was changed")
            yield msg
    except StoreError as e:
        if "repair refused" in str(e):
            raise
        raise StoreError(f"tier {tier.loc.uri}: {e}; it holds the records below commitlog offset {below}: "
                         "repair refused, nothing was changed") from None


def _longest_ordered(recs: list[_Placed], prefer: Any = None) -> list[_Placed]:
    """The longest run of records (in commitlog order) whose queue offsets strictly grow: dispatch writes a
    queue in commitlog order, so a record out of that order cannot be placed without moving its neighbours.
    Of two records claiming one queue offset the first is kept (as dispatch skips the later one) unless
    ``prefer(record)`` says the later one is what the old consume queue pointed at."""
    tails: list[int] = []  # tails[k]: index of the record ending the best ordered run of length k+1
    prev = [-1] * len(recs)
    for i, r in enumerate(recs):
        lo, hi = 0, len(tails)
        while lo < hi:
            mid = (lo + hi) // 2
            if recs[tails[mid]].queue_offset < r.queue_offset:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(tails) and recs[tails[lo]].queue_offset == r.queue_offset and not (prefer and prefer(r)):
            continue
        prev[i] = tails[lo - 1] if lo else -1
        if lo == len(tails):
            tails.append(i)
        else:
            tails[lo] = i
    out: list[_Placed] = []
    i = tails[-1] if tails else -1
    while i >= 0:
        out.append(recs[i])
        i = prev[i]
    return out[::-1]


def _old_unit_reader(cq_root: str, file_size: int) -> Any:
    """(topic, queue id, queue offset) -> the commitlog offset the old consume queue's unit there points at."""
    def phy_at(topic: str, qid: int, qoff: int) -> int | None:
        at = qoff * CQ_STORE_UNIT_SIZE
        path = os.path.join(cq_root, topic, str(qid), f"{at - at % file_size:020d}")
        try:
            with open(path, "rb") as fh:
                fh.seek(at % file_size)
                raw = fh.read(CQ_STORE_UNIT_SIZE)
        except OSError:
            return None
        return _UNIT.unpack(raw)[0] if len(raw) == CQ_STORE_UNIT_SIZE else None
    return phy_at


def place_queues(records: Iterator[codec.MessageExt], on_record: Any = None, old_unit: Any = None) -> tuple[
        dict[tuple[str, int], list[_Placed]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Each trusted record's unit at its own queue offset: (queue -> placed records, gaps, records not placed).

    A record is left out (reported, never moved to another offset) when it is
    out of commitlog order with its queue's others (two records claiming one
    offset, or an offset field a bit flip changed), or when its queue offset
    lies further past the one before it than the bytes between them could hold
    records (a flipped high bit: placing it would write a queue of blank units
    up to there).  A queue offset no placed record holds is a gap: a blank unit.
    ``old_unit(topic, queue id, queue offset)``: where the old consume queue
    pointed, to choose between two records claiming one offset.
    """
    queues: dict[tuple[str, int], list[_Placed]] = {}
    legal: dict[str, bool] = {}
    for msg in records:
        if on_record is not None:
            on_record(msg)
        if msg.sys_flag & codec.TRANSACTION_MASK not in (codec.TRANSACTION_NOT_TYPE, codec.TRANSACTION_COMMIT):
            continue
        ok = legal.get(msg.topic)
        if ok is None:
            ok = legal[msg.topic] = illegal_topic(msg.topic) is None
        if not ok:
            continue
        code = codec.dispatch_tags_code(msg.topic, msg.properties, msg.store_timestamp)
        queues.setdefault((msg.topic, msg.queue_id), []).append(
            _Placed(msg.commit_log_offset, msg.size, msg.queue_offset, code))
    placed: dict[tuple[str, int], list[_Placed]] = {}
    gaps: list[dict[str, Any]] = []
    unplaced: list[dict[str, Any]] = []
    for (topic, qid), recs in sorted(queues.items()):
        prefer = None
        if old_unit is not None:
            def prefer(r: _Placed, topic: str = topic, qid: int = qid) -> bool:
                return old_unit(topic, qid, r.queue_offset) == r.phy
        ordered = _longest_ordered(recs, prefer)
        chosen: list[_Placed] = []
        for r in ordered:
            before = chosen[-1] if chosen else None
            room = r.phy - (before.phy + before.size if before else 0)
            missing = r.queue_offset - (before.queue_offset + 1 if before else 0)
            if missing * MIN_RECORD_SIZE > room:
                unplaced.append({"topic": topic, "queueId": qid, "queueOffset": r.queue_offset,
                                 "commitLogOffset": r.phy, "reason": f"{missing} record(s) of the queue would have to "
                                 f"lie in the {room} bytes before it"})
                continue
            if before is not None and missing:
                gaps.append({"topic": topic, "queueId": qid, "from": before.queue_offset + 1,
                             "to": r.queue_offset - 1})
            chosen.append(r)
        in_order = {id(r) for r in ordered}
        at = {r.queue_offset: r for r in chosen}
        for r in recs:
            if id(r) not in in_order:  # (those in order but not chosen are reported above)
                other = at.get(r.queue_offset)
                unplaced.append({"topic": topic, "queueId": qid, "queueOffset": r.queue_offset,
                                 "commitLogOffset": r.phy, "reason": (
                                     f"the record at {other.phy} holds that queue offset" if other is not None
                                     else "out of commitlog order with the queue's other records")})
        placed[(topic, qid)] = chosen
    return placed, gaps, unplaced


_BLANK_UNIT = _UNIT.pack(0, 0x7FFFFFFF, 0)


def write_queue(root: str, topic: str, queue_id: int, units: list[_Placed], file_size: int) -> None:
    """Write one queue's files under ``root``: each unit at its queue offset, blank units for gaps and below
    the first (as dispatch pads a queue that starts past 0), zeros after the last; fsynced."""
    if not units:
        return
    d = os.path.join(root, topic, str(queue_id))
    os.makedirs(d, exist_ok=True)
    per_file = file_size // CQ_STORE_UNIT_SIZE
    first_file = units[0].queue_offset // per_file
    i = 0
    for k in range(first_file, units[-1].queue_offset // per_file + 1):
        lo = k * per_file
        buf = bytearray(file_size)
        filled = 0  # units of this file written so far
        while i < len(units) and units[i].queue_offset < lo + per_file:
            u = units[i]
            slot = u.queue_offset - lo
            if slot > filled:
                buf[filled * CQ_STORE_UNIT_SIZE:slot * CQ_STORE_UNIT_SIZE] = _BLANK_UNIT * (slot - filled)
            _UNIT.pack_into(buf, slot * CQ_STORE_UNIT_SIZE, u.phy, u.size, u.tags_code)
            filled = slot + 1
            i += 1
        if i < len(units) and filled < per_file:  # the gap runs on into the next file
            buf[filled * CQ_STORE_UNIT_SIZE:] = _BLANK_UNIT * (per_file - filled)
        with open(os.path.join(d, f"{lo * CQ_STORE_UNIT_SIZE:020d}"), "wb") as fh:
            fh.write(buf)
            fh.flush()
            os.fsync(fh.fileno())
    _fsync_dir(d)
    _fsync_dir(os.path.dirname(d))


def _build(paths: StorePaths, cfg: StoreConfig, qdir: str) -> dict[str, Any]:
    """Walk the commitlog once and write the consume queues (placed) and the index into ``qdir/*.new``."""
    cq_new = os.path.join(qdir, "consumequeue.new")
    ix_new = os.path.join(qdir, "index.new")
    for d in (cq_new, ix_new):
        shutil.rmtree(d, ignore_errors=True)
    os.makedirs(cq_new)
    index = None
    last_ts = 0
    if cfg.messageIndexEnable:
        index = IndexService(ix_new, cfg.maxHashSlotNum, cfg.maxIndexNum)
        index.load(True, 0)

    def on_record(msg: codec.MessageExt) -> None:
        nonlocal last_ts
        last_ts = msg.store_timestamp
        if index is not None:
            props = msg.properties
            index.build_index(msg.topic, msg.commit_log_offset, msg.store_timestamp,
                              msg.sys_flag & codec.TRANSACTION_MASK, props.get("UNIQ_KEY"), props.get("KEYS"))

    try:
        old = os.path.join(qdir, "consumequeue")  # the old queues, once an interrupted run moved them here
        old_unit = _old_unit_reader(old if os.path.isdir(old) else paths.consumequeue, cfg.mappedFileSizeConsumeQueue)
        records = itertools.chain(tier_records(paths.root, cfg),
                                  trusted_records(paths.commitlog, cfg.mappedFileSizeCommitLog))
        placed, gaps, unplaced = place_queues(records, on_record, old_unit)
        full_ts = 0
        if index is not None:
            index.flush()
            full = [f for f in index.files if f.is_full()]
            full_ts = full[-1].end_timestamp if full else 0
    finally:
        if index is not None:
            index.close()
    for (topic, qid), units in placed.items():
        write_queue(cq_new, topic, qid, units, cfg.mappedFileSizeConsumeQueue)
    _fsync_dir(cq_new)
    if os.path.isdir(ix_new):
        _fsync_dir(ix_new)
    for g in gaps:
        log.error("%s-%d: queue offsets %d..%d have no trusted record in the commitlog: left as a gap (blank units)",
                  g["topic"], g["queueId"], g["from"], g["to"])
    for u in unplaced:
        log.error("record at commitlog offset %d (%s-%d queue offset %d) not placed in its queue: %s; it stays in "
                  "the commitlog as it is", u["commitLogOffset"], u["topic"], u["queueId"], u["queueOffset"],
                  u["reason"])
    return {"gaps": gaps, "unplaced": unplaced, "indexMsgTimestamp": full_ts}


def _swap_in(paths: StorePaths, qdir: str, name: str) -> None:
    """Move the store's ``name`` to ``qdir`` (once: a later run finds it there) and ``qdir/name.new`` in."""
    live, old, new = os.path.join(paths.root, name), os.path.join(qdir, name), os.path.join(qdir, name + ".new")
    if not os.path.exists(new):
        return
    if os.path.lexists(live):
        if os.path.exists(old):  # what an interrupted run of this repair swapped in: rebuilt again
            shutil.rmtree(live) if os.path.isdir(live) else os.unlink(live)
        else:
            os.replace(live, old)
    os.replace(new, live)
    _fsync_dir(paths.root)


def _rebuild(paths: StorePaths, cfg: StoreConfig, marker: dict[str, Any], lock_fd: int | None) -> list[str]:
    """Rebuild consume queues, index and checkpoint from the (rewritten) commitlog; idempotent, so an
    interrupted run is finished by running it again.  Returns what changed."""
    qdir = os.path.join(paths.quarantine, marker["quarantine"])
    os.makedirs(qdir, exist_ok=True)
    if os.path.exists(paths.checkpoint):
        _keep_original(paths.checkpoint, os.path.join(qdir, "checkpoint"), link=False)  # the rebuild keeps its times
    built = _build(paths, cfg, qdir)
    _step("built")
    _swap_in(paths, qdir, "consumequeue")
    _step("queues swapped")
    _swap_in(paths, qdir, "index")
    # The rebuilt files are whole: the next start is a normal one, and a queue refill the store had left
    # unfinished (consumequeue.rebuild) concerned the old queues.
    for name in ("abort", "abort.bootid", os.path.basename(paths.cq_rebuild)):
        src = os.path.join(paths.root, name)
        if os.path.exists(src):
            os.replace(src, os.path.join(qdir, name))
    _fsync_dir(paths.root)
    _step("swapped")
    try:
        with loaded(paths.root, cfg) as files:  # recovery rebuilds what the swap left, as a writable open would
            for cq in files.consume_queues():
                cq.flush(0)
            files.index_service.flush()
            report = files.recovery_report
            files.checkpoint.confirmPhyOffset = report.confirm_offset if report else 0
            if built["indexMsgTimestamp"]:
                files.checkpoint.indexMsgTimestamp = built["indexMsgTimestamp"]
            files.flush_checkpoint()
            files.recover_topic_queue_table()
    finally:
        if lock_fd is not None:  # releasing the store lock dropped this process's record lock: hold it again
            import fcntl
            fcntl.lockf(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
    marker["phase"] = "finish"
    marker["report"]["gaps"] = built["gaps"]
    marker["report"]["unplaced"] = built["unplaced"]
    _write_marker(paths, marker)
    _step("rebuilt")
    return _finish(paths, marker)


def _finish(paths: StorePaths, marker: dict[str, Any]) -> list[str]:
    """Drop kept files the rebuild reproduced, write the report (or drop the quarantine directory when
    nothing was kept), and remove the marker last."""
    qdir = os.path.join(paths.quarantine, marker["quarantine"])
    report = marker["report"]
    repaired = list(report.get("repaired", []))
    for name in ("consumequeue", "index"):
        change = _drop_identical(os.path.join(qdir, name), os.path.join(paths.root, name), name)
        if change:
            repaired.append(change)
    shutil.rmtree(os.path.join(qdir, "new"), ignore_errors=True)
    kept = report["lost"] or report.get("suspect") or any(
        os.path.exists(os.path.join(qdir, n)) for n in ("commitlog", "consumequeue", "index", "abort"))
    if not kept:
        shutil.rmtree(qdir, ignore_errors=True)
        if os.path.isdir(paths.quarantine) and not os.listdir(paths.quarantine):
            os.rmdir(paths.quarantine)
    else:
        _write_durably(os.path.join(qdir, REPORT_NAME), json.dumps(
            {**report, "repaired": repaired}, ensure_ascii=False, indent=1).encode())
    os.unlink(paths.repair_marker)
    _fsync_dir(paths.root)
    report["repaired"] = repaired
    report["kept"] = bool(kept)
    return repaired


def finish_interrupted_repair(root: str, config: StoreConfig | None = None) -> dict[str, Any] | None:
    """Finish (or, if it was still rewriting segments, roll back) a repair that did not complete: the next
    writable open runs this before anything else, so an interrupted repair leaves the old state or the new.
    Returns the marker it found (None when there was none)."""
    paths = StorePaths(root)
    if not os.path.exists(paths.repair_marker):
        return None
    try:
        with _store_lock(paths, False) as fd:
            marker = read_marker(root)
            if marker is not None:
                _resume(paths, marker, config, fd)
            return marker
    except StoreLockedError:
        marker = read_marker(root)
        raise StoreLockedError(f"{describe_marker(root, marker) if marker else paths.repair_marker}; the store is "
                               "locked by another process (a repair still running?)") from None


def _resume(paths: StorePaths, marker: dict[str, Any], config: StoreConfig | None, fd: int | None) -> None:
    log.warning("%s; %s", describe_marker(paths.root, marker),
                "rolling it back" if marker["phase"] == "commitlog" else "finishing it")
    if marker["phase"] == "commitlog":
        _roll_back(paths, marker)
        return
    cfg = store_config(paths.root, config).inferred(**marker["geometry"])
    if marker["phase"] == "rebuild":
        _rebuild(paths, cfg, marker, fd)
    else:
        _finish(paths, marker)


def _drop_identical(old_root: str, new_root: str, kind: str) -> str | None:
    """Delete the kept old files the rebuild reproduced byte for byte; say what changed."""
    old, new = _files(old_root), _files(new_root)
    if kind == "index":  # named by creation time: compare contents only
        same = len(old) == len(new) and all(
            filecmp.cmp(a, b, shallow=False) for a, b in zip(sorted(old.values()), sorted(new.values())))
        if same:
            shutil.rmtree(old_root, ignore_errors=True)
            return None
        return f"index: {len(old)} file(s) rebuilt as {len(new)}"
    changed = [k for k in old if k in new and not filecmp.cmp(old[k], new[k], shallow=False)]
    gone = [k for k in old if k not in new]
    for k in old:
        if k in new and k not in changed:
            os.unlink(old[k])
    added = [k for k in new if k not in old]
    for d, _dirs, _names in sorted(os.walk(old_root), reverse=True) if os.path.isdir(old_root) else []:
        if not os.listdir(d):
            os.rmdir(d)
    if changed or gone or added:
        return f"{kind}: {len(changed) + len(added)} file(s) rewritten, {len(gone)} removed"
    return None


def _files(root: str) -> dict[str, str]:
    out = {}
    if os.path.isdir(root):
        for d, _dirs, names in os.walk(root):
            for name in names:
                p = os.path.join(d, name)
                out[os.path.relpath(p, root)] = p
    return out


def repair_store(path: str, config: StoreConfig | None = None, *, dry_run: bool = False) -> dict[str, Any]:
    """Repair the store at ``path`` (see the module docstring); return verify's result plus what was done.

    ``lost`` lists every damaged span (with the messages the old consume queues
    placed there); ``ok`` is false whenever it is not empty.  ``gaps`` and
    ``unplaced`` say which queue offsets the rebuilt queues could not fill.
    With ``dry_run`` nothing is written: the result says what repair would do.
    """
    paths = StorePaths(path)
    if not os.path.isdir(paths.commitlog):
        raise StoreLoadError(f"{path}: no commitlog directory; not a store")
    marker = read_marker(path)
    if marker is not None and dry_run:
        raise StoreLoadError(f"{describe_marker(path, marker)}; a dry run changes nothing: run verify --repair or "
                             "rocketstore recover to finish it")
    with _store_lock(paths, dry_run) as fd:
        if marker is not None:
            _resume(paths, marker, config, fd)
        cfg = store_config(path, config)  # by majority, before the files it is measured from are moved aside
        for _msg in tier_records(path, cfg):  # a tier holding records it cannot give: refused before any change
            pass
        if not dry_run:  # a torn last segment is extended, as an open would, before its records are walked
            extend_torn_last_segment(paths.commitlog, cfg.mappedFileSizeCommitLog, False)
        spans = plan(path, cfg.mappedFileSizeCommitLog)
        _lost_messages(paths.consumequeue, spans)
        held = _held_queue_offsets(spans, cfg.mappedFileSizeCommitLog)
        # Records whose routing fields contradict the old unit pointing at them: reported, never rewritten
        # (no CRC covers those fields, and the old unit is a cache: it may be the damaged one).
        suspects = header_fixes(paths.consumequeue, paths.commitlog, cfg.mappedFileSizeCommitLog, spans)
        qname = f"repair-{int(time.time() * 1000)}"  # the tombstones' note: decided before they are laid out
        for s in spans:
            s.pieces = layout(s, held, qname)
            kept_as = {id(m) for _o, _n, kind, m in s.pieces if kind == "tombstone"}
            for m in s.messages:
                m["tombstone"] = id(m) in kept_as
            if s.pieces == [(s.offset, s.length, "filler", None)] and not filler_pieces(s.length):
                # Left in place it would stop recovery and cost every record after it: touch nothing.
                raise StoreError(f"{s.file}: damaged span of {s.length} bytes at commitlog offset {s.offset} "
                                 f"({s.reason}) is too short for a filler record; nothing was written")
        for f in suspects:
            log.warning("%s: record at commitlog offset %d: %s; kept as it "
                        "reads (an intact record is never rewritten)", f.file, f.offset,
                        ", ".join(f"{k} reads {a!r}, its old consume-queue unit says {b!r}" for k, (a, b) in f.fields.items()))
        if dry_run:
            try:
                with loaded(path, cfg, read_only=True) as files:
                    result = verify_store(files)
            except StoreError as e:  # e.g. a consume-queue file of the wrong size
                result = {"ok": False, "segments": 0, "records": 0, "bytesChecked": 0, "consumeQueues": 0,
                          "consumeQueueUnits": 0, "indexFiles": 0, "indexEntries": 0,
                          "problems": [finding("unreadable", path, 0, f"{e} (the rebuild replaces it)")]}
            result["dryRun"] = True
            result["lost"] = [s.to_json() for s in spans]
            result["repaired"] = [f"commitlog: would rewrite {s.length} bytes at {s.offset} as "
                                  + ", ".join(kind for _o, _n, kind, _m in s.pieces) for s in spans if s.pieces]
            result["suspect"] = [f.to_json() for f in suspects]
            result["ok"] = result["ok"] and not spans
            return result
        qdir = os.path.join(paths.quarantine, qname)
        touched = sorted({os.path.basename(s.file) for s in spans if s.pieces})
        marker = {"operation": "verify --repair", "phase": "commitlog", "quarantine": qname, "segments": touched,
                  "pid": os.getpid(), "geometry": {k: getattr(cfg, k) for k in GEOMETRY_KEYS},
                  "report": {"lost": [s.to_json() for s in spans], "suspect": [f.to_json() for f in suspects]}}
        _write_marker(paths, marker)  # before anything changes: the next open rolls back or finishes
        _step("marked")
        os.makedirs(qdir, exist_ok=True)
        unfixed = _apply([s for s in spans if s.pieces], qdir, cfg.mappedFileSizeCommitLog)
        unfixed += [s for s in spans if not s.pieces]
        marker["phase"] = "rebuild"
        marker["report"]["repaired"] = [f"commitlog: {s.length} bytes at {s.offset} rewritten as "
                                        + ", ".join(kind for _o, _n, kind, _m in s.pieces)
                                        for s in spans if s not in unfixed]
        _write_marker(paths, marker)  # the segments are new from here: an interruption is finished, not undone
        _step("segments done")
        _rebuild(paths, cfg, marker, fd)
        with loaded(path, cfg, read_only=True) as files:
            result = verify_store(files)
    report = marker["report"]
    result["lost"] = report["lost"]
    result["suspect"] = report["suspect"]
    result["gaps"] = report.get("gaps", [])
    result["unplaced"] = report.get("unplaced", [])
    result["repaired"] = report["repaired"]
    if report.get("kept"):
        result["quarantine"] = qdir
    result["ok"] = result["ok"] and not spans
    return result
