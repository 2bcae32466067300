"""The queue side of ``verify --repair`` and of refills: every trusted record placed at its own queue offset
(a lost one leaves a gap, never a shift), from the local commitlog and the tier."""

from __future__ import annotations

import logging
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..format import codec
from ..config import StoreConfig
from ..storage.consume_queue import CQ_STORE_UNIT_SIZE
from ..errors import StoreError
from ..format.message import illegal_topic
from ..paths import StorePaths
from .verify import resync


from ..storage.jsonfile import fsync_dir

log = logging.getLogger(__name__)


_UNIT = struct.Struct(">qiq")


MIN_RECORD_SIZE = codec.record_length(0, 1, 0, 0, False)  # no record is shorter: bounds how many fit in a span


@dataclass
class _Placed:
    phy: int
    size: int
    queue_offset: int
    tags_code: int


def trusted_records(cdir: str, file_size: int) -> Iterator[codec.MessageExt]:
    """Every trusted record (magic, size, PHYSICALOFFSET equal to its position, body CRC) in commitlog order.

    A record that fails is skipped to the next trusted one (verify's resync) in
    every segment but the last, where recovery ends the log at it.
    """
    names = sorted(n for n in os.listdir(cdir) if len(n) == 20 and n.isdigit())
    for i, name in enumerate(names):
        path = os.path.join(cdir, name)
        size = os.path.getsize(path)
        if size == 0:
            continue
        base, last = int(name), i == len(names) - 1
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            pos = 0
            while pos < size:
                stopped = None
                for p, n, msg, _reason in codec.walk(mm, pos, size, check_crc=True, base=base):
                    if n == 0:
                        stopped = size  # a blank record ends the file
                        break
                    if msg is None:
                        stopped = p
                        break
                    yield msg
                    pos = p + n
                else:
                    break  # zeros: the written end
                if stopped >= size or last:
                    break
                nxt = resync(mm, stopped, size, base)
                if nxt is None:
                    break
                pos = nxt[0]


def _local_commitlog_min(cdir: str) -> int:
    """The commitlog offset of the first local segment holding data (0 for none): records below it, once
    retention deleted their segments, are held only by the tier."""
    names = sorted(n for n in os.listdir(cdir) if len(n) == 20 and n.isdigit()) if os.path.isdir(cdir) else []
    return next((int(n) for n in names if os.path.getsize(os.path.join(cdir, n)) > 0), 0)


def _tier_reader(root: str, cfg: StoreConfig, below: int) -> Any:
    """The reader of the tier's published manifest; None when no tier was ever published.  A tier that was
    published but cannot be read raises StoreError: repair is refused rather than work from half the log."""
    from ..tier.tiered import TieredStorage
    try:
        tier = TieredStorage(root, cfg, read_only=True)
        tier.refresh(quiet=True)
    except StoreError as e:
        raise StoreError(f"tier {cfg.tieredStoreUri}: {e}; it holds the records below commitlog offset {below} "
                         "(the local commitlog's start): repair refused, nothing was changed") from None
    reader = tier.reader
    why = tier.fault or (tier.error if reader is None else None)
    if reader is None and why is None and tier.deleted_end <= 0:
        return None  # no tier published
    if reader is None or why is not None:
        raise StoreError(f"tier {tier.loc.uri}: cannot be read ({why or 'no manifest'}); it holds the records "
                         f"below commitlog offset {below}: repair refused, nothing was changed")
    return reader


def tier_end(root: str, cfg: StoreConfig) -> int:
    """The commitlog offset where the segments the tier holds end (0: no tier, or none published)."""
    if not cfg.tieredStoreUri:
        return 0
    reader = _tier_reader(root, cfg, _local_commitlog_min(StorePaths(root).commitlog))
    return 0 if reader is None else reader.manifest.end_offset


def tier_copies(root: str, cfg: StoreConfig, spans: list[Any]) -> int:
    """Give each damaged span of a segment the tier holds the tier's bytes for it (``span.restored``), when
    those bytes are trusted records (magic, size, PHYSICALOFFSET, body CRC) covering the span exactly, up to a
    blank end-of-file record at most.  The commitlog is the local segments plus the tier's: a record damaged
    locally but intact in the tier's copy is not lost, and a tombstone in its place would hide it from key
    queries once retention reads the segment from the tier.  Returns how many spans got a copy."""
    if not cfg.tieredStoreUri or not spans:
        return 0
    reader = _tier_reader(root, cfg, _local_commitlog_min(StorePaths(root).commitlog))
    if reader is None:
        return 0
    from ..tier.reader import segment_key
    n = 0
    for s in spans:
        seg = reader.manifest.segment_for(s.offset)
        if seg is None or s.offset + s.length > seg.base + seg.size:
            continue
        try:
            data = reader.read(segment_key(seg.name), s.offset - seg.base, s.length)
        except StoreError as e:
            log.warning("%s: the tier's copy of %d bytes at commitlog offset %d cannot be read: %s", s.file,
                        s.length, s.offset, e)
            continue
        if len(data) == s.length and _trusted_cover(data, s.offset, seg.base + seg.size):
            s.restored = data
            n += 1
    return n


def _trusted_cover(data: bytes, base: int, file_end: int) -> bool:
    """Whether ``data`` (the bytes at commitlog offset ``base``) is whole trusted records end to end, or up to
    a blank end-of-file record; such a record only where ``data`` reaches ``file_end``, its segment's end (in
    the middle of a segment it would end every walk there, hiding the records after it)."""
    pos = 0
    while pos < len(data):
        size, msg, _reason = codec.check(data, pos, len(data), check_crc=True, parsed=True, base=base)
        if size == 0:
            return base + len(data) == file_end
        if size < 0 or msg is None:
            return False
        pos += size
    return pos == len(data)


def tier_records(root: str, cfg: StoreConfig) -> Iterator[codec.MessageExt]:
    """The trusted records the tier holds below the local commitlog, in commitlog order.

    The commitlog is local segments plus the tier's: a rebuild from the local segments alone would leave
    blank units where acknowledged tier-held messages are.  A tier that holds such records but cannot be
    read (unreachable, manifest faulty, a record failing its checks) raises StoreError naming it: the
    caller refuses the repair rather than drop their units.
    """
    below = _local_commitlog_min(StorePaths(root).commitlog)
    if not cfg.tieredStoreUri or below <= 0:
        return  # (a store that copied segments to a tier is refused without it before a repair begins)
    reader = _tier_reader(root, cfg, below)
    if reader is None:
        return  # no tier published: nothing below the local start to read
    try:
        for off, _size, msg, problem in reader.scan(reader.manifest.min_offset, below, check_crc=True):
            if msg is None:
                raise StoreError(f"tier {reader.objects.loc.uri}: record at commitlog offset {off}: {problem}; repair "
                                 "refused, nothing was changed")
            yield msg
    except StoreError as e:
        if "repair refused" in str(e):
            raise
        raise StoreError(f"tier {reader.objects.loc.uri}: {e}; it holds the records below commitlog offset {below}: "
                         "repair refused, nothing was changed") from None


def _kept_by(old_unit: Callable[[str, int, int], int | None], topic: str, qid: int) -> Callable[[_Placed], bool]:
    """``prefer`` for _longest_ordered: of two records claiming one queue offset, the one the old unit named."""
    return lambda r: old_unit(topic, qid, r.queue_offset) == r.phy


def _longest_ordered(recs: list[_Placed], prefer: Any = None) -> list[_Placed]:
    """The longest run of records (in commitlog order) whose queue offsets strictly grow: dispatch writes a
    queue in commitlog order, so a record out of that order cannot be placed without moving its neighbours.
    Of two records claiming one queue offset the first is kept (as dispatch skips the later one) unless
    ``prefer(record)`` says the later one is what the old consume queue pointed at."""
    tails: list[int] = []  # tails[k]: index of the record ending the best ordered run of length k+1
    prev = [-1] * len(recs)
    for i, r in enumerate(recs):
        lo, hi = 0, len(tails)
        while lo < hi:
            mid = (lo + hi) // 2
            if recs[tails[mid]].queue_offset < r.queue_offset:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(tails) and recs[tails[lo]].queue_offset == r.queue_offset and not (prefer and prefer(r)):
            continue
        prev[i] = tails[lo - 1] if lo else -1
        if lo == len(tails):
            tails.append(i)
        else:
            tails[lo] = i
    out: list[_Placed] = []
    i = tails[-1] if tails else -1
    while i >= 0:
        out.append(recs[i])
        i = prev[i]
    return out[::-1]


def old_unit_reader(cq_root: str, file_size: int) -> Any:
    """(topic, queue id, queue offset) -> the commitlog offset the old consume queue's unit there points at."""
    def phy_at(topic: str, qid: int, qoff: int) -> int | None:
        at = qoff * CQ_STORE_UNIT_SIZE
        path = os.path.join(cq_root, topic, str(qid), f"{at - at % file_size:020d}")
        try:
            with open(path, "rb") as fh:
                fh.seek(at % file_size)
                raw = fh.read(CQ_STORE_UNIT_SIZE)
        except OSError:
            return None
        return _UNIT.unpack(raw)[0] if len(raw) == CQ_STORE_UNIT_SIZE else None
    return phy_at


def place_queues(records: Iterator[codec.MessageExt], on_record: Any = None, old_unit: Any = None) -> tuple[
        dict[tuple[str, int], list[_Placed]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Each trusted record's unit at its own queue offset: (queue -> placed records, gaps, records not placed).

    A record is left out (reported, never moved to another offset) when it is
    out of commitlog order with its queue's others (two records claiming one
    offset, or an offset field a bit flip changed), or when its queue offset
    lies further past the one before it than the bytes between them could hold
    records (a flipped high bit: placing it would write a queue of blank units
    up to there).  A queue offset no placed record holds is a gap: a blank unit.
    ``old_unit(topic, queue id, queue offset)``: where the old consume queue
    pointed, to choose between two records claiming one offset.
    """
    queues: dict[tuple[str, int], list[_Placed]] = {}
    legal: dict[str, bool] = {}
    for msg in records:
        if on_record is not None:
            on_record(msg)
        if msg.sys_flag & codec.TRANSACTION_MASK not in (codec.TRANSACTION_NOT_TYPE, codec.TRANSACTION_COMMIT):
            continue
        ok = legal.get(msg.topic)
        if ok is None:
            ok = legal[msg.topic] = illegal_topic(msg.topic) is None
        if not ok:
            continue
        code = codec.dispatch_tags_code(msg.topic, msg.properties, msg.store_timestamp)
        queues.setdefault((msg.topic, msg.queue_id), []).append(
            _Placed(msg.commit_log_offset, msg.size, msg.queue_offset, code))
    placed: dict[tuple[str, int], list[_Placed]] = {}
    gaps: list[dict[str, Any]] = []
    unplaced: list[dict[str, Any]] = []
    for (topic, qid), recs in sorted(queues.items()):
        ordered = _longest_ordered(recs, None if old_unit is None else _kept_by(old_unit, topic, qid))
        chosen: list[_Placed] = []
        for r in ordered:
            before = chosen[-1] if chosen else None
            room = r.phy - (before.phy + before.size if before else 0)
            missing = r.queue_offset - (before.queue_offset + 1 if before else 0)
            if missing * MIN_RECORD_SIZE > room:
                unplaced.append({"topic": topic, "queueId": qid, "queueOffset": r.queue_offset,
                                 "commitLogOffset": r.phy, "reason": f"{missing} record(s) of the queue would have to "
                                 f"lie in the {room} bytes before it"})
                continue
            if before is not None and missing:
                gaps.append({"topic": topic, "queueId": qid, "from": before.queue_offset + 1,
                             "to": r.queue_offset - 1})
            chosen.append(r)
        in_order = {id(r) for r in ordered}
        at = {r.queue_offset: r for r in chosen}
        for r in recs:
            if id(r) not in in_order:  # (those in order but not chosen are reported above)
                other = at.get(r.queue_offset)
                unplaced.append({"topic": topic, "queueId": qid, "queueOffset": r.queue_offset,
                                 "commitLogOffset": r.phy, "reason": (
                                     f"the record at {other.phy} holds that queue offset" if other is not None
                                     else "out of commitlog order with the queue's other records")})
        placed[(topic, qid)] = chosen
    return placed, gaps, unplaced


_BLANK_UNIT = _UNIT.pack(0, 0x7FFFFFFF, 0)


def write_queue(root: str, topic: str, queue_id: int, units: list[_Placed], file_size: int) -> None:
    """Write one queue's files under ``root``: each unit at its queue offset, blank units for gaps and below
    the first (as dispatch pads a queue that starts past 0), zeros after the last; fsynced."""
    if not units:
        return
    d = os.path.join(root, topic, str(queue_id))
    os.makedirs(d, exist_ok=True)
    per_file = file_size // CQ_STORE_UNIT_SIZE
    first_file = units[0].queue_offset // per_file
    i = 0
    for k in range(first_file, units[-1].queue_offset // per_file + 1):
        lo = k * per_file
        buf = bytearray(file_size)
        filled = 0  # units of this file written so far
        while i < len(units) and units[i].queue_offset < lo + per_file:
            u = units[i]
            slot = u.queue_offset - lo
            if slot > filled:
                buf[filled * CQ_STORE_UNIT_SIZE:slot * CQ_STORE_UNIT_SIZE] = _BLANK_UNIT * (slot - filled)
            _UNIT.pack_into(buf, slot * CQ_STORE_UNIT_SIZE, u.phy, u.size, u.tags_code)
            filled = slot + 1
            i += 1
        if i < len(units) and filled < per_file:  # the gap runs on into the next file
            buf[filled * CQ_STORE_UNIT_SIZE:] = _BLANK_UNIT * (per_file - filled)
        with open(os.path.join(d, f"{lo * CQ_STORE_UNIT_SIZE:020d}"), "wb") as fh:
            fh.write(buf)
            fh.flush()
            os.fsync(fh.fileno())
    fsync_dir(d)
    fsync_dir(os.path.dirname(d))
