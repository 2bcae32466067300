"""verify: CRC-check every record and cross-check consume queues and the index against the CommitLog.

Findings are plain dicts ``{"kind", "file", "offset", "detail"}`` so that the
single-machine check, the Spark job and the JSON output share one shape.
``check_segment`` is the per-segment unit of work (the Spark job runs it on
executors); ``verify_store`` runs everything on one machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from . import codec
from .consume_queue import CQ_STORE_UNIT_SIZE
from .index import IndexFile
from .store import MessageStore


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
    key_hashes: frozenset[int]


@dataclass
class SegmentResult:
    path: str
    records: list[RecordSummary] = field(default_factory=list)
    findings: list[dict[str, Any]] = field(default_factory=list)
    bytes_checked: int = 0


def summarize(msg: codec.MessageExt) -> RecordSummary:
    props = msg.properties
    keys = []
    if props.get("UNIQ_KEY"):
        keys.append(f"{msg.topic}#{props['UNIQ_KEY']}")
    keys += [f"{msg.topic}#{k}" for k in (props.get("KEYS") or "").split(" ") if k]
    return RecordSummary(msg.commit_log_offset, msg.size, msg.topic, msg.queue_id, msg.queue_offset, msg.sys_flag,
                         codec.dispatch_tags_code(msg.topic, props, msg.store_timestamp),
                         frozenset(codec.index_key_hash(k) for k in keys))


def check_segment(buf: Any, path: str, base: int, limit: int, file_size: int, is_last: bool) -> SegmentResult:
    """CRC-check the records of one segment up to ``limit`` (its written end)."""
    res = SegmentResult(path)
    end = 0
    ended = False  # by a blank record or a bad one
    for pos, size, msg, reason in codec.walk(buf, 0, limit, check_crc=True):
        if size == 0:
            ended = True
            end = file_size
            break
        if msg is None:
            res.findings.append(finding("bad-record", path, base + pos, reason or "invalid record"))
            ended = True
            end = pos
            break
        if msg.commit_log_offset != base + pos:
            res.findings.append(finding("bad-record", path, base + pos,
                                        f"PHYSICALOFFSET field says {msg.commit_log_offset}"))
        res.records.append(summarize(msg))
        end = pos + size
    if not ended and not is_last and end < file_size:
        res.findings.append(finding("bad-record", path, base + end, "segment ends without a blank record"))
    pos = end
    res.bytes_checked = min(pos, limit)
    return res


def cross_check(store: MessageStore, records: Iterable[RecordSummary]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Every CQ unit must point at a matching record; every queued record must have its unit; every index
    entry must point at a record holding a key of that hash."""
    by_offset = {r.offset: r for r in records}
    findings: list[dict[str, Any]] = []
    counts = {"units": 0, "indexEntries": 0}
    seen_units: set[int] = set()
    for cq in store.consume_queues():
        for f in list(cq.queue.files):
            mm = f.mm
            start = max(0, cq.min_logic_offset - f.file_from_offset)
            for p in range(start, f.wrote_position - CQ_STORE_UNIT_SIZE + 1, CQ_STORE_UNIT_SIZE):
                off, size, tags = codec.struct.unpack_from(">qiq", mm, p)
                idx = (f.file_from_offset + p) // CQ_STORE_UNIT_SIZE
                counts["units"] += 1
                where = f"{f.path} unit {idx}"
                r = by_offset.get(off)
                if r is None:
                    if off >= store.min_phy_offset():
                        findings.append(finding("cq-dangling", f.path, f.file_from_offset + p,
                                                f"{where}: no record at commitlog offset {off}"))
                    continue
                seen_units.add(off)
                problems = []
                if r.size != size:
                    problems.append(f"size {size} != record size {r.size}")
                if (r.topic, r.queue_id) != (cq.topic, cq.queue_id):
                    problems.append(f"record belongs to {r.topic}-{r.queue_id}")
                if r.queue_offset != idx:
                    problems.append(f"record's queue offset is {r.queue_offset}")
                if r.tags_code != tags:
                    problems.append(f"tagsCode {tags} != {r.tags_code}")
                if problems:
                    findings.append(finding("cq-mismatch", f.path, f.file_from_offset + p,
                                            f"{where} -> {off}: " + "; ".join(problems)))
    dispatched_txn = (codec.TRANSACTION_NOT_TYPE, codec.TRANSACTION_COMMIT)
    for r in by_offset.values():
        if r.sys_flag & codec.TRANSACTION_MASK in dispatched_txn and r.offset not in seen_units:
            cq = store._cq_table.get((r.topic, r.queue_id))
            if cq is not None and r.queue_offset < cq.min_offset_in_queue:
                continue  # expired from the queue by retention
            findings.append(finding("cq-missing", store.paths.commitlog, r.offset,
                                    f"record of {r.topic}-{r.queue_id} queue offset {r.queue_offset} "
                                    "has no consume-queue unit"))
    min_phy, max_phy = store.min_phy_offset(), store.max_phy_offset()
    for f in store.index_service.files:
        for n, (h, off, _diff, _prev) in enumerate(_entries(f), 1):
            counts["indexEntries"] += 1
            if off < min_phy or off >= max_phy:
                continue  # expired, or past a recovered end: queries skip these
            r = by_offset.get(off)
            if r is None:
                findings.append(finding("index-dangling", f.path, n, f"entry {n}: no record at {off}"))
            elif h not in r.key_hashes:
                findings.append(finding("index-mismatch", f.path, n,
                                        f"entry {n}: hash {h} is not a key of the record at {off}"))
    return findings, counts


def _entries(f: IndexFile) -> Iterator[tuple[int, int, int, int]]:
    return f.entries_iter()


def verify_store(store: MessageStore, progress: Any = None) -> dict[str, Any]:
    """Check everything; the result has ``ok`` and the list of ``problems``."""
    results = []
    files = list(store.commitlog.queue.files)
    for i, f in enumerate(files):
        results.append(check_segment(f.mm, f.path, f.file_from_offset, f.wrote_position, f.file_size,
                                     i == len(files) - 1))
        if progress is not None:
            progress.update(f.file_size)
    return verify_report(store, results)


def verify_report(store: MessageStore, results: list[SegmentResult]) -> dict[str, Any]:
    """The verify result from the per-segment checks (run here or on Spark executors, one per segment,
    in file order): adds the torn tail recovery found, the cross-checks and the quarantined files."""
    findings: list[dict[str, Any]] = []
    records: list[RecordSummary] = []
    checked = 0
    for res in results:
        findings += res.findings
        records += res.records
        checked += res.bytes_checked
    report = store.recovery_report
    if report is not None and report.abnormal and report.stopped_because:
        findings.append(finding("torn-tail", store.paths.commitlog, report.process_offset,
                                f"{report.stopped_because} (recovery ends the commitlog here)"))
    cross, counts = cross_check(store, records)
    findings += cross
    if os.path.isdir(store.paths.quarantine):
        for q in sorted(os.listdir(store.paths.quarantine)):
            findings.append(finding("quarantined", os.path.join(store.paths.quarantine, q), 0,
                                    "stray file moved aside at open"))
    findings.sort(key=lambda d: (d["kind"], d["file"], d["offset"]))
    return {"ok": not findings, "segments": len(results), "records": len(records), "bytesChecked": checked,
            "consumeQueues": len(store.consume_queues()), "consumeQueueUnits": counts["units"],
            "indexFiles": len(store.index_service.files), "indexEntries": counts["indexEntries"],
            "problems": findings}
