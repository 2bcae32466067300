"""Recovery: from the files on disk to a consistent store, after a clean or an unclean shutdown.

Clean (no ``abort`` file): each consume queue checks its last three files; the
CommitLog is re-checked from the segment holding the queues' highest offset and
records past that offset are re-indexed.  Unlike RocketMQ, every record from
that segment on is offered to the consume queues, which skip what they hold,
so a lost or torn queue tail is rebuilt; when the scan meets a queue's record
past a gap and that queue ended before the scan began, its next records lie
further back: the units the scan appended to it are cut and the scan runs once
more from the segment where it ends.  A clean shutdown leaves no torn tail: a
writable open whose check stops at damage with an intact record after it
refuses (nothing in the CommitLog changed) rather than truncate acknowledged
records; ``verify --repair`` keeps them.

Unclean (``abort`` present): the CommitLog is CRC-checked from the newest
segment whose first record is older than the checkpoint's minimum time (3 s of
slack), or from the first segment.  That point is durable for every queue
(data-safety rule 3): logicsMsgTimestamp advances only after a thorough flush
of every consume queue, so a quiet queue whose file never reached
flushConsumeQueueLeastPages is rebuilt by the re-dispatch.  With no such point
after a reboot (the checkpoint never had one, or was lost) the check starts at
the first segment: the busier queues' ends say nothing about a quiet queue.
Each queue's last units are checked against their records first (topic, queue
id, queue offset, size, tagsCode: a torn page keeps a unit's offset and size
with a zeroed tagsCode) and cut back to the last valid one, to be re-placed
from the records.  Every record is re-dispatched (duplicates
are skipped), and everything past the last valid record is truncated: the
torn tail of the CommitLog, consume-queue units pointing past it (zeroed, so
they never come back), index entries for records past it, and whole files
beyond it.  The index resumes at its last entry's record, adding only the
keys it lacks (no key twice), and from the first record that dropped index
files covered.  After a
reboot or power loss (not a crash of the process alone) the consume queues are
also checked for holes over the range re-checked; a queue is cut at its first
hole and rebuilt from the CommitLog.

Unlike RocketMQ, a record is accepted only if its PHYSICALOFFSET field equals
its position, so stale bytes in a reused segment never come back as messages.
After a reboot or power loss every record re-checked must also have the topic
and properties a producer writes (:func:`codec.tail_problem`): BODYCRC stops at
the body, and a sector lost from the tail (zeros, or bytes an earlier write
left) passes every other check.  Past the checkpoint's flushed point such a
record is the torn end of the log, cut as above.  When the check stops at a
record whose header and body are intact and whose store time is before
physicMsgTimestamp, the record reached the disk whole and the damage is the
disk's: the open refuses, naming the file and offset, and changes no commitlog
byte.  RocketMQ has this hole without enabledAppendPropCRC.

Each segment is checked in three tiers, each taking over where the one before
stops: :func:`queue_checked.checked_prefix` checks the run of records the
consume queues point at (and already hold) in vectorised passes, where they
cover at least ``VECTORISED_MIN_BYTES`` of the segment;
:func:`codec.scan_records` walks on record by record (all the checks, no objects
built, CRC over memoryviews) and hands back only the records a consume queue or
the index may still lack; the first record it does not accept goes through
:func:`codec.walk`, which gives the reason (or accepts it after all).
"""

from __future__ import annotations

import logging
import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import CorruptRecordError
from ..format import codec
from ..storage import mapped_file
from ..storage.consume_queue import CQ_STORE_UNIT_SIZE
from ..services.dispatch import CommitLogDispatcher
from ..errors import CommitLogDamagedError

if TYPE_CHECKING:
    from ..storage.files import StoreFiles

log = logging.getLogger(__name__)
PROGRESS_INTERVAL_S = 3.0
SCAN_CHUNK = 8 << 20  # bytes scanned between dispatching and progress checks
# Segments whose records the consume queues cover for less than this are only walked: importing numpy for the
# vectorised tier (about 0.1 s) would cost more than it saves, and small stores and CLI calls stay light.
VECTORISED_MIN_BYTES = 32 << 20


@dataclass
class RecoveryReport:
    abnormal: bool
    start_offset: int = 0
    process_offset: int = 0
    confirm_offset: int = 0
    bytes_checked: int = 0
    records_checked: int = 0
    stopped_because: str | None = None
    deleted_files: list[str] = field(default_factory=list)
    index_files_dropped: list[str] = field(default_factory=list)
    queues_truncated: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    zeroed_bytes: int = 0
    queues_rebuilt: dict[str, int] = field(default_factory=dict)  # queue -> first unit rebuilt after a hole
    not_rebuilt: dict[str, str] = field(default_factory=dict)  # queue -> what recovery could not rebuild
    index_entries_removed: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"abnormal": self.abnormal, "startOffset": self.start_offset, "processOffset": self.process_offset,
                "confirmOffset": self.confirm_offset, "bytesChecked": self.bytes_checked, "recordsChecked": self.records_checked,
                "stoppedBecause": self.stopped_because, "deletedFiles": self.deleted_files,
                "indexFilesDropped": self.index_files_dropped, "queuesTruncated": self.queues_truncated, "zeroedBytes": self.zeroed_bytes,
                "queuesRebuilt": self.queues_rebuilt, "notRebuilt": self.not_rebuilt,
                "indexEntriesRemoved": self.index_entries_removed, "seconds": round(self.seconds, 3)}


def recover(files: "StoreFiles", last_exit_ok: bool, refill_from: int | None = None) -> RecoveryReport:
    """Bring the loaded files to a consistent state (see the module's docstring); ``refill_from``: the commitlog
    offset from which lost queue files are refilled (StoreLoader.refill_from), None when none are."""
    t0 = time.monotonic()
    report = RecoveryReport(abnormal=not last_exit_ok)
    commitlog = files.commitlog
    writable = not files.read_only
    segments = commitlog.queue.files
    index_enabled = files.config.messageIndexEnable
    index = files.index_service
    cp_start = _checkpoint_start(files) if report.abnormal and segments else None
    # After a power loss (not a crash of the process alone) a consume-queue file may survive as zeros below
    # valid units; every file whose units may point into the range recovery re-checks is checked for that.
    check_from = None
    if writable and report.abnormal and segments and not getattr(files, "process_crash_only", False):
        check_from = segments[cp_start].file_from_offset if cp_start is not None else 0
    max_cq = min_cq = -1  # the highest and the lowest end of a queue
    rebuild_from = None
    full_tail = None  # the lowest end of a queue whose last file is full: a file after it may be lost
    tail_cut: dict = {}  # queue -> (whether a hole was cut first, commitlog offsets of the tail units cut)
    for cq in files.consume_queues():
        report.deleted_files += cq.recover(check_from)
        if writable and segments and (report.abnormal or cq.rebuild_from is not None):  # (no segment: nothing to check)
            # After every unclean start (and at a hole) the queue's last units are checked against their
            # records: a torn page can leave a unit that looks valid with a wrong size or tagsCode.
            holed = cq.rebuild_from is not None
            cut = drop_mismatched_tail(files, cq)
            if cut:
                tail_cut[cq] = (holed, cut)
        max_cq = max(max_cq, cq.max_physic_offset)
        if cq.max_physic_offset >= 0:
            min_cq = cq.max_physic_offset if min_cq < 0 else min(min_cq, cq.max_physic_offset)
        if cq.queue.files and cq.queue.files[-1].wrote_position == cq.file_size:
            full_tail = cq.max_physic_offset if full_tail is None else min(full_tail, cq.max_physic_offset)
        if cq.rebuild_from is not None and writable:
            report.queues_rebuilt[f"{cq.topic}-{cq.queue_id}"] = cq.hole_at
            rebuild_from = cq.rebuild_from if rebuild_from is None else min(rebuild_from, cq.rebuild_from)
    if not segments:
        if writable:
            for cq in files.consume_queues():
                cq.queue.truncate_dirty(0)
        files.recover_topic_queue_table()
        return report
    start_idx = _start_file(files, last_exit_ok, max_cq, min_cq, cp_start)
    if rebuild_from is not None:
        start_idx = min(start_idx, _file_index(segments, rebuild_from))
    if full_tail is not None:  # its next records are offered again, so a lost last file is refilled
        start_idx = min(start_idx, _file_index(segments, full_tail))
    if refill_from is not None:
        start_idx = min(start_idx, _file_index(segments, refill_from))
    if writable and index_enabled:
        index.truncate(codec.NO_INDEX, _store_time(files))  # what a crash left past the entry count
        if report.abnormal:  # the index resumes at its last entry, also when files newer were dropped
            start_idx = min(start_idx, _file_index(segments, index.resume_offset()))
    start = segments[start_idx]
    report.start_offset = start.file_from_offset
    dispatcher = CommitLogDispatcher(files) if writable else None
    check_crc = files.config.checkCRCOnRecover
    # After a reboot or power loss a record may be torn after its body (no CRC covers its topic and properties):
    # each record must also have the tail a producer writes (codec.tail_problem).  A crash of the process alone
    # loses no page, and a clean shutdown flushed everything: there the narrower codec.torn_tail rule stands.
    strict = report.abnormal and not getattr(files, "process_crash_only", False)
    last_valid = start.file_from_offset if report.abnormal else commitlog.max_offset()
    process = start.file_from_offset
    next_log = time.monotonic() + PROGRESS_INTERVAL_S
    file_size = commitlog.file_size
    topics: dict[bytes, str] = {}
    deltas: dict = {}  # for _queue_needs
    # The highest queue offset of each queue's records the scan offered (data-safety rule 2): a new put takes
    # the next offset after it even where the queue's units end lower, so no queue offset is given twice.
    seen_qoff: dict[tuple[str, int], int] = {}
    # What the scan may skip: records their consume queue already holds, and records below where the index
    # must resume.  Both bounds only grow while recovery dispatches, so these snapshots never skip a record
    # the exact per-record rules below would dispatch; those rules still decide for every record offered.
    held = _held_by_queues(files) if dispatcher is not None else None
    index_from = codec.NO_INDEX
    if dispatcher is not None and index_enabled:
        index_from = index.resume_offset() if report.abnormal else max(index.resume_offset(), max_cq + 1)

    def offer(mm: Any, pos: int, parsed: tuple, size: int) -> None:
        """Dispatch a valid record if something still needs it.

        Every record is offered to its consume queue (which rebuilds a lost tail); the index takes what
        RocketMQ re-dispatches: everything after a crash, else the records past the queues' highest
        offset.  Only records that something still needs are decoded.
        """
        h = parsed[0]
        phy = h[6]
        to_index = (report.abnormal or phy > max_cq) and index_enabled and \
            h[7] & codec.TRANSACTION_MASK != codec.TRANSACTION_ROLLBACK and phy >= index.resume_offset()
        to_queue = _queue_needs(files, mm, parsed, size, topics, deltas)
        if to_queue:
            key = (topics[mm[parsed[1]:parsed[1] + parsed[2]]], h[3])
            if h[5] > seen_qoff.get(key, -1):
                seen_qoff[key] = h[5]
        if to_index or to_queue:
            dispatcher.dispatch(codec.decode(mm, pos, pos + size, read_body=False), index=to_index, queue=to_queue)

    def progress(offset: int, path: str) -> None:
        nonlocal next_log
        if time.monotonic() >= next_log:
            next_log = time.monotonic() + PROGRESS_INTERVAL_S
            done = offset - report.start_offset
            log.info("recovery: %d bytes checked (%.1f MB/s), segment %s", done,
                     done / 1e6 / max(time.monotonic() - t0, 1e-9), path)

    # A queue whose tail units were lost (zeroed, torn) ends before records the scan may start after: the scan
    # would append its later records at the wrong unit (a gap).  Its end and length before the scan tell.
    before = {cq: (cq.max_physic_offset, cq.max_offset_in_queue) for cq in files.consume_queues()}
    for cq in before:
        cq.gap_at = None
    rescanned = False
    while True:  # the scan; once more, from further back, when a queue's lost tail lies before where it began
        idx = start_idx
        while True:
            f = segments[idx]
            mm, end, base = f.mm, 0, f.file_from_offset  # end: where the valid records of this file end
            stop = None
            blank = False
            pos, last, n = 0, -1, 0
            if not strict and min(max_cq, base + file_size) - base >= VECTORISED_MIN_BYTES:
                # First the records the consume queues point at (and hold), checked in vectorised passes.
                from ..storage import queue_checked
                pos, last, n = queue_checked.checked_prefix(
                    mm, 0, file_size, base=base, units=queue_checked.units_by_queue(files, base, base + file_size),
                    check_crc=check_crc, held=held, index_from=index_from,
                    progress=lambda at, base=base, path=f.path: progress(base + at, path))
            if n:
                end = pos
                last_valid = base + last
                report.records_checked += n
            while pos < file_size:
                # Then record by record: whole runs of valid records, checked without building anything.
                chunk_end = min(file_size, pos + SCAN_CHUNK)
                nxt, last, n, wanted = codec.scan_records(mm, pos, chunk_end, file_size, base=base, check_crc=check_crc,
                                                           held=held, index_from=index_from, strict=strict)
                if n:
                    if dispatcher is not None:
                        for w in wanted:
                            parsed = codec.parse(mm, w, file_size)
                            offer(mm, w, parsed, parsed[0][0])
                    pos = end = nxt
                    last_valid = base + last
                    report.records_checked += n
                    progress(base + pos, f.path)
                    if pos >= chunk_end:
                        continue
                # The record the scan did not accept: the full check says why (or accepts it after all).
                item = next(codec.walk(mm, pos, file_size, check_crc=check_crc, parsed=True, base=base,
                                       strict=strict), None)
                if item is None:  # all-zero bytes: the end of written data
                    break
                _, size, parsed, reason = item
                if size == 0:
                    blank = True
                    break
                if parsed is None:  # (a stale copy too: the walk's trusted-record check names it)
                    stop = reason or "invalid record"
                    break
                end = pos + size
                last_valid = base + pos
                report.records_checked += 1
                if dispatcher is not None:
                    offer(mm, pos, parsed, size)
                if report.records_checked % 1024 == 0:
                    progress(base + pos, f.path)
                pos = end
            process = base + end
            if stop is not None:
                report.stopped_because = f"{f.path} at file position {end}: {stop}"
                break
            if not blank or idx + 1 >= len(segments):  # only a blank record leads on to the next segment
                break
            idx += 1
        if dispatcher is None or rescanned:
            break
        refill = [cq for cq, (end, units) in before.items()
                  if cq.gap_at is not None and cq.gap_at == units and end < report.start_offset]
        if not refill:
            break
        rescanned = True
        for cq in refill:
            cq.truncate_dirty_logic(report.start_offset)  # only the units this scan appended point there
            cq.pad_gaps = True  # placed at each record's own queue offset, never appended after the cut (rule 2)
        start_idx = min(_file_index(segments, before[cq][0]) if before[cq][0] >= 0 else 0 for cq in refill)
        log.warning("recovery: %s ended before the records of their next queue offsets (lost units); "
                    "offering the records again from %s", ", ".join(f"{cq.topic}-{cq.queue_id}" for cq in refill),
                    segments[start_idx].path)
        report.start_offset = segments[start_idx].file_from_offset
        held = _held_by_queues(files)
        if index_enabled:
            index_from = index.resume_offset() if report.abnormal else max(index.resume_offset(), max_cq + 1)
        for cq in before:
            cq.gap_at = None
    if writable and report.stopped_because is not None:
        _refuse_to_cut_a_written_record(files, process, report)
    if writable and (report.stopped_because is not None or max_cq > process):
        if not report.abnormal:
            _refuse_to_cut_intact_records(files, process, max_cq, report)
        else:
            _refuse_to_cut_flushed_records(files, process, max_cq, report)
    report.process_offset = process
    report.bytes_checked = process - report.start_offset
    report.confirm_offset = last_valid
    if writable:
        files.checkpoint.confirmPhyOffset = last_valid
    if dispatcher is not None:  # what was rebuilt is durable before the checkpoint can say so
        for cq in files.consume_queues():
            cq.flush_dirty()
        if report.abnormal:
            _sync_written_before_crash(files, report.start_offset)
            _count_synced_as_flushed(files, last_valid, process)
    if max_cq >= process:
        for cq in files.consume_queues():
            n = cq.truncate_dirty_logic(process)
            if n:
                report.queues_truncated[f"{cq.topic}-{cq.queue_id}"] = n
    for cq, (holed, cut) in tail_cut.items():  # tail units whose records lay past the recovered end: truncated
        name = f"{cq.topic}-{cq.queue_id}"
        past = sum(1 for off in cut if off >= process)
        if past:
            report.queues_truncated[name] = report.queues_truncated.get(name, 0) + past
        if past == len(cut) and not holed:
            report.queues_rebuilt.pop(name, None)
    commitlog.queue.flushed_where = process
    if writable:
        files.checkpoint.cut_offsets(process)
    report.deleted_files += commitlog.queue.truncate_dirty(process)
    if writable and (report.stopped_because or check_from is not None):  # after a power loss, pages past a
        report.zeroed_bytes = _zero_stale_tail(commitlog, process)     # lost one may have reached the disk
    if writable and index_enabled:
        # Entries for records at or past the new end would answer for whatever is written there next, and
        # the index's end offset would make dispatch skip the new records.
        report.index_entries_removed = index.truncate(process, _store_time(files))
    if writable:
        for cq in files.consume_queues():
            _check_rebuilt(cq, process, commitlog.min_offset(), report)
    files.recover_topic_queue_table()
    if writable:
        _next_offsets_past_records(files, seen_qoff)
    report.seconds = time.monotonic() - t0
    if report.stopped_because and report.abnormal:
        log.warning("recovery truncated the commitlog at %d: %s", process, report.stopped_because)
    return report


def _sync_written_before_crash(files: "StoreFiles", start: int) -> None:
    """After an unclean stop, fdatasync what the crashed process may have left in the page cache only.

    Recovery takes the files it loads as flushed, so the flush services would never sync the bytes a
    crashed process wrote (a crash of the process alone keeps them in the page cache) while the checkpoint
    goes on to count on them: the commitlog segments from where recovery started, and every consume-queue
    file with units pointing there.  After a reboot the files are already what the disk holds: cheap.

    Also from the checkpoint's offsets when they are lower (from the first segment when the page has none):
    only below them did a flush of the crashed writer sync the log and the queues.  After a crash of the
    process alone the scan may start well past them (one segment before the lowest queue end, when the
    checkpoint's times name no segment), and the segments between were counted as flushed, never synced.
    """
    durable = files.checkpoint.recovery_offset()
    start = min(start, 0 if durable is None else durable)
    for f in files.commitlog.queue.files:
        if f.end_offset > start:
            mapped_file.fdatasync(f.fd)
    for cq in files.consume_queues():
        for f in reversed(cq.queue.files):
            if f.wrote_position >= CQ_STORE_UNIT_SIZE:
                off = struct.unpack_from(">q", f.mm, f.wrote_position - CQ_STORE_UNIT_SIZE)[0]
                if off < start and f is not cq.queue.files[-1]:
                    break
            mapped_file.fdatasync(f.fd)


def _count_synced_as_flushed(files: "StoreFiles", last_valid: int, end: int) -> None:
    """(Once the log recovery kept is synced.)  Move the checkpoint's physicMsgTimestamp up to the last kept
    record's store time: else it stays where the crashed writer's last thorough flush left it, and damage to a
    record synced here is taken, after a later power loss, for a torn tail of unflushed writes and the durable
    records after it are truncated (store model seed 2253).  Set even when lower: every record up to it is
    durable now, and _refuse_to_cut_flushed_records finds a record with this store time after the damage
    (an imported record last keeps its original, older store time).  physicFlushedOffset moves up to ``end``,
    where that record ends, with it."""
    if last_valid < 0:
        return
    ts = files.commitlog.pickup_store_timestamp(last_valid, 0)
    if ts > 0:
        files.checkpoint.note_physic_flushed(ts, end)


def _next_offsets_past_records(files: "StoreFiles", seen_qoff: dict[tuple[str, int], int]) -> None:
    """The next queue offset of a put is past the highest one a record of that queue holds, not only past the
    queue's last unit (data-safety rule 2): a queue whose units end lower lost them, and reusing those
    offsets would give one queue offset to two messages.  Dispatch then places the next units at their own
    offsets (blank units in between, which reads report), never appended at the queue's end."""
    for key, qoff in seen_qoff.items():
        cq = files.cq_table.get(key)
        have = files.topic_queue_table.get(key)
        if cq is None or have is None or qoff < have:
            continue
        log.error("%s-%d: its units end at queue offset %d, but the commitlog holds its record of queue offset %d; "
                  "new messages take queue offsets from %d", key[0], key[1], have, qoff, qoff + 1)
        files.topic_queue_table[key] = qoff + 1
        cq.pad_gaps = True


def cuts_as_torn_tail(files: Any, offset: int) -> bool:
    """Whether recovery after a power loss (an unclean stop of another boot), its scan stopped at damage at
    commitlog ``offset``, takes it for the torn tail of unflushed writes and ends the log there (True), or refuses
    the open as damage to flushed records (False): the rule of the two refusals below, for ``verify --repair``,
    which must end such a tail where recovery would, not keep records a power loss left after a hole.
    ``files``: the commitlog and checkpoint as loaded (``root``, ``commitlog``, ``checkpoint``)."""
    report = RecoveryReport(abnormal=True, stopped_because=f"damage at commitlog offset {offset}")
    try:
        _refuse_to_cut_a_written_record(files, offset, report)
        _refuse_to_cut_flushed_records(files, offset, -1, report)
    except CommitLogDamagedError:
        return False
    return True


def _refuse_to_cut_a_written_record(files: "StoreFiles", process: int, report: RecoveryReport) -> None:
    """After a power loss, refuse to truncate at a record whose header and body are intact (only its tail failed
    a check) when its store time is before the checkpoint's physicMsgTimestamp: a thorough flush that began after
    it covered it, so it reached the disk whole and its damage is the disk's, not a torn write (it may have been
    acknowledged as durable).

    A crash of the process alone may leave a record it was writing with its tail unwritten (never
    acknowledged): that is cut.  A store time equal to physicMsgTimestamp does not tell (a record of the same
    millisecond may have come after the flush began): the record is taken for a torn write.  (After a clean
    shutdown the last record is still cut when nothing intact follows it: ``verify --repair`` rebuilds through
    a clean open, and its plan leaves damage at the log's end to that open.)
    """
    if not report.abnormal or getattr(files, "process_crash_only", False):
        return
    f = files.commitlog.queue.find(process)
    pos = None if f is None else process - f.file_from_offset
    ts = None if f is None else codec.intact_head(f.mm, pos, files.commitlog.file_size, f.file_from_offset)
    if ts is None:
        return
    flushed_to = files.checkpoint.flushed_offset()
    flushed = files.checkpoint.physicMsgTimestamp
    if flushed_to is not None:  # the offset says it exactly (store times need not grow: imported records)
        if process >= flushed_to:
            return
        because = f"it lies before the checkpoint's physicFlushedOffset {flushed_to}"
    elif 0 < ts < flushed:
        because = f"its store time {ts} is before the checkpoint's physicMsgTimestamp {flushed}"
    else:
        return
    raise CommitLogDamagedError(f"{report.stopped_because}: the record at commitlog offset {process} ({f.path} at file "
                                f"position {pos}) has an intact header and body, and {because}: it was flushed before "
                                f"the power loss, so its damage is no torn write; recovery would truncate the log at "
                                f"{process} and lose it. No commitlog byte was changed: run `rocketstore verify "
                                f"{files.root} --repair`")


def _refuse_to_cut_intact_records(files: "StoreFiles", process: int, max_cq: int, report: RecoveryReport) -> None:
    """After a clean shutdown every record was flushed, so a scan that stops before the log's end (at a record
    that fails its checks, or at zero bytes the consume queues point past) met damage, not a torn tail.  When
    an intact record follows, truncating there would delete acknowledged messages (and zero them in the last
    segment): refuse the open before any commitlog byte changes; ``verify --repair`` keeps every valid record.
    """
    nxt = _intact_record_after(files.commitlog, process)
    if nxt is None:
        return
    why = report.stopped_because or f"zero bytes at commitlog offset {process}, below the consume queues' end {max_cq}"
    raise CommitLogDamagedError(f"{why}: the store was shut down cleanly, yet its commitlog has damage here with an intact "
                         f"record after it (at commitlog offset {nxt}); recovery would truncate the log at "
                         f"{process} and lose every record after. No commitlog byte was changed: run `rocketstore verify "
                         f"{files.root} --repair`, which keeps every valid record")


def _refuse_to_cut_flushed_records(files: "StoreFiles", process: int, max_cq: int, report: RecoveryReport) -> None:
    """After an unclean stop, refuse to truncate at damage that is not a torn tail of unflushed writes.

    A crash of the process alone (same boot) loses no page, so damage with an intact record after it is
    real damage, as after a clean shutdown.  After a reboot or power loss, an intact record after the damage
    whose store time is at or before the checkpoint's physicMsgTimestamp (the store time of the last record
    a thorough commitlog flush covered) was on disk, so the damage before it is no torn tail either.
    Otherwise the damage lies among records written after the last flush: truncating there is the torn tail.
    """
    nxt = _intact_record_after(files.commitlog, process)
    if nxt is None:
        return
    why = report.stopped_because or f"zero bytes at commitlog offset {process}, below the consume queues' end {max_cq}"
    flushed_to = files.checkpoint.flushed_offset()
    if getattr(files, "process_crash_only", False):
        because = "only the process crashed (no page can be torn)"
    elif flushed_to is not None:  # the offset says it exactly (store times need not grow: imported records)
        if process >= flushed_to:
            return
        because = f"the damage lies before the checkpoint's physicFlushedOffset {flushed_to} (flushed before the power loss)"
    else:
        flushed = files.checkpoint.physicMsgTimestamp
        ts = files.commitlog.pickup_store_timestamp(nxt, 0)
        if not flushed or ts <= 0:
            return
        if ts <= flushed:
            because = (f"the record after it was flushed before the power loss (store time {ts} is not after "
                       f"the checkpoint's physicMsgTimestamp {flushed})")
        else:
            last = _record_stored_at(files.commitlog, nxt, flushed)
            if last is None:
                return
            because = (f"the records after it were flushed before the power loss (the record at commitlog offset "
                       f"{last}, after them, has the checkpoint's physicMsgTimestamp {flushed} as its store time)")
    raise CommitLogDamagedError(f"{why}: {because}, yet its commitlog has damage here with an intact record after "
                                f"it (at commitlog offset {nxt}); recovery would truncate the log at {process} and "
                                f"lose every record after. No commitlog byte was changed: run `rocketstore verify "
                                f"{files.root} --repair`, which keeps every valid record")


def _record_stored_at(commitlog, offset: int, store_timestamp: int) -> int | None:
    """Commitlog offset of the last intact record from ``offset`` on (as far as the records run unbroken) whose
    store time is ``store_timestamp``; None when there is none.  physicMsgTimestamp is the store time of the last
    record a thorough flush covered, and store times are not monotonic (an imported record keeps its original
    one; a clock can go back): an intact record after the damage stored later than it was still flushed when
    that record lies after it in the log."""
    size = commitlog.file_size
    found = None
    for f in commitlog.queue.files:
        base = f.file_from_offset
        if base + size <= offset:
            continue
        pos = max(0, offset - base)
        blank = False
        for at, n, parsed, _ in codec.walk(f.mm, pos, size, check_crc=True, parsed=True, base=base):
            if n == 0:  # the blank record that ends the segment: on to the next
                blank = True
                break
            if parsed is None:
                return found
            if codec.read_store_timestamp(f.mm, at) == store_timestamp:
                found = base + at
        if not blank:
            return found
    return found


def _intact_record_after(commitlog, offset: int) -> int | None:
    """Commitlog offset of the first record after ``offset`` that passes every check (CRC, PHYSICALOFFSET equal
    to its position), in its segment or a later one; None when there is none."""
    size = commitlog.file_size
    for f in commitlog.queue.files:
        base = f.file_from_offset
        if base + size <= offset:
            continue
        mm = f.mm
        if base > offset:  # a later segment: its first record, then the magic codes after it
            first, parsed, _ = codec.check(mm, 0, size, check_crc=True, parsed=True)
            if parsed is not None and first > 0 and parsed[0][6] == base:
                return base
        p = codec.find_record(mm, max(0, offset - base), size, base, check_crc=True)
        if p is not None and codec.read_total_size(mm, p) != size - p:  # not the blank that ends the file
            return base + p
    return None


def _store_time(files: "StoreFiles"):
    """commitlog offset -> store time of the record there (-1 if none), for the index's end timestamp."""
    return lambda offset: files.commitlog.pickup_store_timestamp(offset, 0)


def _check_rebuilt(cq, process: int, min_phy: int, report: RecoveryReport) -> None:
    """Report a queue cut at a hole that the commitlog's records did not fill up again: units still
    missing, or written as blank units though their records should be in the log (not expired)."""
    cq.pad_gaps = False
    if cq.rebuild_from is None:
        return
    name = f"{cq.topic}-{cq.queue_id}"
    problems = []
    if cq.blank_units and cq.rebuild_from >= min_phy:
        problems += [f"units {a}..{b} have no record in the commitlog (written as blank units)"
                     for a, b in cq.blank_units]
    if cq.lost_units is not None:
        units_end, last_phy = cq.lost_units
        if last_phy < process and cq.max_offset_in_queue < units_end:
            problems.append(f"units {cq.max_offset_in_queue}..{units_end - 1} (up to commitlog offset {last_phy}) "
                            f"are not in the commitlog recovery checked from {report.start_offset}")
    if problems:
        report.not_rebuilt[name] = "; ".join(problems)
        log.error("recovery could not rebuild %s: %s", name, report.not_rebuilt[name])


def queues_with_records_before(files: "StoreFiles", firsts: dict[tuple[str, int], tuple[int, int]]) \
        -> set[tuple[str, int]]:
    """The queues, given as (topic, queue id) -> (commitlog offset, queue offset) of their first unit, that
    have a record in the commitlog before that unit's record with a lower queue offset.

    Retention deletes a queue's first file only once all its units point below
    the commitlog's minimum, so such a record means the file was lost, not
    expired.  One pass from the commitlog's minimum to the highest first unit,
    structure checks only; it stops early at damage (what it found so far).
    """
    found: set[tuple[str, int]] = set()
    if not firsts:
        return found
    held: dict[tuple[bytes, int], int] = {key: codec.NO_INDEX for key in _held_by_queues(files)}
    for topic, qid in firsts:  # codec.scan_records hands back the records of these (and of unknown queues)
        held[(topic.encode("utf-8", "surrogatepass"), qid)] = -1
    stop_at = max(phy for phy, _ in firsts.values())
    file_size = files.commitlog.file_size
    for f in files.commitlog.queue.files:
        base, mm, pos = f.file_from_offset, f.mm, 0
        if base >= stop_at:
            break
        stop = min(file_size, stop_at - base)
        while pos < stop:
            pos, _last, _n, wanted = codec.scan_records(mm, pos, stop, file_size, base=base, check_crc=False,
                                                        held=held)
            for w in wanted:
                h, tp, tl, _ = codec.parse(mm, w, file_size)
                key = (bytes(mm[tp:tp + tl]).decode("utf-8", "replace"), h[3])
                first = firsts.get(key)
                if first is not None and h[6] < first[0] and h[5] < first[1]:
                    found.add(key)
            if len(found) == len(firsts):
                return found
            if pos >= stop:
                break
            item = next(codec.walk(mm, pos, file_size, check_crc=False, parsed=True), None)
            if item is None or item[1] != 0:  # zeros or damage: nothing further to learn here
                return found
            break  # the blank record that ends the segment
    return found


def drop_mismatched_tail(files: "StoreFiles", cq, *, through_tier: bool = False) -> list[int]:
    """Cut the units at the end of ``cq`` that are not valid units of their records; return the commitlog
    offsets they pointed at.

    After an unclean start (and at a hole) the last units may have reached the disk torn: a unit that
    straddles a page boundary keeps its offset and size with a zeroed tagsCode, or points at a record past
    the torn end of the commitlog.  Each unit from the end back to the first valid one (data-safety rule 1:
    a trusted record whose topic, queue id, queue offset, size and tagsCode agree) is zeroed and cut, and
    the queue is rebuilt from the end of the last valid unit: recovery offers every record from there and
    places each at its own queue offset (blank units for any really lost, never an append that shifts).
    ``through_tier``: units naming records only the tier holds are checked too (reading them there).
    """
    min_phy = files.commitlog.min_offset()
    cut: list[int] = []
    while True:
        end = cq.queue.max_offset()  # past the last written unit (an empty last file: where it starts)
        if end < CQ_STORE_UNIT_SIZE or end <= cq.min_logic_offset:
            break
        idx = end // CQ_STORE_UNIT_SIZE - 1
        unit = cq.get_unit(idx)
        if unit is None:
            break
        off, size, tags = unit
        if size == _BLANK_SIZE or 0 <= off < min_phy and not (through_tier and files.commitlog.in_tier(off)):
            break  # a blank unit, or a record retention removed: nothing left to check it against
        why = unit_mismatch(files, cq, idx, off, size, tags)
        if why is None:
            break
        log.warning("%s-%d: unit %d (%d, %d, tagsCode %d) %s; cut, and rebuilt from the commitlog",
                    cq.topic, cq.queue_id, idx, off, size, tags, why)
        pos = idx * CQ_STORE_UNIT_SIZE
        f = cq.queue.find(pos)
        p = pos - f.file_from_offset
        f.zero_from(p, p + CQ_STORE_UNIT_SIZE)
        cq.queue.truncate_dirty(pos)  # and any (empty) file after it
        cut.append(off)
    if cut:
        end = cq.queue.max_offset()
        prev = cq.get_unit(end // CQ_STORE_UNIT_SIZE - 1) if end >= CQ_STORE_UNIT_SIZE else None
        cq.max_physic_offset = prev[0] + prev[1] if prev is not None and 0 < prev[1] < _BLANK_SIZE else -1
        cq.hole_at = end // CQ_STORE_UNIT_SIZE if cq.rebuild_from is None else min(cq.hole_at, end // CQ_STORE_UNIT_SIZE)
        cq.rebuild_from = max(cq.max_physic_offset, 0) if cq.rebuild_from is None else \
            min(cq.rebuild_from, max(cq.max_physic_offset, 0))
        cq.pad_gaps = True  # every later record is placed at its own queue offset
    return cut


_BLANK_SIZE = 0x7FFFFFFF  # the size of a blank unit (PRE_BLANK_UNIT, or one standing for a lost record)


def unit_mismatch(files: "StoreFiles", cq, idx: int, off: int, size: int, tags: int) -> str | None:
    """Why (``off``, ``size``, ``tags``) is not a valid unit ``idx`` of ``cq``, or None when it is.

    Valid (data-safety rule 1): it points at a trusted record (magic, size in bounds, PHYSICALOFFSET equal to
    its position, BODYCRC) whose topic, queue id, queue offset and size agree with it, that a consume queue
    holds (NOT_TYPE or COMMIT), and whose tagsCode, derived from its TAGS as dispatch derives it, is ``tags``.
    """
    commitlog = files.commitlog
    seg = commitlog.queue.find(off) if off >= 0 else None
    if seg is not None:
        mm, pos, base, room = seg.mm, off - seg.file_from_offset, seg.file_from_offset, commitlog.file_size
    elif off >= 0 and commitlog.in_tier(off):  # (a TierError, the tier out of reach, is no answer: raised)
        try:
            mm, _key = commitlog.tier.reader.record_bytes(off)
        except CorruptRecordError as e:
            return f"points at no intact record in the tier ({e})"
        pos, base, room = 0, off, len(mm)
    else:
        return f"points at commitlog offset {off}, in no segment"
    if not 0 < size <= room - pos:
        return f"has size {size}, which runs past its segment"
    # The one trusted-record check (codec.check with base): a stale copy or a torn tail is no record.
    total, msg, reason = codec.check(mm, pos, pos + size, check_crc=True, base=base)
    if msg is None:
        return f"points at no intact record of that size ({reason or 'a blank record'})"
    if total != size:
        return f"has size {size}, its record {total}"
    if (msg.topic, msg.queue_id, msg.queue_offset) != (cq.topic, cq.queue_id, idx):
        return f"points at the record of {msg.topic}-{msg.queue_id} offset {msg.queue_offset}"
    txn = msg.sys_flag & codec.TRANSACTION_MASK
    if txn != codec.TRANSACTION_NOT_TYPE and txn != codec.TRANSACTION_COMMIT:
        return "points at a prepared or rolled-back transaction record"
    code = codec.dispatch_tags_code(msg.topic, msg.properties, msg.store_timestamp)
    if code != tags:
        return f"has tagsCode {tags}, its record's TAGS give {code}"
    return None


def _held_by_queues(files: "StoreFiles") -> dict[tuple[bytes, int], int]:
    """(topic as UTF-8, queue id) -> max physical offset of each consume queue, for :func:`codec.scan_records`."""
    held = {}
    for (topic, qid), cq in files.cq_table.items():
        try:
            held[(topic.encode("utf-8"), qid)] = cq.max_physic_offset
        except UnicodeEncodeError:  # a name no topic decodes to (lone surrogates): it holds nothing to skip
            pass
    return held


def _queue_needs(files: "StoreFiles", mm, parsed: tuple, size: int, topics: dict[bytes, str],
                 deltas: dict | None = None) -> bool:
    """Whether a record belongs in a consume queue that does not hold it yet (and names that queue truly).

    ``deltas``: per queue, the last queue-offset mismatch checked, so a run of records after a gap costs one
    :meth:`StoreFiles.queue_claiming` search, not one per record."""
    h, tp, tl, _ = parsed
    txn = h[7] & codec.TRANSACTION_MASK
    if txn != codec.TRANSACTION_NOT_TYPE and txn != codec.TRANSACTION_COMMIT:
        return False
    raw = mm[tp:tp + tl]
    topic = topics.get(raw)
    if topic is None:
        topic = topics[raw] = raw.decode("utf-8", "replace")
    cq = files.cq_table.get((topic, h[3]))
    if cq is not None and h[6] + size <= cq.max_physic_offset:
        return False
    if cq is None or h[5] != cq.max_offset_in_queue:  # a new queue, or not its next offset: a damaged header?
        delta = None if cq is None else h[5] - cq.max_offset_in_queue
        if deltas is not None and delta is not None and deltas.get(cq) == delta:
            return True  # the same shift as the record before (a gap dispatch writes through): checked then
        if deltas is not None and cq is not None:
            deltas[cq] = delta
        claim = files.queue_claiming(h[6], topic, h[3], h[5], h[7])
        if claim is not None:
            log.error("record at commitlog offset %d says %s-%d offset %d, but %s-%d unit %d points at it: its "
                      "header was damaged; not dispatched (verify --repair restores it)", h[6], topic, h[3], h[5],
                      *claim)
            return False
    return True


def _zero_stale_tail(commitlog, offset: int) -> int:
    """Zero the bytes left after the recovered end of the last segment (RocketMQ leaves them).

    Stale records there could otherwise pass every check after the next write
    lands just before them.
    """
    f = commitlog.queue.find(offset)
    return 0 if f is None else f.zero_from(offset - f.file_from_offset)


def _start_file(files: "StoreFiles", last_exit_ok: bool, max_cq: int, min_cq: int, cp_start: int | None) -> int:
    segments = files.commitlog.queue.files
    if last_exit_ok:
        for i in range(len(segments) - 1, -1, -1):
            if segments[i].file_from_offset <= max_cq:
                return i
        return 0
    if cp_start is not None:
        return cp_start
    if not getattr(files, "process_crash_only", False):
        # No point durable for every queue (logicsMsgTimestamp is 0 until a thorough flush of every consume
        # queue; the checkpoint may be lost): after a reboot or power loss a quiet queue's file may be zeros
        # whatever the busier queues reached.  Re-dispatch from the first segment, as RocketMQ does.
        if segments:
            log.info("checkpoint times give no start segment; re-checking the commitlog from %s", segments[0].path)
        return 0
    # After a crash of the process alone every unit written survives in the page cache, and dispatch runs in
    # commitlog order: a record no queue holds lies past every queue's end.  Start one segment before the
    # lowest queue end (the segment before covers a loss that spans a segment boundary).
    start = max(0, _file_index(segments, min_cq) - 1) if min_cq >= 0 else 0
    if files.config.messageIndexEnable:
        start = min(start, _file_index(segments, files.index_service.resume_offset()))
    if start:
        log.info("checkpoint times give no start segment; starting at %s (consume queues reach %d)",
                 segments[start].path, max_cq)
    return start


def _checkpoint_start(files: "StoreFiles") -> int | None:
    """After a crash: the newest segment whose first record is older than the checkpoint's times (less
    3 s), where RocketMQ starts checking, or an earlier one holding the checkpoint's offsets (the flushed
    commitlog, the dispatch reached when the queues were last flushed whole): store times are not monotonic,
    and a segment that begins with an imported record would otherwise start recovery past records whose
    queue units were never made durable; None when no segment is."""
    segments = files.commitlog.queue.files
    cp = files.checkpoint
    bound = cp.min_timestamp()
    if files.config.messageIndexEnable and files.config.messageIndexSafe:
        bound = cp.min_timestamp_index()
    for i in range(len(segments) - 1, -1, -1):
        mm = segments[i].mm
        magic = int.from_bytes(mm[4:8], "big")
        if magic not in (codec.MAGIC_V1, codec.MAGIC_V2):
            continue
        ts = codec.read_store_timestamp(mm, 0)
        if ts != 0 and ts <= bound:
            off = cp.recovery_offset()
            return i if off is None else min(i, _file_index(segments, off))
    return None


def _file_index(segments: list, offset: int) -> int:
    for i in range(len(segments) - 1, -1, -1):
        if segments[i].file_from_offset <= offset:
            return i
    return 0
