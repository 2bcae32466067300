"""Retention: expired-file cleaning (CleanCommitLogService, CleanConsumeQueueService) and the disk guard.

The clock (``files.clock``) and the disk reading (``DiskGuard.usage``) are
injectable, so every rule can be tested in milliseconds.  RocketMQ's rules:

* a commitlog segment is expired when its mtime is older than fileReservedTime;
* deletion runs at the deleteWhen hours, when disk usage passes
  diskMaxUsedSpaceRatio, or while a manual request is pending (20 rounds);
* above diskSpaceCleanForciblyRatio the reserve time is ignored; above
  diskSpaceWarningLevelRatio the store refuses puts (DISK_FULL) until usage drops;
* the last segment is never deleted; the scan stops at the first unexpired one;
  at most deleteFileBatchMax per round; a referenced file is destroyed after
  destroyMapedFileIntervalForcibly.

rocketstore runs the disk check on its own one-second timer (``DiskGuardService``)
so that a slow deletion never delays it, and clears DISK_FULL as soon as it sees
space again; the refusal names the rule and the numbers.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..storage.consumer_offsets import lowest_committed_offsets
from ..storage.index import index_file_size
from .base import ServiceThread

if TYPE_CHECKING:
    from ..storage.mapped_file import MappedFile
    from ..storage.files import StoreFiles

log = logging.getLogger(__name__)
MANUAL_DELETE_ROUNDS = 20


def disk_usage_ratio(path: str) -> float:
    """Used fraction of the file system holding ``path``, rounded up to a whole percent (RocketMQ's rule)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return -1.0
    total, free, avail = st.f_blocks * st.f_frsize, st.f_bfree * st.f_frsize, st.f_bavail * st.f_frsize
    used = total - free
    denom = used + avail
    if denom <= 0:
        return -1.0
    return math.ceil(100 * used / denom) / 100


def disk_free_bytes(path: str) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


@dataclass
class DiskVerdict:
    ratio: float
    clean_immediately: bool
    space_to_delete: bool
    disk_full_reason: str | None
    free_bytes: int = -1
    needed_free_bytes: int = 0


class CleanService(ServiceThread):
    """Runs the commitlog cleaner, then the consume-queue and index cleaner, every cleanResourceInterval."""

    name = "CleanService"

    def __init__(self, files: "StoreFiles", disk_guard: "DiskGuard") -> None:
        cfg = files.config
        super().__init__(interval=cfg.cleanResourceInterval / 1000, initial_delay=60.0)
        self.files = files
        self.disk_guard = disk_guard
        self.manual_delete_rounds = 0
        self.last_physical_min_offset = 0
        self._last_redelete = 0.0

    def run_once(self) -> None:
        self.clean_commitlog()
        self.clean_consume_queues()

    # ------------------------------------------------------------ commitlog
    def request_manual_delete(self) -> None:
        """RocketMQ's ``mqadmin deleteExpiredCommitLog``: 20 rounds that delete expired files at any hour."""
        self.manual_delete_rounds = MANUAL_DELETE_ROUNDS

    def is_time_to_delete(self) -> bool:
        hour = time.localtime(self.files.clock()).tm_hour
        return any(int(h) == hour for h in self.files.config.deleteWhen.split(";") if h.strip())

    def clean_commitlog(self) -> list[str]:
        cfg = self.files.config
        time_up = self.is_time_to_delete()
        verdict = self.disk_guard.check()
        manual = self.manual_delete_rounds > 0
        deleted: list[str] = []
        if time_up or verdict.space_to_delete or manual:
            if manual:
                self.manual_delete_rounds -= 1
            clean_at_once = cfg.cleanFileForciblyEnable and verdict.clean_immediately
            deleted = self.delete_expired_commitlog_files(clean_at_once)
            if deleted:
                log.info("deleted %d expired commitlog segment(s) (time=%s, space=%s, manual=%s, forcibly=%s)",
                         len(deleted), time_up, verdict.space_to_delete, manual, clean_at_once)
        self.redelete_hanged_file()
        return deleted

    def expired_ms(self) -> int:
        return self.files.config.fileReservedTime * 3600 * 1000

    def delete_expired_commitlog_files(self, clean_immediately: bool) -> list[str]:
        files, cfg = self.files, self.files.config
        queue = files.commitlog.queue
        now_ms = files.clock() * 1000
        deleted: list[MappedFile] = []
        candidates = queue.files[:-1]
        tier = files.tier
        for i, f in enumerate(candidates):
            if not (clean_immediately or now_ms >= _mtime_ms(f.path) + self.expired_ms()):
                break
            if tier is not None and not tier.has_segment(f.file_from_offset, f.file_size):
                # Tiered: a segment leaves the disk only once the tier holds it (a full disk then turns the
                # store read-only rather than lose it).
                log.info("%s expired but is not in the tier %s yet; kept", f.path, tier.loc.uri)
                break
            if tier is not None and not self._queue_units_durable(f.end_offset):
                # Its records stay readable from the tier, and recovery re-dispatches local segments only:
                # units a power cut could still lose would leave them in no queue (skipped by every read).
                log.info("%s expired but the consume-queue units of its records are not all dispatched and "
                         "flushed yet; kept", f.path)
                break
            if not deleted:  # the queue offsets of the records about to go must outlive them (queue registry)
                files.save_queue_registry()
            if not f.destroy(cfg.destroyMapedFileIntervalForcibly, now=files.clock()):
                break
            deleted.append(f)
            if len(deleted) >= cfg.deleteFileBatchMax:
                break
            if i + 1 < len(candidates) and cfg.deleteCommitLogFilesInterval:
                files.sleep(cfg.deleteCommitLogFilesInterval / 1000)
        queue.delete_files(deleted)
        return [f.path for f in deleted]

    def _queue_units_durable(self, end: int) -> bool:
        """Whether every record before commitlog offset ``end`` has its consume-queue unit on disk: dispatch
        has passed ``end`` and the queues were flushed whole since (the checkpoint's logicsDispatchedOffset),
        flushing them here when dispatch is past it but the flush is not.  Records the index missed (no index
        file can be made: a full disk) do not count: the index catch-up skips what left the disk, as without a
        tier, and waiting for it kept every tiered segment on a full disk."""
        cp = self.files.checkpoint
        durable = max(cp.logicsDispatchedOffset, cp.logics_units_flushed)
        if durable < end <= cp.logics_dispatched_end:
            from .flush import FlushConsumeQueueService
            FlushConsumeQueueService(self.files).run_once(force=True)
        return max(cp.logicsDispatchedOffset, cp.logics_units_flushed) >= end

    def redelete_hanged_file(self) -> None:
        files, cfg = self.files, self.files.config
        now = files.clock()
        if (now - self._last_redelete) * 1000 < cfg.redeleteHangedFileInterval:
            return
        self._last_redelete = now
        queue = files.commitlog.queue
        first = queue.first()
        if first is not None and not first.available and first is not queue.last():
            if first.destroy(cfg.destroyMapedFileIntervalForcibly, now=now):
                queue.delete_files([first])
                log.info("re-deleted hanging segment %s", first.path)

    # ------------------------------------------------------------ consume queues and index
    def clean_consume_queues(self) -> int:
        files, cfg = self.files, self.files.config
        files.apply_topic_retention()
        m = files.commitlog.min_offset()
        tier = files.tier
        if tier is None:
            if m <= self.last_physical_min_offset:
                return 0
            self.last_physical_min_offset = m
        n = 0
        readable = files.commitlog.min_offset_with_tier()
        for cq in files.consume_queues():
            gate = None if tier is None else \
                (lambda name, last_phy, cq=cq: tier.has_queue_file(cq.topic, cq.queue_id, name, last_phy))
            d = cq.delete_expired_file(m, may_delete=gate, readable_min=readable)
            n += d
            if d and cfg.deleteConsumeQueueFilesInterval:
                files.sleep(cfg.deleteConsumeQueueFilesInterval / 1000)
        files.index_service.delete_expired_file(m, None if tier is None else tier.has_index_file)
        return n


def _mtime_ms(path: str) -> float:
    try:
        return os.path.getmtime(path) * 1000
    except OSError:
        return 0.0


class DiskGuard:
    """Reads disk usage and sets or clears DISK_FULL, naming the rule and the numbers."""

    def __init__(self, files: "StoreFiles", usage: Callable[[str], float] = disk_usage_ratio,
                 free_bytes: Callable[[str], int] = disk_free_bytes) -> None:
        self.files = files
        self.usage = usage
        self.free_bytes = free_bytes
        self.last: DiskVerdict | None = None

    def thresholds(self) -> dict[str, float]:
        cfg = self.files.config
        return {"warning": min(max(cfg.diskSpaceWarningLevelRatio / 100, 0.35), 0.90),
                "forcibly": min(max(cfg.diskSpaceCleanForciblyRatio / 100, 0.30), 0.85),
                "max": min(max(cfg.diskMaxUsedSpaceRatio, 10), 95) / 100}

    def check(self) -> DiskVerdict:
        files, cfg = self.files, self.files.config
        th = self.thresholds()
        p = self.usage(files.paths.commitlog)
        q = self.usage(files.paths.consumequeue)
        reason = None
        clean_now = False
        for label, ratio in (("commitlog", p), ("consumequeue", q)):
            if ratio > th["warning"]:
                reason = reason or (f"disk {ratio * 100:.1f} % used ({label}) > diskSpaceWarningLevelRatio "
                                    f"{th['warning'] * 100:.0f} %")
                clean_now = True
            elif ratio > th["forcibly"]:
                clean_now = True
        needs = self.space_needed()
        needed = sum(needs.values())
        free = self.free_bytes(files.paths.commitlog) if needed else -1
        if 0 <= free < needed:
            reason = reason or (f"disk has {free} bytes free < {needed} needed ("
                                + " + ".join(f"{k} {v}" for k, v in needs.items()) + ")")
            if free < cfg.diskMinFreeBytes:  # only the configured floor also deletes files early
                clean_now = True
        if reason:
            if not files.running_flags.is_disk_full():
                log.warning("%s: refusing puts: %s", files.root, reason)
            files.running_flags.make_disk_full(reason)
        elif files.running_flags.is_disk_full():
            files.running_flags.clear_disk_full()
            log.info("%s: disk has space again (%.1f %% used); accepting puts", files.root, p * 100)
        space = clean_now or p < 0 or p > th["max"] or q < 0 or q > th["max"]
        self.last = DiskVerdict(p, clean_now, space, reason, free, needed)
        return self.last

    def space_needed(self) -> dict[str, int]:
        """Free bytes the store needs before it fills the files it has: the next commitlog segment (unless
        already made ahead), the next index file (made whole, even on a small disk) and diskMinFreeBytes."""
        files, cfg = self.files, self.files.config
        needs = {}
        if not files.commitlog.queue.next_file_reserved():
            needs["next commitlog segment"] = cfg.mappedFileSizeCommitLog
        if cfg.messageIndexEnable:
            needs["next index file"] = index_file_size(cfg.maxHashSlotNum, cfg.maxIndexNum)
        if cfg.diskMinFreeBytes > 0:
            needs["diskMinFreeBytes"] = cfg.diskMinFreeBytes
        return needs

    def to_json(self) -> dict[str, Any]:
        v = self.last or self.check()
        th = self.thresholds()
        return {"usedRatio": v.ratio, "diskMaxUsedSpaceRatio": th["max"], "diskSpaceCleanForciblyRatio":
                th["forcibly"], "diskSpaceWarningLevelRatio": th["warning"], "diskFull": v.disk_full_reason,
                "freeBytes": v.free_bytes, "neededFreeBytes": v.needed_free_bytes}


class DiskGuardService(ServiceThread):
    """Checks the disk every second, independently of the cleaners."""

    name = "DiskGuardService"

    def __init__(self, disk_guard: DiskGuard, interval: float = 1.0) -> None:
        super().__init__(interval=interval)
        self.disk_guard = disk_guard

    def run_once(self) -> None:
        self.disk_guard.check()


def retention_plan(files: "StoreFiles", clean: CleanService) -> dict[str, Any]:
    """Dry run of the commitlog cleaner: each segment's age and whether (and by which rule) it would go now."""
    cfg = files.config
    guard = clean.disk_guard
    th = guard.thresholds()
    ratio = guard.usage(files.paths.commitlog)
    time_up = clean.is_time_to_delete()
    forcibly = cfg.cleanFileForciblyEnable and ratio > th["forcibly"]
    space = ratio < 0 or ratio > th["max"] or forcibly
    now_ms = files.clock() * 1000
    segs = files.commitlog.queue.files
    segments = []
    stopped = False
    deleted = 0
    for i, f in enumerate(segs):
        age_h = (now_ms - _mtime_ms(f.path)) / 3600000
        expired = now_ms >= _mtime_ms(f.path) + clean.expired_ms()
        if i == len(segs) - 1:
            would, reason = False, "last segment is never deleted"
        elif stopped:
            would, reason = False, "an earlier segment is kept, and deletion never leaves holes"
        elif deleted >= cfg.deleteFileBatchMax:
            would, reason = False, f"deleteFileBatchMax {cfg.deleteFileBatchMax} reached this round"
        elif forcibly:
            would, reason = True, (f"disk {ratio * 100:.1f} % used > diskSpaceCleanForciblyRatio "
                                   f"{th['forcibly'] * 100:.0f} %: deleted regardless of age")
        elif not expired:
            would = False
            reason = f"not expired: {cfg.fileReservedTime} h reserve ends in {cfg.fileReservedTime - age_h:.1f} h"
            stopped = True
        elif time_up:
            would, reason = True, f"expired, and the hour is in deleteWhen={cfg.deleteWhen}"
        elif space:
            would, reason = True, (f"expired, and disk {ratio * 100:.1f} % used > diskMaxUsedSpaceRatio "
                                   f"{th['max'] * 100:.0f} %")
        else:
            would, reason = False, f"expired; waits for deleteWhen={cfg.deleteWhen}, disk pressure or a manual delete"
        if would:
            deleted += 1
        segments.append({"file": f.path, "fromOffset": f.file_from_offset, "size": f.file_size,
                         "ageHours": round(age_h, 2), "expired": expired, "wouldDelete": would, "reason": reason})
    warnings: list[str] = []
    consumed_at = lowest_committed_offsets(files.paths.config, warnings)
    doomed_end = max((s["fromOffset"] + s["size"] for s in segments if s["wouldDelete"]), default=-1)
    if doomed_end > 0:
        for (topic, qid), consumed in consumed_at.items():
            cq = files.cq_table.get((topic, qid))
            unit = cq.get_unit(consumed) if cq else None
            if unit is not None and unit[0] < doomed_end:
                warnings.append(f"{topic}-{qid}: a consumer group is at offset {consumed}, whose message "
                                f"(commitlog {unit[0]}) is in a segment that would be deleted")
    topics = []
    limits = cfg.topic_retention()
    for (topic, qid) in files.queue_keys():
        if topic in limits:
            cq = files.find_consume_queue(topic, qid)
            physical = cq.physical_min_offset
            logical = cq.min_offset_in_queue
            topics.append({"topic": topic, "queueId": qid, "topicRetentionMs": limits[topic],
                           "physicalMinOffset": physical, "logicalMinOffset": logical,
                           "maxOffset": cq.max_offset_in_queue})
    return {"segments": segments, "disk": guard.to_json(), "warnings": warnings, "topicRetention": topics}
