"""StoreLoader: opening a store's files and bringing them to a state every read can trust.

RocketMQ's ``DefaultMessageStore.load`` and its recovery, plus what rocketstore adds (docs/data-safety.md):
stray and torn files found before anything moves (quarantine only once every file is known), a torn last
segment extended, lost or torn consume queues refilled from the commitlog at their own offsets, lost index
entries rebuilt (the ``index.rebuild`` marker), an interrupted queue rebuild finished, and the durable
queue registry that tells a lost directory from a queue that never was.  ``MessageStore`` runs it once.
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from ..errors import StoreLoadError
from ..errors import TierError
from ..format import codec
from ..format.message import illegal_topic
from ..storage.checkpoint import StoreCheckpoint
from ..storage.commitlog import CommitLog
from ..storage.consume_queue import ConsumeQueue
from ..config import SYNC_FLUSH, StoreConfig
from ..paths import StorePaths
from ..services.flush import FlushConsumeQueueService
from ..storage.geometry import store_config
from ..storage.store_lock import StoreLock
from ..storage.files import InFiles, StoreFiles
from ..storage.index import IndexService
from ..storage.jsonfile import replace_file_durably
from ..storage.quarantine import QuarantinePlan, extend_torn_last_segment, file_kind
from ..storage.read import StoreReader
from ..tier.tiered import TieredStorage, refuse_without_tier
from .recover import drop_mismatched_tail, queues_with_records_before, recover

log = logging.getLogger(__name__)


def boot_id() -> str | None:
    """This OS boot's id: an abort file of the same boot means only the process crashed."""
    return read_text("/proc/sys/kernel/random/boot_id")


def _read_utf8(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, ValueError):
        return None


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as fh:
            return fh.read().strip()
    except (OSError, ValueError):
        return None


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
                if h[7] & codec.TRANSACTION_MASK in codec.QUEUED_TXN and \
                        held.get((bytes(mm[tp:tp + tl]), h[3]), -1) != codec.NO_INDEX:
                    yield mm, pos, item[1]
                pos += item[1]
                continue
            nxt = codec.find_record(mm, pos + 1, stop, base, check_crc=True)
            log.warning("%s at file position %d: %s; stepped over", f.path, pos, item[3] or "damaged record")
            if nxt is None:
                break
            pos = nxt




class StoreLoader:
    """Loads and recovers a store's files once, for MessageStore (and for repair's rebuild)."""

    # in StoreFiles (one copy of each open file and table)
    paths, root, config, read_only, clock, commitlog, checkpoint, index_service, tier = (InFiles() for _ in range(9))
    topic_queue_table, queues_to_rebuild, recovery_report, _cq_table, last_exit_ok = (InFiles() for _ in range(5))
    abort_file_present, process_crash_only, lost_queues = (InFiles() for _ in range(3))

    def __init__(self, files: StoreFiles, reader: StoreReader, allow_quarantine: bool = False) -> None:
        self.files = files
        self.reader = reader
        self._index_flushes: list[threading.Thread] = []  # flushes of full index files (_on_index_file_full)
        self._quarantine = QuarantinePlan(files.root, allow_quarantine)  # carried out once loading has seen every file
        # the queues known to exist and the queue offset each one's next put may not go below (paths.queue_registry)
        self._registry: dict[tuple[str, int], int] | None = None
        self._registry_text: str | None = None  # what the registry file holds (written by this store)
        self._registry_lock = threading.Lock()
        # the lost queues ("topic/queueId") the rebuild marker names before recovery (_mark_lost_queues)
        self._lost_names: list[str] = []
        # The hooks StoreFiles calls back: the registry is the loader's, per-topic retention a read's.
        files.on_new_queue = self.on_new_queue
        files.save_queue_registry = self.save_queue_registry
        files.apply_topic_retention = reader.apply_topic_retention

    def find_consume_queue(self, topic: str, queue_id: int) -> ConsumeQueue:
        return self.files.find_consume_queue(topic, queue_id)

    def consume_queues(self) -> list[ConsumeQueue]:
        return self.files.consume_queues()

    def messages(self, *args: Any, **kw: Any) -> Iterator[Any]:
        return self.reader.messages(*args, **kw)

    def queue_claiming(self, *args: Any) -> tuple[str, int, int] | None:
        return self.files.queue_claiming(*args)

    def load(self) -> None:
        cfg, ro = self.config, self.read_only
        refuse_without_tier(self.root, cfg.tieredStoreUri)  # before any file is read or written
        self.last_exit_ok = not os.path.exists(self.paths.abort)
        self.abort_file_present = not self.last_exit_ok
        # After a crash of the process alone (same OS boot), every byte written through the maps is intact,
        # so the index files need not be dropped and rebuilt; after a reboot or power loss they may be torn.
        self.process_crash_only = self.abort_file_present and boot_id() is not None and \
            read_text(self.paths.abort_boot) == boot_id()
        if not ro:
            os.makedirs(self.paths.commitlog, exist_ok=True)
            os.makedirs(self.paths.consumequeue, exist_ok=True)
        self.commitlog = CommitLog(self.paths.commitlog, cfg.mappedFileSizeCommitLog, read_only=ro, clock=self.clock,
                                   warm=cfg.warmMapedFileEnable, gather_all=cfg.flushDiskType == SYNC_FLUSH)
        unfinished = read_text(self.paths.cq_rebuild)
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
            self._republish_lost_manifest()
            self.commitlog.tier = self.tier
        self._load_consume_queues()
        self._check_quarantine()  # before the checkpoint and the index are touched
        loaded = set(self._cq_table)
        if not ro:
            self._registry = self._read_queue_registry(loaded)
            self._mark_lost_queues(loaded)
        else:  # a reader cannot rebuild a lost queue: it names the loss (missing is not empty)
            self.lost_queues = set(self._read_queue_registry(loaded)) - loaded
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
        for name in self.queues_to_rebuild:  # a rebuild places each unit at its record's queue offset
            topic, _, qid = name.rpartition("/")
            if (cq := self._cq_table.get((topic, int(qid)))) is not None:
                cq.pad_gaps = True
                if not ro:
                    self._check_kept_end(cq)
        if not ro:
            self._refill_from_tier(self.refill_from())
        self.recovery_report = recover(self.files, self.last_exit_ok, self.refill_from())
        self.recovery_report.index_files_dropped = dropped
        if not ro:
            self._refuse_a_log_behind_its_tier()
            self._refill_lost_queues(loaded)
            self._keep_registered_offsets()
            self._write_queue_registry(offsets=True)
        self._finish_queue_rebuild()
        if reindex:
            self._reindex_lost_entries(reindex_from)
        self.commitlog.confirm_offset = self.commitlog.max_offset()
        if not ro:  # recovery placed (and synced) the unit of every record up to here
            cp = self.checkpoint
            cp.logics_dispatched_end = max(cp.logics_dispatched_end, self.commitlog.max_offset())

    def _plan_reindex(self) -> bool:
        """Whether index entries were lost with a damaged index file (moved to quarantine, the files after it
        dropped) or by an unfinished rebuild: a marker that says so is made durable before any file moves,
        so a crash before the rebuild ends leaves it to the next writable open (missing is not empty)."""
        unfinished = os.path.exists(self.paths.index_rebuild)
        index = self.index_service
        if not index.files and not index.damaged and self.config.messageIndexEnable and \
                self._commitlog_starts_with_a_record():
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
            replace_file_durably(self.paths.index_rebuild, ("\n".join(self.index_service.damaged) + "\n").encode())
        return True

    def _commitlog_starts_with_a_record(self) -> bool:
        """Whether the first local segment starts with bytes a commitlog walk reads (not zeros).  Before recovery
        the log ends where its files end, so a store whose records were all cut off (a segment of zeros, its
        index files deleted with them) would otherwise count as holding records."""
        for mf in self.commitlog.queue.files:
            if mf.available:
                return mf.mm[:8] != bytes(8)
        return False

    def _reindex_lost_entries(self, start: int) -> None:
        """Index again every record from ``start`` (where the index files kept end) to the log's end.

        Only records the index lacks are offered: after a clean shutdown
        recovery indexes just the records past the consume queues' end, so any
        it added are taken back first (entries go in commitlog order).  Walks
        trusted records only (a stale copy at the wrong position is skipped).
        """
        index = self.index_service
        if self.config.messageIndexEnable:
            lowest = self._unindexed_from()
            from_tier = max(start, lowest) < self.commitlog.min_offset()  # records only the tier holds first
            if index.resume_offset() > start and (not self.recovery_report.abnormal or from_tier):
                # Recovery indexed records the index must hold after ones it still lacks: past the queues' end
                # after a clean stop, or (it reads local segments only) the local records after the tier's.
                index.truncate(start + 1, lambda off: self.commitlog.pickup_store_timestamp(off, 0))
            start = max(index.resume_offset(), lowest)
            from ..services.dispatch import CommitLogDispatcher
            dispatcher = CommitLogDispatcher(self.files)
            n = 0
            try:
                for off, _size, msg, problem in self.messages(start, read_body=False, skip_damaged=True):
                    if msg is None:
                        log.warning("index rebuild: %s; not indexed", problem)
                        continue
                    if msg.commit_log_offset != off or msg.sys_flag & codec.TRANSACTION_MASK == \
                            codec.TRANSACTION_ROLLBACK:
                        continue
                    dispatcher.dispatch(msg, index=True, queue=False)
                    n += 1
            except TierError as e:
                # Entries go in commitlog order: the tier's records cannot be indexed after the local ones, so
                # nothing is indexed past them and the marker stays for the next open (missing is not empty).
                index.flush()
                raise StoreLoadError(f"{self.paths.index_rebuild}: the index rebuild must read the records the "
                                     f"tier holds from commitlog offset {start} (their index files are lost): {e}; "
                                     "a writable open with the tier reachable finishes it") from None
            index.flush()
            log.warning("index entries rebuilt from the commitlog for %d records from offset %d (damaged: %s)", n,
                        start, ", ".join(index.damaged) or "an unfinished rebuild")
        index.damaged.clear()
        os.unlink(self.paths.index_rebuild)

    def _republish_lost_manifest(self) -> None:
        """A writable open puts a lost or stale ``tier.json`` back before anything reads the tier, as its upload
        round would later (the local copy once its objects check out, else one rebuilt from the tier's objects).
        Otherwise a crash between a publish's local copy and its bucket write left reads of tier-held records
        failing until that round ran, and a torn queue file whose records only the tier holds left the store
        unopenable until an operator restored the manifest.  A republish that fails leaves the fault: reads
        that need the tier raise naming it."""
        tier = self.tier
        if self.read_only or tier is None or tier.error is None or tier.fault is None or not tier.republishable:
            return
        try:
            tier.republish()
        except TierError as e:
            log.info("tier: %s could not be republished during the open: %s", tier.loc.uri, e)  # (reads say why)

    def _refuse_a_log_behind_its_tier(self) -> None:
        """Refuse a writable open whose local commitlog ends below the end of the segments its tier holds (the
        store's files restored from a backup older than the tier): a put would be written at offsets whose
        records the tier already holds, and once retention trusts the tier for that segment a read returns the
        tier's message there, not the one acknowledged (data-safety rule: never another message at an offset)."""
        tier = self.tier
        if tier is None or tier.error is not None or tier.manifest is None or not tier.manifest.commitlog:
            return
        local_end, tier_end = self.commitlog.max_offset(), tier.manifest.end_offset
        if local_end < tier_end:
            raise StoreLoadError(f"{self.paths.commitlog}: the local commitlog ends at {local_end}, but the tier "
                                 f"{tier.loc.uri} holds its segments up to {tier_end} (tier.json generation "
                                 f"{tier.manifest.generation}): the store's files are older than its tier (restored "
                                 "from a backup?); new messages would take offsets the tier's records hold.  Put "
                                 "back the store's newer files, or move the tier aside")

    def _unindexed_from(self) -> int:
        """Where the records no index file holds may start, for a rebuild of lost index entries.

        The commitlog is local segments plus the tier's (data-safety rule 1): a
        rebuild from the local start alone leaves the keys of tier-held records
        unfindable when their index file was lost before it was uploaded.  The
        index files the tier holds cover its records up to the highest end
        offset among them (uploads go in order), so the rebuild starts there,
        or at the tier's start; records below that are read from the tier.
        """
        local = self.commitlog.min_offset()
        lowest = self.commitlog.min_offset_with_tier()
        if lowest >= local or self.tier is None or self.tier.manifest is None:
            return local
        covered = max((f.end_phy_offset for f in self.tier.manifest.index), default=0)
        return min(local, max(lowest, covered))

    def _on_bad_file(self, path: str, reason: str) -> None:
        """A bad file: refuse when read-only; when writable, plan to move it to quarantine/ (rocketstore
        extension), done by :meth:`_move_to_quarantine` once loading has seen every file."""
        if self.read_only:
            raise StoreLoadError(f"{path}: {reason}")
        self._quarantine.moves.append((path, reason))

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
            # Until recovery has refilled them; the lost queues _mark_lost_queues named stay named (a read-only
            # view takes a lost queue back once no marker names it).
            self._save_rebuild_marker(self.queues_to_rebuild + self._lost_names)
        if self.paths.checkpoint in self._quarantine.carry_out():
            self.checkpoint.flush()  # a fresh one where the bad one was

    def _mark_lost_queues(self, loaded: set[tuple[str, int]]) -> None:
        """Name the registered queues whose directory is gone in the rebuild marker before recovery runs.

        Recovery may make such a directory again, with the units of the records it offers only, before
        :meth:`_refill_lost_queues` rebuilds the queue whole; a read-only view beside this writer
        (tail_view) takes a lost queue back once its directory is there and no marker names it, so without
        the marker it could read that partial queue (missing is not empty)."""
        lost = sorted(set(self._registry or ()) - loaded)
        if not lost or not self.commitlog.queue.files:
            return  # (_refill_lost_queues rebuilds nothing either)
        self._lost_names = [f"{t}/{q}" for t, q in lost]
        self._save_rebuild_marker(self.queues_to_rebuild + self._lost_names)

    def _save_rebuild_marker(self, names: list[str]) -> None:
        """Write the consume-queue rebuild marker naming ``names`` (once each), replaced whole: never seen empty
        or torn by a reader or a power cut."""
        replace_file_durably(self.paths.cq_rebuild, ("\n".join(dict.fromkeys(names)) + "\n").encode())

    def _finish_queue_rebuild(self) -> None:
        """Make the refilled queues durable, then drop the marker that made recovery start where they end."""
        if self.read_only or not self.queues_to_rebuild:
            if self._lost_names and os.path.exists(self.paths.cq_rebuild):  # (no queue was rebuilt after all)
                os.unlink(self.paths.cq_rebuild)
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
        cq.note_kept_end()  # where the refill (from the tier, then recovery's) takes up the queue
        self.queues_to_rebuild.append(f"{cq.topic}/{cq.queue_id}")

    def _check_kept_end(self, cq: ConsumeQueue) -> None:
        """Cut the kept units at the end of a queue being rebuilt that are not valid units of their records
        (data-safety rule 1, a trusted record agrees with its unit): the refill takes up the queue where they
        end, so a last unit damaged into a later valid-looking offset would have it skip the records before
        that offset as already placed and write their units blank."""
        try:
            cut = drop_mismatched_tail(self.files, cq, through_tier=True)
        except TierError as e:
            raise StoreLoadError(f"{self.paths.cq_rebuild}: the rebuild of {cq.topic}/{cq.queue_id} must check "
                                 f"its last kept unit against the record the tier holds: {e}; a writable open with "
                                 "the tier reachable finishes it") from None
        if cut:
            log.warning("%s-%d: the kept units end in damaged ones; the rebuild takes up the queue at commitlog "
                        "offset %d", cq.topic, cq.queue_id, cq.max_physic_offset)

    def _refill_lost_first_files(self) -> None:
        """Queues whose first units were lost, not expired: their records are still in the commitlog.

        A queue starting past unit 0 looks like retention deleted its first
        files; it did only if the records those units pointed at are below the
        commitlog's minimum.  When one is still there, the queue is rebuilt
        from the commitlog (every file goes and recovery refills it).  A queue
        directory without a file lost every unit it had: with a tier holding
        records below the local log it is rebuilt from those too.
        """
        min_phy = self.commitlog.min_offset()
        firsts: dict[tuple[str, int], tuple[int, int]] = {}
        for key, cq in self._cq_table.items():
            if f"{key[0]}/{key[1]}" in self.queues_to_rebuild:
                continue
            zeros = bool(cq.queue.files) and cq.holds_no_unit()
            if zeros and (self._registry or {}).get(key, 0) > 0:
                # Zero-filled where the registry says units were (missing is not empty): its records may lie
                # anywhere, the tier's included, so the queue is rebuilt from the log's start.  (One whose
                # records were all lost too is left with no file: later opens take the cheaper look below.)
                log.warning("%s-%d: its files hold no unit, but the queue registry says it reached queue offset %d "
                            "(a zero-filled queue file); rebuilding it from the commitlog", key[0], key[1],
                            self._registry[key] - 1)
                self._rebuild_queue(cq, [])
                continue
            first = cq.first_unit()
            if first is not None and first[1] > 0 and first[0] > min_phy:
                firsts[key] = first
            elif not cq.queue.files or zeros:  # no file, or files of zeros: any record of it was lost
                firsts[key] = (codec.NO_INDEX, codec.NO_INDEX)
        lost = queues_with_records_before(self.files, firsts)
        if self.commitlog.min_offset_with_tier() < min_phy:
            # The scan reads the local segments only: a queue without a file may have had its records where
            # only the tier holds them.  The rebuild reads the tier first and places whatever is there.
            lost |= {key for key, first in firsts.items() if first[0] == codec.NO_INDEX}
        for topic, qid in sorted(lost):
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
        lost = sorted(set(self._registry or ()) - loaded)  # registered, directory gone: rebuilt, never empty
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
        self._save_rebuild_marker(self.queues_to_rebuild)
        for key in lost:
            cq = self._cq_table.pop(key, None)
            if cq is None:
                continue
            for f in list(cq.queue.files):
                cq.queue.files.remove(f)
                f.destroy()
            cq.close()
        refilled: set[ConsumeQueue] = set()
        if self.tier is not None:  # the records only the tier holds come first, in commitlog order (rule 1)
            for key in lost:
                cq = self.find_consume_queue(*key)
                cq.pad_gaps = True
                refilled.add(cq)
            self._refill_from_tier(-1, names)
        from ..services.dispatch import CommitLogDispatcher
        dispatcher = CommitLogDispatcher(self.files)
        held = {}
        for (t, q) in self._cq_table:
            if (t, q) in lost:
                continue  # (its records from the tier are placed: the local ones follow)
            try:
                held[(t.encode("utf-8"), q)] = codec.NO_INDEX  # every record of a queue kept is skipped
            except UnicodeEncodeError:
                pass
        with self.checkpoint.dispatch_marks_kept():
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
        for cq in refilled:
            cq.pad_gaps = False
        self.files.recover_topic_queue_table()

    def _refill_from_tier(self, start: int | None, names: list[str] | None = None) -> None:
        """A queue being rebuilt whose kept units end below the local log's start: the records in between are
        in the tier only (the commitlog is local segments plus the tier's, data-safety rule 1), and recovery
        walks the local segments.  Their units are placed here first, in commitlog order, else they would be
        written as blank units and their acknowledged messages skipped.  With the tier down the open is
        refused and the rebuild marker stays (missing is not empty)."""
        local = self.commitlog.min_offset()
        if start is None or self.tier is None or start >= local:
            return
        rebuilt = set(self.queues_to_rebuild if names is None else names)
        from ..services.dispatch import CommitLogDispatcher
        dispatcher = CommitLogDispatcher(self.files)
        n = 0
        start = max(start, self.commitlog.min_offset_with_tier())
        try:
            with self.checkpoint.dispatch_marks_kept():
                for off, _size, msg, problem in self.messages(start, read_body=False, skip_damaged=True):
                    if off >= local:
                        break
                    if msg is None:
                        log.warning("queue rebuild from the tier: %s; not placed", problem)
                        continue
                    if msg.commit_log_offset == off and f"{msg.topic}/{msg.queue_id}" in rebuilt:
                        dispatcher.dispatch(msg, index=False, queue=True)
                        n += 1
        except TierError as e:
            raise StoreLoadError(f"{self.paths.cq_rebuild}: the rebuild of consume queues {sorted(rebuilt)} must "
                                 f"read the records the tier holds from commitlog offset {start}: {e}; a writable "
                                 "open with the tier reachable finishes it") from None
        log.warning("consume queues %s: %d unit(s) placed from records the tier holds", ", ".join(sorted(rebuilt)),
                    n)

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

    def _read_queue_registry(self, loaded: set[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """The queues the store created, each with a queue offset its next put may not go below
        (config/consumeQueues.registry, one ``TOPIC/QUEUEID NEXTOFFSET`` a line; a line without an offset, as
        the first version wrote, says 0).  A store without one (older, or written by RocketMQ) starts it from
        the directories it has.  A registered queue whose directory is gone is rebuilt from the commitlog by
        _refill_lost_queues (a lost directory is not an empty queue, rule 4), and one whose records all
        expired keeps its offsets (:meth:`_keep_registered_offsets`).  A line that does not parse refuses the
        open, naming the file and the line: guessing would forget a queue or hand out its offsets again."""
        text = _read_utf8(self.paths.queue_registry)
        if text is None:
            if os.path.exists(self.paths.queue_registry):
                raise StoreLoadError(f"{self.paths.queue_registry}: not UTF-8 text; the queue registry is damaged "
                                     "(remove it to start it again from the consume-queue directories)")
            return {key: 0 for key in loaded}
        self._registry_text = text
        out: dict[tuple[str, int], int] = {}
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            name, _, nxt = line.partition(" ")
            topic, _, qid = name.rpartition("/")
            if not topic or not qid.lstrip("-").isdigit() or not (nxt == "" or nxt.isdigit()) or int(qid) > 2 ** 31 - 1:
                raise StoreLoadError(f"{self.paths.queue_registry} line {n}: {line[:80]!r} is not "
                                     "'TOPIC/QUEUEID NEXTOFFSET'; the queue registry is damaged (remove it to start it "
                                     "again from the consume-queue directories)")
            out[(topic, int(qid))] = max(out.get((topic, int(qid)), 0), int(nxt or 0))
        return out

    def _keep_registered_offsets(self) -> None:
        """A queue left with no unit (its records all expired, then its directory was lost, or a rebuild found
        none of them in the commitlog) takes its next queue offset from the registry, never 0 again: the
        offsets its expired records had are not handed out a second time (rule 2).  A queue that still has
        units is left alone: its units reach past every expired record."""
        for key, nxt in (self._registry or {}).items():
            cq = self._cq_table.get(key)
            if nxt <= self.topic_queue_table.get(key, 0) or (cq is not None and cq.max_offset_in_queue > 0):
                continue
            log.warning("%s-%d has no unit left, but the queue registry says its records reached queue offset %d "
                        "(expired or lost): new messages take queue offsets from %d", key[0], key[1], nxt - 1, nxt)
            self.topic_queue_table[key] = nxt

    def save_queue_registry(self) -> None:
        """Write the registry with every queue's next queue offset (before retention deletes segments: the
        offsets of the records it removes must outlive them)."""
        self._write_queue_registry(offsets=True)

    def _write_queue_registry(self, offsets: bool = False) -> None:
        """Make the registry hold every queue of the table, durably (atomic replace, fsync), when it changed;
        ``offsets``: with each queue's next queue offset too.  The registry is kept in memory: only a change is
        written."""
        if self._registry is None:
            return
        with self._registry_lock:
            reg = dict(self._registry)
            for key in list(self._cq_table):
                reg.setdefault(key, 0)
                if offsets:
                    reg[key] = max(reg[key], self.topic_queue_table.get(key, 0))
            text = "".join(f"{t}/{q} {n}\n" for (t, q), n in sorted(reg.items()))
            if text != self._registry_text:
                os.makedirs(os.path.dirname(self.paths.queue_registry), exist_ok=True)
                replace_file_durably(self.paths.queue_registry, text.encode("utf-8"))
                self._registry_text = text
            self._registry = reg

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

    def on_new_queue(self, key: tuple[str, int]) -> None:
        if self._registry is not None and key not in self._registry:
            self._write_queue_registry()

    def _on_index_file_full(self, full: Any) -> None:
        """Flush a full index file off the dispatch thread, then let the checkpoint count it
        (indexMsgTimestamp); a close waits for these (:meth:`settle_index_flushes`)."""
        def run() -> None:
            full.flush()
            self.checkpoint.indexMsgTimestamp = full.end_timestamp
            self.files.flush_checkpoint()
        t = threading.Thread(target=run, name="IndexFlush", daemon=True)
        self._index_flushes = [x for x in self._index_flushes if x.is_alive()] + [t]
        t.start()

    def settle_index_flushes(self, timeout: float = 30.0) -> None:
        """Wait for the flushes of full index files still running: a close that went on without them unmapped
        the file under the flush (an exception in the thread) and wrote its last checkpoint without the file's
        end time."""
        for t in self._index_flushes:
            t.join(timeout)


@contextmanager
def loaded(root: str, config: StoreConfig, *, read_only: bool = False) -> Iterator[StoreFiles]:
    """A store's files loaded and recovered, without the facade and its services: what repair needs for its
    rebuild and for the verify after it.  Writable, it holds the store lock as MessageStore does, and before it
    closes it flushes what a clean close of the facade flushes (queues, index, checkpoint)."""
    files = StoreFiles(StorePaths(root), store_config(root, config), read_only=read_only)
    loader = StoreLoader(files, StoreReader(files))
    lock = None if read_only else StoreLock(root)
    if lock is not None:
        lock.acquire()
    try:
        loader.load()
        yield files
        if not read_only:
            FlushConsumeQueueService(files).run_once(force=True)
            loader.settle_index_flushes()
            files.index_service.flush()
            files.flush_checkpoint()
            files.commitlog.queue.discard_preallocated()
    finally:
        files.close()
        if lock is not None:
            lock.release()
