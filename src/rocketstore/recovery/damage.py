"""The commitlog side of ``verify --repair``: finding damaged spans, and the filler and tombstone records
that take their place (a tombstone keeps a lost message's queue offset, so no offset is given twice)."""

from __future__ import annotations

import logging
import mmap
import os
import struct
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

from ..format import codec
from ..storage.consume_queue import CQ_STORE_UNIT_SIZE
from ..errors import StoreLoadError
from ..storage.quarantine import record_start_in
from ..paths import StorePaths
from .verify import resync


log = logging.getLogger(__name__)


FILLER_TOPIC = "ROCKETSTORE_REPAIR_FILLER"


FILLER_SYS_FLAG = codec.TRANSACTION_ROLLBACK


MAX_FILLER_BYTES = 1 << 20  # well under maxMessageSize, so any reader takes a filler as an ordinary record


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
    # What the span is rewritten as: (commitlog offset, length, "filler"/"tombstone"/"blank"/"tier copy",
    # message or None).
    pieces: list[tuple[int, int, str, dict[str, Any] | None]] = field(default_factory=list)
    restored: bytes | None = None  # the tier's copy of these bytes, trusted records: written back as they are

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("resume_store_timestamp")
        d.pop("restored")
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


def held_queue_offsets(spans: list[DamagedSpan], file_size: int) -> set[tuple[str, int, int]]:
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


def lost_messages(cq_root: str, spans: list[DamagedSpan]) -> None:
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
