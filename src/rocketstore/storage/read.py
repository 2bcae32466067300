"""StoreReader: the read half of the store (get, look, query, time lookup, walks) over StoreFiles and the tier.

RocketMQ's ``DefaultMessageStore.getMessage`` / ``queryMessage`` / ``lookMessageByOffset``: a unit of a
consume queue is a pointer into the commitlog, checked against the record it names (the trusted-record
check) before a message is returned; a unit whose record is gone from the local disk is read from the tier
(``files.tier``, duck-typed: the tier layer sits above this one).  ``MessageStore`` delegates its reads here.
"""

from __future__ import annotations

import logging
import os
from itertools import islice
from typing import Any, Iterator

from ..config import total_memory_bytes
from ..errors import CorruptRecordError, StoreClosedError, StoreError
from ..errors import TierError
from ..format import codec
from ..format.codec import MessageExt
from ..format.message import GetMessageResult, GetMessageStatus, QueryMessageResult, parse_tag_filter
from .consume_queue import CQ_STORE_UNIT_SIZE, LOWER, ConsumeQueue
from .files import InFiles, StoreFiles

log = logging.getLogger(__name__)


# How far a get walks the commitlog for the record of a unit whose offset was damaged (see
# MessageStore._misplaced_unit_record): a few RocketMQ maximum-size messages.
MISPLACED_SEARCH_BYTES = 16 << 20


BLANK_UNIT_SIZE = 0x7FFFFFFF  # the size of a blank consume-queue unit (PRE_BLANK_UNIT): it names no record


BLANK_LOOK_BACK = 65536  # units a get looks back over for the last one before a blank unit that names a record


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


def _next_naming_unit(cq: ConsumeQueue, index: int) -> tuple[int, int | None]:
    """(queue offset, commitlog offset) of the first unit after ``index`` that names a record (blank units
    stepped over, at most BLANK_LOOK_BACK of them), or (-1, None)."""
    hi = min(cq.max_offset_in_queue, index + 1 + BLANK_LOOK_BACK)
    for i in range(index + 1, hi):
        try:
            unit = cq.get_unit(i)
        except ValueError:  # a file retention closed meanwhile
            return -1, None
        if unit is None:
            return -1, None
        if unit[0] >= 0 and 0 < unit[1] < BLANK_UNIT_SIZE:
            return i, unit[0]
    return -1, None


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




class StoreReader:
    """Reads over a store's open files; ``MessageStore`` delegates its read methods here."""

    # in StoreFiles (one copy of each open file and table)
    commitlog, config, root, paths, tier, index_service, _cq_table, closed = (InFiles() for _ in range(8))
    lost_queues, clock = InFiles(), InFiles()

    def __init__(self, files: StoreFiles) -> None:
        self.files = files
        self._ram = total_memory_bytes()  # accessMessageInMemoryMaxRatio's base
        # (topic, queue) -> the queue's first record in the commitlog, per local minimum (queue_start)
        self._queue_starts: dict[tuple[str, int], tuple[tuple[int, int | None], tuple[str, int, int]]] = {}

    def min_readable_offset(self) -> int:
        """The first offset a read can reach: the tier's start when a tier holds older segments."""
        return self.commitlog.min_offset_with_tier()

    def max_phy_offset(self) -> int:
        return self.files.max_phy_offset()

    def min_offset_in_queue(self, topic: str, queue_id: int) -> int:
        if self.lost_queues and (topic, queue_id) in self.lost_queues:
            raise self._lost_queue_error(topic, queue_id)
        cq = self._cq_table.get((topic, queue_id))
        if cq is not None and cq.blank_min is not None:
            self.settle_queue_min(cq)
        lo = cq.min_offset_in_queue if cq else 0
        return self.queue_min_with_tier(topic, queue_id, lo) if self.tier is not None else lo

    def max_offset_in_queue(self, topic: str, queue_id: int) -> int:
        if self.lost_queues and (topic, queue_id) in self.lost_queues:
            raise self._lost_queue_error(topic, queue_id)
        cq = self._cq_table.get((topic, queue_id))
        return cq.max_offset_in_queue if cq else 0

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
        if self.lost_queues and (topic, queue_id) in self.lost_queues:
            raise self._lost_queue_error(topic, queue_id)
        cq = self._cq_table.get((topic, queue_id))
        if cq is None:
            return GetMessageResult(GetMessageStatus.NO_MESSAGE_IN_QUEUE, 0, 0, 0)
        if cq.blank_min is not None:
            self.settle_queue_min(cq)
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
                            msg, damage = self._gone_unit_record(cq, f, idx - 1, phy, size, read_body, topic,
                                                                 topic_bytes, queue_id)
                            if msg is None and damage is None:
                                if not n:
                                    status = GetMessageStatus.MESSAGE_WAS_REMOVING
                                continue
                            if msg is not None and n and total + msg.size > byte_cap:  # (the cap test above
                                idx -= 1                                                # could not know its size)
                                full = True
                                break
                        elif seg is None and self.commitlog.in_tier(phy):  # uploaded, and gone from local disk
                            msg = self._tier_unit(phy, size, read_body, topic, topic_bytes, queue_id, idx - 1)
                        elif seg is None and self.tier is not None and self.tier.fault is not None and \
                                phy < self.tier.deleted_end:  # deleted on the tier's word; no manifest to trust
                            if n:
                                idx -= 1
                                full = True
                                break
                            raise TierError(f"{topic}-{queue_id} offset {idx - 1}: its record at commitlog offset "
                                            f"{phy} was moved to the tier, but {self.tier.fault}")
                        elif seg is None and phy < self.commitlog.min_offset():  # expired, unless the unit is damaged
                            msg, damage = self._gone_unit_record(cq, f, idx - 1, phy, size, read_body, topic,
                                                                 topic_bytes, queue_id)
                            if msg is None and damage is None:
                                if not n:
                                    status = GetMessageStatus.MESSAGE_WAS_REMOVING
                                if phy >= 0:
                                    skip_file_start = phy - phy % self.commitlog.file_size
                                    skip_file_end = skip_file_start + self.commitlog.file_size
                                continue
                            if msg is not None and n and total + msg.size > byte_cap:
                                idx -= 1
                                full = True
                                break
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

    def _gone_unit_record(self, cq: ConsumeQueue, cq_file: Any, index: int, phy: int, size: int, read_body: bool,
                          topic: str, topic_bytes: bytes, queue_id: int
                          ) -> tuple[MessageExt | None, CorruptRecordError | None]:
        """What a get makes of unit ``index`` when it names no record the store holds: a blank unit (0,
        2147483647), or one pointing below the local commitlog (and not into the tier).  (its record, None)
        when the record is found after all, (None, None) when retention removed it, else (None, the error
        naming the damage).

        Blank units stand for records that are gone: before a queue's first
        message, or written by a rebuild for queue offsets no record was found
        for; a unit pointing below the commitlog's minimum names an expired
        record.  But a unit can be damaged into either shape.  Records are in
        commitlog order, so this unit's record lay between the records of the
        units around it that name one: when the next one's lies below the
        lowest readable offset, it is gone; when the previous one's ends inside
        the store, it must be there; in between it is looked for by a walk of
        the trusted records from the local minimum: the queue's first record
        there tells whether this one lay below it (removed) or not.
        """
        floor = self.min_readable_offset()
        local_min = self.commitlog.min_offset()
        prev_end = 0  # no unit before it names a record: its record lay anywhere from the log's start
        for i in range(index - 1, max(cq.min_offset_in_queue, index - BLANK_LOOK_BACK) - 1, -1):
            unit = cq.get_unit(i)
            if unit is None:
                break
            if unit[0] >= 0 and 0 < unit[1] < BLANK_UNIT_SIZE:
                prev_end = unit[0] + unit[1]
                break
        next_index, next_start = _next_naming_unit(cq, index)
        if next_start is not None and prev_end <= next_start <= floor:
            return None, None  # it lay before a record retention removed
        blank = size == BLANK_UNIT_SIZE
        if prev_end >= local_min:  # it lay after a record the store holds: it must be there
            msg = self._misplaced_unit_record(cq, index, phy, size, read_body, topic, topic_bytes, queue_id,
                                              after=prev_end)
            if msg is not None:
                return msg, None
            what = "it is a blank unit" if blank else "that lies below the commitlog's minimum"
            return None, _lost_unit(cq, cq_file, topic, queue_id, index, phy, size,
                                    f"{what}, yet its record lay at or after commitlog offset {prev_end}, which the "
                                    f"store still holds (lowest readable offset {floor}): a lost unit, not "
                                    "retention")
        if floor < local_min:  # the tier holds [floor, local_min): its own unit says where the record is
            msg, expired = self._tier_queue_record(topic, topic_bytes, queue_id, index, read_body)
            if msg is not None:
                return msg, None
            if expired:
                return None, None
        verdict, at, first = self.queue_start(topic, queue_id, local_min)
        if verdict == "found" and next_start is not None and (at > next_start or first > next_index):
            verdict = "damaged"  # the queue's "first" record contradicts the next unit: one of them is damaged
        if verdict == "found" and index >= first:  # it lay after the queue's first record the store holds
            if index > first:
                verdict, at, qoff = self._queue_record_from(at, topic_bytes, queue_id, index)
                if verdict == "found" and qoff > index:
                    verdict = "after"
            if verdict == "found":
                msg = self._decode_at(at, read_body, topic, topic_bytes, queue_id, index)
                if msg is not None:
                    return msg, None
                verdict = "damaged"
            elif verdict != "damaged" and verdict != "far":
                verdict = "lost"
        elif verdict in ("found", "end") and floor == local_min:
            return None, None  # the queue's records in the commitlog start past it: it lay below the minimum
        why = {"found": f"the tier does not hold it and the queue's first record from the local minimum {local_min} "
                        f"(at {at}) comes after it",
               "end": f"no record of the queue follows the local minimum {local_min} and the tier does not hold it",
               "lost": f"its record is not among the queue's records after its first one (at {at})",
               "damaged": f"the walk of the commitlog looking for its record met a damaged record at {at}",
               "far": f"its record was not found within {MISPLACED_SEARCH_BYTES} bytes of the walk's start"}[verdict]
        what = "it is a blank unit" if blank else "that lies below the commitlog's minimum"
        return None, _lost_unit(cq, cq_file, topic, queue_id, index, phy, size,
                                f"{what} and {why}: a lost unit or damage, not known to be retention")

    def _lost_queue_error(self, topic: str, queue_id: int) -> CorruptRecordError:
        d = os.path.join(self.paths.consumequeue, topic, str(queue_id))
        return CorruptRecordError(f"{d}: consume queue {topic}/{queue_id} is in the queue registry but its directory "
                                  "is gone (a lost consume queue, not an empty one); a writable open (rocketstore "
                                  "recover) rebuilds it from the commitlog", path=d)

    def settle_queue_min(self, cq: ConsumeQueue) -> None:
        """Move a queue's minimum past the blank units it rests on whose records retention removed.

        ConsumeQueue.correct_min_offset leaves the minimum on a blank unit it
        cannot judge (no unit before it in the file names an expired record,
        or the one that does ends before the minimum while the next one's
        record is kept): before a queue's first message, or a unit lost or
        damaged whose record may be intact.  The queue's first record in the
        commitlog (:meth:`queue_start`) decides: blank units below its queue
        offset lay below the minimum.  Any doubt (a tier below the local
        segments, a damaged record on the way) keeps the minimum where it is,
        so that reads of those units decide, naming any damage.
        """
        blank = cq.blank_min
        cq.blank_min = None
        if blank is None or self.min_readable_offset() != self.commitlog.min_offset():
            return
        at, naming = blank
        verdict, _phy, first = self.queue_start(cq.topic, cq.queue_id)
        if verdict != "found" or first <= at or (naming is not None and first > naming):
            return  # (past the next unit naming a record: that record's queue offset is damaged)
        target = first if naming is None or first < naming else naming
        if target * CQ_STORE_UNIT_SIZE > cq.min_logic_offset:
            log.info("%s-%d: units %d..%d are blank and the queue's first record in the commitlog is at queue "
                     "offset %d: its minimum moves to %d", cq.topic, cq.queue_id, at, target - 1, first, target)
            cq.min_logic_offset = target * CQ_STORE_UNIT_SIZE

    def queue_start(self, topic: str, queue_id: int, local_min: int | None = None) -> tuple[str, int, int]:
        """(verdict, commitlog offset, queue offset) of the queue's first trusted record at or after the local
        commitlog minimum, from a walk of the records there (see :meth:`_queue_record_from`), kept until the
        minimum moves (or, when none was found, the log grows): the truth a blank unit at a queue's start, or
        one after its last expired unit, is judged by."""
        if local_min is None:
            local_min = self.commitlog.min_offset()
        key = (topic, queue_id)
        stamp = (local_min, None)
        hit = self._queue_starts.get(key)
        if hit is not None and hit[0] in (stamp, (local_min, self.commitlog.max_offset())):
            return hit[1]
        try:
            topic_bytes = topic.encode("utf-8")
        except UnicodeEncodeError:
            return "end", local_min, 0
        found = self._queue_record_from(local_min, topic_bytes, queue_id, 0)
        if found[0] != "found":
            stamp = (local_min, self.commitlog.max_offset())
        self._queue_starts[key] = (stamp, found)
        return found

    def _decode_at(self, phy: int, read_body: bool, topic: str, topic_bytes: bytes, queue_id: int, index: int
                   ) -> MessageExt | None:
        seg = self.commitlog.queue.find(phy)
        if seg is None or not seg.hold():
            return None
        try:
            pos = phy - seg.file_from_offset
            size = codec.read_total_size(seg.mm, pos)
            if size <= 0 or pos + size > seg.wrote_position:
                return None
            return codec.decode_unit(seg.mm, pos, size, read_body, topic, topic_bytes, queue_id, index)
        finally:
            seg.release()

    def _tier_queue_record(self, topic: str, topic_bytes: bytes, queue_id: int, index: int, read_body: bool
                           ) -> tuple[MessageExt | None, bool]:
        """(the record the tier's own unit ``index`` of the queue names, or None; whether the tier's queue
        starts past ``index``, so that the record was removed from the tier too)."""
        t = self.tier
        if t is None or t.fault is not None or t.reader is None or t.manifest is None:
            return None, False
        rng = t.manifest.queue_range(topic, queue_id)
        if rng is None:
            return None, False
        if index < rng[0]:
            return None, True
        if index >= rng[1]:
            return None, False
        try:
            units = t.reader.units(topic, queue_id, index, 1)
            if not units or not 0 < units[0][1] < BLANK_UNIT_SIZE:
                return None, False
            phy, size, _ = units[0]
            if self.commitlog.in_tier(phy):
                return self._tier_unit(phy, size, read_body, topic, topic_bytes, queue_id, index), False
            return self.local_unit_record(phy, size, read_body, topic, topic_bytes, queue_id, index), False
        except StoreError:
            return None, False

    def _queue_record_from(self, start: int, topic_bytes: bytes, queue_id: int, index: int
                           ) -> tuple[str, int, int]:
        """Walk the trusted records from commitlog offset ``start`` (where a record or a segment begins) to the
        first of the queue whose queue offset is ``index`` or more.

        ("found", its offset, its queue offset); ("end", the log's end, -1)
        when the log ends first; ("damaged", offset, -1) at a record that fails
        its checks, or zeros inside the written records; ("far", offset, -1)
        past MISPLACED_SEARCH_BYTES.
        """
        cl = self.commitlog
        end, stop, off = cl.max_offset(), start + MISPLACED_SEARCH_BYTES, start
        while off < end:
            if off >= stop:
                return "far", off, -1
            seg = cl.queue.find(off)
            if seg is None or not seg.hold():
                return "damaged", off, -1
            try:
                base, mm = seg.file_from_offset, seg.mm
                nxt = off
                for pos, rsize, parsed, _problem in codec.walk(mm, off - base, seg.wrote_position, check_crc=False,
                                                               parsed=True, base=base):
                    if parsed is None:
                        if rsize == 0:  # the blank record that ends a segment
                            nxt = seg.end_offset
                            break
                        return "damaged", base + pos, -1
                    nxt = base + pos + rsize
                    h, tp, tl, _ = parsed
                    if h[3] == queue_id and h[5] >= index and h[7] & codec.TRANSACTION_MASK in codec.QUEUED_TXN and \
                            mm[tp:tp + tl] == topic_bytes:
                        return "found", base + pos, h[5]
                    if nxt >= stop:
                        return "far", nxt, -1
                else:
                    if nxt < min(seg.end_offset, end):  # zeros inside the written records: cannot see past them
                        return "damaged", nxt, -1
            finally:
                seg.release()
            if nxt <= off:
                return "damaged", off, -1
            off = nxt
        return "end", end, -1

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
                if self.commitlog.in_tier(phy):
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
                if self.commitlog.in_tier(off):  # uploaded and gone from local disk
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
                claim = self.files.queue_claiming(off, m.topic, m.queue_id, m.queue_offset, m.sys_flag)
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
        if self.commitlog.in_tier(offset):  # damage in a segment only the tier holds: resync there
            after = self.tier.reader.next_record_after(offset, check_crc=check_crc)
            if queue.files and after >= self.commitlog.min_offset():
                return self.commitlog.min_offset()
            return after if after < self.tier.manifest.end_offset else None
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
