"""Driver-side planning: which commitlog segments a scan must read, and where the live end of a store is.

A batch scan opens each store read-only (recovery runs in memory, nothing is
written) to learn its segments and readable end, then prunes segments:

* ``commitLogOffset`` ranges: by segment offset range;
* ``storeTimestamp`` ranges: by segment time range, the store time of its
  first record up to that of the next segment's first record (store times
  ascend in commitlog order: they are stamped under the put lock);
* ``topic`` / ``queueId``: by the consume queues.  A segment is skipped only
  if the consume-queue units of *all* queues cover it completely (so it holds
  no record outside a queue, such as a PREPARED or ROLLBACK transaction half)
  and none of them belongs to a wanted queue;
* ``keys``: by the index, on segments the consume queues cover completely
  (ROLLBACK halves are not indexed) and that the index covers.

Stream offsets are commitlog offsets found by walking record headers from the
previous end; see :func:`find_tail`.
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass, field, replace
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..paths import StorePaths
from ..format import codec
from ..storage.consume_queue import CQ_STORE_UNIT_SIZE
from ..errors import StoreError, StoreLoadError
from ..storage.queue_checked import units_by_queue
from ..store import MessageStore
from . import segment as _segment
from .remote import TierPart, TierRef, is_tier_uri, tier_below
from .segment import RowFilter, Segment, first_store_timestamp, store_times, walk

log = logging.getLogger(__name__)


@dataclass
class SegmentInfo:
    path: str
    base: int  # commitlog offset of the file start
    file_size: int
    end: int  # readable end, as a file position
    first_ts: int | None = None  # store time (ms) of the first record
    key: str | None = None  # the object key when the segment is read from the tier (``path`` is then its URI)


@dataclass
class ScanTask:
    """One partition: a piece of one segment file."""

    store: str
    path: str
    base: int
    start: int  # file positions
    end: int
    boundary_known: bool = True
    filter: RowFilter | None = None
    queues: list | None = None  # consume-queue slices pointing into the segment (segment.QueueSlice)
    drop_cache: bool = False  # drop the segment's pages after reading (never set for the newest, hot segment)
    tier: TierRef | None = None  # the store's tier: where ``key`` is read, or a local file gone since planning
    key: str | None = None  # object key of a tier segment (read with ranged GETs, not from ``path``)
    file_size: int = 0  # the tier segment's size


@dataclass
class PlanReport:
    store: str
    segments: int = 0
    selected: int = 0
    pruned: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"store": self.store, "segments": self.segments, "selected": self.selected, "pruned": self.pruned}


def store_roots(options: dict[str, str]) -> list[str]:
    """The store directories of ``load(path)`` or ``load([p1, p2])``."""
    import json
    paths: list[str] = []
    if options.get("paths"):
        try:
            value = json.loads(options["paths"])
        except ValueError:
            value = [options["paths"]]
        paths += [value] if isinstance(value, str) else list(value)
    if options.get("path"):
        paths.append(options["path"])
    out = []
    for p in paths:
        if is_tier_uri(p):  # a tier alone: kept as given (s3a:// is s3://)
            out.append("s3://" + p.split("://", 1)[1].rstrip("/"))
            continue
        if p.startswith("file://"):
            p = p[len("file://"):]
        elif p.startswith("file:"):
            p = p[len("file:"):]
        out.append(os.path.abspath(os.path.expanduser(p)))
    seen: set[str] = set()
    return [p for p in out if not (p in seen or seen.add(p))]


def open_read_only(root: str, tier: TierRef | None = None) -> MessageStore:
    """The store read-only, with ``tier`` (the read's tier, perhaps given as read options only) when given."""
    if not os.path.isdir(StorePaths(root).commitlog):
        raise StoreLoadError(f"{root}: not a message store (no commitlog directory)")
    return MessageStore.open(root, None if tier is None else tier.store_config(), read_only=True)


def _segment_times(segs: list[SegmentInfo]) -> None:
    for s in segs:
        s.first_ts = first_store_timestamp(s.path)


def _covered_segments(segs: list[SegmentInfo], units: dict[tuple[str, int], np.ndarray],
                      file_size: int) -> dict[int, tuple[int, int]]:
    """Segments whose records all have a consume-queue unit: base -> (first, last record offset)."""
    if not units:
        return {}
    allu = np.concatenate(list(units.values()))
    if not len(allu):
        return {}
    allu = allu[np.argsort(allu[:, 0], kind="stable")]
    seg_of = allu[:, 0] // file_size
    uniq, first_idx = np.unique(seg_of, return_index=True)
    sums = np.add.reduceat(allu[:, 1], first_idx)
    last_idx = np.append(first_idx[1:], len(allu)) - 1
    info = {s.base: s for s in segs}
    out = {}
    for k, i0, i1, total in zip(uniq.tolist(), first_idx.tolist(), last_idx.tolist(), sums.tolist()):
        base = k * file_size
        s = info.get(base)
        if s is None:
            continue
        first, last = int(allu[i0, 0]), int(allu[i1, 0])
        last_end = last + int(allu[i1, 1])
        if first != base or total != last_end - base:
            continue
        end_pos = last_end - base
        if end_pos != s.end:
            if end_pos + 8 > s.end or s.end != s.file_size:
                continue
            with open(s.path, "rb") as fh:
                fh.seek(end_pos)
                head = fh.read(8)
            if len(head) < 8 or struct.unpack(">iI", head)[1] != codec.BLANK_MAGIC:
                continue
        out[base] = (first, last)
    return out


def _index_hits(store: MessageStore, topics: list[str], keys: frozenset[str]) -> tuple[set[int] | None, tuple[int, int]]:
    """Commitlog offsets the index gives for the first token of each KEYS value, and the range it covers."""
    files = list(store.index_service.files)
    if not files:
        return None, (0, -1)
    hits: set[int] = set()
    for value in keys:
        tokens = [t for t in value.split(" ") if t]
        if not tokens:
            return None, (0, -1)
        for topic in topics:
            out: list[int] = []
            for f in files:
                f.select(out, f"{topic}#{tokens[0]}", 1 << 62, 0, 2 ** 63 - 1)
            hits.update(out)
    lo = files[0].begin_phy_offset
    if lo < store.min_phy_offset() + store.commitlog.file_size:
        lo = store.min_phy_offset()
    return hits, (lo, files[-1].end_phy_offset)


def list_segments(root: str, files: list[tuple[int, str]] | None = None) -> list[SegmentInfo]:
    """The segments holding records and their readable ends, without opening the store.

    Every segment but the newest ends at its blank record; the newest ends
    after its last complete record (:func:`find_tail`), so a store being
    written, or one whose tail was torn by a crash, reads up to its last whole
    record, as recovery would leave it.
    """
    files = _segment_files(root) if files is None else files
    if not files:
        return []
    size = _file_size(files)
    tail = find_tail(root)
    out = []
    for base, path in files:
        if base >= tail:
            break
        out.append(SegmentInfo(path, base, size, min(size, tail - base)))
    return out


def tier_segments(part: TierPart | None) -> list[SegmentInfo]:
    """The tier's segments as SegmentInfo: whole sealed files, each ending at its blank record."""
    if part is None:
        return []
    from ..tier.reader import segment_key
    return [SegmentInfo(part.ref.where(segment_key(s.name)), s.base, s.size, s.size, s.first_store_time or None,
                        key=segment_key(s.name)) for s in part.segments]


def store_tier(root: str, tier: TierRef | None, files: list[tuple[int, str]] | None = None) -> TierPart | None:
    """The part of ``root``'s commitlog that is read from its tier: below the first of the local segment
    ``files`` (listed now unless given; callers that also read the local files pass their one listing, so
    that a file retention deletes in between is in one part or the other, never in neither)."""
    if tier is None:
        return None
    if is_tier_uri(root):
        return tier_below(root, tier, None, None)
    if files is None:
        files = _segment_files(root)
    if not files:
        return tier_below(root, tier, None, None)
    return tier_below(root, tier, files[0][0], _file_size(files))


def plan_scan(root: str, flt: RowFilter, *, report: PlanReport | None = None,
              drop_cache: bool = False, tier: TierRef | None = None) -> list[ScanTask]:
    """The partitions of a batch scan of one store: one per segment that may hold a matching record.

    ``drop_cache``: executors drop each segment's pages once read, except the
    newest segment's (the hot set of a live store's consumers).
    ``tier``: the store's tier (or, for an ``s3://`` root, the tier read alone);
    its segments below the first local one come first, read with ranged GETs.
    Topic, queue and key pruning apply to local segments only."""
    report = report or PlanReport(root)
    if is_tier_uri(root):
        if tier is None:
            raise StoreLoadError(f"{root}: a tier URI needs its options (objectStoreEndpoint ...)")
        local: list[SegmentInfo] = []
    else:
        if not os.path.isdir(StorePaths(root).commitlog):
            if not os.path.exists(root):
                raise StoreLoadError(f"{root}: no such store directory")
            raise StoreLoadError(f"{root}: not a message store (no commitlog directory)")
        files = _segment_files(root)
        local = list_segments(root, files)
    part = store_tier(root, tier, None if is_tier_uri(root) else files)
    remote = tier_segments(part)
    segs = remote + local
    report.segments = len(segs)
    if flt.empty():
        report.pruned["emptyFilter"] = len(segs)
        return []
    keep = segs

    def drop(reason: str, kept: list[SegmentInfo]) -> list[SegmentInfo]:
        if len(kept) < len(keep):
            report.pruned[reason] = report.pruned.get(reason, 0) + len(keep) - len(kept)
        return kept

    if flt.offset_lo is not None or flt.offset_hi is not None:
        lo = -1 if flt.offset_lo is None else flt.offset_lo
        hi = 2 ** 63 if flt.offset_hi is None else flt.offset_hi
        keep = drop("commitLogOffset", [s for s in keep if s.base + s.end > lo and s.base <= hi])
    if (flt.ts_lo is not None or flt.ts_hi is not None) and keep:
        _segment_times(local)
        kept = []
        for i, s in enumerate(segs):
            if s not in keep:
                continue
            nxt = segs[i + 1].first_ts if i + 1 < len(segs) else None
            if s.first_ts is not None and flt.ts_hi is not None and s.first_ts * 1000 > flt.ts_hi:
                continue
            if nxt is not None and flt.ts_lo is not None and nxt * 1000 < flt.ts_lo:
                continue
            kept.append(s)
        keep = drop("storeTimestamp", kept)
    if (flt.topics is not None or flt.queue_ids is not None or flt.keys is not None) and keep and local:
        with open_read_only(root, tier) as store:
            file_size = store.commitlog.file_size
            units = units_by_queue(store)
            covered = _covered_segments(local, units, file_size)  # tier segments are never covered: kept
            if flt.topics is not None or flt.queue_ids is not None:
                hit: set[int] = set()
                for (t, q), u in units.items():
                    if (flt.topics is None or t in flt.topics) and (flt.queue_ids is None or q in flt.queue_ids):
                        hit.update((np.unique(u[:, 0] // file_size) * file_size).tolist())
                keep = drop("consumeQueue", [s for s in keep if s.base in hit or s.base not in covered])
            if flt.keys is not None and keep:
                topics = sorted(flt.topics) if flt.topics is not None else sorted({t for t, _ in units})
                hits, (ilo, ihi) = _index_hits(store, topics, flt.keys)
                if hits is not None:
                    hit_segs = {h // file_size * file_size for h in hits}
                    kept = []
                    for s in keep:
                        c = covered.get(s.base)
                        if s.base in hit_segs or c is None or not (ilo <= c[0] and c[1] <= ihi):
                            kept.append(s)
                    keep = drop("index", kept)
    slices = queue_slices(root, [s for s in keep if s.key is None]) if local else {}
    tasks = []
    for s in keep:
        start, known = 0, True
        if flt.offset_lo is not None and s.base < flt.offset_lo < s.base + s.end:
            start, known = _boundary(s, flt.offset_lo, part)
        tasks.append(ScanTask(root, s.path, s.base, start, s.end, known, None if flt.trivial() else flt,
                              slices.get(s.base), drop_cache=drop_cache and s is not segs[-1] and s.key is None,
                              tier=tier, key=s.key, file_size=s.file_size))
    report.selected = len(tasks)
    log.info("scan of %s: %d of %d segments (%d from the tier) (%s)", root, len(tasks), len(segs), len(remote),
             report.pruned or "no pruning")
    return tasks


PRE_BLANK = 0x7FFFFFFF  # the size field of the padding units before a queue's first real unit
_UNIT_HEAD = struct.Struct(">qi")


class _QueueFiles:
    """One consume queue's files, mapped read-only, for binary searches by commitlog offset.

    Units ascend by commitlog offset within a queue, so the units pointing into
    a segment are one slice, found with two binary searches (a few pages read,
    however long the queue).  A damaged queue only gives slices that do not
    check out on the executor, which then walks the records instead.
    """

    def __init__(self, directory: str, names: list[str], file_size: int) -> None:
        import mmap as _mmap
        self.directory = directory
        self.file_size = file_size
        self.per_file = file_size // CQ_STORE_UNIT_SIZE
        self.first_unit = int(names[0]) // CQ_STORE_UNIT_SIZE
        self.maps = []
        for n in names:
            with open(os.path.join(directory, n), "rb") as fh:
                self.maps.append(_mmap.mmap(fh.fileno(), 0, access=_mmap.ACCESS_READ))
        end = self.first_unit + self.per_file * (len(names) - 1)
        # The written end of the last file: units are non-zero up to it, zero after.
        self.end = end + self._search(0, self.per_file, lambda i: self._unit_at(len(self.maps) - 1, i)[1] == 0)
        # A queue that started past 0 begins with padding units.
        self.start = self._search(self.first_unit, self.end, lambda i: self.unit(i)[1] != PRE_BLANK)

    @staticmethod
    def _search(lo: int, hi: int, pred) -> int:
        """The first i in [lo, hi) with pred(i) true (pred is monotone), or hi."""
        while lo < hi:
            mid = (lo + hi) // 2
            if pred(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _unit_at(self, file_index: int, i: int) -> tuple[int, int]:
        mm = self.maps[file_index]
        if (i + 1) * CQ_STORE_UNIT_SIZE > len(mm):
            return 0, 0
        return _UNIT_HEAD.unpack_from(mm, i * CQ_STORE_UNIT_SIZE)

    def unit(self, i: int) -> tuple[int, int]:
        k = i - self.first_unit
        return self._unit_at(k // self.per_file, k % self.per_file)

    def lower_bound(self, offset: int) -> int:
        return self._search(self.start, self.end, lambda i: self.unit(i)[0] >= offset)

    def close(self) -> None:
        for mm in self.maps:
            mm.close()


def _queue_dirs(cq_root: str) -> Iterator[tuple[str, str, str]]:
    """(topic, queue id, directory) of every queue directory under ``cq_root``, in name order."""
    for topic in sorted(os.listdir(cq_root)):
        tdir = os.path.join(cq_root, topic)
        if not os.path.isdir(tdir):
            continue
        for qid in sorted(os.listdir(tdir)):
            qdir = os.path.join(tdir, qid)
            if qid.isdigit() and os.path.isdir(qdir):
                yield topic, qid, qdir


def queue_slices(root: str, segs: list[SegmentInfo]) -> dict[int, list[tuple[str, int, int, int]]]:
    """For each segment, the consume-queue units that point into it: (queue dir, file size, first, end unit).

    The executors read these slices instead of walking the record headers and
    check them against the records (:func:`segment.queue_layout`).
    """
    cq_root = StorePaths(root).consumequeue
    if not segs or not os.path.isdir(cq_root):
        return {}
    out: dict[int, list[tuple[str, int, int, int]]] = {}
    for _topic, _qid, qdir in _queue_dirs(cq_root):
        try:
            names = sorted(n for n in os.listdir(qdir) if len(n) == 20 and n.isdigit())
            if not names:
                continue
            size = os.path.getsize(os.path.join(qdir, names[0]))
            if size < CQ_STORE_UNIT_SIZE or size % CQ_STORE_UNIT_SIZE or any(
                    int(n) != int(names[0]) + k * size or os.path.getsize(os.path.join(qdir, n)) != size
                    for k, n in enumerate(names)):
                continue  # gaps or odd sizes: no hint from this queue (the executors will walk)
            q = _QueueFiles(qdir, names, size)
        except (OSError, ValueError):
            continue
        try:
            prev = q.lower_bound(segs[0].base)
            for s in segs:
                nxt = q.lower_bound(s.base + s.end)
                if nxt > prev:
                    out.setdefault(s.base, []).append((qdir, size, prev, nxt))
                prev = nxt
        finally:
            q.close()
    return out


def split_task(task: ScanTask, pieces: int) -> list[ScanTask]:
    """``task`` cut into up to ``pieces`` tasks of about equal bytes, at record starts, so that the cores of a
    small store's scan share its segment (Spark splits a large file the same way).

    A cut is the first consume-queue unit at or after an even share of the
    bytes (its record checked: the magic and a PHYSICALOFFSET equal to its own
    offset); each piece gets the slices of the units between its cuts, so that
    its executor still finds its records without a walk.  Without queue slices,
    or without a checked record start near a share, the task stays whole.
    """
    if pieces < 2 or not task.queues:
        return [task]
    step = (task.end - task.start) / pieces
    cuts: list[int] = []
    for k in range(1, pieces):
        at = _first_unit_at(task.queues, task.base + task.start + round(k * step))
        if at is None or not (task.start < at - task.base < task.end) or (cuts and at <= cuts[-1]):
            continue
        if _record_starts_at(task.path, task.base, at):
            cuts.append(at)
    if not cuts:
        return [task]
    bounds = [task.base + task.start, *cuts, task.base + task.end]
    # For each queue slice, the unit index of every cut (the piece ends take the slice's own ends).
    idx = [[lo, *(_lower_bound(q, c) for c in cuts), hi] for q in task.queues for lo, hi in [q[2:4]]]
    out = []
    for k in range(len(bounds) - 1):
        qs = [(q[0], q[1], i[k], i[k + 1]) for q, i in zip(task.queues, idx) if i[k + 1] > i[k]]
        out.append(replace(task, start=bounds[k] - task.base, end=bounds[k + 1] - task.base,
                           boundary_known=task.boundary_known if k == 0 else True, queues=qs or None))
    return out


def _unit_offset(q: tuple[str, int, int, int], i: int) -> int:
    """Commitlog offset of unit ``i`` of the consume-queue slice ``q`` (one 20-byte read)."""
    u = _segment.read_units(q[0], q[1], i, i + 1)
    if not len(u):
        raise OSError(f"{q[0]}: unit {i} is not there")
    return int(u[0, 0])


def _lower_bound(q: tuple[str, int, int, int], offset: int) -> int:
    """The first unit of slice ``q`` whose commitlog offset is at least ``offset`` (units ascend in a queue)."""
    lo, hi = q[2], q[3]
    while lo < hi:
        mid = (lo + hi) // 2
        if _unit_offset(q, mid) >= offset:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _first_unit_at(queues: list, offset: int) -> int | None:
    """The smallest commitlog offset at or after ``offset`` that some queue slice points at, or None."""
    best = None
    try:
        for q in queues:
            i = _lower_bound(q, offset)
            if i < q[3]:
                at = _unit_offset(q, i)
                best = at if best is None else min(best, at)
    except OSError:
        return None
    return best


def _record_starts_at(path: str, base: int, offset: int) -> bool:
    """Whether a record header sits at ``offset``: a known magic and PHYSICALOFFSET equal to ``offset``."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        head = os.pread(fd, 36, offset - base)
    finally:
        os.close(fd)
    if len(head) < 36:
        return False
    _total, magic = struct.unpack_from(">iI", head, 0)
    return magic in (codec.MAGIC_V1, codec.MAGIC_V2) and struct.unpack_from(">q", head, 28)[0] == offset


def _boundary(s: SegmentInfo, offset: int, part: TierPart | None = None) -> tuple[int, bool]:
    """Start a walk at ``offset`` if a record starts there (its PHYSICALOFFSET says so), else at the file start."""
    if s.key is not None:
        assert part is not None
        from .remote import record_starts_at
        return (offset - s.base, True) if record_starts_at(part.ref, part.manifest, offset) else (0, False)
    with Segment(s.path) as seg:
        _size, msg, _ = codec.check(seg.mm, offset - s.base, s.end, check_crc=False)
        if msg is not None and msg.commit_log_offset == offset:
            return offset - s.base, True
    return 0, False


# ---------------------------------------------------------------- live ends (streaming)

def _segment_files(root: str) -> list[tuple[int, str]]:
    d = StorePaths(root).commitlog
    try:
        names = sorted(n for n in os.listdir(d) if len(n) == 20 and n.isdigit())
    except FileNotFoundError:
        raise StoreLoadError(f"{root}: not a message store (no commitlog directory)") from None
    return [(int(n), os.path.join(d, n)) for n in names]


def earliest_offset(root: str, tier: TierRef | None = None) -> int:
    """The first offset a stream can read: the tier's start when it holds segments below the local ones."""
    part = store_tier(root, tier)
    if part is not None:
        return part.start
    if is_tier_uri(root):
        return _tier_alone(root, tier).end
    files = _segment_files(root)
    return files[0][0] if files else 0


def in_local_segments(root: str, offset: int) -> bool:
    """Whether ``offset`` is at or past the first local segment (so a stream there needs no tier)."""
    if is_tier_uri(root):
        return False
    files = _segment_files(root)
    return bool(files) and offset >= files[0][0]


def _tier_alone(root: str, tier: TierRef | None) -> TierPart:
    """A tier read on its own (``load("s3://...")``), possibly holding no segment yet."""
    from .remote import manifest
    if tier is None:
        raise StoreLoadError(f"{root}: a tier URI needs its options (objectStoreEndpoint ...)")
    return TierPart(tier, manifest(tier), [])


def _tier_tail(part: TierPart, start: int, max_bytes: int | None) -> int:
    """How far a stream goes in the tier from ``start`` (a record boundary): whole segments, at least the rest
    of ``start``'s, within ``max_bytes`` (the tier is sealed: every segment end is a record boundary)."""
    pos = start
    size = part.file_size
    for s in part.segments:
        seg_end = s.base + size
        if seg_end <= pos:
            continue
        if max_bytes is not None and pos > start and seg_end - start > max_bytes:
            break
        pos = seg_end
    return pos


def _file_size(files: list[tuple[int, str]]) -> int:
    return os.path.getsize(files[0][1])


def find_tail(root: str, start: int | None = None, max_bytes: int | None = None,
              tier: TierRef | None = None) -> int:
    """The offset just past the last complete record, from ``start`` (see :func:`_local_tail`), across the
    tier's segments (``tier``) first when ``start`` lies in them.

    In the tier, ``max_bytes`` counts whole segments (at least the rest of
    ``start``'s): segment ends are record boundaries, and finding a record
    boundary inside one would mean fetching it on the driver.
    """
    if is_tier_uri(root):
        part = store_tier(root, tier) or _tier_alone(root, tier)
        return part.end if start is None else max(start, _tier_tail(part, start, max_bytes))
    if start is None or tier is None or in_local_segments(root, start):
        return _local_tail(root, start, max_bytes)  # the tier is not asked (nor needed to be up)
    part = store_tier(root, tier)
    if part is None or start >= part.end:
        return _local_tail(root, start, max_bytes)
    pos = _tier_tail(part, start, max_bytes)
    if pos < part.end:
        return pos
    if max_bytes is None:
        return _local_tail(root)
    left = max_bytes - (pos - start)
    return pos if left <= 0 else _local_tail(root, pos, left)


def _local_tail(root: str, start: int | None = None, max_bytes: int | None = None) -> int:
    """The commitlog offset just past the last complete record, walking record headers from ``start``.

    ``start`` must be a record boundary (a previous tail); None starts at the
    newest segment that holds a record, skipping the part of it that the
    consume queues prove a walk would pass (:func:`_queue_verified_prefix`).
    ``max_bytes`` bounds how far one call goes (at least one record).  A
    single writer finishes a record before it starts the next, so only the
    last record found can be incomplete: it is CRC-checked and left for the
    next call if it does not check out yet.
    """
    files = _segment_files(root)
    if not files:
        return 0 if start is None else start
    size = _file_size(files)
    known_last = None  # file position of the record just before ``pos``, when a queue check skipped the walk to it
    if start is None:
        start = files[0][0]
        for base, path in reversed(files):
            if first_store_timestamp(path) is not None:
                start = base
                break
        if max_bytes is None:
            prefix = _queue_verified_prefix(root, start, dict(files)[start], size)
            if prefix is not None:
                known_last, skip_to = prefix
                start += skip_to
    by_base = dict(files)
    budget = max_bytes
    pos = start
    while True:
        base = pos - pos % size
        path = by_base.get(base)
        if path is None:
            return pos
        with Segment(path) as seg:
            w = walk(seg.mm, pos - base, seg.size, zeros_end=True, max_bytes=budget, path=path)
            if w.problem:
                log.debug("tail of %s: %s", root, w.problem)
            end = w.end
            last = int(w.positions[-1]) if len(w.positions) else known_last
            if last is not None and not w.blank:
                _size, msg, reason = codec.check(seg.mm, last, end, check_crc=True)
                if msg is None:
                    log.debug("tail of %s: record at %d not complete yet (%s)", root, base + last, reason)
                    end = last
        known_last = None
        if not w.blank:
            return base + end
        if budget is not None:
            budget -= end - (pos - base)
            if budget <= 0:
                return base + size
        pos = base + size


def _queue_verified_prefix(root: str, base: int, path: str, size: int) -> tuple[int, int] | None:
    """(position of the last record, position after it) of the longest run of consume-queue units that
    tiles segment ``base`` from its start, when the record at its last unit matches that unit; else None.

    A unit is written only after its record, and a single writer appends in
    order, so the end of the last dispatched record is where the records not
    yet dispatched begin: :func:`find_tail` walks from there.  The records
    before it are not read here: every task that reads them checks them against
    their units or walks their headers (:func:`rocketstore.spark.segment.read_range`),
    and fails naming file and offset at one that is not a record.
    """
    slices = queue_slices(root, [SegmentInfo(path, base, size, size)]).get(base)
    units = _segment.queue_units(slices) if slices else None
    if units is None or units[0][0] != base:
        return None
    off, size = units
    ends = off + size
    breaks = np.flatnonzero(off[1:] != ends[:-1])
    n = int(breaks[0]) + 1 if len(breaks) else len(off)
    with Segment(path) as seg:
        pos = _segment.unit_positions(seg, off[:n], size[:n], 0)
        if pos is None or not _segment.records_match_units(seg, pos[-1:], size[n - 1:n]):
            return None
    return int(pos[-1]), int(ends[n - 1] - base)


def offset_for_timestamp(root: str, ts_ms: int, tier: TierRef | None = None) -> int:
    """Commitlog offset of the first record stored at or after ``ts_ms`` (the tail when there is none).

    The tier is searched when the first local record is that new or newer (store times ascend in
    commitlog order), from its last segment whose first record is older: headers read with ranged GETs.
    """
    part = store_tier(root, tier)
    if part is not None:
        files = [] if is_tier_uri(root) else _segment_files(root)
        t0 = first_store_timestamp(files[0][1]) if files else None
        if t0 is None or t0 >= ts_ms:
            from .remote import first_at_or_after
            hit = first_at_or_after(part.ref, part.manifest, part.segments, ts_ms)
            if hit is not None:
                return hit
    if is_tier_uri(root):
        return find_tail(root, tier=tier)
    files = _segment_files(root)
    start_i = 0
    for i, (_base, path) in enumerate(files):
        t = first_store_timestamp(path)
        if t is not None and t < ts_ms:
            start_i = i
    for base, path in files[start_i:]:
        with Segment(path) as seg:
            w = walk(seg.mm, 0, seg.size, zeros_end=True, path=path)
            times = store_times(seg, w.positions)
            hit = np.flatnonzero(times >= ts_ms)
            if len(hit):
                return base + int(w.positions[hit[0]])
            if not w.blank:
                break
    return find_tail(root)


def check_boundary(root: str, offset: int, tier: TierRef | None = None) -> int:
    """``offset`` if a record (or a segment, or the tail) starts there; a stream can only start at one."""
    part = store_tier(root, tier)
    if is_tier_uri(root) and part is None:
        part = _tier_alone(root, tier)
    if part is not None and (part.start <= offset < part.end or is_tier_uri(root)):
        from .remote import record_starts_at
        if offset == part.end or offset in {s.base for s in part.segments} or \
                (part.start <= offset < part.end and record_starts_at(part.ref, part.manifest, offset)):
            return offset
        raise StoreError(f"{root}: no record starts at commitlog offset {offset} in the tier {part.ref.uri}; a "
                         "stream must start at a record (use an offset a batch read returned as commitLogOffset, "
                         "earliest, latest or startingTimestamp)")
    files = _segment_files(root)
    if not files or any(offset == b for b, _ in files):
        return offset
    size = _file_size(files)
    path = dict(files).get(offset - offset % size)
    if path is not None:
        with Segment(path) as seg:
            pos = offset - seg.base
            _size, msg, _ = codec.check(seg.mm, pos, seg.size, check_crc=False)
            if msg is not None and msg.commit_log_offset == offset:
                return offset
    if offset == find_tail(root):
        return offset
    raise StoreError(f"{root}: no record starts at commitlog offset {offset}; a stream must start at a record "
                     "(use an offset a batch read returned as commitLogOffset, earliest, latest or "
                     "startingTimestamp)")


def stream_tasks(root: str, start: int, end: int, flt: RowFilter | None, tier: TierRef | None = None
                 ) -> list[ScanTask]:
    """Partitions for the commitlog range [start, end): one per segment piece; both ends are record boundaries.

    Pieces below the first local segment come from the tier; each offset is read from exactly one place,
    whichever holds it now (a segment both local and uploaded is read locally)."""
    if end <= start:
        return []
    files = [] if is_tier_uri(root) else _segment_files(root)
    part = None if files and start >= files[0][0] else store_tier(root, tier, files)
    tasks = []
    for s in tier_segments(part):
        lo, hi = max(start, s.base), min(end, s.base + s.file_size)
        if lo < hi:
            tasks.append(ScanTask(root, s.path, s.base, lo - s.base, hi - s.base, True, flt, tier=tier, key=s.key,
                                  file_size=s.file_size))
    for base, path in files:
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            if tier is None:
                raise
            from .remote import manifest  # deleted by retention since the listing: uploaded, read from the tier
            size = manifest(tier).geometry["mappedFileSizeCommitLog"]
        lo, hi = max(start, base), min(end, base + size)
        if lo < hi:
            tasks.append(ScanTask(root, path, base, lo - base, hi - base, True, flt, tier=tier, file_size=size))
    return tasks


# ---------------------------------------------------------------- consume queues as partitions (queue offsets)

@dataclass(frozen=True)
class QueueRange:
    """One consume queue's readable units: queue offsets [earliest, end) (Kafka's partition bounds)."""

    topic: str
    queue_id: int
    directory: str
    file_size: int  # the consume queue's file size
    earliest: int
    end: int


def queue_ranges(root: str) -> dict[tuple[str, int], QueueRange]:
    """Every consume queue of ``root`` with its readable queue offsets.

    ``earliest`` is the first unit pointing at or past the first local commitlog segment (units below it point
    at deleted records); ``end`` stops before any unit pointing at or past the commitlog's readable end (a unit
    dispatched for a record a crash tore, which recovery would drop)."""
    cq_root = StorePaths(root).consumequeue
    files = _segment_files(root)
    if not files or not os.path.isdir(cq_root):
        return {}
    first, tail = files[0][0], find_tail(root)
    out: dict[tuple[str, int], QueueRange] = {}
    for topic, qid, qdir in _queue_dirs(cq_root):
        names = sorted(n for n in os.listdir(qdir) if len(n) == 20 and n.isdigit())
        if not names:
            continue
        try:
            size = os.path.getsize(os.path.join(qdir, names[0]))
            if size < CQ_STORE_UNIT_SIZE or size % CQ_STORE_UNIT_SIZE:
                raise StoreError(f"{qdir}: consume queue file size {size} is not a multiple of "
                                 f"{CQ_STORE_UNIT_SIZE}")
            if any(int(n) != int(names[0]) + k * size for k, n in enumerate(names)):
                raise StoreError(f"{qdir}: consume queue files are not contiguous ({', '.join(names)})")
            q = _QueueFiles(qdir, names, size)
        except OSError as e:
            raise StoreError(f"{qdir}: cannot read the consume queue ({e})") from None
        try:
            lo, hi = q.lower_bound(first), q.lower_bound(tail)
        finally:
            q.close()
        out[(topic, int(qid))] = QueueRange(topic, int(qid), qdir, size, lo, max(lo, hi))
    return out


def queue_offsets_by_time(root: str, wanted: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
    """For each (topic, queue) -> store time (ms): the queue offset of its first message stored at or after that
    time (RocketMQ's getOffsetInQueueByTime, lower boundary), clamped to the queue's bounds."""
    from ..storage.consume_queue import LOWER
    if not wanted:
        return {}
    with open_read_only(root) as store:
        return {k: store.offset_by_time(k[0], k[1], ts, LOWER) for k, ts in wanted.items()}
