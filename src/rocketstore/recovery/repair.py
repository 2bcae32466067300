"""Offline repair: keep every trusted CommitLog record as it is, then rebuild the consume queues, index and checkpoint.

The CommitLog is the source of truth and repair never deletes or zeroes bytes
that hold a valid record, but for the torn tail of a power loss (below), which
recovery would end the log at as well (the originals are kept).  It walks every segment with the full checks (magic,
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
  the rebuild's recovery ends the log there, as RocketMQ would;
* **the cut** of the torn tail of a power loss: after an unclean stop of
  another boot, the first span past the checkpoint's flushed point that
  recovery would take for the torn end of unflushed writes (its refusals'
  rule, ``recover.cuts_as_torn_tail``) ends the log, with the intact records
  a power loss left after it (pages reach the disk in any order): the rest of
  its segment is zeroed and later segments removed, originals kept.  Recovery
  ends the log there too; keeping them would leave gaps or tombstones for
  messages that were never flushed.

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
import os
import shutil
import time
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Iterator

from ..format import codec
from ..config import StoreConfig
from ..errors import StoreError, StoreLoadError, StoreLockedError
from ..storage.quarantine import extend_torn_last_segment
from ..storage.index import IndexService
from ..paths import StorePaths
from ..storage.geometry import configured, store_config
from ..tier.tiered import refuse_without_tier
from ..storage.checkpoint import StoreCheckpoint
from ..storage.commitlog import CommitLog
from .load import boot_id, loaded, read_text
from .recover import cuts_as_torn_tail
from .verify import finding, verify_store

from .damage import (DamagedSpan, held_queue_offsets, lost_messages, filler_pieces, filler_record, header_fixes,
                     layout, plan, tombstone_record)
from .placement import (old_unit_reader, place_queues, tier_copies, tier_end, tier_records, trusted_records,
                        write_queue)

from ..storage.jsonfile import fsync_dir

log = logging.getLogger(__name__)

REPORT_NAME = "report.json"
# Phases of a repair, as its marker (StorePaths.repair_marker) names them: while "commitlog", an interrupted repair
# is rolled back (every segment's original is kept); from "rebuild" on it is finished (the rebuild is idempotent).
PHASES = ("commitlog", "rebuild", "finish")
GEOMETRY_KEYS = ("mappedFileSizeCommitLog", "mappedFileSizeConsumeQueue", "maxHashSlotNum", "maxIndexNum")


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


# ---------------------------------------------------------------- durable steps

def _write_durably(path: str, data: bytes) -> None:
    """Write ``data`` beside ``path``, fsync, rename over it, fsync the directory: old bytes or new, never half."""
    d, name = os.path.split(path)
    tmp = os.path.join(d, f".{name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(d)


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
    fsync_dir(os.path.dirname(dest))


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
        if [piece[:3] for s in file_spans for piece in s.pieces] == [(int(name), file_size, "cut")]:
            log.warning("%s: past the torn tail of a power loss: removed as recovery removes it; original kept in "
                        "%s", p, keep)
            os.unlink(p)  # (a roll-back puts the kept original back)
            fsync_dir(cdir)
            _step("removed " + name)
            continue
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
                    elif kind == "tier copy":
                        os.pwrite(fh.fileno(), s.restored, at)
                    elif kind == "cut":  # the torn tail of a power loss: the log ends here
                        os.pwrite(fh.fileno(), bytes(length), at)
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
        fsync_dir(cdir)
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
        fsync_dir(paths.commitlog)
    shutil.rmtree(qdir, ignore_errors=True)
    if os.path.isdir(paths.quarantine) and not os.listdir(paths.quarantine):
        os.rmdir(paths.quarantine)
    os.unlink(paths.repair_marker)
    fsync_dir(paths.root)
    log.warning("%s: an interrupted %s was rolled back before any segment stayed rewritten; the store is as it "
                "was before it", paths.root, marker.get("operation", "repair"))


# ---------------------------------------------------------------- rebuild phase: place, never append


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
        old_unit = old_unit_reader(old if os.path.isdir(old) else paths.consumequeue, cfg.mappedFileSizeConsumeQueue)
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
    fsync_dir(cq_new)
    if os.path.isdir(ix_new):
        fsync_dir(ix_new)
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
    fsync_dir(paths.root)


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
    if os.path.exists(paths.abort):  # the records of a writer that crashed: durable before the mark goes
        _sync_segments(paths)
    # The rebuilt files are whole: the next start is a normal one, and a queue refill the store had left
    # unfinished (consumequeue.rebuild) concerned the old queues.
    for name in ("abort", "abort.bootid", os.path.basename(paths.cq_rebuild)):
        src = os.path.join(paths.root, name)
        if os.path.exists(src):
            os.replace(src, os.path.join(qdir, name))
    fsync_dir(paths.root)
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


def _sync_segments(paths: StorePaths) -> None:
    """fdatasync every commitlog segment (and the directory), before the abort file leaves the store.

    After a crash of the process alone its last records may be in the page cache only; an open's recovery
    syncs them (they count as flushed from then on), but the rebuild opens the store as cleanly shut down,
    and the next run's flushes start at the log's end: a segment the crashed writer filled was never synced
    while the checkpoint of a clean shutdown said it was, and a power cut took its records.  After a reboot
    the pages are clean and this is cheap."""
    for name in sorted(os.listdir(paths.commitlog)):
        if len(name) == 20 and name.isdigit():
            fd = os.open(os.path.join(paths.commitlog, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
    fsync_dir(paths.commitlog)


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
    fsync_dir(paths.root)
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
    refuse_without_tier(root, configured(root, config).tieredStoreUri)
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


def _torn_tail_start(paths: StorePaths, cfg: StoreConfig, spans: list[DamagedSpan]) -> int | None:
    """The commitlog offset of the first damaged span that recovery would take for the torn tail of a power
    loss (:func:`recover.cuts_as_torn_tail`), or None.

    After a power loss the pages written since the last flush reach the disk in any order: a hole among them
    with intact records after it is the log's torn end, and recovery ends the log there (those records were
    never flushed).  It refuses the open only for damage to flushed records, and the operator then runs this
    repair: repairing that damage and keeping what lies past a later hole instead would leave the queues with
    gaps (or tombstones) for messages the power loss took, which no open of the same files without the
    earlier damage would have (store model seed 60050).  Only after an unclean stop of another boot (a crash of
    the process alone tears nothing), with a checkpoint that says how far the flushes reached, and past the
    segments a tier holds."""
    if not os.path.exists(paths.abort) or not spans:
        return None
    boot = boot_id()
    if boot is not None and read_text(paths.abort_boot) == boot:
        return None
    try:
        cp = StoreCheckpoint.load(paths.checkpoint, read_only=True)
    except StoreLoadError:
        return None
    if cp.physicMsgTimestamp <= 0:
        return None
    floor = max(cp.physicFlushedOffset, tier_end(paths.root, cfg))
    commitlog = CommitLog(paths.commitlog, cfg.mappedFileSizeCommitLog, read_only=True)
    try:
        commitlog.load()
        files = SimpleNamespace(root=paths.root, commitlog=commitlog, checkpoint=cp, process_crash_only=False)
        for s in spans:
            if s.restored is None and s.offset >= floor and cuts_as_torn_tail(files, s.offset):
                return None if s.action == "end-of-log" else s.offset  # (nothing after it: left to recovery)
    finally:
        commitlog.close()
    return None


def _cut_spans(paths: StorePaths, file_size: int, torn: int) -> list[DamagedSpan]:
    """The torn tail from commitlog offset ``torn`` to the log's end as spans to cut: the rest of its segment
    (zeros), and each later segment whole (removed); every original is kept in quarantine."""
    why = "past the torn tail of a power loss (writes after the last flush): the log ends here, as recovery ends it"
    cut = []
    for name in sorted(n for n in os.listdir(paths.commitlog) if len(n) == 20 and n.isdigit()):
        base = int(name)
        if base + file_size <= torn:
            continue
        start = max(base, torn)
        cut.append(DamagedSpan(os.path.join(paths.commitlog, name), start, base + file_size - start, why, "cut",
                               False))
    return cut


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
    refuse_without_tier(path, configured(path, config).tieredStoreUri)  # (its records are the tier's too)
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
        tier_copies(path, cfg, spans)  # damaged here, intact in the tier's copy: not lost, written back
        torn = _torn_tail_start(paths, cfg, spans)
        if torn is not None:  # the log ends there, as recovery ends it: what follows is cut, not kept past a hole
            spans = [s for s in spans if s.offset < torn] + _cut_spans(paths, cfg.mappedFileSizeCommitLog, torn)
        lost_messages(paths.consumequeue, [s for s in spans if s.restored is None])
        held = held_queue_offsets(spans, cfg.mappedFileSizeCommitLog)
        # Records whose routing fields contradict the old unit pointing at them: reported, never rewritten
        # (no CRC covers those fields, and the old unit is a cache: it may be the damaged one).
        suspects = header_fixes(paths.consumequeue, paths.commitlog, cfg.mappedFileSizeCommitLog, spans)
        qname = f"repair-{int(time.time() * 1000)}"  # the tombstones' note: decided before they are laid out
        for s in spans:
            if s.restored is not None:
                s.pieces = [(s.offset, s.length, "tier copy", None)]
                continue
            if s.action == "cut":
                s.pieces = [(s.offset, s.length, "cut", None)]
                for m in s.messages:
                    m["tombstone"] = False
                continue
            s.pieces = layout(s, held, qname)
            kept_as = {id(m) for _o, _n, kind, m in s.pieces if kind == "tombstone"}
            for m in s.messages:
                m["tombstone"] = id(m) in kept_as
            if s.pieces == [(s.offset, s.length, "filler", None)] and not filler_pieces(s.length):
                # Left in place it would stop recovery and cost every record after it: touch nothing.
                raise StoreError(f"{s.file}: damaged span of {s.length} bytes at commitlog offset {s.offset} "
                                 f"({s.reason}) is too short for a filler record; nothing was written")
        # What the spans are, for the dry run's answer and the marker's report alike.
        spans_report = {"lost": [s.to_json() for s in spans if s.restored is None],
                        "restored": [s.to_json() for s in spans if s.restored is not None]}
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
            result.update(spans_report)
            result["repaired"] = [f"commitlog: would rewrite {s.length} bytes at {s.offset} as "
                                  + ", ".join(kind for _o, _n, kind, _m in s.pieces) for s in spans if s.pieces]
            result["suspect"] = [f.to_json() for f in suspects]
            result["ok"] = result["ok"] and not result["lost"]
            return result
        qdir = os.path.join(paths.quarantine, qname)
        touched = sorted({os.path.basename(s.file) for s in spans if s.pieces})
        marker = {"operation": "verify --repair", "phase": "commitlog", "quarantine": qname, "segments": touched,
                  "pid": os.getpid(), "geometry": {k: getattr(cfg, k) for k in GEOMETRY_KEYS},
                  "report": {**spans_report, "suspect": [f.to_json() for f in suspects]}}
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
    result["restored"] = report.get("restored", [])
    result["suspect"] = report["suspect"]
    result["gaps"] = report.get("gaps", [])
    result["unplaced"] = report.get("unplaced", [])
    result["repaired"] = report["repaired"]
    if report.get("kept"):
        result["quarantine"] = qdir
    result["ok"] = result["ok"] and not report["lost"]
    return result
