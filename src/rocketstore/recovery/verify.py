"""verify: CRC-check every record and cross-check consume queues and the index against the CommitLog.

Beyond CRC (``bad-record``, resynchronising after each) it finds consume-queue
units that point nowhere or at the wrong record (``cq-dangling``,
``cq-mismatch``), invalid units below a queue's end (``cq-hole``), runs of
units shifted against their records' queue offsets (``cq-gap``), records with
no unit (``cq-missing``), index entries that point nowhere or at a record
without that key (``index-dangling``, ``index-mismatch``), a key hash and
offset indexed more often than the record has the key (``index-duplicate``),
entries a query cannot reach from their key's hash slot (``index-unreachable``),
and keys of indexed records with no entry (``index-missing``).  Files moved
aside at open are ``quarantined`` problems; the originals a ``verify --repair``
kept are listed under ``kept`` and are not problems.

Findings are plain dicts ``{"kind", "file", "offset", "detail"}`` so that the
single-machine check, the Spark job and the JSON output share one shape.
``check_segment`` is the per-segment unit of work (the Spark job runs it on
executors); ``verify_store`` runs everything on one machine.
"""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from ..format import codec
from ..storage.consume_queue import CQ_STORE_UNIT_SIZE
from ..storage.index import IndexFile, key_hashes
from ..storage.files import StoreFiles


def finding(kind: str, file: str, offset: int, detail: str) -> dict[str, Any]:
    return {"kind": kind, "file": file, "offset": offset, "detail": detail}


@dataclass
class RecordSummary:
    """What the cross-checks need of one valid record."""

    offset: int
    size: int
    topic: str
    queue_id: int
    queue_offset: int
    sys_flag: int
    tags_code: int
    key_hashes: tuple[int, ...]  # one per index key (UNIQ_KEY, then each KEYS token; repeats kept, as indexed)


@dataclass
class SegmentResult:
    path: str
    records: list[RecordSummary] = field(default_factory=list)
    findings: list[dict[str, Any]] = field(default_factory=list)
    bytes_checked: int = 0


def summarize(msg: codec.MessageExt) -> RecordSummary:
    props = msg.properties
    return RecordSummary(msg.commit_log_offset, msg.size, msg.topic, msg.queue_id, msg.queue_offset, msg.sys_flag,
                         codec.dispatch_tags_code(msg.topic, props, msg.store_timestamp),
                         tuple(key_hashes(msg.topic, props.get("UNIQ_KEY"), props.get("KEYS"))))


def check_segment(buf: Any, path: str, base: int, limit: int, file_size: int, is_last: bool) -> SegmentResult:
    """CRC-check the records of one segment up to ``limit`` (its written end).

    After a bad record the check resynchronises on the next valid record (see
    :func:`resync`), so one damaged record is one finding and the records after
    it are still checked and cross-checked.
    """
    res = SegmentResult(path)
    end = 0
    ended = False  # by a blank record, or a bad one nothing valid follows
    pos = 0
    while not ended and pos < limit:
        for pos, size, msg, reason in codec.walk(buf, pos, limit, check_crc=True, base=base):
            if size == 0:
                ended = True
                end = file_size
                break
            if msg is None:
                res.findings.append(finding("bad-record", path, base + pos, reason or "invalid record"))
                nxt = resync(buf, pos, limit, base)
                if nxt is None:
                    ended = True
                    end = pos
                else:
                    end = nxt[0]
                break
            res.records.append(summarize(msg))
            end = pos + size
        else:  # the walk ran to the limit, or into zeros: the written end of the last segment
            nxt = None if is_last or end >= limit else resync(buf, end, limit, base)
            if nxt is None:
                break
            res.findings.append(finding("bad-record", path, base + end, f"zero bytes up to the record at "
                                        f"{base + nxt[0]}"))
            end = nxt[0]
        pos = end
    if not ended and not is_last and end < file_size:
        res.findings.append(finding("bad-record", path, base + end, "segment ends without a blank record"))
    res.bytes_checked = min(end, limit)
    return res


_MAGICS = (struct.pack(">I", codec.MAGIC_V1), struct.pack(">I", codec.MAGIC_V2))


def valid_record_at(buf: Any, pos: int, limit: int, base: int) -> tuple[int, int] | None:
    """(size, store timestamp) of a record at ``pos`` that passes every check (magic, sizes, CRC and a
    PHYSICALOFFSET field equal to ``base + pos``), else None."""
    size, parsed, _reason = codec.check(buf, pos, limit, check_crc=True, parsed=True, base=base)
    if parsed is None or size <= 0:
        return None
    return size, parsed[0][11]


def resync(buf: Any, pos: int, limit: int, base: int) -> tuple[int, int] | None:
    """(position, store timestamp) of the first valid record after the bad one at ``pos``, or None.

    The bad record's own TOTALSIZE is tried first (often only its body is
    damaged); then every later occurrence of a magic code is a candidate, and
    only one whose PHYSICALOFFSET field names its own position and whose body
    CRC holds is taken, so bytes inside a body are not mistaken for a record.
    """
    total = codec.read_total_size(buf, pos) if limit - pos >= 4 else 0
    if 0 < total <= limit - pos - 8:
        hit = valid_record_at(buf, pos + total, limit, base)
        if hit is not None:
            return pos + total, hit[1]
    best = None
    for magic in _MAGICS:
        i = buf.find(magic, pos + 5, limit)
        while i != -1 and (best is None or i - 4 < best[0]):
            hit = valid_record_at(buf, i - 4, limit, base)
            if hit is not None:
                best = (i - 4, hit[1])
                break
            i = buf.find(magic, i + 1, limit)
    return best


def cross_check(files: StoreFiles, records: Iterable[RecordSummary]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Every CQ unit must point at a matching record; every queued record must have its unit; every index
    entry must point at a record holding a key of that hash, once; every indexed record's keys must be there."""
    by_offset = {r.offset: r for r in records}
    findings: list[dict[str, Any]] = []
    counts = {"units": 0, "indexEntries": 0}
    seen_units: set[int] = set()
    for cq in files.consume_queues():
        findings += _check_queue(files, cq, by_offset, seen_units, counts)
    dispatched_txn = (codec.TRANSACTION_NOT_TYPE, codec.TRANSACTION_COMMIT)
    for r in by_offset.values():
        if r.sys_flag & codec.TRANSACTION_MASK in dispatched_txn and r.offset not in seen_units:
            cq = files.cq_table.get((r.topic, r.queue_id))
            if cq is not None and r.queue_offset < cq.min_offset_in_queue:
                continue  # expired from the queue by retention
            findings.append(finding("cq-missing", files.paths.commitlog, r.offset,
                                    f"record of {r.topic}-{r.queue_id} queue offset {r.queue_offset} "
                                    "has no consume-queue unit"))
    findings += _check_index(files, by_offset, counts)
    return findings, counts


_UNIT = struct.Struct(">qiq")
PRE_BLANK_UNIT = (0, 0x7FFFFFFF, 0)  # what a queue starting past 0 is padded with below its min offset


def _check_queue(files: StoreFiles, cq: Any, by_offset: dict[int, RecordSummary], seen_units: set[int],
                 counts: dict[str, int]) -> list[dict[str, Any]]:
    """One consume queue's units against the records; a run of units whose records' QUEUEOFFSET differs from
    the unit's by the same amount (a record of the queue lost before them) is one ``cq-gap``."""
    findings: list[dict[str, Any]] = []
    gap: list[Any] = []  # [file, position, first unit, last unit, delta]
    name = f"{cq.topic}-{cq.queue_id}"
    min_phy = files.min_phy_offset()

    def close_gap() -> None:
        if gap:
            path, pos, first, last, delta = gap
            findings.append(finding("cq-gap", path, pos, f"{name} units {first}..{last} hold records whose queue "
                                    f"offset is {delta:+d} from the unit's: {abs(delta)} unit(s) missing before "
                                    f"unit {first}" if delta > 0 else f"{name} units {first}..{last} hold records "
                                    f"whose queue offset is {delta:+d} from the unit's"))
            gap.clear()

    segments = list(cq.queue.files)
    live = False  # a unit pointing at or past the commitlog's start was seen: blank units after it are holes
    for fi, f in enumerate(segments):
        mm = f.mm
        start = max(0, cq.min_logic_offset - f.file_from_offset)
        end = f.wrote_position - (f.wrote_position - start) % CQ_STORE_UNIT_SIZE if f.wrote_position > start else start
        base_idx = f.file_from_offset // CQ_STORE_UNIT_SIZE
        for n, (off, size, tags) in enumerate(_UNIT.iter_unpack(mm[start:end])):
            p = start + n * CQ_STORE_UNIT_SIZE
            idx = base_idx + p // CQ_STORE_UNIT_SIZE
            counts["units"] += 1
            where = f"{f.path} unit {idx}"
            if (off, size, tags) == PRE_BLANK_UNIT and not live:
                continue  # the expired head: recovery's stand-in for a record retention already deleted
            if off < 0 or size <= 0 or (off, size, tags) == PRE_BLANK_UNIT:
                close_gap()
                what = "a blank unit: its message is gone" if (off, size, tags) == PRE_BLANK_UNIT else \
                    f"not valid ({off}, {size}, {tags})"
                findings.append(finding("cq-hole", f.path, f.file_from_offset + p,
                                        f"{name} unit {idx} below the queue's max offset {cq.max_offset_in_queue} "
                                        f"is {what}"))
                continue
            live = live or off >= min_phy
            r = by_offset.get(off)
            if r is None:
                close_gap()
                if off >= min_phy:
                    findings.append(finding("cq-dangling", f.path, f.file_from_offset + p,
                                            f"{where}: no record at commitlog offset {off}"))
                continue
            seen_units.add(off)
            problems = []
            if r.size != size:
                problems.append(f"size {size} != record size {r.size}")
            if (r.topic, r.queue_id) != (cq.topic, cq.queue_id):
                problems.append(f"record belongs to {r.topic}-{r.queue_id}")
            if r.tags_code != tags:
                problems.append(f"tagsCode {tags} != {r.tags_code}")
            delta = r.queue_offset - idx
            if problems:
                close_gap()
                if delta:
                    problems.append(f"record's queue offset is {r.queue_offset}")
                findings.append(finding("cq-mismatch", f.path, f.file_from_offset + p,
                                        f"{where} -> {off}: " + "; ".join(problems)))
            elif delta:
                if gap and gap[4] == delta and gap[3] == idx - 1:
                    gap[3] = idx
                else:
                    close_gap()
                    gap[:] = [f.path, f.file_from_offset + p, idx, idx, delta]
            else:
                close_gap()
        if fi == len(segments) - 1 and end < f.file_size:
            # Recovery ends a queue at its first invalid unit: units after it that still point at records of
            # this store were hidden by a hole (stale units past a truncated commitlog point past its end).
            tail = mm[end:f.file_size]
            if tail.count(0) != len(tail):
                hidden = sum(1 for u in _UNIT.iter_unpack(tail[:len(tail) - len(tail) % CQ_STORE_UNIT_SIZE])
                             if u[1] > 0 and u[0] in by_offset)
                if hidden:
                    findings.append(finding("cq-hole", f.path, f.file_from_offset + end,
                                            f"{name} ends at unit {(f.file_from_offset + end) // CQ_STORE_UNIT_SIZE}"
                                            f", an invalid unit, but {hidden} unit(s) after it point at records"))
    close_gap()
    return findings


def _check_index(files: StoreFiles, by_offset: dict[int, RecordSummary],
                 counts: dict[str, int]) -> list[dict[str, Any]]:
    """Index entries against the records: dangling, wrong key, the same (key hash, offset) more often than
    the record has that key (a duplicate), and keys of indexed records that have no entry."""
    findings: list[dict[str, Any]] = []
    min_phy, max_phy = files.min_phy_offset(), files.max_phy_offset()
    seen: dict[tuple[int, int], int] = {}
    segments = files.index_service.files
    findings += [finding("index-damaged", path, 0, f"{why}: its keys cannot be found (rocketstore recover "
                                                   "rebuilds the index from the commitlog)")
                 for path, why in files.index_service.damaged.items()]
    for f in segments:
        for n, (h, off, _diff, _prev) in enumerate(_entries(f), 1):
            if off < min_phy or off >= max_phy:
                continue  # expired, or past a recovered end: queries skip these
            r = by_offset.get(off)
            if r is None:
                findings.append(finding("index-dangling", f.path, n, f"entry {n}: no record at {off}"))
            elif h not in r.key_hashes:
                findings.append(finding("index-mismatch", f.path, n,
                                        f"entry {n}: hash {h} is not a key of the record at {off}"))
            else:
                c = seen[(h, off)] = seen.get((h, off), 0) + 1
                if c > 1 and c == r.key_hashes.count(h) + 1:
                    findings.append(finding("index-duplicate", f.path, n,
                                            f"entry {n}: hash {h} -> {off} is indexed more often than the record "
                                            f"at {off} has that key ({c - 1})"))
        counts["indexEntries"] += max(0, f.index_count - 1)
        findings += _unreachable_entries(f)
    if not files.config.messageIndexEnable:
        return findings
    # Records the index must cover: from the oldest index file's first entry (older files expire), or all
    # records when no index file holds an entry; ROLLBACK records are never indexed (RocketMQ's buildIndex).
    used = [f for f in segments if f.index_count > 1]
    covered_from = min(f.begin_phy_offset for f in used) if used else min_phy
    rollback = codec.TRANSACTION_ROLLBACK
    for r in by_offset.values():
        off, hs = r.offset, r.key_hashes
        if off < covered_from or r.sys_flag & codec.TRANSACTION_MASK == rollback:
            continue
        if all((h, off) in seen for h in hs) and len(set(hs)) == len(hs):
            continue  # the common case: each key once, each found
        for h, want in Counter(hs).items():
            have = seen.get((h, off), 0)
            if have < want:
                findings.append(finding("index-missing", files.paths.index, off,
                                        f"record of {r.topic} at {off}: {want - have} index entr"
                                        f"{'y' if want - have == 1 else 'ies'} of key hash {h} missing"))
    return findings


def _unreachable_entries(f: IndexFile) -> list[dict[str, Any]]:
    """Entries a query cannot reach: a query walks only the chain from its key's hash slot (newest first,
    through each entry's prev), so a damaged slot or prev hides every key of the chain behind it although
    each entry still points at its record.  One finding per file (the first such entry, and how many)."""
    count, slots = f.index_count, f.slots
    if count <= 1:
        return []
    mm, base = f.mm, f.entries_base
    reached = bytearray(count)
    for s, (cur,) in enumerate(struct.iter_unpack(">i", mm[40:40 + 4 * slots])):
        while 0 < cur < count and not reached[cur]:
            h, _off, _diff, prev = _IDX_ENTRY.unpack_from(mm, base + cur * 20)
            if h % slots == s:
                reached[cur] = 1
            if prev >= cur:
                break
            cur = prev
    missing = count - 1 - sum(reached)
    if not missing:
        return []
    first = reached.index(0, 1)
    return [finding("index-unreachable", f.path, first, f"{missing} entr{'y' if missing == 1 else 'ies'} (the first: "
                    f"entry {first}) cannot be reached from their hash slot: queries miss their keys")]


_IDX_ENTRY = struct.Struct(">iqii")


def _entries(f: IndexFile) -> Iterator[tuple[int, int, int, int]]:
    return f.entries_iter()


def _quarantined(qroot: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(problems, kept): files moved aside at open are problems (they may hold what the operator must look
    at); the originals a finished ``verify --repair`` kept are not: the store it left is whole, and what it
    could not keep it reported when it ran.  Each kept directory is listed with what its report says."""
    problems, kept = [], []
    for q in sorted(os.listdir(qroot)) if os.path.isdir(qroot) else []:
        p = os.path.join(qroot, q)
        report = os.path.join(p, "report.json")
        if q.startswith("repair-") and os.path.isdir(p):
            lost: list[Any] = []
            try:
                with open(report, encoding="utf-8") as fh:
                    lost = json.load(fh).get("lost", [])
                detail = (f"originals kept by verify --repair; {len(lost)} damaged span(s) it could not keep as "
                          f"records (see {report})" if lost else "originals kept by verify --repair (nothing lost)")
            except FileNotFoundError:
                detail = "originals kept by verify --repair (no report)"
            except (OSError, ValueError) as e:
                detail = f"originals kept by verify --repair; unreadable report: {e}"
            kept.append(finding("kept", p, lost[0].get("offset", 0) if lost and isinstance(lost[0], dict) else 0,
                                detail))
            continue
        problems.append(finding("quarantined", p, 0, "stray file moved aside at open"))
    return problems, kept


def verify_store(files: StoreFiles, progress: Any = None) -> dict[str, Any]:
    """Check everything; the result has ``ok`` and the list of ``problems``."""
    results = []
    segments = list(files.commitlog.queue.files)
    for i, f in enumerate(segments):
        results.append(check_segment(f.mm, f.path, f.file_from_offset, f.wrote_position, f.file_size,
                                     i == len(segments) - 1))
        if progress is not None:
            progress.update(f.file_size)
    return verify_report(files, results)


def verify_report(files: StoreFiles, results: list[SegmentResult]) -> dict[str, Any]:
    """The verify result from the per-segment checks (run here or on Spark executors, one per segment,
    in file order): adds the torn tail recovery found, the cross-checks and the quarantined files."""
    findings: list[dict[str, Any]] = []
    records: list[RecordSummary] = []
    checked = 0
    for res in results:
        findings += res.findings
        records += res.records
        checked += res.bytes_checked
    report = files.recovery_report
    if report is not None and report.abnormal and report.stopped_because:
        findings.append(finding("torn-tail", files.paths.commitlog, report.process_offset,
                                f"{report.stopped_because} (recovery ends the commitlog here)"))
    cross, counts = cross_check(files, records)
    findings += cross
    stray, kept = _quarantined(files.paths.quarantine)
    findings += stray
    findings.sort(key=lambda d: (d["kind"], d["file"], d["offset"]))
    return {"ok": not findings, "segments": len(results), "records": len(records), "bytesChecked": checked,
            "consumeQueues": len(files.consume_queues()), "consumeQueueUnits": counts["units"],
            "indexFiles": len(files.index_service.files), "indexEntries": counts["indexEntries"],
            "problems": findings, "kept": kept}
