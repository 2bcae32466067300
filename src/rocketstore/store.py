"""MessageStore: the embedded store (RocketMQ's DefaultMessageStore), writable or read-only.

Opening reads the directory the way RocketMQ's ``load()`` does: the ``abort``
file says whether the last exit was clean, then the CommitLog, the consume
queues, the checkpoint and the index are loaded and recovered.  A read-only
store does all of that in memory and never writes a byte (no lock, no abort
file, maps opened read-only), so it can read a live or a read-only directory.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from itertools import islice
from time import perf_counter
from typing import Any, Callable, Iterator

from . import codec
from .checkpoint import StoreCheckpoint
from .clean import CleanService, DiskGuard, DiskGuardService, disk_usage_ratio
from .codec import MessageExt
from .commitlog import CommitLog
from .config import SYNC_FLUSH, StoreConfig, total_memory_bytes
from .consume_queue import CQ_STORE_UNIT_SIZE, LOWER, ConsumeQueue
from .dispatch import HAND_OVER_LIMIT, ReputMessageService
from .encoder import MessageEncoder
from .errors import CommitLogWriteError, CorruptRecordError, ReadOnlyStoreError, StoreClosedError, StoreLoadError
from .flush import CheckpointService, FlushConsumeQueueService, FlushRealTimeService, GroupCommitService
from .geometry import STORE_CONF, reserved_bytes, store_config
from .index import IndexService
from .jsonfile import write_file_durably
from .message import (DEFAULT_STORE_HOST, GetMessageResult, GetMessageStatus, Message, PutMessageResult,
                      PutMessageStatus, QueryMessageResult, host_tuple, illegal_topic, parse_tag_filter)
from .metrics import SAMPLE_EVERY, MetricsService, StoreMetrics
from .quarantine import QuarantinePlan, extend_torn_last_segment, file_kind
from .recovery import RecoveryReport, queues_with_records_before, recover
from .running_flags import RunningFlags
from .store_lock import StoreLock
from .tier.objectstore import TierError
from .tier.tiered import TieredStorage
from .tier.upload import TierUploadService
from .warm_ahead import WarmAheadService

log = logging.getLogger(__name__)
# How far a get walks the commitlog for the record of a unit whose offset was damaged (see
# MessageStore._misplaced_unit_record): a few RocketMQ maximum-size messages.
MISPLACED_SEARCH_BYTES = 16 << 20
BLANK_UNIT_SIZE = 0x7FFFFFFF  # the size of a blank consume-queue unit (PRE_BLANK_UNIT): it names no record
BLANK_LOOK_BACK = 65536  # units a get looks back over for the last one before a blank unit that names a record


class StorePaths:
    """Where each file of a store lives (RocketMQ's StorePathConfigHelper)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.commitlog = os.path.join(root, "commitlog")
        self.consumequeue = os.path.join(root, "consumequeue")
        self.index = os.path.join(root, "index")
        self.checkpoint = os.path.join(root, "checkpoint")
        self.lock = os.path.join(root, "lock")
        self.abort = os.path.join(root, "abort")
        self.abort_bak = os.path.join(root, "abort.bak")
        self.abort_boot = os.path.join(root, "abort.bootid")  # rocketstore: the OS boot the abort file is from
        self.config = os.path.join(root, "config")
        self.quarantine = os.path.join(root, "quarantine")
        self.cq_rebuild = os.path.join(root, "consumequeue.rebuild")  # rocketstore: queues being rebuilt
        self.repair_marker = os.path.join(root, "repair.json")  # rocketstore: a repair under way (repair.py)
        self.index_rebuild = os.path.join(root, "index.rebuild")  # rocketstore: index entries being rebuilt
        # rocketstore: every queue the store ever created, "topic/queueId" a line (missing is not empty)
        self.queue_registry = os.path.join(root, "config", "consumeQueues.registry")


def infer_config(root: str, base: StoreConfig | None = None) -> StoreConfig:
    """The config an open of ``root`` uses (see :func:`geometry.store_config`): measured before files move."""
    return store_config(root, base)


class MessageStore:
    """An open store.  Use :meth:`open`; it is a context manager."""

    def __init__(self, root: str, config: StoreConfig, *, read_only: bool = False,
                 clock: Callable[[], float] = time.time, start_services: bool = True,
                 disk_usage: Callable[[str], float] | None = None, sleep: Callable[[float], None] = time.sleep,
                 allow_quarantine: bool = False, repairing: bool = False) -> None:
        self.paths = StorePaths(root)
        self.sleep = sleep
        self.root = root
        self.config = config
        self.read_only = read_only
        self.allow_quarantine = allow_quarantine
        self._quarantine = QuarantinePlan(root, allow_quarantine)  # carried out once loading has seen every file
        self.queues_to_rebuild: list[str] = []  # "topic/queueId" that recovery refills from the commitlog
        self._registry: set[tuple[str, int]] | None = None  # the queues known to exist (paths.queue_registry)
        self.clock = clock
        self.running_flags = RunningFlags()
        self.flush_error: str | None = None
        self.closed = False
        self._store_lock: StoreLock | None = None
        self._cq_table: dict[tuple[str, int], ConsumeQueue] = {}
        self._cq_lock = threading.Lock()
        self.topic_queue_table: dict[tuple[str, int], int] = {}
        self._services: list[Any] = []
        self.reput: ReputMessageService | None = None
        self.group_commit: GroupCommitService | None = None
        self.recovery_report: RecoveryReport | None = None
        self.disk_guard = DiskGuard(self, disk_usage or disk_usage_ratio)
        self.clean_service = CleanService(self)
        self._ram = total_memory_bytes()
        self.metrics = StoreMetrics()
        self.encoder = MessageEncoder.for_config(config)
        self.tier: TieredStorage | None = None

        if not os.path.isdir(root):
            if read_only:
                raise StoreLoadError(f"{root}: no such store directory")
            os.makedirs(root, exist_ok=True)
        elif read_only:
            self._refuse_non_store()
        else:
            self._refuse_foreign_directory()
        if not repairing:
            self._check_repair_marker()
        if not read_only:
            self._acquire_lock()
        try:
            self._load()
            if not read_only and start_services:
                self._start()
        except BaseException:
            self._release_lock()
            self._close_files()
            raise

    # ------------------------------------------------------------ opening
    @classmethod
    def open(cls, path: str, config: StoreConfig | str | None = None, *, read_only: bool = False,
             allow_quarantine: bool = False, **kw: Any) -> "MessageStore":
        """Open (or, writable, create) the store at ``path``.

        ``config`` is a StoreConfig, a ``broker.conf`` path, or None; it overlays
        ``<path>/broker.conf`` when that exists (``rocketstore init``).  Geometry
        keys neither sets explicitly are measured from the files; one that
        contradicts them refuses the open (ConfigError) before anything is
        touched.  ``allow_quarantine``: let such a key win, and let one open move
        more than one file of a kind to ``quarantine/`` (refused otherwise).
        """
        if isinstance(config, str):
            config = StoreConfig.load(config)
        if not kw.get("repairing") and os.path.exists(StorePaths(path).repair_marker):
            _repair_marker_gate(path, config, read_only)  # before the geometry is measured from half-swapped files
        config = store_config(path, config, allow_quarantine=allow_quarantine)
        return cls(path, config, read_only=read_only, allow_quarantine=allow_quarantine, **kw)

    def __enter__(self) -> "MessageStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _refuse_foreign_directory(self) -> None:
        known = {"commitlog", "consumequeue", "index", "checkpoint", "lock", "abort", "abort.bak", "config",
                 "abort.bootid", "metrics.json", "consumequeue.rebuild", "repair.json", "index.rebuild",
                 "quarantine", "compaction", "timerwheel", "timerlog", "timercheck", "timermetrics"}
        entries = [e for e in os.listdir(self.root) if not e.startswith(".")]
        # A broker.conf alone marks a store made by init; beside other files it may be a RocketMQ conf/ directory.
        if entries and entries != [STORE_CONF] and not any(e in known for e in entries):
            raise StoreLoadError(f"{self.root}: directory holds files that are not a message store "
                                 f"({', '.join(sorted(entries)[:3])}); refusing to write into it")

    def _refuse_non_store(self) -> None:
        """A reader given a directory that holds no store would report it as empty and healthy: refuse."""
        marks = ("commitlog", "consumequeue", "index", "checkpoint")
        if not any(os.path.exists(os.path.join(self.root, m)) for m in marks):
            raise StoreLoadError(f"{self.root}: not a message store (no commitlog/, consumequeue/, index/ "
                                 "or checkpoint)")

    def _acquire_lock(self) -> None:
        self._store_lock = StoreLock(self.root)
        self._store_lock.acquire()

    def _release_lock(self) -> None:
        if self._store_lock is not None:
            self._store_lock.release()
            self._store_lock = None

    def _load(self) -> None:
        cfg, ro = self.config, self.read_only
        self.last_exit_ok = not os.path.exists(self.paths.abort)
        self.abort_file_present = not self.last_exit_ok
        # After a crash of the process alone (same OS boot), every byte written through the maps is intact,
        # so the index files need not be dropped and rebuilt; after a reboot or power loss they may be torn.
        self.process_crash_only = self.abort_file_present and _boot_id() is not None and \
            _read_text(self.paths.abort_boot) == _boot_id()
        if not ro:
            os.makedirs(self.paths.commitlog, exist_ok=True)
            os.makedirs(self.paths.consumequeue, exist_ok=True)
        self.commitlog = CommitLog(self.paths.commitlog, cfg.mappedFileSizeCommitLog, read_only=ro, clock=self.clock,
                                   warm=cfg.warmMapedFileEnable, gather_all=cfg.flushDiskType == SYNC_FLUSH)
        unfinished = _read_text(self.paths.cq_rebuild)
        if unfinished is not None:
            if ro:
                raise StoreLoadError(f"{self.paths.cq_rebuild}: the rebuild of consume queues {unfinished.split()} "
                                     "has not finished; a writable open (rocketstore recover) finishes it")
            self.queues_to_rebuild += unfinished.split()
        self._extend_torn_last_segment()
        self.commitlog.load(on_bad_file=self._on_bad_file)
        if cfg.tieredStoreUri:
            self.tier = TieredStorage(self.root, cfg, read_only=ro)
            self.tier.refresh(quiet=True)  # a tier that cannot be reached is recorded, not fatal: local data stays readable
            self.commitlog.tier = self.tier
        self._load_consume_queues()
        self._check_quarantine()  # before the checkpoint and the index are touched
        if not ro:
            self._refill_lost_first_files()
        self.checkpoint = StoreCheckpoint.load(self.paths.checkpoint, read_only=ro, on_bad=self._on_bad_file)
        self.index_service = IndexService(self.paths.index, cfg.maxHashSlotNum, cfg.maxIndexNum, read_only=ro,
                                          clock=self.clock, on_file_full=self._on_index_file_full)
        dropped = self.index_service.load(self.last_exit_ok or ro or self.process_crash_only,
                                          self.checkpoint.indexMsgTimestamp,
                                          on_bad_file=self._on_bad_index_file)
        reindex = self._plan_reindex()
        self._move_to_quarantine()
        reindex_from = self.index_service.resume_offset()
        loaded = set(self._cq_table)
        if not ro:
            self._registry = self._read_queue_registry(loaded)
        for name in self.queues_to_rebuild:  # a rebuild places each unit at its record's queue offset
            topic, _, qid = name.rpartition("/")
            if (cq := self._cq_table.get((topic, int(qid)))) is not None:
                cq.pad_gaps = True
        self.recovery_report = recover(self, self.last_exit_ok)
        self.recovery_report.index_files_dropped = dropped
        if not ro:
            self._refill_lost_queues(loaded)
            self._write_queue_registry()
        self._finish_queue_rebuild()
        if reindex:
            self._reindex_lost_entries(reindex_from)
        self.commitlog.confirm_offset = self.commitlog.max_offset()

    def _plan_reindex(self) -> bool:
        """Whether index entries were lost with a damaged index file (moved to quarantine, the files after it
        dropped) or by an unfinished rebuild: a marker that says so is made durable before any file moves,
        so a crash before the rebuild ends leaves it to the next writable open (missing is not empty)."""
        unfinished = os.path.exists(self.paths.index_rebuild)
        index = self.index_service
        if not index.files and not index.damaged and self.config.messageIndexEnable and \
                self.commitlog.max_offset() > self.commitlog.min_offset():
            # Dispatch makes an index file for the first record, and retention never deletes the last one:
            # no index file beside records means the index was lost, not that no record has a key.
            index.damaged[self.paths.index] = "no index file, yet the commitlog holds records (a lost index)"
        if not (unfinished or index.damaged):
            return False
        if self.read_only:
            if not unfinished:
                return False  # a query raises, naming the damaged file
            raise StoreLoadError(f"{self.paths.index_rebuild}: the rebuild of index entries has not finished; a "
                                 "writable open (rocketstore recover) finishes it")
        if self.index_service.damaged:
            write_file_durably(self.paths.index_rebuild, ("\n".join(self.index_service.damaged) + "\n").encode())
        return True

    def _reindex_lost_entries(self, start: int) -> None:
        """Index again every record from ``start`` (where the index files kept end) to the log's end.

        Only records the index lacks are offered: after a clean shutdown
        recovery indexes just the records past the consume queues' end, so any
        it added are taken back first (entries go in commitlog order).  Walks
        trusted records only (a stale copy at the wrong position is skipped).
        """
        index = self.index_service
        if self.config.messageIndexEnable:
            if not self.recovery_report.abnormal and index.resume_offset() > start:
                index.truncate(start + 1, lambda off: self.commitlog.pickup_store_timestamp(off, 0))
            start = max(index.resume_offset(), self.commitlog.min_offset())
            from .dispatch import CommitLogDispatcher
            dispatcher = CommitLogDispatcher(self)
            n = 0
            for off, _size, msg, problem in self.messages(start, read_body=False, skip_damaged=True):
                if msg is None:
                    log.warning("index rebuild: %s; not indexed", problem)
                    continue
                if msg.commit_log_offset != off or msg.sys_flag & codec.TRANSACTION_MASK == \
                        codec.TRANSACTION_ROLLBACK:
                    continue
                dispatcher.dispatch(msg, index=True, queue=False)
                n += 1
            index.flush()
            log.warning("index entries rebuilt from the commitlog for %d records from offset %d (damaged: %s)", n,
                        start, ", ".join(index.damaged) or "an unfinished rebuild")
        index.damaged.clear()
        os.unlink(self.paths.index_rebuild)

    def _on_bad_file(self, path: str, reason: str) -> None:
        """A bad file: refuse when read-only; when writable, plan to move it to quarantine/ (rocketstore
        extension), done by :meth:`_move_to_quarantine` once loading has seen every file."""
        if self.read_only:
            raise StoreLoadError(f"{path}: {reason}")
        self._quarantine.moves.append((path, reason))

    def _check_repair_marker(self) -> None:
        if os.path.exists(self.paths.repair_marker):
            _repair_marker_gate(self.root, self.config, self.read_only)

    def _extend_torn_last_segment(self) -> None:
        """A short last segment holding records is torn, not a stray: extended (writable) or refused (read-only)
        before it loads, never moved to quarantine/ (see quarantine.extend_torn_last_segment)."""
        extend_torn_last_segment(self.paths.commitlog, self.config.mappedFileSizeCommitLog, self.read_only)

    def _on_bad_index_file(self, path: str, reason: str) -> None:
        """A damaged index file is a cache of the commitlog: a writable open moves it to quarantine/ and
        rebuilds its entries (:meth:`_reindex_lost_entries`); a reader goes on without it (a query raises,
        naming it) rather than refuse reads that need no index.  A stray file is refused as before."""
        name = os.path.basename(path)
        if self.read_only and len(name) == 17 and name.isdigit():
            log.info("%s: %s; its keys cannot be found until a writable open (rocketstore recover) rebuilds "
                     "the index", path, reason)  # (a query raises, and verify reports it, naming it)
            return
        self._on_bad_file(path, reason)

    def _check_quarantine(self) -> None:
        self._quarantine.check(self.commitlog.queue.files, self.commitlog.file_size)

    def _move_to_quarantine(self) -> None:
        """Carry out the quarantine plan, after a marker naming the queues to refill is durable."""
        self._check_quarantine()
        if self.queues_to_rebuild:
            self.queues_to_rebuild = list(dict.fromkeys(self.queues_to_rebuild))
            with open(self.paths.cq_rebuild, "w", encoding="utf-8") as fh:  # until recovery has refilled them
                fh.write("\n".join(self.queues_to_rebuild) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        if self.paths.checkpoint in self._quarantine.carry_out():
            self.checkpoint.flush()  # a fresh one where the bad one was

    def _finish_queue_rebuild(self) -> None:
        """Make the refilled queues durable, then drop the marker that made recovery start where they end."""
        if self.read_only or not self.queues_to_rebuild:
            return
        report = self.recovery_report
        for name in self.queues_to_rebuild:
            topic, _, qid = name.rpartition("/")
            cq = self._cq_table.get((topic, int(qid)))
            if cq is not None:
                cq.flush(0)
                key = f"{cq.topic}-{cq.queue_id}"
                if cq.blank_units and report is not None and key not in report.not_rebuilt:  # gaps, placed
                    report.not_rebuilt[key] = "; ".join(f"units {a}..{b} have no record in the commitlog "
                                                        "(written as blank units)" for a, b in cq.blank_units)
                    log.error("rebuilding %s: %s", key, report.not_rebuilt[key])
        os.unlink(self.paths.cq_rebuild)
        log.warning("consume queues %s rebuilt from the commitlog", ", ".join(self.queues_to_rebuild))

    def _rebuild_queue(self, cq: ConsumeQueue, bad: list[tuple[str, str]]) -> None:
        """A queue with a file of the wrong size or a hole: the odd files go to quarantine, the files from the
        first bad one on are dropped, and recovery refills the queue from the commitlog where what is kept
        ends (dispatch only appends to a queue, so a hole would never fill), placing each unit at its
        record's queue offset (``pad_gaps``: a record lost leaves a blank unit, not a shifted offset)."""
        if self.read_only:
            path, reason = bad[0]
            raise StoreLoadError(f"{path}: {reason}; a writable open (rocketstore recover) rebuilds "
                                 f"{cq.topic}/{cq.queue_id} from the commitlog")
        first_bad = min((int(os.path.basename(p)) for p, _ in bad if file_kind(self.root, p)), default=-1)
        for path, reason in bad:
            name = os.path.basename(path)
            if file_kind(self.root, path) and os.path.getsize(path) == cq.file_size and int(name) % cq.file_size == 0:
                self._quarantine.deletes.append(path)  # sound, cut off by the hole: refilled, not quarantined
            else:
                self._on_bad_file(path, reason)
        for f in [f for f in cq.queue.files if f.file_from_offset > first_bad]:
            cq.queue.files.remove(f)
            f.close()
            self._quarantine.deletes.append(f.path)
        self.queues_to_rebuild.append(f"{cq.topic}/{cq.queue_id}")

    def _refill_lost_first_files(self) -> None:
        """Queues whose first units were lost, not expired: their records are still in the commitlog.

        A queue starting past unit 0 looks like retention deleted its first
        files; it did only if the records those units pointed at are below the
        commitlog's minimum.  When one is still there, the queue is rebuilt
        from the commitlog (every file goes and recovery refills it).
        """
        min_phy = self.commitlog.min_offset()
        firsts: dict[tuple[str, int], tuple[int, int]] = {}
        for key, cq in self._cq_table.items():
            if f"{key[0]}/{key[1]}" in self.queues_to_rebuild:
                continue
            first = cq.first_unit()
            if first is not None and first[1] > 0 and first[0] > min_phy:
                firsts[key] = first
            elif not cq.queue.files:  # a queue directory without a file: any record of it was lost
                firsts[key] = (codec.NO_INDEX, codec.NO_INDEX)
        for topic, qid in sorted(queues_with_records_before(self, firsts)):
            cq = self._cq_table[(topic, qid)]
            start = firsts[(topic, qid)][1]
            log.warning("%s-%d %s, but records of it are still in the commitlog (a lost queue file, not "
                        "retention); rebuilding it from the commitlog", topic, qid,
                        "has no file" if start == codec.NO_INDEX else f"starts at unit {start}")
            self._rebuild_queue(cq, [])

    def _refill_lost_queues(self, loaded: set[tuple[str, int]]) -> None:
        """Rebuild, before any read or put, the queues whose consume-queue directory was lost.

        Recovery offers the records from the segment where it starts, so it
        creates a queue it found no directory for at the first of its records
        there: one starting past queue offset 0 lost the units of its earlier
        records (retention never deletes a queue's last file, so its directory
        stays while it has records).  Such a queue is dropped and filled again
        from the commitlog's first record, with every record in no consume
        queue (a queue lost whole), each unit placed at its record's own queue
        offset (a record lost leaves a blank unit, never a shifted offset).
        """
        lost = sorted((self._registry or set()) - loaded)  # registered, directory gone: rebuilt, never empty
        for key, cq in self._cq_table.items():
            if key in loaded or key in lost:
                continue
            first = cq.first_unit()
            if first is not None and first[1] > 0 and first[0] > self.commitlog.min_offset():
                lost.append(key)
        if not lost or not self.commitlog.queue.files:
            return
        names = [f"{t}/{q}" for t, q in sorted(lost)]
        log.warning("consume queues %s had no directory and start past queue offset 0 while the commitlog holds "
                    "earlier records (a lost consume-queue directory); rebuilding them from the commitlog",
                    ", ".join(names))
        self.queues_to_rebuild = list(dict.fromkeys(self.queues_to_rebuild + names))
        write_file_durably(self.paths.cq_rebuild, ("\n".join(self.queues_to_rebuild) + "\n").encode())
        for key in lost:
            cq = self._cq_table.pop(key, None)
            if cq is None:
                continue
            for f in list(cq.queue.files):
                cq.queue.files.remove(f)
                f.destroy()
            cq.close()
        from .dispatch import CommitLogDispatcher
        dispatcher = CommitLogDispatcher(self)
        dispatched_before = self.checkpoint.logics_dispatched
        held = {}
        for (t, q) in self._cq_table:
            try:
                held[(t.encode("utf-8"), q)] = codec.NO_INDEX  # every record of a queue kept is skipped
            except UnicodeEncodeError:
                pass
        refilled: set[ConsumeQueue] = set()
        for mm, pos, size in _records_not_held(self.commitlog, held):
            msg = codec.decode(mm, pos, pos + size, read_body=False)
            key = (msg.topic, msg.queue_id)
            if key not in self._cq_table:
                if illegal_topic(msg.topic) is not None:
                    continue  # (dispatch leaves such a record out of the queues, and says so)
                if key not in lost:
                    lost.append(key)
                    log.warning("%s-%d: records in the commitlog but no consume queue (a lost directory); "
                                "rebuilding it", *key)
                    self.queues_to_rebuild.append(f"{key[0]}/{key[1]}")
                self.find_consume_queue(*key).pad_gaps = True  # place each unit at its queue offset
            cq = self._cq_table[key]
            dispatcher.dispatch(msg, index=False, queue=True)
            refilled.add(cq)
        self.checkpoint.logics_dispatched = dispatched_before
        for cq in refilled:
            cq.pad_gaps = False
        self.recover_topic_queue_table()

    def refill_from(self) -> int | None:
        """The commitlog offset from which recovery must offer every record: where the shortest queue being
        rebuilt ends (-1: from the first segment); None when no queue is being rebuilt."""
        if not self.queues_to_rebuild:
            return None
        ends = []
        for name in self.queues_to_rebuild:
            topic, _, qid = name.rpartition("/")
            cq = self._cq_table.get((topic, int(qid)))
            ends.append(cq.max_physic_offset if cq is not None else -1)
        return min(ends)

    def _read_queue_registry(self, loaded: set[tuple[str, int]]) -> set[tuple[str, int]]:
        """The queues the store created (config/consumeQueues.registry); a store without one (older, or written
        by RocketMQ) starts it from the directories it has.  A registered queue whose directory is gone is
        rebuilt from the commitlog by _refill_lost_queues: a lost directory is not an empty queue (rule 4)."""
        text = _read_utf8(self.paths.queue_registry)
        if text is None:
            return set(loaded)
        out: set[tuple[str, int]] = set()
        for line in text.splitlines():
            topic, _, qid = line.rpartition("/")
            if topic and qid.lstrip("-").isdigit():
                out.add((topic, int(qid)))
        return out

    def _write_queue_registry(self) -> None:
        """Make the registry hold every queue of the table, durably (atomic replace, fsync), when it grew."""
        if self._registry is None:
            return
        have = _read_utf8(self.paths.queue_registry)
        self._registry |= set(self._cq_table)
        text = "".join(f"{t}/{q}\n" for t, q in sorted(self._registry))
        if have != text:
            os.makedirs(os.path.dirname(self.paths.queue_registry), exist_ok=True)
            write_file_durably(self.paths.queue_registry, text.encode("utf-8"))

    def _load_consume_queues(self) -> None:
        root = self.paths.consumequeue
        if not os.path.isdir(root):
            return
        for topic in sorted(os.listdir(root)):
            tdir = os.path.join(root, topic)
            if not os.path.isdir(tdir):
                continue
            for qid in sorted(os.listdir(tdir)):
                if not qid.lstrip("-").isdigit() or not os.path.isdir(os.path.join(tdir, qid)):
                    continue
                cq = ConsumeQueue(root, topic, int(qid), self.config.mappedFileSizeConsumeQueue, read_only=self.read_only)
                bad: list[tuple[str, str]] = []
                cq.load(on_bad_file=lambda path, reason: bad.append((path, reason)))
                if any(file_kind(self.root, path) for path, _ in bad):
                    self._rebuild_queue(cq, bad)
                else:
                    for path, reason in bad:
                        self._on_bad_file(path, reason)
                self._cq_table[(topic, int(qid))] = cq

    def recover_topic_queue_table(self) -> None:
        min_phy = self.commitlog.min_offset_with_tier()  # units whose records are in the tier stay readable
        table = {}
        for key, cq in self._cq_table.items():
            table[key] = cq.max_offset_in_queue
            cq.correct_min_offset(min_phy)
        self.topic_queue_table = table
        self.apply_topic_retention()

    def apply_topic_retention(self) -> dict[tuple[str, int], int]:
        """Per-topic logical retention (topicRetentionMs): advance a queue's minimum past messages older
        than its topic's limit.  Files are untouched; RocketMQ's rules still decide what is deleted."""
        limits = self.config.topic_retention()
        moved: dict[tuple[str, int], int] = {}
        if not limits:
            return moved
        now_ms = int(self.clock() * 1000)
        for (topic, qid), cq in list(self._cq_table.items()):
            ms = limits.get(topic)
            if ms is None:
                continue
            idx = self.offset_by_time(topic, qid, now_ms - ms, LOWER)
            if idx > cq.retention_min_offset:
                cq.retention_min_offset = idx
                moved[(topic, qid)] = idx
        return moved

    def _start(self) -> None:
        cfg = self.config
        if cfg.flushDiskType == SYNC_FLUSH:
            self.group_commit = GroupCommitService(self)
            self._services.append(self.group_commit)
        else:
            self._services.append(FlushRealTimeService(self))
        self.reput = ReputMessageService(self, self.commitlog.max_offset())
        self._services += [self.reput, FlushConsumeQueueService(self), CheckpointService(self)]
        self._services += [self.clean_service, DiskGuardService(self), MetricsService(self)]
        if self.tier is not None:
            self._services.append(TierUploadService(self))
        if cfg.warmAheadBytes > 0:
            self.commitlog.warmer = WarmAheadService(self.commitlog.queue, cfg.warmAheadBytes)
            self._services.append(self.commitlog.warmer)
        if not self.commitlog.queue.files:
            self.commitlog.queue.start_preallocation(0)  # the first segment too is made off the put path
        for s in self._services:
            s.start()
        previous = b""
        if os.path.exists(self.paths.abort):
            with open(self.paths.abort, "rb") as fh:
                previous = fh.read()
        # Durable before the first put is taken: a power cut must not lose the mark that says "recover".
        boot = _boot_id()
        if boot is not None:
            write_file_durably(self.paths.abort_boot, boot.encode("ascii"))
        with open(self.paths.abort_bak, "wb") as fh:
            fh.write(previous)
        write_file_durably(self.paths.abort, str(os.getpid()).encode())

    # ------------------------------------------------------------ queues
    def find_consume_queue(self, topic: str, queue_id: int) -> ConsumeQueue:
        key = (topic, queue_id)
        cq = self._cq_table.get(key)
        if cq is None:
            with self._cq_lock:
                cq = self._cq_table.get(key)
                if cq is None:
                    cq = ConsumeQueue(self.paths.consumequeue, topic, queue_id, self.config.mappedFileSizeConsumeQueue,
                                      read_only=self.read_only)
                    if not self.read_only:
                        os.makedirs(cq.directory, exist_ok=True)
                    if self.recovery_report is None and f"{topic}/{queue_id}" in self.queues_to_rebuild:
                        cq.pad_gaps = True  # refilled by recovery: each unit placed at its queue offset
                    self._cq_table[key] = cq
                    if self.recovery_report is not None and self._registry is not None and key not in self._registry:
                        self._write_queue_registry()  # before its first unit: a lost directory is then noticed
        return cq

    def consume_queues(self) -> list[ConsumeQueue]:
        return list(self._cq_table.values())

    def queue_keys(self) -> list[tuple[str, int]]:
        return sorted(self._cq_table)

    # ------------------------------------------------------------ offsets
    def min_phy_offset(self) -> int:
        """The first offset of the local segments."""
        return self.commitlog.min_offset()

    def min_readable_offset(self) -> int:
        """The first offset a read can reach: the tier's start when a tier holds older segments."""
        return self.commitlog.min_offset_with_tier()

    def max_phy_offset(self) -> int:
        return self.commitlog.max_offset()

    def confirm_offset(self) -> int:
        """How far the dispatcher may read: the max offset (async) or what is flushed (sync)."""
        if self.group_commit is not None:
            return self.commitlog.queue.flushed_where
        return self.commitlog.max_offset()

    def dispatch_behind_bytes(self) -> int:
        return self.reput.behind() if self.reput else 0

    def wait_dispatched(self, timeout: float = 30.0) -> bool:
        """Block until the dispatcher has caught up with everything written so far."""
        if self.reput is None:
            return True
        if self.group_commit is not None:
            self.group_commit.wait_flushed(self.commitlog.max_offset(), timeout)
        return self.reput.wait_dispatched(self.confirm_offset(), timeout)

    # The broker's loop puts and dispatches in one thread (ASYNC_FLUSH); these let it without reaching
    # into the services.
    @property
    def puts_wait_for_flush(self) -> bool:
        """True in SYNC_FLUSH: a put blocks on the group commit, so callers run it off their event loop."""
        return self.group_commit is not None

    def assist_dispatch(self, on: bool) -> None:
        """A caller promises (or stops promising) to call :meth:`dispatch_ready` after its puts."""
        if self.reput is not None:
            self.reput.assisted = on and self.group_commit is None

    def dispatch_ready(self) -> None:
        """Dispatch the handed-over puts that are quick to place, in the caller's thread; the rest is left
        to the dispatch thread, which is woken if this fails."""
        if self.reput is None:
            return
        try:
            self.reput.dispatch_ready()
        except Exception:
            log.exception("dispatching in the caller's thread failed; left to the dispatch thread")
            self.reput.wakeup()

    def dispatched_to(self, offset: int) -> bool:
        """True once the consume queues hold every record before commitlog ``offset`` (or nothing dispatches)."""
        return self.reput is None or self.reput.reput_from_offset >= offset

    def min_offset_in_queue(self, topic: str, queue_id: int) -> int:
        cq = self._cq_table.get((topic, queue_id))
        lo = cq.min_offset_in_queue if cq else 0
        return self.queue_min_with_tier(topic, queue_id, lo) if self.tier is not None else lo

    def max_offset_in_queue(self, topic: str, queue_id: int) -> int:
        cq = self._cq_table.get((topic, queue_id))
        return cq.max_offset_in_queue if cq else 0

    # ------------------------------------------------------------ writing
    def _check_writable(self) -> str | None:
        if self.closed:
            raise StoreClosedError(f"{self.root}: store is closed")
        if self.read_only:
            raise ReadOnlyStoreError(f"{self.root}: store was opened read-only")
        return self.running_flags.why_not_writeable()

    def put(self, message: Message) -> PutMessageResult:
        """Append one message; see RocketMQ's putMessage for the statuses."""
        return self._put([message], batch=False)

    def put_batch(self, messages: list[Message]) -> PutMessageResult:
        """Append messages of one topic/queue as one unit (RocketMQ's putMessages with a MessageExtBatch)."""
        why = batch_problem(messages)
        if why:
            return PutMessageResult(PutMessageStatus.MESSAGE_ILLEGAL, error=why)
        return self._put(messages, batch=True)

    def put_encoded(self, topic: str, queue_id: int, records: list[codec.EncodedRecord],
                    dispatch: tuple[list[int] | None, list[list[int] | None] | None] | None,
                    store_timestamp: int | None = None) -> PutMessageResult:
        """Append records a :class:`MessageEncoder` made elsewhere (a Spark append's tasks) as one unit of one
        topic/queue.  ``dispatch`` is what the dispatcher needs of them: their tagsCodes and index key hashes
        (:func:`index.key_hashes`), each None when all are 0 or absent; None when it must decode them from
        the log (the records' properties say more than the writer parsed, as a replay's do).  This re-checks
        what a record must agree on with the store and the put: its topic and queue (a record whose own
        topic bytes are another topic's would sit in this topic's queue), sizes against the store's
        maxMessageSize, one transaction record alone; a writer with other limits cannot slip a record past."""
        if self.closed or self.read_only or not self.running_flags.is_writeable():
            return PutMessageResult(PutMessageStatus.SERVICE_NOT_AVAILABLE, error=self._check_writable())
        if not records:
            return PutMessageResult(PutMessageStatus.MESSAGE_ILLEGAL, error="empty batch")
        try:
            head, magic, _ = self.encoder.topic(topic)
        except codec.RecordError as e:
            return PutMessageResult(PutMessageStatus.MESSAGE_ILLEGAL, error=str(e))
        limit = self.config.maxMessageSize
        for r in records:
            if r[4] != queue_id or (r[6] & codec.TRANSACTION_MASK and len(records) > 1):
                return PutMessageResult(PutMessageStatus.MESSAGE_ILLEGAL,
                                        error="a batch holds one queue and no transaction messages")
            if r[2] != magic or not r[15].startswith(head):
                return PutMessageResult(PutMessageStatus.MESSAGE_ILLEGAL,
                                        error=f"a record of the batch is not of topic {topic!r} (or was encoded "
                                              "with another autoMessageVersionOnTopicLen)")
            if len(r[14]) > limit or r[1] > limit + 65536:
                return PutMessageResult(PutMessageStatus.MESSAGE_ILLEGAL,
                                        error=f"a {r[1]}-byte record is over maxMessageSize {limit}")
        if dispatch is not None and self.reput is not None:
            dispatch = (dispatch[0], None, None, dispatch[1])
        else:
            dispatch = None
        return self._append(topic, queue_id, records, dispatch, store_timestamp, None, None)

    def _put(self, messages: list[Message], batch: bool) -> PutMessageResult:
        if self.closed or self.read_only or not self.running_flags.is_writeable():
            why = self._check_writable()
            return PutMessageResult(PutMessageStatus.SERVICE_NOT_AVAILABLE, error=why)
        now_ms = int(self.clock() * 1000)
        encode = self.encoder.encode
        try:
            # (one message without a comprehension: on 3.11 each one costs a function frame)
            records = [encode(messages[0], now_ms)] if len(messages) == 1 else [encode(m, now_ms) for m in messages]
        except codec.PropertiesTooLarge as e:
            return PutMessageResult(PutMessageStatus.PROPERTIES_SIZE_EXCEEDED, error=str(e))
        except (codec.RecordError, ValueError) as e:
            return PutMessageResult(PutMessageStatus.MESSAGE_ILLEGAL, error=str(e))
        first = messages[0]
        dispatch = None if self.reput is None else self.encoder.dispatch_columns(messages)
        return self._append(first.topic, first.queue_id, records, dispatch, first.store_timestamp or None,
                            first.store_host, first)

    def _append(self, topic: str, queue_id: int, records: list[codec.EncodedRecord], dispatch: tuple | None,
                store_timestamp: int | None, store_host: Any, first: Message | None) -> PutMessageResult:
        """The put under the lock: stamp and write the records, hand them to the dispatcher, then the flush
        (a synchronous flush is waited for when ``first`` asks to; None: never)."""
        metrics = self.metrics
        n = metrics.puts
        metrics.puts = n + 1
        timed = not n & _UNSAMPLED
        t0 = perf_counter() if timed else 0.0
        key = (topic, queue_id)
        assigns = records[0][6] & codec.TRANSACTION_MASK in _QUEUED_TXN
        commitlog = self.commitlog
        with commitlog.put_lock:
            t1 = perf_counter() if timed else 0.0
            if self.closed:
                raise StoreClosedError(f"{self.root}: store is closed")
            qoff = self.topic_queue_table.get(key, 0) if assigns else None
            try:
                wrote_offset, wrote_bytes, store_ts, offsets = commitlog.append(records, qoff, store_timestamp)
            except codec.MessageTooLarge as e:
                return PutMessageResult(PutMessageStatus.MESSAGE_ILLEGAL, error=str(e))
            except CommitLogWriteError as e:  # nothing acknowledged; stop taking writes, as after a flush error
                self.running_flags.make_not_writeable(str(e))
                log.error("%s: %s; store is now read-only", self.root, e)
                return PutMessageResult(PutMessageStatus.UNKNOWN_ERROR, error=str(e))
            except OSError as e:
                where = e.filename or self.paths.commitlog
                return PutMessageResult(PutMessageStatus.CREATE_MAPPED_FILE_FAILED,
                                        error=f"cannot create commitlog segment {where}: {e.strerror or e}")
            if assigns:
                self.topic_queue_table[key] = qoff + len(records)
            # Else the dispatcher decodes these records from the log: so too past HAND_OVER_LIMIT puts not yet
            # dispatched (a stalled flush under SYNC_FLUSH), which bounds what the hand-over holds in memory.
            if dispatch is not None and len(self.reput.handed_over) < HAND_OVER_LIMIT:
                self.reput.hand_over((wrote_offset, wrote_offset + wrote_bytes, topic, queue_id,
                                      qoff if assigns else -1, store_ts, records[0][6] & codec.TRANSACTION_MASK,
                                      offsets, (wrote_bytes,) if len(records) == 1 else [r[1] for r in records],
                                      *dispatch))
            t2 = perf_counter() if timed else 0.0
        # (positional arguments and the shared default host tuple: a quarter fewer instructions for the result)
        result = PutMessageResult(PutMessageStatus.PUT_OK, wrote_offset, wrote_bytes, qoff if assigns else 0, "",
                                  store_ts, len(records), None,
                                  DEFAULT_STORE_HOST if store_host is None else host_tuple(store_host),
                                  offsets if len(records) > 1 else None)
        gc = self.group_commit
        if gc is not None:
            if first is not None and _wait_store_msg_ok(first):
                if not gc.wait_flushed(wrote_offset + wrote_bytes, self.config.syncFlushTimeout / 1000):
                    result.status = PutMessageStatus.FLUSH_DISK_TIMEOUT
                    result.error = self.flush_error or \
                        f"not flushed within syncFlushTimeout {self.config.syncFlushTimeout} ms"
            else:
                gc.request(wrote_offset + wrote_bytes)
        if timed:
            metrics.record_put(t2 - t1, perf_counter() - t0)
        return result

    # ------------------------------------------------------------ flushing
    def flush_commitlog(self, least_pages: int, thorough: bool) -> bool:
        """One flush round of the commitlog; on an I/O error the store turns read-only."""
        try:
            done = self.commitlog.flush(least_pages)
        except OSError as e:
            self.flush_error = f"fdatasync of the commitlog failed: {os.strerror(e.errno or 0)} ({e})"
            self.running_flags.make_not_writeable(self.flush_error)
            log.error("%s: %s; store is now read-only", self.root, self.flush_error)
            return False
        if thorough and self.commitlog.queue.store_timestamp:
            self.checkpoint.physicMsgTimestamp = self.commitlog.queue.store_timestamp
        return done

    def flush_checkpoint(self) -> None:
        try:
            self.checkpoint.flush()
        except OSError as e:
            log.error("%s: checkpoint flush failed: %s", self.paths.checkpoint, e)

    def _on_index_file_full(self, full: Any) -> None:
        def run() -> None:
            full.flush()
            self.checkpoint.indexMsgTimestamp = full.end_timestamp
            self.flush_checkpoint()
        threading.Thread(target=run, name="IndexFlush", daemon=True).start()

    # ------------------------------------------------------------ retention
    def delete_expired_commit_log(self) -> list[str]:
        """RocketMQ's deleteExpiredCommitLog: request 20 manual rounds and run the first one now."""
        if self.closed:
            raise StoreClosedError(f"{self.root}: store is closed")
        if self.read_only:
            raise ReadOnlyStoreError(f"{self.root}: store was opened read-only")
        self.clean_service.request_manual_delete()
        deleted = self.clean_service.clean_commitlog()
        self.clean_service.clean_consume_queues()
        return deleted

    # ------------------------------------------------------------ reading
    def get(self, topic: str, queue_id: int, offset: int, max_msgs: int = 32,
            tag_filter: set[int] | str | None = None, max_total_bytes: int = 128 * 1024 * 1024,
            read_body: bool = True) -> GetMessageResult:
        """Read through the consume queue (RocketMQ's getMessage).  ``tag_filter``: tag hash codes, a
        subscription expression (``"TagA"``, ``"TagA || TagB"``, ``"*"``) or None.

        A unit whose record is damaged (does not decode, or its body fails
        BODYCRC when bodies are read) or is not the record the unit claims
        (topic, queue id, queue offset, size) is never returned nor skipped:
        the call returns the messages before it (FOUND, ``next_begin_offset``
        at that unit), and a call starting at it raises
        :class:`CorruptRecordError` naming the segment file and offset.  A unit whose own size or
        offset was damaged still reads its intact record (see :meth:`_misplaced_unit_record`).

        Consumers call this in a loop, so the fixed cost of a call weighs about as
        much as the per-message cost: units are read in blocks of one unpack each,
        ``min``/``max`` are written as comparisons (each builtin call costs more
        than the test), and :func:`codec.decode_unit` builds the messages.
        """
        if self.closed:
            raise StoreClosedError(f"{self.root}: store is closed")
        if isinstance(tag_filter, str):
            tag_filter = parse_tag_filter(tag_filter)
        cq = self._cq_table.get((topic, queue_id))
        if cq is None:
            return GetMessageResult(GetMessageStatus.NO_MESSAGE_IN_QUEUE, 0, 0, 0)
        lo, hi = cq.offset_range()
        if hi == 0:
            return GetMessageResult(GetMessageStatus.NO_MESSAGE_IN_QUEUE, 0, lo, hi)
        if offset < lo:
            if self.tier is not None:
                return self._get_from_tier(topic, queue_id, offset, max_msgs, tag_filter, read_body, lo, hi)
            return GetMessageResult(GetMessageStatus.OFFSET_TOO_SMALL, lo, lo, hi)
        if offset == hi:
            return GetMessageResult(GetMessageStatus.OFFSET_OVERFLOW_ONE, offset, lo, hi)
        if offset > hi:
            return GetMessageResult(GetMessageStatus.OFFSET_OVERFLOW_BADLY, hi, lo, hi)
        f = cq.hold_file_at(offset)
        if f is None:
            units_per_file = cq.file_size // CQ_STORE_UNIT_SIZE
            nxt = offset + units_per_file - offset % units_per_file
            return GetMessageResult(GetMessageStatus.OFFSET_FOUND_NULL, nxt, lo, hi)
        status = GetMessageStatus.NO_MATCHED_MESSAGE
        out: list[MessageExt] = []
        n = total = 0  # messages and bytes in ``out``
        cfg = self.config
        max_pull = (100 if max_total_bytes < 100 else  # clamp to [100, 128 MiB]
                    128 * 1024 * 1024 if max_total_bytes > 128 * 1024 * 1024 else max_total_bytes)
        count_cap, byte_cap = max_msgs, max_pull  # narrowed once the first message says hot or cold
        span = max_msgs * CQ_STORE_UNIT_SIZE  # units looked at: at least maxFilterMessageSize worth
        if span < cfg.maxFilterMessageSize:
            span = cfg.maxFilterMessageSize
        stop_idx = offset + -(-span // CQ_STORE_UNIT_SIZE)
        if stop_idx > hi:
            stop_idx = hi
        skip_file_start = skip_file_end = -1
        seg, seg_start, seg_end, mm = None, 0, -1, None  # the commitlog segment held while reading from it
        decode_unit = codec.decode_unit
        topic_bytes = topic.encode("utf-8")
        read_units = cq.read_units
        idx = offset  # the next unit; where the next call begins
        want = max_msgs if max_msgs > 1 else 1  # units in the first block: what an unfiltered call takes
        try:
            while idx < stop_idx:
                block = read_units(f, idx, stop_idx - idx if stop_idx - idx < want else want)
                if not block:
                    break
                want = cq.UNITS_PER_READ
                full = False
                it = iter(block)
                for phy, size, tags in zip(it, it, it):
                    if n and (n >= count_cap or total + size > byte_cap and size != BLANK_UNIT_SIZE):
                        full = True
                        break
                    idx += 1
                    if tag_filter is not None and _signed32(tags) not in tag_filter and size != BLANK_UNIT_SIZE:
                        if not n:
                            status = GetMessageStatus.NO_MATCHED_MESSAGE
                        continue
                    if skip_file_start <= phy < skip_file_end and size != BLANK_UNIT_SIZE:  # its segment is gone
                        continue
                    if not (seg_start <= phy < seg_end):
                        if seg is not None:
                            seg.release()
                        seg = self.commitlog.queue.find(phy)
                        if seg is None or not seg.hold():
                            seg, seg_start, seg_end, mm = None, 0, -1, None
                        else:
                            seg_start, seg_end, mm = seg.file_from_offset, seg.end_offset, seg.mm
                    pos = phy - seg_start
                    if seg is None or pos + size > seg.wrote_position:
                        damage = None
                        if size == BLANK_UNIT_SIZE:  # a unit naming no record: retention's doing, or damage
                            msg, damage = self._blank_unit_record(cq, f, idx - 1, read_body, topic, topic_bytes,
                                                                  queue_id)
                            if msg is None and damage is None:
                                if not n:
                                    status = GetMessageStatus.MESSAGE_WAS_REMOVING
                                continue
                            if msg is not None and n and total + msg.size > byte_cap:  # (the cap test above
                                idx -= 1                                                # could not know its size)
                                full = True
                                break
                        elif seg is None and self.commitlog._in_tier(phy):  # uploaded, and gone from local disk
                            msg = self._tier_unit(phy, size, read_body, topic, topic_bytes, queue_id, idx - 1)
                        elif seg is None and phy < self.commitlog.min_offset():  # expired: its segment is gone
                            if not n:
                                status = GetMessageStatus.MESSAGE_WAS_REMOVING
                            skip_file_start = phy - phy % self.commitlog.file_size
                            skip_file_end = skip_file_start + self.commitlog.file_size
                            continue
                        else:
                            # Not expired, yet no record there: a damaged unit, whose record may still be found.
                            msg = self._misplaced_unit_record(cq, idx - 1, phy, size, read_body, topic, topic_bytes,
                                                              queue_id)
                            if msg is None:
                                damage = _lost_unit(cq, f, topic, queue_id, idx - 1, phy, size,
                                                    "its segment is not in the commitlog" if seg is None else
                                                    f"it reaches past the written end of {seg.path}")
                        if damage is not None:
                            if n:  # return what was read; the next call starts at the damaged unit and raises
                                idx -= 1
                                full = True
                                break
                            raise damage
                        if msg is not None:
                            size, phy = msg.size, msg.commit_log_offset
                    else:
                        msg = decode_unit(mm, pos, size, read_body, topic, topic_bytes, queue_id, idx - 1)
                    if msg is None and seg is not None:
                        msg = self._misplaced_unit_record(cq, idx - 1, phy, size, read_body, topic, topic_bytes,
                                                          queue_id)
                        if msg is not None:
                            size, phy = msg.size, msg.commit_log_offset
                    if msg is None:
                        if n:  # return what was read; the next call starts at the damaged unit and raises
                            idx -= 1
                            full = True
                            break
                        if seg is None:
                            raise self._tier_damaged(phy, size, topic, queue_id, idx - 1)
                        raise _damaged_unit(seg, pos, size, cq, f, topic, queue_id, idx - 1, read_body)
                    if not n:
                        # "In memory" (within 40 % of RAM of the log's end): 32 messages / 256 KiB a call,
                        # else 8 / 64 KiB.
                        in_mem = (self.commitlog.max_offset() - phy
                                  <= self._ram * cfg.accessMessageInMemoryMaxRatio // 100)
                        cap = cfg.maxTransferCountOnMessageInMemory if in_mem else cfg.maxTransferCountOnMessageInDisk
                        if cap < count_cap:
                            count_cap = cap
                        cap = cfg.maxTransferBytesOnMessageInMemory if in_mem else cfg.maxTransferBytesOnMessageInDisk
                        if cap < byte_cap:
                            byte_cap = cap
                        status = GetMessageStatus.FOUND
                    out.append(msg)
                    n += 1
                    total += size
                if full or (n and n >= count_cap):  # the next unit would stop the call: do not read it
                    break
        finally:
            f.release()
            if seg is not None:
                seg.release()
        return GetMessageResult(status, idx, lo, hi, out)

    def queue_claiming(self, phy: int, topic: str, queue_id: int, queue_offset: int, sys_flag: int
                       ) -> tuple[str, int, int] | None:
        """(topic, queue id, queue offset) of another queue's unit pointing at the record at ``phy`` when the
        record's own queue (``topic``, ``queue_id``) has no unit ``queue_offset`` pointing there; else None.

        Dispatch writes a unit from its record's fields, so such a unit means
        the record's topic, queue id or queue offset was changed since (no CRC
        covers them): reading or dispatching it as it reads would misroute the
        message.  PREPARED and ROLLBACK records have no unit: never claimed.
        """
        if sys_flag & codec.TRANSACTION_MASK not in (codec.TRANSACTION_NOT_TYPE, codec.TRANSACTION_COMMIT):
            return None
        own = self._cq_table.get((topic, queue_id))
        if own is not None and 0 <= queue_offset < 1 << 58:
            unit = own.get_unit(queue_offset)
            if unit is not None and unit[0] == phy:
                return None
        for (t, q), cq in list(self._cq_table.items()):  # its own queue too: at another offset
            if (i := cq.unit_pointing_at(phy)) is not None:
                return t, q, i
        return None

    def _blank_unit_record(self, cq: ConsumeQueue, cq_file: Any, index: int, read_body: bool, topic: str,
                           topic_bytes: bytes, queue_id: int) -> tuple[MessageExt | None, CorruptRecordError | None]:
        """What a get makes of unit ``index`` when it is blank (0, 2147483647): (its record, None) when the
        record is found after all, (None, None) when retention removed it, else (None, the error naming it).

        Blank units stand for records that are gone: below a queue's first
        message, or written by a rebuild for queue offsets no record was found
        for.  Records are in commitlog order, so this unit's record lay after
        the record of the last unit before it that names one: only when that
        one lies below the lowest readable offset (the local commitlog's, or
        the tier's) can retention have removed it.  Otherwise the record should
        still be there: a damaged unit, not an expired message.
        """
        floor = self.min_readable_offset()
        prev_end = 0  # no unit before it names a record: its record lay anywhere from the log's start
        for i in range(index - 1, max(cq.min_offset_in_queue, index - BLANK_LOOK_BACK) - 1, -1):
            unit = cq.get_unit(i)
            if unit is None:
                break
            if unit[0] >= 0 and 0 < unit[1] < BLANK_UNIT_SIZE:
                prev_end = unit[0] + unit[1]
                break
        if prev_end < floor:
            return None, None
        msg = self._misplaced_unit_record(cq, index, 0, BLANK_UNIT_SIZE, read_body, topic, topic_bytes, queue_id,
                                          after=prev_end)
        if msg is not None:
            return msg, None
        return None, _lost_unit(cq, cq_file, topic, queue_id, index, 0, BLANK_UNIT_SIZE,
                                f"it is a blank unit, yet its record lay at or after commitlog offset {prev_end}, "
                                f"which the store still holds (lowest readable offset {floor}): a lost unit, "
                                "not retention")

    def _misplaced_unit_record(self, cq: ConsumeQueue, index: int, phy: int, size: int, read_body: bool,
                               topic: str, topic_bytes: bytes, queue_id: int, after: int | None = None
                               ) -> MessageExt | None:
        """The record unit ``index`` means when the record at its offset ``phy`` is not it, or None.

        A bit flip in a unit's size or offset must not cost the intact message
        (a get would stop at it until ``verify --repair``), nor hand out another
        one.  Only a record that names itself as this unit's is taken: its
        topic, queue id and queue offset, a PHYSICALOFFSET equal to its position
        (and its body CRC when bodies are read).  Looked for at ``phy`` by the
        record's own TOTALSIZE (the unit's size damaged), then walking the
        records from the end of the previous unit's record up to the next
        unit's offset, at most ``MISPLACED_SEARCH_BYTES`` (its offset damaged).
        """
        try:
            prev = cq.get_unit(index - 1) if index > 0 else None
            nxt = cq.get_unit(index + 1)
        except ValueError:  # a neighbouring queue file retention closed meanwhile: no bounds to walk between
            prev = nxt = None
        starts = [phy]
        if after is not None:  # where the record of the last unit before it naming one ends
            starts.append(after)
        elif prev is not None and prev[0] >= 0 and 0 < prev[1] < 0x7FFFFFFF:
            starts.append(prev[0] + prev[1])
        hi = nxt[0] if nxt is not None and nxt[0] >= 0 and 0 < nxt[1] < 0x7FFFFFFF else None
        for k, start in enumerate(starts):
            seg = self.commitlog.queue.find(start)
            if seg is None or not seg.hold():
                continue
            try:
                base = seg.file_from_offset
                limit = seg.wrote_position
                stop = limit
                if k:  # the walk between the neighbours' records
                    stop = min(limit, start - base + MISPLACED_SEARCH_BYTES, limit if hi is None else hi - base)
                records = codec.walk(seg.mm, start - base, stop, check_crc=False, parsed=True)
                for pos, rsize, parsed, _ in (records if k else islice(records, 1)):  # k == 0: the one at phy
                    if parsed is None or rsize <= 0:
                        break
                    h = parsed[0]
                    if h[6] == base + pos and h[3] == queue_id and h[5] == index:
                        msg = codec.decode_unit(seg.mm, pos, rsize, read_body, topic, topic_bytes, queue_id, index)
                        if msg is not None:
                            log.warning("%s-%d: unit %d says (%d, %d) but its record is at %d, %d bytes: a damaged "
                                        "unit (verify --repair rebuilds the queue)", topic, queue_id, index, phy,
                                        size, base + pos, rsize)
                            return msg
                        # else another topic's record of the same queue id and offset, or this one damaged
            finally:
                seg.release()
        return None

    # ------------------------------------------------------------ reading from the tier
    def _tier_unit(self, phy: int, size: int, read_body: bool, topic: str, topic_bytes: bytes, queue_id: int,
                   queue_offset: int) -> MessageExt | None:
        """The record of a unit whose segment is only in the tier (None when it is not the unit's record)."""
        buf, _ = self.tier.reader.record_bytes(phy, size)
        if len(buf) < size:
            return None
        return codec.decode_unit(buf, 0, size, read_body, topic, topic_bytes, queue_id, queue_offset)

    def _tier_damaged(self, phy: int, size: int, topic: str, queue_id: int, queue_offset: int) -> CorruptRecordError:
        reader = self.tier.reader
        seg = reader.manifest.segment_for(phy)
        where = reader.where(f"commitlog/{seg.name}") if seg else self.tier.loc.uri
        return CorruptRecordError(f"{where} at offset {phy}: the record is not the one {topic}-{queue_id} unit "
                                  f"{queue_offset} points at ({size} bytes), or its body fails BODYCRC",
                                  path=where, offset=phy)

    def queue_min_with_tier(self, topic: str, queue_id: int, local_min: int) -> int:
        """A queue's lowest readable offset: where its consume-queue files in the tier begin, when lower.

        With no manifest to trust (see TieredStorage.fault) after the store deleted local segments on the
        tier's word, the tier may hold any of the queue's older messages: 0, where a read then raises the
        fault, rather than a local minimum that would have a consumer skip them unawares."""
        t = self.tier
        if t is None:
            return local_min
        if t.fault is not None and t.deleted_end > 0:
            return 0
        rng = t.manifest.queue_range(topic, queue_id) if t.manifest is not None else None
        return rng[0] if rng is not None and rng[0] < local_min else local_min

    def _get_from_tier(self, topic: str, queue_id: int, offset: int, max_msgs: int, tag_filter: set[int] | None,
                       read_body: bool, lo: int, hi: int) -> GetMessageResult:
        """get() below the local consume queue: units from the tier's queue files, records from wherever they are.

        Cold reads take RocketMQ's on-disk caps (maxTransferCountOnMessageInDisk / ...BytesOnMessageInDisk).
        A tier whose manifest cannot be trusted (missing, stale, lost locally) raises, naming the manifest:
        below the local disk is where the tier's messages are, not "too small".
        """
        t = self.tier
        if t.fault is not None:
            raise TierError(f"{topic}-{queue_id} offset {offset} lies below the local consume queue (from {lo}) and "
                            f"is read from the tier, but {t.fault}")
        reader = t.reader
        if reader is None:  # this store never published a manifest: nothing was moved to the tier
            return GetMessageResult(GetMessageStatus.OFFSET_TOO_SMALL, lo, lo, hi)
        rng = reader.manifest.queue_range(topic, queue_id)
        tier_lo = rng[0] if rng is not None and rng[0] < lo else lo
        if offset < tier_lo:
            return GetMessageResult(GetMessageStatus.OFFSET_TOO_SMALL, tier_lo, tier_lo, hi)
        if rng is None or offset >= rng[1]:  # between the tier's last file and the local first: none there
            return GetMessageResult(GetMessageStatus.OFFSET_FOUND_NULL, lo, tier_lo, hi)
        cfg = self.config
        count_cap = min(max_msgs, cfg.maxTransferCountOnMessageInDisk) or 1
        byte_cap = cfg.maxTransferBytesOnMessageInDisk
        topic_bytes = topic.encode("utf-8")
        out: list[MessageExt] = []
        total = 0
        idx = offset
        status = GetMessageStatus.NO_MATCHED_MESSAGE
        stop = min(rng[1], lo if lo > offset else rng[1])
        while idx < stop and len(out) < count_cap:
            units = reader.units(topic, queue_id, idx, min(stop - idx, max(max_msgs, 32)))
            if not units:
                break
            for phy, size, tags in units:
                if out and (len(out) >= count_cap or total + size > byte_cap):
                    return GetMessageResult(GetMessageStatus.FOUND, idx, tier_lo, hi, out)
                if tag_filter is not None and _signed32(tags) not in tag_filter:
                    idx += 1
                    continue
                if self.commitlog._in_tier(phy):
                    msg = self._tier_unit(phy, size, read_body, topic, topic_bytes, queue_id, idx)
                else:
                    msg = self.local_unit_record(phy, size, read_body, topic, topic_bytes, queue_id, idx)
                if msg is None:
                    if out:
                        return GetMessageResult(GetMessageStatus.FOUND, idx, tier_lo, hi, out)
                    raise self._tier_damaged(phy, size, topic, queue_id, idx)
                out.append(msg)
                total += size
                status = GetMessageStatus.FOUND
                idx += 1
        return GetMessageResult(status, idx, tier_lo, hi, out)

    def local_unit_record(self, phy: int, size: int, read_body: bool, topic: str, topic_bytes: bytes, queue_id: int,
                          queue_offset: int) -> MessageExt | None:
        """The record a consume-queue unit points at in the local segments, or None when it is not there whole
        or is not the unit's record (codec.decode_unit's check: topic, queue id, queue offset, size)."""
        f = self.commitlog.queue.find(phy)
        if f is None or not f.hold():
            return None
        try:
            pos = phy - f.file_from_offset
            if pos + size > f.wrote_position:
                return None
            return codec.decode_unit(f.mm, pos, size, read_body, topic, topic_bytes, queue_id, queue_offset)
        finally:
            f.release()

    def look(self, commit_log_offset: int, *, read_body: bool = True) -> MessageExt:
        """The message at a commitlog offset (RocketMQ's lookMessageByOffset).

        Raises :class:`CorruptRecordError` (file and offset) when no record
        decodes there or, reading the body, the body fails its BODYCRC.
        """
        return self.commitlog.read_message(commit_log_offset, read_body=read_body, check_crc=read_body)

    def query(self, topic: str, key: str, max_num: int = 32, begin: int = 0, end: int = 2 ** 63 - 1,
              *, read_body: bool = True) -> QueryMessageResult:
        """Messages by key or UNIQ_KEY through the index (RocketMQ's queryMessage): newest hits, ascending.

        The index holds only hashes, so, as RocketMQ's client does after the
        broker answers, a hit is kept only when its topic is ``topic`` and
        ``key`` is one of its KEYS or its UNIQ_KEY (hash collisions and stale
        entries are dropped).  A kept hit whose body fails its BODYCRC, or an
        entry pointing at bytes that are no record, raises
        :class:`CorruptRecordError` naming the file and offset.
        """
        limit = min(max_num, self.config.maxMsgsNumBatch)
        offsets, last_ts, last_phy = self.index_service.query_offset(topic, key, limit, begin, end)
        if self.tier is not None and self.tier.reader is not None and len(offsets) < limit:
            local = {os.path.basename(f.path) for f in self.index_service.files}
            more = self.tier.reader.select(f"{topic}#{key}", limit - len(offsets), begin, end, local)
            offsets = list(dict.fromkeys(offsets + more))
        offsets.sort()
        msgs, phys = [], []
        for off in offsets:
            f = self.commitlog.queue.find(off)
            if f is None or not f.hold():
                if self.commitlog._in_tier(off):  # uploaded and gone from local disk
                    m = self.commitlog.tier.reader.read_message(off, read_body=read_body, check_crc=read_body)
                    if m.topic == topic and (key == m.uniq_key or key in (m.keys or "").split(" ")):
                        msgs.append(m)
                        phys.append(off)
                continue  # else the segment was deleted (retention): RocketMQ skips such entries too
            try:
                pos = off - f.file_from_offset
                if pos + 4 > f.wrote_position:
                    continue
                m = _indexed_record(f, pos, read_body)
                if m.topic != topic or (key != m.uniq_key and key not in (m.keys or "").split(" ")):
                    log.debug("%s: index hit at offset %d is %s, not %s#%s (hash collision)",
                              self.paths.index, off, m.topic, topic, key)
                    continue
                claim = self.queue_claiming(off, m.topic, m.queue_id, m.queue_offset, m.sys_flag)
                if claim is not None:
                    raise CorruptRecordError(
                        f"{f.path} at offset {off} (file position {pos}): damaged record: it says "
                        f"{m.topic}/{m.queue_id} offset {m.queue_offset}, but consume queue {claim[0]}/{claim[1]} "
                        f"offset {claim[2]} points at it (its header changed since; verify --repair restores it); "
                        f"found through the index by {topic}#{key}", path=f.path, offset=off)
                if read_body and m.body and codec.body_crc(m.body) != m.body_crc:
                    raise CorruptRecordError(f"{f.path} at offset {off} (file position {pos}): damaged record: "
                                             f"body CRC mismatch (stored {m.body_crc}, computed "
                                             f"{codec.body_crc(m.body)}); found through the index by "
                                             f"{topic}#{key}", path=f.path, offset=off)
            finally:
                f.release()
            msgs.append(m)
            phys.append(off)
        if not msgs:
            last_ts = last_phy = 0
        return QueryMessageResult(phys, msgs, last_ts, last_phy)

    def offset_by_time(self, topic: str, queue_id: int, timestamp: int, boundary: str = LOWER) -> int:
        """Queue offset by store time (RocketMQ's getOffsetInQueueByTime)."""
        cq = self._cq_table.get((topic, queue_id))
        if cq is None:
            return 0
        local = cq.offset_by_time(timestamp, boundary, self.commitlog.pickup_store_timestamp,
                                  self.commitlog.min_offset_with_tier())
        t = self.tier
        rng = t.manifest.queue_range(topic, queue_id) if t is not None and t.reader is not None else None
        lo = cq.min_offset_in_queue
        if rng is None or rng[0] >= lo:
            return local
        first = cq.get_unit(lo)
        if first is not None and timestamp >= self.commitlog.pickup_store_timestamp(first[0], first[1]):
            return local
        return self._tier_offset_by_time(topic, queue_id, timestamp, boundary, rng[0], min(rng[1], lo))

    def _tier_offset_by_time(self, topic: str, queue_id: int, timestamp: int, boundary: str, lo: int,
                             hi: int) -> int:
        """offset_by_time over queue offsets [lo, hi) held by the tier: a binary search on store times."""
        reader = self.tier.reader

        def time_at(i: int) -> int:
            unit = reader.units(topic, queue_id, i, 1)
            return self.commitlog.pickup_store_timestamp(unit[0][0], unit[0][1]) if unit else -1

        if boundary == LOWER:  # the first offset stored at or after ``timestamp``
            a, b = lo, hi
            while a < b:
                mid = (a + b) // 2
                if time_at(mid) >= timestamp:
                    b = mid
                else:
                    a = mid + 1
            return a
        a, b = lo, hi  # UPPER: the last offset stored at or before ``timestamp``
        while a < b:
            mid = (a + b) // 2
            if time_at(mid) <= timestamp:
                a = mid + 1
            else:
                b = mid
        return max(lo, a - 1)

    def messages(self, from_offset: int = -1, *, read_body: bool = True, check_crc: bool | None = None,
                 drop_cache: bool = False, skip_damaged: bool = False
                 ) -> Iterator[tuple[int, int, MessageExt | None, str | None]]:
        """Every trusted record in commitlog order (including ones in no consume queue); see CommitLog.scan.

        Only trusted records are messages (data-safety rule 1): magic, sizes,
        PHYSICALOFFSET equal to the position, and BODYCRC (``check_crc``
        defaults to True, bodies read or not: a walk hands its messages to
        ``import``, which would replay a damaged one).  A damaged record or a
        stale copy of one is yielded once as (offset, size, None, problem naming
        file and position) and ends the walk, unless ``skip_damaged``: then the
        walk resumes at the next trusted record after it (:func:`codec.find_record`).
        """
        check = True if check_crc is None else check_crc
        if not skip_damaged:
            return self.commitlog.scan(from_offset, read_body=read_body, check_crc=check, drop_cache=drop_cache)
        return self._messages_resync(from_offset, read_body, check, drop_cache)

    def _messages_resync(self, offset: int, read_body: bool, check_crc: bool, drop_cache: bool
                         ) -> Iterator[tuple[int, int, MessageExt | None, str | None]]:
        while offset is not None:
            damaged = None
            for item in self.commitlog.scan(offset, read_body=read_body, check_crc=check_crc, drop_cache=drop_cache):
                yield item
                if item[2] is None:
                    damaged = item[0]
            offset = None if damaged is None else self._next_record_after(damaged, check_crc)

    def _next_record_after(self, offset: int, check_crc: bool) -> int | None:
        """The commitlog offset of the first intact record after ``offset``, up to the log's end, or None."""
        queue = self.commitlog.queue
        f = queue.find(offset)
        pos = offset - f.file_from_offset + 1 if f is not None else 0
        while f is not None and f.hold():
            try:
                found = codec.find_record(f.mm, pos, f.wrote_position, f.file_from_offset, check_crc=check_crc)
            finally:
                f.release()
            if found is not None:
                return f.file_from_offset + found
            f, pos = queue.find(f.end_offset), 0
        return None

    def seek_offset(self, topic: str | None = None, from_time: int | None = None) -> int:
        """Where a scan for a topic and/or from a store time can start, found through the consume queues.

        The lowest commitlog offset among the matching queues' first units at or
        after ``from_time`` (or their first units).  Records in no consume queue
        (PREPARED/ROLLBACK transaction halves) before that point are skipped.
        """
        if topic is None and from_time is None:
            return self.min_readable_offset()
        best = None
        for (t, qid), cq in list(self._cq_table.items()):
            if topic is not None and t != topic:
                continue
            idx = cq.min_offset_in_queue if from_time is None else self.offset_by_time(t, qid, from_time, LOWER)
            unit = cq.get_unit(idx)
            if unit is not None and (best is None or unit[0] < best):
                best = unit[0]
        return self.max_phy_offset() if best is None else max(best, self.min_readable_offset())

    def consumer_offsets(self, problems: list[str] | None = None) -> dict[tuple[str, int], int]:
        """Lowest committed offset per queue over all groups, from RocketMQ's config/consumerOffset.json
        (as the broker reads it: fastjson's unquoted keys too).

        An entry of the wrong shape raises StoreLoadError naming it, or, given ``problems``
        (retention's warnings), is described there and skipped."""
        from .broker.offsets import ConsumerOffsetManager
        from .group_offsets import config_dir
        manager = ConsumerOffsetManager(config_dir(self.root), strict=problems is None, problems=problems)
        out: dict[tuple[str, int], int] = {}
        for key, queues in manager.table.items():
            topic = key.rsplit("@", 1)[0]
            for qid, off in queues.items():
                out[(topic, qid)] = min(out.get((topic, qid), off), off)
        return out

    def state(self) -> dict[str, Any]:
        queues = []
        for (topic, qid) in self.queue_keys():
            cq = self._cq_table[(topic, qid)]
            lo, hi = self.min_offset_in_queue(topic, qid), cq.max_offset_in_queue  # lo: from the tier, if tiered
            queues.append({"topic": topic, "queueId": qid, "minOffsetInQueue": lo, "maxOffsetInQueue": hi,
                           "messageTotalInQueue": hi - lo})
        d = {"minPhyOffset": self.min_phy_offset(), "maxPhyOffset": self.max_phy_offset(),
             "abortFilePresent": self.abort_file_present, "checkpoint": self.checkpoint.to_dict(),
             "reservedBytes": reserved_bytes(self.root), "queues": queues}
        if self.tier is not None:
            d["tier"] = self.tier.status()
        if not self.read_only:
            d["writeable"] = self.running_flags.why_not_writeable() is None
            d["notWriteableReason"] = self.running_flags.why_not_writeable()
            d["dispatchBehindBytes"] = self.dispatch_behind_bytes()
            d["indexError"] = self.index_service.build_error
            d["indexMissedFrom"] = self.index_service.missed_from
        return d

    # ------------------------------------------------------------ closing
    def close(self) -> None:
        """Stop services, flush everything, delete the abort file when clean, release the lock."""
        if self.closed:
            return
        if self.read_only:
            self.closed = True
            self._close_files()
            return
        if self.reput is not None:
            self.wait_dispatched(timeout=30)
        with self.commitlog.put_lock:
            self.closed = True
        for s in reversed(self._services):
            s.shutdown()
        clean = self.running_flags.why_not_writeable() is None and self.dispatch_behind_bytes() == 0
        if self.index_service.missed_from is not None:  # the abort file stays: the next open re-indexes them
            log.warning("%s: records from commitlog offset %d on are not indexed yet (%s); the next open recovers "
                        "them", self.root, self.index_service.missed_from, self.index_service.build_error)
            clean = False
        try:
            if not self._services:  # no flusher ran: flush the queues, and let the checkpoint say so, here
                FlushConsumeQueueService(self).run_once(force=True)
            self.index_service.flush()
            self.flush_checkpoint()
            self.commitlog.queue.discard_preallocated()
            if clean and os.path.exists(self.paths.abort):
                os.unlink(self.paths.abort)
                if os.path.exists(self.paths.abort_boot):
                    os.unlink(self.paths.abort_boot)
        finally:
            self._close_files()
            self._release_lock()

    def _close_files(self) -> None:
        for attr in ("commitlog", "index_service"):
            obj = getattr(self, attr, None)
            if obj is not None:
                obj.close()
        for cq in self._cq_table.values():
            cq.close()


def _repair_marker_gate(root: str, config: StoreConfig | None, read_only: bool) -> None:
    """A store under repair is half rewritten: a reader refuses it, naming the marker; a writer first finishes
    the repair (or rolls it back, if it was still rewriting segments), so it sees the old state or the new."""
    from .repair import describe_marker, finish_interrupted_repair, read_marker
    if read_only:
        marker = read_marker(root)
        if marker is not None:
            raise StoreLoadError(f"{describe_marker(root, marker)}; a writable open (rocketstore recover) finishes "
                                 "or rolls it back; nothing was read")
        return
    finish_interrupted_repair(root, config)


def _boot_id() -> str | None:
    return _read_text("/proc/sys/kernel/random/boot_id")


def _read_utf8(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, ValueError):
        return None


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as fh:
            return fh.read().strip()
    except (OSError, ValueError):
        return None


def _damaged_unit(seg: Any, pos: int, size: int, cq: ConsumeQueue, cq_file: Any, topic: str, queue_id: int,
                  unit: int, check_crc: bool) -> CorruptRecordError:
    """The error for a consume-queue unit whose record is damaged or is another queue's (the slow path)."""
    phy = seg.file_from_offset + pos
    where = (f"{seg.path} at offset {phy} (file position {pos}), read through consume queue {topic}/{queue_id} "
             f"offset {unit} ({cq_file.path} position {unit * CQ_STORE_UNIT_SIZE % cq.file_size})")
    try:
        m = codec.decode(seg.mm, pos, pos + size, check_crc=check_crc, read_body=False)
    except codec.RecordError as e:
        return CorruptRecordError(f"{where}: damaged record: {e}", path=seg.path, offset=phy)
    return CorruptRecordError(
        f"{where}: the record there is {m.topic}/{m.queue_id} offset {m.queue_offset}, {m.size} bytes, "
        f"not the unit's {topic}/{queue_id} offset {unit}, {size} bytes", path=seg.path, offset=phy)


def _records_not_held(commitlog: CommitLog, held: dict[tuple[bytes, int], int]) -> Iterator[tuple[Any, int, int]]:
    """(segment map, position, size) of every trusted NOT_TYPE/COMMIT record, in commitlog order, whose queue
    ``held`` does not cover (see :func:`codec.scan_records`), from the first segment to the log's end; a
    damaged record is stepped over to the next intact one."""
    file_size = commitlog.file_size
    for f in list(commitlog.queue.files):
        mm, base, pos, stop = f.mm, f.file_from_offset, 0, f.wrote_position
        while pos < stop:
            pos, _last, _n, wanted = codec.scan_records(mm, pos, stop, file_size, base=base, check_crc=True,
                                                        held=held)
            for w in wanted:
                yield mm, w, codec.read_total_size(mm, w)
            if pos >= stop:
                break
            item = next(codec.walk(mm, pos, file_size, check_crc=True, parsed=True, base=base), None)
            if item is None or item[1] == 0:  # zeros or the blank record: the end of this segment's records
                break
            if item[2] is not None:  # a trusted record after all (scan_records left it)
                h, tp, tl, _ = item[2]
                if h[7] & codec.TRANSACTION_MASK in _QUEUED_TXN and \
                        held.get((bytes(mm[tp:tp + tl]), h[3]), -1) != codec.NO_INDEX:
                    yield mm, pos, item[1]
                pos += item[1]
                continue
            nxt = codec.find_record(mm, pos + 1, stop, base, check_crc=True)
            log.warning("%s at file position %d: %s; stepped over", f.path, pos, item[3] or "damaged record")
            if nxt is None:
                break
            pos = nxt


def _lost_unit(cq: ConsumeQueue, cq_file: Any, topic: str, queue_id: int, unit: int, phy: int, size: int,
               why: str) -> CorruptRecordError:
    """The error for a consume-queue unit whose record is not where it says and was not removed by retention."""
    return CorruptRecordError(
        f"consume queue {topic}/{queue_id} offset {unit} ({cq_file.path} position "
        f"{unit * CQ_STORE_UNIT_SIZE % cq.file_size}) says commitlog offset {phy}, {size} bytes, but {why}; the "
        f"message is not returned nor skipped (rocketstore verify --repair rebuilds the queue from the commitlog)",
        path=cq_file.path, offset=phy)


def _indexed_record(f: Any, pos: int, read_body: bool) -> MessageExt:
    """The record an index entry points at (position ``pos`` of segment ``f``); its CRC is not checked yet."""
    try:
        return codec.decode(f.mm, pos, f.wrote_position, read_body=read_body)
    except codec.RecordError as e:
        raise CorruptRecordError(f"{f.path} at offset {f.file_from_offset + pos} (file position {pos}): an index "
                                 f"entry points here but no record decodes: {e}", path=f.path,
                                 offset=f.file_from_offset + pos) from None


def _signed32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - 0x100000000 if v & 0x80000000 else v


def _wait_store_msg_ok(m: Message) -> bool:
    v = m.properties.get("WAIT") if m.properties_string is None else codec.parse_properties(
        m.properties_string).get("WAIT")
    return v is None or v.lower() == "true"


_QUEUED_TXN = (codec.TRANSACTION_NOT_TYPE, codec.TRANSACTION_COMMIT)
_UNSAMPLED = SAMPLE_EVERY - 1


def batch_problem(messages: list[Message]) -> str | None:
    """Why ``put_batch`` would refuse these messages as one batch, or None."""
    if not messages:
        return "empty batch"
    first = messages[0]
    for m in messages:
        if (m.topic, m.queue_id) != (first.topic, first.queue_id):
            return "a batch must hold one topic and queue"
        if m.sys_flag & codec.TRANSACTION_MASK:
            return "a batch cannot hold transaction messages"
    return None
