"""Following a store that another process writes: extend a read-only view to what was appended since.

A read-only :class:`MessageStore` sees the files as recovery found them when it
was opened.  Re-opening to see newer messages repeats that recovery (the CRC of
the whole live segment: about 0.15 s for 100 MB here).  :func:`extend_view`
instead moves the view's ends forward, checking only what is new:

- commitlog: each record past the view's end must pass the CRC and carry its own
  position (PHYSICALOFFSET), as recovery demands; a blank record ends a segment
  and the next segment file, if there, is mapped;
- consume queues (of ``topics``): each new unit must point at a record inside the
  commitlog view whose size, topic, queue id, queue offset and tagsCode agree
  with the unit.  A unit the writer is still copying (a torn read through the
  shared mapping) fails that check and waits for the next call, so a reader
  never skips a message because it read a half-written unit.

Damage is not a record still being copied: bytes that are no trusted record with
a trusted record after them (the writer appends in order, so it has finished
with them) are a damaged record.  The view goes on past it, and so does each
queue past the unit pointing at it, so a read there raises an error naming the
damage and the messages after it are read: a follower never stops silently at
damage a writer (or a rolled-back repair) left behind.

The maps are shared with the writer (``MAP_SHARED``), so the bytes are the
writer's; a segment the writer deletes stays readable through the mapping.
"""

from __future__ import annotations

import logging
import os
import struct
import time
import weakref
from collections.abc import Callable, Iterable

from .format import codec
from .storage.consume_queue import CQ_STORE_UNIT_SIZE, ConsumeQueue
from .storage.mapped_file import MappedFile, MappedFileQueue, file_name
from .store import MessageStore

log = logging.getLogger(__name__)
_UNIT = struct.Struct(">qiq")
# Per read-only store: commitlog offsets of the damaged records its view went past (offset -> reason).
_DAMAGE: "weakref.WeakKeyDictionary[MessageStore, dict[int, str]]" = weakref.WeakKeyDictionary()
# Per read-only store: where its commitlog view last stopped at bytes that are not yet a whole record, and since
# when (monotonic seconds).  The search past damage (through the rest of the segment: up to a GiB of unused
# bytes) runs only once the view has stood there DAMAGE_AFTER seconds: a writer copies a record in microseconds,
# so a view that looks while a put is in progress (a follower of a busy writer, every few milliseconds) waits for
# the next look instead of searching each time.
_STOPPED: "weakref.WeakKeyDictionary[MessageStore, list[float]]" = weakref.WeakKeyDictionary()
DAMAGE_AFTER = 0.1


def extend_view(store: MessageStore, topics: Iterable[str] | None = None) -> bool:
    """Extend the read-only ``store``'s commitlog and the consume queues of ``topics`` (None: all) to what
    is complete on disk now; True when either grew.

    When the writer's retention has overtaken the view (the file after the view's last one is gone while
    later ones exist), the view moves on to the files that are left, as a fresh open would see them: the
    queues' minimums move up, so a read below them answers OFFSET_TOO_SMALL and a consumer skips ahead
    with a warning, instead of waiting for a file that will never come.
    """
    if not store.read_only:
        raise ValueError(f"{store.root}: extend_view is for read-only stores (a writer sees its own puts)")
    log_queue = store.commitlog.queue
    log_min = log_queue.min_offset()
    damage = _DAMAGE.setdefault(store, {})
    grew = _extend_commitlog(log_queue, damage, _STOPPED.setdefault(store, [-1, 0.0]))
    end = store.commitlog.max_offset()
    new_min = log_queue.min_offset()
    moved = new_min != log_min
    for cq in _queues(store, topics):
        first = cq.queue.first()
        grew |= _extend_consume_queue(store, cq, end, new_min, damage)
        if cq.queue.first() is not first and not moved:
            cq.correct_min_offset(new_min)
            grew = True
    if moved:  # records below the new minimum are gone: so are the units pointing at them
        for cq in store.consume_queues():
            cq.correct_min_offset(new_min)
        grew = True
    return grew


# How long past ``until`` a follower keeps looking: a put stamps its store time under the put lock a moment
# before its record is complete in the file, so a record stamped just before ``until`` may appear just after it.
FOLLOW_GRACE_MS = 1000


def follower(store: MessageStore, interval: float, on_idle: Callable[[], None] | None = None,
             until: int | None = None, clock: Callable[[], float] = time.time) -> Callable[[], bool]:
    """For ``Selection.scan(more=...)`` (``dump --follow``): at the end of the view, call ``on_idle`` (flush the
    output), then look every ``interval`` seconds until the writer has appended a record.

    ``until`` (a store time, epoch ms: ``--to-time``): once the clock is past it (plus
    :data:`FOLLOW_GRACE_MS`), no record still to come can be inside the window, so after one last look
    the follower answers False and the scan ends, on an idle store too."""
    def more() -> bool:
        if on_idle is not None:
            on_idle()
        while True:
            done = until is not None and clock() * 1000 > until + FOLLOW_GRACE_MS
            if extend_view(store, topics=()):
                return True
            if done:
                return False
            time.sleep(interval)
    return more


def _next_file(queue: MappedFileQueue) -> MappedFile | None:
    """The segment after the queue's last one, mapped read-only with nothing counted as written; None if
    the writer has not created it yet (or it is not yet of full size)."""
    last = queue.last()
    start = 0 if last is None else last.end_offset
    path = os.path.join(queue.directory, file_name(start))
    try:
        if os.path.getsize(path) != queue.file_size:
            return None
        f = MappedFile(path, queue.file_size, read_only=True)
    except (OSError, ValueError):
        return None
    f.set_positions(0)
    queue.files.append(f)
    return f


def _overtaken(queue: MappedFileQueue) -> MappedFile | None:
    """When the writer's retention deleted the file the view needs next (later files exist, that one does
    not): drop the view's files that are gone from disk and map the first file left past the view, with
    nothing counted as written (the caller checks it from its start).  None when the view is not overtaken.
    """
    last = queue.last()
    start = 0 if last is None else last.end_offset
    try:
        later = sorted(int(n) for n in os.listdir(queue.directory)
                       if len(n) == 20 and n.isdigit() and int(n) > start and int(n) % queue.file_size == 0)
    except OSError:
        return None
    if not later or os.path.exists(os.path.join(queue.directory, file_name(start))):
        return None
    for f in list(queue.files):  # gone from disk: retention removed them (their records are no more)
        if not os.path.exists(f.path):
            queue.files.remove(f)
            f.close()
    if queue.files:  # the view's own files are still there: a hole, not retention; leave the view as it is
        return None
    for first in later:
        path = os.path.join(queue.directory, file_name(first))
        try:
            if os.path.getsize(path) != queue.file_size:
                return None
            f = MappedFile(path, queue.file_size, read_only=True)
        except (OSError, ValueError):  # removed meanwhile too: try the next one
            continue
        log.warning("%s: the writer's retention removed the files after %d; the view goes on from %s",
                    queue.directory, start, path)
        f.set_positions(0)
        queue.files.append(f)
        return f
    return None


def _extend_commitlog(queue: MappedFileQueue, damage: dict[int, str], stopped: list[float]) -> bool:
    f = queue.last() or _next_file(queue) or _overtaken(queue)
    grew = False
    while f is not None:
        pos = f.wrote_position
        while pos < f.file_size:
            size, msg, reason = codec.check(f.mm, pos, f.file_size, check_crc=True, parsed=True,
                                            base=f.file_from_offset)  # a trusted record only
            if size == 0:  # blank: the rest of the segment is unused
                pos = f.file_size
                break
            if msg is None:
                where = f.file_from_offset + pos
                now = time.monotonic()
                if stopped[0] != where:  # the first look at it: the writer is most likely copying it
                    stopped[0], stopped[1] = where, now
                    break
                after = _past_damage(f, pos) if now - stopped[1] >= DAMAGE_AFTER else None
                if after is None:
                    break  # not (yet) a whole record: the writer may be copying it
                if after == pos:
                    continue  # the writer finished copying it between the two looks: check it again
                if where not in damage:
                    damage[where] = f"{f.path} at file position {pos}: {reason}"
                    log.warning("%s; the view goes on at file position %d (a read there names the damage)",
                                damage[where], after)
                pos = after
                continue
            pos += size
        if pos != f.wrote_position:
            f.set_positions(pos)
            grew = True
        if pos < f.file_size:
            break
        f = _next_file(queue) or _overtaken(queue)
    return grew


def _past_damage(f: MappedFile, pos: int) -> int | None:
    """Where the view goes on when the bytes at ``pos`` are a damaged record rather than one the writer is
    still copying: the next trusted record after them (or the blank that ends the segment), which the writer,
    appending in order, can only have written once it was done with ``pos``.  None: wait (nothing written
    there yet, or no trusted record after it: the tail the writer is copying)."""
    if f.mm[pos:pos + 8] == bytes(8):
        return None  # nothing written yet (the usual end of the view): no search through the unused rest
    return codec.find_record(f.mm, pos, f.file_size, f.file_from_offset, check_crc=True)


def _queues(store: MessageStore, topics: Iterable[str] | None) -> list[ConsumeQueue]:
    """The consume queues to extend, including queue directories created since the store was opened."""
    root = store.paths.consumequeue
    if topics is None:
        try:
            names = os.listdir(root)
        except OSError:
            return []
    else:  # a receiver's every look: its topics' directories only (a missing one is skipped below)
        names = sorted(t for t in set(topics) if t and os.sep not in t and t not in (".", ".."))
    out = []
    for topic in names:
        try:
            qids = [int(q) for q in os.listdir(os.path.join(root, topic)) if q.isdigit()]
        except OSError:
            continue
        lost = store.lost_queues
        out += [store.find_consume_queue(topic, q) for q in sorted(qids)
                if not lost or (topic, q) not in lost or _found_again(store, topic, q)]
    return out


def _found_again(store: MessageStore, topic: str, queue_id: int) -> bool:
    """Whether a queue that was lost when the view opened (registered, its directory gone: every read of it
    refused) is the writer's again: its directory is back (the caller saw it) and no unfinished rebuild names
    it (``consumequeue.rebuild``: a writable open refills a lost queue from the commitlog under that marker, and
    drops the marker once the queue is whole and flushed).  It is then dropped from the lost queues and loaded
    as a queue new to the view, each unit checked against the commitlog; until then reads keep refusing it
    (missing is not empty), never read it as an empty or partly refilled queue."""
    marker = store.paths.cq_rebuild
    try:
        with open(marker, encoding="utf-8") as fh:
            if f"{topic}/{queue_id}" in fh.read().split():
                return False
    except FileNotFoundError:
        pass
    except OSError as e:  # cannot tell: still lost
        log.warning("%s: %s; %s/%d stays a lost queue for now", marker, e, topic, queue_id)
        return False
    store.lost_queues.discard((topic, queue_id))
    log.warning("%s/%d: its consume-queue directory is back and rebuilt; read again from its files", topic, queue_id)
    return True


def _extend_consume_queue(store: MessageStore, cq: ConsumeQueue, log_end: int, log_min: int,
                          damage: dict[int, str]) -> bool:
    queue = cq.queue
    f = queue.last() or _next_file(queue) or _rebased(cq)
    grew = False
    while f is not None:
        pos = f.wrote_position
        while pos + CQ_STORE_UNIT_SIZE <= f.file_size:
            phy, size, tags = _UNIT.unpack_from(f.mm, pos)
            index = (f.file_from_offset + pos) // CQ_STORE_UNIT_SIZE
            # a unit whose record retention removed cannot be checked, and is never read: the queue's
            # minimum moves past it (extend_view)
            gone = 0 <= phy and 0 < size and phy + size <= log_min
            # a unit pointing at a damaged record the view went past is kept: its read names the damage
            if not gone and phy not in damage and not _unit_agrees(store, cq, index, phy, size, tags, log_end):
                break
            pos += CQ_STORE_UNIT_SIZE
        if pos != f.wrote_position:
            f.set_positions(pos)
            grew = True
        if pos + CQ_STORE_UNIT_SIZE <= f.file_size:
            break
        f = _next_file(queue) or _rebased(cq)
    return grew


def _rebased(cq: ConsumeQueue) -> MappedFile | None:
    """:func:`_overtaken` for a consume queue: its minimum moves to the first file left."""
    f = _overtaken(cq.queue)
    if f is not None and cq.min_logic_offset < f.file_from_offset:
        cq.min_logic_offset = f.file_from_offset
    return f


def _unit_agrees(store: MessageStore, cq: ConsumeQueue, index: int, phy: int, size: int, tags: int,
                 log_end: int) -> bool:
    """Whether the unit points at a whole record of the view that is this queue's message ``index``
    (the read path's own check, codec.decode_unit, plus the tagsCode)."""
    if size <= 0 or phy < 0 or phy + size > log_end:
        return False
    # None also when the record is not whole yet: the next call looks again
    msg = store.local_unit_record(phy, size, False, cq.topic, cq.topic.encode("utf-8"), cq.queue_id, index)
    if msg is None:
        return False
    want = codec.dispatch_tags_code(msg.topic, msg.properties, msg.store_timestamp)
    return tags == want or (tags - want) % (1 << 32) == 0
